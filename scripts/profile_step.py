"""Where a CUDA decode step spends its time, kernel by kernel.

Writes a synthetic Llama-shaped GGUF, runs decode steps through the engine's
CUDA graphs, and reports per batch size: the step as ``Engine.forward``
returns it (host work and the logits copy included), the GPU time of the
replayed graph alone (CUDA events), and each kernel's GPU time per step as
CUPTI records it during graph replay (through PyTorch's profiler, which sees
every kernel of the process). Kernels start before their predecessor ends
(programmatic dependent launch), so each kernel's exposed time is also given:
its end minus the previous kernel's end, the share of the step it adds; the
last replay is listed launch by launch. With ``--one-launch`` (F16/BF16
models) the engine runs each step in one launch (cuda/step.cu) built with
``ST_TIMES``: block 0's ``%globaltimer`` after each grid barrier gives each
phase's time (medians over tiles and layers; a phase includes the barrier
that ends it) and the LM head's; each ``--variant=FLAGS`` profiles a build
of cuda/step.cu with those ``-D`` flags added (e.g. ``--variant=-DST_STAGES=5``;
``--variant=`` is the node's build), one engine each. Every run reports the
SHA-256 of its last step's logits, so variants must show one digest.
``--contract 2`` profiles the per-op step of determinism contract 2
(docs/determinism.md section 14).

    python scripts/profile_step.py [--shape llama-8b] [--qtype BF16] [--layers 4] [--batch 1 32] [--one-launch]
                                   [--contract 1|2] [--variant=FLAGS ...] [--out prof.json]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import graph_replay_ms  # noqa: E402

import numpy as np  # noqa: E402

from node import backend_cuda  # noqa: E402
from node.backend_cuda import ST_TM  # noqa: E402


def kernel_ms(replay, n: int = 5) -> dict:
    """Per kernel name over ``n`` graph replays: GPU milliseconds per step as CUPTI
    records each kernel ("ms": first block start to last block end, which with
    programmatic dependent launch includes the wait on the previous kernel), and
    its exposed share of the step ("exposed_ms": the kernel's end minus the
    previous kernel's end, summed; these add up to the replays' span)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
    events = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA"), key=lambda ev: ev.time_range.end)
    totals = collections.defaultdict(lambda: [0.0, 0, 0.0])
    prev_end, last = None, []
    for i, ev in enumerate(events):
        t = totals[ev.name]
        t[0] += ev.device_time / 1e3 / n
        t[1] += 1
        exposed = 0.0 if prev_end is None else max(0.0, ev.time_range.end - max(prev_end, ev.time_range.start))
        t[2] += exposed / 1e3 / n
        prev_end = ev.time_range.end if prev_end is None else max(prev_end, ev.time_range.end)
        if i >= len(events) - len(events) // n:
            last.append([ev.name, round(ev.device_time, 1), round(exposed, 1)])
    return {"by_name": {k: {"ms": round(v[0], 4), "exposed_ms": round(v[2], 4), "launches": v[1] // n}
                        for k, v in sorted(totals.items(), key=lambda kv: -kv[1][2])},
            "last_replay_us": last}  # [name, duration, exposed] per launch in order


STEP_PHASES = ("qkv", "attention", "o", "gate_up", "down")  # cuda/step.cu's phases, in order


def step_phases(times, layers: int, tiles: int) -> dict:
    """Microseconds per phase of one cuda/step.cu launch from its ST_TIMES stamps
    (ns: the start at 0, after the launch's barrier k at k, the end after the LM
    head's barrier): per (tile, layer) ``it`` the barriers 5 it + 1 (before Q/K/V;
    none for it = 0) to 5 it + 5 (before down); medians over ``tiles * layers``."""
    t = np.asarray(times, np.int64)
    per = {n: [] for n in STEP_PHASES}
    for it in range(tiles * layers):
        marks = [t[0] if it == 0 else t[5 * it + 1]] + [t[5 * it + j] for j in (2, 3, 4, 5, 6)]
        for n, a, b in zip(STEP_PHASES, marks, marks[1:]):
            per[n].append((b - a) / 1e3)
    end = 5 * tiles * layers
    return {"median_us": {n: round(float(np.median(v)), 2) for n, v in per.items()},
            "head_us": round(float(t[end + 2] - t[end + 1]) / 1e3, 2), "total_us": round(float(t[end + 2] - t[0]) / 1e3, 2)}


def profile_batch(eng, batch: int, steps: int) -> dict:
    import cupy as cp

    be = eng.backend
    seqs = [eng.new_sequence() for _ in range(batch)]
    eng.forward([(s, [1, 2, 3, 4, 5, 6, 7, 8]) for s in seqs])
    eng.forward([(s, [9]) for s in seqs])                    # capture the bucket's graph
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        out = eng.forward([(s, [10 + i]) for s in seqs])
    forward_ms = (time.perf_counter() - t0) / steps * 1e3
    graph = be._entry["graph"]   # the graph of the last decode step

    def replay():
        graph.launch(be.stream)
        be.stream.synchronize()

    gpu_ms = graph_replay_ms(be, batch, steps)
    kernels = kernel_ms(replay)
    phases = {}
    if be.step is not None:   # the last replay's stamps (the graph's tokens: the batch padded to its bucket)
        phases = {"step_phases": step_phases(be.to_host(be.step_times), eng.hp.n_layer,
                                             -(-be._entry["tokens"] // ST_TM))}
    for s in seqs:
        eng.release(s)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(x, np.float32).tobytes() for x in out)).hexdigest()
    return {"batch": batch, "logits_sha256": digest, "forward_ms": round(forward_ms, 3), "graph_gpu_ms": round(gpu_ms, 3),
            "kernel_sum_ms": round(sum(v["ms"] for v in kernels["by_name"].values()), 3),
            "exposed_sum_ms": round(sum(v["exposed_ms"] for v in kernels["by_name"].values()), 3), **phases,
            **kernels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--qtype", default="BF16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one-launch", action="store_true", help="each step in one launch (cuda/step.cu), timed by phase")
    ap.add_argument("--contract", type=int, choices=(1, 2), default=1, help="determinism contract (2: per-op kernels only)")
    ap.add_argument("--variant", action="append", default=None, metavar="FLAGS",
                    help="with --one-launch: extra -D flags of cuda/step.cu, one profile each (repeatable; '' = as built)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.one_launch and args.contract == 2:
        ap.error("--one-launch runs contract 1 only")

    from node.engine import Engine
    from node.gguf_model import load_model
    from node.synth import write_model

    path = write_model(os.path.join(tempfile.mkdtemp(), "m.gguf"), args.shape, args.qtype, seed=1,
                       n_layer=args.layers)
    # step stamps: 5 per tile and layer, and 3; the prefill of 8 tokens per sequence is the longest step
    tiles = -(-8 * max(args.batch) // ST_TM)
    opts = {"one_launch": True, "step_times": 5 * tiles * args.layers + 3} if args.one_launch else {}
    report = {"shape": args.shape, "qtype": args.qtype, "layers": args.layers, "contract": args.contract,
              "variants": []}
    import cupy as cp

    defines = backend_cuda.step_defines
    try:
        for variant in (args.variant or [""]) if args.one_launch else [""]:
            backend_cuda.step_defines = lambda model: (d + tuple(variant.split()) if (d := defines(model)) else d)
            eng = Engine(load_model(path), "cuda", n_ctx=2048, pin=None, contract=args.contract, **opts)
            if args.one_launch and eng.backend.step is None:
                print(f"{args.shape} {args.qtype} does not fit cuda/step.cu (node/backend_cuda.py step_defines)",
                      file=sys.stderr)
                return 2
            report["variants"].append({"flags": variant,
                                       "runs": [profile_batch(eng, b, args.steps) for b in args.batch]})
            del eng
            cp.get_default_memory_pool().free_all_blocks()
    finally:
        backend_cuda.step_defines = defines
        os.unlink(path)
    print(json.dumps(report, indent=1))
    if args.out:
        from attest.atomic import atomic_write
        atomic_write(args.out, json.dumps(report, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
