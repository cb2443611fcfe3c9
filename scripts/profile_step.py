"""Where a CUDA decode step spends its time, by op family.

Runs decode steps eagerly (no CUDA graph) on a synthetic Llama-shaped GGUF,
timing each backend op with CUDA events and a synchronisation after it, and
prints milliseconds per step per op family next to the graph-replay step time.
The per-op figures include one launch gap each; their sum exceeds the graph
step by the launch overhead that graphs remove.

    python scripts/profile_step.py [--shape llama-8b] [--qtype BF16] [--layers 4] [--batch 1 32] [--out prof.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPS = ("embed", "rms_norm", "linears", "rope", "attend", "silu_gate", "residual_add")


def op_key(name: str, args) -> str:
    if name != "linears":
        return name
    parts = [n.rsplit(".", 2)[-2] for n in args[1]]        # blk.0.attn_q.weight -> attn_q
    return "matmul " + "+".join(parts)


def profile(eng, batch: int, steps: int) -> dict:
    import cupy as cp

    be = eng.backend
    totals: dict[str, float] = collections.defaultdict(float)
    originals = {n: getattr(be, n) for n in OPS}

    def timed(name, fn):
        def run(*args):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(be.stream)
            out = fn(*args)
            end.record(be.stream)
            end.synchronize()
            totals[op_key(name, args)] += cp.cuda.get_elapsed_time(start, end)
            return out
        return run

    seqs = [eng.new_sequence() for _ in range(batch)]
    eng.forward([(s, [1, 2, 3, 4]) for s in seqs])
    be.graphs = False
    for n in OPS:
        setattr(be, n, timed(n, originals[n]))
    for i in range(steps):
        eng.forward([(s, [5 + i]) for s in seqs])
    for n in OPS:
        setattr(be, n, originals[n])
    be.graphs = True
    eng.forward([(s, [3]) for s in seqs])                    # capture
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        eng.forward([(s, [7 + i]) for s in seqs])
    graph_ms = (time.perf_counter() - t0) / steps * 1e3
    for s in seqs:
        eng.release(s)
    per_op = {k: round(v / steps, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    return {"batch": batch, "graph_step_ms": round(graph_ms, 3), "eager_sum_ms": round(sum(per_op.values()), 3),
            "ms_per_step": per_op}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--qtype", default="BF16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()

    from node.engine import Engine
    from node.gguf_model import load_model
    from node.synth import write_model

    path = write_model(os.path.join(tempfile.mkdtemp(), "m.gguf"), args.shape, args.qtype, seed=1,
                       n_layer=args.layers)
    eng = Engine(load_model(path), "cuda", n_ctx=2048, pin=None)
    report = {"shape": args.shape, "qtype": args.qtype, "layers": args.layers,
              "runs": [profile(eng, b, args.steps) for b in args.batch]}
    os.unlink(path)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
