"""The worker as a front for vLLM, its engine-free parts on the tiny model: the rendering model's identities, what is
sent for a pack, a chain or a bank's facts (stored or not, saving or not), the completion body, the refusals, and the
settings the front refuses. tests/vllm/test_vllm_front.py runs the whole front over a real vLLM server."""

from __future__ import annotations

import dataclasses

import pytest

from packstore.answering.answer import Question
from packstore.answering.api import compose_and_store
from packstore.answering.engine_answer import EngineAnswerer, completion_body, fresh_salt, local_engine_only
from packstore.answering.engine_client import EngineClient, EngineIdentity
from packstore.errors import InvalidInput, PackMismatch, Unavailable
from packstore.format.header import pack_key
from packstore.kv.build import build_pack
from packstore.kv.device import Cancel
from packstore.kv.inject import Sampling, finish
from packstore.kv.models import load_rendering_model
from packstore.kv.render import pack_prefix_ids, render
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.spec import StoreSpec
from packstore.worker.config import WorkerConfig
from packstore.worker.front import check_engine_config, check_same_model, wait_for_engine
from tools.lib.servers import free_port

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
MORE = ["Alice lives in Paris and works as a baker."]
QUESTION = "What is Wexley famous for?"
ENGINE = {"name": "vllm", "version": "0.32.0", "block_size": 16}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_rendering_model(str(tiny_model_dir), device="vllm at http://127.0.0.1:1")


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_lm):
    with LmdbStore(tmp_path_factory.mktemp("front") / "store") as store:
        store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        store.put(encode_pack(build_pack(tiny_lm, MORE)), name="alice")
        yield store


def front(model, store, *, saves: bool = True, namespaces=("default",)) -> EngineAnswerer:
    """An answerer for the engine the tiny model would be served by (no request is sent by these tests)."""
    identity = EngineIdentity("tiny", model.model_fp, model.template_fp, "float32", ENGINE, saves, tuple(namespaces))
    return EngineAnswerer(model, store, EngineClient("http://127.0.0.1:1"), identity, namespace="default")


def test_the_rendering_model_has_the_loaded_model_identities_without_its_weights(model, tiny_lm) -> None:
    assert (model.model_fp, model.template_fp, model.dtype_name) == (tiny_lm.model_fp, tiny_lm.template_fp, "float32")
    assert model.stop_token_ids == tiny_lm.stop_token_ids and not hasattr(model, "model")


def test_one_pack_is_named_by_its_key_and_the_prompt_is_its_rendering(model, store) -> None:
    ask = front(model, store).plan_ask(Question(QUESTION, refs=("wexley",)), None)
    key = store.resolve("wexley")
    assert ask.params == {"pack": key, "namespace": "default"} and ask.salt is None
    assert ask.prompt == render(model.tokenizer, FACTS, QUESTION).token_ids
    assert (ask.pack, ask.pack_tokens, ask.stored, ask.parts) == (key, store.stat(key).header.tokens, True, None)


def test_a_chain_not_stored_is_computed_whole_and_saved_under_a_salt_of_its_own(model, store) -> None:
    ask = front(model, store).plan_ask(Question(QUESTION, refs=("wexley", "alice")), None)
    ids = pack_prefix_ids(model.tokenizer, FACTS + MORE)
    assert ask.params == {"pack": {"facts": FACTS + MORE}, "save": True, "namespace": "default"}
    assert ask.pack == pack_key(model.model_fp, model.template_fp, ids, engine=ENGINE)  # the key the connector saves under
    assert ask.salt.startswith("packstore-save-") and ask.salt != fresh_salt("save") and not ask.stored
    assert ask.parts == [store.resolve("wexley"), store.resolve("alice")] and ask.pack_tokens == len(ids)


def test_a_chain_without_saves_names_its_parts_so_the_deepest_agreeing_one_loads(model, store) -> None:
    ask = front(model, store, saves=False).plan_ask(Question(QUESTION, refs=("wexley", "alice")), None)
    assert ask.params == {"pack": [store.resolve("wexley"), store.resolve("alice")], "namespace": "default"}
    assert ask.salt is None and not ask.stored


def test_a_stored_composition_and_a_stored_facts_pack_are_loaded_whole(model, tiny_lm, tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        store.put(encode_pack(build_pack(tiny_lm, MORE)), name="alice")
        composed, _, _ = compose_and_store(store, tiny_lm, ["wexley", "alice"])
        chain = front(model, store).plan_ask(Question(QUESTION, refs=("wexley", "alice")), None)
        assert (chain.pack, chain.salt, chain.stored) == (composed.key, None, True)
        assert chain.params == {"pack": {"facts": FACTS + MORE}, "namespace": "default"}
        facts = front(model, store).plan_ask(Question(QUESTION, bank="b"), FACTS + MORE)
        assert (facts.pack, facts.params, facts.parts) == (composed.key, chain.params, None)


def test_what_only_the_local_engine_runs_is_refused_naming_the_field() -> None:
    for question, field in ((Question("q", refs=("a",), steering=(("s", 1.0),)), "steer"),
                            (Question("q", refs=("a", "b"), mode="rope"), "mode")):
        with pytest.raises(InvalidInput, match="needs the local engine") as refused:
            local_engine_only(question)
        assert refused.value.fields["param"] == field


def test_a_pack_of_another_model_is_refused_before_vllm_is_asked(model, store, other_tiny_model_dir) -> None:
    other = load_rendering_model(str(other_tiny_model_dir))
    with pytest.raises(PackMismatch, match="model"):
        front(other, store).plan_ask(Question(QUESTION, refs=("wexley",)), None)


def test_the_completion_body_sets_every_sampling_field_and_vllm_defaults_none(model, store) -> None:
    ask = front(model, store).plan_ask(Question(QUESTION, refs=("wexley", "alice")), None)
    body = completion_body("tiny", ask, Sampling(max_new_tokens=40, stop=("\n",), seed=7), model.stop_token_ids)
    assert body["prompt"] == ask.prompt and body["max_tokens"] == 40 and body["temperature"] == 0.0
    assert (body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"]) == (1.0, -1, 0.0, 1.0)
    assert body["stop"] == ["\n"] and body["seed"] == 7 and body["stop_token_ids"] == list(model.stop_token_ids)
    assert body["cache_salt"] == ask.salt and body["kv_transfer_params"] == ask.params and body["model"] == "tiny"
    plain = completion_body("tiny", dataclasses.replace(ask, salt=None), Sampling(), ())
    assert "cache_salt" not in plain and "seed" not in plain and "stop" not in plain and plain["max_tokens"] == 64


def test_settings_only_the_local_engine_uses_are_refused_with_vllm(tmp_path) -> None:
    base = WorkerConfig(model="m", store=StoreSpec(str(tmp_path)))
    check_engine_config(base)
    with pytest.raises(InvalidInput, match="engine_url"):
        check_engine_config(dataclasses.replace(base, engine="vllm"))
    with pytest.raises(InvalidInput, match="goes with engine 'vllm'"):
        check_engine_config(dataclasses.replace(base, engine_url="http://x:1"))
    front_config = dataclasses.replace(base, engine="vllm", engine_url="http://x:1")
    check_engine_config(front_config)
    with pytest.raises(InvalidInput, match="^device, threads, cache_bytes: only the worker's own engine"):
        check_engine_config(dataclasses.replace(front_config, device="cpu", threads=2, cache_bytes=1 << 20))


def test_an_engine_serving_another_model_or_dtype_is_refused_naming_both(model) -> None:
    same = EngineIdentity("smollm2", model.model_fp, model.template_fp, "float32", ENGINE, True, ("default",))
    check_same_model(model, same, "http://e:1")
    with pytest.raises(PackMismatch, match=r"dtype mismatch: .* \(dtype float32\), .* serves 'smollm2' \(dtype bfloat16\)"):
        check_same_model(model, dataclasses.replace(same, dtype="bfloat16"), "http://e:1")
    with pytest.raises(PackMismatch, match="template mismatch"):
        check_same_model(model, dataclasses.replace(same, template_fp="0" * 64), "http://e:1")


def test_an_engine_that_does_not_answer_is_unavailable_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match=f"the vLLM server at {url} did not answer within 0.5 s"):
        wait_for_engine(EngineClient(url + "/v1"), 0.5)
    with pytest.raises(InvalidInput, match="must start with http"):
        EngineClient("127.0.0.1:8000")


def test_a_completion_from_an_engine_that_does_not_answer_is_unavailable_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match=f"the vLLM server at {url} did not answer: ConnectError"):
        finish(EngineClient(url).complete({"model": "m", "prompt": [1]}, Cancel()))


def test_a_namespace_the_connector_does_not_read_is_unavailable_before_vllm_is_asked(model, store) -> None:
    answerer = front(model, store, namespaces=("tenant-a",))
    with pytest.raises(Unavailable, match="does not read namespace 'default' \\(it reads tenant-a\\)"):
        finish(answerer.stream(Question(QUESTION, refs=("wexley",))))
