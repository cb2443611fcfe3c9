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

from .fmath import exp64, ln64, sincos64


def rope_table(head_dim: int, n_pos: int, base: float, freq_scale: float = 1.0,
               freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(cos, sin)``, each fp32 ``[n_pos, head_dim // 2]`` (radians in, unitless out)."""
    half = head_dim // 2
    expo = -(2.0 * np.arange(half, dtype=np.float64)) / float(head_dim)
    inv_freq = exp64(ln64(float(base)) * expo)
    ff = np.ones(half) if freq_factors is None else np.asarray(freq_factors, np.float64)
    pos = np.arange(n_pos, dtype=np.float64)[:, None]
    theta = ((pos * inv_freq[None, :]) * float(freq_scale)) / ff[None, :]
    s, c = sincos64(theta)
    return c.astype(np.float32), s.astype(np.float32)
