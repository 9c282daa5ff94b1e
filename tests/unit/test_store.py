"""The LMDB store: atomic idempotent puts, names, resolution, deletion, damage detection, growth."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from packstore.errors import AmbiguousRef, IntegrityError, InvalidInput, PackNotFound
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.helpers.packs import FP_A, make_pack, resealed


def other_model(pack, fp: str = "c" * 64):
    return dataclasses.replace(pack, header=dataclasses.replace(pack.header, model_fp=fp))


def test_put_get_round_trip(store_path: Path) -> None:
    pack = make_pack()
    with LmdbStore(store_path) as store:
        key, created = store.put(encode_pack(pack), name="alpha")
        assert created and key == pack.header.key
        decoded = decode_pack(PackReader(store).get("alpha"))
    assert all(torch.equal(a, b) for a, b in zip(pack.keys, decoded.keys))


def test_put_is_idempotent(store_path: Path) -> None:
    encoded = encode_pack(make_pack())
    with LmdbStore(store_path) as store:
        assert store.put(encoded)[1] is True
        later = dataclasses.replace(encoded, header=dataclasses.replace(encoded.header, created="2030-01-01T00:00:00Z"))
        key, created = store.put(later, name="again")
        assert created is False
        assert len(store.list()) == 1
        assert store.stat(key).header.created == encoded.header.created  # the first copy is kept
        assert store.stat(key).names == ("again",)


def test_store_persists_and_is_readable_from_another_process(store_path: Path) -> None:
    key = None
    with LmdbStore(store_path) as store:
        key, _ = store.put(encode_pack(make_pack()), name="persisted")
    code = (
        "import sys; from packstore.store import LmdbStore; from packstore.packs.reader import PackReader;"
        f"s = LmdbStore({str(store_path)!r}, readonly=True); p = PackReader(s).fetch('persisted');"
        "print(p.header.key)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == key


def test_names_are_per_model(store_path: Path) -> None:
    pack_a, pack_b = make_pack(), other_model(make_pack())
    with LmdbStore(store_path) as store:
        key_a, _ = store.put(encode_pack(pack_a), name="shared")
        key_b, _ = store.put(encode_pack(pack_b), name="shared")
        assert store.resolve("shared", model_fp=FP_A) == key_a
        assert store.resolve("shared", model_fp="c" * 64) == key_b
        with pytest.raises(AmbiguousRef, match="2 models"):
            store.resolve("shared")
        with pytest.raises(PackNotFound, match="for model"):
            store.resolve("shared", model_fp="d" * 64)


def test_name_moves_to_a_new_pack(store_path: Path) -> None:
    first, second = make_pack(tokens=5), make_pack(tokens=6)
    with LmdbStore(store_path) as store:
        store.put(encode_pack(first), name="latest")
        key, _ = store.put(encode_pack(second), name="latest")
        assert store.resolve("latest") == key
        assert store.stat(first.header.key).names == ()


def test_content_hash_prefix_resolves(store_path: Path) -> None:
    pack = make_pack()
    with LmdbStore(store_path) as store:
        key, _ = store.put(encode_pack(pack))
        assert store.resolve(pack.header.content_hash[:10]) == key
        with pytest.raises(PackNotFound):
            store.resolve("0000000000")


@pytest.mark.parametrize("name", ["", "has space", "a/b", "-lead", "x" * 129])
def test_invalid_names_are_refused(store_path: Path, name: str) -> None:
    with LmdbStore(store_path) as store:
        with pytest.raises(InvalidInput, match="invalid pack name"):
            store.put(encode_pack(make_pack()), name=name)
        assert store.list() == []


def test_delete_removes_pack_chunks_and_names(store_path: Path) -> None:
    keep, drop = make_pack(tokens=5), make_pack(tokens=7)
    with LmdbStore(store_path) as store:
        store.put(encode_pack(keep), name="keep")
        store.put(encode_pack(drop), name="drop")
        assert store.delete("drop") == drop.header.key
        assert [p.key for p in store.list()] == [keep.header.key]
        with pytest.raises(PackNotFound):
            store.resolve("drop")
        with pytest.raises(PackNotFound):
            store.delete("drop")
        assert decode_pack(PackReader(store).get("keep")).header.key == keep.header.key
    env = lmdb.open(str(store_path), max_dbs=8, readonly=True)
    with env.begin() as txn:
        chunk_keys = [k for k, _ in txn.cursor(db=env.open_db(b"chunks", txn=txn, create=False))]
    assert chunk_keys and all(k.startswith(keep.header.key.encode()) for k in chunk_keys)


def test_gc_keeps_every_chunk_of_a_stored_pack_whatever_bytes_its_index_holds(store_path: Path) -> None:
    """A chunk's key ends with its index in four bytes, and index 35 is the byte of ``#``: gc once took its key for
    another pack's and removed it as an orphan."""
    encoded = encode_pack(make_pack(layers=2, tokens=300, dim=4), block_positions=8)  # 2 x 38 chunks
    assert len(encoded.chunks) > 36
    with LmdbStore(store_path) as store:
        key, _ = store.put(encoded)
        assert store.gc().orphan_chunks == 0
        assert PackReader(store).get(key).chunks == encoded.chunks


def test_damaged_stored_chunk_is_refused_and_named(store_path: Path) -> None:
    pack = make_pack()
    with LmdbStore(store_path) as store:
        key, _ = store.put(encode_pack(pack), name="victim")
    env = lmdb.open(str(store_path), max_dbs=8)
    chunks_db = env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        chunk_key = next(k for k, _ in txn.cursor(db=chunks_db) if k.startswith(key.encode()))
        data = bytearray(txn.get(chunk_key, db=chunks_db))
        data[-1] ^= 0xFF
        txn.put(chunk_key, bytes(data), db=chunks_db)
    env.close()
    with LmdbStore(store_path) as store:
        with pytest.raises(IntegrityError, match=r"chunk \d+ .*damaged"):
            PackReader(store).get("victim")


def test_stored_header_breaking_a_field_rule_is_reported_by_verify(store_path: Path) -> None:
    """A header an older version stored without today's field checks: verify names it, listing still works."""
    pack = make_pack()
    with LmdbStore(store_path) as store:
        key, _ = store.put(encode_pack(pack), name="old")
        store.put(encode_pack(make_pack(tokens=7)), name="fine")
        header = store.stat(key).header
    env = lmdb.open(str(store_path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(key.encode(), resealed(header, model_name=123), db=env.open_db(b"packs", txn=txn))
    env.close()
    with LmdbStore(store_path) as store:
        results = {r.key: r.error for r in PackReader(store).verify_all()}
        assert "'model_name'" in results[key] and list(results.values()).count(None) == 1
        assert len(store.list()) == 2


def test_put_refuses_chunks_that_do_not_match_their_checksums(store_path: Path) -> None:
    encoded = encode_pack(make_pack())
    bad = dataclasses.replace(encoded, chunks=[encoded.chunks[0][::-1]] + encoded.chunks[1:])
    with LmdbStore(store_path) as store:
        with pytest.raises(IntegrityError, match="chunk 0"):
            store.put(bad)
        assert store.list() == []


def test_map_grows_when_full(store_path: Path) -> None:
    with LmdbStore(store_path, map_size=256 * 1024) as store:
        keys = [store.put(encode_pack(make_pack(tokens=200 + i, dim=64)))[0] for i in range(4)]
        assert sorted(p.key for p in store.list()) == sorted(keys)
        assert all(decode_pack(PackReader(store).get(k)).header.key == k for k in keys)


def test_readonly_open_of_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PackNotFound, match="no pack store"):
        LmdbStore(tmp_path / "absent", readonly=True)


def test_fetch_decodes_chunks_from_the_map_without_copying_them(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fetch`` hands the decoder memoryviews of LMDB's map (valid while its read transaction is open), so the
    stored bytes are not copied out before they are hashed and decoded; the pack, signed, comes out exact."""
    import packstore.format.body as body
    from packstore.packs.admin import sign_pack
    from packstore.security.trust import SigningKey, generate_key

    seen = []
    real = body.chunk_digest
    monkeypatch.setattr(body, "chunk_digest", lambda data, algorithm: seen.append(type(data)) or real(data, algorithm))
    pack = make_pack(tokens=40)
    with LmdbStore(store_path) as store:
        key, _ = store.put(encode_pack(pack, block_positions=16))
        signature = sign_pack(store, key, SigningKey.load(generate_key(store_path.parent / "signer")[0]))[1]
        seen.clear()  # the put's own hashes
        fetched = PackReader(store).fetch(key)  # reads the signatures too, in the same transaction
        assert seen and set(seen) == {memoryview}
        assert PackReader(store).get(key).signatures == (signature,)
    assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values))


def test_every_read_hashes_each_chunk_once(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk is verified once per hop: the store's read or the decoder, never both."""
    import packstore.format.body as body

    hashed = []
    real = body.chunk_digest
    monkeypatch.setattr(body, "chunk_digest", lambda data, algorithm: hashed.append(len(data)) or real(data, algorithm))
    encoded = encode_pack(make_pack(tokens=40), block_positions=16)  # 3 layers x 3 token blocks
    with LmdbStore(store_path) as store:
        key, _ = store.put(encoded)
        for read, chunks in (
            (lambda: PackReader(store).fetch(key), 9),
            (lambda: PackReader(store).fetch_part(key), 9),
            (lambda: PackReader(store).fetch_part(key, layers=(1, 1), prefix=20), 2),
            (lambda: PackReader(store).get(key), 9),
        ):
            hashed.clear()
            read()
            assert len(hashed) == chunks
