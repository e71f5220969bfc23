"""The sum and min trees' kernels (``prioritization/tree.py`` holds the trees).

Tree layout (see ``prioritization/tree.py`` for the picture): flat float64 arrays hold every
level, the root first and the leaves last; ``offsets[l]`` is where level ``l``
starts and ``sizes[l]`` how many nodes it has. Node ``j`` of level ``l`` has
the children ``j*FANOUT .. j*FANOUT+FANOUT-1`` of level ``l+1``.

- ``sums``: each node's total. A parent is always recomputed from its
  children, never adjusted by a delta, so the sums cannot drift.
- ``mins``: each internal node's smallest non-zero leaf below (``inf`` for
  none). It has no leaf level: a zero leaf counts as ``inf`` when its parent
  is recomputed, so a bulk update writes the leaves once, not twice.
"""

import numpy as np

from ..common.kernels import kernel
from ..common.status import EMPTY, LIVE, PENDING

# What ``update_capped`` (and ``_bulk.scan``) say of an update: applied, or why nothing was.
UPDATE_OK, BAD_PRIORITY, BAD_INDEX, NEVER_WRITTEN, ABOVE_LIMIT = 0, 1, 2, 3, 4
# Where an update's row goes that is neither LIVE nor PENDING: nowhere (overwritten since sampling, or dead).
SKIPPED = 0

# Children per node: a compile-time constant so the child scans unroll and
# vectorize. Levels are padded to a multiple of it (zeros in sums, inf in
# mins), so every scan reads exactly FANOUT values: one 64-byte cache line.
FANOUT = 8


@kernel
def _nodes(sums, mins, offsets, lev, nodes, n):
    """Recompute nodes ``nodes[:n]`` of level ``lev`` from their children:
    total and (when tracked) smallest non-zero leaf below.

    Each total adds its ``FANOUT`` children left to right (the order every
    tree of every version has used, so sums stay bit for bit what a snapshot
    recorded); two nodes are summed side by side, so the two chains of
    dependent additions overlap (3x faster than one node at a time).
    """
    coff = offsets[lev + 1]
    poff = offsets[lev]
    b = 0
    while b + 1 < n:
        j0 = nodes[b]
        j1 = nodes[b + 1]
        a0 = 0.0
        a1 = 0.0
        for c in range(FANOUT):
            a0 += sums[coff + j0 * FANOUT + c]
            a1 += sums[coff + j1 * FANOUT + c]
        sums[poff + j0] = a0
        sums[poff + j1] = a1
        b += 2
    if b < n:
        j = nodes[b]
        acc = 0.0
        for c in range(FANOUT):
            acc += sums[coff + j * FANOUT + c]
        sums[poff + j] = acc
    if mins.shape[0] == 0:
        return
    if lev == offsets.shape[0] - 2:  # children are leaves: zero means not sampleable
        for b in range(n):
            base = coff + nodes[b] * FANOUT
            m = np.inf
            for c in range(FANOUT):
                v = sums[base + c]
                m = min(m, v if v > 0.0 else np.inf)
            mins[poff + nodes[b]] = m
    else:
        for b in range(n):
            base = coff + nodes[b] * FANOUT
            m = np.inf
            for c in range(FANOUT):
                m = min(m, mins[base + c])
            mins[poff + nodes[b]] = m


@kernel
def _node_range(sums, mins, offsets, lev, lo, hi):
    """``_nodes`` over nodes ``lo .. hi-1`` of level ``lev``, in blocks."""
    block = np.empty(256, dtype=np.int64)
    j = lo
    while j < hi:
        n = min(256, hi - j)
        for b in range(n):
            block[b] = j + b
        _nodes(sums, mins, offsets, lev, block, n)
        j += n


@kernel
def _touch(arr, off, node):
    """Load the cache lines of each row's children before working on them.

    The loads are independent, so the CPU overlaps their misses; the work
    that follows finds its lines in cache.
    """
    acc = 0.0
    for b in range(node.shape[0]):
        base = off + node[b] * FANOUT
        acc += arr[base]
        if FANOUT > 8:
            acc += arr[base + 8]
    return acc


@kernel
def tree_set(sums, mins, offsets, idx, leaves):
    """Set ``leaves[i]`` at leaf ``idx[i]`` (the last of duplicates wins) and
    recompute every ancestor. ``mins`` may be empty (no min tree)."""
    depth = offsets.shape[0]
    leaf_off = offsets[depth - 1]
    for i in range(idx.shape[0]):
        sums[leaf_off + idx[i]] = leaves[i]
    # Ancestors are recomputed level by level after every leaf is in place,
    # so duplicates and shared parents see the final values. Each level's
    # parents are compacted first (a parent repeated in a row is recomputed
    # once: all repeats when idx is sorted, as stratified draws are).
    node = idx.copy()
    n = node.shape[0]
    for lev in range(depth - 2, -1, -1):
        k = 0
        prev = -1
        for b in range(n):
            q = node[b] // FANOUT
            if q != prev:
                node[k] = q
                k += 1
                prev = q
        n = k
        _nodes(sums, mins, offsets, lev, node, n)


@kernel
def tree_build(sums, mins, offsets, sizes):
    """Recompute every internal node from the leaves: O(N)."""
    depth = offsets.shape[0]
    for lev in range(depth - 2, -1, -1):
        _node_range(sums, mins, offsets, lev, 0, sizes[lev])


@kernel
def tree_level(sums, mins, offsets, lev, lo, hi):
    """Recompute nodes ``lo .. hi-1`` of level ``lev`` from their children (one
    range of a threaded O(N) rebuild: ranges of one level are independent)."""
    _node_range(sums, mins, offsets, lev, lo, hi)


@kernel
def set_leaves(sums, offsets, idx, leaves):
    """Write ``leaves[i]`` at leaf ``idx[i]`` (the last of duplicates wins), no ancestor."""
    leaf_off = offsets[offsets.shape[0] - 1]
    for i in range(idx.shape[0]):
        sums[leaf_off + idx[i]] = leaves[i]


@kernel
def tree_set_many(sums, mins, offsets, sizes, idx, leaves):
    """``tree_set`` for a large share of the leaves: write them all (the last
    of duplicates wins), then rebuild every internal node in O(N)."""
    leaf_off = offsets[offsets.shape[0] - 1]
    for i in range(idx.shape[0]):
        sums[leaf_off + idx[i]] = leaves[i]
    tree_build(sums, mins, offsets, sizes)


@kernel
def tree_descend(sums, offsets, targets, out):
    """For each prefix-sum target find its leaf, breadth-first over the batch.

    At each node the chosen child is the first whose running sum of siblings
    exceeds the target. A zero child adds nothing to that sum, so it can never
    be the one. When rounding leaves a target at or past the
    node's total, the last non-zero child is taken instead: a target near the
    total never lands on an empty or unwritten leaf.
    """
    depth = offsets.shape[0]
    n = targets.shape[0]
    node = np.zeros(n, dtype=np.int64)
    rem = np.maximum(targets, 0.0)  # a negative target takes the first non-zero leaf
    for lev in range(1, depth):
        off = offsets[lev]
        _touch(sums, off, node)
        for b in range(n):
            u = rem[b]
            base = off + node[b] * FANOUT
            acc = 0.0
            below = 0.0
            cnt = 0
            for c in range(FANOUT):
                acc += sums[base + c]
                if acc <= u:
                    cnt += 1
                    below = acc
            if cnt < FANOUT:
                u -= below
            else:
                cnt = FANOUT - 1
                while cnt > 0 and sums[base + cnt] <= 0.0:
                    cnt -= 1
                # Stay strictly inside that child on the levels below.
                u = sums[base + cnt] * (1.0 - 2.0 ** -52)
            node[b] = node[b] * FANOUT + cnt
            rem[b] = u
    for b in range(n):
        out[b] = node[b]


@kernel
def sample_kernel(sums, mins, offsets, uniforms, stratified, beta, batch_norm):
    """Draw ``len(uniforms)`` leaves in proportion to their values.

    Stratified: draw ``b`` lands in the slice ``[b, b+1) * total / n``.
    Weights: ``(N P(i))**-beta`` divided by the largest possible weight
    (global: the smallest non-zero leaf, read from the min tree) or by the
    batch's largest; N cancels in both, so it is not needed here.
    Returns indices (int64), probabilities (float64) and weights (float32).
    """
    n = uniforms.shape[0]
    idx_out = np.empty(n, dtype=np.int64)
    prob_out = np.empty(n, dtype=np.float64)
    weight_out = np.empty(n, dtype=np.float32)
    sample_into(sums, mins, offsets, uniforms, stratified, beta, batch_norm, idx_out, prob_out, weight_out)
    return idx_out, prob_out, weight_out


@kernel
def sample_into(sums, mins, offsets, uniforms, stratified, beta, batch_norm, idx_out, prob_out,
                weight_out):
    """``sample_kernel`` writing into the caller's arrays: arrays made inside a
    kernel and handed back to Python cost a dtype lookup each (~1 us)."""
    n = uniforms.shape[0]
    total = sums[0]
    targets = np.empty(n, dtype=np.float64)
    if stratified:
        step = total / n
        for b in range(n):
            targets[b] = (b + uniforms[b]) * step
    else:
        for b in range(n):
            targets[b] = uniforms[b] * total
    tree_descend(sums, offsets, targets, idx_out)
    leaf_off = offsets[offsets.shape[0] - 1]
    lo = np.inf
    for b in range(n):
        v = sums[leaf_off + idx_out[b]]
        prob_out[b] = v / total
        if v < lo:
            lo = v
    if not batch_norm:
        lo = mins[0]
    for b in range(n):
        weight_out[b] = is_weight(lo, sums[leaf_off + idx_out[b]], beta)


# The smallest IS weight a batch holds: float32's smallest normal number. A weight below it (leaves
# about 1e38 ** (1 / beta) apart) would be subnormal or 0 in the batch's float32: a transition drawn
# and then silently ignored by the learner (and subnormals take slow paths on some hardware).
W_MIN = float(np.finfo(np.float32).tiny)


@kernel
def is_weight(lo, v, beta):
    """``(lo / v) ** beta`` for leaves ``0 < lo <= v``: the IS weight
    ``(N P)**-beta`` over the largest possible one, at least ``W_MIN``. The
    ratio is <= 1, so it cannot overflow; where it underflows (leaves more
    than ~1e308 apart) the weight is taken through logarithms instead."""
    r = lo / v
    if r >= 2.2250738585072014e-308:
        w = r ** beta
    else:
        w = np.exp(beta * (np.log(lo) - np.log(v)))
    return w if w >= W_MIN else W_MIN


@kernel
def to_leaves(p, alpha, eps, max_priority, out):
    """``(min(p, max_priority) + eps) ** alpha``; returns the largest value."""
    top = 0.0
    for i in range(p.shape[0]):
        v = p[i]
        if v > max_priority:
            v = max_priority
        v = (v + eps) ** alpha
        out[i] = v
        if v > top:
            top = v
    return top


@kernel
def first_bad_priority(p):
    """Position of the first NaN, infinite or negative value, or -1."""
    for i in range(p.shape[0]):
        v = p[i]
        if not (v >= 0.0 and v < np.inf):
            return i
    return -1


@kernel
def update_kernel(tree, rows, book, keying):
    """``update_capped`` without a cap on the leaves (``keying``: ``(alpha, eps, max_priority)``)."""
    alpha, eps, max_priority = keying
    return update_capped(tree, rows, book, (alpha, eps, max_priority, np.inf), False)


@kernel
def update_capped(tree, rows, book, keying, defer_build):
    """A whole priority update in one call: check, route, transform, set.

    Grouped arguments: ``tree`` ``(sums, mins, offsets, sizes)``; ``rows``
    ``(idx, p, leaves, stamps, use_stamps)``; ``book``, the ring's ``(gid,
    status, pending)``; ``keying`` ``(alpha, eps, max_priority, limit)``.

    Nothing is written unless every row passes. Returns ``(code, position,
    top)``: code 0 (done; ``top`` is the largest value set), 1 (a NaN,
    infinite or negative priority at ``position``), 2 (index out of range) or
    3 (a slot never written) or 4 (a leaf computed here is above ``limit`` or
    NaN, when every priority is valid: reported before any index, the order in
    which a caller that computes the leaves first would report them); rows are
    otherwise checked in order, priority then index. ``leaves`` is
    either empty (computed here) or precomputed (and checked) by the caller.
    Rows are routed by slot status: sampleable -> tree; waiting for its n-step
    window -> ``pending``; overwritten since sampling (``stamps`` differ, when
    ``use_stamps``) or dead -> skipped. With ``defer_build``, a bulk update
    writes the leaves only and returns position -2: the caller then rebuilds
    the internal nodes (``tree_level`` over every level, bottom up).
    """
    sums, mins, offsets, sizes = tree
    idx, p, leaves, stamps, use_stamps = rows
    gid, status, pending = book
    alpha, eps, max_priority, limit = keying
    n = gid.shape[0]
    m = idx.shape[0]
    if leaves.shape[0] != m and first_bad_priority(p) < 0:
        leaves = np.empty(m, dtype=np.float64)
        to_leaves(p, alpha, eps, max_priority, leaves)
        for i in range(m):
            if not leaves[i] <= limit:
                return ABOVE_LIMIT, i, 0.0
    for i in range(m):
        v = p[i]
        if not (v >= 0.0 and v < np.inf):
            return BAD_PRIORITY, i, 0.0
        s = idx[i]
        if s < 0 or s >= n:
            return BAD_INDEX, i, 0.0
        if status[s] == EMPTY:
            return NEVER_WRITTEN, i, 0.0
    keep = np.empty(m, dtype=np.bool_)
    route = np.empty(m, dtype=np.uint8)
    all_tree = True
    for i in range(m):
        s = idx[i]
        st = status[s]
        if use_stamps and gid[s] != stamps[i]:
            st = SKIPPED
        route[i] = st
        keep[i] = st == LIVE
        if st == PENDING:
            pending[s] = leaves[i]
        if st != LIVE:
            all_tree = False
    kept_idx = idx
    if not all_tree:
        kept_idx = idx[keep]
        leaves = leaves[keep]
    rebuild = False
    if kept_idx.shape[0] * 8 >= n and kept_idx.shape[0] > 1024:
        # Walking every ancestor of that many leaves costs more than one O(N) rebuild.
        if defer_build:  # the caller rebuilds (in threads): position -2 says so
            set_leaves(sums, offsets, kept_idx, leaves)
            rebuild = True
        else:
            tree_set_many(sums, mins, offsets, sizes, kept_idx, leaves)
    else:
        tree_set(sums, mins, offsets, kept_idx, leaves)
    # Only values that became leaves (now, or when their window completes)
    # count toward the largest leaf: read back what each routed slot holds, so a
    # repeated index counts its last value only and skipped rows not at all.
    leaf_off = offsets[offsets.shape[0] - 1]
    top = 0.0
    for i in range(m):
        if route[i] == LIVE:
            v = sums[leaf_off + idx[i]]
        elif route[i] == PENDING:
            v = pending[idx[i]]
        else:
            continue
        if v > top:
            top = v
    return UPDATE_OK, -2 if rebuild else -1, top
