"""The Python API that packctl's model-side commands shell over: build, compose, amend and store knowledge
packs, and build steering packs and adapters.

Answering with packs is ``packstore.answering.answer.Answerer``; what needs no model (pack records, pack
files) is ``packstore.answering.stored``, and signing is ``packstore.security.signing``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from packstore.answering.answer import Answerer
from packstore.errors import InvalidInput, PackNotFound
from packstore.format import pack_key
from packstore.packs.tensors import Pack, encode_pack
from packstore.kv.build import build_pack
from packstore.kv.compose import COMPOSE_MODES, Composition, amend, check_erratum, compose_exact, splice
from packstore.kv.models import LoadedModel
from packstore.kv.render import ERRATUM_PREFIX, pack_prefix_ids
from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS
from packstore.kv.packet import generated_examples, packet_compose, train_adapter
from packstore.kv.steer import applied_layers, build_span, build_steering, check_pairs, delta_norms, steering_key
from packstore.kv.records import Example, Pair
from packstore.store import PackStore, StoredPack


DEFAULT_EXAMPLES = 96
GENERATED_SOURCE = "packstore.bank.synthetic facts, 2-4 documents of 2-5 facts per example"


def steering_details(store: PackStore, stored: StoredPack) -> dict[str, Any]:
    """What ``inspect`` adds for a steering pack: pair count, pooling, the layers held and applied by
    default, and per-layer delta norms (read from its tensors: a steering pack is a few KB)."""
    h = stored.header
    first, last = h.recipe["layers"]
    return {
        "pairs": len(h.recipe["pairs"]),
        "pooling": h.recipe["pooling"],
        "steer_layers": [first, last],
        "default_layers": list(applied_layers(h, None)),
        "norms": delta_norms(store.fetch(h.key)),
        "recipe": h.recipe,
    }


def store_pack(store: PackStore, pack: Pack, *, name: str | None = None) -> tuple[StoredPack, bool]:
    """Encode and store a pack; returns its stored record and whether it was new."""
    key, created = store.put(encode_pack(pack), name=name)
    return store.stat(key), created


def build_and_store(
    store: PackStore,
    lm: LoadedModel,
    facts: Sequence[str],
    *,
    name: str | None = None,
    raw: bool = False,
    progress: bool = False,
) -> tuple[StoredPack, bool]:
    """Build the pack for ``facts`` on ``lm`` and store it (idempotent: same facts, same key)."""
    return store_pack(store, build_pack(lm, facts, raw=raw, progress=progress), name=name)


def _stored_or_none(store: PackStore, key: str, name: str | None) -> tuple[StoredPack, bool, None] | None:
    """The already stored pack ``key`` (named ``name`` if given), or None: composing it again stores nothing."""
    try:
        stored = store.stat(key)
    except PackNotFound:
        return None
    if name:
        store.set_name(key, name)
        stored = store.stat(key)
    return stored, False, None


def compose_and_store(
    store: PackStore,
    lm: LoadedModel,
    refs: Sequence[str],
    *,
    mode: str = "exact",
    name: str | None = None,
    adapter: str | None = None,
) -> tuple[StoredPack, bool, Composition | None]:
    """Compose the packs ``refs`` names, in order, and store the result.

    ``exact`` prefills the later parts after the first (token-identical to all facts as prompt
    text); ``rope`` and ``naive`` splice independently built parts without prefilling them, and
    ``packet`` splices them wrapped in the soft tokens of ``adapter`` (approximate; docs/format.md
    §4.2, §4.4). Returns the stored pack, whether it is new, and the Composition (None when the
    same composition was already stored, so nothing was computed).
    """
    if mode not in COMPOSE_MODES:
        raise InvalidInput(f"unknown composition mode {mode!r}: use one of {', '.join(COMPOSE_MODES)}")
    if (mode == "packet") != bool(adapter):
        raise InvalidInput("a packet composition needs an adapter, and an adapter needs the packet mode")
    if len(refs) < 2:
        raise InvalidInput(f"compose needs at least 2 packs, got {len(refs)}")
    answerer = Answerer(lm, store)
    keys, headers = answerer.parts(refs)
    adapter_pack = answerer.adapter_pack(adapter) if adapter else None
    parents: list[str] = [] if mode == "exact" else list(keys)  # an exact composition's key is its tokens' alone
    if adapter_pack is not None:
        parents.append(adapter_pack.header.key)
    token_ids = pack_prefix_ids(lm.tokenizer, [fact for header in headers for fact in header.facts], raw=headers[0].raw)
    existing = _stored_or_none(store, pack_key(lm.model_fp, lm.template_fp, token_ids, mode, parents), name)
    if existing is not None:
        return existing
    if mode == "exact":
        composition = compose_exact(lm, answerer.pack(keys[0])[0], headers[1:])
    elif adapter_pack is not None:
        composition = packet_compose(lm, [answerer.pack(key)[0] for key in keys], adapter_pack)
    else:
        composition = splice(lm, [answerer.pack(key)[0] for key in keys], mode)
    stored, created = store_pack(store, composition.pack, name=name)
    return stored, created, composition


def amend_and_store(
    store: PackStore, lm: LoadedModel, ref: str, erratum: str, *, name: str | None = None
) -> tuple[StoredPack, bool, Composition | None]:
    """Append ``erratum`` to pack ``ref`` as a new pack (the old one stays as it is), prefilling only
    the erratum's line; returns as ``compose_and_store`` does."""
    answerer = Answerer(lm, store)
    [key], [header] = answerer.parts([ref])
    facts = [*header.facts, ERRATUM_PREFIX + check_erratum(erratum)]
    token_ids = pack_prefix_ids(lm.tokenizer, facts, raw=header.raw)
    existing = _stored_or_none(store, pack_key(lm.model_fp, lm.template_fp, token_ids), name)
    if existing is not None:
        return existing
    composition = amend(lm, answerer.pack(key)[0], erratum)
    stored, created = store_pack(store, composition.pack, name=name)
    return stored, created, composition


def build_steering_and_store(
    store: PackStore,
    lm: LoadedModel,
    pairs: Sequence[Pair],
    *,
    name: str | None = None,
    layers: tuple[int, int] | None = None,
    pooling: str = "last",
) -> tuple[StoredPack, bool]:
    """Build the steering pack of ``pairs`` on ``lm`` and store it. Its key is known from the pairs,
    pooling and layers alone, so building the same pack again runs no model and stores nothing new."""
    pairs = check_pairs(lm, pairs)
    span = build_span(lm, layers)
    existing = _stored_or_none(store, steering_key(lm, pairs, pooling, span), name)
    if existing is not None:
        return existing[:2]
    return store_pack(store, build_steering(lm, pairs, layers=span, pooling=pooling), name=name)


def train_adapter_and_store(
    store: PackStore,
    lm: LoadedModel,
    *,
    name: str | None = None,
    examples: Sequence[Example] | None = None,
    source: str = "examples given in Python",
    tokens: int = ADAPTER_TOKENS,
    steps: int = ADAPTER_STEPS,
    learning_rate: float = ADAPTER_LEARNING_RATE,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[StoredPack, bool]:
    """Train a KV Packet adapter for ``lm`` on ``examples`` (default: DEFAULT_EXAMPLES from the
    project's fact generator, never ckc) and store it. Retraining gives a new key: the key covers
    the trained tensors."""
    if examples is None:
        examples, source = generated_examples(DEFAULT_EXAMPLES, seed=seed), GENERATED_SOURCE
    adapter = train_adapter(
        lm, examples, source=source, tokens=tokens, steps=steps, learning_rate=learning_rate, seed=seed, progress=progress
    )
    return store_pack(store, adapter, name=name)
