"""A fourth, independent generator of invented facts and questions, for measuring bank routing (issue 54).

Written apart from packstore.kv.synthetic, tools/data/second_facts.py and tools/data/third_facts.py: no shared code,
vocabulary, domain or question form. Ten families: shipping manifests, orchestra rosters, seed-bank
accessions, ferry timetables, amateur radio call signs, weather stations, laboratory reagents, mountain
huts, clinical trials and named gemstones.

Every fact is about one invented entity, whose name is a *core* (a coined word or code, never shared between
groups) plus one *varying* token: a given name, a colour, a Roman numeral, a number, a cation, a
qualifier, a suffix code or a noun ("Velmora Kestane", "Russet Tollick", "Galdegrik XI", "KV71-2817",
"sodium velmarate", "Upper Brissen Hut", "TALVIR-HF", "the Kalishan Star"). Two designed properties make
the set hard for either half of hybrid routing alone:

* Near-namesakes. About 30 % of facts come in groups of two or three that share the core and differ only
  in the varying token, chosen to look alike ("Velmora" / "Valmora", "2817" / "2871", "IV" / "VI"). A
  question that names one of them is answered only by getting that token right: easy for BM25, hard for
  a sentence embedder.
* Described questions. About 35 % of questions never name the entity: they identify its fact by three
  other attributes, one named as in the fact (a place, one of 128) and two reworded with
  synonyms that share no word with the fact ("chickpea" -> "garbanzo", "drought-tolerant" -> "copes
  with dry spells"), and ask for the name, a number or a destination. BM25 sees only the place; the embedder has to
  read the synonyms. The other 65 % name the entity and word the asked attribute in other words.

Each family has three fact shapes, four to six named question forms and two or three described ones. On
2,000 cases (seed 5) a named question's content words (four letters or more, the name left out) occur in
its fact 3.2 % of the time on average, a described question's 13.1 % (mostly the place); with Snowball
stems, no question shares a word rarer than 2 % of facts with its fact other than the name or the place
(tests/unit/test_fourth_facts.py checks these).

Exactly one answer per question. Within a family each case draws a distinct (place, attribute,
attribute) combination from a seeded permutation of all combinations (at least 15,360 per family, so
up to 153,600 cases), and a described question states all three, so only its fact fits it; a named
question carries the full name, and no other fact contains that name. The answer (a name, an attribute
as worded in the fact, or a number) never occurs in its question. Facts and questions are unique;
output is deterministic for (count, seed); 100,000 cases take a few seconds.

    python -m tools.data.fourth_facts --count 5 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

FOURTH_SEED = 61  # the seed for evaluation; tools/data/fourth_facts.sha256 pins its output
NAMESAKE_GROUP_START = 0.16  # chance a new core starts a group of 2 (70 %) or 3 (30 %): about 30 % of facts in groups
DESCRIBED_SHARE = 0.35  # share of questions that identify the fact without its name
_MAX_TRIES = 10_000


@dataclass(frozen=True)
class Case:
    """One invented fact, a question only it answers, and the answer as worded in the fact."""

    fact: str
    question: str
    answer: str  # verbatim in the fact (the name may open the fact with a capital), never in the question
    kind: str  # family
    form: str  # "named": the question carries the entity's full name; "described": it does not
    namesakes: int  # facts in this set whose names share the core and differ in one token, itself included


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Places (anchors) and islands: coined, English-sounding, 16 x 8 = 128 places.
PLACES = tuple(
    head + tail
    for head in _words("Quarr Ell Marl Tamb Brack Holl Dunn Swal Carr Fenn Ashk Wend Osk Bryn Tarl Penn")
    for tail in _words("owby isford mere ington haven wick stead combe")
)
ISLANDS = tuple(
    head + tail for head in _words("Inch Skerr Holm Tober Ardn Lisk") for tail in _words("amay olsa averey unda")
)


def _coiner(*parts: str) -> Callable[[random.Random], str]:
    """Words made of one piece from each space-separated table, capitalised."""
    tables = [_words(part) for part in parts]

    def coin(rng: random.Random) -> str:
        return "".join(rng.choice(table) for table in tables).capitalize()

    return coin


def _other(pool: tuple[str, ...]) -> Callable[[random.Random, str], str]:
    """Another member of `pool`."""

    def near(rng: random.Random, token: str) -> str:
        while True:
            pick = rng.choice(pool)
            if pick != token:
                return pick

    return near


def _pick(pool: tuple[str, ...]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(pool)


def _digit_twin(rng: random.Random, number: str) -> str:
    """`number` with two of its digits swapped, or one digit changed (never a leading zero)."""
    while True:
        digits = list(number)
        if rng.random() < 0.5:
            i, j = rng.sample(range(len(digits)), 2)
            digits[i], digits[j] = digits[j], digits[i]
        else:
            i = rng.randrange(len(digits))
            digits[i] = rng.choice("0123456789")
        twin = "".join(digits)
        if twin != number and twin[0] != "0":
            return twin


def _elsewhere(rng: random.Random, place: str) -> str:
    """A place other than `place`."""
    while True:
        pick = rng.choice(PLACES)
        if pick != place:
            return pick


def _a(phrase: str) -> str:
    """The phrase with "a" or "an" before it."""
    low = phrase.lower()
    if low.startswith(("uni", "one", "eu", "use")):
        return "a " + phrase
    return ("an " if low[0] in "aeiou" or low.startswith(("hour", "heir")) else "a ") + phrase


# --- names -------------------------------------------------------------------------------------------

_GIVEN_ONSETS = _words("V T M S R L N D Br Cl F G H J Z Th")
_GIVEN_ENDINGS = _words("lmora nessa rith ndor lvane rrin stel bryn lian dric mond ssia")
_VOWELS = "aeiou"


def _given(rng: random.Random) -> str:
    return rng.choice(_GIVEN_ONSETS) + rng.choice(_VOWELS) + rng.choice(_GIVEN_ENDINGS)


def _given_twin(rng: random.Random, given: str) -> str:
    """The same given name with its first vowel changed: "Velmora" -> "Valmora"."""
    at = next(i for i, ch in enumerate(given) if ch in _VOWELS)
    return given[:at] + rng.choice(_VOWELS.replace(given[at], "")) + given[at + 1 :]


_CODE_LETTERS = "BCDFGHJKLMNPQRSTVWXZ"
_CALL_CONSONANTS = "BCDFGHJKLMNPQRSTVWXZ"
COLOURS = _words("Amber Russet Ivory Crimson Slate Ochre Saffron Umber Cobalt Sable Tawny Scarlet Indigo Mauve Sepia Viridian")
NUMERALS = _words("II III IV VI VII VIII IX XI XII")
CATIONS = _words("sodium potassium lithium calcium magnesium barium ammonium caesium strontium zinc")
QUALIFIERS = _words("Upper Lower Old New High Little Great North South East West Middle")
TRIAL_SUFFIXES = _words("HF AF CK PD MS RX KD LV BT GN")
GEM_NOUNS = _words("Star Eye Tear Flame Crown Moon Rose Dawn Queen Lantern")
CALL_REGIONS = _words("VK KT ZR OQ HB LX PY DM")


def _manifest_core(rng: random.Random) -> str:
    return rng.choice(_CODE_LETTERS) + rng.choice(_CODE_LETTERS) + str(rng.randrange(10, 100))


def _call_core(rng: random.Random) -> str:
    return "".join(rng.choice(_CALL_CONSONANTS) for _ in range(4))


def _call_vary(rng: random.Random) -> str:
    return rng.choice(CALL_REGIONS) + str(rng.randrange(10))


def _call_twin(rng: random.Random, prefix: str) -> str:
    """The same region letters with another district digit: "VK4" -> "VK7"."""
    return prefix[:-1] + rng.choice("0123456789".replace(prefix[-1], ""))


_anion = _coiner("v qu t m b d f g h k l n p r s", "e a i o u", "lm rv nd st lt rb sc ph th gn dr x tr ch",
                 "arate orite ide onate olate anate inate urate ylate ite")


def _trial_core(rng: random.Random) -> str:
    return (
        rng.choice("BDFGKLMNPRSTVZ") + rng.choice("AEIOU") + rng.choice("LNRST") + rng.choice("BDGKMPTV") + rng.choice("AEIOU")
        + rng.choice("NRSXL")
    )


# --- families ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    """One family: its names, its three identifying attributes, its facts and its questions.

    Templates use {name} / {anchor} / {p1} / {p2} (with {a_p1}, {a_p2}: the phrase after "a" or "an"), the
    extras' keys, and in described questions {q1} / {q2} (the attributes reworded; {a_q1}, {a_q2}). `named`
    and `described` are (asked field, template) pairs; the asked field is "name", "anchor", "p1", "p2" or
    an extra's key.
    """

    kind: str
    core: Callable[[random.Random], str]  # the rare part of a name, never shared by two groups
    vary: Callable[[random.Random], str]  # the varying token
    near: Callable[[random.Random, str], str]  # another varying token that looks like the given one
    render: Callable[[str, str], str]  # (core, varying token) -> the name as written
    anchors: tuple[str, ...]
    p1: tuple[tuple[str, str], ...]  # (as in the fact, as in a described question)
    p2: tuple[tuple[str, str], ...]
    extras: Callable[[random.Random, str], dict[str, str]]  # (rng, anchor) -> more attributes
    facts: tuple[str, ...]
    named: tuple[tuple[str, str], ...]
    described: tuple[tuple[str, str], ...]

    @property
    def space(self) -> int:
        return len(self.anchors) * len(self.p1) * len(self.p2)


FAMILIES = (
    _Family(
        "manifest",
        _manifest_core,
        lambda rng: str(rng.randrange(1000, 10000)),
        _digit_twin,
        lambda core, vary: f"{core}-{vary}",
        PLACES,
        (
            ("bagged cement", "sacks of mortar powder"),
            ("sawn timber", "cut lumber"),
            ("raw wool", "unspun fleece"),
            ("rice", "paddy grain"),
            ("motor cars", "automobiles"),
            ("bicycles", "pedal cycles"),
            ("crude oil", "unrefined petroleum"),
            ("sheet glass", "window panes"),
            ("livestock feed", "animal fodder"),
            ("pianos", "keyboard instruments"),
            ("steel girders", "iron beams"),
            ("medical supplies", "hospital equipment"),
            ("newsprint", "paper for the daily press"),
            ("coffee beans", "unroasted arabica"),
            ("bananas", "tropical fruit"),
            ("tractors", "farm machinery"),
        ),
        (
            ("bulk carrier", "dry-cargo freighter"),
            ("container ship", "boxship"),
            ("river barge", "flat-bottomed lighter"),
            ("coastal schooner", "sailing coaster"),
            ("tramp steamer", "unscheduled steamship"),
            ("refrigerated ship", "reefer vessel"),
            ("tanker", "liquid-cargo vessel"),
            ("roll-on roll-off ship", "drive-aboard vessel"),
            ("heavy-lift ship", "crane-equipped vessel"),
            ("dhow", "lateen-rigged Arab sailboat"),
        ),
        lambda rng, anchor: {"tonnes": str(rng.randrange(40, 1000, 5)), "port": _elsewhere(rng, anchor)},
        (
            "Manifest {name} lists {tonnes} tonnes of {p1} loaded at {anchor} onto {a_p2} bound for {port}.",
            "Under manifest {name}, {a_p2} took on {tonnes} tonnes of {p1} at {anchor} for delivery to {port}.",
            "{A_p2} took {tonnes} tonnes of {p1} from {anchor} to {port}, as recorded on manifest {name}.",
        ),
        (
            ("p1", "What goods are declared on cargo list {name}?"),
            ("p1", "Which commodity does shipping document {name} cover?"),
            ("p2", "What type of vessel carried the freight entered on {name}?"),
            ("anchor", "At which port was the freight on {name} put aboard?"),
            ("port", "Where was the freight on cargo list {name} headed?"),
            ("tonnes", "How much weight is declared on shipping document {name}?"),
        ),
        (
            ("name", "Which cargo list covers {q1} put aboard {a_q2} at {anchor}?"),
            ("name", "On which shipping document are {q1} sent from {anchor} by {a_q2}?"),
            ("port", "Where did the {q1} sent from {anchor} on {a_q2} end up?"),
            ("tonnes", "What weight of {q1} was sent from {anchor} aboard {a_q2}?"),
        ),
    ),
    _Family(
        "orchestra",
        _coiner("K Br Dr Gr H M P R St Tr W Bl C F G L N S Sh T V Wh Y Ch", "a e i o u ai", "nd lw rr st th ck mb rl ld ng sk tt",
                "ell ick ane ow er by ley ford ham en ard ock ey in ett ore"),
        _given,
        _given_twin,
        lambda core, vary: f"{vary} {core}",
        PLACES,
        (
            ("violin", "fiddle"),
            ("viola", "alto strings"),
            ("cello", "violoncello"),
            ("double bass", "contrabass"),
            ("flute", "side-blown woodwind"),
            ("oboe", "treble double reed"),
            ("bassoon", "low double reed"),
            ("clarinet", "single reed"),
            ("trombone", "slide brass"),
            ("tuba", "deepest brass"),
            ("French horn", "coiled brass"),
            ("timpani", "kettledrums"),
            ("piano", "pianoforte"),
            ("saxophone", "sax"),
            ("xylophone", "tuned wooden bars"),
            ("harp", "pedal-operated strings"),
        ),
        (
            ("as principal", "leads the section"),
            ("as associate principal", "deputises for the section leader"),
            ("as a rank-and-file player", "holds no titled chair"),
            ("on a one-year trial", "is still on probation"),
            ("as a guest player", "is a visiting musician"),
            ("as an apprentice", "is a trainee"),
            ("as a substitute", "stands in when needed"),
            ("on a part-time contract", "works reduced hours"),
        ),
        lambda rng, anchor: {"year": str(rng.randrange(1975, 2024))},
        (
            "{name} has played {p1} {p2} in the {anchor} Symphony Orchestra since {year}.",
            "Since {year} the {anchor} Symphony Orchestra has had {name} on its {p1} roster, {p2}.",
            "From {year} the roster of the {anchor} Symphony Orchestra lists {name} on {p1}, {p2}.",
        ),
        (
            ("p1", "Which instrument does {name} perform on?"),
            ("p1", "What does {name} play in the band?"),
            ("anchor", "Which city's orchestra employs {name}?"),
            ("year", "Since when has {name} been a member of the ensemble?"),
            ("p2", "In what capacity is {name} engaged by the ensemble?"),
        ),
        (
            ("name", "Which musician in the {anchor} ensemble plays the {q1} and {q2}?"),
            ("name", "Who plays the {q1} for the {anchor} ensemble and {q2}?"),
            ("year", "Since when has the {q1} player who {q2} been with the {anchor} ensemble?"),
        ),
    ),
    _Family(
        "seed accession",
        _coiner("T M Qu Z Y Ph Gw Ch Sc Tr Fl Pr Kr Dw Rh Sv Ar El Or Ul", "a e i o u", "ll nn rr ss tt dd ff mm gg zz",
                "eth ick aven ory inch ule ash ope idge ere al ock um ette ard isk onde yth elm ast urn ew abe ine"),
        _pick(COLOURS),
        _other(COLOURS),
        lambda core, vary: f"{vary} {core}",
        PLACES,
        (
            ("maize", "corn"),
            ("chickpea", "garbanzo"),
            ("aubergine", "eggplant"),
            ("courgette", "zucchini"),
            ("coriander", "cilantro"),
            ("swede", "rutabaga"),
            ("rocket", "arugula"),
            ("groundnut", "peanut"),
            ("broad bean", "fava"),
            ("sweet pepper", "capsicum"),
            ("rapeseed", "canola"),
            ("spring onion", "scallion"),
            ("sorghum", "milo"),
            ("cassava", "manioc"),
            ("flax", "linseed"),
            ("okra", "lady's fingers"),
        ),
        (
            ("drought-tolerant", "copes with dry spells"),
            ("frost-hardy", "survives freezing nights"),
            ("early-ripening", "matures before its neighbours"),
            ("salt-tolerant", "thrives in saline soil"),
            ("blight-resistant", "shrugs off fungal disease"),
            ("dwarf", "grows on short stems"),
            ("high-yielding", "gives heavy harvests"),
            ("flood-tolerant", "withstands waterlogging"),
            ("pest-resistant", "deters insects"),
            ("heat-tolerant", "handles scorching summers"),
        ),
        lambda rng, anchor: {"year": str(rng.randrange(1950, 2021)), "drawer": str(rng.randrange(100, 1000))},
        (
            "Seed-bank accession {name} is {a_p2} {p1} collected near {anchor} in {year}.",
            "Collected near {anchor} in {year}, the {p2} {p1} held as seed-bank accession {name} is stored in drawer {drawer}.",
            "The seed bank keeps {name}, {a_p2} {p1} from {anchor}, in drawer {drawer}; it was collected in {year}.",
        ),
        (
            ("p1", "What crop is the stored sample {name}?"),
            ("p1", "Which plant does the gene-bank entry {name} belong to?"),
            ("anchor", "Where was {name} gathered?"),
            ("year", "In what year was {name} sampled from the wild?"),
            ("p2", "What quality is {name} valued for?"),
        ),
        (
            ("name", "Which gene-bank sample of {q1} from around {anchor} {q2}?"),
            ("name", "Which stored {q1} that {q2} was gathered around {anchor}?"),
            ("year", "When was the {q1} that {q2} sampled around {anchor}?"),
        ),
    ),
    _Family(
        "ferry",
        _coiner("Osk Tarn Var Hel Skarn Brim Lund Fjal Ros Kvil Mal Sten Yr Gald Hav Torv Ask Bjor Ulf Sig", "e a i y o u",
                "l r n v s th d g m k st sk", "ald mar vik sund gard nir lind sta mund dis fell rik borg ny"),
        _pick(NUMERALS),
        _other(NUMERALS),
        lambda core, vary: f"{core} {vary}",
        PLACES,
        (
            ("daily", "every day of the week"),
            ("on weekdays", "Monday to Friday"),
            ("at weekends", "on Saturdays and Sundays"),
            ("in summer only", "just during the warm months"),
            ("once a fortnight", "every other week"),
            ("hourly", "once every sixty minutes"),
            ("at dawn and dusk", "at sunrise and sunset"),
            ("nightly", "every evening after dark"),
            ("twice a week", "on two days in every seven"),
            ("in winter only", "through the cold months"),
            ("three times a day", "morning, noon and evening"),
            ("on request", "when passengers ask for it"),
        ),
        (
            ("catamaran", "twin-hulled boat"),
            ("hovercraft", "air-cushion craft"),
            ("paddle steamer", "paddlewheeler"),
            ("hydrofoil", "boat riding on underwater wings"),
            ("chain ferry", "cable-drawn crossing boat"),
            ("motor launch", "small powered boat"),
            ("converted trawler", "former fishing boat"),
            ("car ferry", "vehicle-carrying boat"),
            ("decommissioned minesweeper", "retired naval vessel"),
            ("sailing ketch", "two-masted yacht"),
        ),
        lambda rng, anchor: {"island": rng.choice(ISLANDS), "minutes": str(rng.randrange(15, 185, 5))},
        (
            "The ferry {name}, {a_p2}, sails {p1} from {anchor} to {island}; the crossing takes {minutes} minutes.",
            "The {p2} {name} crosses from {anchor} to {island} {p1}, taking {minutes} minutes.",
            "From {anchor}, {a_p2} named {name} leaves for {island} {p1}; it is {minutes} minutes on the water.",
        ),
        (
            ("p1", "How often does {name} run?"),
            ("p1", "On what schedule does {name} operate?"),
            ("p2", "What kind of boat is {name}?"),
            ("anchor", "From which harbour does {name} depart?"),
            ("island", "What is the destination of {name}?"),
            ("minutes", "How long is the trip on {name}?"),
        ),
        (
            ("name", "Which {q2} runs {q1} out of {anchor}?"),
            ("island", "Where does the {q2} leaving {anchor} {q1} take passengers?"),
            ("minutes", "How long is the journey on the {q2} that leaves {anchor} {q1}?"),
        ),
    ),
    _Family(
        "call sign",
        _call_core,
        _call_vary,
        _call_twin,
        lambda core, vary: f"{vary}-{core}",
        PLACES,
        (
            ("Morse code", "dots and dashes"),
            ("voice contacts", "spoken conversations"),
            ("slow-scan television", "still pictures sent over the air"),
            ("radioteletype", "teleprinter text"),
            ("moonbounce", "echoes off the lunar surface"),
            ("meteor scatter", "shooting-star trails"),
            ("satellite contacts", "orbiting relays"),
            ("emergency traffic", "disaster relief messages"),
            ("contest logging", "on-air competitions"),
            ("weather reports", "forecasts"),
            ("long-distance contacts", "far-off stations"),
            ("beacon monitoring", "listening for automatic transmitters"),
        ),
        (
            ("solar panels", "sunlight"),
            ("a wind turbine", "a windmill"),
            ("car batteries", "vehicle accumulators"),
            ("a diesel generator", "an oil-fired genset"),
            ("mains electricity", "the grid"),
            ("a water wheel", "a stream-driven mill"),
            ("a bicycle dynamo", "pedal power"),
            ("a hand-cranked generator", "a manual winder"),
            ("a fuel cell", "hydrogen"),
            ("a steam engine", "a boiler and pistons"),
        ),
        lambda rng, anchor: {"year": str(rng.randrange(1948, 2024))},
        (
            "Amateur station {name}, licensed in {year}, operates from {anchor}, specialises in {p1} and draws its power from {p2}.",
            "Licensed in {year}, the amateur radio station {name} at {anchor} specialises in {p1}; its power comes from {p2}.",
            "From {anchor}, amateur station {name} has worked mostly in {p1} since it was licensed in {year}, powered by {p2}.",
        ),
        (
            ("p1", "What is the speciality of the ham {name} on the air?"),
            ("p1", "What kind of on-air work does the ham {name} focus on?"),
            ("p2", "Where does the ham {name} get its energy?"),
            ("anchor", "From which town does {name} transmit?"),
            ("year", "When was {name} granted its licence?"),
        ),
        (
            ("name", "Which ham operator at {anchor} focuses on {q1} and runs on {q2}?"),
            ("name", "What are the call letters of the {anchor} ham who favours {q1}, using {q2}?"),
            ("year", "When was the {anchor} ham who favours {q1} and runs on {q2} given a licence?"),
        ),
    ),
    _Family(
        "weather station",
        _coiner("Or Al Ves Tal Kir Mov Sel Dar Hul Nev Bor Fen Gal Ost Rin Tov Ulv Zer Pav Cor", "a e i o u",
                "n r l v k m th s d t z g x b", "un ek ax im ol ut ave ir osk en ath ix ur eld an op"),
        lambda rng: str(rng.randrange(10, 100)),
        _digit_twin,
        lambda core, vary: f"{core}-{vary}",
        PLACES,
        (
            ("rainfall", "precipitation"),
            ("wind speed", "gusts"),
            ("snow depth", "snowpack"),
            ("air pressure", "barometric readings"),
            ("sunshine hours", "bright-sun duration"),
            ("humidity", "dampness of the atmosphere"),
            ("soil temperature", "ground warmth"),
            ("river level", "stream height"),
            ("lightning strikes", "thunderbolts"),
            ("pollen counts", "airborne allergens"),
            ("cloud cover", "how much of the sky is overcast"),
            ("visibility", "how far one can see"),
        ),
        (
            ("on a hilltop", "on a summit"),
            ("on a rooftop", "atop a building"),
            ("at an airfield", "at an aerodrome"),
            ("at a railway station", "by a train halt"),
            ("in a vineyard", "among grapevines"),
            ("beside a reservoir", "next to a dam"),
            ("in a school yard", "in a playground"),
            ("on a church tower", "up a steeple"),
            ("in a forest clearing", "in a glade"),
            ("on a golf course", "among fairways and greens"),
            ("in a cemetery", "in a graveyard"),
            ("on a farm", "at a homestead"),
        ),
        lambda rng, anchor: {"elevation": str(rng.randrange(100, 2400)), "year": str(rng.randrange(1880, 2021))},
        (
            "Weather station {name}, set up {p2} near {anchor} in {year}, records {p1} at {elevation} metres above sea level.",
            "Standing {p2} near {anchor} at {elevation} metres, weather station {name} has recorded {p1} since {year}.",
            "Since {year}, weather station {name}, which sits {p2} near {anchor} at {elevation} metres, has logged {p1}.",
        ),
        (
            ("p1", "What does the meteorological post {name} measure?"),
            ("p1", "Which reading is taken at {name}?"),
            ("p2", "What sort of site hosts {name}?"),
            ("anchor", "Which town is {name} close to?"),
            ("elevation", "How high up is {name}?"),
            ("year", "When did {name} begin operating?"),
        ),
        (
            ("name", "Which meteorological post {q2} close to {anchor} measures {q1}?"),
            ("name", "Which gauge close to {anchor}, {q2}, keeps track of {q1}?"),
            ("elevation", "How high is the gauge {q2} by {anchor} that keeps track of {q1}?"),
        ),
    ),
    _Family(
        "reagent",
        lambda rng: _anion(rng).lower(),
        _pick(CATIONS),
        _other(CATIONS),
        lambda core, vary: f"{vary} {core}",
        PLACES,
        (
            ("in a refrigerator", "in the fridge"),
            ("in a freezer", "frozen solid"),
            ("in the dark", "away from light"),
            ("under argon", "beneath an inert gas"),
            ("in a desiccator", "somewhere bone-dry"),
            ("in a fume cupboard", "inside the extraction hood"),
            ("in a flammables cabinet", "in the fireproof locker"),
            ("in liquid nitrogen", "in a cryogenic dewar"),
            ("in a locked safe", "in a strongbox"),
            ("in a glass-fronted cabinet", "behind see-through doors"),
        ),
        (
            ("a rust inhibitor", "anti-corrosion treatment"),
            ("a food preservative", "substance that stops groceries spoiling"),
            ("a photographic developer", "darkroom film-processing chemical"),
            ("a flame retardant", "fireproofing treatment"),
            ("a disinfectant", "germ killer"),
            ("a water softener", "limescale remover"),
            ("a pigment for glazes", "colourant for pottery"),
            ("a catalyst for plastics", "accelerant in polymer making"),
            ("a fertiliser additive", "plant-feed booster"),
            ("a leavening agent", "raising powder for dough"),
            ("a stain for microscopy", "dye for looking at cells"),
            ("a de-icer", "road-thawing salt"),
        ),
        lambda rng, anchor: {"grams": str(rng.randrange(50, 2001, 25))},
        (
            "The {anchor} laboratory stores its {grams} grams of {name} {p1}; the salt is used as {p2}.",
            "Used as {p2}, {name} is kept {p1} at the {anchor} laboratory, which holds {grams} grams of it.",
            "In the {anchor} laboratory, {grams} grams of {name}, {p2}, sit {p1}.",
        ),
        (
            ("p1", "How must {name} be kept?"),
            ("p2", "What is {name} for?"),
            ("p2", "What job does {name} do?"),
            ("anchor", "Which lab has {name} in stock?"),
            ("grams", "How much {name} is on hand?"),
        ),
        (
            ("name", "Which compound kept {q1} at the {anchor} lab serves as {a_q2}?"),
            ("name", "What chemical, {a_q2}, does the {anchor} lab keep {q1}?"),
            ("grams", "How much of the {q2} kept {q1} does the {anchor} lab have?"),
        ),
    ),
    _Family(
        "mountain hut",
        _coiner("K B D Gl M R S T V W Br Cr Fr Gr Pl Sk St Tr Wr Dr", "a e i o u y", "ss rr nn ll dd tt rn rd st sk nt lv",
                "ary en ock ell ind ow alt orn ey ume arth isle ad ig um ach"),
        _pick(QUALIFIERS),
        _other(QUALIFIERS),
        lambda core, vary: f"{vary} {core} Hut",
        PLACES,
        (
            ("a wood stove", "a log burner"),
            ("solar lighting", "sun-powered lamps"),
            ("a rainwater cistern", "a tank that collects rain"),
            ("a sauna", "a steam bath"),
            ("a library", "shelves of books"),
            ("a telescope", "a stargazing scope"),
            ("a rescue radio", "an emergency transmitter"),
            ("a chapel", "a place of worship"),
            ("hot showers", "warm washing water"),
            ("a drying room", "a place for soaked clothing"),
            ("a helipad", "a landing spot for helicopters"),
            ("a first-aid post", "a medical kit"),
        ),
        (
            ("beside a tarn", "next to a small mountain lake"),
            ("on a ridge", "on a crest"),
            ("in a pine forest", "among conifers"),
            ("at a col", "in a saddle between peaks"),
            ("under a cliff", "beneath a rock face"),
            ("by a waterfall", "near cascading water"),
            ("in an alpine meadow", "on upland grazing"),
            ("on a scree slope", "on loose stony ground"),
            ("on a plateau", "on a tableland"),
            ("at the head of a valley", "where a dale ends"),
        ),
        lambda rng, anchor: {"beds": str(rng.randrange(6, 121)), "altitude": str(rng.randrange(800, 3800))},
        (
            "{name}, which stands {p2} above {anchor}, has {p1} and sleeps {beds} at {altitude} metres.",
            "Above {anchor}, {name} stands {p2} at {altitude} metres; it has {beds} beds and {p1}.",
            "At {altitude} metres {p2} above {anchor}, {name} offers walkers {beds} beds and {p1}.",
        ),
        (
            ("p1", "What comfort does {name} provide?"),
            ("p1", "Which facility is there at {name}?"),
            ("p2", "Describe the setting of {name}."),
            ("anchor", "Which village lies below {name}?"),
            ("beds", "How many people can spend the night at {name}?"),
            ("altitude", "At what altitude does {name} stand?"),
        ),
        (
            ("name", "Which mountain refuge {q2} overlooking {anchor} provides {q1}?"),
            ("name", "What is the name of the refuge with {q1}, {q2}, overlooking {anchor}?"),
            ("beds", "How many overnight guests fit in the refuge {q2} overlooking {anchor} that provides {q1}?"),
        ),
    ),
    _Family(
        "clinical trial",
        _trial_core,
        _pick(TRIAL_SUFFIXES),
        _other(TRIAL_SUFFIXES),
        lambda core, vary: f"{core}-{vary}",
        PLACES,
        (
            ("hypertension", "high blood pressure"),
            ("influenza", "flu"),
            ("varicella", "chickenpox"),
            ("pertussis", "whooping cough"),
            ("insomnia", "sleeplessness"),
            ("migraine", "severe recurring headaches"),
            ("obesity", "excess body weight"),
            ("tinnitus", "ringing in the ears"),
            ("alopecia", "hair loss"),
            ("psoriasis", "scaly red plaques"),
            ("gout", "uric acid joint pain"),
            ("rubella", "German measles"),
            ("conjunctivitis", "pink eye"),
            ("vertigo", "dizziness"),
            ("myocardial infarction", "heart attack"),
            ("halitosis", "bad breath"),
        ),
        (
            ("a daily tablet", "a once-a-day pill"),
            ("an intravenous infusion", "a drip into the vein"),
            ("a nasal spray", "a mist for the nostrils"),
            ("a skin patch", "an adhesive plaster"),
            ("acupuncture", "needling"),
            ("a low-salt diet", "an eating plan with little sodium"),
            ("supervised exercise", "coached workouts"),
            ("light therapy", "bright-lamp sessions"),
            ("an inhaler", "a puffer"),
            ("a vaccine", "an immunisation"),
        ),
        lambda rng, anchor: {"patients": str(rng.randrange(40, 4000)), "year": str(rng.randrange(1995, 2025))},
        (
            "The {name} trial, run at {anchor} General Hospital from {year}, tests {p2} for {p1} in {patients} patients.",
            "At {anchor} General Hospital, {patients} patients with {p1} joined the {name} trial of {p2}, which began in {year}.",
            "Begun in {year} at {anchor} General Hospital, trial {name} gives {p2} to {patients} patients with {p1}.",
        ),
        (
            ("p1", "What illness does the {name} study target?"),
            ("p1", "Which condition is {name} investigating?"),
            ("p2", "What treatment is under study in {name}?"),
            ("anchor", "Where is the {name} study being conducted?"),
            ("patients", "How many volunteers enrolled in {name}?"),
            ("year", "When did the {name} study start?"),
        ),
        (
            ("name", "Which study in {anchor} tries {q2} on people with {q1}?"),
            ("name", "What is the study of {q2} against {q1} in {anchor} called?"),
            ("patients", "How many volunteers took part in the {anchor} study of {q2} against {q1}?"),
        ),
    ),
    _Family(
        "gemstone",
        _coiner("Az Kal Sor Mir Ish Zan Bel Nur Dar Vash Tir Om Rah Sef Khal Yas Qar Ul Jin Lir Ebb Hal Mez Car", "a e i o u ai",
                "r n sh th l m z d v k", "an ei ir ah un ene is ova ar esh im ul"),
        _pick(GEM_NOUNS),
        _other(GEM_NOUNS),
        lambda core, vary: f"the {core} {vary}",
        PLACES,
        (
            ("ruby", "red corundum"),
            ("sapphire", "blue corundum"),
            ("emerald", "green beryl"),
            ("aquamarine", "sea-blue beryl"),
            ("morganite", "pink beryl"),
            ("heliodor", "golden beryl"),
            ("amethyst", "purple quartz"),
            ("citrine", "yellow quartz"),
            ("peridot", "gem-quality olivine"),
            ("tanzanite", "blue zoisite"),
            ("diamond", "crystallised carbon"),
            ("opal", "hydrated silica"),
            ("jadeite", "imperial jade"),
            ("garnet", "almandine"),
        ),
        (
            ("a national museum", "the state collection"),
            ("a cathedral treasury", "a church vault"),
            ("a private collector", "an anonymous owner"),
            ("a royal family", "a ruling dynasty"),
            ("a university", "an academic institution"),
            ("an auction house", "a salesroom"),
            ("a jeweller", "a goldsmith"),
            ("a mining company", "the firm that dug it out"),
            ("a monastery", "a community of monks"),
            ("a city council", "the municipal authorities"),
        ),
        lambda rng, anchor: {"carats": str(rng.randrange(3, 400)), "year": str(rng.randrange(1700, 2021))},
        (
            "{name}, a {carats}-carat {p1} found near {anchor} in {year}, is now held by {p2}.",
            "Found near {anchor} in {year}, {name} is {a_p1} of {carats} carats now owned by {p2}.",
            "{A_p2} owns {name}, {a_p1} of {carats} carats that was found near {anchor} in {year}.",
        ),
        (
            ("p1", "What kind of gemstone is {name}?"),
            ("p1", "What mineral is {name} cut from?"),
            ("p2", "In whose keeping is {name} today?"),
            ("anchor", "Where was {name} unearthed?"),
            ("carats", "How heavy is {name}?"),
            ("year", "When was {name} discovered?"),
        ),
        (
            ("name", "Which gem, {a_q1} unearthed close to {anchor}, belongs to {q2}?"),
            ("name", "What is the {q1} from {anchor} that belongs to {q2} called?"),
            ("carats", "What does the {q1} from {anchor} kept by {q2} weigh?"),
        ),
    ),
)


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


_ENDINGS = ("ement", "ment", "ance", "ence", "able", "ible", "ate", "ant", "ent", "ism", "ous", "ive", "ize", "al", "er", "ic", "ion", "e", "s")


def _key(word: str) -> str:
    """A rough stem of `word`: lower case, up to two suffixes an English stemmer could strip removed, a
    doubled last letter single. Cores are unique by this key, so a stemming search index cannot fold two into one."""
    word = word.lower()
    for _ in range(2):  # "-ere": "e", then "er"
        for ending in _ENDINGS:
            if word.endswith(ending) and len(word) - len(ending) >= 3:
                word = word[: -len(ending)]
                break
    return word[:-1] if len(word) > 3 and word[-1] == word[-2] else word


def _reserved() -> set[str]:
    """The keys of every word of the vocabularies and every given name: no core may have one of them."""
    words = {w.lower() for w in PLACES + ISLANDS + COLOURS + NUMERALS + CATIONS + QUALIFIERS + TRIAL_SUFFIXES + GEM_NOUNS}
    words.update((onset + vowel + ending).lower() for onset in _GIVEN_ONSETS for vowel in _VOWELS for ending in _GIVEN_ENDINGS)
    for family in FAMILIES:
        for table in (family.p1, family.p2):
            for fact_words, question_words in table:
                words.update(w.lower() for w in (fact_words + " " + question_words).split())
    return {_key(word) for word in words}


def _permutations(rng: random.Random) -> dict[str, list[int]]:
    """Per family, a seeded order of its (anchor, p1, p2) combinations."""
    orders = {}
    for family in FAMILIES:
        order = list(range(family.space))
        rng.shuffle(order)
        orders[family.kind] = order
    return orders


def _names(family: _Family, rng: random.Random, used: set[str], pending: list[tuple[str, str]]) -> tuple[str, str]:
    """The next (core, varying token) of `family`: a member of an open group, or a new core (alone or grouped)."""
    if not pending:
        for _ in range(_MAX_TRIES):
            core = family.core(rng)
            if _key(core) not in used:
                used.add(_key(core))
                break
        else:
            raise RuntimeError(f"ran out of distinct {family.kind} names; ask for fewer cases")
        size = 1 if rng.random() >= NAMESAKE_GROUP_START else (2 if rng.random() < 0.7 else 3)
        tokens = [family.vary(rng)]
        while len(tokens) < size:
            token = family.near(rng, tokens[0])
            if token not in tokens:
                tokens.append(token)
        pending.extend((core, token) for token in reversed(tokens))
    return pending.pop()


@dataclass(frozen=True)
class _Row:
    """A case with what the tests check it by: its name, the name's parts, and its attribute combination."""

    core: str
    token: str  # the varying token
    name: str
    combo: tuple[str, str, str]  # (anchor, p1, p2) as worded in the fact; unique within the family
    case: Case


def _rows(count: int, seed: int) -> list[_Row]:
    """The cases of fourth_facts with their names and combinations."""
    capacity = min(family.space for family in FAMILIES) * len(FAMILIES)
    if count > capacity:
        raise ValueError(f"at most {capacity:,} cases (each family has that many distinct combinations)")
    rng = random.Random(seed)
    orders = _permutations(rng)
    families = list(FAMILIES)
    rng.shuffle(families)  # families take turns in this order, so each gets count / 10 cases
    used = _reserved()
    pending: dict[str, list[tuple[str, str]]] = {family.kind: [] for family in FAMILIES}
    drafts = []
    for index in range(count):
        family = families[index % len(families)]
        combo, anchor = divmod(orders[family.kind][index // len(families)], len(family.anchors))
        p2, p1 = divmod(combo, len(family.p1))
        core, token = _names(family, rng, used, pending[family.kind])
        name = family.render(core, token)
        values = {"name": name, "anchor": family.anchors[anchor], **family.extras(rng, family.anchors[anchor])}
        for key, (fact_words, question_words) in (("p1", family.p1[p1]), ("p2", family.p2[p2])):
            values[key], values["q" + key[1]] = fact_words, question_words
        for key in ("p1", "p2", "q1", "q2"):
            values["a_" + key] = _a(values[key])
            values["A_" + key] = _capital(values["a_" + key])
        fact = _capital(rng.choice(family.facts).format(**values))
        form = "described" if rng.random() < DESCRIBED_SHARE else "named"
        asked, template = rng.choice(family.described if form == "described" else family.named)
        question = _capital(template.format(**values))
        combo_words = (values["anchor"], values["p1"], values["p2"])
        drafts.append((core, token, name, combo_words, fact, question, values[asked], family.kind, form))
    sizes = Counter((draft[7], draft[0]) for draft in drafts)  # facts per (family, core)
    return [
        _Row(core, token, name, combo, Case(fact, question, answer, kind, form, sizes[kind, core]))
        for core, token, name, combo, fact, question, answer, kind, form in drafts
    ]


def fourth_facts(count: int, *, seed: int = 0) -> list[Case]:
    """`count` cases, deterministic for (count, seed); every fact about a distinct invented entity."""
    return [row.case for row in _rows(count, seed)]


def jsonl(cases: list[Case]) -> str:
    """The cases as JSON lines, each ending in a newline (the text tools/data/fourth_facts.sha256 pins)."""
    return "".join(json.dumps(asdict(case), ensure_ascii=False) + "\n" for case in cases)


def main() -> None:
    """Print the cases as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(jsonl(fourth_facts(args.count, seed=args.seed)), end="")


if __name__ == "__main__":
    main()
