"""Chat templates (GGUF key ``tokenizer.chat_template``, jinja2) rendered in a
separate process.

A template is code that comes with the model file, so it runs where it can
harm nothing: a spawned worker process with at most :data:`TEMPLATE_MEMORY`
bytes of address space (``RLIMIT_AS``), inside jinja2's immutable sandbox, for
at most :data:`TEMPLATE_STEPS` Python line events and :data:`TEMPLATE_SECONDS`
seconds, returning at most :data:`TEMPLATE_OUTPUT` characters. Compiling
counts too (jinja2 folds constant expressions while it compiles); the worker
keeps the :data:`TEMPLATE_CACHE` templates it used last, compiled, so a node
compiles its model's template once. One worker serves the whole process, one
rendering at a time; it is replaced when it crashes or runs out of time.
"""

from __future__ import annotations

import functools
import multiprocessing
import resource
import signal
import sys
import threading

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import LimitError, RequestError, one_line

TEMPLATE_STEPS = 1_000_000  # Python line events one rendering may take (about a second)
TEMPLATE_ITEMS = 1_000_000  # the longest string or list one ``*`` may build, the most digits one ``**`` may
TEMPLATE_MEMORY = 1 << 30  # bytes of address space the worker process may hold
TEMPLATE_OUTPUT = 16 << 20  # characters of rendered text
TEMPLATE_SECONDS = 30.0  # wall time one rendering may take, the worker's start included
TEMPLATE_CACHE = 4  # compiled templates the worker keeps (by source text)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose ``*`` and ``**`` refuse results past
    :data:`TEMPLATE_ITEMS` items or digits before computing them (so a power
    cannot spend minutes within the memory limit)."""
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


def _raise_exception(msg):
    raise jinja2.TemplateError(msg)


def _render_bounded(source: str, context: dict) -> str:
    """Render ``source`` with ``context``, compiling it first unless it is one of
    the :data:`TEMPLATE_CACHE` sources used last (compiling takes about 5 ms under the step
    count, rendering a chat well under one), stopped after
    :data:`TEMPLATE_STEPS` Python line events in all (jinja2 compiles a template
    to Python, so every loop iteration of it is counted); raises
    ``jinja2.TemplateError`` then, when the text is longer than
    :data:`TEMPLATE_OUTPUT`, and when it is not valid Unicode (a lone surrogate)."""
    left = [TEMPLATE_STEPS]

    def trace(frame, event, arg):
        left[0] -= 1
        if left[0] < 0:
            raise jinja2.TemplateError(f"the template takes more than {TEMPLATE_STEPS} steps")
        return trace

    saved = sys.gettrace()
    sys.settrace(trace)
    try:
        text = _compile(source).render(**context)
    finally:
        sys.settrace(saved)
    if len(text) > TEMPLATE_OUTPUT:
        raise jinja2.TemplateError(f"the template renders more than {TEMPLATE_OUTPUT} characters")
    try:   # a string literal such as '\\ud800' makes a lone surrogate, which no prompt may hold
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise jinja2.TemplateError("the template renders text that is not valid Unicode (a lone surrogate)") from None
    return text


@functools.lru_cache(maxsize=TEMPLATE_CACHE)
def _compile(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox (a failed compile is not kept)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _worker(conn) -> None:
    """The worker process: limit its address space, then answer ``(source,
    context)`` with ``("ok", text)`` or ``("error", message)`` until the pipe
    closes. Ctrl-C reaches the whole process group; only the parent acts on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_AS, (TEMPLATE_MEMORY, resource.getrlimit(resource.RLIMIT_AS)[1]))
    while True:
        try:
            source, context = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", _render_bounded(source, context))
        except MemoryError:
            reply = ("error", f"MemoryError: the template needs more than {TEMPLATE_MEMORY >> 20} MiB")
        except Exception as e:  # noqa: BLE001 - the template is the model file's code: any failure is bad input
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


class _Renderer:
    def __init__(self):
        self._lock = threading.Lock()
        self._proc = self._conn = None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def render(self, source: str, context: dict) -> str:
        with self._lock:
            if self._proc is None:
                ctx = multiprocessing.get_context("spawn")
                self._conn, child = ctx.Pipe()
                self._proc = ctx.Process(target=_worker, args=(child,), daemon=True, name="bitexact-template")
                self._proc.start()
                child.close()
            try:
                self._conn.send((source, context))
                if not self._conn.poll(TEMPLATE_SECONDS):
                    self._stop()
                    raise LimitError(f"chat template failed: it took more than {TEMPLATE_SECONDS:g} s", "messages")
                kind, value = self._conn.recv()
            except (EOFError, OSError):
                self._stop()
                raise LimitError("chat template failed: the process rendering it died", "messages") from None
        if kind != "ok":
            raise RequestError(f"chat template failed: {one_line(value)}", "messages")   # text from the model file
        return value


_RENDERER = _Renderer()


def render_template(source: str, **context) -> str:
    """Render the chat template ``source`` with ``context`` (``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token``: str, bool, lists
    and dicts of them) in the worker process. Raises :class:`RequestError`
    when the template fails, and its :class:`LimitError` when it runs past this
    module's time limit or the worker dies (its memory limit)."""
    return _RENDERER.render(source, context)
