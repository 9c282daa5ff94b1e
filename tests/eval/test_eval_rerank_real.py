"""tools/eval/eval_rerank.py on small banks: both second stages run on the real embedder and smollm2-135m, records in, table out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.eval import eval_rerank  # noqa: E402

pytestmark = [pytest.mark.eval, pytest.mark.model]


def test_eval_rerank_small(tmp_path: Path, kept_banks: Path, shared_model) -> None:
    """The banks of tests/eval/test_eval_banks_real.py (500 facts, the ckc paragraphs), reused when that test ran first."""
    shared_model(eval_rerank)
    argv = ["--size", "500", "--questions", "6", "--lm-questions", "2", "--banks", str(kept_banks), "--out", str(tmp_path)]
    assert eval_rerank.main(argv) == 0
    records = eval_rerank.read_jsonl(tmp_path / "questions.jsonl")
    stages = {(r["dataset"], r["stage"]) for r in records}
    assert stages == {(d, s) for d in ("own 500", "second 500", "ckc tuning") for s in ("late", "lm")}
    assert all(set(r["rank_after"]) == {f"{w:g}" for w in eval_rerank.WEIGHTS} and r["commit"] for r in records)
    assert (tmp_path / "table.md").read_text() == eval_rerank.table(records) + "\n"
