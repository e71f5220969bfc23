"""The rank kernels against slow references, under Hypothesis.

The heap kernels run on fresh arrays and are compared with a plain Python
model (slot -> (key, tick)); the sort with Python's ``sorted``; the law
(``H`` and its inversion) with ``math.fsum`` and a bisection over ``H``.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigper.prioritization import _rank_kernels as RK
from bigper.prioritization import _rank_law as LAW
from bigper.prioritization import _rank_sort as RS

SETTINGS = settings(max_examples=60, deadline=None)
MASK = RS.SLOT_MASK

# Priorities with ties, zeros (both signs), subnormals and huge values drawn often.
priorities = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, 5e-324, 1e-300, 1e300, 3.5]),
    st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False),
)


def new_heap(cap):
    return np.zeros((cap, 2), dtype=np.int64), np.full(cap, -1, dtype=np.int32)


def heap_entries(heap, n):
    """``[(key, tick, slot)]`` in heap order."""
    keys = np.ascontiguousarray(heap[:n, 0]).view(np.float64)
    return [(float(keys[p]), int(heap[p, 1] >> 31), int(heap[p, 1] & MASK)) for p in range(n)]


def assert_heap(heap, spos, n, model):
    """Heap order, position table, and the (slot -> (key, tick)) content of ``model``."""
    assert RK.heap_check(heap, spos, n) == (0, -1)
    ents = heap_entries(heap, n)
    for p in range(1, n):
        kp, tp, _ = ents[p]
        kq, tq, _ = ents[(p - 1) // 2]
        assert (kq, tq) > (kp, tp)
    assert {s: (k, t) for k, t, s in ents} == model
    for p, (_, _, s) in enumerate(ents):
        assert spos[s] == p
    assert int(np.count_nonzero(spos >= 0)) == n
    # -0.0 is stored as +0.0: one bit pattern for zero.
    assert not np.any(heap[:n, 0] < 0)


def apply_model(model, tick, ops):
    """The reference: ``ops`` of ("set", slot, value) / ("remove", slot)."""
    for op in ops:
        if op[0] == "set":
            model[op[1]] = (float(op[2]) + 0.0, tick)
            tick += 1
        else:
            model.pop(op[1], None)
    return tick


ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 23), priorities),
        st.tuples(st.just("remove"), st.integers(0, 23)),
    ),
    max_size=80,
)


@SETTINGS
@given(ops=ops_strategy, sort_at=st.integers(0, 80))
def test_heap_ops_match_model(ops, sort_at):
    cap = 24
    heap, spos = new_heap(cap)
    n, tick = 0, 1
    model = {}
    for i, op in enumerate(ops):
        if i == sort_at:
            tick = RS.heap_sort(heap, spos, n)
            # Sorting renumbers the ticks n - p and keeps the order.
            order = sorted(model, key=lambda s: model[s], reverse=True)
            model = {s: (model[s][0], n - p) for p, s in enumerate(order)}
            assert tick == n + 1
            assert_heap(heap, spos, n, model)
        if op[0] == "set":
            n, tick2 = RK.heap_set(heap, spos, n, np.array([op[1]], dtype=np.int64),
                                   np.array([op[2]], dtype=np.float64), tick)
            assert tick2 == tick + 1
        else:
            n = RK.heap_remove(heap, spos, n, np.array([op[1]], dtype=np.int64))
            tick2 = tick
        apply_model(model, tick, [op])
        tick = tick2
        assert n == len(model)
        assert_heap(heap, spos, n, model)


def _run_tied(ops, cap):
    """Apply ``ops`` one at a time, the heap checked against the model after each."""
    heap, spos = new_heap(cap)
    n, tick, model = 0, 1, {}
    for op in ops:
        if op[0] == "set":
            n, tick2 = RK.heap_set(heap, spos, n, np.array([op[1]], dtype=np.int64),
                                   np.array([op[2]], dtype=np.float64), tick)
        else:
            n, tick2 = RK.heap_remove(heap, spos, n, np.array([op[1]], dtype=np.int64)), tick
        apply_model(model, tick, [op])
        tick = tick2
        assert n == len(model)
        assert_heap(heap, spos, n, model)


tied_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 15), st.sampled_from([1.0, 2.0])),
        st.tuples(st.just("remove"), st.integers(0, 15)),
    ),
    max_size=80,
)


@SETTINGS
@given(ops=tied_ops)
def test_heap_with_tied_keys_after_every_remove(ops):
    """Keys in {1, 2}: nearly every comparison is a tie that the tick decides,
    also where a removal moves the last entry into the hole."""
    _run_tied(ops, 16)


def test_heap_with_tied_keys_after_every_remove_seeded_sweep():
    """The same, 600 random sequences without shrinking: a sift that ignores the
    tick on equal keys breaks the heap in a good share of them."""
    rng = np.random.default_rng(23)
    for _ in range(600):
        ops = []
        for _ in range(60):
            slot = int(rng.integers(0, 16))
            ops.append(("set", slot, float(rng.integers(1, 3))) if rng.random() < 0.6 else ("remove", slot))
        _run_tied(ops, 16)


@SETTINGS
@given(slots=st.lists(st.integers(0, 15), max_size=40), data=st.data())
def test_heap_set_batch_last_duplicate_wins(slots, data):
    vals = data.draw(st.lists(priorities, min_size=len(slots), max_size=len(slots)))
    heap, spos = new_heap(16)
    n, tick = RK.heap_set(heap, spos, 0, np.array(slots, dtype=np.int64),
                          np.array(vals, dtype=np.float64), 7)
    model = {}
    t = 7
    for s, v in zip(slots, vals):
        model[s] = (v + 0.0, t)
        t += 1
    assert tick == t and n == len(model)
    assert_heap(heap, spos, n, model)
    # The most recent write of the largest key is at the root (rank 1).
    if n:
        assert heap_entries(heap, n)[0][2] == max(model, key=lambda s: model[s])


def _sorted_run(values, ticks):
    """Run heap_sort on entries given directly (slots 0..n-1) and check it
    against Python's sort by (key, tick) descending."""
    n = len(values)
    heap, spos = new_heap(max(n, 1))
    heap[:n, 0] = np.asarray(values, dtype=np.float64).view(np.int64)
    heap[:n, 1] = (np.asarray(ticks, dtype=np.int64) << 31) | np.arange(n)
    spos[:n] = np.arange(n)
    want = sorted(range(n), key=lambda i: (values[i], ticks[i]), reverse=True)
    assert RS.heap_sort(heap, spos, n) == n + 1
    got = heap_entries(heap, n)
    assert [s for _, _, s in got] == want
    assert [t for _, t, _ in got] == list(range(n, 0, -1))
    assert [k for k, _, _ in got] == [values[i] for i in want]
    assert RK.heap_check(heap, spos, n) == (0, -1)


@SETTINGS
@given(values=st.lists(priorities.map(lambda v: v + 0.0), max_size=200), data=st.data())
def test_heap_sort_matches_sorted(values, data):
    ticks = data.draw(st.permutations(range(1, len(values) + 1)))
    _sorted_run(values, list(ticks))


@pytest.mark.parametrize("case", ["uniform", "lognormal", "ties", "few", "narrow", "zeros", "mid"])
def test_heap_sort_every_path(case):
    """Sizes and spreads that take each path: insertion sort, LSD buckets,
    and the second MSD pass of a large bucket whose keys still vary."""
    rng = np.random.default_rng(3)
    n = {"mid": 3000}.get(case, 40000)
    values = {
        "uniform": rng.random(n),
        "lognormal": rng.lognormal(0, 3, n),
        "ties": np.ones(n),
        "few": rng.integers(0, 4, n).astype(np.float64),
        "narrow": 1.0 + rng.random(n) * 1e-9,  # one exponent, one MSD bucket
        "zeros": np.where(rng.random(n) < 0.5, 0.0, rng.random(n)),
        "mid": rng.integers(0, 200, n).astype(np.float64),
    }[case]
    ticks = rng.permutation(np.arange(1, n + 1) * 3)
    heap, spos = new_heap(n)
    heap[:, 0] = values.view(np.int64)
    heap[:, 1] = (ticks << 31) | np.arange(n)
    spos[:] = np.arange(n)
    order = np.lexsort((-ticks, -values))
    assert RS.heap_sort(heap, spos, n) == n + 1
    assert np.array_equal(heap[:, 1] & MASK, order)
    assert np.array_equal(heap[:, 1] >> 31, np.arange(n, 0, -1))
    assert RK.heap_check(heap, spos, n) == (0, -1)


# -- update -------------------------------------------------------------------------
def _update_setup(cap=12):
    heap, spos = new_heap(cap)
    status = np.array([1, 1, 1, 2, 3, 0, 1, 1, 1, 1, 1, 1][:cap], dtype=np.uint8)
    live = np.flatnonzero(status == 1)
    n, tick = RK.heap_set(heap, spos, 0, live.astype(np.int64), np.arange(live.size, dtype=np.float64), 1)
    gid = np.arange(cap, dtype=np.int64) + 100
    pending = np.zeros(cap)
    return heap, spos, n, tick, status, gid, pending


@pytest.mark.parametrize("idx,p,code,pos", [
    ([0, 1], [1.0, np.nan], 1, 1),
    ([0, 1], [-1.0, 2.0], 1, 0),
    ([0, 1], [1.0, np.inf], 1, 1),
    ([0, 12], [1.0, 2.0], 2, 1),
    ([-1], [1.0], 2, 0),
    ([6, 5], [1.0, 1.0], 3, 1),
])
def test_rank_update_refuses_and_changes_nothing(idx, p, code, pos):
    heap, spos, n, tick, status, gid, pending = _update_setup()
    before = (heap.copy(), spos.copy(), pending.copy())
    idx = np.array(idx, dtype=np.int64)
    got = RK.rank_update(heap, spos, n, tick, idx, np.array(p), gid[np.maximum(idx, 0) % 12], True,
                         gid, status, pending, np.inf)
    assert got[0] == code and got[1] == pos and got[3] == n and got[4] == tick
    assert np.array_equal(before[0], heap) and np.array_equal(before[1], spos)
    assert np.array_equal(before[2], pending)


@SETTINGS
@given(rows=st.lists(st.tuples(st.integers(0, 11), priorities.map(lambda v: v + 0.0),
                               st.booleans()), max_size=30),
       maxp=st.sampled_from([np.inf, 3.0, 0.5]), use_stamps=st.booleans())
def test_rank_update_routes_like_reference(rows, maxp, use_stamps):
    heap, spos, n, tick, status, gid, pending = _update_setup()
    idx = np.array([r[0] for r in rows], dtype=np.int64)
    p = np.array([r[1] for r in rows], dtype=np.float64)
    stamps = np.array([gid[r[0]] + (0 if r[2] else 1) for r in rows], dtype=np.int64)
    model = {s: (k, t) for k, t, s in heap_entries(heap, n)}
    want_pending = pending.copy()
    t = tick
    top = 0.0
    code = 3 if any(status[i] == 0 for i in idx) else 0
    for i, v, fresh in rows:
        if code or (use_stamps and not fresh):
            continue
        key = min(v, maxp)
        if status[i] == 1:
            model[i] = (key, t)
            t += 1
            top = max(top, key)
        elif status[i] == 2:
            want_pending[i] = key
            top = max(top, key)
    got = RK.rank_update(heap, spos, n, tick, idx, p, stamps, use_stamps, gid, status, pending, maxp)
    assert got[0] == code
    if code == 0:
        assert got[2] == top and got[4] == t
        assert_heap(heap, spos, got[3], model)
        assert np.array_equal(pending, want_pending)


# -- checks -------------------------------------------------------------------------
@pytest.mark.parametrize("damage,code", [
    (lambda h, s: h.__setitem__((5, 0), h[0, 0] + 1), 1),           # a child above its root
    (lambda h, s: s.__setitem__(3, 4), 2),                          # positions swapped in spos
    (lambda h, s: s.__setitem__(9, 0), 2),                          # a slot outside the heap
    (lambda h, s: h.__setitem__((7, 0), np.array(np.nan).view(np.int64)), 4),
    (lambda h, s: h.__setitem__((7, 0), np.array(-0.0).view(np.int64)), 4),
    (lambda h, s: h.__setitem__((7, 1), h[7, 1] & MASK), 5),         # tick 0
])
def test_heap_check_finds_damage(damage, code):
    heap, spos = new_heap(10)
    n, _ = RK.heap_set(heap, spos, 0, np.arange(8, dtype=np.int64), np.arange(8.0), 1)
    assert RK.heap_check(heap, spos, n) == (0, -1)
    damage(heap, spos)
    assert RK.heap_check(heap, spos, n)[0] == code


# -- the law ------------------------------------------------------------------------
alphas = st.one_of(st.sampled_from([0.0, 0.4, 0.6, 0.7, 1.0, 1.0 - 1e-9, 1.5, 3.0]),
                   st.floats(0.0, 3.0))


@SETTINGS
@given(alpha=alphas, m=st.one_of(st.integers(0, 70), st.integers(70, 30000)))
def test_cum_weight_matches_fsum(alpha, m):
    table = LAW.rank_table(alpha)
    want = math.fsum(float(r) ** -alpha for r in range(1, m + 1))
    got = LAW.cum_weight(m, alpha, table)
    # Exact summation up to R0, then Euler-Maclaurin: rounding-level error.
    assert abs(got - want) <= 1e-13 * max(want, 1.0)


def _slow_rank(t, n, alpha, table):
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if LAW.cum_weight(mid, alpha, table) > t:
            hi = mid
        else:
            lo = mid + 1
    return lo


@SETTINGS
@given(alpha=alphas, n=st.one_of(st.integers(1, 200), st.integers(1, 10**9)),
       u=st.floats(0.0, 1.0, exclude_max=True), m=st.integers(0, 10**9), nudge=st.sampled_from([-1, 0, 1]))
def test_rank_of_matches_bisection(alpha, n, u, m, nudge):
    table = LAW.rank_table(alpha)
    total = LAW.cum_weight(n, alpha, table)
    # A uniform point, and a point on (or one float beside) a rank boundary.
    b = LAW.cum_weight(m % n, alpha, table)
    b = {0: b, -1: np.nextafter(b, -np.inf), 1: np.nextafter(b, np.inf)}[nudge]
    for t in (u * total, b):
        if 0 <= t < total:
            r = LAW.rank_of(t, n, alpha, table)
            assert 1 <= r <= n
            assert r == _slow_rank(t, n, alpha, table)


@SETTINGS
@given(alpha=alphas, beta=st.floats(0.0, 1.0), n=st.integers(1, 5000), k=st.integers(1, 64),
       stratified=st.booleans(), batch_norm=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_draw_ranks_probabilities_and_weights(alpha, beta, n, k, stratified, batch_norm, seed):
    table = LAW.rank_table(alpha)
    u = np.random.default_rng(seed).random(k)
    ranks, prob, w = LAW.draw_ranks(n, alpha, beta, table, u, stratified, batch_norm)
    H = math.fsum(float(r) ** -alpha for r in range(1, n + 1))
    for b in range(k):
        t = ((b + u[b]) / k if stratified else u[b]) * LAW.cum_weight(n, alpha, table)
        assert ranks[b] == _slow_rank(t, n, alpha, table)
    assert np.allclose(prob, ranks.astype(float) ** -alpha / H, rtol=1e-12, atol=0)
    # (N P)**-beta over the largest possible weight (the last rank's) or the batch's largest.
    raw = (n * prob) ** -beta
    ref = (n * (float(n) ** -alpha / H)) ** -beta if not batch_norm else raw.max()
    assert np.allclose(w, raw / ref, rtol=1e-5)
    assert w.dtype == np.float32 and np.all(w <= 1.0 + 1e-6)
