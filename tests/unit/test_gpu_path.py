"""The CUDA delivery path: chunks decoded into one reusable pinned pool, copied on a copy stream, each layer handed
out behind its own fence; host packs copied layer by layer. Bit for bit what the CPU decodes. Skips without CUDA,
except the parts that hold on every device."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.memory import PackMemory
from packstore.packs.reader import PackReader
from packstore.packs.tensors import ArrivingPack, encode_pack, start_copy
from packstore.store import LmdbStore
from tests.helpers.packs import make_pack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def test_a_host_pack_started_on_the_cpu_is_the_pack_itself() -> None:
    pack = make_pack(layers=2, tokens=6)
    with Decoder(workers=1) as decoder:
        assert start_copy(pack, "cpu", decoder) is pack
        assert start_copy(pack, None, decoder) is pack


def test_every_device_has_a_fence_and_the_cpus_waits_for_nothing() -> None:
    fence = HostBuffers().fence(torch.device("cpu"))
    assert fence() is None


class CopyInFlight:
    """Where a CUDA event stands for a copy in flight (the only stand-in here: CPU machines have no CUDA event): it
    completes ``seconds`` after it is made, on a timer."""

    def __init__(self, seconds: float) -> None:
        self._done = threading.Event()
        threading.Timer(seconds, self._done.set).start()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


def test_staging_counts_its_waits_for_the_pinned_pool_and_what_it_served_outside_it() -> None:
    buffers = HostBuffers(staging_bytes=4096)
    buffers._pool = PackMemory(4096)  # the pool as made on first use, unpinned here (pinning needs CUDA)
    held = buffers.staging((1024,), torch.float32, CUDA)  # the whole pool, then handed to a copy still in flight
    buffers._in_flight.append((CopyInFlight(0.05), held))  # type: ignore[arg-type]
    del held
    again = buffers.staging((1024,), torch.float32, CUDA)  # waits for that copy to give the block back
    stats = buffers.stats()
    assert (stats.pool_waits, stats.pool_fallbacks) == (1, 0) and stats.pool_wait_seconds >= 0.04
    if not torch.cuda.is_available():  # a request the pool cannot serve, nothing in flight: a pinned allocation of its own
        return
    outside = buffers.staging((4096,), torch.float32, CUDA)
    assert outside.is_pinned() and again.data_ptr() != outside.data_ptr()
    assert (buffers.stats().pool_fallbacks, buffers.stats().pool_fallback_bytes) == (1, 16384)


@cuda
def test_a_fetch_through_a_small_pool_waits_for_it_and_counts_the_waits(tmp_path) -> None:
    pack = make_pack(dtype="bfloat16", layers=4, tokens=300, heads=2, dim=32)
    buffers = HostBuffers(staging_bytes=100 << 10)  # one layer's K and V (38,400 bytes each) and a little: not two
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=1, buffers=buffers) as decoder:  # layers in turn
        key, _ = store.put(encode_pack(pack, block_positions=64))
        with torch.cuda.stream(buffers._stream(CUDA)):
            torch.cuda._sleep(50_000_000)  # the copy stream kept busy: each layer's copies are still in flight for the next
        fetched = PackReader(store, decoder).fetch(key, device="cuda")
    assert same(fetched.keys, pack.keys) and same(fetched.values, pack.values)
    stats = buffers.stats()
    assert stats.pool_waits > 0 and stats.pool_wait_seconds > 0 and stats.pool_fallbacks == 0 == stats.memory_fallbacks


@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("staging_bytes", [64 << 10, 200 << 10, 512 << 20])  # smaller than a layer; two layers; many
def test_fetch_to_cuda_is_bit_for_bit_the_cpu_decode(tmp_path, dtype: str, staging_bytes: int) -> None:
    pack = make_pack(dtype=dtype, layers=4, tokens=300, heads=2, dim=32)
    buffers = HostBuffers(staging_bytes=staging_bytes)
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=4, buffers=buffers) as decoder:
        key, _ = store.put(encode_pack(pack, block_positions=64))
        reader = PackReader(store, decoder)
        on_gpu = reader.fetch(key, device="cuda")
        arriving = reader.start_fetch(key, device=CUDA)
        layers = [arriving.layer(slot) for slot in range(4)]  # each behind its fence, on this thread's stream
        part = reader.fetch_part(key, layers=(1, 2), prefix=100, device="cuda")
    assert all(t.device.type == "cuda" for t in on_gpu.keys + on_gpu.values)
    assert same(on_gpu.keys, pack.keys) and same(on_gpu.values, pack.values)
    assert same([k for k, _ in layers], pack.keys) and same([v for _, v in layers], pack.values)
    assert same(part.keys, [k[:, :100] for k in pack.keys[1:3]])
    pool = buffers._pool
    assert pool is not None and pool._pinned is not None and pool._pinned.is_pinned()
    while buffers._wait_for_oldest_copy():
        pass
    gc.collect()
    assert pool.free_bytes == pool.nbytes  # every staging block came back: none allocated per chunk and kept


@cuda
def test_a_host_pack_is_copied_layer_by_layer_behind_fences() -> None:
    pack = make_pack(dtype="bfloat16", layers=3, tokens=200, heads=2, dim=64)
    with Decoder(workers=2) as decoder:
        pinned = [t.pin_memory() for t in pack.keys + pack.values]
        host_pack = type(pack)(header=pack.header, keys=pinned[:3], values=pinned[3:])
        moved = start_copy(host_pack, CUDA, decoder)
        assert isinstance(moved, ArrivingPack)
        first = moved.layer(0)
        assert torch.equal(first[0].cpu(), pack.keys[0])
        whole = moved.result()
    assert same(whole.keys, pack.keys) and same(whole.values, pack.values)
    assert all(t.device.type == "cuda" for t in whole.keys)


@cuda
def test_the_model_answers_the_same_with_a_pack_fetched_to_cuda(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from packstore.kv.inject import cache_from_pack

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to(CUDA).eval()
    ids = torch.randint(0, 64, (1, 300), device=CUDA)
    with torch.inference_mode():
        prefix = model(input_ids=ids[:, :280], use_cache=True).past_key_values
        keys = [layer.keys[0].cpu() for layer in prefix.layers]
        values = [layer.values[0].cpu() for layer in prefix.layers]
        expected = model(input_ids=ids[:, 280:], past_key_values=prefix).logits
    pack = make_pack(layers=3, tokens=280, heads=2, dim=16)
    pack = type(pack)(header=pack.header, keys=keys, values=values)
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=4) as decoder:
        key, _ = store.put(encode_pack(pack, block_positions=64))
        arriving = PackReader(store, decoder).start_fetch(key, device=CUDA)
        with torch.inference_mode():
            got = model(input_ids=ids[:, 280:], past_key_values=cache_from_pack(arriving, CUDA)).logits
    assert torch.equal(got, expected)


@cuda
def test_a_build_on_cuda_overlapped_with_its_prefill_stores_the_sequential_builds_bytes(tiny_model_dir, tmp_path) -> None:
    """The blocks copied off the GPU on the model's stream while later passes run (``kv.build.block_tensors``) hold
    what the whole cache copied after the prefill holds: the same chunks, byte for byte."""
    from packstore.answering.building import BuildTimings, build_into
    from packstore.kv.build import build_pack
    from packstore.kv.models import load_model

    lm = load_model(str(tiny_model_dir), device="cuda", progress=False)
    facts = [f"Fact {i}: the observatory of Wexley counts {i} bells, and Alice lives in Paris with Bob." for i in range(40)]
    sequential = encode_pack(build_pack(lm, facts), block_positions=64)
    timings = BuildTimings()
    with LmdbStore(tmp_path / "store") as store:
        key, created = build_into(store, lm, facts, block_positions=64, timings=timings)
        stored = PackReader(store).get(key)
    assert created and timings.streamed and stored.chunks == sequential.chunks and stored.header.chunks == sequential.header.chunks
