"""Fair shares of a scarce resource among principals, so that no caller can starve the others.

A resource has ``capacity`` slots (threads for transfers, bulk transfers, uploads, generations). The rule, the same
for every resource: a principal holds at most ``per_principal`` slots at once, and the last ``reserve`` free slots go
only to principals that hold none. So principals already served, however many and however hostile, leave at least
``reserve`` slots for newcomers: with ``reserve`` >= 2, no two principals can starve a third. A principal is a
token's name with ``--auth``; without it, the caller's address, and fairness is best-effort (one client can take
several addresses).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from packstore.errors import LimitExceeded


@dataclass(frozen=True)
class ShareRule:
    """The numbers of one resource: ``capacity`` slots, at most ``per_principal`` each, ``reserve`` for newcomers."""

    capacity: int
    per_principal: int
    reserve: int

    @staticmethod
    def default(capacity: int, per_principal: int = 0) -> ShareRule:
        """``capacity`` slots with a reserve of a quarter (at least 2, leaving at least 1 to take) and, unless given,
        half of them per principal (at least 1, never eating into the reserve)."""
        if capacity < 1:
            raise ValueError(f"a shared resource needs at least 1 slot, got {capacity}")
        reserve = min(capacity - 1, max(2, capacity // 4))
        cap = per_principal or max(1, min(capacity - reserve, capacity // 2))
        return ShareRule(capacity, min(cap, capacity), reserve)


class Shares:
    """The slots of one resource (``name``, as errors and metrics say it) and who holds them, under ``rule``."""

    def __init__(self, name: str, rule: ShareRule) -> None:
        self.name, self.rule = name, rule
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def try_take(self, principal: str) -> bool:
        """Take a slot for ``principal`` if the rule allows it now; whether it did."""
        with self._lock:
            held, free = self._held[principal], self.rule.capacity - sum(self._held.values())
            if free < 1 or held >= self.rule.per_principal or (held and free - 1 < self.rule.reserve):
                if not held:
                    del self._held[principal]
                return False
            self._held[principal] += 1
            return True

    def give_back(self, principal: str) -> None:
        with self._lock:
            self._held[principal] -= 1
            if self._held[principal] <= 0:
                del self._held[principal]

    @contextmanager
    def slot(self, principal: str, what: str) -> Iterator[None]:
        """Hold one slot for ``principal`` while the context runs; LimitExceeded (``what`` names the refused call)
        when the rule refuses it."""
        if not self.try_take(principal):
            raise LimitExceeded(self.refusal(principal, what))
        try:
            yield
        finally:
            self.give_back(principal)

    def refusal(self, principal: str, what: str) -> str:
        """Why ``principal`` got no slot, for its error message."""
        with self._lock:
            held, free = self._held.get(principal, 0), self.rule.capacity - sum(self._held.values())
        rule = self.rule
        if held >= rule.per_principal:
            return f"{what}: {principal} already holds its share of {rule.per_principal} {self.name}; retry when one ends"
        if free < 1:
            return f"{what}: all {rule.capacity} {self.name} are in use; retry later"
        kept = f"the last {rule.reserve} are kept for callers holding none"
        return f"{what}: {principal} holds {held} of the {self.name}, and {kept}; retry when one ends"

    def held(self, principal: str) -> int:
        with self._lock:
            return self._held.get(principal, 0)

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._held.values())


def principal_key(token: str, authenticated: bool, peer: str) -> str:
    """Whom a call's share is counted for: with tokens, the token's name; without, the caller's host (a gRPC peer
    such as ``ipv4:127.0.0.1:5000`` or an HTTP client's address, its port dropped)."""
    if authenticated:
        return f"token:{token}"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer or "unknown"
