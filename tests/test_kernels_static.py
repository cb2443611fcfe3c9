"""CUDA sources: no atomics in the text; with nvcc for sm_90a (the pinned
options): no register spills and no atom/red instruction in PTX or SASS; and
the cubins the node itself builds with NVRTC (no GPU needed to compile): no
atom/red instruction, no stack or local memory, every kernel waiting for the
previous grid before it touches memory, and a compile error is one GpuError
line."""

import os
import re
import shutil
import subprocess

import pytest

from node.backend_cuda import KERNEL_FILES, STEP_FILE, GpuError, _nvrtc_compile
from node.kernels import COMPILE_OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "cuda")
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def _cuobjdump_env():
    """cuobjdump and an environment in which it finds nvdisasm."""
    tool = _cuobjdump()
    assert tool, "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"
    return tool, dict(os.environ, NVDISASM_PATH=os.path.dirname(tool),
                      PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))


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


SASS_ATOMIC = r"\b(ATOM|ATOMS|ATOMG|RED|REDG|REDAS)\b"  # sm_90 opcodes (REDG: atomicAdd with unused result)
NVCC_OPTS = list(COMPILE_OPTIONS)  # the exact options NVRTC compiles with (nvcc accepts them)


def test_every_kernel_file_is_loaded():
    on_disk = sorted(n for n in os.listdir(CUDA) if n.endswith(".cu"))
    assert on_disk == sorted(KERNEL_FILES + (STEP_FILE,))


def test_every_kernel_has_a_numpy_twin_of_its_name():
    """docs/determinism.md: each kernel in cuda/ has a numpy twin of the same name in the
    reference engine (node/reference.py, node/sampler.py); `step` fuses the per-op kernels
    and has their twins, and argmax's twin is numpy's."""
    import node.reference
    import node.sampler
    kernels = set()
    for name in os.listdir(CUDA):
        if name.endswith(".cu"):
            with open(os.path.join(CUDA, name)) as f:
                src = re.sub(r"//[^\n]*|/\*.*?\*/", "", f.read(), flags=re.S)
            kernels |= set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__\w+__\s*\([^)]*\)\s*)*(\w+)\s*\(', src))
    assert {"step", "argmax", "matmul_q", "matmul_rowint", "attention_split"} <= kernels, sorted(kernels)
    missing = sorted(k for k in kernels - {"step", "argmax"}
                     if not any(callable(getattr(m, k, None)) for m in (node.reference, node.sampler)))
    assert not missing, f"kernels without a numpy twin of their name: {missing}"


def _define(name: str, file: str) -> int:
    """The integer a kernel source #defines (the default of an #ifndef-guarded tile constant)."""
    with open(os.path.join(CUDA, file)) as f:
        found = re.findall(rf"^#define {name} (\d+)\b", f.read(), re.M)
    assert len(found) == 1, (name, file, found)
    return int(found[0])


def test_launch_constants_mirror_the_sources():
    """The launch geometry node/backend_cuda.py mirrors by hand, and contract 2's input code
    width node/reference.py fixes, equal the kernels' #defines."""
    import node.backend_cuda as bc
    from node.reference import SPLIT_KV, X_CODE_BITS
    for name, file, value in (("MQ_TM", "matmul.cu", bc.MQ_TM), ("MQ_ROWS", "matmul.cu", bc.MQ_ROWS),
                              ("MF_WARPS", "matmul.cu", bc.MF_WARPS), ("MF_ROWS", "matmul.cu", bc.MF_ROWS),
                              ("MQ_SLOTS", "matmul.cu", bc.MQ_SLOTS), ("ST_TM", "step.cu", bc.ST_TM),
                              ("ST_WARPS", "step.cu", bc.ST_WARPS), ("ST_OREC", "step.cu", bc.ST_OREC),
                              ("SPLIT_KV", "common.cuh", SPLIT_KV), ("RI_XBITS", "matmul.cu", X_CODE_BITS)):
        assert _define(name, file) == value, f"{file} {name} = {_define(name, file)}, Python has {value}"


def _record_asserts(rec_bytes, rowint_fields=None) -> str:
    """static_asserts that cuda/matmul.cu's record layout equals ``rec_bytes(qtype)`` and
    node/backend_cuda.py MQ_NIBBLES for every type matmul_q reads, and that bx_ri_geometry
    holds RowintGeometry's fields (``rowint_fields``, default its count) and RI_NONFINITE."""
    import node.backend_cuda as bc
    n = len(bc.RowintGeometry._fields) if rowint_fields is None else rowint_fields
    lines = [f'static_assert(sizeof(bx_ri_geometry) == {n + 1} * sizeof(int), "bx_ri_geometry size");']
    for qt in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        i = bc.QTYPE_IDS[qt]
        lines.append(f'static_assert(bx_mq_rec({i}) == {rec_bytes(qt)}, "{qt}: record bytes");')
        lines.append(f'static_assert(bx_mq_nibbles({i}) == {str(qt in bc.MQ_NIBBLES).lower()}, "{qt}: nibbles");')
    return "\n".join(lines)


def test_record_layout_mirrors_the_kernel():
    """node/backend_cuda.py packs records of mq_record_bytes(qtype) bytes (4-bit codes
    for MQ_NIBBLES); cuda/matmul.cu's constexpr bx_mq_rec and bx_mq_nibbles must agree,
    and bx_ri_geometry must hold RowintGeometry's fields and RI_NONFINITE.
    Checked by compiling the kernel source with static_asserts of the Python values;
    a wrong value fails the compile."""
    import node.backend_cuda as bc
    with open(os.path.join(CUDA, "matmul.cu")) as f, open(os.path.join(CUDA, "common.cuh")) as h:
        src, header = f.read(), h.read()
    _nvrtc_compile("matmul.cu", src + "\n" + _record_asserts(bc.mq_record_bytes), header)
    with pytest.raises(GpuError, match="Q4_K: record bytes"):
        _nvrtc_compile("matmul.cu", src + "\n" + _record_asserts(
            lambda qt: bc.mq_record_bytes(qt) + (16 if qt == "Q4_K" else 0)), header)
    with pytest.raises(GpuError, match="bx_ri_geometry size"):
        _nvrtc_compile("matmul.cu", src + "\n" + _record_asserts(bc.mq_record_bytes, 5), header)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(CUDA) if n.endswith((".cu", ".cuh"))))
def test_no_atomics_in_source(name):
    with open(os.path.join(CUDA, name)) as f:
        text = f.read()
    assert not re.search(r"\batomic\w*\s*\(|\bred\.|\batom\.", text), name


# cuda/step.cu is compiled for each model's dimensions (node/backend_cuda.py step_defines):
# its defaults (Llama-3.1-8B, BF16), the GPU tests' small shape in F16, Llama-3.2-1B in BF16,
# edges step_defines accepts (F16 with 8 query heads of head_dim 128 on a KV head, BF16 with
# 16 of head_dim 64, BF16 multi-head with head_dim 32); and the defaults with the phase stamps
# of scripts/profile_step.py --one-launch
STEP_SHAPES = [(), ("-DST_D=256", "-DST_F=512", "-DST_HD=64", "-DST_H=4", "-DST_HKV=2", "-DST_WT=1"),
               ("-DST_D=2048", "-DST_F=8192", "-DST_HD=64", "-DST_H=32", "-DST_HKV=8", "-DST_WT=2"),
               ("-DST_D=4096", "-DST_F=14336", "-DST_HD=128", "-DST_H=32", "-DST_HKV=4", "-DST_WT=1"),
               ("-DST_D=4096", "-DST_F=11008", "-DST_HD=64", "-DST_H=64", "-DST_HKV=4", "-DST_WT=2"),
               ("-DST_D=1024", "-DST_F=2816", "-DST_HD=32", "-DST_H=32", "-DST_HKV=32", "-DST_WT=2"),
               ("-DST_TIMES=1",)]
BUILDS = [(n, ()) for n in KERNEL_FILES] + [(STEP_FILE, d) for d in STEP_SHAPES]


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("name, defines", BUILDS)
def test_nvcc_no_spills_no_atomic_instructions(tmp_path, name, defines):
    src = os.path.join(CUDA, name)
    cubin, ptx = tmp_path / "k.cubin", tmp_path / "k.ptx"
    r = subprocess.run([NVCC, "-cubin", *NVCC_OPTS, *defines, "-Xptxas", "-v", "-I", CUDA, "-o", str(cubin), src],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    _assert_no_spills(r.stderr)
    r = subprocess.run([NVCC, "-ptx", *NVCC_OPTS, *defines, "-I", CUDA, "-o", str(ptx), src], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert not re.search(r"\b(atom|red)\.", ptx.read_text())
    _assert_sass_atomic_free(_sass(cubin))


def _assert_no_spills(ptxas_log: str):
    """ptxas -v reported its functions, none with spill stores or loads or a stack frame."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    assert spills, f"no ptxas -v report: {ptxas_log}"
    assert all(s == ("0", "0") for s in spills), f"register spills: {ptxas_log}"
    assert all(f == "0" for f in re.findall(r"(\d+) bytes stack frame", ptxas_log)), f"stack frame: {ptxas_log}"


def _sass(cubin) -> str:
    """The cubin's SASS as cuobjdump prints it."""
    tool, env = _cuobjdump_env()
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    assert sass.returncode == 0 and "Function" in sass.stdout, sass.stderr
    return sass.stdout


def _assert_sass_atomic_free(sass: str):
    assert not re.search(SASS_ATOMIC, sass)


SASS_MEMORY = r"\b(LDG|STG|LDGSTS|LD|ST|UBLKCP|UTMALDG|EXIT|RET)\b"  # global loads/stores, cp.async, exit
SASS_WAIT = r"\bACQBULK\b"  # griddepcontrol.wait (cuda/common.cuh bx_pdl_wait)


def _assert_sass_waits_first(sass: str):
    """Each kernel function waits for the previous grid (ACQBULK) before, in
    address order, its first global load or store, cp.async or exit. Only L2
    prefetch hints (CCTL) may come first. This reads the code linearly; a
    kernel's other paths are covered by the GPU tests."""
    for f in re.split(r"\n\s*Function : ", sass)[1:]:
        name, code = f.split("\n", 1)
        ops = [ln.split(";")[0] for ln in code.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)]
        first_wait = next((i for i, op in enumerate(ops) if re.search(SASS_WAIT, op)), None)
        assert first_wait is not None, f"{name}: no griddepcontrol.wait"
        early = [op.strip() for op in ops[:first_wait] if re.search(SASS_MEMORY, op)]
        assert not early, f"{name}: {early[0]} before griddepcontrol.wait"


@pytest.mark.parametrize("name, defines", BUILDS)
def test_nvrtc_cubins_are_atomic_free_wait_first_without_local_memory(tmp_path, name, defines):
    """The node's own build path (node/backend_cuda.py _nvrtc_compile, pinned
    options): no atomic, no stack or local memory, and, since kernels are launched
    with programmatic dependent launch (node/backend_cuda.py PdlKernel), none
    touches memory an earlier kernel writes before it waits for that kernel."""
    with open(os.path.join(CUDA, name)) as f, open(os.path.join(CUDA, "common.cuh")) as h:
        cubin_bytes = _nvrtc_compile(name, f.read(), h.read(), COMPILE_OPTIONS + defines)
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(cubin_bytes)
    sass = _sass(cubin)
    _assert_sass_atomic_free(sass)
    _assert_sass_waits_first(sass)
    _assert_no_local_memory(_res_usage(cubin))


def _res_usage(cubin) -> list[tuple[str, str, str, str]]:
    """(function, registers, stack bytes, local bytes) of each function, from cuobjdump -res-usage."""
    tool, env = _cuobjdump_env()
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, env=env)
    usage = re.findall(r"Function (\w+):\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res.stdout)
    assert res.returncode == 0 and usage, res.stdout + res.stderr
    return usage


def _assert_no_local_memory(usage):
    """Every function of :func:`_res_usage` has no stack and no local memory."""
    assert all(stack == "0" and local == "0" for _, _, stack, local in usage), f"local memory: {usage}"


# a kernel that needs local memory: an array written at indices known only at run time
PLANTED_LOCAL = ('extern "C" __global__ void k(float* o, int i) { float a[64]; '
                 'for (int j = 0; j < 64; ++j) a[j] = o[j]; '
                 'for (int j = 0; j < 64; ++j) a[(j * i) & 63] += a[j]; o[0] = a[i & 63]; }')
# a kernel that spills under a cap of 16 registers: 48 values live at once
PLANTED_SPILL = ('extern "C" __global__ void k(float* o) { float v[48], s = 0.0f;\n'
                 '#pragma unroll\nfor (int j = 0; j < 48; ++j) v[j] = o[j * 977 + threadIdx.x];\n'
                 '#pragma unroll\nfor (int j = 0; j < 48; ++j) s += v[j] * v[47 - j] * v[(j * 5) % 48];\n'
                 'o[threadIdx.x] = s; }')


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("src, opts, needle, flag", [(PLANTED_LOCAL, (), "stack frame", "stack frame"),
                                                     (PLANTED_SPILL, ("-maxrregcount=16",), "spill stores",
                                                      "register spills")])
def test_the_spill_check_catches_planted_spills_and_stack_frames(tmp_path, src, opts, needle, flag):
    """The nvcc check can fail: a stack frame and spills are flagged."""
    path = tmp_path / "planted.cu"
    path.write_text(src)
    r = subprocess.run([NVCC, "-cubin", *NVCC_OPTS, *opts, "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                        str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"[1-9]\d* bytes {needle}", r.stderr), r.stderr
    with pytest.raises(AssertionError, match=flag):
        _assert_no_spills(r.stderr)


def test_the_local_memory_check_catches_a_planted_array(tmp_path):
    """The node's build path check can fail: a kernel with local memory is flagged."""
    cubin = tmp_path / "planted.cubin"
    cubin.write_bytes(_nvrtc_compile("planted.cu", PLANTED_LOCAL, ""))
    usage = _res_usage(cubin)
    assert any(stack != "0" or local != "0" for _, _, stack, local in usage), usage
    with pytest.raises(AssertionError, match="local memory"):
        _assert_no_local_memory(usage)


@pytest.mark.parametrize("body", ["o[0] = 1.0f; bx_pdl_wait();", "if (o[1] > 0.0f) return; bx_pdl_wait(); o[0] = 1.0f;",
                                  "o[0] = 2.0f;"])
def test_the_wait_check_catches_early_access(tmp_path, body):
    """The wait check can fail: a store, a load and return, or no wait at all."""
    with open(os.path.join(CUDA, "common.cuh")) as h:
        header = h.read()
    src = '#include "common.cuh"\nextern "C" __global__ void k(float* o) { %s }' % body
    cubin = tmp_path / "planted.cubin"
    cubin.write_bytes(_nvrtc_compile("planted.cu", src, header))
    with pytest.raises(AssertionError, match="before griddepcontrol.wait|no griddepcontrol.wait"):
        _assert_sass_waits_first(_sass(cubin))


@pytest.mark.parametrize("body", ["atomicAdd(o + 1, 1.0f);", "o[2] = atomicAdd(o + 1, 1.0f);",
                                  "__shared__ float s; atomicAdd(&s, 1.0f); o[3] = s;"])
def test_the_sass_check_catches_planted_atomics(tmp_path, body):
    """The SASS check can fail: global (REDG, ATOMG) and shared (ATOMS) atomics are flagged."""
    cubin = tmp_path / "planted.cubin"
    cubin.write_bytes(_nvrtc_compile("planted.cu", 'extern "C" __global__ void k(float* o) { %s }' % body, ""))
    sass = _sass(cubin)
    with pytest.raises(AssertionError):
        _assert_sass_atomic_free(sass)


def test_step_refuses_heads_that_would_spill():
    """cuda/step.cu refuses at compile time the head grouping step_defines refuses
    (16 query heads of head_dim 128 on a KV head: 64 query values per lane, which spill)."""
    with open(os.path.join(CUDA, STEP_FILE)) as f, open(os.path.join(CUDA, "common.cuh")) as h:
        src, header = f.read(), h.read()
    defines = ("-DST_D=4096", "-DST_F=14336", "-DST_HD=128", "-DST_H=32", "-DST_HKV=2", "-DST_WT=1")
    with pytest.raises(GpuError, match="query values per lane"):
        _nvrtc_compile(STEP_FILE, src, header, COMPILE_OPTIONS + defines)


def test_nvrtc_compile_error_is_one_gpu_error_line():
    with pytest.raises(GpuError, match=r"^NVRTC failed to compile cuda/broken\.cu: .*error") as e:
        _nvrtc_compile("broken.cu", 'extern "C" __global__ void k() { int x = ; }', "")
    assert "\n" not in str(e.value)


def test_kernel_digest_covers_sources_launchers_and_options():
    """engine.kernels_sha256 (docs/attestation.md) covers every CUDA source, node/backend_cuda.py
    (the launchers and the weight packing the kernels read) and the pinned compile options."""
    from node.provenance import kernels_sha256, sources_sha256
    files = sorted(n for n in os.listdir(CUDA) if n.endswith((".cu", ".cuh")))
    want = sources_sha256([f"cuda/{n}" for n in files] + ["node/backend_cuda.py"], " ".join(COMPILE_OPTIONS).encode())
    assert kernels_sha256() == want
    assert sources_sha256([f"cuda/{n}" for n in files], " ".join(COMPILE_OPTIONS).encode()) != want


def test_load_modules_compiles_each_kernel_file_once_into_the_cache(tmp_path, monkeypatch):
    """The node's modules come from cubin_path: one cubin per kernel file in
    $XDG_CACHE_HOME/bitexact/cubin, keyed by source and options, found again
    (not recompiled) on the next start."""
    import node.backend_cuda as bc
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    class FakeCupy:
        class RawModule:
            def __init__(self, path):
                self.path = path
    mods = bc.load_modules(FakeCupy)
    cache = tmp_path / "bitexact" / "cubin"
    assert sorted(mods) == sorted(KERNEL_FILES)
    assert sorted(os.path.basename(m.path).split("-")[0] for m in mods.values()) == sorted(KERNEL_FILES)
    assert all(os.path.dirname(m.path) == str(cache) for m in mods.values())
    assert len(os.listdir(cache)) == len(KERNEL_FILES)
    monkeypatch.setattr(bc, "_nvrtc_compile", lambda *a, **k: pytest.fail("recompiled a cached kernel"))
    assert {n: m.path for n, m in bc.load_modules(FakeCupy).items()} == {n: m.path for n, m in mods.items()}


def _step_layout_asserts(fields) -> str:
    """static_asserts that cuda/step.cu StepArgs has the fields ``(name, offset)`` and the size of
    node/backend_cuda.py StepArgs."""
    import ctypes

    from node.backend_cuda import StepArgs
    lines = [f'static_assert(__builtin_offsetof(StepArgs, {n}) == {off}, "StepArgs.{n}");' for n, off in fields]
    return "\n".join(lines + [f'static_assert(sizeof(StepArgs) == {ctypes.sizeof(StepArgs)}, "StepArgs size");'])


def test_step_args_layout_matches_the_launcher():
    """The step kernel's one argument: every field of node/backend_cuda.py StepArgs (ctypes)
    sits at the offset cuda/step.cu's struct has (NVRTC compiles static_asserts of them;
    no GPU needed), and a wrong offset fails the compile."""
    from node.backend_cuda import StepArgs
    with open(os.path.join(CUDA, STEP_FILE)) as f, open(os.path.join(CUDA, "common.cuh")) as h:
        src, header = f.read(), h.read()
    fields = [(n, getattr(StepArgs, n).offset) for n, _ in StepArgs._fields_]
    _nvrtc_compile(STEP_FILE, src + "\n" + _step_layout_asserts(fields), header)
    wrong = [(n, off + 4 if n == "scale" else off) for n, off in fields]
    with pytest.raises(GpuError, match="StepArgs.scale"):
        _nvrtc_compile(STEP_FILE, src + "\n" + _step_layout_asserts(wrong), header)
