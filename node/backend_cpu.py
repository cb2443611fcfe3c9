"""CPU backend: runs the forward pass with the numpy twins in node/reference.py.

Holds the weights decoded for :func:`node.reference.matmul_q` /
:func:`node.reference.matmul_f` and an fp32 KV cache per sequence
(``[n_layer, Hkv, capacity, hd]`` for K and for V).
"""

from __future__ import annotations

import numpy as np

from . import reference as ref
from .gguf_model import FLOAT_TYPES, Model, decode_blocks, dequantize_rows, float_values

F32 = np.float32


class CpuBackend:
    name = "cpu"
    xp = np

    def __init__(self, model: Model):
        self.model = model
        self.hp = model.hparams
        self._weights: dict[str, object] = {}
        self._kv: dict[int, list[np.ndarray]] = {}
        self.kv_heads = self._kv_heads()

    def _kv_heads(self) -> int:
        """KV heads the KV cache holds: all of the model's (a tensor-parallel rank: its own)."""
        return self.hp.n_head_kv

    # ---- weights -----------------------------------------------------------
    def _weight(self, name: str):
        w = self._weights.get(name)
        if w is None:
            t = self.model.tensors[name]
            if t.qtype in FLOAT_TYPES:
                w = float_values(t)
            else:
                w = ref.RefQuantWeight(*decode_blocks(t.qtype, t.raw))
            self._weights[name] = w
        return w

    def vector(self, name: str) -> np.ndarray:
        """fp32 ``[K]`` values of a 1-D float tensor (norm weights, RoPE factors), decoded once."""
        v = self._weights.get(name)
        if v is None:
            v = self._weights[name] = float_values(self.model.tensors[name])[0]
        return v

    # ---- ops ---------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return dequantize_rows(self.model.tensors["token_embd.weight"], tokens)

    def rms_norm(self, x, name, feeds=()):
        """RMSNorm of fp32 ``[M, K]``; ``feeds`` (the products reading the result) only matters on the GPU."""
        return ref.rms_norm(x, self.vector(name), self.hp.rms_eps)

    def linears(self, x, names):
        """``[x @ W.T for W in names]``: x fp32 ``[M, K]``, each result fp32 ``[M, N_i]``.

        x is quantized once (``quantize_q8``) and shared by every quantized
        weight in ``names`` (docs/determinism.md section 5).
        """
        xq, out = None, []
        for name in names:
            w = self._weight(name)
            if isinstance(w, np.ndarray):
                out.append(ref.matmul_f(x, w))
            else:
                xq = ref.quantize_q8(x) if xq is None else xq
                out.append(ref.matmul_q(xq, w))
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
