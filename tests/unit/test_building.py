"""A build as one pipeline (issue 56, item 5): chunks encoded while the prefill runs and written to the LMDB tier as
they come (``answering.building``, ``LmdbStream``), byte for byte the sequential build's pack, and nothing stored
when it fails midway."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from packstore.answering import building
from packstore.answering.api import build_and_store
from packstore.answering.building import BuildTimings, build_encoded, build_into
from packstore.errors import IntegrityError, InvalidInput, StoreBusy
from packstore.format.body import EncodedPack
from packstore.kv.build import build_pack
from packstore.packs.decoder import Decoder
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.lmdb import store as lmdb_store
from tests.helpers.packs import make_pack

FACTS = [f"Fact {i}: the observatory of Wexley counts {i} bells, and Alice lives in Paris with Bob." for i in range(40)]
BLOCK = 64  # token blocks of this many positions: many chunks per layer, several blocks per prefill pass


def same_pack(a: EncodedPack, b: EncodedPack) -> bool:
    """Equal headers (but for the time each was made) and equal chunks, byte for byte."""
    return dataclasses.replace(a.header, created="") == dataclasses.replace(b.header, created="") and a.chunks == b.chunks


@pytest.fixture(scope="module")
def sequential(tiny_lm) -> EncodedPack:
    return encode_pack(build_pack(tiny_lm, FACTS), block_positions=BLOCK)


def test_the_facts_make_a_pack_of_several_prefill_passes_and_many_blocks(sequential) -> None:
    positions = sequential.header.positions
    assert len(sequential.header.prefill_chunks or ()) > 3 and positions > 1024 and positions % BLOCK  # a last block cut short
    assert len(sequential.chunks) == sequential.header.layers * -(-positions // BLOCK)


def test_the_overlapped_build_encodes_the_same_bytes_as_the_sequential_one(tiny_lm, sequential) -> None:
    timings = BuildTimings()
    with Decoder(workers=3) as decoder:
        overlapped = build_encoded(tiny_lm, FACTS, block_positions=BLOCK, decoder=decoder, timings=timings)
    assert same_pack(overlapped, sequential)
    assert timings.total >= timings.prefill > 0 and timings.encode > 0 and not timings.streamed


def test_a_pack_of_one_block_is_the_same_too(tiny_lm) -> None:
    facts = FACTS[:3]
    overlapped = build_encoded(tiny_lm, facts)  # under BLOCK_POSITIONS: one chunk per layer, made after the last pass
    assert same_pack(overlapped, encode_pack(build_pack(tiny_lm, facts)))
    assert all(info.first_position is None for info in overlapped.header.chunks)


def test_the_lmdb_tier_takes_the_chunks_as_they_come_and_stores_the_sequential_pack(tiny_lm, sequential, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_store, "STREAM_BATCH_BYTES", 200_000)  # several transactions before the commit
    monkeypatch.setattr(building, "IN_FLIGHT_BYTES", 1)  # the prefill waits for each block to be encoded and written
    timings = BuildTimings()
    with LmdbStore(tmp_path / "store") as store:
        key, created = build_into(store, tiny_lm, FACTS, name="bells", block_positions=BLOCK, timings=timings)
        stored = PackReader(store).get(key)
        assert created and same_pack(stored, sequential) and store.resolve("bells") == key
        assert timings.streamed and timings.write > 0 and timings.digest > 0 and timings.commit > 0
        assert timings.total == pytest.approx(timings.prefill + timings.after_prefill)
        report = store.gc()
        assert report.orphan_chunks == 0  # the claim went with the commit; nothing else was left in staging
        again, created_again = build_into(store, tiny_lm, FACTS, block_positions=BLOCK)
        assert (again, created_again) == (key, False) and same_pack(PackReader(store).get(key), sequential)
        assert [p.key for p in store.list()] == [key]


def test_build_and_store_streams_into_the_lmdb_tier_and_puts_elsewhere(tiny_lm, tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        stored, created = build_and_store(store, tiny_lm, FACTS[:5], name="five")
        assert created and stored.names == ("five",)
        assert same_pack(PackReader(store).get(stored.key), encode_pack(build_pack(tiny_lm, FACTS[:5])))


def test_a_build_that_fails_midway_leaves_nothing_in_the_store(tiny_lm, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_store, "STREAM_BATCH_BYTES", 1)  # every chunk written as it comes
    coded = []
    encode_chunk = building.encode_chunk

    def failing(*args):
        if len(coded) == 7:
            raise RuntimeError("the encoder failed")
        coded.append(1)
        return encode_chunk(*args)

    monkeypatch.setattr(building, "encode_chunk", failing)
    with LmdbStore(tmp_path / "store") as store:
        with pytest.raises(RuntimeError, match="the encoder failed"):
            build_into(store, tiny_lm, FACTS, block_positions=BLOCK)
        assert store.list() == [] and store.counts().packs == 0
        assert store.gc().orphan_chunks == 0  # the chunks written went with the abort, and so did the claim


def stream_of(store: LmdbStore, encoded: EncodedPack, indices: list[int]) -> lmdb_store.LmdbStream:
    stream = store.begin_stream(encoded.header.key)
    for index in indices:
        stream.add(index, encoded.chunks[index], encoded.header.chunks[index])
    return stream


@pytest.fixture
def encoded() -> EncodedPack:
    return encode_pack(make_pack(layers=3, tokens=40, dim=16), block_positions=16)


def test_a_stream_claims_its_key_and_gc_keeps_its_chunks_until_the_claim_is_stale(encoded, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_store, "STREAM_BATCH_BYTES", 1)
    with LmdbStore(tmp_path / "store") as store:
        stream = stream_of(store, encoded, [5, 0, 3])  # any order
        with pytest.raises(StoreBusy):
            store.begin_stream(encoded.header.key)  # a second build of the same pack
        assert store.gc().orphan_chunks == 0 and store.list() == []  # written, unlisted, kept
        for index in (1, 2, 4, 6, 7, 8):
            stream.add(index, encoded.chunks[index], encoded.header.chunks[index])
        key, created = stream.commit(encoded.header, name="streamed")
        assert created and PackReader(store).get(key).chunks == encoded.chunks and store.resolve("streamed") == key
        died = encode_pack(make_pack(layers=2, tokens=41, dim=16), block_positions=16)
        stream_of(store, died, [0, 1])  # a build that died: its chunks stay while its claim is fresh...
        assert store.gc().orphan_chunks == 0
        monkeypatch.setattr(lmdb_store, "STALE_UPLOAD_SECONDS", -1)
        report = store.gc()  # ...and go with it once it is stale (the claim counted as a stale upload)
        assert (report.orphan_chunks, report.orphan_chunk_bytes) == (3, len(died.chunks[0]) + len(died.chunks[1]))
        assert PackReader(store).get(key).chunks == encoded.chunks


def test_a_stream_refuses_chunks_that_do_not_match_and_a_header_that_lists_others(encoded, tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        stream = stream_of(store, encoded, [0])
        with pytest.raises(IntegrityError):
            stream.add(1, encoded.chunks[2], encoded.header.chunks[1])
        with pytest.raises(InvalidInput, match="twice"):
            stream.add(0, encoded.chunks[0], encoded.header.chunks[0])
        with pytest.raises(InvalidInput, match="not those its header lists"):
            stream.commit(encoded.header)  # chunks missing
        stream.abort()
        assert store.list() == [] and store.gc().orphan_chunks == 0
        complete = stream_of(store, encoded, list(range(len(encoded.chunks))))
        other = dataclasses.replace(encoded.header, chunks=encoded.header.chunks[::-1])
        with pytest.raises(InvalidInput):
            complete.commit(other)
        complete.abort()


def test_a_put_of_the_same_pack_during_a_stream_wins_and_the_stream_writes_no_more(encoded, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_store, "STREAM_BATCH_BYTES", 1)
    with LmdbStore(tmp_path / "store") as store:
        stream = stream_of(store, encoded, [0, 1])
        key, created = store.put(encoded)  # another writer stores the same pack whole
        assert created
        for index in range(2, len(encoded.chunks)):
            stream.add(index, encoded.chunks[index], encoded.header.chunks[index])
        assert stream.stored
        assert stream.commit(encoded.header) == (key, False)
        assert PackReader(store).get(key).chunks == encoded.chunks and store.gc().orphan_chunks == 0
        aborted = stream_of(store, encoded, [])
        assert aborted.stored  # stored already: a stream of it writes nothing, and its abort removes nothing
        aborted.abort()
        assert PackReader(store).get(key).chunks == encoded.chunks


def test_streams_of_several_threads_write_one_pack(encoded, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_store, "STREAM_BATCH_BYTES", 3000)
    with LmdbStore(tmp_path / "store") as store:
        stream = store.begin_stream(encoded.header.key)
        threads = [threading.Thread(target=lambda part=part: [stream.add(i, encoded.chunks[i], encoded.header.chunks[i]) for i in part])
                   for part in (range(0, 9, 2), range(1, 9, 2))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        key, created = stream.commit(encoded.header)
        assert created and PackReader(store).get(key).chunks == encoded.chunks
