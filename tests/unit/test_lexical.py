"""The lexical index's imports: bm25s without JAX."""

from __future__ import annotations

import subprocess
import sys


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
