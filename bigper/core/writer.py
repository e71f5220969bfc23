"""The write path: checked rows (``ingest``) become transitions in the ring.

A failed write changes nothing (promise 16). What can fail without a trace
runs first: the ``valid`` rule, the priority keys, and the storage's
copy-on-write ``prepare`` over every row the write touches. Past that, what
the writer changes is either computed on copies and committed after the
write's last call that can fail (``env_ended``, the ring's slots and
counters, the leaves: bookkeeping in memory) or recorded in a journal
(``_undo.Journal``) before it changes and put back when any later call raises:
the rows a storage write overwrites, the frame streams, the compressed log's
counters, slots and growth (a write of more rows than slots is checkpointed
whole). ``tests/core/test_hostile_failed_writes.py`` injects a failure at
every call a write makes. Then, for the common case
(proportional prioritization, a storage with writable arrays,
a write small against the capacity), the small fields are stored with one
numpy assignment each and everything else is **one compiled call**,
``write_rows``: ring slots and end bits, frame dedup with references and new
frames written into the ring, generations and status, the leaves with their
tree ancestors (or, with n-step, the pending keys and the windows this write
completes), and the expiry of transitions whose frames were overwritten.
Any other write takes the general path (a few kernel and numpy calls a
chunk); ``tests/core/test_fused.py`` holds the two equal, bit for bit. The
fused path writes in place only after its last call (the frame store's
arguments), so it needs no journal and costs what it did.

The ring (``core/ring.py``) owns the bookkeeping arrays and counters; the
writer changes them in place. What a write makes sampleable is the sample
unit's to say (``unit.commit``, ``unit.committed``: ``core/units.py``).
"""

from __future__ import annotations

import numpy as np

from ..common.undo import Journal
from ..errors import InvalidArgumentError
from ..frames.store import ALL_VALID, LoggedArgs, RingArgs, expire, write_direct, write_logged
from ..common.kernels import kernel, ring_rows
from ..prioritization._tree_kernels import tree_set
from .ring import commit_rows
from ..common.status import DEAD, LIVE, PENDING
from .nstep import TRUNCATED, complete

_NO_VALID = np.zeros(0, dtype=np.bool_)  # commit_rows: every row valid
_NO_KEYS = np.zeros(0, dtype=np.float64)  # write_rows: every row at max_leaf

# For a buffer without frame stacks (never read): write_rows' ``stacks`` and
# ``frames`` groups (FrameStore.kernel_args gives both otherwise, in this order).
_NO_STACKS = (np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1, 1), np.uint8))
_NO_RING = tuple(RingArgs(False, np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1), np.int64), np.zeros(1, np.bool_),
                          False, np.zeros(1, np.int64), np.zeros((1, 1), np.uint8), np.zeros((1, 1), np.uint8),
                          np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), 0))


@kernel
def write_rows(g0, rows, keys, max_leaf, fw, stacks, book, tree, sizes, frames):
    """Record ``m`` rows numbered from ``g0`` (distinct slots, ``m <= capacity``):
    the bookkeeping of a whole write in one call. Grouped arguments:

    - ``rows``: ``(terminated, truncated, valid)`` of the rows; ``stacks``: their
      ``(obs, next_obs)`` frame stacks (C-contiguous ``(m, k, *frame)``).
    - ``book``: the ring's bookkeeping (``ring.Book``: gid, ends, status, pending, env_ended).
    - ``tree``: the tree's ``TreeArrays``; ``sizes``: ``(n_step, num_envs)``.
    - ``frames``: the frame ring's (``frames.store.RingArgs``, from
      ``FrameStore.kernel_args``).

    Rows with ``valid`` False are recorded dead (leaf 0). Keys are ``keys``
    (or ``max_leaf`` for every row when ``keys`` is empty). With ``n_step`` 1
    they become the rows' leaves; else they wait in ``pending`` (leaf 0) and
    every transition whose window this write completes (``nstep.complete``)
    becomes sampleable with its pending key. With ``framed``, frames and
    references go straight into the ring (``frames.write_direct``) and
    transitions whose oldest frame the ring has overwritten are expired
    (leaf 0). ``env_ended[e]`` becomes whether env ``e``'s last row ended its
    episode (or was not valid). Returns ``(frames written, largest key of a
    valid row)``. ``book``, ``tree``, ``sizes`` and ``frames`` are the same
    every call.
    """
    return _write_rows(g0, rows, keys, max_leaf, fw, stacks, book, tree, sizes, frames, _where(g0, rows, book), 0)


@kernel
def write_rows_logged(g0, rows, keys, max_leaf, fw, stacks, book, tree, sizes, frames, logged):
    """``write_rows`` of a buffer whose frames go to a compressed log
    (``logged``: its ``frames.store.LoggedArgs``, from ``FrameStore.logged_args``;
    ``frames`` holds its staging ring): the new frames go, compressed, to the
    log's open segment first (``frames.store.write_logged``), and when they do
    not all fit (or zstd fails) nothing is written and ``(-1, 0.0)`` (``(-2,
    0.0)``) is returned. (A kernel of its own: one that calls libzstd compiles
    only where compression is used, its library loaded.)"""
    lg = LoggedArgs(*logged)
    where = _where(g0, rows, book)
    fw = write_logged(g0, rows, stacks, frames, where, sizes[1], lg.work, lg.log, fw)
    if fw < 0:
        return fw, 0.0
    # (expired as the ring's: only a log without a budget takes this call, and it releases a
    # segment only once all its frames are older than the newest F: its first frame is never past fw - F)
    return _write_rows(g0, rows, keys, max_leaf, fw, stacks, book, tree, sizes, frames, where, lg.F)


@kernel
def _where(g0, rows, book):
    """The rows' ``(slots, end flags)`` (``ring_rows``), computed once a write."""
    m = rows[0].shape[0]
    slots = np.empty(m, dtype=np.int64)
    ends = np.empty(m, dtype=np.uint8)
    ring_rows(g0, book[0].shape[0], rows[0], rows[1], slots, ends)
    return slots, ends


@kernel
def _write_rows(g0, rows, keys, max_leaf, fw, stacks, book, tree, sizes, frames, where, log_frames):
    """``write_rows``, at ``where`` (``_where``); ``log_frames`` > 0: the frames went to a compressed log
    keeping that many (``write_rows_logged``)."""
    term, trunc, valid = rows
    obs, nxt = stacks
    gid, ends_arr, status, pending, env_ended = book
    sums, mins, offsets = tree
    n_step, num_envs = sizes
    fr = RingArgs(*frames)
    framed, last_frames, last_ref, has_last, has_next = fr.framed, fr.last_frames, fr.last_ref, fr.has_last, fr.has_next
    fref, foff, ring, minref, ptr, expired, reach = fr.fref, fr.foff, fr.ring, fr.minref, fr.ptr, fr.expired, fr.reach
    m = term.shape[0]
    capacity = gid.shape[0]
    F = log_frames if log_frames > 0 else ring.shape[0]
    slots, ends = where
    if framed and log_frames == 0:  # the stacks as (m, k, words) of the ring's word type
        k = last_frames.shape[1]
        ow = obs.reshape((m, k, -1)).view(ring.dtype)
        nw = nxt.reshape((m, k, -1)).view(ring.dtype)
        env = np.empty(m, dtype=np.int64)
        for r in range(m):
            env[r] = (g0 + r) % num_envs
        fw = write_direct((ow, nw, env, ends, valid), (last_frames, last_ref, has_last), fw, has_next,
                          fref, foff, ring, slots, minref, reach)
    commit_rows(g0, slots, ends, valid, LIVE if n_step == 1 else PENDING, gid, ends_arr, status)
    for r in range(m):
        env_ended[(g0 + r) % num_envs] = ends[r] != 0 or not valid[r]
    leaves = np.zeros(m, dtype=np.float64)
    given = keys.shape[0] > 0
    top = 0.0
    for r in range(m):
        key = keys[r] if given else max_leaf
        if given and valid[r] and key > top:
            top = key
        if n_step > 1:
            pending[slots[r]] = key  # the leaf stays 0 until the window completes
        elif valid[r]:
            leaves[r] = key
    tree_set(sums, mins, offsets, slots, leaves)
    if n_step > 1:
        first = max(0, g0 - (n_step - 1) * num_envs)
        ready = np.empty(g0 + m - first, dtype=np.int64)
        nr = complete(first, g0 + m, capacity, num_envs, n_step, ends_arr, gid, status, ready)
        if nr > 0:
            vals = np.empty(nr, dtype=np.float64)
            for i in range(nr):
                status[ready[i]] = LIVE
                vals[i] = pending[ready[i]]
            tree_set(sums, mins, offsets, ready[:nr], vals)
    oldest = fw - F
    if framed and oldest > 0:
        n = expire(ptr, g0 + m, capacity, num_envs, oldest, minref, gid, status, expired)
        if n > 0:
            tree_set(sums, mins, offsets, expired[:n], np.zeros(n, dtype=np.float64))
    return fw, top


class Writer:
    """Writes rows into one buffer's ring.

    Parameters
    ----------
    cfg : Config
    store : storage
    frames : FrameStore or None
    plain : dict
        The fields stored row by row (name -> (shape, dtype)).
    prio : Prioritization
    ring : Ring
        The buffer's slot bookkeeping and counters (changed in place).
    unit : units.SampleUnit
        What a leaf stands for: it sets the leaves a write makes sampleable.
    """

    def __init__(self, cfg, store, frames, plain: dict, prio, ring, unit):
        self.cfg, self.store, self.frames, self.plain, self.prio, self.ring = cfg, store, frames, plain, prio, ring
        self.unit = unit
        self.gid, self.status, self.ends, self.pending = ring.gid, ring.status, ring.ends, ring.pending
        self.env_ended = ring.env_ended  # (its values change, never the array)
        # False: the general path (staged storage writes, one numpy call a step).
        self.fused = True
        self._tree = prio.tree  # (None: the strategy's own methods, rank's heap)
        self._args = self._args_of = None  # write_rows' fixed arguments, and the ring arrays they hold

    def write(self, rows: dict, priorities, valid=None) -> None:
        """Write checked ``rows`` (``name -> (m, ...)``) with their priorities
        (``(m,)`` float64 or None: the largest key so far) and ``valid``."""
        cfg = self.cfg
        m = rows["terminated"].shape[0]
        if valid is not None:
            # A placeholder row may only follow an episode end of its env.
            ended = (rows["terminated"] | rows["truncated"]) | ~valid
            before = np.concatenate([self.env_ended, ended])[:m]
            bad = np.flatnonzero(~valid & ~before)
            if bad.size:
                r = int(bad[0])
                raise InvalidArgumentError(
                    f"valid is False for env {(self.ring.count + r) % cfg.num_envs} at row {r}, "
                    "but that env's previous step did not end an episode; valid=False is for the "
                    "reset step of next-step autoreset")
        keys = None if priorities is None else self.prio.keys(priorities)
        self.ring.writes += 1  # (before any byte changes: a feed's gather without the lock checks it)
        c = cfg.capacity
        if self.store.shared_chunks:
            # Copy-on-write storages make every row this write touches writable
            # first: running out of space then fails before anything changed.
            first = self.ring.count % c
            where = slice(0, c) if m >= c else (
                first if m == 1 else (slice(first, first + m) if first + m <= c else
                                      (np.arange(first, first + m) % c)))
            writes = {name: where for name in self.plain}
            if self.frames is not None:
                writes.update(self.frames.rows_touched(m, where))
            self.store.prepare(writes)
        if 0 < m <= c and self.fused and self._tree is not None and (m <= 1024 or m * 8 < c):
            rw = self.store.writable_arrays
            if rw:
                g0, top = self.ring.count, self.ring.max_leaf
                try:
                    done = self._write_one_call(rows, keys, valid, rw)
                except BaseException:
                    self.ring.failed += 1
                    raise
                if done:
                    self.unit.committed(self.prio, rows, g0, keys, top, valid, self.ring.count)
                    return
        ended = rows["terminated"] | rows["truncated"]
        if valid is not None:
            ended |= ~valid
        k = cfg.num_envs
        # Computed on a copy, committed after the last call that can fail.
        env_ended = ended[-k:] if m >= k else np.concatenate([self.env_ended, ended])[-k:]
        journal = Journal()
        try:
            if m > c:
                # More rows than slots: write in chunks of at most `capacity`, so that slots
                # within one write are distinct and every frame stream stays whole. A chunk
                # that fails puts back what the ones before it committed: copied whole first
                # (this write is that large anyway).
                journal.add(self._checkpoint())
                for lo in range(0, m, c):
                    hi = min(lo + c, m)
                    self._write_chunk({n: v[lo:hi] for n, v in rows.items()},
                                      None if keys is None else keys[lo:hi],
                                      None if valid is None else valid[lo:hi], journal, final=False)
            elif m:
                self._write_chunk(rows, keys, valid, journal)
        except BaseException:
            self.ring.failed += 1  # (its rows were in the storage a while: a feed's gather may have read them)
            journal.roll_back()
            raise
        self.env_ended[:] = env_ended
        if self.frames is not None:
            self.frames.settle()  # (best effort: after every call that can fail)

    def _checkpoint(self):
        """What a write of many chunks changes in memory (the ring, the leaves,
        the unit's tables, the frame store and its log) and the storage's
        in-place arrays, copied; returns the step that puts them back."""
        ring_meta, ring_arrays = self.ring.state()
        ring_meta = {**ring_meta, "env_ended": list(ring_meta["env_ended"])}
        ring_arrays = {n: a.copy() for n, a in ring_arrays.items()}
        pmeta, parrays = self.prio.state()
        pmeta, parrays = dict(pmeta), {n: np.array(a, copy=True) for n, a in parrays.items()}
        unit = {n: np.array(a, copy=True) for n, a in self.unit.state().items()}
        frames = self.frames.checkpoint() if self.frames is not None else None
        rw = self.store.writable_arrays
        data = {n: a.copy() for n, a in rw.items()} if rw else {}

        def back():
            self.ring.restore(ring_meta, ring_arrays)
            self.unit.restore(unit)
            self.prio.restore(pmeta, parrays, self.unit.status)
            if frames is not None:
                frames()
            for n, a in data.items():  # (the journal gave a grown log back first: same rows)
                # Only the bytes that changed: they lie in chunks this write made private; a
                # chunk a snapshot still shares is mapped read-only and must not be written.
                now, was = rw[n].reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8)
                changed = now != was
                if changed.any():
                    np.copyto(now, was, where=changed)
        return back

    def end_episodes(self) -> np.ndarray:
        """End every env's open episode at its last row, as truncated (a resume
        whose environment did not survive: the next row of that env starts a new
        episode, so no n-step window, frame stack or sequence item may join the
        two). Its windows complete with what they have and bootstrap there.
        Returns the envs whose episode was ended."""
        ring, k, c = self.ring, self.cfg.num_envs, self.cfg.capacity
        count = ring.count
        envs = np.flatnonzero(~ring.env_ended)
        last = count - 1 - ((count - 1 - envs) % k)  # each env's last row (rows go round the envs)
        held = (last >= 0) & (last >= count - c)
        envs, last = envs[held], last[held]
        if not envs.size:
            return envs
        slots = last % c
        ring.ends[slots] |= TRUNCATED
        ring.env_ended[envs] = True
        if self.frames is not None:
            self.frames.has_last[envs] = False  # the next row's frames start a new stream
        self.unit.episodes_ended(self.prio, last, count)
        return envs

    def _write_one_call(self, rows: dict, keys, valid, rw: dict) -> bool:
        """The fused write; False (nothing written) where compressed frames
        cannot be written in one call (``FrameStore.logged_args``)."""
        m = rows["terminated"].shape[0]
        g0 = self.ring.count
        c = self.cfg.capacity
        s0 = g0 % c
        where = s0 if m == 1 else (slice(s0, s0 + m) if s0 + m <= c else np.arange(g0, g0 + m) % c)
        frames = self.frames
        logged = None
        if frames is None:
            stacks, ring, fw = _NO_STACKS, _NO_RING, 0
        elif frames.in_place:  # (first: nothing is written until every call that can fail went through)
            stacks, ring = frames.kernel_args(rows, rw)
            fw = frames.fw
        else:  # compressed frames: in the same call, where they may fit in the open segment
            args = frames.logged_args(rows, rw)
            if args is None:
                return False
            (stacks, ring, logged), fw = args, frames.fw
        if logged is None:
            self._write_plain(rows, where, rw)
        ok = (ALL_VALID[:m] if m <= ALL_VALID.shape[0] else np.ones(m, dtype=np.bool_)) \
            if valid is None else valid
        if ring is not self._args_of:  # the ring's arrays (new after a memmap chunk's copy-on-write)
            t, cfg = self._tree, self.cfg
            self._args = (tuple(self.ring.book),  # (plain tuples: common/kernels.py says why)
                          tuple(t.arrays), (cfg.n_step, cfg.num_envs), ring)
            self._args_of = ring
        flags, keys = (rows["terminated"], rows["truncated"], ok), _NO_KEYS if keys is None else keys
        if logged is None:
            fw, top = write_rows(g0, flags, keys, self.ring.max_leaf, fw, stacks, *self._args)
        else:  # the fields once the frames went in (-1: they did not fit, nothing was written)
            fw, top = write_rows_logged(g0, flags, keys, self.ring.max_leaf, fw, stacks, *self._args, logged)
            if fw < 0:
                if fw == -2:
                    raise RuntimeError(f"zstd failed to compress a frame of {frames.row_bytes} bytes")
                return False
            self._write_plain(rows, where, rw)
        self.ring.count = g0 + m
        if top > self.ring.max_leaf:
            self.ring.max_leaf = top
        if frames is not None:
            frames.fw = fw
        return True

    def _write_plain(self, rows: dict, where, rw: dict) -> None:
        m = rows["terminated"].shape[0]
        for name in self.plain:
            rw[name][where] = rows[name][0] if m == 1 else rows[name]

    def _write_chunk(self, rows: dict, keys, valid, journal: Journal, final: bool = True) -> None:
        """Rows (at most ``capacity``): first every call that can fail (the
        storage's writes, the frame store's, recorded in ``journal``), then
        the bookkeeping in memory. ``final``: no chunk of the write follows."""
        cfg = self.cfg
        c = cfg.capacity
        m = rows["terminated"].shape[0]
        g0 = self.ring.count
        if self.fused:
            slots, ends = np.empty(m, np.int64), np.empty(m, np.uint8)
            ring_rows(g0, c, rows["terminated"], rows["truncated"], slots, ends)
        else:  # the general path, for the tests that hold the fused one to it
            slots = np.arange(g0, g0 + m, dtype=np.int64) % c
            ends = rows["terminated"].astype(np.uint8) | (rows["truncated"].astype(np.uint8) << 1)
        s0 = int(slots[0])
        where = s0 if m == 1 else (slice(s0, s0 + m) if s0 + m <= c else slots)
        rw = self.store.writable_arrays if self.fused else None
        frames = self.frames
        fw0 = 0 if frames is None else frames.fw
        if frames is not None:  # first: a compressed log that must grow and cannot fails before any write
            frames.write(rows, g0, slots, where, ends, valid, rw, journal)
        # The compressed log's dictionary look reads the storage after these: in-place rows kept too.
        keep = frames is not None and not frames.in_place
        # The write's last call that can fail needs no record: when it fails, nothing of it was
        # done (a storage's write of one field's rows), and nothing follows it.
        last = None if keep or not final or not self.plain else list(self.plain)[-1]
        for name in self.plain:
            if rw is None:
                if name == last:
                    self.store.write(name, where, rows[name][0] if m == 1 else rows[name])
                else:
                    journal.write(self.store, name, where, rows[name][0] if m == 1 else rows[name], c)
            else:
                if keep:
                    journal.keep(rw[name], where)
                rw[name][where] = rows[name][0] if m == 1 else rows[name]
        if frames is not None:
            frames.look(fw0)  # the last call that can fail; what follows is bookkeeping in memory
        if keys is None:
            keys = np.array((self.ring.max_leaf,)) if m == 1 else np.full(m, self.ring.max_leaf)
        else:
            # Only values that become keys count toward the largest one.
            counted = keys if valid is None else keys[valid]
            if counted.shape[0]:
                self.ring.max_leaf = max(self.ring.max_leaf, float(counted.max()))
        state = LIVE if cfg.n_step == 1 else PENDING
        if self.fused:
            commit_rows(g0, slots, ends, _NO_VALID if valid is None else valid, state,
                        self.gid, self.ends, self.status)
        else:
            self.gid[slots] = np.arange(g0, g0 + m, dtype=np.int64)
            self.ends[slots] = ends
            self.status[slots] = state if valid is None else np.where(valid, state, DEAD).astype(np.uint8)
        self.ring.count = g0 + m
        self.unit.commit(self.prio, g0, slots, ends, valid, keys, self.ring.count, self.frames)
