"""Hostile tests of FileLock's re-check (the path must still name the inode locked)
and of publish.refuse_open on odd dst kinds. Real files, threads and processes."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest

from bigper.common.files import FileLock
from bigper.errors import BigperError, StorageLockedError
from bigper.offline.publish import refuse_open


def _nfds():
    return len(os.listdir("/proc/self/fd"))


def _churn(path: Path, stop: threading.Event, symlink: bool):
    """Replace the lock file in a loop: a fresh regular file, then (symlink) a self-loop symlink."""
    reg, sym = path.with_name("reg"), path.with_name("sym")
    while not stop.is_set():
        reg.write_bytes(b"")
        os.replace(reg, path)
        if symlink:
            try:
                os.symlink(path.name, sym)
            except FileExistsError:
                pass
            os.replace(sym, path)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _hammer(path: Path, seconds: float):
    """Take/release FileLock for ``seconds``; return other exceptions by name."""
    other: dict[str, int] = {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            FileLock(path).release()
        except BigperError:
            pass
        except OSError as e:  # (a vanished path at open is an ordinary FileNotFoundError; anything else counts)
            if not isinstance(e, FileNotFoundError):
                other[f"{type(e).__name__}:{e.errno}"] = other.get(f"{type(e).__name__}:{e.errno}", 0) + 1
    return other


# (Was a strict xfail: the re-check's os.stat raising anything but FileNotFoundError (ELOOP when the
# lock file was swapped for a self-loop symlink after the O_NOFOLLOW open) escaped with the flocked
# fd never closed; any OSError there now means "not the file locked": released, taken again.)
def test_recheck_stat_eloop_leaks_locked_fd(tmp_path):
    p = tmp_path / "x.lock"
    stop = threading.Event()
    t = threading.Thread(target=_churn, args=(p, stop, True))
    n0 = _nfds()  # (counted with the churn thread stopped: it opens files of its own)
    t.start()
    try:
        other = _hammer(p, 1.5)
    finally:
        stop.set()
        t.join()
    leaked = _nfds() - n0
    assert other == {} and leaked == 0, (other, leaked)


def test_recheck_unlink_churn_no_leak(tmp_path):
    """Lock file unlinked/recreated in a loop (a DstLock-style remover): only bigper errors, no fd leak."""
    p = tmp_path / "x.lock"
    stop = threading.Event()
    t = threading.Thread(target=_churn, args=(p, stop, False))
    n0 = _nfds()  # (counted with the churn thread stopped: it opens files of its own)
    t.start()
    try:
        other = _hammer(p, 1.0)
    finally:
        stop.set()
        t.join()
    leaked = _nfds() - n0
    assert other == {} and leaked == 0, (other, leaked)


def _excl_worker(path, counter, seconds, q):
    bad = 0
    t0 = time.monotonic()
    taken = 0
    while time.monotonic() - t0 < seconds:
        try:
            lk = FileLock(Path(path))
        except (StorageLockedError, FileNotFoundError):
            continue
        try:
            taken += 1
            fd = os.open(counter, os.O_RDWR)
            try:
                v = int(os.pread(fd, 16, 0) or b"0")
                if v != 0:
                    bad += 1
                os.pwrite(fd, b"1       ", 0)
                time.sleep(0.0005)
                os.pwrite(fd, b"0       ", 0)
            finally:
                os.close(fd)
        finally:
            # DstLock-style: unlink the lock file while still holding it, then release
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            lk.release()
    q.put((bad, taken))


def test_mutual_exclusion_two_processes_with_remover(tmp_path):
    """Two processes take FileLock on one path, each unlinking the lock file at release (DstLock
    style, while still held) and a third thread creating it anew when missing: never two holders
    inside the critical section together. (A third party that unlinks or replaces a lock file
    someone HOLDS defeats any flock scheme; that is not attacked here.)"""
    p = tmp_path / "d.lock"
    counter = tmp_path / "counter"
    counter.write_bytes(b"0       ")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_excl_worker, args=(str(p), str(counter), 1.5, q)) for _ in range(2)]
    stop = threading.Event()
    def recreate():
        while not stop.is_set():
            try:
                os.close(os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                pass
    t = threading.Thread(target=recreate)
    for pr in procs:
        pr.start()
    t.start()
    try:
        res = [q.get(timeout=30) for _ in procs]
    finally:
        stop.set()
        t.join()
        for pr in procs:
            pr.join(10)
    assert all(b == 0 for b, _ in res), res
    assert sum(n for _, n in res) > 10, res


def test_lock_path_is_directory_or_fifo(tmp_path):
    d = tmp_path / "dir.lock"
    d.mkdir()
    f = tmp_path / "fifo.lock"
    os.mkfifo(f)
    n0 = _nfds()
    for p in (d, f):
        for shared in (False, True):
            with pytest.raises(BigperError):
                FileLock(p, shared=shared)
    assert _nfds() == n0


def test_lock_path_symlink_refused(tmp_path):
    real = tmp_path / "real.lock"
    real.write_bytes(b"")
    s = tmp_path / "s.lock"
    s.symlink_to(real)
    with pytest.raises(BigperError):
        FileLock(s)


def test_relative_path_chdir_between_lock_and_release(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lk = FileLock(Path("rel.lock"))
    os.mkdir(tmp_path / "sub")
    os.chdir(tmp_path / "sub")
    with pytest.raises(StorageLockedError):
        FileLock(tmp_path / "rel.lock")
    lk.release()
    FileLock(tmp_path / "rel.lock").release()


def test_second_exclusive_flock_from_other_process_refused(tmp_path):
    p = tmp_path / "x.lock"
    lk = FileLock(p)
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def probe():
            fd = os.open(p, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                q.put("got")
            except BlockingIOError:
                q.put("busy")
            finally:
                os.close(fd)
        pr = ctx.Process(target=probe)
        pr.start()
        assert q.get(timeout=10) == "busy"
        pr.join(10)
    finally:
        lk.release()


def test_readonly_dir_existing_lock_shared_reader(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    p = tmp_path / "ro" / "x.lock"
    p.parent.mkdir()
    p.write_bytes(b"")
    os.chmod(p, 0o444)
    os.chmod(p.parent, 0o555)
    try:
        lk = FileLock(p, shared=True)
        assert lk.fd >= 0
        lk.release()
    finally:
        os.chmod(p.parent, 0o755)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dir", "missing", "dangling"])
def test_refuse_open_odd_dst(tmp_path, kind):
    dst = tmp_path / "dst.h5"
    if kind == "fifo":
        os.mkfifo(dst)
    elif kind == "symlink":
        (tmp_path / "t.h5").write_bytes(b"x")
        dst.symlink_to(tmp_path / "t.h5")
    elif kind == "dir":
        dst.mkdir()
    elif kind == "dangling":
        dst.symlink_to(tmp_path / "nope")
    n0 = _nfds()
    t0 = time.monotonic()
    try:
        assert refuse_open(dst) is None
    except BigperError:
        pass
    assert time.monotonic() - t0 < 2
    assert _nfds() == n0


def test_refuse_open_held_by_flock(tmp_path):
    dst = tmp_path / "dst.h5"
    dst.write_bytes(b"x")
    fd = os.open(dst, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(StorageLockedError):
            refuse_open(dst)
    finally:
        os.close(fd)
    assert refuse_open(dst) is None


def _ro_bind(tmp_path):
    import subprocess
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root for a read-only bind mount")
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("bind mount not allowed here")
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(ro)])
        pytest.skip("read-only remount not allowed here")
    return src, ro


def test_erofs_shared_reader_no_lock_file_and_existing(tmp_path):
    import subprocess
    src, ro = _ro_bind(tmp_path)
    try:
        n0 = _nfds()
        lk = FileLock(ro / "none.lock", shared=True)  # no lock file, cannot be made: no writer either
        assert lk.fd == -1
        lk.release()
        (src / "has.lock").write_bytes(b"")
        lk = FileLock(ro / "has.lock", shared=True)
        assert lk.fd >= 0
        lk2 = FileLock(ro / "has.lock", shared=True)  # two readers together
        # a writer through the writable name is refused while readers hold it
        with pytest.raises(StorageLockedError):
            FileLock(src / "has.lock")
        lk2.release()
        lk.release()
        with pytest.raises(OSError):
            FileLock(ro / "w.lock")  # a writer on a read-only fs: EROFS, not a silent no-lock
        assert _nfds() == n0
    finally:
        subprocess.run(["umount", str(ro)])


def test_memmap_writer_and_reader_threads_loop(tmp_path):
    """A writer and a reader buffer on one memmap path, opened/closed in a loop from two threads:
    nothing but StorageLockedError, both get in, no fd leaked."""
    import numpy as np

    from bigper import PrioritizedReplayBuffer
    path = tmp_path / "buf"
    fields = {"obs": (4, np.float32)}
    PrioritizedReplayBuffer(16, fields, storage="memmap", path=path).close()
    errs: dict[str, int] = {}
    oks = {True: 0, False: 0}
    n0 = _nfds()

    def loop(ro):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            try:
                PrioritizedReplayBuffer(16, fields, storage="memmap", path=path, mode="resume",
                                        read_only=ro).close()
                oks[ro] += 1
            except StorageLockedError:
                pass
            except Exception as e:  # noqa: BLE001
                k = f"{type(e).__name__}: {str(e)[:120]}"
                errs[k] = errs.get(k, 0) + 1
            time.sleep(0.01 if not ro else 0.001)

    ts = [threading.Thread(target=loop, args=(r,)) for r in (False, True)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errs == {}, errs
    assert oks[True] > 0 and oks[False] > 0, oks
    assert _nfds() == n0
