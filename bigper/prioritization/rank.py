"""Rank-based prioritization: ``P(i) = rank(i)**-alpha / H(n)``.

Transitions are ranked by priority, rank 1 the largest (after the
``max_priority`` clip); ``H(n) = 1**-alpha + ... + n**-alpha`` over the ``n``
sampleable transitions. ``eps`` does not apply: a zero priority still has a
rank, hence a non-zero probability.

The ranking is an array max-heap read as an approximately sorted array
(heap position ``p`` stands for rank ``p + 1``), fully re-sorted at the first
``sample`` after ``sort_every`` writes (default: ``capacity``, the paper's
"once every heap size"); see ``_rank_kernels`` for the layout.

- **Law.** Exactly per heap position: ``P(position p) = (p + 1)**-alpha / H(n)``
  (float rounding aside), stratified over ``k`` equal-probability segments,
  one draw each. Right after a sort, positions are the exact ranks.
- **Between sorts** the heap keeps every transition below its heap
  ancestors, which all have a larger-or-equal priority and a strictly larger
  probability. A write moves any other transition by at most one heap level
  (a removal moves the heap's last entry into the hole, which counts as a
  write of it), so a transition not written since the last sort, after ``w``
  writes, is at most ``w`` levels from where the sort put it: its probability
  is within a factor ``2**(alpha * (w + 1))`` of its sorted-time one.
- **Ties.** Equal priorities rank by recency: the most recently written
  first. A new transition enters with the largest priority seen and the
  newest tick, so it takes rank 1.
- **Memory.** 24 bytes a slot (key 8, tick 8, heap slot 4, slot position 4);
  a sort allocates 20 bytes per sampleable transition while it runs.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import CorruptSnapshotError, InvalidArgumentError, InvalidIndexError
from . import _rank_kernels as RK
from .base import LIVE, Prioritization

_INT32_MAX = 2**31 - 1
_META = ("n", "tick", "writes", "sort_every")


class RankPrioritizer(Prioritization):
    """Rank-based prioritization over ``capacity`` slots.

    Parameters
    ----------
    capacity : int
        Slots, 1 .. 2**31 - 1.
    alpha, eps, max_priority, weight_norm
        As for every strategy; ``eps`` is kept but not used.
    sort_every : int, optional
        Writes (inserts, updates, removals) between full sorts; the sort runs
        at the first ``sample`` past that count. Default: ``capacity``.
    """

    kind = "rank"

    def __init__(self, capacity, *, alpha, eps, max_priority, weight_norm, sort_every=None):
        super().__init__(capacity, alpha=alpha, eps=eps, max_priority=max_priority,
                         weight_norm=weight_norm)
        if not 1 <= self.capacity <= _INT32_MAX:
            raise InvalidArgumentError(
                f"capacity must be in [1, {_INT32_MAX}] for prioritization='rank', got {capacity!r}")
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise InvalidArgumentError(f"alpha must be finite and >= 0, got {alpha!r}")
        every = self.capacity if sort_every is None else sort_every
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
            raise InvalidArgumentError(f"sort_every must be an int >= 1, got {sort_every!r}")
        self.sort_every = int(every)
        c = self.capacity
        self._keys = np.zeros(c, dtype=np.float64)
        self._ticks = np.zeros(c, dtype=np.int64)
        self._hslot = np.zeros(c, dtype=np.int32)
        self._spos = np.full(c, -1, dtype=np.int32)
        self.n = 0          # sampleable slots, the heap's size
        self.tick = 1       # the next write's tick
        self.writes = 0     # writes since the last full sort
        self._table = RK.rank_table(self.alpha)

    # -- keys ------------------------------------------------------------------
    def keys(self, p: np.ndarray) -> np.ndarray:
        # A rank needs no transform: the clipped priority itself orders.
        return np.minimum(p, self.max_priority).astype(np.float64, copy=False)

    # -- writes ----------------------------------------------------------------
    def insert(self, slots, keys) -> None:
        self.n, self.tick = RK.heap_set(self._keys, self._ticks, self._hslot, self._spos, self.n,
                                        slots, keys, self.tick)
        self.writes += slots.shape[0]

    def remove(self, slots) -> None:
        n = RK.heap_remove(self._keys, self._ticks, self._hslot, self._spos, self.n, slots)
        self.writes += self.n - n
        self.n = n

    def update(self, idx, p, stamps, use_stamps, gid, status, pending) -> float:
        n0 = self.n
        tick0 = self.tick
        code, pos, top, n, tick = RK.rank_update(
            self._keys, self._ticks, self._hslot, self._spos, self.n, self.tick, idx, p, stamps,
            bool(use_stamps), gid, status, pending, self.max_priority)
        if code == 1:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[pos]} at position {pos}")
        if code:
            why = "out of range [0, capacity)" if code == 2 else "a slot never written"
            raise InvalidIndexError(f"indices[{pos}] = {idx[pos]} is {why} (capacity={self.capacity})")
        self.n = n
        self.tick = tick
        self.writes += (tick - tick0) + (n0 - n)
        return top

    def sort(self) -> None:
        """Fully re-sort now: heap positions become the exact ranks."""
        self.tick = int(RK.heap_sort(self._keys, self._ticks, self._hslot, self._spos, self.n))
        self.writes = 0

    # -- reads -----------------------------------------------------------------
    @property
    def total(self) -> float:
        return float(RK.cum_weight(self.n, self.alpha, self._table)) if self.n else 0.0

    @property
    def sampleable(self) -> bool:
        return self.n > 0

    @property
    def min_key(self) -> float:
        """Smallest priority of a sampleable slot (``inf`` when none)."""
        return float(self._keys[:self.n].min()) if self.n else math.inf

    def key_at(self, idx) -> np.ndarray:
        pos = self._spos[idx]
        return np.where(pos >= 0, self._keys[np.maximum(pos, 0)], 0.0)

    def positions(self, idx) -> np.ndarray:
        """Heap positions of slots ``idx`` (int64; -1 where not sampleable):
        position ``p`` is sampled as rank ``p + 1``."""
        return self._spos[idx].astype(np.int64)

    def probabilities(self, idx) -> np.ndarray:
        """``P`` the sampler gives slots ``idx`` now (0 where not sampleable)."""
        pos = self.positions(idx)
        out = RK.position_probabilities(np.maximum(pos, 0), max(self.n, 1), self.alpha, self._table)
        out[pos < 0] = 0.0
        return out

    def sample(self, uniforms, *, stratified, beta):
        if self.n == 0:
            raise InvalidArgumentError("cannot sample: no sampleable transition")
        if self.writes >= self.sort_every:
            self.sort()
        return RK.rank_sample(self._hslot, self.n, self.alpha, float(beta), self._table,
                              np.ascontiguousarray(uniforms, dtype=np.float64), bool(stratified),
                              self.batch_norm)

    # -- state -----------------------------------------------------------------
    def state(self):
        meta = {"n": self.n, "tick": self.tick, "writes": self.writes, "sort_every": self.sort_every}
        return meta, {"rank_keys": self._keys, "rank_ticks": self._ticks, "rank_slots": self._hslot}

    def restore(self, meta, arrays, status) -> None:
        """Load a recorded state after checking all of it (``CorruptSnapshotError``
        naming what is wrong); nothing changes on a refusal."""
        got = self._checked(meta, arrays, status)
        self._keys[:] = got["rank_keys"]
        self._ticks[:] = got["rank_ticks"]
        self._hslot[:] = got["rank_slots"]
        self._spos[:] = got["spos"]
        self.n, self.tick, self.writes, self.sort_every = (got[k] for k in _META)

    def _checked(self, meta, arrays, status) -> dict:
        def bad(what):
            raise CorruptSnapshotError(f"rank prioritization state: {what}")

        if not isinstance(meta, dict):
            bad(f"meta must be a dict, got {type(meta).__name__}")
        c = self.capacity
        out = {}
        limits = {"n": (0, c), "tick": (1, 2**62), "writes": (0, 2**62), "sort_every": (1, 2**62)}
        for key in _META:
            v = meta.get(key)
            lo, hi = limits[key]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                bad(f"meta[{key!r}] must be an int in [{lo}, {hi}], got {v!r}")
            out[key] = int(v)
        for name, dtype in (("rank_keys", np.float64), ("rank_ticks", np.int64), ("rank_slots", np.int32)):
            a = arrays.get(name)
            if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != (c,):
                desc = None if not isinstance(a, np.ndarray) else (a.dtype, a.shape)
                bad(f"array {name!r} must be {np.dtype(dtype)} of shape ({c},), got {desc}")
            out[name] = np.ascontiguousarray(a)
        n = out["n"]
        keys = out["rank_keys"][:n]
        ticks = out["rank_ticks"][:n]
        slots = out["rank_slots"][:n]
        if n and not (ticks.min() >= 1 and ticks.max() < out["tick"]):
            bad(f"a tick outside [1, tick={out['tick']})")
        if n and not (slots.min() >= 0 and slots.max() < c):
            bad(f"a slot outside [0, {c})")
        spos = np.full(c, -1, dtype=np.int32)
        spos[slots] = np.arange(n, dtype=np.int32)
        if n and np.count_nonzero(spos >= 0) != n:
            bad("a slot appears twice in the heap")
        live = np.asarray(status) == LIVE
        if live.shape != (c,) or not np.array_equal(spos >= 0, live):
            bad("the heap's slots are not exactly the sampleable slots of status")
        if n and np.unique(ticks).shape[0] != n:
            bad("two entries share a tick")
        code, pos = RK.heap_check(keys.copy(), ticks.copy(), slots.copy(), spos, n)
        if code:
            bad(_PROBLEMS[code].format(pos=pos))
        out["spos"] = spos
        return out

    def check(self, status) -> list[str]:
        problems = []
        code, pos = RK.heap_check(self._keys, self._ticks, self._hslot, self._spos, self.n)
        if code:
            problems.append(_PROBLEMS[code].format(pos=pos))
        live = np.asarray(status) == LIVE
        if not np.array_equal(self._spos >= 0, live):
            problems.append("the heap's slots are not exactly the sampleable slots")
        if self.n and int(self._ticks[:self.n].max()) >= self.tick:
            problems.append(f"a tick is not below the next tick {self.tick}")
        return problems

    def rank_drift(self) -> dict:
        """How far heap positions are from exact ranks now (a diagnostic, O(n log n)).

        Returns ``{"writes_since_sort", "median", "p90", "max"}``, the last three
        over the sampleable transitions of ``|log2((position + 1) / rank)|``
        (0 right after a sort; 1 means a factor 2 in ``rank``, ``2**alpha`` in ``P``).
        """
        n = self.n
        out = {"writes_since_sort": self.writes, "median": 0.0, "p90": 0.0, "max": 0.0}
        if n == 0:
            return out
        order = np.lexsort((-self._ticks[:n], -self._keys[:n]))  # exact ranks, ties by recency
        rank = np.empty(n, dtype=np.float64)
        rank[order] = np.arange(1, n + 1)
        d = np.abs(np.log2(np.arange(1, n + 1) / rank))
        out.update(median=float(np.median(d)), p90=float(np.quantile(d, 0.9)), max=float(d.max()))
        return out


_PROBLEMS = {
    1: "heap position {pos} ranks above its parent",
    2: "heap position {pos}: slot and position tables disagree",
    3: "heap position {pos} shares its parent's tick",
    4: "heap position {pos} holds a key that is NaN, infinite, negative or -0.0",
}
