"""SIGKILL at random moments: the service under 16 concurrent uploads, a packctl writer, a bank build.
After each kill: every pack is complete and verified or absent, every acknowledged upload is present,
and retrying stores each pack once. Short in `make test-all`, 100 trials each in `make test-long`."""

from __future__ import annotations

import dataclasses
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from packstore.bank.bank import open_banks
from packstore.errors import PackstoreError
from packstore.packs.admin import export_pack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, encode_pack
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import make_pack
from tools.lib.servers import free_port, wait_serving

UPLOADERS = 16
PACKS_PER_UPLOADER = 3
PACKSTORE = Path(sys.executable).parent / "packstore"
PACKCTL = Path(sys.executable).parent / "packctl"


def start_server(data: Path, log: Path) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [str(PACKSTORE), "serve", "--data", str(data), "--listen", address], stdout=open(log, "a"), stderr=subprocess.STDOUT
    )
    wait_serving(address, process=process, log=log)
    return process, address


def trial_packs(trial: int) -> list[list]:
    """Each uploader's packs for one trial: distinct keys (shifted token ids), about 100 KB each
    whatever the trial, so a long run's store grows linearly."""
    base = make_pack(layers=4, tokens=400)

    def shifted(serial: int) -> Pack:
        ids = tuple(token + serial for token in base.header.token_ids)
        return dataclasses.replace(base, header=dataclasses.replace(base.header, token_ids=ids))

    per_trial = UPLOADERS * PACKS_PER_UPLOADER
    return [
        [shifted(trial * per_trial + uploader * PACKS_PER_UPLOADER + i) for i in range(PACKS_PER_UPLOADER)]
        for uploader in range(UPLOADERS)
    ]


def upload(address: str, packs: list, acked: list, stop: threading.Event) -> None:
    with RemoteStore(f"grpc://{address}", timeout=30) as store:
        for pack in packs:
            if stop.is_set():
                return
            try:
                key, _ = store.put(encode_pack(pack))
            except PackstoreError:
                return  # the server died mid-upload: not acknowledged
            acked.append(key)


def check_store(data: Path, acked: set[str]) -> int:
    with LmdbStore(data, readonly=True) as store:
        keys = set(store.keys())
        assert acked <= keys, f"acknowledged uploads lost: {sorted(acked - keys)[:3]}"
        bad = [r for r in PackReader(store).verify_all() if not r.ok]
        assert not bad, f"partial or damaged packs after a kill: {bad[:2]}"
        assert store.counts().packs == len(keys)
        return len(keys)


@pytest.mark.parametrize("trials", [3, pytest.param(100, marks=pytest.mark.long)], ids=["short", "long"])
def test_killing_the_service_during_sixteen_uploads_loses_nothing_acknowledged(tmp_path, robustness_report, trials) -> None:
    data, log = tmp_path / "data", tmp_path / "server.log"
    rng = random.Random(7)
    everything: set[str] = set()
    acknowledged_total = 0
    for trial in range(trials):
        packs = trial_packs(trial)
        process, address = start_server(data, log)
        acked: list[str] = []
        stop = threading.Event()
        threads = [threading.Thread(target=upload, args=(address, mine, acked, stop)) for mine in packs]
        for thread in threads:
            thread.start()
        time.sleep(rng.uniform(0.02, 0.8))
        process.send_signal(signal.SIGKILL)
        process.wait()
        stop.set()
        for thread in threads:
            thread.join()
        acknowledged_total += len(acked)
        check_store(data, set(acked))
        process, address = start_server(data, log)  # retry every upload of the trial: each is stored once
        try:
            with RemoteStore(f"grpc://{address}") as store:
                for mine in packs:
                    for pack in mine:
                        everything.add(store.put(encode_pack(pack))[0])
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait()
        assert check_store(data, everything) == len(everything)
    robustness_report.append(
        f"crash (service): {trials} SIGKILLs during {UPLOADERS} concurrent uploads; {acknowledged_total} acknowledged uploads all "
        f"present, 0 partial packs; after retries {len(everything)} packs, each stored once"
    )


@pytest.mark.parametrize("trials", [3, pytest.param(100, marks=pytest.mark.long)], ids=["short", "long"])
def test_killing_a_packctl_writer_leaves_each_pack_whole_or_absent(tmp_path, robustness_report, trials) -> None:
    source, data = tmp_path / "source", tmp_path / "data"
    files = []
    with LmdbStore(source) as store:
        for index in range(8):
            key, _ = store.put(encode_pack(make_pack(layers=6, tokens=3000 + index)))
            files.append((key, tmp_path / f"pack-{index}.pack"))
            export_pack(store, key, files[-1][1])
    rng = random.Random(11)
    killed = 0
    for trial in range(trials):
        key, path = files[trial % len(files)]
        writer = subprocess.Popen([str(PACKCTL), "--store", str(data), "import", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 1.5))
        killed += writer.poll() is None
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        if (data / "data.mdb").exists():
            check_store(data, set())
    for _key, path in files:  # retries: every pack stored once
        assert subprocess.run([str(PACKCTL), "--store", str(data), "import", str(path)], capture_output=True).returncode == 0
    assert check_store(data, {key for key, _ in files}) == len(files)
    robustness_report.append(f"crash (packctl import): {trials} trials, {killed} writers killed while running, 0 partial packs, retries stored each pack once")


@pytest.mark.parametrize("trials", [1, pytest.param(100, marks=pytest.mark.long)], ids=["short", "long"])
def test_killing_a_bank_build_leaves_the_bank_whole_or_absent(tmp_path, robustness_report, trials) -> None:
    from packstore.kv.synthetic import synthetic_facts

    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(case.fact for case in synthetic_facts(3000)) + "\n")
    data = tmp_path / "data"
    rng = random.Random(13)
    outcomes = {"absent": 0, "whole": 0}
    for trial in range(trials):
        build = subprocess.Popen(
            [str(PACKCTL), "--store", str(data), "bank", "build", str(facts), "--name", f"kb{trial}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.5, 12.0))
        build.send_signal(signal.SIGKILL)
        build.wait()
        if not (data / "data.mdb").exists():
            outcomes["absent"] += 1
            continue
        with LmdbStore(data, readonly=True) as store:
            banks = {meta.name: meta for meta, _ in open_banks(store, TEST_BANK_CACHE).list()}
            if f"kb{trial}" in banks:
                meta = banks[f"kb{trial}"]
                assert meta.facts == 3000 and open_banks(store, TEST_BANK_CACHE).route(f"kb{trial}", ["Who established the lighthouse?"])[0].facts
                outcomes["whole"] += 1
            else:
                assert store.bank_stored_bytes(f"kb{trial}") == 0  # no record of it at all
                outcomes["absent"] += 1
    robustness_report.append(f"crash (bank build): {trials} SIGKILLs: {outcomes['whole']} banks whole, {outcomes['absent']} absent, none partial")
