"""packstore: the service-side command. ``packstore info`` reports what this installation would use."""

from __future__ import annotations

import argparse
import sys

from packstore import __version__
from packstore.cli.program import CommandLine, emit_json
from packstore.cli.store_options import connection_options, spec_of
from packstore.errors import InvalidInput

DEFAULT_HOST_CACHE_BYTES = 8 << 30  # the host cache of a worker on an accelerator, unless --host-cache-bytes says otherwise


def cmd_info(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from packstore.kv.models import WHEEL_MODELS, default_device, model_cache_dir
    from packstore.store import StoreSpec

    record = {
        "version": __version__,
        "store": StoreSpec.of(args.store).location,
        "model_cache": str(model_cache_dir()),
        "device": str(default_device()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "models": {
            alias: {"description": wheel.description, "installed": wheel.installed} for alias, wheel in WHEEL_MODELS.items()
        },
    }
    if args.json:
        emit_json(record)
        return 0
    for key in ("version", "store", "model_cache", "device", "torch", "transformers"):
        print(f"{key + ':':<14}{record[key]}")
    for alias, wheel in WHEEL_MODELS.items():
        state = "installed" if wheel.installed else "NOT installed"
        print(f"{'model:':<14}{alias} ({state}) - {wheel.description}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from packstore.service.config import load_config
    from packstore.service.server import serve

    names = (
        "data",
        "listen",
        "bulk_listen",
        "bulk_local",
        "bulk_per_principal",
        "hot_bytes",
        "upload_seconds",
        "stream_seconds",
        "metrics",
        "workers",
        "max_message_bytes",
        "max_pack_bytes",
        "max_chunk_bytes",
        "max_facts_bytes",
        "max_store_bytes",
        "auth",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "objects",
        "s3_endpoint",
        "cache_bytes",
    )
    overrides = {name: getattr(args, name) for name in names}
    serve(load_config(args.config, overrides))
    return 0


def decode_modes(args: argparse.Namespace) -> tuple[bool, bool]:
    """(decode on the device, join planes on the device) from ``--decode`` and the deprecated ``--plane-join``: device
    by default when the model runs on CUDA and numba-cuda is installed, else host; ``--decode device`` elsewhere is an
    error naming what is missing."""
    import torch

    from packstore.kv.models import default_device
    from packstore.packs.device_decode import unavailable

    device = torch.device(args.device) if args.device else default_device()
    if args.plane_join is not None:
        if args.decode is not None:
            raise InvalidInput("give --decode alone: --plane-join is deprecated, and --decode device joins the planes on the device too")
        print(
            "packstore worker: --plane-join is deprecated and goes in the next release: use --decode device (GPU decode and "
            "plane join) or --decode host",
            file=sys.stderr,
        )
        return False, args.plane_join == "device"
    missing = unavailable(device)
    if args.decode == "device" and missing:
        raise InvalidInput(f"--decode device: {missing} (use --decode host)")
    if args.decode is None and device.type == "cuda" and missing:
        print(f"packstore worker: decoding packs on the host ({missing})", file=sys.stderr)
    return (args.decode or ("device" if device.type == "cuda" else "host")) == "device" and not missing, False


def cmd_worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from packstore.kv.models import load_model
    from packstore.worker.server import serve_worker

    decode_on_device, join_on_device = decode_modes(args)
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidInput("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    from packstore.security.trust import TrustedKeys

    trusted = TrustedKeys.load(args.trusted_keys) if args.trusted_keys else None
    from packstore.answering.answer import REF_TTL_SECONDS

    ref_ttl = REF_TTL_SECONDS if args.ref_ttl is None else args.ref_ttl
    if not 0 <= ref_ttl <= 86400:  # also refuses NaN
        raise InvalidInput(f"--ref-ttl must be from 0 to 86400 seconds, got {args.ref_ttl}")
    if args.max_concurrent < 1:
        raise InvalidInput(f"--max-concurrent must be at least 1, got {args.max_concurrent}")
    if args.host_cache_bytes is not None and args.host_cache_bytes < 0:
        raise InvalidInput(f"--host-cache-bytes must be 0 or more, got {args.host_cache_bytes}")
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    lm = load_model(
        args.model, device=args.device, dtype=args.dtype, chat_template=template, progress=not args.quiet and sys.stderr.isatty()
    )
    from packstore.packs.buffers import HostBuffers
    from packstore.packs.decoder import Decoder
    from packstore.packs.memory import PackMemory

    host_cache_bytes = host_cache_bound(args.host_cache_bytes, lm.device.type)
    reserved = decoded_memory_bytes(args.cache_bytes, host_cache_bytes, lm.device.type) if args.reserve_memory == "on" else 0
    pinned = lm.device.type == "cuda"  # the host cache's packs cross to the GPU at link speed only from page-locked memory
    memory = PackMemory(reserved, background=True, pinned=pinned) if reserved else None
    decoder = Decoder(buffers=HostBuffers(memory, join_on_device=join_on_device, decode_on_device=decode_on_device))
    from packstore.security.auth import Auth
    from packstore.worker.namespace_readers import NamespaceReaders

    auth = Auth(args.auth) if args.auth else None
    with NamespaceReaders(spec_of(args, prefix="store_"), per_caller=auth is not None) as stores:
        serve_worker(
            lm,
            stores.get,
            args.listen,
            args.cache_bytes,
            host_cache_bytes=host_cache_bytes,
            metrics=args.metrics or "",
            trusted=trusted,
            auth=auth,
            ref_ttl=ref_ttl,
            decoder=decoder,
            tls_cert=args.tls_cert or "",
            tls_key=args.tls_key or "",
            tls_client_ca=args.tls_client_ca or "",
            http=args.http or "",
            max_concurrent=args.max_concurrent,
        )
    return 0


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


def _listener_options(parser) -> None:
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM certificate (chain) to serve TLS with")
    parser.add_argument("--tls-key", metavar="FILE", help="its private key")
    parser.add_argument("--tls-client-ca", metavar="FILE", help="require client certificates signed by this CA (mutual TLS)")


def build_cli() -> CommandLine:
    cli = CommandLine("packstore", "packstore services.")
    cli.command("info", cmd_info, "version, default store and model cache, device, installed models")

    p = cli.command("serve", cmd_serve, "serve a store over gRPC (with health, reflection and Prometheus metrics)")
    p.add_argument("--data", metavar="DIR", help="store directory; with --objects, where the caches live ($PACKSTORE_DATA)")
    p.add_argument(
        "--objects", metavar="s3://BUCKET/PREFIX", help="serve the packs in this bucket, replicas sharing it ($PACKSTORE_OBJECTS)"
    )
    p.add_argument("--s3-endpoint", metavar="URL", help="the object store's endpoint (default: $AWS_ENDPOINT_URL_S3, else AWS S3)")
    p.add_argument("--cache-bytes", type=int, metavar="N", help="with --objects: local cache per namespace, in bytes (default 1 GiB)")
    p.add_argument("--listen", metavar="HOST:PORT", help="gRPC address (default 127.0.0.1:50551; $PACKSTORE_LISTEN)")
    p.add_argument(
        "--bulk-listen", metavar="HOST:PORT",
        help="the bulk port GetPack sends chunks through (default: --listen's host, any free port; off: stream on gRPC only)",
    )
    p.add_argument(
        "--bulk-local", choices=("on", "off"),
        help="a local bulk socket too, which clients on this host read packs from without TCP (default on)",
    )
    p.add_argument(
        "--bulk-per-principal",
        type=int,
        metavar="N",
        help="bulk transfers one token (without --auth, one address) may run at once (default: half of 4 x workers)",
    )
    p.add_argument(
        "--hot-bytes",
        type=int,
        metavar="N",
        help="memory for packs kept hot for bulk reads, per namespace (default 1 GiB; 0: none)",
    )
    p.add_argument(
        "--upload-seconds", type=float, metavar="S",
        help="cancel an upload (PutPack, BuildBank, AddFacts) still running after this (default 600)",
    )
    p.add_argument(
        "--stream-seconds", type=float, metavar="S",
        help="cancel a stream or bulk transfer whose reader took longer than this plus 1 s per 16 MiB sent (default 60)",
    )
    p.add_argument(
        "--metrics", metavar="HOST:PORT",
        help="serve Prometheus metrics here (:PORT or PORT: on loopback; with --auth, a scrape needs a bearer token) ($PACKSTORE_METRICS)",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings (see docs/operations.md)")
    p.add_argument("--workers", type=int, help="transfer slots: streams, uploads, bank builds at once, shared per token (default 16)")
    p.add_argument("--max-message-bytes", type=int, help="gRPC message size limit (default 4 MiB)")
    p.add_argument("--max-pack-bytes", type=int, help="largest pack accepted by PutPack, in stored bytes (default 4 GiB)")
    p.add_argument(
        "--max-chunk-bytes", type=int, help="largest chunk accepted by PutPack, in stored bytes: bounds an upload's memory (default 64 MiB)"
    )
    p.add_argument("--max-facts-bytes", type=int, help="largest facts text accepted by one BuildBank/AddFacts call (default 256 MiB)")
    p.add_argument(
        "--max-store-bytes",
        type=int,
        help="most each namespace's data file may hold; full: writes RESOURCE_EXHAUSTED, reads go on (default: no limit)",
    )
    p.add_argument(
        "--auth", metavar="FILE", help="TOML file of tokens (name, sha256, namespaces, role); without it: no tokens, one namespace"
    )
    _listener_options(p)

    p = cli.command("worker", cmd_worker, "load a model next to the accelerator and answer with packs from --store")
    p.add_argument("--model", required=True, metavar="M", help="smollm2-135m, gemma3-270m, or a local Hugging Face model directory")
    p.add_argument("--listen", default="127.0.0.1:50552", metavar="HOST:PORT", help="gRPC address of the Worker service")
    p.add_argument("--cache-bytes", type=int, default=2 << 30, metavar="N", help="LRU of ready packs, in decoded KV bytes (default 2 GiB)")
    p.add_argument(
        "--host-cache-bytes", type=int, metavar="N",
        help="host cache under the device LRU: packs fetched from the store are kept in host memory, in decoded KV bytes, so one "
        "the device LRU evicted comes back with a copy instead of a store read (default 8 GiB on an accelerator, 0 = none on a CPU)",
    )
    p.add_argument(
        "--reserve-memory", choices=("on", "off"), default="on",
        help="reserve the host memory packs are decoded into (on a CPU device the LRU's, on an accelerator the host cache's), "
        "touch it in the background from the start, and decode packs into it (default on)",
    )
    p.add_argument(
        "--decode", choices=("device", "host"), default=None,
        help="where packs read from the store are decoded: device (on the model's CUDA device: the CPU threads check digests, "
        "one copy per layer carries the stored bytes, a GPU kernel decodes and joins them; needs numba-cuda, the gpu extra) or "
        "host (CPU threads decode into pinned memory); default: device on CUDA with numba-cuda installed, else host",
    )
    p.add_argument(
        "--plane-join", choices=("host", "device"), default=None,
        help="deprecated, goes in the next release (use --decode): device joins byte planes on the model's device after a "
        "CPU entropy decode",
    )
    p.add_argument(
        "--ref-ttl", type=float, metavar="SECONDS",
        help="use what the store said of a pack ref for this long without asking again: a warm answer makes no store "
        "round trip, and deletions, moved names and new signatures show within it (default 5; 0 asks every time)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--chat-template", metavar="FILE")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads for the model (default: torch's, one per core)")
    p.add_argument(
        "--metrics", metavar="HOST:PORT",
        help="serve Prometheus metrics here (:PORT or PORT: on loopback; with --auth, a scrape needs a bearer token, "
        "and reads its namespaces' series)",
    )
    p.add_argument(
        "--http", metavar="HOST:PORT",
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) here too (:PORT or PORT: on loopback; "
        "HTTPS with the TLS flags; with --auth, callers send 'Authorization: Bearer TOKEN')",
    )
    p.add_argument(
        "--max-concurrent", type=int, default=16, metavar="N",
        help="the worker's generation slots, gRPC Generate and HTTP completions together, shared fairly among callers (tokens, "
        "or hosts without --auth); a caller refused one gets RESOURCE_EXHAUSTED, HTTP 429 (default 16)",
    )
    _listener_options(p)
    p.add_argument("--token-file", metavar="FILE", help="the worker's own token for the store (default: $PACKSTORE_TOKEN)")
    p.add_argument(
        "--auth", metavar="FILE", help="require callers' tokens from this TOML file (as serve --auth); each caller reads its own namespace"
    )
    p.add_argument("--namespace", metavar="NS", help="the store namespace to read, when the token has several ($PACKSTORE_NAMESPACE)")
    connection_options(p, prefix="store-")
    p.add_argument(
        "--trusted-keys", metavar="FILE",
        help="inject only packs signed by one of these public keys (PEM blocks); unsigned or untrusted: FAILED_PRECONDITION",
    )
    return cli


def main(argv: list[str] | None = None) -> int:
    return build_cli().main(argv)


if __name__ == "__main__":
    sys.exit(main())
