"""The caches of ready packs: LRUs bounded in bytes, per-namespace partitions, and a host cache under the device LRU."""

from __future__ import annotations

import random

import pytest
import torch

from packstore.answering.answer import Answerer, Question
from packstore.answering.ready_caches import ReadyCache
from packstore.format import PackHeader
from packstore.format.header import ChunkInfo
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.kv.models import load_model
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.memory import PackMemory
from packstore.packs.tensors import ArrivingPack, Pack, encode_pack
from packstore.store import LmdbStore
from packstore.worker.config import decoded_memory_bytes, host_cache_bound

GREEDY = Sampling(max_new_tokens=6)


def fake_pack(key_byte: str, size: int) -> Pack:
    header = PackHeader(
        kind="knowledge", model_fp=key_byte * 64, template_fp="b" * 64, model_name="t", token_ids=(1,), layers=1,
        kv_heads=1, head_dim=1, dtype="float32", facts=("f",), raw=False, created="2026-01-01T00:00:00Z",
        chunks=(ChunkInfo(0, 1, size, size, "0" * 64),),
    )
    return Pack(header=header, keys=[], values=[])


def test_ready_cache_is_an_lru_bounded_in_bytes() -> None:
    cache = ReadyCache(limit_bytes=100)
    loads: list[str] = []

    def load(key: str) -> Pack:
        loads.append(key)
        return fake_pack(key, {"a": 40, "b": 40, "c": 40, "d": 500}[key])

    for key in ["a", "b", "a", "c"]:  # c evicts b, the least recently used
        cache.get(key, load)
    assert cache.stats == (2, 80)
    assert cache.get("a", load)[1] is True and cache.get("b", load)[1] is False
    cache.get("d", load)  # larger than the whole cache: served, not kept
    assert cache.get("d", load)[1] is False and cache.stats[1] <= 100
    assert loads == ["a", "b", "c", "b", "d", "d"]


def test_ready_cache_partitions_share_the_budget_and_count_their_own_packs() -> None:
    cache = ReadyCache(limit_bytes=100)
    a, b = cache.partition("a"), cache.partition("b")

    def load(key: str) -> Pack:
        return fake_pack(key, 30)

    for partition, key in ((a, "k"), (a, "l"), (b, "k")):
        partition.get(key, load)
    assert b.get("k", load)[1] is True and a.peek("m") is None and b.peek("l") is None  # keys never meet
    assert (a.stats, b.stats, cache.stats) == ((2, 60), (1, 30), (3, 90))
    b.put("m", fake_pack("m", 30))  # over the shared budget: a's least recently used pack goes
    assert (a.stats, b.stats, cache.stats) == ((1, 30), (2, 60), (3, 90)) and a.peek("l") is not None
    assert cache.partition("c").stats == (0, 0) and cache.stats_of("a") == a.stats


def test_hits_and_evictions_are_counted_per_partition() -> None:
    cache = ReadyCache(limit_bytes=100)
    a, b = cache.partition("a"), cache.partition("b")
    a.put("k", fake_pack("k", 60))
    assert a.peek("k") is not None and b.peek("k") is None and a.get("k", lambda key: fake_pack(key, 60))[1] is True
    b.put("k", fake_pack("k", 60))  # evicts a's pack: the eviction is a's
    counts = cache.counts()
    assert (counts["a"].hits, counts["a"].evictions, counts["a"].packs) == (2, 1, 0)
    assert (counts["b"].hits, counts["b"].evictions, counts["b"].packs, counts["b"].bytes) == (0, 0, 1, 60)


def test_a_hit_in_the_device_lru_refreshes_the_pack_in_the_host_tier_without_counting_a_host_hit() -> None:
    host = ReadyCache(limit_bytes=100)
    device = ReadyCache(limit_bytes=50, below=host)
    for key in ("x", "y"):
        host.put(key, fake_pack(key, 40))
    device.put("x", fake_pack("x", 40))
    assert device.peek("x") is not None  # x is now the host cache's most recently used too
    host.put("z", fake_pack("z", 40))  # so the host cache evicts y, not x
    assert host.peek("x") is not None and host.peek("y") is None
    assert host.counts()[""].hits == 1 and device.counts()[""].hits == 1  # the refresh is no hit of the host cache


@pytest.mark.parametrize("seed", range(10))
def test_a_pack_the_device_lru_evicts_is_still_in_a_host_tier_at_least_as_large(seed: int) -> None:
    """Every pack is fetched into the host cache and device hits refresh it there, so with host >= device bytes the
    device LRU only ever holds packs the host cache holds too (random accesses, hot and cold packs, two namespaces)."""
    rng = random.Random(seed)
    sizes = {f"p{i}": rng.randint(5, 50) for i in range(12)}
    host = ReadyCache(limit_bytes=rng.randint(50, 200))
    device = ReadyCache(limit_bytes=rng.randint(50, host.limit_bytes), below=host)
    store_reads = 0

    def fetch(key: str) -> Pack:
        nonlocal store_reads
        store_reads += 1
        return fake_pack(key, sizes[key])

    for _ in range(400):
        namespace, key = rng.choice("ab"), rng.choices(list(sizes), weights=range(12, 0, -1))[0]  # some packs hot
        device.get(key, lambda k, ns=namespace: host.get(k, fetch, ns)[0], namespace)
        assert set(device._packs) <= set(host._packs)  # (partition, key) pairs
    assert store_reads == sum(counts.evictions for counts in host.counts().values()) + host.stats[0]  # each fetch kept once


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_lm):
    with LmdbStore(tmp_path_factory.mktemp("ready") / "store") as store:
        for name, fact in (("alice", "Alice lives in Paris."), ("bob", "Bob lives in Oslo, Norway.")):
            store.put(encode_pack(build_pack(tiny_lm, [fact])), name=name)
        yield store


def test_a_pack_evicted_from_the_device_lru_comes_back_from_the_host_tier(tiny_lm, store) -> None:
    sizes = {name: store.stat(name).header.raw_bytes for name in ("alice", "bob")}
    host = ReadyCache(sum(sizes.values()))
    answerer = Answerer(tiny_lm, store, ready=ReadyCache(max(sizes.values()), below=host), host=host)
    plain = Answerer(tiny_lm, store)
    questions = {name: Question(f"Where does {name.title()} live?", refs=(name,), sampling=GREEDY) for name in sizes}
    answers = [answerer.ask(questions[name]) for name in ("alice", "bob", "alice", "alice")]
    assert [a.cache_hit for a in answers] == [False, False, False, True]  # bob evicted alice from the device LRU
    assert answerer.store_reads == 2 and host.counts()[""].hits == 1  # ...and she came back from the host cache
    assert answerer.ready.stats == (1, sizes["alice"]) and host.stats == (2, sum(sizes.values()))
    assert answers[2].answer == answers[0].answer == plain.ask(questions["alice"]).answer
    assert not isinstance(answerer.arriving("bob")[0], ArrivingPack)  # on the CPU the host cache's pack is the device's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_pack_evicted_from_the_gpu_crosses_back_from_the_pinned_host_tier(tiny_model_dir, store) -> None:
    lm = load_model(str(tiny_model_dir), device="cuda", progress=False)
    sizes = {name: store.stat(name).header.raw_bytes for name in ("alice", "bob")}
    host = ReadyCache(sum(sizes.values()))
    questions = {name: Question(f"Where does {name.title()} live?", refs=(name,), sampling=GREEDY) for name in sizes}
    with Decoder(buffers=HostBuffers(PackMemory(16 << 20, pinned=True))) as decoder:
        answerer = Answerer(lm, store, ready=ReadyCache(max(sizes.values()), below=host), host=host, decoder=decoder)
        answers = [answerer.ask(questions[name]) for name in ("alice", "bob", "alice")]
        assert answerer.store_reads == 2 and host.counts()[""].hits == 1  # alice came back from the host cache
        hosted = host.peek(store.resolve("bob"))
        assert hosted is not None and hosted.keys[0].device.type == "cpu" and hosted.keys[0].is_pinned()
        arriving, hit = answerer.arriving("bob")  # evicted from the GPU: copied from the host cache layer by layer
        assert isinstance(arriving, ArrivingPack) and not hit and arriving.result().keys[0].device.type == "cuda"
        assert answerer.store_reads == 2
    assert answers[2].answer == answers[0].answer == Answerer(lm, store).ask(questions["alice"]).answer


def test_without_a_host_tier_a_pack_still_streams_in(tiny_lm, store) -> None:
    answerer = Answerer(tiny_lm, store)
    arriving, hit = answerer.arriving("bob")
    assert isinstance(arriving, ArrivingPack) and not hit
    arriving.result()
    assert answerer.arriving("bob") == (answerer.ready.peek(store.resolve("bob")), True) and answerer.store_reads == 1


def test_a_bank_fact_pack_in_the_store_is_read_through_the_host_tier(tiny_lm, store) -> None:
    host = ReadyCache(1 << 30)
    answerer = Answerer(tiny_lm, store, ready=ReadyCache(1 << 30, below=host), host=host)
    pack, stored, hit = answerer.facts_pack(["Alice lives in Paris."])
    assert (stored, hit, answerer.store_reads) == (True, False, 1) and host.stats == (1, pack.header.raw_bytes)


def test_the_worker_has_a_host_tier_of_8_gib_on_an_accelerator_and_none_on_a_cpu_unless_told() -> None:
    assert (host_cache_bound(None, "cuda"), host_cache_bound(None, "cpu"), host_cache_bound(5 << 20, "cpu")) == (8 << 30, 0, 5 << 20)
    # the memory packs are decoded into: the host cache's on an accelerator; on a CPU both caches' tensors are the same
    assert (decoded_memory_bytes(2, 8, "cuda"), decoded_memory_bytes(2, 0, "cuda"), decoded_memory_bytes(4, 3, "cpu")) == (8, 0, 4)
