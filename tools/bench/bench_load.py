"""Model load time: first load (GGUF dequantization) vs. later loads (cached safetensors).

Each load runs in a fresh process against a scratch model cache, so the first is really cold
for the converter and the second really uses the cache. Prints seconds and the ratio.

    python -m tools.bench.bench_load [--models smollm2-135m gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

LOAD = (
    "import json, time; t = time.perf_counter();"
    "from packstore.kv.models import load_model;"
    "lm = load_model({spec!r}, progress=False);"
    "print(json.dumps({{'seconds': time.perf_counter() - t}}))"
)


def timed_load(spec: str, cache: str) -> float:
    env = os.environ | {"PACKSTORE_MODEL_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", LOAD.format(spec=spec)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    args = parser.parse_args()
    print(f"{'model':<14} {'first load s':>12} {'later load s':>12} {'ratio':>7}")
    for spec in args.models:
        with tempfile.TemporaryDirectory(prefix="packstore-bench-cache-") as cache:
            first = timed_load(spec, cache)
            later = timed_load(spec, cache)
        print(f"{spec:<14} {first:>12.1f} {later:>12.1f} {first / later:>6.1f}x", flush=True)


if __name__ == "__main__":
    main()
