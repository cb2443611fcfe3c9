"""scripts/model_parts.sh: a model cut into parts NAME.SHA256.K-of-N and put together
again from parts that arrive one at a time, in any order (scripts/gpu_check.sh)."""
import hashlib
import os
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "model_parts.sh")


def parts(*args, cwd):
    return subprocess.run(["bash", SCRIPT, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def cut(tmp_path):
    data = os.urandom(1000)
    (tmp_path / "m.gguf").write_bytes(data)
    p = parts("cut", "m.gguf", "parts", 400, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    return tmp_path, data, hashlib.sha256(data).hexdigest()


def test_parts_arriving_one_at_a_time_give_the_model_back(cut):
    tmp, data, sha = cut
    names = sorted(os.listdir(tmp / "parts"))
    assert names == [f"m.gguf.{sha}.{k}-of-3" for k in (1, 2, 3)]
    assert [len((tmp / "parts" / n).read_bytes()) for n in names] == [400, 400, 200]
    lines = []
    for k in (3, 1, 2):   # one part a run, out of order
        (tmp / f"run{k}").mkdir()
        os.link(tmp / "parts" / names[k - 1], tmp / f"run{k}" / names[k - 1])
        p = parts("join", f"run{k}", "stash", "dest", cwd=tmp)
        assert p.returncode == 0, p.stderr
        lines.append(p.stdout)
    assert lines == ["1 of 3 parts of m.gguf here\n", "2 of 3 parts of m.gguf here\n",
                     f"{sha}  m.gguf (put together from 3 parts)\n"]
    assert os.listdir(tmp / "dest") == ["m.gguf"] and (tmp / "dest" / "m.gguf").read_bytes() == data


def test_parts_that_do_not_give_their_digest_are_refused(cut):
    tmp, _, sha = cut
    bad = tmp / "parts" / f"m.gguf.{sha}.2-of-3"
    bad.write_bytes(b"X" + bad.read_bytes()[1:])
    p = parts("join", "parts", "stash", "dest", cwd=tmp)
    assert p.returncode == 2 and p.stderr == f"model_parts: the parts of m.gguf do not give SHA-256 {sha}\n"
    assert os.listdir(tmp / "dest") == []   # no model, no temporary file


def test_cut_replaces_earlier_parts_but_never_other_files(cut):
    tmp, _, sha = cut
    p = parts("cut", "m.gguf", "parts", 600, cwd=tmp)
    assert p.returncode == 0 and sorted(os.listdir(tmp / "parts")) == [f"m.gguf.{sha}.{k}-of-2" for k in (1, 2)]
    (tmp / "parts" / "notes.txt").write_text("mine")
    p = parts("cut", "m.gguf", "parts", cwd=tmp)
    assert p.returncode == 2 and "holds other files than model parts" in p.stderr
    assert (tmp / "parts" / "notes.txt").read_text() == "mine" and len(os.listdir(tmp / "parts")) == 3
    assert parts("cut", "m.gguf", "m.gguf", cwd=tmp).returncode == 2   # a file, not a folder


def test_join_refuses_a_file_not_named_as_a_part(cut):
    tmp = cut[0]
    (tmp / "other").mkdir()
    (tmp / "other" / "notes.v2.1-of-x").write_text("mine")
    p = parts("join", "other", "stash", "dest", cwd=tmp)
    assert p.returncode == 2 and p.stderr == "model_parts: other/notes.v2.1-of-x is not named NAME.SHA256.K-of-N\n"
    assert not (tmp / "stash").exists() and not (tmp / "dest").exists()


@pytest.mark.parametrize("args", [[], ["cut", "m.gguf"], ["cut", "nope.gguf", "parts"], ["cut", "m.gguf", "parts", "0"],
                                  ["join", "parts", "stash"], ["split"]])
def test_bad_arguments_are_one_line_and_exit_2(cut, args):
    p = parts(*args, cwd=cut[0])
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("model_parts: "), p.stderr
