"""Storages: where a buffer's arrays live, and the kinds a buffer may name.

A kind is a ``StorageBase`` subclass with its own ``kind``; ``storage="<kind>"``
finds it here. bigper's own are named in ``_BUILTIN`` (imported when first
asked for, so h5py stays out of a memory-only process); another is one
``register(MyStorage)`` line (docs/development.md, "Add a storage").
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from .base import Storage, StorageBase
from .memory import MemoryStorage
from ..errors import BigperError, InvalidArgumentError, InvalidTypeError

__all__ = ["Storage", "StorageBase", "MemoryStorage", "open_storage", "register", "kinds", "storage_class",
           "kind_at", "in_memory"]

# kind -> "module:Class" in this package; the order is the order ``kind_at`` asks them.
_BUILTIN = {
    "memory": "memory:MemoryStorage",
    "memmap": "memmap:MemmapStorage",
    "hdf5": "hdf5:HDF5Storage",
}
_REGISTERED: dict[str, type[StorageBase]] = {}


def register(cls: type[StorageBase]) -> type[StorageBase]:
    """Make ``cls`` (a ``StorageBase`` subclass) the storage of
    ``storage=cls.kind``: buffers, snapshots, loads and ``bigper verify``
    find it by that name. Returns ``cls`` (a class decorator too). A kind
    that is taken, by bigper's own or by another class, is refused."""
    if not isinstance(cls, type) or not issubclass(cls, StorageBase):
        raise InvalidTypeError(f"register takes a subclass of bigper.storage.StorageBase, got {cls!r:.80}")
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind.isidentifier() or kind != kind.lower():
        raise InvalidArgumentError(f"register: {cls.__name__}.kind must be its own lower-case identifier "
                                   f"(the storage= name), got {kind!r:.80}")
    taken = _BUILTIN.get(kind) or _REGISTERED.get(kind)
    if taken is not None and taken is not cls:
        raise InvalidArgumentError(f"register: storage kind {kind!r} is taken (by {taken!r}); give "
                                   f"{cls.__name__} a kind of its own")
    _REGISTERED[kind] = cls
    return cls


def kinds() -> tuple[str, ...]:
    """Every storage kind a buffer may name: bigper's own, then those registered."""
    return (*_BUILTIN, *_REGISTERED)


def storage_class(kind: str) -> type[StorageBase]:
    """The class of storage ``kind``; ``InvalidArgumentError`` for an unknown one."""
    if isinstance(kind, str) and kind in _BUILTIN:
        module, name = _BUILTIN[kind].split(":")
        cls: type[StorageBase] = getattr(importlib.import_module(f".{module}", __name__), name)
        return cls
    if isinstance(kind, str) and kind in _REGISTERED:
        return _REGISTERED[kind]
    raise InvalidArgumentError(f"storage must be one of {kinds()}, got {kind!r:.80}")


def in_memory(kind: object) -> bool:
    """Whether storage ``kind`` keeps its arrays in memory (no path); False
    for a name that is no known kind (a recorded one, untrusted: treated as
    a disk storage, which needs a path)."""
    return isinstance(kind, str) and kind in kinds() and storage_class(kind).in_memory


def open_storage(kind: str, path: str | os.PathLike[str] | None = None, **options: Any) -> StorageBase:
    """A storage of ``kind`` at ``path`` (none in memory), not opened yet."""
    cls = storage_class(kind)
    if cls.in_memory:
        if path is not None or options.get("read_only"):
            raise InvalidArgumentError(f"storage={kind!r} takes no path or read_only, got path={path!r}")
        return cls.create(None)
    if path is None:
        raise InvalidArgumentError(f"storage={kind!r} needs a path=, got None")
    return cls.create(path, **options)


def kind_at(path: Path) -> type[StorageBase] | None:
    """The kind of the live storage at ``path`` (``recognizes``), or None."""
    for kind in kinds():
        cls = storage_class(kind)
        try:
            if cls.recognizes(path):
                return cls
        except (OSError, BigperError):  # a path it cannot look at is not its
            continue
    return None


def check_kind(store: StorageBase) -> None:
    """``InvalidArgumentError`` when ``store`` claims the ``kind`` of a
    known storage without being that storage: snapshots, loads and ``bigper
    info`` treat a storage of that kind by what that one holds (a memmap's
    chunk files, an HDF5 file's datasets)."""
    kind = store.kind
    if not isinstance(kind, str) or (kind not in _BUILTIN and kind not in _REGISTERED):
        return
    own = storage_class(kind)
    if not isinstance(store, own):
        raise InvalidArgumentError(
            f"store: a {type(store).__name__} claims kind={kind!r}, the kind of {own.__name__}, "
            f"which it is not; snapshots and resumes would treat it as one: give it a kind of its own "
            "(nothing was written)")
