"""CUDA engine: every kernel equals its numpy twin bit for bit; whole-model logits
equal the reference engine's bytes; batching never changes a sequence's bytes.

Marked ``gpu``: run on the device by scripts/gpu_check.sh. Tests that need the
default model are also marked ``default_model``.
"""

import hashlib
import os
import re

import numpy as np
import pytest

import golden
from node import reference as ref
from node.backend_cuda import x_width
from node.engine import Engine
from node.gguf_model import decode_blocks, default_model_path, float_values, load_model
from node.synth import write_model

pytestmark = pytest.mark.gpu
F32 = np.float32
WARP = ref.WARP
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
SHAPE = (256, 2, 4, 2, 512, 300)


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def assert_same(want, got, what=""):
    """Byte equality; on failure name the first differing element and both values."""
    want, got = np.asarray(want), np.asarray(got)
    assert want.shape == got.shape and want.dtype == got.dtype, (what, want.shape, got.shape, got.dtype)
    if want.tobytes() != got.tobytes():
        wb = want.reshape(-1).view(np.uint8 if want.itemsize == 1 else f"u{want.itemsize}")
        gb = got.reshape(-1).view(wb.dtype)
        i = int(np.flatnonzero(wb != gb)[0])
        raise AssertionError(f"{what}: {int((wb != gb).sum())} of {wb.size} differ; first at flat {i} "
                             f"(index {np.unravel_index(i, want.shape)}): want {want.reshape(-1)[i]!r} "
                             f"got {got.reshape(-1)[i]!r}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-models")
    return {q: load_model(write_model(str(d / f"{q}.gguf"), SHAPE, q, seed=21)) for q in QTYPES}


@pytest.fixture(scope="module")
def backends(models):
    from node.backend_cuda import CudaBackend
    return {q: CudaBackend(m, pin=None, kv_pages=64) for q, m in models.items()}


@pytest.fixture(scope="module")
def backends_c2(models):
    from node.backend_cuda import CudaBackend
    return {q: CudaBackend(models[q], pin=None, kv_pages=8, contract=2) for q in ("F32", "F16", "BF16")}


def test_gpu_pinned_and_recorded(models):
    from node.backend_cuda import CudaBackend, GpuError
    with pytest.raises(GpuError, match="pinned"):
        CudaBackend(models["Q8_0"], pin="Some Other GPU", kv_pages=8)
    rec = CudaBackend(models["Q8_0"], kv_pages=8).device_record()   # default pin: this GPU
    assert rec["gpu"] == "NVIDIA H200" and rec["compute_capability"] == "9.0"
    assert re.fullmatch(r"\d+(\.\d+)+", rec["driver"]), rec   # read through NVML (nvidia-ml-py)
    from node.cli import resolve_device
    assert resolve_device("auto") == "cuda"   # --device auto (tests/test_cli.py: the CPU side)


def test_unsupported_gpu_and_out_of_memory_at_load_are_gpu_errors(models, monkeypatch):
    """A GPU of another compute capability (its properties faked) and a KV cache larger
    than the GPU's memory are one GpuError each (the CLI's exit code 2)."""
    import cupy
    from node.backend_cuda import CudaBackend, GpuError
    with pytest.raises(GpuError, match="out of GPU memory while loading the model"):
        CudaBackend(models["Q8_0"], pin=None, kv_pages=1 << 22)   # 2 TiB of pages
    real = cupy.cuda.runtime.getDeviceProperties
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda d: {**real(d), "major": 8, "minor": 9})
    with pytest.raises(GpuError, match="compute capability 8.9"):
        CudaBackend(models["Q8_0"], pin=None, kv_pages=8)


def test_launch_refusals_are_clear_errors(backends):
    """PdlKernel: an argument of an unsupported type is a TypeError before the
    launch; a launch the driver refuses (1025 threads per block) is a GpuError."""
    import cupy as cp

    from node.backend_cuda import GpuError
    k = backends["F32"].k["residual_add"]
    x = cp.zeros(8, cp.float32)
    with pytest.raises(TypeError, match="residual_add: kernel argument of type int"):
        k((1,), (32,), (x, x, x, 8))
    with pytest.raises(GpuError, match="^kernel residual_add could not be launched: CUDA_ERROR_"):
        k((1,), (1025,), (x, x, x, np.int64(8)))
    k((1,), (32,), (x + 1, x + 2, x, np.int64(8)))
    assert x.get().tolist() == [3.0] * 8


@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_quantize_q8_twin(backends, m):
    be = backends["Q8_0"]
    rng = np.random.default_rng(m)
    x = (rng.standard_normal((m, 512)) * 10 ** rng.uniform(-40, 5, (m, 1))).astype(F32)
    x[0, :32] = 0.0
    x[-1, 32:64] = np.float32(1e-44) * rng.integers(-5, 5, 32)   # subnormals
    x[-1, 100], x[-1, 200], x[0, 511] = np.nan, np.inf, -np.inf      # d = NaN (0x7fc00000) and codes 0
    want = ref.quantize_q8(x)
    got = [be.to_host(a) for a in be.launch_quantize_q8(be.from_host(x))]
    got[0] = got[0].reshape(want[0].shape)
    for w, g, what in zip(want, got, ("q", "d", "a")):
        assert_same(w, g, what)


@pytest.mark.parametrize("v", [1, 2, 4, 8])
def test_lane_major_twin(backends, v):
    be = backends["BF16"]
    x = np.random.default_rng(v).standard_normal((3, 512)).astype(F32)
    assert_same(ref.lane_major(x, v), be.to_host(be.launch_lane_major(be.from_host(x), v)), "lane_major")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 5, 8, 17])
def test_matmul_twin(models, backends, qtype, m):
    """Single and fused (gate+up in one launch) products equal the numpy twins, and
    a single product with the residual add in its epilogue equals residual_add after it."""
    be, model = backends[qtype], models[qtype]
    rng = np.random.default_rng(100 + m)
    for names in (("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"), ("blk.0.ffn_down.weight",),
                  ("output.weight",), ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")):
        ts = [model.tensors[n] for n in names]
        x = rng.standard_normal((m, ts[0].cols)).astype(F32)
        xq = ref.quantize_q8(x)
        if qtype in ("F32", "F16", "BF16"):
            want = [ref.matmul_f(x, float_values(t)) for t in ts]
            got = be.launch_matmul_f(be.from_host(ref.lane_major(x, x_width(ts[0].cols))), list(names))
        else:
            want = [ref.matmul_q(xq, ref.RefQuantWeight(*decode_blocks(qtype, t.raw))) for t in ts]
            got = be.launch_matmul_q(tuple(be.from_host(a.reshape(m, -1) if i == 0 else a)
                                           for i, a in enumerate(xq)), list(names))
        for name, w, g in zip(names, want, got):
            assert_same(w, be.to_host(g), name)
        if len(names) == 1:
            r = (rng.standard_normal(want[0].shape) * 4).astype(F32)
            r[:, 0], r[:, 1], r[:, 2] = -want[0][:, 0], 0.0, np.float32(1e-41)   # cancellation, +0, subnormal
            got = be.linear_residual(be.from_host(r), be.from_host(x), names[0])
            assert_same(ref.residual_add(r, want[0]), be.to_host(got), f"{names[0]} + residual")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_matmul_q_splits_and_copy_widths(tmp_path, monkeypatch, qtype):
    """matmul_q with 4 and with 8 warps per tile equals the twin. Flat types take
    SmolLM2's K = 576 and 1536 (18 and 48 blocks, so warps own partial units of
    records and contract lanes of 0 or 1 blocks); K-quants take K = 768 and
    1536 (24 and 48 blocks); N = 300 leaves the last tile 12 rows short."""
    import node.backend_cuda as bc
    shape = (768, 1, 4, 2, 1536, 300) if qtype in ("Q4_K", "Q6_K") else (576, 1, 9, 3, 1536, 300)
    model = load_model(write_model(str(tmp_path / "k.gguf"), shape, qtype, seed=5))
    be = bc.CudaBackend(model, pin=None, kv_pages=8)
    rng = np.random.default_rng(7)
    for narrow, split in ((0, 4), (10 ** 9, 8)):
        monkeypatch.setattr(bc, "MQ_NARROW", narrow)
        for names in (("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
                      ("blk.0.ffn_down.weight",), ("output.weight",)):
            ts = [model.tensors[n] for n in names]
            assert bc.mq_split([t.rows for t in ts], WARP) == split and ts[0].qtype == qtype
            for m in (1, 9):
                xq = ref.quantize_q8(rng.standard_normal((m, ts[0].cols)).astype(F32))
                got = be.launch_matmul_q(tuple(be.from_host(a.reshape(m, -1) if i == 0 else a)
                                               for i, a in enumerate(xq)), list(names))
                for t, g in zip(ts, got):
                    want = ref.matmul_q(xq, ref.RefQuantWeight(*decode_blocks(qtype, t.raw)))
                    assert_same(want, be.to_host(g), f"{t.name} split {split} m {m}")


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_matmul_f_narrow_chunks(tmp_path, qtype):
    """K = 96 and 160 (K/32 odd): one-element lane chunks, the narrowest layout;
    an odd vocabulary (51 rows) leaves the last warp of the LM head one row short."""
    from node.backend_cuda import CudaBackend
    model = load_model(write_model(str(tmp_path / "odd.gguf"), (96, 1, 4, 2, 160, 51), qtype, seed=3))
    be = CudaBackend(model, pin=None, kv_pages=8)
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(F32)
    got = be.linears(be.from_host(x), ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"])
    for name, g in zip(("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"), got):
        assert_same(ref.matmul_f(x, float_values(model.tensors[name])), be.to_host(g), name)
    head = model.output.name
    (got,) = be.linears(be.from_host(x), [head])
    assert_same(ref.matmul_f(x, float_values(model.tensors[head])), be.to_host(got), head)
    h = np.random.default_rng(2).standard_normal((3, 160)).astype(F32)
    (got,) = be.linears(be.from_host(h), ["blk.0.ffn_down.weight"])
    assert_same(ref.matmul_f(h, float_values(model.tensors["blk.0.ffn_down.weight"])), be.to_host(got), "down")


@pytest.mark.parametrize("qtype", QTYPES)
def test_embed_twin(models, backends, qtype):
    be, t = backends[qtype], models[qtype].tensors["token_embd.weight"]
    toks = np.array([0, 5, 299, 17, 5], np.int64)
    assert_same(ref.embed(t, toks), be.to_host(be.launch_embed(toks)), "embed")


def test_elementwise_twins(backends):
    be = backends["Q4_K"]
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((7, 256)) * 3).astype(F32)
    w = rng.standard_normal(256).astype(F32)
    for width in (0, 8, 4, 1):
        want = ref.rms_norm(x, w, 1e-5)
        want = ref.lane_major(want, width) if width else want
        assert_same(want, be.to_host(be.launch_rms_norm(be.from_host(x), be.from_host(w), 1e-5, width)),
                    f"rms_norm width {width}")
    g2 = (rng.standard_normal((3, 512)) * 8).astype(F32)
    u2 = rng.standard_normal((3, 512)).astype(F32)
    assert_same(ref.lane_major(ref.silu_gate(g2, u2), 4),
                be.to_host(be.launch_silu_gate(be.from_host(g2), be.from_host(u2), 4)), "silu lane-major")
    # q8 outputs: the codes quantize_q8 writes for the fp32 result; an all-zero block (d = 0), subnormals,
    # a gate of -inf (SiLU gives NaN there: that block's d is NaN, bits 0x7fc00000, on both)
    from node.backend_cuda import Q8, Q8_OUT
    x[2, 32:64] = 0.0
    g2[1, 64:96] = np.float32(1e-44) * rng.integers(-5, 5, 32)
    g2[2, 130] = -np.inf
    for what, want, got in (
            ("rms_norm", ref.rms_norm(x, w, 1e-5),
             be.launch_rms_norm(be.from_host(x), be.from_host(w), 1e-5, Q8_OUT)),
            ("silu_gate", ref.silu_gate(g2, u2), be.launch_silu_gate(be.from_host(g2), be.from_host(u2), Q8_OUT))):
        for name, w8, g8 in zip("qda", ref.quantize_q8(want), got):
            assert_same(w8, be.to_host(g8).reshape(w8.shape), f"{what} q8 {name}")
    # the engine's RMSNorm before quantized products writes the codes itself
    assert isinstance(be.rms_norm(be.from_host(x), "blk.0.attn_norm.weight", ["blk.0.attn_q.weight"]), Q8)
    g = np.concatenate([rng.standard_normal(4000) * 30, [0.0, -0.0, 88.7, 89.0, -104.5, -103.9, 1e-40, -1e-40]])
    g = g.astype(F32)
    u = rng.standard_normal(g.size).astype(F32)
    assert_same(ref.silu_gate(g, u), be.to_host(be.launch_silu_gate(be.from_host(g), be.from_host(u))), "silu")
    assert_same(ref.residual_add(g, u), be.to_host(be.launch_residual_add(be.from_host(g), be.from_host(u))),
                "residual")
    logits = rng.standard_normal((3, 300)).astype(F32)
    logits[1, [7, 9]] = 50.0        # tie: lowest id wins
    idx, nan = be.launch_argmax(be.from_host(logits))
    assert be.to_host(idx).tolist() == [int(np.argmax(r)) for r in logits] and not be.to_host(nan).any()


@pytest.mark.parametrize("v", [300, 49152, 128256])
def test_sampler_twins(backends, v):
    """Seeded top-k/top-p on the device: sample_keys == node/sampler.py sample_keys
    bytes, and every row's token == node/sampler.py sample (ties, -0/+0, top_k
    0/1/40/past V, top_p 1/0.9/1e-6, three temperatures, random seeds and positions)."""
    from node.errors import NumericFault
    from node.sampler import SamplingParams, sample, sample_keys
    be = backends["Q4_K"]
    rng = np.random.default_rng(v)
    params = [SamplingParams(t, k, p, int(rng.integers(0, 2 ** 64, dtype=np.uint64)))
              for t in (0.3, 1.0, 1.7) for k in (0, 1, 40, v + 7) for p in (1.0, 0.9, 1e-6)]
    r = len(params)
    logits = (rng.standard_normal((r, v)) * rng.choice([0.5, 3.0, 20.0], (r, 1))).astype(F32)
    logits[::3, rng.integers(0, v, v // 4)] = logits[::3, :1]
    logits[1::4, :8], logits[1::4, 8:16] = 0.0, -0.0
    positions = rng.integers(0, 2 ** 20, r).tolist()
    temps = np.array([p.temperature for p in params], F32)
    keys, bad = be.launch_sample_keys(be.from_host(logits), be.from_host(temps))
    want_keys = np.stack([sample_keys(logits[i], params[i].temperature) for i in range(r)])
    assert_same(want_keys, be.to_host(keys), "sample_keys")
    assert not be.to_host(bad).any()
    got = be.to_host(be.sample(be.from_host(logits), params, positions)).tolist()
    assert got == [sample(logits[i], params[i], positions[i]) for i in range(r)]
    hot = logits[:2].copy()
    hot[1, 5] = 3e38
    with pytest.raises(NumericFault, match=r"^logits / temperature 1e-06 overflow fp32$"):
        be.sample(be.from_host(hot), [SamplingParams(1e-6, 0, 1.0, 1)] * 2, [0, 0])


def test_engine_draws_on_the_gpu_like_the_host(models):
    """Engine.sample on the CUDA backend (rows drawn from the last step's device
    logits: an eager prefill step, then graph-replayed decode steps; picks out of
    row order, two greedy, then a step of greedy rows only) gives
    node/sampler.py's ids for every row."""
    from node.sampler import SamplingParams, sample
    eng = Engine(models["Q8_0"], "cuda", pin=None, kv_pages=64)
    rng = np.random.default_rng(8)
    seqs = [eng.new_sequence() for _ in range(5)]
    outs = eng.forward([(s, rng.integers(0, 300, 9 + i).tolist()) for i, s in enumerate(seqs)])
    for step in range(4):
        params = [SamplingParams(0.5 + 0.3 * i, (0, 1, 7, 0, 50)[i], (1.0, 0.9, 0.5, 0.2, 1.0)[i], 1000 * step + i)
                  for i in range(5)]
        params[2] = params[4] = SamplingParams()
        if step == 3:
            params = [SamplingParams()] * 5
        picks = [(i, params[i], 20 + step) for i in range(5)][::-1]
        got = eng.sample(picks, outs)
        assert got == [sample(outs[r], p, pos) for r, p, pos in picks]
        outs = eng.forward([(s, [t]) for s, t in zip(seqs, got[::-1])])


def test_greedy_draws_on_the_gpu_take_the_lowest_id_among_maxima(models):
    """CudaBackend.sample_last's greedy rows (the argmax kernel) on crafted logits:
    ties between +0 and -0 and between equal maxima, a row of -inf, a maximum of
    +inf, the last id: numpy.argmax's ids, mixed with a seeded row."""
    from node.backend_cuda import CudaBackend
    from node.sampler import SamplingParams, sample
    be = CudaBackend(models["Q8_0"], pin=None, kv_pages=4)
    v = 1000
    rows = np.random.default_rng(3).standard_normal((6, v)).astype(np.float32)
    rows[0, :] = 0.0
    rows[0, :7] = -0.0
    rows[1, [5, 17, 900]] = 9.0
    rows[2, :] = -np.inf
    rows[3, [40, 41]] = np.inf
    rows[4, -1] = 50.0
    be._last = be.from_host(rows)
    params = [SamplingParams()] * 5 + [SamplingParams(0.7, 0, 1.0, 11)]
    order = [5, 3, 0, 4, 1, 2]
    got = be.sample_last(order, [params[r] for r in order], [9] * 6)
    assert got == [sample(rows[r], params[r], 9) for r in order]
    assert got[1:] == [40, 0, v - 1, 5, 0]


def test_attention_twin_multi_split(models):
    """RoPE, the KV store and paged split-KV attention for one sequence past two
    split boundaries; the output written row-major, lane-major and as q8 codes."""
    from node.backend_cuda import Q8_OUT, CudaBackend
    from node.rope_table import rope_table
    model = models["Q8_0"]
    hp = model.hparams
    be = CudaBackend(model, pin=None, kv_pages=16)
    rng = np.random.default_rng(9)
    n = 700
    k = rng.standard_normal((n, hp.n_head_kv, hp.head_dim)).astype(F32)
    v = rng.standard_normal((n, hp.n_head_kv, hp.head_dim)).astype(F32)
    q = (rng.standard_normal((n, hp.n_head, hp.head_dim)) * 3).astype(F32)
    be.kv_alloc(1)
    pos = np.arange(n)
    be.begin_step([(1, 0, n)], pos)
    cos, sin = rope_table(hp.head_dim, 1024, 10000.0)
    got = be.to_host(be.attend(0, *(be.from_host(a) for a in (q, k, v, cos[pos], sin[pos]))))
    qr, kr = ref.rope(q, cos[pos], sin[pos]), ref.rope(k, cos[pos], sin[pos])
    want = ref.attention(qr, kr.transpose(1, 0, 2), v.transpose(1, 0, 2), pos).reshape(n, -1)
    assert_same(want, got, "attention")
    for cache, want_kv in ((be.kp, kr), (be.vp, v)):   # the sequence's pages, in order
        got_kv = be.to_host(cache[0])[be._pages[1]].transpose(1, 0, 2, 3).reshape(hp.n_head_kv, -1, hp.head_dim)
        assert_same(want_kv.transpose(1, 0, 2), got_kv[:, :n], "roped keys and values in the KV cache")
    for width in (8, 4, 2):   # written lane-major for a float-weight output projection
        assert_same(ref.lane_major(want, width), be.to_host(be.launch_attention(be.from_host(qr), width)),
                    f"attention lane-major {width}")
    for name, w8, g8 in zip("qda", ref.quantize_q8(want), be.launch_attention(be.from_host(qr), Q8_OUT)):
        assert_same(w8, be.to_host(g8).reshape(w8.shape), f"attention q8 {name}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_golden_synthetic_on_gpu(tmp_path, qtype):
    """The golden digests, with the per-op kernels and (F16, BF16) with each step in one launch."""
    model = load_model(golden.synth_case(tmp_path, qtype))
    for one_launch in (False, True) if qtype in ("F16", "BF16") else (False,):
        eng = Engine(model, "cuda", pin=None, kv_pages=16, one_launch=one_launch)
        assert (eng.backend.step is not None) == one_launch
        assert golden.logits_sha(eng, golden.SYNTH_TOKENS) == golden.GOLDEN_SYNTH[qtype], one_launch


@pytest.mark.parametrize("qtype", sorted(golden.GOLDEN_SYNTH_CONTRACT2))
def test_golden_synthetic_contract2_on_gpu(tmp_path, qtype):
    """Contract 2's golden digests (docs/determinism.md section 14) on the per-op kernels."""
    model = load_model(golden.synth_case(tmp_path, qtype))
    eng = Engine(model, "cuda", pin=None, kv_pages=16, contract=2)
    assert golden.logits_sha(eng, golden.SYNTH_TOKENS) == golden.GOLDEN_SYNTH_CONTRACT2[qtype]


def rowint_inputs(rng, m, k):
    """fp32 [m, k] inputs for the contract-2 twins: scales over many binades, an
    all-zero row, signed zeros, subnormals, an outlier; with m > 4 a row holding a
    NaN and one holding -inf."""
    x = (rng.standard_normal((m, k)) * 10 ** rng.uniform(-30, 30, (m, 1))).astype(F32)
    x[0] = 0.0
    x[-1, :4] = [-0.0, 1e-40, -3e-39, 2.0 ** -149]
    x[-1, 5] = np.float32(6.5e4)
    if m > 4:
        x[1, 7], x[2, 9] = np.nan, -np.inf
    return x


@pytest.mark.parametrize("m", [1, 5, 8, 9, 17, 33])
def test_quantize_rowint_twin(backends_c2, m):
    from node.backend_cuda import pack_rowint_x
    be = backends_c2["BF16"]
    x = rowint_inputs(np.random.default_rng(m), m, 512)
    codes, s = ref.quantize_rowint(x, ref.X_CODE_BITS)
    px, sx = be.launch_quantize_rowint(be.from_host(x))
    assert_same(pack_rowint_x(codes), be.to_host(px), "codes")
    assert_same(s, be.to_host(sx), "exponents")


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("m", [1, 5, 8, 17, 33])
def test_matmul_rowint_twin(models, backends_c2, qtype, m):
    """Every float matrix shape of the model, alone and fused in one launch of two or three
    (the LM head's 300 rows, not a multiple of a cluster's 64, first of three), against
    reference.matmul_rowint; NaN and inf rows give NaN."""
    be, model = backends_c2[qtype], models[qtype]
    rng = np.random.default_rng(200 + m)
    for names in (("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"), ("blk.0.ffn_down.weight",),
                  ("output.weight", "blk.0.attn_k.weight", "blk.0.attn_q.weight")):
        x = rowint_inputs(rng, m, model.tensors[names[0]].cols)
        gots = be.launch_matmul_rowint(be.launch_quantize_rowint(be.from_host(x)), names)
        assert len(gots) == len(names)
        for name, got in zip(names, gots):
            codes, s = ref.quantize_rowint(float_values(model.tensors[name]), ref.W_CODE_BITS)
            want = ref.matmul_rowint(ref.quantize_rowint(x, ref.X_CODE_BITS), ref.RowintWeight(codes, s))
            got = be.to_host(got)
            nan = np.isnan(want)
            assert np.array_equal(nan, np.isnan(got)), name
            assert_same(np.where(nan, 0, want), np.where(nan, 0, got), name)   # NaN bits differ by device


@pytest.mark.parametrize("shape,tied", [("smollm2", False), ("smollm2", True), ("llama-1b", False),
                                        ("llama-8b", False)])
@pytest.mark.parametrize("qtype", ["BF16", "F16"])
def test_real_shapes_contract2_equal_reference(tmp_path, shape, tied, qtype):
    """Contract 2 at real model shapes (first 2 layers; SmolLM2 also with its LM head
    tied to the embeddings, as the real model has it): GPU bytes == numpy bytes."""
    model = load_model(write_model(str(tmp_path / "m.gguf"), shape, qtype, seed=4, n_layer=2, tied=tied))
    toks = list(np.random.default_rng(1).integers(0, model.hparams.n_vocab, 12))
    cpu = step_logits(Engine(model, "cpu", contract=2), toks, 3)
    gpu = step_logits(Engine(model, "cuda", pin=None, kv_pages=16, contract=2), toks, 3)
    assert_same(cpu, gpu, "logits, contract 2")


def step_logits(engine, toks, steps):
    """All prefill logits, then greedy decode logits, concatenated."""
    seq = engine.new_sequence()
    out = [engine.forward([(seq, toks)], all_logits=True)[0]]
    for _ in range(steps):
        t = int(np.argmax(out[-1][-1]))
        out.append(engine.forward([(seq, [t])], all_logits=True)[0])
    engine.release(seq)
    return np.concatenate(out)


@pytest.mark.parametrize("shape", ["smollm2", "llama-1b", "llama-8b"])
@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "Q4_K"])
def test_real_shapes_equal_reference(tmp_path, shape, qtype):
    """Real model shapes (first 2 layers) in BF16, Q8_0 and Q4_K: GPU bytes == numpy bytes
    (BF16 also with each step in one launch, where the shape fits it: 1B, 8B)."""
    model = load_model(write_model(str(tmp_path / "m.gguf"), shape, qtype, seed=4, n_layer=2))
    n = 4 if shape == "llama-8b" else 12
    toks = list(np.random.default_rng(1).integers(0, model.hparams.n_vocab, n))
    steps = 1 if shape == "llama-8b" else 3
    cpu = step_logits(Engine(model, "cpu"), toks, steps)
    for one_launch in (False, True) if qtype == "BF16" and shape != "smollm2" else (False,):
        gpu = step_logits(Engine(model, "cuda", pin=None, kv_pages=16, one_launch=one_launch), toks, steps)
        assert_same(cpu, gpu, f"logits, one launch {one_launch}")


@pytest.mark.parametrize("qtype, contract, one_launch", [("Q4_1", 1, False), ("BF16", 1, True), ("BF16", 1, False),
                                                        ("BF16", 2, False)])
def test_batches_1_to_64_chunked_and_prefix_reuse(models, qtype, contract, one_launch):
    """Random batches of 1..64 sequences, random prefill chunks, token-by-token
    prefill and prefix reuse: every target's logits equal its solo GPU and CPU bytes
    (Q4_1: the per-op kernels; BF16: the per-op kernels, or each step in one launch,
    cuda/step.cu, against the CPU for the first 4 sequences of a trial, whose numpy
    twin is slow, and against solo runs of the per-op kernels for the others; BF16
    under contract 2: the per-op kernels, all against the CPU)."""
    model = models[qtype]
    cpu_seqs = 4 if (qtype, contract) == ("BF16", 1) else 64
    rng = np.random.default_rng(77)
    gpu = Engine(model, "cuda", pin=None, kv_pages=1024, one_launch=one_launch, contract=contract)
    assert (gpu.backend.step is None) == (not one_launch)
    gpu_solo = Engine(model, "cuda", pin=None, kv_pages=8)   # BF16: the per-op kernels
    solo = {}
    for trial in range(12):
        n_seq = int(rng.integers(1, 65))
        prompts = [rng.integers(0, 300, int(rng.integers(1, 300))).tolist() for _ in range(n_seq)]
        seqs = [gpu.new_sequence() for _ in prompts]
        mode = trial % 3                      # 0 random chunks, 1 token by token, 2 prefix reuse
        if mode == 2:
            donor = gpu.new_sequence()
            gpu.forward([(donor, prompts[0])])
            k = int(rng.integers(0, len(prompts[0])))
            gpu.release(seqs[0])
            seqs[0] = gpu.fork(donor, k)
            gpu.release(donor)
            done = [k] + [0] * (n_seq - 1)
        else:
            done = [0] * n_seq
        got = [[] for _ in prompts]
        while any(d < len(p) for d, p in zip(done, prompts)):
            step, who = [], []
            for i in rng.permutation(n_seq):
                if done[i] < len(prompts[i]) and rng.random() < 0.8:
                    c = 1 if mode == 1 else int(rng.integers(1, 70))
                    step.append((seqs[i], prompts[i][done[i]:done[i] + c]))
                    who.append(i)
            if not step:
                continue
            for i, lg in zip(who, gpu.forward(step, all_logits=True)):
                got[i].append(lg)
                done[i] += lg.shape[0]
        for i in range(n_seq):
            gpu.release(seqs[i])
            tail = np.concatenate(got[i]) if got[i] else np.zeros((0, 300), F32)
            key = (tuple(prompts[i]), i < cpu_seqs)
            if key not in solo:
                e = Engine(model, "cpu", contract=contract) if i < cpu_seqs else gpu_solo
                s = e.new_sequence()
                solo[key] = e.forward([(s, prompts[i])], all_logits=True)[0]
                e.release(s)
            start = len(prompts[i]) - tail.shape[0]
            assert_same(solo[key][start:], tail, f"trial {trial} seq {i}")


@pytest.fixture(scope="module")
def default_model():
    return load_model(os.environ.get("BITEXACT_MODEL") or default_model_path())


@pytest.mark.default_model
@pytest.mark.parametrize("command", ["run", "serve"])
def test_cli_refuses_a_gpu_other_than_its_pin(default_model, tmp_path, command):
    """`run` and `serve` with --device cuda on a GPU other than --pin: exit 2, one error
    line naming the pin, nothing written; `run --pin ''` accepts this GPU and records it."""
    from test_attest import assert_input_error, bx

    from attest import envelope, keys
    assert bx(tmp_path, "keygen", "--out", "k.pem").returncode == 0
    args = {"run": ["--prompt", "hi", "--max-tokens", "1", "--attestation", "a.bxa"],
            "serve": ["--data-dir", "data"]}[command]
    p = bx(tmp_path, command, "--model", default_model.path, "--key", "k.pem", *args, "--device", "cuda",
           "--pin", "Some Other GPU", timeout=180)
    assert "Some Other GPU" in assert_input_error(p)
    assert sorted(os.listdir(tmp_path)) == ["k.pem", "k.pub.pem"]
    if command == "run":
        p = bx(tmp_path, "run", "--model", default_model.path, "--key", "k.pem", *args, "--device", "cuda",
               "--pin", "", timeout=180)
        assert p.returncode == 0, p.stderr
        with open(tmp_path / "a.bxa", "rb") as f:
            payload = envelope.open_envelope(f.read(), keys.load_public(str(tmp_path / "k.pub.pem")))
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        assert payload["backend"] == "cuda" and payload["device"]["gpu"] == props["name"].decode()


@pytest.mark.default_model
def test_cli_kernel_compile_failure_is_one_error_line(default_model, tmp_path):
    """A kernel source NVRTC cannot compile (a copy of the tree with cuda/rope.cu broken):
    `run --device cuda` exits 2 with one error line naming the file, and writes nothing."""
    import shutil

    from test_attest import REPO, assert_input_error, bx
    tree = tmp_path / "tree"
    for d in ("node", "attest", "verify", "cuda"):
        shutil.copytree(os.path.join(REPO, d), tree / d)
    rope = tree / "cuda" / "rope.cu"
    rope.write_text(rope.read_text() + "\n#error planted\n")
    work = tmp_path / "work"
    work.mkdir()
    assert bx(work, "keygen", "--out", "k.pem").returncode == 0
    env = {"PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}   # cubins of the broken tree: none cached
    p = bx(work, "run", "--model", default_model.path, "--key", "k.pem", "--prompt", "hi", "--max-tokens", "1",
           "--device", "cuda", "--pin", "", env=env, timeout=300)
    assert "NVRTC failed to compile cuda/rope.cu" in assert_input_error(p)
    assert sorted(os.listdir(work)) == ["k.pem", "k.pub.pem"]


@pytest.mark.default_model
def test_default_model_golden_on_gpu(default_model):
    from node.tokenizer import Tokenizer
    eng = Engine(default_model, "cuda", n_ctx=512, pin=None)   # the pin: test_gpu_pinned_and_recorded
    assert golden.default_output_digest(eng, Tokenizer(default_model)) == golden.GOLDEN_DEFAULT


@pytest.mark.default_model
def test_default_model_steps_equal_reference(default_model):
    toks = [1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 8524, 314]
    gpu = step_logits(Engine(default_model, "cuda", n_ctx=512, pin=None), toks, 6)
    cpu = step_logits(Engine(default_model, "cpu", n_ctx=512), toks, 6)
    assert_same(cpu, gpu, "logits")


@pytest.mark.default_model
def test_ten_thousand_runs_one_digest(default_model):
    """10,000 runs of one request over random batch compositions give one output digest."""
    from attest import digest
    rng = np.random.default_rng(2026)
    request = [1, 504, 3575, 282, 2914, 314]
    steps = 3
    eng = Engine(default_model, "cuda", n_ctx=512, kv_pages=512, pin=None)

    def run_wave(n_runs, n_others):
        kinds = ["run"] * n_runs + ["other"] * n_others
        rng.shuffle(kinds)
        seqs = [eng.new_sequence() for _ in kinds]
        prompts = [request if k == "run" else rng.integers(0, 49152, int(rng.integers(1, 40))).tolist()
                   for k in kinds]
        done = [0] * len(kinds)
        last = [None] * len(kinds)
        while any(d < len(p) for d, p in zip(done, prompts)):   # random chunked prefill
            step, who = [], []
            for i in rng.permutation(len(kinds)):
                if done[i] < len(prompts[i]):
                    c = int(rng.integers(1, 8))
                    step.append((seqs[i], prompts[i][done[i]:done[i] + c]))
                    who.append(i)
            for i, lg in zip(who, eng.forward(step)):
                done[i] = eng.length(seqs[i])
                last[i] = lg
        links = [digest.sha256(b"start")] * len(kinds)
        for _ in range(steps):
            toks = [int(np.argmax(lg)) for lg in last]
            links = [digest.chain_step(l_, t, digest.logits_digest(lg)) for l_, t, lg in zip(links, toks, last)]
            order = rng.permutation(len(kinds))
            outs = eng.forward([(seqs[i], [toks[i]]) for i in order])
            for i, lg in zip(order, outs):
                last[i] = lg
        for s in seqs:
            eng.release(s)
        return {links[i].hex() for i, k in enumerate(kinds) if k == "run"}

    digests, runs = set(), 0
    while runs < 10_000:
        n_runs = int(min(10_000 - runs, rng.integers(1, 49)))
        digests |= run_wave(n_runs, int(rng.integers(0, 17)))
        runs += n_runs
    assert len(digests) == 1
    cpu = Engine(default_model, "cpu", n_ctx=512)
    s = cpu.new_sequence()
    lg = cpu.forward([(s, request)])[0]
    link = digest.sha256(b"start")
    for _ in range(steps):
        t = int(np.argmax(lg))
        link = digest.chain_step(link, t, digest.logits_digest(lg))
        lg = cpu.forward([(s, [t])])[0]
    assert digests == {link.hex()}


@pytest.mark.parametrize("qtype, one_launch, contract", [("Q4_K", False, 1), ("BF16", False, 1), ("BF16", True, 1),
                                                         ("BF16", False, 2)])
def test_graph_replay_equals_eager(models, qtype, one_launch, contract):
    """Steps replayed through CUDA graphs (padded to their graph's tokens, logits rows
    and KV splits) equal eager launches: a prefill step, decode steps, and steps that
    mix decode tokens with another sequence's prompt chunk as it crosses a KV split
    (BF16 also with each step in one launch, a cooperative launch in the graph, and
    under contract 2)."""
    model = models[qtype]
    outs = []
    for graphs in (True, False):
        rng = np.random.default_rng(3)
        eng = Engine(model, "cuda", pin=None, kv_pages=64, graphs=graphs, one_launch=one_launch, contract=contract)
        seqs = [eng.new_sequence() for _ in range(5)]
        steps = [np.stack(eng.forward([(s, rng.integers(0, 300, 20 + 7 * i).tolist()) for i, s in enumerate(seqs)]))]
        late, prompt = eng.new_sequence(), rng.integers(0, 300, 290).tolist()
        for t in range(10):
            live = seqs[: 5 - t % 3]                     # 5, 4, 3 decode tokens
            chunk = [(late, prompt[40 * t:40 * t + 40])] if 40 * t < len(prompt) else []
            steps.append(np.stack(eng.forward([(s, [t + 1]) for s in live] + chunk)))
        if graphs:   # prefill, decode and mixed steps, one and two KV splits, all replayed
            assert {k[2] for k in eng.backend._graph_cache} == {1, 2} and eng.backend._entry is not None
        outs.append(steps)
    for a, b in zip(*outs):
        assert_same(b, a, "graph vs eager")


def test_the_graph_pool_takes_back_the_default_pool_s_free_blocks():
    """_malloc_no_retry with the device memory held as free blocks of CuPy's default
    pool: the allocation succeeds after they are given back; when live arrays hold
    it, it is an out-of-memory error at once."""
    import cupy as cp

    from node.backend_cuda import _malloc_no_retry
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    free = cp.cuda.runtime.memGetInfo()[0]
    want = free // 2
    big = cp.empty(free - (1 << 30), cp.uint8)   # all but 1 GiB, from the default pool
    with pytest.raises(cp.cuda.memory.OutOfMemoryError):
        _malloc_no_retry(want)                     # held by a live array: nothing to give back
    del big                                        # now a free block of the default pool
    assert pool.free_bytes() >= want
    mem = _malloc_no_retry(want)
    assert mem.mem.size >= want and pool.free_bytes() < want   # the freed block was given back
    del mem


def test_a_failed_graph_capture_keeps_no_graph(models):
    """A step whose CUDA graph capture fails half-way (out of GPU memory) is a GpuError
    and leaves no graph behind: the same step then captures again and gives the bytes
    of eager launches."""
    import cupy as cp

    from node.backend_cuda import GpuError
    model = models["Q8_0"]
    toks = list(range(1, 40))
    outs = []
    for graphs in (True, False):
        eng = Engine(model, "cuda", pin=None, kv_pages=8, graphs=graphs)
        s = eng.new_sequence()
        if graphs:
            real = eng._device_forward

            def failing(*a):
                if eng.backend.stream.is_capturing():
                    raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)
                return real(*a)
            eng._device_forward = failing
            with pytest.raises(GpuError, match="out of GPU memory"):
                eng.forward([(s, toks)])
            assert [e["graph"] for e in eng.backend._graph_cache.values()] == [None]
            eng._device_forward = real
        outs.append(eng.forward([(s, toks)])[0])
        if graphs:
            assert eng.backend._entry["graph"] is not None
    assert_same(outs[1], outs[0], "after a failed capture")


def test_out_of_memory_mid_step_fails_that_step_only(models, monkeypatch):
    """An out-of-memory error half-way through a step's launches (its allocations counted on
    a step of the same shape, then the middle one failed) is one GpuError for that step;
    a sequence that was in it and one that was not keep their lengths and KV cache: going
    on, both give the CPU engine's bytes."""
    import cupy
    from node.backend_cuda import GpuError
    model = models["Q8_0"]
    toks_a, toks_d, toks_b = list(range(1, 40)), list(range(50, 90)), list(range(100, 130))
    want_a, want_d = (step_logits(Engine(model, "cpu"), t, 3) for t in (toks_a, toks_d))
    eng = Engine(model, "cuda", pin=None, kv_pages=16, graphs=False)   # eager: each launch allocates
    real, calls, fail_at = cupy.empty, [0], [None]

    def counting(*args, **kw):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0)
        return real(*args, **kw)

    monkeypatch.setattr(cupy, "empty", counting)
    x, y = eng.new_sequence(), eng.new_sequence()   # the failing step's shape, counted
    eng.forward([(x, toks_a)])
    calls[0] = 0
    eng.forward([(x, [7]), (y, toks_b)])
    per_step = calls[0]
    eng.release(x)
    eng.release(y)
    a, d, b = eng.new_sequence(), eng.new_sequence(), eng.new_sequence()
    got_a = [eng.forward([(a, toks_a)], all_logits=True)[0]]
    got_d = [eng.forward([(d, toks_d)], all_logits=True)[0]]
    calls[0], fail_at[0] = 0, per_step // 2
    assert per_step >= 20, per_step
    with pytest.raises(GpuError, match="out of GPU memory"):
        eng.forward([(a, [int(np.argmax(got_a[-1][-1]))]), (b, toks_b)])
    assert calls[0] == per_step // 2
    assert (eng.length(a), eng.length(d)) == (len(toks_a), len(toks_d))
    monkeypatch.undo()
    eng.release(b)
    for _ in range(3):
        la, ld = eng.forward([(a, [int(np.argmax(got_a[-1][-1]))]), (d, [int(np.argmax(got_d[-1][-1]))])],
                             all_logits=True)
        got_a.append(la)
        got_d.append(ld)
    assert_same(want_a, np.concatenate(got_a), "the failed step's sequence")
    assert_same(want_d, np.concatenate(got_d), "the sequence beside it")


def test_kv_out_of_pages_fails_cleanly(models):
    """A step that cannot get KV pages fails before computing; other sequences are intact."""
    from node.backend_cuda import GpuError
    model = models["Q8_0"]
    toks = list(range(1, 200))
    want = step_logits(Engine(model, "cpu"), toks, 4)
    eng = Engine(model, "cuda", pin=None, kv_pages=3)       # page 0 is scratch: 2 usable pages
    a = eng.new_sequence()
    first = eng.forward([(a, toks)], all_logits=True)[0]
    b = eng.new_sequence()
    with pytest.raises(GpuError, match="KV cache full"):
        eng.forward([(b, [i % 300 for i in range(600)])])
    eng.release(b)
    got = [first]
    for _ in range(4):
        t = int(np.argmax(got[-1][-1]))
        got.append(eng.forward([(a, [t])], all_logits=True)[0])
    assert_same(want, np.concatenate(got), "after failed step")
