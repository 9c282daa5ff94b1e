"""Stores and pack files written before format version 4 (sha256 chunk digests), and before codec byteplane-3,
read unchanged.

tests/data/version3 was written by packstore at commit dcd4730 (its make_store.py says how): an exact pack
with a signature, an exact pack in token blocks, a RoPE-spliced composition (version 2) and a steering
pack (version 3), and the exported pack file of the first. tests/data/codec2 was written at commit 368c20e,
the last before codec byteplane-3: packs in codec byteplane-zstd-2 in float32, bfloat16 and float16, whole
and in token blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from packstore.cli.packctl import main as packctl
from packstore.packs.admin import export_pack, import_pack
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.data.codec2 import make_codec2_store as codec2  # the seeded packs tests/data/codec2 holds
from tests.data.version3.make_store import knowledge, steering  # the seeded packs tests/data/version3 holds

DATA = Path(__file__).resolve().parents[1] / "data" / "version3"
CODEC2 = Path(__file__).resolve().parents[1] / "data" / "codec2"

EXPECTED = {"v1-exact": (1, knowledge(5, 1)), "v1-blocks": (1, knowledge(40, 2)), "v2-rope": (2, knowledge(7, 4)), "v3-steering": (3, steering())}


@pytest.fixture
def old_store(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "store", tmp_path / "store")
    return tmp_path / "store"


def test_a_version_3_store_reads_verifies_and_takes_version_4_packs_in_the_new_codec(old_store: Path, tmp_path: Path) -> None:
    with LmdbStore(old_store) as store:
        for name, (version, expected) in EXPECTED.items():
            encoded = PackReader(store).get(name)
            record = json.loads(encoded.header.to_json())
            assert record["version"] == version and all("sha256" in chunk for chunk in record["chunks"])
            assert record["codec"] == "byteplane-zstd"  # container version 1 (docs/format.md §1.4), still read
            pack = decode_pack(encoded)
            assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, expected.keys + expected.values))
        assert len(PackReader(store).get("v1-exact").signatures) == 1 and PackReader(store).get("v1-exact").signatures[0].digest == PackReader(store).get("v1-exact").header.pack_sha256
        assert len(PackReader(store).get("v1-blocks").header.chunks) == 9  # 3 layers x 3 token blocks of 16 positions
        new, created = store.put(encode_pack(knowledge(6, 5)), name="v4-exact")
        assert created and json.loads(store.stat(new).header.to_json())["version"] == 4
        assert store.stat(new).header.codec == "byteplane-3"
        assert torch.equal(decode_pack(PackReader(store).get(new)).keys[1], knowledge(6, 5).keys[1])
        old_copy = export_pack(store, "v2-rope", tmp_path / "v2-rope.pack")
        assert old_copy[0] == store.stat("v2-rope").header.key
    assert packctl(["--store", str(old_store), "verify"]) == 0


def test_a_version_3_pack_file_imports_with_its_signature(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "fresh") as store:
        stored, created = import_pack(store, DATA / "v1-exact.pack")
        assert created and stored.header.version == 1 and len(stored.signatures) == 1
        pack = decode_pack(PackReader(store).get(stored.header.key))
        assert torch.equal(pack.values[2], EXPECTED["v1-exact"][1].values[2])


def test_a_store_in_codec_byteplane_zstd_2_reads_bit_exact_and_takes_byteplane_3_packs(tmp_path: Path) -> None:
    shutil.copytree(CODEC2 / "store", tmp_path / "store")
    expected = codec2.expected_packs()
    with LmdbStore(tmp_path / "store") as store:
        for name, pack in expected.items():
            stored = store.stat(name).header
            assert stored.codec == "byteplane-zstd-2" and stored.dtype == pack.header.dtype
            fetched = PackReader(store).fetch(name)
            assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values))
            part = PackReader(store).fetch_part(name, layers=(1, 1), prefix=7)
            assert torch.equal(part.values[0], pack.values[1][:, :7])
        assert len(store.stat("f16-blocks").header.chunks) == 2 * 3  # 2 layers x 3 token blocks of 16 positions
        again = encode_pack(expected["f16"])
        assert again.header.codec == "byteplane-3" and again.header.key == store.stat("f16").header.key
        _, created = store.put(again)
        assert not created  # same key: the stored pack stays as it was, in its own codec
        assert store.stat("f16").header.codec == "byteplane-zstd-2"
        fresh = codec2.knowledge("float16", 300, 9)
        key, created = store.put(encode_pack(fresh), name="f16-new")
        assert created and store.stat(key).header.codec == "byteplane-3"
        assert torch.equal(PackReader(store).fetch(key).keys[0], fresh.keys[0])
    assert packctl(["--store", str(tmp_path / "store"), "verify"]) == 0


def test_every_older_container_joins_on_the_device_bit_exact(old_store: Path, tmp_path: Path) -> None:
    """Containers of versions 1 and 2 (a steering pack's whole tensors among them) through ``join_on_device``."""
    shutil.copytree(CODEC2 / "store", tmp_path / "codec2")
    with Decoder(workers=2, buffers=HostBuffers(join_on_device=True)) as decoder:
        for path, expected in ((old_store, {name: pack for name, (_, pack) in EXPECTED.items()}), (tmp_path / "codec2", codec2.expected_packs())):
            with LmdbStore(path) as store:
                for name, pack in expected.items():
                    fetched = PackReader(store, decoder).fetch(name)
                    assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values)), name
