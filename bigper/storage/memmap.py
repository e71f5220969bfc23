"""Memory-mapped storage: a directory with one preallocated file per array.

::

    path/
      meta.json        format, version, config, arrays, clean flag, buffer state
      .lock            flock of the one writer
      data/<name>.bin  raw rows, C order, preallocated with posix_fallocate
      state/<name>.npy the buffer's bookkeeping, written at close

Files are never truncated on open. ``clean`` is false while a writer has the
directory open, so a writer that died is detected on the next open.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ._files import FileLock, fsync_dir, preallocate, read_json, write_json
from ._state import check_meta, load_state_dir, save_state_dir

FORMAT = "bigper-memmap"
VERSION = 1


class MemmapStorage:
    kind = "memmap"

    def __init__(self, path, *, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self.arrays: dict[str, np.ndarray] = {}
        self._maps: list[np.memmap] = []
        self._lock = None
        self._created = False
        self._meta: dict | None = None

    # -- open / create -------------------------------------------------------
    def open(self, config: dict) -> dict | None:
        """Lock the directory; return its recorded meta when it holds a buffer."""
        meta_path = self.path / "meta.json"
        if not meta_path.exists():
            if self.read_only:
                raise FileNotFoundError(f"no bigper memmap storage at {self.path}")
            self._created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(self.path / ".lock", shared=self.read_only)
        if meta_path.exists():
            self._meta = check_meta(read_json(meta_path), FORMAT, VERSION, self.path)
            return self._meta
        self._meta = {"format": FORMAT, "version": VERSION, "config": config,
                      "arrays": {}, "clean": False, "state": None}
        return None

    def allocate(self, specs) -> None:
        fresh = not self._meta["arrays"]
        data = self.path / "data"
        try:
            if fresh:
                data.mkdir(exist_ok=True)
                for name, (rows, shape, dtype) in specs.items():
                    nbytes = rows * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                    preallocate(data / f"{name}.bin", nbytes)
                    self._meta["arrays"][name] = {"rows": rows, "shape": list(shape),
                                                  "dtype": np.dtype(dtype).str, "file": f"data/{name}.bin"}
                fsync_dir(data)
                write_json(self.path / "meta.json", self._meta)
            for name, a in self._meta["arrays"].items():
                mode = "r" if self.read_only else "r+"
                m = np.memmap(self.path / a["file"], dtype=a["dtype"], mode=mode,
                              shape=(a["rows"], *a["shape"]))
                self._maps.append(m)
                self.arrays[name] = m.view(np.ndarray)
            if not fresh and not self.read_only:
                self._meta["clean"] = False
                write_json(self.path / "meta.json", self._meta)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """Undo a failed creation: nothing half-made stays behind."""
        self.arrays.clear()
        self._maps.clear()
        if self._lock:
            self._lock.release()
            self._lock = None
        if self._created:
            shutil.rmtree(self.path, ignore_errors=True)

    # -- rows ----------------------------------------------------------------
    def read(self, name, rows):
        return self.arrays[name][rows]

    def write(self, name, rows, values):
        self.arrays[name][rows] = values

    def flush(self) -> None:
        for m in self._maps:
            m.flush()

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    # -- state and close -------------------------------------------------------
    def saved_state(self):
        """``(meta, arrays)`` the last writer recorded at close."""
        return self._meta["state"], load_state_dir(self.path / "state")

    def close(self, state: tuple[dict, dict] | None = None) -> None:
        """Flush data, record ``state`` (``(meta, arrays)``) and mark the directory clean."""
        if self._lock is None:
            return
        if not self.read_only:
            self.flush()
            if state is not None:
                save_state_dir(self.path / "state", state[1])
                self._meta["state"] = state[0]
            self._meta["clean"] = True
            write_json(self.path / "meta.json", self._meta)
        self.arrays.clear()
        self._maps.clear()
        self._lock.release()
        self._lock = None
