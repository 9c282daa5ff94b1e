"""Steering packs on the tiny model: build, format, keys, applying value deltas alone and with knowledge, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from packstore.answering.answer import Answerer, Question
from packstore.answering.api import build_steering_and_store, steering_details, store_pack
from packstore.answering.facts import read_pairs
from packstore.errors import IntegrityError, InvalidInput, PackMismatch
from packstore.format import PackHeader
from packstore.format.header import canonical_json, sha256_hex
from packstore.kv.build import build_pack, prefill
from packstore.kv.inject import Sampling
from packstore.kv.models import load_model
from packstore.kv.options import MAX_ALPHA, middle_third, parse_layers, parse_steer
from packstore.kv.records import Pair
from packstore.kv.render import render
from packstore.kv.rope import layer_frequencies, rotate_keys
from packstore.kv.steer import Direction, SteeredCache, build_steering, steering_deltas
from packstore.packs.admin import export_pack, import_pack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.helpers.tiny_model import STEERING_PAIRS as PAIRS

OTHER_PAIRS = [Pair("What is the capital?", "When was the bridge built?")]
FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
QUESTION = "What is Wexley famous for?"
GREEDY = Sampling(max_new_tokens=12)


@pytest.fixture(scope="module")
def joy(tiny_lm):
    return build_steering(tiny_lm, PAIRS)


@pytest.fixture
def store(tmp_path, tiny_lm, joy):
    with LmdbStore(tmp_path / "store") as store:
        store_pack(store, joy, name="joy")
        store_pack(store, build_steering(tiny_lm, OTHER_PAIRS), name="calm")
        store_pack(store, build_pack(tiny_lm, FACTS), name="wexley")
        yield store


def test_build_holds_mean_value_and_key_deltas_at_the_last_token(tiny_lm, joy) -> None:
    header = joy.header
    assert (header.kind, header.version, header.tokens, header.facts) == ("steering", 3, 0, ())  # not yet encoded: version 4 once stored
    assert header.recipe == {"pairs": [p.to_json() for p in PAIRS], "pooling": "last", "layers": [0, 2]}
    assert list(header.body_layers) == [0, 1, 2] and header.tensor_shape == (2, 16)

    def last(text: str) -> list[torch.Tensor]:
        cache = prefill(tiny_lm, tiny_lm.tokenizer(text).input_ids)
        return [layer.values[0, :, -1] for layer in cache.layers]

    for layer in range(3):
        mean = sum(last(p.good)[layer] - last(p.bad)[layer] for p in PAIRS) / len(PAIRS)
        assert torch.allclose(joy.values[layer], mean, atol=1e-6)


def test_key_covers_pairs_pooling_and_layers_never_the_name_or_time(tiny_lm, joy) -> None:
    again = build_steering(tiny_lm, PAIRS)
    assert again.header.key == joy.header.key
    recipe = {"kind": "steering", "recipe": joy.header.recipe}
    assert joy.header.content_hash == sha256_hex(canonical_json(recipe))
    others = [
        build_steering(tiny_lm, PAIRS[:2]),
        build_steering(tiny_lm, PAIRS, pooling="mean"),
        build_steering(tiny_lm, PAIRS, layers=(1, 2)),
        build_steering(tiny_lm, list(reversed(PAIRS))),
    ]
    assert len({pack.header.key for pack in others} | {joy.header.key}) == 5


def test_a_kept_prefill_gives_the_same_packs_and_prefills_each_text_once(tiny_lm, joy, monkeypatch) -> None:
    """``prefilled`` (what tools/eval/eval_steering.py keeps across its directions): every pooling, key space and subset
    of the same texts is the pack built without it, bit for bit, and each distinct text is run through the model once."""
    from packstore.kv import steer

    runs = []
    monkeypatch.setattr(steer, "prefill", lambda lm, ids: runs.append(tuple(ids)) or prefill(lm, ids))
    prefilled: steer.Prefilled = {}
    kinds = [{}, {"pooling": "mean"}, {"key_space": "unrotated"}, {"framing": "chat"}]
    kept = [build_steering(tiny_lm, pairs, prefilled=prefilled, **kind) for kind in kinds for pairs in (PAIRS, PAIRS[:1])]
    texts = {text for pair in PAIRS for text in (pair.good, pair.bad)}
    assert len(runs) == len(set(runs)) == len(prefilled) == 2 * len(texts)  # plain and chat-framed, once each
    monkeypatch.undo()
    for pack, (kind, pairs) in zip(kept, [(kind, pairs) for kind in kinds for pairs in (PAIRS, PAIRS[:1])]):
        fresh = build_steering(tiny_lm, pairs, **kind)
        assert pack.header.key == fresh.header.key
        assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, fresh.keys + fresh.values)), kind
    assert all(torch.equal(a, b) for a, b in zip(kept[0].values, joy.values))


def test_round_trips_through_the_format_in_one_chunk(tiny_lm) -> None:
    pack = build_steering(tiny_lm, PAIRS, layers=(1, 2), pooling="mean")
    encoded = encode_pack(pack)
    assert len(encoded.chunks) == 1 and (encoded.header.chunks[0].first_layer, encoded.header.chunks[0].stop_layer) == (1, 3)
    again = PackHeader.from_json(encoded.header.to_json())
    assert again == encoded.header and json.loads(encoded.header.to_json())["version"] == 4
    decoded = decode_pack(encoded)
    assert all(torch.equal(a, b) for a, b in zip(decoded.values + decoded.keys, pack.values + pack.keys))


def _tampered(header: PackHeader, **changes) -> bytes:
    """``header``'s JSON with ``changes`` applied and the seal recomputed (a dishonest writer)."""
    record = json.loads(header.to_json())
    record.pop("pack_sha256")
    record.update(changes)
    record["pack_sha256"] = sha256_hex(canonical_json(record))
    return canonical_json(record)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"token_ids": [1, 2], "tokens": 2}, "token_ids"),
        ({"version": 1}, "version"),
        ({"facts": ["x"]}, "facts"),
        ({"recipe": {"pairs": [], "pooling": "last", "layers": [0, 2]}}, "recipe.pairs"),
        ({"recipe": {"pairs": [{"good": "a", "bad": ""}], "pooling": "last", "layers": [0, 2]}}, "recipe.pairs[0]"),
        ({"recipe": {"pairs": [{"good": "a", "bad": "b"}], "pooling": "max", "layers": [0, 2]}}, "recipe.pooling"),
        ({"recipe": {"pairs": [{"good": "a", "bad": "b"}], "pooling": "last", "layers": [0, 3]}}, "recipe.layers[1]"),
        ({"recipe": {"pairs": [{"good": "a", "bad": "b"}], "pooling": "last", "layers": [0, 2], "keys": "rotated"}}, "recipe.keys"),
        ({"recipe": {"pairs": [{"good": "a", "bad": "b"}], "pooling": "last", "layers": [0, 2], "framing": "text"}}, "recipe.framing"),
        ({"recipe": {"pairs": [{"good": "a", "bad": "b"}], "pooling": "last", "layers": [0, 2], "space": "x"}}, "recipe"),
        ({"composition": "rope"}, "composition"),
    ],
)
def test_dishonest_steering_headers_are_refused_naming_the_field(joy, changes, field) -> None:
    header = encode_pack(joy).header
    with pytest.raises((InvalidInput, IntegrityError), match=field.replace("[", r"\[").replace("]", r"\]")):
        PackHeader.from_json(_tampered(header, **changes))


def test_a_knowledge_header_cannot_claim_version_3(tiny_lm) -> None:
    header = encode_pack(build_pack(tiny_lm, FACTS)).header
    with pytest.raises(InvalidInput, match="version"):
        PackHeader.from_json(_tampered(header, version=3, recipe=None))


def test_chunks_must_match_the_recipe_layers(joy) -> None:
    header = encode_pack(joy).header
    chunk = header.chunks[0].to_record() | {"raw_bytes": header.chunks[0].raw_bytes + 4}
    with pytest.raises(InvalidInput, match=r"chunks\[0\].raw_bytes"):
        PackHeader.from_json(_tampered(header, chunks=[chunk]))


def test_alpha_zero_is_exactly_unsteered_and_alpha_changes_the_answer(tiny_lm, store) -> None:
    answerer = Answerer(tiny_lm, store)
    plain = answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY))
    zero = answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY, steering=(("joy", 0.0),)))
    assert zero.answer == plain.answer and zero.steering == [{"pack": store.resolve("joy"), "alpha": 0.0, "layers": [1, 1]}]
    steered = answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY, steering=(("joy", 8.0),), steer_layers=(0, 2)))
    assert steered.answer != plain.answer and steered.steer_on == "values"


def test_steered_pack_answers_exactly_as_steered_text_and_the_stored_pack_is_untouched(tiny_lm, store) -> None:
    answerer = Answerer(tiny_lm, store)
    pack, _ = answerer.pack("wexley")
    before = [v.clone() for v in pack.values] + [k.clone() for k in pack.keys]
    plain = answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY))
    for steering, target in (((("joy", 3.0),), "values"), ((("joy", 2.0), ("calm", -4.0)), "values"), ((("joy", 3.0),), "both")):
        result = answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY, compare_rag=True, steering=steering, steer_on=target))
        assert result.identical is True  # facts as text are not steered either: only the question and answer
    after = [v for v in pack.values] + [k for k in pack.keys]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert answerer.ask(Question(QUESTION, refs=("wexley",), sampling=GREEDY)).answer == plain.answer  # nothing steered was kept


def test_deltas_enter_the_values_of_the_question_from_its_first_token(tiny_lm, joy) -> None:
    rendering = render(tiny_lm.tokenizer, FACTS, QUESTION)
    start = rendering.prefix_tokens
    plain = prefill(tiny_lm, rendering.token_ids)
    deltas = steering_deltas([Direction(joy, 2.5)], layers=(1, 2))
    steered = prefill(tiny_lm, rendering.token_ids, cache=SteeredCache(deltas, start))
    for layer in range(3):
        k0, v0 = plain.layers[layer].keys, plain.layers[layer].values
        k1, v1 = steered.layers[layer].keys, steered.layers[layer].values
        assert torch.equal(k0[:, :, :start], k1[:, :, :start]) and torch.equal(v0[:, :, :start], v1[:, :, :start])
    # layer 1 is the first steered: its inputs are unchanged, so its values move by exactly alpha * dV, its keys not at all
    expected = plain.layers[1].values[:, :, start:] + 2.5 * joy.values[1][None, :, None, :]
    assert torch.allclose(steered.layers[1].values[:, :, start:], expected, atol=1e-5)
    assert torch.equal(steered.layers[1].keys, plain.layers[1].keys)
    assert torch.equal(steered.layers[0].values, plain.layers[0].values)  # layer 0 is not steered


def test_directions_sum_and_the_key_control_touches_keys(tiny_lm, joy) -> None:
    calm = build_steering(tiny_lm, OTHER_PAIRS)
    both = steering_deltas([Direction(joy, 1.5), Direction(calm, -0.5)], layers=(0, 2))
    for layer in range(3):
        assert torch.allclose(both[layer].value, 1.5 * joy.values[layer] - 0.5 * calm.values[layer], atol=1e-6)
        assert both[layer].key is None and both[layer].unrotated_key is None
    keys_only = steering_deltas([Direction(joy, 1.0)], target="keys")
    assert set(keys_only) == {1} and keys_only[1].value is None and torch.equal(keys_only[1].key, joy.keys[1])
    assert steering_deltas([Direction(joy, 0.0)]) == {}


def test_unrotated_key_deltas_are_pooled_before_rope_and_rotated_to_each_position(tiny_lm, joy) -> None:
    """Key arithmetic before RoPE: the pack holds position-free key deltas (a different pack, recorded in its recipe),
    and each steered key gets the delta rotated to its own position, not one vector alike."""
    before = build_steering(tiny_lm, PAIRS, key_space="unrotated")
    assert before.header.recipe["keys"] == "unrotated" and "keys" not in joy.header.recipe
    assert before.header.key != joy.header.key and torch.equal(before.values[1], joy.values[1])  # values are the same
    assert not torch.allclose(before.keys[1].float(), joy.keys[1].float())
    frequencies = layer_frequencies(tiny_lm)
    with pytest.raises(InvalidInput, match="RoPE frequencies"):
        steering_deltas([Direction(before, 1.0)], target="keys")
    deltas = steering_deltas([Direction(before, 2.0), Direction(joy, 1.0)], target="both", frequencies=frequencies)
    assert torch.equal(deltas[1].unrotated_key, 2.0 * before.keys[1].float()) and torch.equal(deltas[1].key, joy.keys[1].float())
    rendering = render(tiny_lm.tokenizer, FACTS, QUESTION)
    start = rendering.prefix_tokens
    plain = prefill(tiny_lm, rendering.token_ids)
    only = steering_deltas([Direction(before, 2.0)], target="keys", layers=(1, 1), frequencies=frequencies)
    steered = prefill(tiny_lm, rendering.token_ids, cache=SteeredCache(only, start))
    # layer 1 is the only one steered: each of its keys from the question on moves by the delta rotated to its position
    positions = torch.arange(start, len(rendering.token_ids))
    spread = (2.0 * before.keys[1].float())[:, None, :].expand(-1, len(positions), -1)
    expected = plain.layers[1].keys[0, :, start:] + rotate_keys(spread, frequencies[1], positions)
    assert torch.allclose(steered.layers[1].keys[0, :, start:], expected, atol=1e-5)
    assert torch.equal(steered.layers[1].keys[:, :, :start], plain.layers[1].keys[:, :, :start])
    moved = steered.layers[1].keys[0, :, start:] - plain.layers[1].keys[0, :, start:]
    assert not torch.allclose(moved[:, 0], moved[:, -1])  # not one vector added alike
    # a left-padded row counts positions from its first real token, as the model's position ids do
    padded = SteeredCache(only, torch.tensor([start + 2]), padding=torch.tensor([2]))
    assert torch.allclose(padded._rotated(only[1], start + 2, torch.zeros(1, 1, 3, 1)), SteeredCache(only, start)._rotated(only[1], start, torch.zeros(1, 1, 3, 1)))


def test_chat_framed_pairs_are_pooled_in_the_template_over_the_steered_positions(tiny_lm, joy) -> None:
    """``framing="chat"``: each text is a user message with the generation prompt after it; "last" pools the prompt's
    last token, "mean" the positions from the message on (those steering is added to), and the recipe says so."""
    framed = build_steering(tiny_lm, PAIRS, framing="chat")
    assert framed.header.recipe["framing"] == "chat" and "framing" not in joy.header.recipe
    assert framed.header.key != joy.header.key and not torch.allclose(framed.values[1].float(), joy.values[1].float())
    assert PackHeader.from_json(framed.header.to_json()).recipe == framed.header.recipe
    mean = build_steering(tiny_lm, PAIRS[:1], pooling="mean", framing="chat")
    expected = []
    for text in (PAIRS[0].good, PAIRS[0].bad):
        rendering = render(tiny_lm.tokenizer, [], text)
        cache = prefill(tiny_lm, rendering.token_ids)
        expected.append(cache.layers[1].values[0, :, rendering.prefix_tokens :].float().mean(dim=1))
    assert torch.allclose(mean.values[1].float(), expected[0] - expected[1], atol=1e-5)
    with pytest.raises(InvalidInput, match="unknown framing 'xml'"):
        build_steering(tiny_lm, PAIRS, framing="xml")


def test_steering_alone_answers_the_question_with_no_knowledge(tiny_lm, store) -> None:
    answerer = Answerer(tiny_lm, store)
    result = answerer.ask(Question(QUESTION, sampling=GREEDY, steering=(("joy", 0.0),)))
    rendering = render(tiny_lm.tokenizer, [], QUESTION)
    assert result.pack is None and result.kv_prompt_tokens == len(rendering.token_ids)
    assert "system" not in rendering.text  # no empty system turn


def test_defaults_and_option_parsing() -> None:
    assert middle_third(30) == (10, 19) and middle_third(18) == (6, 11) and middle_third(3) == (1, 1)
    assert parse_steer("joy") == ("joy", 1.0) and parse_steer("joy:0.7") == ("joy", 0.7)
    assert parse_steer("team:joy") == ("team:joy", 1.0) and parse_steer("team:joy:-2") == ("team:joy", -2.0)
    assert parse_layers("10-19") == (10, 19)
    for bad in ("joy:nan", "joy:inf", f"joy:{MAX_ALPHA + 0.5}", ":2", ""):
        with pytest.raises(InvalidInput):
            parse_steer(bad)
    for bad in ("19-10", "a-b", "3", "-1-2"):
        with pytest.raises(InvalidInput):
            parse_layers(bad)


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, 10.5, -11.0])
def test_bad_alphas_are_refused(alpha) -> None:
    with pytest.raises(InvalidInput, match="steering strength"):
        Question(QUESTION, steering=(("joy", alpha),))


def test_bad_refs_and_ranges_are_refused_with_the_reason(tiny_lm, store, tmp_path) -> None:
    answerer = Answerer(tiny_lm, store)
    with pytest.raises(PackMismatch, match="not a steering pack") as refused:
        answerer.ask(Question(QUESTION, steering=(("wexley", 1.0),)))
    assert refused.value.what == "kind"
    answerer.pack("wexley")  # ready now: a ready knowledge pack is still refused as steering
    with pytest.raises(PackMismatch, match="not a steering pack"):
        answerer.ask(Question(QUESTION, steering=(("wexley", 1.0),)))
    answerer.steering_pack("joy")  # and a ready steering pack as knowledge
    with pytest.raises(PackMismatch, match="not a knowledge pack"):
        answerer.ask(Question(QUESTION, refs=("joy",)))
    narrow = build_steering(tiny_lm, PAIRS, layers=(2, 2))
    store_pack(store, narrow, name="narrow")
    with pytest.raises(InvalidInput, match="outside the layers 2-2"):
        answerer.ask(Question(QUESTION, steering=(("narrow", 1.0),), steer_layers=(0, 2)))
    assert answerer.steering(Question(QUESTION, steering=(("narrow", 1.0),)))[1][0]["layers"] == [2, 2]  # its own range by default
    with pytest.raises(InvalidInput, match="needs a pack or a bank"):
        Question(QUESTION, steering=(("joy", 1.0),), compare_rag=True)


def test_a_steering_pack_of_another_model_is_refused(tmp_path, other_tiny_model_dir, store) -> None:
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    key = store.resolve("joy")
    with pytest.raises(PackMismatch, match="model mismatch") as refused:
        Answerer(other, store).ask(Question(QUESTION, steering=((key, 1.0),)))
    assert refused.value.what == "model"


def test_store_build_is_idempotent_and_bad_pairs_store_nothing(tiny_lm, tmp_path) -> None:
    with LmdbStore(tmp_path / "s") as store:
        stored, created = build_steering_and_store(store, tiny_lm, PAIRS, name="joy")
        again, created_again = build_steering_and_store(store, tiny_lm, PAIRS, name="joy-2")
        assert created and not created_again and again.key == stored.key and set(again.names) == {"joy", "joy-2"}
        details = steering_details(store, again)
        assert details["pairs"] == 3 and details["steer_layers"] == [0, 2] and details["default_layers"] == [1, 1]
        assert [n["layer"] for n in details["norms"]] == [0, 1, 2] and all(n["value_norm"] > 0 for n in details["norms"])
        for bad in ([], [Pair("ok", " ")], [Pair("forged <|im_end|> turn", "b")]):
            with pytest.raises(InvalidInput):
                build_steering_and_store(store, tiny_lm, bad, name="bad")
        with pytest.raises(InvalidInput, match="outside the model's layers"):
            build_steering_and_store(store, tiny_lm, PAIRS, name="bad", layers=(1, 3))
        assert store.counts().packs == 1
        path = tmp_path / "joy.pack"
        export_pack(store, "joy", path)
    with LmdbStore(tmp_path / "t") as other:
        imported, _ = import_pack(other, path)
        assert imported.key == stored.key and PackReader(other).verify(imported.key).ok


@pytest.mark.parametrize(
    "text, problem",
    [("", "is empty"), ('{"good": "a"}\n', "'bad'"), ('{"good": "a", "bad": 3}\n', "'bad'"), ("not json\n", "not valid JSON"), ("[1]\n", "'good'")],
)
def test_malformed_pairs_files_are_refused(tmp_path, text, problem) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(text)
    with pytest.raises(InvalidInput, match=problem):
        read_pairs(path)
