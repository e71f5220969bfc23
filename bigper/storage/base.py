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
  ``check_present``; ``recorded_array`` and ``convert`` (an older format's
  arrays, converted at open: ``core/legacy.py``). The memmap storage adds its chunk files
  (``chunk_table``, ``chunk_view``, ``mark_shared``, ``layout``, ``adopt``,
  ``replace``: ``snapshot/_save.py`` and ``_load.py``), the HDF5 one ``dsets``.

- What a storage kind answers for the code around it, so that nothing
  outside ``storage/`` asks which kind it holds (``kind ==``): ``in_memory``
  (no path, no lock), ``options`` (the ``storage_options`` it documents),
  ``create`` and ``restoring`` (how ``open_storage`` and a snapshot load make
  one), ``snapshot_options`` (what a snapshot records to rebuild it alike),
  ``chunked`` (its chunk files are linked into snapshots and adopted by
  loads), ``check_room``, ``close_first_at_exit``, and what ``bigper verify``
  asks of its live files: ``recognizes``, ``lock_path``, ``check_layout``,
  ``check_files``. A new kind is one file (a ``StorageBase`` subclass) and one
  registration line (``storage.register``, or a line of ``storage/__init__.py``'s
  ``_BUILTIN``); docs/development.md, "Add a storage".

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

from ..errors import IncompatibleSnapshotError

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

    def release_pages(self, name: str, lo: int, hi: int) -> None:
        """Rows ``lo .. hi - 1`` of array ``name`` leave this process's RSS: the
        pages of the file mapped there are let go of, the bytes stay in the file
        (a storage may let go of more, an HDF5 dataset of its whole map). Called
        after a pass reads rows once (the checks at open and load, a convert's
        copy, ``reprioritize``). Optional: ``StorageBase``'s does nothing."""


class StorageBase:
    """The optional members of the protocols above, at their defaults: a
    storage overrides what it has."""

    kind = ""                       # its name: storage=kind, recorded in configs and snapshots
    in_memory = False               # its arrays live in this process's memory: no path, no lock, nothing at exit
    options: tuple[str, ...] = ()   # the storage_options= it documents; any other is refused by name
    chunked = False                 # its data are chunk files a snapshot hard-links and a load adopts (memmap)
    close_first_at_exit = False     # its close must run before other exit handlers (HDF5: h5py's)
    path_suffix = ""                # how the name of a path of this kind ends (hdf5: ".h5"; a shard's live data)
    previous: dict[str, Any] | None = None  # takeover (a snapshot load): what the replaced buffer recorded
    path: Path | None = None        # OnDisk: its location (None in memory)
    read_only = False
    priorities_writable = False     # read_only data whose priorities may change (an offline dataset)
    arrays: dict[str, np.ndarray] | None = None  # InPlace: None, read and written through read/write
    dsets: dict[str, Any] | None = None          # HDF5: the datasets (snapshots copy from them)
    sidecar: Any = None             # an offline dataset's priorities sidecar (convert keeps clear of it)
    shared_chunks = 0               # rows a snapshot shares: prepare before writing them
    reads_may_fail: bool = True     # a read can raise (an I/O error), so a sample undoes its draw; False: never

    @property
    def writable_arrays(self) -> dict[str, np.ndarray] | None:
        """InPlace: arrays written in place; None: write through ``write``."""
        return None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # "reads never raise" is a claim about a read: a class with a read of its own that
        # does not make the claim itself is taken to raise (a registered storage's included)
        if "read" in cls.__dict__ and "reads_may_fail" not in cls.__dict__:
            cls.reads_may_fail = True

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

    def release_pages(self, name: str, lo: int, hi: int) -> None:
        """Nothing to let go of (``OnDisk.release_pages``: a storage that maps its files says otherwise)."""

    def check_present(self, what: str = "cannot go on") -> None:
        """Nothing at a path to lose."""

    def abort(self) -> None:
        """Nothing to let go."""

    def previous_arrays(self, wanted: tuple[str, ...] | None = None,
                        capacity: int | None = None) -> dict[str, np.ndarray] | None:
        """OnDisk, after ``open`` with takeover: the state arrays (those named
        in ``wanted``, or all) the buffer found here recorded at its clean close (the other half of
        ``previous["state"]``), None where it recorded none or they do not
        read. None larger than a state of ``capacity`` slots (the caller's,
        when given: the recorded config is as hostile as the arrays) or of
        the recorded capacity is read. None here: this storage replaces nothing."""
        return None

    def recorded_array(self, name: str) -> Any:
        """OnDisk: array ``name`` as the storage ``open`` found records it, read
        only, before ``allocate`` (an older format's, for ``core/legacy.py``).
        Refused here: this storage holds none."""
        raise IncompatibleSnapshotError(f"a {self.kind or type(self).__name__} storage holds no recorded "
                                        f"{name!r} to convert")

    def convert(self, new: dict[str, np.ndarray], old: tuple[str, ...], old_state: tuple[str, ...] = ()) -> None:
        """OnDisk: record the arrays ``new`` in place of the recorded ``old``
        (and the state arrays ``old_state``), before ``allocate``: a writer on
        disk, so that a kill -9 leaves the old or the new; a reader in memory.
        Refused here: this storage cannot."""
        raise IncompatibleSnapshotError(f"a {self.kind or type(self).__name__} storage cannot convert the older "
                                        f"format's {list(old)}")

    # -- what the kind answers: making one, snapshots, loads, verify ---------------
    @classmethod
    def create(cls, path: Path | None, **options: Any) -> "StorageBase":
        """A storage of this kind at ``path`` (``open_storage``), with the
        documented ``options`` (``read_only`` besides). Not opened yet."""
        return cls(path, **options)  # type: ignore[call-arg]

    @classmethod
    def restoring(cls, path: Path | None, options: dict[str, Any]) -> "StorageBase":
        """The storage a snapshot load fills at ``path``, taking over whatever
        a dead writer left there; ``options`` as ``snapshot_options`` recorded
        them (read from a snapshot: untrusted)."""
        return cls(path, takeover=True, **options)  # type: ignore[call-arg]

    def snapshot_options(self) -> dict[str, Any]:
        """JSON-able options a snapshot records, for ``restoring`` to build
        the loaded storage alike."""
        return {}

    def check_room(self, nbytes: int) -> None:
        """``OSError(ENOSPC)`` before anything is created when ``nbytes`` of
        rows (a load's) cannot fit where this storage writes; by default
        nothing is checked (allocation preallocates and fails cleanly)."""

    @classmethod
    def recognizes(cls, path: Path) -> bool:
        """Whether ``path`` holds a live storage of this kind (``bigper
        verify``); never blocks, never raises."""
        return False

    @classmethod
    def lock_path(cls, path: Path) -> Path | None:
        """The lock file of the storage at ``path`` (None: it has none)."""
        return None

    @classmethod
    def check_layout(cls, path: Path) -> str | None:
        """For a storage a live writer holds: check what does not change
        while it runs (the record of its layout) and say what was checked;
        a ``BigperError`` when it is not consistent; None: nothing to check."""
        return None

    @classmethod
    def check_files(cls, path: Path, meta: dict[str, Any]) -> None:
        """After a read-only ``open`` returned ``meta``: a ``BigperError``
        when a file the record names is missing or short."""


def fits_spec(name: str, have: tuple[Any, ...], want: tuple[Any, ...], growth: dict[str, int]) -> bool:
    """Whether an array recorded as ``have`` (rows, shape, dtype) is the one
    spec ``want`` asks for: equal, or, for an array that grows, whole steps of
    ``growth[name]`` rows, one at least, ``want``'s rows at most."""
    if name not in growth:
        return tuple(have) == tuple(want)
    step = growth[name]
    return tuple(have[1:]) == tuple(want[1:]) and step <= have[0] <= want[0] and have[0] % step == 0
