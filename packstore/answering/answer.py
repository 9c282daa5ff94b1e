"""The one answering path: a model, a store and an LRU of ready packs; refs and/or a bank -> pack -> tokens,
optionally steered by steering packs.

The Python API, ``packctl ask`` and the worker all answer through ``Answerer``, so resolving refs,
identity checks, composing several packs, lazy recompute of a bank's facts, steering, the ready-cache and
the comparison with the facts as prompt text exist once. The store is any ``PackStore`` (local or remote): only its
protocol methods are used.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from packstore.answering.composing import check_composition, compose, composition_key
from packstore.answering.ready_caches import ReadyCache, ReadyPartition, to_host
from packstore.answering.records import AnswerResult
from packstore.bank.bank import BankCache, open_banks
from packstore.bank.rerank import RERANKERS, default_rerank, reranked_route, reranker
from packstore.errors import InvalidInput, PackNotFound, Untrusted
from packstore.format import PackHeader, pack_key, parse_key
from packstore.kv.build import build_pack, clean_facts
from packstore.kv.compose import check_parts, extend
from packstore.kv.device import Cancel, DeviceLock
from packstore.kv.inject import (
    Sampling,
    answer_with_chunked_text,
    answer_with_text,
    cache_aligned_ids,
    cache_from_pack,
    check_identity,
    finish,
    generate_stream,
    prepare,
)
from packstore.kv.models import LoadedModel
from packstore.kv.options import STEER_TARGETS, check_alpha
from packstore.kv.packet import check_adapter
from packstore.kv.render import Turn, pack_prefix_ids, render
from packstore.kv.rope import layer_frequencies
from packstore.kv.steer import Direction, LayerDeltas, SteeredCache, applied_layers, check_steering, key_space_of, steering_deltas
from packstore.packs.reader import PackReader
from packstore.packs.tensors import FETCH_SECONDS, ArrivingPack, Pack, encode_pack, start_copy
from packstore.store.protocol import DEFAULT_TOP_K, PackStore
from packstore.store.records import StoredPack

if TYPE_CHECKING:
    from packstore.packs.decoder import Decoder
    from packstore.security.trust import TrustedKeys

DEFAULT_CACHE_BYTES = 2 << 30
REF_TTL_SECONDS = 5.0  # how long what the store said of a ref is used without asking again (docs/operations.md)
REF_CACHE_ENTRIES = 4096  # refs remembered (a header each, a few KB)


class RefCache:
    """What the store last said a ref names (its StoredPack: key, header, signatures), used for ``ttl`` seconds.

    Within the ttl a ready pack is answered with no store round trip at all; after it, one StatPack asks
    again, so a deleted pack, a moved name or a new signature shows within ``ttl``. Bounded, least recently
    used first out; a lookup that fails is never remembered."""

    def __init__(self, ttl: float = REF_TTL_SECONDS, entries: int = REF_CACHE_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.entries, self.clock = ttl, entries, clock
        self._refs: OrderedDict[str, tuple[StoredPack, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ref: str) -> StoredPack | None:
        """The StoredPack ``ref`` named less than ``ttl`` seconds ago, or None."""
        with self._lock:
            found = self._refs.get(ref)
            if found is None or self.clock() - found[1] >= self.ttl:
                return None
            self._refs.move_to_end(ref)
            return found[0]

    def lookup(self, store: PackStore, ref: str, model_fp: str) -> StoredPack:
        """What ``ref`` names in ``store``: packs of ``model_fp`` first, then any model's (so a refusal can name the
        model); asked of the store at most once per ttl."""
        stored = self.get(ref)
        if stored is None:
            try:
                stored = store.stat(ref, model_fp=model_fp)
            except PackNotFound:
                if (key := parse_key(ref)) is not None and key[0] == model_fp:
                    raise  # a key of this model (a composition not stored, say): no other model's pack has it
                stored = store.stat(ref)
            self.put(ref, stored)
            if stored.key != ref:
                self.put(stored.key, stored)  # the key itself needs no asking again either
        return stored

    def put(self, ref: str, stored: StoredPack) -> None:
        with self._lock:
            self._refs[ref] = (stored, self.clock())
            self._refs.move_to_end(ref)
            while len(self._refs) > self.entries:
                self._refs.popitem(last=False)


def route_bank(
    store: PackStore,
    bank_cache: BankCache,
    bank: str,
    question: str,
    *,
    top_k: int = DEFAULT_TOP_K,
    probe: int | None = None,
    embedder: str | None = None,
    rerank: str = "none",
    rerank_weight: float | None = None,
    trusted: TrustedKeys | None = None,
    lm: LoadedModel | None = None,
) -> list[str]:
    """The facts ``bank`` routes ``question`` to, best first, reranked by ``rerank`` (``lm``: the model ``lm`` scores
    them, so it needs one); InvalidInput when there are none. With ``trusted`` the bank must bear a trusted signature
    over its current digest. The one routing of every answerer (the local model's, and a serving engine's front)."""
    banks = open_banks(store, bank_cache)
    if trusted is not None:
        trusted.require(f"bank {bank!r}", "bank", banks.digest(bank), banks.signatures(bank))
    if rerank == "lm":  # the model's weights score the facts here; every other stage runs where the bank is
        if lm is None:
            raise InvalidInput("rerank 'lm' scores the facts with the model's weights, which this worker does not load", param="rerank")
        second = reranker("lm", lm=(lm.tokenizer, lm.model), weight=rerank_weight)
        routed = reranked_route(banks, bank, [question], embedder, top_k=top_k, probe=probe, reranker=second)[0]
    else:
        routed = banks.route(bank, [question], embedder, top_k=top_k, probe=probe, rerank=rerank, rerank_weight=rerank_weight)[0]
    facts = [text for text, _ in routed.facts]
    if not facts:
        raise InvalidInput(f"bank {bank!r} routed the question to no facts")
    return facts


@dataclass(frozen=True)
class Question:
    """A question and what to answer it with: pack refs (key, name or content-hash prefix), a bank,
    or both, and/or steering packs.

    Several refs are answered with their exact sequential composition, in order, or, with ``mode``
    ``rope``/``naive``/``packet``, with their parts spliced without recompute (``packet``: wrapped in the soft tokens
    of the adapter ``adapter`` names; all three approximate). With a bank the question is routed there (``top_k``,
    ``probe``, ``embedder``: None means the bank's own; ``rerank``, ``rerank_weight``: a second stage over the routed
    facts, ``bank.rerank``) and answered with the pack of its top facts, or, with refs too, with those facts composed
    after the packs. ``compare_rag`` also answers with all the same facts, in order, as prompt text (steered alike):
    in one prefill, and in the pack's recorded prefill passes (``Answerer.stream``). ``steering`` holds (steering ref,
    alpha) pairs whose deltas are summed and added from the question on, on ``steer_layers`` (None: each pack's
    default, the middle third) and to ``steer_on`` (``values``; ``keys`` or ``both`` only as the key-arithmetic
    control). ``history`` holds the conversation's earlier turns, (role, content) pairs rendered between the facts and
    the question (``kv.render``); routing reads the question alone.
    """

    text: str
    refs: tuple[str, ...] = ()
    bank: str | None = None
    top_k: int = DEFAULT_TOP_K
    probe: int | None = None
    embedder: str | None = None
    rerank: str = ""
    rerank_weight: float | None = None
    compare_rag: bool = False
    sampling: Sampling = Sampling()
    steering: tuple[tuple[str, float], ...] = ()
    steer_layers: tuple[int, int] | None = None
    steer_on: str = "values"
    mode: str = "exact"
    adapter: str | None = None
    history: tuple[Turn, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "refs", tuple(self.refs))
        object.__setattr__(self, "history", tuple(tuple(turn) if isinstance(turn, list) else turn for turn in self.history))
        object.__setattr__(self, "bank", self.bank or None)
        object.__setattr__(self, "steering", tuple((ref, check_alpha(alpha, ref)) for ref, alpha in self.steering))
        for ref in self.refs + tuple(ref for ref, _ in self.steering):
            if not isinstance(ref, str) or not ref.strip():
                raise InvalidInput(f"empty pack ref in {[*self.refs, *(ref for ref, _ in self.steering)]!r}")
        if not self.bank and not self.refs and not self.steering:
            raise InvalidInput("nothing to answer with: give a pack, a bank or a steering pack")
        if self.compare_rag and not self.bank and not self.refs:
            raise InvalidInput("comparing with the facts as prompt text needs a pack or a bank")
        object.__setattr__(self, "rerank", self.rerank or (default_rerank() if self.bank else "none"))
        if self.rerank not in RERANKERS:
            raise InvalidInput(f"unknown reranker {self.rerank!r}: use one of {', '.join(RERANKERS)}")
        if self.rerank != "none" and not self.bank:
            raise InvalidInput("reranking reorders a bank's routed facts: give a bank too")
        if self.steer_on not in STEER_TARGETS:
            raise InvalidInput(f"unknown steering target {self.steer_on!r}: use one of {', '.join(STEER_TARGETS)}")
        parts = len(self.refs) + bool(self.bank)
        if parts > 1 or self.mode != "exact" or self.adapter:  # else nothing is composed: one pack (or none) is used as it is
            check_composition(self.mode, self.adapter, parts)
        if self.steer_layers is not None:
            first, last = self.steer_layers
            if not 0 <= first <= last:
                raise InvalidInput(f"invalid layer range {first}-{last}: FIRST-LAST, 0-based, with FIRST <= LAST")


class Answers(Protocol):
    """What answers a namespace's questions as a token stream: ``Answerer`` (the worker's own model) and
    ``engine_answer.EngineAnswerer`` (a serving engine behind the worker)."""

    store_reads: int

    def stream(self, question: Question, cancel: Cancel | None = None) -> Generator[int, None, AnswerResult]: ...


class Answerer:
    """Answers questions on one model with packs from one store, keeping ready packs in an LRU (and, given a host
    cache, the packs it fetched in host memory too: ``ready_caches``).

    Safe to share between threads: lookups and fetches run concurrently, and the device is shared through one fair
    lock (``DeviceLock``, FIFO): generations hold it one decode step at a time, so the generations running now take
    steps in turn (a short answer interleaves with long ones), while other device work (composing, building a
    bank's facts pack, the prefills of ``compare_rag``'s comparisons) holds it for its whole, short, duration. No
    wait for the store happens with the device held: packs are whole before composing takes it, and a generation
    waiting for a layer of a pack still arriving gives it up meanwhile (``kv.inject.cache_from_pack``).
    """

    def __init__(
        self,
        lm: LoadedModel,
        store: PackStore,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        trusted: TrustedKeys | None = None,
        ready: ReadyCache | ReadyPartition | None = None,
        host: ReadyCache | ReadyPartition | None = None,
        device_lock: DeviceLock | None = None,
        ref_ttl: float = REF_TTL_SECONDS,
        decoder: Decoder | None = None,
        bank_cache: BankCache | None = None,
        fetch_seconds: float = FETCH_SECONDS,
    ) -> None:
        """``trusted``: take from the store only packs a trusted key signed (docs/operations.md, "Signed
        packs"); what this Answerer derives from them in memory (compositions, a bank's fact packs) is
        trusted. ``ready`` and ``device_lock`` share an LRU (a partition of it) and the device with other
        Answerers of the same model (a worker's namespaces); by default they are its own. ``host``: the host cache (a
        partition of it) packs are fetched into and copied to the device from, under ``ready`` (whose ``below`` it is);
        None fetches straight to the device, and lets a pack stream in while the model runs (``arriving``). ``ref_ttl``: how long
        what the store said of a ref is used without asking again (``RefCache``; 0 asks every time). ``decoder``
        and ``bank_cache``: the program's chunk decoder and bank cache (this Answerer's own when None).
        ``fetch_seconds``: the longest an answer waits for the next layer of a pack from the store (Unavailable past it)."""
        self.lm = lm
        self.store = store
        self.reader = PackReader(store, decoder)
        self.bank_cache = bank_cache if bank_cache is not None else BankCache()
        self.trusted = trusted
        self.ready = ready if ready is not None else ReadyCache(cache_bytes)
        self.host = host
        self.store_reads = 0  # packs fetched from the store (each read counted once, whole or streamed)
        self._reads_lock = threading.Lock()
        self._device_lock = device_lock if device_lock is not None else DeviceLock()
        self.refs = RefCache(ref_ttl)
        self.fetch_seconds = fetch_seconds

    def lookup(self, ref: str) -> StoredPack:
        """What ``ref`` names (key, header, signatures): this model's packs first, then any model's (so a
        refusal can name the model). Asks the store at most once per ``REF_TTL_SECONDS`` per ref."""
        return self.refs.lookup(self.store, ref, self.lm.model_fp)

    def resolve(self, ref: str) -> str:
        """The key ``ref`` names (see ``lookup``)."""
        return self.lookup(ref).key

    def pack(self, ref: str) -> tuple[Pack, bool]:
        """The ready knowledge pack ``ref`` names, and whether it was already ready.

        A pack of another kind, model or template is refused with PackMismatch before it is fetched
        (and when ready: the ready-cache holds steering packs and adapters too).
        """
        return self._ready(ref, check_identity)

    def steering_pack(self, ref: str) -> Pack:
        """The ready steering pack ``ref`` names; PackMismatch for another kind, model or template."""
        return self._ready(ref, check_steering)[0]

    def adapter_pack(self, ref: str) -> Pack:
        """The ready adapter ``ref`` names; PackMismatch for another kind, model or template."""
        return self._ready(ref, check_adapter)[0]

    def arriving(self, ref: str) -> tuple[Pack | ArrivingPack, bool]:
        """The knowledge pack ``ref`` names as answering takes it, and whether it was ready: the ready pack, or
        one still arriving from the store (``PackStore.start_fetch``) whose first layers the model can run while
        the rest decode (from the host cache when it holds the pack, copied layer by layer; else from the store); it
        becomes ready once whole, and a pack read from the store is copied into the host cache then. Refused as ``pack``
        refuses, before anything is fetched."""
        stored = self.lookup(ref)
        check_identity(self.lm, stored.header)
        key = stored.key
        if (ready := self.ready.peek(key)) is not None:
            return ready, True
        moving = self._bring(stored)
        if isinstance(moving, Pack):  # the device is the host
            self.ready.put(key, moving)
        else:
            moving.when_complete(lambda pack: self.ready.put(key, pack))
        return moving, False

    def _bring(self, stored: StoredPack) -> Pack | ArrivingPack:
        """The pack ``stored`` describes, on its way to the device layer by layer: copied from the host cache when it
        holds the pack, else fetched from the store and, once whole, copied into the host cache (when there is one)."""
        hosted = self.host.peek(stored.key) if self.host is not None else None
        if hosted is not None:
            return start_copy(hosted, self.lm.device, self.reader.decoder)
        arriving = self._start_download(stored)
        if (host := self.host) is not None:
            arriving.when_complete(lambda pack: host.put(stored.key, to_host(pack, self.reader.decoder.buffers)))
        return arriving

    def _ready(self, ref: str, check: Callable[[LoadedModel, PackHeader], None]) -> tuple[Pack, bool]:
        """The ready pack ``ref`` names and whether it was ready: ``check`` (kind and identities) runs on
        its stored header before it is fetched, and again on a ready one."""

        stored = self.lookup(ref)
        check(self.lm, stored.header)
        return self.ready.get(stored.key, lambda _: self._download(stored))

    def _fetch(self, key: str) -> Pack:
        stored = self.lookup(key)
        check_identity(self.lm, stored.header)
        return self._download(stored)

    def _stored(self, key: str) -> Pack | None:
        """The stored knowledge pack ``key`` (a composition someone stored), or None; with trusted keys an
        unsigned one is None too: it is computed again from its trusted parts."""
        try:
            return self._fetch(key)
        except (PackNotFound, Untrusted):
            return None

    def _download(self, stored: StoredPack) -> Pack:
        """The pack ``stored`` describes on the device, whole (``_bring``); with trusted keys, a fetched digest must
        bear a trusted signature."""
        moving = self._bring(stored)
        return moving if isinstance(moving, Pack) else moving.result(self.fetch_seconds)

    def _start_download(self, stored: StoredPack) -> ArrivingPack:
        """Start fetching the pack ``stored`` describes to the model's device; with trusted keys its header's digest (which the
        chunks are verified against as they arrive) must bear a trusted signature, checked before this returns."""
        key = stored.key
        with self._reads_lock:
            self.store_reads += 1
        pack = self.reader.start_fetch(key, device=self.lm.device, model_fp=self.lm.model_fp, template_fp=self.lm.template_fp)
        if self.trusted is not None:
            try:
                self.trusted.require(f"pack {key}", "pack", pack.header.pack_sha256, stored.signatures)
            except Untrusted:  # refuse on what the store says now, not on signatures remembered from before
                fresh = self.store.stat(key)
                self.refs.put(key, fresh)
                self.trusted.require(f"pack {key}", "pack", pack.header.pack_sha256, fresh.signatures)
        return pack

    def steering(self, question: Question) -> tuple[LayerDeltas, list[dict]]:
        """The summed deltas of the question's steering packs (empty when there are none, or every
        alpha is 0), and what was applied: each pack's key, alpha and layer range."""
        directions, applied = [], []
        for ref, alpha in question.steering:
            pack = self.steering_pack(ref)
            first, last = applied_layers(pack.header, question.steer_layers)
            directions.append(Direction(pack, alpha))
            applied.append({"pack": pack.header.key, "alpha": alpha, "layers": [first, last]})
        before_rope = question.steer_on in ("keys", "both") and any(key_space_of(d.pack.header) == "unrotated" for d in directions)
        deltas = steering_deltas(
            directions,
            layers=question.steer_layers,
            target=question.steer_on,
            device=self.lm.device,
            frequencies=layer_frequencies(self.lm) if before_rope else None,
        )
        return deltas, applied

    def header(self, key: str) -> PackHeader:
        """The header stored under ``key`` (see ``lookup``)."""
        return self.lookup(key).header

    def parts(self, refs: Sequence[str]) -> tuple[list[str], list[PackHeader]]:
        """The keys and headers of the packs ``refs`` names, refused (naming the part) unless all
        are knowledge packs of this model and template, alike in being raw or templated."""
        keys = [self.resolve(ref) for ref in refs]
        headers = [self.header(key) for key in keys]
        check_parts(self.lm, headers)
        return keys, headers

    def composed(self, refs: Sequence[str], extra_facts: Sequence[str] = ()) -> tuple[Pack | ArrivingPack, list[str], bool, int]:
        """The ready exact composition of the packs ``refs`` names (then ``extra_facts``), its part
        keys, whether it was ready, and how many tokens were prefilled to compose it. One pack alone
        may still be arriving (``arriving``).

        Looked up by its content key in the ready-cache, then in the store; otherwise extended from
        the longest leading composition already ready (or the first pack), prefilling only the rest.
        """
        if len(refs) == 1 and not extra_facts:
            pack, hit = self.arriving(refs[0])
            return pack, [pack.header.key], hit, 0
        keys, headers = self.parts(refs)
        groups = [list(header.facts) for header in headers] + ([list(extra_facts)] if extra_facts else [])
        raw = headers[0].raw
        prefilled = 0

        def key_of(n: int) -> str:
            """The composition key of the first ``n`` groups (the first pack's own key for one)."""
            if n == 1:
                return keys[0]
            return composition_key(self.lm, sum(groups[:n], []), raw=raw)

        def build(key: str) -> Pack:
            nonlocal prefilled
            if (stored := self._stored(key)) is not None:
                return stored
            ready = next(((n, p) for n in range(len(groups) - 1, 0, -1) if (p := self.ready.peek(key_of(n)))), None)
            done, base = ready if ready is not None else (1, self.ready.get(keys[0], self._fetch)[0])
            with self._device_lock:
                result = extend(self.lm, base, sum(groups[done:], []), parents=keys)
            prefilled = result.prefilled_tokens
            return result.pack.to(self.lm.device)

        pack, hit = self.ready.get(key_of(len(groups)), build)  # a warm request renders once
        return pack, keys, hit, prefilled

    def spliced(
        self, refs: Sequence[str], extra_facts: Sequence[str] = (), *, mode: str, adapter: str | None = None
    ) -> tuple[Pack, list[str], bool, int]:
        """The ready ``rope``/``naive``/``packet`` composition of the packs ``refs`` names (then the pack
        of ``extra_facts``), its part keys, whether it was ready, and how many positions were computed
        (framing and soft tokens only: no part is recomputed). Looked up by its key in the ready-cache,
        then in the store; otherwise spliced from the ready parts."""
        keys, headers = self.parts(refs)
        parts_keys, extra = list(keys), None
        if extra_facts:
            extra = self.facts_pack(extra_facts)[0]
            parts_keys.append(extra.header.key)
        check_composition(mode, adapter, len(parts_keys))
        adapter_pack = self.adapter_pack(adapter) if adapter else None
        facts = [fact for header in headers for fact in header.facts] + (list(extra.header.facts) if extra else [])
        parents = parts_keys + ([adapter_pack.header.key] if adapter_pack is not None else [])
        prefilled = 0

        def build(key: str) -> Pack:
            nonlocal prefilled
            if (stored := self._stored(key)) is not None:
                return stored
            parts = [self.ready.get(part, self._fetch)[0] for part in keys] + ([extra] if extra is not None else [])
            with self._device_lock:
                result = compose(self.lm, mode, parts, adapter_pack)
            prefilled = result.prefilled_tokens
            return result.pack.to(self.lm.device)

        key = composition_key(self.lm, facts, raw=headers[0].raw, mode=mode, parents=parents)
        pack, hit = self.ready.get(key, build)
        return pack, parts_keys, hit, prefilled

    def facts_pack(self, facts: Sequence[str]) -> tuple[Pack, bool, bool]:
        """The ready pack of exactly ``facts`` (in order), whether it was already stored, and whether already ready.

        Looked up by content key (then in the host cache and the store, as any pack); a pack not stored yet is built
        and written back (lazy recompute).
        """
        facts = clean_facts(facts)
        stored = True

        def load(key: str) -> Pack:
            nonlocal stored
            if self.trusted is None:  # with trusted keys a fact pack is computed here, never taken unsigned from the store
                try:
                    return self._fetch(key)
                except PackNotFound:
                    pass
            with self._device_lock:
                pack = build_pack(self.lm, facts)
            _, created = self.store.put(encode_pack(pack, decoder=self.reader.decoder))
            stored = not created
            return pack.to(self.lm.device)

        key = pack_key(self.lm.model_fp, self.lm.template_fp, pack_prefix_ids(self.lm.tokenizer, facts))
        pack, hit = self.ready.get(key, load)
        return pack, stored, hit

    def route(self, bank: str, question: str, **options: Any) -> list[str]:
        """The facts ``bank`` routes ``question`` to (``route_bank``'s ``options``: top_k, probe, embedder, rerank,
        rerank_weight), with this Answerer's trusted keys and model (``rerank`` ``lm``: this model scores them)."""
        return route_bank(self.store, self.bank_cache, bank, question, trusted=self.trusted, lm=self.lm, **options)

    def stream(self, question: Question, cancel: Cancel | None = None) -> Generator[int, None, AnswerResult]:
        """Answer ``question``, yielding each generated token id as it exists (the stop token that ends the
        answer too: ``self.lm.stop_token_ids``; it is not part of the answer).

        The generator's return value is the AnswerResult. With ``compare_rag`` the same facts, in
        the same order, are then answered as prompt text: prefilled in one pass (``identical``), and
        prefilled in the passes the pack's header records, then generated as the pack's answer was
        (``chunked_identical``: the exactness a pack promises; None where its header records no prefill).
        Both compare the generated token ids, not just the text.

        ``cancel``, cancelled from any thread (its client has gone), stops the answer and its comparisons at their
        next step or prefill pass (``kv.inject.generate_stream``): the stream then raises Left.
        """
        cancel = cancel if cancel is not None else Cancel()
        facts: list[str] | None = None
        reused: bool | None = None
        parts: list[str] | None = None
        composed_tokens: int | None = None
        pack: Pack | ArrivingPack | None = None
        hit: bool | None = None
        deltas, applied = self.steering(question) if question.steering else ({}, None)
        if question.bank:
            facts = self.route(
                question.bank, question.text, top_k=question.top_k, probe=question.probe, embedder=question.embedder,
                rerank=question.rerank, rerank_weight=question.rerank_weight,
            )
        if question.refs and question.mode != "exact":
            pack, keys, hit, prefilled = self.spliced(question.refs, facts or (), mode=question.mode, adapter=question.adapter)
            parts, composed_tokens = keys, prefilled
        elif question.refs:
            pack, keys, hit, prefilled = self.composed(question.refs, facts or ())
            if len(keys) > 1 or facts:
                parts, composed_tokens = keys, prefilled
        elif facts is not None:
            pack, reused, hit = self.facts_pack(facts)
        if pack is not None:
            rendering = prepare(self.lm, pack.header, question.text, question.history)
        else:  # steering alone: the conversation, with no knowledge before it
            rendering = render(self.lm.tokenizer, [], question.text.strip(), history=question.history)

        def cache(filled: bool):
            """A cache steering every position from the question on (None when nothing steers);
            ``filled``: holding the pack's K/V, which stays as stored."""
            held = pack if filled else None
            question_start = held.header.positions if held is not None else rendering.prefix_tokens  # soft tokens take positions
            empty = SteeredCache(deltas, question_start) if deltas else None
            return cache_from_pack(held, self.lm.device, cache=empty, wait_seconds=self.fetch_seconds) if held is not None else empty

        ids = cache_aligned_ids(pack.header, rendering.token_ids, self.lm.stop_token_ids[0]) if pack is not None else rendering.token_ids
        device = self._device_lock  # taken for each prefill, then one step at a time: in turn with other generations
        cancel.check()
        answer = yield from generate_stream(self.lm, ids, question.sampling, cache(filled=True), device=device, cancel=cancel)
        if isinstance(pack, ArrivingPack):
            pack = pack.result(self.fetch_seconds)  # whole by now (the model took every layer), and ready for the next request
        rag = chunked = None
        if question.compare_rag and pack is not None:  # (compare_rag comes with refs or a bank: Question checks)
            rag = answer_with_text(
                self.lm, pack.header.facts, question.text, raw=pack.header.raw, sampling=question.sampling,
                cache=cache(filled=False), history=question.history, device=device, cancel=cancel,
            )
            chunked = answer_with_chunked_text(
                self.lm, pack.header, ids, question.sampling, cache(filled=False), device=device, cancel=cancel
            )
        return AnswerResult(
            question=question.text,
            answer=answer.text,
            kv_prompt_tokens=answer.prompt_tokens,
            rag_answer=rag.text if rag is not None else None,
            rag_prompt_tokens=rag.prompt_tokens if rag is not None else None,
            identical=answer.token_ids == rag.token_ids if rag is not None else None,
            chunked_identical=answer.token_ids == chunked.token_ids if chunked is not None else None,
            pack=pack.header.key if pack is not None else None,
            pack_tokens=pack.header.tokens if pack is not None else None,
            bank=question.bank,
            facts=facts,
            pack_reused=reused,
            cache_hit=hit,
            parts=parts,
            composed_tokens=composed_tokens,
            steering=applied,
            steer_on=question.steer_on if applied is not None else None,
        )

    def ask(self, question: Question) -> AnswerResult:
        """Answer ``question`` (``stream`` without the tokens)."""
        return finish(self.stream(question))
