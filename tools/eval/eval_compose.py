"""Composition of knowledge packs on ckc_dev (the paper's Tables 2 and 5, compose time, errata), per model.

Every ckc paragraph is one pack of one fact (as in tools/eval/eval_packs.py); distractors are other rows'
paragraphs. Questions are taken from the held-out half of the frozen split (tools/data/ckc_split.json)
first, then from the tuning half when more are asked for; distractors and erratum replacements
come from all 600 rows. Every random choice is seeded by ``--seed`` and the row id, so a resumed or
repeated run asks the same thing. Five parts (``--parts``), greedy, ``--max-new-tokens`` tokens:

accumulation (Table 2, as the paper runs it): questions in groups of ``--acc-golds``; a group's parts
    are its questions' own paragraphs and ``--acc-distractors`` paragraphs none of them is about, in
    one seeded order, each its own pack. Step k composes the first k parts exactly, in order
    (``compose_exact`` from the first part: only the later parts are prefilled), and asks every
    question of the group: knowledge accumulates, a question becomes answerable at the step its
    paragraph arrives, so accuracy over all questions rises with k and levels off once every
    paragraph is in. The composed pack and the same paragraphs as prompt text must generate identical
    token ids; prompt tokens per question each way give the savings 1 - pack / text.
modes (Table 5): at k = ``--modes-parts`` (the same arrangement as accumulation at that k), the
    gold pack alone, the exact composition, and the parts spliced with RoPE re-positioning and
    naively; rope and naive are compared with exact on the first answer token (cosine of the
    softmax probability vectors, and of the raw logits; same argmax) and on the whole answer
    (identical generated ids).
timing: ``--timing-parts`` parts of consecutive ckc paragraphs, about ``--timing-tokens`` in all,
    composed exactly (the later parts prefilled) and spliced with RoPE (no part prefilled), timed in
    the same run, median of ``--timing-repeats`` (1 when one exact composition exceeds
    ``--timing-budget`` seconds).
errata: a paragraph's pack amended (``amend``) with its sentence that holds the answer A, with A
    replaced by another row's answer B; does the answer follow the erratum (B), the original (A),
    both, or neither? Answered with the base pack, the amended pack, and the amended facts as text
    (pack and text must generate identical ids).
diagnosis: on the first ``--diag-limit`` modes questions, where the RoPE splice departs from exact: the
    splice with exact's K/V put back at one place at a time (sliding-window layers, full-attention
    layers, the gold paragraph's tokens, the other paragraphs', the template's), each compared with
    exact on exact's answer tokens (``PATCHES``).

Outputs in ``--out``: one JSON line per record per part (accumulation.jsonl, modes.jsonl,
timing.jsonl, errata.jsonl, diagnosis.jsonl, appended as each is done), settings.json, summary.json, table.md; PNGs
in ``--figures``. A part resumes: records already there are not redone (``--fresh`` empties the
parts being run; other settings than recorded are refused). Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.eval.eval_compose [--models smollm2-135m gemma3-270m] [--parts modes,errata]

Progress goes to stderr; torch runs one intra-op thread (``--threads``, see tools/eval/eval_packs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from packstore.kv.build import build_pack  # noqa: E402
from packstore.kv.compose import Composition, amend, compose_exact, splice  # noqa: E402
from packstore.kv.inject import Sampling, answer_with_pack, answer_with_text, cache_from_pack, forced_logits, prepare  # noqa: E402
from packstore.kv.models import LoadedModel, load_model  # noqa: E402
from packstore.kv.render import group_spans  # noqa: E402
from packstore.packs.tensors import Pack  # noqa: E402
from tools.eval.eval_packs import scored  # noqa: E402
from tools.lib.benchlib import logger, machine_description, median, source_description, timed  # noqa: E402
from tools.lib.evallib import (  # noqa: E402
    METRICS,
    REPO,
    Interval,
    Row,
    answer_scores,
    contains_answer,
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
    normalize,
    paired_difference,
    parts_type,
    proportion_interval,
    read_jsonl,
    resumed_records,
)

MODELS = ("smollm2-135m", "gemma3-270m")
PARTS = ("accumulation", "modes", "timing", "errata", "diagnosis")
MODES = {"single": "gold pack alone", "exact": "sequential (exact)", "rope": "RoPE splice", "naive": "naive splice"}
SPLICED = ("rope", "naive")
# the RoPE splice with exact K/V put back in one place: where it recovers exact's answer distribution, the splice's error lives
PATCHES = {
    "none": "RoPE splice",
    "sliding": "+ exact K/V, sliding-window layers",
    "full": "+ exact K/V, full-attention layers",
    "gold": "+ exact K/V, gold paragraph's tokens",
    "others": "+ exact K/V, the other paragraphs' tokens",
    "framing": "+ exact K/V, template tokens (outside paragraphs)",
}
FOLLOWS = {"erratum": "erratum (B)", "original": "original (A)", "both": "both", "neither": "neither"}
ROWS_NOTE = "questions: held-out half of tools/data/ckc_split.json first, then the tuning half; distractors: all other rows"
MAX_ERRATUM_WORDS = 80  # a longer "sentence" is a flattened table or list, not a correction
_SENTENCE_END = re.compile(r"(?<= [.!?]) +")  # ckc text is tokenised: a sentence ends with " ." (not "D. Fink")
log = logger("eval_compose")


# ---- pure helpers: which rows, which distractors, which errata ----


def question_order(rows: Sequence[Row]) -> list[Row]:
    """The rows in the order questions are taken: held-out half of the frozen split, then the tuning half."""
    tuning, held_out = frozen_split(rows)
    return held_out + tuning


def accumulation_groups(rows: Sequence[Row], pool: Sequence[Row], golds: int, distractors: int, seed: int) -> list[tuple[list[Row], list[Row]]]:
    """Consecutive groups of ``golds`` questions (in ``rows`` order, a last short group dropped), each with its parts:
    the questions' own paragraphs (once each) and ``distractors`` other paragraphs that hold none of the group's
    answers, in one order seeded by the group's questions."""
    groups = []
    for start in range(0, len(rows) - golds + 1, golds):
        questions = list(rows[start : start + golds])
        own = list({row.context: row for row in questions}.values())
        contexts = {row.context for row in questions}
        candidates = [
            other for other in pool if other.context not in contexts and not any(contains_answer(other.context, row.answers) for row in questions)
        ]
        rng = random.Random(f"{seed}:accumulation:{','.join(row.id for row in questions)}")
        parts = own + rng.sample(candidates, distractors)
        rng.shuffle(parts)
        groups.append((questions, parts))
    return groups


def arrangement(row: Row, pool: Sequence[Row], k: int, seed: int) -> tuple[list[Row], int]:
    """The k parts for ``row`` and the gold part's index: ``row`` among the first k-1 rows of a seeded
    shuffle of the other rows of ``pool`` (so the parts of step k+1 extend those of step k), at a
    seeded position."""
    others = [other for other in pool if other.id != row.id and other.context != row.context]
    if k - 1 > len(others):
        raise ValueError(f"{k} parts need {k - 1} distractors; the pool has {len(others)}")
    random.Random(f"{seed}:distractors:{row.id}").shuffle(others)
    position = random.Random(f"{seed}:position:{row.id}:{k}").randrange(k)
    parts = others[: k - 1]
    parts.insert(position, row)
    return parts, position


def _words(phrase: str) -> re.Pattern:
    """``phrase`` verbatim, not inside a longer word."""
    return re.compile(rf"(?<!\w){re.escape(phrase)}(?!\w)")


@dataclasses.dataclass(frozen=True)
class ErratumCase:
    """A row whose answer ``original`` is replaced by ``replacement`` in one of its sentences."""

    row: Row
    original: str
    replacement: str
    erratum: str


def _replacement(row: Row, original: str, pool: Sequence[Row], seed: int) -> str | None:
    """Another row's answer that differs from ``original`` (neither contains the other as words), is in
    neither the paragraph nor the question, and has digits exactly when ``original`` has; seeded."""
    candidates = [answer for other in pool if other.id != row.id for answer in other.answers[:1]]
    random.Random(f"{seed}:replacement:{row.id}").shuffle(candidates)
    has_digit = any(c.isdigit() for c in original)
    for candidate in candidates:
        if (
            normalize(candidate)
            and any(c.isdigit() for c in candidate) == has_digit
            and not contains_answer(candidate, [original])
            and not contains_answer(original, [candidate])
            and not contains_answer(row.context, [candidate])
            and not contains_answer(row.question, [candidate])
        ):
            return candidate
    return None


def erratum_case(row: Row, pool: Sequence[Row], seed: int) -> ErratumCase | str:
    """The erratum case of ``row``, or why there is none: its first answer A found verbatim in a sentence
    of at most MAX_ERRATUM_WORDS words, that sentence with A replaced by another row's answer B."""
    original = row.answers[0]
    pattern = _words(original)
    sentence = next((s for s in _SENTENCE_END.split(row.context) if pattern.search(s)), None)
    if sentence is None:
        return "answer not in a sentence"
    if len(sentence.split()) > MAX_ERRATUM_WORDS:
        return f"sentence over {MAX_ERRATUM_WORDS} words"
    replacement = _replacement(row, original, pool, seed)
    if replacement is None:
        return "no replacement answer"
    return ErratumCase(row, original, replacement, pattern.sub(lambda _: replacement, sentence).strip())


def errata_cases(rows: Sequence[Row], pool: Sequence[Row], count: int, seed: int) -> tuple[list[ErratumCase], dict[str, int]]:
    """The first ``count`` erratum cases in ``rows``, and how many rows were skipped before them, by reason."""
    cases: list[ErratumCase] = []
    skipped: dict[str, int] = {}
    for row in rows:
        if len(cases) == count:
            break
        case = erratum_case(row, pool, seed)
        if isinstance(case, str):
            skipped[case] = skipped.get(case, 0) + 1
        else:
            cases.append(case)
    return cases, skipped


def follows(answer: str, case: ErratumCase) -> str:
    """Which of the two answers ``answer`` gives: a key of FOLLOWS."""
    new, old = contains_answer(answer, [case.replacement]), contains_answer(answer, [case.original])
    return "both" if new and old else "erratum" if new else "original" if old else "neither"


def fill_parts(texts: Sequence[str], lengths: Sequence[int], parts: int, tokens_per_part: int) -> list[list[str]]:
    """``parts`` groups of consecutive ``texts``, each taking texts until its ``lengths`` reach ``tokens_per_part``."""
    groups: list[list[str]] = []
    items = iter(zip(texts, lengths))
    for _ in range(parts):
        group, size = [], 0
        while size < tokens_per_part:
            try:
                text, length = next(items)
            except StopIteration:
                raise ValueError(f"not enough text for {parts} parts of {tokens_per_part} tokens") from None
            group.append(text)
            size += length
        groups.append(group)
    return groups


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two vectors (in float64)."""
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def fraction(values: Iterable[bool]) -> Interval:
    """The share of true values, with its Wilson 95% interval."""
    return proportion_interval(values)


# ---- results directory: one jsonl per part, resumable ----


def read_records(out: Path, part: str) -> list[dict]:
    """OUT/PART.jsonl as a list (empty when absent)."""
    return read_jsonl(out / f"{part}.jsonl")


def appender(out: Path, part: str) -> Callable[[dict], None]:
    """A function appending one record to OUT/PART.jsonl (flushed, so a stopped run keeps it)."""
    return jsonl_appender(out / f"{part}.jsonl")


# ---- the four parts ----


def composed(lm: LoadedModel, packs: Sequence[Pack]) -> Composition:
    """The exact composition of ``packs`` in order; one pack is its own composition (nothing prefilled)."""
    if len(packs) == 1:
        return Composition(pack=packs[0], reused_tokens=packs[0].header.tokens, prefilled_tokens=0)
    return compose_exact(lm, packs[0], [pack.header for pack in packs[1:]])


def answer_logits(lm: LoadedModel, pack: Pack, question: str, answer_ids: Sequence[int]) -> torch.Tensor:
    """Teacher-forced logits with ``pack`` injected: row i predicts ``answer_ids[i]`` after the question and the answer's
    first i tokens ([max(len(answer_ids), 1), vocabulary]; row 0 is the first answer token's distribution)."""
    return forced_logits(lm, prepare(lm, pack.header, question).token_ids, answer_ids, cache_from_pack(pack, lm.device))


def answer_agreement(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far teacher-forced answer logits are from the reference's on the same tokens: the mean over answer tokens of
    KL(reference || these) in nats, the share of tokens whose top-1 agrees, and, for the first token, the cosines of
    the probabilities and of the raw logits (the earlier headline, which hardly separates the modes)."""
    log_p, log_q = torch.log_softmax(reference.double(), -1), torch.log_softmax(logits.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "answer_kl": float(kl.mean()),
        "answer_top1": float((logits.argmax(-1) == reference.argmax(-1)).double().mean()),
        "answer_tokens": int(logits.shape[0]),
        "prob_cosine": cosine(logits[0].softmax(-1), reference[0].softmax(-1)),
        "logit_cosine": cosine(logits[0], reference[0]),
        "same_first_token": int(logits[0].argmax()) == int(reference[0].argmax()),
    }


def _progress(lm: LoadedModel, part: str, index: int, total: int, started: float) -> None:
    if index % 10 == 0 or index == total:
        log(f"{lm.name} {part}: {index}/{total}, {(time.perf_counter() - started) / index:.2f} s each")


def _arranged(lm: LoadedModel, row: Row, k: int, position: int, parts: Sequence[Row]) -> dict:
    """The fields every accumulation and modes record starts with: model, question, arrangement."""
    return {"model": lm.name, "id": row.id, "k": k, "gold_position": position, "parts": [part.id for part in parts]}


def run_accumulation(
    lm: LoadedModel, groups: Sequence[tuple[list[Row], list[Row]]], sampling: Sampling, done: set, keep: Callable[[dict], None]
) -> None:
    """One record per question and step k not in ``done`` ((id, k) pairs): the first k parts of its group composed,
    whether its own paragraph is among them, the composed pack and the same paragraphs as text, their answers, scores,
    prompt tokens, and whether their ids differ."""
    started = time.perf_counter()
    for index, (questions, parts) in enumerate(groups, 1):
        packs = {part.id: build_pack(lm, [part.context]) for part in parts}
        for k in range(1, len(parts) + 1):
            asked = [row for row in questions if (row.id, k) not in done]
            if not asked:
                continue
            composition = composed(lm, [packs[part.id] for part in parts[:k]])
            for row in asked:
                with_pack = answer_with_pack(lm, composition.pack, row.question, sampling)
                with_text = answer_with_text(lm, list(composition.pack.header.facts), row.question, sampling=sampling)
                position = next(i for i, part in enumerate(parts) if part.context == row.context)
                keep(
                    {"model": lm.name, "id": row.id, "group": questions[0].id, "k": k, "gold_position": position}
                    | {"parts": [part.id for part in parts[:k]], "gold_included": position < k}
                    | {
                        "composed_tokens": composition.pack.header.tokens,
                        "prefilled_tokens": composition.prefilled_tokens,
                        "reused_tokens": composition.reused_tokens,
                        "divergent": with_pack.token_ids != with_text.token_ids,
                        "pack": scored(with_pack.text, with_pack.prompt_tokens, row),
                        "text": scored(with_text.text, with_text.prompt_tokens, row),
                    }
                )
        _progress(lm, "accumulation", index, len(groups), started)


def run_modes(
    lm: LoadedModel, rows: Sequence[Row], pool: Sequence[Row], k: int, seed: int, sampling: Sampling, keep: Callable[[dict], None]
) -> None:
    """One record per question: each mode's answer and scores, and rope and naive against exact: on the distributions
    over exact's answer tokens (teacher-forced, ``answer_agreement``) and on the generated ids."""
    started = time.perf_counter()
    for index, row in enumerate(rows, 1):
        parts, position = arrangement(row, pool, k, seed)
        packs = [build_pack(lm, [part.context]) for part in parts]
        compositions = {
            "exact": composed(lm, packs),
            **{mode: splice(lm, packs, mode) for mode in SPLICED},
        }
        answers = {"single": answer_with_pack(lm, packs[position], row.question, sampling)}
        answers |= {mode: answer_with_pack(lm, c.pack, row.question, sampling) for mode, c in compositions.items()}
        logits = {mode: answer_logits(lm, c.pack, row.question, answers["exact"].token_ids) for mode, c in compositions.items()}
        conditions = {mode: scored(answer.text, answer.prompt_tokens, row) for mode, answer in answers.items()}
        for mode, composition in compositions.items():
            conditions[mode] |= {"prefilled_tokens": composition.prefilled_tokens, "composed_tokens": composition.pack.header.tokens}
        agreement = {
            mode: answer_agreement(logits[mode], logits["exact"]) | {"same_tokens": answers[mode].token_ids == answers["exact"].token_ids}
            for mode in SPLICED
        }
        keep(_arranged(lm, row, k, position, parts) | {"conditions": conditions, "agreement": agreement})
        _progress(lm, "modes", index, len(rows), started)


def layer_types(lm: LoadedModel) -> list[str]:
    """Each layer's attention type as the config states it ("sliding_attention" / "full_attention"); all full when
    the config names none (Llama)."""
    config = lm.model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return list(getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers)


def patched(spliced: Pack, exact: Pack, layers: Iterable[int], positions: Sequence[int]) -> Pack:
    """``spliced`` with the keys and values of ``layers`` at token ``positions`` taken from ``exact``."""
    keys, values = list(spliced.keys), list(spliced.values)
    index = torch.tensor(list(positions), dtype=torch.long)
    for layer in layers:
        keys[layer], values[layer] = keys[layer].clone(), values[layer].clone()
        keys[layer][:, index], values[layer][:, index] = exact.keys[layer][:, index], exact.values[layer][:, index]
    return Pack(spliced.header, keys, values)


def patch_sites(lm: LoadedModel, parts: Sequence[Pack], position: int, tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """Per patch of ``PATCHES`` (bar "none"): the (layers, token positions) it takes from exact; the sliding-window patch
    only where the model has such layers, the gold and other-paragraph patches only for their parts after the first
    (the first part's tokens are exact in a splice already)."""
    kinds = layer_types(lm)
    every_layer, every_token = list(range(len(kinds))), list(range(tokens))
    _, spans = group_spans(lm.tokenizer, [part.header.facts for part in parts])
    inside = {i: list(range(*span)) for i, span in enumerate(spans)}
    sites = {
        "sliding": ([i for i, kind in enumerate(kinds) if kind == "sliding_attention"], every_token),
        "full": ([i for i, kind in enumerate(kinds) if kind == "full_attention"], every_token),
        "gold": (every_layer, inside[position] if position > 0 else []),
        "others": (every_layer, [t for i, span in inside.items() if i not in (0, position) for t in span]),
        "framing": (every_layer, sorted(set(every_token) - {t for span in inside.values() for t in span})),
    }
    return {name: site for name, site in sites.items() if site[0] and site[1]}


def run_diagnosis(
    lm: LoadedModel, rows: Sequence[Row], pool: Sequence[Row], k: int, seed: int, sampling: Sampling, keep: Callable[[dict], None]
) -> None:
    """One record per question, arranged as in ``run_modes``: the RoPE splice and each patch of it (``PATCHES``)
    against exact on exact's answer tokens (``answer_agreement``), to locate what the splice gets wrong."""
    started = time.perf_counter()
    for index, row in enumerate(rows, 1):
        parts, position = arrangement(row, pool, k, seed)
        packs = [build_pack(lm, [part.context]) for part in parts]
        exact, spliced = composed(lm, packs).pack, splice(lm, packs, "rope").pack
        if list(exact.header.token_ids) != list(spliced.header.token_ids):
            raise SystemExit(f"{row.id}: the splice and the exact composition render different tokens")
        answer = answer_with_pack(lm, exact, row.question, sampling).token_ids
        reference = answer_logits(lm, exact, row.question, answer)
        variants = {"none": spliced}
        variants |= {
            name: patched(spliced, exact, layers, positions)
            for name, (layers, positions) in patch_sites(lm, packs, position, exact.header.tokens).items()
        }
        agreement = {name: answer_agreement(answer_logits(lm, pack, row.question, answer), reference) for name, pack in variants.items()}
        keep(_arranged(lm, row, k, position, parts) | {"agreement": agreement})
        _progress(lm, "diagnosis", index, len(rows), started)


def run_timing(
    lm: LoadedModel, rows: Sequence[Row], targets: Sequence[int], parts: int, repeats: int, budget: float, keep: Callable[[dict], None]
) -> None:
    """One record per target size: seconds of ``compose_exact`` and of ``splice(mode="rope")`` on the same
    parts, alternating, and the tokens each prefilled."""
    texts = [row.context for row in rows]
    lengths = [len(lm.tokenizer(text, add_special_tokens=False).input_ids) + 1 for text in texts]  # + the "\n"
    for target in targets:
        groups = fill_parts(texts, lengths, parts, target // parts)
        build_seconds, packs = timed(lambda groups=groups: [build_pack(lm, group) for group in groups])
        log(f"{lm.name} timing {target}: {parts} parts built ({sum(p.header.tokens for p in packs)} tokens) in {build_seconds:.1f} s")
        seconds: dict[str, list[float]] = {"exact": [], "rope": []}
        results: dict[str, Composition] = {}
        for _ in range(repeats):
            gc.collect()
            elapsed, results["exact"] = timed(lambda packs=packs: composed(lm, packs))
            seconds["exact"].append(elapsed)
            gc.collect()
            elapsed, results["rope"] = timed(lambda packs=packs: splice(lm, packs, "rope"))
            seconds["rope"].append(elapsed)
            if seconds["exact"][0] > budget:
                break
        exact, rope = median(seconds["exact"]), median(seconds["rope"])
        log(f"{lm.name} timing {target}: exact {exact:.2f} s, rope {rope:.2f} s ({len(seconds['exact'])} repeats)")
        keep(
            {
                "model": lm.name,
                "target_tokens": target,
                "parts": parts,
                "part_tokens": [pack.header.tokens for pack in packs],
                "composed_tokens": results["exact"].pack.header.tokens,
                "same_token_ids": results["exact"].pack.header.token_ids == results["rope"].pack.header.token_ids,
                "repeats": len(seconds["exact"]),
                "build_seconds": build_seconds,
                "seconds": seconds,
                "median_seconds": {"exact": exact, "rope": rope},
                "prefilled_tokens": {mode: result.prefilled_tokens for mode, result in results.items()},
            }
        )


def run_errata(lm: LoadedModel, cases: Sequence[ErratumCase], sampling: Sampling, keep: Callable[[dict], None]) -> None:
    """One record per case: the answers with the base pack, the amended pack and the amended facts as text."""
    started = time.perf_counter()
    for index, case in enumerate(cases, 1):
        row = case.row
        base = build_pack(lm, [row.context])
        amended = amend(lm, base, case.erratum)
        answers = {
            "before": answer_with_pack(lm, base, row.question, sampling),
            "after": answer_with_pack(lm, amended.pack, row.question, sampling),
            "text": answer_with_text(lm, list(amended.pack.header.facts), row.question, sampling=sampling),
        }
        keep(
            {
                "model": lm.name,
                "id": row.id,
                "question": row.question,
                "original": case.original,
                "replacement": case.replacement,
                "erratum": case.erratum,
                "prefilled_tokens": amended.prefilled_tokens,
                "divergent": answers["after"].token_ids != answers["text"].token_ids,
                **{name: {"answer": a.text, "follows": follows(a.text, case)} for name, a in answers.items()},
            }
        )
        _progress(lm, "errata", index, len(cases), started)


# ---- summaries, tables and figures ----


def _by_model(records: Sequence[dict]) -> dict[str, list[dict]]:
    return {model: [r for r in records if r["model"] == model] for model in dict.fromkeys(r["model"] for r in records)}


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarize_accumulation(records: Sequence[dict]) -> dict:
    """Per model and k: each of ``METRICS`` with pack and text (recomputed from the answers), contains with the pack
    among the questions whose own paragraph is in the context and among those whose is not, identical share, prompt
    tokens, savings, composed tokens."""
    summary: dict = {}
    golds = gold_answers()
    for model, mine in _by_model(records).items():
        summary[model] = {}
        for k in sorted({r["k"] for r in mine}):
            at = [r for r in mine if r["k"] == k]
            pack_tokens, text_tokens = _mean(r["pack"]["prompt_tokens"] for r in at), _mean(r["text"]["prompt_tokens"] for r in at)
            summary[model][str(k)] = {
                "questions": len(at),
                "gold_included": _mean(r.get("gold_included", True) for r in at),  # records before issue 39: always
                **{
                    f"{metric}_{way}": interval
                    for way in ("pack", "text")
                    for metric, interval in metric_intervals([r[way]["answer"] for r in at], [golds[r["id"]] for r in at]).items()
                },
                **{
                    f"contains_pack_{side}": metric_intervals([r["pack"]["answer"] for r in split], [golds[r["id"]] for r in split])["contains"]
                    for side, split in (
                        ("own_in", [r for r in at if r.get("gold_included", True)]),
                        ("own_out", [r for r in at if not r.get("gold_included", True)]),
                    )
                    if split
                },
                "identical": sum(not r["divergent"] for r in at) / len(at),
                "divergences": sum(r["divergent"] for r in at),
                "prompt_tokens_pack": pack_tokens,
                "prompt_tokens_text": text_tokens,
                "savings": 1 - pack_tokens / text_tokens,
                "composed_tokens": _mean(r["composed_tokens"] for r in at),
                "prefilled_tokens": _mean(r["prefilled_tokens"] for r in at),
            }
    return summary


def summarize_modes(records: Sequence[dict]) -> dict:
    """Per model: each mode's ``METRICS`` (recomputed from the answers) and prefilled tokens; rope and naive against exact."""
    summary: dict = {}
    golds = gold_answers()
    for model, mine in _by_model(records).items():
        modes = {}
        for mode in MODES:
            scores = [r["conditions"][mode] for r in mine]
            modes[mode] = metric_intervals([s["answer"] for s in scores], [golds[r["id"]] for r in mine])
            if "prefilled_tokens" in scores[0]:
                modes[mode] |= {
                    "prefilled_tokens": _mean(s["prefilled_tokens"] for s in scores),
                    "composed_tokens": _mean(s["composed_tokens"] for s in scores),
                }
        scores = {mode: [answer_scores(r["conditions"][mode]["answer"], golds[r["id"]]) for r in mine] for mode in MODES}
        agreement = {}
        for mode in SPLICED:
            measured = [r["agreement"][mode] for r in mine]
            agreement[mode] = {
                "prob_cosine": mean_interval([a["prob_cosine"] for a in measured]),
                "logit_cosine": mean_interval([a["logit_cosine"] for a in measured]),
                "same_first_token": fraction(a["same_first_token"] for a in measured),
                "same_tokens": fraction(a["same_tokens"] for a in measured),
                **{  # paired against exact on the same questions
                    f"{metric}_minus_exact": paired_difference([x[metric] for x in scores[mode]], [x[metric] for x in scores["exact"]])
                    for metric in ("contains", "f1")
                },
            }
            if all("answer_kl" in a for a in measured):  # records made before issue 39 have the first token's only
                agreement[mode] |= {key: mean_interval([a[key] for a in measured]) for key in ("answer_kl", "answer_top1")}
        if all("answer_kl" in agreement[mode] for mode in SPLICED):
            agreement["naive_minus_rope_kl"] = paired_difference(
                [r["agreement"]["naive"]["answer_kl"] for r in mine], [r["agreement"]["rope"]["answer_kl"] for r in mine]
            )
        summary[model] = {"questions": len(mine), "k": mine[0]["k"], "modes": modes, "agreement": agreement}
    return summary


def summarize_diagnosis(records: Sequence[dict]) -> dict:
    """Per model and patch: first-token agreement, answer-token KL and top-1 against exact over the questions that
    patch applies to, with its paired gain over the plain splice on the same questions."""
    summary: dict = {}
    for model, mine in _by_model(records).items():
        summary[model] = {}
        for name in PATCHES:
            have = [r["agreement"] for r in mine if name in r["agreement"]]
            if not have:
                continue
            same = [float(a[name]["same_first_token"]) for a in have]
            summary[model][name] = {
                "questions": len(have),
                "same_first_token": proportion_interval(same),
                "answer_kl": mean_interval([a[name]["answer_kl"] for a in have]),
                "answer_top1": mean_interval([a[name]["answer_top1"] for a in have]),
                "same_first_minus_splice": paired_difference(same, [float(a["none"]["same_first_token"]) for a in have]),
                "kl_minus_splice": paired_difference([a[name]["answer_kl"] for a in have], [a["none"]["answer_kl"] for a in have]),
            }
    return summary


def diagnosis_table(summary: dict) -> str:
    """One line per model and patch."""
    headers = ["model", "RoPE splice", "questions", "same 1st token as exact % [95% CI]", "KL to exact, answer tokens (nats)"]
    headers += ["top-1 agrees, answer tokens %", "same 1st token - splice (paired)", "KL - splice (paired)"]
    tested = [s[key] for patches in summary.values() for name, s in patches.items() if name != "none"
              for key in ("same_first_minus_splice", "kl_minus_splice")]
    adjusted = dict(zip(map(id, tested), holm([t.p for t in tested])))
    lines = []
    for model, patches in summary.items():
        for name, s in patches.items():
            kl, gain = s["answer_kl"], s["kl_minus_splice"]
            paired = ["-", "-"]
            if name != "none":
                first = s["same_first_minus_splice"]
                paired = [_with_p(_signed(first), first, adjusted), _with_p(f"{gain.mean:+.4f} [{gain.low:+.4f}, {gain.high:+.4f}]", gain, adjusted)]
            lines.append(
                [model, PATCHES[name], str(s["questions"]), s["same_first_token"].percent(), f"{kl.mean:.4f} [{kl.low:.4f}, {kl.high:.4f}]"]
                + [s["answer_top1"].percent(), *paired]
            )
    note = (
        "each patch puts the exact composition's K/V back into the RoPE splice at one place; paired differences on the questions "
        "it applies to (the gold and other-paragraph patches skip paragraphs in first place, which a splice keeps exact); same 1st "
        f"token: Wilson interval; paired: 95% paired bootstrap, p two-sided from it, Holm over the family of all {len(tested)} paired "
        "differences in this table"
    )
    return markdown_table(headers, lines, left=2) + "\n\n" + note


def summarize_timing(records: Sequence[dict]) -> dict:
    """Per model and target size: the timing record with the exact/rope ratio."""
    return {
        model: {
            str(r["target_tokens"]): {
                key: r[key] for key in ("composed_tokens", "part_tokens", "repeats", "median_seconds", "prefilled_tokens", "same_token_ids")
            }
            | {"ratio_exact_to_rope": r["median_seconds"]["exact"] / r["median_seconds"]["rope"]}
            for r in sorted(mine, key=lambda r: r["target_tokens"])
        }
        for model, mine in _by_model(records).items()
    }


def summarize_errata(records: Sequence[dict]) -> dict:
    """Per model: for the base pack, the amended pack and the text, the share following each answer; divergences."""
    return {
        model: {
            "cases": len(mine),
            "divergences": sum(r["divergent"] for r in mine),
            "prefilled_tokens": _mean(r["prefilled_tokens"] for r in mine),
            **{
                name: {outcome: fraction(r[name]["follows"] == outcome for r in mine) for outcome in FOLLOWS}
                for name in ("before", "after", "text")
            },
        }
        for model, mine in _by_model(records).items()
    }


def accumulation_table(summary: dict) -> str:
    """One line per model and k."""
    headers = ["model", "k", "questions", "own paragraph in the context %"]
    headers += [*(f"{name} {way} %" for name in METRICS.values() for way in ("pack", "text"))]
    headers += ["contains pack, own paragraph in %", "contains pack, own paragraph out %", "identical ids"]
    headers += ["prompt tokens pack", "prompt tokens text", "savings", "composed: prefilled / total tokens"]
    lines = []
    for model, steps in summary.items():
        for k, s in steps.items():
            scores = [s[f"{metric}_{way}"].percent() for metric in METRICS for way in ("pack", "text")]
            scores += [s[f"contains_pack_{side}"].percent() if f"contains_pack_{side}" in s else "-" for side in ("own_in", "own_out")]
            identical = f"{100 * s['identical']:.0f} % ({s['divergences']} div.)"
            tokens = [f"{s['prompt_tokens_pack']:.1f}", f"{s['prompt_tokens_text']:.1f}", f"{100 * s['savings']:.1f} %"]
            composition = f"{s['prefilled_tokens']:.0f} / {s['composed_tokens']:.0f}"
            lines.append([model, k, str(s["questions"]), f"{100 * s['gold_included']:.0f}", *scores, identical, *tokens, composition])
    return markdown_table(headers, lines, left=2)


def modes_table(summary: dict) -> str:
    """One line per model and mode; rope and naive with their agreement with exact."""
    headers = ["model", "mode", "questions", *metric_headers(), "prefilled / total tokens"]
    headers += ["KL to exact, answer tokens (nats)", "top-1 agrees, answer tokens %", "same 1st token %", "same answer ids %"]
    headers += ["contains - exact (paired)", "F1 - exact (paired)", "prob. cosine 1st token", "logit cosine 1st token"]
    tested = [s["agreement"][mode][key] for s in summary.values() for mode in SPLICED if mode in s["agreement"]
              for key in ("contains_minus_exact", "f1_minus_exact")]
    tested += [s["agreement"]["naive_minus_rope_kl"] for s in summary.values() if "naive_minus_rope_kl" in s["agreement"]]
    adjusted = dict(zip(map(id, tested), holm([t.p for t in tested])))
    lines = []
    for model, s in summary.items():
        for mode, label in MODES.items():
            scores = s["modes"][mode]
            tokens = f"{scores['prefilled_tokens']:.0f} / {scores['composed_tokens']:.0f}" if "prefilled_tokens" in scores else "-"
            versus = ["-"] * 8
            if agreement := s["agreement"].get(mode):
                kl = agreement.get("answer_kl")
                versus = [f"{kl.mean:.4f} [{kl.low:.4f}, {kl.high:.4f}]" if kl else "-"]
                versus += [agreement["answer_top1"].percent() if "answer_top1" in agreement else "-"]
                versus += [agreement["same_first_token"].percent(), agreement["same_tokens"].percent()]
                versus += [_with_p(_signed(agreement[key]), agreement[key], adjusted) for key in ("contains_minus_exact", "f1_minus_exact")]
                versus += [f"{agreement['prob_cosine'].mean:.4f}", f"{agreement['logit_cosine'].mean:.4f}"]
            lines.append([model, label, str(s["questions"]), *(scores[m].percent() for m in METRICS), tokens, *versus])
    notes = []
    for model, s in summary.items():
        note = (
            f"{model}: k = {s['k']} paragraphs (gold + {s['k'] - 1} distractors); KL and top-1 are teacher-forced on exact's "
            "answer tokens, means over questions; contains, same 1st token and same answer ids: Wilson intervals; paired "
            "differences are in points with 95% paired bootstrap intervals"
        )
        if gap := s["agreement"].get("naive_minus_rope_kl"):
            note += "; naive - rope KL: " + _with_p(f"{gap.mean:+.4f} [{gap.low:+.4f}, {gap.high:+.4f}] nats", gap, adjusted)
        notes.append(note)
    notes.append(f"p: two-sided, from the paired bootstrap; Holm: over the family of all {len(tested)} paired differences in this table")
    return markdown_table(headers, lines, left=2) + "\n\n" + "\n".join(notes)


def _signed(interval: Interval) -> str:
    """A paired difference of shares in points: ``+1.0 [-2.0, +4.0]``."""
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"


def _with_p(cell: str, interval: Interval, adjusted: dict[int, float]) -> str:
    """A paired difference's cell with its p-value and its Holm-adjusted p (``adjusted``: by the interval's id)."""
    return f"{cell}, p {format_p(interval.p)} (Holm {format_p(adjusted[id(interval)])})" if interval.p is not None else cell


def timing_table(summary: dict) -> str:
    """One line per model and target size."""
    headers = ["model", "target tokens", "composed tokens", "parts", "repeats", "exact s", "rope s", "exact / rope"]
    headers += ["prefilled exact", "prefilled rope"]
    lines = []
    for model, sizes in summary.items():
        for target, s in sizes.items():
            seconds, prefilled = s["median_seconds"], s["prefilled_tokens"]
            lines.append(
                [model, target, str(s["composed_tokens"]), " + ".join(map(str, s["part_tokens"])), str(s["repeats"])]
                + [f"{seconds['exact']:.3f}", f"{seconds['rope']:.3f}", f"{s['ratio_exact_to_rope']:.1f}x"]
                + [str(prefilled["exact"]), str(prefilled["rope"])]
            )
    return markdown_table(headers, lines, left=2)


def errata_table(summary: dict) -> str:
    """One line per model and way of answering; divergences below."""
    headers = ["model", "answered with", "cases", *(f"{label} %" for label in FOLLOWS.values())]
    names = {"before": "base pack (no erratum)", "after": "amended pack", "text": "amended facts as text"}
    lines = [
        [model, label, str(s["cases"]), *(s[name][outcome].percent() for outcome in FOLLOWS)]
        for model, s in summary.items()
        for name, label in names.items()
    ]
    notes = [
        f"{model}: divergences amended pack vs text: {s['divergences']} of {s['cases']}; "
        f"the erratum prefilled {s['prefilled_tokens']:.1f} tokens on average"
        for model, s in summary.items()
    ]
    return markdown_table(headers, lines, left=2) + "\n\n" + "\n".join(notes)


TABLES = {
    "accumulation": ("Accumulation (Table 2): gold paragraph + k-1 distractors, composed exactly vs as text", accumulation_table),
    "modes": ("Composition modes (Table 5): rope and naive compared with exact", modes_table),
    "timing": ("Compose time: exact (later parts prefilled) vs RoPE splice, median seconds", timing_table),
    "errata": ("Errata: does the answer follow the correction (B) or the original (A)?", errata_table),
    "diagnosis": ("Where the RoPE splice differs from exact: exact K/V put back one place at a time", diagnosis_table),
}


def plot(summary: dict, figures: Path) -> None:
    """The accumulation, modes and errata PNGs in ``figures``, for the parts that have results."""
    if acc := summary.get("accumulation"):
        ways = {"pack": "composed pack", "text": "text"}

        def per_k(key: str) -> dict:
            return {f"{m} {label}": {f"k={k}": s[f"{key}_{way}"] for k, s in steps.items()} for m, steps in acc.items() for way, label in ways.items()}

        counts = ", ".join(f"{m} n={next(iter(steps.values()))['questions']} per k" for m, steps in acc.items())
        own = {m: {f"k={k}": s["contains_pack_own_in"] for k, s in steps.items() if "contains_pack_own_in" in s} for m, steps in acc.items()}
        panels = {"contains (0-1, 95% CI)": per_k("contains"), "contains with the pack, own paragraph in the context": own,
                  "prompt tokens prefilled per question": per_k("prompt_tokens")}
        grouped_bars(
            figures / "eval_compose_accumulation.png", panels,
            title=f"Accumulation on ckc_dev: the first k parts composed exactly vs the same parts as text ({counts})",
            ylabel={panel: "tokens" if panel.startswith("prompt tokens") else "contains (0-1)" for panel in panels},
        )
    if modes := summary.get("modes"):
        measures = {"answer_top1": "top-1 agrees, answer tokens", "prob_cosine": "prob. cosine, 1st token", "same_first_token": "same 1st token",
                    "same_tokens": "same answer ids"}
        versus = {
            f"{m} {mode}": {label: s["agreement"][mode][key] for key, label in measures.items() if key in s["agreement"][mode]}
            for m, s in modes.items() for mode in SPLICED
        }
        panels = {"contains per mode (95% CI)": {m: {MODES[mode]: s["modes"][mode]["contains"] for mode in MODES} for m, s in modes.items()},
                  "rope and naive vs exact": versus}
        if all("answer_kl" in s["agreement"][mode] for s in modes.values() for mode in SPLICED):  # records since issue 39
            panels["KL to exact over its answer tokens (nats, 95% CI)"] = {
                m: {MODES[mode]: s["agreement"][mode]["answer_kl"] for mode in SPLICED} for m, s in modes.items()
            }
        counts = ", ".join(f"{m} k={s['k']} n={s['questions']}" for m, s in modes.items())
        grouped_bars(
            figures / "eval_compose_modes.png", panels,
            title=f"Composition modes on ckc_dev, gold paragraph + distractors ({counts})",
            ylabel={panel: "nats" if panel.startswith("KL") else "score / share (0-1)" for panel in panels},
        )
    if errata := summary.get("errata"):
        names = {"before": "base pack", "after": "amended pack"}
        shares = {f"{m} {label}": {FOLLOWS[o]: s[name][o] for o in FOLLOWS} for m, s in errata.items() for name, label in names.items()}
        counts = ", ".join(f"{m} n={s['cases']}" for m, s in errata.items())
        grouped_bars(
            figures / "eval_compose_errata.png",
            {"the answer contains": shares},
            title=f"Errata: A replaced by B in a correction line\n({counts})",
            ylabel="share of cases (0-1)",
        )


def write_report(records: dict[str, list[dict]], out: Path, figures: Path, about: dict) -> str:
    """summary.json, table.md and the figures from the parts' records; returns the markdown."""
    summarizers = {"accumulation": summarize_accumulation, "modes": summarize_modes, "timing": summarize_timing, "errata": summarize_errata}
    summarizers["diagnosis"] = summarize_diagnosis
    out.mkdir(parents=True, exist_ok=True)
    summary = {part: summarizers[part](mine) for part, mine in records.items() if mine}
    text = "\n\n".join(f"### {TABLES[part][0]}\n\n{TABLES[part][1](s)}" for part, s in summary.items())
    (out / "summary.json").write_text(json.dumps(about | {"parts": summary}, indent=2, default=dataclasses.asdict) + "\n")
    (out / "table.md").write_text(text + "\n")
    plot(summary, figures)
    return text


# ---- command line ----


def _numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model names or directories")
    parser.add_argument("--parts", type=parts_type(PARTS), default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--limit", type=int, default=200, help="questions per model for modes")
    parser.add_argument("--acc-limit", type=int, default=102, help="accumulation: questions per model, asked at every step")
    parser.add_argument("--acc-golds", type=int, default=3, help="accumulation: questions (and their paragraphs) per group")
    parser.add_argument("--acc-distractors", type=int, default=2, help="accumulation: paragraphs per group that answer none of them")
    parser.add_argument("--modes-parts", type=int, default=3, help="paragraphs (gold + distractors) for modes and diagnosis")
    parser.add_argument("--diag-limit", type=int, default=60, help="questions per model for diagnosis (the first of modes')")
    parser.add_argument("--errata", type=int, default=60, help="erratum cases per model")
    parser.add_argument("--timing-tokens", type=_numbers, default=[2048, 8192], help="comma-separated composed sizes to time")
    parser.add_argument("--timing-parts", type=int, default=4)
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--timing-budget", type=float, default=60.0, help="one repeat only when one exact composition takes longer (s)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "eval_compose", help="results directory")
    parser.add_argument("--figures", type=Path, default=REPO / "docs" / "figures", help="where the PNGs go")
    parser.add_argument("--fresh", action="store_true", help="discard the records of the parts being run instead of resuming them")
    parser.add_argument("--report-only", action="store_true", help="redo summary, table and plots from OUT's records")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pool = load_rows()
    ordered = question_order(pool)
    cases, skipped = errata_cases(ordered, pool, args.errata, args.seed)
    groups = accumulation_groups(ordered[: args.acc_limit], pool, args.acc_golds, args.acc_distractors, args.seed)
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    common = {"max_new_tokens": args.max_new_tokens, "seed": args.seed, "rows": ROWS_NOTE}
    wanted = {
        "accumulation": common | {"golds": args.acc_golds, "distractors": args.acc_distractors},
        "modes": common | {"k": args.modes_parts},
        "timing": {"parts": args.timing_parts, "rows": "consecutive paragraphs in question order"},
        "errata": common | {"max_erratum_words": MAX_ERRATUM_WORDS},
        "diagnosis": common | {"k": args.modes_parts},
    }
    started = time.perf_counter()
    if not args.report_only:
        previous = {part: resumed_records(args.out, part, wanted[part], fresh=args.fresh) for part in args.parts}
        for name in args.models:
            lm = load_model(name, device="cpu", progress=False)
            log(f"{name} loaded ({lm.dtype_name}); parts {', '.join(args.parts)}")
            mine = {part: [r for r in records if r["model"] == lm.name] for part, records in previous.items()}
            if "accumulation" in args.parts:
                done = {(r["id"], r["k"]) for r in mine["accumulation"]}
                todo = [(qs, parts) for qs, parts in groups if any((q.id, k) not in done for q in qs for k in range(1, len(parts) + 1))]
                run_accumulation(lm, todo, sampling, done, appender(args.out, "accumulation"))
            if "modes" in args.parts:
                done = {r["id"] for r in mine["modes"]}
                todo = [row for row in ordered[: args.limit] if row.id not in done]
                run_modes(lm, todo, pool, args.modes_parts, args.seed, sampling, appender(args.out, "modes"))
            if "timing" in args.parts:
                done = {r["target_tokens"] for r in mine["timing"]}
                targets = [t for t in args.timing_tokens if t not in done]
                run_timing(lm, ordered, targets, args.timing_parts, args.timing_repeats, args.timing_budget, appender(args.out, "timing"))
            if "errata" in args.parts:
                done = {r["id"] for r in mine["errata"]}
                run_errata(lm, [c for c in cases if c.row.id not in done], sampling, appender(args.out, "errata"))
            if "diagnosis" in args.parts:
                done = {r["id"] for r in mine["diagnosis"]}
                todo = [row for row in ordered[: args.diag_limit] if row.id not in done]
                run_diagnosis(lm, todo, pool, args.modes_parts, args.seed, sampling, appender(args.out, "diagnosis"))
    # the report covers every model with records, restricted to what these options select
    acc_ids = {row.id for questions, _ in groups for row in questions}
    mode_ids, case_ids = {r.id for r in ordered[: args.limit]}, {c.row.id for c in cases}
    selected = {
        "accumulation": [r for r in read_records(args.out, "accumulation") if r["id"] in acc_ids and r["k"] <= args.acc_golds + args.acc_distractors],
        "modes": [r for r in read_records(args.out, "modes") if r["id"] in mode_ids],
        "timing": [r for r in read_records(args.out, "timing") if r["target_tokens"] in args.timing_tokens],
        "errata": [r for r in read_records(args.out, "errata") if r["id"] in case_ids],
        "diagnosis": [r for r in read_records(args.out, "diagnosis") if r["id"] in {row.id for row in ordered[: args.diag_limit]}],
    }
    settings_path = args.out / "settings.json"
    about = {
        "settings": json.loads(settings_path.read_text()) if settings_path.exists() else {},
        "limits": {"acc_limit": args.acc_limit, "limit": args.limit, "errata": args.errata, "timing_tokens": args.timing_tokens}
        | {"diag_limit": args.diag_limit},
        "errata_rows_skipped": skipped,
        "wall_seconds_last_run": round(time.perf_counter() - started, 1),
        "machine": machine_description({}),
        "source": source_description(),
    }
    print(write_report(selected, args.out, args.figures, about))
    return 0


if __name__ == "__main__":
    sys.exit(main())
