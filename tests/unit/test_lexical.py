"""The lexical index's imports: bm25s without JAX."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_index_never_starts_jax(tmp_path) -> None:
    """bm25s runs a JAX op when it is imported, which on a GPU host starts JAX's GPU client and reserves most of the
    GPU's memory: with a JAX installed, importing the lexical index must not import it."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise SystemExit('jax was imported')\n")
    probe = "import sys; import packstore.bank.lexical; assert 'jax' not in sys.modules; print('ok')"
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
