"""What a client sends a serving engine (vLLM) so that a stored pack applies to its request.

An engine's KV connector cannot add tokens to a prompt: the client sends the pack's own rendering followed by
the question, and the pack saves the prefill of its part. This renders that prompt once, in a single pass (as
``packctl ask`` does), checks the pack's token ids are exactly its first tokens, and gives it both as chat
messages (what a chat API renders with the same template) and as token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packstore.errors import PackMismatch
from packstore.format.header import PREFIX_KINDS, PackHeader
from packstore.kv.identity import template_fingerprint
from packstore.kv.render import check_prefix, facts_text, render


@dataclass(frozen=True)
class PackPrompt:
    """A pack's facts and a question rendered as one prompt whose first ``pack_tokens`` ids the pack holds."""

    key: str
    model: str
    messages: list[dict[str, str]] | None  # None for a raw pack: no chat messages render as its bare text
    prompt: str
    prompt_token_ids: list[int]
    pack_tokens: int
    raw: bool

    def to_json(self) -> dict[str, Any]:
        """``packctl render --json``: ``key``, ``model``, ``messages``, ``prompt``, ``prompt_token_ids``, ``pack_tokens``, ``raw``."""
        return dict(vars(self))


def pack_prompt(tokenizer: Any, header: PackHeader, question: str, *, model: str) -> PackPrompt:
    """The prompt for ``question`` with the pack of ``header``, rendered by ``tokenizer`` (of ``model``).

    Raises PackMismatch when the pack holds no prompt tokens (a steering or adapter pack, or soft tokens no prompt
    can carry), when the tokenizer's template identity is not the pack's, or when the pack's ids are not the
    rendering's first tokens.
    """
    if header.kind not in PREFIX_KINDS:
        raise PackMismatch("kind", f"pack {header.key} is a {header.kind} pack: it holds no prompt tokens to render")
    if header.soft_tokens:
        raise PackMismatch("kind", f"pack {header.key} holds trained soft tokens ({header.composition}): no prompt can carry them")
    try:
        header.check_identities(None, template_fingerprint(tokenizer))
    except PackMismatch as exc:
        raise PackMismatch(exc.what, f"{exc} (tokenizer of {model!r})") from None
    text = question.strip()
    rendering = render(tokenizer, header.facts, text, raw=header.raw)
    check_prefix(header.token_ids, rendering, tokenizer)
    messages = None if header.raw else [{"role": "system", "content": facts_text(header.facts)}, {"role": "user", "content": text}]
    return PackPrompt(
        key=header.key,
        model=model,
        messages=messages,
        prompt=rendering.text,
        prompt_token_ids=list(rendering.token_ids),
        pack_tokens=header.tokens,
        raw=header.raw,
    )
