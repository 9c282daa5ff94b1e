"""A fifth, independent generator of invented facts and questions, for measuring bank routing.

Written apart from packstore.kv.synthetic and tools/data/second_facts.py, third_facts.py and fourth_facts.py: it
imports none of them and shares no code, word table, family or question wording with them. Ten families:
apiaries, falconry birds, textile dye lots, herding dogs, windmills, fossil type specimens, coin hoards,
tram routes, stained-glass windows and church bells.

Each fact is about one invented entity whose name joins a *core* (a coined word such as "Brelbamp", never
used by two groups) with one *varying* token: a Greek letter ("Brelbamp Kappa"), an epithet ("Khallaft
the Brave"), a lot code ("Kvagnith FR5"), a dog's call name ("Lantick Ned"), a beast ("the Coot of
Kirnurk"), a type-specimen term ("the Phivrech paratype"), a find word ("the Cilpith Trove"), a route
code ("Ferrondark 14K"), a dedication ("the Inguthosk Jubilee Window") or a saint ("Oswald of Ebbilvuth"). Two
designed properties make the set hard for either half of hybrid routing alone:

* Near-namesakes. About 30 % of facts come in groups of two or three that share the core and differ only
  in the varying token, picked from a look-alike cluster ("Gamma" / "Kappa" / "Lambda", "Brave" / "Grave",
  "FR5" / "FR9", "Jed" / "Ned" / "Ted", "holotype" / "paratype", "14K" / "14C"). A named question is answered
  only by getting that token right: easy for BM25, hard for a sentence embedder.
* Described questions. About 40 % of questions never name the entity: they pick out its fact by a place
  (one of 128, worded as in the fact) and two attributes reworded from tables whose question side shares
  no word stem but little words ("the", "of") with anything in the fact ("madder root" -> "Rubia tinctorum", "rabbits" -> "coneys",
  "above the altar" -> "over the communion table"), and ask for the name, a number or another
  attribute. BM25 sees only the place; the embedder has to read the rewordings. The other 60 % name the
  entity and word the asked attribute in other words than the fact.

Each family has three fact shapes, six named question forms and four described ones. On 2,000 cases
(seed 5) a named question's content words (four letters or more, the name left out) occur in its fact
0.2 % of the time on average, a described question's 11.0 % (the place, and little words such as "with"
and "from"); with Snowball stems, no question shares a stem rarer than 2 % of facts with its fact other
than the name or the place (tests/eval/test_fifth_facts.py checks these). Of questions at FIFTH_SEED,
39.2 % of 5,000 and 39.9 % of 100,000 are described; 28.8 % and 29.6 % of facts have near-namesakes.

Exactly one answer per question. Within a family each case takes a distinct (place, attribute,
attribute) combination, drawn without replacement from at least 15,360 per family (so up to 153,600
cases), and a described question states all three, so only its fact fits it; a named question carries the
full name, and no other fact contains that name. The answer (a name, an attribute as worded in the fact,
or a number) never occurs in its question. Facts and questions are unique; output is deterministic for
(count, seed); 100,000 cases take a few seconds.

    python -m tools.data.fifth_facts --count 5 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

FIFTH_SEED = 73  # the seed for evaluation; tools/data/fifth_facts.sha256 pins its output
DESCRIBED_SHARE = 0.40  # share of questions that never name the entity
GROUP_SIZES = ((1, 0.84), (2, 0.11), (3, 0.05))  # facts per core and their odds: about 30 % of facts share a core
_CORE_ATTEMPTS = 5_000


@dataclass(frozen=True)
class Case:
    """One invented fact, a question only it answers, and the answer as worded in the fact."""

    fact: str
    question: str
    answer: str  # verbatim in the fact (a name opening the fact may be capitalised), never in the question
    kind: str  # family
    form: str  # "named": the question carries the entity's full name; "described": it does not
    namesakes: int  # facts in this set whose names share the core and differ in one token, itself included


def _split(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Places: Czech-sounding coinages, 16 heads x 8 endings = 128.
PLACES = tuple(
    head + ending
    for head in _split("Brod Grad Kras Lip Mlyn Vod Zvon Tres Ostr Dub Hrad Kozl Ryb Smrk Jasen Topol")
    for ending in _split("ovo ice any ina ec ov ava nik")
)

# Cores end in a consonant cluster no English stemmer strips, so a core is its own stem.
_CORE_ENDINGS = _split("rk th nd sk rn mb x ch mp ft rd ck lk st")
_CORE_VOWELS = "aeiou"


def _core_maker(onsets: str, middles: str) -> Callable[[random.Random], str]:
    """Coined words: onset, vowel, middle, vowel, ending ("Stolvarck")."""
    starts, joins = _split(onsets), _split(middles)

    def make(rng: random.Random) -> str:
        return (rng.choice(starts) + rng.choice(_CORE_VOWELS) + rng.choice(joins) + rng.choice(_CORE_VOWELS)
                + rng.choice(_CORE_ENDINGS))

    return make


def _clusters(*groups: str) -> tuple[tuple[str, ...], ...]:
    return tuple(_split(group) for group in groups)


@dataclass(frozen=True)
class _Tokens:
    """Varying tokens: either look-alike clusters (a twin is another member of the same cluster) or a maker."""

    clusters: tuple[tuple[str, ...], ...] = ()
    make: Callable[[random.Random], str] | None = None
    twin: Callable[[random.Random, str], str] | None = None

    def draw(self, rng: random.Random) -> tuple[str, tuple[str, ...]]:
        """A token and the tokens that may stand beside it in a group."""
        if self.make is not None:
            return self.make(rng), ()
        cluster = rng.choice(self.clusters)
        return rng.choice(cluster), cluster

    def look_alike(self, rng: random.Random, token: str, cluster: tuple[str, ...], taken: list[str]) -> str | None:
        """A token not in `taken` that looks like `token`, or None when its cluster is used up."""
        if self.twin is not None:
            for _ in range(50):
                other = self.twin(rng, token)
                if other not in taken:
                    return other
            return None
        free = [member for member in cluster if member not in taken]
        return rng.choice(free) if free else None


_LOT_LETTERS = "BCDFGHJKLMNPRSTVWXZ"


def _lot_code(rng: random.Random) -> str:
    first, second = rng.sample(_LOT_LETTERS, 2)
    return f"{first}{second}{rng.randrange(2, 10)}"


def _lot_twin(rng: random.Random, code: str) -> str:
    """The letters swapped ("RW4" -> "WR4") or the digit changed ("RW4" -> "RW7")."""
    if rng.random() < 0.5:
        return code[1] + code[0] + code[2]
    return code[:2] + rng.choice([digit for digit in "23456789" if digit != code[2]])


_ROUTE_LETTERS = "ABCDEKNS"


def _route_code(rng: random.Random) -> str:
    return f"{rng.randrange(1, 100)}{rng.choice(_ROUTE_LETTERS)}"


def _route_twin(rng: random.Random, code: str) -> str:
    """The same number with another letter ("14A" -> "14B")."""
    return code[:-1] + rng.choice(_ROUTE_LETTERS.replace(code[-1], ""))


@dataclass(frozen=True)
class _Kind:
    """One family.

    Templates fill {name}, {place}, {one} and {two} (the two attributes as in the fact; {a_one}, {a_two} with
    "a" or "an"), the extras, and in described questions {one_r} and {two_r} (the rewordings; {a_one_r},
    {a_two_r}). `named` and `described` hold (asked field, template) pairs; the field is "name", "place",
    "one", "two" or an extra. `name` renders {core} and {token}.
    """

    kind: str
    core: Callable[[random.Random], str]
    tokens: _Tokens
    name: str
    one: tuple[tuple[str, str], ...]  # (as in the fact, as reworded in a described question)
    two: tuple[tuple[str, str], ...]
    extras: tuple[tuple[str, int, int, int], ...]  # (field, low, high, step) for rng.randrange
    facts: tuple[str, ...]
    named: tuple[tuple[str, str], ...]
    described: tuple[tuple[str, str], ...]

    @property
    def space(self) -> int:
        return len(PLACES) * len(self.one) * len(self.two)


KINDS = (
    _Kind(
        "apiary",
        _core_maker("St Br Gl Kr Pl Tr V M H D Sn Sk Th Wr Bl Dw", "lv rr nn lt rv sp mm ld gg ff zz lb"),
        _Tokens(_clusters("Beta Zeta Theta", "Epsilon Upsilon", "Omicron Omega", "Gamma Lambda Kappa", "Phi Psi Chi", "Iota Eta")),
        "{core} {token}",
        (
            ("basswood", "Tilia flowers"),
            ("clover", "trefoil"),
            ("borage", "starflower"),
            ("acacia", "wattle"),
            ("lavender", "Lavandula"),
            ("buckwheat", "Fagopyrum"),
            ("rosemary", "Salvia rosmarinus"),
            ("eucalyptus", "gum trees"),
            ("thyme", "a creeping Mediterranean herb"),
            ("sunflowers", "Helianthus"),
            ("fireweed", "rosebay willowherb"),
            ("manuka", "tea-tree scrub"),
            ("dandelions", "Taraxacum"),
            ("alfalfa", "lucerne"),
            ("phacelia", "scorpionweed"),
            ("sainfoin", "holy hay"),
        ),
        (
            ("Langstroth hives", "movable-frame boxes"),
            ("top-bar hives", "slatted troughs"),
            ("straw skeps", "woven baskets"),
            ("Warré hives", "vertical people's boxes"),
            ("log hives", "hollowed trunks"),
            ("observation hives", "see-through viewing cases"),
            ("Dadant hives", "jumbo-frame boxes"),
            ("Smith hives", "Scottish-pattern boxes"),
            ("terracotta hives", "earthenware jars"),
            ("polystyrene hives", "foam-insulated boxes"),
        ),
        (("colonies", 4, 241, 1), ("kilograms", 20, 3000, 10)),
        (
            "{name} is an apiary outside {place} whose {colonies} colonies, housed in {two}, work {one} and give {kilograms} kilograms of honey a year.",
            "Outside {place}, the {name} apiary keeps {colonies} colonies in {two}, working {one} for {kilograms} kilograms of honey yearly.",
            "Beekeepers at {name}, outside {place}, run {colonies} colonies in {two} on {one}, taking {kilograms} kilograms of honey each season.",
        ),
        (
            ("one", "What bloom do the foraging workers of {name} visit?"),
            ("one", "Which plants feed the swarms tended at {name}?"),
            ("two", "What do the swarms at {name} live in?"),
            ("place", "Which village lies closest to the bee yard {name}?"),
            ("colonies", "How many swarms does {name} maintain?"),
            ("kilograms", "What weight of crop comes annually from the bee yard {name}?"),
        ),
        (
            ("name", "Which bee yard by {place} puts its swarms in {two_r} and feeds them on {one_r}?"),
            ("name", "What is the name of the {place} bee yard that uses {two_r} amid {one_r}?"),
            ("colonies", "How many swarms live in {two_r} at the bee yard by {place} that relies on {one_r}?"),
            ("kilograms", "What weight of crop comes annually from the {two_r} by {place} whose workers visit {one_r}?"),
        ),
    ),
    _Kind(
        "falcon",
        _core_maker("Gr Kh Z Y Vr Ost Ur Esk Fr Sc Ch Qu Gw Rh Ny Ag", "lt rsk nd rv lm sk rg ll tt nv rc dr"),
        _Tokens(_clusters("Grim Prim Trim", "Dour Sour", "Sleek Slick", "Brave Grave", "Proud Loud", "Lithe Blithe", "Deft Daft")),
        "{core} the {token}",
        (
            ("rabbits", "coneys"),
            ("red grouse", "moorland gamebirds"),
            ("partridges", "stubble-field coveys"),
            ("pheasants", "ring-necked game fowl"),
            ("crows", "carrion corvids"),
            ("mallards", "dabbling waterfowl"),
            ("woodcock", "timberdoodles"),
            ("quail", "small ground fowl"),
            ("magpies", "pied chatterers"),
            ("jackrabbits", "long-eared desert hares"),
            ("squirrels", "tree-climbing rodents"),
            ("starlings", "murmuration flocks"),
            ("jackdaws", "nape-collared daws"),
            ("pigeons", "rock doves"),
            ("sage grouse", "prairie chickens"),
            ("moorhens", "marsh gallinules"),
        ),
        (
            ("peregrine", "Falco peregrinus"),
            ("merlin", "Falco columbarius"),
            ("goshawk", "Accipiter gentilis"),
            ("buzzard", "Buteo buteo"),
            ("gyrfalcon", "Falco rusticolus"),
            ("saker", "Falco cherrug"),
            ("lanner", "Falco biarmicus"),
            ("sparrowhawk", "Accipiter nisus"),
            ("shikra", "Accipiter badius"),
            ("hobby", "Falco subbuteo"),
        ),
        (("grams", 150, 2400, 5), ("year", 2003, 2024, 1)),
        (
            "{name}, {a_two} flown from the mews at {place}, hunts {one} and weighs {grams} grams; the bird hatched in {year}.",
            "Hatched in {year} and flown at {place}, the {two} {name} takes {one} at a flying weight of {grams} grams.",
            "The falconer at {place} flies {name}, {a_two} of {grams} grams hatched in {year}, at {one}.",
        ),
        (
            ("one", "What quarry does {name} chase?"),
            ("one", "Which game is {name} sent after?"),
            ("two", "What species of raptor is {name}?"),
            ("place", "Where is {name} housed and trained?"),
            ("grams", "What does {name} tip the scales at?"),
            ("year", "In what year did {name} come out of the egg?"),
        ),
        (
            ("name", "Which {two_r} kept at {place} goes after {one_r}?"),
            ("name", "What is the name of the raptor that chases {one_r} from {place}, {a_two_r}?"),
            ("grams", "What does the {two_r} from {place} that pursues {one_r} tip the scales at?"),
            ("year", "When did the {place} {two_r} used on {one_r} come out of the egg?"),
        ),
    ),
    _Kind(
        "dye lot",
        _core_maker("Pl Sl Tw Kv Dr Sp B F G J L N P R T W", "sk rn lv nd st rd mb lk rp sc tr gn"),
        _Tokens(make=_lot_code, twin=_lot_twin),
        "{core} {token}",
        (
            ("madder root", "Rubia tinctorum"),
            ("woad", "Isatis tinctoria"),
            ("weld", "Reseda luteola"),
            ("cochineal", "crushed Dactylopius bugs"),
            ("logwood", "Haematoxylum heartwood"),
            ("safflower", "Carthamus petals"),
            ("turmeric", "Curcuma rhizome"),
            ("fustic", "Maclura chips"),
            ("cutch", "catechu extract"),
            ("annatto", "achiote seeds"),
            ("henna", "Lawsonia leaves"),
            ("alkanet", "Alkanna root"),
            ("pomegranate rind", "Punica peel"),
            ("oak galls", "tannin nutgalls"),
        ),
        (
            ("merino", "fine ovine fibre"),
            ("mulberry silk", "Bombyx filament"),
            ("tussah silk", "Antheraea filament"),
            ("linen", "woven Linum"),
            ("cotton", "Gossypium"),
            ("alpaca yarn", "camelid fibre"),
            ("mohair", "Angora goat coat"),
            ("cashmere", "pashmina down"),
            ("hemp", "bast from Cannabis"),
            ("jute", "Corchorus bast"),
            ("ramie", "China grass"),
        ),
        (("kilograms", 5, 401, 1), ("degrees", 40, 99, 1)),
        (
            "Dye lot {name}, mixed at the {place} dye house, treated {kilograms} kilograms of {two} with {one} at {degrees} degrees.",
            "At the {place} dye house, lot {name} took {kilograms} kilograms of {two} through a {one} bath held at {degrees} degrees.",
            "Lot {name} from the {place} dye house used {one} on {kilograms} kilograms of {two}, simmered at {degrees} degrees.",
        ),
        (
            ("one", "What colourant went into the vat for batch {name}?"),
            ("one", "Which natural colourant gave batch {name} its shade?"),
            ("two", "What material was steeped in batch {name}?"),
            ("place", "Which dyeworks produced batch {name}?"),
            ("kilograms", "What mass of material went through batch {name}?"),
            ("degrees", "How hot was the vat for batch {name}?"),
        ),
        (
            ("name", "Which batch from the dyeworks in {place} steeped {two_r} in {one_r}?"),
            ("name", "What is the code of the {place} dyeworks batch that tinted {two_r} with {one_r}?"),
            ("degrees", "How hot was the vat when the {place} dyeworks steeped {two_r} in {one_r}?"),
            ("kilograms", "What mass of {two_r} did the {place} dyeworks steep in {one_r}?"),
        ),
    ),
    _Kind(
        "herding dog",
        _core_maker("M C Cr Gl Br Tr L S Sc Dr K R V P Fl Gr", "rv sk ld rr nt lv st ck ll dd nn rb"),
        _Tokens(_clusters("Floss Toss Joss", "Fly Sly", "Gyp Kip Pip", "Meg Peg", "Bess Jess Tess", "Roy Coy", "Jed Ned Ted", "Cap Tap")),
        "{core} {token}",
        (
            ("Herdwick ewes", "a Cumbrian hill flock"),
            ("Blackface ewes", "a horned Scottish flock"),
            ("Texel ewes", "Dutch-bred meat sheep"),
            ("Suffolk lambs", "young East Anglian stock"),
            ("Jacob sheep", "a piebald four-horned breed"),
            ("Soay sheep", "a feral St Kilda breed"),
            ("Shetland ewes", "a small northern-isles flock"),
            ("Highland cattle", "shaggy long-horned kine"),
            ("dairy heifers", "young milking cows"),
            ("Angus steers", "polled black bullocks"),
            ("Indian Runner ducks", "upright-walking poultry"),
            ("goats", "nannies and billies"),
        ),
        (
            ("border collie", "frontier herding breed"),
            ("kelpie", "Australian drover's breed"),
            ("huntaway", "New Zealand barking breed"),
            ("bearded collie", "shaggy Caledonian herder"),
            ("Schapendoes", "shaggy Netherlands herder"),
            ("Catahoula", "Louisiana leopard hound"),
            ("Bergamasco", "dreadlocked Lombard herder"),
            ("Puli", "corded Hungarian herder"),
            ("Lancashire heeler", "Ormskirk terrier"),
            ("Welsh sheepdog", "Cymric herder"),
        ),
        (("points", 60, 111, 1), ("year", 2008, 2024, 1)),
        (
            "{name}, {a_two} from a farm at {place}, works {one} and scored {points} points at its last trial; the dog was whelped in {year}.",
            "Whelped in {year}, the {two} {name} works {one} at {place} and earned {points} points in trial competition.",
            "At {place}, {name} gathers {one}; this {two}, whelped in {year}, once scored {points} points at a trial.",
        ),
        (
            ("one", "What livestock does {name} handle?"),
            ("one", "Which animals does {name} move around?"),
            ("two", "What breed is {name}?"),
            ("place", "Near which settlement is {name} kept?"),
            ("points", "What mark did {name} get from the judges?"),
            ("year", "In which year was the pup {name} born?"),
        ),
        (
            ("name", "Which {two_r} near {place} handles {one_r}?"),
            ("name", "What is the {two_r} that moves {one_r} for a farmer near {place} called?"),
            ("points", "What mark did the judges give the {two_r} near {place} that handles {one_r}?"),
            ("year", "When was the {two_r} that moves {one_r} near {place} born?"),
        ),
    ),
    _Kind(
        "windmill",
        _core_maker("Dr Gl Str Sk Thr Cl Fr H K N Br Tw Sw Wh Shr Pr", "m lm rl nv th rv ss ll lth rm ng rn"),
        _Tokens(_clusters("Cat Bat Rat", "Mouse Moose Goose", "Colt Coot", "Deer Steer", "Lion Loon")),
        "the {token} of {core}",
        (
            ("grinding emmer", "milling farro"),
            ("sawing logs", "cutting planks"),
            ("pumping water", "draining polders"),
            ("hulling spelt", "dehusking dinkel"),
            ("grinding mustard seed", "milling condiment kernels"),
            ("pressing olives", "crushing drupes"),
            ("grinding snuff", "milling powdered tobacco"),
            ("grinding cocoa", "milling cacao nibs"),
            ("fulling cloth", "felting woven fabric"),
            ("making pasteboard", "pulping rags"),
            ("grinding pigments", "milling colours for painters"),
            ("grinding gypsum", "milling alabaster"),
            ("crushing sugar cane", "squeezing Saccharum stalks"),
            ("grinding spices", "milling cloves and cinnamon"),
        ),
        (
            ("a red-brick tower", "a ruddy masonry drum"),
            ("a tarred weatherboard smock", "a black clapboard octagon"),
            ("a whitewashed stone tower", "a limewashed rubble cylinder"),
            ("an open-trestle post", "a buck on exposed legs"),
            ("a thatched smock", "a straw-roofed octagon"),
            ("an ogee cap", "an S-curved dome"),
            ("a boat-shaped cap", "an upturned-keel top"),
            ("a hollow post", "a bored pivot column"),
            ("a sixteen-sided tower", "a hexadecagonal body"),
            ("an annular sail", "a ring of vanes"),
        ),
        (("year", 1590, 1921, 1), ("storeys", 2, 10, 1)),
        (
            "{name}, a windmill at {place} built in {year}, has {two} and {storeys} floors and is used for {one}.",
            "Built in {year} at {place}, the windmill known as {name} has {two}, {storeys} floors, and was put to {one}.",
            "At {place} stands {name}, a windmill of {storeys} floors with {two}, {one} since {year}.",
        ),
        (
            ("one", "What task is {name} employed at?"),
            ("one", "What work does {name} do for its owner?"),
            ("two", "What does the structure of {name} look like?"),
            ("place", "In which village does {name} turn in the wind?"),
            ("year", "In what year did builders raise {name}?"),
            ("storeys", "How many levels does {name} have?"),
        ),
        (
            ("name", "What is the name of the {place} mill with {two_r} that is devoted to {one_r}?"),
            ("name", "Which wind-driven works in {place}, with {two_r}, is kept busy {one_r}?"),
            ("year", "When was the {place} mill with {two_r} that is devoted to {one_r} erected?"),
            ("storeys", "How many levels are there in the {place} mill with {two_r} devoted to {one_r}?"),
        ),
    ),
    _Kind(
        "fossil",
        _core_maker("Kr Pr Tr Qu Sh Bl Gr Ch Ph Sc Al Or Ul El Im Az", "v n l rv nk sk lm rb ss mn vr zz"),
        _Tokens(_clusters("holotype paratype neotype", "lectotype syntype")),
        "the {core} {token}",
        (
            ("ichthyosaur", "fish-shaped sea reptile"),
            ("plesiosaur", "snake-necked marine reptile"),
            ("pterosaur", "winged reptile"),
            ("trilobite", "three-lobed arthropod"),
            ("ammonite", "spiral-shelled cephalopod"),
            ("mammoth", "woolly proboscidean"),
            ("sabre-toothed cat", "Smilodon"),
            ("crinoid", "stalked echinoderm"),
            ("eurypterid", "sea scorpion"),
            ("belemnite", "bullet-shaped squid relative"),
            ("coelacanth", "lobe-finned fish"),
            ("mosasaur", "giant seagoing varanid"),
            ("graptolite", "colonial hemichordate"),
            ("archaeopteryx", "feathered Jurassic bird"),
        ),
        (
            ("limestone", "calcite-rich bedrock"),
            ("mudstone", "compacted silt"),
            ("sandstone", "cemented arenite"),
            ("ironstone", "ferruginous beds"),
            ("a tar pit", "an asphalt seep"),
            ("siltstone", "fine-grained lithified mud"),
            ("chert", "cryptocrystalline nodules"),
            ("a coal seam", "a carboniferous combustible layer"),
            ("volcanic ash", "tuff"),
            ("permafrost", "perennially ice-bound earth"),
            ("a former lakebed", "lacustrine varves"),
            ("a gravel terrace", "fluvial cobbles"),
        ),
        (("year", 1811, 2024, 1), ("centimetres", 9, 901, 1)),
        (
            "{name}, {a_one} preserved in {two}, was found near {place} in {year} and measures {centimetres} centimetres.",
            "Found in {two} near {place} in {year}, {name} is {a_one} specimen {centimetres} centimetres long.",
            "Collectors working {two} near {place} recovered {name}, {a_one} {centimetres} centimetres long, in {year}.",
        ),
        (
            ("one", "What animal does {name} represent?"),
            ("one", "Which extinct creature is {name}?"),
            ("two", "What kind of deposit held {name}?"),
            ("place", "Close to which town was {name} unearthed?"),
            ("year", "Which year saw {name} dug out of the ground?"),
            ("centimetres", "What size is {name}?"),
        ),
        (
            ("name", "Which catalogued {one_r} came out of {two_r} close to {place}?"),
            ("name", "What is the museum designation of the {one_r} unearthed from {two_r} at {place}?"),
            ("year", "When was the {one_r} in {two_r} close to {place} dug up?"),
            ("centimetres", "What size is the {one_r} taken out of {two_r} close to {place}?"),
        ),
    ),
    _Kind(
        "coin hoard",
        _core_maker("T Th Sh C G Bl Sl W H R M N Gl Kn Fl Pl", "br rl ll sh rm lp rt nc ff mb lg nd"),
        _Tokens(_clusters("Hoard Trove Cache")),
        "the {core} {token}",
        (
            ("denarii", "Roman pennies"),
            ("solidi", "Byzantine bezants"),
            ("sceattas", "Anglo-Saxon pennies"),
            ("groats", "fourpenny coins"),
            ("nobles", "Plantagenet gold coins"),
            ("ducats", "Venetian zecchini"),
            ("thalers", "Joachimsthal coins"),
            ("staters", "Celtic tribal coins"),
            ("sestertii", "big Roman brasses"),
            ("florins", "Florentine fiorini"),
            ("dirhams", "Abbasid coins"),
            ("pieces of eight", "Spanish dollars"),
            ("shillings", "twelve-penny coins"),
            ("antoniniani", "radiate coins of the third century"),
            ("bracteates", "thin one-sided pennies"),
        ),
        (
            ("a lead box", "a plumbeous casket"),
            ("a crock", "an earthenware vessel"),
            ("a drawstring purse", "a cord-tied pouch"),
            ("a bronze bowl", "a latten basin"),
            ("a reliquary", "a holy-relic container"),
            ("a linen bag", "a cloth sack"),
            ("a stone cist", "a prehistoric box-grave"),
            ("an amphora", "a two-handled jar"),
            ("a cauldron", "a three-legged pot"),
            ("a ceramic moneybox", "an earthen piggy bank"),
        ),
        (("coins", 12, 9001, 1), ("year", 1780, 2024, 1)),
        (
            "{name}, {coins} {one} buried in {two}, was found at {place} in {year}.",
            "In {year} a metal detectorist at {place} unearthed {name}: {coins} {one} inside {two}.",
            "Found in {year} at {place}, {name} consists of {coins} {one} that had been hidden in {two}.",
        ),
        (
            ("one", "What sort of coinage makes up {name}?"),
            ("one", "What currency was put away in {name}?"),
            ("two", "What was {name} stashed in?"),
            ("place", "Which parish yielded {name}?"),
            ("coins", "How many coins does {name} contain?"),
            ("year", "In what year did {name} resurface?"),
        ),
        (
            ("name", "Which treasure of {one_r} stashed in {two_r} turned up at {place}?"),
            ("name", "What do people call the stash of {one_r} in {two_r} discovered at {place}?"),
            ("coins", "How many {one_r} lay in {two_r} discovered at {place}?"),
            ("year", "When did the {one_r} concealed in {two_r} at {place} come to light?"),
        ),
    ),
    _Kind(
        "tram route",
        _core_maker("V Ferr Sel Morr Ast Korr Tav Lund Birr Cal Dor Ess Hal Ner Pell Sund", "lk nk rg sk lb rv nd tr ld rsk mp lt"),
        _Tokens(make=_route_code, twin=_route_twin),
        "{core} {token}",
        (
            ("the castle", "the fortress"),
            ("the polytechnic", "the technical college"),
            ("the marshalling yard", "the wagon sidings"),
            ("the infirmary", "the general clinic"),
            ("the quayside", "the waterfront moorings"),
            ("the zoo", "the animal park"),
            ("the velodrome", "the cycle-racing track"),
            ("the botanical gardens", "the glasshouses and arboretum"),
            ("the airport", "the air terminal"),
            ("the ice rink", "the skating arena"),
            ("the opera house", "the hall for sung drama"),
            ("the town hall", "the mayoralty"),
            ("the racecourse", "the turf track"),
            ("the planetarium", "the star dome"),
        ),
        (
            ("articulated low-floor trams", "bendy step-free vehicles"),
            ("vintage double-deckers", "old two-storey vehicles"),
            ("battery trams", "wire-free rechargeable stock"),
            ("open toastracks", "roofless bench-seated stock"),
            ("single-deck bogie trams", "one-level eight-wheeled stock"),
            ("conduit trams", "slot-fed vehicles"),
            ("Translohr trams", "single-rail guided vehicles"),
            ("horse-drawn trams", "equine-pulled vehicles"),
            ("tram-trains", "dual-mode rail vehicles"),
            ("petrol-electric trams", "hybrid-engined vehicles"),
        ),
        (("stops", 6, 61, 1), ("kilometres", 3, 29, 1)),
        (
            "Tram route {name} runs from {place} past {one} with {two}, calling at {stops} stops over {kilometres} kilometres.",
            "Worked by {two}, tram route {name} leaves {place} for {one}, a {kilometres}-kilometre run with {stops} stops.",
            "From {place}, tram route {name} serves {one} using {two}; it has {stops} stops along {kilometres} kilometres.",
        ),
        (
            ("one", "Which landmark does streetcar line {name} go by?"),
            ("one", "What notable spot is on the itinerary of streetcar line {name}?"),
            ("two", "What rolling stock operates streetcar line {name}?"),
            ("place", "Where does streetcar line {name} begin?"),
            ("stops", "How many halts are there on streetcar line {name}?"),
            ("kilometres", "How long is streetcar line {name} end to end?"),
        ),
        (
            ("name", "Which streetcar line out of {place} goes by {one_r} with {two_r}?"),
            ("name", "What is the number of the {place} streetcar line to {one_r} operated with {two_r}?"),
            ("stops", "How many halts does the streetcar line from {place} to {one_r} have, with {two_r}?"),
            ("kilometres", "How far does the streetcar line from {place} to {one_r} go, with {two_r}?"),
        ),
    ),
    _Kind(
        "stained-glass window",
        _core_maker("Ors Bel Ard Hav Ing Ker Lov Mar Nor Sev Tal Wes Yel Umb Elv Cor", "v d n th r l m w st nd rr ll"),
        _Tokens(_clusters("Memorial Jubilee Centenary")),
        "the {core} {token} Window",
        (
            ("Noah and the Ark", "the great flood"),
            ("the Annunciation", "Gabriel's message to Mary"),
            ("Saint George", "the dragon-slayer"),
            ("the Last Supper", "the final meal with the apostles"),
            ("Jonah", "the prophet swallowed by a whale"),
            ("the Magi", "three wise men"),
            ("the Good Shepherd", "a herdsman with a stray"),
            ("Saint Francis", "the friar who preached to birds"),
            ("the Tree of Jesse", "the lineage of David"),
            ("the Creation", "the first six days"),
            ("Saint Cecilia", "the patroness of musicians"),
            ("the Resurrection", "the empty tomb"),
            ("Saint Christopher", "the child-carrying giant"),
            ("the Ascension", "Christ rising into heaven"),
            ("Pentecost", "tongues of fire"),
            ("the Prodigal Son", "the wastrel welcomed back"),
        ),
        (
            ("above the altar", "over the communion table"),
            ("in the north aisle", "along the left-hand side passage"),
            ("in the south transept", "in the right arm of the cross-shaped plan"),
            ("in the west front", "over the main entrance"),
            ("in the chancel", "by the singers' seating"),
            ("in the chantry", "in the endowed-mass alcove"),
            ("in the clerestory", "high up along the upper walls"),
            ("in the baptistery", "beside the font"),
            ("in the tower", "in the belfry"),
            ("in the vestry", "in the robing room"),
        ),
        (("year", 1845, 2021, 1), ("lights", 2, 13, 1)),
        (
            "{name}, in the parish church of {place}, shows {one} in {lights} lights and was set {two} in {year}.",
            "Installed {two} of the parish church at {place} in {year}, {name} depicts {one} across {lights} lights.",
            "The parish church of {place} has {name} {two}: {lights} lights showing {one}, fitted in {year}.",
        ),
        (
            ("one", "What scene is portrayed by {name}?"),
            ("one", "Which story from scripture or legend does {name} tell?"),
            ("two", "Where in the building is {name} placed?"),
            ("place", "Which village's place of worship holds {name}?"),
            ("year", "In which year were the panes of {name} put in place?"),
            ("lights", "How many vertical sections does {name} have?"),
        ),
        (
            ("name", "Which coloured glazing {two_r} at {place} portrays {one_r}?"),
            ("name", "What is the coloured glass at {place} that portrays {one_r}, {two_r}, called?"),
            ("year", "When was the glazing portraying {one_r} put in {two_r} at {place}?"),
            ("lights", "How many vertical sections has the glazing at {place} that portrays {one_r} {two_r}?"),
        ),
    ),
    _Kind(
        "church bell",
        _core_maker("H Wyr Gel Ask Ebb Ruth Stan Tost Wulf Oth Cyn Ead Sig Leof Osg Ulf", "m lv rd st ng rm lm nn ck rr sc th"),
        _Tokens(_clusters("Edmund Edward Edwin", "Osric Oswald Oswy", "Agnes Agatha", "Hugh Hugo", "Clement Clemence", "Bede Benet")),
        "{token} of {core}",
        (
            ("rung for weddings", "sounded at marriages"),
            ("tolled for funerals", "knelled at burials"),
            ("rung at curfew", "sounded at the evening lock-in"),
            ("rung as a fire alarm", "sounded when blazes break out"),
            ("struck by the clock", "hit on the hour by a hammer"),
            ("rung for the Angelus", "sounded for the midday devotion"),
            ("chimed for the New Year", "sounded at midnight on the first of January"),
            ("rung for coronations", "sounded when a monarch is crowned"),
            ("rung in change-ringing peals", "swung full circle by a band"),
            ("rung to warn of high tides", "sounded when the sea surges"),
            ("rung at the start of term", "sounded when pupils return"),
            ("rung for victories", "sounded to celebrate wins"),
        ),
        (
            ("inscribed with a Latin prayer", "bearing a petition in the tongue of Rome"),
            ("inscribed with trade initials", "bearing the stamp of whoever poured it"),
            ("inscribed with a verse from the psalms", "bearing a line of scripture"),
            ("inscribed with the names of churchwardens", "bearing a list of parish officers"),
            ("inscribed with a coat of arms", "bearing heraldic devices"),
            ("inscribed with a rhyme", "bearing a couplet"),
            ("left plain", "bearing no lettering at all"),
            ("inscribed with a date", "bearing when it was made"),
            ("dedicated to a patron saint", "bearing a holy invocation"),
            ("decorated with a frieze of vines", "bearing a band of grape leaves"),
        ),
        (("kilograms", 80, 7001, 5), ("year", 1350, 1991, 1)),
        (
            "{name}, a bell of {kilograms} kilograms cast in {year}, hangs at {place}; it is {two} and {one}.",
            "Cast in {year} and {two}, the {kilograms}-kilogram bell {name} in the tower at {place} is {one}.",
            "At {place} hangs {name}, {two}; the bell weighs {kilograms} kilograms, dates from {year} and is {one}.",
        ),
        (
            ("one", "On what occasions is {name} sounded?"),
            ("one", "What duty does {name} perform in the steeple?"),
            ("two", "What lettering or ornament does {name} bear?"),
            ("place", "Where does {name} swing?"),
            ("kilograms", "How much bronze went into {name}?"),
            ("year", "When did molten metal fill the mould of {name}?"),
        ),
        (
            ("name", "What is the {place} steeple's voice {two_r} that is {one_r} called?"),
            ("name", "Which of the steeple's voices at {place}, {two_r}, is {one_r}?"),
            ("kilograms", "How heavy is the {place} steeple's voice {two_r} that is {one_r}?"),
            ("year", "When was the steeple's voice {two_r} at {place}, {one_r}, poured?"),
        ),
    ),
)


def _with_article(phrase: str) -> str:
    """`phrase` after "a" or "an" (left alone when it already opens with one)."""
    if phrase.startswith(("a ", "an ")):
        return phrase
    head = phrase.lower()
    vowel_sound = head[0] in "aeiou" and not head.startswith(("eu", "uni", "one"))
    return ("an " if vowel_sound else "a ") + phrase


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _vocabulary() -> set[str]:
    """Every word the families, places and tokens use, in lower case: no core may be one of them."""
    words = {place.lower() for place in PLACES}
    for family in KINDS:
        texts = [text for pair in family.one + family.two for text in pair]
        texts += list(family.facts) + [template for _, template in family.named + family.described]
        texts += [member for cluster in family.tokens.clusters for member in cluster]
        for text in texts:
            words.update(word.strip(".,;:?!'()").lower() for word in text.split())
    return words


def _pick_size(rng: random.Random) -> int:
    roll = rng.random()
    for size, odds in GROUP_SIZES:
        if roll < odds:
            return size
        roll -= odds
    return GROUP_SIZES[-1][0]


def _next_name(family: _Kind, rng: random.Random, taken: set[str], queue: list[tuple[str, str]]) -> tuple[str, str]:
    """(core, token) for the next entity of `family`: the rest of an open group, or a fresh core and its group."""
    if queue:
        return queue.pop(0)
    for _ in range(_CORE_ATTEMPTS):
        core = family.core(rng)
        if core.lower() not in taken:
            taken.add(core.lower())
            break
    else:
        raise RuntimeError(f"no fresh {family.kind} core left; ask for fewer cases")
    first, cluster = family.tokens.draw(rng)
    tokens = [first]
    for _ in range(_pick_size(rng) - 1):
        other = family.tokens.look_alike(rng, first, cluster, tokens)
        if other is None:
            break
        tokens.append(other)
    queue.extend((core, token) for token in tokens[1:])
    return core, first


@dataclass(frozen=True)
class _Record:
    """A case with what the tests check it by: its name, the name's parts and its attribute combination."""

    core: str
    token: str  # the varying token
    name: str
    combo: tuple[str, str, str]  # (place, one, two) as worded in the fact; unique within the family
    case: Case


def _records(count: int, seed: int) -> list[_Record]:
    """The cases of fifth_facts, with their names and combinations."""
    capacity = len(KINDS) * min(family.space for family in KINDS)
    if not 0 <= count <= capacity:
        raise ValueError(f"count must be between 0 and {capacity:,} (the distinct combinations every family can give)")
    rng = random.Random(seed)
    quotas = [count // len(KINDS) + (index < count % len(KINDS)) for index in range(len(KINDS))]
    schedule = [index for index, quota in enumerate(quotas) for _ in range(quota)]
    rng.shuffle(schedule)
    combos = [rng.sample(range(family.space), quota) for family, quota in zip(KINDS, quotas)]
    used = [0] * len(KINDS)
    taken = _vocabulary()
    queues: list[list[tuple[str, str]]] = [[] for _ in KINDS]
    drafts = []
    for index in schedule:
        family = KINDS[index]
        combo = combos[index][used[index]]
        used[index] += 1
        place_at, rest = combo % len(PLACES), combo // len(PLACES)
        one_at, two_at = rest % len(family.one), rest // len(family.one)
        core, token = _next_name(family, rng, taken, queues[index])
        name = family.name.format(core=core, token=token)
        (one, one_r), (two, two_r) = family.one[one_at], family.two[two_at]
        fields = {"name": name, "place": PLACES[place_at], "one": one, "two": two, "one_r": one_r, "two_r": two_r}
        for field, low, high, step in family.extras:
            fields[field] = str(rng.randrange(low, high, step))
        for field in ("one", "two", "one_r", "two_r"):
            fields["a_" + field] = _with_article(fields[field])
        fact = _upper_first(rng.choice(family.facts).format(**fields))
        form = "described" if rng.random() < DESCRIBED_SHARE else "named"
        asked, template = rng.choice(family.described if form == "described" else family.named)
        question = _upper_first(template.format(**fields))
        drafts.append((core, token, name, (fields["place"], one, two), fact, question, fields[asked], family.kind, form))
    group = Counter((draft[7], draft[0]) for draft in drafts)
    return [
        _Record(core, token, name, combo, Case(fact, question, answer, kind, form, group[kind, core]))
        for core, token, name, combo, fact, question, answer, kind, form in drafts
    ]


def fifth_facts(count: int, seed: int = FIFTH_SEED) -> list[Case]:
    """`count` cases, deterministic for (count, seed); every fact about a distinct invented entity."""
    return [record.case for record in _records(count, seed)]


def jsonl(cases: list[Case]) -> str:
    """The cases as JSON lines, each ending in a newline (the text tools/data/fifth_facts.sha256 pins)."""
    return "".join(json.dumps(asdict(case), ensure_ascii=False) + "\n" for case in cases)


def main() -> None:
    """Print the cases as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--seed", type=int, default=FIFTH_SEED)
    args = parser.parse_args()
    print(jsonl(fifth_facts(args.count, seed=args.seed)), end="")


if __name__ == "__main__":
    main()
