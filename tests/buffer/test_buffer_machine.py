"""PrioritizedReplayBuffer (memory storage, n_step=1) as a Hypothesis state
machine against a plain Python model: a dict slot -> transition and a list of
leaf values.

Every transition carries its global number ``g`` in its data, so a sampled
row says by itself which transition it is.
"""

import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

import bigper

FIELDS = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
priorities = st.one_of(st.just(0.0), st.floats(0.0, 100.0), st.sampled_from([1e-8, 1.0, 3.0, 1e6]))


def transition(g):
    """The data of the g-th transition ever added."""
    return {
        "obs": np.array([g, -g], dtype=np.float32),
        "action": np.int64(1000 + g),
        "reward": np.float32(g * 0.5),
        "next_obs": np.array([g + 0.25, -g - 0.25], dtype=np.float32),
        "terminated": bool(g % 3 == 0),
        "truncated": bool(g % 5 == 1),
    }


def columns(gs):
    """What extend takes for the transitions numbered ``gs``."""
    spec = dict(FIELDS, next_obs=((2,), np.float32), terminated=((), bool), truncated=((), bool))
    rows = [transition(g) for g in gs]
    return {k: np.array([r[k] for r in rows], dtype=dt).reshape((len(rows),) + shape)
            for k, (shape, dt) in spec.items()}


class BufferMachine(RuleBasedStateMachine):
    batches = Bundle("batches")

    @initialize(capacity=st.integers(1, 7), alpha=st.sampled_from([0.0, 0.6, 1.0]),
                eps=st.sampled_from([0.0, 1e-6, 0.5]), max_priority=st.sampled_from([None, 2.0]),
                weight_norm=st.sampled_from(["global", "batch"]), seed=st.integers(0, 2**32 - 1),
                beta=st.sampled_from([0.4, "linear"]))
    def start(self, capacity, alpha, eps, max_priority, weight_norm, seed, beta):
        self.schedule = bigper.LinearSchedule(0.2, 1.0, 5) if beta == "linear" else None
        self.buf = bigper.PrioritizedReplayBuffer(
            capacity, FIELDS, alpha=alpha, eps=eps, max_priority=max_priority,
            beta=self.schedule or beta, weight_norm=weight_norm, seed=seed)
        self.c, self.alpha, self.eps = capacity, alpha, eps
        self.maxp = math.inf if max_priority is None else max_priority
        self.const_beta = beta
        self.norm = weight_norm
        # the model
        self.data = {}                 # slot -> transition dict
        self.gid = [-1] * capacity     # slot -> global number of what it holds
        self.leaves = [0.0] * capacity
        self.count = 0
        self.max_leaf = 1.0
        self.samples = 0

    def leaf(self, p):
        return (min(p, self.maxp) + self.eps) ** self.alpha

    def _put(self, g, leaf):
        s = g % self.c
        self.data[s] = transition(g)
        self.gid[s] = g
        self.leaves[s] = leaf

    # -- writing ---------------------------------------------------------------
    @rule(p=st.none() | priorities)
    def add(self, p):
        g = self.count
        if p is None:
            self.buf.add(**transition(g))
            self._put(g, self.max_leaf)
        else:
            self.buf.add(**transition(g), priorities=p)
            leaf = self.leaf(p)
            self._put(g, leaf)
            self.max_leaf = max(self.max_leaf, leaf)
        self.count += 1

    @rule(data=st.data(), m=st.integers(0, 16), with_p=st.booleans())
    def extend(self, data, m, with_p):
        cols = columns(range(self.count, self.count + m))
        if with_p:
            ps = data.draw(st.lists(priorities, min_size=m, max_size=m))
            self.buf.extend(cols, priorities=np.array(ps, dtype=np.float64))
        else:
            ps = [None] * m
            self.buf.extend(cols)
        # only the newest `capacity` rows of one call are ever stored
        for i, p in enumerate(ps):
            if m - i > self.c:
                continue
            if p is None:
                self._put(self.count + i, self.max_leaf)
            else:
                self._put(self.count + i, self.leaf(p))
        if with_p:  # every priority given counts, also those of rows overwritten within the call
            self.max_leaf = max([self.max_leaf] + [self.leaf(p) for p in ps])
        self.count += m

    # -- priorities ------------------------------------------------------------
    @rule(data=st.data())
    def update_by_indices(self, data):
        written = sorted(self.data)
        if not written:
            return
        idx = data.draw(st.lists(st.sampled_from(written), min_size=1, max_size=10))
        ps = data.draw(st.lists(priorities, min_size=len(idx), max_size=len(idx)))
        self.buf.update_priorities(np.array(idx, dtype=np.int64), np.array(ps))
        for s, p in zip(idx, ps):  # the last of duplicates wins
            self.leaves[s] = self.leaf(p)
        # Only values that became leaves count: a duplicate's losing value does not.
        self.max_leaf = max([self.max_leaf] + [self.leaves[s] for s in idx])

    @rule(sampled=batches, data=st.data())
    def update_by_batch(self, sampled, data):
        batch, gids_then = sampled
        ps = data.draw(st.lists(priorities, min_size=batch.size, max_size=batch.size))
        as_column = data.draw(st.booleans())
        p = np.array(ps).reshape(-1, 1) if as_column else np.array(ps)
        self.buf.update_priorities(batch, p)
        kept = []
        for s, g, pr in zip(batch.indices, gids_then, ps):
            if self.gid[s] != g:  # overwritten since it was sampled: skipped, not a leaf
                continue
            self.leaves[s] = self.leaf(pr)
            kept.append(s)
        # Only values that became leaves count: a duplicate's losing value does not.
        self.max_leaf = max([self.max_leaf] + [self.leaves[s] for s in kept])

    # -- sampling --------------------------------------------------------------
    @rule(target=batches, n=st.integers(1, 9), stratified=st.booleans(),
          beta=st.none() | st.sampled_from([0.0, 0.7, 1.0]))
    def sample(self, n, stratified, beta):
        total = math.fsum(self.leaves)
        if total == 0:
            state = self.buf._draws.rng.bit_generator.state
            with pytest.raises(ValueError):
                self.buf.sample(n, stratified=stratified, beta=beta)
            assert self.buf._draws.rng.bit_generator.state == state
            return multiple()
        batch = self.buf.sample(n, stratified=stratified, beta=beta)
        if beta is None:
            beta = self.schedule(self.samples) if self.schedule else self.const_beta
        self.samples += 1
        idx = batch.indices
        assert idx.dtype == np.int64 and idx.shape == (n,)
        assert batch.weights.dtype == np.float32 and batch.probabilities.dtype == np.float64
        leaves = np.array(self.leaves)
        for row, s in enumerate(idx):
            assert s in self.data, f"sampled slot {s} was never written"
            assert leaves[s] > 0, f"sampled slot {s} has a zero leaf"
            want = self.data[s]
            for k, v in want.items():
                np.testing.assert_array_equal(batch[k][row], v, err_msg=f"{k} of slot {s}")
            assert batch["discount"][row] == (0.0 if want["terminated"] else np.float32(0.99))
        np.testing.assert_allclose(batch.probabilities, leaves[idx] / total, rtol=1e-12)
        if stratified:  # row b's draw lies in the b-th of n equal slices of the total
            cum = np.cumsum(leaves)
            lo, hi = np.arange(n) * total / n, np.arange(1, n + 1) * total / n
            tol = 1e-9 * total
            assert np.all(cum[idx] - leaves[idx] <= hi + tol) and np.all(cum[idx] >= lo - tol)
        # w = (N P(i))**-beta / max w = (P(i) / P_min)**-beta, and P(i) / P_min is
        # leaf_i / leaf_min exactly: dividing by the total first could underflow
        # a denormal leaf's P to 0 and drop it from the min.
        top = leaves[idx].min() if self.norm == "batch" else leaves[leaves > 0].min()
        with np.errstate(over="ignore", under="ignore", divide="ignore"):
            want = ((leaves[idx] / top) ** -beta)
        want = np.maximum(want, np.finfo(np.float32).tiny).astype(np.float32)  # (never 0 or subnormal)
        np.testing.assert_allclose(batch.weights, want, rtol=1e-5, atol=0)
        return batch, [self.gid[s] for s in idx]

    # -- invariants ------------------------------------------------------------
    @invariant()
    def matches_model(self):
        assert len(self.buf) == min(self.count, self.c)
        assert self.buf.capacity == self.c
        assert math.isclose(self.buf.total_priority, math.fsum(self.leaves), rel_tol=1e-12, abs_tol=0)
        meta, arrays = self.buf.state_dict()
        np.testing.assert_allclose(arrays["leaves"], self.leaves, rtol=1e-14, atol=0)
        assert self.buf.prioritization.tree.check() == []
        # the i-th transition ever added sits at slot i % capacity (the end flags
        # are checked through sample(); the storage holds the data fields)
        np.testing.assert_array_equal(arrays["gid"], self.gid)
        for g in range(max(0, self.count - self.c), self.count):
            s = g % self.c
            for k in ("obs", "action", "reward", "next_obs"):
                got = self.buf.storage.read(k, np.array([s]))[0]
                np.testing.assert_array_equal(got, transition(g)[k], err_msg=f"{k} of transition {g}")


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
