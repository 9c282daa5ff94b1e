"""Packs for a paged-attention engine (vLLM): which pack a prompt gets, and how many of its tokens, in whole blocks.

An engine with a paged KV cache prefills a prompt it is sent; a pack can only save that prefill for the prompt's first
tokens, in whole cache blocks, and only for the blocks where the prompt's tokens are the pack's exactly (any agreeing
prefix: causal K/V of a prefix depends on nothing after it, so a pack serves a prompt that extends it, or extends a
part of it, as a composition or an erratum does). This module decides that
without the engine: ``PackMatcher.plan`` names the pack (asked for by ref, or found by ``PrefixIndex`` from the prompt's
first tokens), checks its identities against the served model and whose arithmetic it is (``arithmetic``: approximate
K/V only in a request salted for it), and never raises: a pack that cannot apply gets a plan with the reason, which the
engine reports with the answer.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from packstore.answering.arithmetic import ENGINE, EngineArithmetic, arithmetic_of, preference, salt_refusal
from packstore.answering.pack_headers import HeaderNeeded, PackHeaders
from packstore.answering.transfer_params import transfer_fields
from packstore.errors import PackNotFound, PackstoreError, Untrusted
from packstore.format.header import DTYPE_SIZES, PackHeader, pack_key
from packstore.kv.render import common_prefix_length
from packstore.security.trust import TrustedKeys
from packstore.store.namespaces import DEFAULT_NAMESPACE
from packstore.store.protocol import PackStore
from packstore.store.records import StoredPack

log = logging.getLogger("packstore.paged")

_TOKEN_BYTES = 4  # token ids hash as little-endian uint32, as pack keys do


@dataclass(frozen=True)
class ServedModel:
    """What the engine serves, as packs are checked against it: identities, dtype, cache shape and block size."""

    model_fp: str
    template_fp: str
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    engine_version: str | None = None  # the serving engine's version (vLLM's), None where unknown
    preamble_tokens: int = 0  # the template's framing every pack begins with (``render.preamble_tokens``): not a match
    engine_name: str = "vllm"

    @property
    def arithmetic(self) -> EngineArithmetic:
        """The engine's own arithmetic, as headers of packs it built record it."""
        return EngineArithmetic(self.engine_name, self.engine_version, self.block_size, self.dtype)

    @property
    def engine(self) -> dict[str, Any]:
        """The engine as the header and key of a pack it computed record it (``PackHeader.engine``)."""
        return {"name": self.engine_name, "version": self.engine_version, "block_size": self.block_size}

    @property
    def token_bytes(self) -> int:
        """The bytes of one token's K/V in the served model: layers x 2 x kv heads x head dim x element size."""
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    def identity(self) -> dict[str, Any]:
        """Who the engine is, as a client outside it needs to know to compute the keys of packs it builds or to check
        that it talks to the engine it expects (``kv_transfer_params: {"identity": true}``)."""
        return {
            "model_fp": self.model_fp, "template_fp": self.template_fp, "dtype": self.dtype, "layers": self.layers,
            "kv_heads": self.kv_heads, "head_dim": self.head_dim, "engine": self.engine,
        }


@dataclass
class PackPlan:
    """The decision for one request: the pack and the block-aligned tokens to load, or why none applies.

    ``tokens`` counts the prompt's first tokens whose K/V the pack supplies (whole blocks of ``prompt[:-1]``);
    ``loaded`` how many of them were written from the pack (the rest were already in the engine's prefix cache)."""

    ref: Any = None  # what the request named: a key or name, a chain of them (a list), or {"facts": [...]}
    key: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    pack_tokens: int = 0
    tokens: int = 0
    pack_sha256: str | None = None
    mode: str = "none"  # "explicit" (kv_transfer_params.pack), "automatic" (the prompt's first tokens), "none"
    arithmetic: str | None = None  # whose K/V the pack is (packstore.answering.arithmetic), once its header is read
    reason: str | None = None
    loaded: int = 0
    offered: int = 0  # the tokens last offered to the engine (beyond its prefix cache's), of which it took ``loaded``
    background: bool = False  # offered to be loaded beside the forward passes (the pack is not in the worker's memory)
    failure: str | None = None  # set when loading failed and the engine recomputed the blocks, or it took none
    identity: dict[str, Any] | None = None  # the engine's identity, where the request asked for it
    save_key: str | None = None  # the key a save request's pack is stored under (being stored, or there already)
    save_reason: str | None = None  # why a save request stores nothing (or that its pack is there already)
    # A pack named by its facts or as a chain: the facts, their token ids as the served template renders them, and the
    # keys of the stored packs of exactly those tokens (this engine's build, packstore's); what a save request needs
    facts: tuple[str, ...] | None = None
    rendering: tuple[int, ...] | None = None
    stored: tuple[str, ...] = ()

    @property
    def applies(self) -> bool:
        return self.key is not None and self.reason is None and self.tokens > 0

    @property
    def reported(self) -> bool:
        """Whether the answer carries a report: a pack was named or matched, something could not be read, or the
        request asked who the engine is."""
        return self.mode != "none" or self.reason is not None or self.identity is not None or self.save_reason is not None

    def report(self) -> dict[str, Any]:
        """What comes back with the answer (vLLM: the response's ``kv_transfer_params``)."""
        found: dict[str, Any] = {"pack_applied": self.applies and self.failure is None, "pack_mode": self.mode}
        if self.ref is not None:
            found["pack"] = self.ref
        if self.key is not None:
            found["pack_key"] = self.key
            found["pack_tokens"] = self.pack_tokens
        if self.arithmetic is not None:
            found["pack_arithmetic"] = self.arithmetic
        if self.applies and self.failure is None:
            found["pack_tokens_used"] = self.tokens
            found["pack_tokens_loaded"] = self.loaded
            found["pack_parts"] = [{"key": self.key, "tokens": self.tokens}]
        reason = self.failure or self.reason
        if reason is not None:
            found["reason"] = reason
        if self.identity is not None:
            found["identity"] = self.identity
        if self.save_key is not None:
            found["pack_saved"] = self.save_key
        if self.save_reason is not None:
            found["pack_save_reason"] = self.save_reason
        return found


def aligned_tokens(pack_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """The pack tokens an engine can take from a pack: whole blocks of ``prompt[:-1]`` (one token is always computed)."""
    return (min(pack_tokens, prompt_tokens - 1) // block_size) * block_size


def block_chain(token_ids: Sequence[int], block_size: int, blocks: int) -> list[bytes]:
    """Digests of the first 1..``blocks`` whole blocks of ``token_ids``, each chained on the one before."""
    chain, digest = [], b""
    for block in range(blocks):
        part = token_ids[block * block_size : (block + 1) * block_size]
        digest = hashlib.blake2b(digest + b"".join(int(t).to_bytes(_TOKEN_BYTES, "little") for t in part), digest_size=16).digest()
        chain.append(digest)
    return chain


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> list[int]:
    """The paged-cache slots of positions [start, stop) of a request whose blocks are ``block_ids``, in order."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def blocks_of(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> set[int]:
    """The block ids holding positions [start, stop)."""
    return {block_ids[p // block_size] for p in range(start, stop)}


class PrefixIndex:
    """Packs by their token ids at block boundaries: a prompt that agrees with a pack's first blocks finds it.

    Each pack is filed under the digest chain of every one of its whole blocks, with its arithmetic; ``matches`` walks
    the prompt's chain and returns, for each pack, its deepest run of whole blocks that agrees with the prompt (the
    last prompt token is always computed), best first (``arithmetic.preference``: the most tokens, then this engine's
    arithmetic, another's exact, approximate; then by key). A pack's first blocks are exact K/V of those tokens alone
    (causal attention), so a composition or an erratum that extends a pack still gets the pack's agreeing blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_chain: dict[bytes, list[tuple[str, tuple[int, ...], str]]] = {}
        self.packs = 0

    def add(self, key: str, token_ids: Sequence[int], arithmetic: str = ENGINE) -> None:
        """File pack ``key``; packs shorter than one block are not filed (they save no whole block)."""
        blocks = len(token_ids) // self.block_size
        if blocks == 0:
            return
        filed = (key, tuple(token_ids), arithmetic)
        for digest in block_chain(token_ids, self.block_size, blocks):
            self._by_chain.setdefault(digest, []).append(filed)
        self.packs += 1

    def matches(self, prompt: Sequence[int], *, beyond: int = 0) -> list[tuple[str, int, str]]:
        """(key, agreeing tokens, arithmetic) of every filed pack whose first whole blocks agree with ``prompt[:-1]``
        for more than ``beyond`` tokens (the template's preamble, which every pack shares), each at its deepest
        agreeing block, best first."""
        deepest: dict[str, tuple[int, str]] = {}
        for depth, digest in enumerate(block_chain(prompt, self.block_size, (len(prompt) - 1) // self.block_size), start=1):
            tokens = depth * self.block_size
            for key, ids, arithmetic in self._by_chain.get(digest, ()):
                if tuple(prompt[:tokens]) == ids[:tokens]:
                    deepest[key] = (tokens, arithmetic)
        found = [(key, tokens, arithmetic) for key, (tokens, arithmetic) in deepest.items() if tokens > beyond]
        return sorted(found, key=lambda item: preference(item[2], item[1], item[0]))


def _rendered(plan: PackPlan, facts: Sequence[str], ids: Sequence[int] | None, stored: Sequence[PackHeader]) -> PackPlan:
    """``plan`` with the facts its request named, their rendering (None where this connector cannot render facts) and
    the stored packs of that rendering."""
    plan.facts, plan.stored = tuple(facts), tuple(header.key for header in stored)
    plan.rendering = tuple(ids) if ids is not None else None
    return plan


def _refusal(header: PackHeader, served: ServedModel) -> str | None:
    """Why a pack cannot be loaded into the served model's cache, or None."""
    if header.kind != "knowledge":
        return f"pack {header.key[-12:]} is a {header.kind} pack, not a knowledge pack"
    if header.soft_tokens or header.composition == "naive":
        return f"pack {header.key[-12:]} is a {header.composition} composition, whose cache positions are not its tokens'"
    if header.template_fp != served.template_fp:
        return (
            f"template mismatch: pack built with template_fp {header.template_fp[:12]}, the served tokenizer has "
            f"template_fp {served.template_fp[:12]}"
        )
    if header.model_fp != served.model_fp:
        if header.dtype != served.dtype:
            return f"dtype mismatch: pack built in {header.dtype}, the engine serves the model in {served.dtype}"
        return (
            f"model mismatch: pack built for model {header.model_name!r} (model_fp {header.model_fp[:12]}), the engine "
            f"serves model_fp {served.model_fp[:12]}"
        )
    shape = (header.layers, header.kv_heads, header.head_dim)
    if shape != (served.layers, served.kv_heads, served.head_dim):
        cache = (served.layers, served.kv_heads, served.head_dim)
        return f"shape mismatch: pack has (layers, kv heads, head dim) {shape}, the engine's cache {cache}"
    return None


def _agreement_problem(header: PackHeader, prompt: Sequence[int], served: ServedModel) -> str | None:
    """Why the pack's whole blocks that agree with ``prompt[:-1]`` reach none of its facts (past the template's
    preamble, which every pack shares), or None."""
    agreed = common_prefix_length(header.token_ids, prompt)
    if aligned_tokens(agreed, len(prompt), served.block_size) > (0 if header.raw else served.preamble_tokens):
        return None
    if agreed < min(header.tokens, len(prompt)):
        mine, theirs = header.token_ids[agreed], prompt[agreed]
        return (
            f"the prompt's tokens differ from the pack's at position {agreed} (pack {mine}, prompt {theirs}), before a "
            f"whole cache block of {served.block_size} tokens reaches its facts: render the prompt with packctl render"
        )
    return f"the pack's {header.tokens} tokens fill no whole cache block of {served.block_size} tokens before the prompt's last token"


@dataclass(frozen=True)
class _Ask:
    """What a request brings besides its prompt and kv_transfer_params: its cache_salt, and why the engine cannot take
    a pack into it at all (or None); and whether its plan may read the store (else ``HeaderNeeded``)."""

    cache_salt: object
    refusal: str | None
    lookup: bool = True


PACK_FIELD = (
    'kv_transfer_params.pack must be a pack key or name (a string), a chain of them (a list of strings), or '
    '{"facts": [...]} (a list of non-empty strings)'
)
COUNTERS = (
    "packs_applied", "packs_not_applied", "pack_load_failures", "pack_tokens_loaded", "packs_untrusted_skipped", "packs_saved",
    "pack_save_failures",
)


@dataclass
class MatcherCounters:
    """How requests fared since the start (``COUNTERS``): what the connector logs and reports to vLLM's metrics.
    A request is counted once it finished (``count``), so a pack whose load failed is not counted as applied."""

    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    _reported: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def add(self, name: str, amount: int = 1) -> None:
        self.totals[name] += amount

    def count(self, plan: PackPlan) -> None:
        """Count a finished request's plan: applied (with the tokens written from the pack), or not and why."""
        if plan.applies and plan.failure is None:
            self.add("packs_applied")
            self.add("pack_tokens_loaded", plan.loaded)
        elif plan.reason is not None or plan.failure is not None:
            self.add("packs_not_applied")

    def take(self) -> dict[str, int]:
        """What was counted since the last ``take`` (vLLM collects connector stats as increments)."""
        increments = {name: self.totals[name] - self._reported[name] for name in COUNTERS}
        self._reported = dict(self.totals)
        return increments


class PackMatcher:
    """Plans each request against packs in ``stores(namespace)``: explicit refs, and (``automatic``) the prompt's first
    tokens through a ``PrefixIndex`` of each namespace, rebuilt in the background every ``refresh_s`` seconds. Headers
    come from memory (``PackHeaders``: a name is resolved again after ``refresh_s`` seconds, a key's header is read once).

    ``namespaces``: the namespaces a request may name (``kv_transfer_params.namespace``); the first is the default.
    ``other_exact``: whether exact packs of another engine's arithmetic load unsalted (``arithmetic.OTHER_EXACT_POLICIES``).
    With ``trusted`` keys, a pack no trusted key signed is left out of the automatic index alone (counted, logged once).
    ``pack_ids``: the token ids of the pack of some facts as the served template renders them (``render.pack_prefix_ids``
    with the engine's tokenizer), so that a request can name a chain's stored composition, or a pack by its facts."""

    def __init__(
        self,
        stores: Callable[[str], PackStore],
        served: ServedModel,
        *,
        namespaces: Sequence[str] = (DEFAULT_NAMESPACE,),
        automatic: bool = True,
        trusted: TrustedKeys | None = None,
        refresh_s: float = 10.0,
        other_exact: str = "unsalted",
        pack_ids: Callable[[Sequence[str]], list[int]] | None = None,
    ) -> None:
        self.stores, self.served, self.namespaces, self.pack_ids = stores, served, tuple(namespaces), pack_ids
        self.automatic, self.trusted, self.refresh_s, self.other_exact = automatic, trusted, refresh_s, other_exact
        self.counters = MatcherCounters()
        self._untrusted: set[tuple[str, str]] = set()  # (namespace, key) of packs left out of the index, logged once
        self.headers = PackHeaders(self._stat, ttl=refresh_s)
        self._indexes: dict[str, PrefixIndex] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def start(self) -> None:
        """Build every namespace's prefix index now, then keep them fresh in a daemon thread (automatic mode only)."""
        if not self.automatic:
            return
        self.refresh()
        self._refresher = threading.Thread(target=self._refresh_forever, name="packstore-prefix-index", daemon=True)
        self._refresher.start()

    def close(self) -> None:
        self._stop.set()

    def _refresh_forever(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def refresh(self) -> None:
        """Rebuild each namespace's index from its store's packs for the served model and template; a store that
        cannot be read keeps its last index (logged)."""
        for namespace in self.namespaces:
            try:
                index = self._build_index(namespace)
            except (PackstoreError, OSError) as exc:
                log.warning("packstore: cannot index the packs of namespace %r: %s", namespace, exc)
                continue
            with self._lock:
                self._indexes[namespace] = index

    def _build_index(self, namespace: str) -> PrefixIndex:
        index = PrefixIndex(self.served.block_size)
        store = self.stores(namespace)
        for summary in store.list(model_fp=self.served.model_fp, template_fp=self.served.template_fp):
            if summary.kind != "knowledge" or summary.tokens < self.served.block_size:
                continue
            try:
                header = self.headers.get(namespace, summary.key)
            except Untrusted as exc:
                self._skip_untrusted(namespace, summary.key, exc)
                continue
            if _refusal(header, self.served) is None:
                index.add(header.key, header.token_ids, arithmetic_of(header, self.served.arithmetic))
        return index

    def _skip_untrusted(self, namespace: str, key: str, exc: Untrusted) -> None:
        """Leave an unsigned pack out of the index: counted and logged the first time it is seen."""
        if (namespace, key) not in self._untrusted:
            self._untrusted.add((namespace, key))
            self.counters.add("packs_untrusted_skipped")
            log.warning("packstore: pack %s of namespace %r left out of the automatic index: %s", key[-12:], namespace, exc)

    def _stat(self, namespace: str, ref: str) -> StoredPack:
        """The stored pack ``ref`` names in ``namespace``, its signatures checked when keys are trusted."""
        store = self.stores(namespace)
        try:
            stored = store.stat(ref, model_fp=self.served.model_fp)
        except PackNotFound:  # a name of another model's pack: read it anyway, so the refusal can say what differs
            stored = store.stat(ref)
        if self.trusted is not None:
            self.trusted.require(f"pack {stored.key}", "pack", stored.header.pack_sha256, stored.signatures)
        return stored

    def plan(self, prompt: Sequence[int], params: object, *, cache_salt: object = None, refusal: str | None = None) -> PackPlan:
        """The pack for a prompt and its ``kv_transfer_params`` (any JSON), in a request with ``cache_salt`` that the
        engine cannot take a pack into for ``refusal`` (``transfer_params.engine_refusal``; said only where a pack
        would apply); never raises (a plan with a reason instead). Counted by the caller once the request finished."""
        return self.logged(self.decide(prompt, params, cache_salt=cache_salt, refusal=refusal))

    def decide(
        self, prompt: Sequence[int], params: object, *, cache_salt: object = None, refusal: str | None = None, lookup: bool = True
    ) -> PackPlan:
        """``plan`` without logging it. ``lookup`` False: from memory alone, ``HeaderNeeded`` when a header is not in
        memory (``PlanLookups`` then reads it off the caller's thread); nothing else is raised."""
        try:
            fields, problem = transfer_fields(params)
            if problem:
                return PackPlan(reason=problem)
            wants_identity = fields.get("identity", False)
            if not isinstance(wants_identity, bool):
                return PackPlan(reason="kv_transfer_params.identity must be true or false (a JSON boolean)")
            plan = self._plan(list(prompt), fields, _Ask(cache_salt, refusal, lookup))
            plan.identity = self.served.identity() if wants_identity else None
            return plan
        except HeaderNeeded:
            raise
        except Exception as exc:  # the engine's scheduler must never see an exception from here
            log.exception("packstore: planning a request failed")
            return PackPlan(reason=f"internal error: {type(exc).__name__}: {exc}")

    @staticmethod
    def logged(plan: PackPlan) -> PackPlan:
        """``plan``, its reason logged when it does not apply."""
        if plan.reason is not None:
            log.warning("packstore: pack %s not applied: %s", plan.ref or plan.key or "-", plan.reason)
        return plan

    def _plan(self, prompt: list[int], params: dict[str, Any], ask: _Ask) -> PackPlan:
        namespace = params.get("namespace") or self.namespaces[0]
        ref = params.get("pack")
        if not isinstance(namespace, str) or namespace not in self.namespaces:
            readable = ", ".join(self.namespaces)
            reason = f"namespace {namespace!r} is not one this server's connector reads ({readable})"
            return PackPlan(ref=ref if isinstance(ref, str) else None, reason=reason)
        if ref is False:  # the request opts out: no pack, not even one its first tokens match
            return PackPlan()
        if isinstance(ref, list):
            return self._chain(prompt, ref, namespace, ask)
        if isinstance(ref, dict):
            return self._of_facts(prompt, ref, namespace, ask)
        if ref is not None:
            if not isinstance(ref, str) or not ref:
                return PackPlan(mode="explicit", reason=PACK_FIELD)
            return self._explicit(prompt, ref, namespace, ask)
        if not self.automatic:
            return PackPlan()
        with self._lock:
            index = self._indexes.get(namespace)
        found = index.matches(prompt, beyond=self.served.preamble_tokens) if index is not None else []
        if not found:
            return PackPlan()
        allowed = [match for match in found if salt_refusal(match[2], match[0], ask.cache_salt, self.other_exact) is None]
        key = (allowed or found)[0][0]  # none allowed: the best says why it did not load
        header = self.headers.get(namespace, key, lookup=ask.lookup)
        return self._checked(PackPlan(key=key, namespace=namespace, mode="automatic"), header, prompt, ask)

    def _explicit(self, prompt: list[int], ref: str, namespace: str, ask: _Ask) -> PackPlan:
        plan = PackPlan(ref=ref, namespace=namespace, mode="explicit")
        try:
            header = self.headers.get(namespace, ref, lookup=ask.lookup)
        except PackstoreError as exc:
            plan.reason = f"{type(exc).__name__}: {exc}"
            return plan
        plan.key = header.key
        return self._checked(plan, header, prompt, ask)

    def _chain(self, prompt: list[int], refs: list[Any], namespace: str, ask: _Ask) -> PackPlan:
        """A chain of packs (a base and its errata, or packs composed in order): its stored composition when there is
        one, else the part whose agreeing blocks reach deepest (the first part's, as a rule); vLLM prefills the rest."""
        if not refs or not all(isinstance(part, str) and part for part in refs):
            return PackPlan(ref=refs, namespace=namespace, mode="explicit", reason=PACK_FIELD)
        parts = []
        for part in refs:
            try:
                parts.append(self.headers.get(namespace, part, lookup=ask.lookup))
            except PackstoreError as exc:
                return PackPlan(ref=refs, namespace=namespace, mode="explicit", reason=f"chain part {part!r}: {type(exc).__name__}: {exc}")
        facts = [fact for header in parts for fact in header.facts]
        ids = self.pack_ids(facts) if self.pack_ids is not None else None
        stored = self._stored_of(ids, namespace, ask) if ids is not None else []
        return _rendered(self._deepest(refs, [*stored, *parts], namespace, prompt, ask), facts, ids, stored)

    def _of_facts(self, prompt: list[int], ref: dict[str, Any], namespace: str, ask: _Ask) -> PackPlan:
        """The pack of some facts, by the key this engine's build would have, else packstore's own build's."""
        facts = ref.get("facts")
        if set(ref) != {"facts"} or not isinstance(facts, list) or not facts or not all(isinstance(f, str) and f.strip() for f in facts):
            return PackPlan(ref=ref, namespace=namespace, mode="explicit", reason=PACK_FIELD)
        if self.pack_ids is None:
            return PackPlan(ref=ref, namespace=namespace, mode="explicit", reason="this connector cannot render facts: name the pack")
        ids = self.pack_ids(facts)
        stored = self._stored_of(ids, namespace, ask)
        if not stored:
            reason = f"no pack of these {len(facts)} facts is stored for the served model in namespace {namespace!r}"
            return _rendered(PackPlan(ref=ref, namespace=namespace, mode="explicit", reason=reason), facts, ids, stored)
        return _rendered(self._deepest(ref, stored, namespace, prompt, ask), facts, ids, stored)

    def _stored_of(self, ids: Sequence[int], namespace: str, ask: _Ask) -> list[PackHeader]:
        """The stored packs of the token ids ``ids`` (some facts rendered with the served template): this engine's
        build, then packstore's."""
        served, found = self.served, []
        for engine in ((served.engine,) if served.engine_version is not None else ()) + (None,):
            key = pack_key(served.model_fp, served.template_fp, ids, engine=engine)
            try:
                found.append(self.headers.get(namespace, key, lookup=ask.lookup))
            except PackNotFound:
                continue
        return found

    def _deepest(self, ref: Any, headers: Sequence[PackHeader], namespace: str, prompt: Sequence[int], ask: _Ask) -> PackPlan:
        """Of ``headers``, the pack whose agreeing blocks supply the most tokens (then by the preference rule); where
        none applies, the first, with its reason."""
        plans = [self._checked(PackPlan(ref=ref, key=h.key, namespace=namespace, mode="explicit"), h, prompt, ask) for h in headers]
        applying = [plan for plan in plans if plan.applies]
        if not applying:
            return plans[0]
        return min(applying, key=lambda plan: preference(plan.arithmetic or ENGINE, plan.tokens, plan.key or ""))

    def _checked(self, plan: PackPlan, header: PackHeader, prompt: Sequence[int], ask: _Ask) -> PackPlan:
        plan.pack_tokens, plan.pack_sha256 = header.tokens, header.pack_sha256
        plan.arithmetic = arithmetic_of(header, self.served.arithmetic)
        plan.reason = (
            _refusal(header, self.served)
            or _agreement_problem(header, prompt, self.served)
            or ask.refusal
            or salt_refusal(plan.arithmetic, header.key, ask.cache_salt, self.other_exact)
        )
        if plan.reason is None:
            plan.tokens = aligned_tokens(common_prefix_length(header.token_ids, prompt), len(prompt), self.served.block_size)
        return plan

