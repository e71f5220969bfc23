"""The Storage protocol: named arrays of rows, and every call the core makes on them.

A buffer asks its storage for arrays by name (``allocate``), writes rows and
reads rows back. This file lists every call bigper makes on a storage, so a
new storage's author reads one file:

- ``Storage``: what every storage has (memory, memmap, HDF5).
- ``InPlace``: numpy arrays the core indexes directly instead of ``read`` /
  ``write`` (memory, memmap). Without ``arrays`` a storage is read through
  ``read`` and written through ``write`` (HDF5). ``prepare`` and
  ``shared_chunks``: copy-on-write storages (memmap, after a snapshot).
- ``Growing``: ``rows``, ``grow``, ``shrink`` for the arrays ``allocate`` was
  told grow (the compressed frame log, ``frames/segments.py``).
- ``OnDisk``: what snapshots, loads and ``bigper info`` ask of a storage at a
  path: ``path``, ``read_only``, ``abort`` (let go, recording nothing),
  ``check_present``. The memmap storage adds its chunk files
  (``chunk_table``, ``chunk_view``, ``mark_shared``, ``layout``, ``adopt``,
  ``replace``: ``snapshot/_save.py`` and ``_load.py``), the HDF5 one ``dsets``.

Every storage subclasses ``StorageBase``, which gives the optional members
their defaults (no ``arrays``: read and write; ``shared_chunks`` 0: nothing
to make writable; ``rows`` None and ``grow`` refused: the arrays were
allocated whole, and the compressed log holds all its slots from the start;
``shrink``, ``check_present`` and ``abort`` no-ops), so the core calls them
all directly and never asks a storage what it has. ``from_parts`` checks a
storage's arrays against the specs first (``core/layout.check_storage``),
and refuses a storage that claims a kind of bigper's own without being it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

Specs = dict[str, tuple[int, tuple[int, ...], np.dtype[Any]]]  # name -> (rows, row shape, dtype)

# What a storage keeps beside the arrays, in their namespace: the HDF5 file's root
# group holds each array as a dataset and the buffer's record (meta, state) as this
# group. No array may take the name (``core/layout.py`` ``own_names``).
RECORD = "_bigper"


class Storage(Protocol):
    """Where a buffer keeps its arrays: memory, memmap files or one HDF5 file."""

    kind: str  # "memory", "memmap" or "hdf5": recorded in the config and snapshots

    def open(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """Lock the location; return its recorded metadata (``config``,
        ``state``) when it already holds a buffer, else None."""

    def saved_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(meta, arrays)`` of the buffer's bookkeeping, recorded at the last close."""

    def allocate(self, specs: Specs, growth: dict[str, int] | None = None) -> None:
        """Create (or attach to) one array per name: ``name -> (rows, shape, dtype)``.
        An array named in ``growth`` (name -> rows of a step) starts with one
        step and grows by ``grow`` up to its spec's rows (a reopened one holds
        what it grew to). A storage that cannot grow allocates it whole."""

    def read(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int64, any order, duplicates allowed) of array ``name``."""

    def write(self, name: str, rows: int | slice | np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` at ``rows`` (an int, a slice or an int64 array)."""

    def flush(self) -> None:
        """Make written rows durable (a no-op in memory)."""

    def close(self, state: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None) -> None:
        """Flush, record ``state`` (the buffer's bookkeeping) durably, mark the
        location cleanly closed, and release files and locks."""

    def nbytes(self) -> int:
        """Bytes the arrays take (on disk for disk storages)."""


class InPlace(Protocol):
    """A storage whose arrays the core indexes directly (memory, memmap)."""

    arrays: dict[str, np.ndarray]  # name -> array, read only where a snapshot shares it

    @property
    def writable_arrays(self) -> dict[str, np.ndarray]:
        """name -> array written in place (after ``prepare``, where there is one)."""

    def prepare(self, writes: dict[str, Any]) -> None:
        """Make writable now every row ``writes`` (name -> rows) will touch
        (copy-on-write of what a snapshot shares): a full disk fails here,
        before any write. Optional."""

    @property
    def shared_chunks(self) -> int:
        """Chunks a snapshot still shares (0: writes need no ``prepare``). Optional."""


class Growing(Protocol):
    """A storage whose ``growth`` arrays change their rows (optional: without
    it they are allocated whole, and the compressed log never grows)."""

    def rows(self, name: str) -> int | None:
        """Rows array ``name`` holds (one of ``growth``: what it grew to);
        None (``StorageBase``'s default): the storage does not grow."""

    def grow(self, name: str, rows: int) -> None:
        """Array ``name`` of ``growth`` holds ``rows`` rows from now on (whole
        steps; the new rows zero and really reserved: a full disk is an
        ``OSError`` here naming the file, with nothing changed)."""

    def shrink(self, name: str, rows: int) -> None:
        """Array ``name`` of ``growth`` holds ``rows`` rows from now on (fewer,
        whole steps; the rows past them are given back). Optional."""


class OnDisk(Protocol):
    """A storage at a path (memmap, HDF5): what loads, snapshots and the CLI ask."""

    path: Path
    read_only: bool

    def abort(self) -> None:
        """Release without recording anything (a location this storage created goes)."""

    def check_present(self, what: str = "cannot go on") -> None:
        """``PathNotFoundError`` when the location was deleted while open
        (memmap; optional: ``save`` asks it before it links the files)."""


class StorageBase:
    """The optional members of the protocols above, at their defaults: a
    storage overrides what it has."""

    kind = ""
    path: Path | None = None        # OnDisk: its location (None in memory)
    read_only = False
    priorities_writable = False     # read_only data whose priorities may change (an offline dataset)
    arrays: dict[str, np.ndarray] | None = None  # InPlace: None, read and written through read/write
    dsets: dict[str, Any] | None = None          # HDF5: the datasets (snapshots copy from them)
    sidecar: Any = None             # an offline dataset's priorities sidecar (convert keeps clear of it)
    shared_chunks = 0               # rows a snapshot shares: prepare before writing them

    @property
    def writable_arrays(self) -> dict[str, np.ndarray] | None:
        """InPlace: arrays written in place; None: write through ``write``."""
        return None

    def prepare(self, writes: dict[str, Any]) -> None:
        """Nothing is shared with a snapshot: every row is writable."""

    def rows(self, name: str) -> int | None:
        """Growing only: the rows of a ``growth`` array. None: this storage
        does not grow, so it allocated the array whole (its spec's rows)."""
        return None

    def grow(self, name: str, rows: int) -> None:
        """Refused: the arrays were allocated whole."""
        raise RuntimeError(f"a {self.kind or type(self).__name__} storage cannot grow {name!r} to {rows} rows")

    def shrink(self, name: str, rows: int) -> None:
        """Keeps every row (``rows`` tells what it holds)."""

    def check_present(self, what: str = "cannot go on") -> None:
        """Nothing at a path to lose."""

    def abort(self) -> None:
        """Nothing to let go."""


def fits_spec(name: str, have: tuple[Any, ...], want: tuple[Any, ...], growth: dict[str, int]) -> bool:
    """Whether an array recorded as ``have`` (rows, shape, dtype) is the one
    spec ``want`` asks for: equal, or, for an array that grows, whole steps of
    ``growth[name]`` rows, one at least, ``want``'s rows at most."""
    if name not in growth:
        return tuple(have) == tuple(want)
    step = growth[name]
    return tuple(have[1:]) == tuple(want[1:]) and step <= have[0] <= want[0] and have[0] % step == 0
