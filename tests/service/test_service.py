"""The pack service over real loopback sockets, with ``packstore serve`` started as a subprocess."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from packstore.bank.bank import open_banks
from packstore.errors import IntegrityError, InvalidInput, PackMismatch, PackNotFound, PackstoreError
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.security.auth import Auth
from packstore.serving.metrics_http import metrics_address, serve_metrics
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import flip_in_file, make_pack
from tools.lib.servers import running_server


def stub_for(server) -> store_pb2_grpc.PackStoreStub:
    return store_pb2_grpc.PackStoreStub(grpc.insecure_channel(server.address))


@pytest.mark.fast  # the fast lane's round trip through this tier
def test_put_list_get_delete(remote) -> None:
    pack = make_pack(tokens=300, dim=64)
    key, created = remote.put(encode_pack(pack), name="alpha")
    assert created and remote.put(encode_pack(pack))[1] is False
    assert [p.key for p in remote.list()] == [key] and remote.stat("alpha").names == ("alpha",)
    fetched = PackReader(remote).fetch("alpha")
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, fetched.keys + fetched.values))
    assert decode_pack(PackReader(remote).get(key)).header == fetched.header
    assert PackReader(remote).verify_all()[0].ok
    assert remote.delete("alpha") == key and remote.list() == []
    with pytest.raises(PackNotFound):
        remote.stat(key)


def test_list_is_paged_and_filtered(remote, server) -> None:
    keys = sorted(remote.put(encode_pack(make_pack(tokens=t)))[0] for t in range(3, 8))
    remote.put(encode_pack(make_pack(tokens=9)), name="named")
    stub = stub_for(server)
    first = stub.ListPacks(store_pb2.ListPacksRequest(page_size=2))
    second = stub.ListPacks(store_pb2.ListPacksRequest(page_size=2, page_token=first.next_page_token))
    assert [p.key for p in list(first.packs) + list(second.packs)] == sorted(keys + [remote.resolve("named")])[:4]
    assert len(remote.list()) == 6
    assert [p.names for p in remote.list(name="named")] == [("named",)]
    assert remote.list(model_fp="c" * 64) == []
    with pytest.raises(grpc.RpcError) as info:
        stub.ListPacks(store_pb2.ListPacksRequest(page_size=5000))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_names(remote) -> None:
    key, _ = remote.put(encode_pack(make_pack()))
    assert remote.set_name(key, "tagged") == key and remote.resolve("tagged") == key
    assert remote.delete_name("tagged", model_fp="a" * 64) == key
    with pytest.raises(PackNotFound):
        remote.resolve("tagged")


def test_mismatched_identities_are_refused_with_failed_precondition(remote, server) -> None:
    key, _ = remote.put(encode_pack(make_pack()))
    with pytest.raises(PackMismatch, match="model mismatch"):
        PackReader(remote).fetch(key, model_fp="c" * 64)
    with pytest.raises(grpc.RpcError) as info:
        next(stub_for(server).GetPack(store_pb2.GetPackRequest(ref=key, model_fp="a" * 64, template_fp="d" * 64)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "template mismatch" in info.value.details()


@pytest.mark.parametrize(
    "requests,code",
    [
        ([store_pb2.PutPackRequest(chunk=store_pb2.Chunk(index=0, data=b"x"))], grpc.StatusCode.INVALID_ARGUMENT),
        ([store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=b"{not json"))], grpc.StatusCode.DATA_LOSS),
        ([], grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_uploads_get_a_clear_status_and_the_server_keeps_serving(server, remote, requests, code) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub_for(server).PutPack(iter(requests))
    assert info.value.code() == code and info.value.details()
    assert remote.list() == []


def test_truncated_or_damaged_upload_stores_nothing(server, remote) -> None:
    encoded = encode_pack(make_pack())
    begin = store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=encoded.header.to_json()))
    chunk = lambda i, data: store_pb2.PutPackRequest(chunk=store_pb2.Chunk(index=i, data=data, digest=encoded.header.chunks[i].digest))  # noqa: E731
    with pytest.raises(grpc.RpcError) as info:
        stub_for(server).PutPack(iter([begin, chunk(0, encoded.chunks[0])]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 of 3 chunks" in info.value.details()
    damaged = bytes([encoded.chunks[1][0] ^ 1]) + encoded.chunks[1][1:]
    with pytest.raises(grpc.RpcError) as info:
        stub_for(server).PutPack(iter([begin, chunk(0, encoded.chunks[0]), chunk(1, damaged)]))
    assert info.value.code() == grpc.StatusCode.DATA_LOSS and "chunk 1" in info.value.details()
    assert remote.list() == []


def test_health_and_reflection(server) -> None:
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "packstore.v1.PackStore"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"packstore.v1.PackStore", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def scraped(server) -> dict[tuple[str, tuple], float]:
    """Every sample of the metrics port, by name and labels."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_and_bytes_per_namespace(server, remote) -> None:
    encoded = encode_pack(make_pack(tokens=17))
    chunk_bytes = sum(chunk.stored_bytes for chunk in encoded.header.chunks)
    before = scraped(server)
    remote.put(encoded, name="m")
    PackReader(remote).fetch("m")
    after = scraped(server)
    default = (("namespace", "default"),)

    def grew(name: str, labels: tuple = default) -> float:
        return after[name, labels] - before.get((name, labels), 0)

    assert grew("packstore_requests_total", (("code", "OK"), ("method", "PutPack"), ("namespace", "default"))) == 1
    assert grew("packstore_received_bytes_total") == grew("packstore_sent_bytes_total") == chunk_bytes
    assert after["packstore_store_packs", default] == 1 and ("packstore_store_file_bytes", ()) in after  # the whole service: no label


def test_a_metrics_address_without_a_host_listens_on_loopback() -> None:
    assert metrics_address("9100") == metrics_address(":9100") == ("127.0.0.1", 9100)
    assert metrics_address("0.0.0.0:9100") == ("0.0.0.0", 9100) and metrics_address("[::1]:9100") == ("::1", 9100)
    with pytest.raises(InvalidInput, match="use HOST:PORT"):
        metrics_address("9100:")
    port = serve_metrics(":0", CollectorRegistry(), Auth())
    try:
        assert port.server_address[0] == "127.0.0.1"
    finally:
        port.shutdown()
        port.server_close()


PROTO_ONLY_CLIENT = """
import blake3, json, sys
import grpc
sys.path.insert(0, sys.argv[1])
import store_pb2, store_pb2_grpc  # generated by the test from protos/, nothing of packstore imported
assert "packstore" not in sys.modules
header_json, chunks = open(sys.argv[2], "rb").read(), [open(p, "rb").read() for p in sys.argv[4:]]
header = json.loads(header_json)
stub = store_pb2_grpc.PackStoreStub(grpc.insecure_channel(sys.argv[3]))
def upload():
    yield store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=header_json, name="from-proto"))
    for i, data in enumerate(chunks):
        yield store_pb2.PutPackRequest(chunk=store_pb2.Chunk(index=i, data=data, digest=header["chunks"][i]["blake3"]))
put = stub.PutPack(upload())
listed = [p.key for p in stub.ListPacks(store_pb2.ListPacksRequest()).packs]
got = list(stub.GetPack(store_pb2.GetPackRequest(ref="from-proto")))
received = {}
for message in got[1:]:
    received[message.chunk.index] = received.get(message.chunk.index, b"") + message.chunk.data
ok = all(blake3.blake3(received[i]).hexdigest() == c["blake3"] for i, c in enumerate(header["chunks"]))
print(json.dumps({"created": put.created, "key": put.pack.key, "listed": listed, "header_key": got[0].header.key, "chunks_ok": ok}))
"""


def test_a_client_that_knows_only_the_protos(tmp_path: Path, server, remote) -> None:
    from importlib import resources

    from grpc_tools import protoc

    proto_dir = Path(__file__).resolve().parents[2] / "protos" / "packstore" / "v1"
    out = tmp_path / "stubs"
    out.mkdir()
    include = str(resources.files("grpc_tools") / "_proto")
    assert protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", str(proto_dir / "store.proto")]) == 0
    encoded = encode_pack(make_pack(tokens=2000, dim=64))  # chunks above 1 MiB: sent whole, received in pieces
    (tmp_path / "header.json").write_bytes(encoded.header.to_json())
    chunk_files = []
    for i, data in enumerate(encoded.chunks):
        chunk_files.append(tmp_path / f"chunk{i}")
        chunk_files[-1].write_bytes(data)
    result = subprocess.run(
        [sys.executable, "-c", PROTO_ONLY_CLIENT, str(out), str(tmp_path / "header.json"), server.address, *map(str, chunk_files)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"created": True, "key": encoded.header.key, "listed": [encoded.header.key], "header_key": encoded.header.key, "chunks_ok": True}
    assert PackReader(remote).verify("from-proto").ok


def test_damaged_pack_is_never_served(tmp_path: Path) -> None:
    encoded = encode_pack(make_pack(tokens=64, dim=16))
    with running_server(tmp_path / "data", "--hot-bytes", "0") as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encoded, name="victim")
        flip_in_file(server.data / "data.mdb", encoded.chunks[2], 30)
        with pytest.raises(IntegrityError, match="chunk 2"):
            PackReader(remote).fetch("victim")
        with pytest.raises(grpc.RpcError) as info:
            list(stub_for(server).GetPack(store_pb2.GetPackRequest(ref=key)))
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert not PackReader(remote).verify("victim").ok
        assert remote.stat("victim").key == key  # still serving


def test_a_hot_pack_is_served_from_its_verified_copy_while_its_stored_copy_is_damaged(tmp_path: Path) -> None:
    """A pack held hot (it was just uploaded) is read from the copy verified on its way in: damage to the stored copy
    is never served, it shows in verify and in every read from the store (the gRPC stream, or once no longer hot)."""
    pack = make_pack(tokens=64, dim=16)
    encoded = encode_pack(pack)
    with running_server(tmp_path / "data") as server, RemoteStore(server.url) as remote:
        key, _ = remote.put(encoded, name="victim")
        flip_in_file(server.data / "data.mdb", encoded.chunks[2], 30)
        fetched = PackReader(remote).fetch("victim")
        assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values))
        assert not PackReader(remote).verify("victim").ok
        with pytest.raises(grpc.RpcError) as info:
            list(stub_for(server).GetPack(store_pb2.GetPackRequest(ref=key)))
        assert info.value.code() == grpc.StatusCode.DATA_LOSS


def test_serving_on_a_port_already_taken_exits_with_a_message_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        packstore = Path(sys.executable).parent / "packstore"
        result = subprocess.run([str(packstore), "serve", "--data", str(tmp_path / "data"), "--listen", address], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"cannot listen on {address}" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_size_limit_is_enforced(tmp_path: Path) -> None:
    with running_server(tmp_path / "data", "--max-pack-bytes", "10000") as server, RemoteStore(server.url) as remote:
        with pytest.raises(PackstoreError, match="exceeds the limit"):
            remote.put(encode_pack(make_pack(tokens=500, dim=64)))
        assert remote.put(encode_pack(make_pack(tokens=2, dim=2)))[1] is True


def test_sigterm_lets_in_flight_streams_finish(tmp_path: Path) -> None:
    pack = make_pack(layers=8, tokens=4000, dim=64)
    with running_server(tmp_path / "data") as server:
        with RemoteStore(server.url) as remote:
            key, _ = remote.put(encode_pack(pack))
        stream = stub_for(server).GetPack(store_pb2.GetPackRequest(ref=key))
        header = next(stream)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        pieces = list(stream)  # the stream in flight completes
        assert sum(len(p.chunk.data) for p in pieces) == header.header.stored_bytes - len(header.header.header_json)
        assert server.process.wait(timeout=60) == 0
        with pytest.raises(grpc.RpcError):
            stub_for(server).StatPack(store_pb2.StatPackRequest(ref=key), timeout=2)


def test_many_concurrent_large_reads_keep_server_memory_bounded(tmp_path: Path) -> None:
    """16 slow readers of a ~100 MB pack: the server holds chunks, never whole packs, per stream. (One principal, this
    host's address, holds at most half the transfer slots: --workers 32 lets it hold 16.)"""
    pack = make_pack(layers=24, tokens=16000, dim=64)
    with running_server(tmp_path / "data", "--workers", "32") as server:
        with RemoteStore(server.url) as remote:
            key, _ = remote.put(encode_pack(pack))
            stored = remote.stat(key).stored_bytes
        rss = lambda: int(next(ln for ln in open(f"/proc/{server.process.pid}/status") if ln.startswith("VmRSS")).split()[1]) * 1024  # noqa: E731
        before, peak = rss(), [0]
        streams = [stub_for(server).GetPack(store_pb2.GetPackRequest(ref=key)) for _ in range(16)]
        headers = [next(s) for s in streams]  # every stream started; each now reads slowly
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for s in streams:
            for _ in s:
                pass
        done.set()
        sampler.join()
        assert len(headers) == 16
        assert peak[0] - before < 4 * stored, f"server grew by {(peak[0] - before) >> 20} MiB for 16 readers of a {stored >> 20} MiB pack"


def test_banks_over_the_service(server, remote) -> None:
    from packstore.kv.synthetic import synthetic_facts

    banks = open_banks(remote, TEST_BANK_CACHE)
    cases = synthetic_facts(120)
    meta = banks.build("remote-bank", [c.fact for c in cases])
    assert (meta.facts, meta.clusters) == (120, 6)
    routes = banks.route("remote-bank", [c.query for c in cases[:10]], top_k=2)
    assert sum(r.facts[0][0] == c.fact for r, c in zip(routes, cases)) >= 9
    assert all(len(r.clusters) == 5 for r in banks.route("remote-bank", [cases[0].query], mode="dense"))  # the default probe
    assert banks.add("remote-bank", ["The mill Xyloquent was built by Ferro."]).facts == 121
    assert banks.route("remote-bank", ["Xyloquent"], top_k=1, mode="lexical")[0].facts[0][0] == "The mill Xyloquent was built by Ferro."
    assert banks.list()[0][0].lexical == "bm25s/en/snowball" and banks.list()[0][0].vectors == "int8"  # the default
    assert banks.build("remote-fp16", [c.fact for c in cases[:40]], vectors="fp16").vectors == "fp16"
    assert banks.add("remote-fp16", ["The kiln Ostravel was fired by Mira."]).vectors == "fp16"
    banks.delete("remote-fp16")
    assert [m.name for m, _ in banks.list()] == ["remote-bank"] and banks.stored_bytes("remote-bank") / 121 < 1024
    stub = stub_for(server)
    with pytest.raises(grpc.RpcError) as info:
        stub.RouteQuery(store_pb2.RouteQueryRequest(name="remote-bank", queries=["Who?"], embedder="/etc"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the service" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.RouteQuery(store_pb2.RouteQueryRequest(name="remote-bank", queries=[" "]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.RouteQuery(store_pb2.RouteQueryRequest(name="remote-bank", queries=["Who?"], mode="fuzzy"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown route mode" in info.value.details()
    # the service reranks with the cross-encoder it holds (no model on the caller's side), and names it
    [crossed] = banks.route("remote-bank", [cases[3].query], top_k=2, rerank="cross")
    assert crossed.facts[0][0] == cases[3].fact and crossed.reranker == "cross" and len(crossed.reranker_fp) == 64
    [alone] = banks.route("remote-bank", [cases[3].query], top_k=2, rerank="cross", rerank_weight=0.0)  # the logit alone
    assert alone.facts[0][1] != crossed.facts[0][1] and alone.reranker == "cross"
    for rerank, message in (("lm", "which the store does not hold"), ("bogus", "unknown reranker 'bogus'")):
        with pytest.raises(grpc.RpcError) as info:
            stub.RouteQuery(store_pb2.RouteQueryRequest(name="remote-bank", queries=["Who?"], rerank=rerank))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
    onnx = banks.build("remote-bge", [c.fact for c in cases[:40]], "bge-small-en")  # torch-free on the server's side
    assert onnx.embedder == "bge-small-en" and banks.route("remote-bge", [cases[5].query], top_k=1)[0].facts[0][0] == cases[5].fact
    banks.delete("remote-bge")
    banks.delete("remote-bank")
    with pytest.raises(PackNotFound):
        banks.route("remote-bank", ["Who?"])
