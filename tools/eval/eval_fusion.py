"""Choose how hybrid bank routes fuse cosine and BM25, by the worst case over the tuning data only (issue 54).

Two steps, so that the choice reads no data it may not:

``dump``: for each tuning data set (own, second and third generators at 5k and 100k facts; the ckc tuning half),
build the bank (MiniLM, the default vectors; kept under ``--banks`` and reused by later runs) and route every
question as ``route`` would, keeping each candidate fact's cosine and BM25 before fusion
(``packstore.bank.bank.route_candidates``) and where the answering fact is among them. One ``.npz`` per data set
under ``--candidates`` (scratch: a few MB each, not committed).

``sweep``: every fusion rule of ``RULES`` ranks the dumped candidates exactly as ``route`` would (the same arrays in
the same order, the same stable sort); per rule and data set top-1 and top-5 with Wilson intervals; the rule chosen
has the least worst shortfall over the data sets (``choose``): top-1 first, then top-5. Records: OUT/sweep.jsonl (one line per rule and
data set, with the commit), OUT/sweep.md.

The fourth generator and the ckc held-out half are never dumped here: they are measured once, by
tools/eval/eval_banks.py, after the choice.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_fusion dump [--sizes 5000 100000]
    .venv/bin/python -m tools.eval.eval_fusion sweep
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from packstore.bank.bank import route_candidates  # noqa: E402
from packstore.bank.fusion import Additive, Candidates, Fusion, LexicalLead, RankFusion  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.eval.eval_banks import BANK_CACHE, Dataset, banks_to_dump, ckc_datasets, own_dataset, second_dataset, third_dataset  # noqa: E402
from tools.lib.benchlib import logger  # noqa: E402
from tools.lib.evallib import REPO, fresh_appender, markdown_table, read_jsonl, wilson_interval  # noqa: E402

EMBEDDER = "all-minilm-l6-v2"
SCRATCH = Path(os.environ.get("PACKSTORE_EVAL_SCRATCH", "/tmp/packstore-eval"))
log = logger("eval_fusion")

RULES: list[Fusion] = (
    [Additive(w) for w in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0)]
    + [RankFusion(k, lexical) for k in (1, 3, 10, 30, 60) for lexical in (0.5, 1.0, 1.5, 2.0, 3.0)]
    + [LexicalLead(Additive(w), ratio) for w in (0.2, 0.3, 0.4, 0.5, 0.8) for ratio in (1.1, 1.2, 1.3, 1.5, 2.0, 3.0)]
    + [LexicalLead(RankFusion(k, 1.0), ratio) for k in (3, 10, 60) for ratio in (1.2, 1.5, 2.0, 3.0)]
)


def tuning_datasets(sizes: Sequence[int], questions: int) -> list[Dataset]:
    """The tuning data: own, second and third generators at each size, and the ckc tuning half (never held-out)."""
    found = [maker(size, questions) for size in sizes for maker in (own_dataset, second_dataset, third_dataset)]
    return found + [ckc_datasets()[0]]


def dump(datasets: Sequence[Dataset], banks: Path, out: Path) -> None:
    """Each data set's candidates, per question: cosine, BM25 and the answering fact's index among them (-1: absent)."""
    with LmdbStore(banks) as store:
        for dataset, target, name, _ in banks_to_dump(store, datasets, out, EMBEDDER, "candidates"):
            embedder = BANK_CACHE.embedder(EMBEDDER)
            cosine, bm25, gold, sizes = [], [], [], []
            for question, fact in dataset.questions:
                [(texts, candidates)] = route_candidates(store, name, [question], embedder, cache=BANK_CACHE)
                cosine.append(candidates.cosine)
                bm25.append(candidates.bm25)
                gold.append(texts.index(fact.strip()) if fact.strip() in texts else -1)
                sizes.append(len(texts))
            np.savez_compressed(
                target, cosine=np.concatenate(cosine), bm25=np.concatenate(bm25), gold=np.array(gold), sizes=np.array(sizes)
            )
            log(f"{dataset.name}: {len(gold)} questions, answering fact among the candidates for {sum(g >= 0 for g in gold)}")


def rank_of_gold(rule: Fusion, cosine: np.ndarray, bm25: np.ndarray, gold: int) -> int | None:
    """Where ``route`` (hybrid, this rule) puts the answering fact: 0-based, None when absent."""
    if gold < 0:
        return None
    candidates = Candidates(cosine=cosine, bm25=bm25)
    scores = rule(candidates) if bm25.any() else cosine
    order = np.argsort(-np.asarray(scores), kind="stable")
    return int(np.flatnonzero(order == gold)[0])


def sweep(candidates: Path, out: Path) -> list[dict]:
    """Every rule on every dumped data set: one record per rule and data set."""
    records = out / "sweep.jsonl"
    keep = fresh_appender(records)
    for path in sorted(candidates.glob("*.npz")):
        data = np.load(path)
        bounds = np.concatenate([[0], np.cumsum(data["sizes"])])
        questions = [(data["cosine"][a:b], data["bm25"][a:b], int(g)) for a, b, g in zip(bounds[:-1], bounds[1:], data["gold"])]
        for rule in RULES:
            ranks = [rank_of_gold(rule, cosine, bm25, gold) for cosine, bm25, gold in questions]
            top1 = sum(r == 0 for r in ranks)
            top5 = sum(r is not None and r < 5 for r in ranks)
            keep({"dataset": path.stem, "rule": rule.name, "questions": len(ranks), "top1": top1, "top5": top5})
        log(f"{path.stem}: {len(RULES)} rules")
    return read_jsonl(records)


def choose(records: Sequence[dict]) -> tuple[str, list[list[str]]]:
    """The rule whose worst shortfall over the data sets is least, among those that cannot drown a decisive lexical
    match whatever the cosines (rank fusion, the lead rule; the additive rules are there to compare with): per data
    set, the shortfall is the top-1 of the best rule there minus this rule's (ties: the same for top-5). A worst case of plain top-1 would be ckc's on every
    rule (about 80 % against 91-100 % elsewhere), and so would ignore every other data set. Also the table of all
    rules, best first."""
    rules: dict[str, dict[str, dict]] = {}
    for record in records:
        rules.setdefault(record["rule"], {})[record["dataset"]] = record
    datasets = sorted({record["dataset"] for record in records})

    def share(rule: str, dataset: str, field: str) -> float:
        return rules[rule][dataset][field] / rules[rule][dataset]["questions"]

    best = {(d, field): max(share(rule, d, field) for rule in rules) for d in datasets for field in ("top1", "top5")}

    def shortfall(rule: str, field: str) -> float:
        return max(best[d, field] - share(rule, d, field) for d in datasets)

    ordered = sorted(rules, key=lambda rule: (shortfall(rule, "top1"), shortfall(rule, "top5")))
    eligible = [rule for rule in ordered if not rule.startswith("additive")]  # (rank or lead rules: no cosine margin drowns BM25)
    rows = []
    for rule in ordered:
        cells = [rule, f"{100 * shortfall(rule, 'top1'):.1f}", f"{100 * shortfall(rule, 'top5'):.1f}"]
        for d in datasets:
            r = rules[rule][d]
            low, high = wilson_interval(r["top1"], r["questions"])
            cells.append(f"{100 * r['top1'] / r['questions']:.1f} [{100 * low:.1f}, {100 * high:.1f}] / {100 * r['top5'] / r['questions']:.1f}")
        rows.append(cells)
    headers = ["rule", "worst top-1 shortfall (points)", "worst top-5 shortfall", *[f"{d}: top-1 % [95% CI] / top-5 %" for d in datasets]]
    return eligible[0], [headers, *rows]


def sweep_table(records: Sequence[dict], best: int = 12) -> str:
    """The sweep as docs/evaluation.md shows it: the chosen rule, the ``best`` rules by worst shortfall, and the rule
    before issue 54 (additive w=0.2), each with its top-1 [Wilson 95 % CI] / top-5 per data set."""
    chosen, rows = choose(records)
    header, body = rows[0], rows[1:]
    shown = [row for row in body if row[0] == chosen]
    shown += [row for row in body[:best] if row[0] != chosen]
    shown += [row for row in body if row[0] == Additive(0.2).name and row not in shown]
    marked = [[f"**{row[0]}** (chosen)" if row[0] == chosen else row[0], *row[1:]] for row in shown]
    return markdown_table(header, marked)


def fusion_cost(pools: Sequence[int] = (600, 2400), repeats: int = 2000) -> list[list[str]]:
    """Microseconds the chosen rule and the old one take over a pool of candidates of each size (about the pools of
    100,000 and 1,000,000-fact banks: 10 and 100 probed clusters of 20 facts, plus the clusters of 20 BM25 hits), median
    of ``repeats``: what the fusion adds to a route, beside its measured latency."""
    from packstore.bank.bank import FUSION

    rng = np.random.default_rng(0)
    rows = []
    for size in pools:
        candidates = Candidates(cosine=rng.random(size, dtype=np.float32), bm25=np.where(rng.random(size) < 0.05, rng.random(size) * 20, 0).astype(np.float32))
        cells = [f"{size:,}"]
        for rule in (Additive(0.2), FUSION):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                scores = rule(candidates)
                np.argsort(-scores, kind="stable")
                times.append(time.perf_counter() - started)
            cells.append(f"{1e6 * float(np.median(times)):.0f}")
        rows.append(cells)
    return [["candidates", f"{Additive(0.2).name} us", f"{FUSION.name} us"], *rows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("dump", "sweep", "cost"))
    parser.add_argument("--sizes", nargs="+", type=int, default=[5000, 100000])
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--banks", type=Path, default=SCRATCH / "banks", help="where built banks are kept for reuse")
    parser.add_argument("--candidates", type=Path, default=SCRATCH / "candidates")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_fusion")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.step == "cost":
        rows = fusion_cost()
        print(markdown_table(rows[0], rows[1:]))
        return 0
    if args.step == "dump":
        dump(tuning_datasets(args.sizes, args.questions), args.banks, args.candidates)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    records = sweep(args.candidates, args.out)
    chosen, rows = choose(records)
    text = markdown_table(rows[0], rows[1:])
    (args.out / "sweep.md").write_text(f"chosen: {chosen}\n\n{text}\n")
    print(f"chosen: {chosen}\n\n{sweep_table(records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
