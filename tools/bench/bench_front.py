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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import httpx  # noqa: E402

from packstore.answering.answer import route_bank  # noqa: E402
from packstore.bank.bank import BankCache  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, print_table, source_commit, source_description  # noqa: E402
from tools.lib.evallib import REPO, bare_question, load_rows  # noqa: E402
from tools.lib.front_stack import FrontStack, Timed, ask_front, ask_vllm, front_stack, wait_stored  # noqa: E402

log = logger("bench_front")
OVERHEAD_TARGET_MS = 5.0


def rag(client: httpx.Client, stack: FrontStack, facts: Sequence[str], question: str, max_tokens: int) -> Timed:
    """vLLM with ``facts`` as prompt text (no pack, nothing of its prefix cache)."""
    prompt = render(stack.tokenizer, facts, question).token_ids
    return ask_vllm(client, stack, prompt, max_tokens, {"pack": False}, f"bench-rag-{uuid.uuid4().hex}")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


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

    rows, seen = [], set()
    for row in load_rows():
        if row.context not in seen:
            seen.add(row.context)
            rows.append(row)
    rows = rows[: args.bank_rows]
    paragraphs = [row.context for row in rows]
    overhead_facts = paragraphs[:3]
    machine = machine_description({"httpx": httpx.__version__})
    print(f"Machine: {machine}\nSource: {source_description()}; model smollm2-135m (float32); data ckc_dev.jsonl")
    record("machine", machine=machine, bank_rows=len(paragraphs), top_k=args.top_k)
    bank_cache = BankCache()
    with tempfile.TemporaryDirectory(prefix="bench-front-") as tmp, httpx.Client(timeout=600) as client:
        log("building the packs and the bank, starting vLLM and the front")
        with front_stack(Path(tmp), {"overhead": overhead_facts}, {"ckc": paragraphs}, bank_cache=bank_cache) as stack:
            with LmdbStore(stack.store, readonly=True) as store:  # (open until the stack stops: one environment per process)
                route = lambda question: route_bank(store, bank_cache, "ckc", question, top_k=args.top_k)  # noqa: E731
                route(bare_question(rows[0].question))  # (the embedder loaded once, before timing)
                questions = [bare_question(row.question) for row in rows]
                warmup = ask_front(client, stack, questions[-1], args.max_tokens, bank="ckc", top_k=args.top_k)
                log(f"warm-up answered in {warmup.total_s:.2f} s")
                part1 = []
                for question in questions[: args.questions]:
                    start = time.perf_counter()
                    facts = route(question)
                    route_s = time.perf_counter() - start
                    cold = ask_front(client, stack, question, args.max_tokens, bank="ckc", top_k=args.top_k)
                    wait_stored(store, cold.report["pack"])
                    warm = ask_front(client, stack, question, args.max_tokens, bank="ckc", top_k=args.top_k)
                    text = rag(client, stack, facts, question, args.max_tokens)
                    tokens = len(render(stack.tokenizer, facts, question).token_ids)
                    same = cold.text == warm.text == text.text and facts == cold.report["facts"]
                    kinds = (cold.report.get("facts_pack"), warm.report.get("facts_pack"))
                    record("bank", question=question, prompt_tokens=tokens, route_s=route_s, cold_s=cold.first_token_s,
                           warm_s=warm.first_token_s, rag_s=text.first_token_s, facts_pack=kinds, same_text=same)
                    part1.append((tokens, route_s, cold, warm, text, kinds, same))
                    log(f"  {tokens} tokens: cold {cold.first_token_s:.3f} s, warm {warm.first_token_s:.3f} s, "
                        f"rag {text.first_token_s:.3f} s, route {ms(route_s)} ms, {kinds}")
                med = lambda values: statistics.median(values)  # noqa: E731
                cold_s, warm_s, rag_s = (med([p[i].first_token_s for p in part1]) for i in (2, 3, 4))
                print_table(
                    f"1. A bank question through the front, top {args.top_k} of {len(paragraphs)} ckc paragraphs: first token, median of "
                    f"{len(part1)} questions",
                    ["prompt tokens", "route ms", "cold s", "warm s", "RAG s", "cold / RAG", "warm / RAG", "computed, then loaded", "same text"],
                    [[f"{med([p[0] for p in part1]):.0f}", ms(med([p[1] for p in part1])), f"{cold_s:.3f}", f"{warm_s:.3f}",
                      f"{rag_s:.3f}", f"{cold_s / rag_s:.2f}x", f"{warm_s / rag_s:.2f}x",
                      f"{sum(p[5] == ('computed', 'loaded') for p in part1)}/{len(part1)}", f"{sum(p[6] for p in part1)}/{len(part1)}"]],
                )
                if args.concurrent:
                    batch = questions[args.questions : args.questions + args.concurrent]
                    routed = [route_bank(store, bank_cache, "ckc", q, top_k=args.top_k) for q in batch]

                    def together(ask) -> tuple[float, list[Timed]]:
                        start = time.perf_counter()
                        with ThreadPoolExecutor(len(batch)) as pool:
                            answers = list(pool.map(ask, range(len(batch))))
                        return time.perf_counter() - start, answers

                    front = lambda i: ask_front(client, stack, batch[i], args.max_tokens, bank="ckc", top_k=args.top_k)  # noqa: E731
                    cold_wall, colds = together(front)
                    for answer in colds:
                        wait_stored(store, answer.report["pack"])
                    warm_wall, warms = together(front)
                    rag_wall, rags = together(lambda i: rag(client, stack, routed[i], batch[i], args.max_tokens))
                    table = []
                    for mode, wall, answers in (("cold", cold_wall, colds), ("warm", warm_wall, warms), ("RAG", rag_wall, rags)):
                        first = med([a.first_token_s for a in answers])
                        record("concurrent", mode=mode, requests=len(batch), wall_s=wall, first_token_s=[a.first_token_s for a in answers])
                        table.append([mode, str(len(batch)), f"{wall:.2f}", f"{first:.3f}", f"{wall / rag_wall:.2f}x"])
                    print_table(f"2. {len(batch)} bank questions at once: seconds", ["mode", "requests", "wall s", "median first token s", "wall / RAG"], table)
                prompt = render(stack.tokenizer, overhead_facts, bare_question(rows[0].question)).token_ids
                key = stack.keys["overhead"]
                question = bare_question(rows[0].question)
                for _ in range(3):  # warm both paths
                    ask_front(client, stack, question, 1, packs=["overhead"])
                    ask_vllm(client, stack, prompt, 1, {"pack": key}, None)
                pairs = []
                for repeat in range(args.overhead_repeats):
                    order = ("front", "direct") if repeat % 2 == 0 else ("direct", "front")
                    timed = {}
                    for which in order:
                        if which == "front":
                            timed[which] = ask_front(client, stack, question, 1, packs=["overhead"])
                        else:
                            timed[which] = ask_vllm(client, stack, prompt, 1, {"pack": key}, None)
                    pairs.append((timed["front"].total_s, timed["direct"].total_s))
                    record("overhead", repeat=repeat, front_s=timed["front"].total_s, direct_s=timed["direct"].total_s,
                           saved=timed["front"].report.get("prompt_tokens_saved"), cached=timed["direct"].report.get("prompt_tokens_details"))
                front_p50, direct_p50 = med([p[0] for p in pairs]), med([p[1] for p in pairs])
                extra = med([p[0] - p[1] for p in pairs])
                print_table(
                    f"3. The front's own overhead, a packs request ({len(prompt)} prompt tokens, 1 new token), {len(pairs)} alternating pairs",
                    ["front p50 ms", "direct p50 ms", "median paired difference ms", "target", "met"],
                    [[ms(front_p50), ms(direct_p50), ms(extra), f"<= {OVERHEAD_TARGET_MS:g} ms", "yes" if extra * 1000 <= OVERHEAD_TARGET_MS else "no"]],
                )
                record("overhead_summary", front_p50_s=front_p50, direct_p50_s=direct_p50, paired_difference_s=extra)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"\nGPU figures unmeasured: vLLM runs here on CPU only (vllm-cpu).\nRecords: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
