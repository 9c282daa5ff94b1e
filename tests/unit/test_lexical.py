"""The lexical index: bm25s imported without JAX, and the documents holding a query's rarest terms (the pool a bank
route widens with, issue 66)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from packstore.bank.lexical import LexicalIndex
from packstore.format.bank import Cluster


def test_the_index_never_starts_jax(tmp_path) -> None:
    """bm25s runs a JAX op when it is imported, which on a GPU host starts JAX's GPU client and reserves most of the
    GPU's memory: with a JAX installed, importing the lexical index, building one and scoring with it must not import
    it (bm25s is imported at first use, with JAX hidden)."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise SystemExit('jax was imported')\n")
    probe = (
        "import sys\n"
        "import numpy as np\n"
        "from packstore.bank.lexical import LexicalIndex\n"
        "from packstore.format.bank import Cluster\n"
        "texts = ['The mill Xyloquent was built by Ferro.', 'Rivers flow to the sea.']\n"
        "cluster = Cluster(ids=np.arange(2, dtype=np.uint32), embeddings=np.zeros((2, 4), dtype=np.float16), texts=texts)\n"
        "assert LexicalIndex.build({0: cluster}, 1).scores('Xyloquent').argmax() == 0\n"
        "assert 'bm25s' in sys.modules and 'jax' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def _index(texts: list[str]) -> LexicalIndex:
    cluster = Cluster(ids=np.arange(len(texts), dtype=np.uint32), embeddings=np.zeros((len(texts), 4), dtype=np.float16), texts=texts)
    return LexicalIndex.build({0: cluster}, 1)


def test_the_rarest_terms_documents_come_whole_while_they_fit() -> None:
    """"zorvath" is in 3 documents, "lamp" in 6: with room for 5, the 3 holding the rarest term, then the 2 best by
    the query's BM25 of those holding the next; a stopword or an unknown word adds nothing."""
    texts = [f"A lamp numbered {i} hangs in the hall of lamps, lamp {i}." for i in range(4)]
    texts += ["The Zorvath lantern rests on a shelf.", "Zorvath harbour has a lamp.", "Zorvath lamp, the lamp of lamps.",
              "Rivers flow to the sea."]
    index = _index(texts)
    scores = index.scores("Which lamp is kept in Zorvath?")
    found = index.rare_term_documents("Which lamp is kept in Zorvath?", scores, 5)
    assert sorted(found[:3].tolist()) == [4, 5, 6] and len(found) == 5
    lamp_only = list(range(4))
    assert set(found[3:].tolist()) <= set(lamp_only)
    assert set(found[3:].tolist()) == set(np.array(lamp_only)[np.argsort(-scores[lamp_only], kind="stable")[:2]].tolist())
    assert sorted(index.rare_term_documents("Which lamp is kept in Zorvath?", scores, 100).tolist()) == [0, 1, 2, 3, 4, 5, 6]
    assert index.rare_term_documents("Which lamp is kept in Zorvath?", scores, 0).size == 0
    assert index.rare_term_documents("the qwertyuiop", index.scores("the qwertyuiop"), 10).size == 0


def test_a_rare_term_that_does_not_fit_gives_its_best_by_bm25() -> None:
    texts = [f"Zorvath {'lamp ' * (i % 3)}note {i}" for i in range(10)]
    index = _index(texts)
    scores = index.scores("Zorvath lamp")
    found = index.rare_term_documents("Zorvath lamp", scores, 3)  # "lamp" (in 6) is the rarer; 3 of its best
    assert len(found) == 3 and all("lamp" in texts[d] for d in found)
    assert scores[found].min() >= np.sort(scores[[d for d in range(10) if "lamp" in texts[d]]])[-3]
