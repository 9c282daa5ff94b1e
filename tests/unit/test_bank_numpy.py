"""Bank routing runs in NumPy (issue 55: a store service routes without torch) and routes as the torch code it
replaced did: the same nearest clusters in the same order, the same facts in the same order, the same scores to float
tolerance. The reference below is that torch computation, written out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packstore.bank.bank import build_bank, centroids_of, nearest_centroids, route
from packstore.bank.embedder import load_embedder
from packstore.kv.synthetic import synthetic_facts
from packstore.store import LmdbStore

N = 400


@pytest.fixture(scope="module")
def embedder():
    return load_embedder()


@pytest.fixture(scope="module", params=["fp16", "int8"])
def bank(request, tmp_path_factory, embedder):
    store = LmdbStore(tmp_path_factory.mktemp("numpy-banks") / "store")
    build_bank(store, "b", [s.fact for s in synthetic_facts(N)], embedder, vectors=request.param)
    yield store
    store.close()


def torch_nearest(vectors: np.ndarray, centroids: np.ndarray, count: int) -> np.ndarray:
    scores = torch.tensor(vectors) @ torch.tensor(centroids).T  # copies: the centroids are a read-only view of stored bytes
    return torch.topk(scores, min(count, centroids.shape[0]), dim=1).indices.numpy()


def torch_dense_route(store: LmdbStore, vector: np.ndarray, probe: int, top_k: int) -> list[tuple[str, float]]:
    """A dense route as the torch code ranked it: the probed clusters' facts by cosine, best first (stable)."""
    probed = torch_nearest(vector[None], np.asarray(store.bank_centroids("b"), dtype=np.float32), probe)[0].tolist()
    found = [c for c in store.bank_clusters("b", probed).values() if c is not None and c.texts]
    texts = [t for c in found for t in c.texts]
    cosine = (torch.from_numpy(np.concatenate([c.vectors() for c in found])) @ torch.tensor(vector)).numpy()
    best = np.argsort(-cosine, kind="stable")[:top_k]
    return [(texts[i], float(cosine[i])) for i in best]


@pytest.mark.parametrize("count", [1, 5, 20])
def test_nearest_centroids_match_torch_topk(bank, embedder, count: int) -> None:
    queries = [s.query for s in synthetic_facts(N)[::4]]
    vectors = embedder.embed(queries)
    centroids = centroids_of(bank, "b")
    assert np.array_equal(nearest_centroids(vectors, centroids, count), torch_nearest(vectors, centroids, count))


def test_nearest_centroids_with_more_asked_than_there_are_ranks_them_all(bank, embedder) -> None:
    vectors = embedder.embed(["a question"])
    centroids = centroids_of(bank, "b")
    assert np.array_equal(nearest_centroids(vectors, centroids, 10_000), torch_nearest(vectors, centroids, 10_000))


def test_dense_routes_equal_the_torch_reference(bank, embedder) -> None:
    cases = synthetic_facts(N)[1::5]
    routes = route(bank, "b", [c.query for c in cases], embedder, top_k=5, probe=5, mode="dense")
    for case, routed in zip(cases, routes):
        expected = torch_dense_route(bank, embedder.embed([case.query])[0], probe=5, top_k=5)
        assert [text for text, _ in routed.facts] == [text for text, _ in expected]
        assert np.allclose([score for _, score in routed.facts], [score for _, score in expected], atol=1e-6)


def test_routing_imports_no_torch_when_the_embedder_plays_no_part(tmp_path) -> None:
    """Lexical routing needs neither torch nor an embedder (a store service without the model stack routes so)."""
    import subprocess
    import sys

    with LmdbStore(tmp_path / "store") as store:
        build_bank(store, "b", ["The mill Xyloquent was built by Ferro.", "Rivers flow to the sea."], load_embedder())
    probe = (
        "import sys\n"
        "from packstore.bank.bank import LocalBanks\n"
        "from packstore.store import LmdbStore\n"
        f"with LmdbStore({str(tmp_path / 'store')!r}, readonly=True) as store:\n"
        "    [found] = LocalBanks(store).route('b', ['Xyloquent'], top_k=1, mode='lexical')\n"
        "assert found.facts[0][0].startswith('The mill Xyloquent'), found\n"
        "heavy = [m for m in ('torch', 'transformers', 'sentence_transformers', 'faiss', 'jax') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


class StoreReadingAtAnOddByte(LmdbStore):
    """The LMDB store, its centroid matrix handed out from an odd address, as a record read in place may lie."""

    def bank_centroids(self, name: str) -> np.ndarray:
        matrix = np.asarray(super().bank_centroids(name), dtype=np.float32)
        shifted = np.frombuffer(b"\0" + matrix.tobytes(), dtype=np.float32, offset=1).reshape(matrix.shape)
        assert not shifted.flags.aligned
        return shifted


def test_the_centroid_matrix_routes_from_aligned_memory(tmp_path, embedder) -> None:
    """NumPy multiplies an unaligned matrix without BLAS (about 40x slower at 5,000 centroids): the bank aligns it once."""
    with StoreReadingAtAnOddByte(tmp_path / "store") as odd:
        build_bank(odd, "b", [s.fact for s in synthetic_facts(60)], embedder)
        centroids = centroids_of(odd, "b")
        assert centroids.flags.aligned and centroids.flags.c_contiguous
        assert np.array_equal(centroids, np.asarray(LmdbStore.bank_centroids(odd, "b"), dtype=np.float32))
