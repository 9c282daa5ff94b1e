"""The exactness a pack promises (issue 36) on smollm2-135m over real ckc paragraphs: its answer is that of its
text prefilled in the pack's recorded passes, then the question (``chunked_identical``), for a build, an exact
composition made on the fly or stored, and an erratum; unknown (None) for a RoPE splice, which is no prefill of
its text. On CUDA the same holds in bfloat16 and float32 (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from packstore.answering.answer import Answerer, Question
from packstore.answering.api import amend_and_store, build_and_store, compose_and_store
from packstore.kv.build import PREFILL_CHUNK_TOKENS
from packstore.kv.exactness import machine
from packstore.kv.inject import Sampling
from packstore.kv.models import LoadedModel, load_model
from packstore.store import LmdbStore
from tests.helpers.real_models import eval_rows

pytestmark = pytest.mark.model
GREEDY = Sampling(max_new_tokens=12)  # token-for-token checks: a divergence shows within the first tokens
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smol(real_model) -> LoadedModel:
    return real_model(MODEL, device="cpu")


def ask(answerer: Answerer, refs: tuple[str, ...], rows: list[dict], sampling: Sampling = GREEDY):
    return [answerer.ask(Question(row["question"], refs=refs, compare_rag=True, sampling=sampling)) for row in rows]


def test_plain_and_exact_compositions_answer_as_their_text_prefilled_in_their_passes(smol, tmp_path: Path) -> None:
    rows = eval_rows()[:9]
    with LmdbStore(tmp_path / "store") as store:
        answerer = Answerer(smol, store)
        plain, _ = build_and_store(store, smol, [row["context"] for row in rows[:6]], name="plain")
        passes = plain.header.prefill_chunks
        assert plain.header.tokens > PREFILL_CHUNK_TOKENS and passes[:2] == (0, PREFILL_CHUNK_TOKENS) and passes[-1] == plain.header.tokens
        assert plain.header.built_on == {**machine(torch.device("cpu")), "dtype": "float32"} and plain.header.built_on["torch"]
        results = ask(answerer, ("plain",), rows[:3])
        assert all(r.chunked_identical is True and r.identical is True for r in results)  # CPU float32: one pass agrees too

        build_and_store(store, smol, [row["context"] for row in rows[6:]], name="later")
        stored, _, composition = compose_and_store(store, smol, ["plain", "later"], name="composed")
        assert composition is not None and composition.reused_tokens >= plain.header.tokens - 8
        assert stored.header.prefill_chunks[: len(passes) - 1] == passes[:-1]
        assert all(r.chunked_identical is True for r in ask(answerer, ("composed",), rows[5:8]))
        assert all(r.chunked_identical is True for r in ask(Answerer(smol, store), ("plain", "later"), rows[6:8]))  # on the fly
        amend_and_store(store, smol, "composed", "The figures above are from the 2020 census.", name="amended")
        assert all(r.chunked_identical is True for r in ask(answerer, ("amended",), rows[:2]))

        rope, _, _ = compose_and_store(store, smol, ["plain", "later"], mode="rope", name="rope")
        assert rope.header.prefill_chunks is None
        assert all(r.chunked_identical is None and isinstance(r.identical, bool) for r in ask(answerer, ("rope",), rows[6:8]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_cuda_a_pack_answers_as_its_text_prefilled_in_its_passes(dtype: str, tmp_path: Path) -> None:
    lm = load_model(MODEL, device="cuda", dtype=dtype, progress=False)
    rows = eval_rows()[:8]
    with LmdbStore(tmp_path / "store") as store:
        stored, _ = build_and_store(store, lm, [row["context"] for row in rows], name="plain")
        built_on = stored.header.built_on  # the GPU model, capability, SM count, torch and CUDA versions (format version 6)
        assert built_on == {**machine(lm.device), "dtype": dtype} and built_on["gpu"] == torch.cuda.get_device_name(lm.device)
        assert built_on["sms"] == torch.cuda.get_device_properties(lm.device).multi_processor_count and built_on["cuda"] == torch.version.cuda
        assert len(stored.header.prefill_chunks) > 2
        results = ask(Answerer(lm, store), ("plain",), rows[:4], Sampling(max_new_tokens=64))
    assert [r.chunked_identical for r in results] == [True] * 4, [(r.answer, r.rag_answer) for r in results]
