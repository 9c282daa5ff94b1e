"""Helpers shared by the benchmarks in tools/: timing, tables, and describing the machine and source."""

from __future__ import annotations

import atexit
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_STARTED = time.perf_counter()


def elapsed() -> float:
    """Seconds since the benchmark started."""
    return time.perf_counter() - _STARTED


def logger(name: str) -> Callable[[str], None]:
    """A progress logger to stderr, stamped with seconds since the benchmark started."""

    def log(message: str) -> None:
        print(f"[{name} {elapsed():5.0f}s] {message}", file=sys.stderr, flush=True)

    return log


def freeze_imports() -> None:
    """Put every object alive now out of the collector's reach (``gc.freeze``): called once, after the imports, it
    spares each later full collection the modules' half a million objects (torch and transformers: 0.26 s a
    collection before, about 1 ms after), which a benchmark that collects before every timed call pays dozens of
    times. What is made later (models, packs) is collected as before; the frozen objects are unfrozen at exit, so the
    interpreter's last collection still finalizes them."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds one call of ``fn`` takes, with the garbage collector paused, and its result.

    With a model loaded a full collection takes ~0.2 s (about 1 ms after ``freeze_imports``), so callers collect once per
    round (``gc.collect()``) instead of letting one land inside a timed call.
    """
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    finally:
        gc.enable()


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(f"\n{title}")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    sys.stdout.flush()


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else platform."""
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_description(libraries: dict[str, str]) -> str:
    """CPUs, memory, torch and its thread count, the given library versions, and Python."""
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    threads = torch.get_num_threads()
    versions = "".join(f", {name} {version}" for name, version in libraries.items())
    return (
        f"{os.cpu_count()} CPUs ({cpu_model()}){memory}, torch {torch.__version__} "
        f"({threads} intra-op thread{'s' if threads != 1 else ''}){versions}, python {platform.python_version()}"
    )


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    command = ["git", "--no-optional-locks", *args]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def source_description() -> str:
    """The packstore commit measured, and whether packstore/ had uncommitted changes (read-only git calls)."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "packstore")
    except (OSError, subprocess.CalledProcessError):
        return "packstore: not a git checkout"
    return f"packstore: commit {commit}" + (" + uncommitted changes in packstore/" if dirty else "")


def source_commit() -> str:
    """The commit a record was measured at: the short hash, with "+dirty" when packstore/ or tools/ differed from it
    (a record so marked names no tree anyone can check out)."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "packstore", "tools")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


@dataclass
class JsonlRecords:
    """A benchmark's records: JSON lines written to ``out`` as they come, each with the ``common`` fields."""

    out: Path
    common: dict[str, Any]

    def __post_init__(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("")

    def record(self, part: str, **fields: Any) -> None:
        with self.out.open("a") as f:
            f.write(json.dumps({"part": part, **self.common, **fields}) + "\n")
