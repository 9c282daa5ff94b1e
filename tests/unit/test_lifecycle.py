"""Damage in the LMDB file is always detected; export/import; gc and compaction; crash-safe puts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch

from packstore.cli.packctl import main as packctl
from packstore.errors import IntegrityError, StoreBusy
from packstore.format.packfile import parse_pack_file
from packstore.packs.admin import export_pack, import_pack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.helpers import child_env
from tests.helpers.packs import flip_in_file, make_pack


def stored_pack(store_path: Path, **shape):
    encoded = encode_pack(make_pack(**shape))
    with LmdbStore(store_path) as store:
        store.put(encoded, name="victim")
    return encoded


def test_every_flipped_chunk_byte_in_the_lmdb_file_is_detected(store_path: Path) -> None:
    encoded = stored_pack(store_path, layers=2, tokens=64, dim=16)
    pristine = (store_path / "data.mdb").read_bytes()
    rng = random.Random(0)
    for index, chunk in enumerate(encoded.chunks):
        for at in sorted(rng.sample(range(len(chunk)), 6)) + [0, len(chunk) - 1]:
            (store_path / "data.mdb").write_bytes(pristine)
            flip_in_file(store_path / "data.mdb", chunk, at)
            with LmdbStore(store_path) as store:
                result = PackReader(store).verify("victim")
                assert not result.ok and f"chunk {index}" in result.error
                with pytest.raises(IntegrityError, match=f"chunk {index}"):
                    PackReader(store).get("victim")


def test_flipped_header_byte_is_detected(store_path: Path) -> None:
    encoded = stored_pack(store_path)
    header = encoded.header.to_json()
    flip_in_file(store_path / "data.mdb", header, header.index(b'"created"') + 14)
    with LmdbStore(store_path) as store:
        result = PackReader(store).verify_all()
    assert len(result) == 1 and not result[0].ok and "pack_sha256" in result[0].error


def test_packctl_verify_exit_codes(store_path: Path, capsys: pytest.CaptureFixture) -> None:
    encoded = stored_pack(store_path)
    assert packctl(["--store", str(store_path), "verify"]) == 0
    assert "ok" in capsys.readouterr().out
    flip_in_file(store_path / "data.mdb", encoded.chunks[1], 40)
    assert packctl(["--store", str(store_path), "verify", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report[0]["ok"] is False and "chunk 1" in report[0]["error"]
    assert packctl(["--store", str(store_path), "verify", "victim"]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_export_import_round_trip(tmp_path: Path, store_path: Path) -> None:
    encoded = stored_pack(store_path)
    with LmdbStore(store_path) as store:
        key, size = export_pack(store, "victim", tmp_path / "victim.pack")
    assert size == (tmp_path / "victim.pack").stat().st_size
    assert not list(tmp_path.glob(".*.partial"))
    with LmdbStore(tmp_path / "other") as other:
        stored, created = import_pack(other, tmp_path / "victim.pack", name="moved")
        assert created and stored.key == key and stored.names == ("moved",)
        assert import_pack(other, tmp_path / "victim.pack")[1] is False
        decoded = decode_pack(PackReader(other).get("moved"))
    original = decode_pack(encoded)
    assert all(torch.equal(a, b) for a, b in zip(original.values, decoded.values))


@pytest.mark.parametrize(
    "mangle,message",
    [
        (lambda d: d[:-10], "truncated"),
        (lambda d: d + b"junk", "unexpected bytes"),
        (lambda d: b"NOTAPACK" + d[8:], "bad magic"),
        (lambda d: d[:-100] + bytes([d[-100] ^ 1]) + d[-99:], "damaged"),
        (lambda d: d[:200] + bytes([d[200] ^ 1]) + d[201:], "pack_sha256|JSON|malformed"),
    ],
)
def test_bad_pack_files_are_refused_and_nothing_is_stored(tmp_path: Path, store_path: Path, mangle, message) -> None:
    stored_pack(store_path)
    with LmdbStore(store_path) as store:
        export_pack(store, "victim", tmp_path / "good.pack")
    (tmp_path / "bad.pack").write_bytes(mangle((tmp_path / "good.pack").read_bytes()))
    with LmdbStore(tmp_path / "other") as other:
        with pytest.raises(IntegrityError, match=message):
            import_pack(other, tmp_path / "bad.pack")
        assert other.list() == []


def test_pack_file_is_self_describing(tmp_path: Path, store_path: Path) -> None:
    encoded = stored_pack(store_path)
    with LmdbStore(store_path) as store:
        export_pack(store, "victim", tmp_path / "p.pack")
    parsed = parse_pack_file((tmp_path / "p.pack").read_bytes())
    assert parsed.header == encoded.header and parsed.chunks == encoded.chunks


def test_gc_removes_orphans_and_compaction_shrinks_the_file(store_path: Path) -> None:
    with LmdbStore(store_path) as store:
        keep = store.put(encode_pack(make_pack(tokens=5)), name="keep")[0]
        for tokens in range(40, 44):
            store.put(encode_pack(make_pack(tokens=tokens, dim=64)))
    env = lmdb.open(str(store_path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"f" * 64 + b"/" + b"f" * 64 + b"/" + b"f" * 64 + b"#\x00\x00\x00\x00", b"stray", db=env.open_db(b"chunks", txn=txn))
        txn.put(b"a" * 64 + b"/ghost", b"f" * 64 + b"/" + b"f" * 64 + b"/" + b"f" * 64, db=env.open_db(b"names", txn=txn))
    env.close()
    with LmdbStore(store_path) as store:
        for stored in store.list():
            if stored.key != keep:
                store.delete(stored.key)
        report = store.gc(compact=True)
        assert (report.orphan_chunks, report.orphan_chunk_bytes, report.dangling_names) == (1, 5, 1)
        assert report.file_bytes_after < report.file_bytes_before
        assert [p.key for p in store.list()] == [keep] and PackReader(store).verify("keep").ok
        store.put(encode_pack(make_pack(tokens=9)))  # still writable after the swap
        assert len(store.list()) == 2


def test_compaction_refuses_while_another_process_has_the_store(store_path: Path) -> None:
    stored_pack(store_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from packstore.store import LmdbStore; s = LmdbStore({str(store_path)!r}); print('open', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        with LmdbStore(store_path) as store:
            with pytest.raises(StoreBusy, match="another process"):
                store.gc(compact=True)
            assert PackReader(store).verify("victim").ok
    finally:
        holder.communicate("\n")


WRITER = """
import sys, torch
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from tests.helpers.packs import make_pack
store = LmdbStore({path!r})
for i in range(1000):
    encoded = encode_pack(make_pack(layers=24, tokens=1000 + i, dim=64))
    print("begin", i, flush=True)
    store.put(encoded, name=f"p{{i}}")
    print("done", i, flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03])
def test_writer_killed_mid_put_leaves_no_partial_pack(store_path: Path, delay: float) -> None:
    script = WRITER.format(path=str(store_path))
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=child_env())
    begun = 0
    for line in writer.stdout:
        if line.startswith("begin"):
            begun = int(line.split()[1])
            if begun >= 2:
                time.sleep(delay)
                os.kill(writer.pid, signal.SIGKILL)
                break
    writer.wait()
    with LmdbStore(store_path) as store:
        results = PackReader(store).verify_all()
        assert all(r.ok for r in results), results
        assert len(results) in (begun, begun + 1)  # the pack being written is whole or absent
        report = store.gc()
        assert report.orphan_chunks == 0 and report.dangling_names == 0
