"""Where each namespace of a data directory lives, so tenants' keys, names and banks never meet.

``default`` is the data directory itself (the store a service without tokens serves, so a store written before
namespaces existed is the ``default`` namespace); any other namespace ``N`` is the store in ``DATA/namespaces/N``.
On an object store each namespace is its own tree of the bucket (``store/objects``)."""

from __future__ import annotations

from pathlib import Path

from packstore.store.protocol import check_name

DEFAULT_NAMESPACE = "default"  # the namespace of callers and stores that name none
NAMESPACES_DIR = "namespaces"


def namespace_path(data: str | Path, namespace: str) -> Path:
    """Where namespace ``namespace`` of the data directory ``data`` lives."""
    return Path(data) if namespace == DEFAULT_NAMESPACE else Path(data) / NAMESPACES_DIR / check_name(namespace)


def namespaces_at(data: str | Path) -> list[str]:
    """The namespaces a data directory holds a store for, ``default`` first."""
    found = [DEFAULT_NAMESPACE] if (Path(data) / "data.mdb").exists() else []
    others = Path(data) / NAMESPACES_DIR
    if others.is_dir():
        found += sorted(entry.name for entry in others.iterdir() if (entry / "data.mdb").exists())
    return found
