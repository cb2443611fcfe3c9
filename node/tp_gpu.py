"""A tensor-parallel rank on its own GPU: its shard of every matrix, the others' pieces by NCCL all-gather.

The GPU twin of :class:`node.tp_runtime.RankBackend` (docs/determinism.md
section 12). Rank ``r`` of ``T`` runs in its own process on GPU ``r`` and
keeps only its shard of each matrix (:class:`node.tp.ShardPlan`): the rows of
a column-parallel matrix (Q/K/V, gate/up, LM head) with the full K, or the
contract lanes ``r*32/T ..`` of a row-parallel one (attention output, FFN
down), which ``matmul_q`` / ``matmul_f`` reduce over the lowest
``log2(32/T)`` butterfly levels. Each product's pieces are all-gathered with
NCCL, which only moves bytes (``ncclAllGather``; an all-reduce would add in
an order NCCL picks from the message size and topology), and assembled on
every rank (:func:`pack_pieces`, :func:`unpack_pieces`): column pieces at
their rows, row-parallel partials by the ``tp_combine`` kernel (the tree's
top levels). Column-parallel products stay on their rank: attention runs over
the rank's ``attn_heads`` with KV cache pages of its own KV heads, the SiLU
gate over its FFN features, and its row-parallel shard reads those
activations (:class:`node.tp.ShardPlan`); so only the row-parallel partials
and the logits are gathered. RMSNorm, RoPE and the residual stream run on
every rank alike, so every rank holds the same residual stream and its
logits are the bytes of ``T = 1``.

Decode steps replay CUDA graphs as on one GPU; NCCL's all-gathers are
captured in them (every rank captures and replays the same steps in the
same order, as NCCL requires).
"""

from __future__ import annotations

import os

from .backend_cuda import ESIZE, SUPER_BLOCKS, Q8, CudaBackend, GpuError, LaneMajor, Mat, _cupy
from .gguf_model import FLOAT_TYPES, Model
from .reference import WARP
from .tp import ROW_PARALLEL, ShardPlan


def nccl_unique_id():
    """A new NCCL unique id (made by the parent, passed to every rank). Raises :class:`GpuError`."""
    _cupy()
    try:
        from cupy.cuda import nccl
        return nccl.get_unique_id()
    except Exception as e:  # noqa: BLE001 - CuPy without NCCL, or NCCL failing to start
        raise GpuError(f"NCCL is not available to CuPy: {e}") from None


def shard_mat(backend: CudaBackend, plan: ShardPlan, rank: int, name: str, t) -> Mat | None:
    """Rank ``rank``'s shard of matrix ``name`` (tensor ``t``) uploaded by
    ``backend`` for the matmul kernels; ``None`` when the shard is empty.

    Column-parallel: rows ``plan.spans(name)[rank]``, full K. Row-parallel:
    its contract lanes of K; float elements are laid out lane-major over those
    lanes, quantized rows keep the whole super-blocks around the shard's blocks.
    """
    a, b = plan.spans(name)[rank]
    if a == b:
        return None
    if not name.endswith(ROW_PARALLEL):
        return backend._upload(t, t.raw[a:b], b - a)
    lanes = WARP // plan.tp
    if t.qtype in FLOAT_TYPES:
        es = ESIZE[t.qtype]
        return backend._upload(t, t.raw[:, a * es:b * es], t.rows, lanes, rank * lanes)
    per = SUPER_BLOCKS.get(t.qtype, 1)
    b0, b1 = a // 32, b // 32
    s0, s1 = b0 // per, -(-b1 // per)
    unit = t.raw.shape[1] // (t.cols // 32 // per)          # bytes per super-block (per block when per = 1)
    return backend._upload(t, t.raw[:, s0 * unit:s1 * unit], t.rows, lanes, rank * lanes, b0 - s0 * per, b1 - b0)


def _widths(plan: ShardPlan, name: str) -> list[int]:
    """Columns of each rank's piece of ``name``: its rows, or all N for a row-parallel partial."""
    if name.endswith(ROW_PARALLEL):
        return [plan.model.tensors[name].rows] * plan.tp
    return [b - a for a, b in plan.spans(name)]


def pack_pieces(xp, plan: ShardPlan, names, m: int, rank: int, own: dict):
    """The send buffer of rank ``rank``: its pieces (fp32 ``[m, width]``, from
    ``own`` by name; absent ones are empty shards, +0) flattened in ``names``
    order, padded with +0 to the longest rank's length. ``xp``: numpy or cupy."""
    widths = [_widths(plan, n) for n in names]
    count = max(sum(m * w[r] for w in widths) for r in range(plan.tp))
    send = xp.zeros(count, xp.float32)
    off = 0
    for name, w in zip(names, widths):
        n = m * w[rank]
        if name in own:
            send[off:off + n] = own[name].reshape(-1)
        off += n
    return send


def unpack_pieces(xp, plan: ShardPlan, names, m: int, recv, combine) -> list:
    """The products from the gathered send buffers ``recv`` fp32 ``[tp, count]``:
    row-parallel partials added by ``combine`` (``tp_combine``, the tree's top
    levels); column pieces (the LM head's vocabulary shards) written at their
    rows, as ``TpCpuBackend.assemble`` does."""
    if len(names) == 1 and names[0].endswith(ROW_PARALLEL):
        return [combine(recv.reshape(plan.tp, m, -1))]
    out, offs = [], [0] * plan.tp
    for name in names:
        y = xp.empty((m, plan.model.tensors[name].rows), xp.float32)
        for r, (a, b) in enumerate(plan.spans(name)):
            n = m * (b - a)
            if n:
                y[:, a:b] = recv[r, offs[r]:offs[r] + n].reshape(m, b - a)
            offs[r] += n
        out.append(y)
    return out


class CudaRankBackend(CudaBackend):
    """:class:`node.backend_cuda.CudaBackend` of tensor-parallel rank ``rank`` of ``tp`` on GPU ``rank``.

    ``nccl_id`` is :func:`nccl_unique_id`'s value, the same for every rank.
    Other options as for :class:`CudaBackend`.
    Raises :class:`GpuError` when fewer than ``tp`` GPUs are visible or NCCL
    cannot start, :class:`ModelError` for a degree the model cannot be split by.
    """

    def __init__(self, model: Model, tp: int, rank: int, nccl_id, **opts):
        cp = _cupy()
        if cp.cuda.runtime.getDeviceCount() < tp:
            raise GpuError(f"tensor-parallel degree {tp} needs {tp} GPUs; {cp.cuda.runtime.getDeviceCount()} visible")
        cp.cuda.Device(rank).use()
        self.plan, self.tp, self.rank = ShardPlan(model, tp), tp, rank
        # NVLink SHARP (NVLS) only accelerates reductions in the switch, which we
        # never ask NCCL for; it stays off (multicast objects are a shared resource).
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        from cupy.cuda import nccl
        self._nccl = nccl
        try:
            self.comm = nccl.NcclCommunicator(tp, nccl_id, rank)
        except Exception as e:  # noqa: BLE001
            raise GpuError(f"tensor-parallel rank {rank}: NCCL could not start: {e}") from None
        super().__init__(model, **opts)

    def _load_step(self, sms: int, times: int = 0) -> None:
        """A rank runs the per-op kernels (its products gather partials between them)."""
        return None

    def _kv_heads(self) -> int:
        return self.plan.kv_heads(self.rank)

    def _all_gather(self, send):
        """fp32 ``[count]`` from every rank -> fp32 ``[tp, count]`` in rank order (bytes only)."""
        recv = self.cp.empty((self.tp, send.size), self.cp.float32)
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._nccl.NCCL_FLOAT32, self.stream.ptr)
        return recv

    def _agree_kv_pages(self, n: int) -> int:
        with self.stream:
            pages = self._all_gather(self.cp.asarray([n], self.cp.float32))     # exact: n <= 2048
            return int(pages.min())

    def _mat(self, name: str, t) -> Mat | None:
        return shard_mat(self, self.plan, self.rank, name, t)

    def linears(self, x, names):
        """As :meth:`CudaBackend.linears`, each product computed as this rank's piece:
        column-parallel pieces stay local (fp32 ``[M, b - a]``, its rows); a row-parallel
        product (alone) or the LM head is all-gathered and assembled (:func:`pack_pieces`,
        :func:`unpack_pieces`)."""
        cp = self.cp
        m = (x.data if isinstance(x, LaneMajor) else x.q if isinstance(x, Q8) else x).shape[0]
        if any(n.endswith(ROW_PARALLEL) for n in names) and len(names) != 1:
            raise ValueError(f"a row-parallel product is computed alone, got {names}")
        live = [n for n in names if self._mats[n] is not None]
        own = dict(zip(live, super().linears(x, live))) if live else {}
        if not self.plan.gathered(names[0]):
            return [own[n] if n in own else cp.zeros((m, 0), cp.float32) for n in names]
        recv = self._all_gather(pack_pieces(cp, self.plan, names, m, self.rank, own))
        return unpack_pieces(cp, self.plan, names, m, recv, self.launch_tp_combine)

    def attend(self, layer, q, k, v, cos, sin, feeds=()):
        """Attention over this rank's ``attn_heads`` (q fp32 ``[M, H_r, hd]``, k and v
        ``[M, H_r / G, hd]``, stored in its own KV pages); returns the columns of its
        K shard of the attention output, fp32 ``[M, b - a]``
        (:meth:`node.tp.ShardPlan.attention_columns`)."""
        cp = self.cp
        a, b = self.plan.attention_columns(layer, self.rank)
        if q.shape[1] == 0:
            return cp.zeros((q.shape[0], 0), cp.float32)
        return cp.ascontiguousarray(super().attend(layer, q, k, v, cos, sin)[:, a:b])

    def silu_gate(self, g, u, feeds=()):
        """SiLU gate of this rank's FFN features, fp32 ``[M, b - a]`` (none: ``[M, 0]``)."""
        return super().silu_gate(g, u) if g.shape[-1] else self.cp.zeros(g.shape, self.cp.float32)

    def linear_residual(self, x, h, name):
        """``x + h @ W.T`` for row-parallel ``name`` from this rank's activations ``h``
        (fp32 ``[M, b - a]``, its K shard), placed at their columns of a zero ``[M, K]``
        array whose other columns its shard never reads: the gathered product
        (:meth:`linears`), then the residual add (a rank's piece is a partial sum, so
        nothing is fused)."""
        return self.residual_add(x, self.linears(self.plan.shard_input(self.cp, h, name, self.rank), (name,))[0])

    def close(self) -> None:
        """Free the NCCL communicator."""
        if getattr(self, "comm", None) is not None:
            self.comm.destroy()
            self.comm = None

