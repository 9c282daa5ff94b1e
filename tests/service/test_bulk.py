"""GetPack's bulk transfer: chunks over the bulk port for a single-use ticket, the same bytes as the stream,
errors as typed as gRPC's, and the stream whenever the port is off, cannot be reached or is busy; connections that
present no ticket in time take no slot; hot packs per namespace, within their memory bound, never passed as
descriptors."""

from __future__ import annotations

import array
import dataclasses
import logging
import socket
import struct
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from packstore.errors import IntegrityError, InvalidInput, LimitExceeded, PackNotFound, Unauthenticated, Unavailable
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.rpc.frames import CHUNK, END, MAGIC, TICKET_BYTES, end_frame, error_frame, read_frame, recv_exact
from packstore.service.bulk import Tickets, bulk_address
from packstore.service.hot import HotPacks
from packstore.store import LmdbStore
from packstore.store.remote.bulk_reads import ReceiveBuffers, bulk_chunks, connect
from packstore.store.remote.from_messages import stored_pack
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.packs import make_pack
from tools.lib.servers import free_port, running_server


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
    line = f'packstore_requests_total{{code="{code}",method="{method}",'  # any namespace
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line))


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_a_fetch_reads_its_chunks_over_the_bulk_port_and_gets_what_the_stream_gives(server) -> None:
    pack = make_pack(layers=4, tokens=600, dim=64)
    encoded = encode_pack(pack)
    before = requests_counted(server, "GetPack.bulk", "OK")
    with RemoteStore(server.url) as remote, RemoteStore(server.url, bulk=False) as streamed:
        key, _ = remote.put(encoded, name="bulky")
        assert same(PackReader(remote).fetch("bulky"), pack) and same(PackReader(streamed).fetch("bulky"), pack)
        assert [bytes(c) for c in PackReader(remote).get(key).chunks] == list(encoded.chunks)
        part = PackReader(remote).fetch_part(key, layers=(1, 2), prefix=100)
        assert torch.equal(part.keys[0], pack.keys[1][..., :100, :])
        for _ in range(3):  # the receive buffer is reused, and what a finished fetch returned stays intact
            again = PackReader(remote).fetch(key)
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
        assert same(PackReader(remote).fetch(key), pack)


def test_connections_without_a_ticket_take_no_slot_and_are_closed_within_about_a_second(server) -> None:
    """--workers 1 gives 4 transfer slots: 8 idle connections and 8 sending garbage slowly hold none of them, a fetch
    still goes over the bulk port meanwhile, and each idle one is closed after about a second."""
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(make_pack(tokens=64, dim=16)))
        _, ticket = ticket_for(server, key)
        idle = [socket.create_connection(("127.0.0.1", ticket.port), timeout=10) for _ in range(8)]
        slow = [socket.create_connection(("127.0.0.1", ticket.port), timeout=10, source_address=("127.0.0.2", 0)) for _ in range(8)]
        try:
            for sock in slow:
                sock.sendall(MAGIC[:2])
            before = requests_counted(server, "GetPack.bulk", "OK")
            assert PackReader(remote).fetch(key).header.key == key
            assert requests_counted(server, "GetPack.bulk", "OK") - before == 1
            started = time.monotonic()
            for sock in idle + slow:
                assert sock.recv(1) == b""  # closed by the server, without a frame
            assert time.monotonic() - started < 5
        finally:
            for sock in idle + slow:
                sock.close()


def big_pack():
    """A pack of about 33 MB: more than the kernel buffers a transfer nobody reads can fill."""
    return make_pack(layers=8, tokens=4000, dim=64)


def test_a_principal_past_its_share_of_slots_gets_limit_exceeded_from_any_address_and_the_client_streams_instead(server, caplog) -> None:
    """--workers 1: 4 slots, the last 2 kept for principals holding none (without tokens, a principal is the address
    GetPack was called from). Two transfers nobody reads hold all this principal may; a third of its tickets gets LIMIT_EXCEEDED, presented from the same
    address or another; a RemoteStore of the same principal streams the pack instead and says so once in its log.
    (Another principal still gets a slot: test_fair_shares.py.)"""
    pack = big_pack()
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack))
    stalled = []
    try:
        for _ in range(2):
            _, ticket = ticket_for(server, key)
            stalled.append(connect("127.0.0.1", ticket.port, ticket.ticket, timeout=10, tls=None))
            read_frame(stalled[-1])  # admitted: its first chunk is on its way
        for source in ("127.0.0.1", "127.0.0.2"):
            _, ticket = ticket_for(server, key)
            with socket.create_connection(("127.0.0.1", ticket.port), timeout=10, source_address=(source, 0)) as third:
                third.sendall(MAGIC + ticket.ticket)
                kind, _, length = read_frame(third)
                body = bytes(recv_exact(third, length))
                assert kind == 3 and b"LIMIT_EXCEEDED" in body and b"holds 2 of the bulk transfers" in body
        caplog.set_level(logging.WARNING, logger="packstore.remote")
        with RemoteStore(server.url, local_bulk=False) as remote:
            before = requests_counted(server, "GetPack", "OK")
            assert same(PackReader(remote).fetch(key), pack) and same(PackReader(remote).fetch(key), pack) and remote.bulk
            assert requests_counted(server, "GetPack", "OK") - before == 4  # twice asked for bulk, twice streamed
        assert caplog.text.count("did not start a transfer") == 1
    finally:
        for sock in stalled:
            sock.close()


def test_with_the_bulk_port_off_or_out_of_reach_a_fetch_streams(tmp_path: Path, caplog) -> None:
    pack = make_pack(tokens=200, dim=32)
    with running_server(tmp_path / "off", "--bulk-listen", "off") as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack))
        assert same(PackReader(remote).fetch(key), pack) and remote.bulk
        assert requests_counted(server, "GetPack.bulk", "OK") == 0
    # bound on 127.0.0.2: a client that reached gRPC on 127.0.0.1 finds nothing at that port, as past a firewall
    away = ("--bulk-listen", f"127.0.0.2:{free_port()}", "--bulk-local", "off")  # (a local socket would be reached)
    with running_server(tmp_path / "away", *away) as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack), name="p")
        assert same(PackReader(remote).fetch("p"), pack) and not remote.bulk
        assert "cannot be reached" in caplog.text
        assert same(PackReader(remote).fetch("p"), pack)  # straight to the stream from now on


def test_tickets_lapse_and_are_shared_among_principals() -> None:
    tickets = Tickets(lifetime=0.05, limit=4)  # (a reserve of 2 for principals holding none)
    header = encode_pack(make_pack(tokens=4, dim=4)).header
    first = tickets.issue(None, "default", header, [0], {}, "token:a")
    second = tickets.issue(None, "default", header, [0], {}, "token:a")
    assert first != second
    with pytest.raises(LimitExceeded, match=r"bulk ticket: token:a holds 2 of the bulk tickets, and the last 2 are kept .*; retry in"):
        tickets.issue(None, "default", header, [0], {}, "token:a")  # past its share: the caller streams
    assert tickets.issue(None, "default", header, [0], {}, "token:b") is not None  # another is served at once
    assert tickets.take(second).indices == (0,) and tickets.shares.held("token:a") == 1  # a presented ticket frees its unit
    time.sleep(0.1)
    with pytest.raises(Unauthenticated, match="lapsed"):
        tickets.take(first)
    assert tickets.issue(None, "default", header, [0], {}, "token:a") is not None  # lapsed ones make room
    assert (tickets.shares.held("token:a"), tickets.shares.held("token:b")) == (1, 0)


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


def metric(server, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels`` (0 when none)."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics").read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_on_the_services_host_a_hot_pack_comes_over_the_local_socket_as_chunks_never_as_a_descriptor(server) -> None:
    """An upload makes a pack hot; a client on the service's host reads it over the local socket, whole or in part,
    as CHUNK frames with no file descriptor attached (a descriptor could keep the memory alive past --hot-bytes)."""
    pack = make_pack(layers=4, tokens=600, dim=64)
    encoded = encode_pack(pack)
    hits = metric(server, "packstore_hot_reads_total", result="hit")
    with RemoteStore(server.url) as remote:
        key, _ = remote.put(encoded, name="hot")
        info, ticket = ticket_for(server, key)
        assert ticket.local_socket.startswith("packstore-bulk-")
        header = stored_pack(info).header
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(10)
            raw.connect("\0" + ticket.local_socket)
            raw.sendall(MAGIC + ticket.ticket)
            fds = array.array("i")
            for index in range(len(header.chunks)):
                data, ancillary, _, _ = raw.recvmsg(13, socket.CMSG_LEN(4 * fds.itemsize))
                assert not ancillary
                kind, got, length = struct.unpack("<BIQ", data + bytes(recv_exact(raw, 13 - len(data))))
                assert (kind, got) == (CHUNK, index) and bytes(recv_exact(raw, length)) == encoded.chunks[index]
            assert read_frame(raw)[0] == END
        assert same(PackReader(remote).fetch("hot"), pack)
        part = PackReader(remote).fetch_part(key, layers=(1, 2), prefix=100)
        assert torch.equal(part.values[1], pack.values[2][..., :100, :])
        assert [bytes(c) for c in PackReader(remote).get(key).chunks] == list(encoded.chunks)
    assert metric(server, "packstore_hot_reads_total", result="hit") - hits == 4
    assert metric(server, "packstore_hot_packs") >= 1


def test_a_pack_turns_hot_on_its_first_whole_read_and_leaves_when_deleted(tmp_path: Path) -> None:
    pack = make_pack(layers=3, tokens=300, dim=32)
    with LmdbStore(tmp_path / "data") as store:
        key, _ = store.put(encode_pack(pack))  # stored before the service starts: not hot
    with running_server(tmp_path / "data") as server, RemoteStore(server.url) as remote:
        PackReader(remote).fetch_part(key, layers=(0, 0))  # a part is read from the store and not kept
        assert metric(server, "packstore_hot_packs") == 0
        assert same(PackReader(remote).fetch(key), pack)  # the first whole read keeps it
        assert metric(server, "packstore_hot_packs") == 1 and metric(server, "packstore_hot_reads_total", result="miss") == 2
        assert same(PackReader(remote).fetch(key), pack)
        assert metric(server, "packstore_hot_reads_total", result="hit") == 1
        remote.delete(key)
        assert metric(server, "packstore_hot_packs") == 0 and metric(server, "packstore_hot_memory_bytes") == 0
        with pytest.raises(PackNotFound):
            PackReader(remote).fetch(key)


def test_hot_packs_stay_within_hot_bytes_the_least_recently_used_going_first(tmp_path: Path) -> None:
    packs = [make_pack(layers=2, tokens=200 + i, dim=32) for i in range(3)]
    size = encode_pack(packs[0]).stored_bytes
    with running_server(tmp_path / "data", "--hot-bytes", str(int(size * 1.6))) as server, RemoteStore(server.url) as remote:
        keys = [remote.put(encode_pack(p))[0] for p in packs]
        assert metric(server, "packstore_hot_packs") == 1 and metric(server, "packstore_hot_memory_bytes") <= size * 1.6
        for key, pack in reversed(list(zip(keys, packs))):  # each read whole turns hot, evicting the one before
            assert same(PackReader(remote).fetch(key), pack)
        assert metric(server, "packstore_hot_reads_total", result="hit") == 1  # only the last upload was still hot
        assert metric(server, "packstore_hot_packs") == 1


def test_without_a_local_socket_or_hot_packs_fetches_go_over_tcp(tmp_path: Path) -> None:
    pack = make_pack(layers=2, tokens=300, dim=32)
    with running_server(tmp_path / "data", "--bulk-local", "off", "--hot-bytes", "0") as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encode_pack(pack))
        _, ticket = ticket_for(server, key)
        assert ticket.local_socket == ""
        assert same(PackReader(remote).fetch(key), pack) and same(PackReader(remote).fetch(key), pack)
        assert metric(server, "packstore_hot_packs") == 0 and requests_counted(server, "GetPack.bulk", "OK") == 2


def test_hot_packs_count_writes_in_flight_and_copies_still_being_sent_against_their_namespaces_bound() -> None:
    """Every byte of memory the hot packs map counts against its namespace's bound: a pack being written reserves its
    size first (none is made when the room is taken), and an evicted pack a transfer still sends counts until that
    transfer ends. Another namespace's packs neither take that room nor are evicted for it."""
    base = make_pack(layers=2, tokens=100, dim=16)
    packs = [encode_pack(dataclasses.replace(base, header=dataclasses.replace(base.header, facts=(f"fact {i}",)))) for i in range(4)]
    size = sum(c.stored_bytes for c in packs[0].header.chunks)
    assert all(sum(c.stored_bytes for c in p.header.chunks) == size for p in packs)
    hot = HotPacks(int(size * 2.5))

    def keep(namespace: str, encoded) -> None:
        writer = hot.writer(namespace, encoded.header)
        for index, chunk in enumerate(encoded.chunks):
            writer.add(index, chunk)
        hot.add(writer)

    keep("other", packs[3])  # another tenant's pack: it stays hot whatever "a" does
    first, second = hot.writer("a", packs[0].header), hot.writer("a", packs[1].header)
    assert hot.namespace_bytes("a") == 2 * size and hot.writer("a", packs[2].header) is None  # two in flight: no room
    second.discard()
    for index, chunk in enumerate(packs[0].chunks):
        first.add(index, chunk)
    hot.add(first)
    with hot.lease("a", packs[0].header) as segment:
        assert segment is not None and bytes(segment.chunk(0)) == packs[0].chunks[0]
        for encoded in packs[1:3]:  # each new one evicts a's least recently used; packs[0] is still being sent
            keep("a", encoded)
            assert hot.namespace_bytes("a") <= hot.max_bytes
        assert hot.namespace_bytes("a") == 2 * size  # packs[2] kept; packs[0] evicted for it but still mapped
    assert hot.namespace_bytes("a") == size and hot.bytes == 2 * size
    assert hot.stats_by_namespace() == {"a": (1, size), "other": (1, size)}


def test_a_stalled_upload_is_cancelled_after_upload_seconds_and_gives_its_hot_room_back(tmp_path: Path) -> None:
    """An upload reserves hot memory for its pack when it starts; one that stalls is cancelled by the server after
    --upload-seconds (gRPC sets no deadline of its own), stores nothing, and the room it reserved is free again."""
    encoded = encode_pack(make_pack(layers=2, tokens=300, dim=32))
    with running_server(tmp_path / "data", "--upload-seconds", "1") as server:
        stub = store_pb2_grpc.PackStoreStub(grpc.insecure_channel(server.address))

        def stalled():
            yield store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=encoded.header.to_json()))
            time.sleep(4)  # then nothing: the server gives up first

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.PutPack(stalled(), timeout=30)
        assert info.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - started < 4
        for _ in range(100):  # the handler unwinds on its own thread, just after the client is told
            if metric(server, "packstore_hot_memory_bytes") == 0:
                break
            time.sleep(0.05)
        assert metric(server, "packstore_hot_memory_bytes") == 0
        with RemoteStore(server.url) as remote:
            assert remote.keys() == []
            key, _ = remote.put(encoded)  # a prompt upload still goes through, and turns hot
            assert metric(server, "packstore_hot_packs") == 1
