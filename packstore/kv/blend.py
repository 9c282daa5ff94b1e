"""Selective recompute (the CacheBlend idea): the baseline between splicing parts with no recompute and
recomputing all of them, used by tools/eval_packet.py.

Starting from a RoPE splice of independently built parts, it recomputes the K/V of the ``share`` of
tokens whose values deviate most from what a full prefill would give, and keeps the rest as spliced:

1. Probe: run the first ``probe_layers`` layers over every token (that fraction of a full prefill)
   and measure, per token, how far its values at the last probed layer are from the spliced ones.
2. Recompute: run the most deviating tokens alone through every layer, each at its own position and
   attending causally to every position before it (the spliced K/V of the others, the recomputed K/V
   of the selected), and write their K/V back into the cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from packstore.errors import InvalidInput
from packstore.kv.build import layer_kv, prefill
from packstore.kv.models import LoadedModel
from packstore.packs.tensors import Pack

DEFAULT_SHARE = 0.15
PROBE_LAYERS = 2


@dataclass
class Blend:
    """A selectively recomputed cache and what it cost: probed positions (first layers only) and recomputed ones."""

    cache: DynamicCache
    recomputed: list[int]  # positions recomputed at every layer
    probed_tokens: int
    probe_layers: int


class _ScatterCache(DynamicCache):
    """Holds every position's K/V; an update writes the given positions' K/V in place and returns all."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: torch.Tensor) -> None:
        super().__init__()
        for layer, (k, v) in enumerate(zip(keys, values)):
            super().update(k.clone(), v.clone(), layer)
        self.positions = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = layer_kv(self.layers[layer_idx])
        keys[:, :, self.positions] = key_states
        values[:, :, self.positions] = value_states
        return keys, values


def _probe_values(lm: LoadedModel, token_ids: Sequence[int], layers: int) -> torch.Tensor:
    """Values of every token at layer ``layers - 1`` of a full prefill that runs only the first ``layers`` layers."""
    config = lm.model.config.get_text_config()
    total = config.num_hidden_layers
    config.num_hidden_layers = layers  # the decoders run self.layers[: num_hidden_layers]
    try:
        cache = prefill(lm, token_ids)
    finally:
        config.num_hidden_layers = total
    return layer_kv(cache.layers[layers - 1])[1][0]


def _attention_masks(lm: LoadedModel, positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor | dict:
    """Additive masks letting the token at each of ``positions`` see the positions up to its own (and,
    for sliding-window layers, only within the window)."""
    keys = torch.arange(length, device=positions.device)
    allowed = keys[None, :] <= positions[:, None]
    blocked = torch.finfo(dtype).min

    def mask(allow: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allow.shape, dtype=dtype, device=positions.device).masked_fill(~allow, blocked)[None, None]

    config = lm.model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types and "sliding_attention" in layer_types and window:
        near = keys[None, :] > positions[:, None] - window
        return {"full_attention": mask(allowed), "sliding_attention": mask(allowed & near)}
    return mask(allowed)


def selective_recompute(
    lm: LoadedModel, spliced: Pack, *, share: float = DEFAULT_SHARE, probe_layers: int = PROBE_LAYERS
) -> Blend:
    """``spliced`` (a rope or naive splice, no soft tokens) with the ``share`` of its tokens whose values
    deviate most after the first ``probe_layers`` layers recomputed at every layer."""
    header = spliced.header
    if header.soft_tokens:
        raise InvalidInput("selective recompute takes a splice without soft tokens")
    if not 0 <= share <= 1:
        raise InvalidInput(f"the recomputed share must be from 0 to 1, got {share}")
    layers = lm.model.config.get_text_config().num_hidden_layers
    probe_layers = max(1, min(probe_layers, layers))
    ids = list(header.token_ids)
    probed = _probe_values(lm, ids, probe_layers)
    deviation = (probed.float() - spliced.values[probe_layers - 1].to(probed.device).float()).pow(2).sum(dim=(0, 2))
    count = math.ceil(share * len(ids))
    positions = torch.sort(torch.topk(deviation, count).indices).values if count else torch.zeros(0, dtype=torch.long)
    device = lm.device
    keys = [k.unsqueeze(0).to(device) for k in spliced.keys]
    values = [v.unsqueeze(0).to(device) for v in spliced.values]
    cache = _ScatterCache(keys, values, positions.to(device))
    if count:
        dtype = keys[0].dtype
        with torch.inference_mode():
            lm.model(
                input_ids=torch.tensor([ids], device=device)[:, positions.to(device)],
                position_ids=positions.to(device)[None],
                attention_mask=_attention_masks(lm, positions.to(device), len(ids), dtype),
                **{lm.cache_argument: cache},
                use_cache=True,
                logits_to_keep=1,
            )
    plain = DynamicCache()  # a plain cache from here on: generation appends to it
    for layer in range(layers):
        plain.update(*layer_kv(cache.layers[layer]), layer)
    return Blend(plain, positions.tolist(), len(ids), probe_layers)
