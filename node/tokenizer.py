"""The GGUF's own tokenizer through llama.cpp (llama-cpp-python, ``vocab_only``),
byte-identical to llama.cpp, and chat templates rendered with jinja2 from the
GGUF key ``tokenizer.chat_template``."""

from __future__ import annotations

import os
import re
import sys
import threading

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import ModelError, RequestError
from .gguf_model import Model

TEMPLATE_STEPS = 1_000_000  # Python line events one chat-template rendering may take (about a second)
TEMPLATE_ITEMS = 1_000_000  # the longest string or list one template expression may build with * or **
CONTROL_TYPES = (3, 4)  # tokenizer.ggml.token_type CONTROL and USER_DEFINED: what encode(special=True) parses


def _load_vocab(llama_cpp, path: str):
    """The GGUF's vocabulary through llama.cpp (``vocab_only``); raises :class:`ModelError`."""
    saved = os.dup(2)
    try:  # llama.cpp prints loader chatter on fd 2 even with verbose=False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        return llama_cpp.Llama(path, vocab_only=True, verbose=False)
    except Exception as e:
        raise ModelError(f"cannot load tokenizer from {path}: {e}") from None
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class Tokenizer:
    """Tokenize and detokenize with the vocabulary stored in ``model``'s GGUF file.

    Raises :class:`ModelError` when the vocabulary cannot be loaded or its size
    differs from the model's (rows of ``token_embd``), as llama.cpp requires.
    Encoding and decoding use two instances of the vocabulary, each behind its
    own lock, so tokenizing a long prompt never holds up the decode steps.
    """

    def __init__(self, model: Model):
        try:
            import llama_cpp
        except ImportError as e:
            raise ModelError(f"the tokenizer needs llama-cpp-python: {e}") from None
        self.model = model
        self._enc, self._enc_lock = _load_vocab(llama_cpp, model.path), threading.Lock()
        self._dec, self._dec_lock = _load_vocab(llama_cpp, model.path), threading.Lock()
        n = int(self._dec.n_vocab())
        if n != model.hparams.n_vocab:
            raise ModelError(f"the tokenizer has {n} tokens but the model {model.hparams.n_vocab} "
                             f"(rows of token_embd.weight); they must match")
        self.eos_id = int(self._dec.token_eos())
        self.bos_id = int(self._dec.token_bos())
        pieces = [bytes(self._dec.detokenize([i], special=True)) for i in range(n)]
        self.max_piece_bytes = max(1, max(map(len, pieces)))  # no token stands for more bytes of text
        types = model.metadata.get("tokenizer.ggml.token_type") or []
        control = sorted({pieces[i].decode("utf-8", "replace") for i, ty in enumerate(types)
                          if ty in CONTROL_TYPES and pieces[i]}, key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, control))) if control else None

    def control_tokens(self, text: str) -> list[str]:
        """The control-token texts in ``text`` (e.g. ``<|im_end|>``), as ``encode(special=True)`` would parse them."""
        return self._control.findall(text) if self._control else []

    def min_tokens(self, text: str, special: bool = False) -> int:
        """A lower bound of ``len(encode(text, special))`` found without tokenizing:
        no token stands for more than :attr:`max_piece_bytes` bytes; with
        ``special``, each control-token text is one token and the text between
        them is tokenized piece by piece (llama.cpp splits there first)."""
        pieces = self._control.split(text) if special and self._control else [text]
        return len(pieces) - 1 + sum(-(-len(p.encode("utf-8")) // self.max_piece_bytes) for p in pieces)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for ``text`` (UTF-8), with BOS when the GGUF asks for it.

        ``special=True`` parses control tokens such as ``<|im_start|>`` (used for
        rendered chat templates); plain prompts keep them as text.
        """
        with self._enc_lock:
            return list(self._enc.tokenize(text.encode("utf-8"), add_bos=True, special=special))

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of the concatenated token pieces."""
        with self._dec_lock:
            return bytes(self._dec.detokenize(list(ids)))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict]) -> str:
        """Render ``messages`` (``[{"role": str, "content": str}, ...]``) with the
        model's chat template and ``add_generation_prompt=True``.

        Raises :class:`RequestError` when the model has no template or the
        template fails on these messages.
        """
        tpl = self.model.metadata.get("tokenizer.chat_template")
        if not tpl:
            raise RequestError("this model has no tokenizer.chat_template; use --prompt")
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        piece = self.decode_bytes
        try:
            return _render_bounded(env.from_string(tpl), messages=messages, add_generation_prompt=True,
                                   bos_token=piece([self.bos_id]).decode("utf-8", "replace"),
                                   eos_token=piece([self.eos_id]).decode("utf-8", "replace"))
        except Exception as e:  # noqa: BLE001 - the template is the model file's code: any failure is bad input
            raise RequestError(f"chat template failed: {type(e).__name__}: {e}") from None


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose ``*`` and ``**`` refuse results past
    :data:`TEMPLATE_ITEMS` items or digits before computing them."""
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        seq, num = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
        if operator == "*" and isinstance(seq, (str, list, tuple)) and isinstance(num, int) \
                and len(seq) * num > TEMPLATE_ITEMS:
            raise SecurityError(f"the template builds a sequence of more than {TEMPLATE_ITEMS} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * abs(left).bit_length() > 4 * TEMPLATE_ITEMS:
            raise SecurityError(f"the template computes a number of more than {TEMPLATE_ITEMS} digits")
        return super().call_binop(context, operator, left, right)


def _render_bounded(template, **context) -> str:
    """``template.render(**context)`` stopped after :data:`TEMPLATE_STEPS` Python line
    events (jinja2 compiles a template to Python, so every loop iteration of it is
    counted); raises ``jinja2.TemplateError`` then."""
    left = [TEMPLATE_STEPS]

    def trace(frame, event, arg):
        left[0] -= 1
        if left[0] < 0:
            raise jinja2.TemplateError(f"the template takes more than {TEMPLATE_STEPS} steps")
        return trace

    saved = sys.gettrace()
    sys.settrace(trace)
    try:
        return template.render(**context)
    finally:
        sys.settrace(saved)
