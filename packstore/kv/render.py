"""Render facts + question in one pass with the chat template, and find where the pack ends.

A pack holds the tokens of everything the rendering puts before the question: for ChatML that is
the whole system turn plus the user-turn header; for Gemma, whose template has no system role, the
turn header plus the facts at the top of the first user turn. The split point is found by rendering
the conversation once with a sentinel question and cutting at the last token that ends before it.

Earlier turns of a conversation (``history``: system, user and assistant messages) are rendered between the pack's
prefix and the question, where the template places them; a conversation that changes the text before its first
message (a system message the template puts only first, say) cannot follow a pack and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from packstore.errors import InvalidInput, PackMismatch

QUESTION_SENTINEL = "Question_placeholder_for_packstore_split"
TURN_ROLES = ("system", "user", "assistant")
Turn = tuple[str, str]  # (role, content) of one earlier message


@dataclass(frozen=True)
class Rendering:
    """One conversation rendered and tokenized in a single pass."""

    text: str
    token_ids: list[int]
    prefix_tokens: int
    offsets: list[tuple[int, int]]  # each token's (start, end) characters in ``text``

    @property
    def prefix_ids(self) -> list[int]:
        return self.token_ids[: self.prefix_tokens]


def facts_text(facts: Sequence[str]) -> str:
    """The system-message text of a fact list: one fact a line."""
    return "\n".join(facts)


def _adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    ids = tokenizer("a").input_ids
    return bos is not None and bool(ids) and ids[0] == bos


def check_no_special_tokens(tokenizer: Any, what: str, text: str) -> None:
    """Text containing a literal special token would forge turn boundaries: refuse it."""
    for token in tokenizer.all_special_tokens:
        if token and token in text:
            raise InvalidInput(f"{what} contains the special token {token!r}, which would change the conversation's structure")


def conversation_text(tokenizer: Any, facts: Sequence[str], question: str, *, raw: bool, history: Sequence[Turn] = ()) -> str:
    """The full prompt text: facts as the system message (or, raw, as bare text), the ``history`` turns, then the
    user question.

    Without facts (a question steered with no knowledge) it is the conversation alone, rendered as the template
    renders one without the facts' system message."""
    messages = [{"role": role, "content": content} for role, content in history] + [{"role": "user", "content": question}]
    try:
        if not facts:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not raw:
            system = {"role": "system", "content": facts_text(facts)}
            return tokenizer.apply_chat_template([system, *messages], tokenize=False, add_generation_prompt=True)
        turn = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except ValueError as exc:  # transformers raises ValueError when no chat template is set
        raise InvalidInput(f"the model's tokenizer cannot render a chat: {exc}; load the model with a chat template") from None
    except TemplateError as exc:  # the template's own refusal, e.g. roles that do not alternate
        raise InvalidInput(f"the chat template cannot render this conversation: {exc}") from None
    lead = ""
    if _adds_bos(tokenizer) and turn.startswith(tokenizer.bos_token):
        lead, turn = tokenizer.bos_token, turn[len(tokenizer.bos_token) :]
    return lead + facts_text(facts) + "\n\n" + turn


def check_history(tokenizer: Any, history: Sequence[Turn]) -> None:
    """Refuse earlier turns that are not (role, text) pairs of a known role, or whose text holds a special token."""
    for index, turn in enumerate(history):
        if not (isinstance(turn, tuple | list) and len(turn) == 2 and all(isinstance(part, str) for part in turn)):
            raise InvalidInput(f"turn {index + 1} of the history is not a (role, content) pair of strings")
        if turn[0] not in TURN_ROLES:
            raise InvalidInput(f"turn {index + 1} has the role {turn[0]!r}: use one of {', '.join(TURN_ROLES)}")
        check_no_special_tokens(tokenizer, f"turn {index + 1} of the history", turn[1])


def render(tokenizer: Any, facts: Sequence[str], question: str, *, raw: bool = False, history: Sequence[Turn] = ()) -> Rendering:
    """Render and tokenize the whole conversation once; ``prefix_tokens`` counts the tokens before the question, or
    before the first of the ``history`` turns: the tokens a pack of ``facts`` holds."""
    if not question.strip():
        raise InvalidInput("the question is empty")
    for index, fact in enumerate(facts):
        check_no_special_tokens(tokenizer, f"fact {index + 1}", fact)
    check_no_special_tokens(tokenizer, "the question", question)
    check_history(tokenizer, history)
    text = conversation_text(tokenizer, facts, question, raw=raw, history=history)
    if history and not facts:  # no pack to follow: the split is where the first turn's text begins
        first = [(history[0][0], QUESTION_SENTINEL), *history[1:]]
        question_start = _sentinel_at(conversation_text(tokenizer, [], question, raw=raw, history=first))
    else:
        probe = conversation_text(tokenizer, facts, QUESTION_SENTINEL, raw=raw)  # the text a pack of these facts holds
        question_start = _sentinel_at(probe)
        if not text.startswith(probe[:question_start]):
            if not history:
                raise InvalidInput("the chat template renders the text before the question differently per question")
            roles = ", ".join(role for role, _ in history)
            raise InvalidInput(
                f"the chat template cannot place these earlier turns ({roles}) after the facts: it changes the text before "
                "the first turn (a system message, or a first turn not from the user, has no place there in this template); "
                "put instructions in the user message, or begin the history with a user turn"
            )
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    prefix = 0
    for _, end in encoding["offset_mapping"]:
        if end > question_start:
            break
        prefix += 1
    offsets = [tuple(pair) for pair in encoding["offset_mapping"]]
    return Rendering(text=text, token_ids=list(encoding["input_ids"]), prefix_tokens=prefix, offsets=offsets)


def _sentinel_at(probe: str) -> int:
    """Where the sentinel question starts in ``probe``, a rendering that must hold it exactly once."""
    if probe.count(QUESTION_SENTINEL) != 1:
        raise InvalidInput("the chat template does not place the question exactly once; cannot split a pack from it")
    return probe.index(QUESTION_SENTINEL)


def pack_prefix_ids(tokenizer: Any, facts: Sequence[str], *, raw: bool = False) -> list[int]:
    """The token ids a pack for ``facts`` holds: the rendering's tokens before any question."""
    if not facts:
        raise InvalidInput("no facts: a pack needs at least one non-empty fact")
    return render(tokenizer, facts, QUESTION_SENTINEL, raw=raw).prefix_ids


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens ``first`` and ``second`` share."""
    shared = 0
    for mine, theirs in zip(first, second):
        if mine != theirs:
            break
        shared += 1
    return shared


def preamble_tokens(tokenizer: Any) -> int:
    """The tokens every pack rendered with ``tokenizer``'s chat template begins with, whatever its facts (the
    template's framing before them): a prompt that agrees with a pack no further says nothing of its facts."""
    return common_prefix_length(pack_prefix_ids(tokenizer, ["A."]), pack_prefix_ids(tokenizer, ["Z."]))


def group_spans(tokenizer: Any, groups: Sequence[Sequence[str]], *, raw: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """The pack ids of all groups' facts in order, and for each group the [start, stop) token range
    lying wholly inside that group's facts text: where a part's own tokens sit in a composition."""
    facts = [fact for group in groups for fact in group]
    rendering = render(tokenizer, facts, QUESTION_SENTINEL, raw=raw)
    block = rendering.text.find(facts_text(facts))
    if block < 0:
        raise InvalidInput("the chat template does not render the facts verbatim; cannot locate them in the tokens")
    ids = rendering.prefix_ids
    offsets = rendering.offsets[: len(ids)]
    spans = []
    start = block
    for group in groups:
        stop = start + len(facts_text(group))
        inside = [i for i, (first, end) in enumerate(offsets) if first >= start and end <= stop and end > first]
        spans.append((inside[0], inside[-1] + 1) if inside else (0, 0))
        start = stop + 1  # the "\n" between groups
    return ids, spans


def check_prefix(pack_ids: Sequence[int], rendering: Rendering, tokenizer: Any) -> None:
    """Raise PackMismatch unless the pack's ids are exactly the first tokens of ``rendering``."""
    full = rendering.token_ids
    n = len(pack_ids)
    if len(full) > n and list(full[:n]) == list(pack_ids):
        return
    if len(full) <= n:
        raise PackMismatch("tokens", f"the conversation has {len(full)} tokens, not more than the pack's {n}")
    position = next(i for i in range(n) if full[i] != pack_ids[i])
    raise PackMismatch(
        "tokens",
        f"pack tokens differ from the conversation's at position {position}: pack has "
        f"{pack_ids[position]} ({tokenizer.convert_ids_to_tokens(int(pack_ids[position]))!r}), "
        f"conversation has {full[position]} ({tokenizer.convert_ids_to_tokens(int(full[position]))!r})",
    )
