"""tools/eval/eval_steering.py: its scorers, conditions and layer thirds, and a whole run on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.eval import eval_steering  # noqa: E402


def test_repetition_counts_repeated_word_trigrams() -> None:
    assert eval_steering.repetition("the cat sat on the mat") == 0.0
    assert eval_steering.repetition("one two three one two three one two three") == pytest.approx(4 / 7)
    assert eval_steering.repetition("too short") == 0.0


def test_food_share_and_sentiment_scorers() -> None:
    assert eval_steering.food_share("We ate pasta and bread.") == pytest.approx(3 / 5)
    assert eval_steering.food_share("") == 0.0
    assert eval_steering.sentiment("I love this wonderful day") > 0.5 > -0.5 > eval_steering.sentiment("I hate this awful day")


def test_thirds_cover_every_layer_once() -> None:
    for layers in (3, 18, 30):
        spans = eval_steering.thirds(layers)
        covered = [i for name, (first, last) in spans.items() if name != "all" for i in range(first, last + 1)]
        assert covered == list(range(layers)) and spans["all"] == (0, layers - 1)
    assert eval_steering.thirds(30) == {"early": (0, 9), "middle": (10, 19), "late": (20, 29), "all": (0, 29)}


def test_conditions_are_unique_and_pair_sets_disjoint() -> None:
    names = [c.name for c in eval_steering.conditions()]
    assert len(names) == len(set(names)) and "sentiment +0" in names
    sets = eval_steering.direction_pairs()
    assert len(sets["sentiment"]) == 30 and len(sets["food"]) == 30 and len(sets["sentiment-second"]) == 40
    subsets = [set(sets[f"sentiment-5{s}"]) for s in "abc"]
    assert all(len(s) == 5 for s in subsets) and not (subsets[0] & subsets[1] or subsets[1] & subsets[2])
    short = eval_steering.direction_pairs(6)  # --pairs 6: the first 6 of each, three disjoint subsets of 2
    assert {name: len(found) for name, found in short.items()} == dict.fromkeys(sets, 6) | dict.fromkeys(("sentiment-5a", "sentiment-5b", "sentiment-5c"), 2)
    assert short["sentiment"] == sets["sentiment"][:6] and short["sentiment-5a"] + short["sentiment-5b"] + short["sentiment-5c"] == short["sentiment"]
    assert eval_steering.direction_pairs(100) == sets


def test_a_whole_run_on_the_tiny_model_resumes_and_reports(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", str(tiny_model_dir), "--limit", "1", "--dual-limit", "1", "--compare", "1", "--batch", "3"]
    argv += ["--max-new-tokens", "4", "--dual-max-new-tokens", "4", "--out", str(out), "--figures", str(figures)]
    assert eval_steering.main(argv) == 0
    records = (out / "generations.jsonl").read_text().splitlines()
    assert len(records) == 3 * len(eval_steering.conditions())
    assert eval_steering.main(argv) == 0  # resumed: nothing is generated again
    assert (out / "generations.jsonl").read_text().splitlines() == records
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    [dual] = summary["dual"].values()
    assert all(s["divergences"] == 0 and s["compared"] == 1 for s in dual.values())
    assert len(list(figures.glob("eval_steering_*.png"))) == 4
    with pytest.raises(SystemExit):
        eval_steering.main([*argv[:-4], "--max-new-tokens", "5", "--out", str(out), "--figures", str(figures)])


def test_the_label_shuffled_null_centres_on_zero_and_rejects_a_shared_direction() -> None:
    """Two directions built from the same pair differences agree (cosine 1), which shuffled labels almost never
    reach; unrelated random differences sit inside the null."""
    import numpy as np
    import torch

    from tools.eval.eval_steering import NULL_SHUFFLES, shuffled_null

    generator = torch.Generator().manual_seed(0)
    shared = [[torch.randn(3, 8, generator=generator) + 2.0 for _ in range(4)] for _ in range(12)]  # 12 pairs, 4 layers
    same = shuffled_null(shared, shared, 1.0, seed=1)
    assert same["shuffles"] == NULL_SHUFFLES and same["p_two_sided"] < 0.01
    low, middle, high = same["quantiles"]
    assert low < middle < high and abs(middle) < 0.2
    other = [[torch.randn(3, 8, generator=generator) for _ in range(4)] for _ in range(12)]
    observed = float(np.mean([torch.nn.functional.cosine_similarity(sum(p[i] for p in shared).ravel(), sum(p[i] for p in other).ravel(), dim=0)
                               for i in range(4)]))
    assert shuffled_null(shared, other, observed, seed=1)["p_two_sided"] > 0.01
