"""Storages: where a buffer's arrays live."""

from .base import Storage
from .memory import MemoryStorage
from ..errors import InvalidArgumentError

__all__ = ["Storage", "MemoryStorage", "open_storage"]


def open_storage(kind: str, path=None, **options):
    """The storage of ``kind`` (``"memory"``, ``"memmap"`` or ``"hdf5"``).

    Disk storages import lazily, so h5py stays out of a memory-only process.
    """
    if kind == "memory":
        return MemoryStorage()
    if path is None:
        raise InvalidArgumentError(f"storage={kind!r} needs a path=, got None")
    if kind == "memmap":
        from .memmap import MemmapStorage

        return MemmapStorage(path, **options)
    if kind == "hdf5":
        from .hdf5 import HDF5Storage

        return HDF5Storage(path, **options)
    raise InvalidArgumentError(f"storage must be 'memory', 'memmap' or 'hdf5', got {kind!r}")


def check_kind(store) -> None:
    """``InvalidArgumentError`` when ``store`` claims the ``kind`` of one of
    bigper's own storages (``"memory"``, ``"memmap"``, ``"hdf5"``) without
    being that storage: snapshots, loads and ``bigper info`` treat a storage
    of that kind by what that one holds (a memmap's chunk files, an HDF5
    file's datasets)."""
    kind = store.kind
    if kind == "memory":
        own = MemoryStorage
    elif kind == "memmap":
        from .memmap import MemmapStorage as own
    elif kind == "hdf5":
        from .hdf5 import HDF5Storage as own
    else:
        return
    if not isinstance(store, own):
        raise InvalidArgumentError(
            f"store: a {type(store).__name__} claims kind={kind!r}, the kind of bigper's own {own.__name__}, "
            f"which it is not; snapshots and resumes would treat it as one: give it a kind of its own "
            "(nothing was written)")
