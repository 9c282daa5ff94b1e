"""tools/doc_tables.py: docs/evaluation.md's marked tables are what the records under results/ give (no model runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import doc_tables  # noqa: E402

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
    import eval_banks

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
    import eval_banks

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
    import eval_banks

    (tmp_path / "sweep").mkdir()
    records = [{"commit": "ccc3333", "dataset": "ckc tuning", "lexical_weight": w, "question": i, "rank": rank, "ms": 5.0}
               for w in (0.0, 0.2) for i, rank in enumerate((0, 2 if w == 0.0 else 0))]
    (tmp_path / "sweep" / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = doc_tables.generate("eval_banks-sweep", "sweep", tmp_path)
    assert table == eval_banks.sweep_table(eval_banks.sweep_rows_from_records(records))
    assert "| ckc tuning | 0 | 2 | 50.0 [" in table and "| ckc tuning | 0.2 | 2 | 100.0 [100.0, 100.0] |" in table
