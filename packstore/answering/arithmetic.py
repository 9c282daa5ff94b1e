"""Whose arithmetic a pack's K/V is, and when it may enter a paged engine's prefix cache (docs/protocol.md, "vLLM
connector", the arithmetic rule).

Blocks a connector loads stay in vLLM's prefix cache under the prompt's token hashes and serve later requests with the
same tokens. K/V of the engine's own arithmetic is what those requests would compute; approximate K/V (a RoPE splice)
is not, so it loads only in a request whose ``cache_salt`` carries the pack's digest (``pack_salt``): vLLM hashes the
salt into the first block, so those blocks serve only requests that send the same salt. Exact K/V of another engine's
arithmetic (packstore's transformers build, another vLLM version or block size) follows a connector setting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packstore.format.header import PackHeader

SALT_PREFIX = "ps1-"
SALT_HEX = 40
MAX_CACHE_SALT = 128  # vLLM's OpenAI server refuses a longer cache_salt
_REFUSED_IN_SALT = ("@", "/", "\\", "\x00")  # vLLM's OpenAI server refuses a cache_salt holding any of these

ENGINE, OTHER, APPROXIMATE = "engine", "other", "approximate"  # the three arithmetics, most preferred first
ARITHMETICS = (ENGINE, OTHER, APPROXIMATE)
OTHER_EXACT_POLICIES = ("unsalted", "salted")  # exact K/V of another engine: loads unsalted (the answer says so), or salted


def pack_salt(key: str) -> str:
    """The salt naming pack ``key`` in a ``cache_salt``: ``ps1-`` and the first 40 hex digits of the key's sha256."""
    return SALT_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()[:SALT_HEX]


def cache_salt_for(key: str, own_salt: str | None = None) -> str:
    """The ``cache_salt`` a client sends with a request for pack ``key``: its own salt, if any, then ``pack_salt(key)``;
    ValueError when the whole would not pass vLLM's checks (at most 128 characters, none of ``@ / \\`` or NUL)."""
    salt = (own_salt or "") + pack_salt(key)
    if len(salt) > MAX_CACHE_SALT:
        raise ValueError(f"cache_salt would be {len(salt)} characters, over vLLM's {MAX_CACHE_SALT}: shorten the client's own salt")
    if any(char in salt for char in _REFUSED_IN_SALT):
        raise ValueError("a cache_salt may not hold '@', '/', '\\' or NUL (vLLM refuses it): choose another own salt")
    return salt


def carries(cache_salt: object, key: str) -> bool:
    """Whether a request's ``cache_salt`` ends with pack ``key``'s salt (anything not a string carries none)."""
    return isinstance(cache_salt, str) and cache_salt.endswith(pack_salt(key))


@dataclass(frozen=True)
class EngineArithmetic:
    """The serving engine's own arithmetic, as a pack header records it (``engine``), with the dtype it serves in;
    ``version`` None where the engine is not known (then no pack is of its arithmetic)."""

    name: str
    version: str | None
    block_size: int
    dtype: str

    def owns(self, header: PackHeader) -> bool:
        """Whether ``header``'s exact K/V was computed by this engine, version, block size and dtype."""
        recorded: Mapping[str, Any] = header.engine or {}
        own = {"name": self.name, "version": self.version, "block_size": self.block_size}
        return self.version is not None and dict(recorded) == own and header.dtype == self.dtype


def arithmetic_of(header: PackHeader, engine: EngineArithmetic) -> str:
    """``ENGINE`` (exact, computed by this engine), ``OTHER`` (exact, another engine's) or ``APPROXIMATE``."""
    if header.composition != "exact":
        return APPROXIMATE
    return ENGINE if engine.owns(header) else OTHER


def salt_refusal(arithmetic: str, key: str, cache_salt: object, other_exact: str) -> str | None:
    """Why K/V of ``arithmetic`` may not load in a request with ``cache_salt`` (``other_exact``: the connector's policy
    for exact K/V of another engine), or None."""
    if arithmetic == ENGINE or carries(cache_salt, key):
        return None
    if arithmetic == OTHER and other_exact == "unsalted":
        return None
    what = "is approximate K/V (a composition spliced without recompute)" if arithmetic == APPROXIMATE else (
        "is exact K/V of another engine's arithmetic and this connector is set to salt it (other_exact: \"salted\")"
    )
    return (
        f"pack {key[-12:]} {what}: it loads only in a request whose cache_salt ends with {pack_salt(key)}, so that its "
        "blocks in vLLM's prefix cache serve no other request"
    )


def preference(arithmetic: str, tokens: int, key: str) -> tuple[int, int, str]:
    """Sort key of packs that all match a prompt, best first: the longest, then this engine's arithmetic, another
    engine's exact, approximate; then by key, so that the choice never depends on the order packs were listed."""
    return (-tokens, ARITHMETICS.index(arithmetic), key)
