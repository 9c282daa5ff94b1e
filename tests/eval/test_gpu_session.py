"""tools/bench/gpu_session.sh run --dry-run: the GPU session's one command, on CPU with the tiny shape (issue 56).

Every step runs as on the GPU machine (the carried wheels installed with pip from the carried folder alone, the
preflight, the tests collected, the host probe, bench_gpu's two steps, exactness), and the archive holds the manifest
and the records. It runs with an empty HOME, a minimal environment and an audit hook in every Python process it starts
(``sitecustomize``): a file opened outside the repository, the interpreter's own installation and the test's
temporary folder, or a connection to anything but loopback, is a failure: the session reads nothing the GPU machine
would lack and downloads nothing. The same sitecustomize hides boto3 (the s3 extra) and faiss, absent there too.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.helpers.tiny_model import make_tokenizer
from tools.bench import gpu_session

pytestmark = pytest.mark.eval
ROOT = Path(__file__).resolve().parents[2]

AUDIT = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, os, socket, sys

    _ALLOWED = tuple(p for p in os.environ["GPU_SESSION_AUDIT_ALLOWED"].split(os.pathsep) if p)
    _LOG = os.environ["GPU_SESSION_AUDIT_LOG"]
    _LOOPBACK = ("127.0.0.1", "::1", "localhost", "0.0.0.0", "", None)

    def _note(what):
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {sys.argv[:3]} {what}\\n")

    def _hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if path != _LOG and not path.startswith(_ALLOWED):
                _note(f"open {path}")
        elif event == "socket.connect" and args[0].family in (socket.AF_INET, socket.AF_INET6):
            if args[1][0] not in _LOOPBACK:
                _note(f"connect {args[1]}")
        elif event == "socket.getaddrinfo" and args[0] not in _LOOPBACK:
            _note(f"getaddrinfo {args[0]}")

    sys.addaudithook(_hook)


    class _Absent(importlib.abc.MetaPathFinder):  # what the GPU machine lacks and the session does not carry: not found
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("boto3", "botocore", "s3transfer", "faiss"):
                return None
            return self.inner.find_spec(name, path, target)

        def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the meta path finders
            return self.inner.find_distributions(*args, **kwargs)

        def invalidate_caches(self):
            self.inner.invalidate_caches()


    sys.meta_path[:] = [_Absent(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    """
)


def make_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one module, ``gpu_session_dry_probe``: what the dry run installs from the carried folder."""
    name, version = "gpu_session_dry_probe", "0.1"
    files = {
        f"{name}.py": b"VALUE = 56\n",
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}" for path, data in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join([*record, f"{name}-{version}.dist-info/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def test_the_session_runs_on_cpu_offline_into_one_archive(tmp_path: Path) -> None:
    carried, out, home, audit = tmp_path / "carried", tmp_path / "out", tmp_path / "home", tmp_path / "audit"
    make_wheel(carried / "whl")
    make_tokenizer().save_pretrained(carried / "tok")
    (carried / "rev").write_text("dry+run\n")
    for folder in (out, home, audit):
        folder.mkdir()
    (audit / "sitecustomize.py").write_text(AUDIT)
    log = tmp_path / "audit.log"
    allowed = [str(ROOT) + os.sep, str(tmp_path) + os.sep, sys.prefix + os.sep, sys.base_prefix + os.sep, sys.exec_prefix + os.sep,
               "/usr/", "/lib", "/etc/", "/proc/", "/sys/", "/dev/"]
    env = {
        "PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(home), "OUT": str(out), "PYTHON": sys.executable,
        "PYTHONPATH": str(audit), "GPU_SESSION_AUDIT_ALLOWED": os.pathsep.join(allowed), "GPU_SESSION_AUDIT_LOG": str(log),
        "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull,
    }
    probe = subprocess.run([sys.executable, "-c", "open('/nonexistent-gpu-session-probe')"], env=env, capture_output=True, text=True)
    assert "FileNotFoundError" in probe.stderr and "open /nonexistent-gpu-session-probe" in log.read_text(), "the audit hook is not on"
    blocked = subprocess.run([sys.executable, "-c", "import boto3"], env=env, capture_output=True, text=True)
    assert "No module named 'boto3'" in blocked.stderr
    log.unlink()
    argv = ["bash", str(ROOT / "tools/bench/gpu_session.sh"), "run", "--dry-run", "--carried", str(carried),
            "--site", str(tmp_path / "site"), "--work", str(tmp_path / "work"), "--budget", "300"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[:4000] + done.stderr[-2000:]

    archive = out / "gpu-session-dry-run.tar.gz"
    assert [p.name for p in out.iterdir()] == [archive.name]  # one file comes back
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("gpu-session-dry-run/manifest.json"))  # type: ignore[arg-type]
        versions = json.load(tar.extractfile("gpu-session-dry-run/versions.json"))  # type: ignore[arg-type]
        bench = [json.loads(line) for line in tar.extractfile("gpu-session-dry-run/bench_gpu.jsonl")]  # type: ignore[union-attr]
        worker = [json.loads(line) for line in tar.extractfile("gpu-session-dry-run/bench_worker.jsonl")]  # type: ignore[union-attr]
        worker_log = tar.extractfile("gpu-session-dry-run/bench_worker.log").read().decode()  # type: ignore[union-attr]
    steps = {s["name"]: s for s in manifest["steps"]}
    assert list(steps) == [s.name for s in gpu_session.STEPS]
    assert {name: s["status"] for name, s in steps.items()} == dict.fromkeys(steps, "ok"), manifest
    assert manifest["rev"] == "dry+run" and manifest["dry_run"] and manifest["total_s"] < 300
    assert all(s["seconds"] <= s["timeout_s"] + 1 for s in steps.values())
    assert "gpu_session_dry_probe-0.1" in versions["installed_from_carried_wheels"]
    for record in ("preflight.json", "decode_check.json", "tests.xml", "host_probe.jsonl", "exactness/cpu-float32.json",
                   "servers/tiny-worker.log", "servers/tiny-worker-local.log", "servers/tiny-serve.log"):
        assert f"gpu-session-dry-run/{record}" in names, record
    assert {r["part"] for r in bench} >= {"machine", "build", "ttft", "fetch", "buffers", "decode", "convoy", "total"}
    assert "(d) The worker, one new token" in worker_log  # (tests/eval/test_bench_gpu.py leaves it here)
    served = [r for r in worker if r["part"] == "worker"]
    assert [r["store"] for r in served] == ["grpc", "local"]  # over gRPC, then on the store's host reading its LMDB directory
    assert all(r["size"] == 300 and min(r["cold_ms"], r["warm_ms"]) > 0 and r["repeats"] == 1 for r in served)
    assert not {"build", "ttft", "fetch", "decode", "convoy"} & {r["part"] for r in worker}  # the worker step builds no store parts
    assert not (tmp_path / "work" / "models").exists()  # the made models went with the session

    assert not log.exists(), log.read_text()[:3000]  # nothing read outside, nothing fetched
    assert not any(home.rglob("huggingface")), "a Hugging Face cache was made under HOME"


def test_the_run_call_fits_the_device_tool(tmp_path: Path) -> None:
    call = gpu_session.invocation(gpu_session.CARRY)
    assert len(call["command"]) <= 2000 and len(call["carry"]) <= 8 and call["timeout_s"] <= 600
    assert gpu_session.BUDGET_S + 10 < call["timeout_s"] and gpu_session.BUDGET_S < 550
    assert sum(s.floor for s in gpu_session.STEPS) + gpu_session.RESERVE_S < gpu_session.BUDGET_S
    sizes = gpu_session.tree_bytes(ROOT, [])
    assert sizes["tree"] < 20 * 2**20  # the tracked tree leaves room for the wheels within 60 MiB
