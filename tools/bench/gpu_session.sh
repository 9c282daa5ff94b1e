#!/usr/bin/env bash
# The GPU session of issue 56: prepared here, run on the lent GPU machine as ONE command (tools/bench/gpu_session.py
# says what it runs; docs/benchmarks.md, "The GPU session", how and why).
#
#   here:       tools/bench/gpu_session.sh prepare     # .gpu/ (wheels, tokenizer, rev), the size check, the `run` call
#   GPU:        bash tools/bench/gpu_session.sh run    # carry .gpu and packstore/v1; $OUT/gpu-session-<rev>.tar.gz
#   CPU check:  tools/bench/gpu_session.sh run --dry-run --out DIR [--carried DIR]   (tests/eval/test_gpu_session.py)
#
# prepare downloads nothing the GPU machine will fetch later (it has no network): the Python 3.12 x86-64 wheels of
# what the worker, the service and the benchmarks import beyond the image (uvicorn and starlette included), pinned to the
# versions of this checkout's .venv where it has them; numba-cuda too, installed there only when the image's is older
# than 0.30. PYTHON (default .venv/bin/python, else python3) runs the module here; python3 runs it there.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE_PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

# What the GPU machine's image lacks (../shared/gpu/README.md, /work/.library/device/KINDS.md), and what the carried
# ones need in a newer version than the image may have: grpcio and protobuf match the generated packstore/v1 stubs.
WHEELS=(lmdb zstandard blake3 gguf grpcio grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos protobuf
        bm25s PyStemmer cryptography cffi pycparser uvicorn starlette anyio sniffio h11 click idna typing_extensions)
NUMBA_CUDA=numba-cuda==0.30.4   # installed on the GPU machine only if its own numba-cuda is older (the image's cuda-bindings stay)

pinned() {  # NAME==VERSION as this checkout's environment has it, else NAME (the newest)
    "$HERE_PY" - "$@" <<'PY'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
PY
}

download() {  # DIR SPEC...
    local dir=$1; shift
    mkdir -p "$dir"
    "$HERE_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dir" "$@"
}

prepare() {
    grep -qxF /.gpu/ .gitignore || { echo "expected /.gpu/ in .gitignore" >&2; exit 1; }
    [ -f packstore/v1/store_pb2.py ] || "$HERE_PY" -m packstore.rpc.codegen
    mapfile -t specs < <(pinned "${WHEELS[@]}")
    rm -rf .gpu/whl .gpu/numba
    download .gpu/whl "${specs[@]}"
    download .gpu/numba "$NUMBA_CUDA"
    if [ ! -f .gpu/tok/tokenizer.json ]; then
        HF_HUB_OFFLINE=1 "$HERE_PY" -c "from tools.bench.bench_gpu import load_tokenizer; load_tokenizer('smollm2-135m').save_pretrained('.gpu/tok')"
    fi
    local rev
    rev=$(git rev-parse --short HEAD)
    git diff --quiet HEAD -- packstore tools tests || rev="$rev+dirty"
    echo "$rev" > .gpu/rev
    ls .gpu/whl .gpu/numba
    "$HERE_PY" -m tools.bench.gpu_session plan
}

case ${1:-} in
    prepare) prepare ;;
    run) shift; export PYTHONUNBUFFERED=1; exec "${PYTHON:-python3}" -m tools.bench.gpu_session run "$@" ;;
    *) sed -n '2,13p' "$0"; exit 2 ;;
esac
