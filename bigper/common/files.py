"""File helpers shared by the disk storages and snapshots: safe opening of
untrusted files, locks, durable JSON, preallocation."""

from __future__ import annotations

import contextlib

import errno
import fcntl
import json
import os
import re
import stat
from pathlib import Path

from ..errors import CorruptSnapshotError, StorageLockedError

# Largest JSON file bigper reads (meta.json, a sidecar's meta): far above any it writes.
JSON_LIMIT = 64 << 20


def open_regular(path, flags: int = os.O_RDONLY, *, dir_fd: int | None = None,
                 follow: bool = False, mode: int = 0o644, error=CorruptSnapshotError) -> int:
    """Open ``path`` as a regular file without ever blocking, and return the fd.

    Everything bigper reads from disk is untrusted: a FIFO in place of a data
    file would block ``open``/``read`` forever, a device could be read without
    end, and a symlink could lead outside the directory bigper was given. So
    the file is opened with ``O_NONBLOCK`` (a FIFO opens at once), with
    ``O_NOFOLLOW`` unless ``follow`` (the last component may not be a symlink),
    then ``fstat``-ed: anything but a regular file is closed and refused.
    ``O_NONBLOCK`` is cleared again before returning (it means nothing for a
    regular file, but callers get an ordinary fd).

    Parameters
    ----------
    path : str or Path
        The file; relative to ``dir_fd`` when that is given.
    flags : int
        ``os.open`` flags (``O_RDONLY``, ``O_RDWR | O_CREAT``, ...).
    dir_fd : int, optional
        A directory fd that ``path`` is resolved in.
    follow : bool
        Allow the last component to be a symlink (for paths a user gave, not
        names bigper reads from its own records).
    mode : int
        Permissions of a file that ``O_CREAT`` creates.
    error : type
        The ``BigperError`` class raised for a file that is not regular (or a
        symlink where none may be); ``CorruptSnapshotError`` by default.

    Returns
    -------
    int
        An open fd of a regular file; the caller closes it.

    Raises
    ------
    error
        ``path`` is a FIFO, socket, device, directory or (unless ``follow``) a symlink.
    FileNotFoundError, OSError
        As ``os.open`` raises them otherwise (a missing file is the caller's to word).
    """
    extra = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise error(f"{path} is a symbolic link; bigper opens only regular files it names") from None
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.EWOULDBLOCK, errno.ENODEV, errno.EOPNOTSUPP):
            raise error(f"{path} is not a regular file ({e.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a directory" if stat.S_ISDIR(st.st_mode) else "not a file")
            raise error(f"{path} is {kind}, not a regular file; refused")
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path, *, limit: int = JSON_LIMIT, dir_fd: int | None = None,
                 follow: bool = False, error=CorruptSnapshotError) -> bytes:
    """The bytes of the regular file ``path`` (opened by ``open_regular``);
    ``error`` when it holds more than ``limit`` bytes."""
    fd = open_regular(path, os.O_RDONLY, dir_fd=dir_fd, follow=follow, error=error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{path} has {size} bytes, more than the {limit} bigper ever writes there")
        check_dense(fd, path, error=error)  # read in time bounded by the bytes really on disk
        out = bytearray()
        while len(out) <= limit:
            chunk = os.read(fd, max(1, min(limit + 1 - len(out), 8 << 20)))
            if not chunk:
                break
            out += chunk
        if len(out) > limit:
            raise error(f"{path} grew past {limit} bytes while it was read")
        return bytes(out)
    finally:
        os.close(fd)


# A file may be short of allocated blocks by this much (and by half its size)
# before it is measured for holes; below it, reading holes costs well under a second.
HOLE_SLACK = 64 << 20
_EXTENTS = 1 << 16  # data extents walked at most (2 lseeks each) before a file counts as holes


def _hole_bytes(fd: int, size: int) -> int | None:
    """Bytes of holes in the first ``size`` bytes of ``fd`` (SEEK_DATA/SEEK_HOLE),
    or None when they cannot be counted in bounded time (a file of more than
    ``_EXTENTS`` fragments). Where the system or filesystem cannot tell holes
    from data, every byte counts as data (0)."""
    if not hasattr(os, "SEEK_DATA"):
        return 0
    pos = holes = 0
    for _ in range(_EXTENTS):
        if pos >= size:
            return holes
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos: the rest is one hole
                return holes + size - pos
            return 0 if pos == 0 else None  # no hole reporting here (EINVAL): all data
        holes += min(data, size) - pos
        pos = os.lseek(fd, data, os.SEEK_HOLE)
    return None


def check_dense(fd: int, where, *, error=CorruptSnapshotError) -> None:
    """Refuse the open file ``fd`` when it is mostly holes.

    A sparse file claims any size for a few kilobytes of disk (``truncate -s
    1T``): a size check against ``st_size`` passes, and hashing or copying
    it then reads a terabyte of zeros. bigper never writes one: live memmap
    chunks are fallocated, snapshot files are written in full or hard-linked
    to those chunks (the same inodes). So a file whose holes exceed half its
    size and ``HOLE_SLACK`` is refused, naming its size and allocated bytes.

    The allocated blocks (``st_blocks * 512``) are only the quick test: a
    filesystem that compresses (ZFS, btrfs) reports fewer blocks than the
    size for a legitimate file, so a file short of blocks is measured again
    with ``SEEK_DATA``/``SEEK_HOLE``, which counts compressed data as data.
    What is left is the trade-off: a compressing filesystem that stores
    all-zero blocks as holes (ZFS with compression on) makes a snapshot of a
    mostly empty buffer of more than ``2 * HOLE_SLACK`` bytes look sparse,
    and it is refused; a filesystem without hole reporting counts every
    byte as data, and its sparse files are read (in time linear in their size).
    """
    st = os.fstat(fd)
    size, allocated = st.st_size, st.st_blocks * 512
    allowed = max(size // 2, HOLE_SLACK)
    if size - allocated <= allowed:
        return
    holes = _hole_bytes(fd, size)
    if holes is None or holes > allowed:
        raise error(f"{where} is a sparse file: {size} bytes, of which {allocated} allocated on disk "
                    f"({'unmeasured' if holes is None else holes} bytes of holes); bigper never writes "
                    "files with holes, so it is refused unread")


# Locks this process holds, by (device, inode) of the lock file: flock is per open
# file, so a second open in the same process conflicts like another process would,
# and the error can say that the holder is this very process (a buffer not closed).
_HELD: dict[tuple[int, int], tuple[str, int]] = {}


_LOCK_TRIES = 100  # (opens of a lock file removed under us before giving up)


class FileLock:
    """An flock on ``path``: released by the kernel when the process dies, so
    a killed writer never blocks the next one. Exclusive for writers, shared
    for readers. A writer records its PID in the lock file, so the error of a
    second one can say who holds it.

    A reader opens the file read-only (flock needs no write access), so it
    can read a storage on a read-only filesystem or in a directory it may
    not write. Where the lock file is missing and cannot be created because
    the filesystem is read-only, no writer can exist either: the reader goes
    on without a lock (``fd`` is -1)."""

    def __init__(self, path: Path, *, shared: bool = False, owner=None):
        self.path = Path(path)
        owner = owner if owner is not None else self.path.parent
        self.fd = -1
        # The flock is on the file opened; a holder that removes its lock file at release
        # (convert's DstLock, a storage's lock it made) may unlink it between our open and
        # our flock: then the path names a new file (or none) that a third one can lock
        # too. Locked, the path must still name the file locked; else again.
        for _ in range(_LOCK_TRIES):
            self._lock(shared, owner)
            if self.fd < 0:
                return
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self.key:
                    break
            except OSError:  # (gone, or no longer a path to a file: ELOOP, ENOTDIR)
                pass
            except BaseException:
                self.release()
                raise
            self.release()
        else:
            raise StorageLockedError(f"{owner}: its lock file {self.path} was removed and made again "
                                     f"{_LOCK_TRIES} times while taking it; try again")

    def _lock(self, shared: bool, owner) -> None:
        """Open ``path`` and flock it (``fd``, ``key``), or ``StorageLockedError``."""
        if shared:
            try:
                self.fd = open_regular(self.path, os.O_RDONLY)
            except FileNotFoundError:
                try:
                    self.fd = open_regular(self.path, os.O_RDONLY | os.O_CREAT)
                except OSError as e:
                    if e.errno != errno.EROFS:
                        raise
                    self.key = None
                    return
        else:
            self.fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        st = os.fstat(self.fd)
        self.key = (st.st_dev, st.st_ino)
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            who = self._holder()
            os.close(self.fd)
            self.fd = -1
            raise StorageLockedError(
                f"{owner} is in use by {who} (lock {self.path} is held); one writer per storage "
                "path") from None
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        if not shared:
            try:  # who holds it, for the next one's error; a failure here only loses that line
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass
        _HELD[self.key] = ("a writer" if not shared else "a reader", os.getpid())

    def _holder(self) -> str:
        held = _HELD.get(self.key)
        if held is not None and held[1] == os.getpid():  # (a forked child inherits the dict, not the lock)
            return (f"{held[0]} in this process (pid {os.getpid()}): a buffer on this path "
                    "is still open; close() it first")
        try:
            pid = int(os.pread(self.fd, 32, 0).decode().strip() or "x")
        except (OSError, ValueError, UnicodeDecodeError):
            return "another process (a writer or readers)"
        if pid == os.getpid():  # recorded by a writer of this process that holds it still
            return f"a writer in this process (pid {pid}): a buffer on this path is still open"
        return f"process {pid} (or readers that opened it after that process)"

    @staticmethod
    def holder_pid(path) -> int | None:
        """The PID a live writer recorded in the lock file ``path``, or None
        when no writer holds it (probed with a shared, non-blocking flock)."""
        try:
            fd = open_regular(path, os.O_RDONLY)
        except (OSError, CorruptSnapshotError):
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    return int(os.pread(fd, 32, 0).decode().strip())
                except (OSError, ValueError, UnicodeDecodeError):
                    return -1
            return None
        finally:
            os.close(fd)  # releases a probe lock

    def release(self) -> None:
        if self.fd >= 0:
            _HELD.pop(self.key, None)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync it, rename
    it into place and fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    # A fresh file, never one found under that name: the leftover of an
    # interrupted write (a plain file of ours) is removed; anything else there
    # (a FIFO, a symlink, a hard link to another file) is refused, not written through.
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise CorruptSnapshotError(f"{tmp} is not a leftover of bigper's own (a special file, a "
                                       "symlink or a hard link): refusing to write through it")
        os.unlink(tmp)
    fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:  # (a full disk: the file as it was, and no half-written copy beside it)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, obj) -> None:
    write_durable(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: Path, *, error=CorruptSnapshotError):
    """The JSON in the regular file ``path``; ``error`` for a special file, a
    symlink, a huge file, or bytes that are not JSON (a 100,000-deep list
    included). A missing file raises ``FileNotFoundError``."""
    raw = read_regular(path, error=error)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise error(f"{path} is not valid JSON: {str(e)[:200]}") from None


def preallocate(path: Path, nbytes: int, *, follow: bool = False, new: bool = False) -> None:
    """Create ``path`` with ``nbytes`` really reserved on disk: a full disk is
    an OSError here, never a SIGBUS when a mapped page is first written.

    ``new``: ``path`` must not exist (``O_EXCL``: anything there, a hard link
    or a symlink included, is ``FileExistsError`` with nothing done to it),
    and a file this call made that cannot be reserved goes again."""
    fd = open_regular(path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if new else 0), follow=follow)
    try:
        if nbytes > 0:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:  # ENOSPC, EFBIG: name the file (posix_fallocate's error names nothing)
                if new:
                    os.unlink(path)  # (made by this call: O_EXCL)
                raise OSError(e.errno, f"{e.strerror} (reserving {nbytes:,} bytes)", str(path)) from None
    finally:
        os.close(fd)


# /proc/self/fd/N -> the real path of the directory a HeldDir opened there (for messages).
_HELD_ROOTS: dict[str, str] = {}
_PROC_FD = re.compile(r"/proc/self/fd/\d+")


def real_names(exc: BaseException, where=None) -> BaseException:
    """``exc`` with every ``/proc/self/fd/N`` path of a held directory put back
    as the path the user knows (file operations go through the descriptor; the
    messages should not); an ``OSError`` that names no file (a full disk's
    ENOSPC from a write) names ``where``. Changes ``exc`` in place and returns it."""
    def fix(text):
        if not isinstance(text, str) or "/proc/self/fd/" not in text:
            return text
        return _PROC_FD.sub(lambda m: _HELD_ROOTS.get(m.group(0), m.group(0)), text)

    if isinstance(exc, OSError):
        # str() of an OSError with an errno prints strerror (a message may quote a
        # path there), not args: every one is fixed. (Set only when changed:
        # OSError's str reads a filename set to None as one.)
        for attr in ("filename", "filename2", "strerror"):
            old = getattr(exc, attr, None)
            if fix(old) is not old:
                setattr(exc, attr, fix(old))
    if exc.args:
        exc.args = tuple(fix(a) for a in exc.args)
    if where is not None and isinstance(exc, OSError) and exc.errno is not None and exc.filename is None \
            and str(where) not in str(exc):
        exc.filename = str(where)
    return exc


class HeldDir:
    """A directory held by an ``O_DIRECTORY`` descriptor from the moment a
    storage opens it (promise 11), and ``root``, a path that resolves through
    that descriptor (``/proc/self/fd/N`` on Linux): every file operation made
    under ``root`` lands in the directory that was opened, even after a
    ``chdir``, or after the directory is renamed and another one made under its
    old name. Where ``/proc`` is missing, ``root`` is the absolute path.
    ``path`` (the absolute path given) is for messages and records."""

    def __init__(self, path):
        self.path = Path(os.path.abspath(path))
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        proc = Path(f"/proc/self/fd/{self.fd}")
        try:
            same = os.path.samestat(os.stat(proc), os.fstat(self.fd))
        except OSError:
            same = False
        self.root = proc if same else self.path
        if same:
            _HELD_ROOTS[str(proc)] = str(self.path)

    def gone(self) -> bool:
        """Whether the directory held was deleted (its last name removed)."""
        return self.fd >= 0 and os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        """Let go of the descriptor; ``root`` is the plain path from now on (a
        closed descriptor's number may be reused by another file)."""
        if self.fd >= 0:
            self.root = self.path
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass
