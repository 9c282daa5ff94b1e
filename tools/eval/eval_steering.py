"""Steering packs (the paper's §4.6-4.7, Tables 6-10): effect and coherence against alpha, layer ranges,
pair counts, two directions, the key-arithmetic control, and the dual channel on ckc, per model.

Behaviours and scorers (stated in docs/evaluation.md):
  sentiment: built from the first 30 pairs of tools/data/steering/sentiment_pairs.jsonl; scored by
    VADER's compound score (the vaderSentiment package: a rule-based lexicon scorer from -1 to 1,
    written by others, knowing nothing of these models); its effect is the mean compound score.
  food topic: built from 30 pairs of topic_pairs.jsonl (food vs. other everyday things, both neutral);
    scored by the share of outputs naming a food word (FOOD_WORDS) and the share of their words that are.
  coherence: the perplexity of the output under the unsteered model given the same prompt (median over
    prompts), and the repetition rate (share of word 3-grams of an output that repeat an earlier one).
Prompt sets (60 each, the third real data): ``own`` (tools/data/steering/prompts.jsonl), ``second``
(second_prompts.jsonl, written independently by someone who never saw the pairs or the first set),
``ckc`` (held-out ckc paragraphs given as knowledge, asked "What do you think about this?"). A second,
independently written pair set (second_sentiment_pairs.jsonl) gives a second sentiment direction,
used for the cosine of two directions of the same behaviour.

Parts:
  sweep (Table 6): sentiment at alpha -2 .. 3 on the middle third of the layers, and the
    instruction-in-the-prompt baselines (a sentence asking for a happy / an angry tone).
  layers (Table 7): sentiment at alpha 1 and 2 on the early and late thirds (the middle is the sweep's).
  pairs: three disjoint 5-pair subsets of the 30 pairs, at alpha 1 and 2 (30 pairs: the sweep's).
  directions (Table 8): food alone (alpha 1, 2, 3), and sentiment + food together at alpha 1 and 2 each; per-layer cosine
    of the value deltas of two directions (and of two authors' sentiment directions, and random vectors).
  keys: the key-arithmetic control: the same deltas added to the keys (alpha 0.5, 1, 2) or to both (1).
  dual (Tables 9-10): ckc questions answered with their paragraph as a knowledge pack through the one
    answering path (packstore.answering.answer), steered by sentiment at alpha 0 .. 2; EM/F1, the answers'
    sentiment, and (first ``--compare`` questions per alpha) divergences from the steered text-in-prompt answer.

Generation is greedy, ``--max-new-tokens`` tokens, batched (left-padded, each row steered from its own
question start) for the first five parts; the dual channel runs one question at a time, as a user's
would. Every distinct pair text is prefilled once per model, for all the directions, poolings and the
cosines' nulls that use it. Records append to ``--out`` as made and a rerun resumes (``--fresh`` starts
over); summary.json, table.md there, PNGs in ``--figures``. From the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_steering [--models smollm2-135m gemma3-270m] [--parts sweep,dual]

A short run (tests/eval/test_eval_real.py) narrows the same parts: ``--conditions`` names the conditions to run (the
sweep's sentiment +0, +1 and +2, which the other parts compare with, run too), ``--pairs N`` builds each direction from
its first N pairs (the three subsets from N // 3 each when that is fewer than 5; recorded in settings.json), and
``--dual-alphas`` asks the dual channel at some of its alphas.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from packstore.answering.answer import Answerer, Question  # noqa: E402
from packstore.answering.api import store_pack  # noqa: E402
from packstore.answering.facts import read_items, read_pairs  # noqa: E402
from packstore.kv.build import build_pack  # noqa: E402
from packstore.kv.inject import Sampling  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.kv.options import middle_third  # noqa: E402
from packstore.kv.records import Pair  # noqa: E402
from packstore.kv.render import render  # noqa: E402
from packstore.kv.rope import layer_frequencies  # noqa: E402
from packstore.kv.steer import Direction, Prefilled, SteeredCache, build_steering, model_layers, pair_deltas, steering_deltas  # noqa: E402
from packstore.packs.tensors import Pack, encode_pack  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, source_commit, source_description  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    METRICS,
    REPO,
    Interval,
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
    mean_interval,
    metric_headers,
    metric_intervals,
    parts_type,
    proportion_interval,
    read_jsonl,
)

MODELS = ("smollm2-135m", "gemma3-270m")
PARTS = ("sweep", "layers", "pairs", "directions", "keys", "diagnosis", "dual")
DATA = REPO / "tools" / "data" / "steering"
MAIN_PAIRS = 30
MEAN_POOLED = "sentiment, mean-pooled"  # the sentiment pairs, K/V pooled as the mean over each text's tokens
CHAT_FRAMED = "sentiment, chat-framed"  # the sentiment pairs pooled as user messages in the chat template (--framing chat)
UNROTATED = "sentiment, keys before RoPE"  # the sentiment pairs, key deltas pooled before RoPE (steer build --keys unrotated)
SUBSET_PAIRS = 5
SWEEP_ALPHAS = (-2.0, -1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0)
DUAL_ALPHAS = (0.0, 0.35, 0.7, 1.0, 1.5, 2.0)
CKC_ASK = "What do you think about this?"
REFERENCES = ("sentiment +0", "sentiment +1", "sentiment +2")  # the sweep's conditions the other parts compare with
# Records in results/eval_steering without a commit were made before records named theirs (f9fd0fb): by this tool as of
# its first commit 055c0ed, up to 4647cb5, which committed them (git log -- tools/eval/eval_steering.py results/eval_steering).
LEGACY = "legacy"
LEGACY_NOTE = ("legacy: records without a commit, made by the tool at commits 055c0ed..4647cb5 (2026-11-24), before records "
               "named their commit; the steering arithmetic did not change in that range")
INSTRUCTIONS = {"happy": "Answer in a very happy and positive tone.", "angry": "Answer in a very angry and negative tone."}
# Food words for the topic scorer (singular and plural forms listed where both are common).
FOOD_WORDS = frozenset(
    """food foods meal meals dish dishes eat eating ate eaten cook cooking cooked cooks recipe recipes bake baking baked
    bread breads cake cakes cookie cookies pie pies pastry pastries croissant biscuit biscuits dough flour sugar butter
    cheese milk cream yoghurt yogurt egg eggs honey jam sauce soup soups stew salad salads sandwich sandwiches pizza pasta
    noodles rice dumplings sushi curry taco tacos burger burgers cheeseburger fries chips crisps popcorn snack snacks
    dessert desserts chocolate caramel vanilla cinnamon ice-cream icecream pancake pancakes waffle waffles breakfast lunch
    dinner supper brunch picnic buffet menu restaurant cafe bakery kitchen chef chefs tasty delicious flavour flavor
    flavours spicy sweet salty savory savoury fruit fruits apple apples banana bananas berries strawberry strawberries
    grape grapes lemon lemons orange oranges peach peaches cherry cherries vegetable vegetables veggies carrot carrots
    potato potatoes tomato tomatoes onion onions garlic pepper peppers cucumber lettuce spinach beans peas corn mushroom
    mushrooms olive olives avocado herbs basil meat beef chicken pork bacon ham sausage sausages steak fish seafood
    salmon tuna shrimp lentils oats granola cereal tea coffee juice smoothie milkshake wine beer drinks grill grilled
    roast roasted fried fry boil boiled bake tasting taste tastes feast""".split()
)
_WORD = re.compile(r"[a-z][a-z'-]*")
log = logger("eval_steering")


# ---- pure scoring helpers ----


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def repetition(text: str, n: int = 3) -> float:
    """Share of the word n-grams of ``text`` that repeat an earlier one (0 for fewer than two)."""
    tokens = words(text)
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if len(grams) > 1 else 0.0


def food_share(text: str) -> float:
    """Share of the words of ``text`` that are food words."""
    tokens = words(text)
    return sum(t in FOOD_WORDS for t in tokens) / len(tokens) if tokens else 0.0


_VADER = None


def sentiment(text: str) -> float:
    """VADER's compound score of ``text``, -1 (negative) to 1 (positive); 0 for no text."""
    global _VADER
    if _VADER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _VADER = SentimentIntensityAnalyzer()
    return _VADER.polarity_scores(text)["compound"] if text.strip() else 0.0


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


# ---- what is asked ----


@dataclass(frozen=True)
class Prompt:
    """One prompt of a set: the question and the knowledge given with it (ckc: the paragraph)."""

    set: str
    index: int
    question: str
    facts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Condition:
    """One way of answering every prompt: steering directions with alphas, layers and target, or an instruction."""

    name: str
    part: str
    steer: tuple[tuple[str, float], ...] = ()
    layers: str = "middle"  # early | middle | late third, or all layers
    target: str = "values"
    instruction: str = ""
    alpha: float = 0.0  # the sentiment alpha this condition is plotted at (sweep, layers, pairs, keys)


def thirds(layers: int) -> dict[str, tuple[int, int]]:
    """Early, middle and late thirds of ``layers`` layers (the middle as ``middle_third``), and all of them."""
    first, last = middle_third(layers)
    return {"early": (0, first - 1), "middle": (first, last), "late": (last + 1, layers - 1), "all": (0, layers - 1)}


def conditions() -> list[Condition]:
    """Every condition of the first five parts, in run order."""
    found = [Condition(f"sentiment {a:+g}", "sweep", (("sentiment", a),), alpha=a) for a in SWEEP_ALPHAS]
    found += [Condition(f"instruction {tone}", "sweep", instruction=text) for tone, text in INSTRUCTIONS.items()]
    found += [
        Condition(f"sentiment {a:+g} {third}", "layers", (("sentiment", a),), layers=third, alpha=a)
        for third in ("early", "late")
        for a in (1.0, 2.0)
    ]
    found += [Condition(f"sentiment-5{s} {a:+g}", "pairs", ((f"sentiment-5{s}", a),), alpha=a) for s in "abc" for a in (1.0, 2.0)]
    found += [Condition(f"food {a:+g}", "directions", (("food", a),), alpha=a) for a in (1.0, 2.0, 3.0)]
    found += [Condition(f"sentiment {a:+g} food {a:+g}", "directions", (("sentiment", a), ("food", a)), alpha=a) for a in (1.0, 2.0)]
    found += [Condition(f"keys {a:+g}", "keys", (("sentiment", a),), target="keys", alpha=a) for a in (0.5, 1.0, 2.0)]
    found += [Condition("both +1", "keys", (("sentiment", 1.0),), target="both", alpha=1.0)]
    found += [  # key arithmetic before RoPE: the delta rotated to each steered position (issue 39)
        Condition(f"keys before RoPE {a:+g}", "keys", ((UNROTATED, a),), target="keys", alpha=a) for a in (0.5, 1.0, 2.0)
    ]
    # why is sentiment inert on gemma3-270m? mean pooling instead of the last token, pairs in the chat template, every
    # layer, stronger alphas
    found += [Condition(f"sentiment mean-pooled {a:+g}", "diagnosis", ((MEAN_POOLED, a),), alpha=a) for a in (1.0, 2.0, 4.0)]
    found += [Condition(f"sentiment chat-framed {a:+g}", "diagnosis", ((CHAT_FRAMED, a),), alpha=a) for a in (1.0, 2.0, 4.0)]
    found += [Condition(f"sentiment all layers {a:+g}", "diagnosis", (("sentiment", a),), layers="all", alpha=a) for a in (0.5, 1.0)]
    found += [Condition(f"sentiment {a:+g}", "diagnosis", (("sentiment", a),), alpha=a) for a in (4.0, 6.0)]
    return found


def direction_pairs(limit: int | None = None) -> dict[str, list[Pair]]:
    """The pair sets each direction is built from; with ``limit`` (``--pairs``, at least 3), at most that many pairs
    each, and the three disjoint subsets ``limit // 3`` pairs each where that is fewer than ``SUBSET_PAIRS``."""
    main = MAIN_PAIRS if limit is None else min(limit, MAIN_PAIRS)
    subset = SUBSET_PAIRS if limit is None else min(SUBSET_PAIRS, limit // 3)
    sentiment_pairs = read_pairs(DATA / "sentiment_pairs.jsonl")[:main]
    sets = {"sentiment": sentiment_pairs, "food": read_pairs(DATA / "topic_pairs.jsonl")[:main]}
    for number, letter in enumerate("abc"):
        sets[f"sentiment-5{letter}"] = sentiment_pairs[number * subset : (number + 1) * subset]
    sets["sentiment-second"] = read_pairs(DATA / "second_sentiment_pairs.jsonl")[:limit]
    return sets


def prompt_sets(limit: int) -> dict[str, list[Prompt]]:
    """The three prompt sets, ``limit`` prompts each: own, second (another author) and ckc (real paragraphs)."""
    own = read_items(DATA / "prompts.jsonl", "prompt")[:limit]
    second = read_items(DATA / "second_prompts.jsonl", "prompt")[:limit]
    rows = load_rows()
    _, held_out = frozen_split(rows)
    paragraphs = list(dict.fromkeys(row.context for row in held_out))[:limit]
    return {
        "own": [Prompt("own", i, text) for i, text in enumerate(own)],
        "second": [Prompt("second", i, text) for i, text in enumerate(second)],
        "ckc": [Prompt("ckc", i, CKC_ASK, (text,)) for i, text in enumerate(paragraphs)],
    }


# ---- generation and scoring (batched) ----


@dataclass
class Batch:
    """Prompts rendered and left-padded together: ids, mask, and each row's question start."""

    prompts: list[Prompt]
    ids: torch.Tensor
    mask: torch.Tensor
    starts: torch.Tensor
    lengths: list[int] = field(default_factory=list)


def render_batch(lm: LoadedModel, prompts: Sequence[Prompt], instruction: str) -> Batch:
    renderings = [render(lm.tokenizer, p.facts, f"{p.question} {instruction}".strip()) for p in prompts]
    width = max(len(r.token_ids) for r in renderings)
    pad = lm.stop_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(r.token_ids)) + r.token_ids for r in renderings])
    mask = torch.tensor([[0] * (width - len(r.token_ids)) + [1] * len(r.token_ids) for r in renderings])
    starts = torch.tensor([width - len(r.token_ids) + r.prefix_tokens for r in renderings])
    return Batch(list(prompts), ids, mask, starts, [len(r.token_ids) for r in renderings])


def generate_batch(lm: LoadedModel, batch: Batch, deltas: dict, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of each row (stop tokens cut), steered from each row's question start."""
    padding = torch.tensor([batch.ids.shape[1] - length for length in batch.lengths])
    cache = SteeredCache(deltas, batch.starts, padding) if deltas else None
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=batch.ids,
            attention_mask=batch.mask,
            **{lm.cache_argument: cache},
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=lm.stop_token_ids[0],
            eos_token_id=list(lm.stop_token_ids),
        )
    continuations = []
    for row in out[:, batch.ids.shape[1] :].tolist():
        cut = next((i for i, token in enumerate(row) if token in lm.stop_token_ids), len(row))
        continuations.append(row[:cut])
    return continuations


def perplexities(lm: LoadedModel, batch: Batch, outputs: Sequence[Sequence[int]]) -> list[float | None]:
    """Each output's perplexity under the unsteered model, given its prompt (None for an empty output)."""
    rows = [batch.ids[i][batch.mask[i].bool()].tolist() + list(out) for i, out in enumerate(outputs)]
    width = max(len(r) for r in rows)
    pad = lm.stop_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    keep = max(len(o) for o in outputs) + 1
    with torch.inference_mode():
        logits = lm.model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    found: list[float | None] = []
    for i, out in enumerate(outputs):
        if not out:
            found.append(None)
            continue
        predicted = logprobs[i, keep - 1 - len(out) : keep - 1]
        nll = -predicted.gather(1, torch.tensor(out)[:, None]).mean()
        found.append(float(torch.exp(nll)))
    return found


def scored_outputs(lm: LoadedModel, batch: Batch, outputs: Sequence[Sequence[int]]) -> list[dict]:
    ppl = perplexities(lm, batch, outputs)
    records = []
    for prompt, out, perplexity in zip(batch.prompts, outputs, ppl):
        text = lm.tokenizer.decode(out, skip_special_tokens=True).strip()
        records.append(
            {
                "set": prompt.set,
                "index": prompt.index,
                "output": text,
                "tokens": len(out),
                "sentiment": sentiment(text),
                "food_share": food_share(text),
                "food_any": food_share(text) > 0,
                "repetition": repetition(text),
                "ppl": perplexity,
            }
        )
    return records


# ---- the model-side runs ----


def build_directions(lm: LoadedModel, prefilled: Prefilled | None = None, pair_limit: int | None = None) -> dict[str, Pack]:
    """Every direction's steering pack on ``lm`` (all layers, last-token pooling, the default), and the sentiment
    direction again with its key deltas pooled before RoPE (``UNROTATED``), mean-pooled and chat-framed, from
    ``direction_pairs(pair_limit)``. With ``prefilled`` (``pair_deltas``), a text several directions pool (the 5-pair
    subsets', the variants') is prefilled once."""
    pairs = direction_pairs(pair_limit)
    return {name: build_steering(lm, found, prefilled=prefilled) for name, found in pairs.items()} | {
        UNROTATED: build_steering(lm, pairs["sentiment"], key_space="unrotated", prefilled=prefilled),
        MEAN_POOLED: build_steering(lm, pairs["sentiment"], pooling="mean", prefilled=prefilled),
        CHAT_FRAMED: build_steering(lm, pairs["sentiment"], framing="chat", prefilled=prefilled),
    }


def condition_deltas(lm: LoadedModel, condition: Condition, packs: dict[str, Pack]) -> dict:
    directions = [Direction(packs[name], alpha) for name, alpha in condition.steer]
    span = thirds(model_layers(lm))[condition.layers]
    before_rope = any(name == UNROTATED for name, _ in condition.steer)
    return steering_deltas(directions, layers=span, target=condition.target, frequencies=layer_frequencies(lm) if before_rope else None)


def run_conditions(
    lm: LoadedModel,
    todo: Sequence[tuple[Condition, list[Prompt]]],
    packs: dict[str, Pack],
    max_new_tokens: int,
    batch_size: int,
    keep: Callable[[dict], None],
) -> None:
    started = time.perf_counter()
    total = sum(len(prompts) for _, prompts in todo)
    done = 0
    for condition, prompts in todo:
        deltas = condition_deltas(lm, condition, packs)
        ordered = sorted(prompts, key=lambda p: (p.set, len(p.question) + sum(map(len, p.facts))))
        for first in range(0, len(ordered), batch_size):
            batch = render_batch(lm, ordered[first : first + batch_size], condition.instruction)
            outputs = generate_batch(lm, batch, deltas, max_new_tokens)
            for record in scored_outputs(lm, batch, outputs):
                keep({"model": lm.name, "condition": condition.name, "part": condition.part} | record)
            done += len(batch.prompts)
            rate = (time.perf_counter() - started) / done
            log(f"{lm.name} {condition.name}: {done}/{total} prompts, {rate:.2f} s each, ~{rate * (total - done) / 60:.0f} min left")


NULL_SHUFFLES = 1000  # label-shuffled draws per pair of directions


def direction_cosines(
    lm: LoadedModel, packs: dict[str, Pack], seed: int, prefilled: Prefilled | None = None, pair_limit: int | None = None
) -> dict:
    """Per-layer cosine of the value deltas of two directions, of two authors' sentiment directions,
    and of two random vectors of the same size (what unrelated directions look like in this dimension);
    and, per pair of directions, a label-shuffled null (``shuffled_null``); ``prefilled`` and ``pair_limit`` as
    ``build_directions`` took them (the pairs' texts are then not prefilled again)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = {"sentiment vs food": ("sentiment", "food"), "sentiment vs sentiment (other author)": ("sentiment", "sentiment-second")}
    found = {label: [cosine(packs[a].values[i], packs[b].values[i]) for i in range(len(packs[a].values))] for label, (a, b) in pairs.items()}
    size = packs["sentiment"].values[0].numel()
    found["random vectors"] = [cosine(torch.randn(size, generator=generator), torch.randn(size, generator=generator)) for _ in packs["sentiment"].values]
    sets = direction_pairs(pair_limit)
    differences = {name: [dv for _, dv in pair_deltas(lm, sets[name], prefilled=prefilled)] for name in {n for a_b in pairs.values() for n in a_b}}
    null = {label: shuffled_null(differences[a], differences[b], float(np.mean(found[label])), seed) for label, (a, b) in pairs.items()}
    return {"model": lm.name, "commit": source_commit(), "layers": len(packs["sentiment"].values), "dimension": size, "cosines": found, "null": null}


def shuffled_null(first: Sequence[Sequence[torch.Tensor]], second: Sequence[Sequence[torch.Tensor]], observed: float, seed: int) -> dict:
    """What the mean-over-layers cosine of two directions looks like when their pairs' labels mean nothing: each draw
    swaps good and bad in a random half of each direction's pairs (a random sign per pair) and averages again.
    ``first[p][layer]`` is pair p's value delta. Returns the null's 2.5 / 50 / 97.5 % quantiles and the two-sided
    share of draws at least as far from 0 as ``observed``."""
    rng = np.random.default_rng(seed)
    stacked = [np.stack([np.stack([d.numpy().ravel() for d in layers]) for layers in pairs]) for pairs in (first, second)]  # [pairs, layers, dim]
    draws = []
    for _ in range(NULL_SHUFFLES):
        means = [np.einsum("p,pld->ld", rng.choice((-1.0, 1.0), size=len(deltas)), deltas) / len(deltas) for deltas in stacked]
        dot = (means[0] * means[1]).sum(-1)
        norms = np.linalg.norm(means[0], axis=-1) * np.linalg.norm(means[1], axis=-1)
        draws.append(float(np.mean(dot / np.maximum(norms, 1e-30))))
    values = np.asarray(draws)
    low, middle, high = np.percentile(values, [2.5, 50, 97.5])
    return {
        "shuffles": NULL_SHUFFLES,
        "observed": observed,
        "quantiles": [float(low), float(middle), float(high)],
        "p_two_sided": float(np.mean(np.abs(values) >= abs(observed))),
    }


def run_dual(
    lm: LoadedModel,
    rows,
    packs: dict[str, Pack],
    max_new_tokens: int,
    compare: int,
    done: set,
    keep: Callable[[dict], None],
    alphas: Sequence[float] = DUAL_ALPHAS,
) -> None:
    """ckc questions with their paragraph as a knowledge pack, steered by sentiment at each of ``alphas``, via Answerer."""
    sampling = Sampling(max_new_tokens=max_new_tokens)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eval-steering-") as tmp, LmdbStore(Path(tmp) / "store") as store:
        store_pack(store, packs["sentiment"], name="sentiment")
        answerer = Answerer(lm, store)
        for number, row in enumerate(rows):
            todo = [a for a in alphas if (row.id, a) not in done]
            if not todo:
                continue
            key, _ = store.put(encode_pack(build_pack(lm, [row.context])))
            for alpha in todo:
                steering = (("sentiment", alpha),) if alpha else ()
                result = answerer.ask(
                    Question(row.question, refs=(key,), sampling=sampling, steering=steering, compare_rag=number < compare)
                )
                keep(
                    {
                        "model": lm.name,
                        "id": row.id,
                        "alpha": alpha,
                        "answer": result.answer,
                        **answer_scores(result.answer, row.answers),
                        "sentiment": sentiment(result.answer),
                        "compared": result.identical is not None,
                        "identical": result.identical,
                    }
                )
            rate = (time.perf_counter() - started) / (number + 1)
            log(f"{lm.name} dual: {number + 1}/{len(rows)} questions, {rate:.1f} s each")


# ---- records ----


# ---- summaries, tables, plots ----


def _median(values: Iterable[float | None]) -> float:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else float("nan")


def summarize_generations(records: Sequence[dict]) -> dict:
    """Per model, condition and prompt set: mean sentiment (with interval), food shares, coherence."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["condition"], r["set"]), []).append(r)
        groups.setdefault((r["model"], r["condition"], "all"), []).append(r)
    summary: dict = {}
    for (model, condition, prompt_set), mine in groups.items():
        summary.setdefault(model, {}).setdefault(condition, {})[prompt_set] = {
            "n": len(mine),
            "part": mine[0]["part"],
            "sentiment": mean_interval([r["sentiment"] for r in mine]),
            "positive": float(np.mean([r["sentiment"] > 0.05 for r in mine])),
            "food_any": proportion_interval(r["food_any"] for r in mine),
            "food_share": float(np.mean([r["food_share"] for r in mine])),
            "ppl": _median(r["ppl"] for r in mine),
            "repetition": float(np.mean([r["repetition"] for r in mine])),
            "empty": float(np.mean([r["tokens"] == 0 for r in mine])),
            "commits": _commits(mine),
        }
    return summary


def _commits(records: Sequence[dict]) -> list[str]:
    """The commits the records name, in order of first appearance; ``LEGACY`` for records that name none."""
    return list(dict.fromkeys(r.get("commit") or LEGACY for r in records))


def summarize_dual(records: Sequence[dict]) -> dict:
    """Per model and alpha: ``METRICS`` (recomputed from the answers), sentiment, repetition, divergences."""
    summary: dict = {}
    golds = gold_answers()
    for model in dict.fromkeys(r["model"] for r in records):
        for alpha in DUAL_ALPHAS:
            mine = [r for r in records if r["model"] == model and r["alpha"] == alpha]
            if not mine:
                continue
            compared = [r for r in mine if r["compared"]]
            summary.setdefault(model, {})[f"{alpha:g}"] = {
                "n": len(mine),
                **metric_intervals([r["answer"] for r in mine], [golds[r["id"]] for r in mine]),
                "sentiment": mean_interval([r["sentiment"] for r in mine]),
                "repetition": float(np.mean([repetition(r["answer"]) for r in mine])),
                "compared": len(compared),
                "divergences": sum(not r["identical"] for r in compared),
                "commits": _commits(mine),
            }
    return summary


def _f(value: float, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _ci(interval: Interval, digits: int = 2) -> str:
    return f"{interval.mean:+.{digits}f} [{interval.low:+.{digits}f}, {interval.high:+.{digits}f}]"


def generation_table(summary: dict, names: Sequence[str], effect: str = "sentiment") -> str:
    """One row per model and condition: the effect per prompt set, and coherence over all sets."""
    rows = []
    for model, by_condition in summary.items():
        base = by_condition.get("sentiment +0", {})
        for name in names:
            cells = by_condition.get(name)
            if not cells:
                continue
            all_sets = cells["all"]
            effect_cells = []
            for prompt_set in ("own", "second", "ckc"):
                if prompt_set in cells:
                    value = cells[prompt_set][effect]
                    effect_cells.append(_ci(value) if isinstance(value, Interval) else _f(value))
                else:
                    effect_cells.append("-")
            delta = "-"
            if base.get("all") and effect == "sentiment":
                delta = f"{all_sets['sentiment'].mean - base['all']['sentiment'].mean:+.2f}"
            elif base.get("all"):
                delta = f"{all_sets['food_any'].mean - base['all']['food_any'].mean:+.2f}"
            commits = all_sets.get("commits", [])
            rows.append([model, name, *effect_cells, delta, _f(all_sets["ppl"], 1), _f(all_sets["repetition"]), _f(all_sets["empty"]), ", ".join(commits)])
    label = "sentiment (VADER compound)" if effect == "sentiment" else "outputs naming food (share, Wilson 95%)"
    headers = ["model", "condition", f"{label}: own", "second", "ckc", "change vs alpha 0 (all)", "median PPL", "repetition", "empty", "records' commit"]
    return _with_legacy_note(markdown_table(headers, rows, left=2), rows)


def _with_legacy_note(table: str, rows: Sequence[Sequence[str]]) -> str:
    """``table`` with ``LEGACY_NOTE`` under it when some row's records name no commit."""
    return table + "\n\n" + LEGACY_NOTE if any(LEGACY in row[-1].split(", ") for row in rows) else table


def retained_table(summary: dict) -> str:
    """Table 8: each direction's effect alone and with the other applied too, at alpha 1 and 2 each (all prompt sets)."""
    rows = []
    for model, c in summary.items():
        for alpha in ("+1", "+2"):
            needed = ("sentiment +0", f"sentiment {alpha}", f"food {alpha}", f"sentiment {alpha} food {alpha}")
            if not all(name in c for name in needed):
                continue
            base, s_alone, f_alone, both = (c[name]["all"] for name in needed)
            s_effect = s_alone["sentiment"].mean - base["sentiment"].mean
            s_both = both["sentiment"].mean - base["sentiment"].mean
            f_effect = f_alone["food_any"].mean - base["food_any"].mean
            f_both = both["food_any"].mean - base["food_any"].mean
            rows.append(
                [
                    model,
                    alpha,
                    f"{s_effect:+.3f}",
                    f"{s_both:+.3f}",
                    f"{100 * s_both / s_effect:.0f} %" if abs(s_effect) > 1e-9 else "-",
                    f"{f_effect:+.3f}",
                    f"{f_both:+.3f}",
                    f"{100 * f_both / f_effect:.0f} %" if abs(f_effect) > 1e-9 else "-",
                ]
            )
    headers = ["model", "alpha (each)", "sentiment effect alone", "with food too", "retained", "food effect alone", "with sentiment too", "retained"]
    return markdown_table(headers, rows)


def cosine_table(cosines: Sequence[dict]) -> str:
    """One row per model and pair of directions: the cosine over layers, and the label-shuffled null where recorded."""
    tested = [(entry["model"], label, _null_p(null)) for entry in cosines for label, null in entry.get("null", {}).items()]
    adjusted = {(model, label): p for (model, label, _), p in zip(tested, holm([p for _, _, p in tested]))}
    rows = []
    for entry in cosines:
        for label, values in entry["cosines"].items():
            null = entry.get("null", {}).get(label)
            shuffled = ["-", "-", "-"]
            if null is not None:
                shuffled = [f"{null['quantiles'][0]:+.4f} .. {null['quantiles'][2]:+.4f}", format_p(_null_p(null)), format_p(adjusted[entry["model"], label])]
            rows.append(
                [entry["model"], label, f"{np.mean(values):+.4f}", f"{np.std(values):.4f}", f"{np.mean(np.abs(values)):.4f}", str(entry["dimension"]), *shuffled]
            )
    headers = ["model", "value deltas of", "mean cosine", "sd over layers", "mean abs", "dimension", "label-shuffled null, 95 %", "p (two-sided)", "p, Holm"]
    note = (f"p: (draws at least as far from 0 as the observed cosine + 1) / (draws + 1); Holm: over the family of the {len(tested)} "
            "comparisons with a null in this table")
    return markdown_table(headers, rows, left=2) + ("\n\n" + note if tested else "")


def _null_p(null: dict) -> float:
    """The label-shuffled null's two-sided p-value with the add-one rule (never 0 from a finite number of draws)."""
    extreme = round(null["p_two_sided"] * null["shuffles"])
    return (extreme + 1) / (null["shuffles"] + 1)


def dual_table(summary: dict) -> str:
    rows = []
    for model, by_alpha in summary.items():
        for alpha, s in by_alpha.items():
            rows.append(
                [model, alpha, str(s["n"]), *(s[m].percent() for m in METRICS), _ci(s["sentiment"]), _f(s["repetition"]),
                 f"{s['divergences']} / {s['compared']}", ", ".join(s.get("commits", []))]
            )
    headers = ["model", "alpha", "questions", *metric_headers(), "answer sentiment", "repetition", "divergences pack vs text (steered)", "records' commit"]
    return _with_legacy_note(markdown_table(headers, rows, left=2), rows)


def plot(summary: dict, dual: dict, cosines: Sequence[dict], figures: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures.mkdir(parents=True, exist_ok=True)
    models = list(summary)
    if models:  # Table 6: effect and coherence against alpha, per model and prompt set
        figure, axes = plt.subplots(3, len(models), figsize=(6.5 * len(models), 10.5), squeeze=False)
        for column, model in enumerate(models):
            c = summary[model]
            for prompt_set, colour in (("own", "tab:blue"), ("second", "tab:orange"), ("ckc", "tab:green")):
                points = [(a, c[f"sentiment {a:+g}"][prompt_set]) for a in SWEEP_ALPHAS if prompt_set in c.get(f"sentiment {a:+g}", {})]
                if not points:
                    continue
                alphas = [a for a, _ in points]
                means = [p["sentiment"].mean for _, p in points]
                errors = [[p["sentiment"].mean - p["sentiment"].low for _, p in points], [p["sentiment"].high - p["sentiment"].mean for _, p in points]]
                axes[0][column].errorbar(alphas, means, yerr=errors, marker="o", capsize=3, color=colour, label=f"steered ({prompt_set})")
                axes[1][column].plot(alphas, [p["ppl"] for _, p in points], marker="o", color=colour, label=prompt_set)
                axes[2][column].plot(alphas, [p["repetition"] for _, p in points], marker="o", color=colour, label=prompt_set)
                for tone, style in (("happy", "--"), ("angry", ":")):
                    baseline = c.get(f"instruction {tone}", {}).get(prompt_set)
                    if baseline:
                        axes[0][column].axhline(baseline["sentiment"].mean, color=colour, linestyle=style, linewidth=1, label=f"instruction '{tone}' ({prompt_set})")
            axes[0][column].set_title(f"{model}: sentiment of the answers (VADER)")
            axes[0][column].set_ylabel("mean compound score (-1..1)")
            axes[1][column].set_title(f"{model}: perplexity under the unsteered model")
            axes[1][column].set_ylabel("median perplexity (log scale)")
            axes[1][column].set_yscale("log")
            axes[2][column].set_title(f"{model}: repetition")
            axes[2][column].set_ylabel("share of repeated word 3-grams")
            for row in axes:
                row[column].set_xlabel("alpha (sentiment direction, middle third of layers)")
                row[column].grid(alpha=0.3)
            axes[0][column].legend(fontsize=7, ncol=2)
            axes[1][column].legend(fontsize=8)
        figure.suptitle("Steering strength: effect and coherence (dashed/dotted: instruction in the prompt)", fontsize=11)
        figure.tight_layout()
        figure.savefig(figures / "eval_steering_alpha.png", dpi=110)
        plt.close(figure)

        panels = {}
        for model in models:  # Tables 7 and pairs: sentiment change vs alpha 0 by layer range and pair count
            c = summary[model]
            base = c.get("sentiment +0", {}).get("all")
            if not base:
                continue
            series: dict[str, dict[str, float]] = {}
            for a in (1.0, 2.0):
                for label, name in (
                    ("early third", f"sentiment {a:+g} early"),
                    ("middle third", f"sentiment {a:+g}"),
                    ("late third", f"sentiment {a:+g} late"),
                    ("5 pairs (a)", f"sentiment-5a {a:+g}"),
                    ("5 pairs (b)", f"sentiment-5b {a:+g}"),
                    ("5 pairs (c)", f"sentiment-5c {a:+g}"),
                    ("keys (control)", f"keys {a:+g}"),
                ):
                    if name in c:
                        series.setdefault(f"alpha {a:g}", {})[label] = c[name]["all"]["sentiment"].mean - base["sentiment"].mean
            panels[model] = series
        if panels:
            grouped_bars(
                figures / "eval_steering_layers_pairs.png",
                panels,
                title="Sentiment change vs alpha 0 (all prompt sets): layer thirds, 5 vs 30 pairs (middle = 30 pairs), key control",
                ylabel="change in mean VADER compound",
                shared_y=True,  # gemma3-270m's changes are a tenth of smollm2-135m's: one scale shows it
            )
    if cosines:
        figure, axes = plt.subplots(1, len(cosines), figsize=(6.5 * len(cosines), 4.2), squeeze=False)
        for axis, entry in zip(axes[0], cosines):
            for label, values in entry["cosines"].items():
                axis.plot(range(len(values)), values, marker="o", label=label)
            axis.axhline(0, color="grey", linewidth=0.8)
            axis.set_title(f"{entry['model']}: cosine of value deltas per layer (dim {entry['dimension']})")
            axis.set_xlabel("layer")
            axis.set_ylabel("cosine")
            axis.legend(fontsize=8)
            axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(figures / "eval_steering_directions.png", dpi=110)
        plt.close(figure)
    if dual:
        figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        for model, by_alpha in dual.items():
            alphas = [float(a) for a in by_alpha]
            axes[0].errorbar(
                alphas,
                [100 * s["contains"].mean for s in by_alpha.values()],
                yerr=[
                    [100 * (s["contains"].mean - s["contains"].low) for s in by_alpha.values()],
                    [100 * (s["contains"].high - s["contains"].mean) for s in by_alpha.values()],
                ],
                marker="o",
                capsize=3,
                label=model,
            )
            axes[1].plot(alphas, [s["sentiment"].mean for s in by_alpha.values()], marker="o", label=model)
        axes[0].axvline(0.7, color="grey", linestyle="--", linewidth=1, label="paper's guidance (0.7)")
        axes[0].set_title("Dual channel: ckc accuracy with the knowledge pack, steered")
        axes[0].set_xlabel("alpha (sentiment)")
        axes[0].set_ylabel("contains the answer %")
        axes[1].set_title("Dual channel: sentiment of the answers")
        axes[1].set_xlabel("alpha (sentiment)")
        axes[1].set_ylabel("mean VADER compound")
        for axis in axes:
            axis.legend(fontsize=8)
            axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(figures / "eval_steering_dual.png", dpi=110)
        plt.close(figure)


TABLE_SETS = {
    "sweep": ("Effect and coherence against alpha (Table 6)", [f"sentiment {a:+g}" for a in SWEEP_ALPHAS] + [f"instruction {t}" for t in INSTRUCTIONS]),
    "layers": ("Layer range (Table 7)", [f"sentiment {a:+g}{t}" for a in (1.0, 2.0) for t in (" early", "", " late")]),
    "pairs": ("How many pairs: 5 against 30", [f"{n} {a:+g}" for a in (1.0, 2.0) for n in ("sentiment", "sentiment-5a", "sentiment-5b", "sentiment-5c")]),
    "diagnosis": (
        "Why sentiment is inert on gemma3-270m: pooling, template, layers, strength",
        ["sentiment +0", "sentiment +1", "sentiment +2", "sentiment +4", "sentiment +6"]
        + [f"sentiment mean-pooled {a:+g}" for a in (1.0, 2.0, 4.0)]
        + [f"sentiment chat-framed {a:+g}" for a in (1.0, 2.0, 4.0)]
        + [f"sentiment all layers {a:+g}" for a in (0.5, 1.0)],
    ),
    "keys": (
        "The key-arithmetic control",
        ["sentiment +0", "sentiment +1", "keys +0.5", "keys +1", "keys +2", "both +1"] + [f"keys before RoPE {a:+g}" for a in (0.5, 1.0, 2.0)],
    ),
}

FOOD_CONDITIONS = ["sentiment +0", "food +1", "food +2", "food +3", "sentiment +1 food +1", "sentiment +2 food +2"]  # Table 8's food rows


def write_report(generations: list[dict], dual_records: list[dict], cosines: list[dict], out: Path, figures: Path, about: dict) -> str:
    summary = summarize_generations(generations)
    dual = summarize_dual(dual_records)
    sections = [f"### {title}\n\n{generation_table(summary, names)}" for title, names in TABLE_SETS.values()]
    sections.append(
        "### Two directions (Table 8)\n\n"
        + generation_table(summary, FOOD_CONDITIONS, effect="food_any")
        + "\n\n"
        + retained_table(summary)
        + "\n\n"
        + cosine_table(cosines)
    )
    if dual:
        sections.append(f"### Dual channel (Tables 9-10)\n\n{dual_table(dual)}")
    text = "\n\n".join(sections)
    out.mkdir(parents=True, exist_ok=True)
    encode = lambda value: value.__dict__ if isinstance(value, Interval) else str(value)  # noqa: E731
    (out / "summary.json").write_text(json.dumps(about | {"generations": summary, "dual": dual, "cosines": cosines}, indent=2, default=encode) + "\n")
    (out / "table.md").write_text(text + "\n")
    plot(summary, dual, cosines, figures)
    return text


# ---- command line ----


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model names or directories")
    parser.add_argument("--parts", type=parts_type(PARTS), default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument(
        "--conditions",
        type=parts_type([c.name for c in conditions()], "conditions"),
        help="comma-separated condition names: only these of the parts' conditions, and the references the other parts "
        f"compare with ({', '.join(REFERENCES)}); default every one",
    )
    parser.add_argument("--limit", type=int, default=60, help="prompts per prompt set")
    parser.add_argument("--dual-limit", type=int, default=200, help="ckc questions for the dual channel")
    parser.add_argument("--compare", type=int, default=20, help="dual channel: questions also answered as steered text, to count divergences")
    parser.add_argument(
        "--dual-alphas", type=float, nargs="+", choices=DUAL_ALPHAS, default=list(DUAL_ALPHAS), metavar="ALPHA",
        help=f"dual channel: these of its alphas ({' '.join(f'{a:g}' for a in DUAL_ALPHAS)}; default all)",
    )
    parser.add_argument(
        "--pairs", type=int, metavar="N",
        help=f"at most N pairs per direction, N >= 3 (default {MAIN_PAIRS}, and all of the second author's); the three subsets "
        f"then hold N // 3 pairs each where that is fewer than {SUBSET_PAIRS} (a short run: tests/eval/test_eval_real.py)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--dual-max-new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=32, help="prompts generated together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_steering")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    parser.add_argument("--fresh", action="store_true", help="discard earlier records instead of resuming")
    parser.add_argument("--report-only", action="store_true", help="redo summary, table and plots from OUT's records")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.pairs is not None and args.pairs < 3:
        parser.error("--pairs: at least 3 (one pair in each of the three subsets)")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = {name: args.out / f"{name}.jsonl" for name in ("generations", "dual")}
    settings = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "dual_max_new_tokens": args.dual_max_new_tokens, "seed": args.seed}
    settings |= {"pairs": args.pairs} if args.pairs is not None else {}  # the directions differ; the full run's settings name none
    settings_path = args.out / "settings.json"
    if args.fresh or not settings_path.exists():
        for path in paths.values():
            discard_records(path)
        (args.out / "cosines.json").write_text("[]\n")
        settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    elif json.loads(settings_path.read_text()) != settings:
        raise SystemExit(f"{args.out} was made with settings {settings_path.read_text().strip()}, not {settings}: pass --fresh")
    sets = prompt_sets(args.limit)
    _, held_out = frozen_split(load_rows())
    dual_rows = held_out[: args.dual_limit]
    started = time.perf_counter()
    if not args.report_only:
        cosines = json.loads((args.out / "cosines.json").read_text())
        for name in args.models:
            lm = load_model(name, device="cpu", progress=False)
            log(f"{name} loaded: {model_layers(lm)} layers, thirds {thirds(model_layers(lm))}")
            prefilled: Prefilled = {}  # each pair text prefilled once, for every direction and the cosines' nulls
            packs = build_directions(lm, prefilled, args.pairs)
            if "directions" in args.parts:
                cosines = [c for c in cosines if c["model"] != lm.name] + [direction_cosines(lm, packs, args.seed, prefilled, args.pairs)]
                (args.out / "cosines.json").write_text(json.dumps(cosines, indent=2) + "\n")
            del prefilled
            done = {(r["condition"], r["set"], r["index"]) for r in read_jsonl(paths["generations"]) if r["model"] == lm.name}
            todo = []
            compared = set(args.parts) & {"layers", "pairs", "directions", "keys", "diagnosis"}
            references = set(REFERENCES) if compared else set()  # what those parts compare with
            for condition in conditions():
                wanted = args.conditions is None or condition.name in args.conditions
                if condition.part in args.parts and wanted or condition.name in references:
                    prompts = [p for prompts in sets.values() for p in prompts if (condition.name, p.set, p.index) not in done]
                    if prompts:
                        todo.append((condition, prompts))
            run_conditions(lm, todo, packs, args.max_new_tokens, args.batch, jsonl_appender(paths["generations"]))
            if "dual" in args.parts:
                done_dual = {(r["id"], r["alpha"]) for r in read_jsonl(paths["dual"]) if r["model"] == lm.name}
                run_dual(lm, dual_rows, packs, args.dual_max_new_tokens, args.compare, done_dual, jsonl_appender(paths["dual"]), args.dual_alphas)
    about = {
        "settings": settings,
        "wall_seconds_last_run": round(time.perf_counter() - started, 1),
        "machine": machine_description({}),
        "source": source_description(),
    }
    cosines = json.loads((args.out / "cosines.json").read_text())
    print(write_report(read_jsonl(paths["generations"]), read_jsonl(paths["dual"]), cosines, args.out, args.figures, about))
    return 0


if __name__ == "__main__":
    sys.exit(main())
