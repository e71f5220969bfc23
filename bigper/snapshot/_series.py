"""Snapshots: a directory of numbered snapshots with retention and fallback."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import (
    CorruptSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
    PathNotFoundError,
)
from ..storage._files import fsync_dir, open_regular

_NAME = re.compile(r"^snap-(\d{8,})$")
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # a save in progress (or interrupted): <parent>/.tmp-<name>-<pid>-<rand>
DEL_PREFIX = ".del-"  # a deletion in progress (or interrupted)
# Exactly the names save and retention give their temporaries: nothing else is removed.
_LEFTOVER = re.compile(r"^(\.tmp-snap-\d{8,}-\d+-[0-9a-f]{8}|\.del-snap-\d{8,}-[0-9a-f]{8})$")


def _seq(p: Path) -> int:
    m = _NAME.match(p.name)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot holds besides the buffer (``Snapshots.last_loaded``,
    ``snapshot_info``).

    Attributes
    ----------
    path : Path
        The snapshot directory.
    number : int or None
        Its sequence number under a ``Snapshots`` root (``snap-00000042`` -> 42).
    created : str or None
        When it was written (ISO 8601, UTC).
    metadata : JSON value or None
        What the caller passed as ``metadata=`` to ``save`` (e.g. ``{"step": 100000}``).
    files : Mapping[str, Path]
        ``name -> path`` of the caller's files kept in the snapshot (read-only:
        copy one before changing it; retention deletes them with the snapshot).
    count, len : int or None
        Transitions ever added, and held, when it was written.
    """

    path: Path
    number: int | None
    created: str | None
    metadata: Any
    files: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}))
    count: int | None = None
    len: int | None = None

    @property
    def step(self):
        """``metadata["step"]`` when the caller recorded one, else None."""
        return self.metadata.get("step") if isinstance(self.metadata, dict) else None


def snapshot_info(snapshot) -> SnapshotInfo:
    """The ``SnapshotInfo`` of one snapshot directory (its manifest checked;
    the files it names are not read)."""
    from ._manifest import read_manifest

    p = Path(os.path.abspath(snapshot))
    body = read_manifest(p)
    user = body.get("user") or {}
    seq = _seq(p)
    count = body["state"]["meta"].get("count")
    n = body.get("summary", {}).get("len")
    return SnapshotInfo(
        path=p, number=seq if seq >= 0 else None, created=body.get("created"),
        metadata=user.get("metadata"),
        files=MappingProxyType({name: p / m for name, m in user.get("files", {}).items()}),
        count=count if isinstance(count, int) else None, len=n if isinstance(n, int) else None)


class Snapshots:
    """Numbered snapshots of one buffer under ``root``, the newest ``keep`` kept.

    ::

        root/
          .lock                       flock: exclusive while saving, shared while loading
          snap-00000041/              complete snapshots (written by bigper.snapshot.save)
          snap-00000042/
          .tmp-snap-00000043-...      an interrupted save: removed when Snapshots starts
          .del-snap-00000040-...      an interrupted deletion: removed when Snapshots starts

    Parameters
    ----------
    root : str or Path
        Created if missing.
    keep : int or None
        Complete snapshots to keep (>= 1), or None to keep all. Retention runs
        after each successful ``save`` and never deletes the newest complete
        snapshot.

    Attributes
    ----------
    last_loaded : SnapshotInfo or None
        Which snapshot the last ``load_latest`` loaded: its path, number,
        the caller's ``metadata`` and ``files`` saved with it.

    Examples
    --------
    >>> snaps = Snapshots("runs/pong/snaps", keep=3)             # doctest: +SKIP
    >>> torch.save(model.state_dict(), "runs/pong/model.pt")    # doctest: +SKIP
    >>> snaps.save(buf, metadata={"step": step}, files={"model.pt": "runs/pong/model.pt"})  # doctest: +SKIP
    >>> buf = snaps.load_latest()                               # doctest: +SKIP
    >>> snaps.last_loaded.step, snaps.last_loaded.files["model.pt"]  # doctest: +SKIP
    """

    def __init__(self, root, keep: int | None = 3, *, loader=None):
        if loader is not None and not callable(loader):
            raise InvalidTypeError(f"loader must be callable like ShardedPrioritizedBuffer.load, got {loader!r}")
        self.loader = loader  # loader(snapshot, path=...) for buffers that snapshot themselves (shards)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidArgumentError(f"keep must be an int >= 1 or None, got {keep!r}")
        self.root = Path(os.path.abspath(root))
        self.keep = keep
        self.last_loaded: SnapshotInfo | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise PathExistsError(f"Snapshots root {str(self.root)!r} (or a part of it) exists and is not "
                                  "a directory") from None
        self.cleaned = self._clean()

    def __repr__(self) -> str:
        return f"Snapshots({str(self.root)!r}, keep={self.keep})"

    # -- the lock ---------------------------------------------------------------
    @contextmanager
    def _locked(self, shared: bool, blocking: bool = True):
        fd = open_regular(self.root / ".lock", os.O_RDWR | os.O_CREAT)
        try:
            mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the flock

    def _clean(self) -> list[str]:
        """Remove leftovers of interrupted saves and deletions (unless one is running)."""
        removed = []
        with self._locked(shared=False, blocking=False) as held:
            if not held:
                return removed
            for entry in sorted(os.listdir(self.root)):
                if _LEFTOVER.match(entry):
                    if os.path.islink(self.root / entry):  # not one bigper made: left alone
                        continue
                    shutil.rmtree(self.root / entry, ignore_errors=True)
                    removed.append(entry)
            if removed:
                fsync_dir(self.root)
        return removed

    # -- listing ----------------------------------------------------------------
    def _entries(self) -> list[Path]:
        """Every ``snap-*`` directory, oldest first."""
        out = []
        for e in os.listdir(self.root):
            if _NAME.match(e):
                try:  # lstat: a symlink named like a snapshot is not one (it could lead anywhere)
                    if stat.S_ISDIR(os.lstat(self.root / e).st_mode):
                        out.append(self.root / e)
                except FileNotFoundError:  # retired by a concurrent save's retention
                    pass
        return sorted(out, key=_seq)

    def list(self) -> list[Path]:
        """Complete snapshots (a manifest is present), oldest first; not verified."""
        return [p for p in self._entries() if (p / MANIFEST).is_file()]

    @staticmethod
    def _intact(p: Path) -> bool:
        from ._manifest import read_manifest

        try:
            read_manifest(p)
        except (CorruptSnapshotError, OSError):
            return False
        except Exception:  # another format: intact, just not ours to judge
            return True
        return True

    def latest(self) -> Path | None:
        """The newest snapshot whose manifest is intact, or None. Its data files
        are checked by ``load_latest`` (or ``bigper verify``)."""
        for p in reversed(self._entries()):
            if self._intact(p):
                return p
        return None

    # -- saving -------------------------------------------------------------------
    def save(self, buf, *, metadata=None, files=None) -> Path:
        """Snapshot ``buf`` as the next number, then apply retention; returns its path.

        Parameters
        ----------
        buf : PrioritizedReplayBuffer
        metadata : JSON-able, optional
            The caller's record to keep with it (a step, an episode count);
            ``last_loaded.metadata`` after ``load_latest``.
        files : dict of str to path, optional
            The caller's files (a model checkpoint written just before) to copy
            into the snapshot in the same atomic commit, checksummed;
            ``last_loaded.files[name]`` after ``load_latest``. bigper never
            loads them; retention deletes them with their snapshot.
        """
        from ._save import save

        # A buffer with its own snapshot format (a sharded buffer) writes itself.
        own = getattr(type(buf), "snapshot_format", None) is not None
        if own and (metadata is not None or files):
            raise InvalidArgumentError("metadata= and files= are kept for local buffers' snapshots only; "
                                       f"{type(buf).__name__} writes its own snapshot format")
        with self._locked(shared=False):
            entries = self._entries()
            seq = (_seq(entries[-1]) + 1) if entries else 1
            target = self.root / f"snap-{seq:08d}"
            path = buf.save(target) if own else save(buf, target, metadata=metadata, files=files)
            self._retain()
        return path

    def _retain(self) -> None:
        if self.keep is None:
            return
        entries = self._entries()
        kept = []
        for p in reversed(entries):
            if len(kept) == self.keep:
                break
            if self._intact(p):
                kept.append(p)
        if not kept:  # nothing complete: delete nothing
            return
        oldest = _seq(kept[-1])
        for p in entries:
            if _seq(p) < oldest:
                self._delete(p)

    def _delete(self, p: Path) -> None:
        # Renamed first: an interrupted deletion leaves a .del- leftover, never a
        # snap- directory with some files missing.
        dst = self.root / f"{DEL_PREFIX}{p.name}-{uuid.uuid4().hex[:8]}"
        os.rename(p, dst)
        fsync_dir(self.root)
        shutil.rmtree(dst, ignore_errors=True)

    # -- loading ------------------------------------------------------------------
    def load_latest(self, *, path=None, with_info: bool = False):
        """Load the newest snapshot that verifies; an older one, with a warning,
        when a newer one is corrupt. ``last_loaded`` then tells which.

        Parameters
        ----------
        path : str or Path, optional
            Where a disk storage keeps its live data (see ``PrioritizedReplayBuffer.load``).
        with_info : bool
            Return ``(buffer, SnapshotInfo)`` instead of the buffer alone.

        Raises
        ------
        FileNotFoundError
            ``root`` holds no snapshot.
        CorruptSnapshotError
            Every snapshot is corrupt.
        """
        from ._load import load

        with self._locked(shared=True):
            entries = [p for p in reversed(self._entries()) if (p / MANIFEST).exists()] \
                or list(reversed(self._entries()))
            if not entries:
                raise PathNotFoundError(f"no snapshot in {self.root}")
            problems = []
            for i, p in enumerate(entries):
                try:
                    if self.loader is not None:
                        buf = self.loader(p, path=path)
                        info = SnapshotInfo(path=p, number=_seq(p), created=None, metadata=None)
                    else:
                        info = snapshot_info(p)
                        buf = load(p, path=path)
                except CorruptSnapshotError as e:
                    problems.append(str(e))
                    if i + 1 < len(entries):
                        warnings.warn(f"snapshot {p.name} is corrupt ({e}); falling back to "
                                      f"{entries[i + 1].name}", RuntimeWarning, stacklevel=2)
                else:
                    self.last_loaded = info
                    return (buf, info) if with_info else buf
            raise CorruptSnapshotError(f"no loadable snapshot in {self.root}: " + "; ".join(problems))
