"""Banks at growing N: build cost, stored bytes per fact, routing accuracy, per-query latency.

Facts are deterministic synthetic fictional facts (packstore.bank.synthetic: one invented entity
per fact), and each query is a paraphrase of one fact's question, so the right answer is known.
Routing accuracy = the answering fact is in the probed clusters / is ranked first. Latency per
query is split into embed, route (nearest centroids), rank (facts of the probed clusters) and
recompute (building the KV pack of the top facts with smollm2-135m, which does not depend on N).
The first query after a build is timed apart ("cold route"): it reads and verifies the centroid
matrix, which later queries find cached.

    python tools/bench_banks.py [--sizes 1000 5000 100000 1000000] [--queries 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import logger, machine_description, print_table, source_description  # noqa: E402

from packstore.bank.bank import build_bank, route  # noqa: E402
from packstore.bank.embedder import Embedder, load_embedder  # noqa: E402
from packstore.bank.synthetic import synthetic_facts  # noqa: E402
from packstore.kv.build import build_pack  # noqa: E402
from packstore.kv.models import load_model  # noqa: E402
from packstore.store import PackStore  # noqa: E402

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


def bench_size(n: int, args: argparse.Namespace, embedder: TimedEmbedder, lm, workdir: Path) -> dict[str, list[str]]:
    """One bank of ``n`` facts: its build row and one routing row per probe count."""
    cases = synthetic_facts(n)
    with PackStore(workdir / f"bank-{n}") as store:
        log(f"{n} facts: building")
        embedder.seconds = 0.0
        started = time.perf_counter()
        meta = build_bank(store, "synthetic", [c.fact for c in cases], embedder, progress=True)
        build_seconds = time.perf_counter() - started
        per_fact = store.bank_stored_bytes("synthetic") / n
        build = [
            f"{n:,}", f"{meta.clusters:,}", f"{build_seconds:.1f}", f"{embedder.seconds:.1f}",
            f"{build_seconds - embedder.seconds:.1f}", f"{n / build_seconds:.0f}", f"{per_fact:.0f}", f"{peak_rss_gib():.1f}",
        ]
        sample = cases[:: max(1, n // args.queries)][: args.queries]
        cold = route(store, "synthetic", [sample[0].query], embedder, top_k=TOP_K, probe=args.probes[0])[0].seconds["route"]
        routing = []
        for probe in args.probes:
            log(f"{n} facts: routing {len(sample)} queries, probe {probe}")
            timings: dict[str, list[float]] = {"embed": [], "route": [], "rank": [], "recompute": []}
            in_clusters = first = 0
            for index, case in enumerate(sample):
                result = route(store, "synthetic", [case.query], embedder, top_k=TOP_K, probe=probe)[0]
                for part in ("embed", "route", "rank"):
                    timings[part].append(result.seconds[part])
                first += result.facts[0][0] == case.fact
                probed = store.bank_clusters("synthetic", result.clusters).values()
                in_clusters += any(c is not None and case.fact in c.texts for c in probed)
                if probe == args.probes[0] and index < args.recomputes:
                    started = time.perf_counter()
                    build_pack(lm, [text for text, _ in result.facts])
                    timings["recompute"].append(time.perf_counter() - started)
            routing.append([
                f"{n:,}", str(probe), f"{100 * in_clusters / len(sample):.1f} %", f"{100 * first / len(sample):.1f} %",
                f"{cold * 1000:.1f}", *(percentiles(timings[p]) if timings[p] else "-" for p in ("embed", "route", "rank", "recompute")),
            ])
    return {"build": build, "routing": routing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200, help="paraphrased queries per size")
    parser.add_argument("--probes", type=int, nargs="+", default=[5], help="clusters probed per query (one routing row each)")
    parser.add_argument("--recomputes", type=int, default=10, help="queries per size whose top facts' pack is built")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings stable on shared cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Machine: {machine_description({})}")
    print(source_description())
    print(f"Embedder all-minilm-l6-v2 (384-d, stored fp16); about N/20 clusters; top {TOP_K} facts; {args.queries} queries per size")
    embedder = TimedEmbedder(**load_embedder().__dict__)
    lm = load_model("smollm2-135m", progress=False)
    builds, routings = [], []
    with tempfile.TemporaryDirectory(prefix="packstore-bench-banks-") as tmp:
        for n in args.sizes:
            rows = bench_size(n, args, embedder, lm, Path(tmp))
            builds.append(rows["build"])
            routings.extend(rows["routing"])
            print_table("Build", ["facts", "clusters", "build s", "embed s", "cluster+store s", "facts/s", "B/fact", "peak RSS GiB"], builds)
            print_table(
                "Routing (latency per query in ms, p50 / p95)",
                ["facts", "probe", "in probed", "ranked 1st", "cold route", "embed", "route", "rank", "recompute"],
                routings,
            )


if __name__ == "__main__":
    main()
