"""Where a store is and how to reach it: ``StoreSpec``, made by ``StoreSpec.of``, the one reader of
``$PACKSTORE_STORE`` (and of the object tier's ``$PACKSTORE_S3_ENDPOINT``); ``packstore.store.open_store`` opens it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from packstore.store.namespaces import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from packstore.rpc.channel import Connection

GRPC_SCHEMES = ("grpc://", "grpcs://")
S3_SCHEME = "s3://"
DEFAULT_OBJECT_CACHE_BYTES = 1 << 30  # what an object store keeps locally unless told otherwise

Tier = Literal["lmdb", "s3", "grpc"]


def _default_location() -> str:
    """``$PACKSTORE_STORE``, else ``$XDG_DATA_HOME/packstore``, else ``~/.local/share/packstore``."""
    if os.environ.get("PACKSTORE_STORE"):
        return os.environ["PACKSTORE_STORE"]
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return str(Path(base) / "packstore")


@dataclass(frozen=True)
class StoreSpec:
    """A store's location, a directory (the LMDB tier), ``s3://BUCKET/PREFIX`` (the object tier) or
    ``grpc://HOST:PORT`` / ``grpcs://HOST:PORT`` (the service, through the gRPC client tier), with what that tier
    needs to open it; each field is read only by its tier.

    ``connection``: TLS files, token and namespace to reach the service (None: the environment's).
    ``s3_endpoint``: the object store's URL (None: ``$AWS_ENDPOINT_URL_S3``, else AWS S3); ``namespace``: its tree of
    the bucket; ``cache_dir``/``cache_bytes``: its local cache (None: a temporary one, removed on close).
    ``max_bytes``: the most a directory's data file may hold (None: no limit); ``map_size``: the address space its
    map reserves (None: the LMDB tier's default). ``timeout``: the seconds each call to a service or bucket may take
    (None: the tier's default; a service's calls then have no deadline)."""

    location: str
    connection: Connection | None = None
    s3_endpoint: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    cache_dir: Path | None = None
    cache_bytes: int = DEFAULT_OBJECT_CACHE_BYTES
    max_bytes: int | None = None
    map_size: int | None = None
    timeout: float | None = None

    @classmethod
    def of(
        cls,
        location: str | os.PathLike[str] | None = None,
        *,
        connection: Connection | None = None,
        s3_endpoint: str | None = None,
        namespace: str | None = None,
    ) -> StoreSpec:
        """The store ``location`` names (None: ``$PACKSTORE_STORE``, else the per-user data directory), reached with
        ``connection`` when it is a service; an ``s3://`` store at ``s3_endpoint`` (else ``$PACKSTORE_S3_ENDPOINT``) in
        ``namespace`` (else ``$PACKSTORE_NAMESPACE``, else ``default``)."""
        text = str(location or _default_location())
        if text.startswith(GRPC_SCHEMES):
            return cls(text, connection=connection)
        if text.startswith(S3_SCHEME):
            endpoint = s3_endpoint or os.environ.get("PACKSTORE_S3_ENDPOINT") or None
            return cls(text, s3_endpoint=endpoint, namespace=namespace or os.environ.get("PACKSTORE_NAMESPACE") or DEFAULT_NAMESPACE)
        return cls(text)

    @property
    def tier(self) -> Tier:
        if self.location.startswith(GRPC_SCHEMES):
            return "grpc"
        return "s3" if self.location.startswith(S3_SCHEME) else "lmdb"

    @property
    def is_directory(self) -> bool:
        """Whether the store is a local directory (the LMDB tier), not reached over a network."""
        return self.tier == "lmdb"
