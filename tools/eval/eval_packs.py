"""Accuracy of knowledge packs on ckc_dev (the paper's Tables 1 and 3), per model.

Each ckc row's context paragraph becomes one pack, kept whole as a single fact: the paragraphs are
short (about 100-200 tokens), many are flattened tables or lists that a sentence splitter would cut
at random, and one fact keeps the pack's text identical to the text-in-prompt baseline. Each
question is answered four ways, greedy, ``--max-new-tokens`` tokens:

(a) no knowledge: the question alone, rendered with the chat template;
(b) text in the prompt: the paragraph as the system message (``answer_with_text``);
(c) pack: the paragraph's pack, built with the chat template, injected through ``Answerer``;
(d) raw pack: the pack built without the chat template (``raw=True``), injected the same way.

``--prompt short`` (the default) asks each question with ``evallib.SHORT_ANSWER`` after it; ``--prompt open``
asks the bare question. The models answer in sentences either way. Every answer is scored two ways
(``evallib.METRICS``: contains, with a Wilson interval, and token F1, with a bootstrap one); strict exact
match is not reported (evallib's docstring says why).

(b) and (c) come from one ``Answerer.ask(compare_rag=True)``, which compares their generated token
ids: every difference is a divergence, and there must be none. Packs live in a scratch store in a
temp directory, deleted as soon as their row is scored. Outputs: a markdown table on stdout (and in
OUT/table.md), one JSON line per question (OUT/questions.jsonl, appended as each row is scored), a
summary (OUT/summary.json), and two PNGs in ``--figures``. A run resumes: rows already in
OUT/questions.jsonl for a model are not asked again (``--fresh`` starts over), so the hours-long full
run can be stopped and restarted. Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_packs [--models smollm2-135m gemma3-270m] [--limit N]

Progress goes to stderr. Torch runs one intra-op thread by default (``--threads``): on the shared
2-core machine two threads stalled whenever another process held a core (a 24-token answer took
25-47 s instead of 1.4 s), as tools/bench/bench_pack.py found for first-token latency.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from packstore.answering.api import build_and_store  # noqa: E402
from packstore.kv.inject import Answer, Sampling, generate  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, source_commit, source_description  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    METRICS,
    PROMPTS,
    REPO,
    Row,
    answer_scores,
    asked,
    contains_answer,
    grouped_bars,
    load_rows,
    markdown_table,
    metric_headers,
    metric_intervals,
    paired_difference,
    read_jsonl,
    resumed_records,
    write_jsonl,
)

CONDITIONS = {
    "none": "(a) no knowledge",
    "text": "(b) text in prompt",
    "pack": "(c) pack, chat template",
    "raw": "(d) pack, raw",
}
MODELS = ("smollm2-135m", "gemma3-270m")
log = logger("eval_packs")


def answer_without_knowledge(lm: LoadedModel, question: str, sampling: Sampling) -> Answer:
    """The question alone as the user turn of the chat template (the template's own default system text, if any)."""
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": question.strip()}], tokenize=False, add_generation_prompt=True)
    return generate(lm, lm.tokenizer(text, add_special_tokens=False).input_ids, sampling)


def scored(answer: str, prompt_tokens: int, row: Row) -> dict:
    """One condition's part of a record: the answer, its prompt tokens and its ``METRICS`` scores."""
    return {"answer": answer, "prompt_tokens": prompt_tokens, **answer_scores(answer, row.answers)}


def evaluate(
    lm: LoadedModel,
    rows: Sequence[Row],
    store: LmdbStore,
    sampling: Sampling,
    *,
    prompt: str = "short",
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One record per row: the four conditions' answers, prompt tokens and scores, and whether (b) and (c) diverged.

    ``prompt`` names what follows each question (``evallib.PROMPTS``). ``on_record`` sees each record as
    soon as its row is scored (the CLI appends it to questions.jsonl).
    """
    answerer = Answerer(lm, store, cache_bytes=0)
    records = []
    commit = source_commit()
    started = time.perf_counter()
    for index, row in enumerate(rows, 1):
        facts, question = [row.context], asked(row.question, prompt)
        templated, _ = build_and_store(store, lm, facts)
        raw, _ = build_and_store(store, lm, facts, raw=True)
        none = answer_without_knowledge(lm, question, sampling)
        with_pack = answerer.ask(Question(question, refs=(templated.key,), compare_rag=True, sampling=sampling))
        with_raw = answerer.ask(Question(question, refs=(raw.key,), sampling=sampling))
        store.delete(templated.key)
        store.delete(raw.key)
        record = {
            "model": lm.name,
            "id": row.id,
            "commit": commit,
            "prompt": prompt,
            "question": row.question,
            "answers": list(row.answers),
            "pack_tokens": templated.header.tokens,
            "raw_pack_tokens": raw.header.tokens,
            "divergent": not with_pack.identical,
            "conditions": {
                "none": scored(none.text, none.prompt_tokens, row),
                "text": scored(with_pack.rag_answer, with_pack.rag_prompt_tokens, row),
                "pack": scored(with_pack.answer, with_pack.kv_prompt_tokens, row),
                "raw": scored(with_raw.answer, with_raw.kv_prompt_tokens, row),
            },
        }
        records.append(record)
        if on_record is not None:
            on_record(record)
        if index % 10 == 0 or index == len(rows):
            rate = (time.perf_counter() - started) / index
            log(f"{lm.name}: {index}/{len(rows)} rows, {rate:.2f} s/row")
    return records


def summarize(records: Sequence[dict]) -> dict:
    """Per model and condition: each of ``METRICS`` (mean with its 95% interval, recomputed from the answers),
    mean prompt tokens; and divergences."""
    summary: dict = {}
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        conditions = {}
        for condition in CONDITIONS:
            scores = [r["conditions"][condition] for r in mine]
            conditions[condition] = metric_intervals([s["answer"] for s in scores], [r["answers"] for r in mine]) | {
                "prompt_tokens": sum(s["prompt_tokens"] for s in scores) / len(scores),
            }
        contains = {c: [float(contains_answer(r["conditions"][c]["answer"], r["answers"])) for r in mine] for c in ("pack", "raw")}
        summary[model] = {
            "questions": len(mine),
            "divergences": sum(r["divergent"] for r in mine),
            "pack_tokens": sum(r["pack_tokens"] for r in mine) / len(mine),
            "conditions": conditions,
            "raw_minus_pack": paired_difference(contains["raw"], contains["pack"]),  # what the chat template is worth
        }
    return summary


def table(summary: dict) -> str:
    """The markdown table: one line per model and condition."""
    lines = []
    for model, result in summary.items():
        for condition, label in CONDITIONS.items():
            scores = result["conditions"][condition]
            lines.append(
                [
                    model,
                    label,
                    str(result["questions"]),
                    *(scores[metric].percent() for metric in METRICS),
                    f"{scores['prompt_tokens']:.1f}",
                ]
            )
    headers = ["model", "condition", "questions", *metric_headers(), "prompt tokens / question"]
    notes = [
        f"{model}: divergences (b) vs (c): {r['divergences']} of {r['questions']} questions; mean pack size {r['pack_tokens']:.1f} tokens; "
        f"(d) - (c) contains, paired: {_points(r['raw_minus_pack'])} points"
        for model, r in summary.items()
    ]
    return markdown_table(headers, lines, left=2) + "\n\n" + "\n".join(notes)


def _points(interval) -> str:
    """A paired difference of shares in points with its 95 % paired bootstrap interval."""
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"


def plot(summary: dict, figures: Path) -> list[Path]:
    """Each metric per condition and model with its interval, and prompt tokens per condition and model."""
    accuracy, tokens = figures / "eval_packs_accuracy.png", figures / "eval_packs_prompt_tokens.png"
    counts = ", ".join(f"{m} n={r['questions']}" for m, r in summary.items())
    grouped_bars(
        accuracy,
        {
            name: {m: {CONDITIONS[c]: r["conditions"][c][metric] for c in CONDITIONS} for m, r in summary.items()}
            for metric, name in METRICS.items()
        },
        title=f"ckc_dev accuracy per condition (95% intervals: Wilson for contains, bootstrap for F1; {counts})",
        ylabel="score (0-1)",
    )
    grouped_bars(
        tokens,
        {
            "(c) and (d) take their pack's own tokens from its cache": {
                m: {CONDITIONS[c]: r["conditions"][c]["prompt_tokens"] for c in CONDITIONS} for m, r in summary.items()
            }
        },
        title=f"Mean prompt tokens prefilled per question ({counts})",
        ylabel="tokens per question",
    )
    return [accuracy, tokens]


def write_report(records: Sequence[dict], out: Path, figures: Path, about: dict) -> str:
    """Write questions.jsonl, summary.json, table.md and the figures; returns the markdown table."""
    summary = summarize(records)
    text = table(summary)
    write_jsonl(out / "questions.jsonl", records)
    (out / "summary.json").write_text(json.dumps(about | {"models": summary}, indent=2, default=dataclasses.asdict) + "\n")
    (out / "table.md").write_text(text + "\n")
    plot(summary, figures)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model names or directories")
    parser.add_argument("--limit", type=int, default=None, help="only the first N ckc rows per model")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_packs", help="results directory")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures", help="where the PNGs go")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prompt", choices=tuple(PROMPTS), default="short", help="what follows each question (evallib.PROMPTS)")
    parser.add_argument("--report-only", action="store_true", help="redo table and plots from OUT/questions.jsonl")
    parser.add_argument("--fresh", action="store_true", help="discard OUT/questions.jsonl instead of resuming it")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the module docstring)")
    args = parser.parse_args(argv)
    if args.report_only:
        records = read_jsonl(args.out / "questions.jsonl")
        about = json.loads((args.out / "summary.json").read_text())
        about.pop("models", None)
        print(write_report(records, args.out, args.figures, about))
        return 0
    torch.set_num_threads(args.threads)
    rows = load_rows(limit=args.limit)
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    settings = {"max_new_tokens": args.max_new_tokens, "prompt": args.prompt}
    records = resumed_records(args.out, "questions", settings, fresh=args.fresh)
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="eval-packs-") as scratch,
        LmdbStore(Path(scratch) / "store") as store,
        (args.out / "questions.jsonl").open("a") as sink,
    ):

        def keep(record: dict) -> None:
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()

        models = []
        for name in args.models:
            lm = load_model(name, progress=False)
            models.append(lm.name)
            done = {r["id"] for r in records if r["model"] == lm.name}
            todo = [row for row in rows if row.id not in done]
            log(f"{name} loaded on {lm.device} ({lm.dtype_name}); {len(todo)} of {len(rows)} rows to ask")
            records += evaluate(lm, todo, store, sampling, prompt=args.prompt, on_record=keep)
    asked = {row.id for row in rows}
    records = [r for r in records if r["model"] in models and r["id"] in asked]
    about = {
        "rows_per_model": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "prompt": args.prompt,
        "wall_seconds_last_run": round(time.perf_counter() - started, 1),
        "machine": machine_description({}),
        "source": source_description(),
    }
    print(write_report(records, args.out, args.figures, about))
    print(f"\n{len(records)} questions; this run took {about['wall_seconds_last_run']:.0f} s on {about['machine']}; {about['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
