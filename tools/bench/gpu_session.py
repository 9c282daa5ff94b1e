"""The GPU session of issue 56 in one command: install the carried wheels, check imports, run the CUDA tests, probe
the host, bench the 8B shape, check exactness on the 1B shape, and pack every record into one archive.

The GPU machine has no network, carries at most 64 MiB per command (the working tree counts) and gives 15 minutes of
device time per issue, so everything runs in one command under a deadline (``--budget``, 540 s), each step in a
process group of its own with its own timeout, clipped so that the steps after it keep their minimum; a step that
fails or runs out of time is recorded and the next one runs, except the install and the import preflight, which end
the session at once (about 20 s) when they fail. After every step the manifest (each step's status, exit code,
seconds, timeout, command) and every record so far are packed into ``$OUT/gpu-session-<rev>.tar.gz``, so a command cut
short still brings back what it measured.

This module imports nothing outside the standard library at the top: it runs before the carried wheels are installed.
Subcommands (from the repository root):

    python3 -m tools.bench.gpu_session run [--dry-run] [--only STEP ...] [--skip STEP ...]   # on the GPU machine
    python3 -m tools.bench.gpu_session plan [--carry PATH ...]   # here, after prepare: sizes, and the `run` call to make

``tools/bench/gpu_session.sh prepare`` downloads the wheels and saves the tokenizer into ``.gpu/`` (ignored), then calls
``plan``; ``tools/bench/gpu_session.sh run`` calls ``run``. ``--dry-run`` is the same session on CPU with the tiny shape
(seconds): tests/eval/test_gpu_session.py runs it. The helpers ``versions``, ``preflight``, ``decode-check``
and ``install-numba`` are the steps' own commands (the exactness step makes its model with ``eval_exactness --shape``). docs/benchmarks.md ("The GPU session") says more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRIED = ".gpu"  # the ignored folder prepare fills: whl/ (wheels), numba/ (numba-cuda, a fallback), tok/ (tokenizer), rev
STUBS = "packstore/v1"  # the generated gRPC modules: ignored by git, so carried
CARRY = (CARRIED, STUBS)
ALWAYS = ("install", "machine", "preflight")  # --only adds its steps to these
BUDGET_S = 540  # the whole session, install to archive; the `run` call's timeout_s is RUN_TIMEOUT_S
RUN_TIMEOUT_S = 590
RESERVE_S = 8  # kept back for the last archive
LIMIT_MIB = 60  # the device tool carries 64 MiB in all (tracked tree, untracked files, carried paths)
NUMBA_CUDA_MIN = (0, 30)
DRY_RUN_SLOWER = 3  # the dry run's timeouts: a CPU box shared with other tests starts Python and torch slower than the GPU machine
TEST_FILES = ("tests/unit/test_device_decode.py", "tests/unit/test_plane_join.py", "tests/unit/test_gpu_path.py", "tests/unit/test_ready_caches.py")
DATA = "tools/data/ckc_dev.jsonl"
# What the worker, the service, bench_gpu and eval_exactness import (the preflight imports each; a missing one ends the
# session within seconds instead of failing every step).
IMPORTS = (
    "torch", "transformers", "numpy", "numba", "lmdb", "zstandard", "blake3", "gguf", "grpc", "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection", "grpc_status", "google.protobuf", "google.rpc", "bm25s", "Stemmer", "cryptography",
    "starlette", "uvicorn", "anyio", "prometheus_client",
    "packstore.v1.store_pb2_grpc", "packstore.v1.worker_pb2_grpc", "packstore.cli.packstore_main", "packstore.service.server",
    "packstore.worker.server", "packstore.worker.http", "packstore.packs.reader", "packstore.packs.device_decode",
    "packstore.format.huffman_cuda", "tools.bench.bench_gpu", "tools.bench.host_probe", "tools.eval.eval_exactness",
)
VERSIONS = (
    "torch", "transformers", "numpy", "numba", "numba-cuda", "cuda-bindings", "cuda-core", "cuda-pathfinder", "grpcio",
    "protobuf", "lmdb", "blake3", "zstandard", "starlette", "uvicorn", "anyio", "pytest",
)


# -- the session --------------------------------------------------------------------------


@dataclass
class Context:
    root: Path
    carried: Path
    site: Path
    work: Path
    out: Path
    rev: str
    dry_run: bool
    python: str = sys.executable

    @property
    def name(self) -> str:
        return "gpu-session-" + re.sub(r"[^A-Za-z0-9._-]", "-", self.rev)

    @property
    def records(self) -> Path:
        return self.work / self.name

    @property
    def models(self) -> Path:
        return self.work / "models"

    def module(self, name: str, *args: str | Path) -> list[str]:
        return [self.python, "-m", name, *map(str, args)]


@dataclass
class Step:
    """``commands`` run one after the other within ``timeout`` s (clipped by the deadline, never below ``floor`` unless
    the deadline leaves less); ``gate``: a failure ends the session."""

    name: str
    timeout: int
    floor: int
    commands: Callable[[Context], list[list[str]]]
    gate: bool = False
    about: str = ""


def install_commands(c: Context) -> list[list[str]]:
    wheels = sorted((c.carried / "whl").glob("*.whl"))
    if not wheels:
        raise StepSkipped(f"no wheels in {c.carried / 'whl'} (run tools/bench/gpu_session.sh prepare here first)")
    pip = [c.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--upgrade", "--target", str(c.site)]
    return [pip + [str(w) for w in wheels], c.module("tools.bench.gpu_session", "install-numba", "--site", c.site, "--carried", c.carried)]


def machine_commands(c: Context) -> list[list[str]]:
    smi = [] if c.dry_run or not shutil.which("nvidia-smi") else [["nvidia-smi"]]
    return [*smi, c.module("tools.bench.gpu_session", "versions", "--site", c.site, "--out", c.records / "versions.json")]


def preflight_commands(c: Context) -> list[list[str]]:
    return [c.module("tools.bench.gpu_session", "preflight", "--out", c.records / "preflight.json", *(["--cpu"] if c.dry_run else []))]


def decode_commands(c: Context) -> list[list[str]]:
    return [c.module("tools.bench.gpu_session", "decode-check", "--out", c.records / "decode_check.json", *(["--cpu"] if c.dry_run else []))]


def test_commands(c: Context) -> list[list[str]]:
    argv = c.module("pytest", "-q", "-p", "no:cacheprovider", "-rs", "--junitxml", c.records / "tests.xml", "--basetemp", c.work / "pytest",
                    *TEST_FILES)
    return [argv + (["--collect-only"] if c.dry_run else [])]  # the dry run checks that they import and collect


def probe_commands(c: Context) -> list[list[str]]:
    small = ["--device", "cpu", "--size-mb", "8", "--threads", "1", "2", "--repeats", "1"] if c.dry_run else []
    return [c.module("tools.bench.host_probe", "--rev", c.rev, "--out", c.records / "host_probe.jsonl", *small)]


def bench_common(c: Context) -> list[str]:
    shape = ["--device", "cpu", "--shape", "tiny"] if c.dry_run else ["--shape", "8b"]
    return [*shape, "--tokenizer", str(c.carried / "tok"), "--data", str(c.root / DATA), "--models", str(c.models), "--rev", c.rev]


def bench_commands(c: Context) -> list[list[str]]:
    sizes = ["--sizes", "300", "--repeats", "1"] if c.dry_run else ["--sizes", "2048", "8000", "32000", "--repeats", "3"]
    return [c.module("tools.bench.bench_gpu", *bench_common(c), *sizes, "--no-worker", "--workdir", c.work / "bench",
                     "--out", c.records / "bench_gpu.jsonl")]


def worker_commands(c: Context) -> list[list[str]]:
    sizes = ["--worker-sizes", "300", "--worker-repeats", "1"] if c.dry_run else ["--worker-sizes", "2048", "8000", "--worker-repeats", "2"]
    return [c.module("tools.bench.bench_gpu", *bench_common(c), "--no-ttft", "--no-fetch", "--no-build", "--no-decode", "--no-convoy", "--repeats", "1",
                     *sizes, "--workdir", c.work / "bench_worker", "--logs", c.records / "servers", "--out", c.records / "bench_worker.jsonl")]


EXACTNESS_VARIANTS = "default,deterministic,sdpa-math,deterministic+sdpa-math"  # each builds and answers under its mode


def exactness_commands(c: Context) -> list[list[str]]:
    """eval_exactness on the 1B shape with random weights (made on the GPU in float32, with the carried tokenizer), every
    exactness variant in bfloat16 first (where chunked_identical failed on the H100), then in float32: the records say
    which variant makes chunked_identical hold, kv_bit_equal on the pack the answers used, and each variant's prefill cost."""
    shape, device = ("tiny", "cpu") if c.dry_run else ("1b", "cuda")
    asked = ["--dtypes", "float32", "--variants", "default,deterministic+sdpa-math", "--questions", "2", "--per-pack", "2",
             "--max-new-tokens", "4", "--timing-repeats", "1"] if c.dry_run else \
        ["--dtypes", "bfloat16", "float32", "--variants", EXACTNESS_VARIANTS, "--questions", "8", "--per-pack", "4",
         "--max-new-tokens", "12", "--timing-repeats", "3"]
    return [
        c.module("tools.eval.eval_exactness", "--shape", shape, "--tokenizer", c.carried / "tok", "--models", c.models, "--device", device,
                 *asked, "--data", c.root / DATA, "--out", c.records / "exactness", "--rev", c.rev),
    ]


STEPS = (
    Step("install", 40, 10, install_commands, gate=True, about="the carried wheels into --site; numba-cuda only if the image's is older"),
    Step("machine", 15, 5, machine_commands, about="nvidia-smi; versions of python, torch, CUDA and the packages that matter"),
    Step("preflight", 20, 20, preflight_commands, gate=True, about="every module the steps import, and CUDA"),
    Step("decode_check", 40, 10, decode_commands, about="packstore.packs.device_decode.unavailable(cuda): the kernel compiles"),
    Step("tests", 75, 30, test_commands, about="the CUDA paths: " + " ".join(TEST_FILES)),
    Step("host_probe", 40, 15, probe_commands, about="memcpy and blake3 by threads, host-to-device on 1 and 2 streams"),
    Step("bench", 200, 60, bench_commands, about="bench_gpu 8B at 2k/8k/32k: build sequential and overlapped by stage, first token "
         "(stored, hosted, floor, prefill), fetch and pool waits, decode by stage and the GIL convoy at 8k"),
    Step("bench_worker", 170, 60, worker_commands, about="bench_gpu 8B: packstore serve + a worker over gRPC, then one on its LMDB directory, cold and warm"),
    Step("exactness", 150, 60, exactness_commands, about="eval_exactness on the 1B random shape, bf16 then fp32, each exactness variant"),
)


class StepSkipped(Exception):
    """A step that cannot run here (its reason is recorded)."""


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | timeout | skipped
    started_s: float = 0.0  # since the session began
    seconds: float = 0.0
    timeout_s: float | None = None
    returncode: int | None = None
    reason: str = ""
    commands: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", None, []) or k == "seconds"}


def step_env(c: Context) -> dict[str, str]:
    """The environment of every step: the installed wheels and the repository first on the path, nothing fetched."""
    path = [str(c.site), str(c.root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    tmp = c.work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return os.environ | {
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp),
        "PACKSTORE_EVAL_DATA": str(c.root / DATA),
    }


def run_group(argv: list[str], env: dict[str, str], log, timeout: float) -> int | None:
    """Run ``argv`` in a process group of its own; None when ``timeout`` ran out (the group is then ended)."""
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        return process.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return None
    finally:
        try:  # what the step left running (a server a killed benchmark started) goes with it
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_step(step: Step, c: Context, timeout: float, env: dict[str, str]) -> Outcome:
    try:
        commands = step.commands(c)
    except StepSkipped as why:
        return Outcome(step.name, "skipped", reason=str(why))
    outcome = Outcome(step.name, "ok", timeout_s=round(timeout, 1), commands=[shlex.join(map(str, a)) for a in commands])
    started = time.perf_counter()
    with (c.records / f"{step.name}.log").open("a") as log:
        for argv in commands:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            left = timeout - (time.perf_counter() - started)
            code = run_group(argv, env, log, left)
            if code is None:
                outcome.status, outcome.reason = "timeout", f"cut at {timeout:.0f} s"
                break
            if code != 0:
                outcome.status, outcome.returncode = "failed", code
                break
            outcome.returncode = 0
    outcome.seconds = round(time.perf_counter() - started, 2)
    return outcome


def keep_server_logs(step: Step, c: Context) -> None:
    """The serve and worker logs a benchmark left in its workdir (a benchmark that ends well removes them)."""
    workdir = c.work / step.name
    for log in sorted(workdir.rglob("*.log")) if workdir.exists() else []:
        target = c.records / f"{step.name}-{log.parent.name}-{log.name}"
        shutil.copyfile(log, target)
    shutil.rmtree(workdir, ignore_errors=True)


def archive(c: Context, manifest: dict) -> Path:
    """The manifest and every record so far in ``$OUT/<name>.tar.gz`` (replaced whole, never half written)."""
    (c.records / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    target = c.out / f"{c.name}.tar.gz"
    partial = c.out / f".{c.name}.partial"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(c.records, arcname=c.name)
    partial.replace(target)
    return target


def read_rev(root: Path, carried: Path) -> str:
    """The commit measured: what prepare wrote into the carried folder (the GPU machine's copy has no .git), else git."""
    written = carried / "rev"
    if written.is_file() and written.read_text().strip():
        return written.read_text().strip()
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
        return commit.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def session(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    deadline = started + args.budget
    out = Path(args.out or os.environ.get("OUT") or "")
    if not str(out):
        raise SystemExit("gpu_session run: give --out or set OUT (the device tool sets it)")
    carried = Path(args.carried).resolve()
    c = Context(ROOT, carried, Path(args.site).resolve(), Path(args.work).resolve(), out.resolve(), args.rev or read_rev(ROOT, carried), args.dry_run)
    shutil.rmtree(c.records, ignore_errors=True)
    for folder in (c.records, c.out, c.site):
        folder.mkdir(parents=True, exist_ok=True)
    env = step_env(c)
    steps = [s for s in STEPS if (not args.only or s.name in args.only or s.name in ALWAYS) and s.name not in args.skip]
    manifest: dict = {
        "session": c.name, "rev": c.rev, "dry_run": c.dry_run, "budget_s": args.budget, "python": sys.version.split()[0],
        "started_unix": round(time.time()), "steps": [],
    }
    print(f"{c.name}: {len(steps)} steps within {args.budget} s{' (dry run, CPU)' if c.dry_run else ''}", flush=True)
    stop = ""
    for index, step in enumerate(steps):
        step_started = time.perf_counter()
        later_floors = sum(s.floor for s in steps[index + 1 :])
        timeout = min(step.timeout * (DRY_RUN_SLOWER if c.dry_run else 1), deadline - time.perf_counter() - later_floors - RESERVE_S)
        if stop:
            outcome = Outcome(step.name, "skipped", reason=stop)
        elif timeout < min(step.floor, 5):
            outcome = Outcome(step.name, "skipped", reason=f"{timeout:.0f} s left for it before the deadline")
        else:
            outcome = run_step(step, c, timeout, env)
            keep_server_logs(step, c)
        outcome.started_s = round(step_started - started, 1)
        if step.name == "bench_worker" or outcome.status != "ok" and step.name == "bench":
            shutil.rmtree(c.models / "llama-8b-bfloat16", ignore_errors=True)  # 16 GB; half written when bench was cut
            shutil.rmtree(c.models / "llama-tiny-float32", ignore_errors=True)
        if step.gate and outcome.status not in ("ok",) and not args.keep_going and not (c.dry_run and outcome.status == "skipped"):
            stop = f"{step.name} {outcome.status}: the session stopped there"
        manifest["steps"].append(outcome.as_dict())
        print(f"[{time.perf_counter() - started:5.0f} s] {step.name:<13} {outcome.status:<8} {outcome.seconds:6.1f} s  {outcome.reason}", flush=True)
        manifest["total_s"] = round(time.perf_counter() - started, 1)
        archive(c, manifest)
    shutil.rmtree(c.models, ignore_errors=True)
    manifest["total_s"] = round(time.perf_counter() - started, 1)
    target = archive(c, manifest)
    print(f"{c.name}: {manifest['total_s']} s; {target} ({target.stat().st_size / 2**20:.2f} MiB)")
    for name in ("versions.json", "preflight.json", "decode_check.json"):
        if (c.records / name).exists():
            print(f"--- {name}\n{(c.records / name).read_text().strip()[:1500]}")
    statuses = {s["status"] for s in manifest["steps"]}
    return 2 if stop else 0 if statuses <= {"ok"} or (c.dry_run and statuses <= {"ok", "skipped"}) else 1


# -- the steps' own commands -----------------------------------------------------------------


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def install_numba(args: argparse.Namespace) -> int:
    """Install the carried numba-cuda into ``--site`` only where the image's is missing or older than NUMBA_CUDA_MIN."""
    have = installed_version("numba-cuda")
    wheels = sorted((Path(args.carried) / "numba").glob("*.whl"))
    if have and version_tuple(have) >= NUMBA_CUDA_MIN:
        print(f"numba-cuda {have} is there: the carried one is not installed")
        return 0
    if not wheels:
        print(f"numba-cuda {have or 'missing'} and none carried: --decode device will be unavailable")
        return 0
    print(f"numba-cuda {have or 'missing'}: installing {' '.join(w.name for w in wheels)}")
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                            "--disable-pip-version-check", "--upgrade", "--target", args.site, *map(str, wheels)])


def versions(args: argparse.Namespace) -> int:
    site = Path(args.site)
    carried = sorted(p.name.removesuffix(".dist-info") for p in site.glob("*.dist-info")) if site.exists() else []
    about: dict = {"python": sys.version, "executable": sys.executable, "cpus": os.cpu_count(),
                   "versions": {name: installed_version(name) for name in VERSIONS}, "installed_from_carried_wheels": carried}
    try:
        import torch

        about |= {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            about |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                      "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    except Exception as exc:  # recorded; the preflight decides
        about["torch_error"] = repr(exc)
    Path(args.out).write_text(json.dumps(about, indent=1) + "\n")
    print(json.dumps(about, indent=1))
    return 0


def preflight(args: argparse.Namespace) -> int:
    import importlib

    started = time.perf_counter()
    failed: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name in IMPORTS:
        t = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
        seconds[name] = round(time.perf_counter() - t, 3)
    import torch

    report: dict = {"failed_imports": failed, "import_s": seconds, "cuda_available": torch.cuda.is_available()}
    if not args.cpu and not torch.cuda.is_available():
        failed["torch.cuda"] = "torch finds no CUDA device"
    try:
        from packstore.format import huffman_cuda

        cuda = huffman_cuda.cuda_module()
        report["numba_cuda_available"] = bool(cuda.is_available())
        report["numba_cuda_simulator"] = huffman_cuda.simulated()
    except Exception as exc:  # --decode device then falls back or fails; decode_check says which
        report["numba_cuda_error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = round(time.perf_counter() - started, 2)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "import_s"}, indent=1))
    return 1 if failed else 0


def decode_check(args: argparse.Namespace) -> int:
    import torch

    from packstore.packs import device_decode

    device = torch.device("cpu" if args.cpu else "cuda")
    started = time.perf_counter()
    reason = device_decode.unavailable(device)
    report = {"device": str(device), "unavailable": reason, "seconds": round(time.perf_counter() - started, 2)}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0 if reason is None or args.cpu else 3


# -- here: the sizes and the call to make -------------------------------------------------------


def tree_bytes(root: Path, carry: Sequence[str]) -> dict[str, int]:
    """Bytes that travel with a `run` call: tracked and untracked-not-ignored files, shared/ if there, each carried path."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    files = {root / os.fsdecode(name) for name in listed if name}
    sizes = {"tree": sum(p.lstat().st_size for p in files if p.is_file() or p.is_symlink())}
    extra = (["shared"] if (root / "shared").is_dir() else []) + list(carry)
    for name in extra:
        path = root / name
        found = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
        sizes[name] = sum(p.lstat().st_size for p in found if p not in files)
    return sizes


def invocation(carry: Sequence[str]) -> dict:
    return {"command": "bash tools/bench/gpu_session.sh run", "carry": list(carry), "timeout_s": RUN_TIMEOUT_S}


def plan(args: argparse.Namespace) -> int:
    missing = [name for name in args.carry if not (ROOT / name).exists()]
    sizes = tree_bytes(ROOT, args.carry)
    total = sum(sizes.values())
    for name, size in sizes.items():
        print(f"{name:<16} {size / 2**20:8.2f} MiB")
    print(f"{'total':<16} {total / 2**20:8.2f} MiB (limit {args.limit_mib} MiB; the device tool's is 64)")
    call = invocation(args.carry)
    assert len(call["command"]) <= 2000 and len(call["carry"]) <= 8
    print("\nThe `run` call (device tool), from this checkout:\n" + json.dumps(call))
    if missing:
        print(f"missing: {' '.join(missing)} (run tools/bench/gpu_session.sh prepare)", file=sys.stderr)
        return 1
    if total > args.limit_mib * 2**20:
        print(f"too large: {total / 2**20:.2f} MiB > {args.limit_mib} MiB", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the session (on the GPU machine; --dry-run on CPU)")
    run.add_argument("--dry-run", action="store_true", help="the same steps on CPU with the tiny shape, in seconds")
    run.add_argument("--out", help="where the archive goes (default: $OUT)")
    run.add_argument("--carried", default=str(ROOT / CARRIED), help="the carried folder (default: .gpu)")
    run.add_argument("--site", default="/tmp/site", help="where the wheels are installed")
    run.add_argument("--work", default="/tmp/gpu-session", help="scratch: records, made models (16 GB for 8B), workdirs")
    run.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole session")
    run.add_argument("--rev", help="the commit measured (default: .gpu/rev, else git)")
    run.add_argument("--only", nargs="+", default=[], choices=[s.name for s in STEPS], metavar="STEP",
                     help=f"these steps only, after {', '.join(ALWAYS)} (which --skip can drop)")
    run.add_argument("--skip", nargs="+", default=[], choices=[s.name for s in STEPS], metavar="STEP")
    run.add_argument("--keep-going", action="store_true", help="run every step even when the install or the preflight failed")
    p = sub.add_parser("plan", help="here: what travels, against the limit, and the `run` call to make")
    p.add_argument("--carry", nargs="+", default=list(CARRY))
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    n = sub.add_parser("install-numba")
    n.add_argument("--site", required=True)
    n.add_argument("--carried", required=True)
    v = sub.add_parser("versions")
    v.add_argument("--site", required=True)
    v.add_argument("--out", required=True)
    for name in ("preflight", "decode-check"):
        q = sub.add_parser(name)
        q.add_argument("--out", required=True)
        q.add_argument("--cpu", action="store_true", help="the dry run: CUDA not required")
    args = parser.parse_args(argv)
    command: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": session, "plan": plan, "install-numba": install_numba, "versions": versions, "preflight": preflight,
        "decode-check": decode_check,
    }
    return command[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
