"""Property-based hostile input (hypothesis) against every RPC of the pack service and against packctl
import: malformed, truncated, reordered or oversized messages, declared sizes far beyond the data,
decompression bombs, safetensors tables that lie, names with separators, control characters and huge
lengths. Every case gets a clear status (never INTERNAL or UNKNOWN), the server stays up with bounded
memory (anonymous and shared memory of its own memory cgroup, cgroup_helpers), and a refused call changes
nothing stored. About 560 cases in `make test-all`, 20 times as many in `make test-long`; the fast path (bulk
port, GetPack's bulk/layers/prefix, auth metadata, the Worker) is fuzzed in test_fuzz_fastpath.py."""

from __future__ import annotations

import dataclasses
import json
import struct

import grpc
import pytest
import zstandard
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from packstore.bank.bank import open_banks
from packstore.cli.packctl import main as packctl
from packstore.format.body import chunk_digest
from packstore.format.header import canonical_json, sha256_hex
from packstore.format.packfile import pack_file_parts
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.cgroup import memory_cgroup
from tests.helpers.fuzz import CLEAR, any_char, fuzz, texts
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

MAX_RESIDENT_MB = 1500  # the server's cgroup, anonymous + shared memory (cgroup_helpers); measured 395 MB short, 426 MB long
SCALE = {"short": 1, "long": 20}
counted = {"cases": 0}

hex64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    with memory_cgroup("packstore-fuzz", limit_bytes=4 << 30) as cgroup, running_server(  # (4 GiB: a runaway is OOM-killed in there)
        root / "data", "--max-chunk-bytes", str(8 << 20), cgroup=cgroup
    ) as server:
        server.cgroup = cgroup
        with RemoteStore(server.url, timeout=60) as store:
            store.put(encode_pack(make_pack(tokens=6)), name="base")
            open_banks(store, TEST_BANK_CACHE).build("kb", ["The lighthouse Zorel was founded in 1801.", "The bakery Mirtel opened in 1922."])
        channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
        yield server, store_pb2_grpc.PackStoreStub(channel), channel
        channel.close()


def state(server) -> tuple:
    """What the store holds: every key, the counts, the banks with their digests."""
    with RemoteStore(server.url, timeout=60) as store:
        banks = open_banks(store, TEST_BANK_CACHE)
        return tuple(store.keys()), store.counts(), tuple((m.name, m.facts, banks.digest(m.name)) for m, _ in banks.list())


def expect_clear(call, server, before) -> bool:
    """Run ``call``; a failure must be a clear status that left the store as it was. Returns whether it succeeded."""
    counted["cases"] += 1
    try:
        call()
        return True
    except grpc.RpcError as exc:
        assert exc.code() in CLEAR, f"{exc.code()}: {exc.details()}"
        assert exc.details(), exc.code()
    assert state(server) == before
    return False


# ---- PutPack: headers that lie, chunks out of order, sizes far beyond the data ----


def _sealed(record: dict) -> bytes:
    record = dict(record)
    record.pop("pack_sha256", None)
    record["pack_sha256"] = sha256_hex(canonical_json(record))
    return canonical_json(record)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(any_char, max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(any_char, max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def uploads(draw):
    encoded = encode_pack(make_pack(tokens=draw(st.integers(1, 40))))
    record = json.loads(encoded.header.to_json())
    how = draw(st.sampled_from(["field", "bytes", "declared", "chunks", "none"]))
    if how == "field":
        record[draw(st.sampled_from(sorted(record)))] = draw(json_values)
        header = _sealed(record) if draw(st.booleans()) else canonical_json(record)
    elif how == "bytes":
        header = draw(st.binary(max_size=2000))
    elif how == "declared":
        chunk = draw(st.integers(0, len(record["chunks"]) - 1))
        record["chunks"][chunk][draw(st.sampled_from(["stored_bytes", "raw_bytes"]))] = draw(st.sampled_from([0, 1, 2**31, 2**39, 2**40 - 1]))
        header = _sealed(record)
    else:
        header = encoded.header.to_json()
    messages = [store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=header, name=draw(st.one_of(st.just(""), texts))))]
    chunks = list(enumerate(encoded.chunks))
    if how == "chunks":
        chunks = draw(st.permutations(chunks))[: draw(st.integers(0, len(chunks) + 1))]
        if chunks and draw(st.booleans()):
            index, data = chunks[0]
            chunks[0] = (draw(st.integers(0, 10)), data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=20)))
    for index, data in chunks:
        messages.append(store_pb2.PutPackRequest(chunk=store_pb2.Chunk(index=index, data=data, digest=chunk_digest(data, "blake3"))))
    if draw(st.booleans()):
        messages.insert(draw(st.integers(0, len(messages))), store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=b"{}")))
    return messages, how


@pytest.mark.parametrize("scale", ["short", pytest.param("long", marks=pytest.mark.long)])
def test_put_pack(service, scale) -> None:
    server, stub, _ = service

    def check(case) -> None:
        messages, _ = case
        before = state(server)
        expect_clear(lambda: stub.PutPack(iter(messages), timeout=30), server, before)  # a valid upload may succeed

    fuzz(120 * SCALE[scale], uploads(), check)


# ---- every other RPC with hostile fields ----


@pytest.mark.parametrize("scale", ["short", pytest.param("long", marks=pytest.mark.long)])
def test_unary_rpcs(service, scale) -> None:
    server, stub, _ = service
    calls = st.one_of(
        st.builds(lambda r, m: ("StatPack", store_pb2.StatPackRequest(ref=r, model_fp=m)), texts, texts),
        st.builds(lambda r, m, t: ("GetPack", store_pb2.GetPackRequest(ref=r, model_fp=m, template_fp=t)), texts, texts, texts),
        st.builds(lambda s, t, m, n: ("ListPacks", store_pb2.ListPacksRequest(page_size=s, page_token=t, model_fp=m, name=n)),
                  st.integers(0, 2**32 - 1), texts, texts, texts),
        st.builds(lambda r, m: ("DeletePack", store_pb2.DeletePackRequest(ref=r, model_fp=m)), texts, texts),
        st.builds(lambda r, n, m: ("SetName", store_pb2.SetNameRequest(ref=r, name=n, model_fp=m)), texts, texts, texts),
        st.builds(lambda n, m: ("DeleteName", store_pb2.DeleteNameRequest(name=n, model_fp=m)), texts, texts),
        st.builds(lambda r: ("VerifyPacks", store_pb2.VerifyPacksRequest(refs=r)), st.lists(texts, max_size=4)),
        st.builds(lambda r, s: ("SignPack", store_pb2.SignPackRequest(ref=r, signature=s)), st.one_of(st.just("base"), texts),
                  st.one_of(texts, json_values.map(json.dumps))),
        st.builds(lambda n, q, k, p, e, md: ("RouteQuery", store_pb2.RouteQueryRequest(name=n, queries=q, top_k=k, probe=p, embedder=e, mode=md)),
                  st.one_of(st.just("kb"), texts), st.lists(texts, max_size=3), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                  st.one_of(st.just(""), texts), st.one_of(st.sampled_from(["", "dense", "lexical", "hybrid"]), texts)),
        st.builds(lambda n: ("StatBank", store_pb2.StatBankRequest(name=n)), texts),
        st.builds(lambda n, s: ("SignBank", store_pb2.SignBankRequest(name=n, signature=s)), st.one_of(st.just("kb"), texts), texts),
        st.builds(lambda n: ("DeleteBank", store_pb2.DeleteBankRequest(name=n)), texts.filter(lambda n: n != "kb")),
        st.just(("ListBanks", store_pb2.ListBanksRequest())),
        st.just(("StoreStats", store_pb2.StoreStatsRequest())),
    )

    def check(case) -> None:
        method, request = case
        before = state(server)
        rpc = getattr(stub, method)

        def call():
            reply = rpc(request, timeout=60)
            return list(reply) if method in ("GetPack", "VerifyPacks") else reply

        if expect_clear(call, server, before) and method in ("DeletePack", "DeleteName", "SetName"):
            with RemoteStore(server.url) as store:  # a hostile input that happened to be valid: put things back
                if "base" not in [n for s in store.list() for n in s.names]:
                    store.put(encode_pack(make_pack(tokens=6)), name="base")

    fuzz(300 * SCALE[scale], calls, check)


@pytest.mark.parametrize("scale", ["short", pytest.param("long", marks=pytest.mark.long)])
def test_bank_uploads(service, scale) -> None:
    server, stub, _ = service
    batches = st.lists(
        st.builds(lambda n, e, f, v: store_pb2.BankFacts(name=n, embedder=e, facts=f, vectors=v),
                  st.one_of(st.just("kb"), texts), st.one_of(st.just(""), texts), st.lists(st.text(max_size=50), max_size=3),
                  st.one_of(st.sampled_from(["", "fp16", "int8"]), texts)),
        max_size=3,
    )

    def check(messages) -> None:
        before = state(server)
        method = stub.AddFacts if messages and messages[0].name == "kb" else stub.BuildBank
        expect_clear(lambda: method(iter(messages), timeout=120), server, before)

    fuzz(40 * SCALE[scale], batches, check)


# ---- packctl import: damaged files, decompression bombs, safetensors tables that lie ----


def _bomb_chunk() -> bytes:
    """A byte-plane container whose zstd frame inflates far beyond what the header declares."""
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))
    return b"PSBP" + bytes([1, 4, 1]) + struct.pack("<BQQ", 1, 64 << 20, len(frame)) + frame


def _lying_table_chunk() -> bytes:
    table = json.dumps({"layers.0.key": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 16]}}).encode()
    plain = struct.pack("<Q", len(table)) + table + bytes(16)
    return b"PSBP" + bytes([1, 4, 1]) + struct.pack("<BQQ", 0, len(plain), len(plain)) + plain


@st.composite
def pack_files(draw):
    encoded = encode_pack(make_pack(tokens=draw(st.integers(1, 20)), layers=1))
    how = draw(st.sampled_from(["flip", "truncate", "insert", "bomb", "table"]))
    if how in ("bomb", "table"):
        chunk = _bomb_chunk() if how == "bomb" else _lying_table_chunk()
        info = dataclasses.replace(encoded.header.chunks[0], stored_bytes=len(chunk), digest=chunk_digest(chunk, "blake3"))
        encoded = dataclasses.replace(encoded, header=dataclasses.replace(encoded.header, chunks=(info,)), chunks=[chunk])
    data = bytearray(b"".join(pack_file_parts(encoded)))
    if how == "flip":
        where = draw(st.integers(0, len(data) - 1))
        data[where] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "insert":
        where = draw(st.integers(0, len(data)))
        data[where:where] = draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


@pytest.mark.parametrize("scale", ["short", pytest.param("long", marks=pytest.mark.long)])
def test_packctl_import(tmp_path_factory, capsys, scale) -> None:
    root = tmp_path_factory.mktemp("import-fuzz")
    store_path, file = root / "store", root / "case.pack"
    with LmdbStore(store_path) as store:
        store.put(encode_pack(make_pack(tokens=3)))
        before = store.keys()

    def check(data: bytes) -> None:
        counted["cases"] += 1
        file.write_bytes(data)
        code = packctl(["--store", str(store_path), "import", str(file)])
        err = capsys.readouterr().err
        assert code == 1 and err.startswith("packctl: error: ") and len(err.strip().splitlines()) == 1, err
        with LmdbStore(store_path, readonly=True) as store:
            assert store.keys() == before

    fuzz(100 * SCALE[scale], pack_files(), check)


@pytest.mark.parametrize("scale", ["short", pytest.param("long", marks=pytest.mark.long)])  # (so that `make test-long` checks too)
def test_the_server_stayed_up_with_bounded_memory(service, robustness_report, scale) -> None:
    server, _, channel = service
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING and server.process.poll() is None
    peak = server.cgroup.peak_bytes / 2**20  # everything the server held, its hot packs' shared memory included
    robustness_report.append(
        f"fuzz: {counted['cases']} hostile cases (RPCs and packctl import): 0 unclear statuses, server up, server {server.cgroup.report()}"
    )
    assert peak < MAX_RESIDENT_MB
