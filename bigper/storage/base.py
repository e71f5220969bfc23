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

    def allocate(self, specs: dict[str, tuple[int, tuple[int, ...], np.dtype[Any]]],
                 growth: dict[str, int] | None = None) -> None:
        """Create (or attach to) one array per name: ``name -> (rows, shape, dtype)``.
        An array named in ``growth`` (name -> rows of a step) starts with one
        step and grows by ``grow`` up to its spec's rows (a reopened one holds
        what it grew to)."""

    def read(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int64, any order, duplicates allowed) of array ``name``."""

    def write(self, name: str, rows: int | slice | np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` at ``rows`` (an int, a slice or an int64 array)."""

    def rows(self, name: str) -> int:
        """Rows array ``name`` holds (one of ``growth``: what it grew to)."""

    def grow(self, name: str, rows: int) -> None:
        """Array ``name`` of ``growth`` holds ``rows`` rows from now on (whole
        steps; the new rows zero and really reserved: a full disk is an
        ``OSError`` here, with nothing changed)."""

    # Optional: ``writable_arrays`` (name -> numpy array written in place, after
    # ``prepare`` where the storage has it); storages without it (HDF5) get ``write``.

    def flush(self) -> None:
        """Make written rows durable (a no-op in memory)."""

    def close(self, state: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None) -> None:
        """Flush, record ``state`` (the buffer's bookkeeping) durably, mark the
        location cleanly closed, and release files and locks."""

    def nbytes(self) -> int:
        """Bytes the arrays take (on disk for disk storages)."""


def fits_spec(name: str, have: tuple, want: tuple, growth: dict) -> bool:
    """Whether an array recorded as ``have`` (rows, shape, dtype) is the one
    spec ``want`` asks for: equal, or, for an array that grows, whole steps of
    ``growth[name]`` rows, one at least, ``want``'s rows at most."""
    if name not in growth:
        return tuple(have) == tuple(want)
    step = growth[name]
    return tuple(have[1:]) == tuple(want[1:]) and step <= have[0] <= want[0] and have[0] % step == 0
