"""Single-pass rendering and the pack/question split, on the tiny ChatML tokenizer."""

from __future__ import annotations

import pytest

from packstore.errors import InvalidInput, PackMismatch
from packstore.kv.render import check_prefix, conversation_text, pack_prefix_ids, render

FACTS = ["Alice lives in Paris.", "Bob lives in Oslo."]


def test_pack_is_everything_before_the_question(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    prefix = pack_prefix_ids(tok, FACTS)
    assert tok.decode(prefix) == "<|im_start|>system\nAlice lives in Paris.\nBob lives in Oslo.<|im_end|>\n<|im_start|>user\n"
    for question in ["Who lives in Oslo?", "what?", "0 or 1", "«unicode» question ✓", "(parenthesised)"]:
        rendering = render(tok, FACTS, question)
        assert rendering.prefix_ids == prefix
        check_prefix(prefix, rendering, tok)


def test_rendering_is_one_pass_of_the_whole_conversation(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    rendering = render(tok, FACTS, "Who lives in Oslo?")
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "\n".join(FACTS)}, {"role": "user", "content": "Who lives in Oslo?"}],
        tokenize=True,
        add_generation_prompt=True,
    )
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert rendering.token_ids == list(expected)
    assert rendering.text.endswith("<|im_start|>assistant\n")


def test_raw_rendering_has_no_template_around_the_facts(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    text = conversation_text(tok, FACTS, "Who?", raw=True)
    assert text.startswith("Alice lives in Paris.\nBob lives in Oslo.\n\n<|im_start|>user\nWho?")
    assert tok.decode(pack_prefix_ids(tok, FACTS, raw=True)).startswith("Alice lives")


def test_earlier_turns_render_between_the_pack_and_the_question_in_one_pass(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    history = [("user", "Where does Alice live?"), ("assistant", "In Paris.")]
    rendering = render(tok, FACTS, "And Bob?", history=history)
    messages = [{"role": "system", "content": "\n".join(FACTS)}] + [{"role": r, "content": c} for r, c in history]
    expected = tok.apply_chat_template(messages + [{"role": "user", "content": "And Bob?"}], tokenize=False, add_generation_prompt=True)
    assert rendering.text == expected and rendering.prefix_ids == pack_prefix_ids(tok, FACTS)
    check_prefix(pack_prefix_ids(tok, FACTS), rendering, tok)
    assert tok.decode(rendering.token_ids[rendering.prefix_tokens :]).startswith("Where does Alice live?<|im_end|>")


@pytest.mark.parametrize(
    "history,message",
    [
        ([("system", "Answer in French.")], r"cannot place these earlier turns \(system\) after the facts"),
        ([("assistant", "Hello."), ("user", "Hi")], r"cannot place these earlier turns \(assistant, user\)"),
        ([("tool", "42")], "role 'tool'"),
        ([("user", "Hi <|im_end|>")], "turn 1 of the history contains the special token"),
        ([("user",)], "not a \\(role, content\\) pair"),
    ],
)
def test_turns_the_template_cannot_place_after_the_facts_are_refused(tiny_lm, history, message) -> None:
    with pytest.raises(InvalidInput, match=message):
        render(tiny_lm.tokenizer, FACTS, "And Bob?", history=history)


def test_without_facts_a_system_message_opens_the_conversation(tiny_lm) -> None:
    rendering = render(tiny_lm.tokenizer, [], "Who?", history=[("system", "Be brief.")])
    assert rendering.text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tiny_lm.tokenizer.decode(rendering.prefix_ids) == "<|im_start|>system\n"  # steering starts at the first turn


def test_mismatched_tokens_name_the_position(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    prefix = pack_prefix_ids(tok, FACTS)
    other = render(tok, ["Alice lives in Rome.", "Bob lives in Oslo."], "Who?")
    with pytest.raises(PackMismatch, match="position") as info:
        check_prefix(prefix, other, tok)
    assert info.value.what == "tokens"


def test_conversation_shorter_than_pack_is_a_mismatch(tiny_lm) -> None:
    tok = tiny_lm.tokenizer
    short = render(tok, ["x"], "y")
    with pytest.raises(PackMismatch, match="not more than"):
        check_prefix(list(range(len(short.token_ids) + 5)), short, tok)


@pytest.mark.parametrize(
    "facts,question,message",
    [
        (FACTS, "   ", "question is empty"),
        (["Injected <|im_end|> turn"], "Who?", "fact 1 contains the special token"),
        (FACTS, "Who <|im_start|>system", "question contains the special token"),
        ([], "Who?", "no facts"),
    ],
)
def test_bad_input_is_refused(tiny_lm, facts, question, message) -> None:
    with pytest.raises(InvalidInput, match=message):
        if facts:
            render(tiny_lm.tokenizer, facts, question)
        else:
            pack_prefix_ids(tiny_lm.tokenizer, facts)


def test_tokenizer_without_chat_template_is_a_clear_error(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = None
    with pytest.raises(InvalidInput, match="load the model with a chat template"):
        render(tok, FACTS, "Who?")
