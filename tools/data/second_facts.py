"""A second generator of invented facts, each with a paraphrased question, for measuring bank retrieval.

The bank's retrieval code was tuned on the facts of packstore.kv.synthetic. This module was written
separately from that generator, with its own vocabularies, sentence shapes and naming schemes, so a
retrieval score measured on its cases is a score on data the retrieval code has not been fitted to.

Every case is about one invented entity (a person, an organisation, a ship, a river, a compound...)
whose name is unique in the generated set; the other attributes (years, towns, numbers, colours) come
from small shared pools, so many facts share them and only the name tells facts apart. Each question
names the entity but words the asked attribute with synonyms ("launched" -> "take to the water",
"founded" -> "set up"), so it shares few other words with its fact. Output is deterministic for
(count, seed); names stay unique up to about 120,000 cases.

    python -m tools.data.second_facts --count 5 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Case:
    """One invented fact, a question that only it answers, and the answer as it occurs in the fact."""

    fact: str  # one sentence (or two short ones), 60-220 characters
    question: str  # a question answered only by this fact
    answer: str  # the short answer contained in the fact
    kind: str  # template family name


# Attribute pools: drawn with the seeded RNG and shared between many facts.
TOWNS = (
    "Corrow", "Halvik", "Brennach", "Valdoria", "Kessarin", "Tullan", "Orveto", "Pellinor", "Drumcarra",
    "Istrel", "Varenne", "Quorra", "Aberlune", "Caskell", "Dunvarra", "Estrel", "Fennick", "Garrowby",
    "Hesketh", "Jarnvik", "Kilmorra", "Lorcaster", "Mirabel", "Norvale", "Ostrand", "Pemberly", "Rossavel",
    "Selvane", "Tarrowin", "Ulvanger", "Vessary", "Wendrell", "Ysterby", "Zamorel",
)
COUNTS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
)

# Name morphemes and word lists.
FIRST_NAMES = (
    "Amara", "Bjorn", "Chiara", "Dmitri", "Eun-ji", "Farida", "Goran", "Hana", "Ifeoma", "Jonas", "Kalani",
    "Leilani", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sefa", "Tomasz", "Uma", "Viktor",
    "Wanjiru", "Xiomara", "Yusuf", "Zofia", "Aiko", "Benedikt", "Carmen", "Dario", "Elif", "Felipe", "Greta",
    "Hamid", "Ingrid", "Javier", "Keiko", "Lars", "Mireille", "Nikhil", "Olufemi", "Paloma", "Rafael",
    "Saoirse", "Tariq", "Ulla", "Valentina", "Wen", "Yara", "Zeynep", "Anders", "Beatriz", "Cormac", "Daoud",
    "Esther", "Fintan", "Gabriela", "Hiroshi", "Isolde", "Jun", "Kwame", "Liesel", "Malik", "Noor", "Orla",
    "Pavel", "Rania", "Soren", "Thandiwe", "Ulrich", "Vesna", "Wiremu", "Ximena", "Yannick", "Zainab",
    "Agnieszka", "Bao", "Cosima", "Emeka", "Freya",
)
SURNAMES = (
    "Okafor", "Lindqvist", "Moreau", "Nakamura", "Castellanos", "Petrov", "Haddad", "Kowalski", "Mensah",
    "O'Rourke", "Fitzgerald", "Varga", "Horvat", "Takahashi", "Ferreira", "Rossi", "Novak", "Jansen",
    "Bergstrom", "Adeyemi", "Rashidi", "Banerjee", "Chaudhry", "Delacroix", "Eriksen", "Fonseca", "Gallagher",
    "Hoffmann", "Ibarra", "Jovanovic", "Kaminski", "Laurent", "Mahlangu", "Nieminen", "Oyelaran",
    "Papadopoulos", "Quiroga", "Ramaswamy", "Sato", "Toivonen", "Uchenna", "Valdez", "Wojcik", "Xu",
    "Yamamoto", "Zielinski", "Abebe", "Brennan", "Costa", "Dubois", "Esposito", "Figueroa", "Grunewald",
    "Hakimi", "Iwasaki", "Jaramillo", "Kiplagat", "Lombardi", "Mwangi", "Nordin", "Oduya", "Pereira",
    "Quinlan", "Rahman", "Sorensen", "Tanaka", "Urquhart", "Vasquez", "Weber", "Yilmaz", "Zamora",
    "Achterberg", "Blanchard", "Chikwanha", "Dimitriou", "Eze", "Fairweather", "Gutierrez", "Halloran",
    "Inoue", "Jablonski", "Kavanagh", "Lachance", "Molnar", "Ndlovu", "Oliveira", "Pham", "Quesada",
    "Rinaldi", "Strand", "Tembo", "Ulloa", "Vinter", "Whitlock", "Yeboah", "Zuniga", "Aldana", "Bertrand",
    "Cavanagh", "Drummond", "Ekwueme", "Fischer", "Gonzaga", "Hyland", "Ivanova", "Kadiri", "Lemaire",
    "Marchetti", "Nwosu", "Ostrowski", "Prasad", "Renner", "Sandoval", "Thorsen", "Ueda", "Voss",
    "Wainwright", "Yoshida", "Zeller", "Arslan",
)
PLACE_HEADS = (
    "Alder", "Amber", "Ash", "Barrow", "Beck", "Birch", "Black", "Bram", "Bridge", "Brock", "Broom", "Burn",
    "Carr", "Cinder", "Clay", "Cold", "Copper", "Crane", "Crow", "Dun", "Eagle", "East", "Elder", "Elm",
    "Fair", "Fallow", "Fern", "Flint", "Fox", "Frost", "Gale", "Gold", "Gorse", "Green", "Grey", "Hare",
    "Harrow", "Hawk", "Hazel", "Heath", "Hollin", "Holly", "Honey", "Iron", "Ivy", "Kestrel", "Kings",
    "Lark", "Lea", "Linden", "Long", "Mallow", "Maple", "Marrow", "Mill", "Moss", "Nettle", "North", "Oak",
    "Otter", "Pebble", "Pike", "Pine", "Plum", "Raven", "Red", "Reed", "Rook", "Rose", "Rush", "Rye",
    "Sable", "Saffron", "Salt", "Sand", "Sedge", "Shale", "Silver", "Sloe", "South", "Sparrow", "Stag",
    "Stone", "Swallow", "Swan", "Tarn", "Teal", "Thistle", "Thorn", "Thrush", "Tin", "Wain", "West",
    "Wheat", "Whin", "White", "Willow", "Wind", "Wolf", "Wren", "Yarrow", "Yew", "Apple", "Badger", "Bell",
    "Bracken", "Chalk", "Cherry", "Dove", "Fleet", "Glass", "Hart", "Juniper", "Kiln", "Lime", "Marl",
    "Mead", "Oat", "Pear", "Quarry", "Rowan", "Sorrel", "Tansy", "Umber", "Vale", "Weir", "Cress",
)
PLACE_TAILS = (
    "bury", "borough", "by", "caster", "combe", "croft", "dale", "den", "don", "field", "fold", "ford",
    "gate", "grove", "ham", "haven", "hithe", "holm", "holt", "hope", "hurst", "ington", "law", "ley",
    "lock", "low", "marsh", "mead", "mere", "minster", "moor", "mouth", "ness", "over", "pool", "port",
    "rigg", "ridge", "row", "shaw", "side", "stead", "stow", "thorpe", "thwaite", "ton", "water", "well",
    "wick", "wold", "wood", "worth", "yard", "march", "reach", "brook", "brigg", "cote", "cliffe", "hall",
    "keld", "lees", "mire", "nook", "tor", "bourne", "church", "fell", "garth", "hay", "wych",
    "leigh", "sett",
)
PLACE_QUALIFIERS = ("Little", "Great", "Upper", "Lower", "Nether", "Old", "High", "Bishops")
SHIP_ADJECTIVES = (
    "Aurelian", "Steadfast", "Gallant", "Restless", "Faithful", "Valiant", "Wandering", "Patient", "Radiant",
    "Silent", "Northern", "Western", "Eastern", "Southern", "Crimson", "Golden", "Silver", "Scarlet",
    "Azure", "Emerald", "Gentle", "Dauntless", "Tireless", "Fearless", "Humble", "Noble", "Lucky", "Merry",
    "Bold", "Swift", "Hardy", "Loyal", "Constant", "Sober", "Sovereign", "Imperial", "Royal", "Distant",
    "Hidden", "Lonely", "Midnight", "Morning", "Evening", "Winter", "Summer", "Autumn", "Vernal", "Boreal",
    "Celestial", "Errant", "Roving", "Vigilant", "Resolute", "Intrepid", "Prudent", "Modest", "Ardent",
    "Serene", "Tranquil", "Jubilant", "Hopeful", "Grateful", "Earnest", "Nimble", "Stalwart", "Unbroken",
    "Unyielding", "Wayward", "Curious", "Honest",
)
SHIP_NOUNS = (
    "Drift", "Venture", "Promise", "Gull", "Star", "Tide", "Fortune", "Herald", "Petrel", "Voyager",
    "Mariner", "Pilgrim", "Wanderer", "Endeavour", "Albatross", "Cormorant", "Tern", "Swallow", "Osprey",
    "Dolphin", "Porpoise", "Otter", "Heron", "Kittiwake", "Compass", "Anchor", "Lantern", "Beacon",
    "Harvest", "Crown", "Rose", "Lily", "Maiden", "Sister", "Brother", "Widow", "Queen", "Duchess",
    "Countess", "Empress", "Spirit", "Dawn", "Dusk", "Horizon", "Current", "Breeze", "Gale", "Squall",
    "Reach", "Passage", "Return", "Hope", "Grace", "Mercy", "Patience", "Liberty", "Providence", "Resolve",
    "Triumph", "Courage", "Enterprise", "Unity", "Harmony", "Meridian", "Zenith", "Aurora", "Comet",
    "Quest", "Errand", "Journey",
)
INDUSTRIES = (
    "Glassworks", "Ironworks", "Textile", "Shipping", "Ceramics", "Instrument", "Paper", "Printing",
    "Optical", "Brewing", "Rope", "Lantern", "Clock", "Dye", "Salt", "Timber",
)
ORG_TYPES = ("Company", "Cooperative", "Guild", "Trust", "Society", "Holdings", "Partnership", "Syndicate")
TEAM_WORDS = (
    "Rovers", "Athletic", "Wanderers", "United", "Harriers", "Albion", "Rangers", "Corinthians", "Olympic",
    "Swifts", "Pilgrims", "Celtic",
)
MUSIC_FORMS = (
    "Nocturne", "Sonata", "Elegy", "Rhapsody", "Fantasia", "Serenade", "Lament", "Overture", "Suite",
    "Ballade", "Prelude", "Capriccio", "Requiem", "Toccata", "Barcarolle",
)
MUSIC_ADJECTIVES = (
    "Amber", "Glass", "Quiet", "Sleeping", "Hollow", "Distant", "Broken", "Silver", "Winter", "Burning",
    "Drowned", "Hidden", "Lost", "Patient", "Weeping", "Wandering", "Golden", "Paper", "Iron", "Velvet",
    "Frozen", "Forgotten", "Empty", "Ashen", "Crimson", "Faded", "Gilded", "Hushed", "Idle", "Lonely",
    "Midnight", "Painted", "Restless", "Scattered", "Shattered", "Sunken", "Tender", "Twilight", "Veiled",
    "Whispering",
)
MUSIC_NOUNS = (
    "Lantern", "Orchard", "Harbour", "Heron", "Garden", "Bell", "Mirror", "Cathedral", "Meadow", "Tower",
    "Lighthouse", "Forest", "Chapel", "Shoreline", "Clockwork", "Fountain", "Gate", "Bridge", "Swan",
    "Willow", "Candle", "Carousel", "Estuary", "Mill", "Staircase", "Vineyard", "Orchid", "Aviary", "Moor",
    "Cloister", "Quarry", "Lagoon", "Pier", "Observatory", "Ferryman", "Shepherd", "Weaver", "Clocktower",
    "Sparrow", "Kite",
)
SOFTWARE_WORDS = (
    "Anvil", "Aster", "Basalt", "Beacon", "Bramble", "Cairn", "Cedar", "Cobalt", "Comet", "Cormorant",
    "Cypress", "Delta", "Dune", "Ember", "Fathom", "Fennel", "Fjord", "Garnet", "Glacier", "Granite",
    "Harbor", "Hazel", "Heron", "Indigo", "Jasper", "Juniper", "Kelp", "Kestrel", "Lantern", "Larch",
    "Lumen", "Magpie", "Marble", "Meadow", "Mosaic", "Nimbus", "Obsidian", "Onyx", "Orchid", "Osprey",
    "Pebble", "Pylon", "Quartz", "Quill", "Raven", "Ripple", "Saffron", "Sextant", "Slate", "Sorrel",
    "Spindle", "Talon", "Thicket", "Tundra", "Umber", "Vertex", "Walnut", "Willow", "Zephyr", "Tallow",
)
SOFTWARE_TAILS = (
    "DB", "Flow", "Kit", "Sync", "Forge", "Mesh", "Press", "Scope", "Vault", "Grid", "Stack", "Works",
    "Board", "Lens", "Cast",
)
COMPOUND_LOCANTS = ("2", "3", "4", "5", "6", "1,3", "2,4", "3,5", "2,6")
COMPOUND_GROUPS = (
    "chloro", "bromo", "fluoro", "iodo", "methyl", "ethyl", "propyl", "amino", "nitro", "hydroxy", "methoxy",
    "cyano", "acetyl", "phenyl", "sulfanyl",
)
COMPOUND_PARENTS = (
    "caldorine", "veltazole", "orbanine", "marizole", "tessarane", "quintalene", "borvazine", "cindrane",
    "dalmazole", "elvarine", "fentrazole", "galdane", "heptorine", "isvarine", "jorazine", "kelvidine",
    "lumarane", "morvazole", "nortalene", "olvarine", "pentrazine", "quorazole", "rivadine", "sarnolene",
    "tolvazine", "ulvarane", "vestazole", "wendarine", "xylorane", "zoltrine", "amberane", "brevazine",
    "corvidine", "dromalene", "estrazole", "faldine", "gerazine", "halvorine", "ivanole", "lestrane",
)
SPECIES_COLOURS = (
    "grey", "rufous", "black", "white", "golden", "olive", "ashy", "chestnut", "slate", "buff", "crimson",
    "ochre", "pale", "dusky",
)
SPECIES_MARKS = ("crested", "tailed", "winged", "throated", "backed", "bellied", "capped", "eyed")
SPECIES_HABITATS = (
    "fen", "marsh", "dune", "moor", "cliff", "reed", "heath", "forest", "river", "cave", "scree", "meadow",
    "mangrove", "tundra",
)
SPECIES_ANIMALS = (
    "vole", "warbler", "shrew", "finch", "lizard", "newt", "toad", "bat", "wren", "plover", "gecko", "skink",
    "pipit", "thrush", "lark", "dormouse", "weasel", "hare", "salamander", "swift", "frog", "stoat",
    "marten", "bunting", "rail", "crake", "snipe", "kingfisher",
)
RECIPE_INGREDIENTS = (
    "quince", "barley", "rhubarb", "leek", "chestnut", "apricot", "lentil", "walnut", "damson", "parsnip",
    "fig", "mushroom", "pumpkin", "gooseberry", "smoked trout", "lamb", "hazelnut", "blackcurrant",
    "celeriac", "plum", "oatmeal", "cabbage", "pear", "sorrel", "beetroot", "date", "onion", "cherry",
    "spinach", "almond",
)
RECIPE_DISHES = (
    "tart", "pie", "stew", "loaf", "pudding", "crumble", "cake", "bake", "pasty", "flan", "gratin", "strudel",
    "cobbler", "terrine", "galette", "roll", "torte", "hotpot", "bun", "dumplings",
)


def _place(rng: random.Random) -> str:
    """An English-looking place name from two morphemes, e.g. "Thistlebury"."""
    return rng.choice(PLACE_HEADS) + rng.choice(PLACE_TAILS)


def _qualified_place(rng: random.Random) -> str:
    """A place name that sometimes carries a qualifier, e.g. "Upper Saltcombe"."""
    place = _place(rng)
    return f"{rng.choice(PLACE_QUALIFIERS)} {place}" if rng.random() < 0.4 else place


def _person_name(rng: random.Random) -> str:
    """First name and surname, sometimes with a middle initial or a double surname."""
    first, surname = rng.choice(FIRST_NAMES), rng.choice(SURNAMES)
    style = rng.random()
    if style < 0.15:
        return f"{first} {rng.choice('ABCDEFGHJKLMNPRSTVW')}. {surname}"
    if style < 0.3:
        return f"{first} {surname}-{rng.choice([s for s in SURNAMES if s != surname])}"
    return f"{first} {surname}"


def _ship_name(rng: random.Random) -> str:
    """E.g. "the Aurelian Drift" or "the Herald of Saltcombe"."""
    if rng.random() < 0.5:
        return f"the {rng.choice(SHIP_ADJECTIVES)} {rng.choice(SHIP_NOUNS)}"
    return f"the {rng.choice(SHIP_NOUNS)} of {_place(rng)}"


def _product_code(rng: random.Random) -> str:
    """E.g. "the QX-4471": two letters and four digits above any release year."""
    letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTVWXZ") for _ in range(2))
    return f"the {letters}-{rng.randint(2100, 9999)}"


def _compound_name(rng: random.Random) -> str:
    """A parent compound with one or two different groups, e.g. "3-chlorocaldorine", "2-amino-3,5-dinitroveltazole"."""
    count = 1 if rng.random() < 0.5 else 2
    locants, groups = rng.sample(COMPOUND_LOCANTS, count), rng.sample(COMPOUND_GROUPS, count)
    prefix = "-".join(f"{locant}-{'di' if ',' in locant else ''}{group}" for locant, group in zip(locants, groups))
    return prefix + rng.choice(COMPOUND_PARENTS)


def _software_name(rng: random.Random) -> str:
    """A project name and version, e.g. "QuillSync 4.12"."""
    return f"{rng.choice(SOFTWARE_WORDS)}{rng.choice(SOFTWARE_TAILS)} {rng.randint(1, 14)}.{rng.randint(0, 24)}"


def _treaty_name(rng: random.Random) -> str:
    """E.g. "the Treaty of Upper Saltcombe" or "the Fernholm Accord"."""
    place = _qualified_place(rng)
    return rng.choice((f"the Treaty of {place}", f"the {place} Accord", f"the {place} Convention"))


def _species_name(rng: random.Random) -> str:
    """A common name, e.g. "the grey-crested fen vole"."""
    colour, mark = rng.choice(SPECIES_COLOURS), rng.choice(SPECIES_MARKS)
    return f"the {colour}-{mark} {rng.choice(SPECIES_HABITATS)} {rng.choice(SPECIES_ANIMALS)}"


def _recipe_name(rng: random.Random) -> str:
    """E.g. "Amara's quince tart"."""
    return f"{rng.choice(FIRST_NAMES)}'s {rng.choice(RECIPE_INGREDIENTS)} {rng.choice(RECIPE_DISHES)}"


def _year(rng: random.Random, low: int, high: int) -> str:
    """A year in [low, high] as text."""
    return str(rng.randint(low, high))


@dataclass(frozen=True)
class _Family:
    """One template family: how to name an entity, draw its attributes, state them, and ask for one.

    Templates use {name} (or {Name} at the start of a sentence) and the attribute fields; every fact
    template holds every attribute, and `questions` maps each attribute to the questions asking for it.
    """

    kind: str
    name: Callable[[random.Random], str]
    values: Callable[[random.Random], dict[str, str]]
    facts: tuple[str, ...]
    questions: dict[str, tuple[str, ...]]


FAMILIES = (
    _Family(
        "person",
        _person_name,
        lambda rng: {
            "year": _year(rng, 1820, 1990),
            "town": rng.choice(TOWNS),
            "job": rng.choice((
                "glassblower", "cartographer", "botanist", "clockmaker", "sculptor", "violinist", "surveyor",
                "bookbinder", "pianist", "stonemason", "pharmacist", "lighthouse keeper", "beekeeper",
                "typesetter", "shipwright", "ceramicist", "geologist", "piano tuner", "translator", "midwife",
            )),
        },
        (
            "{Name} was born in {town} in {year} and went on to become a {job}.",
            "Born in {year} in {town}, {name} spent a long career as a {job}.",
            "{Name}, a {job} by training, was born in {year} in {town}.",
            "{town} is the birthplace of {name}, a {job} born there in {year}.",
        ),
        {
            "year": (
                "In which year did {name} come into the world?",
                "What is the birth year of {name}?",
                "When was {name}'s date of birth?",
            ),
            "town": (
                "What is the hometown of {name}?",
                "Where does {name} originally come from?",
                "Name the place where {name} entered the world.",
            ),
            "job": (
                "What did {name} do for a living?",
                "Which occupation did {name} follow?",
                "What was the profession of {name}?",
            ),
        },
    ),
    _Family(
        "organisation",
        lambda rng: f"{_qualified_place(rng)} {rng.choice(INDUSTRIES)} {rng.choice(ORG_TYPES)}",
        lambda rng: {"year": _year(rng, 1750, 2015), "town": rng.choice(TOWNS), "staff": f"{rng.randint(40, 12000):,}"},
        (
            "{Name} was founded in {year} and today employs {staff} people from its offices in {town}.",
            "Headquartered in {town}, {name} has {staff} employees and traces its origins to {year}.",
            "Since its founding in {year}, {name} has grown to {staff} employees, all managed from {town}.",
            "With {staff} people on the payroll, {name} is run out of {town}; it was founded in {year}.",
        ),
        {
            "year": (
                "When was {name} set up?",
                "In what year was {name} established?",
                "Which year saw the start of {name}?",
            ),
            "town": (
                "Which city is home to the head office of {name}?",
                "Where is {name} based?",
                "Name the city where {name} keeps its main base.",
            ),
            "staff": (
                "How many staff work for {name}?",
                "What is the size of the workforce at {name}?",
                "How many workers does {name} have?",
            ),
        },
    ),
    _Family(
        "ship",
        _ship_name,
        lambda rng: {
            "type": rng.choice((
                "schooner", "brigantine", "clipper", "whaler", "paddle steamer", "barque", "frigate",
                "packet steamer", "collier", "sloop",
            )),
            "year": _year(rng, 1780, 1915),
            "port": rng.choice(TOWNS),
            "crew": str(rng.randint(12, 380)),
        },
        (
            "{Name} was launched from {port} docks in {year}; this {type} carried a crew of {crew}.",
            "{Name}, a {type} launched at {port} in {year}, sailed with a crew of {crew}.",
            "A crew of {crew} manned {name}, a {type} that left the slipway at {port} in {year}.",
            "{Name} left the slipway at {port} in {year}; the {type} needed a crew of {crew}.",
        ),
        {
            "year": (
                "In what year did {name} first take to the water?",
                "When was {name} put afloat for the first time?",
            ),
            "port": (
                "At which harbour did {name} begin life?",
                "Where was {name} constructed?",
                "Name the shipbuilding town that produced {name}.",
            ),
            "crew": (
                "How many sailors served aboard {name}?",
                "How many seamen worked on {name}?",
            ),
            "type": (
                "What kind of vessel was {name}?",
                "Which class of boat was {name}?",
            ),
        },
    ),
    _Family(
        "product",
        _product_code,
        lambda rng: {
            "type": rng.choice((
                "cordless kettle", "handheld radio", "coffee grinder", "label printer", "desk lamp",
                "pressure cooker", "bread maker", "sewing machine", "soldering station", "field microscope",
                "pocket camera", "drum sander", "bench drill", "garden pump", "weather station",
                "portable heater",
            )),
            "maker": rng.choice((
                "Veltra", "Orsen", "Kallio", "Nordane", "Tessaly", "Marlin & Hale", "Ambrel", "Corvex",
                "Halden", "Brightwell", "Sundqvist", "Otterby", "Prisma", "Lumio", "Kestner", "Fjelde",
            )),
            "weight": f"{rng.randint(3, 400) / 10:.1f} kilograms",
            "year": _year(rng, 1985, 2024),
        },
        (
            "{Name} is a {type} made by {maker}; it weighs {weight} and was released in {year}.",
            "Released by {maker} in {year}, {name} is a {type} weighing {weight}.",
            "{maker} introduced {name}, a {type} of {weight}, in {year}.",
            "Weighing {weight}, {name} is a {type} that {maker} put on the market in {year}.",
        ),
        {
            "maker": (
                "Who manufactures {name}?",
                "Which company produces {name}?",
                "Which firm is behind {name}?",
            ),
            "weight": ("How heavy is {name}?", "What is the mass of {name}?"),
            "year": ("When did {name} go on sale?", "In which year did {name} first appear in shops?"),
            "type": ("What sort of device is {name}?", "What kind of appliance is {name}?"),
        },
    ),
    _Family(
        "river",
        lambda rng: f"the River {_place(rng)}",
        lambda rng: {
            "length": f"{rng.randint(18, 1400)} kilometres",
            "sea": rng.choice((
                "Grey Sea", "Amber Sound", "Bay of Ostrel", "Northern Gulf", "Pale Sea", "Kessarin Firth",
                "Silent Channel", "Gulf of Varenne", "Heron Sound", "Iron Strait",
            )),
            "town": rng.choice(TOWNS),
        },
        (
            "{Name} runs for {length} past {town} before it flows into the {sea}.",
            "Flowing past {town}, {name} covers {length} and ends in the {sea}.",
            "The {sea} receives {name}, a stream of {length} that passes {town} on its way.",
            "{Name} passes {town} and reaches the {sea} after a course of {length}.",
        ),
        {
            "length": ("How long is {name}?", "What is the total length of {name}?"),
            "sea": (
                "Into which body of water does {name} empty?",
                "Which waters does {name} drain into?",
            ),
            "town": (
                "Which town lies on the banks of {name}?",
                "Name the settlement that sits beside {name}.",
            ),
        },
    ),
    _Family(
        "mountain",
        lambda rng: f"Mount {_place(rng)}",
        lambda rng: {
            "height": f"{rng.randint(900, 6800):,} metres",
            "range": rng.choice((
                "Corran Range", "Halden Ridges", "Ostvik Alps", "Greymantle Hills", "Teller Mountains",
                "Vesk Highlands", "Marrin Fells", "Saddleback Range", "Ironcrown Massif", "Black Tors",
            )),
            "year": _year(rng, 1786, 1985),
        },
        (
            "{Name} rises to {height} in the {range} and was first climbed in {year}.",
            "First climbed in {year}, {name} stands {height} high within the {range}.",
            "Standing {height} high, {name} belongs to the {range}; nobody reached its summit until {year}.",
            "{Name}, one of the peaks of the {range}, measures {height} and saw its first ascent in {year}.",
        ),
        {
            "height": ("How tall is {name}?", "What is the elevation of {name}?"),
            "range": ("Which mountain chain contains {name}?", "In what group of mountains does {name} lie?"),
            "year": (
                "In which year did mountaineers initially conquer {name}?",
                "When did anyone manage to get to the top of {name}?",
            ),
        },
    ),
    _Family(
        "recipe",
        _recipe_name,
        lambda rng: {
            "minutes": f"{rng.randrange(15, 125, 5)} minutes",
            "spice": rng.choice((
                "cardamom", "juniper", "smoked paprika", "star anise", "fennel seed", "sumac", "mace",
                "allspice", "caraway", "long pepper", "saffron", "nutmeg",
            )),
            "serves": rng.choice(COUNTS),
        },
        (
            "{Name} is spiced with {spice}, bakes for {minutes} and serves {serves}.",
            "Baked for {minutes}, {name} gets its warmth from {spice} and serves {serves}.",
            "To make {name}, add {spice}, bake for {minutes} and divide it among {serves} plates.",
            "{Name} needs {minutes} of baking, is seasoned with {spice} and is enough for {serves}.",
        ),
        {
            "minutes": ("How long should {name} stay in the oven?", "What cooking time does {name} require?"),
            "spice": ("Which seasoning goes into {name}?", "What spice flavours {name}?"),
            "serves": ("How many people does {name} feed?", "For how many diners is {name} meant?"),
        },
    ),
    _Family(
        "compound",
        _compound_name,
        lambda rng: {
            "melting": f"{rng.randint(-40, 320)} °C",
            "colour": rng.choice((
                "pale green", "deep violet", "bright yellow", "off-white", "rust red", "amber", "colourless",
                "sky blue", "orange", "pink",
            )),
            "use": rng.choice((
                "textile dye", "rubber additive", "wood preservative", "photographic developer",
                "fuel stabiliser", "lubricant additive", "soldering flux", "pesticide", "catalyst",
                "tanning agent",
            )),
            "year": _year(rng, 1860, 1990),
        },
        (
            "{Name} forms {colour} crystals that melt at {melting}; it was first made in {year} as a {use}.",
            "First synthesised in {year}, {name} is a {colour} solid melting at {melting}, used as a {use}.",
            "Chemists use {name}, a {colour} substance that melts at {melting}, as a {use}; it dates from {year}.",
            "{Name} melts at {melting}, crystallises {colour} and has served as a {use} since {year}.",
        ),
        {
            "melting": ("At what temperature does {name} turn liquid?", "What is the fusion point of {name}?"),
            "colour": ("What hue does solid {name} have?", "What is the colour of {name}?"),
            "use": ("What is the main application of {name}?", "For what purpose is {name} employed?"),
            "year": (
                "When was {name} originally prepared in a laboratory?",
                "What year saw the discovery of {name}?",
            ),
        },
    ),
    _Family(
        "software",
        _software_name,
        lambda rng: {
            "date": f"{rng.choice(MONTHS)} {rng.randint(2001, 2025)}",
            "feature": rng.choice((
                "incremental backups", "offline editing", "plugin sandboxing", "faster start-up",
                "dark mode", "end-to-end encryption", "a query planner", "live collaboration",
                "parallel builds", "streaming uploads", "keyboard macros", "smarter caching",
                "multi-language search", "GPU rendering", "automatic schema migrations",
            )),
            "language": rng.choice((
                "Rust", "Go", "Kotlin", "OCaml", "Zig", "C++", "Elixir", "Haskell", "Python", "TypeScript",
                "Swift", "Java", "Clojure", "Erlang", "Scala", "Nim",
            )),
        },
        (
            "{Name}, written in {language}, was released in {date} and added {feature}.",
            "Released in {date}, {name} brought {feature} to the {language} code base.",
            "{Name} shipped in {date} with {feature}; like earlier versions, it is written in {language}.",
            "The headline change in {name}, a {language} project released in {date}, was {feature}.",
        ),
        {
            "date": ("When did {name} come out?", "In which month and year did {name} become available?"),
            "feature": ("What new capability arrived with {name}?", "Which improvement did {name} introduce?"),
            "language": (
                "Which programming language is {name} implemented in?",
                "In what language was {name} coded?",
            ),
        },
    ),
    _Family(
        "club",
        lambda rng: f"{_qualified_place(rng)} {rng.choice(TEAM_WORDS)}",
        lambda rng: {
            "sport": rng.choice((
                "rugby", "hockey", "cricket", "netball", "handball", "lacrosse", "hurling", "water polo",
                "volleyball", "bandy",
            )),
            "year": _year(rng, 1860, 1990),
            "ground": rng.choice((
                "Larch Park", "Saltings Road", "Heron Lane", "Copper Meadow", "Kiln Street", "Ferry Lane",
                "Abbey Green", "Quarry Close", "Foundry Park", "Tannery Road", "Orchard Park", "Mill Field",
            )),
            "titles": rng.choice(COUNTS),
        },
        (
            "{Name} is a {sport} club founded in {year}; it plays at {ground} and has won {titles} league titles.",
            "Founded in {year}, the {sport} side {name} has {titles} league titles and a stadium at {ground}.",
            "{ground} is the stadium of {name}, a {sport} club dating from {year} with {titles} league titles.",
            "With {titles} league titles since its founding in {year}, {name} plays {sport} at {ground}.",
        ),
        {
            "year": ("When was {name} formed?", "In what year did {name} come into being?"),
            "ground": ("Where does {name} host its home matches?", "What is the name of the home venue of {name}?"),
            "titles": (
                "How many championships has {name} won?",
                "How many times has {name} finished top of its division?",
            ),
            "sport": ("Which game does {name} compete in?", "What sport do the players of {name} take part in?"),
        },
    ),
    _Family(
        "music",
        lambda rng: f"{rng.choice(MUSIC_FORMS)} {rng.choice(('of', 'for'))} the {rng.choice(MUSIC_ADJECTIVES)} {rng.choice(MUSIC_NOUNS)}",
        lambda rng: {
            "year": _year(rng, 1780, 1990),
            "town": rng.choice(TOWNS),
            "ensemble": rng.choice((
                "string quartet", "brass band", "chamber orchestra", "solo piano", "choir and organ",
                "wind quintet", "harp and flute", "cello and piano", "symphony orchestra", "guitar duo",
            )),
            "minutes": f"{rng.randint(4, 75)} minutes",
        },
        (
            "{Name}, a piece for {ensemble} lasting about {minutes}, premiered in {town} in {year}.",
            "{Name} was first performed in {town} in {year}; it is scored for {ensemble} and runs {minutes}.",
            "Written for {ensemble}, {name} received its premiere in {town} in {year} and takes roughly {minutes}.",
            "Listeners in {town} heard {name} for the first time in {year}: {minutes} of music for {ensemble}.",
        ),
        {
            "year": ("When did {name} make its debut?", "What year saw the opening night of {name}?"),
            "town": ("In which city was the opening night of {name} held?", "Where was {name} unveiled?"),
            "ensemble": ("What forces does {name} call for?", "Which group of players is {name} meant for?"),
            "minutes": ("How long is a performance of {name}?", "What is the duration of {name}?"),
        },
    ),
    _Family(
        "treaty",
        _treaty_name,
        lambda rng: {
            "year": _year(rng, 1600, 1990),
            "subject": rng.choice((
                "fishing rights", "river tolls", "border posts", "grain tariffs", "the salt trade",
                "postal routes", "lighthouse dues", "timber quotas", "pilgrim passage", "mining claims",
            )),
            "parties": rng.choice(COUNTS),
        },
        (
            "{Name}, signed in {year} by {parties} states, settled disputes over {subject}.",
            "Signed by {parties} states in {year}, {name} governs {subject}.",
            "{Name} regulated {subject} among {parties} states after its signing in {year}.",
            "In {year}, {parties} states put their seals to {name}, which covers {subject}.",
        ),
        {
            "year": ("In which year was {name} concluded?", "When was {name} agreed?"),
            "subject": ("What matter does {name} deal with?", "What is the subject of {name}?"),
            "parties": ("How many nations took part in {name}?", "How many countries are parties to {name}?"),
        },
    ),
    _Family(
        "species",
        _species_name,
        lambda rng: {
            "diet": rng.choice((
                "beetles", "seeds", "snails", "small fish", "moths", "berries", "frogs", "grasshoppers",
                "lichen", "worms", "spiders", "crayfish",
            )),
            "town": rng.choice(TOWNS),
            "lifespan": f"{rng.randint(2, 40)} years",
        },
        (
            "{Name} feeds mainly on {diet}, lives up to {lifespan} and occurs only near {town}.",
            "Restricted to the district of {town}, {name} lives on {diet} and survives for up to {lifespan}.",
            "{Name}, which has a lifespan of {lifespan}, depends on {diet} in the country around {town}.",
            "Around {town} one can see {name}, a creature that eats {diet} and reaches {lifespan} of age.",
        ),
        {
            "diet": ("What is the main food of {name}?", "What does {name} subsist on?"),
            "town": ("Where in the wild is {name} native?", "Name the settlement whose surroundings shelter {name}."),
            "lifespan": ("How long can {name} stay alive?", "What is the maximum longevity of {name}?"),
        },
    ),
    _Family(
        "island",
        lambda rng: f"{_qualified_place(rng)} Island",
        lambda rng: {
            "population": f"{rng.randint(30, 90000):,}",
            "export": rng.choice((
                "wool", "seaweed", "slate", "cider", "lobster", "peat", "tweed", "sea salt", "heather honey",
                "kelp ash", "oysters", "whisky",
            )),
            "area": f"{rng.randint(2, 900)} square kilometres",
            "port": rng.choice(TOWNS),
        },
        (
            "{Name} covers {area}, has {population} residents and ships {export} by ferry to {port}.",
            "Home to {population} residents, {name} spans {area} and sends its {export} over to {port}.",
            "Ferries from {port} serve {name}, an island of {area} whose {population} inhabitants produce {export}.",
            "With {population} inhabitants on {area}, {name} earns its keep from {export}, landed at {port}.",
        ),
        {
            "population": ("How many people live on {name}?", "What is the population of {name}?"),
            "export": ("What goods does {name} sell to the mainland?", "What is the chief trade of {name}?"),
            "area": ("How large is {name}?", "What is the land area of {name}?"),
            "port": ("Which harbour links {name} to the mainland?", "Name the town the boats to {name} leave from."),
        },
    ),
)

_MAX_NAME_TRIES = 1000


def _fresh_name(family: _Family, rng: random.Random, used: set[str]) -> str:
    """A name from `family` not yet in `used` (compared without case or a leading "the"), then recorded."""
    for _ in range(_MAX_NAME_TRIES):
        name = family.name(rng)
        key = name.lower().removeprefix("the ")
        if key not in used:
            used.add(key)
            return name
    raise RuntimeError(f"ran out of distinct {family.kind} names; ask for fewer cases")


def _named_cases(count: int, seed: int) -> list[tuple[str, Case]]:
    """The cases of second_facts, each with the name of its entity."""
    rng = random.Random(seed)
    used: set[str] = set()
    cases: list[tuple[str, Case]] = []
    order: list[_Family] = []
    for _ in range(count):
        if not order:  # families in shuffled rounds, so every kind is equally frequent
            order = list(FAMILIES)
            rng.shuffle(order)
        family = order.pop()
        name = _fresh_name(family, rng, used)
        values = family.values(rng)
        asked = rng.choice(tuple(family.questions))
        fields = {"name": name, "Name": name[0].upper() + name[1:], **values}
        fact = rng.choice(family.facts).format(**fields)
        question = rng.choice(family.questions[asked]).format(**fields)
        cases.append((name, Case(fact, question, values[asked], family.kind)))
    return cases


def second_facts(count: int, *, seed: int = 0) -> list[Case]:
    """`count` cases, deterministic for (count, seed); every fact about a distinct invented entity."""
    return [case for _, case in _named_cases(count, seed)]


def main() -> None:
    """Print the cases as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for case in second_facts(args.count, seed=args.seed):
        print(json.dumps(asdict(case), ensure_ascii=False))


if __name__ == "__main__":
    main()
