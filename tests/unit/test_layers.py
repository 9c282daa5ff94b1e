"""The package's layers import one way: the worker never imports the service, and neither do the shared rpc/ and
security/ modules both servers use."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import packstore

PACKAGE = Path(packstore.__file__).parent


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize(("layer", "forbidden"), [("worker", "service"), ("service", "worker"), ("rpc", "service"), ("security", "service")])
def test_a_layer_never_imports_another_beside_or_above_it(layer: str, forbidden: str) -> None:
    wrong = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in (PACKAGE / layer).rglob("*.py")
        for name in imported(path)
        if name == f"packstore.{forbidden}" or name.startswith(f"packstore.{forbidden}.")
    }
    assert not wrong, sorted(wrong)
