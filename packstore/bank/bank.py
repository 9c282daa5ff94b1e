"""Build, extend and route banks: k-means over fact embeddings (faiss) fused with a BM25 index of every fact."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

import numpy as np

from packstore.bank.embedder import BankEmbedder, load_embedder
from packstore.bank.fusion import Additive, Candidates, Fusion, LexicalLead
from packstore.bank.lexical import LEXICAL_KIND, LexicalIndex
from packstore.bank.onnx_models import CROSS_MINILM, CrossEncoder, load_cross_encoder
from packstore.bank.rerank import Reranker, reranker
from packstore.errors import InvalidInput, PackMismatch, StoreBusy
from packstore.extras import check_extra, require_extra
from packstore.format.bank import DEFAULT_VECTORS, VECTOR_KINDS, BankMeta, Cluster, quantize
from packstore.store.bank_records import BankChanged, StoredBanks
from packstore.store.protocol import (
    DEFAULT_EMBEDDER,
    DEFAULT_TOP_K,
    BankReads,
    BankStore,
    BankTables,
    BankWrites,
    ServesBanks,
    check_name,
)
from packstore.store.records import Route

FACTS_PER_CLUSTER = 20
ROUTE_MODES = ("hybrid", "dense", "lexical")  # how a bank ranks facts (route); the first is the default
MIN_PROBE = 5  # clusters probed at least, when the caller names no probe count
PROBED_SHARE = 0.002  # of a bank's clusters probed, when the caller names no probe count
MAX_QUERY_CHARS = 100_000
# How hybrid routes fuse cosine and BM25 (bank/fusion.py): cosine + 0.4 x BM25 / the query's best BM25, and a fact whose
# BM25 is at least 1.5 x every other's first. Chosen by its worst shortfall over the tuning data only (issue 54;
# docs/evaluation.md, tools/eval_fusion.py); cosine + 0.2 x the share before, which let a fact 0.2 higher in cosine
# beat an exact match on a rare name.
FUSION: Fusion = LexicalLead(Additive(0.4), 1.5)
ADD_ATTEMPTS = 8  # times an add is computed again when concurrent writers keep changing the bank
LEXICAL_CANDIDATES = 20  # best BM25 facts whose clusters are ranked besides the probed ones
_Cached = TypeVar("_Cached")


def default_probe(clusters: int) -> int:
    """Clusters to probe when the caller names none: 0.2 % of the bank's clusters, at least 5.

    A fixed count does not scale: as clusters get finer, a paraphrased query's own fact sits further down
    the centroid ranking (docs/benchmarks.md, "Banks"), while ranking costs only the facts of a probed cluster.
    """
    return max(MIN_PROBE, math.ceil(clusters * PROBED_SHARE))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unique_facts(facts: Sequence[str]) -> list[str]:
    """Stripped, non-empty, first occurrence of each: a bank holds every fact once."""
    seen: dict[str, None] = {}
    for fact in facts:
        if fact and fact.strip():
            seen.setdefault(fact.strip(), None)
    if not any(re.search(r"\w", fact) for fact in seen):
        raise InvalidInput("no facts: a bank needs at least one fact with a letter or digit")
    return list(seen)


FLAT_KMEANS_MAX_CLUSTERS = 1024


def _flat_kmeans(vectors: np.ndarray, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    faiss = require_extra("faiss", "bank")
    if clusters == 1:
        centroid = vectors.mean(axis=0, keepdims=True)
        return centroid / max(float(np.linalg.norm(centroid)), 1e-12), np.zeros(len(vectors), dtype=np.int64)
    model = faiss.Kmeans(
        vectors.shape[1], clusters, niter=20, seed=seed, spherical=True, min_points_per_centroid=1, max_points_per_centroid=1 << 30
    )
    model.train(vectors)
    _, assignment = model.index.search(vectors, 1)
    return np.ascontiguousarray(model.centroids, dtype=np.float32), assignment[:, 0]


def kmeans(vectors: np.ndarray, clusters: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means (faiss): unit-length centroids and each vector's cluster.

    Flat k-means costs N x k per iteration, so past ``FLAT_KMEANS_MAX_CLUSTERS`` it runs in two
    levels: about sqrt(k) coarse clusters, each split into clusters in proportion to its size.
    """
    clusters = min(clusters, len(vectors))
    if clusters <= FLAT_KMEANS_MAX_CLUSTERS:
        return _flat_kmeans(vectors, clusters, seed)
    coarse = round(clusters**0.5)
    _, groups = _flat_kmeans(vectors, coarse, seed)
    centroids: list[np.ndarray] = []
    assignment = np.zeros(len(vectors), dtype=np.int64)
    for group in range(coarse):
        members = np.flatnonzero(groups == group)
        if not len(members):
            continue
        share = max(1, min(len(members), round(clusters * len(members) / len(vectors))))
        fine_centroids, fine = _flat_kmeans(vectors[members], share, seed + 1 + group)
        assignment[members] = fine + sum(len(c) for c in centroids)
        centroids.append(fine_centroids)
    return np.concatenate(centroids), assignment


def _check_embedder(meta: BankMeta, embedder: BankEmbedder) -> None:
    if meta.embedder_fp != embedder.fingerprint:
        raise PackMismatch(
            "embedder",
            f"embedder mismatch: bank {meta.name!r} was built with {meta.embedder!r} (embedder_fp {meta.embedder_fp[:12]}), "
            f"the query embedder {embedder.name!r} has embedder_fp {embedder.fingerprint[:12]}",
        )


def _group(ids: np.ndarray, vectors: np.ndarray, texts: list[str], assignment: np.ndarray, kind: str) -> dict[int, Cluster]:
    """Facts split by cluster, in their original order inside each, embeddings stored as ``kind``.

    One stable sort, not a scan per cluster.
    """
    order = np.argsort(assignment, kind="stable")
    cluster_ids, starts = np.unique(assignment[order], return_index=True)
    if kind == "int8":
        codes, scales = quantize(vectors)
        everything = Cluster(ids=ids, embeddings=codes, texts=texts, scales=scales)
    else:
        everything = Cluster(ids=ids, embeddings=vectors.astype(np.float16), texts=texts)
    return {cluster_id: everything.take(members) for cluster_id, members in zip(cluster_ids.tolist(), np.split(order, starts[1:]))}


def build_bank(
    store: BankWrites, name: str, facts: Sequence[str], embedder: BankEmbedder, *, vectors: str = DEFAULT_VECTORS, progress: bool = False
) -> BankMeta:
    """Embed every fact, cluster into about N/20 clusters, and store the bank (replacing one of that name).

    ``vectors`` "int8" stores each fact's embedding as int8 codes and a scale (half of "fp16").
    """
    check_name(name)
    if vectors not in VECTOR_KINDS:
        raise InvalidInput(f"unknown vector storage {vectors!r}: use one of {', '.join(VECTOR_KINDS)}")
    facts = unique_facts(facts)
    embedded = embedder.embed(facts, progress=progress)
    centroids, assignment = kmeans(embedded, max(1, round(len(facts) / FACTS_PER_CLUSTER)))
    now = _now()
    meta = BankMeta(
        name=name, embedder=embedder.name, embedder_fp=embedder.fingerprint, dim=embedded.shape[1],
        facts=len(facts), clusters=len(centroids), next_fact_id=len(facts), created=now, updated=now, lexical=LEXICAL_KIND,
        vectors=vectors,
    )
    clusters = _group(np.arange(len(facts), dtype=np.uint32), embedded, facts, assignment, vectors)
    store.put_bank(meta, centroids, clusters, LexicalIndex.build(clusters, len(centroids)).to_bytes())
    return meta


class BankCache:
    """What a program keeps between bank calls: the embedders it loaded (about a second each), by specifier, and the
    last ``RECORDS_KEPT`` bank records it decoded (centroids, full-text indexes), keyed by their seal so that a
    rebuilt bank misses. The program's entry point makes one and hands it to every ``LocalBanks``."""

    RECORDS_KEPT = 16

    def __init__(self) -> None:
        self._embedders: dict[str, BankEmbedder] = {}
        self._cross: dict[str, CrossEncoder] = {}
        self._records: dict[tuple[str | bytes, ...], object] = {}
        self._lock = threading.Lock()

    def embedder(self, spec: str) -> BankEmbedder:
        """The embedder ``spec`` names, loaded on first use."""
        with self._lock:
            if spec not in self._embedders:
                self._embedders[spec] = load_embedder(spec)
            return self._embedders[spec]

    def cross_encoder(self, spec: str = CROSS_MINILM) -> CrossEncoder:
        """The cross-encoder ``spec`` names (``onnx_models``), loaded on first use."""
        with self._lock:
            if spec not in self._cross:
                check_extra("route")
                self._cross[spec] = load_cross_encoder(spec)
            return self._cross[spec]

    def record(self, key: tuple[str | bytes, ...], load: Callable[[], _Cached]) -> _Cached:
        """``load()``, kept under ``key`` (which ends with the record's seal)."""
        with self._lock:
            found = self._records.get(key)
        if found is None:
            found = load()
            with self._lock:
                if len(self._records) >= self.RECORDS_KEPT:
                    self._records.pop(next(iter(self._records)))
                self._records[key] = found
        return found  # type: ignore[return-value]


def _kept(cache: BankCache | None, key: tuple[str | bytes, ...], load: Callable[[], _Cached]) -> _Cached:
    return load() if cache is None else cache.record(key, load)


def centroids_of(store: BankReads, name: str, cache: BankCache | None = None) -> np.ndarray:
    """A bank's centroid matrix (float32), read and verified once per build when ``cache`` keeps it."""
    key = (str(store.path), name, "centroids", store.bank_centroids_seal(name))
    # aligned as well as contiguous: a matrix read in place from a store record may start at any byte, and NumPy
    # multiplies an unaligned one without BLAS (2.7 ms instead of 0.06 ms for 5,000 centroids)
    return _kept(cache, key, lambda: np.require(store.bank_centroids(name), dtype=np.float32, requirements=("C", "A")))


def lexical_index_of(store: BankReads, name: str, cache: BankCache | None = None) -> LexicalIndex | None:
    """A bank's full-text index, read once per build or addition; None for a bank built without one."""
    seal = store.bank_lexical_seal(name)
    if seal is None:
        return None

    def load() -> LexicalIndex | None:
        record = store.bank_lexical(name)
        return LexicalIndex.from_record(record) if record is not None else None  # (removed since its seal was read)

    return _kept(cache, (str(store.path), name, "lexical", seal), load)


def nearest_centroids(vectors: np.ndarray, centroids: np.ndarray, count: int) -> np.ndarray:
    """Per vector, the indices of the ``count`` centroids of highest cosine, best first.

    NumPy, so that a store service routes without torch; only the ``count`` best of each row are sorted.
    """
    scores = np.ascontiguousarray(vectors, dtype=np.float32) @ centroids.T
    kept = np.argpartition(-scores, min(count, centroids.shape[0]) - 1, axis=1)[:, :count]
    order = np.argsort(-np.take_along_axis(scores, kept, axis=1), axis=1, kind="stable")
    return np.take_along_axis(kept, order, axis=1)


def add_facts(
    store: BankWrites, name: str, facts: Sequence[str], embedder: BankEmbedder, *, progress: bool = False, cache: BankCache | None = None
) -> BankMeta:
    """Add facts to an existing bank without re-clustering: each joins its nearest centroid's cluster.

    The full-text index is rebuilt over all the bank's facts (BM25 statistics cover every document).
    The update is computed from the bank as read and written only if it is still that bank; when
    another add or a rebuild got in between, it is computed again from the new state (the new
    facts' embeddings are kept), so concurrent adds never lose facts.
    """
    _check_embedder(store.bank(name), embedder)
    facts = unique_facts(facts)
    vectors = embedder.embed(facts, progress=progress)
    for _ in range(ADD_ATTEMPTS):
        meta = store.bank(name)
        _check_embedder(meta, embedder)
        updated, merged, lexical = _additions(store, meta, facts, vectors, cache)
        try:
            store.update_bank(updated, merged, lexical, expected=meta)
        except BankChanged:
            continue
        return updated
    raise StoreBusy(f"bank {name!r} kept changing while facts were being added ({ADD_ATTEMPTS} attempts); try again")


def _additions(
    store: BankReads, meta: BankMeta, facts: list[str], vectors: np.ndarray, cache: BankCache | None
) -> tuple[BankMeta, dict[int, Cluster], bytes]:
    """The metadata, changed clusters and full-text index record of ``meta``'s bank with ``facts`` added."""
    name = meta.name
    assignment = nearest_centroids(vectors, centroids_of(store, name, cache), 1)[:, 0]
    ids = np.arange(meta.next_fact_id, meta.next_fact_id + len(facts), dtype=np.uint32)
    additions = _group(ids, vectors, facts, assignment, meta.vectors)
    current = store.bank_clusters(name, list(range(meta.clusters)))
    merged = {}
    for cluster_id, added in additions.items():
        old = current[cluster_id]
        if old is None:
            merged[cluster_id] = added
            continue
        known = set(old.texts)
        merged[cluster_id] = Cluster.joined([old, added.take([i for i, text in enumerate(added.texts) if text not in known])])
    added_count = sum(len(c.texts) for c in merged.values()) - sum(len(was.texts) for c in merged if (was := current[c]) is not None)
    changes = {"facts": meta.facts + added_count, "next_fact_id": int(ids[-1]) + 1, "updated": _now(), "lexical": LEXICAL_KIND}
    updated = BankMeta(**{**meta.__dict__, **changes})
    return updated, merged, LexicalIndex.build({**current, **merged}, meta.clusters).to_bytes()


def _lexical_candidates(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` highest positive scores (any order)."""
    positive = np.flatnonzero(scores > 0)
    if len(positive) > count:
        positive = positive[np.argpartition(-scores[positive], count)[:count]]
    return positive


def _fact_documents(index: LexicalIndex, cluster_id: int, rows: int) -> np.ndarray:
    """Document indices of a cluster's rows; -1 for rows added after the index was read."""
    start, end = (int(x) for x in index.cluster_starts[cluster_id : cluster_id + 2])
    documents = np.arange(start, start + rows)
    documents[end - start :] = -1
    return documents


def route(
    store: BankReads,
    name: str,
    queries: Sequence[str],
    embedder: BankEmbedder | None,
    *,
    top_k: int = DEFAULT_TOP_K,
    probe: int | None = None,
    mode: str = "hybrid",
    cache: BankCache | None = None,
    rare_facts: int = 0,
) -> list[Route]:
    """Per query, the ``top_k`` best facts: the facts of the ``probe`` nearest clusters and of the best BM25 hits.

    ``mode`` "hybrid" scores by ``FUSION`` (cosine + 0.4 x BM25 / the query's best BM25, a decisive BM25 lead
    first), so a fact whose rare words the query shares can win without its cluster being probed; "dense" ranks the
    probed clusters by cosine alone, "lexical" the BM25 hits by BM25 alone, without the embedder (None there: no
    model stack needed). ``probe`` None probes ``default_probe`` of the bank's cluster count. ``rare_facts`` widens a
    hybrid route's pool by the clusters of up to that many facts holding the query's rarest terms
    (``LexicalIndex.rare_term_documents``): what the cross stage reranks from (``Reranker.rare_facts``).
    """
    if not queries:
        raise InvalidInput("no queries: give at least one")
    if top_k < 1 or (probe is not None and probe < 1):
        raise InvalidInput("top_k and probe must be at least 1")
    if rare_facts < 0:
        raise InvalidInput(f"rare_facts must be 0 or more, not {rare_facts}")
    if mode not in ROUTE_MODES:
        raise InvalidInput(f"unknown route mode {mode!r}: use one of {', '.join(ROUTE_MODES)}")
    for query in queries:
        if not query.strip():
            raise InvalidInput("the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise InvalidInput(f"the query has {len(query)} characters; the limit is {MAX_QUERY_CHARS}")
    meta = store.bank(name)
    dense = mode != "lexical"
    if dense:
        if embedder is None:
            raise InvalidInput(f"{mode} routing needs the bank's embedder")
        _check_embedder(meta, embedder)
    lexical = lexical_index_of(store, name, cache) if mode != "dense" else None
    if mode == "lexical" and lexical is None:
        raise InvalidInput(f"bank {name!r} has no full-text index (built by an older version): add facts or rebuild it")
    if probe is None:
        probe = default_probe(meta.clusters)
    started = time.perf_counter()
    vectors = embedder.embed_queries([q.strip() for q in queries]) if dense and embedder is not None else None
    embedded = time.perf_counter()
    nearest = nearest_centroids(vectors, centroids_of(store, name, cache), probe).tolist() if vectors is not None else [[] for _ in queries]
    routed = time.perf_counter()
    per_query = {"embed": (embedded - started) / len(queries), "route": (routed - embedded) / len(queries)}
    widen = rare_facts if mode == "hybrid" else 0  # lexical's top facts are among the BM25 hits already
    routes = []
    for i, query in enumerate(queries):
        started = time.perf_counter()
        pool, texts, candidates = _candidates(store, name, query, None if vectors is None else vectors[i], nearest[i], lexical, widen)
        routes.append(_rank(query, pool, texts, candidates, top_k, mode, per_query | {"lexical": time.perf_counter() - started}))
    return routes


def _rank(query: str, pool: list[int], texts: list[str], candidates: Candidates, top_k: int, mode: str, seconds: dict[str, float]) -> Route:
    """Score the pool's facts (``_candidates``) as ``mode`` ranks them; keep ``top_k``."""
    searched = time.perf_counter()
    if mode == "dense" or not len(texts):
        scores = candidates.cosine
    elif mode == "lexical":
        best = float(candidates.bm25.max())
        scores = candidates.bm25 / best if best > 0 else candidates.bm25
    else:
        scores = FUSION(candidates) if candidates.bm25.any() else candidates.cosine
    best_first = np.argsort(-scores, kind="stable")
    if mode == "lexical":
        best_first = best_first[scores[best_first] > 0]  # facts that only share a cluster with a hit do not count
    best_first = best_first[:top_k]
    finished = time.perf_counter()
    return Route(
        query=query,
        clusters=pool,
        facts=[(texts[i], float(scores[i])) for i in best_first],
        seconds=seconds | {"rank": finished - searched},
    )


def _candidates(
    store: BankReads,
    name: str,
    query: str,
    vector: np.ndarray | None,
    probed: list[int],
    lexical: LexicalIndex | None,
    rare_facts: int,
) -> tuple[list[int], list[str], Candidates]:
    """The clusters ranked (the probed ones, then those holding the best BM25 hits, then those holding up to
    ``rare_facts`` facts with the query's rarest terms), their facts, and each fact's cosine with ``vector`` (zeros
    without one) and BM25 (zeros without an index)."""
    bm25 = lexical.scores(query) if lexical is not None else None
    hits = _lexical_candidates(bm25, LEXICAL_CANDIDATES) if bm25 is not None else np.zeros(0, dtype=np.int64)
    if lexical is not None and bm25 is not None and rare_facts and hits.size:
        hits = np.concatenate([hits, lexical.rare_term_documents(query, bm25, rare_facts)])
    pool = list(dict.fromkeys(probed + [cluster for cluster, _ in lexical.locate(hits)])) if lexical is not None else probed
    found = [(cluster_id, c) for cluster_id, c in store.bank_clusters(name, pool).items() if c is not None and c.texts]
    texts = [t for _, c in found for t in c.texts]
    cosine = np.zeros(len(texts), dtype=np.float32)
    if found and vector is not None:
        cosine = np.concatenate([c.vectors() for _, c in found]) @ np.asarray(vector, dtype=np.float32)
    shared = np.zeros(len(texts), dtype=np.float32)
    if found and lexical is not None and bm25 is not None and len(hits):
        documents = np.concatenate([_fact_documents(lexical, cluster_id, len(c.texts)) for cluster_id, c in found])
        shared = np.where(documents >= 0, bm25[np.maximum(documents, 0)], 0).astype(np.float32)
    return pool, texts, Candidates(cosine=cosine, bm25=shared)


def route_candidates(
    store: BankReads,
    name: str,
    queries: Sequence[str],
    embedder: BankEmbedder,
    *,
    probe: int | None = None,
    cache: BankCache | None = None,
    rare_facts: int = 0,
) -> list[tuple[list[str], Candidates]]:
    """Per query, every fact a hybrid route (with ``rare_facts``) ranks and its evidence (cosine, BM25) before
    fusion: what tools/eval/eval_fusion.py and eval_cross.py compare rules on, exactly as ``route`` would rank them."""
    meta = store.bank(name)
    _check_embedder(meta, embedder)
    lexical = lexical_index_of(store, name, cache)
    vectors = embedder.embed_queries([q.strip() for q in queries])
    nearest = nearest_centroids(vectors, centroids_of(store, name, cache), probe or default_probe(meta.clusters)).tolist()
    found = []
    for query, vector, probed in zip(queries, vectors, nearest):
        _, texts, candidates = _candidates(store, name, query, vector, probed, lexical, rare_facts)
        found.append((texts, candidates))
    return found


class LocalBanks(StoredBanks):
    """Bank operations on a store this process holds (LMDB or object tier): ``StoredBanks``' record operations, and
    building, adding and routing with embedders named by specifier (as over the service), loaded and kept in
    ``cache`` (a fresh one, for this object alone, when None)."""

    store: BankTables  # StoredBanks needs only its BankAdmin; building and routing need the rest

    def __init__(self, store: BankTables, cache: BankCache | None = None) -> None:
        super().__init__(store)
        self.cache = cache if cache is not None else BankCache()

    def build(
        self, name: str, facts: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, vectors: str = DEFAULT_VECTORS, progress: bool = False
    ) -> BankMeta:
        return build_bank(self.store, name, facts, self.cache.embedder(embedder), vectors=vectors, progress=progress)

    def add(self, name: str, facts: Sequence[str], embedder: str | None = None, *, progress: bool = False) -> BankMeta:
        return add_facts(self.store, name, facts, self._embedder(name, embedder), progress=progress, cache=self.cache)

    def route(
        self,
        name: str,
        queries: Sequence[str],
        embedder: str | None = None,
        *,
        top_k: int = DEFAULT_TOP_K,
        probe: int | None = None,
        mode: str = "hybrid",
        rerank: str = "none",
        rerank_weight: float | None = None,
    ) -> list[Route]:
        chosen = None if mode == "lexical" else self._embedder(name, embedder)  # BM25 alone: no embedder to load
        second = self._reranker(name, embedder, rerank, rerank_weight)
        top, widen = (top_k, 0) if second is None else (second.routed_for(top_k), second.rare_facts)
        routes = route(self.store, name, queries, chosen, top_k=top, probe=probe, mode=mode, cache=self.cache, rare_facts=widen)
        return routes if second is None else [second.apply(found, top_k) for found in routes]

    def _reranker(self, name: str, embedder: str | None, rerank: str, weight: float | None) -> Reranker | None:
        """The second stage ``rerank`` names, with what this process holds (``late``: the embedder the route uses;
        InvalidInput for ``lm``)."""
        if rerank == "lm":
            raise InvalidInput("rerank 'lm' scores facts with a language model, which the store does not hold: rerank where the model is")
        if rerank == "late":
            return reranker("late", embedder=self._embedder(name, embedder), weight=weight)
        return reranker(rerank, cross=self.cache.cross_encoder() if rerank == "cross" else None, weight=weight)

    def _embedder(self, name: str, spec: str | None) -> BankEmbedder:
        """The named embedder, or the one the bank records when ``spec`` is None."""
        return self.cache.embedder(spec if spec is not None else self.store.bank(name).embedder)


def open_banks(store: object, cache: BankCache | None = None) -> BankStore:
    """The banks beside ``store``: the service's own when it serves them (routing runs there), else ``LocalBanks``
    over its bank tables with ``cache``; InvalidInput for a store that keeps no banks."""
    if isinstance(store, ServesBanks):
        return store.banks()
    if isinstance(store, BankTables):
        return LocalBanks(store, cache)
    raise InvalidInput(f"{type(store).__name__} keeps no banks")
