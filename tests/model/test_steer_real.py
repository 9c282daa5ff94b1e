"""Steering packs on both real models, through packctl and through a real service and worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.cli.packctl import main as packctl
from packstore.kv.inject import Sampling
from packstore.kv.options import middle_third
from packstore.store import LmdbStore
from packstore.worker.client import WorkerClient
from tests.helpers.real_models import MODELS, eval_rows

pytestmark = [pytest.mark.model, pytest.mark.service]
PAIRS = Path(__file__).resolve().parents[2] / "tools" / "data" / "steering" / "sentiment_pairs.jsonl"
GREEDY = Sampling(max_new_tokens=16)


@pytest.fixture(scope="module", params=MODELS)
def real_lm(request, real_model):
    return real_model(request.param)


@pytest.mark.usefixtures("packctl_on_loaded_models")
def test_steer_build_ask_alone_and_with_a_pack_via_cli_and_worker(real_lm, model_service, tmp_path: Path, capsys) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:8]))
    row = eval_rows()[5]  # no other test on the shared service builds this row's pack: both packs are new to its worker
    facts = tmp_path / "facts.txt"
    facts.write_text(row["context"] + "\n")
    model = ["--model", real_lm.name]
    server, worker = model_service(real_lm.name)
    store = ["--store", server.url]
    assert packctl([*store, "steer", "build", str(pairs), *model, "--name", "joy", "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    layers = real_lm.model.config.get_text_config().num_hidden_layers
    assert built["kind"] == "steering" and built["tokens"] == 0 and built["pairs"] == 8
    assert packctl([*store, "inspect", "joy", "--json"]) == 0
    details = json.loads(capsys.readouterr().out)
    assert details["steer_layers"] == [0, layers - 1] and details["default_layers"] == list(middle_third(layers))
    # Layer 0's values depend on the last token alone, the same punctuation in both sides of
    # every pair here, so its delta is zero; every later layer has seen the whole text.
    assert details["norms"][0]["value_norm"] < 1e-3
    assert all(norm["value_norm"] > 0 for norm in details["norms"][1:])
    assert packctl([*store, "build", str(facts), *model, "--name", "para"]) == 0
    capsys.readouterr()

    def ask(*extra: str) -> dict:
        assert packctl([*store, "ask", "para", row["question"], *model, "--json", "--max-new-tokens", "16", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain = ask()
    assert ask("--steer", "joy:0")["answer"] == plain["answer"]  # alpha 0 is exactly unsteered
    steered = ask("--steer", "joy:1.5", "--compare-rag")
    assert steered["identical"] is True and steered["steering"][0]["layers"] == list(middle_third(layers))
    assert packctl([*store, "ask", "--steer", "joy:0", "Tell me about your weekend.", *model, "--json", "--max-new-tokens", "16"]) == 0
    alone_plain = json.loads(capsys.readouterr().out)
    assert packctl([*store, "ask", "--steer", "joy:4", "--steer-on", "both", "Tell me about your weekend.", *model, "--json", "--max-new-tokens", "16"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["pack"] is None and alone["answer"] != alone_plain["answer"]

    with WorkerClient(worker.address) as client:  # the shared worker: it may hold other tests' packs
        cached = client.status()["cached_packs"]
        question = Question(row["question"], refs=("para",), sampling=GREEDY, steering=(("joy", 1.5),), compare_rag=True)
        remote = client.ask(question)
        assert remote.identical is True and remote.answer == steered["answer"] and remote.steering == steered["steering"]
        assert client.ask(Question(row["question"], refs=("para",), sampling=GREEDY)).answer == plain["answer"]
        status = client.status()
        assert status["cached_packs"] == cached + 2, status  # the knowledge pack and the steering pack


def test_a_steering_pack_answers_only_its_own_model(real_model, tmp_path: Path) -> None:
    """A steering pack built on one real model is refused by the other (model identity)."""
    from packstore.answering.api import build_steering_and_store
    from packstore.answering.facts import read_pairs
    from packstore.errors import PackMismatch

    first, second = (real_model(name) for name in MODELS)
    with LmdbStore(tmp_path / "store") as store:
        stored, _ = build_steering_and_store(store, first, read_pairs(PAIRS)[:3], name="joy")
        with pytest.raises(PackMismatch, match="model mismatch"):
            Answerer(second, store).ask(Question("Tell me about your weekend.", steering=((stored.key, 1.0),), sampling=GREEDY))


def test_key_deltas_before_rope_on_both_models(real_lm, tmp_path: Path) -> None:
    """steer build --keys unrotated on a real model (Llama; Gemma 3, whose local and global layers rotate with
    different frequencies): rotating cached keys back to position 0 gives layer 0 one key per token wherever it
    stands (layer 0's keys see no context), and the control moves the answer's distribution while a zero alpha
    changes nothing and the values alone do not depend on the key space."""
    import torch

    from packstore.answering.api import build_steering_and_store, steering_details
    from packstore.kv.build import layer_kv, prefill
    from packstore.kv.records import Pair
    from packstore.kv.render import render
    from packstore.kv.rope import layer_frequencies, rotate_keys
    from packstore.kv.steer import SteeredCache

    word = real_lm.tokenizer(" river", add_special_tokens=False).input_ids
    ids = real_lm.tokenizer("river").input_ids[:-1] + word * 5  # BOS (where the tokenizer adds one), then " river" x 5
    keys, _ = layer_kv(prefill(real_lm, ids).layers[0])
    positions = torch.arange(len(ids))
    unrotated = rotate_keys(keys[0].float(), layer_frequencies(real_lm)[0], -positions)[:, -5:]  # [heads, 5, head_dim]
    assert torch.allclose(unrotated, unrotated[:, :1].expand_as(unrotated), atol=1e-4)
    assert not torch.allclose(keys[0, :, -1].float(), keys[0, :, -2].float(), atol=1e-3)  # as cached they differ

    pairs = [Pair(**json.loads(line)) for line in PAIRS.read_text().splitlines()[:8]]
    question = "Describe a walk in the park."
    with LmdbStore(tmp_path / "store") as store:
        rotated, _ = build_steering_and_store(store, real_lm, pairs, name="joy")
        before, created = build_steering_and_store(store, real_lm, pairs, name="joy-before-rope", key_space="unrotated")
        assert created and before.key != rotated.key and steering_details(store, before)["key_space"] == "unrotated"
        answerer = Answerer(real_lm, store)
        asked = lambda ref, alpha, on: Question(question, sampling=GREEDY, steering=((ref, alpha),), steer_on=on)  # noqa: E731
        plain = answerer.ask(asked("joy", 0.0, "values")).answer  # alpha 0 is exactly unsteered
        assert answerer.ask(asked("joy-before-rope", 0.0, "keys")).answer == plain
        assert answerer.ask(asked("joy-before-rope", 1.0, "values")).answer == answerer.ask(asked("joy", 1.0, "values")).answer
        rendering = render(real_lm.tokenizer, [], question)
        tokens = torch.tensor([rendering.token_ids], device=real_lm.device)

        def first_token(deltas) -> torch.Tensor:
            cache = SteeredCache(deltas, rendering.prefix_tokens)
            with torch.inference_mode():
                return real_lm.model(input_ids=tokens, use_cache=True, **{real_lm.cache_argument: cache}).logits[0, -1].float()

        unsteered = first_token(answerer.steering(asked("joy-before-rope", 0.0, "keys"))[0])
        steered = first_token(answerer.steering(asked("joy-before-rope", 4.0, "keys"))[0])
        kl = torch.nn.functional.kl_div(torch.log_softmax(steered, -1), torch.log_softmax(unsteered, -1), log_target=True, reduction="sum")
        assert float(kl) > 1e-3
