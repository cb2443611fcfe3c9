"""Time variants of the matmul_f or matmul_q tile constants on the Llama-3.1-8B product shapes.

Each variant is cuda/matmul.cu compiled with the pinned options plus ``-D``
overrides (matmul_f: MF_ROWS, MF_BYTES, MF_WARPS, MF_MINB; matmul_q: MQ_SPLIT
of 4 or 8, MQ_NT; none of them changes any sum). matmul_f reads BF16
weights, matmul_q Q4_K weights (random codes and scales) and activations
quantized by quantize_q8. For each product (Q/K/V fused, O, gate/up fused,
down, LM head) and batch 1, 8, 32 it replays a CUDA graph of 20 launches that
cycle over weight copies larger than L2, and reports microseconds per launch,
GB/s of weights, and whether the output bytes equal the first variant's.

    python scripts/tune_matmul.py --out tune.json -- "" "-DMF_ROWS=1 -DMF_BYTES=64" ...
    python scripts/tune_matmul.py --kernel matmul_q --out tuneq.json -- "" "-DMQ_NT=2" ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from node.gguf_model import BLOCK_BYTES  # noqa: E402

SHAPES = {"qkv": ([4096, 1024, 1024], 4096), "o": ([4096], 4096), "gu": ([14336, 14336], 4096),
          "down": ([4096], 14336), "head": ([128256], 4096)}
BATCHES = (1, 8, 32)
DEFAULTS = {"MF_ROWS": 2, "MF_WARPS": 8, "MQ_SPLIT": 4, "MQ_NT": 1}


def compile_variant(cp, kernel: str, defines: list[str]):
    from node import backend_cuda as bc

    root = bc.ROOT
    src = open(os.path.join(root, "cuda", "matmul.cu")).read()
    hdr = open(os.path.join(root, "cuda", "common.cuh")).read()
    cubin = bc._nvrtc_compile("matmul.cu", src, hdr, bc.COMPILE_OPTIONS + tuple(defines))
    path = f"/tmp/tune-{hashlib.sha256(' '.join(defines).encode()).hexdigest()[:12]}.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    params = dict(DEFAULTS, **{d[2:].split("=")[0]: int(d.split("=")[1]) for d in defines})
    mod = cp.RawModule(path=path)
    return (mod.get_function(kernel), mod.get_function("quantize_q8")), params


def weights(cp, kernel: str, n: int, k: int):
    """Random weights ``[n, k]``: BF16 bits (matmul_f) or Q4_K blocks with scales 2^-7 (matmul_q)."""
    if kernel == "matmul_f":
        return (cp.random.standard_normal((n, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    w = cp.random.randint(0, 256, (n, k // 256, BLOCK_BYTES["Q4_K"][0]), dtype=cp.uint8)
    w[:, :, 0:4] = cp.asarray(np.array([0x2000, 0x2000], np.uint16).view(np.uint8))  # d, dmin = 2^-7 (fp16)
    return w.reshape(n, -1)


def time_variant(cp, kernel, fns, params, ns, k, x, wsets, reps=20):
    from node.backend_cuda import QTYPE_IDS, mq_smem
    from node.reference import lane_terms, lane_width

    fn, quantize = fns
    m = x.shape[0]
    ys = [cp.empty((m, n), cp.float32) for n in ns]
    pad = 3 - len(ns)
    if kernel == "matmul_f":
        rows, warps = params["MF_ROWS"], params["MF_WARPS"]
        grid, block = ((m + 7) // 8, -(-sum(-(-n // rows) for n in ns) // warps)), (32 * warps,)
        tail = (np.int32(QTYPE_IDS["BF16"]), np.int32(lane_width(k, 2)), x, np.int32(m), np.int32(k), np.int32(32), np.int32(0))
        smem = 0
    else:
        nb = k // 32
        q, d, a = cp.empty((m, k), cp.int8), cp.empty((m, nb), cp.float32), cp.empty((m, nb), cp.int32)
        quantize(((32 * m * nb + 255) // 256,), (256,), (x, q, d, a, np.int32(m), np.int32(k)))
        tt = 8 * params["MQ_NT"]
        grid, block = ((m + tt - 1) // tt, sum(-(-n // 16) for n in ns)), (32 * params["MQ_SPLIT"],)
        smem = mq_smem(params["MQ_SPLIT"], params["MQ_NT"])
        fn.max_dynamic_shared_size_bytes = smem
        rb = k // 256 * BLOCK_BYTES["Q4_K"][0]
        tail = (*(np.int32(QTYPE_IDS["Q4_K"]) for _ in range(3)), *(np.int32(rb) for _ in range(3)), q, d, a, np.int32(m),
                np.int32(k), np.int32(lane_terms(nb)), np.int32(32), np.int32(0), np.int32(0), np.int32(nb))

    def launch(ws):
        fn(grid, block, (*ws, *[ws[0]] * pad, *ys, *[ys[0]] * pad, *(np.int32(n) for n in ns + [0] * pad), *tail),
           shared_mem=smem)

    launch(wsets[0])
    cp.cuda.runtime.deviceSynchronize()
    out = b"".join(y.tobytes() for y in ys)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for i in range(reps):
            launch(wsets[i % len(wsets)])
        g = s.end_capture()
        g.launch(s)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(s)
        for _ in range(3):
            g.launch(s)
        end.record(s)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / (3 * reps), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel", choices=("matmul_f", "matmul_q"), default="matmul_f")
    ap.add_argument("variants", nargs="+", help="space-separated -D overrides per variant ('' = the defaults)")
    args = ap.parse_args()
    import cupy as cp

    variants = [(v or "defaults", *compile_variant(cp, args.kernel, v.split())) for v in args.variants]
    report = {"kernel": args.kernel, "runs": [],
              "variants": {name: {"registers": fns[0].num_regs, "local_bytes": fns[0].local_size_bytes}
                           for name, fns, _ in variants}}
    for shape, (ns, k) in SHAPES.items():
        nbytes = sum(ns) * k * (2 if args.kernel == "matmul_f" else BLOCK_BYTES["Q4_K"][0] / 256)
        copies = max(1, min(6, int(300e6 // nbytes) + 1))      # cycle over > 300 MB: no L2 reuse
        wsets = [[weights(cp, args.kernel, n, k) for n in ns] for _ in range(copies)]
        for m in BATCHES:
            x = cp.random.standard_normal((m, k), dtype=cp.float32)
            first = None
            for name, fns, params in variants:
                us, out = time_variant(cp, args.kernel, fns, params, ns, k, x, wsets)
                first = first or out
                run = {"shape": shape, "batch": m, "variant": name, "us": round(us, 1),
                       "GB_per_s": round(nbytes / us / 1e3), "same_bytes": out == first}
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
        del wsets
        cp.get_default_memory_pool().free_all_blocks()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if all(r["same_bytes"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
