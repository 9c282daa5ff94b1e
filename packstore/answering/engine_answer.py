"""Answering through a serving engine: ``packstore worker --engine vllm`` renders each conversation as the local
worker does (the template split, the token check), routes banks with the same code, and sends vLLM the prompt as token
ids with ``kv_transfer_params`` naming what its ``PackstoreConnector`` loads or saves; vLLM generates.

What is sent (``EngineAsk``, made by ``plan_ask``; docs/protocol.md, "The worker as a front for vLLM"):
- one pack: its key, which the connector loads (an approximate pack with its salt);
- a chain (several packs, or packs then a bank's facts) or a bank's facts: ``{"facts": [...]}``, which the connector
  loads whole when the pack of exactly those facts is stored (this engine's build or packstore's); else, where the
  connector saves, the same with ``"save": true`` under a salt of the request's own, so vLLM computes every token and
  the pack is stored in its arithmetic (the seeds' lazy recompute) and loads whole on the next ask; where it does not
  save, a chain of packs names its parts (the deepest agreeing part loads, vLLM prefills the rest).

The answer's ``packstore`` object is made from this plan and vLLM's count of prompt tokens it did not prefill
(``cached_tokens``, which its streams carry too, unlike ``kv_transfer_params``): the same whether streamed or not.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from packstore.answering.answer import Question, RefCache, route_bank
from packstore.answering.arithmetic import cache_salt_for
from packstore.answering.composing import composition_key
from packstore.answering.engine_client import EngineClient, EngineIdentity, Usage
from packstore.answering.records import AnswerResult
from packstore.bank.bank import BankCache
from packstore.errors import InvalidInput, PackNotFound, Unavailable, Untrusted
from packstore.format.header import PackHeader, pack_key
from packstore.kv.build import clean_facts
from packstore.kv.compose import check_parts
from packstore.kv.device import Cancel
from packstore.kv.inject import Sampling, answer_of, finish, prepare
from packstore.kv.models import RenderingModel
from packstore.kv.render import render
from packstore.security.trust import TrustedKeys
from packstore.store.protocol import PackStore

SALT_PREFIX = "packstore-"  # the front's own salts: packstore-save-HEX (a save), packstore-rag-HEX (compare_rag's text)


@dataclass(frozen=True)
class EngineAsk:
    """One request for the engine: the prompt's token ids, the connector's ``kv_transfer_params`` and vLLM's
    ``cache_salt``; and what the answer reports of it: the pack (the key it loads, or the key its save stores), the part
    keys of a chain, the pack's tokens (the prompt's first), and whether the facts were stored before this ask."""

    prompt: list[int]
    params: dict[str, Any]
    salt: str | None
    pack: str
    parts: list[str] | None
    pack_tokens: int
    stored: bool


def local_engine_only(question: Question) -> None:
    """InvalidInput naming the field for what a serving engine cannot run: steering, splicing modes, adapters (they
    need the local engine's model)."""
    if question.steering:
        raise InvalidInput("steer needs the local engine: vLLM cannot add steering deltas to its K/V", param="steer")
    if question.mode != "exact":
        raise InvalidInput(f"mode {question.mode!r} needs the local engine: vLLM composes packs in sequence only", param="mode")
    if question.adapter:
        raise InvalidInput("adapter needs the local engine: vLLM cannot run a pack's soft tokens", param="adapter")


def check_namespace(engine: EngineIdentity, namespace: str, url: str) -> None:
    """Unavailable unless the engine's connector reads ``namespace`` (a front's caller must get its own packs there)."""
    if namespace not in engine.namespaces:
        raise Unavailable(
            f"the vLLM server's connector does not read namespace {namespace!r} (it reads {', '.join(engine.namespaces)}): "
            "add it to its kv_connector_extra_config namespaces",
            url=url,
        )


def fresh_salt(purpose: str) -> str:
    """A ``cache_salt`` no other request sends, so vLLM's prefix cache serves this one nothing (and it serves none)."""
    return f"{SALT_PREFIX}{purpose}-{uuid.uuid4().hex}"


def completion_body(served_name: str, ask: EngineAsk, sampling: Sampling, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``ask``: the prompt as token ids and every sampling field explicit, so that no
    server default (vLLM's ``max_tokens`` of 16, a generation config's temperature) changes the answer."""
    body: dict[str, Any] = {
        "model": served_name, "prompt": ask.prompt, "max_tokens": sampling.max_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature, "top_p": sampling.top_p, "top_k": -1,
        "min_p": 0.0, "repetition_penalty": 1.0, "stop_token_ids": list(stop_token_ids), "kv_transfer_params": ask.params,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if ask.salt is not None:
        body["cache_salt"] = ask.salt
    return body


class EngineAnswerer:
    """Answers one namespace's questions with the engine behind ``client``, from the packs and banks of ``store`` (the
    store its connector reads): the same ``stream`` as ``Answerer``'s, generation done by vLLM."""

    def __init__(
        self,
        model: RenderingModel,
        store: PackStore,
        client: EngineClient,
        engine: EngineIdentity,
        *,
        namespace: str,
        trusted: TrustedKeys | None = None,
        bank_cache: BankCache | None = None,
        refs: RefCache | None = None,
    ) -> None:
        self.model, self.store, self.client, self.engine = model, store, client, engine
        self.namespace, self.trusted = namespace, trusted
        self.bank_cache = bank_cache if bank_cache is not None else BankCache()
        self.refs = refs if refs is not None else RefCache()
        self.store_reads = 0  # (the engine's connector reads the packs, not this front)

    def header(self, ref: str) -> PackHeader:
        """The header of the knowledge pack ``ref`` names, refused as the local worker refuses it (kind, model,
        template; with trusted keys, a signature)."""
        stored = self.refs.lookup(self.store, ref, self.model.model_fp)
        check_parts(self.model, [stored.header])
        if self.trusted is not None:
            self.trusted.require(f"pack {stored.key}", "pack", stored.header.pack_sha256, stored.signatures)
        return stored.header

    def stored_key(self, ids: Sequence[int]) -> str | None:
        """The key of a stored pack of exactly the token ids ``ids`` (this engine's build first, then packstore's), or
        None; a pack found is remembered for the ref ttl (``RefCache``), so a warm ask makes no store round trip."""
        m, t = self.model.model_fp, self.model.template_fp
        for key in (pack_key(m, t, ids, engine=self.engine.engine), pack_key(m, t, ids)):
            try:
                stored = self.refs.lookup(self.store, key, m)
            except PackNotFound:
                continue
            if self.trusted is None or self._signed(stored.header.pack_sha256, stored.signatures):
                return key
        return None

    def _signed(self, digest: str, signatures: Any) -> bool:
        assert self.trusted is not None
        try:
            self.trusted.require("pack", "pack", digest, signatures)
        except Untrusted:
            return False
        return True

    def plan_ask(self, question: Question, facts: list[str] | None) -> EngineAsk:
        """What to send for ``question`` (its packs, then ``facts`` routed from its bank)."""
        headers = [self.header(ref) for ref in question.refs]
        raw = headers[0].raw if headers else False
        every = [fact for header in headers for fact in header.facts] + (facts or [])
        namespace = {"namespace": self.namespace}
        if len(headers) == 1 and not facts:
            header = headers[0]
            rendering = prepare(self.model, header, question.text, question.history)  # the pack is the prompt's start
            salt = cache_salt_for(header.key) if header.composition != "exact" else None  # (approximate: docs/protocol.md)
            return EngineAsk(rendering.token_ids, {"pack": header.key} | namespace, salt, header.key, None, header.tokens, True)
        rendering = render(self.model.tokenizer, every, question.text.strip(), raw=raw, history=question.history)
        parts = [header.key for header in headers] or None
        found = self.stored_key(rendering.prefix_ids)  # (the facts' tokens: this rendering's, split in one pass)
        if found is not None:
            params: dict[str, Any] = {"pack": {"facts": every}}
            return EngineAsk(rendering.token_ids, params | namespace, None, found, parts, rendering.prefix_tokens, True)
        if self.engine.saves:
            ids = rendering.prefix_ids
            key = pack_key(self.model.model_fp, self.model.template_fp, ids, engine=self.engine.engine)
            params = {"pack": {"facts": every}, "save": True}
            return EngineAsk(rendering.token_ids, params | namespace, fresh_salt("save"), key, parts, rendering.prefix_tokens, False)
        key = composition_key(self.model, every, raw=raw)
        params = {"pack": parts if parts and not facts else {"facts": every}}
        return EngineAsk(rendering.token_ids, params | namespace, None, key, parts, rendering.prefix_tokens, False)

    def stream(self, question: Question, cancel: Cancel | None = None) -> Generator[int, None, AnswerResult]:
        """Answer ``question`` with the engine, yielding each generated token id as vLLM streams it (a stop token that
        ends the answer too); returns the AnswerResult. ``cancel`` aborts the engine's request (Left)."""
        cancel = cancel if cancel is not None else Cancel()
        local_engine_only(question)
        check_namespace(self.engine, self.namespace, self.client.url)
        facts = None
        if question.bank:
            facts = clean_facts(route_bank(
                self.store, self.bank_cache, question.bank, question.text, top_k=question.top_k, probe=question.probe,
                embedder=question.embedder, rerank=question.rerank, rerank_weight=question.rerank_weight, trusted=self.trusted,
            ))
        ask = self.plan_ask(question, facts)
        cancel.check()
        body = completion_body(self.engine.served_name, ask, question.sampling, self.model.stop_token_ids)
        generated: list[int] = []
        usage = yield from self._generate(body, cancel, generated)
        answer = answer_of(self.model, generated, usage.prompt_tokens - (usage.cached_tokens or 0), question.sampling.stop)
        saved = min(usage.cached_tokens or 0, ask.pack_tokens)
        rag = None
        if question.compare_rag:
            text_ask = EngineAsk(ask.prompt, {"pack": False}, fresh_salt("rag"), ask.pack, None, 0, False)
            text_body = completion_body(self.engine.served_name, text_ask, question.sampling, self.model.stop_token_ids)
            text_ids: list[int] = []
            text_usage = finish(self._generate(text_body, cancel, text_ids))  # (its tokens are not the client's)
            rag = answer_of(self.model, text_ids, text_usage.prompt_tokens, question.sampling.stop)
        several = ask.parts is not None and (len(ask.parts) > 1 or facts is not None)
        return AnswerResult(
            question=question.text,
            answer=answer.text,
            kv_prompt_tokens=len(ask.prompt) - ask.pack_tokens,
            rag_answer=rag.text if rag is not None else None,
            rag_prompt_tokens=rag.prompt_tokens if rag is not None else None,
            identical=answer.token_ids == rag.token_ids if rag is not None else None,
            pack=ask.pack,
            pack_tokens=ask.pack_tokens,
            bank=question.bank,
            facts=facts,
            pack_reused=ask.stored and saved > 0 if facts is not None else None,
            cache_hit=saved > 0,
            parts=ask.parts if several else None,
            composed_tokens=ask.pack_tokens - saved,  # the pack's tokens vLLM prefilled (past its last whole block, or all)
        )

    def _generate(self, body: dict[str, Any], cancel: Cancel, generated: list[int]) -> Generator[int, None, Usage]:
        """Stream ``body``'s answer from the engine: yield each token id (into ``generated`` too); return the usage."""
        pieces = self.client.complete(body, cancel)
        try:
            while True:
                for token in next(pieces):
                    generated.append(token)
                    yield token
        except StopIteration as finished:
            return finished.value
        finally:
            pieces.close()
