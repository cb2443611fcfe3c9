"""One request from text to output tokens, with the per-step digest chain.

Used identically by ``bitexact run`` and by the verifier, so a re-execution
takes exactly the operator's path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attest import digest
from .engine import Engine
from .errors import RequestError
from .sampler import SamplingParams, sample
from .tokenizer import Tokenizer

PREFILL_CHUNK = 128  # tokens per prefill step; any value gives the same bytes


@dataclass
class Request:
    """A completion request. Exactly one of ``prompt`` / ``messages`` is set."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)


@dataclass
class Result:
    request: dict            # the attested request record (docs/attestation.md)
    tokens: list[int]
    text: str
    finish_reason: str       # "stop" (EOS or stop string) or "length"
    step_chain: list[bytes]
    digest: bytes


def _validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("chat messages must be a non-empty list")
    for m in messages:
        if not (isinstance(m, dict) and set(m) == {"role", "content"}
                and isinstance(m["role"], str) and isinstance(m["content"], str)):
            raise RequestError("each chat message must be {\"role\": str, \"content\": str}")


def build_request(req: Request, tok: Tokenizer, n_ctx: int) -> dict:
    """Validate ``req`` and return its attested record with prompt token ids.

    Raises :class:`RequestError` for an empty prompt, a prompt that leaves no
    room in the context, ``max_tokens <= 0`` or bad sampling parameters.
    """
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give exactly one of a prompt or chat messages")
    if not isinstance(req.max_tokens, int) or req.max_tokens <= 0:
        raise RequestError(f"max tokens must be a positive integer, got {req.max_tokens}")
    req.params.validate()
    if any(not isinstance(s, str) or not s for s in req.stop):
        raise RequestError("stop strings must be non-empty")
    if req.messages is not None:
        _validate_messages(req.messages)
        text = tok.render_chat(req.messages)
        ids = tok.encode(text, special=True)
        mode = "chat"
    else:
        if not req.prompt or not req.prompt.strip():
            raise RequestError("the prompt is empty")
        text, ids, mode = req.prompt, tok.encode(req.prompt), "prompt"
    if len(ids) >= n_ctx:
        raise RequestError(f"the prompt is {len(ids)} tokens; the context holds {n_ctx} (one must stay free)")
    p = req.params
    return {"mode": mode, "prompt": text, "messages": req.messages, "prompt_tokens": ids,
            "max_tokens": req.max_tokens, "n_ctx": n_ctx, "temperature": float(p.temperature),
            "top_k": int(p.top_k), "top_p": float(p.top_p), "seed": int(p.seed), "stop": list(req.stop)}


def params_of(record: dict) -> SamplingParams:
    return SamplingParams(temperature=record["temperature"], top_k=record["top_k"],
                          top_p=record["top_p"], seed=record["seed"])


def generate(engine: Engine, tok: Tokenizer, record: dict, on_token=None) -> Result:
    """Run the request ``record`` (from :func:`build_request`) on ``engine``.

    Prefill in chunks of :data:`PREFILL_CHUNK`, then decode one token per
    step until EOS, a stop string, ``max_tokens`` or the context end.
    ``on_token(i, token_id)`` is called after each step.
    """
    params = params_of(record)
    ids = list(record["prompt_tokens"])
    link = digest.chain_start(bytes.fromhex(engine.model.sha256), record)
    seq = engine.new_sequence()
    try:
        for a in range(0, len(ids), PREFILL_CHUNK):
            logits = engine.forward([(seq, ids[a:a + PREFILL_CHUNK])])[0]
        tokens, chain, finish, text = [], [], "length", ""
        while True:
            pos = len(ids) + len(tokens)
            t = sample(logits, params, pos)
            link = digest.chain_step(link, t, logits)
            tokens.append(t)
            chain.append(link)
            if on_token:
                on_token(len(tokens) - 1, t)
            if t == tok.eos_id:
                finish, text = "stop", tok.decode(tokens[:-1])
                break
            text = tok.decode(tokens)
            cut = [text.find(s) for s in record["stop"] if s in text]
            if cut:
                finish, text = "stop", text[:min(cut)]
                break
            if len(tokens) >= record["max_tokens"] or pos + 1 >= engine.n_ctx:
                break
            logits = engine.forward([(seq, [t])])[0]
    finally:
        engine.release(seq)
    out = digest.output_digest(link, tokens, text, finish)
    return Result(record, tokens, text, finish, chain, out)


def greedy_logits(engine: Engine, ids: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy-decode ``steps`` tokens after ``ids``; returns tokens and each step's logits."""
    seq = engine.new_sequence()
    try:
        logits = engine.forward([(seq, ids)])[0]
        toks, all_logits = [], []
        for _ in range(steps):
            all_logits.append(logits)
            toks.append(int(np.argmax(logits)))
            logits = engine.forward([(seq, [toks[-1]])])[0]
        return toks, all_logits
    finally:
        engine.release(seq)
