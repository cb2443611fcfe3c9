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
every rank: column pieces side by side, row-parallel partials by the
``tp_combine`` kernel (the tree's top levels). RMSNorm, RoPE, attention and
the residual stream run on every rank alike, so every rank holds the same
activations and its logits are the bytes of ``T = 1``.

Decode steps replay CUDA graphs as on one GPU; NCCL's all-gathers are
captured in them (every rank captures and replays the same steps in the
same order, as NCCL requires).
"""

from __future__ import annotations

import os

from .backend_cuda import ESIZE, SUPER_BLOCKS, CudaBackend, GpuError, LaneMajor, Mat, _cupy
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
        super().__init__(model, **opts)
        # NVLink SHARP (NVLS) only accelerates reductions in the switch, which we
        # never ask NCCL for; it stays off (multicast objects are a shared resource).
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        from cupy.cuda import nccl
        self._nccl = nccl
        try:
            self.comm = nccl.NcclCommunicator(tp, nccl_id, rank)
        except Exception as e:  # noqa: BLE001
            raise GpuError(f"tensor-parallel rank {rank}: NCCL could not start: {e}") from None

    def _mat(self, name: str, t) -> Mat | None:
        return shard_mat(self, self.plan, self.rank, name, t)

    def _width(self, name: str, r: int) -> int:
        """Columns of rank ``r``'s piece of ``name``: its rows, or all N for a row-parallel partial."""
        if name.endswith(ROW_PARALLEL):
            return self.model.tensors[name].rows
        a, b = self.plan.spans(name)[r]
        return b - a

    def linears(self, x, names):
        """As :meth:`CudaBackend.linears`, each product computed as this rank's piece,
        all-gathered and assembled (module docstring). A row-parallel matrix comes alone."""
        cp = self.cp
        m = (x.data if isinstance(x, LaneMajor) else x).shape[0]
        row_parallel = any(n.endswith(ROW_PARALLEL) for n in names)
        if row_parallel and len(names) != 1:
            raise ValueError(f"a row-parallel product is computed alone, got {names}")
        live = [n for n in names if self._mats[n] is not None]
        own = dict(zip(live, super().linears(x, live))) if live else {}
        pieces = [own[n] if n in own else cp.zeros((m, self._width(n, self.rank)), cp.float32) for n in names]
        sizes = [[m * self._width(n, r) for n in names] for r in range(self.tp)]
        count = max(sum(s) for s in sizes)
        send = cp.zeros(count, cp.float32)
        off = 0
        for p in pieces:
            send[off:off + p.size] = p.reshape(-1)
            off += p.size
        recv = cp.empty((self.tp, count), cp.float32)
        self.comm.allGather(send.data.ptr, recv.data.ptr, count, self._nccl.NCCL_FLOAT32, self.stream.ptr)
        if row_parallel:
            return [self.launch_tp_combine(recv.reshape(self.tp, m, -1))]
        out, offs = [], [0] * self.tp
        for i, name in enumerate(names):
            cols = []
            for r in range(self.tp):
                w = sizes[r][i] // m if m else 0
                if w:
                    cols.append(recv[r, offs[r]:offs[r] + sizes[r][i]].reshape(m, w))
                offs[r] += sizes[r][i]
            out.append(cp.ascontiguousarray(cp.concatenate(cols, axis=1)))
        return out

    def close(self) -> None:
        """Free the NCCL communicator."""
        if getattr(self, "comm", None) is not None:
            self.comm.destroy()
            self.comm = None

