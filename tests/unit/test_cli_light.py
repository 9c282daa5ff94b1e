"""packctl's store commands never import torch, transformers, sentence-transformers or faiss: each runs in
a fresh interpreter, which then must not hold them (the full install is present, so only imports count)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.store_commands import COMMANDS, make_store, output_of, store_argv

HEAVY = ("torch", "transformers", "sentence_transformers", "faiss")
PROBE = f"""
import sys
from packstore.cli.packctl import main
rc = main(sys.argv[1:])
heavy = [name for name in {HEAVY!r} if name in sys.modules]
sys.exit(f"exit code {{rc}}, imported {{heavy}}" if rc or heavy else 0)
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    return make_store(tmp_path_factory.mktemp("written"))


@pytest.mark.parametrize("argv, check", COMMANDS)
def test_store_command_imports_no_model_library(written, tmp_path: Path, argv: list[str], check) -> None:
    store, key, file = written
    result = subprocess.run([sys.executable, "-c", PROBE, *store_argv(store, tmp_path, file, argv)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert check(output_of(result.stdout), key)
