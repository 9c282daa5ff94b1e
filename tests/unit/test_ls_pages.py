"""``packctl ls`` lists one page by default (a large store lists in seconds, a page in milliseconds):
the next page through ``--page-token``, everything with ``--all``, and the cursor in the JSON."""

from __future__ import annotations

import json

import pytest

from packstore.cli.packctl import main as packctl
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.protocol import DEFAULT_PAGE
from tests.helpers.packs import make_pack

PACKS = DEFAULT_PAGE + 3


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """A store of one default page and three packs more, and their keys in key order."""
    path = tmp_path_factory.mktemp("ls") / "store"
    with LmdbStore(path) as opened:
        keys = sorted(opened.put(encode_pack(make_pack(layers=1, tokens=n, heads=1, dim=2)))[0] for n in range(1, PACKS + 1))
    return str(path), keys


def ls(capsys: pytest.CaptureFixture, store: str, *argv: str) -> tuple[int, str, str]:
    code = packctl(["--store", store, "ls", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_prints_the_first_page_and_how_to_get_the_next(store: tuple[str, list[str]], capsys: pytest.CaptureFixture) -> None:
    path, keys = store
    code, out, err = ls(capsys, path, "--json")
    first = json.loads(out)
    assert code == 0 and [p["key"] for p in first["packs"]] == keys[:DEFAULT_PAGE]
    assert first["next_page_token"] == keys[DEFAULT_PAGE - 1] and f"--page-token {first['next_page_token']}" in err and "--all" in err

    code, out, err = ls(capsys, path, "--json", "--page-token", first["next_page_token"])
    last = json.loads(out)
    assert code == 0 and [p["key"] for p in last["packs"]] == keys[DEFAULT_PAGE:] and last["next_page_token"] == "" and err == ""

    code, out, _ = ls(capsys, path, "--limit", "2", "--after", keys[0])  # --after: the older spelling
    assert code == 0 and out.splitlines()[0].startswith("NAME") and len(out.splitlines()) == 3

    code, out, err = ls(capsys, path)
    assert code == 0 and len(out.splitlines()) == 1 + DEFAULT_PAGE and "more packs follow" in err


def test_ls_all_lists_every_pack(store: tuple[str, list[str]], capsys: pytest.CaptureFixture) -> None:
    path, keys = store
    code, out, err = ls(capsys, path, "--all", "--json")
    every = json.loads(out)
    assert code == 0 and [p["key"] for p in every["packs"]] == keys and every["next_page_token"] == "" and err == ""
    code, out, _ = ls(capsys, path, "--all")
    assert code == 0 and len(out.splitlines()) == 1 + PACKS

    code, _, err = ls(capsys, path, "--all", "--limit", "5")
    assert code == 1 and "--all" in err and err.count("\n") == 1
    code, _, err = ls(capsys, path, "--limit", "0")
    assert code == 1 and "page size 0" in err
