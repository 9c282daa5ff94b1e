"""What the tests share: builders, servers, certificates, the tiny model. Test modules import these, never each other."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a Python child process that imports ``tests.helpers``: this one's, with the repository root
    first on PYTHONPATH (as pytest's ``pythonpath`` puts it first on ``sys.path`` here)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path} | extra
