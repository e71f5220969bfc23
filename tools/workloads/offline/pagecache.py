"""The page cache of one file: the share of its pages cached (``mincore``),
and a read from start to end that caches it (``bench offline --scale``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def cached(path: Path) -> float:
    """The share of ``path``'s pages in the page cache now (``mincore`` over a map of it)."""
    import ctypes
    import mmap

    size = os.stat(path).st_size
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = np.zeros(-(-size // mmap.PAGESIZE), dtype=np.uint8)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(m, dtype=np.uint8)
    try:
        ok = libc.mincore(view.ctypes.data, size, vec.ctypes.data) == 0
    finally:
        del view
        m.close()
    return float((vec & 1).mean()) if ok else float("nan")


def read_through(path: Path, chunk: int = 16 << 20) -> float:
    """Read the file at ``path`` once from start to end (what a learner's
    sampling does to its page cache over a long run: every frame is read
    sooner or later), then the share of its pages cached (``cached``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.read(fd, chunk):
            pass
    finally:
        os.close(fd)
    return cached(path)
