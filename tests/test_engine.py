"""A sequence's logits are byte-identical however it is batched, chunked or cached."""

import hashlib
import itertools
import time

import jinja2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planted import Wrapped, misuse_cases
from node.engine import Engine
from node.errors import BitexactError
from node.gguf_model import load_model
from node.synth import write_model

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny-q4_1.gguf"
    return load_model(write_model(str(path), "tiny", "Q4_1", seed=3))


def solo_logits(model, tokens):
    eng = Engine(model)
    seq = eng.new_sequence()
    return eng.forward([(seq, tokens)], all_logits=True)[0]


def h(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def split_points(draw_sizes, n):
    out, a = [], 0
    for s in draw_sizes:
        if a >= n:
            break
        out.append((a, min(n, a + s)))
        a += s
    if a < n:
        out.append((a, n))
    return out


@SETTINGS
@given(data=st.data())
def test_batched_chunked_any_slot(tiny, data):
    """Target prefilled in random chunks, each step batched with 0-16 other
    sequences at random positions and slots: logits equal the solo run's bytes."""
    n = data.draw(st.integers(1, 40), label="target length")
    toks = data.draw(st.lists(st.integers(0, 255), min_size=n, max_size=n), label="tokens")
    want = solo_logits(tiny, toks)
    eng = Engine(tiny)
    others = []
    for _ in range(data.draw(st.integers(1, 16), label="n_others")):
        s = eng.new_sequence()
        pre = data.draw(st.integers(0, 30))
        if pre:
            eng.forward([(s, data.draw(st.lists(st.integers(0, 255), min_size=pre, max_size=pre)))])
        others.append(s)
    target = eng.new_sequence()
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=40), label="chunks")
    got = []
    for a, b in split_points(sizes, n):
        step = [(s, data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=5)))
                for s in others if data.draw(st.booleans())]
        slot = data.draw(st.integers(0, len(step)), label="slot")
        step.insert(slot, (target, toks[a:b]))
        out = eng.forward(step, all_logits=True)
        got.append(out[slot])
    assert np.concatenate(got).tobytes() == want.tobytes()


def test_token_by_token_equals_prefill_across_split_boundary(tiny):
    """Prefill at once vs one token per step, past the 256-position KV split."""
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 256, 300).tolist()
    want = solo_logits(tiny, toks)
    eng = Engine(tiny)
    s = eng.new_sequence()
    got = [eng.forward([(s, [t])], all_logits=True)[0] for t in toks]
    assert np.concatenate(got).tobytes() == want.tobytes()


@SETTINGS
@given(data=st.data())
def test_prefix_reuse(tiny, data):
    """A sequence forked from a cached prefix continues with the same bytes."""
    n = data.draw(st.integers(2, 50))
    toks = data.draw(st.lists(st.integers(0, 255), min_size=n, max_size=n))
    k = data.draw(st.integers(1, n - 1))
    want = solo_logits(tiny, toks)
    eng = Engine(tiny)
    donor = eng.new_sequence()
    extra = data.draw(st.lists(st.integers(0, 255), max_size=10))
    eng.forward([(donor, toks[:k] + extra)])
    seq = eng.fork(donor, k)
    eng.release(donor)
    got = eng.forward([(seq, toks[k:])], all_logits=True)[0]
    assert got.tobytes() == want[k:].tobytes()


def test_repeat_and_threads(tiny):
    """Repeated runs and a different BLAS thread count give the same bytes."""
    from threadpoolctl import threadpool_limits

    toks = list(range(1, 60, 3))
    a = solo_logits(tiny, toks)
    with threadpool_limits(limits=1):
        b = solo_logits(tiny, toks)
    c = solo_logits(tiny, toks)
    assert a.tobytes() == b.tobytes() == c.tobytes()


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_every_quant_type_batch_invariant(tmp_path, qtype):
    """Each supported weight type: batched/chunked equals solo, logits finite."""
    shape = (256, 2, 4, 2, 512, 300)
    model = load_model(write_model(str(tmp_path / f"{qtype}.gguf"), shape, qtype, seed=11, tied=qtype == "Q8_0"))
    toks = list(range(5, 45))
    want = solo_logits(model, toks)
    assert np.isfinite(want).all()
    eng = Engine(model)
    other, target = eng.new_sequence(), eng.new_sequence()
    got = []
    for a in range(0, 40, 7):
        out = eng.forward([(other, [a % 300, 1]), (target, toks[a:a + 7])], all_logits=True)
        got.append(out[1])
    assert np.concatenate(got).tobytes() == want.tobytes()


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_weights_beyond_the_cpu_cache_budget_give_the_same_bytes(tmp_path, monkeypatch, qtype):
    """A matrix the CPU engine's weight budget leaves out is decoded again at
    every use, in row chunks: the logits bytes are those of the cached engine,
    with no budget, a budget that holds some matrices, and chunks of a few rows."""
    import node.backend_cpu as bc
    shape = (256, 2, 4, 2, 512, 300)
    model = load_model(write_model(str(tmp_path / f"{qtype}.gguf"), shape, qtype, seed=5, tied=qtype == "Q8_0"))
    toks = list(range(7, 30))
    want = solo_logits(model, toks)
    monkeypatch.setattr(bc, "CHUNK_BYTES", 3 * 256 * 4 + 1)    # 3 rows of K = 256 per chunk: uneven last chunk
    some = sum(bc.decoded_bytes(model.tensors[n]) for n in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"))
    for budget in (0, some):
        be = bc.CpuBackend(model, weight_cache=budget)
        eng = Engine(model, backend=be)
        got = eng.forward([(eng.new_sequence(), toks)], all_logits=True)[0]
        assert got.tobytes() == want.tobytes()
        kept = sum(bc.decoded_bytes(model.tensors[n]) for n in be._weights if model.tensors[n].rows > 1)
        assert kept <= budget and be._cache_left == budget - kept
        assert (kept > 0) == (budget > 0)


@pytest.mark.parametrize("value, want", [("0", 0), ("12", 12 << 20), (" 7 ", 7 << 20), ("0" * 5000 + "3", 3 << 20),
                                         ("9" * 13, 1 << 62), ("9" * 5000, 1 << 62)])
def test_the_cpu_weight_budget_is_read_from_the_environment(monkeypatch, value, want):
    import node.backend_cpu as bc
    monkeypatch.setenv(bc.CACHE_ENV, value)
    assert bc.weight_cache_bytes() == want


@pytest.mark.parametrize("value", ["", "-1", "1.5", "lots", "1e3", "\u00b2", "\u0663", "\uff11\uff12", "+3", "1_0"])
def test_a_bad_cpu_weight_budget_is_one_error(tiny, monkeypatch, value):
    import node.backend_cpu as bc
    monkeypatch.setenv(bc.CACHE_ENV, value)
    with pytest.raises(BitexactError, match=bc.CACHE_ENV):
        Engine(tiny)


def test_engine_misuse_is_a_request_error_and_changes_nothing(tiny):
    """An unknown or released sequence id, a bad fork length, an empty or
    duplicated chunk and non-integer or out-of-range token ids are each a
    RequestError (not a KeyError or numpy's error); afterwards the live
    sequence still gives its solo logits."""
    from node.errors import RequestError
    eng = Engine(tiny)
    cases, live = misuse_cases(eng, tiny.hparams.n_vocab)
    for call, message in cases:
        with pytest.raises(RequestError, match=message):
            call()
    assert eng.length(live) == 0
    assert eng.forward([(live, [5, 6, 7])], all_logits=True)[0].tobytes() == solo_logits(tiny, [5, 6, 7]).tobytes()


def test_numpy_integers_are_accepted_alike(tiny):
    """A numpy integer serves as a token id (forward) and as a fork length alike."""
    eng = Engine(tiny)
    donor = eng.new_sequence()
    eng.forward([(donor, np.asarray([5, 6, 7]))])
    seq = eng.fork(donor, np.int64(2))
    assert eng.length(seq) == 2 and type(eng.length(seq)) is int
    got = eng.forward([(seq, [np.int32(7)])], all_logits=True)[0]
    assert got.tobytes() == solo_logits(tiny, [5, 6, 7])[2:].tobytes()


@pytest.mark.parametrize("n_ctx", [0, -5, 2.5, 1 << 21, "8", True])
def test_engine_rejects_a_bad_context_length(n_ctx):
    from node.errors import RequestError
    from node.gguf_model import default_model_path, load_model
    with pytest.raises(RequestError, match="context length"):
        Engine(load_model(default_model_path()), n_ctx=n_ctx)


@pytest.mark.parametrize("template", ["{{ raise_exception('system role not supported') }}",
                                      "{{ messages[0]['content'] / 0 }}", "{% for %}", "{{ x.y.z() }}",
                                      "{{ ''.__class__.__mro__ }}",
                                      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                      "{% endfor %}",
                                      '{% for a in "x"*100000 %}{% for b in "x"*100000 %}{% endfor %}{% endfor %}',
                                      '{{ "x"*100000000 }}', "{{ [1]*10**8 }}", "{{ 2**100000000 }}",
                                      "{{ (10**10)**(10**10) }}",
                                      "{{ 'x'|center(3000000000) }}",  # folded by jinja2 while it compiles
                                      "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}"
                                      "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
                                      "{{ ('x' * 1000000)|replace('x', 'x' * 1000000) }}",
                                      "{{ '{:>3000000000}'.format('x') }}",
                                      "{% for i in range(17) %}{{ 'x' * 1000000 }}{% endfor %}",
                                      "{{ raise_exception('line one\\nsecond \\x1b[31mRED') }}",
                                      "{{ '\\ud800' }}{{ messages[0]['content'] }}"])   # a lone surrogate
def test_a_failing_chat_template_is_one_request_error(template):
    """The chat template is code from the model file: any failure, including
    the sandbox refusing an attribute, running out of steps, of the worker's
    memory or of its output size, is a one-line RequestError, and the next
    rendering works."""
    from node.errors import RequestError
    from node.gguf_model import default_model_path, load_model
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    model.metadata["tokenizer.chat_template"] = template
    with pytest.raises(RequestError, match="^chat template failed") as e:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert str(e.value).isprintable() and e.value.param == "messages"   # one line, no terminal escapes
    model.metadata["tokenizer.chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}!"
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi!"


def test_a_dead_template_process_is_one_request_error_and_is_replaced():
    from node import template
    from node.errors import RequestError
    assert template.render_template("{{ 1 + 1 }}") == "2"
    template._RENDERER._proc.kill()
    template._RENDERER._proc.join()
    with pytest.raises(template.LimitError, match="^chat template failed: the process rendering it died$"):
        template.render_template("{{ 1 + 1 }}")
    assert template.render_template("{{ 2 + 2 }}") == "4"


def test_a_template_past_its_time_is_a_limit_error_and_still_a_request_error(monkeypatch):
    """A rendering past TEMPLATE_SECONDS is this machine's limit (LimitError, which a
    verifier does not count against the attestation), and a bad request to the daemon."""
    from node import template
    from node.errors import LimitError, RequestError
    monkeypatch.setattr(template, "TEMPLATE_SECONDS", 0)     # no worker answers in no time:
    template._RENDERER._stop()   # a new one must start first, and a warm one could answer a cached
    with pytest.raises(LimitError, match="took more than 0 s") as e:   # template before the parent looks
        template.render_template("{% for i in range(20000) %}{{ i }}{% endfor %}")
    assert isinstance(e.value, RequestError)
    monkeypatch.undo()
    assert template.render_template("{{ 3 + 3 }}") == "6"


def test_compiled_templates_are_kept_per_source_and_bounded():
    """The template worker compiles a source once and renders it with each call's own
    context; it keeps the TEMPLATE_CACHE sources used last, and a source whose compiling
    runs out of steps is not kept: it fails again, under the same step count, on every call."""
    from node import template
    template._compile.cache_clear()
    src = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"

    def compiles(source, context):   # render; how many compilations that took
        before = template._compile.cache_info().misses
        template._render_bounded(source, context)
        return template._compile.cache_info().misses - before
    assert [compiles(src, {"messages": [{"role": w, "content": "x"}]}) for w in "ab"] == [1, 0]
    assert template._render_bounded(src, {"messages": [{"role": "c", "content": "y"}]}) == "c:y;"
    for i in range(template.TEMPLATE_CACHE + 2):
        assert compiles(f"{{{{ {i} }}}}", {}) == 1 and compiles(src, {"messages": []}) == 0   # used each time: kept
    for i in range(template.TEMPLATE_CACHE):
        compiles(f"{{{{ {i} }}}}!", {})
    assert compiles(src, {"messages": []}) == 1                                           # evicted
    slow = "{{ " + " + ".join(["1"] * 200) + " }}"   # constant folding while compiling
    old = template.TEMPLATE_STEPS
    try:
        template.TEMPLATE_STEPS = 50
        misses = template._compile.cache_info().misses
        for _ in range(2):   # kept, the second call would render the folded constant within the steps
            with pytest.raises(jinja2.TemplateError, match="more than 50 steps"):
                template._render_bounded(slow, {})
        assert template._compile.cache_info().misses == misses + 2
    finally:
        template.TEMPLATE_STEPS = old


def test_a_sampling_fault_fails_only_its_request():
    """A draw that faults (logits / temperature overflowing fp32) fails its own
    request with that error; the request stepped beside it ends with its solo digest."""

    from node.errors import NumericFault
    from node.gguf_model import default_model_path
    from node.generate import Request, build_request, generate
    from node.sampler import SamplingParams
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)

    class FaultOnSeed666(Wrapped):
        """The engine, except that a draw for seed 666 overflows."""
        def sample(self, picks, logits):
            if any(p.seed == 666 for _, p, _ in picks):
                raise NumericFault("logits / temperature 1e-06 overflow fp32")
            return self.engine.sample(picks, logits)

    recs = [build_request(Request(prompt="Name a colour.", max_tokens=3, params=SamplingParams(0.8, 0, 1.0, s)),
                          tok, 256) for s in (666, 7)]
    want = generate(Engine(model, n_ctx=256), tok, recs[1]).digest
    ends = serve_all(Scheduler(FaultOnSeed666(Engine(model, n_ctx=256)), tok, max_batch=4), recs)
    assert ends[0][0] == "error" and isinstance(ends[0][1], NumericFault)
    assert ends[1][0] == "done" and ends[1][1].digest == want


def serve_all(sched, recs, wait=300):
    """Submit ``recs`` to ``sched`` and wait (up to ``wait`` s) until each has ended;
    stops ``sched``. Returns each request's end ``(kind, value)`` by index."""
    import threading
    ends, done = {}, threading.Event()

    def on_event(i, kind, value):
        if kind != "token":
            ends[i] = (kind, value)
            if len(ends) == len(recs):
                done.set()

    try:
        for i, r in enumerate(recs):
            sched.submit(r, lambda kind, value, i=i: on_event(i, kind, value))
        assert done.wait(wait), ends
    finally:
        sched.stop()
    return ends


def serve_then_one_more(sched, recs, again, wait):
    """Submit ``recs`` to ``sched``, wait (up to ``wait`` s) until each has ended,
    then submit ``again`` and wait for it; stops ``sched``. Returns each request's
    end ``(kind, value)`` by index, ``again``'s at ``len(recs)``."""
    import threading
    ends, done = {}, threading.Event()

    def on_event(i, kind, value):
        if kind != "token":
            ends[i] = (kind, value)
            if len(ends) == len(recs) + 1:
                done.set()

    try:
        for i, r in enumerate(recs):
            sched.submit(r, lambda kind, value, i=i: on_event(i, kind, value))
        end = time.monotonic() + wait
        while len(ends) < len(recs) and time.monotonic() < end:
            time.sleep(0.1)
        assert len(ends) == len(recs), ends                         # the failed step's requests got answers
        sched.submit(again, lambda kind, value: on_event(len(recs), kind, value))
        assert done.wait(wait), ends
    finally:
        sched.stop()
    return ends


def test_a_bug_in_a_step_fails_only_the_requests_that_hit_it(caplog):
    """A bug (not a BitexactError) in the forward pass or the draw fails only the
    requests that hit it when run alone; the requests stepped beside them end
    with their solo digests (each rerun request drawn from its own step's logits),
    and the node serves the next request."""
    from node.gguf_model import default_model_path
    from node.generate import Request, build_request, generate
    from node.sampler import SamplingParams
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    reqs = [Request(prompt="Zebras and yaks.", max_tokens=3), Request(prompt="Name a colour.", max_tokens=3,
            params=SamplingParams(0.8, 0, 1.0, 666)), Request(prompt="Count to three.", max_tokens=3,
            params=SamplingParams(1.0, 0, 1.0, 7)), Request(prompt="The capital of France is", max_tokens=3)]
    recs = [build_request(r, tok, 256) for r in reqs]
    marker = next(t for t in recs[0]["prompt_tokens"] if all(t not in r["prompt_tokens"] for r in recs[1:]))

    class Buggy(Wrapped):
        """The engine, except that a forward pass holding ``marker`` and a draw for seed
        666 raise. Like the CUDA engine it draws from the last forward pass's logits
        (row indices wrapping, as CuPy's do), not from the ones it is given."""
        last = None

        def forward(self, chunks, all_logits=False):
            if any(marker in c for _, c in chunks):
                raise RuntimeError("planted bug in the forward pass")
            self.last = self.engine.forward(chunks, all_logits)
            return self.last

        def sample(self, picks, logits):
            if any(p.seed == 666 for _, p, _ in picks):
                raise ZeroDivisionError("planted bug in the draw")
            return self.engine.sample(picks, [self.last[r % len(self.last)] for r in range(len(logits))])

    want = {i: generate(Engine(model, n_ctx=256), tok, recs[i]).digest for i in (2, 3)}
    ends = serve_then_one_more(Scheduler(Buggy(Engine(model, n_ctx=256)), tok, max_batch=4), recs, recs[2], 300)
    assert ends[0][0] == "error" and "RuntimeError: planted bug in the forward pass" in str(ends[0][1])
    assert ends[1][0] == "error" and "ZeroDivisionError: planted bug in the draw" in str(ends[1][1])
    for i in (2, 3):
        assert ends[i][0] == "done" and ends[i][1].digest == want[i], (i, ends[i])
    assert ends[len(recs)][0] == "done" and ends[len(recs)][1].digest == want[2]
    assert "of the failed step one by one" in caplog.text


def test_a_broken_engine_still_answers_the_requests_of_its_failed_step():
    """When a step fails because the engine broke (a tensor-parallel rank died),
    freeing the sequences fails too; every request of the step still gets its
    error, and the worker keeps answering later requests."""
    from node.errors import BitexactError
    from node.gguf_model import default_model_path
    from node.generate import Request, build_request
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)

    class Broken(Wrapped):
        """The engine, broken after its first step: every later call raises."""
        steps = 0

        def __getattr__(self, name):
            if self.steps:
                raise BitexactError("tensor-parallel rank 1 exited; the tensor-parallel engine must be restarted")
            return getattr(self.engine, name)

        def forward(self, chunks, all_logits=False):
            self.steps += 1
            if self.steps > 1:
                raise BitexactError("tensor-parallel rank 1 exited; the tensor-parallel engine must be restarted")
            return self.engine.forward(chunks, all_logits)

    recs = [build_request(Request(prompt=p, max_tokens=4), tok, 256) for p in ("Hi", "Name a colour.")]
    ends = serve_then_one_more(Scheduler(Broken(Engine(model, n_ctx=256)), tok, max_batch=4), recs, recs[0], 120)
    assert all(kind == "error" and "restarted" in str(err) for kind, err in ends.values()), ends


def test_max_queue_zero_runs_a_request_when_a_batch_slot_is_free():
    """max_queue 0: a request is taken while a batch slot is free and refused
    (QueueFull) while none is; the queue limit counts only jobs beyond the free slots."""
    import threading

    from node.gguf_model import default_model_path
    from node.generate import Request, build_request
    from node.scheduler import QueueFull, Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    rec = build_request(Request(prompt="Hi", max_tokens=2), tok, 256)
    sched = Scheduler(Engine(model, n_ctx=256), tok, max_batch=1, max_queue=0)
    ends = []
    try:
        for _ in range(2):
            done = threading.Event()
            sched.submit(rec, lambda kind, value: (ends.append(kind), done.set()) if kind != "token" else None)
            with pytest.raises(QueueFull):
                sched.submit(rec, lambda kind, value: None)
            assert done.wait(120)
    finally:
        sched.stop()
    assert ends == ["done", "done"]


def test_step_token_budget_serves_short_prompts_first_and_keeps_the_bytes():
    """With 8 tokens per step, a 60-token prompt is prefilled over several
    steps while a short request submitted after it is prefilled and decoded
    beside it: no step feeds more than 8 tokens, the short request finishes
    first, and both digests equal their solo runs."""
    import threading

    from node.gguf_model import default_model_path
    from node.generate import Request, build_request, generate
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    long = build_request(Request(prompt="one two three four five six seven eight nine ten " * 6, max_tokens=2),
                         tok, 256)
    short = build_request(Request(prompt="Hi", max_tokens=3), tok, 256)
    assert len(long["prompt_tokens"]) > 50
    solo = [generate(Engine(model, n_ctx=256), tok, r).digest for r in (long, short)]
    steps, order, got = [], [], {}
    done = threading.Semaphore(0)
    sched = Scheduler(Engine(model, n_ctx=256), tok, max_batch=4, step_tokens=8,
                      on_step=lambda b, fed, s: steps.append(fed))

    def on(name):
        def cb(kind, value):
            if kind != "token":
                order.append(name)
                got[name] = value.digest if kind == "done" else value
                done.release()
        return cb
    try:
        sched.submit(long, on("long"))
        sched.submit(short, on("short"))
        assert done.acquire(timeout=300) and done.acquire(timeout=300)
    finally:
        sched.stop()
    assert [got["long"], got["short"]] == solo
    assert order == ["short", "long"]
    assert steps and max(steps) <= 8 and sum(steps) >= len(long["prompt_tokens"]) + len(short["prompt_tokens"])


def test_newer_shorter_prompts_cannot_hold_a_long_prompt_back_forever():
    """With fewer prompt tokens per step than prefilling jobs (here 1, every
    step's other tokens going to decoding jobs), the tokens go round: a long
    prompt is fed within a few steps even while a shorter prompt arrives every
    three steps (as fast as one token a step can serve them), where
    fewest-left-first alone would never feed it."""
    from node.scheduler import Job, Scheduler

    class Gen:   # a job's prompt to prefill, as Scheduler._plan reads a Generation
        def __init__(self, left):
            self.prompt_left = left

        def next_chunk(self, n):
            n = min(n, self.prompt_left) if self.prompt_left else 1
            self.prompt_left -= min(n, self.prompt_left)
            return [0] * n

    plan = Scheduler._plan.__get__(type("S", (), {"step_tokens": 4, "_plans": 0})())
    decoding = [Job({}, None, gen=Gen(0)) for _ in range(4)]   # 4 decode tokens: 1 prompt token left
    long = Job({}, None, gen=Gen(100))
    fed, ready = [], decoding + [long]
    for step in range(12):
        ready = [j for j in ready if j.gen.prompt_left or j in decoding]
        if step % 3 == 0:
            ready.append(Job({}, None, gen=Gen(3)))   # a shorter prompt of 3 tokens
        before = long.gen.prompt_left
        jobs, chunks = plan(ready)
        assert sum(len(c) for j, c in zip(jobs, chunks) if j not in decoding) == 1
        fed.append(before - long.gen.prompt_left)
    assert sum(fed) >= 3 and max(len(list(g)) for k, g in itertools.groupby(fed) if k == 0) <= 4, fed


def test_a_cancelled_job_holds_no_place_while_its_step_runs():
    """A client that goes away mid-prefill: its job is cancelled during a long step,
    and until that step ends the job still holds its sequence, but not its place:
    with one batch slot and no queue the next request is taken (not QueueFull),
    counted neither active nor waiting, and served once the step ends; a waiting
    job that is cancelled leaves the queue at once."""
    import threading

    from node.gguf_model import default_model_path
    from node.generate import Request, build_request
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)

    class Gated(Wrapped):
        """The engine, except that its first forward pass waits for ``go``."""
        def __init__(self, engine):
            super().__init__(engine)
            self.entered, self.go = threading.Event(), threading.Event()

        def forward(self, chunks, all_logits=False):
            if not self.entered.is_set():
                self.entered.set()
                assert self.go.wait(60)
            return self.engine.forward(chunks, all_logits)

    engine = Gated(Engine(model, n_ctx=256))
    rec = build_request(Request(prompt="Hi", max_tokens=1), tok, 256)
    sched = Scheduler(engine, tok, max_batch=1, max_queue=0)
    ends, done = [], threading.Event()
    try:
        first = sched.submit(rec, lambda kind, value: ends.append(("first", kind)))
        assert engine.entered.wait(60)
        sched.cancel(first)
        assert (sched.active, sched.queue_depth) == (0, 0)
        second = sched.submit(rec, lambda kind, value: ends.append(("second", kind)))
        assert sched.queue_depth == 1
        sched.cancel(second)                  # a waiting job leaves the queue at once
        assert sched.queue_depth == 0
        sched.submit(rec, lambda kind, value: (ends.append(("third", kind)), done.set()) if kind != "token" else None)
        engine.go.set()
        assert done.wait(120)
    finally:
        engine.go.set()
        sched.stop()
    assert ends == [("third", "done")]


def test_a_bug_freeing_a_sequence_still_answers_and_keeps_the_worker(caplog):
    """A bug (not a BitexactError) in freeing a sequence, after a request finished
    or was cancelled: the request still gets its answer, the bug is logged, and the
    worker thread lives on to serve the next request (no request waits forever)."""
    import threading

    from node.gguf_model import default_model_path
    from node.generate import Request, build_request
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)

    class LeakyRelease(Wrapped):
        def release(self, seq):
            raise RuntimeError("planted bug in release")

    rec = build_request(Request(prompt="Hi", max_tokens=2), tok, 256)
    sched = Scheduler(LeakyRelease(Engine(model, n_ctx=256)), tok, max_batch=2)
    try:
        ends = []
        for i in range(2):
            done, started = threading.Event(), threading.Event()
            cancelled = sched.submit(rec, lambda kind, value: started.set())
            assert started.wait(60)
            sched.cancel(cancelled)           # freed by the worker's loop, not by a step
            sched.submit(rec, lambda kind, value: (ends.append(kind), done.set()) if kind != "token" else None)
            assert done.wait(60), f"request {i} got no answer"
    finally:
        sched.stop()
    assert ends == ["done", "done"]
    assert "planted bug in release" in caplog.text


def test_stop_leaves_a_step_that_never_ends_behind(monkeypatch, caplog):
    """stop() waits STOP_SECONDS for the engine step under way; a step that never ends
    (a hung GPU or rank) is logged and left behind, so a node's shutdown still ends."""
    import threading

    from node import scheduler
    from node.gguf_model import default_model_path
    from node.generate import Request, build_request
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    entered, release = threading.Event(), threading.Event()

    class Stuck(Wrapped):
        def forward(self, chunks, all_logits=False):
            entered.set()
            release.wait(60)
            raise RuntimeError("released")

    monkeypatch.setattr(scheduler, "STOP_SECONDS", 0.3)
    sched = scheduler.Scheduler(Stuck(Engine(model, n_ctx=256)), tok)
    ends = []
    sched.submit(build_request(Request(prompt="Hi", max_tokens=1), tok, 256), lambda kind, value: ends.append(kind))
    assert entered.wait(60)
    t0 = time.monotonic()
    sched.stop()
    assert time.monotonic() - t0 < 5 and sched._thread.is_alive()
    assert "did not stop within 0.3 s" in caplog.text
    release.set()                 # the step ends at last: the worker fails its request and exits
    sched._thread.join(60)
    assert not sched._thread.is_alive() and ends == ["error"]


def test_a_nan_in_one_request_of_a_step_fails_only_that_request():
    """A NaN in one request's logits (a NumericFault of the forward pass) fails that
    request only: the request stepped beside it ends with its solo digest, as it
    would alone on an idle node. The faulted step appends nothing to any sequence
    (Engine.forward raises before the lengths move), so its requests can be rerun."""

    from node.errors import NumericFault
    from node.gguf_model import default_model_path
    from node.generate import Request, build_request, generate
    from node.sampler import SamplingParams
    from node.scheduler import Scheduler
    from node.tokenizer import Tokenizer
    model = load_model(default_model_path())
    tok = Tokenizer(model)
    recs = [build_request(Request(prompt=p, max_tokens=3, params=SamplingParams(0.8, 0, 1.0, 7)), tok, 256)
            for p in ("Zebras and yaks.", "Name a colour.")]
    marker = next(t for t in recs[0]["prompt_tokens"] if t not in recs[1]["prompt_tokens"])
    want = generate(Engine(model, n_ctx=256), tok, recs[1]).digest

    eng = Engine(model, n_ctx=256)
    run = eng.backend.run

    def nan_rows(forward, tok_ids, pos, rows):   # the logits row of a chunk holding the marker is NaN
        out = np.array(run(forward, tok_ids, pos, rows))
        for i, r in enumerate(rows):               # chunk i: tokens rows[i - 1] + 1 .. rows[i]
            if marker in tok_ids[(rows[i - 1] + 1 if i else 0):r + 1].tolist():
                out[i] = np.nan
        return out
    eng.backend.run = nan_rows

    s1, s2 = eng.new_sequence(), eng.new_sequence()
    with pytest.raises(NumericFault):
        eng.forward([(s1, [marker, 1, 2]), (s2, [3, 4])])
    assert (eng.length(s1), eng.length(s2)) == (0, 0)          # a faulted step appends nothing
    eng.release(s1)
    eng.release(s2)

    ends = serve_all(Scheduler(eng, tok, max_batch=4), recs)
    assert ends[0][0] == "error" and isinstance(ends[0][1], NumericFault), ends[0]
    assert ends[1][0] == "done" and ends[1][1].digest == want, ends[1]
