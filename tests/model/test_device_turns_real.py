"""The device shared per token (issue 53) on smollm2-135m: generations that take their steps in turn, as a worker's
do, choose the tokens each chooses alone (greedy, and sampled with a seed), and a comparison (``compare_rag``) made
while others generate still finds its answers identical."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.answering.api import build_and_store
from packstore.kv import inject
from packstore.kv.device import DeviceLock
from packstore.kv.inject import Sampling
from packstore.kv.models import LoadedModel
from packstore.store import LmdbStore
from tests.helpers.device import take_turns

pytestmark = pytest.mark.model
MODEL = "smollm2-135m"
FACTS = [
    "The river Tamsin flows through the town of Wexley.",
    "Wexley is famous for its bells, cast in 1720 by the Harrow foundry.",
    "The Harrow foundry closed in 1802, after a fire.",
]
ASKED = [
    ("Write a long story about Wexley and its bells.", Sampling(max_new_tokens=40), False),
    ("Tell me about the Harrow foundry.", Sampling(max_new_tokens=32, temperature=0.8, seed=3), False),
    ("When did the Harrow foundry close?", Sampling(max_new_tokens=12), True),
]
WAIT_SECONDS = 600.0


@pytest.fixture(scope="module")
def smol(real_model) -> LoadedModel:
    return real_model(MODEL, device="cpu")


def run(answerer: Answerer, question: Question) -> tuple[list[int], object]:
    stream, tokens = answerer.stream(question), []
    try:
        while True:
            tokens.append(next(stream))
    except StopIteration as finished:
        return tokens, finished.value


def test_generations_taking_turns_on_smollm2_choose_the_tokens_they_choose_alone(smol, tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        build_and_store(store, smol, FACTS, name="wexley")
        questions = [Question(text, refs=("wexley",), sampling=sampling, compare_rag=compare) for text, sampling, compare in ASKED]
        alone = [run(Answerer(smol, store), question) for question in questions]
        device = DeviceLock()
        answerer = Answerer(smol, store, device_lock=device)
        answerer.pack("wexley")
        steps: list[str] = []
        assert smol.model in inject._hooked  # (the turns' hook runs before this one: each step is recorded holding the device)
        hook = smol.model.register_forward_pre_hook(lambda module, args: steps.append(threading.current_thread().name))
        try:
            results = take_turns(device, [lambda question=question: run(answerer, question) for question in questions], WAIT_SECONDS)
        finally:
            hook.remove()
    for index, (tokens, result) in enumerate(alone):
        assert results[index][0] == tokens, ASKED[index][0]  # the same token ids, interleaved or alone
        assert results[index][1].answer == result.answer  # type: ignore[attr-defined]
    compared = results[2][1]
    assert compared.identical is True and compared.chunked_identical is True  # type: ignore[attr-defined]
    first = steps[:3]
    shortest = len(alone[2][0])
    assert len(set(first)) == 3 and steps[: 3 * shortest] == first * shortest  # a step each, in turn, while all three ran
