"""Contract 2 (docs/determinism.md section 14): float-weight products in exact integers.

The numpy twins (node/reference.py quantize_rowint, matmul_rowint) against exact
rational arithmetic, the GPU layouts (node/backend_cuda.py pack_rowint_w,
pack_rowint_x) against the PTX operand layouts of wgmma, the engine's batch independence
and refusals, and the attested contract version end to end (run, verify, a
forged version). The CUDA kernels are checked against these twins by
tests/test_gpu.py.
"""

import json
import os
from fractions import Fraction

import numpy as np
import pytest

from attest import envelope, keys
from node import reference as ref
from node.backend_cuda import pack_rowint_w, pack_rowint_x
from node.engine import Engine
from attest.envelope import AttestationError
from node.errors import ModelError, RequestError
from node.gguf_model import default_model_path, load_model
from node.synth import copy_model, write_model
from test_attest import assert_input_error, bx, sign_raw

F32 = np.float32


def _inputs(rng, m, k):
    x = rng.standard_normal((m, k)).astype(F32)
    x[0, :] = 0.0                                   # an all-zero row
    x[1, :3] = [1e-40, -3e-39, 2.0 ** -149]         # subnormals
    x[2, 5] = np.float32(6.5e4)                     # an outlier
    x[3] = np.float32(2.0 ** -140) * np.sign(x[3])  # a row of subnormals only
    return x


@pytest.mark.parametrize("bits", [ref.W_CODE_BITS, ref.X_CODE_BITS])
def test_codes_are_the_rounded_scaled_values_within_their_bound(bits):
    a = _inputs(np.random.default_rng(1), 6, 64)
    c, s = ref.quantize_rowint(a, bits)
    assert c.dtype == np.int32 and s.dtype == np.int32
    assert np.max(np.abs(c)) <= 2 ** (bits + 1) and s[0] == 0 and not c[0].any()
    for r in range(1, 6):
        amax = max(abs(Fraction(float(v))) for v in a[r])
        e = int(s[r]) + bits   # floor(log2(max |a|))
        assert Fraction(2) ** e <= amax < Fraction(2) ** (e + 1), r
        for v, code in zip(a[r], c[r]):
            exact = Fraction(float(v)) / Fraction(2) ** int(s[r])
            assert abs(exact - int(code)) <= Fraction(1, 2)
            if abs(exact - int(code)) == Fraction(1, 2):
                assert int(code) % 2 == 0   # ties to even


def test_the_product_is_the_exact_integer_scaled_and_rounded_once():
    rng = np.random.default_rng(2)
    x, w = _inputs(rng, 5, 96), rng.standard_normal((7, 96)).astype(F32)
    w[2] = 0.0
    xr = ref.quantize_rowint(x, ref.X_CODE_BITS)
    wr = ref.RowintWeight(*ref.quantize_rowint(w, ref.W_CODE_BITS))
    y = ref.matmul_rowint(xr, wr)
    assert y.dtype == F32 and y.shape == (5, 7)
    for m in range(5):
        for n in range(7):
            exact = sum(int(a) * int(b) for a, b in zip(xr[0][m], wr.codes[n]))
            value = Fraction(exact) * Fraction(2) ** int(xr[1][m] + wr.s[n])
            assert abs(exact) < 2 ** 53   # so exact -> double is exact, and double -> fp32 the one rounding
            assert y[m, n].tobytes() == np.float32(float(value)).tobytes(), (m, n)   # +0.0, never -0.0


def test_the_product_does_not_depend_on_the_order_of_k():
    """Integer sums: any permutation of K (what a split or tile does) gives the same bytes,
    which a float sum of these terms would not (checked below on the same data)."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((4, 4096)).astype(F32), rng.standard_normal((8, 4096)).astype(F32)
    perm = rng.permutation(4096)

    def product(xx, ww):
        return ref.matmul_rowint(ref.quantize_rowint(xx, ref.X_CODE_BITS),
                                 ref.RowintWeight(*ref.quantize_rowint(ww, ref.W_CODE_BITS)))
    assert product(x, w).tobytes() == product(x[:, perm], w[:, perm]).tobytes()
    t = x[0] * w[0]
    assert np.cumsum(t, dtype=F32)[-1] != np.cumsum(t[perm], dtype=F32)[-1]


def test_a_row_that_is_not_finite_faults_only_its_own_outputs():
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((4, 64)).astype(F32), rng.standard_normal((5, 64)).astype(F32)
    x[1, 3], x[2, 60] = np.nan, -np.inf
    w[4, 0] = np.inf
    xr, (cw, sw) = ref.quantize_rowint(x, ref.X_CODE_BITS), ref.quantize_rowint(w, ref.W_CODE_BITS)
    assert xr[1].tolist()[1:3] == [ref.ROWINT_NONFINITE] * 2 and not xr[0][1:3].any()
    assert sw[4] == ref.ROWINT_NONFINITE and not cw[4].any()
    y = ref.matmul_rowint(xr, ref.RowintWeight(cw, sw))
    bad = np.zeros(y.shape, bool)
    bad[1:3], bad[:, 4] = True, True
    assert np.array_equal(np.isnan(y), bad)


def test_k_of_2_16_or_more_is_refused():
    x = np.zeros((1, ref.MAX_ROWINT_K), F32)
    with pytest.raises(ValueError, match="K < 65536"):
        ref.matmul_rowint(ref.quantize_rowint(x, ref.X_CODE_BITS),
                          ref.RowintWeight(*ref.quantize_rowint(x, ref.W_CODE_BITS)))


def test_weight_layout_is_wgmma_k_major_core_matrices():
    """PTX ISA, wgmma shared-memory layout of a K-major operand without swizzle: per
    64-row group, k-step and slice, core matrices of 8 rows x 16 bytes, row group
    r // 8 at byte 256 (r // 8), the k-half at 128, row r % 8 at 16 (r % 8), element
    e % 16 at e % 16; N = 70 pads the second group with zeros."""
    rng = np.random.default_rng(4)
    codes = rng.integers(-2 ** 13, 2 ** 13 + 1, size=(70, 64)).astype(np.int32)
    p = pack_rowint_w(np, codes)
    assert p.shape == (2, 2, 2, 2048) and p.dtype == np.uint8
    c = np.zeros((128, 64), np.int32)
    c[:70] = codes
    for s, sl in enumerate((c & 127, c >> 7)):
        assert sl.min() >= -64 and sl.max() <= 127
        for g in range(2):
            for kk in range(2):
                for r in range(64):
                    for e in range(32):
                        at = 256 * (r // 8) + 128 * (e // 16) + 16 * (r % 8) + e % 16
                        assert p[g, kk, s, at] == sl[64 * g + r, 32 * kk + e] & 0xFF
    assert np.array_equal((c >> 7) * 128 + (c & 127), c)


def test_input_layout_is_wgmma_k_major_core_matrices():
    """PTX ISA, wgmma shared-memory layout of a K-major operand without swizzle: per
    8-token tile, k-step and slice, core matrices of 8 tokens x 16 bytes, the k-half h at
    byte 128 h, token t at 16 t, element e at e; tokens past M (11) zero."""
    rng = np.random.default_rng(5)
    codes = rng.integers(-2 ** 20, 2 ** 20 + 1, size=(11, 64)).astype(np.int32)
    p = pack_rowint_x(codes)
    assert p.shape == (2, 2, 3, 256) and p.dtype == np.uint8
    for s, sl in enumerate((codes & 127, (codes >> 7) & 127, codes >> 14)):
        for tt in range(2):
            for kk in range(2):
                for h in range(2):
                    for t in range(8):
                        for e in range(16):
                            tok, col = tt * 8 + t, kk * 32 + 16 * h + e
                            want = sl[tok, col] & 0xFF if tok < 11 else 0
                            assert p[tt, kk, s, 128 * h + 16 * t + e] == want
    assert np.array_equal((codes >> 14) * 2 ** 14 + ((codes >> 7) & 127) * 128 + (codes & 127), codes)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return load_model(write_model(str(tmp_path_factory.mktemp("c2") / "bf16.gguf"), "tiny", "BF16", seed=11))


def _all_logits(engine, chunks_of):
    """Logits of every token of each prompt in ``chunks_of`` (a list of chunk lists),
    fed one step per chunk index with all prompts' chunks of that index in one step."""
    seqs = [engine.new_sequence() for _ in chunks_of]
    out = [[] for _ in chunks_of]
    for i in range(max(len(c) for c in chunks_of)):
        step = [(s, c[i]) for s, c in zip(seqs, chunks_of) if i < len(c)]
        who = [j for j, c in enumerate(chunks_of) if i < len(c)]
        for j, lg in zip(who, engine.forward(step, all_logits=True)):
            out[j].append(lg)
    return [np.concatenate(o) for o in out]


def test_contract2_bytes_do_not_depend_on_batch_chunks_or_weight_budget(bf16):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, n).tolist() for n in (13, 5, 21)]
    solo = [_all_logits(Engine(bf16, contract=2), [[p]])[0] for p in prompts]
    batched = _all_logits(Engine(bf16, contract=2), [[c for c in (p[:4], p[4:9], p[9:]) if c] for p in prompts])
    one_by_one = _all_logits(Engine(bf16, contract=2), [[[t] for t in p] for p in prompts])
    from node.backend_cpu import CpuBackend
    chunked = Engine(bf16, contract=2)
    chunked.backend = CpuBackend(bf16, weight_cache=0, contract=2)   # every matrix decoded row chunk by chunk
    streamed = _all_logits(chunked, [[p] for p in prompts])
    for s, b, o, c in zip(solo, batched, one_by_one, streamed):
        assert s.tobytes() == b.tobytes() == o.tobytes() == c.tobytes()


def test_contract2_is_another_contract_close_to_float64(bf16, monkeypatch):
    """Contract 2 changes the bytes (so it is attested) and stays close to the float64
    forward pass (node/reference.py matmul_f replaced by float64 products rounded once)."""
    toks = list(range(1, 30))
    one, two = (_all_logits(Engine(bf16, contract=c), [[toks]])[0] for c in (1, 2))
    monkeypatch.setattr(ref, "matmul_f", lambda x, w, *a: (x.astype(np.float64) @ w.astype(np.float64).T).astype(F32))
    f64 = _all_logits(Engine(bf16, contract=1), [[toks]])[0]
    assert one.tobytes() != two.tobytes() != f64.tobytes()
    scale = np.max(np.abs(f64))
    assert np.max(np.abs(one - f64)) < 1e-5 * scale    # contract 1: fp32 sums
    assert np.max(np.abs(two - f64)) < 1e-3 * scale    # contract 2: codes of 13 and 20 bits


@pytest.mark.parametrize("kw, needle", [({"contract": 3}, "must be one of"), ({"contract": True}, "must be one of"),
                                        ({"contract": "2"}, "must be one of"),
                                        ({"contract": 2, "tp": 2}, "one process"),
                                        ({"contract": 2, "one_launch": True}, "one-launch")])
def test_engine_refusals(bf16, kw, needle):
    with pytest.raises(RequestError, match=needle):
        Engine(bf16, **kw)


def test_a_float_matrix_of_k_2_16_is_refused_when_the_engine_is_built(tmp_path):
    """ffn_down with K = n_ff = 2^16: contract 2 refuses the model up front (not in its
    first step); contract 1 runs it."""
    wide = load_model(write_model(str(tmp_path / "wide.gguf"), (64, 1, 2, 1, 1 << 16, 64), "BF16", n_ctx=64))
    with pytest.raises(ModelError, match="blk.0.ffn_down.weight: contract 2 needs float matrices with K < 65536"):
        Engine(wide, contract=2)
    eng = Engine(wide, contract=1)
    assert np.all(np.isfinite(eng.forward([(eng.new_sequence(), [1, 2])])[0]))


def test_decode_rows_refuses_part_of_k_under_contract2(bf16):
    from node.backend_cpu import decode_rows
    t = bf16.tensors["blk.0.ffn_down.weight"]
    whole = decode_rows(t, 0, t.rows, contract=2)
    assert whole.codes.shape == (t.rows, t.cols)
    with pytest.raises(ValueError, match="contract 2 decodes whole rows"):
        decode_rows(t, 0, t.rows, 0, t.cols // 2, contract=2)


def test_an_attestation_of_contract2_on_gpu_ranks_is_refused(tmp_path_factory):
    """The node never runs contract 2 on tensor-parallel ranks, so a payload claiming it is malformed."""
    from attest.schema import DEVICE_FIELDS, check_payload
    from test_attest import artifact
    p = dict(artifact(tmp_path_factory).payload, backend="cuda",
             device={**{k: "x" for k in DEVICE_FIELDS["cuda"]}, "tensor_parallel": 2})
    check_payload(dict(p, contract_version=1))
    with pytest.raises(AttestationError, match="tensor_parallel: --contract 2 runs in one process"):
        check_payload(dict(p, contract_version=2))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The default model with two matrices in BF16 (seeded normals): a model with a
    tokenizer whose bytes differ between the contracts."""
    import gguf
    src = load_model(default_model_path())
    rng = np.random.default_rng(12)

    def bf16_matrix(name, data, qtype):
        if name not in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
            return None
        t = src.tensors[name]
        w = (rng.standard_normal((t.rows, t.cols)) * 0.05).astype(F32)
        return (w.view(np.uint32) >> 16).astype(np.uint16), gguf.GGMLQuantizationType.BF16

    return copy_model(src.path, str(tmp_path_factory.mktemp("c2") / "mixed.gguf"), tensor=bf16_matrix)


def test_run_and_verify_attest_contract2_and_a_forged_version_fails(mixed, tmp_path):
    assert bx(tmp_path, "keygen", "--out", "k.pem").returncode == 0
    payloads = {}
    for c in (1, 2):
        p = bx(tmp_path, "run", "--key", "k.pem", "--model", mixed, "--prompt", "The sky is", "--max-tokens", 4,
               "--device", "cpu", "--contract", c, "--attestation", f"c{c}.bxa")
        assert p.returncode == 0, p.stderr
        with open(tmp_path / f"c{c}.bxa", "rb") as f:
            payloads[c] = envelope.open_envelope(f.read())
        assert payloads[c]["contract_version"] == c
    assert payloads[1]["output"]["step_chain"][-1] != payloads[2]["output"]["step_chain"][-1]
    v = bx(tmp_path, "verify", "c2.bxa", "--model", mixed, "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["result"] == "OK", v.stdout + v.stderr
    forged = dict(payloads[2], contract_version=1)   # contract 2's tokens and chain, claimed as contract 1
    with open(tmp_path / "f.bxa", "wb") as f:
        f.write(sign_raw(forged, keys.load_private(str(tmp_path / "k.pem"))))
    v = bx(tmp_path, "verify", "f.bxa", "--model", mixed)
    assert v.returncode == 1 and "FAIL: first divergent step 0" in v.stdout, v.stdout + v.stderr
    forged["contract_version"] = 7
    with open(tmp_path / "g.bxa", "wb") as f:
        f.write(sign_raw(forged, keys.load_private(str(tmp_path / "k.pem"))))
    line = assert_input_error(bx(tmp_path, "verify", "g.bxa", "--model", mixed))
    assert "unknown determinism-contract version 7" in line


def test_cli_refuses_contract2_with_tensor_parallelism_and_unknown_versions(bf16, tmp_path):
    assert bx(tmp_path, "keygen", "--out", "k.pem").returncode == 0
    line = assert_input_error(bx(tmp_path, "serve", "--key", "k.pem", "--model", bf16.path, "--device", "cpu",
                                 "--tp", 2, "--contract", 2, "--port", 0))
    assert "--contract 2 runs in one process" in line
    for device in ("cpu", "auto"):   # refused on every device, not only where --one-launch applies
        line = assert_input_error(bx(tmp_path, "run", "--key", "k.pem", "--model", bf16.path, "--prompt", "hi",
                                     "--device", device, "--contract", 2, "--one-launch"))
        assert "--contract 2 runs in one process with per-op kernels" in line
    line = assert_input_error(bx(tmp_path, "run", "--key", "k.pem", "--model", bf16.path, "--prompt", "hi",
                                 "--contract", 3))
    assert "--contract" in line
    assert sorted(os.listdir(tmp_path)) == ["k.pem", "k.pub.pem"]


def test_serve_under_contract2_names_it_and_attests_it(mixed, tmp_path):
    """``serve --contract 2``: the banner and /v1/node name the contract, and the
    attestation of a completion records it and verifies by re-execution."""
    import re
    import signal
    import subprocess
    import sys
    import urllib.request
    assert bx(tmp_path, "keygen", "--out", "k.pem").returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "serve", "--key", str(tmp_path / "k.pem"),
                             "--model", mixed, "--data-dir", str(tmp_path / "data"), "--port", "0",
                             "--device", "cpu", "--contract", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        banner = proc.stdout.readline()
        m = re.search(r", determinism contract 2, key id .*(http://127\.0\.0\.1:\d+)\s*$", banner)
        assert m, banner
        url = m.group(1)
        assert json.loads(urllib.request.urlopen(url + "/v1/node", timeout=30).read())["contract_version"] == 2
        req = urllib.request.Request(url + "/v1/completions", json.dumps(
            {"model": json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"],
             "prompt": "The sky is", "max_tokens": 3}).encode(),
            {"Content-Type": "application/json"})
        body = json.loads(urllib.request.urlopen(req, timeout=120).read())
        att = urllib.request.urlopen(f"{url}/v1/attestations/{body['attestation']['id']}", timeout=30).read()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert envelope.open_envelope(att)["contract_version"] == 2
    (tmp_path / "served.bxa").write_bytes(att)
    v = bx(tmp_path, "verify", "served.bxa", "--model", mixed, "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["result"] == "OK", v.stdout + v.stderr



def test_weight_upload_in_threaded_chunks_gives_the_whole_matrix_codes(tmp_path, monkeypatch):
    """CudaBackend._upload_rowint quantizes row chunks on host threads and packs them in
    order; run here with numpy standing in for CuPy (the packing is integer array ops),
    with chunks of 64 rows (the last one partial) on 3 threads: the same packed codes
    and exponents as the whole matrix quantized at once."""
    import types

    from node import backend_cuda as bc
    from node.gguf_model import float_values
    monkeypatch.setattr(bc, "QUANTIZE_ELEMS", 64 * 96)   # 64 rows of K = 96
    monkeypatch.setattr(bc, "QUANTIZE_THREADS", 3)
    model = load_model(write_model(str(tmp_path / "m.gguf"), (64, 1, 2, 1, 96, 1000), "BF16", seed=3))
    t = model.tensors["output.weight"]
    mat = bc.CudaBackend._upload_rowint(types.SimpleNamespace(cp=np), t)
    codes, s = ref.quantize_rowint(float_values(t), ref.W_CODE_BITS)
    assert mat.data.tobytes() == pack_rowint_w(np, codes.astype(np.int16)).tobytes()
    assert mat.s.tobytes() == s.tobytes()


def test_a_tied_lm_head_of_bf16_embeddings_is_a_contract2_product(tmp_path):
    """A Q8_0 model whose embeddings (and so its tied LM head) are BF16: the embedding
    lookup is the same under both contracts, so contract 2 changes only the LM head's
    product, the last one of each step; the logits differ, and stay close."""
    import gguf
    q8 = write_model(str(tmp_path / "q8.gguf"), "tiny", "Q8_0", seed=13, tied=True)
    rng = np.random.default_rng(14)

    def bf16_embd(name, data, qtype):
        if name != "token_embd.weight":
            return None
        t = load_model(q8).tensors[name]
        w = rng.standard_normal((t.rows, t.cols)).astype(F32)
        return (w.view(np.uint32) >> 16).astype(np.uint16), gguf.GGMLQuantizationType.BF16

    tied = load_model(copy_model(q8, str(tmp_path / "tied.gguf"), tensor=bf16_embd))
    assert tied.tied_output and tied.tensors["token_embd.weight"].qtype == "BF16"
    toks = list(range(1, 12))
    one, two = (_all_logits(Engine(tied, contract=c), [[toks]])[0] for c in (1, 2))
    assert one.tobytes() != two.tobytes()
    assert np.max(np.abs(one - two)) < 1e-2 * np.max(np.abs(one))
