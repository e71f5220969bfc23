"""A buffer with sequence items as a Hypothesis state machine over add,
sample, update (per step, with NaN in masked steps), save and load, against a
plain model: tests/_sequence_reference.py for which items live and what they
hold, and a dict of item priorities (alpha 1, eps 0: a leaf is the reduced
priority itself) with the largest-priority-seen rule for new items."""

import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import bigper
from tests import hook

from tests._sequence_reference import Ref, assert_window
from tests.core.test_sequences import build, feed

ends = st.sampled_from([0, 0, 0, 0, 1, 2])
_TMP: list[Path] = []  # the folder the examples save into (pytest's temporary directory)


@pytest.fixture(autouse=True, scope="module")
def _snapshots_under_pytest_tmp(tmp_path_factory):
    """Each example saves under pytest's temporary directory, which pytest itself removes
    in a later session, instead of a mkdtemp folder removed example by example (their ~12k
    snapshot files' unlinks took about as long as the examples themselves)."""
    _TMP.append(tmp_path_factory.mktemp("seqm"))
    yield
    _TMP.pop()


class SequenceMachine(RuleBasedStateMachine):
    @initialize(num_envs=st.integers(1, 2), length=st.integers(1, 4), burn_in=st.integers(0, 2),
                period=st.integers(1, 4), extra=st.integers(0, 6), frame_stack=st.sampled_from([None, 2]),
                eta=st.sampled_from([0.9, 0.0, 0.5]), seed=st.integers(0, 2**16))
    def start(self, num_envs, length, burn_in, period, extra, frame_stack, eta, seed):
        self.ref = Ref(0, num_envs, length, burn_in, period, frame_stack, seed=seed)
        self.ref.c = (burn_in + length) * num_envs + extra
        self.eta = eta
        self.buf = build(self.ref, self.ref.c, alpha=1.0, eps=0.0, eta=eta, seed=seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="bigper-seqm-", dir=_TMP[-1] if _TMP else None))
        self.saves = 0
        self.max_key = 1.0
        self.keys = {}  # g (start row) -> key, for items not yet gone
        self.batch = None

    def teardown(self):
        if hasattr(self, "buf"):
            self.buf.close()
            if not _TMP:  # run outside pytest: nobody else removes it
                shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the model's bookkeeping ---------------------------------------------------
    def _after_add(self, first):
        """Items that started in rows ``first ..`` enter with the largest key seen."""
        pos = self.ref.positions()
        for g in range(first, self.ref.count):
            if pos[g] >= 0 and pos[g] % self.ref.period == 0:
                self.keys[g] = self.max_key

    def _live(self):
        return {g for g, s in self.ref.items().items() if s == "live"}

    # -- rules ---------------------------------------------------------------------
    @rule(steps=st.lists(st.lists(ends, min_size=2, max_size=2), min_size=1, max_size=6),
          chunk=st.sampled_from([1, 2, 6]))
    def add(self, steps, chunk):
        first = self.ref.count
        feed(self.buf, self.ref, [s[:self.ref.k] for s in steps], chunk)
        self._after_add(first)

    @precondition(lambda self: bool(self.buf.total_priority > 0) and any(
        s == "live" and self.keys[g] > 0 for g, s in self.ref.items().items()))
    @rule(b=st.integers(1, 6))
    def sample(self, b):
        batch = self.buf.sample(b)
        live = self._live()
        if self.ref.fs:  # the model does not know frame expiry: the items the buffer still has (a subset, checked)
            has = self.buf.leaves(np.array([g % self.ref.c for g in live], dtype=np.int64)) > 0
            live = {g for g, h in zip(live, has) if h}
        total = sum(self.keys[g] for g in live)
        for i, s in enumerate(batch.indices):
            g = int(batch.generations[i])
            assert g in live and g % self.ref.c == s
            assert_window({n: v[i] for n, v in batch.data.items()}, batch.mask[i], self.ref.window(g))
            assert math.isclose(batch.probabilities[i], self.keys[g] / total, rel_tol=1e-9)
        self.batch = batch

    @precondition(lambda self: self.batch is not None)
    @rule(data=st.data())
    def update(self, data):
        b, ref = self.batch, self.ref
        n = b.size
        # No subnormal errors: at 5e-324 the model's eta * max + (1 - eta) * mean rounds to 0 where
        # the buffer's overflow-safe max - (1 - eta) * (max - mean) gives the correctly rounded 5e-324,
        # and "is the item live" would hang on the last bit of two roundings.
        td = np.array(data.draw(st.lists(st.floats(0, 10, allow_subnormal=False), min_size=n * ref.T,
                                         max_size=n * ref.T)),
                      dtype=np.float64).reshape(n, ref.T)
        td[~b.mask] = np.nan
        td[:, :ref.burn_in] = np.nan
        live = self._live()
        if ref.fs:  # the model does not know frame expiry: the items the buffer still holds live (a subset)
            items = hook.unit(self.buf).status
            assert all(items[g % ref.c] in (1, 3) for g in live)  # live, or dead with their frames
            live = {g for g in live if items[g % ref.c] == 1}
        self.buf.update_priorities(b, td)
        last = {}
        for i in range(n):
            g = int(b.generations[i])
            real = [td[i, t] for t in range(ref.burn_in, ref.T) if b.mask[i, t]]
            if g in live:  # the item still lives: the last row of a repeat wins
                last[g] = self.eta * max(real) + (1 - self.eta) * (math.fsum(real) / len(real))
        self.keys.update(last)
        self.max_key = max([self.max_key, *last.values()])
        self.batch = None

    @rule()
    def save_and_load(self):
        snap = self.buf.save(self.tmp / f"s{self.saves}")
        self.saves += 1
        self.buf.close()
        self.buf = bigper.PrioritizedReplayBuffer.load(snap, continue_episodes=True)  # the model goes on
        self.batch = None

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def live_items_and_their_priorities(self):
        if not hasattr(self, "buf"):
            return
        live = self._live()
        leaves = self.buf.leaves(np.arange(self.ref.c))
        got = set(np.flatnonzero(leaves > 0).tolist())
        want = {g % self.ref.c for g in live if self.keys[g] > 0}
        if self.ref.fs:  # frames may expire before the ring overwrites their steps
            assert got <= want
        else:
            assert got == want, (sorted(got), sorted(want))
        for g in live:
            if g % self.ref.c in got:
                assert math.isclose(leaves[g % self.ref.c], self.keys[g], rel_tol=1e-12), g
        assert math.isclose(self.buf.shard.max_leaf, self.max_key, rel_tol=1e-12)


SequenceMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_sequence_machine = SequenceMachine.TestCase
