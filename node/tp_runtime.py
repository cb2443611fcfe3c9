"""Tensor-parallel ranks as processes: one process per rank, all-gather over shared memory.

Each rank process loads the model and runs the whole forward pass with a
:class:`RankBackend`: every product computes only that rank's piece (its rows
of a column-parallel matrix, or its K range of a row-parallel one, per
:class:`node.tp.ShardPlan`), all-gathers the other ranks' pieces, and
assembles the full tensor exactly as :class:`node.tp.TpCpuBackend` does
(docs/determinism.md section 12: no reduction happens in the collective; the
row-parallel combine is the contract tree's top levels, computed locally).
Every rank therefore holds the same activations, and rank 0's logits are the
step's logits, byte-identical to ``tp = 1``.

:class:`TpEngine` is the parent's handle: it mirrors :class:`node.engine.Engine`
and forwards each call to every rank. Ranks run on the CPU (numpy, this
module's :class:`RankBackend`) or one per GPU (:class:`node.tp_gpu.CudaRankBackend`:
the same pieces and assembly, with NCCL's all-gather in place of
:class:`ShmAllGather`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing import shared_memory
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import numpy as np

from .backend_cpu import decode_rows
from .engine import Engine, default_n_ctx, draw_rows
from .errors import BitexactError, ModelError, RequestError
from .gguf_model import Model, load_model
from .tp import ROW_PARALLEL, ShardPlan, TpCpuBackend, check_degree

log = logging.getLogger("bitexact.tp")

SLOT_FLOATS = 1 << 20   # fp32 values each rank can publish per round (4 MiB)
POLL_S = 0.05           # how often a rank waiting at a gather looks at the abort flag
HEADER = 8              # bytes before the slots: the abort flag (int64)
OUT_ROWS = 64           # logits rows rank 0 hands back through shared memory (larger results: the pipe)
ERR_GRACE_S = 10.0      # after one rank's request error, how long the others have to report theirs


class GatherAborted(RuntimeError):
    """Another rank failed or died while this one waited at a gather."""


def shm_size(tp: int) -> int:
    return HEADER + tp * (16 + 4 * SLOT_FLOATS)


class ShmAllGather:
    """All-gather of fp32 ``[M, n_r]`` arrays (one M, any n_r) among ``tp`` processes.

    The shared-memory block holds an abort flag, then one slot per rank: a
    2-int64 header (rows, columns) and ``SLOT_FLOATS`` fp32 values. A round:
    each rank writes a chunk of its rows, passes the barrier, copies every
    slot, passes the barrier again (so no slot is overwritten while read).
    Chunks hold ``SLOT_FLOATS // max_cols`` rows, the same number on every rank.

    The barrier holds no lock, so a rank that dies cannot wedge the others:
    rank r has a counting semaphore; arriving, a rank posts once to every
    other rank's semaphore and then takes ``tp - 1`` posts from its own. A
    post for a later barrier implies its sender passed this one, hence that
    everyone arrived, so the counts never mix generations wrongly; semaphores
    also order the slot writes before the reads. While waiting a rank polls the
    abort flag (set by the parent when a rank dies, or by a rank that fails)
    and raises :class:`GatherAborted`.
    """

    def __init__(self, shm_name: str, sems, tp: int, rank: int, max_cols: int):
        self.shm = shared_memory.SharedMemory(name=shm_name)
        self.sems, self.tp, self.rank = sems, tp, rank
        self.ppid = os.getppid()               # a rank is the parent's child: it changes when the parent dies
        self.rows = max(1, SLOT_FLOATS // max_cols)
        slot = 16 + 4 * SLOT_FLOATS
        self.flag = np.ndarray((1,), np.int64, self.shm.buf, 0)
        self.heads = [np.ndarray((2,), np.int64, self.shm.buf, HEADER + r * slot) for r in range(tp)]
        self.data = [np.ndarray((SLOT_FLOATS,), np.float32, self.shm.buf, HEADER + r * slot + 16)
                     for r in range(tp)]

    def abort(self) -> None:
        """Make every rank waiting at a gather (now or later) raise :class:`GatherAborted`."""
        self.flag[0] = 1

    def _barrier(self) -> None:
        if os.getppid() != self.ppid:          # the parent was killed: the step's result has no reader
            raise GatherAborted("the parent process is gone")
        for r in range(self.tp):
            if r != self.rank:
                self.sems[r].release()
        for _ in range(self.tp - 1):
            while not self.sems[self.rank].acquire(timeout=POLL_S):
                if self.flag[0]:
                    raise GatherAborted("another tensor-parallel rank failed during a gather")
                if os.getppid() != self.ppid:
                    raise GatherAborted("the parent process is gone")

    def all_gather(self, a: np.ndarray) -> list[np.ndarray]:
        """Every rank's array, in rank order (this rank's ``a`` among them)."""
        m = a.shape[0]
        parts: list[list[np.ndarray]] = [[] for _ in range(self.tp)]
        for r0 in range(0, m, self.rows):
            chunk = np.ascontiguousarray(a[r0:r0 + self.rows], np.float32)
            self.heads[self.rank][:] = chunk.shape
            self.data[self.rank][:chunk.size] = chunk.reshape(-1)
            self._barrier()
            for r in range(self.tp):
                rows, cols = (int(v) for v in self.heads[r])
                parts[r].append(self.data[r][:rows * cols].reshape(rows, cols).copy())
            self._barrier()
        return [np.concatenate(p) for p in parts]

    def close(self) -> None:
        self.flag = self.heads = self.data = None
        self.shm.close()


class RankBackend(TpCpuBackend):
    """The numpy backend of one rank: its own pieces, the others' by all-gather.

    It decodes only its own shard of each matrix (its rows, or its K range,
    from the file's bytes: :func:`node.backend_cpu.decode_rows`), so a rank's
    weights take about ``1/tp`` of the model's decoded size. The shards count
    against the CPU weight budget (:func:`node.backend_cpu.weight_cache_bytes`),
    split evenly between the ranks: a shard beyond the rank's share is decoded
    again at every use. Column-parallel products
    stay local (:class:`node.tp.ShardPlan`): attention runs over the rank's
    ``attn_heads`` with a KV cache of its own KV heads, the SiLU gate over its
    FFN features, and a row-parallel product reads the rank's own activations
    (:meth:`linear_residual`). Only row-parallel partials and the logits are
    all-gathered.
    """

    def __init__(self, model: Model, tp: int, rank: int, gather: ShmAllGather):
        self.rank = rank
        super().__init__(model, tp)
        self._cache_left //= tp                 # the node's budget, shared by its rank processes
        self.gather = gather
        self._own: dict[str, object] = {}

    def _kv_heads(self) -> int:
        return self.plan.kv_heads(self.rank)

    def _shard(self, name, r):
        """This rank's part of ``name`` (ndarray or RefQuantWeight), decoded alone: kept
        while the budget allows, its bytes counted against it; beyond it, decoded again."""
        w = self._own.get(name)
        if w is None:
            t, (a, b) = self.model.tensors[name], self.plan.spans(name)[r]
            w = decode_rows(t, 0, t.rows, a, b) if name.endswith(ROW_PARALLEL) else decode_rows(t, a, b)
            if w.nbytes <= self._cache_left:
                self._own[name] = w
                self._cache_left -= w.nbytes
        return w

    def linears(self, x, names):
        """This rank's pieces of column-parallel products (fp32 ``[M, b - a]``, its rows);
        a row-parallel product or the LM head gathered and assembled (fp32 ``[M, N]``)."""
        if not self.plan.gathered(names[0]):
            return [self.piece(x, name, self.rank) for name in names]
        return [self.assemble(name, self.gather.all_gather(self.piece(x, name, self.rank))) for name in names]

    def attend(self, layer, q, k, v, cos, sin, feeds=()):
        """Attention over this rank's ``attn_heads`` (q fp32 ``[M, H_r, hd]``, k and v
        ``[M, H_r / G, hd]``); returns the columns of its K shard of the attention
        output, fp32 ``[M, b - a]`` (:meth:`node.tp.ShardPlan.attention_columns`)."""
        a, b = self.plan.attention_columns(layer, self.rank)
        if q.shape[1] == 0:
            return np.zeros((q.shape[0], 0), np.float32)
        return super().attend(layer, q, k, v, cos, sin)[:, a:b]

    def linear_residual(self, x, h, name):
        """``x + h @ W.T`` for row-parallel ``name`` from this rank's activations ``h``
        (fp32 ``[M, b - a]``, its K shard): placed at their columns of a zero
        ``[M, K]`` array, whose other columns the shard never reads."""
        return super().linear_residual(x, self.plan.shard_input(np, h, name, self.rank), name)


def _max_cols(model: Model) -> int:
    """Widest piece any rank can publish: the most rows of any matrix."""
    return max(t.rows for t in model.tensors.values() if t.rows > 1)


def _rank_engine(path: str, sha256: str, tp: int, rank: int, n_ctx, device: str, link, cuda_opts: dict):
    """The rank's engine and the object whose ``close`` ends its collective. Raises
    :class:`ModelError` when the file at ``path`` is no longer the one the parent
    loaded (``sha256``): the parent's attestations name that model."""
    model = load_model(path)
    if model.sha256 != sha256:
        raise ModelError(f"tensor-parallel rank {rank}: {path} changed after it was loaded (SHA-256 "
                         f"{model.sha256}, not {sha256}); restart to serve the new file")
    if device == "cuda":
        from .tp_gpu import CudaRankBackend
        be = CudaRankBackend(model, tp, rank, link, n_ctx=n_ctx or default_n_ctx(model.hparams),
                             **cuda_opts)
        return Engine(model, "cuda", n_ctx, backend=be), be
    shm_name, sems = link
    gather = ShmAllGather(shm_name, sems, tp, rank, _max_cols(model))
    return Engine(model, "cpu", n_ctx, backend=RankBackend(model, tp, rank, gather)), gather


def _publish(out: list, shm) -> object:
    """Rank 0's ``forward`` result: written into the shared logits block when it
    fits (the reply then carries only the shapes), else returned as is."""
    n = sum(a.size for a in out)
    if n * 4 > shm.size:
        return out
    flat = np.ndarray((n,), np.float32, shm.buf)
    off = 0
    for a in out:
        flat[off:off + a.size] = a.reshape(-1)
        off += a.size
    del flat
    return ("shm", [a.shape for a in out])


def _rank_main(path: str, sha256: str, tp: int, rank: int, n_ctx, device: str, link, cuda_opts: dict,
               out_name: str, conn) -> None:
    """A rank process: build the rank's engine, then serve (method, args) calls until ``None``.

    ``link``: the shared-memory name and semaphores (cpu) or the NCCL unique
    id (cuda); ``out_name`` the shared block through which rank 0 hands back
    logits (:func:`_publish`). Replies: ``("ok", result)`` (rank 0's result;
    others send ``None``), ``("err", e)`` for a request error (every rank raises it alike,
    before any gather), ``("fault", e)`` for anything else; a CPU rank that
    faults sets the abort flag first, so the others stop waiting for it (GPU
    ranks waiting in NCCL are stopped by the parent).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)                  # the parent handles Ctrl-C and stops us
    try:
        eng, coll = _rank_engine(path, sha256, tp, rank, n_ctx, device, link, cuda_opts)
        rec = eng.backend.device_record() if device == "cuda" else None
        out_shm = shared_memory.SharedMemory(name=out_name) if rank == 0 else None
        conn.send(("ok", (eng.n_ctx, rec)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("err", e if isinstance(e, BitexactError) else BitexactError(f"rank {rank}: {e}")))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:                                          # the parent is gone
            break
        if msg is None:
            break
        method, args = msg
        try:
            try:
                out = getattr(eng, method)(*args)
                if rank == 0 and method == "forward":
                    out = _publish(out, out_shm)
                conn.send(("ok", out if rank == 0 else None))
            except BitexactError as e:
                conn.send(("err", e))
            except GatherAborted as e:
                conn.send(("fault", BitexactError(f"tensor-parallel rank {rank}: {e}")))
            except Exception as e:  # noqa: BLE001 - a bug, out of memory on this rank only, an unpicklable result
                if device == "cpu":
                    coll.abort()
                conn.send(("fault", BitexactError(f"tensor-parallel rank {rank} failed: {type(e).__name__}: {e}")))
        except OSError:                                           # the parent is gone (killed): stop quietly
            break
    coll.close()
    if out_shm is not None:
        out_shm.close()


class TpEngine:
    """:class:`node.engine.Engine` run as ``tp`` rank processes, on the CPU or one per GPU.

    Same interface and bytes as ``Engine(model, device, n_ctx)``; ``tp`` is 2,
    4 or 8 and must split the model's heads (:class:`node.tp.ShardPlan`);
    ``device`` is ``"cpu"`` or ``"cuda"`` (rank ``r`` on GPU ``r``;
    ``cuda_opts`` as for :class:`node.backend_cuda.CudaBackend`).
    Raises :class:`ModelError` for a bad degree and the first rank's error
    when a rank cannot start (:class:`node.backend_cuda.GpuError` when there
    are fewer GPUs than ranks). A call raises the request error the ranks
    raised alike (the engine stays usable); if a rank dies or faults, the
    ranks disagree, or the caller is interrupted while ranks work, the call
    raises :class:`BitexactError` and the engine is broken: every later
    call raises too (restart it). Call :meth:`close` to stop the ranks (they
    are daemonic, so they also end with the parent).
    """

    contract = 1   # tensor parallelism runs determinism contract 1 (docs/determinism.md section 12)

    def __init__(self, model: Model, tp: int, n_ctx: int | None = None, device: str = "cpu", **cuda_opts):
        check_degree(tp)
        ShardPlan(model, tp)                                     # refuse a bad split before starting processes
        if device not in ("cpu", "cuda"):
            raise BitexactError(f"unknown device {device!r} (expected cpu or cuda)")
        self.model, self.hp, self.tp, self.device = model, model.hparams, tp, device
        self._broken: str | None = None
        self._closing = False   # close() stops the ranks: their exits are not deaths
        self._shm, self._flag, self._out = None, None, None
        self._conns, self._procs = [], []
        ctx = mp.get_context("spawn")
        try:
            if device == "cuda":
                from .tp_gpu import nccl_unique_id
                link = nccl_unique_id()
            else:
                self._shm = shared_memory.SharedMemory(create=True, size=shm_size(tp))
                self._flag = np.ndarray((1,), np.int64, self._shm.buf, 0)
                self._flag[0] = 0
                link = (self._shm.name, [ctx.Semaphore(0) for _ in range(tp)])
            self._out = shared_memory.SharedMemory(create=True, size=OUT_ROWS * self.hp.n_vocab * 4)
            for rank in range(tp):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, name=f"bitexact-tp{rank}", daemon=True,
                                args=(model.path, model.sha256, tp, rank, n_ctx, device, link, cuda_opts,
                                      self._out.name, child))
                p.start()
                self._conns.append(parent)
                self._procs.append(p)
            self.n_ctx, self._record = self._replies(startup=True)
        except BaseException:
            self.close()
            raise

    def device_record(self) -> dict:
        """Rank 0's GPU record (:meth:`node.backend_cuda.CudaBackend.device_record`) and the degree."""
        return dict(self._record or {}, tensor_parallel=self.tp)

    @property
    def broken(self) -> str | None:
        """Why the engine is broken (a rank died or faulted), or ``None``. A rank
        that exited while the engine was idle breaks it here, when it is asked
        (``GET /health``), not only at the next call; one log line says so (a
        call that fails on it has its own)."""
        if self._broken is None and not self._closing:
            for rank, p in enumerate(self._procs):
                if p.exitcode is not None:
                    self._break(f"tensor-parallel rank {rank} exited")
                    log.error("tensor-parallel rank %d exited (exit code %s); the node must be restarted",
                              rank, p.exitcode)
                    break
        return self._broken

    def _break(self, why: str) -> BitexactError:
        """Mark the engine broken (and free ranks waiting at a gather); the error to raise."""
        self._broken = why
        self._abort_ranks()
        return BitexactError(f"{why}; the tensor-parallel engine must be restarted")

    def _abort_ranks(self) -> None:
        """Stop ranks waiting for a failed one: the shared-memory abort flag
        (CPU), or killing the processes (GPU: NCCL waits without a timeout)."""
        if self._flag is not None:
            self._flag[0] = 1
        elif self.device == "cuda":
            for p in self._procs:
                if p.is_alive():
                    p.kill()

    def _replies(self, startup: bool = False, ranks: range | None = None):
        """The reply of every rank in ``ranks`` (default: all) to the last message: rank 0's result, the request
        error all ranks raised, or a fault that breaks the engine. At
        ``startup`` a rank's error stops the others (GPU ranks would wait for
        it in NCCL's setup) and is raised. After a step's request error the
        others have :data:`ERR_GRACE_S` to report theirs: ranks raise request
        errors alike before any gather, so a rank still silent then waits at a
        gather for the failed one (e.g. an out-of-memory on one GPU), and the
        ranks are stopped."""
        ranks = range(self.tp) if ranks is None else ranks
        replies: dict[int, tuple] = {}
        first = None                                            # the first rank to die or fault
        deadline = None                                         # set by the first request error
        try:
            while len(replies) < len(ranks):
                pending = {r: (self._conns[r], self._procs[r].sentinel) for r in ranks if r not in replies}
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = set(wait([h for pair in pending.values() for h in pair], timeout=left))
                if not ready:                                   # the grace after a request error ran out
                    if first is None:
                        first = (f"tensor-parallel ranks {sorted(pending)} did not answer after another rank's "
                                 f"error ({next(str(v[1]) for v in replies.values() if v[0] == 'err')})")
                        self._abort_ranks()
                    deadline = None                             # now wait, without a timeout, for them to stop
                for rank, (conn, sentinel) in pending.items():
                    if conn in ready:
                        try:
                            replies[rank] = conn.recv()
                            if startup and replies[rank][0] == "err" and first is None:
                                first = replies[rank][1]
                                self._abort_ranks()
                            elif replies[rank][0] == "err" and deadline is None and first is None:
                                deadline = time.monotonic() + ERR_GRACE_S
                            elif replies[rank][0] == "fault" and first is None:
                                first = str(replies[rank][1])
                                self._abort_ranks()
                            continue
                        except (EOFError, OSError):                 # closed or reset by a killed rank
                            pass
                    elif sentinel not in ready:
                        continue
                    replies[rank] = ("dead", None)
                    if first is None:
                        first = f"tensor-parallel rank {rank} exited"
                        self._abort_ranks()                     # ranks waiting for it stop waiting
        except BaseException:                                   # e.g. KeyboardInterrupt: replies left in the pipes
            self._break("interrupted while the ranks were working")
            raise
        kinds = [replies[r][0] for r in ranks]
        if isinstance(first, BaseException):
            raise first
        if first is not None:
            raise self._break(first)
        if "err" in kinds:
            errs = {(type(replies[r][1]), str(replies[r][1])) for r in ranks}
            if "ok" in kinds or len(errs) != 1:
                raise self._break(f"the tensor-parallel ranks disagree: {sorted(str(e[1]) for e in errs)}")
            raise replies[0][1]
        return replies[0][1]

    def _call(self, method: str, *args, ranks: range | None = None):
        """Run ``method(*args)`` on every rank in ``ranks`` (default: all); see :meth:`_replies`."""
        ranks = range(self.tp) if ranks is None else ranks
        if not self._conns:
            raise BitexactError("this tensor-parallel engine is closed")
        if self._broken:
            raise BitexactError(f"{self._broken}; the tensor-parallel engine must be restarted")
        try:
            msg = ForkingPickler.dumps((method, args))   # once, before any rank has the call
        except Exception as e:  # noqa: BLE001 - e.g. a lambda among the token ids: nothing was sent
            raise RequestError(f"the arguments of {method} cannot be sent to the ranks: "
                               f"{type(e).__name__}: {e}") from None
        try:
            for r in ranks:
                try:
                    self._conns[r].send_bytes(msg)       # what Connection.send writes
                except OSError:                  # a dead rank: _replies reports it
                    pass
        except BaseException:                    # e.g. KeyboardInterrupt: some ranks have the call, others not
            self._break("interrupted while sending a call to the ranks")
            raise
        return self._replies(ranks=ranks)

    def new_sequence(self) -> int:
        return self._call("new_sequence")

    def fork(self, src: int, n_tokens: int) -> int:
        return self._call("fork", src, n_tokens)

    def release(self, seq: int) -> None:
        self._call("release", seq)

    def length(self, seq: int) -> int:
        return self._call("length", seq)

    def forward(self, chunks, all_logits: bool = False) -> list[np.ndarray]:
        """:meth:`node.engine.Engine.forward` on every rank; rank 0's logits."""
        out = self._call("forward", [(s, list(t)) for s, t in chunks], all_logits)
        if isinstance(out, tuple):                               # rank 0 wrote it into the shared block
            flat = np.ndarray((sum(int(np.prod(s)) for s in out[1]),), np.float32, self._out.buf)
            parts, off = [], 0
            for shape in out[1]:
                n = int(np.prod(shape))
                parts.append(flat[off:off + n].reshape(shape).copy())
                off += n
            return parts
        return out

    def sample(self, picks, logits) -> list[int]:
        """Token ids for rows of the last :meth:`forward` (see
        :meth:`node.engine.Engine.sample`). On GPU ranks the rows are drawn on
        rank 0's GPU from the step's gathered device logits
        (:meth:`node.engine.Engine.sample_on_device`): a draw changes no state,
        so the other ranks need not draw, and an error of rank 0's draw (e.g.
        out of GPU memory) fails the step's requests without breaking the
        engine. On CPU ranks the rows are drawn on the host."""
        cuda = self.device == "cuda"
        return draw_rows(picks, logits,
                         (lambda picks: self._call("sample_on_device", picks, ranks=range(1))) if cuda else None)

    def close(self) -> None:
        """Stop the rank processes and free the shared memory (idempotent)."""
        self._closing = True
        if self._broken:
            self._abort_ranks()
        for conn, p in zip(self._conns, self._procs):
            if p.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join()
        self._conns, self._procs = [], []
        if self._shm is not None:
            self._flag = None
            self._shm.close()
            self._shm.unlink()
            self._shm = None
        if self._out is not None:
            self._out.close()
            self._out.unlink()
            self._out = None
