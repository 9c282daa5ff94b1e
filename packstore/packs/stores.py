"""Any storage tier opened by specifier: a directory (LMDB), ``s3://`` (the object tier) or ``grpc://`` (the service)."""

from __future__ import annotations

import os

from packstore.store import default_store_path
from packstore.store.protocol import PackStore


def is_remote(spec: str | os.PathLike[str] | None) -> bool:
    """Whether a store specifier names a service (``grpc://`` or ``grpcs://HOST:PORT``) or an object store
    (``s3://BUCKET/PREFIX``) rather than a directory: reached through a ``Connection``."""
    return str(spec or "").startswith(("grpc://", "grpcs://", "s3://"))


def open_store(spec: str | os.PathLike[str] | None = None, *, readonly: bool = False, connection=None) -> PackStore:
    """The store a specifier names: ``grpc://HOST:PORT`` (``grpcs://`` for TLS) is the service, with
    ``connection``'s TLS files, token and namespace; ``s3://BUCKET/PREFIX`` the object store at
    ``connection``'s endpoint, in its namespace, with a temporary cache; anything else a local
    directory. ``connection`` defaults to the environment's. Without ``spec``: ``$PACKSTORE_STORE``,
    else the per-user data directory.
    """
    spec = str(spec or os.environ.get("PACKSTORE_STORE") or default_store_path())
    if spec.startswith("s3://"):
        from packstore.rpc.channel import Connection  # the tiers are imported only when named
        from packstore.store.objects.store import ObjectStore
        from packstore.store.protocol import DEFAULT_NAMESPACE

        connection = connection or Connection.from_env()
        return ObjectStore(spec, endpoint=connection.s3_endpoint, namespace=connection.namespace or DEFAULT_NAMESPACE)
    if is_remote(spec):
        from packstore.rpc.remote import RemoteStore

        return RemoteStore(spec, connection=connection)
    from packstore.store.lmdb.store import LmdbStore

    return LmdbStore(spec, readonly=readonly)
