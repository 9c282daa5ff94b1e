"""Pack memory: a touched region decoded packs are carved from, each block free again once its tensors are gone."""

from __future__ import annotations

import gc

import pytest
import torch

from packstore.packs.buffers import BufferStats, HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.memory import ALIGN, PackMemory
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.worker.worker_metrics import WorkerMetrics
from tests.helpers.packs import make_pack

CPU = torch.device("cpu")


def inside(memory: PackMemory, tensor: torch.Tensor) -> bool:
    start = memory._region.ctypes.data
    return start <= tensor.data_ptr() < start + memory.nbytes


def test_blocks_are_carved_first_fit_and_come_back_when_every_view_is_gone() -> None:
    memory = PackMemory(10 * ALIGN)
    a, b = memory.take(3 * ALIGN), memory.take(2 * ALIGN + 1)  # the second rounds up to 3 * ALIGN
    assert a is not None and b is not None and len(b) == 2 * ALIGN + 1
    assert b.data_ptr() - a.data_ptr() == 3 * ALIGN and memory.free_bytes == 4 * ALIGN
    assert memory.take(5 * ALIGN) is None  # no free run fits: the caller allocates as usual
    view = a[ALIGN:].view(torch.int32)
    del a
    gc.collect()
    assert memory.free_bytes == 4 * ALIGN  # a view still holds the block
    del view
    assert memory.free_bytes == 7 * ALIGN
    del b
    assert memory.free_bytes == 10 * ALIGN and memory._free == [(0, 10 * ALIGN)]  # merged back into one run
    whole = memory.take(10 * ALIGN)
    assert whole is not None and whole.data_ptr() == memory._region.ctypes.data


def test_host_buffers_come_from_their_pack_memory_when_it_has_room() -> None:
    memory = PackMemory(1 << 20)
    buffers = HostBuffers(memory)
    tensors = buffers.layer_tensors((2, 8, 16), torch.float32, 6, CPU)
    assert all(inside(memory, t) and t.shape == (2, 8, 16) and t.dtype == torch.float32 for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == 6
    assert buffers.stats() == BufferStats()
    too_big = buffers.layer_tensors((1024, 1024), torch.float32, 1, CPU)  # 4 MB: no room, allocated as usual
    assert not inside(memory, too_big[0])
    assert buffers.stats() == BufferStats(memory_fallbacks=1, memory_fallback_bytes=4 << 20)  # ...and counted
    plain = HostBuffers()
    assert not inside(memory, plain.layer_tensors((2, 8, 16), torch.float32, 1, CPU)[0])
    assert plain.stats() == BufferStats()  # no pack memory: nothing fell back from it


def test_the_workers_metrics_show_its_buffers_waits_and_fallbacks() -> None:
    buffers = HostBuffers(PackMemory(1 << 20))
    metrics = WorkerMetrics({}, dict, buffers.stats)
    buffers.layer_tensors((1024, 512), torch.float32, 1, CPU)  # 2 MB: past the pack memory
    found = {(s.name, s.labels.get("kind")): s.value for family in metrics.registry.collect() for s in family.samples}
    assert found[("packstore_worker_buffer_fallbacks_total", "memory")] == 1
    assert found[("packstore_worker_buffer_fallback_bytes_total", "memory")] == 2 << 20
    assert found[("packstore_worker_buffer_fallbacks_total", "pool")] == 0
    assert found[("packstore_worker_buffer_pool_waits_total", None)] == 0
    assert found[("packstore_worker_buffer_pool_wait_seconds_total", None)] == 0
    assert not any(name.startswith("packstore_worker_buffer") for family in WorkerMetrics({}, dict).registry.collect()
                   for name in [family.name])


def test_packs_decode_into_the_pack_memory_and_give_it_back_when_dropped(tmp_path) -> None:
    pack = make_pack(layers=3, tokens=40, dim=16)
    memory = PackMemory(1 << 20)
    with LmdbStore(tmp_path / "store") as store:
        key, _ = store.put(encode_pack(pack, block_positions=16))
        with Decoder(buffers=HostBuffers(memory)) as decoder:
            fetched = PackReader(store, decoder).fetch(key)
    assert all(inside(memory, t) for t in fetched.keys + fetched.values)
    assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values))
    assert memory.free_bytes < memory.nbytes
    del fetched
    gc.collect()
    assert memory.free_bytes == memory.nbytes


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1])
def test_tiny_regions_and_blocks_are_handled(size: int) -> None:
    memory = PackMemory(size)
    assert memory.nbytes == 0 and memory.take(1) is None


def test_a_region_touched_in_the_background_hands_out_only_what_is_touched(monkeypatch) -> None:
    touch = PackMemory._touch
    monkeypatch.setattr(PackMemory, "_touch", lambda self: None)  # the background thread has not got far yet
    memory = PackMemory(16 * ALIGN, background=True)
    assert memory.take(ALIGN) is None
    monkeypatch.setattr(PackMemory, "TOUCH_STEP", 4 * ALIGN)
    touch(memory)
    assert memory._touched == memory.nbytes and memory.take(16 * ALIGN) is not None
