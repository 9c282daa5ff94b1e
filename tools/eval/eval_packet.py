"""KV Packet against full, no and selective recompute, on multi-document ckc questions, per model and seed.

For each seed an adapter is trained (``packstore.kv.packet.train_adapter``, model frozen) on examples
from the project's two fact generators (packstore.kv.synthetic and tools/data/second_facts.py), never on ckc:
2-5 paragraph-long documents of 6-10 invented facts and a question about one fact, the other documents
distractors (``--shape paragraphs``; ``--shape facts``: 2-4 documents of 2-5 facts, the first adapters'
data), with the held-out KL every ``--curve-every`` steps; the ablation part trains the first seed again
with other soft-token counts, learning rates and step counts. It is then
tested on the held-out ckc questions (all 288 unless ``--questions N``): each question's paragraph (the
gold) and 1-4 other paragraphs as distractors, 2-5 in all, in an order and with the gold at a position
seeded per question (``ARRANGEMENT_SEED``), every paragraph its own pack built alone. Every seed and every
method answers these same questions in these same arrangements: full, none and selective recompute do
not depend on the adapter and are asked once per question (records with seed null), KV Packet once per
question and seed; so the methods' differences are paired per question and the spread across seeds is
the adapters' own.
The test contexts differ from the training ones: real Wikipedia paragraphs of 100-250 tokens instead
of lists of invented facts, and distractors on unrelated topics.

Methods, all from the same independently built parts:
  full       full recompute: the prefill of every part's tokens in one rendering (exact, the reference);
  none       no recompute: the parts spliced with RoPE re-positioning (only framing tokens prefilled);
  selective  selective recompute (the CacheBlend idea, packstore.kv.blend): the splice, with the
             ``--share`` (15 %) of tokens whose values deviate most after two layers recomputed;
  packet     the splice with the adapter's soft tokens around each part (packstore.kv.packet).
Per method: contains and F1 of the greedy answer; against full recompute, teacher-forced on
full's answer tokens, the mean KL (nats) and the share of tokens whose top-1 agrees, the first token's
agreement and logit cosine, and whether the whole answer equals full's; and the FLOPs of composing (analytic: 2 x non-embedding parameters + 4 x layers x
attention width x context per computed position; the probe's share for selective). Time to first
token (composing from parts in memory, the question's prefill and the first token) is timed on a
subset (``--timing``), each method in turn per question, median of ``--repeats``.

Intervals: for a method asked once per question, Wilson for contains and a bootstrap over questions for
the rest; for KV Packet, whose answers come from several adapters, a two-level bootstrap resampling the
adapters (seeds) as well as the questions (``evallib.two_level_interval``), in its paired differences
too, each with its p-value, Holm-adjusted over every paired difference of the table (both models, every
comparison and measure). The adapters table sets each adapter's "gap closed" (1 - its KL / the plain
splice's) on its 16 synthetic held-out examples beside the same ratio on the ckc questions, with an
interval over the questions (and the adapters, for all of them together).

Outputs in ``--out``: training.jsonl (one line per adapter: time, memory, held-out KL), adapters/
(the adapter packs, as pack files), answers.jsonl, timing.jsonl (appended as made; a rerun resumes),
summary.json, table.md; PNGs in ``--figures``. From the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_packet [--models smollm2-135m gemma3-270m] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from packstore.format import PackHeader  # noqa: E402
from packstore.format.packfile import pack_file_parts, parse_pack_file  # noqa: E402
from packstore.kv.blend import DEFAULT_SHARE, PROBE_LAYERS, selective_recompute  # noqa: E402
from packstore.kv.build import build_pack, prefill  # noqa: E402
from packstore.kv.compose import splice  # noqa: E402
from packstore.kv.inject import cache_aligned_ids, cache_from_pack, forced_logits, greedy_with_logits  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS  # noqa: E402
from packstore.kv.packet import generated_examples, packet_compose, train_adapter  # noqa: E402
from packstore.kv.records import Example  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.packs.tensors import Pack, decode_pack, encode_pack  # noqa: E402
from tools.data.second_facts import second_facts  # noqa: E402
from tools.eval.eval_compose import answer_agreement  # noqa: E402
from tools.lib.benchlib import logger, machine_description, median, source_description  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    METRICS,
    REPO,
    Interval,
    Row,
    answer_scores,
    discard_records,
    format_p,
    frozen_split,
    gold_answers,
    grouped_bars,
    holm,
    jsonl_appender,
    load_rows,
    markdown_table,
    metric_interval,
    parts_type,
    read_jsonl,
    two_level_interval,
)

MODELS = ("smollm2-135m", "gemma3-270m")
SEEDLESS = ("full", "none", "selective")  # do not depend on the adapter: asked once per question, seed None
METHODS = (*SEEDLESS, "packet")
ARRANGEMENT_SEED = 0  # the distractors and gold position of each question, the same for every adapter seed
COMPARISONS = (("packet", "none"), ("packet", "full"), ("selective", "packet"))  # paired differences, first - second
LABELS = {"full": "full recompute", "none": "no recompute (RoPE)", "selective": "selective recompute", "packet": "KV Packet"}
PARTS = ("train", "answers", "timing", "ablation")
log = logger("eval_packet")


# ---- data ----


SHAPES = {  # --shape: (documents, facts per document) ranges of the training examples
    "facts": ((2, 4), (2, 5)),  # short invented facts: the first adapters' data
    "paragraphs": ((2, 5), (6, 10)),  # paragraph-long documents, 2-5 of them, as the test contexts are (issue 39)
}


def training_examples(count: int, seed: int, shape: str = "paragraphs") -> list[Example]:
    """``count`` examples, half from each of the project's fact generators (never ckc), shuffled by ``seed``: each a
    question about one fact of one of its documents, the other documents distractors, in the ``SHAPES`` given."""
    documents_range, facts_range = SHAPES[shape]
    first = generated_examples(count - count // 2, seed=seed, documents=documents_range, facts=facts_range)
    rng = random.Random(f"second:{seed}:{shape}")
    cases = second_facts(count * documents_range[1] * facts_range[1], seed=seed)
    second, used = [], 0
    for _ in range(count // 2):
        documents = []
        for _ in range(rng.randint(*documents_range)):
            size = rng.randint(*facts_range)
            documents.append(cases[used : used + size])
            used += size
        asked = rng.choice(rng.choice(documents))
        second.append(Example(tuple(tuple(case.fact for case in doc) for doc in documents), asked.question))
    examples = first + second
    random.Random(seed).shuffle(examples)
    return examples


def questions(rows: Sequence[Row], count: int | None, pool: Sequence[Row]) -> list[tuple[Row, list[Row]]]:
    """The first ``count`` held-out questions (all of them when None), each with its 2-5 paragraphs: the gold at a
    seeded position among seeded distractors. Every adapter seed and every method is asked these same questions in
    these same arrangements, so their differences are paired and the spread across seeds is the adapters' alone."""
    _, held_out = frozen_split(rows)
    arranged = []
    for row in held_out[:count]:
        rng = random.Random(f"{ARRANGEMENT_SEED}:{row.id}")
        others = [other for other in pool if other.context != row.context]
        k = rng.randint(2, 5)
        parts = rng.sample(others, k - 1)
        parts.insert(rng.randrange(k), row)
        arranged.append((row, parts))
    return arranged


# ---- costs ----


def flops_per_position(lm: LoadedModel, context: int, layers: int | None = None) -> float:
    """Forward FLOPs of one position at ``context`` (itself included) through ``layers`` layers (default all)."""
    config = lm.model.config.get_text_config()
    total = config.num_hidden_layers
    embedding = lm.model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in lm.model.parameters()) - embedding * (1 if config.tie_word_embeddings else 2)
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    used = total if layers is None else layers
    return (2 * body * used / total) + 4 * used * width * context


def composing_flops(lm: LoadedModel, computed: Sequence[int], probed: int = 0) -> float:
    """FLOPs of composing: ``computed`` positions through every layer (each at its own context), plus a probe
    of ``probed`` positions through the first PROBE_LAYERS (selective)."""
    total = sum(flops_per_position(lm, p + 1) for p in computed)
    total += sum(flops_per_position(lm, p + 1, PROBE_LAYERS) for p in range(probed))
    return total


# ---- answering ----


@dataclass(frozen=True)
class Composed:
    """One method's composed context: a function making a fresh cache of it (generation extends the cache it is
    given), the pack header whose soft tokens the cache holds (None without), the positions computed through every
    layer, and the positions probed through the first layers."""

    fresh: Callable[[], DynamicCache]
    header: PackHeader | None
    computed: list[int]
    probed: int


def compositions(lm: LoadedModel, parts: Sequence[Pack], methods: Sequence[str], adapter: Pack | None, share: float) -> dict[str, Composed]:
    """The composed context of each of ``methods`` (``packet`` needs the ``adapter``)."""
    with torch.inference_mode():
        rope = splice(lm, parts, "rope")
    token_ids = list(rope.pack.header.token_ids)
    made: dict[str, Composed] = {}
    for method in methods:
        if method == "full":
            full = prefill(lm, token_ids)
            made[method] = Composed(lambda full=full: copy.deepcopy(full), None, list(range(len(token_ids))), 0)
        elif method == "none":
            made[method] = Composed(lambda: cache_from_pack(rope.pack, lm.device), None, list(rope.computed_positions), 0)
        elif method == "selective":
            blend = selective_recompute(lm, rope.pack, share=share)
            computed = sorted(set(rope.computed_positions) | set(blend.recomputed))
            made[method] = Composed(lambda blend=blend: copy.deepcopy(blend.cache), None, computed, len(token_ids))
        else:
            if adapter is None:
                raise ValueError("the packet method needs an adapter")
            with torch.inference_mode():
                packet = packet_compose(lm, parts, adapter)
            made[method] = Composed(lambda packet=packet: cache_from_pack(packet.pack, lm.device), packet.pack.header, list(packet.computed_positions), 0)
    return made


def evaluate_question(
    lm: LoadedModel, row: Row, arranged: Sequence[Row], methods: Sequence[str], adapter: Pack | None, share: float, max_new_tokens: int
) -> dict:
    """One record: each of ``methods``' greedy answer and scores, and its agreement with full recompute (the reference,
    computed in every record): the distributions over full's answer tokens (teacher-forced, ``answer_agreement``),
    the whole answer, and the cost of composing."""
    with torch.inference_mode():
        parts = [build_pack(lm, [paragraph.context]) for paragraph in arranged]
    rendering = render(lm.tokenizer, [p.context for p in arranged], row.question)
    record = {"id": row.id, "k": len(arranged), "gold": next(i for i, p in enumerate(arranged) if p.id == row.id), "tokens": rendering.prefix_tokens}
    made = compositions(lm, parts, ["full", *(m for m in methods if m != "full")], adapter, share)
    reference_ids: list[int] = []
    reference_logits = None
    for method, composed in made.items():
        ids = cache_aligned_ids(composed.header, rendering.token_ids, lm.stop_token_ids[0]) if composed.header is not None else rendering.token_ids
        answer_ids, _ = greedy_with_logits(lm, ids, max_new_tokens, composed.fresh())
        if method == "full":
            reference_ids = answer_ids
        logits = forced_logits(lm, ids, reference_ids, composed.fresh())
        reference_logits = logits if reference_logits is None else reference_logits
        if method not in methods:
            continue
        answer = lm.tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        record[method] = {
            "answer": answer,
            **answer_scores(answer, row.answers),
            **answer_agreement(logits, reference_logits),
            "same_answer": answer_ids == reference_ids,
            "computed": len(composed.computed),
            "probed": composed.probed,
            "flops": composing_flops(lm, composed.computed, composed.probed),
        }
    return record


def time_question(lm: LoadedModel, row: Row, arranged: Sequence[Row], adapter: Pack, share: float, repeats: int) -> dict:
    """Seconds from parts in memory to the first answer token, per method (median of ``repeats``)."""
    with torch.inference_mode():
        parts = [build_pack(lm, [paragraph.context]) for paragraph in arranged]
    rendering = render(lm.tokenizer, [p.context for p in arranged], row.question)

    def first_token(method: str) -> None:
        with torch.inference_mode():
            if method == "full":
                cache, header = prefill(lm, rendering.prefix_ids), None
            elif method == "selective":
                cache, header = selective_recompute(lm, splice(lm, parts, "rope").pack, share=share).cache, None
            else:
                composed = (splice(lm, parts, "rope") if method == "none" else packet_compose(lm, parts, adapter)).pack
                cache, header = cache_from_pack(composed, lm.device), composed.header
            ids = cache_aligned_ids(header, rendering.token_ids, lm.stop_token_ids[0]) if header is not None else rendering.token_ids
            greedy_with_logits(lm, ids, 1, cache)

    seconds: dict[str, list[float]] = {method: [] for method in METHODS}
    for _ in range(repeats):
        for method in METHODS:
            start = time.perf_counter()
            first_token(method)
            seconds[method].append(time.perf_counter() - start)
    return {"id": row.id, "k": len(arranged), "tokens": rendering.prefix_tokens} | {m: median(v) for m, v in seconds.items()}


# ---- adapters ----


def adapter_path(
    out: Path, model: str, seed: int, tokens: int | None = None, learning_rate: float | None = None, steps: int | None = None
) -> Path:
    """Where an adapter is kept: one per model and seed, and per soft-token count (``tokens``), learning rate
    (``learning_rate``) or step count (``steps``) for the ablation's."""
    tail = ("" if tokens is None else f"-t{tokens}") + ("" if learning_rate is None else f"-lr{learning_rate:g}")
    tail += "" if steps is None else f"-s{steps}"
    return out / "adapters" / f"{Path(model).name}-seed{seed}{tail}.pack"


def save_adapter(pack: Pack, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(pack_file_parts(encode_pack(pack))))


def load_adapter(path: Path) -> Pack:
    return decode_pack(parse_pack_file(path.read_bytes()))


# ---- records, summaries, report ----


def _scored(entry: dict, answers: Sequence[str]) -> dict:
    """A method's record entry with every metric recomputed from its answer (records before issue 39 name the
    first-token agreement ``same_first``)."""
    scored = {"same_first_token": entry.get("same_first")} | entry | answer_scores(entry["answer"], answers)
    scored.pop("same_first", None)
    return scored


AGREEMENT = ("answer_kl", "answer_top1")  # with full recompute, over its answer tokens (records from issue 39 on)
AVERAGED = (*METRICS, *AGREEMENT, "logit_cosine", "same_first_token", "same_answer", "computed", "flops")
RESAMPLES = 10000  # two-level bootstrap draws: p-values down to 2e-4, small enough for Holm over a table's comparisons


def _value(by_seed: dict, method: str, seed, question: str, key: str) -> float | None:
    """``method``'s ``key`` for ``question`` as adapter ``seed`` saw it: a seedless method's own record (seed None),
    or, in the first run where each seed asked its own questions with every method, the record of that seed."""
    entries = by_seed[method].get(seed if seed in by_seed[method] else None, {})
    entry = entries.get(question)
    return None if entry is None else entry.get(key)


def gap_closed(packet_kl: dict, splice_kl: dict, *, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """1 - (KV Packet's mean KL to full recompute) / (the plain splice's), over the same questions, with a 95 %
    two-level bootstrap interval: adapters (``packet_kl``'s seeds) and questions resampled (one adapter: questions
    only), the splice's mean over the same drawn questions. Negative: the adapters widen the splice's gap."""
    seeds, questions = list(packet_kl), list(splice_kl)
    trained = np.array([[packet_kl[s][q] for q in questions] for s in seeds])
    plain = np.array([splice_kl[q] for q in questions])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
    drawn = rng.integers(0, len(questions), size=(resamples, len(questions)))
    per_seed = np.stack([row[drawn].mean(axis=1) for row in trained])
    gaps = 1 - per_seed[picks, np.arange(resamples)[:, None]].mean(axis=1) / plain[drawn].mean(axis=1)
    low, high = np.percentile(gaps, [2.5, 97.5])
    return Interval(float(1 - trained.mean() / plain.mean()), float(low), float(high))


def summarize(answers: Sequence[dict], timing: Sequence[dict], training: Sequence[dict]) -> dict:
    """Per model and method, over the questions it was asked: ``METRICS`` recomputed from the answers (a question's
    score is its mean over the adapter seeds that asked it), per-seed means, agreement with full recompute and cost,
    with intervals (module docstring); the paired differences of ``COMPARISONS`` on the questions both methods were
    asked, their p-values Holm-adjusted over the whole table (``holm``: comparison -> measure -> adjusted p); each
    adapter's gap closed on ckc against its synthetic one (``adapters``); median TTFT; the training records."""
    summary: dict = {}
    golds = gold_answers()
    for model in dict.fromkeys(r["model"] for r in [*answers, *training]):  # an adapter trained before any answer counts
        by_seed: dict[str, dict] = {}  # method -> seed (None for a seedless method) -> question -> scored entry
        for record in (r for r in answers if r["model"] == model):
            for method in METHODS:
                if method in record:
                    entry = _scored(record[method], golds[record["id"]])
                    by_seed.setdefault(method, {}).setdefault(record.get("seed"), {})[record["id"]] = entry
        entry: dict = {"methods": {}, "paired": {}, "adapters": []}
        for method, seeds in by_seed.items():
            rows = [e for questions_ in seeds.values() for e in questions_.values()]
            measured = {key for e in rows for key in AVERAGED if e.get(key) is not None}
            if method in SEEDLESS:  # asked once per question (the first run's seeds only split the questions)
                intervals = {key: metric_interval(key, [e[key] for e in rows]) for key in (*METRICS, *AGREEMENT) if key in measured}
            else:
                intervals = {
                    key: two_level_interval({s: {q: e[key] for q, e in qs.items()} for s, qs in seeds.items()}, resamples=RESAMPLES)
                    for key in (*METRICS, *AGREEMENT) if key in measured
                }
            entry["methods"][method] = {
                "questions": len({q for qs in seeds.values() for q in qs}),
                "seeds": sorted(seed for seed in seeds if seed is not None),
                "interval": "Wilson / bootstrap over questions" if method in SEEDLESS else "two-level bootstrap over adapters and questions",
                **intervals,
                **{f"{metric}_by_seed": [float(np.mean([e[metric] for e in qs.values()])) for qs in seeds.values()] for metric in METRICS},
                **{key: float(np.mean([e[key] for e in rows])) for key in ("logit_cosine", "same_first_token", "same_answer", "computed")},
                "gflops": float(np.mean([e["flops"] for e in rows])) / 1e9,
            }
        for first, second in COMPARISONS:
            if first not in by_seed or second not in by_seed:
                continue
            trained = "packet" if "packet" in (first, second) else None
            seeds = list(by_seed[trained]) if trained else [None]
            differences: dict[str, dict] = {}
            for metric in (*METRICS, *AGREEMENT):
                by = {}
                for seed in seeds:
                    questions_ = by_seed[trained or first][seed] if trained else by_seed[first][None]
                    values = {q: (_value(by_seed, first, seed, q, metric), _value(by_seed, second, seed, q, metric)) for q in questions_}
                    by[seed] = {q: a - b for q, (a, b) in values.items() if a is not None and b is not None}
                if all(by.values()) and all(len(v) == len(by_seed[trained or first][s]) for s, v in by.items()):  # measured on every question
                    differences[metric] = two_level_interval(by, resamples=RESAMPLES)
            asked = {q for qs in by_seed[trained or first].values() for q in qs}
            entry["paired"][f"{first} - {second}"] = {"questions": len(asked)} | differences
        if "packet" in by_seed and "none" in by_seed and None in by_seed["none"]:  # the crossed design: every adapter, the same questions
            splice = {q: e.get("answer_kl") for q, e in by_seed["none"][None].items()}
            packet = {s: {q: e.get("answer_kl") for q, e in qs.items()} for s, qs in by_seed["packet"].items()}
            measured = all(v is not None for v in splice.values()) and all(v is not None for qs in packet.values() for v in qs.values())
            if measured and all(set(qs) == set(splice) for qs in packet.values()):
                contains = {seed: float(np.mean([e["contains"] for e in qs.values()])) for seed, qs in by_seed["packet"].items()}
                for seed, kls in packet.items():
                    trained_on = next((t for t in training if t["model"] == model and t["seed"] == seed and not t.get("ablation")), None)
                    entry["adapters"].append({"seed": seed, "training": trained_on, "questions": len(kls), "ckc_gap_closed": gap_closed({seed: kls}, splice),
                                              "contains": contains[seed]})
                entry["adapters"].append({"seed": "all", "training": None, "questions": len(splice), "ckc_gap_closed": gap_closed(packet, splice),
                                          "contains": float(np.mean(list(contains.values())))})
        asked_tokens = [r["tokens"] for r in answers if r["model"] == model]
        entry["tokens"] = float(np.mean(asked_tokens)) if asked_tokens else None
        timed = [r for r in timing if r["model"] == model]
        if timed:
            entry["ttft"] = {m: median([r[m] for r in timed]) for m in METHODS}
            entry["ttft_questions"] = len(timed)
        entry["training"] = [t for t in training if t["model"] == model]
        summary[model] = entry
    family = [(model, comparison, metric) for model, e in summary.items() for comparison, d in e["paired"].items() for metric in d if metric != "questions"]
    adjusted = holm([summary[m]["paired"][c][k].p for m, c, k in family])
    for (model, comparison, metric), p in zip(family, adjusted):
        summary[model]["paired"][comparison].setdefault("holm", {})[metric] = p
    return summary


def _pm(values: Sequence[float]) -> str:
    """Per-seed means as ``mean ± sample sd`` in percent; one seed (a seedless method) has no spread."""
    if len(values) < 2:
        return f"{100 * np.mean(values):.1f} (one run)"
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values, ddof=1):.1f}"


def _points(interval: Interval) -> str:
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"


def _tested(cell: str, interval: Interval, adjusted: float | None) -> str:
    """A paired difference's cell with its p-value and the Holm-adjusted one."""
    if interval.p is None or adjusted is None:
        return cell
    return f"{cell}, p {format_p(interval.p)} (Holm {format_p(adjusted)})"


TABLES = ("quality", "paired", "cost", "training", "adapters", "curve")


def table_texts(summary: dict) -> dict[str, str]:
    """The tables of ``TABLES`` by name, each with any note lines under it: quality, paired differences, cost, adapter
    training, the adapters' gap closed on synthetic examples and on ckc, and their learning curves ("" where the
    records hold nothing for one: answer-token KL, curves)."""
    rows, paired, costs, trained, adapters, curves = [], [], [], [], [], []
    for model, entry in summary.items():
        full = entry["methods"].get("full")
        for method, m in entry["methods"].items():
            kl = m.get("answer_kl")
            rows.append(
                [model, LABELS[method], str(m["questions"]), str(len(m["seeds"]) or 1), m["contains"].percent(), _pm(m["contains_by_seed"]),
                 m["f1"].percent(), _pm(m["f1_by_seed"]), f"{kl.mean:.4f} [{kl.low:.4f}, {kl.high:.4f}]" if kl else "-",
                 m["answer_top1"].percent() if "answer_top1" in m else "-", f"{100 * m['same_first_token']:.1f}",
                 f"{100 * m['same_answer']:.1f}", f"{m['logit_cosine']:.4f}"]
            )
            ttft = entry.get("ttft", {})
            costs.append(
                [model, LABELS[method], f"{m['computed']:.1f}", f"{m['gflops']:.2f}", f"{m['gflops'] / full['gflops']:.3f}",
                 f"{1000 * ttft[method]:.0f}" if method in ttft else "-", f"{ttft[method] / ttft['full']:.2f}" if method in ttft else "-"]
            )
        for comparison, differences in entry["paired"].items():
            first, second = comparison.split(" - ")
            holms = differences.get("holm", {})
            cells = [_tested(_points(differences[m]), differences[m], holms.get(m)) if m in differences else "-" for m in METRICS]
            kl, top1 = differences.get("answer_kl"), differences.get("answer_top1")
            cells.append(_tested(f"{kl.mean:+.4f} [{kl.low:+.4f}, {kl.high:+.4f}]", kl, holms.get("answer_kl")) if kl else "-")
            cells.append(_tested(_points(top1), top1, holms.get("answer_top1")) if top1 else "-")
            paired.append([model, f"{LABELS[first]} - {LABELS[second]}", str(differences["questions"]), *cells])
        for t in entry["training"]:
            closed = 1 - t["holdout_kl_after"] / t["holdout_kl_no_adapter"]  # full recompute is the teacher: its KL is 0
            trained.append(
                [model, str(t["seed"]), str(t.get("tokens", "-")), f"{t['learning_rate']:g}" if "learning_rate" in t else "-",
                 t.get("shape", "-") + (" (ablation)" if t.get("ablation") else ""),
                 str(t["steps"]), str(t["examples"]), f"{t['train_seconds'] / 60:.1f}", f"{t['peak_rss_mb']:.0f}",
                 f"{t['holdout_kl_no_adapter']:.4f}", f"{t['holdout_kl_before']:.4f}", f"{t['holdout_kl_after']:.4f}",
                 f"{t['train_kl_last_50']:.4f}" if "train_kl_last_50" in t else "-", f"{closed:+.0%}", "yes" if closed >= 0.5 else "no"]
            )
        for t in entry["training"]:
            if t.get("curve"):
                shares = {step: kl / t["holdout_kl_no_adapter"] for step, kl in t["curve"]}
                curves.append((model, t, shares))
        for a in entry["adapters"]:
            t, gap = a["training"], a["ckc_gap_closed"]
            synthetic = ["-", "-", "-", "-"]
            if t is not None:
                closed = 1 - t["holdout_kl_after"] / t["holdout_kl_no_adapter"]
                synthetic = [str(t.get("holdout_examples", "-")), f"{t['holdout_kl_no_adapter']:.4f}", f"{t['holdout_kl_after']:.4f}", f"{closed:+.0%}"]
            adapters.append([model, "all (mean)" if a["seed"] == "all" else str(a["seed"]), *synthetic, str(a["questions"]),
                             f"{gap.mean:+.0%} [{gap.low:+.0%}, {gap.high:+.0%}]", f"{100 * a['contains']:.1f}"])
    quality = markdown_table(
        ["model", "method", "questions", "seeds", "contains % [95% CI]", "contains by seed (mean ± sd)", "F1 % [95% CI]",
         "F1 by seed", "KL to full, answer tokens (nats)",
         "top-1 agrees with full, answer tokens %", "same first token %", "same answer as full %", "first-token logit cosine"],
        rows, left=2,
    )
    if rows:
        quality += ("\n\nintervals: full, no and selective recompute (asked once per question): Wilson for contains, a bootstrap over "
                    "questions for the rest; KV Packet (every adapter seed): a two-level bootstrap resampling the adapters and the questions")
    differences = markdown_table(
        ["model", "paired difference (same questions)", "questions", *(f"{name} points [95% CI]" for name in METRICS.values()),
         "KL to full, answer tokens (nats) [95% CI]", "top-1 agrees with full, points [95% CI]"], paired, left=2,
    )
    if paired:
        count = sum(len(d.get("holm", {})) for e in summary.values() for d in e["paired"].values())
        differences += (f"\n\nKV Packet's differences resample the adapters and the questions (two-level bootstrap); p: two-sided, from the same "
                        f"bootstrap; Holm: adjusted over the family of all {count} paired differences in this table (both models, every "
                        "comparison and measure)")
    cost = markdown_table(["model", "method", "positions computed", "GFLOPs to compose", "vs full", "TTFT ms (median)", "vs full"], costs, left=2)
    training = markdown_table(
        ["model", "seed", "soft tokens a side", "learning rate", "training data", "steps", "examples", "minutes", "peak RSS MB",
         "held-out KL: RoPE splice, no adapter", "soft tokens at init", "trained", "training KL, last 50 steps", "gap to full recompute closed",
         "half closed"],
        trained, left=1,
    )
    texts = {"quality": quality, "paired": differences, "cost": cost, "training": training, "adapters": "", "curve": ""}
    if adapters:
        texts["adapters"] = (
            markdown_table(
                ["model", "adapter (seed)", "synthetic held-out examples", "their KL: RoPE splice", "trained", "gap closed (synthetic)",
                 "ckc questions", "gap closed on ckc [95% CI]", "contains on ckc %"],
                adapters, left=2,
            )
            + "\n\ngap closed: 1 - trained KL / plain splice KL, to full recompute (KL 0) over its answer tokens; synthetic: the adapter's own "
            "held-out examples of its training distribution (each seed draws its own; per-example KLs not recorded, so no interval); ckc: "
            "the held-out questions every adapter answered, interval by bootstrap over the questions (all: over the adapters too)"
        )
    if curves:
        steps = sorted({step for _, _, shares in curves for step in shares})
        texts["curve"] = markdown_table(
            ["model", "seed", "soft tokens a side", "learning rate", "steps", *(f"step {step}" for step in steps)],
            [[model, str(t["seed"]), str(t.get("tokens", "-")), f"{t['learning_rate']:g}" if "learning_rate" in t else "-",
              str(t["steps"]) + (" (ablation)" if t.get("ablation") else ""), *(f"{shares[step]:.2f}" if step in shares else "-" for step in steps)]
             for model, t, shares in curves],
            left=1,
        ) + "\n\neach adapter's held-out KL to full recompute during training, as a share of its own held-out examples' plain-splice KL (1: no better than the splice; 0: full recompute; 0.5: half the gap closed)"
    return texts


def tables(summary: dict) -> str:
    """The tables of ``table_texts`` that hold something, blank-line separated, in ``TABLES`` order."""
    return "\n\n".join(text for text in table_texts(summary).values() if text)


def plot(summary: dict, figures: Path) -> None:
    summary = {model: entry for model, entry in summary.items() if "full" in entry["methods"]}  # models with answers
    panels_quality = {
        model: {
            "F1 %": {LABELS[m]: v["f1"].scaled(100) for m, v in entry["methods"].items()},
            "contains %": {LABELS[m]: v["contains"].scaled(100) for m, v in entry["methods"].items()},
        }
        for model, entry in summary.items()
    }
    if not panels_quality:
        return
    grouped_bars(figures / "eval_packet_quality.png", panels_quality, title="Multi-document ckc questions (2-5 paragraphs), by method (95 % bootstrap intervals)", ylabel="percent")
    panels_cost = {
        model: {
            "GFLOPs to compose (relative to full)": {LABELS[m]: v["gflops"] / entry["methods"]["full"]["gflops"] for m, v in entry["methods"].items()},
            **(
                {"time to first token (relative to full)": {LABELS[m]: entry["ttft"][m] / entry["ttft"]["full"] for m in METHODS}}
                if "ttft" in entry
                else {}
            ),
        }
        for model, entry in summary.items()
    }
    grouped_bars(figures / "eval_packet_cost.png", panels_cost, title="Cost of composing, relative to full recompute", ylabel="ratio to full recompute")


def plot_curves(training: Sequence[dict], figures: Path) -> None:
    """Held-out KL against training steps, one line per adapter, each as a share of its own held-out examples'
    plain-splice KL (no adapter: 1; full recompute: 0; issue 39's target: 0.5); written only when some training
    record has a curve."""
    curved = [t for t in training if t.get("curve")]
    if not curved:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(t["model"] for t in curved))
    figure, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for axis, model in zip(axes[0], models):
        mine = [t for t in curved if t["model"] == model]
        for t in mine:
            steps, kls = zip(*([(0, t["holdout_kl_before"])] + [tuple(point) for point in t["curve"]]))
            rate = f", lr {t['learning_rate']:g}" if "learning_rate" in t else ""
            shares = [kl / t["holdout_kl_no_adapter"] for kl in kls]
            ablation = f", {t['steps']} steps (ablation)" if t.get("ablation") else ""
            axis.plot(steps, shares, marker=".", label=f"seed {t['seed']}, {t.get('tokens', '?')} tokens{rate}{ablation}")
        axis.axhline(1.0, color="grey", linestyle="--", label="RoPE splice, no adapter")
        axis.axhline(0.5, color="grey", linestyle=":", label="half the gap to full recompute")
        axis.set_title(f"{Path(model).name}: held-out KL to full recompute while training")
        axis.set_xlabel("training step")
        axis.set_ylabel("held-out KL / the plain splice's (0 = full recompute)")
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figures.mkdir(parents=True, exist_ok=True)
    figure.savefig(figures / "eval_packet_curve.png", dpi=110)
    plt.close(figure)


def write_report(out: Path, figures: Path, about: dict) -> str:
    summary = summarize(read_jsonl(out / "answers.jsonl"), read_jsonl(out / "timing.jsonl"), read_jsonl(out / "training.jsonl"))
    text = tables(summary)
    encode = lambda value: value.__dict__ if hasattr(value, "__dict__") else str(value)  # noqa: E731
    (out / "summary.json").write_text(json.dumps(about | {"models": summary}, indent=2, default=encode) + "\n")
    (out / "table.md").write_text(text + "\n")
    plot(summary, figures)
    plot_curves(read_jsonl(out / "training.jsonl"), figures)
    return text


# ---- command line ----


def train_and_keep(
    lm: LoadedModel, args, seed: int, tokens: int, path: Path, *, ablation: bool = False, learning_rate: float | None = None,
    steps: int | None = None,
) -> None:
    """Train one adapter on ``--shape`` examples (at ``learning_rate``, else ``--learning-rate``, for ``steps``, else
    ``--steps``), keep it at ``path`` and append its training record (time, memory, held-out KL before and after, the
    held-out KL every ``--curve-every`` steps) to training.jsonl."""
    curve: list[list[float]] = []
    learning_rate = args.learning_rate if learning_rate is None else learning_rate
    steps = args.steps if steps is None else steps
    adapter = train_adapter(
        lm, training_examples(args.examples, seed, args.shape), source=f"packstore.kv.synthetic + tools/data/second_facts.py, {args.shape}",
        tokens=tokens, steps=steps, learning_rate=learning_rate, seed=seed,
        progress=lambda step, loss: log(f"{lm.name} seed {seed} t{tokens} step {step}: KL {loss:.4f}") if step % 25 == 0 else None,
        checkpoints=range(args.curve_every, steps + 1, args.curve_every) if args.curve_every else (),
        on_checkpoint=lambda step, kl: curve.append([step, round(kl, 5)]),
    )
    save_adapter(adapter, path)
    record = {"model": lm.name, "seed": seed, "tokens": tokens, "learning_rate": learning_rate, "steps": steps, "examples": args.examples,
              "shape": args.shape}
    jsonl_appender(args.out / "training.jsonl")(record | {"ablation": ablation, "curve": curve, **adapter.header.metrics})
    log(f"{lm.name} seed {seed} t{tokens}: adapter trained, {adapter.header.metrics}")


def ask(lm: LoadedModel, asked: Sequence[tuple[Row, list[Row]]], methods: Sequence[str], seed: int | None, adapter: Pack | None, args) -> None:
    """Append one record per question not yet in answers.jsonl for this model and ``seed`` (None: the seedless methods)."""
    done = {r["id"] for r in read_jsonl(args.out / "answers.jsonl") if r["model"] == lm.name and r.get("seed") == seed}
    keep = jsonl_appender(args.out / "answers.jsonl")
    todo = [(row, arranged) for row, arranged in asked if row.id not in done]
    started = time.perf_counter()
    for number, (row, arranged) in enumerate(todo, 1):
        keep({"model": lm.name, "seed": seed} | evaluate_question(lm, row, arranged, methods, adapter, args.share, args.max_new_tokens))
        if number % 10 == 0:
            log(f"{lm.name} {'seed ' + str(seed) if seed is not None else 'seedless methods'}: {number}/{len(todo)} questions, "
                f"{(time.perf_counter() - started) / number:.1f} s each")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--parts", type=parts_type(PARTS), default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--questions", type=int, default=None, help="the first N held-out questions (default all 288), the same for every seed")
    parser.add_argument("--examples", type=int, default=96, help="training examples per adapter")
    parser.add_argument("--steps", type=int, default=ADAPTER_STEPS)
    parser.add_argument("--tokens", type=int, default=ADAPTER_TOKENS, help="soft tokens on each side of a part")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="paragraphs", help="training examples: paragraph-long documents or short facts")
    parser.add_argument("--curve-every", type=int, default=50, help="held-out KL every N training steps (0: none)")
    parser.add_argument("--ablate-tokens", type=int, nargs="*", default=[], help="ablation part: also train the first seed with these token counts")
    parser.add_argument("--ablate-learning-rates", type=float, nargs="*", default=[],
                        help="ablation part: also train the first seed at --tokens with these learning rates")
    parser.add_argument("--ablate-steps", type=int, nargs="*", default=[],
                        help="ablation part: also train the first seed at --tokens for these step counts (the learning curve covers counts up to --steps)")
    parser.add_argument("--learning-rate", type=float, default=ADAPTER_LEARNING_RATE)
    parser.add_argument("--share", type=float, default=DEFAULT_SHARE, help="selective recompute: share of tokens recomputed")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--timing", type=int, default=12, help="questions timed per model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_packet")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    parts = args.parts
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "examples": args.examples, "steps": args.steps, "tokens": args.tokens, "learning_rate": args.learning_rate, "shape": args.shape,
        "share": args.share, "max_new_tokens": args.max_new_tokens, "questions": args.questions,
    }
    settings_path = args.out / "settings.json"
    if args.fresh or not settings_path.exists():
        for name in ("training", "answers", "timing"):
            discard_records(args.out / f"{name}.jsonl")
        for old in (args.out / "adapters").glob("*.pack") if (args.out / "adapters").exists() else []:
            old.unlink()
        settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    elif json.loads(settings_path.read_text()) != settings:
        raise SystemExit(f"{args.out} was made with settings {settings_path.read_text().strip()}, not {settings}: pass --fresh")
    rows = load_rows()
    asked = questions(rows, args.questions, rows)
    started = time.perf_counter()
    if not args.report_only:
        for name in args.models:
            lm = load_model(name, device="cpu", progress=False)
            log(f"{name} loaded")
            if "answers" in parts:
                ask(lm, asked, SEEDLESS, None, None, args)
            for seed in args.seeds:
                path = adapter_path(args.out, lm.name, seed)
                if "train" in parts and not path.exists():
                    train_and_keep(lm, args, seed, args.tokens, path)
                if not path.exists():
                    continue
                adapter = load_adapter(path)
                if "answers" in parts:
                    ask(lm, asked, ("packet",), seed, adapter, args)
                if "timing" in parts and seed == args.seeds[0]:
                    done = {r["id"] for r in read_jsonl(args.out / "timing.jsonl") if r["model"] == lm.name}
                    keep = jsonl_appender(args.out / "timing.jsonl")
                    for row, arranged in asked[: args.timing]:
                        if row.id not in done:
                            keep({"model": lm.name} | time_question(lm, row, arranged, adapter, args.share, args.repeats))
            if "ablation" in parts:  # held-out KL only: other soft-token counts, learning rates and steps, the first seed
                for tokens in args.ablate_tokens:
                    path = adapter_path(args.out, lm.name, args.seeds[0], tokens)
                    if not path.exists():
                        train_and_keep(lm, args, args.seeds[0], tokens, path, ablation=True)
                for rate in args.ablate_learning_rates:
                    path = adapter_path(args.out, lm.name, args.seeds[0], args.tokens, rate)
                    if not path.exists():
                        train_and_keep(lm, args, args.seeds[0], args.tokens, path, ablation=True, learning_rate=rate)
                for steps in args.ablate_steps:
                    path = adapter_path(args.out, lm.name, args.seeds[0], args.tokens, steps=steps)
                    if not path.exists():
                        train_and_keep(lm, args, args.seeds[0], args.tokens, path, ablation=True, steps=steps)
    about = {"settings": settings, "wall_seconds_last_run": round(time.perf_counter() - started, 1), "machine": machine_description({}), "source": source_description()}
    print(write_report(args.out, args.figures, about))
    return 0


if __name__ == "__main__":
    sys.exit(main())
