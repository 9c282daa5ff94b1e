"""The model's device shared fairly: a FIFO lock that generations hold one decode step at a time (issue 53).

One model answers for every caller of a worker, on one device. A generation holds the device for its prefill and
then for one decode step at a time: between two steps it passes the device to whoever waits (``Seat.pass_on``) and
queues again behind them, so the generations running now take steps in turn and a short answer interleaves with long
ones instead of waiting for them to end. Other device work (a composition's prefill, a bank's facts pack, the
comparisons of ``compare_rag``'s prefills) holds the lock whole through ``with lock:``, queued in the same order.
Nothing waits for I/O with the device held: a generation gives it up while it waits for a layer of a pack still
arriving from the store or for its reader to take its tokens (``kv.inject._off_device``), and an answer whose client
has gone (``Cancel``) stops at its next step (issue 62).

The order is FIFO over the requests for the device (a ticket lock's: each waiter is served in the order it asked,
and handed the device directly, so no one overtakes a waiter), not round-robin over principals: the worker's
admission already bounds what a principal runs (its share of the generation slots, ``security/shares.py``), so
each running generation getting one step per round gives each principal at most its share of slots' worth of the
device, and a generation waits at most one step of each other running generation per token; the model layer needs
to know nothing of callers for that. (Round-robin over principals would give a principal with one generation half
the device beside another with two, instead of a third: a difference bounded by the per-principal share.)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class Left(Exception):
    """A seat was left (its reader went away) while it waited for the device, or an answer's client went
    (``Cancel``): what it ran has stopped, holding nothing."""


class Cancel:
    """Set (``cancel``, from any thread) once an answer's client has gone: each ``when_cancelled`` action runs then (a
    generation's seat left, its token queue closed), so what the answer runs stops at its next step, prefill pass or
    wait, and ``check`` raises Left from then on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._actions: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            actions, self._actions = self._actions, []
        for action in actions:
            action()

    def when_cancelled(self, action: Callable[[], None]) -> None:
        """Run ``action`` once cancelled (now, if it is)."""
        with self._lock:
            if not self.cancelled:
                self._actions.append(action)
                return
        action()

    def check(self, *_: object) -> None:
        """Left once cancelled (its arguments ignored: a prefill's ``after_pass``, say)."""
        if self.cancelled:
            raise Left


class DeviceLock:
    """A FIFO lock over the model's device, held whole (``with lock:``, ``acquire``/``release``, as a
    ``threading.Lock``) or one step at a time through a ``Seat`` (``seat()``). Released, it goes to the waiter that
    asked first; ``handoffs`` counts the times it went straight from one holder to a waiting one."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._holder: Seat | None = None
        self._queue: deque[Seat] = deque()
        self.handoffs = 0

    def seat(self) -> Seat:
        """A place in this lock's queue for one generation (or one holder)."""
        return Seat(self)

    def locked(self) -> bool:
        return self._holder is not None

    @property
    def waiting(self) -> int:
        """How many wait for the device now (the holder not counted)."""
        with self._mutex:
            return len(self._queue)

    def acquire(self) -> bool:
        """Wait for the device behind those waiting, and hold it (until ``release``)."""
        self.seat().take()
        return True

    def release(self) -> None:
        """Give the device to the first waiter (or free it)."""
        with self._mutex:
            if self._holder is None:
                raise RuntimeError("release of a device lock that is not held")
            self._hand_on()

    def __enter__(self) -> DeviceLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _hand_on(self) -> None:
        """(under the mutex) The device to the first waiter, or to none."""
        if self._queue:
            self._holder = self._queue.popleft()
            self.handoffs += 1
            self._holder._granted.set()
        else:
            self._holder = None


class Seat:
    """One generation's place at a ``DeviceLock``: ``take`` the device, ``pass_on`` between steps, ``release`` at the
    end; ``leave`` (from any thread) makes a wait in progress or to come return at once without the device."""

    def __init__(self, lock: DeviceLock) -> None:
        self._lock = lock
        self._granted = threading.Event()
        self.left = False
        self.passes = 0  # times this seat let others go before it

    @property
    def held(self) -> bool:
        return self._lock._holder is self

    def take(self) -> bool:
        """Wait for the device behind those waiting, and hold it; False (holding nothing) once left."""
        lock = self._lock
        with lock._mutex:
            if self.left:
                return False
            if lock._holder is None and not lock._queue:
                lock._holder = self
                return True
            self._granted.clear()
            lock._queue.append(self)
        return self._wait()

    def pass_on(self, saving: Callable[[], Callable[[], None]] | None = None) -> None:
        """Between two steps: when others wait for the device, let them take it first and wait for it again (at the
        back of the queue); with none waiting, keep it. ``saving``, called only when the device passes, saves what
        the others' turns may change (a random generator's state) and returns what restores it once the device is
        back. Left, before or meanwhile: Left (holding nothing)."""
        lock = self._lock
        with lock._mutex:
            if lock._holder is not self:
                raise RuntimeError("pass_on by a seat that does not hold the device")
            if self.left:  # (its reader went away since its last step: the device goes on, the generation ends)
                lock._hand_on()
                raise Left
            if not lock._queue:
                return
            restore = saving() if saving is not None else None
            self.passes += 1
            self._granted.clear()
            lock._queue.append(self)
            lock._hand_on()
        if not self._wait():
            raise Left
        if restore is not None:
            restore()

    def release(self) -> None:
        """Give the device on, if this seat holds it."""
        lock = self._lock
        with lock._mutex:
            if lock._holder is self:
                lock._hand_on()

    def leave(self) -> None:
        """(any thread) Stop waiting: a wait in progress or to come returns without the device. A seat holding the
        device keeps it until ``release``."""
        lock = self._lock
        with lock._mutex:
            self.left = True
            if self in lock._queue:
                lock._queue.remove(self)
            self._granted.set()

    def _wait(self) -> bool:
        self._granted.wait()
        with self._lock._mutex:
            return self._lock._holder is self
