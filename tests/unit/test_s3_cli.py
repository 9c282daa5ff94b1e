"""``packctl --store s3://BUCKET/PREFIX``: admin work straight on a SeaweedFS bucket, and ``packctl migrate``
from a local store into the bucket and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packstore.cli.packctl import main
from packstore.format.body import EncodedPack
from packstore.store import LmdbStore
from packstore.tensors import encode_pack
from packstore.trust import SigningKey, generate_key
from test_s3_store import random_pack


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
    assert code == 0 and json.loads(out) == {"packs": 3, "copied": 3, "names_set": 2, "signatures_added": 0}
    code, out, _ = packctl(capsys, "--store", str(path), "migrate", "--to", url, "--json")
    assert code == 0 and json.loads(out) == {"packs": 3, "copied": 0, "names_set": 0, "signatures_added": 0}  # idempotent

    code, out, _ = packctl(capsys, "--store", url, "ls", "--json")
    listed = json.loads(out)
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
            a, b = original.get(key), copy.get(key)
            assert (a.header, a.chunks, a.signatures) == (b.header, b.chunks, b.signatures)
            assert original.stat(key).names == copy.stat(key).names
        assert all(r.ok for r in copy.verify_all())


def test_a_second_migrate_adds_only_missing_names_and_signatures(capsys, local, url, tmp_path) -> None:
    path, keys = local
    assert packctl(capsys, "--store", str(path), "migrate", "--to", url)[0] == 0
    signer = SigningKey.load(generate_key(tmp_path / "second")[0])
    with LmdbStore(path) as store:
        store.set_name(keys[2], "late-name")
        store.add_signature(keys[1], signer.sign("pack", store.stat(keys[1]).header.pack_sha256))
    code, out, _ = packctl(capsys, "--store", str(path), "migrate", "--to", url, "--json")
    assert code == 0 and json.loads(out) == {"packs": 3, "copied": 0, "names_set": 1, "signatures_added": 1}
    code, out, _ = packctl(capsys, "--store", url, "inspect", "late-name", "--json")
    assert code == 0 and json.loads(out)["key"] == keys[2]


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
    digest = json.loads(packctl(capsys, *where, "inspect", keys[0], "--json")[1])["chunks"][0]["sha256"]
    name = url.split("/", 3)[3] + f"/ns/default/chunks/{digest}"
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
