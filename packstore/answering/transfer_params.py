"""What a paged engine's request brings besides its prompt, read without trusting it: ``kv_transfer_params`` (any JSON,
from any client) and the request's own settings that rule a pack out. Each problem is a reason for the answer, never an
exception, since these are read in the engine's scheduler (an exception there stops the engine)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _kind(value: object) -> str:
    """A JSON-ish name for ``value``'s type, for reasons a client reads."""
    names = {str: "a string", list: "a list", tuple: "a list", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")


def transfer_fields(raw: object) -> tuple[dict[str, Any], str | None]:
    """The fields of a request's ``kv_transfer_params`` (absent: none), or none and why they cannot be read."""
    if raw is None:
        return {}, None
    if not isinstance(raw, Mapping):
        return {}, f"kv_transfer_params must be a JSON object, not {_kind(raw)}: the request ran without a pack"
    if not all(isinstance(name, str) for name in raw):
        return {}, "kv_transfer_params must be a JSON object with string field names: the request ran without a pack"
    return dict(raw), None


def engine_refusal(*, lora: str | None, skips_prefix_cache: bool) -> str | None:
    """Why the engine cannot take a pack's K/V for a request, whatever the pack: it runs a LoRA adapter (``lora``: its
    name), or reads no cached K/V (vLLM then discards the connector's tokens); or None."""
    if lora is not None:
        return f"the request runs LoRA adapter {lora!r}, and packs hold the base model's K/V, not the adapter's"
    if skips_prefix_cache:
        return (
            "the request reads no cached K/V (prompt_logprobs, or skip_reading_prefix_cache), so vLLM would discard "
            "the pack's tokens: it ran without the pack"
        )
    return None
