"""tools/eval/eval_packet.py: training data, the shared held-out questions, and a whole run on the tiny model (two seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.eval import eval_packet  # noqa: E402
from tools.lib.evallib import frozen_split, load_rows  # noqa: E402


def test_training_examples_mix_both_generators_and_never_ckc() -> None:
    short = eval_packet.training_examples(20, seed=0, shape="facts")
    assert len(short) == 20 and all(2 <= len(e.documents) <= 4 and all(2 <= len(d) <= 5 for d in e.documents) for e in short)
    examples = eval_packet.training_examples(20, seed=0)  # paragraphs: shaped like the test contexts
    assert len(examples) == 20 and all(2 <= len(e.documents) <= 5 and all(6 <= len(d) <= 10 for d in e.documents) for e in examples)
    assert all(any(e.question and d for d in e.documents) for e in examples)
    assert eval_packet.training_examples(20, seed=0) == examples and eval_packet.training_examples(20, seed=1) != examples
    paragraphs = {row.context for row in load_rows()}
    assert not any(fact in paragraphs for e in examples for doc in e.documents for fact in doc)


def test_questions_are_the_held_out_half_each_with_the_gold_paragraph_once_among_2_to_5() -> None:
    rows = load_rows()
    asked = eval_packet.questions(rows, 30, rows)
    held_out = frozen_split(rows)[1]
    assert [row.id for row, _ in asked] == [row.id for row in held_out[:30]]
    for row, parts in asked:
        assert 2 <= len(parts) <= 5 and sum(p.context == row.context for p in parts) == 1
    assert asked == eval_packet.questions(rows, 30, rows)  # the same arrangements for every seed and run
    assert len(eval_packet.questions(rows, None, rows)) == len(held_out) == 288


def test_a_whole_run_on_the_tiny_model(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", str(tiny_model_dir), "--seeds", "0", "1", "--questions", "2", "--examples", "6", "--steps", "2"]
    argv += ["--curve-every", "1", "--ablate-tokens", "2", "--ablate-learning-rates", "0.01", "--ablate-steps", "3"]
    argv += ["--timing", "1", "--repeats", "1", "--max-new-tokens", "4", "--out", str(out), "--figures", str(figures)]
    assert eval_packet.main(argv) == 0
    capsys.readouterr()
    [entry] = json.loads((out / "summary.json").read_text())["models"].values()
    methods = entry["methods"]
    assert methods["full"]["logit_cosine"] > 0.9999 and methods["full"]["same_answer"] == 1.0
    assert methods["full"]["answer_kl"]["mean"] < 1e-6 and methods["full"]["answer_top1"]["mean"] == 1.0
    assert methods["none"]["answer_kl"]["mean"] > 0
    assert methods["full"]["seeds"] == [] and methods["packet"]["seeds"] == [0, 1]  # full, none, selective once a question
    assert all(m["questions"] == 2 for m in methods.values())
    records = eval_packet.read_jsonl(out / "answers.jsonl")
    assert sorted(str(r["seed"]) for r in records) == ["0", "0", "1", "1", "None", "None"]
    assert {r["id"] for r in records if r["seed"] == 0} == {r["id"] for r in records if r["seed"] is None}
    assert set(entry["paired"]) == {f"{a} - {b}" for a, b in eval_packet.COMPARISONS}
    assert all({"contains", "f1", "answer_kl", "answer_top1"} <= set(d) for d in entry["paired"].values())  # KL paired too
    assert entry["paired"]["packet - full"]["answer_kl"]["mean"] == pytest.approx(methods["packet"]["answer_kl"]["mean"], abs=1e-9)
    assert methods["none"]["gflops"] < methods["selective"]["gflops"] < methods["full"]["gflops"]
    assert methods["none"]["gflops"] < methods["packet"]["gflops"] < methods["full"]["gflops"]
    assert set(entry["ttft"]) == set(eval_packet.METHODS) and len(entry["training"]) == 5  # two seeds and three ablations
    trained = eval_packet.read_jsonl(out / "training.jsonl")
    expected = [(0, 4, 0.03, 2, False), (1, 4, 0.03, 2, False), (0, 2, 0.03, 2, True), (0, 4, 0.01, 2, True), (0, 4, 0.03, 3, True)]
    assert [(t["seed"], t["tokens"], t["learning_rate"], t["steps"], t["ablation"]) for t in trained] == expected
    assert all([step for step, _ in t["curve"]] == list(range(1, t["steps"] + 1)) and t["shape"] == "paragraphs" and t["commit"] for t in trained)
    assert (out / "adapters" / f"{tiny_model_dir.name}-seed0-t2.pack").exists()
    assert (out / "adapters" / f"{tiny_model_dir.name}-seed0-t4-lr0.01.pack").exists()
    assert (out / "adapters" / f"{tiny_model_dir.name}-seed0-t4-s3.pack").exists()
    assert {p.name for p in figures.iterdir()} == {"eval_packet_quality.png", "eval_packet_cost.png", "eval_packet_curve.png"}
    texts = eval_packet.table_texts(eval_packet.summarize(records, [], trained))
    assert list(texts) == list(eval_packet.TABLES) and all(texts.values())  # with the adapters' gap closed on ckc, and the curves
    assert [a["seed"] for a in entry["adapters"]] == [0, 1, "all"] and "| all (mean) |" in texts["adapters"]
    paired = texts["paired"]
    assert "p " in paired and "(Holm " in paired and "family of all 12 paired differences" in paired


def test_an_adapter_trained_before_any_answer_has_its_training_row(tmp_path: Path) -> None:
    trained = {"model": "m", "seed": 0, "tokens": 4, "shape": "paragraphs", "ablation": False, "steps": 300, "examples": 96,
               "train_seconds": 600.0, "peak_rss_mb": 900.0, "holdout_kl_no_adapter": 0.08, "holdout_kl_before": 0.09,
               "holdout_kl_after": 0.03, "curve": [[50, 0.06]]}
    summary = eval_packet.summarize([], [], [trained])
    assert summary["m"]["methods"] == {} and summary["m"]["tokens"] is None
    training = eval_packet.table_texts(summary)["training"]
    assert "| m | 0 | 4 | - | paragraphs | 300 | 96 | 10.0 | 900 | 0.0800 | 0.0900 | 0.0300 | - | +62% | yes |" in training
    eval_packet.plot(summary, tmp_path)  # nothing to draw for a model without answers, and no error
