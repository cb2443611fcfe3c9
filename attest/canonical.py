"""Canonical msgpack (docs/attestation.md, "Canonical encoding").

Rules: maps have str keys sorted by their UTF-8 bytes; integers use msgpack's
shortest form (positive fixint, uint8/16/32/64, negative fixint, int8/16/32/64,
as msgpack-python's packer chooses); floats are always float64; str is UTF-8
``str`` family, bytes are ``bin`` family; no ext types, no duplicate keys, no
trailing bytes. A byte string is canonical iff re-encoding its decoded value
gives the same bytes.
"""

from __future__ import annotations

import msgpack

from node.errors import AttestationError

MAX_BYTES = 16 << 20  # a 131 072-token generation's attestation takes under 8 MiB. The items of arrays
#                       still being decoded are counted only as each array ends, so this size bounds
#                       them: at worst about 20 bytes of memory per byte (3-byte strings)
MAX_DEPTH = 32  # arrays and maps nested at most this deep (attestations use fewer than 8 levels)
MAX_ARRAY = 1 << 20  # items of one array (a token list holds at most a context's worth)
MAX_MAP = 1 << 10  # keys of one map (attestation maps have fixed fields; fewer than 64)
MAX_CONTAINERS = 1 << 16  # arrays and maps in all (a payload has 13, plus one per chat message)
MAX_ITEMS = 1 << 22  # items of all arrays and maps together (a payload's token lists and step chain
#                      hold fewer than three contexts' worth)


class LimitError(AttestationError):
    """Input holding more arrays and maps, or more items in them, than :func:`decode` allows."""


class _Budget:
    """Counts the arrays and maps msgpack builds (it calls these hooks as each one
    ends) and stops the decoding once there are more than ``containers`` of them or
    more than :data:`MAX_ITEMS` items in them: a file of many empty arrays costs
    about 80 bytes of memory per byte, so these counts, not the file size, must
    bound the work."""

    def __init__(self, containers: int):
        self.containers, self.items = containers, MAX_ITEMS

    def _take(self, n: int) -> None:
        self.containers -= 1
        self.items -= n
        if self.containers < 0 or self.items < 0:
            raise LimitError("")

    def array(self, items: list) -> list:
        self._take(len(items))
        return items

    def map(self, pairs) -> dict:
        d = _no_dup_pairs(pairs)
        self._take(len(d))
        return d


def _sorted(obj):
    if isinstance(obj, (msgpack.ExtType, msgpack.Timestamp)):
        raise TypeError("canonical encoding has no ext types")
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("canonical maps need str keys")
        return {k: _sorted(obj[k]) for k in sorted(obj, key=lambda k: k.encode("utf-8"))}
    if isinstance(obj, (list, tuple)):
        return [_sorted(v) for v in obj]
    return obj


def encode(obj) -> bytes:
    """Canonical msgpack bytes of ``obj`` (dict/list/str/bytes/int/float/bool/None)."""
    return msgpack.packb(_sorted(obj), use_bin_type=True, use_single_float=False, strict_types=False)


def _no_dup_pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _depth(obj) -> int:
    """Nesting depth of arrays and maps in ``obj`` (a scalar is 0), without recursion;
    only containers are pushed, so a wide flat array costs no memory."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        if isinstance(o, list):
            deepest = max(deepest, d + 1)
            stack.extend((v, d + 1) for v in o if isinstance(v, (list, dict)))
    return deepest


def decode(data: bytes, what: str = "data", max_containers: int = MAX_CONTAINERS):
    """Decode canonical msgpack; raises :class:`AttestationError` on malformed,
    truncated, trailing or non-canonical input, nesting deeper than :data:`MAX_DEPTH`,
    or an array or map longer than :data:`MAX_ARRAY` / :data:`MAX_MAP` (refused at
    its header, before its items are read), and :class:`LimitError` once more than
    ``max_containers`` arrays and maps, or :data:`MAX_ITEMS` items in them, are
    decoded (decoding stops there)."""
    if len(data) > MAX_BYTES:
        raise AttestationError(f"{what} is larger than {MAX_BYTES} bytes")
    budget = _Budget(max_containers)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, list_hook=budget.array,
                              object_pairs_hook=budget.map, max_array_len=MAX_ARRAY, max_map_len=MAX_MAP)
    except LimitError:
        raise LimitError(f"{what} holds more than {max_containers} arrays and maps, "
                         f"or more than {MAX_ITEMS} items in them") from None
    except msgpack.StackError:  # msgpack's own nesting limit (1024), past ours
        raise AttestationError(f"{what} nests arrays or maps deeper than {MAX_DEPTH} levels") from None
    except msgpack.ExtraData:   # msgpack's own words ("received extra data") read as if bytes were appended
        raise AttestationError(f"{what} is not valid msgpack: bytes follow the end of its first value "
                               f"(appended, or a header byte altered)") from None
    except Exception as e:
        raise AttestationError(f"{what} is not valid msgpack: {e}") from None
    if _depth(obj) > MAX_DEPTH:
        raise AttestationError(f"{what} nests arrays or maps deeper than {MAX_DEPTH} levels")
    try:
        again = encode(obj)
    except Exception:
        again = None
    if again != data:
        raise AttestationError(f"{what} is not canonically encoded")
    return obj


def plain(v):
    """``v`` with every bytes value as lowercase hex, for JSON output."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v
