"""The core install (``pip install packstore``, no extras) runs packctl's store commands on a store the full
install wrote: a fresh venv gets this checkout alone (its build hook generates packstore/v1), then each
command runs through the venv's own ``packctl``. Slow (an install, about half a minute with pip's cache warm)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.store_commands import COMMANDS, make_store, output_of, store_argv

pytestmark = pytest.mark.install
REPO = Path(__file__).resolve().parents[2]
FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


@pytest.fixture(scope="module")
def core_packctl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``packctl`` of a fresh venv holding the core install of a copy of this checkout's sources."""
    root = tmp_path_factory.mktemp("core")
    source = root / "source"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(REPO / "packstore", source / "packstore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(source / "packstore" / "v1", ignore_errors=True)  # generated: the build hook must make it, as in a fresh clone
    shutil.copytree(REPO / "protos", source / "protos")
    for name in FILES:
        shutil.copy2(REPO / name, source / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(source)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-4000:]
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; print([m for m in ('torch', 'transformers', 'grpc_tools') if u.find_spec(m)])"], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"  # the core pulls in no model library, and needs no grpcio-tools to run
    return venv / "bin" / "packctl"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    return make_store(tmp_path_factory.mktemp("written"))


@pytest.mark.parametrize("argv, check", COMMANDS)
def test_core_install_runs_store_command(core_packctl: Path, written, tmp_path: Path, argv: list[str], check) -> None:
    store, key, file = written
    result = subprocess.run([str(core_packctl), *store_argv(store, tmp_path, file, argv)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert check(output_of(result.stdout), key)
