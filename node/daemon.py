"""Operator daemon: an OpenAI-compatible HTTP API (aiohttp) over the scheduler.

Every answer carries its signed attestation (in the body's ``attestation``
field, in ``X-Bitexact-*`` headers, and, when streaming, in the last event).
Attestations are committed to the SQLite store before the answer is sent.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import errno
import hashlib
import json
import logging
import sqlite3
import sys
import time
import uuid
import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.datastructures import MIMEAccept
from werkzeug.http import parse_accept_header

from attest import canonical, keys
from attest.envelope import open_envelope, seal

from . import __version__
from .engine import Engine
from .errors import AttestationError, BitexactError, KeyError_, RequestError, one_line
from .generate import Request, RoundsToZero, build_request, exact_float, unique_names
from .provenance import build_payload, device_record
from .sampler import SamplingParams
from .scheduler import Draining, QueueFull, Scheduler
from .store import AttestationStore
from .tokenizer import Tokenizer

log = logging.getLogger("bitexact.daemon")


class OneLineErrors(logging.Filter):
    """Log a record's exception as one line, without its traceback: aiohttp's server
    logs one for every malformed HTTP request its parser refuses and for a client
    that leaves before its request is answered (while the node reads the body or
    writes a 100 Continue), which are bad input or the client's doing, not bugs:
    those are warnings, not errors. asyncio logs a failed accept() for every retry
    while the process is out of file descriptors (hundreds a second): one such line
    per ACCEPT_EVERY_S seconds is kept."""

    ACCEPT = "socket.accept() out of system resource"
    ACCEPT_EVERY_S = 5.0

    def __init__(self):
        super().__init__()
        self._accept_logged = -self.ACCEPT_EVERY_S

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" and record.getMessage().startswith(self.ACCEPT):
            now = time.monotonic()
            if now - self._accept_logged < self.ACCEPT_EVERY_S:
                return False
            self._accept_logged = now
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            # a malformed request (answered 400), or the client went away (ConnectionResetError)
            if isinstance(e, (HttpProcessingError, web.RequestPayloadError, ConnectionResetError)):
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "%s: %s: %s", (" ".join(record.getMessage().split("\n")), type(e).__name__,
                                                     " ".join(str(e).split()))
            record.exc_info = record.exc_text = None
        return True


ONE_LINE_ERRORS = OneLineErrors()
# OpenAI request fields this node does not implement, with their neutral value: for None,
# absent, null, false, 0 or empty is accepted; otherwise absent, null or that value (best_of 0
# or repetition_penalty 0 is a setting, not the neutral 1). Anything else is a 400.
# Sampler extensions other OpenAI-compatible servers take (llama.cpp server, vLLM) are refused alike.
# Output constraints have NULL_ONLY: an empty schema, regex or list still constrains the output.
# logprobs has NULL_OR_FALSE: chat's false asks for nothing, but completions' 0 asks for the
# sampled tokens' log-probabilities.
NULL_ONLY, NULL_OR_FALSE = object(), object()
UNSUPPORTED = {"logprobs": NULL_OR_FALSE, "top_logprobs": None, "echo": None, "suffix": None, "best_of": 1,
               "presence_penalty": None, "frequency_penalty": None, "logit_bias": None, "tools": None,
               "functions": None, "function_call": None, "tool_choice": None, "parallel_tool_calls": None,
               "response_format": {"type": "text"}, "repetition_penalty": 1, "repeat_penalty": 1,
               "min_p": None, "typical_p": 1, "tfs_z": 1, "top_a": None, "mirostat": None,
               "dynatemp_range": None, "xtc_probability": None, "dry_multiplier": None, "min_tokens": None,
               "ignore_eos": None, "grammar": None, "json_schema": NULL_ONLY, "guided_json": NULL_ONLY,
               "guided_regex": NULL_ONLY, "guided_choice": NULL_ONLY, "guided_grammar": NULL_ONLY,
               "structured_outputs": NULL_ONLY, "n_probs": None, "mirostat_mode": None, "length_penalty": 1,
               "use_beam_search": None, "prompt_logprobs": None, "logits_processors": None, "bad_words": None, "allowed_token_ids": None}


CODINGS = ("gzip", "deflate")   # request content codings the node decodes (one, alone)
# aiohttp's own decoding of request bodies accepts a gzip stream without its CRC-32 and
# length trailer and ignores bytes after it, so the server hands the node the raw body
# (node/cli.py passes these to web.run_app) and decode_body checks the whole stream.
SERVER_OPTIONS = {"auto_decompress": False}


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.etype, self.param, self.code = status, message, etype, param, code

    def response(self) -> web.Response:
        resp = web.json_response({"error": {"message": self.message, "type": self.etype, "param": self.param,
                                            "code": self.code}}, status=self.status)
        if self.status == 408:   # a body that did not arrive: the connection closes, even if the rest comes later
            resp.force_close()   # (aiohttp first reads what arrives of it for up to 10 s, its lingering time)
        return resp


def _not_json(name: str):
    """``json.loads``' hook for NaN, Infinity and -Infinity, which Python accepts and
    RFC 8259 section 6 does not."""
    raise ValueError(f"{name} is not a JSON number (RFC 8259 section 6)")


def deliver_to(loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
    """A job's ``on_event`` (called from the engine worker thread): puts ``(kind,
    value)`` on ``events`` in ``loop``. Once the loop has closed (shutdown left a
    stuck step behind, node/scheduler.py ``stop``) nobody waits for the event: it is
    dropped, so the worker thread does not die on the closed loop's RuntimeError."""
    def on_event(kind: str, value) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))
        except RuntimeError:   # the loop is closed
            pass
    return on_event


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes")


def decode_body(raw: bytes, coding: str, limit: int) -> bytes:
    """Decode a request body of content coding ``coding`` (RFC 9110 section 8.4.1):
    "gzip" is RFC 1952 (one member, its CRC-32 and length checked by zlib); "deflate"
    is the zlib format of RFC 1950, or raw RFC 1951 data when the first byte is not a
    zlib header (as aiohttp and browsers accept). At most ``limit`` decoded bytes.
    Raises :class:`ApiError` 400 for data that does not decode, a stream that ends early
    or bytes after its end, and 413 past ``limit``."""
    wbits = 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 \
        else -zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    try:   # zlib takes a C ssize_t as its output bound; no body past that fits in memory anyway
        out = d.decompress(raw, min(limit, sys.maxsize - 1) + 1)
    except zlib.error as e:
        raise ApiError(400, f"the request body could not be read: {coding}: {e}") from None
    if len(out) > limit:
        raise too_large(limit)
    if not d.eof:
        raise ApiError(400, f"the request body could not be read: the {coding} stream ends early")
    if d.unused_data:
        raise ApiError(400, f"the request body could not be read: {len(d.unused_data)} bytes after the {coding} stream")
    return out


def _field(body: dict, name: str, types, default=None, what=""):
    """``body[name]`` (or ``default`` when absent or null) checked against
    ``types``; a number field (``float`` in ``types``) is returned as a float.
    Raises :class:`ApiError` (400, ``param=name``) for a wrong type or a number
    too large for a float."""
    if name not in body or body[name] is None:
        return default
    v = body[name]
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(v, bool) and bool not in allowed) or not isinstance(v, types):
        raise ApiError(400, f"'{name}' must be {what}", param=name)
    if float in allowed:
        try:
            return float(v)
        except OverflowError:
            raise ApiError(400, f"'{name}' is too large for a float", param=name) from None
    return v


# The .bxa file first (a tie gets it), then the JSON form, also as its Content-Type names it
# (werkzeug matches a range with parameters only to a type with the same ones).
ATTESTATION_TYPES = ("application/msgpack", "application/json", "application/json; charset=utf-8")


def wants_json(accept: str) -> bool:
    """Whether an attestation is to be served as JSON for the ``Accept`` header
    ``accept``: when its best match among :data:`ATTESTATION_TYPES` is
    ``application/json``, with no parameter or ``charset=utf-8`` (RFC 9110
    section 12.5.1 as werkzeug reads it: types in any case, weights, an exact
    type before ``type/*`` before ``*/*``). No header, ``*/*``,
    ``application/json;q=0`` or a tie of ``application/json`` with ``application/msgpack``
    gets the file (``application/json;charset=utf-8`` is werkzeug's more specific type, so
    it wins such a tie)."""
    return parse_accept_header(accept, MIMEAccept).best_match(ATTESTATION_TYPES) in ATTESTATION_TYPES[1:]


class Node:
    """Holds the engine, scheduler, store, key and metrics of one running daemon."""

    def __init__(self, engine: Engine, tok: Tokenizer, key, data_dir: str, max_batch: int = 16,
                 max_queue: int = 64, max_tokens_cap: int = 4096, pin: str | None = None, step_tokens: int | None = None):
        self.engine, self.tok, self.key = engine, tok, key
        self.public_raw = keys.public_raw(key)
        self.key_id = keys.key_id(self.public_raw)
        self.max_tokens_cap = max_tokens_cap
        self.pin = pin if engine.device == "cuda" else None
        self.model_id = str(engine.model.metadata.get("general.name") or "bitexact")
        self.store = AttestationStore(data_dir)
        self._check_store_key(data_dir)
        self.registry = CollectorRegistry()
        r = self.registry
        self.m_queue = Gauge("bitexact_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.m_batch = Gauge("bitexact_batch_size", "Sequences in the last engine step", registry=r)
        self.m_tokens = Counter("bitexact_generated_tokens", "Tokens sampled", registry=r)
        self.m_fed = Counter("bitexact_fed_tokens", "Tokens fed to the engine (prefill and decode)", registry=r)
        self.m_requests = Counter("bitexact_requests", "Requests by outcome", ["outcome"], registry=r)
        self.m_latency = Histogram("bitexact_request_seconds", "Request latency", registry=r)
        self.scheduler = Scheduler(engine, tok, max_batch, max_queue, on_step=self._on_step, step_tokens=step_tokens)
        self.store_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bitexact-store")

    def _check_store_key(self, data_dir: str) -> None:
        """Refuse a store whose attestations another key signed (its earliest row that
        opens as an attestation decides): this node would answer every one of them with
        a 500, since it serves only what it signed. Raises :class:`KeyError_`; damaged
        rows before it are left to the requests that fetch them (a logged 500)."""
        for blob in self.store.blobs():
            try:
                signer = open_envelope(blob)["signer"]["public_key"]
            except (AttestationError, KeyError, TypeError):   # damaged (TypeError: a row that is not bytes)
                continue
            if signer == self.public_raw:
                return
            self.store.close()
            raise KeyError_(f"the attestation store in {data_dir} holds attestations signed by key id "
                            f"{keys.key_id(signer)}, not by this key ({self.key_id}): serve a new key from "
                            f"another --data-dir (attestations stay verifiable with the key that signed them)")

    def _on_step(self, batch: int, fed: int, sampled: int) -> None:
        self.m_batch.set(batch)
        self.m_fed.inc(fed)
        self.m_tokens.inc(sampled)
        self.m_queue.set(self.scheduler.queue_depth)

    def info(self) -> dict:
        m = self.engine.model
        return {"public_key": self.public_raw.hex(), "key_id": self.key_id, "pinned_gpu": self.pin,
                "backend": self.engine.device, "device": device_record(self.engine),
                "model": {"id": self.model_id, "sha256": m.sha256, "architecture": m.arch,
                          "quant_types": m.quant_types, "n_ctx": self.engine.n_ctx},
                "contract_version": self.engine.contract, "engine_version": __version__}

    # ---- request parsing -------------------------------------------------
    def parse(self, body, chat: bool) -> dict:
        """Validate an OpenAI request body; returns the attested request record.

        ``model`` may be absent or null, ``self.model_id`` (what ``/v1/models``
        lists) or the model file's SHA-256 (64 lowercase hex, as in ``/v1/node``
        and the attestation); any other string is a 404 ``model_not_found``.
        Raises :class:`ApiError` (400 for a bad field, ``param`` naming it)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = _field(body, "model", str, what="a string")
        if model is not None and model not in (self.model_id, self.engine.model.sha256):
            raise ApiError(404, f"the model {model!r} does not exist on this node; it serves {self.model_id!r}",
                           param="model", code="model_not_found")
        if _field(body, "n", int, 1, what="an integer") != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        for name, neutral in UNSUPPORTED.items():
            value = body.get(name)
            if neutral is NULL_ONLY:
                is_set = value is not None
            elif neutral is NULL_OR_FALSE:
                is_set = value is not None and value is not False
            elif neutral is None:   # absent, null, false, 0 and empty ask for nothing
                is_set = bool(value)
            else:   # a field with a neutral setting of its own: 0 or {} is another setting, and true is not 1
                is_set = value is not None and (value != neutral or isinstance(value, bool))
            if is_set:
                raise ApiError(400, f"'{name}' is not supported by this node", param=name)
        # Types here; ranges in SamplingParams.validate and build_request (one rule each).
        given = [n for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None]
        if not chat and "max_completion_tokens" in given:
            raise ApiError(400, "'max_completion_tokens' is a chat field; completions take 'max_tokens'",
                           param="max_completion_tokens")
        if len(given) == 2:
            raise ApiError(400, "give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
        limit = given[0] if given else "max_tokens"
        # absent: OpenAI's completions default of 16, within the node's cap
        max_tokens = _field(body, limit, int, min(16, self.max_tokens_cap), what="an integer")
        if not 1 <= max_tokens <= self.max_tokens_cap:
            raise ApiError(400, f"'{limit}' must be in [1, {self.max_tokens_cap}], got {max_tokens}", param=limit)
        temperature = _field(body, "temperature", (int, float), 0.0, what="a number")
        top_p = _field(body, "top_p", (int, float), 1.0, what="a number")
        top_k = _field(body, "top_k", int, 0, what="an integer")
        seed = _field(body, "seed", int, 0, what="an integer")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
            raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
        _field(body, "stream", bool, False, what="a boolean")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' must be a non-empty array", param="messages")
            messages = []
            for m in msgs:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ApiError(400, "each message needs a string 'role' and a string 'content'", param="messages")
                extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
                if extra:  # e.g. name, tool_calls: the template would not see them
                    raise ApiError(400, f"message field '{extra[0]}' is not supported by this node", param="messages")
                messages.append({"role": m["role"], "content": m["content"]})
            req = Request(messages=messages)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise ApiError(400, "'prompt' must be a string", param="prompt")
            req = Request(prompt=prompt)
        req.max_tokens = max_tokens
        req.params = SamplingParams(temperature, top_k, top_p, seed)
        req.stop = stop
        try:
            return build_request(req, self.tok, self.engine.n_ctx)
        except RequestError as e:
            raise ApiError(400, str(e), code=e.code, param=limit if e.param == "max_tokens" else e.param) from None

    # ---- attestation -----------------------------------------------------
    def attest(self, result) -> dict:
        """Sign ``result``, commit it to the store (durable), return its summary."""
        payload = build_payload(result, self.engine, self.public_raw)
        blob = seal(payload, self.key)
        att_id = hashlib.sha256(blob).hexdigest()
        try:
            self.store.put(att_id, payload["timestamp"], result.digest.hex(), blob)
        except sqlite3.Error as e:
            raise BitexactError(f"the attestation {att_id} could not be stored: {e}") from None
        sig = canonical.decode(blob)[4]
        return {"id": att_id, "output_digest": result.digest.hex(), "signature": sig.hex(), "key_id": self.key_id}

    def stored(self, att_id: str) -> tuple[bytes, dict] | None:
        """The attestation file stored under ``att_id`` and its payload, checked as
        ``bitexact verify --trusted-key`` with this node's key checks a file (None: no
        such attestation). Raises ``sqlite3.Error`` for a row that is not the file its
        id names (:meth:`AttestationStore.get`) and :class:`AttestationError` for a
        file that is not a valid attestation signed by this node."""
        blob = self.store.get(att_id)
        return None if blob is None else (blob, open_envelope(blob, trusted_key=self.public_raw))


def _headers(att: dict) -> dict:
    return {"X-Bitexact-Attestation-Id": att["id"], "X-Bitexact-Output-Digest": att["output_digest"],
            "X-Bitexact-Signature": att["signature"], "X-Bitexact-Key-Id": att["key_id"]}


def make_app(node: Node, max_body_bytes: int = 1 << 20, body_timeout_s: float = 30.0,
             drain_timeout_s: float = 30.0) -> web.Application:
    """The daemon's aiohttp application. A request body larger than ``max_body_bytes``
    is a 413; one that has not fully arrived ``body_timeout_s`` seconds after its
    headers is a 408 (the connection then closes, within aiohttp's 10 s lingering time). At shutdown the requests queued
    and running have ``drain_timeout_s`` seconds to finish; those still running
    then end with a 503 (an error event when streaming), not a dropped connection."""

    @web.middleware
    async def json_errors(request, handler):
        """OpenAI-style JSON for errors aiohttp raises (404, 405, ...) and for bugs (500)."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = ApiError(e.status, e.reason, "invalid_request_error").response()
            if "Allow" in e.headers:   # a 405 names the route's methods (RFC 9110 section 15.5.6)
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:   # noqa: BLE001 - a bug must not leave a plain-text 500
            if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):   # a resource, not a bug
                log.error("request refused: %s", e)
                return ApiError(503, f"the node is out of file descriptors ({e.strerror}); retry later",
                                "server_error").response()
            log.exception("request failed")
            return ApiError(500, "internal error", "server_error").response()

    for name in ("aiohttp.server", "asyncio"):     # asyncio: e.g. accept() out of file descriptors
        logging.getLogger(name).addFilter(ONE_LINE_ERRORS)     # once: addFilter skips a repeat
    app = web.Application(client_max_size=max_body_bytes, middlewares=[json_errors])

    async def expect_continue(request):
        """``Expect: 100-continue`` (RFC 9110 section 10.1.1): a 100 only for a body the
        node will read; one it would refuse from its headers (:func:`body_coding`:
        413, 415, 501) gets that answer now, with ``Connection: close``, and any
        other expectation a 417. Returning None goes on
        to the route's handler."""
        expect = ", ".join(request.headers.getall("Expect", []))   # every header line
        if expect.lower() != "100-continue":
            return ApiError(417, f"unsupported Expect: {expect!r}").response()
        if request.body_exists:
            try:
                body_coding(request)
            except ApiError as e:       # the 413, 415 or 501 the body would get, before it is sent
                resp = e.response()
                resp.force_close()
                return resp
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0    # the 100 is not part of the response
        return None

    def body_coding(request) -> str:
        """The body's content coding (lower case; "" or "identity": none), from its
        headers alone. Raises :class:`ApiError`: 413 for a declared length over
        ``max_body_bytes``, 501 for a transfer coding but ``chunked`` (RFC 9112
        section 6.1: aiohttp frames ``gzip, chunked`` as chunked and would hand over
        the gzip bytes), 415 for a content coding not of :data:`CODINGS` (or a list)."""
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise too_large(max_body_bytes)
        te = ", ".join(request.headers.getall("Transfer-Encoding", []))   # every header line
        if te and [c for c in (c.strip(" \t").lower() for c in te.split(",")) if c] != ["chunked"]:   # "" ignored
            raise ApiError(501, f"unsupported Transfer-Encoding {te!r}: chunked alone, or none")
        header = ", ".join(request.headers.getall("Content-Encoding", []))   # every header line
        coding = header.strip().lower()
        if coding not in ("", "identity", *CODINGS):
            raise ApiError(415, f"unsupported Content-Encoding {header!r}: one of {', '.join(CODINGS)} or none")
        return coding

    async def read_json(request):
        """The body as JSON: UTF-8 (RFC 8259 section 8.1), no name twice in an
        object, its framing and coding as :func:`body_coding` accepts them."""
        coding = body_coding(request)   # before reading it
        try:
            raw = await asyncio.wait_for(request.read(), body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {body_timeout_s:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large(max_body_bytes) from None
        except web.RequestPayloadError as e:   # e.g. a chunked body that breaks off
            raise ApiError(400, f"the request body could not be read: {e}") from None
        if coding in CODINGS:
            raw = decode_body(raw, coding, max_body_bytes)
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_not_json, parse_float=exact_float,
                              object_pairs_hook=unique_names)
        except RoundsToZero as e:
            raise ApiError(400, f"a number of the request body: {e}") from None
        except (ValueError, RecursionError) as e:   # bad JSON, not UTF-8, too deep, too long an integer
            raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}") from None

    async def complete(request: web.Request, chat: bool):
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            body = await read_json(request)
            record = await loop.run_in_executor(None, node.parse, body, chat)
            if node.engine.broken:   # a tensor-parallel rank died: say so before any stream starts
                raise ApiError(500, f"{node.engine.broken}; the tensor-parallel engine must be restarted",
                               "server_error")
            events: asyncio.Queue = asyncio.Queue()
            job = node.scheduler.submit(record, deliver_to(loop, events))
        except ApiError as e:
            node.m_requests.labels("rejected").inc()
            return e.response()
        except QueueFull as e:
            node.m_requests.labels("queue_full").inc()
            return ApiError(429, str(e), "rate_limit_error").response()
        except Draining as e:
            node.m_requests.labels("rejected").inc()
            return ApiError(503, str(e), "server_error").response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        stream = bool(body.get("stream"))
        resp = None
        sent = ""
        try:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                if request.version < (1, 1):   # no chunked coding: the stream ends when the connection closes
                    resp.force_close()         # (aiohttp would keep an HTTP/1.0 keep-alive connection open)
                await resp.prepare(request)
                if chat:
                    await _sse(resp, _chunk(rid, created, node.model_id, chat, {"role": "assistant", "content": ""}))
            while True:
                kind, value = await events.get()
                if kind == "token":
                    if stream and len(value[1]) > len(sent):
                        delta, sent = value[1][len(sent):], value[1]
                        await _sse(resp, _chunk(rid, created, node.model_id, chat, delta))
                    continue
                if kind == "error":
                    raise value
                result = value
                break
            att = await loop.run_in_executor(node.store_pool, node.attest, result)
            usage = {"prompt_tokens": len(result.request["prompt_tokens"]), "completion_tokens": len(result.tokens),
                     "total_tokens": len(result.request["prompt_tokens"]) + len(result.tokens)}
            node.m_requests.labels("ok").inc()
            node.m_latency.observe(time.monotonic() - t0)
            if stream:
                last = _chunk(rid, created, node.model_id, chat, result.text[len(sent):], result.finish_reason)
                last["attestation"], last["usage"] = att, usage
                await _sse(resp, last)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            return web.json_response({"id": rid, "object": obj, "created": created, "model": node.model_id,
                                      "choices": [choice], "usage": usage, "attestation": att},
                                     headers=_headers(att))
        except (asyncio.CancelledError, ConnectionResetError) as e:
            # CancelledError: the connection closed (the server runs with handler
            # cancellation, node/cli.py cmd_serve), so a client that hangs up never
            # keeps its batch slot.
            node.scheduler.cancel(job)
            node.m_requests.labels("disconnected").inc()
            log.warning("%s: the client went away %s; its job is cancelled", rid,
                        "before the answer" if resp is None else "mid-stream")
            if resp is None or isinstance(e, asyncio.CancelledError):
                raise
            return resp   # aiohttp's final write_eof meets the closed connection and stops quietly
        except BitexactError as e:   # the node's fault (a NaN, the KV cache, the store) or its shutdown
            node.m_requests.labels("failed").inc()
            if not isinstance(e, Draining):   # on_shutdown logs those
                log.error("%s failed: %s", rid, one_line(str(e)))
            if resp is not None:
                await _sse(resp, {"error": {"message": str(e), "type": "server_error"}})
                return resp
            return ApiError(503 if isinstance(e, Draining) else 500, str(e), "server_error").response()

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def attestation(request):
        att_id = request.match_info["id"]
        if len(att_id) != 64 or any(c not in "0123456789abcdef" for c in att_id):
            return ApiError(404, "no such attestation", code="not_found").response()
        try:
            found = await asyncio.get_running_loop().run_in_executor(node.store_pool, node.stored, att_id)
        except (sqlite3.Error, AttestationError) as e:   # the node's fault, not the client's
            log.error("attestation %s cannot be served: the store holds a bad row: %s", att_id, e)
            return ApiError(500, "the stored attestation is damaged", "server_error").response()
        if found is None:
            return ApiError(404, "no such attestation", code="not_found").response()
        blob, payload = found
        if wants_json(", ".join(request.headers.getall("Accept", []))):   # every header line
            env = canonical.decode(blob)
            try:   # RFC 8259 has no NaN or infinity; the node never signs one, a planted row might
                body = json.dumps({"format": env[0], "format_version": env[1], "payload": canonical.plain(payload),
                                   "payload_msgpack_b64": base64.b64encode(env[2]).decode(),
                                   "public_key": env[3].hex(), "signature": env[4].hex()}, allow_nan=False)
            except ValueError as e:
                log.error("attestation %s cannot be served as JSON: %s", att_id, e)
                return ApiError(500, "the stored attestation is damaged", "server_error").response()
            return web.Response(text=body, content_type="application/json")
        return web.Response(body=blob, content_type="application/msgpack",
                            headers={"Content-Disposition": f'attachment; filename="{att_id}.bxa"'})

    async def node_info(request):
        return web.json_response(node.info())

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": node.model_id, "object": "model",
                                                              "created": 0, "owned_by": "bitexact"}]})

    async def health(request):
        if node.engine.broken:                       # a tensor-parallel rank died: requests fail until restart
            return web.json_response({"status": "broken", "reason": node.engine.broken}, status=503)
        return web.json_response({"status": "ok", "active": node.scheduler.active,
                                  "queue_depth": node.scheduler.queue_depth})

    async def metrics(request):
        node.m_queue.set(node.scheduler.queue_depth)
        return web.Response(body=generate_latest(node.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def on_shutdown(app):
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, node.scheduler.drain, drain_timeout_s):
            log.warning("shutting down: %d requests did not finish within %g s; they end with a 503",
                        node.scheduler.active + node.scheduler.queue_depth, drain_timeout_s)
            # each gets Draining, so its handler answers before aiohttp cancels the handlers
            await loop.run_in_executor(None, node.scheduler.stop)

    async def on_cleanup(app):
        node.scheduler.stop()
        node.store_pool.shutdown(wait=True)
        node.store.close()

    app.router.add_post("/v1/completions", completions, expect_handler=expect_continue)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_continue)
    app.router.add_get("/v1/attestations/{id}", attestation, expect_handler=expect_continue)
    app.router.add_get("/v1/node", node_info, expect_handler=expect_continue)
    app.router.add_get("/v1/models", models, expect_handler=expect_continue)
    app.router.add_get("/health", health, expect_handler=expect_continue)
    app.router.add_get("/metrics", metrics, expect_handler=expect_continue)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def _chunk(rid, created, model, chat, text, finish=None) -> dict:
    if chat:
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
