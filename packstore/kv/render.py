"""Render facts + question in one pass with the chat template, and find where the pack ends.

A pack holds the tokens of everything the rendering puts before the question: for ChatML that is
the whole system turn plus the user-turn header; for Gemma, whose template has no system role, the
turn header plus the facts at the top of the first user turn. The split point is found by rendering
the conversation once with a sentinel question and cutting at the last token that ends before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from packstore.errors import InvalidInput, PackMismatch

QUESTION_SENTINEL = "Question_placeholder_for_packstore_split"
ERRATUM_PREFIX = "Correction: "  # an erratum is rendered as one more line: this prefix, then its text


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


def conversation_text(tokenizer: Any, facts: Sequence[str], question: str, *, raw: bool) -> str:
    """The full prompt text: facts as the system message (or, raw, as bare text) then the user question.

    Without facts (a question steered with no knowledge) it is the user question alone, rendered as
    the template renders a conversation without a system message."""
    try:
        if not facts:
            return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        if not raw:
            return tokenizer.apply_chat_template(
                [{"role": "system", "content": facts_text(facts)}, {"role": "user", "content": question}],
                tokenize=False,
                add_generation_prompt=True,
            )
        turn = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    except ValueError as exc:  # transformers raises ValueError when no chat template is set
        raise InvalidInput(f"the model's tokenizer cannot render a chat: {exc}; load the model with a chat template") from None
    lead = ""
    if _adds_bos(tokenizer) and turn.startswith(tokenizer.bos_token):
        lead, turn = tokenizer.bos_token, turn[len(tokenizer.bos_token) :]
    return lead + facts_text(facts) + "\n\n" + turn


def render(tokenizer: Any, facts: Sequence[str], question: str, *, raw: bool = False) -> Rendering:
    """Render and tokenize the whole conversation once; ``prefix_tokens`` counts the tokens before the question."""
    if not question.strip():
        raise InvalidInput("the question is empty")
    for index, fact in enumerate(facts):
        check_no_special_tokens(tokenizer, f"fact {index + 1}", fact)
    check_no_special_tokens(tokenizer, "the question", question)
    text = conversation_text(tokenizer, facts, question, raw=raw)
    probe = conversation_text(tokenizer, facts, QUESTION_SENTINEL, raw=raw)
    if probe.count(QUESTION_SENTINEL) != 1:
        raise InvalidInput("the chat template does not place the question exactly once; cannot split a pack from it")
    question_start = probe.index(QUESTION_SENTINEL)
    if not text.startswith(probe[:question_start]):
        raise InvalidInput("the chat template renders the text before the question differently per question")
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    prefix = 0
    for _, end in encoding["offset_mapping"]:
        if end > question_start:
            break
        prefix += 1
    offsets = [tuple(pair) for pair in encoding["offset_mapping"]]
    return Rendering(text=text, token_ids=list(encoding["input_ids"]), prefix_tokens=prefix, offsets=offsets)


def pack_prefix_ids(tokenizer: Any, facts: Sequence[str], *, raw: bool = False) -> list[int]:
    """The token ids a pack for ``facts`` holds: the rendering's tokens before any question."""
    if not facts:
        raise InvalidInput("no facts: a pack needs at least one non-empty fact")
    return render(tokenizer, facts, QUESTION_SENTINEL, raw=raw).prefix_ids


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
