"""Bank answers end to end on ckc_dev (the paper's Table 4): a bank of every ckc paragraph, per model.

Each question is answered four ways, greedy, ``--max-new-tokens`` tokens:

(a) no knowledge: the question alone in the chat template;
(b) gold paragraph as text: the question's own paragraph in the prompt (the oracle RAG baseline);
(e) bank: ``ask --bank`` routes the question in one bank of all 600 paragraphs and answers with the
    pack of its ``--top-k`` routed paragraphs (built lazily, stored, reused);
(f) bank facts as text: the same routed paragraphs, in the same order, in the prompt; (e) and (f)
    must generate the same tokens (``divergences``), as for single packs.

Prompt tokens count the tokens prefilled per question: (e) prefills only the question's turn.
The retrieval share (gold paragraph among the routed ones) is reported too. By default the
held-out half of the frozen split is asked (tools/ckc_split.json); ``--rows all`` asks all 600.
Outputs: OUT/questions.jsonl, OUT/summary.json, OUT/table.md, and a PNG in ``--figures``.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/eval_bank_answers.py [--models smollm2-135m] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.kv.inject import Sampling, answer_with_text  # noqa: E402
from packstore.kv.models import load_model  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from packstore.store.protocol import DEFAULT_TOP_K  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import logger, machine_description, source_description  # noqa: E402
from eval_packs import answer_without_knowledge, scored  # noqa: E402
from evallib import REPO, frozen_split, grouped_bars, load_rows, markdown_table, mean_interval, write_jsonl  # noqa: E402
from packstore.bank.bank import open_banks

CONDITIONS = {
    "none": "(a) no knowledge",
    "gold_text": "(b) gold paragraph as text",
    "bank": "(e) bank pack (routed)",
    "bank_text": "(f) routed paragraphs as text",
}
log = logger("eval_bank_answers")


def evaluate(lm, rows, store: LmdbStore, sampling: Sampling, top_k: int) -> list[dict]:
    """One record per row: the four conditions' answers and scores, the routed paragraphs, divergence."""
    answerer = Answerer(lm, store)
    records = []
    started = time.perf_counter()
    for index, row in enumerate(rows, 1):
        none = answer_without_knowledge(lm, row.question, sampling)
        gold = answer_with_text(lm, [row.context], row.question, sampling=sampling)
        banked = answerer.ask(Question(row.question, bank="ckc", top_k=top_k, compare_rag=True, sampling=sampling))
        records.append(
            {
                "model": lm.name,
                "id": row.id,
                "question": row.question,
                "answers": list(row.answers),
                "gold_routed": row.context.strip() in banked.facts,
                "gold_rank": banked.facts.index(row.context.strip()) + 1 if row.context.strip() in banked.facts else None,
                "divergent": not banked.identical,
                "conditions": {
                    "none": scored(none.text, none.prompt_tokens, row),
                    "gold_text": scored(gold.text, gold.prompt_tokens, row),
                    "bank": scored(banked.answer, banked.kv_prompt_tokens, row),
                    "bank_text": scored(banked.rag_answer, banked.rag_prompt_tokens, row),
                },
            }
        )
        if index % 10 == 0 or index == len(rows):
            log(f"{lm.name}: {index}/{len(rows)} rows, {(time.perf_counter() - started) / index:.2f} s/row")
    return records


def summarize(records: Sequence[dict]) -> dict:
    summary = {}
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        summary[model] = {
            "questions": len(mine),
            "divergences": sum(r["divergent"] for r in mine),
            "gold_routed": sum(r["gold_routed"] for r in mine) / len(mine),
            "conditions": {
                c: {
                    "em": mean_interval([r["conditions"][c]["em"] for r in mine]),
                    "f1": mean_interval([r["conditions"][c]["f1"] for r in mine]),
                    "prompt_tokens": sum(r["conditions"][c]["prompt_tokens"] for r in mine) / len(mine),
                }
                for c in CONDITIONS
            },
        }
    return summary


def table(summary: dict, top_k: int) -> str:
    lines = [
        [model, label, str(r["questions"]), r["conditions"][c]["em"].percent(), r["conditions"][c]["f1"].percent(), f"{r['conditions'][c]['prompt_tokens']:.1f}"]
        for model, r in summary.items()
        for c, label in CONDITIONS.items()
    ]
    notes = [
        f"{model}: gold paragraph among the {top_k} routed: {100 * r['gold_routed']:.1f} %; "
        f"divergences (e) vs (f): {r['divergences']} of {r['questions']}"
        for model, r in summary.items()
    ]
    headers = ["model", "condition", "questions", "EM % [95% CI]", "F1 % [95% CI]", "prompt tokens / question"]
    return markdown_table(headers, lines, left=2) + "\n\n" + "\n".join(notes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--rows", choices=("held-out", "all"), default="held-out")
    parser.add_argument("--limit", type=int, default=None, help="only the first N of those rows")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="paragraphs routed per question (as ask --bank)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_bank_answers")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = load_rows()
    asked = (rows if args.rows == "all" else frozen_split(rows)[1])[: args.limit]
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    started = time.perf_counter()
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="eval-bank-answers-") as scratch, LmdbStore(Path(scratch) / "store") as store:
        open_banks(store).build("ckc", [r.context for r in rows])
        for name in args.models:
            lm = load_model(name, progress=False)
            records += evaluate(lm, asked, store, sampling, args.top_k)
    summary = summarize(records)
    text = table(summary, args.top_k)
    about = {
        "rows": args.rows, "questions_per_model": len(asked), "top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
        "wall_seconds": round(time.perf_counter() - started, 1), "machine": machine_description({}), "source": source_description(),
    }
    write_jsonl(args.out / "questions.jsonl", records)
    (args.out / "summary.json").write_text(json.dumps(about | {"models": summary}, indent=2, default=lambda i: i.__dict__) + "\n")
    (args.out / "table.md").write_text(text + "\n")
    counts = ", ".join(f"{m} n={r['questions']}" for m, r in summary.items())
    grouped_bars(
        args.figures / "eval_bank_answers.png",
        {
            metric.upper(): {m: {CONDITIONS[c]: r["conditions"][c][metric] for c in CONDITIONS} for m, r in summary.items()}
            for metric in ("em", "f1")
        },
        title=f"ckc answers with a bank of all 600 paragraphs, top {args.top_k} routed ({counts})",
        ylabel="score (0-1)",
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
