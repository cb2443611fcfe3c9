"""RoPE cos/sin table, built on the host in float64 with the project's own
math (node/fmath.py) and rounded once to fp32. Both engines read these exact
bytes, so no device ever evaluates sin or cos.

Formula (docs/determinism.md, "RoPE"), for pair ``i`` of ``hd/2`` and position ``p``:
``inv_freq[i] = exp64(ln64(base) * (-(2*i) / hd))``;
``theta = ((p * inv_freq[i]) * freq_scale) / freq_factor[i]``;
``cos, sin = fp32(sincos64(theta))``. ``freq_factor`` comes from the GGUF
tensor ``rope_freqs.weight`` when present (Llama 3.1), else 1.
"""

from __future__ import annotations

import numpy as np

from .errors import ModelError
from .fmath import exp64, ln64, sincos64


def rope_table(head_dim: int, n_pos: int, base: float, freq_scale: float = 1.0,
               freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(cos, sin)``, each fp32 ``[n_pos, head_dim // 2]`` (radians in, unitless out).

    ``base`` > 1. Raises :class:`ModelError` when a frequency factor is not a
    positive finite number or an angle would reach 2**28 rad, the range of
    :func:`node.fmath.sincos64` (e.g. a tiny ``llama.rope.scaling.factor``).
    """
    half = head_dim // 2
    expo = -(2.0 * np.arange(half, dtype=np.float64)) / float(head_dim)
    inv_freq = exp64(ln64(float(base)) * expo)       # in (0, 1] for base > 1
    ff = np.ones(half) if freq_factors is None else np.asarray(freq_factors, np.float64)
    if not np.all(np.isfinite(ff) & (ff > 0)):
        raise ModelError("rope_freqs.weight holds a frequency factor that is not a positive finite number")
    top = (n_pos - 1) * float(freq_scale) / float(ff.min())   # the largest angle: inv_freq[0] = 1
    if not top < 2.0 ** 28:
        raise ModelError(f"RoPE angles would reach {top:.3g} rad over {n_pos} positions (limit 2**28): "
                         "check llama.rope.scaling.factor and rope_freqs.weight")
    pos = np.arange(n_pos, dtype=np.float64)[:, None]
    theta = ((pos * inv_freq[None, :]) * float(freq_scale)) / ff[None, :]
    s, c = sincos64(theta)
    return c.astype(np.float32), s.astype(np.float32)
