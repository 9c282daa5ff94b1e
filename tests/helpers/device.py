"""Generations taking turns on one DeviceLock, as the tests start them: the device held while each asks for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from packstore.kv.device import DeviceLock


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
