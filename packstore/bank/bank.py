"""Build, extend and route banks: k-means over fact embeddings (faiss), ranking inside routed clusters."""

from __future__ import annotations

import math
import re
import threading
import time
from datetime import datetime, timezone
from typing import Sequence

import numpy as np
import torch

from packstore.bank.embedder import Embedder, load_embedder
from packstore.errors import InvalidInput, PackMismatch
from packstore.format.bank import BankMeta, Cluster
from packstore.records import Route
from packstore.store.lmdb_store import LmdbStore
from packstore.store.protocol import check_name
from packstore.store.protocol import DEFAULT_EMBEDDER, DEFAULT_TOP_K, MIN_PROBE, PROBED_SHARE

FACTS_PER_CLUSTER = 20
_EMBEDDERS: dict[str, "Embedder"] = {}
_EMBEDDERS_LOCK = threading.Lock()
MAX_QUERY_CHARS = 100_000
LEXICAL_WEIGHT = 0.5
_WORD = re.compile(r"\w{3,}")


def default_probe(clusters: int) -> int:
    """Clusters to probe when the caller names none: 0.2 % of the bank's clusters, at least 5.

    A fixed count does not scale: as clusters get finer, a paraphrased query's own fact sits
    further down the centroid ranking (at a million facts, within the nearest 5 clusters for 55 %
    of queries, within 100 for all; docs/benchmarks.md). Ranking cost stays ~20 facts a probe.
    """
    return max(MIN_PROBE, math.ceil(clusters * PROBED_SHARE))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def unique_facts(facts: Sequence[str]) -> list[str]:
    """Stripped, non-empty, first occurrence of each: a bank holds every fact once."""
    seen: dict[str, None] = {}
    for fact in facts:
        if fact and fact.strip():
            seen.setdefault(fact.strip(), None)
    if not seen:
        raise InvalidInput("no facts: a bank needs at least one non-empty fact")
    return list(seen)


FLAT_KMEANS_MAX_CLUSTERS = 1024


def _flat_kmeans(vectors: np.ndarray, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    import faiss

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
    centroids, assignment = [], np.zeros(len(vectors), dtype=np.int64)
    for group in range(coarse):
        members = np.flatnonzero(groups == group)
        if not len(members):
            continue
        share = max(1, min(len(members), round(clusters * len(members) / len(vectors))))
        fine_centroids, fine = _flat_kmeans(vectors[members], share, seed + 1 + group)
        assignment[members] = fine + sum(len(c) for c in centroids)
        centroids.append(fine_centroids)
    return np.concatenate(centroids), assignment


def _check_embedder(meta: BankMeta, embedder: Embedder) -> None:
    if meta.embedder_fp != embedder.fingerprint:
        raise PackMismatch(
            "embedder",
            f"embedder mismatch: bank {meta.name!r} was built with {meta.embedder!r} (embedder_fp {meta.embedder_fp[:12]}), "
            f"the query embedder {embedder.name!r} has embedder_fp {embedder.fingerprint[:12]}",
        )


def _group(ids: np.ndarray, vectors: np.ndarray, texts: list[str], assignment: np.ndarray) -> dict[int, Cluster]:
    """Facts split by cluster, in their original order inside each: one stable sort, not a scan per cluster."""
    order = np.argsort(assignment, kind="stable")
    cluster_ids, starts = np.unique(assignment[order], return_index=True)
    halves = vectors.astype(np.float16)
    clusters: dict[int, Cluster] = {}
    for cluster_id, members in zip(cluster_ids.tolist(), np.split(order, starts[1:])):
        clusters[cluster_id] = Cluster(ids=ids[members], embeddings=halves[members], texts=[texts[i] for i in members])
    return clusters


def build_bank(store: LmdbStore, name: str, facts: Sequence[str], embedder: Embedder, *, progress: bool = False) -> BankMeta:
    """Embed every fact, cluster into about N/20 clusters, and store the bank (replacing one of that name)."""
    check_name(name)
    facts = unique_facts(facts)
    vectors = embedder.embed(facts, progress=progress)
    centroids, assignment = kmeans(vectors, max(1, round(len(facts) / FACTS_PER_CLUSTER)))
    now = _now()
    meta = BankMeta(
        name=name, embedder=embedder.name, embedder_fp=embedder.fingerprint, dim=vectors.shape[1],
        facts=len(facts), clusters=len(centroids), next_fact_id=len(facts), created=now, updated=now,
    )
    store.put_bank(meta, centroids, _group(np.arange(len(facts), dtype=np.uint32), vectors, facts, assignment))
    return meta


_CENTROIDS: dict[tuple[str, str, bytes], torch.Tensor] = {}
_CENTROIDS_KEPT = 8


def centroids_of(store: LmdbStore, name: str) -> torch.Tensor:
    """A bank's centroid matrix, read and verified once per build: cached under the centroid record's seal."""
    key = (str(store.path), name, store.bank_centroids_seal(name))
    with _EMBEDDERS_LOCK:
        found = _CENTROIDS.get(key)
    if found is None:
        found = torch.tensor(store.bank_centroids(name))
        with _EMBEDDERS_LOCK:
            if len(_CENTROIDS) >= _CENTROIDS_KEPT:
                _CENTROIDS.pop(next(iter(_CENTROIDS)))
            _CENTROIDS[key] = found
    return found


def nearest_centroids(vectors: np.ndarray, centroids: torch.Tensor, count: int) -> np.ndarray:
    """Per vector, the indices of the ``count`` centroids of highest cosine, best first.

    Torch, not NumPy: the matmul then runs on the embedder's thread pool, where a NumPy BLAS pool
    beside it would oversubscribe the cores.
    """
    scores = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)) @ centroids.T
    return torch.topk(scores, min(count, centroids.shape[0]), dim=1).indices.numpy()


def add_facts(store: LmdbStore, name: str, facts: Sequence[str], embedder: Embedder, *, progress: bool = False) -> BankMeta:
    """Add facts to an existing bank without re-clustering: each joins its nearest centroid's cluster."""
    meta = store.bank(name)
    _check_embedder(meta, embedder)
    facts = unique_facts(facts)
    vectors = embedder.embed(facts, progress=progress)
    assignment = nearest_centroids(vectors, centroids_of(store, name), 1)[:, 0]
    ids = np.arange(meta.next_fact_id, meta.next_fact_id + len(facts), dtype=np.uint32)
    additions = _group(ids, vectors, facts, assignment)
    current = store.bank_clusters(name, list(additions))
    merged = {}
    for cluster_id, added in additions.items():
        old = current[cluster_id]
        if old is None:
            merged[cluster_id] = added
            continue
        known = set(old.texts)
        keep = [i for i, text in enumerate(added.texts) if text not in known]
        merged[cluster_id] = Cluster(
            ids=np.concatenate([old.ids, added.ids[keep]]),
            embeddings=np.concatenate([old.embeddings, added.embeddings[keep]]),
            texts=old.texts + [added.texts[i] for i in keep],
        )
    added_count = sum(len(c.texts) for c in merged.values()) - sum(len(current[c].texts) for c in merged if current[c] is not None)
    meta = BankMeta(**{**meta.__dict__, "facts": meta.facts + added_count, "next_fact_id": int(ids[-1]) + 1, "updated": _now()})
    store.update_bank(meta, merged)
    return meta


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def rank_scores(query: str, query_vector: np.ndarray, texts: list[str], embeddings: np.ndarray) -> np.ndarray:
    """Hybrid ranking: cosine similarity plus ``LEXICAL_WEIGHT`` x the share of the query's words in the fact.

    Dense embeddings blur rare names (a person, a product code) that a question and its fact share
    verbatim; the lexical term restores them. The product runs in torch, on the embedder's thread
    pool: NumPy's BLAS threads, woken by a large probe, spun on and slowed the next query's embedding.
    """
    dense = (torch.from_numpy(embeddings).float() @ torch.from_numpy(query_vector)).numpy()
    words = _words(query)
    if not words:
        return dense
    lexical = np.array([len(words & _words(text)) / len(words) for text in texts], dtype=np.float32)
    return dense + LEXICAL_WEIGHT * lexical


def route(
    store: LmdbStore, name: str, queries: Sequence[str], embedder: Embedder, *, top_k: int = DEFAULT_TOP_K, probe: int | None = None
) -> list[Route]:
    """Embed each query, pick the ``probe`` nearest centroids, rank those clusters' facts, keep ``top_k``.

    ``probe`` None probes ``default_probe`` of the bank's cluster count.
    """
    if top_k < 1 or (probe is not None and probe < 1):
        raise InvalidInput("top_k and probe must be at least 1")
    for query in queries:
        if not query.strip():
            raise InvalidInput("the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise InvalidInput(f"the query has {len(query)} characters; the limit is {MAX_QUERY_CHARS}")
    meta = store.bank(name)
    _check_embedder(meta, embedder)
    if probe is None:
        probe = default_probe(meta.clusters)
    started = time.perf_counter()
    vectors = embedder.embed([q.strip() for q in queries])
    embedded = time.perf_counter()
    nearest = nearest_centroids(vectors, centroids_of(store, name), probe)
    routed = time.perf_counter()
    per_query = (embedded - started) / len(queries), (routed - embedded) / len(queries)
    results = []
    for query, vector, cluster_ids in zip(queries, vectors, nearest.tolist()):
        ranking = time.perf_counter()
        found = [c for c in store.bank_clusters(name, cluster_ids).values() if c is not None]
        texts = [t for c in found for t in c.texts]
        scores = rank_scores(query, vector, texts, np.concatenate([c.embeddings for c in found])) if found else np.zeros(0)
        best = np.argsort(-scores, kind="stable")[:top_k]
        results.append(
            Route(
                query=query,
                clusters=cluster_ids,
                facts=[(texts[i], float(scores[i])) for i in best],
                seconds={"embed": per_query[0], "route": per_query[1], "rank": time.perf_counter() - ranking},
            )
        )
    return results


def cached_embedder(spec: str) -> Embedder:
    """One loaded embedder per specifier per process (loading and fingerprinting cost about a second)."""
    with _EMBEDDERS_LOCK:
        if spec not in _EMBEDDERS:
            _EMBEDDERS[spec] = load_embedder(spec)
        return _EMBEDDERS[spec]


class LocalBanks:
    """Bank operations on a local store, with embedders named by specifier (as over the service)."""

    def __init__(self, store: LmdbStore) -> None:
        self.store = store

    def build(self, name: str, facts: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, progress: bool = False) -> BankMeta:
        return build_bank(self.store, name, facts, cached_embedder(embedder), progress=progress)

    def add(self, name: str, facts: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, progress: bool = False) -> BankMeta:
        return add_facts(self.store, name, facts, cached_embedder(embedder), progress=progress)

    def route(
        self, name: str, queries: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, top_k: int = DEFAULT_TOP_K, probe: int | None = None
    ) -> list[Route]:
        return route(self.store, name, queries, cached_embedder(embedder), top_k=top_k, probe=probe)

    def list(self) -> list[tuple[BankMeta, int]]:
        """Every bank with its stored bytes."""
        return [(meta, self.store.bank_stored_bytes(meta.name)) for meta in self.store.bank_metas()]

    def stored_bytes(self, name: str) -> int:
        self.store.bank(name)
        return self.store.bank_stored_bytes(name)

    def delete(self, name: str) -> None:
        self.store.delete_bank(name)
