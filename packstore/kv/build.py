"""Build a knowledge pack: facts -> single-pass chat rendering -> prefix ids -> prefill -> per-layer K/V."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from packstore.errors import InvalidInput
from packstore.format import PackHeader
from packstore.format.body import BLOCK_POSITIONS
from packstore.kv.exactness import machine
from packstore.kv.models import LoadedModel
from packstore.kv.render import pack_prefix_ids
from packstore.packs.tensors import Pack, position_blocks

PREFILL_CHUNK_TOKENS = 512
# A fact an extension point is found with (``extension_point``): any line of text after the facts.
EXTENSION_PROBE = "More."


def prefill_boundaries(start: int, stop: int, *, chunk: int | None = None, cut: int | None = None) -> list[int]:
    """The passes of a prefill of cache positions ``start`` to ``stop``, as ``prefill`` takes them: a pass every
    ``chunk`` positions (default PREFILL_CHUNK_TOKENS) from ``start``, another starting at ``cut`` when it lies
    inside, then ``stop``."""
    step = chunk or PREFILL_CHUNK_TOKENS
    starts = set(range(start, stop, step)) | ({cut} if cut is not None and start < cut < stop else set())
    return sorted(starts) + [stop]


def prefill(
    lm: LoadedModel,
    token_ids: Sequence[int],
    *,
    cache: DynamicCache | None = None,
    boundaries: Sequence[int] | None = None,
    progress: bool = False,
    after_pass: Callable[[DynamicCache, int], None] | None = None,
) -> DynamicCache:
    """Run ``token_ids`` through the model and return its KV cache; with ``cache`` they continue it (in place).

    ``boundaries`` are the cache positions the forward passes start at, then where the last one ends (the cache's
    length, then rising to it plus ``len(token_ids)``; ``prefill_boundaries`` makes them): chunked passes bound
    activation memory and show progress for long packs, and the same boundaries reproduce a pack's recorded
    prefill (its header's ``prefill_chunks``) bit for bit. ``None`` runs one pass. Layers are plain full-length
    caches, also for sliding-window attention: the model's masks apply the window, and the stored pack keeps
    every position. ``after_pass(cache, filled)`` runs after each pass is issued, with the cache positions filled so far.
    """
    cache = DynamicCache() if cache is None else cache
    first = cache.get_seq_length()
    passes = list(boundaries) if boundaries is not None else [first, first + len(token_ids)]
    if passes[0] != first or passes[-1] != first + len(token_ids) or any(a >= b for a, b in zip(passes, passes[1:])):
        raise ValueError(f"prefill boundaries must rise from the cache's {first} positions to {first + len(token_ids)}, got {passes}")
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    with torch.inference_mode(), tqdm(
        total=ids.shape[1], unit="tok", desc="prefill", disable=not progress, leave=False
    ) as bar:
        for start, stop in zip(passes, passes[1:]):
            piece = ids[:, start - first : stop - first]
            lm.model(input_ids=piece, use_cache=True, logits_to_keep=1, **{lm.cache_argument: cache})
            bar.update(piece.shape[1])
            if after_pass is not None:
                after_pass(cache, stop)
    return cache


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V (``[batch, kv_heads, positions, head_dim]``) one layer of a filled cache holds: the caches here
    are DynamicCaches of attention layers (a CacheLayerMixin, whose tensors are set once it has seen tokens)."""
    keys, values = (layer.keys, layer.values) if isinstance(layer, CacheLayerMixin) else (None, None)
    if keys is None or values is None:
        raise TypeError(f"a {type(layer).__name__} cache layer holding no K/V")
    return keys, values


def cache_tensors(cache: DynamicCache, tokens: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V as ``[kv_heads, tokens, head_dim]`` CPU tensors (the first ``tokens`` positions).

    On CUDA every tensor is copied into one pinned host buffer without waiting, then synchronized once: a pageable
    ``.to("cpu")`` per tensor waits for each copy in turn and goes through a staging buffer."""
    layers = [layer_kv(layer) for layer in cache.layers]
    parts = [t[0, :, :tokens].detach() for k, v in layers for t in (k, v)]  # K, V of layer 0, then of layer 1, ...
    device = parts[0].device if parts else torch.device("cpu")
    if device.type == "cuda":
        host = torch.empty(sum(part.numel() for part in parts), dtype=parts[0].dtype, pin_memory=True)
        copies, at = [], 0
        for part in parts:
            copies.append(host[at : at + part.numel()].view(part.shape).copy_(part, non_blocking=True))
            at += part.numel()
        torch.cuda.synchronize(device)
        parts = copies
    else:
        parts = [part.to("cpu").contiguous() for part in parts]
    return parts[0::2], parts[1::2]


def clean_facts(facts: Sequence[str]) -> list[str]:
    """Strip each fact and drop empty ones; refuse a list with nothing left."""
    cleaned = [f.strip() for f in facts if f and f.strip()]
    if not cleaned:
        raise InvalidInput("no facts: a pack needs at least one non-empty fact")
    return cleaned


def built_on(lm: LoadedModel) -> dict[str, Any]:
    """Where ``lm`` computes, as a pack's header records it (format version 6): its device type and compute dtype, the
    machine and software (``exactness.machine``: torch's version, on CUDA the GPU model, capability, SM count and CUDA
    version) and the exactness mode when not the default. Two packs computed alike record equal ones."""
    return {**machine(lm.device), "dtype": lm.dtype_name}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def extension_point(lm: LoadedModel, facts: Sequence[str], token_ids: Sequence[int], *, raw: bool) -> int:
    """How many of the tokens ``token_ids`` of ``facts``'s pack a pack of more facts after them shares: all but the
    template's closing framing. An exact composition or erratum (kv/compose.py) keeps a pack's K/V up to a pass
    boundary of its prefill, so a prefill ends a pass here and an extension reuses everything but the framing."""
    return common_prefix(token_ids, pack_prefix_ids(lm.tokenizer, [*facts, EXTENSION_PROBE], raw=raw))


def knowledge_header(
    lm: LoadedModel,
    token_ids: Sequence[int],
    facts: Sequence[str],
    shape: tuple[int, int, int],
    *,
    raw: bool = False,
    parents: Sequence[str] = (),
    composition: str = "exact",
    soft_tokens: Sequence[tuple[int, int]] = (),
    prefill_chunks: Sequence[int] | None = None,
    copied_from: Sequence[Mapping[str, Any] | None] = (),
) -> PackHeader:
    """The header of a knowledge pack of ``lm`` holding K/V for ``token_ids`` (the rendering of ``facts``), and for any
    ``soft_tokens`` between them (a packet composition), in ``shape``: (layers, KV heads, head dim).

    ``prefill_chunks``: the passes that computed it, when it is the prefill of its tokens (None: unknown, or no
    prefill). ``copied_from``: the ``built_on`` of the packs whose K/V it copies; its own ``built_on`` is ``lm``'s,
    or unknown (None) when one of them was computed elsewhere (another GPU model, SM count, torch or CUDA version, or
    exactness mode: its ``built_on`` differs) or where unknown (none recorded, or only the device type and dtype, as
    packs written before format version 6 record it)."""
    here = built_on(lm)
    header = PackHeader(
        kind="knowledge",
        model_fp=lm.model_fp,
        template_fp=lm.template_fp,
        model_name=lm.name,
        token_ids=tuple(token_ids),
        layers=shape[0],
        kv_heads=shape[1],
        head_dim=shape[2],
        dtype=lm.dtype_name,
        facts=tuple(facts),
        raw=raw,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        parents=tuple(parents),
        composition=composition,
        soft_tokens=tuple((index, count) for index, count in soft_tokens),
        prefill_chunks=tuple(prefill_chunks) if prefill_chunks is not None else None,
        built_on=here if all(other == here for other in copied_from) else None,
    )
    return header


def knowledge_pack(
    lm: LoadedModel,
    token_ids: Sequence[int],
    facts: Sequence[str],
    cache: DynamicCache,
    *,
    raw: bool = False,
    parents: Sequence[str] = (),
    composition: str = "exact",
    soft_tokens: Sequence[tuple[int, int]] = (),
    prefill_chunks: Sequence[int] | None = None,
    copied_from: Sequence[Mapping[str, Any] | None] = (),
) -> Pack:
    """A knowledge pack of ``lm`` holding ``cache``'s K/V for ``token_ids`` (the rendering of ``facts``), and for any
    ``soft_tokens`` between them, with ``knowledge_header``'s header (the other arguments are its)."""
    keys, values = cache_tensors(cache)
    header = knowledge_header(
        lm, token_ids, facts, (len(keys), keys[0].shape[0], keys[0].shape[2]), raw=raw, parents=parents, composition=composition,
        soft_tokens=soft_tokens, prefill_chunks=prefill_chunks, copied_from=copied_from,
    )
    return Pack(header=header, keys=keys, values=values)


def build_pack(lm: LoadedModel, facts: Sequence[str], *, raw: bool = False, progress: bool = False) -> Pack:
    """Compute the pack for ``facts`` on ``lm``. ``raw`` skips the chat template (to measure that pitfall).

    The prefill runs in passes of PREFILL_CHUNK_TOKENS and ends one at ``extension_point``, and the header
    records them (``prefill_chunks``): answers with the pack are those of its text prefilled in these passes."""
    facts, token_ids, passes = build_plan(lm, facts, raw=raw)
    cache = prefill(lm, token_ids, boundaries=passes, progress=progress)
    return knowledge_pack(lm, token_ids, facts, cache, raw=raw, prefill_chunks=passes)


def build_plan(lm: LoadedModel, facts: Sequence[str], *, raw: bool = False) -> tuple[list[str], list[int], list[int]]:
    """What ``build_pack`` prefills: the facts cleaned (``clean_facts``), their tokens, and the passes (PREFILL_CHUNK_TOKENS
    each, one ending at ``extension_point``)."""
    facts = clean_facts(facts)
    token_ids = pack_prefix_ids(lm.tokenizer, facts, raw=raw)
    return facts, token_ids, prefill_boundaries(0, len(token_ids), cut=extension_point(lm, facts, token_ids, raw=raw))


@dataclass
class KvBlock:
    """K and V of every layer for the positions of one token block (``positions``; None: every position of a pack not
    split into blocks), each ``[kv_heads, positions, head_dim]`` in host memory; ``ready()`` waits until their copy off
    the device has landed (at once on the CPU)."""

    positions: range | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    ready: Callable[[], None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _landed() -> None:
    """The ``ready`` of host copies made synchronously."""


def block_tensors(cache: DynamicCache, positions: range) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]]:
    """K and V of every layer of ``cache`` at ``positions``, in host memory of their own (the cache's tensors are
    replaced as it grows), and a wait for them: on CUDA copied into one pinned buffer on the current stream, after the
    work issued on it so far and without waiting (the wait is an event's); elsewhere copied now."""
    parts = [t[0, :, positions.start : positions.stop] for layer in cache.layers for t in layer_kv(layer)]
    device = parts[0].device
    if device.type == "cuda":
        host = torch.empty(sum(part.numel() for part in parts), dtype=parts[0].dtype, pin_memory=True)
        copies, at = [], 0
        for part in parts:
            copies.append(host[at : at + part.numel()].view(part.shape).copy_(part, non_blocking=True))
            at += part.numel()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        return copies[0::2], copies[1::2], done.synchronize
    copies = [part.clone(memory_format=torch.contiguous_format) if device.type == "cpu" else part.to("cpu").contiguous() for part in parts]
    return copies[0::2], copies[1::2], _landed


def build_blocks(
    lm: LoadedModel,
    facts: Sequence[str],
    take: Callable[[PackHeader, KvBlock], None],
    *,
    raw: bool = False,
    progress: bool = False,
    block_positions: int = BLOCK_POSITIONS,
) -> PackHeader:
    """``build_pack``, handing its K/V out as the prefill makes them: after each pass of the prefill (the same passes,
    so the same K/V to the bit), ``take(header, block)`` is called on this thread for each token block of the pack
    (``position_blocks`` of ``block_positions``, in order) that the passes so far have filled, its copy off the device
    issued and not waited for (``KvBlock.ready``). The header (made at the first pass; its codec and chunks are the
    encoder's to set) is returned once the last pass is issued."""
    facts, token_ids, passes = build_plan(lm, facts, raw=raw)
    waiting = deque(position_blocks(len(token_ids), block_positions))
    made: list[PackHeader] = []

    def after_pass(cache: DynamicCache, filled: int) -> None:
        if not made:
            first = layer_kv(cache.layers[0])[0]
            made.append(knowledge_header(lm, token_ids, facts, (len(cache.layers), first.shape[1], first.shape[3]), raw=raw,
                                         prefill_chunks=passes))
        while waiting and (waiting[0].stop if waiting[0] is not None else len(token_ids)) <= filled:
            block = waiting.popleft()
            keys, values, ready = block_tensors(cache, block if block is not None else range(len(token_ids)))
            take(made[0], KvBlock(block, keys, values, ready))

    prefill(lm, token_ids, boundaries=passes, progress=progress, after_pass=after_pass)
    return made[0]
