"""Format version 6: ``built_on`` names the machine and software that computed a pack's K/V (torch's version; on CUDA the
GPU model, compute capability, SM count and CUDA version; on CPU the vector instruction set), and the exactness mode
when not the default (docs/format.md §1.1, §7). Packs written before it (``built_on`` with only the device type and
dtype, tests/data/version5) read unchanged; a version-5 reader refuses version 6 naming it; the key stays the content's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from packstore.cli.packctl import main as packctl
from packstore.errors import IntegrityError, InvalidInput
from packstore.format import header as header_module
from packstore.format.header import PackHeader
from packstore.kv.build import build_pack, built_on
from packstore.kv.compose import compose_exact, extend, splice
from packstore.kv.exactness import exactness, machine
from packstore.packs.admin import import_pack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.data.version5.make_packs import packs as version5_packs  # the seeded packs tests/data/version5 holds
from tests.helpers.packs import make_pack, resealed

VERSION5 = Path(__file__).resolve().parents[1] / "data" / "version5"
H200 = {"device": "cuda", "dtype": "bfloat16", "torch": "2.11.0+cu130", "gpu": "NVIDIA H200", "capability": "9.0", "sms": 132, "cuda": "13.0"}
CPU = {"device": "cpu", "dtype": "float32", "torch": "2.13.0+cpu", "capability": "AVX512"}


def recorded(built: dict | None, **fields) -> PackHeader:
    """A stored (encoded) synthetic pack's header recording ``built``."""
    pack = make_pack(tokens=6)
    pack.header = dataclasses.replace(pack.header, prefill_chunks=(0, 4, 6), built_on=built, **fields)
    return encode_pack(pack).header


@pytest.mark.parametrize("built", [H200, CPU, {**H200, "exactness": "deterministic+sdpa-math"}, {"device": "mps", "dtype": "float16", "torch": "2.13.0"}])
def test_a_header_naming_the_machine_is_version_6_and_round_trips(built: dict) -> None:
    header = recorded(built)
    record = json.loads(header.to_json())
    assert record["version"] == 6 and record["built_on"] == built
    again = PackHeader.from_json(header.to_json())
    assert again == header and again.built_on == built and again.to_json() == header.to_json()


def test_the_machine_is_not_the_key_so_packs_of_the_same_content_share_it() -> None:
    """The spec (§2) keys a pack by what it holds, on every machine alike: the same tokens built on an H100 and an H200
    (or on no recorded machine) are one key, and the store keeps the first; built_on says which machine that was."""
    h100 = {**H200, "gpu": "NVIDIA H100 80GB HBM3", "sms": 132}
    keys = {recorded(built).key for built in (H200, h100, CPU, {"device": "cuda", "dtype": "bfloat16"}, None)}
    assert len(keys) == 1
    assert recorded(H200).pack_sha256 != recorded(h100).pack_sha256  # the seal covers it: built_on is not forgeable


def test_a_build_here_records_this_machine() -> None:
    here = machine(torch.device("cpu"))
    assert here == {"device": "cpu", "torch": str(torch.__version__), "capability": torch.backends.cpu.get_cpu_capability()}
    assert type(here["torch"]) is str  # torch's TorchVersion is a str subclass, which the header refuses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_machine_is_the_gpu_model_capability_sms_and_versions() -> None:
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    here = machine(device)
    assert here == {
        "device": "cuda", "torch": str(torch.__version__), "gpu": props.name, "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count, "cuda": torch.version.cuda or f"hip {torch.version.hip}",
    }
    assert recorded({**here, "dtype": "bfloat16"}).version == 6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"built_on": {k: v for k, v in H200.items() if k != "sms"}}, "'built_on' must be an object with exactly the fields capability, cuda, device, dtype, gpu, sms, torch"),
        ({"built_on": {**H200, "sms": 0}}, "'built_on.sms' must be an integer from 1 to 65536"),
        ({"built_on": {**H200, "sms": "132"}}, "'built_on.sms' must be an integer"),
        ({"built_on": {**H200, "sms": True}}, "'built_on.sms' must be an integer"),
        ({"built_on": {**H200, "capability": "9"}}, "'built_on.capability' must be major.minor"),
        ({"built_on": {**H200, "gpu": ""}}, "'built_on.gpu' must be a string of 1 to 256 characters"),
        ({"built_on": {**H200, "gpu": "x" * 257}}, "'built_on.gpu' must be a string of 1 to 256"),
        ({"built_on": {**H200, "cuda": 13.0}}, "'built_on.cuda' must be a string"),
        ({"built_on": {**H200, "torch": ""}}, "'built_on.torch' must be a string of 1 to 64"),
        ({"built_on": {**H200, "exactness": "fast"}}, "'built_on.exactness' must be one of 'deterministic'"),
        ({"built_on": {**H200, "exactness": "default"}}, "'built_on.exactness' must be one of 'deterministic'"),  # the default is absence
        ({"built_on": {**H200, "driver": "580"}}, "'built_on' must be an object with exactly the fields"),
        ({"built_on": {**CPU, "capability": "AVX 2"}}, "'built_on.capability' must be a vector instruction set"),
        ({"built_on": {**CPU, "gpu": "NVIDIA H200"}}, "'built_on' must be an object with exactly the fields capability, device, dtype, torch"),
        ({"built_on": {**CPU, "device": "CPU"}}, "'built_on.device' must be a device type"),
        ({"built_on": {**CPU, "dtype": "float64"}}, "'built_on.dtype' must be one of"),
        ({"built_on": {"device": "cuda", "dtype": "bfloat16"}}, "'built_on' names the machine .* in exactly the version-6 headers"),
        ({"built_on": None}, "'built_on' names the machine .* in exactly the version-6 headers"),
        ({"version": 4}, "'built_on' names the machine .* in exactly the version-6 headers"),
    ],
)
def test_bad_machine_records_are_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises((InvalidInput, IntegrityError), match=message):
        PackHeader.from_json(resealed(recorded(H200), **changes))


def test_a_header_built_in_python_is_checked_alike() -> None:
    pack = make_pack(tokens=6)
    with pytest.raises(InvalidInput, match="'built_on.sms' must be an integer from 1 to 65536"):
        dataclasses.replace(pack.header, built_on={**H200, "sms": 0}).validate()
    not_stored = "'built_on' must be an object with exactly the fields device, dtype in a version-1 header (with torch: version 6)"
    with pytest.raises(InvalidInput, match=re.escape(not_stored)):  # no torch: the machine's fields without the version that holds them
        dataclasses.replace(pack.header, built_on={"device": "cuda", "dtype": "bfloat16", "gpu": "NVIDIA H200"}).validate()


def test_a_version_5_reader_refuses_version_6_naming_it(monkeypatch) -> None:
    data = recorded(H200).to_json()
    monkeypatch.setattr(header_module, "READ_VERSIONS", (1, 2, 3, 4, 5))
    monkeypatch.setattr(header_module, "FORMAT_VERSION", 5)
    with pytest.raises(IntegrityError, match=r"pack format version 6 is not supported \(this build reads versions 1 to 5\)"):
        header_module.PackHeader._parse(data)


def test_an_engine_built_pack_naming_the_machine_is_version_6_and_keeps_its_engine_key() -> None:
    engine = {"name": "vllm", "version": "0.32.0", "block_size": 32}
    header = recorded(CPU, engine=engine)
    assert header.version == 6 and PackHeader.from_json(header.to_json()).engine == engine
    assert header.key == recorded({"device": "cpu", "dtype": "float32"}, engine=engine).key != recorded(CPU).key
    with pytest.raises(InvalidInput, match="'engine' is in exactly the version-5 headers"):
        PackHeader.from_json(resealed(recorded({"device": "cpu", "dtype": "float32"}), engine=engine))  # version 4 with an engine


def test_packs_written_before_version_6_read_verify_and_decode_unchanged(tmp_path: Path) -> None:
    """tests/data/version5 was written at commit 7d2a287 (make_packs.py): built_on with device and dtype only."""
    expected = version5_packs()
    with LmdbStore(tmp_path / "store") as store:
        for name, (version, built) in {
            "v4-built-on": (4, {"device": "cuda", "dtype": "bfloat16"}),
            "v5-engine": (5, {"device": "cpu", "dtype": "float32"}),
            "v4-rope": (4, {"device": "cpu", "dtype": "float32"}),
        }.items():
            stored, created = import_pack(store, VERSION5 / f"{name}.pack", name=name)
            assert created and stored.header.version == version and stored.header.built_on == built
            assert stored.header.key == expected[name].header.key
            pack = decode_pack(PackReader(store).get(name))
            assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, expected[name].keys + expected[name].values))
        old = expected["v4-built-on"]
        again = dataclasses.replace(old, header=dataclasses.replace(old.header, built_on={**H200, "dtype": "bfloat16"}))
        key, created = store.put(encode_pack(again), name="again")  # the same content built on an H200 now: its key
        assert key == old.header.key and not created and store.stat(key).header.version == 4  # the first pack stays
        v6 = make_pack(tokens=9)
        v6.header = dataclasses.replace(v6.header, built_on=CPU)
        new, created = store.put(encode_pack(v6), name="v6")
        assert created and store.stat(new).header.version == 6 and store.stat(new).header.built_on == CPU
    assert packctl(["--store", str(tmp_path / "store"), "verify"]) == 0


def test_a_composition_records_the_machine_only_where_every_part_was_computed_alike(tiny_lm) -> None:
    """``copied_from``: a composition's built_on is this machine's exactly when the K/V it copies were computed by an
    equal built_on (same device, dtype, torch, exactness mode, and on CUDA the same GPU model, SM count and CUDA)."""
    here = built_on(tiny_lm)
    base, later = build_pack(tiny_lm, ["The river Tamsin flows through Wexley."]), build_pack(tiny_lm, ["Bob lives in Oslo."])
    assert base.header.built_on == here and here["device"] == "cpu" and "torch" in here
    assert compose_exact(tiny_lm, base, [later.header]).pack.header.built_on == here
    assert splice(tiny_lm, [base, later], "rope").pack.header.built_on == here
    elsewhere = [
        {"device": "cpu", "dtype": "float32"},  # written before version 6: which machine is unknown
        {**here, "torch": "2.0.0"},  # another torch
        {**here, "exactness": "deterministic"},  # another exactness mode
        {**H200, "dtype": "float32"},  # another device
    ]
    for other in elsewhere:
        moved = dataclasses.replace(base, header=dataclasses.replace(base.header, built_on=other))
        assert extend(tiny_lm, moved, ["Bob lives in Oslo."], parents=[base.header.key]).pack.header.built_on is None, other
        assert splice(tiny_lm, [moved, later], "rope").pack.header.built_on is None, other
    with exactness("deterministic"):
        strict = build_pack(tiny_lm, ["The river Tamsin flows through Wexley."])
        assert strict.header.built_on == {**here, "exactness": "deterministic"}
        assert compose_exact(tiny_lm, base, [later.header]).pack.header.built_on is None  # base was computed in the default mode
    assert strict.header.key == base.header.key  # the mode is not the key either


def test_an_engine_capture_gives_the_machine_it_recorded() -> None:
    """packstore.vllm writes ``exactness.machine`` of the vLLM process into the capture's metadata; a capture from
    before it (or one whose record is not JSON) gives the device type alone, and the pack is then version 5."""
    from packstore.kv.engine_build import machine_of

    here = machine(torch.device("cpu"))
    assert machine_of({"device": "cpu", "built_on": json.dumps(here)}) == here
    assert machine_of({"device": "cuda"}) == {"device": "cuda"} and machine_of({}) == {"device": "cpu"}
    assert machine_of({"device": "cpu", "built_on": "{not json"}) == {"device": "cpu"}
    engine = {"name": "vllm", "version": "0.32.0", "block_size": 32}
    assert recorded({**machine_of({"device": "cpu"}), "dtype": "float32"}, engine=engine).version == 5
    assert recorded({**machine_of({"built_on": json.dumps(here)}), "dtype": "float32"}, engine=engine).version == 6
