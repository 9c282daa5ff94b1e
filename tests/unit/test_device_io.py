"""The device held for no one's I/O and no absent client (issue 62): a generation waiting for a layer of a pack from
a stalled store, or for its reader to take its tokens, waits with the device given up, so the others' tokens keep
coming; a store that never delivers fails the answer UNAVAILABLE naming the pack once ``fetch_seconds`` pass; an answer
whose client has gone (``Cancel``) stops within a step, its compare_rag comparisons too. Tokens stay those each
generation chooses alone.

Every wait is for a state (who holds the device, how many steps ran), bounded by WAIT_SECONDS so that a hang fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.errors import Unavailable
from packstore.kv import inject
from packstore.kv.build import build_pack
from packstore.kv.device import Cancel, DeviceLock, Left
from packstore.kv.inject import Sampling, cache_from_pack, finish, generate_stream, prepare
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from tests.helpers import device as device_helpers
from tests.helpers.device import StalledStore, StepCounter

FACTS = {"a": ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."],
         "b": ["Orla keeps bees on the hill above Dunmore.", "Dunmore's honey is sold in May."]}
# on the tiny model this prompt sampled so runs to its length without a stop token
LONG_PROMPT = "What is the capital?"
WAIT_SECONDS = 60.0  # how long a state is waited for before the test fails (never reached when it passes)


def wait_for(condition, what: str) -> None:
    device_helpers.wait_for(condition, what, WAIT_SECONDS)


@pytest.fixture
def store(tmp_path: Path, tiny_lm):
    with LmdbStore(tmp_path / "store") as store:
        for name, facts in FACTS.items():
            store.put(encode_pack(build_pack(tiny_lm, facts)), name=name)
        yield store


def run(call) -> tuple[threading.Thread, dict]:
    """``call`` on a thread of its own; its result (or error) under "result" once it ends."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # (kept, for the test to check)
            outcome["result"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.fast
def test_a_generation_waiting_on_a_stalled_store_leaves_the_device_to_the_others(tiny_lm, store) -> None:
    a = Question("Where does the river Tamsin flow?", refs=("a",), sampling=Sampling(max_new_tokens=40))
    b = Question(LONG_PROMPT, refs=("b",), sampling=Sampling(max_new_tokens=30, temperature=1.0, seed=3))
    alone = {name: list(Answerer(tiny_lm, store).stream(question)) for name, question in (("a", a), ("b", b))}
    stalled = StalledStore(store, {store.resolve("b")})
    device = DeviceLock()
    answerer = Answerer(tiny_lm, stalled, device_lock=device)
    answerer.pack("a")  # ready: A needs nothing from the store
    steps = StepCounter(tiny_lm.model)
    b_thread, b_outcome = run(lambda: list(answerer.stream(b)))
    try:
        # B takes the device, starts its prefill and reaches the first layer, which does not come: it waits without it
        wait_for(lambda: steps.count == 1 and not device.locked(), "B waits for the store off the device")
        assert stalled.waiting.is_set()
        a_thread, a_outcome = run(lambda: list(answerer.stream(a)))
        a_thread.join(WAIT_SECONDS)
        assert a_outcome.get("result") == alone["a"]  # A's answer, whole, while B's pack still hangs
        assert b_thread.is_alive() and steps.count == 1 + len(alone["a"])  # (B ran no step meanwhile)
    finally:
        stalled.flowing.set()
        steps.remove()
    b_thread.join(WAIT_SECONDS)
    assert b_outcome.get("result") == alone["b"]  # B's tokens as alone, its prefill interrupted or not
    assert not device.locked() and device.waiting == 0


def test_a_store_that_never_delivers_fails_the_answer_unavailable_naming_the_pack(tiny_lm, store) -> None:
    key = store.resolve("b")
    stalled = StalledStore(store, {key})
    device = DeviceLock()
    answerer = Answerer(tiny_lm, stalled, device_lock=device, fetch_seconds=0.3)
    try:
        with pytest.raises(Unavailable) as failed:
            finish(answerer.stream(Question(LONG_PROMPT, refs=("b",))))
        assert str(failed.value) == f"pack {key}: layer 0 did not arrive from the store within 0.3 s"
        assert not device.locked() and device.waiting == 0
        answerer.pack("a")
        assert finish(answerer.stream(Question(LONG_PROMPT, refs=("a",)))).answer  # nothing else is affected
    finally:
        stalled.flowing.set()


def test_a_reader_that_stops_reading_stops_its_generation_off_the_device(tiny_lm, store) -> None:
    pack = Answerer(tiny_lm, store).pack("a")[0]
    ids = prepare(tiny_lm, pack.header, LONG_PROMPT).token_ids
    sampling = Sampling(max_new_tokens=1500, temperature=1.0, seed=2)
    alone = list(generate_stream(tiny_lm, ids, sampling, cache_from_pack(pack, tiny_lm.device)))
    assert len(alone) == 1500
    device = DeviceLock()
    tokens = generate_stream(tiny_lm, ids, sampling, cache_from_pack(pack, tiny_lm.device), device=device)
    first = next(tokens)
    steps = StepCounter(tiny_lm.model)
    try:
        # its reader takes no more: the generation stops a few tokens ahead, without the device
        wait_for(lambda: not device.locked(), "the device is free")
        ran = steps.count
        assert inject._generation_threads().busy == 1 and ran < 100, ran  # waiting, not ended (1500 tokens)
        other = finish(generate_stream(tiny_lm, ids[:-3], Sampling(max_new_tokens=20), cache_from_pack(pack, tiny_lm.device), device=device))
        assert len(other.token_ids) > 0  # another generation runs meanwhile
        assert steps.count - ran == len(other.token_ids)  # (and only it)
    finally:
        steps.remove()
    assert [first, *tokens] == alone  # read again: it goes on, its tokens as alone
    assert not device.locked()


@pytest.mark.parametrize("at", [230, 450], ids=["rag comparison", "chunked comparison"])
def test_a_cancelled_answer_stops_its_comparisons_within_a_step(tiny_lm, store, at) -> None:
    device = DeviceLock()
    answerer = Answerer(tiny_lm, store, device_lock=device)
    answerer.pack("a")
    question = Question(LONG_PROMPT, refs=("a",), compare_rag=True, sampling=Sampling(max_new_tokens=200, temperature=1.0, seed=2))
    cancel = Cancel()
    stream = answerer.stream(question, cancel)
    # the answer's 200 steps, then the comparisons': the client goes during one of them (at its ``at``-th step)
    steps = StepCounter(tiny_lm.model, at, cancel.cancel)
    try:
        thread, outcome = run(lambda: finish(stream))
        thread.join(WAIT_SECONDS)
    finally:
        steps.remove()
    assert isinstance(outcome.get("result"), Left), outcome
    assert steps.count == at  # no step after the one it went during
    assert not device.locked() and device.waiting == 0 and inject._generation_threads().busy == 0
