"""Tensor parallelism on GPUs (docs/determinism.md section 12).

On one GPU: every rank's shard of every product, computed by the sharded
``matmul_q`` / ``matmul_f`` kernels, equals the numpy rank's piece bit for
bit at TP 2, 4 and 8, and ``tp_combine`` equals its twin. On several GPUs:
:class:`node.tp_runtime.TpEngine` with one rank per GPU gives the bytes of
the single-GPU and CPU engines, for 1,000 requests over random batch
compositions. Marked ``gpu``; the multi-GPU tests skip with fewer GPUs than
ranks. Run by ``bash scripts/gpu_check.sh tp``.
"""

import numpy as np
import pytest

from attest import digest
from node import reference as ref
from node.engine import Engine
from node.gguf_model import load_model
from node.synth import write_model
from node.tp import ROW_PARALLEL, TpCpuBackend

pytestmark = pytest.mark.gpu
F32 = np.float32
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
SHAPE = (512, 1, 8, 2, 1024, 300)     # 8 heads of 64: whole heads per rank up to TP 8


def assert_same(want, got, what):
    want, got = np.asarray(want), np.asarray(got)
    assert want.shape == got.shape and want.dtype == got.dtype, (what, want.shape, got.shape)
    diff = int((want.view(np.uint32) != got.view(np.uint32)).sum()) if want.size else 0
    assert want.tobytes() == got.tobytes(), f"{what}: {diff} of {want.size} values differ"


def gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-gpu-models")
    return {q: load_model(write_model(str(d / f"{q}.gguf"), SHAPE, q, seed=5)) for q in QTYPES}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_pieces_equal_numpy_ranks(models, qtype, tp):
    """Each rank's piece of each product (column rows, row-parallel partials of
    its lanes) and their tp_combine: GPU bytes == numpy bytes, at M = 1, 5, 17."""
    from node.backend_cuda import CudaBackend
    from node.tp_gpu import shard_mat
    model = models[qtype]
    be = CudaBackend(model, pin=None, kv_pages=8)
    cpu = TpCpuBackend(model, tp)
    rng = np.random.default_rng(tp)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                 "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", model.output.name):
        t = model.tensors[name]
        for m in (1, 5, 17):
            x = (rng.standard_normal((m, t.cols)) * 3).astype(F32)
            pieces = []
            for r in range(tp):
                want = cpu.piece(x, name, r)
                mat = shard_mat(be, cpu.plan, r, name, t)
                if mat is None:
                    got = np.zeros_like(want)
                else:
                    be._mats[name] = mat
                    got = be.to_host(be.linears(be.from_host(x), [name])[0])
                assert_same(want, got, f"{name} rank {r}/{tp} M={m}")
                pieces.append(got)
            if name.endswith(ROW_PARALLEL):
                stack = np.stack(pieces)
                assert_same(ref.tp_combine(stack), be.to_host(be.launch_tp_combine(be.from_host(stack))),
                            f"{name} tp_combine")
                assert_same(ref.matmul_q(ref.quantize_q8(x), cpu._weight(name)) if qtype.startswith("Q")
                            else ref.matmul_f(x, cpu._weight(name)), ref.tp_combine(stack), f"{name} == TP 1")


def _need(n):
    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs, {gpu_count()} visible")


@pytest.mark.parametrize("qtype", ["BF16", "Q4_K", "Q8_0", "Q4_1-smollm2"])
def test_tp_engine_on_gpus_equals_one_gpu_and_cpu(models, tmp_path, qtype):
    """TP 2 (and 4, 8 where there are GPUs): logits of chunked prefill and
    decode steps equal the single-GPU and CPU engines' bytes. The SmolLM2-like
    case (9 query heads over 3 KV heads) has ranks sharing a KV head."""
    from node.tp_runtime import TpEngine
    _need(2)
    model = models.get(qtype) or load_model(write_model(str(tmp_path / "s.gguf"), (576, 2, 9, 3, 1536, 300),
                                                         "Q4_1", seed=9))
    prompts = [list(np.random.default_rng(i).integers(0, 300, n)) for i, n in enumerate((7, 1, 30))]

    def logits(eng):
        seqs = [eng.new_sequence() for _ in prompts]
        out = eng.forward(list(zip(seqs, prompts)), all_logits=True)
        toks = [int(np.argmax(o[-1])) for o in out]
        for _ in range(3):
            step = eng.forward([(s, [t]) for s, t in zip(seqs, toks)])
            out += step
            toks = [int(np.argmax(o)) for o in step]
        return np.concatenate([o.reshape(-1) for o in out])

    want = logits(Engine(model, "cpu"))
    assert_same(want, logits(Engine(model, "cuda", pin=None, kv_pages=16)), "one GPU")
    for tp in (2, 4, 8):
        if tp > gpu_count():
            break
        eng = TpEngine(model, tp, device="cuda", pin=None, kv_pages=16)
        try:
            assert eng.device_record()["tensor_parallel"] == tp
            assert_same(want, logits(eng), f"TP {tp} on {tp} GPUs")
        finally:
            eng.close()


def test_tp_engine_draws_seeded_rows_on_the_gpus(models):
    """TpEngine.sample on GPU ranks: the seeded rows go to the ranks' GPU sampler
    (the gathered device logits of the step: an eager prefill step, then
    graph-replayed decode steps; picks out of row order, one greedy), and every
    row's id equals node/sampler.py's on the returned logits. Only rank 0 draws."""
    from node.sampler import SamplingParams, sample
    from node.tp_runtime import TpEngine
    _need(2)
    eng = TpEngine(models["Q8_0"], 2, device="cuda", pin=None, kv_pages=64)
    calls = []
    call = eng._call
    eng._call = lambda method, *a, **kw: (calls.append((method, kw.get("ranks"))), call(method, *a, **kw))[1]
    try:
        rng = np.random.default_rng(8)
        seqs = [eng.new_sequence() for _ in range(5)]
        outs = eng.forward([(s, rng.integers(0, 300, 9 + i).tolist()) for i, s in enumerate(seqs)])
        for step in range(4):
            params = [SamplingParams(0.5 + 0.3 * i, (0, 1, 7, 0, 50)[i], (1.0, 0.9, 0.5, 0.2, 1.0)[i],
                                     1000 * step + i) for i in range(5)]
            params[2] = SamplingParams()
            picks = [(i, params[i], 20 + step) for i in range(5)][::-1]
            got = eng.sample(picks, outs)
            assert got == [sample(outs[r], p, pos) for r, p, pos in picks]
            outs = eng.forward([(s, [t]) for s, t in zip(seqs, got[::-1])])
        assert calls.count(("sample_on_device", range(1))) == 4      # rank 0 alone draws
    finally:
        eng.close()


def _digests(eng, requests, rng, steps=4):
    """Greedy step-chain digest of each request, run in random batch compositions
    with random prefill chunks (a request's digest must not depend on them)."""
    out, pending = {}, list(range(len(requests)))
    while pending:
        wave = [pending.pop() for _ in range(min(len(pending), int(rng.integers(1, 33))))]
        seqs = {i: eng.new_sequence() for i in wave}
        done, last = dict.fromkeys(wave, 0), {}
        while any(done[i] < len(requests[i]) for i in wave):
            step = []
            for i in rng.permutation(wave):
                if done[i] < len(requests[i]):
                    c = int(rng.integers(1, 9))
                    step.append((i, requests[i][done[i]:done[i] + c]))
            for (i, tk), lg in zip(step, eng.forward([(seqs[i], tk) for i, tk in step])):
                done[i] += len(tk)
                last[i] = lg
        links = dict.fromkeys(wave, digest.sha256(b"start"))
        for _ in range(steps):
            toks = {i: int(np.argmax(last[i])) for i in wave}
            for i in wave:
                links[i] = digest.chain_step(links[i], toks[i], digest.logits_digest(last[i]))
            order = list(rng.permutation(wave))
            for i, lg in zip(order, eng.forward([(seqs[i], [toks[i]]) for i in order])):
                last[i] = lg
        for i in wave:
            eng.release(seqs[i])
            out[i] = links[i].hex()
    return out


def test_thousand_requests_same_digests_at_every_degree(models):
    """1,000 requests over random batch compositions: the digests at TP 2 (4, 8
    where there are GPUs) equal the single-GPU digests, and a sample equals the CPU's."""
    from node.tp_runtime import TpEngine
    _need(2)
    model = models["Q4_K"]
    rng = np.random.default_rng(1000)
    requests = [rng.integers(0, 300, int(rng.integers(1, 24))).tolist() for _ in range(1000)]
    want = _digests(Engine(model, "cuda", pin=None, kv_pages=256), requests, np.random.default_rng(1))
    sample = list(range(0, 1000, 50))
    cpu = _digests(Engine(model, "cpu"), [requests[i] for i in sample], np.random.default_rng(2))
    assert [cpu[j] for j in range(len(sample))] == [want[i] for i in sample]
    for tp in (2, 4, 8):
        if tp > gpu_count():
            break
        eng = TpEngine(model, tp, device="cuda", pin=None, kv_pages=256)
        try:
            assert _digests(eng, requests, np.random.default_rng(tp)) == want, f"TP {tp}"
        finally:
            eng.close()


def test_killed_gpu_rank_breaks_the_engine(models):
    """A GPU rank killed between steps: the next call fails within seconds (the
    others, waiting in NCCL, are stopped) and the engine stays broken."""
    import time

    from node.errors import BitexactError
    from node.tp_runtime import TpEngine
    _need(2)
    eng = TpEngine(models["Q8_0"], 2, device="cuda", pin=None, kv_pages=8)
    try:
        seq = eng.new_sequence()
        eng.forward([(seq, [1, 2, 3])])
        eng._procs[1].kill()
        t0 = time.monotonic()
        with pytest.raises(BitexactError, match="rank 1 exited"):
            eng.forward([(seq, [4])])
        assert time.monotonic() - t0 < 30
        with pytest.raises(BitexactError, match="restarted"):
            eng.length(seq)
        assert eng.broken
    finally:
        eng.close()
