"""Max-min fair shares of a scarce resource among principals, so that no caller, and no crowd of callers, can starve
another.

A resource has ``capacity`` units (threads, transfer or generation slots, bulk tickets, connections). The rule, the
same for every resource, with k the principals that hold a unit or asked for one lately (``ask_seconds``), the
caller included:

1. a principal's share is ``capacity // k``, at least 1; one at or above its share gets no new unit while another
   of the k is below its share;
2. among the principals below their share, units go first to the one holding fewest, then to the one asking
   longest: a principal gets a unit only while more are free than other askers rank before it;
3. the last ``reserve`` free units go only to principals holding none, so that a newcomer is served at once while
   they last (and otherwise within one holding time, by rule 2);
4. nobody holds more than ``per_principal`` (a ceiling an operator may set; by default the capacity).

A refused principal is told to retry after ``retry_seconds`` and counts as asking for ``ask_seconds`` (a little more
than that), so the units others give back are kept for it. The units are bounded in time by the pacing rules of
each resource, so a principal below its share is served within one holding time plus a retry, whatever the number
of greedy principals beside it. A principal is a token's name with ``--auth``; without it, the caller's host
(fairness is then per address: a caller with several addresses is several principals).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from packstore.errors import LimitExceeded

RETRY_SECONDS = 0.5  # what a refusal tells the caller to wait before asking again
ASK_SECONDS = 2.0  # how long a refused principal still counts as asking: a few retries' worth


@dataclass(frozen=True)
class ShareRule:
    """The numbers of one resource: ``capacity`` units, at most ``per_principal`` each, the last ``reserve`` free
    only for principals holding none; refusals say ``retry_seconds`` and are remembered ``ask_seconds``."""

    capacity: int
    per_principal: int
    reserve: int
    retry_seconds: float = RETRY_SECONDS
    ask_seconds: float = ASK_SECONDS

    @staticmethod
    def default(capacity: int, per_principal: int = 0) -> ShareRule:
        """``capacity`` units with a newcomers' reserve of a quarter (at least 2, always leaving 1 to take: no two
        principals can starve a third) and, unless given, no ceiling per principal beyond what the max-min rule sets."""
        if capacity < 1:
            raise ValueError(f"a shared resource needs at least 1 unit, got {capacity}")
        reserve = min(capacity - 1, max(2, capacity // 4))
        return ShareRule(capacity, min(per_principal or capacity, capacity), reserve)


class Shares:
    """The units of one resource (``name``, as errors and metrics say it) and who holds them, under ``rule``.
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, name: str, rule: ShareRule, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.rule = name, rule
        self._held: Counter[str] = Counter()
        self._asking: dict[str, tuple[float, float]] = {}  # principal -> (first refused, last refused), while live
        self._lock = threading.Lock()
        self._clock = clock

    def try_take(self, principal: str) -> bool:
        """Take a unit for ``principal`` if the rule allows it now; whether it did (a refusal is remembered as an ask)."""
        with self._lock:
            now = self._clock()
            if self._refusal_reason(principal, now) is None:
                self._held[principal] += 1
                self._asking.pop(principal, None)
                return True
            first, _ = self._asking.get(principal, (now, now))
            self._asking[principal] = (first, now)
            return False

    def _refusal_reason(self, principal: str, now: float) -> str | None:
        """Which rule refuses ``principal`` a unit now (``REASONS``' keys), or None when it may take one."""
        rule, held = self.rule, self._held[principal]
        free = rule.capacity - sum(self._held.values())
        if held >= rule.per_principal:
            return "limit"
        if free < 1:
            return "none free"
        if held and free - 1 < rule.reserve:
            return "reserve"
        self._asking = {p: times for p, times in self._asking.items() if now - times[1] <= rule.ask_seconds}
        active = set(self._held) | set(self._asking) | {principal}
        share = max(1, rule.capacity // len(active))
        if held >= share and any(self._held[p] < share for p in active if p != principal):
            return "fair share"
        mine = (held, self._asking.get(principal, (now, now))[0])
        before = sum(1 for p, (first, _) in self._asking.items() if p != principal and (self._held[p], first) < mine)
        return None if free - (rule.reserve if held else 0) > before else "queue"

    def give_back(self, principal: str) -> None:
        """Return one of ``principal``'s units; if it is asking for more, it queues again from now (its place was
        earned at its former holding)."""
        with self._lock:
            self._held[principal] -= 1
            if self._held[principal] <= 0:
                del self._held[principal]
            if principal in self._asking:
                now = self._clock()
                self._asking[principal] = (now, now)

    @contextmanager
    def slot(self, principal: str, what: str) -> Iterator[None]:
        """Hold one unit for ``principal`` while the context runs; LimitExceeded (``what`` names the refused call)
        when the rule refuses it."""
        if not self.try_take(principal):
            raise self.refused(principal, what)
        try:
            yield
        finally:
            self.give_back(principal)

    def refused(self, principal: str, what: str) -> LimitExceeded:
        """The error for a refused ``principal``: its message (``refusal``) and ``retry_after_seconds``."""
        return LimitExceeded(self.refusal(principal, what), retry_after_seconds=f"{self.rule.retry_seconds:g}")

    def refusal(self, principal: str, what: str) -> str:
        """Why ``principal`` got no unit, naming only its own use, and when to retry."""
        rule = self.rule
        with self._lock:
            held = self._held.get(principal, 0)
            reason = self._refusal_reason(principal, self._clock()) or "queue"  # (a unit came free since: retry at once)
        why = {
            "limit": f"{principal} already holds its share of {rule.per_principal} {self.name}",
            "none free": f"all {rule.capacity} {self.name} are in use (units given back go first to the callers holding fewest)",
            "reserve": f"{principal} holds {held} of the {self.name}, and the last {rule.reserve} are kept for callers holding none",
            "fair share": f"{principal} already holds {held} of the {rule.capacity} {self.name}, its fair share while others wait",
            "queue": f"{principal} holds {held} of the {self.name}, and the free ones are kept for callers that asked first",
        }[reason]
        return f"{what}: {why}; retry in {rule.retry_seconds:g} s"

    def held(self, principal: str) -> int:
        with self._lock:
            return self._held.get(principal, 0)

    @property
    def asking(self) -> int:
        """How many principals were refused within ``ask_seconds`` and have not been served since."""
        with self._lock:
            now = self._clock()
            return sum(1 for _, last in self._asking.values() if now - last <= self.rule.ask_seconds)

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
