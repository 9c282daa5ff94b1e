"""Load: 64 concurrent clients mixing uploads, streaming reads, lists and routes (seconds in `make test-all`,
three minutes in `make test-long`) with zero errors and bounded server memory; readers that stop reading
cannot make the server buffer without limit; a full store refuses writes while reads go on."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from packstore.bank.bank import open_banks
from packstore.errors import LimitExceeded, PackstoreError
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

CLIENTS = 64
MAX_RSS_MB = 1500


def rss_mb(process, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def client_loop(url: str, number: int, seeded: list[str], deadline: float, counts: dict, errors: list) -> None:
    rng = random.Random(number)
    with RemoteStore(url, timeout=120) as store:
        serial = 0
        while time.monotonic() < deadline:
            op = rng.choice(("upload", "read", "read", "list", "route"))
            try:
                if op == "upload":
                    serial += 1
                    store.put(encode_pack(make_pack(layers=4, tokens=50 + (number * 10_000 + serial) % 5000)))
                elif op == "read":
                    PackReader(store).fetch(rng.choice(seeded))
                elif op == "list":
                    store.list_page(page_size=50)
                else:
                    open_banks(store, TEST_BANK_CACHE).route("kb", ["Who founded the lighthouse?"], top_k=3)
            except PackstoreError as exc:
                errors.append(f"{op}: {exc}")
                return
            counts[op] = counts.get(op, 0) + 1


@pytest.mark.parametrize("seconds", [8, pytest.param(180, marks=pytest.mark.long)], ids=["short", "long"])
def test_sixty_four_clients_mixing_everything(tmp_path, robustness_report, seconds) -> None:
    # Without tokens the 64 clients are one principal (this host's address), which may hold half the transfer slots:
    # --workers 128 lets each of them hold one at once.
    with running_server(tmp_path / "data", "--workers", "128") as server:
        with RemoteStore(server.url, timeout=120) as store:
            seeded = [store.put(encode_pack(make_pack(layers=8, tokens=500 + i)))[0] for i in range(8)]
            open_banks(store, TEST_BANK_CACHE).build("kb", [f"The lighthouse number {i} was founded by keeper {i}." for i in range(200)])
        counts: dict[str, int] = {}
        errors: list[str] = []
        peak = [0.0]
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=client_loop, args=(server.url, n, seeded, deadline, counts, errors)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            peak[0] = max(peak[0], rss_mb(server.process))
            time.sleep(0.2)
        with RemoteStore(server.url) as store:
            assert all(result.ok for result in PackReader(store).verify_all())
        high_water = rss_mb(server.process, "VmHWM")
    robustness_report.append(
        f"load: {CLIENTS} clients for {seconds} s: {sum(counts.values())} calls ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}), "
        f"{len(errors)} errors, peak server RSS {high_water:.0f} MB"
    )
    assert not errors, errors[:3]
    assert high_water < MAX_RSS_MB


def test_readers_that_stop_reading_cannot_make_the_server_buffer_a_pack(tmp_path, robustness_report) -> None:
    # (--workers 24: these 12 streams are one principal, this host's address, which may hold half the transfer slots)
    with running_server(tmp_path / "data", "--workers", "24") as server:
        with RemoteStore(server.url, timeout=120) as store:
            key, _ = store.put(encode_pack(make_pack(layers=8, tokens=30_000, heads=2, dim=16)))  # about 60 MB stored
            size_mb = store.stat(key).stored_bytes / 2**20
        before = rss_mb(server.process, "RssAnon")  # the server's own memory: the store's mapped file pages are not buffers
        channels = [grpc.insecure_channel(server.address) for _ in range(12)]
        streams = [store_pb2_grpc.PackStoreStub(c).GetPack(store_pb2.GetPackRequest(ref=key)) for c in channels]
        for stream in streams:
            next(stream)  # the header arrives; then nobody reads
        time.sleep(5)
        grown = rss_mb(server.process, "RssAnon") - before
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
    chunk_mb = size_mb / 8  # one chunk per layer
    robustness_report.append(
        f"stalled readers: 12 streams of a {size_mb:.0f} MB pack ({chunk_mb:.1f} MB chunks) left unread: "
        f"server RSS grew {grown:.0f} MB, {grown / 12:.1f} MB a stream"
    )
    # A stalled stream holds the chunk it is sending and what flow control lets it queue: a few
    # chunks at most, never the pack (8 chunks) or 12 x the pack.
    assert grown / 12 < 3 * chunk_mb


def test_a_full_store_refuses_writes_and_keeps_serving_reads(tmp_path) -> None:
    with running_server(tmp_path / "data", "--max-store-bytes", str(3 << 20)) as server, RemoteStore(server.url) as store:
        kept, _ = store.put(encode_pack(make_pack(tokens=100)))
        with pytest.raises(LimitExceeded, match="is full"):
            for index in range(1000):
                store.put(encode_pack(make_pack(layers=4, tokens=2000 + index)))
        assert PackReader(store).fetch(kept).header.key == kept and PackReader(store).verify(kept).ok and store.list()
        with pytest.raises(LimitExceeded, match="is full"):
            open_banks(store, TEST_BANK_CACHE).build("kb", [f"Fact number {i} is about the lighthouse keeper {i}." for i in range(2000)])
        listed = [summary.key for summary in store.list()]
        for key in listed[1:]:  # deleting frees space for new writes: a full store is not stuck
            store.delete(key)
        store.put(encode_pack(make_pack(layers=4, tokens=1999)))
        assert PackReader(store).fetch(listed[0]).header.key == listed[0]
