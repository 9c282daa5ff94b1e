"""The bulk port cannot be jammed: another process keeps 200 connections open against it, TCP and local socket, idle
or sending garbage, re-opening each one the server closes, while authorised clients fetch. Every fetch succeeds with
the right bytes; a client that is its own peer still reads over the bulk port every time, and one that shares the
attacker's address at worst streams instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

ATTACKER = r"""
import json, os, random, select, socket, sys, time
port, local_name, seconds, count = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
rng = random.Random(7)
sources = ["127.0.0.1", "127.0.0.3"]  # half from the fetching client's own address
def open_one(i):
    try:
        if i % 4 < 2:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1, source_address=(sources[i % 2], 0))
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1)
            sock.connect("\0" + local_name)
        if i % 2:  # garbage: random bytes, or the magic and a made-up ticket
            sock.sendall(rng.randbytes(rng.randint(1, 64)) if rng.random() < 0.5 else b"PKB1" + rng.randbytes(32))
        return sock
    except OSError:
        return None
socks = [None] * count
opened = closed = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    for i, sock in enumerate(socks):
        if sock is None:
            socks[i] = open_one(i)
            opened += socks[i] is not None
    live = [s for s in socks if s is not None]
    readable, _, _ = select.select(live, [], [], 0.05)
    for sock in readable:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:  # the server closed it (or answered with an ERROR frame and then closed): open another
            sock.close()
            socks[socks.index(sock)] = None
            closed += 1
print(json.dumps({"opened": opened, "closed_by_server": closed}))
"""


@pytest.mark.parametrize("seconds", [8, pytest.param(120, marks=pytest.mark.long)], ids=["short", "long"])
def test_two_hundred_idle_or_garbage_connections_do_not_stop_authorised_fetches(tmp_path, robustness_report, seconds) -> None:
    pack = make_pack(layers=4, tokens=600, dim=64)
    # --workers 4: 16 bulk slots, and 2 transfer slots for this principal (this host's address), whose two clients
    # fetch one after the other
    with running_server(tmp_path / "data", "--workers", "4") as server:
        with RemoteStore(server.url) as local, RemoteStore(server.url, local_bulk=False) as tcp:
            key, _ = local.put(encode_pack(pack))
            assert torch.equal(PackReader(local).fetch(key).keys[0], pack.keys[0])
            ticket_port, name = _bulk_endpoints(server, key)
            attacker = subprocess.Popen(
                [sys.executable, "-c", ATTACKER, str(ticket_port), name, str(seconds), "200"], stdout=subprocess.PIPE, text=True
            )
            time.sleep(1)  # let it open its connections
            fetches = {"local": 1, "tcp": 0}  # (the fetch above)
            try:
                while attacker.poll() is None:
                    assert torch.equal(PackReader(local).fetch(key).values[3], pack.values[3])
                    fetches["local"] += 1
                    assert torch.equal(PackReader(tcp).fetch(key).keys[1], pack.keys[1])  # may stream: it shares an address
                    fetches["tcp"] += 1
            finally:
                if attacker.poll() is None:
                    attacker.kill()
                report = json.loads(attacker.communicate(timeout=30)[0] or "{}")
        assert server.process.poll() is None
    me = f"unix:uid={os.getuid()},pid={os.getpid()}"  # how the service names this process on its local socket
    local_bulk = [line for line in server.log_lines() if line.get("method") == "GetPack.bulk" and line.get("peer") == me]
    assert fetches["local"] >= 3 and len(local_bulk) == fetches["local"]  # its own peer: always over the bulk port
    assert {line["code"] for line in local_bulk} == {"OK"}
    robustness_report.append(
        f"bulk jam: 200 idle/garbage connections for {seconds} s ({report['opened']} opened, {report['closed_by_server']} closed by "
        f"the service); {fetches['local']} local-socket fetches all over the bulk port, {fetches['tcp']} TCP fetches from the "
        "attacker's address all correct (streamed where refused)"
    )
    assert report["opened"] >= 200 and report["closed_by_server"] >= 100  # idle ones closed about a second on


def _bulk_endpoints(server, key: str) -> tuple[int, str]:
    """The bulk port and local socket name, from a GetPack that asks for bulk."""
    with grpc.insecure_channel(server.address) as channel:
        _, ticket = list(store_pb2_grpc.PackStoreStub(channel).GetPack(store_pb2.GetPackRequest(ref=key, bulk=True)))
    return ticket.bulk.port, ticket.bulk.local_socket
