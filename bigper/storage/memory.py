"""In-memory storage: plain numpy arrays."""

from __future__ import annotations

import numpy as np


class MemoryStorage:
    kind = "memory"
    read_only = False

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def open(self, config):
        return None

    def allocate(self, specs):
        for name, (rows, shape, dtype) in specs.items():
            # Touched now rather than page by page on the hot path (and the
            # memory is there, or MemoryError, when the buffer is created).
            a = np.empty((rows, *shape), dtype=dtype)
            a.fill(0)
            self.arrays[name] = a

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

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())
