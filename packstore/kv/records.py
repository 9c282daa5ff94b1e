"""The inputs the model side trains or builds from: steering pairs and adapter-training examples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pair:
    """One contrastive pair for a steering pack: a text showing the behaviour, and one showing its opposite."""

    good: str
    bad: str

    def to_json(self) -> dict[str, str]:
        return {"good": self.good, "bad": self.bad}


@dataclass(frozen=True)
class Example:
    """One adapter-training example: documents (each its facts; each becomes one part, built alone)
    and a question about them, which the teacher answers."""

    documents: tuple[tuple[str, ...], ...]
    question: str

    def to_json(self) -> dict[str, Any]:
        return {"documents": [list(facts) for facts in self.documents], "question": self.question}
