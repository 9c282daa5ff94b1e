"""tools/eval/eval_banks.py on small banks: the three kinds of data, every mode, the real MiniLM embedder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.eval import eval_banks  # noqa: E402

pytestmark = pytest.mark.eval


def test_eval_banks_small(tmp_path: Path, kept_banks: Path) -> None:
    """Banks of 500 facts and the ckc bank (kept for the other bank evaluations), 60 questions each, every mode."""
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--sizes", "500", "--questions", "60", "--ckc-questions", "60", "--embedders", "all-minilm-l6-v2", "--vectors", "int8"]
    argv += ["--banks", str(kept_banks), "--out", str(out), "--figures", str(figures)]
    assert eval_banks.main(argv) == 0
    rows = {(r["dataset"], r["mode"]): r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert {d for d, _ in rows} == {"own 500", "second 500", "ckc tuning", "ckc held-out"}
    assert {m for _, m in rows} == set(eval_banks.MODES)
    for dataset in ("own 500", "second 500"):
        assert rows[dataset, "hybrid"]["top1"] >= 0.95, dataset
        assert rows[dataset, "hybrid"]["top1"] >= rows[dataset, "dense"]["top1"]
    assert rows["ckc held-out", "hybrid"]["top5"] >= 0.85
    assert rows["ckc held-out", "hybrid"]["questions"] == rows["ckc tuning", "dense"]["questions"] == 60
    assert all(r["vectors"] == "int8" and r["facts"] == (600 if r["dataset"].startswith("ckc") else 500) for r in rows.values())
    assert all(r["bytes_per_fact"] > 0 and r["p95_ms"] >= r["p50_ms"] for r in rows.values())
    assert {p.name for p in figures.iterdir()} == {"eval_banks_accuracy.png", "eval_banks_latency.png"}
    records = eval_banks.read_jsonl(out / "questions.jsonl")
    assert len(records) == sum(r["questions"] for r in rows.values()) and all(r["commit"] for r in records)
    again = {(r["dataset"], r["mode"]): r for r in eval_banks.rows_from_records(records)}
    assert {key: (r["top1"], r["top5"]) for key, r in again.items()} == {key: (r["top1"], r["top5"]) for key, r in rows.items()}
    assert eval_banks.main(argv + ["--report-only"]) == 0  # the table again, from the records alone
