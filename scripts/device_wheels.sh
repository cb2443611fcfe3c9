#!/usr/bin/env bash
# Fill .whl/ with the wheels scripts/gpu_check.sh installs on a GPU machine
# that has no package-index access but has CuPy, numpy, msgpack, jinja2,
# aiohttp and pytest: the packages bitexact needs beyond those, at the
# versions of this checkout's .venv (run scripts/setup.sh first), for
# CPython $DEVICE_PYTHON (default 3.12) on x86-64 Linux. llama-cpp-python is
# the wheel pip built for setup.sh (GGML_NATIVE=OFF, tagged py3-none), taken
# from pip's cache or built again. It also cuts the default model into
# .model/NAME.SHA256.K-of-3 (36 MB, 36 MB, the rest; scripts/model_parts.sh), for a
# GPU machine reached by copies of at most 64 MiB (.whl with the third part, then
# one part each); gpu_check.sh puts them together again and checks the SHA-256.
#   bash scripts/device_wheels.sh          # then copy .whl and .model/*3-of-3 over
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PYTHON:-3.12}
[ -x .venv/bin/python ] || { echo "device_wheels: run scripts/setup.sh first (no .venv)" >&2; exit 2; }
PKGS=(gguf cryptography pynacl cffi pycparser diskcache openai httpx2 httpcore2 truststore h11 idna anyio jiter pydantic pydantic-core
      sniffio typing-inspection annotated-types typing-extensions werkzeug nvidia-ml-py)
pins=()
for p in "${PKGS[@]}"; do
    v=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null) \
        || { echo "device_wheels: $p is not installed in .venv" >&2; exit 2; }
    pins+=("$p==$v")
done
rm -rf .whl && mkdir .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/python -m pip wheel -q --no-deps -w .whl "llama-cpp-python==0.3.36"
model=$(.venv/bin/python -c "from node.gguf_model import default_model_path; print(default_model_path())")
bash scripts/model_parts.sh cut "$model" .model 36000000
ls .whl .model
du -sh .whl .model
