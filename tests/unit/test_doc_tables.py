"""tools/eval/doc_tables.py: docs/evaluation.md's marked tables are what the records under results/ give (no model runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.eval import doc_tables  # noqa: E402

SECTION_KIND = "eval_compose-timing"  # a small records file: the section the edit tests copy


def _section() -> str:
    """The repository doc's marked timing table, markers included, between two lines of text."""
    lines = doc_tables.DEFAULT_FILE.read_text().split("\n")
    marked = next(m for m in doc_tables.marked_tables(lines) if m.kind == SECTION_KIND)
    return "Some text.\n\n" + "\n".join(lines[marked.start - 1 : marked.end + 1]) + "\n\nMore text.\n"


def test_the_repository_doc_matches_its_records(capsys) -> None:
    marked = doc_tables.marked_tables(doc_tables.DEFAULT_FILE.read_text().split("\n"))
    assert {m.kind for m in marked} >= {"eval_packs", "eval_bank_answers", "eval_compose-modes", "eval_steering-dual", "eval_packet-quality"}
    assert all(m.kind in doc_tables.GENERATORS for m in marked)
    assert doc_tables.main(["--check"]) == 0, capsys.readouterr().out


def test_a_changed_cell_fails_the_check_and_write_restores_it(tmp_path: Path, capsys) -> None:
    original = _section()
    lines = original.split("\n")
    assert lines[2].startswith("<!-- table:") and lines[3].startswith("| model |")
    row = lines[5]  # the table's first row, after the header and the alignment line
    edited = row.rsplit(" | ", 1)[0] + " | 999 |"  # its last cell changed
    assert edited != row
    changed = original.replace(row, edited)
    doc = tmp_path / "doc.md"
    doc.write_text(changed)
    assert doc_tables.main(["--check", str(doc)]) == 1
    out = capsys.readouterr().out
    assert f"<!-- table: {SECTION_KIND} results/eval_compose -->" in out
    assert f"{doc}:3:" in out  # where the marker is
    assert f"\n-{edited}\n+{row}\n" in out  # the doc's line, then the records'
    assert doc_tables.main(["--write", str(doc)]) == 0
    assert doc.read_text() == original
    assert doc_tables.main(["--check", str(doc)]) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- table: no_such_kind results/eval_compose -->\n| a |\n<!-- /table -->\n", "unknown table kind 'no_such_kind'"),
        ("<!-- table: eval_compose-timing results/eval_compose -->\n| a |\n", "is not closed"),
        ("| a |\n<!-- /table -->\n", "without an opening"),
        ("<!-- table: eval_compose-timing -->\n| a |\n<!-- /table -->\n", "malformed marker"),
        ("<!-- table: eval_compose-timing results/no-such-dir -->\n| a |\n<!-- /table -->\n", "results/no-such-dir does not exist"),
        ("<!-- table: eval_packs results/eval_compose -->\n| a |\n<!-- /table -->\n", "no records file results/eval_compose/questions.jsonl"),
    ],
)
def test_marker_and_records_errors(tmp_path: Path, capsys, text: str, message: str) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("Text.\n\n" + text)
    for action in ("--check", "--write"):
        assert doc_tables.main([action, str(doc)]) == 2
        assert message in capsys.readouterr().err
    assert doc.read_text() == "Text.\n\n" + text


def test_eval_banks_tables_come_from_question_records(tmp_path: Path) -> None:
    """eval_banks has no records in results/ yet: its generator on a few made-up records, through --root."""
    from tools.eval import eval_banks

    (tmp_path / "banks").mkdir()
    about = {"commit": "abc1234", "dataset": "own 10", "embedder": "all-minilm-l6-v2", "vectors": "fp16", "facts": 10, "clusters": 1,
             "build_s": 0.5, "bytes_per_fact": 800.0}
    records = [about | {"mode": mode, "question": i, "rank": rank, "ms": 2.0 + i} for mode in ("hybrid", "lexical") for i, rank in enumerate((0, 1, None))]
    (tmp_path / "banks" / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = doc_tables.generate("eval_banks", "banks", tmp_path)
    assert table == eval_banks.table(eval_banks.rows_from_records(records))
    assert table.count("\n| own 10 |") == 2 and "| 33.3 [" in table
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- table: eval_banks banks -->\n<!-- /table -->\n")
    assert doc_tables.main(["--check", str(doc), "--root", str(tmp_path)]) == 1
    assert doc_tables.main(["--write", str(doc), "--root", str(tmp_path)]) == 0
    assert doc.read_text() == f"<!-- table: eval_banks banks -->\n{table}\n<!-- /table -->\n"


def test_the_targets_table_gathers_several_runs(tmp_path: Path) -> None:
    """issue 38's targets from two results directories joined by +: a met target, a miss, and one not measured."""
    from tools.eval import eval_banks

    default = {"embedder": "all-minilm-l6-v2", "vectors": "int8", "mode": "hybrid", "clusters": 1, "build_s": 0.5}
    runs = {
        "third": [default | {"commit": "aaa1111", "dataset": "third 5,000", "facts": 5000, "bytes_per_fact": 600.0, "question": i,
                             "rank": 0, "ms": 10.0} for i in range(4)],
        "ckc": [default | {"commit": "bbb2222", "dataset": "ckc held-out", "facts": 600, "bytes_per_fact": 1400.0, "question": i,
                           "rank": rank, "ms": 20.0} for i, rank in enumerate((0, 0, 3, None))],
    }
    for name, records in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = doc_tables.generate("eval_banks-targets", "third+ckc", tmp_path)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert len(lines) == len(eval_banks.TARGETS)
    assert "(4 of 4) | aaa1111 | yes |" in lines["top-1 >= 99 % at 5,000 facts, generator nobody tuned on"]
    assert "not measured" in lines["top-1 >= 97 % at 100,000 facts, generator nobody tuned on"]
    assert "(3 of 4) | bbb2222 | **no** |" in lines["top-5 >= 97 % on the held-out ckc questions"]
    assert "1,400 B | bbb2222 | yes |" in lines["<= 1.5 KB per fact for paragraph-length facts, default vectors"]
    with pytest.raises(doc_tables.DocTableError, match="one results directory"):
        doc_tables.generate("eval_rerank", "third+ckc", tmp_path)


def test_the_lexical_weight_sweep_table_comes_from_its_question_records(tmp_path: Path) -> None:
    from tools.eval import eval_banks

    (tmp_path / "sweep").mkdir()
    records = [{"commit": "ccc3333", "dataset": "ckc tuning", "lexical_weight": w, "question": i, "rank": rank, "ms": 5.0}
               for w in (0.0, 0.2) for i, rank in enumerate((0, 2 if w == 0.0 else 0))]
    (tmp_path / "sweep" / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = doc_tables.generate("eval_banks-sweep", "sweep", tmp_path)
    assert table == eval_banks.sweep_table(eval_banks.sweep_rows_from_records(records))
    assert "| ckc tuning | 0 | 2 | 50.0 [" in table and "| ckc tuning | 0.2 | 2 | 100.0 [34.2, 100.0] |" in table  # (Wilson: no point interval)


def test_figures_in_prose_are_read_as_written() -> None:
    text = "contains 52.2 % [48.2, 56.0], +3.0 points, -0.058 nats, 14.6x, 1,020 answers, k = 3, `0.5 in code`, gemma3-270m, §4.3, 1.1e-5"
    assert [(f.text, f.value, f.signed, f.decimals) for f in doc_tables.figures_in(text)] == [
        ("52.2 %", 52.2, False, 1), ("48.2", 48.2, False, 1), ("56.0", 56.0, False, 1), ("+3.0", 3.0, True, 1), ("-0.058", -0.058, True, 3),
        ("14.6x", 14.6, False, 1),
    ]  # integers without a sign or % (1,020; 3) are not checked, nor code spans, names, section numbers or 1.1e-5
    assert [f.value for f in doc_tables.figures_in("1,020 answers, 17 %", checked_only=False)] == [1020.0, 17.0]
    values = [-0.0582, 52.0, 0.0461]
    assert doc_tables.figure_matches(doc_tables.figures_in("-0.058")[0], values)  # to the precision written
    assert doc_tables.figure_matches(doc_tables.figures_in("0.058")[0], values)  # unsigned: the magnitude
    assert not doc_tables.figure_matches(doc_tables.figures_in("+0.058")[0], values)  # signed: the sign too
    assert doc_tables.figure_matches(doc_tables.figures_in("52 %")[0], values) and doc_tables.figure_matches(doc_tables.figures_in("0.05")[0], values)
    assert not doc_tables.figure_matches(doc_tables.figures_in("52.4 %")[0], values)  # more precision than the records give


def test_a_prose_figure_not_in_its_records_fails_the_check_unless_quoted(tmp_path: Path, capsys) -> None:
    records = "results/eval_compose"
    table = doc_tables.generate(SECTION_KIND, records)
    ratio = next(cell for cell in table.split(" | ") if cell.endswith("x"))  # a figure the timing table holds, e.g. 14.6x
    doc = tmp_path / "doc.md"
    good = f"Text.\n\n<!-- figures: {SECTION_KIND} {records} quoted: 6.5 -->\n- exact is {ratio} slower (the paper: 6.5 %).\n<!-- /figures -->\n"
    doc.write_text(good)
    assert doc_tables.main(["--check", str(doc)]) == 0
    doc.write_text(good.replace(ratio, "99.9x"))
    assert doc_tables.main(["--check", str(doc)]) == 1
    out = capsys.readouterr().out
    assert f"{doc}:3: <!-- figures: {SECTION_KIND} {records} quoted: 6.5 -->: figures not in its records" in out and "line 4: 99.9" in out
    assert doc_tables.main(["--write", str(doc)]) == 1  # tables are rewritten; prose is only reported
    doc.write_text(good.replace(" quoted: 6.5", ""))
    assert doc_tables.main(["--check", str(doc)]) == 1 and "line 4: 6.5 %" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- figures: eval_compose-timing -->\n- 1.5\n<!-- /figures -->\n", "malformed marker"),
        ("<!-- figures: eval_compose-timing results/eval_compose -->\n- 1.5\n", "is not closed"),
        ("- 1.5\n<!-- /figures -->\n", "without an opening"),
        ("<!-- figures: no_such_kind results/eval_compose -->\n- 1.5\n<!-- /figures -->\n", "unknown table kind 'no_such_kind'"),
        ("<!-- figures: eval_compose-timing results/eval_compose -->\n<!-- table: eval_compose-timing results/eval_compose -->\n<!-- /table -->\n"
         "<!-- /figures -->\n", "a table marker inside the figures block"),
    ],
)
def test_figures_marker_errors(tmp_path: Path, capsys, text: str, message: str) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("Text.\n\n" + text)
    assert doc_tables.main(["--check", str(doc)]) == 2
    assert message in capsys.readouterr().err



def test_the_repository_doc_checks_figures_in_the_prose_of_every_section_it_marks() -> None:
    """issue 54: prose figures are checked like tables in the sections outside bank retrieval."""
    blocks = doc_tables.marked_figures(doc_tables.DEFAULT_FILE.read_text().split("\n"))
    kinds = {kind.split("-")[0] for block in blocks for kind, _ in block.records}
    assert kinds >= {"eval_packs", "eval_bank_answers", "eval_compose", "eval_steering", "eval_packet", "eval_exactness", "eval_vllm"}
