"""Host-side logic of node/backend_cuda.py CudaBackend (graph buffers, step inputs,
error paths, streams) on a fake CuPy, so it runs without a GPU."""

import contextlib
import os
import sys
import types

import numpy as np
import pytest

from node.backend_cuda import CudaBackend, GpuError

V = 8   # vocabulary of the fake model


class Dev(np.ndarray):
    """A "device" array: numpy, with CuPy's set/get."""

    def set(self, arr, stream=None):
        self[...] = arr

    def get(self, stream=None, out=None):
        if out is None:
            return np.array(self)
        out[...] = self
        return out


class FakeOOM(Exception):
    pass


class FakeStream:
    def __init__(self):
        self.depth = 0
        self.capturing = False

    def __enter__(self):
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1

    def begin_capture(self, mode=None):
        self.capturing = True

    def end_capture(self):
        self.capturing = False
        return types.SimpleNamespace(launch=lambda stream: None)

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        pass


class FakeCupy:
    """Just enough of CuPy for CudaBackend's host-side code; ``oom`` device
    allocations from now on fail (counted down) with cuda.memory.OutOfMemoryError."""
    float32, uint8, int32, int64 = np.float32, np.uint8, np.int32, np.int64

    def __init__(self):
        self.oom = 0
        self.fail_after = 0
        self.cuda = types.SimpleNamespace(
            MemoryPool=lambda alloc: types.SimpleNamespace(malloc=alloc),
            using_allocator=lambda alloc: contextlib.nullcontext(),
            memory=types.SimpleNamespace(OutOfMemoryError=FakeOOM),
            runtime=types.SimpleNamespace(streamCaptureModeRelaxed=1))

    def _alloc(self, a):
        if self.fail_after:
            self.fail_after -= 1
        elif self.oom:
            self.oom -= 1
            raise FakeOOM("out of memory allocating a fake buffer")
        return a.view(Dev)

    def empty(self, shape, dtype=np.float32):
        return self._alloc(np.empty(shape, dtype))

    def zeros(self, shape, dtype=np.float32):
        return self._alloc(np.zeros(shape, dtype))

    def asarray(self, x, dtype=None):
        return self._alloc(np.array(x, dtype))

    def asnumpy(self, x):
        return np.array(x)


@pytest.fixture
def backend(monkeypatch):
    cp = FakeCupy()
    cupyx = types.SimpleNamespace(zeros_pinned=lambda n, dtype: np.zeros(n, dtype),
                                  empty_pinned=lambda shape, dtype: np.empty(shape, dtype))
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    be = object.__new__(CudaBackend)
    be.cp = be.xp = cp
    be.stream = FakeStream()
    be.hp = types.SimpleNamespace(n_vocab=V)
    be.graphs, be.max_splits = True, 4
    be.kv_pages = 16
    be._free_pages = list(range(15, 0, -1))
    be._scratch_page, be._pages = 0, {}
    be._graph_cache, be._graph_pool, be._graph_out = {}, None, None
    be._entry = be._last = None
    return be


def forward_of(be):
    """A device pass whose logits row is the row's token id, everywhere."""
    def forward(tok, pos, rows):
        return be.cp.asarray(np.repeat(np.asarray(tok)[np.asarray(rows)], V).reshape(-1, V).astype(np.float32))
    return forward


def step(be, chunks):
    """One replayable step of (seq, tokens) chunks on a fresh layout: each sequence starts at 0."""
    toks, pos, spans = [], [], []
    for seq, tk in chunks:
        spans.append((seq, len(toks), len(toks) + len(tk)))
        toks += tk
        pos += range(len(tk))
    rows = np.asarray([b - 1 for _, _, b in spans])
    be.begin_step(spans, np.asarray(pos, np.int64), replay=True)
    return be.run(forward_of(be), np.asarray(toks, np.int64), np.asarray(pos, np.int64), rows)


def test_an_out_of_memory_making_the_first_graph_leaves_later_graph_steps_working(backend):
    """An out-of-memory while the first graph's buffers are made (the graphs' one output
    buffer) is a GpuError, and the next replayable step makes the buffer and runs:
    the pool was kept without its output buffer, and every later graph step failed with
    a TypeError (writing the logits into None)."""
    be = backend
    for s in (1, 2):
        be.kv_alloc(s)
    be.cp.oom = 1
    with pytest.raises(GpuError, match="out of GPU memory"):
        step(be, [(1, [5, 6]), (2, [7])])
    assert be._graph_cache == {}
    out = step(be, [(1, [5, 6]), (2, [7])])
    assert out.tolist() == [[6.0] * V, [7.0] * V]
    assert be._graph_out is not None and be._last.tolist() == out.tolist()


def test_an_out_of_memory_in_begin_step_is_a_gpu_error(backend):
    """Out of memory while a step's inputs are uploaded (an eager step's page tables)
    is a GpuError like one in run, not CuPy's OutOfMemoryError (which the scheduler
    takes for a bug and the CLI for a crash)."""
    be = backend
    be.graphs = False
    be.kv_alloc(1)
    be.cp.oom = 1
    with pytest.raises(GpuError, match="out of GPU memory"):
        be.begin_step([(1, 0, 3)], np.arange(3, dtype=np.int64), replay=True)


def test_kv_copy_prefix_copies_on_the_backends_stream(backend):
    """A fork's page copies run on the backend's stream (non-blocking, so the legacy
    default stream of a thread that never made it current does not order them
    before the next step's kernels)."""
    be = backend
    seen = []

    class Pages:
        def __getitem__(self, idx):
            seen.append(be.stream.depth > 0)
            return 0

        def __setitem__(self, idx, value):
            seen.append(be.stream.depth > 0)

    be.kp, be.vp = Pages(), Pages()
    be.kv_alloc(1)
    be._grow(1, 300)                # two pages
    be.kv_copy_prefix(1, 2, 300)
    assert seen and all(seen), seen


class FakeRuntimeError(Exception):
    def __init__(self, status):
        super().__init__(status)
        self.status = status


@pytest.mark.parametrize("capturing,fails,freed,ok", [
    (False, 0, 0, True),    # memory at once: nothing freed
    (False, 1, 1, True),    # the default pool's free blocks given back, then the second try succeeds
    (False, 2, 1, False),   # still none after that: out of memory, after one retry only
    (True, 1, 0, False),    # during a capture nothing is freed: out of memory at once
])
def test_the_graph_pool_takes_back_only_the_default_pool_s_free_blocks(monkeypatch, capturing, fails, freed, ok):
    """_malloc_no_retry, the graphs' pool's base allocator: on a CUDA out-of-memory
    error it frees the default pool's free blocks (never the graphs' own, which CuPy's
    retry would free) and tries once more, except during a capture."""
    from node.backend_cuda import _malloc_no_retry
    calls = {"alloc": 0, "freed": 0}
    no_memory = 2

    def memory(size):
        calls["alloc"] += 1
        if calls["alloc"] <= fails:
            raise FakeRuntimeError(no_memory)
        return ("mem", size)

    stream = FakeStream()
    stream.capturing = capturing
    cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            Memory=memory, MemoryPointer=lambda mem, off: mem,
            runtime=types.SimpleNamespace(CUDARuntimeError=FakeRuntimeError),
            memory=types.SimpleNamespace(OutOfMemoryError=lambda size, limit: FakeOOM(size)),
            get_current_stream=lambda: stream),
        get_default_memory_pool=lambda: types.SimpleNamespace(
            free_all_blocks=lambda: calls.__setitem__("freed", calls["freed"] + 1)))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    if ok:
        assert _malloc_no_retry(64) == ("mem", 64)
    else:
        with pytest.raises(FakeOOM):
            _malloc_no_retry(64)
    assert calls["freed"] == freed and calls["alloc"] == min(fails + 1, 1 if capturing else 2)


def test_out_of_pinned_host_memory_for_the_logits_is_a_gpu_error(backend):
    """cudaHostAlloc failing for a replayed step's logits (CuPy raises its runtime
    error, not OutOfMemoryError) is a GpuError, and the next step runs."""
    be = backend
    be.cp.cuda.runtime.CUDARuntimeError = FakeRuntimeError
    be.kv_alloc(1)
    cupyx = sys.modules["cupyx"]
    real, calls = cupyx.empty_pinned, []

    def empty_pinned(shape, dtype):
        calls.append(shape)
        if len(calls) == 1:
            raise FakeRuntimeError(2)   # cudaErrorMemoryAllocation
        return real(shape, dtype)
    cupyx.empty_pinned = empty_pinned
    with pytest.raises(GpuError, match="out of pinned host memory"):
        step(be, [(1, [5, 6])])
    assert step(be, [(1, [5, 6])]).tolist() == [[6.0] * V]


def test_a_capture_that_fails_reports_its_own_error_not_end_capture_s(backend):
    """An out-of-memory error during capture, after which ending the (void) capture
    raises too: the step is the GpuError of the out-of-memory, no graph is kept, and
    the next step captures again."""
    be = backend
    be.cp.cuda.runtime.CUDARuntimeError = FakeRuntimeError
    be.kv_alloc(1)
    real_end, ends = be.stream.end_capture, []

    def end_capture():
        ends.append(1)
        if len(ends) == 1:
            be.stream.capturing = False
            raise FakeRuntimeError(901)   # cudaErrorStreamCaptureInvalidated
        return real_end()
    be.stream.end_capture = end_capture
    real_asarray = be.cp.asarray

    def asarray(x, dtype=None):   # the forward pass's allocation (forward_of)
        if be.stream.capturing and not ends:
            raise FakeOOM("out of memory in capture")
        return real_asarray(x, dtype)
    be.cp.asarray = asarray
    with pytest.raises(GpuError, match="out of GPU memory"):
        step(be, [(1, [5, 6])])
    assert [e["graph"] for e in be._graph_cache.values()] == [None]
    assert step(be, [(1, [5, 6])]).tolist() == [[6.0] * V] and len(ends) == 2


def test_a_fork_into_a_full_kv_cache_fails_and_leaves_no_sequence_behind(backend):
    """Forking more positions than the free pages hold is a GpuError, and the new id
    keeps no (empty) page list: before, every failed fork left an entry behind."""
    be = backend
    be.kp = be.vp = np.zeros((1, 16), np.float32)
    be.kv_alloc(1)
    be._grow(1, 300)                # two of the 15 free pages
    free = list(be._free_pages)
    with pytest.raises(GpuError, match="KV cache full"):
        be.kv_copy_prefix(1, 2, 256 * 16)
    assert 2 not in be._pages and be._free_pages == free



def test_step_defines_choose_by_the_model_alone(tmp_path):
    """cuda/step.cu runs the models whose matrices are all F16 or all BF16 and whose
    dimensions fit it (compiled in as -D flags); others run the per-op kernels."""
    from node.backend_cuda import step_defines
    from node.gguf_model import load_model
    from node.synth import write_model
    shape = (256, 2, 4, 2, 512, 300)
    got = {q: step_defines(load_model(write_model(str(tmp_path / f"{q}.gguf"), shape, q, seed=1)))
           for q in ("F16", "BF16", "F32", "Q8_0", "Q4_K")}
    dims = ("-DST_D=256", "-DST_F=512", "-DST_HD=64", "-DST_H=4", "-DST_HKV=2")
    assert got == {"F16": dims + ("-DST_WT=1",), "BF16": dims + ("-DST_WT=2",), "F32": None, "Q8_0": None,
                   "Q4_K": None}
    # n_embd 576 (SmolLM2): not a multiple of 256, so no lane chunks of 8
    smol = load_model(write_model(str(tmp_path / "s.gguf"), (576, 1, 9, 3, 1536, 300), "BF16", seed=1))
    assert step_defines(smol) is None
    # 8 query heads of head_dim 128 on a KV head fit (32 query values per lane); 16 do not
    for kv_heads, fits in ((2, True), (1, False)):
        m = load_model(write_model(str(tmp_path / f"g{kv_heads}.gguf"), (2048, 1, 16, kv_heads, 512, 300), "BF16",
                                   seed=1))
        assert (step_defines(m) is not None) == fits, kv_heads


def test_step_phases_read_the_stamps_of_one_launch():
    """scripts/profile_step.py step_phases: per (tile, layer) the phases between
    cuda/step.cu's barrier stamps (the first Q/K/V from the start: the first layer
    has no barrier before it), medians over them, the LM head, the whole launch."""
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from profile_step import step_phases
    layers, tiles = 2, 2
    t = np.zeros(5 * tiles * layers + 3, np.int64)
    widths = [3, 5, 1, 2, 7] * (tiles * layers)   # µs of qkv, attention, o, gate_up, down in order
    stamps = np.cumsum([0] + widths + [4]) * 1000   # ..., then the LM head
    t[0] = stamps[0]
    t[2:] = stamps[1:]        # barrier 1 (before the first Q/K/V) is never passed: its stamp stays 0
    got = step_phases(t, layers, tiles)
    assert got["median_us"] == {"qkv": 3.0, "attention": 5.0, "o": 1.0, "gate_up": 2.0, "down": 7.0}
    assert got["head_us"] == 4.0 and got["total_us"] == sum(widths) + 4
