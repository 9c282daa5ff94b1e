"""tools/eval_packet.py: training data, question arrangements, FLOPs, and a whole run on the tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import eval_packet  # noqa: E402
from evallib import load_rows  # noqa: E402


def test_training_examples_mix_both_generators_and_never_ckc() -> None:
    examples = eval_packet.training_examples(20, seed=0)
    assert len(examples) == 20 and all(2 <= len(e.documents) <= 4 for e in examples)
    assert eval_packet.training_examples(20, seed=0) == examples and eval_packet.training_examples(20, seed=1) != examples
    paragraphs = {row.context for row in load_rows()}
    assert not any(fact in paragraphs for e in examples for doc in e.documents for fact in doc)


def test_questions_hold_the_gold_paragraph_once_among_2_to_5() -> None:
    rows = load_rows()
    asked = eval_packet.questions(rows, seed=1, count=30, pool=rows)
    assert len({row.id for row, _ in asked}) == 30
    assert not {row.id for row, _ in asked} & {row.id for row, _ in eval_packet.questions(rows, seed=0, count=30, pool=rows)}
    for row, parts in asked:
        assert 2 <= len(parts) <= 5 and sum(p.context == row.context for p in parts) == 1
    assert asked == eval_packet.questions(rows, seed=1, count=30, pool=rows)


def test_a_whole_run_on_the_tiny_model(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", str(tiny_model_dir), "--seeds", "0", "--questions", "2", "--examples", "6", "--steps", "1"]
    argv += ["--timing", "1", "--repeats", "1", "--max-new-tokens", "4", "--out", str(out), "--figures", str(figures)]
    assert eval_packet.main(argv) == 0
    capsys.readouterr()
    [entry] = json.loads((out / "summary.json").read_text())["models"].values()
    methods = entry["methods"]
    assert methods["full"]["logit_cosine"] > 0.9999 and methods["full"]["same_answer"] == 1.0
    assert methods["none"]["gflops"] < methods["selective"]["gflops"] < methods["full"]["gflops"]
    assert methods["none"]["gflops"] < methods["packet"]["gflops"] < methods["full"]["gflops"]
    assert set(entry["ttft"]) == set(eval_packet.METHODS) and len(entry["training"]) == 1
    assert {p.name for p in figures.iterdir()} == {"eval_packet_quality.png", "eval_packet_cost.png"}
