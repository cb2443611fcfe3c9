"""Token selection: greedy argmax or seeded sampling with a counter-based PRNG.

The random draw for the token at absolute sequence position ``pos`` is
Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3",
SC 2011) with key ``(seed mod 2**32, seed >> 32)`` and counter
``(pos, 0, 0, 0)``. It depends on nothing else: not the batch slot, not the
call order. docs/determinism.md, "Sampling", specifies every step below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import NumericFault, RequestError
from .fmath import exp32

F32 = np.float32
_M0, _M1 = 0xD2511F53, 0xCD9E8D57      # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85      # Weyl key increments
_MASK = 0xFFFFFFFF


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10) -> tuple[int, ...]:
    """Philox4x32-``rounds`` block function; returns four uint32 words."""
    c0, c1, c2, c3 = (int(v) & _MASK for v in counter)
    k0, k1 = (int(v) & _MASK for v in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & _MASK, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK)
    return c0, c1, c2, c3


def uniform(seed: int, pos: int) -> F32:
    """Uniform draw in the open interval (0, 1) for sequence position ``pos``.

    ``u = (2 * (w0 >> 9) + 1) * 2**-24`` where ``w0`` is Philox's first output
    word: an odd multiple of 2**-24, so ``2**-24 <= u <= 1 - 2**-24`` and both
    factors are exact in fp32.
    """
    w0 = philox4x32((pos, 0, 0, 0), (seed & _MASK, (seed >> 32) & _MASK))[0]
    return F32(2 * (w0 >> 9) + 1) * F32(2.0 ** -24)


MIN_TEMPERATURE = 1e-6   # below this, logits / T can overflow fp32


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0          # 0 = no limit
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        """Raise :class:`RequestError` for values outside their documented ranges:
        temperature +0.0 or in [MIN_TEMPERATURE, 100] (-0.0 is refused: it would be
        attested as another request than 0), top_p in (0, 1], top_k in [0, 2**31),
        seed in [0, 2**64)."""
        t = self.temperature
        if t == 0.0 and math.copysign(1.0, t) < 0:
            raise RequestError("temperature -0.0 is refused: write 0 (a signed zero would be attested as another "
                               "request than 0)", "temperature")
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= 100.0):
            raise RequestError(f"temperature must be 0 or in [{MIN_TEMPERATURE}, 100], got {t}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.top_k < 2 ** 31:
            raise RequestError(f"top_k must be in [0, 2**31), got {self.top_k}", "top_k")
        if not 0 <= self.seed < 2 ** 64:
            raise RequestError(f"seed must be in [0, 2**64), got {self.seed}", "seed")


def sample_keys(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Sort keys of the candidates for fp32 logits ``[n_vocab]``; uint64 ``[n_vocab]``.

    ``z = logits / T`` in fp32. Key of id ``i``: high word the complement of
    the order-preserving bits of ``z_i + 0`` (``+ 0`` makes -0 equal +0), low
    word ``i``; so ascending keys order candidates by (z descending, id
    ascending), and no two keys are equal. Twin of cuda/sampler.cu sample_keys.
    Raises :class:`NumericFault` when some ``z`` is not finite.
    """
    with np.errstate(over="ignore"):
        z = logits.astype(F32) / F32(temperature)
    if not np.isfinite(z).all():
        raise NumericFault(f"logits / temperature {temperature} overflow fp32")
    b = (z + F32(0.0)).view(np.uint32)
    asc = np.where(b >> np.uint32(31), ~b, b | np.uint32(0x80000000))
    return ((~asc).astype(np.uint64) << np.uint64(32)) | np.arange(z.size, dtype=np.uint64)


def sample_sorted(logits: np.ndarray, keys: np.ndarray, params: SamplingParams, pos: int) -> int:
    """The seeded draw over candidates in ascending key order (``keys``: the sorted
    :func:`sample_keys`). The first ``top_k`` (0: all) are kept;
    ``e = exp32(z - z_first)``; ``c`` = sequential fp32 prefix sums of ``e``;
    keep the shortest prefix with ``c_j >= top_p * c_last``; draw ``u`` for
    ``pos``; return the id of the first kept candidate with ``c_j > u * c_J``
    (``c_J`` the kept total; the last kept one if none).
    Twin of cuda/sampler.cu sample_sorted.
    """
    ids = (keys & np.uint64(_MASK)).astype(np.int64)
    n = params.top_k if 0 < params.top_k < ids.size else ids.size
    ids = ids[:n]
    zs = logits[ids].astype(F32) / F32(params.temperature)
    with np.errstate(over="ignore"):   # z spanning more than FLT_MAX: -inf, and exp32 gives 0 (as on the GPU)
        e = exp32(zs - zs[0])
    c = np.add.accumulate(e, dtype=F32)
    keep = int(np.searchsorted(c >= F32(params.top_p) * c[-1], True)) + 1
    target = uniform(params.seed, pos) * c[keep - 1]
    j = int(np.argmax(c[:keep] > target)) if (c[:keep] > target).any() else keep - 1
    return int(ids[j])


def sample(logits: np.ndarray, params: SamplingParams, pos: int) -> int:
    """Pick the next token id from fp32 logits ``[n_vocab]``.

    Greedy: the lowest id among the maxima. Otherwise
    :func:`sample_sorted` over the sorted :func:`sample_keys`. Raises
    :class:`NumericFault` when ``logits / temperature`` overflows fp32.
    """
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    keys = sample_keys(logits, params.temperature)
    if 0 < params.top_k < keys.size:   # the top_k smallest keys, sorted: the same first top_k (keys are unique)
        return sample_sorted(logits, np.sort(np.partition(keys, params.top_k - 1)[:params.top_k]), params, pos)
    return sample_sorted(logits, np.sort(keys), params, pos)


def sample_rows(logits, picks) -> list[int]:
    """Host draws for rows of one step: ``picks`` = ``(row, SamplingParams, position)``
    over ``logits`` (fp32 ``[n_vocab]`` rows, indexed by row). Raises
    :class:`NumericFault` when ``logits / temperature`` of a row overflows fp32."""
    return [sample(logits[r], p, pos) for r, p, pos in picks]
