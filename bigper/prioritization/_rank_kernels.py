"""Compiled kernels of rank-based prioritization: pure functions over flat arrays.

Nothing here validates input (``rank.py`` checks everything at the boundary).

The ranking is an array max-heap over the sampleable slots, ``n`` of them::

    position   0          key 9.0        the heap is read as an approximately
              / \\                         sorted array: position p stands for
             1   2        7.5   8.0       rank p + 1; right after a full sort
            / \\ / \\                       it *is* the sorted array
           3  4 5  6      ...

- ``keys[p]``   float64, the priority at heap position ``p``
- ``ticks[p]`` int64, when that priority was written (larger = more recent)
- ``hslot[p]``  int32, the slot at heap position ``p``
- ``spos[s]``   int32, the heap position of slot ``s`` (-1: not in the heap)

24 bytes a slot. Order is by ``(key, tick)``: among equal priorities the
most recently written ranks first, so a new transition given the largest
priority seen goes to position 0 (rank 1).

The sampler follows the per-rank law exactly at the heap positions:
``P(position p) = f(p + 1) / H(n)`` with ``f(r) = r**-alpha`` and
``H(m) = f(1) + ... + f(m)``. ``H`` is exact (a table) up to ``R0`` and the
Euler-Maclaurin expansion beyond, accurate to rounding; a draw inverts it in
O(1) (a closed-form guess, then one or two exact checks).
"""

import numpy as np

from .._kernels import kernel

# Ranks up to R0 use a summed table; beyond it the Euler-Maclaurin remainder
# is below 1e-13 of f(R0) for alpha <= 3.
R0 = 64
# Radix sort digit: 2**11 counters stay in L1.
RADIX_BITS = 11
# Most-significant-digit passes: buckets a pass.
MSD_BITS = 12


# -- order ------------------------------------------------------------------------
@kernel
def _above(ka, sa, kb, sb):
    """Whether ``(ka, sa)`` ranks above ``(kb, sb)``."""
    return ka > kb or (ka == kb and sa > sb)


@kernel
def sift_up(keys, ticks, hslot, spos, p):
    """Move the entry at ``p`` toward the root while it ranks above its parent."""
    k = keys[p]
    s = ticks[p]
    slot = hslot[p]
    while p > 0:
        q = (p - 1) >> 1
        if not _above(k, s, keys[q], ticks[q]):
            break
        keys[p] = keys[q]
        ticks[p] = ticks[q]
        hslot[p] = hslot[q]
        spos[hslot[p]] = p
        p = q
    keys[p] = k
    ticks[p] = s
    hslot[p] = slot
    spos[slot] = p
    return p


@kernel
def sift_down(keys, ticks, hslot, spos, n, p):
    """Move the entry at ``p`` away from the root while a child ranks above it."""
    k = keys[p]
    s = ticks[p]
    slot = hslot[p]
    while True:
        c = 2 * p + 1
        if c >= n:
            break
        if c + 1 < n and _above(keys[c + 1], ticks[c + 1], keys[c], ticks[c]):
            c += 1
        if not _above(keys[c], ticks[c], k, s):
            break
        keys[p] = keys[c]
        ticks[p] = ticks[c]
        hslot[p] = hslot[c]
        spos[hslot[p]] = p
        p = c
    keys[p] = k
    ticks[p] = s
    hslot[p] = slot
    spos[slot] = p
    return p


@kernel
def heap_set(keys, ticks, hslot, spos, n, slots, values, tick):
    """Write ``values[i]`` as the priority of ``slots[i]``, in order (the last
    of duplicates wins); a slot not in the heap is added at its end first.

    Every write takes a fresh tick ``tick, tick + 1, ...``.
    Returns ``(n, tick)`` after the writes.
    """
    for i in range(slots.shape[0]):
        slot = slots[i]
        v = values[i] + 0.0  # -0.0 -> +0.0: one bit pattern for zero (the sort uses bits)
        p = spos[slot]
        if p < 0:
            p = n
            n += 1
            hslot[p] = slot
            spos[slot] = p
            keys[p] = v
            ticks[p] = tick
            sift_up(keys, ticks, hslot, spos, p)
        else:
            # A fresh tick ranks above an equal key: not lower means up.
            up = v >= keys[p]
            keys[p] = v
            ticks[p] = tick
            if up:
                sift_up(keys, ticks, hslot, spos, p)
            else:
                sift_down(keys, ticks, hslot, spos, n, p)
        tick += 1
    return n, tick


@kernel
def heap_remove(keys, ticks, hslot, spos, n, slots):
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
        keys[p] = keys[n]
        ticks[p] = ticks[n]
        hslot[p] = hslot[n]
        spos[hslot[p]] = p
        if p > 0 and _above(keys[p], ticks[p], keys[(p - 1) >> 1], ticks[(p - 1) >> 1]):
            sift_up(keys, ticks, hslot, spos, p)
        else:
            sift_down(keys, ticks, hslot, spos, n, p)
    return n


@kernel
def rank_update(keys, ticks, hslot, spos, n, tick, idx, p, stamps, use_stamps, gid, status,
                pending, max_priority):
    """A whole priority update in one call: check, route, write.

    Nothing is written unless every row passes. Returns ``(code, position,
    top, n, tick)``: code 0 (done; ``top`` is the largest key set or pended),
    1 (a NaN, infinite or negative priority at ``position``), 2 (index out
    of range) or 3 (a slot never written). The key is
    ``min(p, max_priority)``. Rows go by slot status: sampleable -> heap;
    waiting for its n-step window -> ``pending``; overwritten since sampling
    (``stamps`` differ from ``gid``, when ``use_stamps``) or dead -> skipped.
    Rows are applied in order, so the last of repeated indices wins.
    """
    cap = gid.shape[0]
    m = idx.shape[0]
    for i in range(m):
        v = p[i]
        if not (v >= 0.0 and v < np.inf):
            return 1, i, 0.0, n, tick
        s = idx[i]
        if s < 0 or s >= cap:
            return 2, i, 0.0, n, tick
        if status[s] == 0:
            return 3, i, 0.0, n, tick
    top = 0.0
    one = np.empty(1, dtype=np.int64)
    val = np.empty(1, dtype=np.float64)
    for i in range(m):
        s = idx[i]
        st = status[s]
        if use_stamps and gid[s] != stamps[i]:
            continue
        v = min(p[i], max_priority)
        if st == 1:
            one[0] = s
            val[0] = v
            n, tick = heap_set(keys, ticks, hslot, spos, n, one, val, tick)
        elif st == 2:
            pending[s] = v
        else:
            continue
        top = max(top, v)
    return 0, -1, top, n, tick


# -- full sort ----------------------------------------------------------------------
@kernel
def _radix_pass(src_d, src_a, src_b, dst_d, dst_a, dst_b, shift, mask, count):
    """One stable counting pass on the digit ``(src_d >> shift) & mask``,
    carrying ``src_a`` and ``src_b`` along."""
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
        dst_b[j] = src_b[i]


@kernel
def _varying_bits(x):
    """Bits that differ between any two values of ``x`` (uint64)."""
    acc = np.uint64(0)
    for i in range(x.shape[0]):
        acc |= x[i] ^ x[0]
    return acc


@kernel
def _sort_on(d, a, b, d2, a2, b2, varying, count):
    """LSD radix sort of ``d`` (uint64, ascending, stable) carrying ``a, b``;
    only digits holding varying bits get a pass. Returns whether the result
    is in the second set of arrays."""
    mask = np.uint64((1 << RADIX_BITS) - 1)
    flipped = False
    shift = 0
    while shift < 64:
        if (varying >> np.uint64(shift)) & mask:
            if flipped:
                _radix_pass(d2, a2, b2, d, a, b, np.uint64(shift), mask, count)
            else:
                _radix_pass(d, a, b, d2, a2, b2, np.uint64(shift), mask, count)
            flipped = not flipped
        shift += RADIX_BITS
    return flipped


@kernel
def _insertion_sort(kb, tk, sl, s, e):
    """Sort ``[s, e)`` ascending by ``(kb, tk)`` in place (short runs)."""
    for i in range(s + 1, e):
        k = kb[i]
        t = tk[i]
        v = sl[i]
        j = i - 1
        while j >= s and (kb[j] > k or (kb[j] == k and tk[j] > t)):
            kb[j + 1] = kb[j]
            tk[j + 1] = tk[j]
            sl[j + 1] = sl[j]
            j -= 1
        kb[j + 1] = k
        tk[j + 1] = t
        sl[j + 1] = v


@kernel
def _lsd_sort(kb, tk, sl, kb2, tk2, sl2, count):
    """Sort ascending by ``(kb, tk)``, stable LSD passes (ticks first, keys
    last) on the varying digits only; the result ends in ``kb, tk, sl``."""
    if _sort_on(tk, kb, sl, tk2, kb2, sl2, _varying_bits(tk), count):
        kb[:] = kb2
        tk[:] = tk2
        sl[:] = sl2
    if _sort_on(kb, tk, sl, kb2, tk2, sl2, _varying_bits(kb), count):
        kb[:] = kb2
        tk[:] = tk2
        sl[:] = sl2


@kernel
def _msd_scatter(kb, tk, sl, kb2, tk2, sl2, start):
    """One stable pass over the top MSD_BITS bits that vary in ``kb``: the entries
    go to ``kb2, tk2, sl2`` grouped by that digit, ascending; bucket ``j`` is
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
        sl2[j] = sl[i]


@kernel
def _sort_small(kb, tk, sl, kb2, tk2, sl2, count):
    """Sort a bucket ascending by ``(kb, tk)`` in place."""
    if kb.shape[0] <= 48:
        _insertion_sort(kb, tk, sl, 0, kb.shape[0])
    else:
        _lsd_sort(kb, tk, sl, kb2, tk2, sl2, count)


@kernel
def heap_sort(keys, ticks, hslot, spos, n):
    """Fully sort the heap: position ``p`` becomes rank ``p + 1`` exactly.

    Order is ``(key, tick)`` descending; the keys' bit patterns order like the
    non-negative keys. A most-significant-digit pass on the top 12 bits that
    vary spreads the entries over 4096 buckets, a second one splits buckets
    that are still large (priorities bunch up in a few exponents), and the
    small buckets are then sorted in cache: insertion sort when short, else
    least-significant-digit radix passes on the digits that vary in them.
    O(n). The ticks are then renumbered ``n - p``: that keeps every comparison
    that can still matter, because a tick only breaks a tie of keys, and any
    later tie involves a write with a newer tick. Returns the next free tick,
    ``n + 1``.
    """
    if n == 0:
        return np.int64(1)
    kb = keys[:n].view(np.uint64).copy()
    tk = ticks[:n].view(np.uint64).copy()
    sl = hslot[:n].copy()
    kb2 = np.empty(n, dtype=np.uint64)
    tk2 = np.empty(n, dtype=np.uint64)
    sl2 = np.empty(n, dtype=np.int32)
    count = np.zeros(1 << RADIX_BITS, dtype=np.int64)
    start = np.empty((1 << MSD_BITS) + 1, dtype=np.int64)
    inner = np.empty((1 << MSD_BITS) + 1, dtype=np.int64)
    _msd_scatter(kb, tk, sl, kb2, tk2, sl2, start)
    # Now the data is in kb2..; kb.. is scratch of the same size.
    for b in range(1 << MSD_BITS):
        s = start[b]
        e = start[b + 1]
        if e - s <= 4096 or _varying_bits(kb2[s:e]) == 0:
            _sort_small(kb2[s:e], tk2[s:e], sl2[s:e], kb[s:e], tk[s:e], sl[s:e], count)
            continue
        _msd_scatter(kb2[s:e], tk2[s:e], sl2[s:e], kb[s:e], tk[s:e], sl[s:e], inner)
        for c in range(1 << MSD_BITS):
            s2 = s + inner[c]
            e2 = s + inner[c + 1]
            if e2 > s2:
                _sort_small(kb[s2:e2], tk[s2:e2], sl[s2:e2], kb2[s2:e2], tk2[s2:e2], sl2[s2:e2],
                            count)
        kb2[s:e] = kb[s:e]
        tk2[s:e] = tk[s:e]
        sl2[s:e] = sl[s:e]
    kview = kb2.view(np.float64)
    # Ascending -> descending: the largest goes to position 0.
    for i in range(n):
        p = n - 1 - i
        keys[p] = kview[i]
        hslot[p] = sl2[i]
        spos[sl2[i]] = p
        ticks[p] = n - p
    return np.int64(n + 1)


# -- checks -------------------------------------------------------------------------
@kernel
def heap_check(keys, ticks, hslot, spos, n):
    """First problem found, as ``(code, position)``; ``(0, -1)`` when healthy.

    Codes: 1 a child ranks above its parent; 2 ``spos`` and ``hslot`` disagree
    (or a slot outside the heap has a position); 3 a duplicate tick between
    parent and child; 4 a key that is NaN, infinite, negative or -0.0.
    """
    cap = spos.shape[0]
    for p in range(n):
        k = keys[p]
        if not (k >= 0.0 and k < np.inf) or (k == 0.0 and np.signbit(k)):
            return 4, p
        s = hslot[p]
        if s < 0 or s >= cap or spos[s] != p:
            return 2, p
        if p > 0:
            q = (p - 1) >> 1
            if ticks[p] == ticks[q]:
                return 3, p
            if _above(keys[p], ticks[p], keys[q], ticks[q]):
                return 1, p
    inside = 0
    for s in range(cap):
        if spos[s] >= 0:
            if spos[s] >= n:
                return 2, spos[s]
            inside += 1
    if inside != n:
        return 2, -1
    return 0, -1


# -- the rank law -------------------------------------------------------------------
@kernel
def rank_table(alpha):
    """Per-alpha constants, ``R0 + 4`` float64: ``H(0..R0)`` summed exactly,
    the Euler-Maclaurin constant ``C`` (``H(m) = C + I(m) + E(m)`` for
    ``m >= R0``), ``R0**(1 - alpha)`` and ``log(R0)``."""
    t = np.empty(R0 + 4, dtype=np.float64)
    t[0] = 0.0
    for r in range(1, R0 + 1):
        t[r] = t[r - 1] + float(r) ** -alpha
    t[R0 + 1] = t[R0] - _em_tail(float(R0), alpha)
    t[R0 + 2] = float(R0) ** (1.0 - alpha)
    t[R0 + 3] = np.log(float(R0))
    return t


@kernel
def _em_tail(x, alpha):
    """``E(x) = f/2 + f'/12 - f'''/720 + f'''''/30240`` at ``x``."""
    f = x ** -alpha
    ix2 = 1.0 / (x * x)
    d1 = -alpha * f / x
    d3 = d1 * (alpha + 1.0) * (alpha + 2.0) * ix2
    d5 = d3 * (alpha + 3.0) * (alpha + 4.0) * ix2
    return 0.5 * f + d1 / 12.0 - d3 / 720.0 + d5 / 30240.0


@kernel
def _integral(x, alpha):
    """``I(x)``: the integral of ``t**-alpha`` from ``R0`` to ``x``, without
    cancellation near ``alpha = 1``."""
    lg = np.log(x / R0)
    e = 1.0 - alpha
    if e == 0.0:
        return lg
    return float(R0) ** e * np.expm1(e * lg) / e


@kernel
def cum_weight(m, alpha, table):
    """``H(m) = 1**-alpha + ... + m**-alpha`` (``m >= 0``)."""
    if m <= R0:
        return table[m]
    x = float(m)
    return table[R0 + 1] + _integral(x, alpha) + _em_tail(x, alpha)


@kernel
def _first_above(t, lo, hi, alpha, table):
    """Smallest ``m`` in ``[lo, hi]`` with ``H(m) > t`` (``hi`` if none)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if cum_weight(mid, alpha, table) > t:
            hi = mid
        else:
            lo = mid + 1
    return lo


@kernel
def rank_of(t, n, alpha, table):
    """The rank ``r`` in ``1..n`` with ``H(r - 1) <= t < H(r)`` (``n`` if none)."""
    if t < table[R0] or n <= R0:
        lo = 1
        hi = min(n, R0)
        while lo < hi:  # few candidates: binary search in the table
            mid = (lo + hi) >> 1
            if table[mid] > t:
                hi = mid
            else:
                lo = mid + 1
        return lo
    # The continuous solution x of C + I(x) = t. By the midpoint rule
    # H(m) ~ C + I(m + 1/2), off by about alpha f(m) / (24 m), so x - 1/2
    # lies in (r - 1, r) up to that much plus t's rounding in units of f(x).
    # Only when x is that close to a boundary do exact checks against H
    # decide (a few draws in a thousand).
    e = 1.0 - alpha
    y = t - table[R0 + 1]
    if e == 0.0:
        lx = table[R0 + 3] + y
    else:
        z = e * y / table[R0 + 2]
        lx = table[R0 + 3] + np.log1p(z) / e if z > -1.0 else np.inf
    g = np.exp(lx) - 0.5
    lo = R0 + 1
    if g >= n:
        r = n
    elif g < lo:
        r = lo
    else:
        r = int(np.ceil(g))
        fx = np.exp(-alpha * lx)
        # x = exp(lx) carries lx's rounding times |lx|.
        tol = (alpha / (6.0 * g) + 1e-15 * (abs(t) + abs(table[R0 + 1])) / fx
               + 1e-15 * g * (abs(lx) + 2.0) + 1e-9)
        if r - g > tol and g - (r - 1) > tol:
            return r
    # Bracket the answer around r by growing steps, then bisect.
    d = 1
    while True:
        a = max(lo, r - d)
        b = min(n, r + d)
        if (a == lo or cum_weight(a - 1, alpha, table) <= t) and (
                b == n or cum_weight(b, alpha, table) > t):
            return _first_above(t, a, b, alpha, table)
        d *= 4


@kernel
def rank_sample(hslot, n, alpha, beta, table, uniforms, stratified, batch_norm):
    """Draw ``len(uniforms)`` heap positions by the rank law; return slots.

    Stratified: draw ``b`` falls in the ``b``-th of ``k`` segments of equal
    probability (``k = len(uniforms)``), by the per-rank law inside it.
    Weights ``(n P)**-beta`` divided by the largest possible one (global: the
    last rank's) or the batch's largest; either way they reduce to
    ``(r / r_ref)**(alpha * beta)``.
    Returns slots (int64), probabilities (float64), weights (float32).
    """
    k = uniforms.shape[0]
    idx = np.empty(k, dtype=np.int64)
    prob = np.empty(k, dtype=np.float64)
    weight = np.empty(k, dtype=np.float32)
    ranks = np.empty(k, dtype=np.int64)
    total = cum_weight(n, alpha, table)
    rmax = 0
    for b in range(k):
        if stratified:
            t = (b + uniforms[b]) * (total / k)
        else:
            t = uniforms[b] * total
        r = rank_of(t, n, alpha, table)
        ranks[b] = r
        rmax = max(rmax, r)
        idx[b] = hslot[r - 1]
        prob[b] = float(r) ** -alpha / total
    ref = float(rmax) if batch_norm else float(n)
    ab = alpha * beta
    for b in range(k):
        weight[b] = (ranks[b] / ref) ** ab
    return idx, prob, weight


@kernel
def position_probabilities(pos, n, alpha, table):
    """``P`` of heap positions ``pos`` (int64) among ``n``: ``f(p + 1) / H(n)``."""
    total = cum_weight(n, alpha, table)
    out = np.empty(pos.shape[0], dtype=np.float64)
    for i in range(pos.shape[0]):
        out[i] = float(pos[i] + 1) ** -alpha / total
    return out
