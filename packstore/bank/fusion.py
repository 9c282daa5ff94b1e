"""How a bank route fuses its two kinds of evidence, cosine (the embedder's) and BM25 (the full-text index's), into
one score per candidate fact. Pure NumPy over a query's candidates, so that rules can be compared offline on dumped
candidates (``tools/eval_fusion.py``) exactly as ``route`` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Candidates:
    """One query's candidate facts: their cosine with the query (NaN where the route did not compute one: lexical
    mode) and their BM25 (0 where the fact shares no term, or was added after the index was read)."""

    cosine: np.ndarray
    bm25: np.ndarray


def ranks(values: np.ndarray) -> np.ndarray:
    """1-based rank of each value, highest first (ties by position)."""
    order = np.argsort(-values, kind="stable")
    found = np.empty(len(values), dtype=np.float64)
    found[order] = np.arange(1, len(values) + 1)
    return found


@dataclass(frozen=True)
class Additive:
    """cosine + ``weight`` x BM25 / the query's best BM25: the rule before issue 54 (weight 0.2)."""

    weight: float

    def __call__(self, c: Candidates) -> np.ndarray:
        best = float(c.bm25.max()) if len(c.bm25) else 0.0
        share = c.bm25 / best if best > 0 else np.zeros_like(c.bm25)
        return c.cosine + self.weight * share

    @property
    def name(self) -> str:
        return f"additive w={self.weight:g}"


@dataclass(frozen=True)
class RankFusion:
    """Reciprocal rank fusion: 1 / (k + dense rank) + ``lexical`` / (k + BM25 rank); facts sharing no term with the
    query get no BM25 part. A decisive lexical match (BM25 rank 1) counts as much as the dense rank 1, whatever the
    scale of the scores."""

    k: float
    lexical: float = 1.0

    def __call__(self, c: Candidates) -> np.ndarray:
        dense: np.ndarray = 1.0 / (self.k + ranks(c.cosine))
        lexical: np.ndarray = np.where(c.bm25 > 0, self.lexical / (self.k + ranks(c.bm25)), 0.0)
        fused: np.ndarray = dense + lexical
        return fused

    @property
    def name(self) -> str:
        return f"rrf k={self.k:g} lexical={self.lexical:g}"


@dataclass(frozen=True)
class LexicalLead:
    """``base``, except that when the best BM25 leads the second by at least ``ratio`` (one fact holds the query's
    rare terms and no other does), that fact goes first, its score 1 above the highest: no cosine can drown a
    decisive lexical match."""

    base: Additive | RankFusion
    ratio: float

    def __call__(self, c: Candidates) -> np.ndarray:
        scores = np.asarray(self.base(c), dtype=np.float64)
        if len(c.bm25) < 1 or c.bm25.max() <= 0:
            return scores
        order = np.argsort(-c.bm25, kind="stable")
        second = float(c.bm25[order[1]]) if len(order) > 1 else 0.0
        if second <= 0 or c.bm25[order[0]] >= self.ratio * second:
            scores = scores.copy()
            scores[order[0]] = scores.max() + 1.0
        return scores

    @property
    def name(self) -> str:
        return f"lead {self.ratio:g} over {self.base.name}"


Fusion = Additive | RankFusion | LexicalLead
