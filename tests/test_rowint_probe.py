"""The rowint probe's numpy twins and layouts (scripts/rowint.py; the CUDA probe
scripts/rowint_probe.cu is checked against them on the GPU by scripts/bench_rowint.py,
and built by tests/test_kernels_static.py)."""

import os
import sys
from fractions import Fraction

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import rowint  # noqa: E402


def _inputs(rng, m, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] = 0.0                                   # an all-zero row
    x[1, :3] = [1e-40, -3e-39, 2.0 ** -149]         # subnormals
    x[2, 5] = np.float32(6.5e4)                     # an outlier
    x[3] = np.float32(2.0 ** -140) * np.sign(x[3])  # a row of subnormals only
    return x


@pytest.mark.parametrize("bits", [rowint.W_CODE_BITS, rowint.X_CODE_BITS])
def test_codes_are_the_rounded_scaled_values_within_their_bound(bits):
    rng = np.random.default_rng(1)
    a = _inputs(rng, 6, 64)
    c, s = rowint.quantize_rowint(a, bits)
    assert c.dtype == np.float64 and s.dtype == np.int32 and np.all(c == np.rint(c))
    assert np.max(np.abs(c)) <= 2 ** (bits + 1) and s[0] == 0 and not c[0].any()
    for r in range(1, 6):
        amax = max(abs(Fraction(float(v))) for v in a[r])
        e = int(s[r]) + bits   # floor(log2(max |a|))
        assert Fraction(2) ** e <= amax < Fraction(2) ** (e + 1), r
        for v, code in zip(a[r], c[r]):
            exact = Fraction(float(v)) / Fraction(2) ** int(s[r])
            assert abs(exact - int(code)) <= Fraction(1, 2)
            if abs(exact - int(code)) == Fraction(1, 2):
                assert int(code) % 2 == 0   # ties to even


def test_the_product_is_the_exact_integer_scaled_and_rounded_once():
    rng = np.random.default_rng(2)
    x, w = _inputs(rng, 5, 96), rng.standard_normal((7, 96)).astype(np.float32)
    w[2] = 0.0
    xr, wr = rowint.quantize_rowint(x, rowint.X_CODE_BITS), rowint.quantize_rowint(w, rowint.W_CODE_BITS)
    y = rowint.matmul_rowint(xr, wr)
    assert y.dtype == np.float32 and y.shape == (5, 7)
    for m in range(5):
        for n in range(7):
            exact = sum(int(a) * int(b) for a, b in zip(xr[0][m], wr[0][n]))
            value = Fraction(exact) * Fraction(2) ** int(xr[1][m] + wr[1][n])
            # the fp32 nearest to the exact value (ties to even): exact -> double is exact here (|I| < 2^53)
            assert abs(exact) < 2 ** 53
            assert y[m, n] == np.float32(float(value)), (m, n)
            assert y[m, n].tobytes() == np.float32(float(value)).tobytes()   # +0.0, never -0.0


def test_the_product_does_not_depend_on_the_order_of_k():
    """Integer sums: any permutation of K (what a split or tile does) gives the same bytes,
    which a float sum of these terms would not (checked below on the same data)."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((4, 4096)).astype(np.float32), rng.standard_normal((8, 4096)).astype(np.float32)
    perm = rng.permutation(4096)
    one = rowint.matmul_rowint(rowint.quantize_rowint(x, rowint.X_CODE_BITS),
                               rowint.quantize_rowint(w, rowint.W_CODE_BITS))
    two = rowint.matmul_rowint(rowint.quantize_rowint(x[:, perm], rowint.X_CODE_BITS),
                               rowint.quantize_rowint(w[:, perm], rowint.W_CODE_BITS))
    assert one.tobytes() == two.tobytes()
    t = x[0] * w[0]
    assert np.cumsum(t, dtype=np.float32)[-1] != np.cumsum(t[perm], dtype=np.float32)[-1]


def test_weight_layout_is_the_mma_a_fragments_in_lane_order():
    rng = np.random.default_rng(4)
    codes = rng.integers(-2 ** 13, 2 ** 13 + 1, size=(32, 64)).astype(np.float64)
    p = rowint.pack_w(np, codes)
    assert p.shape == (2, 2, 2, 512) and p.dtype == np.uint8
    c = codes.astype(np.int32)
    for s, sl in enumerate((c & 127, c >> 7)):
        assert sl.min() >= -64 and sl.max() <= 127
        for rt in range(2):
            for kk in range(2):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for j in range(4):   # a0 .. a3: rows g, g + 8; elements 4t .., then 16 + 4t ..
                        for i in range(4):
                            row, col = rt * 16 + g + 8 * (j & 1), kk * 32 + 4 * t + 16 * (j >> 1) + i
                            assert p[rt, kk, s, lane * 16 + j * 4 + i] == sl[row, col] & 0xFF
    assert np.array_equal((c >> 7) * 128 + (c & 127), c)
    with pytest.raises(ValueError, match="N % 16"):
        rowint.pack_w(np, codes[:8])


def test_input_layout_is_the_mma_b_fragments_in_lane_order():
    rng = np.random.default_rng(5)
    codes = rng.integers(-2 ** 20, 2 ** 20 + 1, size=(11, 64)).astype(np.float64)
    p = rowint.pack_x(codes)
    assert p.shape == (2, 2, 3, 256) and p.dtype == np.uint8
    c = codes.astype(np.int32)
    for s, sl in enumerate((c & 127, (c >> 7) & 127, c >> 14)):
        for tt in range(2):
            for kk in range(2):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for h in range(2):   # b0, b1: token g, elements 4t .., then 16 + 4t ..
                        for i in range(4):
                            tok, col = tt * 8 + g, kk * 32 + 16 * h + 4 * t + i
                            want = sl[tok, col] & 0xFF if tok < 11 else 0
                            assert p[tt, kk, s, lane * 8 + h * 4 + i] == want
    assert np.array_equal((c >> 14) * 2 ** 14 + ((c >> 7) & 127) * 128 + (c & 127), c)
