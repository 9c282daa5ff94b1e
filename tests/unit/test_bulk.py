"""GetPack's bulk transfer: chunks over the bulk port for a single-use ticket, the same bytes as the stream,
errors as typed as gRPC's, and the stream whenever the port is off or cannot be reached."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from packstore.errors import IntegrityError, InvalidInput, LimitExceeded, PackNotFound, Unauthenticated, Unavailable
from packstore.rpc.bulk import MAGIC, TICKET_BYTES, ReceiveBuffers, bulk_chunks, connect, end_frame, error_frame, read_frame
from packstore.rpc.messages import stored_pack
from packstore.service.bulk import Tickets, bulk_address
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
    with running_server(tmp_path / "away", "--bulk-listen", f"127.0.0.2:{free_port()}") as server, RemoteStore(server.url) as remote:
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
