"""Snapshots: crash-consistent save, verified load and exact resume.

``save(buf, path)`` writes a directory (format in ``_manifest.py``) through a
temporary directory and one rename (``_save.py``); ``load(path)`` checks every
byte and rebuilds the buffer, taking over the live location (``_load.py``);
``Snapshots(root, keep=N)`` numbers, retains and falls back (``_series.py``);
``verify`` and ``describe`` look without loading (``_inspect.py``).
"""

from ._inspect import describe, verify
from ._load import load
from ._manifest import FORMAT, MAGIC
from ._save import save
from ._series import Snapshots

__all__ = ["FORMAT", "MAGIC", "Snapshots", "describe", "load", "save", "verify"]
