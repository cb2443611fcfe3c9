"""Request, per-step chain and output digests (docs/attestation.md, "Digests").

All are SHA-256 (FIPS 180-4) over domain-separated byte strings::

    request_digest = SHA256(canonical(request))
    chain[-1]      = SHA256("bitexact/chain/v1\\0" || contract u32le || model_sha256 || request_digest)
    chain[i]       = SHA256(chain[i-1] || u32le(token_i) || SHA256(logits_i as little-endian fp32))
    output_digest  = SHA256("bitexact/output/v1\\0" || chain[n-1] || canonical([tokens, text, finish_reason]))
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from . import canonical

CONTRACT_VERSIONS = (1, 2)   # determinism-contract versions (docs/determinism.md; 2: section 14)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def request_digest(request: dict) -> bytes:
    return sha256(canonical.encode(request))


def chain_start(model_sha256: bytes, request: dict, contract: int) -> bytes:
    """The chain's first link for a request run under determinism-contract version ``contract``."""
    return sha256(b"bitexact/chain/v1\0" + struct.pack("<I", contract) + model_sha256 + request_digest(request))


def logits_digest(logits: np.ndarray) -> bytes:
    """SHA-256 of fp32 ``[n_vocab]`` logits as little-endian bytes (hashed in
    place; hashlib releases the GIL meanwhile, so rows may be hashed in threads)."""
    return hashlib.sha256(np.ascontiguousarray(logits, dtype="<f4")).digest()


def chain_step(prev: bytes, token: int, logits_sha: bytes) -> bytes:
    """The next chain link after ``prev`` for ``token``, drawn from logits whose
    :func:`logits_digest` is ``logits_sha``."""
    return sha256(prev + struct.pack("<I", token) + logits_sha)


def output_digest(last_link: bytes, tokens: list[int], text: str, finish_reason: str) -> bytes:
    return sha256(b"bitexact/output/v1\0" + last_link + canonical.encode([list(tokens), text, finish_reason]))
