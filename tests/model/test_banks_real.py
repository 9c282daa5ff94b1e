"""Banks on real models: lazy recompute on smollm2-135m (answers identical to the facts as prompt text), mpnet banks."""

from __future__ import annotations

from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.bank.bank import open_banks
from packstore.kv.inject import Sampling
from packstore.kv.synthetic import synthetic_facts
from packstore.store import LmdbStore
from tests.helpers.banks import TEST_BANK_CACHE

pytestmark = pytest.mark.model
GREEDY = Sampling(max_new_tokens=12)  # token-for-token checks: a divergence shows within the first tokens


def test_lazy_recompute_on_a_real_model(real_model, tmp_path: Path) -> None:
    lm = real_model("smollm2-135m")
    cases = synthetic_facts(1000)
    with LmdbStore(tmp_path / "store") as store:
        open_banks(store, TEST_BANK_CACHE).build("synthetic", [c.fact for c in cases])
        answerer = Answerer(lm, store)
        for case in cases[::100]:
            result = answerer.ask(Question(case.query, bank="synthetic", compare_rag=True, sampling=GREEDY))
            assert result.identical is True, case.query
            assert result.facts[0] == case.fact and result.pack_reused is False
        again = Answerer(lm, store).ask(Question(cases[0].query, bank="synthetic", sampling=GREEDY))
        assert again.pack_reused is True


def test_a_bank_on_the_mpnet_embedder_records_it_and_routes_with_it(tmp_path: Path) -> None:
    from packstore.errors import PackMismatch
    from tools.data.second_facts import second_facts

    cases = second_facts(200, seed=3)
    with LmdbStore(tmp_path / "store") as store:
        banks = open_banks(store, TEST_BANK_CACHE)
        meta = banks.build("mpnet", [c.fact for c in cases], "all-mpnet-base-v2")
        assert (meta.embedder, meta.dim, meta.lexical) == ("all-mpnet-base-v2", 768, "bm25s/en/snowball")
        routes = banks.route("mpnet", [c.question for c in cases[:40]], top_k=5)  # the bank's own embedder
        assert sum(r.facts[0][0] == c.fact for r, c in zip(routes, cases)) >= 38
        with pytest.raises(PackMismatch, match="embedder mismatch"):
            banks.route("mpnet", ["Who?"], "all-minilm-l6-v2")
