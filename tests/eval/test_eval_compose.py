"""tools/eval/eval_compose.py: row order, arrangements, errata cases, parts, report; answer-token agreement on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.eval import eval_compose  # noqa: E402
from tools.eval.eval_compose import (  # noqa: E402
    ErratumCase,
    arrangement,
    cosine,
    errata_cases,
    erratum_case,
    fill_parts,
    follows,
    question_order,
)
from tools.lib.evallib import Row, contains_answer, frozen_split, load_rows  # noqa: E402

POOL = [Row(f"r{i}", f"question {i}?", f"Paragraph {i} names Person {i} here .", (f"Person {i}",)) for i in range(20)]


def test_questions_come_from_the_held_out_half_first() -> None:
    rows = load_rows()
    tuning, held_out = frozen_split(rows)
    ordered = question_order(rows)
    assert ordered == held_out + tuning
    assert sorted(r.id for r in ordered) == sorted(r.id for r in rows)


def test_arrangements_are_seeded_nested_and_hold_the_gold_row_once() -> None:
    row = POOL[3]
    previous: list[Row] = []
    for k in range(1, 6):
        parts, position = arrangement(row, POOL, k, seed=0)
        assert len(parts) == k and parts[position] == row and parts.count(row) == 1
        distractors = [p for p in parts if p != row]
        assert distractors[: len(previous)] == previous  # step k+1 adds one distractor to step k's
        previous = distractors
        assert arrangement(row, POOL, k, seed=0) == (parts, position)
    assert arrangement(row, POOL, 5, seed=1)[0] != arrangement(row, POOL, 5, seed=0)[0]
    with pytest.raises(ValueError):
        arrangement(row, POOL[:3], 5, seed=0)  # 3 other rows, 4 distractors wanted


def test_accumulation_groups_hold_their_questions_paragraphs_and_distractors_without_their_answers() -> None:
    groups = eval_compose.accumulation_groups(POOL[:10], POOL, golds=3, distractors=2, seed=0)
    assert [[row.id for row in questions] for questions, _ in groups] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7", "r8"]]
    for questions, parts in groups:
        assert len(parts) == 5 and len({part.id for part in parts}) == 5
        assert {row.id for row in questions} <= {part.id for part in parts}
        distractors = [part for part in parts if part not in questions]
        assert len(distractors) == 2 and not any(contains_answer(part.context, row.answers) for part in distractors for row in questions)
    assert groups == eval_compose.accumulation_groups(POOL[:10], POOL, golds=3, distractors=2, seed=0)
    assert [parts for _, parts in groups] != [parts for _, parts in eval_compose.accumulation_groups(POOL[:10], POOL, 3, 2, seed=1)]


def test_erratum_replaces_the_answer_in_its_sentence() -> None:
    row = Row("x", "who founded it?", "It opened in 1990 . It was founded by Ann Lee in Oslo . It closed .", ("Ann Lee",))
    pool = [row, Row("y", "q?", "c", ("1999",)), Row("z", "q?", "c", ("Ann Lee Smith",)), Row("w", "q?", "c", ("Bo Chen",))]
    case = erratum_case(row, pool, seed=0)
    assert isinstance(case, ErratumCase)
    # 1999 has digits, "Ann Lee Smith" contains the original: only Bo Chen qualifies
    assert (case.original, case.replacement) == ("Ann Lee", "Bo Chen")
    assert case.erratum == "It was founded by Bo Chen in Oslo ."
    assert follows("It was Bo Chen.", case) == "erratum"
    assert follows("Ann Lee did.", case) == "original"
    assert follows("Ann Lee, then Bo Chen.", case) == "both"
    assert follows("Nobody", case) == "neither"


def test_rows_without_a_usable_sentence_are_skipped_with_a_reason() -> None:
    inside_a_word = Row("a", "q?", "The Annleeville club .", ("Annlee",))
    too_long = Row("b", "q?", " ".join(["word"] * 90) + " Ann Lee .", ("Ann Lee",))
    no_other = Row("c", "q?", "Ann Lee met Bo Chen .", ("Ann Lee",))
    pool = [inside_a_word, too_long, no_other, Row("d", "q?", "c", ("Bo Chen",))]
    assert erratum_case(inside_a_word, pool, 0) == "answer not in a sentence"
    assert erratum_case(too_long, pool, 0).startswith("sentence over")
    assert erratum_case(no_other, [no_other, pool[3]], 0) == "no replacement answer"
    cases, skipped = errata_cases(POOL, POOL, 5, seed=0)
    assert [c.row for c in cases] == POOL[:5] and skipped == {}
    assert all(c.replacement != c.original and c.replacement in c.erratum for c in cases)


def test_parts_take_consecutive_texts_until_their_size() -> None:
    texts = [f"t{i}" for i in range(10)]
    assert fill_parts(texts, [3] * 10, 3, 5) == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"]]
    with pytest.raises(ValueError):
        fill_parts(texts, [3] * 10, 4, 9)


def test_cosine() -> None:
    assert cosine(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0])) == pytest.approx(1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])) == pytest.approx(0.0)


def _accumulation(k: int, divergent: bool) -> dict:
    scores = {"answer": "It was Zayed Khan", "contains": 1.0, "f1": 2 / 3}
    return {
        "model": "m",
        "id": "ckc-15887",  # a real ckc row: tables score the answers against its gold answer, Zayed Khan
        "gold_included": k > 1,
        "k": k,
        "composed_tokens": 300,
        "prefilled_tokens": 200,
        "divergent": divergent,
        "pack": scores | {"prompt_tokens": 20},
        "text": scores | {"prompt_tokens": 200},
    }


def test_answer_agreement_is_teacher_forced_over_the_answer_tokens(tiny_lm) -> None:
    from packstore.kv.build import build_pack
    from packstore.kv.compose import splice
    from packstore.kv.inject import Sampling, answer_with_pack

    packs = [build_pack(tiny_lm, [f"Paragraph {i} names Person {i} here ."]) for i in range(3)]
    exact, naive = eval_compose.composed(tiny_lm, packs).pack, splice(tiny_lm, packs, "naive").pack
    answer = answer_with_pack(tiny_lm, exact, "who is named?", Sampling(max_new_tokens=5))
    logits = eval_compose.answer_logits(tiny_lm, exact, "who is named?", answer.token_ids)
    assert logits.shape[0] == max(len(answer.token_ids), 1)
    assert logits.argmax(-1).tolist() == answer.token_ids[: logits.shape[0]]  # greedy: each forced row picks the next token
    same = eval_compose.answer_agreement(logits, logits)
    assert same["answer_kl"] == pytest.approx(0.0, abs=1e-9) and same["answer_top1"] == 1.0 and same["same_first_token"]
    spliced = eval_compose.answer_agreement(eval_compose.answer_logits(tiny_lm, naive, "who is named?", answer.token_ids), logits)
    assert spliced["answer_kl"] > 0 and spliced["answer_tokens"] == logits.shape[0]


def _modes_record(kl: float | None) -> dict:
    """A modes record: rope right and naive wrong, with answer-token agreement when ``kl`` is given (records before
    issue 39 have the first token's only)."""
    right, wrong = {"answer": "Zayed Khan", "prompt_tokens": 20}, {"answer": "nobody", "prompt_tokens": 20}
    versus = {"prob_cosine": 0.9, "logit_cosine": 0.99, "same_first_token": True, "same_tokens": False}
    extra = {} if kl is None else {"answer_top1": 0.5, "answer_tokens": 4}
    return {
        "model": "m",
        "id": "ckc-15887",
        "k": 3,
        "conditions": {"single": right, "exact": right, "rope": right, "naive": wrong},
        "agreement": {
            "rope": versus | ({} if kl is None else extra | {"answer_kl": kl}),
            "naive": versus | ({} if kl is None else extra | {"answer_kl": 3 * kl}),
        },
    }


def test_modes_summary_has_paired_differences_and_kl_when_recorded() -> None:
    old = eval_compose.summarize_modes([_modes_record(None)])["m"]["agreement"]
    assert "answer_kl" not in old["rope"] and "naive_minus_rope_kl" not in old
    assert old["naive"]["contains_minus_exact"].mean == -1.0 and old["rope"]["contains_minus_exact"].mean == 0.0
    new = eval_compose.summarize_modes([_modes_record(0.1), _modes_record(0.3)])
    assert new["m"]["agreement"]["naive_minus_rope_kl"].mean == pytest.approx(0.4)
    table = eval_compose.modes_table(new)
    assert "| m | RoPE splice | 2 |" in table and "0.2000 [" in table and "-100.0 [-100.0, -100.0], p " in table
    assert "naive - rope KL: +0.4000" in table and "Holm: over the family of all 5 paired differences" in table
    assert "| - | - |" in eval_compose.modes_table(eval_compose.summarize_modes([_modes_record(None)]))


def test_report_from_records_of_every_part(tmp_path: Path) -> None:
    scores = {"answer": "Zayed Khan.", "prompt_tokens": 20, "contains": 1.0, "f1": 1.0}
    versus = {"prob_cosine": 0.9, "logit_cosine": 0.99, "same_first_token": True, "same_tokens": False}
    composed = {"prefilled_tokens": 5, "composed_tokens": 300}
    records = {
        "accumulation": [_accumulation(1, False), _accumulation(2, True)],
        "modes": [
            {
                "model": "m",
                "id": "ckc-15887",
                "k": 3,
                "agreement": {mode: versus for mode in eval_compose.SPLICED},
                "conditions": {"single": scores} | {mode: scores | composed for mode in ("exact", "rope", "naive")},
            }
        ],
        "timing": [
            {
                "model": "m",
                "target_tokens": 2048,
                "composed_tokens": 2100,
                "part_tokens": [525] * 4,
                "repeats": 3,
                "median_seconds": {"exact": 2.0, "rope": 0.5},
                "prefilled_tokens": {"exact": 1580, "rope": 8},
                "same_token_ids": True,
            }
        ],
        "errata": [
            {"model": "m", "id": "a", "divergent": False, "prefilled_tokens": 30}
            | {name: {"answer": "x", "follows": outcome} for name, outcome in (("before", "original"), ("after", "erratum"), ("text", "erratum"))}
        ],
    }
    text = eval_compose.write_report(records, tmp_path, tmp_path, {"about": "test"})
    summary = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert summary["accumulation"]["m"]["2"]["savings"] == pytest.approx(0.9)
    assert summary["accumulation"]["m"]["2"]["divergences"] == 1
    assert summary["accumulation"]["m"]["1"]["gold_included"] == 0.0 and summary["accumulation"]["m"]["2"]["gold_included"] == 1.0
    accumulated = summary["accumulation"]["m"]["1"]
    assert (accumulated["contains_pack"]["mean"], accumulated["f1_text"]["mean"]) == (1.0, pytest.approx(2 / 3))
    assert "em_pack" not in accumulated and "strict EM" not in text  # no strict exact match (issue 54)
    assert summary["modes"]["m"]["modes"]["rope"]["contains"]["mean"] == 1.0
    assert summary["timing"]["m"]["2048"]["ratio_exact_to_rope"] == pytest.approx(4.0)
    assert summary["errata"]["m"]["after"]["erratum"]["mean"] == 1.0
    assert "| m | 2 | 1 |" in text and "4.0x" in text
    assert {p.name for p in tmp_path.glob("*.png")} == {f"eval_compose_{n}.png" for n in ("accumulation", "modes", "errata")}


def test_diagnosis_patches_put_exact_back_and_all_of_it_is_exact(tiny_lm) -> None:
    """Patching every layer at every position gives exact's answer distribution; the token patches split the tokens
    into the gold paragraph's, the other later paragraphs' and the template's."""
    from packstore.kv.build import build_pack
    from packstore.kv.compose import splice
    from packstore.kv.inject import Sampling, answer_with_pack

    packs = [build_pack(tiny_lm, [f"Paragraph {i} names Person {i} here ."]) for i in range(3)]
    exact, spliced = eval_compose.composed(tiny_lm, packs).pack, splice(tiny_lm, packs, "rope").pack
    tokens = exact.header.tokens
    sites = eval_compose.patch_sites(tiny_lm, packs, 1, tokens)
    assert "sliding" not in sites and sites["full"] == (list(range(tiny_lm.model.config.num_hidden_layers)), list(range(tokens)))
    gold, others, framing = (set(sites[name][1]) for name in ("gold", "others", "framing"))
    assert gold and others and framing and not gold & others and not (gold | others) & framing
    assert "gold" not in eval_compose.patch_sites(tiny_lm, packs, 0, tokens)  # a first paragraph is exact in a splice
    answer = answer_with_pack(tiny_lm, exact, "who is named?", Sampling(max_new_tokens=5)).token_ids
    reference = eval_compose.answer_logits(tiny_lm, exact, "who is named?", answer)
    whole = eval_compose.patched(spliced, exact, *sites["full"])
    agreement = eval_compose.answer_agreement(eval_compose.answer_logits(tiny_lm, whole, "who is named?", answer), reference)
    assert agreement["answer_kl"] == pytest.approx(0.0, abs=1e-6) and agreement["answer_top1"] == 1.0
    assert torch.equal(spliced.keys[0], splice(tiny_lm, packs, "rope").pack.keys[0])  # the splice itself is untouched


def test_diagnosis_summary_pairs_each_patch_with_the_plain_splice() -> None:
    def record(same: bool, kl: float) -> dict:
        plain = {"same_first_token": False, "answer_kl": 0.5, "answer_top1": 0.5}
        return {"model": "m", "id": "x", "k": 3, "agreement": {"none": plain, "gold": {"same_first_token": same, "answer_kl": kl, "answer_top1": 1.0}}}

    summary = eval_compose.summarize_diagnosis([record(True, 0.1), record(False, 0.3)])
    assert summary["m"]["gold"]["same_first_minus_splice"].mean == pytest.approx(0.5)
    assert summary["m"]["gold"]["kl_minus_splice"].mean == pytest.approx(-0.3)
    table = eval_compose.diagnosis_table(summary)
    assert "| m | RoPE splice | 2 | 0.0 [0.0, 65.8] |" in table  # same first token: a Wilson interval, not [0.0, 0.0]
    assert "+ exact K/V, gold paragraph's tokens" in table and "+50.0 [" in table and "(Holm " in table
