"""Signed attestation envelope (docs/attestation.md, "Envelope").

A ``.bxa`` file is the canonical msgpack array
``["bitexact-attestation", 1, payload: bin, public_key: bin[32], signature: bin[64]]``.
The signature is Ed25519 (RFC 8032) over DSSE's pre-authentication encoding
``PAE(PAYLOAD_TYPE, payload)``; it is checked over the exact stored payload
bytes before the payload is parsed.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from node.errors import AttestationError

from . import canonical, schema
from .keys import is_valid_public, key_id, public_raw

MAGIC = "bitexact-attestation"
FORMAT_VERSION = 1
ENVELOPE_HEAD = b"\x95"   # the first byte of every envelope: canonical msgpack's fixarray of 5
PAYLOAD_TYPE = "application/vnd.bitexact.attestation.v1+msgpack"
# The envelope is one array of 5 scalars; decoding stops past this many arrays and maps
# (the envelope and one in place of each element, which the check of that element names).
ENVELOPE_CONTAINERS = 6


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding:
    ``"DSSEv1" SP len(type) SP type SP len(body) SP body`` (lengths in ASCII decimal)."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def seal(payload: dict, key: Ed25519PrivateKey) -> bytes:
    """Encode ``payload`` canonically, sign it and return the envelope bytes.
    Raises :class:`AttestationError` when they would be larger than
    :data:`attest.canonical.MAX_BYTES`, or the payload would break another limit of
    :func:`attest.canonical.decode`, which no reader accepts."""
    schema.check_payload(payload)
    body = canonical.encode(payload)
    try:   # what a reader would refuse (more arrays and maps, or items, than it counts) is not signed
        canonical.decode(body, "the attestation payload")
    except AttestationError as e:
        raise AttestationError(f"{e}, which no reader accepts: shorten the request or its output") from None
    sig = key.sign(pae(PAYLOAD_TYPE, body))
    blob = canonical.encode([MAGIC, FORMAT_VERSION, body, public_raw(key), sig])
    if len(blob) > canonical.MAX_BYTES:
        raise AttestationError(f"the attestation would take {len(blob)} bytes, more than the "
                               f"{canonical.MAX_BYTES} a reader accepts: shorten the request or its output")
    return blob


def open_envelope(data: bytes, trusted_key: bytes | None = None) -> dict:
    """Check an envelope and return its payload dict.

    Order: envelope structure and version, trusted key, the key's validity
    (:func:`attest.keys.is_valid_public`), signature over the stored payload
    bytes, then payload decoding and schema, then that the payload names the
    envelope's signer. Raises :class:`AttestationError`.
    """
    if data[:1] not in (b"", ENVELOPE_HEAD):   # JSON, base64, gzip, another format: not read as msgpack
        as_json = data.lstrip()[:1] == b"{"
        raise AttestationError("not a bitexact attestation" + (" (this is JSON: verify and inspect read the "
                               "msgpack file, application/msgpack)" if as_json else ""))
    try:
        env = canonical.decode(data, "attestation file", max_containers=ENVELOPE_CONTAINERS)
    except canonical.LimitError:
        raise AttestationError("not a bitexact attestation") from None
    if not (isinstance(env, list) and len(env) == 5 and env[0] == MAGIC):
        raise AttestationError("not a bitexact attestation")
    _, version, body, pub, sig = env
    if type(version) is not int or version != FORMAT_VERSION:  # not True or 1.0
        raise AttestationError(f"unknown attestation format version {version!r} (this build reads {FORMAT_VERSION})")
    if not (isinstance(body, bytes) and isinstance(pub, bytes) and len(pub) == 32
            and isinstance(sig, bytes) and len(sig) == 64):
        raise AttestationError("malformed attestation envelope")
    if trusted_key is not None and pub != trusted_key:
        raise AttestationError(f"signed by key {key_id(pub)}, not by the trusted key {key_id(trusted_key)}")
    if not is_valid_public(pub):
        raise AttestationError(f"signed by a weak Ed25519 key {key_id(pub)} (small order, non-canonical, or "
                               f"outside the prime-order subgroup; a damaged or altered key field reads so "
                               f"too): its signatures prove nothing")
    try:
        Ed25519PublicKey.from_public_bytes(pub).verify(sig, pae(PAYLOAD_TYPE, body))
    except InvalidSignature:
        raise AttestationError("bad signature: the attestation was altered or not signed by its key") from None
    payload = canonical.decode(body, "attestation payload")
    schema.check_payload(payload)
    signer = payload["signer"]
    if signer["public_key"] != pub or signer["key_id"] != key_id(pub):
        raise AttestationError("payload names a different signer than the envelope")
    return payload
