"""Tenant B's read times with and without tenant A holding the same pack hot (issue 34: hot packs per namespace).

The script starts ``packstore serve --auth`` on 127.0.0.1 with two tenants, ``a`` and ``b``, each with a write token
for its own namespace, and a ``--hot-bytes`` that holds one pack. Both namespaces' stores hold pack P (the same
content, so the same key and header digest); A's also holds Q, another pack of the same shape. Each repetition,
in a rotating order:

- same:  A reads P whole (hot in A's namespace, evicting whatever was hot), then B reads P (timed);
- other: A reads Q whole (the same eviction, another pack), then B reads P (timed);
- hot:   B reads P again right away (timed): B's own hot copy, i.e. what B would see if A's copy served B.

B's read is ``RemoteStore.fetch`` into CPU tensors over the local bulk socket, as a client on the service's host
does by default. If hot copies crossed tenants, ``same`` would read like ``hot``; kept apart, ``same`` reads like
``other``. The packs have random float32 K/V in smollm2-135m's shape (30 layers, 3 KV heads x 64) at ``--tokens``.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_tenants.py [--repeats 15] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import tempfile
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_format import make_pack  # noqa: E402

from benchlib import elapsed, logger, machine_description, median, print_table, source_description, timed  # noqa: E402
from packstore.packs.decoder import Decoder  # noqa: E402
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack  # noqa: E402
from packstore.rpc.channel import Connection  # noqa: E402
from packstore.rpc.remote import RemoteStore  # noqa: E402
from packstore.store import LmdbStore  # noqa: E402
from packstore.store.namespaces import namespace_path  # noqa: E402

DECODER = Decoder()  # the chunk threads every read of this run decodes on, as a program's entry point makes one
from service_helpers import running_server  # noqa: E402

log = logger("bench_tenants")
TOKENS = {"a": "bench-secret-a", "b": "bench-secret-b"}
ORDERS = (("same", "other"), ("other", "same"))


def tokens_file(path: Path) -> Path:
    path.write_text(
        "\n".join(
            f'[[token]]\nname = "{ns}-writer"\nsha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"\nnamespaces = ["{ns}"]\nrole = "write"\n'
            for ns, secret in TOKENS.items()
        )
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repetitions")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per pack")
    args = parser.parse_args()
    shared = make_pack(layers=30, tokens=args.tokens, heads=3, dim=64)
    other = make_pack(layers=30, tokens=args.tokens + 1, heads=3, dim=64)
    encoded_shared, encoded_other = encode_pack(shared), encode_pack(other)
    print(f"Machine: {machine_description({'grpcio': grpc.__version__})}")
    print(f"Source: {source_description()}")
    print(f"Packs: {args.tokens} tokens, float32, {encoded_shared.header.raw_bytes / 1e6:.0f} MB of KV, {encoded_shared.stored_bytes / 1e6:.0f} MB stored")
    with tempfile.TemporaryDirectory(prefix="packstore-bench-tenants-") as tmp:
        data = Path(tmp) / "data"
        for namespace, packs in (("a", (encoded_shared, encoded_other)), ("b", (encoded_shared,))):
            with LmdbStore(namespace_path(data, namespace)) as store:
                for encoded in packs:
                    store.put(encoded)
        shared_key, other_key = encoded_shared.header.key, encoded_other.header.key
        hot_bytes = str(int(encoded_shared.stored_bytes * 1.5))
        with running_server(data, "--auth", str(tokens_file(Path(tmp) / "tokens.toml")), "--hot-bytes", hot_bytes) as server:
            a = RemoteStore(server.url, connection=Connection(token=TOKENS["a"]))
            b = RemoteStore(server.url, connection=Connection(token=TOKENS["b"]))
            times: dict[str, list[float]] = {"same": [], "other": [], "hot": []}
            for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
                for condition in ORDERS[repeat % 2]:
                    PackReader(a, DECODER).fetch(shared_key if condition == "same" else other_key)
                    gc.collect()
                    seconds, _ = timed(lambda: PackReader(b, DECODER).fetch(shared_key))
                    hot_seconds, _ = timed(lambda: PackReader(b, DECODER).fetch(shared_key))
                    if repeat:
                        times[condition].append(seconds)
                        times["hot"].append(hot_seconds)
                log(f"repetition {repeat}/{args.repeats}")
            a.close()
            b.close()
    same, different, hot = (median(times[k]) * 1000 for k in ("same", "other", "hot"))
    rows = [
        ["B reads P cold, A holds P hot (same)", f"{same:.1f}", f"{same / different:.2f}x"],
        ["B reads P cold, A holds Q hot (other)", f"{different:.1f}", "1.00x"],
        ["B reads P from its own hot copy (hot)", f"{hot:.1f}", f"{hot / different:.2f}x"],
    ]
    print_table(f"Tenant B's RemoteStore.fetch, median of {args.repeats} (ms)", ["read", "ms", "vs other"], rows)
    print(f"\nTotal run time: {elapsed():.0f} s")


if __name__ == "__main__":
    main()
