"""The tables of docs/evaluation.md, generated from the evaluations' per-question records under results/.

A generated table is marked in the markdown by a comment line before it and one after it, with the
table (and any note lines its tool prints under it) between them and nothing else:

    <!-- table: KIND DIR -->
    | ... |
    <!-- /table -->

KIND names a generator (``GENERATORS``), DIR a results directory relative to the repository root (or
several joined by ``+``, for a table gathered from several runs); the generator makes the table from DIR's
records with the evaluation tool's own table function, as the tool's ``--report-only`` does. Run from the repository root:

    .venv/bin/python tools/doc_tables.py --check [FILE]   # exit 1, with a diff per table, when the doc differs
    .venv/bin/python tools/doc_tables.py --write [FILE]   # rewrite the marked tables from the records

FILE defaults to docs/evaluation.md. An unknown KIND, a missing DIR or records file, or a malformed or
unclosed marker is an error (exit 2). tests/unit/test_doc_tables.py runs ``--check`` on the repository's doc.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evallib import REPO, read_jsonl  # noqa: E402

DEFAULT_FILE = REPO / "docs" / "evaluation.md"
OPEN = re.compile(r"<!-- table: (?P<kind>\S+) (?P<dir>\S+) -->")
CLOSE = "<!-- /table -->"


class DocTableError(Exception):
    """A marker or records problem: the tables cannot be checked or written."""


def _tool(name: str) -> ModuleType:
    """tools/NAME.py, imported only when a marker asks for one of its tables (each imports torch)."""
    return importlib.import_module(name)


@dataclass(frozen=True)
class Generator:
    """What a KIND reads in each DIR (glob patterns, each must match a file) and how it makes the table from
    them (``make`` gets the one directory, or the list of them when ``several``)."""

    records: tuple[str, ...]
    make: Callable[[Path], str] | Callable[[list[Path]], str]
    several: bool = False


def _eval_banks(outs: list[Path]) -> str:
    """One table of every run's rows, in the order of the directories (e.g. one run per embedder)."""
    eval_banks = _tool("eval_banks")
    return eval_banks.table([row for out in outs for row in eval_banks.rows_from_records(read_jsonl(out / "questions.jsonl"))])


def _eval_banks_targets(outs: list[Path]) -> str:
    eval_banks = _tool("eval_banks")
    return eval_banks.targets_table([row for out in outs for row in eval_banks.rows_from_records(read_jsonl(out / "questions.jsonl"))])


def _eval_banks_sweep(out: Path) -> str:
    eval_banks = _tool("eval_banks")
    return eval_banks.sweep_table(eval_banks.sweep_rows_from_records(read_jsonl(out / "sweep.jsonl")))


def _eval_rerank(out: Path) -> str:
    eval_rerank = _tool("eval_rerank")
    return eval_rerank.table(read_jsonl(out / "questions.jsonl"))


def _eval_packs(out: Path) -> str:
    eval_packs = _tool("eval_packs")
    return eval_packs.table(eval_packs.summarize(read_jsonl(out / "questions.jsonl")))


def _eval_bank_answers(out: Path) -> str:
    """The records do not say how many paragraphs were routed: the run's summary.json does (its --top-k)."""
    tool = _tool("eval_bank_answers")
    summary = out / "summary.json"
    top_k = json.loads(summary.read_text()).get("top_k", tool.DEFAULT_TOP_K) if summary.exists() else tool.DEFAULT_TOP_K
    return tool.table(tool.summarize(read_jsonl(out / "questions.jsonl")), top_k)


def _eval_compose(part: str) -> Callable[[Path], str]:
    def make(out: Path) -> str:
        tool = _tool("eval_compose")
        summarize = getattr(tool, f"summarize_{part}")
        return tool.TABLES[part][1](summarize(tool.read_records(out, part)))

    return make


def _steering_generations(names: Callable[[ModuleType], Sequence[str]], effect: str = "sentiment") -> Callable[[Path], str]:
    def make(out: Path) -> str:
        tool = _tool("eval_steering")
        return tool.generation_table(tool.summarize_generations(read_jsonl(out / "generations.jsonl")), names(tool), effect=effect)

    return make


def _steering_retained(out: Path) -> str:
    tool = _tool("eval_steering")
    return tool.retained_table(tool.summarize_generations(read_jsonl(out / "generations.jsonl")))


def _steering_cosines(out: Path) -> str:
    tool = _tool("eval_steering")
    return tool.cosine_table(json.loads((out / "cosines.json").read_text()))


def _steering_dual(out: Path) -> str:
    tool = _tool("eval_steering")
    return tool.dual_table(tool.summarize_dual(read_jsonl(out / "dual.jsonl")))


def _eval_packet(index: int) -> Callable[[Path], str]:
    """tools/eval_packet.py prints four tables (quality, paired, cost, training) separated by blank lines: the INDEXth."""

    def make(out: Path) -> str:
        tool = _tool("eval_packet")
        summary = tool.summarize(read_jsonl(out / "answers.jsonl"), read_jsonl(out / "timing.jsonl"), read_jsonl(out / "training.jsonl"))
        return tool.tables(summary).split("\n\n")[index]

    return make


def _eval_exactness(out: Path) -> str:
    """One line per records file OUT/<device>-<dtype>.json, in name order."""
    return _tool("eval_exactness").table([read_jsonl(path) for path in sorted(out.glob("*.json"))])


def _eval_vllm(out: Path) -> str:
    """One line per arm and dtype, from every records file OUT/<arm>-<dtype>.jsonl."""
    tool = _tool("eval_vllm")
    return tool.table(tool.read_records(out))


def _steering_set(name: str) -> Callable[[ModuleType], Sequence[str]]:
    return lambda tool: tool.TABLE_SETS[name][1]


GENERATORS: dict[str, Generator] = {
    "eval_banks": Generator(("questions.jsonl",), _eval_banks, several=True),
    "eval_banks-sweep": Generator(("sweep.jsonl",), _eval_banks_sweep),
    "eval_banks-targets": Generator(("questions.jsonl",), _eval_banks_targets, several=True),
    "eval_rerank": Generator(("questions.jsonl",), _eval_rerank),
    "eval_packs": Generator(("questions.jsonl",), _eval_packs),
    "eval_bank_answers": Generator(("questions.jsonl",), _eval_bank_answers),
    **{f"eval_compose-{part}": Generator((f"{part}.jsonl",), _eval_compose(part)) for part in ("accumulation", "modes", "timing", "errata", "diagnosis")},
    **{
        f"eval_steering-{name}": Generator(("generations.jsonl",), _steering_generations(_steering_set(name)))
        for name in ("sweep", "layers", "pairs", "keys", "diagnosis")
    },
    "eval_steering-food": Generator(("generations.jsonl",), _steering_generations(lambda tool: tool.FOOD_CONDITIONS, effect="food_any")),
    "eval_steering-retained": Generator(("generations.jsonl",), _steering_retained),
    "eval_steering-cosines": Generator(("cosines.json",), _steering_cosines),
    "eval_steering-dual": Generator(("dual.jsonl",), _steering_dual),
    **{
        f"eval_packet-{name}": Generator(("answers.jsonl", "timing.jsonl", "training.jsonl"), _eval_packet(index))
        for index, name in enumerate(("quality", "paired", "cost", "training"))
    },
    "eval_exactness": Generator(("*.json",), _eval_exactness),
    "eval_vllm": Generator(("*.jsonl",), _eval_vllm),
}


@dataclass(frozen=True)
class Marked:
    """One marked table: its marker line, the kind and directory, and the lines between the markers (0-based, end excluded)."""

    marker: str
    line: int  # 1-based line of the opening marker
    kind: str
    directory: str
    start: int
    end: int


def marked_tables(lines: Sequence[str], where: str = "") -> list[Marked]:
    """The marked tables of a markdown file's lines; a malformed, unclosed or unopened marker raises DocTableError."""
    found: list[Marked] = []
    opened: tuple[int, re.Match] | None = None
    for index, line in enumerate(lines):
        text = line.strip()
        if text.startswith("<!-- table:"):
            match = OPEN.fullmatch(text)
            if match is None:
                raise DocTableError(f"{where}:{index + 1}: malformed marker {text!r}: write <!-- table: KIND DIR -->")
            if opened is not None:
                raise DocTableError(f"{where}:{opened[0] + 1}: marker {opened[1].group(0)!r} is not closed before line {index + 1}")
            opened = (index, match)
        elif text == CLOSE:
            if opened is None:
                raise DocTableError(f"{where}:{index + 1}: {CLOSE} without an opening <!-- table: KIND DIR -->")
            start, match = opened
            found.append(Marked(match.group(0), start + 1, match["kind"], match["dir"], start + 1, index))
            opened = None
    if opened is not None:
        raise DocTableError(f"{where}:{opened[0] + 1}: marker {opened[1].group(0)!r} is not closed ({CLOSE} missing)")
    return found


def generate(kind: str, directory: str, root: Path = REPO) -> str:
    """The table KIND makes from ROOT/DIRECTORY's records (no trailing newline)."""
    generator = GENERATORS.get(kind)
    if generator is None:
        raise DocTableError(f"unknown table kind {kind!r}; known: {', '.join(GENERATORS)}")
    outs = []
    for name in directory.split("+"):
        out = root / name
        if not out.is_dir():
            raise DocTableError(f"{kind}: results directory {name} does not exist (under {root})")
        for pattern in generator.records:
            if not any(out.glob(pattern)):
                raise DocTableError(f"{kind}: no records file {name}/{pattern}")
        outs.append(out)
    if len(outs) > 1 and not generator.several:
        raise DocTableError(f"{kind} is made from one results directory, not {len(outs)} ({directory})")
    return generator.make(outs if generator.several else outs[0]).rstrip("\n")  # type: ignore[arg-type]


def _generated(path: Path, root: Path) -> tuple[list[str], list[tuple[Marked, list[str]]]]:
    lines = path.read_text().split("\n")
    tables = []
    for marked in marked_tables(lines, str(path)):
        try:
            text = generate(marked.kind, marked.directory, root)
        except DocTableError as error:
            raise DocTableError(f"{path}:{marked.line}: {error}") from None
        tables.append((marked, text.split("\n")))
    return lines, tables


def check(path: Path, root: Path = REPO) -> list[str]:
    """One report per marked table that differs from its records: the marker and a unified diff (doc, then records)."""
    lines, tables = _generated(path, root)
    reports = []
    for marked, wanted in tables:
        present = lines[marked.start : marked.end]
        if present != wanted:
            diff = difflib.unified_diff(
                present, wanted, f"{path}:{marked.line + 1} (doc)", f"{marked.directory} ({marked.kind}, records)", lineterm=""
            )
            reports.append(f"{path}:{marked.line}: {marked.marker} differs from its records\n" + "\n".join(diff))
    return reports


def write(path: Path, root: Path = REPO) -> list[str]:
    """Rewrite every marked table of ``path`` from its records; returns the markers of the tables that changed."""
    lines, tables = _generated(path, root)
    changed = []
    for marked, wanted in reversed(tables):  # from the end, so earlier line numbers stay valid
        if lines[marked.start : marked.end] != wanted:
            lines[marked.start : marked.end] = wanted
            changed.append(f"{path}:{marked.line}: {marked.marker}")
    if changed:
        path.write_text("\n".join(lines))
    return changed[::-1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="exit 1 with a diff per marked table that differs from its records")
    action.add_argument("--write", action="store_true", help="rewrite the marked tables from their records")
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT_FILE, help="markdown file (default: docs/evaluation.md)")
    parser.add_argument("--root", type=Path, default=REPO, help="where marker directories are relative to (default: the repository)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            reports = check(args.file, args.root)
            for report in reports:
                print(report + "\n")
            if reports:
                print(f"{len(reports)} table(s) in {args.file} differ from their records: `tools/doc_tables.py --write` regenerates them")
                return 1
            return 0
        for marker in write(args.file, args.root):
            print(f"rewrote {marker}")
        return 0
    except (DocTableError, OSError, ValueError) as error:  # ValueError: a records line that is not JSON
        print(f"doc_tables: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
