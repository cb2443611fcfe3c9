"""Continuous batching: requests join and leave the running batch at any step.

One worker thread owns the engine. Each step holds one decode token of every
decoding request and, within a budget of tokens per step, prefill chunks of
new requests, shortest prompts first (the others wait a step), so a long
prompt can neither make every other request's step long nor hold a short one
back. Because the engine's bytes never depend on the batch or the chunking, a
request's output equals what it would get alone on an idle node.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from attest.digest import logits_digest
from .engine import Engine
from .errors import BitexactError, NumericFault
from .generate import PREFILL_CHUNK, Generation, Result
from .tokenizer import Tokenizer

log = logging.getLogger("bitexact.scheduler")
STEP_TOKENS = {"cpu": 32, "cuda": 2048}  # tokens per step by default: a CPU prefills about 13 tokens/s
STOP_SECONDS = 30.0  # how long stop() waits for the step under way
DIGEST_THREADS = min(8, os.cpu_count() or 1)  # a step's logits rows are hashed in parallel (hashlib frees the GIL)


class QueueFull(BitexactError):
    """The waiting queue is at its limit (HTTP 429)."""


class Draining(BitexactError):
    """The node is shutting down and takes no new requests (HTTP 503)."""


@dataclass(eq=False)   # jobs are compared by identity: two requests may hold equal records
class Job:
    """One submitted request. ``on_event(kind, value)`` is called from the worker
    thread with ``("token", (token_id, stable_text))``, then ``("done", Result)``
    or ``("error", BitexactError)``."""

    record: dict
    on_event: Callable[[str, object], None]
    cancelled: bool = False
    gen: Generation | None = field(default=None, repr=False)
    fed_at: int | None = None   # the plan that last gave it prompt tokens (first: the one it was seen in)


class Scheduler:
    """Runs jobs on ``engine`` with at most ``max_batch`` active sequences; at most
    ``max_queue`` jobs wait beyond the free batch slots (0: a job is taken only
    when a slot is free), past that :meth:`submit` raises :class:`QueueFull`.
    A step feeds every decoding request's token and, up to ``step_tokens``
    tokens in all (default :data:`STEP_TOKENS` of the engine's device), prompt
    tokens, at least one while a prompt is left."""

    def __init__(self, engine: Engine, tok: Tokenizer, max_batch: int = 16, max_queue: int = 64,
                 on_step: Callable[[int, int, int], None] | None = None, step_tokens: int | None = None):
        self.engine, self.tok = engine, tok
        self.max_batch, self.max_queue = max_batch, max_queue
        self.step_tokens = step_tokens or STEP_TOKENS[engine.device]
        self.on_step = on_step  # (batch size, tokens fed, tokens sampled)
        self._plans = 0         # steps planned (the worker thread's own count)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self._hashers = concurrent.futures.ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="bitexact-digest")
        self._thread = threading.Thread(target=self._loop, name="bitexact-scheduler", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a batch slot (a cancelled one leaves at once)."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Jobs in the running batch, not counting cancelled ones (their sequence
        is freed once the step under way ends). Lock-free (a copy of the batch), so
        /health never waits on the worker."""
        return _live(list(self._active))

    def submit(self, record: dict, on_event) -> Job:
        """Queue a request record (from :func:`node.generate.build_request`).
        Raises :class:`QueueFull` or :class:`Draining`."""
        job = Job(record, on_event)
        with self._cv:
            if self._draining or self._stop:
                raise Draining("the node is shutting down")
            # a cancelled job (its client went away) holds no place: it leaves at the next step
            if len(self._waiting) >= max(0, self.max_batch - _live(self._active)) + self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting)")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job (a client went away): a waiting one leaves the queue now, a
        running one's sequence is freed at the next step."""
        with self._cv:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
            self._cv.notify()

    def drain(self, timeout: float) -> bool:
        """Refuse new jobs and wait until queued and active ones end; True if they did."""
        end = time.monotonic() + timeout
        with self._cv:
            self._draining = True
            self._cv.notify_all()
            while (self._waiting or self._active) and time.monotonic() < end:
                self._cv.wait(0.05)
            return not (self._waiting or self._active)

    def stop(self) -> None:
        """Stop the worker; jobs still queued or active get a Draining error. A
        worker still inside an engine step after :data:`STOP_SECONDS` (a hung GPU
        or rank) is logged and left behind (a daemon thread), so shutdown ends."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(STOP_SECONDS)
        if self._thread.is_alive():
            log.error("the engine worker did not stop within %g s (a step is stuck); leaving it", STOP_SECONDS)
        self._hashers.shutdown(wait=False)

    # ---- worker ------------------------------------------------------------
    def _release(self, job: Job) -> None:
        """Free the job's sequence. An engine that cannot (a tensor-parallel engine
        broken by a dead rank) is logged, a bug with its traceback; the request
        still gets its answer and the worker lives on."""
        if job.gen is not None:
            try:
                job.gen.release()
            except Exception as e:   # noqa: BLE001 - the worker thread must survive
                (log.warning if isinstance(e, BitexactError) else log.exception)(
                    "could not free a finished request's sequence: %s", e)

    def _finish(self, job: Job, kind: str, value) -> None:
        self._release(job)
        if not job.cancelled:
            job.on_event(kind, value)

    def _loop(self) -> None:
        while True:
            with self._cv:
                for job in [j for j in self._active if j.cancelled]:
                    self._active.remove(job)
                    self._release(job)
                if self._stop:
                    for job in list(self._waiting) + self._active:
                        self._finish(job, "error", Draining("the node stopped before the request finished"))
                    self._waiting.clear()
                    self._active.clear()
                    self._cv.notify_all()
                    return
                while self._waiting and len(self._active) < self.max_batch:
                    self._active.append(self._waiting.popleft())
                if not self._active:
                    self._cv.notify_all()
                    self._cv.wait(0.5)
                    continue
                batch = list(self._active)
            self._step(batch)

    def _step(self, batch: list[Job]) -> None:
        """One engine step for ``batch``. A :class:`BitexactError` fails the
        requests it concerns; any other exception is a bug, logged with its
        traceback. A bug or a NaN fault in the forward pass, or a bug in the
        draw, is narrowed down by running the step's requests one by one (a
        request's bytes do not depend on its batch), so it fails only the
        requests that hit it; a bug elsewhere fails this step's requests. The
        node keeps serving."""
        try:
            self._step_jobs(batch)
        except Exception as e:   # noqa: BLE001 - the worker thread must survive
            log.exception("engine step failed")
            for job in batch:
                self._drop(job, _as_request_error(e))

    def _plan(self, ready: list[Job]) -> tuple[list[Job], list[list[int]]]:
        """This step's jobs and their chunks: every decoding job's token, and
        prompt chunks within the tokens left, shared max-min fairly: the
        prefilling jobs with the fewest prompt tokens left are served first,
        each up to an equal share of what remains (and PREFILL_CHUNK); at least
        one prompt token when none decode. When the tokens left are fewer than
        the prefilling jobs, the jobs fed longest ago get them first, so newer,
        shorter prompts cannot hold a long one back forever. The others wait
        for a later step."""
        self._plans += 1
        left = max(self.step_tokens - sum(1 for job in ready if not job.gen.prompt_left), 1)
        waiting = sorted((job for job in ready if job.gen.prompt_left), key=lambda job: job.gen.prompt_left)
        for job in waiting:
            job.fed_at = self._plans if job.fed_at is None else job.fed_at
        if left < len(waiting):   # not a token for each: round robin (a stable sort keeps fewest-left first)
            waiting.sort(key=lambda job: job.fed_at)
        give = {}
        for i, job in enumerate(waiting):
            n = min(job.gen.prompt_left, PREFILL_CHUNK, max(left // (len(waiting) - i), 1), left)
            if n:
                give[id(job)] = n
                left -= n
                job.fed_at = self._plans
        jobs = [job for job in ready if not job.gen.prompt_left or id(job) in give]
        return jobs, [job.gen.next_chunk(give.get(id(job), 1)) for job in jobs]

    def _step_jobs(self, batch: list[Job]) -> None:
        ready = []
        for job in batch:
            if job.gen is None:
                try:
                    job.gen = Generation(self.engine, self.tok, job.record)
                except BitexactError as e:
                    self._drop(job, e)
                    continue
            ready.append(job)
        if not ready:
            return
        ready, chunks = self._plan(ready)
        try:
            outs = self.engine.forward([(job.gen.seq, c) for job, c in zip(ready, chunks)])
        except NumericFault as e:   # a NaN in some request's logits (the step appended nothing)
            self._isolate(ready, chunks, e)
            return
        except BitexactError as e:   # e.g. KV cache full: fail this step's requests, keep serving
            for job in ready:
                self._drop(job, e)
            return
        except Exception as e:   # noqa: BLE001 - a bug: find the requests that hit it
            log.exception("an engine step of %d requests failed", len(ready))
            self._isolate(ready, chunks, _as_request_error(e))
            return
        self._draw_and_emit(ready, chunks, outs)

    def _isolate(self, ready: list[Job], chunks: list[list[int]], err: BitexactError) -> None:
        """A step of ``ready`` failed with ``err``: a lone job gets it; otherwise, since a
        request's bytes do not depend on its batch, each job's chunk runs as a step of its
        own (its draw reading its own logits), and only the jobs whose own step fails
        get an error (that step's)."""
        if len(ready) == 1:
            self._drop(ready[0], err)
            return
        log.warning("running the %d requests of the failed step one by one", len(ready))
        for job, c in zip(ready, chunks):
            try:
                out = self.engine.forward([(job.gen.seq, c)])
            except Exception as e:   # noqa: BLE001
                self._drop(job, _as_request_error(e))
                continue
            self._draw_and_emit([job], [c], out)

    def _draw_and_emit(self, ready: list[Job], chunks: list[list[int]], outs: list) -> None:
        """Draw the tokens of the last engine step (``outs``: its logits, a row per
        job; on the CUDA engine the rows are drawn from the step's device logits,
        so this follows that very step) and pass them to their requests."""
        due = [(i, job.gen.due(len(c))) for i, (job, c) in enumerate(zip(ready, chunks))]
        picks = [(i, ready[i].gen.params, pos) for i, pos in due if pos is not None]
        sums = self._hashers.map(logits_digest, [outs[i] for i, _, _ in picks])   # hashed while drawing
        try:
            toks = self.engine.sample(picks, outs)
        except Exception as batch_err:   # noqa: BLE001 - e.g. logits / temperature overflow: find the rows
            (log.warning if isinstance(batch_err, BitexactError) else log.exception)(
                "a step's draw failed (%s); drawing its %d rows one by one", batch_err, len(picks))
            toks = []
            for pick in picks:
                try:
                    toks.append(self.engine.sample([pick], outs)[0])
                except Exception as e:   # noqa: BLE001
                    self._drop(ready[pick[0]], _as_request_error(e))
                    toks.append(None)
        sampled = 0
        for (i, _, _), t, sha in zip(picks, toks, sums):
            if t is None:
                continue
            job = ready[i]
            job.gen.take(t, sha)
            sampled += 1
            if not job.cancelled:
                job.on_event("token", (t, job.gen.stable_text()))
            if job.gen.done:
                with self._cv:
                    self._active.remove(job)
                    self._cv.notify_all()
                self._finish(job, "done", job.gen.result())
        if self.on_step:
            self.on_step(len(ready), sum(len(c) for c in chunks), sampled)

    def _drop(self, job: Job, err: BitexactError) -> None:
        with self._cv:
            if job not in self._active:
                return            # already finished or dropped
            self._active.remove(job)
            self._cv.notify_all()
        self._finish(job, "error", err)


def _live(jobs) -> int:
    """How many of ``jobs`` are not cancelled."""
    return sum(not job.cancelled for job in jobs)


def _as_request_error(e: Exception) -> BitexactError:
    """``e`` itself when it is a :class:`BitexactError`, else (a bug) the error a request gets for it."""
    return e if isinstance(e, BitexactError) else BitexactError(
        f"internal error in the engine step: {type(e).__name__}: {e}")


__all__ = ["Scheduler", "Job", "QueueFull", "Draining", "Result"]
