"""The ``bitexact`` command line as a subprocess: exit codes, one-line errors,
nothing written on failure, and verification of real, tampered and re-signed
attestations.

The single real attestation of the session comes from tests/test_attest.py's
:func:`artifact` (one ``bitexact run`` per session).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import stat
import sys

import pytest
from cryptography.hazmat.primitives import serialization

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attest import (_packb_sorted, artifact, assert_input_error, bx, sign_raw,  # noqa: E402
                         split_envelope)

from attest import canonical, envelope, keys  # noqa: E402
from node.errors import KeyError_  # noqa: E402
from node.synth import write_model  # noqa: E402


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return artifact(tmp_path_factory)


def listing(d) -> list[str]:
    return sorted(os.listdir(d))


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


@pytest.fixture(scope="module")
def dsa_key(tmp_path_factory):
    """A DSA key pair's PEM files (private, public): an algorithm `cryptography` deprecates,
    whose loading warns on stderr unless the CLI keeps library warnings off it."""
    import warnings

    from cryptography.hazmat.primitives.asymmetric import dsa
    from cryptography.utils import CryptographyDeprecationWarning
    d = tmp_path_factory.mktemp("dsa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        key = dsa.generate_private_key(key_size=1024)
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    return write(d / "dsa.pem", priv), write(d / "dsa.pub.pem", pub)


@pytest.fixture(scope="module")
def enc_key(tmp_path_factory):
    """A passphrase-protected key made with ``keygen --passphrase-file``."""
    d = tmp_path_factory.mktemp("enc")
    write(d / "pass.txt", b"correct horse\n")
    p = bx(d, "keygen", "--out", "enc.pem", "--passphrase-file", "pass.txt")
    assert p.returncode == 0, p.stderr
    return d


# --------------------------------------------------------------------------
# keygen

def test_error_lines_escape_line_breaks_and_terminal_escapes(capsys):
    """An error message quoting a model file or a request is printed as one line
    that cannot drive the terminal."""
    from node import cli
    cli._stderr_line("bitexact: error: tensor zz\n\x1b[31mEVIL \u2028 é")
    assert capsys.readouterr().err == "bitexact: error: tensor zz\\n\\x1b[31mEVIL \\u2028 é\n"


def test_an_unrecognized_argument_is_one_escaped_line(art, tmp_path):
    msg = assert_input_error(bx(tmp_path, "run", "--key", art.key, "--prompt", "hi", "\x1b[31mRED\nsecond"))
    assert msg.endswith("unrecognized arguments: \\x1b[31mRED\\nsecond (see bitexact run --help)")


def test_version_and_a_missing_command(tmp_path):
    from node import __version__
    p = bx(tmp_path, "--version")
    assert p.returncode == 0 and p.stdout == f"bitexact {__version__}\n", (p.stdout, p.stderr)
    assert "the following arguments are required: command" in assert_input_error(bx(tmp_path))


def test_quickstart_refuses_port_0_before_setup(tmp_path):
    """BITEXACT_PORT=0 would have serve listen on a port the quick start's client
    cannot know: one line, exit 2, before setup or any file is written."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(root, "scripts", "quickstart.sh"), copy / "scripts")
    p = subprocess.run(["bash", str(copy / "scripts" / "quickstart.sh")], env={**os.environ, "BITEXACT_PORT": "0"},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "BITEXACT_PORT=0" in p.stderr, (p.returncode, p.stderr)
    assert listing(copy) == ["scripts"]


@pytest.mark.parametrize("left", [["node.pem"], ["node.pub.pem"], ["data"], ["node.pub.pem", "data"]])
def test_quickstart_refuses_a_half_kept_key_before_setup(tmp_path, left):
    """A key without its public key, or the old key's public key or store without
    the key (a new key could not serve from that store): one line naming the way
    out, exit 2, before setup or any file is written."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(root, "scripts", "quickstart.sh"), copy / "scripts")
    qs = copy / "quickstart"
    qs.mkdir()
    for name in left:
        if name == "data":
            (qs / name).mkdir()
        else:
            write(qs / name, b"")
    p = subprocess.run(["bash", str(copy / "scripts" / "quickstart.sh")], env={**os.environ, "BITEXACT_PORT": "18931"},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, (p.returncode, p.stderr)
    assert "move the quickstart folder aside" in p.stderr, p.stderr
    assert listing(copy) == ["quickstart", "scripts"] and listing(qs) == sorted(left)


@pytest.mark.parametrize("args, needle", [
    (["--url", "http://[::1"], "is not a URL"), (["--url", "http://127.0.0.1:99999"], "is not a URL"),
    (["--url", ""], "must be http"), (["--url", "localhost:8420"], "must be http"),
    (["--url", "http://127.0.0.1:1", "--json", "{tmp}/no/such/folder/r.json"], "--json"),
    (["--url", "http://127.0.0.1:1", "--json", "{tmp}"], "--json"), (["--requests", "x"], "--requests"),
    (["--url", "http://127.0.0.1:1", "--json", "{tmp}/fifo"], "--json"),     # replaced by a rename, as /dev/null
    (["--url", "http://127.0.0.1:1", "--json", "{tmp}/link"], "--json")])    # would be
def test_loadtest_refuses_bad_arguments_before_any_request(tmp_path, args, needle):
    """A bad --url or an unwritable --json: exit 2 and one line, before any daemon
    starts or any request is sent (not a traceback, exit 1 as for differing digests,
    after the whole run, nor an empty --url taken as no --url)."""
    import subprocess
    from test_attest import cli_env
    os.mkfifo(tmp_path / "fifo")
    write(tmp_path / "target.json", b"kept")
    os.symlink("target.json", tmp_path / "link")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "loadtest.py"),
                        *(a.replace("{tmp}", str(tmp_path)) for a in args)],
                       env=cli_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, (p.returncode, p.stderr)
    assert p.stderr.startswith("loadtest: ") and needle in p.stderr and p.stdout == "", p.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and os.path.islink(tmp_path / "link")


@pytest.mark.parametrize("args, needle", [
    (["--model", "/no/such/model.gguf"], "model file not found"), (["--model", "/dev/null"], "not a regular file"),
    (["--threads", "0"], "--threads"), (["--tokens", "0"], "--tokens"), (["--tokens", "x"], "--tokens"),
    (["--prompt", ""], "encodes to no tokens"), (["--prompt", "\x04"], "encodes to no tokens"),
    (["--tokens", "9000"], "do not fit the context of 8192 tokens")])
def test_bench_cpu_refuses_bad_arguments_in_one_line(args, needle):
    """A missing model, an empty prompt or one the context cannot hold with --tokens: exit 2
    and one line, before anything runs, not a traceback from the engine (exit 1)."""
    import subprocess
    from test_attest import cli_env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_cpu.py"), *args],
                       env=cli_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, (p.returncode, p.stderr)
    assert p.stderr.startswith("bench_cpu: error: ") and needle in p.stderr and p.stdout == "", p.stderr


@pytest.mark.parametrize("models, needle", [([], "it lists no model"),
                                             ([{"id": "m", "object": "model", "created": 0, "owned_by": "x"}],
                                              "its answer carries no attestation")])
def test_loadtest_against_a_server_that_is_not_a_node(models, needle):
    """--url naming another OpenAI-compatible server: exit 2 and one line, not a traceback
    with exit 1, which says that a digest differs."""
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from test_attest import cli_env

    class Handler(BaseHTTPRequestHandler):
        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send({"object": "list", "data": models})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}]})

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        p = subprocess.run([sys.executable, os.path.join(root, "scripts", "loadtest.py"), "--url",
                            f"http://127.0.0.1:{server.server_port}", "--requests", "1", "--max-tokens", "1"],
                           env=cli_env(), capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, (p.returncode, p.stderr)
    assert p.stderr.startswith("loadtest: ") and "not a bitexact node: " + needle in p.stderr, p.stderr


def test_loadtest_removes_the_daemons_key_and_store(tmp_path):
    """The daemon loadtest starts gets a key and a store in a temporary folder, removed
    at exit (here: the daemon refuses a model without a tokenizer, exit 2)."""
    import subprocess
    from test_attest import cli_env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = write_model(str(tmp_path / "m.gguf"), "tiny", "Q8_0")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "loadtest.py"), "--model", model],
                       env={**cli_env(), "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "the daemon exited" in p.stderr, p.stderr
    assert listing(tmp) == []


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_loadtest_stops_its_daemon(tmp_path, signum):
    """loadtest's own daemon does not outlive it: SIGTERM stops it through main's
    cleanup, while it starts or runs (exit 143, temporary folder removed), SIGKILL through
    the kernel."""
    import subprocess
    import time
    from test_attest import cli_env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([sys.executable, os.path.join(root, "scripts", "loadtest.py"), "--requests", "1000"],
                         env={**cli_env(), "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    end, daemon = time.time() + 60, None
    while daemon is None and time.time() < end and p.poll() is None:
        for c in _children(p.pid):
            try:
                with open(f"/proc/{c}/cmdline", "rb") as f:
                    if b"serve" in f.read().split(b"\0"):
                        daemon = c
            except OSError:   # an earlier child (keygen) that has just ended
                pass
        time.sleep(0.1)
    assert daemon is not None, p.communicate(timeout=60)
    time.sleep(1)   # past the daemon's exec
    p.send_signal(signum)
    assert p.wait(60) == (143 if signum == signal.SIGTERM else -signal.SIGKILL)
    end = time.time() + 60
    while _running(daemon) and time.time() < end:
        time.sleep(0.2)
    assert not _running(daemon)
    if signum == signal.SIGTERM:
        assert listing(tmp) == []


def test_keygen_writes_private_0600_and_public(tmp_path):
    p = bx(tmp_path, "keygen", "--out", "KEY.pem")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert listing(tmp_path) == ["KEY.pem", "KEY.pub.pem"]
    assert stat.S_IMODE(os.stat(tmp_path / "KEY.pem").st_mode) == 0o600
    key = keys.load_private(str(tmp_path / "KEY.pem"), require_private_mode=True)
    pub = keys.load_public(str(tmp_path / "KEY.pub.pem"))
    assert pub == keys.public_raw(key)
    assert keys.key_id(pub) in p.stdout
    assert b"ENCRYPTED" not in (tmp_path / "KEY.pem").read_bytes()


def test_keygen_success_line_escapes_the_path(tmp_path):
    """The paths in keygen's success line are escaped as error lines are: a name
    with a line break or a terminal escape stays one line and drives nothing."""
    p = bx(tmp_path, "keygen", "--out", "a\nb\x1b[2J.pem")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1 and "\x1b" not in p.stdout
    assert p.stdout.startswith("wrote a\\nb\\x1b[2J.pem (mode 0600) and a\\nb\\x1b[2J.pub.pem; key id "), p.stdout


@pytest.mark.parametrize("existing", ["KEY.pem", "KEY.pub.pem"])
def test_keygen_refuses_to_overwrite_either_file(tmp_path, existing):
    write(tmp_path / existing, b"precious")
    p = bx(tmp_path, "keygen", "--out", "KEY.pem")
    assert existing in assert_input_error(p)
    assert listing(tmp_path) == [existing]
    assert (tmp_path / existing).read_bytes() == b"precious"


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_keygen_names_what_is_not_a_file(tmp_path, kind):
    """--out naming a folder or a FIFO: refused as not a regular file (not as an
    existing file), and left as it was."""
    (tmp_path / "KEY.pem").mkdir() if kind == "folder" else os.mkfifo(tmp_path / "KEY.pem")
    msg = assert_input_error(bx(tmp_path, "keygen", "--out", "KEY.pem"))
    assert msg.endswith("refusing to write KEY.pem: it is not a regular file")
    assert listing(tmp_path) == ["KEY.pem"]


def test_keygen_twice_keeps_the_first_key(tmp_path):
    assert bx(tmp_path, "keygen", "--out", "KEY.pem").returncode == 0
    before = {n: (tmp_path / n).read_bytes() for n in listing(tmp_path)}
    assert_input_error(bx(tmp_path, "keygen", "--out", "KEY.pem"))
    assert {n: (tmp_path / n).read_bytes() for n in listing(tmp_path)} == before


@pytest.mark.parametrize("setup,args", [
    (None, ["--out", "nodir/KEY.pem"]),
    ("pass_missing", ["--out", "KEY.pem", "--passphrase-file", "nope.txt"]),
    ("pass_empty", ["--out", "KEY.pem", "--passphrase-file", "empty.txt"]),
    ("pass_long", ["--out", "KEY.pem", "--passphrase-file", "long.txt"]),
    (None, ["--out", "KEY.pem", "--passphrase-file", ""]),   # names no file: not a key in the clear
    (None, ["--out", ""]),                                   # names no file, as --attestation '' and --data-dir ''
])
def test_keygen_errors_write_nothing(tmp_path, setup, args):
    if setup == "pass_empty":
        write(tmp_path / "empty.txt", b"\n")
    if setup == "pass_long":
        write(tmp_path / "long.txt", b"x" * 1024)
    before = listing(tmp_path)
    msg = assert_input_error(bx(tmp_path, "keygen", *args))
    assert listing(tmp_path) == before
    if args == ["--out", ""]:
        assert msg.endswith("--out must not be empty")


def test_keygen_names_the_public_key_it_cannot_write(tmp_path):
    """A private key name the folder allows whose public key name (``.pub.pem``) is
    too long: the error names the public key, and neither file is left."""
    name = "x" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 4) + ".pem"   # the longest allowed name
    msg = assert_input_error(bx(tmp_path, "keygen", "--out", name))
    assert msg.startswith(f"bitexact: error: cannot write public key {name[:-4]}.pub.pem: "), msg
    assert listing(tmp_path) == []


def test_env_passphrase_is_the_environment_bytes(tmp_path):
    """BITEXACT_KEY_PASSPHRASE is taken as the bytes the OS holds, UTF-8 or not:
    keygen encrypts with them and run decrypts with them; over 1023 bytes is one
    error line, exit 2, nothing written."""
    raw = b"ab\xffcd"
    env = {"BITEXACT_KEY_PASSPHRASE": os.fsdecode(raw)}
    p = bx(tmp_path, "keygen", "--out", "k.pem", env=env)
    assert p.returncode == 0, p.stderr
    key = serialization.load_pem_private_key((tmp_path / "k.pem").read_bytes(), password=raw)
    assert keys.public_raw(key) == keys.load_public(str(tmp_path / "k.pub.pem"))
    p = bx(tmp_path, "run", "--key", "k.pem", "--prompt", "", "--max-tokens", "2", "--device", "cpu", env=env)
    assert "prompt is empty" in assert_input_error(p)     # the key decrypted; the request is what fails
    before = listing(tmp_path)
    p = bx(tmp_path, "keygen", "--out", "long.pem", env={"BITEXACT_KEY_PASSPHRASE": "a" * 1024})
    assert "BITEXACT_KEY_PASSPHRASE holds more than 1023 bytes" in assert_input_error(p)
    p = bx(tmp_path, "keygen", "--out", "empty.pem", env={"BITEXACT_KEY_PASSPHRASE": ""})
    assert "BITEXACT_KEY_PASSPHRASE is set but empty" in assert_input_error(p)
    assert listing(tmp_path) == before


def test_keygen_passphrase_file(enc_key):
    pem = (enc_key / "enc.pem").read_bytes()
    assert b"ENCRYPTED PRIVATE KEY" in pem
    assert stat.S_IMODE(os.stat(enc_key / "enc.pem").st_mode) == 0o600
    # The passphrase is the file's content without its trailing newline.
    key = serialization.load_pem_private_key(pem, password=b"correct horse")
    assert keys.public_raw(key) == keys.load_public(str(enc_key / "enc.pub.pem"))
    with pytest.raises(KeyError_):
        keys.load_private(str(enc_key / "enc.pem"))


@pytest.fixture
def cwd(tmp_path):
    """An empty working folder for the command; tmp_path itself holds side files."""
    d = tmp_path / "cwd"
    d.mkdir()
    return d


@pytest.mark.parametrize("via", ["file", "env"])
def test_run_with_the_right_passphrase_gets_past_the_key(enc_key, cwd, via):
    # An empty prompt fails after the key is loaded: the error is about the request, not the key.
    extra, env = (["--passphrase-file", enc_key / "pass.txt"], None) if via == "file" else \
        ([], {"BITEXACT_KEY_PASSPHRASE": "correct horse"})
    p = bx(cwd, "run", "--key", enc_key / "enc.pem", *extra, "--prompt", "", "--max-tokens", "2",
           "--device", "cpu", env=env)
    assert "prompt is empty" in assert_input_error(p)
    assert listing(cwd) == []


@pytest.mark.parametrize("case,needle", [
    ("wrong", "wrong passphrase"),
    ("env_wrong", "wrong passphrase"),
    ("missing", "is encrypted: give its passphrase"),
    ("empty_pass", "is empty"),
    ("empty_pass_path", "cannot read passphrase file"),   # not the environment's passphrase instead
    ("garbage", "is not a PEM private key"),
    ("absent", "cannot read key"),
    ("public", "is not a PEM private key"),
    ("unencrypted_with_pass", "not encrypted"),
    ("dsa", "is not an Ed25519 key"),
])
def test_run_with_a_bad_key_fails_and_writes_nothing(enc_key, dsa_key, art, tmp_path, cwd, case, needle):
    key, extra, env = enc_key / "enc.pem", [], None
    if case == "wrong":
        extra = ["--passphrase-file", write(tmp_path / "wrong.txt", b"wrong horse\n")]
    elif case == "env_wrong":
        env = {"BITEXACT_KEY_PASSPHRASE": "wrong horse"}
    elif case == "empty_pass":
        extra = ["--passphrase-file", write(tmp_path / "empty.txt", b"")]
    elif case == "empty_pass_path":
        extra, env = ["--passphrase-file", ""], {"BITEXACT_KEY_PASSPHRASE": "correct horse"}
    elif case == "garbage":
        key = write(tmp_path / "garbage.pem", b"-----BEGIN PRIVATE KEY-----\nAAAA\n")
    elif case == "absent":
        key = tmp_path / "no-such-key.pem"
    elif case == "public":
        key = art.pub
    elif case == "unencrypted_with_pass":
        key, extra = art.key, ["--passphrase-file", enc_key / "pass.txt"]
    elif case == "dsa":   # deprecated by the library: its warning must not reach stderr
        key = dsa_key[0]
    p = bx(cwd, "run", "--key", key, *extra, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu", env=env)
    assert needle in assert_input_error(p)
    assert listing(cwd) == []


def test_run_with_an_unreadable_key(art, tmp_path, cwd):
    if os.geteuid() == 0:
        # root reads any file: use a folder in the key's place instead.
        key = tmp_path / "dir.pem"
        key.mkdir()
    else:
        key = tmp_path / "locked.pem"
        shutil.copy(art.key, key)
        os.chmod(key, 0)
    p = bx(cwd, "run", "--key", key, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu")
    assert "cannot read key" in assert_input_error(p)
    assert listing(cwd) == []


# --------------------------------------------------------------------------
# run: bad requests write nothing

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 4


@pytest.mark.parametrize("args,needle", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "   \n\t "], "prompt is empty"),
    (["--prompt", "\x04\x06"], "encodes to no tokens"),
    (["--prompt", LONG_PROMPT, "--ctx", "16"], "context holds 16"),
    (["--prompt", "hi", "--max-tokens", "0"], "max tokens"),
    (["--prompt", "hi", "--max-tokens", "-1"], "max tokens"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--prompt", "hi", "--temperature", "nan"], "temperature"),
    (["--prompt", "hi", "--temperature=-0"], "temperature -0.0 is refused: write 0"),
    (["--prompt", "hi", "--temperature", "-0.0"], "temperature -0.0 is refused: write 0"),
    (["--prompt", "hi", "--temperature", "1e-400"], "argument --temperature: 1e-400 is not 0 but rounds to 0"),
    (["--prompt", "hi", "--top-p=-1_0e-999"], "argument --top-p: -1_0e-999 is not 0 but rounds to 0"),
    (["--prompt", "hi", "--temperature", "\u0663e-999"], "is not 0 but rounds to 0"),   # an Arabic-Indic 3
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--prompt", "hi", "--top-k", "-1"], "top_k"),
    (["--prompt", "hi", "--seed", "-1"], "seed"),
    (["--prompt", "hi", "--stop", ""], "stop"),
    (["--prompt", "hi", "--stop", "x" * 4097], "at most 4096 characters"),
    (["--prompt", "hi", "--ctx", "0"], "--ctx"),
    (["--prompt", "hi", "--ctx", "100000000000"], "--ctx"),
    (["--chat", "  "], "chat messages are empty"),
    (["--chat", "[1]"], "chat message"),
    (["--chat", "[]"], "non-empty"),
    (["--chat", '[{"role": "user", "content": 1}]'], "chat message"),
    (["--chat", '[{"role": "user", "content": "a", "content": "b"}]'], "'content' appears twice"),   # not the last
    (["--chat", '[{"role": "user", "role": "user", "content": "a"}]'], "'role' appears twice"),
    (["--chat", "[" * 100000], "context holds"),        # not JSON: one user message, far too long
    (["--prompt", "hi", "--model", "/no/such/model.gguf"], "not found"),
    (["--prompt", "hi", "--model", "/"], "not a regular file"),
    (["--prompt", "hi", "--model", "/dev/null"], "not a regular file"),
    (["--prompt", "hi", "--model", "NOT_GGUF"], "GGUF"),
    (["--prompt", "hi", "--model", "EMPTY_FILE"], "GGUF"),
    (["--prompt", "hi", "--temperature", "warm"], "--temperature"),
    (["--prompt", "hi", "--max-tokens", "two"], "--max-tokens"),
    (["--prompt", "hi", "--temperature", "1e-45"], "temperature"),
    (["--prompt", "hi", "--top-k", str(2 ** 70)], "top_k"),
    (["--prompt", "hi", "--max-tokens", str(2 ** 70)], "max tokens"),
    (["--prompt", "hi", "--max-tokens", "0", "--model", "/no/such/model.gguf"], "max tokens"),   # before the model
    (["--prompt", "abc\udcff"], "not valid Unicode"),          # invalid UTF-8 in argv
    (["--prompt", "hi", "--stop", "\udcff"], "not valid Unicode"),
    (["--prompt", "hi", "--model", ""], "not found"),
    (["--prompt", "hi", "--attestation", ""], "--attestation"),
    (["--prompt", "hi", "--attestation", "/no/such/folder/a.bxa"], "not a readable, writable folder"),
    (["--prompt", "hi", "--attestation", "nodir/"], "not a readable, writable folder"),          # a folder's name
    (["--prompt", "hi", "--attestation", "nodir/../a.bxa"], "not a readable, writable folder"),  # the system resolves nodir
    # a folder that takes no new files even for root, found before the model is opened
    (["--prompt", "hi", "--attestation", "/proc/a.bxa", "--model", "/no/such/model.gguf"],
     "not a readable, writable folder"),
    ([], "--prompt"),
])
def test_run_rejects_bad_requests(art, tmp_path, cwd, args, needle):
    subs = {"NOT_GGUF": write(tmp_path / "model.gguf", b"this is not a GGUF file\n" * 10),
            "EMPTY_FILE": write(tmp_path / "empty.gguf", b"")}
    args = [subs.get(a, a) for a in args]
    if "--max-tokens" not in args:
        args += ["--max-tokens", "2"]
    p = bx(cwd, "run", "--key", art.key, *args, "--device", "cpu")
    assert needle in assert_input_error(p)
    assert listing(cwd) == []                           # no .bxa, no temp file
    assert listing(art.dir) == sorted(["node.pem", "node.pub.pem", os.path.basename(art.bxa)])


def _usable_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_usable_gpu(), reason="this machine has a usable GPU")
@pytest.mark.parametrize("command", ["run", "verify", "serve"])
def test_device_cuda_without_a_usable_gpu_is_one_error_line(art, cwd, command):
    """--device cuda where CuPy is missing or sees no GPU (for serve: GPU ranks,
    --tp 2): exit 2, one line, nothing written."""
    args = {"run": ["--key", art.key, "--prompt", "hi", "--max-tokens", "1"], "verify": [art.bxa],
            "serve": ["--key", art.key, "--tp", "2", "--data-dir", "data"]}[command]
    p = bx(cwd, command, *args, "--device", "cuda", timeout=120)
    line = assert_input_error(p)
    assert "CuPy" in line or "GPU" in line, line
    assert listing(cwd) == []


@pytest.mark.skipif(_usable_gpu(), reason="this machine has a usable GPU")
def test_device_auto_without_a_usable_gpu_runs_on_the_cpu(art, cwd):
    """run's default --device auto where CuPy is missing or sees no GPU: the CPU engine
    runs the request and the attestation says so (tests/test_gpu.py checks the GPU side)."""
    p = bx(cwd, "run", "--key", art.key, "--prompt", "hi", "--max-tokens", "1", "--attestation", "a.bxa")
    assert p.returncode == 0, p.stderr
    with open(cwd / "a.bxa", "rb") as f:
        payload = envelope.open_envelope(f.read(), keys.load_public(art.pub))
    assert payload["backend"] == "cpu" and set(payload["device"]) == {"cpu", "machine", "python"}


def test_run_chat_text_that_is_not_a_json_list_is_one_user_message(art, cwd):
    """--chat "[citation needed] ..." is not JSON: it is sent as one user message."""
    text = "[citation needed] What does this tag mean?"
    p = bx(cwd, "run", "--key", art.key, "--chat", text, "--max-tokens", "1", "--attestation", "a.bxa",
           "--device", "cpu")
    assert p.returncode == 0, p.stderr
    q = bx(cwd, "inspect", "--json", "a.bxa")
    assert json.loads(q.stdout)["request"]["messages"] == [{"role": "user", "content": text}]
    v = bx(cwd, "verify", "a.bxa")
    assert v.returncode == 0 and v.stdout.startswith("OK: 1 token reproduced, output digest "), v.stdout


def test_run_chat_list_with_an_unconvertible_integer_is_one_user_message(art, cwd):
    """--chat "[999...9]" (past Python's 4300-digit int limit, a ValueError, not a
    JSONDecodeError) is one user message too: here too long for --ctx 64, so one
    input error line, exit 2, nothing written."""
    p = bx(cwd, "run", "--key", art.key, "--chat", "[" + "9" * 5000 + "]", "--ctx", "64", "--max-tokens", "1",
           "--attestation", "a.bxa", "--device", "cpu")
    assert "context" in assert_input_error(p)
    assert listing(cwd) == []


def test_run_chat_json_nested_near_the_recursion_limit_is_never_a_traceback(art, cwd):
    """Checking --chat's JSON for a name given twice must not make it nest less deep than
    before: at every depth around Python's recursion limit it is a list that is refused or
    text that is one user message (here the missing model stops it), never a traceback."""
    for depth in range(960, 1001):
        p = bx(cwd, "run", "--key", art.key, "--chat", "[" * depth + "{}" + "]" * depth,
               "--model", "/no/such/model.gguf", "--device", "cpu")
        assert p.returncode == 2 and "Traceback" not in p.stderr, (depth, p.stderr[-300:])
        assert "chat message" in p.stderr or "not found" in p.stderr, (depth, p.stderr)
    assert listing(cwd) == []


def test_run_with_explicit_attestation_path_writes_nothing_on_failure(art, cwd):
    p = bx(cwd, "run", "--key", art.key, "--prompt", "hi", "--top-p", "0", "--attestation", "out.bxa",
           "--device", "cpu")
    assert "top_p" in assert_input_error(p)
    assert listing(cwd) == []


@pytest.mark.parametrize("target", ["key", "public", "passphrase", "model", "fifo", "folder", "symlink"])
def test_run_refuses_to_replace_what_is_not_a_plain_output_file(enc_key, tmp_path, cwd, target):
    """--attestation never replaces the signing key, its public key, its passphrase
    file, the model, a FIFO, a folder or a symlink; the refusal comes before the
    model loads and leaves the target as it was."""
    from node.synth import write_model
    key, pw = str(enc_key / "enc.pem"), str(enc_key / "pass.txt")
    model = write_model(str(tmp_path / "m.gguf"), "tiny", "Q8_0")
    path = {"key": key, "public": str(enc_key / "enc.pub.pem"), "passphrase": pw, "model": model,
            "fifo": str(tmp_path / "fifo"), "folder": str(tmp_path / "dir"), "symlink": str(tmp_path / "link")}[target]
    if target == "fifo":
        os.mkfifo(path)
    elif target == "folder":
        os.mkdir(path)
    elif target == "symlink":
        os.symlink(key, path)
    before = os.lstat(path)
    data = open(key, "rb").read()
    kept = open(path, "rb").read() if os.path.isfile(path) and target != "fifo" else None
    p = bx(cwd, "run", "--key", key, "--passphrase-file", pw, "--model", model, "--prompt", "hi",
           "--attestation", path, "--device", "cpu")
    why = {"key": "it is the --key file", "public": "it is the public key file",
           "passphrase": "it is the --passphrase-file file", "model": "it is the --model file"}.get(
        target, "it is a symbolic link" if target == "symlink" else "it is not a regular file")
    assert assert_input_error(p).endswith(f"refusing to replace {path}: {why}")
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode) and open(key, "rb").read() == data
    assert kept is None or open(path, "rb").read() == kept
    assert listing(cwd) == []


def test_run_refuses_to_replace_the_default_model_by_that_name(art, tmp_path, cwd):
    """Without --model the refusal names the default model, not a flag the user never
    gave. The target is a hard link to the installed file in a scratch folder, so that
    even a broken refusal would only replace the link, never the installed model."""
    from node.gguf_model import default_model_path
    link = str(tmp_path / "model-link.gguf")
    try:
        os.link(default_model_path(), link)
    except OSError as e:
        pytest.skip(f"cannot hard-link the default model here: {e.strerror}")
    p = bx(cwd, "run", "--key", art.key, "--prompt", "hi", "--attestation", link, "--device", "cpu")
    assert assert_input_error(p).endswith(f"refusing to replace {link}: it is the default model file")
    assert os.path.samefile(link, default_model_path()) and listing(cwd) == []


@pytest.mark.parametrize("sigs", [["SIGINT"], ["SIGTERM"], ["SIGTERM", "SIGTERM"], ["SIGINT", "SIGTERM", "SIGINT"]])
def test_run_interrupted_is_exit_130_and_writes_nothing(art, cwd, sigs):
    """One signal or several back to back (an impatient user, `timeout` escalating):
    one line, exit 130."""
    import signal
    import subprocess
    import time
    from test_attest import cli_env
    from node.gguf_model import default_model_path
    p = subprocess.Popen([sys.executable, "-m", "node.cli", "run", "--key", art.key, "--prompt", "Count to 500:",
                          "--max-tokens", "2000", "--device", "cpu"], cwd=cwd, env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    model, end = os.path.realpath(default_model_path()), time.time() + 120
    while time.time() < end and p.poll() is None:   # the model is mapped: the handlers are set, the run is on
        with open(f"/proc/{p.pid}/maps") as f:
            if model in f.read():
                break
        time.sleep(0.1)
    for sig in sigs:
        p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.decode() == "bitexact: interrupted\n", (p.returncode, err)
    assert listing(cwd) == []


def test_run_synthetic_model_without_vocab(art, tmp_path, cwd):
    model = write_model(str(tmp_path / "syn.gguf"), shape=(64, 2, 4, 2, 96, 256), qtype="Q8_0")
    p = bx(cwd, "run", "--key", art.key, "--prompt", "hi", "--model", model, "--max-tokens", "2",
           "--device", "cpu")
    assert "tokenizer" in assert_input_error(p)
    assert listing(cwd) == []


# --------------------------------------------------------------------------
# verify: the real attestation

@pytest.mark.parametrize("args", [["inspect", "ART"], ["--version"], ["--help"], ["run", "--help"]])
@pytest.mark.parametrize("stdout", ["full", "closed"])
def test_an_unwritable_stdout_is_one_error_line(art, stdout, args):
    """stdout on a full device (`> /dev/full`) or closed (`>&-`): one error line, exit 2,
    for a command and for argparse's own --help and --version."""
    import subprocess
    from test_attest import cli_env
    args = [art.bxa if a == "ART" else a for a in args]
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "node.cli", *args], env=cli_env(),
                           stdout=full if stdout == "full" else None, stderr=subprocess.PIPE, timeout=120,
                           preexec_fn=(lambda: os.close(1)) if stdout == "closed" else None)
    err = p.stderr.decode()
    assert p.returncode == 2 and err.count("\n") == 1 and err.startswith("bitexact: error: "), err
    assert ("No space left" in err) if stdout == "full" else ("closed" in err), err


@pytest.mark.parametrize("stderr", ["full", "closed"])
def test_an_unwritable_stderr_loses_only_the_diagnostics(art, cwd, stderr):
    """stderr full (`2>/dev/full`) or closed (`2>&-`): `run` still prints its text, writes
    its attestation and exits 0, `--version` prints; bad input is still exit 2 with
    nothing on stdout (the error line goes nowhere)."""
    import subprocess
    from test_attest import cli_env

    def cli(*args):
        with open("/dev/full", "w") as full:
            return subprocess.run([sys.executable, "-m", "node.cli", *args], env=cli_env(), cwd=cwd, timeout=300,
                                  stdout=subprocess.PIPE, stderr=full if stderr == "full" else None,
                                  preexec_fn=(lambda: os.close(2)) if stderr == "closed" else None)
    p = cli("run", "--key", art.key, "--prompt", "hi", "--max-tokens", "2", "--attestation", "a.bxa", "--device", "cpu")
    assert p.returncode == 0 and p.stdout.endswith(b"\n"), p
    with open(cwd / "a.bxa", "rb") as f:
        payload = envelope.open_envelope(f.read(), keys.load_public(art.pub))
    assert p.stdout.decode() == payload["output"]["text"] + "\n" and listing(cwd) == ["a.bxa"]
    v = cli("--version")
    assert v.returncode == 0 and v.stdout.startswith(b"bitexact "), v
    bad = cli("inspect", "missing.bxa")
    assert bad.returncode == 2 and bad.stdout == b"", bad


@pytest.mark.parametrize("args", [["inspect", "ART"], ["inspect", "MISSING"], ["keygen", "--out", "KEY"]])
def test_stdout_and_stderr_both_full_still_exit_2(art, tmp_path, args):
    """`> /dev/full 2>&1`: the error line cannot be written either, and the exit code
    is still 2 (bad input or output), never 1, which `verify` uses for a mismatch."""
    import subprocess
    from test_attest import cli_env
    sub = {"ART": art.bxa, "MISSING": str(tmp_path / "nope.bxa"), "KEY": str(tmp_path / "k.pem")}
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "node.cli", *[sub.get(a, a) for a in args]], env=cli_env(),
                           stdout=full, stderr=full, timeout=120)
    assert p.returncode == 2, p.returncode


def test_a_deleted_working_folder_is_named(art, tmp_path):
    """Started in a folder that no longer exists: one line naming the working folder, exit 2."""
    import subprocess
    from test_attest import cli_env
    gone = tmp_path / "gone"
    gone.mkdir()
    p = subprocess.run([sys.executable, "-m", "node.cli", "inspect", art.bxa], env=cli_env(),
                       capture_output=True, timeout=120, cwd=gone, preexec_fn=lambda: os.rmdir(gone))
    err = p.stderr.decode()
    assert p.returncode == 2 and err == "bitexact: error: cannot use the working folder: No such file or directory\n", err


@pytest.mark.parametrize("command", ["run", "verify"])
def test_a_bad_cpu_weight_budget_is_one_error_line(art, tmp_path, command):
    """A budget str.isdigit accepts but int() does not ('²'): exit 2, one line naming the variable."""
    from node.backend_cpu import CACHE_ENV
    args = (["--key", art.key, "--prompt", "hi", "--max-tokens", "1"] if command == "run" else [art.bxa])
    p = bx(tmp_path, command, *args, "--device", "cpu", env={CACHE_ENV: "\u00b2"})
    assert CACHE_ENV in assert_input_error(p)
    assert not list(tmp_path.glob("*.bxa"))


def test_overflowing_weights_give_one_error_line_without_numpy_warnings(art, tmp_path):
    """output_norm weights of 1e38 overflow fp32 in the forward pass: numpy's
    RuntimeWarnings stay silent and the run ends with the engine's one NaN line."""
    from test_tokenizer import _copy_with

    from node.gguf_model import default_model_path
    path = str(tmp_path / "inf.gguf")
    _copy_with(default_model_path(), path, fill={"output_norm.weight": 1e38})
    p = bx(tmp_path, "run", "--key", art.key, "--prompt", "hi", "--max-tokens", "2", "--model", path)
    assert "NaN" in assert_input_error(p, code=p.returncode) and p.returncode != 0
    assert not list(tmp_path.glob("*.bxa"))


@pytest.mark.parametrize("as_json", [False, True])
def test_text_the_locale_cannot_encode_is_escaped(art, tmp_path, as_json):
    """`inspect` of an attestation whose output text is not ASCII, under an ASCII-only
    stdout encoding: the text comes out with backslash escapes, exit 0."""
    import subprocess
    from test_attest import cli_env
    write(tmp_path / "u.bxa", sign_raw(_payload_with(art, ("output", "text"), "café 中"), art.private_key()))
    p = subprocess.run([sys.executable, "-m", "node.cli", "inspect", *(["--json"] if as_json else []),
                        str(tmp_path / "u.bxa")], env={**cli_env(), "PYTHONIOENCODING": "ascii"},
                       capture_output=True, timeout=120)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert b"caf\\xe9 \\u4e2d" in p.stdout, p.stdout


def test_a_closed_stdout_pipe_is_exit_141_without_a_traceback(art):
    """`bitexact inspect --json A | head -0`: the reader is gone before the output."""
    import subprocess
    from test_attest import cli_env
    p = subprocess.Popen([sys.executable, "-m", "node.cli", "inspect", "--json", art.bxa], env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"]])
def test_a_closed_stdout_pipe_is_exit_141_for_help_and_version(args):
    """`bitexact --version | true`: argparse's own output to a reader that is gone
    exits 141 like a command's, not 2 with an error line."""
    import subprocess
    from test_attest import cli_env
    p = subprocess.Popen([sys.executable, "-m", "node.cli", *args], env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_verify_ok(art, tmp_path):
    shutil.copy(art.bxa, tmp_path / "a.bxa")
    p = bx(tmp_path, "verify", "a.bxa")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("OK")
    assert art.payload["output"]["digest"].hex() in lines[0]
    assert f"{len(art.payload['output']['tokens'])} tokens" in lines[0]
    # without --trusted-key any valid signer passes: the line names it and says no key was checked
    assert lines[0].endswith(f", signed by key {art.payload['signer']['key_id']} (no --trusted-key given)"), lines[0]
    assert p.stderr == ""
    assert listing(tmp_path) == ["a.bxa"]


def test_verify_ok_with_the_signers_trusted_key(art, tmp_path):
    p = bx(tmp_path, "verify", art.bxa, "--trusted-key", art.pub, "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["result"] == "OK" and rep["message"].startswith("OK")
    assert rep["key_id"] == art.payload["signer"]["key_id"]
    assert rep["message"].endswith(f", signed by the trusted key {rep['key_id']}"), rep["message"]
    assert rep["first_divergent_step"] is None


def test_verify_with_another_trusted_key(art, tmp_path):
    assert bx(tmp_path, "keygen", "--out", "other.pem").returncode == 0
    p = bx(tmp_path, "verify", art.bxa, "--trusted-key", "other.pub.pem")
    assert "not by the trusted key" in assert_input_error(p)
    assert p.stdout == ""


@pytest.mark.parametrize("which", ["missing", "private", "garbage", "empty path", "dsa"])
def test_verify_with_a_bad_trusted_key_file(art, dsa_key, tmp_path, which):
    """Refused before anything is checked: an empty path (an unset shell variable)
    names no key, and must not verify with no trusted key at all; a DSA key is one
    line too (no library warning)."""
    path = {"missing": str(tmp_path / "nope.pub.pem"), "private": art.key,
            "garbage": write(tmp_path / "g.pub.pem", b"garbage"), "empty path": "", "dsa": dsa_key[1]}[which]
    p = bx(tmp_path, "verify", art.bxa, "--trusted-key", path)
    assert "public key" in assert_input_error(p)
    assert p.stdout == ""


# --------------------------------------------------------------------------
# verify: files that are not attestations

def _bad_files(art):
    d = art.data
    files = {f"cut{c}": d[:c] for c in (1, 2, 3, 24, len(d) // 2, len(d) - 65, len(d) - 1)}
    files.update({
        "empty": b"",
        "random": bytes(hashlib.sha256(b"%d" % i).digest()[0] for i in range(700)),
        "json": json.dumps({"format": "bitexact-attestation", "version": 1}).encode(),
        "msgpack_other": canonical.encode({"hello": [1, 2, 3], "b": b"x"}),
        "msgpack_list": canonical.encode(["bitexact-attestation", 1, b"x", b"y" * 32, b"z" * 64]),
        "trailing": d + b"\x00",
    })
    return files


@pytest.mark.parametrize("name", ["cut1", "cut2", "cut3", "cut24", "cut_half", "cut_sig", "cut_last",
                                  "empty", "random", "json", "msgpack_other", "msgpack_list", "trailing"])
def test_verify_rejects_non_attestations(art, tmp_path, name):
    files = _bad_files(art)
    key = {"cut_half": f"cut{len(art.data) // 2}", "cut_sig": f"cut{len(art.data) - 65}",
           "cut_last": f"cut{len(art.data) - 1}"}.get(name, name)
    write(tmp_path / "x.bxa", files[key])
    for cmd in ("verify", "inspect"):
        p = bx(tmp_path, cmd, "x.bxa")
        assert_input_error(p)
        assert p.stdout == ""
    assert listing(tmp_path) == ["x.bxa"]


@pytest.mark.parametrize("target", ["missing", "directory"])
def test_verify_unreadable_attestation(tmp_path, target):
    path = "nope.bxa" if target == "missing" else "."
    assert "cannot read attestation" in assert_input_error(bx(tmp_path, "verify", path))
    assert "cannot read attestation" in assert_input_error(bx(tmp_path, "inspect", path))


# --------------------------------------------------------------------------
# verify: versions, models and tampering

def _payload_with(art, path, value):
    p = copy.deepcopy(art.payload)
    obj = p
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value
    return p


def test_verify_unknown_envelope_version(art, tmp_path):
    _, _, body, pub, sig = split_envelope(art.data)
    write(tmp_path / "v.bxa", canonical.encode([envelope.MAGIC, 2, body, pub, sig]))
    assert "unknown attestation format version 2" in assert_input_error(bx(tmp_path, "verify", "v.bxa"))


@pytest.mark.parametrize("field,value", [("architecture", "gpt2"), ("quant_types", ["F64"]),
                                         ("name", "totally-not-smollm")])
def test_verify_fails_a_model_description_the_file_contradicts(art, tmp_path, field, value):
    """The signed payload's model fields must describe the model file, not only its digest."""
    write(tmp_path / "m.bxa", sign_raw(_payload_with(art, ("model", field), value), art.private_key()))
    p = bx(tmp_path, "verify", "m.bxa")
    assert p.returncode == 1 and p.stdout.strip() == (
        f"FAIL: the attested model description differs from the model file (fields ['{field}'])"), p.stdout


@pytest.mark.parametrize("field,value,message", [("format_version", 2, "unknown payload format version 2"),
                                                 ("contract_version", 3, "unknown determinism-contract version 3")])
def test_verify_unknown_payload_versions(art, tmp_path, field, value, message):
    p = _payload_with(art, (field,), value)
    write(tmp_path / "v.bxa", sign_raw(p, art.private_key()))
    assert message in assert_input_error(bx(tmp_path, "verify", "v.bxa"))
    assert message in assert_input_error(bx(tmp_path, "inspect", "v.bxa"))


def test_verify_with_a_model_of_another_digest(art, tmp_path):
    model = write_model(str(tmp_path / "syn.gguf"), shape=(64, 2, 4, 2, 96, 256), qtype="Q8_0")
    p = bx(tmp_path, "verify", art.bxa, "--model", model)
    msg = assert_input_error(p)
    assert "model digest differs" in msg and art.payload["model"]["sha256"] in msg
    assert p.stdout == ""


@pytest.mark.parametrize("which", ["missing", "not_gguf", "empty path"])
def test_verify_with_a_missing_or_bad_model(art, tmp_path, which):
    """An empty --model names no file (as for run), not the default model."""
    path = {"missing": str(tmp_path / "nope.gguf"), "not_gguf": write(tmp_path / "bad.gguf", b"GGUX" * 64),
            "empty path": ""}[which]
    p = bx(tmp_path, "verify", art.bxa, "--model", path)
    assert_input_error(p)
    assert p.stdout == ""


@pytest.mark.parametrize("path,value,why", [
    (("request", "n_ctx"), 10 ** 11, "context length"),
    (("request", "max_tokens"), 2 ** 63, "max tokens"),
    (("request", "top_k"), -1, "top_k"),
    (("request", "stop"), [""], "stop strings"),
    (("request", "stop"), ["x"] * 17, "at most 16 stop strings"),   # bounds the verifier's work per token
    (("request", "prompt"), "\x04", "encodes to no tokens"),     # a character the vocabulary drops
])
def test_verify_fails_a_signed_request_the_node_would_refuse(art, tmp_path, path, value, why):
    """Step 7 (docs/attestation.md): a validly signed request that cannot be
    rebuilt is a FAIL (exit 1, one line on stdout naming the reason), not a
    usage error."""
    write(tmp_path / "c.bxa", envelope.seal(_payload_with(art, path, value), art.private_key()))
    r = bx(tmp_path, "verify", "c.bxa")
    assert r.returncode == 1 and r.stderr == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL: the attested request cannot be rebuilt: ") and why in lines[0]


def test_a_request_this_machine_cannot_rebuild_is_not_a_fail(art, monkeypatch):
    """A chat template past this machine's limits (time, memory) says nothing about
    the attestation: verify raises (exit 2, "cannot be checked"), it does not FAIL."""
    import verify.verifier as vf
    from node.errors import BitexactError, LimitError

    def slow(*a, **k):
        raise LimitError("chat template failed: it took more than 30 s", "messages")
    monkeypatch.setattr(vf, "build_request", slow)
    with pytest.raises(BitexactError, match="^cannot rebuild the attested request on this machine: chat template"):
        vf.verify_file(art.bxa)


def test_a_context_the_engine_refuses_is_a_fail(art, monkeypatch):
    """A signed context length the engine refuses (past 2**20 positions, for a model
    trained longer) is a request the node would refuse: FAIL, not a usage error."""
    import verify.verifier as vf
    from node.errors import RequestError

    def refuse(*a, **k):
        raise RequestError("the context length must be an integer in [1, 2**20], got 2097152")
    monkeypatch.setattr(vf, "Engine", refuse)
    rep = vf.verify_file(art.bxa)
    assert not rep.ok and rep.message == ("FAIL: the attested request cannot be rebuilt: the context length must "
                                          "be an integer in [1, 2**20], got 2097152")


def test_inspect_and_verify_reject_ext_types_in_a_signed_payload(art, tmp_path):
    import msgpack
    p = _payload_with(art, ("device", "clock"), msgpack.Timestamp(5))
    write(tmp_path / "t.bxa", sign_raw(None, art.private_key(), body=_packb_sorted(p)))
    for args in (["inspect", "t.bxa"], ["inspect", "--json", "t.bxa"], ["verify", "t.bxa"]):
        assert "not canonically encoded" in assert_input_error(bx(tmp_path, *args))


@pytest.mark.parametrize("where", ["array_header", "magic", "version", "payload_first", "payload_mid",
                                   "payload_last", "public_key", "signature_first", "signature_last", "last"])
def test_verify_cli_rejects_single_byte_flips(art, tmp_path, where):
    d = art.data
    _, _, body, pub, sig = split_envelope(d)
    b_at, k_at, s_at = d.index(body), d.rindex(pub), d.rindex(sig)
    i = {"array_header": 0, "magic": 3, "version": 22, "payload_first": b_at, "payload_mid": b_at + len(body) // 2,
         "payload_last": b_at + len(body) - 1, "public_key": k_at + 7, "signature_first": s_at,
         "signature_last": s_at + 63, "last": len(d) - 1}[where]
    if where == "version":
        assert d[i] == 1
    buf = bytearray(d)
    buf[i] ^= 0xFF
    write(tmp_path / "f.bxa", bytes(buf))
    p = bx(tmp_path, "verify", "f.bxa")
    assert_input_error(p)
    assert p.stdout == ""


def test_verify_cli_rejects_a_changed_field_under_the_old_signature(art, tmp_path):
    _, version, body, pub, sig = split_envelope(art.data)
    p = copy.deepcopy(art.payload)
    p["output"]["tokens"][0] += 1
    write(tmp_path / "f.bxa", canonical.encode([envelope.MAGIC, version, canonical.encode(p), pub, sig]))
    assert "bad signature" in assert_input_error(bx(tmp_path, "verify", "f.bxa"))


def test_verify_fails_a_signed_output_whose_step_faults(art, tmp_path):
    """A validly signed claim for a model whose forward pass overflows fp32 (output_norm
    weights of 1e38: NaN logits at the prefill): `run` refuses such a request (exit 2), so no
    honest node signed it; verify says FAIL at step 0 (exit 1, one line on stdout), and
    --json names the step, the attested token and no re-executed one."""
    from test_tokenizer import _copy_with

    from node.gguf_model import default_model_path
    path = str(tmp_path / "nan.gguf")
    _copy_with(default_model_path(), path, fill={"output_norm.weight": 1e38})
    with open(path, "rb") as f:
        p = _payload_with(art, ("model", "sha256"), hashlib.sha256(f.read()).hexdigest())
    write(tmp_path / "n.bxa", envelope.seal(p, art.private_key()))
    r = bx(tmp_path, "verify", "n.bxa", "--model", path)
    assert (r.returncode, r.stderr) == (1, ""), (r.returncode, r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["FAIL: step 0 faulted on re-execution (NaN in logits: the forward pass "
                                     "faulted); the node signs no such output"]
    j = bx(tmp_path, "verify", "n.bxa", "--model", path, "--json")
    rep = json.loads(j.stdout)
    assert (j.returncode, rep["result"], rep["first_divergent_step"], rep["expected_token"], rep["got_token"]) == (
        1, "FAIL", 0, p["output"]["tokens"][0], None)


def test_verify_names_the_step_that_faults_after_matching_steps(art, monkeypatch):
    """A fault in the sampler at the third step (logits / temperature past fp32) after two
    matching steps: FAIL at step 2, with the attested token of that step."""
    import verify.verifier as vf
    from node.engine import Engine
    from node.errors import NumericFault
    real, calls = Engine.sample, []

    def sample(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise NumericFault("logits / temperature 1e-06 overflow fp32")
        return real(self, *a, **k)
    monkeypatch.setattr(Engine, "sample", sample)
    rep = vf.verify_file(art.bxa)
    assert (rep.ok, rep.first_divergent_step, rep.expected_token, rep.got_token) == (
        False, 2, art.payload["output"]["tokens"][2], None)
    assert rep.message == ("FAIL: step 2 faulted on re-execution (logits / temperature 1e-06 overflow fp32); "
                           "the node signs no such output")


def _resealed_with_changed_token(art, k):
    p = copy.deepcopy(art.payload)
    got = p["output"]["tokens"][k]
    forged = got ^ 1
    p["output"]["tokens"][k] = forged
    p["output"]["step_chain"][k] = hashlib.sha256(b"forged step %d" % k).digest()
    blob = envelope.seal(p, art.private_key())
    assert envelope.open_envelope(blob, keys.load_public(art.pub)) == p   # the signature is valid
    return blob, forged, got


def test_verify_fails_on_resigned_changed_output(art, tmp_path):
    k = 1
    blob, forged, got = _resealed_with_changed_token(art, k)
    write(tmp_path / "r.bxa", blob)
    p = bx(tmp_path, "verify", "r.bxa", "--trusted-key", art.pub)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stderr == ""
    lines = p.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0] == f"FAIL: first divergent step {k}: expected token {forged}, got token {got}"


def test_verify_names_a_changed_step_digest_when_the_tokens_agree(art, tmp_path):
    """Only step 2's chain link is forged (tokens untouched): the report names
    the step and says the tokens agree but the step digest differs."""
    p = copy.deepcopy(art.payload)
    k = 2
    p["output"]["step_chain"][k] = hashlib.sha256(b"forged link").digest()
    write(tmp_path / "r.bxa", envelope.seal(p, art.private_key()))
    r = bx(tmp_path, "verify", "r.bxa", "--trusted-key", art.pub)
    assert r.returncode == 1, (r.stdout, r.stderr)
    tok = p["output"]["tokens"][k]
    assert r.stdout.splitlines() == [f"FAIL: first divergent step {k}: token {tok} in both, but the step digest "
                                     f"(logits, or the request it chains from) differs"]


def test_verify_fails_on_resigned_changed_first_token_json(art, tmp_path):
    k = 0
    blob, forged, got = _resealed_with_changed_token(art, k)
    write(tmp_path / "r.bxa", blob)
    p = bx(tmp_path, "verify", "r.bxa", "--json")
    assert p.returncode == 1, (p.stdout, p.stderr)
    rep = json.loads(p.stdout)
    assert rep["result"] == "FAIL"
    assert (rep["first_divergent_step"], rep["expected_token"], rep["got_token"]) == (k, forged, got)
    assert rep["message"].startswith("FAIL") and f"step {k}" in rep["message"]


@pytest.fixture
def forward_calls(monkeypatch):
    """The token counts of each chunk of every engine step run in this process."""
    from node.engine import Engine
    calls, real = [], Engine.forward

    def forward(self, chunks, *args, **kwargs):
        calls.append([len(t) for _, t in chunks])
        return real(self, chunks, *args, **kwargs)
    monkeypatch.setattr(Engine, "forward", forward)
    return calls


def _unbounded_claim(art) -> dict:
    """The attested request with max_tokens 2^31 - 1 in a 16-token context: left to run,
    it would decode until the context is full."""
    p = _payload_with(art, ("request", "max_tokens"), 2 ** 31 - 1)
    p["request"]["n_ctx"] = 16
    return p


def test_verify_stops_at_the_first_divergent_step(art, tmp_path, forward_calls):
    """A re-signed claim of an unbounded request whose step 0 is wrong fails at step 0
    after the one engine step that yields it (the prefill), not after the whole re-execution."""
    from verify.verifier import verify_file
    p = _unbounded_claim(art)
    real = p["output"]["tokens"][0]
    p["output"]["tokens"][0] = real ^ 1
    rep = verify_file(write(tmp_path / "f.bxa", envelope.seal(p, art.private_key())))
    assert (rep.ok, rep.message) == (False, f"FAIL: first divergent step 0: expected token {real ^ 1}, got token {real}")
    assert (rep.first_divergent_step, rep.expected_token, rep.got_token) == (0, real ^ 1, real)
    assert forward_calls == [[len(p["request"]["prompt_tokens"])]]


def test_verify_names_the_output_fields_that_differ_after_every_step_matched(art, tmp_path):
    """A re-signed claim whose steps all reproduce but whose text and finish reason
    are altered: FAIL names those two fields (and only them)."""
    import copy

    from verify.verifier import verify_file
    p = copy.deepcopy(art.payload)
    p["output"]["text"] += "!"
    p["output"]["finish_reason"] = "stop" if p["output"]["finish_reason"] == "length" else "length"
    rep = verify_file(write(tmp_path / "t.bxa", envelope.seal(p, art.private_key())))
    assert (rep.ok, rep.message) == (False, "FAIL: every step matched but the output differs in: text, finish reason")


def test_verify_runs_one_step_past_a_claim_that_stops_early(art, tmp_path, forward_calls):
    """A claim holding the true first 2 steps of an unbounded request, then stopping, is
    re-executed for 3 steps: the 2 that match, and the one that shows it stopped early."""
    from node.engine import Engine
    from node.generate import steps
    from node.gguf_model import default_model_path, load_model
    from node.tokenizer import Tokenizer
    from verify.verifier import verify_file
    p = _unbounded_claim(art)
    model = load_model(default_model_path())
    run = steps(Engine(model, device="cpu", n_ctx=16), Tokenizer(model), p["request"])
    true = [(g.tokens[-1], g.chain[-1]) for g, _ in zip(run, range(3))]
    run.close()
    p["output"].update(tokens=[t for t, _ in true[:2]], step_chain=[c for _, c in true[:2]], finish_reason="stop")
    forward_calls.clear()
    rep = verify_file(write(tmp_path / "s.bxa", envelope.seal(p, art.private_key())))
    assert (rep.ok, rep.message) == (False, f"FAIL: first divergent step 2: expected the end of the output, got token {true[2][0]}")
    assert forward_calls == [[len(p["request"]["prompt_tokens"])], [1], [1]]


# --------------------------------------------------------------------------
# inspect

def _plain(v):
    """Expected JSON form of a payload value: bytes as hex (independent of node.cli)."""
    return json.loads(json.dumps(v, default=lambda b: b.hex()))


def _dict_leaves(obj, prefix=""):
    for k, v in obj.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            yield from _dict_leaves(v, path)
        else:
            yield path


def test_inspect_prints_every_field(art, tmp_path):
    p = bx(tmp_path, "inspect", art.bxa)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"signature: valid (Ed25519, key id {art.payload['signer']['key_id']})"
    shown = {ln.split(": ", 1)[0] for ln in lines[1:]}
    leaves = set(_dict_leaves(art.payload))
    assert leaves == shown
    for name in ("request.prompt", "output.tokens", "output.step_chain", "model.sha256", "signer.key_id",
                 "engine.reference_sha256", "timestamp", "contract_version", "request.temperature"):
        assert name in shown
    assert f"request.prompt: {art.payload['request']['prompt']!r}" in lines
    assert f"output.tokens: {json.dumps(art.payload['output']['tokens'])}" in lines
    assert f"output.digest: '{art.payload['output']['digest'].hex()}'" in lines


def test_inspect_and_verify_refuse_a_message_key_that_is_not_a_field(art, tmp_path):
    """A signed chat message with a key holding a newline, a terminal escape and a forged
    field name is refused at the schema (exit 2), in one escaped line: inspect shows
    only the schema's field names."""
    evil = "cpu\nrequest.prompt: 'forged'\x1b[2K\r"
    p = _payload_with(art, ("request", "mode"), "chat")
    p["request"]["messages"] = [{evil: "x"}]
    write(tmp_path / "k.bxa", sign_raw(p, art.private_key()))
    for args in (["inspect", "k.bxa"], ["verify", "k.bxa"]):
        r = bx(tmp_path, *args)
        assert assert_input_error(r) == ("bitexact: error: k.bxa: field request.messages[0]: missing ['content', "
                                         "'role'] unexpected [\"cpu\\nrequest.prompt: 'forged'\\x1b[2K\\r\"]")
        assert r.stdout == "" and "\x1b" not in r.stderr and "\r" not in r.stderr


@pytest.mark.parametrize("mode,messages,error", [
    ("chat", [{"role": "user", "content": 1}], "field request.messages[0].content has the wrong type"),
    ("chat", [{"role": "user", "content": "hi"}, ["user", "hi"]], "field request.messages[1] must be a map"),
    ("chat", [{"role": "user"}], "field request.messages[0]: missing ['content'] unexpected []"),
    ("chat", [{"role": "user", "content": "hi", "name": "x"}],
     "field request.messages[0]: missing [] unexpected ['name']"),
    ("chat", None, "field request.messages must be an array in chat mode"),
    ("prompt", [{"role": "user", "content": "hi"}], "field request.messages must be nil in prompt mode"),
])
def test_verify_refuses_signed_messages_of_the_wrong_shape(art, tmp_path, mode, messages, error):
    """The attested messages are checked at the schema like every other field: a bad
    shape is a file that cannot be checked (exit 2), not a FAIL."""
    p = _payload_with(art, ("request", "mode"), mode)
    p["request"]["messages"] = messages
    write(tmp_path / "m.bxa", sign_raw(p, art.private_key()))
    for args in (["verify", "m.bxa"], ["inspect", "m.bxa"]):
        assert assert_input_error(bx(tmp_path, *args)) == f"bitexact: error: m.bxa: {error}"


def test_inspect_json_escapes_what_the_plain_form_escapes(art, tmp_path):
    """inspect --json keeps non-ASCII text as it is, but JSON escapes only C0 controls: a C1
    control sequence introducer, a right-to-left override, DEL, a line separator and an
    astral format character are written as \\u escapes too (they were written raw)."""
    stops = ["\x9b31m", "\u202e", "\x7f", "\u2028", "\U000e0001", "caf\u00e9"]
    write(tmp_path / "s.bxa", envelope.seal(_payload_with(art, ("request", "stop"), stops), art.private_key()))
    r = bx(tmp_path, "inspect", "s.bxa", "--json")
    assert r.returncode == 0, r.stderr
    assert not any(c in r.stdout for c in "\x9b\u202e\x7f\u2028\U000e0001"), r.stdout
    assert "caf\u00e9" in r.stdout and json.loads(r.stdout)["request"]["stop"] == stops


def test_inspect_escapes_control_characters_in_lists(art, tmp_path):
    """Stop strings (which the daemon accepts as given) holding a C1 control sequence
    introducer, a right-to-left override and an ESC are printed escaped, like single strings."""
    stops = ["\x9b31m", "\u202e", "\x1b[2J", "plain"]
    write(tmp_path / "s.bxa", envelope.seal(_payload_with(art, ("request", "stop"), stops), art.private_key()))
    r = bx(tmp_path, "inspect", "s.bxa")
    assert r.returncode == 0, r.stderr
    assert not any(c in r.stdout for c in "\x9b\u202e\x1b"), r.stdout
    assert f"request.stop: [{', '.join(map(repr, stops))}]" in r.stdout.splitlines()


@pytest.mark.parametrize("stamp", ["\x1b[2J", "2026-11-30 12:00:00", "2026-11-30T12:00:00+01:00", "2026-13-01T00:00:00Z",
                                   "2024-1-1T1:1:1Z", "2026-11-30t12:00:00z", "\uff12\uff10\uff12\uff16-11-30T12:00:00Z",
                                   "2026-11-30T12:00:00Z\n"])
def test_a_signed_timestamp_that_is_not_rfc3339_utc_is_refused(art, tmp_path, stamp):
    """The time of signing is checked like every other field (seal would refuse it: signed from the internals)."""
    write(tmp_path / "t.bxa", sign_raw(_payload_with(art, ("timestamp",), stamp), art.private_key()))
    for args in (["inspect", "t.bxa"], ["verify", "t.bxa"]):
        assert "RFC 3339" in assert_input_error(bx(tmp_path, *args))


def test_inspect_json(art, tmp_path):
    p = bx(tmp_path, "inspect", "--json", art.bxa)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == _plain(art.payload)


def test_inspect_corrupt(art, tmp_path):
    buf = bytearray(art.data)
    buf[len(buf) // 2] ^= 0x01
    write(tmp_path / "c.bxa", bytes(buf))
    for args in (["inspect", "c.bxa"], ["inspect", "--json", "c.bxa"]):
        p = bx(tmp_path, *args)
        assert_input_error(p)
        assert p.stdout == ""


def test_usage_errors_are_one_line(tmp_path):
    for args in ([], ["frobnicate"], ["verify"], ["run", "--prompt", "x"], ["keygen"]):
        p = bx(tmp_path, *args)
        assert_input_error(p)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("args,needle", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--max-body-bytes", "-1"], "--max-body-bytes"),
    (["--max-tokens-cap", "0"], "--max-tokens-cap"),
    (["--step-tokens", "0"], "--step-tokens"),
    (["--tp", "3"], "tensor-parallel degree"),
    (["--data-dir", "WRONG_STORE"], "attestation store"),
    (["--data-dir", "DIR_STORE"], "attestation store"),
    (["--data-dir", "RANDOM_STORE"], "attestation store"),
])
def test_serve_rejects_bad_options_and_foreign_stores(art, tmp_path, args, needle):
    """Bad options give one error line before the model loads; a store with
    another table, a store path that is a folder, and a store file of random
    bytes give one error line after the node starts listening (on a free port,
    so that a daemon already on the default port cannot answer first)."""
    import socket
    import sqlite3
    db = sqlite3.connect(tmp_path / "attestations.sqlite3")
    db.execute("CREATE TABLE attestations (x)")
    db.close()
    (tmp_path / "dir" / "attestations.sqlite3").mkdir(parents=True)
    (tmp_path / "rnd").mkdir()
    (tmp_path / "rnd" / "attestations.sqlite3").write_bytes(hashlib.sha256(b"x").digest() * 256)
    where = {"WRONG_STORE": tmp_path, "DIR_STORE": tmp_path / "dir", "RANDOM_STORE": tmp_path / "rnd"}
    args = [str(where.get(a, a)) for a in args]
    if "--port" not in args:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args += ["--port", str(s.getsockname()[1])]
    p = bx(tmp_path, "serve", "--key", art.key, "--device", "cpu", *args, timeout=120)
    assert needle in assert_input_error(p)


def test_serve_refuses_a_foreign_store_behind_damaged_rows(art, tmp_path):
    """Damaged earliest rows (a blob that is no attestation, a row holding an integer)
    do not hide that the attestations after them are another key's: refused at start."""
    from node.store import AttestationStore
    from test_store_and_models import plant
    store = AttestationStore(str(tmp_path / "data"))
    junk = b"\x92\x01\x02"
    store.put(hashlib.sha256(junk).hexdigest(), "t", "d", junk)
    store.close()
    plant(tmp_path / "data", "ab" * 32, 12345)
    plant(tmp_path / "data", hashlib.sha256(art.data).hexdigest(), art.data)
    assert bx(tmp_path, "keygen", "--out", "other.pem").returncode == 0
    p = bx(tmp_path, "serve", "--key", "other.pem", "--device", "cpu", "--port", "0", "--data-dir", tmp_path / "data",
           timeout=120)
    assert f"signed by key id {art.payload['signer']['key_id']}" in assert_input_error(p)


@pytest.mark.parametrize("where", ["busy port", "bad host", "host name past IDNA's limits"])
def test_serve_that_cannot_listen_fails_cleanly_without_a_banner_or_a_store(art, tmp_path, where):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = {"busy port": ["--port", s.getsockname()[1]], "bad host": ["--host", "256.1.1.1"],
                "host name past IDNA's limits": ["--host", "a" * 64 + ".example"]}[where]
        p = bx(tmp_path, "serve", "--key", art.key, "--device", "cpu", *addr, "--data-dir", tmp_path / "data",
               timeout=120)
    assert "cannot listen" in assert_input_error(p)
    assert "bitexact serve:" not in p.stdout
    assert not (tmp_path / "data").exists()          # exit 2 writes nothing: the store is opened after listening


def test_inspect_json_and_verify_refuse_a_signed_nan(art, tmp_path):
    write(tmp_path / "nan.bxa", sign_raw(_payload_with(art, ("request", "temperature"), float("nan")),
                                         art.private_key()))
    assert "non-finite" in assert_input_error(bx(tmp_path, "inspect", "nan.bxa", "--json"))
    r = bx(tmp_path, "verify", "nan.bxa")          # signed, so step 7 judges it: FAIL, exit 1
    assert r.returncode == 1 and r.stderr == "", (r.returncode, r.stdout, r.stderr)
    assert r.stdout.startswith("FAIL: the attested request cannot be rebuilt: temperature")


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_signed_negative_zero_is_not_canonical(art, tmp_path, field):
    """-0.0 in a signed request (seal would refuse it: signed from the internals) is refused
    at the schema by verify and inspect alike, exit 2: it is not the request 0.0 is."""
    write(tmp_path / "z.bxa", sign_raw(_payload_with(art, ("request", field), -0.0), art.private_key()))
    for args in (["verify", "z.bxa"], ["inspect", "z.bxa"]):
        assert assert_input_error(bx(tmp_path, *args)) == (f"bitexact: error: z.bxa: field request.{field} is -0.0, "
                                                            f"which is not canonical (0.0 is)")


@pytest.mark.parametrize("args,what", [
    (["verify", "FIFO"], "attestation"),
    (["inspect", "FIFO"], "attestation"),
    (["verify", "ART", "--trusted-key", "FIFO"], "public key"),
    (["run", "--key", "FIFO", "--prompt", "hi", "--device", "cpu"], "key"),
    (["run", "--key", "KEY", "--passphrase-file", "FIFO", "--prompt", "hi", "--device", "cpu"], "passphrase file"),
    (["keygen", "--out", "new.pem", "--passphrase-file", "FIFO"], "passphrase file"),
])
def test_a_fifo_input_is_refused_without_waiting_for_a_writer(art, tmp_path, args, what):
    """Every file the CLI reads must be a regular file, as --attestation must be: a FIFO
    with no writer is refused at once (exit 2) instead of blocking the command forever."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = [{"FIFO": str(fifo), "ART": art.bxa, "KEY": art.key}.get(a, a) for a in args]
    line = assert_input_error(bx(cwd, *args, timeout=120))   # a blocked command fails here, by its timeout
    assert line.endswith(f"cannot read {what} {fifo}: not a regular file"), line
    assert listing(cwd) == []


def test_a_device_input_is_refused(art, tmp_path):
    """A device (here /dev/zero, which never ends) is refused like a FIFO, before it is read."""
    assert assert_input_error(bx(tmp_path, "verify", "/dev/zero")) == ("bitexact: error: cannot read attestation "
                                                                       "/dev/zero: not a regular file")


def test_one_launch_is_accepted_and_ignored_on_the_cpu(art, tmp_path):
    """``run --one-launch`` (an operator's choice of how a GPU runs F16/BF16 models)
    is accepted on the CPU, which ignores it: the same output digest."""
    digests = []
    for extra in ((), ("--one-launch",)):
        p = bx(tmp_path, "run", "--key", art.key, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu", "--json",
               "--attestation", tmp_path / f"a{len(extra)}.bxa", *extra)
        assert p.returncode == 0, p.stderr
        digests.append(json.loads(p.stdout)["output_digest"])
    assert digests[0] == digests[1]


def test_run_help_states_the_stop_limits_the_request_enforces(capsys):
    """`run --help` names the limits of --stop that node/generate.py enforces."""
    from node.cli import main
    from node.generate import MAX_STOP_CHARS, MAX_STOP_STRINGS
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert f"at most {MAX_STOP_CHARS} characters (repeatable, up to {MAX_STOP_STRINGS} times)" in text
