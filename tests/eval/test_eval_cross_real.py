"""tools/eval/eval_cross.py on small banks: the dump, the sweep with its paired tests, and the held-out measurement,
on the real embedder and cross-encoder; records in, tables out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.eval import eval_cross  # noqa: E402

pytestmark = [pytest.mark.eval, pytest.mark.model]


def test_eval_cross_small(tmp_path: Path, kept_banks: Path) -> None:
    """The banks of tests/eval/test_eval_banks_real.py (500 facts, the ckc paragraphs), reused when that test ran first."""
    common = ["--sizes", "500", "--questions", "6", "--banks", str(kept_banks), "--dumps", str(tmp_path / "dumps"), "--out", str(tmp_path)]
    assert eval_cross.main(["dump", *common]) == 0
    assert eval_cross.main(["sweep", *common]) == 0
    records = eval_cross.read_jsonl(tmp_path / eval_cross.EMBEDDERS[0] / "sweep.jsonl")
    datasets = {r["dataset"] for r in records}
    assert datasets == {"own_500", "second_500", "third_500", "fourth_500", "ckc_tuning"}
    rules = {r["rule"] for r in records}
    per_bound = 1 + len(eval_cross.NS) * len(eval_cross.WEIGHTS)  # the fused order, and each cross rule, per pool bound
    assert len(rules) == len(eval_cross.RARE_BOUNDS) * per_bound + 1 and all(len(r["places"]) == 6 for r in records)
    assert {r["bound"] for r in records} == set(eval_cross.RARE_BOUNDS)
    chosen, _ = eval_cross.choose(records)
    assert chosen.startswith("cross") and chosen in (tmp_path / eval_cross.EMBEDDERS[0] / "sweep.md").read_text()
    assert eval_cross.main(["measure", *common]) == 0
    measured = eval_cross.read_jsonl(tmp_path / eval_cross.EMBEDDERS[0] / "measured.jsonl")
    assert {r["dataset"] for r in measured} == {"fifth 500", "ckc held-out"} and len(measured) == 12
    assert all(r["cross"]["ms"] > 0 and -1 <= r["cross"]["place"] < 5 for r in measured)
    assert "fifth 500" in eval_cross.measured_table(measured)
