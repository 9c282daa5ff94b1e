"""tools/bench/bench_objects.py end to end on a tiny pack: SeaweedFS, two replicas, every section (no timing asserted)."""

from __future__ import annotations

import os

from tools.bench import bench_objects  # noqa: E402


def test_the_benchmark_runs_tiny(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the benchmark sets the SeaweedFS credentials in it
    bench_objects.main(["--tokens", "8", "--repeats", "1", "--clients", "2", "--rounds", "1", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    for line in ("1. GetPack of one pack", "cold / warm:", "2. 2 concurrent clients", "2 replicas / 1 replica, aggregate:"):
        assert line in out
