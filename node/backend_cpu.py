"""CPU backend: runs the forward pass with the numpy twins in node/reference.py.

Holds the weights decoded for :func:`node.reference.matmul_q` /
:func:`node.reference.matmul_f` (about 4 bytes per weight) up to a memory
budget, and an fp32 KV cache per sequence (``[n_layer, Hkv, capacity, hd]``
for K and for V). A matrix beyond the budget is decoded again at every use,
in row chunks of :data:`CHUNK_BYTES`; each output row's sum reads only its own
weight row, so the bytes are the same either way and a machine can verify a
model whose decoded weights exceed its memory.
"""

from __future__ import annotations

import os

import numpy as np

from . import reference as ref
from .errors import BitexactError
from .gguf_model import BLOCK_BYTES, FLOAT_TYPES, Model, Tensor, decode_blocks, float_values

F32 = np.float32
CACHE_ENV = "BITEXACT_CPU_WEIGHT_CACHE_MB"
CHUNK_BYTES = 64 << 20      # decoded bytes per row chunk of a matrix the budget leaves out


def weight_cache_bytes() -> int:
    """Bytes of decoded weights the CPU engine keeps between steps:
    ``$BITEXACT_CPU_WEIGHT_CACHE_MB`` MiB when set, else half of the machine's
    physical memory (unlimited where the platform does not report it, or for
    more than 12 digits of MiB). Raises :class:`BitexactError` for a value that
    is not ASCII digits (surrounding whitespace allowed)."""
    v = os.environ.get(CACHE_ENV)
    if v is not None:
        digits = v.strip()
        if not (digits.isascii() and digits.isdigit()):   # not '²' or '٣', which str.isdigit accepts
            raise BitexactError(f"{CACHE_ENV} must be a whole number of MiB (0 or more), got {v!r}")
        digits = digits.lstrip("0") or "0"
        return 1 << 62 if len(digits) > 12 else int(digits) << 20   # int() refuses over 4300 digits
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return 1 << 62


def decoded_bytes(t: Tensor, contract: int = 1) -> int:
    """Bytes of matrix ``t`` decoded for the reference products: fp32 values or
    codes (4 per weight), plus a quantized type's fp32 scale and offset per block;
    under contract 2 a float matrix's int16 codes and int32 exponent per row."""
    if t.qtype in FLOAT_TYPES:
        return (2 * t.cols + 4) * t.rows if contract == 2 else 4 * t.rows * t.cols
    return 4 * t.rows * t.cols + 8 * t.rows * (t.cols // ref.QK)


def decode_rows(t: Tensor, a: int, b: int, k0: int = 0, k1: int | None = None, contract: int = 1):
    """Rows ``[a, b)`` of matrix ``t``, and of them the K range ``[k0, k1)``
    (elements, whole 32-element blocks for a quantized type; default all of K),
    as the reference products take them: fp32 ``[b - a, k1 - k0]`` (float types;
    under ``contract`` 2 the whole rows' :class:`node.reference.RowintWeight`)
    or a :class:`node.reference.RefQuantWeight`. Only the bytes of that range
    are decoded (for a K-quant, the super-blocks holding it), with the values
    decoding the whole matrix gives: each block (each row, for contract 2)
    decodes alone). Raises ValueError for a part of K under contract 2 (a row's
    scale exponent is its whole row's)."""
    k1 = t.cols if k1 is None else k1
    if t.qtype in FLOAT_TYPES:
        es = t.raw.shape[1] // t.cols   # bytes per element
        w = float_values(Tensor(t.name, t.qtype, b - a, k1 - k0, t.raw[a:b, k0 * es:k1 * es]))
        if contract == 2:
            if (k0, k1) != (0, t.cols):   # a row's exponent is its whole row's
                raise ValueError(f"{t.name}: contract 2 decodes whole rows, not K range [{k0}, {k1})")
            codes, s = ref.quantize_rowint(w, ref.W_CODE_BITS)
            return ref.RowintWeight(codes.astype(np.int16), s)
        return w
    bb, be = BLOCK_BYTES[t.qtype]       # bytes and elements of one encoding block
    s0, s1 = k0 // be, -(-k1 // be)
    w = ref.RefQuantWeight(*decode_blocks(t.qtype, t.raw[a:b, s0 * bb:s1 * bb]))
    if (s0 * be, s1 * be) != (k0, k1):   # part of a K-quant super-block: its 32-element blocks
        w = w.part(blocks=slice((k0 - s0 * be) // ref.QK, (k1 - s0 * be) // ref.QK)).copy()
    return w


class CpuBackend:
    name = "cpu"
    xp = np

    def __init__(self, model: Model, weight_cache: int | None = None, contract: int = 1):
        """``weight_cache``: bytes of decoded weights to keep (default
        :func:`weight_cache_bytes`); matrices are kept in the order of first use
        while they fit. ``contract``: the determinism contract's version (1, or
        2: float-weight products in integers, docs/determinism.md section 14)."""
        self.model = model
        self.contract = contract
        self.hp = model.hparams
        self._weights: dict[str, object] = {}
        self._cache_left = weight_cache_bytes() if weight_cache is None else weight_cache
        self._kv: dict[int, list[np.ndarray]] = {}
        self.kv_heads = self._kv_heads()

    def _kv_heads(self) -> int:
        """KV heads the KV cache holds: all of the model's (a tensor-parallel rank: its own)."""
        return self.hp.n_head_kv

    # ---- weights -----------------------------------------------------------
    def _cached(self, name: str):
        """Matrix ``name`` decoded, from the cache or decoded now and kept if the
        budget allows; ``None`` when it does not fit."""
        w = self._weights.get(name)
        if w is None:
            t = self.model.tensors[name]
            if decoded_bytes(t, self.contract) > self._cache_left:
                return None
            w = self._weights[name] = decode_rows(t, 0, t.rows, contract=self.contract)
            self._cache_left -= decoded_bytes(t, self.contract)
        return w

    def _weight(self, name: str):
        """Matrix ``name`` decoded whole (kept if the budget allows)."""
        w = self._cached(name)
        if w is None:
            t = self.model.tensors[name]
            w = decode_rows(t, 0, t.rows, contract=self.contract)
        return w

    def vector(self, name: str) -> np.ndarray:
        """fp32 ``[K]`` values of a 1-D float tensor (norm weights, RoPE factors), decoded once."""
        v = self._weights.get(name)
        if v is None:
            v = self._weights[name] = float_values(self.model.tensors[name])[0]
        return v

    # ---- ops ---------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return ref.embed(self.model.tensors["token_embd.weight"], tokens)

    def rms_norm(self, x, name, feeds=()):
        """RMSNorm of fp32 ``[M, K]``; ``feeds`` (the products reading the result) only matters on the GPU."""
        return ref.rms_norm(x, self.vector(name), self.hp.rms_eps)

    def linears(self, x, names):
        """``[x @ W.T for W in names]``: x fp32 ``[M, K]``, each result fp32 ``[M, N_i]``.

        x is quantized once (``quantize_q8``) and shared by every quantized
        weight in ``names`` (docs/determinism.md section 5); under contract 2
        once more (``quantize_rowint``) for every float weight (section 14).
        """
        xq, xr, out = None, None, []
        for name in names:
            float_weight = self.model.tensors[name].qtype in FLOAT_TYPES
            if float_weight and self.contract == 2:
                xr = ref.quantize_rowint(x, ref.X_CODE_BITS) if xr is None else xr
                out.append(self._product(ref.matmul_rowint, xr, len(x), name))
            elif float_weight:
                out.append(self._product(ref.matmul_f, x, len(x), name))
            else:
                xq = ref.quantize_q8(x) if xq is None else xq
                out.append(self._product(ref.matmul_q, xq, len(x), name))
        return out

    def _product(self, matmul, x, m: int, name: str) -> np.ndarray:
        """``matmul(x, W)`` fp32 ``[m, N]`` for matrix ``name``: the cached weight,
        or, beyond the budget, rows decoded chunk by chunk (the same bytes)."""
        w = self._cached(name)
        if w is not None:
            return matmul(x, w)
        t = self.model.tensors[name]
        step = max(1, CHUNK_BYTES // (decoded_bytes(t, self.contract) // t.rows))
        out = np.empty((m, t.rows), F32)
        for a in range(0, t.rows, step):
            out[:, a:a + step] = matmul(x, decode_rows(t, a, min(t.rows, a + step), contract=self.contract))
        return out

    def silu_gate(self, g, u, feeds=()):
        return ref.silu_gate(g, u)

    def residual_add(self, x, y):
        return ref.residual_add(x, y)

    def linear_residual(self, x, h, name):
        """``x + h @ W.T`` for the one matrix ``name``: the residual stream x fp32 ``[M, N]``
        plus the product (:meth:`linears`, then ``reference.residual_add``)."""
        return self.residual_add(x, self.linears(h, (name,))[0])

    def to_host(self, x) -> np.ndarray:
        return x

    def from_host(self, x):
        return x

    # ---- KV cache ----------------------------------------------------------
    def kv_alloc(self, seq: int) -> None:
        hp = self.hp
        shape = (hp.n_layer, self.kv_heads, 64, hp.head_dim)
        self._kv[seq] = [np.zeros(shape, F32), np.zeros(shape, F32)]

    def kv_free(self, seq: int) -> None:
        self._kv.pop(seq, None)

    def kv_copy_prefix(self, src: int, dst: int, n: int) -> None:
        k, v = self._kv[src]
        self._kv[dst] = [k[:, :, :max(n, 64)].copy(), v[:, :, :max(n, 64)].copy()]

    def run(self, forward, tok, pos, rows) -> np.ndarray:
        """Run the engine's device pass; returns host fp32 logits ``[R, n_vocab]``."""
        return forward(tok, pos, rows)

    def begin_step(self, spans, pos, replay: bool = False) -> None:
        """Make room in each sequence's cache for this step's tokens.

        ``spans``: ``(seq, a, b)``, the step's token rows ``a:b`` belong to
        ``seq``; ``pos`` int ``[M]`` the tokens' positions; ``replay`` says the
        logits rows are the chunks' last tokens (a CUDA graph may run the step;
        unused on the CPU).
        """
        self._spans, self._pos = spans, pos
        for seq, a, b in spans:
            cache = self._kv[seq]
            need = int(pos[b - 1]) + 1
            if cache[0].shape[2] < need:
                cap = max(need, 2 * cache[0].shape[2])
                for i in range(2):
                    grown = np.zeros(cache[i].shape[:2] + (cap,) + cache[i].shape[3:], F32)
                    grown[:, :, :cache[i].shape[2]] = cache[i]
                    cache[i] = grown

    def attend(self, layer, q, k, v, cos, sin, feeds=()):
        """RoPE of q (fp32 ``[M, H, hd]``) and k (fp32 ``[M, Hkv, hd]``) with the step's
        table rows cos, sin (fp32 ``[M, hd/2]``); store k, v at their positions, then
        return attention of q, each token over its own sequence, as fp32 ``[M, H*hd]``."""
        q, k = ref.rope(q, cos, sin), ref.rope(k, cos, sin)
        out = np.empty_like(q)
        for seq, a, b in self._spans:
            kc, vc = self._kv[seq][0][layer], self._kv[seq][1][layer]
            pos = self._pos[a:b]
            kc[:, pos] = k[a:b].transpose(1, 0, 2)
            vc[:, pos] = v[a:b].transpose(1, 0, 2)
            out[a:b] = ref.attention(q[a:b], kc, vc, pos)
        return out.reshape(len(q), -1)
