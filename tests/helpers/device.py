"""Generations taking turns on one DeviceLock, as the tests start them: the device held while each asks for it; a store
that stalls, and a count of the model's steps, to see what holds the device while a generation waits (issue 62)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from packstore.kv.device import DeviceLock
from packstore.store import LmdbStore

STALL_SECONDS = 300.0  # the longest a StalledStore holds a read back (a test that never releases it still ends)


def wait_for(condition: Callable[[], object], what: str, seconds: float) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``seconds`` (never reached when a test passes)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)


def take_turns(device: DeviceLock, calls: Sequence[Callable[[], object]], seconds: float) -> dict[int, object]:
    """Run each of ``calls`` on a thread of its own, started while the test holds ``device`` and each waiting for it
    before the next starts, so they share the device from the same start in that order; their results by index."""
    results: dict[int, object] = {}
    threads: list[threading.Thread] = []
    with device:
        for index, call in enumerate(calls):
            thread = threading.Thread(target=lambda index=index, call=call: results.__setitem__(index, call()))
            thread.start()
            threads.append(thread)
            wait_for(lambda: device.waiting == len(threads), f"generation {index} waits for the device", seconds)
    for thread in threads:
        thread.join(seconds)
    return results


class StalledStore:
    """An LmdbStore whose chunks of the packs named in ``stalled`` come only once ``flowing`` is set: a store that
    stalls after sending a pack's header, in process; ``waiting`` is set once a read waits (at most STALL_SECONDS)."""

    def __init__(self, store: LmdbStore, stalled: set[str]) -> None:
        self.store, self.stalled = store, stalled
        self.flowing, self.waiting = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def open_pack(self, ref: str, **options):
        opened = self.store.open_pack(ref, **options)
        if opened.header.key not in self.stalled:
            return opened

        @contextmanager
        def chunks() -> Iterator:
            self.waiting.set()
            assert self.flowing.wait(STALL_SECONDS)
            with opened.chunks() as inner:
                yield inner

        return dataclasses.replace(opened, chunks=chunks)


class StepCounter:
    """Counts the model's forward passes (a hook registered after the device's own: it counts only steps that ran);
    ``at`` calls ``action`` when the count reaches it."""

    def __init__(self, model, at: int = 0, action=None) -> None:
        self.count, self.at, self.action = 0, at, action
        self._handle = model.register_forward_pre_hook(self._step)

    def _step(self, module, args) -> None:
        self.count += 1
        if self.count == self.at and self.action is not None:
            self.action()

    def remove(self) -> None:
        self._handle.remove()
