"""Format version 5: a pack whose K/V a serving engine computed records the engine, and the engine is part of its key
(docs/format.md §1.1, §7). A version-4 reader refuses it naming the version; this build reads every older pack."""

from __future__ import annotations

import dataclasses
import json

import pytest

from packstore.errors import IntegrityError, InvalidInput
from packstore.format import header as header_module
from packstore.format.header import PackHeader, canonical_json, sha256_hex
from packstore.packs.tensors import decode_pack, encode_pack
from tests.helpers.packs import make_pack

ENGINE = {"name": "vllm", "version": "0.32.0", "block_size": 32}


def engine_pack(**engine):
    pack = make_pack(tokens=40)
    pack.header = dataclasses.replace(pack.header, engine={**ENGINE, **engine}, built_on={"device": "cpu", "dtype": "float32"})
    return pack


def resealed(header: PackHeader, **changes) -> bytes:
    """The header's JSON with ``changes`` applied and the seal recomputed (a writer that broke a rule)."""
    record = json.loads(header.to_json())
    record.pop("pack_sha256")
    for name, value in changes.items():
        if value is None:
            record.pop(name, None)
        else:
            record[name] = value
    record["pack_sha256"] = sha256_hex(canonical_json(record))
    return canonical_json(record)


def test_an_engine_built_pack_is_version_5_with_its_own_key_and_reads_back() -> None:
    plain, built = make_pack(tokens=40), engine_pack()
    encoded = encode_pack(built)
    assert encoded.header.version == 5 and encode_pack(plain).header.version == 4
    assert built.header.token_ids == plain.header.token_ids and built.header.key != plain.header.key
    assert engine_pack(block_size=64).header.key != built.header.key  # the whole engine record is in the recipe
    parsed = PackHeader.from_json(encoded.header.to_json())
    assert parsed.engine == ENGINE and parsed.key == built.header.key
    assert all(a.equal(b) for a, b in zip(decode_pack(encoded).keys, built.keys))


def test_a_version_4_reader_refuses_version_5_naming_it(monkeypatch) -> None:
    data = encode_pack(engine_pack()).header.to_json()
    monkeypatch.setattr(header_module, "READ_VERSIONS", (1, 2, 3, 4))
    monkeypatch.setattr(header_module, "FORMAT_VERSION", 4)
    with pytest.raises(IntegrityError, match=r"pack format version 5 is not supported \(this build reads versions 1 to 4\)"):
        header_module.PackHeader._parse(data)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 4}, "engine.*is in exactly the version-5 headers"),
        ({"engine": None}, "engine.*is in exactly the version-5 headers"),
        ({"engine": {**ENGINE, "name": "sglang"}}, "engine.name"),
        ({"engine": {**ENGINE, "block_size": 0}}, "engine.block_size"),
        ({"engine": {"name": "vllm"}}, "exactly the fields block_size, name, version"),
    ],
)
def test_engine_fields_are_checked(changes, message) -> None:
    encoded = encode_pack(engine_pack())
    with pytest.raises((IntegrityError, InvalidInput), match=message):
        PackHeader._parse(resealed(encoded.header, **changes))


def test_only_an_exact_knowledge_pack_has_an_engine() -> None:
    pack = engine_pack()
    parents = (pack.header.key, make_pack(tokens=3).header.key)
    header = dataclasses.replace(pack.header, composition="rope", parents=parents)
    with pytest.raises(InvalidInput, match="engine"):
        header.validate()
