"""One forward pass's pack loads on a paged-attention engine's worker, none of them waited for past its deadline.

A pack already in memory is written at once; any other is opened on a small pool of threads (a store's header read
may hang), and each of its layers is written when the model reaches that layer; every wait, for the opening and for
each layer, ends at the step's deadline (``seconds`` after ``start``). A load that misses it, or fails, writes nothing
more; ``finish`` hands back its blocks, which the engine recomputes, and the reason. A load planned before its store
missed a deadline (``wait`` False) does not wait for the store at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from packstore.answering.paged import blocks_of, slot_mapping
from packstore.errors import Unavailable
from packstore.packs.tensors import ArrivingPack

if TYPE_CHECKING:
    from packstore.packs.tensors import Pack

OPEN_THREADS = 4  # packs opened at once


@dataclass(frozen=True)
class PackLoad:
    """One request's load: positions [start, stop) of pack ``key`` into the request's blocks. ``wait`` False: its
    namespace's store missed a load deadline after it was planned, so only a pack already in memory is written."""

    request_id: str
    key: str
    namespace: str
    pack_sha256: str
    start: int
    stop: int
    block_ids: tuple[int, ...]
    wait: bool = True
    background: bool = False  # loaded beside the forward passes (``BackgroundLoads``): its request waits for it


@dataclass(frozen=True)
class StepFailures:
    """What ``StepLoads.finish`` hands back: the blocks to recompute, each failed request's reason, and the
    namespaces whose store missed the deadline (the scheduler looks their packs up again before loading one)."""

    blocks: set[int] = field(default_factory=set)
    reasons: dict[str, str] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)


@dataclass
class _Loading:
    load: PackLoad
    opening: Future[ArrivingPack | Pack] | None
    slots: torch.Tensor
    written: set[str] = field(default_factory=set)
    failure: str | None = None
    late: bool = False


# K, V of the layer's [start, stop) positions ([kv heads, tokens, head dim]) into the request's slots
Write = Callable[[PackLoad, torch.Tensor, torch.Tensor, torch.Tensor], None]


def load_slots(load: PackLoad, block_size: int) -> torch.Tensor:
    """The cache slots of ``load``'s positions in its request's blocks."""
    return torch.tensor(slot_mapping(load.block_ids, block_size, load.start, load.stop), dtype=torch.long)


def not_waited(load: PackLoad) -> str:
    """Why a load planned before its store missed a deadline (``wait`` False), of a pack not in memory, was recomputed."""
    return f"the store of namespace {load.namespace!r} missed the load deadline after this request was planned: not waited for"


def checked(pack: ArrivingPack | Pack, load: PackLoad) -> ArrivingPack | Pack:
    """``pack``, unless it is not the one ``load`` was planned with (ValueError)."""
    if pack.header.pack_sha256 != load.pack_sha256:
        raise ValueError(f"pack {load.key[-12:]} changed in the store after it was planned")
    return pack


def layer_rows(pack: ArrivingPack | Pack, index: int, load: PackLoad, left: float, seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of layer ``index`` at ``load``'s positions, waiting up to ``left`` seconds for the layer to arrive
    (``Unavailable`` naming the ``seconds`` of load_seconds past that)."""
    if isinstance(pack, ArrivingPack) and not pack.arrived(index, left):
        raise Unavailable(f"{pack.late(index, seconds)} (load_seconds)")
    keys, values = pack.layer(index)
    return keys[:, load.start : load.stop], values[:, load.start : load.stop]


class PackLoader:
    """What loads read packs with: ``ready(load)``, the pack a load reads if it is in memory (else None);
    ``fetch(load)``, the pack arriving from the store, run on a pool of ``threads``; and their deadline, ``seconds``."""

    def __init__(
        self,
        ready: Callable[[PackLoad], Pack | None],
        fetch: Callable[[PackLoad], ArrivingPack | Pack],
        block_size: int,
        seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        threads: int = OPEN_THREADS,
    ) -> None:
        self._ready, self._fetch, self.block_size, self.seconds, self._clock = ready, fetch, block_size, seconds, clock
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"packstore-{type(self).__name__}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StepLoads(PackLoader):
    """Loads of one step at a time: ``start(loads)``, ``write_layer`` per layer as the model reaches it, ``finish``;
    ``ready`` runs on the caller's thread, ``fetch`` on the pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loadings: list[_Loading] = []
        self._deadline = 0.0

    def __bool__(self) -> bool:
        return bool(self._loadings)

    def start(self, loads: Sequence[PackLoad]) -> None:
        """Begin opening each load's pack; the step's deadline is ``seconds`` from now."""
        self._deadline = self._clock() + self.seconds
        for load in loads:
            loading = _Loading(load, None, load_slots(load, self.block_size))
            pack = self._ready(load)
            if pack is not None:
                loading.opening = Future()
                loading.opening.set_result(pack)
            elif load.wait:
                loading.opening = self._pool.submit(self._fetch, load)
            else:
                loading.failure = not_waited(load)
            self._loadings.append(loading)

    def write_layer(self, name: str, index: int, write: Write) -> None:
        """Write layer ``index`` (named ``name``) of every load still going, waiting for it until the deadline."""
        for loading in self._loadings:
            if loading.failure is None and name not in loading.written:
                self._write(loading, name, index, write)

    def _write(self, loading: _Loading, name: str, index: int, write: Write) -> None:
        load = loading.load
        try:
            keys, values = layer_rows(self._pack(loading), index, load, self._left(), self.seconds)
            write(load, loading.slots, keys, values)
        except Exception as exc:
            loading.failure = f"{type(exc).__name__}: {exc}"
            loading.late = isinstance(exc, Unavailable)
            return
        loading.written.add(name)

    def _pack(self, loading: _Loading) -> ArrivingPack | Pack:
        load = loading.load
        assert loading.opening is not None  # a load without one failed at start
        try:
            pack = loading.opening.result(timeout=self._left())
        except FutureTimeout:
            raise Unavailable(f"pack {load.key[-12:]}: the store did not open it within {self.seconds:g} s (load_seconds)") from None
        return checked(pack, load)

    def _left(self) -> float:
        return max(0.0, self._deadline - self._clock())

    def finish(self, names: Iterable[str]) -> StepFailures:
        """End the step: each load that failed, or left a layer of ``names`` unwritten, is handed back."""
        failures, names = StepFailures(), set(names)
        for loading in self._loadings:
            load = loading.load
            missing = sorted(names - loading.written)
            if loading.failure is None and missing:
                loading.failure = f"layer {missing[0]} was not written before the model used it"
            if loading.failure is None:
                continue
            failures.blocks.update(blocks_of(load.block_ids, self.block_size, load.start, load.stop))
            failures.reasons[load.request_id] = loading.failure
            if loading.late:
                failures.late.add(load.namespace)
        self._loadings = []
        return failures
