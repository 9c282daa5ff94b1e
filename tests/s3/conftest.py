"""Fixtures shared by the unit tests.

The object-tier tests': one real S3 server (SeaweedFS ``weed mini``) per module, a prefix of its bucket per test,
and two replicas on it. The service tests' (test_service, test_hostile): a ``packstore serve`` on loopback per
module, and a client that empties it after each test; a module may define its own ``server`` instead."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from packstore.rpc.remote import RemoteStore
from seaweed_helpers import Seaweed, running_seaweed
from service_helpers import running_server

if TYPE_CHECKING:  # the s3 extra (boto3): imported where used, so the other unit tests run without it (a GPU host)
    from packstore.store.objects.store import ObjectStore


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory) -> Iterator[Seaweed]:
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server, pytest.MonkeyPatch.context() as env:
        for variable, value in server.env().items():
            env.setenv(variable, value)
        yield server


@pytest.fixture
def url(seaweed: Seaweed, request) -> str:
    """This test's own prefix of the bucket."""
    return f"s3://{seaweed.bucket}/{request.node.name.replace('[', '-').rstrip(']')}"


@pytest.fixture
def replicas(url: str, tmp_path: Path) -> Iterator[tuple[ObjectStore, ObjectStore]]:
    """Two stores on one bucket and prefix, each with its own cache: two replicas of a service."""
    from packstore.store.objects.store import ObjectStore

    with ObjectStore(url, cache_dir=tmp_path / "a") as a, ObjectStore(url, cache_dir=tmp_path / "b") as b:
        yield a, b


@pytest.fixture
def model_fp(request) -> str:
    return hashlib.sha256(request.node.name.encode()).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("svc") / "data") as running:
        yield running


@pytest.fixture
def remote(server):
    with RemoteStore(server.url) as store:
        yield store
        for key in store.keys():
            store.delete(key)
