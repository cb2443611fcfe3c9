"""Load test for `bitexact serve` on loopback.

First sends each distinct request alone (an idle node) to get its solo output
digest, then sends ``--requests`` requests from ``--concurrency`` bounded
clients (the official ``openai`` client) and reports throughput, p50/p99
latency and the number of digests that differ from the solo reference (which
must be 0). Starts its own daemon unless ``--url`` is given.

    python scripts/loadtest.py --requests 200 --concurrency 32 [--device cpu|cuda] [--url http://127.0.0.1:8420]

Exit status: 0 when no digest differs, 1 when one does, 2 for bad arguments or
a daemon that fails, refuses a request, cannot be reached or is not a bitexact node
(its answers carry no attestation) (one line on stderr),
128 + N when stopped by signal N (SIGINT, SIGTERM, SIGHUP). The daemon it
starts stops with it, even when it is killed (SIGKILL: the daemon gets SIGTERM
from the kernel, Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def quicksort(xs):",
           "Three facts about the Moon:", "1, 1, 2, 3, 5, 8,", "Translate 'good morning' into Spanish:",
           "The best way to learn a language is", "Q: What is 12 times 12?\nA:"]


def fail(message: str):
    print(f"loadtest: {message}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


def check_url(url: str) -> None:
    """Refuse (exit 2) an ``--url`` that is not http(s)://HOST[:PORT] (the client would
    raise a traceback for a bad IPv6 literal, or say only "Connection error")."""
    try:
        u = urllib.parse.urlsplit(url)
        u.port   # noqa: B018 - raises ValueError for a port that is not a number in [0, 65535]
    except ValueError as e:
        fail(f"--url {url!r} is not a URL: {e}")
    if u.scheme not in ("http", "https") or not u.hostname:
        fail(f"--url {url!r} must be http://HOST[:PORT] or https://HOST[:PORT]")


def check_report_path(path: str) -> None:
    """Refuse (exit 2) a ``--json`` path that cannot be written, before the load test runs,
    or that names something other than a regular file: the report replaces what is there
    (a rename), so a device such as /dev/null, a FIFO or a symbolic link would be replaced."""
    folder = os.path.dirname(path) or "."
    if not path or os.path.isdir(path) or not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        fail(f"--json {path!r}: not a file in a writable folder")
    from attest.atomic import not_replaceable
    try:
        why = not_replaceable(path)
    except OSError as e:
        fail(f"--json {path!r}: {e.strerror or e}")
    if why:
        fail(f"--json {path!r}: refusing to replace it: it is {why}")


def requests_pool(rng: random.Random, max_tokens: int) -> list[dict]:
    pool = []
    for i, p in enumerate(PROMPTS):
        n = rng.randint(1, max_tokens)
        pool.append({"kind": "prompt", "prompt": p, "max_tokens": n})
        pool.append({"kind": "chat", "prompt": p, "max_tokens": n, "temperature": 0.8, "seed": 1000 + i})
    return pool


class NotANode(Exception):
    """An answer without a bitexact attestation: the --url server is another kind."""


def call(client, model: str, r: dict) -> tuple[str, float]:
    t0 = time.perf_counter()
    kw = {"max_tokens": r["max_tokens"], "temperature": r.get("temperature", 0.0)}
    if "seed" in r:
        kw["seed"] = r["seed"]
    if r["kind"] == "prompt":
        out = client.completions.create(model=model, prompt=r["prompt"], **kw)
    else:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": r["prompt"]}], **kw)
    att = (out.model_extra or {}).get("attestation")
    if not (isinstance(att, dict) and isinstance(att.get("output_digest"), str)):
        raise NotANode("its answer carries no attestation")
    return att["output_digest"], time.perf_counter() - t0


def _stop_with_parent() -> None:
    """In the daemon's process before exec: SIGTERM when loadtest's process ends,
    however it ends (prctl(2) PR_SET_PDEATHSIG; Linux, else nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG = 1


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)   # main's finally stops the daemon, atexit removes its folder


def start_daemon(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, tmp, True)   # its key and store, after main has stopped the daemon
    key = os.path.join(tmp, "node.pem")
    subprocess.run([sys.executable, "-m", "node.cli", "keygen", "--out", key], check=True, capture_output=True)
    cmd = [sys.executable, "-m", "node.cli", "serve", "--key", key, "--data-dir", os.path.join(tmp, "data"),
           "--port", str(port), "--device", args.device, "--max-batch", str(args.max_batch),
           "--max-queue", str(args.requests)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_stop_with_parent)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 180
    try:
        while time.time() < end:
            if proc.poll() is not None:
                fail(f"the daemon exited: {proc.stderr.read().strip()}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                return proc, url
            except OSError:
                time.sleep(0.3)
        fail("the daemon did not start within 180 s")
    except BaseException:   # that, or a signal while it starts: stop it before its folder goes
        proc.kill()
        proc.wait(60)
        raise


def main() -> int:
    import openai

    from attest.atomic import atomic_write

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.error = lambda message: fail(f"{message} (see --help)")   # one line, exit 2
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model")
    ap.add_argument("--url", help="an already running daemon")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    if not (1 <= args.concurrency <= 1024 and 1 <= args.requests <= 100_000 and 1 <= args.max_tokens <= 4096
            and 1 <= args.max_batch <= 1024):
        fail("--concurrency must be in [1, 1024], --requests in [1, 100000], --max-tokens in [1, 4096] and "
             "--max-batch in [1, 1024]")
    if args.url is not None:
        check_url(args.url)
    if args.json is not None:
        check_report_path(args.json)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    proc, url = (None, args.url) if args.url is not None else start_daemon(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        rng = random.Random(args.seed)
        pool = requests_pool(rng, args.max_tokens)
        listed = client.models.list().data
        if not listed:
            raise NotANode("it lists no model")
        model = listed[0].id  # the one model the node serves
        solo = {i: call(client, model, r)[0] for i, r in enumerate(pool)}
        picks = [rng.randrange(len(pool)) for _ in range(args.requests)]
        t0 = time.perf_counter()
        ex = concurrent.futures.ThreadPoolExecutor(args.concurrency)
        try:
            results = list(ex.map(lambda i: call(client, model, pool[i]), picks))
        finally:   # on a signal: drop the queued requests; those in flight end with the daemon
            ex.shutdown(wait=False, cancel_futures=True)
        wall = time.perf_counter() - t0
        lat = sorted(r[1] for r in results)
        differ = sum(results[k][0] != solo[i] for k, i in enumerate(picks))
        report = {"requests": args.requests, "concurrency": args.concurrency, "distinct_requests": len(pool),
                  "wall_s": round(wall, 2), "requests_per_s": round(args.requests / wall, 2),
                  "p50_latency_s": round(lat[len(lat) // 2], 3),
                  "p99_latency_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
                  "digests_differing_from_solo": differ}
        print(json.dumps(report, indent=1))
        if args.json:
            try:
                atomic_write(args.json, json.dumps(report, indent=1).encode())
            except OSError as e:
                fail(f"cannot write {args.json}: {e.strerror or e}")
        return 0 if differ == 0 else 1
    except openai.APIError as e:     # the daemon refused a request or cannot be reached
        fail(f"{url}: {type(e).__name__}: {e}")
    except NotANode as e:            # not exit 1, which says that a digest differs
        fail(f"{url}: not a bitexact node: {e}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
