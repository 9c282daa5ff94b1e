"""``packctl --store s3://BUCKET/PREFIX``: admin work straight on a SeaweedFS bucket, and ``packctl migrate``
of packs and banks from a local store into the bucket and back."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import pytest

from packstore.answering.api import sign_bank
from packstore.bank.bank import open_banks
from packstore.cli.packctl import main
from packstore.format.body import EncodedPack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.security.trust import SigningKey, generate_key
from packstore.store import LmdbStore
from packstore.store.objects.store import ObjectStore
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.s3 import FACTS, random_pack

NO_BANKS = {"banks": 0, "banks_copied": 0, "bank_signatures_added": 0, "banks_skipped": []}


def packctl(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def local(tmp_path: Path, model_fp: str) -> tuple[Path, list[str]]:
    """A local store of three packs, two of them named and one signed; returns its path and the keys."""
    signer = SigningKey.load(generate_key(tmp_path / "key")[0])
    with LmdbStore(tmp_path / "local") as store:
        keys = []
        for seed in range(3):
            encoded = encode_pack(random_pack(model_fp, seed))
            if seed == 0:
                encoded = EncodedPack(encoded.header, encoded.chunks, (signer.sign("pack", encoded.header.pack_sha256),))
            keys.append(store.put(encoded, name=f"pack-{seed}" if seed < 2 else None)[0])
    return tmp_path / "local", keys


def test_migrate_a_local_store_into_a_bucket_and_back(capsys, local, url, tmp_path) -> None:
    path, keys = local
    code, out, _ = packctl(capsys, "--store", str(path), "migrate", "--to", url, "--json")
    assert code == 0 and json.loads(out) == {"packs": 3, "copied": 3, "names_set": 2, "signatures_added": 0} | NO_BANKS
    code, out, _ = packctl(capsys, "--store", str(path), "migrate", "--to", url, "--json")
    assert code == 0 and json.loads(out) == {"packs": 3, "copied": 0, "names_set": 0, "signatures_added": 0} | NO_BANKS  # idempotent

    code, out, _ = packctl(capsys, "--store", url, "ls", "--json")
    listed = json.loads(out)["packs"]
    assert code == 0 and sorted(p["key"] for p in listed) == sorted(keys)
    assert {p["key"]: p["names"] for p in listed}[keys[0]] == ["pack-0"]
    code, out, _ = packctl(capsys, "--store", url, "inspect", "pack-1", "--json")
    assert code == 0 and json.loads(out)["key"] == keys[1]
    code, out, _ = packctl(capsys, "--store", url, "verify", "--trusted-keys", str(tmp_path / "key.pub"), keys[0])
    assert code == 0 and out.split() == ["ok", keys[0]]

    back = tmp_path / "back"
    code, out, _ = packctl(capsys, "--store", url, "migrate", "--to", str(back), "--json")
    assert code == 0 and json.loads(out)["copied"] == 3
    with LmdbStore(path, readonly=True) as original, LmdbStore(back, readonly=True) as copy:
        for key in keys:
            a, b = PackReader(original).get(key), PackReader(copy).get(key)
            assert (a.header, a.chunks, a.signatures) == (b.header, b.chunks, b.signatures)
            assert original.stat(key).names == copy.stat(key).names
        assert all(r.ok for r in PackReader(copy).verify_all())


def test_a_second_migrate_adds_only_missing_names_and_signatures(capsys, local, url, tmp_path) -> None:
    path, keys = local
    assert packctl(capsys, "--store", str(path), "migrate", "--to", url)[0] == 0
    signer = SigningKey.load(generate_key(tmp_path / "second")[0])
    with LmdbStore(path) as store:
        store.set_name(keys[2], "late-name")
        store.add_signature(keys[1], signer.sign("pack", store.stat(keys[1]).header.pack_sha256))
    code, out, _ = packctl(capsys, "--store", str(path), "migrate", "--to", url, "--json")
    assert code == 0 and json.loads(out) == {"packs": 3, "copied": 0, "names_set": 1, "signatures_added": 1} | NO_BANKS
    code, out, _ = packctl(capsys, "--store", url, "inspect", "late-name", "--json")
    assert code == 0 and json.loads(out)["key"] == keys[2]


def _as_an_older_version_wrote_it(path: Path, name: str) -> None:
    """Make bank ``name`` of the store at ``path`` one built before the full-text index: no lexical record, and
    metadata without the fields added later (so re-encoding it would change its bytes, and the bank's digest)."""
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        db = env.open_db(b"banks", txn=txn)
        txn.delete(f"lexical/{name}".encode(), db=db)
        meta = json.loads(txn.get(f"meta/{name}".encode(), db=db))
        txn.put(f"meta/{name}".encode(), json.dumps({k: v for k, v in meta.items() if k not in ("lexical", "vectors")}).encode(), db=db)
    env.close()


@pytest.fixture
def banked(local: tuple[Path, list[str]], tmp_path: Path) -> Path:
    """The local store with two banks besides its packs: "lockers", signed with ``tmp_path/bank-key``, and
    "older" as an earlier version wrote it."""
    path, _ = local
    with LmdbStore(path) as store:
        open_banks(store, TEST_BANK_CACHE).build("lockers", FACTS)
        open_banks(store, TEST_BANK_CACHE).build("older", FACTS[:20])
        sign_bank(store, "lockers", SigningKey.load(generate_key(tmp_path / "bank-key")[0]))
    _as_an_older_version_wrote_it(path, "older")
    return path


def _routes(store, name: str) -> list[dict]:
    return [r.to_json() for r in open_banks(store, TEST_BANK_CACHE).route(name, ["Which umbrella is in locker 13?", "guest 207"], top_k=3)]


def test_migrate_copies_banks_into_a_bucket_and_back_with_their_digests(capsys, banked, url, tmp_path) -> None:
    code, out, _ = packctl(capsys, "--store", str(banked), "migrate", "--to", url, "--json")
    assert code == 0 and json.loads(out) == {
        "packs": 3, "copied": 3, "names_set": 2, "signatures_added": 0, "banks": 2, "banks_copied": 2, "bank_signatures_added": 1, "banks_skipped": []
    }
    with LmdbStore(banked) as store:  # a signature made after the copy is added by the next run, nothing else
        sign_bank(store, "older", SigningKey.load(tmp_path / "bank-key"))
    code, out, _ = packctl(capsys, "--store", str(banked), "migrate", "--to", url, "--json")
    report = json.loads(out)
    assert code == 0 and (report["copied"], report["banks_copied"], report["bank_signatures_added"]) == (0, 0, 1)
    code, out, err = packctl(capsys, "--store", str(banked), "migrate", "--to", url)
    assert code == 0 and "2 banks: 0 copied, 2 already there; 0 signatures added" in out and "present  bank lockers" in err

    back = tmp_path / "back"
    code, out, _ = packctl(capsys, "--store", url, "migrate", "--to", str(back), "--json")
    report = json.loads(out)
    assert code == 0 and (report["banks_copied"], report["bank_signatures_added"]) == (2, 2)
    with LmdbStore(banked, readonly=True) as original, LmdbStore(back, readonly=True) as copy, ObjectStore(url, cache_dir=tmp_path / "c") as bucket:
        for name in ("lockers", "older"):
            assert open_banks(bucket, TEST_BANK_CACHE).digest(name) == open_banks(copy, TEST_BANK_CACHE).digest(name) == open_banks(original, TEST_BANK_CACHE).digest(name)
            assert copy.bank_records(name) == bucket.bank_records(name) == original.bank_records(name)
            assert copy.bank_signatures(name) == original.bank_signatures(name) and len(copy.bank_signatures(name)) == 1
            assert _routes(bucket, name) == _routes(copy, name) == _routes(original, name)
        assert original.bank_lexical("older") is None and copy.bank("older").lexical == ""
    code, out, _ = packctl(capsys, "--store", str(back), "bank", "verify", "--trusted-keys", str(tmp_path / "bank-key.pub"))
    assert code == 0, out


def test_a_bank_of_the_same_name_with_other_contents_stops_migrate(capsys, banked, url, tmp_path) -> None:
    with ObjectStore(url, cache_dir=tmp_path / "c") as bucket:
        open_banks(bucket, TEST_BANK_CACHE).build("older", FACTS[20:])
        theirs = bucket.bank_records("older")
    code, _, err = packctl(capsys, "--store", str(banked), "migrate", "--to", url)
    assert code == 1 and "'older'" in err and "'lockers'" not in err and "never replaces a bank, so nothing was copied" in err
    with ObjectStore(url, cache_dir=tmp_path / "d") as bucket:
        assert bucket.bank_records("older") == theirs and [m.name for m in bucket.bank_metas()] == ["older"] and bucket.list() == []


def test_admin_commands_on_a_bucket(capsys, local, url, seaweed, tmp_path, monkeypatch) -> None:
    path, keys = local
    assert packctl(capsys, "--store", str(path), "export", "pack-0", "-o", str(tmp_path / "p.pack"))[0] == 0
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")  # the endpoint from the flag instead
    where = ("--store", url, "--s3-endpoint", seaweed.endpoint)
    code, out, _ = packctl(capsys, *where, "import", str(tmp_path / "p.pack"), "--name", "imported")
    assert code == 0 and out.strip() == keys[0]
    code, out, _ = packctl(capsys, *where, "export", "imported", "-o", str(tmp_path / "again.pack"))
    assert code == 0 and (tmp_path / "again.pack").read_bytes() == (tmp_path / "p.pack").read_bytes()
    assert packctl(capsys, *where, "rm", "imported")[0] == 0
    code, out, _ = packctl(capsys, *where, "gc", "--json")
    assert code == 0 and json.loads(out)["orphan_chunks"] == 0  # the chunks are younger than the grace period
    code, _, err = packctl(capsys, *where, "gc", "--compact")
    assert code == 1 and "nothing to compact" in err

    assert packctl(capsys, *where, "import", str(tmp_path / "p.pack"))[0] == 0
    digest = json.loads(packctl(capsys, *where, "inspect", keys[0], "--json")[1])["chunks"][0]["blake3"]
    name = url.split("/", 3)[3] + f"/ns/default/chunks/blake3-{digest}"
    seaweed.client().put_object(Bucket=seaweed.bucket, Key=name, Body=b"damaged")
    code, out, err = packctl(capsys, *where, "verify")
    assert code == 1 and out.startswith(f"DAMAGED    {keys[0]}") and "1 damaged" in err
    code, _, err = packctl(capsys, *where, "backup", str(tmp_path / "bk"))
    assert code == 1 and "packctl migrate" in err


def test_bucket_problems_are_one_line(capsys, seaweed, monkeypatch) -> None:
    code, _, err = packctl(capsys, "--store", "s3://no-such-bucket/x", "ls")
    assert code == 1 and err.startswith("packctl: error: bucket 'no-such-bucket'") and "does not exist" in err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    code, _, err = packctl(capsys, "--store", f"s3://{seaweed.bucket}/x", "ls")
    assert code == 1 and "refused access" in err


def test_a_damaged_bank_in_the_source_is_not_copied(capsys, banked, url, tmp_path) -> None:
    env = lmdb.open(str(banked), max_dbs=8)
    with env.begin(write=True) as txn:
        db = env.open_db(b"banks", txn=txn)
        key = next(k for k, _ in txn.cursor(db=db) if k.startswith(b"cluster/lockers/"))
        txn.put(key, txn.get(key, db=db)[:-1] + b"\0", db=db)
    env.close()
    code, _, err = packctl(capsys, "--store", str(banked), "migrate", "--to", url)
    assert code == 1 and "bank 'lockers': record cluster/lockers/" in err and "damaged" in err
    with ObjectStore(url, cache_dir=tmp_path / "c") as bucket:
        assert "lockers" not in [m.name for m in bucket.bank_metas()]
