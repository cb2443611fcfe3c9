"""The reference twins follow docs/determinism.md exactly, and compute the right values."""

import numpy as np
import pytest

from node import reference as ref
from node.fmath import exp32, ln64, sincos64
from node.gguf_model import decode_blocks
from node.rope_table import rope_table
from node.sampler import SamplingParams, philox4x32, sample, uniform

F32 = np.float32
rng = np.random.default_rng(1234)


def scalar_warp_sum(terms, g=None, n_lanes=32):
    """Independent scalar emulation of the contract's warp_sum (lanes, then xor-butterfly);
    with ``g`` and ``n_lanes``, the subtree of that many lanes of g terms."""
    n = len(terms)
    g = max(1, -(-n // 32)) if g is None else g
    lanes = []
    for lane in range(n_lanes):
        acc = F32(0.0)
        for i in range(lane * g, min(n, lane * g + g)):
            acc = F32(acc + F32(terms[i]))
        lanes.append(acc)
    off = 1
    while off < n_lanes:
        lanes = [F32(lanes[i] + lanes[i ^ off]) for i in range(n_lanes)]
        off *= 2
    assert len(set(v.tobytes() for v in lanes)) == 1  # every lane holds the same value
    return lanes[0]


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 100, 576, 1000])
def test_warp_sum_matches_scalar_emulation(n):
    t = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(F32)
    assert ref.warp_sum(t).tobytes() == scalar_warp_sum(t).tobytes()


@pytest.mark.parametrize("lanes,g,n", [(32, 3, 71), (32, 8, 256), (16, 5, 1), (8, 4, 31), (4, 7, 28), (2, 3, 5),
                                       (1, 6, 5), (32, 1, 18)])
def test_subtree_sum_on_any_axis_matches_scalar_emulation(lanes, g, n):
    """Full lanes, one partial lane and empty lanes; signed zeros and subnormal terms;
    the summed axis first, in the middle or last, in strided views."""
    t = (rng.standard_normal((3, n, 2)) * 10 ** rng.uniform(-42, 3, (3, n, 2))).astype(F32)
    t[0, ::3, 0], t[1, ::4, 1] = -0.0, 0.0
    want = np.array([[scalar_warp_sum(t[i, :, j], g, lanes) for j in range(2)] for i in range(3)], F32)
    strided = np.zeros((3, 2 * n, 2), F32)[:, ::2]
    strided[...] = t
    for axis, a in ((1, t), (0, t.transpose(1, 0, 2)), (2, t.transpose(0, 2, 1)), (1, strided)):
        assert ref.subtree_sum(a, g, lanes, axis).tobytes() == want.tobytes(), f"axis {axis}"
    # lanes start at +0.0, so terms that are all -0.0 sum to +0.0
    assert ref.subtree_sum(np.full((2, n), -0.0, F32), g, lanes).tobytes() == np.zeros(2, F32).tobytes()


def test_warp_sum_order_is_observable():
    """The tree differs from a left-to-right sum on cancelling inputs, so the order matters."""
    t = np.array([1e8, 1.0, -1e8, 1.0] * 16, F32)
    seq = F32(0)
    for v in t:
        seq = F32(seq + v)
    assert ref.warp_sum(t) != seq


@pytest.mark.parametrize("k,esize,v", [(4096, 2, 8), (4096, 4, 4), (576, 2, 2), (96, 2, 1), (14336, 2, 8)])
def test_lane_major_gives_each_lane_its_segment_in_order(k, esize, v):
    """Reading chunk j*32+l for j = 0, 1, ... gives lane l exactly k = l*g .. l*g+g-1, ascending."""
    assert ref.lane_width(k, esize) == v
    g = k // 32
    b = ref.lane_major(np.arange(2 * k).reshape(2, k), v)
    for lane in range(32):
        got = np.concatenate([b[1, (j * 32 + lane) * v:(j * 32 + lane + 1) * v] for j in range(g // v)])
        assert got.tolist() == list(range(k + lane * g, k + (lane + 1) * g))
    with pytest.raises(ValueError, match="K % 32"):
        ref.lane_width(100, 2)


def test_exp32_accuracy_and_specials():
    x = np.linspace(-87, 88.7, 1_000_001).astype(F32)
    y = exp32(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - want) / want) < 2.5 * 2.0 ** -24 * 2  # under 2.5 ulp
    sp = exp32(np.array([0.0, -0.0, 100.0, -200.0, np.inf, -np.inf], F32))
    assert sp.tolist() == [1.0, 1.0, np.inf, 0.0, np.inf, 0.0]
    assert np.isnan(exp32(np.array([np.nan], F32)))[0]
    sub = exp32(np.array([-100.0], F32))[0]
    assert 0 < sub < np.finfo(F32).tiny  # subnormal result, not flushed
    assert abs(float(sub) - np.exp(-100.0)) <= 2.0 ** -149  # within one subnormal ulp


def test_host_math():
    for x in (2.0, 10000.0, 100000.0, 500000.0, 0.37):
        assert abs(ln64(x) - np.log(x)) < 4e-15 * max(1, abs(np.log(x)))
    t = np.linspace(-10000, 10000, 100001)
    s, c = sincos64(t)
    assert np.abs(s - np.sin(t)).max() < 1e-12 and np.abs(c - np.cos(t)).max() < 1e-12
    cos, sin = rope_table(64, 4096, 100000.0)
    i = np.arange(32)
    th = np.arange(4096)[:, None] * 100000.0 ** (-2 * i / 64)
    assert np.abs(cos - np.cos(th)).max() < 1e-7 and np.abs(sin - np.sin(th)).max() < 1e-7


def test_quantize_q8():
    x = (rng.standard_normal((3, 128)) * 5).astype(F32)
    x[1, :32] = 0.0
    q, d, a = ref.quantize_q8(x)
    assert q.dtype == np.int8 and np.abs(q).max() <= 127
    assert (d[1, 0] == 0) and not q[1, 0].any()
    assert np.array_equal(d, (np.abs(x.reshape(3, 4, 32)).max(-1) / F32(127)))
    err = np.abs(q * d[..., None] - x.reshape(3, 4, 32))
    assert (err <= d[..., None] * 0.5000001).all()
    assert np.array_equal(a, q.astype(np.int32).sum(-1))


def test_quantize_q8_gives_a_non_finite_block_a_nan_scale():
    """A block holding a NaN, +inf or -inf: d = NaN with the bits 0x7fc00000 (what the CUDA
    twin writes), codes and code sum 0, no numpy warning; the other blocks are as before,
    and a product of such a block is NaN (a fault)."""
    import warnings
    x = (rng.standard_normal((3, 128)) * 5).astype(F32)
    clean = ref.quantize_q8(x)
    x[0, 40], x[1, 0], x[2, 127] = np.nan, np.inf, -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, d, a = ref.quantize_q8(x)
    bad = [(0, 1), (1, 0), (2, 3)]
    for m, b in bad:
        assert d[m, b].view(np.uint32) == 0x7fc00000 and not q[m, b].any() and a[m, b] == 0
    keep = np.ones(d.shape, bool)
    keep[tuple(zip(*bad))] = False
    for got, want in zip((q, d, a), clean):
        assert got[keep].tobytes() == want[keep].tobytes()
    w = ref.RefQuantWeight(np.ones((2, 4, 32), np.int8), np.ones((2, 4), F32), None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isnan(ref.matmul_q((q, d, a), w)).all()


@pytest.mark.parametrize("qtype,bb,be", [("Q8_0", 34, 32), ("Q4_0", 18, 32), ("Q4_1", 20, 32),
                                         ("Q4_K", 144, 256), ("Q6_K", 210, 256)])
def test_matmul_q_close_to_float64(qtype, bb, be):
    from node.synth import _quant_rows
    n, k, m = 40, 512, 3
    raw = _quant_rows(np.random.default_rng(2), qtype, n, k, 1.0)
    codes, scale, offset = decode_blocks(qtype, raw)
    w64 = scale[..., None].astype(np.float64) * codes
    if offset is not None:
        w64 = w64 + offset[..., None]
    w64 = w64.reshape(n, k)
    x = rng.standard_normal((m, k)).astype(F32)
    xq = ref.quantize_q8(x)
    y = ref.matmul_q(xq, ref.RefQuantWeight(codes, scale, offset))
    xdq = (xq[0].astype(np.float64) * xq[1][..., None]).reshape(m, k)
    want = xdq @ w64.T
    assert np.allclose(y, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    # and the activation quantization error against the unquantized product is small
    assert np.abs(y - x.astype(np.float64) @ w64.T).max() < 0.02 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_pack_q_records_give_each_thread_its_fragments(qtype):
    """Reading pack_q's records as cuda/matmul.cu does (thread 4 * gid + c: rows
    gid and gid + 8, elements 8c .. 8c + 7, then the scale words) gives back the
    reference decoder's codes, scales and offsets, for a shard of blocks
    starting inside a super-block and rows that do not fill the last tile."""
    from node.backend_cuda import mq_record_bytes, pack_q
    from node.synth import _quant_rows
    n, k = 37, 1024
    raw = _quant_rows(np.random.default_rng(3), qtype, n, k, 1.0)
    codes, scale, offset = decode_blocks(qtype, raw)
    b_off, terms = 3, 17
    rec = pack_q(np, qtype, raw, b_off, terms)
    r = mq_record_bytes(qtype)
    assert rec.shape == (3, terms, r) and rec.dtype == np.uint8
    got_codes = np.zeros((48, terms, 32), np.int32)
    got_words = np.zeros((48, terms, 2), np.uint32)
    for lane in range(32):
        gid, c = lane >> 2, lane & 3
        rows = [gid, gid + 8]
        if r == 384:
            p = rec[:, :, 8 * lane:8 * lane + 8].astype(np.int32)
            for half in range(2):
                for j in range(4):
                    byte = p[:, :, 4 * half + j]
                    bias = 8 if qtype == "Q4_0" else 0
                    got_codes[rows[half]::16, :, 8 * c + j] = (byte & 15) - bias
                    got_codes[rows[half]::16, :, 8 * c + 4 + j] = (byte >> 4) - bias
        else:
            p = rec[:, :, 16 * lane:16 * lane + 16].view(np.int8).astype(np.int32)
            for h in range(2):
                for half in range(2):
                    got_codes[rows[half]::16, :, 8 * c + 4 * h:8 * c + 4 * h + 4] = p[:, :, 8 * h + 4 * half:][..., :4]
        words = np.ascontiguousarray(rec[:, :, r - 128 + 16 * gid:r - 112 + 16 * gid]).view(np.uint32)
        for half in range(2):
            got_words[rows[half]::16, :, 0] = words[..., half]
            got_words[rows[half]::16, :, 1] = words[..., 2 + half]
    part = slice(b_off, b_off + terms)
    assert not got_codes[n:].any() and not got_words[n:].any()      # rows past N: zero
    assert np.array_equal(got_words[:n, :, 0].view(np.float32), scale[:, part])
    if qtype == "Q6_K":   # int16 sub-block scales of elements 0..15 (low) and 16..31 (high)
        sub = got_words[:n, :, 1]
        lo, hi = (sub & 0xFFFF).astype(np.uint16).view(np.int16), (sub >> 16).astype(np.uint16).view(np.int16)
        got = got_codes[:n] * np.repeat(np.stack([lo, hi], -1), 16, axis=-1)
        assert np.array_equal(got, codes[:, part])
    else:
        assert np.array_equal(got_codes[:n], codes[:, part])
        want = offset[:, part] if offset is not None else np.zeros((n, terms), np.float32)
        assert got_words[:n, :, 1].tobytes() == want.view(np.uint32).tobytes()


def test_block_decoders_refuse_float_types():
    from node.errors import ModelError
    for qtype in ("F32", "BF16", "Q5_K"):
        with pytest.raises(ModelError, match="not a quantized type"):
            decode_blocks(qtype, np.zeros((1, 34), np.uint8))


def test_matmul_f_and_rms_norm_close_to_float64():
    x = rng.standard_normal((4, 300)).astype(F32)
    w = rng.standard_normal((50, 300)).astype(F32)
    assert np.allclose(ref.matmul_f(x, w), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)
    g = rng.standard_normal(300).astype(F32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g
    assert np.allclose(ref.rms_norm(x, g, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_attention_close_to_float64_softmax():
    hkv, h, hd, p = 2, 4, 16, 600          # 600 positions: three KV splits
    k = rng.standard_normal((hkv, p, hd)).astype(F32)
    v = rng.standard_normal((hkv, p, hd)).astype(F32)
    pos = np.array([0, 255, 256, 599])
    q = (rng.standard_normal((4, h, hd)) * 2).astype(F32)
    out = ref.attention(q, k, v, pos)
    for t, pp in enumerate(pos):
        for hh in range(h):
            kv = hh // (h // hkv)
            s = (k[kv, :pp + 1].astype(np.float64) @ q[t, hh]) / np.sqrt(hd)
            e = np.exp(s - s.max())
            want = (e / e.sum()) @ v[kv, :pp + 1]
            assert np.allclose(out[t, hh], want, rtol=1e-4, atol=1e-5)


def _lane_tree(terms: np.ndarray, g: int) -> np.ndarray:
    """docs/determinism.md section 3 written out: lane l adds terms l*g .. l*g+g-1
    (axis 0) onto +0.0 one by one, then lanes meet neighbours first."""
    lanes = []
    for l in range(32):
        acc = np.zeros(terms.shape[1:], F32)
        for j in range(l * g, min(l * g + g, terms.shape[0])):
            acc = acc + terms[j]
        lanes.append(acc)
    while len(lanes) > 1:
        lanes = [lanes[i] + lanes[i + 1] for i in range(0, len(lanes), 2)]
    return lanes[0]


def _attention_as_written(q, k, v, p, kv):
    """One query head ``q`` fp32 ``[hd]`` at position ``p`` over KV head ``kv``, by
    docs/determinism.md section 8 step by step."""
    from node.fmath import exp32
    hd = q.shape[0]
    scale = F32(1.0) / np.sqrt(F32(hd))
    ms, ls, os_ = [], [], []
    for c in range(p // 256 + 1):
        slots = np.arange(256 * c, 256 * c + 256)
        live = slots <= p
        kk = np.where(live[:, None], k[kv, np.minimum(slots, p)], F32(0.0))
        s = _lane_tree((q[None, :] * kk).T, max(1, -(-hd // 32))) * scale
        m = np.max(s[live])
        e = np.where(live, exp32(np.where(live, s - m, F32(0.0))), F32(0.0))
        vv = np.where(live[:, None], v[kv, np.minimum(slots, p)], F32(0.0))
        ms.append(m)
        ls.append(_lane_tree(e, 8))
        os_.append(_lane_tree(e[:, None] * vv, 8))
    big_m = max(ms)
    big_l, big_o = F32(0.0), np.zeros(hd, F32)
    for m, l_c, o_c in zip(ms, ls, os_):
        w = exp32(np.asarray(m - big_m, F32))
        big_l = big_l + l_c * w
        big_o = big_o + o_c * w
    return big_o / big_l


def test_attention_bytes_are_the_contract_as_written():
    """node/reference.py attention == section 8 of the contract followed literally, byte
    for byte: three KV splits, queries in any order, positions at split edges, signed
    zeros in K and V, scores far enough apart that exp32 gives +0, and passes of several
    queries (the reference leaves out slots masked for a whole pass)."""
    r = np.random.default_rng(21)
    hkv, h, hd, p = 2, 4, 40, 600
    k = r.standard_normal((hkv, p, hd)).astype(F32)
    v = r.standard_normal((hkv, p, hd)).astype(F32)
    k[:, 5], v[:, 6] = -0.0, -0.0
    k[:, 300:310] *= F32(40.0)               # far-off scores: exp32 underflows to +0 in their split
    edges = [599, 0, 255, 256, 3, 511, 512, 300, 598, 257]
    pos = np.concatenate([edges, r.integers(0, p, 40)])   # 50 queries: more than one pass
    q = (r.standard_normal((pos.size, h, hd)) * 2).astype(F32)
    out = ref.attention(q, k, v, pos)
    for t, pp in enumerate(pos):
        assert out[t].tobytes() == ref.attention(q[t:t + 1], k, v, pos[t:t + 1])[0].tobytes()
        for hh in range(h):
            want = _attention_as_written(q[t, hh], k, v, int(pp), hh // (h // hkv))
            assert out[t, hh].tobytes() == want.tobytes(), (pp, hh)


def test_philox_known_answers():
    """Random123 known-answer vectors for philox4x32-10."""
    assert philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_uniform_open_interval():
    us = np.array([uniform(s, p) for s in range(20) for p in range(200)])
    assert us.dtype == F32 and (us > 0).all() and (us < 1).all()
    assert abs(us.mean() - 0.5) < 0.02
    assert F32(2 * (0 >> 9) + 1) * F32(2.0 ** -24) == F32(2.0 ** -24)
    assert F32(2 * (0xFFFFFFFF >> 9) + 1) * F32(2.0 ** -24) == F32(1 - 2.0 ** -24)


def test_sample_keys_order_z_descending_then_id():
    """Ascending sample_keys == numpy's lexsort by (z descending, id ascending), with
    ties, -0 beside +0, and signs mixed; a non-finite z is a fault."""
    from node.errors import NumericFault
    from node.sampler import sample_keys
    r = np.random.default_rng(11)
    for t in (0.5, 1.0, 3.0):
        lg = (r.standard_normal(4000) * 10).astype(F32)
        lg[r.integers(0, 4000, 1000)] = lg[7]
        lg[:20], lg[20:40] = -0.0, 0.0
        z = lg / F32(t)
        order = (np.sort(sample_keys(lg, t)) & np.uint64(0xFFFFFFFF)).astype(np.int64)
        assert order.tolist() == np.lexsort((np.arange(z.size), -z)).tolist()
    with pytest.raises(NumericFault):
        sample_keys(np.array([1.0, 3e38], F32), 1e-6)


def test_top_k_by_partition_equals_the_full_sort():
    """sample() takes the top_k smallest keys by partition; the draw equals the one
    over the fully sorted keys, ties and all."""
    from node.sampler import sample_keys, sample_sorted
    r = np.random.default_rng(12)
    for i in range(300):
        lg = (r.standard_normal(int(r.integers(2, 3000))) * 4).astype(F32)
        lg[r.integers(0, lg.size, lg.size // 3)] = lg[0]
        p = SamplingParams(float(r.choice([0.3, 1.0, 2.0])), int(r.integers(1, lg.size + 3)),
                           float(r.choice([1.0, 0.8, 1e-6])), i)
        full = sample_sorted(lg, np.sort(sample_keys(lg, p.temperature)), p, i)
        assert sample(lg, p, i) == full


def test_greedy_ties_lowest_id():
    lg = np.array([1.0, 3.0, 2.0, 3.0], F32)
    assert sample(lg, SamplingParams(), 0) == 1


def test_seeded_sampling():
    lg = rng.standard_normal(1000).astype(F32)
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=42)
    draws = [sample(lg, p, pos) for pos in range(300)]
    assert draws == [sample(lg, p, pos) for pos in range(300)]              # reproducible
    assert draws != [sample(lg, SamplingParams(0.8, 50, 0.9, 43), pos) for pos in range(300)]
    assert len(set(draws)) > 5
    top = set(np.argsort(-lg, kind="stable")[:50].tolist())
    assert set(draws) <= top
    assert all(sample(lg, SamplingParams(0.8, 1, 1.0, 1), pos) == int(np.argmax(lg)) for pos in range(20))
    assert all(sample(lg, SamplingParams(0.8, 0, 1e-6, 1), pos) == int(np.argmax(lg)) for pos in range(20))


def test_sampling_distribution_matches_softmax():
    lg = np.array([2.0, 1.0, 0.0, -1.0], F32)
    p = SamplingParams(temperature=1.0, seed=7)
    counts = np.bincount([sample(lg, p, pos) for pos in range(20000)], minlength=4)
    want = np.exp(lg) / np.exp(lg).sum()
    assert np.allclose(counts / counts.sum(), want, atol=0.015)


@pytest.mark.parametrize("bad", [SamplingParams(temperature=-0.1), SamplingParams(top_p=0.0),
                                 SamplingParams(top_p=1.5), SamplingParams(top_k=-1),
                                 SamplingParams(temperature=float("nan")), SamplingParams(seed=-1),
                                 SamplingParams(temperature=1e-45), SamplingParams(temperature=101.0),
                                 SamplingParams(top_k=2 ** 31)])
def test_sampling_params_rejected(bad):
    from node.errors import RequestError
    with pytest.raises(RequestError):
        bad.validate()


def test_logits_over_temperature_overflow_is_a_fault():
    from node.errors import NumericFault
    with pytest.raises(NumericFault, match="overflow"):
        sample(np.array([3e38, 1.0, -2.0], np.float32), SamplingParams(temperature=1e-6, seed=1), 0)

