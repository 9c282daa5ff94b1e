"""The one pack reader over a backend that speaks bytes: what it checks of the chunks a tier hands it, the decoder's
buffer provider as the seam to the device, and that nothing of the decoder exists before a program makes one."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from packstore.errors import IntegrityError
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.protocol import OpenedPack
from tests.helpers.packs import make_pack


class ReorderingStore(LmdbStore):
    """A real LMDB store whose chunk source hands the chunks out as ``arrange`` reorders them (a tier gone wrong)."""

    arrange = staticmethod(lambda chunks: chunks)

    def open_pack(self, ref: str, **kwargs: object) -> OpenedPack:
        opened = super().open_pack(ref, **kwargs)  # type: ignore[arg-type]

        @contextmanager
        def chunks() -> Iterator[list[tuple[int, bytes | memoryview]]]:
            with opened.chunks() as found:
                yield self.arrange(list(found))

        return dataclasses.replace(opened, chunks=chunks)


def test_get_refuses_chunks_out_of_order_and_every_read_refuses_a_missing_one(tmp_path) -> None:
    pack = make_pack(layers=3, tokens=8)
    with ReorderingStore(tmp_path / "store") as store:
        key, _ = store.put(encode_pack(pack))
        reader = PackReader(store)
        assert len(reader.get(key).chunks) == 3
        store.arrange = staticmethod(lambda chunks: chunks[::-1])
        with pytest.raises(IntegrityError, match="came where chunk 0 belongs"):
            reader.get(key)  # a pack file's chunks are in order
        assert reader.verify(key).ok and torch.equal(reader.fetch(key).keys[2], pack.keys[2])  # each is placed by its index
        store.arrange = staticmethod(lambda chunks: chunks[:-1])
        with pytest.raises(IntegrityError, match="chunks are missing"):
            reader.get(key)
        assert "chunks are missing" in (reader.verify(key).error or "")
        with pytest.raises(IntegrityError):
            reader.fetch(key)


class CountingBuffers(HostBuffers):
    """Host buffers that count what the decoder asked of them (a device strategy plugs in here)."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors = 0

    def layer_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> list[torch.Tensor]:
        self.tensors += count
        return super().layer_tensors(shape, dtype, count, device)


def test_packs_are_decoded_into_the_decoders_buffers(tmp_path) -> None:
    pack = make_pack(layers=3, tokens=40, dim=16)
    buffers = CountingBuffers()
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=2, buffers=buffers) as decoder:
        key, _ = store.put(encode_pack(pack, block_positions=16))
        reader = PackReader(store, decoder)
        fetched = reader.fetch(key)
        part = reader.fetch_part(key, layers=(1, 2), prefix=20)
    assert buffers.tensors == 2 * 3 + 2 * 2  # K and V per layer of the whole pack, then of the part
    assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values))
    assert torch.equal(part.keys[0], pack.keys[1][:, :20])


def test_importing_the_pack_side_starts_no_thread_and_verify_needs_no_torch(tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(make_pack(layers=2, tokens=8)))
    probe = (
        "import sys, threading\n"
        "import packstore.packs.reader, packstore.store.lmdb.store\n"
        f"store = packstore.store.lmdb.store.LmdbStore({str(tmp_path / 'store')!r})\n"
        "results = packstore.packs.reader.PackReader(store).verify_all()\n"
        "assert [r.ok for r in results] == [True], results\n"
        "assert 'torch' not in sys.modules\n"
        "import packstore.packs.tensors, packstore.kv.inject\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
