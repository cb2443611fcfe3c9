"""Write synthetic ``llama`` GGUF models with seeded random weights.

Used by tests and benchmarks (no model hub is needed): shapes of real models
(SmolLM2, Llama-3.2-1B, Llama-3.1-8B) or tiny ones, in any supported quant type.
Quantized tensors are random ggml blocks with bounded fp16 scales, written with
``gguf.GGUFWriter`` as raw bytes; float tensors are random normals.
"""

from __future__ import annotations

import numpy as np

from .gguf_model import BLOCK_BYTES

SHAPES = {
    # name: (n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab)
    "tiny": (64, 2, 4, 2, 96, 256),
    "smollm2": (576, 30, 9, 3, 1536, 49152),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama-70b": (8192, 80, 64, 8, 28672, 128256),
}


def _quant_rows(rng, qtype: str, rows: int, cols: int, scale: float) -> np.ndarray:
    bb, be = BLOCK_BYTES[qtype]
    nblk = cols // be
    raw = rng.integers(0, 256, size=(rows, nblk, bb), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, size=(rows, nblk, 1)).astype(np.float16).view(np.uint8)

    # fp16 scales chosen so the dequantized weights have a standard deviation near ``scale``.
    div = {"Q8_0": 74.0, "Q4_0": 4.6, "Q4_1": 4.6, "Q4_K": 32 * 4.6, "Q6_K": 64 * 18.0}[qtype]
    d_lo, d_hi = 0.5 * scale / div, 1.5 * scale / div
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K"):
        raw[..., 0:2] = f16(d_lo, d_hi)
    if qtype == "Q4_1":
        raw[..., 2:4] = f16(-8.0 * d_hi, -7.0 * d_lo)
    elif qtype == "Q4_K":
        raw[..., 2:4] = f16(7.0 * d_lo, 8.0 * d_hi)
    elif qtype == "Q6_K":
        raw[..., 208:210] = f16(d_lo, d_hi)
    return raw.reshape(rows, nblk * bb)


def write_model(path: str, shape: str | tuple = "tiny", qtype: str = "Q8_0", seed: int = 0,
                n_ctx: int = 4096, tied: bool = False, norm_type: str = "F32", n_layer: int | None = None,
                metadata: dict | None = None) -> str:
    """Write a synthetic llama GGUF to ``path`` and return ``path``.

    ``shape`` is a key of :data:`SHAPES` or a tuple in its layout; ``qtype``
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) is used for every matrix
    (K-quant matrices whose K is not a multiple of 256 are written as Q8_0);
    ``n_layer`` overrides the layer count (for truncated big shapes);
    ``metadata`` replaces metadata keys (int, float, str or bytes values, bytes
    being a string's raw bytes; a float is stored as FLOAT32, a ``numpy.float64``
    as FLOAT64; for tests of malformed files).
    """
    import gguf

    n_embd, layers, n_head, n_head_kv, n_ff, n_vocab = SHAPES[shape] if isinstance(shape, str) else shape
    layers = n_layer or layers
    hd = n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"synthetic-{shape if isinstance(shape, str) else 'custom'}-{qtype}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    for key, val in (metadata or {}).items():
        w.kv_data[0].pop(key, None)
        if isinstance(val, bytes):   # a string's raw bytes, e.g. not UTF-8
            w.add_key_value(key, val, gguf.GGUFValueType.STRING)
            continue
        add = (w.add_string if isinstance(val, str) else w.add_float64 if isinstance(val, np.float64)
               else w.add_float32 if isinstance(val, float) else w.add_uint32)
        add(key, val)

    def matrix(name, rows, cols, scale):
        # K-quants need K % 256 == 0; like llama.cpp's quantizer, fall back to Q8_0 otherwise.
        qt = "Q8_0" if qtype in ("Q4_K", "Q6_K") and cols % 256 else qtype
        if qt in BLOCK_BYTES:
            raw = _quant_rows(rng, qt, rows, cols, scale)
            w.add_tensor(name, raw, raw_shape=(rows, raw.shape[1]), raw_dtype=gguf.GGMLQuantizationType[qt])
        else:
            vals = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
            if qtype == "F16":
                w.add_tensor(name, vals.astype(np.float16))
            elif qtype == "BF16":
                bits = (vals.view(np.uint32) + 0x8000) >> 16   # round to nearest (ties up) for test data
                w.add_tensor(name, bits.astype(np.uint16).view(np.uint8).reshape(rows, cols * 2),
                             raw_shape=(rows, cols * 2), raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(name, vals)

    def norm(name, n):
        vals = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, vals.astype(np.float16) if norm_type == "F16" else vals)

    matrix("token_embd.weight", n_vocab, n_embd, 1.0)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", n_embd)
        matrix(p + "attn_q.weight", n_embd, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "attn_k.weight", n_head_kv * hd, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "attn_v.weight", n_head_kv * hd, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "attn_output.weight", n_embd, n_embd, 1.0 / np.sqrt(n_embd))
        norm(p + "ffn_norm.weight", n_embd)
        matrix(p + "ffn_gate.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "ffn_up.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
        matrix(p + "ffn_down.weight", n_embd, n_ff, 1.0 / np.sqrt(n_ff))
    norm("output_norm.weight", n_embd)
    if not tied:
        matrix("output.weight", n_vocab, n_embd, 1.0 / np.sqrt(n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_model(src: str, dst: str, metadata: dict | None = None, tensor=None) -> str:
    """Write the GGUF ``src`` again to ``dst`` and return ``dst``: every metadata key
    (``GGUF.*`` header fields aside) with its type, then ``metadata`` added as FLOAT32
    values, and every tensor as it is, or as ``tensor(name, data, ggml_type)`` returns
    it (``(data, ggml_type)``, or None for unchanged). For tests and studies that
    vary a real model (a metadata key, the matrices' type)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(dst, "llama")
    w.kv_data[0].pop("general.architecture", None)   # copied with the other keys below
    for key, f in r.fields.items():
        if not key.startswith("GGUF."):
            vt = f.types[0]
            w.add_key_value(key, f.contents(), vt, f.types[1] if vt == GGUFValueType.ARRAY else None)
    for key, v in (metadata or {}).items():
        w.add_key_value(key, v, GGUFValueType.FLOAT32)
    for t in r.tensors:
        data, qtype = np.array(t.data), t.tensor_type
        data, qtype = (tensor and tensor(t.name, data, qtype)) or (data, qtype)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
