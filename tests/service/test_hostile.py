"""Regression tests for the defects a hostile-input probe found (issue 12): each failed before its fix.

Every case gets a clear status or error naming the problem, the server stays up with bounded
memory, and nothing stored changes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from packstore.bank.bank import open_banks
from packstore.cli.packctl import main as packctl
from packstore.errors import IntegrityError, InvalidInput, LimitExceeded, PackstoreError
from packstore.format.body import chunk_digest
from packstore.format.header import canonical_json, sha256_hex
from packstore.format.packfile import FILE_MAGIC
from packstore.packs.admin import export_pack, import_pack
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

MIB = 1 << 20


def sealed(record: dict[str, Any]) -> bytes:
    """A header JSON whose seal matches whatever ``record`` now says (what a forger would send)."""
    record = {k: v for k, v in record.items() if k != "pack_sha256"}
    record["pack_sha256"] = sha256_hex(canonical_json(record))
    return canonical_json(record)


def forged(mutate: Callable[[dict], None], pack=None) -> tuple[bytes, list[bytes]]:
    """A real pack's header JSON, changed by ``mutate`` and resealed, with the pack's real chunks."""
    encoded = encode_pack(pack or make_pack())
    record = json.loads(encoded.header.to_json())
    mutate(record)
    return sealed(record), encoded.chunks


def pack_file(header_json: bytes, chunks: list[bytes]) -> bytes:
    return struct.pack("<8sIQ", FILE_MAGIC, 1, len(header_json)) + header_json + b"".join(chunks)


def set_field(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation setting ``record[a][b]...`` for a dotted path (list indexes as numbers)."""

    def mutate(record: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = record
        for part in parents:
            target = target[part]
        target[last] = value

    return mutate


BAD_FIELDS = [
    ("model_name", 123),
    ("model_name", "x" * 100_000),
    ("kind", ["knowledge"]),
    ("created", 5),
    ("raw", "yes"),
    ("layers", "3"),
    ("layers", 2**40),
    ("kv_heads", -1),
    ("head_dim", 1.5),
    ("dtype", "float64"),
    ("facts", [1, 2]),
    ("facts", "one fact"),
    ("parents", [7]),
    ("parents", ["not-a-key"]),
    ("codec", None),
    ("chunks.0.raw_bytes", 2**70),
    ("chunks.0.stored_bytes", -5),
    ("chunks.0.blake3", "zz"),
    ("chunks.0.first_layer", 1),
    ("chunks.1.stop_layer", 9),
    ("chunks", []),
    ("chunks.0", "chunk"),
]


def put_raw(server, header_json: bytes, chunks: list[bytes], name: str = "") -> store_pb2.PutPackResponse:
    stub = store_pb2_grpc.PackStoreStub(grpc.insecure_channel(server.address))

    def requests():
        yield store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=header_json, name=name))
        for index, data in enumerate(chunks):
            for start in range(0, max(len(data), 1), MIB):
                yield store_pb2.PutPackRequest(chunk=store_pb2.Chunk(index=index, data=data[start : start + MIB]))

    return stub.PutPack(requests())


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={str(v)[:12]}" for f, v in BAD_FIELDS])
def test_header_fields_are_checked_on_import(tmp_path: Path, field: str, value: Any) -> None:
    header_json, chunks = forged(set_field(field, value))
    (tmp_path / "bad.pack").write_bytes(pack_file(header_json, chunks))
    with LmdbStore(tmp_path / "store") as store:
        good, _ = store.put(encode_pack(make_pack(tokens=7)), name="good")
        with pytest.raises(InvalidInput, match=field.split(".")[0]):
            import_pack(store, tmp_path / "bad.pack")
        assert [p.key for p in store.list()] == [good]
    assert packctl(["--store", str(tmp_path / "store"), "ls", "--json"]) == 0


@pytest.mark.parametrize("field,value", BAD_FIELDS[:8] + BAD_FIELDS[15:17], ids=lambda v: str(v)[:12])
def test_header_fields_are_checked_on_put_pack(server, remote, field: str, value: Any) -> None:
    header_json, chunks = forged(set_field(field, value))
    before = remote.list()
    with pytest.raises(grpc.RpcError) as info:
        put_raw(server, header_json, chunks)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field.split(".")[0] in info.value.details()
    assert remote.list() == before


def test_a_declared_huge_chunk_is_refused_before_buffering(server, remote) -> None:
    """1 GiB declared for one chunk (the probe drove the server to 2.3 GB RSS): refused at the header."""

    def huge(record: dict) -> None:
        record["chunks"][0]["stored_bytes"] = 1 << 30

    header_json, _ = forged(huge)
    rss = lambda: int(next(ln for ln in open(f"/proc/{server.process.pid}/status") if ln.startswith("VmRSS")).split()[1]) << 10  # noqa: E731
    before = rss()
    with pytest.raises(grpc.RpcError) as info:
        put_raw(server, header_json, [b"\0" * (64 * MIB)])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "chunk 0" in info.value.details()
    assert rss() - before < 48 * MIB
    assert remote.list() == [] or all(p.stored_bytes < 1 << 30 for p in remote.list())


def test_more_bytes_than_declared_are_refused_as_they_arrive(server, remote) -> None:
    encoded = encode_pack(make_pack())
    chunks = [encoded.chunks[0] + b"\0" * (8 * MIB)] + encoded.chunks[1:]
    with pytest.raises(grpc.RpcError) as info:
        put_raw(server, encoded.header.to_json(), chunks)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "longer than" in info.value.details()


def test_the_chunk_limit_is_configurable(tmp_path: Path) -> None:
    pack = make_pack(tokens=600, dim=64)
    with running_server(tmp_path / "data", "--max-chunk-bytes", str(8 * 1024)) as server, RemoteStore(server.url) as remote:
        with pytest.raises(LimitExceeded, match="chunk 0 .* exceeds the chunk limit of 8192"):
            remote.put(encode_pack(pack))
        assert remote.list() == []


def bomb_chunk(plain_len: int) -> bytes:
    """A byte-plane container whose one zstd frame claims ``plain_len`` bytes and has no content size."""
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 4096)
    container = struct.pack("<4sBBB", b"PSBP", 1, 1, 2)
    container += struct.pack("<BQQ", 1, plain_len, len(frame)) + struct.pack("<BQQ", 0, 0, 0)
    return container + frame


def test_decompression_never_trusts_a_declared_size(tmp_path: Path) -> None:
    """A frame declaring 1 TiB used to end in a MemoryError traceback on import."""
    chunk = bomb_chunk(1 << 40)

    def mutate(record: dict) -> None:
        record["chunks"] = [{**record["chunks"][0], "stored_bytes": len(chunk), "blake3": chunk_digest(chunk, "blake3")}]
        record["layers"] = 1

    header_json, _ = forged(mutate, make_pack(layers=1))
    (tmp_path / "bomb.pack").write_bytes(pack_file(header_json, [chunk]))
    with LmdbStore(tmp_path / "store") as store:
        with pytest.raises((IntegrityError, InvalidInput), match="chunk 0"):
            import_pack(store, tmp_path / "bomb.pack")
        assert store.list() == []


def test_a_full_listing_page_fits_the_message_limit(tmp_path: Path) -> None:
    """1,000 packs of 2k tokens, each with many long names: every documented page size works."""
    data = tmp_path / "data"
    with LmdbStore(data) as store:
        base = encode_pack(make_pack(tokens=2048, dim=2, layers=1))

        def body(txn) -> None:
            import dataclasses

            for i in range(1000):
                header = dataclasses.replace(base.header, token_ids=(i,) + base.header.token_ids[1:])
                store._commit_in(txn, header, base.chunks.__getitem__, None)
                for n in range(40):
                    store._name_in(txn, header.model_fp, f"n{i}-{n}-" + "x" * 110, header.key)

        store._write(body)
    with running_server(data) as server, RemoteStore(server.url) as remote:
        page = remote.list_page(page_size=1000)
        assert 0 < len(page.packs) <= 1000 and all(len(p.names) == 40 for p in page.packs)
        assert len(remote.list()) == 1000


BAD_NAMES = ["okname\n", "a/b", "a\x00b", " lead", "trail ", "in side", "ünïcode", "x" * 10_000, "", "-dash", "tab\t"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:14] for n in BAD_NAMES])
def test_bad_names_are_refused_on_every_way_in(tmp_path: Path, server, remote, name: str) -> None:
    encoded = encode_pack(make_pack(tokens=3))
    with LmdbStore(tmp_path / "store") as store:
        with pytest.raises(InvalidInput, match="invalid pack name"):
            store.put(encoded, name=name)
        key, _ = store.put(encoded)
        with pytest.raises(InvalidInput, match="invalid pack name"):
            store.set_name(key, name)
        export_pack(store, key, tmp_path / "p.pack")
        with pytest.raises(InvalidInput, match="invalid pack name"):
            import_pack(store, tmp_path / "p.pack", name=name)
        with pytest.raises(InvalidInput, match="invalid"):
            open_banks(store, TEST_BANK_CACHE).build(name, ["a fact"])
        assert [p.names for p in store.list()] == [()]
    with pytest.raises(PackstoreError, match="invalid pack name"):
        remote.put(encoded, name=name)
    key, _ = remote.put(encoded)
    with pytest.raises(PackstoreError, match="invalid pack name"):
        remote.set_name(key, name)
    assert remote.stat(key).names == ()
    remote.delete(key)
