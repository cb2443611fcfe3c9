"""Ed25519 signing keys (RFC 8032) through ``cryptography``.

Private keys are PKCS#8 PEM, optionally encrypted with a passphrase
(``BestAvailableEncryption``); public keys are SubjectPublicKeyInfo PEM.
The key id is the hex SHA-256 of the 32-byte raw public key. A public key
must be a canonical encoding of a point of the prime-order subgroup
(libsodium's ``crypto_core_ed25519_is_valid_point``, through PyNaCl): a
small-order key such as the identity verifies one signature for every
message (Chalkias, Garillot and Nikolaenko, "Taming the many EdDSAs", 2020).
"""

from __future__ import annotations

import hashlib
import os
import stat

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import crypto_core_ed25519_is_valid_point

from node.errors import KeyError_

from .atomic import atomic_write, not_replaceable
from .readfile import read_regular


def key_id(public_raw: bytes) -> str:
    """Hex SHA-256 of a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(public_raw).hexdigest()


def is_valid_public(raw: bytes) -> bool:
    """True when ``raw`` (32 bytes) is a canonical Ed25519 point of the prime-order
    subgroup: not of small order, not a non-canonical encoding."""
    return len(raw) == 32 and crypto_core_ed25519_is_valid_point(raw)


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def pub_path_for(path: str) -> str:
    """``KEY.pem`` -> ``KEY.pub.pem``."""
    return (path[:-4] if path.endswith(".pem") else path) + ".pub.pem"


MAX_PASSPHRASE = 1023  # the longest passphrase the PKCS#8 encryption of `cryptography` accepts


def read_passphrase(path: str | None) -> bytes | None:
    """Passphrase bytes from a file (one trailing newline stripped, at most
    1023 bytes), or None. Raises :class:`KeyError_` when the file is unreadable,
    not a regular file, empty or too long."""
    if path is None:
        return None
    try:
        data = read_regular(path, MAX_PASSPHRASE + 2)
    except OSError as e:
        raise KeyError_(f"cannot read passphrase file {path}: {e.strerror}") from None
    data = data[:-1] if data.endswith(b"\n") else data
    if not data:
        raise KeyError_(f"passphrase file {path} is empty")
    if len(data) > MAX_PASSPHRASE:
        raise KeyError_(f"passphrase file {path} holds more than {MAX_PASSPHRASE} bytes")
    return data


def env_passphrase(name: str = "BITEXACT_KEY_PASSPHRASE") -> bytes | None:
    """Passphrase bytes from environment variable ``name``, as the OS holds them
    (any bytes, not only UTF-8; at most 1023), or None when unset. Raises
    :class:`KeyError_` when it is set but empty (as for an empty passphrase
    file: a key meant to be encrypted must not be written in the clear)."""
    value = os.environ.get(name)
    if value is None:
        return None
    if not value:
        raise KeyError_(f"{name} is set but empty (unset it for a key without a passphrase)")
    data = os.fsencode(value)
    if len(data) > MAX_PASSPHRASE:
        raise KeyError_(f"{name} holds more than {MAX_PASSPHRASE} bytes")
    return data


def generate(path: str, passphrase: bytes | None = None) -> str:
    """Create a new key at ``path`` (mode 0600) and its public key beside it.

    Returns the key id. Raises :class:`KeyError_` if either file exists or
    cannot be written; neither file is left half-written.
    """
    pub_path = pub_path_for(path)
    for p in (path, pub_path):
        if os.path.lexists(p):
            why = not_replaceable(p)   # a folder, device or link: not a file to refuse to overwrite
            raise KeyError_(f"refusing to write {p}: it is {why}" if why else f"refusing to overwrite existing file {p}")
    key = Ed25519PrivateKey.generate()
    enc = (serialization.BestAvailableEncryption(passphrase) if passphrase
           else serialization.NoEncryption())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    target = path   # the file being written when an error comes: the private key, then the public key
    try:
        atomic_write(path, pem, mode=0o600, overwrite=False)
        target = pub_path
        try:
            atomic_write(pub_path, pub, mode=0o644, overwrite=False)
        except BaseException:
            os.unlink(path)
            raise
    except FileExistsError:   # made since the check above (os.link's filename is the temp file)
        raise KeyError_(f"refusing to overwrite existing file {target}") from None
    except OSError as e:
        raise KeyError_(f"cannot write {'public ' if target == pub_path else ''}key {target}: {e.strerror}") from None
    return key_id(public_raw(key))


def load_private(path: str, passphrase: bytes | None = None, require_private_mode: bool = False) -> Ed25519PrivateKey:
    """Load an Ed25519 private key.

    Raises :class:`KeyError_` when the file is unreadable or not a regular file, not an Ed25519 PKCS#8
    key, encrypted and the passphrase is missing or wrong, or (with
    ``require_private_mode``) readable by group or others.
    """
    try:
        st = os.stat(path)
        data = read_regular(path, 1 << 16)
    except OSError as e:
        raise KeyError_(f"cannot read key {path}: {e.strerror}") from None
    if require_private_mode and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyError_(f"key {path} is readable by group or others (chmod 600 it)")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError:
        if passphrase is None:
            raise KeyError_(f"key {path} is encrypted: give its passphrase "
                            f"(--passphrase-file or BITEXACT_KEY_PASSPHRASE)") from None
        raise KeyError_(f"key {path} is not encrypted, but a passphrase was given") from None
    except ValueError:
        if passphrase is not None:
            raise KeyError_(f"cannot decrypt key {path}: wrong passphrase or not a PEM private key") from None
        raise KeyError_(f"{path} is not a PEM private key") from None
    except Exception as e:  # unsupported algorithm and similar
        raise KeyError_(f"cannot load key {path}: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyError_(f"key {path} is not an Ed25519 key")
    return key


def load_public(path: str) -> bytes:
    """Raw 32-byte public key from a PEM SubjectPublicKeyInfo file.

    Raises :class:`KeyError_` when unreadable or not a regular file, holding more than
    one PEM block (a bundle), not Ed25519, or a weak key (:func:`is_valid_public`).
    """
    try:
        data = read_regular(path, 1 << 16)
    except OSError as e:
        raise KeyError_(f"cannot read public key {path}: {e.strerror}") from None
    blocks = data.count(b"-----BEGIN ")
    if blocks > 1:   # the loader would take the first block alone
        raise KeyError_(f"{path} holds {blocks} PEM blocks: give one public key")
    try:
        pub = serialization.load_pem_public_key(data)
    except Exception:
        raise KeyError_(f"{path} is not a PEM public key") from None
    if not isinstance(pub, Ed25519PublicKey):
        raise KeyError_(f"public key {path} is not an Ed25519 key")
    raw = public_raw(pub)
    if not is_valid_public(raw):
        raise KeyError_(f"public key {path} is a weak Ed25519 key (small order, non-canonical, "
                        f"or outside the prime-order subgroup)")
    return raw
