"""Tensor parallelism on the CPU: the numpy engine sharded as 2, 4 and 8 ranks
(row-parallel partials gathered and combined as the contract tree's top levels)
gives the bytes of TP 1, for the default model and synthetic shapes, whatever
the batching."""

import time

import numpy as np
import pytest

from node import reference as ref
from planted import misuse_cases
from node.engine import Engine
from node.errors import ModelError
from node.gguf_model import BLOCK_BYTES, FLOAT_TYPES, default_model_path, load_model
from node.synth import write_model
from node.tp import ROW_PARALLEL, ShardPlan, TpCpuBackend, k_shards

F32 = np.float32
SHAPE = (512, 2, 8, 4, 1024, 300)     # n_embd, layers, heads, KV heads, FFN, vocab: 8 heads split over 8 ranks
SMOL_LIKE = (576, 1, 9, 3, 1536, 300)  # SmolLM2's widths and grouping: uneven heads, KV groups across ranks


@pytest.mark.parametrize("n", [1, 31, 32, 33, 576, 1000, 4096, 14336])
def test_subtrees_of_tp_ranks_recombine_to_warp_sum(n):
    rng = np.random.default_rng(n)
    t = (rng.standard_normal((3, n)) * 10.0 ** rng.uniform(-3, 3, n)).astype(F32)
    want = ref.warp_sum(t)
    g = ref.lane_terms(n)
    for tp in (1, 2, 4, 8):
        per = (32 // tp) * g
        parts = [ref.subtree_sum(t[:, r * per:(r + 1) * per], g, 32 // tp) for r in range(tp)]
        assert ref.subtree_sum(np.stack(parts), 1, tp, axis=0).tobytes() == want.tobytes()


def test_combining_partials_in_another_order_changes_bytes():
    """The check above can fail: a left-to-right combine of 8 partials differs from the tree."""
    rng = np.random.default_rng(1)
    t = (rng.standard_normal((256, 4096)) * 10.0 ** rng.uniform(-3, 3, 4096)).astype(F32)
    parts = [ref.subtree_sum(t[:, r * 512:(r + 1) * 512], 128, 4) for r in range(8)]
    seq = parts[0]
    for p in parts[1:]:
        seq = seq + p
    assert seq.tobytes() != ref.warp_sum(t).tobytes()


def test_k_shards_cover_k_in_lane_order():
    assert k_shards(576, True, 4) == [(0, 256), (256, 512), (512, 576), (576, 576)]   # SmolLM2: 18 blocks
    assert k_shards(576, False, 2) == [(0, 288), (288, 576)]                          # 18 elements per lane
    assert k_shards(14336, True, 8) == [(r * 1792, (r + 1) * 1792) for r in range(8)]
    for k, quant, tp in [(1536, True, 8), (4096, False, 4), (96, False, 8)]:
        spans = k_shards(k, quant, tp)
        assert spans[0][0] == 0 and spans[-1][1] == k and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def run(engine, prompts, chunks):
    """Prefill each prompt in the given chunk sizes (all sequences in every step), then 3 greedy steps."""
    seqs = [engine.new_sequence() for _ in prompts]
    logits = {s: [] for s in seqs}
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        step = []
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            if done[i] < len(p):
                n = chunks[i % len(chunks)]
                step.append((s, p[done[i]:done[i] + n]))
                done[i] += n
        for (s, _), lg in zip(step, engine.forward(step, all_logits=True)):
            logits[s].append(lg)
    for _ in range(3):
        step = [(s, [int(np.argmax(logits[s][-1][-1]))]) for s in seqs]
        for (s, _), lg in zip(step, engine.forward(step, all_logits=True)):
            logits[s].append(lg)
    out = [np.concatenate(logits[s]) for s in seqs]
    for s in seqs:
        engine.release(s)
    return out


def assert_tp_equal(model, prompts):
    want = run(Engine(model, n_ctx=256), prompts, [64])                     # TP 1, whole prompts
    for tp, chunks in ((2, [3, 1]), (4, [5]), (8, [1, 2, 7])):
        got = run(Engine(model, n_ctx=256, tp=tp), prompts, chunks)
        for w, g in zip(want, got):
            assert w.tobytes() == g.tobytes(), f"TP {tp} differs from TP 1"


@pytest.mark.parametrize("qtype", ["BF16", "F32", "Q8_0", "Q4_K", "Q4_1", "Q6_K"])
def test_tp_synthetic_bytes_equal_tp1(tmp_path, qtype):
    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, qtype, seed=5))
    assert_tp_equal(model, [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 299, 5, 6]])


@pytest.mark.default_model
def test_tp_default_model_bytes_equal_tp1():
    plan = ShardPlan(load_model(default_model_path()), 4)
    assert plan.heads[0] == [(0, 4), (4, 8), (8, 9), (9, 9)]                 # 9 heads over 4 ranks
    assert_tp_equal(load_model(default_model_path()), [[1, 504, 3250, 314, 2], [28, 1359]])


def test_ranks_attend_over_whole_kv_groups_of_their_own_heads(tmp_path):
    """9 query heads over 3 KV heads (SmolLM2's grouping) split unevenly: each rank
    attends over the heads of its K shard widened to whole KV-head groups, keeps
    those groups' KV heads, and hands its shard's columns of the attention output
    to the attention output product."""
    model = load_model(write_model(str(tmp_path / "m.gguf"), SMOL_LIKE, "Q4_1", seed=3))
    want = {2: ([(0, 8), (8, 9)], [(0, 9), (6, 9)], [3, 1], [(0, 512), (128, 192)]),
            4: ([(0, 4), (4, 8), (8, 9), (9, 9)], [(0, 6), (3, 9), (6, 9), (0, 0)], [2, 2, 1, 0],
                [(0, 256), (64, 320), (128, 192), (0, 0)])}
    for tp, (heads, attn, kv, cols) in want.items():
        plan = ShardPlan(model, tp)
        assert plan.heads[0] == heads and plan.attn_heads == attn, tp
        assert [plan.kv_heads(r) for r in range(tp)] == kv
        assert [plan.attention_columns(0, r) for r in range(tp)] == cols
        assert plan.spans("blk.0.attn_q.weight") == [(a * 64, b * 64) for a, b in attn]
        assert plan.spans("blk.0.attn_k.weight") == [(a // 3 * 64, b // 3 * 64) for a, b in attn]


def test_a_rank_gathers_only_row_parallel_partials_and_logits(tmp_path):
    """A rank process's backend all-gathers twice per layer (attention output, FFN
    down) and once for the logits, and its KV cache holds only its KV heads.
    (The stand-in gather hands back the rank's own piece for every rank: it
    counts calls; the bytes are checked by the process tests.)"""
    from node.tp_runtime import RankBackend

    class CountingGather:
        calls = 0

        def all_gather(self, a):
            CountingGather.calls += 1
            return [a] * 4

    model = load_model(write_model(str(tmp_path / "m.gguf"), SMOL_LIKE, "Q4_1", seed=3))
    for rank, kv in enumerate([2, 2, 1, 0]):
        CountingGather.calls = 0
        eng = Engine(model, "cpu", 256, backend=RankBackend(model, 4, rank, CountingGather()))
        seq = eng.new_sequence()
        eng.forward([(seq, [1, 2, 3])])
        assert CountingGather.calls == 2 * model.hparams.n_layer + 1, rank
        assert eng.backend._kv[seq][0].shape[:2] == (model.hparams.n_layer, kv), rank


@pytest.mark.parametrize("qtype", ["BF16", "Q4_1"])
def test_a_ranks_shards_count_against_the_cpu_weight_budget(tmp_path, monkeypatch, qtype):
    """A rank process keeps its shards only within its share (1/tp) of the CPU
    weight budget; beyond it, shards are cut from matrices decoded again, with the
    same bytes (the stand-in gather hands back the rank's own piece for every rank,
    alike for every budget)."""
    import node.backend_cpu as bc
    from node.tp_runtime import RankBackend

    class SelfGather:
        def all_gather(self, a):
            return [a] * 2

    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, qtype, seed=3))
    out = {}
    for mb in (None, "0", "1"):
        if mb is None:
            monkeypatch.delenv(bc.CACHE_ENV, raising=False)
        else:
            monkeypatch.setenv(bc.CACHE_ENV, mb)
        for rank in range(2):
            be = RankBackend(model, 2, rank, SelfGather())
            share = be._cache_left
            eng = Engine(model, "cpu", 64, backend=be)
            seq = eng.new_sequence()
            out[mb, rank] = np.concatenate([eng.forward([(seq, [1, 2, 3])], all_logits=True)[0],
                                            eng.forward([(seq, [4])], all_logits=True)[0]]).tobytes()
            kept = sum(w.nbytes for w in be._own.values())
            assert kept <= share and be._cache_left == share - kept, (mb, rank)
            assert not [n for n in be._weights if model.tensors[n].rows > 1], "whole matrices are dropped"
            if mb is not None:
                assert share == (int(mb) << 20) // 2
            assert (kept > 0) == (mb != "0"), (mb, rank)
    assert len(set(out[mb, 0] for mb in (None, "0", "1"))) == 1
    assert len(set(out[mb, 1] for mb in (None, "0", "1"))) == 1


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_rank_decodes_only_its_shard_with_the_whole_matrix_s_bytes(tmp_path, monkeypatch, qtype):
    """A rank process decodes its rows or its K range from the file's bytes alone
    (a K-quant's K shard can end inside a super-block): each shard equals the same
    part of the matrix decoded whole, at every degree, and no whole matrix is decoded."""
    import node.backend_cpu as bc
    from node.tp_runtime import RankBackend
    decoded = []   # bytes of the file each decoding read

    def spy(f):
        return lambda *a: decoded.append(a[-1].raw.nbytes if hasattr(a[-1], "raw") else a[-1].nbytes) or f(*a)
    shape = (512, 1, 8, 4, 1536, 64)      # K = 512 and 1 536: K-quant super-blocks split at TP 4 and 8
    model = load_model(write_model(str(tmp_path / "m.gguf"), shape, qtype, seed=5))
    for tp in (2, 4, 8):
        whole, split = TpCpuBackend(model, tp), 0   # cuts its shards from whole decoded matrices
        for rank in range(tp):
            be = RankBackend(model, tp, rank, gather=None)
            for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.attn_output.weight",
                         "blk.0.ffn_down.weight"):
                a, b = be.plan.spans(name)[rank]
                if a == b:
                    continue
                t = model.tensors[name]
                with monkeypatch.context() as m:
                    m.setattr(bc, "decode_blocks", spy(bc.decode_blocks))
                    m.setattr(bc, "float_values", spy(bc.float_values))
                    decoded.clear()
                    be._shard(name, rank)
                if not name.endswith(ROW_PARALLEL):
                    part = (b - a) * t.raw.shape[1]                          # its rows
                elif qtype in FLOAT_TYPES:
                    part = t.rows * (b - a) * (t.raw.shape[1] // t.cols)     # its K range
                else:
                    bb, be_ = BLOCK_BYTES[qtype]                             # the encoding blocks holding it
                    part = t.rows * (-(-b // be_) - a // be_) * bb
                assert decoded == [part], (tp, name, decoded, part)
                split += qtype in ("Q4_K", "Q6_K") and t.cols % 256 == 0 and name.endswith(ROW_PARALLEL) \
                    and (a % 256 or b % 256)
                got, want = be._shard(name, rank), whole._shard(name, rank)
                for g, w in ([(got, want)] if isinstance(got, np.ndarray) else
                             [(got.codes, want.codes), (got.scale, want.scale), (got.offset, want.offset)]):
                    assert (g is None) == (w is None) and (g is None or (g.shape == w.shape and g.dtype == w.dtype
                                                                        and g.tobytes() == w.tobytes())), (tp, name)
            assert not [n for n in be._weights if model.tensors[n].rows > 1], "a whole matrix was decoded"
        if qtype in ("Q4_K", "Q6_K") and tp == 8:
            assert split, "no shard ended inside a super-block"


def test_tp_refuses_a_degree_that_splits_a_head(tmp_path):
    model = load_model(write_model(str(tmp_path / "m.gguf"), (256, 1, 4, 2, 512, 50), "BF16", seed=1))
    Engine(model, tp=4)                                                     # 64 elements per rank = 1 head
    with pytest.raises(ModelError, match="split a head"):
        Engine(model, tp=8)
    for bad in (3, True, 2.0, "2"):
        with pytest.raises(ModelError, match="degree"):
            Engine(model, tp=bad)


# ---- ranks as processes (node.tp_runtime) ----------------------------------

def test_tp_processes_bytes_equal_tp1(tmp_path):
    """TP 2 and 4 as rank processes that all-gather over shared memory give
    TP 1's bytes, chunked prefill and decode included; a fork is mirrored on
    every rank."""
    from node.tp_runtime import OUT_ROWS, TpEngine
    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, "Q8_0", seed=7))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 299, 5, 6]]
    want = run(Engine(model, n_ctx=256), prompts, [64])
    for tp, chunks in ((2, [2, 5]), (4, [1, 3])):
        eng = TpEngine(model, tp, n_ctx=256)
        try:
            assert eng.n_ctx == 256
            for w, g in zip(want, run(eng, prompts, chunks)):
                assert w.tobytes() == g.tobytes(), f"TP {tp} processes differ from TP 1"
            a = eng.new_sequence()
            eng.forward([(a, prompts[0])])
            b = eng.fork(a, 4)
            assert (eng.length(a), eng.length(b)) == (7, 4)
            long = [(7 * i) % 300 for i in range(OUT_ROWS + 6)]    # more logits rows than the shared block
            one = Engine(model, n_ctx=256)
            assert eng.forward([(eng.new_sequence(), long)], all_logits=True)[0].tobytes() == \
                one.forward([(one.new_sequence(), long)], all_logits=True)[0].tobytes()
        finally:
            eng.close()
    smol = load_model(write_model(str(tmp_path / "s.gguf"), SMOL_LIKE, "Q4_1", seed=3))
    want = run(Engine(smol, n_ctx=256), prompts, [64])
    for tp in (2, 4):                            # ranks attend over KV groups they share, one rank over none
        eng = TpEngine(smol, tp, n_ctx=256)
        try:
            for w, g in zip(want, run(eng, prompts, [3, 4])):
                assert w.tobytes() == g.tobytes(), f"TP {tp} processes differ from TP 1 (9 heads over 3 KV heads)"
        finally:
            eng.close()


@pytest.mark.default_model
def test_tp_processes_default_model_and_errors():
    """The default model at TP 2 in two processes, with a 60-token chunk (its
    gathers take several shared-memory rounds: 49152-row LM head, 21 rows per
    round); a bad request fails on every rank alike and the engine keeps
    serving; a killed rank fails the next call at once (the barrier is
    aborted) instead of hanging."""
    from node.errors import BitexactError, RequestError
    from node.tp_runtime import SLOT_FLOATS, TpEngine
    model = load_model(default_model_path())
    prompts = [[1, 504, 3250, 314, 2], [(7 * i + 28) % 9000 for i in range(60)]]
    assert 60 > SLOT_FLOATS // model.hparams.n_vocab
    want = run(Engine(model, n_ctx=256), prompts, [64])
    eng = TpEngine(model, 2, n_ctx=256)
    try:
        s = eng.new_sequence()
        with pytest.raises(RequestError, match="token id"):
            eng.forward([(s, [model.hparams.n_vocab])])
        eng.release(s)
        for w, g in zip(want, run(eng, prompts, [2, 60])):
            assert w.tobytes() == g.tobytes()
        s = eng.new_sequence()
        eng._procs[1].kill()
        eng._procs[1].join()
        t0 = time.monotonic()
        with pytest.raises(BitexactError, match="rank"):     # rank 0 waits at a gather until the abort
            eng.forward([(s, [1, 2])])
        assert time.monotonic() - t0 < 60
    finally:
        eng.close()
    with pytest.raises(BitexactError, match="closed"):
        eng.new_sequence()


def test_tp_processes_refuse_a_bad_split_before_starting(tmp_path):
    from node.tp_runtime import TpEngine
    model = load_model(write_model(str(tmp_path / "m.gguf"), (256, 1, 4, 2, 512, 50), "BF16", seed=1))
    with pytest.raises(ModelError, match="split a head"):
        TpEngine(model, 8)


class _Alarm(Exception):
    pass


@pytest.mark.default_model
def test_tp_processes_break_cleanly_on_a_mid_gather_death_or_interrupt():
    """A rank killed while a long step runs (the other rank then waits at a
    gather), a fault on the ranks, or the caller interrupted mid-call: the
    call fails within seconds, every later call says the engine must be
    restarted (never a stale result), and close() still stops every rank."""
    import signal
    import threading

    from node.errors import BitexactError
    from node.tp_runtime import TpEngine
    model = load_model(default_model_path())
    prompt = [(7 * i + 28) % 9000 for i in range(200)]

    def broken_after(eng, action):
        s = eng.new_sequence()
        result = {}

        def call():
            try:
                eng.forward([(s, prompt)])
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                result["error"] = e
        t0 = time.monotonic()
        action(eng, call)
        assert time.monotonic() - t0 < 60, "the failed call hung"
        with pytest.raises(BitexactError, match="must be restarted"):
            eng.new_sequence()
        return result

    def kill_rank_mid_step(eng, call):
        t = threading.Thread(target=call)
        t.start()
        time.sleep(1.0)
        eng._procs[1].kill()
        t.join(60)
        assert not t.is_alive()

    def interrupt_mid_step(eng, call):
        def on_alarm(*_):
            raise _Alarm()
        old = signal.signal(signal.SIGALRM, on_alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    for action, want in ((kill_rank_mid_step, BitexactError), (interrupt_mid_step, _Alarm)):
        eng = TpEngine(model, 2, n_ctx=512)
        procs = list(eng._procs)
        try:
            assert isinstance(broken_after(eng, action).get("error"), want)
        finally:
            eng.close()
        assert not any(p.is_alive() for p in procs)

    eng = TpEngine(model, 2, n_ctx=512)
    try:
        with pytest.raises(BitexactError, match="AttributeError"):       # a bug on the ranks: a fault
            eng._call("no_such_method")
        with pytest.raises(BitexactError, match="must be restarted"):
            eng.new_sequence()
    finally:
        eng.close()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gpu_gather_layout_assembles_like_the_numpy_ranks(tmp_path, tp):
    """The GPU ranks' send buffers (``pack_pieces``) of what they gather (the
    row-parallel partials and the LM head's vocabulary shards), gathered in rank
    order and unpacked (``unpack_pieces``), give the numpy engine's products byte
    for byte, uneven and empty shards included (9 heads of SmolLM2's widths)."""
    from node.tp_gpu import pack_pieces, unpack_pieces
    model = load_model(write_model(str(tmp_path / "m.gguf"), SMOL_LIKE, "Q4_1", seed=3))
    cpu = TpCpuBackend(model, tp)
    rng = np.random.default_rng(tp)
    for names in (("blk.0.attn_output.weight",), ("blk.0.ffn_down.weight",), (model.output.name,)):
        x = rng.standard_normal((5, model.tensors[names[0]].cols)).astype(np.float32)
        sends = []
        for r in range(tp):
            own = {n: cpu.piece(x, n, r) for n in names if cpu.plan.spans(n)[r][0] != cpu.plan.spans(n)[r][1]}
            sends.append(pack_pieces(np, cpu.plan, names, 5, r, own))
        got = unpack_pieces(np, cpu.plan, names, 5, np.stack(sends), ref.tp_combine)
        for name, w, g in zip(names, cpu.linears(x, names), got):
            assert w.tobytes() == g.tobytes(), f"TP {tp} {name}"
    if tp == 8:
        assert cpu.plan.spans("blk.0.attn_output.weight")[7] == (576, 576)      # an empty shard exercised


def test_a_request_error_on_one_rank_only_stops_the_others(tmp_path, monkeypatch):
    """If one rank raises a request error while another waits at a gather (on
    GPUs: an out-of-memory on one device), the call fails once the others
    stay silent for ERR_GRACE_S, and the engine is broken instead of hanging."""
    from node import tp_runtime
    from node.errors import BitexactError
    monkeypatch.setattr(tp_runtime, "ERR_GRACE_S", 1.0)
    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, "Q8_0", seed=7))
    eng = tp_runtime.TpEngine(model, 2, n_ctx=256)
    try:
        seq = eng.new_sequence()
        eng._conns[0].send(("forward", ([(seq, [1, 2, 3])], False)))                     # gathers, waits for rank 1
        eng._conns[1].send(("forward", ([(seq, [model.hparams.n_vocab])], False)))      # refuses the token id
        t0 = time.monotonic()
        with pytest.raises(BitexactError, match="did not answer"):
            eng._replies()
        assert time.monotonic() - t0 < 30 and eng.broken
        with pytest.raises(BitexactError, match="restarted"):
            eng.length(seq)
    finally:
        eng.close()


def test_a_rank_that_dies_while_idle_breaks_the_engine_when_asked(tmp_path, caplog):
    """A rank killed between calls: ``broken`` says so at once (the daemon's
    ``GET /health`` is 503 before any request has to fail on it), with one log
    line, and the next call says the engine must be restarted."""
    from node.errors import BitexactError
    from node.tp_runtime import TpEngine
    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, "Q8_0", seed=7))
    eng = TpEngine(model, 2, n_ctx=256)
    try:
        seq = eng.new_sequence()
        assert eng.broken is None
        eng._procs[1].kill()
        eng._procs[1].join()
        assert eng.broken == "tensor-parallel rank 1 exited" and eng.broken == "tensor-parallel rank 1 exited"
        lines = [r.getMessage() for r in caplog.records if r.name == "bitexact.tp"]
        assert len(lines) == 1 and lines[0].startswith("tensor-parallel rank 1 exited (exit code -9)"), lines
        with pytest.raises(BitexactError, match="must be restarted"):
            eng.length(seq)
    finally:
        eng.close()
    assert not any(p.is_alive() for p in eng._procs)
    clean = TpEngine(model, 2, n_ctx=256)
    procs = list(clean._procs)
    clean.close()
    clean._procs = procs   # as a health check reading `broken` while close() joins them would see them
    assert clean.broken is None and len([r for r in caplog.records if r.name == "bitexact.tp"]) == 1, \
        "a rank stopped by close() is not a death"


def test_tp_engine_misuse_is_a_request_error_and_leaves_it_usable(tmp_path):
    """Every rank raises the same RequestError for a call the caller got wrong
    (unknown sequence, bad fork length, bad token ids, ...), so the
    tensor-parallel engine stays usable, as Engine does, instead of breaking."""
    from node.errors import RequestError
    from node.tp_runtime import TpEngine
    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, "Q8_0", seed=7))
    eng = TpEngine(model, 2, n_ctx=256)
    try:
        cases, live = misuse_cases(eng, model.hparams.n_vocab)
        for call, message in cases:
            with pytest.raises(RequestError, match=message):
                call()
        assert eng.broken is None and eng.length(live) == 0
        # an argument that cannot be pickled reaches no rank: a request error (Engine's is one
        # too), not an engine broken as if interrupted mid-send
        for call in (lambda: eng.forward([(live, [lambda: 0])]), lambda: eng.length(lambda: 0)):
            with pytest.raises(RequestError, match="cannot be sent to the ranks"):
                call()
        assert eng.broken is None and eng.length(live) == 0
        # a call to rank 0 alone (TpEngine.sample on GPU ranks): its request error leaves the
        # engine usable, and the other ranks' pipes stay in step for the calls that follow
        with pytest.raises(RequestError, match="unknown sequence"):
            eng._call("length", 999, ranks=range(1))
        assert eng._call("length", live, ranks=range(1)) == 0 and eng.broken is None
        one = Engine(model, n_ctx=256)
        assert eng.forward([(live, [5, 6, 7])], all_logits=True)[0].tobytes() == \
            one.forward([(one.new_sequence(), [5, 6, 7])], all_logits=True)[0].tobytes()
    finally:
        eng.close()


def test_tp_ranks_refuse_a_model_file_replaced_after_the_parent_loaded_it(tmp_path):
    """The ranks load the model by path; if the file changed since the parent
    loaded it (its SHA-256 goes into every attestation), they would compute with
    another model than the one attested. They refuse to start instead."""
    from node.tp_runtime import TpEngine
    path = str(tmp_path / "m.gguf")
    model = load_model(write_model(path, SHAPE, "Q8_0", seed=7))
    write_model(path, SHAPE, "Q8_0", seed=8)                      # replaced on disk
    with pytest.raises(ModelError, match="changed after it was loaded"):
        TpEngine(model, 2, n_ctx=256).close()


def test_tp_call_interrupted_while_sending_breaks_the_engine(tmp_path):
    """An interrupt between the sends of one call leaves some ranks with the call
    and others without: the next call would pair different steps in the gathers
    (wrong bytes) or wait forever. The engine is broken instead."""
    import threading

    from node.errors import BitexactError
    from node.tp_runtime import TpEngine
    model = load_model(write_model(str(tmp_path / "m.gguf"), SHAPE, "Q8_0", seed=7))
    eng = TpEngine(model, 2, n_ctx=256)
    try:
        seq = eng.new_sequence()
        real = eng._conns[1]

        class Interrupted:
            def send_bytes(self, msg):                        # TpEngine._call's send of the pickled call
                eng._conns[1] = real
                raise KeyboardInterrupt

        eng._conns[1] = Interrupted()
        with pytest.raises(KeyboardInterrupt):
            eng.forward([(seq, [1, 2, 3])])                  # rank 0 got it, rank 1 did not
        result = {}

        def call():
            try:
                result["ok"] = eng.forward([(seq, [4, 5, 6])])
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                result["error"] = e
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the call after an interrupted send hung"
        assert isinstance(result.get("error"), BitexactError) and "restarted" in str(result["error"]), result
    finally:
        eng._abort_ranks()
        eng.close()


_ORPHAN_SCRIPT = """
import os, signal, sys, threading, time
from node.gguf_model import load_model
from node.tp_runtime import TpEngine
if __name__ == "__main__":
    eng = TpEngine(load_model(sys.argv[1]), 2, n_ctx=1024)
    print(" ".join(str(p.pid) for p in eng._procs), flush=True)
    s = eng.new_sequence()
    threading.Thread(target=eng.forward, args=([(s, [(7 * i) % 300 for i in range(600)])],), daemon=True).start()
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)                  # the parent dies mid-step
"""


def test_tp_ranks_stop_quietly_when_the_parent_is_killed_mid_step(tmp_path):
    """A killed parent (OOM killer, kill -9) leaves its ranks without a reader:
    they stop at their next gather instead of computing the rest of the step,
    and say nothing (no tracebacks of the failed reply in the node's log)."""
    import os
    import subprocess
    import sys
    model = write_model(str(tmp_path / "m.gguf"), (512, 8, 8, 4, 2048, 300), "Q8_0", seed=7)
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    one = Engine(load_model(model), n_ctx=1024)
    t0 = time.monotonic()
    one.forward([(one.new_sequence(), [(7 * i) % 300 for i in range(600)])])
    step_s = time.monotonic() - t0                           # the step alone, on one process
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, str(script), model], stdout=subprocess.PIPE, stderr=f, text=True,
                                env=env)
        pids = [int(p) for p in proc.stdout.readline().split()]
        proc.wait(120)
    t1 = time.monotonic()                                    # the parent is dead
    assert len(pids) == 2, err.read_text()
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() - t1 < 60:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), "the ranks outlived their parent"
    assert time.monotonic() - t1 < step_s / 2, (time.monotonic() - t1, step_s)   # not the rest of the step
    assert "Traceback" not in err.read_text(), err.read_text()
