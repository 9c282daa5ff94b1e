"""A third, independent generator of invented facts with reworded questions, for measuring bank retrieval.

Neither packstore.kv.synthetic nor tools/data/second_facts.py shares a template, a name pool, a domain or a
question form with this module: its families are manuscripts, festivals, patents, minor planets,
cheeses, court rulings, board games, locomotives, perfumes, glaciers, typefaces, postage stamps and
caves, each stated in three or four sentence shapes (some of two sentences). Every fact is about one
invented entity whose name is unique in the generated set; the other attributes (years, towns, people,
numbers) come from small shared pools, so only the entity tells facts apart.

Questions never use the plain "What/When/Who ...?" or "Name the ..." forms of the other generators:
they are imperative ("Tell me ...", "Give me ..."), indirect ("I'm trying to find out ...", "Any idea
..."), "Do you know ..." forms, or fronted topics ("About X: what size is it?", "X? Who penned it?"),
and a tenth of them are written all in lower case. The asked attribute is worded with other words than
the fact's ("copied" -> "penned", "leaves" -> "sheets"): on 2,000 cases (seed 5), on average 0.19 % of
a question's content words (four letters or more) besides the entity's name occur in its fact (the
only one shared is "About" of the fronted-topic form).

Uniqueness. Names are drawn with rejection against every earlier name (compared in lower case), and
each family's name space is far larger than its share of 120,000 cases (families take turns, so each
gets count / 13, about 9,231): coined words are 48 heads x 7 joins x 40 endings = 13,440, and names
combine one with a family word (manuscripts x 12 genres = 161,280; festivals x 10 = 134,400; board
games x 10 = 134,400; cheeses and typefaces x 8 = 107,520; perfumes x 6 = 80,640; glaciers x 5 =
67,200; caves x 4 = 53,760) or with numbers (patents, minor planets, locomotives: millions) or with
another coined word (rulings: 180 million; stamps x 80 colour-values: over a million). No name is
contained, word for word, in another, so a question names exactly one fact. Output is
deterministic for (count, seed); the test checks uniqueness at 120,000 cases.

    python -m tools.data.third_facts --count 5 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

THIRD_SEED = 29  # the seed for evaluation; tools/data/third_facts.sha256 pins its output


@dataclass(frozen=True)
class Case:
    """One invented fact, a question that only it answers, and the answer as it occurs in the fact."""

    fact: str  # one sentence or two, 60-300 characters
    question: str  # a question (or request) answered only by this fact
    answer: str  # the short answer, verbatim in the fact
    kind: str  # family name


# Coined words: head + join + ending, e.g. "Quessavane", "Drovimarch".
HEADS = (
    "Ald", "Brev", "Cav", "Dorn", "Ess", "Fal", "Gisk", "Holm", "Ith", "Jor", "Kav", "Lun", "Morv", "Ness",
    "Orv", "Pell", "Quess", "Rosk", "Sav", "Tor", "Ulm", "Verm", "Wesk", "Yar", "Zel", "Brav", "Cresk",
    "Drov", "Elst", "Fenn", "Grav", "Harn", "Isk", "Kell", "Lorn", "Marr", "Nov", "Oss", "Pryd", "Rav",
    "Stell", "Trev", "Vald", "Wint", "Ost", "Carn", "Belm", "Hask",
)
JOINS = ("a", "e", "i", "o", "u", "ae", "io")
ENDINGS = (
    "lin", "mar", "nor", "ssa", "vik", "dell", "ran", "thos", "mere", "vash", "ric", "nde", "lor", "sten",
    "vane", "berg", "march", "lune", "tov", "zan", "quist", "rade", "nell", "vor", "tane", "lis", "gard",
    "mont", "rieux", "vesk", "dane", "holt", "sima", "brecht", "loch", "tarra", "vell", "nash", "corre",
    "wyn",
)

# Shared attribute pools: small, so many facts share each value.
TOWNS = (
    "Castrelo", "Miravalle", "Oberlauf", "Santerra", "Kolvang", "Drosselbach", "Aubergue", "Penmarrow",
    "Tolvern", "Zarech", "Rosmund", "Stavenes", "Marchetal", "Quillon", "Fendrake", "Ilvassa", "Beaumorin",
    "Kraswick", "Lindquay", "Vorsetta", "Hallgrund", "Sorvino", "Tremadoc Nua", "Wexmoor",
)
PEOPLE = (
    "Ottilie Marsh", "Edda Falkenrath", "Mirren Holtby", "Casimir Vell", "Ines Abarca", "Tobiah Crane",
    "Linnea Sjoholm", "Amadou Sarr", "Renske Baak", "Teodor Hlinka", "Maeve Connolly", "Kofi Ansah",
    "Solveig Haug", "Bruno Lattes", "Anouk Verbeek", "Yusra Qadir", "Emil Rask", "Delphine Aury",
    "Ilario Benni", "Hedda Brun", "Nils Ostergaard", "Paulina Wrona", "Cyrus Mehran", "Agathe Rolin",
)
SCRIBES = (
    "Brother Aldric", "Sister Wendeline", "Brother Osmund", "Brother Gerlach", "Brother Thiemo",
    "Sister Richenza", "Brother Eadwig", "Brother Folcard", "Brother Lambert", "Sister Hildeburg",
)
WORD_COUNTS = ("three", "four", "five", "six", "seven", "eight", "nine", "eleven", "twelve", "fourteen")
SEASON_MONTHS = ("January", "March", "April", "May", "June", "July", "August", "September", "October", "December")


def _coined(rng: random.Random) -> str:
    """An invented word, e.g. "Kellivane"."""
    return rng.choice(HEADS) + rng.choice(JOINS) + rng.choice(ENDINGS)


def _pick(*options: str) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(options)


def _years(low: int, high: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(low, high))


def _numbers(low: int, high: int, step: int = 1) -> Callable[[random.Random], str]:
    return lambda rng: f"{rng.randrange(low, high + 1, step):,}"


# Name makers, one per family.
def _manuscript(rng: random.Random) -> str:
    genre = rng.choice((
        "Psalter", "Herbal", "Bestiary", "Gospels", "Breviary", "Chronicle", "Missal", "Lectionary",
        "Book of Hours", "Antiphonary", "Cartulary", "Apocalypse",
    ))
    return f"the {_coined(rng)} {genre}"


def _festival(rng: random.Random) -> str:
    theme = rng.choice(("Lantern", "Kite", "Ember", "Salt", "Honey", "Drum", "Mask", "Reed", "Thaw", "Loom"))
    return f"the {_coined(rng)} {theme} Festival"


def _patent(rng: random.Random) -> str:
    letters = "".join(rng.choice("BCDFGHKLMNPRSTVZ") for _ in range(2))
    return f"patent {letters} {rng.randint(1, 9)},{rng.randint(0, 999):03d},{rng.randint(0, 999):03d}"


def _planet(rng: random.Random) -> str:
    return f"minor planet {rng.randint(10_000, 99_999)} {_coined(rng)}"


def _cheese(rng: random.Random) -> str:
    style = rng.choice(("Bleu", "Tomme", "Crottin", "Reserve", "Washed Rind", "Farmhouse", "Smoked", "Brebis"))
    return f"{_coined(rng)} {style}"


def _ruling(rng: random.Random) -> str:
    return f"{_coined(rng)} v. {_coined(rng)}"


def _board_game(rng: random.Random) -> str:
    noun = rng.choice((
        "Conquest", "Caravans", "Dominion", "Harvest", "Outposts", "Labyrinth", "Dynasties", "Tides",
        "Lanterns", "Bazaar",
    ))
    return f"{_coined(rng)} {noun}"


def _locomotive(rng: random.Random) -> str:
    return f"No. {rng.randint(1000, 9999)} {_coined(rng)}"


def _perfume(rng: random.Random) -> str:
    word = _coined(rng)
    return rng.choice((f"Nuit de {word}", f"Eau de {word}", f"{word} Absolu", f"Ombre de {word}", f"Jardin de {word}", f"{word} Intense"))


def _glacier(rng: random.Random) -> str:
    return f"the {_coined(rng)} {rng.choice(('Glacier', 'Icefield', 'Icefall', 'Ice Sheet', 'Ice Stream'))}"


def _typeface(rng: random.Random) -> str:
    return f"{_coined(rng)} {rng.choice(('Sans', 'Serif', 'Grotesk', 'Mono', 'Slab', 'Display', 'Antiqua', 'Script'))}"


def _stamp(rng: random.Random) -> str:
    colour = rng.choice(("lilac", "vermilion", "sepia", "olive", "ultramarine", "carmine", "slate", "ochre", "rose", "jade"))
    value = rng.choice(("halfpenny", "threepence", "fourpence", "one-florin", "two-kreuzer", "five-centime", "ten-ore", "one-real"))
    return f"the {_coined(rng)} {colour} {value}"


def _cave(rng: random.Random) -> str:
    return f"the {_coined(rng)} {rng.choice(('Cavern', 'Pothole', 'Grotto', 'Cave System'))}"


@dataclass(frozen=True)
class _Family:
    """One family: how to name an entity, draw its attributes, state them, and ask for one.

    Fact templates use {name} (or {Name} to open a sentence) and every attribute. `asks` maps an
    attribute to (noun phrase, indirect clause, pronoun question) triples that ask for it in other words.
    """

    kind: str
    name: Callable[[random.Random], str]
    values: dict[str, Callable[[random.Random], str]]
    facts: tuple[str, ...]
    asks: dict[str, tuple[tuple[str, str, str], ...]]


FAMILIES = (
    _Family(
        "manuscript",
        _manuscript,
        {"scribe": _pick(*SCRIBES), "year": _years(1040, 1490), "folios": _numbers(64, 420)},
        (
            "{Name} was copied by {scribe} in {year} and runs to {folios} vellum leaves.",
            "Written out in {year} by the hand of {scribe}, {name} has {folios} leaves of parchment.",
            "{Name} contains {folios} leaves. Its colophon names {scribe} as the copyist and gives the date {year}.",
            "{scribe} finished {name} in {year}; the volume now counts {folios} leaves.",
        ),
        {
            "scribe": (("the person who penned {name}", "whose pen produced {name}", "who penned it"),),
            "year": (("the year of completion of {name}", "when {name} was completed", "when was it made"),),
            "folios": (("the page count of {name}", "how many pages are in {name}", "how many sheets does it have"),),
        },
    ),
    _Family(
        "festival",
        _festival,
        {"town": _pick(*TOWNS), "month": _pick(*SEASON_MONTHS), "visitors": _numbers(2_000, 90_000, 500)},
        (
            "{Name} takes place every {month} in {town} and draws about {visitors} visitors.",
            "Each {month}, around {visitors} people crowd into {town} for {name}.",
            "{Name} is held in {town}. It falls in {month} and attracts roughly {visitors} guests a year.",
        ),
        {
            "town": (("the host town of {name}", "where {name} happens", "in which town is it staged"),),
            "month": (("the calendar slot of {name}", "which month brings {name}", "when does it come round"),),
            "visitors": (("the attendance at {name}", "how big the audience of {name} gets", "what turnout does it get"),),
        },
    ),
    _Family(
        "patent",
        _patent,
        {
            "inventor": _pick(*PEOPLE),
            "year": _years(1850, 1990),
            "device": _pick(
                "rotary seed drill", "folding ladder", "steam pressure valve", "loom shuttle", "spring clamp",
                "tide gauge", "bicycle brake", "oil lamp wick holder", "typewriter ribbon spool", "hand-cranked mangle",
            ),
        },
        (
            "{Name} was granted to {inventor} in {year} for an improved {device}.",
            "In {year}, {inventor} received {name}, which protects a new kind of {device}.",
            "{Name} covers a {device}. The inventor, {inventor}, filed it in {year}.",
        ),
        {
            "inventor": (("the person credited with {name}", "who came up with the idea behind {name}", "who holds it"),),
            "device": (("the subject matter of {name}", "what gadget {name} concerns", "what machine does it deal with"),),
            "year": (("the award date of {name}", "when {name} was issued", "what year was it awarded"),),
        },
    ),
    _Family(
        "minor planet",
        _planet,
        {"observer": _pick(*PEOPLE), "year": _years(1890, 2023), "diameter": lambda rng: f"{rng.randint(2, 140)} kilometres"},
        (
            "{Name} was discovered by {observer} in {year} and measures about {diameter} across.",
            "Spotted in {year} by {observer}, {name} is roughly {diameter} wide.",
            "{Name} has a diameter near {diameter}. {observer} first recorded it in {year}.",
        ),
        {
            "observer": (("the astronomer who found {name}", "who detected {name}", "who caught sight of it"),),
            "year": (("the year {name} came to light", "when {name} was identified", "when was it found"),),
            "diameter": (("the size of {name}", "how large {name} is", "what size is it"),),
        },
    ),
    _Family(
        "cheese",
        _cheese,
        {
            "milk": _pick("sheep's", "goat's", "cow's", "buffalo", "yak", "mare's"),
            "ageing": _pick("six weeks", "three months", "five months", "nine months", "a year", "two years"),
            "town": _pick(*TOWNS),
        },
        (
            "{Name} is made from {milk} milk in {town} and aged for {ageing}.",
            "Cheesemakers in {town} ripen {name}, a {milk} milk cheese, for {ageing}.",
            "{Name} comes from {town}. It is a {milk} milk cheese, matured {ageing} before sale.",
        ),
        {
            "milk": (("the animal whose dairy goes into {name}", "which animal supplies {name}", "what creature gives the dairy for it"),),
            "ageing": (("the cellar time of {name}", "how long {name} rests until it is eaten", "how long does it sit in the cellar"),),
            "town": (("the home district of {name}", "where {name} is produced", "where is it crafted"),),
        },
    ),
    _Family(
        "court ruling",
        _ruling,
        {
            "year": _years(1860, 2019),
            "margin": _pick("five to four", "six to three", "seven to two", "four to three", "three to two", "eight to one"),
            "subject": _pick(
                "water rights", "a broken lease", "salvage fees", "a forged will", "grazing land", "a dock strike",
                "river pollution", "a shipwrecked cargo", "church bells at night", "a fallen boundary wall",
            ),
        },
        (
            "{Name} was decided in {year} by a {margin} vote, settling a dispute about {subject}.",
            "In {year} the judges ruled {margin} in {name}, a case concerning {subject}.",
            "{Name} turned on {subject}. The bench split {margin} as it gave judgment in {year}.",
        ),
        {
            "year": (("the year the decision in {name} came down", "when {name} was handed down", "when was it resolved"),),
            "margin": (("the tally of the justices in {name}", "how the justices divided over {name}", "what was the count among the justices"),),
            "subject": (("the matter at issue in {name}", "what {name} concerned", "what was the quarrel over"),),
        },
    ),
    _Family(
        "board game",
        _board_game,
        {
            "designer": _pick(*PEOPLE),
            "players": _pick("two to four", "two to five", "three to six", "one to four", "two to six", "four to eight"),
            "minutes": _pick("20", "30", "45", "60", "90", "120", "150", "180"),
        },
        (
            "{Name} is a board game by {designer} for {players} players; a round lasts about {minutes} minutes.",
            "Designed by {designer}, {name} seats {players} players and plays in roughly {minutes} minutes.",
            "{Name} was created by {designer}. It suits {players} players, and a session takes {minutes} minutes.",
        ),
        {
            "designer": (("the author of {name}", "who invented {name}", "who dreamt it up"),),
            "players": (("the group size {name} supports", "how many people can sit down to {name}", "how many can join in"),),
            "minutes": (("the length of a match of {name}", "how long a sitting of {name} goes on", "how much time does a match need"),),
        },
    ),
    _Family(
        "locomotive",
        _locomotive,
        {
            "builder": _pick(
                "Harwell & Finch", "the Norland Engine Company", "Brackwater Foundries", "Oswin Kettle & Sons",
                "the Vessing Works", "Tamberlin Brothers", "the Calder Iron Company", "Mowbray & Lisle",
            ),
            "year": _years(1840, 1960),
            "wheels": _pick("4-4-0", "4-6-0", "4-6-2", "2-8-0", "0-6-0", "2-6-2", "4-8-4", "2-10-0"),
        },
        (
            "Locomotive {name} left the shops of {builder} in {year} with a {wheels} wheel arrangement.",
            "{Name}, a {wheels} steam engine, was built by {builder} in {year}.",
            "Built in {year}, {name} runs on a {wheels} layout. Its maker was {builder}.",
        ),
        {
            "builder": (("the firm that manufactured {name}", "which manufacturer assembled {name}", "which firm produced it"),),
            "year": (("the year {name} was constructed", "when {name} was completed", "when was it put together"),),
            "wheels": (("the axle configuration of {name}", "how the axles of {name} are configured", "what is its axle configuration"),),
        },
    ),
    _Family(
        "perfume",
        _perfume,
        {
            "house": _pick("Maison Orlande", "Ferrault", "Casa Imbres", "Atelier Vaucel", "Lysandre", "Helmsdottir Paris", "Ombrage", "Drusille"),
            "note": _pick("vetiver", "iris", "oud", "tuberose", "bergamot", "leather", "fig leaf", "incense", "violet", "tonka bean"),
            "year": _years(1921, 2023),
        },
        (
            "{Name} was released by the house of {house} in {year}, with a heart of {note}.",
            "{Name}, a fragrance built around {note}, was introduced by {house} in {year}.",
            "{house} brought out {name} in {year}. The scent is dominated by {note}.",
        ),
        {
            "house": (("the label behind {name}", "which brand makes {name}", "who sells it"),),
            "note": (("the main accord of {name}", "what {name} smells of", "what does it smell like"),),
            "year": (("the debut year of {name}", "when {name} first appeared on the market", "when did it hit the shelves"),),
        },
    ),
    _Family(
        "glacier",
        _glacier,
        {"length": lambda rng: f"{rng.randint(3, 60)} kilometres", "town": _pick(*TOWNS), "retreat": _numbers(4, 90)},
        (
            "{Name} stretches {length} down towards {town} and loses about {retreat} metres of ice each year.",
            "Flowing {length} towards the valley of {town}, {name} is retreating by roughly {retreat} metres annually.",
            "{Name} ends above {town}. It is {length} long and shrinks some {retreat} metres every year.",
        ),
        {
            "length": (("the extent of {name} from top to snout", "how far {name} reaches", "how far does it run"),),
            "town": (("the settlement beneath the snout of {name}", "which village lies below {name}", "which village sits under it"),),
            "retreat": (("the yearly melt-back of {name}", "how quickly {name} is withdrawing", "how fast is it pulling back"),),
        },
    ),
    _Family(
        "typeface",
        _typeface,
        {"designer": _pick(*PEOPLE), "year": _years(1890, 2023), "weights": _pick(*WORD_COUNTS)},
        (
            "{Name} is a typeface drawn by {designer} in {year} and offered in {weights} weights.",
            "{designer} designed {name} in {year}; the family ships with {weights} weights.",
            "{Name} appeared in {year}. Its {weights} weights were all cut by {designer}.",
        ),
        {
            "designer": (("the letterer behind {name}", "who shaped the letters of {name}", "whose hand shaped it"),),
            "year": (("the publication date of {name}", "when {name} came out", "when was it published"),),
            "weights": (("the number of styles in {name}", "how many boldness variants {name} offers", "how many styles does it include"),),
        },
    ),
    _Family(
        "postage stamp",
        _stamp,
        {"printer": _pick(*PEOPLE), "year": _years(1850, 1960), "copies": _numbers(1_000, 250_000, 1_000)},
        (
            "{Name} was printed by {printer} in {year} in a run of {copies} copies.",
            "Only {copies} copies of {name} came off the presses of {printer} in {year}.",
            "{Name} was issued in {year}. {printer} printed {copies} sheets of it.",
        ),
        {
            "printer": (("the engraver who produced {name}", "who manufactured {name}", "which engraver made it"),),
            "year": (("the year {name} went on sale", "when {name} reached post offices", "when did it go on sale"),),
            "copies": (("the quantity of {name} produced", "how many examples of {name} exist", "how many were made"),),
        },
    ),
    _Family(
        "cave",
        _cave,
        {"depth": _numbers(40, 1_400, 10), "explorer": _pick(*PEOPLE), "year": _years(1880, 2015)},
        (
            "{Name} reaches a depth of {depth} metres and was first explored by {explorer} in {year}.",
            "{explorer} led the first descent into {name} in {year}, reaching {depth} metres down.",
            "{Name} goes {depth} metres below ground. Cavers under {explorer} mapped it in {year}.",
        ),
        {
            "depth": (("the vertical extent of {name}", "how far underground {name} extends", "how deep is it"),),
            "explorer": (("the leader of the pioneering expedition to {name}", "who headed the original survey of {name}", "who opened it up"),),
            "year": (("the year of the original survey of {name}", "when {name} was originally entered", "when was it entered originally"),),
        },
    ),
)

# Question forms: a noun phrase, an indirect clause, or a pronoun question after the fronted name.
PHRASE_FORMS = ("Tell me {ask}.", "Do you know {ask}?", "I'd like {ask}, please.", "Could you look up {ask}?", "Give me {ask}.")
CLAUSE_FORMS = ("I'm trying to find out {ask}.", "Any idea {ask}?", "Do you happen to know {ask}?", "I wonder {ask}.", "Can you check {ask}?")
TOPIC_FORMS = ("About {name}: {ask}?", "Regarding {name} - {ask}?", "Quick one on {name}: {ask}?", "{Name}? {Ask}?")
LOWER_CASE_SHARE = 0.1  # questions typed all in lower case

_MAX_NAME_TRIES = 1000


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def _fresh_name(family: _Family, rng: random.Random, used: set[str]) -> str:
    """A name from `family` not yet in `used` (compared in lower case), then recorded."""
    for _ in range(_MAX_NAME_TRIES):
        name = family.name(rng)
        if name.lower() not in used:
            used.add(name.lower())
            return name
    raise RuntimeError(f"ran out of distinct {family.kind} names; ask for fewer cases")


def _question(family: _Family, asked: str, name: str, rng: random.Random) -> str:
    phrase, clause, topic = rng.choice(family.asks[asked])
    form = rng.randrange(3)
    if form == 0:
        question = rng.choice(PHRASE_FORMS).format(ask=phrase.format(name=name))
    elif form == 1:
        question = rng.choice(CLAUSE_FORMS).format(ask=clause.format(name=name))
    else:
        question = rng.choice(TOPIC_FORMS).format(name=name, Name=_capital(name), ask=topic, Ask=_capital(topic))
    return _capital(question) if rng.random() >= LOWER_CASE_SHARE else question.lower()


def _named_cases(count: int, seed: int) -> list[tuple[str, Case]]:
    """The cases of third_facts, each with the name of its entity."""
    rng = random.Random(seed)
    used: set[str] = set()
    cases: list[tuple[str, Case]] = []
    order: list[_Family] = []
    for _ in range(count):
        if not order:  # families in shuffled rounds, so every family is equally frequent
            order = list(FAMILIES)
            rng.shuffle(order)
        family = order.pop()
        name = _fresh_name(family, rng, used)
        values = {key: draw(rng) for key, draw in family.values.items()}
        asked = rng.choice(tuple(family.asks))
        fact = rng.choice(family.facts).format(name=name, Name=_capital(name), **values)
        fact = ". ".join(_capital(sentence) for sentence in fact.split(". "))  # a sentence opening with a pool value
        cases.append((name, Case(fact, _question(family, asked, name, rng), values[asked], family.kind)))
    return cases


def third_facts(count: int, *, seed: int = 0) -> list[Case]:
    """`count` cases, deterministic for (count, seed); every fact about a distinct invented entity."""
    return [case for _, case in _named_cases(count, seed)]


def jsonl(cases: list[Case]) -> str:
    """The cases as JSON lines, each ending in a newline (the text tools/data/third_facts.sha256 pins)."""
    return "".join(json.dumps(asdict(case), ensure_ascii=False) + "\n" for case in cases)


def main() -> None:
    """Print the cases as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(jsonl(third_facts(args.count, seed=args.seed)), end="")


if __name__ == "__main__":
    main()
