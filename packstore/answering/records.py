"""What answering a question returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class AnswerResult:
    """One question answered with a pack, and optionally with the same facts as prompt text."""

    question: str
    answer: str
    kv_prompt_tokens: int
    rag_answer: str | None = None
    rag_prompt_tokens: int | None = None
    identical: bool | None = None  # with compare_rag: the same token ids as the facts as text, prefilled in one pass
    # with compare_rag: the same token ids as the pack's text prefilled in its recorded passes, then the question (the
    # exactness a pack promises); None where its header records no prefill (written before it was, or spliced)
    chunked_identical: bool | None = None
    pack: str | None = None
    pack_tokens: int | None = None  # the pack's facts tokens: served from its cache, never prefilled for this answer
    bank: str | None = None
    facts: list[str] | None = None  # with a bank: the routed facts the pack holds, best first
    pack_reused: bool | None = None  # with a bank: the facts' pack was already stored
    cache_hit: bool | None = None  # the pack's tensors were already in the ready-cache
    parts: list[str] | None = None  # several packs (or packs and a bank): the part keys composed, in order
    composed_tokens: int | None = None  # tokens prefilled to compose the pack for this answer (0 when it was ready)
    steering: list[dict] | None = None  # steering packs applied: each {"pack": key, "alpha", "layers": [first, last]}
    steer_on: str | None = None  # with steering: what the deltas were added to ("values", or the key control)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
