"""The words the checks of a recorded state are written in (``statecheck``, and
each sample unit's check of its own arrays): refuse the state, read one of its
arrays at the dtype and shape a writer gives it."""

from __future__ import annotations

import numpy as np

from ..errors import CorruptSnapshotError

BIG = 1 << 62  # far above any count a buffer reaches, far below int64 overflow


def refuse(what: str):
    """Raise ``CorruptSnapshotError`` for a recorded state that says ``what``."""
    raise CorruptSnapshotError(f"recorded buffer state: {what}")


def array(arrays: dict, name: str, dtype, shape: tuple) -> np.ndarray:
    """``arrays[name]``, refused unless it is an array of ``dtype`` and ``shape``."""
    a = arrays.get(name)
    if not isinstance(a, np.ndarray):
        refuse(f"array {name!r} is missing")
    if a.dtype != np.dtype(dtype) or a.shape != shape:
        refuse(f"array {name!r} must be {np.dtype(dtype)} of shape {shape}, got {a.dtype} of shape {a.shape}")
    return a
