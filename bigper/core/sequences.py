"""Sequence items (``sequence=bigper.Sequence(...)``): which start steps are
items, their status, and the windows of steps a sampled item covers.

Steps are stored once, in the buffer's ring, as without sequences; an *item*
is a start step. Along one env's stream, a step at position ``pos`` of its
episode (0 at the episode's first step) starts an item when
``pos % period == 0``. Item ``s`` (its start slot) covers::

    burn-in: min(pos, burn_in) steps before s      (padding in front for the rest)
    learning: s and the steps after it, up to length steps or the episode's end
              (padding behind for the rest)

    episode  |x0 x1 x2 x3 x4 x5 x6 x7 x8|     length 4, burn_in 2, period 3
    items     ^        ^        ^             starts at pos 0, 3, 6
    item@3          [x1 x2|x3 x4 x5 x6]       T = 6 steps, all real
    item@6                   [x4 x5|x6 x7 x8 __]   episode ended: one padded step

Item status by start slot: 0 never written, 3 dead or no item starts there.
An item is *pending* (status 2, its key in ``pending``) until its ``length``
steps are written or its episode ends, then *live* (status 1, a leaf in the
prioritization); it is *dead* (status 3) from the moment its earliest step
(the first of its burn-in, or the start) is overwritten by the ring or loses
its frames: the ring overwrites oldest first, so the earliest step decides.
Along one env's stream the earliest steps of successive items never
decrease, so one pointer per env finds the items that just died (as
``frames.expire`` does for transitions).

Leaves live only at item start slots; the buffer's prioritization strategy
is used as it is, with the item status and pending arrays in place of the
transition ones.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..common.kernels import kernel
from ..prioritization._tree_kernels import tree_set
from ..prioritization.tree import TreeArrays
from ..tensors.lazy import as_array
from ..config import Config
from ..errors import InvalidArgumentError, InvalidTypeError
from ..common.status import DEAD, EMPTY, LIVE, PENDING
from .recorded import BIG, array, refuse
from .ring import expected_gid

# Names of the item tables in a buffer's recorded state (``state_dict``).
ITEM_ARRAYS = ("seq_pos", "seq_status", "seq_pending", "seq_next", "seq_ptr")

Positions = np.ndarray  # int64 (C,): a step's position in its episode, -1 for a placeholder row


class ItemRows(NamedTuple):
    """The rows a write records, as the item kernels take them."""

    slots: np.ndarray  # (m,) int64: the slots written
    ends: np.ndarray  # (m,) uint8: their end bits
    valid: np.ndarray  # (m,) bool: False for a placeholder row
    keys: np.ndarray  # (m,) float64: the key of the item a row starts


class ItemSizes(NamedTuple):
    """The buffer's and the sequence's sizes (``Items.sizes``)."""

    capacity: int
    num_envs: int
    length: int
    period: int
    burn_in: int


class ItemTables(NamedTuple):
    """The item arrays the write kernels change (``Items.tables``; the same arrays every call)."""

    next_pos: np.ndarray  # (num_envs,) int64: each env's next step's position
    pos: np.ndarray  # (C,) int64: each slot's position in its episode
    status: np.ndarray  # (C,) uint8: item status by start slot
    pending: np.ndarray  # (C,) float64: the keys of pending items
    ptr: np.ndarray  # (num_envs,) int64: each env's oldest item that may live
    dead: np.ndarray  # (C,) int64: scratch, the items a write kills


class StepBook(NamedTuple):
    """The ring's arrays the item kernels read."""

    gid: np.ndarray  # (C,) int64: the step each slot holds
    status: np.ndarray  # (C,) uint8: each step's status


@kernel
def write_items(g0, rows, sizes, tables, gid, ready):
    """Record rows ``g0 ..`` (``ItemRows``, already committed to
    ``gid``/``ends``): each valid row's position, a pending item where it
    starts one (with its key), and the items it completes (made live, their
    slots written to ``ready``). Returns how many are in ``ready``.
    ``sizes``: ``ItemSizes``; ``tables``: ``ItemTables`` (each a plain tuple
    at the call, named here: ``common/kernels.py`` says why)."""
    rows, sizes, tables = ItemRows(*rows), ItemSizes(*sizes), ItemTables(*tables)
    slots, ends, valid, keys = rows.slots, rows.ends, rows.valid, rows.keys
    capacity, num_envs, length, period = sizes.capacity, sizes.num_envs, sizes.length, sizes.period
    next_pos, pos_arr, status, pending = tables.next_pos, tables.pos, tables.status, tables.pending
    nr = 0
    for r in range(slots.shape[0]):
        g = g0 + r
        e = g % num_envs
        s = slots[r]
        status[s] = DEAD  # written: dead unless it starts an item (0 is for never written)
        pending[s] = 0.0
        if not valid[r]:
            pos_arr[s] = -1
            next_pos[e] = 0
            continue
        pos = next_pos[e]
        pos_arr[s] = pos
        if pos % period == 0:
            status[s] = PENDING
            pending[s] = keys[r]
        ended = ends[r] != 0
        # This step completes the item it is the length-th step of; an episode
        # end completes every item of the episode still pending.
        lo = 0 if ended else length - 1
        for j in range(lo, min(pos, length - 1) + 1):
            if (pos - j) % period == 0:
                st = g - j * num_envs
                ss = st % capacity
                if gid[ss] == st and status[ss] == PENDING:
                    status[ss] = LIVE
                    ready[nr] = ss
                    nr += 1
        next_pos[e] = 0 if ended else pos + 1
    return nr


@kernel
def kill_items(ptr, count, capacity, num_envs, burn_in, period, pos_arr, gid, step_status, status, out):
    """Advance each env's pointer past the items whose earliest step is
    overwritten (before ``count - capacity``) or dead (its frames gone);
    mark those still live or pending dead, write their slots to ``out`` and
    return how many."""
    n = 0
    first = count - capacity
    for e in range(ptr.shape[0]):
        g = ptr[e]
        if g < first:  # starts the ring itself has overwritten: gone with their slots
            g += ((first - g + num_envs - 1) // num_envs) * num_envs
        while g < count:
            s = g % capacity
            pos = pos_arr[s]
            if gid[s] == g and pos >= 0 and pos % period == 0:
                early = g - min(pos, burn_in) * num_envs
                if early >= first and step_status[early % capacity] != DEAD:
                    break
                if status[s] == LIVE or status[s] == PENDING:
                    status[s] = DEAD
                    out[n] = s
                    n += 1
            g += num_envs
        ptr[e] = g
    return n


@kernel
def write_items_tree(g0, count, rows, sizes, tables, book, tree):
    """``write_items`` and ``kill_items`` with the leaves set in the sum tree
    (proportional) in the same call: the written slots' leaves go, the dead
    items' go, the completed items get their keys. The same leaves as
    ``Items.write``'s general path, in one call. ``book``: ``StepBook``;
    ``tree``: the tree's ``TreeArrays``; the rest as ``write_items``."""
    rows, sizes, tables, book = ItemRows(*rows), ItemSizes(*sizes), ItemTables(*tables), StepBook(*book)
    slots = rows.slots
    num_envs, length, period = sizes.num_envs, sizes.length, sizes.period
    status, pending, dead = tables.status, tables.pending, tables.dead
    tree = TreeArrays(*tree)
    sums, mins, offsets = tree.sums, tree.mins, tree.offsets
    m = slots.shape[0]
    ready = np.empty(m + num_envs * (length // period + 2), dtype=np.int64)
    nr = write_items(g0, rows, sizes, tables, book.gid, ready)
    nd = kill_items(tables.ptr, count, sizes.capacity, num_envs, sizes.burn_in, period, tables.pos, book.gid,
                    book.status, status, dead)
    tree_set(sums, mins, offsets, slots, np.zeros(m, dtype=np.float64))
    if nd > 0:
        tree_set(sums, mins, offsets, dead[:nd], np.zeros(nd, dtype=np.float64))
    k = 0
    for i in range(nr):
        if status[ready[i]] == LIVE:
            ready[k] = ready[i]
            k += 1
    if k > 0:
        vals = np.empty(k, dtype=np.float64)
        for i in range(k):
            vals[i] = pending[ready[i]]
        tree_set(sums, mins, offsets, ready[:k], vals)


@kernel
def windows(idx, capacity, num_envs, burn_in, length, pos_arr, gid, ends, slots_out, mask_out):
    """The ``(B, T)`` step slots and mask of the items at ``idx`` (live);
    padded steps get the item's own slot (any readable slot; zeroed later)."""
    T = burn_in + length
    for b in range(idx.shape[0]):
        s = idx[b]
        g = gid[s]
        for t in range(T):
            slots_out[b, t] = s
            mask_out[b, t] = False
        nb = min(pos_arr[s], burn_in)
        for j in range(1, nb + 1):
            slots_out[b, burn_in - j] = (g - j * num_envs) % capacity
            mask_out[b, burn_in - j] = True
        for j in range(length):
            gg = g + j * num_envs
            ss = gg % capacity
            if gid[ss] != gg:
                break
            slots_out[b, burn_in + j] = ss
            mask_out[b, burn_in + j] = True
            if ends[ss] != 0:
                break


@kernel
def item_truth(count, capacity, num_envs, burn_in, length, period, pos_arr, gid, step_status, ends, out):
    """The status every slot's item must have after ``count`` rows, from the
    positions and the ring alone (for checking a recorded state): 0 where
    nothing was written, dead where no item starts, else dead, live or
    pending by the rules above."""
    first = count - capacity
    for s in range(capacity):
        g = gid[s]
        pos = pos_arr[s]
        out[s] = EMPTY if g < 0 else DEAD
        if g < 0 or pos < 0 or pos % period != 0:
            continue
        early = g - min(pos, burn_in) * num_envs
        if early < first or step_status[early % capacity] == DEAD:
            out[s] = DEAD
            continue
        done = False
        for j in range(length):
            gg = g + j * num_envs
            if gg >= count:
                break
            if ends[gg % capacity] != 0 or j == length - 1:
                done = True
                break
        out[s] = LIVE if done else PENDING


class Items:
    """The item tables of one buffer with ``sequence=...``.

    Parameters
    ----------
    cfg : Config
        With ``cfg.sequence`` set.
    gid, step_status, ends : np.ndarray
        The buffer's ring arrays (read only here; the buffer changes them).
    """

    def __init__(self, cfg: Config, gid: np.ndarray, step_status: np.ndarray, ends: np.ndarray):
        seq = cfg.seq
        self.length, self.burn_in, self.period, self.eta = seq.length, seq.burn_in, seq.period, seq.eta
        self.T = seq.steps
        self.capacity, self.num_envs = cfg.capacity, cfg.num_envs
        self.gid, self.step_status, self.ends = gid, step_status, ends
        c, k = cfg.capacity, cfg.num_envs
        self.pos: Positions = np.full(c, -1, dtype=np.int64)
        self.status = np.zeros(c, dtype=np.uint8)      # item status at its start slot
        self.pending = np.zeros(c, dtype=np.float64)   # keys of pending items
        self.next_pos = np.zeros(k, dtype=np.int64)    # position of each env's next step
        self.ptr = np.arange(k, dtype=np.int64)        # each env's oldest item that may live
        self._dead = np.empty(c, dtype=np.int64)       # scratch for kill_items
        self._ones = np.ones(256, dtype=np.bool_)       # valid rows of a small write
        self._ready = np.empty(256 + k * (self.length // self.period + 2), dtype=np.int64)  # scratch
        # (plain tuples of the named groups, the same arrays for the buffer's life: changed in place, never replaced)
        self.sizes = tuple(ItemSizes(self.capacity, self.num_envs, self.length, self.period, self.burn_in))
        self.book = tuple(StepBook(gid, step_status))
        self.tables = tuple(ItemTables(self.next_pos, self.pos, self.status, self.pending, self.ptr, self._dead))

    # -- writes ------------------------------------------------------------------
    def write(self, prio, g0: int, slots: np.ndarray, ends: np.ndarray, valid, keys: np.ndarray,
              count: int, fused: bool = True) -> None:
        """Rows ``g0 .. count - 1`` were written at ``slots`` (and committed):
        record their items, make the completed ones live in ``prio`` and
        remove the ones whose earliest step is gone. ``fused``: with a
        proportional tree, all of it in one compiled call (the general path,
        through the strategy's insert/remove, leaves the same tree)."""
        if fused and prio.tree is not None:
            self._write_tree(prio.tree, g0, slots, ends, valid, keys, count)
        else:
            self._write_general(prio, g0, slots, ends, valid, keys, count)

    def _write_tree(self, t, g0, slots, ends, valid, keys, count) -> None:
        m = slots.shape[0]
        ok = (self._ones[:m] if m <= self._ones.shape[0] else np.ones(m, dtype=np.bool_)) if valid is None \
            else valid
        write_items_tree(g0, count, (slots, ends, ok, np.ascontiguousarray(keys, dtype=np.float64)),
                         self.sizes, self.tables, self.book, tuple(t.arrays))

    def _write_general(self, prio, g0, slots, ends, valid, keys, count) -> None:
        m = slots.shape[0]
        ok = (self._ones[:m] if m <= self._ones.shape[0] else np.ones(m, dtype=np.bool_)) if valid is None \
            else valid
        need = m + self.num_envs * (self.length // self.period + 2)
        ready = self._ready if need <= self._ready.shape[0] else np.empty(need, dtype=np.int64)
        nr = write_items(g0, (slots, ends, ok, np.ascontiguousarray(keys, dtype=np.float64)), self.sizes,
                         self.tables, self.gid, ready)
        nd = kill_items(self.ptr, count, self.capacity, self.num_envs, self.burn_in, self.period, self.pos,
                        self.gid, self.step_status, self.status, self._dead)
        prio.remove(slots)  # whatever these slots held is gone
        if nd:
            prio.remove(self._dead[:nd].copy())
        if nr:
            ready = ready[:nr].copy()
            ready = ready[self.status[ready] == LIVE]
            if ready.shape[0]:
                prio.insert(ready, self.pending[ready])

    def end(self, last: np.ndarray) -> np.ndarray:
        """Rows ``last`` (an env's last row each) now end their episodes: the
        items of those episodes still pending become live (as an episode end
        written with the row makes them) and each env's next step starts at
        position 0. Returns the slots made live."""
        ready = []
        for g in last.tolist():
            s = g % self.capacity
            pos = int(self.pos[s])
            self.next_pos[g % self.num_envs] = 0
            for j in range(min(pos, self.length - 1) + 1):  # as write_items does at an episode end
                st = g - j * self.num_envs
                ss = st % self.capacity
                if (pos - j) % self.period == 0 and self.gid[ss] == st and self.status[ss] == PENDING:
                    self.status[ss] = LIVE
                    ready.append(ss)
        return np.array(ready, dtype=np.int64)

    # -- reads -------------------------------------------------------------------
    def window(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, mask)``, both ``(B, T)``: the step slots of the items at
        ``idx`` (live) and which steps are real."""
        b = idx.shape[0]
        slots = np.empty((b, self.T), dtype=np.int64)
        mask = np.empty((b, self.T), dtype=np.bool_)
        windows(idx, self.capacity, self.num_envs, self.burn_in, self.length, self.pos, self.gid,
                self.ends, slots, mask)
        return slots, mask

    def check_starts(self, idx: np.ndarray, stamps: np.ndarray, use_stamps: bool) -> None:
        """Refuse indices of written slots that start no item (out-of-range and
        never-written ones are the prioritization's to refuse; with
        ``use_stamps``, rows whose slot was overwritten since sampling are
        skipped by it, not refused)."""
        inside = (idx >= 0) & (idx < self.capacity)
        at = np.where(inside, idx, 0)
        gid, pos = self.gid[at], self.pos[at]
        now = (gid == stamps) if use_stamps else True
        bad = np.flatnonzero(inside & (gid >= 0) & ((pos < 0) | (pos % self.period != 0)) & now)
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(
                f"indices[{i}] = {idx[i]} is a step that starts no sequence item (items start every "
                f"period={self.period} steps of an episode)")

    def reduce(self, errors, mask, b: int):
        """Per-item priorities from ``errors``: ``(B,)`` as they are, or per step
        ``(B, T)`` (or ``(B, length)``, the steps after the burn-in) reduced
        over each row's real steps after the burn-in with
        ``eta * max + (1 - eta) * mean``. Values at padded and burn-in steps
        are ignored (NaN is fine there); every other one must be finite and
        >= 0. ``mask``: the batch's ``(B, T)`` mask (None for raw indices).
        Returns None for an array that is not per step (checked as ``(B,)``)."""
        return reduce_errors(errors, mask, b, self.burn_in, self.length, self.eta)

    # -- state -------------------------------------------------------------------
    def state(self) -> dict:
        return {"seq_pos": self.pos, "seq_status": self.status, "seq_pending": self.pending,
                "seq_next": self.next_pos, "seq_ptr": self.ptr}

    def restore(self, arrays: dict) -> None:
        self.pos[:] = arrays["seq_pos"]
        self.status[:] = arrays["seq_status"]
        self.pending[:] = arrays["seq_pending"]
        self.next_pos[:] = arrays["seq_next"]
        self.ptr[:] = arrays["seq_ptr"]


def reduce_errors(errors, mask, b: int, burn_in: int, length: int, eta: float):
    """``update_priorities``' per-step reduction (see ``Items.reduce``):
    ``(B,)`` float64 priorities, or None when ``errors`` is not a per-step
    array (the usual ``(B,)`` checks then apply to it as it is)."""
    e = as_array(errors, "priorities")
    T = burn_in + length
    # (B, 1) is one value an item (with length 1 its one step after the burn-in is the start: the same).
    if e.ndim != 2 or (e.shape[1] not in (T, length)) or e.shape[1] == 1:
        if e.ndim == 2 and e.shape[1] != 1:
            raise InvalidArgumentError(
                f"priorities must have shape ({b},), ({b}, {T}) (every step) or ({b}, {length}) (the "
                f"steps after the burn-in), got {e.shape}")
        return None
    if e.dtype.kind not in "fiub":
        raise InvalidTypeError(f"priorities must be numbers, got dtype {e.dtype}")
    if e.shape[0] != b:
        raise InvalidArgumentError(f"priorities must have shape ({b}, {e.shape[1]}) to match the indices, "
                                   f"got {e.shape}")
    if mask is None:
        raise InvalidArgumentError(
            "per-step priorities need the batch's mask: pass the Batch (or the dict to_torch gives) as "
            "the target, not raw indices")
    m = as_array(mask, "the target's mask")
    if m.dtype != np.bool_ or m.shape != (b, T):
        raise InvalidArgumentError(f"the target's mask must be bool of shape ({b}, {T}), got {m.dtype} {m.shape}")
    shift = burn_in if e.shape[1] == T else 0  # column of the first step after the burn-in
    e = e[:, shift:].astype(np.float64)
    m = m[:, burn_in:]
    with np.errstate(invalid="ignore"):
        bad = np.argwhere(m & ~((e >= 0) & (e < np.inf)))
    if bad.size:
        r, t = int(bad[0][0]), int(bad[0][1])
        raise InvalidArgumentError(
            f"priorities[{r}, {t + shift}] = {e[r, t]!r} is the error of a real step after the burn-in: "
            "it must be finite and >= 0 (padded and burn-in steps may hold anything, NaN included)")
    n = m.sum(axis=1)
    if (n == 0).any():  # a sampled mask always has its start step; a hand-made one may not
        r = int(np.flatnonzero(n == 0)[0])
        raise InvalidArgumentError(f"the target's mask row {r} has no real step after the burn-in")
    # eta * max + (1 - eta) * mean as max - (1 - eta) * (max - mean), the mean
    # taken of x / max (terms <= 1) and capped at max: finite errors give a
    # finite priority <= max (a plain sum overflowed for errors near float max).
    x = np.where(m, e, 0.0)
    top = x.max(axis=1)
    scale = np.where(top > 0, top, 1.0)
    mean = np.minimum(scale * ((x / scale[:, None]).sum(axis=1) / n), top)
    return top - (1.0 - eta) * (top - mean)


def check_items(cfg, arrays: dict, count: int, gid, status, ends, top: float) -> np.ndarray:
    """Refuse a recorded state whose sequence item tables (``Items.state``) a
    buffer could not have written: positions that
    chain along each env's stream, item status exactly as the positions and
    the ring imply, pending keys finite in [0, max_leaf] (every key written
    counts toward max_leaf), pointers in range. Returns the item status."""
    c, envs, seq = cfg.capacity, cfg.num_envs, cfg.seq
    if gid is None:  # (not recorded: it follows from count)
        gid = expected_gid(count, c)
    pos = array(arrays, "seq_pos", np.int64, (c,))
    istatus = array(arrays, "seq_status", np.uint8, (c,))
    pending = array(arrays, "seq_pending", np.float64, (c,))
    nxt = array(arrays, "seq_next", np.int64, (envs,))
    ptr = array(arrays, "seq_ptr", np.int64, (envs,))
    bad = np.flatnonzero((pos < -1) | (pos >= BIG) | ((gid < 0) & (pos != -1)))
    if bad.size:
        refuse(f"seq_pos[{bad[0]}] = {pos[bad[0]]} (a position in an episode, -1 for none)")
    # A step whose previous step of its env is still in the ring continues its position,
    # or starts at 0 after an episode end or a placeholder row; a placeholder row has -1.
    written = gid >= 0
    prev_g = gid - envs
    inside = written & (prev_g >= max(count - c, 0))
    prev = np.where(inside, prev_g % c, 0)
    want_pos = np.where(inside & (pos[prev] >= 0) & (ends[prev] == 0), pos[prev] + 1, 0)
    bad = np.flatnonzero(inside & (pos >= 0) & (pos != want_pos))
    if bad.size:
        s = int(bad[0])
        refuse(f"seq_pos[{s}] = {pos[s]}, but the step before it in its env's stream gives {want_pos[s]}")
    bad = np.flatnonzero(written & (pos < 0) & (status != DEAD))
    if bad.size:
        refuse(f"seq_pos[{bad[0]}] = -1 for a step that is not a placeholder (status {status[bad[0]]})")
    truth = np.empty(c, dtype=np.uint8)
    item_truth(count, c, envs, seq.burn_in, seq.length, seq.period, pos, gid, status, ends, truth)
    bad = np.flatnonzero(istatus != truth)
    if bad.size:
        s = int(bad[0])
        refuse(f"seq_status[{s}] = {istatus[s]}, but the ring and positions give {truth[s]} "
             "(0 no item, 1 live, 2 pending, 3 dead)")
    bad = np.flatnonzero(~((pending >= 0) & (pending <= top)))
    if bad.size:
        refuse(f"seq_pending[{bad[0]}] = {pending[bad[0]]!r} (a pending key is finite, >= 0 and <= "
             f"max_leaf {top!r})")
    e = np.arange(envs, dtype=np.int64)
    bad = np.flatnonzero((ptr < 0) | (ptr % envs != e) | (ptr >= count + envs))
    if bad.size:
        refuse(f"seq_ptr[{bad[0]}] = {ptr[bad[0]]} (env {bad[0]}'s item pointer after {count} steps)")
    # The pointer never passes an item that may still live (it would then never be removed).
    alive = np.flatnonzero((truth == LIVE) | (truth == PENDING))
    for k in range(envs):
        g = gid[alive][gid[alive] % envs == k]
        if g.size and ptr[k] > g.min():
            refuse(f"seq_ptr[{k}] = {ptr[k]} is past env {k}'s item at step {g.min()}, which still lives")
    last = count - envs + e  # each env's last row
    for k in range(envs):
        g = int(last[k])
        s = g % c
        want = 0 if g < 0 or pos[s] < 0 or ends[s] != 0 else int(pos[s]) + 1
        if nxt[k] != want:
            refuse(f"seq_next[{k}] = {nxt[k]}, but env {k}'s last step gives {want}")
    return istatus
