"""What contract 2's integer products of float weights cost in fidelity (CPU).

Contract 2 (docs/determinism.md section 14) multiplies F32/F16/BF16 weights as
integer codes: each weight row and each token's input with one power-of-two
scale (``rne(a / 2^(E - bits))``, E the binary exponent of the row's largest
magnitude; 12 bits for weights, 19 for inputs), the dot product the exact
integer sum of code products, the output that integer times both scales,
rounded once to fp32. Its sums are exact in any order, so int8 tensor cores
compute it; its codes round the weights and inputs. This script measures that
rounding on real weights: the default model's matrices dequantized and
rounded to BF16 (a BF16 copy of SmolLM2-135M), run by the CPU engine:

* ``contract``: contract 1 (node/reference.py matmul_f, fp32 lane sums);
* ``float64``: every product in float64, rounded once to fp32 (a near-exact
  reference for how far each contract is from the real value);
* ``rowint``: contract 2 (node/reference.py matmul_rowint).

For each prompt it reports the largest logit difference from ``float64`` at
every prefill position and greedy step, and how many greedy tokens each
contract keeps in common with ``float64``.

    python scripts/rowint_fidelity.py [--tokens 48] [--out rowint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from node import reference  # noqa: E402
from node.engine import Engine  # noqa: E402
from node.gguf_model import default_model_path, dequantize_rows, load_model  # noqa: E402
from node.synth import copy_model  # noqa: E402
from node.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
]
def bf16_copy(src: str, dst: str) -> str:
    """``src`` with every 2-D tensor dequantized and rounded to BF16 (round to nearest even)."""
    from gguf import GGMLQuantizationType

    model = load_model(src)

    def to_bf16(name, data, qtype):
        if data.ndim != 2:
            return None
        t = model.tensors[name]
        v = dequantize_rows(t, np.arange(t.rows)).astype(np.float32).view(np.uint32)
        return ((v + 0x7FFF + ((v >> 16) & 1)) >> 16).astype(np.uint16), GGMLQuantizationType.BF16

    return copy_model(src, dst, tensor=to_bf16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--out")
    args = ap.parse_args()

    path = bf16_copy(default_model_path(), os.path.join(tempfile.mkdtemp(), "smollm2-bf16.gguf"))
    model = load_model(path)
    tok = Tokenizer(model)
    contract = reference.matmul_f

    def f64(x, w, g=None, lanes=reference.WARP):
        return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)

    rules = {"contract": (1, contract), "float64": (1, f64), "rowint": (2, contract)}
    report = {"model": "SmolLM2-135M-Instruct, 2-D tensors as BF16", "tokens": args.tokens, "prompts": []}
    for prompt in PROMPTS:
        ids = tok.encode(tok.render_chat([{"role": "user", "content": prompt}]), special=True)
        runs = {}
        for name, (version, fn) in rules.items():
            reference.matmul_f = fn
            eng = Engine(model, contract=version)
            seq = eng.new_sequence()
            logits = [eng.forward([(seq, ids)])[0]]
            out = []
            for _ in range(args.tokens):
                out.append(int(np.argmax(logits[-1])))
                logits.append(eng.forward([(seq, [out[-1]])])[0])
            runs[name] = (out, logits)
        reference.matmul_f = contract
        ref_out, ref_logits = runs["float64"]
        entry = {"prompt": prompt}
        for name in ("contract", "rowint"):
            out, logits = runs[name]
            same = next((i for i, (a, b) in enumerate(zip(out, ref_out)) if a != b), len(out))
            # logit differences over the steps both runs share the same tokens (prefill and after)
            diffs = [float(np.max(np.abs(a - b))) for a, b in zip(logits[:same + 1], ref_logits[:same + 1])]
            entry[name] = {"same_greedy_tokens": same, "max_logit_diff": max(diffs),
                           "median_step_max_diff": float(np.median(diffs))}
        entry["text"] = tok.decode(ref_out)
        report["prompts"].append(entry)
        print(json.dumps(entry), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
