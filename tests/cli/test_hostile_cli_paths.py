"""Hostile paths for ``bigper verify PATH`` and ``bigper info PATH`` (``bigper/cli/paths.py``,
``bigper/cli/__init__.py``), run as the real command in a subprocess: a FIFO named ``.pkl``, a symlink
to a pickle, a sparse 10 GB ``x.pkl``, pickles of other protocols, truncated, random, or whose
``__reduce__`` would run code, an empty folder, a symlink loop, a chmod-000 folder, a folder
of 10,000 empty subfolders.

Each case: the exit code is 0, 1 or 2, no traceback, it finishes within its timeout, and
nothing in the folder is created or changed.

Most calls run in one child interpreter between them (tests/_child_batch.py: each call its own
``python -m bigper`` run with its own argv, the same cwd, environment and stdin, reported apart,
its folder's listing taken right before the call and right after what its exit does, its time
bounded as before; a hang or a crash ends only its own call). A case whose point is the process
itself keeps a ``python -m bigper`` of its own: a FIFO that would block, an "answers at once"
time limit on the whole command, a command run as another user."""

from __future__ import annotations

import functools
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from tests._child_batch import CaseResult, run_batch

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("verify", "info")


def cli(*args, timeout=20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bigper", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          stdin=subprocess.DEVNULL)


def listing(top: Path) -> dict:
    """Every entry below ``top`` (symlinks not followed): its mode, size and mtime."""
    out = {}
    for d, dirs, files in os.walk(top, followlinks=False):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    st = os.lstat(top)
    out["."] = (st.st_mode, st.st_mtime_ns)
    return out


def check(command: str, target: Path, top: Path, timeout: float = 20, within: float | None = None):
    before = listing(top)
    t0 = time.monotonic()
    r = cli(command, target, timeout=timeout)
    took = time.monotonic() - t0
    assert r.returncode in (0, 1, 2), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "Traceback" not in r.stdout, r.stdout
    if within is not None:
        assert took < within, (took, r.stderr)
    assert listing(top) == before
    return r


# -- the batch -------------------------------------------------------------------------------

class Call(NamedTuple):
    """One ``bigper COMMAND TARGET`` of a batched case, checked as ``check`` checks it."""
    command: str
    target: Path
    top: Path
    timeout: float = 20
    within: float | None = None


# test name -> its preparation: (its folder, its parameters) -> its calls, in order
PREPARE: dict[str, Callable[..., list[Call]]] = {}
AFTER_BATCH: list[Callable[[], None]] = []  # what a preparation undoes once the batch has run


def prepares(test_name: str):
    def register(fn):
        PREPARE[test_name] = fn
        return fn
    return register


# ``python -m bigper COMMAND TARGET`` with ``listing(top)`` taken right before the call and right
# after what its exit does, and the time between (pickled to a file of the parent's).
BATCH_CLI = """
import pickle, runpy, sys, time
from tests.cli.test_hostile_cli_paths import listing
top, prints = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
before = listing(top)
t0 = time.monotonic()


def after_exit():
    took = time.monotonic() - t0
    with open(prints, "wb") as f:
        pickle.dump((before, listing(top), took), f)


runpy.run_module("bigper", run_name="__main__", alter_sys=True)
"""


class Batch:
    """What ``batch`` prepared and what its child runs said, per case (a test's ``request.node.name``)."""

    def __init__(self, folders, calls, errors, results):
        self.folders, self.calls, self.errors, self.results = folders, calls, errors, results

    def folder(self, request) -> Path:
        """The requesting case's folder (what its ``tmp_path`` was)."""
        if request.node.name in self.errors:
            raise self.errors[request.node.name]
        return self.folders[request.node.name]

    def check(self, request) -> list[CaseResult]:
        """The requesting case's calls, each checked as ``check`` checks a call."""
        self.folder(request)
        out = []
        for call, (r, prints) in zip(self.calls[request.node.name], self.results[request.node.name]):
            if r.timed_out:
                pytest.fail(f"bigper {call.command} {call.target} still ran after {call.timeout} s (a hang)")
            assert r.returncode in (0, 1, 2), (r.returncode, r.stdout, r.stderr)
            assert "Traceback" not in r.stderr, r.stderr
            assert "Traceback" not in r.stdout, r.stdout
            assert prints is not None, (r.returncode, r.stdout, r.stderr)
            before, after, took = prints
            if call.within is not None:
                assert took < call.within, (took, r.stderr)
            assert after == before
            out.append(r)
        return out


@pytest.fixture(scope="module")
def batch(request, tmp_path_factory) -> Batch:
    """Every selected case of the tests of PREPARE, prepared each in a fresh folder of its own and
    its calls run in one batch of children (one per timeout), in the order of the session."""
    folders, calls, errors = {}, {}, {}
    try:
        for item in request.session.items:
            if getattr(item, "module", None) is not request.module or \
                    getattr(item, "originalname", None) not in PREPARE:
                continue
            folders[item.name] = tmp = tmp_path_factory.mktemp(item.originalname[5:40])
            try:
                calls[item.name] = PREPARE[item.originalname](tmp, **item.callspec.params)
            except Exception as e:  # noqa: BLE001 -- raised by that case's test
                errors[item.name] = e
        prints = tmp_path_factory.mktemp("prints")
        names = {(key, i): re.sub(r"[^\w.\[\]-]", "_", key) + f".{i}"  # (case names: no spaces)
                 for key, cs in calls.items() for i in range(len(cs))}
        results = {}
        for timeout in sorted({c.timeout for cs in calls.values() for c in cs}):
            results.update(run_batch(BATCH_CLI, {
                names[key, i]: [c.top, prints / names[key, i], c.command, c.target]
                for key, cs in calls.items() for i, c in enumerate(cs) if c.timeout == timeout},
                env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=timeout))
    finally:
        while AFTER_BATCH:
            AFTER_BATCH.pop()()
    out = {}
    for key, cs in calls.items():
        out[key] = []
        for i in range(len(cs)):
            f = prints / names[key, i]
            out[key].append((results[names[key, i]], pickle.loads(f.read_bytes()) if f.exists() else None))
    return Batch(folders, calls, errors, out)


# -- files -----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_a_fifo_named_pkl_does_not_hang(tmp_path, command):
    fifo = tmp_path / "replay_buffer.pkl"
    os.mkfifo(fifo)
    r = check(command, fifo, tmp_path, within=15)
    assert r.returncode != 0


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_holding_a_fifo_pkl_does_not_hang(tmp_path, command):
    os.mkfifo(tmp_path / "replay_buffer.pkl")
    check(command, tmp_path, tmp_path, within=15)


def _plain_pickle(path: Path, protocol: int) -> None:
    path.write_bytes(pickle.dumps({"format": "x", "snapshot": "/nowhere", "manifest_sha256": "0" * 64},
                                  protocol=protocol))


@prepares("test_a_symlink_to_a_pickle")
def _symlink_to_a_pickle(tmp_path, command):
    real = tmp_path / "real.pkl"
    _plain_pickle(real, 5)
    link = tmp_path / "link.pkl"
    link.symlink_to(real)
    return [Call(command, link, tmp_path)]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_symlink_to_a_pickle(batch, request, command):
    r, = batch.check(request)
    assert r.returncode != 0


@pytest.mark.parametrize("command", COMMANDS)
def test_a_sparse_10gb_pkl_answers_at_once(tmp_path, command):
    big = tmp_path / "x.pkl"
    with open(big, "wb") as f:
        f.truncate(10 * 2**30)
    r = check(command, big, tmp_path, within=10)
    assert r.returncode != 0


@prepares("test_a_pickle_of_each_protocol_is_refused_cleanly")
def _pickle_of_a_protocol(tmp_path, protocol):
    p = tmp_path / "replay_buffer.pkl"
    _plain_pickle(p, protocol)
    return [Call("verify", p, tmp_path)]


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_of_each_protocol_is_refused_cleanly(batch, request, protocol):
    r, = batch.check(request)
    assert r.returncode == 2, (r.stdout, r.stderr)


@prepares("test_a_broken_pickle")
def _broken_pickle(tmp_path, command, kind):
    p = tmp_path / "replay_buffer.pkl"
    whole = pickle.dumps({"format": "bigper.sb3/1", "snapshot": "/nowhere", "manifest_sha256": "0" * 64,
                          "cls": "bigper.integrations.sb3"}, protocol=4)
    p.write_bytes({"truncated": whole[: len(whole) // 2], "random": os.urandom(4096), "empty": b"",
                   "text": b"hello\n" * 100}[kind])
    return [Call(command, p, tmp_path)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["truncated", "random", "empty", "text"])
def test_a_broken_pickle(batch, request, command, kind):
    r, = batch.check(request)
    assert r.returncode != 0


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _marker(tmp_path: Path) -> Path:
    return tmp_path.parent / f"{tmp_path.name}-MARKER"


@prepares("test_a_pickle_whose_reduce_runs_code_never_runs_it")
def _pickle_whose_reduce_runs_code(tmp_path, command, protocol):
    marker = _marker(tmp_path)
    d = tmp_path / "ckpt"
    d.mkdir()
    p = d / "replay_buffer.pkl"
    # it also names what the drop-in's pickle names, so the reader goes as far as it can
    p.write_bytes(pickle.dumps({"x": "bigper.integrations.sb3", "format": "bigper.sb3/1",
                                "snapshot": str(tmp_path / "snap"), "manifest_sha256": "0" * 64,
                                "evil": _Evil(str(marker))}, protocol=protocol))
    return [Call(command, p, d), Call(command, d, d)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_pickle_whose_reduce_runs_code_never_runs_it(batch, request, command, protocol):
    batch.check(request)  # both calls: the pickle, then its folder
    assert not _marker(batch.folder(request)).exists()


# -- folders ---------------------------------------------------------------------------------

@prepares("test_an_empty_folder")
def _empty_folder(tmp_path, command):
    d = tmp_path / "empty"
    d.mkdir()
    return [Call(command, d, tmp_path)]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_folder(batch, request, command):
    r, = batch.check(request)
    assert r.returncode == 2, (r.stdout, r.stderr)


@prepares("test_a_folder_that_is_a_symlink_loop")
def _folder_that_is_a_symlink_loop(tmp_path, command):
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    return [Call(command, a, tmp_path, within=15)]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_that_is_a_symlink_loop(batch, request, command):
    r, = batch.check(request)
    assert r.returncode != 0


@prepares("test_a_folder_with_a_self_loop_inside")
def _folder_with_a_self_loop_inside(tmp_path, command):
    d = tmp_path / "run"
    d.mkdir()
    (d / "loop").symlink_to(d)
    (d / "deeper").mkdir()
    (d / "deeper" / "up").symlink_to(tmp_path)
    return [Call(command, d, tmp_path, within=15)]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_with_a_self_loop_inside(batch, request, command):
    r, = batch.check(request)
    assert r.returncode != 0


@prepares("test_an_unreadable_folder")
def _unreadable_folder(tmp_path, command):
    d = tmp_path / "locked"
    d.mkdir()
    (d / "sub").mkdir()
    d.chmod(0)
    AFTER_BATCH.append(lambda: d.chmod(0o755))
    return [Call(command, d, tmp_path)]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreadable_folder(batch, request, command):
    r, = batch.check(request)
    assert r.returncode != 0


@prepares("test_a_folder_with_10000_empty_subfolders")
def _folder_with_10000_empty_subfolders(tmp_path, command):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(10_000):
        (d / f"s{i:05d}").mkdir()
    return [Call(command, d, tmp_path, timeout=60, within=30)]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_with_10000_empty_subfolders(batch, request, command):
    r, = batch.check(request)
    assert r.returncode == 2, (r.stdout, r.stderr)


@functools.cache
def _nobody_imports_bigper() -> subprocess.CompletedProcess:
    """Whether ``nobody`` can import this checkout at all (asked once, for both commands)."""
    import tempfile

    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           "import bigper"], capture_output=True, text=True, timeout=60, cwd="/",
                          stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                         "NUMBA_CACHE_DIR": tempfile.gettempdir()})


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreadable_folder_as_a_user_who_cannot_read_it(command):
    """As root, chmod 000 reads anyway; run the command as ``nobody`` so that it really cannot."""
    import shutil
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as nobody")
    probe = _nobody_imports_bigper()
    if probe.returncode != 0:  # a checkout in a 0700 folder (CI's): nobody cannot import bigper at all
        pytest.skip(f"nobody cannot import this checkout: {probe.stderr.strip()[-200:]}")
    top = Path(tempfile.mkdtemp(prefix="bigper-hostile-"))
    try:
        top.chmod(0o777)
        (top / "locked" / "sub").mkdir(parents=True)
        (top / "part" / "no").mkdir(parents=True)
        (top / "part" / "ok").mkdir()
        (top / "locked").chmod(0)
        (top / "part" / "no").chmod(0)
        for target in (top / "locked", top / "locked" / "sub", top / "part"):
            before = listing(top)
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                "-m", "bigper", command, str(target)], capture_output=True, text=True, timeout=20,
                               cwd="/", stdin=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(top / ".nc")})
            if "Permission denied" in r.stderr and "bigper" not in r.stderr:
                pytest.skip("nobody cannot run this interpreter")
            assert r.returncode == 2, (target, r.returncode, r.stdout, r.stderr)
            assert "Traceback" not in r.stderr + r.stdout, r.stderr
            after = listing(top)
            after.pop(".", None), before.pop(".", None)
            assert {k: v for k, v in after.items() if not k.startswith(".nc")} == \
                {k: v for k, v in before.items() if not k.startswith(".nc")}
    finally:
        for d in (top / "locked", top / "part" / "no"):
            d.chmod(0o755)
        shutil.rmtree(top, ignore_errors=True)


def test_a_pickle_flooded_with_opcodes_answers_at_once(tmp_path):
    p = tmp_path / "replay_buffer.pkl"
    p.write_bytes(b"\x80\x04" + b"N" * (60 << 20) + b".")
    before = listing(tmp_path)
    try:
        r = cli("verify", p, timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("verify of a 60 MiB opcode flood took more than 5 s")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert listing(tmp_path) == before


def _pkl_that_is_no_file(tmp_path, kind):
    p = tmp_path / "replay_buffer.pkl"
    if kind == "a folder named .pkl":
        p.mkdir()
    elif kind == "a symlink to a FIFO":
        os.mkfifo(tmp_path / "fifo")
        p.symlink_to(tmp_path / "fifo")
    else:
        p.symlink_to("/dev/zero")
    return p


# (a symlink to a FIFO, whose open would block the process, runs in a process of its own)
ALONE = "a symlink to a FIFO"


@prepares("test_a_pkl_that_is_no_file")
def _pkl_that_is_no_file_batched(tmp_path, command, kind):
    return [] if kind == ALONE else [Call(command, _pkl_that_is_no_file(tmp_path, kind), tmp_path, within=15)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["a folder named .pkl", "a symlink to a FIFO", "a symlink to /dev/zero"])
def test_a_pkl_that_is_no_file(tmp_path, request, command, kind):
    if kind == ALONE:
        r = check(command, _pkl_that_is_no_file(tmp_path, kind), tmp_path, within=15)
    else:
        r, = request.getfixturevalue("batch").check(request)
    assert r.returncode == 2, (r.stdout, r.stderr)
