"""PriorityTree: a k-ary sum tree (and optional min tree) over any number of leaves.

::

    level 0 (root)            [ 8.0 ]
                            /    |    \\
    level 1           [ 3.5 ] [ 4.0 ] [ 0.5 ]           k children a node,
                      / | \\    / | \\    |                the last node of a level
    level 2 (leaves) 1 2 .5  0 3 1     .5               may have fewer

All levels live in one flat float64 array, root first (``offsets``/``sizes``
say where each level starts and how long it is). With ``k = 8`` a node's
children are one cache line, and 2**20 leaves need 7 levels.
A zero leaf is not sampleable; the min tree ignores it.
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import numpy as np

from . import _tree_kernels as K
from ..common.pool import for_ranges
from ..errors import InvalidArgumentError

FANOUT = K.FANOUT
# Nodes of one level per thread in a rebuild, at least (below, one thread is faster).
_REBUILD_CHUNK = 1 << 14


def _layout(n: int, k: int = FANOUT) -> tuple[np.ndarray, np.ndarray, int]:
    """Level offsets and sizes; every level starts on a multiple of ``k`` so
    that a node's children never straddle an extra cache line."""
    sizes = [n]
    while sizes[-1] > 1 or len(sizes) == 1:
        sizes.append(-(-sizes[-1] // k))
    sizes.reverse()
    offsets = np.zeros(len(sizes), dtype=np.int64)
    pos = 0
    for lev, size in enumerate(sizes):
        offsets[lev] = pos
        pos += -(-size // k) * k
    return offsets, np.asarray(sizes, dtype=np.int64), pos


def _alloc(n: int, fill: float) -> np.ndarray:
    """float64 array on fresh anonymous pages, 4 KiB aligned, backed by huge
    pages where the kernel allows it: random descents then miss the TLB less.
    Private pages (``mmap``'s default is a shared mapping): a forked child
    gets its own copy of the tree, as of every other array, never the
    parent's live one."""
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, n * 8, flags=flags) if flags else mmap.mmap(-1, n * 8)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    arr = np.frombuffer(m, dtype=np.float64, count=n)
    if fill != 0.0:
        arr.fill(fill)
    return arr


class TreeArrays(NamedTuple):
    """A tree's arrays as the fused kernels of the writer, the sequence items
    and the feed take them (``PriorityTree.arrays``; see ``_tree_kernels``),
    as a plain tuple at the call (``common/kernels.py`` says why)."""

    sums: np.ndarray
    mins: np.ndarray
    offsets: np.ndarray


class PriorityTree:
    """Sum tree (and min tree) over ``capacity`` float64 leaves.

    Parameters
    ----------
    capacity : int
        Number of leaves, any value >= 1.
    track_min : bool
        Keep a min tree over the non-zero leaves (needed for global weight
        normalization).
    """

    def __init__(self, capacity: int, *, track_min: bool = True):
        if int(capacity) < 1:
            raise InvalidArgumentError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self.k = FANOUT
        self.offsets, self.sizes, total = _layout(self.capacity)
        self.sums = _alloc(total, 0.0)
        # The min tree has no leaf level (see _tree_kernels): it ends where the leaves start.
        self.mins = _alloc(int(self.offsets[-1]) if track_min else 0, np.inf)
        self._leaf_off = int(self.offsets[-1])
        self.arrays = TreeArrays(self.sums, self.mins, self.offsets)  # (what the fused kernels take)
        # False: bulk writes rebuild in one kernel call (tree_build), for the
        # tests that hold the threaded rebuild to it.
        self.threaded = True

    # -- reading -----------------------------------------------------------
    @property
    def leaves(self) -> np.ndarray:
        """View of the leaf values, shape ``(capacity,)`` float64 (read it, don't write it)."""
        return self.sums[self._leaf_off:self._leaf_off + self.capacity]

    @property
    def total(self) -> float:
        return float(self.sums[0])

    @property
    def min(self) -> float:
        """Smallest non-zero leaf (``inf`` when every leaf is zero)."""
        if self.mins.shape[0] == 0:
            nz = self.leaves[self.leaves > 0]
            return float(nz.min()) if nz.size else math.inf
        return float(self.mins[0])

    # -- writing (indices and values already validated) ---------------------
    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (int64) to ``values`` (float64 >= 0); the last duplicate wins."""
        if idx.shape[0] * 8 >= self.capacity and idx.shape[0] > 1024:
            # Walking every ancestor of that many leaves costs more than one O(N) rebuild.
            if self.threaded:
                K.set_leaves(self.sums, self.offsets, idx, values)
                self.rebuild()
            else:
                K.tree_set_many(self.sums, self.mins, self.offsets, self.sizes, idx, values)
        else:
            K.tree_set(self.sums, self.mins, self.offsets, idx, values)

    def set_all(self, values: np.ndarray) -> None:
        """Replace every leaf and rebuild the tree in O(N)."""
        self.sums[self._leaf_off:self._leaf_off + self.capacity] = values
        if self.threaded:
            self.rebuild()
        else:
            K.tree_build(self.sums, self.mins, self.offsets, self.sizes)

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves, O(N), level by level
        bottom up; a large level in ranges on several threads (the same
        nodes, the same values: ``tree_build``'s result bit for bit)."""
        sums, mins, offsets = self.sums, self.mins, self.offsets
        for lev in range(len(self.sizes) - 2, -1, -1):
            size = int(self.sizes[lev])
            if size >= 2 * _REBUILD_CHUNK:
                for_ranges(lambda lo, hi, lev=lev: K.tree_level(sums, mins, offsets, lev, lo, hi),
                           size, _REBUILD_CHUNK)
            else:
                K.tree_level(sums, mins, offsets, lev, 0, size)

    def find(self, targets: np.ndarray) -> np.ndarray:
        """Leaf index for each prefix-sum target in ``[0, total)``."""
        out = np.empty(targets.shape[0], dtype=np.int64)
        K.tree_descend(self.sums, self.offsets,
                       np.ascontiguousarray(targets, dtype=np.float64), out)
        return out

    def sample(self, uniforms: np.ndarray, *, stratified: bool, beta: float, batch_norm: bool):
        """Indices, probabilities and IS weights for uniforms in ``[0, 1)``."""
        return K.sample_kernel(self.sums, self.mins, self.offsets, uniforms, stratified,
                               float(beta), batch_norm or self.mins.shape[0] == 0)

    # -- state ---------------------------------------------------------------
    def check(self, rel: float = 1e-9) -> list[str]:
        """Invariant violations (empty when healthy): parents equal the sum of
        their children, mins equal the min of theirs."""
        problems = []
        for lev in range(len(self.sizes) - 1):
            child = self.sums[self.offsets[lev + 1]:self.offsets[lev + 1] + self.sizes[lev + 1]]
            pad = (-child.shape[0]) % self.k
            sums = np.concatenate([child, np.zeros(pad)]).reshape(-1, self.k).sum(axis=1)
            got = self.sums[self.offsets[lev]:self.offsets[lev] + self.sizes[lev]]
            if not np.allclose(got, sums, rtol=rel, atol=0):
                problems.append(f"level {lev}: a node differs from the sum of its children")
        if self.mins.shape[0]:
            nz = self.leaves[self.leaves > 0]
            want = float(nz.min()) if nz.size else math.inf
            if self.mins[0] != want:
                problems.append(f"min tree root {self.mins[0]} != smallest non-zero leaf {want}")
        return problems
