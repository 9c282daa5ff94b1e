"""Plans made without blocking the engine's scheduler: a request whose pack header is not in memory is planned on a
small pool of lookup threads, and the scheduler asks again on a later step (vLLM: ``get_num_new_matched_tokens``
returns None meanwhile). A lookup that takes longer than its deadline is given up: the request runs without the pack
and the plan says why; a store that hangs holds a lookup thread, never the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from packstore.answering.pack_headers import HeaderNeeded
from packstore.answering.paged import PackMatcher, PackPlan
from packstore.answering.transfer_params import transfer_fields

LOOKUP_THREADS = 4  # lookups in flight at once; more wait for a thread (within their own deadline)


@dataclass
class _Lookup:
    """A request's plan being made on a lookup thread, and when it is given up."""

    future: Future[PackPlan | None]
    need: HeaderNeeded
    deadline: float
    mode: str


class PlanLookups:
    """``plan(request_id, prompt, params, ...)``: the request's plan at once when memory has what it needs, else None
    while a lookup is in flight, then the plan (or, past ``seconds``, a plan without the pack and the reason), logged
    once when it is handed out. Called from one thread (the scheduler's)."""

    def __init__(
        self, matcher: PackMatcher, seconds: float, *, threads: int = LOOKUP_THREADS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.matcher, self.seconds, self._clock = matcher, seconds, clock
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="packstore-lookup")
        self._pending: dict[str, _Lookup] = {}

    def plan(
        self, request_id: str, prompt: Sequence[int], params: object, *, cache_salt: object = None, refusal: str | None = None
    ) -> PackPlan | None:
        """``request_id``'s plan (``PackMatcher.plan`` of the rest), or None while its header is being looked up."""
        pending = self._pending.get(request_id)
        if pending is None:
            decide = partial(self.matcher.decide, list(prompt), params, cache_salt=cache_salt, refusal=refusal)
            try:
                return self.matcher.logged(decide(lookup=False))
            except HeaderNeeded as need:  # raised only once ``params`` was read as a JSON object
                deadline = self._clock() + self.seconds
                future = self._pool.submit(self._look_up, decide, deadline)
                mode = "explicit" if transfer_fields(params)[0].get("pack") is not None else "automatic"
                self._pending[request_id] = _Lookup(future, need, deadline, mode)
                return None
        looked_up = pending.future.result() if pending.future.done() else None
        if looked_up is not None:
            del self._pending[request_id]
            return self.matcher.logged(looked_up)
        if self._clock() < pending.deadline:
            return None
        del self._pending[request_id]  # the thread finishes on its own (the store's own deadline bounds it)
        return self.matcher.logged(self._given_up(pending))

    def _look_up(self, decide: Callable[..., PackPlan], deadline: float) -> PackPlan | None:
        """The plan, reading the store as needed (on a lookup thread); None when its deadline passed before a thread
        was free (the request was given up already)."""
        if self._clock() >= deadline:
            return None
        return decide(lookup=True)

    def _given_up(self, pending: _Lookup) -> PackPlan:
        need = pending.need
        reason = (
            f"the store did not answer the lookup of pack {need.ref[-12:]} in namespace {need.namespace!r} within "
            f"{self.seconds:g} s (lookup_seconds): the request ran without the pack"
        )
        if pending.mode == "explicit":
            return PackPlan(ref=need.ref, namespace=need.namespace, mode="explicit", reason=reason)
        return PackPlan(key=need.ref, namespace=need.namespace, mode="automatic", reason=reason)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s lookup (the request finished or was aborted while it was in flight)."""
        self._pending.pop(request_id, None)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
