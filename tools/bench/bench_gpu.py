"""Packs on an accelerator (issues 36, 56): first token, fetch bandwidth, the worker cold and warm, build against prefill.

For each model shape given, in one run (the machines are shared and noisy: repetitions are interleaved, every
figure is a median, and the ratios within this run are what count):

(a) Time to first token (``max_new_tokens=1``) at each ``--sizes`` pack size, facts being consecutive contexts of
    ``--data`` (the last cut to the size), the question the first context's: stored = ``Answerer.ask`` with an
    empty ready-cache, the pack arriving from an LMDB store onto the device while the model runs; hosted = the pack in
    the host tier alone (a worker's host cache: pinned host memory on CUDA), copied to the device layer by layer; floor
    = the same KV already on the device (a ready-cache hit); prefill = the facts as prompt text (``answer_with_text``).
(b) Model shapes: ``--shape 1b`` / ``8b`` (Llama-3.2-1B and Llama-3.1-8B geometries with random weights, made on the
    device in seconds), ``tiny`` (a few small layers: CPU, seconds; for the test), each with ``--tokenizer``'s
    tokenizer and chat template (smollm2-135m's by default) and 40,960 positions; or ``--model DIR``, any local
    Hugging Face model directory. Several in one run; each is freed before the next.
(c) Fetch to the device: ``PackReader.fetch`` of each pack onto ``--device`` (read, verify, decode, copy) in GB/s of
    decoded KV, also with the byte planes joined on the device (``HostBuffers(join_on_device=True)``), beside the
    host-to-device copy bandwidth from pinned and from pageable memory, measured in the same rounds (n/a on CPU);
    (c2) what the two decoders' ``HostBuffers`` had to make do with meanwhile: waits for the pinned staging pool, and
    requests served outside it or outside the pack memory (``HostBuffers.stats``).
(d) The worker over gRPC: ``packstore serve`` and ``packstore worker`` on loopback (this interpreter, this process's
    packstore), packs built here and uploaded through the service (which keeps them hot); one new token, timed at the
    client, after a warm-up request: cold = a pack in no tier of the worker (a distinct pack each repetition; with
    ``--host-cache-bytes 0`` where the worker has that flag), warm = the same pack asked again (its ready-cache; both
    asserted through cache_hit). ``--worker-args='...'`` adds worker flags.
(e) Build (facts -> pack stored in an LMDB store, once each way, after a warm-up) against one prefill of the same
    tokens in a single pass (median), with the KV and stored sizes: sequential, each stage alone as before issue 56
    (e1: the chunked prefill, the copy off the device, encoding, the digest of every chunk, ``LmdbStore.put``), and
    overlapped, ``build_and_store`` (e2: chunks encoded while the prefill runs and written as they come; its stages
    summed over the coding threads, and what is left after the prefill), and whether both stored the same chunks.
(f) Decoding on the host, by stage and thread count: the stored chunks (in memory) of the pack nearest
    ``--decode-size`` tokens (8,000) checked against their digests (digest), opened into byte planes (frames: Huffman or zstd, and the tensor table checked, as
    ``open_chunk`` does for every reader), staged as planes (staged: digest, frames and the planes copied into touched
    memory, the host's share of a fetch joined on the device), and decoded whole into touched host
    memory (decode: the digest, the frames, the plane join and the bookkeeping, what a fetch does before its copy), on
    1, 2, 4, ... threads up to the cores this process may use, in GB/s of KV: which stage stops scaling, where a
    fetch falls short of the copy bandwidth.
(g) The GIL convoy: ``PackReader.fetch`` of that pack onto the device in a thread of its own (a worker's request
    thread), alone and while the main thread renders and tokenizes questions in a loop, interleaved; the fetch's time
    both ways and the main thread's renders per second alone and during the fetch.

CUDA timings synchronize the device before and after each timed call. Each result is a JSON line in ``--out``
(default ``results/bench_gpu/<rev>-<device>.jsonl``); the tables are printed at the end, progress goes to stderr.

On a GPU host, from the repository root (estimated 4-5 minutes for both shapes; on a machine without network the
wheels, a saved tokenizer and the data travel with the command: docs/benchmarks.md, "GPU path (issue 36)"):

    HF_HUB_OFFLINE=1 python3 -m tools.bench.bench_gpu --shape 1b --shape 8b [--tokenizer DIR] [--data FILE]

On CPU, for a check of the format in seconds:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_gpu --device cpu --shape tiny --sizes 300 600 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# bm25s (banks) imports JAX where it is installed, and JAX would take most of the GPU's memory in whichever process, the
# servers included, first uses it: here it may have the CPU. The servers inherit this.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grpc  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase  # noqa: E402

import packstore  # noqa: E402
from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.answering.api import build_and_store  # noqa: E402
from packstore.answering.building import BuildTimings, build_encoded  # noqa: E402
from packstore.answering.ready_caches import ReadyCache  # noqa: E402
from packstore.format.body import EncodedPack, verify_chunk  # noqa: E402
from packstore.format.chunks import open_chunk  # noqa: E402
from packstore.kv.build import build_pack, build_plan, knowledge_pack, prefill  # noqa: E402
from packstore.kv.models import LoadedModel, load_model, resolve_model_dir  # noqa: E402
from packstore.kv.render import pack_prefix_ids, render  # noqa: E402
from packstore.packs.buffers import BufferStats, HostBuffers  # noqa: E402
from packstore.packs.decoder import WORKERS, Decoder  # noqa: E402
from packstore.packs.memory import PackMemory  # noqa: E402
from packstore.packs.reader import PackReader  # noqa: E402
from packstore.packs.tensors import Pack, decode_pack, encode_pack, start_copy  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from packstore.store.remote.store import RemoteStore  # noqa: E402
from packstore.worker.client import WorkerClient  # noqa: E402
from tools.bench import bench_pack as bp  # noqa: E402
from tools.lib.benchlib import (  # noqa: E402
    JsonlRecords,
    freeze_imports,
    logger,
    machine_description,
    median,
    print_table,
    source_description,
    timed,
)
from tools.lib.servers import POLL_OPTIONS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MAX_POSITIONS = 40960
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
WORKER_STRIDE = 40  # each worker pack's facts start this many records after the previous one's: distinct packs
MB, GB = 1e6, 1e9
T = TypeVar("T")

log = logger("bench_gpu")


# -- timing and results -------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_timed(device: torch.device, fn: Callable[[], T]) -> tuple[float, T]:
    """``benchlib.timed`` with the device synchronized before the call and inside the timed region after it."""

    def run() -> T:
        result = fn()
        synchronize(device)
        return result

    synchronize(device)
    return timed(run)


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Results(JsonlRecords):
    """JSON lines written as they come, and the table rows printed at the end."""

    tables: dict[str, list[list[str]]] = field(default_factory=dict)

    def row(self, table: str, cells: Sequence[str]) -> None:
        self.tables.setdefault(table, []).append(list(cells))


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x"


# -- machine and models -------------------------------------------------------------------


def git_revision() -> str:
    try:
        done = subprocess.run(["git", "--no-optional-locks", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def machine(device: torch.device, rev: str) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return {
        "machine": machine_description({"transformers": transformers.__version__, "grpcio": grpc.__version__}),
        "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda or "none", "cpus": os.cpu_count(),
        "rev": rev, "source": source_description(),
    }


@dataclass(frozen=True)
class ModelSpec:
    """A made shape (``shape``, a key of SHAPES) or a local model directory (``path``)."""

    label: str
    shape: str | None = None
    path: Path | None = None


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """A tokenizer with its chat template: a directory holding one, or a wheel model's alias."""
    path = Path(spec)
    return AutoTokenizer.from_pretrained(path if path.is_dir() else resolve_model_dir(spec)[0])


def make_model(shape: str, tokenizer: PreTrainedTokenizerBase, dtype: str, device: torch.device, out: Path) -> Path:
    """A Llama of ``shape`` with random weights, made on ``device`` in ``dtype``, saved with ``tokenizer`` to ``out``
    (kept: a directory already there is used as it is)."""
    if (out / "config.json").exists():
        return out
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS, rope_theta=500000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **SHAPES[shape],
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    free_device()
    return out


def head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def describe(lm: LoadedModel) -> str:
    c = lm.model.config
    return (f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads, "
            f"{c.num_key_value_heads} KV heads x {head_dim(c)}, intermediate {c.intermediate_size}, {lm.dtype_name}")


def kv_bytes_per_token(lm: LoadedModel) -> int:
    c = lm.model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim(c) * lm.dtype.itemsize


# -- cases: packs in the LMDB store; (e) build against prefill ----------------------------


def fitting_facts(lm: LoadedModel, records: Sequence[bp.Record], target: int) -> tuple[list[str], str]:
    """``bench_pack.select_facts``, refused when the prompt with one new token passes the model's positions."""
    facts, question = bp.select_facts(lm, records, target)
    prompt = len(render(lm.tokenizer, facts, question).token_ids)
    limit = lm.model.config.max_position_embeddings
    if prompt + bp.FIRST_TOKEN.max_new_tokens > limit:
        raise SystemExit(f"size {target}: a prompt of {prompt} tokens does not fit the model's {limit} positions")
    return facts, question


def warm_up(lm: LoadedModel, records: Sequence[bp.Record]) -> None:
    """One short build each way and a prefill, so the first timed one pays no kernel selection, codec compilation,
    thread start or allocator growth (pinned host memory included)."""
    facts, _ = bp.select_facts(lm, records, 600)
    encode_pack(build_pack(lm, facts))
    build_encoded(lm, facts)
    prefill(lm, pack_prefix_ids(lm.tokenizer, facts))
    synchronize(lm.device)


@dataclass(frozen=True)
class BuildStages:
    """Seconds of one sequential build (the build before issue 56: each stage alone, after the one before), by stage:
    the chunked prefill (``build_pack``'s passes), the copy of the KV off the device (``knowledge_pack``), encoding
    (``encode_pack``), the store's check of every chunk (digest, timed apart), and ``LmdbStore.put`` (the one
    transaction, commit and sync included, and its own check of every chunk again: the write is put less digest)."""

    prefill: float
    copy: float
    encode: float
    digest: float
    put: float

    @property
    def total(self) -> float:
        return self.prefill + self.copy + self.encode + self.put

    @property
    def write(self) -> float:
        return max(self.put - self.digest, 0.0)


def build_staged(lm: LoadedModel, store: LmdbStore, facts: Sequence[str]) -> tuple[BuildStages, str]:
    """``store.put(encode_pack(build_pack(lm, facts)))`` taken apart and timed by stage; returns the stages and the key."""
    facts, token_ids, passes = build_plan(lm, facts)
    prefill_s, cache = device_timed(lm.device, lambda: prefill(lm, token_ids, boundaries=passes))
    copy_s, pack = timed(lambda cache=cache: knowledge_pack(lm, token_ids, facts, cache, prefill_chunks=passes))
    del cache  # the device's copy, before the host's stages
    encode_s, encoded = timed(lambda pack=pack: encode_pack(pack))
    del pack
    digest_s, _ = timed(lambda: [verify_chunk(encoded.header, i, chunk) for i, chunk in enumerate(encoded.chunks)])
    put_s, (key, _) = timed(lambda: store.put(encoded))
    return BuildStages(prefill_s, copy_s, encode_s, digest_s, put_s), key


@dataclass
class Built:
    """One size's pack as the other parts use it, and how it was built: overlapped (``build_and_store``, into the
    store the parts read) and, unless (e) is skipped, sequentially (into a store of its own, then deleted), with
    whether the two stored the same chunks (their digests)."""

    case: bp.Case
    overlapped: BuildTimings
    sequential: BuildStages | None = None
    same_chunks: bool | None = None


def build_cases(
    lm: LoadedModel, store: LmdbStore, records: Sequence[bp.Record], sizes: Sequence[int], sequential: Path | None
) -> list[Built]:
    """Each size's pack built into ``store`` by ``build_and_store`` (the seconds of each stage) and fetched onto the
    device as ``bench_pack`` does; with ``sequential`` (a directory), first built the old way into a store there."""
    built = []
    with ExitStack() as stack:
        other = stack.enter_context(LmdbStore(sequential)) if sequential is not None else None
        for target in sizes:
            log(f"building the {target}-token pack")
            facts, question = fitting_facts(lm, records, target)
            stages = same = None
            if other is not None:
                stages, other_key = build_staged(lm, other, facts)
                free_device()
            timings = BuildTimings()
            stored, _ = build_and_store(store, lm, facts, timings=timings)
            if other is not None:
                same = other.stat(other_key).header.chunks == stored.header.chunks
                other.delete(other_key)
            case = bp.Case(target, facts, question, stored.key, bp.load_stored(lm, store, stored.key), stored.stored_bytes)
            built.append(Built(case, timings, stages, same))
            free_device()
    if sequential is not None:
        shutil.rmtree(sequential, ignore_errors=True)
    return built


def bench_build(lm: LoadedModel, label: str, built: Sequence[Built], repeats: int, results: Results) -> None:
    """(e): each build against the median of ``repeats`` single-pass prefills of its tokens."""
    for one in built:
        case, t, seq = one.case, one.overlapped, one.sequential
        assert seq is not None
        ids = pack_prefix_ids(lm.tokenizer, case.facts)
        prefill_s = median([device_timed(lm.device, lambda ids=ids: prefill(lm, ids))[0] for _ in range(repeats)])
        kv_mb, stored_mb = case.kv_bytes / MB, case.stored_bytes / MB
        results.record(
            "build", shape=label, tokens=case.tokens, kv_mb=kv_mb, stored_mb=stored_mb, prefill_ms=prefill_s * 1e3,
            build_ms=t.total * 1e3, build_prefill_ms=t.prefill * 1e3, after_prefill_ms=t.after_prefill * 1e3, held_ms=t.held * 1e3,
            copy_wait_ms=t.copy * 1e3, encode_ms=t.encode * 1e3, digest_ms=t.digest * 1e3, write_ms=t.write * 1e3,
            commit_ms=t.commit * 1e3, streamed=t.streamed, build_over_prefill=t.total / prefill_s,
            seq_build_ms=seq.total * 1e3, seq_prefill_ms=seq.prefill * 1e3, seq_copy_ms=seq.copy * 1e3, seq_encode_ms=seq.encode * 1e3,
            seq_digest_ms=seq.digest * 1e3, seq_put_ms=seq.put * 1e3, seq_write_ms=seq.write * 1e3,
            seq_build_over_prefill=seq.total / prefill_s, same_chunks=one.same_chunks,
        )
        results.row("build", [label, str(case.tokens), f"{kv_mb:.1f}", f"{stored_mb:.1f}", f"{prefill_s * 1e3:.1f}",
                              f"{seq.total * 1e3:.1f}", ratio(seq.total, prefill_s), f"{t.total * 1e3:.1f}", ratio(t.total, prefill_s),
                              "yes" if one.same_chunks else "NO"])
        results.row("build_seq", [label, str(case.tokens), f"{seq.prefill * 1e3:.1f}", f"{seq.copy * 1e3:.1f}",
                                  f"{seq.encode * 1e3:.1f}", f"{kv_mb / seq.encode:.0f}", f"{seq.digest * 1e3:.1f}",
                                  f"{seq.put * 1e3:.1f}", f"{seq.write * 1e3:.1f}", f"{stored_mb / max(seq.write, 1e-9):.0f}"])
        results.row("build_overlap", [label, str(case.tokens), f"{t.total * 1e3:.1f}", f"{t.prefill * 1e3:.1f}",
                                      f"{t.after_prefill * 1e3:.1f}", f"{t.held * 1e3:.1f}", f"{t.copy * 1e3:.1f}",
                                      f"{t.encode * 1e3:.1f}", f"{t.digest * 1e3:.1f}", f"{t.write * 1e3:.1f}", f"{t.commit * 1e3:.1f}",
                                      "yes" if t.streamed else "no"])
        free_device()


# -- (a) time to first token --------------------------------------------------------------


TTFT_MODES = ("stored", "hosted", "floor", "prefill")


def hosted_first_token(lm: LoadedModel, store: LmdbStore, case: bp.Case, hosted: Pack) -> str:
    """The first token's text through ``Answerer.ask`` with the pack in the host tier alone (a worker's host cache:
    pinned memory on CUDA) and an empty device ready-cache: copied to the device layer by layer, nothing read."""
    host = ReadyCache(case.kv_bytes)
    host.put(case.key, hosted)
    answerer = Answerer(lm, store, ready=ReadyCache(case.kv_bytes, below=host), host=host, decoder=bp.DECODER)
    result = answerer.ask(Question(text=case.question, refs=(case.key,), sampling=bp.FIRST_TOKEN))
    assert result.cache_hit is False and answerer.store_reads == 0 and host.counts()[""].hits == 1
    return result.answer


def bench_ttft(
    lm: LoadedModel, store: LmdbStore, label: str, cases: Sequence[bp.Case], hosted: dict[int, Pack], repeats: int, results: Results
) -> None:
    """``bench_pack``'s three modes and the hosted one (``hosted``, each case's pack as the host tier holds it:
    ``hosted_first_token``), interleaved (the order rotates each repetition), the device synchronized."""
    modes = TTFT_MODES

    def once(case: bp.Case, mode: str) -> tuple[float, str]:
        if mode == "hosted":
            return device_timed(lm.device, lambda: hosted_first_token(lm, store, case, hosted[case.target]))
        seconds, (_, text) = device_timed(lm.device, lambda: bp.first_token(lm, store, case, mode))
        return seconds, text

    for mode in modes:
        once(cases[0], mode)
    times: dict[tuple[int, str], list[float]] = {(c.target, m): [] for c in cases for m in modes}
    texts: dict[tuple[int, str], set[str]] = {(c.target, m): set() for c in cases for m in modes}
    for r in range(repeats):
        for case in cases:
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                gc.collect()
                seconds, text = once(case, mode)
                times[case.target, mode].append(seconds)
                texts[case.target, mode].add(text)
        log(f"first token: repeat {r + 1}/{repeats} done")
    for case in cases:
        stored, hosted_s, floor, prefill_s = (median(times[case.target, m]) for m in modes)
        same = len({frozenset(texts[case.target, m]) for m in modes}) == 1
        results.record("ttft", shape=label, tokens=case.tokens, stored_ms=stored * 1e3, hosted_ms=hosted_s * 1e3, floor_ms=floor * 1e3,
                       prefill_ms=prefill_s * 1e3, same_first_token=same)
        results.row("ttft", [label, str(case.tokens), f"{stored * 1e3:.1f}", f"{hosted_s * 1e3:.1f}", f"{floor * 1e3:.1f}",
                             f"{prefill_s * 1e3:.1f}", ratio(stored, floor), ratio(hosted_s, floor), ratio(prefill_s, stored),
                             "yes" if same else "NO"])


# -- (c) fetch to the device against copy bandwidth ---------------------------------------


def copy_sources(nbytes: int) -> dict[str, torch.Tensor]:
    """Host buffers of ``nbytes`` to copy to the device from: pinned and pageable."""
    return {"pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pageable": torch.empty(nbytes, dtype=torch.uint8)}


def bench_fetch(
    lm: LoadedModel, store: LmdbStore, label: str, cases: Sequence[bp.Case], hosted: dict[int, Pack], repeats: int, results: Results
) -> None:
    """Fetches of each pack and, on CUDA, copies of the same bytes from pinned and pageable memory, interleaved."""
    reader = PackReader(store, bp.DECODER)
    joining = Decoder(WORKERS, HostBuffers(join_on_device=True))
    joined_reader = PackReader(store, joining)
    nbytes = min(max(c.kv_bytes for c in cases), 1 << 30)
    on_cuda = lm.device.type == "cuda"
    sources = copy_sources(nbytes) if on_cuda else {}
    target = torch.empty(nbytes, dtype=torch.uint8, device=lm.device) if on_cuda else None
    operations: dict[int | str, Callable[[], object]] = {c.target: lambda c=c: reader.fetch(c.key, device=lm.device) for c in cases}
    operations |= {f"joined {c.target}": lambda c=c: joined_reader.fetch(c.key, device=lm.device) for c in cases}
    operations |= {f"host {t}": lambda p=p: start_copy(p, lm.device, bp.DECODER).result() for t, p in hosted.items() if on_cuda}
    operations |= {name: lambda source=source: target.copy_(source, non_blocking=True) for name, source in sources.items()}
    seconds: dict[int | str, list[float]] = {key: [] for key in operations}
    buffers = {"host join": bp.DECODER.buffers, "device join": joining.buffers}
    before = {name: b.stats() for name, b in buffers.items() if isinstance(b, HostBuffers)}
    try:
        for operation in operations.values():
            operation()  # warm-up, and the store's pages into memory
        for r in range(repeats):
            for key, operation in operations.items():
                gc.collect()
                seconds[key].append(device_timed(lm.device, operation)[0])
            log(f"fetch: repeat {r + 1}/{repeats} done")
    finally:
        joining.close()
    record_buffers(label, "fetch", before, buffers, results)
    copy_gbps = {name: nbytes / median(seconds[name]) / GB for name in sources}
    for case in cases:
        fetch_s = median(seconds[case.target])
        gbps, joined_gbps = (case.kv_bytes / median(seconds[key]) / GB for key in (case.target, f"joined {case.target}"))
        host_gbps = case.kv_bytes / median(seconds[f"host {case.target}"]) / GB if on_cuda else None
        results.record("fetch", shape=label, tokens=case.tokens, kv_mb=case.kv_bytes / MB, fetch_ms=fetch_s * 1e3, fetch_gbps=gbps,
                       joined_on_device_gbps=joined_gbps, copy_mb=nbytes / MB, pinned_gbps=copy_gbps.get("pinned"),
                       pageable_gbps=copy_gbps.get("pageable"), host_copy_gbps=host_gbps)
        cells = [f"{copy_gbps[n]:.1f}" if n in copy_gbps else "n/a" for n in ("pinned", "pageable")]
        shares = [ratio(gbps, copy_gbps["pinned"]), f"{host_gbps:.1f}", ratio(host_gbps, copy_gbps["pinned"])] if host_gbps else ["n/a"] * 3
        results.row("fetch", [label, str(case.tokens), f"{case.kv_bytes / MB:.1f}", f"{fetch_s * 1e3:.1f}", f"{gbps:.2f}",
                              f"{joined_gbps:.2f}", *cells, *shares])


def record_buffers(label: str, part: str, before: dict[str, BufferStats], buffers: dict[str, Any], results: Results) -> None:
    """What each decoder's ``HostBuffers`` had to make do with during ``part`` (``stats()`` now less ``before``)."""
    for name, then in before.items():
        now = buffers[name].stats()
        waits, waited = now.pool_waits - then.pool_waits, now.pool_wait_seconds - then.pool_wait_seconds
        pool, memory = now.pool_fallbacks - then.pool_fallbacks, now.memory_fallbacks - then.memory_fallbacks
        pool_mb, memory_mb = (now.pool_fallback_bytes - then.pool_fallback_bytes) / MB, (now.memory_fallback_bytes - then.memory_fallback_bytes) / MB
        results.record("buffers", shape=label, during=part, decoder=name, pool_waits=waits, pool_wait_ms=waited * 1e3, pool_fallbacks=pool,
                       pool_fallback_mb=pool_mb, memory_fallbacks=memory, memory_fallback_mb=memory_mb)
        results.row("buffers", [label, part, name, str(waits), f"{waited * 1e3:.1f}", str(pool), f"{pool_mb:.1f}", str(memory), f"{memory_mb:.1f}"])


def host_pack(pack: Pack) -> Pack:
    """``pack`` in pinned host memory, as the worker's host cache holds it."""
    return Pack(pack.header, [k.cpu().pin_memory() for k in pack.keys], [v.cpu().pin_memory() for v in pack.values])


# -- (f) decoding on the host, by stage and thread count ----------------------------------

DECODE_STAGES = ("digest", "frames", "staged", "decode")
DECODE_REPEATS = 3  # at most: every stage runs at every thread count


def decode_repeats(args: argparse.Namespace) -> int:
    return min(args.repeats, DECODE_REPEATS)


def thread_counts(cores: int = WORKERS) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores``."""
    return [2**i for i in range(cores.bit_length()) if 2**i < cores] + [cores]


class StagedOnly(HostBuffers):
    """The host's share of a fetch whose planes are joined on the device (``HostBuffers(join_on_device=True)``): each
    chunk's planes staged in touched memory, as in the pinned pool, and neither copied nor joined."""

    def __init__(self, memory: PackMemory) -> None:
        super().__init__(memory, join_on_device=True)

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert self.memory is not None
        block = self.memory.take(int(torch.Size(shape).numel()) * dtype.itemsize)
        return super().staging(shape, dtype, device) if block is None else block.view(dtype).view(shape)

    def upload(self, staged: torch.Tensor, device: torch.device, then: Callable[[torch.Tensor], None]) -> None:
        """Nothing: the copy and the join are the device's."""


def decode_stages(encoded: EncodedPack, decoder: Decoder, staging: Decoder) -> dict[str, Callable[[], object]]:
    """Each stage of decoding ``encoded`` once over all its chunks, on ``decoder``'s threads (``staging``'s, which
    has as many, for the planes staged)."""
    header, indexed = encoded.header, list(enumerate(encoded.chunks))
    return {
        "digest": lambda: decoder.map(lambda item: verify_chunk(header, *item), indexed),
        "frames": lambda: decoder.map(lambda item: open_chunk(header, *item, verified=True), indexed),
        "staged": lambda: decode_pack(encoded, decoder=staging),
        "decode": lambda: decode_pack(encoded, decoder=decoder),
    }


def bench_decode(store: LmdbStore, label: str, case: bp.Case, repeats: int, results: Results) -> None:
    """(f) for ``case``: every stage at every thread count, interleaved, median of ``repeats``."""
    encoded = PackReader(store).get(case.key)
    memory = PackMemory(2 * case.kv_bytes)  # touched once, as a worker's; room for a pack being freed and the next
    staging = PackMemory(2 * case.kv_bytes)
    decoders = {n: Decoder(n, HostBuffers(memory)) for n in thread_counts()}
    stagers = {n: Decoder(n, StagedOnly(staging)) for n in decoders}
    operations = {(n, stage): op for n, decoder in decoders.items() for stage, op in decode_stages(encoded, decoder, stagers[n]).items()}
    seconds: dict[tuple[int, str], list[float]] = {key: [] for key in operations}
    try:
        for operation in operations.values():
            operation()  # warm-up: threads started, their scratch grown
        for _ in range(repeats):
            for key, operation in operations.items():
                gc.collect()
                seconds[key].append(timed(operation)[0])
    finally:
        for decoder in [*decoders.values(), *stagers.values()]:
            decoder.close()
    single = {stage: median(seconds[1, stage]) for stage in DECODE_STAGES}
    for n in decoders:
        gbps = {stage: case.kv_bytes / median(seconds[n, stage]) / GB for stage in DECODE_STAGES}
        speedup = single["decode"] / median(seconds[n, "decode"])
        results.record("decode", shape=label, tokens=case.tokens, kv_mb=case.kv_bytes / MB, chunks=len(encoded.chunks), threads=n,
                       **{f"{stage}_gbps": gbps[stage] for stage in DECODE_STAGES}, decode_speedup=speedup)
        results.row("decode", [label, str(case.tokens), str(len(encoded.chunks)), str(n),
                               *(f"{gbps[stage]:.2f}" for stage in DECODE_STAGES), f"{speedup:.2f}x"])
    log(f"{label}: decode stages timed on {', '.join(map(str, decoders))} threads")


# -- (g) a fetch beside a busy main thread (the GIL convoy) --------------------------------


def render_loop(lm: LoadedModel, case: bp.Case, busy: Callable[[], bool]) -> tuple[int, float]:
    """Render and tokenize the case's question after its first fact (what a worker's request thread does before its
    prefill) over and over while ``busy()``; returns how many renders and the seconds they took."""
    started, count = time.perf_counter(), 0
    while busy() or count == 0:
        render(lm.tokenizer, case.facts[:1], case.question)
        count += 1
    return count, time.perf_counter() - started


def bench_convoy(lm: LoadedModel, store: LmdbStore, label: str, case: bp.Case, repeats: int, results: Results) -> None:
    """(g): ``PackReader.fetch`` of ``case`` onto the device in a thread of its own (as a worker's request thread
    fetches, its chunks decoded on the decoder's threads), timed alone (this thread waiting) and while this thread
    renders and tokenizes questions in a loop (Python holding the GIL: the convoy), interleaved; and this thread's
    renders per second alone (for as long as the fetch alone took) and during the fetch."""
    decoder = Decoder(WORKERS, HostBuffers())
    reader = PackReader(store, decoder)
    before = {"convoy": decoder.buffers.stats()} if isinstance(decoder.buffers, HostBuffers) else {}

    def fetch_in_thread(beside: Callable[[Callable[[], bool]], tuple[int, float]] | None) -> tuple[float, tuple[int, float] | None]:
        seconds: list[float] = []
        thread = threading.Thread(target=lambda: seconds.append(device_timed(lm.device, lambda: reader.fetch(case.key, device=lm.device))[0]))
        thread.start()
        rendered = beside(thread.is_alive) if beside is not None else None
        thread.join()
        return seconds[0], rendered

    try:
        fetch_in_thread(None)  # warm-up: the decoder's threads started, the store's pages in memory
        render_loop(lm, case, lambda: False)
        alone, convoy, rate_alone, rate_during = [], [], [], []
        for _ in range(repeats):
            gc.collect()
            fetch_s, _ = fetch_in_thread(None)
            alone.append(fetch_s)
            deadline = time.perf_counter() + fetch_s
            count, spent = render_loop(lm, case, lambda deadline=deadline: time.perf_counter() < deadline)
            rate_alone.append(count / spent)
            gc.collect()
            fetch_s, rendered = fetch_in_thread(lambda busy: render_loop(lm, case, busy))
            assert rendered is not None
            convoy.append(fetch_s)
            rate_during.append(rendered[0] / rendered[1])
    finally:
        decoder.close()
    record_buffers(label, "convoy", before, {"convoy": decoder.buffers}, results)
    a, c, ra, rd = median(alone), median(convoy), median(rate_alone), median(rate_during)
    results.record("convoy", shape=label, tokens=case.tokens, kv_mb=case.kv_bytes / MB, fetch_alone_ms=a * 1e3, fetch_convoy_ms=c * 1e3,
                   fetch_slowdown=c / a, renders_per_s_alone=ra, renders_per_s_during=rd, repeats=repeats)
    results.row("convoy", [label, str(case.tokens), f"{case.kv_bytes / MB:.1f}", f"{a * 1e3:.1f}", f"{case.kv_bytes / a / GB:.2f}",
                           f"{c * 1e3:.1f}", f"{case.kv_bytes / c / GB:.2f}", ratio(c, a), f"{ra:.0f}", f"{rd:.0f}"])


def nearest_case(cases: Sequence[bp.Case], size: int) -> bp.Case:
    """The case whose target is nearest ``size`` (the larger of two as near)."""
    return min(cases, key=lambda case: (abs(case.target - size), -case.target))


# -- (d) the worker over gRPC -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def packstore_command(*args: str) -> list[str]:
    """``packstore ARGS`` run by this interpreter (the GPU machine has the project on PYTHONPATH, not installed)."""
    return [sys.executable, "-m", "packstore.cli.packstore_main", *args]


def server_env() -> dict[str, str]:
    """The servers' environment: offline, and the packstore this process imported first on their path (run from the
    scratch directory, they would otherwise take whichever packstore their working directory or site-packages holds)."""
    root = str(Path(packstore.__file__).resolve().parent.parent)
    return os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def worker_has_host_cache(cwd: Path) -> bool:
    """Whether this packstore's worker keeps a host cache that ``--host-cache-bytes 0`` turns off."""
    done = subprocess.run(packstore_command("worker", "--help"), capture_output=True, text=True, env=server_env(), cwd=cwd)
    return "--host-cache-bytes" in done.stdout


def wait_healthy(address: str, process: subprocess.Popen, log_file: Path, timeout: float) -> None:
    """Wait until the server at ``address`` reports SERVING; SystemExit with its log if it exits first."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address, options=POLL_OPTIONS) as channel:  # asked every 0.25 s at most, not after a growing backoff
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"{' '.join(process.args[3:5])} exited with {process.returncode}:\n{log_file.read_text()[-3000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise SystemExit(f"{address} did not become SERVING in {timeout:.0f} s:\n{log_file.read_text()[-3000:]}")


@dataclass
class Server:
    process: subprocess.Popen
    address: str
    log_file: Path


@contextmanager
def running(argv: list[str], address: str, log_file: Path) -> Iterator[Server]:
    """A ``packstore`` server process, terminated (then killed) on the way out."""
    with log_file.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=log_file.parent)
        try:
            yield Server(process, address, log_file)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def worker_packs(lm: LoadedModel, service_address: str, records: Sequence[bp.Record], sizes: Sequence[int], count: int) -> dict[int, list[tuple[str, str]]]:
    """``count`` distinct packs (key, question) of each size, built here and stored through the service."""
    packs: dict[int, list[tuple[str, str]]] = {}
    with RemoteStore(f"grpc://{service_address}") as remote:
        for size in sizes:
            log(f"building {count} worker packs of {size} tokens through the service")
            packs[size] = []
            for j in range(count):
                facts, question = fitting_facts(lm, records[WORKER_STRIDE * j :], size)
                stored, _ = build_and_store(remote, lm, facts)
                packs[size].append((stored.key, question))
    return packs


def ask_worker(client: WorkerClient, key: str, question: str, hit: bool) -> float:
    """Client-side seconds of one Generate of one new token; asserts whether the worker had the pack ready."""
    seconds, result = timed(lambda: client.ask(Question(question, refs=(key,), sampling=bp.FIRST_TOKEN)))
    assert result.cache_hit is hit, f"pack {key}: cache_hit {result.cache_hit}, expected {hit}"
    return seconds


def bench_worker(address: str, label: str, store: str, packs: dict[int, list[tuple[str, str]]], results: Results) -> None:
    """The first pack of each size warms the worker up; each later one is asked cold, then warm. ``store``: how the
    worker reaches the store (``grpc``: the service; ``local``: the service's LMDB directory, read-only)."""
    cold: dict[int, list[float]] = {s: [] for s in packs}
    warm: dict[int, list[float]] = {s: [] for s in packs}
    with WorkerClient(address) as client:
        for entries in packs.values():
            ask_worker(client, *entries[0], hit=False)
            ask_worker(client, *entries[0], hit=True)
        for r in range(1, max(len(e) for e in packs.values())):
            for size, entries in packs.items():
                gc.collect()
                cold[size].append(ask_worker(client, *entries[r], hit=False))
                warm[size].append(ask_worker(client, *entries[r], hit=True))
    for size in packs:
        c, w = median(cold[size]), median(warm[size])
        results.record("worker", shape=label, store=store, size=size, cold_ms=c * 1e3, warm_ms=w * 1e3, repeats=len(cold[size]))
        results.row("worker", [label, store, str(size), f"{c * 1e3:.1f}", f"{w * 1e3:.1f}", ratio(c, w)])


# -- one model ----------------------------------------------------------------------------


def model_dir(spec: ModelSpec, args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, models: Path) -> Path:
    if spec.path is not None:
        return spec.path
    assert spec.shape is not None
    seconds, made = device_timed(args.device, lambda: make_model(spec.shape, tokenizer, args.dtype, args.device, models / f"llama-{spec.shape}-{args.dtype}"))
    log(f"{spec.label}: model made (or found) in {seconds:.1f} s")
    return made


def store_parts(lm: LoadedModel, label: str, args: argparse.Namespace, records: Sequence[bp.Record], where: Path, results: Results) -> None:
    """(e), (a) and (c): packs of ``--sizes`` built into an LMDB store in ``where``."""
    with LmdbStore(where) as store:
        built = build_cases(lm, store, records, sorted(args.sizes), None if args.no_build else where.parent / "sequential")
        cases = [one.case for one in built]
        if not args.no_build:
            bench_build(lm, label, built, args.repeats, results)
        on_host = lm.device.type == "cuda" and not (args.no_ttft and args.no_fetch)  # pinned, as the host tier holds them
        hosted = {case.target: host_pack(case.pack) if on_host else case.pack for case in cases}  # for (a) and (c)
        if not args.no_ttft:
            bench_ttft(lm, store, label, cases, hosted, args.repeats, results)
        if not args.no_fetch:
            bench_fetch(lm, store, label, cases, hosted, args.repeats, results)
        del hosted
        if not args.no_decode:
            bench_decode(store, label, nearest_case(cases, args.decode_size), decode_repeats(args), results)
        if not args.no_convoy:
            bench_convoy(lm, store, label, nearest_case(cases, args.decode_size), args.repeats, results)


def run_model(spec: ModelSpec, args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, workdir: Path, results: Results) -> None:
    """Every part asked for, on one model; what it put on the device, and in ``workdir``, is gone on return."""
    scratch = workdir / spec.label
    scratch.mkdir(parents=True, exist_ok=True)
    path = model_dir(spec, args, tokenizer, args.models or scratch / "models")
    load_s, lm = timed(lambda: load_model(str(path), device=args.device, dtype=args.dtype, progress=False))
    records = bp.read_records(args.data)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    print(f"Model {spec.label}: {describe(lm)}; loaded in {load_s:.1f} s from {path}", flush=True)
    results.record("model", shape=spec.label, description=describe(lm), path=str(path), load_s=load_s)
    warm_up(lm, records)
    if args.sizes and not (args.no_build and args.no_ttft and args.no_fetch and args.no_decode and args.no_convoy):
        store_parts(lm, spec.label, args, records, scratch / "store", results)
        free_device()
    if args.worker_sizes:
        service_address, worker_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        data = scratch / "service"
        serve_argv = packstore_command("serve", "--data", str(data), "--listen", service_address)
        cache_bytes = 4 * max(args.worker_sizes) * kv_bytes_per_token(lm)  # the ready packs of the run, with room

        def worker_argv(store: str) -> list[str]:
            """A worker reading the service (grpc) or, on its host, the service's LMDB directory read-only (local)."""
            where = f"grpc://{service_address}" if store == "grpc" else str(data)
            return packstore_command(
                "--store", where, "worker", "--model", str(path), "--device", str(args.device), "--dtype", args.dtype,
                "--listen", worker_address, "--cache-bytes", str(cache_bytes), *args.tier_args, *args.worker_args,
            )

        with running(serve_argv, service_address, scratch / "serve.log") as service:
            wait_healthy(service.address, service.process, service.log_file, 60)
            packs: dict[int, list[tuple[str, str]]] = {}
            for store in args.worker_stores:  # one worker after the other, each new to every pack
                log_file = scratch / ("worker.log" if store == "grpc" else f"worker-{store}.log")
                with running(worker_argv(store), worker_address, log_file) as worker:  # the first loads while the packs build
                    if not packs:
                        packs = worker_packs(lm, service.address, records, sorted(args.worker_sizes), args.worker_repeats + 1)
                        del lm
                        free_device()
                    wait_healthy(worker.address, worker.process, worker.log_file, 600)
                    log(f"{spec.label}: worker on the {store} store up; cold and warm")
                    bench_worker(worker.address, spec.label, store, packs, results)
    if args.device.type == "cuda":
        results.record("memory", shape=spec.label, peak_gb=torch.cuda.max_memory_allocated(args.device) / GB)
    free_device()
    if args.logs is not None:  # the servers' logs outlive the scratch directory
        args.logs.mkdir(parents=True, exist_ok=True)
        for log_file in scratch.glob("*.log"):
            shutil.copyfile(log_file, args.logs / f"{spec.label}-{log_file.name}")
    shutil.rmtree(scratch)  # a made 8b model is 16 GB


# -- main ---------------------------------------------------------------------------------


TABLES = {
    "ttft": ("(a) Time to first token, one new token (median of {repeats}; ms): stored (from the LMDB store, cold), hosted (in the "
             "host tier, pinned on CUDA), floor (on the device already), prefill (the facts as prompt text)",
             ["model shape", "pack tokens", "stored ms", "hosted ms", "floor ms", "prefill ms", "stored / floor", "hosted / floor",
              "prefill / stored", "same token"]),
    "fetch": ("(c) Fetch to the device: PackReader.fetch GB/s of decoded KV (joined on the host; and with the byte planes "
              "joined on the device), beside host-to-device copies of min(largest KV, 1 GiB) and a pinned host pack copied "
              "layer by layer (start_copy, the host cache's path) in the same rounds (median of {repeats})",
              ["model shape", "pack tokens", "KV MB", "fetch ms", "fetch GB/s", "joined on device GB/s", "pinned GB/s", "pageable GB/s",
               "fetch / pinned",
               "host cache GB/s", "host cache / pinned"]),
    "buffers": ("(c2) The decoders' host buffers during a part (HostBuffers.stats): staging requests that waited for the pinned pool, "
                "and what was served outside it (pool: a pinned allocation of its own) or outside the pack memory (memory: pageable)",
                ["model shape", "during", "decoder", "pool waits", "waited ms", "pool fallbacks", "pool fallback MB", "memory fallbacks",
                 "memory fallback MB"]),
    "worker": ("(d) The worker, one new token at the client (median of {worker_repeats} packs; cold: in no tier of the worker, "
               "warm: the same pack again); store grpc: `--store grpc://` the service, local: on the store's host, `--store DIR` the "
               "service's LMDB directory read-only",
               ["model shape", "store", "pack tokens (target)", "cold ms", "warm ms", "cold / warm"]),
    "build": ("(e) Build (facts -> pack in the LMDB store, once each way) against one single-pass prefill of the same tokens "
              "(median of {repeats}): sequential (each stage after the last, as before issue 56) and overlapped (build_and_store: "
              "encoding while the prefill runs, the LMDB writes as chunks come); same chunks: the two stored the same digests",
              ["model shape", "pack tokens", "KV MB", "stored MB", "prefill ms", "sequential ms", "sequential / prefill",
               "overlapped ms", "overlapped / prefill", "same chunks"]),
    "build_seq": ("(e1) The sequential build by stage, each alone (ms): the chunked prefill, the KV off the device, encoding, "
                  "the digest of every chunk, LmdbStore.put (one transaction, its own digest check included), the write (put - digest)",
                  ["model shape", "pack tokens", "prefill ms", "device->host ms", "encode ms", "encode MB/s of KV", "digest ms", "put ms",
                   "write ms", "write MB/s stored"]),
    "build_overlap": ("(e2) The overlapped build by stage (ms): total; the prefill until its last pass is done (of which held: waiting for "
                      "the encoders); what is left after it; then summed over the coding threads, so overlapping the prefill: waiting "
                      "for a block's copy off the device, encoding, the store's digest check, its writes as chunks come; the commit",
                      ["model shape", "pack tokens", "total ms", "prefill ms", "after prefill ms", "held ms", "copy wait ms",
                       "encode ms", "digest ms", "write ms", "commit ms", "streamed"]),
    "decode": ("(f) Decoding a pack on the host (the size nearest --decode-size), by stage and thread count, GB/s of KV (median of {decode_repeats}; "
               "digest: chunks checked; frames: coded into byte planes; staged: the host's share when planes are joined on the "
               "device, planes staged in touched host memory; decode: whole, into touched host memory)",
               ["model shape", "pack tokens", "chunks", "threads", "digest GB/s", "frames GB/s", "staged GB/s", "decode GB/s",
                "decode vs 1 thread"]),
    "convoy": ("(g) A fetch beside a busy main thread (the GIL convoy): PackReader.fetch onto the device in a thread of its own, alone "
               "and while the main thread renders and tokenizes questions in a loop (median of {repeats}), and the main thread's renders "
               "per second alone and during the fetch",
               ["model shape", "pack tokens", "KV MB", "fetch alone ms", "alone GB/s", "fetch beside renders ms", "beside GB/s",
                "slowdown", "renders/s alone", "renders/s during fetch"]),
}


def print_tables(results: Results, args: argparse.Namespace) -> None:
    for part, (title, headers) in TABLES.items():
        if part in results.tables:
            title = title.format(repeats=args.repeats, worker_repeats=args.worker_repeats, decode_repeats=decode_repeats(args))
            print_table(title, headers, results.tables[part])
    if results.tables.get("worker") and args.tier_args:
        print("   worker cold: run with --host-cache-bytes 0 (no host cache)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", dest="specs", action="append", type=lambda s: ModelSpec(s, shape=s), metavar="{" + ",".join(SHAPES) + "}",
                        help="a Llama shape with random weights (repeatable)")
    parser.add_argument("--model", dest="specs", action="append", type=lambda p: ModelSpec(Path(p).name, path=Path(p)), metavar="DIR",
                        help="a local Hugging Face model directory (repeatable)")
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--sizes", type=int, nargs="*", default=[2048, 8000, 32000], help="pack sizes in tokens (a, c, e)")
    parser.add_argument("--worker-sizes", type=int, nargs="*", default=[2048, 8000], help="pack sizes for the worker (d)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions (a, c) and prefills (e)")
    parser.add_argument("--worker-repeats", type=int, default=3, help="distinct cold packs per size for the worker (d)")
    parser.add_argument("--worker-stores", nargs="+", choices=["grpc", "local"], default=["grpc", "local"],
                        help="how the worker (d) reads the store: grpc (the service) and local (its LMDB directory, on its host)")
    parser.add_argument("--worker-args", type=shlex.split, default=[], help="extra worker flags, e.g. --worker-args='--threads 8'")
    parser.add_argument("--no-ttft", action="store_true", help="skip (a)")
    parser.add_argument("--no-fetch", action="store_true", help="skip (c)")
    parser.add_argument("--no-worker", action="store_true", help="skip (d)")
    parser.add_argument("--no-build", action="store_true", help="skip (e)")
    parser.add_argument("--no-decode", action="store_true", help="skip (f)")
    parser.add_argument("--no-convoy", action="store_true", help="skip (g)")
    parser.add_argument("--decode-size", type=int, default=8000, help="(f) and (g) take the pack of --sizes nearest this (default 8000)")
    parser.add_argument("--tokenizer", default=bp.MODEL, help="tokenizer and chat template of made shapes: a directory, or a wheel alias")
    parser.add_argument("--data", type=Path, default=bp.DATA, help="JSON lines with 'context' and 'question'")
    parser.add_argument("--models", type=Path, help="where made shapes are saved and found again (default: the temporary workdir)")
    parser.add_argument("--workdir", type=Path, help="where stores and logs go (default: a temporary directory, removed after)")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs (serve, worker) here (default: removed with the workdir)")
    parser.add_argument("--rev", default=None, help="the revision measured (default: git rev-parse --short HEAD)")
    parser.add_argument("--out", type=Path, help="JSON lines of every result (default: results/bench_gpu/<rev>-<device>.jsonl)")
    args = parser.parse_args(argv)
    if not args.specs:
        parser.error("give at least one --shape or --model")
    for spec in args.specs:
        if spec.shape is not None and spec.shape not in SHAPES:
            parser.error(f"--shape {spec.shape}: expected one of {', '.join(SHAPES)}")
    if args.repeats < 1 or args.worker_repeats < 1:
        parser.error("repetitions must be at least 1")
    args.dtype = args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")
    args.worker_sizes = [] if args.no_worker else args.worker_sizes
    args.rev = args.rev or git_revision()
    args.out = args.out or ROOT / "results" / "bench_gpu" / f"{args.rev}-{args.device.type}.jsonl"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    freeze_imports()  # each gc.collect() between timed calls then scans what the run made, not the imports (0.26 s each)
    started = time.perf_counter()
    about = machine(args.device, args.rev)
    print(f"Machine: {about['machine']}\nGPU: {about['gpu']}; torch {about['torch']}; CUDA {about['cuda']}; {about['cpus']} CPUs")
    print(f"Source: {about['source']} (rev {args.rev}); device {args.device}, {args.dtype}; data {args.data.name}", flush=True)
    results = Results(args.out, {"rev": args.rev, "device": args.device.type, "dtype": args.dtype})
    results.record("machine", **about)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="packstore-bench-gpu-", dir=args.workdir) as tmp:
            args.tier_args = ["--host-cache-bytes", "0"] if args.worker_sizes and worker_has_host_cache(Path(tmp)) else []
            for spec in args.specs:
                log(f"model {spec.label}")
                run_model(spec, args, tokenizer, Path(tmp), results)
    finally:  # what was measured is printed even when a later part fails: device time is rationed
        print_tables(results, args)
    total = time.perf_counter() - started
    results.record("total", seconds=total)
    print(f"\nTotal run time: {total:.0f} s; results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
