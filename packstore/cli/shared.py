"""What packctl's command groups share: the store ``--store`` names, sizes for people, progress bars."""

from __future__ import annotations

import argparse
import os
import sys

from packstore.cli.common import connection_of
from packstore.packs.stores import is_remote, open_store
from packstore.store import PackStore


def progress(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: not with ``--quiet``, and only for a person at a terminal."""
    return not args.quiet and sys.stderr.isatty()


def store_of(args: argparse.Namespace, *, readonly: bool = False, spec: str | None = None) -> PackStore:
    """The store ``--store`` names (or ``spec``), reached with the connection options when it is not a directory."""
    spec = spec or args.store or os.environ.get("PACKSTORE_STORE")
    return open_store(spec, readonly=readonly, connection=connection_of(args) if is_remote(spec) else None)


def human_bytes(n: float) -> str:
    """``n`` bytes as a person reads them: B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
