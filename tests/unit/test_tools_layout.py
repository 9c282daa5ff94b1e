"""tools/ is a package of modules run as ``python -m tools.KIND.NAME``: no tool edits ``sys.path``, none imports
from tests/, and tools import one another by their package names (``tools.lib.evallib``, never a bare ``evallib``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = sorted((ROOT / "tools").rglob("*.py"))


def imported_roots(tree: ast.AST) -> set[str]:
    """The first name of every module a file imports (relative imports excluded: the tools use none)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def edits_sys_path(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"
        for node in ast.walk(tree)
    )


def test_tools_import_no_tests_and_no_bare_sibling() -> None:
    tests = {"tests"} | {path.stem for path in (ROOT / "tests").rglob("*.py")}
    siblings = {path.stem for path in TOOLS} - {"__init__"}
    assert TOOLS and siblings >= {"evallib", "benchlib", "doc_tables", "eval_banks", "bench_pack", "third_facts"}
    wrong = {}
    for path in TOOLS:
        bad = imported_roots(ast.parse(path.read_text())) & (tests | siblings)
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert wrong == {}, "import these through tools.* (helpers the tools share belong in tools/lib)"


def test_no_tool_edits_sys_path() -> None:
    assert [str(path.relative_to(ROOT)) for path in TOOLS if edits_sys_path(ast.parse(path.read_text()))] == []


def test_every_tools_folder_is_a_package() -> None:
    folders = {path.parent for path in TOOLS}
    assert [str(folder.relative_to(ROOT)) for folder in sorted(folders) if not (folder / "__init__.py").exists()] == []
