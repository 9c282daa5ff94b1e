"""tools/eval_packs.py end to end on smollm2-135m over the first ckc rows: outputs written, 0 divergences."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import eval_packs  # noqa: E402

pytestmark = pytest.mark.integration
ROWS = 5


def test_eval_packs_on_smollm2(tmp_path: Path, capsys) -> None:
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", "smollm2-135m", "--limit", str(ROWS), "--out", str(out), "--figures", str(figures)]
    assert eval_packs.main(argv) == 0
    assert f"divergences (b) vs (c): 0 of {ROWS}" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    assert len(records) == ROWS and not any(r["divergent"] for r in records)
    for record in records:
        conditions = record["conditions"]
        assert conditions["pack"]["prompt_tokens"] + record["pack_tokens"] == conditions["text"]["prompt_tokens"]
        assert conditions["pack"]["prompt_tokens"] < conditions["none"]["prompt_tokens"]
    # The paragraphs hold the (substituted) answers: text in the prompt must answer some of them.
    assert sum(r["conditions"]["text"]["em"] for r in records) >= 1
    assert {p.name for p in figures.iterdir()} == {"eval_packs_accuracy.png", "eval_packs_prompt_tokens.png"}
