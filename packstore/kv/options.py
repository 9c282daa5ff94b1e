"""Options of the model-side commands, without torch, so the CLI parses them before any model loads:
steering strengths, layer ranges and targets (applied by ``packstore.kv.steer``), and the defaults of
adapter training (``packstore.kv.packet``)."""

from __future__ import annotations

import math
import re

from packstore.errors import InvalidInput

STEER_TARGETS = ("values", "keys", "both")  # what steering adds to: values (the method), or the key control
MAX_ALPHA = 10.0  # |alpha| bound: far past where the models stay coherent (docs/evaluation.md), finite
_LAYER_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")
ADAPTER_TOKENS = 4  # soft tokens before and after each part
ADAPTER_STEPS = 300
ADAPTER_LEARNING_RATE = 0.03


def middle_third(layers: int) -> tuple[int, int]:
    """The middle third of ``layers`` layers as an inclusive range: 10-19 of 30, 6-11 of 18."""
    first = layers // 3
    return first, max(first, 2 * layers // 3 - 1)


def parse_layers(text: str) -> tuple[int, int]:
    """``FIRST-LAST`` (0-based, inclusive) -> (first, last); InvalidInput otherwise."""
    match = _LAYER_RANGE.fullmatch(text or "")
    if not match or int(match[1]) > int(match[2]):
        raise InvalidInput(f"invalid layer range {text!r}: write FIRST-LAST, 0-based and inclusive, with FIRST <= LAST")
    return int(match[1]), int(match[2])


def check_alpha(alpha: float, ref: str = "") -> float:
    """A steering strength: finite, and at most ``MAX_ALPHA`` in size (negative steers the other way)."""
    what = f" for {ref!r}" if ref else ""
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or abs(alpha) > MAX_ALPHA:
        raise InvalidInput(f"steering strength {alpha!r}{what} must be a finite number from {-MAX_ALPHA:g} to {MAX_ALPHA:g}")
    return float(alpha)


def parse_steer(text: str) -> tuple[str, float]:
    """``REF[:ALPHA]`` -> (ref, alpha). Names may hold ``:``, so ALPHA is what follows the last ``:``
    only when it parses as a number; otherwise the whole text is the ref and alpha is 1."""
    ref, alpha = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep:
        try:
            ref, alpha = head, float(tail)
        except ValueError:
            pass
    if not ref.strip():
        raise InvalidInput(f"steering {text!r} names no pack: write REF or REF:ALPHA")
    return ref, check_alpha(alpha, ref)
