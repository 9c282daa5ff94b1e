"""Fixtures of the service tests: a ``packstore serve`` on loopback per module, and a client that empties it after
each test; a module may define its own ``server`` instead."""

from __future__ import annotations

import pytest

from packstore.store.remote.store import RemoteStore
from tools.lib.servers import running_server


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
