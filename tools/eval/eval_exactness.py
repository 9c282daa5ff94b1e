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
- ``kv_bit_equal`` (per pack, a diagnosis): the pack the answers ran with (the answerer's ready pack on the device,
  ``kv_source`` "answer"; "fetched" where it was not kept) equals, bit for bit in every layer, the text prefilled in its
  recorded passes there; where it does not, ``kv_first_diff_layer`` is the first layer whose K or V differ
  (``kv_first_diff`` which: key, value or both) and ``kv_max_abs_diff`` the largest difference over all layers; where it
  holds and ``chunked_identical`` does not, the difference arises in generation (kernels chosen for the injected
  cache), not in the K/V delivered;
- ``repeat_identical``: the pack's answer asked once more (from the ready cache) equals the first: whether the
  device repeats itself; where it fails, a ``chunked_identical`` failure may be run-to-run nondeterminism;
- ``text_chunking_identical``: the baseline, no pack at all: the text answered after one prefill equals
  the text answered after a prefill of its facts in passes of 512 tokens: how sensitive plain prefill is
  to its own chunking on this device and dtype.

Each measure is taken per exactness variant (``--variants``, packstore.kv.exactness): ``default`` (torch as it comes),
``deterministic`` (``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, reduced-precision
reductions off), ``sdpa-math`` (one attention backend pinned, for the build and the answers alike; also
``sdpa-efficient``, ``sdpa-flash``, ``sdpa-cudnn``) or both (``deterministic+sdpa-math``): the pack is built, stored
and asked under the variant. Its cost: ``prefill_s``, the median of ``--timing-repeats`` prefills of each pack's tokens
in its recorded passes under the variant (synchronized on the device), against the default's (the table's cost column,
where the run has the default too). A variant that fails (an operation without a deterministic implementation, a
pinned backend that cannot run the mask) is recorded with its error and the next one runs.

``--shape 1b`` (or ``tiny``, ``8b``: tools/bench/bench_gpu.py's shapes) measures a Llama of that geometry with random
weights, made in float32 on the device into ``--models`` with ``--tokenizer``'s tokenizer and chat template, instead of
``--model``: random weights keep logits flat, a strict test of equal arithmetic rather than of answers.

Outputs: one JSON line per question in OUT/<device>-<dtype>.json (OUT/<device>-<dtype>-<variant>.json for another
variant than the default, ``+`` written ``_``; rewritten by each run of that dtype and variant, written question by
question, so a run cut short keeps what it finished), and a markdown table on stdout.
``--shard I/N`` asks packs I, I+N, ... only, into OUT/<device>-<dtype>.<I>of<N>.json, so that N processes share
a GPU's time (the table groups every file's records by model, device and dtype). Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_exactness [--model smollm2-135m | --shape 1b] [--device cuda]
        [--dtypes bfloat16 float32] [--variants default,deterministic,sdpa-math] [--questions 80] [--quick]

``--quick`` asks 2 packs of 2 paragraphs 2 questions each with 8 new tokens, timing 1 prefill (what the test runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.answering.api import build_and_store  # noqa: E402
from packstore.errors import InvalidInput  # noqa: E402
from packstore.format.header import PackHeader  # noqa: E402
from packstore.kv.build import layer_kv, prefill, prefill_boundaries  # noqa: E402
from packstore.kv.exactness import CUBLAS_WORKSPACE, Mode, exactness  # noqa: E402
from packstore.kv.inject import Sampling, generate  # noqa: E402
from packstore.kv.models import DTYPES, LoadedModel, default_device, load_model  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.packs.tensors import Pack  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, source_commit, source_description  # noqa: E402
from tools.lib.evallib import REPO, Row, data_path, frozen_split, jsonl_appender, load_rows, markdown_table, wilson_interval  # noqa: E402

MEASURES = ("identical", "chunked_identical", "text_chunking_identical", "kv_bit_equal", "repeat_identical")
SHAPES = ("tiny", "1b", "8b")  # tools/bench/bench_gpu.py's SHAPES (imported only when one is made)
TIMING_REPEATS = 3
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


@dataclass(frozen=True)
class KvComparison:
    """A pack's K/V against its text prefilled in its recorded passes: equal bit for bit, else the first layer whose K
    or V differ (``which``: "key", "value" or "key+value") and the largest absolute difference over every layer."""

    bit_equal: bool
    first_layer: int | None
    which: str | None
    max_abs_diff: float

    def fields(self) -> dict:
        return {"kv_bit_equal": self.bit_equal, "kv_first_diff_layer": self.first_layer, "kv_first_diff": self.which,
                "kv_max_abs_diff": self.max_abs_diff}


def compare_kv(pack: Pack, reference: DynamicCache) -> KvComparison:
    """``pack``'s K/V (on the reference's device) against ``reference``'s, layer by layer."""
    first, which, largest = None, None, 0.0
    for slot, layer in enumerate(reference.layers):
        key, value = layer_kv(layer)
        differ = []
        for name, ours, theirs in (("key", pack.keys[slot], key[0]), ("value", pack.values[slot], value[0])):
            ours = ours.to(theirs.device)
            if not torch.equal(ours, theirs):
                differ.append(name)
                largest = max(largest, (ours.float() - theirs.float()).abs().max().item())
        if differ and first is None:
            first, which = slot, "+".join(differ)
    return KvComparison(first is None, first, which, largest)


def used_pack(lm: LoadedModel, answerer: Answerer, key: str) -> tuple[Pack, str]:
    """The pack the answers with ``key`` ran with: the answerer's ready pack on the device ("answer"), or, where it was
    not kept (larger than the ready cache), the pack fetched onto the device as an answer fetches it ("fetched")."""
    ready = answerer.ready.peek(key)
    if ready is not None:
        return ready, "answer"
    return answerer.reader.fetch(key, device=lm.device), "fetched"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_prefills(lm: LoadedModel, header: PackHeader, repeats: int) -> tuple[DynamicCache, float]:
    """The pack's tokens prefilled in its recorded passes (the reference K/V), and the median seconds of ``repeats``
    more such prefills after it (the first warms the kernels up), each synchronized on the device."""
    reference = prefill(lm, header.token_ids, boundaries=header.prefill_chunks)
    seconds = []
    for _ in range(repeats):
        synchronize(lm.device)
        started = time.perf_counter()
        prefill(lm, header.token_ids, boundaries=header.prefill_chunks)
        synchronize(lm.device)
        seconds.append(time.perf_counter() - started)
    return reference, statistics.median(seconds)


def evaluate(
    lm: LoadedModel,
    groups: Sequence[tuple[int, list[Row]]],
    sampling: Sampling,
    store: LmdbStore,
    keep: Callable[[dict], None],
    commit: str,
    *,
    variant: str = "default",
    label: str | None = None,
    timing_repeats: int = TIMING_REPEATS,
) -> list[dict]:
    """One record per question (the measures, the pack's size, recorded passes and K/V comparison, and the prefill's
    time), each handed to ``keep`` as it is made; ``groups`` are (pack number, its rows). Runs under exactness mode
    ``variant`` from the build to the last answer; ``label`` names the model in the records (default ``lm.name``)."""
    answerer = Answerer(lm, store)
    records: list[dict] = []
    with exactness(variant):
        for number, group in groups:
            facts = [row.context for row in group]
            stored, _ = build_and_store(store, lm, facts)
            compared: dict | None = None
            for row in group:
                result = answerer.ask(Question(row.question, refs=(stored.key,), compare_rag=True, sampling=sampling))
                if compared is None:  # the pack this answer ran with, before anything else can evict it
                    used, source = used_pack(lm, answerer, stored.key)
                    reference, seconds = timed_prefills(lm, stored.header, timing_repeats)
                    compared = {**compare_kv(used, reference).fields(), "kv_source": source, "prefill_s": seconds}
                    del used, reference
                again = answerer.ask(Question(row.question, refs=(stored.key,), sampling=sampling))
                records.append(
                    {
                        "commit": commit,
                        "model": label or lm.name,
                        "device": lm.device.type,
                        "dtype": lm.dtype_name,
                        "variant": variant,
                        "pack": number,
                        "id": row.id,
                        "question": row.question,
                        "answer": result.answer,
                        "rag_answer": result.rag_answer,
                        "identical": result.identical,
                        "chunked_identical": result.chunked_identical,
                        "text_chunking_identical": text_chunking_identical(lm, facts, row.question, sampling),
                        **compared,
                        "repeat_identical": again.answer == result.answer,
                        "pack_tokens": stored.header.tokens,
                        "prefill_chunks": list(stored.header.prefill_chunks or ()),
                        "built_on": dict(stored.header.built_on or {}),
                        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                    }
                )
                keep(records[-1])
            log(f"{lm.dtype_name} {variant}: pack {number + 1} ({stored.header.tokens} tokens) asked")
    return records


def variant_of(record: dict) -> str:
    return record.get("variant", "default")  # records from before the variants ran the default


def summary_row(records: Sequence[dict], default_prefill: float | None = None) -> list[str]:
    """A table row: model, device, dtype, variant, questions, each measure's rate as ``count/total (percent [Wilson 95 %
    interval])`` (n/a for a measure the records predate), the first layers whose K/V differed (per pack, "-" where
    none did, n/a in records from before it was recorded), the median prefill time and its cost against ``default_prefill`` (the default variant's)."""
    first = records[0]

    def rate(measure: str) -> str:
        if not all(measure in r for r in records):
            return "n/a"
        count = sum(bool(r[measure]) for r in records)
        low, high = wilson_interval(count, len(records))
        return f"{count}/{len(records)} ({100 * count / len(records):.1f} % [{100 * low:.1f}, {100 * high:.1f}])"

    packs = {r["pack"]: r for r in records}.values()  # the K/V and prefill fields are per pack
    layers = sorted({r["kv_first_diff_layer"] for r in packs if r.get("kv_first_diff_layer") is not None})
    differ = "n/a" if not all("kv_first_diff_layer" in r for r in packs) else ", ".join(map(str, layers)) or "-"
    timed = [r["prefill_s"] for r in packs if "prefill_s" in r]
    prefill_s = statistics.median(timed) if timed else None
    cost = "n/a" if prefill_s is None or not default_prefill else f"{100 * (prefill_s / default_prefill - 1):+.1f} %"
    return [
        first["model"], first["device"], first["dtype"], variant_of(first), str(len(records)), *(rate(m) for m in MEASURES),
        differ, "n/a" if prefill_s is None else f"{1e3 * prefill_s:.1f}", cost,
    ]


def table(runs: Sequence[Sequence[dict]], failures: Sequence[dict] = ()) -> str:
    """The markdown table: one line per model, device, dtype and variant, from the question records of every run (shards
    of one run are grouped), and a line per variant that failed."""
    grouped: dict[tuple[str, str, str, str], list[dict]] = {}
    for record in (record for records in runs for record in records):
        grouped.setdefault((record["model"], record["device"], record["dtype"], variant_of(record)), []).append(record)
    rows = []
    for (model, device, dtype, _), records in grouped.items():
        default = grouped.get((model, device, dtype, "default"), [])
        default_packs = {r["pack"]: r for r in default}.values()
        timed = [r["prefill_s"] for r in default_packs if "prefill_s" in r]
        rows.append(summary_row(records, statistics.median(timed) if timed else None))
    headers = ["model", "device", "dtype", "variant", "questions", *MEASURES, "K/V differ from layer", "prefill ms", "cost"]
    text = markdown_table(headers, rows, left=4)
    text += "\n\nrates: count / questions (percent [Wilson 95 % interval]); K/V differ from layer: per pack whose K/V differed,"
    text += " the first layer; prefill ms: median per pack; cost: against the default variant's prefill"
    for failure in failures:
        text += f"\n{failure['model']} {failure['device']} {failure['dtype']} {failure['variant']}: failed: {failure['error']}"
    return text


def shard(text: str) -> tuple[int, int]:
    """``I/N`` as (I, N), 0 <= I < N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"not a shard I/N with 0 <= I < N: {text!r}")
    return int(index), int(count)


def variants(text: str) -> list[str]:
    """A comma-separated list of exactness modes (packstore.kv.exactness), each known, in the order given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    try:
        return [Mode.parse(name).name for name in names] if names else ["default"]
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def made_model(shape: str, tokenizer: str, models: Path, device: str) -> Path:
    """A Llama of ``shape`` with random weights (seeded: the same on every run), made in float32 on ``device`` into
    ``models`` with ``tokenizer``'s tokenizer and chat template (tools/bench/bench_gpu.py's make_model)."""
    from tools.bench.bench_gpu import load_tokenizer, make_model

    started = time.perf_counter()
    path = make_model(shape, load_tokenizer(tokenizer), "float32", torch.device(device), models / f"exactness-{shape}-float32")
    log(f"{shape} shape with random weights made in {time.perf_counter() - started:.1f} s: {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias or local Hugging Face directory")
    parser.add_argument("--shape", choices=SHAPES, default=None, help="a Llama geometry with random weights instead of --model")
    parser.add_argument("--tokenizer", default="smollm2-135m", help="--shape: a tokenizer with a chat template (a directory or alias)")
    parser.add_argument("--models", type=Path, default=None, help="--shape: where the model is made (default: a temporary directory)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--variants", type=variants, default=["default"], help="exactness modes, comma-separated (default: default)")
    parser.add_argument("--questions", type=int, default=80, help="held-out questions per dtype")
    parser.add_argument("--per-pack", type=int, default=8, help="paragraphs per pack")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--timing-repeats", type=int, default=TIMING_REPEATS, help="timed prefills per pack (after one untimed)")
    parser.add_argument("--data", type=Path, default=None, help="ckc JSONL (default: $PACKSTORE_EVAL_DATA or tools/data/ckc_dev.jsonl)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_exactness", help="results directory")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--shard", type=shard, default=None, metavar="I/N", help="ask packs I, I+N, ... only (N processes share a GPU)")
    parser.add_argument("--rev", default=None, help="the commit measured (default: from git; a copy without .git says unknown)")
    parser.add_argument("--quick", action="store_true", help="2 packs of 2 paragraphs, 2 questions each, 8 new tokens, 1 timed prefill")
    args = parser.parse_args(argv)
    if args.timing_repeats < 1:
        parser.error(f"--timing-repeats must be at least 1, got {args.timing_repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if any(Mode.parse(name).deterministic for name in args.variants):
        # Before the first CUDA matrix product: cuBLAS takes its workspace size when torch creates its handle, so every
        # variant of this run, the default too, runs with the one deterministic mode needs (torch's own default on sm_90).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    per_pack, questions, max_new_tokens = (2, 4, 8) if args.quick else (args.per_pack, args.questions, args.max_new_tokens)
    repeats = 1 if args.quick else args.timing_repeats
    data = args.data or data_path()
    _, held_out = frozen_split(load_rows(data), data)
    numbered = list(enumerate(pack_groups(held_out, per_pack, questions)))
    index, count = args.shard or (0, 1)
    groups, suffix = numbered[index::count], "" if args.shard is None else f".{index}of{count}"
    commit = args.rev or source_commit()
    sampling = Sampling(max_new_tokens=max_new_tokens)
    device = args.device or str(default_device())
    runs, failures = [], []
    with tempfile.TemporaryDirectory(prefix="eval-exactness-models-") as scratch_models:
        model, label = args.model, None
        if args.shape is not None:
            model, label = str(made_model(args.shape, args.tokenizer, args.models or Path(scratch_models), device)), f"random-{args.shape}"
        for dtype in args.dtypes:
            lm = load_model(model, device=device, dtype=dtype, progress=False)
            for variant in args.variants:
                started = time.perf_counter()
                named = "" if variant == "default" else "-" + variant.replace("+", "_")
                path = args.out / f"{lm.device.type}-{dtype}{named}{suffix}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)  # a run's records are all of one commit
                keep = jsonl_appender(path)
                with tempfile.TemporaryDirectory(prefix="eval-exactness-") as scratch, LmdbStore(Path(scratch) / "store") as store:
                    try:
                        records = evaluate(lm, groups, sampling, store, keep, commit, variant=variant, label=label, timing_repeats=repeats)
                    except RuntimeError as exc:  # e.g. an operation without a deterministic implementation on this device
                        failure = {"commit": commit, "model": label or lm.name, "device": lm.device.type, "dtype": dtype,
                                   "variant": variant, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                        keep(failure)
                        failures.append(failure)
                        log(f"{dtype} {variant}: failed: {failure['error']}")
                        continue
                runs.append(records)
                log(f"{dtype} {variant}: {len(records)} questions in {time.perf_counter() - started:.0f} s")
            del lm
    print(table(runs, failures))
    print(f"\n{max_new_tokens} new tokens, packs of {per_pack} held-out ckc paragraphs; {machine_description({})}; {source_description()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
