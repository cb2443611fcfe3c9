"""Verify an attestation by re-executing its request (docs/attestation.md, "Verification").

Order: signature over the stored bytes (and the trusted key), payload schema,
model digest, re-tokenization of the prompt, then re-execution, each step
compared with the attested digest chain as it is produced: the first
divergent step ends it, so a claim is never run past its own length + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from attest.canonical import MAX_BYTES
from attest.envelope import open_envelope
from attest.readfile import read_regular
from node.engine import Engine
from node.errors import AttestationError, BitexactError, LimitError, ModelError, NumericFault, RequestError
from node.generate import Request, build_request, params_of, steps
from node.gguf_model import default_model_path, load_model
from node.provenance import model_record
from node.tokenizer import Tokenizer


@dataclass
class Report:
    ok: bool
    payload: dict
    message: str
    first_divergent_step: int | None = None
    expected_token: int | None = None
    got_token: int | None = None


def read_attestation(path: str, trusted_key: bytes | None = None) -> dict:
    """Read and check ``path``; returns the payload. Raises :class:`AttestationError`
    (also for a path that is not a regular file)."""
    try:
        data = read_regular(path, MAX_BYTES + 1)
    except OSError as e:
        raise AttestationError(f"cannot read attestation {path}: {e.strerror}") from None
    try:
        return open_envelope(data, trusted_key)
    except AttestationError as e:
        raise AttestationError(f"{path}: {e}") from None


def verify_file(path: str, model_path: str | None = None, trusted_key: bytes | None = None,
                device: str = "cpu") -> Report:
    """Verify ``path``. Returns a :class:`Report` (``ok`` False means the output
    did not reproduce, also when a re-executed step faults: a NaN in the logits or
    ``logits / temperature`` past fp32, :class:`NumericFault`); raises
    AttestationError/ModelError when the file cannot be checked at all, and
    BitexactError when this machine cannot rebuild the request within the chat
    template's limits (node/template.py)."""
    payload = read_attestation(path, trusted_key)
    model = load_model(default_model_path() if model_path is None else model_path)
    want = payload["model"]["sha256"]
    if model.sha256 != want:
        raise ModelError(f"model digest differs: the attestation names {want}, {model.path} is {model.sha256}")
    described = model_record(model)
    fields = ["architecture", "quant_types"] + (["name"] if model.metadata.get("general.name") else [])
    wrong = [k for k in fields if payload["model"][k] != described[k]]   # a file's own name may differ here
    if wrong:
        return Report(False, payload, f"FAIL: the attested model description differs from the model file "
                                      f"(fields {wrong})")
    rec = payload["request"]
    tok = Tokenizer(model)
    try:  # step 7: a request this node would refuse cannot have been run by it
        if not 0 < rec["n_ctx"] <= model.hparams.n_ctx_train:
            raise RequestError(f"the context length {rec['n_ctx']} is outside 1..{model.hparams.n_ctx_train}, "
                               f"the model's context length")
        req = Request(prompt=rec["prompt"] if rec["mode"] == "prompt" else None, messages=rec["messages"],
                      max_tokens=rec["max_tokens"], params=params_of(rec), stop=list(rec["stop"]))
        rebuilt = build_request(req, tok, rec["n_ctx"])
        engine = (Engine(model, device=device, n_ctx=rec["n_ctx"], contract=payload["contract_version"])
                  if rebuilt == rec else None)
    except LimitError as e:   # this machine's limit, not the request's fault: nothing is concluded
        raise BitexactError(f"cannot rebuild the attested request on this machine: {e}") from None
    except RequestError as e:
        return Report(False, payload, f"FAIL: the attested request cannot be rebuilt: {e}")
    if rebuilt != rec:
        diff = sorted(k for k in rec if rebuilt.get(k) != rec[k])
        return Report(False, payload, f"FAIL: the request does not re-encode to the attested record (fields {diff})")
    out = payload["output"]
    want_chain, want_tokens = out["step_chain"], out["tokens"]
    run, i = steps(engine, tok, rec), -1
    try:   # each step as it is produced: at most one step past the claimed chain
        for g in run:
            i = len(g.chain) - 1
            if i < len(want_chain) and g.chain[i] == want_chain[i]:
                continue
            return _divergence(payload, i, want_tokens[i] if i < len(want_tokens) else None, g.tokens[i])
    except NumericFault as e:   # the node signs nothing for a request whose step faults (run exits 2)
        i += 1
        return Report(False, payload, f"FAIL: step {i} faulted on re-execution ({e}); the node signs no such "
                                      f"output", i, want_tokens[i] if i < len(want_tokens) else None, None)
    finally:
        run.close()
    res = g.result()
    if len(res.step_chain) < len(want_chain):   # the re-execution ended first
        i = len(res.step_chain)
        return _divergence(payload, i, want_tokens[i], None)
    differ = [name for name, got, want in (("digest", res.digest, out["digest"]), ("tokens", res.tokens, out["tokens"]),
                                           ("text", res.text, out["text"]),
                                           ("finish reason", res.finish_reason, out["finish_reason"])) if got != want]
    if differ:
        return Report(False, payload, f"FAIL: every step matched but the output differs in: {', '.join(differ)}")
    n = len(res.tokens)
    signer = payload["signer"]["key_id"]
    by = f"the trusted key {signer}" if trusted_key is not None else f"key {signer} (no --trusted-key given)"
    return Report(True, payload, f"OK: {n} token{'' if n == 1 else 's'} reproduced, output digest "
                                 f"{res.digest.hex()}, signed by {by}")


def _divergence(payload: dict, i: int, et: int | None, gt: int | None) -> Report:
    """The FAIL report for step ``i``, where the attested token was ``et`` and the re-executed one ``gt``
    (None: that side has no step ``i``)."""
    def name(t):
        return "the end of the output" if t is None else f"token {t}"
    what = (f"expected {name(et)}, got {name(gt)}" if et != gt else
            f"token {et} in both, but the step digest (logits, or the request it chains from) differs")
    return Report(False, payload, f"FAIL: first divergent step {i}: {what}", i, et, gt)
