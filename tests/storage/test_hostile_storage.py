"""Hostile storage directories: crafted meta.json and state files, special
files and symlinks in place of every name bigper reads, the safe-open helper
itself, who holds a lock, and ``bigper verify``/``info`` on live storages.

Every refusal is checked against a fingerprint of the directory taken
before it (names, types and bytes of every entry).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import time

import numpy as np
import pytest

import bigper
from bigper import CorruptSnapshotError, StorageLockedError
from bigper.cli import main
from bigper.errors import BigperError, IncompatibleSnapshotError, PathExistsError
from bigper.common.files import FileLock, open_regular, read_json, read_regular, write_json

from tests._storage_cases import AGENT_FIELDS, DISK, AgentPool, open_buffer, where
from tests._hostile_snapshot_cases import deadline, fingerprint


def _add(buf, n):
    for i in range(n):
        buf.add(obs=np.full(3, i, np.float32), reward=np.float32(i), next_obs=np.full(3, i + 1, np.float32))


def _closed_memmap(tmp, n=5):
    path = where("memmap", tmp)
    buf = open_buffer("memmap", path, 16, AGENT_FIELDS)
    _add(buf, n)
    buf.close()
    return path


def _reopen(path):
    return open_buffer("memmap", path, 16, AGENT_FIELDS, mode="resume")


def refused_reopen(exc, path):
    before = fingerprint(path)
    with deadline():
        with pytest.raises(exc):
            _reopen(path)
    assert fingerprint(path) == before


# -- the safe-open helper -------------------------------------------------------------------
def test_open_regular_refuses_every_special_file_at_once(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "sock"))
    (tmp_path / "file").write_bytes(b"data")
    os.symlink(tmp_path / "file", tmp_path / "link")
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "sock", "link", "dir"):
        for flags in (os.O_RDONLY, os.O_RDWR, os.O_WRONLY):
            t0 = time.monotonic()
            with deadline():
                with pytest.raises(CorruptSnapshotError, match=name):
                    os.close(open_regular(tmp_path / name, flags))
            assert time.monotonic() - t0 < 1
    with pytest.raises(CorruptSnapshotError, match="device"):
        open_regular("/dev/zero", follow=True)
    with pytest.raises(PathExistsError):  # the error class is the caller's
        open_regular(tmp_path / "fifo", error=PathExistsError)
    fd = open_regular(tmp_path / "link", follow=True)  # a path a user gave may be a link
    try:
        assert not __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL) & os.O_NONBLOCK
        assert os.read(fd, 10) == b"data"
    finally:
        os.close(fd)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.close(open_regular("file", dir_fd=dfd))
        with pytest.raises(CorruptSnapshotError):
            open_regular("fifo", dir_fd=dfd)
    finally:
        os.close(dfd)
    s.close()


def test_read_json_refuses_huge_deep_and_special_files(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "bad.json").write_bytes(b"\xff{")
    os.mkfifo(tmp_path / "fifo.json")
    for name in ("deep.json", "bad.json", "fifo.json"):
        with deadline():
            with pytest.raises(CorruptSnapshotError):
                read_json(tmp_path / name)
    (tmp_path / "big.json").write_bytes(b" " * 100)
    with pytest.raises(CorruptSnapshotError, match="more than"):
        read_regular(tmp_path / "big.json", limit=10)
    with pytest.raises(CorruptSnapshotError, match="grew past"):  # a size fstat does not tell
        read_regular("/proc/self/status", limit=10, follow=True)
    write_json(tmp_path / "ok.json", {"a": 1})
    assert read_json(tmp_path / "ok.json") == {"a": 1}
    os.unlink(tmp_path / "ok.json")
    os.mkfifo(tmp_path / ".ok.json.tmp")  # a planted temporary: refused, never written through
    with deadline():
        with pytest.raises(CorruptSnapshotError):
            write_json(tmp_path / "ok.json", {"a": 1})


# -- crafted storage records ----------------------------------------------------------------
def _meta_change(path, change):
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    (path / "meta.json").write_text(json.dumps(meta))


META_LIES = {
    "arrays a list": lambda m: m.__setitem__("arrays", [1]),
    "shape 2**32 x 2**32": lambda m: m["arrays"]["obs"].__setitem__("shape", [2**32, 2**32]),
    "shape of 10**30": lambda m: m["arrays"]["obs"].__setitem__("shape", [10**30]),
    "rows a string": lambda m: m["arrays"]["obs"].__setitem__("rows", "16"),
    "dtype object": lambda m: m["arrays"]["obs"].__setitem__("dtype", "|O"),
    "array name escaping": lambda m: m["arrays"].__setitem__("../../x", dict(m["arrays"]["obs"])),
    "a list": lambda m: (m.clear(), m.update({"format": "bigper-memmap", "version": 1, "clean": True,
                                              "arrays": {}, "config": [1]})),
}
# Recorded buffer state: refused by check_state at restore. (The buffer marks the
# directory unclean when it maps it, before its restore runs; the fingerprint is
# not compared for these until buffer.py checks the state before allocating.)
STATE_LIES = {
    "state count -5": lambda m: m["state"].__setitem__("count", -5),
    "state max_leaf nan": lambda m: m["state"].__setitem__("max_leaf", float("nan")),
    "state rng a string": lambda m: m["state"].__setitem__("rng", "x"),
    "state a list": lambda m: m.__setitem__("state", [1]),
}


@pytest.mark.parametrize("case", sorted(META_LIES))
def test_a_crafted_meta_json_gets_bigpers_error_and_changes_nothing(case, tmp_path):
    path = _closed_memmap(tmp_path)
    _meta_change(path, META_LIES[case])
    refused_reopen(BigperError, path)


@pytest.mark.parametrize("case", sorted(STATE_LIES))
def test_a_crafted_recorded_state_is_corrupt(case, tmp_path):
    path = _closed_memmap(tmp_path)
    _meta_change(path, STATE_LIES[case])
    with deadline():
        with pytest.raises(CorruptSnapshotError):
            _reopen(path)


def test_a_lying_state_file_is_corrupt_on_reopen(tmp_path):
    path = _closed_memmap(tmp_path)
    leaves = np.load(path / "state" / "leaves.npy")
    leaves[2] = np.nan
    bio = io.BytesIO()
    np.save(bio, leaves)
    (path / "state" / "leaves.npy").write_bytes(bio.getvalue())
    refused_reopen(CorruptSnapshotError, path)


def test_special_files_and_symlinks_in_a_storage_directory_are_refused_at_once(tmp_path):
    path = _closed_memmap(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    names = ["meta.json", ".lock"] + [f"data/{p.name}" for p in (path / "data").iterdir()] \
        + [f"state/{p.name}" for p in (path / "state").iterdir()]
    for name in names:
        p = path / name
        keep = p.read_bytes()
        for plant in ("fifo", "symlink"):
            os.unlink(p)
            if plant == "fifo":
                os.mkfifo(p)
            else:
                (outside / p.name).write_bytes(keep)
                os.symlink(outside / p.name, p)
            t0 = time.monotonic()
            refused_reopen(BigperError, path)
            assert time.monotonic() - t0 < 2, (name, plant)
            before = fingerprint(path)
            with deadline():
                assert main(["verify", str(path)]) == 1
            assert fingerprint(path) == before
            os.unlink(p)
            p.write_bytes(keep)
    with _reopen(path) as buf:
        assert len(buf) == 5


# -- who holds a lock (item 16) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def agents():
    pool = AgentPool()
    yield pool
    pool.stop()


@pytest.mark.parametrize("kind", DISK)
def test_storage_locked_error_names_this_process_or_the_holders_pid(kind, tmp_path, agents, capsys):
    path = where(kind, tmp_path)
    buf = open_buffer(kind, path, 16, AGENT_FIELDS)
    with pytest.raises(StorageLockedError, match=f"this process \\(pid {os.getpid()}\\)"):
        open_buffer(kind, path, 16, AGENT_FIELDS, mode="resume")
    buf.close()
    agent = agents.take()
    lock = path / ".lock" if kind == "memmap" else path.with_name(path.name + ".lock")
    try:
        assert agent.ask(f"open {kind} {path} writer") == "ok"
        with pytest.raises(StorageLockedError, match=f"process {agent.proc.pid}"):
            open_buffer(kind, path, 16, AGENT_FIELDS, mode="resume")
        assert FileLock.holder_pid(lock) == agent.proc.pid
        # verify: in use, by which PID, a distinct exit code; never "CORRUPT"
        capsys.readouterr()
        assert main(["verify", str(path)]) == 3
        out = capsys.readouterr().out
        assert "IN USE" in out and str(agent.proc.pid) in out and "CORRUPT" not in out, out
        if kind == "memmap":
            assert "layout is consistent" in out, out
    finally:
        agent.kill()
    assert FileLock.holder_pid(lock) is None
    # its writer died: unclean, which verify says (exit 1), and it is not "in use"
    assert main(["verify", str(path)]) == 1
    assert "UNCLEAN" in capsys.readouterr().out


def test_verify_a_closed_storage_is_ok(tmp_path, capsys):
    path = _closed_memmap(tmp_path)
    assert main(["verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("command", ["info", "verify"])
def test_help_shows_the_path_argument(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "path" in out and "snapshot directory" in out, out
    if command == "verify":
        assert "exit status" in out and "3 a live buffer" in out


def test_a_lock_file_that_is_a_fifo_or_symlink_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo.lock")
    (tmp_path / "victim").write_text("x")
    os.symlink(tmp_path / "victim", tmp_path / "link.lock")
    for name in ("fifo.lock", "link.lock"):
        with deadline():
            with pytest.raises(CorruptSnapshotError):
                FileLock(tmp_path / name)
    assert (tmp_path / "victim").read_text() == "x"


def test_incompatible_records_are_bigper_errors():
    assert issubclass(IncompatibleSnapshotError, bigper.BigperError)


def test_a_new_storage_never_writes_into_a_directory_of_foreign_files(tmp_path):
    path = tmp_path / "buf"
    (path / "data").mkdir(parents=True)
    (path / "data" / "obs.bin").write_bytes(b"the user's own obs")  # the very name a chunk would take
    (path / "notes.txt").write_text("x")
    for mode in ("new", "resume"):
        before = fingerprint(path)
        with pytest.raises(PathExistsError, match="data"):
            open_buffer("memmap", path, 16, AGENT_FIELDS, mode=mode)
        assert fingerprint(path) == before
    os.rename(path / "data", tmp_path / "aside")
    open_buffer("memmap", path, 16, AGENT_FIELDS, mode="new").close()  # beside the user's notes: fine
    assert (path / "notes.txt").read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    open_buffer("memmap", empty, 16, AGENT_FIELDS, mode="new").close()  # an empty directory is fine


def test_a_snapshots_root_with_a_planted_lock_or_leftover_link_is_safe(tmp_path):
    from bigper import Snapshots

    root = tmp_path / "snaps"
    root.mkdir()
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("mine")
    os.symlink(tmp_path / "victim", root / ".tmp-snap-00000001-1-abc")  # looks like a leftover
    Snapshots(root)
    assert (tmp_path / "victim" / "keep.txt").read_text() == "mine"
    os.unlink(root / ".lock")
    os.mkfifo(root / ".lock")
    with deadline():
        with pytest.raises(CorruptSnapshotError):
            Snapshots(root).latest() or Snapshots(root).load_latest()


@pytest.mark.parametrize("case", sorted(META_LIES) + sorted(STATE_LIES))
def test_info_on_a_crafted_storage_answers_without_a_traceback(case, tmp_path, capsys):
    path = _closed_memmap(tmp_path)
    _meta_change(path, {**META_LIES, **STATE_LIES}[case])
    before = fingerprint(path)
    assert main(["info", str(path)]) in (0, 1)
    assert main(["verify", str(path)]) == 1
    assert fingerprint(path) == before


def test_a_symlinked_data_or_state_directory_is_refused_on_reopen(tmp_path):
    path = _closed_memmap(tmp_path)
    for sub in ("data", "state"):
        os.rename(path / sub, tmp_path / sub)
        os.symlink(tmp_path / sub, path / sub)
        refused_reopen(CorruptSnapshotError, path)
        os.unlink(path / sub)
        os.rename(tmp_path / sub, path / sub)
    with _reopen(path) as buf:
        assert len(buf) == 5


def test_a_storage_path_through_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(PathExistsError):
            open_buffer("memmap", path, 16, AGENT_FIELDS, mode="new")
    assert (tmp_path / "f").read_text() == "x"


def test_write_durable_never_writes_through_a_planted_hard_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.link(victim, tmp_path / ".meta.json.tmp")  # a hard link planted under bigper's temporary name
    with pytest.raises(CorruptSnapshotError):
        write_json(tmp_path / "meta.json", {"a": 1})
    assert victim.read_text() == "keep me"
    os.unlink(tmp_path / ".meta.json.tmp")
    (tmp_path / ".meta.json.tmp").write_text("half a write")  # an interrupted write of ours: replaced
    write_json(tmp_path / "meta.json", {"a": 1})
    assert read_json(tmp_path / "meta.json") == {"a": 1}


# -- only what bigper created (promise 7) ----------------------------------------------------------
def test_resume_removes_only_its_own_copy_on_write_leftovers(tmp_path):
    """Resume clears the ``.cow`` copies an interrupted copy-on-write left, and
    nothing else: a user's ``data/my-notes.cow`` used to be deleted, and a
    directory ``data/x.cow/`` made resume fail with a raw IsADirectoryError."""
    path = _closed_memmap(tmp_path)
    (path / "data" / "my-notes.cow").write_text("mine")
    (path / "data" / "x.cow").mkdir()
    (path / "data" / "x.cow" / "inside").write_text("also mine")
    (path / "data" / "obs.bin.cow").write_bytes(b"half a copy")  # bigper's own leftover, by name
    with _reopen(path) as buf:
        assert len(buf) == 5
    assert (path / "data" / "my-notes.cow").read_text() == "mine"
    assert (path / "data" / "x.cow" / "inside").read_text() == "also mine"
    assert not os.path.lexists(path / "data" / "obs.bin.cow")


@pytest.mark.parametrize("plant", ["dir", "fifo", "symlink"])
def test_a_leftover_name_that_is_not_a_plain_file_is_refused_untouched(plant, tmp_path):
    """A name bigper gives its copies (``obs.bin.cow``) holding a directory, a
    FIFO or a symlink is not bigper's leftover: refused by name, nothing changed."""
    path = _closed_memmap(tmp_path)
    p = path / "data" / "obs.bin.cow"
    (tmp_path / "victim").write_text("keep")
    if plant == "dir":
        p.mkdir()
        (p / "inside").write_text("keep")
    elif plant == "fifo":
        os.mkfifo(p)
    else:
        os.symlink(tmp_path / "victim", p)
    before = fingerprint(tmp_path)
    with deadline():
        with pytest.raises(PathExistsError, match="obs.bin.cow"):
            _reopen(path)
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("kind", DISK)
@pytest.mark.parametrize("options", [{"takeover": True}, {"read_only": True}, {"compression": "lzf"},
                                     {"random_reads": True}, {"chunk_bytes": 4096}, {"bogus": 1}])
def test_only_the_documented_storage_options_are_taken(kind, options, tmp_path):
    """``storage_options`` used to reach the storage's constructor unfiltered:
    ``{"takeover": True}`` with mode="resume" wiped a 40-transition buffer, and
    ``{"compression": "lzf"}`` on memmap was a raw TypeError. Each storage takes
    its documented options only; any other is named, with nothing changed."""
    path = where(kind, tmp_path)
    with open_buffer(kind, path, 64, AGENT_FIELDS) as buf:
        _add(buf, 40)
    documented = {"memmap": {"random_reads", "chunk_bytes"}, "hdf5": {"compression"}}[kind]
    before = fingerprint(tmp_path)
    if set(options) <= documented:
        with open_buffer(kind, path, 64, AGENT_FIELDS, storage_options=options) as buf:
            assert len(buf) == 40
        return
    with pytest.raises(bigper.InvalidArgumentError, match=f"{next(iter(options))}.*{kind}"):
        open_buffer(kind, path, 64, AGENT_FIELDS, storage_options=options)
    assert fingerprint(tmp_path) == before
    with open_buffer(kind, path, 64, AGENT_FIELDS) as buf:
        assert len(buf) == 40


def test_memory_storage_takes_no_options_and_options_must_be_a_dict(tmp_path):
    with pytest.raises(bigper.InvalidArgumentError, match="random_reads.*memory"):
        bigper.PrioritizedReplayBuffer(8, AGENT_FIELDS, storage_options={"random_reads": True})
    with pytest.raises(bigper.InvalidArgumentError, match="storage_options must be a dict"):
        open_buffer("memmap", where("memmap", tmp_path), 8, AGENT_FIELDS, storage_options=["random_reads"])
    assert not os.path.lexists(where("memmap", tmp_path))


def _fds_into(folder) -> list[str]:
    """This process's open descriptors that lead into ``folder`` (deleted or not)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_a_storage_folder_deleted_while_open_gets_bigpers_error_and_lets_everything_go(kind, tmp_path):
    """``rm -rf`` of a run's folder while its buffer is open (a cleanup script,
    a user in another shell): ``save`` and ``close`` raised a raw
    ``FileNotFoundError`` through ``/proc/self/fd/N``, and memmap's close kept
    its lock, its directory descriptor and its mappings. Now each says which
    path is gone (``PathNotFoundError``, a ``FileNotFoundError`` too), and
    close lets go of everything it held there."""
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / ("r.h5" if kind == "hdf5" else "r")
    buf = bigper.PrioritizedReplayBuffer(16, {"x": ((2,), np.float32)}, storage=kind, path=path, seed=0)
    for i in range(5):
        buf.add(x=np.full(2, i, np.float32))
    shutil.rmtree(folder)
    if kind == "memmap":  # its chunk files are linked into a snapshot, and they are gone
        with pytest.raises(bigper.errors.PathNotFoundError, match=str(path)):
            buf.save(tmp_path / "snap")
        assert not (tmp_path / "snap").exists()
    else:  # the open file still holds every row: the snapshot rescues them
        buf.save(tmp_path / "snap")
        with bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "back.h5") as back:
            assert back.gather(np.arange(5))["x"][:, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(bigper.errors.PathNotFoundError, match=str(path)):
        buf.close()
    assert buf.closed
    assert _fds_into(folder) == []
    buf.close()  # idempotent, silent


def _plant_dir(p):
    p.unlink()
    p.mkdir()


@pytest.mark.parametrize("kind,harm", [
    ("hdf5", "rm"),            # close: PathNotFoundError quoting the inner error's text
    ("memmap", "rm"),
    ("memmap", "dir-meta"),    # close: IsADirectoryError from the rename onto meta.json
])
def test_errors_after_open_name_the_users_path_never_proc_self_fd(kind, harm, tmp_path):
    """Files of an open storage are reached through ``/proc/self/fd/N`` (the
    held directory); no message a user sees may name that. ``close()`` was not
    passed through ``real_names``, and an ``OSError`` with an errno kept its
    ``strerror`` (which ``str()`` prints) unfixed."""
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / ("r.h5" if kind == "hdf5" else "r")
    buf = bigper.PrioritizedReplayBuffer(16, {"x": ((2,), np.float32)}, storage=kind, path=path, seed=0)
    for i in range(5):
        buf.add(x=np.full(2, i, np.float32))
    if harm == "rm":
        shutil.rmtree(folder)
    else:
        _plant_dir(path / "meta.json")
    with pytest.raises(OSError) as info:
        buf.close()
    text = str(info.value) + repr(info.value.args)
    assert "/proc/self/fd" not in text, text
    assert str(folder) in text
    assert buf.closed


def test_real_names_fixes_an_oserror_with_an_errno_and_a_message():
    from bigper.common.files import HeldDir, real_names
    import errno as _errno
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        held = HeldDir(d)
        try:
            e = real_names(OSError(_errno.EIO, f"{held.root}/x: could not record"))
            assert "/proc/self/fd" not in str(e) and f"{d}/x" in str(e), str(e)
        finally:
            held.close()


@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_a_full_disk_in_save_and_close_names_the_path(small_tmpfs, kind):
    """ENOSPC from a write names no file; the error a user sees names the
    snapshot (save) or the storage (close) it was writing."""
    from tests.conftest import fill_disk

    path = small_tmpfs / ("r.h5" if kind == "hdf5" else "r")
    buf = bigper.PrioritizedReplayBuffer(64, {"obs": ((8,), np.float32)}, storage=kind, path=path)
    for i in range(40):
        buf.add(obs=np.full(8, i, np.float32), next_obs=np.full(8, i + 1, np.float32))
    fill_disk(small_tmpfs / "filler")
    with pytest.raises(OSError) as e:
        buf.save(small_tmpfs / "snap")
    assert str(small_tmpfs / "snap") in str(e.value), str(e.value)
    try:
        buf.close()
    except OSError as e:  # a storage that reserved its space may still record its state
        assert str(path) in str(e) and "/proc/self/fd" not in str(e), str(e)
