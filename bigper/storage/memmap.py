"""Memory-mapped storage: a directory of preallocated chunk files per array.

::

    path/
      meta.json                 format, version, config, arrays, clean flag, buffer state
      .lock                     flock of the one writer
      data/<name>.bin           rows 0 .. chunk_rows-1, raw, C order, preallocated
      data/<name>.000001.bin    the next ``chunk_rows`` rows, and so on (an array
                                of up to ``chunk_bytes`` is the one file <name>.bin)
      state/<name>.npy          the buffer's bookkeeping, written at close

Every array is one numpy array over one contiguous range of address space;
each chunk file is mapped over its part (``_region.py``), so reads and writes
are plain numpy indexing.

Snapshots hard-link chunk files instead of copying them. A chunk file that
has another link (``st_nlink > 1``: a snapshot holds it) is *shared*: it is
mapped read-only, and the first write into it copies the file to a private
one and maps the copy in its place (copy-on-write at chunk granularity), so
the live buffer never writes into a file a snapshot holds.

Files are never truncated on open. ``clean`` is false while a writer has the
directory open, so a writer that died is detected on the next open; a
snapshot load with ``takeover=True`` replaces whatever such a writer left.

Takeover replaces only what bigper can prove it wrote: ``meta.json`` with
this format's marker is written before any chunk file exists, and names
every array; ``data/`` may hold only those arrays' chunk files (and their
``.cow`` copies in progress), ``state/`` only the ``.npy`` files named at the
last close. Anything else anywhere in the directory (a user's
``data/train.csv``, a subdirectory, a symlink, a FIFO) is refused with
``PathExistsError`` before anything changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    BigperError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
    PathNotFoundError,
)
from . import _relayout
from .chunks import CHUNK_BYTES, _Array, chunk_name, chunk_rows_for  # noqa: F401  (CHUNK_BYTES, _Array: used by snapshots and tools)
from ..common.files import FileLock, HeldDir, fsync_dir, open_regular, preallocate, read_json, write_json
from .base import StorageBase, fits_spec
from .state import (STATE_BYTES_PER_SLOT, STATE_NAME, check_arrays, check_meta, entry_kind, load_state_dir,
                    save_state_dir, state_slots)

FORMAT = "bigper-memmap"
VERSION = 1  # chunk files arrived before any release; one chunk is the original layout
# What a storage directory may hold; takeover refuses a directory with anything else.
_OWN = {"meta.json": "file", ".meta.json.tmp": "file", ".lock": "file", "data": "dir", "state": "dir"}
_TRASH = re.compile(r"^\.trash-[0-9a-f]{12}$")


def random_reads_pay(data_bytes: int) -> bool:
    """Whether sampling should read without read-ahead: when the data is more
    than half this machine's memory, the page cache cannot keep it, and
    read-ahead fetches 128 KB around every sampled row (measured, 2^20 and
    2^22 Atari rows with a cold page cache: a sample(32) + update round 3-5x
    faster without; at 2^22 in steady state 3-9x over several runs). A buffer
    that fits keeps read-ahead: its page cache fills much sooner after a
    reopen with it."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return False
    return data_bytes > ram // 2


class MemmapStorage(StorageBase):
    kind = "memmap"
    reads_may_fail: bool = False  # (reads from a map: a cut file is a SIGBUS, never an exception)
    options = ("random_reads", "chunk_bytes")
    chunked = True

    # -- what the kind answers (storage/base.py) -----------------------------------
    @classmethod
    def restoring(cls, path: Path | None, options: dict[str, Any]) -> "MemmapStorage":
        """A takeover of ``path`` with the snapshot's chunking (its chunk files are adopted when it matches)."""
        return cls(path, takeover=True, chunk_bytes=int(options.get("chunk_bytes", CHUNK_BYTES)))

    def snapshot_options(self) -> dict[str, Any]:
        return {"chunk_bytes": self.chunk_bytes}

    @classmethod
    def recognizes(cls, path: Path) -> bool:
        """A directory with a ``meta.json`` that is no snapshot's (no ``manifest.json``)."""
        return path.is_dir() and os.path.lexists(path / "meta.json") and not (path / "manifest.json").exists()

    @classmethod
    def lock_path(cls, path: Path) -> Path:
        return path / ".lock"

    @classmethod
    def check_layout(cls, path: Path) -> str:
        """``meta.json`` (its marker, its arrays) and every chunk file it names."""
        meta = read_json(path / "meta.json")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptSnapshotError(f"{path}/meta.json has no bigper memmap marker")
        check_arrays(meta.get("arrays"), path)
        cls.check_files(path, meta)
        return f"{len(meta['arrays'])} arrays, every chunk file in place"

    @classmethod
    def check_files(cls, path: Path, meta: dict[str, Any]) -> None:
        """Every chunk file ``meta`` records: a regular file of at least its size."""
        for name, rec in meta["arrays"].items():
            a = _Array(path, name, rec)
            for k in range(a.n):
                try:
                    fd = open_regular(a.path(k))
                except FileNotFoundError:
                    raise CorruptSnapshotError(f"{a.path(k)} is missing") from None
                try:
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                if size < a.sizes[k]:
                    raise CorruptSnapshotError(f"{a.path(k)} has {size} bytes, its layout needs {a.sizes[k]}")

    def __init__(self, path, *, read_only: bool = False, takeover: bool = False,
                 chunk_bytes: int = CHUNK_BYTES, random_reads: bool | None = None):
        if takeover and read_only:
            raise InvalidArgumentError("takeover=True needs a writer; read_only must be False")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise InvalidArgumentError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
        if random_reads is not None and not isinstance(random_reads, bool):
            raise InvalidArgumentError(f"random_reads must be True, False or None (auto), got {random_reads!r}")
        self.random_reads = random_reads
        self.path = Path(os.path.abspath(path))  # resolved once: a later chdir redirects nothing
        self.read_only = read_only
        self.takeover = takeover
        self.chunk_bytes = chunk_bytes
        self.arrays: dict[str, np.ndarray] = {}
        self._arr: dict[str, _Array] = {}
        self._rw: dict[str, np.ndarray] = {}
        self._nshared = 0
        self._renamed = False
        self._record_before = None  # meta.json as it was before this session marked it unclean
        self._marked = False  # meta.json already says clean: false in this session
        self._lock = None
        self._created = False
        self._meta: dict | None = None
        self.previous: dict | None = None  # with takeover: the meta found there, if readable
        self._dir: HeldDir | None = None
        self._root = self.path  # the path file operations go through (see open)
        self._aside: dict | None = None  # takeover: the old buffer's data/state, moved aside
        self._converted: tuple | None = None  # convert: (the record before, the new arrays' layout), for abort
        self._overlay: dict = {}  # convert, read_only: the new arrays, in memory, in place of ``_hidden``
        self._hidden: tuple = ()
        self._journaled = False  # open found an interrupted conversion's journal: _recover acts on it

    # -- open / create -------------------------------------------------------
    def open(self, config: dict) -> dict | None:
        """Lock the directory; return its recorded meta when it holds a buffer
        (with ``takeover``: None, whatever it holds; see ``previous``)."""
        meta_path = self.path / "meta.json"
        if not meta_path.exists() or self.takeover:
            if self.read_only:
                raise PathNotFoundError(f"no bigper memmap storage at {self.path}")
            if self.path.exists() and not self.path.is_dir():
                raise PathExistsError(f"{self.path} exists and is not a directory")
            self._created = not self.path.exists()
            if not self._created and not self.takeover and not os.path.lexists(meta_path):
                # A new storage in an existing directory is made beside what is there, but
                # never into it: a user's data/obs.bin would be preallocated in place. (bigper
                # names meta.json before it makes data/ or state/, so those are not its own.)
                foreign = sorted(e for e in ("data", "state") if os.path.lexists(self.path / e))
                if foreign:
                    raise PathExistsError(
                        f"{self.path} holds {foreign} but no bigper storage (no meta.json): a new storage "
                        "would write into them; pass an empty or new directory (nothing was changed)")
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise PathExistsError(f"a part of {self.path} exists and is not a directory") from None
        # Held from now on: every file operation goes through this descriptor.
        self._dir = HeldDir(self.path)
        self._root = self._dir.root
        meta_path = self._root / "meta.json"
        # The lock before anything in the directory is read (a live writer is refused
        # with nothing looked at); a lock file made here beside foreign files goes again.
        made_lock = not os.path.lexists(self._root / ".lock")
        try:
            self._lock = FileLock(self._root / ".lock", shared=self.read_only, owner=self.path)
        except BaseException:
            self._let_go()
            raise
        try:
            if self.takeover:
                try:
                    return self._take_over(config)
                except PathExistsError:
                    if made_lock:
                        os.unlink(self._root / ".lock")
                    raise
            if meta_path.exists():
                self._meta = check_meta(read_json(meta_path), FORMAT, VERSION, self.path)
                check_arrays(self._meta.get("arrays"), self.path)
                _relayout.check_journal(self._meta, self.path)
                for sub in ("data", "state"):  # names resolve inside: no symlinked subdirectory
                    if os.path.lexists(self._root / sub) and entry_kind(self._root / sub) != "dir":
                        raise CorruptSnapshotError(f"{self.path / sub} is not a plain directory (a symlink?)")
                if not self.read_only:
                    self._leftovers()  # refused here, before allocate changes anything
                    # a conversion a kill interrupted: back to the old folder, or on to the new one,
                    # once the buffer is known to be this one (convert or allocate: _recover)
                    _relayout.check_files(self._root, self._meta)  # (refused here: nothing changed)
                    self._journaled = any(self._meta.get(k) is not None for k in _relayout.KEYS)
                return self._meta
        except BaseException:
            if made_lock:  # a refused path keeps no lock file this open made (bigper verify, a reader)
                with contextlib.suppress(OSError):
                    os.unlink(self._root / ".lock")
            self._abort()
            raise
        self._meta = self._new_meta(config)
        return None

    def _new_meta(self, config):
        return {"format": FORMAT, "version": VERSION, "config": config, "arrays": {},
                "clean": False, "state": None, "chunk_bytes": self.chunk_bytes, "shared_digests": {}}

    def replace(self, config: dict) -> None:
        """``mode="overwrite"``: the buffer ``open`` just found here (under the lock
        it still holds) is to be replaced by a new, empty one of ``config``. Every
        entry is proved bigper's first (``PathExistsError`` otherwise); the old
        files go at ``allocate``, so a caller may still ``abort`` with nothing changed."""
        if self._lock is None or self.read_only or self._arr:
            raise RuntimeError("replace() is for a writer that open() just locked")
        self.takeover = True
        self._take_over(config)

    def _take_over(self, config) -> None:
        """Lock only: nothing changes on disk until ``adopt`` or ``allocate``,
        so a caller that finds ``previous`` unacceptable can still ``abort``."""
        self.previous = self._own_previous()
        self._meta = self._new_meta(config)
        return None

    def _own_previous(self) -> dict | None:
        """The meta.json of the buffer that this directory holds (None if it
        holds none yet), after proving that every entry in it is one bigper
        wrote there; ``PathExistsError`` naming the first that is not."""
        def foreign(what: str):
            raise PathExistsError(
                f"{self.path} holds {what}, which a bigper memmap storage does not: refusing to "
                "take it over (pass an empty or bigper directory as path); nothing was changed")

        previous = None
        if os.path.lexists(self._root / "meta.json"):
            try:
                previous = read_json(self._root / "meta.json", error=PathExistsError)
            except PathExistsError:
                foreign("a meta.json that is not a regular file or not JSON")
            if not isinstance(previous, dict) or previous.get("format") != FORMAT:
                foreign("a meta.json without bigper's memmap marker")
        names = {"data": set(), "state": set()}
        journal = (set(), set())
        data = self._root / "data"  # (a writer killed before it made data/ left none)
        present = os.listdir(data) if os.path.lexists(data) and entry_kind(data) == "dir" else []
        if previous:
            try:
                _relayout.check_journal(previous, self.path)
                journal = _relayout.journal_files(previous, present)  # a conversion's files: bigper's
            except CorruptSnapshotError:
                pass  # (a damaged journal proves nothing)
        names["data"] |= journal[0]
        arrays = previous.get("arrays") if previous else None
        if isinstance(arrays, dict):
            try:  # the chunk files (and their copies on write) the record names, looked up entry by
                # entry: a record of 2**55 one-row chunks costs what data/ holds
                own = _relayout.chunk_files(check_arrays(arrays, self.path),
                                            [e[:-4] if e.endswith(".cow") else e for e in present])
                names["data"] |= set(own) | {e + ".cow" for e in own}
            except CorruptSnapshotError:
                pass  # a damaged record proves nothing: only an empty data/ is taken over
        recorded = previous.get("state_files") if previous else None
        for entry in sorted(os.listdir(self._root)):
            if entry in _OWN:
                if entry_kind(self._root / entry) != _OWN[entry]:
                    foreign(f"{entry!r} (not a plain {_OWN[entry]})")
            elif not (_TRASH.match(entry) and entry_kind(self._root / entry) == "dir"):
                foreign(repr(entry))
        for sub in ("data", "state"):
            if not (self._root / sub).is_dir():
                continue
            for entry in sorted(os.listdir(self._root / sub)):
                if sub == "state":
                    stem = entry[1:-8] if entry.startswith(".") and entry.endswith(".npy.tmp") else \
                        entry[:-4] if entry.endswith(".npy") else None
                    ok = stem is not None and STATE_NAME.match(stem) and \
                        (stem in recorded or stem in journal[1] if isinstance(recorded, list) else previous is not None)
                else:
                    ok = entry in names["data"]
                if not ok or entry_kind(self._root / sub / entry) != "file":
                    foreign(f"{sub}/{entry!r}")
        return previous

    def _wipe(self) -> None:
        """Takeover: mark the directory unclean, then move what the last writer
        left aside (kept until the new buffer is allocated: ``abort`` puts it back)."""
        for trash in self._root.iterdir():  # of an earlier takeover that was interrupted
            if _TRASH.match(trash.name):
                shutil.rmtree(trash, ignore_errors=True)
        if isinstance(self.previous, dict) and self.previous.get("clean"):
            # Unclean from now on, still naming its arrays: what is left stays provably bigper's.
            write_json(self._root / "meta.json", {**self.previous, "clean": False})
        self._aside = {}
        for sub in ("data", "state"):
            if (self._root / sub).exists():
                name = f".trash-{uuid.uuid4().hex[:12]}"
                os.replace(self._root / sub, self._root / name)
                self._aside[sub] = name
        self.takeover = False

    def _settle(self) -> None:
        """The new buffer is in place: the old one's files go."""
        for name in self._aside.values():
            shutil.rmtree(self._root / name, ignore_errors=True)
        self._aside = None

    def _put_back(self) -> None:
        """A takeover that failed: the old buffer's files and record return as they were."""
        if self._aside is None:
            return
        for sub in ("data", "state"):
            if (self._root / sub).exists():
                shutil.rmtree(self._root / sub, ignore_errors=True)
        for sub, name in self._aside.items():
            os.replace(self._root / name, self._root / sub)
        if isinstance(self.previous, dict):
            write_json(self._root / "meta.json", self.previous)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._root / "meta.json")
        self._aside = None

    def adopt(self, arrays: dict) -> None:
        """Attach a snapshot's chunk files (takeover only): hard-link each (copy
        where linking fails) into ``data/``. ``arrays``: name -> layout dict
        (``rows``, ``shape``, ``dtype``, ``chunk_rows``) plus ``files``, a list of
        ``(source path, xxh3 digest)`` per chunk."""
        if not self.takeover:
            raise RuntimeError("adopt() is for a fresh takeover, before allocate()")
        self._wipe()
        for name, rec in arrays.items():  # named before any file exists (see _own_previous)
            self._meta["arrays"][name] = {k: rec[k] for k in ("rows", "shape", "dtype", "chunk_rows")}
        write_json(self._root / "meta.json", self._meta)
        data = self._root / "data"
        data.mkdir()
        for name, rec in arrays.items():
            digests = {}
            for k, (src, digest) in enumerate(rec["files"]):
                dst = data / chunk_name(name, k)
                try:
                    os.link(src, dst)
                    digests[str(k)] = [os.stat(dst).st_ino, digest]
                except OSError:  # another filesystem, or links not allowed: copy
                    shutil.copyfile(src, dst)
            self._meta["arrays"][name] = {k: rec[k] for k in ("rows", "shape", "dtype", "chunk_rows")}
            self._meta["shared_digests"][name] = digests
        write_json(self._root / "meta.json", self._meta)
        self._marked = True

    def layout(self, specs, growth=None) -> dict:
        """The chunk layout this storage gives ``specs`` (``name -> (rows, shape,
        dtype)``); an array of ``growth`` (name -> rows of a step) has one chunk a step."""
        growth = growth or {}
        out = {}
        for name, (rows, shape, dtype) in specs.items():
            row_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            per = int(growth[name]) if name in growth else chunk_rows_for(int(rows), row_bytes, self.chunk_bytes)
            out[name] = {"rows": int(rows), "shape": [int(s) for s in shape], "dtype": np.dtype(dtype).str,
                         "chunk_rows": per}
        return out

    def allocate(self, specs, growth=None) -> None:
        """Create (or attach to) the arrays of ``specs``; one of ``growth``
        (name -> rows of a step) starts with one step, grows by ``grow`` up to
        its spec's rows, and has a chunk file a step."""
        growth = growth or {}
        fresh = not self._meta["arrays"]
        try:
            if self.takeover:
                self._wipe()
            if fresh:
                layout = self.layout({n: (min(int(r), growth[n]) if n in growth else r, sh, dt)
                                      for n, (r, sh, dt) in specs.items()}, growth)
                self._meta["arrays"].update(layout)
                write_json(self._root / "meta.json", self._meta)  # names every file before it exists
                data = self._root / "data"
                data.mkdir(exist_ok=True)
                for name, rec in layout.items():
                    a = _Array(self._root, name, rec)
                    for k in range(a.n):
                        preallocate(a.path(k), a.sizes[k])
                fsync_dir(data)
            else:
                want = self.layout(specs, growth)
                rec = self._recorded()
                key = lambda r: (r["rows"], tuple(r["shape"]), r["dtype"])  # noqa: E731
                if set(rec) != set(want) or not all(
                        fits_spec(n, key(rec[n]), key(want[n]), growth)
                        and (n not in growth or rec[n]["chunk_rows"] == want[n]["chunk_rows"]) for n in want):
                    raise IncompatibleSnapshotError(
                        f"{self.path} holds arrays {rec}, but the buffer needs {want}")
                self._recover()  # (an interrupted conversion's leftovers, once the arrays are known to fit)
            known = self._meta.get("shared_digests") or {}
            arrays = {name: _Array(self._root, name, rec, specs[name][0] if name in growth else None)
                      for name, rec in self._meta["arrays"].items() if name not in self._hidden}
            random = self.random_reads
            if random is None:
                random = random_reads_pay(sum(sum(a.sizes) for a in arrays.values()))
            for name, a in arrays.items():
                a.map(not self.read_only, known.get(name, {}), random)
                self._arr[name], self._rw[name], self.arrays[name] = a, a.rw, a.ro
            for name, arr in self._overlay.items():  # (read_only: converted in memory, never written)
                self._rw[name] = self.arrays[name] = arr
            self._nshared = sum(int(a.shared.sum()) for a in self._arr.values())
            if not fresh and not self.read_only:
                for stale in self._leftovers():
                    os.unlink(self._root / "data" / stale)
                if not self._marked:
                    # A refusal after this (a crafted index: segments.check_index) puts the record back.
                    self._record_before = json.loads(json.dumps(self._meta))
                self._meta["clean"] = False
                if not self._marked:
                    write_json(self._root / "meta.json", self._meta)
            if self._aside is not None:
                self._settle()
        except BaseException:
            self._abort()
            raise

    # -- an older format's arrays, converted (core/legacy.py) ---------------------
    def recorded_array(self, name: str) -> np.ndarray:
        """Array ``name`` as the record ``open`` read names it, mapped
        read-only (before ``allocate``): its chunk files regular files of
        their sizes, else the error that names the file."""
        a = _Array(self._root, name, self._meta["arrays"][name])
        a.map(False, {})
        return a.ro

    def convert(self, new: dict, old: tuple, old_state: tuple = ()) -> None:
        """Record the arrays ``new`` (name -> array) in place of the recorded
        arrays ``old`` and the state files ``old_state`` (before ``allocate``,
        which then maps them). A writer writes them into this folder,
        journaled (``_relayout``: a kill -9 leaves the old folder or the new
        one); the old files go at ``close``, and an ``abort`` before puts the
        old folder back. A reader keeps ``new`` in memory, changing nothing."""
        if self._arr or self._lock is None:
            raise RuntimeError("convert() is for a storage open() just locked, before allocate()")
        layout = self.layout({n: (a.shape[0], a.shape[1:], a.dtype) for n, a in new.items()})
        if self.read_only:
            for a in new.values():
                a.flags.writeable = False
            self._overlay, self._hidden = dict(new), tuple(old)
            return
        self._recover()
        before = self._meta
        self._meta = _relayout.write_new(self._root, before, new, layout, tuple(old), tuple(old_state))
        self._converted = (before, layout)

    def _recover(self) -> None:
        """A writer's first change: an interrupted conversion (the journal
        open found) back to the old folder, or on to the new one. Not at open:
        a resume refused there (another config) leaves the folder as it was."""
        if self._journaled and not self.read_only:
            self._journaled = False
            self._meta = _relayout.recover(self._root, self._meta)

    def _recorded(self) -> dict:
        """The arrays this storage holds: the record's (a reader's conversion in memory in place of the old)."""
        rec = {n: r for n, r in self._meta["arrays"].items() if n not in self._hidden}
        rec.update(self.layout({n: (a.shape[0], a.shape[1:], a.dtype) for n, a in self._overlay.items()}))
        return rec

    def _leftovers(self) -> list[str]:
        """The copies an interrupted copy-on-write left in ``data/``: only names
        bigper gives them (``<chunk file>.cow`` of a recorded chunk), so a user's
        ``my-notes.cow`` is never touched; such a name that is not a plain file
        (a directory, FIFO, symlink) is not bigper's: ``PathExistsError``."""
        out = []
        data = self._root / "data"
        cows = [e[:-4] for e in os.listdir(data) if e.endswith(".cow")] if os.path.isdir(data) else []
        # (looked up entry by entry, as a takeover does: a record's numbers read from disk bound nothing)
        for chunk in _relayout.chunk_files(self._meta.get("arrays") or {}, cows):
            cow = chunk + ".cow"
            if entry_kind(data / cow) != "file":
                raise PathExistsError(
                    f"{self.path / 'data' / cow} is not a plain file, so not a leftover copy of "
                    "bigper's: refusing to open over it (nothing was changed)")
            out.append(cow)
        return out

    def abort(self) -> None:
        """Release without recording anything; a directory this storage created is removed."""
        self._abort()

    def _abort(self) -> None:
        """Undo a failed creation: nothing half-made stays behind (a buffer
        being replaced comes back as it was)."""
        self._drop()
        if self._aside is not None and self._lock:
            self._put_back()
        if getattr(self, "_record_before", None) is not None and self._lock:
            write_json(self._root / "meta.json", self._record_before)  # resumed, then refused: as it was
            self._record_before = None
        if self._converted is not None and self._lock:  # converted, then refused: the old folder back
            before, layout = self._converted
            self._converted = None
            _relayout.undo(self._root, before, layout)
        if self._lock:
            self._lock.release()
            self._lock = None
        self._let_go()
        if self._created:
            shutil.rmtree(self.path, ignore_errors=True)

    def _let_go(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None
        self._root = self.path

    @property
    def writable_arrays(self) -> dict:
        """Writable views by name (empty when read-only). A row inside a chunk a
        snapshot links is written only after ``prepare`` made that chunk private."""
        return self._rw

    def _drop(self) -> None:
        # The mappings go when the last array view does (a sampled row may still be held).
        self.arrays.clear()
        self._rw.clear()
        self._arr.clear()

    # -- rows ----------------------------------------------------------------
    def read(self, name, rows):
        return self.arrays[name][rows]

    def write(self, name, rows, values):
        if self._nshared:
            self._thaw_rows(self._arr[name].rows, rows)
        self._rw[name][rows] = values

    def prepare(self, writes: dict) -> None:
        """Make writable now every chunk that ``writes`` (name -> rows) will touch:
        copying a shared chunk is the one write that can fail for want of space,
        so a caller that prepares all of a step's writes first fails before any."""
        if self._nshared:
            for name, rows in writes.items():
                self._thaw(self._arr[name], rows)

    def _thaw_rows(self, nrows: int, rows) -> None:
        # Every array with these rows first: a full disk then fails before any field is written.
        for a in self._arr.values():
            if a.rows == nrows:
                self._thaw(a, rows)

    @property
    def shared_chunks(self) -> int:
        """Chunks a snapshot still shares (0: writes need no ``prepare``)."""
        return self._nshared

    def _thaw(self, a: _Array, rows) -> None:
        # Only the chunks still shared: after a snapshot this runs on every write
        # until each chunk has had its first write, so it must cost next to nothing.
        if not a.nshared:
            return
        for k in a.shared_chunks_of(rows):
            if a.shared[k]:
                if self.read_only:
                    raise InvalidArgumentError(f"{self.path} is open read_only")
                self._renamed |= a.thaw(int(k))
                self._nshared -= 1

    def grow(self, name: str, rows: int) -> None:
        """Array ``name`` (one allocated with ``growth``) holds ``rows`` rows
        from now on: meta.json names the new chunk files first (so they are
        provably bigper's), then each is made and really reserved on disk. A
        full disk is an ``OSError`` naming the file, with every file this call
        made gone again and the record as it was."""
        if self.read_only:
            raise InvalidArgumentError(f"{self.path} is open read_only")
        a = self._arr[name]
        rec = self._meta["arrays"][name]
        before = rec["rows"]
        what = f"growing {name} from {before:,} to {int(rows):,} rows"
        rec["rows"] = int(rows)
        try:
            write_json(self._root / "meta.json", self._meta)  # (atomic: as it was when it fails)
        except OSError as e:
            rec["rows"] = before
            raise OSError(e.errno, f"{e.strerror or e} ({what})", str(self._root / "meta.json")) from None
        try:
            a.grow(int(rows), True)
            fsync_dir(self._root / "data")
        except BaseException as e:
            rec["rows"] = before
            # (a record naming files that are not there is still bigper's: close rewrites it)
            with contextlib.suppress(OSError):
                write_json(self._root / "meta.json", self._meta)
            if isinstance(e, OSError) and not isinstance(e, BigperError) and not e.filename:
                raise OSError(e.errno, f"{e.strerror or e} ({what})", str(self._root / "data")) from None
            raise
        self._rw[name], self.arrays[name] = a.rw, a.ro

    def shrink(self, name: str, rows: int) -> None:
        """Array ``name`` (one allocated with ``growth``) holds ``rows`` rows
        from now on (fewer): the chunk files past them go, then meta.json
        stops naming them (named and missing is still provably bigper's)."""
        if self.read_only:
            raise InvalidArgumentError(f"{self.path} is open read_only")
        a = self._arr[name]
        shared = int(a.shared[int(rows) // a.chunk_rows:].sum())
        a.shrink(int(rows))
        self._nshared -= shared
        # The views first: the chunks past ``rows`` are unmapped now, whatever
        # the writes below do (a full disk fails meta.json's rewrite after the
        # files went, and the old views would reach into unmapped memory).
        self._rw[name], self.arrays[name] = a.rw, a.ro
        self._meta["arrays"][name]["rows"] = int(rows)
        fsync_dir(self._root / "data")
        write_json(self._root / "meta.json", self._meta)

    def rows(self, name: str) -> int:
        """Rows array ``name`` holds (an array that grows: what it grew to)."""
        return int(self._arr[name].rows)

    def release_pages(self, name: str, lo: int, hi: int) -> None:
        """Rows ``lo .. hi - 1`` of array ``name`` leave this process's RSS (a
        copy of a large storage read once); their bytes stay in the files and
        a later read maps them again."""
        if not isinstance(name, str) or name not in self.arrays:
            raise InvalidArgumentError(f"release_pages: name must be an array of this storage (one of "
                                       f"{sorted(self.arrays)}), got {name!r:.80}")
        a = self._arr.get(name)  # (None: an older layout's array converted in memory, not mapped)
        rows = a.rows if a is not None else self.arrays[name].shape[0]
        for what, v in (("lo", lo), ("hi", hi)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidTypeError(f"release_pages: {what} must be an int, got {type(v).__name__} {v!r:.80}")
        if not 0 <= lo <= hi <= rows:
            raise InvalidArgumentError(f"release_pages: rows {lo}..{hi} are not rows of array {name!r} "
                                       f"(0..{rows}, lo <= hi)")
        if a is not None:
            a.release_pages(int(lo), int(hi))

    def flush(self) -> None:
        if not self.read_only:
            for a in self._arr.values():
                a.region.sync(0, a.mapped_bytes())
            if self._renamed:  # copies that replaced shared chunk files
                fsync_dir(self._root / "data")
                self._renamed = False

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    # -- snapshots ---------------------------------------------------------------
    def chunk_table(self) -> dict:
        """name -> (layout dict, [(path, size, shared, digest or None), ...]) for snapshots."""
        out = {}
        for name, a in self._arr.items():
            rec = dict(self._meta["arrays"][name])
            out[name] = (rec, [(a.path(k), a.sizes[k], bool(a.shared[k]), a.digests[k]) for k in range(a.n)])
        return out

    def chunk_view(self, name: str, k: int) -> np.ndarray:
        """The bytes of chunk ``k`` of ``name`` (uint8, as mapped, padding included)."""
        return self._arr[name].view(k)

    def mark_shared(self, name: str, k: int, digest: str) -> None:
        """A snapshot now links chunk ``k``: map it read-only; the next write copies it."""
        a = self._arr[name]
        if a.shared[k]:
            a.digests[k] = digest
            return
        a.shared[k] = True  # first: whatever happens next, a write copies the chunk
        a.nshared += 1
        a.digests[k] = digest
        self._nshared += 1
        fd = open_regular(a.path(k), os.O_RDONLY)
        try:  # read-only from now on: a stray write faults instead of changing a snapshot
            a.region.map_file(a.offset(k), a.sizes[k], fd, writable=False)
        finally:
            os.close(fd)

    # -- state and close -------------------------------------------------------
    def previous_arrays(self, wanted=None, capacity=None):
        """The state arrays (those named in ``wanted``, or all) the buffer a
        takeover found recorded at its clean close
        (``StorageBase.previous_arrays``): read, never changed."""
        prev = self.previous
        names = prev.get("state_files") if isinstance(prev, dict) and prev.get("clean") is True else None
        if not isinstance(names, list) or not all(isinstance(n, str) and STATE_NAME.match(n) for n in names):
            return None
        limit = STATE_BYTES_PER_SLOT * (state_slots(prev.get("config"), capacity) + 1024)
        names = [n for n in names if n in wanted] if wanted is not None else names
        try:  # (none larger than a state of the recorded capacity or the caller's can be: not read)
            if any(os.lstat(self._root / "state" / f"{n}.npy").st_size > limit for n in names):
                return None
            return load_state_dir(self._root / "state", names, limit=limit)  # (and again on the file opened)
        except (CorruptSnapshotError, OSError, ValueError):
            return None

    def saved_state(self):
        """``(meta, arrays)`` the last writer recorded at close."""
        names = self._meta.get("state_files")
        return self._meta["state"], load_state_dir(self._root / "state", names if isinstance(names, list) else None)

    def close(self, state: tuple[dict, dict] | None = None) -> None:
        """Flush data, record ``state`` (``(meta, arrays)``) and mark the directory clean."""
        if self._lock is None:
            return
        gone = False
        try:
            if not self.read_only:
                self.check_present("close could not record the buffer's state")
                self.flush()
                if state is not None:
                    save_state_dir(self._root / "state", state[1])
                    self._meta["state"] = state[0]
                    self._meta["state_files"] = sorted(state[1])
                if self._arr:
                    self._meta["shared_digests"] = {
                        name: {str(k): [a.inodes[k], a.digests[k]] for k in range(a.n) if a.digests[k]}
                        for name, a in self._arr.items()}
                self._meta = _relayout.finish(self._root, self._meta)  # a conversion's old files go now
                self._converted = None
                self._meta["clean"] = True
                write_json(self._root / "meta.json", self._meta)
        except FileNotFoundError as e:
            gone = self._dir is not None and self._dir.gone()
            if not gone:
                raise
            failed = e
        finally:  # whatever failed, nothing stays held: mappings, lock, directory
            self._drop()
            self._lock.release()
            self._lock = None
            self._let_go()
        if gone:
            raise PathNotFoundError(f"{self.path} was deleted while its buffer was open: close could not "
                                    f"record the buffer's state ({failed})") from failed

    def check_present(self, what: str = "cannot go on") -> None:
        """``PathNotFoundError`` when the directory held was deleted while open."""
        if self._dir is not None and self._dir.gone():
            raise PathNotFoundError(f"{self.path} was deleted while its buffer was open: {what}")
