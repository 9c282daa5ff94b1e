"""Nobody can hold the worker's HTTP port or a metrics port (issue 62): a client reading its streamed answer at a
trickle loses it at gRPC's minimum rate and frees its generation slot; floods of idle connections, from one host and
from several loopback addresses, get no more than their host's cap (the rest a 503 at once) while A is answered 200
within a second, and the metrics port of ``packstore serve`` runs no thread beyond its pool for them."""

from __future__ import annotations

import json
import logging
import selectors
import socket
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from packstore.security.shares import principal_key
from packstore.worker.http import OpenAIApp, serve_http
from tests.helpers.workers import worker_over_a_pack
from tools.lib.servers import running_server

pytestmark = [pytest.mark.stress, pytest.mark.service]
FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
TENANTS = {name: (f"secret-{name}", ["a"], "read") for name in ("alice", "bob")}
STREAM_SECONDS = 1.0  # the test's allowance for waiting on a reader (the worker's default is 60 s)
CONNECTIONS, PER_PEER = 64, 8
WAIT_SECONDS = 60.0  # how long a state is waited for before the test fails (never reached when it passes)
A_SECONDS = 1.0  # what the issue gives A's answer under a flood


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_lm):
    """A worker with tokens, 4 generation slots and a 1 s stream allowance, on an HTTP port of 64 connections, 8 a host."""
    root = tmp_path_factory.mktemp("http-connections")
    service, store = worker_over_a_pack(root, tiny_lm, FACTS, TENANTS, max_concurrent=4, stream_seconds=STREAM_SECONDS)
    http = serve_http("127.0.0.1:0", OpenAIApp(service), connections=CONNECTIONS, connections_per_peer=PER_PEER)
    for listener in http.server.servers[0].sockets:  # connections inherit it: small kernel buffers, so a slow reader shows
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # within an answer of the tiny model (~300 KB)
    yield SimpleNamespace(service=service, http=http, address=http.listening, model=tiny_lm.name)
    http.stop(1)
    store.close()


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_a_trickle_reader_of_a_streamed_answer_is_cut_at_the_minimum_rate_and_its_slot_freed(worker, caplog) -> None:
    caplog.set_level(logging.INFO, logger="packstore.worker")
    body = json.dumps({
        "model": worker.model, "messages": [{"role": "user", "content": "What is the capital?"}], "packs": ["wexley"],
        "max_tokens": 1500, "temperature": 1.0, "seed": 2, "stream": True,
    }).encode()
    host, port = worker.address.rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (a small window: the server's buffers fill sooner)
    client.settimeout(WAIT_SECONDS)
    client.connect((host, int(port)))
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nAuthorization: Bearer secret-bob\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    read, deadline = 0, time.monotonic() + WAIT_SECONDS
    while not [r for r in caplog.records if getattr(r, "fields", {}).get("code") == "CANCELLED"]:  # a trickle: 64 B per 100 ms
        assert time.monotonic() < deadline, f"a trickle reader still served after {WAIT_SECONDS:g} s ({read} bytes read)"
        read += len(client.recv(64))
        time.sleep(0.1)
    [line] = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("code") == "CANCELLED"]
    assert line["token"] == "bob" and line["slow_reader"] is True and line["method"] == "ChatCompletions" and line["peer"].startswith("ipv4:127.0.0.1:")
    [warning] = [r for r in caplog.records if r.getMessage() == "stream cancelled: its client reads too slowly"]
    assert warning.levelno == logging.WARNING and warning.fields["token"] == "bob" and "bytes_sent" in warning.fields
    wait_for(lambda: worker.service.slots.in_use == 0, "the slot freed")
    client.close()


def flood(stack: ExitStack, address: str, hosts: list[str], each: int) -> dict[str, list[socket.socket]]:
    """``each`` idle connections from each of ``hosts`` (loopback addresses) to ``address``, left open: by host."""
    host, port = address.rsplit(":", 1)
    opened: dict[str, list[socket.socket]] = {}
    for source in hosts:
        for _ in range(each):
            connection = stack.enter_context(socket.create_connection((host, int(port)), timeout=WAIT_SECONDS, source_address=(source, 0)))
            opened.setdefault(source, []).append(connection)
    return opened


def check_refusal(connection: socket.socket) -> None:
    """``connection`` (readable) got a 503 (too many connections, retry after 1 s) and was closed, or (TLS) only closed."""
    response = b""
    try:
        while chunk := connection.recv(65536):
            response += chunk
    except ConnectionResetError:
        pass
    if response:
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), response
        assert json.loads(body)["error"]["code"] == "too_many_connections"


def a_is_answered(url: str) -> None:
    """A's request (from 127.0.0.1, a host the flood does not use) gets 200 within A_SECONDS."""
    start = time.monotonic()
    with urllib.request.urlopen(url, timeout=WAIT_SECONDS) as response:
        assert response.status == 200
        response.read()
    assert time.monotonic() - start < A_SECONDS, f"A waited {time.monotonic() - start:.2f} s"


def held_by_host(opened: dict[str, list[socket.socket]]) -> dict[str, int]:
    """How many of each host's connections the server holds open: those it has not refused once none has been for 1 s."""
    answered: set[socket.socket] = set()
    with selectors.DefaultSelector() as selector:
        for connections in opened.values():
            for connection in connections:
                selector.register(connection, selectors.EVENT_READ)
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.0:
            events = selector.select(0.1)
            for key, _ in events:
                check_refusal(key.fileobj)  # type: ignore[arg-type]
                selector.unregister(key.fileobj)
                answered.add(key.fileobj)  # type: ignore[arg-type]
            if events:
                quiet_since = time.monotonic()
    return {host: sum(connection not in answered for connection in connections) for host, connections in opened.items()}


@pytest.mark.parametrize(
    "hosts, each",
    [(["127.0.0.2"], 1200), (["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"], 300), pytest.param([f"127.0.0.{n}" for n in range(2, 7)], 2000, marks=pytest.mark.long)],
    ids=["one-host", "four-hosts", "long"],
)
def test_a_flood_of_idle_connections_to_the_http_port_holds_only_its_hosts_caps_while_a_is_answered(worker, hosts, each, robustness_report) -> None:
    with ExitStack() as stack:
        opened = flood(stack, worker.address, hosts, each)
        a_is_answered(f"http://{worker.address}/health")
        held = held_by_host(opened)
        assert all(1 <= count <= PER_PEER for count in held.values()), held
        assert all(worker.http.guard.shares.held(principal_key("", False, f"ipv4:{host}:0")) <= PER_PEER for host in hosts)
        a_is_answered(f"http://{worker.address}/health")
    robustness_report.append(
        f"connection flood, worker HTTP port: {len(hosts)} hosts x {each} idle connections; held at most {max(held.values())} a host "
        f"(cap {PER_PEER}), the rest refused 503; A answered 200 within {A_SECONDS:g} s"
    )
    wait_for(lambda: worker.http.guard.shares.in_use == 0, "the flood's connections given back")


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for process {pid}")


@pytest.mark.parametrize(
    "hosts, each",
    [pytest.param(["127.0.0.2"], 1000, marks=pytest.mark.fast), (["127.0.0.2", "127.0.0.3", "127.0.0.4"], 400), pytest.param([f"127.0.0.{n}" for n in range(2, 6)], 2000, marks=pytest.mark.long)],
    ids=["one-host", "three-hosts", "long"],
)
def test_a_flood_of_idle_connections_to_the_metrics_port_of_serve_runs_no_thread_past_its_pool(tmp_path, hosts, each, robustness_report) -> None:
    with running_server(tmp_path / "data", "--metrics-connections", "16", "--metrics-connections-per-peer", "4") as server:
        url = f"http://{server.metrics}/metrics"
        a_is_answered(url)
        before = threads_of(server.process.pid)
        with ExitStack() as stack:
            opened = flood(stack, server.metrics, hosts, each)
            a_is_answered(url)
            assert threads_of(server.process.pid) <= before + 16, "a thread per connection"  # (at most the pool, started lazily or not)
            held = held_by_host(opened)
            assert all(1 <= count <= 4 for count in held.values()), held
            a_is_answered(url)
            threads = threads_of(server.process.pid) - before
    robustness_report.append(
        f"connection flood, serve's metrics port: {len(hosts)} hosts x {each} idle connections; held at most {max(held.values())} a host "
        f"(cap 4), {threads} threads more than before (pool 16); A answered 200 within {A_SECONDS:g} s"
    )
