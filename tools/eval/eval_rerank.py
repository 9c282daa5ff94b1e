"""Reranking trials on the tuning data only: would a second stage over the routed candidates rank the answering fact higher?

No PyPI wheel ships a cross-encoder's or a late-interaction model's weights (searched for issue 38: rerankers on PyPI
download their weights at run time), so the two second stages that load offline (``packstore.bank.rerank``, what
``--rerank`` runs) are tried:

- ``late``: late interaction with the bank's own embedder (all-MiniLM-L6-v2 from its wheel): each candidate's score is
  the mean over the question's tokens of the best cosine with the candidate's tokens (ColBERT's MaxSim), computed for
  the top ``--late-candidates`` facts at query time;
- ``lm``: the language model scoring the candidates (smollm2-135m from its wheel): the mean log-probability of the
  question's tokens after the candidate (``rerank.LM_PROMPT``), as zero-shot question likelihood rerankers do, for the
  top ``--lm-candidates`` facts.

Each stage's score is added to the route's hybrid score with a weight from ``WEIGHTS`` (a very large weight is the
stage alone). Data (``--data``): the own generator's and the second generator's 5,000-fact banks and the ckc tuning half
(never the held-out half, never the third generator). Records: OUT/questions.jsonl (per question and stage: the answering fact's
rank before and after at each weight, the route's and the stage's ms), OUT/table.md. ``--banks DIR`` keeps the banks
(MiniLM, the default int8 vectors) and reuses those kept there, as tools/eval/eval_banks.py and eval_fusion.py do.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_rerank [--lm-questions 60] [--out results/eval_rerank]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from packstore.bank.bank import route  # noqa: E402
from packstore.bank.rerank import CANDIDATES, late_scorer, lm_scorer  # noqa: E402
from packstore.format.bank import DEFAULT_VECTORS  # noqa: E402
from packstore.kv.models import load_model  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.eval.eval_banks import BANK_CACHE, EMBEDDERS, Dataset, ckc_datasets, kept_bank, own_dataset, second_dataset  # noqa: E402
from tools.lib.benchlib import logger  # noqa: E402
from tools.lib.evallib import REPO, discard_records, jsonl_appender, markdown_table, proportion_interval, read_jsonl  # noqa: E402

WEIGHTS = (0.25, 0.5, 1.0, 2.0, 4.0, 1000.0)
log = logger("eval_rerank")


def _rank(texts: Sequence[str], scores: np.ndarray, fact: str) -> int | None:
    order = [texts[i] for i in np.argsort(-scores, kind="stable")]
    return order.index(fact) if fact in order else None


def trial(store: LmdbStore, bank: str, dataset: Dataset, embedder, stage: str, scorer, candidates: int, questions: int, keep) -> None:
    """Route each question for ``candidates`` facts, rescore them with ``scorer``, keep one record per question."""
    route(store, bank, [dataset.questions[0][0]], embedder, top_k=candidates, cache=BANK_CACHE)  # warm: the bank's records, read once
    for index, (question, fact) in enumerate(dataset.questions[:questions]):
        started = time.perf_counter()
        found = route(store, bank, [question], embedder, top_k=candidates, cache=BANK_CACHE)[0]
        routed = time.perf_counter() - started
        texts, hybrid = [t for t, _ in found.facts], np.array([s for _, s in found.facts], dtype=np.float64)
        started = time.perf_counter()
        extra = scorer(question, texts)
        seconds = time.perf_counter() - started
        after = {f"{weight:g}": _rank(texts, hybrid + weight * extra, fact.strip()) for weight in WEIGHTS}
        keep(
            {"dataset": dataset.name, "stage": stage, "candidates": candidates, "question": index,
             "rank_before": _rank(texts, hybrid, fact.strip()), "rank_after": after, "ms": seconds * 1000,
             "route_ms": routed * 1000}
        )


def table(records: Sequence[dict]) -> str:
    """Top-1 / top-5 before and after each weight, per dataset and stage, with the stage's median and p95 ms and the
    p95 of route + stage (records from before route times were kept leave it blank)."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["dataset"], record["stage"], record["candidates"]), []).append(record)
    lines = []
    for (dataset, stage, candidates), members in groups.items():
        ms = np.array([r["ms"] for r in members])
        timed = all("route_ms" in r for r in members)
        total = f"{np.percentile([r['route_ms'] + r['ms'] for r in members], 95):.0f}" if timed else ""
        columns = [("hybrid", [r["rank_before"] for r in members])]
        columns += [(f"+{w}x", [r["rank_after"][w] for r in members]) for w in members[0]["rank_after"]]  # the run's weights
        for label, ranks in columns:
            top1 = proportion_interval([rank == 0 for rank in ranks])
            top5 = proportion_interval([rank is not None and rank < 5 for rank in ranks])
            stage_ms = "" if label == "hybrid" else f"{np.median(ms):.0f} / {np.percentile(ms, 95):.0f}"
            row = [dataset, stage, str(candidates), str(len(members)), label, top1.percent(), top5.percent(), stage_ms]
            lines.append(row + ([] if not timed else ["" if label == "hybrid" else total]))
    headers = ["tuning data", "stage", "candidates", "questions", "order", "top-1 % [95% CI]", "top-5 % [95% CI]", "stage ms p50 / p95"]
    if all("route_ms" in r for r in records):
        headers.append("route + stage p95 ms")
    return markdown_table(headers, lines, left=5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=400, help="questions per data set (the first ones; ckc has 312 tuning questions)")
    parser.add_argument("--late-candidates", type=int, default=CANDIDATES["late"])
    parser.add_argument("--lm-candidates", type=int, default=CANDIDATES["lm"])
    parser.add_argument("--lm-questions", type=int, default=60, help="questions per data set for the (slow) language-model stage")
    parser.add_argument("--lm", default="smollm2-135m", help="the language model that scores candidates")
    parser.add_argument("--size", type=int, default=5000, help="facts per generated bank")
    parser.add_argument("--data", nargs="+", choices=("own", "second", "ckc"), default=["own", "second", "ckc"], help="tuning data sets")
    parser.add_argument("--report-only", action="store_true", help="print the table from OUT/questions.jsonl")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_rerank")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--banks", type=Path, help="keep built banks here and reuse those kept, as tools/eval/eval_banks.py (default: build each run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    records = args.out / "questions.jsonl"
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        discard_records(records)
        keep = jsonl_appender(records)  # stamps each record with the commit, read once: a run's records are all of one tree

        embedder = BANK_CACHE.embedder(EMBEDDERS[0])
        stages = [("late", late_scorer(embedder), args.late_candidates, args.questions)]
        lm = load_model(args.lm, progress=False)
        stages.append(("lm", lm_scorer(lm.tokenizer, lm.model), args.lm_candidates, args.lm_questions))
        makers = {"own": own_dataset, "second": second_dataset, "ckc": lambda size, questions: ckc_datasets()[0]}
        datasets = [makers[name](args.size, args.questions) for name in args.data]
        with tempfile.TemporaryDirectory(prefix="eval-rerank-") as scratch, LmdbStore(args.banks or Path(scratch) / "store") as store:
            for dataset in datasets:
                bank, _ = kept_bank(store, dataset.facts, EMBEDDERS[0], DEFAULT_VECTORS)
                for stage, scorer, candidates, questions in stages:
                    trial(store, bank, dataset, embedder, stage, scorer, candidates, questions, keep)
                    log(f"{dataset.name} {stage}: done")
    text = table(read_jsonl(records))
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
