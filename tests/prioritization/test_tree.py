"""PriorityTree against a plain list of leaves (cumsum + searchsorted), under Hypothesis.

A state machine sets leaves in batches (duplicates, zeros, bulk rebuilds,
zeroed tails) and after every step checks the invariants: each node equals
the sum of its children, the root equals ``math.fsum`` of the leaves, the min
equals the smallest non-zero leaf, and ``find`` lands where the reference says,
never on a zero leaf and never past the capacity.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from bigper.prioritization.tree import FANOUT, PriorityTree

capacities = st.one_of(
    st.sampled_from([1, 2, 3, 15, 16, 17, 255, 256, 257, 4096, 4097, 5000]),
    st.integers(1, 5000),
)
leaf_values = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-300, max_value=1e300),
    st.floats(min_value=0.0, max_value=10.0),
    st.sampled_from([1.0, 5e-324, 2.0 ** -52]),
)


def level(tree, lev, arr=None):
    arr = tree.sums if arr is None else arr
    return arr[tree.offsets[lev]:tree.offsets[lev] + tree.sizes[lev]]


def check_invariants(tree, model):
    """Everything a healthy tree holding ``model`` must satisfy."""
    n = model.shape[0]
    np.testing.assert_array_equal(tree.leaves, model)
    assert tree.check() == []
    # each node against the sum of its own children, computed here from scratch
    for lev in range(len(tree.sizes) - 1):
        child = level(tree, lev + 1)
        groups = np.concatenate([child, np.zeros((-child.shape[0]) % FANOUT)]).reshape(-1, FANOUT)
        np.testing.assert_allclose(level(tree, lev), [math.fsum(g) for g in groups], rtol=1e-13, atol=0)
        if tree.mins.shape[0]:
            if lev + 1 == len(tree.sizes) - 1:  # leaves: zero ones are not sampleable
                mchild = np.where(child > 0, child, np.inf)
            else:
                mchild = level(tree, lev + 1, tree.mins)
            mg = np.concatenate([mchild, np.full((-child.shape[0]) % FANOUT, np.inf)]).reshape(-1, FANOUT)
            np.testing.assert_array_equal(level(tree, lev, tree.mins), mg.min(axis=1))
    assert math.isclose(tree.total, math.fsum(model), rel_tol=1e-12, abs_tol=0)
    nz = model[model > 0]
    assert tree.min == (nz.min() if nz.size else math.inf)


def check_find(tree, model, rng):
    """find() against searchsorted over the cumsum of the leaves."""
    n = model.shape[0]
    total = tree.total
    if not total > 0:
        return
    cum = np.cumsum(model)
    before = cum - model
    tol = 1e-10 * total
    # strictly inside a (not vanishingly thin) leaf's interval: exactly that leaf
    wide = np.flatnonzero(model > 1e-6 * total)
    inside = before[wide] + model[wide] * rng.uniform(0.01, 0.99, wide.shape[0])
    # (with subnormal leaves, model * u can round onto the interval's edge: not inside)
    ok = (inside > before[wide]) & (inside < cum[wide])
    np.testing.assert_array_equal(tree.find(inside[ok]), wide[ok])
    # anywhere, and at the floating-point edge near the total
    edge = np.array([0.0, total, np.nextafter(total, 0), total * (1 - 2.0 ** -53),
                     total * (1 - 2.0 ** -52), total * (1 - 1e-14), total * (1 - 1e-10)])
    t = np.concatenate([edge, rng.random(64) * total])
    got = tree.find(t)
    assert got.dtype == np.int64 and got.shape == t.shape
    assert np.all((got >= 0) & (got < n)), "find returned an index outside [0, capacity)"
    assert np.all(model[got] > 0), "find returned a zero leaf"
    ok = (before[got] <= t + tol) & (np.minimum(t, total) <= cum[got] + tol)
    assert np.all(ok), (t[~ok], got[~ok])


class TreeMachine(RuleBasedStateMachine):
    @initialize(n=capacities, track_min=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def start(self, n, track_min, seed):
        self.tree = PriorityTree(n, track_min=track_min)
        self.model = np.zeros(n)
        self.rng = np.random.default_rng(seed)

    def _set(self, idx, vals):
        idx = np.asarray(idx, dtype=np.int64)
        vals = np.asarray(vals, dtype=np.float64)
        self.tree.set(idx, vals)
        for i, v in zip(idx, vals):  # the last of duplicates wins
            self.model[i] = v

    @rule(data=st.data())
    def set_few(self, data):
        """A short explicit batch; indices from a small pool, so duplicates are common."""
        n = self.model.shape[0]
        pool = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4, unique=True))
        pool += [n - 1, 0]
        pairs = data.draw(st.lists(st.tuples(st.sampled_from(pool), leaf_values), min_size=1, max_size=24))
        self._set([i for i, _ in pairs], [v for _, v in pairs])

    @rule(size=st.integers(1, 3000), zero_frac=st.sampled_from([0.0, 0.5, 1.0]),
          spread=st.sampled_from([0, 6, 20]))
    def set_many(self, size, zero_frac, spread):
        n = self.model.shape[0]
        idx = self.rng.integers(0, n, size)
        vals = 10.0 ** self.rng.uniform(-spread, 1, size) * self.rng.random(size)
        vals[self.rng.random(size) < zero_frac] = 0.0
        self._set(idx, vals)

    @rule(zero_frac=st.sampled_from([0.0, 0.3, 0.99, 1.0]))
    def set_all(self, zero_frac):
        n = self.model.shape[0]
        vals = self.rng.random(n) * 10.0 ** self.rng.integers(-5, 6)
        vals[self.rng.random(n) < zero_frac] = 0.0
        self.tree.set_all(vals)
        self.model = vals.copy()

    @rule(k=st.integers(1, 5000))
    def zero_the_tail(self, k):
        n = self.model.shape[0]
        idx = np.arange(max(0, n - k), n)
        self._set(idx, np.zeros(idx.shape[0]))

    @precondition(lambda self: self.model.shape[0] > 1)
    @rule(data=st.data(), value=st.floats(min_value=1e-300, max_value=1e300))
    def all_but_one_zero(self, data, value):
        n = self.model.shape[0]
        keep = data.draw(st.sampled_from([0, n - 1, n // 2, data.draw(st.integers(0, n - 1))]))
        vals = np.zeros(n)
        vals[keep] = value
        self._set(np.arange(n), vals)

    @invariant()
    def healthy(self):
        check_invariants(self.tree, self.model)
        check_find(self.tree, self.model, self.rng)


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=60, stateful_step_count=12, deadline=None)


@settings(max_examples=60, deadline=None)
@given(n=capacities, seed=st.integers(0, 2**32 - 1), zero_frac=st.sampled_from([0.0, 0.5, 0.99]),
       chunks=st.integers(1, 40), track_min=st.booleans())
def test_set_all_equals_individual_sets(n, seed, zero_frac, chunks, track_min):
    rng = np.random.default_rng(seed)
    vals = rng.random(n) * 10.0 ** rng.uniform(-8, 8, n)
    vals[rng.random(n) < zero_frac] = 0.0
    bulk = PriorityTree(n, track_min=track_min)
    # a used tree first: set_all replaces everything that was there
    bulk.set(rng.integers(0, n, 50).astype(np.int64), rng.random(50))
    bulk.set_all(vals)
    one = PriorityTree(n, track_min=track_min)
    for part in np.array_split(rng.permutation(n).astype(np.int64), chunks):
        one.set(part, vals[part])
    np.testing.assert_array_equal(bulk.sums, one.sums)
    np.testing.assert_array_equal(bulk.mins, one.mins)
    check_invariants(bulk, vals)


@settings(max_examples=60, deadline=None)
@given(leaves=st.lists(st.integers(0, 5), min_size=1, max_size=300).filter(lambda v: sum(v) > 0))
def test_find_exact_boundaries(leaves):
    """Integer leaves make every prefix sum exact: a target on a boundary
    belongs to the next non-zero leaf, exactly as searchsorted(side='right')."""
    model = np.array(leaves, dtype=np.float64)
    tree = PriorityTree(model.shape[0])
    tree.set_all(model)
    total = int(model.sum())
    t = np.arange(0, 2 * total) / 2.0  # every boundary and every midpoint below the total
    np.testing.assert_array_equal(tree.find(t), np.searchsorted(np.cumsum(model), t, side="right"))


@pytest.mark.parametrize("n", [1, 5, 16, 17, 257, 4097])
def test_last_leaves_zero_and_target_at_total(n):
    """The bug behind openai/baselines#171: rounding near the total must not
    walk into the empty (zero, unwritten) tail."""
    tree = PriorityTree(n)
    rng = np.random.default_rng(n)
    written = max(1, n // 3)
    vals = rng.random(written) + 0.1
    tree.set(np.arange(written, dtype=np.int64), vals)
    total = tree.total
    t = np.array([total, np.nextafter(total, 0), total * (1 - 2.0 ** -52), total * 1.5])
    got = tree.find(t)
    np.testing.assert_array_equal(got, written - 1)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity.*0"):
        PriorityTree(0)


def test_fresh_tree_is_empty():
    tree = PriorityTree(17)
    assert tree.total == 0.0 and tree.min == math.inf
    np.testing.assert_array_equal(tree.leaves, np.zeros(17))
    assert tree.check() == []


# -- the tree after a bulk update (leaves written, nodes rebuilt by the caller) -----------------
@pytest.mark.parametrize("m,cap", [(1025, 4096), (2048, 2048), (4096, 8192), (4096, 32768), (4097, 4097),
                                   (6000, 8192), (1024, 4096)])
def test_a_bulk_update_leaves_every_node_the_sum_of_its_children(m, cap):
    """Updates of more than 1,024 rows and an eighth of the slots write the
    leaves and rebuild the nodes once; sums, total and min tree must then be
    those of the new leaves (a skipped rebuild leaves stale sums behind)."""
    from bigper.prioritization.proportional import Proportional

    rng = np.random.default_rng(m + cap)
    prio = Proportional(cap, alpha=0.7, eps=1e-6, max_priority=math.inf, weight_norm="global")
    gid = np.arange(cap, dtype=np.int64)
    status = np.ones(cap, dtype=np.uint8)
    pending = np.zeros(cap)
    first = rng.random(cap) * 3
    prio.insert(gid, prio.keys(first))
    idx = rng.integers(0, cap, size=m)  # duplicates included: the last one wins
    p = rng.random(m) * 10
    prio.update(idx, p, gid[idx], False, gid, status, pending)
    want = first.copy()
    want[idx] = p  # numpy's fancy assignment keeps the last of duplicates
    keys = prio.keys(want)
    t = prio.tree
    np.testing.assert_array_equal(t.leaves, keys)
    assert t.check() == []
    assert t.total == pytest.approx(math.fsum(keys), rel=1e-12)
    assert t.min == keys.min()
    # Draws follow the new leaves: the slot holding each target.
    targets = np.sort(rng.random(64)) * t.total
    cum = np.cumsum(keys)
    np.testing.assert_array_equal(t.find(targets), np.minimum(np.searchsorted(cum, targets, side="right"), cap - 1))
