"""One request from text to output tokens, with the per-step digest chain.

Used identically by ``bitexact run`` and by the verifier, so a re-execution
takes exactly the operator's path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from attest import digest
from attest.canonical import MAX_CONTAINERS
from .engine import Engine
from .errors import RequestError
from .sampler import SamplingParams
from .tokenizer import TextStream, Tokenizer

PREFILL_CHUNK = 128  # tokens per prefill step; any value gives the same bytes
MAX_STOP_CHARS = 4096  # characters of one stop string (bounds the work a token can cause)
MAX_STOP_STRINGS = 16  # stop strings of one request (with MAX_STOP_CHARS, bounds a verifier's work per token)
# chat messages of one request: each is a map of the attestation payload, which holds 13 arrays and maps of
# its own in chat mode, and a reader accepts at most MAX_CONTAINERS in all (docs/attestation.md)
MAX_MESSAGES = MAX_CONTAINERS - 13


class DuplicateName(ValueError):
    """A JSON object that gives one name twice (raised by :func:`unique_names`)."""


class RoundsToZero(ValueError):
    """A nonzero number that rounds to 0 as a double (raised by :func:`exact_float`)."""


def exact_float(text: str) -> float:
    """``float(text)`` (also ``json.loads``' ``parse_float`` hook), refusing a nonzero
    literal that underflows to 0 in IEEE 754 binary64, such as ``1e-400``: a request
    must not run with another value than the one it names (a temperature of 1e-400
    would be greedy decoding). Raises ValueError for text that is not a number and
    :class:`RoundsToZero` for an underflow."""
    v = float(text)
    # a nonzero digit before the exponent (float() reads any Unicode decimal digit)
    if v == 0.0 and any(c.isdecimal() and int(c) for c in text.lower().split("e")[0]):
        raise RoundsToZero(f"{text.strip()} is not 0 but rounds to 0 as a double (IEEE 754 binary64)")
    return v


def unique_names(pairs: list) -> dict:
    """``json.loads``' object hook: a name given twice in one object raises
    :class:`DuplicateName`. RFC 8259 section 4 leaves such an object's meaning
    to the parser (some take the first value, Python the last), so a proxy that
    checked one value could pass the node a request it runs with the other."""
    seen = set()
    for name, _ in pairs:
        if name in seen:
            raise DuplicateName(f"the name {name!r} appears twice in one object (RFC 8259 section 4)")
        seen.add(name)
    return dict(pairs)


@dataclass
class Request:
    """A completion request. Exactly one of ``prompt`` / ``messages`` is set."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Every check that needs no tokenizer or model; raises :class:`RequestError`
        for both or neither of prompt and messages, an empty or non-UTF-8 prompt,
        bad chat messages, ``max_tokens`` outside [1, 2**31), bad sampling
        parameters, more than :data:`MAX_STOP_STRINGS` stop strings or a bad
        one. :func:`build_request` runs it first."""
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of a prompt or chat messages")
        if not isinstance(self.max_tokens, int) or not 0 < self.max_tokens < 2 ** 31:
            raise RequestError(f"max tokens must be an integer in [1, 2**31), got {self.max_tokens}", "max_tokens")
        self.params.validate()
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"a request may have at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
                               "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
        for s in self.stop:
            _utf8(s, "stop string", "stop")
        if self.messages is not None:
            _validate_messages(self.messages)
        else:
            if not self.prompt or not self.prompt.strip():
                raise RequestError("the prompt is empty or only whitespace", "prompt")
            _utf8(self.prompt, "prompt", "prompt")


@dataclass
class Result:
    request: dict            # the attested request record (docs/attestation.md)
    tokens: list[int]
    text: str
    finish_reason: str       # "stop" (EOS or stop string) or "length"
    step_chain: list[bytes]
    digest: bytes


def _utf8(text: str, what: str, param: str) -> str:
    """``text`` if it encodes as UTF-8 (no lone surrogates), else :class:`RequestError`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"the {what} is not valid Unicode text (a lone surrogate?)", param) from None
    return text


def _validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("chat messages must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:   # its attestation would hold more maps than a reader accepts
        raise RequestError(f"a request may have at most {MAX_MESSAGES} chat messages, got {len(messages)}", "messages")
    for m in messages:
        if not (isinstance(m, dict) and set(m) == {"role", "content"}
                and isinstance(m["role"], str) and isinstance(m["content"], str)):
            raise RequestError("each chat message must be {\"role\": str, \"content\": str}", "messages")
        _utf8(m["role"], "chat role", "messages")
        _utf8(m["content"], "chat message", "messages")
    if not any(m["content"].strip() for m in messages):
        raise RequestError("the chat messages are empty or only whitespace", "messages")


def build_request(req: Request, tok: Tokenizer, n_ctx: int) -> dict:
    """Validate ``req`` and return its attested record with prompt token ids.

    Raises :class:`RequestError` for an empty prompt, one that encodes to no
    tokens, a prompt that leaves no room in the context, ``max_tokens <= 0`` or
    bad sampling parameters.
    """
    req.validate()
    if req.messages is not None:
        for m in req.messages:
            found = tok.control_tokens(m["role"]) + tok.control_tokens(m["content"])
            if found:
                raise RequestError(f"a chat message contains the model's control token {found[0]!r}; "
                                   "messages are text, the chat template adds the control tokens", "messages")
        text, mode = tok.render_chat(req.messages), "chat"
    else:
        text, mode = req.prompt, "prompt"
    param = "prompt" if mode == "prompt" else "messages"
    least = tok.min_tokens(text, special=mode == "chat")
    if least >= n_ctx:     # refused before tokenizing, whose cost grows with the text
        raise RequestError(f"the prompt is at least {least} token{'' if least == 1 else 's'}; the context holds "
                           f"{n_ctx} (one must stay free)", param=param, code="context_length_exceeded")
    ids = tok.encode(text, special=mode == "chat")
    if not ids:  # e.g. characters the model's vocabulary drops
        what = "prompt" if mode == "prompt" else "chat template's rendering of the messages"
        raise RequestError(f"the {what} encodes to no tokens of this model's vocabulary", param=param)
    if len(ids) >= n_ctx:
        raise RequestError(f"the prompt is {len(ids)} tokens; the context holds {n_ctx} (one must stay free)",
                           param=param, code="context_length_exceeded")
    p = req.params
    return {"mode": mode, "prompt": text, "messages": req.messages, "prompt_tokens": ids,
            "max_tokens": req.max_tokens, "n_ctx": n_ctx, "temperature": float(p.temperature),
            "top_k": int(p.top_k), "top_p": float(p.top_p), "seed": int(p.seed), "stop": list(req.stop)}


def params_of(record: dict) -> SamplingParams:
    return SamplingParams(temperature=record["temperature"], top_k=record["top_k"],
                          top_p=record["top_p"], seed=record["seed"])


class _StopTail:
    """Where stop string ``s`` first occurs in a growing text, and how much of the
    text's end could still begin it: the Knuth-Morris-Pratt automaton of ``s``
    (Knuth, Morris and Pratt, "Fast pattern matching in strings", SIAM J. Comput.
    1977) run over the text as it grows, in amortised constant time per character
    (one character may walk the failure table, at most ``len(s)`` steps)."""

    def __init__(self, s: str):
        self.s, self.fail = s, [0] * len(s)  # fail[i]: longest proper border of s[:i + 1]
        k = 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = self.fail[k - 1]
            k += s[i] == s[k]
            self.fail[i] = k
        self.k = 0  # longest prefix of s that the text ends with
        self.k_kept = 0  # the same for the text without its trailing U+FFFD characters

    def _run(self, k: int, chars: str, keep: bool) -> tuple[int, int]:
        """The state after ``chars`` from state ``k``, and the offset in ``chars``
        just past the first occurrence of ``s`` they complete (-1: none)."""
        s, fail, end = self.s, self.fail, -1
        for i, c in enumerate(chars):
            if k == len(s):
                k = fail[k - 1]
            while k and c != s[k]:
                k = fail[k - 1]
            k += c == s[k]
            if k == len(s) and end < 0:
                end = i + 1
            if keep and c != "\ufffd":
                self.k_kept = k
        return k, end

    def feed(self, chars: str) -> int:
        """Append ``chars`` to the text; returns :meth:`_run`'s offset."""
        self.k, end = self._run(self.k, chars, True)
        return end

    def peek(self, chars: str) -> int:
        """The same offset for ``chars`` after the text, which is left as it was."""
        return self._run(self.k, chars, False)[1]


class Generation:
    """Decoding state of one request; the engine steps are driven from outside
    (by :func:`generate` alone, or by the scheduler beside other requests).

    Each step: feed :meth:`next_chunk` to ``engine.forward`` for :attr:`seq`;
    pass the chunk length to :meth:`due`, and when it gives a position, the
    token ``engine.sample`` draws there and the logits to :meth:`take`.
    """

    def __init__(self, engine: Engine, tok: Tokenizer, record: dict):
        self.engine, self.tok, self.record = engine, tok, record
        self.params = params_of(record)
        self.ids = list(record["prompt_tokens"])
        self.fed = 0
        self.link = digest.chain_start(bytes.fromhex(engine.model.sha256), record, engine.contract)
        self.tokens: list[int] = []
        self.chain: list[bytes] = []
        self.finish: str | None = None
        self.text = ""  # tok.decode(tokens), cut at a stop string, without a final EOS
        self._stream = TextStream(tok)
        self._tails = [_StopTail(s) for s in record["stop"]]
        self.seq = engine.new_sequence()

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet fed (0 once decoding)."""
        return len(self.ids) - self.fed

    def next_chunk(self, limit: int = PREFILL_CHUNK) -> list[int]:
        """The tokens to feed next: up to ``limit`` prompt tokens, then the last sampled token."""
        if self.fed < len(self.ids):
            return self.ids[self.fed:self.fed + limit]
        return [self.tokens[-1]]

    def due(self, n: int) -> int | None:
        """Count ``n`` more fed tokens; returns the position of the token this
        step's logits yield, or None while the prompt is still being prefilled."""
        if self.fed < len(self.ids):
            self.fed += n
            if self.fed < len(self.ids):
                return None
        return len(self.ids) + len(self.tokens)

    def take(self, t: int, logits_sha: bytes) -> int:
        """Append token ``t``, drawn by ``engine.sample`` for the position :meth:`due`
        gave from logits whose :func:`attest.digest.logits_digest` is ``logits_sha``
        (chained into the digest chain)."""
        pos = len(self.ids) + len(self.tokens)
        self.link = digest.chain_step(self.link, t, logits_sha)
        self.tokens.append(t)
        self.chain.append(self.link)
        if t == self.tok.eos_id:
            self.finish = "stop"
            return t
        seen = len(self._stream.committed)
        self._stream.push(t)
        new, held = self._stream.committed[seen:], self._stream.held
        self.text = self._stream.committed + held
        # The text held no stop string at the last step, so a first occurrence ends in
        # the new committed characters, or in the U+FFFD shown for held-back bytes.
        cut = []
        for tail in self._tails:
            end = tail.feed(new)
            if end < 0 and held and (end := tail.peek(held)) >= 0:
                end += len(new)
            if end >= 0:
                cut.append(seen + end - len(tail.s))
        if cut:
            self.finish, self.text = "stop", self.text[:min(cut)]
        elif len(self.tokens) >= self.record["max_tokens"] or pos + 1 >= self.engine.n_ctx:
            self.finish = "length"
        return t

    def stable_text(self) -> str:
        """The longest prefix of the text that can no longer change: the text
        without its trailing U+FFFD characters (a cut UTF-8 character may still
        complete) and without the longest end of that which begins a stop string."""
        if self.done:
            return self.text
        kept = self._stream.committed.rstrip("\ufffd")  # self.text adds only U+FFFD for held-back bytes
        return kept[:len(kept) - max((tail.k_kept for tail in self._tails), default=0)]

    def result(self) -> Result:
        out = digest.output_digest(self.link, self.tokens, self.text, self.finish)
        return Result(self.record, self.tokens, self.text, self.finish, self.chain, out)

    def release(self) -> None:
        self.engine.release(self.seq)


def steps(engine: Engine, tok: Tokenizer, record: dict) -> Iterator[Generation]:
    """Run the request ``record`` (from :func:`build_request`) alone on ``engine``,
    yielding its :class:`Generation` after each sampled token, so a caller can stop
    it early (closing the iterator releases the sequence).

    Prefill in chunks of :data:`PREFILL_CHUNK`, then decode one token per
    step until EOS, a stop string, ``max_tokens`` or the context end.
    """
    g = Generation(engine, tok, record)
    try:
        while not g.done:
            chunk = g.next_chunk()
            logits = engine.forward([(g.seq, chunk)])
            pos = g.due(len(chunk))
            if pos is not None:
                g.take(engine.sample([(0, g.params, pos)], logits)[0], digest.logits_digest(logits[0]))
                yield g
    finally:
        g.release()


def generate(engine: Engine, tok: Tokenizer, record: dict) -> Result:
    """Run the request ``record`` alone on ``engine`` to its end (:func:`steps`)."""
    for g in steps(engine, tok, record):
        pass
    return g.result()
