"""A command that needs an extra this installation lacks ends in one line naming it (issue 55 item 8), and the table
of extras behind that line (packstore.extras) says what pyproject.toml says. A core install is simulated by hiding the
modules of every extra (``sys.modules[name] = None`` makes their import fail) in a fresh interpreter."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest

from packstore.errors import MissingExtra
from packstore.extras import EXTRA_MODULES, INCLUDED, check_extra, missing_extra, require_extra

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = sorted(module for modules in EXTRA_MODULES.values() for module in modules)


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]).lower()


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_table_names_each_extras_packages_and_inclusions() -> None:
    providers = {module: {_name(d) for d in dists} for module, dists in packages_distributions().items()}
    for extra, modules in EXTRA_MODULES.items():
        listed = {_name(r) for r in _extras()[extra] if not r.startswith("packstore[")}
        needed = listed | {_name(r) for dist in listed for r in requires(dist) or () if "extra ==" not in r}
        assert INCLUDED.get(extra, ()) == tuple(
            part for r in _extras()[extra] if r.startswith("packstore[") for part in r[len("packstore[") : -1].split(",")
        ), extra
        for module in modules:
            assert providers[module] & needed, f"{module} ({providers[module]}) is not installed by the {extra!r} extra"
        for dist in listed:
            assert any(dist in providers.get(module, ()) for module in modules), f"{dist} of {extra!r} provides no module in the table"
    assert set(_extras()["all"][0][len("packstore[") : -1].split(",")) == set(EXTRA_MODULES)


def test_require_extra_names_the_extra_and_the_module_missing(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "Stemmer", None)
    with pytest.raises(MissingExtra) as raised:
        require_extra("Stemmer", "lexical")
    assert raised.value.fields == {"extra": "lexical", "module": "Stemmer"}
    assert str(raised.value) == "Stemmer is not installed: this needs packstore's 'lexical' extra (pip install 'packstore[lexical]')"
    (tmp_path / "needs_faiss.py").write_text("import faiss\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(MissingExtra, match=r"^faiss is not installed: .*'bank' extra"):
        require_extra("needs_faiss", "bank")


def test_check_extra_covers_the_extras_an_extra_includes(monkeypatch) -> None:
    check_extra("bank")  # the full install
    monkeypatch.setitem(sys.modules, "bm25s", None)
    with pytest.raises(MissingExtra) as raised:
        check_extra("bank")
    assert raised.value.fields == {"extra": "bank", "module": "bm25s"}


def test_a_missing_module_of_no_extra_is_not_an_extra() -> None:
    assert missing_extra(ModuleNotFoundError("No module named 'nonesuch'", name="nonesuch")) is None
    assert missing_extra(ModuleNotFoundError("No module named 'torch.cuda'", name="torch.cuda")).fields["extra"] == "model"


PROBE = """
import contextlib, io, json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
from packstore.cli import packctl, packstore_main
programs = {"packctl": packctl.main, "packstore": packstore_main.main}
results = []
for program, *argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = programs[program](argv)
        except BaseException as exc:
            rc = f"raised {type(exc).__name__}: {exc}"
    results.append([rc, err.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def with_bank(tmp_path_factory) -> Path:
    """A store holding bank "b" (built with the full install)."""
    from packstore.bank.bank import build_bank
    from packstore.bank.embedder import load_embedder
    from packstore.store import LmdbStore

    path = tmp_path_factory.mktemp("extras") / "store"
    with LmdbStore(path) as store:
        build_bank(store, "b", ["The mill Xyloquent was built by Ferro.", "Rivers flow to the sea."], load_embedder())
    return path


def test_each_command_needing_an_extra_ends_in_one_line_naming_it(with_bank: Path, tmp_path: Path) -> None:
    facts = tmp_path / "facts.txt"
    facts.write_text("The mill Xyloquent was built by Ferro.\n")
    store = ["--store", str(with_bank)]
    cases = [
        (["packctl", *store, "build", str(facts), "--model", "smollm2-135m"], "model"),
        (["packctl", *store, "ask", "x", "a question", "--model", "smollm2-135m"], "model"),
        (["packctl", *store, "compose", "a", "b", "--model", "smollm2-135m"], "model"),
        (["packctl", "--store", "s3://bucket/prefix", "ls"], "s3"),
        (["packctl", *store, "bank", "build", str(facts), "--name", "c"], "bank"),
        (["packctl", *store, "bank", "route", "b", "Xyloquent"], "bank"),
        (["packctl", *store, "bank", "route", "b", "Xyloquent", "--mode", "lexical"], "lexical"),
        (["packstore", "serve", "--data", str(tmp_path / "served"), "--listen", "127.0.0.1:0"], "server"),
        (["packstore", "worker", "--model", "smollm2-135m", *store], "model"),
        (["packstore", "info"], "model"),
    ]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HIDDEN), json.dumps([argv for argv, _ in cases])],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for (argv, extra), (rc, stderr) in zip(cases, json.loads(result.stdout.splitlines()[-1])):
        assert rc == 1 and stderr.count("\n") == 1, (argv, rc, stderr)
        assert stderr.startswith(f"{argv[0]}: error: ") and f"pip install 'packstore[{extra}]'" in stderr, (argv, stderr)
