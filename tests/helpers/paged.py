"""The tiny test model as a paged-attention engine serves it, for the vLLM connector's engine-free tests."""

from __future__ import annotations

from typing import Any

from packstore.answering.paged import ServedModel


def served_tiny(tiny_lm: Any, block_size: int, engine_version: str | None = None) -> ServedModel:
    """The tiny model served in float32 with ``block_size``-token cache blocks (by vLLM ``engine_version``, if given)."""
    config = tiny_lm.model.config
    return ServedModel(
        model_fp=tiny_lm.model_fp,
        template_fp=tiny_lm.template_fp,
        dtype="float32",
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        block_size=block_size,
        engine_version=engine_version,
    )
