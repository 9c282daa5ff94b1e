"""Pack loads beside a paged-attention engine's forward passes: the request waits (vLLM: ``WAITING_FOR_REMOTE_KVS``)
while its pack is read and written into its blocks on a thread, so a slow or hung store delays only the requests
waiting for it, never a forward pass.

Each load is handed back once, by ``finished``: written whole, or failed (the store erred, or did not deliver within
``seconds`` of its start) with its blocks, which the engine recomputes. A load past its deadline is given up: its thread
writes nothing more, though the store call it waits in ends only at the client's own deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from packstore.answering.paged import blocks_of
from packstore.answering.step_loads import PackLoad, PackLoader, checked, layer_rows, load_slots, not_waited
from packstore.errors import Unavailable

# layer ``name``'s K, V at a load's positions ([kv heads, tokens, head dim]) into the request's slots
LayerWrite = Callable[[str, PackLoad, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class LoadOutcome:
    """A finished load: its request, and when it failed, why, the blocks to recompute and whether the store was late."""

    request_id: str
    namespace: str
    failure: str | None = None
    blocks: frozenset[int] = frozenset()
    late: bool = False


@dataclass
class _Job:
    load: PackLoad
    deadline: float
    outcome: LoadOutcome | None = None
    given_up: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class BackgroundLoads(PackLoader):
    """``start(load, layers, write)`` reads ``load``'s pack (``ready(load)`` if in memory, else ``fetch(load)``) and
    writes each of ``layers`` ((name, index) pairs) on a pool thread; ``finished()`` hands back what ended."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jobs: dict[str, _Job] = {}
        self._ended = threading.Event()  # set when a load ends (cleared by ``wait``)

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, load: PackLoad, layers: Sequence[tuple[str, int]], write: LayerWrite) -> None:
        job = _Job(load, self._clock() + self.seconds)
        self._jobs[load.request_id] = job
        self._pool.submit(self._run, job, list(layers), write)

    def _run(self, job: _Job, layers: list[tuple[str, int]], write: LayerWrite) -> None:
        if job.given_up:  # its deadline passed while it waited for a thread
            return
        load = job.load
        try:
            failure, late = self._write(job, layers, write), False
        except Exception as exc:
            failure, late = f"{type(exc).__name__}: {exc}", isinstance(exc, Unavailable)
        with job.lock:
            if not job.given_up:
                job.outcome = self._outcome(load, failure, late)
        self._ended.set()

    def _write(self, job: _Job, layers: list[tuple[str, int]], write: LayerWrite) -> str | None:
        """Read ``job``'s pack and write its layers until done or given up; why it was not read, or None."""
        load = job.load
        ready = self._ready(load)
        if ready is None and not load.wait:
            return not_waited(load)
        pack = checked(ready if ready is not None else self._fetch(load), load)
        slots = load_slots(load, self.block_size)
        for name, index in layers:
            keys, values = layer_rows(pack, index, load, max(0.0, job.deadline - self._clock()), self.seconds)
            with job.lock:
                if job.given_up:
                    return None
                write(name, load, slots, keys, values)
        return None

    def _outcome(self, load: PackLoad, failure: str | None, late: bool) -> LoadOutcome:
        if failure is None:
            return LoadOutcome(load.request_id, load.namespace)
        blocks = frozenset(blocks_of(load.block_ids, self.block_size, load.start, load.stop))
        return LoadOutcome(load.request_id, load.namespace, failure, blocks, late)

    def wait(self, seconds: float) -> None:
        """Return once a load has ended (at once if one has and was not handed back), its deadline has passed, or
        ``seconds`` have."""
        self._ended.clear()
        now = self._clock()
        if not self._jobs or any(job.outcome is not None or now >= job.deadline for job in list(self._jobs.values())):
            return
        deadline = min(job.deadline for job in list(self._jobs.values()))
        self._ended.wait(max(0.0, min(seconds, deadline - now)))

    def finished(self) -> list[LoadOutcome]:
        """The loads that ended since the last call: written, failed, or past their deadline (given up)."""
        ended = []
        now = self._clock()
        for request_id, job in list(self._jobs.items()):
            with job.lock:
                if job.outcome is None and now >= job.deadline:
                    job.given_up = True
                    reason = f"pack {job.load.key[-12:]}: the store did not deliver it within {self.seconds:g} s (load_seconds)"
                    job.outcome = self._outcome(job.load, f"Unavailable: {reason}", True)
                outcome = job.outcome
            if outcome is not None:
                ended.append(outcome)
                del self._jobs[request_id]
        return ended

