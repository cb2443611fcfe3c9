"""CUDA backend: the kernels in cuda/ through CuPy, bit-identical to node/reference.py.

Kernels are compiled from source with NVRTC (``cuda.bindings.nvrtc``) using the
pinned options of :mod:`node.kernels` (never CuPy's own compile, which appends
``-ftz=true``), cached as cubins keyed by the SHA-256 of sources and options,
and loaded with ``cupy.RawModule(path=...)``.

Each ``launch_*`` function below is the launcher of the kernel of the same
name, with its shape and dtype checks, in the order of the ``.cu`` files.
The KV cache is paged: a page holds one 256-position attention split of one
sequence, for all layers (``[n_layer, n_pages, Hkv, 256, hd]`` fp32 for K and V).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from typing import NamedTuple

import numpy as np

from .errors import BitexactError, NumericFault
from .gguf_model import BLOCK_BYTES, FLOAT_TYPES, Model, Tensor, block_fields, float_values
from .kernels import COMPILE_OPTIONS
from .reference import (MAX_ROWINT_K, ROWINT_NONFINITE, SPLIT_KV, W_CODE_BITS, WARP, lane_major, lane_terms,
                        lane_width, quantize_rowint)

QTYPE_IDS = {"F32": 0, "F16": 1, "BF16": 2, "Q8_0": 3, "Q4_0": 4, "Q4_1": 5, "Q4_K": 6, "Q6_K": 7}
DEFAULT_PIN = "NVIDIA H200"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_FILES = ("matmul.cu", "norm.cu", "rope.cu", "attention.cu", "activation.cu", "residual.cu",
                "embed.cu", "sampler.cu", "tp.cu")
# Launch geometry mirrored from cuda/matmul.cu (tests/test_kernels_static.py checks that they agree)
MQ_TM, MF_WARPS = 8, 8  # tokens and warps per block of matmul_f
MQ_ROWS, MF_ROWS = 16, 2  # output rows per tile of matmul_q (the MMA's M) / per warp of matmul_f
MQ_NARROW = 128  # matmul_q launches of fewer row tiles than this split K over 8 warps per tile, others over 4 (mq_split)
MQ_SLOTS = 2  # contract lanes per shared-memory slot of matmul_q (a warp owns whole groups of them)
ESIZE = {"F32": 4, "F16": 2, "BF16": 2}
SUPER_BLOCKS = {"Q4_K": 8, "Q6_K": 8}  # 32-element blocks per super-block (ggml k-quants); others: 1
MQ_NIBBLES = ("Q4_0", "Q4_1", "Q4_K")  # weight types whose matmul_q records hold 4-bit codes (cuda/matmul.cu)
MQ_SCALES = 128  # bytes of a record's scale words
PACK_ROWS = 8192  # rows packed at a time (bounds the packing's temporary memory)
QUANTIZE_THREADS = min(8, os.cpu_count() or 1)  # host threads quantizing contract 2's weight rows
QUANTIZE_ELEMS = 1 << 21  # weights per chunk of those threads (about 40 MB of temporaries each)
MAX_SMEM = 200 * 1024  # dynamic shared memory a kernel may use per block (opted in at load; sm_90 has 227 KiB)
GRAPH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512)  # tokens of a step replayed by a graph
GRAPH_ROWS = (1, 2, 4, 8, 16, 32, 64)  # logits rows (sequences) of a step replayed through a CUDA graph
STEP_FILE = "step.cu"  # the one-launch step, compiled for each model's dimensions (step_defines)
ST_TM, ST_WARPS, ST_OREC = 8, 16, 34  # mirrored from cuda/step.cu: tokens per tile, warps per block, floats per split record
STEP_MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # cuda/step.cu mats order


def step_defines(model: Model) -> tuple[str, ...] | None:
    """``-D`` flags compiling cuda/step.cu for ``model``'s dimensions, or None when
    the model does not fit the one-launch step (its steps then run the per-op
    kernels). It fits when every layer matrix and the LM head is F16, or every one
    is BF16, ``n_head * head_dim == n_embd <= 4096``, ``n_embd`` and ``n_ff`` are
    multiples of 256 (lane-major chunks of 8), ``head_dim`` is a multiple of 32 up
    to 128, at most 16 query heads share a KV head and a lane holds at most 32 of
    their query values (heads per KV head × head_dim / 32; beyond it the attention
    phase spills registers). A choice by the model alone."""
    hp = model.hparams
    names = [f"blk.{i}.{n}.weight" for i in range(hp.n_layer) for n in STEP_MATS] + [model.output.name]
    types = {model.tensors[n].qtype for n in names}
    d, f, hd, h, hkv = hp.n_embd, hp.n_ff, hp.head_dim, hp.n_head, hp.n_head_kv
    if len(types) != 1 or not types <= {"F16", "BF16"} or h * hd != d or d > 4096 or d % 256 or f % 256 \
            or hd % 32 or hd > 128 or h % hkv or h // hkv > ST_WARPS or h // hkv * (hd // 32) > 32:
        return None
    return (f"-DST_D={d}", f"-DST_F={f}", f"-DST_HD={hd}", f"-DST_H={h}", f"-DST_HKV={hkv}",
            f"-DST_WT={QTYPE_IDS[types.pop()]}")


class StepArgs(ctypes.Structure):
    """cuda/step.cu ``StepArgs``, the step kernel's one argument (its size is checked
    against the module's ``bx_step_args_bytes`` at load)."""
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "mats", "norms", "h0", "h", "h1", "q", "att", "act", "kc", "vc", "page_tab", "qpos", "cosr", "sinr",
        "rows", "scratch", "logits", "flags", "times")] + [(n, ctypes.c_int) for n in (
            "layers", "M", "R", "ms", "pages", "vocab")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def mq_split(rows: list[int], lanes: int) -> int:
    """Warps per matmul_q tile (8, 4, or fewer for a shard of few lanes) for
    matrices of ``rows`` output rows whose K spans ``lanes`` contract lanes; each
    warp owns whole groups of MQ_SLOTS lanes. Chosen from the model's dimensions
    only; it changes no sum (the warps' slots meet in the tree's top levels)."""
    tiles = sum(-(-r // MQ_ROWS) for r in rows)
    return min(8 if tiles < MQ_NARROW and lanes >= 8 else 4, lanes // MQ_SLOTS)


def mq_record_bytes(qtype: str) -> int:
    """Bytes of one :func:`pack_q` record of a quantized type (cuda/matmul.cu bx_mq_rec;
    tests/test_kernels_static.py compiles the kernel with static_asserts of these values)."""
    return (256 if qtype in MQ_NIBBLES else 512) + MQ_SCALES


def pack_q(xp, qtype: str, raw, b_off: int = 0, terms: int = 0):
    """matmul_q's layout of quantized rows: uint8 ``[ceil(N/16), nbs, R]``.

    ``raw``: ggml blocks of ``N`` rows (uint8 ``[N, row_bytes]``, numpy or CuPy
    as ``xp``); the record of tile ``t`` (rows ``16t .. 16t + 15``, zero past
    ``N``) and block ``b`` holds the fields of :func:`node.gguf_model.block_fields`
    for blocks ``b_off .. b_off + nbs - 1`` of each row (``nbs = terms``, or all).
    A record is the MMA's A fragments, then the scale words. Thread ``4 * gid
    + c`` of a warp reads rows ``gid`` and ``gid + 8``, elements ``8c .. 8c + 7``:
    - 4-bit types (R = 384): 8 bytes at ``8 * (4 * gid + c)``, row ``gid`` then
      row ``gid + 8``, byte ``j`` holding element ``8c + j`` (low nibble) and
      ``8c + 4 + j`` (high); a Q4_0 code is stored as ``q = code + 8``;
    - Q8_0 and Q6_K (R = 640): 16 bytes at ``16 * (4 * gid + c)``: elements
      ``8c .. 8c + 3`` of rows ``gid``, ``gid + 8``, then ``8c + 4 .. 8c + 7``
      of rows ``gid``, ``gid + 8`` (int8);
    - scale words: 16 bytes at ``R - 128 + 16 * gid``: the fp32 scales of rows
      ``gid``, ``gid + 8``, then their fp32 offsets (+0 for symmetric types)
      or, for Q6_K, their two int16 sub-block scales (elements 0..15 low,
      16..31 high). Only bytes move, and scales are the decoder's own values.
    Layout: mma.sync m16n8k32 A fragments (PTX ISA, "Matrix Fragments for
    mma.m16n8k32"), with k-slots ``4c .. 4c + 3`` and ``16 + 4c .. 16 + 4c + 3``
    holding elements ``8c .. 8c + 7``.
    """
    n = raw.shape[0]
    tiles = -(-n // MQ_ROWS)
    nbs = terms or (raw.shape[1] // BLOCK_BYTES[qtype][0] * BLOCK_BYTES[qtype][1] // 32 - b_off)
    rec = mq_record_bytes(qtype)
    out = xp.empty((tiles, nbs, rec), xp.uint8)
    for r0 in range(0, n, PACK_ROWS):
        codes, scale, offset, sub = block_fields(qtype, raw[r0:r0 + PACK_ROWS], xp)
        part = slice(b_off, b_off + nbs)
        codes, scale = codes[:, part], scale[:, part]
        words = [scale.view(xp.uint32)]
        if offset is not None:
            words.append(offset[:, part].view(xp.uint32))
        elif sub is not None:
            s16 = sub[:, part].astype(xp.int16).view(xp.uint16).astype(xp.uint32)
            words.append(s16[..., 0] | (s16[..., 1] << 16))
        else:
            words.append(xp.zeros_like(words[0]))
        rows = codes.shape[0]
        t = -(-rows // MQ_ROWS)
        pad = t * MQ_ROWS - rows

        def tiled(a):  # [rows, nbs, ...] -> [t, half, gid, nbs, ...], zero rows past N
            if pad:
                a = xp.concatenate([a, xp.zeros((pad,) + a.shape[1:], a.dtype)])
            return a.reshape((t, 2, 8) + a.shape[1:])

        c = tiled(codes).reshape(t, 2, 8, nbs, 4, 2, 4)            # element 8c + 4h + j
        if qtype in MQ_NIBBLES:
            u = (c + xp.int8(8 if qtype == "Q4_0" else 0)).view(xp.uint8)
            frag = (u[..., 0, :] | (u[..., 1, :] << 4)).transpose(0, 3, 2, 4, 1, 5)   # [t, nbs, gid, c, half, j]
        else:
            frag = c.view(xp.uint8).transpose(0, 3, 2, 4, 5, 1, 6)   # [t, nbs, gid, c, h, half, j]
        sw = xp.stack([tiled(w) for w in words], axis=1)             # [t, 2 (scale, offset), half, gid, nbs]
        sw = sw.transpose(0, 4, 3, 1, 2)                             # [t, nbs, gid, word, half]
        o = out[r0 // MQ_ROWS:r0 // MQ_ROWS + t]
        o[..., :rec - MQ_SCALES] = frag.reshape(t, nbs, -1)
        o[..., rec - MQ_SCALES:] = xp.ascontiguousarray(sw).view(xp.uint8).reshape(t, nbs, -1)
    return out


def pack_rowint_w(xp, codes):
    """matmul_rowint's layout of weight codes (integer ``[N, K]``, ``|c| <= 2^13``,
    K % 32 == 0; numpy or CuPy as ``xp``): per 64-row group (rows past N zero) and
    32-element k-step, the low slice ``c & 127`` then the high slice ``c >> 7``
    (``c = 128 * high + low``), each 2048 bytes in wgmma's K-major core matrices
    without swizzle (PTX ISA, "Shared Memory Matrix Layout"): row ``r`` of the group
    and element ``e`` at byte ``256 (r // 8) + 128 (e // 16) + 16 (r % 8) + e % 16``.
    Only bytes move (integer ops). Returns uint8 ``[ceil(N/64), K/32, 2, 2048]``."""
    n, k = codes.shape
    g = -(-n // 64)
    c = xp.zeros((g * 64, k), xp.int32)
    c[:n] = codes
    out = [sl.astype(xp.int8).reshape(g, 8, 8, k // 32, 2, 16)   # group, row // 8, row % 8, kk, k half, byte
           .transpose(0, 3, 1, 4, 2, 5).reshape(g, k // 32, 2048) for sl in (c & 127, c >> 7)]
    return xp.stack(out, axis=2).view(xp.uint8)


def pack_rowint_x(codes: np.ndarray) -> np.ndarray:
    """The layout quantize_rowint writes input codes in (integer ``[M, K]``, ``|c| <= 2^20``):
    per 8-token tile and k-step, the slices ``c & 127``, ``(c >> 7) & 127``, ``c >> 14``,
    each 256 bytes in wgmma's K-major core matrices (PTX ISA, "Shared Memory Matrix
    Layout"): k-half ``h``, token ``t`` of the tile and element ``e`` at byte
    ``128 h + 16 t + e``; tokens past M zero. Returns uint8 ``[ceil(M/8), K/32, 3, 256]``
    (what the GPU tests compare)."""
    m, k = codes.shape
    mp = -(-m // 8) * 8
    c = np.zeros((mp, k), np.int32)
    c[:m] = codes
    out = [s.astype(np.int8).reshape(mp // 8, 8, k // 32, 2, 16).transpose(0, 2, 3, 1, 4)
           .reshape(mp // 8, k // 32, 256) for s in (c & 127, (c >> 7) & 127, c >> 14)]
    return np.stack(out, axis=2).view(np.uint8)


def module_ints(mod, name: str, n: int = 1) -> list[int]:
    """An ``extern "C" __constant__ int[n]`` of a loaded kernel module (e.g. cuda/matmul.cu bx_mq_tokens)."""
    import cupy

    return cupy.ndarray((n,), cupy.int32, mod.get_global(name)).get().tolist()


class RowintGeometry(NamedTuple):
    """cuda/matmul.cu bx_ri_geometry: matmul_rowint's tokens per pass, rows per cluster,
    blocks per cluster, threads per block and dynamic shared memory bytes per block;
    quantize_rowint's threads per token."""
    tokens: int
    rows: int
    cluster: int
    threads: int
    smem: int
    quantize_threads: int

    def grid(self, m: int, ns) -> tuple:
        """matmul_rowint's grid for ``m`` tokens and matrices of ``ns`` rows (each from a
        group of its own): a cluster per pass of :attr:`tokens` tokens and group of
        :attr:`rows` rows."""
        return (self.cluster * -(-m // self.tokens) * sum(-(-n // self.rows) for n in ns),)


def rowint_geometry(mod) -> RowintGeometry:
    """The :class:`RowintGeometry` of a loaded cuda/matmul.cu module; raises
    :class:`GpuError` if its RI_NONFINITE differs from node/reference.py's."""
    *geo, nonfinite = module_ints(mod, "bx_ri_geometry", 7)
    if nonfinite != ROWINT_NONFINITE:
        raise GpuError(f"cuda/matmul.cu RI_NONFINITE is {nonfinite}, node/reference.py {ROWINT_NONFINITE}")
    return RowintGeometry(*geo)


def x_width(k: int) -> int:
    """Chunk width (fp32 elements) of the lane-major input ``matmul_f`` reads for rows of
    ``k`` elements: 16-byte chunks where ``k / 32`` allows (:func:`node.reference.lane_width`
    with 4-byte elements), whatever the weights' chunk width (cuda/matmul.cu, matmul_f).
    Raises ValueError when ``k % 32 != 0``."""
    return lane_width(k, 4)


class LaneMajor(NamedTuple):
    """fp32 activations ``[M, K]`` already in :func:`node.reference.lane_major`
    layout with chunks of ``v`` elements, as written by a producer kernel for
    the float-weight products that read them."""
    data: object
    v: int


class Q8(NamedTuple):
    """fp32 activations ``[M, K]`` quantized per 32-element block
    (:func:`node.reference.quantize_q8`): int8 codes ``q [M, K]``, fp32 scales
    ``d [M, K/32]`` and int32 code sums ``a [M, K/32]``, as ``quantize_q8`` or a
    producer kernel writes them for the quantized-weight products that read them."""
    q: object
    d: object
    a: object


Q8_OUT = -1  # chunk width argument of rms_norm / silu_gate asking for q8 codes (cuda/norm.cu, activation.cu)


class Mat(NamedTuple):
    """A weight matrix ``[N, K]``, or a tensor-parallel shard of one, as the matmul kernels read it.

    ``data``: :func:`pack_q` records of quantized weights or the elements
    lane-major over ``lanes`` lanes (:func:`node.reference.lane_major`).
    A column-parallel shard is some rows with the full K (``lanes = 32``); a
    row-parallel shard holds contract lanes ``lane0 .. lane0 + lanes - 1`` of
    K (docs/determinism.md section 12): for quantized weights its ``terms``
    blocks of each row (0: all). Under contract 2 a float matrix is
    :func:`pack_rowint_w` codes with its rows' scale exponents ``s`` (int32 ``[N]``).
    """
    data: object
    rows: int
    qtype: str
    k: int
    lanes: int = WARP
    lane0: int = 0
    terms: int = 0
    s: object = None


class GpuError(BitexactError):
    """No usable GPU, a GPU other than the pinned one, a compile failure or out of memory."""


def _cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise GpuError("no CUDA GPU is visible")
        return cupy
    except ImportError:
        raise GpuError("CuPy is not installed: pip install -e '.[cuda]'") from None
    except GpuError:
        raise
    except Exception as e:
        raise GpuError(f"no usable CUDA GPU: {e}") from None


def _nvrtc_compile(name: str, src: str, header: str, options: tuple = COMPILE_OPTIONS) -> bytes:
    """cubin of ``src`` (``common.cuh`` = ``header``) compiled by NVRTC with
    ``options`` (the node always uses the pinned :data:`COMPILE_OPTIONS`).
    Raises :class:`GpuError` with the first error line of the compile log."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise GpuError("cuda-bindings (NVRTC) is not installed: pip install -e '.[cuda]'") from None
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 1, [header.encode()], [b"common.cuh"])
    if err != ok:
        raise GpuError(f"NVRTC could not create program {name}: {err}")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != ok:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            first = next((ln for ln in log.decode(errors="replace").splitlines() if "error" in ln), str(err))
            raise GpuError(f"NVRTC failed to compile cuda/{name}: {first.strip()}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cubin_path(src_path: str, defines: tuple = ()) -> str:
    """Path of the cubin of the CUDA source at ``src_path`` (``common.cuh`` from
    cuda/) compiled with the pinned :data:`COMPILE_OPTIONS` plus ``defines``
    (``-D`` flags: the tile variants the benchmark scripts time; none for the
    node), compiled once and kept in ``$XDG_CACHE_HOME/bitexact/cubin`` under a
    name keyed by source, header and options. Raises :class:`GpuError` on a
    compile failure, OSError if the cache cannot be written."""
    from attest.atomic import atomic_write

    with open(src_path) as f, open(os.path.join(ROOT, "cuda", "common.cuh")) as h:
        src, header = f.read(), h.read()
    options = COMPILE_OPTIONS + tuple(defines)
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bitexact", "cubin")
    os.makedirs(cache, exist_ok=True)
    name = os.path.basename(src_path)
    key = hashlib.sha256("\0".join((src, header) + options).encode()).hexdigest()
    path = os.path.join(cache, f"{name}-{key[:24]}.cubin")
    if not os.path.exists(path):
        atomic_write(path, _nvrtc_compile(name, src, header, options))
    return path


def load_modules(cupy) -> dict:
    """Every kernel file's module (compiled, or taken from the cache); returns name -> RawModule."""
    return {name: cupy.RawModule(path=cubin_path(os.path.join(ROOT, "cuda", name))) for name in KERNEL_FILES}


_ARG_CTYPES = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32,
               np.float32: ctypes.c_float}  # kernel scalar arguments PdlKernel passes


class PdlKernel:
    """A kernel of cuda/ launched with programmatic stream serialization
    (``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``;
    CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization").

    Its blocks may start while the stream's previous kernel still runs: the
    products hint their first weight bytes into L2, then every kernel waits in
    ``bx_pdl_wait`` (cuda/common.cuh) until that kernel has completed and its
    writes are visible, so no operand, value or order changes, only when
    blocks start.
    With ``cooperative`` it is a cooperative launch instead
    (``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``: every block resident at once, or the
    launch is refused), for cuda/step.cu's grid barriers.
    Called like a ``cupy.RawModule`` function: ``(grid, block, args,
    shared_mem=0)`` on CuPy's current stream (captured into CUDA graphs like
    any launch). ``args``: CuPy arrays (device pointers), ``None`` (a null
    pointer) and numpy scalars (int32, int64, uint32, float32), or one
    ``ctypes.Structure`` passed by value. Raises :class:`TypeError` for any
    other argument and :class:`GpuError` when the driver refuses the launch.
    """

    def __init__(self, fn, name: str, cooperative: bool = False):
        import cupy
        try:
            from cuda.bindings import driver
        except ImportError:
            raise GpuError("cuda-bindings (the CUDA driver API) is not installed: pip install -e '.[cuda]'") from None

        self.fn, self.name, self._cp, self._drv, self.cooperative = fn, name, cupy, driver, cooperative
        self._f = driver.CUfunction(fn.kernel.ptr)
        self._configs: dict = {}

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.fn.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int) -> None:
        self.fn.max_dynamic_shared_size_bytes = n

    def _config(self, grid, block, shared_mem: int, stream: int):
        """The launch configuration: one per block shape, shared memory and stream
        (a handful per kernel), its grid set for this launch."""
        key = (block, shared_mem, stream)
        cfg = self._configs.get(key)
        if cfg is None:
            drv = self._drv
            cfg = self._configs[key] = drv.CUlaunchConfig()
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (*block, 1, 1)[:3]
            cfg.sharedMemBytes = shared_mem
            cfg.hStream = drv.CUstream(stream)
            attr = drv.CUlaunchAttribute()
            if self.cooperative:
                attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
                attr.value.cooperative = 1
            else:
                attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs, cfg.numAttrs = [attr], 1
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (*grid, 1, 1)[:3]
        return cfg

    def _arg(self, a):
        if a is None:
            return 0, ctypes.c_void_p
        if isinstance(a, self._cp.ndarray):
            return a.data.ptr, ctypes.c_void_p
        t = _ARG_CTYPES.get(type(a))
        if t is None:
            raise TypeError(f"{self.name}: kernel argument of type {type(a).__name__}")
        return a.item(), t

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        cfg = self._config(grid, tuple(block), int(shared_mem), self._cp.cuda.get_current_stream().ptr)
        if isinstance(args, ctypes.Structure):   # one argument by value: void*[1] pointing at its bytes
            ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(args))
            params = ctypes.addressof(ptrs)
        else:
            params = tuple(zip(*(self._arg(a) for a in args)))
        (err,) = self._drv.cuLaunchKernelEx(cfg, self._f, params, 0)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise GpuError(f"kernel {self.name} could not be launched: {err.name}")


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"kernel launch shape check failed: {what}")


CUDA_ERROR_MEMORY_ALLOCATION = 2   # cudaErrorMemoryAllocation (CUDA Runtime API, cudaError); CuPy does not export it


def _malloc_no_retry(size: int):
    """Base allocator of the graphs' memory pool: device memory of ``size`` bytes, or
    ``OutOfMemoryError``. The graphs' own free blocks are never given back (CuPy's
    pool would free them and retry: they are scratch that captured graphs still
    write); on a CUDA out-of-memory error the free blocks of CuPy's default pool,
    which no graph uses, are, and the allocation is tried once more (not during a
    capture, where freeing device memory is not allowed)."""
    import cupy as cp

    for last in (False, True):
        try:
            return cp.cuda.MemoryPointer(cp.cuda.Memory(size), 0)
        except cp.cuda.runtime.CUDARuntimeError as e:
            if e.status != CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            if last or cp.cuda.get_current_stream().is_capturing():
                raise cp.cuda.memory.OutOfMemoryError(size, -1) from None
            cp.get_default_memory_pool().free_all_blocks()


class CudaBackend:
    name = "cuda"

    def __init__(self, model: Model, pin: str | None = DEFAULT_PIN, kv_pages: int | None = None,
                 graphs: bool = True, n_ctx: int = 8192, one_launch: bool = False, step_times: int = 0,
                 contract: int = 1):
        self.contract = contract   # 2: float-weight products in integers (docs/determinism.md section 14)
        cp = self.xp = _cupy()
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)   # graphs cannot capture the legacy stream
        self.stream.use()
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = f"{props['major']}.{props['minor']}"
        if pin and self.gpu_name != pin:
            raise GpuError(f"this node is pinned to {pin!r} but the GPU is {self.gpu_name!r} (use --pin to change)")
        if (props["major"], props["minor"]) != (9, 0):
            raise GpuError(f"kernels are built for sm_90a (Hopper); {self.gpu_name} is compute capability {self.cc}")
        self.model, self.hp = model, model.hparams
        try:
            mods = load_modules(cp)
            self.k = {n: PdlKernel(mods[f].get_function(n), n) for f, names in (
                ("matmul.cu", ("quantize_q8", "matmul_q", "lane_major", "matmul_f", "quantize_rowint",
                               "matmul_rowint")), ("norm.cu", ("rms_norm",)),
                ("rope.cu", ("rope",)), ("attention.cu", ("attention_split", "attention_combine")),
                ("activation.cu", ("silu_gate",)), ("residual.cu", ("residual_add",)), ("embed.cu", ("embed",)),
                ("sampler.cu", ("argmax", "sample_keys", "sample_sorted")), ("tp.cu", ("tp_combine",))) for n in names}
            for n in ("rms_norm", "attention_split", "matmul_q"):
                self.k[n].max_dynamic_shared_size_bytes = MAX_SMEM
            # launch shapes the kernel sources define: matmul_q's tokens per tile and dynamic shared
            # memory per warp by weight type and per contract lane (cuda/matmul.cu), RMSNorm's
            # threads (cuda/norm.cu)
            (self.mq_tokens,) = module_ints(mods["matmul.cu"], "bx_mq_tokens")
            (self.rn_threads,) = module_ints(mods["norm.cu"], "bx_rn_threads")
            self.mq_warp_smem = module_ints(mods["matmul.cu"], "bx_mq_warp_smem", len(QTYPE_IDS))
            (self.mq_lane_smem,) = module_ints(mods["matmul.cu"], "bx_mq_lane_smem")
            self.ri = rowint_geometry(mods["matmul.cu"])
            self.k["matmul_rowint"].max_dynamic_shared_size_bytes = self.ri.smem
            # Float matrices are kept lane-major for matmul_f (token_embd stays
            # row-major for embed, plus a matrix of its own when it is the LM head).
            self._weights, self._mats = {}, {}
            for name, t in model.tensors.items():
                if t.rows == 1 and t.qtype in FLOAT_TYPES:
                    self._weights[name] = cp.asarray(float_values(t)[0])
                    continue
                if name == "token_embd.weight":
                    self._weights[name] = cp.asarray(np.ascontiguousarray(t.raw))
                    if not model.tied_output:
                        continue
                if t.qtype in FLOAT_TYPES and t.cols % 32:
                    raise GpuError(f"{name}: the CUDA engine needs float matrices with K % 32 == 0, got K={t.cols}")
                self._mats[name] = self._mat(name, t)
            hp = self.hp
            self.kv_heads = self._kv_heads()
            self.page_floats = self.kv_heads * SPLIT_KV * hp.head_dim
            page_bytes = max(1, 2 * hp.n_layer * self.page_floats * 4)     # a TP rank may hold no KV head
            if kv_pages is None:
                free = cp.cuda.runtime.memGetInfo()[0]
                kv_pages = self._agree_kv_pages(int(max(8, min(2048, 0.5 * free // page_bytes))))
            self.kv_pages = kv_pages
            shape = (hp.n_layer, kv_pages, self.kv_heads, SPLIT_KV, hp.head_dim)
            self.kp = cp.empty(shape, cp.float32)
            self.vp = cp.empty(shape, cp.float32)
            self.step = self._load_step(props["multiProcessorCount"], step_times) if one_launch else None
        except cp.cuda.memory.OutOfMemoryError as e:
            raise GpuError(f"out of GPU memory while loading the model: {e}") from None
        self._free_pages = list(range(kv_pages - 1, 0, -1))
        self._scratch_page = 0            # written by the padding rows of graph buckets, never read as data
        self._pages: dict[int, list[int]] = {}
        self.graphs = graphs
        self.max_splits = -(-n_ctx // SPLIT_KV)
        self._graph_cache: dict[tuple, dict] = {}
        self._graph_pool = None           # the memory of every captured graph (they run one at a time)
        self._graph_out = None            # device logits [GRAPH_ROWS[-1], n_vocab] every graph ends by writing
        self._entry = None
        self._last = None                 # device logits [R, n_vocab] of the last step (for sample_last)
        self._device_record = None

    def _load_step(self, sms: int, times: int = 0) -> PdlKernel | None:
        """The step kernel (cuda/step.cu) compiled for this model (``one_launch``: an
        operator's choice, the bytes are the same either way), or None when the model
        does not fit it (:func:`step_defines`; a tensor-parallel rank: always).
        Its tables: the weight pointers in ``STEP_MATS`` order per layer then the LM
        head, the norm vectors (attn_norm, ffn_norm per layer, then output_norm), one
        barrier flag per block (one block per SM). ``times`` > 0 (scripts/profile_step.py):
        the variant that records block 0's ``%globaltimer`` (ns) at the start, after
        each barrier and at the end into ``step_times`` (uint64 ``[times]``)."""
        defines = step_defines(self.model)
        if defines is None:
            return None
        cp, hp = self.cp, self.hp
        self.step_times = cp.zeros(times, cp.uint64) if times else None
        mod = cp.RawModule(path=cubin_path(os.path.join(ROOT, "cuda", STEP_FILE),
                                           defines + (("-DST_TIMES=1",) if times else ())))
        (size,) = module_ints(mod, "bx_step_args_bytes")
        if size != ctypes.sizeof(StepArgs):
            raise GpuError(f"cuda/{STEP_FILE} StepArgs is {size} bytes, node/backend_cuda.py StepArgs "
                           f"{ctypes.sizeof(StepArgs)}")
        kernel = PdlKernel(mod.get_function("step"), "step", cooperative=True)
        (self.step_smem,) = module_ints(mod, "bx_step_smem")
        kernel.max_dynamic_shared_size_bytes = self.step_smem
        mats = [f"blk.{i}.{n}.weight" for i in range(hp.n_layer) for n in STEP_MATS] + [self.model.output.name]
        norms = [f"blk.{i}.{n}.weight" for i in range(hp.n_layer) for n in ("attn_norm", "ffn_norm")]
        self._step_mats = cp.asarray(np.array([self._mats[n].data.data.ptr for n in mats], np.uint64))
        self._step_norms = cp.asarray(np.array([self._weights[n].data.ptr for n in norms + ["output_norm.weight"]],
                                               np.uint64))
        self._step_flags = cp.zeros(sms, cp.uint32)
        return kernel

    def _kv_heads(self) -> int:
        """KV heads the KV cache pages hold: all of the model's (a tensor-parallel rank: its own)."""
        return self.hp.n_head_kv

    def _agree_kv_pages(self, n: int) -> int:
        """KV pages to allocate when this GPU's free memory allows ``n`` (tensor-parallel
        ranks take the smallest of all ranks', so their caches fill up alike)."""
        return n

    def _mat(self, name: str, t) -> Mat | None:
        """Upload matrix ``name`` for the matmul kernels (a tensor-parallel rank uploads its shard)."""
        return self._upload(t, t.raw, t.rows)

    def _upload(self, t, raw, rows: int, lanes: int = WARP, lane0: int = 0, b_off: int = 0, terms: int = 0) -> Mat:
        """:class:`Mat` of ``raw`` (``rows`` rows of tensor ``t``'s bytes, or a K shard of
        them whose ``terms`` blocks start ``b_off`` blocks into its first super-block)."""
        if t.qtype in FLOAT_TYPES and self.contract == 2:   # the whole matrix (contract 2 has no shards)
            return self._upload_rowint(t)
        raw = np.ascontiguousarray(raw)
        if t.qtype in FLOAT_TYPES:
            elem = raw.view(np.uint32 if ESIZE[t.qtype] == 4 else np.uint16)
            return Mat(self.cp.asarray(lane_major(elem, lane_width(t.cols, ESIZE[t.qtype]), lanes)), rows,
                       t.qtype, t.cols, lanes, lane0, terms)
        return Mat(pack_q(self.cp, t.qtype, self.cp.asarray(raw), b_off, terms), rows, t.qtype, t.cols, lanes,
                   lane0, terms)

    def _upload_rowint(self, t) -> Mat:
        """:class:`Mat` of float matrix ``t`` under contract 2: its rows quantized on the host
        (reference.quantize_rowint, numpy keeps subnormals) in chunks of whole 64-row groups
        of about :data:`QUANTIZE_ELEMS` weights on up to :data:`QUANTIZE_THREADS` threads
        (numpy's loops release the GIL; each row alone, so the split does not change a
        code), then packed on the GPU in order (:func:`pack_rowint_w`, integer ops only)."""
        from concurrent.futures import ThreadPoolExecutor

        cp = self.cp
        data = cp.empty((-(-t.rows // 64), t.cols // 32, 2, 2048), cp.uint8)
        s = np.empty(t.rows, np.int32)
        step = max(64, QUANTIZE_ELEMS // t.cols // 64 * 64)

        def quantize(r0):
            rows = Tensor(t.name, t.qtype, min(step, t.rows - r0), t.cols, t.raw[r0:r0 + step])
            codes, s[r0:r0 + rows.rows] = quantize_rowint(float_values(rows), W_CODE_BITS)
            return codes.astype(np.int16)

        starts = range(0, t.rows, step)
        with ThreadPoolExecutor(min(QUANTIZE_THREADS, len(starts))) as pool:
            pending = [pool.submit(quantize, r0) for r0 in starts[:QUANTIZE_THREADS]]
            for i, r0 in enumerate(starts):   # at most QUANTIZE_THREADS chunks held at once
                codes = pending[i].result()
                if i + QUANTIZE_THREADS < len(starts):
                    pending.append(pool.submit(quantize, starts[i + QUANTIZE_THREADS]))
                data[r0 // 64:r0 // 64 + step // 64] = pack_rowint_w(cp, cp.asarray(codes))
                pending[i] = None
        return Mat(data, t.rows, t.qtype, t.cols, s=cp.asarray(s))

    # ---- host/device -------------------------------------------------------
    def to_host(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)

    def from_host(self, x):
        return self.cp.asarray(x)

    def vector(self, name: str) -> np.ndarray:
        return float_values(self.model.tensors[name])[0]

    def device_record(self) -> dict:
        """GPU name, compute capability, driver (NVML, nvidia-ml-py; "unknown" where NVML
        cannot be read), CUDA driver/runtime API and CuPy versions (read once)."""
        if self._device_record is None:
            cp = self.cp
            rec = {"gpu": self.gpu_name, "compute_capability": self.cc,
                   "cuda_driver": str(cp.cuda.runtime.driverGetVersion()),
                   "cuda_runtime": str(cp.cuda.runtime.runtimeGetVersion()), "cupy": cp.__version__}
            try:
                import pynvml
                pynvml.nvmlInit()
                rec["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
            except Exception:
                rec["driver"] = "unknown"
            self._device_record = rec
        return dict(self._device_record)

    # ---- launchers ---------------------------------------------------------
    def launch_quantize_q8(self, x):
        cp = self.cp
        m, k = x.shape
        _check(x.dtype == cp.float32 and x.flags.c_contiguous and k % 32 == 0, "quantize_q8 x fp32 [M, K%32==0]")
        out = self._q8_buffers(m, k)
        self.k["quantize_q8"](((32 * m * (k // 32) + 255) // 256,), (256,), (x, *out, np.int32(m), np.int32(k)))
        return out

    def _q8_buffers(self, m, k):
        """Uninitialized :class:`Q8` arrays for ``[m, k]`` activations."""
        cp = self.cp
        return Q8(cp.empty((m, k), cp.int8), cp.empty((m, k // 32), cp.float32), cp.empty((m, k // 32), cp.int32))

    def _producer_out(self, shape, v):
        """Output of a producer kernel (rms_norm, attention_combine, silu_gate) of fp32
        result ``shape`` written with output argument ``v``: the :class:`Q8` arrays
        (v = Q8_OUT) or one fp32 array, and the kernel's four output pointers
        (y, q, qd, qa), of which it writes y or the codes."""
        if v == Q8_OUT:
            out = self._q8_buffers(int(np.prod(shape[:-1])), shape[-1])
            return out, (out.q, *out)
        out = self.cp.empty(shape, self.cp.float32)
        return out, (out,) * 4

    def _fused(self, names):
        """Matrices of one fused launch: at most three with one K and one shard of it;
        returns (matrices, their N padded to three)."""
        ms = [self._mats[n] for n in names]
        shard = {(m.k, m.lanes, m.lane0, m.terms) for m in ms}
        _check(1 <= len(ms) <= 3 and len(shard) == 1, f"fused matmul of {names}: 1-3 matrices, one K and shard")
        _check(all(m.rows > 0 for m in ms), f"fused matmul of {names}: no empty matrix")
        return ms, [m.rows for m in ms] + [0] * (3 - len(ms))

    def _matmul_grid(self, m, rows, warps, rows_per_warp=1, tokens=MQ_TM):
        """Grid of matmul_q / matmul_f: (token tiles, blocks); each matrix starts at a warp
        (matmul_f) or tile (matmul_q, ``warps`` = 1) of its own."""
        blocks = -(-sum(-(-r // rows_per_warp) for r in rows) // warps)
        _check(blocks <= 65535, f"matmul rows {sum(rows)} exceed the grid")
        return ((m + tokens - 1) // tokens, blocks)

    def _residual(self, r, ms, m):
        """The residual operand of a product launch: fp32 [m, N] of its one whole matrix, or None."""
        if r is None:
            return None
        _check(len(ms) == 1 and ms[0].lanes == WARP and ms[0].terms == 0 and r.dtype == self.cp.float32
               and r.flags.c_contiguous and r.shape == (m, ms[0].rows),
               "residual add: one whole matrix, fp32 [M, N] residual")
        return r

    def launch_matmul_q(self, xq, names, residual=None):
        """Quantized products of one quantized input with 1-3 matrices of the same K
        (or one row-parallel shard); list of fp32 [M, N_i]. ``residual`` fp32 [M, N]
        (one whole matrix only) is added to the product in the epilogue."""
        cp = self.cp
        ms, rows = self._fused(names)
        q, d, a = xq
        m, k = q.shape
        w0 = ms[0]
        nb = k // 32
        g, nbs = lane_terms(nb), w0.terms or nb
        _check(k == w0.k and d.shape == (m, nb) and a.shape == (m, nb), f"matmul_q {names} K={w0.k}")
        _check(q.flags.c_contiguous and q.data.ptr % 16 == 0, "matmul_q: x codes contiguous, 16-byte aligned")
        _check(all(w.qtype not in FLOAT_TYPES and w.data.data.ptr % 16 == 0
                   and w.data.shape == (-(-w.rows // MQ_ROWS), nbs, mq_record_bytes(w.qtype)) for w in ms),
               "matmul_q takes quantized weights as pack_q records, 16-byte aligned")
        r = self._residual(residual, ms, m)
        _check(w0.lanes in (4, 8, 16, 32) and w0.lane0 % w0.lanes == 0
               and w0.lane0 * g + nbs <= nb
               and nbs <= w0.lanes * g, f"matmul_q {names}: shard of lanes {w0.lane0}+{w0.lanes}, {nbs} blocks")
        ys = [cp.empty((m, w.rows), cp.float32) for w in ms]
        pad = 3 - len(ms)
        ws = [w.data for w in ms] + [w0.data] * pad
        yy = ys + [ys[0]] * pad
        qt = [QTYPE_IDS[w.qtype] for w in ms] + [0] * pad
        split = mq_split(rows, w0.lanes)
        self.k["matmul_q"](self._matmul_grid(m, rows, 1, MQ_ROWS, self.mq_tokens), (32 * split,),
                           (*ws, *yy, r, *(np.int32(n) for n in rows), *(np.int32(v) for v in qt),
                            q, d, a, np.int32(m), np.int32(k), np.int32(g),
                            np.int32(w0.lanes), np.int32(w0.lane0 * g), np.int32(nbs), np.int32(split)),
                           shared_mem=split * max(self.mq_warp_smem[v] for v in qt[:len(ms)])
                           + w0.lanes * self.mq_lane_smem)
        return ys

    def launch_lane_major(self, x, v):
        """fp32 [M, K] -> the lane-major layout of reference.lane_major with chunks of v elements."""
        cp = self.cp
        m, k = x.shape
        _check(x.dtype == cp.float32 and x.flags.c_contiguous and k % 32 == 0 and v in (1, 2, 4, 8)
               and (k // 32) % v == 0, "lane_major x fp32 [M, K%32==0], V | K/32")
        out = cp.empty_like(x)
        self.k["lane_major"](((m * k + 255) // 256,), (256,), (x, out, np.int32(m), np.int32(k), np.int32(v)))
        return out

    def launch_matmul_f(self, xl, names):
        """Float-weight products of one input with 1-3 matrices of one type and K (or one
        row-parallel shard): xl fp32 [M, K] lane-major with chunks of :func:`x_width` (K);
        list of fp32 [M, N_i]."""
        cp = self.cp
        ms, rows = self._fused(names)
        m, k = xl.shape
        w0 = ms[0]
        _check(xl.dtype == cp.float32 and xl.flags.c_contiguous and k == w0.k, f"matmul_f {names} K={k}")
        _check(len({w.qtype for w in ms}) == 1 and w0.qtype in FLOAT_TYPES, "matmul_f: one float weight type")
        _check(w0.lanes in (4, 8, 16, 32) and w0.lane0 % w0.lanes == 0 and w0.lane0 + w0.lanes <= WARP
               and w0.data.shape == (w0.rows, w0.lanes * (k // WARP)), f"matmul_f {names}: lane shard")
        ys = [cp.empty((m, w.rows), cp.float32) for w in ms]
        pad = 3 - len(ms)
        ws = [w.data for w in ms] + [w0.data] * pad
        yy = ys + [ys[0]] * pad
        self.k["matmul_f"](self._matmul_grid(m, rows, MF_WARPS, MF_ROWS * (WARP // w0.lanes)), (32 * MF_WARPS,),
                           (*ws, *yy, *(np.int32(n) for n in rows), np.int32(QTYPE_IDS[w0.qtype]),
                            np.int32(lane_width(k, ESIZE[w0.qtype])), xl, np.int32(m), np.int32(k),
                            np.int32(w0.lanes), np.int32(w0.lane0)))
        return ys

    def launch_quantize_rowint(self, x):
        """Contract 2 input codes of fp32 x [M, K] (K % 32 == 0): (:func:`pack_rowint_x` codes
        uint8 [ceil(M/8), K/32, 3, 256], exponents int32 [M])."""
        cp = self.cp
        m, k = x.shape
        _check(x.dtype == cp.float32 and x.flags.c_contiguous and x.data.ptr % 16 == 0 and m > 0 and k % 32 == 0
               and 0 < k < MAX_ROWINT_K, f"quantize_rowint x fp32 [M>0, K%32==0, K<{MAX_ROWINT_K}], 16-byte aligned")
        mp = -(-m // 8) * 8
        px, sx = cp.empty((mp // 8, k // 32, 3, 256), cp.uint8), cp.empty(m, cp.int32)
        self.k["quantize_rowint"]((mp,), (self.ri.quantize_threads,), (x, px, sx, np.int32(m), np.int32(k)))
        return px, sx

    def launch_matmul_rowint(self, xr, names):
        """Contract 2 products of :meth:`launch_quantize_rowint`'s ``xr`` with 1-3 float
        matrices ``names`` of one K (:func:`pack_rowint_w` :class:`Mat`), one launch;
        list of fp32 [M, N_i]."""
        cp = self.cp
        px, sx = xr
        ms, rows = self._fused(names)
        m, ks = sx.shape[0], px.shape[1]
        _check(px.dtype == cp.uint8 and px.flags.c_contiguous and px.data.ptr % 16 == 0
               and px.shape == (-(-m // 8), ks, 3, 256), "matmul_rowint: packed input codes")
        _check(all(w.s is not None and w.k == 32 * ks and w.data.shape == (-(-w.rows // 64), ks, 2, 2048)
                   and w.s.shape == (w.rows,) for w in ms), f"matmul_rowint {names}: packed codes of one K")
        ys = [cp.empty((m, w.rows), cp.float32) for w in ms]
        pad = 3 - len(ms)
        self.k["matmul_rowint"](self.ri.grid(m, rows), (self.ri.threads,),
                                (*[w.data for w in ms], *[ms[0].data] * pad, *[w.s for w in ms], *[ms[0].s] * pad,
                                 *ys, *[ys[0]] * pad, *(np.int32(n) for n in rows), px, sx, np.int32(m),
                                 np.int32(ms[0].k)), shared_mem=self.ri.smem)
        return ys

    def _check_width(self, k, v, what):
        _check(v == 0 or (v == Q8_OUT and k % 32 == 0) or (v in (1, 2, 4, 8) and k % 32 == 0 and (k // 32) % v == 0),
               f"{what}: lane-major chunk width {v} must divide K/32, q8 output needs K % 32 == 0 (K={k})")

    def launch_rms_norm(self, x, w, eps, v=0):
        """RMSNorm of fp32 x [M, K]; output fp32 row-major (v = 0), lane-major with chunks
        of v, or (v = Q8_OUT) its :class:`Q8` codes."""
        cp = self.cp
        m, k = x.shape
        _check(x.dtype == cp.float32 and x.flags.c_contiguous and w.shape == (k,), "rms_norm x [M, K], w [K]")
        self._check_width(k, v, "rms_norm")
        smem = (2 * k + 32) * 4
        _check(smem <= MAX_SMEM, f"rms_norm K={k} exceeds shared memory")
        y, outs = self._producer_out(x.shape, v)
        self.k["rms_norm"]((m,), (self.rn_threads,),
                           (x, w, *outs, np.int32(m), np.int32(k), np.float32(eps), np.int32(v)), shared_mem=smem)
        return y

    def launch_rope(self, layer, q, k, v, cos, sin):
        """RoPE of q fp32 [T, H, hd] (returned) and k fp32 [T, Hkv, hd], which is stored
        with v in ``layer``'s KV cache pages at the step's slots; cos, sin fp32 [T, hd/2]."""
        cp = self.cp
        t, h, hd = q.shape
        hkv = k.shape[1]
        _check(all(a.dtype == cp.float32 and a.flags.c_contiguous for a in (q, k, v, cos, sin))
               and k.shape == v.shape == (t, hkv, hd) and hd % 2 == 0 and cos.shape == sin.shape == (t, hd // 2)
               and t == self._tok_page.size and hkv == self.kv_heads, "rope shapes")
        out = cp.empty_like(q)
        n = t * (h + hkv) * (hd // 2)
        self.k["rope"](((n + 255) // 256,), (256,), (q, k, v, cos, sin, out, self.kp[layer], self.vp[layer],
                                                     self._tok_page, self._tok_slot, np.int32(t), np.int32(h),
                                                     np.int32(hkv), np.int32(hd)))
        return out

    def launch_attention(self, q, v=0):
        """Attention of q fp32 [T, H, hd] over the step's pages; returns fp32 [T, H*hd],
        row-major (v = 0), lane-major with chunks of v, or (v = Q8_OUT, hd % 32 == 0)
        its :class:`Q8` codes."""
        cp = self.cp
        t, h, hd = q.shape
        hkv = self.kv_heads
        _check(q.flags.c_contiguous and h % hkv == 0 and hd <= 1024 and t == self._qpos.size, "attention shapes")
        ms = self._max_splits
        pm = cp.empty((t, h, ms), cp.float32)
        pl = cp.empty((t, h, ms), cp.float32)
        po = cp.empty((t, h, ms, hd), cp.float32)
        smem = (hd + SPLIT_KV + 32 * hd) * 4
        scale = np.float32(1.0) / np.sqrt(np.float32(hd))
        self.k["attention_split"]((t, h, ms), (SPLIT_KV,), (q, self._layer_k, self._layer_v, self._page_tab,
                                                            self._qpos, pm, pl, po, np.int32(t), np.int32(h),
                                                            np.int32(hkv), np.int32(hd), np.int32(ms), scale),
                                  shared_mem=smem)
        self._check_width(h * hd, v, "attention")
        _check(v != Q8_OUT or hd % 32 == 0, "attention: q8 output needs head_dim % 32 == 0")
        out, outs = self._producer_out((t, h * hd), v)
        self.k["attention_combine"]((t, h), (hd,), (pm, pl, po, self._qpos, *outs, np.int32(t), np.int32(h),
                                                     np.int32(hd), np.int32(ms), np.int32(v)))
        return out

    def launch_silu_gate(self, g, u, v=0):
        """SiLU gate of fp32 g, u [..., K]; output fp32 row-major (v = 0), lane-major with
        chunks of v, or (v = Q8_OUT) the :class:`Q8` codes of its rows."""
        _check(g.shape == u.shape and g.flags.c_contiguous and u.flags.c_contiguous, "silu_gate shapes")
        k = g.shape[-1]
        self._check_width(k, v, "silu_gate")
        out, outs = self._producer_out(g.shape, v)
        self.k["silu_gate"](((g.size + 255) // 256,), (256,),
                            (g, u, *outs, np.int64(g.size), np.int32(k), np.int32(v)))
        return out

    def launch_residual_add(self, x, y):
        _check(x.shape == y.shape and x.flags.c_contiguous and y.flags.c_contiguous, "residual_add shapes")
        out = self.cp.empty_like(x)
        self.k["residual_add"](((x.size + 255) // 256,), (256,), (x, y, out, np.int64(x.size)))
        return out

    def launch_embed(self, tokens):
        cp = self.cp
        t = self.model.tensors["token_embd.weight"]
        tok = cp.asarray(tokens, dtype=cp.int64)
        m = tok.size
        out = cp.empty((m, t.cols), cp.float32)
        n = m * t.cols
        self.k["embed"](((n + 255) // 256,), (256,), (self._weights[t.name], np.int32(QTYPE_IDS[t.qtype]),
                                                      np.int32(t.raw.shape[1]), tok, out, np.int32(m),
                                                      np.int32(t.cols)))
        return out

    def launch_argmax(self, logits):
        cp = self.cp
        r, v = logits.shape
        _check(logits.dtype == cp.float32 and logits.flags.c_contiguous, "argmax logits fp32 [R, V]")
        out = cp.empty((r,), cp.int32)
        nan = cp.empty((r,), cp.int32)
        self.k["argmax"]((r,), (256,), (logits, out, nan, np.int32(r), np.int32(v)))
        return out, nan

    def launch_sample_keys(self, logits, temps):
        """Sort keys of fp32 logits ``[R, V]`` at fp32 temperatures ``temps [R]`` (> 0):
        uint64 keys ``[R, V]`` (node/sampler.py sample_keys per row) and int32
        ``bad [R]``, 1 where some ``logits / T`` of the row is not finite."""
        cp = self.cp
        r, v = logits.shape
        _check(logits.dtype == cp.float32 and logits.flags.c_contiguous and 0 < v < 2 ** 31
               and temps.shape == (r,) and temps.dtype == cp.float32 and temps.flags.c_contiguous,
               "sample_keys logits fp32 [R, V], temps fp32 [R]")
        keys = cp.empty((r, v), cp.uint64)
        bad = cp.zeros(r, cp.int32)
        self.k["sample_keys"](((r * v + 255) // 256,), (256,), (logits, temps, keys, bad, np.int32(r), np.int32(v)))
        return keys, bad

    def launch_sample_sorted(self, logits, keys, temps, params, positions):
        """Draws of node/sampler.py sample_sorted for each row of fp32 logits ``[R, V]``
        and its ascending keys ``[R, V]``; ``temps``: the rows' fp32 temperatures ``[R]``
        (device, as given to :meth:`launch_sample_keys`); ``params``: R
        :class:`SamplingParams` with temperature > 0 (top-k, top-p, seed); ``positions``:
        R sequence positions (the PRNG counters). Returns int32 token ids ``[R]`` (device)."""
        cp = self.cp
        r, v = logits.shape
        _check(logits.dtype == cp.float32 and logits.flags.c_contiguous, "sample_sorted logits fp32 [R, V]")
        _check(keys.shape == (r, v) and keys.dtype == cp.uint64 and keys.flags.c_contiguous, "sample_sorted keys")
        _check(temps.shape == (r,) and temps.dtype == cp.float32 and temps.flags.c_contiguous,
               "sample_sorted temps fp32 [R]")
        _check(len(params) == r == len(positions) and all(p.temperature > 0 for p in params),
               "sample_sorted: one non-greedy SamplingParams and one position per row")

        def col(vals, dt):
            return cp.asarray(np.array(vals, dt))

        seed = np.array([(p.seed & 0xFFFFFFFF, p.seed >> 32) for p in params], np.uint32)
        out = cp.empty(r, cp.int32)
        self.k["sample_sorted"]((r,), (256,), (
            logits, keys, temps, col([p.top_k for p in params], np.int32),
            col([p.top_p for p in params], np.float32), cp.asarray(seed),
            col([q & 0xFFFFFFFF for q in positions], np.uint32), cp.empty((r, v), cp.float32), out,
            np.int32(r), np.int32(v)))
        return out

    def sample(self, logits, params, positions):
        """Seeded top-k/top-p on the device, the twin of node/sampler.py ``sample`` for
        temperature > 0: ``sample_keys``, a sort of each row's keys (CuPy; keys are
        unique, so every correct sort gives one order), ``sample_sorted``.
        ``logits`` fp32 ``[R, V]`` (device); returns int32 token ids ``[R]`` (device).
        Raises :class:`NumericFault` when ``logits / temperature`` of a row is not finite.
        """
        cp = self.cp
        temps = cp.asarray(np.array([p.temperature for p in params], np.float32))
        keys, bad = self.launch_sample_keys(logits, temps)
        out = self.launch_sample_sorted(logits, cp.sort(keys, axis=1), temps, params, positions)
        bad = self.to_host(bad)
        if bad.any():   # the CPU engine's message (node/sampler.py sample_keys)
            raise NumericFault(f"logits / temperature {params[int(bad.argmax())].temperature} overflow fp32")
        return out

    def sample_last(self, rows, params, positions) -> list[int]:
        """Token ids for rows ``rows`` of the last step's device logits (valid until the
        next step): ``argmax`` for greedy rows (temperature 0), :meth:`sample` for the
        others; returns host token ids in the order of ``rows``."""
        cp = self.cp
        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        seeded = [i for i, p in enumerate(params) if p.temperature != 0.0]
        try:
            with self.stream:
                def pick(idx):
                    return self._last[cp.asarray(np.asarray([rows[i] for i in idx], np.int64))]
                ids = []
                if greedy:
                    ids.append(self.launch_argmax(pick(greedy))[0])
                if seeded:
                    ids.append(self.sample(pick(seeded), [params[i] for i in seeded],
                                           [positions[i] for i in seeded]))
                host = self.to_host(cp.concatenate(ids)).tolist()
        except cp.cuda.memory.OutOfMemoryError as err:
            raise GpuError(f"out of GPU memory while sampling {len(rows)} rows: {err}") from None
        out = [0] * len(rows)
        for i, t in zip(greedy + seeded, host):
            out[i] = t
        return out

    def launch_tp_combine(self, partials):
        """fp32 partials [T, M, N] of a row-parallel product (rank order) -> fp32 [M, N]."""
        cp = self.cp
        t = partials.shape[0]
        _check(partials.dtype == cp.float32 and partials.flags.c_contiguous and t in (1, 2, 4, 8),
               "tp_combine partials fp32 [T in 1, 2, 4, 8, ...]")
        out = cp.empty(partials.shape[1:], cp.float32)
        n = out.size
        self.k["tp_combine"](((n + 255) // 256,), (256,), (partials, out, np.int64(n), np.int32(t)))
        return out

    def launch_step(self, h0, cos, sin, rows):
        """The whole forward step in one launch (cuda/step.cu) for the step that
        :meth:`begin_step` prepared: embedding rows fp32 ``[M, n_embd]``, the RoPE
        table fp32 ``[n_ctx, head_dim/2]`` (cos, sin), the rows whose logits are
        wanted int64 ``[R]``; returns fp32 logits ``[R, n_vocab]``. The KV cache
        gets every token's keys and values. Models :func:`step_defines` accepts only."""
        cp, hp = self.cp, self.hp
        m, d = h0.shape
        hd = hp.head_dim
        _check(self.step is not None, "launch_step: this model's steps run the per-op kernels")
        _check(h0.dtype == cp.float32 and h0.flags.c_contiguous and d == hp.n_embd and m == self._qpos.size,
               "step h0 fp32 [M, n_embd], M = the step's tokens")
        _check(all(t.dtype == cp.float32 and t.flags.c_contiguous and t.ndim == 2 and t.shape[1] == hd // 2
                   and t.shape[0] >= int(self._pos_max) + 1 for t in (cos, sin)) and cos.shape == sin.shape,
               "step cos, sin fp32 [n_ctx, head_dim/2] covering the step's positions")
        _check(rows.dtype == cp.int64 and rows.ndim == 1 and rows.flags.c_contiguous and rows.size >= 1,
               "step rows int64 [R]")
        _check(self.step_times is None or self.step_times.size >= 5 * -(-m // ST_TM) * hp.n_layer + 3,
               "step times: 5 per tile and layer, and 3")
        ms, tm = self._max_splits, min(m, ST_TM)   # tm: the tokens of the largest tile
        h = cp.empty_like(h0)
        h1, q, att = (cp.empty((tm, d), cp.float32) for _ in range(3))
        act = cp.empty((tm, hp.n_ff), cp.float32)
        scratch = cp.empty(tm * hp.n_head * (hd // 32) * ms * ST_OREC, cp.float32)
        logits = cp.empty((rows.size, hp.n_vocab), cp.float32)
        args = StepArgs(*(0 if a is None else a.data.ptr for a in (
            self._step_mats, self._step_norms, h0, h, h1, q, att, act, self.kp, self.vp, self._page_tab, self._qpos,
            cos, sin, rows, scratch, logits, self._step_flags, self.step_times)), hp.n_layer, m, rows.size, ms,
            self.kv_pages, hp.n_vocab, float(np.float32(hp.rms_eps)), float(np.float32(1.0) / np.sqrt(np.float32(hd))))
        self.step((self._step_flags.size,), (32 * ST_WARPS,), args, shared_mem=self.step_smem)
        return logits

    # ---- backend ops (same interface as CpuBackend) -------------------------
    def embed(self, tokens):
        return self.launch_embed(tokens)

    def _feed_width(self, feeds) -> int:
        """Chunk width :func:`x_width` (K) when every weight in ``feeds`` is a float
        matrix (their input can be written lane-major), else 0 (also under contract 2,
        whose products read row-major inputs)."""
        if not feeds or self.contract == 2 or any(self.model.tensors[n].qtype not in FLOAT_TYPES for n in feeds):
            return 0
        return x_width(self.model.tensors[feeds[0]].cols)

    def _feed_output(self, feeds) -> int:
        """Output argument of a producer kernel whose result only ``feeds`` read:
        :data:`Q8_OUT` when every one has quantized weights, else :meth:`_feed_width`."""
        if feeds and all(self.model.tensors[n].qtype not in FLOAT_TYPES for n in feeds):
            return Q8_OUT
        return self._feed_width(feeds)

    def _wrap(self, y, v):
        """A producer's output ``y`` written with output argument ``v``: :class:`LaneMajor` when v > 0."""
        return LaneMajor(y, v) if v > 0 else y

    def _matmul_f(self, xl, names, residual):
        ys = self.launch_matmul_f(xl, list(names))
        return ys if residual is None else [self.launch_residual_add(residual, ys[0])]

    def rms_norm(self, x, name, feeds=()):
        """RMSNorm; written lane-major when every product in ``feeds`` has float weights,
        as q8 codes when every one has quantized weights."""
        v = self._feed_output(feeds)
        y = self.launch_rms_norm(self.cp.ascontiguousarray(x), self._weights[name], self.hp.rms_eps, v)
        return self._wrap(y, v)

    def linears(self, x, names):
        """``[x @ W.T for W in names]`` (same K): x fp32 ``[M, K]`` (or :class:`LaneMajor`,
        or :class:`Q8`); results fp32 ``[M, N_i]``.

        x is quantized once for the quantized weights and laid out lane-major
        once (chunks of :func:`x_width`) for the float weights of every type (unless
        its producer already wrote it so); weights of one route (and float type)
        share one fused launch.
        """
        return self._linears(x, names)

    def linear_residual(self, x, h, name):
        """``x + h @ W.T`` for the one matrix ``name``: x fp32 ``[M, N]`` (the residual
        stream), h as :meth:`linears` takes it; fp32 ``[M, N]``. For quantized weights
        the add is fused into matmul_q's epilogue (the twin of reference.residual_add
        after the product); float weights take residual_add after matmul_f (fused,
        matmul_f measured 5-8 % slower at batch 1: docs/benchmarks.md)."""
        return self._linears(h, (name,), self.cp.ascontiguousarray(x))[0]

    def _linears(self, x, names, residual=None):
        if isinstance(x, Q8):
            _check(self._feed_output(names) == Q8_OUT, f"q8 input for {names}")
            return self.launch_matmul_q(x, list(names), residual)
        if isinstance(x, LaneMajor):
            _check(self._feed_width(names) == x.v, f"lane-major input of width {x.v} does not match {names}")
        else:
            x = self.cp.ascontiguousarray(x)
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            qt = self.model.tensors[name].qtype
            groups.setdefault(qt if qt in FLOAT_TYPES else "q", []).append(i)
        out, xl, xr = [None] * len(names), None, None
        for key, idx in groups.items():
            if key == "q":   # x is row-major: a lane-major x feeds float weights only
                ys = self.launch_matmul_q(self.launch_quantize_q8(x), [names[i] for i in idx], residual)
            elif self.contract == 2:   # one quantize_rowint for every float type
                xr = self.launch_quantize_rowint(x) if xr is None else xr
                ys = self.launch_matmul_rowint(xr, [names[i] for i in idx])
                ys = ys if residual is None else [self.launch_residual_add(residual, ys[0])]
            else:            # one lane-major x for every float type
                if xl is None:
                    xl = x.data if isinstance(x, LaneMajor) else self.launch_lane_major(x, x_width(x.shape[1]))
                ys = self._matmul_f(xl, [names[i] for i in idx], residual)
            for i, y in zip(idx, ys):
                out[i] = y
        return out

    def silu_gate(self, g, u, feeds=()):
        """SiLU gate; written lane-major when every product in ``feeds`` has float weights,
        as q8 codes when every one has quantized weights."""
        v = self._feed_output(feeds)
        return self._wrap(self.launch_silu_gate(g, u, v), v)

    def residual_add(self, x, y):
        return self.launch_residual_add(x, y)

    # ---- paged KV cache ----------------------------------------------------
    def kv_alloc(self, seq: int) -> None:
        self._pages[seq] = []

    def kv_free(self, seq: int) -> None:
        self._free_pages.extend(reversed(self._pages.pop(seq, [])))

    def _grow(self, seq: int, n_positions: int) -> None:
        pages = self._pages[seq]
        need = -(-n_positions // SPLIT_KV) - len(pages)
        if need > len(self._free_pages):
            raise GpuError(f"KV cache full: {need} more pages needed, {len(self._free_pages)} free")
        for _ in range(max(0, need)):
            pages.append(self._free_pages.pop())

    def kv_copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give ``dst`` pages for ``n`` positions and copy ``src``'s into them.
        Raises :class:`GpuError` when the KV cache has too few free pages (``dst``
        then holds none)."""
        self._pages[dst] = []
        try:
            self._grow(dst, n)
        except GpuError:
            del self._pages[dst]
            raise
        with self.stream:   # the steps' stream (non-blocking: the caller's default stream would not order the copies)
            for sp, dp in zip(self._pages[src], self._pages[dst]):
                self.kp[:, dp] = self.kp[:, sp]
                self.vp[:, dp] = self.vp[:, sp]

    def graph_key(self, m: int, r: int, splits: int) -> tuple[int, int, int] | None:
        """The captured CUDA graph that a step of ``m`` tokens, ``r`` logits rows and
        ``splits`` KV splits (of its furthest position) replays: ``(tokens, rows,
        splits)`` padded up to :data:`GRAPH_TOKENS`, :data:`GRAPH_ROWS` and a power of
        two (at most ``max_splits``). None (eager launches) when graphs are off or
        the step is larger."""
        mb = next((b for b in GRAPH_TOKENS if b >= m), None)
        rb = next((b for b in GRAPH_ROWS if b >= r), None)
        if not self.graphs or mb is None or rb is None:
            return None
        return mb, rb, min(1 << (splits - 1).bit_length(), self.max_splits)

    def begin_step(self, spans, pos, replay: bool = False) -> None:
        """Allocate pages for this step's positions and fill the per-token page tables.

        A step whose logits rows are its chunks' last tokens (``replay``) and that
        fits a :meth:`graph_key` is padded to that graph's shape: padding tokens are
        token 0 at position 0 on the scratch page, padding logits rows repeat the
        last token row, and the page tables have the graph's split count, so the
        step can replay a captured CUDA graph. Per-row results do not depend on the
        padding (every op is per token or per row, and a split past a token's
        position adds nothing).
        """
        self._entry = None
        try:
            with self.stream:
                self._begin_step(spans, pos, replay)
        except self.cp.cuda.memory.OutOfMemoryError as err:   # a new graph's buffers, an eager step's tables
            raise GpuError(f"out of GPU memory preparing a step of {len(pos)} tokens: {err}") from None

    def _begin_step(self, spans, pos, replay):
        cp = self.cp
        for seq, a, b in spans:
            self._grow(seq, int(pos[b - 1]) + 1)
        m = len(pos)
        need = int(pos.max()) // SPLIT_KV + 1
        key = self.graph_key(m, len(spans), need) if replay else None
        rows, ms = (key[0], key[2]) if key else (m, need)
        tab = np.full((rows, ms), self._scratch_page, np.int32)
        tok_page = np.full(rows, self._scratch_page, np.int32)
        for seq, a, b in spans:
            pg = self._pages[seq]
            n = min(len(pg), ms)
            tab[a:b, :n] = pg[:n]
            tok_page[a:b] = [pg[p // SPLIT_KV] for p in pos[a:b]]
        qpos = np.zeros(rows, np.int32)
        qpos[:m] = pos
        self._max_splits, self._pos_max = ms, int(pos.max())
        if key is None:   # eager launches (begin_step has cleared _entry)
            self._page_tab, self._tok_page = cp.asarray(tab), cp.asarray(tok_page)
            self._tok_slot, self._qpos = cp.asarray(qpos % SPLIT_KV), cp.asarray(qpos)
            return
        e = self._graph_cache.get(key)
        if e is None:
            e = self._graph_cache[key] = self._new_graph(*key)
        h = e["host"]
        h["tab"][:] = tab
        h["page"][:] = tok_page
        h["slot"][:] = qpos % SPLIT_KV
        h["qpos"][:] = qpos
        d = e["dev"]
        self._page_tab, self._tok_page, self._tok_slot, self._qpos = d["tab"], d["page"], d["slot"], d["qpos"]
        self._entry = e

    def _new_graph(self, mb: int, rb: int, ms: int) -> dict:
        """Buffers of the graph of ``mb`` tokens, ``rb`` logits rows and ``ms`` KV
        splits. The step's inputs (token ids, positions, logits rows, page tables)
        live in one pinned host buffer mirrored by one device buffer, so a step
        uploads them with a single asynchronous copy; the logits come back into
        pinned host memory (:meth:`_run`). Every graph takes its memory from one pool: graphs run one
        at a time, each rewrites its inputs before it runs, and each ends by
        copying its logits into one buffer that a step reads before the next step
        runs, so graphs share their scratch memory. The pool never frees a block
        (its base allocator, :func:`_malloc_no_retry`, raises its out-of-memory
        error itself instead of letting the pool free its own free blocks and
        retry): a captured graph keeps using its scratch."""
        cp = self.cp
        import cupyx

        layout = (("tok", np.int64, mb), ("pos", np.int64, mb), ("rows", np.int64, rb), ("tab", np.int32, mb * ms),
                  ("page", np.int32, mb), ("slot", np.int32, mb), ("qpos", np.int32, mb))
        size = sum(np.dtype(t).itemsize * n for _, t, n in layout)
        if self._graph_pool is None:
            self._graph_pool = cp.cuda.MemoryPool(_malloc_no_retry)
        if self._graph_out is None:   # apart from the pool: an out-of-memory here leaves it to the next graph
            with cp.cuda.using_allocator(self._graph_pool.malloc):
                self._graph_out = cp.empty((GRAPH_ROWS[-1], self.hp.n_vocab), cp.float32)
        with cp.cuda.using_allocator(self._graph_pool.malloc):
            dev_raw = cp.zeros(size, cp.uint8)
        host_raw = cupyx.zeros_pinned(size, np.uint8)
        host, dev, off = {}, {}, 0
        for name, t, n in layout:
            nb = np.dtype(t).itemsize * n
            host[name] = host_raw[off:off + nb].view(t)
            dev[name] = dev_raw[off:off + nb].view(t)
            off += nb
        host["tab"], dev["tab"] = host["tab"].reshape(mb, ms), dev["tab"].reshape(mb, ms)
        return {"graph": None, "tokens": mb, "host_raw": host_raw, "dev_raw": dev_raw, "host": host, "dev": dev}

    def run(self, forward, tok, pos, rows) -> np.ndarray:
        """Run the engine's device pass; returns host fp32 logits ``[R, n_vocab]`` (pinned
        memory of their own on replayed steps).

        A step :meth:`begin_step` fitted to a graph replays it, captured on first
        use in the graphs' memory pool (so no allocation outside graphs can reuse
        their buffers); other steps launch eagerly.
        """
        cp = self.cp
        e = self._entry
        try:
            with self.stream:
                return self._run(forward, tok, pos, rows, e)
        except cp.cuda.memory.OutOfMemoryError as err:
            raise GpuError(f"out of GPU memory in a step of {len(tok)} tokens: {err}") from None
        except cp.cuda.runtime.CUDARuntimeError as err:   # cudaHostAlloc of the logits' pinned memory
            if err.status != CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            raise GpuError(f"out of pinned host memory for the logits of a step of {len(rows)} rows") from None

    def _run(self, forward, tok, pos, rows, e):
        cp = self.cp
        import cupyx
        if e is None:
            self._last = forward(cp.asarray(tok), cp.asarray(pos), cp.asarray(rows))
            return self.to_host(self._last)
        m, r = len(tok), len(rows)
        h, d = e["host"], e["dev"]
        h["tok"][:m], h["tok"][m:] = tok, 0
        h["pos"][:m], h["pos"][m:] = pos, 0
        h["rows"][:r], h["rows"][r:] = rows, e["tokens"] - 1
        e["dev_raw"].set(e["host_raw"], self.stream)
        if e["graph"] is None:
            def step():   # the forward pass, then its logits into the graphs' one output buffer
                out = forward(d["tok"], d["pos"], d["rows"])
                self._graph_out[:out.shape[0]] = out     # out itself is scratch once captured
            with cp.cuda.using_allocator(self._graph_pool.malloc):
                step()          # warm the pool and load every kernel: no cudaMalloc or module load in capture
                self.stream.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    step()
                except BaseException:   # a capture that failed half-way (out of memory) is dropped, not kept,
                    try:                # and its error is the one raised, not end_capture's on the void capture
                        self.stream.end_capture()
                    except cp.cuda.runtime.CUDARuntimeError:
                        pass
                    raise
                e["graph"] = self.stream.end_capture()
        e["graph"].launch(self.stream)
        self._last = self._graph_out[:r]
        # Pinned host memory of its own (CuPy's pinned pool takes it back when the caller
        # drops it), one size per row bucket: no host copy after the transfer.
        host = cupyx.empty_pinned((e["host"]["rows"].size, self.hp.n_vocab), np.float32)[:r]
        self._last.get(self.stream, out=host)
        self.stream.synchronize()
        return host

    def attend(self, layer, q, k, v, cos, sin, feeds=()):
        """RoPE of q (fp32 ``[M, H, hd]``) and k (fp32 ``[M, Hkv, hd]``) with the step's
        table rows cos, sin (fp32 ``[M, hd/2]``), store k and v in the KV cache, attend;
        returns fp32 ``[M, H*hd]``, lane-major when every product in ``feeds`` has float
        weights, as q8 codes when every one has quantized weights (and hd % 32 == 0)."""
        cp = self.cp
        q = self.launch_rope(layer, *(cp.ascontiguousarray(a) for a in (q, k, v, cos, sin)))
        self._layer_k, self._layer_v = self.kp[layer], self.vp[layer]
        out = self._feed_output(feeds)
        if out == Q8_OUT and self.hp.head_dim % 32:
            out = 0
        return self._wrap(self.launch_attention(q, out), out)
