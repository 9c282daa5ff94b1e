"""Banks at growing N: build cost, stored bytes per fact, routing accuracy, per-query latency.

Facts are deterministic synthetic fictional facts (packstore.bank.synthetic: one invented entity
per fact), and each query is a paraphrase of one fact's question, so the right answer is known.
Routing accuracy = the answering fact is in the probed clusters / is ranked first. Latency per
query is split into embed, route (nearest centroids), rank (facts of the probed clusters) and
recompute (building the KV pack of the top facts with smollm2-135m, which does not depend on N).

    python tools/bench_banks.py [--sizes 1000 5000 100000 1000000] [--queries 200]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from packstore.bank.bank import build_bank, route
from packstore.bank.embedder import load_embedder
from packstore.bank.synthetic import synthetic_facts
from packstore.kv.build import build_pack
from packstore.kv.models import load_model
from packstore.store import PackStore

TOP_K, PROBE = 5, 5


def percentiles(values: list[float]) -> str:
    ms = np.array(values) * 1000
    return f"{np.percentile(ms, 50):7.2f} / {np.percentile(ms, 95):7.2f}"


def bench_size(n: int, queries: int, recomputes: int, embedder, lm, workdir: Path) -> list[str]:
    cases = synthetic_facts(n)
    with PackStore(workdir / f"bank-{n}") as store:
        started = time.perf_counter()
        meta = build_bank(store, "synthetic", [c.fact for c in cases], embedder, progress=True)
        build_seconds = time.perf_counter() - started
        per_fact = store.bank_stored_bytes("synthetic") / n
        sample = cases[:: max(1, n // queries)][:queries]
        timings: dict[str, list[float]] = {"embed": [], "route": [], "rank": [], "recompute": []}
        in_clusters = first = 0
        for index, case in enumerate(sample):
            result = route(store, "synthetic", [case.query], embedder, top_k=TOP_K, probe=PROBE)[0]
            for part in ("embed", "route", "rank"):
                timings[part].append(result.seconds[part])
            first += result.facts[0][0] == case.fact
            probed = store.bank_clusters("synthetic", result.clusters).values()
            in_clusters += any(c is not None and case.fact in c.texts for c in probed)
            if index < recomputes:
                started = time.perf_counter()
                build_pack(lm, [text for text, _ in result.facts])
                timings["recompute"].append(time.perf_counter() - started)
    return [
        f"{n:>9}", f"{meta.clusters:>8}", f"{build_seconds:8.1f}", f"{n / build_seconds:7.0f}", f"{per_fact:7.0f}",
        f"{100 * in_clusters / len(sample):6.1f}%", f"{100 * first / len(sample):6.1f}%",
        *(percentiles(timings[p]) for p in ("embed", "route", "rank", "recompute")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200, help="paraphrased queries per size")
    parser.add_argument("--recomputes", type=int, default=10, help="queries per size whose top facts' pack is built")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings stable on shared cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"Embedder all-minilm-l6-v2 (384-d, stored fp16); top-k {TOP_K}, probe {PROBE} clusters; ~N/20 clusters")
    embedder, lm = load_embedder(), load_model("smollm2-135m", progress=False)
    headers = ["facts", "clusters", "build s", "facts/s", "B/fact", "in probed", "ranked 1st",
               "embed ms p50/p95", "route ms p50/p95", "rank ms p50/p95", "recompute ms p50/p95"]
    print(" | ".join(headers))
    with tempfile.TemporaryDirectory(prefix="packstore-bench-banks-") as tmp:
        for n in args.sizes:
            print(" | ".join(bench_size(n, args.queries, args.recomputes, embedder, lm, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
