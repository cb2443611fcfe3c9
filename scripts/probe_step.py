"""Measure one launch per decode step: scripts/probe_step.cu on the Llama-3.1-8B shape in BF16.

A measurement for the batch-1 roofline target (docs/benchmarks.md, "A whole
step in one launch"), not a path of the node: the kernel runs one decode
step for M <= 8 tokens (each the next token of its own sequence, at its own
position below 256) of a synthetic model with seeded random BF16 weights
(std 0.02), every layer and the LM head inside one cooperative launch. It
first runs one layer and the LM head at each ``--check-tokens`` count and
compares every intermediate (queries after RoPE, the K and V written to the
cache, the attention output, both residuals, the SiLU gate, the logits)
byte for byte with node/reference.py; then, for each ``--tokens`` count and
each variant of the kernel's ``-D`` constants (PS_STAGES, PS_SL, PS_SR,
PS_FENCE), it times the full depth (20 launches after 3 untimed ones, CUDA
events) and checks that every launch gave the same logits bytes. Roofline:
weight bytes ÷ 4.3 TB/s. Exit status 0 only when every check and every
digest held.

    python3 scripts/probe_step.py --out probe.json --tokens 1,8 --check-tokens 1,3 -- "" "-DPS_SL=4"
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from node import reference as ref  # noqa: E402

D, F, HD, H, HKV, VOCAB, P = 4096, 14336, 128, 32, 8, 128256, 256
EPS = np.float32(1e-5)
HBM = 4.3e12


def compile_variant(cp, defines: list[str]):
    from node.backend_cuda import cubin_path as variant_cubin

    mod = cp.RawModule(path=variant_cubin(os.path.join(ROOT, "scripts", "probe_step.cu"), tuple(defines)))
    fn = mod.get_function("probe_step")
    params = {"PS_WARPS": 16, "PS_STAGES": 6, "PS_TM": 8}
    params.update({d[2:].split("=")[0]: int(d.split("=")[1]) for d in defines})
    smem = params["PS_WARPS"] * params["PS_STAGES"] * 1024 + (params["PS_TM"] * D + 32) * 4
    fn.max_dynamic_shared_size_bytes = smem
    return fn, mod, params, smem


def bf16_bits(cp, rng_seed: int, n: int, k: int):
    """Seeded random weights [n, k] as BF16 bits (truncated fp32 of N(0, 0.02^2))."""
    g = cp.random.default_rng(rng_seed)
    w = g.standard_normal((n, k), dtype=cp.float32) * cp.float32(0.02)
    return (w.view(cp.uint32) >> 16).astype(cp.uint16)


def lane_major(cp, w):
    n, k = w.shape
    return cp.ascontiguousarray(w.reshape(n, 32, k // 256, 8).swapaxes(1, 2)).reshape(n, k)


class Model:
    """Device weights of ``layers`` layers (lane-major, gate/up interleaved) and, for the check, layer 0's host copies."""

    def __init__(self, cp, layers: int, keep_host: bool):
        self.mats, self.host = [], {}
        for layer in range(layers):
            s = 1000 * layer
            qkv, o, gt, up, dn = (bf16_bits(cp, s + i, n, k) for i, (n, k) in
                                  enumerate([(D + 2 * HKV * HD, D), (D, D), (F, D), (F, D), (D, F)]))
            gu = cp.stack([lane_major(cp, gt), lane_major(cp, up)], axis=1).reshape(2 * F, D)
            self.mats += [lane_major(cp, qkv), lane_major(cp, o), cp.ascontiguousarray(gu), lane_major(cp, dn)]
            if keep_host and layer == 0:
                self.host.update(qkv=qkv.get(), o=o.get(), gate=gt.get(), up=up.get(), down=dn.get())
            del qkv, o, gt, up, dn, gu
        head = bf16_bits(cp, 999_999, VOCAB, D)
        self.mats.append(lane_major(cp, head))
        if keep_host:
            self.host["head"] = head.get()
        del head
        self.ptrs = cp.asarray(np.array([m.data.ptr for m in self.mats], np.uint64))
        self.bytes = sum(m.nbytes for m in self.mats)


def f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_setup(cp, model: Model, layers: int, positions: list[int], seed: int = 7):
    """Inputs and buffers for M = len(positions) tokens, token m the next token of its own sequence
    at positions[m] (< 256), and the packed kernel arguments."""
    m = len(positions)
    rng = np.random.default_rng(seed)
    host = {"h0": rng.standard_normal((m, D), dtype=np.float32),
            "attn_norm": (1 + 0.1 * rng.standard_normal((layers, D))).astype(np.float32),
            "ffn_norm": (1 + 0.1 * rng.standard_normal((layers, D))).astype(np.float32),
            "out_norm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
            "kc": rng.standard_normal((layers, m, HKV, P, HD), dtype=np.float32),
            "vc": rng.standard_normal((layers, m, HKV, P, HD), dtype=np.float32),
            "pos": np.array(positions, np.int32)}
    theta = np.array(positions, np.float64)[:, None] * (500000.0 ** (-np.arange(HD // 2) * 2.0 / HD))
    host["cos"], host["sin"] = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    dev = {k: cp.asarray(v) for k, v in host.items()}
    for name, n in (("h", D), ("h1", D), ("q", D), ("att", D), ("act", F), ("logits", VOCAB)):
        dev[name] = cp.zeros((m, n), cp.float32)
    dev["flags"] = cp.zeros(1024, cp.uint32)
    dev["times"] = cp.zeros(5 * layers + 2, cp.uint64)
    order = ["attn_norm", "ffn_norm", "out_norm", "h0", "h", "h1", "q", "att", "act", "kc", "vc", "pos", "cos",
             "sin", "logits", "flags", "times"]
    scale = np.float32(1.0) / np.sqrt(np.float32(HD))
    dev["args"] = struct.pack("<18Q4i2f", model.ptrs.data.ptr, *(dev[k].data.ptr for k in order), layers, m, P,
                              VOCAB, float(EPS), float(scale))
    return host, dev


def set_args(mod, dev) -> None:
    """The kernel's arguments into its module's constant ``ps_args``."""
    mod.get_global("ps_args").copy_from_host(np.frombuffer(dev["args"], np.uint8).ctypes.data, len(dev["args"]))


def launch(fn, smem, grid, warps, epoch):
    fn.kernel((grid,), (32 * warps,), (np.uint32(epoch),), shared_mem=smem, enable_cooperative_groups=True)


def phase_us(times: np.ndarray, layers: int) -> dict:
    """Median µs per phase over the layers from block 0's timestamps, and the LM head's."""
    d = np.diff(times.astype(np.int64)) / 1e3
    names = ["qkv_rope_kv", "attention", "o_residual", "gate_up_silu", "down_residual"]
    out = {n: round(float(np.median(d[i:5 * layers:5])), 2) for i, n in enumerate(names)}
    out["norm_lm_head_block0"] = round(float(d[5 * layers]), 2)
    out["per_layer"] = round(float(np.sum(d[:5 * layers]) / layers), 2)
    return out


def reference_layer(model: Model, host: dict) -> dict:
    """node/reference.py for layer 0 and the LM head, each token the next one of its own sequence."""
    w = {k: f32(v) for k, v in model.host.items()}
    x, pos = host["h0"], host["pos"]
    m = x.shape[0]
    xn = ref.rms_norm(x, host["attn_norm"][0], EPS)
    qkv = ref.matmul_f(xn, w["qkv"])
    q = ref.rope(qkv[:, :D].reshape(m, H, HD), host["cos"], host["sin"])
    k = ref.rope(qkv[:, D:D + HKV * HD].reshape(m, HKV, HD), host["cos"], host["sin"])
    v = qkv[:, D + HKV * HD:].reshape(m, HKV, HD)
    kc, vc = host["kc"][0].copy(), host["vc"][0].copy()
    att = np.empty((m, D), np.float32)
    for t in range(m):
        kc[t, :, pos[t]], vc[t, :, pos[t]] = k[t], v[t]
        att[t] = ref.attention(q[t:t + 1], kc[t], vc[t], pos[t:t + 1]).reshape(D)
    h1 = ref.residual_add(x, ref.matmul_f(att, w["o"]))
    xn2 = ref.rms_norm(h1, host["ffn_norm"][0], EPS)
    act = ref.silu_gate(ref.matmul_f(xn2, w["gate"]), ref.matmul_f(xn2, w["up"]))
    h2 = ref.residual_add(h1, ref.matmul_f(act, w["down"]))
    logits = ref.matmul_f(ref.rms_norm(h2, host["out_norm"], EPS), w["head"])
    rows = np.arange(m)
    return {"q": q, "k_at_pos": kc[rows, :, pos], "v_at_pos": vc[rows, :, pos], "att": att, "h1": h1,
            "act": act, "h": h2, "logits": logits}


def positions(m: int, first: int) -> list[int]:
    """M distinct positions below 256, the first one ``first``."""
    return [(first - 37 * t) % 256 for t in range(m)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pos", type=int, default=200, help="the first token's position (< 256: one attention split)")
    ap.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8],
                    help="token counts M (1..8) to time, comma-separated")
    ap.add_argument("--check-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1, 3, 8],
                    help="token counts checked against the numpy engine")
    ap.add_argument("--check-variant", default="", help="the -D flags of the variant checked (default: none)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("variants", nargs="*", default=[""])
    args = ap.parse_args()
    bad = ([f"--tokens {m}" for m in args.tokens + args.check_tokens if not 1 <= m <= 8]
           + ([f"--pos {args.pos}"] if not 0 <= args.pos < P else [])
           + ([f"--layers {args.layers}"] if args.layers < 1 else [])
           + ([f"--iters {args.iters}"] if args.iters < 1 else []))
    if bad:
        print(f"probe_step: out of range (tokens 1..8, pos 0..{P - 1}, layers and iters >= 1): {', '.join(bad)}",
              file=sys.stderr)
        return 2
    from node.backend_cuda import GpuError, _cupy
    try:
        cp = _cupy()
    except GpuError as e:
        print(f"probe_step: {e}", file=sys.stderr)
        return 2

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    result = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "sms": sms, "pos": args.pos,
              "check": {}, "runs": []}
    # 1. bytes against the numpy engine: one layer and the LM head, at each checked token count
    fn, mod, params, smem = compile_variant(cp, args.check_variant.split())
    result["check_variant"] = args.check_variant
    model = Model(cp, 1, keep_host=True)
    for m in args.check_tokens:
        host, dev = run_setup(cp, model, 1, positions(m, args.pos))
        set_args(mod, dev)
        launch(fn, smem, sms, params["PS_WARPS"], 0)
        cp.cuda.Device().synchronize()
        t0 = time.time()
        want = reference_layer(model, host)
        rows, pos = np.arange(m), host["pos"]
        got = {"q": dev["q"].get().reshape(m, H, HD), "k_at_pos": dev["kc"].get()[0][rows, :, pos],
               "v_at_pos": dev["vc"].get()[0][rows, :, pos], "att": dev["att"].get(), "h1": dev["h1"].get(),
               "act": dev["act"].get(), "h": dev["h"].get(), "logits": dev["logits"].get()}
        check = {}
        for k in want:
            same = want[k].astype(np.float32).tobytes() == got[k].tobytes()
            check[k] = same if same else f"differs at {int(np.argmax(want[k] != got[k]))} of {want[k].size}"
        result["check"][f"M={m}"] = {"positions": positions(m, args.pos), **check,
                                     "seconds": round(time.time() - t0, 1)}
        print(f"check M={m}:", check, flush=True)
    del model, dev
    cp.get_default_memory_pool().free_all_blocks()
    # 2. the full depth, timed
    model = Model(cp, args.layers, keep_host=False)
    result["weight_bytes"] = model.bytes
    roof_ms = model.bytes / HBM * 1e3
    result["roofline_ms"] = roof_ms
    barriers = 5 * args.layers
    for m in args.tokens:
        host, dev = run_setup(cp, model, args.layers, positions(m, args.pos))
        epoch = 0
        for var in args.variants:
            fn, mod, params, smem = compile_variant(cp, var.split())
            set_args(mod, dev)
            digests = set()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            for i in range(3 + args.iters):
                if i == 3:
                    start.record()
                launch(fn, smem, sms, params["PS_WARPS"], epoch)
                epoch += barriers
                if i < 3 or i == 2 + args.iters:
                    end.record()
                    end.synchronize()
                    digests.add(dev["logits"].get().tobytes())
            ms = cp.cuda.get_elapsed_time(start, end) / args.iters
            ph = phase_us(dev["times"].get(), args.layers)
            run = {"variant": var, "tokens": m, "ms_per_step": round(ms, 4), "tokens_per_s": round(m * 1e3 / ms, 1),
                   "of_roofline": round(roof_ms / ms, 4), "one_logits_digest": len(digests) == 1,
                   "phases_us": ph, "rest_us": round(ms * 1e3 - args.layers * ph["per_layer"], 1)}
            result["runs"].append(run)
            print(run, flush=True)
        del dev
    from attest.atomic import atomic_write
    atomic_write(args.out, json.dumps(result, indent=1).encode())
    ok = all(v is True for c in result["check"].values() for k, v in c.items() if k not in ("positions", "seconds"))
    return 0 if ok and all(r["one_logits_digest"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
