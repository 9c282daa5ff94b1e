"""Exactness of packs per device and dtype (issue 36): how often a pack's greedy answer equals the text's.

A pack promises the answer of its text prefilled in the pack's own recorded passes (its header's
``prefill_chunks``), then the question, bit for bit; equality with the text prefilled in one pass is
usual on CPU in float32 but not promised, since other pass shapes run other floating-point kernels.
For every dtype this tool measures, over held-out ckc questions (tools/data/ckc_split.json), grouped into
packs of ``--per-pack`` paragraphs (one fact each, in file order) and asked with each pack's own rows'
questions, greedy, ``--max-new-tokens`` tokens:

- ``identical``: the pack's answer equals the facts as text prefilled in one pass (``Answerer`` with
  ``compare_rag``);
- ``chunked_identical``: it equals the text prefilled in the pack's recorded passes, then the question,
  through the same generation path (``AnswerResult.chunked_identical``; must be 1.0 everywhere);
- ``kv_bit_equal`` (per pack, a diagnosis): the pack fetched from the store onto the device equals, bit for bit in
  every layer, the text prefilled in its recorded passes there; where it holds and ``chunked_identical`` does not,
  the difference arises in generation (kernels chosen for the injected cache), not in the K/V delivered;
- ``repeat_identical``: the pack's answer asked once more (from the ready cache) equals the first: whether the
  device repeats itself; where it fails, a ``chunked_identical`` failure may be run-to-run nondeterminism;
- ``text_chunking_identical``: the baseline, no pack at all: the text answered after one prefill equals
  the text answered after a prefill of its facts in passes of 512 tokens: how sensitive plain prefill is
  to its own chunking on this device and dtype.

Outputs: one JSON line per question in OUT/<device>-<dtype>.json (rewritten by each run of that dtype,
written question by question, so a run cut short keeps what it finished), and a markdown table on stdout.
``--shard I/N`` asks packs I, I+N, ... only, into OUT/<device>-<dtype>.<I>of<N>.json, so that N processes share
a GPU's time (the table groups every file's records by model, device and dtype). Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_exactness [--model smollm2-135m] [--device cuda]
        [--dtypes bfloat16 float32] [--questions 80] [--quick]

``--quick`` asks 2 packs of 2 paragraphs 2 questions each with 8 new tokens (what the test runs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.answering.api import build_and_store  # noqa: E402
from packstore.format.header import PackHeader  # noqa: E402
from packstore.kv.build import layer_kv, prefill, prefill_boundaries  # noqa: E402
from packstore.kv.inject import Sampling, generate  # noqa: E402
from packstore.kv.models import DTYPES, LoadedModel, default_device, load_model  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, source_commit, source_description  # noqa: E402
from tools.lib.evallib import REPO, Row, data_path, frozen_split, jsonl_appender, load_rows, markdown_table, wilson_interval  # noqa: E402

MEASURES = ("identical", "chunked_identical", "text_chunking_identical", "kv_bit_equal", "repeat_identical")
log = logger("eval_exactness")


def pack_groups(rows: Sequence[Row], per_pack: int, questions: int) -> list[list[Row]]:
    """Consecutive rows in packs of ``per_pack`` (a last short group dropped), enough packs for ``questions``
    questions: each pack is asked its own rows' questions."""
    groups = [list(rows[start : start + per_pack]) for start in range(0, len(rows) - per_pack + 1, per_pack)]
    return groups[: -(-questions // per_pack)]


def text_chunking_identical(lm: LoadedModel, facts: Sequence[str], question: str, sampling: Sampling) -> bool:
    """Whether the text (facts and question) answers alike after one prefill and after its facts are prefilled in
    passes of 512 tokens (the question then in one more, as ``generate`` prefills what the cache lacks)."""
    rendering = render(lm.tokenizer, facts, question)
    one = generate(lm, rendering.token_ids, sampling)
    passes = prefill_boundaries(0, rendering.prefix_tokens)
    chunked = generate(lm, rendering.token_ids, sampling, prefill(lm, rendering.prefix_ids, boundaries=passes))
    return one.token_ids == chunked.token_ids


def kv_bit_equal(lm: LoadedModel, answerer: Answerer, header: PackHeader) -> bool:
    """Whether the pack, fetched onto the model's device as an answer fetches it, holds bit for bit the K/V of its
    text prefilled in its recorded passes on that device."""
    pack = answerer.reader.fetch(header.key, device=lm.device)
    reference = prefill(lm, header.token_ids, boundaries=header.prefill_chunks)
    for slot, layer in enumerate(reference.layers):
        key, value = layer_kv(layer)
        if not (torch.equal(key[0], pack.keys[slot]) and torch.equal(value[0], pack.values[slot])):
            return False
    return True


def evaluate(
    lm: LoadedModel, groups: Sequence[tuple[int, list[Row]]], sampling: Sampling, store: LmdbStore, keep: Callable[[dict], None], commit: str
) -> list[dict]:
    """One record per question (the measures, and the pack's size and recorded passes), each handed to ``keep`` as
    it is made; ``groups`` are (pack number, its rows)."""
    answerer = Answerer(lm, store)
    records: list[dict] = []
    for number, group in groups:
        facts = [row.context for row in group]
        stored, _ = build_and_store(store, lm, facts)
        bit_equal = kv_bit_equal(lm, answerer, stored.header)
        for row in group:
            result = answerer.ask(Question(row.question, refs=(stored.key,), compare_rag=True, sampling=sampling))
            again = answerer.ask(Question(row.question, refs=(stored.key,), sampling=sampling))
            records.append(
                {
                    "commit": commit,
                    "model": lm.name,
                    "device": lm.device.type,
                    "dtype": lm.dtype_name,
                    "pack": number,
                    "id": row.id,
                    "question": row.question,
                    "answer": result.answer,
                    "rag_answer": result.rag_answer,
                    "identical": result.identical,
                    "chunked_identical": result.chunked_identical,
                    "text_chunking_identical": text_chunking_identical(lm, facts, row.question, sampling),
                    "kv_bit_equal": bit_equal,
                    "repeat_identical": again.answer == result.answer,
                    "pack_tokens": stored.header.tokens,
                    "prefill_chunks": list(stored.header.prefill_chunks or ()),
                }
            )
            keep(records[-1])
        log(f"{lm.dtype_name}: pack {number + 1} ({stored.header.tokens} tokens) asked")
    return records


def summary_row(records: Sequence[dict]) -> list[str]:
    """A table row: model, device, dtype, questions, and each measure's rate as ``count/total (percent [Wilson 95 %
    interval])`` (n/a for a measure the records predate)."""
    first = records[0]

    def rate(measure: str) -> str:
        if not all(measure in r for r in records):
            return "n/a"
        count = sum(bool(r[measure]) for r in records)
        low, high = wilson_interval(count, len(records))
        return f"{count}/{len(records)} ({100 * count / len(records):.1f} % [{100 * low:.1f}, {100 * high:.1f}])"

    return [first["model"], first["device"], first["dtype"], str(len(records)), *(rate(m) for m in MEASURES)]


def table(runs: Sequence[Sequence[dict]]) -> str:
    """The markdown table: one line per model, device and dtype, from the question records of every run (shards of
    one run are grouped)."""
    grouped: dict[tuple[str, str, str], list[dict]] = {}
    for record in (record for records in runs for record in records):
        grouped.setdefault((record["model"], record["device"], record["dtype"]), []).append(record)
    rows = [summary_row(records) for records in grouped.values()]
    return markdown_table(["model", "device", "dtype", "questions", *MEASURES], rows, left=3) + "\n\nrates: count / questions (percent [Wilson 95 % interval])"


def shard(text: str) -> tuple[int, int]:
    """``I/N`` as (I, N), 0 <= I < N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"not a shard I/N with 0 <= I < N: {text!r}")
    return int(index), int(count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face directory")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--questions", type=int, default=80, help="held-out questions per dtype")
    parser.add_argument("--per-pack", type=int, default=8, help="paragraphs per pack")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--data", type=Path, default=None, help="ckc JSONL (default: $PACKSTORE_EVAL_DATA or tools/data/ckc_dev.jsonl)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_exactness", help="results directory")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--shard", type=shard, default=None, metavar="I/N", help="ask packs I, I+N, ... only (N processes share a GPU)")
    parser.add_argument("--rev", default=None, help="the commit measured (default: from git; a copy without .git says unknown)")
    parser.add_argument("--quick", action="store_true", help="2 packs of 2 paragraphs, 2 questions each, 8 new tokens")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    per_pack, questions, max_new_tokens = (2, 4, 8) if args.quick else (args.per_pack, args.questions, args.max_new_tokens)
    data = args.data or data_path()
    _, held_out = frozen_split(load_rows(data), data)
    numbered = list(enumerate(pack_groups(held_out, per_pack, questions)))
    index, count = args.shard or (0, 1)
    groups, suffix = numbered[index::count], "" if args.shard is None else f".{index}of{count}"
    commit = args.rev or source_commit()
    sampling = Sampling(max_new_tokens=max_new_tokens)
    device = args.device or str(default_device())
    runs = []
    for dtype in args.dtypes:
        started = time.perf_counter()
        lm = load_model(args.model, device=device, dtype=dtype, progress=False)
        with tempfile.TemporaryDirectory(prefix="eval-exactness-") as scratch, LmdbStore(Path(scratch) / "store") as store:
            path = args.out / f"{lm.device.type}-{dtype}{suffix}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a run's records are all of one commit
            records = evaluate(lm, groups, sampling, store, jsonl_appender(path), commit)
        runs.append(records)
        log(f"{dtype}: {len(records)} questions in {time.perf_counter() - started:.0f} s")
        del lm
    print(table(runs))
    print(f"\n{max_new_tokens} new tokens, packs of {per_pack} held-out ckc paragraphs; {machine_description({})}; {source_description()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
