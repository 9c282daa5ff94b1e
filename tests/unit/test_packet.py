"""KV Packet on the tiny model: adapter training and format, packet compositions, selective recompute."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from packstore.answering.answer import Answerer, Question
from packstore.answering.api import compose_and_store, store_pack, train_adapter_and_store
from packstore.answering.facts import read_examples
from packstore.errors import IntegrityError, InvalidInput, PackMismatch
from packstore.format import PackHeader
from packstore.format.header import canonical_json, sha256_hex
from packstore.kv.blend import selective_recompute
from packstore.kv.build import build_pack
from packstore.kv.compose import compose_exact, splice
from packstore.kv.inject import Sampling, cache_aligned_ids
from packstore.kv.models import load_model
from packstore.kv.packet import data_digest, generated_examples, packet_compose, train_adapter
from packstore.kv.records import Pair
from packstore.kv.steer import build_steering
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore

PART_A = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
PART_B = ["Alice lives in Paris and works as a baker."]
PART_C = ["Bob lives in Oslo.", "The bridge was built in 1890."]
GREEDY = Sampling(max_new_tokens=8)


@pytest.fixture(scope="module")
def adapter(tiny_lm):
    return train_adapter(tiny_lm, generated_examples(12), source="test generator", tokens=2, steps=6, holdout=4)


@pytest.fixture(scope="module")
def parts(tiny_lm):
    return [build_pack(tiny_lm, facts) for facts in (PART_A, PART_B, PART_C)]


def test_adapter_pack_holds_soft_tokens_recipe_and_metrics(tiny_lm, adapter) -> None:
    header = adapter.header
    assert (header.kind, header.version, header.tokens, list(header.body_layers)) == ("adapter", 3, 0, [0])  # not yet encoded: version 4 once stored
    assert header.tensor_shape == (2, 64) and header.tensor_names(0) == ("soft.header", "soft.trailer")
    recipe = header.recipe
    assert recipe["tokens"] == 2 and recipe["steps"] == 6 and recipe["hidden_size"] == 64
    assert recipe["data"] == {"source": "test generator", "sha256": data_digest(generated_examples(12)), "examples": 12}
    metrics = header.metrics
    assert metrics["holdout_examples"] == 4 and metrics["train_seconds"] >= 0 and metrics["peak_rss_mb"] > 0
    assert {"holdout_kl_before", "holdout_kl_after"} <= set(metrics)
    encoded = encode_pack(adapter)
    assert PackHeader.from_json(encoded.header.to_json()) == encoded.header
    decoded = decode_pack(encoded)
    assert torch.equal(decoded.keys[0], adapter.keys[0]) and torch.equal(decoded.values[0], adapter.values[0])


def test_the_key_covers_recipe_data_and_tensors(tiny_lm, adapter) -> None:
    again = train_adapter(tiny_lm, generated_examples(12), source="test generator", tokens=2, steps=6, holdout=4)
    assert again.header.key == adapter.header.key  # the same training is deterministic: the same adapter
    other_seed = train_adapter(tiny_lm, generated_examples(12), source="test generator", tokens=2, steps=6, holdout=4, seed=1)
    more_steps = train_adapter(tiny_lm, generated_examples(12), source="test generator", tokens=2, steps=7, holdout=4)
    assert len({adapter.header.key, other_seed.header.key, more_steps.header.key}) == 3
    recipe = {"kind": "adapter", "recipe": adapter.header.recipe}
    assert adapter.header.content_hash == sha256_hex(canonical_json(recipe))


def test_tensors_that_do_not_match_the_recipe_digest_are_damage(adapter) -> None:
    forged = dataclasses.replace(adapter, keys=[adapter.keys[0] + 1])
    with pytest.raises(IntegrityError, match="tensors_sha256"):
        decode_pack(encode_pack(forged))


def test_packet_composition_wraps_each_part_in_soft_tokens_without_recomputing_parts(tiny_lm, parts, adapter) -> None:
    composed = packet_compose(tiny_lm, parts, adapter)
    header = composed.pack.header
    rope = splice(tiny_lm, parts, "rope").pack
    assert header.composition == "packet" and header.token_ids == rope.header.token_ids
    assert header.parents == tuple(p.header.key for p in parts) + (adapter.header.key,)
    assert [count for _, count in header.soft_tokens] == [2, 2, 2, 2, 2]  # trailer, header+..., trailer
    assert header.positions == header.tokens + 10 and composed.reused_tokens == rope.header.tokens - splice(tiny_lm, parts, "rope").prefilled_tokens
    assert composed.prefilled_tokens == splice(tiny_lm, parts, "rope").prefilled_tokens + 10
    # every part's own tokens are copied: part A's leading tokens exactly, later parts rotated as in rope
    first_soft = header.soft_tokens[0][0]
    assert torch.equal(composed.pack.keys[0][:, :first_soft], rope.keys[0][:, :first_soft])
    encoded = encode_pack(composed.pack)
    again = PackHeader.from_json(encoded.header.to_json())
    assert again == encoded.header and json.loads(encoded.header.to_json())["version"] == 6  # built_on names this machine
    assert decode_pack(encoded).keys[0].shape[1] == header.positions
    ids = list(range(header.tokens + 3))
    aligned = cache_aligned_ids(header, ids, placeholder=-1)
    assert len(aligned) == header.positions + 3 and aligned.count(-1) == 10 and [i for i in aligned if i != -1] == ids


def test_packet_compositions_answer_through_the_one_path_and_are_stored_once(tiny_lm, parts, adapter, tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        for name, part in zip("abc", parts):
            store_pack(store, part, name=name)
        store_pack(store, adapter, name="adapter")
        answerer = Answerer(tiny_lm, store)
        question = Question("Where does Bob live?", refs=("a", "b", "c"), mode="packet", adapter="adapter", sampling=GREEDY, compare_rag=True)
        on_the_fly = answerer.ask(question)
        stored, created, composition = compose_and_store(store, tiny_lm, ["a", "b", "c"], mode="packet", adapter="adapter", name="abc")
        assert created and stored.key == on_the_fly.pack and on_the_fly.parts == [p.header.key for p in parts]
        assert on_the_fly.composed_tokens == composition.prefilled_tokens
        assert compose_and_store(store, tiny_lm, ["a", "b", "c"], mode="packet", adapter="adapter")[1:] == (False, None)
        stored_answer = answerer.ask(Question("Where does Bob live?", refs=("abc",), sampling=GREEDY))
        assert stored_answer.answer == on_the_fly.answer and stored_answer.kv_prompt_tokens == on_the_fly.kv_prompt_tokens
        again = answerer.ask(question)
        assert again.cache_hit is True and again.composed_tokens == 0 and again.answer == on_the_fly.answer
        rope = answerer.ask(dataclasses.replace(question, mode="rope", adapter=None))
        assert rope.pack != on_the_fly.pack and rope.identical is not None
        store_pack(store, build_steering(tiny_lm, [Pair("Alice lives in Paris.", "Bob lives in Oslo.")]), name="joy")
        unsteered = answerer.ask(dataclasses.replace(question, steering=(("joy", 0.0),)))
        assert unsteered.answer == on_the_fly.answer  # soft tokens take cache positions: steering starts after them
        steered = answerer.ask(dataclasses.replace(question, steering=(("joy", 6.0),), steer_layers=(0, 2)))
        assert steered.pack == on_the_fly.pack and steered.answer != on_the_fly.answer


def test_bad_packet_requests_are_refused(tiny_lm, parts, adapter, other_tiny_model_dir, tmp_path) -> None:
    with pytest.raises(InvalidInput, match="needs an adapter"):
        Question("Q?", refs=("a", "b"), mode="packet")
    with pytest.raises(InvalidInput, match="at least 2 packs"):
        Question("Q?", refs=("a",), mode="rope")
    with pytest.raises(InvalidInput, match="unknown composition mode"):
        Question("Q?", refs=("a", "b"), mode="blend")
    composed = packet_compose(tiny_lm, parts[:2], adapter).pack
    with pytest.raises(InvalidInput, match="soft tokens cannot be spliced"):
        splice(tiny_lm, [composed, parts[2]], "rope")
    with pytest.raises(InvalidInput, match="exact composition needs an exact first part"):
        compose_exact(tiny_lm, composed, [parts[2].header])
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    foreign = train_adapter(other, generated_examples(6), source="test", steps=1, holdout=2)
    with pytest.raises(PackMismatch, match="model mismatch"):
        packet_compose(tiny_lm, parts, foreign)
    with LmdbStore(tmp_path / "store") as store:
        for name, part in zip("abc", parts):
            store_pack(store, part, name=name)
        store_pack(store, foreign, name="foreign")
        with pytest.raises(PackMismatch, match="not an adapter") as refused:
            compose_and_store(store, tiny_lm, ["a", "b"], mode="packet", adapter="c")
        assert refused.value.what == "kind"
        with pytest.raises(PackMismatch, match="model mismatch"):
            Answerer(tiny_lm, store).ask(Question("Q?", refs=("a", "b"), mode="packet", adapter=store.resolve("foreign")))
        with pytest.raises(InvalidInput, match="needs an adapter"):
            compose_and_store(store, tiny_lm, ["a", "b"], mode="packet")
    for bad in ({"tokens": 0}, {"steps": -1}):
        with pytest.raises(InvalidInput):
            train_adapter(tiny_lm, generated_examples(6), source="test", holdout=2, **bad)
    with pytest.raises(InvalidInput, match="more than 4 examples"):
        train_adapter(tiny_lm, generated_examples(4), source="test", holdout=4)


def test_stored_adapter_training_and_examples_file(tiny_lm, tmp_path) -> None:
    data = tmp_path / "examples.jsonl"
    lines = [json.dumps(e.to_json() | {"documents": ["\n".join(d) for d in e.documents]}) for e in generated_examples(6)]
    data.write_text("\n".join(lines) + "\n")
    examples = read_examples(data)
    assert examples == generated_examples(6)
    for text, message in (('{"documents": ["one"], "question": "Q?"}\n', "at least 2"), ('{"documents": ["a", "b"]}\n', "'question'")):
        data.write_text(text)
        with pytest.raises(InvalidInput, match=message):
            read_examples(data)
    with LmdbStore(tmp_path / "store") as store:
        stored, created = train_adapter_and_store(store, tiny_lm, name="pk", examples=examples, source="file", steps=2)
        assert created and stored.names == ("pk",) and stored.header.recipe["data"]["source"] == "file"
        assert PackReader(store).fetch("pk").header.kind == "adapter" and PackReader(store).verify(stored.key).ok


def test_selective_recompute_spans_rope_to_full_recompute(tiny_lm, parts) -> None:
    rope = splice(tiny_lm, parts, "rope").pack
    exact = compose_exact(tiny_lm, parts[0], [p.header for p in parts[1:]]).pack
    nothing = selective_recompute(tiny_lm, rope, share=0.0)
    assert nothing.recomputed == [] and all(torch.equal(nothing.cache.layers[i].keys[0], rope.keys[i]) for i in range(3))
    everything = selective_recompute(tiny_lm, rope, share=1.0)
    assert len(everything.recomputed) == rope.header.tokens
    assert max((everything.cache.layers[i].keys[0] - exact.keys[i]).abs().max().item() for i in range(3)) < 1e-4
    some = selective_recompute(tiny_lm, rope, share=0.15)
    assert len(some.recomputed) == -(-rope.header.tokens * 15 // 100) and some.probe_layers == 2
    gap = lambda cache: max((cache.layers[i].values[0] - exact.values[i]).abs().max().item() for i in range(3))  # noqa: E731
    assert gap(some.cache) <= gap(nothing.cache)
