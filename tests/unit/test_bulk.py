"""GetPack's bulk transfer: chunks over the bulk port for a single-use ticket, the same bytes as the stream,
errors as typed as gRPC's, and the stream whenever the port is off or cannot be reached; on the service's host,
hot packs mapped from their sealed segments."""

from __future__ import annotations

import fcntl
import os
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from packstore.errors import IntegrityError, InvalidInput, LimitExceeded, PackNotFound, Unauthenticated, Unavailable
from packstore.rpc.bulk import (
    MAGIC,
    TICKET_BYTES,
    Mappings,
    ReceiveBuffers,
    bulk_chunks,
    chunk_frame,
    connect,
    end_frame,
    error_frame,
    read_frame,
    segment_frame,
)
from packstore.rpc.messages import stored_pack
from packstore.service.bulk import Tickets, bulk_address
from packstore.store import LmdbStore
from packstore.store.remote import RemoteStore
from packstore.tensors import encode_pack
from packstore.v1 import store_pb2, store_pb2_grpc
from service_helpers import free_port, running_server
from test_format import make_pack


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("bulk") / "data", "--workers", "1") as running:
        yield running


def ticket_for(server, ref: str, **fields) -> tuple[store_pb2.PackInfo, store_pb2.BulkTicket]:
    """GetPack asking for bulk, as any gRPC client would: the header, then the ticket."""
    stub = store_pb2_grpc.PackStoreStub(grpc.insecure_channel(server.address))
    header, ticket = list(stub.GetPack(store_pb2.GetPackRequest(ref=ref, bulk=True, **fields)))
    assert header.WhichOneof("item") == "header" and ticket.WhichOneof("item") == "bulk"
    return header.header, ticket.bulk


def requests_counted(server, method: str, code: str) -> float:
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics").read().decode()
    line = f'packstore_requests_total{{code="{code}",method="{method}"}} '
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(line))


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_a_fetch_reads_its_chunks_over_the_bulk_port_and_gets_what_the_stream_gives(server) -> None:
    pack = make_pack(layers=4, tokens=600, dim=64)
    encoded = encode_pack(pack)
    before = requests_counted(server, "GetPack.bulk", "OK")
    with RemoteStore(server.url) as remote, RemoteStore(server.url, bulk=False) as streamed:
        key, _ = remote.put(encoded, name="bulky")
        assert same(remote.fetch("bulky"), pack) and same(streamed.fetch("bulky"), pack)
        assert [bytes(c) for c in remote.get(key).chunks] == list(encoded.chunks)
        part = remote.fetch_part(key, layers=(1, 2), prefix=100)
        assert torch.equal(part.keys[0], pack.keys[1][..., :100, :])
        for _ in range(3):  # the receive buffer is reused, and what a finished fetch returned stays intact
            again = remote.fetch(key)
        assert same(again, pack) and remote._buffers.idle_bytes >= encoded.stored_bytes - len(encoded.header.to_json())
    assert requests_counted(server, "GetPack.bulk", "OK") - before == 6  # the stream client asked for none


def test_a_ticket_is_single_use_and_the_bulk_port_refuses_anything_else(server) -> None:
    encoded = encode_pack(make_pack(tokens=64, dim=16))
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encoded)
    info, ticket = ticket_for(server, key)
    assert ticket.port and len(ticket.ticket) == TICKET_BYTES and ticket.expires_ms == 30000 and not ticket.tls
    header = stored_pack(info).header
    indices = range(len(header.chunks))
    chunks = list(bulk_chunks(connect("127.0.0.1", ticket.port, ticket.ticket, timeout=10, tls=None), header, indices, "test"))
    assert [bytes(c) for _, c in chunks] == list(encoded.chunks)
    with pytest.raises(Unauthenticated, match="single-use"):
        list(bulk_chunks(connect("127.0.0.1", ticket.port, ticket.ticket, timeout=10, tls=None), header, indices, "test"))
    with pytest.raises(Unauthenticated):
        list(bulk_chunks(connect("127.0.0.1", ticket.port, b"\0" * TICKET_BYTES, timeout=10, tls=None), header, indices, "test"))
    with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * TICKET_BYTES)
        kind, _, length = read_frame(raw)
        assert (kind, b"not a packstore bulk connection" in raw.recv(length)) == (3, True)
    with RemoteStore(server.url) as remote:
        assert remote.stat(key).key == key  # still serving


def test_a_pack_deleted_after_its_ticket_is_not_found_and_a_damaged_chunk_never_leaves(server) -> None:
    encoded = encode_pack(make_pack(tokens=64, dim=16))
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encoded)
        info, ticket = ticket_for(server, key)
        remote.delete(key)
    header = stored_pack(info).header
    sock = connect("127.0.0.1", ticket.port, ticket.ticket, timeout=10, tls=None)
    with pytest.raises(PackNotFound, match="chunk 0 is gone"):
        list(bulk_chunks(sock, header, range(len(header.chunks)), "test"))


def test_a_client_that_goes_away_mid_transfer_leaves_the_server_serving(server) -> None:
    pack = make_pack(layers=8, tokens=4000, dim=64)
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack))
        for _ in range(3):
            _, ticket = ticket_for(server, key)
            sock = connect("127.0.0.1", ticket.port, ticket.ticket, timeout=10, tls=None)
            read_frame(sock)
            sock.close()  # after the first frame, with megabytes still to come
        assert same(remote.fetch(key), pack)


def test_connections_past_the_limit_are_refused_with_resource_exhausted(server) -> None:
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(make_pack(tokens=64, dim=16)))
    _, ticket = ticket_for(server, key)
    idle = [socket.create_connection(("127.0.0.1", ticket.port), timeout=10) for _ in range(4)]  # --workers 1: 4 at once
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as extra:
            kind, _, length = read_frame(extra)
            assert kind == 3 and b"LIMIT_EXCEEDED" in extra.recv(length)
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    with RemoteStore(server.url) as remote:
        assert remote.fetch(key).header.key == key


def test_with_the_bulk_port_off_or_out_of_reach_a_fetch_streams(tmp_path: Path, caplog) -> None:
    pack = make_pack(tokens=200, dim=32)
    with running_server(tmp_path / "off", "--bulk-listen", "off") as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack))
        assert same(remote.fetch(key), pack) and remote.bulk
        assert requests_counted(server, "GetPack.bulk", "OK") == 0
    # bound on 127.0.0.2: a client that reached gRPC on 127.0.0.1 finds nothing at that port, as past a firewall
    away = ("--bulk-listen", f"127.0.0.2:{free_port()}", "--bulk-local", "off")  # (a local socket would be reached)
    with running_server(tmp_path / "away", *away) as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack), name="p")
        assert same(remote.fetch("p"), pack) and not remote.bulk
        assert "cannot be reached" in caplog.text
        assert same(remote.fetch("p"), pack)  # straight to the stream from now on


def test_tickets_lapse_and_are_bounded() -> None:
    tickets = Tickets(lifetime=0.05, limit=2)
    header = encode_pack(make_pack(tokens=4, dim=4)).header
    first = tickets.issue(None, header, [0], {})
    second = tickets.issue(None, header, [0], {})
    assert first != second and tickets.issue(None, header, [0], {}) is None  # at the limit: the caller streams
    assert tickets.take(second).indices == (0,)
    time.sleep(0.1)
    with pytest.raises(Unauthenticated, match="lapsed"):
        tickets.take(first)
    assert tickets.issue(None, header, [0], {}) is not None  # lapsed ones make room


def test_the_bulk_address_follows_the_grpc_one_unless_told() -> None:
    assert bulk_address("127.0.0.1:50551", "") == ("127.0.0.1", 0)
    assert bulk_address("[::1]:50551", "") == ("::1", 0)
    assert bulk_address("0.0.0.0:1", "10.0.0.5:7000") == ("10.0.0.5", 7000)
    assert bulk_address("127.0.0.1:1", "off") is None and bulk_address("unix:/tmp/s", "") is None
    for bad in ("nohost", ":7", "h:port", "h:70000"):
        with pytest.raises(InvalidInput, match="bad bulk address"):
            bulk_address("127.0.0.1:1", bad)


def test_receive_buffers_are_reused_once_released_and_bounded() -> None:
    buffers = ReceiveBuffers(keep_bytes=1000)
    with buffers.lease(600) as first:
        with buffers.lease(300) as second:
            assert len(first) == 600 and len(second) == 300 and first.obj is not second.obj
    assert buffers.idle_bytes == 900
    with buffers.lease(200) as third, buffers.lease(500) as fourth:
        assert third.obj is second.obj and fourth.obj is first.obj  # the smallest that fits
    with buffers.lease(2000):
        pass
    assert buffers.idle_bytes == 900  # the 2000-byte one was not kept: over keep_bytes


def test_error_frames_carry_the_error_class_and_fields() -> None:
    a, b = socket.socketpair()
    header = encode_pack(make_pack(tokens=4, dim=4)).header
    a.sendall(error_frame(IntegrityError("chunk 0 is damaged", chunk="0")))
    with pytest.raises(IntegrityError, match="damaged") as info:
        list(bulk_chunks(b, header, [0], "test"))
    assert info.value.fields == {"chunk": "0"}
    a.close()
    a, b = socket.socketpair()
    a.sendall(error_frame(LimitExceeded("busy")) + end_frame())
    with pytest.raises(LimitExceeded):
        list(bulk_chunks(b, header, [0], "test"))
    a.close()
    a, b = socket.socketpair()
    a.sendall(end_frame())  # END before any chunk
    with pytest.raises(InvalidInput, match="where chunk 0"):
        list(bulk_chunks(b, header, [0], "test"))
    a.close()
    a, b = socket.socketpair()
    a.sendall(MAGIC)  # half a frame, then the connection drops
    a.close()
    with pytest.raises(Unavailable, match="broke off after 0 of 1"):
        list(bulk_chunks(b, header, [0], "test"))


def metric(server, sample: str) -> float:
    """The value of one Prometheus sample (name and labels exactly as exposed), 0 when absent."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " "))


def test_on_the_services_host_a_hot_pack_arrives_as_its_sealed_segment(server, monkeypatch) -> None:
    """An upload makes a pack hot; a client on the service's host then maps its segment (the bytes cross no socket),
    for the whole pack or part of it, and what it returns outlives the mapping."""
    pack = make_pack(layers=4, tokens=600, dim=64)
    encoded = encode_pack(pack)
    mapped, original = [], Mappings.map
    monkeypatch.setattr(Mappings, "map", lambda self, fd, end: mapped.append(end) or original(self, fd, end))
    hits = metric(server, 'packstore_hot_reads_total{result="hit"}')
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encoded, name="hot")
        _, ticket = ticket_for(server, key)
        assert ticket.local_socket.startswith("packstore-bulk-")
        assert same(remote.fetch("hot"), pack) and len(mapped) == 1
        part = remote.fetch_part(key, layers=(1, 2), prefix=100)
        assert torch.equal(part.values[1], pack.values[2][..., :100, :]) and len(mapped) == 2
        assert [bytes(c) for c in remote.get(key).chunks] == list(encoded.chunks)
    assert metric(server, 'packstore_hot_reads_total{result="hit"}') - hits == 3
    assert metric(server, "packstore_hot_packs") >= 1


def test_a_pack_turns_hot_on_its_first_whole_read_and_leaves_when_deleted(tmp_path: Path) -> None:
    pack = make_pack(layers=3, tokens=300, dim=32)
    with LmdbStore(tmp_path / "data") as store:
        key, _ = store.put(encode_pack(pack))  # stored before the service starts: not hot
    with running_server(tmp_path / "data") as server, RemoteStore(server.url) as remote:
        remote.fetch_part(key, layers=(0, 0))  # a part is read from the store and not kept
        assert metric(server, "packstore_hot_packs") == 0
        assert same(remote.fetch(key), pack)  # the first whole read keeps it
        assert metric(server, "packstore_hot_packs") == 1 and metric(server, 'packstore_hot_reads_total{result="miss"}') == 2
        assert same(remote.fetch(key), pack)
        assert metric(server, 'packstore_hot_reads_total{result="hit"}') == 1
        remote.delete(key)
        assert metric(server, "packstore_hot_packs") == 0 and metric(server, "packstore_hot_bytes") == 0
        with pytest.raises(PackNotFound):
            remote.fetch(key)


def test_hot_packs_stay_within_hot_bytes_the_least_recently_used_going_first(tmp_path: Path) -> None:
    packs = [make_pack(layers=2, tokens=200 + i, dim=32) for i in range(3)]
    size = encode_pack(packs[0]).stored_bytes
    with running_server(tmp_path / "data", "--hot-bytes", str(int(size * 1.6))) as server, RemoteStore(server.url) as remote:
        keys = [remote.put(encode_pack(p))[0] for p in packs]
        assert metric(server, "packstore_hot_packs") == 1 and metric(server, "packstore_hot_bytes") <= size * 1.6
        for key, pack in reversed(list(zip(keys, packs))):  # each read whole turns hot, evicting the one before
            assert same(remote.fetch(key), pack)
        assert metric(server, 'packstore_hot_reads_total{result="hit"}') == 1  # only the last upload was still hot
        assert metric(server, "packstore_hot_packs") == 1


def test_without_a_local_socket_or_hot_packs_fetches_go_over_tcp(tmp_path: Path, monkeypatch) -> None:
    pack = make_pack(layers=2, tokens=300, dim=32)
    mapped = []
    monkeypatch.setattr(Mappings, "map", lambda self, fd, end: mapped.append(end))
    with running_server(tmp_path / "data", "--bulk-local", "off", "--hot-bytes", "0") as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack))
        _, ticket = ticket_for(server, key)
        assert ticket.local_socket == ""
        assert same(remote.fetch(key), pack) and same(remote.fetch(key), pack) and not mapped
        assert metric(server, "packstore_hot_packs") == 0 and requests_counted(server, "GetPack.bulk", "OK") == 2


def segment_transfer(descriptor: int, entries: list[tuple[int, int, int]]) -> socket.socket:
    """The client's end of a local connection on which a server sent a SEGMENT frame with ``descriptor``, then END."""
    server_end, client_end = socket.socketpair(socket.AF_UNIX)
    socket.send_fds(server_end, [segment_frame(entries)], [descriptor])
    server_end.sendall(end_frame())
    server_end.close()
    os.close(descriptor)
    return client_end


def test_a_client_maps_only_a_sealed_segment_that_holds_its_table() -> None:
    encoded = encode_pack(make_pack(tokens=8, dim=8))
    header, data = encoded.header, encoded.chunks[0]
    entries = [(0, 0, len(data))]

    def memfd(sealed: bool, size: int) -> int:
        fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
        os.write(fd, data[:size])
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        return fd

    with Mappings() as mappings:
        chunks = list(bulk_chunks(segment_transfer(memfd(True, len(data)), entries), header, [0], "test", None, mappings))
        assert [(i, bytes(c)) for i, c in chunks] == [(0, data)]
    with Mappings() as mappings, pytest.raises(IntegrityError, match="not sealed"):
        list(bulk_chunks(segment_transfer(memfd(False, len(data)), entries), header, [0], "test", None, mappings))
    with Mappings() as mappings, pytest.raises(IntegrityError, match="whose table reaches byte"):
        list(bulk_chunks(segment_transfer(memfd(True, len(data) - 1), entries), header, [0], "test", None, mappings))
    with Mappings() as mappings, pytest.raises(InvalidInput, match="holds chunk 0 of 3 bytes"):
        list(bulk_chunks(segment_transfer(memfd(True, len(data)), [(0, 0, 3)]), header, [0], "test", None, mappings))
    server_end, client_end = socket.socketpair(socket.AF_UNIX)
    socket.send_fds(server_end, [chunk_frame(0, len(data))], [memfd(True, len(data))])
    with Mappings() as mappings, pytest.raises(InvalidInput, match="a descriptor with a frame of kind 1"):
        list(bulk_chunks(client_end, header, [0], "test", None, mappings))
    server_end.close()
    a, b = socket.socketpair()
    a.sendall(segment_frame(entries))  # a segment on a TCP-like connection (no mappings): refused
    with pytest.raises(InvalidInput, match="sent frame 4"):
        list(bulk_chunks(b, header, [0], "test"))
    a.close()
