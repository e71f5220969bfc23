"""Snapshots: crash-consistent save, verified load and exact resume.

``save(buf, path)`` writes a directory (format in ``_manifest.py``) through a
temporary directory and one rename (``_save.py``); ``load(path)`` checks every
byte and rebuilds the buffer, taking over the live location (``_load.py``);
``Snapshots(root, keep=N)`` numbers, retains and falls back (``_series.py``);
``verify`` and ``describe`` look without loading (``_inspect.py``).

Only ``Snapshots`` is imported with ``bigper``; the rest on first use.
"""

from ._series import SnapshotInfo, Snapshots, snapshot_info

_LAZY = {"save": "_save", "load": "_load", "verify": "_inspect", "describe": "_inspect",
         "FORMAT": "_manifest", "MAGIC": "_manifest"}

__all__ = ["FORMAT", "MAGIC", "SnapshotInfo", "Snapshots", "describe", "load", "save", "snapshot_info",
           "verify"]


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
