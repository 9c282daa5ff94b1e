"""Deterministic synthetic fictional facts and paraphrased queries, to measure routing.

Every fact is about a distinct invented entity, so the one fact that answers a query is known.
"""

from __future__ import annotations

from dataclasses import dataclass

SYLLABLES = [
    "ka", "zo", "mir", "tel", "van", "ru", "dex", "lo", "pha", "quin", "sor", "bel", "tir", "nox", "ul", "gra", "vey", "dun", "ix", "mael",
]
KINDS = [
    "lighthouse", "bakery", "observatory", "library", "shipyard", "vineyard", "monastery", "foundry", "theatre", "orchard", "brewery",
    "archive",
]
PLACES = [
    "the Kessel valley", "Port Amaranth", "the Orn highlands", "Lake Vesper", "the Tarn coast", "Old Brimley", "the Saffron isles",
    "Mount Caldera",
]
_SPAN = len(SYLLABLES) ** 5  # 3.2 million distinct five-syllable names


def _name(index: int, salt: int) -> str:
    """A distinct invented name per index: a bijective scramble of index into five syllables."""
    value = (index * 1_000_003 + salt) % _SPAN
    parts = []
    for _ in range(5):
        value, digit = divmod(value, len(SYLLABLES))
        parts.append(SYLLABLES[digit])
    return "".join(parts).capitalize()


@dataclass(frozen=True)
class SyntheticFact:
    fact: str
    query: str


def synthetic_fact(index: int) -> SyntheticFact:
    if not 0 <= index < _SPAN:
        raise ValueError(f"index must be in [0, {_SPAN})")
    entity, founder = _name(index, 7), _name(index, 1_234_567)
    kind, place = KINDS[index % len(KINDS)], PLACES[(index // len(KINDS)) % len(PLACES)]
    year = 1500 + (index * 37) % 500
    return SyntheticFact(
        fact=f"The {kind} {entity} in {place} was founded by {founder} in {year}.",
        query=f"Who established {entity}, the {kind} in {place}?",
    )


def synthetic_facts(count: int) -> list[SyntheticFact]:
    return [synthetic_fact(i) for i in range(count)]
