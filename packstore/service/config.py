"""Service settings: defaults, then a TOML config file, then ``PACKSTORE_*`` environment, then flags."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from packstore.errors import InvalidInput
from packstore.serving.connections import METRICS_CONNECTIONS, METRICS_CONNECTIONS_PER_PEER, ConnectionCaps
from packstore.store.spec import DEFAULT_OBJECT_CACHE_BYTES


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``packstore serve`` can be told. Each field F also reads ``$PACKSTORE_<F upper>``."""

    data: str = ""  # the store directory; with ``objects``, only the caches of the object store
    listen: str = "127.0.0.1:50551"
    bulk_listen: str = ""  # HOST:PORT of the bulk port GetPack hands tickets for; empty: listen's host, any free port; off: none
    bulk_local: str = "on"  # on: also a local bulk socket, for clients on this host (no TCP); off: none
    bulk_per_principal: int = 0  # bulk transfers one principal (token; without auth, address) may run at once; 0: half the slots
    hot_bytes: int = 1 << 30  # per namespace: memory for packs kept hot for the bulk port (kept, being written, being sent); 0: none
    stream_seconds: float = 60.0  # what a stream or bulk transfer may wait for its reader, plus 1 s per 16 MiB it sends
    upload_seconds: float = 600.0  # a PutPack still running after this is cancelled (gRPC sets no deadline of its own)
    metrics: str = ""  # HOST:PORT for Prometheus (no host: loopback); empty disables
    metrics_connections: int = METRICS_CONNECTIONS  # scrapes at once (each on a thread of a pool), all hosts together
    metrics_connections_per_peer: int = METRICS_CONNECTIONS_PER_PEER  # scrapes at once from one host
    workers: int = 16  # transfer slots (streams, uploads, bank builds and routes), shared among principals
    max_message_bytes: int = 4 << 20  # per gRPC message, both directions
    max_pack_bytes: int = 4 << 30  # stored bytes of one uploaded pack
    max_chunk_bytes: int = 64 << 20  # stored bytes of one chunk: what one upload holds in memory at a time
    max_facts_bytes: int = 256 << 20  # text of the facts one BuildBank / AddFacts call sends
    max_header_bytes: int = 64 << 20
    max_store_bytes: int = 0  # most each namespace's data file may hold; 0: no limit. Full: writes RESOURCE_EXHAUSTED, reads go on
    shutdown_grace_seconds: float = 30.0
    log_level: str = "info"
    auth: str = ""  # TOML file of tokens (docs/operations.md, "Tokens and namespaces"); empty: no tokens, one namespace
    tls_cert: str = ""  # PEM certificate (chain) for TLS; empty: plain gRPC
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA whose client certificates are required (mutual TLS)
    objects: str = ""  # s3://BUCKET/PREFIX to serve from (docs/operations.md, "Object store tier"); empty: the local store
    s3_endpoint: str = ""  # the object store's URL; empty: $AWS_ENDPOINT_URL_S3, else AWS S3
    cache_bytes: int = DEFAULT_OBJECT_CACHE_BYTES  # with objects: the local cache of each namespace

    @property
    def bulk_connections(self) -> int:
        """The bulk port's transfers at once (its connections' cap): 4 x ``workers``."""
        return self.workers * 4


# Settings that no longer exist, and what took their place (a config that still names one is refused, not ignored).
REPLACED = {
    "bulk_per_peer": "was replaced by bulk_per_principal: bulk slots are now shared per token (without auth, per address)",
}


def _coerce(field: dataclasses.Field[Any], value: Any, source: str) -> Any:
    kind: type[Any] = type(field.default)  # every setting has a default, of the setting's type
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{source}: {field.name} must be a {type(field.default).__name__}, got {value!r}") from None


def load_config(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """Merge the config file, environment and explicit overrides (None values are ignored)."""
    values: dict[str, Any] = {}
    known = {f.name: f for f in fields(ServiceConfig)}
    if config_file:
        try:
            table = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidInput(f"config file {config_file}: {exc}") from None
        for name, value in table.items():
            if name in REPLACED:
                raise InvalidInput(f"config file {config_file}: {name} {REPLACED[name]}")
            if name not in known:
                raise InvalidInput(f"config file {config_file}: unknown setting {name!r}")
            values[name] = _coerce(known[name], value, config_file)
    for name, why in REPLACED.items():
        if f"PACKSTORE_{name.upper()}" in os.environ:
            raise InvalidInput(f"$PACKSTORE_{name.upper()}: {name} {why}")
    for name, field in known.items():
        env = os.environ.get(f"PACKSTORE_{name.upper()}")
        if env is not None:
            values[name] = _coerce(field, env, f"$PACKSTORE_{name.upper()}")
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(known[name], value, f"--{name.replace('_', '-')}")
    config = ServiceConfig(**values)
    if not config.data:
        raise InvalidInput("no data directory: set data (as a flag, in the config file or as $PACKSTORE_DATA)")
    if min(config.max_pack_bytes, config.max_chunk_bytes, config.max_facts_bytes, config.max_header_bytes) < 1:
        raise InvalidInput("size limits must be at least 1 byte")
    if config.workers < 1 or config.max_message_bytes < (1 << 20) + 4096:
        raise InvalidInput("workers must be >= 1 and max_message_bytes at least 1 MiB + 4 KiB (chunk pieces are 1 MiB)")
    if config.objects and config.max_store_bytes:
        raise InvalidInput("max_store_bytes bounds a local store; with objects, bound the bucket with the object store's own quota")
    if config.cache_bytes < 0 or config.hot_bytes < 0 or config.bulk_per_principal < 0:
        raise InvalidInput("cache_bytes, hot_bytes and bulk_per_principal must be >= 0")
    for name in ("upload_seconds", "stream_seconds"):
        if not 0 < getattr(config, name) <= 86400:  # also refuses NaN
            raise InvalidInput(f"{name} must be from 0 to 86400, got {getattr(config, name)}")
    ConnectionCaps(metrics=config.metrics_connections, metrics_per_peer=config.metrics_connections_per_peer)  # (refuses caps below 1)
    if config.bulk_local not in ("on", "off"):
        raise InvalidInput(f"bulk_local must be on or off, got {config.bulk_local!r}")
    return config
