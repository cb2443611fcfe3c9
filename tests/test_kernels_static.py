"""CUDA sources: no atomics in the text, and with nvcc for sm_90 (the pinned
options): no register spills and no atom/red instruction in PTX or SASS."""

import os
import re
import shutil
import subprocess

import pytest

from node.backend_cuda import KERNEL_FILES
from node.kernels import COMPILE_OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "cuda")
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def _cuobjdump():
    found = shutil.which("cuobjdump") or (NVCC and shutil.which("cuobjdump", path=os.path.dirname(NVCC)))
    if found:
        return found
    try:  # the nvidia-cuda-cuobjdump wheel (a test dependency)
        import nvidia
        for base in nvidia.__path__:
            cand = os.path.join(base, "cu13", "bin", "cuobjdump")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


NVCC_OPTS = list(COMPILE_OPTIONS)  # the exact options NVRTC compiles with (nvcc accepts them)


def test_every_kernel_file_is_loaded():
    on_disk = sorted(n for n in os.listdir(CUDA) if n.endswith(".cu"))
    assert on_disk == sorted(KERNEL_FILES)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(CUDA) if n.endswith((".cu", ".cuh"))))
def test_no_atomics_in_source(name):
    with open(os.path.join(CUDA, name)) as f:
        text = f.read()
    assert not re.search(r"\batomic\w*\s*\(|\bred\.|\batom\.", text), name


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvcc_no_spills_no_atomic_instructions(tmp_path, name):
    src = os.path.join(CUDA, name)
    cubin, ptx = tmp_path / "k.cubin", tmp_path / "k.ptx"
    r = subprocess.run([NVCC, "-cubin", *NVCC_OPTS, "-Xptxas", "-v", "-I", CUDA, "-o", str(cubin), src],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert spills and all(s == ("0", "0") for s in spills), r.stderr
    assert "stack frame" not in r.stderr or re.findall(r"(\d+) bytes stack frame", r.stderr) == \
        ["0"] * len(re.findall(r"(\d+) bytes stack frame", r.stderr)), r.stderr
    r = subprocess.run([NVCC, "-ptx", *NVCC_OPTS, "-I", CUDA, "-o", str(ptx), src], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not re.search(r"\b(atom|red)\.", ptx.read_text())
    tool = _cuobjdump()
    assert tool, "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(tool),
               PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    assert sass.returncode == 0 and "Function" in sass.stdout
    assert not re.search(r"\b(ATOM|ATOMS|ATOMG|RED)\b", sass.stdout)
