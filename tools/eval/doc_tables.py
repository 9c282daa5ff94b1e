"""The tables of docs/evaluation.md, generated from the evaluations' per-question records under results/.

A generated table is marked in the markdown by a comment line before it and one after it, with the
table (and any note lines its tool prints under it) between them and nothing else:

    <!-- table: KIND DIR -->
    | ... |
    <!-- /table -->

KIND names a generator (``GENERATORS``), DIR a results directory relative to the repository root (or
several joined by ``+``, for a table gathered from several runs); the generator makes the table from DIR's
records with the evaluation tool's own table function, as the tool's ``--report-only`` does. Records may be
kept compressed (``evallib.compressed``: questions.jsonl.gz for questions.jsonl). A superseded run whose
directory was removed from results/ is cited at a commit that still holds it, DIR@COMMIT
(``results/eval_packs-38@b486812``): its records are read from the git history (``git archive``), so the
table and the prose that quote it stay checked without the records in the tree.

Figures in prose are checked against the same records. A paragraph or list that quotes results is marked
by a comment line before it and one after it, naming the records its figures come from (one or more KIND
DIR pairs, the tables those generators make, whether or not the doc shows them) and, after ``quoted:``,
any figure it quotes from elsewhere (the paper, an issue, a one-off check), as written:

    <!-- figures: KIND DIR [KIND DIR ...] [quoted: 6.4 0.0003 ...] -->
    Prose citing 52.2 % [48.2, 56.0] and +3.0 points ...
    <!-- /figures -->

Every figure in the block must be one of the named records' values, to the precision it is written in
(``figure_matches``: 0.058 matches a table's -0.0582 when unsigned, +0.058 only a positive value), or be
quoted. A figure is a number written with a decimal point, a percent sign or a sign (+/-); plain integers
(counts, k, alpha, issue numbers) are not checked, nor anything in `code spans`. An unmatched figure is
reported with its line, like a table that differs. Run from the repository root:

    .venv/bin/python -m tools.eval.doc_tables --check [FILE]   # exit 1, with a diff per table and the prose figures not in the records
    .venv/bin/python -m tools.eval.doc_tables --write [FILE]   # rewrite the marked tables from the records (prose is reported, not rewritten)

FILE defaults to docs/evaluation.md. An unknown KIND, a missing DIR or records file, or a malformed or
unclosed marker is an error (exit 2). tests/unit/test_doc_tables.py runs ``--check`` on the repository's doc.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tools.lib.evallib import REPO, read_jsonl  # noqa: E402

DEFAULT_FILE = REPO / "docs" / "evaluation.md"
OPEN = re.compile(r"<!-- table: (?P<kind>\S+) (?P<dir>\S+) -->")
CLOSE = "<!-- /table -->"
FIGURES_OPEN = re.compile(r"<!-- figures: (?P<records>\S+ \S+(?: \S+ \S+)*?)(?: quoted: (?P<quoted>[^>]*?))? -->")
FIGURES_CLOSE = "<!-- /figures -->"
# A number in text: an optional sign, digits (with thousands commas), an optional decimal part, an optional "x" (times)
# or percent sign. Not inside a word or a dotted name (gemma3-270m, 2k, v1.2, §4.3, 1.1e-5): nothing alphanumeric,
# '.', '§' or '/' before it, nothing alphanumeric or further decimals after it.
NUMBER = re.compile(
    r"(?<![\w.§/])(?P<sign>[+-]|−)?(?P<digits>\d{1,3}(?:,\d{3})+|\d+)(?P<decimals>\.\d+)?(?P<times>x)?(?!\w|\.\d)(?P<percent>\s?%)?"
)
CODE_SPAN = re.compile(r"`[^`]*`")


class DocTableError(Exception):
    """A marker or records problem: the tables cannot be checked or written."""


def _tool(name: str) -> ModuleType:
    """tools/eval/NAME.py, imported only when a marker asks for one of its tables (each imports torch)."""
    return importlib.import_module(f"tools.eval.{name}")


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


def _eval_banks_targets_54(outs: list[Path]) -> str:
    eval_banks = _tool("eval_banks")
    rows = [row for out in outs for row in eval_banks.rows_from_records(read_jsonl(out / "questions.jsonl"))]
    return eval_banks.targets_table(rows, eval_banks.TARGETS_54)


def _eval_banks_fourth_forms(outs: list[Path]) -> str:
    return _tool("eval_banks").fourth_forms_table([record for out in outs for record in read_jsonl(out / "questions.jsonl")])


def _eval_banks_targets(outs: list[Path]) -> str:
    eval_banks = _tool("eval_banks")
    return eval_banks.targets_table([row for out in outs for row in eval_banks.rows_from_records(read_jsonl(out / "questions.jsonl"))])


def _eval_fusion(out: Path) -> str:
    return _tool("eval_fusion").sweep_table(read_jsonl(out / "sweep.jsonl"))


def _eval_banks_sweep(out: Path) -> str:
    eval_banks = _tool("eval_banks")
    return eval_banks.sweep_table(eval_banks.sweep_rows_from_records(read_jsonl(out / "sweep.jsonl")))


def _eval_rerank(out: Path) -> str:
    eval_rerank = _tool("eval_rerank")
    return eval_rerank.table(read_jsonl(out / "questions.jsonl"))


def _eval_cross(part: str) -> Callable[[Path], str]:
    """A table of tools/eval/eval_cross.py from one embedder's records (OUT/EMBEDDER: ``sweep``, ``paired``, ``cost``,
    ``measured``) or, for ``embedders``, from OUT itself (both embedders' sweeps)."""

    def make(out: Path) -> str:
        tool = _tool("eval_cross")
        if part == "embedders":
            return tool.embedders_table(out)
        if part == "measured":
            return tool.measured_table(read_jsonl(out / "measured.jsonl"))
        records = read_jsonl(out / "sweep.jsonl")
        if part == "paired":
            return tool.paired_table(records, tool.choose(records)[0])
        return tool.cost_table(records) if part == "cost" else tool.sweep_table(records)

    return make


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


def _eval_packet(name: str) -> Callable[[Path], str]:
    """One of tools/eval/eval_packet.py's tables by name (``TABLES``: quality, paired, cost, training, adapters, curve; the
    last two empty where the records hold no answer-token KL or no learning curve). The summary is made once per
    directory: its two-level bootstraps take a few seconds."""

    def make(out: Path) -> str:
        tool = _tool("eval_packet")
        key = str(out.resolve())
        if key not in _PACKET_TEXTS:
            summary = tool.summarize(read_jsonl(out / "answers.jsonl"), read_jsonl(out / "timing.jsonl"), read_jsonl(out / "training.jsonl"))
            _PACKET_TEXTS[key] = tool.table_texts(summary)
        return _PACKET_TEXTS[key][name]

    return make


_PACKET_TEXTS: dict[str, dict[str, str]] = {}


def _eval_exactness(out: Path) -> str:
    """One line per records file OUT/<device>-<dtype>.json, in name order."""
    return _tool("eval_exactness").table([read_jsonl(path) for path in sorted(out.glob("*.json"))])


def _eval_vllm(out: Path) -> str:
    """One line per arm and dtype, from every records file OUT/<arm>-<dtype>.jsonl."""
    tool = _tool("eval_vllm")
    return tool.table(tool.read_records(out))


def _eval_front(out: Path) -> str:
    """The front's fidelity per dtype, from every records file OUT/<dtype>.jsonl."""
    tool = _tool("eval_front")
    return tool.summary(tool.read_records(out))


def _steering_set(name: str) -> Callable[[ModuleType], Sequence[str]]:
    return lambda tool: tool.TABLE_SETS[name][1]


GENERATORS: dict[str, Generator] = {
    "eval_banks": Generator(("questions.jsonl",), _eval_banks, several=True),
    "eval_banks-sweep": Generator(("sweep.jsonl",), _eval_banks_sweep),
    "eval_fusion": Generator(("sweep.jsonl",), _eval_fusion),
    "eval_banks-fourth-forms": Generator(("questions.jsonl",), _eval_banks_fourth_forms, several=True),
    "eval_banks-targets-54": Generator(("questions.jsonl",), _eval_banks_targets_54, several=True),
    "eval_banks-targets": Generator(("questions.jsonl",), _eval_banks_targets, several=True),
    "eval_rerank": Generator(("questions.jsonl",), _eval_rerank),
    **{f"eval_cross-{part}": Generator(("sweep.jsonl",), _eval_cross(part)) for part in ("sweep", "paired", "cost")},
    "eval_cross-embedders": Generator(("*/sweep.jsonl",), _eval_cross("embedders")),
    "eval_cross-measured": Generator(("measured.jsonl",), _eval_cross("measured")),
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
        f"eval_packet-{name}": Generator(("answers.jsonl", "timing.jsonl", "training.jsonl"), _eval_packet(name))
        for name in ("quality", "paired", "cost", "training", "adapters", "curve")
    },
    "eval_exactness": Generator(("*.json",), _eval_exactness),
    "eval_vllm": Generator(("*.jsonl",), _eval_vllm),
    "eval_front": Generator(("*.jsonl",), _eval_front),
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


@dataclass(frozen=True)
class Figures:
    """One marked prose block: its marker line (1-based), the (KIND, DIR) records it cites, the figures it quotes from
    elsewhere, and its lines (0-based, end excluded)."""

    marker: str
    line: int
    records: tuple[tuple[str, str], ...]
    quoted: tuple[str, ...]
    start: int
    end: int


def marked_figures(lines: Sequence[str], where: str = "") -> list[Figures]:
    """The marked prose blocks of a markdown file's lines; a malformed, unclosed or unopened marker, or a table marker
    inside a block, raises DocTableError."""
    found: list[Figures] = []
    opened: tuple[int, re.Match] | None = None
    for index, line in enumerate(lines):
        text = line.strip()
        if text.startswith("<!-- figures:"):
            match = FIGURES_OPEN.fullmatch(text)
            if match is None:
                raise DocTableError(f"{where}:{index + 1}: malformed marker {text!r}: write <!-- figures: KIND DIR [KIND DIR ...] [quoted: N ...] -->")
            if opened is not None:
                raise DocTableError(f"{where}:{opened[0] + 1}: marker {opened[1].group(0)!r} is not closed before line {index + 1}")
            opened = (index, match)
        elif text == FIGURES_CLOSE:
            if opened is None:
                raise DocTableError(f"{where}:{index + 1}: {FIGURES_CLOSE} without an opening <!-- figures: ... -->")
            start, match = opened
            words = match["records"].split()
            records = tuple(zip(words[::2], words[1::2]))
            quoted = tuple((match["quoted"] or "").split())
            found.append(Figures(match.group(0), start + 1, records, quoted, start + 1, index))
            opened = None
        elif opened is not None and (text.startswith("<!-- table:") or text == CLOSE):
            raise DocTableError(f"{where}:{index + 1}: a table marker inside the figures block opened at line {opened[0] + 1}")
    if opened is not None:
        raise DocTableError(f"{where}:{opened[0] + 1}: marker {opened[1].group(0)!r} is not closed ({FIGURES_CLOSE} missing)")
    return found


@dataclass(frozen=True)
class Figure:
    """A number as written in text: its value, whether it has a sign, and how many decimals it is written to."""

    text: str
    value: float
    signed: bool
    decimals: int


def figures_in(text: str, *, checked_only: bool = True) -> list[Figure]:
    """The numbers in ``text`` outside `code spans`; with ``checked_only``, only those a prose check covers: with a
    decimal point, a percent sign or a sign."""
    found = []
    for match in NUMBER.finditer(CODE_SPAN.sub(" ", text)):
        sign = match["sign"] or ""
        if checked_only and not (sign or match["decimals"] or match["percent"]):
            continue
        number = match["digits"].replace(",", "") + (match["decimals"] or "")
        value = float(number) * (-1 if sign in ("-", "−") else 1)
        found.append(Figure(match.group(0).strip(), value, bool(sign), len(match["decimals"] or ".") - 1))
    return found


def figure_matches(figure: Figure, values: Sequence[float]) -> bool:
    """Whether ``figure`` is one of ``values`` to the precision it is written in: within half a unit of its last
    digit; a signed figure against the signed values, an unsigned one against their magnitudes."""
    tolerance = 0.5 * 10 ** -figure.decimals + 1e-9
    if figure.signed:
        return any(abs(value - figure.value) <= tolerance for value in values)
    return any(abs(abs(value) - figure.value) <= tolerance for value in values)


_ARCHIVED: dict[tuple[str, str, str], Path] = {}  # (root, commit, directory) -> where its records were extracted
_SCRATCH: list[tempfile.TemporaryDirectory] = []  # made on the first DIR@COMMIT, removed when the process ends


def archived(root: Path, name: str, commit: str) -> Path:
    """ROOT/NAME as the commit COMMIT of ROOT's git repository holds it, extracted once per process into a scratch
    directory; DocTableError when the history lacks it (a shallow clone, a wrong commit or path)."""
    key = (str(root), commit, name)
    if key not in _ARCHIVED:
        if not _SCRATCH:
            _SCRATCH.append(tempfile.TemporaryDirectory(prefix="doc-tables-"))
        into = Path(_SCRATCH[0].name) / commit / name
        archive = subprocess.run(["git", "archive", "--format=tar", commit, "--", name], cwd=root, capture_output=True)
        if archive.returncode != 0:
            why = archive.stderr.decode(errors="replace").strip()
            raise DocTableError(f"{name}@{commit}: not in the git history here ({why}); a full clone holds it")
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(Path(_SCRATCH[0].name) / commit, filter="data")
        _ARCHIVED[key] = into
    return _ARCHIVED[key]


def has_records(out: Path, pattern: str) -> bool:
    """Whether ``out`` holds a records file matching ``pattern``, plain or compressed."""
    return any(out.glob(pattern)) or any(out.glob(pattern + ".gz"))


def generate(kind: str, directory: str, root: Path = REPO) -> str:
    """The table KIND makes from ROOT/DIRECTORY's records (no trailing newline); a part NAME@COMMIT of DIRECTORY is
    read at that commit (``archived``)."""
    generator = GENERATORS.get(kind)
    if generator is None:
        raise DocTableError(f"unknown table kind {kind!r}; known: {', '.join(GENERATORS)}")
    outs = []
    for part in directory.split("+"):
        name, _, commit = part.partition("@")
        out = archived(root, name, commit) if commit else root / name
        if not out.is_dir():
            raise DocTableError(f"{kind}: results directory {part} does not exist (under {root})")
        for pattern in generator.records:
            if not has_records(out, pattern):
                raise DocTableError(f"{kind}: no records file {part}/{pattern}")
        outs.append(out)
    if len(outs) > 1 and not generator.several:
        raise DocTableError(f"{kind} is made from one results directory, not {len(outs)} ({directory})")
    return generator.make(outs if generator.several else outs[0]).rstrip("\n")  # type: ignore[arg-type]


def _generated(path: Path, root: Path, made: dict[tuple[str, str], str] | None = None) -> tuple[list[str], list[tuple[Marked, list[str]]]]:
    """The file's lines and each marked table with the lines its records give; ``made`` caches generated texts."""
    made = {} if made is None else made
    lines = path.read_text().split("\n")
    tables = []
    for marked in marked_tables(lines, str(path)):
        tables.append((marked, _made(made, marked.kind, marked.directory, root, f"{path}:{marked.line}").split("\n")))
    return lines, tables


def _made(made: dict[tuple[str, str], str], kind: str, directory: str, root: Path, where: str) -> str:
    if (kind, directory) not in made:
        try:
            made[kind, directory] = generate(kind, directory, root)
        except DocTableError as error:
            raise DocTableError(f"{where}: {error}") from None
    return made[kind, directory]


def check_figures(path: Path, root: Path = REPO, made: dict[tuple[str, str], str] | None = None) -> list[str]:
    """One report per marked prose block with figures that are neither among its records' values nor quoted: the
    marker and each such figure with its line."""
    made = {} if made is None else made
    lines = path.read_text().split("\n")
    reports = []
    for block in marked_figures(lines, str(path)):
        values = [f.value for kind, directory in block.records
                  for f in figures_in(_made(made, kind, directory, root, f"{path}:{block.line}"), checked_only=False)]
        missing = []
        for number in range(block.start, block.end):
            for figure in figures_in(lines[number]):
                if figure.text.rstrip(" %") not in block.quoted and figure.text not in block.quoted and not figure_matches(figure, values):
                    missing.append(f"  line {number + 1}: {figure.text}")
        if missing:
            reports.append(f"{path}:{block.line}: {block.marker}: figures not in its records (nor quoted):\n" + "\n".join(missing))
    return reports


def check(path: Path, root: Path = REPO) -> list[str]:
    """One report per marked table that differs from its records (the marker and a unified diff, doc then records),
    then one per marked prose block with figures its records do not hold (``check_figures``)."""
    made: dict[tuple[str, str], str] = {}
    lines, tables = _generated(path, root, made)
    reports = []
    for marked, wanted in tables:
        present = lines[marked.start : marked.end]
        if present != wanted:
            diff = difflib.unified_diff(
                present, wanted, f"{path}:{marked.line + 1} (doc)", f"{marked.directory} ({marked.kind}, records)", lineterm=""
            )
            reports.append(f"{path}:{marked.line}: {marked.marker} differs from its records\n" + "\n".join(diff))
    return reports + check_figures(path, root, made)


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
                print(f"{len(reports)} table(s) or prose block(s) in {args.file} differ from their records: `python -m tools.eval.doc_tables --write` "
                      "regenerates the tables; prose figures are edited by hand")
                return 1
            return 0
        for marker in write(args.file, args.root):
            print(f"rewrote {marker}")
        prose = check_figures(args.file, args.root)
        for report in prose:
            print(report + "\n")
        return 1 if prose else 0
    except (DocTableError, OSError, ValueError) as error:  # ValueError: a records line that is not JSON
        print(f"doc_tables: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
