"""Damage the store's data file at random places (bit flips, truncation, zeroed pages): the store refuses
to open with a clear message, or every read of an affected pack fails with DATA_LOSS while the others
serve their exact tensors, and verify names exactly the damaged packs. Short in `make test-all`, 240
trials in `make test-long`."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from packstore.cli.packctl import main as packctl
from packstore.errors import IntegrityError
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

DAMAGES = ("flip", "truncate", "zero-page")


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A store of 16 packs of different sizes, and each pack's tensors."""
    path = tmp_path_factory.mktemp("corruption") / "original"
    packs = {}
    with LmdbStore(path) as store:
        for index in range(16):
            pack = make_pack(tokens=3 + 9 * index)
            key, _ = store.put(encode_pack(pack), name=f"p{index}")
            packs[key] = pack
    return path, packs


def damage(path: Path, kind: str, rng: random.Random) -> str:
    data_file = path / "data.mdb"
    data = bytearray(data_file.read_bytes())
    if kind == "flip":
        where = rng.randrange(len(data))
        data[where] ^= 1 << rng.randrange(8)
        what = f"bit flip at byte {where}"
    elif kind == "truncate":
        where = rng.randrange(len(data))
        data = data[:where]
        what = f"truncated to {where} bytes"
    else:
        page = rng.randrange(len(data) // 4096)
        data[page * 4096 : (page + 1) * 4096] = bytes(4096)
        what = f"page {page} zeroed"
    data_file.write_bytes(data)
    return what


def run_trial(original, tmp_path: Path, trial: int, capsys) -> dict:
    source, packs = original
    rng = random.Random(trial)
    copy = tmp_path / f"trial-{trial}"
    shutil.copytree(source, copy)
    (copy / "packstore.checked").unlink(missing_ok=True)
    what = damage(copy, DAMAGES[trial % 3], rng)
    try:
        store = LmdbStore(copy, readonly=True)
    except IntegrityError as exc:
        assert "restore it from a backup" in str(exc), what
        assert packctl(["--store", str(copy), "verify"]) == 1 and "restore it from a backup" in capsys.readouterr().err
        return {"refused": 1, "damaged": 0, "intact": 0}
    damaged = set()
    with store:
        for key, pack in packs.items():
            try:
                fetched = PackReader(store).fetch(key)
            except IntegrityError as exc:
                assert key in str(exc) or str(copy) in str(exc), (what, str(exc))
                damaged.add(key)
                continue
            # a pack that reads at all reads exactly: no wrong tensor ever reaches a caller
            assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values)), what
        verified = {r.key for r in PackReader(store).verify_all() if not r.ok}
    # verify names every damaged pack, and nothing else but keys the damage made up (a flipped key byte)
    assert verified & set(packs) == damaged and (verified - damaged).isdisjoint(packs), what
    code = packctl(["--store", str(copy), "verify"])
    out = capsys.readouterr().out
    named = {line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("DAMAGED")}
    assert code == (1 if verified else 0) and named == verified, what
    shutil.rmtree(copy)
    return {"refused": 0, "damaged": len(damaged), "intact": len(packs) - len(damaged)}


@pytest.mark.parametrize("trials", [30, pytest.param(240, marks=pytest.mark.long)], ids=["short", "long"])
def test_damage_is_refused_or_reported_and_never_served(original, tmp_path, capsys, robustness_report, trials) -> None:
    totals = {"refused": 0, "damaged": 0, "intact": 0}
    for trial in range(trials):
        for name, value in run_trial(original, tmp_path, trial, capsys).items():
            totals[name] += value
    robustness_report.append(
        f"corruption: {trials} trials ({', '.join(DAMAGES)}): {totals['refused']} stores refused to open, "
        f"{totals['damaged']} damaged pack reads failed with DATA_LOSS, {totals['intact']} intact pack reads exact, 0 wrong tensors"
    )
    assert totals["refused"] > 0 and totals["damaged"] > 0


def test_the_service_answers_data_loss_for_damaged_packs_and_serves_the_rest(original, tmp_path) -> None:
    source, packs = original
    for trial in range(3, 400, 3):  # flips: find one that damages some packs but lets the store open
        copy = tmp_path / f"served-{trial}"
        shutil.copytree(source, copy)
        (copy / "packstore.checked").unlink(missing_ok=True)
        damage(copy, "flip", random.Random(trial))
        try:
            with LmdbStore(copy, readonly=True) as store:
                damaged = {r.key for r in PackReader(store).verify_all() if not r.ok}
        except IntegrityError:
            continue
        if damaged:
            break
    else:
        pytest.fail("no flip damaged a pack without breaking the store")
    with running_server(copy) as server, RemoteStore(server.url) as remote:
        for key, pack in packs.items():
            if key in damaged:
                with pytest.raises(IntegrityError):
                    PackReader(remote).fetch(key)
            else:
                fetched = PackReader(remote).fetch(key)
                assert all(torch.equal(a, b) for a, b in zip(fetched.keys + fetched.values, pack.keys + pack.values))
        assert remote.counts().packs == len(packs)  # still serving
