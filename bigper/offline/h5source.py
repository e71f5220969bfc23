"""An HDF5 dataset opened in place as a read-only storage: D4RL, Minari or bigper's own layout.

Transitions are numbered ``0 .. n-1`` in file order (episode by episode for
Minari; slots for bigper's layout) and that number is the buffer's slot. Each
field a batch carries is a :class:`~bigper.offline._h5map.Column` over the
file's datasets::

    D4RL (one dataset per name at the root, one row per transition)
      obs <- observations      action <- actions      reward <- rewards
      next_obs <- next_observations, else observations[t + 1]
      terminated <- terminals  truncated <- timeouts   any other dataset with n rows

    Minari (one group per episode; observations has one more row than actions)
      obs <- observations[t]   next_obs <- observations[t + 1]
      action <- actions        reward <- rewards
      terminated <- terminations, truncated <- truncations
      a dict observation obs/<key>/<key2> becomes the field obs_<key>_<key2>;
      infos/<key> becomes info_<key> (the info of the step, when recorded)

    bigper (the HDF5 storage's file): its datasets by name, its recorded state

Without ``next_observations`` a D4RL transition that ends by timeout has no
known next observation (the next row starts another episode): it is held but
never sampled or scored. A terminal one reads its own observation as
``next_obs``, a placeholder that its zero discount never uses.

The file is opened with h5py in mode ``"r"`` and mapped read-only; nothing here
writes to it. The end flags (``n`` bytes) and per-episode offsets are the only
arrays held in memory; data is read at sample time (see ``_h5map``): through
the map for the smallest datasets, up to ``MAP_BYTES`` in all, with pread for
the others, so that a file larger than memory never stays in the RSS.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
from pathlib import Path

import numpy as np

from ..errors import (
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidIndexError,
    InvalidTypeError,
    PathNotFoundError,
    StorageLockedError,
    UncleanStorageError,
    UnknownFieldError,
)
from ..common.files import open_regular
from ..storage.base import StorageBase, fits_spec
from ..storage._h5guard import check_links
from ._h5layouts import _RESERVED, DEAD, LIVE, Layouts, OfflineDatasetError
from ._h5map import map_column, plan_reads, read_column, row_order

__all__ = ["H5Source", "OfflineDatasetError", "LAYOUTS", "LIVE", "DEAD"]

LAYOUTS = ("auto", "d4rl", "minari", "bigper")
# Bytes of datasets read through the file's map, smallest first; larger ones are read with
# pread, so that sampling a file larger than memory keeps at most this much of it in RSS
# (``_h5map.plan_reads``).
MAP_BYTES = 1 << 30


class H5Source(Layouts, StorageBase):
    """A read-only storage over an HDF5 dataset; see the module docstring.

    Parameters
    ----------
    dataset : str or Path
        An HDF5 file, or a Minari dataset directory (holding ``data/main_data.hdf5``).
    layout : {"auto", "d4rl", "minari", "bigper"}
    cache_bytes : int
        h5py's chunk cache, used by datasets that are not memory-mapped (compressed ones).
    held : bool
        The caller holds the file's own lock (``<file>.lock``) exclusively, as
        ``convert`` does at its dst: no shared one is taken.
    """

    kind = "hdf5-source"
    # Data is read-only; priorities stay writable (they live in the sidecar).
    read_only = True
    priorities_writable = True

    def __init__(self, dataset, *, layout: str = "auto", cache_bytes: int = 64 << 20,
                 allow_external: bool = False, taken=_RESERVED, held: bool = False):
        import h5py

        # Names no column may take as its field (the offline layer passes every name
        # bigper keeps for itself, core/layout.py own_names): such a column is skipped.
        self.taken = frozenset(taken) | _RESERVED
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(allow_external, bool):
            raise InvalidTypeError(f"allow_external must be True or False, got {allow_external!r}")
        self.path = Path(dataset).expanduser().absolute()
        if not os.path.lexists(self.path):
            raise PathNotFoundError(f"no dataset at {self.path}")
        self.file_path = self.path
        if self.path.is_dir():
            self.file_path = self.path / "data" / "main_data.hdf5"
            if not os.path.lexists(self.file_path):
                raise OfflineDatasetError(f"{self.path} is a directory without data/main_data.hdf5 "
                                          "(a Minari dataset directory holds one)")
        self.notes: list[str] = []
        self.on_close = None
        self._lock_fd = -1
        self._held = held
        self._map = None
        self._file = None
        self.recorded_arrays: dict = {}  # bigper's layout: the arrays its record names
        self.overlay: dict = {}  # an older bigper's references, converted in memory (convert)
        # The file itself first, without blocking: a FIFO or a device in its place (or at
        # the end of a symlink the user gave) is refused before HDF5 opens it. Read-only,
        # here and in h5py: nothing in bigper ever opens a dataset for writing.
        try:
            self._fd = open_regular(self.file_path, os.O_RDONLY, follow=True, error=OfflineDatasetError)
        except FileNotFoundError:
            raise PathNotFoundError(f"no dataset at {self.file_path} (a dangling symlink?)") from None
        except OSError as e:
            raise OfflineDatasetError(f"{self.file_path} cannot be opened: {e.strerror}") from None
        st = os.fstat(self._fd)
        self.file_id = (st.st_dev, st.st_ino)
        self._size = st.st_size
        try:
            self._file = self._open_h5(h5py, cache_bytes)
            check_links(self._file, self.file_path, allow_external)
            try:
                self._open(layout)
            except (OfflineDatasetError, StorageLockedError, IncompatibleSnapshotError, UncleanStorageError):
                raise
            except (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError, OverflowError,
                    RecursionError, MemoryError) as e:
                # h5py's errors on a crafted file (links in loops, unreadable types, bad
                # metadata): bigper's error, naming the file
                raise OfflineDatasetError(f"{self.file_path} cannot be read as a dataset: "
                                          f"{type(e).__name__}: {str(e)[:300]}") from None
        except BaseException:
            self._release()
            raise

    def _open_h5(self, h5py, cache_bytes: int):
        try:
            f = h5py.File(self.file_path, "r", rdcc_nbytes=cache_bytes)
        except OSError as e:
            msg = str(e)
            if "unable to lock file" not in msg.lower():  # (not any "lock": a truncated file's says "sblock")
                raise OfflineDatasetError(f"{self.file_path} cannot be opened as an HDF5 file: {e}") from None
            if "errno = 11" in msg:  # EAGAIN: a writer holds HDF5's own file lock
                raise StorageLockedError(f"{self.file_path} is open for writing in another process "
                                         f"(HDF5 file lock: {e})") from None
            # file systems without locks (read-only mounts, some NFS): read without one
            f = h5py.File(self.file_path, "r", rdcc_nbytes=cache_bytes, locking=False)
        if f.driver == "sec2":  # the file h5py opened is the one checked above, not a swapped one
            st = os.fstat(f.id.get_vfd_handle())
            if (st.st_dev, st.st_ino) != self.file_id:
                f.close()
                raise OfflineDatasetError(f"{self.file_path} was replaced while it was being opened")
        return f

    # -- layouts ---------------------------------------------------------------
    def _open(self, layout: str) -> None:
        f = self._file
        if layout == "auto":
            if "_bigper" in f and "meta" in f["_bigper"].attrs:
                layout = "bigper"
            elif any(re.fullmatch(r"episode_\d+", k) for k in f.keys()):
                layout = "minari"
            elif "observations" in f:
                layout = "d4rl"
            else:
                raise OfflineDatasetError(
                    f"{self.file_path} is not a D4RL, Minari or bigper HDF5 dataset: no 'observations' "
                    f"dataset, no episode_<i> groups, no _bigper group (found {sorted(f.keys())[:20]})")
        self.layout = layout
        self.recorded = None
        getattr(self, f"_open_{layout}")(f)
        self.starts = np.asarray(self.starts, dtype=np.int64)
        self._one_segment = self.starts.shape[0] == 2
        mm = None
        if f.driver == "sec2" and self._size > 0:
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            self.advise(sequential=False)
            mm = np.frombuffer(self._map, dtype=np.uint8)
        self._mm = mm
        for col in self.columns.values():
            map_column(col, f, mm)
        plan_reads(self.columns.values(), MAP_BYTES)

    # -- what the buffer is built from -------------------------------------------
    def fields(self) -> dict:
        """Config fields: name -> (shape, dtype), without successors and end flags."""
        nexts = {f"next_{n}" for n in self.next_of}
        return {n: (c.shape, c.dtype.newbyteorder("=")) for n, c in self.columns.items()
                if n not in nexts and n not in self.taken}

    def fingerprint(self) -> dict:
        """What a priorities sidecar must match: name, layout, length, schema and episode checksums."""
        import xxhash

        schema = sorted((n, list(c.shape), c.dtype.str, c.source) for n, c in self.columns.items())
        h = xxhash.xxh64()
        for a in (self.starts, self.ends, self.status):
            h.update(np.ascontiguousarray(a).tobytes())
        return {"name": self.path.name, "layout": self.layout, "transitions": int(self.n),
                "schema": xxhash.xxh64(json.dumps(schema).encode()).hexdigest(),
                "episodes": h.hexdigest()}

    # -- the Storage protocol ------------------------------------------------------
    def open(self, config: dict):
        return None

    def saved_state(self):
        """The recorded state; its arrays until ``opened`` lets them go."""
        return ({}, {}) if self.recorded is None else (self.recorded[1], self.recorded[2])

    def opened(self) -> None:
        """The buffer's initial state is built (``datasets._initial_state``): the
        record's arrays read at open are let go, the recorded leaves above all
        (8 bytes a slot, 400 MB at 50M); the ends and status stay, this source's
        own. ``saved_state`` gives no arrays after it: nothing reads the record of
        an open dataset again."""
        if self.recorded is not None:
            self.recorded = (*self.recorded[:2], {})

    def recorded_array(self, name: str):
        """Dataset ``name`` of bigper's layout, read-only (its record and shape checked at open)."""
        return self._file[name]

    def convert(self, new: dict, old: tuple, old_state: tuple = ()) -> None:
        """An older bigper's arrays ``old`` read as ``new`` (name -> array), in
        memory: the file is never written."""
        for a in new.values():
            a.flags.writeable = False
        self.overlay = dict(new)

    def allocate(self, specs, growth=None) -> None:
        """Check the dataset holds ``specs`` (an array of ``growth``: whole steps, at most its rows)."""
        growth = growth or {}
        for name, (rows, shape, dtype) in specs.items():
            if name in ("terminated", "truncated"):
                continue
            if name in self.overlay:
                a = self.overlay[name]
                if (a.shape[0], a.shape[1:], a.dtype) != (rows, tuple(shape), np.dtype(dtype)):
                    raise OfflineDatasetError(f"{self.file_path}: the buffer asks for {name!r} {(rows, tuple(shape))} "
                                              f"{np.dtype(dtype)}, converted it is {a.shape} {a.dtype}")
                continue
            col = self.columns.get(name)
            want = None if col is None else (int(col.seg_rows.sum()) if self.recorded else self.n)
            if col is None or not fits_spec(name, (want, tuple(col.shape)), (rows, tuple(shape)), growth):
                have = None if col is None else (want, col.shape)
                raise OfflineDatasetError(f"{self.file_path}: the buffer asks for {name!r} "
                                          f"{(rows, tuple(shape))}, the dataset has {have}")

    def rows(self, name: str) -> int:
        """Rows the dataset holds of array ``name``."""
        if name in self.overlay:
            return int(self.overlay[name].shape[0])
        col = self.columns[name]
        return int(col.seg_rows.sum()) if self.recorded else self.n

    def read(self, name, rows):
        rows = np.asarray(rows)
        if name in self.overlay:  # (converted in memory: bounds as for a column)
            a = self.overlay[name]
            if rows.size and (rows.min() < 0 or rows.max() >= a.shape[0]):
                raise InvalidIndexError(f"a row of {name!r} is out of range [0, {a.shape[0]}) in {self.path}")
            return a[rows]
        if rows.ndim != 1:
            return self.read(name, rows.reshape(-1)).reshape(rows.shape + self._shape(name))
        flags = name in ("terminated", "truncated")
        col = None if flags else self.columns.get(name)
        if col is None and not flags:
            raise UnknownFieldError(f"{name!r} is not a field of {self.path}; fields: {sorted(self.columns)}")
        # bigper's layout holds arrays of other lengths (the frame ring): bound by the array
        limit = int(col.seg_rows[0]) if col is not None and self.recorded else self.n
        seg, t, uniq, inverse = self._plan_for(rows)
        if uniq.shape[0] and (uniq[0] < 0 or uniq[-1] >= limit):
            bad = uniq[0] if uniq[0] < 0 else uniq[-1]
            raise InvalidIndexError(f"row {bad} of {name!r} is out of range [0, {limit}) in {self.path}")
        if flags:
            out = (self.ends[uniq] & (1 if name == "terminated" else 2)) != 0
        else:
            out = read_column(col, self._file, self._mm, seg, t, uniq, self._pread, self._fd)
        return out if inverse is None else out[inverse]

    def _shape(self, name) -> tuple:
        return () if name in ("terminated", "truncated") else self.columns[name].shape

    def _plan_for(self, rows: np.ndarray):
        """Sorted unique rows, their segments and steps, and how to undo the sort."""
        r = rows.astype(np.int64, copy=False)
        n = r.shape[0]
        inverse = None
        order = row_order(r) if n > 1 else 0
        if order:
            if order == 1:  # sorted with repeats (stratified sampling): no sort needed
                keep = np.empty(n, dtype=bool)
                keep[0] = True
                np.not_equal(r[1:], r[:-1], out=keep[1:])
                inverse = np.cumsum(keep) - 1
                r = r[keep]
            else:
                r, inverse = np.unique(r, return_inverse=True)
        if self._one_segment:
            seg, t = np.zeros(r.shape[0], dtype=np.int64), r
        else:
            seg = np.searchsorted(self.starts, r, side="right") - 1
            t = r - self.starts[seg]
        return seg, t, r, inverse

    def write(self, name, rows, values):
        raise InvalidArgumentError(f"{self.path} is an offline dataset, opened read-only: add and extend cannot "
                         "write to it (update_priorities can)")

    def flush(self) -> None:
        pass

    def nbytes(self) -> int:
        # The file opened, by its descriptor: the name may lead elsewhere by now.
        return os.fstat(self._fd).st_size if self._fd >= 0 else os.path.getsize(self.file_path)

    def close(self, state=None) -> None:
        try:
            if self.on_close is not None:
                hook, self.on_close = self.on_close, None
                hook()
        finally:
            self._release()

    def advise(self, sequential: bool) -> None:
        """How the map is read: ``sequential=False`` (from open on) a row here and
        there, as sampling reads (``MADV_RANDOM``: a page fault reads its page, not
        the 128 KB of read-ahead around it; on a 50M-transition file larger than
        the page cache, a B=32 round took 4.4 ms with read-ahead, 1.2 ms without);
        ``sequential=True`` in order, as a streamed pass reads (``MADV_NORMAL``: the
        kernel's read-ahead, and no drop-behind, which ``MADV_SEQUENTIAL`` would add:
        the pages read stay cached for the sampling after it). Best effort: nothing
        where the system has no such advice."""
        flag = getattr(mmap, "MADV_NORMAL" if sequential else "MADV_RANDOM", None)
        if self._map is not None and flag is not None:
            try:
                self._map.madvise(flag)
            except (OSError, ValueError):
                pass

    def release_pages(self, name: str | None = None, lo: int = 0, hi: int = 0) -> None:
        """Every page of the file this process has mapped leaves its RSS, whichever
        rows are named (``MADV_DONTNEED`` over the read-only map: clean pages,
        still in the page cache; a later read maps them again). A streamed pass
        over a dataset larger than memory (``score_all``, the checks at open) calls
        it as it goes, so its RSS is a batch's pages, not the file's. Best effort:
        nothing where the system has no such advice."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._map.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    def _pread(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (C-contiguous) with the file's bytes from ``offset``."""
        view = memoryview(out).cast("B")
        while view.nbytes:
            got = os.preadv(self._fd, [view], offset)
            if got <= 0:
                raise OSError(f"{self.file_path}: unexpected end of file at byte {offset}")
            view, offset = view[got:], offset + got

    def _release(self) -> None:
        # (Reads run under the buffer's lock, as close does: the descriptor closed here is
        # never in a pread of another thread, whose number could name another file by then.)
        self._mm = None
        for col in getattr(self, "columns", {}).values():
            col.runs = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the map goes with it
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


@contextlib.contextmanager
def in_order(store):
    """A pass over ``store`` in the order of its rows (``reprioritize``, ``convert``):
    an ``H5Source``'s map is read ahead for the pass (``advise``) and random again
    after; it gives a callable that lets go of the pages read so far
    (``release_pages``), to call after each batch. Any other storage: nothing."""
    if not isinstance(store, H5Source):
        yield lambda: None
        return
    store.advise(sequential=True)
    try:
        yield store.release_pages
    finally:
        store.advise(sequential=False)
