"""Contract 2's products on the GPU: bit-exact against their numpy twins, and timed.

cuda/matmul.cu quantize_rowint and matmul_rowint (docs/determinism.md section
14) against node/reference.py quantize_rowint and matmul_rowint: for small and
Llama-3.1-8B-shaped matrices and token counts that do and do not fill a tile,
the input codes (packed), the scale exponents and the output bytes must be
equal, also for one launch of three matrices. Then each product of the 8B
shape (Q/K/V, O, gate/up, down, LM head) is timed at batch 1, 8, 32 and 64
(quantize_rowint + matmul_rowint, CUDA events over repeated launches) beside
torch's bf16 matmul (cuBLAS) of the same shape, and the products of a whole
32-layer step are summed. Exits 1 on any mismatch.

    python3 scripts/bench_rowint.py [--reps 20] [--out rowint_gpu.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from node import reference as ref  # noqa: E402
from node.backend_cuda import load_modules, pack_rowint_w, pack_rowint_x, rowint_geometry  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
CHECKS = [((64, 96), (1, 3, 8)), ((48, 96), (1, 9, 17)), ((6144, 4096), (1, 5, 8, 32, 33, 64)), ((4096, 14336), (1, 32, 64)),
          ((28672, 4096), (7, 32)), ((300, 256), (1, 17)),
          ((1, 32), (1, 9)),                # K = 32: one k-step, three of a cluster's four blocks add none
          ((130, 608), (1, 50, 57)),        # 19 k-steps (4, 5, 5, 5 per block), last passes of 3 and 4 tiles
          ((64, 1184), (33,)),              # 37 k-steps (9, 9, 9, 10 per block)
          ((131136, 64), (1, 33)),          # N past 2^17: the largest grid of the checks
          ((70, 65504), (3, 40))]           # the largest K; with SATURATED values
SATURATED = {(70, 65504)}  # weights and inputs of magnitude 1.999 (codes near their bounds), a sign per row
FUSED = [((300, 64, 1024), 608, (1, 40))]  # one launch of three matrices (the first not whole 64-row groups)


class Rowint:
    """cuda/matmul.cu's contract-2 kernels, launched as node/backend_cuda.py launches them."""

    def __init__(self):
        import cupy as cp

        self.cp = cp
        mod = load_modules(cp)["matmul.cu"]
        self.q, self.mm = mod.get_function("quantize_rowint"), mod.get_function("matmul_rowint")
        self.geo = rowint_geometry(mod)
        self.mm.max_dynamic_shared_size_bytes = self.geo.smem

    def weights(self, w: np.ndarray):
        """Host weights fp32 ``[N, K]`` -> device (packed codes, exponents) and the twin's weight."""
        cw, sw = ref.quantize_rowint(w, ref.W_CODE_BITS)
        return (pack_rowint_w(self.cp, self.cp.asarray(cw)), self.cp.asarray(sw)), ref.RowintWeight(cw, sw)

    def quantize(self, x):
        cp = self.cp
        m, k = x.shape
        mp = -(-m // 8) * 8
        px = cp.empty((mp // 8, k // 32, 3, 256), cp.uint8)
        sx = cp.empty(m, cp.int32)
        self.q((mp,), (self.geo.quantize_threads,), (x, px, sx, np.int32(m), np.int32(k)))
        return px, sx

    def matmul(self, px, sx, pw, sw, m, n, k, y):
        """One matrix's product (matmul_rowint's second and third matrices empty)."""
        self.matmul_fused(px, sx, [(pw, sw, n, y)], m, k)

    def matmul_fused(self, px, sx, mats, m, k):
        """The products with 1-3 matrices ``(packed codes, exponents, N, y)`` of one K, one launch."""
        assert k % 32 == 0 and 1 <= len(mats) <= 3
        assert all(pw.shape == (-(-n // 64), k // 32, 2, 2048) and y.shape == (m, n) for pw, _, n, y in mats)
        mats = list(mats) + [mats[0][:2] + (0, mats[0][3])] * (3 - len(mats))
        self.mm(self.geo.grid(m, [n for _, _, n, _ in mats]), (self.geo.threads,),
                (*(a[0] for a in mats), *(a[1] for a in mats), *(a[3] for a in mats),
                 *(np.int32(a[2]) for a in mats), px, sx, np.int32(m), np.int32(k)), shared_mem=self.geo.smem)


def weights_like(rng, n: int, k: int) -> np.ndarray:
    """BF16-valued fp32 weights ``[N, K]``: normal with a few large entries per row (outliers)."""
    w = rng.standard_normal((n, k), np.float32) * np.float32(0.02)
    w[np.arange(n), rng.integers(0, k, n)] *= np.float32(40.0)
    return (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def inputs_like(rng, m: int, k: int) -> np.ndarray:
    x = rng.standard_normal((m, k), np.float32)
    x[:, rng.integers(0, k, 4)] *= np.float32(30.0)   # outlier channels
    x[:, :3] = [0.0, -0.0, 1e-40]                     # zeros and a subnormal
    return x


def saturated(rng, rows: int, k: int) -> np.ndarray:
    """fp32 ``[rows, k]`` of magnitude 1.999, one random sign per row: every code within a
    few units of its bound and no cancellation: at K = 65 504 the largest int32 slice sum
    over all of K is 0.69 of 2^31 (each block of a cluster adds a quarter of K)."""
    sign = np.where(rng.random((rows, 1)) < 0.5, np.float32(-1.0), np.float32(1.0))
    return np.broadcast_to(sign * np.float32(1.999), (rows, k)).copy()


def check(ri: Rowint, rng) -> list:
    cp = ri.cp
    out = []
    for (n, k), ms in CHECKS:
        w = saturated(rng, n, k) if (n, k) in SATURATED else weights_like(rng, n, k)
        (pw, sw), wr = ri.weights(w)
        for m in ms:
            x = saturated(rng, m, k) if (n, k) in SATURATED else inputs_like(rng, m, k)
            xr = ref.quantize_rowint(x, ref.X_CODE_BITS)
            want = ref.matmul_rowint(xr, wr)
            px, sx = ri.quantize(cp.asarray(x))
            y = cp.empty((m, n), cp.float32)
            ri.matmul(px, sx, pw, sw, m, n, k, y)
            got = cp.asnumpy(y)
            ok = {"codes": bool(np.array_equal(cp.asnumpy(px), pack_rowint_x(xr[0]))),
                  "exponents": bool(np.array_equal(cp.asnumpy(sx), xr[1])),
                  "output": got.tobytes() == want.tobytes()}
            row = {"n": n, "k": k, "m": m, **ok, "sha256": hashlib.sha256(want.tobytes()).hexdigest()[:16],
                   "differing": int(np.sum(got.view(np.uint32) != want.view(np.uint32)))}
            print(json.dumps(row), flush=True)
            out.append(row)
    for ns, k, ms in FUSED:
        ws = [ri.weights(weights_like(rng, n, k)) for n in ns]
        for m in ms:
            x = inputs_like(rng, m, k)
            xr = ref.quantize_rowint(x, ref.X_CODE_BITS)
            px, sx = ri.quantize(cp.asarray(x))
            ys = [cp.empty((m, n), cp.float32) for n in ns]
            ri.matmul_fused(px, sx, [(pw, sw, n, y) for ((pw, sw), _), n, y in zip(ws, ns, ys)], m, k)
            codes = bool(np.array_equal(cp.asnumpy(px), pack_rowint_x(xr[0])))
            exponents = bool(np.array_equal(cp.asnumpy(sx), xr[1]))
            for i, (n, (_, wr), y) in enumerate(zip(ns, ws, ys)):
                want, got = ref.matmul_rowint(xr, wr), cp.asnumpy(y)
                row = {"n": n, "k": k, "m": m, "fused": f"{i + 1} of {len(ns)}", "codes": codes,
                       "exponents": exponents, "output": got.tobytes() == want.tobytes(),
                       "differing": int(np.sum(got.view(np.uint32) != want.view(np.uint32)))}
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def timed(cp, fn, reps: int) -> float:
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps * 1e3   # us


def bench(ri: Rowint, rng, reps: int) -> dict:
    import torch

    cp = ri.cp
    res = {}
    for name, (n, k) in SHAPES_8B.items():
        w64 = weights_like(np.random.default_rng(1), 64, k)   # timed, not checked: one 64-row group repeated
        cw, sw = ref.quantize_rowint(w64, ref.W_CODE_BITS)
        pw = pack_rowint_w(cp, cp.tile(cp.asarray(cw), (-(-n // 64), 1))[:n])
        sw = cp.tile(cp.asarray(sw), -(-n // 64))[:n]
        wt = torch.as_tensor(cp.tile(cp.asarray(w64), (-(-n // 64), 1))[:n], device="cuda").to(torch.bfloat16)
        res[name] = {}
        for m in (1, 8, 32, 64):
            x = cp.asarray(inputs_like(rng, m, k))
            y = cp.empty((m, n), cp.float32)

            def run():
                px, sx = ri.quantize(x)
                ri.matmul(px, sx, pw, sw, m, n, k, y)
            xt = torch.as_tensor(x, device="cuda").to(torch.bfloat16)
            t_ri = timed(cp, run, reps)
            t_bl = timed(cp, lambda: torch.matmul(xt, wt.T), reps)
            res[name][m] = {"rowint_us": round(t_ri, 1), "cublas_bf16_us": round(t_bl, 1),
                            "rowint_TBps": round(2 * n * k / t_ri / 1e6, 2)}
            print(name, m, res[name][m], flush=True)
        del pw, wt
        cp.get_default_memory_pool().free_all_blocks()
    layer = ("qkv", "o", "gate_up", "down")
    res["step_32_layers_ms"] = {m: {e[:-2] + "ms": round((32 * sum(res[p][m][e] for p in layer) + res["lm_head"][m][e]) / 1e3, 3)
                                    for e in ("rowint_us", "cublas_bf16_us")} for m in (1, 8, 32, 64)}
    print(json.dumps(res["step_32_layers_ms"]), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    ri = Rowint()
    rng = np.random.default_rng(7)
    checks = check(ri, rng)
    report = {"checks": checks, "bench": bench(ri, rng, args.reps)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    bad = [c for c in checks if not (c["codes"] and c["exponents"] and c["output"])]
    print(f"{len(checks) - len(bad)} of {len(checks)} checks bit-exact")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
