"""packstore: the service-side command. ``packstore info`` reports what this installation would use."""

from __future__ import annotations

import argparse
import sys

from packstore import __version__
from packstore.cli.program import CommandLine, emit_json
from packstore.cli.store_options import connection_options, spec_of
from packstore.format.header import EXACTNESS_MODES
from packstore.serving.connections import HTTP_CONNECTIONS, HTTP_CONNECTIONS_PER_PEER, METRICS_CONNECTIONS, METRICS_CONNECTIONS_PER_PEER
from packstore.serving.pacing import STREAM_SECONDS
from packstore.worker.config import DEFAULT_CACHE_BYTES, DEFAULT_LISTEN, DEFAULT_MAX_CONCURRENT, WorkerConfig


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
        "metrics_connections",
        "metrics_connections_per_peer",
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


def cmd_worker(args: argparse.Namespace) -> int:
    from packstore.worker.server import run_worker

    config = WorkerConfig(
        model=args.model,
        store=spec_of(args, prefix="store_"),
        engine=args.engine,
        engine_url=args.engine_url or "",
        listen=args.listen,
        cache_bytes=args.cache_bytes,
        host_cache_bytes=args.host_cache_bytes,
        reserve_memory=args.reserve_memory == "on",
        decode=args.decode,
        plane_join=args.plane_join,
        ref_ttl=args.ref_ttl,
        fetch_seconds=args.fetch_seconds,
        device=args.device,
        dtype=args.dtype,
        chat_template=args.chat_template or "",
        threads=args.threads,
        exactness=args.exactness,
        metrics=args.metrics or "",
        metrics_connections=args.metrics_connections,
        metrics_connections_per_peer=args.metrics_connections_per_peer,
        http=args.http or "",
        http_connections=args.http_connections,
        http_connections_per_peer=args.http_connections_per_peer,
        max_concurrent=args.max_concurrent,
        stream_seconds=args.stream_seconds,
        tls_cert=args.tls_cert or "",
        tls_key=args.tls_key or "",
        tls_client_ca=args.tls_client_ca or "",
        auth=args.auth or "",
        trusted_keys=args.trusted_keys or "",
        progress=not args.quiet and sys.stderr.isatty(),
    )
    run_worker(config)
    return 0


def _metrics_connection_options(parser, defaults: bool) -> None:
    """--metrics-connections and --metrics-connections-per-peer (``defaults``: argparse's; else None, the config's)."""
    parser.add_argument(
        "--metrics-connections", type=int, metavar="N", default=METRICS_CONNECTIONS if defaults else None,
        help=f"scrapes served at once, each on a thread of a pool; more are refused with 503 (default {METRICS_CONNECTIONS})",
    )
    parser.add_argument(
        "--metrics-connections-per-peer", type=int, metavar="N", default=METRICS_CONNECTIONS_PER_PEER if defaults else None,
        help=f"scrapes at once from one host (default {METRICS_CONNECTIONS_PER_PEER})",
    )


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
    _metrics_connection_options(p, defaults=False)
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

    p = cli.command("worker", cmd_worker, "answer with packs from --store: a model next to the accelerator, or a vLLM server's front")
    p.add_argument("--model", required=True, metavar="M", help="smollm2-135m, gemma3-270m, or a local Hugging Face model directory")
    p.add_argument(
        "--engine", choices=("transformers", "vllm"), default="transformers",
        help="who generates: transformers (the worker loads the model) or vllm (the vLLM OpenAI server at --engine-url, running "
        "PackstoreConnector over the same store; the worker loads only the tokenizer and renders, routes and streams)",
    )
    p.add_argument("--engine-url", metavar="URL", help="--engine vllm: the vLLM OpenAI server (http://HOST:PORT), private to the worker")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help="gRPC address of the Worker service")
    p.add_argument(
        "--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES, metavar="N", help="LRU of ready packs, in decoded KV bytes (default 2 GiB)"
    )
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
    p.add_argument(
        "--fetch-seconds", type=float, metavar="SECONDS",
        help="the longest an answer waits for the next layer of a pack from the store (without holding the device); past "
        "it the answer fails UNAVAILABLE, naming the pack (default 60)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--chat-template", metavar="FILE")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads for the model (default: torch's, one per core)")
    p.add_argument(
        "--exactness", default="default", choices=EXACTNESS_MODES,
        help="the exactness mode the model runs under, packs built here included (recorded in their built_on): deterministic "
        "(deterministic algorithms, reduced-precision reductions off), sdpa-B (one attention backend), or both; default: "
        "torch as it comes",
    )
    p.add_argument(
        "--metrics", metavar="HOST:PORT",
        help="serve Prometheus metrics here (:PORT or PORT: on loopback; with --auth, a scrape needs a bearer token, "
        "and reads its namespaces' series)",
    )
    _metrics_connection_options(p, defaults=True)
    p.add_argument(
        "--http", metavar="HOST:PORT",
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) here too (:PORT or PORT: on loopback; "
        "HTTPS with the TLS flags; with --auth, callers send 'Authorization: Bearer TOKEN')",
    )
    p.add_argument(
        "--http-connections", type=int, default=HTTP_CONNECTIONS, metavar="N",
        help=f"connections the HTTP API holds at once (an open file each, no thread); more get 503 (default {HTTP_CONNECTIONS})",
    )
    p.add_argument(
        "--http-connections-per-peer", type=int, default=HTTP_CONNECTIONS_PER_PEER, metavar="N",
        help=f"connections to the HTTP API at once from one host (default {HTTP_CONNECTIONS_PER_PEER})",
    )
    p.add_argument(
        "--stream-seconds", type=float, default=STREAM_SECONDS, metavar="S",
        help="cancel a Generate stream or an HTTP response whose reader took longer than this plus 1 s per 16 MiB sent (default 60)",
    )
    p.add_argument(
        "--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT, metavar="N",
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
