"""numpy reference engine: the executable form of docs/determinism.md.

Each function here is the twin of the CUDA kernel with the same name in
cuda/*.cu and performs the same fp32 operations in the same order. numpy's
elementwise ufuncs are single correctly rounded IEEE-754 operations (no
contraction into FMA); reductions never use ``np.sum``/BLAS on non-integer data,
only :func:`warp_sum`. Integer-valued products use sgemm, which is exact because
every partial sum stays below 2**24 (see "Quantized matrix products"), and
contract 2's integer products use float64 GEMM, exact below 2**53.

Shapes: ``M`` tokens, ``K`` input features, ``N`` output features, ``H`` query
heads, ``Hkv`` KV heads, ``hd`` head dimension, ``nb = K/32`` blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .fmath import exp32
from .gguf_model import QK, dequantize_rows

F32 = np.float32
WARP = 32          # lanes in the fixed reduction tree
SPLIT_KV = 256     # key positions per attention split (fixed, never a split count)


def subtree_sum(t: np.ndarray, g: int, lanes: int, axis: int = -1) -> np.ndarray:
    """The part of the contract tree that ``lanes`` consecutive lanes compute.

    ``t`` holds the terms of those lanes in order along ``axis`` (at most
    ``lanes * g``; lanes past the end hold none). Lane ``l`` adds terms
    ``l*g .. l*g+g-1`` one by one onto +0.0; then the lane values are added
    pairwise, neighbours first (offsets 1, 2, 4, ...), until one value is left.
    ``lanes`` is a power of two dividing 32. With ``lanes = 32`` this is
    :func:`warp_sum`; a tensor-parallel rank that owns ``32/T`` lanes of K
    computes its partial with ``lanes = 32/T``, and the T partials combine as
    ``subtree_sum(partials, 1, T)`` (docs/determinism.md section 3).
    Returns fp32 with ``axis`` removed.
    """
    t = np.asarray(t, dtype=F32)
    axis = axis % t.ndim
    n = t.shape[axis]
    if lanes & (lanes - 1) or WARP % lanes or n > lanes * g:
        raise ValueError(f"{n} terms do not fit {lanes} lanes of {g}")
    lead = (slice(None),) * axis
    full, rest = divmod(n, g)  # lanes holding g terms; terms of the one partial lane after them
    # The full lanes' terms split in place into (full, g): no copy of the terms.
    tf = t[lead + (slice(0, full * g),)].reshape(t.shape[:axis] + (full, g) + t.shape[axis + 1:])
    acc = np.zeros(t.shape[:axis] + (lanes,) + t.shape[axis + 1:], F32)  # lanes past the terms stay +0.0
    for j in range(g):
        acc[lead + (slice(0, full),)] += tf[lead + (slice(None), j)]
    for j in range(rest):
        acc[lead + (full,)] += t[lead + (full * g + j,)]
    while acc.shape[axis] > 1:
        acc = acc[lead + (slice(0, None, 2),)] + acc[lead + (slice(1, None, 2),)]
    return acc[lead + (0,)]


def lane_terms(n: int) -> int:
    """Terms per lane ``g = max(1, ceil(n / 32))`` of a ``warp_sum`` over ``n`` terms."""
    return max(1, -(-n // WARP))


def warp_sum(t: np.ndarray, axis: int = -1) -> np.ndarray:
    """Contract sum of fp32 terms along ``axis`` (docs/determinism.md, "warp_sum").

    With ``n`` terms and ``g = max(1, ceil(n/32))``, lane ``l`` adds terms
    ``l*g .. l*g+g-1`` (those below ``n``) one by one onto +0.0; then the 32 lane
    values are added pairwise, neighbours first (xor-butterfly with offsets
    1, 2, 4, 8, 16). Returns fp32 with ``axis`` removed.
    """
    return subtree_sum(t, lane_terms(np.shape(t)[axis]), WARP, axis)


def embed(t, tokens: np.ndarray) -> np.ndarray:
    """Embedding lookup (docs/determinism.md section 4; twin of the kernel of that name):
    rows ``tokens`` int ``[M]`` of the token-embedding :class:`~node.gguf_model.Tensor`
    ``t`` ``[V, K]``, dequantized (:func:`~node.gguf_model.dequantize_rows`). Returns fp32 ``[M, K]``."""
    return dequantize_rows(t, tokens)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019): ``(x * (1 / sqrt(warp_sum(x*x)/K + eps))) * w``.

    x fp32 ``[M, K]``, w fp32 ``[K]``; returns fp32 ``[M, K]``.
    """
    k = x.shape[-1]
    ss = warp_sum(x * x, axis=-1)
    inv = F32(1.0) / np.sqrt(ss / F32(k) + F32(eps))
    return (x * inv[:, None]) * w


def quantize_q8(x: np.ndarray):
    """Quantize activations per 32-element block to int8 (ggml's q8_1 scheme).

    x fp32 ``[M, K]``. Per block: ``amax = max|x|``, ``d = amax / 127``,
    ``q = clip(rint(x / d), -127, 127)`` (0 when ``d == 0``), ``a = sum(q)``.
    A block holding a NaN or an infinity gets ``d = NaN`` (bits 0x7fc00000 on
    every device) and codes 0, so every product it enters is NaN: a fault
    (docs/determinism.md sections 2 and 5).
    Returns ``(q int8 [M, nb, 32], d fp32 [M, nb], a int32 [M, nb])``.
    """
    m, k = x.shape
    xb = x.reshape(m, k // QK, QK)
    amax = np.max(np.abs(xb), axis=-1)   # NaN when the block holds one
    d = np.where(np.isfinite(amax), amax / F32(127.0), F32(np.nan))
    safe = np.where(d > 0, d, F32(1.0))
    q = np.where(d[..., None] > 0, np.clip(np.rint(xb / safe[..., None]), -127, 127), 0).astype(np.int8)
    return q, d.astype(F32), q.astype(np.int32).sum(axis=-1, dtype=np.int32)


def matmul_q(xq, w, g: int | None = None, lanes: int = WARP) -> np.ndarray:
    """Quantized matrix product ``y[m, n] = sum_k x[m, k] * W[n, k]``.

    ``xq`` is :func:`quantize_q8`'s output for x ``[M, K]``; ``w`` a
    :class:`RefQuantWeight` for W ``[N, K]``. Per block ``b``:
    ``I = sum(code * q)`` (exact integer), ``r = (s*d) * I`` and, for asymmetric
    types, ``r = r + (o*d) * a``; then ``y = warp_sum(r over b)``.
    With ``g`` and ``lanes`` (a tensor-parallel shard: the blocks of ``lanes``
    lanes of ``g`` blocks each) it returns that shard's :func:`subtree_sum`.
    Returns fp32 ``[M, N]``.
    """
    q, d, a = xq
    qa = np.ascontiguousarray(q.transpose(1, 0, 2)).astype(F32)          # [nb, M, 32]
    isum = np.matmul(qa, w.codes)                                        # [nb, M, N] exact
    dT = d.T[:, :, None]                                                 # [nb, M, 1]
    r = (w.scale[:, None, :] * dT) * isum
    if w.offset is not None:
        r = r + (w.offset[:, None, :] * dT) * a.T[:, :, None].astype(F32)
    return subtree_sum(r, lane_terms(r.shape[0]) if g is None else g, lanes, axis=0)


def matmul_f(x: np.ndarray, w: np.ndarray, g: int | None = None, lanes: int = WARP) -> np.ndarray:
    """Float-weight matrix product ``y[m, n] = warp_sum_k(x[m, k] * W[n, k])``.

    x fp32 ``[M, K]``, w fp32 ``[N, K]`` (exact values of F32/F16/BF16 weights).
    With ``g`` and ``lanes`` (a tensor-parallel shard of K) it returns that
    shard's :func:`subtree_sum`. Returns fp32 ``[M, N]``. Processed in row
    chunks to bound memory.
    """
    m, k = x.shape
    n = w.shape[0]
    g = lane_terms(k) if g is None else g
    out = np.empty((m, n), F32)
    step = max(1, (1 << 24) // max(1, m * k))
    for i in range(0, n, step):
        out[:, i:i + step] = subtree_sum(x[:, None, :] * w[None, i:i + step, :], g, lanes, axis=-1)
    return out


W_CODE_BITS = 12   # contract 2: weight codes |c| <= 2^13 (two int8 slices on the GPU)
X_CODE_BITS = 19   # contract 2: input codes |c| <= 2^20 (three int8 slices on the GPU)
MAX_ROWINT_K = 1 << 16   # contract 2: K below this keeps every GPU slice sum below 2^31
ROWINT_NONFINITE = 1 << 30   # contract 2: the exponent of a row holding a NaN or infinity


class RowintWeight(NamedTuple):
    """A float matrix ``[N, K]`` as contract 2 multiplies it (:func:`quantize_rowint`
    with :data:`W_CODE_BITS`): integer codes int16 ``[N, K]`` and scale exponents
    int32 ``[N]``."""
    codes: np.ndarray
    s: np.ndarray


def quantize_rowint(a: np.ndarray, bits: int):
    """Row-scaled integer codes of fp32 ``a`` ``[R, K]`` (docs/determinism.md section 14).

    Per row: ``E = floor(log2(max |a|))``, scale exponent ``s = E - bits``
    (0 for an all-zero row), codes ``c = rint(a * 2^-s)`` (round half to even;
    the scaling is exact in float64), so ``|c| <= 2^(bits + 1)``. A row holding
    a NaN or an infinity gets ``s =`` :data:`ROWINT_NONFINITE` and zero codes.
    Weights take ``bits`` = :data:`W_CODE_BITS`, inputs :data:`X_CODE_BITS`.
    Returns ``(c int32 [R, K], s int32 [R])``.
    """
    amax = np.max(np.abs(a), axis=1)            # NaN and inf propagate
    bad = ~np.isfinite(amax)
    s = np.where(amax > 0, np.frexp(np.where(bad, 1, amax))[1] - 1 - bits, 0).astype(np.int32)
    a64 = a.astype(np.float64)
    a64[bad] = 0.0
    s[bad] = 0
    c = np.rint(np.ldexp(a64, -s[:, None])).astype(np.int32)
    s[bad] = ROWINT_NONFINITE
    return c, s


def matmul_rowint(xr, w: RowintWeight) -> np.ndarray:
    """Contract 2's product of float weights (docs/determinism.md section 14):
    ``y[m, n] = fp32_rn(I[m, n] * 2^(sx[m] + s[n]))`` with the exact integer
    ``I = sum_k cx[m, k] * codes[n, k]``.

    ``xr``: :func:`quantize_rowint` of x ``[M, K]`` with :data:`X_CODE_BITS`;
    ``w``: a :class:`RowintWeight` ``[N, K]``. Every partial sum is an integer
    of magnitude at most ``K * 2^33 < 2^53``, so the float64 GEMM is exact in any order (its
    BLAS may use any); the one rounding is the conversion to fp32. Processed in
    row chunks to bound memory. An output whose row of x or of W is not finite
    (exponent :data:`ROWINT_NONFINITE`) is NaN. Returns fp32 ``[M, N]``. Raises
    ValueError for ``K >= 2^16``.
    """
    cx, sx = xr
    m, k = cx.shape
    if k >= MAX_ROWINT_K:
        raise ValueError(f"contract 2 products need K < {MAX_ROWINT_K}, got K={k}")
    n = w.codes.shape[0]
    x64 = cx.astype(np.float64)
    out = np.empty((m, n), F32)
    step = max(1, (1 << 22) // max(1, k))
    bad_x = sx == ROWINT_NONFINITE
    for i in range(0, n, step):
        sw = w.s[i:i + step]
        bad = bad_x[:, None] | (sw == ROWINT_NONFINITE)[None, :]
        e = np.where(bad, 0, sx[:, None] + sw[None, :])
        out[:, i:i + step] = np.where(bad, np.nan, np.ldexp(x64 @ w.codes[i:i + step].astype(np.float64).T, e))
    return out


def lane_width(k: int, esize: int) -> int:
    """Elements ``V`` per lane chunk for rows of ``K`` elements of ``esize`` bytes.

    The largest of ``16 / esize, ..., 2, 1`` that divides ``g = K / 32`` (so a
    lane's chunk is one 16-byte load when possible). Depends on K only.
    Raises ValueError when ``K % 32 != 0``.
    """
    if k % WARP:
        raise ValueError(f"lane-major layout needs K % 32 == 0, got K={k}")
    v = 16 // esize
    while (k // WARP) % v:
        v //= 2
    return v


def lane_major(a: np.ndarray, v: int, lanes: int = WARP) -> np.ndarray:
    """Reorder the last axis (``K = lanes * g``) into lane-major chunks of ``v`` elements.

    Chunk ``(l, j)``, the elements ``l*g + j*v .. l*g + j*v + v - 1`` that lane
    ``l`` of :func:`warp_sum` adds at its step ``j``, moves to
    ``(j*lanes + l) * v``. A pure permutation of any dtype (no arithmetic): a
    warp then reads its lanes' step-``j`` chunks as one contiguous span.
    ``lanes`` < 32 lays out a tensor-parallel shard of K (its ``lanes``
    contract lanes, docs/determinism.md section 12).
    ``a`` ``[..., K]`` (a numpy or CuPy array); returns a new C-contiguous array
    of the same shape, dtype and array module.
    """
    *lead, k = a.shape
    g = k // lanes
    return a.reshape(*lead, lanes, g // v, v).swapaxes(-3, -2).copy().reshape(*lead, k)


def tp_combine(partials: np.ndarray) -> np.ndarray:
    """The ``T`` gathered partials fp32 ``[T, ...]`` (rank order) of a row-parallel
    product combined as the contract tree's top ``log2(T)`` levels,
    neighbours first (docs/determinism.md section 12). Returns fp32 ``[...]``."""
    return subtree_sum(partials, 1, partials.shape[0], axis=0)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE (Su et al. 2021, arXiv:2104.09864) on adjacent pairs (ggml ROPE_TYPE_NORM).

    x fp32 ``[M, H, hd]``; cos, sin fp32 ``[M, hd/2]`` rows of the RoPE table at
    each token's position. ``out[2i] = x[2i]*c - x[2i+1]*s``,
    ``out[2i+1] = x[2i]*s + x[2i+1]*c``. Returns fp32 ``[M, H, hd]``.
    """
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """Causal GQA attention with fixed-size KV splits (docs/determinism.md, "Attention").

    q fp32 ``[T, H, hd]`` (after RoPE) for tokens of one sequence at positions
    ``qpos`` int ``[T]``; k_cache, v_cache fp32 ``[Hkv, P, hd]`` holding that
    sequence's keys/values for positions ``0 .. max(qpos)`` at least.
    Query head ``h`` reads KV head ``h // (H / Hkv)``. Returns fp32 ``[T, H, hd]``.

    Queries are taken a few at a time. For each such pass only the slots up to
    the pass's last position are computed: the splits past it and the tail of
    its last split are masked for every query of the pass, and their ``+0``
    terms are left out, as a lane sum leaves out missing terms (adding ``+0``
    to a lane sum, never ``-0.0``, changes nothing).
    """
    t_n, h_n, hd = q.shape
    hkv = k_cache.shape[0]
    grp = h_n // hkv
    scale = F32(1.0) / np.sqrt(F32(hd))
    out = np.empty_like(q)
    chunk = max(1, (1 << 22) // (h_n * (int(qpos.max()) + 1) * hd))   # queries per pass: bounds the temporaries
    for i in range(0, t_n, chunk):
        qc = q[i:i + chunk].reshape(-1, hkv, grp, 1, 1, hd)             # [T,Hkv,G,1,1,hd]
        pos = qpos[i:i + chunk]
        end = int(pos.max()) + 1
        n_full = (end - 1) // SPLIT_KV                                  # splits before the pass's last one
        parts = [attention_split(qc, k_cache, v_cache, pos, scale, c0, n, slots)
                 for c0, n, slots in ((0, n_full, SPLIT_KV), (n_full * SPLIT_KV, 1, end - n_full * SPLIT_KV)) if n]
        m_c, l_c, live = (np.concatenate([p[j] for p in parts], axis=-1) for j in (0, 1, 3))
        o_c = np.concatenate([p[2] for p in parts], axis=-2)
        out[i:i + chunk] = attention_combine(m_c, l_c, o_c, live).reshape(-1, h_n, hd)
    return out


def attention_combine(m_c, l_c, o_c, live) -> np.ndarray:
    """The splits' sums combined in split order (docs/determinism.md section 8, step 5;
    twin of the kernel of that name): ``m_c``, ``l_c`` fp32 ``[T,Hkv,G,n]``, ``o_c`` fp32
    ``[T,Hkv,G,n,hd]`` and ``live`` bool ``[T,1,1,n]`` from :func:`attention_split`
    (a split without a live slot is skipped); returns fp32 ``[T,Hkv,G,hd]``."""
    m_all = np.max(np.where(live, m_c, F32(-np.inf)), axis=-1)          # [T,Hkv,G]
    big_l = np.zeros(m_all.shape, F32)
    big_o = np.zeros(m_all.shape + (o_c.shape[-1],), F32)
    for c in range(m_c.shape[-1]):
        lv = live[..., c]
        w = exp32(np.where(lv, m_c[..., c] - m_all, F32(0.0)))
        big_l = np.where(lv, big_l + l_c[..., c] * w, big_l)
        big_o = np.where(lv[..., None], big_o + o_c[..., c, :] * w[..., None], big_o)
    return big_o / big_l[..., None]


def attention_split(qc, k_cache, v_cache, pos, scale, first: int, n: int, slots: int):
    """Per-split sums (docs/determinism.md section 8; twin of the kernel of that name)
    of ``n`` KV splits of ``slots`` slots each from position ``first`` (a split
    boundary; ``slots`` <= :data:`SPLIT_KV`) for the queries ``qc`` fp32 ``[T,Hkv,G,1,1,hd]`` at positions ``pos`` ``[T]``: returns
    ``m_c`` ``[T,Hkv,G,n]``, ``l_c`` ``[T,Hkv,G,n]``, ``o_c`` ``[T,Hkv,G,n,hd]``
    and ``live`` bool ``[T,1,1,n]`` (the query has an unmasked slot in the split)."""
    hkv, hd = k_cache.shape[0], k_cache.shape[2]
    kk = k_cache[:, first:first + n * slots].reshape(hkv, n, slots, hd)
    vv = v_cache[:, first:first + n * slots].reshape(hkv, n, slots, hd)
    keypos = (first + np.arange(n * slots)).reshape(n, slots)
    g_slot = SPLIT_KV // WARP  # lane l of a split's sums owns slots l*g_slot .. l*g_slot + g_slot - 1
    s = warp_sum(qc * kk[None, :, None], axis=-1) * scale              # [T,Hkv,G,n,slots]
    valid = (keypos[None] <= pos[:, None, None])[:, None, None]         # [T,1,1,n,slots]
    m_c = np.max(np.where(valid, s, F32(-np.inf)), axis=-1)             # [T,Hkv,G,n]
    with np.errstate(invalid="ignore"):
        e = np.where(valid, exp32(np.where(valid, s - m_c[..., None], F32(0.0))), F32(0.0))
    l_c = subtree_sum(e, g_slot, WARP, axis=-1)
    pv = np.where(valid[..., None], e[..., None] * vv[None, :, None], F32(0.0))
    o_c = subtree_sum(pv, g_slot, WARP, axis=-2)                        # [T,Hkv,G,n,hd]
    return m_c, l_c, o_c, valid.any(axis=-1)


def silu_gate(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SwiGLU gate (Shazeer 2020): ``(g / (1 + exp32(-g))) * u``, fp32, any shape."""
    return (g / (F32(1.0) + exp32(-g))) * u


def residual_add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Residual connection ``x + y``, fp32, one rounding per element."""
    return x + y


class RefQuantWeight:
    """A quantized matrix ``[N, K]`` laid out for :func:`matmul_q`.

    ``codes`` fp32 ``[nb, 32, N]`` (integer values), ``scale`` fp32
    ``[nb, N]``, ``offset`` fp32 ``[nb, N]`` or ``None``.
    """

    def __init__(self, codes, scale, offset):
        self.codes = np.ascontiguousarray(codes.transpose(1, 2, 0)).astype(F32)
        self.scale = np.ascontiguousarray(scale.T)
        self.offset = None if offset is None else np.ascontiguousarray(offset.T)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (as ``ndarray.nbytes``)."""
        return sum(a.nbytes for a in (self.codes, self.scale, self.offset) if a is not None)

    def part(self, rows: slice = slice(None), blocks: slice = slice(None)) -> "RefQuantWeight":
        """A view of some output rows and some K blocks (a tensor-parallel shard)."""
        sub = object.__new__(RefQuantWeight)
        sub.codes, sub.scale = self.codes[blocks, :, rows], self.scale[blocks, rows]
        sub.offset = None if self.offset is None else self.offset[blocks, rows]
        return sub

    def copy(self) -> "RefQuantWeight":
        """A copy owning its arrays (like ``ndarray.copy``), e.g. of a :meth:`part` view."""
        sub = self.part()
        sub.codes, sub.scale = sub.codes.copy(), sub.scale.copy()
        sub.offset = None if sub.offset is None else sub.offset.copy()
        return sub
