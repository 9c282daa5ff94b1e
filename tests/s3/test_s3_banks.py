"""Banks on the object tier (SeaweedFS): shared by replicas, whole or absent, damage refused, gc of old records."""

from __future__ import annotations

import threading
import time

import pytest

from packstore.bank.bank import open_banks
from packstore.errors import IntegrityError, PackNotFound, Unavailable
from packstore.store.objects.store import ObjectStore
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.s3 import FACTS, objects


def test_replicas_share_banks_and_concurrent_adds_all_land(replicas) -> None:
    a, b = replicas
    open_banks(a, TEST_BANK_CACHE).build("lockers", FACTS)
    assert open_banks(b, TEST_BANK_CACHE).route("lockers", ["Which umbrella is in locker 13?"], top_k=1)[0].facts[0][0] == FACTS[13]
    added, start = [f"Locker {900 + i} holds a spare key." for i in range(6)], threading.Barrier(6)

    def add(i: int) -> None:
        start.wait()
        open_banks((a, b)[i % 2], TEST_BANK_CACHE).add("lockers", [added[i]])

    threads = [threading.Thread(target=add, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert a.bank("lockers").facts == len(FACTS) + 6  # each add was computed on the bank as it was, none lost
    for fact in added:
        assert open_banks(b, TEST_BANK_CACHE).route("lockers", [fact], top_k=1)[0].facts[0][0] == fact


def test_a_bank_is_whole_or_absent_and_gc_removes_a_dead_builds_records(url, seaweed, tmp_path, monkeypatch) -> None:
    with ObjectStore(url, cache_dir=tmp_path / "a", gc_grace=2) as a, ObjectStore(url, cache_dir=tmp_path / "b", gc_grace=2) as b:
        open_banks(a, TEST_BANK_CACHE).build("kept", FACTS[:20])

        def die(*_args, **_kwargs):
            raise SystemExit("killed before the commit")

        monkeypatch.setattr(a._registers, "update", die)
        with pytest.raises(SystemExit):
            open_banks(a, TEST_BANK_CACHE).build("half", FACTS)
        monkeypatch.undo()
        assert any("banks/half/records/" in name for name in objects(seaweed, url, "banks/"))
        assert [m.name for m, _ in open_banks(b, TEST_BANK_CACHE).list()] == ["kept"]
        with pytest.raises(PackNotFound, match="no bank named 'half'"):
            open_banks(b, TEST_BANK_CACHE).route("half", ["umbrella"])
        open_banks(a, TEST_BANK_CACHE).build("kept", FACTS[20:])  # a rebuild: the first build's records are garbage once old
        time.sleep(3.5)  # past the grace, +1 s: LastModified and Date are whole seconds
        b.gc()
        left = objects(seaweed, url, "banks/")
        assert not any("banks/half/" in name for name in left)
        kept = a._bank_head("kept")
        assert {name for name in left if "/records/" in name} == {obj.split("ns/default/", 1)[1] for obj, *_ in kept["records"].values()}
        assert open_banks(b, TEST_BANK_CACHE).route("kept", [FACTS[25]], top_k=1)[0].facts[0][0] == FACTS[25]


def test_a_bank_whose_upload_outlasts_the_writer_window_is_refused_and_absent(url, tmp_path) -> None:
    """The upload is timed on a monotonic clock (the store's counts whole seconds): one longer than the window
    (here 25 µs) is refused before the bank is committed, so a gc counting its records old cannot break it."""
    with ObjectStore(url, cache_dir=tmp_path / "a", gc_grace=1e-4) as a:
        with pytest.raises(Unavailable, match="too slow: uploading bank 'slow'"):
            open_banks(a, TEST_BANK_CACHE).build("slow", FACTS)
        assert [m.name for m, _ in open_banks(a, TEST_BANK_CACHE).list()] == []


def test_a_damaged_bank_record_is_data_loss(replicas, seaweed, url) -> None:
    a, b = replicas
    open_banks(a, TEST_BANK_CACHE).build("fragile", FACTS)
    obj = a._bank_head("fragile")["records"]["centroids/fragile"][0]
    seaweed.client().put_object(Bucket=seaweed.bucket, Key=url.split("/", 3)[3] + "/" + obj, Body=b"\0" * 64)
    with pytest.raises(IntegrityError, match="record centroids/fragile is damaged") as error:
        open_banks(b, TEST_BANK_CACHE).route("fragile", ["umbrella"])
    assert error.value.grpc_status == "DATA_LOSS"
