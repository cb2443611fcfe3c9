"""The attestation store survives a failed write and refuses foreign databases;
malformed GGUF metadata and tensor shapes are refused with a ModelError."""

import hashlib
import os
import re
import sqlite3

import numpy as np
import pytest

from node.errors import ModelError
from node.gguf_model import load_model
from node.store import AttestationStore
from node.synth import copy_model, write_model


def test_store_rolls_back_a_failed_put_and_keeps_working(tmp_path):
    store = AttestationStore(str(tmp_path))
    with pytest.raises(sqlite3.Error):
        store.put("a", "t", "d", object())            # not bindable: fails inside the transaction
    b = hashlib.sha256(b"blob").hexdigest()
    store.put(b, "t", "d", b"blob")
    assert store.get(b) == b"blob" and store.get("a") is None and store.count() == 1
    store.close()


def test_store_raises_the_commit_error_not_the_rollback_error(tmp_path):
    """A COMMIT that fails and ends the transaction itself (e.g. a disk I/O error)
    makes the ROLLBACK fail too; put raises the COMMIT's error, which says what happened."""
    store = AttestationStore(str(tmp_path))
    db = store._db

    class FailingCommit:
        def execute(self, sql, *a):
            if sql == "COMMIT":
                db.execute("ROLLBACK")
                raise sqlite3.OperationalError("disk I/O error")
            return db.execute(sql, *a)

    store._db = FailingCommit()
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        store.put("a", "t", "d", b"blob")
    store._db = db
    assert store.get("a") is None and store.count() == 0
    store.close()


def test_store_refuses_a_table_of_another_shape(tmp_path):
    db = sqlite3.connect(tmp_path / "attestations.sqlite3")
    db.execute("CREATE TABLE attestations (x)")
    db.close()
    with pytest.raises(sqlite3.DatabaseError, match="not a bitexact store"):
        AttestationStore(str(tmp_path))


def test_a_store_that_can_only_be_read_is_refused_when_opened(tmp_path, monkeypatch):
    """SQLite opens a database file it may not write read-only, silently (a file of
    another owner, a read-only mount; simulated with mode=ro, since root writes any
    file): the store refuses it when opened, not at the first put, after a request's work."""
    AttestationStore(str(tmp_path)).close()
    real = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda path, **k: real(f"file:{path}?mode=ro", uri=True, **k))
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        AttestationStore(str(tmp_path))
    monkeypatch.undo()
    store = AttestationStore(str(tmp_path))   # the store itself is left as it was
    assert store.count() == 0
    store.close()


def plant(folder, att_id: str, blob) -> None:
    """Write a row straight into the store's database, as a damaged or foreign writer could."""
    db = sqlite3.connect(os.path.join(folder, "attestations.sqlite3"), isolation_level=None)
    db.execute("INSERT INTO attestations VALUES (?, 't', 'd', ?)", (att_id, blob))
    db.close()


GOOD = b"a signed attestation"
BAD_ROWS = {   # the blob of a row, and what get says of it
    "integer": (12345, "holds int, not a blob"),
    "huge integer": (2 ** 62, "holds int, not a blob"),
    "text": ("text", "holds str, not a blob"),
    "real": (1.5, "holds float, not a blob"),
    "other bytes": (b"not the file its id names", "holds a blob whose SHA-256 is not its id"),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_store_get_refuses_a_row_that_is_not_the_file_its_id_names(tmp_path, name):
    """SQLite keeps any type in a BLOB column: a stored integer is refused, never made
    into as many zero bytes, and bytes are the file only when their SHA-256 is the id."""
    blob, why = BAD_ROWS[name]
    store = AttestationStore(str(tmp_path))
    att_id = hashlib.sha256(GOOD).hexdigest()
    plant(tmp_path, att_id, blob)
    with pytest.raises(sqlite3.DatabaseError) as e:
        store.get(att_id)
    assert str(e.value) == f"the row of attestation {att_id} {why}"
    store.close()


def test_store_get_returns_the_file_its_id_names(tmp_path):
    store = AttestationStore(str(tmp_path))
    att_id = hashlib.sha256(GOOD).hexdigest()
    store.put(att_id, "t", "d", GOOD)
    assert store.get(att_id) == GOOD and store.get("0" * 64) is None
    store.close()


@pytest.mark.parametrize("metadata,needle", [
    ({"llama.attention.head_count": 0}, "head_count has an invalid value"),
    ({"llama.attention.head_count_kv": 0}, "head_count_kv has an invalid value"),
    ({"llama.attention.layer_norm_rms_epsilon": "small"}, "rms_epsilon is stored as STRING; llama.cpp reads it as FLOAT32"),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, "invalid value"),
    ({"llama.attention.layer_norm_rms_epsilon": 1e-50}, "invalid value"),   # stored as float32: 0
    ({"llama.attention.layer_norm_rms_epsilon": 1 - 1e-12}, "invalid value"),   # stored as float32: 1
    ({"llama.attention.layer_norm_rms_epsilon": np.float64(1e-5)}, "stored as FLOAT64; llama.cpp reads it as FLOAT32"),
    ({"llama.rope.freq_base": 0.0}, "freq_base has an invalid value"),
    ({"llama.rope.freq_base": 1e-30}, "freq_base has an invalid value"),
    ({"llama.attention.layer_norm_rms_epsilon": "1e-5"}, "stored as STRING"),
    ({"llama.rope.freq_base": 10000}, "freq_base is stored as UINT32; llama.cpp reads it as FLOAT32"),
    ({"llama.rope.freq_base": np.float64(1e308)}, "freq_base is stored as FLOAT64"),
    ({"llama.block_count": 30.5}, "block_count is stored as FLOAT32; llama.cpp reads it as UINT32"),
    ({"llama.block_count": 0}, "block_count has an invalid value"),
    ({"llama.block_count": 50_000_000}, "says 50000000 layers; the file holds"),
    ({"general.name": b"\xff\xfeabc"}, "general.name holds a string that is not UTF-8"),
    ({"general.architecture": b"\xffllama"}, "general.architecture holds a string that is not UTF-8"),
    ({"llama.feed_forward_length": 100}, "hyperparameters say 100x64"),
    ({"llama.embedding_length": 96}, "head layout"),
    ({"llama.block_count": float("inf")}, "block_count is stored as FLOAT32"),
    ({"llama.context_length": float("inf")}, "context_length is stored as FLOAT32"),
    ({"llama.rope.freq_base": float("inf")}, "freq_base has an invalid value inf"),
    ({"general.name": 7}, "general.name is stored as UINT32; llama.cpp reads it as STRING only"),
    ({"tokenizer.chat_template": 7}, "chat_template is stored as UINT32; llama.cpp reads it as STRING only"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "unsupported RoPE scaling type 'yarn'"),
    ({"llama.rope.scaling.factor": -2.0}, "rope.scaling.factor has an invalid value"),
    ({"llama.rope.scale_linear": float("nan")}, "rope.scale_linear has an invalid value nan"),
    ({"llama.rope.dimension_count": 8}, "head layout"),   # partial rotary: not the llama layout
])
def test_malformed_metadata_is_a_model_error(tmp_path, metadata, needle):
    path = write_model(str(tmp_path / "bad.gguf"), "tiny", "Q8_0", metadata=metadata)
    with pytest.raises(ModelError, match=needle):
        load_model(path)


def test_truncated_gguf_is_one_model_error(tmp_path):
    """A GGUF file cut anywhere (header, metadata, tensor infos, tensor data) is
    one ModelError that says so, whatever the GGUF reader tripped on."""
    data = open(write_model(str(tmp_path / "m.gguf"), "tiny", "Q8_0"), "rb").read()
    for cut in (0, 3, 8, 20, 100, 1000, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelError, match=f"cannot read GGUF file {path}: it is truncated or corrupt"):
            load_model(str(path))


def test_an_unreadable_gguf_is_not_called_corrupt(tmp_path, monkeypatch):
    """An OSError opening or reading the file (here EACCES, which root never gets
    from chmod) is named as such, not as a truncated or corrupt file."""
    from node import gguf_model

    path = write_model(str(tmp_path / "m.gguf"), "tiny", "Q8_0")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_model, "_bounded_reader", lambda: refuse)   # the reader's open fails
    with pytest.raises(ModelError, match=f"^cannot read GGUF file {re.escape(path)}: Permission denied$"):
        load_model(path)


@pytest.mark.parametrize("metadata,scale", [
    ({}, 1.0),
    ({"llama.rope.scaling.factor": 4.0}, 0.25),                   # no type: linear, as llama.cpp reads it
    ({"llama.rope.scale_linear": 2.0}, 0.5),                      # the older key
    ({"llama.rope.scaling.factor": 4.0, "llama.rope.scale_linear": 2.0}, 0.25),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, 1.0),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, 1.0),   # 0: no scaling
])
def test_rope_scaling_metadata_reads_as_llama_cpp_reads_it(tmp_path, metadata, scale):
    """docs/determinism.md section 7: the RoPE frequency scale from the GGUF keys
    (tests/test_fidelity.py checks the logits against llama.cpp's)."""
    model = load_model(write_model(str(tmp_path / "m.gguf"), "tiny", "Q8_0", metadata=metadata))
    assert model.hparams.rope_freq_scale == scale


@pytest.mark.parametrize("metadata", [{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1e-39},
                                      {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1e-6}])
def test_rope_angles_past_the_table_range_are_one_model_error(tmp_path, metadata):
    """A scaling factor that would push RoPE angles past sincos64's 2**28 rad is
    refused before the table is computed: a ModelError, and no numpy warning."""
    import warnings

    from node.engine import Engine
    model = load_model(write_model(str(tmp_path / "bad.gguf"), "tiny", "Q8_0", metadata=metadata))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModelError, match="RoPE angles would reach"):
            Engine(model, n_ctx=2048)


def _lone_embedding_gguf(path: str, shape: tuple) -> str:
    """A GGUF of the llama architecture holding only token_embd.weight, fp32 zeros of
    numpy ``shape`` (GGUF lists the dimensions in the reverse order), and no metadata."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("shape,shown", [((0, 64), r"\[64, 0\]"), ((), r"\[\]")])
def test_a_tensor_with_an_empty_dimension_or_none_is_a_model_error(tmp_path, shape, shown):
    """A zero-row tensor or one of no dimensions (valid GGUF) is refused by name, not
    with numpy's reshape error or an IndexError."""
    path = _lone_embedding_gguf(str(tmp_path / "zero.gguf"), shape)
    with pytest.raises(ModelError, match=f"'token_embd.weight' has shape {shown}: it needs at least one dimension"):
        load_model(path)


@pytest.mark.parametrize("shape", [(2, 32, 64), (3, 1, 32, 64)])
def test_a_tensor_of_more_than_two_dimensions_is_a_model_error(tmp_path, shape):
    """GGUF shape [64, 32, 2] holds as many values as [64, 64] but is another layout:
    refused by name (dimensions of 1 there are read as absent: the test below)."""
    path = _lone_embedding_gguf(str(tmp_path / "dims.gguf"), shape)
    shown = ", ".join(map(str, shape[::-1]))
    with pytest.raises(ModelError, match=rf"'token_embd.weight' has shape \[{shown}\]: the llama layout has at most two"):
        load_model(path)


def test_dimensions_of_one_after_the_second_leave_the_model_as_it_was(tmp_path):
    """A model whose tensors carry dimensions of 1 after their second (GGUF [K, N, 1],
    a norm as [n_embd, 1, 1, 1]; llama.cpp reads them as absent) loads as the same
    model: every tensor's rows, columns, type and bytes."""
    src = write_model(str(tmp_path / "a.gguf"), "tiny", "Q8_0", seed=5)
    extra = {"blk.0.attn_q.weight": (1,), "blk.1.ffn_down.weight": (1, 1), "output_norm.weight": (1, 1, 1)}

    def padded(name, data, qtype):   # numpy order: the leading axes are GGUF's last dimensions
        return (data.reshape(extra[name] + data.shape), qtype) if name in extra else None

    a, b = load_model(src), load_model(copy_model(src, str(tmp_path / "b.gguf"), tensor=padded))
    assert a.tensors.keys() == b.tensors.keys() and a.sha256 != b.sha256
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (u.qtype, u.rows, u.cols) == (t.qtype, t.rows, t.cols) and u.raw.tobytes() == t.raw.tobytes(), name


def test_a_model_named_through_a_link_and_dotdot_keeps_the_file_it_read(tmp_path, monkeypatch):
    """``link/../m.gguf`` is the m.gguf beside the link's target: Model.path (which the
    tokenizer and the rank processes open again) names that file, not the m.gguf a
    textual folding of the name would give (absent here, or another model)."""
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "cwd").mkdir()
    os.symlink(tmp_path / "real" / "inner", tmp_path / "cwd" / "link")
    real = write_model(str(tmp_path / "real" / "m.gguf"), shape=(64, 2, 4, 2, 96, 256), qtype="Q8_0")
    monkeypatch.chdir(tmp_path / "cwd")
    model = load_model(os.path.join("link", "..", "m.gguf"))
    assert os.path.isabs(model.path) and os.path.exists(model.path) and os.path.samefile(model.path, real)


@pytest.mark.parametrize("existing", [False, True, "through a link"])
def test_a_store_that_cannot_be_created_leaves_nothing(tmp_path, monkeypatch, existing):
    """A full disk while the store is created (its table cannot be written): the error
    propagates and neither the database file nor a folder the store made is left, also
    when the folder is named through a symbolic link and ``..`` (``link/../data`` is
    beside the link's target)."""
    real = sqlite3.connect

    class FullDisk:
        def __init__(self, *a, **k):
            self.db = real(*a, **k)

        def execute(self, sql, *a):
            if sql.startswith("CREATE TABLE"):
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.execute(sql, *a)

        def close(self):
            self.db.close()

    folder = tmp_path / "a" / "b" / "data"   # makedirs makes three folders when none exists
    if existing == "through a link":
        (tmp_path / "real" / "inner").mkdir(parents=True)
        os.symlink(tmp_path / "real" / "inner", tmp_path / "link")
        folder = tmp_path / "link" / ".." / "a" / "data"
    elif existing:
        folder.mkdir(parents=True)
    monkeypatch.setattr(sqlite3, "connect", FullDisk)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        AttestationStore(str(folder))
    if existing == "through a link":
        assert sorted(os.listdir(tmp_path)) == ["link", "real"] and os.listdir(tmp_path / "real") == ["inner"]
    elif existing:
        assert folder.is_dir() and not any(folder.iterdir())
    else:
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["blk.0.attn_norm.weight", "output_norm.weight"])
def test_a_quantized_norm_vector_is_refused_at_load(tmp_path, name):
    """Norm weights are read as floats: a Q8_0 one (valid GGUF, the right shape) is
    refused by load_model, not at the first forward step, where a daemon that started
    with it (its health ok) would answer every request with a 500."""
    import gguf

    def quantized(tname, data, qtype):
        if tname != name:
            return None
        block = np.concatenate([np.array([1.0], np.float16).view(np.uint8), np.ones(32, np.uint8)])
        return np.tile(block, 2).reshape(1, 68), gguf.GGMLQuantizationType.Q8_0   # 64 values: scale 1, codes 1

    src = write_model(str(tmp_path / "m.gguf"), "tiny", "Q8_0")
    path = copy_model(src, str(tmp_path / "qnorm.gguf"), tensor=quantized)
    with pytest.raises(ModelError, match=f"tensor {name} has quant type Q8_0; a vector .* must be one of F32"):
        load_model(path)


def test_copy_model_adds_metadata_and_replaces_only_the_tensors_it_is_given(tmp_path):
    """synth.copy_model (a real model varied by tests and studies): every key and
    tensor of the source, the added key, and a replaced tensor with its new type."""
    from gguf import GGMLQuantizationType

    src = write_model(str(tmp_path / "a.gguf"), "tiny", "Q8_0", seed=3)

    def halve_norm(name, data, qtype):
        if name != "output_norm.weight":
            return None
        return (data.astype(np.float32) / 2).astype(np.float16), GGMLQuantizationType.F16

    dst = copy_model(src, str(tmp_path / "b.gguf"), {"llama.rope.scaling.factor": 2.0}, tensor=halve_norm)
    a, b = load_model(src), load_model(dst)
    assert b.hparams.rope_freq_scale == 0.5 and a.hparams.rope_freq_scale == 1.0
    assert {k: v for k, v in b.metadata.items() if k != "llama.rope.scaling.factor"} == a.metadata
    assert a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        u = b.tensors[name]
        if name == "output_norm.weight":
            assert (u.qtype, t.qtype) == ("F16", "F32")
            half = (t.raw.view("<f4") / 2).astype(np.float16)
            assert np.array_equal(u.raw.view("<f2"), half)
        else:
            assert (u.qtype, u.raw.tobytes()) == (t.qtype, t.raw.tobytes()), name


@pytest.mark.parametrize("itype, count, cut, said", [
    (5, 2 ** 60, False, "claims 1152921504606846976 items, more than 1048576"),   # int32 items
    (0, 2 ** 20 + 1, False, "claims 1048577 items, more than 1048576"),           # uint8: within the file
    (5, 49152, True, "claims 49152 items, more than the file holds"),             # the file cut short
    (8, 49152, True, "claims 49152 items, more than the file holds"),             # strings: 8 bytes at least
])
def test_a_forged_metadata_array_length_is_refused_before_the_reader_walks_it(tmp_path, itype, count, cut, said):
    """The gguf reader walks an array item by item (about 660 bytes of memory each):
    a forged length in the default model's token_type array would cost minutes and
    gigabytes before it failed. Refused at once with the array's claim."""
    import struct

    from node.gguf_model import default_model_path

    b = bytearray(open(default_model_path(), "rb").read())
    key = b"tokenizer.ggml.token_type"
    i = b.find(key) + len(key)
    assert struct.unpack_from("<IIQ", b, i) == (9, 5, 49152)   # ARRAY of INT32, the vocabulary's size
    struct.pack_into("<IIQ", b, i, 9, itype, count)
    if cut:
        b = b[:i + 16 + 4096]
    path = tmp_path / "forged.gguf"
    path.write_bytes(b)
    with pytest.raises(ModelError, match="truncated or corrupt") as e:
        load_model(str(path))
    assert said in str(e.value)
