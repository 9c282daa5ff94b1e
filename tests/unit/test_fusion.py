"""How hybrid routes fuse cosine and BM25 (packstore.bank.fusion, issue 54): the rules on hand-made candidates, the
default rule keeping a decisive lexical match first whatever the cosines, and ``route_candidates`` handing
tools/eval/eval_fusion.py exactly what ``route`` ranks (a rule applied to them gives the route's order and scores)."""

from __future__ import annotations

import numpy as np
import pytest

from packstore.bank.bank import FUSION, build_bank, route, route_candidates
from packstore.bank.embedder import load_embedder
from packstore.bank.fusion import Additive, Candidates, LexicalLead, RankFusion, ranks
from packstore.kv.synthetic import synthetic_facts
from packstore.store import LmdbStore


def candidates(cosine: list[float], bm25: list[float]) -> Candidates:
    return Candidates(cosine=np.array(cosine, dtype=np.float32), bm25=np.array(bm25, dtype=np.float32))


def test_ranks_are_one_based_highest_first_ties_by_position() -> None:
    assert ranks(np.array([0.2, 0.9, 0.2, 0.5])).tolist() == [3, 1, 4, 2]


def test_the_old_additive_rule_drowns_a_decisive_lexical_match_and_the_default_does_not() -> None:
    """Fact 1 holds the query's rare name (BM25 12, every other fact at most 3); fact 0's cosine is 0.3 higher."""
    c = candidates([0.80, 0.50, 0.40], [3.0, 12.0, 0.0])
    assert int(np.argmax(Additive(0.2)(c))) == 0  # the mechanism: a cosine 0.2 higher wins
    scores = FUSION(c)
    assert int(np.argmax(scores)) == 1 and scores[1] == pytest.approx(scores[[0, 2]].max() + 1)
    assert FUSION == LexicalLead(Additive(0.4), 1.5)


def test_without_a_decisive_lead_the_default_is_cosine_plus_its_weighted_bm25_share() -> None:
    c = candidates([0.80, 0.50, 0.40], [10.0, 12.0, 0.0])  # 12 < 1.5 x 10: no lead
    assert np.allclose(FUSION(c), [0.80 + 0.4 * 10 / 12, 0.50 + 0.4, 0.40])
    only = candidates([0.9, 0.1], [0.0, 2.0])  # a single fact shares a word with the query: it leads
    assert int(np.argmax(FUSION(only))) == 1


def test_rank_fusion_weighs_ranks_not_scores() -> None:
    c = candidates([0.99, 0.10, 0.05], [0.0, 50.0, 1.0])
    rule = RankFusion(k=1, lexical=1.0)
    assert np.allclose(rule(c), [1 / 2, 1 / 3 + 1 / 2, 1 / 4 + 1 / 3])
    assert rule(candidates([0.5], [0.0])).tolist() == [0.5]


@pytest.fixture(scope="module")
def synthetic_bank(tmp_path_factory):
    embedder = load_embedder()
    store = LmdbStore(tmp_path_factory.mktemp("fusion") / "store")
    build_bank(store, "b", [case.fact for case in synthetic_facts(400)], embedder)
    yield store, embedder
    store.close()


def test_route_candidates_are_exactly_what_route_ranks(synthetic_bank) -> None:
    """For each query, the default rule over ``route_candidates`` gives ``route``'s facts, in its order, with its
    scores: what makes tools/eval/eval_fusion.py's offline sweep the route's own figures."""
    store, embedder = synthetic_bank
    cases = synthetic_facts(400)[::20]
    queries = [case.query for case in cases] + [f"Tell me about {case.fact.split()[2]}." for case in cases]
    routes = route(store, "b", queries, embedder, top_k=5)
    for (texts, found), routed in zip(route_candidates(store, "b", queries, embedder), routes):
        scores = FUSION(found) if found.bm25.any() else found.cosine
        best = np.argsort(-scores, kind="stable")[:5]
        assert [texts[i] for i in best] == [text for text, _ in routed.facts]
        assert np.allclose([scores[i] for i in best], [score for _, score in routed.facts], atol=1e-6)


def test_a_widened_pool_holds_every_fact_with_the_query_s_rarest_term(tmp_path) -> None:
    """30 facts hold "Ferrowick" with the query's other words, so BM25's 20 best are among them; the fact that
    describes the lamp in other words ("lantern", "rests") holds only the place. The pool widened by the rarest
    term's facts (issue 66) holds it and every other Ferrowick fact."""
    facts = [case.fact for case in synthetic_facts(200)]
    facts += [f"Ferrowick keeps lamp number {i}, a brass lamp kept in hall {i}." for i in range(30)]
    facts += [f"Dunmore keeps lamp number {i}, an iron lamp kept in shed {i}." for i in range(30)]
    target = "An old lantern rests by the quay at Ferrowick."
    embedder = load_embedder()
    with LmdbStore(tmp_path / "store") as store:
        build_bank(store, "b", [*facts, target], embedder)
        query = "Which lamp is kept in Ferrowick?"
        [(narrow, _)] = route_candidates(store, "b", [query], embedder, probe=1, rare_facts=0)
        [(wide, found)] = route_candidates(store, "b", [query], embedder, probe=1, rare_facts=40)
        assert target not in narrow and set(narrow) <= set(wide) and target in wide
        assert all(fact in wide for fact in facts if "Ferrowick" in fact)
        assert len(found.cosine) == len(wide) and found.bm25[wide.index(target)] > 0
