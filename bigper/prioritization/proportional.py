"""Proportional prioritization: ``P(i) = leaf_i / sum(leaves)`` over a sum tree."""

from __future__ import annotations

import math
import sys

import numpy as np

from . import _tree_kernels as K
from ..errors import InvalidArgumentError, InvalidIndexError
from .tree import PriorityTree
from . import _bulk
from .base import Prioritization
from ..common.status import LIVE

_EMPTY = np.zeros(0, dtype=np.float64)
_BULK = 4096  # above this many rows the keys are computed in threads first
_POW_CHUNK = 1 << 16  # rows per thread at least, for the bulk keys
# Above this many rows bound for the tree (and an eighth of the slots), an
# update writes the leaves and rebuilds the tree in O(N) (as update_capped does).
_REBUILD_MIN = 1024


def is_weights(lo: float, keys: np.ndarray, beta: float) -> np.ndarray:
    """``(lo / key) ** beta`` as float32, through logarithms where the ratio
    underflows (keys more than ~1e308 apart), at least ``W_MIN``, as
    ``_tree_kernels.is_weight``."""
    with np.errstate(under="ignore", divide="ignore"):
        r = lo / keys
        w = r ** beta
        tiny = r < np.finfo(np.float64).tiny
        if tiny.any():
            w[tiny] = np.exp(beta * (np.log(lo) - np.log(keys[tiny])))
    return np.maximum(w, K.W_MIN).astype(np.float32)


class Proportional(Prioritization):
    """A leaf holds ``(min(p, max_priority) + eps) ** alpha``; a zero leaf is
    never drawn. Leaves are capped at ``float max / capacity`` so that the
    total, every node of the tree and the largest leaf stay finite whatever
    is added; a priority whose leaf would pass the cap is refused.
    """

    kind = "proportional"
    ARRAYS = ("leaves",)
    # False: the general paths (keys then update kernel, one-thread rebuilds,
    # kernel-made sample arrays), which tests/test_fused*.py compare against.
    fused = True

    def __init__(self, capacity, *, alpha, eps, max_priority, weight_norm):
        super().__init__(capacity, alpha=alpha, eps=eps, max_priority=max_priority,
                         weight_norm=weight_norm)
        self.tree = PriorityTree(self.capacity, track_min=not self.batch_norm)
        # Every leaf <= limit keeps the root (a sum of `capacity` leaves) finite.
        self.limit = sys.float_info.max / self.capacity

    # -- keys ------------------------------------------------------------------
    def keys(self, p: np.ndarray) -> np.ndarray:
        if p.shape[0] > _BULK:
            out, bad, top = _bulk.keys(p, self.alpha, self.eps, self.max_priority, _POW_CHUNK)
            if bad >= 0:  # callers pass checked priorities; never a key made of garbage
                raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[bad]} at position {bad}")
            if not top <= self.limit:
                self._check_keys(p, out)
            return out
        out = np.empty(p.shape[0], dtype=np.float64)
        K.to_leaves(p, self.alpha, self.eps, self.max_priority, out)
        self._check_keys(p, out)
        return out

    def _check_keys(self, p, keys) -> None:
        if keys.shape[0] and not keys.max() <= self.limit:  # also catches NaN
            bad = int(np.flatnonzero(~(keys <= self.limit))[0])
            raise InvalidArgumentError(
                f"priorities[{bad}] = {p[bad]!r} gives the leaf (min(p, max_priority) + eps) ** alpha "
                f"= {keys[bad]!r}, above the largest leaf this buffer keeps finite "
                f"(float max / capacity = {self.limit:.6g}); lower alpha or set max_priority")

    # -- writes ----------------------------------------------------------------
    def insert(self, slots, keys) -> None:
        self.tree.set(slots, keys)

    def remove(self, slots) -> None:
        self.tree.set(slots, np.zeros(slots.shape[0]))

    def assign(self, keys, live) -> None:
        self.tree.set_all(np.where(live, keys, 0.0))  # one O(N) rebuild

    def update(self, idx, p, stamps, use_stamps, gid, status, pending) -> float:
        # One kernel call checks the priorities, computes the keys, checks them
        # against the cap, checks the indices and applies it all. Above _BULK
        # rows one threaded pass first checks everything and computes the keys
        # (the same scalar pow); when most leaves change they are then written
        # in one pass and the tree rebuilt (_bulk.py), else the kernel applies them.
        t = self.tree
        if not self.fused:  # the general path: keys first, then the kernel
            pre = self.keys(p) if K.first_bad_priority(p) < 0 else _EMPTY
            code, pos, top = K.update_kernel((t.sums, t.mins, t.offsets, t.sizes), (idx, p, pre, stamps, use_stamps),
                                             (gid, status, pending), (self.alpha, self.eps, self.max_priority))
            return self._raise(code, pos, idx, p) if code else top
        pre = _EMPTY
        if p.shape[0] > _BULK:  # checks, keys and routing counts in one threaded pass
            keys, bad, top, bad_row, code, kept = _bulk.scan(
                p, idx, stamps, use_stamps, gid, status, self.alpha, self.eps, self.max_priority, _POW_CHUNK)
            if bad < 0:
                if not top <= self.limit:
                    self._check_keys(p, keys)  # raises, naming the first
                if bad_row >= 0:
                    return self._raise(code, bad_row, idx, p)
                if kept * 8 >= gid.shape[0] and kept > _REBUILD_MIN:
                    # Most leaves change: write them last row first, then one O(N) rebuild.
                    top = _bulk.write_last_first(t.sums, int(t.offsets[-1]), idx, keys, stamps, use_stamps,
                                                 gid, status, pending, np.zeros(gid.shape[0], dtype=np.bool_))
                    t.rebuild()
                    return top
                pre = keys
        code, pos, top = K.update_capped((t.sums, t.mins, t.offsets, t.sizes), (idx, p, pre, stamps, use_stamps),
                                         (gid, status, pending), (self.alpha, self.eps, self.max_priority, self.limit),
                                         True)
        if code == K.UPDATE_OK and pos == -2:  # a bulk update wrote the leaves; the nodes in threads
            t.rebuild()
        return self._raise(code, pos, idx, p) if code else top

    def _raise(self, code, pos, idx, p):
        if code == K.ABOVE_LIMIT:  # a key above the cap: keys() says which, in its words
            self.keys(p)
            raise InvalidArgumentError(f"priorities[{pos}] = {p[pos]!r} gives a leaf above {self.limit:.6g}")
        if code == K.BAD_PRIORITY:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[pos]} at position {pos}")
        if code:
            why = "out of range [0, capacity)" if code == K.BAD_INDEX else "a slot never written"
            raise InvalidIndexError(f"indices[{pos}] = {idx[pos]} is {why} (capacity={self.capacity})")

    # -- reads -----------------------------------------------------------------
    @property
    def total(self) -> float:
        return self.tree.total

    @property
    def sampleable(self) -> bool:
        return self.tree.sums[0] > 0

    @property
    def min_key(self) -> float:
        """Smallest non-zero leaf (``inf`` when nothing is sampleable)."""
        return self.tree.min

    def key_at(self, idx) -> np.ndarray:
        return self.tree.leaves[idx]

    def sample(self, uniforms, *, stratified, beta):
        if not self.fused:
            return self.tree.sample(uniforms, stratified=stratified, beta=beta, batch_norm=self.batch_norm)
        t = self.tree
        n = uniforms.shape[0]
        idx, prob, w = np.empty(n, np.int64), np.empty(n, np.float64), np.empty(n, np.float32)
        K.sample_into(t.sums, t.mins, t.offsets, uniforms, stratified, float(beta),
                      self.batch_norm or t.mins.shape[0] == 0, idx, prob, w)
        return idx, prob, w

    def sample_at(self, targets, *, beta):
        idx = self.tree.find(targets)
        leaves = self.tree.leaves[idx]
        return idx, leaves / self.tree.total, is_weights(leaves.min(), leaves, beta)

    # -- state -----------------------------------------------------------------
    def state(self):
        return {}, dict(zip(self.ARRAYS, (self.tree.leaves,)))

    def restore(self, meta, arrays, status) -> None:
        self.tree.set_all(arrays["leaves"])

    @classmethod
    def recorded_keys(cls, meta, arrays, capacity):
        leaves = arrays.get("leaves") if isinstance(arrays, dict) else None
        if not isinstance(leaves, np.ndarray) or leaves.dtype != np.float64 or leaves.shape != (capacity,):
            return None
        return leaves

    def check(self, status) -> list[str]:
        problems = self.tree.check()
        leaves = self.tree.leaves
        if not np.all(np.isfinite(leaves)) or leaves.min(initial=0.0) < 0:
            problems.append("a leaf is negative or not finite")
        elif leaves.max(initial=0.0) > self.limit:
            problems.append(f"a leaf exceeds float max / capacity ({self.limit:.6g})")
        if not math.isfinite(self.total):
            problems.append("the total is not finite")
        if np.any(leaves[status != LIVE] != 0):
            problems.append("a slot that is not sampleable has a non-zero leaf")
        return problems
