"""Tenants sharing one service and one worker: hot packs kept per namespace (issue 34), and an honest tenant's latency
beside a hostile one (issue 53: fair shares).

Part 1, hot (issue 34): tenant B's read times with and without tenant A holding the same pack hot.
The script starts ``packstore serve --auth`` on 127.0.0.1 with two tenants, ``a`` and ``b``, each with a write token
for its own namespace, and a ``--hot-bytes`` that holds one pack (per namespace). Both namespaces' stores hold pack P
(the same content, so the same key and header digest) and Q, another pack of the same shape. Each repetition, in a
rotating order, B first reads Q whole, which evicts P from B's own hot packs, then:

- same:  A reads P whole (hot in A's namespace, evicting whatever was hot there), then B reads P (timed);
- other: A reads Q whole (the same eviction, another pack), then B reads P (timed);
- hot:   B reads P again right away (timed): B's own hot copy, i.e. what B would see if A's copy served B.

B's read is ``RemoteStore.fetch`` into CPU tensors over the local bulk socket, as a client on the service's host
does by default. If hot copies crossed tenants, ``same`` would read like ``hot``; kept apart, ``same`` reads like
``other``. The packs have random float32 K/V in smollm2-135m's shape (30 layers, 3 KV heads x 64) at ``--tokens``.

Part 2, latency (issue 53): honest tenant A's p50 and p99 latency, quiet and with a hostile tenant B.
A fresh ``packstore serve --auth --workers W`` (``--workers``, default 4) and ``packstore worker --auth --http``
on smollm2-135m (float32, ``--threads`` torch threads, ``--max-concurrent`` generation slots, default 4) run with
tokens ``a``, ``b`` and the worker's own (it reads each caller's namespace). A, one request at a time, times:

- fetch, bulk:   ``PackReader(RemoteStore(...)).fetch`` of a ``--fetch-tokens`` pack (random float32 K/V in
                 smollm2-135m's shape) over the local bulk socket, as a client on the service's host does;
- fetch, stream: the same with ``RemoteStore(..., bulk=False)``: the chunks on GetPack's gRPC stream;
- answer:        a short greedy answer (``--answer-tokens``, 8) with a pack of a few facts built on the real model,
                 over the worker's HTTP API (``/v1/chat/completions``, whole) or, with ``--answer-api grpc``, its gRPC
                 ``Generate``.

Each answer is compared with A's first (greedy: the same text), each fetch with the pack as built (a layer's K and
V); a failure, timeout or difference is an error, counted per phase and kind (and left out of the percentiles).

Quiet and hostile phases alternate (``--rounds`` pairs, the order alternating), so the machine's noise hits both.
In a hostile phase B holds everything it can the whole time:

- on the service, every ``--hold-seconds`` (20, under the service's 60 s stream allowance), B first takes
  2 x (workers x 4) bulk tickets one after another and presents each on the local bulk socket, reading nothing
  after the first frame (the bulk port's slots: workers x 4, at most half per principal), then opens 2 x workers
  GetPack streams of a ~50 MB pack with ``bulk=false``, each on a channel of its own, and reads nothing after the
  first message (the transfer slots: at most half per principal, the last quarter kept for principals holding
  none); then drops them all and takes them again;
- on the worker, ``--max-concurrent`` threads ask over HTTP for whole (non-streaming) answers of
  ``--hostile-tokens`` tokens (sampled, a prompt that runs to its length), each asking again as soon as its answer
  comes or 0.5 s after a refusal (429); as many more threads open gRPC ``Generate`` streams of the same, one every
  0.5 s each, and never read them (the worker's slots: shared by both ports, at most half per principal).

What B held and was refused is counted from its side and from the service's and worker's logs. The ratios within
this one run (hostile / quiet, at p50 and p99) are what count: the machine is shared with whatever else runs on it.
p99 of 30 samples lies between the two slowest.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_tenants [--repeats 15] [--tokens 2048] [--requests 30]
        [--answers 30] [--rounds 3] [--hostile-tokens 64] [--only hot|latency]

About 6-10 minutes on 2 cores by default (part 2 most of it; a hostile phase's answers wait for B's generations).
Records (JSON lines, one per timed request) and the printed output go to results/bench_tenants/, named with the
commit (``-dirty`` when packstore/ or tools/ had uncommitted changes). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import http.client
import io
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import torch  # noqa: E402

from packstore.answering.answer import Question  # noqa: E402
from packstore.kv.inject import Sampling  # noqa: E402
from packstore.packs.decoder import Decoder  # noqa: E402
from packstore.packs.reader import PackReader  # noqa: E402
from packstore.packs.tensors import Pack, encode_pack  # noqa: E402
from packstore.rpc.channel import Connection  # noqa: E402
from packstore.rpc.frames import FRAME, MAGIC, recv_exact  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from packstore.store.namespaces import namespace_path  # noqa: E402
from packstore.store.remote.store import RemoteStore  # noqa: E402
from packstore.v1 import store_pb2, store_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from packstore.worker.client import WorkerClient  # noqa: E402
from tools.lib.benchlib import (  # noqa: E402
    JsonlRecords,
    elapsed,
    logger,
    machine_description,
    median,
    print_table,
    source_commit,
    source_description,
    timed,
)
from tools.lib.packs import make_pack  # noqa: E402
from tools.lib.servers import free_port, running_server, running_worker  # noqa: E402

DECODER = Decoder()  # the chunk threads every read of this run decodes on, as a program's entry point makes one

log = logger("bench_tenants")
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "bench_tenants"
MODEL = "smollm2-135m"
TOKENS = {"a": "bench-secret-a", "b": "bench-secret-b"}
WORKER_TOKEN = "bench-secret-worker"  # the worker's own token for the store: reads both namespaces
ORDERS = (("same", "other"), ("other", "same"))
KINDS = ("fetch, bulk", "fetch, stream", "answer")
CONDITIONS = ("quiet", "hostile")
FACTS = [
    "The Wexley Bridge over the river Amber was completed in 1887 by the engineer Hannah Wexley.",
    "It is 412 metres long and carries two railway tracks.",
]
QUESTION = "When was the Wexley Bridge completed?"
HOSTILE_PROMPT = "Write a very long story about the bridge."  # sampled at temperature 1, runs to its length
CHUNK = 1  # the bulk port's first frame kind for an admitted transfer (ERROR: 3, refused)
RETRY_SECONDS = 0.5  # how soon a hostile asker asks again after a refusal (and how often the gRPC ones open a stream)
SETTLE_SECONDS = 3.0  # after B starts (to hold all it can) and after it stops (for its transfers and generations to end)


def tokens_file(path: Path) -> Path:
    entries = [(f"{ns}-writer", secret, [ns], "write") for ns, secret in TOKENS.items()]
    entries.append(("worker", WORKER_TOKEN, list(TOKENS), "read"))
    path.write_text(
        "\n".join(
            f'[[token]]\nname = "{name}"\nsha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"\nnamespaces = {json.dumps(spaces)}\nrole = "{role}"\n'
            for name, secret, spaces, role in entries
        )
    )
    return path


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile, interpolated between the samples (``statistics.quantiles``, inclusive)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def spread(counts: dict[str, int]) -> list[str]:
    """The kinds ``counts`` asks for, interleaved evenly (each kind's requests spaced across the phase)."""
    slots = [((i + 0.5) / n, order, kind) for order, (kind, n) in enumerate(counts.items()) for i in range(n)]
    return [kind for _, _, kind in sorted(slots)]


def share_of(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split as evenly as can be into ``parts``."""
    return total // parts + (1 if index < total % parts else 0)


class Tee(io.TextIOBase):
    """stdout, also kept in memory: the printed output, written to results/ at the end."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


# -- part 1: hot packs per namespace ---------------------------------------------------------


def bench_hot(args: argparse.Namespace, records: JsonlRecords) -> None:
    shared = make_pack(layers=30, tokens=args.tokens, heads=3, dim=64)
    other = make_pack(layers=30, tokens=args.tokens + 1, heads=3, dim=64)
    encoded_shared, encoded_other = encode_pack(shared), encode_pack(other)
    print(f"\n1. Hot packs per namespace. Packs: {args.tokens} tokens, float32, {encoded_shared.header.raw_bytes / 1e6:.0f} MB of KV, "
          f"{encoded_shared.stored_bytes / 1e6:.0f} MB stored")
    with tempfile.TemporaryDirectory(prefix="packstore-bench-tenants-") as tmp:
        data = Path(tmp) / "data"
        for namespace in ("a", "b"):
            with LmdbStore(namespace_path(data, namespace)) as store:
                for encoded in (encoded_shared, encoded_other):
                    store.put(encoded)
        shared_key, other_key = encoded_shared.header.key, encoded_other.header.key
        hot_bytes = str(int(encoded_shared.stored_bytes * 1.5))
        with running_server(data, "--auth", str(tokens_file(Path(tmp) / "tokens.toml")), "--hot-bytes", hot_bytes) as server:
            a = RemoteStore(server.url, connection=Connection(token=TOKENS["a"]))
            b = RemoteStore(server.url, connection=Connection(token=TOKENS["b"]))
            times: dict[str, list[float]] = {"same": [], "other": [], "hot": []}
            for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
                for condition in ORDERS[repeat % 2]:
                    PackReader(b, DECODER).fetch(other_key)  # P leaves B's hot packs (--hot-bytes is per namespace)
                    PackReader(a, DECODER).fetch(shared_key if condition == "same" else other_key)
                    gc.collect()
                    seconds, _ = timed(lambda: PackReader(b, DECODER).fetch(shared_key))
                    hot_seconds, _ = timed(lambda: PackReader(b, DECODER).fetch(shared_key))
                    if repeat:
                        times[condition].append(seconds)
                        times["hot"].append(hot_seconds)
                        records.record("hot", repeat=repeat, condition=condition, seconds=seconds, hot_seconds=hot_seconds)
                log(f"hot: repetition {repeat}/{args.repeats}")
            a.close()
            b.close()
    same, different, hot = (median(times[k]) * 1000 for k in ("same", "other", "hot"))
    rows = [
        ["B reads P cold, A holds P hot (same)", f"{same:.1f}", f"{same / different:.2f}x"],
        ["B reads P cold, A holds Q hot (other)", f"{different:.1f}", "1.00x"],
        ["B reads P from its own hot copy (hot)", f"{hot:.1f}", f"{hot / different:.2f}x"],
    ]
    print_table(f"Tenant B's RemoteStore.fetch, median of {args.repeats} (ms)", ["read", "ms", "vs other"], rows)


# -- part 2: an honest tenant beside a hostile one --------------------------------------------


class HostileStore:
    """Tenant B holding every transfer and bulk slot of the service it can, unread, retaken every ``hold_seconds``."""

    def __init__(self, server, key: str, workers: int, hold_seconds: float) -> None:
        self.server, self.key, self.workers, self.hold_seconds = server, key, workers, hold_seconds
        self.counts: Counter[str] = Counter()
        self.cycles: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hostile-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            with ExitStack() as stack:
                cycle = self._take(stack)
                self.cycles.append(cycle)
                self.counts.update(cycle)
                self._stop.wait(self.hold_seconds)
            if not self._stop.is_set():
                time.sleep(0.5)  # for the service to see them dropped and free their slots

    def _take(self, stack: ExitStack) -> dict[str, int]:
        cycle: Counter[str] = Counter()
        channel = stack.enter_context(grpc.insecure_channel(self.server.address))
        stub = store_pb2_grpc.PackStoreStub(channel)
        for _ in range(2 * self.workers * 4):  # bulk tickets first: taking one needs a transfer slot for a moment
            if self._stop.is_set():
                break
            try:
                _, ticket = list(stub.GetPack(store_pb2.GetPackRequest(ref=self.key, bulk=True), metadata=bearer("b"), timeout=30))
            except grpc.RpcError as exc:
                cycle[f"ticket refused ({exc.code().name})"] += 1
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stack.callback(sock.close)
            try:
                sock.settimeout(30)
                sock.connect("\0" + ticket.bulk.local_socket)
                sock.sendall(MAGIC + ticket.bulk.ticket)
                kind, _, _ = FRAME.unpack(bytes(recv_exact(sock, FRAME.size)))
            except OSError as exc:
                cycle[f"bulk failed ({type(exc).__name__})"] += 1
                continue
            cycle["bulk held" if kind == CHUNK else "bulk refused"] += 1
        for _ in range(2 * self.workers):
            if self._stop.is_set():
                break
            stream_channel = stack.enter_context(grpc.insecure_channel(self.server.address))
            responses = store_pb2_grpc.PackStoreStub(stream_channel).GetPack(
                store_pb2.GetPackRequest(ref=self.key, bulk=False), metadata=bearer("b")
            )
            stack.callback(responses.cancel)
            try:
                next(responses)
                cycle["streams held"] += 1
            except grpc.RpcError as exc:
                cycle["streams refused" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else f"streams failed ({exc.code().name})"] += 1
        return dict(cycle)


class HostileWorker:
    """Tenant B keeping every generation slot of the worker it can busy with long generations: ``askers`` threads
    asking for whole answers over HTTP, as many opening gRPC streams they never read."""

    def __init__(self, http: str, grpc_address: str, key: str, askers: int, tokens: int) -> None:
        self.http, self.grpc_address, self.key, self.askers, self.tokens = http, grpc_address, key, askers, tokens
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._connections: list[http.client.HTTPConnection] = []
        self._calls: list[Any] = []
        self._seed = 0

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def next_seed(self) -> int:
        with self._lock:
            self._seed += 1
            return self._seed

    def start(self) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._http, name=f"hostile-http-{i}", daemon=True) for i in range(self.askers)]
        self._threads += [threading.Thread(target=self._grpc, name=f"hostile-grpc-{i}", daemon=True) for i in range(self.askers)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for connection in self._connections:  # a whole answer being waited for: the worker stops it within a token
                if connection.sock is not None:
                    try:
                        connection.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            for call in self._calls:
                call.cancel()
        for thread in self._threads:
            thread.join()
        self._connections.clear()
        self._calls.clear()

    def _http(self) -> None:
        host, port = self.http.rsplit(":", 1)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKENS['b']}"}
        while not self._stop.is_set():
            body = {
                "model": MODEL, "messages": [{"role": "user", "content": HOSTILE_PROMPT}], "packs": [self.key],
                "max_tokens": self.tokens, "temperature": 1.0, "seed": self.next_seed(),
            }
            connection = http.client.HTTPConnection(host, int(port), timeout=3600)
            with self._lock:
                self._connections.append(connection)
            try:
                connection.request("POST", "/v1/chat/completions", json.dumps(body), headers)
                response = connection.getresponse()
                answer = json.loads(response.read())
                if response.status == 200:
                    self.count("http answered")
                    self.count("http tokens", answer["usage"]["completion_tokens"])
                else:
                    self.count(f"http {response.status}")
                    self._stop.wait(RETRY_SECONDS)
            except (OSError, http.client.HTTPException, ValueError):
                if not self._stop.is_set():
                    self.count("http failed")
                    self._stop.wait(RETRY_SECONDS)
            finally:
                connection.close()
                with self._lock:
                    self._connections.remove(connection)

    def _grpc(self) -> None:
        with grpc.insecure_channel(self.grpc_address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            while not self._stop.is_set():
                request = worker_pb2.GenerateRequest(
                    packs=[self.key], question=HOSTILE_PROMPT,
                    sampling=worker_pb2.Sampling(max_new_tokens=self.tokens, temperature=1.0, seed=self.next_seed()),
                )
                call = stub.Generate(request, metadata=bearer("b"))  # started at once, and never read
                with self._lock:
                    self._calls.append(call)
                self.count("grpc streams opened")
                self._stop.wait(RETRY_SECONDS)


class Tenant:
    """Honest tenant A: one request at a time, each timed and checked."""

    def __init__(self, server_url: str, worker, http: str, fetch_key: str, fetch_pack: Pack, answer_key: str, args) -> None:
        connection = Connection(token=TOKENS["a"])
        self.bulk = RemoteStore(server_url, connection=connection, timeout=60)
        self.stream = RemoteStore(server_url, connection=connection, bulk=False, timeout=60)
        self.worker, self.http, self.args = worker, http, args
        self.fetch_key, self.fetch_pack, self.answer_key = fetch_key, fetch_pack, answer_key
        self.expected: str | None = None

    def close(self) -> None:
        self.bulk.close()
        self.stream.close()

    def request(self, kind: str) -> Callable[[], None]:
        return {"fetch, bulk": lambda: self.fetch(self.bulk), "fetch, stream": lambda: self.fetch(self.stream), "answer": self.answer}[kind]

    def fetch(self, store: RemoteStore) -> None:
        pack = PackReader(store, DECODER).fetch(self.fetch_key)
        if not (torch.equal(pack.keys[0], self.fetch_pack.keys[0]) and torch.equal(pack.values[-1], self.fetch_pack.values[-1])):
            raise AssertionError("the fetched pack differs from the one stored")

    def answer(self) -> None:
        text = self._ask_grpc() if self.args.answer_api == "grpc" else self._ask_http()
        if self.expected is None:
            self.expected = text
        elif text != self.expected:
            raise AssertionError(f"answer {text!r} differs from the first, {self.expected!r}")

    def _ask_http(self) -> str:
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "packs": [self.answer_key],
            "max_tokens": self.args.answer_tokens, "temperature": 0,
        }
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKENS['a']}"}
        request = urllib.request.Request(f"http://{self.http}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.args.answer_timeout) as response:
                return json.loads(response.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None

    def _ask_grpc(self) -> str:
        question = Question(QUESTION, refs=(self.answer_key,), sampling=Sampling(max_new_tokens=self.args.answer_tokens))
        with WorkerClient(self.worker.address, connection=Connection(token=TOKENS["a"]), timeout=self.args.answer_timeout) as client:
            return client.ask(question).answer


def build_answer_pack(threads: int) -> tuple[Any, str]:
    """The facts' pack on the real model (float32, as the worker loads it), encoded, and its key."""
    from packstore.kv.build import build_pack
    from packstore.kv.models import load_model

    torch.set_num_threads(threads)
    lm = load_model(MODEL, dtype="float32", progress=False)
    encoded = encode_pack(build_pack(lm, FACTS))
    del lm
    gc.collect()
    return encoded, encoded.header.key


def log_window(lines: list[dict], start: float, end: float) -> list[dict]:
    return [line for line in lines if start <= line.get("ts", 0) <= end]


def bench_latency(args: argparse.Namespace, records: JsonlRecords) -> None:
    fetch_pack = make_pack(layers=30, tokens=args.fetch_tokens, heads=3, dim=64)
    encoded_fetch = encode_pack(fetch_pack)
    stall_pack = encode_pack(make_pack(layers=8, tokens=3072, heads=4, dim=64))  # more than socket buffers and windows hold
    log("building the answer pack on the real model")
    answer_pack, answer_key = build_answer_pack(args.threads)
    max_concurrent = args.max_concurrent
    print(
        f"\n2. An honest tenant A beside a hostile tenant B. Service: --workers {args.workers} (A's fetch pack: "
        f"{args.fetch_tokens} tokens, {encoded_fetch.header.raw_bytes / 1e6:.0f} MB of KV, {encoded_fetch.stored_bytes / 1e6:.0f} MB "
        f"stored; B's: {stall_pack.stored_bytes / 1e6:.0f} MB stored). Worker: {MODEL} float32 on CPU, --threads {args.threads}, "
        f"--max-concurrent {max_concurrent}; A's answer: {args.answer_tokens} tokens greedy over {args.answer_api}, a pack of "
        f"{answer_pack.header.tokens} tokens; B's generations: {args.hostile_tokens} tokens sampled."
    )
    phases: list[dict[str, Any]] = []
    times: dict[tuple[str, str], list[float]] = {(kind, c): [] for kind in KINDS for c in CONDITIONS}
    errors: dict[tuple[str, str], int] = {(kind, c): 0 for kind in KINDS for c in CONDITIONS}
    with tempfile.TemporaryDirectory(prefix="packstore-bench-tenants-") as tmp:
        root = Path(tmp)
        data = root / "data"
        with LmdbStore(namespace_path(data, "a")) as store:
            fetch_key, _ = store.put(encoded_fetch)
        with LmdbStore(namespace_path(data, "b")) as store:
            stall_key, _ = store.put(stall_pack)
        tokens = tokens_file(root / "tokens.toml")
        (root / "worker.token").write_text(WORKER_TOKEN)
        http = f"127.0.0.1:{free_port()}"
        server_args = ("--auth", str(tokens), "--workers", str(args.workers))
        with running_server(data, *server_args) as server:
            for name in ("a", "b"):
                with RemoteStore(server.url, connection=Connection(token=TOKENS[name])) as remote:
                    remote.put(answer_pack)
            log("starting the worker")
            worker_args = (
                "--auth", str(tokens), "--token-file", str(root / "worker.token"), "--http", http,
                "--max-concurrent", str(max_concurrent), "--threads", str(args.threads),
            )
            with running_worker(server.url, MODEL, root, *worker_args) as worker:
                tenant = Tenant(server.url, worker, http, fetch_key, fetch_pack, answer_key, args)
                for kind in KINDS:  # warm-up, not counted: connections, A's pack hot in the service and ready in the worker
                    tenant.request(kind)()
                log(f"A's answer: {tenant.expected!r}")
                hostile_store = HostileStore(server, stall_key, args.workers, args.hold_seconds)
                hostile_worker = HostileWorker(http, worker.address, answer_key, max_concurrent, args.hostile_tokens)
                phase_index = 0
                for round_index in range(args.rounds):
                    order = CONDITIONS if round_index % 2 == 0 else CONDITIONS[::-1]
                    counts = {
                        "fetch, bulk": share_of(args.requests, args.rounds, round_index),
                        "fetch, stream": share_of(args.requests, args.rounds, round_index),
                        "answer": share_of(args.answers, args.rounds, round_index),
                    }
                    for condition in order:
                        phase: dict[str, Any] = {"round": round_index, "phase": phase_index, "condition": condition}
                        store_before, worker_before = Counter(hostile_store.counts), Counter(hostile_worker.counts)
                        if condition == "hostile":
                            hostile_store.start()
                            hostile_worker.start()
                            time.sleep(SETTLE_SECONDS)
                        phase["start"] = time.time()
                        phase_errors: Counter[str] = Counter()
                        loads: list[float] = []  # the 1-minute load average at each of A's requests: how shared the cores were
                        for kind in spread(counts):
                            gc.collect()
                            started = time.time()
                            try:
                                seconds, _ = timed(tenant.request(kind))
                                ok, error = True, None
                            except Exception as exc:  # counted, not raised: A's failures are what part 2 looks for
                                seconds, ok, error = time.time() - started, False, f"{type(exc).__name__}: {exc}"[:500]
                            if ok:
                                times[kind, condition].append(seconds)
                            else:
                                errors[kind, condition] += 1
                                phase_errors[kind] += 1
                                log(f"A's {kind} failed: {error}")
                            records.record(
                                "latency", round=round_index, phase=phase_index, condition=condition, kind=kind,
                                seconds=seconds, ok=ok, error=error, at=started, load1=os.getloadavg()[0],
                            )
                            loads.append(os.getloadavg()[0])
                        phase["end"] = time.time()
                        if condition == "hostile":
                            hostile_store.stop()
                            hostile_worker.stop()
                        phase["a_requests"], phase["a_errors"] = dict(counts), dict(phase_errors)
                        phase["load1"] = [min(loads), max(loads)]
                        phase["b_store"] = dict(hostile_store.counts - store_before)
                        phase["b_worker"] = dict(hostile_worker.counts - worker_before)
                        phases.append(phase)
                        log(f"round {round_index + 1}/{args.rounds}, {condition}: {phase['end'] - phase['start']:.0f} s, "
                            f"A's errors {sum(phase_errors.values())}, B {phase['b_store']} {phase['b_worker']}")
                        time.sleep(SETTLE_SECONDS)  # B's transfers and generations end before the next phase
                        phase_index += 1
                tenant.close()
            worker_lines = worker_log(root)
        service_lines = server.log_lines()
    report_latency(args, times, errors, phases, service_lines, worker_lines, records)


def worker_log(log_dir: Path) -> list[dict]:
    path = log_dir / "worker.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")] if path.exists() else []


def report_latency(
    args, times: dict, errors: dict, phases: list[dict], service_lines: list[dict], worker_lines: list[dict], records: JsonlRecords
) -> None:
    rows = []
    for kind in KINDS:
        quiet, hostile = times[kind, "quiet"], times[kind, "hostile"]
        if not quiet or not hostile:
            rows.append([kind, *(["-"] * 6), f"{errors[kind, 'quiet']} / {errors[kind, 'hostile']}"])
            continue
        q50, q99 = percentile(quiet, 50) * 1000, percentile(quiet, 99) * 1000
        h50, h99 = percentile(hostile, 50) * 1000, percentile(hostile, 99) * 1000
        rows.append([
            f"{kind} ({len(quiet)} / {len(hostile)})", f"{q50:.1f}", f"{h50:.1f}", f"{h50 / q50:.2f}x", f"{q99:.1f}", f"{h99:.1f}",
            f"{h99 / q99:.2f}x", f"{errors[kind, 'quiet']} / {errors[kind, 'hostile']}",
        ])
        records.record("summary", kind=kind, quiet_p50=q50, quiet_p99=q99, hostile_p50=h50, hostile_p99=h99,
                       p50_ratio=h50 / q50, p99_ratio=h99 / q99, errors_quiet=errors[kind, "quiet"], errors_hostile=errors[kind, "hostile"])
    print_table(
        f"Tenant A's latency, quiet vs with hostile tenant B ({args.rounds} rounds, phases interleaved; ms; requests quiet / hostile)",
        ["A's request", "quiet p50", "hostile p50", "x", "quiet p99", "hostile p99", "x", "errors q / h"], rows,
    )
    phase_rows = []
    for phase in phases:
        start, end = phase["start"], phase["end"]
        service, worker = log_window(service_lines, start, end), log_window(worker_lines, start, end)
        b_gets = Counter(line.get("code") for line in service if line.get("token") == "b-writer" and line.get("method", "").startswith("GetPack"))
        b_gens = [line for line in worker if line.get("token") == "b-writer" and line.get("method") in ("Generate", "ChatCompletions")]
        b_codes = Counter(line.get("code") for line in b_gens)
        b_tokens = sum(line.get("tokens", 0) for line in b_gens if line.get("code") in ("OK", "CANCELLED"))
        a_lines = [line for line in service + worker if line.get("token") == "a-writer" and line.get("method") not in (None, "PutPack")]
        a_calls = Counter(line.get("code") for line in a_lines)
        b_store, a_errors = phase["b_store"], sum(phase["a_errors"].values())
        held = f"none ({sum(b_gets.values())} calls logged)" if phase["condition"] == "quiet" else (
            f"{b_store.get('streams held', 0)}/{b_store.get('streams refused', 0)} streams, "
            f"{b_store.get('bulk held', 0)}/{b_store.get('bulk refused', 0)} bulk"
        )
        generations = f"{b_codes.get('OK', 0) + b_codes.get('CANCELLED', 0)}/{b_codes.get('RESOURCE_EXHAUSTED', 0)}, {b_tokens} tokens"
        phase_rows.append([
            f"{phase['round'] + 1} {phase['condition']}", f"{end - start:.0f}", "{:.1f}-{:.1f}".format(*phase["load1"]),
            str(sum(phase["a_requests"].values())), str(a_errors),
            ",".join(f"{code} {n}" for code, n in sorted(a_calls.items())), held, generations,
        ])
        records.record(
            "phase", **phase, service_b_getpack=dict(b_gets), worker_b_codes=dict(b_codes),
            worker_b_tokens=b_tokens, a_codes_logged=dict(a_calls), a_not_ok_logged=[line for line in a_lines if line.get("code") != "OK"],
        )
    print_table(
        "Phases: A's requests and errors; A's calls as the service and worker logged them; what B held / was refused "
        "(service: held / refused, summed over its hold cycles, as B saw them; worker: generations run / refused and the tokens "
        "B generated, as the worker logged them, the end of the last hostile phase's included; load: the 1-minute load "
        "average over A's requests, other programs' included)",
        ["phase", "s", "load", "A reqs", "A errors", "A's calls logged", "B on the service", "B on the worker"], phase_rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("hot", "latency"), help="run one part only")
    parser.add_argument("--repeats", type=int, default=15, help="hot: interleaved repetitions")
    parser.add_argument("--tokens", type=int, default=2048, help="hot: tokens per pack")
    parser.add_argument("--requests", type=int, default=30, help="latency: A's fetches of each kind per condition")
    parser.add_argument("--answers", type=int, default=30, help="latency: A's answers per condition")
    parser.add_argument("--rounds", type=int, default=3, help="latency: quiet/hostile phase pairs, the order alternating")
    parser.add_argument("--fetch-tokens", type=int, default=512, help="latency: tokens of A's fetched pack")
    parser.add_argument("--workers", type=int, default=4, help="latency: the service's --workers (transfer slots)")
    parser.add_argument("--max-concurrent", type=int, default=4, help="latency: the worker's generation slots")
    parser.add_argument("--threads", type=int, default=1, help="latency: torch threads of the worker")
    parser.add_argument("--answer-tokens", type=int, default=8, help="latency: tokens of A's answers (greedy)")
    parser.add_argument("--answer-api", choices=("http", "grpc"), default="http", help="latency: the worker's port A asks on")
    parser.add_argument("--answer-timeout", type=float, default=300.0, help="latency: seconds before A's answer counts as an error")
    parser.add_argument("--hostile-tokens", type=int, default=64, help="latency: tokens of each of B's generations")
    parser.add_argument("--hold-seconds", type=float, default=20.0, help="latency: how long B holds its transfers before retaking them")
    parser.add_argument("--out", type=Path, help="where the records and output go (default results/bench_tenants/COMMIT.{jsonl,txt})")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the service and worker it started stop too
    commit = source_commit()
    name = commit.replace("+dirty", "-dirty")
    out = args.out or RESULTS / name
    records = JsonlRecords(out.with_suffix(".jsonl"), {"commit": commit})
    tee = Tee(sys.stdout)
    sys.stdout = tee
    try:
        print(f"Machine: {machine_description({'grpcio': grpc.__version__})}")
        print(f"Source: {source_description()}")
        print(f"Load average at the start: {os.getloadavg()[0]:.2f} (1 min): other programs share this machine")
        if args.only != "latency":
            bench_hot(args, records)
        if args.only != "hot":
            bench_latency(args, records)
        print(f"\nTotal run time: {elapsed():.0f} s")
    finally:
        sys.stdout = tee.stream
        out.with_suffix(".txt").write_text(tee.kept.getvalue())
        log(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.txt')}")


if __name__ == "__main__":
    main()
