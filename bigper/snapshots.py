"""Snapshots: a directory of numbered snapshots of one buffer, with retention and fallback."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .buffer import PrioritizedReplayBuffer
from .errors import (
    InvalidArgumentError,
    CorruptSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
    PathNotFoundError,
)
from .snapshot.manifest import MANIFEST, read_manifest
from .snapshot.series import DEL_PREFIX, LEFTOVER, NAME, SnapshotInfo, seq_of, snapshot_info
from .common.files import fsync_dir, open_regular


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
    loader : callable, optional
        ``loader(snapshot, path=...)`` loads a buffer that writes its own
        snapshot format (``ShardedPrioritizedBuffer.load``); default
        ``PrioritizedReplayBuffer.load``.

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

    def __init__(self, root: str | os.PathLike[str], keep: int | None = 3, *,
                 loader: Callable[..., Any] | None = None) -> None:
        if loader is not None and not callable(loader):
            raise InvalidTypeError(f"loader must be callable like ShardedPrioritizedBuffer.load, got {loader!r}")
        self.loader = loader  # loader(snapshot, path=...) for buffers that snapshot themselves (shards)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidArgumentError(f"keep must be an int >= 1 or None, got {keep!r}")
        self.root: Path = Path(os.path.abspath(root))
        self.keep = keep
        self.last_loaded: SnapshotInfo | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise PathExistsError(f"Snapshots root {str(self.root)!r} (or a part of it) exists and is not "
                                  "a directory") from None
        self.cleaned: list[str] = self._clean()

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
                if LEFTOVER.match(entry):
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
            if NAME.match(e):
                try:  # lstat: a symlink named like a snapshot is not one (it could lead anywhere)
                    if stat.S_ISDIR(os.lstat(self.root / e).st_mode):
                        out.append(self.root / e)
                except FileNotFoundError:  # retired by a concurrent save's retention
                    pass
        return sorted(out, key=seq_of)

    def list(self) -> list[Path]:
        """Complete snapshots (a manifest is present), oldest first; not verified."""
        return [p for p in self._entries() if (p / MANIFEST).is_file()]

    @staticmethod
    def _intact(p: Path) -> bool:
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
    def save(self, buf: PrioritizedReplayBuffer | Any, *, metadata: Any = None,
             files: Mapping[str, str | os.PathLike[str]] | None = None) -> Path:
        """Snapshot ``buf`` as the next number, then apply retention; returns its path.

        Parameters
        ----------
        buf : PrioritizedReplayBuffer
            The buffer (or, with a ``loader``, a buffer that writes its own
            snapshot format, such as ``ShardedPrioritizedBuffer``).
        metadata : JSON-able, optional
            The caller's record to keep with it (a step, an episode count);
            ``last_loaded.metadata`` after ``load_latest``.
        files : dict of str to path, optional
            The caller's files (a model checkpoint written just before) to copy
            into the snapshot in the same atomic commit, checksummed;
            ``last_loaded.files[name]`` after ``load_latest``. bigper never
            loads them; retention deletes them with their snapshot.
        """
        # A buffer with its own snapshot format (a sharded buffer) takes no caller's files.
        own = getattr(type(buf), "snapshot_format", None) is not None
        if own and (metadata is not None or files):
            raise InvalidArgumentError("metadata= and files= are kept for local buffers' snapshots only; "
                                       f"{type(buf).__name__} writes its own snapshot format")
        with self._locked(shared=False):
            target = self._next()
            path = buf.save(target) if own else buf.save(target, metadata=metadata, files=files)
            self._retain()
        return path

    def _next(self) -> Path:
        """The next snapshot's path: numbered after the newest snapshot that
        holds a manifest (bigper's, intact or damaged; not after a user's
        entry, whose number may be anything), and past any name that is taken
        (a user's file, symlink or folder is left alone and never blocks a save)."""
        complete = self.list()
        taken = {seq_of(Path(e)) for e in os.listdir(self.root) if NAME.match(e)}
        n = (seq_of(complete[-1]) if complete else 0) + 1
        while n in taken:
            n += 1
        name = f"snap-{n:08d}"
        if len(name) > 200:  # its temporary (.tmp-<name>-<pid>-<rand>) must fit a file name too
            raise PathExistsError(f"{complete[-1]} numbers the series past what a file name can hold; "
                                  "move it out of the Snapshots root")
        return self.root / name

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
        oldest = seq_of(kept[-1])
        for p in entries:
            # Only what bigper provably wrote goes: a snapshot whose manifest reads
            # as bigper's. A folder of the same name without one (a user's, or a
            # damaged snapshot) is left where it is.
            if seq_of(p) < oldest and self._intact(p):
                self._delete(p)

    def _delete(self, p: Path) -> None:
        # Renamed first: an interrupted deletion leaves a .del- leftover, never a
        # snap- directory with some files missing.
        dst = self.root / f"{DEL_PREFIX}{p.name}-{uuid.uuid4().hex[:8]}"
        os.rename(p, dst)
        fsync_dir(self.root)
        shutil.rmtree(dst, ignore_errors=True)

    # -- loading ------------------------------------------------------------------
    def load_latest(self, *, path: str | os.PathLike[str] | None = None,
                    with_info: bool = False, device: Any = None, continue_episodes: bool = False,
                    rewind: bool = False) -> Any:
        """Load the newest snapshot that verifies; an older one, with a warning,
        when a newer one is corrupt. ``last_loaded`` then tells which.

        Parameters
        ----------
        path : str or Path, optional
            Where a disk storage keeps its live data (see ``PrioritizedReplayBuffer.load``).
        with_info : bool
            Return ``(buffer, SnapshotInfo)`` instead of the buffer alone.
        device : str or torch.device, optional
            The device tier of the loaded buffer (``PrioritizedReplayBuffer.load``);
            not with a ``loader``.
        continue_episodes, rewind : bool
            As ``PrioritizedReplayBuffer.load`` takes them: the episodes open at
            the snapshot end there (truncated) unless ``continue_episodes``; a
            live path holding newer data is refused unless ``rewind``. Not with
            a ``loader``.

        Returns
        -------
        PrioritizedReplayBuffer or tuple
            The buffer (what ``loader`` returns, with one), or
            ``(buffer, SnapshotInfo)`` with ``with_info=True``.

        Raises
        ------
        FileNotFoundError
            ``root`` holds no snapshot.
        CorruptSnapshotError
            Every snapshot is corrupt.
        """
        for name, v, default in (("device", device, None), ("continue_episodes", continue_episodes, False),
                                 ("rewind", rewind, False)):
            if self.loader is not None and (v is not None if default is None else bool(v) is not default):
                raise InvalidArgumentError(f"{name}= is for PrioritizedReplayBuffer snapshots; this series loads "
                                           f"with its own loader ({self.loader!r})")
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
                        info = SnapshotInfo(path=p, number=seq_of(p), created=None, metadata=None)
                    else:
                        info = snapshot_info(p)
                        buf = PrioritizedReplayBuffer.load(p, path=path, device=device,
                                                           continue_episodes=continue_episodes, rewind=rewind)
                except CorruptSnapshotError as e:
                    problems.append(str(e))
                    if i + 1 < len(entries):
                        warnings.warn(f"snapshot {p.name} is corrupt ({e}); falling back to "
                                      f"{entries[i + 1].name}", RuntimeWarning, stacklevel=2)
                else:
                    self.last_loaded = info
                    return (buf, info) if with_info else buf
            raise CorruptSnapshotError(f"no loadable snapshot in {self.root}: " + "; ".join(problems))
