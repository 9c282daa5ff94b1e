"""tools/data/fourth_facts.py: pinned digests, determinism, uniqueness, one answer per question, near-namesakes, described questions.

On 2,000 cases (seed 5), a named question's content words (four letters or more, the name left out) occur in
its fact on average 3.2 % of the time, a described question's 13.1 % (the place it names, and family
words such as "lab" or "stand"); the test allows 8 % and 20 %. With Snowball stems
(the bank's BM25 analyser), no question shares a word rarer than 2 % of facts with its fact except the
entity's name (named questions) or the place (described questions).
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from tests.helpers import fact_generators as checks

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "data"

from tools.data.fourth_facts import FAMILIES, FOURTH_SEED, _rows, fourth_facts, jsonl  # noqa: E402

NAMED_LIMIT, DESCRIBED_LIMIT = 0.08, 0.20
FUNCTION_WORDS = {"a", "an", "the", "in", "on", "of", "at", "and", "by", "to", "for", "with"}


@functools.cache
def _large() -> list:
    return _rows(120_000, 0)  # about 3 s


@functools.cache
def _medium() -> list:
    return _rows(20_000, 3)


def test_output_matches_the_committed_digests() -> None:
    pinned = checks.pinned_digests(TOOLS / "fourth_facts.sha256")
    assert set(pinned) == {(5_000, FOURTH_SEED), (100_000, FOURTH_SEED)}
    for (count, seed), digest in pinned.items():  # 100,000 cases take about 3 s
        assert hashlib.sha256(jsonl(fourth_facts(count, seed=seed)).encode()).hexdigest() == digest, (count, seed)


def test_jsonl_is_one_json_object_per_line() -> None:
    text = jsonl(fourth_facts(3, seed=0))
    assert text.endswith("\n") and text.count("\n") == 3
    assert all(line.startswith('{"fact": ') for line in text.splitlines())


def test_same_seed_gives_the_same_cases() -> None:
    assert fourth_facts(500, seed=3) == fourth_facts(500, seed=3)


def test_another_seed_gives_other_cases() -> None:
    assert fourth_facts(500, seed=3) != fourth_facts(500, seed=4)


def test_more_cases_than_the_combinations_allow_are_refused() -> None:
    checks.assert_capacity_refused(FAMILIES, fourth_facts, at_least=150_000)


def test_facts_questions_and_names_are_unique_at_120000_cases() -> None:
    checks.assert_unique_facts_questions_and_names(_large())


def test_attribute_combinations_are_unique_within_a_family_at_120000_cases() -> None:
    checks.assert_unique_combinations(_large())


def test_cores_keep_distinct_stems_at_120000_cases() -> None:
    """A stemming index must not fold two groups' names into one."""
    cores = {row.core.lower() for row in _large()}
    assert len(set(checks.stemmer().stemWords(sorted(cores)))) == len(cores)


def test_cases_are_well_formed() -> None:
    checks.assert_well_formed(_rows(3_000, seed=1), endings=("?", "."))


def test_a_named_question_names_exactly_one_fact() -> None:
    """The core occurs in its group's facts only, and the full name in one of them."""
    checks.assert_named_questions_name_one_fact(_medium(), core_words=lambda row: re.findall(r"\w+", row.core.lower()))


def test_a_described_question_states_its_facts_unique_combination() -> None:
    """Place and both reworded attributes are in the question; the combination is unique in the family."""
    reworded = {}
    for family in FAMILIES:
        for table in (family.p1, family.p2):
            assert len({question for _, question in table}) == len(table), family.kind
            for fact_words, question_words in table:
                reworded[family.kind, fact_words] = question_words
    checks.assert_described_questions_state_their_combination(_medium(), reworded)


def test_families_and_question_forms() -> None:
    assert len(FAMILIES) >= 8
    for family in FAMILIES:
        assert len(family.named) >= 4 and len(family.described) >= 2, family.kind
        assert {asked for asked, _ in family.described} & {"name"}, family.kind
        assert len(family.facts) >= 3, family.kind
    assert {case.kind for case in fourth_facts(1_000, seed=2)} == {family.kind for family in FAMILIES}


def test_near_namesakes_share_all_but_one_token() -> None:
    """About 30 % of facts are in groups of 2 or 3 whose names differ in one token, with distinct stems."""
    checks.assert_near_namesakes(_medium(), low=0.25, high=0.36)


def test_shares_of_described_and_namesake_questions() -> None:
    checks.assert_form_shares([row.case for row in _medium()], described=(0.30, 0.40), named_namesakes=0.15)


def test_questions_share_few_words_with_their_fact() -> None:
    checks.assert_mean_word_shares(_rows(2_000, seed=5), NAMED_LIMIT, DESCRIBED_LIMIT)


def test_questions_share_no_rare_stem_with_their_fact_but_the_name_or_the_place() -> None:
    """BM25's only rare evidence is the name (named questions) or the place (described questions)."""
    checks.assert_no_rare_stem_shared_but_the_name_or_the_place(_medium(), rarity=0.02)


def test_rewordings_share_no_stem_with_the_fact_wording() -> None:
    tables = ((family.kind, table) for family in FAMILIES for table in (family.p1, family.p2))
    checks.assert_rewordings_share_no_stem(((kind, *pair) for kind, table in tables for pair in table), FUNCTION_WORDS)
