"""The Python API that packctl shells over: build, store, load and ask with knowledge packs."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from packstore.bank.bank import DEFAULT_TOP_K
from packstore.errors import InvalidInput, PackNotFound
from packstore.format import Pack, decode_pack, encode_pack, pack_key
from packstore.format.packfile import pack_file_parts, parse_pack_file
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling, answer_with_pack, answer_with_text, check_identity
from packstore.kv.models import LoadedModel
from packstore.kv.render import pack_prefix_ids
from packstore.store import PackStore, StoredPack, default_store_path


def open_store(spec: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> Any:
    """A local ``PackStore`` for a path, or a ``RemoteStore`` for ``grpc://HOST:PORT``.

    Without ``spec``: ``$PACKSTORE_STORE``, else the per-user data directory.
    """
    from packstore.client import RemoteStore, is_remote

    spec = str(spec or os.environ.get("PACKSTORE_STORE") or default_store_path())
    return RemoteStore(spec) if is_remote(spec) else PackStore(spec, readonly=readonly)


def pack_summary(stored: StoredPack) -> dict[str, Any]:
    """The JSON record of a stored pack shared by ``build``, ``inspect`` and ``ls``."""
    h = stored.header
    return {
        "key": stored.key,
        "name": stored.names[0] if stored.names else None,
        "names": list(stored.names),
        "kind": h.kind,
        "model_fp": h.model_fp,
        "template_fp": h.template_fp,
        "model_name": h.model_name,
        "tokens": h.tokens,
        "dtype": h.dtype,
        "raw": h.raw,
        "raw_bytes": h.raw_bytes,
        "stored_bytes": stored.stored_bytes,
        "facts": len(h.facts),
        "created": h.created,
    }


def pack_details(stored: StoredPack) -> dict[str, Any]:
    """``pack_summary`` plus the full header: shapes, codec, chunks, facts and token ids."""
    h = stored.header
    return pack_summary(stored) | {
        "layers": h.layers,
        "kv_heads": h.kv_heads,
        "head_dim": h.head_dim,
        "codec": h.codec,
        "parents": list(h.parents),
        "chunks": [asdict(c) for c in h.chunks],
        "facts": list(h.facts),
        "token_ids": list(h.token_ids),
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


def export_pack(store: PackStore, ref: str, path: str | os.PathLike[str]) -> tuple[str, int]:
    """Write pack ``ref`` (checksums verified on read) to a single pack file; returns (key, bytes written).

    The file appears only when complete: it is written beside its final name and renamed.
    """
    encoded = store.get(ref)
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as out:
            for part in pack_file_parts(encoded):
                out.write(part)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {target}: {exc.strerror}") from None
    return encoded.header.key, target.stat().st_size


def import_pack(store: PackStore, path: str | os.PathLike[str], *, name: str | None = None) -> tuple[StoredPack, bool]:
    """Read a pack file, verify its seal, every checksum and that every chunk decodes, then store it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror}") from None
    encoded = parse_pack_file(data)
    decode_pack(encoded)
    key, created = store.put(encoded, name=name)
    return store.stat(key), created


def resolve_for_model(store: Any, ref: str, lm: LoadedModel) -> str:
    """The key ``ref`` names for ``lm``: its own packs first, then any model's (so a refusal can name the model)."""
    try:
        return store.resolve(ref, model_fp=lm.model_fp)
    except PackNotFound:
        return store.resolve(ref)


def load_pack(store: Any, ref: str, lm: LoadedModel) -> Pack:
    """Fetch, verify and decode the pack ``ref`` onto ``lm``'s device; a pack of another model or template is refused."""
    key = resolve_for_model(store, ref, lm)
    check_identity(lm, store.stat(key).header)
    return store.fetch(key, device=lm.device, model_fp=lm.model_fp, template_fp=lm.template_fp)


@dataclass(frozen=True)
class AskResult:
    """One question answered with the pack, and optionally with the same facts as prompt text."""

    question: str
    answer: str
    kv_prompt_tokens: int
    rag_answer: str | None = None
    rag_prompt_tokens: int | None = None
    identical: bool | None = None
    pack: str | None = None
    bank: str | None = None
    facts: list[str] | None = None  # with a bank: the routed facts the pack holds, best first
    pack_reused: bool | None = None  # with a bank: the facts' pack was already stored

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ask(
    lm: LoadedModel, pack: Pack, question: str, *, compare_rag: bool = False, sampling: Sampling = Sampling()
) -> AskResult:
    """Answer ``question`` with ``pack`` injected; ``compare_rag`` also answers with the facts in the prompt.

    ``identical`` compares the generated token ids, not just the decoded text.
    """
    answer = answer_with_pack(lm, pack, question, sampling)
    result = AskResult(question=question, answer=answer.text, kv_prompt_tokens=answer.prompt_tokens, pack=pack.header.key)
    if not compare_rag:
        return result
    rag = answer_with_text(lm, pack.header.facts, question, raw=pack.header.raw, sampling=sampling)
    return AskResult(
        question=question,
        answer=answer.text,
        kv_prompt_tokens=answer.prompt_tokens,
        rag_answer=rag.text,
        rag_prompt_tokens=rag.prompt_tokens,
        identical=answer.token_ids == rag.token_ids,
        pack=pack.header.key,
    )


def pack_for_facts(store: Any, lm: LoadedModel, facts: Sequence[str], *, progress: bool = False) -> tuple[Pack, bool]:
    """The pack of exactly ``facts`` (in order) for ``lm``: fetched by content key if stored, else built and written back."""
    key = pack_key(lm.model_fp, lm.template_fp, pack_prefix_ids(lm.tokenizer, list(facts)))
    try:
        return store.fetch(key, device=lm.device, model_fp=lm.model_fp, template_fp=lm.template_fp), True
    except PackNotFound:
        pack = build_pack(lm, facts, progress=progress)
        store_pack(store, pack)
        return pack, False


def banks_of(store: Any) -> Any:
    """Bank operations for a store: ``LocalBanks`` next to an LMDB store, ``RemoteBanks`` over the service."""
    from packstore.bank.bank import LocalBanks
    from packstore.client import RemoteBanks, RemoteStore

    return RemoteBanks(store) if isinstance(store, RemoteStore) else LocalBanks(store)


def ask_bank(
    store: Any,
    lm: LoadedModel,
    embedder: str,
    bank: str,
    question: str,
    *,
    top_k: int = DEFAULT_TOP_K,
    probe: int | None = None,
    compare_rag: bool = False,
    sampling: Sampling = Sampling(),
) -> AskResult:
    """Route ``question`` in ``bank``, get the pack of its top facts (lazily computed, cached in the store), answer.

    With ``compare_rag`` the same facts, in the same order, go into the prompt instead.
    """
    facts = [text for text, _ in banks_of(store).route(bank, [question], embedder, top_k=top_k, probe=probe)[0].facts]
    if not facts:
        raise InvalidInput(f"bank {bank!r} routed the question to no facts")
    pack, reused = pack_for_facts(store, lm, facts)
    result = ask(lm, pack, question, compare_rag=compare_rag, sampling=sampling)
    return AskResult(**{**asdict(result), "bank": bank, "facts": facts, "pack_reused": reused})
