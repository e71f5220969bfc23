"""In-memory storage: plain numpy arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .base import StorageBase


class MemoryStorage(StorageBase):
    kind = "memory"
    reads_may_fail: bool = False  # (numpy takes from memory)
    in_memory = True
    read_only = False

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    @classmethod
    def create(cls, path: Path | None = None, **options: Any) -> "MemoryStorage":
        """A new one (no path: ``open_storage`` refused one)."""
        return cls()

    @classmethod
    def restoring(cls, path: Path | None, options: dict[str, Any]) -> "MemoryStorage":
        """A new one, which the load fills."""
        return cls()

    def open(self, config):
        return None

    def allocate(self, specs, growth=None):
        """One array per spec; those named in ``growth`` (name -> rows of a
        step) start with one step and grow (``grow``)."""
        growth = growth or {}
        self._room = {}
        for name, (rows, shape, dtype) in specs.items():
            n = min(int(rows), growth[name]) if name in growth else rows
            # Touched now rather than page by page on the hot path (and the
            # memory is there, or MemoryError, when the buffer is created).
            a = np.empty((n, *shape), dtype=dtype)
            a.fill(0)
            self.arrays[name] = a
            if name in growth:
                self._room[name] = (a, int(rows))

    def grow(self, name: str, rows: int) -> None:
        """Array ``name`` holds ``rows`` rows from now on (more; the new ones
        zero), in a block that doubles as it fills (one copy per doubling)."""
        block, most = self._room[name]
        old = self.arrays[name]
        if rows <= old.shape[0] or rows > most:
            raise ValueError(f"grow({name!r}, {rows}): it holds {old.shape[0]} rows, {most} at most")
        if rows > block.shape[0]:
            bigger = np.empty((min(most, max(rows, 2 * block.shape[0])), *block.shape[1:]), dtype=block.dtype)
            bigger[:old.shape[0]] = old
            bigger[old.shape[0]:].fill(0)
            block = bigger
            self._room[name] = (block, most)
        self.arrays[name] = block[:rows]

    def rows(self, name: str) -> int:
        return int(self.arrays[name].shape[0])

    def shrink(self, name: str, rows: int) -> None:
        """Array ``name`` holds ``rows`` rows from now on (fewer; its block is kept)."""
        self.arrays[name] = self._room[name][0][:rows]

    @property
    def writable_arrays(self) -> dict:
        """Arrays a buffer may write rows into directly (all of them, in memory)."""
        return self.arrays

    def read(self, name, rows):
        # take() is several times faster than fancy indexing for a small batch of rows.
        return self.arrays[name].take(rows, axis=0)

    def write(self, name, rows, values):
        self.arrays[name][rows] = values

    def flush(self):
        pass

    def close(self, state=None):
        pass

    def abort(self) -> None:
        pass

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())
