"""The compiled kernels against slow references, under Hypothesis.

Every kernel is a pure function over flat arrays, so each is called here
directly on arrays laid out by ``tree._layout`` and compared with a plain
numpy/``math.fsum`` reference computed from the leaves alone.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bigper.prioritization import _tree_kernels as K
from bigper.prioritization.tree import _layout

SETTINGS = settings(max_examples=60, deadline=None)
F = K.FANOUT

# Capacities 1..5000 with the awkward ones (powers of 16 and their neighbours) drawn often.
capacities = st.one_of(
    st.sampled_from([1, 2, 3, 15, 16, 17, 31, 255, 256, 257, 4095, 4096, 4097, 5000]),
    st.integers(1, 5000),
)


def new_arrays(n):
    offsets, sizes, total = _layout(n)
    # The min tree has no leaf level: it ends where the leaves start.
    return offsets, sizes, np.zeros(total), np.full(int(offsets[-1]), np.inf)


def random_leaves(rng, n, zero_frac, spread):
    """Leaves spanning ``spread`` decades, about ``zero_frac`` of them zero."""
    v = 10.0 ** rng.uniform(-spread, 1.0, n) * rng.random(n)
    v[rng.random(n) < zero_frac] = 0.0
    return v


def expected_levels(leaves, sizes):
    """Each level's exact node sums and mins (over non-zero leaves), from the leaves alone."""
    sums, mins = [np.asarray(leaves, dtype=np.float64)], [np.where(leaves > 0, leaves, np.inf)]
    for _ in range(len(sizes) - 1):
        s, m = sums[0], mins[0]
        groups = range(0, s.shape[0], F)
        sums.insert(0, np.array([math.fsum(s[i:i + F]) for i in groups]))
        mins.insert(0, np.array([m[i:i + F].min() for i in groups]))
    return sums, mins


def assert_tree_matches(sums, mins, offsets, sizes, leaves):
    """Layout, every node against the exact sum of its subtree, mins exact,
    and every parent against the sum of its own children."""
    n = leaves.shape[0]
    assert sizes[0] == 1 and sizes[-1] == n
    want_sums, want_mins = expected_levels(leaves, sizes)
    # the reference's levels: the leaf level has n nodes, each one above ceil(/16)
    assert [len(w) for w in want_sums] == list(sizes)
    for lev in range(len(sizes)):
        got = sums[offsets[lev]:offsets[lev] + sizes[lev]]
        np.testing.assert_allclose(got, want_sums[lev], rtol=1e-12, atol=0,
                                   err_msg=f"sums at level {lev}")
        if mins.shape[0] and lev < len(sizes) - 1:
            got_m = mins[offsets[lev]:offsets[lev] + sizes[lev]]
            np.testing.assert_array_equal(got_m, want_mins[lev], err_msg=f"mins at level {lev}")
    for lev in range(len(sizes) - 1):
        child = sums[offsets[lev + 1]:offsets[lev + 1] + sizes[lev + 1]]
        pad = np.concatenate([child, np.zeros((-child.shape[0]) % F)]).reshape(-1, F)
        parents = sums[offsets[lev]:offsets[lev] + sizes[lev]]
        np.testing.assert_allclose(parents, [math.fsum(r) for r in pad], rtol=1e-13, atol=0)
    assert math.isclose(sums[0], math.fsum(leaves), rel_tol=1e-12, abs_tol=0)


@SETTINGS
@given(n=capacities)
def test_layout_levels_are_disjoint_and_aligned(n):
    offsets, sizes, total = _layout(n)
    assert sizes[0] == 1 and sizes[-1] == n
    assert len(sizes) >= 2
    for lev in range(len(sizes) - 1):
        assert sizes[lev] == -(-sizes[lev + 1] // F)
        # a level never runs into the next, even when padded to whole nodes
        assert offsets[lev] + -(-sizes[lev] // F) * F <= offsets[lev + 1]
    assert all(o % F == 0 for o in offsets)
    assert offsets[-1] + -(-n // F) * F <= total
    # as few levels as the fan-out needs (a lone leaf still has a root above it)
    below_root = 1
    while F ** below_root < n:
        below_root += 1
    assert len(sizes) == 1 + below_root


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 4),
       batch=st.integers(1, 300), zero_frac=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
       spread=st.sampled_from([0, 3, 12]), pool=st.integers(1, 50))
def test_tree_set_batches_with_duplicates_and_zeros(n, seed, batches, batch, zero_frac, spread, pool):
    rng = np.random.default_rng(seed)
    offsets, sizes, sums, mins = new_arrays(n)
    model = np.zeros(n)
    for _ in range(batches):
        # indices drawn from a small pool so that duplicates are common
        choices = rng.choice(n, size=min(pool, n), replace=False)
        idx = rng.choice(choices, size=batch).astype(np.int64)
        vals = random_leaves(rng, batch, zero_frac, spread)
        K.tree_set(sums, mins, offsets, idx, vals)
        for i, v in zip(idx, vals):  # the last of duplicates wins
            model[i] = v
        np.testing.assert_array_equal(sums[offsets[-1]:offsets[-1] + n], model)
        assert_tree_matches(sums, mins, offsets, sizes, model)


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), zero_frac=st.sampled_from([0.0, 0.5, 1.0]))
def test_tree_set_without_min_tree(n, seed, zero_frac):
    rng = np.random.default_rng(seed)
    offsets, sizes, sums, _ = new_arrays(n)
    idx = rng.integers(0, n, 3 * n).astype(np.int64)
    vals = random_leaves(rng, idx.shape[0], zero_frac, 6)
    K.tree_set(sums, np.zeros(0), offsets, idx, vals)
    model = np.zeros(n)
    for i, v in zip(idx, vals):
        model[i] = v
    assert_tree_matches(sums, np.zeros(0), offsets, sizes, model)


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), zero_frac=st.sampled_from([0.0, 0.5, 0.99]))
def test_tree_build_equals_the_same_leaves_set_one_by_one(n, seed, zero_frac):
    rng = np.random.default_rng(seed)
    leaves = random_leaves(rng, n, zero_frac, 8)
    offsets, sizes, sums_b, mins_b = new_arrays(n)
    # start from stale internal nodes (padding stays zero, as the tree keeps it):
    # build must not depend on what was there
    for lev in range(len(sizes) - 1):
        sums_b[offsets[lev]:offsets[lev] + sizes[lev]] = rng.random(sizes[lev])
        mins_b[offsets[lev]:offsets[lev] + sizes[lev]] = rng.random(sizes[lev])
    sums_b[offsets[-1]:offsets[-1] + n] = leaves
    K.tree_build(sums_b, mins_b, offsets, sizes)
    _, _, sums_s, mins_s = new_arrays(n)
    perm = rng.permutation(n).astype(np.int64)
    for chunk in np.array_split(perm, max(1, n // 97)):
        K.tree_set(sums_s, mins_s, offsets, chunk, leaves[chunk])
    assert_tree_matches(sums_s, mins_s, offsets, sizes, leaves)
    for lev in range(len(sizes)):
        a, b = offsets[lev], offsets[lev] + sizes[lev]
        np.testing.assert_array_equal(sums_b[a:b], sums_s[a:b])
        if lev < len(sizes) - 1:
            np.testing.assert_array_equal(mins_b[a:b], mins_s[a:b])


def reference_find(leaves, targets):
    """Leaf whose interval [cum_before, cum_after) holds each target."""
    cum = np.cumsum(leaves)
    return np.searchsorted(cum, targets, side="right")


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), zero_frac=st.sampled_from([0.0, 0.4, 0.95]),
       top=st.sampled_from([1, 3, 1000]))
def test_descend_exact_on_integer_leaves(n, seed, zero_frac, top):
    """With integer leaves every prefix sum is exact, so the tree must agree
    with searchsorted on every target, boundaries included."""
    rng = np.random.default_rng(seed)
    leaves = rng.integers(0, top + 1, n).astype(np.float64)
    leaves[rng.random(n) < zero_frac] = 0.0
    assume(leaves.sum() > 0)
    offsets, sizes, sums, mins = new_arrays(n)
    sums[offsets[-1]:offsets[-1] + n] = leaves
    K.tree_build(sums, mins, offsets, sizes)
    total = leaves.sum()
    cum = np.cumsum(leaves)
    targets = np.concatenate([
        [0.0, total - 0.5, total - 1.0],
        cum[:-1],                       # every interior boundary: the next non-zero leaf
        cum - 0.5 * leaves,             # every midpoint
        rng.random(200) * total,
    ])
    targets = targets[(targets >= 0) & (targets < total)]
    out = np.empty(targets.shape[0], dtype=np.int64)
    K.tree_descend(sums, offsets, targets, out)
    np.testing.assert_array_equal(out, reference_find(leaves, targets))
    assert np.all(leaves[out] > 0)


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), zero_frac=st.sampled_from([0.0, 0.5, 0.95]),
       spread=st.sampled_from([0, 5, 15]))
def test_descend_against_cumsum(n, seed, zero_frac, spread):
    rng = np.random.default_rng(seed)
    leaves = random_leaves(rng, n, zero_frac, spread)
    assume(leaves.sum() > 0)
    offsets, sizes, sums, mins = new_arrays(n)
    sums[offsets[-1]:offsets[-1] + n] = leaves
    K.tree_build(sums, mins, offsets, sizes)
    total = sums[0]
    cum = np.cumsum(leaves)
    before = cum - leaves
    tol = 1e-10 * total
    # a target well inside a leaf's interval lands on that leaf
    wide = np.flatnonzero(leaves > 1e-6 * total)
    mid = before[wide] + leaves[wide] * rng.uniform(0.01, 0.99, wide.shape[0])
    out = np.empty(mid.shape[0], dtype=np.int64)
    K.tree_descend(sums, offsets, mid, out)
    np.testing.assert_array_equal(out, wide)
    # any target: a non-zero leaf whose interval holds it up to rounding
    t = np.concatenate([rng.random(500) * total, [0.0]])
    out = np.empty(t.shape[0], dtype=np.int64)
    K.tree_descend(sums, offsets, t, out)
    assert np.all((out >= 0) & (out < n))
    assert np.all(leaves[out] > 0)
    assert np.all(before[out] <= t + tol) and np.all(t <= cum[out] + tol)


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), tail_zeros=st.integers(0, 5000),
       spread=st.sampled_from([0, 8, 30]))
def test_descend_near_the_total_never_hits_a_zero_leaf(n, seed, tail_zeros, spread):
    rng = np.random.default_rng(seed)
    leaves = random_leaves(rng, n, 0.3, spread)
    leaves[max(1, n - tail_zeros):] = 0.0  # trees whose last leaves are all zero
    assume(leaves.sum() > 0)
    offsets, sizes, sums, mins = new_arrays(n)
    sums[offsets[-1]:offsets[-1] + n] = leaves
    K.tree_build(sums, mins, offsets, sizes)
    total = sums[0]
    edge = [total, np.nextafter(total, 0), total * (1 - 2.0 ** -53), total * (1 - 2.0 ** -52),
            total * (1 - 1e-15), total * (1 - 1e-12), np.nextafter(total, np.inf)]
    out = np.empty(len(edge), dtype=np.int64)
    K.tree_descend(sums, offsets, np.array(edge), out)
    last = np.flatnonzero(leaves)[-1]
    assert np.all(out >= 0) and np.all(out <= last)
    assert np.all(leaves[out] > 0)
    # what lies after the chosen leaf is only rounding's worth of mass
    for j in out:
        assert math.fsum(leaves[j + 1:]) <= 1e-11 * total


@pytest.mark.parametrize("n", [1, 2, 16, 17, 300, 4097])
def test_descend_all_but_one_zero(n):
    for k in sorted({0, n // 2, n - 1}):
        for value in (1.0, 1e-300, 5e-324, 1e300):
            leaves = np.zeros(n)
            leaves[k] = value
            offsets, sizes, sums, mins = new_arrays(n)
            sums[offsets[-1]:offsets[-1] + n] = leaves
            K.tree_build(sums, mins, offsets, sizes)
            t = np.array([0.0, value * 0.5, np.nextafter(value, 0), value, value * 2])
            out = np.empty(t.shape[0], dtype=np.int64)
            K.tree_descend(sums, offsets, t, out)
            np.testing.assert_array_equal(out, k)


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 300),
       stratified=st.booleans(), batch_norm=st.booleans(), beta=st.sampled_from([0.0, 0.4, 1.0, 2.5]),
       zero_frac=st.sampled_from([0.0, 0.7]))
def test_sample_kernel(n, seed, batch, stratified, batch_norm, beta, zero_frac):
    rng = np.random.default_rng(seed)
    leaves = random_leaves(rng, n, zero_frac, 6)
    assume(leaves.sum() > 0)
    offsets, sizes, sums, mins = new_arrays(n)
    sums[offsets[-1]:offsets[-1] + n] = leaves
    K.tree_build(sums, mins, offsets, sizes)
    u = rng.random(batch)
    u[-1] = np.nextafter(1.0, 0)  # the largest uniform a Generator can return
    idx, prob, w = K.sample_kernel(sums, mins, offsets, u, stratified, beta, batch_norm)
    assert idx.dtype == np.int64 and prob.dtype == np.float64 and w.dtype == np.float32
    total = math.fsum(leaves)
    assert np.all(leaves[idx] > 0) and np.all(idx < n)
    # the draw of row b: target (b + u_b) * total / batch, or u_b * total
    t = (np.arange(batch) + u) * total / batch if stratified else u * total
    cum = np.cumsum(leaves)
    tol = 1e-10 * total
    assert np.all(cum[idx] - leaves[idx] <= t + tol) and np.all(t <= cum[idx] + tol)
    np.testing.assert_allclose(prob, leaves[idx] / total, rtol=1e-12)
    p_all = leaves / total
    norm = (p_all[idx].min() if batch_norm else p_all[p_all > 0].min())
    np.testing.assert_allclose(w, (p_all[idx] / norm) ** -beta, rtol=2e-6)
    assert np.all(w <= 1.0 + 1e-6)


@SETTINGS
@given(p=st.lists(st.floats(0, 1e6), min_size=0, max_size=50),
       alpha=st.sampled_from([0.0, 0.5, 0.6, 1.0, 2.0]), eps=st.sampled_from([0.0, 1e-6, 0.1]),
       maxp=st.sampled_from([np.inf, 1.0, 37.5]))
def test_to_leaves(p, alpha, eps, maxp):
    p = np.array(p, dtype=np.float64)
    out = np.empty(p.shape[0])
    top = K.to_leaves(p, alpha, eps, maxp, out)
    want = [(min(x, maxp) + eps) ** alpha for x in p]
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=0)
    assert top == pytest.approx(max(want, default=0.0), rel=1e-14)


@SETTINGS
@given(p=st.lists(st.one_of(st.floats(), st.floats(0, 10)), max_size=30))
def test_first_bad_priority(p):
    arr = np.array(p, dtype=np.float64)
    bad = [i for i, x in enumerate(p) if math.isnan(x) or math.isinf(x) or x < 0]
    assert K.first_bad_priority(arr) == (bad[0] if bad else -1)


@SETTINGS
@given(n=capacities, seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6000),
       zero_frac=st.sampled_from([0.0, 0.5]))
def test_tree_set_many_equals_tree_set(n, seed, m, zero_frac):
    """The O(N) bulk path gives the same arrays as the per-leaf path."""
    rng = np.random.default_rng(seed)
    offsets, sizes, sums_a, mins_a = new_arrays(n)
    _, _, sums_b, mins_b = new_arrays(n)
    start = random_leaves(rng, n, 0.2, 4)
    for sums, mins in ((sums_a, mins_a), (sums_b, mins_b)):
        sums[offsets[-1]:offsets[-1] + n] = start
        K.tree_build(sums, mins, offsets, sizes)
    idx = rng.integers(0, n, m).astype(np.int64)
    vals = random_leaves(rng, m, zero_frac, 4)
    K.tree_set(sums_a, mins_a, offsets, idx, vals)
    K.tree_set_many(sums_b, mins_b, offsets, sizes, idx, vals)
    model = start.copy()
    for i, v in zip(idx, vals):
        model[i] = v
    assert_tree_matches(sums_b, mins_b, offsets, sizes, model)
    np.testing.assert_array_equal(sums_a, sums_b)
    np.testing.assert_array_equal(mins_a, mins_b)


def reference_update(idx, p, stamps, use, gid, status, n, alpha, eps, maxp):
    """(code, position) of the first bad row, else the per-slot outcome."""
    for i, (s, v) in enumerate(zip(idx, p)):
        if not (v >= 0 and v < math.inf):
            return (1, i), None
        if not 0 <= s < n:
            return (2, i), None
        if status[s] == 0:
            return (3, i), None
    tree, pend = {}, {}
    leaves = [(min(v, maxp) + eps) ** alpha for v in p]
    for s, g, lf in zip(idx, stamps, leaves):
        st_ = 0 if use and gid[s] != g else status[s]
        if st_ == 1:
            tree[s] = lf
        elif st_ == 2:
            pend[s] = lf
    # Only values that became leaves count toward the largest: with a repeated
    # index, the last value; skipped rows not at all.
    return (0, -1), (tree, pend, max(list(tree.values()) + list(pend.values()), default=0.0))


@SETTINGS
@given(data=st.data(), n=st.integers(1, 40), use=st.booleans(), precomputed=st.booleans(),
       alpha=st.sampled_from([0.0, 0.6, 1.0]), eps=st.sampled_from([0.0, 1e-6]),
       maxp=st.sampled_from([math.inf, 2.0]))
def test_update_kernel(data, n, use, precomputed, alpha, eps, maxp):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    gid = rng.integers(-1, 6, n).astype(np.int64)
    status = np.array(data.draw(st.lists(st.sampled_from([0, 1, 1, 2, 3]), min_size=n, max_size=n)),
                      dtype=np.uint8)
    m = data.draw(st.integers(0, 30))
    if data.draw(st.booleans()):
        # Half the examples are valid updates (most random rows would be refused
        # at the first check and never reach the routing): written slots, often
        # repeated, priorities in range.
        written = np.flatnonzero(status)
        if written.size == 0:
            status[0] = 1
            written = np.array([0])
        idx = np.array(data.draw(st.lists(st.sampled_from(written.tolist()), min_size=m, max_size=m)),
                       dtype=np.int64)
        p = np.array(data.draw(st.lists(st.floats(0, 10), min_size=m, max_size=m)), dtype=np.float64)
    else:
        idx = np.array(data.draw(st.lists(st.integers(0, n - 1) | st.integers(-2, n + 1), min_size=m,
                                          max_size=m)), dtype=np.int64)
        p = np.array(data.draw(st.lists(st.floats(0, 10) | st.floats(), min_size=m, max_size=m)),
                     dtype=np.float64)
    stamps = np.where(rng.random(m) < 0.7, gid[np.clip(idx, 0, n - 1)], 99).astype(np.int64)
    offsets, sizes, sums, mins = new_arrays(n)
    start = random_leaves(rng, n, 0.3, 3)
    sums[offsets[-1]:offsets[-1] + n] = start
    K.tree_build(sums, mins, offsets, sizes)
    pending = rng.random(n)
    before = (sums.copy(), mins.copy(), pending.copy())
    want, outcome = reference_update(idx, p, stamps, use, gid, status, n, alpha, eps, maxp)
    with np.errstate(invalid="ignore"):
        pre = np.power(np.minimum(p, maxp) + eps, alpha) if precomputed and want[0] == 0 else np.zeros(0)
    code, pos, top = K.update_kernel((sums, mins, offsets, sizes), (idx, p, pre, stamps, use),
                                     (gid, status, pending), (alpha, eps, maxp))
    assert (code, pos) == want
    if code:  # nothing written
        for a, b in zip((sums, mins, pending), before):
            np.testing.assert_array_equal(a, b)
        return
    tree, pend, want_top = outcome
    model = start.copy()
    for s, v in tree.items():
        model[s] = v
    np.testing.assert_allclose(sums[offsets[-1]:offsets[-1] + n], model, rtol=1e-14, atol=0)
    assert_tree_matches(sums, mins, offsets, sizes, sums[offsets[-1]:offsets[-1] + n].copy())
    want_pending = before[2].copy()
    for s, v in pend.items():
        want_pending[s] = v
    np.testing.assert_allclose(pending, want_pending, rtol=1e-14, atol=0)
    assert top == pytest.approx(want_top, rel=1e-14)
