"""packctl backup: a consistent hot copy of every namespace while a writer keeps writing; the copy is a store."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from packstore.cli.packctl import main as packctl
from packstore.errors import InvalidInput
from packstore.packs.backup import backup
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.namespaces import namespace_path
from packstore.store.remote.store import RemoteStore
from tests.helpers import child_env
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

WRITER = r"""
import sys
from tests.helpers.packs import make_pack
from packstore.store import LmdbStore
from packstore.packs.tensors import encode_pack
with LmdbStore(sys.argv[1]) as store, open(sys.argv[2], "a") as log:
    for index in range(100000):
        key, _ = store.put(encode_pack(make_pack(tokens=10 + index)))
        log.write(key + "\n")
        log.flush()
"""


def test_backup_is_a_consistent_copy_taken_while_a_writer_writes(tmp_path, capsys) -> None:
    data = tmp_path / "data"
    with LmdbStore(namespace_path(data, "team-a")) as team:
        team.put(encode_pack(make_pack(tokens=20)), name="theirs")
    acked = tmp_path / "acked.log"
    acked.write_text("")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(data), str(acked)], stderr=subprocess.PIPE, env=child_env())
    try:
        while len(acked.read_text().splitlines()) < 15:
            assert writer.poll() is None, writer.stderr.read().decode()
            time.sleep(0.05)
        before = set(acked.read_text().splitlines())
        assert packctl(["--store", str(data), "backup", str(tmp_path / "copy"), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        still_writing = writer.poll() is None
    finally:
        writer.kill()
        writer.wait()
    assert still_writing
    assert set(report["namespaces"]) == {"default", "team-a"} and report["namespaces"]["team-a"]["packs"] == 1
    with LmdbStore(tmp_path / "copy", readonly=True) as copy:
        keys = set(copy.keys())
        assert before <= keys  # everything committed before the copy began is in it
        assert all(result.ok for result in PackReader(copy).verify_all())  # and every pack in it is complete
        assert copy.counts().packs == len(keys) == report["namespaces"]["default"]["packs"]
    assert packctl(["--store", str(namespace_path(tmp_path / "copy", "team-a")), "verify"]) == 0
    capsys.readouterr()


def test_a_backup_restores_by_serving_it(tmp_path) -> None:
    data = tmp_path / "data"
    with LmdbStore(data) as store:
        key, _ = store.put(encode_pack(make_pack(tokens=9)), name="kept")
    backup(data, tmp_path / "copy")
    with running_server(tmp_path / "copy") as server, RemoteStore(server.url) as remote:
        assert remote.stat("kept", model_fp="a" * 64).key == key and PackReader(remote).verify(key).ok


def test_backup_refuses_an_existing_destination_a_missing_store_and_a_service(tmp_path, capsys) -> None:
    with LmdbStore(tmp_path / "data") as store:
        store.put(encode_pack(make_pack(tokens=4)))
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidInput, match="exists"):
        backup(tmp_path / "data", tmp_path / "taken")
    with pytest.raises(InvalidInput, match="no pack store"):
        backup(tmp_path / "nothing", tmp_path / "copy")
    assert not (tmp_path / "copy").exists() and not (tmp_path / ".copy.partial").exists()
    assert packctl(["--store", "grpc://127.0.0.1:1", "backup", str(tmp_path / "copy")]) == 1
    assert "run it on the service's host" in capsys.readouterr().err
