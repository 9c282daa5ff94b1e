"""The test lanes (README, "Tests"): the fast lane of ``make test`` still touches every module of the package.

"Touches" is static and cheap: a module is touched when a test module of the lane imports it, directly or through a
helper of ``tests.helpers`` or through another packstore module (an import anywhere in a file counts, a function's
lazy one too, and so does a string naming the module: a command's handlers imported by name, ``python -m MODULE``).
The lane is the Makefile's ``FAST_LANE`` marker expression, as pytest selects it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, child_env

PACKAGE = REPO / "packstore"
GENERATED = {"packstore.v1"}  # protos compiled by packstore.rpc.codegen (ignored by git): imported by rpc/, not tested
RUN_BY_THE_INSTALL = {"packstore.rpc.codegen"}  # setup.py runs it (packstore/v1) at every install, before any test


def fast_lane() -> str:
    found = re.search(r"^FAST_LANE\s*:?=\s*(.+)$", (REPO / "Makefile").read_text(), flags=re.M)
    assert found, "the Makefile defines FAST_LANE"
    return found.group(1).strip()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: path for name, path in modules.items() if not any(name == g or name.startswith(g + ".") for g in GENERATED)}


def imported(path: Path, name: str) -> set[str]:
    """Every module ``path`` (module ``name``) imports anywhere in its code, and the parents of each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"(packstore|tests)(\.\w+)+", node.value):
            found.add(node.value)  # a module named in a string: imported by name, or run as `python -m`
    parents = {".".join(module.split(".")[:i]) for module in found for i in range(1, module.count(".") + 1)}
    return found | parents


def touched(start: list[Path]) -> set[str]:
    """The packstore and tests modules reachable by imports from the test files ``start``."""
    files = {name: path for name, path in package_modules().items()}
    files.update({module_name(path): path for path in (REPO / "tests").rglob("*.py") if "data" not in path.parts})
    seen: set[str] = set()
    todo = [module_name(path) for path in start]
    while todo:
        name = todo.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        todo.extend(imported(files[name], name) - seen)
    return seen


def test_the_fast_lane_imports_every_packstore_module() -> None:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", fast_lane(), "tests"],
        cwd=REPO, capture_output=True, text=True, env=child_env(), timeout=600,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    files = sorted({REPO / line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line})
    assert len(files) > 20, collected.stdout[-3000:]
    missing = sorted(set(package_modules()) - touched(files) - RUN_BY_THE_INSTALL)
    assert not missing, f"modules no test of the fast lane ({fast_lane()}) imports: {missing}"
