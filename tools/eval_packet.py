"""KV Packet against full, no and selective recompute, on multi-document ckc questions, per model and seed.

For each seed an adapter is trained (``packstore.kv.packet.train_adapter``, model frozen) on examples
from the project's two fact generators (packstore.kv.synthetic and tools/second_facts.py: short
invented facts, 2-4 documents of 2-5 facts, a question about one fact), never on ckc. It is then
tested on ckc: each question's paragraph (the gold) and 1-4 other paragraphs as distractors, 2-5 in
all, in a seeded order with the gold at a seeded position, every paragraph its own pack built alone.
The test contexts differ from the training ones: real Wikipedia paragraphs of 100-250 tokens instead
of invented one-line facts, up to 5 parts instead of 4, and every question's distractors unrelated.

Methods, all from the same independently built parts:
  full       full recompute: the prefill of every part's tokens in one rendering (exact, the reference);
  none       no recompute: the parts spliced with RoPE re-positioning (only framing tokens prefilled);
  selective  selective recompute (the CacheBlend idea, packstore.kv.blend): the splice, with the
             ``--share`` (15 %) of tokens whose values deviate most after two layers recomputed;
  packet     the splice with the adapter's soft tokens around each part (packstore.kv.packet).
Per method: EM and F1 of the greedy answer, the first answer token's logits against full recompute
(cosine of the logits and of the probabilities, same argmax), whether the whole answer equals full
recompute's, and the FLOPs of composing (analytic: 2 x non-embedding parameters + 4 x layers x
attention width x context per computed position; the probe's share for selective). Time to first
token (composing from parts in memory, the question's prefill and the first token) is timed on a
subset (``--timing``), each method in turn per question, median of ``--repeats``.

Outputs in ``--out``: training.jsonl (one line per adapter: time, memory, held-out KL), adapters/
(the adapter packs, as pack files), answers.jsonl, timing.jsonl (appended as made; a rerun resumes),
summary.json, table.md; PNGs in ``--figures``. From the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python tools/eval_packet.py [--models smollm2-135m gemma3-270m] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from packstore.format.packfile import pack_file_parts, parse_pack_file  # noqa: E402
from packstore.kv.blend import DEFAULT_SHARE, PROBE_LAYERS, selective_recompute  # noqa: E402
from packstore.kv.build import build_pack, prefill  # noqa: E402
from packstore.kv.compose import splice  # noqa: E402
from packstore.kv.inject import cache_aligned_ids, cache_from_pack, greedy_with_logits  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS  # noqa: E402
from packstore.kv.packet import generated_examples, packet_compose, train_adapter  # noqa: E402
from packstore.kv.records import Example  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.packs.tensors import Pack, decode_pack, encode_pack  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import logger, machine_description, median, source_description  # noqa: E402
from evallib import (  # noqa: E402
    METRICS,
    REPO,
    Row,
    answer_scores,
    frozen_split,
    gold_answers,
    grouped_bars,
    jsonl_appender,
    load_rows,
    markdown_table,
    mean_interval,
    parts_type,
    read_jsonl,
)
from second_facts import second_facts  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")
METHODS = ("full", "none", "selective", "packet")
LABELS = {"full": "full recompute", "none": "no recompute (RoPE)", "selective": "selective recompute", "packet": "KV Packet"}
PARTS = ("train", "answers", "timing")
log = logger("eval_packet")


# ---- data ----


def training_examples(count: int, seed: int) -> list[Example]:
    """``count`` examples, half from each of the project's fact generators, shuffled by ``seed``."""
    first = generated_examples(count - count // 2, seed=seed)
    rng = random.Random(f"second:{seed}")
    cases = second_facts(count * 14, seed=seed)
    second, used = [], 0
    for _ in range(count // 2):
        documents = []
        for _ in range(rng.randint(2, 4)):
            size = rng.randint(2, 5)
            documents.append(cases[used : used + size])
            used += size
        asked = rng.choice(rng.choice(documents))
        second.append(Example(tuple(tuple(case.fact for case in doc) for doc in documents), asked.question))
    examples = first + second
    random.Random(seed).shuffle(examples)
    return examples


def questions(rows: Sequence[Row], seed: int, count: int, pool: Sequence[Row]) -> list[tuple[Row, list[Row]]]:
    """``count`` questions for ``seed`` (held-out half first, seeds taking consecutive rows), each with its
    2-5 paragraphs: the gold at a seeded position among seeded distractors."""
    tuning, held_out = frozen_split(rows)
    ordered = held_out + tuning
    chosen = ordered[seed * count : (seed + 1) * count]
    arranged = []
    for row in chosen:
        rng = random.Random(f"{seed}:{row.id}")
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


def compositions(lm: LoadedModel, parts: Sequence[Pack], adapter: Pack, share: float) -> dict[str, tuple]:
    """Per method: (cache, the pack header whose soft tokens the cache holds or None, the positions
    computed through every layer, the positions probed through the first layers)."""
    with torch.inference_mode():
        rope = splice(lm, parts, "rope")
        packet = packet_compose(lm, parts, adapter)
    token_ids = list(rope.pack.header.token_ids)
    blend = selective_recompute(lm, rope.pack, share=share)
    return {
        "full": (prefill(lm, token_ids), None, list(range(len(token_ids))), 0),
        "none": (cache_from_pack(rope.pack, lm.device), None, list(rope.computed_positions), 0),
        "selective": (blend.cache, None, sorted(set(rope.computed_positions) | set(blend.recomputed)), len(token_ids)),
        "packet": (cache_from_pack(packet.pack, lm.device), packet.pack.header, list(packet.computed_positions), 0),
    }


def evaluate_question(lm: LoadedModel, row: Row, arranged: Sequence[Row], adapter: Pack, share: float, max_new_tokens: int) -> dict:
    with torch.inference_mode():
        parts = [build_pack(lm, [paragraph.context]) for paragraph in arranged]
    rendering = render(lm.tokenizer, [p.context for p in arranged], row.question)
    record = {"id": row.id, "k": len(arranged), "gold": next(i for i, p in enumerate(arranged) if p.id == row.id), "tokens": rendering.prefix_tokens}
    reference = None
    for method, (cache, header, computed, probed) in compositions(lm, parts, adapter, share).items():
        ids = cache_aligned_ids(header, rendering.token_ids, lm.stop_token_ids[0]) if header is not None else rendering.token_ids
        answer_ids, step_logits = greedy_with_logits(lm, ids, max_new_tokens, cache)
        logits = step_logits[0]  # the first answer token's
        answer = lm.tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        if reference is None:
            reference = (answer_ids, logits)
        probs, reference_probs = torch.softmax(logits, -1), torch.softmax(reference[1], -1)
        record[method] = {
            "answer": answer,
            **answer_scores(answer, row.answers),
            "logit_cosine": float(torch.nn.functional.cosine_similarity(logits, reference[1], dim=0)),
            "prob_cosine": float(torch.nn.functional.cosine_similarity(probs, reference_probs, dim=0)),
            "same_first": int(logits.argmax()) == int(reference[1].argmax()),
            "same_answer": answer_ids == reference[0],
            "computed": len(computed),
            "probed": probed,
            "flops": composing_flops(lm, computed, probed),
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


def adapter_path(out: Path, model: str, seed: int) -> Path:
    return out / "adapters" / f"{Path(model).name}-seed{seed}.pack"


def save_adapter(pack: Pack, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(pack_file_parts(encode_pack(pack))))


def load_adapter(path: Path) -> Pack:
    return decode_pack(parse_pack_file(path.read_bytes()))


# ---- records, summaries, report ----


def summarize(answers: Sequence[dict], timing: Sequence[dict], training: Sequence[dict]) -> dict:
    """Per model and method: ``METRICS`` (recomputed from the answers; contains and F1 also per seed), agreement
    with full recompute, cost; median TTFT; the adapters' training records."""
    summary: dict = {}
    golds = gold_answers()
    for model in dict.fromkeys(r["model"] for r in answers):
        mine = [r for r in answers if r["model"] == model]
        seeds = sorted({r["seed"] for r in mine})
        entry: dict = {"questions": len(mine), "seeds": seeds, "methods": {}}
        for method in METHODS:
            scores = [answer_scores(r[method]["answer"], golds[r["id"]]) for r in mine]
            values = [r[method] for r in mine]
            entry["methods"][method] = {
                **{metric: mean_interval([score[metric] for score in scores]) for metric in METRICS},
                **{
                    f"{metric}_by_seed": [float(np.mean([sc[metric] for sc, r in zip(scores, mine) if r["seed"] == s])) for s in seeds]
                    for metric in ("contains", "f1")
                },
                "logit_cosine": float(np.mean([v["logit_cosine"] for v in values])),
                "prob_cosine": float(np.mean([v["prob_cosine"] for v in values])),
                "same_first": float(np.mean([v["same_first"] for v in values])),
                "same_answer": float(np.mean([v["same_answer"] for v in values])),
                "computed": float(np.mean([v["computed"] for v in values])),
                "gflops": float(np.mean([v["flops"] for v in values])) / 1e9,
            }
        entry["tokens"] = float(np.mean([r["tokens"] for r in mine]))
        timed = [r for r in timing if r["model"] == model]
        if timed:
            entry["ttft"] = {m: median([r[m] for r in timed]) for m in METHODS}
            entry["ttft_questions"] = len(timed)
        entry["training"] = [t for t in training if t["model"] == model]
        summary[model] = entry
    return summary


def _pm(values: Sequence[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}"


def tables(summary: dict) -> str:
    rows, costs, trained = [], [], []
    for model, entry in summary.items():
        full = entry["methods"]["full"]
        for method, m in entry["methods"].items():
            rows.append(
                [model, LABELS[method], m["contains"].percent(), _pm(m["contains_by_seed"]), m["em"].percent(), m["f1"].percent(), _pm(m["f1_by_seed"]),
                 f"{m['logit_cosine']:.4f}", f"{100 * m['same_first']:.1f}", f"{100 * m['same_answer']:.1f}"]
            )
            ttft = entry.get("ttft", {})
            costs.append(
                [model, LABELS[method], f"{m['computed']:.1f}", f"{m['gflops']:.2f}", f"{m['gflops'] / full['gflops']:.3f}",
                 f"{1000 * ttft[method]:.0f}" if method in ttft else "-", f"{ttft[method] / ttft['full']:.2f}" if method in ttft else "-"]
            )
        for t in entry["training"]:
            trained.append(
                [model, str(t["seed"]), str(t["steps"]), str(t["examples"]), f"{t['train_seconds']:.0f}", f"{t['peak_rss_mb']:.0f}",
                 f"{t['holdout_kl_no_adapter']:.4f}", f"{t['holdout_kl_before']:.4f}", f"{t['holdout_kl_after']:.4f}",
                 f"{t['holdout_kl_after'] / t['holdout_kl_no_adapter'] - 1:+.0%}"]
            )
    quality = markdown_table(
        ["model", "method", "contains % [95% CI]", "contains by seed (mean ± sd)", "strict EM % [95% CI]", "F1 % [95% CI]", "F1 by seed", "first-token logit cosine to full", "same first token %", "same answer as full %"],
        rows, left=2,
    )
    cost = markdown_table(["model", "method", "positions computed", "GFLOPs to compose", "vs full", "TTFT ms (median)", "vs full"], costs, left=2)
    training = markdown_table(
        ["model", "seed", "steps", "examples", "seconds", "peak RSS MB", "held-out KL: RoPE splice, no adapter", "soft tokens at init", "trained",
         "trained vs no adapter"],
        trained, left=1,
    )
    return "\n\n".join([quality, cost, training])


def plot(summary: dict, figures: Path) -> None:
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


def write_report(out: Path, figures: Path, about: dict) -> str:
    summary = summarize(read_jsonl(out / "answers.jsonl"), read_jsonl(out / "timing.jsonl"), read_jsonl(out / "training.jsonl"))
    text = tables(summary)
    encode = lambda value: value.__dict__ if hasattr(value, "__dict__") else str(value)  # noqa: E731
    (out / "summary.json").write_text(json.dumps(about | {"models": summary}, indent=2, default=encode) + "\n")
    (out / "table.md").write_text(text + "\n")
    plot(summary, figures)
    return text


# ---- command line ----


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--parts", type=parts_type(PARTS), default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--questions", type=int, default=100, help="questions per seed (each seed takes its own rows)")
    parser.add_argument("--examples", type=int, default=96, help="training examples per adapter")
    parser.add_argument("--steps", type=int, default=ADAPTER_STEPS)
    parser.add_argument("--tokens", type=int, default=ADAPTER_TOKENS, help="soft tokens on each side of a part")
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
        "examples": args.examples, "steps": args.steps, "tokens": args.tokens, "learning_rate": args.learning_rate,
        "share": args.share, "max_new_tokens": args.max_new_tokens, "questions": args.questions,
    }
    settings_path = args.out / "settings.json"
    if args.fresh or not settings_path.exists():
        for name in ("training", "answers", "timing"):
            (args.out / f"{name}.jsonl").write_text("")
        for old in (args.out / "adapters").glob("*.pack") if (args.out / "adapters").exists() else []:
            old.unlink()
        settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    elif json.loads(settings_path.read_text()) != settings:
        raise SystemExit(f"{args.out} was made with settings {settings_path.read_text().strip()}, not {settings}: pass --fresh")
    rows = load_rows()
    started = time.perf_counter()
    if not args.report_only:
        for name in args.models:
            lm = load_model(name, device="cpu", progress=False)
            log(f"{name} loaded")
            for seed in args.seeds:
                path = adapter_path(args.out, lm.name, seed)
                if "train" in parts and not path.exists():
                    examples = training_examples(args.examples, seed)
                    adapter = train_adapter(
                        lm, examples, source="packstore.kv.synthetic + tools/second_facts.py", tokens=args.tokens, steps=args.steps,
                        learning_rate=args.learning_rate, seed=seed,
                        progress=lambda step, loss, name=name, seed=seed: log(f"{name} seed {seed} step {step}: KL {loss:.4f}") if step % 25 == 0 else None,
                    )
                    save_adapter(adapter, path)
                    jsonl_appender(args.out / "training.jsonl")({"model": lm.name, "seed": seed, "steps": args.steps, "examples": args.examples, **adapter.header.metrics})
                    log(f"{name} seed {seed}: adapter trained, {adapter.header.metrics}")
                if not path.exists():
                    continue
                adapter = load_adapter(path)
                asked = questions(rows, seed, args.questions, rows)
                if "answers" in parts:
                    done = {r["id"] for r in read_jsonl(args.out / "answers.jsonl") if r["model"] == lm.name and r["seed"] == seed}
                    keep = jsonl_appender(args.out / "answers.jsonl")
                    todo = [(row, arranged) for row, arranged in asked if row.id not in done]
                    for number, (row, arranged) in enumerate(todo, 1):
                        keep({"model": lm.name, "seed": seed} | evaluate_question(lm, row, arranged, adapter, args.share, args.max_new_tokens))
                        if number % 10 == 0:
                            log(f"{name} seed {seed}: {number}/{len(todo)} questions, {(time.perf_counter() - started) / 60:.0f} min in")
                if "timing" in parts and seed == args.seeds[0]:
                    done = {r["id"] for r in read_jsonl(args.out / "timing.jsonl") if r["model"] == lm.name}
                    keep = jsonl_appender(args.out / "timing.jsonl")
                    for row, arranged in asked[: args.timing]:
                        if row.id not in done:
                            keep({"model": lm.name} | time_question(lm, row, arranged, adapter, args.share, args.repeats))
    about = {"settings": settings, "wall_seconds_last_run": round(time.perf_counter() - started, 1), "machine": machine_description({}), "source": source_description()}
    print(write_report(args.out, args.figures, about))
    return 0


if __name__ == "__main__":
    sys.exit(main())
