"""Time variants of the matmul_f or matmul_q tiles on the Llama-3.1-8B or SmolLM2-135M product shapes.

Each variant is cuda/matmul.cu compiled with the pinned options plus ``-D``
overrides (matmul_f: MF_ROWS, MF_BYTES, MF_WARPS, MF_MINB, MF_PF; matmul_q: MQ_NT, MQ_PF, MQ_SLOTS)
and, for matmul_q, ``split=4`` or ``split=8`` warps per tile instead of the
node's choice (node/backend_cuda.py mq_split); none of them changes any sum.
matmul_f reads BF16 weights; matmul_q reads the shapes' quantized type (8B:
Q4_K; SmolLM2: Q4_1, LM head Q8_0, as the default model) with random codes
and scales 2^-7, packed as the node packs them, and activations quantized
by quantize_q8. For each product
(Q/K/V fused, O, gate/up fused, down, LM head) and batch 1, 8, 32 it replays
a CUDA graph of 20 launches that cycle over weight copies larger than L2
(launched as the node launches them, with programmatic dependent launch, so
each launch's L2 hints overlap the previous one's tail), and
reports microseconds per launch, GB/s of weights, and whether the output
bytes equal the first variant's.

    python scripts/tune_matmul.py --out tune.json -- "" "-DMF_ROWS=1 -DMF_BYTES=64" ...
    python scripts/tune_matmul.py --kernel matmul_q --shapes smollm2 --out tuneq.json -- "" "split=4" "split=8"
    ncu --clock-control none -k regex:^matmul python scripts/tune_matmul.py --once --out f.json -- ""

``--once`` launches each variant once per product and batch, untimed, for a
profiler (docs/benchmarks.md has the counters of one such run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from node.gguf_model import BLOCK_BYTES  # noqa: E402

# product: (rows of the fused matrices, K, quantized type)
SHAPES = {"8b": {"qkv": ([4096, 1024, 1024], 4096, "Q4_K"), "o": ([4096], 4096, "Q4_K"),
                 "gu": ([14336, 14336], 4096, "Q4_K"), "down": ([4096], 14336, "Q4_K"),
                 "head": ([128256], 4096, "Q4_K")},
          "smollm2": {"qkv": ([576, 192, 192], 576, "Q4_1"), "o": ([576], 576, "Q4_1"),
                      "gu": ([1536, 1536], 576, "Q4_1"), "down": ([576], 1536, "Q4_1"),
                      "head": ([49152], 576, "Q8_0")}}
BATCHES = (1, 8, 32)
DEFAULTS = {"MF_ROWS": 2, "MF_WARPS": 8}


def compile_variant(cp, kernel: str, tokens: list[str]):
    """(kernel, quantize_q8, module) and the variant's parameters from its -D and split= tokens."""
    from node import backend_cuda as bc

    defines = tuple(t for t in tokens if t.startswith("-D"))
    params = dict(DEFAULTS, **{t.removeprefix("-D").split("=")[0]: int(t.split("=")[1]) for t in tokens})
    mod = cp.RawModule(path=bc.cubin_path(os.path.join(bc.ROOT, "cuda", "matmul.cu"), defines))
    return (bc.PdlKernel(mod.get_function(kernel), kernel), bc.PdlKernel(mod.get_function("quantize_q8"), "quantize_q8"),
            mod), params


def weights(cp, kernel: str, qtype: str, n: int, k: int):
    """Random weights ``[n, k]``: BF16 bits (matmul_f) or ``qtype`` blocks with scales 2^-7 (matmul_q)."""
    if kernel == "matmul_f":
        return (cp.random.standard_normal((n, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    from node.backend_cuda import pack_q
    bb, be = BLOCK_BYTES[qtype]
    w = cp.random.randint(0, 256, (n, k // be, bb), dtype=cp.uint8)
    for at in {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
        w[:, :, at:at + 2] = cp.asarray(np.array([0x2000], np.uint16).view(np.uint8))  # fp16 scales 2^-7 (ggml)
    return pack_q(cp, qtype, w.reshape(n, -1))  # the records node/backend_cuda.py uploads


def time_variant(cp, kernel, fns, params, ns, k, qtype, x, wsets, once=False):
    """(µs per launch of a replayed graph, output bytes); ``once``: one eager launch, untimed (µs 0)."""
    from node.backend_cuda import QTYPE_IDS, module_ints, mq_split
    from node.reference import lane_terms, lane_width

    fn, quantize, mod = fns
    reps = max(20, len(wsets))  # launches per graph: each weight copy at least once
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
        (tt,), split = module_ints(mod, "bx_mq_tokens"), params.get("split", mq_split(ns, 32))
        grid, block = ((m + tt - 1) // tt, sum(-(-n // 16) for n in ns)), (32 * split,)
        smem = split * module_ints(mod, "bx_mq_warp_smem", len(QTYPE_IDS))[QTYPE_IDS[qtype]] \
            + 32 * module_ints(mod, "bx_mq_lane_smem")[0]
        fn.max_dynamic_shared_size_bytes = smem
        tail = (*(np.int32(QTYPE_IDS[qtype]) for _ in range(3)), q, d, a, np.int32(m), np.int32(k),
                np.int32(lane_terms(nb)), np.int32(32), np.int32(0), np.int32(nb), np.int32(split))

    def launch(ws):
        residual = () if kernel == "matmul_f" else (None,)  # matmul_q's residual: none
        fn(grid, block, (*ws, *[ws[0]] * pad, *ys, *[ys[0]] * pad, *residual, *(np.int32(n) for n in ns + [0] * pad),
                         *tail),
           shared_mem=smem)

    launch(wsets[0])
    cp.cuda.runtime.deviceSynchronize()
    out = b"".join(y.tobytes() for y in ys)
    if once:
        return 0.0, out
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
    ap.add_argument("--shapes", choices=tuple(SHAPES), default="8b")
    ap.add_argument("--once", action="store_true",
                    help="launch each variant once per product and batch, untimed (to run under a profiler: "
                         "ncu --clock-control none -k regex:matmul python3 scripts/tune_matmul.py --once ...)")
    ap.add_argument("variants", nargs="+",
                    help="space-separated -D overrides and split=N per variant ('' = the defaults)")
    args = ap.parse_args()
    for v in args.variants:  # -DNAME=INT overrides and split=4|8, before the GPU is touched
        for t in v.split():
            name, _, val = t.removeprefix("-D").partition("=")
            if not (val.lstrip("-").isdigit() and (t.startswith("-D") and name or t in ("split=4", "split=8"))):
                ap.error(f"variant token {t!r}: expected -DNAME=INT or split=4 / split=8")
    try:
        import cupy as cp
    except ImportError:
        ap.error("CuPy is not installed: this script runs on the GPU machine")
    from node.backend_cuda import mq_record_bytes

    variants = [(v or "defaults", *compile_variant(cp, args.kernel, v.split())) for v in args.variants]
    report = {"kernel": args.kernel, "shapes": args.shapes, "runs": [],
              "variants": {name: {"registers": fns[0].fn.num_regs, "local_bytes": fns[0].fn.local_size_bytes}
                           for name, fns, _ in variants}}
    for shape, (ns, k, qtype) in SHAPES[args.shapes].items():
        nbytes = sum(ns) * k * 2 if args.kernel == "matmul_f" else \
            sum(-(-n // 16) for n in ns) * (k // 32) * mq_record_bytes(qtype)   # bytes the kernel reads
        copies = int(300e6 // nbytes) + 1      # cycle over > 300 MB: no L2 reuse
        wsets = [[weights(cp, args.kernel, qtype, n, k) for n in ns] for _ in range(copies)]
        for m in BATCHES:
            x = cp.random.standard_normal((m, k), dtype=cp.float32)
            first = None
            for name, fns, params in variants:
                us, out = time_variant(cp, args.kernel, fns, params, ns, k, qtype, x, wsets, args.once)
                first = first or out
                run = {"shape": shape, "batch": m, "variant": name, "us": round(us, 1),
                       "GB_per_s": round(nbytes / us / 1e3) if us else None, "same_bytes": out == first}
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
        del wsets
        cp.get_default_memory_pool().free_all_blocks()
    from attest.atomic import atomic_write
    atomic_write(args.out, json.dumps(report, indent=1).encode())
    return 0 if all(r["same_bytes"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
