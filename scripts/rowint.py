"""numpy twins and layouts of the rowint probe (scripts/rowint_probe.cu).

The rowint route for F16/BF16 products, weighed in docs/benchmarks.md ("The
route past batch 32") and not part of the node's contract: each weight row and
each token's input become integer codes with one power-of-two scale each, the
dot product is the exact integer sum of code products (so any order, split or
tensor-core tile gives the same integer), and the output is that integer times
both scales, rounded once to fp32. Shapes: ``M`` tokens, ``N`` output rows,
``K`` inputs.
"""

from __future__ import annotations

import numpy as np

W_CODE_BITS = 12   # weight codes: |c| <= 2^13 (two int8 slices)
X_CODE_BITS = 19   # input codes: |c| <= 2^20 (three int8 slices)


def quantize_rowint(a: np.ndarray, bits: int):
    """Row-scaled integer codes of fp32 ``a`` ``[R, K]`` (finite values).

    Per row: ``E = floor(log2(max |a|))`` (0 for an all-zero row), scale
    exponent ``s = E - bits``, codes ``c = rint(a * 2^-s)`` (round half to even;
    the scaling is exact in float64), so ``|c| <= 2^(bits + 1)``. Returns
    ``(c float64 [R, K] integer-valued, s int32 [R])``.
    """
    amax = np.max(np.abs(a), axis=1)
    s = np.where(amax > 0, np.frexp(amax)[1] - 1 - bits, 0).astype(np.int32)
    return np.rint(np.ldexp(a.astype(np.float64), -s[:, None])), s


def matmul_rowint(xr, wr) -> np.ndarray:
    """``y[m, n] = fp32_rn(I[m, n] * 2^(sx[m] + sw[n]))``, ``I = sum_k cx[m, k] * cw[n, k]`` exactly.

    ``xr``, ``wr``: :func:`quantize_rowint` of x ``[M, K]`` (X_CODE_BITS) and W
    ``[N, K]`` (W_CODE_BITS). Every partial sum is an integer below
    ``K * 2^33 < 2^53``, so the float64 GEMM is exact in any order (its BLAS
    may use any); the one rounding is the conversion to fp32. Returns fp32 ``[M, N]``.
    """
    (cx, sx), (cw, sw) = xr, wr
    return np.ldexp(cx @ cw.T, sx[:, None] + sw[None, :]).astype(np.float32)


def pack_w(xp, codes):
    """Weight codes (integer-valued ``[N, K]``, N % 16 == 0, K % 32 == 0) as matmul_rowint
    reads them: per 16-row tile and 32-element k-step, the low slice ``c & 127`` then the
    high slice ``c >> 7``, each the 512 bytes of the m16n8k32 A fragments in lane order
    (lane 4 g + t: rows g and g + 8 at elements 4 t .. 4 t + 3, then 16 + 4 t ..).
    ``xp``: numpy or CuPy. Returns uint8 ``[N / 16, K / 32, 2, 512]``."""
    n, k = codes.shape
    if n % 16 or k % 32:
        raise ValueError(f"pack_w: N % 16 and K % 32 must be 0, got {codes.shape}")
    c = codes.astype(xp.int32)
    out = [sl.astype(xp.int8).reshape(n // 16, 2, 8, k // 32, 2, 4, 4)   # tile, row half, g, kk, k half, t, byte
           .transpose(0, 3, 2, 5, 4, 1, 6).reshape(n // 16, k // 32, 512) for sl in (c & 127, c >> 7)]
    return xp.stack(out, axis=2).view(xp.uint8)


def pack_x(codes: np.ndarray) -> np.ndarray:
    """Input codes (integer-valued ``[M, K]``) as quantize_rowint writes them: per 8-token
    tile and k-step, the slices ``c & 127``, ``(c >> 7) & 127``, ``c >> 14``, each the 256
    bytes of the B fragments in lane order (lane 4 g + t: token g at elements 4 t ..
    4 t + 3, then 16 + 4 t ..); tokens past M zero. Returns uint8 ``[ceil(M/8), K/32, 3, 256]``."""
    m, k = codes.shape
    mp = -(-m // 8) * 8
    c = np.zeros((mp, k), np.int32)
    c[:m] = codes
    out = [s.astype(np.int8).reshape(mp // 8, 8, k // 32, 2, 4, 4).transpose(0, 2, 1, 4, 3, 5)
           .reshape(mp // 8, k // 32, 256) for s in (c & 127, (c >> 7) & 127, c >> 14)]
    return np.stack(out, axis=2).view(np.uint8)
