"""Build a knowledge pack: facts -> single-pass chat rendering -> prefix ids -> prefill -> per-layer K/V."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from packstore.errors import InvalidInput
from packstore.format import PackHeader
from packstore.kv.exactness import machine
from packstore.kv.models import LoadedModel
from packstore.kv.render import pack_prefix_ids
from packstore.packs.tensors import Pack

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
) -> DynamicCache:
    """Run ``token_ids`` through the model and return its KV cache; with ``cache`` they continue it (in place).

    ``boundaries`` are the cache positions the forward passes start at, then where the last one ends (the cache's
    length, then rising to it plus ``len(token_ids)``; ``prefill_boundaries`` makes them): chunked passes bound
    activation memory and show progress for long packs, and the same boundaries reproduce a pack's recorded
    prefill (its header's ``prefill_chunks``) bit for bit. ``None`` runs one pass. Layers are plain full-length
    caches, also for sliding-window attention: the model's masks apply the window, and the stored pack keeps
    every position.
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
    """A knowledge pack of ``lm`` holding ``cache``'s K/V for ``token_ids`` (the rendering of ``facts``),
    and for any ``soft_tokens`` between them (a packet composition).

    ``prefill_chunks``: the passes that computed it, when it is the prefill of its tokens (None: unknown, or no
    prefill). ``copied_from``: the ``built_on`` of the packs whose K/V it copies; its own ``built_on`` is ``lm``'s,
    or unknown (None) when one of them was computed elsewhere (another GPU model, SM count, torch or CUDA version, or
    exactness mode: its ``built_on`` differs) or where unknown (none recorded, or only the device type and dtype, as
    packs written before format version 6 record it)."""
    keys, values = cache_tensors(cache)
    here = built_on(lm)
    header = PackHeader(
        kind="knowledge",
        model_fp=lm.model_fp,
        template_fp=lm.template_fp,
        model_name=lm.name,
        token_ids=tuple(token_ids),
        layers=len(keys),
        kv_heads=keys[0].shape[0],
        head_dim=keys[0].shape[2],
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
    return Pack(header=header, keys=keys, values=values)


def build_pack(lm: LoadedModel, facts: Sequence[str], *, raw: bool = False, progress: bool = False) -> Pack:
    """Compute the pack for ``facts`` on ``lm``. ``raw`` skips the chat template (to measure that pitfall).

    The prefill runs in passes of PREFILL_CHUNK_TOKENS and ends one at ``extension_point``, and the header
    records them (``prefill_chunks``): answers with the pack are those of its text prefilled in these passes."""
    facts = clean_facts(facts)
    token_ids = pack_prefix_ids(lm.tokenizer, facts, raw=raw)
    passes = prefill_boundaries(0, len(token_ids), cut=extension_point(lm, facts, token_ids, raw=raw))
    cache = prefill(lm, token_ids, boundaries=passes, progress=progress)
    return knowledge_pack(lm, token_ids, facts, cache, raw=raw, prefill_chunks=passes)
