"""Banks with the real all-MiniLM-L6-v2 embedder: build, route, add, refusals, damage, lazy recompute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest

from packstore.bank.bank import MIN_PROBE, add_facts, build_bank, default_probe, open_banks, route
from packstore.bank.embedder import load_embedder, resolve_embedder_dir
from packstore.cli.packctl import main as packctl
from packstore.errors import IntegrityError, InvalidInput, PackMismatch, PackNotFound
from packstore.format.bank import DEFAULT_VECTORS, encode_centroids, encode_cluster, encode_lexical
from packstore.kv.synthetic import synthetic_facts
from packstore.store import LmdbStore
from tests.helpers.banks import TEST_BANK_CACHE

N = 400


@pytest.fixture(scope="module")
def embedder():
    return load_embedder()


@pytest.fixture(scope="module")
def bank_store(tmp_path_factory, embedder):
    store = LmdbStore(tmp_path_factory.mktemp("banks") / "store")
    build_bank(store, "synthetic", [s.fact for s in synthetic_facts(N)], embedder)
    yield store
    store.close()


def test_build_clusters_about_n_over_20_and_stays_under_1kb_per_fact(bank_store) -> None:
    meta = bank_store.bank("synthetic")
    assert (meta.facts, meta.clusters, meta.dim) == (N, N // 20, 384)
    assert bank_store.bank_stored_bytes("synthetic") / N < 1024


def test_stored_bytes_are_exactly_the_bank_records(bank_store) -> None:
    meta = bank_store.bank("synthetic")
    clusters = bank_store.bank_clusters("synthetic", list(range(meta.clusters))).values()
    records = [
        meta.to_json(),
        encode_centroids(bank_store.bank_centroids("synthetic")),
        encode_lexical(*bank_store.bank_lexical("synthetic")),
        *map(encode_cluster, clusters),
    ]
    assert bank_store.bank_stored_bytes("synthetic") == sum(map(len, records))


def test_paraphrased_queries_route_to_their_fact(bank_store, embedder) -> None:
    cases = synthetic_facts(N)[::8]
    results = route(bank_store, "synthetic", [c.query for c in cases], embedder, top_k=3)
    first = sum(r.facts[0][0] == c.fact for r, c in zip(results, cases))
    assert first / len(cases) >= 0.95
    assert all(len(r.clusters) >= MIN_PROBE and len(r.facts) == 3 for r in results)
    assert all(r.facts[0][1] >= r.facts[1][1] >= r.facts[2][1] for r in results)


def test_default_probe_grows_with_the_clusters() -> None:
    assert [default_probe(c) for c in (1, 20, 2_500, 2_501, 5_000, 50_000, 500_000)] == [5, 5, 5, 6, 10, 100, 1000]


def test_routing_without_a_probe_count_probes_the_default_share(tmp_path: Path, embedder, monkeypatch) -> None:
    monkeypatch.setattr("packstore.bank.bank.PROBED_SHARE", 0.5)
    with LmdbStore(tmp_path / "store") as store:
        meta = build_bank(store, "b", [s.fact for s in synthetic_facts(400)], embedder)
        query = [synthetic_facts(400)[0].query]
        assert len(route(store, "b", query, embedder, mode="dense")[0].clusters) == meta.clusters // 2
        assert len(route(store, "b", query, embedder, probe=3, mode="dense")[0].clusters) == 3


def test_routed_clusters_are_the_nearest_centroids_best_first(bank_store, embedder) -> None:
    query = synthetic_facts(N)[5].query
    result = route(bank_store, "synthetic", [query], embedder, probe=7)[0]
    scores = bank_store.bank_centroids("synthetic") @ embedder.embed([query])[0]
    assert result.clusters[:7] == np.argsort(-scores, kind="stable")[:7].tolist()  # then the BM25 hits' clusters
    clusters = bank_store.bank_clusters("synthetic", list(range(N // 20))).values()
    stored = [text for cluster in clusters for text in cluster.texts]
    assert sorted(stored) == sorted(s.fact for s in synthetic_facts(N))
    assert all(list(c.ids) == sorted(c.ids) for c in clusters)


def test_adding_facts_needs_no_rebuild(bank_store, embedder) -> None:
    before = bank_store.bank("synthetic")
    new = "The lighthouse Qwertzuiop on the Glass coast was painted by Hemlo Vantrix."
    meta = add_facts(bank_store, "synthetic", [new, synthetic_facts(1)[0].fact], embedder)  # the second is already there
    assert meta.facts == before.facts + 1 and meta.clusters == before.clusters
    assert route(bank_store, "synthetic", ["Who painted Qwertzuiop?"], embedder, top_k=1)[0].facts[0][0] == new


def test_queries_embedded_by_another_embedder_are_refused(bank_store, tmp_path: Path) -> None:
    copy = tmp_path / "other-embedder"
    shutil.copytree(resolve_embedder_dir("all-minilm-l6-v2"), copy)
    (copy / "README.md").write_text("a different embedder identity\n")
    with pytest.raises(PackMismatch, match="embedder mismatch") as info:
        route(bank_store, "synthetic", ["Who?"], load_embedder(str(copy)))
    assert info.value.what == "embedder"


def test_empty_huge_and_unicode_queries(bank_store, embedder) -> None:
    with pytest.raises(InvalidInput, match="empty"):
        route(bank_store, "synthetic", ["  "], embedder)
    with pytest.raises(InvalidInput, match="limit"):
        route(bank_store, "synthetic", ["x" * 100_001], embedder)
    long_query = "Who established the lighthouse? " * 2000  # past the embedder's 256 tokens: truncated, still routed
    assert len(route(bank_store, "synthetic", [long_query], embedder)[0].facts) == 5
    unicode_query = "Qui a fondé l'observatoire « Ŧelvarn » à 東京? 🚀"
    assert route(bank_store, "synthetic", [unicode_query], embedder)[0].facts
    with pytest.raises(PackNotFound, match="no bank"):
        route(bank_store, "absent", ["Who?"], embedder)
    with pytest.raises(InvalidInput, match="no queries"):  # found by the fuzz run: was a division by zero
        route(bank_store, "synthetic", [], embedder)


def test_facts_without_a_single_word_are_refused(tmp_path: Path, embedder) -> None:
    """Found by the fuzz run: facts with no letter or digit left the full-text index without a vocabulary."""
    with LmdbStore(tmp_path / "store") as store:
        with pytest.raises(InvalidInput, match="letter or digit"):
            build_bank(store, "kb", [":", "--", " ! "], embedder)
        build_bank(store, "kb", [":", "The lighthouse was founded by Ana."], embedder)
        assert route(store, "kb", ["Who founded the lighthouse?"], embedder)[0].facts


def test_a_bank_rebuilt_under_its_name_is_routed_with_its_new_centroids(tmp_path: Path, embedder) -> None:
    old, new = synthetic_facts(200)[:100], synthetic_facts(200)[100:120]
    with LmdbStore(tmp_path / "s") as store:
        build_bank(store, "b", [s.fact for s in old], embedder)
        assert route(store, "b", [old[3].query], embedder, top_k=1)[0].facts[0][0] == old[3].fact
        build_bank(store, "b", [s.fact for s in new], embedder)  # same second, same name: a routing cache must not serve the old build
        result = route(store, "b", [new[3].query], embedder, top_k=1, probe=50)[0]
        assert result.facts[0][0] == new[3].fact and len(result.clusters) == 1


def test_damaged_cluster_is_detected(tmp_path: Path, embedder) -> None:
    facts = [s.fact for s in synthetic_facts(40)]
    with LmdbStore(tmp_path / "s") as store:
        build_bank(store, "small", facts, embedder)
    _damage(tmp_path / "s", b"cluster/small/")
    with LmdbStore(tmp_path / "s") as store:
        with pytest.raises(IntegrityError, match="bank cluster is damaged"):
            route(store, "small", [synthetic_facts(1)[0].query], embedder, probe=2)


def test_bank_commands(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(s.fact for s in synthetic_facts(60)))
    store = ["--store", str(tmp_path / "store")]
    assert packctl([*store, "bank", "build", str(facts), "--name", "b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["clusters"] == 3
    query = synthetic_facts(60)[7].query
    assert packctl([*store, "bank", "route", "b", query, "--json", "--top-k", "2"]) == 0
    routed = json.loads(capsys.readouterr().out)
    assert routed["query"] == query and routed["facts"][0]["text"] == synthetic_facts(60)[7].fact and len(routed["clusters"]) == 3  # all there are
    assert set(routed["facts"][0]) == {"text", "score"}
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"query": query}) + "\n" + json.dumps({"query": "Who?"}) + "\n")
    assert packctl([*store, "bank", "route", "b", "--queries", str(queries)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    name_only = synthetic_facts(60)[9].fact.split()[2]  # the invented name alone
    assert packctl([*store, "bank", "route", "b", name_only, "--mode", "lexical", "--json", "--top-k", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["facts"][0]["text"] == synthetic_facts(60)[9].fact
    with pytest.raises(SystemExit):
        packctl([*store, "bank", "route", "b", "Who?", "--mode", "sideways"])
    assert "invalid choice: 'sideways'" in capsys.readouterr().err
    assert packctl([*store, "ask", "--bank", "b", query, "--model", str(tiny_model_dir), "--compare-rag", "--json", "--max-new-tokens", "6", "--top-k", "2"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["identical"] is True and answer["bank"] == "b" and len(answer["facts"]) == 2
    assert packctl([*store, "bank", "ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["facts"] == 60
    assert packctl([*store, "bank", "rm", "b"]) == 0
    assert packctl([*store, "bank", "route", "b", "Who?"]) == 1
    assert "no bank named" in capsys.readouterr().err


def test_two_level_kmeans_for_many_clusters(tmp_path: Path, embedder, monkeypatch) -> None:
    from packstore.bank import bank

    monkeypatch.setattr(bank, "FLAT_KMEANS_MAX_CLUSTERS", 4)
    cases = synthetic_facts(200)
    with LmdbStore(tmp_path / "s") as store:
        meta = build_bank(store, "two-level", [c.fact for c in cases], embedder)
        assert 8 <= meta.clusters <= 12
        routes = route(store, "two-level", [c.query for c in cases[::10]], embedder)
        assert sum(r.facts[0][0] == c.fact for r, c in zip(routes, cases[::10])) >= 19


def _entity(fact: str) -> str:
    return fact.split()[2]  # "The <kind> <Name> in ..."


def test_hybrid_finds_a_fact_whose_cluster_is_not_probed(bank_store, embedder) -> None:
    """The invented name alone: dense vectors of an unknown word route almost at random, BM25 finds it."""
    cases = synthetic_facts(N)[:80]
    queries = [f"Tell me about {_entity(c.fact)}." for c in cases]
    dense = route(bank_store, "synthetic", queries, embedder, probe=1, top_k=1, mode="dense")
    hybrid = route(bank_store, "synthetic", queries, embedder, probe=1, top_k=1)
    dense_first = sum(r.facts[0][0] == c.fact for r, c in zip(dense, cases))
    hybrid_first = sum(r.facts[0][0] == c.fact for r, c in zip(hybrid, cases))
    assert hybrid_first >= 0.95 * len(cases) and hybrid_first > dense_first
    clusters = bank_store.bank_clusters("synthetic", list(range(N // 20)))
    home = {text: cluster_id for cluster_id, c in clusters.items() for text in c.texts}
    unprobed = [r for r, c in zip(hybrid, cases) if home[c.fact] != r.clusters[0] and r.facts[0][0] == c.fact]
    assert unprobed, "every hit was in the probed cluster: the lexical side was not needed"
    lexical = route(bank_store, "synthetic", queries[:10], embedder, top_k=1, mode="lexical")
    assert all(r.facts[0][0] == c.fact for r, c in zip(lexical, cases))


def test_route_modes_are_checked(bank_store, embedder) -> None:
    with pytest.raises(InvalidInput, match="unknown route mode 'fuzzy'"):
        route(bank_store, "synthetic", ["Who?"], embedder, mode="fuzzy")
    assert route(bank_store, "synthetic", ["zzqx vvbn"], embedder, mode="lexical")[0].facts == []  # no indexed word
    name = _entity(synthetic_facts(N)[3].fact)
    only = route(bank_store, "synthetic", [name], embedder, mode="lexical", top_k=5)[0]
    assert [text for text, _ in only.facts] == [synthetic_facts(N)[3].fact]  # its cluster-mates share no word with it


def test_added_facts_are_in_the_full_text_index(tmp_path: Path, embedder) -> None:
    with LmdbStore(tmp_path / "s") as store:
        build_bank(store, "b", [s.fact for s in synthetic_facts(100)], embedder)
        seal = store.bank_lexical_seal("b")
        added = ["The archive Plomquatsch in Port Amaranth was catalogued by Irmeline Vosk in 1911."]
        add_facts(store, "b", added, embedder)
        assert store.bank_lexical_seal("b") != seal
        found = route(store, "b", ["Plomquatsch"], embedder, top_k=1, mode="lexical")[0]
        assert found.facts[0][0] == added[0]
        assert open_banks(store, TEST_BANK_CACHE).route("b", ["Who catalogued Plomquatsch?"], top_k=1)[0].facts[0][0] == added[0]  # the bank's own embedder


def test_an_add_that_meets_a_concurrent_add_loses_no_facts(tmp_path: Path, embedder, monkeypatch) -> None:
    """Another add commits between this add's read and its write: this one is computed again."""
    first = ["The archive Plomquatsch in Port Amaranth was catalogued by Irmeline Vosk in 1911."]
    second = ["The foundry Ekkerwal in Lower Brisk was cast in bronze by Tobiah Quell in 1702."]
    with LmdbStore(tmp_path / "s") as store:
        build_bank(store, "b", [s.fact for s in synthetic_facts(60)], embedder)
        real_update = store.update_bank
        calls = []

        def update_after_another_add(*args, **kwargs):
            calls.append(kwargs["expected"].facts)
            if len(calls) == 1:
                add_facts(store, "b", second, embedder)  # commits first, and changes the bank under us
            return real_update(*args, **kwargs)

        monkeypatch.setattr(store, "update_bank", update_after_another_add)
        meta = add_facts(store, "b", first, embedder)
        assert meta.facts == store.bank("b").facts == 62 and calls == [60, 60, 61]
        found = {route(store, "b", [text], embedder, top_k=1, mode="lexical")[0].facts[0][0] for text in ("Plomquatsch", "Ekkerwal")}
        assert found == {first[0], second[0]}
        clusters = store.bank_clusters("b", list(range(meta.clusters)))
        ids = [i for c in clusters.values() if c is not None for i in c.ids.tolist()]
        assert len(ids) == len(set(ids)) == 62 and meta.next_fact_id == 62


def _damage(path: Path, prefix: bytes, *, remove: bool = False) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        db = env.open_db(b"banks", txn=txn)
        key = next(k for k, _ in txn.cursor(db=db) if k.startswith(prefix))
        if remove:
            txn.delete(key, db=db)
        else:
            data = bytearray(txn.get(key, db=db))
            data[100] ^= 1
            txn.put(key, bytes(data), db=db)
    env.close()


def test_damaged_lexical_index_is_detected_and_a_bank_without_one_routes_dense(tmp_path: Path, embedder) -> None:
    facts = [s.fact for s in synthetic_facts(40)]
    for name in ("damaged", "older"):
        with LmdbStore(tmp_path / name) as store:
            build_bank(store, "b", facts, embedder)
    _damage(tmp_path / "damaged", b"lexical/b")
    _damage(tmp_path / "older", b"lexical/b", remove=True)
    query = [synthetic_facts(40)[3].query]
    with LmdbStore(tmp_path / "damaged") as store:
        with pytest.raises(IntegrityError, match="bank lexical index is damaged"):
            route(store, "b", query, embedder)
        assert route(store, "b", query, embedder, mode="dense")[0].facts[0][0] == facts[3]
    with LmdbStore(tmp_path / "older") as store:
        assert route(store, "b", query, embedder)[0].facts[0][0] == facts[3]
        with pytest.raises(InvalidInput, match="no full-text index"):
            route(store, "b", query, embedder, mode="lexical")
        add_facts(store, "b", ["The foundry Ekkerwal was cast in bronze."], embedder)  # adding builds the index
        assert route(store, "b", ["Ekkerwal"], embedder, mode="lexical")[0].facts[0][0].startswith("The foundry Ekkerwal")


def test_int8_vectors_the_default_halve_the_embedding_bytes_of_fp16_and_route_alike(bank_store, tmp_path: Path, embedder) -> None:
    facts = [s.fact for s in synthetic_facts(N)]
    with LmdbStore(tmp_path / "s") as store:
        meta = build_bank(store, "q", facts, embedder, vectors="fp16")
        assert meta.vectors == "fp16" and bank_store.bank("synthetic").vectors == "int8" == DEFAULT_VECTORS
        saved = store.bank_stored_bytes("q") - bank_store.bank_stored_bytes("synthetic")
        assert abs(saved - N * (384 - 2)) < 0.02 * N * 384  # 2 bytes a dimension -> 1, plus a 2-byte scale a fact
        cluster = next(iter(bank_store.bank_clusters("synthetic", [0]).values()))
        assert cluster.embeddings.dtype == np.int8 and cluster.scales.shape == (len(cluster.texts),)
        exact = embedder.embed(cluster.texts)
        assert np.abs(cluster.vectors() - exact).max() < 0.01
        cases = synthetic_facts(N)[::8]
        for kind_store, bank in ((store, "q"), (bank_store, "synthetic")):
            routed = route(kind_store, bank, [c.query for c in cases], embedder, top_k=1, mode="dense")
            assert sum(r.facts[0][0] == c.fact for r, c in zip(routed, cases)) / len(cases) >= 0.75
        build_bank(store, "r", facts[:40], embedder)
        added = "The orchard Vexmoriel in Lake Vesper was planted by Odo Brank in 1701."
        assert add_facts(store, "r", [added], embedder).vectors == "int8"
        assert route(store, "r", ["Who planted Vexmoriel?"], embedder, top_k=1)[0].facts[0][0] == added
        with pytest.raises(InvalidInput, match="unknown vector storage 'int4'"):
            build_bank(store, "bad", facts[:5], embedder, vectors="int4")
