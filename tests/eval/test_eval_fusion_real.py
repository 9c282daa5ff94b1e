"""tools/eval/eval_fusion.py on small banks with the real MiniLM embedder: the dump and the sweep run, and the sweep's
figures for the default rule are the route's own (eval_banks measuring the same banks with ``route``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packstore.bank.bank import FUSION  # noqa: E402
from tools.eval import (
    eval_banks,  # noqa: E402
    eval_fusion,  # noqa: E402
)

pytestmark = pytest.mark.eval


def test_the_sweep_reproduces_the_route_on_the_tuning_data(tmp_path: Path, kept_banks: Path) -> None:
    banks, candidates, out = kept_banks, tmp_path / "candidates", tmp_path / "out"  # the ckc bank of test_eval_banks_real.py
    assert eval_fusion.main(["dump", "--sizes", "300", "--questions", "40", "--banks", str(banks), "--candidates", str(candidates)]) == 0
    assert sorted(path.stem for path in candidates.glob("*.npz")) == ["ckc_tuning", "own_300", "second_300", "third_300"]
    assert eval_fusion.main(["sweep", "--candidates", str(candidates), "--out", str(out)]) == 0
    swept = {(r["dataset"], r["rule"]): r for r in eval_fusion.read_jsonl(out / "sweep.jsonl")}
    assert (out / "sweep.md").read_text().startswith("chosen: ")
    datasets = [eval_banks.own_dataset(300, 40), eval_banks.second_dataset(300, 40), eval_banks.third_dataset(300, 40)]
    rows = eval_banks.evaluate(datasets, [eval_fusion.EMBEDDER], ["hybrid"], tmp_path, ["int8"], banks=banks)
    for row in rows:  # the same banks, routed by route(): the same top-1 and top-5 as the sweep's row for the default
        record = swept[row["dataset"].replace(",", "").replace(" ", "_"), FUSION.name]
        assert (record["top1"], record["top5"]) == (round(row["top1"] * row["questions"]), round(row["top5"] * row["questions"]))
