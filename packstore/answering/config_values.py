"""Typed reads of a JSON settings object (the vLLM connector's ``kv_connector_extra_config``): every value is checked
at start and a wrong one stops the engine with a ValueError naming the key, the value and what it must be, since a
value read loosely (the string ``"false"`` as true) serves requests other than as configured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ConfigValues:
    """The values of ``extra``, read by key and type; ``where`` names the settings in messages."""

    def __init__(self, extra: Mapping[str, Any], where: str) -> None:
        self.extra, self.where = extra, where

    def _wrong(self, name: str, must: str) -> ValueError:
        return ValueError(f"{self.where} {name!r} must be {must}, not {self.extra[name]!r}")

    def text(self, name: str) -> str | None:
        """A non-empty string, or None when absent or null."""
        value = self.extra.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise self._wrong(name, "a non-empty string")
        return value

    def texts(self, name: str) -> tuple[str, ...]:
        """A list of non-empty strings (absent or null: none)."""
        value = self.extra.get(name)
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) and v for v in value):
            raise self._wrong(name, "a list of non-empty strings")
        return tuple(value)

    def flag(self, name: str, default: bool) -> bool:
        """A JSON boolean (``"false"``, ``0`` and other stand-ins are refused, not guessed)."""
        value = self.extra.get(name, default)
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false (a JSON boolean)")
        return value

    def count(self, name: str, default: int) -> int:
        """A whole number, 0 or more."""
        value = self.extra.get(name, default)
        if type(value) is not int or value < 0:
            raise self._wrong(name, "a whole number, 0 or more")
        return value

    def seconds(self, name: str, default: float) -> float:
        """A positive number of seconds."""
        value = self.extra.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or value == float("inf"):
            raise self._wrong(name, "a positive number of seconds")
        return float(value)

    def choice(self, name: str, choices: Sequence[str]) -> str:
        """One of ``choices``; the first when absent."""
        value = self.extra.get(name, choices[0])
        if not isinstance(value, str) or value not in choices:
            raise self._wrong(name, "one of " + ", ".join(f'"{c}"' for c in choices))
        return value
