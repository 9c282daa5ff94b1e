"""Shared evaluation helpers for tools/eval/eval_*.py: ckc rows, answer scoring, intervals, and report output.

Scoring follows SQuAD's answer normalisation (lowercase, drop punctuation and the articles a/an/the,
collapse whitespace), with two metrics, each under its own name in every table (``METRICS``):
``contains`` (a normalised gold answer occurs in the normalised prediction as whole words, so that "5"
does not match "15") and ``f1`` (SQuAD's bag-of-tokens F1); each is the best over the gold answers.
There is no strict exact match: the models answer in sentences whatever they are asked, and no answer
extraction was built or validated, so an exact match of the whole answer was 0 everywhere and said
nothing (issue 54); records made before keep an ``em`` field that no table reads.

Intervals: a proportion (a share of 0/1 outcomes, such as contains) gets the Wilson score interval
(``proportion_interval``), which does not collapse to a point at 0 % or 100 % as a percentile bootstrap
does; other means get a seeded percentile bootstrap over questions (``mean_interval``); paired
differences a paired bootstrap with its two-sided p-value (``paired_difference``), adjusted for the
comparisons a table makes with ``holm``; results of several trained adapters (seeds) a two-level
bootstrap that resamples the seeds as well as the questions (``two_level_interval``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.lib.benchlib import source_commit

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO / "tools" / "data" / "ckc_dev.jsonl"  # BIG-bench ckc rows, kept with their license (tools/data/README.md)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True)
class Row:
    """One ckc question: the paragraph that answers it and the accepted answers."""

    id: str
    question: str
    context: str
    answers: tuple[str, ...]


def data_path() -> Path:
    """``$PACKSTORE_EVAL_DATA`` if set, else the repository's own copy, ``tools/data/ckc_dev.jsonl``."""
    return Path(os.environ.get("PACKSTORE_EVAL_DATA", DEFAULT_DATA))


def load_rows(path: Path | None = None, *, limit: int | None = None) -> list[Row]:
    """The ckc rows in file order, the first ``limit`` of them when given."""
    path = path or data_path()
    if not path.exists():
        raise FileNotFoundError(f"evaluation data not found at {path} (set PACKSTORE_EVAL_DATA)")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append(Row(record["id"], record["question"], record["context"], tuple(record["answers"])))
    return rows[:limit] if limit is not None else rows


def gold_answers(path: Path | None = None) -> dict[str, tuple[str, ...]]:
    """Each ckc row's accepted answers by id, for scoring records that keep only the row's id."""
    return {row.id: row.answers for row in load_rows(path)}


def split_rows(rows: Sequence[Row], fraction: float = 0.5, *, seed: int = 0) -> tuple[list[Row], list[Row]]:
    """A deterministic split into (first part, rest), about ``fraction`` of the rows in the first.

    Each row goes by a sha256 of (seed, id), so the split does not depend on row order or on the
    Python process, and a row stays on its side when rows are added.
    """
    first, rest = [], []
    for row in rows:
        digest = hashlib.sha256(f"{seed}:{row.id}".encode()).digest()
        (first if int.from_bytes(digest[:8], "big") / 2**64 < fraction else rest).append(row)
    return first, rest


SPLIT_FILE = REPO / "tools" / "data" / "ckc_split.json"


def frozen_split(rows: Sequence[Row], path: Path | None = None) -> tuple[list[Row], list[Row]]:
    """(tuning, held-out) rows (read from ``path``, by default ``data_path()``) by the split frozen in
    tools/data/ckc_split.json before any tuning.

    Raises if the data file is not the one the split was made from, so a changed data set cannot
    quietly move rows between the halves.
    """
    split = json.loads(SPLIT_FILE.read_text())
    path = path or data_path()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != split["data_sha256"]:
        raise ValueError(f"{path} is not the data {SPLIT_FILE.name} was frozen on (sha256 {digest[:12]})")
    by_id = {row.id: row for row in rows}
    return [by_id[i] for i in split["tuning"]], [by_id[i] for i in split["held_out"]]


def normalize(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def contains_answer(prediction: str, answers: Iterable[str]) -> bool:
    """Lenient: whether some normalised gold answer occurs in the normalised prediction as whole words."""
    padded = f" {normalize(prediction)} "
    return any(gold and f" {gold} " in padded for gold in map(normalize, answers))


def token_f1(prediction: str, answers: Iterable[str]) -> float:
    """SQuAD token F1 between the prediction and the best-matching gold answer."""
    predicted = normalize(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize(answer).split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS = {"contains": "contains", "f1": "F1"}  # record key -> column name, in table order
PROPORTIONS = ("contains",)  # the metrics that are 0/1 per answer: Wilson intervals

# Chosen on 25 rows of the tuning half against four other wordings (a few words, a one-line answer, two worked
# examples, ...): none got either model to answer with the bare answer; this one kept the most answers right.
SHORT_ANSWER = "\n\nAnswer with only the answer (a name, date or number)."
PROMPTS = {"short": SHORT_ANSWER, "open": ""}  # --prompt: what follows each question


def asked(question: str, prompt: str) -> str:
    """The question as the model is asked it under ``--prompt`` ``prompt`` (``PROMPTS``)."""
    return question.strip() + PROMPTS[prompt]


def bare_question(text: str) -> str:
    """``text`` without the instruction any of ``PROMPTS`` appended (``asked``'s inverse): what a bank routes. The
    instruction is for the model; routing it too let its words (answer, name, date, number) move the route."""
    for suffix in PROMPTS.values():
        if suffix and text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def answer_scores(prediction: str, answers: Iterable[str]) -> dict[str, float]:
    """Every metric of ``METRICS`` for one answer: ``contains`` as 0/1, ``f1`` in [0, 1]."""
    answers = list(answers)
    return {"contains": float(contains_answer(prediction, answers)), "f1": token_f1(prediction, answers)}


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% interval; for a difference, ``p``: the two-sided p-value of no difference (else None)."""

    mean: float
    low: float
    high: float
    p: float | None = None

    def percent(self) -> str:
        """``mean [low, high]`` in percent, one decimal."""
        return f"{100 * self.mean:.1f} [{100 * self.low:.1f}, {100 * self.high:.1f}]"

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (``100``: percent), for plotting."""
        return Interval(factor * self.mean, factor * self.low, factor * self.high, self.p)


def _bootstrap_p(means: np.ndarray) -> float:
    """The two-sided p-value of a zero mean from bootstrap means: twice the smaller share of them on either side of 0
    (0 included), with the add-one rule so that it is never 0. Below 0.05 exactly when the 95 % percentile interval
    excludes 0 (up to the add-one rule)."""
    below, above = int(np.count_nonzero(means <= 0)), int(np.count_nonzero(means >= 0))
    return min(1.0, 2 * (min(below, above) + 1) / (means.size + 1))


def _bootstrap_means(values: Sequence[float], resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("no values to average")
    return data, np.random.default_rng(seed).choice(data, size=(resamples, data.size)).mean(axis=1)


def mean_interval(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> Interval:
    """The mean of ``values`` with a 95% percentile-bootstrap interval (seeded, so reruns agree)."""
    data, means = _bootstrap_means(values, resamples, seed)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(data.mean()), float(low), float(high))


def proportion_interval(values: Iterable[float | bool]) -> Interval:
    """The share of true (1) values among 0/1 ``values``, with its Wilson 95 % interval."""
    data = [float(v) for v in values]
    if not data:
        raise ValueError("no values to average")
    if any(v not in (0.0, 1.0) for v in data):
        raise ValueError("a proportion is made of 0/1 values")
    successes = int(sum(data))
    low, high = wilson_interval(successes, len(data))
    share = successes / len(data)
    return Interval(share, min(low, share), max(high, share))


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default): unlike a percentile bootstrap, it does not
    collapse to a point at 0 % or 100 % (0 of 600 is [0, 0.6 %], not [0, 0])."""
    if trials <= 0:
        return (0.0, 1.0)
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * ((share * (1 - share) / trials + z * z / (4 * trials * trials)) ** 0.5) / (1 + z * z / trials)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(first: Sequence[float], second: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> Interval:
    """The mean of ``first - second`` over the same questions, with a 95% paired bootstrap interval and its two-sided
    p-value (``p``): questions are resampled together, so question-to-question variance common to both cancels (an
    interval excluding 0 is a difference at the 5% level, before any correction for the other comparisons made)."""
    data, means = _bootstrap_means([a - b for a, b in zip(first, second, strict=True)], resamples, seed)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(data.mean()), float(low), float(high), _bootstrap_p(means))


def two_level_interval(by_seed: Mapping[object, Mapping[str, float]], *, resamples: int = 10000, seed: int = 0) -> Interval:
    """The mean over seeds of each seed's mean over its questions, with a 95 % two-level bootstrap interval and the
    two-sided p-value of a zero mean (``p``, for differences): each resample draws the seeds (adapters) with
    replacement and the questions with replacement, so that the interval holds for another adapter trained the same
    way as well as for other questions. ``by_seed[seed][question]`` is one value; when every seed has the same
    questions (the seeds asked the same questions) one draw of the questions serves every drawn seed, so question
    effects shared by the seeds are kept; otherwise (each seed its own questions) each drawn seed's questions are
    drawn from its own. One seed reduces to the plain bootstrap over questions."""
    seeds = list(by_seed)
    if not seeds or not all(by_seed[s] for s in seeds):
        raise ValueError("no values to average")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(seeds), size=(resamples, len(seeds)))  # the seeds drawn, one row per resample
    crossed = all(set(by_seed[s]) == set(by_seed[seeds[0]]) for s in seeds)
    if crossed:
        questions = list(by_seed[seeds[0]])
        matrix = np.array([[by_seed[s][q] for q in questions] for s in seeds], dtype=float)  # seeds x questions
        drawn = rng.integers(0, len(questions), size=(resamples, len(questions)))
        per_seed = np.stack([row[drawn].mean(axis=1) for row in matrix])  # seeds x resamples
        means = per_seed[picks, np.arange(resamples)[:, None]].mean(axis=1)
        estimate = float(matrix.mean())
    else:  # each seed drawn in a resample gets its own draw of its questions
        slots = np.empty((resamples, len(seeds)))
        for slot in range(len(seeds)):
            for index, s in enumerate(seeds):
                values = np.fromiter(by_seed[s].values(), dtype=float)
                chosen = picks[:, slot] == index
                if chosen.any():
                    slots[chosen, slot] = values[rng.integers(0, values.size, size=(int(chosen.sum()), values.size))].mean(axis=1)
        means = slots.mean(axis=1)
        estimate = float(np.mean([np.mean(list(by_seed[s].values())) for s in seeds]))
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(estimate, float(low), float(high), _bootstrap_p(means))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (same order): the i-th smallest times (m - i), made
    monotone and at most 1. A comparison is significant at 5 % over the whole family when its adjusted p < 0.05."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [1.0] * len(pvalues)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def format_p(p: float) -> str:
    """A p-value for a table: three decimals, ``<0.001`` below that."""
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def metric_interval(metric: str, values: Sequence[float]) -> Interval:
    """One metric's mean with its 95 % interval: Wilson for a proportion (``PROPORTIONS``), else the bootstrap."""
    return proportion_interval(values) if metric in PROPORTIONS else mean_interval(values)


def metric_intervals(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> dict[str, Interval]:
    """Each metric of ``METRICS`` over paired predictions and gold answers, with its 95% interval (``metric_interval``).

    Tables recompute the scores from the answers' text rather than read stored flags, so records made
    before a metric existed (or when ``em`` still meant containment) give the same columns.
    """
    scores = [answer_scores(p, a) for p, a in zip(predictions, answers, strict=True)]
    if not scores:
        raise ValueError("no answers to score")
    return {metric: metric_interval(metric, [s[metric] for s in scores]) for metric in METRICS}


def metric_headers() -> list[str]:
    """The table columns for ``metric_intervals``: ``contains % [Wilson 95%]``, ``F1 % [95% CI]``."""
    return [f"{name} % [{'Wilson 95%' if metric in PROPORTIONS else '95% CI'}]" for metric, name in METRICS.items()]


def compressed(path: Path) -> Path:
    """Where the records of OUT/NAME.jsonl are kept compressed: OUT/NAME.jsonl.gz.

    A records file is one logical list in up to two files: what a finished run keeps, gzip-compressed (results/ holds
    its records so: the large ones compress 6-10 times), then the records appended since, plain. ``read_jsonl`` reads
    both in that order, an appender (``jsonl_appender``) adds to the plain one, so a compressed run resumes where it
    stopped, and ``compress_records`` folds the plain file into the compressed one before the records are committed.
    """
    return path.with_name(path.name + ".gz")


def _lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as text:
            return text.read().splitlines()
    return path.read_text().splitlines()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file ``path`` (OUT/NAME.jsonl): those kept compressed beside it (``compressed``), then
    its own; empty when neither exists."""
    files = [f for f in (compressed(path), path) if f.exists()]
    return [json.loads(line) for f in files for line in _lines(f) if line.strip()]


def _write_gzip(path: Path, text: str) -> None:
    """``text`` gzip-compressed into ``path``, the same bytes for the same text (no name or time in the header)."""
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as sink:
        sink.write(text.encode("utf-8"))


def write_jsonl(path: Path, records: Iterable[Mapping]) -> None:
    """Replace the records of ``path`` with ``records``, one JSON object a line (parent directories created): compressed
    where they were kept compressed, else plain."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    if compressed(path).exists():
        _write_gzip(compressed(path), text)
        path.unlink(missing_ok=True)
    else:
        path.write_text(text)


def discard_records(path: Path) -> None:
    """Start the records of ``path`` over: the plain file emptied, the compressed one removed (``--fresh``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    compressed(path).unlink(missing_ok=True)
    path.write_text("")


def compress_records(directory: Path) -> list[Path]:
    """Fold every plain records file of ``directory`` (``*.jsonl``) into its compressed one (``compressed``); the
    compressed files written."""
    written = []
    for path in sorted(directory.glob("*.jsonl")):
        records = read_jsonl(path)
        compressed(path).touch()
        write_jsonl(path, records)
        written.append(compressed(path))
    return written


def record_files(directory: Path, pattern: str = "*.jsonl") -> list[Path]:
    """The records files of ``directory`` matching ``pattern`` (a ``*.jsonl`` glob), each named by its plain path
    whether it is kept plain, compressed or both, in name order: what ``read_jsonl`` takes."""
    plain = set(directory.glob(pattern)) | {path.with_suffix("") for path in directory.glob(pattern + ".gz")}
    return sorted(plain)


def jsonl_appender(path: Path) -> Callable[[dict], None]:
    """A function appending one record to ``path`` (flushed, so a stopped run keeps what it made).

    A record without a ``commit`` gets the commit the run measures (``benchlib.source_commit``, read once
    when the appender is made), so every record says which tree of packstore/ and tools/ made it.
    """
    commit = source_commit()

    def keep(record: Mapping) -> None:
        with path.open("a") as sink:
            sink.write(json.dumps({"commit": commit, **record}, ensure_ascii=False) + "\n")

    return keep


def fresh_appender(path: Path) -> Callable[[dict], None]:
    """``jsonl_appender`` of ``path`` once its records are started over (``discard_records``)."""
    discard_records(path)
    return jsonl_appender(path)


def resumed_records(out: Path, part: str, settings: Mapping, *, fresh: bool) -> list[dict]:
    """The records a resumed run keeps of OUT/PART.jsonl (compressed or not): as they stand, unless ``fresh`` (then they
    are discarded).

    A part is only resumed under the ``settings`` it was made with (generation length, prompt, ...), which
    OUT/settings.json records per part; other settings are refused rather than mixed into one table.
    """
    out.mkdir(parents=True, exist_ok=True)
    path, settings_path = out / f"{part}.jsonl", out / "settings.json"
    recorded = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    wanted = dict(settings)
    if fresh or not (path.exists() or compressed(path).exists()):
        discard_records(path)
        settings_path.write_text(json.dumps(recorded | {part: wanted}, indent=2) + "\n")
        return []
    if recorded.get(part) != wanted:
        raise SystemExit(f"{path} was made with settings {recorded.get(part)}, not {wanted}: pass --fresh to start over")
    return read_jsonl(path)


def parts_type(known: Sequence[str], what: str = "parts") -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of parts (or other names, ``what``) of ``known``."""

    def parse(text: str) -> list[str]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        unknown = set(parts) - set(known)
        if unknown:
            import argparse

            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(sorted(unknown))}: use {', '.join(known)}")
        return parts

    return parse


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """A GitHub markdown table: the first ``left`` columns left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * left + " ---: |" * (len(headers) - left)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def grouped_bars(
    path: Path,
    panels: Mapping[str, Mapping[str, Mapping[str, Interval | float]]],
    *,
    title: str,
    ylabel: str | Mapping[str, str],
    shared_y: bool = False,
) -> None:
    """A PNG of grouped bar charts: one panel per key of ``panels``, categories on x, one bar per series.

    ``panels[panel][series][category]`` is a value or an Interval (drawn with its interval as an
    error bar). Each bar is labelled with its value. ``ylabel``: one y label for every panel, or one per
    panel (``ylabel[panel]``) where panels measure different things. ``shared_y``: one y scale for every
    panel, so that panels of very different effects are not drawn the same height.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crowded = max(len(series) for series in panels.values()) > 4  # then panels stack and the legend goes beside them
    rows, columns = (len(panels), 1) if crowded else (1, len(panels))
    size = (13.0, 4.6 * len(panels) + 0.6) if crowded else (max(6.5 * len(panels), 9.0), 5.4)
    figure, axes = plt.subplots(rows, columns, figsize=size, squeeze=False, sharey=shared_y)
    for axis, (panel, series) in zip(axes.flat, panels.items()):
        categories = list(dict.fromkeys(c for values in series.values() for c in values))
        width = 0.8 / max(len(series), 1)
        upright = len(series) > 3  # side by side, four or more bars' value labels run into each other
        for index, (name, values) in enumerate(series.items()):
            xs = [i + (index - (len(series) - 1) / 2) * width for i, c in enumerate(categories) if c in values]
            points = [values[c] for c in categories if c in values]
            means = [p.mean if isinstance(p, Interval) else p for p in points]
            errors = None
            if all(isinstance(p, Interval) for p in points):
                errors = [[p.mean - p.low for p in points], [p.high - p.mean for p in points]]
            colour = plt.cm.tab20(index % 20) if len(series) > 10 else None  # the default cycle repeats after 10
            bars = axis.bar(xs, means, width, yerr=errors, capsize=3, label=name, color=colour)
            fmt = "%.2f" if max(means, default=0) <= 1 else "%.0f"
            axis.bar_label(bars, fmt=fmt, fontsize=6 if crowded else 7, padding=2, rotation=90 if upright else 0)
        axis.set_title(panel)
        axis.set_ylabel(ylabel if isinstance(ylabel, str) else ylabel[panel])
        axis.set_xticks(range(len(categories)), categories, rotation=0 if crowded else 15, ha="center" if crowded else "right", fontsize=8)
        if crowded:
            axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:  # below the panel: inside it, "best" still covers a bar when every place holds one
            axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(series), 3), frameon=False)
        axis.margins(y=0.2 if crowded else 0.15)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def mcnemar_exact(first_only: int, second_only: int) -> float:
    """The exact (binomial) two-sided McNemar p-value of discordant pairs: whether one side is right alone more often."""
    n, k = first_only + second_only, min(first_only, second_only)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
