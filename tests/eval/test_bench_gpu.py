"""tools/bench/bench_gpu.py end to end on CPU with the tiny shape (smollm2-135m's tokenizer): every part but the worker, every
table, the JSON lines. Its part (d), the worker over gRPC, runs in the GPU session's dry run (tests/eval/test_gpu_session.py:
the bench_worker step, bench_gpu with that part alone), which checks its table and record: starting `packstore serve` and
`packstore worker` twice would double the most expensive part of both tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.eval
ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    argv = ["--device", "cpu", "--shape", "tiny", "--sizes", "300", "600", "--repeats", "1", "--no-worker", "--workdir", str(tmp_path), "--out", str(out)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tools.bench.bench_gpu", *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("(a) Time to first token", "stored / floor", "(c) Fetch to the device", "(e) Build",
                 "(f) Decoding the largest pack on the host",
                 "GPU: none", "Total run time"):
        assert line in done.stdout, line
    records = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [r["part"] for r in records]
    assert parts[0] == "machine" and parts[-1] == "total"
    assert parts.count("ttft") == parts.count("fetch") == parts.count("build") == 2 and "worker" not in parts
    decode = [r for r in records if r["part"] == "decode"]
    assert [r["threads"] for r in decode][0] == 1 and decode[0]["decode_speedup"] == 1.0 and decode[0]["tokens"] == max(r["tokens"] for r in records if r["part"] == "fetch")
    for r in records:
        if r["part"] == "ttft":
            assert r["same_first_token"] and min(r["stored_ms"], r["floor_ms"], r["prefill_ms"]) > 0
        if r["part"] == "fetch":
            assert r["fetch_gbps"] > 0 and r["joined_on_device_gbps"] > 0 and r["pinned_gbps"] is None
        if r["part"] == "decode":
            assert min(r["digest_gbps"], r["frames_gbps"], r["staged_gbps"], r["decode_gbps"]) > 0
        if r["part"] == "build":  # the stages add up to the build
            assert min(r["kv_ms"], r["encode_ms"], r["put_ms"]) > 0 and r["build_ms"] == pytest.approx(r["kv_ms"] + r["encode_ms"] + r["put_ms"])
    assert list(tmp_path.iterdir()) == [out]  # the model, stores and logs went with the run
