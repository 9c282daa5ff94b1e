"""packctl's store commands as the torch-free tests run them: a store with one pack written by the full
install (this test process), and each command's argv with a check of its JSON output."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from packstore.packs.admin import export_pack
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from tests.helpers.packs import make_pack

NAME = "light"


def make_store(root: Path) -> tuple[Path, str, Path]:
    """A store under ``root`` holding one named pack, and that pack as a pack file: (store, key, file)."""
    with LmdbStore(root / "store") as store:
        key, _ = store.put(encode_pack(make_pack(tokens=24)), name=NAME)
        export_pack(store, key, root / "light.pack")
    return root / "store", key, root / "light.pack"


Check = Callable[[Any, str], bool]
# (argv after --store STORE --json, with {tmp} and {file} filled in; what the JSON output must satisfy given the key)
COMMANDS: list[Any] = [
    pytest.param(["ls"], lambda out, key: [r["key"] for r in out["packs"]] == [key] and out["next_page_token"] == "", id="ls"),
    pytest.param(["inspect", NAME], lambda out, key: out["key"] == key and out["facts"], id="inspect"),
    pytest.param(["verify"], lambda out, key: out == [{"key": key, "ok": True, "error": None}], id="verify"),
    pytest.param(["export", NAME, "-o", "{tmp}/out.pack"], lambda out, key: out["key"] == key and out["bytes"] > 0, id="export"),
    pytest.param(["import", "{file}", "--name", "again"], lambda out, key: out["key"] == key and out["created_new"] is False, id="import"),
    pytest.param(["rm", NAME], lambda out, key: out == {"removed": [key]}, id="rm"),
    pytest.param(["gc"], lambda out, key: out["orphan_chunks"] == 0, id="gc"),
    pytest.param(["backup", "{tmp}/copy"], lambda out, key: out["namespaces"]["default"]["packs"] == 1, id="backup"),
    pytest.param(["migrate", "--to", "{tmp}/moved"], lambda out, key: out["packs"] == out["copied"] == 1, id="migrate"),
]


def store_argv(original: Path, tmp: Path, file: Path, argv: list[str]) -> list[str]:
    """packctl's full argv for one command on a private copy of the store at ``original`` (commands change it)."""
    store = shutil.copytree(original, tmp / "store")
    return ["--store", str(store), "--json", *(a.replace("{tmp}", str(tmp)).replace("{file}", str(file)) for a in argv)]


def output_of(stdout: str) -> Any:
    """The one JSON document a command printed."""
    return json.loads(stdout)
