"""Tensor parallelism: how T ranks shard a model, and the numpy engine sharded that way.

Megatron-style sharding (Shoeybi et al. 2019, arXiv:1909.08053) under the
determinism contract (docs/determinism.md section 12):

- the K dimension of a row-parallel product (attention output, FFN down) is
  split by **contract lanes**: rank ``r`` of ``T`` owns lanes
  ``r*32/T .. (r+1)*32/T - 1`` of ``warp_sum``, i.e. the terms (elements for
  float weights, 32-element blocks for quantized ones) ``r*(32/T)*g ..`` with
  ``g`` terms per lane. Its partial is a whole subtree of the contract tree,
  and the T partials, gathered, combine as the tree's top levels. No
  all-reduce: its order would follow NCCL's choice of algorithm.
- Q/K/V and gate/up are column-parallel: a rank computes the rows its
  row-parallel shard needs (its query heads, widened to whole KV-head groups,
  and their KV heads; its FFN features), full K, so each row is the TP-1 row.
  A rank process (node/tp_runtime.py, node/tp_gpu.py) keeps them local: it
  attends over its own heads with a KV cache of its own KV heads, gates its
  own features, and feeds its row-parallel shard from them, so only the
  row-parallel partials and the logits are gathered.
- the LM head is split by vocabulary; RMSNorm, RoPE and the residual stream
  are replicated.

Shards can be uneven (SmolLM2's 9 heads over 4 ranks give 4, 4, 1, 0) but
are never inside a head: :class:`ShardPlan` raises :class:`ModelError` when a
shard boundary would cut one.
"""

from __future__ import annotations

import numpy as np

from . import reference as ref
from .backend_cpu import CpuBackend
from .errors import ModelError
from .gguf_model import FLOAT_TYPES, Model

TP_DEGREES = (1, 2, 4, 8)
ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight")


def check_degree(tp) -> int:
    """Return ``tp`` if it is a tensor-parallel degree of :data:`TP_DEGREES` (an
    ``int``; ``True`` or ``2.0`` are refused); raise :class:`ModelError` otherwise."""
    if type(tp) is not int or tp not in TP_DEGREES:
        raise ModelError(f"tensor-parallel degree must be one of {TP_DEGREES}, got {tp!r}")
    return tp


def k_shards(k: int, quantized: bool, tp: int) -> list[tuple[int, int]]:
    """Element ranges ``[a, b)`` of K owned by each of ``tp`` ranks (contract lanes).

    Terms are elements (float weights) or 32-element blocks (quantized);
    ``g = max(1, ceil(terms / 32))`` terms per lane; rank ``r`` owns lanes
    ``r*32/tp .. (r+1)*32/tp - 1``. Ranges can be empty.
    """
    unit = ref.QK if quantized else 1
    terms = k // unit
    g = ref.lane_terms(terms)
    per = (ref.WARP // tp) * g
    return [(min(terms, r * per) * unit, min(terms, (r + 1) * per) * unit) for r in range(tp)]


class ShardPlan:
    """Which rows and K ranges each of ``tp`` ranks owns for a model.

    ``heads[layer][r]`` (query heads ``[h0, h1)`` whose attention outputs are
    rank ``r``'s K shard of the attention output), ``ffn[layer][r]`` (FFN
    features ``[a, b)``), ``vocab[r]`` (LM-head rows ``[a, b)``).
    ``attn_heads[r]``: the query heads ``[H0, H1)`` rank ``r`` attends over in
    every layer, the union of its ``heads`` over the layers widened to whole
    KV-head groups (GQA), so its KV cache holds KV heads ``[H0/G, H1/G)``
    (``G = n_head / n_head_kv``) and each of its query heads reads its own.
    Raises :class:`ModelError` for a degree outside 1, 2, 4, 8 or a shard
    boundary inside a head.
    """

    def __init__(self, model: Model, tp: int):
        check_degree(tp)
        hp = model.hparams
        self.model, self.hp, self.tp = model, hp, tp
        self.heads, self.ffn = {}, {}
        for layer in range(hp.n_layer):
            o = model.tensors[f"blk.{layer}.attn_output.weight"]
            spans = k_shards(o.cols, o.qtype not in FLOAT_TYPES, tp)
            if any(a % hp.head_dim or b % hp.head_dim for a, b in spans):
                raise ModelError(f"TP {tp} would split a head of layer {layer}: K shards {spans}, "
                                 f"head_dim {hp.head_dim}")
            self.heads[layer] = [(a // hp.head_dim, b // hp.head_dim) for a, b in spans]
            d = model.tensors[f"blk.{layer}.ffn_down.weight"]
            self.ffn[layer] = k_shards(d.cols, d.qtype not in FLOAT_TYPES, tp)
        per = -(-hp.n_vocab // tp)
        self.vocab = [(min(hp.n_vocab, r * per), min(hp.n_vocab, (r + 1) * per)) for r in range(tp)]
        grp = hp.n_head // hp.n_head_kv
        self.attn_heads = []
        for r in range(tp):
            own = [h for h in (self.heads[layer][r] for layer in range(hp.n_layer)) if h[1] > h[0]]
            lo, hi = (min(a for a, _ in own), max(b for _, b in own)) if own else (0, 0)
            self.attn_heads.append((lo // grp * grp, -(-hi // grp) * grp))

    def kv_heads(self, rank: int) -> int:
        """KV heads in rank ``rank``'s KV cache (those of its ``attn_heads``)."""
        h0, h1 = self.attn_heads[rank]
        return (h1 - h0) // (self.hp.n_head // self.hp.n_head_kv)

    def attention_columns(self, layer: int, rank: int) -> tuple[int, int]:
        """Columns ``[a, b)`` of rank ``rank``'s attention output (its ``attn_heads``, each
        ``head_dim`` wide) that are its K shard of ``layer``'s attention output."""
        (h0, h1), (a0, _) = self.heads[layer][rank], self.attn_heads[rank]
        hd = self.hp.head_dim
        return ((h0 - a0) * hd, (h1 - a0) * hd) if h1 > h0 else (0, 0)

    def gathered(self, name: str) -> bool:
        """Whether rank processes all-gather product ``name``: a row-parallel product
        (its partials) or the LM head (the logits); column-parallel pieces stay local."""
        return name.endswith(ROW_PARALLEL) or name == self.model.output.name

    def shard_input(self, xp, h, name: str, rank: int):
        """Rank ``rank``'s activations ``h`` fp32 ``[M, b - a]`` for row-parallel ``name``
        (its K shard) placed at their columns of a zero fp32 ``[M, K]`` array, the
        input its shard of ``name`` reads (the other columns are never read).
        ``xp``: numpy or cupy."""
        a, b = self.spans(name)[rank]
        full = xp.zeros((h.shape[0], self.model.tensors[name].cols), xp.float32)
        full[:, a:b] = h
        return full

    def spans(self, name: str) -> list[tuple[int, int]]:
        """Per rank: the K range ``[a, b)`` (elements) of row-parallel matrix
        ``name``, or the output rows ``[a, b)`` of a column-parallel one."""
        t = self.model.tensors[name]
        if name.endswith(ROW_PARALLEL):
            return k_shards(t.cols, t.qtype not in FLOAT_TYPES, self.tp)
        if name == self.model.output.name:
            return self.vocab
        layer, kind = int(name.split(".")[1]), name.split(".")[2]
        return self.column_rows(layer, kind.split("_")[-1], self.hp)

    def column_rows(self, layer: int, kind: str, hp) -> list[tuple[int, int]]:
        """Rows ``[a, b)`` of the column-parallel matrix ``kind`` (q, k, v, gate, up) each
        rank computes: its ``attn_heads`` (q) and their KV heads (k, v), or its FFN features."""
        if kind == "q":
            return [(h0 * hp.head_dim, h1 * hp.head_dim) for h0, h1 in self.attn_heads]
        if kind in ("k", "v"):
            grp = hp.n_head // hp.n_head_kv
            return [(h0 // grp * hp.head_dim, h1 // grp * hp.head_dim) for h0, h1 in self.attn_heads]
        return self.ffn[layer]


def _rows(w, a: int, b: int):
    """Rows ``[a, b)`` of a CPU-backend weight (fp32 array or RefQuantWeight)."""
    return w[a:b] if isinstance(w, np.ndarray) else w.part(rows=slice(a, b))


def _k_cols(w, a: int, b: int):
    """K range ``[a, b)`` (elements) of a CPU-backend weight."""
    return w[:, a:b] if isinstance(w, np.ndarray) else w.part(blocks=slice(a // ref.QK, b // ref.QK))


class TpCpuBackend(CpuBackend):
    """The numpy engine computed as ``tp`` ranks would compute it, one rank after another.

    Every product is evaluated per rank on that rank's shard only
    (:meth:`piece`); the pieces are then gathered and assembled
    (:meth:`assemble`): column-parallel pieces are concatenated, row-parallel
    partials combine as ``subtree_sum(partials, 1, tp)``. Attention is per
    (token, head), so the heads of all ranks are evaluated in one call.
    :class:`node.tp_runtime.RankBackend` computes one rank's pieces in its own
    process, keeps its column-parallel pieces (head-local attention) and
    gathers the others' row-parallel partials and logits from the other
    processes.
    """

    def __init__(self, model: Model, tp: int):
        self.plan, self.tp = ShardPlan(model, tp), tp     # before the base class sizes the KV cache
        super().__init__(model)

    def linears(self, x, names):
        return [self.assemble(name, [self.piece(x, name, r) for r in range(self.tp)]) for name in names]

    def _shard(self, name, r):
        """Rank ``r``'s part of weight ``name`` (a view of the whole decoded matrix)."""
        a, b = self.plan.spans(name)[r]
        w = self._weight(name)
        return _k_cols(w, a, b) if name.endswith(ROW_PARALLEL) else _rows(w, a, b)

    def piece(self, x, name, r):
        """Rank ``r``'s share of ``x @ W.T``: fp32 ``[M, N]`` partial over its K
        range (row-parallel ``name``), or fp32 ``[M, b - a]`` of its output rows."""
        t = self.model.tensors[name]
        quant = t.qtype not in FLOAT_TYPES
        a, b = self.plan.spans(name)[r]
        if name.endswith(ROW_PARALLEL):
            if a == b:                                                      # lanes with no terms hold +0
                return np.zeros((x.shape[0], t.rows), np.float32)
            g = ref.lane_terms(x.shape[1] // (ref.QK if quant else 1))
            xs, ws = x[:, a:b], self._shard(name, r)
            if quant:
                return ref.matmul_q(ref.quantize_q8(xs), ws, g, ref.WARP // self.tp)
            return ref.matmul_f(xs, ws, g, ref.WARP // self.tp)
        if b == a:
            return np.zeros((x.shape[0], 0), np.float32)
        ws = self._shard(name, r)
        return ref.matmul_q(ref.quantize_q8(x), ws) if quant else ref.matmul_f(x, ws)

    def assemble(self, name, pieces):
        """The full product from every rank's :meth:`piece`, in rank order."""
        if name.endswith(ROW_PARALLEL):
            return ref.tp_combine(np.stack(pieces))                         # the tree's top levels
        out = np.zeros((pieces[0].shape[0], self.model.tensors[name].rows), np.float32)
        for (a, b), p in zip(self.plan.spans(name), pieces):
            out[:, a:b] = p
        return out
