"""RankPrioritizer: the strategy behind ``prioritization="rank"``.

A Hypothesis state machine checks the heap invariants and the documented
bounds after every operation, against a plain Python model; exact resume
through ``state``/``restore``; every refusal leaves the strategy unchanged.
"""

import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bigper.errors import CorruptSnapshotError, InvalidArgumentError, InvalidIndexError
from bigper.prioritization import make
from bigper.prioritization import _rank_kernels as RK
from bigper.prioritization.rank import RankPrioritizer

CAP = 16


def new(cap=CAP, alpha=0.6, **kw):
    return RankPrioritizer(cap, alpha=alpha, eps=1e-6, max_priority=kw.pop("max_priority", math.inf),
                           weight_norm=kw.pop("weight_norm", "global"), **kw)


def fingerprint(r):
    return (r._heap.tobytes(), r._spos.tobytes(), r.n, r.tick, r.writes, r.sort_every)


def ring(cap=CAP):
    """The buffer's bookkeeping for ``cap`` live slots."""
    return (np.arange(cap, dtype=np.int64), np.ones(cap, dtype=np.uint8), np.zeros(cap))


def depth(p):
    return int(p + 1).bit_length() - 1


def test_make_builds_rank():
    r = make("rank", 10, alpha=0.5, eps=0.1, max_priority=2.0, weight_norm="batch")
    assert isinstance(r, RankPrioritizer) and r.kind == "rank" and r.batch_norm
    assert r.sort_every == 10 and not r.sampleable and r.total == 0.0


@pytest.mark.parametrize("kw", [
    {"cap": 2**31}, {"cap": 0}, {"alpha": -0.1}, {"alpha": math.nan}, {"alpha": math.inf},
    {"sort_every": 0}, {"sort_every": 2.5}, {"sort_every": True}, {"sort_every": "10"},
])
def test_construction_refusals(kw):
    with pytest.raises(InvalidArgumentError):
        new(**kw)


@pytest.mark.parametrize("alpha", [0.0, 1e-12, 1.0 - 1e-9, 1.0, 5.0, 50.0, 400.0])
def test_extreme_alphas_sample_valid_draws(alpha):
    r = new(5000, alpha=alpha)
    r.insert(np.arange(5000, dtype=np.int64), np.random.default_rng(0).random(5000))
    r.sort()
    for u in (np.random.default_rng(1).random(64), np.full(64, 1 - 2**-53), np.zeros(64)):
        for stratified in (True, False):
            idx, p, w = r.sample(u, stratified=stratified, beta=1.0)
            assert np.all((idx >= 0) & (idx < 5000))
            assert np.all(np.isfinite(p) & (p >= 0) & (p <= 1))
            assert np.all(np.isfinite(w) & (w >= 0) & (w <= 1))
            assert np.array_equal(p, r.probabilities(idx))


def test_keys_clip_and_ignore_eps():
    r = new(max_priority=2.0)
    p = np.array([0.0, 1.5, 2.0, 7.0])
    assert np.array_equal(r.keys(p), [0.0, 1.5, 2.0, 2.0])


def test_new_transition_takes_rank_one_and_ties_go_by_recency():
    r = new()
    r.insert(np.arange(8, dtype=np.int64), np.array([3.0, 1.0, 3.0, 2.0, 0.0, 3.0, 0.5, 1.0]))
    r.sort()
    # Ties by recency: among the three 3.0, the last written (slot 5) ranks first.
    assert list(r.heap_slots()[:3]) == [5, 2, 0]
    # A new transition with the largest priority seen enters at rank 1.
    r.remove(np.array([1], dtype=np.int64))
    r.insert(np.array([1], dtype=np.int64), np.array([3.0]))
    assert r.positions(np.array([1]))[0] == 0
    assert r.check(np.ones(CAP, np.uint8) * (np.arange(CAP) < 8)) == []


def test_reads():
    r = new(alpha=1.0)
    r.insert(np.array([4, 2, 9], dtype=np.int64), np.array([1.0, 5.0, 0.0]))
    r.sort()
    assert r.total == pytest.approx(1 + 1 / 2 + 1 / 3)
    assert np.array_equal(r.key_at(np.array([4, 2, 9, 0])), [1.0, 5.0, 0.0, 0.0])
    assert r.min_key == 0.0
    p = r.probabilities(np.array([2, 4, 9, 0]))
    assert np.allclose(p, np.array([1, 1 / 2, 1 / 3, 0]) / r.total)
    assert list(r.exact_ranks()) == [1, 2, 3]


def test_sort_runs_at_the_first_sample_after_sort_every_writes():
    r = new(sort_every=5)
    gid, status, pending = ring()
    r.insert(np.arange(4, dtype=np.int64), np.array([1.0, 2.0, 3.0, 4.0]))
    assert r.writes == 4
    r.sample(np.array([0.5]), stratified=True, beta=0.4)
    assert r.writes == 4  # not yet
    r.update(np.array([0], dtype=np.int64), np.array([9.0]), gid[:1], True, gid, status, pending)
    assert r.writes == 5
    r.remove(np.array([3, 3, 12], dtype=np.int64))  # one removal counts once; absent slots not
    assert r.writes == 6
    r.sample(np.array([0.5]), stratified=True, beta=0.4)
    assert r.writes == 0 and r.tick == r.n + 1
    assert list(r.exact_ranks()) == [1, 2, 3]


@pytest.mark.parametrize("every", [1, 2, 5, 16])
def test_the_sort_runs_at_exactly_sort_every_writes_and_not_one_before(every):
    """The boundary itself: ``sort_every - 1`` writes leave the heap as it is,
    exactly ``sort_every`` writes sort it at the next sample."""
    r = new(CAP, sort_every=every)
    keys = np.random.default_rng(every).permutation(CAP).astype(np.float64) + 1.0
    r.insert(np.arange(CAP, dtype=np.int64), keys)  # CAP writes: sorts at the first sample
    r.sample(np.array([0.5]), stratified=True, beta=0.4)
    assert r.writes == 0
    gid, status, pending = ring()
    for w in range(1, every + 1):
        slot = np.array([w % CAP], dtype=np.int64)
        r.update(slot, np.array([100.0 + w]), gid[slot], True, gid, status, pending)
        assert r.writes == w
        before = fingerprint(r)
        r.sample(np.array([0.5]), stratified=True, beta=0.4)
        if w < every:
            assert fingerprint(r) == before, f"sorted after {w} of {every} writes"
        else:
            assert r.writes == 0, f"no sort after exactly sort_every={every} writes"
            assert np.array_equal(r.exact_ranks(), np.arange(1, CAP + 1))  # positions are ranks


def _age(r):
    """Shift every tick up to just below the limit, as after ~4e9 writes."""
    r._heap[:r.n, 1] += (RK.TICK_LIMIT - 2 - r.tick) << 31
    r.tick = RK.TICK_LIMIT - 2
    assert r.check((r._spos >= 0).astype(np.uint8)) == []


def test_update_near_the_tick_limit_sorts_first():
    r = new()
    gid, status, pending = ring()
    r.insert(np.arange(CAP, dtype=np.int64), np.arange(CAP, dtype=np.float64) % 5)
    _age(r)
    r.update(np.array([3, 4, 5], dtype=np.int64), np.array([9.0, 9.0, 0.0]), gid[3:6], True, gid,
             status, pending)
    assert r.tick == CAP + 1 + 3 and r.check(status) == []
    assert r.heap_slots()[0] == 4  # equal keys: the later write first
    r.sort()
    assert list(r.heap_slots()[:2]) == [4, 3]


def test_ticks_never_reach_the_limit():
    r = new()
    r.insert(np.arange(6, dtype=np.int64), np.array([1.0, 1.0, 2.0, 1.0, 0.0, 2.0]))
    r.tick = RK.TICK_LIMIT - 3  # as after ~4e9 writes without a sample
    r._heap[:6, 1] += (RK.TICK_LIMIT - 10) << 31
    r.sort()
    order = list(r.heap_slots())
    r.tick = RK.TICK_LIMIT - 3
    r._heap[:6, 1] += (RK.TICK_LIMIT - 10) << 31
    r.insert(np.array([7, 8, 9], dtype=np.int64), np.array([1.0, 1.0, 1.0]))  # sorts first
    assert r.tick == 6 + 1 + 3
    assert r.check(np.isin(np.arange(CAP), [0, 1, 2, 3, 4, 5, 7, 8, 9]).astype(np.uint8)) == []
    # The renumbering kept the order of the entries that were there.
    r.sort()
    assert [s for s in r.heap_slots() if s < 6] == order


@pytest.mark.parametrize("idx,p,err", [
    ([0, 1], [1.0, math.nan], InvalidArgumentError),
    ([0, 1], [1.0, -2.0], InvalidArgumentError),
    ([0, CAP], [1.0, 1.0], InvalidIndexError),
    ([0, 5], [1.0, 1.0], InvalidIndexError),  # never written
])
@pytest.mark.parametrize("near_limit", [False, True])
def test_update_refusals_change_nothing(idx, p, err, near_limit):
    r = new()
    gid, status, pending = ring()
    status[5] = 0
    r.insert(np.flatnonzero(status == 1).astype(np.int64), np.arange(CAP - 1, dtype=np.float64))
    if near_limit:  # an update that passed would re-sort first; a refused one must not
        _age(r)
    before = fingerprint(r), pending.copy()
    idx = np.array(idx, dtype=np.int64)
    with pytest.raises(err):
        r.update(idx, np.array(p), gid[idx % CAP], True, gid, status, pending)
    assert fingerprint(r) == before[0] and np.array_equal(pending, before[1])


# -- state ----------------------------------------------------------------------------
def _filled(seed=0, cap=CAP):
    rng = np.random.default_rng(seed)
    r = new(cap, sort_every=7)
    gid, status, pending = ring(cap)
    r.insert(np.arange(cap, dtype=np.int64), rng.integers(0, 4, cap).astype(np.float64))
    return r, (gid, status, pending), rng


def _run(r, ring_, rng, steps):
    gid, status, pending = ring_
    out = []
    for _ in range(steps):
        idx, prob, w = r.sample(rng.random(4), stratified=True, beta=0.5)
        r.update(idx, rng.integers(0, 5, 4).astype(np.float64), gid[idx], True, gid, status, pending)
        out.append((idx.tolist(), prob.tolist(), w.tolist()))
    return out


def test_exact_resume():
    a, ring_a, rng_a = _filled()
    _run(a, ring_a, rng_a, 5)
    meta, arrays = a.state()
    b = new(CAP, sort_every=99)
    b.restore(dict(meta), {k: v.copy() for k, v in arrays.items()}, ring_a[1])
    assert b.sort_every == 7 and fingerprint(b) == fingerprint(a)
    assert _run(a, ring_a, np.random.default_rng(5), 20) == _run(b, ring(), np.random.default_rng(5), 20)
    assert fingerprint(b) == fingerprint(a)


def _corruptions():
    def word(p, value):
        return lambda m, a: a["rank_heap"].__setitem__((p, 1), value)

    def key(p, value):
        return lambda m, a: a["rank_heap"].__setitem__((p, 0), np.array(value).view(np.int64))

    return {
        "meta keys missing": lambda m, a: m.clear(),
        "n too large": lambda m, a: m.__setitem__("n", CAP + 1),
        "n a bool": lambda m, a: m.__setitem__("n", True),
        "n a float": lambda m, a: m.__setitem__("n", 16.0),
        "tick zero": lambda m, a: m.__setitem__("tick", 0),
        "tick below a stored tick": lambda m, a: m.__setitem__("tick", 3),
        "sort_every zero": lambda m, a: m.__setitem__("sort_every", 0),
        "writes negative": lambda m, a: m.__setitem__("writes", -1),
        "heap missing": lambda m, a: a.pop("rank_heap"),
        "heap wrong dtype": lambda m, a: a.__setitem__("rank_heap", a["rank_heap"].astype(np.float64)),
        "heap wrong shape": lambda m, a: a.__setitem__("rank_heap", a["rank_heap"][:-1]),
        "negative word": word(3, -5),
        "slot twice": lambda m, a: a["rank_heap"].__setitem__(
            (4, 1), (a["rank_heap"][4, 1] >> 31 << 31) | (a["rank_heap"][2, 1] & RK.SLOT_MASK)),
        "tick zero in heap": lambda m, a: a["rank_heap"].__setitem__(
            (5, 1), a["rank_heap"][5, 1] & RK.SLOT_MASK),
        "ticks shared": lambda m, a: a["rank_heap"].__setitem__(
            (9, 1), (a["rank_heap"][1, 1] >> 31 << 31) | (a["rank_heap"][9, 1] & RK.SLOT_MASK)),
        "order broken": lambda m, a: a["rank_heap"].__setitem__(slice(None), a["rank_heap"][::-1].copy()),
        "nan key": key(6, math.nan),
        "negative key": key(6, -1.0),
        "minus zero key": key(CAP - 1, -0.0),
    }


@pytest.mark.parametrize("name", sorted(_corruptions()))
def test_restore_refuses_corrupt_state_and_changes_nothing(name):
    src, ring_, rng = _filled(1)
    _run(src, ring_, rng, 3)
    meta, arrays = src.state()
    meta = dict(meta)
    arrays = {k: v.copy() for k, v in arrays.items()}
    _corruptions()[name](meta, arrays)
    dst, ring_d, rng_d = _filled(2)
    _run(dst, ring_d, rng_d, 2)
    before = fingerprint(dst)
    with pytest.raises(CorruptSnapshotError):
        dst.restore(meta, arrays, ring_[1])
    assert fingerprint(dst) == before


def test_restore_refuses_status_mismatch():
    src, ring_, _ = _filled(1)
    meta, arrays = src.state()
    dst = new(CAP)
    before = fingerprint(dst)
    status = ring_[1].copy()
    status[3] = 2  # the heap holds slot 3 but status says it waits for its window
    with pytest.raises(CorruptSnapshotError):
        dst.restore(dict(meta), {k: v.copy() for k, v in arrays.items()}, status)
    assert fingerprint(dst) == before


# -- the state machine -----------------------------------------------------------------
prio = st.one_of(st.sampled_from([0.0, 1.0, 2.0, 1e-300, 1e300]), st.floats(0, 100))


class RankMachine(RuleBasedStateMachine):
    """Random inserts, removals, updates, samples and sorts; after each: the
    heap invariants, the model's keys, and the documented bounds."""

    def __init__(self):
        super().__init__()
        self.r = new(CAP, sort_every=9)
        self.gid, self.status, self.pending = ring()
        self.status[:] = 0
        self.keys = {}            # slot -> key (the model)
        self.at_sort = {}         # slot -> heap position at the last sort
        self.touched = set()      # slots written or moved as a filler since the last sort
        self._mark_sorted()

    def _mark_sorted(self):
        self.at_sort = {int(s): p for p, s in enumerate(self.r.heap_slots())}
        self.touched = set()

    @rule(slots=st.lists(st.integers(0, CAP - 1), unique=True, max_size=5), data=st.data())
    def insert(self, slots, data):
        vals = [data.draw(prio) for _ in slots]
        self.r.insert(np.array(slots, dtype=np.int64), np.array(vals, dtype=np.float64))
        for s, v in zip(slots, vals):
            self.keys[s] = v
            self.status[s] = 1
            self.touched.add(s)

    @rule(slots=st.lists(st.integers(0, CAP - 1), max_size=4))
    def remove(self, slots):
        for s in slots:  # one at a time, to know which entry fills each hole
            hs = self.r.heap_slots()
            if s in self.keys and hs.shape[0]:
                self.touched.add(int(hs[-1]))
            self.r.remove(np.array([s], dtype=np.int64))
            self.keys.pop(s, None)
            self.status[s] = 3 if self.status[s] else 0

    @precondition(lambda self: self.keys)
    @rule(data=st.data())
    def update(self, data):
        live = sorted(self.keys)
        idx = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=5))
        vals = [data.draw(prio) for _ in idx]
        self.r.update(np.array(idx, dtype=np.int64), np.array(vals), self.gid[idx], True, self.gid,
                      self.status, self.pending)
        for s, v in zip(idx, vals):
            self.keys[s] = v
            self.touched.add(s)

    @precondition(lambda self: self.keys)
    @rule(k=st.integers(1, 6), stratified=st.booleans(), seed=st.integers(0, 1000))
    def sample(self, k, stratified, seed):
        will_sort = self.r.writes >= self.r.sort_every
        idx, prob, w = self.r.sample(np.random.default_rng(seed).random(k), stratified=stratified, beta=0.5)
        if will_sort:
            self._mark_sorted()
        assert set(idx.tolist()) <= set(self.keys)
        assert np.array_equal(prob, self.r.probabilities(idx))
        assert np.all((w > 0) & (w <= 1))

    @rule()
    def sort(self):
        self.r.sort()
        self._mark_sorted()
        self.after_sort()

    def after_sort(self):
        # Right after a sort, positions are the exact ranks: a larger priority is
        # always strictly more likely (ties: the more recent write is).
        assert np.array_equal(self.r.exact_ranks(), np.arange(1, self.r.n + 1))
        slots = np.array(sorted(self.keys), dtype=np.int64)
        p = self.r.probabilities(slots)
        k = np.array([self.keys[s] for s in slots])
        for i in range(len(slots)):
            for j in range(len(slots)):
                if k[i] > k[j]:
                    assert p[i] > p[j]

    @invariant()
    def heap_is_healthy(self):
        assert self.r.check(self.status) == []
        assert self.r.n == len(self.keys)
        slots = np.arange(CAP, dtype=np.int64)
        assert np.array_equal(self.r.key_at(slots), [self.keys.get(s, 0.0) for s in range(CAP)])

    @invariant()
    def bounds_hold(self):
        r = self.r
        pos = {int(s): p for p, s in enumerate(r.heap_slots())}
        probs = r.probabilities(np.arange(CAP, dtype=np.int64))
        for s, p in pos.items():
            # Every heap ancestor has a larger-or-equal priority and is strictly more likely.
            q = p
            while q > 0:
                q = (q - 1) // 2
                a = int(r.heap_slots()[q])
                assert self.keys[a] >= self.keys[s] and probs[a] > probs[s]
            # A transition not written (nor moved as a filler) since the last sort is
            # within `writes` heap levels of where the sort put it.
            if s not in self.touched and s in self.at_sort:
                p0 = self.at_sort[s]
                assert abs(depth(p) - depth(p0)) <= r.writes
                # hence its position (its rank as sampled) within a factor 2**(w + 1)
                assert 2.0 ** -(r.writes + 1) < (p + 1) / (p0 + 1) < 2.0 ** (r.writes + 1)


TestRankMachine = RankMachine.TestCase
TestRankMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
