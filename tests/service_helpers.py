"""The service runners for tests: they live in ``tools.lib.servers``, beside the benchmarks that start servers the same way."""

from tools.lib.servers import RunningServer, ServerExited, free_port, running_server, running_worker, wait_serving

__all__ = ["RunningServer", "ServerExited", "free_port", "running_server", "running_worker", "wait_serving"]
