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
