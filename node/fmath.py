"""The project's own transcendental functions, built from IEEE-754 add, sub,
mul, div and round-to-integral only (docs/determinism.md, "Transcendentals").

``exp32`` is the fp32 exponential used by softmax and SiLU on both engines; its
CUDA twin is ``bx_exp32`` in cuda/common.cuh. ``exp64``, ``ln64`` and
``sincos64`` are float64 routines used on the host to build the RoPE table;
both engines read the same table, so the GPU never evaluates sin or cos.

No libm or CUDA intrinsic is used: results are identical on every IEEE-754
platform. Range reduction is Cody-Waite (Cody & Waite, "Software Manual for the
Elementary Functions", 1980) with fdlibm's split constants.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32

# ---- fp32 exp ------------------------------------------------------------------
EXP32_HI = F32(88.72283935546875)      # above: +inf
EXP32_LO = F32(-104.0)                 # below: +0
LOG2E_F = F32(1.4426950408889634)
LN2_HI_F = F32(0.693359375)            # 0x3f318000: 9 significant bits, n*LN2_HI_F is exact
LN2_LO_F = F32(-2.12194440e-4)         # 0xb95e8083
# Taylor coefficients 1/k!, k = 7..2, rounded to fp32 (Horner order high to low).
EXP32_POLY = tuple(F32(1.0 / f) for f in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0))


def exp32(x: np.ndarray) -> np.ndarray:
    """fp32 ``e**x`` elementwise for fp32 ``x`` of any shape (measured maximum error 1.7 ulp).

    Steps (each one fp32 operation, round to nearest even):
    ``n = rint(x * LOG2E)``; ``r = (x - n*LN2_HI) - n*LN2_LO``;
    ``p = ((((((c7*r + c6)*r + c5)*r + c4)*r + c3)*r + c2)*r + 1)*r + 1``;
    result ``(p * 2**(n>>1)) * 2**(n - (n>>1))``, two exact-or-once-rounded
    power-of-two scalings so subnormal results round once.
    ``x > 88.72283935546875`` gives +inf, ``x < -104`` gives +0, NaN stays NaN.
    """
    x = np.asarray(x, dtype=F32)
    xc = np.clip(np.where(np.isnan(x), F32(0.0), x), EXP32_LO, EXP32_HI)
    n = np.rint(xc * LOG2E_F)
    r = (xc - n * LN2_HI_F) - n * LN2_LO_F
    p = np.full_like(r, EXP32_POLY[0])
    for c in EXP32_POLY[1:]:
        p = p * r + c
    p = p * r + F32(1.0)
    p = p * r + F32(1.0)
    ni = n.astype(np.int32)
    n1 = ni >> 1
    n2 = ni - n1
    s1 = ((n1 + 127) << 23).view(F32)
    s2 = ((n2 + 127) << 23).view(F32)
    with np.errstate(over="ignore"):
        y = (p * s1) * s2
    y = np.where(x > EXP32_HI, F32(np.inf), y)
    y = np.where(x < EXP32_LO, F32(0.0), y)
    return np.where(np.isnan(x), x, y).astype(F32)


# ---- float64 host routines for the RoPE table ---------------------------------
LN2 = 0.6931471805599453
LN2_HI = 6.93147180369123816490e-01     # fdlibm ln2_hi
LN2_LO = 1.90821492927058770002e-10     # fdlibm ln2_lo
PIO2_1 = 1.57079632673412561417e+00     # fdlibm pio2_1 (33 bits)
PIO2_2 = 6.07710050630396597660e-11     # fdlibm pio2_2
PIO2_3 = 2.02226624871116645580e-21     # fdlibm pio2_3
INV_PIO2 = 6.36619772367581382433e-01
SQRT_HALF = 0.7071067811865476


def ln64(x: float) -> float:
    """Natural log of a positive finite float64 ``x``.

    ``x = m * 2**e`` exactly (``m`` in [sqrt(1/2), sqrt(2))), then
    ``ln x = e*LN2 + 2*atanh(s)`` with ``s = (m-1)/(m+1)`` and the atanh series
    summed to ``s**41``. Raises ValueError for ``x <= 0``.
    """
    if not x > 0.0:
        raise ValueError("ln64 needs x > 0")
    m, e = np.frexp(np.float64(x))
    m, e = float(m), int(e)
    if m < SQRT_HALF:
        m, e = m * 2.0, e - 1
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = 0.0
    for k in range(41, 0, -2):  # Horner from the highest odd power down
        acc = acc * s2 + 1.0 / k
    return e * LN2 + 2.0 * (s * acc)


def exp64(x: np.ndarray) -> np.ndarray:
    """float64 ``e**x`` elementwise for float64 ``x`` in [-700, 700].

    ``n = rint(x / LN2)``; ``r = (x - n*LN2_HI) - n*LN2_LO``; Taylor series to
    ``r**16`` in Horner form; result ``p * 2**n`` (exact scaling).
    """
    x = np.asarray(x, dtype=np.float64)
    n = np.rint(x / LN2)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = np.ones_like(r)
    for k in range(16, 0, -1):
        p = p * r / k + 1.0
    return np.ldexp(p, n.astype(np.int64))


def sincos64(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(sin, cos)`` elementwise for float64 ``theta`` with ``|theta| < 2**28``.

    ``k = rint(theta * 2/pi)``; ``r = ((theta - k*PIO2_1) - k*PIO2_2) - k*PIO2_3``;
    Taylor series of sin and cos on ``|r| <= pi/4`` to degree 23 and 22;
    the quadrant ``k mod 4`` selects and negates.
    """
    t = np.asarray(theta, dtype=np.float64)
    k = np.rint(t * INV_PIO2)
    r = ((t - k * PIO2_1) - k * PIO2_2) - k * PIO2_3
    r2 = r * r
    s = np.ones_like(r)
    for j in range(23, 2, -2):        # sin r = r (1 - r^2/(2*3) (1 - r^2/(4*5) (...)))
        s = 1.0 - s * r2 / ((j - 1) * j)
    s = s * r
    c = np.ones_like(r)
    for j in range(22, 1, -2):        # cos r = 1 - r^2/(1*2) (1 - r^2/(3*4) (...))
        c = 1.0 - c * r2 / ((j - 1) * j)
    q = k.astype(np.int64) & 3
    sin = np.select([q == 0, q == 1, q == 2], [s, c, -s], -c)
    cos = np.select([q == 0, q == 1, q == 2], [c, -s, -c], s)
    return sin, cos
