"""Fidelity of the numpy engine to llama.cpp and to a float64 forward pass.

On the default model (SmolLM2-135M-Instruct Q4_1) and 22 varied prompts:

(a) first-step logits (after prefill) of our engine against llama.cpp
    (llama-cpp-python, CPU, ``n_batch=1``): max abs difference, also relative
    to llama.cpp's max abs logit, and the least-squares slope of ours on
    theirs (a systematic scale error shows there long before in the maxima);
(b) top-1 agreement over 32 greedy steps: we greedy-decode 32 tokens, and at
    every step llama.cpp, fed exactly our tokens (teacher forcing, one
    ``eval`` per token), must mostly pick the same argmax, and every
    disagreement must be a near tie in both engines' logits.

The engines are not expected to agree bit for bit: llama.cpp keeps the KV
cache in F16 and quantizes activations with its own kernels (block scales
rounded to F16, other summation orders), so logits of magnitude ~20 differ
by a few tenths to about one. The bounds below come from measurement
(2026-11-29, docs/benchmarks.md "Fidelity to llama.cpp (CPU)") with a 50%
margin; see the comment above the bounds.
The per-prompt table is printed even when output is captured.

A float64 reference (weights dequantized with
:func:`node.gguf_model.dequantize_rows`, no activation quantization, written
here independently of node/reference.py) checks that we compute the model:
first-step logits within a tolerance and the same top-1 token.

Set ``BITEXACT_FIDELITY_REPORT=path`` to also write the per-prompt table as
Markdown.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from node.engine import Engine
from node.gguf_model import default_model_path, dequantize_rows, float_values, load_model
from node.synth import copy_model
from node.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

STEPS = 32
DECODE_GROUP = 11  # sequences per decode step (fastest measured on 2 cores: 8..11)

# ---- bounds ----------------------------------------------------------------
# Both engines are deterministic run to run, so every run on one machine
# measures the same numbers. Measured on 2026-11-29 (docs/benchmarks.md). The
# maxima are heavy-tailed: rounding-level changes to our engine that leave the
# model the same (RoPE positions shifted by one, which RoPE's relative form
# cancels; RMSNorm eps 1e-6 for 1e-5) moved some of them by up to 1.5x, so each
# bound is about 1.5x the largest value seen across the engine and those two
# variants. A real bug (RoPE base 10000 for 100000) fails every bound.
FIRST_ABS_MAX = 2.5         # per prompt, max |ours - llama.cpp| at step 1; measured max 1.651 (es)
FIRST_REL_MAX = 0.115       # the same / max |llama.cpp logit|; measured max 0.0771 (es)
FIRST_ABS_MEAN_MAX = 1.12   # mean over prompts of the first; measured 0.746 (variants <= 0.773)
ALL_STEPS_ABS_MAX = 5.7     # max over all 32 teacher-forced steps; measured 2.533 (num-seq),
                            # variants up to 3.774
MIN_AGREEMENT = 0.93        # aggregate top-1 agreement; measured 674/704 = 0.957 (variants
                            # >= 0.9545): disagreement <= 4.55%, bound 7%
TIE_MARGIN = 1.0            # every disagreement is a near tie: the winner leads the other
                            # engine's pick by at most this in either engine's logits;
                            # measured max 0.396 (variants up to 0.691)
SLOPE_TOL = 0.004           # mean over prompts of the least-squares slope of our step-1
                            # logits on llama.cpp's must be 1 within this; measured 1.0012
                            # (variants 0.9998, 1.0000; per-prompt spread ~0.006, so ~3 sigma).
                            # Catches a 1% logit scale error (1.0112) that the maxima miss.
F64_ABS_MAX = 1.4           # max |ours - float64| at step 1 (chat-system); measured 0.732
                            # (variants up to 0.941)
F64_REL_MAX = 0.057         # the same / max |float64 logit|; measured 0.0294 (variants <= 0.038)

LONG_EN = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used to make wine. Within fifty years printing shops had opened in more than two "
    "hundred European cities, and the number of books in circulation grew from tens of "
    "thousands to millions. Scholars could compare identical copies of a text, scientists "
    "could share diagrams without errors introduced by copyists, and reformers could spread "
    "pamphlets faster than authorities could suppress them. Historians still debate which of "
    "these effects mattered most, but almost all agree that"
)
LONG_CODE = '''import json
from dataclasses import dataclass


@dataclass
class Account:
    owner: str
    balance: float = 0.0

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount

    def withdraw(self, amount: float) -> None:
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount


def load_accounts(path: str) -> list[Account]:
    with open(path) as f:
        data = json.load(f)
    return [Account(**row) for row in data]


def total_balance(accounts: list[Account]) -> float:
'''

# (name, plain text) or (name, chat messages)
PROMPTS = [
    ("en-short", "The capital of France is"),
    ("en-one-word", "Hello"),
    ("en-story", "Once upon a time, in a small village by the sea, there lived"),
    ("en-long", LONG_EN),
    ("py-fib", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ("c-loop", "#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 10; i++) {\n"),
    ("json", '{"name": "Alice", "age": 30, "languages": ["Python", '),
    ("py-long", LONG_CODE),
    ("num-seq", "1, 1, 2, 3, 5, 8, 13, 21,"),
    ("num-arith", "Q: What is 17 * 23?\nA: 17 * 23 ="),
    ("num-mixed", "In 1969 the Apollo 11 mission landed on the Moon; pi is 3.14159 and e is"),
    ("fr", "La tour Eiffel est située à Paris, et elle"),
    ("de", "Die Hauptstadt von Deutschland ist Berlin. Die Stadt hat"),
    ("es", "El perro corre por el parque porque"),
    ("zh", "中国的首都是北京。上海是"),
    ("ru", "Москва — столица России. Она"),
    ("ja", "東京は日本の首都です。"),
    ("emoji-md", "## Shopping list\n- 🍕 pizza\n- ☕ coffee\n-"),
    ("chat-capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat-system", [{"role": "system", "content": "You are a terse assistant."},
                     {"role": "user", "content": "Write a haiku about autumn."}]),
    ("chat-multi", [{"role": "user", "content": "Hi! Can you help me with math?"},
                    {"role": "assistant", "content": "Of course. What do you need?"},
                    {"role": "user", "content": "What is 12 squared?"}]),
    ("chat-code", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
]


def _quiet_llama(path):
    """llama_cpp.Llama with llama.cpp's loader chatter on fd 2 silenced."""
    import llama_cpp

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        return llama_cpp.Llama(path, n_ctx=512, n_batch=1, logits_all=True, verbose=False)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def prompt_ids(tok, prompt):
    if isinstance(prompt, str):
        return tok.encode(prompt)
    return tok.encode(tok.render_chat(prompt), special=True)


def ours_greedy_batched(eng, prompts, steps, group=DECODE_GROUP):
    """Greedy-decode ``steps`` tokens for every prompt (token id lists); yields
    ``(index, tokens, logits of each step)``.

    Each prompt is prefilled alone; then ``group`` sequences at a time decode
    one token each per engine step. The engine's contract (docs/determinism.md)
    makes a sequence's logits independent of what else is in the step, so this
    gives exactly the bytes of decoding each prompt alone (the fixture
    spot-checks it), about twice as fast: a decode step is mostly bound by
    reading the weights, whatever its batch.
    """
    for g in range(0, len(prompts), group):
        seqs = [eng.new_sequence() for _ in prompts[g:g + group]]
        try:
            logits = [eng.forward([(s, p)])[0] for s, p in zip(seqs, prompts[g:g + group])]
            toks = [[] for _ in seqs]
            out = [[] for _ in seqs]
            for i in range(steps):
                for j, lg in enumerate(logits):
                    out[j].append(lg)
                    toks[j].append(int(np.argmax(lg)))
                if i + 1 < steps:
                    logits = eng.forward([(s, [t[-1]]) for s, t in zip(seqs, toks)])
        finally:
            for s in seqs:
                eng.release(s)
        for j, (t, o) in enumerate(zip(toks, out)):
            yield g + j, t, o


def llama_forced(llm, ids, toks):
    """llama.cpp's logits at each step on our prefix (prompt, then our tokens)."""
    llm.reset()
    llm.eval(ids)
    out = []
    for i, t in enumerate(toks):
        out.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        if i + 1 < len(toks):
            llm.eval([t])
    return out


def compare(name, ids, toks, ours, theirs):
    d0 = float(np.max(np.abs(ours[0] - theirs[0])))
    agree, ties = 0, []
    for t, a, b in zip(toks, ours, theirs):
        lt = int(np.argmax(b))
        if lt == t:
            agree += 1
        else:
            # how far ahead each engine's own pick was, in its own logits (both >= 0)
            ties.append((float(a[t] - a[lt]), float(b[lt] - b[t])))
    x, y = theirs[0].astype(np.float64), ours[0].astype(np.float64)
    x = x - x.mean()
    return {
        "name": name, "n_prompt": len(ids), "steps": len(toks),
        "slope": float(np.dot(x, y - y.mean()) / np.dot(x, x)),
        "first_abs": d0, "first_rel": d0 / float(np.max(np.abs(theirs[0]))),
        "max_logit": float(np.max(np.abs(theirs[0]))),
        "all_abs": max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs)),
        "agree": agree, "tie_gaps": ties,
    }


def report(request, text):
    """Print ``text`` past pytest's output capture."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        print(text)
        return
    with capman.global_and_fixture_disabled():
        print(text)


def markdown(rows):
    lines = ["| prompt | prompt tokens | steps | max abs diff, step 1 | max abs logit | relative "
             "| slope | max abs diff, all steps | top-1 agree |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['n_prompt']} | {r['steps']} | {r['first_abs']:.3f} "
                     f"| {r['max_logit']:.2f} | {r['first_rel']:.4f} | {r['slope']:.4f} | {r['all_abs']:.3f} "
                     f"| {r['agree']}/{r['steps']} |")
    n = sum(r["steps"] for r in rows)
    a = sum(r["agree"] for r in rows)
    fa = [r["first_abs"] for r in rows]
    fr = [r["first_rel"] for r in rows]
    lines.append(f"| **all {len(rows)}** | {sum(r['n_prompt'] for r in rows)} | {n} "
                 f"| max {max(fa):.3f}, mean {np.mean(fa):.3f} | | max {max(fr):.4f} "
                 f"| mean {np.mean([r['slope'] for r in rows]):.4f} "
                 f"| max {max(r['all_abs'] for r in rows):.3f} | {a}/{n} ({a / n:.2%}) |")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer(model)


@pytest.fixture(scope="module")
def fidelity(model, tok, request):
    eng = Engine(model)
    llm = _quiet_llama(model.path)
    ids = [prompt_ids(tok, p) for _, p in PROMPTS]
    assert all(len(i) + STEPS <= 512 for i in ids)
    t0 = time.perf_counter()
    ours = {i: (toks, lg) for i, toks, lg in ours_greedy_batched(eng, ids, STEPS)}
    t1 = time.perf_counter()
    theirs = {i: llama_forced(llm, ids[i], ours[i][0]) for i in ours}
    t2 = time.perf_counter()
    # The grouped run is our greedy decode: spot-check two steps of one prompt
    # against a solo run.
    seq = eng.new_sequence()
    solo = [eng.forward([(seq, ids[0])])[0]]
    solo += eng.forward([(seq, ours[0][0][:1])])
    eng.release(seq)
    assert [x.tobytes() for x in solo] == [x.tobytes() for x in ours[0][1][:2]]
    rows, first = [], {}
    for i, (name, _) in enumerate(PROMPTS):
        rows.append(compare(name, ids[i], ours[i][0], ours[i][1], theirs[i]))
        first[name] = (ids[i], ours[i][1][0], theirs[i][0])
    table = markdown(rows)
    out = os.environ.get("BITEXACT_FIDELITY_REPORT")
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
    gaps = ", ".join(f"{r['name']} {g:.3f}/{h:.3f}" for r in rows for g, h in r["tie_gaps"]) or "none"
    report(request, f"\nfidelity to llama.cpp (ours {t1 - t0:.0f} s, llama.cpp {t2 - t1:.0f} s):\n"
                    f"{table}\ndisagreements (lead of the winner, ours/llama.cpp): {gaps}")
    return rows, first


def test_first_step_logits_close_to_llama_cpp(fidelity):
    rows, _ = fidelity
    assert len(rows) >= 20
    bad = [r["name"] for r in rows if r["first_abs"] > FIRST_ABS_MAX or r["first_rel"] > FIRST_REL_MAX]
    assert not bad, f"first-step logits too far from llama.cpp: {bad}"
    mean = float(np.mean([r["first_abs"] for r in rows]))
    assert mean <= FIRST_ABS_MEAN_MAX, f"mean first-step max abs diff {mean:.3f}"


def test_no_systematic_logit_scale(fidelity):
    rows, _ = fidelity
    slope = float(np.mean([r["slope"] for r in rows]))
    assert abs(slope - 1.0) <= SLOPE_TOL, f"our logits are llama.cpp's scaled by {slope:.4f}"


def test_teacher_forced_logits_close_to_llama_cpp(fidelity):
    rows, _ = fidelity
    bad = [(r["name"], round(r["all_abs"], 3)) for r in rows if r["all_abs"] > ALL_STEPS_ABS_MAX]
    assert not bad, f"logits too far from llama.cpp at some step: {bad}"


def test_greedy_top1_agrees_with_llama_cpp(fidelity):
    rows, _ = fidelity
    n = sum(r["steps"] for r in rows)
    assert len(rows) >= 20 and all(r["steps"] == STEPS for r in rows) and n >= 20 * 32
    agree = sum(r["agree"] for r in rows)
    assert agree / n >= MIN_AGREEMENT, f"top-1 agreement {agree}/{n}"
    gaps = [(r["name"], g, h) for r in rows for g, h in r["tie_gaps"]]
    assert all(max(g, h) <= TIE_MARGIN for _, g, h in gaps), f"disagreements that are not near ties: {gaps}"


# ---- independent float64 reference -------------------------------------------

def float64_logits(model, ids):
    """Last-token logits of the llama forward pass in float64: dequantized weights
    (exact fp32 values, widened), no activation quantization, libm RoPE/exp."""
    hp, tw = model.hparams, model.tensors
    hd, n = hp.head_dim, len(ids)

    def mat(name):
        t = tw[name]
        return dequantize_rows(t, np.arange(t.rows)).astype(np.float64)

    def vec(name):
        return float_values(tw[name])[0].astype(np.float64)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + hp.rms_eps) * w

    inv = hp.rope_base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    theta = np.arange(n, dtype=np.float64)[:, None] * inv * hp.rope_freq_scale
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]

    def rope(v):  # adjacent pairs (ggml ROPE_TYPE_NORM, the llama architecture)
        o = np.empty_like(v)
        a, b = v[..., 0::2], v[..., 1::2]
        o[..., 0::2] = a * cos - b * sin
        o[..., 1::2] = a * sin + b * cos
        return o

    grp = hp.n_head // hp.n_head_kv
    mask = np.triu(np.full((n, n), -np.inf), 1)
    x = dequantize_rows(tw["token_embd.weight"], np.asarray(ids)).astype(np.float64)
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        h = rms(x, vec(p + "attn_norm.weight"))
        q = rope((h @ mat(p + "attn_q.weight").T).reshape(n, hp.n_head, hd))
        k = rope((h @ mat(p + "attn_k.weight").T).reshape(n, hp.n_head_kv, hd))
        v = (h @ mat(p + "attn_v.weight").T).reshape(n, hp.n_head_kv, hd)
        k, v = np.repeat(k, grp, axis=1), np.repeat(v, grp, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", s, v).reshape(n, hp.n_embd)
        x = x + att @ mat(p + "attn_output.weight").T
        h = rms(x, vec(p + "ffn_norm.weight"))
        g, u = h @ mat(p + "ffn_gate.weight").T, h @ mat(p + "ffn_up.weight").T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ mat(p + "ffn_down.weight").T
    h = rms(x[-1:], vec("output_norm.weight"))
    out = model.output
    logits = np.empty(out.rows)
    for a in range(0, out.rows, 8192):
        r = np.arange(a, min(a + 8192, out.rows))
        logits[r] = (h @ dequantize_rows(out, r).astype(np.float64).T)[0]
    return logits


def test_first_step_logits_close_to_float64(model, fidelity, request):
    _, first = fidelity
    ids, ours, theirs = first["chat-system"]
    ref = float64_logits(model, ids)
    d = float(np.max(np.abs(ours - ref)))
    dl = float(np.max(np.abs(theirs - ref)))
    rel = d / float(np.max(np.abs(ref)))
    top5 = lambda z: set(np.argsort(z)[-5:].tolist())  # noqa: E731
    report(request, f"\nfloat64 reference, chat-system, {len(ids)} tokens: max|ours - f64| {d:.3f} "
                    f"(relative {rel:.4f}), max|llama.cpp - f64| {dl:.3f}, max|f64| "
                    f"{np.max(np.abs(ref)):.2f}, top-1 f64 {int(np.argmax(ref))} ours "
                    f"{int(np.argmax(ours))}, top-5 sets equal {top5(ref) == top5(ours)}")
    assert int(np.argmax(ours)) == int(np.argmax(ref))
    assert d <= F64_ABS_MAX and rel <= F64_REL_MAX


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_a_rope_scaling_factor_without_a_type_scales_as_in_llama_cpp(tmp_path, tok, key):
    """A GGUF with a RoPE scaling factor (or its older key) and no scaling type:
    llama.cpp takes the type as linear. Our prefill logits after 120 tokens stay
    as close to llama.cpp's as the fidelity bounds require, and the reading that
    ignores the factor would be far off (so the check can tell them apart)."""
    import dataclasses

    path = copy_model(default_model_path(), str(tmp_path / "scaled.gguf"), {key: 4.0})
    scaled = load_model(path)
    assert scaled.hparams.rope_freq_scale == 0.25
    ids = tok.encode(LONG_EN)[:120]
    llm = _quiet_llama(path)
    llm.eval(ids)
    theirs = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)

    def prefill(m):
        eng = Engine(m)
        return eng.forward([(eng.new_sequence(), ids)])[0]
    ours = prefill(scaled)
    wrong = prefill(dataclasses.replace(scaled, hparams=dataclasses.replace(scaled.hparams, rope_freq_scale=1.0)))
    near, far = float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(wrong - theirs)))
    print(f"\nRoPE scaling via {key}: max |ours - llama.cpp| {near:.3f}, ignoring the factor {far:.3f}")
    assert near <= FIRST_ABS_MAX and far > 2 * FIRST_ABS_MAX, (near, far)
