"""Hostile paths for ``bigper verify PATH`` and ``bigper info PATH`` (``bigper/cli/paths.py``,
``bigper/cli/__init__.py``), run as the real command in a subprocess: a FIFO named ``.pkl``, a symlink
to a pickle, a sparse 10 GB ``x.pkl``, pickles of other protocols, truncated, random, or whose
``__reduce__`` would run code, an empty folder, a symlink loop, a chmod-000 folder, a folder
of 10,000 empty subfolders.

Each case: the exit code is 0, 1 or 2, no traceback, it finishes within its timeout, and
nothing in the folder is created or changed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("command", COMMANDS)
def test_a_symlink_to_a_pickle(tmp_path, command):
    real = tmp_path / "real.pkl"
    _plain_pickle(real, 5)
    link = tmp_path / "link.pkl"
    link.symlink_to(real)
    r = check(command, link, tmp_path)
    assert r.returncode != 0


@pytest.mark.parametrize("command", COMMANDS)
def test_a_sparse_10gb_pkl_answers_at_once(tmp_path, command):
    big = tmp_path / "x.pkl"
    with open(big, "wb") as f:
        f.truncate(10 * 2**30)
    r = check(command, big, tmp_path, within=10)
    assert r.returncode != 0


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_of_each_protocol_is_refused_cleanly(tmp_path, protocol):
    p = tmp_path / "replay_buffer.pkl"
    _plain_pickle(p, protocol)
    r = check("verify", p, tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["truncated", "random", "empty", "text"])
def test_a_broken_pickle(tmp_path, command, kind):
    p = tmp_path / "replay_buffer.pkl"
    whole = pickle.dumps({"format": "bigper.sb3/1", "snapshot": "/nowhere", "manifest_sha256": "0" * 64,
                          "cls": "bigper.integrations.sb3"}, protocol=4)
    p.write_bytes({"truncated": whole[: len(whole) // 2], "random": os.urandom(4096), "empty": b"",
                   "text": b"hello\n" * 100}[kind])
    r = check(command, p, tmp_path)
    assert r.returncode != 0


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_pickle_whose_reduce_runs_code_never_runs_it(tmp_path, command, protocol):
    marker = tmp_path.parent / f"{tmp_path.name}-MARKER"
    d = tmp_path / "ckpt"
    d.mkdir()
    p = d / "replay_buffer.pkl"
    # it also names what the drop-in's pickle names, so the reader goes as far as it can
    p.write_bytes(pickle.dumps({"x": "bigper.integrations.sb3", "format": "bigper.sb3/1",
                                "snapshot": str(tmp_path / "snap"), "manifest_sha256": "0" * 64,
                                "evil": _Evil(str(marker))}, protocol=protocol))
    check(command, p, d)
    check(command, d, d)
    assert not marker.exists()


# -- folders ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_folder(tmp_path, command):
    d = tmp_path / "empty"
    d.mkdir()
    r = check(command, d, tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_that_is_a_symlink_loop(tmp_path, command):
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    r = check(command, a, tmp_path, within=15)
    assert r.returncode != 0


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_with_a_self_loop_inside(tmp_path, command):
    d = tmp_path / "run"
    d.mkdir()
    (d / "loop").symlink_to(d)
    (d / "deeper").mkdir()
    (d / "deeper" / "up").symlink_to(tmp_path)
    r = check(command, d, tmp_path, within=15)
    assert r.returncode != 0


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreadable_folder(tmp_path, command):
    d = tmp_path / "locked"
    d.mkdir()
    (d / "sub").mkdir()
    d.chmod(0)
    try:
        r = check(command, d, tmp_path)
        assert r.returncode != 0
    finally:
        d.chmod(0o755)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_with_10000_empty_subfolders(tmp_path, command):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(10_000):
        (d / f"s{i:05d}").mkdir()
    r = check(command, d, tmp_path, timeout=60, within=30)
    assert r.returncode == 2, (r.stdout, r.stderr)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreadable_folder_as_a_user_who_cannot_read_it(command):
    """As root, chmod 000 reads anyway; run the command as ``nobody`` so that it really cannot."""
    import shutil
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as nobody")
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                            "import bigper"], capture_output=True, text=True, timeout=60, cwd="/",
                           stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                          "NUMBA_CACHE_DIR": tempfile.gettempdir()})
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


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["a folder named .pkl", "a symlink to a FIFO", "a symlink to /dev/zero"])
def test_a_pkl_that_is_no_file(tmp_path, command, kind):
    p = tmp_path / "replay_buffer.pkl"
    if kind == "a folder named .pkl":
        p.mkdir()
    elif kind == "a symlink to a FIFO":
        os.mkfifo(tmp_path / "fifo")
        p.symlink_to(tmp_path / "fifo")
    else:
        p.symlink_to("/dev/zero")
    r = check(command, p, tmp_path, within=15)
    assert r.returncode == 2, (r.stdout, r.stderr)
