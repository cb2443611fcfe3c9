"""The GGUF's own tokenizer through llama.cpp (llama-cpp-python, a ``vocab_only``
model), byte-identical to llama.cpp, and chat templates from the GGUF key
``tokenizer.chat_template`` (rendered by :mod:`node.template`)."""

from __future__ import annotations

import codecs
import collections
import ctypes
import os
import re
import sys
import threading

from .errors import ModelError, RequestError
from .gguf_model import Model
from .template import render_template

CONTROL_TYPES = (3, 4)  # tokenizer.ggml.token_type CONTROL and USER_DEFINED: what encode(special=True) parses
_BACKEND = threading.Lock()  # llama_backend_init, once per process
_backend_ready = False
_LOG = None  # the llama.cpp log callback (_load_log), referenced so it is never freed
_LOADING = threading.local()  # .errors: the error lines llama.cpp logs while this thread loads a vocabulary
GGML_LOG_LEVEL_ERROR = 4  # enum ggml_log_level in llama.cpp's ggml.h (llama-cpp-python 0.3.36)


def _load_log(llama_cpp):
    """A llama.cpp log callback, kept alive for the process, that keeps the error
    lines of a vocabulary load in progress in this thread (:func:`_load_vocab` names
    the reason llama.cpp gives) and drops every other line."""
    global _LOG

    def log(level, text, user_data):
        errors = getattr(_LOADING, "errors", None)
        if level == GGML_LOG_LEVEL_ERROR and errors is not None:
            errors.append(text.decode("utf-8", "replace").strip())

    _LOG = llama_cpp.llama_log_callback(log)
    return _LOG


def _load_vocab(llama_cpp, path: str):
    """The GGUF's vocabulary through llama.cpp (a ``vocab_only`` llama_model);
    raises :class:`ModelError`, also for a path that is not UTF-8 (llama.cpp takes UTF-8).

    llama-cpp-python's model wrapper is used rather than its ``Llama`` class,
    which would also compile every chat template in the file with its own
    jinja2 environment (whose constant folding a hostile template can make
    allocate gigabytes); templates are rendered by :mod:`node.template` only.
    """
    global _backend_ready
    from llama_cpp import _internals

    try:   # llama-cpp-python passes the path to llama.cpp as UTF-8
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ModelError(f"cannot load tokenizer from {path}: llama.cpp, which reads it, cannot open a path "
                         "that is not UTF-8 (rename the file or a folder above it)") from None
    saved = os.dup(2)
    try:  # llama.cpp prints loader chatter on fd 2
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        with _BACKEND:
            if not _backend_ready:
                llama_cpp.llama_backend_init()
                # llama.cpp's log lines (warnings at tokenize time too) stay off the node's stderr
                llama_cpp.llama_log_set(_load_log(llama_cpp), ctypes.c_void_p(0))
                _backend_ready = True
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        _LOADING.errors = []
        return _internals.LlamaModel(path_model=path, params=params, verbose=False)
    except Exception as e:
        # llama.cpp's first error line holds the reason ("llama_model_load: error loading model: ...")
        why = next(iter(getattr(_LOADING, "errors", None) or []), "").split("error loading model: ")[-1]
        raise ModelError(f"cannot load tokenizer from {path}: "
                         + (f"llama.cpp says: {why}" if why else str(e))) from None
    finally:
        _LOADING.errors = None
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _pieces(llama_cpp, vocab, n: int, special: bool) -> list[bytes]:
    """The text bytes of tokens 0 .. n-1 through llama.cpp's ``llama_token_to_piece``
    (``special``: control tokens as their text, else as nothing). A piece longer than
    the buffer makes it return minus the size it needs, and the call is repeated with
    that size: llama-cpp-python's ``LlamaModel.detokenize`` passes a 32-byte buffer and
    returns nothing for longer pieces (SmolLM2 has 47, such as 64 spaces or dashes)."""
    size, out = 64, []
    buf = ctypes.create_string_buffer(size)
    for i in range(n):
        k = llama_cpp.llama_token_to_piece(vocab, llama_cpp.llama_token(i), buf, size, 0, special)
        if k < 0:
            size = -k
            buf = ctypes.create_string_buffer(size)
            k = llama_cpp.llama_token_to_piece(vocab, llama_cpp.llama_token(i), buf, size, 0, special)
        if k < 0:
            raise ModelError(f"llama.cpp cannot render token {i} of the vocabulary")
        out.append(buf.raw[:k])
    return out


BYTE_TYPE = 6  # tokenizer.ggml.token_type BYTE: SentencePiece's <0xNN> byte tokens


def _check_vocab(model: Model) -> None:
    """Refuse (:class:`ModelError`) tokenizer metadata that llama.cpp, which reads
    the vocabulary, would abort the whole process on (an assertion or an uncaught
    C++ exception, seen with llama-cpp-python 0.3.36), before it reads the file:
    a tokenizer type other than byte-level BPE (``gpt2``) or SentencePiece
    (``llama``); token texts that are not distinct strings without NUL; token
    types that are not a list of integers or do not match the tokens, or byte
    tokens outside SentencePiece; a SentencePiece vocabulary without all 256
    byte tokens ``<0x00>`` .. ``<0xFF>``
    (its fallback for text outside the vocabulary); a BOS or EOS token to be
    added without an id; a BOS or EOS id that names no token (llama.cpp would
    warn and fall back to a default token, so generation could not stop on the
    EOS the file names). Keys: GGUF spec, "Tokenizer"."""
    md, path = model.metadata, model.path
    kind = md.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelError(f"{path}: tokenizer type {kind!r} is not supported (supported: 'gpt2', byte-level BPE; "
                         "'llama', SentencePiece)")
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelError(f"{path}: tokenizer.ggml.tokens is not a list of strings")
    twice = [t for t, k in collections.Counter(tokens).items() if k > 1]
    if twice:
        raise ModelError(f"{path}: the token text {twice[0]!r} appears more than once in tokenizer.ggml.tokens")
    if any("\0" in t for t in tokens):
        raise ModelError(f"{path}: a token text in tokenizer.ggml.tokens holds a NUL character")
    types = md.get("tokenizer.ggml.token_type") or []
    if not (isinstance(types, list) and all(isinstance(t, int) for t in types)):
        raise ModelError(f"{path}: tokenizer.ggml.token_type is not a list of integers")
    if types and len(types) != len(tokens):
        raise ModelError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if kind == "gpt2" and BYTE_TYPE in types:
        raise ModelError(f"{path}: a byte-level BPE vocabulary has a token of type BYTE (SentencePiece only)")
    if kind == "llama":
        missing = sorted({f"<0x{b:02X}>" for b in range(256)} - set(tokens))
        if missing:
            raise ModelError(f"{path}: the SentencePiece vocabulary has no byte token for {len(missing)} of the "
                             f"256 bytes (such as {missing[0]}); llama.cpp needs all of them")
    for end in ("bos", "eos"):
        i = md.get(f"tokenizer.ggml.{end}_token_id")
        if md.get(f"tokenizer.ggml.add_{end}_token") and i is None:
            raise ModelError(f"{path}: tokenizer.ggml.add_{end}_token is set but tokenizer.ggml.{end}_token_id "
                             "is missing")
        if i is not None and not (type(i) is int and 0 <= i < len(tokens)):
            raise ModelError(f"{path}: tokenizer.ggml.{end}_token_id {i!r} names no token "
                             f"(the vocabulary has {len(tokens)})")


class Tokenizer:
    """Tokenize and detokenize with the vocabulary stored in ``model``'s GGUF file.

    Raises :class:`ModelError` when the vocabulary cannot be loaded, is one
    llama.cpp would abort the process on (:func:`_check_vocab`), or its size
    differs from the model's (rows of ``token_embd``), as llama.cpp requires.
    Every token's text is read from llama.cpp once, here; decoding joins those
    pieces, so it never waits for a long prompt being tokenized.
    """

    def __init__(self, model: Model):
        try:
            import llama_cpp
        except ImportError as e:
            raise ModelError(f"the tokenizer needs llama-cpp-python: {e}") from None
        self.model = model
        _check_vocab(model)
        self._enc, self._enc_lock = _load_vocab(llama_cpp, model.path), threading.Lock()
        n = int(self._enc.n_vocab())
        if n != model.hparams.n_vocab:
            raise ModelError(f"the tokenizer has {n} tokens but the model {model.hparams.n_vocab} "
                             f"(rows of token_embd.weight); they must match")
        self.eos_id = int(self._enc.token_eos())
        self.bos_id = int(self._enc.token_bos())
        pieces = _pieces(llama_cpp, self._enc.vocab, n, special=True)   # control tokens as their own text
        # a chat template's bos_token and eos_token: those tokens' own texts (e.g. "<s>"), which
        # encode(special=True) parses back; empty for a vocabulary without one
        self._bos_text, self._eos_text = (pieces[i].decode("utf-8", "replace") if 0 <= i < n else ""
                                          for i in (self.bos_id, self.eos_id))
        self._text = _pieces(llama_cpp, self._enc.vocab, n, special=False)   # what decode joins
        self.max_piece_bytes = max(1, max(map(len, pieces)))  # no token stands for more bytes of text
        types = model.metadata.get("tokenizer.ggml.token_type") or []
        control = sorted({pieces[i].decode("utf-8", "replace") for i, ty in enumerate(types)
                          if ty in CONTROL_TYPES and pieces[i]}, key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, control))) if control else None
        # Characters llama.cpp drops without a token (SmolLM2: six C0 controls such as U+001D); probed over
        # U+0000..U+00FF, which holds every control character, and left out of min_tokens' byte count.
        bos = len(self.encode(""))
        self._silent = {cp: None for cp in range(256) if len(self.encode(chr(cp))) == bos}

    def control_tokens(self, text: str) -> list[str]:
        """The control-token texts in ``text`` (e.g. ``<|im_end|>``), as ``encode(special=True)`` would parse them."""
        return self._control.findall(text) if self._control else []

    def min_tokens(self, text: str, special: bool = False) -> int:
        """A lower bound of ``len(encode(text, special))`` found without tokenizing:
        no token stands for more than :attr:`max_piece_bytes` bytes, and characters
        the vocabulary drops count for none; with ``special``, each control-token
        text is one token and the text between them is tokenized piece by piece
        (llama.cpp splits there first)."""
        pieces = self._control.split(text) if special and self._control else [text]
        return len(pieces) - 1 + sum(-(-len(p.translate(self._silent).encode("utf-8")) // self.max_piece_bytes)
                                     for p in pieces)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for ``text`` (UTF-8), with BOS when the GGUF asks for it.

        ``special=True`` parses control tokens such as ``<|im_start|>`` (used for
        rendered chat templates); plain prompts keep them as text.
        """
        with self._enc_lock:
            return list(self._enc.tokenize(text.encode("utf-8"), add_bos=True, special=special))

    def piece(self, i: int) -> bytes:
        """Text bytes of token ``i`` as :meth:`decode_bytes` joins them (a control
        token gives none). Raises ``IndexError`` for an id outside the vocabulary."""
        if i < 0:
            raise IndexError(f"token id {i} is negative")
        return self._text[i]

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of the concatenated token pieces (control tokens give none); as
        llama-cpp-python's ``detokenize``, a space that follows a leading BOS is dropped
        (SentencePiece's prefix space). Raises ``IndexError`` for an id outside the vocabulary."""
        out = b"".join(map(self.piece, ids))
        return out[1:] if ids and ids[0] == self.bos_id and out[:1] == b" " else out

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict]) -> str:
        """Render ``messages`` (``[{"role": str, "content": str}, ...]``) with the
        model's chat template and ``add_generation_prompt=True``; ``bos_token`` and
        ``eos_token`` are those tokens' own texts (empty for a vocabulary without one).

        Raises :class:`RequestError` when the model has no template or the
        template fails on these messages.
        """
        tpl = self.model.metadata.get("tokenizer.chat_template")
        if not tpl:
            raise RequestError("this model has no tokenizer.chat_template; use --prompt")
        return render_template(tpl, messages=messages, add_generation_prompt=True,
                               bos_token=self._bos_text, eos_token=self._eos_text)


class TextStream:
    """The text of a growing token list, equal after every :meth:`push` to
    ``tok.decode(ids)`` of all ids pushed so far, without decoding again the
    bytes of earlier tokens (a push still copies the text once).

    Bytes go through Python's incremental UTF-8 decoder (``codecs``, errors
    ``"replace"``): :attr:`committed` is the text no later token can change;
    the bytes the decoder holds back (the start of a character not yet
    complete, or of one that cannot complete) are shown in :attr:`text` as
    U+FFFD characters, as decoding the whole list would show them.
    """

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._bos_space = None  # True while a leading BOS may still drop the first byte
        self.committed = ""

    def push(self, i: int) -> None:
        """Append token ``i``; raises ``IndexError`` for an id outside the vocabulary."""
        b = self._tok.piece(i)
        if self._bos_space is None:
            self._bos_space = i == self._tok.bos_id
        if self._bos_space and b:
            self._bos_space = False
            b = b[1:] if b[:1] == b" " else b
        self.committed += self._utf8.decode(b)

    @property
    def held(self) -> str:
        """The U+FFFD characters that stand for the held-back bytes ("" when none)."""
        return self._utf8.getstate()[0].decode("utf-8", errors="replace")

    @property
    def text(self) -> str:
        """``tok.decode`` of every id pushed so far."""
        return self.committed + self.held
