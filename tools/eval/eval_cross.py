"""Choose the cross-encoder stage (``--rerank cross``) on the tuning data only, by paired tests (issue 66).

Two steps, so that the choice reads no data it may not, as tools/eval/eval_fusion.py does:

``dump``: for each tuning data set (``--data``: own, second, third and fourth generators at ``--sizes``; the ckc tuning
half), build the bank (``--embedder``, the default vectors, kept under ``--banks``) and route every question as ``route``
would (``route_candidates``: each candidate's cosine and BM25) once per pool bound of ``RARE_BOUNDS`` (the facts holding
the question's rarest terms added to the pool, ``rare_facts``). Per question and bound keep: the shipped fusion's scores
(``bank.FUSION``) of its top ``POOL`` candidates in its order, where the answering fact is in that order (recall@N), the
route's milliseconds, and the cross-encoder's logit of each of the top ``POOL`` (one pair per run); once per question,
where the rule before issue 54 (additive w=0.2) puts the fact, and the cross-encoder's milliseconds a pair. One
``.npz`` per data set under ``--dumps``/EMBEDDER.

``sweep``: every (bound, N, weight) of ``RARE_BOUNDS`` x ``NS`` x ``WEIGHTS`` ranks each question's top N by logit +
weight x fused score, the rest below in fused order, exactly as ``Reranker.apply`` does over ``route(rare_facts=bound)``;
per data set top-1 and top-5 with Wilson intervals, and for each rule, question by question against the shipped fusion
(bound 0, no second stage) and against additive w=0.2, the exact McNemar p-value of top-1 and top-5. The rule chosen
has the least worst top-1 shortfall (then top-5, then the smaller bound and N) among the rules that lose top-5 on ckc
tuning to neither (p < 0.05 with more losses than gains). Records: OUT/EMBEDDER/sweep.jsonl and sweep.md (with the
costs).

The fourth generator, measured once for issue 54 and tuned on by nobody, joins the tuning data here: its described
questions (no name, three attributes, synonyms) are what the cross stage is for, and the 5,000-fact sets of the others
are saturated. The fifth generator and the ckc held-out half are never read here (``measure`` reads the fifth once,
after the choice).

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_cross dump [--embedder bge-small-en] [--sizes 5000] [--questions 500] [--data third fourth]
    .venv/bin/python -m tools.eval.eval_cross sweep [--embedder bge-small-en]
    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_cross measure [--embedder bge-small-en] [--sizes 5000 100000]

``measure`` (once, after the choice): the fifth generator's questions (``--sizes``) and the ckc held-out half (seen:
read question by question during issue 54), routed as shipped and with ``--rerank cross`` as `bank route` runs them,
top-1 and top-5 with Wilson intervals by question form, paired McNemar p-values, and route latency. Records:
OUT/EMBEDDER/measured.jsonl and measured.md.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from packstore.bank.bank import FUSION, route_candidates  # noqa: E402
from packstore.bank.fusion import Additive  # noqa: E402
from packstore.bank.onnx_models import load_cross_encoder  # noqa: E402
from packstore.format.bank import DEFAULT_VECTORS  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.eval.eval_banks import (  # noqa: E402
    BANK_CACHE,
    Dataset,
    banks_to_dump,
    ckc_datasets,
    fourth_dataset,
    kept_bank,
    own_dataset,
    second_dataset,
    third_dataset,
)
from tools.lib.benchlib import logger  # noqa: E402
from tools.lib.evallib import REPO, fresh_appender, markdown_table, mcnemar_exact, read_jsonl, wilson_interval  # noqa: E402

EMBEDDERS = ("all-minilm-l6-v2", "bge-small-en")  # the bank's embedder: today's default, and the ONNX one (item 3)
SCRATCH = Path(os.environ.get("PACKSTORE_EVAL_SCRATCH", "/tmp/packstore-eval"))
POOL = 30  # candidates cross-scored per question: the largest N of the sweep
RARE_BOUNDS = (0, 100, 300, 1000)  # facts with the question's rarest terms added to the pool (rerank.CROSS_RARE_FACTS)
NS = (5, 10, 15, 20, 30)
WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
OLD = Additive(0.2)
CKC = "ckc_tuning"
log = logger("eval_cross")


GENERATORS = {"own": own_dataset, "second": second_dataset, "third": third_dataset, "fourth": fourth_dataset}


def tuning_datasets(sizes: Sequence[int], questions: int, data: Sequence[str] = (*GENERATORS, "ckc")) -> list[Dataset]:
    """The tuning data named in ``data``: the own, second, third and fourth generators at each size, and the ckc
    tuning half (never held-out)."""
    found = [GENERATORS[name](size, questions) for size in sizes for name in data if name in GENERATORS]
    return found + ([ckc_datasets(questions)[0]] if "ckc" in data else [])


def _order(scores: np.ndarray) -> np.ndarray:
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")


def _place(order: np.ndarray, gold: int) -> int:
    return int(np.flatnonzero(order == gold)[0]) if gold >= 0 else -1


def dump(datasets: Sequence[Dataset], embedder_spec: str, banks: Path, out: Path) -> None:
    """Per question and pool bound (``RARE_BOUNDS``, ``route_candidates``' ``rare_facts``): the fused scores of the top
    ``POOL`` (in fused order), the answering fact's place in the fused order (-1: not among the candidates), the route's
    milliseconds, and the cross-encoder's logits of those facts; once per question, its milliseconds a pair and where
    the answering fact is in the old order (additive w=0.2 over the pool issue 54 routed, bound 0)."""
    out.mkdir(parents=True, exist_ok=True)
    cross = load_cross_encoder()
    with LmdbStore(banks) as store:
        for dataset, target, name, about in banks_to_dump(store, datasets, out / embedder_spec, embedder_spec, "dump"):
            embedder = BANK_CACHE.embedder(embedder_spec)
            shape = (len(RARE_BOUNDS), len(dataset.questions))
            fused_rows, logit_rows = np.full((*shape, POOL), np.nan), np.full((*shape, POOL), np.nan)
            gold_fused, route_ms = np.full(shape, -1), np.zeros(shape)
            gold_old, ms = [], []
            for index, (question, fact) in enumerate(dataset.questions):
                logits: dict[str, float] = {}  # a pair's logit does not depend on the other pairs (one per run)
                for b, bound in enumerate(RARE_BOUNDS):
                    started = time.perf_counter()
                    [(texts, candidates)] = route_candidates(store, name, [question], embedder, cache=BANK_CACHE, rare_facts=bound)
                    route_ms[b, index] = 1000 * (time.perf_counter() - started)
                    fused = FUSION(candidates) if candidates.bm25.any() else candidates.cosine
                    order = _order(fused)
                    gold = texts.index(fact.strip()) if fact.strip() in texts else -1
                    gold_fused[b, index] = _place(order, gold)
                    if bound == 0:
                        gold_old.append(_place(_order(OLD(candidates) if candidates.bm25.any() else candidates.cosine), gold))
                    top = order[:POOL]
                    new = [texts[i] for i in top if texts[i] not in logits]
                    started = time.perf_counter()
                    logits |= dict(zip(new, cross.score(question, new))) if new else {}
                    if bound == 0:
                        ms.append(1000 * (time.perf_counter() - started) / max(len(new), 1))
                    fused_rows[b, index, : len(top)] = np.asarray(fused, dtype=np.float64)[top]
                    logit_rows[b, index, : len(top)] = [logits[texts[i]] for i in top]
                if index % 100 == 99:
                    log(f"{dataset.name}: {index + 1} questions ({np.median(ms):.1f} ms a pair)")
            np.savez_compressed(target, bounds=np.array(RARE_BOUNDS), fused=fused_rows, logits=logit_rows, gold=gold_fused,
                                old=np.array(gold_old), pair_ms=np.array(ms), route_ms=route_ms, build_s=about["build_s"])
            found = ", ".join(f"{bound}: {int(np.sum((0 <= g) & (g < POOL)))}" for bound, g in zip(RARE_BOUNDS, gold_fused))
            log(f"{dataset.name}: {len(ms)} questions, answering fact in the top {POOL} by pool bound {found}")


def reranked_place(fused: np.ndarray, logits: np.ndarray, gold: int, n: int, weight: float) -> int:
    """Where the answering fact lands (0-based; -1 absent) when the top ``n`` of the fused order are re-scored by
    logit + ``weight`` x fused (``Reranker.apply`` with ``leads``) and the rest follow in fused order."""
    if gold < 0:
        return -1
    if gold >= n:
        return gold
    count = int(np.sum(~np.isnan(fused[:n])))
    scores = logits[:count] + weight * fused[:count]
    return int(np.flatnonzero(_order(scores) == gold)[0])


SHIPPED = FUSION.name + " (shipped)"  # the fused order over the pool issue 54 routed (bound 0), no second stage


def rule_name(bound: int, n: int | None = None, weight: float = 0.0) -> str:
    """The fused order over the pool widened by ``bound`` rare-term facts, re-scored by the cross stage when ``n``."""
    if n is None:
        return SHIPPED if bound == 0 else f"{FUSION.name} pool {bound}"
    return f"cross N={n} w={weight:g} pool {bound}"


FIRST_CHOICE = rule_name(0, 15, 8.0)  # what the 5,000-fact tuning sets chose first (fd2db70), before the pool was widened


def sweep(dumps: Path, out: Path) -> list[dict]:
    """One record per rule and data set, with every question's place (for the paired tests)."""
    records = out / "sweep.jsonl"
    keep = fresh_appender(records)
    for path in sorted(dumps.glob("*.npz")):
        data = np.load(path)
        pair = data["pair_ms"]
        keep({"dataset": path.stem, "rule": OLD.name, "places": [int(g) for g in data["old"]], "bound": 0, "n": 0})
        for b, bound in enumerate(int(bound) for bound in data["bounds"]):
            fused = [int(g) for g in data["gold"][b]]
            route = data["route_ms"][b]
            cost = {"build_s": float(data["build_s"]), "route_ms": [float(np.median(route)), float(np.percentile(route, 95))],
                    "pair_ms": [float(np.median(pair)), float(np.percentile(pair, 95))]}
            keep({"dataset": path.stem, "rule": rule_name(bound), "places": fused, "bound": bound, "n": 0, "cost": cost})
            for n in NS:
                for weight in WEIGHTS:
                    places = [reranked_place(f, lg, g, n, weight) for f, lg, g in zip(data["fused"][b], data["logits"][b], fused)]
                    keep({"dataset": path.stem, "rule": rule_name(bound, n, weight), "places": places, "bound": bound, "n": n})
        log(f"{path.stem}: {len(pair)} questions")
    return read_jsonl(records)


def hits(places: Sequence[int], k: int) -> np.ndarray:
    return np.array([0 <= p < k for p in places])


def paired(first: Sequence[int], second: Sequence[int], k: int) -> tuple[int, int, float]:
    """Questions only ``first`` has in its top ``k``, only ``second`` has, and the exact McNemar p-value."""
    a, b = hits(first, k), hits(second, k)
    only_first, only_second = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    return only_first, only_second, mcnemar_exact(only_first, only_second)


def loses(rule: Sequence[int], other: Sequence[int], k: int) -> bool:
    """Whether ``rule`` loses top-``k`` to ``other`` question by question (more losses than gains, p < 0.05)."""
    gained, lost, p = paired(rule, other, k)
    return lost > gained and p < 0.05


def choose(records: Sequence[dict]) -> tuple[str, list[list[str]]]:
    """The cross rule of least worst top-1 shortfall (then top-5, then the smaller pool bound and N: the cheaper
    route) over the data sets among those that lose top-5 on the ckc tuning half neither to the shipped fusion nor to
    additive w=0.2; and the table, best first."""
    by_rule: dict[str, dict[str, list[int]]] = {}
    cheapness: dict[str, tuple[int, int]] = {}
    for record in records:
        by_rule.setdefault(record["rule"], {})[record["dataset"]] = record["places"]
        cheapness[record["rule"]] = (record.get("bound", 0), record.get("n", 0))  # the first choice's records (fd2db70) have no pool bound
    datasets = sorted({record["dataset"] for record in records})

    def share(rule: str, dataset: str, k: int) -> float:
        return float(np.mean(hits(by_rule[rule][dataset], k)))

    best = {(d, k): max(share(rule, d, k) for rule in by_rule) for d in datasets for k in (1, 5)}

    def shortfall(rule: str, k: int) -> float:
        return max(best[d, k] - share(rule, d, k) for d in datasets)

    ordered = sorted(by_rule, key=lambda rule: (round(shortfall(rule, 1), 9), round(shortfall(rule, 5), 9), cheapness[rule]))
    ckc = next(d for d in datasets if d.startswith(CKC))
    eligible = [
        rule for rule in ordered
        if rule.startswith("cross") and not any(loses(by_rule[rule][ckc], by_rule[other][ckc], 5) for other in (SHIPPED, OLD.name))
    ]
    rows = []
    for rule in ordered:
        cells = [rule, f"{100 * shortfall(rule, 1):.1f}", f"{100 * shortfall(rule, 5):.1f}"]
        for d in datasets:
            places = by_rule[rule][d]
            top1, top5 = int(hits(places, 1).sum()), int(hits(places, 5).sum())
            low, high = wilson_interval(top1, len(places))
            cells.append(f"{100 * top1 / len(places):.1f} [{100 * low:.1f}, {100 * high:.1f}] / {100 * top5 / len(places):.1f}")
        rows.append(cells)
    headers = ["rule", "worst top-1 shortfall (points)", "worst top-5 shortfall", *[f"{d}: top-1 % [95% CI] / top-5 %" for d in datasets]]
    return eligible[0], [headers, *rows]


def paired_table(records: Sequence[dict], chosen: str) -> str:
    """The chosen rule against the shipped fusion and additive w=0.2, per data set: top-1 and top-5 gained / lost and
    the exact McNemar p-value; and recall@N of the fused order over the pool issue 54 routed and over the chosen rule's
    widened pool (where a second stage can find the fact at all)."""
    by_rule: dict[str, dict[str, list[int]]] = {}
    bound = next(record.get("bound", 0) for record in records if record["rule"] == chosen)
    for record in records:
        by_rule.setdefault(record["rule"], {})[record["dataset"]] = record["places"]
    rows = []
    for dataset in sorted(by_rule[chosen]):
        cells = [dataset]
        for other in (SHIPPED, OLD.name):
            for k in (1, 5):
                gained, lost, p = paired(by_rule[chosen][dataset], by_rule[other][dataset], k)
                cells.append(f"+{gained} / -{lost} (p {p:.3g})")
        orders = [by_rule[SHIPPED][dataset]] + ([by_rule[rule_name(bound)][dataset]] if bound else [])
        cells += [" / ".join(f"{100 * hits(places, n).mean():.1f}" for places in orders) for n in NS]
        rows.append(cells)
    pools = f" pool 0 / {bound}" if bound else ""
    headers = ["data set", "vs shipped top-1", "vs shipped top-5", "vs additive w=0.2 top-1", "vs additive w=0.2 top-5",
               *[f"recall@{n} %{pools}" for n in NS]]
    return markdown_table(headers, rows)


def cost_table(records: Sequence[dict]) -> str:
    """Per data set and pool bound, as the dump measured it (beside the other evaluation work on the machine): the
    bank's build seconds, the first stage's milliseconds a question (embed, probe, BM25, read the pool, fuse; median
    and p95) and the cross-encoder's a pair (median and p95 of per-question means; pairs run side by side, one thread
    each)."""
    rows = []
    for record in records:
        if "cost" in record:
            cost = record["cost"]
            rows.append([record["dataset"], str(record.get("bound", 0)), f"{cost['build_s']:.0f}", *(f"{v:.1f}" for v in cost["route_ms"] + cost["pair_ms"])])
    return markdown_table(["data set", "pool bound", "bank build s", "route ms, median", "p95", "cross ms a pair, median", "p95"], rows)


def sweep_table(records: Sequence[dict], best: int = 8) -> str:
    """The sweep as docs/evaluation.md shows it: the chosen rule first, the ``best`` next by worst shortfall, the
    first choice (fd2db70), the shipped fusion and additive w=0.2."""
    chosen, rows = choose(records)
    shown = [row for row in rows[1:] if row[0] == chosen] + [row for row in rows[1 : best + 1] if row[0] != chosen]
    shown += [row for row in rows[1:] if row[0] in (FIRST_CHOICE, SHIPPED, OLD.name) and row not in shown]
    marked = [[f"**{row[0]}** (chosen)" if row[0] == chosen else row[0], *row[1:]] for row in shown]
    return markdown_table(rows[0], marked)


def embedders_table(out: Path, rule: str = SHIPPED) -> str:
    """The two first stages question by question (the same questions): top-1 and top-5 of ``rule`` with each
    embedder's banks, MiniLM's wins / bge's wins and the exact McNemar p-value, and recall@20 of each."""
    places: dict[str, dict[str, list[int]]] = {}
    for spec in EMBEDDERS:
        for record in read_jsonl(out / spec / "sweep.jsonl"):
            if record["rule"] == rule:
                places.setdefault(record["dataset"], {})[spec] = record["places"]
    rows = []
    for dataset, found in sorted(places.items()):
        if len(found) < len(EMBEDDERS):
            continue
        minilm, bge = (found[spec] for spec in EMBEDDERS)
        cells = [dataset, str(len(minilm))]
        for k in (1, 5):
            cells += [f"{100 * hits(minilm, k).mean():.1f}", f"{100 * hits(bge, k).mean():.1f}"]
            first, second, p = paired(minilm, bge, k)
            cells.append(f"{first} / {second} (p {p:.3g})")
        cells += [f"{100 * hits(minilm, 20).mean():.1f}", f"{100 * hits(bge, 20).mean():.1f}"]
        rows.append(cells)
    headers = ["data set", "questions", "MiniLM top-1 %", "bge top-1 %", "top-1 wins MiniLM / bge", "MiniLM top-5 %", "bge top-5 %",
               "top-5 wins MiniLM / bge", "MiniLM recall@20 %", "bge recall@20 %"]
    return markdown_table(headers, rows)


def fifth_dataset(size: int, questions: int) -> tuple[Dataset, list[str]]:
    """The fifth generator's facts and a sample of its questions (tools/data/fifth_facts.sha256 pins them), with each
    question's form (named or described)."""
    from tools.data.fifth_facts import fifth_facts

    cases = fifth_facts(size)
    asked = random.Random(size).sample(cases, min(questions, size))
    return Dataset(f"fifth {size:,}", [c.fact for c in cases], [(c.question, c.fact) for c in asked]), [c.form for c in asked]


def measure(datasets: Sequence[tuple[Dataset, list[str]]], embedder_spec: str, banks_dir: Path, out: Path) -> list[dict]:
    """Route every question as shipped and with ``--rerank cross`` (its defaults: the chosen N, weight and pool), through
    ``LocalBanks.route`` as `bank route` does, timing each; one record per question."""
    from packstore.bank.bank import open_banks
    from packstore.bank.rerank import CANDIDATES, CROSS_RARE_FACTS, CROSS_WEIGHT

    shipped_cross = rule_name(CROSS_RARE_FACTS, CANDIDATES["cross"], CROSS_WEIGHT)  # what `--rerank cross` runs
    records = out / "measured.jsonl"
    keep = fresh_appender(records)
    with LmdbStore(banks_dir) as store:
        banks = open_banks(store, BANK_CACHE)
        for dataset, forms in datasets:
            name, about = kept_bank(store, dataset.facts, embedder_spec, DEFAULT_VECTORS)
            log(f"{dataset.name}: {embedder_spec} bank ready ({about['build_s']:.0f} s to build)")
            banks.route(name, [dataset.questions[0][0]], rerank="cross")  # warm: records read, models loaded
            for (question, fact), form in zip(dataset.questions, forms):
                row = {"dataset": dataset.name, "embedder": embedder_spec, "form": form, "build_s": about["build_s"], "rule": shipped_cross}
                for stage in ("none", "cross"):
                    started = time.perf_counter()
                    [found] = banks.route(name, [question], top_k=5, rerank=stage)
                    texts = [text for text, _ in found.facts]
                    row[stage] = {"place": texts.index(fact.strip()) if fact.strip() in texts else -1, "ms": 1000 * (time.perf_counter() - started)}
                keep(row)
            log(f"{dataset.name}: {len(forms)} questions measured")
    return read_jsonl(records)


def measured_table(records: Sequence[dict]) -> str:
    """Per data set and question form: top-1 and top-5 [Wilson 95 %] as shipped and with the cross stage, the exact
    McNemar p-values between them, and each one's route p50 / p95 ms."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        for form in ("all", record["form"]):
            groups.setdefault((record["dataset"], form), []).append(record)
    rows = []
    for (dataset, form), group in sorted(groups.items()):
        if form != "all" and len(group) == len(groups[dataset, "all"]):
            continue  # one form only (ckc): its row would repeat "all"
        cells = [dataset, form, str(len(group))]
        for stage in ("none", "cross"):
            places = [r[stage]["place"] for r in group]
            for k in (1, 5):
                found = int(hits(places, k).sum())
                low, high = wilson_interval(found, len(places))
                cells.append(f"{100 * found / len(places):.1f} [{100 * low:.1f}, {100 * high:.1f}]")
        for k in (1, 5):
            gained, lost, p = paired([r["cross"]["place"] for r in group], [r["none"]["place"] for r in group], k)
            cells.append(f"+{gained} / -{lost} (p {p:.3g})")
        for stage in ("none", "cross"):
            ms = [r[stage]["ms"] for r in group]
            cells.append(f"{np.median(ms):.0f} / {np.percentile(ms, 95):.0f}")
        rows.append(cells)
    headers = ["data set", "questions", "n", "shipped top-1 %", "shipped top-5 %", "cross top-1 %", "cross top-5 %",
               "cross vs shipped top-1", "top-5", "shipped ms p50 / p95", "cross ms p50 / p95"]
    return markdown_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("dump", "sweep", "measure"))
    parser.add_argument("--sizes", nargs="+", type=int, default=[5000])
    parser.add_argument("--embedder", choices=EMBEDDERS, default=EMBEDDERS[0], help="the banks' embedder (the route's first stage)")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--data", nargs="+", choices=(*GENERATORS, "ckc"), default=(*GENERATORS, "ckc"),
                        help="dump: the tuning data sets (a generator at each size, or the ckc tuning half)")
    parser.add_argument("--banks", type=Path, default=SCRATCH / "banks", help="where built banks are kept for reuse")
    parser.add_argument("--dumps", type=Path, default=SCRATCH / "cross")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_cross")
    args = parser.parse_args(argv)
    if args.step == "dump":
        dump(tuning_datasets(args.sizes, args.questions, args.data), args.embedder, args.banks, args.dumps)
        return 0
    if args.step == "measure":
        out = args.out / args.embedder
        out.mkdir(parents=True, exist_ok=True)
        held_out = [fifth_dataset(size, args.questions) for size in args.sizes]
        ckc = ckc_datasets(args.questions)[1]  # read question by question during issue 54: reported, marked as seen
        records = measure([*held_out, (ckc, ["ckc (seen)"] * len(ckc.questions))], args.embedder, args.banks, out)
        text = measured_table(records) + "\n"
        (out / "measured.md").write_text(text)
        print(text)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    dumps, out = args.dumps / args.embedder, args.out / args.embedder
    out.mkdir(parents=True, exist_ok=True)
    records = sweep(dumps, out)
    chosen, _ = choose(records)
    text = (sweep_table(records) + "\n\nPaired, question by question:\n\n" + paired_table(records, chosen)
            + "\n\nCost:\n\n" + cost_table(records) + "\n")
    (out / "sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
