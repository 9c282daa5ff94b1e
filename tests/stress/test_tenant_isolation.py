"""Tenants share nothing observable on the fast path: whether tenant A holds, uploads or reads the same pack as
tenant B changes nothing B's token can see: the frames of B's bulk reads, B's responses, B's log lines, B's
metrics. Two services run the same script for B; only A's activity differs (the same pack as B's, or another)."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.rpc.channel import Connection
from packstore.rpc.frames import FRAME, MAGIC, recv_exact
from packstore.store import LmdbStore
from packstore.store.namespaces import namespace_path
from packstore.store.remote.from_messages import stored_pack
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.auth import TOKENS, tokens_file
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

VOLATILE_LOG_FIELDS = {"ts", "ms", "peer"}  # times, and the client's port


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name][0]}")]


def bulk_read(server, name: str, key: str) -> list[tuple]:
    """B's raw view of one bulk read over the local socket: each frame's kind and index, and any descriptors sent."""
    channel = grpc.insecure_channel(server.address)
    header, ticket = list(store_pb2_grpc.PackStoreStub(channel).GetPack(store_pb2.GetPackRequest(ref=key, bulk=True), metadata=bearer(name)))
    channel.close()
    chunks = stored_pack(header.header).header.chunks
    seen = [("header", header.header.key, header.header.stored_bytes, header.header.tokens), ("ticket", ticket.WhichOneof("item"))]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect("\0" + ticket.bulk.local_socket)
        sock.sendall(MAGIC + ticket.bulk.ticket)
        for _ in range(len(chunks) + 1):
            data, ancillary, _, _ = sock.recvmsg(FRAME.size, socket.CMSG_LEN(16))
            kind, index, length = FRAME.unpack(data + bytes(recv_exact(sock, FRAME.size - len(data))))
            seen.append(("frame", kind, index, length, len(ancillary)))
            if length:
                recv_exact(sock, length)
    return seen


def metrics_seen(server, name: str) -> list[tuple]:
    """What B's token reads from the metrics port, less what only timing changes (latency histograms)."""
    request = urllib.request.Request(f"http://{server.metrics}/metrics", headers={"Authorization": f"Bearer {TOKENS[name][0]}"})
    text = urllib.request.urlopen(request).read().decode()
    return sorted(
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(text)
        if family.name.startswith("packstore_") and family.type != "histogram"
        for sample in family.samples
        if not sample.name.endswith("_created")
    )


def log_lines_of(server, namespace: str) -> list[dict]:
    return [{k: v for k, v in line.items() if k not in VOLATILE_LOG_FIELDS} for line in server.log_lines() if line.get("namespace") == namespace]


def b_sees(root: Path, a_reads_the_same_pack: bool) -> dict:
    """Run A's activity, then B's reads, on a fresh service; return everything B's token showed B."""
    shared, other = make_pack(layers=3, tokens=300, dim=32), make_pack(layers=3, tokens=301, dim=32)
    data = root / "data"
    with LmdbStore(namespace_path(data, "b")) as store:  # B's copy is stored before the service starts: cold
        key, _ = store.put(encode_pack(shared))
    with running_server(data, "--auth", str(tokens_file(root / "tokens.toml"))) as server:
        with RemoteStore(server.url, connection=Connection(token=TOKENS["a-writer"][0])) as a:
            mine = shared if a_reads_the_same_pack else other
            a_key, _ = a.put(encode_pack(mine))  # uploading makes it hot in A's namespace
            assert torch.equal(PackReader(a).fetch(a_key).keys[0], mine.keys[0])
        seen = {"reads": [bulk_read(server, "b-writer", key) for _ in range(2)]}
        with RemoteStore(server.url, connection=Connection(token=TOKENS["b-writer"][0])) as b:
            assert torch.equal(PackReader(b).fetch(key).values[2], shared.values[2])
            seen["listing"] = [(p.key, p.stored_bytes) for p in b.list()]
        seen["metrics"] = metrics_seen(server, "b-writer")
    seen["logs"] = log_lines_of(server, "b")
    return seen


def test_tenant_b_cannot_tell_whether_tenant_a_holds_or_just_read_the_same_pack(tmp_path: Path) -> None:
    alone, beside = b_sees(tmp_path / "alone", False), b_sees(tmp_path / "beside", True)
    assert alone == beside
    first, second = alone["reads"]
    assert {entry[-1] for entry in first + second if entry[0] == "frame"} == {0}  # no descriptor ever comes
    assert any(line.get("hot") is False for line in alone["logs"]) and any(line.get("hot") is True for line in alone["logs"])
