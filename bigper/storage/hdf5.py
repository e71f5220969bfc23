"""HDF5 storage: one file, one chunked dataset per array.

Datasets are chunked along rows, about ``CHUNK_BYTES`` a chunk (a few dozen
84x84 frames), optionally compressed with what h5py ships (``"lzf"``,
``"gzip"``). A batch is read with sorted unique rows, one read per dataset.
Metadata and the buffer's bookkeeping live in the group ``/_bigper``; the
writer's lock is ``<file>.lock`` beside the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ._files import FileLock, fsync_dir
from ._state import check_meta

FORMAT = "bigper-hdf5"
VERSION = 1
CHUNK_BYTES = 256 * 1024
COMPRESSIONS = (None, "lzf", "gzip")


def _h5py():
    import h5py

    return h5py


class HDF5Storage:
    kind = "hdf5"

    def __init__(self, path, *, read_only: bool = False, compression=None):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.path = Path(path)
        self.read_only = read_only
        self.compression = compression
        self.dsets: dict = {}
        self._file = None
        self._lock = None
        self._created = False
        self._meta: dict | None = None

    def open(self, config: dict) -> dict | None:
        h5py = _h5py()
        exists = self.path.exists()
        if not exists and self.read_only:
            raise FileNotFoundError(f"no bigper HDF5 storage at {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(self.path.with_name(self.path.name + ".lock"), shared=self.read_only,
                              owner=self.path)
        try:
            if exists:
                self._file = h5py.File(self.path, "r" if self.read_only else "r+")
                raw = self._file.get("_bigper")
                meta = json.loads(raw.attrs["meta"]) if raw is not None and "meta" in raw.attrs else {}
                self._meta = check_meta(meta, FORMAT, VERSION, self.path)
                return self._meta
            self._created = True
            self._file = h5py.File(self.path, "w", rdcc_nbytes=16 * CHUNK_BYTES)
            self._meta = {"format": FORMAT, "version": VERSION, "config": config, "arrays": {},
                          "clean": False, "state": None, "compression": self.compression}
            return None
        except BaseException:
            self._abort()
            raise

    def allocate(self, specs) -> None:
        f = self._file
        try:
            if not self._meta["arrays"]:
                for name, (rows, shape, dtype) in specs.items():
                    row_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                    chunk_rows = int(max(1, min(rows, CHUNK_BYTES // max(row_bytes, 1))))
                    f.create_dataset(name, shape=(rows, *shape), dtype=dtype,
                                     chunks=(chunk_rows, *shape), compression=self.compression,
                                     fillvalue=np.zeros((), dtype=dtype))
                    self._meta["arrays"][name] = {"rows": rows, "shape": list(shape),
                                                  "dtype": np.dtype(dtype).str, "chunk_rows": chunk_rows}
                self._write_meta()
            elif not self.read_only:
                self._meta["clean"] = False
                self._write_meta()
            self.dsets = {name: f[name] for name in self._meta["arrays"]}
        except BaseException:
            self._abort()
            raise

    def _write_meta(self) -> None:
        g = self._file.require_group("_bigper")
        g.attrs["meta"] = json.dumps(self._meta)
        self._file.flush()

    def _abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._created and self.path.exists():
            self.path.unlink()
        if self._lock:
            self._lock.release()
            self._lock = None

    # -- rows ----------------------------------------------------------------
    def read(self, name, rows):
        rows = np.asarray(rows)
        if rows.ndim == 0:
            return self.dsets[name][int(rows)]
        uniq, inverse = np.unique(rows, return_inverse=True)
        return self.dsets[name][uniq][inverse.reshape(rows.shape)]

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
        return sum(int(d.id.get_storage_size()) for d in self.dsets.values())

    # -- state and close -------------------------------------------------------
    def saved_state(self):
        g = self._file.get("_bigper/state")
        arrays = {name: g[name][()] for name in g} if g is not None else {}
        return self._meta["state"], arrays

    def close(self, state: tuple[dict, dict] | None = None) -> None:
        if self._file is None:
            return
        if not self.read_only:
            if state is not None:
                g = self._file.require_group("_bigper/state")
                for name, arr in state[1].items():
                    if name in g:
                        del g[name]
                    g.create_dataset(name, data=arr)
                self._meta["state"] = state[0]
            self._meta["clean"] = True
            self._write_meta()
        self._file.close()
        self._file = None
        if not self.read_only:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.path.parent)
        self._lock.release()
        self._lock = None
