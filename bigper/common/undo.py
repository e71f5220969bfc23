"""What a write changed, to put back when a later call of it fails (promise 16).

A write makes several calls that can fail (a storage's ``write``, ``grow``,
``read``; a full disk at any of them). What it changes before its last such
call is either computed on copies and committed after it, or recorded here
first (the rows a storage write overwrites, the counters a step moves) and put
back, newest first, when anything raises. ``core/writer.py`` holds one
``Journal`` a write; the frame store and the compressed log record their parts.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("bigper")


def as_rows(where, n: int) -> np.ndarray:
    """``where`` (an int, a step-1 slice or an int64 array) as int64 row numbers
    of an array of ``n`` rows."""
    if isinstance(where, slice):
        return np.arange(*where.indices(n), dtype=np.int64)
    return np.atleast_1d(np.asarray(where, dtype=np.int64))


class Journal:
    """The undo steps of one write, newest last (``roll_back`` runs them in reverse)."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps: list = []

    def add(self, step) -> None:
        """``step()`` puts back something this write is about to change."""
        self.steps.append(step)

    def write(self, store, name: str, where, values: np.ndarray, nrows: int) -> None:
        """``store.write(name, where, values)`` (an array of ``nrows`` rows), the
        rows it overwrites read first (a read that fails has changed nothing):
        a write that fails halfway is put back too."""
        rows = as_rows(where, nrows)
        # (copied: a storage's read may give a view of what the write then changes)
        if rows.shape[0] == 1:  # one row (an add): read and put back as an int, a storage's quickest
            row = int(rows[0])
            old = np.array(store.read(name, np.asarray(row, dtype=np.int64)), copy=True)
            self.steps.append(lambda: store.write(name, row, old))
        else:
            old = np.array(store.read(name, rows), copy=True)
            self.steps.append(lambda: store.write(name, rows, old))
        store.write(name, where, values)

    def keep(self, array: np.ndarray, where) -> None:
        """Rows ``where`` of an array written in place next (a copy, put back in place)."""
        old = array[where].copy()
        self.steps.append(lambda: array.__setitem__(where, old))

    def roll_back(self) -> None:
        """Put everything back, newest first. A step that fails (the disk that
        failed the write may fail the undo too) is logged and the others run."""
        while self.steps:
            step = self.steps.pop()
            try:
                step()
            except BaseException as e:  # (the caller re-raises the write's own error)
                log.error("bigper: undoing a failed write did not complete (%r): the buffer may hold a "
                          "partial write; close it and resume from its last snapshot", e)
