"""The second stage over a route (packstore.bank.rerank): both scorers on real and tiny models, the reorder, the
flags of ``bank route`` and ``ask``, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from packstore.answering.answer import Answerer, Question
from packstore.bank.bank import open_banks
from packstore.bank.rerank import CANDIDATES, Reranker, lm_scorer, reranked_route, reranker
from packstore.cli.packctl import main as packctl
from packstore.errors import InvalidInput, PackNotFound
from packstore.kv.inject import Sampling
from packstore.kv.synthetic import synthetic_facts
from packstore.store import LmdbStore
from packstore.store.records import Route
from tests.helpers.banks import TEST_BANK_CACHE

CASES = synthetic_facts(60)


@pytest.fixture(scope="module")
def banks(tmp_path_factory):
    with LmdbStore(tmp_path_factory.mktemp("rerank") / "store") as store:
        banks = open_banks(store, TEST_BANK_CACHE)
        banks.build("b", [c.fact for c in CASES])
        yield banks


def by_length(query: str, candidates: list[str]) -> np.ndarray:
    """A scorer that prefers short candidates: enough to see the route's order change."""
    return -np.array([len(c) for c in candidates], dtype=np.float64)


def test_a_reranker_adds_its_weighted_score_and_keeps_top_k() -> None:
    route = Route("q", [0], [("a long fact here", 0.9), ("short", 0.8), ("medium one", 0.7)], {"embed": 0.01})
    kept = Reranker("length", by_length, candidates=3, weight=1.0).apply(route, top_k=2)
    assert [text for text, _ in kept.facts] == ["short", "medium one"]
    assert kept.facts[0][1] == pytest.approx(0.8 - 5) and set(kept.seconds) == {"embed", "rerank"}
    barely = Reranker("length", by_length, candidates=3, weight=1e-6).apply(route, top_k=3)  # a tiny weight keeps the order
    assert [text for text, _ in barely.facts] == [text for text, _ in route.facts]
    assert Reranker("length", by_length, candidates=3).apply(Route("q", [], []), top_k=2).facts == []
    assert Reranker("length", by_length, candidates=20).routed_for(5) == 20 and Reranker("length", by_length, candidates=2).routed_for(5) == 5


def test_reranker_settings_are_checked(tiny_lm) -> None:
    assert reranker("none") is None
    with pytest.raises(InvalidInput, match="unknown reranker 'bogus'"):
        reranker("bogus")
    with pytest.raises(InvalidInput, match="needs a cross-encoder"):
        reranker("cross")
    with pytest.raises(InvalidInput, match="needs the bank's embedder"):
        reranker("late")
    with pytest.raises(InvalidInput, match="needs a language model"):
        reranker("lm")
    for weight in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidInput, match="rerank weight must be a positive number"):
            reranker("lm", lm=(tiny_lm.tokenizer, tiny_lm.model), weight=weight)
    with pytest.raises(InvalidInput, match="at least 1 candidate"):
        reranker("lm", lm=(tiny_lm.tokenizer, tiny_lm.model), candidates=0)
    assert reranker("lm", lm=(tiny_lm.tokenizer, tiny_lm.model)).candidates == CANDIDATES["lm"]


def test_the_lm_scorer_scores_each_candidate_as_if_alone(tiny_lm) -> None:
    """Padding in the batch changes no score: each equals the candidate scored by itself."""
    score = lm_scorer(tiny_lm.tokenizer, tiny_lm.model)
    candidates = [c.fact for c in CASES[:4]] + ["x"]
    batched = score(CASES[0].query, candidates)
    alone = np.array([score(CASES[0].query, [c])[0] for c in candidates])
    assert batched.shape == (5,) and np.isfinite(batched).all()
    np.testing.assert_allclose(batched, alone, atol=1e-4)


def test_late_reranking_on_the_real_embedder_keeps_the_answering_fact_first(banks) -> None:
    """MaxSim over MiniLM's tokens, after the hybrid route: the fact a paraphrased question asks for stays on top."""
    late = reranker("late", embedder=TEST_BANK_CACHE.embedder(banks.store.bank("b").embedder))
    routes = reranked_route(banks, "b", [c.query for c in CASES[:10]], top_k=3, reranker=late)
    assert all(len(r.facts) == 3 and "rerank" in r.seconds for r in routes)
    assert sum(r.facts[0][0] == c.fact for r, c in zip(routes, CASES[:10])) >= 9
    plain = reranked_route(banks, "b", [CASES[0].query], top_k=3)[0]
    assert "rerank" not in plain.seconds
    with pytest.raises(PackNotFound, match="no bank named 'absent'"):
        banks.route("absent", ["Who?"], rerank="late")  # the late stage needs the bank's embedder: there is no bank


def test_questions_check_their_reranker() -> None:
    assert Question("Q?", bank="b", rerank="").rerank == "cross"  # the default stage of a bank question (issue 66)
    assert Question("Q?", refs=("a",)).rerank == "none" and Question("Q?", bank="b", rerank="none").rerank == "none"
    with pytest.raises(InvalidInput, match="unknown reranker 'bogus'"):
        Question("Q?", bank="b", rerank="bogus")
    assert Question("Q?", bank="b", rerank="cross").rerank_weight is None  # each stage's own default
    with pytest.raises(InvalidInput, match="reranking reorders a bank's routed facts"):
        Question("Q?", refs=("a",), rerank="lm")


def test_an_answer_with_the_lm_reranker_routes_through_it(tiny_lm, tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        open_banks(store, TEST_BANK_CACHE).build("b", [c.fact for c in CASES])
        answerer = Answerer(tiny_lm, store)
        question = Question(CASES[3].query, bank="b", top_k=2, rerank="lm", rerank_weight=1000.0, sampling=Sampling(max_new_tokens=4))
        result = answerer.ask(question)
        candidates = answerer.route("b", CASES[3].query, top_k=CANDIDATES["lm"])
        scores = lm_scorer(tiny_lm.tokenizer, tiny_lm.model)(CASES[3].query, candidates)
        assert result.facts == [candidates[i] for i in np.argsort(-scores, kind="stable")[:2]]  # the model's order at this weight


def test_bank_route_and_ask_take_the_rerank_flags(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(c.fact for c in CASES))
    store = ["--store", str(tmp_path / "store")]
    assert packctl([*store, "bank", "build", str(facts), "--name", "b"]) == 0
    capsys.readouterr()
    query = CASES[7].query
    assert packctl([*store, "bank", "route", "b", query, "--json", "--top-k", "2", "--rerank", "late"]) == 0
    routed = json.loads(capsys.readouterr().out)
    assert len(routed["facts"]) == 2 and routed["facts"][0]["text"] == CASES[7].fact
    argv = [*store, "bank", "route", "b", query, "--json", "--top-k", "2", "--rerank", "lm", "--rerank-model", str(tiny_model_dir)]
    assert packctl(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["facts"]) == 2
    ask = [*store, "ask", "--bank", "b", query, "--model", str(tiny_model_dir), "--json", "--max-new-tokens", "3", "--top-k", "2"]
    assert packctl([*ask, "--rerank", "lm", "--rerank-weight", "0.5"]) == 0
    assert len(json.loads(capsys.readouterr().out)["facts"]) == 2
    with pytest.raises(SystemExit):
        packctl([*store, "bank", "route", "b", query, "--rerank", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert packctl([*store, "bank", "route", "b", query, "--rerank", "late", "--rerank-weight", "-1"]) == 1
    assert "rerank weight must be a positive number" in capsys.readouterr().err
