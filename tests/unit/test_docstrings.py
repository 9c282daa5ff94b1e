"""Docstrings say what the code is (issue 55): every package says what it holds, and no docstring or comment of the
package quotes a measured figure (figures belong to docs/benchmarks.md, where their runs are recorded)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packstore"
GENERATED = PACKAGE / "v1"

# A throughput, or a speed-up: what a run measured, which the next run changes.
MEASURED = re.compile(r"\b\d[\d.,]*\s*(GB/s|GiB/s|MB/s|MiB/s|tok/s|tokens/s)|\b\d[\d.,]*\s*x\s+(faster|slower)\b")


def sources() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if GENERATED not in path.parents]


def test_every_package_says_what_it_holds() -> None:
    """A package's docstring is a sentence, not its own name (``\"\"\"packs\"\"\"`` said nothing)."""
    thin = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if GENERATED in init.parents or init.parent == GENERATED:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if len(doc.split()) < 6:
            thin.append(f"{init.relative_to(ROOT)}: {doc!r}")
    assert not thin, "packages without a docstring that says what they hold:\n" + "\n".join(thin)


def test_no_measured_figures_in_the_code() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources()
        for number, line in enumerate(path.read_text().split("\n"), 1)
        if MEASURED.search(line)
    ]
    assert not found, "measured figures in the code (cite docs/benchmarks.md instead):\n" + "\n".join(found)


def test_the_figure_pattern_finds_figures() -> None:
    assert MEASURED.search("16 threads decoded 7.9 GB/s against a pinned copy")
    assert MEASURED.search("the device join is 3.2x faster")
    assert not MEASURED.search("plus 1 s per 16 MiB it sends")
