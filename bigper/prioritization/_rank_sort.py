"""Compiled full sort of the rank heap: O(n) radix passes, cache-local.

Entries are pairs of int64 ``(key bits, tick << 31 | slot)`` (see
``_rank_kernels``); sorting them ascending as unsigned pairs sorts by
``(priority, tick)``. A most-significant-digit pass on the top ``MSD_BITS``
bits of the keys that vary spreads the entries over buckets, a second one
splits buckets that are still large (priorities bunch up in a few binary
exponents), and each small bucket is then sorted in cache: insertion sort
when short, else least-significant-digit passes on the digits that vary in
it, the second word first so that it breaks ties of keys.
Nothing here validates input.
"""

import numpy as np

from ..common.kernels import kernel

SLOT_BITS = 31
SLOT_MASK = (1 << SLOT_BITS) - 1
# LSD digit: 2**11 counters stay in L1.
RADIX_BITS = 11
# MSD digit: 4096 buckets a pass (measured best of 10, 12 and 16 here).
MSD_BITS = 12
SHORT = 48     # insertion sort up to this many entries
SPLIT = 4096   # a bucket larger than this gets a second MSD pass


@kernel
def _varying_bits(x):
    """Bits that differ between any two values of ``x`` (uint64)."""
    acc = np.uint64(0)
    for i in range(x.shape[0]):
        acc |= x[i] ^ x[0]
    return acc


@kernel
def _radix_pass(src_d, src_a, dst_d, dst_a, shift, mask, count):
    """One stable counting pass on the digit ``(src_d >> shift) & mask``."""
    m = src_d.shape[0]
    count[:] = 0
    for i in range(m):
        count[(src_d[i] >> shift) & mask] += 1
    acc = 0
    for j in range(count.shape[0]):
        c = count[j]
        count[j] = acc
        acc += c
    for i in range(m):
        d = (src_d[i] >> shift) & mask
        j = count[d]
        count[d] = j + 1
        dst_d[j] = src_d[i]
        dst_a[j] = src_a[i]


@kernel
def _sort_on(d, a, d2, a2, low, count):
    """Stable LSD sort of ``d`` carrying ``a``, on the digits from bit ``low``
    up that vary; the result ends in ``d, a``."""
    varying = _varying_bits(d)
    mask = np.uint64((1 << RADIX_BITS) - 1)
    flipped = False
    shift = low
    while shift < 64:
        if (varying >> np.uint64(shift)) & mask:
            if flipped:
                _radix_pass(d2, a2, d, a, np.uint64(shift), mask, count)
            else:
                _radix_pass(d, a, d2, a2, np.uint64(shift), mask, count)
            flipped = not flipped
        shift += RADIX_BITS
    if flipped:
        d[:] = d2
        a[:] = a2


@kernel
def _sort_small(kb, tk, kb2, tk2, count):
    """Sort a bucket ascending by ``(kb, tk)`` in place (``kb2, tk2`` scratch)."""
    m = kb.shape[0]
    if m <= SHORT:
        for i in range(1, m):
            k = kb[i]
            t = tk[i]
            j = i - 1
            while j >= 0 and (kb[j] > k or (kb[j] == k and tk[j] > t)):
                kb[j + 1] = kb[j]
                tk[j + 1] = tk[j]
                j -= 1
            kb[j + 1] = k
            tk[j + 1] = t
    else:
        # The second word first; only its ticks order (they are unique), not the slot bits.
        _sort_on(tk, kb, tk2, kb2, SLOT_BITS, count)
        _sort_on(kb, tk, kb2, tk2, 0, count)


@kernel
def _msd_scatter(kb, tk, kb2, tk2, start):
    """One stable pass on the top ``MSD_BITS`` bits that vary in ``kb``: the
    entries go to ``kb2, tk2`` by that digit, ascending; bucket ``j`` is
    ``[start[j], start[j + 1])``."""
    m = kb.shape[0]
    varying = _varying_bits(kb)
    top = 0
    while top < 64 and (varying >> np.uint64(top)) != 0:
        top += 1
    sh = np.uint64(max(0, top - MSD_BITS))
    mask = np.uint64((1 << MSD_BITS) - 1)
    start[:] = 0
    for i in range(m):
        start[((kb[i] >> sh) & mask) + 1] += 1
    for j in range(1, start.shape[0]):
        start[j] += start[j - 1]
    nxt = start[:-1].copy()
    for i in range(m):
        d = (kb[i] >> sh) & mask
        j = nxt[d]
        nxt[d] = j + 1
        kb2[j] = kb[i]
        tk2[j] = tk[i]


@kernel
def heap_sort(heap, spos, n):
    """Fully sort the heap: position ``p`` becomes rank ``p + 1`` exactly.

    Order is ``(key, tick)`` descending. The ticks are then renumbered
    ``n - p``: that keeps every comparison that can still matter, because a
    tick only breaks a tie of keys, and any later tie involves a write with a
    newer tick. Returns the next free tick, ``n + 1``. Allocates 32 bytes an
    entry while it runs.
    """
    if n == 0:
        return np.int64(1)
    kb = heap[:n, 0].astype(np.uint64)
    tk = heap[:n, 1].astype(np.uint64)
    kb2 = np.empty(n, dtype=np.uint64)
    tk2 = np.empty(n, dtype=np.uint64)
    count = np.zeros(1 << RADIX_BITS, dtype=np.int64)
    start = np.empty((1 << MSD_BITS) + 1, dtype=np.int64)
    inner = np.empty((1 << MSD_BITS) + 1, dtype=np.int64)
    if _varying_bits(kb) == 0:
        # One key for all (a buffer filling up at the largest priority): ticks decide.
        _sort_on(tk, kb, tk2, kb2, SLOT_BITS, count)
        return _write_out(heap, spos, n, kb, tk)
    _msd_scatter(kb, tk, kb2, tk2, start)
    # The data is in kb2, tk2 now; kb, tk serve as scratch.
    for b in range(1 << MSD_BITS):
        s = start[b]
        e = start[b + 1]
        if e - s <= SPLIT or _varying_bits(kb2[s:e]) == 0:
            _sort_small(kb2[s:e], tk2[s:e], kb[s:e], tk[s:e], count)
            continue
        _msd_scatter(kb2[s:e], tk2[s:e], kb[s:e], tk[s:e], inner)
        for c in range(1 << MSD_BITS):
            s2 = s + inner[c]
            e2 = s + inner[c + 1]
            if e2 > s2:
                _sort_small(kb[s2:e2], tk[s2:e2], kb2[s2:e2], tk2[s2:e2], count)
        kb2[s:e] = kb[s:e]
        tk2[s:e] = tk[s:e]
    return _write_out(heap, spos, n, kb2, tk2)


@kernel
def _write_out(heap, spos, n, kb, tk):
    """Sorted ascending ``kb, tk`` back into the heap, largest at position 0,
    ticks renumbered ``n - p``; returns the next free tick."""
    for i in range(n):
        p = n - 1 - i
        slot = np.int64(tk[i]) & SLOT_MASK
        heap[p, 0] = np.int64(kb[i])
        heap[p, 1] = ((n - p) << SLOT_BITS) | slot
        spos[slot] = p
    return np.int64(n + 1)
