"""Bank answers end to end on ckc_dev (the paper's Table 4): a bank of every ckc paragraph, per model.

Each question is answered four ways, greedy, ``--max-new-tokens`` tokens:

(a) no knowledge: the question alone in the chat template;
(b) gold paragraph as text: the question's own paragraph in the prompt (the oracle RAG baseline);
(e) bank: ``ask --bank`` routes the question in one bank of all 600 paragraphs and answers with the
    pack of its ``--top-k`` routed paragraphs (built lazily, stored, reused);
(f) bank facts as text: the same routed paragraphs, in the same order, in the prompt; (e) and (f)
    must generate the same tokens (``divergences``), as for single packs.

The bank routes the bare question (``evallib.bare_question``): the short-answer instruction is for the model,
and routing it too let its words move the route (records from before issue 54 routed the question with the
instruction; they carry no ``routing`` field, and the table says which way its records routed).

Prompt tokens count the tokens prefilled per question: (e) prefills only the question's turn.
The retrieval share (gold paragraph among the routed ones) is reported too. By default the
held-out half of the frozen split is asked (tools/data/ckc_split.json); ``--rows all`` asks all 600.
``--prompt`` and the metrics are as in tools/eval/eval_packs.py. Outputs: OUT/questions.jsonl (one
record per question, appended as it is scored, so a stopped run resumes; ``--fresh`` starts over),
OUT/summary.json, OUT/table.md, and a PNG in ``--figures``; ``--report-only`` redoes the last three.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_bank_answers [--models smollm2-135m] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.bank.bank import open_banks  # noqa: E402
from packstore.kv.inject import Sampling, answer_with_text  # noqa: E402
from packstore.kv.models import load_model  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from packstore.store.protocol import DEFAULT_TOP_K  # noqa: E402
from tools.eval.eval_packs import answer_without_knowledge, scored  # noqa: E402
from tools.lib.benchlib import logger, machine_description, source_description  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    METRICS,
    PROMPTS,
    REPO,
    asked,
    bare_question,
    frozen_split,
    grouped_bars,
    jsonl_appender,
    load_rows,
    markdown_table,
    metric_headers,
    metric_intervals,
    read_jsonl,
    resumed_records,
)

CONDITIONS = {
    "none": "(a) no knowledge",
    "gold_text": "(b) gold paragraph as text",
    "bank": "(e) bank pack (routed)",
    "bank_text": "(f) routed paragraphs as text",
}
ROUTING = "bare question"  # what the bank routes: the question without the --prompt instruction (records from issue 54 on)
log = logger("eval_bank_answers")


class BareQuestionRouting(Answerer):
    """An Answerer whose bank routes the bare question (``bare_question``) while the model is asked the question as
    given, the short-answer instruction included."""

    def route(self, bank: str, question: str, **options) -> list[str]:
        return super().route(bank, bare_question(question), **options)


def evaluate(
    lm, rows, store: LmdbStore, sampling: Sampling, top_k: int, *, prompt: str = "short", on_record: Callable[[dict], None] | None = None
) -> list[dict]:
    """One record per row: the four conditions' answers and scores, the routed paragraphs, divergence.

    ``on_record`` sees each record as soon as its row is scored (the CLI appends it to questions.jsonl)."""
    answerer = BareQuestionRouting(lm, store)
    records = []
    started = time.perf_counter()
    for index, row in enumerate(rows, 1):
        question = asked(row.question, prompt)
        none = answer_without_knowledge(lm, question, sampling)
        gold = answer_with_text(lm, [row.context], question, sampling=sampling)
        banked = answerer.ask(Question(question, bank="ckc", top_k=top_k, compare_rag=True, sampling=sampling))
        records.append(
            {
                "model": lm.name,
                "id": row.id,
                "prompt": prompt,
                "routing": ROUTING,
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
        if on_record is not None:
            on_record(records[-1])
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
            "routing": sorted({r.get("routing", "question with the short-answer instruction") if r.get("prompt") == "short" else "bare question"
                               for r in mine}),
            "conditions": {
                c: metric_intervals([r["conditions"][c]["answer"] for r in mine], [r["answers"] for r in mine])
                | {"prompt_tokens": sum(r["conditions"][c]["prompt_tokens"] for r in mine) / len(mine)}
                for c in CONDITIONS
            },
        }
    return summary


def table(summary: dict, top_k: int) -> str:
    lines = [
        [
            model,
            label,
            str(r["questions"]),
            *(r["conditions"][c][m].percent() for m in METRICS),
            f"{r['conditions'][c]['prompt_tokens']:.1f}",
        ]
        for model, r in summary.items()
        for c, label in CONDITIONS.items()
    ]
    notes = [
        f"{model}: gold paragraph among the {top_k} routed: {100 * r['gold_routed']:.1f} %; "
        f"divergences (e) vs (f): {r['divergences']} of {r['questions']}; the bank routed the {' / '.join(r['routing'])}"
        for model, r in summary.items()
    ]
    headers = ["model", "condition", "questions", *metric_headers(), "prompt tokens / question"]
    return markdown_table(headers, lines, left=2) + "\n\n" + "\n".join(notes)


def write_report(records: Sequence[dict], out: Path, figures: Path, about: dict) -> str:
    """Write summary.json, table.md and the figure from ``records``; returns the markdown table."""
    summary = summarize(records)
    text = table(summary, about["top_k"])
    (out / "summary.json").write_text(json.dumps(about | {"models": summary}, indent=2, default=lambda i: i.__dict__) + "\n")
    (out / "table.md").write_text(text + "\n")
    counts = ", ".join(f"{m} n={r['questions']}" for m, r in summary.items())
    grouped_bars(
        figures / "eval_bank_answers.png",
        {
            name: {m: {CONDITIONS[c]: r["conditions"][c][metric] for c in CONDITIONS} for m, r in summary.items()}
            for metric, name in METRICS.items()
        },
        title=f"ckc answers with a bank of all 600 paragraphs, top {about['top_k']} routed ({counts}; Wilson / bootstrap 95% intervals)",
        ylabel="score (0-1)",
    )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--rows", choices=("held-out", "all"), default="held-out")
    parser.add_argument("--limit", type=int, default=None, help="only the first N of those rows")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="paragraphs routed per question (as ask --bank)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prompt", choices=tuple(PROMPTS), default="short", help="what follows each question (evallib.PROMPTS)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_bank_answers")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    parser.add_argument("--report-only", action="store_true", help="redo table, summary and figure from OUT/questions.jsonl")
    parser.add_argument("--fresh", action="store_true", help="discard OUT/questions.jsonl instead of resuming it")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.report_only:
        about = json.loads((args.out / "summary.json").read_text())
        about.pop("models", None)
        print(write_report(read_jsonl(args.out / "questions.jsonl"), args.out, args.figures, about))
        return 0
    torch.set_num_threads(args.threads)
    rows = load_rows()
    chosen = (rows if args.rows == "all" else frozen_split(rows)[1])[: args.limit]
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    settings = {"rows": args.rows, "top_k": args.top_k, "max_new_tokens": args.max_new_tokens, "prompt": args.prompt, "routing": ROUTING}
    records = resumed_records(args.out, "questions", settings, fresh=args.fresh)
    keep = jsonl_appender(args.out / "questions.jsonl")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eval-bank-answers-") as scratch, LmdbStore(Path(scratch) / "store") as store:
        open_banks(store).build("ckc", [r.context for r in rows])
        for name in args.models:
            lm = load_model(name, progress=False)
            done = {r["id"] for r in records if r["model"] == lm.name}
            todo = [row for row in chosen if row.id not in done]
            log(f"{name} loaded; {len(todo)} of {len(chosen)} questions to ask")
            records += evaluate(lm, todo, store, sampling, args.top_k, prompt=args.prompt, on_record=keep)
    ids = {row.id for row in chosen}
    records = [r for r in records if r["id"] in ids]
    about = settings | {
        "questions_per_model": len(chosen),
        "wall_seconds_last_run": round(time.perf_counter() - started, 1),
        "machine": machine_description({}),
        "source": source_description(),
    }
    print(write_report(records, args.out, args.figures, about))
    return 0


if __name__ == "__main__":
    sys.exit(main())
