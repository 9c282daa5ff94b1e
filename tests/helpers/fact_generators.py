"""Checks the tests of the invented-fact generators (tools/data/*_facts.py) share: pinned digests, content words
and stems, word shares per question form, rare stems, uniqueness, near-namesakes and described questions.

The generators share no code (each stands alone); their tests do, here. Each test passes its own limits.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import pytest

if TYPE_CHECKING:  # the types only: the checks read the records' fields and import no generator
    from tools.data import fifth_facts, fourth_facts, third_facts

    FactCase: TypeAlias = fourth_facts.Case | fifth_facts.Case
    FactRecord: TypeAlias = fourth_facts._Row | fifth_facts._Record  # a case with its name, the name's parts and its combination


def pinned_digests(path: Path) -> dict[tuple[int, int], str]:
    """(count, seed) -> hex digest, from a generator's ``.sha256`` file."""
    pinned = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            count, seed, digest = line.split()
            pinned[int(count), int(seed)] = digest
    return pinned


def content_words(text: str) -> set[str]:
    """Lowercase words of four letters or more."""
    return set(re.findall(r"[a-z]{4,}", text.lower()))


def word_share(case: third_facts.Case | FactCase, name: str) -> float:
    """The share of the question's content words (the name's words left out) that occur in the case's fact."""
    words = content_words(case.question) - set(re.findall(r"[a-z]+", name.lower()))
    assert words, case
    return len(words & content_words(case.fact)) / len(words)


def assert_mean_word_shares(records: Sequence[FactRecord], named_limit: float, described_limit: float) -> None:
    """The mean ``word_share`` of named questions is under ``named_limit``, of described ones under ``described_limit``."""
    shares: dict[str, list[float]] = {"named": [], "described": []}
    for record in records:
        shares[record.case.form].append(word_share(record.case, record.name))
    assert sum(shares["named"]) / len(shares["named"]) < named_limit
    assert sum(shares["described"]) / len(shares["described"]) < described_limit


def assert_form_shares(cases: Sequence[FactCase], described: tuple[float, float], named_namesakes: float) -> None:
    """The share of described questions is within ``described``, that of named questions with namesakes at least ``named_namesakes``."""
    low, high = described
    described_share = sum(case.form == "described" for case in cases) / len(cases)
    named_namesakes_share = sum(case.form == "named" and case.namesakes > 1 for case in cases) / len(cases)
    assert low <= described_share <= high, described_share
    assert named_namesakes_share >= named_namesakes, named_namesakes_share


def stemmer() -> Any:
    """The English Snowball stemmer (the bank's BM25 analyser); the test is skipped without PyStemmer."""
    return pytest.importorskip("Stemmer").Stemmer("english")


def stems(stemmer: Any, text: str) -> set[str]:
    """The stems of the text's lowercase words."""
    return set(stemmer.stemWords(re.findall(r"\w+", text.lower())))


def assert_no_rare_stem_shared_but_the_name_or_the_place(records: Sequence[FactRecord], rarity: float) -> None:
    """A question shares no stem in fewer than ``rarity`` of the facts with its fact but the name's (named questions)
    or the place's (described questions)."""
    snowball = stemmer()
    fact_stems = [stems(snowball, record.case.fact) for record in records]
    frequency = Counter(stem for one in fact_stems for stem in one)
    for record, one in zip(records, fact_stems):
        shared = {stem for stem in stems(snowball, record.case.question) & one if frequency[stem] < rarity * len(records)}
        allowed = stems(snowball, record.name if record.case.form == "named" else record.combo[0])
        assert shared <= allowed, (shared - allowed, record.case)


def assert_rewordings_share_no_stem(rewordings: Iterable[tuple[str, str, str]], ignored: set[str]) -> None:
    """Each (family, attribute as in the fact, its rewording) shares no stem with the fact's wording but ``ignored`` words."""
    snowball = stemmer()
    for kind, fact_words, question_words in rewordings:
        common = (stems(snowball, fact_words) & stems(snowball, question_words)) - ignored
        assert not common, (kind, fact_words, question_words)


def assert_capacity_refused(
    families: Sequence[fourth_facts._Family] | Sequence[fifth_facts._Kind], generate: Callable[[int], object], at_least: int
) -> None:
    """The families allow at least ``at_least`` cases, and ``generate`` refuses one more than they allow."""
    capacity = min(family.space for family in families) * len(families)
    assert capacity >= at_least
    with pytest.raises(ValueError):
        generate(capacity + 1)


def assert_unique_facts_questions_and_names(records: Sequence[FactRecord]) -> None:
    """Facts, questions and names are unique, and a core belongs to one family."""
    for field in ("fact", "question"):
        assert len({getattr(record.case, field) for record in records}) == len(records), field
    assert len({record.name.lower() for record in records}) == len(records)
    families_of_core = defaultdict(set)
    for record in records:
        families_of_core[record.core.lower()].add(record.case.kind)
    assert all(len(kinds) == 1 for kinds in families_of_core.values())


def assert_well_formed(records: Sequence[FactRecord], endings: tuple[str, ...]) -> None:
    """Answer in the fact and not in the question, lengths, question endings, the name exactly in named questions."""
    for record in records:
        case = record.case
        assert case.answer.lower() in case.fact.lower(), case
        assert not re.search(rf"\b{re.escape(case.answer)}\b", case.question, re.IGNORECASE), case
        assert 60 <= len(case.fact) <= 200 and case.question.endswith(endings), case
        assert bool(re.search(rf"\b{re.escape(record.name)}\b", case.question, re.IGNORECASE)) == (case.form == "named"), case
        if case.form == "described":
            assert record.core.lower() not in case.question.lower(), case


def assert_named_questions_name_one_fact(records: Sequence[FactRecord], core_words: Callable[[FactRecord], list[str]]) -> None:
    """The facts holding all of ``core_words(record)`` are its group's, and the full name is in its own fact alone."""
    facts_with_word = defaultdict(set)
    for index, record in enumerate(records):
        for word in set(re.findall(r"\w+", record.case.fact.lower())):
            facts_with_word[word].add(index)
    group = defaultdict(set)
    for index, record in enumerate(records):
        group[record.case.kind, record.core].add(index)
    for index, record in enumerate(records):
        holders = set.intersection(*(facts_with_word[word] for word in core_words(record)))
        assert holders == group[record.case.kind, record.core], record
        named = re.compile(rf"\b{re.escape(record.name)}\b", re.IGNORECASE)  # "Tarnyrrik XI" is not in "Tarnyrrik XII"
        assert [i for i in holders if named.search(records[i].case.fact)] == [index], record


def assert_unique_combinations(records: Sequence[FactRecord]) -> None:
    """No two records of a family have the same attribute combination."""
    assert len({(record.case.kind, record.combo) for record in records}) == len(records)


def assert_described_questions_state_their_combination(records: Sequence[FactRecord], reworded: dict[tuple[str, str], str]) -> None:
    """Combinations are unique in a family; a described question holds its place and both attributes' rewordings."""
    assert_unique_combinations(records)
    for record in records:
        if record.case.form == "described":
            place, one, two = record.combo
            for words in (place, reworded[record.case.kind, one], reworded[record.case.kind, two]):
                assert words in record.case.question, (words, record.case)


def assert_near_namesakes(records: Sequence[FactRecord], low: float, high: float) -> None:
    """Between ``low`` and ``high`` of facts are in groups of 2 or 3 whose names differ in one token, with distinct stems."""
    snowball = stemmer()
    share = sum(record.case.namesakes > 1 for record in records) / len(records)
    assert low <= share <= high, share
    groups = defaultdict(list)
    for record in records:
        groups[record.case.kind, record.core].append(record)
    for members in groups.values():
        assert len(members) <= 3 and all(record.case.namesakes == len(members) for record in members)
        tokens = [re.findall(r"\w+", record.name.lower()) for record in members]
        for one in tokens[1:]:
            assert len(one) == len(tokens[0]) and sum(a != b for a, b in zip(one, tokens[0])) == 1, tokens
        assert len({snowball.stemWord(record.token.lower()) for record in members}) == len(members), tokens
