"""Fair shares under hostile tenants, each test an attack an ordinary client can make with a token of its own:
tenants B and C hold every stream or bulk slot they can and never read, while tenant A's cheap calls, streamed and
bulk fetches are still answered; the streams B left unread are cancelled by the minimum read rate, with a log line
naming B. Without tokens the principal is an address (test_bulk.py). Long variants hold on for longer, with more
streams."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from packstore.errors import InvalidInput
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, encode_pack
from packstore.rpc.channel import Connection
from packstore.rpc.frames import FRAME, MAGIC, recv_exact
from packstore.service.config import load_config
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.auth import tokens_file
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

TENANTS = {name: (f"secret-{name}", [name], "write") for name in ("a", "b", "c")}  # a token per tenant, its own namespace
CHUNK, ERROR = 1, 3


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TENANTS[name][0]}")]


def store(server, name: str, **options) -> RemoteStore:
    return RemoteStore(server.url, connection=Connection(token=TENANTS[name][0]), timeout=60, **options)


def big_pack() -> Pack:
    """About 50 MB stored: more than loopback socket buffers and HTTP/2 windows hold, so an unread transfer stalls."""
    return make_pack(layers=8, tokens=3072, heads=4, dim=64)


def _upload_each(server) -> tuple[dict[str, str], dict[str, Pack]]:
    """Each tenant stores the big pack in its own namespace: its key, and the pack, by tenant."""
    pack, keys = big_pack(), {}
    encoded = encode_pack(pack)
    for name in TENANTS:
        with store(server, name) as remote:
            keys[name], _ = remote.put(encoded)
    return keys, dict.fromkeys(TENANTS, pack)


def _unread_streams(server, name: str, key: str, count: int, stack: ExitStack) -> tuple[list, list]:
    """``count`` GetPack streams of ``key`` by tenant ``name``, each on a channel of its own, read as far as their first
    message and then left: (the streams admitted, the refusals' status codes)."""
    admitted, refused = [], []
    for _ in range(count):
        channel = stack.enter_context(grpc.insecure_channel(server.address))
        responses = store_pb2_grpc.PackStoreStub(channel).GetPack(store_pb2.GetPackRequest(ref=key, bulk=False), metadata=bearer(name))
        try:
            next(responses)
            admitted.append(responses)
        except grpc.RpcError as exc:
            refused.append(exc.code())
    return admitted, refused


@pytest.mark.parametrize("seconds", [4, pytest.param(30, marks=pytest.mark.long)], ids=["short", "long"])
def test_two_tenants_holding_unread_streams_do_not_stop_a_thirds_calls_and_are_cancelled_for_reading_too_slowly(
    tmp_path: Path, seconds: int
) -> None:
    """--workers 4: B and C each open 2 x workers GetPack streams without bulk and never read them. Each holds at most
    its share (B 2, C 1: the last 2 slots are kept for principals holding none); A's StatPack, ListPacks, StoreStats,
    streamed and bulk fetches are all answered meanwhile; after --stream-seconds plus their bytes at 16 MiB/s the
    unread streams are cancelled, logged CANCELLED with a warning naming the token."""
    auth = tokens_file(tmp_path / "tokens.toml", TENANTS)
    workers = 4
    with running_server(tmp_path / "data", "--auth", str(auth), "--workers", str(workers), "--stream-seconds", str(seconds)) as server:
        keys, packs = _upload_each(server)
        with ExitStack() as stack:
            held_b, refused_b = _unread_streams(server, "b", keys["b"], 2 * workers, stack)
            held_c, refused_c = _unread_streams(server, "c", keys["c"], 2 * workers, stack)
            assert (len(held_b), len(held_c)) == (2, 1)
            assert set(refused_b) == set(refused_c) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            with store(server, "a", bulk=False) as streamed, store(server, "a") as bulk:
                assert streamed.stat(keys["a"]).key == keys["a"] and len(streamed.list_page().packs) == 1
                assert streamed.counts().packs == 1
                assert torch.equal(PackReader(streamed).fetch(keys["a"]).keys[3], packs["a"].keys[3])
                assert torch.equal(PackReader(bulk).fetch(keys["a"]).values[2], packs["a"].values[2])
            time.sleep(seconds + 4)  # past the allowance (plus what the windows took, at 16 MiB/s): the watch cancels B's and C's streams
            for responses in held_b + held_c:
                with pytest.raises(grpc.RpcError) as cancelled:
                    for _ in responses:
                        pass
                assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        lines = server.log_lines()
    warnings = [line for line in lines if line["msg"].startswith("stream cancelled: its client reads too slowly")]
    assert sorted(line["token"] for line in warnings) == ["b", "b", "c"]
    assert all("16 MiB" in line["rule"] for line in warnings)
    gets = [line for line in lines if line.get("method") == "GetPack" and line.get("slow_reader")]
    assert sorted((line["token"], line["code"]) for line in gets) == [("b", "CANCELLED")] * 2 + [("c", "CANCELLED")]
    a_calls = [line for line in lines if line.get("token") == "a" and line.get("method") != "PutPack"]
    assert a_calls and {line["code"] for line in a_calls} == {"OK"}


LOCAL_HOLDER = r"""
import socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\0" + sys.argv[1])
sock.sendall(bytes.fromhex(sys.argv[2]))
print(sock.recv(1)[0], flush=True)  # the first byte of the first frame: its kind
time.sleep(float(sys.argv[3]))
"""


def _bulk_hold(server, name: str, key: str, how: str, stack: ExitStack) -> int:
    """Tenant ``name`` takes a bulk ticket and presents it from ``how`` (a TCP source address, or ``process``: another
    process on the local socket), then reads no further than the first frame's kind: CHUNK when admitted, ERROR when
    refused."""
    with grpc.insecure_channel(server.address) as channel:
        _, ticket = list(store_pb2_grpc.PackStoreStub(channel).GetPack(store_pb2.GetPackRequest(ref=key, bulk=True), metadata=bearer(name)))
    hello = MAGIC + ticket.bulk.ticket
    if how == "process":
        child = subprocess.Popen(
            [sys.executable, "-c", LOCAL_HOLDER, ticket.bulk.local_socket, hello.hex(), "120"], stdout=subprocess.PIPE, text=True
        )
        stack.callback(child.kill)
        return int(child.stdout.readline())
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", ticket.bulk.port), timeout=10, source_address=(how, 0)))
    sock.sendall(hello)
    kind, _, _ = FRAME.unpack(bytes(recv_exact(sock, FRAME.size)))
    return kind


@pytest.mark.parametrize("seconds", [0, pytest.param(45, marks=pytest.mark.long)], ids=["short", "long"])
def test_one_tenant_with_tickets_from_several_addresses_and_processes_leaves_bulk_slots_for_others(tmp_path: Path, seconds: int) -> None:
    """--workers 1: 4 bulk slots, the last 2 kept for principals holding none. B presents four tickets from
    two addresses and another process and reads none: two are admitted, two refused however they come. C takes one.
    A still reads over the bulk port, exactly, over TCP and the local socket, for as long as B and C hold on."""
    auth = tokens_file(tmp_path / "tokens.toml", TENANTS)
    with running_server(tmp_path / "data", "--auth", str(auth), "--workers", "1") as server:
        keys, packs = _upload_each(server)
        with ExitStack() as stack:
            kinds_b = [_bulk_hold(server, "b", keys["b"], how, stack) for how in ("127.0.0.2", "127.0.0.3", "process", "127.0.0.1")]
            kinds_c = [_bulk_hold(server, "c", keys["c"], how, stack) for how in ("127.0.0.4", "process")]
            assert kinds_b == [CHUNK, CHUNK, ERROR, ERROR] and kinds_c == [CHUNK, ERROR]
            fetches, end = 0, time.monotonic() + seconds
            with store(server, "a", local_bulk=False) as tcp, store(server, "a") as local:
                while not fetches or time.monotonic() < end:
                    assert torch.equal(PackReader(tcp).fetch(keys["a"]).keys[1], packs["a"].keys[1])
                    assert torch.equal(PackReader(local).fetch(keys["a"]).keys[2], packs["a"].keys[2])
                    fetches += 2
        lines = server.log_lines()
    bulk_a = [line for line in lines if line.get("method") == "GetPack.bulk" and line.get("token") == "a"]
    assert [line["code"] for line in bulk_a] == ["OK"] * fetches  # all over the bulk port, none streamed after a refusal
    refused = [line for line in lines if line.get("method") == "GetPack.bulk" and line.get("code") == "RESOURCE_EXHAUSTED"]
    assert sorted(line["token"] for line in refused) == ["b", "b", "c"]
    assert all("kept for callers holding none" in line["error"] for line in refused)  # B's third and fourth, C's second


def _hot_metrics(server, name: str) -> dict[str, float]:
    """The hot-pack series tenant ``name``'s token reads from the metrics port."""
    request = urllib.request.Request(f"http://{server.metrics}/metrics", headers={"Authorization": f"Bearer {TENANTS[name][0]}"})
    text = urllib.request.urlopen(request).read().decode()
    return {
        f"{sample.name}{sorted(sample.labels.items())}": sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("packstore_hot")
    }


def test_another_tenants_pack_sizes_do_not_show_in_what_a_tenant_reads(tmp_path: Path) -> None:
    """Each namespace has its own --hot-bytes: B fills its budget with its own packs, then A uploads and reads a pack of
    another size. Nothing B's token reads of the hot packs changes (before, one tenant's pack evicted another's and
    B's gauge bounded A's pack size), and B's packs are all still hot."""
    auth = tokens_file(tmp_path / "tokens.toml", TENANTS)
    b_packs = [make_pack(layers=4, tokens=1024 + i, heads=2, dim=64) for i in range(3)]  # about 3.5 MB stored each
    size = sum(chunk.stored_bytes for pack in b_packs for chunk in encode_pack(pack).header.chunks)
    with running_server(tmp_path / "data", "--auth", str(auth), "--hot-bytes", str(int(size * 1.15))) as server:
        with store(server, "b") as b:
            b_keys = [b.put(encode_pack(pack))[0] for pack in b_packs]  # an upload turns hot
        b_before = _hot_metrics(server, "b")
        assert b_before["packstore_hot_bytes[('namespace', 'b')]"] == size
        with store(server, "a") as a:
            key, _ = a.put(encode_pack(make_pack(layers=4, tokens=2200, heads=2, dim=64)))  # over a third of the budget
            assert torch.equal(PackReader(a).fetch(key).keys[0], make_pack(layers=4, tokens=2200, heads=2, dim=64).keys[0])
        assert _hot_metrics(server, "b") == b_before
        with store(server, "b") as b:
            for pack_key, pack in zip(b_keys, b_packs):
                assert torch.equal(PackReader(b).fetch(pack_key).values[1], pack.values[1])
        after = _hot_metrics(server, "b")
        hits = "packstore_hot_reads_total[('namespace', 'b'), ('result', 'hit')]"
        assert after[hits] == 3 and after.get("packstore_hot_reads_total[('namespace', 'b'), ('result', 'miss')]", 0) == 0


def test_a_config_that_still_sets_bulk_per_peer_is_refused_naming_what_replaced_it(tmp_path: Path, monkeypatch) -> None:
    """Its meaning changed (per principal, not per address): a setting silently ignored would leave a limit unset."""
    config = tmp_path / "packstore.toml"
    config.write_text(f'data = "{tmp_path}"\nbulk_per_peer = 2\n')
    with pytest.raises(InvalidInput, match="bulk_per_peer was replaced by bulk_per_principal"):
        load_config(str(config))
    monkeypatch.setenv("PACKSTORE_BULK_PER_PEER", "2")
    with pytest.raises(InvalidInput, match=r"\$PACKSTORE_BULK_PER_PEER: bulk_per_peer was replaced"):
        load_config(None, {"data": str(tmp_path)})
    monkeypatch.delenv("PACKSTORE_BULK_PER_PEER")
    assert load_config(None, {"data": str(tmp_path), "bulk_per_principal": 3, "stream_seconds": 5}).bulk_per_principal == 3
    with pytest.raises(InvalidInput, match="stream_seconds must be from 0 to 86400"):
        load_config(None, {"data": str(tmp_path), "stream_seconds": 0})
