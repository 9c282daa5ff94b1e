"""The format core needs no torch: reading a header or verifying a chunk stays a light import."""

from __future__ import annotations

import subprocess
import sys

LIGHT_MODULES = (
    "packstore.format",
    "packstore.format.header",
    "packstore.format.body",
    "packstore.format.codec",
    "packstore.format.packfile",
    "packstore.format.bank",
    "packstore.store.records",
    "packstore.errors",
)


def test_format_core_imports_no_torch_lmdb_or_grpc() -> None:
    probe = (
        f"import sys, {', '.join(LIGHT_MODULES)}\n"
        "heavy = sorted(m for m in ('torch', 'safetensors', 'lmdb', 'grpc') if m in sys.modules)\n"
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
