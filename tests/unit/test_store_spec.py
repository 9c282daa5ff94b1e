"""StoreSpec (issue 55): the one reader of $PACKSTORE_STORE and of the object tier's endpoint, and open_store, the
one factory that opens a tier by it."""

from __future__ import annotations

from pathlib import Path

import pytest

from packstore.errors import PackNotFound
from packstore.rpc.channel import Connection
from packstore.store import StoreSpec, open_store
from packstore.store.lmdb.store import LmdbStore


def test_without_a_location_the_environment_then_the_user_data_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PACKSTORE_STORE", str(tmp_path / "named"))
    assert StoreSpec.of(None) == StoreSpec(str(tmp_path / "named"))
    monkeypatch.delenv("PACKSTORE_STORE")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert StoreSpec.of(None).location == str(tmp_path / "xdg" / "packstore")
    assert StoreSpec.of(tmp_path / "given").location == str(tmp_path / "given")


def test_each_tier_keeps_only_what_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKSTORE_S3_ENDPOINT", "http://env:8333")
    monkeypatch.setenv("PACKSTORE_NAMESPACE", "team")
    connection = Connection(token="t", namespace="other")
    s3 = StoreSpec.of("s3://bucket/prefix", connection=connection)
    assert (s3.tier, s3.s3_endpoint, s3.namespace, s3.connection) == ("s3", "http://env:8333", "team", None)
    given = StoreSpec.of("s3://bucket/prefix", s3_endpoint="http://given:1", namespace="mine")
    assert (given.s3_endpoint, given.namespace) == ("http://given:1", "mine")
    service = StoreSpec.of("grpcs://host:50551", connection=connection, s3_endpoint="http://given:1")
    assert (service.tier, service.connection, service.s3_endpoint) == ("grpc", connection, None)
    directory = StoreSpec.of("/data/packs", connection=connection)
    assert (directory.tier, directory.is_directory, directory.connection) == ("lmdb", True, None)


def test_open_store_opens_a_directory_as_the_lmdb_tier(tmp_path: Path) -> None:
    with pytest.raises(PackNotFound):
        open_store(tmp_path / "missing", readonly=True)
    with open_store(StoreSpec(str(tmp_path / "s"), max_bytes=1 << 30)) as store:
        assert isinstance(store, LmdbStore)
    with open_store(str(tmp_path / "s"), readonly=True) as store:
        assert isinstance(store, LmdbStore) and store.readonly
