"""Time variants of the matmul_f tile constants on the Llama-3.1-8B product shapes.

Each variant is cuda/matmul.cu compiled with the pinned options plus ``-D``
overrides of MF_ROWS, MF_BYTES, MF_WARPS, MF_MINB (none of them changes any
sum). For each product (Q/K/V fused, O, gate/up fused, down, LM head) and
batch 1, 8, 32 it replays a CUDA graph of 20 launches that cycle over
weight copies larger than L2, and reports microseconds per launch, GB/s of
weights, and whether the output bytes equal the first variant's.

    python scripts/tune_matmul_f.py --out tune.json "" "-DMF_ROWS=1 -DMF_BYTES=64" ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": ([4096, 1024, 1024], 4096), "o": ([4096], 4096), "gu": ([14336, 14336], 4096),
          "down": ([4096], 14336), "head": ([128256], 4096)}
BATCHES = (1, 8, 32)
DEFAULTS = {"MF_ROWS": 2, "MF_WARPS": 8}


def compile_variant(cp, defines: list[str]):
    from node import backend_cuda as bc

    root = bc.ROOT
    src = open(os.path.join(root, "cuda", "matmul.cu")).read()
    hdr = open(os.path.join(root, "cuda", "common.cuh")).read()
    cubin = bc._nvrtc_compile("matmul.cu", src, hdr, bc.COMPILE_OPTIONS + tuple(defines))
    path = f"/tmp/tune-{hashlib.sha256(' '.join(defines).encode()).hexdigest()[:12]}.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    params = dict(DEFAULTS, **{d[2:].split("=")[0]: int(d.split("=")[1]) for d in defines})
    return cp.RawModule(path=path).get_function("matmul_f"), params


def time_variant(cp, fn, params, ns, k, x, wsets, reps=20):
    from node.reference import lane_width

    m = x.shape[0]
    rows, warps = params["MF_ROWS"], params["MF_WARPS"]
    grid = ((m + 7) // 8, -(-sum(-(-n // rows) for n in ns) // warps))
    ys = [cp.empty((m, n), cp.float32) for n in ns]
    pad = 3 - len(ns)

    def launch(ws):
        fn(grid, (32 * warps,), (*ws, *[ws[0]] * pad, *ys, *[ys[0]] * pad,
                                 *(np.int32(n) for n in ns + [0] * pad), np.int32(2),
                                 np.int32(lane_width(k, 2)), x, np.int32(m), np.int32(k), np.int32(32), np.int32(0)))

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
    ap.add_argument("variants", nargs="+", help="space-separated -D overrides per variant ('' = the defaults)")
    args = ap.parse_args()
    import cupy as cp

    variants = [(v or "defaults", *compile_variant(cp, v.split())) for v in args.variants]
    report = {"variants": {name: {"registers": fn.num_regs, "local_bytes": fn.local_size_bytes}
                           for name, fn, _ in variants}, "runs": []}
    for shape, (ns, k) in SHAPES.items():
        nbytes = sum(ns) * k * 2
        copies = max(1, min(6, int(300e6 // nbytes) + 1))      # cycle over > 300 MB: no L2 reuse
        wsets = [[(cp.random.standard_normal((n, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
                  for n in ns] for _ in range(copies)]
        for m in BATCHES:
            x = cp.random.standard_normal((m, k), dtype=cp.float32)
            first = None
            for name, fn, params in variants:
                us, out = time_variant(cp, fn, params, ns, k, x, wsets)
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
