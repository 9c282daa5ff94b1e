"""The one answering path: a model, a store and an LRU of ready packs; refs or a bank -> pack -> tokens.

The Python API, ``packctl ask`` and the worker all answer through ``Answerer``, so resolving refs,
identity checks, lazy recompute of a bank's facts, the ready-cache and the comparison with the
facts as prompt text exist once. The store is any ``PackStore`` (local or remote): only its
protocol methods are used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from packstore.errors import InvalidInput, PackNotFound
from packstore.format import pack_key
from packstore.tensors import Pack, encode_pack
from packstore.kv.build import build_pack, clean_facts
from packstore.kv.inject import Sampling, answer_with_text, cache_from_pack, check_identity, generate_stream, prepare
from packstore.kv.models import LoadedModel
from packstore.kv.render import pack_prefix_ids
from packstore.records import AnswerResult
from packstore.store.protocol import DEFAULT_TOP_K, PackStore

DEFAULT_CACHE_BYTES = 2 << 30


class ReadyCache:
    """An LRU of ready packs (tensors already on the device), bounded by their decoded KV bytes.

    A single pack larger than the limit is returned but not kept. ``get`` loads a missing pack
    with ``load(key)``; concurrent misses on one key may load it twice, which is harmless.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._packs: OrderedDict[str, Pack] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str, load: Callable[[str], Pack]) -> tuple[Pack, bool]:
        """The pack for ``key`` and whether it was already cached."""
        with self._lock:
            if key in self._packs:
                self._packs.move_to_end(key)
                return self._packs[key], True
        pack = load(key)
        size = pack.header.raw_bytes
        with self._lock:
            if size <= self.limit_bytes and key not in self._packs:
                self._packs[key] = pack
                self._bytes += size
                while self._bytes > self.limit_bytes:
                    _, evicted = self._packs.popitem(last=False)
                    self._bytes -= evicted.header.raw_bytes
        return pack, False

    @property
    def stats(self) -> tuple[int, int]:
        """(packs cached, bytes cached)."""
        with self._lock:
            return len(self._packs), self._bytes


@dataclass(frozen=True)
class Question:
    """A question and what to answer it with: pack refs (key, name or content-hash prefix), or a bank.

    With a bank the question is routed there (``top_k``, ``probe``, ``embedder``: None means the
    bank's own) and answered with the pack of its top facts. ``compare_rag`` also answers with the same facts as prompt text.
    """

    text: str
    refs: tuple[str, ...] = ()
    bank: str | None = None
    top_k: int = DEFAULT_TOP_K
    probe: int | None = None
    embedder: str | None = None
    compare_rag: bool = False
    sampling: Sampling = Sampling()

    def __post_init__(self) -> None:
        object.__setattr__(self, "refs", tuple(self.refs))
        object.__setattr__(self, "bank", self.bank or None)
        if self.bank and self.refs:
            raise InvalidInput("give either packs or a bank, not both")
        if not self.bank and not self.refs:
            raise InvalidInput("nothing to answer with: give a pack or a bank")


class Answerer:
    """Answers questions on one model with packs from one store, keeping ready packs in an LRU.

    Safe to share between threads: lookups and fetches run concurrently, while device work
    (building a bank's facts pack, generating) runs one request at a time.
    """

    def __init__(self, lm: LoadedModel, store: PackStore, *, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.lm = lm
        self.store = store
        self.ready = ReadyCache(cache_bytes)
        self._device_lock = threading.Lock()

    def resolve(self, ref: str) -> str:
        """The key ``ref`` names: this model's packs first, then any model's (so a refusal can name the model)."""
        try:
            return self.store.resolve(ref, model_fp=self.lm.model_fp)
        except PackNotFound:
            return self.store.resolve(ref)

    def pack(self, ref: str) -> tuple[Pack, bool]:
        """The ready pack ``ref`` names, and whether it was already ready.

        A pack of another kind, model or template is refused with PackMismatch before it is fetched.
        """
        return self.ready.get(self.resolve(ref), self._fetch)

    def _fetch(self, key: str) -> Pack:
        check_identity(self.lm, self.store.stat(key).header)
        return self.store.fetch(key, device=self.lm.device, model_fp=self.lm.model_fp, template_fp=self.lm.template_fp)

    def facts_pack(self, facts: Sequence[str]) -> tuple[Pack, bool, bool]:
        """The ready pack of exactly ``facts`` (in order), whether it was already stored, and whether already ready.

        Looked up by content key; a pack not stored yet is built and written back (lazy recompute).
        """
        facts = clean_facts(facts)
        stored = True

        def load(key: str) -> Pack:
            nonlocal stored
            try:
                return self.store.fetch(key, device=self.lm.device, model_fp=self.lm.model_fp, template_fp=self.lm.template_fp)
            except PackNotFound:
                with self._device_lock:
                    pack = build_pack(self.lm, facts)
                self.store.put(encode_pack(pack))
                stored = False
                device = self.lm.device
                return Pack(header=pack.header, keys=[k.to(device) for k in pack.keys], values=[v.to(device) for v in pack.values])

        key = pack_key(self.lm.model_fp, self.lm.template_fp, pack_prefix_ids(self.lm.tokenizer, facts))
        pack, hit = self.ready.get(key, load)
        return pack, stored, hit

    def route(
        self, bank: str, question: str, *, top_k: int = DEFAULT_TOP_K, probe: int | None = None, embedder: str | None = None
    ) -> list[str]:
        """The facts ``bank`` routes ``question`` to, best first; InvalidInput when there are none."""
        routed = self.store.banks().route(bank, [question], embedder, top_k=top_k, probe=probe)[0]
        facts = [text for text, _ in routed.facts]
        if not facts:
            raise InvalidInput(f"bank {bank!r} routed the question to no facts")
        return facts

    def stream(self, question: Question) -> Generator[int, None, AnswerResult]:
        """Answer ``question``, yielding each generated token id as it exists (stop tokens excluded).

        The generator's return value is the AnswerResult. With ``compare_rag`` the same facts, in
        the same order, are then answered as prompt text; ``identical`` compares the generated
        token ids, not just the text.
        """
        facts: list[str] | None = None
        reused: bool | None = None
        if question.bank:
            facts = self.route(question.bank, question.text, top_k=question.top_k, probe=question.probe, embedder=question.embedder)
            pack, reused, hit = self.facts_pack(facts)
        else:
            if len(question.refs) > 1:
                raise InvalidInput(
                    f"answering with {len(question.refs)} packs needs their composition, which is not available yet: "
                    "give exactly one pack"
                )
            pack, hit = self.pack(question.refs[0])
        rendering = prepare(self.lm, pack.header, question.text)
        with self._device_lock:
            cache = cache_from_pack(pack, self.lm.device)
            answer = yield from generate_stream(self.lm, rendering.token_ids, question.sampling, cache)
            rag = (
                answer_with_text(self.lm, pack.header.facts, question.text, raw=pack.header.raw, sampling=question.sampling)
                if question.compare_rag
                else None
            )
        return AnswerResult(
            question=question.text,
            answer=answer.text,
            kv_prompt_tokens=answer.prompt_tokens,
            rag_answer=rag.text if rag is not None else None,
            rag_prompt_tokens=rag.prompt_tokens if rag is not None else None,
            identical=answer.token_ids == rag.token_ids if rag is not None else None,
            pack=pack.header.key,
            bank=question.bank,
            facts=facts,
            pack_reused=reused,
            cache_hit=hit,
        )

    def ask(self, question: Question) -> AnswerResult:
        """Answer ``question`` (``stream`` without the tokens)."""
        tokens = self.stream(question)
        while True:
            try:
                next(tokens)
            except StopIteration as finished:
                return finished.value
