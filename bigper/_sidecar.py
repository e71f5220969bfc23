"""Priorities of an offline dataset, kept beside it (never inside it).

::

    <dataset>.priorities/
      meta.json              format, version, the dataset's fingerprint, what the files hold
      scores-<run>.f64       raw float64 scores, one per slot: of the last complete
                             reprioritize ("scores"), or of the run in progress, valid
                             up to the slot meta names ("partial"; resumable)
      leaves-<run>.npy       leaf values saved at close after update_priorities (allow_pickle=False)
      .lock                  flock of the one writer

``meta.json`` is replaced atomically and names every file it relies on, with
an xxh64 checksum of the bytes it vouches for; a file it does not name is left
over from an interrupted write and is removed by the next writer. Scores are
kept raw, so reopening with another ``alpha`` or ``eps`` transforms them anew;
leaves saved at close record the ``alpha``, ``eps`` and ``max_priority`` they
were made with and are used only when those match.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path

import numpy as np

from .errors import CorruptSnapshotError, SidecarMismatchError, StorageLockedError
from .storage._files import fsync_dir, preallocate, write_durable, write_json

FORMAT = "bigper-priorities"
VERSION = 1




def _xxh(data) -> str:
    import xxhash

    return xxhash.xxh64(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()


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
    """

    def __init__(self, path, fingerprint: dict, rows: int):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.rows = int(rows)
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
        if self.path.exists() and not self.path.is_dir():
            raise SidecarMismatchError(f"priorities path {self.path} is a file, not a sidecar directory")
        mp = self.path / "meta.json"
        if not mp.exists():
            self.meta = None
            return None
        try:
            meta = json.loads(mp.read_bytes())
        except ValueError as e:
            raise CorruptSnapshotError(f"{mp} is not valid JSON: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise SidecarMismatchError(f"{self.path} is not a bigper priorities sidecar")
        if meta.get("version") != VERSION:
            raise SidecarMismatchError(f"{self.path} has sidecar version {meta.get('version')!r}; "
                                       f"this bigper reads version {VERSION}")
        theirs, ours = meta.get("dataset", {}), self.fingerprint
        diff = [f"{k}: sidecar {theirs.get(k)!r} != dataset {ours[k]!r}"
                for k in ("layout", "transitions", "schema", "episodes") if theirs.get(k) != ours[k]]
        if diff:
            raise SidecarMismatchError(
                f"priorities sidecar {self.path} was made for another dataset ({theirs.get('name')!r}); "
                + "; ".join(diff) + ". Pass priorities= another path, or delete it to start over")
        self.meta = meta
        return meta

    def _read_f64(self, entry: dict, count: int) -> np.ndarray:
        p = self.path / entry["file"]
        try:
            a = np.fromfile(p, dtype="<f8", count=count)
        except OSError as e:
            raise CorruptSnapshotError(f"{p} cannot be read: {e}") from None
        if a.shape[0] != count or _xxh(a) != entry["xxh64"]:
            raise CorruptSnapshotError(f"{p} does not match its checksum in {self.path / 'meta.json'}")
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

    def leaves(self, alpha: float, eps: float, max_priority) -> np.ndarray | None:
        """Leaves saved at close, when they were made with these parameters."""
        e = (self.meta or {}).get("leaves")
        if e is None or [e["alpha"], e["eps"], e["max_priority"]] != [alpha, eps, max_priority]:
            return None
        p = self.path / e["file"]
        try:
            a = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CorruptSnapshotError(f"{p} cannot be read: {err}") from None
        if a.shape != (self.rows,) or a.dtype != np.float64 or _xxh(a) != e["xxh64"]:
            raise CorruptSnapshotError(f"{p} does not match its checksum in {self.path / 'meta.json'}")
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
            e = self.meta["leaves"]
            parts.append(f"leaves saved at close (alpha={e['alpha']}, eps={e['eps']})")
        return f"priorities: {self.path}: " + ("; ".join(parts) or "empty")

    # -- writing (under the writer's lock) -------------------------------------------
    def lock(self) -> None:
        if self._lock_fd >= 0:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageLockedError(f"priorities sidecar {self.path} is being written by another "
                                     "process (its .lock is held)") from None
        self._lock_fd = fd
        self.load()  # what the last writer committed

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
        write_json(self.path / "meta.json", meta)
        self.meta = meta
        keep = {"meta.json", ".lock"} | {meta[k]["file"] for k in ("scores", "partial", "leaves") if meta.get(k)}
        for p in self.path.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)

    def _base(self) -> dict:
        base = dict(self.meta) if self.meta else {"format": FORMAT, "version": VERSION}
        base["dataset"] = self.fingerprint
        return base

    def start_run(self, total: int, batch_size: int) -> dict:
        """A new partial scores file (preallocated); returns its entry (not yet committed)."""
        name = f"scores-{uuid.uuid4().hex[:12]}.f64"
        preallocate(self.path / name, self.rows * 8)
        return {"file": name, "done": 0, "total": int(total), "rows_valid": 0, "xxh64": _xxh(np.zeros(0)),
                "batch_size": int(batch_size)}

    def write_scores(self, entry: dict, lo: int, values: np.ndarray) -> None:
        """Write ``values`` (float64) at slots ``lo ..`` of the partial file (not durable yet)."""
        if self._scores_fd < 0 or self._scores_name != entry["file"]:
            self._close_scores()
            self._scores_fd = os.open(self.path / entry["file"], os.O_WRONLY)
            self._scores_name = entry["file"]
        os.pwrite(self._scores_fd, memoryview(np.ascontiguousarray(values, dtype="<f8")).cast("B"), lo * 8)

    def _close_scores(self) -> None:
        if self._scores_fd >= 0:
            os.close(self._scores_fd)
            self._scores_fd = -1

    def commit_progress(self, entry: dict, done: int, scores: np.ndarray, rows_valid: int) -> None:
        """Make the partial file durable up to slot ``rows_valid`` and record ``done`` transitions."""
        fd = os.open(self.path / entry["file"], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        entry = dict(entry, done=int(done), rows_valid=int(rows_valid), xxh64=_xxh(scores[:rows_valid]))
        meta = self._base()
        meta["partial"] = entry
        self._commit(meta)

    def finish_run(self, entry: dict, scores: np.ndarray) -> None:
        """The partial file becomes the complete scores; saved leaves are dropped (they are older)."""
        fd = os.open(self.path / entry["file"], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        meta = self._base()
        meta["scores"] = {"file": entry["file"], "total": entry["total"], "xxh64": _xxh(scores)}
        meta["partial"] = meta["leaves"] = None
        self._commit(meta)

    def save_leaves(self, leaves: np.ndarray, alpha: float, eps: float, max_priority) -> None:
        name = f"leaves-{uuid.uuid4().hex[:12]}.npy"
        import io

        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(leaves, dtype=np.float64), allow_pickle=False)
        write_durable(self.path / name, buf.getvalue())
        meta = self._base()
        meta["leaves"] = {"file": name, "alpha": alpha, "eps": eps, "max_priority": max_priority,
                          "xxh64": _xxh(leaves)}
        self._commit(meta)
        fsync_dir(self.path)
