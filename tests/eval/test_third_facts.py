"""tools/data/third_facts.py: pinned digests, determinism, unique names, answers in facts, every family, reworded questions.

On 2,000 cases (seed 5) questions share on average 0.19 % of their content words (four letters or more,
the entity's name left out) with their fact; the test allows up to 5 %.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from tests.helpers import fact_generators as checks

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "data"

from tools.data.third_facts import FAMILIES, THIRD_SEED, _named_cases, jsonl, third_facts  # noqa: E402


def _digest(count: int, seed: int) -> str:
    return hashlib.sha256(jsonl(third_facts(count, seed=seed)).encode()).hexdigest()


def test_output_matches_the_committed_digests() -> None:
    pinned = checks.pinned_digests(TOOLS / "third_facts.sha256")
    assert set(pinned) == {(5_000, THIRD_SEED), (100_000, THIRD_SEED)}
    for (count, seed), digest in pinned.items():  # 100,000 cases take about 3 s
        assert _digest(count, seed) == digest, (count, seed)


def test_jsonl_is_one_json_object_per_line() -> None:
    text = jsonl(third_facts(3, seed=0))
    assert text.endswith("\n") and text.count("\n") == 3
    assert all(line.startswith('{"fact": ') for line in text.splitlines())


def test_same_seed_gives_the_same_cases() -> None:
    assert third_facts(500, seed=3) == third_facts(500, seed=3)


def test_another_seed_gives_other_cases() -> None:
    assert third_facts(500, seed=3) != third_facts(500, seed=4)


def test_entity_names_are_unique_at_120000_cases() -> None:
    names = [name.lower() for name, _ in _named_cases(120_000, seed=0)]
    assert len(set(names)) == len(names)


def test_cases_are_well_formed() -> None:
    for name, case in _named_cases(3_000, seed=1):
        assert case.answer and case.answer in case.fact, case
        assert not re.search(rf"\b{re.escape(case.answer)}\b", case.question, re.IGNORECASE), case
        assert 60 <= len(case.fact) <= 300, case
        assert name.lower() in case.fact.lower() and name.lower() in case.question.lower(), case


def test_every_family_appears_at_1000_cases() -> None:
    kinds = {family.kind for family in FAMILIES}
    assert len(kinds) >= 12
    assert {case.kind for case in third_facts(1_000, seed=2)} == kinds


def test_some_facts_have_two_sentences() -> None:
    assert any(". " in case.fact.replace("No. ", "").replace("v. ", "") for case in third_facts(200, seed=0))


def test_questions_share_few_words_with_their_fact() -> None:
    shares = [checks.word_share(case, name) for name, case in _named_cases(2_000, seed=5)]
    assert sum(shares) / len(shares) < 0.05
