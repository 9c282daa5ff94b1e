"""A pack built locally with smollm2-135m, uploaded to the service, answered through the worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packstore.answering.answer import Question
from packstore.cli.packctl import main as packctl
from packstore.errors import PackMismatch
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.packs.tensors import encode_pack
from packstore.store.remote.store import RemoteStore
from packstore.worker.client import WorkerClient
from tests.helpers.real_models import WORKER_FLAGS, eval_rows, fact_sets
from tools.lib.servers import running_server, running_worker

pytestmark = [pytest.mark.model, pytest.mark.service]
GREEDY = Sampling(max_new_tokens=12)  # token-for-token checks: a divergence shows within the first tokens


@pytest.mark.usefixtures("packctl_on_loaded_models")
def test_upload_and_answer_through_the_worker(real_model, model_service, tmp_path: Path, monkeypatch, capsys) -> None:
    """packctl (its main, in this process, on the run's loaded model) builds into the service named by $PACKSTORE_STORE;
    the worker answers from it."""
    lm = real_model("smollm2-135m")
    facts, rows = fact_sets(lm.tokenizer, eval_rows())[0]
    server, worker = model_service("smollm2-135m")  # shared: the names here are this test's alone
    monkeypatch.setenv("PACKSTORE_STORE", server.url)
    facts_file = tmp_path / "facts.jsonl"
    facts_file.write_text("".join(json.dumps({"text": f}) + "\n" for f in facts))
    assert packctl(["build", str(facts_file), "--model", "smollm2-135m", "--name", "ckc", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] >= 500
    with WorkerClient(worker.address) as client:
        for row in rows:
            result = client.ask(Question(row["question"], refs=("ckc",), sampling=GREEDY, compare_rag=True))
            assert result.identical is True, row["question"]
            assert result.rag_prompt_tokens - result.kv_prompt_tokens >= 500

        gemma = real_model("gemma3-270m")
        with RemoteStore(server.url) as remote:
            remote.put(encode_pack(build_pack(gemma, facts[:1])), name="gemma-pack")
        with pytest.raises(PackMismatch, match="model mismatch"):
            client.ask(Question(rows[0]["question"], refs=("gemma-pack",), sampling=GREEDY))


def test_a_worker_joining_planes_on_its_device_answers_the_same(real_model, tmp_path: Path) -> None:
    """``--plane-join device``: packs from the store are joined by torch on the model's device (here the CPU), and the
    answers are still token for token those with the facts as text."""
    lm = real_model("smollm2-135m")
    facts, rows = fact_sets(lm.tokenizer, eval_rows())[0]
    with running_server(tmp_path / "data") as server:
        with RemoteStore(server.url) as remote:
            remote.put(encode_pack(build_pack(lm, facts)), name="ckc")
        with running_worker(server.url, "smollm2-135m", tmp_path, *WORKER_FLAGS, "--plane-join", "device") as worker, WorkerClient(worker.address) as client:
            for row in rows[:2]:
                result = client.ask(Question(row["question"], refs=("ckc",), sampling=GREEDY, compare_rag=True))
                assert result.identical is True, row["question"]
