"""HDF5 storage: one file, one chunked dataset per array.

Datasets are chunked along rows, about ``CHUNK_BYTES`` a chunk (a few dozen
84x84 frames), optionally compressed with what h5py ships (``"lzf"``,
``"gzip"``). A batch is read with sorted unique rows: one read per dataset
for small rows, one read per row for rows of ``ROW_READ_BYTES`` or more.
Metadata and the buffer's bookkeeping live in the group ``/_bigper``; the
writer's lock is ``<file>.lock`` beside the file.

Uncompressed datasets are allocated when they are created (HDF5's early
allocation, no fill writes) and the file's blocks are then reserved with
``posix_fallocate``, so a full disk is an ``OSError`` at creation. Compressed
chunks change size as they are written, so their space cannot be reserved:
with compression a full disk surfaces later, as an error from h5py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from . import _h5relayout
from ..common.files import FileLock, HeldDir, fsync_dir, open_regular, preallocate
from ._h5guard import check_links
from .base import RECORD, StorageBase, fits_spec
from .state import check_meta, state_bytes_limit, state_slots
from ..errors import (
    BigperError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    OfflineDatasetError,
    PathExistsError,
    PathNotFoundError,
    StorageLockedError,
)

FORMAT = "bigper-hdf5"
VERSION = 1
CHUNK_BYTES = 256 * 1024
ROW_READ_BYTES = 4096  # rows at least this large are read one by one
COMPRESSIONS = (None, "lzf", "gzip")
# Bytes reserved at close beyond the state's own (HDF5 object headers, heaps, B-trees).
RESERVE_SLACK = 256 * 1024


def _h5py():
    import h5py

    return h5py


class HDF5Storage(StorageBase):
    kind = "hdf5"
    options = ("compression",)
    path_suffix = ".h5"
    close_first_at_exit = True  # h5py tears its objects down in its own exit handler

    # -- what the kind answers (storage/base.py) -----------------------------------
    @classmethod
    def restoring(cls, path: Path | None, options: dict[str, Any]) -> "HDF5Storage":
        return cls(path, compression=options.get("compression"), takeover=True)

    def snapshot_options(self) -> dict[str, Any]:
        return {"compression": self.compression}

    def check_room(self, nbytes: int) -> None:
        """Uncompressed: ``OSError(ENOSPC)`` when the folder's filesystem cannot
        hold ``nbytes`` of rows and HDF5's own metadata: HDF5 answers a full
        disk in the middle of creating a file with errors that do not say so."""
        if self.compression is not None:
            return
        where = self.path.parent
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
        want = nbytes + max(256 << 10, nbytes // 64)
        if free < want:
            raise OSError(errno.ENOSPC, f"{where} has {free:,} bytes free; loading this snapshot into an "
                                        f"HDF5 file there needs about {want:,}", str(where))

    @classmethod
    def recognizes(cls, path: Path) -> bool:
        """A regular file with its lock file beside it, or with HDF5's
        signature (a copy, a file on a read-only filesystem)."""
        if not path.is_file():
            return False
        if os.path.lexists(cls.lock_path(path)):
            return True
        try:
            fd = open_regular(path, follow=True)
        except (OSError, BigperError):
            return False
        try:
            return os.pread(fd, len(_HDF5_SIGNATURE), 0) == _HDF5_SIGNATURE
        except OSError:
            return False
        finally:
            os.close(fd)

    @classmethod
    def lock_path(cls, path: Path) -> Path:
        return path.with_name(path.name + ".lock")

    def __init__(self, path, *, read_only: bool = False, compression=None, takeover: bool = False):
        if compression not in COMPRESSIONS:
            raise InvalidArgumentError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if takeover and read_only:
            raise InvalidArgumentError("takeover=True needs a writer; read_only must be False")
        self.path = Path(os.path.abspath(path))  # resolved once: a later chdir redirects nothing
        self.read_only = read_only
        self.compression = compression
        self.takeover = takeover
        self.previous: dict | None = None  # with takeover or replace: the meta of the file replaced
        self.dsets: dict = {}
        self._file = None
        self._lock = None
        self._created = False
        self._lock_created = False
        self._meta: dict | None = None
        self._record_before = None  # the record as it was before this session marked it unclean
        self._pending = False  # the file at path is to be replaced by a new one at allocate
        self._trash: Path | None = None  # the replaced file, until the new one is complete
        self._dir: HeldDir | None = None  # the folder, held from open (see open)
        self._fp = self.path  # the path file operations go through
        self._older: Path | None = None  # convert: the file it replaced, kept until close (abort puts it back)
        self._overlay: dict = {}  # convert, read_only: the new arrays, in memory, in place of ``_hidden``
        self._hidden: tuple = ()

    def open(self, config: dict) -> dict | None:
        """Lock the path (``<file>.lock``), then look at the file: its recorded
        meta when it holds a buffer. With ``takeover`` (a snapshot load): None,
        after proving that the file there, if any, is a bigper storage (its meta
        in ``previous``); nothing changes before ``allocate``."""
        h5py = _h5py()
        if not os.path.lexists(self.path) and self.read_only:
            raise PathNotFoundError(f"no bigper HDF5 storage at {self.path}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise PathExistsError(f"a part of {self.path.parent} exists and is not a directory") from None
        # The folder is held from now on: every file operation goes through its descriptor.
        self._dir = HeldDir(self.path.parent)
        self._fp = self._dir.root / self.path.name
        lock_path = self._dir.root / (self.path.name + ".lock")
        self._lock_created = not os.path.lexists(lock_path)
        try:
            self._lock = FileLock(lock_path, shared=self.read_only, owner=self.path)
        except BaseException:
            self._let_go()
            raise
        # Looked at under the lock: a writer that created the file since must
        # not see it truncated by mode "w".
        exists = os.path.lexists(self._fp)
        try:
            if self.takeover:  # (what an interrupted replace left; a takeover killed in its _swap left its
                self._clear_trash()  # file only at its trash name)
            if exists and self.takeover:
                self.previous = peek_meta(self._fp, where=self.path)
                self._meta = self._new_meta(config)
                self._pending = True
                return None
            if exists:
                self._file = self._open_existing(h5py)
                raw = self._file.get(RECORD)
                meta = raw.attrs.get("meta") if isinstance(raw, h5py.Group) else None
                try:
                    meta = json.loads(meta) if isinstance(meta, (str, bytes)) else {}
                except (ValueError, RecursionError) as e:
                    raise CorruptSnapshotError(f"{self.path}: its /_bigper meta is not JSON ({str(e)[:200]})") \
                        from None
                self._meta = check_meta(meta, FORMAT, VERSION, self.path)
                return self._meta
            self._created = True
            self._file = h5py.File(self._fp, "w-", rdcc_nbytes=0)
            self._meta = self._new_meta(config)
            return None
        except BaseException:
            self._abort()
            raise

    def _new_meta(self, config) -> dict:
        return {"format": FORMAT, "version": VERSION, "config": config, "arrays": {},
                "clean": False, "state": None, "compression": self.compression}

    def replace(self, config: dict) -> None:
        """``mode="overwrite"``: the buffer ``open`` just found here (under the lock
        it still holds) is to be replaced by a new, empty one of ``config``. The
        old file is moved aside at ``allocate`` and removed once the new one is
        complete; ``abort`` before that puts it back."""
        if self._lock is None or self.read_only or self._file is None or self.dsets:
            raise RuntimeError("replace() is for a writer that open() just locked")
        self.previous = self._meta
        self._file.close()
        self._file = None
        self._meta = self._new_meta(config)
        self._pending = True

    def _clear_trash(self) -> None:
        """Remove what an interrupted replace (or conversion) left beside the file: plain
        files named as bigper names them (``.<name>.trash-<12 hex>``, ``.convert-``)."""
        _h5relayout.clear(self._dir.root, self.path.name)

    def _swap(self) -> None:
        """The old file aside, a new empty one in its place (under the lock)."""
        trash = self._dir.root / f".{self.path.name}.trash-{uuid.uuid4().hex[:12]}"
        os.replace(self._fp, trash)
        self._trash = trash
        self._created = True
        self._file = _h5py().File(self._fp, "w-", rdcc_nbytes=0)
        self._pending = False

    def _open_existing(self, h5py, mode: str = "r"):
        """The file at the storage path, when it is a regular HDF5 file: a FIFO or a device
        there is refused without blocking, anything h5py cannot open is left untouched. A file
        whose datasets live elsewhere (external storage or links, virtual datasets of other
        files) is refused: writing rows would write into those other files. Opened read-only
        (``mode``) until a writer's ``allocate``: HDF5 cuts a file opened for writing back to
        its end of allocation when it closes, so a writer refused before then (another
        config, a full disk in a conversion) would still have changed the file."""
        fd = open_regular(self._fp, os.O_RDONLY, follow=True, error=PathExistsError)
        os.close(fd)
        try:
            f = h5py.File(self._fp, mode, rdcc_nbytes=0)
        except OSError as e:
            if "unable to lock" in str(e).lower():
                raise StorageLockedError(f"{self.path} is open in another process (HDF5 file lock: {e})") \
                    from None
            raise PathExistsError(f"{self.path} holds a file that is not a bigper HDF5 storage ({e}); "
                                  "left untouched") from None
        try:
            check_links(f, self.path, allow_external=False)
        except OfflineDatasetError as e:
            f.close()
            raise CorruptSnapshotError(f"not a bigper HDF5 storage: {e}") from None
        return f

    def allocate(self, specs, growth=None) -> None:
        """Create (or attach to) the arrays of ``specs``; one of ``growth``
        (name -> rows of a step) starts with one step and grows by ``grow``
        up to its spec's rows, a chunk a step."""
        growth = growth or {}
        try:
            if self._pending:
                self._swap()
            elif not self.read_only and self._file.mode != "r+":  # open() read it: now it is written
                self._file.close()
                self._file = None
                self._file = self._open_existing(_h5py(), "r+")
                if self._older is None:  # (convert() cleared them, and keeps its own older file)
                    self._clear_trash()  # what a replace or a conversion left beside it: at the first change
            f = self._file
            if not self._meta["arrays"]:
                h5py, reserve = _h5py(), self.compression is None
                for name, (most, shape, dtype) in specs.items():
                    row_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                    rows = min(int(most), growth[name]) if name in growth else most
                    chunk_rows = growth[name] if name in growth else _chunk_rows(int(rows), row_bytes)
                    early = {}
                    if reserve:  # every chunk placed now; never written with fill values
                        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                        early = {"dcpl": dcpl, "fill_time": "never"}
                    f.create_dataset(name, shape=(rows, *shape), dtype=dtype,
                                     maxshape=(int(most), *shape) if name in growth else None,
                                     chunks=(chunk_rows, *shape), compression=self.compression,
                                     fillvalue=np.zeros((), dtype=dtype), **early)
                    self._meta["arrays"][name] = {"rows": rows, "shape": list(shape),
                                                  "dtype": np.dtype(dtype).str, "chunk_rows": chunk_rows}
                self._write_meta()  # the flush extends the (sparse) file over every chunk
                if reserve:
                    preallocate(self._fp, os.stat(self._fp).st_size)
            else:
                self._check_arrays(specs, growth)
                if not self.read_only:
                    # A refusal after this (a crafted index: segments.check_index) puts the record back.
                    self._record_before = json.loads(json.dumps(self._meta))
                    self._meta["clean"] = False
                    self._write_meta()
            self.dsets = {name: self._open_dataset(name) for name in self._meta["arrays"] if name not in self._hidden}
            self.dsets.update(self._overlay)  # (read_only: converted in memory, never written)
        except BaseException:
            self._abort()
            raise
        if self._trash is not None:  # the new file is complete: the replaced one goes
            self._trash.unlink(missing_ok=True)
            self._trash = None
            fsync_dir(self._dir.root)

    # -- an older format's arrays, converted (core/legacy.py) ---------------------
    def recorded_array(self, name: str):
        """Dataset ``name`` as the record ``open`` read names it (before
        ``allocate``): a dataset of this file of the record's rows, shape and
        dtype, else ``IncompatibleSnapshotError``."""
        h5py = _h5py()
        rec, d = self._meta["arrays"].get(name), self._file.get(name)
        want = None
        if isinstance(rec, dict):
            try:
                want = ((int(rec["rows"]), *(int(x) for x in rec["shape"])), np.dtype(rec["dtype"]))
            except (KeyError, TypeError, ValueError):
                pass
        if not isinstance(d, h5py.Dataset) or want is None or (d.shape, d.dtype) != want:
            have = (d.shape, d.dtype) if isinstance(d, h5py.Dataset) else type(d).__name__
            raise IncompatibleSnapshotError(f"{self.path}: array {name!r} is {have}; its record says {want}")
        return d

    def convert(self, new: dict, old: tuple, old_state: tuple = ()) -> None:
        """Record the arrays ``new`` (name -> array) in place of the recorded
        ``old`` and the state arrays ``old_state`` (before ``allocate``). A
        writer writes a new file beside this one and renames it over it
        (``_h5relayout``: a kill -9 leaves the old file or the new one); the
        old file goes at ``close``, and an ``abort`` before puts it back. A
        reader keeps ``new`` in memory, changing nothing."""
        if self.dsets or self._lock is None:
            raise RuntimeError("convert() is for a storage open() just locked, before allocate()")
        if self.read_only:
            for a in new.values():
                a.flags.writeable = False
            self._overlay, self._hidden = dict(new), tuple(old)
            return
        self._clear_trash()  # (an interrupted conversion's leftovers: not counted against the free space)
        meta = json.loads(json.dumps(self._meta))
        meta["arrays"] = {n: r for n, r in meta["arrays"].items() if n not in old}
        for name, a in new.items():
            row_bytes = int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
            meta["arrays"][name] = {"rows": int(a.shape[0]), "shape": list(a.shape[1:]), "dtype": a.dtype.str,
                                    "chunk_rows": _chunk_rows(int(a.shape[0]), row_bytes)}
        size = os.fstat(self._file.id.get_vfd_handle()).st_size
        st = os.statvfs(self._dir.root)
        if st.f_bavail * st.f_frsize < size + size // 16 + (1 << 20):
            raise OSError(errno.ENOSPC, f"{self.path} is converted from an older bigper's format into a new file "
                                        f"beside it, which needs about {size:,} bytes free; the folder has "
                                        f"{st.f_bavail * st.f_frsize:,} (nothing was changed)", str(self.path.parent))
        tmp = _h5relayout.rewrite(_h5py(), self._file, self._dir.root, self.path.name, new, tuple(old),
                                  tuple(old_state), meta)
        self._file.close()
        self._file = None
        try:
            self._older = _h5relayout.swap(self._dir.root, self.path.name, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            self._file = self._open_existing(_h5py())
        self._meta = meta

    def rows(self, name: str) -> int:
        """Rows array ``name`` holds (an array that grows: what it grew to)."""
        return int(self.dsets[name].shape[0])

    def shrink(self, name: str, rows: int) -> None:
        """Array ``name`` holds ``rows`` rows from now on (fewer: HDF5 frees
        the chunks past them for its later allocations)."""
        if self.read_only:
            raise InvalidArgumentError(f"{self.path} is open read_only")
        self.dsets[name].resize(int(rows), axis=0)
        self._meta["arrays"][name]["rows"] = int(rows)
        self._write_meta()

    def grow(self, name: str, rows: int) -> None:
        """Array ``name`` (one allocated with ``growth``) holds ``rows`` rows
        from now on, their chunks written (zeros) and the file's new bytes
        really reserved: a full disk is an ``OSError`` naming the file, with
        the dataset and the record as they were."""
        if self.read_only:
            raise InvalidArgumentError(f"{self.path} is open read_only")
        d = self.dsets[name]
        before = int(d.shape[0])
        # The new chunks' bytes (and room for HDF5's metadata) reserved past HDF5's end of
        # allocation before HDF5 writes them: HDF5 places them there, inside what is reserved,
        # so a full disk is an OSError here with nothing changed. (An ENOSPC inside HDF5 leaves
        # the library's state broken: every later flush fails.) Reserved without lengthening
        # the file (FALLOC_FL_KEEP_SIZE): a file lengthened by the reservation keeps the
        # part HDF5 does not use as zeros past its last object, 64 KiB a growth (issue 43 s. 2:
        # 171-187 bytes a transition at 20,000 Atari transitions); what is left goes at close.
        size = max(int(self._file.id.get_filesize()), 0)  # (HDF5's end of allocation, or its end of file)
        extra = (int(rows) - before) * int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize + (1 << 16)
        try:
            fd = open_regular(self._fp, os.O_RDWR)
            try:
                _fallocate_keep_size(fd, size, extra)
            finally:
                os.close(fd)
        except OSError as e:
            with contextlib.suppress(OSError):  # (blocks reserved past the end go back)
                os.truncate(self._fp, os.stat(self._fp).st_size)
            raise OSError(e.errno, f"{e.strerror or e} (growing {name} to {int(rows):,} rows: reserving "
                          f"{extra:,} bytes)", str(self.path)) from None
        try:
            d.resize(int(rows), axis=0)
            d[before:int(rows)] = 0
            self._meta["arrays"][name]["rows"] = int(rows)
            self._write_meta()
            preallocate(self._fp, os.stat(self._fp).st_size)
        except BaseException as e:
            self._meta["arrays"][name]["rows"] = before
            with contextlib.suppress(Exception):
                d.resize(before, axis=0)
                self._write_meta()
            if isinstance(e, OSError) and not e.filename:
                raise OSError(e.errno, f"{e.strerror or e} (growing {name} to {rows:,} rows)", str(self.path)) from e
            raise

    def _check_arrays(self, specs, growth=None) -> None:
        """A reopened file's recorded arrays and its datasets must be what ``specs`` asks for
        (rows, row shape, dtype), before anything is written: a crafted or foreign record
        must not let rows land outside a dataset or in another one."""
        h5py = _h5py()
        arrays = self._meta.get("arrays")
        if isinstance(arrays, dict) and self._hidden:
            arrays = {n: r for n, r in arrays.items() if n not in self._hidden} | dict.fromkeys(self._overlay)
        if not isinstance(arrays, dict) or set(arrays) != set(specs):
            got = sorted(arrays) if isinstance(arrays, dict) else arrays
            raise IncompatibleSnapshotError(f"{self.path} records arrays {got!r:.200}; this buffer has "
                                            f"{sorted(specs)}")
        growth = growth or {}
        for name, (rows, shape, dtype) in specs.items():
            d = self._overlay[name] if name in self._overlay else self._file.get(name)
            want = ((int(rows), *map(int, shape)), np.dtype(dtype))
            if not isinstance(d, (h5py.Dataset, np.ndarray)) or not fits_spec(
                    name, (d.shape[0], d.shape[1:], d.dtype), (want[0][0], want[0][1:], want[1]), growth) \
                    or (name in growth and (isinstance(d, np.ndarray) or d.chunks is None or d.chunks[0] != growth[name]
                                            or (d.maxshape[0] or 0) < int(rows))):
                have = (d.shape, d.dtype) if isinstance(d, (h5py.Dataset, np.ndarray)) else type(d).__name__
                raise IncompatibleSnapshotError(f"{self.path}: array {name!r} is {have}; this buffer needs "
                                                f"{want}")

    def _open_dataset(self, name: str):
        """``name`` with a chunk cache where it is compressed. The file has none:
        an uncompressed row is then read or written in place, where a cache
        would move its whole chunk (for random rows, a miss every time)."""
        h5py = _h5py()
        dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
        if self._meta.get("compression") is not None:
            dapl.set_chunk_cache(521, 16 * CHUNK_BYTES, 0.75)
        return h5py.Dataset(h5py.h5d.open(self._file.id, name.encode(), dapl=dapl))

    def _write_meta(self) -> None:
        g = self._file.require_group(RECORD)
        g.attrs["meta"] = json.dumps(self._meta)
        self._file.flush()

    def abort(self) -> None:
        """Release without recording anything; a file this storage created is
        removed, and a file it was replacing is put back."""
        self._abort()

    def _abort(self) -> None:
        if self._file is not None:
            if self._record_before is not None:  # resumed, then refused: the record as it was
                with contextlib.suppress(Exception):
                    self._meta, self._record_before = self._record_before, None
                    self._write_meta()
            self._file.close()
            self._file = None
        if self._older is not None:  # converted, then refused: the older file back at its name
            os.replace(self._older, self._fp)
            self._older = None
            fsync_dir(self._dir.root)
        if self._created and os.path.lexists(self._fp):
            os.unlink(self._fp)
        if self._trash is not None:
            os.replace(self._trash, self._fp)
            self._trash = None
            self._created = False
        if self._lock:
            # leave no lock of ours beside a failed creation or a file that is not ours
            # (a reader on a read-only filesystem holds no lock file: fd -1, nothing to remove)
            if self._lock_created and self._lock.fd >= 0 and (self._created or self._meta is None):
                self._lock.path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None
        self._let_go()

    def _let_go(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None
        self._fp = self.path

    # -- rows ----------------------------------------------------------------
    def read(self, name, rows):
        rows = np.asarray(rows)
        d = self.dsets[name]
        if rows.ndim == 0:
            return d[int(rows)]
        uniq, inverse = np.unique(rows, return_inverse=True)
        if d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64)) < ROW_READ_BYTES:
            return d[uniq][inverse.reshape(rows.shape)]
        # Large rows (frames) one at a time: HDF5 builds the union of many
        # row hyperslabs slowly (about 1 ms a row for 84x84 frames), while a
        # single row is one simple selection (tens of microseconds).
        out = np.empty((uniq.shape[0], *d.shape[1:]), dtype=d.dtype)
        for k, r in enumerate(uniq.tolist()):
            out[k] = d[r]
        return out[inverse.reshape(rows.shape)]

    def write(self, name, rows, values):
        d = self.dsets[name]
        if isinstance(rows, (slice, int, np.integer)):
            d[rows] = values
            return
        rows = np.asarray(rows)
        order = np.argsort(rows, kind="stable")
        d[rows[order]] = np.asarray(values)[order]

    def flush(self) -> None:
        self._file.flush()

    def nbytes(self) -> int:
        return sum(int(d.nbytes) if name in self._overlay else int(d.id.get_storage_size())
                   for name, d in self.dsets.items())

    # -- state and close -------------------------------------------------------
    def saved_state(self):
        """The recorded state: meta and arrays (``_state_group``)."""
        return self._meta["state"], _state_group(self._file, self._meta, self.path)

    def previous_arrays(self, wanted=None, capacity=None):
        """The state arrays (those named in ``wanted``, or all) the buffer a
        takeover found recorded at its clean close
        (``StorageBase.previous_arrays``): the file read, never changed."""
        prev = self.previous
        if not isinstance(prev, dict) or prev.get("clean") is not True or self._file is not None:
            return None
        h5py = _h5py()
        try:
            if not stat.S_ISREG(os.lstat(self._fp).st_mode):  # (peek_meta proved it one; no FIFO reaches h5py)
                return None
            with h5py.File(self._fp, "r") as f:
                check_links(f, self.path, allow_external=False)  # (as open does: no bytes read from elsewhere)
                return _state_group(f, prev, self.path, wanted, capacity)
        except Exception:  # noqa: BLE001  (h5py refuses in many ways; each means "none to compare")
            return None

    def close(self, state: tuple[dict, dict] | None = None) -> None:
        """Record ``state`` and mark the file clean, then release it.

        A full disk must not reach HDF5 here: h5py reports a failed write of
        metadata only from a destructor ("Exception ignored in ObjectID.__dealloc__"),
        ``close`` would return as if all was recorded, and the library crashes the
        process later. So the bytes this close can add are reserved first
        (``posix_fallocate`` past the end of the file, where HDF5 allocates): when
        that fails nothing is written and ``OSError`` is raised; the file stays
        marked unclean (its writer set that at open), so it is refused with
        ``UncleanStorageError`` until it is resumed from a snapshot. The lock is
        released either way.

        Raises
        ------
        OSError
            The state could not be recorded (disk full, or an I/O error).
        """
        if self._file is None:
            return
        failed = None
        written = not self.read_only and self._file.mode == "r+"  # (a writer before allocate changed nothing)
        try:
            if written:
                self._file.flush()  # rows still cached (compressed chunks): their errors raise here
                self._reserve(state)
                if state is not None:
                    self._write_state(state)
                self._meta["clean"] = True
                self._write_meta()
        except Exception as e:  # noqa: BLE001 (h5py raises RuntimeError, OSError, ValueError)
            failed = e
            self._discard_writes()
        try:
            self._file.close()
        except Exception as e:  # noqa: BLE001
            failed = failed or e
        self._file = None
        try:
            if written:
                fd = os.open(self._fp, os.O_RDWR)
                try:  # blocks reserved past the end and not used go back (size unchanged)
                    os.ftruncate(fd, os.fstat(fd).st_size)
                    if failed is None:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if failed is None:
                    if self._older is not None:  # a conversion's older file: recorded over, it goes
                        self._older.unlink(missing_ok=True)
                        self._older = None
                    fsync_dir(self._dir.root)
        except OSError as e:
            failed = e
        finally:
            gone = failed is not None and self._dir is not None and \
                (self._dir.gone() or not os.path.lexists(self._fp))
            self._lock.release()
            self._lock = None
            self._let_go()
        if gone:
            raise PathNotFoundError(f"{self.path} was deleted while its buffer was open: close could not "
                                    f"record the buffer's state ({failed})") from failed
        if failed is not None:
            raise OSError(getattr(failed, "errno", None) or errno.EIO,
                          f"{self.path}: close could not record the buffer's state ({failed}); the file is "
                          "left unclean and will be refused on reopen: resume from a snapshot") from failed

    def _discard_writes(self) -> None:
        """After a failed write HDF5 still holds dirty metadata; closing would retry it
        on the full disk, fail inside a destructor and leave the library in a state
        that crashes the process later. Point the file's descriptor at an anonymous
        in-memory file instead: the close completes, what it writes goes nowhere, and
        the file on disk keeps what was flushed before (marked unclean at open)."""
        try:
            vfd = self._file.id.get_vfd_handle()
            sink = os.memfd_create("bigper-discarded-hdf5-writes")
        except (OSError, AttributeError, RuntimeError, ValueError):
            return
        try:
            os.ftruncate(sink, os.fstat(vfd).st_size)
            os.dup2(sink, vfd)
        finally:
            os.close(sink)

    def _write_state(self, state) -> None:
        g = self._file.require_group(f"{RECORD}/state")
        for name, arr in state[1].items():
            old = g.get(name)
            if old is not None and old.shape == arr.shape and old.dtype == arr.dtype:
                old[...] = arr  # in place: reopen cycles do not grow the file
                continue
            if old is not None:
                del g[name]
            g.create_dataset(name, data=arr)
        self._meta["state"] = state[0]

    def _reserve(self, state) -> None:
        """Reserve, past the file's end, the space this close may need (state arrays,
        the meta attribute, HDF5's headers); ``OSError`` when the disk cannot give it.
        The file's size is kept (HDF5 must not see a longer file): the blocks wait
        beyond the end for the writes that extend it."""
        arrays = state[1] if state is not None else {}
        meta = dict(self._meta, clean=True, state=state[0] if state is not None else self._meta.get("state"))
        need = sum(int(np.asarray(a).nbytes) for a in arrays.values())
        need = 2 * (need + len(json.dumps(meta))) + RESERVE_SLACK + 4096 * len(arrays)
        fd = os.open(self._fp, os.O_RDWR)
        try:
            _fallocate_keep_size(fd, os.fstat(fd).st_size, need)
        finally:
            os.close(fd)


_FALLOC_FL_KEEP_SIZE = 1


def _chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows a chunk of a dataset of ``rows`` rows: about ``CHUNK_BYTES`` a
    chunk, the rows spread evenly over the chunks, so the last one does not
    hang far past them (its space is allocated whole)."""
    per = max(1, min(rows, CHUNK_BYTES // max(row_bytes, 1)))
    n = -(-rows // per)
    return max(1, -(-rows // n))


def _fallocate_keep_size(fd: int, offset: int, length: int) -> None:
    """``fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length)``: blocks reserved, size unchanged.
    Where the call or the flag is missing, the free space is only looked at (``statvfs``),
    not reserved. ENOSPC raises ``OSError``."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC and _LIBC.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    err = ctypes.get_errno() if _LIBC else errno.ENOSYS
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err))
    st = os.fstatvfs(fd)
    if st.f_bavail * st.f_frsize < length:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({st.f_bavail * st.f_frsize} bytes free, "
                                    f"{length} needed)")


_LIBC = None


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _state_group(f, meta: dict, where, wanted=None, capacity=None) -> dict:
    """The arrays of ``f``'s recorded state (``/_bigper/state``; those named
    in ``wanted``, or all), each checked before it is read: a numeric dataset
    of this file, none larger than a state of the recorded capacity (or of
    ``capacity`` slots, when given and smaller: ``state_slots``) can be."""
    h5py = _h5py()
    g = f.get(f"{RECORD}/state")
    if g is None:
        return {}
    if not isinstance(g, h5py.Group):
        raise CorruptSnapshotError(f"{where}: /_bigper/state is not a group")
    cap = state_slots(meta.get("config"), capacity)
    limit = state_bytes_limit(meta.get("config"), capacity)
    arrays = {}
    for name in g:
        if wanted is not None and name not in wanted:
            continue
        d = g.get(name)
        if not isinstance(d, h5py.Dataset) or d.dtype.hasobject or d.dtype.kind not in "biuf":
            raise CorruptSnapshotError(f"{where}: recorded state {name!r} is not a numeric dataset")
        nbytes = int(np.prod(d.shape, dtype=object)) * d.dtype.itemsize
        if nbytes > limit:
            raise CorruptSnapshotError(f"{where}: recorded state {name!r} of shape {d.shape} is larger "
                                       f"than any state of a {cap}-slot buffer")
        arrays[name] = d[()]
    return arrays


def peek_meta(path: Path, where=None) -> dict:
    """The meta of the bigper HDF5 storage at ``path``, read without changing
    it; ``PathExistsError`` for anything else (a symlink, a special file, a file
    that is not HDF5, an HDF5 file without bigper's marker, one h5py cannot
    read): bigper replaces only what carries its own marker. The caller holds
    the storage's lock (a live writer is ``StorageLockedError`` before this)."""
    h5py = _h5py()
    path, where = Path(path), where or path
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise PathExistsError(f"{where} exists and is not a regular file (a symlink, directory or "
                              "special file): refusing to replace it")
    fd = open_regular(path, error=PathExistsError)  # no FIFO reaches h5py
    try:
        head = os.pread(fd, len(_HDF5_SIGNATURE), 0)
    finally:
        os.close(fd)
    if head != _HDF5_SIGNATURE:
        raise PathExistsError(f"{where} exists and is not a bigper HDF5 storage (not an HDF5 file): "
                              "refusing to replace it")
    try:
        with h5py.File(path, "r") as f:
            g = f.get(RECORD)
            raw = g.attrs.get("meta") if isinstance(g, h5py.Group) else None
            meta = json.loads(raw) if isinstance(raw, (str, bytes)) else None
    except Exception as e:  # noqa: BLE001  (h5py and json refuse in many ways; each means "not provably ours")
        if "unable to lock" in str(e).lower():
            raise StorageLockedError(f"{where} is open in another process (HDF5 file lock: {e})") from None
        raise PathExistsError(f"{where} is an HDF5 file that cannot be read as a bigper storage "
                              f"({str(e)[:120]}): refusing to replace it; remove it yourself if it is "
                              "a dead writer's") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PathExistsError(f"{where} is an HDF5 file but not a bigper storage: refusing to replace it")
    return meta
