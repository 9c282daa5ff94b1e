"""Building a pack and storing it as one overlapped pipeline (issue 56, item 5).

``build_pack`` then ``encode_pack`` then ``put`` runs the three one after the other: the prefill, then the whole KV
copied off the device, then every chunk encoded, then every chunk checked and written in one transaction. Here the
prefill hands out each token block of every layer as soon as its passes have filled it (``kv.build.build_blocks``:
the same passes, so the same K/V to the bit), its copy off the device issued without waiting; the decoder's threads
encode each block's chunks (``packs.tensors.encode_chunk``, the same bytes as ``encode_pack``) while the prefill goes
on, and a store that writes packs as they are made (``StreamsPacks``: the LMDB tier) checks and writes them as they
come, in batches, the header last with the rest in one transaction; any other store gets the encoded pack in one
``put`` at the end. What is left after the prefill is the encoding and writing of the last block (and of whatever the
threads had not caught up with) and the commit.

Host memory holds at most ``IN_FLIGHT_BYTES`` of K/V copied off the device and not yet encoded and handed to the
store (the prefill waits for the encoders beyond that), and the LMDB tier a batch of encoded chunks, never the pack.
A failure anywhere stops the build and leaves nothing stored (``PackStream.abort``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from packstore.errors import StoreBusy
from packstore.format.body import BLOCK_POSITIONS, EncodedPack
from packstore.format.header import ChunkInfo, PackHeader
from packstore.kv.build import KvBlock, build_blocks
from packstore.kv.models import LoadedModel
from packstore.packs.decoder import Decoder
from packstore.packs.tensors import chunk_plan, encode_chunk, encoded_header, using_decoder
from packstore.store import PackStore
from packstore.store.protocol import PackStream, StreamsPacks, check_name

IN_FLIGHT_BYTES = 1 << 30  # K/V off the device and not yet encoded: at least one block, whatever its size
T = TypeVar("T")


@dataclass
class BuildTimings:
    """Seconds of one overlapped build, by stage; the stages after the prefill overlap it, so they add up to more
    than ``total``. ``prefill``: from the start to the prefill's last pass done on the device (the copies of each block
    issued included), of which ``held``: the prefill waiting for the encoders (``IN_FLIGHT_BYTES``). Summed over the
    decoder's threads: ``copy``, waiting for a block's copy off the device; ``encode``, encoding chunks; ``digest``,
    the store's check of each chunk; ``write``, the store's writes as chunks come (the LMDB tier). ``commit``: the
    last write after every chunk is in (the header, and the chunks not yet written; for a store that does not stream,
    the whole ``put``, its check of every chunk included). ``total``: the build, start to stored. ``streamed``: the
    store wrote the chunks as they came."""

    prefill: float = 0.0
    held: float = 0.0
    copy: float = 0.0
    encode: float = 0.0
    digest: float = 0.0
    write: float = 0.0
    commit: float = 0.0
    total: float = 0.0
    streamed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def after_prefill(self) -> float:
        """What the build took once the prefill was done: the remaining encoding, writing and the commit."""
        return self.total - self.prefill

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            setattr(self, stage, getattr(self, stage) + seconds)


class _Collected:
    """The chunks of a store that does not stream (or of no store), kept until the pack is whole."""

    def __init__(self) -> None:
        self.seconds = {"digest": 0.0, "write": 0.0}
        self.chunks: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def add(self, index: int, data: bytes, info: ChunkInfo) -> None:
        with self._lock:
            self.chunks[index] = data

    def encoded(self, header: PackHeader) -> EncodedPack:
        return EncodedPack(header, [self.chunks[index] for index in range(len(header.chunks))])


class _InFlight:
    """Bytes of K/V handed to the encoders and not yet through them, bounded: ``take`` waits below ``limit`` (a block
    larger than the limit waits for nothing else in flight)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._changed = threading.Condition()

    def take(self, nbytes: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.held == 0 or self.held + nbytes <= self.limit)
            self.held += nbytes

    def give(self, nbytes: int) -> None:
        with self._changed:
            self.held -= nbytes
            self._changed.notify_all()


def _pipeline(
    lm: LoadedModel,
    facts: Sequence[str],
    sink_for: Callable[[PackHeader], PackStream | _Collected],
    finish: Callable[[PackHeader, PackStream | _Collected], T],
    *,
    raw: bool,
    progress: bool,
    decoder: Decoder | None,
    block_positions: int,
    timings: BuildTimings,
) -> T:
    """The overlapped build: the prefill on this thread, the chunks of each block encoded on ``decoder``'s threads and
    added to ``sink_for(header)`` (made at the first block); ``finish(header as stored, sink)`` once every chunk is in."""
    started = time.perf_counter()
    budget = _InFlight(IN_FLIGHT_BYTES)
    futures: list[Future[None]] = []
    failed: list[BaseException] = []
    sinks: list[PackStream | _Collected] = []
    plans: list[list[tuple[int, int, range | None]]] = []
    records: dict[int, ChunkInfo] = {}

    def code(header: PackHeader, index: int, block: KvBlock, done: Callable[[], None]) -> None:
        try:
            first, stop, _ = plans[0][index]
            at, count = first - header.body_layers.start, stop - first
            waited = time.perf_counter()
            block.ready()
            coded = time.perf_counter()
            data, info = encode_chunk(header, first, stop, block.positions, block.keys[at : at + count], block.values[at : at + count])
            encoded = time.perf_counter()
            sinks[0].add(index, data, info)
            records[index] = info
            timings.add("copy", coded - waited)
            timings.add("encode", encoded - coded)
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            done()

    with using_decoder(decoder) as coder:

        def take(header: PackHeader, block: KvBlock) -> None:
            if failed:
                raise failed[0]
            if not sinks:
                plans.append(chunk_plan(header, block_positions))
                sinks.append(sink_for(header))
            indices = [index for index, (_, _, positions) in enumerate(plans[0]) if positions == block.positions]
            nbytes, left, lock = block.nbytes, [len(indices)], threading.Lock()
            held = time.perf_counter()
            budget.take(nbytes)
            timings.add("held", time.perf_counter() - held)

            def done() -> None:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    budget.give(nbytes)

            futures.extend(coder.submit(code, header, index, block, done) for index in indices)

        try:
            header = build_blocks(lm, facts, take, raw=raw, progress=progress, block_positions=block_positions)
            if lm.device.type == "cuda":
                torch.cuda.synchronize(lm.device)
            timings.prefill = time.perf_counter() - started
            for future in futures:
                future.result()
            committing = time.perf_counter()
            result = finish(encoded_header(header, (records[index] for index in range(len(plans[0])))), sinks[0])
            timings.commit = time.perf_counter() - committing
        except BaseException:
            for future in futures:
                future.cancel()
            for future in futures:  # the chunks being coded finish before the stream is aborted
                if not future.cancelled():
                    future.exception()
            if sinks and not isinstance(sinks[0], _Collected):
                sinks[0].abort()
            raise
    seconds = sinks[0].seconds
    timings.add("digest", seconds["digest"])
    timings.add("write", seconds["write"])
    timings.total = time.perf_counter() - started
    return result


def build_encoded(
    lm: LoadedModel,
    facts: Sequence[str],
    *,
    raw: bool = False,
    progress: bool = False,
    decoder: Decoder | None = None,
    block_positions: int = BLOCK_POSITIONS,
    timings: BuildTimings | None = None,
) -> EncodedPack:
    """``encode_pack(build_pack(lm, facts))``, the chunks encoded while the prefill runs: the same header (but for its
    ``created`` time) and the same chunks, byte for byte."""
    collected = _Collected()
    return _pipeline(
        lm, facts, lambda header: collected, lambda header, sink: collected.encoded(header), raw=raw, progress=progress,
        decoder=decoder, block_positions=block_positions, timings=timings if timings is not None else BuildTimings(),
    )


def build_into(
    store: PackStore,
    lm: LoadedModel,
    facts: Sequence[str],
    *,
    name: str | None = None,
    raw: bool = False,
    progress: bool = False,
    decoder: Decoder | None = None,
    block_positions: int = BLOCK_POSITIONS,
    timings: BuildTimings | None = None,
) -> tuple[str, bool]:
    """Build the pack for ``facts`` on ``lm`` into ``store`` as one pipeline (the prefill, the encoding and, where the
    store streams, the writes overlapped); returns ``(key, created)`` as ``put`` does. The stored pack is the one
    ``store.put(encode_pack(build_pack(lm, facts)))`` stores, byte for byte (but for the header's ``created``)."""
    timings = timings if timings is not None else BuildTimings()
    if name is not None:
        check_name(name)  # before the model runs

    def sink_for(header: PackHeader) -> PackStream | _Collected:
        if isinstance(store, StreamsPacks):
            try:
                stream = store.begin_stream(header.key)
            except StoreBusy:  # another build streams the same pack: this one is put whole at the end
                return _Collected()
            timings.streamed = True
            return stream
        return _Collected()

    def finish(header: PackHeader, sink: PackStream | _Collected) -> tuple[str, bool]:
        if isinstance(sink, _Collected):
            return store.put(sink.encoded(header), name=name)
        return sink.commit(header, name=name)

    return _pipeline(lm, facts, sink_for, finish, raw=raw, progress=progress, decoder=decoder, block_positions=block_positions,
                     timings=timings)
