"""Fair shares under a hostile tenant, on the worker (issue 53): one set of generation slots for gRPC ``Generate`` and
the HTTP completions, per principal, that no two tenants can take from a third; cheap calls that never wait behind
generations; and the HTTP port's deadlines, each met by the attack it stops: headers sent a byte at a time, bodies
half sent, clients gone midway or no longer reading, callers without a token while every slot is busy.

Every generation here is held at the device (the test holds ``WorkerService._device_lock``, which a generation takes
for its prefill and then for each token's step, in turn with the others running) or cut short by its client, so the
tests wait on states, not on times; only the deadlines themselves (1-2 s here) are times."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import Request

from packstore.answering.answer import Answerer, Question
from packstore.errors import LimitExceeded, Unauthenticated
from packstore.kv.inject import Sampling
from packstore.rpc.channel import Connection
from packstore.security.auth import Principal
from packstore.security.shares import principal_key
from packstore.serving.pacing import StreamWatch
from packstore.store import LmdbStore
from packstore.v1 import worker_pb2_grpc
from packstore.worker.client import WorkerClient
from packstore.worker.http import OpenAIApp, serve_http
from packstore.worker.http_connections import MAX_HEADER_BYTES
from packstore.worker.messages import generate_request
from packstore.worker.server import WorkerService, worker_server
from tests.helpers.device import StepCounter
from tests.helpers.workers import worker_over_a_pack
from tools.lib.servers import free_port

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
QUESTION = "What is Wexley famous for?"
GREEDY = Sampling(max_new_tokens=12)
# on the tiny model, this prompt sampled so runs to its 1500 tokens without a stop token: a generation long enough that
# a cut-short one shows it
LONG_PROMPT, LONG = "What is the capital?", Sampling(max_new_tokens=1500, temperature=1.0, seed=2)
LONG_FIELDS = {"max_tokens": LONG.max_new_tokens, "temperature": LONG.temperature, "seed": LONG.seed}
TENANTS = {name: (f"secret-{name}", ["a"], "read") for name in ("alice", "bob", "carol")}
BODY_SECONDS = HEADER_SECONDS = 2.0
WAIT_SECONDS = 120.0  # how long a state is waited for before the test fails (never reached when it passes)
STEP_SECONDS = 0.02  # what counted_steps adds to each step


@pytest.fixture(scope="module")
def fair(tmp_path_factory, tiny_lm):
    """A worker service with tokens and 4 generation slots (a reserve of 2 for principals holding none) on a gRPC and an HTTP port."""
    service, store = worker_over_a_pack(tmp_path_factory.mktemp("fair"), tiny_lm, FACTS, TENANTS, max_concurrent=4)
    address = f"127.0.0.1:{free_port()}"
    server = worker_server(service, address)
    server.start()
    http = serve_http("127.0.0.1:0", OpenAIApp(service, body_seconds=BODY_SECONDS), header_seconds=HEADER_SECONDS)
    expected = Answerer(tiny_lm, store).ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY)).answer
    yield SimpleNamespace(service=service, grpc=address, http=http.listening, expected=expected, model=tiny_lm.name)
    http.stop(1)
    server.stop(0)
    store.close()


@contextmanager
def counted_steps(fair) -> Iterator[StepCounter]:
    """The model's steps counted while the context runs, each made STEP_SECONDS longer, so that "stopped within a step"
    is checked in steps, not raced against a fast model."""
    slowing = fair.service.lm.model.register_forward_pre_hook(lambda module, args: time.sleep(STEP_SECONDS))
    steps = StepCounter(fair.service.lm.model)
    try:
        yield steps
    finally:
        slowing.remove()
        steps.remove()


def share(name: str) -> str:
    return principal_key(name, True, "")


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def chat_body(fair, prompt: str = QUESTION, **fields) -> dict:
    return {"model": fair.model, "messages": [{"role": "user", "content": prompt}], "packs": ["wexley"], "max_tokens": 12} | fields


def completion_body(fair, prompt: str = QUESTION, **fields) -> dict:
    return {"model": fair.model, "prompt": prompt, "packs": ["wexley"], "max_tokens": 12} | fields


def post(fair, tenant: str | None, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    """POST ``body`` as ``tenant`` (None: no token): the status and JSON of the response."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {TENANTS[tenant][0]}"} if tenant else {})
    request = urllib.request.Request(f"http://{fair.http}{path}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=WAIT_SECONDS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
        if exc.code == 429:  # a share refused says when to ask again
            assert exc.headers["Retry-After"] == "1", exc.headers
        return exc.code, body


def grpc_ask(fair, tenant: str, question: Question | None = None) -> str:
    with WorkerClient(fair.grpc, connection=Connection(token=TENANTS[tenant][0]), timeout=WAIT_SECONDS) as client:
        return client.ask(question or Question(QUESTION, refs=("wexley",), sampling=GREEDY)).answer


def logged(caplog, method: str, code: str) -> list[dict]:
    return [record.fields for record in caplog.records if getattr(record, "fields", {}).get("method") == method and record.fields.get("code") == code]


class Asking:
    """Calls run on threads, their results (or errors) kept by name."""

    def __init__(self) -> None:
        self.results: dict[str, object] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, call: Callable[[], object]) -> None:
        def run() -> None:
            try:
                self.results[name] = call()
            except Exception as exc:  # (kept, to fail the test on the main thread)
                self.results[name] = exc

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> dict[str, object]:
        for thread in self.threads:
            thread.join(WAIT_SECONDS)
        return self.results


def test_two_tenants_holding_all_they_can_leave_a_third_a_slot_over_grpc_and_http_together(fair) -> None:
    slots = fair.service.slots
    assert (slots.rule.capacity, slots.rule.reserve) == (4, 2)
    asking = Asking()
    with fair.service._device_lock:  # every generation started now holds its slot, waiting for the device
        asking.start("alice over gRPC", lambda: grpc_ask(fair, "alice"))
        asking.start("alice over HTTP", lambda: post(fair, "alice", chat_body(fair)))
        wait_for(lambda: slots.held(share("alice")) == 2, "alice holds 2 slots, one per port")
        asking.start("bob over gRPC", lambda: grpc_ask(fair, "bob"))
        wait_for(lambda: slots.held(share("bob")) == 1, "bob holds a slot")
        # alice holds all a lone principal may on the two ports together, bob all the rule leaves him: the last free slot is the
        # reserve's, for a principal holding none
        with pytest.raises(LimitExceeded, match="token:alice'? holds 2 of the generation slots, and the last 2 are kept"):
            grpc_ask(fair, "alice")
        status, refused = post(fair, "alice", chat_body(fair))
        assert status == 429 and refused["error"]["type"] == "rate_limit_error" and "kept for callers holding none" in refused["error"]["message"]
        with pytest.raises(LimitExceeded, match="generation slots"):
            grpc_ask(fair, "bob")
        assert post(fair, "bob", completion_body(fair), "/v1/completions")[0] == 429
        asking.start("carol over HTTP", lambda: post(fair, "carol", completion_body(fair), "/v1/completions"))
        wait_for(lambda: slots.held(share("carol")) == 1, "carol, holding none, gets the reserve's slot")
        assert slots.in_use == 4
        # every slot taken and every generation waiting: the cheap calls of both ports are answered at once
        with WorkerClient(fair.grpc, connection=Connection(token=TENANTS["carol"][0]), timeout=30) as client:
            assert client.status()["model"] == fair.model
        with grpc.insecure_channel(fair.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = urllib.request.Request(f"http://{fair.http}/v1/models", headers={"Authorization": f"Bearer {TENANTS['bob'][0]}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["data"][0]["id"] == fair.model
        with urllib.request.urlopen(f"http://{fair.http}/health", timeout=30) as response:
            assert response.status == 200
    results: dict = asking.join()
    assert results["alice over gRPC"] == results["bob over gRPC"] == fair.expected, results
    status, chat = results["alice over HTTP"]
    assert status == 200 and chat["choices"][0]["message"]["content"] == fair.expected
    status, completion = results["carol over HTTP"]
    assert status == 200 and completion["choices"][0]["text"] == fair.expected
    assert slots.in_use == 0


def test_a_short_answer_takes_its_steps_between_a_hostile_tenants_long_generations(fair, caplog) -> None:
    """B holds its share of the slots with long generations; A's short answer takes the device a step at a time in
    turn with them, so it is whole while each of B's has produced a few of its tokens, not after B's end."""
    caplog.set_level(logging.INFO, logger="packstore.worker")
    device, slots = fair.service._device_lock, fair.service.slots
    wait_for(lambda: slots.asking == 0, "the refusals of earlier tests have lapsed (a refused principal keeps its turn a while)")
    steps: list[str] = []  # the model's forward passes in the order they ran, by thread (each holding the device)
    hook = fair.service.lm.model.register_forward_pre_hook(lambda module, args: steps.append(threading.current_thread().name))
    asking = Asking()
    with grpc.insecure_channel(fair.grpc) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            with device:  # B's generations and A's answer wait for the device, then share it from the same start
                calls = [
                    stub.Generate(generate_request(Question(LONG_PROMPT, refs=("wexley",), sampling=LONG)), metadata=[("authorization", "Bearer secret-bob")])
                    for _ in range(2)
                ]
                wait_for(lambda: slots.held(share("bob")) == 2 and device.waiting == 2, "bob's two generations wait for the device")
                asking.start("alice", lambda: post(fair, "alice", chat_body(fair)))
                wait_for(lambda: device.waiting == 3, "alice's answer waits behind them")
            status, chat = asking.join()["alice"]  # type: ignore[misc]
            assert status == 200 and chat["choices"][0]["message"]["content"] == fair.expected
            for call in calls:  # (bob's generations may still be running: each would run to its 1500 tokens)
                call.cancel()
            wait_for(lambda: slots.in_use == 0, "bob's slots freed")
        finally:
            hook.remove()
    bob_first, bob_second, alice = list(dict.fromkeys(steps))[:3]  # first steps in the order they asked: B, B, then A
    alice_steps = steps.count(alice)
    assert alice_steps == chat["usage"]["completion_tokens"] + (chat["choices"][0]["finish_reason"] == "stop")  # a step a token
    whole = max(index for index, name in enumerate(steps) if name == alice)  # A's last step: its answer is whole
    before = steps[: whole + 1]
    # while A's answer was generated, each of B's took one step per step of A's (a round each), far short of its length
    assert before.count(bob_first) == before.count(bob_second) == alice_steps < LONG.max_new_tokens
    assert before == [bob_first, bob_second, alice] * alice_steps
    assert not logged(caplog, "Generate", "INTERNAL")


def test_a_caller_without_a_token_gets_401_while_every_slot_is_busy_and_never_holds_one(fair) -> None:
    slots = fair.service.slots
    others = [share(name) for name in ("alice", "alice", "bob", "carol")]
    assert all(slots.try_take(other) for other in others)  # (as if these were generating)
    try:
        for path, body in (("/v1/chat/completions", chat_body(fair)), ("/v1/completions", completion_body(fair))):
            status, body = post(fair, None, body, path)
            assert status == 401 and body["error"]["type"] == "authentication_error", body
        headers = {"Content-Type": "application/json", "Authorization": "Bearer not-a-token"}
        request = urllib.request.Request(f"http://{fair.http}/v1/chat/completions", data=json.dumps(chat_body(fair)).encode(), headers=headers)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 401 and info.value.headers["WWW-Authenticate"].startswith("Bearer")
        with WorkerClient(fair.grpc, connection=Connection(token="not-a-token"), timeout=30) as client, pytest.raises(Unauthenticated):
            client.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY))
        assert post(fair, "carol", chat_body(fair))[0] == 429  # (a known caller finds them busy)
        assert slots.in_use == 4
    finally:
        for other in others:
            slots.give_back(other)
    assert post(fair, "carol", chat_body(fair))[1]["choices"][0]["message"]["content"] == fair.expected


@pytest.mark.parametrize("rounds", [1, pytest.param(20, marks=pytest.mark.long)], ids=["short", "long"])
def test_slow_headers_and_half_sent_bodies_hold_no_slot_and_stop_no_one_else(fair, rounds: int) -> None:
    for _ in range(rounds):
        _slow_headers_and_half_sent_bodies(fair)


def _slow_headers_and_half_sent_bodies(fair) -> None:
    """One round of the attack: every kind of late or oversized request at once, while others are answered."""
    host, port = fair.http.rsplit(":", 1)
    body = json.dumps(chat_body(fair)).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nAuthorization: Bearer secret-alice\r\n"
    slow_head = socket.create_connection((host, int(port)))
    slow_head.sendall(head)  # and never the blank line that ends the headers
    silent = socket.create_connection((host, int(port)))  # a connection that sends nothing at all
    half_sent = [socket.create_connection((host, int(port))) for _ in range(fair.service.slots.rule.capacity + 1)]
    for connection in half_sent:  # more bodies than slots, all alice's: each read, never whole
        connection.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    flood = socket.create_connection((host, int(port)))
    try:
        flood.sendall(head + b"X-Junk: " + b"j" * (MAX_HEADER_BYTES + 1024))  # headers past the bound
    except OSError:  # (the server may close it before it is all sent)
        pass
    # meanwhile alice herself, over both ports, and bob are answered: what waits for headers or a body holds no slot
    assert post(fair, "alice", chat_body(fair))[1]["choices"][0]["message"]["content"] == fair.expected
    assert grpc_ask(fair, "alice") == grpc_ask(fair, "bob") == fair.expected
    assert fair.service.slots.in_use == 0
    waiting = [slow_head, silent, *half_sent]
    assert not select.select(waiting, [], [], 0)[0], "answered before their deadlines"  # (they were waiting all along)
    for connection in (slow_head, silent, flood):  # closed by the server, without a response
        connection.settimeout(WAIT_SECONDS)
        try:
            assert connection.recv(1024) == b""
        except ConnectionResetError:
            pass
    for connection in half_sent:  # 408, OpenAI's error object, and the connection closed
        connection.settimeout(WAIT_SECONDS)
        response = b""
        while chunk := connection.recv(65536):
            response += chunk
        status_line, _, rest = response.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), response
        headers, _, payload = rest.partition(b"\r\n\r\n")
        assert b"connection: close" in headers.lower()
        error = json.loads(payload)["error"]
        assert error == {"message": f"the request body did not arrive within {BODY_SECONDS:g} s", "type": "invalid_request_error", "param": "body", "code": "request_timeout"}
    for connection in [*waiting, flood]:
        connection.close()
    assert fair.service.slots.in_use == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_whole_answer_whose_client_has_gone_stops_within_a_step_and_is_logged_cancelled(fair, caplog, path) -> None:
    caplog.set_level(logging.INFO, logger="packstore.worker")
    method = {"/v1/chat/completions": "ChatCompletions", "/v1/completions": "Completions"}[path]
    body = (chat_body if path == "/v1/chat/completions" else completion_body)(fair, LONG_PROMPT, **LONG_FIELDS)
    payload = json.dumps(body).encode()
    host, port = fair.http.rsplit(":", 1)
    client = socket.create_connection((host, int(port)))
    client.sendall(
        f"POST {path} HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nAuthorization: Bearer secret-bob\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    with counted_steps(fair) as steps:
        wait_for(lambda: fair.service.slots.held(share("bob")) == 1 and steps.count > 0, "bob's answer is being generated")
        client.close()  # not streamed: the client has nothing to read until the answer is whole, and leaves
        at_close = steps.count
        wait_for(lambda: logged(caplog, method, "CANCELLED"), f"{method} logged CANCELLED")
    assert steps.count - at_close <= 3, (at_close, steps.count)  # the step running, and at most two more
    [line] = logged(caplog, method, "CANCELLED")
    assert line["token"] == "bob" and line["tokens"] <= at_close + 3, line
    assert not logged(caplog, method, "OK") and not logged(caplog, method, "INTERNAL")
    wait_for(lambda: fair.service.slots.in_use == 0, "the slot freed")
    assert post(fair, "bob", chat_body(fair))[0] == 200  # and the device is free for the next


def test_a_cancelled_generate_stops_and_frees_its_slot_and_is_logged_with_its_tokens(fair, caplog) -> None:
    caplog.set_level(logging.INFO, logger="packstore.worker")
    with grpc.insecure_channel(fair.grpc) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate(
            generate_request(Question(LONG_PROMPT, refs=("wexley",), sampling=LONG)), metadata=[("authorization", "Bearer secret-carol")]
        )
        with counted_steps(fair) as steps:
            for _ in range(3):
                next(call)
            call.cancel()
            at_cancel = steps.count
            wait_for(lambda: logged(caplog, "Generate", "CANCELLED"), "Generate logged CANCELLED")
    assert steps.count - at_cancel <= 3, (at_cancel, steps.count)  # the step running, and at most two more
    [line] = logged(caplog, "Generate", "CANCELLED")
    assert line["token"] == "carol" and 3 <= line["tokens"] <= at_cancel + 3, line
    wait_for(lambda: fair.service.slots.in_use == 0, "the slot freed")


def test_a_generate_whose_client_stops_taking_its_tokens_is_cancelled_and_frees_the_device(fair, caplog, monkeypatch) -> None:
    """A suspended Generate holds its slot, but not the device once its token queue is full (issue 62); a client that
    takes no more tokens (its window full: gRPC waits to send) is cancelled by the watch, as a store stream is, and
    logged so."""
    caplog.set_level(logging.INFO, logger="packstore.worker")
    monkeypatch.setattr(fair.service, "watch", StreamWatch(logging.getLogger("packstore.worker"), seconds=0.3))

    class Context:  # what Generate reads of a gRPC call's context
        cancelled = threading.Event()
        callbacks: list[Callable[[], None]] = []

        def invocation_metadata(self) -> list[tuple[str, str]]:
            return [("authorization", f"Bearer {TENANTS['alice'][0]}")]

        def peer(self) -> str:
            return "ipv4:127.0.0.1:5000"

        def add_callback(self, callback: Callable[[], None]) -> bool:
            self.callbacks.append(callback)
            return True

        def cancel(self) -> None:  # (gRPC runs the call's callbacks once it ends)
            self.cancelled.set()
            for callback in self.callbacks:
                callback()

    context = Context()
    stream = fair.service.Generate(generate_request(Question(LONG_PROMPT, refs=("wexley",), sampling=LONG)), context)
    next(stream), next(stream)  # two tokens taken, then none: gRPC waits to send the next
    assert context.cancelled.wait(WAIT_SECONDS)
    assert fair.service.slots.held(share("alice")) == 1
    stream.close()  # (what gRPC does with a cancelled stream's generator)
    [line] = logged(caplog, "Generate", "CANCELLED")
    assert line["slow_reader"] is True and line["token"] == "alice" and line["tokens"] == 2, line
    assert fair.service.slots.in_use == 0 and not fair.service._device_lock.locked()


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_slot_freed(fair, caplog, monkeypatch) -> None:
    """A client that stops reading (its connection full: every send waits) loses its stream once past the watch's
    ``stream_seconds``, not when it likes; the call is logged CANCELLED (a slow reader) and its slot is free."""
    caplog.set_level(logging.INFO, logger="packstore.worker")
    monkeypatch.setattr(fair.service, "watch", StreamWatch(logging.getLogger("packstore.worker"), seconds=0.5))
    app = OpenAIApp(fair.service)
    body = json.dumps(chat_body(fair, LONG_PROMPT, stream=True, **LONG_FIELDS)).encode()
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer secret-carol")]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers, "client": ("127.0.0.1", 5555), "query_string": b""}
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent and not getattr(receive, "done", False):
            receive.done = True  # type: ignore[attr-defined]
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # (the client is still there)
        return {}

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) > 4:  # the response began; then the client's connection is full
            await anyio.sleep_forever()

    anyio.run(app.app, scope, receive, send)
    assert sent[0]["status"] == 200
    [line] = logged(caplog, "ChatCompletions", "CANCELLED")
    assert line["token"] == "carol" and line["slow_reader"] is True and 1 <= line["tokens"] < LONG.max_new_tokens
    assert fair.service.slots.in_use == 0 and not fair.service._device_lock.locked()


def test_without_tokens_a_host_is_one_principal_on_both_ports(tiny_lm, tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        service = WorkerService(tiny_lm, lambda namespace: store, cache_bytes=1 << 20)
    app = OpenAIApp(service)
    anonymous = Principal("anonymous", "admin", "default")
    assert app._share(Request({"type": "http", "client": ("127.0.0.1", 5000)}), anonymous) == service.share(anonymous, "ipv4:127.0.0.1:6000")
    assert app._share(Request({"type": "http", "client": ("::1", 5000)}), anonymous) == service.share(anonymous, "ipv6:%5B::1%5D:6000")
    assert app._share(Request({"type": "http", "client": ("127.0.0.1", 5000)}), anonymous) != service.share(anonymous, "ipv4:10.0.0.1:6000")
