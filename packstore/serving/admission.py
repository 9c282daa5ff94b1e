"""What a gRPC call must pass before it is given a thread: its token, checked from the metadata alone, and its
principal's shares of the server's in-flight calls and, for a cheap call, of the cheap-call threads. The anonymous
services (health, reflection) pass a per-host share of their own instead. Nothing is taken for a caller before its
token is checked; a refusal names the caller's own use (``security/shares.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass

from packstore.errors import PackstoreError
from packstore.security.auth import Auth
from packstore.security.shares import ShareRule, Shares, principal_key

CHEAP_THREADS = 8  # the threads that only cheap calls (stats, lists, status) run on, apart from the transfers'
ANONYMOUS_CALLS = 64  # health and reflection calls open at once, all hosts together (a host: half of them)

Metadata = tuple[tuple[str, str | bytes], ...]
Refused = Callable[[str, PackstoreError, str], None]  # (method, error, peer): count and log a refused call


@dataclass
class Admission:
    """The admission rule of one server. ``role_of``: the role each method needs (``security/auth.py``);
    ``heavy``: the methods that run on the transfer threads (the rest are cheap calls); ``in_flight``: the capacity
    of calls in flight, of every kind, shared among principals; ``refused``: told of each call refused here."""

    auth: Auth
    role_of: Mapping[str, str]
    heavy: frozenset[str]
    in_flight: int
    refused: Refused

    def __post_init__(self) -> None:
        self.calls = Shares("calls in flight", ShareRule.default(self.in_flight))
        self.cheap = Shares("cheap-call threads", ShareRule.default(CHEAP_THREADS))
        self.anonymous = Shares("health and reflection calls", ShareRule.default(ANONYMOUS_CALLS, ANONYMOUS_CALLS // 2))

    def admit(self, method: str, metadata: Metadata, peer: str) -> tuple[ExitStack, str]:
        """The unit of calls in flight ``method``'s call holds until it ends (close the stack to give it back) and
        whom it is counted for; the PackstoreError its client is answered with when its token or the share refuses
        it (reported to ``refused``). A cheap call then waits its turn for a cheap-call thread (``Bridge``)."""
        try:
            principal = self.auth.authenticate(metadata, method, self.role_of[method])
            key = principal_key(principal.token, self.auth.enabled, peer)
            held = ExitStack()
            held.enter_context(self.calls.slot(key, method))
            return held, key
        except PackstoreError as exc:
            self.refused(method, exc, peer)
            raise

    def admit_anonymous(self, method: str, peer: str) -> ExitStack:
        """The unit a health or reflection call holds, counted for its host; LimitExceeded past the host's share."""
        held = ExitStack()
        held.enter_context(self.anonymous.slot(principal_key("", False, peer), method))
        return held
