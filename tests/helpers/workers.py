"""An in-process worker service over a store of its own, for the tests that drive a worker's ports directly."""

from __future__ import annotations

from pathlib import Path

from packstore.kv.build import build_pack
from packstore.kv.models import LoadedModel
from packstore.packs.tensors import encode_pack
from packstore.security.auth import Auth
from packstore.store import LmdbStore
from packstore.worker.server import WorkerService
from tests.helpers.auth import tokens_file


def worker_over_a_pack(root: Path, lm: LoadedModel, facts: list[str], tenants: dict | None = None, **options: object) -> tuple[WorkerService, LmdbStore]:
    """A WorkerService on ``lm`` over a store in ``root`` holding the pack of ``facts`` named ``wexley``, with the tokens
    of ``tenants`` (``tests.helpers.auth.tokens_file``'s form; None: no tokens) and ``options`` (max_concurrent, ...):
    the service and its store (close it after)."""
    store = LmdbStore(root / "store")
    store.put(encode_pack(build_pack(lm, facts)), name="wexley")
    auth = Auth(tokens_file(root / "tokens.toml", tenants)) if tenants else None
    options = {"cache_bytes": 1 << 30} | options
    return WorkerService(lm, lambda namespace: store, auth=auth, **options), store
