"""Rank-based prioritization: ``P(i) = rank(i)**-alpha / H(n)``.

Transitions are ranked by priority, rank 1 the largest (after the
``max_priority`` clip); ``H(n) = 1**-alpha + ... + n**-alpha`` over the ``n``
sampleable transitions. ``eps`` does not apply: a zero priority still has a
rank, hence a non-zero probability.

The ranking is an array max-heap read as an approximately sorted array
(heap position ``p`` stands for rank ``p + 1``), fully re-sorted at the first
``sample`` after ``sort_every`` writes (default: ``capacity``, the paper's
"once every heap size"), and before the write clock (ticks) would pass
2**32; see ``_rank_kernels`` for the layout.

- **Law.** Exactly per heap position: ``P(position p) = (p + 1)**-alpha / H(n)``
  (float rounding aside), stratified over ``k`` equal-probability segments,
  one draw each. Right after a sort, positions are the exact ranks.
- **Between sorts** the heap keeps every transition below its heap
  ancestors, which all have a larger-or-equal priority and a strictly larger
  probability. A write moves any other transition by at most one heap level
  (a removal moves the heap's last entry into the hole, which counts as a
  write of it), so a transition not written since the last sort, after ``w``
  writes, is at most ``w`` levels from where the sort put it: its sampled
  rank ``p + 1`` is within a factor ``2**(w + 1)`` of the exact rank the sort
  gave it (its probability, at equal ``n``, within ``2**(alpha * (w + 1))``),
  and its exact rank has moved by at most ``w`` since. That bound is loose;
  ``rank_drift()`` measures the real distance (at 2**20 slots, after 2**20
  updates of sampled transitions: median ``|log2(sampled / exact rank)|``
  0.28, 90th percentile 1.06).
- **Ties.** Equal priorities rank by recency: the most recently written
  first. A new transition enters with the largest priority seen and the
  newest tick, so it takes rank 1.
- **Memory.** 20 bytes a slot (key 8, tick and slot 8, slot position 4);
  a sort allocates 32 bytes per sampleable transition while it runs.
"""

from __future__ import annotations

import math

import numpy as np

from . import _tree_kernels as K
from ..errors import CorruptSnapshotError, InvalidArgumentError, InvalidIndexError
from . import _rank_kernels as RK
from . import _rank_law as LAW
from ._rank_sort import SLOT_MASK, heap_sort
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
    ARRAYS = ("rank_heap",)

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
        self._heap = np.zeros((c, 2), dtype=np.int64)
        self._spos = np.full(c, -1, dtype=np.int32)
        self.n = 0          # sampleable slots, the heap's size
        self.tick = 1       # the next write's tick
        self.writes = 0     # writes since the last full sort
        self._table = LAW.rank_table(self.alpha)

    # -- keys ------------------------------------------------------------------
    def keys(self, p: np.ndarray) -> np.ndarray:
        # A rank needs no transform: the clipped priority itself orders.
        return np.minimum(p, self.max_priority).astype(np.float64, copy=False)

    # -- writes ----------------------------------------------------------------
    def _room(self, m: int) -> None:
        # Ticks must stay below 2**32; a sort renumbers them from n + 1.
        if self.tick + m >= RK.TICK_LIMIT:
            self.sort()

    def insert(self, slots, keys) -> None:
        self._room(slots.shape[0])
        self.n, self.tick = RK.heap_set(self._heap, self._spos, self.n, slots,
                                        np.ascontiguousarray(keys, dtype=np.float64), self.tick)
        self.writes += slots.shape[0]

    def remove(self, slots) -> None:
        n = RK.heap_remove(self._heap, self._spos, self.n, slots)
        self.writes += self.n - n
        self.n = n

    def assign(self, keys, live) -> None:
        """Every slot at once, then one full sort: O(N) radix passes, not N
        heap inserts. Equal keys rank by slot, the later slot first (as if
        written in slot order)."""
        slots = np.flatnonzero(live).astype(np.int64)
        n = slots.shape[0]
        kept = np.ascontiguousarray(keys[slots], dtype=np.float64) + 0.0  # -0.0 becomes +0.0
        self._spos[:] = -1
        self._heap[n:] = 0
        self._heap[:n, 0] = kept.view(np.int64)
        self._heap[:n, 1] = (np.arange(1, n + 1, dtype=np.int64) << 31) | slots
        self.n = n
        self.sort()

    def update(self, idx, p, stamps, use_stamps, gid, status, pending) -> float:
        if self.tick + idx.shape[0] >= RK.TICK_LIMIT:
            # The renumbering sort changes the state: only for an update that passes.
            _refuse(*RK.first_bad_row(idx, p, status), idx, p, self.capacity)
            self.sort()
        n0 = self.n
        tick0 = self.tick
        code, pos, top, n, tick = RK.rank_update(
            self._heap, self._spos, self.n, self.tick, idx, p, stamps, bool(use_stamps), gid, status,
            pending, self.max_priority)
        _refuse(code, pos, idx, p, self.capacity)
        self.n = n
        self.tick = tick
        self.writes += (tick - tick0) + (n0 - n)
        return top

    def sort(self) -> None:
        """Fully re-sort now: heap positions become the exact ranks."""
        self.tick = int(heap_sort(self._heap, self._spos, self.n))
        self.writes = 0

    # -- reads -----------------------------------------------------------------
    @property
    def total(self) -> float:
        return float(LAW.cum_weight(self.n, self.alpha, self._table)) if self.n else 0.0

    @property
    def sampleable(self) -> bool:
        return self.n > 0

    @property
    def min_key(self) -> float:
        """Smallest priority of a sampleable slot (``inf`` when none)."""
        return float(self._heap[:self.n, 0].min().view(np.float64)) if self.n else math.inf

    def key_at(self, idx) -> np.ndarray:
        pos = self._spos[idx]
        keys = np.ascontiguousarray(self._heap[np.maximum(pos, 0), 0]).view(np.float64)
        return np.where(pos >= 0, keys, 0.0)

    def heap_keys(self) -> np.ndarray:
        """Priorities in heap order, shape ``(n,)`` float64 (a copy)."""
        return np.ascontiguousarray(self._heap[:self.n, 0]).view(np.float64)

    def heap_slots(self) -> np.ndarray:
        """Slots in heap order, shape ``(n,)`` int64 (a copy)."""
        return self._heap[:self.n, 1] & SLOT_MASK

    def heap_ticks(self) -> np.ndarray:
        """Ticks in heap order, shape ``(n,)`` int64 (a copy)."""
        return self._heap[:self.n, 1] >> 31

    def positions(self, idx) -> np.ndarray:
        """Heap positions of slots ``idx`` (int64; -1 where not sampleable):
        position ``p`` is sampled as rank ``p + 1``."""
        return self._spos[idx].astype(np.int64)

    def probabilities(self, idx) -> np.ndarray:
        pos = self.positions(idx)
        out = LAW.rank_probabilities(np.maximum(pos, 0) + 1, max(self.n, 1), self.alpha, self._table)
        out[pos < 0] = 0.0
        return out

    def sample(self, uniforms, *, stratified, beta):
        if self.n == 0:
            raise InvalidArgumentError("cannot sample: no sampleable transition")
        if self.writes >= self.sort_every:
            self.sort()
        ranks, prob, weights = LAW.draw_ranks(
            self.n, self.alpha, float(beta), self._table, np.ascontiguousarray(uniforms, dtype=np.float64),
            bool(stratified), self.batch_norm)
        return RK.slots_at(self._heap, ranks), prob, weights

    # -- state -----------------------------------------------------------------
    def state(self):
        meta = {"n": self.n, "tick": self.tick, "writes": self.writes, "sort_every": self.sort_every}
        return meta, dict(zip(self.ARRAYS, (self._heap,)))

    def restore(self, meta, arrays, status) -> None:
        """Load a recorded state after checking all of it (``CorruptSnapshotError``
        naming what is wrong); nothing changes on a refusal."""
        got = self._checked(meta, arrays, status)
        self._heap[:] = got["rank_heap"]
        self._spos[:] = got["spos"]
        self.n, self.tick, self.writes, self.sort_every = (got[k] for k in _META)

    @classmethod
    def recorded_keys(cls, meta, arrays, capacity):
        """Slot ``s``'s key is the priority (its bit pattern, ``_rank_kernels``)
        at the heap position that names ``s``; positions past ``meta["n"]``
        hold none. None where the heap does not decode (a slot out of range,
        or named twice)."""
        n = meta.get("n") if isinstance(meta, dict) else None
        heap = arrays.get("rank_heap") if isinstance(arrays, dict) else None
        if (isinstance(n, bool) or not isinstance(n, int) or isinstance(capacity, bool)
                or not isinstance(capacity, (int, np.integer)) or not 0 <= n <= capacity
                or not isinstance(heap, np.ndarray) or heap.dtype != np.int64 or heap.shape != (capacity, 2)):
            return None
        words = heap[:n, 1]
        slots = words & SLOT_MASK
        if n and (words.min() < 0 or slots.max() >= capacity or np.unique(slots).size != n):
            return None
        keys = np.full(capacity, np.nan)
        keys[slots] = heap[:n, 0].view(np.float64)
        return keys

    def _checked(self, meta, arrays, status) -> dict:
        def bad(what):
            raise CorruptSnapshotError(f"rank prioritization state: {what}")

        if not isinstance(meta, dict):
            bad(f"meta must be a dict, got {type(meta).__name__}")
        c = self.capacity
        out = {}
        limits = {"n": (0, c), "tick": (1, RK.TICK_LIMIT - 1), "writes": (0, 2**62),
                  "sort_every": (1, 2**62)}
        for key in _META:
            v = meta.get(key)
            lo, hi = limits[key]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                bad(f"meta[{key!r}] must be an int in [{lo}, {hi}], got {v!r}")
            out[key] = int(v)
        heap = arrays.get("rank_heap") if isinstance(arrays, dict) else None
        if not isinstance(heap, np.ndarray) or heap.dtype != np.int64 or heap.shape != (c, 2):
            desc = (heap.dtype, heap.shape) if isinstance(heap, np.ndarray) else type(heap).__name__
            bad(f"array 'rank_heap' must be int64 of shape ({c}, 2), got {desc}")
        heap = np.ascontiguousarray(heap)
        n = out["n"]
        words = heap[:n, 1]
        if n and words.min() < 0:
            bad("a negative tick word")
        slots = words & SLOT_MASK
        ticks = words >> 31
        if n and not (slots.max() < c and ticks.min() >= 1 and ticks.max() < out["tick"]):
            bad(f"a slot outside [0, {c}) or a tick outside [1, tick={out['tick']})")
        spos = np.full(c, -1, dtype=np.int32)
        spos[slots] = np.arange(n, dtype=np.int32)
        if np.count_nonzero(spos >= 0) != n:
            bad("a slot appears twice in the heap")
        live = np.asarray(status) == LIVE
        if live.shape != (c,) or not np.array_equal(spos >= 0, live):
            bad("the heap's slots are not exactly the sampleable slots of status")
        if _repeats(ticks):
            bad("two entries share a tick")
        code, pos = RK.heap_check(heap, spos, n)
        if code != RK.HEAP_OK:
            bad(_PROBLEMS[code].format(pos=pos))
        out["rank_heap"] = heap
        out["spos"] = spos
        return out

    def check(self, status) -> list[str]:
        problems = []
        code, pos = RK.heap_check(self._heap, self._spos, self.n)
        if code != RK.HEAP_OK:
            problems.append(_PROBLEMS[code].format(pos=pos))
        live = np.asarray(status) == LIVE
        if not np.array_equal(self._spos >= 0, live):
            problems.append("the heap's slots are not exactly the sampleable slots")
        ticks = self.heap_ticks()
        if self.n and int(ticks.max()) >= self.tick:
            problems.append(f"a tick is not below the next tick {self.tick}")
        if _repeats(ticks):
            problems.append("two entries share a tick")
        return problems

    def exact_ranks(self) -> np.ndarray:
        """Exact rank (1 = largest priority, ties by recency) of each heap
        position, shape ``(n,)`` int64; O(n log n), for diagnostics and tests."""
        n = self.n
        order = np.lexsort((-self.heap_ticks(), -self.heap_keys()))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(1, n + 1)
        return rank

    def rank_drift(self) -> dict:
        """How far heap positions are from exact ranks now (a diagnostic, O(n log n)).

        Returns ``{"writes_since_sort", "median", "p90", "max"}``, the last three
        over the sampleable transitions of ``|log2((position + 1) / rank)|``
        (0 right after a sort; 1 means a factor 2 in ``rank``, ``2**alpha`` in ``P``).
        """
        out = {"writes_since_sort": self.writes, "median": 0.0, "p90": 0.0, "max": 0.0}
        if self.n == 0:
            return out
        d = np.abs(np.log2(np.arange(1, self.n + 1) / self.exact_ranks()))
        out.update(median=float(np.median(d)), p90=float(np.quantile(d, 0.9)), max=float(d.max()))
        return out


def _repeats(a: np.ndarray) -> bool:
    """True if a value occurs twice (a sort: numpy's hashing unique is ~10x slower at 2**20)."""
    s = np.sort(a)
    return bool(s.shape[0] > 1 and (s[1:] == s[:-1]).any())


def _refuse(code, pos, idx, p, capacity) -> None:
    """Raise the error for an update row refused with ``code`` (0: none)."""
    if code == K.BAD_PRIORITY:
        raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[pos]} at position {pos}")
    if code != K.UPDATE_OK:
        why = "out of range [0, capacity)" if code == K.BAD_INDEX else "a slot never written"
        raise InvalidIndexError(f"indices[{pos}] = {idx[pos]} is {why} (capacity={capacity})")


_PROBLEMS = {
    RK.HEAP_ORDER: "heap position {pos} does not rank below its parent",
    RK.HEAP_POSITIONS: "heap position {pos}: the heap and the slot positions disagree",
    RK.HEAP_KEY: "heap position {pos} holds a key that is not a finite float >= 0 (or is -0.0)",
    RK.HEAP_TICK: "heap position {pos} holds a tick outside [1, 2**32)",
}
