"""Compiled kernels: pure functions over flat arrays.

Nothing here validates input: the Python layer (``tree.py``, ``buffer.py``)
checks everything once at the public boundary and hands over arrays of the
right dtype. Every kernel works on a whole batch per call.

Tree layout (see ``tree.py`` for the picture): one flat float64 array holds
every level, the root first and the leaves last; ``offsets[l]`` is where level
``l`` starts and ``sizes[l]`` how many nodes it has. Node ``j`` of level ``l``
has the children ``j*k .. j*k+k-1`` of level ``l+1`` (those that exist). A
parent is always recomputed from its children, never adjusted by a delta, so
the sums cannot drift.
"""

import numpy as np
from numba import njit

# One decorator so that every kernel shares the same options and lands in the
# same on-disk cache entries in every process.
kernel = njit(cache=True, nogil=True)


# Children per node: a compile-time constant so the child scans unroll and
# vectorize. Levels are padded to a multiple of it (zeros in the sum tree,
# inf in the min tree), so every scan reads exactly FANOUT values.
FANOUT = 16


@kernel
def _sum_children(sums, base):
    s = 0.0
    for c in range(FANOUT):
        s += sums[base + c]
    return s


@kernel
def _min_children(mins, base):
    m = mins[base]
    for c in range(1, FANOUT):
        m = min(m, mins[base + c])
    return m


@kernel
def _touch(arr, off, node):
    """Load the first word of each row's children's two cache lines.

    The loads are independent, so the CPU overlaps their misses; the scan
    that follows finds its lines in cache.
    """
    acc = 0.0
    for b in range(node.shape[0]):
        base = off + node[b] * FANOUT
        acc += arr[base] + arr[base + 8]
    return acc


@kernel
def tree_set(sums, mins, offsets, idx, leaves):
    """Set ``leaves[i]`` at leaf ``idx[i]`` (the last of duplicates wins) and
    recompute every ancestor. ``mins`` may be empty (no min tree)."""
    depth = offsets.shape[0]
    leaf_off = offsets[depth - 1]
    track_min = mins.shape[0] > 0
    for i in range(idx.shape[0]):
        v = leaves[i]
        sums[leaf_off + idx[i]] = v
        if track_min:
            mins[leaf_off + idx[i]] = v if v > 0.0 else np.inf
    # Ancestors are recomputed level by level after every leaf is in place,
    # so duplicates and shared parents see the final values; touching a
    # level's lines first lets the batch's cache misses overlap.
    node = idx.copy()
    for lev in range(depth - 2, -1, -1):
        for b in range(node.shape[0]):
            node[b] = node[b] // FANOUT
        child_off = offsets[lev + 1]
        _touch(sums, child_off, node)
        if track_min:
            _touch(mins, child_off, node)
        prev = -1
        for b in range(node.shape[0]):
            j = node[b]
            if j == prev:
                continue
            prev = j
            base = child_off + j * FANOUT
            sums[offsets[lev] + j] = _sum_children(sums, base)
            if track_min:
                mins[offsets[lev] + j] = _min_children(mins, base)


@kernel
def tree_build(sums, mins, offsets, sizes):
    """Recompute every internal node from the leaves: O(N)."""
    depth = offsets.shape[0]
    track_min = mins.shape[0] > 0
    if track_min:
        leaf_off = offsets[depth - 1]
        for i in range(sizes[depth - 1]):
            v = sums[leaf_off + i]
            mins[leaf_off + i] = v if v > 0.0 else np.inf
    for lev in range(depth - 2, -1, -1):
        for j in range(sizes[lev]):
            base = offsets[lev + 1] + j * FANOUT
            sums[offsets[lev] + j] = _sum_children(sums, base)
            if track_min:
                mins[offsets[lev] + j] = _min_children(mins, base)


@kernel
def tree_descend(sums, offsets, targets, out):
    """For each prefix-sum target find its leaf, breadth-first over the batch.

    At each node the chosen child is the first whose running prefix sum
    exceeds the target; a zero child adds nothing to the prefix, so it can
    never be that child. When rounding leaves a target at or past the node's
    sum, the last non-zero child is taken instead: a target near the total
    never lands on an empty or unwritten leaf.
    """
    depth = offsets.shape[0]
    n = targets.shape[0]
    node = np.zeros(n, dtype=np.int64)
    rem = targets.copy()
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
                while sums[base + cnt] <= 0.0:
                    cnt -= 1
                # Stay strictly inside that child on the levels below.
                u = sums[base + cnt] * (1.0 - 2.0 ** -52)
            node[b] = node[b] * FANOUT + cnt
            rem[b] = u
    for b in range(n):
        out[b] = node[b]


@kernel
def sample_kernel(sums, mins, offsets, uniforms, stratified, beta, batch_norm,
                  idx_out, prob_out, weight_out):
    """Draw ``len(uniforms)`` leaves in proportion to their values.

    Stratified: draw ``b`` lands in the slice ``[b, b+1) * total / n``.
    Weights: ``(N P(i))**-beta`` divided by the largest possible weight
    (global: the smallest non-zero leaf, read from the min tree) or by the
    batch's largest; N cancels in both, so it is not needed here.
    """
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
        weight_out[b] = (sums[leaf_off + idx_out[b]] / lo) ** (-beta)


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
def first_out_of_range(idx, n):
    """Position of the first index outside ``[0, n)``, or -1."""
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= n:
            return i
    return -1


@kernel
def keep_current(idx, gens_then, gens_now):
    """Mask of batch rows whose slot was not overwritten since sampling."""
    out = np.empty(idx.shape[0], dtype=np.bool_)
    for i in range(idx.shape[0]):
        out[i] = gens_now[idx[i]] == gens_then[i]
    return out


@kernel
def plan_update(idx, stamps, use_stamps, gid, status):
    """Route each row of a priority update.

    Codes: 1 set the tree leaf, 2 keep as the pending value of a transition
    whose n-step window is not complete, 0 skip (overwritten since sampling,
    or no longer sampleable), -1 index out of range, -2 slot never written.
    """
    n = gid.shape[0]
    out = np.empty(idx.shape[0], dtype=np.int8)
    for i in range(idx.shape[0]):
        s = idx[i]
        if s < 0 or s >= n:
            out[i] = -1
        elif status[s] == 0:
            out[i] = -2
        elif use_stamps and gid[s] != stamps[i]:
            out[i] = 0
        elif status[s] == 1:
            out[i] = 1
        elif status[s] == 2:
            out[i] = 2
        else:
            out[i] = 0
    return out
