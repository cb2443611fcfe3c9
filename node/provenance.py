"""What an attestation says about the code, the device and the model."""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import platform

from attest import digest, keys
from attest.schema import FORMAT_VERSION

from . import __version__
from .engine import Engine
from .generate import Result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files whose text is the executable determinism contract on the CPU (the tokenizer: the output text).
REFERENCE_SOURCES = ("node/reference.py", "node/fmath.py", "node/rope_table.py", "node/sampler.py",
                     "node/engine.py", "node/gguf_model.py", "node/generate.py", "node/tokenizer.py")


def sources_sha256(paths, extra: bytes = b"") -> str:
    """Hex SHA-256 over ``len(path) path len(body) body`` for each file, then ``extra``."""
    h = hashlib.sha256()
    for rel in paths:
        with open(os.path.join(ROOT, rel), "rb") as f:
            body = f.read()
        h.update(b"%d %s %d " % (len(rel), rel.encode(), len(body)) + body)
    h.update(extra)
    return h.hexdigest()


@functools.cache
def reference_sha256() -> str:
    """SHA-256 of the reference-engine sources (read once per process)."""
    return sources_sha256(REFERENCE_SOURCES)


def kernel_sources() -> list[str]:
    """The CUDA sources, then their launchers and the weight layouts they read (node/backend_cuda.py)."""
    folder = os.path.join(ROOT, "cuda")
    names = sorted(n for n in os.listdir(folder) if n.endswith((".cu", ".cuh"))) if os.path.isdir(folder) else []
    return [f"cuda/{n}" for n in names] + ["node/backend_cuda.py"]


@functools.cache
def kernels_sha256() -> str:
    """SHA-256 of the CUDA sources, their launchers and weight packing, plus the pinned compile options."""
    from .kernels import COMPILE_OPTIONS
    return sources_sha256(kernel_sources(), " ".join(COMPILE_OPTIONS).encode())


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_record(engine: Engine) -> dict:
    if engine.device == "cuda":
        return engine.device_record()
    return {"cpu": cpu_name(), "machine": platform.machine(), "python": platform.python_version()}


def model_record(m) -> dict:
    """The payload's ``model`` map for model ``m`` (docs/attestation.md): its SHA-256,
    architecture, quant types and name (``general.name``, else the file's name)."""
    return {"sha256": m.sha256, "architecture": m.arch, "quant_types": m.quant_types,
            "name": str(m.metadata.get("general.name") or os.path.basename(m.path))}


def build_payload(result: Result, engine: Engine, public_raw: bytes) -> dict:
    """The attestation payload for ``result`` (docs/attestation.md, "Payload")."""
    m = engine.model
    return {
        "format_version": FORMAT_VERSION,
        "contract_version": engine.contract,
        "engine": {"name": "bitexact", "version": __version__, "kernels_sha256": kernels_sha256(),
                   "reference_sha256": reference_sha256()},
        "backend": engine.device,
        "device": device_record(engine),
        "model": model_record(m),
        "request": result.request,
        "output": {"tokens": result.tokens, "text": result.text, "finish_reason": result.finish_reason,
                   "step_chain": result.step_chain, "digest": result.digest},
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "signer": {"public_key": public_raw, "key_id": keys.key_id(public_raw)},
    }
