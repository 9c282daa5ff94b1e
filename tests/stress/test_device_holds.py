"""The worker's device held for no one's I/O and no absent client (issue 62), over gRPC and HTTP: a Generate whose pack
hangs in a stalled store leaves the device to the others (whose answers come whole meanwhile) and fails UNAVAILABLE
naming the pack once ``fetch_seconds`` pass; an answer with ``compare_rag`` whose client leaves during the comparisons
stops within a step and frees its slot and the device.

The tests wait on states (steps run, slots held, the device held), bounded by WAIT_SECONDS so that a hang fails; only
``fetch_seconds`` itself (1 s here) is a time."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import pytest

from packstore.answering.answer import Answerer, Question
from packstore.errors import Unavailable
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.packs.tensors import encode_pack
from packstore.rpc.channel import Connection
from packstore.store import LmdbStore
from packstore.v1 import worker_pb2_grpc
from packstore.worker.client import WorkerClient
from packstore.worker.http import OpenAIApp, serve_http
from packstore.worker.messages import generate_request
from packstore.worker.server import WorkerService, worker_server
from tests.helpers.device import StalledStore, StepCounter
from tests.unit.test_device_io import FACTS, LONG_PROMPT
from tools.lib.servers import free_port

pytestmark = pytest.mark.service
WAIT_SECONDS = 120.0  # how long a state is waited for before the test fails (never reached when it passes)
FETCH_SECONDS = 1.0
# sampled so, the answer and each comparison run to their 200 tokens: the comparisons take the steps after the 200th
COMPARED = Sampling(max_new_tokens=200, temperature=1.0, seed=2)
LEAVE_AT = 230  # the step the client leaves at: in the first comparison's decoding
STEP_SECONDS = 0.02  # each step made this much longer, so that a step more or less is not a race with the client


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_lm):
    """A worker service without tokens over a store whose pack "b" stalls until released, on a gRPC and an HTTP port."""
    root = tmp_path_factory.mktemp("holds")
    store = LmdbStore(root / "store")
    for name, facts in FACTS.items():
        store.put(encode_pack(build_pack(tiny_lm, facts)), name=name)
    stalled = StalledStore(store, {store.resolve("b")})
    service = WorkerService(tiny_lm, lambda namespace: stalled, cache_bytes=1 << 30, max_concurrent=4, fetch_seconds=FETCH_SECONDS)
    address = f"127.0.0.1:{free_port()}"
    server = worker_server(service, address)
    server.start()
    http = serve_http("127.0.0.1:0", OpenAIApp(service))
    yield SimpleNamespace(service=service, grpc=address, http=http.listening, store=store, stalled=stalled, model=tiny_lm.name)
    stalled.flowing.set()
    http.stop(1)
    server.stop(0)
    store.close()


def logged(caplog, method: str, code: str) -> list[dict]:
    return [record.fields for record in caplog.records if getattr(record, "fields", {}).get("method") == method and record.fields.get("code") == code]


def ask(worker, question: Question):
    with WorkerClient(worker.grpc, connection=Connection(), timeout=WAIT_SECONDS) as client:
        return client.ask(question)


@pytest.mark.stress
def test_a_generate_waiting_on_a_stalled_store_leaves_the_device_to_others_and_fails_unavailable(worker, tiny_lm, caplog, robustness_report) -> None:
    caplog.set_level(logging.INFO, logger="packstore.worker")
    a = Question("Where does the river Tamsin flow?", refs=("a",), sampling=Sampling(max_new_tokens=40))
    expected = Answerer(tiny_lm, worker.store).ask(a).answer
    ask(worker, a)  # A's pack ready on the worker: A needs nothing from the store
    steps = StepCounter(tiny_lm.model)
    failure: list[Unavailable] = []
    b = threading.Thread(target=lambda: failure.append(pytest.raises(Unavailable, ask, worker, Question(LONG_PROMPT, refs=("b",))).value))
    try:
        b.start()
        # B takes the device, starts its prefill and reaches the first layer, which does not come: it waits without it
        wait_for(lambda: steps.count == 1 and not worker.service._device_lock.locked(), "B waits for the store off the device")
        started = time.monotonic()
        assert ask(worker, a).answer == expected  # A's answer, whole, while B's pack hangs
        answered = time.monotonic() - started
        assert answered < FETCH_SECONDS or b.is_alive()  # (within B's wait, not after it failed)
        b.join(WAIT_SECONDS)
    finally:
        steps.remove()
    [error] = failure
    key = worker.store.resolve("b")
    assert str(error) == f"pack {key}: layer 0 did not arrive from the store within {FETCH_SECONDS:g} s"
    assert logged(caplog, "Generate", "UNAVAILABLE")
    wait_for(lambda: worker.service.slots.in_use == 0, "the slots freed")
    assert not worker.service._device_lock.locked()
    robustness_report.append(
        f"device: B's pack stalled in its store: A's 40-token answer whole in {answered * 1000:.0f} ms meanwhile; "
        f"B failed UNAVAILABLE after --fetch-seconds {FETCH_SECONDS:g}, device and slots freed"
    )


def _leave_grpc(worker, tiny_lm, leave: threading.Event) -> None:
    with grpc.insecure_channel(worker.grpc) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate(generate_request(Question(LONG_PROMPT, refs=("a",), compare_rag=True, sampling=COMPARED)))
        assert leave.wait(WAIT_SECONDS)
        call.cancel()


def _leave_http(streamed: bool) -> Callable[..., None]:
    def leave_http(worker, tiny_lm, leave: threading.Event) -> None:
        body = {"model": worker.model, "messages": [{"role": "user", "content": LONG_PROMPT}], "packs": ["a"], "compare_rag": True}
        body |= {"max_tokens": COMPARED.max_new_tokens, "temperature": COMPARED.temperature, "seed": COMPARED.seed, "stream": streamed}
        payload = json.dumps(body).encode()
        host, port = worker.http.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            assert leave.wait(WAIT_SECONDS)
        # (closed: the client has gone)

    return leave_http


@pytest.mark.stress
@pytest.mark.parametrize(
    "leave, method", [(_leave_grpc, "Generate"), (_leave_http(False), "ChatCompletions"), (_leave_http(True), "ChatCompletions")],
    ids=["grpc", "http whole", "http streamed"],
)
def test_a_compare_rag_whose_client_leaves_stops_within_a_step_and_frees_slot_and_device(
    worker, tiny_lm, caplog, leave, method, robustness_report
) -> None:
    caplog.set_level(logging.INFO, logger="packstore.worker")
    worker.service.answerer("default").pack("a")
    gone = threading.Event()
    at_leave: list[int] = []

    def slow_step(module, args) -> None:
        time.sleep(STEP_SECONDS)

    def leaving() -> None:
        at_leave.append(steps.count)
        gone.set()

    slowing = tiny_lm.model.register_forward_pre_hook(slow_step)
    steps = StepCounter(tiny_lm.model, LEAVE_AT, leaving)
    client = threading.Thread(target=leave, args=(worker, tiny_lm, gone))
    try:
        client.start()
        client.join(WAIT_SECONDS)
        wait_for(lambda: logged(caplog, method, "CANCELLED"), f"{method} logged CANCELLED")
        wait_for(lambda: worker.service.slots.in_use == 0, "the slot freed")
    finally:
        slowing.remove()
        steps.remove()
    assert steps.count - at_leave[0] <= 3, steps.count  # the comparison's step in progress, and at most two more
    robustness_report.append(f"device: a compare_rag answer left at step {LEAVE_AT} ({method}): {steps.count - at_leave[0]} steps ran after (bound 3)")
    assert not worker.service._device_lock.locked() and not logged(caplog, method, "OK")
