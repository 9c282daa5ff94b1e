"""Packs in vLLM against vLLM prefilling the text (issue 52): how often vLLM answers a held-out ckc question alike with
the paragraph's pack loaded through PackstoreConnector and with vLLM prefilling the same prompt tokens itself.

For every dtype (float32, bfloat16), over the held-out half of ckc_dev (tools/data/ckc_split.json), the model exported with
``packctl model export`` (``--model``, smollm2-135m), each row's paragraph becomes one pack (one fact, as
tools/eval/eval_packs.py builds them), and the question, asked with ``evallib.SHORT_ANSWER`` after it, is rendered with
the paragraph as the system message (``render``: the prompt begins with the pack's tokens). One vLLM engine per dtype
(block size ``--block-size``, prefix caching off, enforce_eager; tools/eval/vllm_answers.py in a process of its own, where
the run's engines start one after another) answers every question twice, greedy, ``--max-new-tokens`` tokens, each
request alone in its ``generate`` call:

- ``pack``: ``kv_transfer_params {"pack": NAME}``: the connector loads the pack's whole blocks of the prompt and vLLM
  prefills the rest (the pack's last partial block and the question);
- ``text``: ``{"pack": false}``: vLLM prefills the whole prompt in one pass.

Arm ``transformers`` (always): packs built by packstore's normal build (transformers) in the engine's dtype. Their K/V
are another computation than vLLM's joint prefill: transformers' kernels, and the pack's tokens prefilled alone (other
GEMM and attention shapes than the whole prompt). Arm ``vllm`` (``--engine-packs N``: the first N rows whose pack fills
a cache block): packs built with vLLM's own prefill (``packctl build --engine vllm``; one engine start per pack),
answered in an engine with prefix caching on, and compared with vLLM's own prefix cache for the same prompt (the pack's
tokens prefilled alone, then the question reusing their blocks: must be identical, ids and logprobs) as well as with
the text prefilled in one pass: where this arm differs from the text, the split alone (same kernels) makes the
difference. Arm ``saved`` (``--saved-packs N``, issue 64): packs vLLM stores while serving. In an engine that saves,
each question is asked once naming its paragraph with ``save: true`` (the one-pass answer: vLLM prefills paragraph and
question together, and the paragraph's range becomes a pack), then from vLLM's own prefix cache of the paragraph's
tokens alone; a fresh engine then answers it with the saved pack loaded. The saved pack's answer is compared with the
saving request's own one-pass answer ("text") and with the saving engine's prefix cache (must be identical).

Per question a record says whether the pack applied (``pack_applied`` from the response's kv_transfer_params, else the
``reason``), whether the two answers have identical token ids (and bit-identical logprobs), the first position where
they differ, and whether each contains the gold answer (``evallib.contains_answer``). Per arm and dtype the table
gives the identical answers and the answers that agree on containing the gold answer, as counts with Wilson 95 %
intervals. Outputs: OUT/<arm>-<dtype>.jsonl (one JSON line per question, appended as each answer pair arrives, so a
stopped run resumes where it stopped; ``--fresh`` starts over), OUT/settings.json, OUT/table.md, and
``--figures``/eval_vllm.png. Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_vllm [--dtypes float32 bfloat16] [--limit N] [--engine-packs N]

``--report-only`` redoes the table and figure from the records (tools/eval/doc_tables.py makes the same table).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tools.lib.benchlib import logger, machine_description, source_description  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    PROMPTS,
    REPO,
    Interval,
    Row,
    asked,
    contains_answer,
    frozen_split,
    jsonl_appender,
    load_rows,
    markdown_table,
    mcnemar_exact,
    read_jsonl,
    record_files,
    resumed_records,
)

DRIVER = Path(__file__).resolve().with_name("vllm_answers.py")
DTYPES = ("float32", "bfloat16")
ARMS = {
    "transformers": "transformers-built pack",
    "vllm": "vLLM-built pack (--engine vllm)",
    "saved": "pack vLLM saved while serving (save: true)",
}
SHORT = {"transformers": "transformers-built", "vllm": "vLLM-built", "saved": "vLLM-saved"}
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
log = logger("eval_vllm")


def wilson(count: int, total: int, z: float = Z95) -> Interval:
    """``count`` of ``total`` as a proportion with its Wilson score interval (95 % by default); the interval of the
    binomial proportion that stays inside [0, 1] and keeps its coverage at 0 or ``total`` successes."""
    if total <= 0:
        raise ValueError("no trials")
    p = count / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return Interval(p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))  # p lies inside: not rounded out


def first_difference(first: Sequence[int], second: Sequence[int]) -> int | None:
    """The first position where two token-id sequences differ (one ending early counts), or None when equal."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return None if len(first) == len(second) else min(len(first), len(second))


def held_out_rows(limit: int | None) -> list[Row]:
    """The held-out half of ckc_dev (tools/data/ckc_split.json), in the split's order, the first ``limit`` when given."""
    _, held_out = frozen_split(load_rows())
    return held_out[:limit] if limit is not None else held_out


def block_filling_rows(model: str, rows: Sequence[Row], block_size: int, count: int) -> list[Row]:
    """The first ``count`` rows whose pack fills at least one cache block (a shorter pack cannot apply in vLLM, and
    each vLLM-built pack costs an engine start)."""
    from packstore.kv.models import load_tokenizer
    from packstore.kv.render import pack_prefix_ids

    tokenizer = load_tokenizer(model)
    return [row for row in rows if len(pack_prefix_ids(tokenizer, [row.context])) >= block_size][:count]


def pack_name(row: Row) -> str:
    return f"q-{row.id}"


# -- running the engine -------------------------------------------------------------------------------------------


class Engines:
    """tools/eval/vllm_answers.py in one process for the run, fed spec after spec on stdin: every engine of the run (one
    an arm and dtype) starts in it once the previous one is down, so Python starts and vLLM is imported once, not once
    an engine (about 10 CPU seconds each). Its log goes to ``log_path``; a failed run raises with the log's end."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def answers(self, spec: dict, work: Path) -> Iterator[dict]:
        """Serve ``spec`` (written to WORK/spec.json) with an engine of its own; its answers as they come."""
        (work / "spec.json").write_text(json.dumps(spec))
        if self.process is None or self.process.poll() is not None:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
            with self.log_path.open("a") as engine_log:
                self.process = subprocess.Popen(
                    [sys.executable, str(DRIVER), "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=engine_log, text=True, env=env
                )
        process = self.process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(f"{work / 'spec.json'}\n")
        process.stdin.flush()
        finished = False
        try:
            for line in process.stdout:
                if not line.startswith("{"):
                    continue
                message = json.loads(line)
                if message.get("event") == "ready":
                    log("vLLM engine ready")
                elif message.get("event") == "done":
                    finished = True
                    return
                elif "tag" in message:
                    yield message
        finally:
            if not finished:  # the engine failed, or the caller stopped reading: this process is not the next engine's
                self.process = None
                if process.poll() is None:
                    process.terminate()
                code = process.wait()
                if code not in (0, -15):
                    tail = "\n".join(self.log_path.read_text().splitlines()[-30:])
                    raise RuntimeError(f"vLLM exited with {code}:\n{tail}")
        raise RuntimeError(f"vLLM exited before answering every request:\n{self.log_path.read_text()[-3000:]}")

    def close(self) -> None:
        """End the process once its last engine is down."""
        if self.process is not None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                self.process.wait()
            self.process = None


def paired(answers: Iterator[dict], parts: int) -> Iterator[tuple[str, dict[str, dict]]]:
    """Group answers tagged ``ROW/PART`` by row, yielding a row once its ``parts`` answers have come."""
    pending: dict[str, dict[str, dict]] = {}
    for answer in answers:
        row, part = answer["tag"].rsplit("/", 1)
        pending.setdefault(row, {})[part] = answer
        if len(pending[row]) == parts:
            yield row, pending.pop(row)


def pack_report(answer: dict, expected: list[int], prompt: list[int]) -> dict:
    """Whether the pack applied, from the response's kv_transfer_params, with the reason when it did not."""
    kv = answer.get("kv") or {}
    report = {"pack_applied": kv.get("pack_applied") is True, "pack_tokens_loaded": kv.get("pack_tokens_loaded", 0)}
    if not report["pack_applied"]:
        reason = kv.get("reason") or ("no kv_transfer_params came back" if not kv else "pack_applied is not true")
        if prompt[: len(expected)] != expected:
            reason += " (the prompt does not begin with the pack's tokens)"
        report["reason"] = reason
    return report


def compared(first: dict, second: dict) -> dict:
    """How two answers to one prompt compare: identical ids, bit-identical logprobs, the first differing position."""
    identical = first["ids"] == second["ids"]
    return {
        "identical": identical,
        "logprobs_identical": identical and first["logprobs"] == second["logprobs"],
        "first_difference": first_difference(first["ids"], second["ids"]),
    }


def answer_part(answer: dict, answers: Sequence[str]) -> dict:
    return {"text": answer["text"], "ids": answer["ids"], "logprobs": answer["logprobs"], "contains": contains_answer(answer["text"], answers)}


# -- the arms ---------------------------------------------------------------------------------------------------


class Context:
    """What a run shares between arms and dtypes: the exported model (made on first use), the scratch directory,
    the settings, the process the engines run in."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.args = args
        self.scratch = scratch
        self._model_dir: Path | None = None
        self.engines = Engines(scratch / "vllm.log")

    @property
    def model_dir(self) -> Path:
        if self._model_dir is None:
            from packstore.kv.export import export_model

            exported = export_model(self.args.model, self.scratch / "model")
            log(f"{self.args.model} exported to {exported.directory} (model_fp {exported.model_fp[:12]})")
            self._model_dir = exported.directory
        return self._model_dir

    def spec(self, dtype: str, store: Path, requests: list, *, prefix_caching: bool, **connector: object) -> dict:
        return {
            "model": str(self.model_dir),
            "dtype": dtype,
            "block_size": self.args.block_size,
            "prefix_caching": prefix_caching,
            "max_model_len": 4096,
            "connector": {"store": str(store), "automatic": False, **connector},
            "requests": requests,
        }


def base_record(row: Row, args: argparse.Namespace, arm: str, dtype: str, pack_tokens: int, prompt: list[int]) -> dict:
    return {
        "model": args.model,
        "arm": arm,
        "dtype": dtype,
        "id": row.id,
        "question": row.question,
        "answers": list(row.answers),
        "prompt": args.prompt,
        "block_size": args.block_size,
        "max_tokens": args.max_new_tokens,
        "pack_tokens": pack_tokens,
        "prompt_tokens": len(prompt),
    }


def rendered(tokenizer, header, row: Row, prompt: str) -> list[int]:
    from packstore.kv.render import render

    return list(render(tokenizer, list(header.facts), asked(row.question, prompt), raw=header.raw).token_ids)


def run_saved_arm(context: Context, dtype: str, rows: Sequence[Row], keep: Callable[[dict], None]) -> int:
    """Packs vLLM saves while it serves (issue 64): in an engine that saves (prefix caching on), each question asked
    once naming its paragraph with ``save: true`` (vLLM prefills paragraph and question in one pass, and the
    paragraph's range is stored as a pack), then from vLLM's own prefix cache of the paragraph's tokens alone; then, in
    a fresh engine, with the saved pack loaded. Compared: the loaded pack against the saving request's own one-pass
    answer ("text"), and against the saving engine's prefix cache (must be identical, ids and logprobs)."""
    from packstore.kv.models import load_tokenizer
    from packstore.kv.render import pack_prefix_ids, render

    args = context.args
    work = context.scratch / f"saved-{dtype}"
    work.mkdir()
    tokenizer = load_tokenizer(str(context.model_dir))
    saving: list = []
    loading: list = []
    prepared: dict[str, tuple[Row, dict, list[int]]] = {}
    for row in rows:
        facts = [row.context]
        rendering = list(pack_prefix_ids(tokenizer, facts))
        prompt = list(render(tokenizer, facts, asked(row.question, args.prompt)).token_ids)
        prepared[row.id] = (row, base_record(row, args, "saved", dtype, len(rendering), prompt), rendering)
        ask = {"prompt_token_ids": prompt, "max_tokens": args.max_new_tokens}
        saving += [
            "reset",
            {"tag": f"{row.id}/text", **ask, "kv_transfer_params": {"pack": {"facts": facts}, "save": True, "name": pack_name(row)}},
            "reset",
            {"tag": f"{row.id}/prime", "prompt_token_ids": rendering, "max_tokens": 1, "kv_transfer_params": {"pack": False}},
            {"tag": f"{row.id}/cache", **ask, "kv_transfer_params": {"pack": False}},
        ]
        loading += ["reset", {"tag": f"{row.id}/pack", **ask, "kv_transfer_params": {"pack": pack_name(row)}}]
    answers: dict[str, dict[str, dict]] = {}
    for spec in (
        context.spec(dtype, work / "store", saving, prefix_caching=True, allow_save=True),
        context.spec(dtype, work / "store", loading, prefix_caching=True),
    ):
        for answer in context.engines.answers(spec, work):
            row_id, part = answer["tag"].rsplit("/", 1)
            answers.setdefault(row_id, {})[part] = answer
    done = 0
    for row_id, (row, record, rendering) in prepared.items():
        parts = answers.get(row_id, {})
        if not {"text", "cache", "pack"} <= set(parts):
            raise RuntimeError(f"saved {dtype}: the engines did not answer every request of question {row_id}")
        pack, text = parts["pack"], parts["text"]
        record = dict(record) | pack_report(pack, rendering, record_prompt(saving, row_id))
        record["saved"] = (text.get("kv") or {}).get("pack_saved") is not None
        record["save_reason"] = (text.get("kv") or {}).get("pack_save_reason")
        record |= compared(pack, text)
        record["cache"] = compared(pack, parts["cache"])
        record["pack"] = answer_part(pack, row.answers)
        record["text"] = answer_part(text, row.answers)
        keep(record)
        done += 1
    log(f"saved {dtype}: {done} questions")
    return done


def record_prompt(requests: list, row_id: str) -> list[int]:
    """The prompt of question ``row_id``'s one-pass request among ``requests``."""
    return next(r["prompt_token_ids"] for r in requests if r != "reset" and r["tag"] == f"{row_id}/text")


def run_transformers_arm(context: Context, dtype: str, rows: Sequence[Row], keep: Callable[[dict], None]) -> int:
    """Packs built by transformers in ``dtype``; each question asked with the pack and with the pack opted out."""
    import torch

    from packstore.answering.api import build_and_store
    from packstore.kv.models import load_model
    from packstore.store import LmdbStore

    args = context.args
    work = context.scratch / f"transformers-{dtype}"
    work.mkdir()
    torch.set_num_threads(args.threads)
    lm = load_model(str(context.model_dir), device="cpu", dtype=dtype, progress=False)
    requests: list = []
    prepared: dict[str, tuple[Row, dict, list[int]]] = {}
    started = time.perf_counter()
    with LmdbStore(work / "store") as store:
        for row in rows:
            stored, _ = build_and_store(store, lm, [row.context], name=pack_name(row))
            prompt = rendered(lm.tokenizer, stored.header, row, args.prompt)
            prepared[row.id] = (row, base_record(row, args, "transformers", dtype, stored.header.tokens, prompt), list(stored.header.token_ids))
            for part, transfer in (("pack", {"pack": pack_name(row)}), ("text", {"pack": False})):
                requests.append({"tag": f"{row.id}/{part}", "prompt_token_ids": prompt, "max_tokens": args.max_new_tokens,
                                 "kv_transfer_params": transfer})
    log(f"{dtype}: {len(rows)} packs built by transformers in {time.perf_counter() - started:.0f} s")
    del lm
    gc.collect()
    spec = context.spec(dtype, work / "store", requests, prefix_caching=False)
    return _collect(spec, context.engines.answers(spec, work), prepared, keep, f"transformers {dtype}", lambda parts, _: parts["text"])


def run_engine_arm(context: Context, dtype: str, rows: Sequence[Row], keep: Callable[[dict], None]) -> int:
    """Packs built by vLLM (``--engine vllm``); each question asked with the pack, then from vLLM's own prefix cache
    of the pack's tokens, then with the text prefilled in one pass (prefix cache emptied between them)."""
    from packstore.answering.api import store_pack
    from packstore.kv.engine_build import build_pack_with_engine
    from packstore.kv.models import load_tokenizer
    from packstore.store import LmdbStore

    args = context.args
    work = context.scratch / f"vllm-{dtype}"
    work.mkdir()
    tokenizer = load_tokenizer(str(context.model_dir))
    requests: list = []
    prepared: dict[str, tuple[Row, dict, list[int]]] = {}
    started = time.perf_counter()
    with LmdbStore(work / "store") as store:
        for index, row in enumerate(rows, 1):
            pack = build_pack_with_engine(str(context.model_dir), [row.context], dtype=dtype, block_size=args.block_size)
            stored, _ = store_pack(store, pack, name=pack_name(row))
            prompt = rendered(tokenizer, stored.header, row, args.prompt)
            prepared[row.id] = (row, base_record(row, args, "vllm", dtype, stored.header.tokens, prompt), list(stored.header.token_ids))
            ask = {"prompt_token_ids": prompt, "max_tokens": args.max_new_tokens}
            requests += [
                "reset",
                {"tag": f"{row.id}/pack", **ask, "kv_transfer_params": {"pack": pack_name(row)}},
                "reset",
                {"tag": f"{row.id}/prime", "prompt_token_ids": list(stored.header.token_ids), "max_tokens": 1, "kv_transfer_params": {"pack": False}},
                {"tag": f"{row.id}/cache", **ask, "kv_transfer_params": {"pack": False}},
                "reset",
                {"tag": f"{row.id}/text", **ask, "kv_transfer_params": {"pack": False}},
            ]
            log(f"{dtype}: {index}/{len(rows)} packs built by vLLM, {(time.perf_counter() - started) / index:.0f} s each")
    spec = context.spec(dtype, work / "store", requests, prefix_caching=True)

    def extra(parts: dict[str, dict], record: dict) -> dict:
        record["cache"] = compared(parts["pack"], parts["cache"])
        return parts["text"]

    return _collect(spec, context.engines.answers(spec, work), prepared, keep, f"vllm-built {dtype}", extra, parts=4)


def _collect(
    spec: dict,
    engine: Iterator[dict],
    prepared: dict[str, tuple[Row, dict, list[int]]],
    keep: Callable[[dict], None],
    what: str,
    text_of: Callable[[dict[str, dict], dict], dict],
    *,
    parts: int = 2,
) -> int:
    """Keep one record per row as the answers of ``spec``'s engine arrive; the number kept."""
    started, done = time.perf_counter(), 0
    for row_id, answers in paired(engine, parts):
        row, record, expected = prepared[row_id]
        record = dict(record)
        pack, prompt = answers["pack"], spec_prompt(spec, row_id)
        record |= pack_report(pack, expected, prompt)
        text = text_of(answers, record)
        record |= compared(pack, text)
        record["pack"] = answer_part(pack, row.answers)
        record["text"] = answer_part(text, row.answers)
        keep(record)
        done += 1
        if done % 10 == 0 or done == len(prepared):
            log(f"{what}: {done}/{len(prepared)} questions, {(time.perf_counter() - started) / done:.1f} s each")
    if done != len(prepared):
        raise RuntimeError(f"{what}: the engine answered {done} of {len(prepared)} questions")
    return done


def spec_prompt(spec: dict, row_id: str) -> list[int]:
    return next(r["prompt_token_ids"] for r in spec["requests"] if r != "reset" and r["tag"] == f"{row_id}/pack")


# -- the report -------------------------------------------------------------------------------------------------


def summarize(records: Sequence[dict]) -> list[dict]:
    """One summary per (arm, dtype), in ARMS then DTYPES order: counts and Wilson intervals over the questions whose
    pack applied."""
    summaries = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["arm"], record["dtype"]), []).append(record)
    for (arm, dtype), mine in sorted(groups.items(), key=lambda item: (list(ARMS).index(item[0][0]), item[0][1] != "float32", item[0][1])):
        applied = [r for r in mine if r["pack_applied"]]
        n = len(applied)
        identical = sum(r["identical"] for r in applied)
        agree = sum(r["pack"]["contains"] == r["text"]["contains"] for r in applied)
        different = [r for r in applied if not r["identical"]]
        summary = {
            "arm": arm,
            "dtype": dtype,
            "model": mine[0]["model"],
            "questions": len(mine),
            "applied": n,
            "reasons": Counter(re.sub(r"\d+", "N", r.get("reason", "")) for r in mine if not r["pack_applied"]),
            "identical": identical,
            "logprobs_identical": sum(r["logprobs_identical"] for r in applied),
            "contains_agree": agree,
            "different": len(different),
            "different_both_contain": sum(r["pack"]["contains"] and r["text"]["contains"] for r in different),
            "different_contains_agree": sum(r["pack"]["contains"] == r["text"]["contains"] for r in different),
            "first_differences": sorted(r["first_difference"] for r in different),
            "pack_contains": sum(r["pack"]["contains"] for r in applied),
            "text_contains": sum(r["text"]["contains"] for r in applied),
            "pack_tokens": sum(r["pack_tokens"] for r in mine) / len(mine),
            "commits": sorted({r.get("commit", "unknown") for r in mine}),
            # identical answers: each one's largest |logprob difference| between the pack's and the text's
            "logprob_gaps": sorted(max((abs(x - y) for x, y in zip(r["pack"]["logprobs"], r["text"]["logprobs"], strict=True)), default=0.0)
                                   for r in applied if r["identical"]),
            "pack_only": sum(r["pack"]["contains"] and not r["text"]["contains"] for r in applied),
            "text_only": sum(r["text"]["contains"] and not r["pack"]["contains"] for r in applied),
        }
        if n:
            summary["identical_interval"] = wilson(identical, n)
            summary["agree_interval"] = wilson(agree, n)
        cached = [r for r in applied if "cache" in r]
        if cached:
            summary["cache_identical"] = sum(r["cache"]["identical"] for r in cached)
            summary["cache_logprobs_identical"] = sum(r["cache"]["logprobs_identical"] for r in cached)
            summary["cache_interval"] = wilson(summary["cache_identical"], len(cached))
        summaries.append(summary)
    return summaries


def _count(count: int, total: int, interval: Interval | None = None) -> str:
    if total == 0:
        return "n/a"
    interval = interval or wilson(count, total)
    return f"{count}/{total} ({interval.percent()})"


def _positions(first: Sequence[int]) -> str:
    """Where differing answers first differ: every position when few, else the median, quartiles and first-token count."""
    if not first:
        return "no answer differs"
    if len(first) <= 8:
        return f"first differing token at {', '.join(map(str, first))}"
    q1, median, q3 = (first[round(f * (len(first) - 1))] for f in (0.25, 0.5, 0.75))
    return f"first differing token: median {median} (quartiles {q1}, {q3}), {first.count(0)} at the first token"


def table(records: Sequence[dict]) -> str:
    """The markdown table, one line per arm and dtype, and a note line per arm and dtype under it."""
    summaries = summarize(records)
    headers = [
        "model", "pack", "dtype", "questions", "pack applied", "identical ids % [Wilson 95%]", "contains agrees % [Wilson 95%]",
        "differing: both contain gold", "contains, pack", "contains, text",
    ]
    lines, notes = [], []
    for s in summaries:
        n = s["applied"]
        lines.append([
            s["model"], ARMS[s["arm"]], s["dtype"], str(s["questions"]), f"{n}/{s['questions']}",
            _count(s["identical"], n, s.get("identical_interval")), _count(s["contains_agree"], n, s.get("agree_interval")),
            f"{s['different_both_contain']}/{s['different']}", f"{s['pack_contains']}/{n}", f"{s['text_contains']}/{n}",
        ])
        note = f"{ARMS[s['arm']]}, {s['dtype']}: logprobs bit-identical in {s['logprobs_identical']} of {n}; {_positions(s['first_differences'])}"
        if s["logprob_gaps"]:
            gaps = s["logprob_gaps"]
            note += f"; identical answers' largest logprob difference: median {gaps[(len(gaps) - 1) // 2]:.2g}, max {gaps[-1]:.2g}"
        if s["pack_only"] or s["text_only"]:
            note += (f"; contains with the pack only / the text only: {s['pack_only']} / {s['text_only']} "
                     f"(exact McNemar p {mcnemar_exact(s['pack_only'], s['text_only']):.3f})")
        note += f"; mean pack {s['pack_tokens']:.0f} tokens"
        if "cache_identical" in s:
            note += (
                f"; against vLLM's own prefix cache: ids identical in {_count(s['cache_identical'], n, s['cache_interval'])}, "
                f"logprobs bit-identical in {s['cache_logprobs_identical']} of {n}"
            )
        if s["reasons"]:
            note += "; not applied: " + "; ".join(f"{count} x {reason!r}" for reason, count in sorted(s["reasons"].items()))
        notes.append(note)
    return markdown_table(headers, lines, left=3) + "\n\n" + "\n".join(notes)


def plot(records: Sequence[dict], path: Path) -> Path:
    """Two panels: identical answers and contains agreement per arm and dtype with Wilson intervals; and where the
    differing answers first differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [s for s in summarize(records) if s["applied"]]
    figure, (bars, positions) = plt.subplots(1, 2, figsize=(16, 5.4), gridspec_kw={"width_ratios": [1.7, 1]})
    labels = [f"{SHORT[s['arm']]}\n{s['dtype']} (n={s['applied']})" for s in summaries]
    measures = [("identical token ids", "identical_interval"), ("contains agrees (both or neither hold the gold answer)", "agree_interval")]
    if any("cache_interval" in s for s in summaries):
        measures.append(("vLLM-built or saved: ids = own prefix cache", "cache_interval"))
    width = 0.8 / len(measures)
    for index, (name, key) in enumerate(measures):
        xs = [i + (index - (len(measures) - 1) / 2) * width for i, s in enumerate(summaries) if key in s]
        points = [s[key].scaled(100) for s in summaries if key in s]
        errors = [[p.mean - p.low for p in points], [p.high - p.mean for p in points]]
        drawn = bars.bar(xs, [p.mean for p in points], width, yerr=errors, capsize=3, label=name)
        bars.bar_label(drawn, fmt="%.1f", fontsize=6, padding=2)
    bars.set_xticks(range(len(summaries)), labels, fontsize=7)
    bars.set_ylabel("% of questions (Wilson 95% interval)")
    bars.set_ylim(0, 112)
    bars.set_title("vLLM with the pack vs vLLM prefilling the text", fontsize=10)
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(measures), frameon=False)
    longest = max((r["max_tokens"] for r in records), default=32)
    differing = [
        (s["first_differences"], f"{label.split(' (n=')[0].replace(chr(10), ' ')} ({len(s['first_differences'])} differing)")
        for s, label in zip(summaries, labels)
        if s["first_differences"]
    ]
    if differing:  # side by side per bin of 2 positions
        positions.hist([d for d, _ in differing], bins=range(0, longest + 2, 2), label=[name for _, name in differing])
    positions.set_xlabel("first differing generated token (0 = the first; bins of 2)")
    positions.set_ylabel("questions")
    positions.set_title("Where the differing answers part", fontsize=10)
    if any(s["first_differences"] for s in summaries):
        positions.legend(fontsize=8)
    else:
        positions.text(0.5, 0.5, "no answer differs", ha="center", va="center", transform=positions.transAxes)
    model = records[0]["model"] if records else ""
    figure.suptitle(f"{model} on held-out ckc questions, greedy, {longest} tokens, vLLM CPU, block size {records[0]['block_size']}", fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def read_records(out: Path) -> list[dict]:
    """Every record of OUT/<arm>-<dtype>.jsonl (compressed or not), in name order."""
    return [record for path in record_files(out) for record in read_jsonl(path)]


def write_report(out: Path, figures: Path) -> str:
    records = read_records(out)
    text = table(records)
    (out / "table.md").write_text(text + "\n")
    if records:
        plot(records, figures / "eval_vllm.png")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (exported with packctl model export)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--limit", type=int, default=None, help="only the first N held-out questions")
    parser.add_argument("--engine-packs", type=int, default=0, help="arm vllm: packs built by vLLM for the first N held-out rows that fill a block (0: none)")
    parser.add_argument("--saved-packs", type=int, default=0, help="arm saved: packs vLLM saves while serving, for the first N held-out rows that fill a block (0: none)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_vllm", help="results directory")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures", help="where eval_vllm.png goes")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's KV cache block size")
    parser.add_argument("--prompt", choices=tuple(PROMPTS), default="short", help="what follows each question (evallib.PROMPTS)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the transformers builds")
    parser.add_argument("--report-only", action="store_true", help="redo the table and figure from OUT's records")
    parser.add_argument("--fresh", action="store_true", help="discard OUT's records instead of resuming them")
    args = parser.parse_args(argv)
    if args.report_only and not args.out.is_dir():
        parser.error(f"--report-only: no records directory {args.out}")
    if not args.report_only:
        rows = held_out_rows(args.limit)
        settings = {"model": args.model, "max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "prompt": args.prompt}
        plan = [("transformers", dtype, rows) for dtype in args.dtypes]
        if args.engine_packs > 0:
            engine_rows = block_filling_rows(args.model, rows, args.block_size, args.engine_packs)
            plan += [("vllm", dtype, engine_rows) for dtype in args.dtypes]
        if args.saved_packs > 0:
            saved_rows = block_filling_rows(args.model, rows, args.block_size, args.saved_packs)
            plan += [("saved", dtype, saved_rows) for dtype in args.dtypes]
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="eval-vllm-") as scratch:
            context = Context(args, Path(scratch))
            try:
                for arm, dtype, wanted in plan:
                    part = f"{arm}-{dtype}"
                    done = {r["id"] for r in resumed_records(args.out, part, settings, fresh=args.fresh)}
                    todo = [row for row in wanted if row.id not in done]
                    log(f"{part}: {len(todo)} of {len(wanted)} questions to ask")
                    if todo:
                        run = {"transformers": run_transformers_arm, "vllm": run_engine_arm, "saved": run_saved_arm}[arm]
                        run(context, dtype, todo, jsonl_appender(args.out / f"{part}.jsonl"))
            finally:
                context.engines.close()
        log(f"this run took {time.perf_counter() - started:.0f} s on {machine_description({})}; {source_description()}")
    print(write_report(args.out, args.figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
