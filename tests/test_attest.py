"""Attestation format: canonical msgpack, the signed envelope and tamper detection.

One real attestation is made per session (``bitexact run`` on the default
model, 3 tokens); every case here works on copies of its bytes in-process.
tests/test_cli.py reuses the same attestation through :func:`artifact`.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import json
import os
import random
import re
import struct
import subprocess
import sys
from dataclasses import dataclass

import msgpack
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st

from attest import canonical, envelope, keys, schema
from node.errors import AttestationError, KeyError_

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
MAX_TOKENS = 3


# --------------------------------------------------------------------------
# Shared helpers (also imported by tests/test_cli.py)

def cli_env() -> dict:
    env = dict(os.environ)
    env.pop("BITEXACT_KEY_PASSPHRASE", None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def bx(cwd, *args, timeout=300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m node.cli ARGS`` in ``cwd`` (``env`` adds variables)."""
    return subprocess.run([sys.executable, "-m", "node.cli", *map(str, args)], cwd=str(cwd),
                          env={**cli_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)


def assert_input_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """Exit ``code`` with exactly one ``bitexact: error:`` line on stderr and no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bitexact: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@dataclass
class Artifact:
    dir: str
    key: str          # KEY.pem (unencrypted)
    pub: str          # KEY.pub.pem
    bxa: str          # the attestation written by ``bitexact run``
    data: bytes       # its bytes
    payload: dict     # its checked payload
    run_stdout: str
    run_stderr: str

    def private_key(self) -> Ed25519PrivateKey:
        return keys.load_private(self.key)


_ARTIFACT: Artifact | None = None


def artifact(tmp_path_factory) -> Artifact:
    """The session's single real attestation (made once, shared by both test files)."""
    global _ARTIFACT
    if _ARTIFACT is None:
        d = tmp_path_factory.mktemp("signed")
        p = bx(d, "keygen", "--out", "node.pem")
        assert p.returncode == 0, p.stderr
        p = bx(d, "run", "--key", "node.pem", "--prompt", PROMPT, "--max-tokens", MAX_TOKENS, "--device", "cpu")
        assert p.returncode == 0, p.stderr
        names = sorted(os.listdir(d))
        bxas = [n for n in names if n.endswith(".bxa")]
        assert len(bxas) == 1 and names == sorted(bxas + ["node.pem", "node.pub.pem"]), names
        path = os.path.join(d, bxas[0])
        with open(path, "rb") as f:
            data = f.read()
        payload = envelope.open_envelope(data)
        _ARTIFACT = Artifact(str(d), os.path.join(d, "node.pem"), os.path.join(d, "node.pub.pem"), path, data,
                             payload, p.stdout, p.stderr)
    return _ARTIFACT


def sign_raw(payload_obj, key: Ed25519PrivateKey, version=envelope.FORMAT_VERSION, body: bytes | None = None) -> bytes:
    """An envelope built from the internals, without :func:`envelope.seal`'s schema check."""
    if body is None:
        body = canonical.encode(payload_obj)
    sig = key.sign(envelope.pae(envelope.PAYLOAD_TYPE, body))
    return canonical.encode([envelope.MAGIC, version, body, keys.public_raw(key), sig])


def split_envelope(data: bytes):
    env = canonical.decode(data)
    assert isinstance(env, list) and len(env) == 5
    return env


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Artifact:
    return artifact(tmp_path_factory)


# --------------------------------------------------------------------------
# The real attestation itself

def test_run_wrote_a_consistent_attestation(art):
    p = art.payload
    assert os.path.basename(art.bxa) == p["output"]["digest"].hex() + ".bxa"
    assert art.run_stdout == p["output"]["text"] + "\n"
    err = art.run_stderr.splitlines()
    assert len(err) == 1 and err[0].startswith(f"attestation: {os.path.basename(art.bxa)} ")
    assert p["request"]["prompt"] == PROMPT and p["request"]["max_tokens"] == MAX_TOKENS
    assert len(p["output"]["tokens"]) == MAX_TOKENS == len(p["output"]["step_chain"])
    assert p["output"]["finish_reason"] == "length"
    assert p["signer"]["public_key"] == keys.load_public(art.pub)
    assert p["signer"]["key_id"] == hashlib.sha256(p["signer"]["public_key"]).hexdigest()
    assert p["backend"] == "cpu"
    # The stored bytes are exactly the canonical re-encoding of the envelope.
    assert canonical.encode(split_envelope(art.data)) == art.data


def test_trusted_key(art, tmp_path):
    own = keys.load_public(art.pub)
    assert envelope.open_envelope(art.data, trusted_key=own) == art.payload
    other = keys.public_raw(Ed25519PrivateKey.generate())
    with pytest.raises(AttestationError, match="not by the trusted key"):
        envelope.open_envelope(art.data, trusted_key=other)


IDENTITY = b"\x01" + bytes(31)   # the neutral point: [S]B = R + [k]A holds for R = identity, S = 0
WEAK_KEYS = {"identity": IDENTITY, "zero (order 4)": bytes(32), "p - 1 (order 2)": b"\xec" + b"\xff" * 30 + b"\x7f",
             "p (non-canonical zero)": b"\xed" + b"\xff" * 30 + b"\x7f",
             "identity with the sign bit": b"\x01" + bytes(30) + b"\x80"}


def test_identity_key_forgery_is_refused(art, tmp_path):
    """Under the identity key one signature verifies for every message in ``cryptography``
    (RFC 8032 does not require refusing small-order keys); the envelope refuses such keys
    before the signature, so the forgery of a changed payload fails, in the API and in the CLI."""
    forged_sig = IDENTITY + bytes(32)
    Ed25519PublicKey.from_public_bytes(IDENTITY).verify(forged_sig, b"any message at all")   # the hazard
    p = copy.deepcopy(art.payload)
    p["output"]["text"] = "forged"
    p["signer"] = {"public_key": IDENTITY, "key_id": keys.key_id(IDENTITY)}
    data = canonical.encode([envelope.MAGIC, 1, canonical.encode(p), IDENTITY, forged_sig])
    with pytest.raises(AttestationError, match="weak Ed25519 key"):
        envelope.open_envelope(data)
    path = tmp_path / "forged.bxa"
    path.write_bytes(data)
    for cmd in ("verify", "inspect"):
        msg = assert_input_error(bx(tmp_path, cmd, str(path)))
        assert "weak Ed25519 key" in msg, msg


@pytest.mark.parametrize("name", sorted(WEAK_KEYS))
def test_weak_public_keys_are_refused(art, tmp_path, name):
    raw = WEAK_KEYS[name]
    assert not keys.is_valid_public(raw) and keys.is_valid_public(keys.load_public(art.pub))
    _, version, body, _, sig = split_envelope(art.data)
    with pytest.raises(AttestationError, match="weak Ed25519 key"):
        envelope.open_envelope(canonical.encode([envelope.MAGIC, version, body, raw, sig]))
    pem = tmp_path / "weak.pub.pem"
    pem.write_bytes(Ed25519PublicKey.from_public_bytes(raw).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(KeyError_, match="weak Ed25519 key"):
        keys.load_public(str(pem))



def test_a_key_bundle_is_refused(art, tmp_path):
    """A --trusted-key file holding two PEM public keys is refused: the loader would
    trust the first alone. One key with explanatory text around it (RFC 7468) loads."""
    one = open(art.pub, "rb").read()
    other = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    bundle = tmp_path / "two.pub.pem"
    bundle.write_bytes(one + other)
    with pytest.raises(KeyError_, match="holds 2 PEM blocks: give one public key$"):
        keys.load_public(str(bundle))
    noted = tmp_path / "noted.pub.pem"
    noted.write_bytes(b"the node's key\n" + one + b"\n")
    assert keys.load_public(str(noted)) == keys.load_public(art.pub)


def test_the_json_form_and_other_formats_are_named_not_an_attestation(art):
    """Files that cannot start an envelope (its first byte is canonical msgpack's
    fixarray of 5) are refused before decoding: the daemon's JSON form says it is
    JSON, base64 and gzip of the file are not attestations. A positive fixint first
    byte ('{', letters) had read as "bytes follow the end of its first value"."""
    doc = json.dumps({"id": "x", "payload_msgpack_b64": base64.b64encode(art.data).decode()}).encode()
    for data in (doc, b"\n  " + doc):
        with pytest.raises(AttestationError, match=r"^not a bitexact attestation \(this is JSON: verify and "
                                                   r"inspect read the msgpack file, application/msgpack\)$"):
            envelope.open_envelope(data)
    for data in (base64.b64encode(art.data), gzip.compress(art.data), b"\x94" + art.data[1:]):
        with pytest.raises(AttestationError, match="^not a bitexact attestation$"):
            envelope.open_envelope(data)
    assert art.data[:1] == envelope.ENVELOPE_HEAD and envelope.open_envelope(art.data) == art.payload


# --------------------------------------------------------------------------
# Tampering with the stored bytes

@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_single_byte_flip_is_rejected(art, mask):
    data = art.data
    buf = bytearray(data)
    accepted = []
    for i in range(len(buf)):
        buf[i] ^= mask
        try:
            envelope.open_envelope(bytes(buf))
        except AttestationError:
            pass
        else:
            accepted.append(i)
        buf[i] ^= mask
    assert bytes(buf) == data
    assert accepted == []


def test_every_truncation_and_extension_is_rejected(art):
    data = art.data
    for cut in range(len(data)):
        with pytest.raises(AttestationError):
            envelope.open_envelope(data[:cut])
    for extra in (b"\x00", b"\xc0", data[:1], data):
        with pytest.raises(AttestationError):
            envelope.open_envelope(data + extra)


def _leaf_paths(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaf_paths(v, path + (k,))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaf_paths(v, path + (i,))
    else:
        yield path


def _container_paths(obj, path=()):
    if isinstance(obj, (dict, list)):
        yield path, obj
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            yield from _container_paths(v, path + (k,))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _set(obj, path, value):
    _get(obj, path[:-1])[path[-1]] = value


def _changed(v):
    """A different value of the same shape (hex strings stay lowercase hex)."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v + 0.5
    if isinstance(v, bytes):
        return bytes([v[0] ^ 1]) + v[1:]
    if isinstance(v, str):
        if len(v) == 64 and all(c in "0123456789abcdef" for c in v):
            return v[:-1] + ("0" if v[-1] != "0" else "1")
        return v + "x"
    if v is None:
        return []
    if v == []:
        return ["x"]
    raise AssertionError(f"no mutation for {v!r}")


def _field_mutations(payload):
    for path in _leaf_paths(payload):
        p = copy.deepcopy(payload)
        _set(p, path, _changed(_get(payload, path)))
        yield "set " + ".".join(map(str, path)), p
    for path, c in _container_paths(payload):
        if isinstance(c, dict):
            for k in c:
                p = copy.deepcopy(payload)
                del _get(p, path)[k]
                yield "drop " + ".".join(map(str, path + (k,))), p
            p = copy.deepcopy(payload)
            _get(p, path)["zz_extra"] = 0
            yield "add " + ".".join(map(str, path + ("zz_extra",))), p
        elif c:
            p = copy.deepcopy(payload)
            _get(p, path).append(copy.deepcopy(c[-1]))
            yield "append " + ".".join(map(str, path)), p
            p = copy.deepcopy(payload)
            _get(p, path).pop()
            yield "pop " + ".".join(map(str, path)), p


def test_each_payload_field_change_breaks_the_signature(art):
    _, version, body, pub, sig = split_envelope(art.data)
    assert canonical.decode(body) == art.payload
    seen = set()
    cases = list(_field_mutations(art.payload))
    names = {n for n, _ in cases}
    for must in ("set output.tokens.0", "set output.step_chain.2", "set output.text", "set output.digest",
                 "set request.prompt", "set request.prompt_tokens.0", "set request.temperature",
                 "set request.seed", "set request.messages", "set request.stop", "set model.sha256",
                 "set signer.public_key", "set signer.key_id", "set timestamp", "set contract_version",
                 "set engine.reference_sha256", "set device.cpu", "drop output", "add zz_extra",
                 "append output.tokens", "pop output.step_chain"):
        assert must in names, must
    for name, mutated in cases:
        new_body = canonical.encode(mutated)
        assert new_body != body, name
        assert new_body not in seen, name
        seen.add(new_body)
        forged = canonical.encode([envelope.MAGIC, version, new_body, pub, sig])
        with pytest.raises(AttestationError, match="bad signature"):
            envelope.open_envelope(forged)
    assert len(cases) > 60


def test_swapping_in_another_key_is_rejected(art):
    _, version, body, pub, sig = split_envelope(art.data)
    other = Ed25519PrivateKey.generate()
    # The old signature under another public key.
    forged = canonical.encode([envelope.MAGIC, version, body, keys.public_raw(other), sig])
    with pytest.raises(AttestationError, match="bad signature"):
        envelope.open_envelope(forged)
    # A valid signature by another key over a payload that still names the original signer.
    forged = sign_raw(None, other, body=body)
    with pytest.raises(AttestationError, match="different signer"):
        envelope.open_envelope(forged)


def test_an_attestation_no_reader_accepts_is_never_sealed(art, monkeypatch):
    """seal refuses to write an attestation larger than MAX_BYTES (a long enough
    output would make one); at the limit it still writes it."""
    blob = envelope.seal(art.payload, art.private_key())
    monkeypatch.setattr(canonical, "MAX_BYTES", len(blob))
    assert envelope.open_envelope(envelope.seal(art.payload, art.private_key())) == art.payload
    monkeypatch.setattr(canonical, "MAX_BYTES", len(blob) - 1)
    with pytest.raises(AttestationError, match=f"^the attestation would take {len(blob)} bytes, more than the "
                                               f"{len(blob) - 1} a reader accepts: shorten the request or its output$"):
        envelope.seal(art.payload, art.private_key())


def _chat_payload(art, n: int) -> dict:
    p = copy.deepcopy(art.payload)
    p["request"]["mode"], p["request"]["messages"] = "chat", [{"role": "user", "content": ""}] * n
    return p


def test_a_payload_with_more_maps_than_a_reader_counts_is_never_sealed(art):
    """One chat message is one map of the payload: with more than MAX_CONTAINERS arrays and
    maps in all (a chat template that renders few of them keeps the prompt short), no reader
    would open the file, so seal refuses it; at the limit it opens."""
    from node.generate import MAX_MESSAGES
    blob = envelope.seal(_chat_payload(art, MAX_MESSAGES), art.private_key())
    assert len(envelope.open_envelope(blob)["request"]["messages"]) == MAX_MESSAGES
    with pytest.raises(AttestationError, match="holds more than 65536 arrays and maps.*which no reader accepts"):
        envelope.seal(_chat_payload(art, MAX_MESSAGES + 1), art.private_key())


def test_a_request_with_more_chat_messages_than_an_attestation_holds_is_refused():
    """Refused before it runs (the daemon: a 400), not after, when it could not be attested."""
    from node.errors import RequestError
    from node.generate import MAX_MESSAGES, Request
    Request(messages=[{"role": "user", "content": "hi"}] * MAX_MESSAGES).validate()
    with pytest.raises(RequestError, match=f"^a request may have at most {MAX_MESSAGES} chat messages, "
                                           f"got {MAX_MESSAGES + 1}$") as e:
        Request(messages=[{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)).validate()
    assert e.value.param == "messages"


def test_resealed_by_the_same_key_passes_the_signature_check(art):
    p = copy.deepcopy(art.payload)
    p["output"]["tokens"][1] += 1
    p["output"]["step_chain"][1] = hashlib.sha256(b"forged").digest()
    assert envelope.open_envelope(envelope.seal(p, art.private_key())) == p


# --------------------------------------------------------------------------
# Versions: only the version is wrong, the signature is valid

def test_unknown_envelope_format_version(art):
    _, version, body, pub, sig = split_envelope(art.data)
    assert version == envelope.FORMAT_VERSION == 1
    for v in (0, 2, 255, -1, "1", 1.0, True, None, [1]):
        forged = canonical.encode([envelope.MAGIC, v, body, pub, sig])
        with pytest.raises(AttestationError, match="unknown attestation format version"):
            envelope.open_envelope(forged)
    # Same bytes with version 1 open fine: only the version was wrong.
    assert envelope.open_envelope(canonical.encode([envelope.MAGIC, 1, body, pub, sig])) == art.payload


@pytest.mark.parametrize("field,value,message", [
    ("format_version", 2, "unknown payload format version"),
    ("format_version", 0, "unknown payload format version"),
    ("contract_version", 3, "unknown determinism-contract version"),
    ("contract_version", 0, "unknown determinism-contract version"),
])
def test_unknown_payload_versions(art, field, value, message):
    p = copy.deepcopy(art.payload)
    p[field] = value
    with pytest.raises(AttestationError, match=message):
        envelope.seal(p, art.private_key())
    with pytest.raises(AttestationError, match=message):
        envelope.open_envelope(sign_raw(p, art.private_key()))


@pytest.mark.parametrize("path,value,message", [
    (("backend",), "tpu", "unknown backend"),
    (("output", "finish_reason"), "done", "unknown finish reason"),
    (("request", "mode"), "batch", "unknown request mode"),
    (("request", "temperature"), 0, "wrong type"),
    (("request", "temperature"), -0.0, "request.temperature is -0.0, which is not canonical"),
    (("request", "top_p"), -0.0, "request.top_p is -0.0, which is not canonical"),
    (("request", "max_tokens"), True, "must be an integer"),
    (("model", "sha256"), "AB" * 32, "64 lowercase hex"),
    (("output", "digest"), b"\x00" * 31, "32 bytes"),
    (("output", "tokens"), [1, 2], "differ in length"),
])
def test_signed_but_schema_invalid_payloads(art, path, value, message):
    p = copy.deepcopy(art.payload)
    _set(p, path, value)
    with pytest.raises(AttestationError, match=message):
        envelope.open_envelope(sign_raw(p, art.private_key()))


def test_a_signed_output_without_tokens_is_refused(art):
    """Every request samples at least one token: a signed output with no tokens (and so no
    step chain) is malformed (docs/attestation.md, output.tokens), refused before any
    re-execution."""
    p = copy.deepcopy(art.payload)
    p["output"]["tokens"], p["output"]["step_chain"] = [], []
    with pytest.raises(AttestationError, match="^output.tokens is empty: an output holds at least one token$"):
        envelope.open_envelope(sign_raw(p, art.private_key()))


CUDA_DEVICE = {"gpu": "NVIDIA H200", "compute_capability": "9.0", "driver": "580.95.05", "cuda_driver": "13000",
               "cuda_runtime": "13000", "cupy": "14.0.0"}


@pytest.mark.parametrize("backend,device,message", [
    ("cpu", CUDA_DEVICE, "does not describe a cpu device"),
    ("cuda", {"cpu": "x", "machine": "x86_64", "python": "3.11.2"}, "does not describe a cuda device"),
    ("cpu", {"cpu": "x", "machine": "x86_64", "python": "3.11.2", "tensor_parallel": 2}, "unexpected"),
    ("cpu", {"cpu": "x", "machine": "x86_64", "python": 311}, "device.python must be a string"),
    ("cuda", dict(CUDA_DEVICE, gpu=None), "device.gpu must be a string"),
    ("cuda", dict(CUDA_DEVICE, tensor_parallel=3), "tensor_parallel must be one of"),
    ("cuda", dict(CUDA_DEVICE, tensor_parallel=2.0), "tensor_parallel must be one of"),
    ("cuda", dict(CUDA_DEVICE, tensor_parallel=True), "tensor_parallel must be one of"),
    ("cuda", {k: v for k, v in CUDA_DEVICE.items() if k != "driver"}, r"missing \['driver'\]"),
    ("cuda", CUDA_DEVICE, None),
    ("cuda", dict(CUDA_DEVICE, tensor_parallel=8), None),
])
def test_device_record_must_match_the_backend(art, backend, device, message):
    """A signed payload whose device map is not the backend's record (node/provenance.py,
    CudaBackend.device_record) is refused at the schema; the backend's own records pass."""
    p = copy.deepcopy(art.payload)
    p["backend"], p["device"] = backend, device
    data = sign_raw(p, art.private_key())
    if message is None:
        assert envelope.open_envelope(data) == p
    else:
        with pytest.raises(AttestationError, match=message):
            envelope.open_envelope(data)


def test_engine_name_is_checked(art):
    p = copy.deepcopy(art.payload)
    p["engine"]["name"] = "other-engine"
    with pytest.raises(AttestationError, match="unknown engine 'other-engine'"):
        envelope.open_envelope(sign_raw(p, art.private_key()))


def _packb_sorted(obj):
    """Sorted-key msgpack without the canonical module's type checks."""
    def srt(o):
        if isinstance(o, dict):
            return {k: srt(o[k]) for k in sorted(o, key=lambda k: k.encode())}
        if isinstance(o, list):
            return [srt(v) for v in o]
        return o
    return msgpack.packb(srt(obj), use_bin_type=True)


def test_ext_types_inside_a_signed_payload_are_rejected(art):
    p = copy.deepcopy(art.payload)
    p["device"]["clock"] = msgpack.Timestamp(5)
    with pytest.raises(TypeError):
        canonical.encode(p)
    forged = sign_raw(None, art.private_key(), body=_packb_sorted(p))
    with pytest.raises(AttestationError, match="not canonically encoded"):
        envelope.open_envelope(forged)


def test_garbage_files(art):
    cases = [b"", b"\x90", b'{"format": "bitexact-attestation"}\n', random.Random(0).randbytes(512),
             canonical.encode({"a": [1, 2]}), canonical.encode(["bitexact-attestation", 1]),
             canonical.encode(["bitexact-attestation", 1, b"x", b"y" * 32, b"z" * 64]),
             canonical.encode(["bitexact-attestation", 1, "body", b"y" * 32, b"z" * 64]),
             canonical.encode(["bitexact-attestation", 1, b"x", b"y" * 31, b"z" * 64]),
             canonical.encode(["other-magic"] + split_envelope(art.data)[1:])]
    for data in cases:
        with pytest.raises(AttestationError):
            envelope.open_envelope(data)


# --------------------------------------------------------------------------
# Canonical encoding

def test_insertion_order_does_not_change_the_bytes():
    a = {"b": 1, "a": [{"y": 2.5, "x": b"\x00"}], "é": None, "B": "s"}
    b = {"B": "s", "é": None, "a": [{"x": b"\x00", "y": 2.5}], "b": 1}
    assert list(a) != list(b)
    assert canonical.encode(a) == canonical.encode(b)
    assert canonical.decode(canonical.encode(a)) == a
    # Keys sorted by UTF-8 bytes: "B" (0x42) < "a" < "b" < "é" (0xc3 0xa9).
    assert list(canonical.decode(canonical.encode(a))) == ["B", "a", "b", "é"]


def test_canonical_forms_accepted():
    assert canonical.decode(b"\x05") == 5
    assert canonical.decode(b"\xcc\x80") == 128
    assert canonical.decode(b"\xcb" + struct.pack(">d", 1.5)) == 1.5
    assert canonical.decode(b"\xa1a") == "a"
    assert canonical.decode(b"\xc4\x01a") == b"a"
    assert canonical.encode(1.5) == b"\xcb" + struct.pack(">d", 1.5)


@pytest.mark.parametrize("data", [
    b"\xce\x00\x00\x00\x05",                      # 5 as uint32 (fits positive fixint)
    b"\xcc\x05",                                  # 5 as uint8
    b"\xcd\x00\x80",                              # 128 as uint16 (fits uint8)
    b"\xd0\xff",                                  # -1 as int8 (fits negative fixint)
    b"\xca" + struct.pack(">f", 1.5),             # float32 instead of float64
    msgpack.packb({"b": 1, "a": 2}),              # unsorted map keys
    b"\xd9\x01a",                                 # str8 for a 1-byte string (fixstr fits)
    b"\xdc\x00\x01\x01",                          # array16 for one element
    b"\xde\x00\x01\xa1a\x01",                     # map16 for one entry
    msgpack.packb(msgpack.Timestamp(5)),          # ext type (timestamp)
    msgpack.packb(msgpack.ExtType(1, b"x")),      # ext type
    msgpack.packb({b"a": 1}, use_bin_type=True),  # bin map key
])
def test_non_canonical_encodings_are_rejected(data):
    with pytest.raises(AttestationError, match="not canonically encoded"):
        canonical.decode(data)


@pytest.mark.parametrize("data", [
    b"", b"\xcb\x00", b"\x92\x01",                 # truncated
    b"\x82\xa1a\x01\xa1a\x02",                     # duplicate key
    b"\x81\x01\x02",                               # int map key
    b"\xc1",                                       # reserved byte
    b"\x05\x00",                                   # trailing byte
])
def test_malformed_msgpack_is_rejected(data):
    with pytest.raises(AttestationError, match="not valid msgpack"):
        canonical.decode(data)


def test_bytes_past_the_first_value_are_named_as_such():
    """A 5-element array whose header says 4 (one altered byte): the message says
    bytes follow the first value, not msgpack's own "received extra data"."""
    with pytest.raises(AttestationError, match="bytes follow the end of its first value"):
        canonical.decode(b"\x94\x01\x02\x03\x04\x05", "attestation file")


@pytest.mark.parametrize("depth,ok", [(canonical.MAX_DEPTH, True), (canonical.MAX_DEPTH + 1, False),
                                      (600, False), (1000, False), (1025, False), (100000, False)])
def test_nesting_depth_is_bounded(depth, ok):
    """Arrays nested past MAX_DEPTH are refused with a message that says so
    (600 levels is past msgpack's own packing limit, past 1024 its unpacking one)."""
    data = b"\x91" * (depth - 1) + b"\x90"
    if ok:
        assert canonical.decode(data) is not None
    else:
        with pytest.raises(AttestationError, match="deeper than"):
            canonical.decode(data)


@pytest.mark.parametrize("kind,n,ok", [("array", canonical.MAX_ARRAY, True), ("array", canonical.MAX_ARRAY + 1, False),
                                       ("map", canonical.MAX_MAP, True), ("map", canonical.MAX_MAP + 1, False),
                                       ("array", 2 ** 32 - 1, False), ("map", 2 ** 32 - 1, False)])
def test_array_and_map_lengths_are_bounded_at_their_header(kind, n, ok):
    """An array or map longer than MAX_ARRAY / MAX_MAP is refused from its header
    alone: a header claiming 2^32 - 1 items with none behind it fails the same way
    (not as truncated data), so no item of an oversized container is read."""
    import msgpack
    if kind == "array":
        data = msgpack.packb([0] * n) if ok or n < 2 ** 32 - 1 else b"\xdd" + n.to_bytes(4, "big")
    else:
        data = (msgpack.packb({f"k{i:07d}": 0 for i in range(n)}) if ok or n < 2 ** 32 - 1
                else b"\xdf" + n.to_bytes(4, "big"))
    if ok:
        assert len(canonical.decode(data)) == n
    else:
        with pytest.raises(AttestationError, match=f"exceeds max_{kind}_len"):
            canonical.decode(data)


def _bomb(n: int) -> bytes:
    """A canonical msgpack array of ``n`` arrays of 2^20 empty arrays: 1 MiB per array,
    about 80 MiB of Python objects per array once decoded."""
    return bytes([0x90 + n]) + (b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20)) * n


def _peak_bytes(fn) -> int:
    """Peak memory (bytes) Python allocates while ``fn()`` runs."""
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_array_bomb_is_refused_before_it_is_built(art):
    """Many empty arrays (one byte each) are refused once more than MAX_CONTAINERS arrays
    and maps are decoded, as a file and as a payload signed by its key: the decoding
    stops there instead of building them all (a few MiB instead of about 160 MiB)."""
    bomb = _bomb(2)

    def as_file():
        with pytest.raises(AttestationError, match="^not a bitexact attestation$"):
            envelope.open_envelope(bomb)

    def as_payload():
        with pytest.raises(AttestationError, match=f"^attestation payload holds more than {canonical.MAX_CONTAINERS} "
                                                   f"arrays and maps, or more than {canonical.MAX_ITEMS} items in them$"):
            envelope.open_envelope(sign_raw(None, art.private_key(), body=bomb))

    assert _peak_bytes(as_file) < 1 << 20
    assert _peak_bytes(as_payload) < 16 << 20


def test_items_of_open_arrays_are_bounded_by_the_size_limit():
    """Items count only once their array ends, so arrays nested in the last item of
    arrays of 2-character strings hold all their items open at once: the size limit
    bounds them. A file as large as allowed (16 MiB) costs under 400 MiB of memory
    (at 64 MiB it cost 1.6 GiB) and is refused; one byte more is refused before decoding."""
    item = canonical.encode("ab")
    n = canonical.MAX_ARRAY - 1
    data, level = b"", 0
    while len(data) + 5 + n * len(item) < canonical.MAX_BYTES - 64:   # array32 headers, innermost last
        level += 1
        data += b"\xdd" + (n + 1).to_bytes(4, "big") + item * n
    data += canonical.encode(["ab"] * ((canonical.MAX_BYTES - 64 - len(data)) // len(item)))
    assert level >= 4 and canonical.MAX_BYTES - 128 < len(data) <= canonical.MAX_BYTES

    def refused():
        with pytest.raises(AttestationError, match="^not a bitexact attestation$"):
            envelope.open_envelope(data)

    assert _peak_bytes(refused) < 400 << 20
    with pytest.raises(AttestationError, match=f"larger than {canonical.MAX_BYTES} bytes"):
        canonical.decode(bytes(canonical.MAX_BYTES + 1))


@pytest.mark.parametrize("extra,ok", [(0, True), (1, False)])
def test_arrays_and_maps_in_all_are_bounded(extra, ok):
    """MAX_CONTAINERS arrays and maps in all decode (the outer array is one of them), one more does not."""
    n = canonical.MAX_CONTAINERS - 2 + extra
    data = canonical.encode([[] for _ in range(n)] + [{}])
    if ok:
        assert canonical.decode(data) == [[] for _ in range(n)] + [{}]
    else:
        with pytest.raises(canonical.LimitError, match="more than 65536 arrays and maps"):
            canonical.decode(data)


@pytest.mark.parametrize("extra,ok", [(0, True), (1, False)])
def test_items_in_all_are_bounded(extra, ok):
    """MAX_ITEMS items in all arrays and maps decode, one more does not (each array
    here is within MAX_ARRAY); the outer array's 4 items count too."""
    last = canonical.MAX_ARRAY - 4 + extra
    data = canonical.encode([[None] * canonical.MAX_ARRAY] * 3 + [[None] * last])
    if ok:
        assert [len(a) for a in canonical.decode(data)] == [canonical.MAX_ARRAY] * 3 + [last]
    else:
        with pytest.raises(canonical.LimitError, match="more than 4194304 items"):
            canonical.decode(data)


def test_a_long_step_chain_decodes():
    """A context's worth of steps (8192 links of 32 bytes and their tokens) is well within the limits."""
    out = {"step_chain": [bytes([i % 256]) * 32 for i in range(8192)], "tokens": list(range(50000, 58192))}
    assert canonical.decode(canonical.encode(out)) == out


_scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
            | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, database=None)
@given(_values)
def test_canonical_round_trip_and_order_independence(v):
    data = canonical.encode(v)
    assert canonical.decode(data) == v
    assert canonical.encode(canonical.decode(data)) == data

    def reverse(o):
        if isinstance(o, dict):
            return {k: reverse(o[k]) for k in reversed(list(o))}
        if isinstance(o, list):
            return [reverse(x) for x in o]
        return o
    assert canonical.encode(reverse(v)) == data


def test_schema_matches_envelope_versions():
    assert schema.FORMAT_VERSION == envelope.FORMAT_VERSION == 1
    assert schema.CONTRACT_VERSIONS == (1, 2)


# --------------------------------------------------------------------------
# Key files: a key pair is written whole or not at all

@pytest.mark.parametrize("fail_at", [1, 2])   # the folder fsync after the private key, after the public key
@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), KeyboardInterrupt()])
def test_keygen_that_fails_after_a_link_leaves_neither_file(tmp_path, monkeypatch, fail_at, error):
    """A failure or Ctrl-C once a key file is linked into place (the folder's
    fsync) removes it again: no lone private key that later keygens refuse to
    replace, no public key without its private key."""
    import stat as stat_
    real, dirs = os.fsync, [0]

    def fsync(fd):
        if stat_.S_ISDIR(os.fstat(fd).st_mode):
            dirs[0] += 1
            if dirs[0] == fail_at:
                raise error
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises((KeyError_, KeyboardInterrupt)):
        keys.generate(str(tmp_path / "KEY.pem"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("late", ["KEY.pem", "KEY.pub.pem"])
def test_keygen_names_a_file_made_after_its_check(tmp_path, monkeypatch, late):
    """A key file that appears between keygen's check and its link: refused, the
    message names that file (not the temp file), the newcomer is kept and no other
    file is left."""
    real = keys.atomic_write

    def racing(path, data, **kw):
        if os.path.basename(path) == late:
            (tmp_path / late).write_bytes(b"newcomer")
        return real(path, data, **kw)
    monkeypatch.setattr(keys, "atomic_write", racing)
    with pytest.raises(KeyError_, match=f"^refusing to overwrite existing file {re.escape(str(tmp_path / late))}$"):
        keys.generate(str(tmp_path / "KEY.pem"))
    assert os.listdir(tmp_path) == [late] and (tmp_path / late).read_bytes() == b"newcomer"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_atomic_write_replaces_only_a_regular_file(tmp_path, kind):
    """A rename over a FIFO, a symbolic link or a device such as /dev/null would
    replace it with a regular file (a report written to /dev/null by root did):
    refused, the thing left as it was and no temp file left; a regular file is
    replaced."""
    from attest.atomic import atomic_write
    target = tmp_path / "out.json"
    {"fifo": lambda: os.mkfifo(target), "symlink": lambda: os.symlink(tmp_path / "elsewhere", target),
     "folder": lambda: target.mkdir()}[kind]()
    before = os.lstat(target)
    with pytest.raises(FileExistsError, match="refusing to replace it: it is " +
                       ("a symbolic link" if kind == "symlink" else "not a regular file")):
        atomic_write(str(target), b"{}")
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino) and os.listdir(tmp_path) == ["out.json"]
    plain = tmp_path / "plain.json"
    plain.write_bytes(b"old")
    atomic_write(str(plain), b"new")
    assert plain.read_bytes() == b"new"


def test_atomic_write_writes_in_the_folder_the_system_resolves(tmp_path, monkeypatch):
    """``link/../x.bxa`` names x.bxa beside the link's target (the system resolves the
    link before ``..``): the temp file is made there, not in a folder found by folding
    the path as text, so the rename stays on one file system and the folder fsynced
    is the one that holds the file."""
    import tempfile

    from attest.atomic import atomic_write
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "cwd").mkdir()
    os.symlink(tmp_path / "real" / "inner", tmp_path / "cwd" / "lnk")
    monkeypatch.chdir(tmp_path / "cwd")
    made, mkstemp = [], tempfile.mkstemp

    def spy(**k):
        fd, tmp = mkstemp(**k)
        made.append(tmp)
        return fd, tmp
    monkeypatch.setattr(tempfile, "mkstemp", spy)
    atomic_write(os.path.join("lnk", "..", "x.bxa"), b"data")
    assert len(made) == 1 and os.path.dirname(made[0]) == os.path.realpath(tmp_path / "real")
    assert (tmp_path / "real" / "x.bxa").read_bytes() == b"data" and os.listdir(tmp_path / "cwd") == ["lnk"]


def test_atomic_write_in_an_unreadable_folder_writes_nothing(tmp_path, monkeypatch):
    """A folder that may be written but not read (mode 0333) cannot be opened for the
    fsync that follows the rename: the call fails before the file appears, and an
    old file stays as it was (root ignores the mode, so the refusal is simulated)."""
    import attest.atomic as atomic
    (tmp_path / "a.bxa").write_bytes(b"old")
    real_open = os.open

    def unreadable(path, flags, *a, **k):
        if os.path.realpath(path) == os.path.realpath(tmp_path) and flags == os.O_RDONLY:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(atomic.os, "open", unreadable)
    for name in ("a.bxa", "new.bxa"):
        with pytest.raises(PermissionError):
            atomic.atomic_write(str(tmp_path / name), b"new")
    assert os.listdir(tmp_path) == ["a.bxa"] and (tmp_path / "a.bxa").read_bytes() == b"old"
