"""The one answering path on the tiny model: Answerer over a local store, its ready-cache, refusals, banks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.answering.records import AnswerResult
from packstore.bank.bank import open_banks
from packstore.errors import IntegrityError, InvalidInput, PackMismatch
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling, answer_with_text
from packstore.kv.models import load_model
from packstore.kv.synthetic import synthetic_facts
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.lmdb.store import _chunk_key
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.tiny_model import ALT_TEMPLATE

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
QUESTION = "What is Wexley famous for?"
GREEDY = Sampling(max_new_tokens=12)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_lm):
    with LmdbStore(tmp_path_factory.mktemp("answer") / "store") as store:
        store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        yield store


def streamed(answerer: Answerer, question: Question) -> tuple[list[int], AnswerResult]:
    """The token ids ``stream`` yields, and the result it returns."""
    tokens, ids = answerer.stream(question), []
    while True:
        try:
            ids.append(next(tokens))
        except StopIteration as finished:
            return ids, finished.value


def test_answering_from_the_store_equals_the_facts_as_prompt_text(tiny_lm, store) -> None:
    ids, result = streamed(Answerer(tiny_lm, store), Question(QUESTION, refs=("wexley",), compare_rag=True, sampling=GREEDY))
    assert ids and ids == answer_with_text(tiny_lm, FACTS, QUESTION, sampling=GREEDY).token_ids
    record = result.to_json()
    assert {"question", "answer", "rag_answer", "identical", "kv_prompt_tokens", "rag_prompt_tokens"} <= record.keys()
    assert record["identical"] is True and record["answer"] == record["rag_answer"]
    assert record["rag_prompt_tokens"] - record["kv_prompt_tokens"] == store.stat("wexley").header.tokens
    assert (result.pack, result.bank, result.facts) == (store.resolve("wexley"), None, None)


def test_the_second_ask_finds_the_pack_ready(tiny_lm, store) -> None:
    answerer = Answerer(tiny_lm, store)
    question = Question(QUESTION, refs=("wexley",), sampling=GREEDY)
    first, second = answerer.ask(question), answerer.ask(question)
    assert (first.cache_hit, second.cache_hit) == (False, True) and first.answer == second.answer
    assert answerer.ready.stats == (1, store.stat("wexley").header.raw_bytes)


def test_a_damaged_chunk_fails_the_answer_before_any_token_and_is_never_made_ready(tiny_lm, tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        key, _ = store.put(encode_pack(build_pack(tiny_lm, FACTS)))
        last = len(store.stat(key).header.chunks) - 1  # the last layer's: the model has run every layer before it

        def flip(txn) -> None:
            damaged = bytearray(txn.get(_chunk_key(key, last), db=store._chunks))
            damaged[-1] ^= 1
            txn.put(_chunk_key(key, last), bytes(damaged), db=store._chunks)

        store._env.write(flip)
        answerer = Answerer(tiny_lm, store)
        tokens = answerer.stream(Question(QUESTION, refs=(key,), sampling=GREEDY))
        with pytest.raises(IntegrityError, match=f"chunk {last} .* is damaged"):
            next(tokens)
        assert answerer.ready.stats == (0, 0)


def test_packs_of_another_model_or_template_are_refused(tiny_lm, store, tiny_model_dir, other_tiny_model_dir) -> None:
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    store.put(encode_pack(build_pack(other, FACTS)), name="foreign")
    with pytest.raises(PackMismatch, match="model mismatch") as info:
        Answerer(tiny_lm, store).ask(Question(QUESTION, refs=("foreign",), sampling=GREEDY))
    assert info.value.what == "model"
    alt = load_model(str(tiny_model_dir), device="cpu", progress=False, chat_template=ALT_TEMPLATE)
    answerer = Answerer(alt, store)
    with pytest.raises(PackMismatch, match="template mismatch") as info:
        answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY))
    assert info.value.what == "template" and answerer.ready.stats == (0, 0)


def test_a_bank_question_builds_its_facts_pack_once_then_reuses_it(tiny_lm, tmp_path: Path) -> None:
    cases = synthetic_facts(60)
    with LmdbStore(tmp_path / "store") as store:
        open_banks(store, TEST_BANK_CACHE).build("b", [c.fact for c in cases])
        question = Question(cases[3].query, bank="b", top_k=2, compare_rag=True, sampling=GREEDY)
        answerer = Answerer(tiny_lm, store)
        first = answerer.ask(question)
        assert first.identical is True and first.facts[0] == cases[3].fact and len(first.facts) == 2
        assert (first.bank, first.pack_reused, first.cache_hit) == ("b", False, False)
        assert store.keys() == [first.pack]  # the computed pack was written back
        again = answerer.ask(question)
        assert (again.pack, again.answer, again.pack_reused, again.cache_hit) == (first.pack, first.answer, True, True)
        fresh = Answerer(tiny_lm, store).ask(question)  # an empty ready-cache fetches the stored pack
        assert (fresh.pack, fresh.answer, fresh.pack_reused, fresh.cache_hit) == (first.pack, first.answer, True, False)


MORE = [["Alice lives in Paris and works as a baker."], ["Bob lives in Oslo."], ["The bridge was built in 1890."]]


@pytest.fixture(scope="module")
def parts_store(tmp_path_factory, tiny_lm):
    with LmdbStore(tmp_path_factory.mktemp("parts") / "store") as store:
        for index, facts in enumerate([FACTS, *MORE]):
            store.put(encode_pack(build_pack(tiny_lm, facts)), name=f"part{index}")
        yield store


def test_several_refs_answer_with_their_composition_exactly_as_text(tiny_lm, parts_store) -> None:
    answerer = Answerer(tiny_lm, parts_store)
    refs = ("part0", "part1", "part2")
    result = answerer.ask(Question("Where does Bob live?", refs=refs, compare_rag=True, sampling=GREEDY))
    assert result.identical is True and result.answer == result.rag_answer
    assert result.parts == [parts_store.resolve(ref) for ref in refs] and result.cache_hit is False
    all_facts = FACTS + MORE[0] + MORE[1]
    text = answer_with_text(tiny_lm, all_facts, "Where does Bob live?", sampling=GREEDY)
    assert result.rag_prompt_tokens == text.prompt_tokens
    assert result.composed_tokens < text.prompt_tokens - parts_store.stat("part0").header.tokens
    again = answerer.ask(Question("Who works as a baker?", refs=refs, sampling=GREEDY))
    assert (again.cache_hit, again.composed_tokens, again.pack) == (True, 0, result.pack)
    assert len(parts_store.keys()) == 4  # the composition lives in the ready-cache; nothing is written back


def test_accumulation_extends_the_longest_ready_composition(tiny_lm, parts_store) -> None:
    """An agent adding one pack per step pays only that pack's tokens (and the closing framing)."""
    answerer = Answerer(tiny_lm, parts_store)
    costs = []
    for steps in range(1, 5):
        refs = tuple(f"part{index}" for index in range(steps))
        result = answerer.ask(Question("Where does Bob live?", refs=refs, compare_rag=True, sampling=GREEDY))
        assert result.identical is True
        costs.append(result.composed_tokens)
    facts = [FACTS, *MORE]
    framing = 6  # "<|im_end|>\n<|im_start|>user\n" and the line break between facts, at most
    for step in range(1, 4):
        before = answer_with_text(tiny_lm, sum(facts[:step], []), "x").prompt_tokens
        after = answer_with_text(tiny_lm, sum(facts[: step + 1], []), "x").prompt_tokens
        assert costs[step] <= after - before + framing
    assert costs[0] is None or costs[0] == 0


def test_refs_and_a_bank_compose_the_routed_facts_after_the_packs(tiny_lm, tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        cases = synthetic_facts(40)
        open_banks(store, TEST_BANK_CACHE).build("b", [case.fact for case in cases])
        answerer = Answerer(tiny_lm, store)
        question = Question(cases[3].query, refs=("wexley",), bank="b", top_k=2, compare_rag=True, sampling=GREEDY)
        result = answerer.ask(question)
        assert result.identical is True and len(result.facts) == 2 and result.parts == [store.resolve("wexley")]
        composed = answerer.ready.peek(result.pack)
        assert composed.header.facts == tuple(FACTS) + tuple(result.facts)


def test_bad_composition_requests_are_refused(tiny_lm, parts_store, tmp_path) -> None:
    with pytest.raises(InvalidInput, match="give a pack, a bank or a steering pack"):
        Question(QUESTION)
    with pytest.raises(InvalidInput, match="empty pack ref"):
        Question(QUESTION, refs=("part0", ""))
    raw_key, _ = parts_store.put(encode_pack(build_pack(tiny_lm, MORE[0], raw=True)))
    with pytest.raises(InvalidInput, match="raw"):
        Answerer(tiny_lm, parts_store).ask(Question(QUESTION, refs=("part0", raw_key)))
    parts_store.delete(raw_key)


def test_a_stop_token_first_gives_an_empty_answer(tiny_lm, store) -> None:
    question = Question(QUESTION, refs=("wexley",), compare_rag=True, sampling=GREEDY)
    first_token = streamed(Answerer(tiny_lm, store), question)[0][0]
    stops_at_once = dataclasses.replace(tiny_lm, stop_token_ids=(first_token, *tiny_lm.stop_token_ids))
    ids, result = streamed(Answerer(stops_at_once, store), question)
    assert ids == [first_token]  # the stop token is streamed, and is not part of the answer
    assert (result.answer, result.rag_answer, result.identical) == ("", "", True)
