"""Frame stacks stored once: a ring of frames and per-transition references.

With ``frame_stack=k`` the ``"obs"`` field is a stack of ``k`` frames on axis
0. Each transition references the global ids of the frames of its ``obs``
stack and of its ``next_obs`` stack; frame ``f`` lives in row ``f % F`` of
the frame ring (``F`` frames, a little more than the capacity). A frame is
written only when it is new::

    step t    obs      [a b c d]   -> refs of the previous step's next_obs
              next_obs [b c d e]   -> refs [b c d] shared, e written: 1 frame a step

The references of a transition are stored as one frame id and small offsets
(``frames/refs.py``: ``frame_ref``, ``frame_off``); a frame is reused only
within the offsets' reach, else written again.

What is compared is always the bytes, so any input comes back exactly: a
stack that does not continue the previous step's next_obs (a reset without an
end flag, other padding) has its frames written, each distinct frame once.

A transition is valid while all its frames are in the ring. Along one env's
stream the oldest frame a transition references never decreases, so one
pointer per env finds the transitions whose frames were just overwritten;
they are marked dead (leaf 0) and never sampled again.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import zstd as _zstd
from .budget import frame_capacity  # (config.py sizes the compressed log by it too)
from ..common.kernels import kernel
from ..common.pool import for_ranges, workers
from ..common.reuse import ReusedArrays
from .refs import check_offsets, derive_minref, offset_dtype, offset_reach, pack_refs, refs_outside, unpack_refs
from .segments import SegmentLog, append_staged
from ..common.undo import Journal
from ..errors import CorruptSnapshotError, IncompatibleSnapshotError
from ..common.status import DEAD, LIVE, PENDING


def require_compression() -> None:
    """Load libzstd now: ``CompressionUnavailableError`` naming the extra when it is missing."""
    _zstd.lib()


ALL_VALID = np.ones(256, dtype=np.bool_)
REF_NAMES = ("obs_ref", "next_obs_ref")  # the stacks whose ids ``refs`` gives (names, not arrays)


_STAGING_BYTES = 64 << 20  # write's staging of new frames kept between writes, at most
_ENV0 = np.zeros(256, dtype=np.int64)  # env of every row with one env (read only by kernels)


class LoggedArgs(NamedTuple):
    """A compressed log's write as ``core/writer.write_rows_logged`` takes it
    (``FrameStore.logged_args``); a plain tuple at the call, named in the kernel."""

    F: int  # frames the log keeps
    work: tuple  # write_logged's (staging ring, scratch)
    log: tuple  # the open segment (segments.StagedLog's values)


class RingArgs(NamedTuple):
    """The frame ring as ``core/writer.write_rows`` takes it (``FrameStore.kernel_args``;
    ``framed`` False: a buffer without one, the others never read); a plain
    tuple at the call, named in the kernel (``common/kernels.py`` says why)."""

    framed: bool
    last_frames: np.ndarray  # (num_envs, k, words): each env's last stack
    last_ref: np.ndarray  # (num_envs, k): its frames' ids
    has_last: np.ndarray  # (num_envs,): whether it has one
    has_next: bool  # whether rows carry next_obs
    fref: np.ndarray  # (capacity,): each slot's frame id
    foff: np.ndarray  # (capacity, 2k): its stacks' offsets back from it
    ring: np.ndarray  # (F, words): the frames
    minref: np.ndarray  # (capacity,): each slot's oldest frame
    ptr: np.ndarray  # the frames written (one element)
    expired: np.ndarray  # scratch: the slots a write expires
    reach: int  # the farthest offset ``foff`` holds


@kernel
def _same(a, b):
    """Two frames (as words of equal count) hold the same bytes. Blocks of a
    fixed 128 words, so the inner loop vectorizes (a block length known only
    at run time kept it scalar: 4x slower); stops after the first differing block."""
    if a.ctypes.data == b.ctypes.data:  # one frame seen twice (stacks that are views of one window)
        return True
    n = a.shape[0]
    i = 0
    while i + 128 <= n:
        acc = a[i] ^ b[i]
        for j in range(1, 128):
            acc |= a[i + j] ^ b[i + j]
        if acc != 0:
            return False
        i += 128
    if i == n:
        return True
    acc = a[i] ^ b[i]
    for j in range(i + 1, n):
        acc |= a[j] ^ b[j]
    return acc == 0


@kernel
def _copy(dst, src):
    """``dst[:] = src`` for 1-D rows: a plain loop vectorizes, numba's slice
    assignment does not (2x slower for a frame)."""
    for w in range(src.shape[0]):
        dst[w] = src[w]


@kernel
def _new_frame(src, dst, n_new, fw, ring):
    # ring > 0: dst is the frame ring itself (ring rows), frame fw goes to row fw % ring;
    # else dst collects the new frames in order.
    _copy(dst[fw % ring if ring > 0 else n_new], src)
    return fw + 1, n_new + 1


@kernel
def assign_refs(rows, stream, fw, has_next, refs, new_frames, slots, minref, reach, ring=0, copy_last=True):
    """Frame references for ``m`` transitions, in order.

    ``rows``: ``(obs, nxt, env, ends, valid)``: (m, k, P) uint8 bytes of the
    stacks, the env of each row, its end flags and whether it is valid.
    ``stream``: ``(last_frames, last_ref, has_last)``: per env, the bytes and
    refs of the stack the next step should continue (the previous next_obs,
    or the previous obs shifted by one when next_obs is not stored) and
    whether the stream goes on (no episode end since). ``refs``: ``(obs_ref,
    next_ref)``, (m, k) outputs. A frame reuses a reference when its bytes
    equal the frame it continues or the frame before it in the same stack;
    otherwise it is copied into ``new_frames`` and numbered from ``fw``.
    Rows with ``valid`` False (reset steps of next-step autoreset) store
    nothing and get the reference -1. ``minref[slots[r]]`` gets row r's
    oldest reference (-1 for a row without frames: what ``derive_minref``
    gives from the stored references). A frame the stream continues is
    reused only when it lies at most ``reach`` ids before the row's first
    new frame (``offset_reach``); else it is written again. Returns the new
    frame count. With ``ring`` > 0,
    ``new_frames`` is the frame ring (``ring`` rows) and each new frame is
    written straight to its row: frames are compared with the input and with
    ``last_frames``, never read back from the ring, so the result is the same.
    ``copy_last`` False: ``last_frames`` is left as it was, and the caller
    copies each env's continued stack into it (``continue_streams``) once the
    write went through (nothing to save for an undo).
    """
    obs, nxt, env, ends, valid = rows
    last_frames, last_ref, has_last = stream
    obs_ref, next_ref = refs
    m, k = obs.shape[0], obs.shape[1]
    n_new = 0
    shift = 0 if has_next else 1
    cont = nxt if has_next else obs  # the stack the env's next row continues
    # prev[e]: env e's last valid row of this call, whose stack its next row continues
    # (compared in the input; last_frames gets a copy of it once, at the end)
    prev = np.full(last_frames.shape[0], -1, dtype=np.int64)
    for r in range(m):
        e = env[r]
        if not valid[r]:
            for j in range(k):
                obs_ref[r, j] = -1
                next_ref[r, j] = -1
            minref[slots[r]] = -1
            continue
        p = prev[e]
        f0 = fw  # the row's first new frame id: a reused one lies at most `reach` before it
        for j in range(k):
            src = j + shift
            if has_last[e] and src < k and f0 - last_ref[e, src] <= reach and \
                    (_same(obs[r, j], cont[p, src]) if p >= 0 else _same(obs[r, j], last_frames[e, src])):
                obs_ref[r, j] = last_ref[e, src]
            elif j > 0 and _same(obs[r, j], obs[r, j - 1]):
                obs_ref[r, j] = obs_ref[r, j - 1]
            else:
                obs_ref[r, j] = fw
                fw, n_new = _new_frame(obs[r, j], new_frames, n_new, fw, ring)
        if has_next:
            for j in range(k):
                if j < k - 1 and _same(nxt[r, j], obs[r, j + 1]):
                    next_ref[r, j] = obs_ref[r, j + 1]
                elif j > 0 and _same(nxt[r, j], nxt[r, j - 1]):
                    next_ref[r, j] = next_ref[r, j - 1]
                else:
                    next_ref[r, j] = fw
                    fw, n_new = _new_frame(nxt[r, j], new_frames, n_new, fw, ring)
            for j in range(k):
                last_ref[e, j] = next_ref[r, j]
        else:
            for j in range(k):
                last_ref[e, j] = obs_ref[r, j]
        prev[e] = r
        has_last[e] = ends[r] == 0
        lo = obs_ref[r, 0]
        for j in range(k):
            lo = min(lo, obs_ref[r, j])
            if has_next:
                lo = min(lo, next_ref[r, j])
        minref[slots[r]] = lo
    if copy_last:
        for e in range(prev.shape[0]):
            if prev[e] >= 0:
                for j in range(k):
                    _copy(last_frames[e, j], cont[prev[e], j])
    return fw


@kernel
def continue_streams(last_frames, cont, env, valid):
    """``assign_refs``' last step, for ``copy_last`` False: each env's
    stream continues its last valid row's stack ``cont[r]``."""
    done = np.zeros(last_frames.shape[0], dtype=np.bool_)
    for r in range(env.shape[0] - 1, -1, -1):
        e = env[r]
        if valid[r] and not done[e]:
            done[e] = True
            for j in range(last_frames.shape[1]):
                _copy(last_frames[e, j], cont[r, j])


@kernel
def write_direct(rows, stream, fw, has_next, fref, foff, ring, slots, minref, reach, copy_last=True):
    """``assign_refs`` writing new frames into the ring (``ring.shape[0]``
    rows) and the references of row ``r`` into ``fref[slots[r]]`` /
    ``foff[slots[r]]`` (``pack_refs``); returns the new frame count."""
    m, k = rows[0].shape[0], rows[0].shape[1]
    obs_ref = np.empty((m, k), dtype=np.int64)
    next_ref = np.empty((m, k), dtype=np.int64)
    fw = assign_refs(rows, stream, fw, has_next, (obs_ref, next_ref), ring, slots, minref, reach, ring.shape[0],
                     copy_last)
    pack_refs(obs_ref, next_ref, has_next, slots, fref, foff)
    return fw


@kernel
def write_logged(g0, flags, stacks, ra, where, num_envs, work, log, fw):
    """``write_direct`` for a compressed log, all or nothing, for rows
    ``g0 ..`` (``flags``: their ``(terminated, truncated, valid)``; ``stacks``:
    ``(obs, next_obs)``, C-contiguous ``(m, k, *frame)``; ``ra``: the
    streams and references (``RingArgs``; its ``ring`` unused); ``where``:
    the rows' ``(slots, end flags)`` (``ring_rows``); ``fw``: the frames written): the new frames go to a
    staging ring and from there, compressed, to the open segment
    (``segments.append_staged``, ``log`` its ``StagedLog``). ``work``: ``(staged, scratch)``, the
    staging ring (``2 * m * k`` rows at least) and room for their compressed
    frames (reused: no page faults). When they do not all fit there (or zstd
    fails), what it changed (the streams' references, the slots' oldest references and
    references; the streams' frames change only after the append) is put back and
    ``-1`` (``-2``) is returned; else the new frame count."""
    term, trunc, valid = flags
    obs, nxt = stacks
    ra = RingArgs(*ra)
    last_frames, last_ref, has_last = ra.last_frames, ra.last_ref, ra.has_last
    fref, foff, minref = ra.fref, ra.foff, ra.minref
    slots, ends = where
    m, k = term.shape[0], last_frames.shape[1]
    env = np.empty(m, dtype=np.int64)
    for r in range(m):
        env[r] = (g0 + r) % num_envs
    staged, scratch = work
    s_ref = np.empty((m, k), dtype=np.int64)
    s_fref = np.empty(m, dtype=np.int64)
    s_foff = np.empty((m, foff.shape[1]), dtype=foff.dtype)
    s_has = np.empty(m, dtype=np.bool_)
    s_min = np.empty(m, dtype=np.int64)
    for r in range(m):
        e, s = env[r], slots[r]
        s_ref[r] = last_ref[e]
        s_has[r] = has_last[e]
        s_min[r] = minref[s]
        s_fref[r] = fref[s]
        s_foff[r] = foff[s]
    ow = obs.reshape((m, k, -1)).view(last_frames.dtype)
    nw = nxt.reshape((m, k, -1)).view(last_frames.dtype)
    # (last_frames is copied only once the frames went in: nothing of it to save for the undo)
    fw1 = write_direct((ow, nw, env, ends, valid), (last_frames, last_ref, has_last), fw, ra.has_next,
                       fref, foff, staged, slots, minref, ra.reach, False)
    code = append_staged(log, staged.view(np.uint8), scratch, fw, fw1 - fw)
    if code == 0:
        continue_streams(last_frames, nw if ra.has_next else ow, env, valid)
        return fw1
    for r in range(m - 1, -1, -1):  # (in reverse: an env's first row holds what it had before)
        e, s = env[r], slots[r]
        last_ref[e] = s_ref[r]
        has_last[e] = s_has[r]
        minref[s] = s_min[r]
        fref[s] = s_fref[r]
        foff[s] = s_foff[r]
    return code


@kernel
def expire(ptr, count, capacity, k_envs, oldest_frame, minref, gid, status, out):
    """Advance each env's pointer past transitions whose oldest frame is
    below ``oldest_frame`` (overwritten); write their slots to ``out`` (those
    still live or pending) and return how many."""
    n = 0
    for e in range(ptr.shape[0]):
        g = ptr[e]
        first_live = count - capacity
        if g < first_live:  # skip what the ring itself has overwritten
            g += ((first_live - g + k_envs - 1) // k_envs) * k_envs
        while g < count:
            s = g % capacity
            if gid[s] == g and minref[s] >= oldest_frame:
                break
            if gid[s] == g and (status[s] == LIVE or status[s] == PENDING):
                status[s] = DEAD
                out[n] = s
                n += 1
            g += k_envs
        ptr[e] = g
    return n


@kernel
def distinct_ids(ids, uniq, src):
    """Where each distinct frame id of ``ids`` ``(n,)`` is decoded, once.

    Returns ``u``, the count of distinct ids >= 0, and fills ``uniq[:u]``:
    the ids to decode into rows ``0 .. u - 1`` of the output, and ``src``
    ``(n,)``: the row (< ``u``) that holds the frame of ``ids[i]``, or -1 for
    an id < 0 (a zero frame). An id's first occurrence at a position ``i < u``
    is decoded in place (``src[i] == i``); the first occurrences past ``u``
    are decoded into the holes below ``u`` (positions of repeats or of
    zeros), so ``spread_rows`` moves about two rows a repeat, not every row
    after it. ``u == n``: every id is distinct and >= 0, ``uniq`` is ``ids``.
    """
    n = ids.shape[0]
    # First occurrences through an open-addressing table of positions (2 to 4 slots an id,
    # Fibonacci hashing): one pass, no sort (a sort took twice as long for a batch of 160).
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    size = 1 << bits
    shift = np.uint64(64 - bits)
    table = np.full(size, -1, dtype=np.int64)
    head = np.empty(n, dtype=np.int64)  # each position's first occurrence (-1: a zero frame)
    u = 0
    for i in range(n):
        v = ids[i]
        if v < 0:
            head[i] = -1
            continue
        j = np.int64((np.uint64(v) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
        while True:
            p = table[j]
            if p < 0:
                table[j] = i
                head[i] = i
                u += 1
                break
            if ids[p] == v:
                head[i] = p
                break
            j = (j + 1) & (size - 1)
    h = 0  # the next hole below u
    for i in range(n):
        if head[i] != i:
            continue
        if i < u:
            uniq[i] = ids[i]
            src[i] = i
        else:  # (there are as many holes below u as first occurrences at or past it)
            while head[h] == h:
                h += 1
            uniq[h] = ids[i]
            src[i] = h
            h += 1
    for i in range(n):
        if head[i] != i:
            src[i] = -1 if head[i] < 0 else src[head[i]]
    return u


@kernel
def spread_rows(rows, src, u):
    """Row ``i`` of ``rows`` ``(n, words)`` becomes row ``src[i]`` (zeros for
    -1), in place, after ``distinct_ids`` put the distinct frames in rows
    ``0 .. u - 1``: first the rows past ``u`` (read from rows below ``u``,
    not yet changed), then the holes below ``u`` (read from first
    occurrences decoded in place, which never change)."""
    for i in range(u, rows.shape[0]):
        _row_from(rows, i, src[i])
    for i in range(u):
        if src[i] != i:
            _row_from(rows, i, src[i])


@kernel
def _row_from(rows, i, s):
    if s < 0:
        for w in range(rows.shape[1]):
            rows[i, w] = 0
    else:
        _copy(rows[i], rows[s])


# Frames per thread at least in a gather (about 0.9 MB of 84x84 frames), and the
# threads it takes to pay: on 2 shared cores, measured, a split gather was 1.3x slower
# (the copy is bound by memory bandwidth, which two cores already saturate).
GATHER_CHUNK = 128
GATHER_MIN_THREADS = 4


def _take_rows(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``src.take(rows, axis=0, out=out)``, in row ranges on several threads
    when there are many rows (numpy's take releases the GIL; each range
    copies the same bytes to the same place)."""
    # mode="clip": the rows are ring positions, always in range; with the default
    # mode="raise" numpy gathers into a temporary and copies it to `out` (measured:
    # 172 us instead of 100 for 160 Atari frames).
    if rows.shape[0] < 2 * GATHER_CHUNK or workers() < GATHER_MIN_THREADS:
        return src.take(rows, axis=0, out=out, mode="clip")
    for_ranges(lambda lo, hi: src.take(rows[lo:hi], axis=0, out=out[lo:hi], mode="clip"),
               rows.shape[0], GATHER_CHUNK)
    return out


class FrameStore:
    """The frame ring of one buffer: assigns references when steps are
    written, expires transitions whose frames were overwritten, and rebuilds
    stacks at sample time."""

    def __init__(self, cfg, store, dictionary=None, offsets=None, index=None):
        """``offsets``: the dtype of the stored ``frame_off`` (None: the
        config's, ``offset_dtype``; a wider one: what a buffer converted from
        the older format keeps, ``check_offsets``); ``index``: the row shape
        of the stored ``frame_index`` (None: a new log's; ``(2,)``: the wide
        entries an older bigper wrote, ``segments.index_width``). Another is
        ``IncompatibleSnapshotError``."""
        self.k = cfg.frame_stack
        obs_shape = cfg.shape("obs")
        self.frame_shape = tuple(obs_shape[1:])
        self.dtype = cfg.dtype("obs")
        self.row_bytes = int(np.prod(self.frame_shape)) * self.dtype.itemsize
        # Frames are compared and copied as 8-byte words where their size allows.
        self.word = np.dtype(np.uint64 if self.row_bytes % 8 == 0 else np.uint8)
        self.row_words = self.row_bytes // self.word.itemsize
        self.has_next = "obs" in cfg.next_of
        try:
            self.off_dtype = offset_dtype(self.k, cfg.num_envs) if offsets is None else \
                check_offsets(offsets, self.k, cfg.num_envs)
        except (TypeError, ValueError) as e:
            raise IncompatibleSnapshotError(f"the stored frame offsets: {e}") from None
        self.reach = offset_reach(self.k, self.off_dtype)
        self.n_off = self.k * (2 if self.has_next else 1)
        self.num_envs = cfg.num_envs
        self.capacity = cfg.capacity
        self.F = frame_capacity(cfg.capacity, self.k, cfg.num_envs)
        self.store = store
        # compression="zstd": frames live compressed in a segment log (frames/segments.py), not in a ring.
        try:
            self.log = SegmentLog(self.F, self.row_bytes, cfg.compression_budget, store, dictionary, index) \
                if cfg.compression else None
        except ValueError as e:
            raise IncompatibleSnapshotError(f"the stored frame index: {e}") from None
        self.in_place = self.log is None  # whether writes may go straight into the ring (_writer)
        # Mutable state: frames written, per-env stream continuity, expiry pointers.
        self.fw = 0
        self.last_frames = np.zeros((self.num_envs, self.k, self.row_words), dtype=self.word)
        self.last_ref = np.zeros((self.num_envs, self.k), dtype=np.int64)
        self.has_last = np.zeros(self.num_envs, dtype=np.bool_)
        self.ptr = np.arange(self.num_envs, dtype=np.int64)
        self.minref = np.zeros(cfg.capacity, dtype=np.int64)
        self._expired = np.empty(cfg.capacity, dtype=np.int64)  # scratch for expire()
        self._outs = ReusedArrays(depth=4, max_keys=4)  # gathers' outputs (pair's, stacks', rows_of's shapes)
        self._ring_of = self._ring = None  # the storage's frames array, and it as (F, words)
        self._args = self._args_of = None  # kernel_args' ring part, and the arrays it was made of
        self._work = None  # write_logged's staging ring and scratch
        self._new = None  # write's staging of new frames (kept up to _STAGING_BYTES)

    def specs(self) -> dict:
        """Arrays the storage holds: name -> (rows, shape, dtype)."""
        out = {"frames": (self.F, self.frame_shape, self.dtype)} if self.log is None else self.log.specs()
        out["frame_ref"] = (self.capacity, (), np.dtype(np.int64))
        out["frame_off"] = (self.capacity, (self.n_off,), self.off_dtype)
        return out

    def _words(self, stacks: np.ndarray) -> np.ndarray:
        m = stacks.shape[0]
        if stacks.flags.c_contiguous:  # the usual case: two views, no copy
            return stacks.reshape(m, self.k, self.row_bytes // self.dtype.itemsize).view(self.word)
        # Stacks that are views of one window of frames (a DQN Replay convert): a view of
        # words when the frames' own bytes are contiguous, compared by address first (_same).
        w = self.word.itemsize
        try:
            flat = stacks.reshape(m, self.k, -1).view(np.uint8)
        except ValueError:  # (a dtype wider than a byte whose last axis is not contiguous)
            flat = np.ascontiguousarray(stacks).reshape(m, self.k, -1).view(np.uint8)
        if flat.strides[-1] != 1 or flat.strides[1] % w or flat.strides[0] % w or flat.ctypes.data % w:
            flat = np.ascontiguousarray(flat)
        return flat.view(self.word)

    def write(self, rows: dict, g0: int, slots, where, ends: np.ndarray, valid=None, rw=None,
              journal: Journal | None = None) -> None:
        """Store the frames of ``rows["obs"]``/``rows["next_obs"]`` that are
        new and the references of every row at ``where`` (slots ``slots``);
        the rows are transitions ``g0, g0 + 1, ...``.

        ``rw``: the storage's writable arrays by name (memory, or memmap after
        ``prepare``), when it has them: frames and references are then written
        in place by the kernel, without a staging copy and the storage's calls.
        ``journal``: what this changes is recorded there first, to be put back
        when a later call of the write fails (``common.undo.Journal``); raw frames
        written in place need none (no call that can fail follows them in a
        write of at most ``capacity`` rows). The caller runs ``look`` after
        its last call that can fail.
        """
        m = ends.shape[0]
        obs, nxt, env = self._inputs(rows, g0, m)
        ok = (ALL_VALID[:m] if m <= ALL_VALID.shape[0] else np.ones(m, dtype=np.bool_)) \
            if valid is None else valid
        if rw is not None and self.log is None:
            ring, fref, foff = self._in_place(rw)
            # Rows go straight to their slots: refs are written row by row at slots[r].
            self.fw = write_direct((obs, nxt, env, ends, ok), (self.last_frames, self.last_ref, self.has_last),
                                   self.fw, self.has_next, fref, foff, ring, slots, self.minref, self.reach)
            return
        journal = Journal() if journal is None else journal
        obs_ref = np.empty((m, self.k), dtype=np.int64)
        next_ref = np.empty((m, self.k), dtype=np.int64)
        new = self._staging(2 * m * self.k)
        fw0 = self.fw
        # assign_refs changes the streams and the slots' oldest references before the
        # storage calls that can fail (the log's growth, a write): kept to put back.
        saved = self._save(env, slots)
        journal.add(lambda: self._undo(saved, slots, fw0))
        fw = assign_refs((obs, nxt, env, ends, ok), (self.last_frames, self.last_ref, self.has_last),
                         fw0, self.has_next, (obs_ref, next_ref), new, slots, self.minref, self.reach)
        n_new = fw - fw0
        if n_new and self.log is not None:
            self.log.append(fw0, new[:n_new].view(np.uint8).reshape(n_new, self.row_bytes), rw, journal)
        elif n_new:
            frames = new[:n_new].view(self.dtype).reshape((n_new, *self.frame_shape))
            first = fw0 % self.F
            dest = slice(first, first + n_new) if first + n_new <= self.F else np.arange(fw0, fw) % self.F
            if n_new > self.F:  # only the newest F frames survive
                frames, dest = frames[-self.F:], np.arange(fw - self.F, fw) % self.F
            journal.write(self.store, "frames", dest, frames, self.F)
        self.fw = fw
        one = m == 1
        fref = np.empty(m, dtype=np.int64)
        foff = np.empty((m, self.n_off), dtype=self.off_dtype)
        pack_refs(obs_ref, next_ref, self.has_next, np.arange(m, dtype=np.int64), fref, foff)
        for name, r in (("frame_ref", fref), ("frame_off", foff)):
            if rw is not None:
                journal.keep(rw[name], where)  # (the log's dictionary look, after this, reads the storage)
                rw[name][where] = r[0] if one else r
            else:
                journal.write(self.store, name, where, r[0] if one else r, self.capacity)

    def _staging(self, rows: int) -> np.ndarray:
        """``(rows, row_words)`` words where ``write`` puts a write's new frames: one
        array kept from write to write while it is at most ``_STAGING_BYTES`` (an
        extend of 1,024 Atari stacks stages 58 MB; a fresh one each time costs
        page faults, and a long convert's heap fragments). It stays for the store's
        life: up to 64 MB a buffer that once extended that many stacks at a time."""
        kept = self._new
        if kept is not None and kept.shape[0] >= rows:
            return kept[:rows]
        new = np.empty((rows, self.row_words), dtype=self.word)
        if new.nbytes <= _STAGING_BYTES:
            self._new = new
        return new

    def logged_args(self, rows: dict, rw: dict):
        """``(stacks, ring, logged)``: the frame arguments of
        ``_writer.write_rows_logged`` for a write of compressed frames in the same
        compiled call (``write_logged``, all or nothing, no journal: ``-1``
        when they do not fit, ``-2`` when zstd failed), for a write of at
        most ``num_envs`` rows whose frames may fit in the log's open
        segment. None: the general path writes them (they may reach a
        dictionary look: ``look`` can fail, so it runs where a journal can
        put the write back; or the log is capped)."""
        m = rows["terminated"].shape[0]
        log = None if m > self.num_envs or self.log.look_due(self.fw, 2 * m * self.k) \
            else self.log.staged_args(rw)
        if log is None:
            return None
        if self._work is None:
            most = 2 * self.num_envs * self.k
            self._work = (np.empty((most, self.row_words), dtype=self.word),
                          np.empty(most * self.log.max_len, dtype=np.uint8))
        # (made each call, not kept: the log's arrays are released with the log at its close)
        return self._contiguous(rows), self._ring_args(self._work[0], rw["frame_ref"], rw["frame_off"]), \
            (self.F, self._work, log)

    def look(self, fw0: int) -> None:
        """After frames ``fw0 .. fw - 1`` were written and the write's other
        calls went through: the compressed log's dictionary look (it only
        reads, then adopts a dictionary all or nothing)."""
        if self.log is not None:
            self.log.maybe_train(fw0, self.fw)

    def settle(self) -> None:
        """At the end of a write: the compressed log gives back free segments
        (best effort, after every call that can fail the write)."""
        if self.log is not None:
            self.log.trim()

    def checkpoint(self):
        """Everything in memory a write of more rows than slots changes
        (streams, pointers, oldest references, the log's counters and
        dictionaries), copied; returns the step that puts it back."""
        fw, frames, ref, has = self.fw, self.last_frames.copy(), self.last_ref.copy(), self.has_last.copy()
        ptr, minref = self.ptr.copy(), self.minref.copy()
        back_log = self.log.checkpoint() if self.log is not None else None

        def back():
            self.fw = fw
            self.last_frames[:], self.last_ref[:], self.has_last[:] = frames, ref, has
            self.ptr[:], self.minref[:] = ptr, minref
            if back_log is not None:
                back_log()
        return back

    def _save(self, env: np.ndarray, slots) -> tuple:
        """What ``assign_refs`` changes for rows of ``env`` at ``slots``: the
        streams of those envs and the slots' oldest references (a write that
        fails after ``assign_refs`` puts them back: ``_undo``)."""
        envs = env if env.shape[0] < self.num_envs else slice(None)
        return (envs, self.last_frames[envs].copy(), self.last_ref[envs].copy(), self.has_last[envs].copy(),
                self.minref[slots].copy())

    def _undo(self, saved: tuple, slots, fw0: int) -> None:
        envs, frames, ref, has, minref = saved
        self.last_frames[envs], self.last_ref[envs], self.has_last[envs] = frames, ref, has
        self.minref[slots] = minref
        self.fw = fw0

    def growth(self) -> dict:
        """Arrays that grow (the compressed log): name -> rows of one step."""
        return {} if self.log is None else self.log.growth()

    def attach(self) -> None:
        """After the storage allocated the arrays: the log takes the segments it holds."""
        if self.log is not None:
            self.log.attach()

    def _inputs(self, rows: dict, g0: int, m: int):
        """The rows' obs and next_obs stacks as words, and each row's env."""
        obs = self._words(rows["obs"])
        nxt = self._words(rows["next_obs"]) if self.has_next else obs
        return obs, nxt, self._envs(g0, m)

    def _envs(self, g0: int, m: int) -> np.ndarray:
        """The env of each of rows ``g0 .. g0 + m - 1``."""
        if self.num_envs > 1:
            return np.arange(g0, g0 + m, dtype=np.int64) % self.num_envs
        return _ENV0[:m] if m <= _ENV0.shape[0] else np.zeros(m, np.int64)

    def _in_place(self, rw: dict):
        """The storage's ring (as ``(F, words)``) and reference arrays, to write in place."""
        src = rw["frames"]
        if self._ring_of is not src:  # the ring as (F, words), kept while the storage keeps its array
            self._ring_of, self._ring = src, src.reshape(self.F, -1).view(self.word)
        return self._ring, rw["frame_ref"], rw["frame_off"]

    def kernel_args(self, rows: dict, rw: dict) -> tuple:
        """The frame arguments of ``_writer.write_rows`` for ``rows``
        written in place into ``rw``: ``(obs, next_obs)`` of the rows
        (C-contiguous stacks, viewed as words by the kernel), and the ring's
        (the same tuple while the storage keeps its arrays). The caller
        stores the returned frame count in ``fw``."""
        return self._contiguous(rows), self._ring_args(*self._in_place(rw))

    def _ring_args(self, ring, fref, foff) -> tuple:
        """The ring's ``RingArgs`` over these arrays, as a plain tuple (see
        ``RingArgs``), made again only when the storage's arrays change (a
        copy-on-write); a compressed log's writes pass their staging ring as
        ``ring``."""
        made_of = self._args_of
        if made_of is None or made_of[0] is not ring or made_of[1] is not fref or made_of[2] is not foff:
            self._args = tuple(RingArgs(True, self.last_frames, self.last_ref, self.has_last, self.has_next, fref,
                                        foff, ring, self.minref, self.ptr, self._expired, self.reach))
            self._args_of = (ring, fref, foff)
        return self._args

    def _contiguous(self, rows: dict) -> tuple:
        """The rows' ``(obs, next_obs)`` stacks, C-contiguous (``obs`` twice
        without next_obs), as bytes: the kernels view them as words, and take
        no array of a dtype numba has no type for (float16, another byte order)."""
        obs = rows["obs"]
        if not obs.flags.c_contiguous:
            obs = np.ascontiguousarray(obs)
        nxt = obs
        if self.has_next:
            nxt = rows["next_obs"]
            if not nxt.flags.c_contiguous:
                nxt = np.ascontiguousarray(nxt)
        return obs.view(np.uint8), nxt.view(np.uint8)

    def rows_touched(self, m: int, where) -> dict:
        """Rows a write of ``m`` transitions at ``where`` may touch, by array
        (frame rows as an upper bound: every frame of both stacks new)."""
        most = min(2 * m * self.k, self.F)
        first = self.fw % self.F
        frames = slice(first, first + most) if first + most <= self.F else \
            np.arange(self.fw, self.fw + most) % self.F
        if self.log is not None:
            out = {"frame_index": frames, "frame_log": self.log.touched()}
        else:
            out = {"frames": frames}
        out["frame_ref"] = out["frame_off"] = where
        return out

    def expire(self, count: int, gid, status) -> np.ndarray:
        """Slots of transitions whose frames are gone; they are marked dead."""
        oldest = self.fw - self.F
        if self.log is not None:
            oldest = max(oldest, self.log.oldest())
        if oldest <= 0:
            return np.zeros(0, dtype=np.int64)
        n = expire(self.ptr, count, self.capacity, self.num_envs, oldest, self.minref, gid, status,
                   self._expired)
        return self._expired[:n].copy()

    def stacks(self, name: str, slots: np.ndarray, out=None) -> np.ndarray:
        """``(B, k, *frame)`` stacks of ``name`` ("obs_ref" or "next_obs_ref") at
        ``slots``; ``out``: a C-contiguous array of that shape to gather into."""
        if self.log is not None:
            ids = self._refs(name, slots).ravel()
            dest = self._out((ids.shape[0], *self.frame_shape)) if out is None else out
            self._decode(ids, dest)
            return dest.reshape((slots.shape[0], self.k, *self.frame_shape))
        rows = (self._refs(name, slots) % self.F).ravel()
        arrays = self.store.arrays
        dest = None if out is None else out.reshape((rows.shape[0], *self.frame_shape))
        if arrays is None:
            frames = self.store.read("frames", rows)
            if dest is not None:
                np.copyto(dest, frames)
                return out
        else:
            frames = _take_rows(arrays["frames"], rows,
                                self._out((rows.shape[0], *self.frame_shape)) if dest is None else dest)
        return out if out is not None else frames.reshape((slots.shape[0], self.k, *self.frame_shape))

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The frames of global frame ids ``ids`` ``(n,)``, as ``(n, *frame)``
        (a reused output array); an id of -1 gives a zero frame."""
        out = self._out((ids.shape[0], *self.frame_shape))
        if self.log is not None:
            return self._decode(ids, out)
        real = ids >= 0
        every = bool(real.all())
        rows = np.where(real, ids % self.F, 0)
        arrays = self.store.arrays
        if arrays is None:
            np.copyto(out, self.store.read("frames", rows))
        else:
            _take_rows(arrays["frames"], rows, out)
        if not every:
            out[~real] = 0
        return out

    def expand(self, frames: np.ndarray, index: np.ndarray) -> np.ndarray:
        """``(B, T, k, *frame)`` stacks from each row's distinct ``frames``
        ``(B, n, *frame)``: ``index`` ``(B, T, k)`` positions in the rows
        (``seqframes.distinct_frames``), gathered into a reused output."""
        b, n = frames.shape[0], frames.shape[1]
        rows = (index + (np.arange(b, dtype=np.int64) * n)[:, None, None]).reshape(-1)
        out = _take_rows(frames.reshape(b * n, *self.frame_shape), rows, self._out((rows.shape[0], *self.frame_shape)))
        return out.reshape((*index.shape, *self.frame_shape))

    def oldest_frame(self) -> int:
        """The oldest frame id still stored (``fw - F`` for the ring; the log's oldest when compressed)."""
        oldest = max(0, self.fw - self.F)
        return oldest if self.log is None else max(oldest, self.log.oldest())

    def refs(self, name: str, slots: np.ndarray) -> np.ndarray:
        """``(B, k)`` frame ids of the ``name`` stacks ("obs_ref" or "next_obs_ref") at ``slots``."""
        return self._refs(name, slots)

    def _refs(self, name: str, slots: np.ndarray) -> np.ndarray:
        stack = REF_NAMES.index(name)
        fref, foff = self._stored(slots)
        return unpack_refs(fref, foff, self.k, stack)

    def _stored(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(frame_ref, frame_off)`` rows of ``slots`` as stored."""
        arrays = self.store.arrays
        if arrays is None:
            return self.store.read("frame_ref", slots), self.store.read("frame_off", slots)
        # take() beats fancy indexing for a batch
        return arrays["frame_ref"].take(slots, axis=0), arrays["frame_off"].take(slots, axis=0)

    def _ids(self, slots: np.ndarray) -> np.ndarray:
        """``(B, 2k)`` frame ids of the obs then the next_obs stacks at ``slots``."""
        fref, foff = self._stored(slots)
        return fref[:, None] - foff.astype(np.int64)

    def pair(self, slots: np.ndarray, out: np.ndarray | None = None,
             last: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``obs`` stacks at ``slots`` and ``next_obs`` stacks at ``last`` (the
        last slot of each n-step window; default ``slots``).

        When every next_obs stack is its obs stack moved on by one frame (a
        batch without episode starts), both are views of one gather of
        ``k + 1`` frames a row: 5/8 of the bytes for k = 4. They are then not
        contiguous along the batch axis. ``out``: a C-contiguous ``(B, k + 1,
        *frame)`` array for that gather (say, in pinned memory); unused when
        the stacks are not such a pair.
        """
        last = slots if last is None else last
        if last is slots and self.has_next:  # (one read of each slot's references for both stacks)
            ids = self._ids(slots)
            ro, rn = ids[:, :self.k], ids[:, self.k:]
        else:
            ro, rn = self._refs("obs_ref", slots), self._refs("next_obs_ref", last)
        arrays = self.store.arrays
        b, k = slots.shape[0], self.k
        if (arrays is None and self.log is None) or not (rn[:, :-1] == ro[:, 1:]).all():
            if self.log is None:
                return self.stacks("obs_ref", slots), self.stacks("next_obs_ref", last)
            # Compressed: both stacks from one decode of their frames (they still share most).
            both = self._decode(np.concatenate([ro.ravel(), rn.ravel()]),
                                self._out((2 * b * k, *self.frame_shape))).reshape((2, b, k, *self.frame_shape))
            return both[0], both[1]
        ids = np.concatenate([ro, rn[:, -1:]], axis=1).ravel()
        out = self._out((ids.shape[0], *self.frame_shape)) if out is None else \
            out.reshape((ids.shape[0], *self.frame_shape))
        if self.log is not None:
            self._decode(ids, out)
        else:
            out = _take_rows(arrays["frames"], ids % self.F, out)
        out = out.reshape((b, k + 1, *self.frame_shape))
        return out[:, :k], out[:, 1:]

    def _decode(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Frames ``ids`` ``(n,)`` from the compressed log into ``out`` (a
        C-contiguous array of ``n`` frames), each distinct id decoded once (the
        stacks of neighbouring transitions, a sequence's steps and a batch's
        repeated draws share frames); an id of -1 gives a zero frame.

        The distinct frames are decoded into the first rows of ``out``, most
        where they belong, and copied to the others in place (``distinct_ids``,
        ``spread_rows``): no scratch array, about two row copies a repeat, and
        a batch without a repeat (the usual prioritized draw from a large
        buffer) is one ``decode`` of ``ids``, as before."""
        n = ids.shape[0]
        if n == 0:  # (nothing to decode, and no row to reshape into)
            return out
        rows = out.reshape(n, -1).view(np.uint8)  # (n, row_bytes)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        uniq = np.empty(n, dtype=np.int64)
        src = np.empty(n, dtype=np.int64)
        u = distinct_ids(ids, uniq, src)
        if u == n:
            self.log.decode(ids, rows)
            return out
        if u:
            self.log.decode(uniq[:u], rows[:u])
        spread_rows(rows.view(self.word), src, u)
        return out

    def _out(self, shape: tuple) -> np.ndarray:
        """An output array for a gather (``common.reuse``: no page faults for a fresh one)."""
        return self._outs.take(shape, self.dtype)

    def check_live(self, status: np.ndarray, chunk: int = 4096) -> int:
        """Decompress every frame a live or pending transition references and
        check it (bounds, size, checksum): ``CorruptSnapshotError`` on the
        first that fails. Returns how many frames were checked."""
        if self.log is None:
            return 0
        slots = np.flatnonzero((status == LIVE) | (status == PENDING))
        ids = [self._refs("obs_ref", slots)]
        if self.has_next:
            ids.append(self._refs("next_obs_ref", slots))
        ids = np.unique(np.concatenate([i.ravel() for i in ids])) if slots.size else np.zeros(0, np.int64)
        out = np.empty((min(chunk, max(ids.shape[0], 1)), self.row_bytes), dtype=np.uint8)
        for lo in range(0, ids.shape[0], chunk):
            part = ids[lo:lo + chunk]
            self.log.decode(part, out[:part.shape[0]])
        return int(ids.shape[0])

    # -- state ---------------------------------------------------------------
    def state(self) -> tuple[dict, dict]:
        last = self.last_frames.view(np.uint8).reshape(self.num_envs, self.k, self.row_bytes)
        meta = {"fw": self.fw}
        arrays = {"frames_last": last, "frames_last_ref": self.last_ref,
                  "frames_has_last": self.has_last, "frames_ptr": self.ptr, "frames_minref": self.minref}
        # (frames_minref is not written to disk, core/layout.DERIVED: restore derives it from frame_ref / frame_off)
        if self.log is not None:
            self.log.settle_look(self.fw)  # (a dictionary look in flight is applied first: the state is whole)
            lmeta, larrays = self.log.state()
            meta.update(lmeta)
            arrays.update(larrays)
        return meta, arrays

    def restore(self, meta: dict, arrays: dict) -> None:
        self.fw = int(meta["fw"])
        self.last_frames.view(np.uint8).reshape(self.num_envs, self.k, self.row_bytes)[:] = \
            arrays["frames_last"]
        self.last_ref[:] = arrays["frames_last_ref"]
        self.has_last[:] = arrays["frames_has_last"]
        self.ptr[:] = arrays["frames_ptr"]
        if self.log is not None:
            self.log.restore(meta, arrays)
        if "frames_minref" in arrays:  # a state in memory (checked by statecheck), as it was
            self.minref[:] = arrays["frames_minref"]
        else:  # read from disk: derived from the stored references, and they checked
            self._derive_minref(arrays["status"])

    def _derive_minref(self, status: np.ndarray, chunk: int = 1 << 20) -> None:
        """Each slot's oldest reference from the stored ``frame_ref`` /
        ``frame_off`` (read from disk: untrusted), and the check that every
        live or pending transition references only frames still stored:
        ``CorruptSnapshotError`` naming the slot otherwise."""
        arrays, c = self.store.arrays, self.capacity
        lo, fw = self.oldest_frame(), self.fw
        for a in range(0, c, chunk):
            b = min(a + chunk, c)
            if arrays is not None:
                fref, foff = arrays["frame_ref"][a:b], arrays["frame_off"][a:b]
            else:
                rows = np.arange(a, b, dtype=np.int64)
                fref, foff = self.store.read("frame_ref", rows), self.store.read("frame_off", rows)
            part = status[a:b]
            wrong, mins = refs_outside(fref, foff, (part == LIVE) | (part == PENDING), lo, fw)
            if wrong:
                raise CorruptSnapshotError(wrong if a == 0 else f"{wrong} (slots counted from {a})")
            self.minref[a:b] = mins
            for name in ("frame_ref", "frame_off"):  # (read once here: a 50M ring's pages need not stay)
                self.store.release_pages(name, a, b)
