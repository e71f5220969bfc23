"""Snapshots: crash-consistent save, verified load and exact resume.

``save(snapshot, config=, state=, storage=, summary=)`` writes a directory
(format in ``manifest.py``) through a temporary directory and one rename
(``_save.py``); ``load(snapshot, path=)`` checks every byte and gives back
the parts a buffer is built of, taking over the live location
(``_load.py``); ``verify`` and ``describe`` look without loading
(``inspect.py``). They take and give plain state (a config, named arrays, a
storage), so the buffer's ``save``/``load`` call them directly; the numbered
series with retention is ``bigper.Snapshots`` (``bigper/snapshots.py``).

``SnapshotInfo`` is imported with ``bigper``; the rest on first use.
"""

from .series import SnapshotInfo, snapshot_info

_LAZY = {"save": "_save", "load": "_load", "verify": "inspect", "describe": "inspect",
         "counterpart": "_load", "default_live_path": "_load",
         "FORMAT": "manifest", "MAGIC": "manifest"}

__all__ = ["FORMAT", "MAGIC", "SnapshotInfo", "counterpart", "default_live_path", "describe", "load", "save",
           "snapshot_info", "verify"]


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
