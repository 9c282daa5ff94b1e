"""KV Packet on both real models: an adapter trained through packctl, packet compositions through the
service and the worker, and selective recompute spanning the RoPE splice to full recompute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.cli.packctl import main as packctl
from packstore.kv.blend import selective_recompute
from packstore.kv.build import build_pack
from packstore.kv.compose import compose_exact, splice
from packstore.kv.inject import Sampling
from packstore.kv.packet import generated_examples
from packstore.packs.tensors import encode_pack
from packstore.store.remote.store import RemoteStore
from packstore.worker.client import WorkerClient
from tests.helpers.real_models import MODELS, eval_rows

pytestmark = [pytest.mark.model, pytest.mark.service]
GREEDY = Sampling(max_new_tokens=12)


@pytest.fixture(scope="module", params=MODELS)
def real_lm(request, real_model):
    return real_model(request.param)


@pytest.mark.usefixtures("packctl_on_loaded_models")
def test_adapter_training_and_packet_compositions_through_the_service_and_worker(real_lm, model_service, tmp_path: Path, capsys) -> None:
    data = tmp_path / "examples.jsonl"
    data.write_text("".join(json.dumps({"documents": ["\n".join(d) for d in e.documents], "question": e.question}) + "\n" for e in generated_examples(6)))
    rows = eval_rows()[26:29]  # long paragraphs the compose test does not use: on the shared service the same text is the same pack
    server, worker = model_service(real_lm.name)  # shared: the names here are this test's alone
    store = ["--store", server.url]
    assert packctl([*store, "adapter", "train", "--model", real_lm.name, "--name", "pk", "--data", str(data), "--steps", "1", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    hidden = real_lm.model.get_input_embeddings().weight.shape[1]
    assert trained["kind"] == "adapter" and trained["recipe"]["hidden_size"] == hidden and trained["metrics"]["train_seconds"] > 0
    with RemoteStore(server.url) as remote:
        keys = [remote.put(encode_pack(build_pack(real_lm, [row["context"]])), name=f"p{i}")[0] for i, row in enumerate(rows)]
    assert packctl([*store, "compose", "p0", "p1", "p2", "--mode", "packet", "--adapter", "pk", "--name", "pkt", "--json"]) == 0
    composed = json.loads(capsys.readouterr().out)
    assert composed["parents"] == keys + [trained["key"]] and composed["composition"] == "packet"
    assert composed["reused_tokens"] > 10 * composed["prefilled_tokens"]  # no part recomputed: framing and 5 x 4 soft tokens only
    question = Question(rows[1]["question"], refs=("p0", "p1", "p2"), mode="packet", adapter="pk", sampling=GREEDY, compare_rag=True)
    with RemoteStore(server.url) as remote:
        local = Answerer(real_lm, remote).ask(question)
    assert local.pack == composed["key"] and local.answer
    with WorkerClient(worker.address) as client:
        remote_result = client.ask(question)
        assert (remote_result.pack, remote_result.answer, remote_result.identical) == (local.pack, local.answer, local.identical)
        assert client.ask(Question(rows[1]["question"], refs=("pkt",), sampling=GREEDY)).answer == local.answer


def test_selective_recompute_spans_the_splice_to_full_recompute(real_lm) -> None:
    rows = eval_rows()[:3]
    parts = [build_pack(real_lm, [row["context"]]) for row in rows]
    rope = splice(real_lm, parts, "rope").pack
    exact = compose_exact(real_lm, parts[0], [p.header for p in parts[1:]]).pack
    everything = selective_recompute(real_lm, rope, share=1.0)
    gap = max((everything.cache.layers[i].values[0] - exact.values[i]).abs().max().item() for i in range(len(exact.values)))
    assert gap < 1e-3
    some = selective_recompute(real_lm, rope, share=0.15)
    assert len(some.recomputed) == -(-rope.header.tokens * 15 // 100)
