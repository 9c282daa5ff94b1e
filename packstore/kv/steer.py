"""Steering packs: contrastive K/V deltas from (good, bad) pairs, added to the values a model
computes for the question and the answer (docs/format.md §4.3).

Building runs each text of each pair through the model alone and pools its cached K and V per
layer (``last``: the last token's; ``mean``: the mean over its tokens); the pack holds, per layer,
``dK = mean over pairs of (K_good - K_bad)`` and the same for V, each ``[kv_heads, head_dim]``.
Applying adds ``alpha * dV`` to the values of every position from the question's first token on,
in the chosen layers, while they are computed: a knowledge pack's stored K/V (and the facts, when
they are prompt text) are never touched. Keys are untouched too, unless the key-arithmetic
control asks for them (``keys`` or ``both``). Cached keys are rotated by RoPE, so a key delta pooled
from them ("rotated", the default) is one vector added alike to every steered key: a shift softmax
mostly ignores. Built with ``keys="unrotated"``, each position's key is rotated back to position 0
before pooling, and the delta is rotated to each position it is added at: key arithmetic before RoPE,
which changes how attention weighs the steered positions against each other. Built with
``framing="chat"``, each text is pooled as a user message in the chat template with the generation
prompt after it, over the positions steering is added to at use (the message and the template after
it), rather than as plain text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
from transformers import DynamicCache

from packstore.errors import InvalidInput
from packstore.format import PackHeader
from packstore.format.header import FRAMINGS, KEY_SPACES, POOLINGS, inputs_hash
from packstore.kv.build import layer_kv, prefill
from packstore.kv.inject import check_identity
from packstore.kv.models import LoadedModel
from packstore.kv.options import STEER_TARGETS, middle_third
from packstore.kv.records import Pair
from packstore.kv.render import check_no_special_tokens, render
from packstore.kv.rope import layer_frequencies, rotate_keys
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


# Token ids -> each layer's (K, V) of their prefill (``pair_deltas``'s ``prefilled``), keyed by model and ids.
Prefilled = dict[tuple[str, tuple[int, ...]], list[tuple[torch.Tensor, torch.Tensor]]]


def _text_kv(lm: LoadedModel, ids: Sequence[int], prefilled: Prefilled | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cached (K, V) after a prefill of ``ids`` alone, taken from ``prefilled`` when it holds them (and
    kept there when given)."""
    key = (lm.model_fp, tuple(ids))
    if prefilled is not None and key in prefilled:
        return prefilled[key]
    layers = [layer_kv(layer) for layer in prefill(lm, ids).layers]
    if prefilled is not None:
        prefilled[key] = layers
    return layers


def _pooled(
    lm: LoadedModel,
    text: str,
    pooling: str,
    frequencies: list[torch.Tensor] | None = None,
    framing: str = "text",
    prefilled: Prefilled | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the text's cached K and V pooled over its tokens, each ``[kv_heads, head_dim]`` float32; with each
    layer's RoPE ``frequencies``, every key is first rotated back to position 0 (its value before RoPE). ``framing``
    "chat": the text as a user message in the chat template, pooled from the message's first token to the end."""
    if framing == "chat":
        rendering = render(lm.tokenizer, [], text)
        ids, start = rendering.token_ids, rendering.prefix_tokens
    else:
        ids, start = lm.tokenizer(text).input_ids, 0  # the tokenizer's own special tokens (a BOS where it adds one)
    pool = (lambda t: t[:, -1]) if pooling == "last" else (lambda t: t[:, start:].mean(dim=1))
    layers = _text_kv(lm, ids, prefilled)
    back = -torch.arange(len(ids))
    keys = [
        pool(rotate_keys(k[0].float().cpu(), frequencies[i], back) if frequencies is not None else k[0].float()).cpu()
        for i, (k, _) in enumerate(layers)
    ]
    values = [pool(v[0].float()).cpu() for _, v in layers]
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


def steering_key(
    lm: LoadedModel, pairs: Sequence[Pair], pooling: str, span: tuple[int, int], key_space: str = "rotated", framing: str = "text"
) -> str:
    """The key the steering pack of these (checked) pairs would have: known before any model work."""
    return f"{lm.model_fp}/{lm.template_fp}/{inputs_hash('steering', steering_recipe(pairs, pooling, span, key_space, framing))}"


def _summed(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of ``tensors``, in order (at least one)."""
    total, *rest = tensors
    for tensor in rest:
        total = total + tensor
    return total


def pair_deltas(
    lm: LoadedModel,
    pairs: Sequence[Pair],
    *,
    pooling: str = "last",
    key_space: str = "rotated",
    framing: str = "text",
    prefilled: Prefilled | None = None,
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per pair (checked), per layer, the good text's pooled K and V minus the bad text's, float32 on CPU: what a
    steering pack averages (and what a label-shuffled null flips the sign of). ``prefilled``: a dict the caller keeps
    across calls that pool the same texts (several directions, poolings or key spaces from one pair set): each distinct
    text is then prefilled once, its K/V per layer kept there (the same numbers as prefilling it again)."""
    frequencies = layer_frequencies(lm) if key_space == "unrotated" else None
    differences = []
    for pair in pairs:
        good_k, good_v = _pooled(lm, pair.good, pooling, frequencies, framing, prefilled)
        bad_k, bad_v = _pooled(lm, pair.bad, pooling, frequencies, framing, prefilled)
        differences.append(([g - b for g, b in zip(good_k, bad_k)], [g - b for g, b in zip(good_v, bad_v)]))
    return differences


def build_steering(
    lm: LoadedModel,
    pairs: Sequence[Pair],
    *,
    layers: tuple[int, int] | None = None,
    pooling: str = "last",
    key_space: str = "rotated",
    framing: str = "text",
    prefilled: Prefilled | None = None,
) -> Pack:
    """The steering pack of ``pairs`` on ``lm``: per layer of ``layers`` (default every layer), the mean
    over pairs of the good text's pooled K/V minus the bad text's, in the model's dtype; ``key_space`` "unrotated"
    pools each key as it was before RoPE (module docstring; needs a model whose RoPE is a pure rotation); ``framing``
    "chat" pools each text as a user message in the chat template; ``prefilled`` as ``pair_deltas`` takes it."""
    pairs = check_pairs(lm, pairs)
    if pooling not in POOLINGS:
        raise InvalidInput(f"unknown pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
    if key_space not in KEY_SPACES:
        raise InvalidInput(f"unknown key space {key_space!r}: use one of {', '.join(KEY_SPACES)}")
    if framing not in FRAMINGS:
        raise InvalidInput(f"unknown framing {framing!r}: use one of {', '.join(FRAMINGS)}")
    count = model_layers(lm)
    first, last = build_span(lm, layers)
    differences = pair_deltas(lm, pairs, pooling=pooling, key_space=key_space, framing=framing, prefilled=prefilled)
    span = range(first, last + 1)
    keys = [(_summed(dk[layer] for dk, _ in differences) / len(pairs)).to(lm.dtype).contiguous() for layer in span]
    values = [(_summed(dv[layer] for _, dv in differences) / len(pairs)).to(lm.dtype).contiguous() for layer in span]
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
        recipe=steering_recipe(pairs, pooling, (first, last), key_space, framing),
        metrics={},
    )
    return Pack(header=header, keys=keys, values=values)


def steering_recipe(
    pairs: Sequence[Pair], pooling: str, layers: tuple[int, int], key_space: str = "rotated", framing: str = "text"
) -> dict:
    """The recipe a steering pack's header holds and its key hashes (docs/format.md §4.3); "keys" only when unrotated
    and "framing" only when chat, so packs built before those fields keep their keys."""
    recipe = {"pairs": [pair.to_json() for pair in pairs], "pooling": pooling, "layers": list(layers)}
    recipe |= {"keys": key_space} if key_space != "rotated" else {}
    return recipe | ({"framing": framing} if framing != "text" else {})


def key_space_of(header: PackHeader) -> str:
    """The space a steering pack's key deltas are in: "rotated" (as cached) or "unrotated" (before RoPE)."""
    return (header.recipe or {}).get("keys", "rotated")


def framing_of(header: PackHeader) -> str:
    """How a steering pack's pair texts were pooled: "text" (alone) or "chat" (as user messages in the template)."""
    return (header.recipe or {}).get("framing", "text")


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


@dataclass(frozen=True)
class LayerDelta:
    """What steering adds to one layer's K and V at each steered position: ``key`` and ``value`` as they are,
    ``unrotated_key`` rotated to the position first (``inv_freq``: the layer's RoPE frequencies); None: nothing."""

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    unrotated_key: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None


LayerDeltas = dict[int, LayerDelta]


def steering_deltas(
    directions: Sequence[Direction],
    *,
    layers: tuple[int, int] | None = None,
    target: str = "values",
    device: torch.device | str = "cpu",
    frequencies: Sequence[torch.Tensor] | None = None,
) -> LayerDeltas:
    """Per layer, the sum of ``alpha * dK`` (rotated and unrotated key deltas apart) and of ``alpha * dV`` over
    ``directions``, on ``device`` in the packs' dtype, with what ``target`` leaves alone left out. Directions with
    alpha 0 add nothing. Unrotated key deltas need each layer's RoPE ``frequencies`` (``rope.layer_frequencies``)."""
    if target not in STEER_TARGETS:
        raise InvalidInput(f"unknown steering target {target!r}: use one of {', '.join(STEER_TARGETS)}")
    steer_keys, steer_values = target in ("keys", "both"), target in ("values", "both")
    sums: dict[int, dict[str, torch.Tensor]] = {}
    dtype = None
    for direction in directions:
        header = direction.pack.header
        first, last = applied_layers(header, layers)
        if direction.alpha == 0:
            continue
        dtype = direction.pack.values[0].dtype
        space = "unrotated_key" if key_space_of(header) == "unrotated" else "key"
        if steer_keys and space == "unrotated_key" and frequencies is None:
            raise InvalidInput(f"steering pack {header.key} holds key deltas before RoPE: applying them needs the model's RoPE frequencies")
        for layer in range(first, last + 1):
            slot = layer - header.body_layers.start
            parts = sums.setdefault(layer, {})
            pack = direction.pack
            for name, delta, wanted in ((space, pack.keys[slot], steer_keys), ("value", pack.values[slot], steer_values)):
                if wanted:
                    added = direction.alpha * delta.float()
                    parts[name] = parts[name] + added if name in parts else added
    return {
        layer: LayerDelta(
            **{name: total.to(device, dtype) for name, total in parts.items()},
            inv_freq=frequencies[layer] if "unrotated_key" in parts and frequencies is not None else None,
        )
        for layer, parts in sums.items()
        if parts
    }


class SteeredCache(DynamicCache):
    """A DynamicCache that adds steering deltas to the K/V of every position from ``start`` on, as the
    model computes them; positions before ``start`` (a pack's K/V, or facts given as text) stay as they are.

    ``start`` is one position for every row, or a tensor of one per row (a left-padded batch). An unrotated key
    delta is rotated to each position's RoPE position: its cache index less the row's ``padding`` (left-padded
    rows count their positions from their first real token, as the model's position ids do)."""

    def __init__(self, deltas: LayerDeltas, start: int | torch.Tensor, padding: torch.Tensor | None = None) -> None:
        super().__init__()
        self.deltas = deltas
        self.start = start
        self.padding = padding

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        delta = self.deltas.get(layer_idx)
        if delta is not None:
            cached = self.get_seq_length(layer_idx)
            steer = self._steered_positions(cached, key_states)
            if steer is not None:
                key_states = _add_where(key_states, delta.key, steer)
                if delta.unrotated_key is not None and delta.inv_freq is not None:
                    key_states = key_states + steer[:, None, :, None].to(key_states.dtype) * self._rotated(delta, cached, key_states)
                value_states = _add_where(value_states, delta.value, steer)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _rotated(self, delta: LayerDelta, cached: int, states: torch.Tensor) -> torch.Tensor:
        """The unrotated key delta at each incoming position's RoPE position: [batch or 1, heads, positions, head_dim]."""
        assert delta.unrotated_key is not None and delta.inv_freq is not None
        indices = torch.arange(cached, cached + states.shape[-2])
        padding = self.padding.cpu() if self.padding is not None else torch.zeros(1, dtype=torch.long)
        rows = []
        for pad in padding.tolist():
            positions = indices - pad
            spread = delta.unrotated_key[:, None, :].expand(-1, len(positions), -1)
            rows.append(rotate_keys(spread, delta.inv_freq, positions))
        return torch.stack(rows).to(states.device, states.dtype)

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
