"""Listing at scale: ``ls`` and one ``ListPacks`` page in a store of 100,000 packs, local and over gRPC.

The packs are synthetic but their headers are realistic (2,048 token ids, 20 facts of about 100
characters, 30 chunk entries: ~19 KB of header JSON each), since listing cost used to grow with
header size. Their chunks are empty: listing never reads a chunk. They are bulk-loaded 1,000 per
write transaction (one transaction per pack would fsync 100,000 times); everything after that
goes through the public store API, the gRPC service (``packstore serve`` on 127.0.0.1) and the
``packctl`` command line. Every figure is a median of ``--repeats`` runs, taken in one run.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_listing [--packs 100000] [--repeats 5] [--keep DIR]

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from packstore.format import ChunkInfo, PackHeader  # noqa: E402
from packstore.format.header import CODEC  # noqa: E402
from packstore.store import LmdbStore, PackStore  # noqa: E402
from packstore.store.remote.store import RemoteStore  # noqa: E402
from tools.lib.benchlib import logger, machine_description, median, print_table, source_description, timed  # noqa: E402
from tools.lib.servers import running_server  # noqa: E402

TOKENS, FACTS, LAYERS, BATCH = 2048, 20, 30, 1000
MODEL_FP, TEMPLATE_FP = "5" * 64, "6" * 64
WORDS = ["river", "town", "bell", "baker", "1887", "north", "flows", "through", "famous", "for", "its", "the"]
log = logger("bench_listing")


def synthetic_header(index: int, rng: np.random.Generator) -> PackHeader:
    """A header shaped like a 2k-token pack of smollm2-135m (30 layers) with 20 facts."""
    return PackHeader(
        kind="knowledge",
        model_fp=MODEL_FP,
        template_fp=TEMPLATE_FP,
        model_name="smollm2-135m",
        token_ids=tuple(rng.integers(49152, size=TOKENS).tolist()),
        layers=LAYERS,
        kv_heads=3,
        head_dim=64,
        dtype="float32",
        facts=tuple(f"Fact {index}.{i}: " + " ".join(rng.choice(WORDS, size=16).tolist()) for i in range(FACTS)),
        raw=False,
        created="2026-11-23T00:00:00Z",
        codec=CODEC,
        chunks=tuple(ChunkInfo(layer, layer + 1, 2 * 3 * TOKENS * 64 * 4, 2_600_000, rng.bytes(32).hex()) for layer in range(LAYERS)),
    )


def bulk_load(store: LmdbStore, count: int) -> None:
    """``count`` synthetic packs, every tenth named, written 1,000 per transaction."""
    rng = np.random.default_rng(0)
    for start in range(0, count, BATCH):
        headers = [synthetic_header(i, rng) for i in range(start, min(start + BATCH, count))]

        def body(txn, headers: list = headers, start: int = start) -> None:
            for offset, header in enumerate(headers):
                name = f"pack-{start + offset}" if (start + offset) % 10 == 0 else None
                store._commit_in(txn, header, lambda _: b"", name)

        store._write(body)
        if start % 10_000 == 0:
            log(f"loaded {start + len(headers)} packs")


def measure(label: str, fn: Callable[[], object], repeats: int) -> tuple[str, str]:
    seconds = median([timed(fn)[0] for _ in range(repeats)])
    return label, f"{seconds * 1000:.1f}"


def store_rows(store: PackStore, count: int, repeats: int) -> list[tuple[str, str]]:
    full = store.list()
    assert len(full) == count, f"listed {len(full)} of {count} packs"
    middle = full[count // 2].key
    return [
        measure("list_page(100), first page", lambda: store.list_page(page_size=100), repeats),
        measure("list_page(100), from the middle", lambda: store.list_page(page_size=100, page_token=middle), repeats),
        measure("list_page(1000)", lambda: store.list_page(page_size=1000), repeats),
        measure("list_page(100), by name", lambda: store.list_page(page_size=100, name=f"pack-{count // 2}"), repeats),
        measure("resolve(name), any model", lambda: store.resolve(f"pack-{count // 2}"), repeats),
        measure(f"list(): all {count:,}", store.list, repeats),
    ]


def cli_rows(spec: str, repeats: int) -> list[tuple[str, str]]:
    """Whole ``packctl ls`` processes: the default first page against one pack and against ``--all``,
    as a table and as JSON (the default page should cost what one pack costs, whatever the store holds)."""
    packctl = str(Path(sys.executable).parent / "packctl")

    def run(*args: str) -> Callable[[], object]:
        return lambda: subprocess.run([packctl, "--store", spec, "ls", *args], check=True, capture_output=True)

    return [
        measure("packctl ls --limit 1 (process)", run("--limit", "1"), repeats),
        measure("packctl ls (process, default: first page of 100)", run(), repeats),
        measure("packctl ls --json (process, first page of 100)", run("--json"), repeats),
        measure("packctl ls --all (process)", run("--all"), repeats),
        measure("packctl ls --all --json (process)", run("--all", "--json"), repeats),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="where the store goes (default: a temp dir, removed after)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the store in this directory and reuse it on later runs")
    args = parser.parse_args()
    print(f"Machine: {machine_description({})}")
    print(f"Source: {source_description()}")
    with tempfile.TemporaryDirectory(prefix="packstore-bench-listing-", dir=args.workdir) as tmp:
        data = args.keep or Path(tmp) / "store"
        with LmdbStore(data) as store:
            if store.counts().packs != args.packs:
                bulk_load(store, args.packs)
            header_bytes = len(store.stat("pack-0").header.to_json())
            log("measuring the local store")
            local = store_rows(store, args.packs, args.repeats)
        local += cli_rows(str(data), args.repeats)
        log("measuring over gRPC")
        with running_server(data) as server, RemoteStore(server.url) as remote:
            remote_rows = store_rows(remote, args.packs, args.repeats) + cli_rows(server.url, args.repeats)
    print(f"Store: {args.packs:,} packs, headers of {header_bytes:,} bytes ({TOKENS} token ids, {FACTS} facts, {LAYERS} chunks)")
    rows = [(label, ms, remote_ms) for (label, ms), (_, remote_ms) in zip(local, remote_rows)]
    print_table(f"Listing {args.packs:,} packs, median ms of {args.repeats}", ["operation", "local", "grpc://"], rows)


if __name__ == "__main__":
    main()
