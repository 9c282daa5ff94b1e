"""Start time of packctl's store commands: wall time of whole processes, against an interpreter that does
nothing (``python -c pass``) and ``packctl --version`` (parser built, no command run), measured in one run.

The store holds one small pack (written through the library). Each repetition runs every command once, in
a rotating order; the table gives medians and ratios to both baselines. packctl runs as
``python -m packstore.cli.packctl``, which is what the console script does, with the PYTHONPATH given.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_cli_start [--repeats 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.lib.benchlib import machine_description, median, print_table, source_description  # noqa: E402
from tools.lib.packs import NAME, make_store  # noqa: E402

PACKCTL = [sys.executable, "-m", "packstore.cli.packctl"]


def commands(store: Path) -> dict[str, list[str]]:
    """The processes timed, by label: the two baselines, then the store commands."""
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "packctl --version": [*PACKCTL, "--version"],
        "packctl ls": [*PACKCTL, "--store", str(store), "ls"],
        "packctl inspect": [*PACKCTL, "--store", str(store), "inspect", NAME],
        "packctl verify": [*PACKCTL, "--store", str(store), "verify"],
    }


def wall_seconds(argv: list[str]) -> float:
    """Wall time of one process from start to exit; it must succeed."""
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store, _, _ = make_store(Path(tmp))
        timed = commands(store)
        for argv in timed.values():  # warm the page cache and the byte-code caches once
            wall_seconds(argv)
        times: dict[str, list[float]] = {label: [] for label in timed}
        labels = list(timed)
        for repeat in range(args.repeats):
            for label in labels[repeat % len(labels) :] + labels[: repeat % len(labels)]:
                times[label].append(wall_seconds(timed[label]))
    print(f"Machine: {machine_description({})}")
    print(f"Source: {source_description()}")
    print()
    bare, version = median(times["python -c pass"]), median(times["packctl --version"])
    rows = [
        [label, f"{median(values) * 1000:.0f}", f"{min(values) * 1000:.0f}", f"{median(values) / bare:.2f}", f"{median(values) / version:.2f}"]
        for label, values in times.items()
    ]
    print_table(
        f"Process wall time, median of {args.repeats} (ms)",
        ["process", "median", "min", "x python -c pass", "x packctl --version"],
        rows,
    )


if __name__ == "__main__":
    main()
