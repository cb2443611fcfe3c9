"""The GGUF's own tokenizer through llama.cpp (llama-cpp-python, ``vocab_only``),
byte-identical to llama.cpp, and chat templates rendered with jinja2 from the
GGUF key ``tokenizer.chat_template``."""

from __future__ import annotations

import os
import sys
import threading

from .errors import ModelError, RequestError
from .gguf_model import Model

TEMPLATE_RANGE_ITEMS = 1_000_000  # range() items one chat-template rendering may iterate over, in all


class Tokenizer:
    """Tokenize and detokenize with the vocabulary stored in ``model``'s GGUF file."""

    def __init__(self, model: Model):
        try:
            import llama_cpp
        except ImportError as e:
            raise ModelError(f"the tokenizer needs llama-cpp-python: {e}") from None
        self.model = model
        saved = os.dup(2)
        try:  # llama.cpp prints loader chatter on fd 2 even with verbose=False
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
            self._llama = llama_cpp.Llama(model.path, vocab_only=True, verbose=False)
        except Exception as e:
            raise ModelError(f"cannot load tokenizer from {model.path}: {e}") from None
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        self._lock = threading.Lock()  # llama.cpp vocab calls from the scheduler and HTTP threads
        self.eos_id = int(self._llama.token_eos())
        self.bos_id = int(self._llama.token_bos())

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for ``text`` (UTF-8), with BOS when the GGUF asks for it.

        ``special=True`` parses control tokens such as ``<|im_start|>`` (used for
        rendered chat templates); plain prompts keep them as text.
        """
        with self._lock:
            return list(self._llama.tokenize(text.encode("utf-8"), add_bos=True, special=special))

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of the concatenated token pieces."""
        with self._lock:
            return bytes(self._llama.detokenize(list(ids)))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict]) -> str:
        """Render ``messages`` (``[{"role": str, "content": str}, ...]``) with the
        model's chat template and ``add_generation_prompt=True``.

        Raises :class:`RequestError` when the model has no template or the
        template fails on these messages.
        """
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

        tpl = self.model.metadata.get("tokenizer.chat_template")
        if not tpl:
            raise RequestError("this model has no tokenizer.chat_template; use --prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        budget = [TEMPLATE_RANGE_ITEMS]

        def bounded_range(*args):
            """The sandbox's range (at most MAX_RANGE items per call), counted
            against one budget per rendering, so nested loops cannot run for ever."""
            r = safe_range(*args)
            budget[0] -= len(r)
            if budget[0] < 0:
                raise jinja2.TemplateError(f"the template ranges over more than {TEMPLATE_RANGE_ITEMS} items")
            return r

        env.globals["raise_exception"] = raise_exception
        env.globals["range"] = bounded_range
        piece = self.decode_bytes
        try:
            return env.from_string(tpl).render(
                messages=messages, add_generation_prompt=True,
                bos_token=piece([self.bos_id]).decode("utf-8", "replace"),
                eos_token=piece([self.eos_id]).decode("utf-8", "replace"))
        except Exception as e:  # noqa: BLE001 - the template is the model file's code: any failure is bad input
            raise RequestError(f"chat template failed: {type(e).__name__}: {e}") from None
