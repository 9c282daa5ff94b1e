"""Re-position stored keys: rotate post-RoPE keys by a position offset, per layer, exactly as the model would.

RoPE rotates each (i, i + d/2) pair of a key by ``position * inv_freq[i]``; rotations compose, so a key
computed at position p becomes the key at p + delta by one more rotation of ``delta * inv_freq``. That
holds only when the model's RoPE is a pure rotation with fixed frequencies: ``default``, ``linear``
(frequencies divided by a factor) and ``llama3`` (frequencies rescaled once) are; types whose
frequencies depend on the sequence length (``dynamic``, ``longrope``) or that scale attention
(``yarn``) are refused. Gemma 3 has two sets of frequencies, for its local and its global layers.
"""

from __future__ import annotations

import torch

from packstore.errors import InvalidInput
from packstore.kv.models import LoadedModel

PURE_ROTATIONS = ("default", "linear", "llama3")
SUPPORTED_MODEL_TYPES = ("llama", "gemma3_text", "gemma3")


def _rope_type(parameters: dict) -> str:
    return parameters.get("rope_type") or parameters.get("type") or "default"


def layer_frequencies(lm: LoadedModel) -> list[torch.Tensor]:
    """Each layer's RoPE inverse frequencies (float64, on CPU); InvalidInput when RoPE is not a pure rotation."""
    config = lm.model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidInput(
            f"RoPE re-positioning supports the architectures {', '.join(SUPPORTED_MODEL_TYPES)}, not {model_type!r}"
        )
    rotary = lm.model.get_decoder().rotary_emb
    layers = text_config.num_hidden_layers
    if model_type == "llama":
        parameters = {"": text_config.rope_parameters}
        per_layer = [""] * layers
    else:
        parameters = dict(text_config.rope_parameters)
        per_layer = list(text_config.layer_types)
    frequencies: dict[str, torch.Tensor] = {}
    for layer_type, params in parameters.items():
        rope_type = _rope_type(params)
        suffix = f"{layer_type}_" if layer_type else ""
        scaling = getattr(rotary, f"{suffix}attention_scaling")
        if rope_type not in PURE_ROTATIONS or float(scaling) != 1.0:
            raise InvalidInput(
                f"cannot re-position keys of {lm.name!r}: its RoPE type {rope_type!r}"
                f"{f' ({layer_type})' if layer_type else ''} with attention scaling {float(scaling)} is not a pure "
                f"rotation (supported: {', '.join(PURE_ROTATIONS)} without attention scaling)"
            )
        frequencies[layer_type] = getattr(rotary, f"{suffix}inv_freq").detach().to("cpu", torch.float64)
    return [frequencies[layer_type] for layer_type in per_layer]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, inv_freq: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
    """``keys`` ([..., tokens, head_dim], post-RoPE) moved ``delta`` positions later (earlier if negative); a tensor
    ``delta`` of one offset per token moves each token by its own (rotating a position-free vector by its position
    is this with the positions as offsets).

    The angle is formed in float64 and the rotation done in float32, then cast back to the keys' dtype.
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    if isinstance(delta, torch.Tensor):
        offsets = delta.to("cpu", torch.float64)[:, None]  # [tokens, 1]: one angle set per token
    else:
        offsets = torch.tensor(float(delta), dtype=torch.float64)
    angles = offsets * inv_freq.to(torch.float64)
    angles = torch.cat((angles, angles), dim=-1)
    cos = angles.cos().to(torch.float32).to(keys.device)
    sin = angles.sin().to(torch.float32).to(keys.device)
    k = keys.to(torch.float32)
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)
