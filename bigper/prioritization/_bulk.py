"""Bulk priority updates of proportional prioritization: many rows at once
(``reprioritize``, a whole dataset's scores, a large ``update_priorities``).

The checked update kernel (``_tree_kernels.update_capped``) walks the rows four
times in order: check, route, write, read back the largest value. For a
million rows that is about 70 MB of memory traffic on one core, as much time
as the keys' ``pow``. Here the same update takes two passes:

1. ``scan_range`` over row ranges on the thread pool: each priority checked
   and turned into its key (the same scalar ``pow`` as every other path), the
   largest key, the first bad index or never-written slot, and how many rows
   go to the tree. Nothing is written but the keys.
2. ``write_last_first`` on one thread, only when every row passed: the rows
   from last to first, each slot written once, with the value of its last
   row that routes anywhere ("the last duplicate wins"), which is also the
   value the largest-key read-back of the in-order path would see.

Then the caller rebuilds the tree's internal nodes (O(N), threaded). The
result is the in-order kernel's, bit for bit (``tests/core/test_fused.py``).
Anything else (a bad priority, few rows bound for the tree) goes to the
in-order kernel, which reports errors in its row order.

``keys`` (the threaded keys of ``Proportional.keys`` for many rows) lives here
too; both compute a key with ``_key``. Kernels here call no kernel of another file: numba's
on-disk cache does not notice when another file's kernel changes.
"""

from __future__ import annotations

import numpy as np

from ..common.kernels import kernel
from ._tree_kernels import BAD_INDEX, NEVER_WRITTEN, UPDATE_OK
from ..common.pool import for_ranges
from ..common.status import EMPTY, LIVE, PENDING


@kernel
def _key(v, alpha, eps, max_priority):
    """``(min(v, max_priority) + eps) ** alpha``: ``_tree_kernels.to_leaves``'s formula, bit for bit."""
    if v > max_priority:
        v = max_priority
    return (v + eps) ** alpha


@kernel
def keys_range(p, alpha, eps, max_priority, out, lo, hi):
    """Keys of rows ``lo .. hi-1`` (one range of a threaded ``keys``), checking
    each priority as it goes. Returns ``(position of the first NaN, infinite or
    negative priority, or -1; the largest key)``."""
    top = 0.0
    for i in range(lo, hi):
        v = p[i]
        if not (v >= 0.0 and v < np.inf):
            return i, top
        v = _key(v, alpha, eps, max_priority)
        out[i] = v
        if v > top:
            top = v
    return -1, top


@kernel
def scan_range(p, idx, stamps, use_stamps, gid, status, alpha, eps, max_priority, keys, lo, hi):
    """Rows ``lo .. hi-1`` of a bulk update: ``keys[i] = (min(p[i], max_priority)
    + eps) ** alpha``. Returns ``(first row with a NaN, infinite or negative
    priority or -1, the largest key, first row whose index is out of range or
    whose slot was never written or -1, its code: 2 out of range, 3 never
    written, rows bound for the tree)``; stops at a bad priority."""
    n = gid.shape[0]
    top = 0.0
    bad_row = -1
    code = UPDATE_OK
    kept = 0
    for i in range(lo, hi):
        v = p[i]
        if not (v >= 0.0 and v < np.inf):
            return i, top, bad_row, code, kept
        v = _key(v, alpha, eps, max_priority)
        keys[i] = v
        if v > top:
            top = v
        if bad_row < 0:
            s = idx[i]
            if s < 0 or s >= n:
                bad_row, code = i, BAD_INDEX
            elif status[s] == EMPTY:
                bad_row, code = i, NEVER_WRITTEN
            elif status[s] == LIVE and (not use_stamps or gid[s] == stamps[i]):
                kept += 1
    return -1, top, bad_row, code, kept


@kernel
def write_last_first(sums, leaf_off, idx, keys, stamps, use_stamps, gid, status, pending, seen):
    """Write checked rows from the last to the first: a row whose slot is
    sampleable (status 1) sets its leaf ``sums[leaf_off + slot]``, one waiting
    for its n-step window (status 2) its ``pending`` key; stale rows (their
    stamp is not the slot's generation, with ``use_stamps``) and dead slots
    are skipped. ``seen`` (zeros, one per slot) keeps each slot to its last
    routed row. Returns the largest value written."""
    top = 0.0
    for i in range(idx.shape[0] - 1, -1, -1):
        s = idx[i]
        st = status[s]
        if (st != LIVE and st != PENDING) or seen[s] or (use_stamps and gid[s] != stamps[i]):
            continue
        seen[s] = True
        v = keys[i]
        if st == LIVE:
            sums[leaf_off + s] = v
        else:
            pending[s] = v
        if v > top:
            top = v
    return top


def keys(p, alpha, eps, max_priority, chunk: int):
    """Keys of many priorities in one checked pass, in ranges on the thread
    pool (element-wise, so any split gives the same bits): ``(keys, the first
    bad priority's position or -1, the largest key)``."""
    out = np.empty(p.shape[0], dtype=np.float64)
    found = []

    def part(lo, hi):
        found.append(keys_range(p, alpha, eps, max_priority, out, lo, hi))

    for_ranges(part, p.shape[0], chunk)
    bad = [i for i, _ in found if i >= 0]
    return out, (min(bad) if bad else -1), max(t for _, t in found)


def scan(p, idx, stamps, use_stamps, gid, status, alpha, eps, max_priority, chunk: int):
    """``scan_range`` over the whole update, in ranges on the thread pool:
    ``(keys, first bad priority row or -1, largest key, first bad index row
    or -1, its code, rows bound for the tree)``; the index fields are only
    meaningful when no priority is bad."""
    keys = np.empty(p.shape[0], dtype=np.float64)
    parts = []

    def part(lo, hi):
        parts.append(scan_range(p, idx, stamps, use_stamps, gid, status, alpha, eps, max_priority, keys, lo, hi))

    for_ranges(part, p.shape[0], chunk)
    bad_p = [r[0] for r in parts if r[0] >= 0]
    bad_i = min(((r[2], r[3]) for r in parts if r[2] >= 0), default=(-1, 0))
    return (keys, min(bad_p) if bad_p else -1, max(r[1] for r in parts), bad_i[0], bad_i[1],
            sum(r[4] for r in parts))
