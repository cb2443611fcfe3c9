"""Batched llama forward pass over many sequences at once.

One step takes any mix of chunks: a new prompt's prefill, a later chunk of a
chunked prefill, or one decode token, for any number of sequences at any
positions. Every op is per token or per sequence (attention reads only the
token's own sequence), and every reduction follows docs/determinism.md, so a
sequence's logits never depend on what else is in the step.
"""

from __future__ import annotations

import itertools
import operator
from typing import Sequence

import numpy as np

from attest.digest import CONTRACT_VERSIONS

from .errors import ModelError, NumericFault, RequestError
from .gguf_model import FLOAT_TYPES, Model
from .reference import MAX_ROWINT_K
from .rope_table import rope_table
from .sampler import sample_rows
from .tp import check_degree


def check_contract(contract, tp: int = 1, one_launch: bool = False, rank: bool = False) -> int:
    """Return ``contract`` if it is a version of ``attest.digest.CONTRACT_VERSIONS`` (an
    ``int``) that runs with tensor-parallel degree ``tp``, ``one_launch`` and (``rank``)
    a tensor-parallel rank's backend: contract 2 runs in one process on the per-op
    kernels (docs/determinism.md section 14). Raises :class:`RequestError` otherwise."""
    if type(contract) is not int or contract not in CONTRACT_VERSIONS:
        raise RequestError(f"determinism-contract version must be one of {CONTRACT_VERSIONS}, got {contract!r}")
    if contract == 2 and (tp != 1 or one_launch or rank):
        raise RequestError("--contract 2 runs in one process with per-op kernels "
                           "(--tp and --one-launch run contract 1)")
    return contract


def default_n_ctx(hp) -> int:
    """Context length in tokens when none is given: the model's training context, at most 8192."""
    return min(hp.n_ctx_train, 8192)


def check_rowint_model(model: Model) -> None:
    """Raise :class:`ModelError` unless every float matrix of ``model`` has
    ``K <`` :data:`node.reference.MAX_ROWINT_K`, as contract 2's products need
    (docs/determinism.md section 14)."""
    for name, t in model.tensors.items():
        if t.qtype in FLOAT_TYPES and t.rows > 1 and t.cols >= MAX_ROWINT_K:
            raise ModelError(f"{name}: contract 2 needs float matrices with K < {MAX_ROWINT_K}, got K={t.cols}")


class Engine:
    """Forward pass of a loaded :class:`~node.gguf_model.Model` on one backend.

    ``device`` is ``"cpu"`` (numpy reference) or ``"cuda"`` (CuPy kernels).
    ``n_ctx`` is the context length in tokens (default: the model's training
    context, at most 8192). ``tp`` (1, 2, 4, 8) runs the numpy engine sharded
    as that many tensor-parallel ranks would (:mod:`node.tp`); the bytes are
    those of ``tp = 1``. ``backend`` is an already built backend for ``device``
    (a tensor-parallel rank's: :class:`node.tp_runtime.RankBackend` or
    :class:`node.tp_gpu.CudaRankBackend`).
    ``contract`` is the determinism contract's version (docs/determinism.md): 1, or
    2 (products of float weights in integers, section 14; one process, per-op kernels).
    ``cuda_opts`` (``pin``, ``kv_pages``, ``graphs``, ``one_launch``: each step of an
    F16/BF16 model in one launch, cuda/step.cu, the same bytes) go to
    :class:`~node.backend_cuda.CudaBackend`. Raises :class:`RequestError` for an
    unknown device or contract, ``tp > 1`` on cuda, or contract 2 with ``tp > 1``, a
    rank's backend or ``one_launch``; :class:`ModelError` for a ``tp`` that
    is not 1, 2, 4 or 8 or that the model's heads cannot be split by, and under
    contract 2 for a float matrix with ``K >= 2^16`` (:func:`check_rowint_model`).
    """

    broken = None  # one process: a fault fails its step only (node.tp_runtime.TpEngine can break)

    def __init__(self, model: Model, device: str = "cpu", n_ctx: int | None = None, tp: int = 1, backend=None,
                 contract: int = 1, **cuda_opts):
        self.model = model
        self.hp = hp = model.hparams
        if n_ctx is not None and not (type(n_ctx) is int and 1 <= n_ctx <= 1 << 20):
            raise RequestError(f"the context length must be an integer in [1, 2**20], got {n_ctx!r}")
        self.n_ctx = n_ctx or default_n_ctx(hp)
        check_degree(tp)
        self.contract = check_contract(contract, tp, bool(cuda_opts.get("one_launch")), backend is not None)
        if contract == 2:
            check_rowint_model(model)
        if backend is not None:                 # a tensor-parallel rank's backend (node.tp_runtime)
            self.backend = backend
        elif device == "cpu" and tp != 1:
            from .tp import TpCpuBackend
            self.backend = TpCpuBackend(model, tp)
        elif device == "cpu":
            from .backend_cpu import CpuBackend
            self.backend = CpuBackend(model, contract=contract)
        elif device == "cuda" and tp != 1:
            raise RequestError(f"Engine(tp={tp!r}) emulates ranks on the CPU; GPU ranks run in node.tp_runtime.TpEngine")
        elif device == "cuda":
            from .backend_cuda import CudaBackend
            self.backend = CudaBackend(model, n_ctx=self.n_ctx, contract=contract, **cuda_opts)
        else:
            raise RequestError(f"unknown device {device!r} (expected cpu or cuda)")
        self.device = device
        ff = None
        if "rope_freqs.weight" in model.tensors:
            ff = self.backend.vector("rope_freqs.weight").astype(np.float64)
        cos, sin = rope_table(hp.head_dim, self.n_ctx, hp.rope_base, hp.rope_freq_scale, ff)
        self._cos = self.backend.from_host(cos)
        self._sin = self.backend.from_host(sin)
        self._len: dict[int, int] = {}
        self._ids = itertools.count(1)

    def device_record(self) -> dict:
        """The GPU's record for attestations (cuda only: :meth:`CudaBackend.device_record`)."""
        return self.backend.device_record()

    # ---- sequences ---------------------------------------------------------
    def new_sequence(self) -> int:
        """Allocate an empty sequence; returns its id."""
        seq = next(self._ids)
        self.backend.kv_alloc(seq)
        self._len[seq] = 0
        return seq

    def fork(self, src: int, n_tokens: int) -> int:
        """New sequence whose KV cache is a copy of the first ``n_tokens`` of ``src``.
        Raises :class:`RequestError` for an unknown ``src`` or ``n_tokens`` outside
        ``[0, length(src)]``."""
        n = self.length(src)
        try:                                    # an integer, numpy's too (as forward's token ids), no bool
            k = -1 if type(n_tokens) is bool else operator.index(n_tokens)
        except TypeError:
            k = -1
        if not 0 <= k <= n:
            raise RequestError(f"cannot reuse {n_tokens!r} tokens of a {n}-token sequence")
        seq = next(self._ids)
        self.backend.kv_copy_prefix(src, seq, k)
        self._len[seq] = k
        return seq

    def release(self, seq: int) -> None:
        """Free a sequence's KV cache (an unknown id: nothing to free). Raises
        :class:`RequestError` for an id that cannot be one (unhashable)."""
        try:
            hash(seq)
        except TypeError:                       # as length() does: every rank raises it alike
            raise _unknown(seq) from None
        self.backend.kv_free(seq)
        self._len.pop(seq, None)

    def length(self, seq: int) -> int:
        """Tokens in ``seq``'s KV cache. Raises :class:`RequestError` for an id that
        :meth:`new_sequence` or :meth:`fork` did not return, or that was released
        (an error the caller made, which every tensor-parallel rank raises alike)."""
        try:
            return self._len[seq]
        except (KeyError, TypeError):           # TypeError: an unhashable id
            raise _unknown(seq) from None

    # ---- forward -----------------------------------------------------------
    def forward(self, chunks: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Append each chunk's tokens to its sequence and run one step.

        ``chunks``: ``(seq, tokens)`` pairs, at most one per sequence; each
        chunk continues its sequence at position ``length(seq)``.
        Returns, per chunk, fp32 logits ``[n_tokens, n_vocab]`` when
        ``all_logits`` else ``[n_vocab]`` for the chunk's last token.
        Raises :class:`RequestError` for no chunks, an unknown sequence, two chunks
        of one sequence, an empty chunk, a token id that is not an integer in
        ``[0, n_vocab)`` or a step past the context length, and
        :class:`NumericFault` if a NaN appears (no sequence grows then).
        """
        hp, be = self.hp, self.backend
        if not chunks:
            raise RequestError("a step needs at least one chunk")
        try:
            all_logits = bool(all_logits)
        except (TypeError, ValueError):         # e.g. an array: its rank would fault, breaking a TpEngine
            raise RequestError(f"all_logits must be true or false, got {all_logits!r}") from None
        toks, pos, spans = [], [], []
        for seq, tk in chunks:
            n0 = self.length(seq)
            if len(tk) == 0:
                raise RequestError("empty chunk")
            if n0 + len(tk) > self.n_ctx:
                raise RequestError(f"sequence would reach {n0 + len(tk)} tokens, past the context of {self.n_ctx}")
            spans.append((len(toks), len(toks) + len(tk)))
            if any(type(t) is bool for t in tk):
                raise RequestError("token ids must be integers, not booleans")
            try:
                toks.extend(operator.index(t) for t in tk)
            except TypeError:
                raise RequestError("token ids must be integers") from None
            pos.extend(range(n0, n0 + len(tk)))
        if len({s for s, _ in chunks}) != len(chunks):
            raise RequestError("a step may hold at most one chunk per sequence")
        if min(toks) < 0 or max(toks) >= hp.n_vocab:
            raise RequestError(f"token id out of range [0, {hp.n_vocab})")
        tok_arr = np.asarray(toks, np.int64)
        pos_arr = np.asarray(pos, np.int64)
        rows = np.arange(len(toks)) if all_logits else np.asarray([b - 1 for _, b in spans])
        be.begin_step([(seq, a, b) for (seq, _), (a, b) in zip(chunks, spans)], pos_arr, replay=not all_logits)
        logits = be.run(self._device_forward, tok_arr, pos_arr, rows)
        if np.isnan(logits.max()):   # max propagates NaN: one pass, no mask array
            # before the lengths move: a faulted step appends nothing (its KV entries lie past
            # every sequence's length and are rewritten), so its chunks can be run again
            raise NumericFault("NaN in logits: the forward pass faulted")
        for (seq, tk) in chunks:
            self._len[seq] += len(tk)
        if all_logits:
            return [logits[a:b] for a, b in spans]
        return [logits[i] for i in range(len(chunks))]

    def sample(self, picks, logits) -> list[int]:
        """Token ids for rows of the last :meth:`forward` step (``all_logits`` off).

        ``picks``: ``(row, SamplingParams, position)``; ``logits``: that step's
        result. On the CUDA backend the rows are drawn on the GPU from the step's
        device logits (:meth:`sample_on_device`); the CPU backend uses
        node/sampler.py on the host (:func:`draw_rows`). Raises
        :class:`NumericFault` when ``logits / temperature`` of a row overflows fp32.
        """
        return draw_rows(picks, logits, self.sample_on_device if self.device == "cuda" else None)

    def sample_on_device(self, picks) -> list[int]:
        """Token ids of ``picks`` drawn on the GPU from the last step's device logits
        (``CudaBackend.sample_last``, the twin of node/sampler.py ``sample``: the
        same ids). CUDA backend only."""
        return self.backend.sample_last(*zip(*picks))

    def _device_forward(self, tok, pos, rows):
        """The layer stack on backend arrays: token ids int64 ``[M]``, positions
        int64 ``[M]``, the rows whose logits are wanted int64 ``[R]``; returns
        fp32 logits ``[R, n_vocab]`` on the backend. No host synchronisation, so
        the CUDA backend can capture it in a graph."""
        hp, be = self.hp, self.backend
        if self.device == "cuda" and be.step is not None:   # one launch (cuda/step.cu), the same bytes
            return be.launch_step(be.embed(tok), self._cos, self._sin, rows)
        m = tok.shape[0]
        cos, sin = self._cos[pos], self._sin[pos]
        x = be.embed(tok)
        for layer in range(hp.n_layer):
            p = f"blk.{layer}."
            qkv = (p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
            q, k, v = be.linears(be.rms_norm(x, p + "attn_norm.weight", qkv), qkv)
            o = p + "attn_output.weight"
            hd = hp.head_dim   # heads: all of them, or a tensor-parallel rank's own (node/tp.py)
            att = be.attend(layer, q.reshape(m, -1, hd), k.reshape(m, -1, hd), v.reshape(m, -1, hd), cos, sin, (o,))
            x = be.linear_residual(x, att, o)
            gu = (p + "ffn_gate.weight", p + "ffn_up.weight")
            g, u = be.linears(be.rms_norm(x, p + "ffn_norm.weight", gu), gu)
            down = p + "ffn_down.weight"
            x = be.linear_residual(x, be.silu_gate(g, u, (down,)), down)
        out = (self.model.output.name,)
        return be.linears(be.rms_norm(x[rows], "output_norm.weight", out), out)[0]


def _unknown(seq) -> RequestError:
    return RequestError(f"unknown sequence {seq!r} (never allocated, or released)")


def draw_rows(picks, logits, device_draw=None) -> list[int]:
    """Token ids for ``picks`` ``(row, SamplingParams, position)`` over one step's
    ``logits`` (fp32 ``[n_vocab]`` rows, indexed by row): through ``device_draw``
    (a list of picks -> their ids, drawn on the GPU from the step's device
    logits) when given, else on the host (node/sampler.py ``sample_rows``).
    Raises :class:`RequestError` for rows of an ``all_logits`` step,
    :class:`NumericFault` when ``logits / temperature`` of a row overflows fp32."""
    if any(np.ndim(logits[r]) != 1 for r, _, _ in picks):
        raise RequestError("sample takes the rows of a forward step without all_logits")
    if not picks:
        return []
    return device_draw(picks) if device_draw else sample_rows(logits, picks)
