"""The Python API that packctl shells over: build, compose, amend, store, export and import knowledge
packs, and build steering packs.

Answering with packs is ``packstore.answering.answer.Answerer``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from packstore.answering.answer import Answerer
from packstore.answering.building import BuildTimings, build_into
from packstore.answering.composing import check_composition, compose, composition_key
from packstore.bank.bank import open_banks
from packstore.errors import InvalidInput, PackNotFound
from packstore.format import pack_key
from packstore.format.body import ERRATUM_PREFIX
from packstore.format.signature import Signature
from packstore.kv.compose import Composition, amend, check_erratum
from packstore.kv.models import LoadedModel
from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS
from packstore.kv.packet import generated_examples, train_adapter
from packstore.kv.records import Example, Pair
from packstore.kv.render import pack_prefix_ids
from packstore.kv.steer import (
    applied_layers,
    build_span,
    build_steering,
    check_pairs,
    delta_norms,
    framing_of,
    key_space_of,
    steering_key,
)
from packstore.packs.decoder import Decoder
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, encode_pack
from packstore.store import PackStore, StoredPack
from packstore.store.records import VerifyResult

if TYPE_CHECKING:
    from packstore.security.trust import SigningKey, TrustedKeys


DEFAULT_EXAMPLES = 96
GENERATED_SOURCE = "packstore.kv.synthetic facts, 2-4 documents of 2-5 facts per example"


def steering_details(store: PackStore, stored: StoredPack) -> dict[str, Any]:
    """What ``inspect`` adds for a steering pack: pair count, pooling, the layers held and applied by
    default, and per-layer delta norms (read from its tensors: a steering pack is a few KB)."""
    h = stored.header
    recipe = h.recipe
    if recipe is None:
        raise InvalidInput(f"pack {h.key} has no recipe: it is not a steering pack")
    first, last = recipe["layers"]
    return {
        "pairs": len(recipe["pairs"]),
        "pooling": recipe["pooling"],
        "key_space": key_space_of(h),
        "framing": framing_of(h),
        "steer_layers": [first, last],
        "default_layers": list(applied_layers(h, None)),
        "norms": delta_norms(PackReader(store).fetch(h.key)),
        "recipe": recipe,
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
    decoder: Decoder | None = None,
    timings: BuildTimings | None = None,
) -> tuple[StoredPack, bool]:
    """Build the pack for ``facts`` on ``lm`` and store it (idempotent: same facts, same key): its chunks are encoded on
    ``decoder``'s threads (a pool of its own when None) while the prefill runs, and written as they come where the store
    can (the LMDB tier), the same bytes as ``store_pack(store, build_pack(lm, facts))`` (``answering.building``;
    ``timings``, if given, is filled with the seconds of each stage)."""
    key, created = build_into(store, lm, facts, name=name, raw=raw, progress=progress, decoder=decoder, timings=timings)
    return store.stat(key), created


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
    check_composition(mode, adapter, len(refs))
    answerer = Answerer(lm, store)
    keys, headers = answerer.parts(refs)
    adapter_pack = answerer.adapter_pack(adapter) if adapter else None
    parents = keys + ([adapter_pack.header.key] if adapter_pack is not None else [])
    key = composition_key(lm, [fact for header in headers for fact in header.facts], raw=headers[0].raw, mode=mode, parents=parents)
    existing = _stored_or_none(store, key, name)
    if existing is not None:
        return existing
    later = headers[1:] if mode == "exact" else [answerer.pack(part)[0] for part in keys[1:]]  # exact needs the later parts' facts only
    composition = compose(lm, mode, [answerer.pack(keys[0])[0], *later], adapter_pack)
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
    key_space: str = "rotated",
    framing: str = "text",
) -> tuple[StoredPack, bool]:
    """Build the steering pack of ``pairs`` on ``lm`` and store it. Its key is known from the pairs, pooling,
    layers, key space and framing alone, so building the same pack again runs no model and stores nothing new."""
    pairs = check_pairs(lm, pairs)
    span = build_span(lm, layers)
    existing = _stored_or_none(store, steering_key(lm, pairs, pooling, span, key_space, framing), name)
    if existing is not None:
        return existing[:2]
    built = build_steering(lm, pairs, layers=span, pooling=pooling, key_space=key_space, framing=framing)
    return store_pack(store, built, name=name)


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


def sign_bank(store: PackStore, name: str, key: SigningKey) -> Signature:
    """Sign bank ``name``'s current digest (every record of it) with ``key`` and store the signature."""
    banks = open_banks(store)
    signature = key.sign("bank", banks.digest(name))
    banks.sign(name, signature)
    return signature


def verify_banks(store: PackStore, names: Sequence[str], trusted: TrustedKeys) -> list[VerifyResult]:
    """Per bank (default: every bank), None or why no trusted key signed its current contents."""
    banks = open_banks(store)
    names = list(names) or [meta.name for meta, _ in banks.list()]
    results = []
    for name in names:
        problem = trusted.problem("bank", banks.digest(name), banks.signatures(name))
        results.append(VerifyResult(name, f"not trusted: {problem}" if problem else None))
    return results


