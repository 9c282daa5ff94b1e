"""Building and injecting packs on the tiny model: exactness, refusals, raw packs, sampling."""

from __future__ import annotations

import pytest

from packstore.errors import InvalidInput, PackMismatch
from packstore.kv import inject
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling, TextDeltas, answer_with_pack, answer_with_text, prefill_divergence
from packstore.kv.models import load_model
from packstore.packs.tensors import decode_pack, encode_pack
from tests.helpers.tiny_model import ALT_TEMPLATE

FACTS = [
    "The river Tamsin flows through the town of Wexley.",
    "Wexley is famous for its bells.",
    "Alice lives in Paris and works as a baker.",
]
QUESTIONS = ["Which river flows through Wexley?", "What is Wexley famous for?", "Who works as a baker?", "Where does Bob live?"]
GREEDY = Sampling(max_new_tokens=24)


@pytest.fixture(scope="module")
def pack(tiny_lm):
    return decode_pack(encode_pack(build_pack(tiny_lm, FACTS)))


def test_injection_answers_exactly_as_text_in_prompt(tiny_lm, pack) -> None:
    for question in QUESTIONS:
        with_pack = answer_with_pack(tiny_lm, pack, question, GREEDY)
        with_text = answer_with_text(tiny_lm, FACTS, question, sampling=GREEDY)
        assert with_pack.token_ids == with_text.token_ids
        assert len(with_pack.token_ids) > 0
        assert with_pack.prompt_tokens + pack.header.tokens == with_text.prompt_tokens
    dk, dv = prefill_divergence(tiny_lm, pack, QUESTIONS[0])
    print(f"\ntiny model: max |dK| {dk:.2e}, max |dV| {dv:.2e}")
    assert dk < 1e-3 and dv < 1e-3


def test_pack_for_another_model_is_refused(pack, other_tiny_model_dir) -> None:
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    with pytest.raises(PackMismatch, match="model mismatch") as info:
        answer_with_pack(other, pack, QUESTIONS[0], GREEDY)
    assert info.value.what == "model"


def test_pack_with_another_template_is_refused(pack, tiny_model_dir) -> None:
    other = load_model(str(tiny_model_dir), device="cpu", progress=False, chat_template=ALT_TEMPLATE)
    with pytest.raises(PackMismatch, match="template mismatch") as info:
        answer_with_pack(other, pack, QUESTIONS[0], GREEDY)
    assert info.value.what == "template"


def test_raw_pack_is_flagged_and_exact_against_raw_text(tiny_lm) -> None:
    raw = build_pack(tiny_lm, FACTS, raw=True)
    assert raw.header.raw is True
    assert raw.header.key != build_pack(tiny_lm, FACTS).header.key
    question = QUESTIONS[1]
    assert (
        answer_with_pack(tiny_lm, raw, question, GREEDY).token_ids
        == answer_with_text(tiny_lm, FACTS, question, raw=True, sampling=GREEDY).token_ids
    )


def test_seeded_sampling_is_reproducible_and_matches_text(tiny_lm, pack) -> None:
    sampling = Sampling(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    first = answer_with_pack(tiny_lm, pack, QUESTIONS[0], sampling)
    assert answer_with_pack(tiny_lm, pack, QUESTIONS[0], sampling).token_ids == first.token_ids
    assert answer_with_text(tiny_lm, FACTS, QUESTIONS[0], sampling=sampling).token_ids == first.token_ids


def test_long_pack_built_in_chunks_stays_exact(tiny_lm, monkeypatch) -> None:
    from packstore.kv import build

    monkeypatch.setattr(build, "PREFILL_CHUNK_TOKENS", 16)
    facts = [f"Fact {i}: the bell of tower {i} rings {i % 7} times." for i in range(12)]
    pack = build.build_pack(tiny_lm, facts)
    assert pack.header.tokens > 3 * 16
    question = "How often does the bell of tower 5 ring?"
    assert (
        answer_with_pack(tiny_lm, pack, question, GREEDY).token_ids
        == answer_with_text(tiny_lm, facts, question, sampling=GREEDY).token_ids
    )


def test_streamed_text_pieces_concatenate_to_the_answer_even_inside_utf8_characters(tiny_lm) -> None:
    text = "Tōkyō 東京 café 🚀!"
    ids = tiny_lm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # the tiny byte-level vocabulary splits these characters across tokens
    deltas = TextDeltas(tiny_lm.tokenizer)
    pieces = [deltas.add(token) for token in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_closing_a_token_stream_stops_generation_before_returning(tiny_lm, pack) -> None:
    """A cancelled stream must free the device: generation has stopped once close() returns."""
    from packstore.kv.inject import cache_from_pack, generate_stream, prepare

    rendering = prepare(tiny_lm, pack.header, QUESTIONS[0])
    tokens = generate_stream(tiny_lm, rendering.token_ids, Sampling(max_new_tokens=5000), cache_from_pack(pack, tiny_lm.device))
    next(tokens)
    tokens.close()
    assert inject._generation_threads().busy == 0  # the generation thread is free: 5000 tokens take far longer


def test_every_stream_generates_on_the_same_long_lived_thread(tiny_lm, pack, monkeypatch) -> None:
    """A fresh thread per request would fault in a fresh malloc arena's pages each time (docs/benchmarks.md)."""
    import threading

    idents = []

    def record(lm, ids, sampling, cache, streamer, stop):
        idents.append(threading.get_ident())
        streamer.end()

    monkeypatch.setattr(inject, "_run_generate", record)
    for _ in range(3):
        list(inject.generate_stream(tiny_lm, [1, 2], Sampling(max_new_tokens=1)))
    assert len(idents) == 3 and len(set(idents)) == 1 and threading.get_ident() not in idents


def test_a_stop_string_ends_the_answer_before_it_streamed_or_not(tiny_lm, pack) -> None:
    from packstore.kv.inject import cache_from_pack, finish, generate_stream, prepare

    free = answer_with_pack(tiny_lm, pack, QUESTIONS[0], GREEDY)
    full = tiny_lm.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = full.strip()[4:7]  # a string the free answer holds, past its start
    stopped = answer_with_pack(tiny_lm, pack, QUESTIONS[0], Sampling(max_new_tokens=24, stop=(stop, "never-generated")))
    assert stopped.text == full[: full.find(stop)].strip() and len(stopped.token_ids) < len(free.token_ids)
    rendering = prepare(tiny_lm, pack.header, QUESTIONS[0])
    deltas = TextDeltas(tiny_lm.tokenizer, (stop,))
    tokens = generate_stream(tiny_lm, rendering.token_ids, Sampling(max_new_tokens=24, stop=(stop,)), cache_from_pack(pack, tiny_lm.device))
    streamed = [deltas.add(token) for token in tokens]
    assert "".join(streamed) + deltas.rest() == full[: full.find(stop)] and stop not in "".join(streamed)
    assert finish(generate_stream(tiny_lm, rendering.token_ids, Sampling(max_new_tokens=24, stop=(stop,)), cache_from_pack(pack, tiny_lm.device))).text == stopped.text


@pytest.mark.parametrize("stop", [("",), tuple("abcdefghijklmnopq"), ("x" * 257,)])
def test_bad_stop_strings_are_refused(stop) -> None:
    with pytest.raises(InvalidInput, match="stop takes"):
        Sampling(stop=stop)


def test_text_held_back_as_a_possible_stop_comes_out_when_no_stop_follows(tiny_lm) -> None:
    ids = tiny_lm.tokenizer.encode("ab end", add_special_tokens=False)
    deltas = TextDeltas(tiny_lm.tokenizer, ("endless",))
    assert "".join(deltas.add(token) for token in ids) + deltas.rest() == "ab end" and deltas.text == "ab end"
