"""Field-by-field shape of the attestation payload (docs/attestation.md, "Payload")."""

from __future__ import annotations

import datetime
import math
import re

from node.errors import AttestationError, RequestError
from node.tp import TP_DEGREES

from .digest import CONTRACT_VERSIONS

FORMAT_VERSION = 1

# The device map's fields per backend (node/provenance.py device_record, node/backend_cuda.py
# CudaBackend.device_record); a cuda node running GPU ranks adds the degree, "tensor_parallel".
DEVICE_FIELDS = {"cpu": ("cpu", "machine", "python"),
                 "cuda": ("gpu", "compute_capability", "driver", "cuda_driver", "cuda_runtime", "cupy")}

TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z")

HEX64 = "hex64"
B32 = "bin32"
MESSAGE = {"role": str, "content": str}  # a chat message (node/generate.py _validate_messages)
_SPEC = {
    "format_version": int,
    "contract_version": int,
    "engine": {"name": str, "version": str, "kernels_sha256": HEX64, "reference_sha256": HEX64},
    "backend": str,
    "device": dict,
    "model": {"sha256": HEX64, "architecture": str, "quant_types": [str], "name": str},
    "request": {"mode": str, "prompt": str, "messages": (list, type(None)), "prompt_tokens": [int],
                "max_tokens": int, "n_ctx": int, "temperature": float, "top_k": int, "top_p": float,
                "seed": int, "stop": [str]},
    "output": {"tokens": [int], "text": str, "finish_reason": str, "step_chain": [B32], "digest": B32},
    "timestamp": str,
    "signer": {"public_key": B32, "key_id": HEX64},
}


def _check(value, spec, path):
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise AttestationError(f"field {path or 'payload'} must be a map")
        if set(value) != set(spec):
            extra, missing = sorted(set(value) - set(spec)), sorted(set(spec) - set(value))
            raise AttestationError(f"field {path or 'payload'}: missing {missing} unexpected {extra}")
        for k, s in spec.items():
            _check(value[k], s, f"{path}.{k}" if path else k)
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise AttestationError(f"field {path} must be an array")
        for i, v in enumerate(value):
            _check(v, spec[0], f"{path}[{i}]")
    elif spec == HEX64:
        if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
            raise AttestationError(f"field {path} must be 64 lowercase hex digits")
    elif spec == B32:
        if not (isinstance(value, bytes) and len(value) == 32):
            raise AttestationError(f"field {path} must be 32 bytes")
    elif spec is float:
        if not isinstance(value, float):
            raise AttestationError(f"field {path} has the wrong type")
        if value == 0.0 and math.copysign(1.0, value) < 0:
            raise AttestationError(f"field {path} is -0.0, which is not canonical (0.0 is)")
    elif spec is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise AttestationError(f"field {path} must be an integer")
    elif not isinstance(value, spec):
        raise AttestationError(f"field {path} has the wrong type")


def _check_device(dev: dict, backend: str) -> None:
    want = DEVICE_FIELDS[backend]
    extra = sorted(set(dev) - set(want) - ({"tensor_parallel"} if backend == "cuda" else set()))
    missing = sorted(set(want) - set(dev))
    if extra or missing:
        raise AttestationError(f"field device does not describe a {backend} device: missing {missing} "
                               f"unexpected {extra}")
    for k in want:
        if not isinstance(dev[k], str):
            raise AttestationError(f"field device.{k} must be a string")
    tp = dev.get("tensor_parallel", 1)
    if type(tp) is not int or tp not in TP_DEGREES:
        raise AttestationError(f"field device.tensor_parallel must be one of {TP_DEGREES}")


def check_payload(p) -> None:
    """Raise :class:`AttestationError` unless ``p`` has exactly the documented
    fields, types and known versions (``request.messages`` an array of
    :data:`MESSAGE` maps in chat mode, nil in prompt mode); a float field
    holding -0.0 is refused (0.0 is its one canonical zero)."""
    _check(p, _SPEC, "")
    if p["format_version"] != FORMAT_VERSION:
        raise AttestationError(f"unknown payload format version {p['format_version']}")
    if p["contract_version"] not in CONTRACT_VERSIONS:
        raise AttestationError(f"unknown determinism-contract version {p['contract_version']}")
    r, o = p["request"], p["output"]
    if r["mode"] not in ("prompt", "chat"):
        raise AttestationError(f"unknown request mode {r['mode']!r}")
    if (r["messages"] is None) != (r["mode"] == "prompt"):
        raise AttestationError(f"field request.messages must be {'nil' if r['mode'] == 'prompt' else 'an array'} "
                               f"in {r['mode']} mode")
    for i, m in enumerate(r["messages"] or ()):
        _check(m, MESSAGE, f"request.messages[{i}]")
    if o["finish_reason"] not in ("stop", "length"):
        raise AttestationError(f"unknown finish reason {o['finish_reason']!r}")
    if not o["tokens"]:   # every request samples at least one token (max_tokens >= 1)
        raise AttestationError("output.tokens is empty: an output holds at least one token")
    if len(o["step_chain"]) != len(o["tokens"]):
        raise AttestationError("output.step_chain and output.tokens differ in length")
    if p["engine"]["name"] != "bitexact":
        raise AttestationError(f"unknown engine {p['engine']['name']!r}")
    if p["backend"] not in DEVICE_FIELDS:
        raise AttestationError(f"unknown backend {p['backend']!r}")
    _check_device(p["device"], p["backend"])
    from node.engine import check_contract   # the node's rule of which versions run on ranks
    try:
        check_contract(p["contract_version"], p["device"].get("tensor_parallel", 1))
    except RequestError as e:
        raise AttestationError(f"field device.tensor_parallel: {e}") from None
    try:  # RFC 3339, UTC, whole seconds: the form node/provenance.py writes (strptime alone takes 2024-1-1)
        if not TIMESTAMP.fullmatch(p["timestamp"]):
            raise ValueError
        datetime.datetime.strptime(p["timestamp"], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        raise AttestationError(f"field timestamp {p['timestamp']!r} is not an RFC 3339 UTC time "
                               f"(YYYY-MM-DDTHH:MM:SSZ)") from None
