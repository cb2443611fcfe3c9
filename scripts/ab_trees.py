"""A/B benchmark of source trees: the GPU time of one decode step of each tree's
CUDA engine on the same synthetic model, alternating trees over several rounds.

Each tree (a checkout, e.g. ``git archive REV | tar -x -C old``) runs in its
own process with that tree first on ``sys.path``; the step is the bucket's
CUDA graph replayed back to back (scripts/bench_gpu.py ``graph_replay_ms``).
Every tree must give the same logits bytes: the SHA-256 of the last decode
step's logits is reported per tree and batch, and a mismatch exits 1.

    python scripts/ab_trees.py --out ab.json [--shape llama-8b] [--layers 4] [--qtype BF16]
        [--batches 1 8 32] [--rounds 2] [--one-launch] TREE [TREE ...]

With ``--one-launch`` every tree runs each step in one launch (cuda/step.cu;
trees from before it fail).

The model is written once to the temporary folder (``ab-SHAPE-NL-QTYPE.gguf``;
3.8 GB for the default 4-layer 8B slice in BF16) and reused by later runs.
Output: JSON with, per tree, the median over rounds of GPU ms per step at each
batch size, every round's figure and the digests. Exit codes: 0 all trees
agree, 1 a digest differs or a tree's run failed, 2 bad arguments or no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs inside one tree's process: argv = tree, model path, batches (comma separated), replays,
# this tree's scripts/, and "1" for the one-launch step.
RUNNER = r"""
import hashlib, json, sys
tree, path, batches, n = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
sys.path.insert(0, tree)
sys.path.insert(1, sys.argv[5])
import numpy as np
from node.engine import Engine
from node.gguf_model import load_model
from bench_gpu import graph_replay_ms
opts = {"one_launch": True} if sys.argv[6] == "1" else {}
eng = Engine(load_model(path), "cuda", n_ctx=2048, pin=None, **opts)
if opts and eng.backend.step is None:
    sys.exit("the model does not fit the one-launch step (node/backend_cuda.py step_defines)")
out = {}
for b in batches:
    seqs = [eng.new_sequence() for _ in range(b)]
    eng.forward([(s, [1 + i % 7, 2, 3, 4, 5, 6, 7, 8]) for i, s in enumerate(seqs)])
    eng.forward([(s, [9]) for s in seqs])   # captures the bucket's graph
    logits = eng.forward([(s, [10]) for s in seqs])
    ms = min(graph_replay_ms(eng.backend, b, n) for _ in range(3))
    out[b] = {"gpu_ms_step": round(ms, 4),
              "logits_sha256": hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()}
    for s in seqs:
        eng.release(s)
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="source trees (directories holding node/ and cuda/)")
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--shape", default="llama-8b", help="node.synth shape (default llama-8b)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the shape to keep (default 4)")
    ap.add_argument("--qtype", default="BF16", help="weight type of every matrix (default BF16)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=30, help="graph replays per timing (default 30)")
    ap.add_argument("--one-launch", action="store_true", help="each step in one launch (cuda/step.cu)")
    args = ap.parse_args()
    bad = [t for t in args.trees if not os.path.isfile(os.path.join(t, "node", "engine.py"))]
    if bad:
        print(f"ab_trees: not a source tree: {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver or no GPU: the same answer
        print(f"ab_trees: needs a GPU with CuPy (pip install -e '.[cuda]'): {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    sys.path.insert(0, ROOT)
    from node.synth import write_model

    path = os.path.join(tempfile.gettempdir(), f"ab-{args.shape}-{args.layers}L-{args.qtype}.gguf")
    if not os.path.exists(path):
        write_model(path + ".part", args.shape, args.qtype, seed=1, n_layer=args.layers)
        os.replace(path + ".part", path)
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for t in args.trees:
            p = subprocess.run([sys.executable, "-c", RUNNER, os.path.abspath(t), path,
                                ",".join(map(str, args.batches)), str(args.replays),
                                os.path.join(ROOT, "scripts"), "1" if args.one_launch else "0"],
                               capture_output=True, text=True)
            if p.returncode:
                print(f"ab_trees: {t} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
            runs[t].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r} {t}: {runs[t][-1]}", flush=True)
    res = {"model": {"shape": args.shape, "layers": args.layers, "qtype": args.qtype},
           "one_launch": args.one_launch, "trees": {}}
    digests = set()
    for t, rs in runs.items():
        res["trees"][t] = {str(b): {"median_gpu_ms_step": statistics.median(x[str(b)]["gpu_ms_step"] for x in rs),
                                    "rounds": [x[str(b)]["gpu_ms_step"] for x in rs],
                                    "logits_sha256": sorted({x[str(b)]["logits_sha256"] for x in rs})}
                           for b in args.batches}
        digests.add(tuple(tuple(v["logits_sha256"]) for v in res["trees"][t].values()))
    res["same_bytes"] = len(digests) == 1
    from attest.atomic import atomic_write
    atomic_write(args.out, json.dumps(res, indent=1).encode())
    print(json.dumps(res, indent=1))
    return 0 if res["same_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
