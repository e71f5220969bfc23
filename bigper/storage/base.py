"""The Storage protocol: named 2-D-or-more arrays with a fixed number of rows.

A buffer asks its storage for arrays by name (``allocate``), writes rows and
reads rows back. Memory and memmap storages hand out numpy arrays (``arrays``)
that the buffer indexes directly; HDF5 reads through h5py.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Storage(Protocol):
    """Where a buffer keeps its arrays: memory, memmap files or one HDF5 file."""

    kind: str

    def open(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """Lock the location; return its recorded metadata (``config``,
        ``state``) when it already holds a buffer, else None."""

    def saved_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(meta, arrays)`` of the buffer's bookkeeping, recorded at the last close."""

    def allocate(self, specs: dict[str, tuple[int, tuple[int, ...], np.dtype[Any]]]) -> None:
        """Create (or attach to) one array per name: ``name -> (rows, shape, dtype)``."""

    def read(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int64, any order, duplicates allowed) of array ``name``."""

    def write(self, name: str, rows: int | slice | np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` at ``rows`` (an int, a slice or an int64 array)."""

    # Optional: ``writable_arrays`` (name -> numpy array written in place, after
    # ``prepare`` where the storage has it); storages without it (HDF5) get ``write``.

    def flush(self) -> None:
        """Make written rows durable (a no-op in memory)."""

    def close(self, state: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None) -> None:
        """Flush, record ``state`` (the buffer's bookkeeping) durably, mark the
        location cleanly closed, and release files and locks."""

    def nbytes(self) -> int:
        """Bytes the arrays take (on disk for disk storages)."""
