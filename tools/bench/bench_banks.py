"""Banks at growing N: build cost, stored bytes per fact, routing accuracy, per-query latency.

Facts are deterministic synthetic fictional facts (packstore.kv.synthetic: one invented entity
per fact), and each query is a paraphrase of one fact, drawn at random with a fixed seed, so the
right answer is known.
Routing accuracy = the answering fact is in the searched clusters (the probed ones and those of
the best BM25 hits) / is ranked first. Latency per query is split into embed, route (nearest
centroids), lexical (BM25 over the whole bank), rank (reading and scoring the searched clusters) and
recompute (building the KV pack of the top facts with smollm2-135m, which does not depend on N).
The first query after a build is timed apart ("cold route"): it reads and verifies the centroid
matrix, which later queries find cached. Probe 0 is the default probe count (default_probe).

``--adds K ...`` then times ``bank add`` of K new facts (one add per K, in order) on a backup of the
bank, so a kept bank stays as it was. An add embeds only the new facts but rebuilds the BM25 index over
every fact (bm25s stores IDF-weighted scores per document, so it cannot append); the "lexical rebuild"
column times that rebuild of the grown bank alone (``LexicalIndex.build`` and its serialisation).

With --keep DIR the banks are built in DIR and kept; a later run with the same DIR measures
routing on a kept bank of the same N facts and embedder instead of embedding them again (its
build row then says "kept").

    python -m tools.bench.bench_banks [--sizes 1000 5000 100000 1000000] [--probes 0 5 20] [--threads 2] [--keep DIR] [--adds 1 1000]
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from packstore.bank.bank import BankCache, add_facts, build_bank, default_probe, route  # noqa: E402
from packstore.bank.embedder import Embedder, load_embedder  # noqa: E402
from packstore.bank.lexical import LexicalIndex  # noqa: E402
from packstore.errors import PackNotFound  # noqa: E402
from packstore.format.bank import DEFAULT_VECTORS  # noqa: E402
from packstore.kv.build import build_pack  # noqa: E402
from packstore.kv.models import load_model  # noqa: E402
from packstore.kv.synthetic import synthetic_fact, synthetic_facts  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, print_table, source_description  # noqa: E402

TOP_K = 5
log = logger("bench_banks")


class TimedEmbedder(Embedder):
    """The embedder, adding up the seconds its ``embed`` calls take (the build's embedding share)."""

    seconds: float = 0.0

    def embed(self, texts: list[str], *, progress: bool = False) -> np.ndarray:
        started = time.perf_counter()
        try:
            return super().embed(texts, progress=progress)
        finally:
            self.seconds += time.perf_counter() - started


def percentiles(values: list[float]) -> str:
    ms = np.array(values) * 1000
    return f"{np.percentile(ms, 50):.2f} / {np.percentile(ms, 95):.2f}"


def peak_rss_gib() -> float:
    """This process's resident-set high-water mark so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def kept_bank(store: LmdbStore, n: int, embedder: Embedder):
    """The bank a ``--keep`` run left for these ``n`` synthetic facts and this embedder, else None."""
    try:
        meta = store.bank("synthetic")
    except PackNotFound:
        return None
    return meta if meta.facts == n and meta.embedder_fp == embedder.fingerprint else None


def bytes_per_fact(store: LmdbStore, n: int) -> str:
    return f"{store.bank_stored_bytes('synthetic') / n:.0f}"


def build_row(n: int, store: LmdbStore, embedder: TimedEmbedder):
    """Build (or, with --keep, reuse) the bank of ``n`` synthetic facts; its metadata and build row."""
    meta = kept_bank(store, n, embedder)
    if meta is not None:
        log(f"{n} facts: reusing the kept bank")
        return meta, [f"{n:,}", f"{meta.clusters:,}", "kept", "-", "-", "-", bytes_per_fact(store, n), "-"]
    log(f"{n} facts: building")
    embedder.seconds = 0.0
    started = time.perf_counter()
    meta = build_bank(store, "synthetic", [c.fact for c in synthetic_facts(n)], embedder, progress=True)
    seconds = time.perf_counter() - started
    return meta, [
        f"{n:,}", f"{meta.clusters:,}", f"{seconds:.1f}", f"{embedder.seconds:.1f}",
        f"{seconds - embedder.seconds:.1f}", f"{n / seconds:.0f}", bytes_per_fact(store, n), f"{peak_rss_gib():.1f}",
    ]


def add_rows(n: int, store: LmdbStore, adds: list[int], embedder: TimedEmbedder, scratch: Path) -> list[list[str]]:
    """One row per ``adds`` entry K: ``bank add`` of K new synthetic facts to a backup of the bank, in order."""
    store.backup_into(scratch)
    rows, total = [], n
    with LmdbStore(scratch) as copy:
        for count in adds:
            facts = [synthetic_fact(total + i).fact for i in range(count)]
            embedder.seconds = 0.0
            started = time.perf_counter()
            meta = add_facts(copy, "synthetic", facts, embedder)
            seconds = time.perf_counter() - started
            total = meta.facts
            clusters = copy.bank_clusters("synthetic", list(range(meta.clusters)))
            started = time.perf_counter()
            LexicalIndex.build(clusters, meta.clusters).to_bytes()
            lexical = time.perf_counter() - started
            rows.append([f"{n:,}", f"{count:,}", f"{seconds:.2f}", f"{embedder.seconds:.2f}", f"{lexical:.2f}"])
            log(f"{n} facts: added {count} in {seconds:.2f} s")
    return rows


def bench_size(n: int, args: argparse.Namespace, embedder: TimedEmbedder, lm, workdir: Path) -> dict[str, list[str]]:
    """One bank of ``n`` facts: its build row, one routing row per probe count (0: the default), one row per add."""
    with LmdbStore(workdir / f"bank-{n}") as store:
        meta, build = build_row(n, store, embedder)
        sample = [synthetic_fact(i) for i in random.Random(n).sample(range(n), min(args.queries, n))]
        cache = BankCache()  # as a serving process holds one: the first query reads the bank's records, later ones reuse them
        cold = route(store, "synthetic", [sample[0].query], embedder, top_k=TOP_K, probe=args.probes[0] or None, cache=cache)[0].seconds["route"]
        routing = []
        default = default_probe(meta.clusters)
        for probe in dict.fromkeys(p or default for p in args.probes):
            log(f"{n} facts: routing {len(sample)} queries, probe {probe}")
            timings: dict[str, list[float]] = {"embed": [], "route": [], "lexical": [], "rank": [], "total": [], "recompute": []}
            in_clusters = first = 0
            for index, case in enumerate(sample):
                result = route(store, "synthetic", [case.query], embedder, top_k=TOP_K, probe=probe, cache=cache)[0]
                for part in ("embed", "route", "lexical", "rank"):
                    timings[part].append(result.seconds[part])
                timings["total"].append(sum(result.seconds[part] for part in ("embed", "route", "lexical", "rank")))
                first += result.facts[0][0] == case.fact
                probed = store.bank_clusters("synthetic", result.clusters).values()
                in_clusters += any(c is not None and case.fact in c.texts for c in probed)
                if not routing and index < args.recomputes:
                    started = time.perf_counter()
                    build_pack(lm, [text for text, _ in result.facts])
                    timings["recompute"].append(time.perf_counter() - started)
            routing.append([
                f"{n:,}", f"{probe}{' (default)' if probe == default else ''}",
                f"{100 * in_clusters / len(sample):.1f} %", f"{100 * first / len(sample):.1f} %", f"{cold * 1000:.1f}",
                *(percentiles(timings[p]) if timings[p] else "-" for p in ("embed", "route", "lexical", "rank", "total", "recompute")),
            ])
        adds = []
        if args.adds:
            with tempfile.TemporaryDirectory(prefix=f"packstore-bench-adds-{n}-") as scratch:
                adds = add_rows(n, store, args.adds, embedder, Path(scratch))
    return {"build": build, "routing": routing, "adds": adds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200, help="paraphrased queries per size")
    parser.add_argument("--probes", type=int, nargs="+", default=[0], help="clusters probed per query, one routing row each (0: the default)")
    parser.add_argument("--recomputes", type=int, default=10, help="queries per size whose top facts' pack is built")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings stable on shared cores)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="build the banks in DIR and keep them; reuse banks kept there")
    parser.add_argument("--adds", type=int, nargs="*", default=[], help="time bank add of K new facts, per K (on a backup)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Machine: {machine_description({})}")
    print(source_description())
    print(f"Embedder all-minilm-l6-v2 (384-d, stored {DEFAULT_VECTORS}); about N/20 clusters; top {TOP_K} facts; {args.queries} queries per size")
    loaded = load_embedder()
    embedder = TimedEmbedder(name=loaded.name, directory=loaded.directory)
    lm = load_model("smollm2-135m", progress=False)
    builds, routings, adds = [], [], []
    with tempfile.TemporaryDirectory(prefix="packstore-bench-banks-") as tmp:
        for n in args.sizes:
            rows = bench_size(n, args, embedder, lm, args.keep or Path(tmp))
            builds.append(rows["build"])
            routings.extend(rows["routing"])
            adds.extend(rows["adds"])
            print_table("Build", ["facts", "clusters", "build s", "embed s", "cluster+store s", "facts/s", "B/fact", "peak RSS GiB"], builds)
            print_table(
                "Routing (latency per query in ms, p50 / p95)",
                ["facts", "probe", "in searched", "ranked 1st", "cold route", "embed", "route", "lexical", "rank", "total", "recompute"],
                routings,
            )
            if adds:
                print_table("bank add (seconds; on a backup of each bank)", ["facts", "added", "add s", "embed s", "lexical rebuild s"], adds)


if __name__ == "__main__":
    main()
