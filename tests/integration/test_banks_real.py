"""Banks with lazy recompute on smollm2-135m: answers identical to the same facts as prompt text."""

from __future__ import annotations

from pathlib import Path

import pytest

from packstore.answer import Answerer, Question
from packstore.bank.synthetic import synthetic_facts
from packstore.kv.inject import Sampling
from packstore.kv.models import load_model
from packstore.store import LmdbStore

pytestmark = pytest.mark.integration


def test_lazy_recompute_on_a_real_model(tmp_path: Path) -> None:
    lm = load_model("smollm2-135m", progress=False)
    cases = synthetic_facts(1000)
    with LmdbStore(tmp_path / "store") as store:
        store.banks().build("synthetic", [c.fact for c in cases])
        answerer = Answerer(lm, store)
        for case in cases[::100]:
            result = answerer.ask(Question(case.query, bank="synthetic", compare_rag=True, sampling=Sampling(max_new_tokens=24)))
            assert result.identical is True, case.query
            assert result.facts[0] == case.fact and result.pack_reused is False
        again = Answerer(lm, store).ask(Question(cases[0].query, bank="synthetic", sampling=Sampling(max_new_tokens=24)))
        assert again.pack_reused is True
