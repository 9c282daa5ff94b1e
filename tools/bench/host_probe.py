"""What the host can move (issue 56): memory copy and BLAKE3 by thread count, host-to-device copies on one and two streams.

The CPU side of a fetch reads every stored byte at least twice (its digest, then its decode) and writes the decoded
planes once; these are the ceilings those passes meet on this host, beside the copy to the device:

- ``memcpy``: ``--size-mb`` of touched memory copied into touched memory, split into equal parts over 1, 2, 4, ...
  threads (numpy's copy releases the GIL), GB/s of bytes copied;
- ``blake3``: the same buffer hashed in ``--chunk-mb`` slices (a pack's chunks are a few MB), each slice whole on one
  thread of a pool of 1, 2, 4, ... threads, as the decoder's workers check digests (blake3-py releases the GIL), GB/s
  hashed;
- ``h2d``: host to device, from pinned and from pageable memory, the buffer sent whole on one CUDA stream and in two
  halves on two streams at once, GB/s (CUDA only; the records say n/a on CPU).

Every figure is the median of ``--repeats`` timed runs after one warm-up. Each result is a JSON line in ``--out``; a
table is printed. On the GPU machine (tools/bench/gpu_session.py runs it):

    python3 -m tools.bench.host_probe --out host_probe.jsonl

On CPU, in seconds: ``python -m tools.bench.host_probe --device cpu --size-mb 16 --threads 1 2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np
import torch

from tools.lib.benchlib import JsonlRecords, machine_description, median, print_table

GB, MB = 1e9, 1 << 20
DEFAULT_THREADS = (1, 2, 4, 8, 16)


def timed_median(fn: Callable[[], object], repeats: int, synchronize: Callable[[], None] = lambda: None) -> float:
    """Seconds, the median of ``repeats`` runs after one untimed warm-up."""
    fn()
    synchronize()
    seconds = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return median(seconds)


def parts(n: int, count: int) -> list[slice]:
    """``count`` contiguous slices covering ``range(n)``, as equal as can be."""
    bounds = [n * i // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def probe_memcpy(src: np.ndarray, dst: np.ndarray, threads: int, pool: ThreadPoolExecutor, repeats: int) -> float:
    pieces = parts(src.size, threads)

    def copy() -> None:
        list(pool.map(lambda s: np.copyto(dst[s], src[s]), pieces))

    return src.nbytes / timed_median(copy, repeats) / GB


def probe_blake3(src: np.ndarray, chunk: int, pool: ThreadPoolExecutor, repeats: int) -> float:
    view = memoryview(src).cast("B")
    slices = [view[start : start + chunk] for start in range(0, len(view), chunk)]

    def digest() -> None:
        list(pool.map(lambda piece: blake3.blake3(piece).digest(), slices))

    return src.nbytes / timed_median(digest, repeats) / GB


def copy_rate(source: torch.Tensor, target: torch.Tensor, streams: Sequence[torch.cuda.Stream], repeats: int) -> float:
    """GB/s of ``source`` copied into ``target``, in as many equal parts as ``streams``, each part on its own stream."""
    pieces = parts(source.numel(), len(streams))

    def send() -> None:
        for stream, piece in zip(streams, pieces):
            with torch.cuda.stream(stream):
                target[piece].copy_(source[piece], non_blocking=True)

    return source.numel() / timed_median(send, repeats, lambda: torch.cuda.synchronize(target.device)) / GB


def probe_h2d(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """GB/s host to ``device``: pinned and pageable, whole on one stream and halves on two streams at once."""
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    result: dict[str, float] = {}
    for memory in ("pinned", "pageable"):
        source = torch.ones(nbytes, dtype=torch.uint8, pin_memory=memory == "pinned")  # touched
        result[f"{memory}_1_stream_gbps"] = copy_rate(source, target, streams[:1], repeats)
        result[f"{memory}_2_streams_gbps"] = copy_rate(source, target, streams, repeats)
        del source
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    parser.add_argument("--size-mb", type=int, default=1024, help="buffer size (MiB) of every probe")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="BLAKE3 slice size (MiB): about a stored chunk")
    parser.add_argument("--threads", type=int, nargs="+", default=list(DEFAULT_THREADS), help="thread counts of memcpy and blake3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rev", default="unknown")
    parser.add_argument("--out", type=Path, default=Path("host_probe.jsonl"))
    args = parser.parse_args(argv)
    nbytes = args.size_mb * int(MB)
    records = JsonlRecords(args.out, {"rev": args.rev, "device": args.device.type})
    gpu = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "none"
    about = machine_description({"blake3": getattr(blake3, "__version__", "?")})
    records.record("machine", machine=about, gpu=gpu, cpus=os.cpu_count(), affinity=len(os.sched_getaffinity(0)), size_mb=args.size_mb)
    print(f"Machine: {about}; GPU: {gpu}; {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable)", flush=True)

    src = np.ones(nbytes, dtype=np.uint8)  # touched
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst[:] = 0
    rows = []
    base_copy = base_hash = 0.0
    for threads in args.threads:
        with ThreadPoolExecutor(threads) as pool:
            copy_gbps = probe_memcpy(src, dst, threads, pool, args.repeats)
            hash_gbps = probe_blake3(src, int(args.chunk_mb * MB), pool, args.repeats)
        base_copy, base_hash = base_copy or copy_gbps, base_hash or hash_gbps
        records.record("cpu", threads=threads, memcpy_gbps=copy_gbps, blake3_gbps=hash_gbps, chunk_mb=args.chunk_mb)
        rows.append([str(threads), f"{copy_gbps:.1f}", f"{copy_gbps / base_copy:.2f}x", f"{hash_gbps:.2f}", f"{hash_gbps / base_hash:.2f}x"])
    del src, dst
    print_table(f"Host memory: {args.size_mb} MiB copied and hashed (BLAKE3, {args.chunk_mb:g} MiB slices), median of {args.repeats}",
                ["threads", "memcpy GB/s", "vs 1 thread", "blake3 GB/s", "vs 1 thread"], rows)

    if args.device.type == "cuda":
        h2d = probe_h2d(nbytes, args.device, args.repeats)
        records.record("h2d", size_mb=args.size_mb, **h2d)
        print_table(f"Host to device, {args.size_mb} MiB, median of {args.repeats}", ["source", "1 stream GB/s", "2 streams GB/s"],
                    [[m, f"{h2d[f'{m}_1_stream_gbps']:.1f}", f"{h2d[f'{m}_2_streams_gbps']:.1f}"] for m in ("pinned", "pageable")])
    else:
        records.record("h2d", size_mb=args.size_mb, skipped=f"device {args.device.type}: no host-to-device copy")
        print("Host to device: n/a (no CUDA device)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
