"""The evaluation harness: the three answer metrics, the seeded split, intervals, resuming, and eval_packs on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packstore.bank.bank import open_banks
from packstore.kv.inject import Sampling  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tests.helpers.banks import TEST_BANK_CACHE
from tools.eval import eval_packs  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    METRICS,
    Row,
    answer_scores,
    asked,
    bare_question,
    compress_records,
    compressed,
    contains_answer,
    frozen_split,
    holm,
    jsonl_appender,
    load_rows,
    mean_interval,
    metric_headers,
    metric_intervals,
    normalize,
    paired_difference,
    proportion_interval,
    read_jsonl,
    record_files,
    resumed_records,
    split_rows,
    token_f1,
    two_level_interval,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  A   cat, an owl and THE dog. ", "cat owl and dog"),
        ("Theatre anthem", "theatre anthem"),
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_is_squad_style(text: str, expected: str) -> None:
    assert normalize(text) == expected


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        ("It was played by Zayed Khan.", ["Zayed Khan"], True),
        ("zayed khan", ["The Zayed Khan"], True),
        ("Neal Schon", ["Brick", "Neal Schon"], True),
        ("In 1915.", ["5"], False),
        ("Zayed", ["Zayed Khan"], False),
        ("anything", ["the"], False),
    ],
)
def test_contains_is_whole_word_containment(prediction: str, answers: list[str], expected: bool) -> None:
    assert contains_answer(prediction, answers) is expected


def test_every_metric_is_scored_and_recomputed_from_the_answers() -> None:
    """contains and F1; no strict exact match (answers are sentences and no extraction was validated, issue 54)."""
    assert answer_scores("It was Zayed Khan", ["Zayed Khan"]) == {"contains": 1.0, "f1": pytest.approx(2 / 3)}
    assert list(answer_scores("x", ["y"])) == list(METRICS) == ["contains", "f1"]
    intervals = metric_intervals(["Zayed Khan", "no idea"], [["Zayed Khan"], ["Brick"]])
    assert {m: i.mean for m, i in intervals.items()} == {"contains": 0.5, "f1": 0.5}
    assert metric_headers() == ["contains % [Wilson 95%]", "F1 % [95% CI]"]
    with pytest.raises(ValueError):
        metric_intervals(["one"], [])


def test_the_short_prompt_follows_the_question_and_routing_takes_it_off() -> None:
    assert asked(" who? ", "open") == "who?"
    assert asked("who?", "short").startswith("who?\n\nAnswer with only the answer")
    assert bare_question(asked(" who sang? ", "short")) == bare_question(asked("who sang?", "open")) == "who sang?"


def test_proportions_get_wilson_intervals_that_do_not_collapse_at_the_extremes() -> None:
    """Issue 54: a percentile bootstrap gave 0.0 [0.0, 0.0] on 600 answers; Wilson gives [0, 0.6 %]."""
    none = proportion_interval([0] * 600)
    assert none.mean == none.low == 0.0 and none.high == pytest.approx(0.00636, abs=1e-5)
    every = proportion_interval([True] * 1000)
    assert every.mean == every.high == 1.0 and every.low == pytest.approx(0.99617, abs=1e-5)
    half = proportion_interval([1, 0] * 50)
    assert half.low < 0.5 < half.high
    with pytest.raises(ValueError):
        proportion_interval([0.5])


def test_paired_differences_carry_a_p_value_and_holm_adjusts_a_family() -> None:
    same = paired_difference([1, 0, 1, 0], [1, 0, 1, 0])
    assert same.mean == 0.0 and same.p == 1.0
    better = paired_difference([1.0] * 40, [0.0] * 30 + [1.0] * 10)
    assert better.low > 0 and better.p < 0.01
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm([0.001, 0.9]) == pytest.approx([0.002, 0.9]) and holm([]) == []


def test_the_two_level_interval_resamples_seeds_as_well_as_questions() -> None:
    """Three adapters that disagree: the interval over seeds and questions is wider than the one over questions of
    their pooled means; one seed is the plain bootstrap over questions; each seed its own questions works too."""
    questions = [f"q{i}" for i in range(60)]
    by_seed = {seed: {q: float(i % 4 == 0) + offset for i, q in enumerate(questions)} for seed, offset in ((0, -0.2), (1, 0.0), (2, 0.2))}
    two_level = two_level_interval(by_seed, resamples=4000)
    pooled = mean_interval([sum(by_seed[s][q] for s in by_seed) / 3 for q in questions], resamples=4000)
    assert two_level.mean == pytest.approx(pooled.mean) and two_level.high - two_level.low > 1.5 * (pooled.high - pooled.low)
    assert two_level.p is not None and 0 < two_level.p <= 1
    one = two_level_interval({0: by_seed[1]}, resamples=4000)
    assert one.low < one.mean < one.high
    nested = two_level_interval({s: {f"{s}-{q}": v for q, v in values.items()} for s, values in by_seed.items()}, resamples=2000)
    assert nested.mean == pytest.approx(two_level.mean) and nested.low < nested.mean < nested.high


def test_token_f1_is_the_best_over_gold_answers() -> None:
    assert token_f1("Zayed Khan", ["Zayed Khan"]) == 1.0
    assert token_f1("the", ["the"]) == 0.0
    assert token_f1("nothing here", ["Zayed Khan"]) == 0.0
    # "Big Daddy was Zayed Khan" -> big daddy was zayed khan: precision 2/5, recall 1 -> 4/7
    assert token_f1("Big Daddy was Zayed Khan", ["Paul Newman", "Zayed Khan"]) == pytest.approx(4 / 7)


def test_split_is_deterministic_and_complete() -> None:
    rows = [Row(f"r{i}", "q", "c", ("a",)) for i in range(200)]
    first, rest = split_rows(rows, 0.5, seed=3)
    assert split_rows(list(reversed(rows)), 0.5, seed=3)[0] == list(reversed(first))
    assert sorted(r.id for r in first + rest) == sorted(r.id for r in rows)
    assert 70 < len(first) < 130
    assert split_rows(rows, 0.5, seed=4)[0] != first


def test_mean_interval_brackets_the_mean() -> None:
    interval = mean_interval([1, 0, 1, 1, 0, 1, 0, 1])
    assert interval.low <= interval.mean == 0.625 <= interval.high
    assert mean_interval([1, 1, 1]).low == 1.0


def test_eval_packs_on_the_tiny_model(tiny_lm, tmp_path: Path) -> None:
    rows = load_rows(limit=3)
    with LmdbStore(tmp_path / "store") as store:
        records = eval_packs.evaluate(tiny_lm, rows, store, Sampling(max_new_tokens=4))
        assert store.keys() == []
    assert [r["id"] for r in records] == [r.id for r in rows]
    assert not any(r["divergent"] for r in records)
    for record in records:
        assert record["prompt"] == "short" and record["commit"]
        assert set(record["conditions"]) == set(eval_packs.CONDITIONS)
        assert set(METRICS) <= set(record["conditions"]["pack"])
        text, pack = record["conditions"]["text"], record["conditions"]["pack"]
        assert text["answer"] == pack["answer"]
        assert pack["prompt_tokens"] + record["pack_tokens"] == text["prompt_tokens"]
    table = eval_packs.write_report(records, tmp_path / "out", tmp_path / "figures", {"rows_per_model": 3})
    assert "divergences (b) vs (c): 0 of 3" in table
    assert len((tmp_path / "out" / "questions.jsonl").read_text().splitlines()) == 3
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["models"][tiny_lm.name]["conditions"]["pack"]["contains"].keys() == {"mean", "low", "high", "p"}
    for png in ("eval_packs_accuracy.png", "eval_packs_prompt_tokens.png"):
        assert (tmp_path / "figures" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    redrawn = tmp_path / "redrawn"
    assert eval_packs.main(["--report-only", "--out", str(tmp_path / "out"), "--figures", str(redrawn)]) == 0
    assert len(list(redrawn.glob("*.png"))) == 2
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["rows_per_model"] == 3


def test_the_frozen_ckc_split_is_the_seeded_half_and_covers_every_row() -> None:
    rows = load_rows()
    tuning, held_out = frozen_split(rows)
    assert (tuning, held_out) == split_rows(rows, 0.5, seed=13)
    assert {r.id for r in tuning}.isdisjoint(r.id for r in held_out)
    assert len(tuning) + len(held_out) == len(rows) == 600


def test_a_run_resumes_only_under_the_same_settings(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert resumed_records(out, "questions", {"max_new_tokens": 24}, fresh=False) == []
    (out / "questions.jsonl").write_text(json.dumps({"model": "m", "id": "ckc-1"}) + "\n")
    assert resumed_records(out, "questions", {"max_new_tokens": 24}, fresh=False) == [{"model": "m", "id": "ckc-1"}]
    with pytest.raises(SystemExit, match="pass --fresh"):
        resumed_records(out, "questions", {"max_new_tokens": 32}, fresh=False)
    assert resumed_records(out, "other", {"max_new_tokens": 32}, fresh=False) == []  # each part has its own settings
    assert json.loads((out / "settings.json").read_text()) == {"questions": {"max_new_tokens": 24}, "other": {"max_new_tokens": 32}}
    assert resumed_records(out, "questions", {"max_new_tokens": 32}, fresh=True) == []
    assert (out / "questions.jsonl").read_text() == ""


def test_appended_records_name_the_commit_that_made_them(tmp_path: Path) -> None:
    keep = jsonl_appender(tmp_path / "records.jsonl")
    keep({"id": "a"})
    keep({"id": "b", "commit": "given"})
    first, second = read_jsonl(tmp_path / "records.jsonl")
    assert first["id"] == "a" and first["commit"] and first["commit"] != "given"
    assert second["commit"] == "given"


def test_compressed_records_resume_and_fold_back(tmp_path: Path) -> None:
    """results/ keeps records gzip-compressed: a resumed run appends plain records beside them, readers see both in
    order, folding makes one compressed file (the same bytes for the same records), and --fresh drops both."""
    out = tmp_path / "out"
    assert resumed_records(out, "questions", {"max_new_tokens": 24}, fresh=False) == []
    path = out / "questions.jsonl"
    path.write_text(json.dumps({"id": "a"}) + "\n")
    assert compress_records(out) == [compressed(path)] and not path.exists()
    first = compressed(path).read_bytes()
    assert compress_records(out) == [] and compressed(path).read_bytes() == first  # nothing plain left to fold
    assert resumed_records(out, "questions", {"max_new_tokens": 24}, fresh=False) == [{"id": "a"}]
    jsonl_appender(path)({"id": "b", "commit": "c"})
    assert read_jsonl(path) == [{"id": "a"}, {"id": "b", "commit": "c"}] and record_files(out) == [path]
    compress_records(out)
    assert not path.exists() and read_jsonl(path) == [{"id": "a"}, {"id": "b", "commit": "c"}]
    again = tmp_path / "again" / "questions.jsonl"
    again.parent.mkdir()
    again.write_text("".join(json.dumps(record) + "\n" for record in read_jsonl(path)))
    compress_records(again.parent)
    assert compressed(again).read_bytes() == compressed(path).read_bytes()  # the same records, the same bytes
    assert resumed_records(out, "questions", {"max_new_tokens": 24}, fresh=True) == []
    assert not compressed(path).exists() and read_jsonl(path) == []


def test_eval_bank_answers_on_the_tiny_model(tiny_lm, tmp_path: Path) -> None:
    from tools.eval import eval_bank_answers

    rows = load_rows(limit=20)
    with LmdbStore(tmp_path / "store") as store:
        open_banks(store, TEST_BANK_CACHE).build("ckc", [r.context for r in rows])
        records = eval_bank_answers.evaluate(tiny_lm, rows[:3], store, Sampling(max_new_tokens=4), top_k=2)
    assert [r["id"] for r in records] == [r.id for r in rows[:3]] and not any(r["divergent"] for r in records)
    for record in records:
        conditions = record["conditions"]
        assert set(conditions) == set(eval_bank_answers.CONDITIONS)
        assert conditions["bank"]["answer"] == conditions["bank_text"]["answer"]
        assert conditions["bank"]["prompt_tokens"] < conditions["none"]["prompt_tokens"] < conditions["gold_text"]["prompt_tokens"]
    assert all(r["routing"] == eval_bank_answers.ROUTING for r in records)
    summary = eval_bank_answers.summarize(records)
    assert "divergences (e) vs (f): 0 of 3; the bank routed the bare question" in eval_bank_answers.table(summary, 2)
