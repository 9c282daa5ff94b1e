"""The worker's records survive their protocol messages both ways (packstore.worker.messages)."""

from __future__ import annotations

import pytest

from packstore.answering.answer import Question
from packstore.answering.records import AnswerResult
from packstore.kv.inject import Sampling
from packstore.v1 import worker_pb2
from packstore.worker.messages import answer_result, generate_done, generate_request, question_of

QUESTIONS = [  # floats exact in float32, as the wire carries them
    Question("Which river?", refs=("wexley",)),
    Question(
        "Which river?", refs=("a", "b"), bank="towns", top_k=3, probe=2, embedder="minilm", rerank="lm", rerank_weight=0.5, compare_rag=True,
        sampling=Sampling(max_new_tokens=7, temperature=0.5, top_p=0.75, seed=0, stop=("\n", "Q:")), steering=(("joy", 0.5), ("calm", -1.0)),
        steer_layers=(1, 2), steer_on="both", mode="packet", adapter="adapter",
        history=(("user", "Where is Wexley?"), ("assistant", "By the river.")),
    ),
]


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_question_round_trips_through_its_request(question: Question) -> None:
    request = worker_pb2.GenerateRequest.FromString(generate_request(question).SerializeToString())
    assert question_of(request) == question


RESULTS = [
    (Question("Q?", refs=("a",)), AnswerResult(question="Q?", answer="A.", kv_prompt_tokens=9, pack="k", pack_tokens=30, cache_hit=False)),
    (
        Question("Q?", refs=("a",), bank="towns", compare_rag=True),
        AnswerResult(
            question="Q?", answer="A.", kv_prompt_tokens=9, rag_answer="B.", rag_prompt_tokens=30, identical=False,
            chunked_identical=False, pack="k", bank="towns", facts=["f1", "f2"], cache_hit=True, parts=["k1", "k2"], composed_tokens=0,
            steering=[{"pack": "s", "alpha": 0.5, "layers": [1, 2]}], steer_on="values",
        ),
    ),
    *(  # chunked_identical unknown (a pack recording no prefill) reads back as None, never as False
        (
            Question("Q?", refs=("a",), compare_rag=True),
            AnswerResult(
                question="Q?", answer="A.", kv_prompt_tokens=9, rag_answer="A.", rag_prompt_tokens=30, identical=True,
                chunked_identical=chunked, pack="k", cache_hit=False,
            ),
        )
        for chunked in (True, None)
    ),
]


@pytest.mark.parametrize(("question", "result"), RESULTS)
def test_an_answer_round_trips_through_its_summary(question: Question, result: AnswerResult) -> None:
    done = worker_pb2.GenerateDone.FromString(generate_done(result, 5).SerializeToString())
    assert done.generated_tokens == 5 and done.compared == question.compare_rag
    assert answer_result(done, question) == result
