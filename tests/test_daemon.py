"""The operator daemon: OpenAI API, continuous batching that never changes bytes,
durable attestations, draining, and bad input. Runs `bitexact serve` on the
default model on loopback and talks to it with the official `openai` client.
The daemon runs the CPU engine; ``BITEXACT_TEST_DEVICE=cuda`` (scripts/gpu_check.sh)
runs the same tests against the CUDA engine. Solo digests always come from the
CPU reference engine."""

import concurrent.futures
import contextlib
import gzip
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib

import openai
import pytest

from planted import Wrapped
from node.engine import Engine
from node.generate import Request, build_request, generate
from node.gguf_model import default_model_path, load_model
from node.sampler import SamplingParams
from node.tokenizer import Tokenizer

DEVICE = os.environ.get("BITEXACT_TEST_DEVICE", "cpu")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, key, data_dir, *extra, nofile: int | None = None):
        """``nofile``: the daemon's limit of open file descriptors (RLIMIT_NOFILE)."""
        import resource
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "node.cli", "serve", "--key", key, "--data-dir", data_dir,
                     "--port", str(self.port), "--device", DEVICE, *extra]
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=limit)
        end = time.time() + 90
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.proc.stderr.read()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        self.model = self.client.models.list().data[0].id     # the id requests must name (or omit)

    def get(self, path, accept=None):
        req = urllib.request.Request(self.url + path, headers={"Accept": accept} if accept else {})
        return urllib.request.urlopen(req, timeout=30)

    def post_raw(self, path, data: bytes, ctype="application/json"):
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": ctype})
        try:
            r = urllib.request.urlopen(req, timeout=120)
            return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    d = tmp_path_factory.mktemp("key")
    subprocess.run([sys.executable, "-m", "node.cli", "keygen", "--out", str(d / "node.pem")], check=True,
                   capture_output=True)
    return str(d / "node.pem")


@pytest.fixture(scope="module")
def daemon(key, tmp_path_factory):
    d = Daemon(key, str(tmp_path_factory.mktemp("data")), "--max-batch", "32", "--max-queue", "64")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def solo():
    """Output digest of a request served alone (the same code path, one request at a time)."""
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    engine = Engine(model)
    cache = {}

    def digest(kind, text, max_tokens, temperature=0.0, seed=0, stop=()):
        k = (kind, text, max_tokens, temperature, seed, tuple(stop))
        if k not in cache:
            req = Request(prompt=text if kind == "prompt" else None,
                          messages=[{"role": "user", "content": text}] if kind == "chat" else None,
                          max_tokens=max_tokens, params=SamplingParams(temperature, 0, 1.0, seed), stop=list(stop))
            cache[k] = generate(engine, tok, build_request(req, tok, engine.n_ctx)).digest.hex()
        return cache[k]
    return digest


def send(d, kind, text, max_tokens, temperature=0.0, seed=None, stream=False):
    kw = {"max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        kw["seed"] = seed
    if kind == "prompt":
        if stream:
            last = None
            for ch in d.client.completions.create(model=d.model, prompt=text, stream=True, **kw):
                last = ch
            return last.model_extra["attestation"]["output_digest"]
        r = d.client.completions.create(model=d.model, prompt=text, **kw)
    else:
        msgs = [{"role": "user", "content": text}]
        if stream:
            last = None
            for ch in d.client.chat.completions.create(model=d.model, messages=msgs, stream=True, **kw):
                last = ch
            return last.model_extra["attestation"]["output_digest"]
        r = d.client.chat.completions.create(model=d.model, messages=msgs, **kw)
    return r.model_extra["attestation"]["output_digest"]


FILLERS = [("prompt", "Once upon a time", 2), ("chat", "Say hi.", 3), ("prompt", "1, 2, 3, 4,", 1),
           ("chat", "What is the capital of Italy? Answer in one word.", 2),
           ("prompt", "def fibonacci(n):\n    ", 3), ("prompt", "The weather today is", 1)]


def run_concurrently(d, solo, jobs):
    """jobs: (kind, text, max_tokens, temperature, seed, stream). Every digest must equal solo's."""
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        futs = [ex.submit(send, d, k, t, n, temp, seed, stream) for k, t, n, temp, seed, stream in jobs]
        got = [f.result() for f in futs]
    want = [solo(k, t, n, temp, seed if seed is not None else 0) for k, t, n, temp, seed, _ in jobs]
    assert got == want
    return got


def mixed(n, offset=0):
    return [(*FILLERS[(i + offset) % len(FILLERS)], 0.0, None, i % 3 == 0) for i in range(n)]


def test_same_prompt_eight_times_at_once(daemon, solo):
    same = [("prompt", "The three primary colors are", 3, 0.0, None, i % 2 == 0) for i in range(8)]
    got = run_concurrently(daemon, solo, same + mixed(24))
    assert len(set(got[:8])) == 1


def test_seeded_sampling_beside_greedy(daemon, solo):
    seeded = [("chat", "Write a word that rhymes with cat.", 3, 0.8, 1234, False)] * 4
    run_concurrently(daemon, solo, seeded + mixed(28, 2))


def test_shared_long_prefix(daemon, solo):
    prefix = "In a quiet village by the sea, there lived an old fisherman who every morning " * 2
    jobs = [("prompt", prefix + end, 2, 0.0, None, False) for end in ("he", "she", "the boat", "and", "so", "then")]
    run_concurrently(daemon, solo, jobs * 3 + mixed(14, 4))


def test_sequential_a_b_a_a_and_repeat_after_other(daemon, solo):
    a = ("prompt", "A short story about a robot:", 3)
    b = ("chat", "List two fruits.", 3)
    got = [send(daemon, *a), send(daemon, *b), send(daemon, *a), send(daemon, *a)]
    assert got == [solo(*a), solo(*b), solo(*a), solo(*a)]
    # a request repeated right after a different one, under load from 31 other clients
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        bg = [ex.submit(send, daemon, *j[:3]) for j in mixed(30, 1)]
        first = ex.submit(send, daemon, *b)
        time.sleep(0.5)
        again = ex.submit(send, daemon, *b)
        assert first.result() == again.result() == solo(*b)
        assert [f.result() for f in bg] == [solo(*j[:3]) for j in mixed(30, 1)]


def test_attestation_endpoint_and_verify(daemon, key, tmp_path):
    r = daemon.client.completions.with_raw_response.create(model=daemon.model, prompt="Hello there", max_tokens=3)
    att = r.parse().model_extra["attestation"]
    assert r.headers["X-Bitexact-Attestation-Id"] == att["id"]
    assert r.headers["X-Bitexact-Output-Digest"] == att["output_digest"]
    blob = daemon.get(f"/v1/attestations/{att['id']}").read()
    assert hashlib.sha256(blob).hexdigest() == att["id"]     # the id is the file's SHA-256 (README)
    path = tmp_path / "a.bxa"
    path.write_bytes(blob)
    v = subprocess.run([sys.executable, "-m", "node.cli", "verify", str(path), "--trusted-key",
                        key[:-4] + ".pub.pem"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("OK"), v.stdout + v.stderr
    js = json.loads(daemon.get(f"/v1/attestations/{att['id']}", "application/json").read())
    assert js["payload"]["output"]["digest"] == att["output_digest"] and js["signature"] == att["signature"]
    node = json.loads(daemon.get("/v1/node").read())
    assert node["key_id"] == att["key_id"] and node["contract_version"] == 1
    assert node["model"]["sha256"] == load_model(default_model_path()).sha256
    assert json.loads(daemon.get("/v1/models").read())["data"][0]["object"] == "model"
    assert json.loads(daemon.get("/health").read())["status"] == "ok"
    metrics = daemon.get("/metrics").read().decode()
    for name in ("bitexact_queue_depth", "bitexact_batch_size", "bitexact_generated_tokens_total",
                 'bitexact_requests_total{outcome="ok"}'):
        assert name in metrics
    with pytest.raises(urllib.error.HTTPError) as e:
        daemon.get("/v1/attestations/" + "0" * 64)
    assert e.value.code == 404


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "temperature": -0.5}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "temperature": -0.0}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "hi", "stop": 5}).encode(), 400, "stop"),
    (json.dumps({"prompt": "hi", "stop": ["a", "x" * 4097]}).encode(), 400, "stop"),
    (json.dumps({"prompt": "hi", "seed": -1}).encode(), 400, "seed"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": 42}).encode(), 400, "prompt"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "   "}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "\u0004"}).encode(), 400, "prompt"),   # no token: a character the vocabulary drops
    (json.dumps({"prompt": "hi", "max_tokens": 10 ** 9}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps(["a"]).encode(), 400, None),
    (json.dumps({"prompt": "hi", "temperature": 1e-45}).encode(), 400, "temperature"),  # logits / T would overflow
    (json.dumps({"prompt": "hi", "temperature": 10 ** 400}).encode(), 400, "temperature"),  # no float holds it
    (json.dumps({"prompt": "hi", "top_k": 2 ** 64}).encode(), 400, "top_k"),
    (json.dumps({"prompt": "hi", "top_k": -1}).encode(), 400, "top_k"),
    (json.dumps({"prompt": "hi", "seed": 2 ** 64}).encode(), 400, "seed"),
    (b'{"prompt": "\\ud800", "max_tokens": 1}', 400, "prompt"),                      # lone surrogate
    (json.dumps({"prompt": "hi", "stop": "\ud800"}).encode(), 400, "stop"),
    (b"[" * 100000 + b"]" * 100000, 400, None),                                      # too deep for the parser
    (b'{"prompt": "hi", "max_tokens": 1, "max_tokens": 900000}', 400, None),          # a name twice
    (b'{"prompt": "hi", "stream_options": {"a": 1, "a": 2}}', 400, None),             # ... in any object
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),           # integer too long to parse
    (json.dumps({"prompt": "hi", "max_completion_tokens": 2}).encode(), 400, "max_completion_tokens"),
    (json.dumps({"prompt": "hi", "logprobs": 5}).encode(), 400, "logprobs"),
    (json.dumps({"prompt": "hi", "logprobs": 0}).encode(), 400, "logprobs"),      # the sampled tokens' logprobs
    (json.dumps({"prompt": "hi", "echo": True}).encode(), 400, "echo"),
    (json.dumps({"prompt": "hi", "best_of": 3}).encode(), 400, "best_of"),
    (json.dumps({"prompt": "hi", "best_of": 0}).encode(), 400, "best_of"),               # not the neutral 1
    (json.dumps({"prompt": "hi", "best_of": True}).encode(), 400, "best_of"),
    (json.dumps({"prompt": "hi", "repetition_penalty": 0}).encode(), 400, "repetition_penalty"),
    (json.dumps({"prompt": "hi", "response_format": {}}).encode(), 400, "response_format"),
    (json.dumps({"prompt": "hi", "repetition_penalty": 1.3}).encode(), 400, "repetition_penalty"),
    (json.dumps({"prompt": "hi", "min_p": 0.05}).encode(), 400, "min_p"),
    (json.dumps({"prompt": "hi", "ignore_eos": True}).encode(), 400, "ignore_eos"),
])
def test_bad_completion_requests(daemon, body, status, param):
    code, err = daemon.post_raw("/v1/completions", body)
    assert code == status and set(err) == {"error"} and err["error"]["message"]
    assert err["error"]["param"] == param


def test_a_chat_request_with_temperature_negative_zero_is_refused(daemon):
    """-0.0 would be greedy like 0.0 but attested as another request (another digest): refused."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": -0.0}
    assert json.dumps(body).endswith('"temperature": -0.0}')
    code, err = daemon.post_raw("/v1/chat/completions", json.dumps(body).encode())
    assert (code, err["error"]["param"]) == (400, "temperature"), err
    assert err["error"]["message"] == ("temperature -0.0 is refused: write 0 (a signed zero would be attested as "
                                       "another request than 0)")


@pytest.mark.parametrize("extra,param", [({"tool_choice": "auto"}, "tool_choice"),
                                         ({"parallel_tool_calls": True}, "parallel_tool_calls"),
                                         ({"response_format": {"type": "json_object"}}, "response_format"),
                                         ({"guided_json": {}}, "guided_json"),   # an empty schema: any JSON
                                         ({"guided_regex": ""}, "guided_regex"),
                                         ({"mirostat_mode": 2}, "mirostat_mode"),
                                         ({"length_penalty": 1.1}, "length_penalty"),
                                         ({"msg": {"name": "bob"}}, "messages"),
                                         ({"msg": {"tool_calls": [{"id": "x"}]}}, "messages")])
def test_bad_chat_requests_name_the_unsupported_field(daemon, extra, param):
    """Chat fields this node does not implement are refused, not dropped: the
    answer would otherwise not be what the client asked for. An output constraint
    counts as set even when empty (an empty JSON schema still asks for JSON)."""
    msg = {"role": "user", "content": "hi", **extra.pop("msg", {})}
    code, err = daemon.post_raw("/v1/chat/completions", json.dumps({"messages": [msg], "max_tokens": 1, **extra}).encode())
    assert code == 400 and err["error"]["param"] == param, err
    assert "not supported" in err["error"]["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(daemon):
    body = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": 1,
            "response_format": {"type": "text"}, "tool_choice": None, "guided_json": None, "length_penalty": 1.0,
            "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "best_of": 1, "repetition_penalty": None}
    assert daemon.post_raw("/v1/chat/completions", json.dumps(body).encode())[0] == 200


def test_a_stream_to_an_http_1_0_keep_alive_client_ends_by_closing_the_connection(daemon):
    """HTTP/1.0 has no chunked coding, so a stream's body ends when the connection
    closes; with ``Connection: keep-alive`` aiohttp kept it open after the last event,
    and the client waited for the end until the keep-alive timeout (75 s)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2, "stream": True}).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while chunk := s.recv(65536):
            got += chunk
    head, _, events = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"keep-alive" not in head.lower(), head
    assert events.endswith(b"data: [DONE]\n\n"), events[-200:]


def test_declared_oversize_body_is_refused_before_it_arrives(daemon):
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{}")
        head = s.recv(4096).split(b"\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 413"), head


def test_undecodable_content_encoding_is_a_400(daemon):
    """A body whose declared Content-Encoding does not decode is bad input (400 JSON), not a 500."""
    req = urllib.request.Request(daemon.url + "/v1/completions", data=b"abcde",
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and "could not be read" in body["error"]["message"], body
    assert daemon.post_raw("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())[0] == 200


def test_a_body_limit_past_zlib_s_output_bound_still_decodes_coded_bodies():
    """--max-body-bytes 9223372036854775807 is past what zlib takes as an output bound
    (a C ssize_t): a gzip or deflate body still decodes (it was an OverflowError, a 500)."""
    from node.daemon import decode_body
    for coding, data in (("gzip", gzip.compress(b"{}")), ("deflate", zlib.compress(b"{}"))):
        assert decode_body(data, coding, 2 ** 63 - 1) == b"{}"


def _exchange(port, head: bytes, body: bytes = b"", body_after_100: bool = False) -> tuple[bytes, bytes]:
    """Send a raw request (its body only after a 100 when ``body_after_100``); returns the
    status codes received, space-separated, and the final response's body bytes."""
    statuses = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + (b"" if body_after_100 else body))
        got = b""
        if body_after_100:
            while b"\r\n\r\n" not in got:
                got += s.recv(65536)
            interim, _, got = got.partition(b"\r\n\r\n")
            statuses = interim.split(b" ", 2)[1] + b" "
            s.sendall(body)
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        head_bytes, _, rest = got.partition(b"\r\n\r\n")
        n = int(re.search(rb"(?i)content-length: (\d+)", head_bytes).group(1))
        while len(rest) < n:
            rest += s.recv(65536)
    return statuses + head_bytes.split(b" ", 2)[1], rest


def test_expect_encodings_and_charsets(key, tmp_path):
    """Expect: 100-continue gets a 100 only for a body the node reads (an oversize one gets
    its 413 first, an unsupported coding its 415 or 501, an unknown expectation a 417); a body must be UTF-8 JSON (RFC 8259) with at
    one gzip or deflate coding or none (else 415); a coded body is decoded whole: one that
    does not decode, ends before its trailer or has bytes after it is a 400, one that
    decodes past the size limit a 413; a transfer coding other than chunked alone is a 501
    (RFC 9112 section 6.1); none of these is logged. A client that leaves after its headers
    (before or after its 100) is one warning line."""
    d = Daemon(key, str(tmp_path / "data"))
    ok = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    pack = zlib.compressobj(wbits=-zlib.MAX_WBITS)   # raw RFC 1951 data, no zlib header
    raw_deflate = pack.compress(ok) + pack.flush()

    def post(extra: bytes, body: bytes, **kw):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
                + b"Content-Length: %d\r\n\r\n" % len(body))
        return _exchange(d.port, head, body, **kw)

    try:
        for got_100 in (True, False):   # a client that leaves after its headers, with or without the 100
            with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(ok))
                if got_100:
                    assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
            time.sleep(0.5)
        assert post(b"Expect: 100-continue\r\n", ok, body_after_100=True)[0] == b"100 200"
        status, body = _exchange(d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                          b"\r\nExpect: 100-continue\r\nContent-Length: 100000000\r\n\r\n")
        assert status == b"413" and "larger than" in json.loads(body)["error"]["message"], (status, body)
        for extra, want in ((b"Content-Encoding: br\r\nContent-Length: 9", b"415"),
                            (b"Transfer-Encoding: gzip, chunked", b"501")):   # refused from the headers: no 100
            status, body = _exchange(d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                              b"application/json\r\nExpect: 100-continue\r\n%s\r\n\r\n" % extra)
            assert status == want and "unsupported" in json.loads(body)["error"]["message"], (extra, status, body)
        status, body = post(b"Expect: 200-ok\r\n", ok)
        assert status == b"417" and json.loads(body)["error"]["message"] == "unsupported Expect: '200-ok'"
        status, body = post(b"Expect: 100-continue\r\nExpect: foo\r\n", ok)
        assert status == b"417" and "100-continue, foo" in json.loads(body)["error"]["message"], (status, body)
        status, body = _exchange(d.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: foo\r\n\r\n")
        assert status == b"417" and json.loads(body)["error"]["message"] == "unsupported Expect: 'foo'"
        for enc, data, want, message in [
                (b"", ok.decode().encode("utf-16"), b"400", "not valid JSON"),
                (b"", b"\xef\xbb\xbf" + ok, b"400", "not valid JSON"),
                (b"", ok.decode().encode("utf-32"), b"400", "not valid JSON"),
                (b"", ok[:-1] + b', "user": NaN}', b"400", "NaN is not a JSON number"),   # RFC 8259 section 6
                (b"", ok[:-1] + b', "metadata": -Infinity}', b"400", "-Infinity is not a JSON number"),
                (b"", ok[:-1] + b', "temperature": 1e-400}', b"400",   # not greedy decoding in disguise
                 "a number of the request body: 1e-400 is not 0 but rounds to 0"),
                (b"", ok[:-1] + b', "temperature": 0.0e-400}', b"200", None),
                (b"gzip, gzip", gzip.compress(gzip.compress(ok)), b"415", "unsupported Content-Encoding"),
                (b"br", ok, b"415", "unsupported Content-Encoding"),
                (b"compress", ok, b"415", "unsupported Content-Encoding"),
                (b"gzip", b"abcde", b"400", "could not be read"),
                (b"gzip", gzip.compress(ok), b"200", None),
                (b"gzip", gzip.compress(ok)[:-8], b"400", "the gzip stream ends early"),   # no CRC-32, length
                (b"gzip", gzip.compress(ok)[:-8] + b"\0" * 8, b"400", "incorrect data check"),
                (b"gzip", gzip.compress(ok) + gzip.compress(ok), b"400", "after the gzip stream"),
                (b"gzip", gzip.compress(b" " * (2 << 20) + ok), b"413", "larger than"),
                (b"deflate", raw_deflate, b"200", None),
                (b"deflate", zlib.compress(ok)[:-4], b"400", "the deflate stream ends early"),
                (b"identity", ok, b"200", None),
                (b"deflate, identity", zlib.compress(ok), b"415", "unsupported Content-Encoding"),
                (b"Deflate", zlib.compress(ok), b"200", None),
                (b"gzip\r\nContent-Encoding: gzip", gzip.compress(ok), b"415", "unsupported Content-Encoding"),
                (b"identity\r\nContent-Encoding: foo", ok, b"415", "unsupported Content-Encoding")]:
            status, body = post(b"Content-Encoding: %s\r\n" % enc if enc else b"", data)
            assert status == want, (enc, data[:20], status, body)
            if message:
                assert message in json.loads(body)["error"]["message"], (enc, body)
        for te, data, want in [(b"chunked", ok, b"200"), (b"Chunked", ok, b"200"),
                               (b", chunked", ok, b"200"),       # an empty list element (RFC 9110 5.6.1)
                               (b"gzip, chunked", gzip.compress(ok), b"501"),     # RFC 9112 section 6.1
                               (b"deflate,chunked", zlib.compress(ok), b"501")]:
            status, body = _exchange(d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                             b"application/json\r\nTransfer-Encoding: %s\r\n\r\n" % te,
                                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            assert status == want, (te, status, body)
            if want == b"501":
                assert "unsupported Transfer-Encoding" in json.loads(body)["error"]["message"], body
    finally:
        assert d.stop() == 0
    # The refusals above are the node's JSON answers, not logged. Each client that left after its headers is at
    # most one warning line: whether aiohttp sees it as a reset depends on its version and timing (a machine with
    # another aiohttp logged none).
    err = d.proc.stderr.read().splitlines()
    assert len(err) <= 2 and all(" WARNING " in line and "ConnectionResetError" in line for line in err), err


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405),
                                                ("POST", "/health", 405)])
def test_unknown_routes_get_openai_style_json(daemon, method, path, status):
    req = urllib.request.Request(daemon.url + path, method=method, data=b"{}" if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == status and json.loads(e.value.read())["error"]["message"]


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/completions", {"POST"}),
                                               ("POST", "/health", {"GET", "HEAD"})])
def test_a_405_names_the_methods_the_route_takes(daemon, method, path, allow):
    """RFC 9110 section 15.5.6: a 405 must carry an Allow header; the JSON form of
    aiohttp's 405 had dropped it."""
    req = urllib.request.Request(daemon.url + path, method=method, data=b"{}" if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405 and json.loads(e.value.read())["error"]["message"]
    assert set((e.value.headers["Allow"] or "").split(",")) == allow, e.value.headers


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_a_404_before_any_stream_bytes(daemon, path, stream):
    """A model the node does not serve: 404 model_not_found naming both models; the
    whole body is that JSON, so no SSE event came before it when streaming."""
    body = {"model": "gpt-4o", "stream": stream, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    code, err = daemon.post_raw(path, json.dumps(body).encode())
    assert code == 404, err
    assert err == {"error": {"message": f"the model 'gpt-4o' does not exist on this node; it serves "
                                        f"{daemon.model!r}", "type": "invalid_request_error", "param": "model",
                             "code": "model_not_found"}}


def test_served_model_names(daemon):
    """The id /v1/models lists, the model file's sha256 and an omitted model are served
    (the answer names the listed id); the openai client sees any other name as NotFoundError."""
    assert [m.id for m in daemon.client.models.list().data] == [daemon.model]
    sha = json.loads(daemon.get("/v1/node").read())["model"]["sha256"]
    msgs = [{"role": "user", "content": "Say hi."}]
    for name in (daemon.model, sha):
        r = daemon.client.chat.completions.create(model=name, messages=msgs, max_tokens=1)
        assert r.model == daemon.model and r.model_extra["attestation"]["id"], r
    code, r = daemon.post_raw("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    assert code == 200 and r["model"] == daemon.model, r
    with pytest.raises(openai.NotFoundError) as e:
        daemon.client.chat.completions.create(model=sha.upper(), messages=msgs, max_tokens=1, stream=True)
    assert e.value.code == "model_not_found" and e.value.param == "model"


MALFORMED_HTTP = (
    b"GARBAGE\r\n\r\n",                                                          # request line
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",                  # header
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",  # content-length
    b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{"prompt": "hi"}\r\n\r\n',
)


def test_a_store_another_key_signed_is_refused_at_start(key, tmp_path):
    """Serving a new key from a data folder the old key filled would answer every stored
    attestation with a 500 (the node serves only what it signed): the node refuses to
    start, in one line naming both key ids, exit 2. The old key still serves the folder."""
    data = str(tmp_path / "data")
    d = Daemon(key, data)
    try:
        r = d.client.completions.with_raw_response.create(model=d.model, prompt="Hi", max_tokens=1)
        old_id = r.headers["X-Bitexact-Key-Id"]
    finally:
        assert d.stop() == 0
    other = str(tmp_path / "other.pem")
    subprocess.run([sys.executable, "-m", "node.cli", "keygen", "--out", other], check=True, capture_output=True)
    p = subprocess.run([sys.executable, "-m", "node.cli", "serve", "--key", other, "--data-dir", data, "--port", "0",
                        "--device", DEVICE], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr[-3000:]
    assert f"signed by key id {old_id}" in p.stderr and "another --data-dir" in p.stderr, p.stderr
    d = Daemon(key, data)
    try:
        assert d.get(f"/v1/attestations/{r.headers['X-Bitexact-Attestation-Id']}").status == 200
    finally:
        assert d.stop() == 0


def test_a_bad_store_row_is_a_500_and_one_log_line(key, tmp_path):
    """A row that is not the file its id names (an integer, other bytes) and one that is
    but is no attestation: fetched as the file or as JSON, each is a JSON 500 with one
    log line, no traceback."""
    from test_store_and_models import plant
    garbage = b"\x92\x01\x02"   # msgpack, but no attestation
    rows = {"ab" * 32: 12345, "cd" * 32: b"other bytes", hashlib.sha256(garbage).hexdigest(): garbage}
    d = Daemon(key, str(tmp_path / "data"))
    try:
        for att_id, blob in rows.items():
            plant(tmp_path / "data", att_id, blob)
            for accept in (None, "application/json"):
                with pytest.raises(urllib.error.HTTPError) as e:
                    d.get(f"/v1/attestations/{att_id}", accept)
                assert e.value.code == 500
                assert json.loads(e.value.read()) == {"error": {"message": "the stored attestation is damaged",
                                                                "type": "server_error", "param": None, "code": None}}
    finally:
        assert d.stop() == 0
    err = d.proc.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 6 and all(" bitexact.daemon ERROR attestation " in line for line in lines), err[-3000:]
    for why in ("holds int, not a blob", "SHA-256 is not its id", "not a bitexact attestation"):
        assert sum(why in line for line in lines) == 2, err[-3000:]


def test_a_stored_attestation_not_signed_by_the_node_or_not_json_is_a_500(key, tmp_path):
    """A row holding a valid attestation signed by another key is damaged (a 500 in both
    forms); one signed by the node's own key but holding a NaN is served as the file,
    and its JSON form is a 500 (RFC 8259 has no NaN). One log line each, no traceback."""
    import math

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from attest import envelope, keys
    from test_store_and_models import plant
    d = Daemon(key, str(tmp_path / "data"))
    try:
        r = d.client.completions.with_raw_response.create(model=d.model, prompt="Hi", max_tokens=1)
        good = d.get(f"/v1/attestations/{r.headers['X-Bitexact-Attestation-Id']}").read()
        payload = envelope.open_envelope(good)
        other_key = Ed25519PrivateKey.generate()
        pub = keys.public_raw(other_key)
        other = envelope.seal(dict(payload, signer={"public_key": pub, "key_id": keys.key_id(pub)}), other_key)
        nan = envelope.seal(dict(payload, request=dict(payload["request"], temperature=math.nan)),
                            keys.load_private(key))
        ids = {name: hashlib.sha256(blob).hexdigest() for name, blob in (("other", other), ("nan", nan))}
        plant(tmp_path / "data", ids["other"], other)
        plant(tmp_path / "data", ids["nan"], nan)
        for accept in (None, "application/json"):
            with pytest.raises(urllib.error.HTTPError) as e:
                d.get(f"/v1/attestations/{ids['other']}", accept)
            assert e.value.code == 500 and json.loads(e.value.read())["error"]["message"] == \
                "the stored attestation is damaged"
        assert d.get(f"/v1/attestations/{ids['nan']}").read() == nan
        with pytest.raises(urllib.error.HTTPError) as e:
            d.get(f"/v1/attestations/{ids['nan']}", "application/json")
        assert e.value.code == 500 and json.loads(e.value.read())["error"]["message"] == \
            "the stored attestation is damaged"
    finally:
        assert d.stop() == 0
    err = d.proc.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if " ERROR " in ln]
    assert len(lines) == 3, err[-3000:]
    assert sum("not by the trusted key" in ln for ln in lines) == 2 and "cannot be served as JSON" in lines[2]


ACCEPT_FORMS = [  # (Accept header, served as JSON)
    ("application/json", True),
    ("Application/JSON", True),                                  # media types are case-insensitive
    ("text/html, application/json;q=0.9, */*;q=0.8", True),
    ("application/json, application/msgpack", False),            # a tie: the file, the node's preference
    ("application/json, text/plain, */*", True),                 # an exact type before */*
    ("application/json;q=0", False),                             # q=0: not acceptable
    ("application/json;q=0.5, application/msgpack", False),     # the file is preferred
    ("application/json;Q=0.000", False),
    ("application/json; charset=utf-8", True),                   # the JSON form's own Content-Type
    ("application/json;charset=UTF-8;q=0.9, application/msgpack;q=0.5", True),
    ("application/json;charset=latin-1", False),                 # a charset the JSON form is not in
    ("application/json-seq", False),                             # another type that starts alike
    ("application/jsonx, */*", False),
    ("*/*", False),
    ("", False),
]


def test_the_attestation_form_follows_the_accept_header(key, tmp_path):
    """GET /v1/attestations/{id} gives JSON only to an Accept header whose best match
    is application/json (in any case; RFC 9110 section 12.5.1): above 0, above
    application/msgpack or more specific than the range that matches it; else the .bxa file."""
    import asyncio

    import aiohttp

    node = in_process(key, tmp_path)
    req = Request(prompt="Hi", max_tokens=1)
    att = node.attest(generate(node.engine, node.tok, build_request(req, node.tok, node.engine.n_ctx)))

    async def main():
        async with app_on_loopback(node) as (_, base), aiohttp.ClientSession() as http:
            got = []
            for accept, _ in ACCEPT_FORMS:
                async with http.get(f"{base}/v1/attestations/{att['id']}", headers={"Accept": accept}) as r:
                    got.append((r.status, r.content_type, await r.read()))
            return got
    for (accept, as_json), (status, ctype, body) in zip(ACCEPT_FORMS, asyncio.run(main())):
        assert status == 200, accept
        if as_json:
            assert ctype == "application/json" and json.loads(body)["signature"] == att["signature"], accept
        else:
            assert ctype == "application/msgpack" and hashlib.sha256(body).hexdigest() == att["id"], accept


def test_malformed_http_gets_aiohttp_plain_text_400_and_node_keeps_serving(key, tmp_path):
    """aiohttp's parser answers these before any handler runs, in plain text (aiohttp has
    no public hook to make it JSON; README says so); it closes the connection, the node
    serves the next request, and its log has one warning line per refusal, no traceback."""
    d = Daemon(key, str(tmp_path / "data"))
    try:
        for raw in MALFORMED_HTTP:
            with socket.create_connection(("127.0.0.1", d.port), timeout=20) as s:
                s.sendall(raw)
                got = b""
                while chunk := s.recv(65536):    # until EOF: a socket timeout here means it stayed open
                    got += chunk
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.split(b" ", 2)[1] == b"400" and body, got
            assert b"\r\ncontent-type: text/plain" in head.lower(), got
            assert d.post_raw("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())[0] == 200
    finally:
        assert d.stop() == 0
    err = d.proc.stderr.read()
    refusals = [line for line in err.splitlines() if "aiohttp.server WARNING" in line and "400" in line]
    # one line each (aiohttp does not log the bad request line at all), nothing else
    assert "Traceback" not in err and err.splitlines() == refusals and len(refusals) == 3, err[-3000:]


def test_out_of_file_descriptors_is_a_503_and_one_line_each(key, tmp_path):
    """With its descriptors used up by idle connections, a chat request (whose template
    renderer needs a pipe and a process) gets a JSON 503, not a 500 with a traceback, and
    every log line is one record; once the connections close the node serves again."""
    d = Daemon(key, str(tmp_path / "data"), nofile=200)
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(chat))
    idle = []
    try:
        first = socket.create_connection(("127.0.0.1", d.port), timeout=30)
        first.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 200 " in first.recv(65536)   # accepted while descriptors were left
        for _ in range(250):   # more than the limit: the last ones wait in the listen backlog
            idle.append(socket.create_connection(("127.0.0.1", d.port), timeout=30))
        time.sleep(2)
        first.sendall(head + chat)
        got = b""
        while b"\r\n\r\n" not in got:
            got += first.recv(65536)
        status = got.split(b" ", 2)[1]
        n = int(re.search(rb"(?i)content-length: (\d+)", got).group(1))
        body = got.partition(b"\r\n\r\n")[2]
        while len(body) < n:
            body += first.recv(65536)
        assert status == b"503" and "out of file descriptors" in json.loads(body)["error"]["message"], (status, body)
        first.close()
        for s in idle:
            s.close()
        idle = []
        time.sleep(2)
        assert d.post_raw("/v1/chat/completions", chat)[0] == 200
    finally:
        for s in idle:
            s.close()
        assert d.stop() == 0
    err = d.proc.stderr.read()
    lines = err.splitlines()
    assert "Traceback" not in err and lines, err[-3000:]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", line) for line in lines), err[-3000:]
    assert any("request refused" in line and "Too many open files" in line for line in lines), err[-3000:]
    accepts = [line for line in lines if "socket.accept() out of system resource" in line]
    assert 1 <= len(accepts) <= 4, err[-3000:]   # one per 5 s, not one per retry


def test_a_body_that_does_not_arrive_gets_408_and_the_connection_closes(key, tmp_path):
    """A request whose body stops short is answered 408 (JSON) once --body-timeout
    passes, and its connection is closed (it no longer holds a file descriptor)."""
    d = Daemon(key, str(tmp_path / "data"), "--body-timeout", "1")
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
            s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                      b'Content-Length: 100\r\n\r\n{"pro')
            t0, got = time.monotonic(), b""
            while chunk := s.recv(65536):    # until EOF: a socket timeout here means it stayed open
                got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"408" and time.monotonic() - t0 < 25, got
        assert json.loads(body)["error"]["message"] == "the request body did not arrive within 1 s", got
        assert d.post_raw("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())[0] == 200
    finally:
        assert d.stop() == 0


def test_a_408_closes_the_connection_even_when_the_rest_of_the_body_comes(key, tmp_path):
    """The 408 says Connection: close, and a client that sends the rest of its body
    after it, then another request, gets no second answer on that connection."""
    d = Daemon(key, str(tmp_path / "data"), "--body-timeout", "1")
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
            s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                      b'Content-Length: 20\r\n\r\n{"pr')
            head = s.recv(65536)
            assert head.split(b" ", 2)[1] == b"408" and b"\r\nConnection: close\r\n" in head, head
            s.sendall(b"x" * 16)
            time.sleep(0.5)
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                rest = s.recv(65536)
            except ConnectionResetError:
                rest = b""
            assert rest == b"", rest
    finally:
        assert d.stop() == 0


def test_bad_chat_requests_and_node_keeps_serving(daemon, solo):
    for body in ({"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user"}]},
                 {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user", "content": ""}]}):
        code, err = daemon.post_raw("/v1/chat/completions", json.dumps(body).encode())
        assert code == 400 and err["error"]["type"] == "invalid_request_error", body
    assert send(daemon, "chat", "Say hi.", 4) == solo("chat", "Say hi.", 4)


@pytest.mark.parametrize("limits,param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 10 ** 9}, "max_completion_tokens"),          # past the node's cap
    ({"max_completion_tokens": "2"}, "max_completion_tokens"),
    ({"max_completion_tokens": None, "max_tokens": 0}, "max_tokens"),       # null counts as absent
    ({"max_completion_tokens": None, "max_tokens": "bad"}, "max_tokens"),
    ({"max_completion_tokens": 1, "max_tokens": 1}, "max_tokens"),          # one limit, not two
])
def test_chat_token_limit_errors_name_the_field_given(daemon, limits, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **limits}
    code, err = daemon.post_raw("/v1/chat/completions", json.dumps(body).encode())
    assert code == 400 and err["error"]["param"] == param, err
    assert param in err["error"]["message"] or "max tokens" in err["error"]["message"]


def test_limits_context_body_and_queue(key, tmp_path, solo):
    d = Daemon(key, str(tmp_path / "data"), "--ctx", "48", "--max-body-bytes", "4096", "--max-batch", "1",
               "--max-queue", "1", "--max-tokens-cap", "40")
    try:
        code, err = d.post_raw("/v1/completions", json.dumps({"prompt": "word " * 100}).encode())
        assert code == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == "prompt"
        code, err = d.post_raw("/v1/chat/completions",
                               json.dumps({"messages": [{"role": "user", "content": "word " * 100}]}).encode())
        assert code == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == "messages"
        code, err = d.post_raw("/v1/completions", json.dumps({"prompt": "x" * 10000}).encode())
        assert code == 413 and "error" in err
        code, err = d.post_raw("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 41}).encode())
        assert code == 400 and err["error"]["param"] == "max_tokens"
        # One running and one queued at most: a burst of 24 requests released
        # together must see 429s, whatever the engine's speed.
        burst = threading.Barrier(24)

        def post_after_barrier(i):
            burst.wait()
            return d.post_raw("/v1/completions", json.dumps({"prompt": f"Count: {i}, ", "max_tokens": 30}).encode())
        with concurrent.futures.ThreadPoolExecutor(24) as ex:
            got = list(ex.map(post_after_barrier, range(24)))
        codes = [c for c, _ in got]
        assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 1, codes
        assert all(e["error"]["type"] == "rate_limit_error" for c, e in got if c == 429)
        assert d.post_raw("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())[0] == 200
    finally:
        assert d.stop() == 0


def test_without_max_tokens_a_small_cap_is_the_limit(key, tmp_path):
    """OpenAI's default of 16 tokens, within the node's cap: a request that gives
    no limit is served (at most the cap), not refused for a field it never sent."""
    d = Daemon(key, str(tmp_path / "data"), "--max-tokens-cap", "3")
    try:
        for path, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]})):
            code, out = d.post_raw(path, json.dumps(body).encode())
            assert code == 200 and 1 <= out["usage"]["completion_tokens"] <= 3, out
    finally:
        assert d.stop() == 0


def _wait_active(d, n: int, seconds: float) -> int:
    """Poll /health until ``n`` requests are active or ``seconds`` pass; the last count."""
    end = time.time() + seconds
    while (active := json.loads(d.get("/health").read())["active"]) != n and time.time() < end:
        time.sleep(0.05)
    return active


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_goes_away_frees_its_slot_and_logs_one_line(key, tmp_path, solo, stream):
    """A client that closes its connection mid-stream or before a plain answer:
    its job is cancelled at once, so with one batch slot and no queue the next
    request is served (not 429) long before the first could have finished, with
    the solo bytes; the log has one line for it, no traceback."""
    d = Daemon(key, str(tmp_path / "data"), "--max-batch", "1", "--max-queue", "0")
    try:
        if stream:
            events = d.client.completions.create(model=d.model, prompt="Tell me a very long story:",
                                                 max_tokens=400, stream=True)
            for i, _ in enumerate(events):
                if i == 3:
                    break
            events.close()
        else:
            body = json.dumps({"prompt": "Tell me a very long story:", "max_tokens": 400}).encode()
            with socket.create_connection(("127.0.0.1", d.port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert _wait_active(d, 1, 30) == 1
        assert _wait_active(d, 0, 10) == 0
        assert send(d, "prompt", "Once upon a time", 3) == solo("prompt", "Once upon a time", 3)
    finally:
        assert d.stop() == 0
    err = d.proc.stderr.read()
    why = "went away mid-stream" if stream else "went away before the answer"
    assert why in err and "Traceback" not in err, err[-3000:]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host,shown", [("127.0.0.1", "127.0.0.1"),
                                        pytest.param("::1", "[::1]", marks=pytest.mark.skipif(
                                            not _ipv6_loopback(), reason="no IPv6 loopback here"))])
def test_port_zero_banner_names_the_bound_port(key, tmp_path, host, shown):
    """``--port 0`` lets the kernel pick a free port; the banner's URL names that port
    (an IPv6 host in brackets, RFC 3986) and answers."""
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "serve", "--key", key, "--data-dir",
                             str(tmp_path / "data"), "--port", "0", "--host", host, "--device", DEVICE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        m = re.search(r"(http://" + re.escape(shown) + r":(\d+))\s*$", banner)
        assert m and int(m.group(2)) != 0, banner
        assert json.loads(urllib.request.urlopen(m.group(1) + "/health", timeout=30).read())["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_sigkill_then_restart_keeps_every_returned_attestation(key, tmp_path):
    data = str(tmp_path / "data")
    d = Daemon(key, data)
    ids = []
    for text in ("Red, green and", "The sun is", "Water boils at"):
        r = d.client.completions.create(model=d.model, prompt=text, max_tokens=3)
        ids.append(r.model_extra["attestation"]["id"])
    t = threading.Thread(target=lambda: _swallow(lambda: d.client.completions.create(
        model=d.model, prompt="Write a long essay about the ocean:", max_tokens=500)))
    t.start()
    time.sleep(3)
    d.stop(signal.SIGKILL)
    t.join()
    d2 = Daemon(key, data)
    try:
        for att_id in ids:
            blob = d2.get(f"/v1/attestations/{att_id}").read()
            p = tmp_path / f"{att_id}.bxa"
            p.write_bytes(blob)
            v = subprocess.run([sys.executable, "-m", "node.cli", "verify", str(p)], capture_output=True, text=True)
            assert v.returncode == 0 and v.stdout.startswith("OK"), v.stdout + v.stderr
    finally:
        d2.stop()


def _swallow(fn):
    try:
        fn()
    except Exception:
        pass


def test_sigterm_drains_in_flight_requests(key, tmp_path):
    d = Daemon(key, str(tmp_path / "data"))
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(d.client.completions.create, model=d.model, prompt="Count to twenty: 1, 2, 3,", max_tokens=12)
        time.sleep(2)
        d.proc.send_signal(signal.SIGTERM)
        r = fut.result()
    assert r.choices[0].finish_reason in ("length", "stop") and r.model_extra["attestation"]["id"]
    assert d.proc.wait(60) == 0


def in_process(key, tmp_path, engine_wrapper=lambda e: e):
    """A :class:`node.daemon.Node` in this process on the CPU engine (``engine_wrapper``
    may plant faults in it), for tests that drive the aiohttp app directly."""
    from attest import keys
    from node.daemon import Node
    model = load_model(default_model_path())
    return Node(engine_wrapper(Engine(model, n_ctx=256)), Tokenizer(model), keys.load_private(key),
                str(tmp_path / "data"))


def serve_in_process(node, bodies, before_cleanup=None, **app_kw):
    """POST each of ``bodies`` to /v1/completions of ``node``'s app at once; awaits
    ``before_cleanup(node)`` (if given) before the app shuts down. Returns each
    request's ``(status, body bytes)``, ``(None, error)`` for a dropped connection."""
    import asyncio

    import aiohttp

    async def main():
        async with app_on_loopback(node, **app_kw) as (runner, base):
            async with aiohttp.ClientSession() as http:
                async def post(body):
                    try:
                        async with http.post(base + "/v1/completions", json=body) as r:
                            return r.status, await r.read()
                    except aiohttp.ClientError as e:
                        return None, repr(e)
                tasks = [asyncio.create_task(post(body)) for body in bodies]
                if before_cleanup:
                    await before_cleanup(node)
                    await runner.cleanup()
                return await asyncio.gather(*tasks)
    return asyncio.run(main())


@contextlib.asynccontextmanager
async def app_on_loopback(node, **app_kw):
    """``node``'s aiohttp app served on a free loopback port, as ``serve`` runs it
    (handler cancellation); yields ``(runner, base URL)`` and cleans the runner up."""
    from aiohttp import web

    from node.daemon import make_app
    runner = web.AppRunner(make_app(node, **app_kw), handler_cancellation=True, shutdown_timeout=10)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_requests_past_the_drain_timeout_end_with_a_503(key, tmp_path, caplog):
    """At shutdown, the requests still running when the drain times out end with
    a 503 (an error event when streaming), not a dropped connection, and the log
    says so in one line rather than blaming the clients."""
    import asyncio

    async def both_running(node):
        while node.scheduler.active < 2:
            await asyncio.sleep(0.05)
    (code, plain), (stream_code, streamed) = serve_in_process(
        in_process(key, tmp_path), [{"prompt": "Count: 1, 2,", "max_tokens": 200, "stream": stream}
                                    for stream in (False, True)], both_running, drain_timeout_s=1.0)
    assert code == 503 and json.loads(plain)["error"]["type"] == "server_error", (code, plain)
    assert stream_code == 200 and b'data: {"error": {"message": "the node stopped before the request finished"' \
        in streamed, streamed
    assert "did not finish within 1 s" in caplog.text and "went away" not in caplog.text, caplog.text


def test_an_engine_fault_is_a_500_with_one_log_line(key, tmp_path, caplog):
    """A fault of the engine (here a NaN in a step holding a planted token) fails
    its request with a 500 (an error event when streaming) and one log line each
    naming the request, not a 500 the operator never hears of."""
    from node.errors import NumericFault
    tok = Tokenizer(load_model(default_model_path()))
    marker = tok.encode("Zebras")[-1]

    class Faulty(Wrapped):
        def forward(self, chunks, all_logits=False):
            if any(marker in c for _, c in chunks):
                raise NumericFault("NaN in logits: the forward pass faulted")
            return self.engine.forward(chunks, all_logits)
    got = serve_in_process(in_process(key, tmp_path, Faulty), [
        {"prompt": "Zebras", "max_tokens": 1}, {"prompt": "Zebras", "max_tokens": 1, "stream": True}])
    (code, plain), (stream_code, streamed) = got
    assert code == 500 and json.loads(plain)["error"]["message"] == "NaN in logits: the forward pass faulted"
    assert stream_code == 200 and b'"NaN in logits' in streamed, streamed
    lines = [r for r in caplog.records if "NaN in logits" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelname == "ERROR" and "cmpl-" in r.getMessage() for r in lines), caplog.text


def test_a_second_signal_does_not_cut_the_drain_short(key, tmp_path):
    """SIGTERM, then SIGINT and SIGTERM again while a stream is open: the signals
    after the first do nothing; the stream still ends with its attestation and
    [DONE], and the daemon exits 0."""
    d = Daemon(key, str(tmp_path / "data"))
    body = json.dumps({"prompt": "Count: 1, 2,", "max_tokens": 4, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", d.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
            d.proc.send_signal(sig)
            time.sleep(0.3)
        while chunk := s.recv(65536):
            got += chunk
    assert b'"attestation"' in got and b"data: [DONE]" in got, got[-2000:]
    assert d.proc.wait(60) == 0, d.proc.stderr.read()[-3000:]
    assert "went away" not in d.proc.stderr.read()


LATE_SIGNALS = """
import asyncio, os, signal, time
from aiohttp.web_runner import GracefulExit
from node import cli

async def drain():
    await cli._drain_on_first_signal(None)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(30)

try:
    asyncio.run(drain())
except GracefulExit:
    pass
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("alive")
"""


def test_signals_after_the_drain_do_not_kill_the_teardown():
    """On a fast engine the drain ends before a second signal arrives. The loop then
    closes and removes its signal handlers; SIGINT and SIGTERM arriving after that,
    while the node tears down, must still do nothing (before the fix they restored
    the default handlers and killed the process with -2: seen on the GPU)."""
    proc = subprocess.run([sys.executable, "-c", LATE_SIGNALS], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert (proc.returncode, proc.stdout.strip()) == (0, "alive"), proc.stderr[-2000:]


def test_group_readable_key_refused(key, tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_bytes(open(key, "rb").read())
    os.chmod(bad, 0o640)
    p = subprocess.run([sys.executable, "-m", "node.cli", "serve", "--key", str(bad), "--device", "cpu",
                        "--data-dir", str(tmp_path / "d"), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "readable by group or others" in p.stderr and "Traceback" not in p.stderr


def _gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.skipif(DEVICE == "cuda" and _gpu_count() < 2, reason="GPU ranks need two GPUs")
def test_serve_with_tp_rank_processes_gives_the_solo_digests(key, tmp_path, solo):
    """`serve --tp 2`: two rank processes (on the CPU, or on two GPUs with
    BITEXACT_TEST_DEVICE=cuda); concurrent requests (greedy, sampled, streamed)
    get the digests of the one-process engine; a killed rank gives 500 and a
    503 health check; SIGTERM stops the ranks."""
    d = Daemon(key, str(tmp_path / "data"), "--tp", "2", "--max-batch", "8")
    try:
        kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(d.proc.pid)], capture_output=True,
                              text=True).stdout.split()
        assert len(kids) >= 2, kids                                        # the ranks (and a resource tracker)
        run_concurrently(d, solo, mixed(6) + [("chat", "Say hi.", 3, 0.8, 5, True)])
        ranks = [p for p in kids if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        os.kill(int(ranks[-1]), signal.SIGKILL)                            # a rank dies: the node says so
        end, health = time.time() + 20, None
        while time.time() < end:                   # at once, while idle: no request has to fail on it first
            try:
                d.get("/health").close()
            except urllib.error.HTTPError as e:
                health = (e.code, json.loads(e.read()))
                break
            time.sleep(0.1)
        assert health is not None and health[0] == 503 and health[1]["status"] == "broken", health
        code, err = d.post_raw("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
        assert code == 500 and "restarted" in err["error"]["message"], err
    finally:
        assert d.stop() == 0
    assert "tensor parallel: 2 rank processes" in d.proc.stdout.read()
    end = time.time() + 20
    while time.time() < end and any(os.path.exists(f"/proc/{pid}") for pid in kids):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in kids), "rank processes outlived the daemon"


def test_an_event_for_a_closed_loop_is_dropped():
    """A step the shutdown left behind finishes after the event loop closed: its
    events are dropped, not a RuntimeError that kills the engine worker thread."""
    import asyncio

    from node.daemon import deliver_to
    loop = asyncio.new_event_loop()
    events = asyncio.Queue()
    on_event = deliver_to(loop, events)
    on_event("token", 1)
    loop.run_until_complete(asyncio.sleep(0))
    assert events.get_nowait() == ("token", 1)
    loop.close()
    on_event("done", 2)   # no RuntimeError
    assert events.empty()
