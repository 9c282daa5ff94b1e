"""Compose knowledge packs: exact sequential extension (composition, accumulation, errata) and
approximate splicing of independently built parts (RoPE re-positioning, or naive for measurement).

Every composition of parts P1..Pn holds the tokens of one single-pass rendering of all their facts
in order (docs/format.md §1.5), so the usual token check applies to it at use. ``extend`` reuses the
first part's K/V as far as its tokens agree with that rendering and prefills only the rest: the
later parts' facts and the template's closing tokens. ``splice`` prefills nothing of the parts: it
copies each part's own fact tokens, rotated to their new positions (``rope``) or left where they
were computed (``naive``), and prefills only the few framing tokens no part holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from packstore.errors import InvalidInput, PackMismatch
from packstore.format import PackHeader
from packstore.format.body import ERRATUM_PREFIX
from packstore.format.header import COMPOSITIONS
from packstore.kv.build import clean_facts, common_prefix, extension_point, knowledge_pack, prefill, prefill_boundaries
from packstore.kv.inject import cache_from_pack, check_identity
from packstore.kv.models import LoadedModel, ModelSide, embedding_weight
from packstore.kv.render import group_spans, pack_prefix_ids
from packstore.kv.rope import layer_frequencies, rotate_keys
from packstore.packs.tensors import Pack

COMPOSE_MODES = COMPOSITIONS  # exact first, the default
SPLICE_MODES = ("rope", "naive")  # spliced without an adapter


@dataclass(frozen=True)
class Composition:
    """A composed pack and where its tokens' K/V came from."""

    pack: Pack
    reused_tokens: int  # copied from stored parts (rotated or not)
    prefilled_tokens: int  # run through the model
    computed_positions: tuple[int, ...] = ()  # spliced compositions: the cache positions run through the model

    def to_json(self) -> dict:
        return {"reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens}


def check_parts(lm: ModelSide, headers: Sequence[PackHeader]) -> bool:
    """Refuse parts that cannot be composed on ``lm``; returns whether they are raw (all alike)."""
    if not headers:
        raise InvalidInput("nothing to compose: give at least one pack")
    for index, header in enumerate(headers):
        try:
            check_identity(lm, header)
        except PackMismatch as exc:
            if len(headers) == 1:
                raise
            raise PackMismatch(exc.what, f"part {index + 1} of the composition: {exc}") from None
    if len({header.raw for header in headers}) > 1:
        raise InvalidInput("cannot compose raw packs (built without the chat template) with templated ones")
    return headers[0].raw


def extend(lm: LoadedModel, base: Pack, facts: Sequence[str], *, parents: Sequence[str]) -> Composition:
    """The exact pack of ``base``'s facts then ``facts``: ``base``'s K/V is kept as far as its tokens agree
    with the new rendering, and only the rest is prefilled, with ``base`` as prefix.

    What is kept ends at a pass boundary of ``base``'s recorded prefill (the last at or before the shared
    tokens: a build ends a pass where an extension starts), so the result is its text prefilled in passes
    too, recorded as ``base``'s passes up to there then the new ones. A base whose prefill is unknown (a pack
    written before it was recorded) is kept as far as its tokens agree, and the result's prefill is unknown."""
    check_parts(lm, [base.header])
    if base.header.composition != "exact":
        raise InvalidInput(
            f"pack {base.header.key} is a {base.header.composition} composition: an exact composition needs an exact first part"
        )
    all_facts = list(base.header.facts) + clean_facts(facts)
    token_ids = pack_prefix_ids(lm.tokenizer, all_facts, raw=base.header.raw)
    kept = common_prefix(base.header.token_ids, token_ids)
    recorded = base.header.prefill_chunks
    if recorded is not None:
        kept = max(position for position in recorded if position <= kept)
    cache = cache_from_pack(base, lm.device, tokens=kept)
    passes = prefill_boundaries(kept, len(token_ids), cut=extension_point(lm, all_facts, token_ids, raw=base.header.raw))
    prefill(lm, token_ids[kept:], cache=cache, boundaries=passes)
    pack = knowledge_pack(
        lm,
        token_ids,
        all_facts,
        cache,
        raw=base.header.raw,
        parents=parents,
        prefill_chunks=[position for position in recorded if position < kept] + passes if recorded is not None else None,
        copied_from=[base.header.built_on] if kept else [],
    )
    return Composition(pack=pack, reused_tokens=kept, prefilled_tokens=len(token_ids) - kept)


def compose_exact(lm: LoadedModel, first: Pack, later: Sequence[PackHeader]) -> Composition:
    """Sequential composition: ``first``'s K/V, then every later part's facts prefilled after it, in order.

    The later parts contribute their facts only (their stored K/V was computed at other positions)."""
    check_parts(lm, [first.header, *later])
    facts = [fact for header in later for fact in header.facts]
    return extend(lm, first, facts, parents=[first.header.key, *(header.key for header in later)])


def check_erratum(erratum: str) -> str:
    """An erratum is one non-empty line."""
    text = erratum.strip() if isinstance(erratum, str) else ""
    if not text:
        raise InvalidInput("the erratum is empty")
    if "\n" in text or "\r" in text:
        raise InvalidInput("an erratum is one line: it contains a line break")
    return text


def amend(lm: LoadedModel, base: Pack, erratum: str) -> Composition:
    """``base`` with one erratum appended (rendered as ``Correction: TEXT`` after its facts)."""
    return extend(lm, base, [ERRATUM_PREFIX + check_erratum(erratum)], parents=[base.header.key])


@dataclass
class SoftTokens:
    """An adapter's soft-token embeddings for one model, each ``[tokens, hidden_size]`` on the model's device:
    ``header`` goes before every later part of a packet composition, ``trailer`` after every part."""

    header: torch.Tensor
    trailer: torch.Tensor


@dataclass
class Assembly:
    """A spliced cache and where its positions came from (``soft``: (token index, count) of soft tokens before it)."""

    cache: DynamicCache
    token_ids: list[int]
    soft: list[tuple[int, int]]
    reused_tokens: int
    computed: list[int]  # cache positions run through the model (framing and soft tokens)

    @property
    def prefilled_tokens(self) -> int:
        return len(self.computed)


class _Prefill:
    """Collects the positions no part holds (framing token ids, soft-token embeddings), in order, and
    runs them through the model into the cache, with everything before them as prefix."""

    def __init__(self, lm: LoadedModel, cache: DynamicCache, grad: bool) -> None:
        self.lm, self.cache, self.grad = lm, cache, grad
        self.pending: list[list[int] | torch.Tensor] = []
        self.computed: list[int] = []

    def add(self, item: list[int] | torch.Tensor) -> None:
        if len(item):
            self.pending.append(item)

    def flush(self) -> None:
        if not self.pending:
            return
        start = self.cache.get_seq_length()
        self.computed += range(start, start + sum(len(item) for item in self.pending))
        if all(isinstance(item, list) for item in self.pending) and not self.grad:
            prefill(self.lm, [token for item in self.pending for token in item], cache=self.cache)
        else:
            embed = self.lm.model.get_input_embeddings()
            device = self.lm.device
            with torch.set_grad_enabled(self.grad):
                dtype = embedding_weight(embed).dtype
                pieces = [
                    embed(torch.tensor(item, device=device)) if isinstance(item, list) else item.to(device, dtype) for item in self.pending
                ]
                self.lm.model(inputs_embeds=torch.cat(pieces)[None], use_cache=True, **{self.lm.cache_argument: self.cache})
        self.pending = []


def assemble(lm: LoadedModel, parts: Sequence[Pack], *, rotate: bool, soft: SoftTokens | None = None, grad: bool = False) -> Assembly:
    """Splice independently built parts into the rendering of all their facts, prefilling none of them.

    Each part's own template framing is stripped: only its fact tokens are copied, to where the same
    tokens sit in the composed rendering (keys rotated by the position offset when ``rotate``). The
    framing tokens between and after the parts, and with ``soft`` the trailer after every part and the
    header before every later part, are run through the model with everything before them as prefix.
    ``grad`` keeps the autograd graph of those runs (training an adapter); parts are never in it.
    """
    if len(parts) < 2:
        raise InvalidInput("a spliced composition needs at least 2 packs")
    raw = check_parts(lm, [part.header for part in parts])
    for part in parts:
        if part.header.soft_tokens:
            raise InvalidInput(f"pack {part.header.key} is a packet composition: its soft tokens cannot be spliced again")
    frequencies = layer_frequencies(lm) if rotate else None
    token_ids, spans = group_spans(lm.tokenizer, [part.header.facts for part in parts], raw=raw)
    kept = common_prefix(parts[0].header.token_ids, token_ids)
    cache = cache_from_pack(parts[0], lm.device, tokens=kept)
    pending = _Prefill(lm, cache, grad)
    layout: list[tuple[int, int]] = []

    def insert(embeddings: torch.Tensor, index: int) -> None:
        pending.add(embeddings)
        if layout and layout[-1][0] == index:
            layout[-1] = (index, layout[-1][1] + len(embeddings))
        else:
            layout.append((index, len(embeddings)))

    if soft is not None:
        insert(soft.trailer, kept)
    index, reused = kept, kept  # index: the next rendering token; the cache also holds the soft tokens
    for part, (start, stop) in zip(parts[1:], spans[1:]):
        own_ids, [(own_start, own_stop)] = group_spans(lm.tokenizer, [part.header.facts], raw=raw)
        if list(own_ids) != list(part.header.token_ids):
            raise InvalidInput(f"pack {part.header.key} does not hold the rendering of its own facts; cannot splice it")
        skip = max(0, index - start)
        run = common_prefix(own_ids[own_start + skip : own_stop], token_ids[start + skip : stop])
        pending.add(list(token_ids[index:start]))
        index = max(index, start)
        if soft is not None:
            insert(soft.header, index)
        pending.flush()
        first, last = own_start + skip, own_start + skip + run
        delta = cache.get_seq_length() - first  # the part's tokens move from their own positions to the cache's end
        for layer, (k, v) in enumerate(zip(part.keys, part.values)):
            keys = k[:, first:last]
            if frequencies is not None:
                keys = rotate_keys(keys, frequencies[layer], delta)
            cache.update(keys.unsqueeze(0).to(lm.device), v[:, first:last].unsqueeze(0).to(lm.device), layer)
        index += run
        reused += run
        if soft is not None:
            insert(soft.trailer, index)
    pending.add(list(token_ids[index:]))
    pending.flush()
    return Assembly(cache, token_ids, layout, reused, pending.computed)


def splice(lm: LoadedModel, parts: Sequence[Pack], mode: str) -> Composition:
    """Splice independently built parts (``assemble``): ``rope`` rotates their keys by the position
    offset; ``naive`` leaves them at the positions they were computed at (wrong; kept only to measure it)."""
    if mode not in SPLICE_MODES:
        raise InvalidInput(f"unknown splice mode {mode!r}: use one of {', '.join(SPLICE_MODES)}")
    if len(parts) < 2:
        raise InvalidInput(f"a {mode} composition needs at least 2 packs")
    assembly = assemble(lm, parts, rotate=mode == "rope")
    return _spliced_pack(lm, parts, assembly, mode, parents=[part.header.key for part in parts])


def _spliced_pack(lm: LoadedModel, parts: Sequence[Pack], assembly: Assembly, mode: str, parents: Sequence[str]) -> Composition:
    facts = [fact for part in parts for fact in part.header.facts]
    pack = knowledge_pack(
        lm,
        assembly.token_ids,
        facts,
        assembly.cache,
        raw=parts[0].header.raw,
        parents=parents,
        composition=mode,
        soft_tokens=assembly.soft,
        copied_from=[part.header.built_on for part in parts],
    )
    return Composition(
        pack=pack,
        reused_tokens=assembly.reused_tokens,
        prefilled_tokens=assembly.prefilled_tokens,
        computed_positions=tuple(assembly.computed),
    )
