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
    for line in ("(a) Time to first token", "stored / floor", "hosted / floor", "(c) Fetch to the device", "(c2) The decoders' host buffers",
                 "(e) Build", "(e1) The sequential build by stage", "(e2) The overlapped build by stage",
                 "(f) Decoding a pack on the host", "(g) A fetch beside a busy main thread",
                 "GPU: none", "Total run time"):
        assert line in done.stdout, line
    records = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [r["part"] for r in records]
    assert parts[0] == "machine" and parts[-1] == "total"
    assert parts.count("ttft") == parts.count("fetch") == parts.count("build") == 2 and "worker" not in parts and parts.count("convoy") == 1
    assert sorted((r["during"], r["decoder"]) for r in records if r["part"] == "buffers") == [
        ("convoy", "convoy"), ("fetch", "device join"), ("fetch", "host join")]
    decode = [r for r in records if r["part"] == "decode"]
    sizes = [r["tokens"] for r in records if r["part"] == "fetch"]
    assert [r["threads"] for r in decode][0] == 1 and decode[0]["decode_speedup"] == 1.0 and decode[0]["tokens"] == max(sizes)  # nearest 8,000
    for r in records:
        if r["part"] == "ttft":
            assert r["same_first_token"] and min(r["stored_ms"], r["hosted_ms"], r["floor_ms"], r["prefill_ms"]) > 0
        if r["part"] == "fetch":
            assert r["fetch_gbps"] > 0 and r["joined_on_device_gbps"] > 0 and r["pinned_gbps"] is None
        if r["part"] == "decode":
            assert min(r["digest_gbps"], r["frames_gbps"], r["staged_gbps"], r["decode_gbps"]) > 0
        if r["part"] == "build":  # the sequential stages add up to its build; the overlapped build streamed the same chunks
            stages = [r[f"seq_{stage}_ms"] for stage in ("prefill", "copy", "encode", "put")]
            assert min(stages) > 0 and r["seq_build_ms"] == pytest.approx(sum(stages)) and r["seq_digest_ms"] > 0
            assert r["same_chunks"] and r["streamed"] and min(r["build_ms"], r["encode_ms"], r["digest_ms"], r["commit_ms"]) > 0
            assert r["build_ms"] == pytest.approx(r["build_prefill_ms"] + r["after_prefill_ms"])
        if r["part"] == "convoy":
            assert min(r["fetch_alone_ms"], r["fetch_convoy_ms"], r["renders_per_s_alone"], r["renders_per_s_during"]) > 0
    assert list(tmp_path.iterdir()) == [out]  # the model, stores and logs went with the run
