"""Worker settings: what ``packstore worker`` can be told, as a ``WorkerConfig``, and the rules that turn them into
the worker's parts (where packs decode, how large the host cache is, how much host memory to reserve), as
``packstore.service.config`` is for ``packstore serve``. The CLI only parses flags into a ``WorkerConfig``;
``packstore.worker.server.run_worker`` builds and serves the worker from one.

Nothing heavy is imported at load (torch and the model stack only inside ``decode_modes``, when it runs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from packstore.errors import InvalidInput
from packstore.serving.connections import HTTP_CONNECTIONS, HTTP_CONNECTIONS_PER_PEER, METRICS_CONNECTIONS, METRICS_CONNECTIONS_PER_PEER
from packstore.serving.pacing import STREAM_SECONDS

if TYPE_CHECKING:
    from packstore.store.spec import StoreSpec

DEFAULT_LISTEN = "127.0.0.1:50552"
DEFAULT_CACHE_BYTES = 2 << 30  # the device LRU of ready packs, in decoded KV bytes
DEFAULT_HOST_CACHE_BYTES = 8 << 30  # the host cache of a worker on an accelerator, unless host_cache_bytes says otherwise
MAX_REF_TTL = 86400.0
DEFAULT_MAX_CONCURRENT = 16  # the worker's generation slots, gRPC and HTTP together (--max-concurrent)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything ``packstore worker`` can be told (docs/operations.md, "The worker"); the flag of each field is its name
    with dashes (``--host-cache-bytes``), the store's are ``--store`` and its connection options."""

    model: str  # smollm2-135m, gemma3-270m, or a local Hugging Face model directory
    store: StoreSpec  # where packs are read (with a token, the caller's namespace of it)
    # who generates: "transformers" (the worker's own model) or "vllm" (the vLLM OpenAI server at engine_url, running
    # PackstoreConnector over the same store: the worker is its front, worker/front.py)
    engine: str = "transformers"
    engine_url: str = ""
    listen: str = DEFAULT_LISTEN  # gRPC address of the Worker service
    cache_bytes: int = DEFAULT_CACHE_BYTES
    host_cache_bytes: int | None = None  # None: DEFAULT_HOST_CACHE_BYTES on an accelerator, 0 (none) on a CPU
    reserve_memory: bool = True  # reserve and touch the host memory packs are decoded into (PackMemory)
    decode: str | None = None  # "device", "host"; None: device on CUDA with numba-cuda installed, else host
    plane_join: str | None = None  # deprecated: "device" joins byte planes on the device after a CPU entropy decode
    ref_ttl: float | None = None  # None: answering.answer.REF_TTL_SECONDS
    fetch_seconds: float | None = None  # None: packs.tensors.FETCH_SECONDS, the wait for a pack's next layer
    device: str | None = None  # torch device; None: cuda if available, else cpu
    dtype: str = "float32"
    chat_template: str = ""  # a file holding the model's chat template
    threads: int | None = None  # torch's intra-op threads; None: torch's own count
    # The exactness mode the model runs under, packs built here included (packstore.kv.exactness.EXACTNESS_MODES:
    # "deterministic", "sdpa-math", ...); "default" is torch as it comes. Which mode a worker on CUDA should default to
    # awaits the GPU measurement of tools/eval/eval_exactness.py --variants (issue 56).
    exactness: str = "default"
    metrics: str = ""  # HOST:PORT for Prometheus; empty: none
    metrics_connections: int = METRICS_CONNECTIONS  # scrapes at once (threads), all hosts together
    metrics_connections_per_peer: int = METRICS_CONNECTIONS_PER_PEER  # scrapes at once from one host
    http: str = ""  # HOST:PORT of the OpenAI-compatible API; empty: none
    http_connections: int = HTTP_CONNECTIONS  # connections to the HTTP API at once, all hosts together
    http_connections_per_peer: int = HTTP_CONNECTIONS_PER_PEER  # connections to the HTTP API at once from one host
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # generation slots, gRPC and HTTP together, shared among callers
    # what a Generate stream or an HTTP response may wait for its reader, plus 1 s per 16 MiB it sends (serving/pacing.py)
    stream_seconds: float = STREAM_SECONDS
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth: str = ""  # callers' tokens file; empty: no tokens, every caller in the default namespace
    trusted_keys: str = ""  # public keys a pack must be signed by; empty: any pack
    progress: bool = False  # show the model's loading progress


class DecodeFlags(Protocol):
    """What ``decode_modes`` reads: the model's device and the two decode flags."""

    @property
    def device(self) -> str | None: ...

    @property
    def decode(self) -> str | None: ...

    @property
    def plane_join(self) -> str | None: ...


def decode_modes(config: DecodeFlags) -> tuple[bool, bool]:
    """(decode on the device, join planes on the device) from ``decode`` and the deprecated ``plane_join``: device by
    default when the model runs on CUDA and numba-cuda is installed, else host; ``--decode device`` elsewhere is an
    error naming what is missing."""
    import torch

    from packstore.kv.models import default_device
    from packstore.packs.device_decode import unavailable

    device = torch.device(config.device) if config.device else default_device()
    if config.plane_join is not None:
        if config.decode is not None:
            raise InvalidInput("give decode alone: plane_join is deprecated, and decode='device' joins the planes on the device too")
        print(
            "packstore worker: --plane-join is deprecated and goes in the next release: use --decode device (GPU decode and "
            "plane join) or --decode host",
            file=sys.stderr,
        )
        return False, config.plane_join == "device"
    missing = unavailable(device)
    if config.decode == "device" and missing:
        raise InvalidInput(f"decode='device': {missing} (decode on the host instead)")
    if config.decode is None and device.type == "cuda" and missing:
        print(f"packstore worker: decoding packs on the host ({missing})", file=sys.stderr)
    return (config.decode or ("device" if device.type == "cuda" else "host")) == "device" and not missing, False


def host_cache_bound(asked: int | None, device_type: str) -> int:
    """The host cache's bound: ``asked`` (``--host-cache-bytes``), else 8 GiB on an accelerator and none on a CPU device,
    whose device LRU is host memory already."""
    if asked is None:
        return 0 if device_type == "cpu" else DEFAULT_HOST_CACHE_BYTES
    return asked


def decoded_memory_bytes(cache_bytes: int, host_cache_bytes: int, device_type: str) -> int:
    """The host memory packs are decoded into (``PackMemory``): on a CPU device the LRU's, which the host cache's
    packs share (both hold the same tensors there); on an accelerator the host cache's (0: none, packs are decoded
    straight to the device)."""
    return max(cache_bytes, host_cache_bytes) if device_type == "cpu" else host_cache_bytes
