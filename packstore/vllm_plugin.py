"""vLLM's plugin entry point (``vllm.general_plugins``): registers ``PackstoreConnector`` by name, so
``--kv-transfer-config '{"kv_connector": "PackstoreConnector", ...}'`` needs no ``kv_connector_module_path``.

Kept apart from ``packstore.vllm`` and importing nothing at load: vLLM loads general plugins in every one of its
processes, before its CPU worker rebinds kernels by scanning every module in ``sys.modules``, a scan that llvmlite's
objects (through numba, which the pack reader uses) break. The connector module is imported only when vLLM builds it.
"""

from __future__ import annotations

CONNECTOR = "PackstoreConnector"
CONNECTOR_MODULE = "packstore.vllm"


def register() -> None:
    """Register the connector lazily by module path and class name (vLLM may load plugins more than once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # vLLM's process: it is there

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR, CONNECTOR_MODULE, CONNECTOR)
