"""What vLLM runs of packstore's before any of packstore is imported: the plugin entry point (``vllm.general_plugins``)
that registers ``PackstoreConnector`` by name, and the capture run of ``packctl build --engine vllm``.

Both import nothing at load. vLLM loads general plugins in every one of its processes, before its CPU worker rebinds
kernels by scanning every module in ``sys.modules``, a scan that llvmlite's objects (through numba, which the pack
reader uses) break; and a capture run is started as ``python -m packstore.vllm_plugin capture SPEC`` so that the
engine's processes start from a process that has imported nothing of packstore. The connector module
(``packstore.vllm``) is imported only when vLLM builds it, after that scan.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONNECTOR = "PackstoreConnector"
CONNECTOR_MODULE = "packstore.vllm"
CAPTURE_CONNECTOR = "EngineCaptureConnector"  # the capture run's connector: the only one that takes capture_dir


def register() -> None:
    """Register the connector lazily by module path and class name (vLLM may load plugins more than once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # vLLM's process: it is there

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR, CONNECTOR_MODULE, CONNECTOR)


def capture(spec_path: str) -> None:
    """Prefill ``spec["token_ids"]`` once in vLLM serving ``spec["model"]``, the connector writing the K/V the engine
    computes into ``spec["capture_dir"]`` (packstore.kv.engine_build turns it into a pack).

    On CPU, vLLM's engine core runs in this process and its worker, which computes the K/V, in a process of its own with
    vLLM's CPU thread binding, as in vLLM's default layout there: the same K/V, from one Python process and one vLLM
    import fewer. Elsewhere vLLM lays out its processes as it does by default."""
    from vllm import LLM, SamplingParams  # vLLM is installed where this runs (packctl build --engine vllm checks)
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    if on_cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when the engine is made, not at import
    spec = json.loads(Path(spec_path).read_text())
    transfer = KVTransferConfig(
        kv_connector=CAPTURE_CONNECTOR,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": spec["capture_dir"], "automatic": False, "capture_dir": spec["capture_dir"]},
    )
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=transfer,
        distributed_executor_backend="mp" if on_cpu else None,  # vLLM's own on CPU: the worker in a process of its own (its OMP binding)
    )
    request = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"pack": False}})
    llm.generate([TokensPrompt(prompt_token_ids=spec["token_ids"])], request, use_tqdm=False)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "capture":
        sys.exit("usage: python -m packstore.vllm_plugin capture SPEC.json")
    capture(sys.argv[2])
