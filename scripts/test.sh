#!/usr/bin/env bash
# Set up, then run the CPU test suite (GPU tests are marked `gpu` and run on
# the device with scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"   # exec: a signal to this script reaches pytest
