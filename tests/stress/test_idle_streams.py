"""Idle streams before authentication (issue 62): a caller with no token opens gRPC calls whose first message never
comes (reflection streams, unary calls), on the service's port and on the worker's, from another host's address. They
hold no thread, and health and reflection are capped per host: tenant A's calls are answered within a second each,
and a principal flooding cheap calls leaves A's answered too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from packstore.answering.answer import Question
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.packs.tensors import encode_pack
from packstore.rpc.channel import Connection
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from packstore.worker.client import WorkerClient
from tests.helpers.auth import tokens_file
from tests.helpers.packs import make_pack
from tests.helpers.raw_grpc import IdleStreams
from tools.lib.servers import running_server, running_worker

TENANTS = {name: (f"secret-{name}", [name], "write") for name in ("a", "b")}
ATTACKER = "127.0.0.2"  # another loopback address: to the servers, another host than A's
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
SERVICE_UNARY = ("/packstore.v1.PackStore/StatPack", "/packstore.v1.PackStore/ListPacks", "/packstore.v1.PackStore/GetPack")
WORKER_UNARY = ("/packstore.v1.Worker/Status", "/packstore.v1.Worker/Generate")
BOUND_SECONDS = 1.0  # what each of A's calls must be answered within
CALL_SECONDS = 10.0  # every call's own deadline: a hang fails the test instead of stalling it

pytestmark = [pytest.mark.stress, pytest.mark.service]


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TENANTS[name][0]}")]


@contextmanager
def idle(address: str, unary: tuple[str, ...], count: int) -> Iterator[None]:
    """``count`` idle anonymous streams from ATTACKER: half reflection streams, half the ``unary`` calls in turn."""
    with IdleStreams(address, REFLECTION, count // 2, source=ATTACKER) as reflection:
        streams = [IdleStreams(address, path, count // 2 // len(unary) + 1, source=ATTACKER) for path in unary]
        try:
            assert reflection.sockets and all(s.sockets for s in streams)
            yield
        finally:
            for held in streams:
                held.close()


SLOWEST: dict[str, float] = {}  # the longest any of A's calls took, by test, for the robustness report


def answered_in_time(what: str, call: Callable[[], object]) -> None:
    start = time.monotonic()
    call()
    seconds = time.monotonic() - start
    assert seconds < BOUND_SECONDS, f"{what} took {seconds:.2f} s beside the idle streams"
    SLOWEST["now"] = max(SLOWEST.get("now", 0.0), seconds)


def report(robustness_report: list[str], where: str, count: int, rounds: int) -> None:
    robustness_report.append(
        f"idle streams: {count} anonymous streams whose first message never comes on the {where}: {rounds} rounds of A's calls, "
        f"the slowest answered in {SLOWEST.pop('now', 0.0) * 1000:.0f} ms (bound {BOUND_SECONDS * 1000:.0f})"
    )


def healthy(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_SECONDS)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def a_store_calls(address: str, key: str) -> dict[str, Callable[[], object]]:
    """Tenant A's calls on a fresh channel each: health, StatPack, ListPacks, and an export (a streamed GetPack)."""

    def on_channel(call: Callable[[store_pb2_grpc.PackStoreStub], object]) -> Callable[[], object]:
        def run() -> object:
            with grpc.insecure_channel(address) as channel:
                return call(store_pb2_grpc.PackStoreStub(channel))

        return run

    def export(stub: store_pb2_grpc.PackStoreStub) -> int:
        responses = stub.GetPack(store_pb2.GetPackRequest(ref=key), metadata=bearer("a"), timeout=CALL_SECONDS)
        return sum(len(r.chunk.data) for r in responses)

    return {
        "health": lambda: healthy(address),
        "StatPack": on_channel(lambda stub: stub.StatPack(store_pb2.StatPackRequest(ref=key), metadata=bearer("a"), timeout=CALL_SECONDS)),
        "ListPacks": on_channel(lambda stub: stub.ListPacks(store_pb2.ListPacksRequest(), metadata=bearer("a"), timeout=CALL_SECONDS)),
        "export": on_channel(export),
    }


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """``packstore serve --auth`` (default --workers 16) holding one small pack of A's: its address and the key."""
    root = tmp_path_factory.mktemp("idle")
    auth = tokens_file(root / "tokens.toml", TENANTS)
    with running_server(root / "data", "--auth", str(auth)) as server:
        with RemoteStore(server.url, connection=Connection(token=TENANTS["a"][0]), timeout=CALL_SECONDS) as remote:
            key, _ = remote.put(encode_pack(make_pack()))
        yield server.address, key


IDLE_LONG = pytest.param(2000, 60, marks=pytest.mark.long, id="2000-long")  # (count, seconds held)


def repeated(seconds: float) -> Iterator[None]:
    """Rounds of A's calls: one, then more, a second apart, until ``seconds`` have passed (the long runs hold the
    streams that long)."""
    end, first = time.monotonic() + seconds, True
    while first or time.monotonic() < end:
        yield
        first = False
        time.sleep(min(1.0, seconds))


@pytest.mark.parametrize(("count", "seconds"), [pytest.param(24, 0, marks=pytest.mark.fast, id="24"), pytest.param(200, 0, id="200"), IDLE_LONG])
def test_idle_anonymous_streams_do_not_stop_a_tenants_calls_on_the_service(service, count: int, seconds: float, robustness_report) -> None:
    """24, then 200 (long: 2,000 for a minute), streams without a token whose first message never comes: A's health
    check, StatPack, ListPacks and export are each answered within a second, every round."""
    address, key = service
    with idle(address, SERVICE_UNARY, count):
        rounds = 0
        for _ in repeated(seconds):
            for what, call in a_store_calls(address, key).items():
                answered_in_time(what, call)
            rounds += 1
    report(robustness_report, "service (health, StatPack, ListPacks, export)", count, rounds)


def test_a_principal_flooding_cheap_calls_and_calls_in_flight_leaves_anothers_answered(service) -> None:
    """B, with its token, holds 64 StatPack calls whose message never comes (as many calls as the service had in
    flight at once, 4 x --workers) and keeps 32 threads calling StatPack without pause: more cheap calls than there
    are cheap-call threads. Some of B's are refused RESOURCE_EXHAUSTED naming B's own share; A's calls are each
    answered within a second."""
    address, key = service
    token = (b"authorization", f"Bearer {TENANTS['b'][0]}".encode())
    held = IdleStreams(address, SERVICE_UNARY[0], 64, headers=(token,))
    stop, refusals, errors = threading.Event(), [], []

    def flood() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = store_pb2_grpc.PackStoreStub(channel)
            while not stop.is_set():
                try:
                    stub.StatPack(store_pb2.StatPackRequest(ref="absent"), metadata=bearer("b"), timeout=CALL_SECONDS)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        refusals.append(exc.details())
                    elif exc.code() != grpc.StatusCode.NOT_FOUND:
                        errors.append(exc.code())

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(32)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(5):
            for what, call in a_store_calls(address, key).items():
                answered_in_time(what, call)
    finally:
        stop.set()
        for thread in threads:
            thread.join(CALL_SECONDS)
        held.close()
    assert not errors, errors
    for message in refusals:
        assert "token:b" in message and "retry" in message and "token:a" not in message, message


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_model_dir, tiny_lm) -> Iterator[str]:
    """``packstore worker --auth`` on the tiny model (default --max-concurrent) over a store holding a pack named
    ``wexley``, warmed by one answer of A's."""
    root = tmp_path_factory.mktemp("idle-worker")
    auth = tokens_file(root / "tokens.toml", TENANTS)
    with running_server(root / "data") as server, running_worker(server.url, str(tiny_model_dir), root, "--threads", "1", "--auth", str(auth)) as running:
        with RemoteStore(server.url, timeout=CALL_SECONDS) as remote:
            remote.put(encode_pack(build_pack(tiny_lm, ["The river Tamsin flows through the town of Wexley."])), name="wexley")
        ask(running.address)
        yield running.address


def ask(address: str) -> object:
    with WorkerClient(address, connection=Connection(token=TENANTS["a"][0]), timeout=CALL_SECONDS) as client:
        return client.ask(Question("Where is Wexley?", refs=("wexley",), sampling=Sampling(max_new_tokens=4)))


def status(address: str) -> dict:
    with WorkerClient(address, connection=Connection(token=TENANTS["a"][0]), timeout=CALL_SECONDS) as client:
        return client.status()


@pytest.mark.parametrize(("count", "seconds"), [pytest.param(24, 0, id="24"), pytest.param(200, 0, id="200"), IDLE_LONG])
def test_idle_anonymous_streams_do_not_stop_a_tenants_calls_on_the_worker(worker, count: int, seconds: float, robustness_report) -> None:
    """The same on the worker's gRPC port: A's health check, Status and a short whole answer (Generate) are each
    answered within a second, every round."""
    with idle(worker, WORKER_UNARY, count):
        rounds = 0
        for _ in repeated(seconds):
            answered_in_time("health", lambda: healthy(worker))
            answered_in_time("Status", lambda: status(worker))
            answered_in_time("Generate", lambda: ask(worker))
            rounds += 1
    report(robustness_report, "worker (health, Status, Generate)", count, rounds)


def test_a_hosts_reflection_streams_are_capped_at_its_share(service) -> None:
    """Reflection stays open without a token, but a host holds at most its share of the anonymous calls (half of
    them): with 32 of its reflection streams idle, its next is refused at once (RESOURCE_EXHAUSTED, saying so);
    once they close, it reflects again."""
    address, _ = service
    with IdleStreams(address, REFLECTION, 32):
        with pytest.raises(grpc.RpcError) as refused:
            reflect(address)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "health and reflection calls" in refused.value.details() and "retry" in refused.value.details()
    deadline = time.monotonic() + CALL_SECONDS
    while True:  # the server sees the connections close a moment later
        try:
            assert "packstore.v1.PackStore" in reflect(address)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "reflection never answered again"
            time.sleep(0.05)


def reflect(address: str) -> list[str]:
    """The services reflection lists at ``address``."""
    with grpc.insecure_channel(address) as channel:
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=CALL_SECONDS)
        return [service.name for reply in replies for service in reply.list_services_response.service]
