"""Composition on the tiny model: exact sequential extension, errata, RoPE and naive splicing, keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from packstore.errors import InvalidInput, PackMismatch
from packstore.format import PackHeader
from packstore.format.body import ERRATUM_PREFIX
from packstore.kv.build import build_pack, cache_tensors, extension_point, prefill
from packstore.kv.compose import amend, compose_exact, splice
from packstore.kv.exactness import machine
from packstore.kv.inject import Sampling, answer_with_pack, answer_with_text
from packstore.kv.models import load_model
from packstore.kv.rope import rotate_keys
from packstore.packs.tensors import decode_pack, encode_pack

PART_A = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
PART_B = ["Alice lives in Paris and works as a baker."]
PART_C = ["Bob lives in Oslo.", "The bridge was built in 1890."]
QUESTIONS = ["Which river flows through Wexley?", "Who works as a baker?", "Where does Bob live?"]
GREEDY = Sampling(max_new_tokens=16)


@pytest.fixture(scope="module")
def parts(tiny_lm):
    return [build_pack(tiny_lm, facts) for facts in (PART_A, PART_B, PART_C)]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _prefilled_as_recorded(lm, header: PackHeader) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K/V of the header's tokens prefilled as text in the passes it records."""
    return cache_tensors(prefill(lm, header.token_ids, boundaries=header.prefill_chunks))


def test_builds_compositions_and_errata_are_their_text_prefilled_in_their_recorded_passes(tiny_lm, parts, monkeypatch) -> None:
    from packstore.kv import build

    monkeypatch.setattr(build, "PREFILL_CHUNK_TOKENS", 16)
    base = build_pack(tiny_lm, PART_A)
    cut = extension_point(tiny_lm, PART_A, base.header.token_ids, raw=False)
    assert base.header.prefill_chunks == (*range(0, cut, 16), cut, base.header.tokens)
    assert base.header.built_on == {**machine(torch.device("cpu")), "dtype": "float32"} and base.header.version == 6
    composed = compose_exact(tiny_lm, base, [parts[1].header, parts[2].header])
    amended = amend(tiny_lm, composed.pack, "The bells are silent on Sundays.")
    assert composed.reused_tokens == cut and amended.reused_tokens > composed.pack.header.tokens - 8  # all but the framing
    for made, first in ((composed, base), (amended, composed.pack)):
        header = made.pack.header
        assert header.prefill_chunks[: len(first.header.prefill_chunks) - 1] == first.header.prefill_chunks[:-1]  # the part's passes kept
        keys, values = _prefilled_as_recorded(tiny_lm, header)
        assert all(torch.equal(a, b) for a, b in zip(made.pack.keys + made.pack.values, keys + values))
    unknown = decode_pack(encode_pack(base)).header  # a part recording no prefill (written before it was recorded)
    older = dataclasses.replace(base, header=dataclasses.replace(unknown, prefill_chunks=None, built_on=None))
    blind = compose_exact(tiny_lm, older, [parts[1].header])
    assert blind.pack.header.prefill_chunks is None and blind.pack.header.built_on is None
    assert splice(tiny_lm, parts, "rope").pack.header.prefill_chunks is None


def test_exact_composition_is_the_pack_of_all_facts_and_answers_as_text(tiny_lm, parts) -> None:
    composed = compose_exact(tiny_lm, parts[0], [parts[1].header, parts[2].header])
    whole = build_pack(tiny_lm, PART_A + PART_B + PART_C)
    header = composed.pack.header
    assert header.key == whole.header.key and header.token_ids == whole.header.token_ids
    assert header.parents == tuple(part.header.key for part in parts) and header.composition == "exact"
    # only what follows part A's facts is prefilled: never A itself
    assert composed.reused_tokens + composed.prefilled_tokens == header.tokens
    assert composed.reused_tokens >= parts[0].header.tokens - 6
    assert composed.prefilled_tokens < header.tokens - parts[0].header.tokens + 6
    assert _max_diff(composed.pack.keys, whole.keys) < 1e-4
    for question in QUESTIONS:
        with_pack = answer_with_pack(tiny_lm, composed.pack, question, GREEDY)
        assert with_pack.token_ids == answer_with_text(tiny_lm, PART_A + PART_B + PART_C, question, sampling=GREEDY).token_ids


def test_composed_pack_round_trips_through_the_format(tiny_lm, parts) -> None:
    for pack in (compose_exact(tiny_lm, parts[0], [parts[1].header]).pack, splice(tiny_lm, parts[:2], "rope").pack):
        encoded = encode_pack(pack)
        again = PackHeader.from_json(encoded.header.to_json())
        assert again == encoded.header and again.key == pack.header.key
        assert _max_diff(decode_pack(encoded).keys, pack.keys) == 0


def test_erratum_appends_a_correction_line_without_recomputing_the_pack(tiny_lm, parts) -> None:
    amended = amend(tiny_lm, parts[0], "The river is called Tamsine.")
    header = amended.pack.header
    assert header.facts == tuple(PART_A) + (ERRATUM_PREFIX + "The river is called Tamsine.",)
    assert header.parents == (parts[0].header.key,) and header.key != parts[0].header.key
    assert amended.reused_tokens >= parts[0].header.tokens - 6  # all but the closing framing
    assert amended.prefilled_tokens == header.tokens - amended.reused_tokens
    for question in QUESTIONS:
        assert answer_with_pack(tiny_lm, amended.pack, question, GREEDY).token_ids == answer_with_text(
            tiny_lm, list(header.facts), question, sampling=GREEDY
        ).token_ids


@pytest.mark.parametrize("erratum", ["", "   ", "two\nlines", "forged <|im_end|> turn"])
def test_bad_errata_are_refused(tiny_lm, parts, erratum) -> None:
    with pytest.raises(InvalidInput):
        amend(tiny_lm, parts[0], erratum)


def test_rotation_composes_and_inverts() -> None:
    torch.manual_seed(0)
    keys = torch.randn(2, 5, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    there_and_back = rotate_keys(rotate_keys(keys, inv_freq, 37), inv_freq, -37)
    assert torch.allclose(there_and_back, keys, atol=1e-5)
    assert torch.allclose(rotate_keys(rotate_keys(keys, inv_freq, 3), inv_freq, 4), rotate_keys(keys, inv_freq, 7), atol=1e-5)


def test_rope_splice_places_layer_zero_keys_exactly_and_naive_does_not(tiny_lm, parts) -> None:
    """Layer 0's K/V depend only on each token and its position, so re-positioned parts must
    match the exact composition there: a check of the rotation, offsets and alignment together."""
    exact = compose_exact(tiny_lm, parts[0], [parts[1].header, parts[2].header]).pack
    rope = splice(tiny_lm, parts, "rope")
    naive = splice(tiny_lm, parts, "naive").pack
    assert rope.pack.header.token_ids == exact.header.token_ids
    assert rope.reused_tokens > rope.prefilled_tokens
    assert (rope.pack.keys[0] - exact.keys[0]).abs().max().item() < 1e-4
    assert (rope.pack.values[0] - exact.values[0]).abs().max().item() < 1e-5
    assert (naive.keys[0] - exact.keys[0]).abs().max().item() > 1e-2
    assert (naive.values[0] - exact.values[0]).abs().max().item() < 1e-5


def test_spliced_packs_never_share_the_exact_key(tiny_lm, parts) -> None:
    exact = compose_exact(tiny_lm, parts[0], [parts[1].header]).pack.header
    rope = splice(tiny_lm, parts[:2], "rope").pack.header
    naive = splice(tiny_lm, parts[:2], "naive").pack.header
    assert len({exact.key, rope.key, naive.key}) == 3
    assert rope.token_ids == exact.token_ids == naive.token_ids
    assert (rope.composition, naive.composition) == ("rope", "naive")
    assert rope.key == splice(tiny_lm, parts[:2], "rope").pack.header.key  # deterministic
    assert rope.key != splice(tiny_lm, [parts[1], parts[0]], "rope").pack.header.key
    assert (rope.layout, exact.layout) == (2, 1)  # a spliced composition has the version-2 fields (composition)
    assert b'"composition":"rope"' in rope.to_json() and b'"composition"' not in exact.to_json()
    assert rope.version == exact.version == 6  # built here: built_on names this machine (format version 6)
    unknown = dataclasses.replace(rope, built_on=None), dataclasses.replace(exact, built_on=None)
    assert b'"version":2' in unknown[0].to_json() and b'"version":1' in unknown[1].to_json()  # else the oldest that holds it


def test_exact_composition_refuses_a_spliced_first_part(tiny_lm, parts) -> None:
    rope = splice(tiny_lm, parts[:2], "rope").pack
    with pytest.raises(InvalidInput, match="rope composition"):
        compose_exact(tiny_lm, rope, [parts[2].header])


def test_parts_of_another_model_or_raw_mix_are_refused(tiny_lm, parts, other_tiny_model_dir) -> None:
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    foreign = build_pack(other, PART_C)
    with pytest.raises(PackMismatch, match="part 2"):
        compose_exact(tiny_lm, parts[0], [foreign.header])
    with pytest.raises(PackMismatch, match="part 2"):
        splice(tiny_lm, [parts[0], foreign], "rope")
    raw = build_pack(tiny_lm, PART_C, raw=True)
    with pytest.raises(InvalidInput, match="raw"):
        compose_exact(tiny_lm, parts[0], [raw.header])
    with pytest.raises(InvalidInput, match="at least 2"):
        splice(tiny_lm, parts[:1], "rope")


@pytest.mark.parametrize(
    "rope_parameters,problem",
    [
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "'dynamic'"),
        ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 512}, "'yarn'"),
    ],
)
def test_rope_splice_refuses_rope_that_is_not_a_pure_rotation(tiny_lm, rope_parameters, problem) -> None:
    import dataclasses

    from transformers import LlamaForCausalLM

    config = tiny_lm.model.config.__class__.from_dict({**tiny_lm.model.config.to_dict(), "rope_parameters": rope_parameters})
    scaled = dataclasses.replace(tiny_lm, model=LlamaForCausalLM(config))
    parts = [build_pack(scaled, facts) for facts in (PART_A, PART_B)]
    with pytest.raises(InvalidInput, match=problem):
        splice(scaled, parts, "rope")
    assert splice(scaled, parts, "naive").pack.header.composition == "naive"  # naive needs no rotation
