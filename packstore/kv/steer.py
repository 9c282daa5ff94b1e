"""Steering packs: contrastive K/V deltas from (good, bad) pairs, added to the values a model
computes for the question and the answer (docs/format.md §4.3).

Building runs each text of each pair through the model alone and pools its cached K and V per
layer (``last``: the last token's; ``mean``: the mean over its tokens); the pack holds, per layer,
``dK = mean over pairs of (K_good - K_bad)`` and the same for V, each ``[kv_heads, head_dim]``.
Applying adds ``alpha * dV`` to the values of every position from the question's first token on,
in the chosen layers, while they are computed: a knowledge pack's stored K/V (and the facts, when
they are prompt text) are never touched. Keys are untouched too, unless the key-arithmetic
control asks for them (``keys`` or ``both``): the cached keys are rotated by RoPE, so adding a
delta made at other positions is expected to break coherence, which is what the control measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
from transformers import DynamicCache

from packstore.errors import InvalidInput
from packstore.format import PackHeader
from packstore.format.header import POOLINGS, inputs_hash
from packstore.kv.build import layer_kv, prefill
from packstore.kv.inject import check_identity
from packstore.kv.models import LoadedModel
from packstore.kv.options import STEER_TARGETS, middle_third
from packstore.kv.records import Pair
from packstore.kv.render import check_no_special_tokens
from packstore.packs.tensors import Pack


@dataclass(frozen=True)
class Direction:
    """A steering pack and the strength it is applied with."""

    pack: Pack
    alpha: float


def check_pairs(lm: LoadedModel, pairs: Sequence[Pair]) -> list[Pair]:
    """Stripped pairs, refused when there are none, a side is empty, or a text holds a special token."""
    if not pairs:
        raise InvalidInput("no contrastive pairs: a steering pack needs at least one {good, bad} pair")
    cleaned = []
    for index, pair in enumerate(pairs, 1):
        good, bad = (side.strip() if isinstance(side, str) else "" for side in (pair.good, pair.bad))
        if not good or not bad:
            raise InvalidInput(f"pair {index} has an empty side: both good and bad need text")
        check_no_special_tokens(lm.tokenizer, f"pair {index}", good + "\n" + bad)
        cleaned.append(Pair(good, bad))
    return cleaned


def _pooled(lm: LoadedModel, text: str, pooling: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the text's cached K and V pooled over its tokens, each ``[kv_heads, head_dim]`` float32."""
    ids = lm.tokenizer(text).input_ids  # the tokenizer's own special tokens (a BOS where it adds one)
    cache = prefill(lm, ids)
    pool = (lambda t: t[0, :, -1]) if pooling == "last" else (lambda t: t[0].mean(dim=1))
    layers = [layer_kv(layer) for layer in cache.layers]
    keys = [pool(k.float()).cpu() for k, _ in layers]
    values = [pool(v.float()).cpu() for _, v in layers]
    return keys, values


def model_layers(lm: LoadedModel) -> int:
    return lm.model.config.get_text_config().num_hidden_layers


def build_span(lm: LoadedModel, layers: tuple[int, int] | None) -> tuple[int, int]:
    """The layers a steering pack is built on: ``layers`` (within the model's), default every layer."""
    count = model_layers(lm)
    first, last = layers if layers is not None else (0, count - 1)
    if not 0 <= first <= last < count:
        raise InvalidInput(f"layer range {first}-{last} is outside the model's layers 0-{count - 1}")
    return first, last


def steering_key(lm: LoadedModel, pairs: Sequence[Pair], pooling: str, span: tuple[int, int]) -> str:
    """The key the steering pack of these (checked) pairs would have: known before any model work."""
    return f"{lm.model_fp}/{lm.template_fp}/{inputs_hash('steering', steering_recipe(pairs, pooling, span))}"


def build_steering(
    lm: LoadedModel, pairs: Sequence[Pair], *, layers: tuple[int, int] | None = None, pooling: str = "last"
) -> Pack:
    """The steering pack of ``pairs`` on ``lm``: per layer of ``layers`` (default every layer), the mean
    over pairs of the good text's pooled K/V minus the bad text's, in the model's dtype."""
    pairs = check_pairs(lm, pairs)
    if pooling not in POOLINGS:
        raise InvalidInput(f"unknown pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
    count = model_layers(lm)
    first, last = build_span(lm, layers)
    sums_k: list[torch.Tensor] | None = None
    sums_v: list[torch.Tensor] | None = None
    for pair in pairs:
        good_k, good_v = _pooled(lm, pair.good, pooling)
        bad_k, bad_v = _pooled(lm, pair.bad, pooling)
        diff_k = [g - b for g, b in zip(good_k, bad_k)]
        diff_v = [g - b for g, b in zip(good_v, bad_v)]
        sums_k = diff_k if sums_k is None else [s + d for s, d in zip(sums_k, diff_k)]
        sums_v = diff_v if sums_v is None else [s + d for s, d in zip(sums_v, diff_v)]
    assert sums_k is not None and sums_v is not None  # check_pairs refuses an empty list
    keys = [(s / len(pairs)).to(lm.dtype).contiguous() for s in sums_k[first : last + 1]]
    values = [(s / len(pairs)).to(lm.dtype).contiguous() for s in sums_v[first : last + 1]]
    header = PackHeader(
        kind="steering",
        model_fp=lm.model_fp,
        template_fp=lm.template_fp,
        model_name=lm.name,
        token_ids=(),
        layers=count,
        kv_heads=keys[0].shape[0],
        head_dim=keys[0].shape[1],
        dtype=lm.dtype_name,
        facts=(),
        raw=False,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        recipe=steering_recipe(pairs, pooling, (first, last)),
        metrics={},
    )
    return Pack(header=header, keys=keys, values=values)


def steering_recipe(pairs: Sequence[Pair], pooling: str, layers: tuple[int, int]) -> dict:
    """The recipe a steering pack's header holds and its key hashes (docs/format.md §4.3)."""
    return {"pairs": [pair.to_json() for pair in pairs], "pooling": pooling, "layers": list(layers)}


def check_steering(lm: LoadedModel, header: PackHeader) -> None:
    """Raise PackMismatch unless ``header`` is a steering pack made on ``lm``'s model and template."""
    check_identity(lm, header, "steering")


def applied_layers(header: PackHeader, layers: tuple[int, int] | None) -> tuple[int, int]:
    """The layers a steering pack is applied to: ``layers`` (which it must hold), else its default:
    the middle third of the model's layers for a pack holding all of them, else the layers it holds."""
    held = header.body_layers
    if layers is None:
        return middle_third(header.layers) if len(held) == header.layers else (held.start, held.stop - 1)
    first, last = layers
    if first not in held or last not in held:
        raise InvalidInput(
            f"layer range {first}-{last} is outside the layers {held.start}-{held.stop - 1} that steering pack {header.key} holds"
        )
    return first, last


LayerDeltas = dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]


def steering_deltas(
    directions: Sequence[Direction], *, layers: tuple[int, int] | None = None, target: str = "values", device: torch.device | str = "cpu"
) -> LayerDeltas:
    """Per layer, the sum of ``alpha * dK`` and of ``alpha * dV`` over ``directions`` (None where
    ``target`` leaves K or V alone), on ``device`` in the packs' dtype. Directions with alpha 0 add nothing."""
    if target not in STEER_TARGETS:
        raise InvalidInput(f"unknown steering target {target!r}: use one of {', '.join(STEER_TARGETS)}")
    sums: dict[int, list[torch.Tensor]] = {}
    dtype = None
    for direction in directions:
        header = direction.pack.header
        first, last = applied_layers(header, layers)
        if direction.alpha == 0:
            continue
        dtype = direction.pack.values[0].dtype
        for layer in range(first, last + 1):
            slot = layer - header.body_layers.start
            dk = direction.alpha * direction.pack.keys[slot].float()
            dv = direction.alpha * direction.pack.values[slot].float()
            if layer in sums:
                sums[layer] = [sums[layer][0] + dk, sums[layer][1] + dv]
            else:
                sums[layer] = [dk, dv]
    return {
        layer: (
            dk.to(device, dtype) if target in ("keys", "both") else None,
            dv.to(device, dtype) if target in ("values", "both") else None,
        )
        for layer, (dk, dv) in sums.items()
    }


class SteeredCache(DynamicCache):
    """A DynamicCache that adds steering deltas to the K/V of every position from ``start`` on, as the
    model computes them; positions before ``start`` (a pack's K/V, or facts given as text) stay as they are.

    ``start`` is one position for every row, or a tensor of one per row (a left-padded batch)."""

    def __init__(self, deltas: LayerDeltas, start: int | torch.Tensor) -> None:
        super().__init__()
        self.deltas = deltas
        self.start = start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        delta = self.deltas.get(layer_idx)
        if delta is not None:
            steer = self._steered_positions(self.get_seq_length(layer_idx), key_states)
            if steer is not None:
                dk, dv = delta
                key_states = _add_where(key_states, dk, steer)
                value_states = _add_where(value_states, dv, steer)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _steered_positions(self, cached: int, states: torch.Tensor) -> torch.Tensor | None:
        """A [batch or 1, positions] mask of the incoming positions to steer, or None when there are none."""
        positions = torch.arange(cached, cached + states.shape[-2], device=states.device)
        start = self.start if isinstance(self.start, torch.Tensor) else torch.tensor([self.start])
        mask = positions[None, :] >= start.to(states.device)[:, None]
        return mask if bool(mask.any()) else None


def _add_where(states: torch.Tensor, delta: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """``states`` ([batch, heads, positions, head_dim]) with ``delta`` ([heads, head_dim]) added where ``mask``
    ([batch, positions]) is set."""
    if delta is None:
        return states
    return states + mask[:, None, :, None].to(states.dtype) * delta.to(states.dtype)[None, :, None, :]


def delta_norms(pack: Pack) -> list[dict]:
    """Per layer the steering pack holds, the L2 norms of its K and V deltas (what ``inspect`` shows)."""
    return [
        {"layer": layer, "key_norm": round(float(k.float().norm()), 6), "value_norm": round(float(v.float().norm()), 6)}
        for layer, k, v in zip(pack.header.body_layers, pack.keys, pack.values)
    ]
