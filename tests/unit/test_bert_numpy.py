"""all-MiniLM-L6-v2 in NumPy (packstore.bank.bert_numpy): vectors equal to sentence-transformers' but for the last
bits, and a MiniLM bank routing by meaning, reranked, in a process where torch cannot be imported."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from packstore.bank.bank import open_banks
from packstore.bank.bert_numpy import NumpyBert, _erf, is_numpy_bert
from packstore.bank.embedder import NumpyEmbedder
from packstore.store import LmdbStore
from tests.helpers.banks import DESCRIBED_FACT, DESCRIBED_QUESTION, OTHER_FACTS, TEST_BANK_CACHE

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
TEXTS = [DESCRIBED_FACT, DESCRIBED_QUESTION, "a", (OTHER_FACTS[0] + " ") * 40]  # the last past the model's 256 tokens: cut as sentence-transformers cuts


def test_erf_is_within_its_bound() -> None:
    xs = np.linspace(-6, 6, 2001, dtype=np.float32)
    assert max(abs(float(found) - math.erf(float(x))) for x, found in zip(xs, _erf(xs))) < 2e-7


def test_numpy_vectors_equal_sentence_transformers_but_for_the_last_bits() -> None:
    reference = TEST_BANK_CACHE.embedder("all-minilm-l6-v2")
    assert is_numpy_bert(reference.directory)
    mine = NumpyEmbedder(reference.name, reference.directory)
    assert mine.fingerprint == reference.fingerprint and mine.dim == reference.dim == 384  # the same files: the same bank identity
    ours, theirs = mine.embed(TEXTS), reference.embed(TEXTS)
    assert ours.dtype == np.float32 and np.abs(ours - theirs).max() < 1e-5
    assert mine.embed([]).shape == (0, 384) and NumpyBert(reference.directory).embed(TEXTS[:1]).shape == (1, 384)


def test_only_plain_bert_directories_are_computed_in_numpy(tmp_path: Path) -> None:
    reference = TEST_BANK_CACHE.embedder("all-minilm-l6-v2")
    other = tmp_path / "roberta"
    other.mkdir()
    for name in ("modules.json", "model.safetensors"):
        (other / name).symlink_to(reference.directory / name)
    (other / "1_Pooling").mkdir()
    (other / "1_Pooling" / "config.json").symlink_to(reference.directory / "1_Pooling" / "config.json")
    config = json.loads((reference.directory / "config.json").read_text()) | {"model_type": "roberta"}
    (other / "config.json").write_text(json.dumps(config))
    assert not is_numpy_bert(other) and not is_numpy_bert(tmp_path / "absent")


def test_a_minilm_bank_routes_by_meaning_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    """The bank is built with sentence-transformers here; a process without torch routes it (hybrid, then the cross
    stage) with the NumPy BERT and finds the fact a question describes."""
    facts = [DESCRIBED_FACT, *OTHER_FACTS, *[f"Record {i}: the census of district {i} is number {i * 7}." for i in range(30)]]
    with LmdbStore(tmp_path / "store") as store:
        open_banks(store, TEST_BANK_CACHE).build("b", facts)
    script = f"""
import importlib.abc, importlib.util, sys
HIDDEN = ("torch", "sentence_transformers", "transformers")
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
import packstore.extras
real = importlib.util.find_spec
packstore.extras.importlib.util.find_spec = lambda name, *a: None if name.partition(".")[0] in HIDDEN else real(name, *a)
from pathlib import Path
from packstore.bank.bank import BankCache, open_banks
from packstore.store import LmdbStore
cache = BankCache()
with LmdbStore(Path({str(tmp_path / 'store')!r})) as store:
    banks = open_banks(store, cache)
    [route] = banks.route("b", [{DESCRIBED_QUESTION!r}], top_k=2, rerank="cross")
print(type(cache.embedder("all-minilm-l6-v2")).__name__, route.reranker)
print(route.facts[0][0])
assert not any(m.partition(".")[0] in HIDDEN for m in sys.modules), "torch was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["NumpyEmbedder cross", DESCRIBED_FACT]
