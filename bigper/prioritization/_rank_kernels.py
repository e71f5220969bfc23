"""Compiled kernels of rank-based prioritization: the heap, pure functions
over flat arrays. Nothing here validates input (``rank.py`` checks
everything at the boundary).

The ranking is an array max-heap over the ``n`` sampleable slots::

    position   0          key 9.0        the heap is read as an approximately
              / \\                         sorted array: position p stands for
             1   2        7.5   8.0       rank p + 1; right after a full sort
            / \\ / \\                       (``_rank_sort``) it *is* the sorted
           3  4 5  6      ...             array

- ``heap[p, 0]`` int64: the priority's float64 bit pattern (non-negative
  floats order like their bit patterns; -0.0 is stored as +0.0)
- ``heap[p, 1]`` int64: ``tick << 31 | slot``; the tick says when that
  priority was written (larger = more recent, unique, < 2**32)
- ``spos[s]``    int32: the heap position of slot ``s`` (-1: not in the heap)

20 bytes a slot, an entry's two words side by side so that a sift step
touches one cache line. Entries compare as ``(key, tick)`` pairs: among
equal priorities the most recently written ranks first, so a new transition
given the largest priority seen goes to position 0 (rank 1).
"""

import numpy as np

from ..common.kernels import kernel
from ._tree_kernels import BAD_INDEX, BAD_PRIORITY, NEVER_WRITTEN, UPDATE_OK
from ..common.status import EMPTY, LIVE, PENDING
# Constants only: numba's cache does not notice when another file's kernel
# changes, so no kernel here calls one from another file.
from ._rank_sort import SLOT_BITS, SLOT_MASK

TICK_LIMIT = 1 << 32  # ticks stay below it (rank.py re-sorts, renumbering, before)
KEY_END = 0x7FF0000000000000  # bit patterns of finite non-negative floats are below it


# -- order ------------------------------------------------------------------------
@kernel
def sift_up(heap, spos, p):
    """Move the entry at ``p`` toward the root while it ranks above its parent."""
    k = heap[p, 0]
    m = heap[p, 1]
    while p > 0:
        q = (p - 1) >> 1
        kq = heap[q, 0]
        mq = heap[q, 1]
        if not (k > kq or (k == kq and m > mq)):
            break
        heap[p, 0] = kq
        heap[p, 1] = mq
        spos[mq & SLOT_MASK] = p
        p = q
    heap[p, 0] = k
    heap[p, 1] = m
    spos[m & SLOT_MASK] = p
    return p


@kernel
def sift_down(heap, spos, n, p):
    """Move the entry at ``p`` away from the root while a child ranks above it."""
    k = heap[p, 0]
    m = heap[p, 1]
    while True:
        c = 2 * p + 1
        if c >= n:
            break
        kc = heap[c, 0]
        mc = heap[c, 1]
        if c + 1 < n:
            kd = heap[c + 1, 0]
            md = heap[c + 1, 1]
            if kd > kc or (kd == kc and md > mc):
                c += 1
                kc = kd
                mc = md
        if not (kc > k or (kc == k and mc > m)):
            break
        heap[p, 0] = kc
        heap[p, 1] = mc
        spos[mc & SLOT_MASK] = p
        p = c
    heap[p, 0] = k
    heap[p, 1] = m
    spos[m & SLOT_MASK] = p
    return p


@kernel
def _write(heap, spos, n, slot, kbits, tick):
    """Give ``slot`` the key ``kbits`` and ``tick``, adding it if absent; returns ``n``."""
    m = (tick << SLOT_BITS) | slot
    p = spos[slot]
    if p < 0:
        heap[n, 0] = kbits
        heap[n, 1] = m
        spos[slot] = n
        sift_up(heap, spos, n)
        return n + 1
    # The fresh tick ranks above an equal key: not lower means up.
    up = kbits >= heap[p, 0]
    heap[p, 0] = kbits
    heap[p, 1] = m
    if up:
        sift_up(heap, spos, p)
    else:
        sift_down(heap, spos, n, p)
    return n


@kernel
def heap_set(heap, spos, n, slots, values, tick):
    """Write ``values[i]`` (float64 >= 0) as the priority of ``slots[i]``, in
    order (the last of duplicates wins); a slot not in the heap is added.

    Every write takes a fresh tick ``tick, tick + 1, ...``.
    Returns ``(n, tick)`` after the writes.
    """
    bits = (values + 0.0).view(np.int64)  # + 0.0 turns -0.0 into +0.0
    for i in range(slots.shape[0]):
        n = _write(heap, spos, n, slots[i], bits[i], tick)
        tick += 1
    return n, tick


@kernel
def heap_remove(heap, spos, n, slots):
    """Take ``slots`` out of the heap (those not in it are ignored); returns ``n``."""
    for i in range(slots.shape[0]):
        slot = slots[i]
        p = spos[slot]
        if p < 0:
            continue
        spos[slot] = -1
        n -= 1
        if p == n:
            continue
        # The last entry fills the hole and moves whichever way it must.
        k = heap[n, 0]
        m = heap[n, 1]
        heap[p, 0] = k
        heap[p, 1] = m
        spos[m & SLOT_MASK] = p
        q = (p - 1) >> 1
        if p > 0 and (k > heap[q, 0] or (k == heap[q, 0] and m > heap[q, 1])):
            sift_up(heap, spos, p)
        else:
            sift_down(heap, spos, n, p)
    return n


@kernel
def _touch(heap, spos, idx):
    """XOR of the keys at the slots ``idx`` (those in the heap): reads them."""
    acc = 0
    for i in range(idx.shape[0]):
        q = spos[idx[i]]
        if q >= 0:
            acc ^= heap[q, 0]
    return acc


@kernel
def first_bad_row(idx, p, status):
    """``(code, position)`` of the first row an update must refuse, ``(UPDATE_OK,
    -1)`` if none (``kernels``' update codes: a NaN, infinite or negative
    priority, an index out of range, a slot never written)."""
    cap = status.shape[0]
    for i in range(idx.shape[0]):
        v = p[i]
        if not (v >= 0.0 and v < np.inf):
            return BAD_PRIORITY, i
        s = idx[i]
        if s < 0 or s >= cap:
            return BAD_INDEX, i
        if status[s] == EMPTY:
            return NEVER_WRITTEN, i
    return UPDATE_OK, -1


@kernel
def rank_update(heap, spos, n, tick, idx, p, stamps, use_stamps, gid, status, pending,
                max_priority):
    """A whole priority update in one call: check, route, write.

    Nothing is written unless every row passes. Returns ``(code, position,
    top, n, tick)``: ``UPDATE_OK`` (``top`` is the largest key set or pended)
    or ``first_bad_row``'s code and ``position``. The key is
    ``min(p, max_priority)``. Rows go by slot status: sampleable -> heap;
    waiting for its n-step window -> ``pending``; overwritten since sampling
    (``stamps`` differ from ``gid``, when ``use_stamps``) or dead -> skipped.
    Rows are applied in order, so the last of repeated indices wins.
    """
    m = idx.shape[0]
    code, pos = first_bad_row(idx, p, status)
    if code != UPDATE_OK:
        return code, pos, 0.0, n, tick
    keys = np.minimum(p, max_priority) + 0.0
    bits = keys.view(np.int64)
    # Load every row's heap entry first: the cache misses overlap instead of
    # queueing behind each sift (~20% of an update at 2**20 slots).
    warm = _touch(heap, spos, idx)
    top = 0.0 if warm != -1 else -0.0  # uses the loads, so they are kept
    for i in range(m):
        s = idx[i]
        st = status[s]
        if use_stamps and gid[s] != stamps[i]:
            continue
        if st == LIVE:
            n = _write(heap, spos, n, s, bits[i], tick)
            tick += 1
        elif st == PENDING:
            pending[s] = keys[i]
        else:
            continue
        top = max(top, keys[i])
    return UPDATE_OK, -1, top, n, tick


@kernel
def slots_at(heap, ranks):
    """The slots (int64) at heap positions ``ranks - 1``."""
    idx = np.empty(ranks.shape[0], dtype=np.int64)
    for b in range(ranks.shape[0]):
        idx[b] = heap[ranks[b] - 1, 1] & SLOT_MASK
    return idx


# -- checks -------------------------------------------------------------------------
# What ``heap_check`` finds: nothing; an entry that ranks above its parent (or equals it); ``spos`` and
# the heap disagreeing (or a slot outside the heap with a position); a key that is not a finite float
# >= 0 (or is -0.0); a tick outside ``[1, TICK_LIMIT)``.
HEAP_OK, HEAP_ORDER, HEAP_POSITIONS, HEAP_KEY, HEAP_TICK = 0, 1, 2, 4, 5


@kernel
def heap_check(heap, spos, n):
    """First problem found, as ``(code, position)`` (``HEAP_*``); ``(HEAP_OK, -1)`` when healthy."""
    cap = spos.shape[0]
    for p in range(n):
        k = heap[p, 0]
        m = heap[p, 1]
        if k < 0 or k >= KEY_END:
            return HEAP_KEY, p
        t = m >> SLOT_BITS
        if t < 1 or t >= TICK_LIMIT:
            return HEAP_TICK, p
        s = m & SLOT_MASK
        if s >= cap or spos[s] != p:
            return HEAP_POSITIONS, p
        if p > 0:
            q = (p - 1) >> 1
            if not (heap[q, 0] > k or (heap[q, 0] == k and heap[q, 1] > m)):
                return HEAP_ORDER, p
    inside = 0
    for s in range(cap):
        if spos[s] >= 0:
            if spos[s] >= n:
                return HEAP_POSITIONS, spos[s]
            inside += 1
        elif spos[s] != -1:
            return HEAP_POSITIONS, spos[s]
    if inside != n:
        return HEAP_POSITIONS, -1
    return HEAP_OK, -1
