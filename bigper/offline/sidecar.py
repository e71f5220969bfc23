"""Priorities of an offline dataset, kept beside it (never inside it).

::

    <dataset>.priorities/
      meta.json              format, version, the dataset's fingerprint, what the files hold
      scores-<run>.f64       raw float64 scores, one per slot: of the last complete
                             reprioritize ("scores"), or of the run in progress, valid
                             up to the slot meta names ("partial"; resumable)
      leaves-<run>.npy       the strategy's keys saved at close after update_priorities
                             (allow_pickle=False): proportional leaves, or rank's clipped priorities
      .lock                  flock of the one writer

``meta.json`` is replaced atomically and names every file it relies on, with
an xxh64 checksum of the bytes it vouches for; a file of bigper's own naming
that it does not name is left over from an interrupted write and is removed by
the next writer. Scores are kept raw, so reopening with another ``alpha`` or
``eps`` transforms them anew; keys saved at close record the prioritization
and the parameters they were made with (proportional: ``alpha``, ``eps``,
``max_priority``; rank: ``max_priority``) and are used only when those match.

Everything in the directory is untrusted (a sidecar can come in a tarball
beside the dataset): ``meta.json`` is checked field by field, the file names it
gives must be names bigper itself makes (``scores-<12 hex>.f64``,
``leaves-<12 hex>.npy``), they are opened with ``O_NOFOLLOW | O_NONBLOCK`` as
regular files only, a file written in place must have one link and not be the
dataset, and only files of bigper's naming are ever deleted.
"""

from __future__ import annotations

import fcntl
import io
import math
import os
import re
import stat
import uuid
from pathlib import Path

import numpy as np

from ..errors import CorruptSnapshotError, PathExistsError, SidecarMismatchError, StorageLockedError
from ..prioritization import KINDS
from ..common.files import fsync_dir, open_regular, read_json, write_durable, write_json

FORMAT = "bigper-priorities"
VERSION = 1

_NAMES = {"scores": re.compile(r"scores-[0-9a-f]{12}\.f64"), "partial": re.compile(r"scores-[0-9a-f]{12}\.f64"),
          "leaves": re.compile(r"leaves-[0-9a-f]{12}\.npy")}
# Every name bigper creates in a sidecar; nothing else there is ever deleted.
_OURS = re.compile(r"(scores-[0-9a-f]{12}\.f64|leaves-[0-9a-f]{12}\.npy|\.meta\.json\.tmp"
                   r"|\.leaves-[0-9a-f]{12}\.npy\.tmp|\.lock|meta\.json)")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_NPY_HEADER = 4096  # more than np.save ever writes before the data of a 1-D float64 array


def _kind(path: Path) -> str:
    """What ``path`` is, for an error (links not followed)."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        try:
            os.stat(path)
        except OSError as e:
            return f"a symbolic link that leads nowhere ({e.strerror})"
        return "a symbolic link to a file"
    return ("a file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a directory")


def _xxh(data) -> str:
    import xxhash

    return xxhash.xxh64(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    """A finite JSON number as a writer records one: a float, or an int a float
    holds exactly (2**1100 would overflow math.isfinite; a bool is no number)."""
    if isinstance(v, float):
        return math.isfinite(v)
    return _is_int(v) and -(1 << 53) <= v <= 1 << 53


def key_params(kind: str, alpha: float, eps: float, max_priority) -> dict:
    """What the keys of a strategy of ``kind`` depend on (rank keys are clipped priorities)."""
    if kind == "rank":
        return {"prioritization": kind, "max_priority": max_priority}
    return {"prioritization": kind, "alpha": alpha, "eps": eps, "max_priority": max_priority}


class Sidecar:
    """The priorities directory of one dataset.

    Parameters
    ----------
    path : Path
        The directory (created on the first write only).
    fingerprint : dict
        The dataset's ``H5Source.fingerprint()``.
    rows : int
        Slots (one score per slot).
    protect : tuple of (int, int), optional
        ``(st_dev, st_ino)`` of the dataset's file: a sidecar file that is the
        dataset (a hard link) is never opened for writing.
    """

    def __init__(self, path, fingerprint: dict, rows: int, protect=None):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.rows = int(rows)
        self.protect = protect
        self.meta = None
        self._lock_fd = -1
        self._scores_fd, self._scores_name = -1, None

    @staticmethod
    def default_path(dataset) -> Path:
        p = Path(dataset).expanduser().absolute()
        return p.with_name(p.name + ".priorities")

    # -- reading -------------------------------------------------------------
    def load(self) -> dict | None:
        """Read and check ``meta.json``; None when there is no sidecar yet."""
        if os.path.lexists(self.path) and not self.path.is_dir():
            raise SidecarMismatchError(f"priorities path {self.path} is {_kind(self.path)}, not a sidecar "
                                       "directory")
        mp = self.path / "meta.json"
        try:
            meta = read_json(mp)
        except FileNotFoundError:
            self.meta = None
            return None
        except NotADirectoryError:
            raise SidecarMismatchError(f"priorities path {self.path} is not a directory") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise SidecarMismatchError(f"{self.path} is not a bigper priorities sidecar")
        if meta.get("version") != VERSION:
            raise SidecarMismatchError(f"{self.path} has sidecar version {meta.get('version')!r}; "
                                       f"this bigper reads version {VERSION}")
        theirs, ours = meta.get("dataset"), self.fingerprint
        if not isinstance(theirs, dict):
            raise CorruptSnapshotError(f"{mp}: 'dataset' must be an object, got {theirs!r:.80}")
        diff = [f"{k}: sidecar {theirs.get(k)!r:.80} != dataset {ours[k]!r}"
                for k in ("layout", "transitions", "schema", "episodes") if theirs.get(k) != ours[k]]
        if diff:
            raise SidecarMismatchError(
                f"priorities sidecar {self.path} was made for another dataset ({theirs.get('name')!r:.80}); "
                + "; ".join(diff) + ". Pass priorities= another path, or delete it to start over")
        for key in ("scores", "partial", "leaves"):
            self._check_entry(mp, key, meta.get(key))
        self.meta = meta
        return meta

    def _check_entry(self, mp: Path, key: str, e) -> None:
        """Every field of entry ``key`` of meta.json: types, ranges, a name bigper makes."""
        if e is None:
            return

        def bad(what):
            raise CorruptSnapshotError(f"{mp}: {key!r} entry {what}")

        if not isinstance(e, dict):
            bad(f"must be an object, got {e!r:.80}")
        name = e.get("file")
        if not isinstance(name, str) or not _NAMES[key].fullmatch(name):
            bad(f"names the file {name!r:.80}, not one bigper writes ({_NAMES[key].pattern}); refused")
        if not isinstance(e.get("xxh64"), str) or not _HEX16.fullmatch(e["xxh64"]):
            bad(f"has checksum {e.get('xxh64')!r:.80}, not 16 hex digits")
        n = self.rows
        if key == "scores":
            if not _is_int(e.get("total")) or not 0 <= e["total"] <= n:
                bad(f"has total {e.get('total')!r:.80}; expected an int in [0, {n}]")
        elif key == "partial":
            for k in ("done", "total", "rows_valid", "batch_size"):
                if not _is_int(e.get(k)):
                    bad(f"has {k} {e.get(k)!r:.80}; expected an int")
            if not 0 <= e["done"] <= e["total"] <= n:
                bad(f"has done {e['done']} and total {e['total']}; expected 0 <= done <= total <= {n}")
            if not 0 <= e["rows_valid"] <= n or e["batch_size"] < 1:
                bad(f"has rows_valid {e['rows_valid']} and batch_size {e['batch_size']}; expected "
                    f"0 <= rows_valid <= {n} and batch_size >= 1")
        else:
            if e.get("prioritization", "proportional") not in KINDS:
                bad(f"has prioritization {e.get('prioritization')!r:.80}; expected one of {KINDS}")
            for k in ("alpha", "eps"):
                if not _is_num(e.get(k)):
                    bad(f"has {k} {e.get(k)!r:.80}; expected a finite number")
            if e.get("max_priority") is not None and not _is_num(e["max_priority"]):
                bad(f"has max_priority {e['max_priority']!r:.80}; expected null or a finite number")

    def _open(self, name: str, flags: int = os.O_RDONLY) -> int:
        """``name`` (a plain name checked by ``load``) inside the sidecar, as a regular file, never a
        symlink; a file opened for writing must have one link and not be the dataset."""
        if "/" in name or name in (".", ".."):  # names come from _check_entry or uuid; never a path
            raise CorruptSnapshotError(f"{self.path}: {name!r} is not a plain file name")
        p = self.path / name
        try:
            fd = open_regular(p, flags)
        except FileNotFoundError:
            raise CorruptSnapshotError(f"{p}, named in {self.path / 'meta.json'}, is missing") from None
        if flags & (os.O_WRONLY | os.O_RDWR):
            st = os.fstat(fd)
            if st.st_nlink != 1 or (self.protect is not None and (st.st_dev, st.st_ino) == tuple(self.protect)):
                os.close(fd)
                what = "is the dataset itself" if st.st_nlink == 1 else f"has {st.st_nlink} links"
                raise CorruptSnapshotError(f"{p} {what}; bigper writes only files it created (one link), "
                                           "never the dataset; refused")
        return fd

    def _read_f64(self, entry: dict, count: int) -> np.ndarray:
        p = self.path / entry["file"]
        fd = self._open(entry["file"])
        try:
            size = os.fstat(fd).st_size
            if size != self.rows * 8:  # every scores file is preallocated to one float64 a slot
                raise CorruptSnapshotError(f"{p} has {size} bytes; a scores file of {self.rows} slots has "
                                           f"{self.rows * 8}")
            a = np.empty(count, dtype="<f8")
            view, off = memoryview(a).cast("B"), 0
            while off < view.nbytes:
                got = os.preadv(fd, [view[off:]], off)
                if got <= 0:
                    raise CorruptSnapshotError(f"{p} ended at byte {off} while it was read")
                off += got
        except OSError as e:
            raise CorruptSnapshotError(f"{p} cannot be read: {e}") from None
        finally:
            os.close(fd)
        if _xxh(a) != entry["xxh64"]:
            raise CorruptSnapshotError(f"{p} does not match its checksum in {self.path / 'meta.json'}")
        bad = np.flatnonzero(~(np.isfinite(a) & (a >= 0)))
        if bad.size:  # reprioritize writes only checked scores: a re-signed file was crafted
            raise CorruptSnapshotError(f"{p} holds the score {a[bad[0]]!r} at slot {bad[0]}; "
                                       "scores are finite and >= 0")
        return a

    def scores(self) -> np.ndarray | None:
        """The scores of the last complete reprioritize, ``(rows,)`` float64, or None."""
        e = (self.meta or {}).get("scores")
        return None if e is None else self._read_f64(e, self.rows)

    def partial(self):
        """``(scores so far, entry)`` of an interrupted reprioritize, or None."""
        e = (self.meta or {}).get("partial")
        if e is None:
            return None
        out = np.zeros(self.rows, dtype=np.float64)
        out[:e["rows_valid"]] = self._read_f64(e, e["rows_valid"])
        return out, e

    def saved_with(self) -> dict | None:
        """The parameters of the keys saved at close, or None."""
        e = (self.meta or {}).get("leaves")
        if not e:
            return None
        kind = e.get("prioritization", "proportional")  # written before rank existed
        return key_params(kind, e["alpha"], e["eps"], e["max_priority"])

    def leaves(self, kind: str, alpha: float, eps: float, max_priority) -> np.ndarray | None:
        """Keys saved at close, when they were made with these parameters
        (by a strategy of ``kind``)."""
        e = (self.meta or {}).get("leaves")
        if e is None or self.saved_with() != key_params(kind, alpha, eps, max_priority):
            return None
        p = self.path / e["file"]
        fd = self._open(e["file"])
        try:
            size = os.fstat(fd).st_size
            if size > self.rows * 8 + _NPY_HEADER:
                raise CorruptSnapshotError(f"{p} has {size} bytes, more than {self.rows} float64 leaves need")
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(self.rows * 8 + _NPY_HEADER + 1)
            a = np.load(io.BytesIO(raw), allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise CorruptSnapshotError(f"{p} cannot be read: {err}") from None
        finally:
            os.close(fd)
        if a.shape != (self.rows,) or a.dtype != np.float64 or _xxh(a) != e["xxh64"]:
            raise CorruptSnapshotError(f"{p} does not match its checksum in {self.path / 'meta.json'}")
        if not (np.isfinite(a).all() and (a >= 0).all()):
            raise CorruptSnapshotError(f"{p} holds leaves that are negative or not finite")
        return a

    def describe(self) -> str:
        if self.meta is None:
            return f"priorities: none yet at {self.path} (every transition 1.0)"
        parts = []
        if self.meta.get("scores"):
            parts.append(f"scores of a complete reprioritize ({self.meta['scores']['total']:,} transitions)")
        if self.meta.get("partial"):
            e = self.meta["partial"]
            parts.append(f"a reprioritize in progress: {e['done']:,} of {e['total']:,} scored (resumable)")
        if self.meta.get("leaves"):
            w = self.saved_with()
            parts.append(f"{w.pop('prioritization')} keys saved at close ("
                         + ", ".join(f"{k}={v}" for k, v in w.items()) + ")")
        return f"priorities: {self.path}: " + ("; ".join(parts) or "empty")

    # -- writing (under the writer's lock) -------------------------------------------
    def lock(self) -> None:
        if self._lock_fd >= 0:
            return
        if os.path.lexists(self.path) and not self.path.is_dir():
            raise SidecarMismatchError(f"priorities path {self.path} is {_kind(self.path)}, not a sidecar "
                                       "directory")
        self.path.mkdir(parents=True, exist_ok=True)
        # A directory without meta.json is taken only when all it holds is bigper's own
        # names (an interrupted first run); anything else is someone's, untouched.
        if not os.path.lexists(self.path / "meta.json"):
            foreign = sorted(p.name for p in self.path.iterdir() if not _OURS.fullmatch(p.name))
            if foreign:
                raise PathExistsError(f"priorities path {self.path} holds files bigper did not create "
                                      f"({foreign[:5]}); pass priorities= an empty or new directory")
        # Read-only is enough for flock: the lock file is never written, whatever it is.
        fd = open_regular(self.path / ".lock", os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageLockedError(f"priorities sidecar {self.path} is being written by another "
                                     "process (its .lock is held)") from None
        self._lock_fd = fd
        try:
            self.load()  # what the last writer committed
        except BaseException:
            self.unlock()
            raise

    @property
    def locked(self) -> bool:
        return self._lock_fd >= 0

    def unlock(self) -> None:
        self._close_scores()
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _commit(self, meta: dict) -> None:
        # A planted temporary name (a hard link to another file) must not be truncated in place.
        (self.path / ".meta.json.tmp").unlink(missing_ok=True)
        write_json(self.path / "meta.json", meta)
        self.meta = meta
        keep = {"meta.json", ".lock"} | {meta[k]["file"] for k in ("scores", "partial", "leaves") if meta.get(k)}
        for p in self.path.iterdir():
            if p.name not in keep and _OURS.fullmatch(p.name):
                p.unlink(missing_ok=True)

    def _base(self) -> dict:
        base = dict(self.meta) if self.meta else {"format": FORMAT, "version": VERSION}
        base["dataset"] = self.fingerprint
        return base

    def start_run(self, total: int, batch_size: int) -> dict:
        """A new partial scores file (preallocated); returns its entry (not yet committed)."""
        name = f"scores-{uuid.uuid4().hex[:12]}.f64"
        fd = open_regular(self.path / name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            if self.rows:
                os.posix_fallocate(fd, 0, self.rows * 8)
        except BaseException:
            os.close(fd)
            (self.path / name).unlink(missing_ok=True)
            raise
        self._close_scores()
        self._scores_fd, self._scores_name = fd, name
        return {"file": name, "done": 0, "total": int(total), "rows_valid": 0, "xxh64": _xxh(np.zeros(0)),
                "batch_size": int(batch_size)}

    def write_scores(self, entry: dict, lo: int, values: np.ndarray) -> None:
        """Write ``values`` (float64) at slots ``lo ..`` of the partial file (not durable yet)."""
        if not 0 <= lo <= self.rows - values.shape[0]:
            raise CorruptSnapshotError(f"{self.path}: scores at slot {lo} ({values.shape[0]} of them) "
                                       f"fall outside its {self.rows} slots")
        if self._scores_fd < 0 or self._scores_name != entry["file"]:
            self._close_scores()
            self._scores_fd = self._open(entry["file"], os.O_WRONLY)
            self._scores_name = entry["file"]
        data = memoryview(np.ascontiguousarray(values, dtype="<f8")).cast("B")
        off = lo * 8
        while data.nbytes:
            got = os.pwrite(self._scores_fd, data, off)
            data, off = data[got:], off + got

    def _close_scores(self) -> None:
        if self._scores_fd >= 0:
            os.close(self._scores_fd)
            self._scores_fd = -1

    def _sync_scores(self, entry: dict) -> None:
        if self._scores_fd >= 0 and self._scores_name == entry["file"]:
            os.fsync(self._scores_fd)
            return
        fd = self._open(entry["file"])
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit_progress(self, entry: dict, done: int, scores: np.ndarray, rows_valid: int) -> None:
        """Make the partial file durable up to slot ``rows_valid`` and record ``done`` transitions."""
        self._sync_scores(entry)
        entry = dict(entry, done=int(done), rows_valid=int(rows_valid), xxh64=_xxh(scores[:rows_valid]))
        meta = self._base()
        meta["partial"] = entry
        self._commit(meta)

    def finish_run(self, entry: dict, scores: np.ndarray) -> None:
        """The partial file becomes the complete scores; saved leaves are dropped (they are older)."""
        self._sync_scores(entry)
        meta = self._base()
        meta["scores"] = {"file": entry["file"], "total": entry["total"], "xxh64": _xxh(scores)}
        meta["partial"] = meta["leaves"] = None
        self._commit(meta)

    def save_leaves(self, leaves: np.ndarray, kind: str, alpha: float, eps: float, max_priority) -> None:
        name = f"leaves-{uuid.uuid4().hex[:12]}.npy"
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(leaves, dtype=np.float64), allow_pickle=False)
        (self.path / f".{name}.tmp").unlink(missing_ok=True)
        write_durable(self.path / name, buf.getvalue())
        meta = self._base()
        meta["leaves"] = {"file": name, "prioritization": kind, "alpha": alpha, "eps": eps,
                          "max_priority": max_priority, "xxh64": _xxh(leaves)}
        self._commit(meta)
        fsync_dir(self.path)
