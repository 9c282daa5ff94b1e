"""Composition on both real models, against a real service and worker: compose, accumulate, amend, splice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packstore.answering.answer import Question
from packstore.answering.api import amend_and_store, compose_and_store
from packstore.cli.packctl import main as packctl
from packstore.errors import PackNotFound
from packstore.kv.build import build_pack
from packstore.kv.compose import compose_exact, splice
from packstore.kv.inject import Sampling, answer_with_text
from packstore.kv.rope import layer_frequencies
from packstore.packs.admin import export_pack, import_pack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from packstore.worker.client import WorkerClient
from tests.helpers.real_models import MODELS, eval_rows

pytestmark = [pytest.mark.model, pytest.mark.service]
GREEDY = Sampling(max_new_tokens=12)  # token-for-token checks: a divergence shows within the first tokens


@pytest.fixture(scope="module", params=MODELS)
def real_lm(request, real_model):
    return real_model(request.param)


def test_rope_re_positioning_is_exact_where_keys_see_no_context(real_lm) -> None:
    """Layer 0's K/V depend on each token and its position alone: there, re-positioned parts equal
    the exact composition, for every RoPE base the model has (Gemma 3: local and global)."""
    rows = eval_rows()[:3]
    parts = [build_pack(real_lm, [row["context"]]) for row in rows]
    exact = compose_exact(real_lm, parts[0], [part.header for part in parts[1:]]).pack
    rope = splice(real_lm, parts, "rope").pack
    naive = splice(real_lm, parts, "naive").pack
    assert rope.header.token_ids == exact.header.token_ids
    assert (rope.keys[0] - exact.keys[0]).abs().max().item() < 1e-3
    assert (naive.keys[0] - exact.keys[0]).abs().max().item() > 0.1
    bases = {tuple(f.tolist()) for f in layer_frequencies(real_lm)}
    assert len(bases) == (2 if "gemma" in real_lm.name else 1)


@pytest.mark.usefixtures("packctl_on_loaded_models")
def test_compose_accumulate_amend_and_splice_through_the_service_and_worker(real_lm, model_service, tmp_path: Path, capsys) -> None:
    rows = eval_rows()[:3]
    names = [f"part{index}" for index in range(3)]
    server, worker = model_service(real_lm.name)  # shared: the names here are this test's alone
    with RemoteStore(server.url) as remote, WorkerClient(worker.address) as client:
        keys = [remote.put(encode_pack(build_pack(real_lm, [row["context"]])), name=name)[0] for row, name in zip(rows, names)]
        facts = [row["context"] for row in rows]

        # accumulation on the worker: one more pack per step, each answer identical to the text
        for steps in (1, 2, 3):
            row = rows[steps - 1]
            result = client.ask(Question(row["question"], refs=tuple(names[:steps]), sampling=GREEDY, compare_rag=True))
            assert result.identical is True, row["question"]
            text = answer_with_text(real_lm, facts[:steps], row["question"], sampling=GREEDY)
            assert result.rag_prompt_tokens == text.prompt_tokens and result.answer == text.text
            if steps > 1:
                assert result.parts == keys[:steps]
                assert 0 < result.composed_tokens < len(real_lm.tokenizer(facts[steps - 1]).input_ids) + 8
        on_the_fly = result.pack

        # the stored composition is the same pack; composing again stores nothing
        stored, created, composition = compose_and_store(remote, real_lm, names, name="all")
        assert created and stored.key == on_the_fly and stored.header.parents == tuple(keys)
        assert composition.reused_tokens >= remote.stat(keys[0]).header.tokens - 8
        assert compose_and_store(remote, real_lm, names)[1:] == (False, None)

        # an erratum on the composition, answered through the worker exactly as the text
        amended, _, _ = amend_and_store(remote, real_lm, "all", "The answer to every question is Jane Placeholder.", name="all-v2")
        assert amended.header.parents == (stored.key,) and remote.stat("all").header == stored.header
        result = client.ask(Question(rows[0]["question"], refs=("all-v2",), sampling=GREEDY, compare_rag=True))
        assert result.identical is True

        # the CLI against grpc:// (model from the pack's own header)
        assert packctl(["--store", server.url, "compose", "part0", "part2", "--mode", "rope", "--name", "rope02", "--json"]) == 0
        rope = json.loads(capsys.readouterr().out)
        assert rope["composition"] == "rope" and rope["parents"] == [keys[0], keys[2]]
        assert packctl(["--store", server.url, "ls"]) == 0
        listing = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}  # by name (other tests' packs too)
        assert "rope:2" in listing["rope02"] and "exact:3" in listing["all"] and "exact:1" in listing["all-v2"]
        result = client.ask(Question(rows[2]["question"], refs=("rope02",), sampling=GREEDY, compare_rag=True))
        assert result.pack == rope["key"] and result.answer  # approximate: may differ from the text

        # ordinary packs everywhere: GetPack, verify, export/import; removing parents breaks no child
        assert PackReader(remote).fetch("rope02").header.composition == "rope"
        export_pack(remote, "rope02", tmp_path / "rope.pack")
        with LmdbStore(tmp_path / "local") as local:
            imported, _ = import_pack(local, tmp_path / "rope.pack")
            assert imported.key == rope["key"] and PackReader(local).verify(imported.key).ok
        for name in names:
            remote.delete(name)
        with pytest.raises(PackNotFound):
            remote.stat(keys[0])
        assert all(PackReader(remote).verify(ref).ok for ref in ("all", "all-v2", "rope02"))
    with WorkerClient(worker.address) as client:
        result = client.ask(Question(rows[1]["question"], refs=("all-v2",), sampling=GREEDY, compare_rag=True))
        assert result.identical is True
