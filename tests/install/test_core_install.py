"""The core install (``pip install packstore``, no extras) runs packctl's store commands on a store the full
install wrote, and names the extra a command needs in one line; the core plus ``server`` (no torch) serves packs and
lexical bank routes, and answers what needs the model stack with MISSING_EXTRA. Each install is a fresh venv holding
this checkout alone (its build hook generates packstore/v1); commands run through the venv's own scripts. Slow (an
install each: about half a minute for the core, a minute with ``server``, pip's cache warm)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packstore.bank.bank import build_bank, open_banks
from packstore.bank.embedder import load_embedder
from packstore.errors import MissingExtra
from packstore.store import LmdbStore, open_store
from tests.store_commands import COMMANDS, NAME, make_store, output_of, store_argv
from tools.lib.servers import running_server

pytestmark = pytest.mark.install
REPO = Path(__file__).resolve().parents[2]
FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
MODEL_LIBRARIES = ("torch", "transformers", "sentence_transformers", "faiss", "grpc_tools")


def outside() -> dict[str, str]:
    """This environment without PYTHONPATH: the venvs' programs import their own install, never a source tree."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def install(root: Path, extras: str = "") -> Path:
    """A fresh venv under ``root`` holding a copy of this checkout's sources installed with ``extras``; its bin folder.
    None of the model libraries may come with it (nor grpcio-tools, which only the build needs)."""
    source = root / "source"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(REPO / "packstore", source / "packstore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(source / "packstore" / "v1", ignore_errors=True)  # generated: the build hook must make it, as in a fresh clone
    shutil.copytree(REPO / "protos", source / "protos")
    for name in FILES:
        shutil.copy2(REPO / name, source / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    spec = f"{source}[{extras}]" if extras else str(source)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", spec], capture_output=True, text=True, timeout=600, env=outside())
    assert done.returncode == 0, done.stderr[-4000:]
    probe = f"import importlib.util as u; print([m for m in {MODEL_LIBRARIES!r} if u.find_spec(m)])"
    found = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True, env=outside())
    assert found.stdout.strip() == "[]"
    return venv / "bin"


@pytest.fixture(scope="module")
def core_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install(tmp_path_factory.mktemp("core"))


@pytest.fixture(scope="module")
def server_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install(tmp_path_factory.mktemp("server"), "server")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    return make_store(tmp_path_factory.mktemp("written"))


@pytest.mark.parametrize("argv, check", COMMANDS)
def test_core_install_runs_store_command(core_bin: Path, written, tmp_path: Path, argv: list[str], check) -> None:
    store, key, file = written
    result = subprocess.run([str(core_bin / "packctl"), *store_argv(store, tmp_path, file, argv)], capture_output=True, text=True, env=outside())
    assert result.returncode == 0, result.stderr[-4000:]
    assert check(output_of(result.stdout), key)


@pytest.mark.parametrize(
    "argv, extra",
    [
        (["packctl", "build", "{tmp}/facts.txt", "--model", "smollm2-135m"], "model"),
        (["packctl", "--store", "s3://bucket/prefix", "ls"], "s3"),
        (["packstore", "serve", "--data", "{tmp}/served", "--listen", "127.0.0.1:0"], "server"),
    ],
    ids=["build", "s3", "serve"],
)
def test_core_install_names_the_missing_extra_in_one_line(core_bin: Path, tmp_path: Path, argv: list[str], extra: str) -> None:
    (tmp_path / "facts.txt").write_text("The mill Xyloquent was built by Ferro.\n")
    command = [str(core_bin / argv[0]), "--store", str(tmp_path / "store"), *(a.replace("{tmp}", str(tmp_path)) for a in argv[1:])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=outside())
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-4000:]
    assert result.stderr.startswith(f"{argv[0]}: error: ") and f"pip install 'packstore[{extra}]'" in result.stderr


def test_server_install_serves_packs_and_lexical_routes_without_torch(server_bin: Path, written, tmp_path: Path, monkeypatch) -> None:
    """A pack and a bank written by the full install, served by the torch-free one: the pack arrives byte for byte (a
    torch-free packctl exports it over gRPC), a lexical route is answered, a hybrid one is MISSING_EXTRA naming ``bank``."""
    original, key, file = written
    monkeypatch.delenv("PYTHONPATH", raising=False)  # running_server's program imports its own install
    data = shutil.copytree(original, tmp_path / "data")
    with LmdbStore(data) as store:
        build_bank(store, "b", ["The mill Xyloquent was built by Ferro.", "Rivers flow to the sea."], load_embedder())
    with running_server(data, packstore=server_bin / "packstore") as server:
        fetched = tmp_path / "fetched.pack"
        result = subprocess.run(
            [str(server_bin / "packctl"), "--store", server.url, "export", NAME, "-o", str(fetched)], capture_output=True, text=True, env=outside()
        )
        assert result.returncode == 0, result.stderr[-4000:]
        assert fetched.read_bytes() == file.read_bytes()
        with open_store(server.url) as remote:
            banks = open_banks(remote)
            [found] = banks.route("b", ["Xyloquent"], top_k=1, mode="lexical")
            assert found.facts[0][0] == "The mill Xyloquent was built by Ferro."
            with pytest.raises(MissingExtra) as raised:
                banks.route("b", ["Who built the mill?"], top_k=1)
            assert raised.value.fields["extra"] == "bank" and "pip install 'packstore[bank]'" in str(raised.value)
        assert server.process.poll() is None  # the refused call left it serving
