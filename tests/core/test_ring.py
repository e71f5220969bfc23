"""The ring (bigper/core/ring.py): what it records is what it restores, and a
buffer's state_dict is the ring's plus the rest."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import bigper
from bigper.core.ring import Ring
from tests import hook


@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 64), num_envs=st.integers(1, 4), n_step=st.integers(1, 3),
       count=st.integers(0, 2**40), max_leaf=st.floats(1e-6, 1e6), seed=st.integers(0, 2**16))
def test_a_ring_restores_what_it_recorded(capacity, num_envs, n_step, count, max_leaf, seed):
    rng = np.random.default_rng(seed)
    a = Ring(capacity, num_envs, n_step)
    a.gid[:] = rng.integers(-1, 1000, capacity)
    a.status[:] = rng.integers(0, 4, capacity)
    a.ends[:] = rng.integers(0, 4, capacity)
    a.pending[:] = rng.random(a.pending.shape[0])
    a.count, a.max_leaf = count, max_leaf
    a.env_ended[:] = rng.random(num_envs) < 0.5
    meta, arrays = a.state()
    b = Ring(capacity, num_envs, n_step)
    arrays_before = {k: v.copy() for k, v in arrays.items()}
    b.restore(meta, {k: v.copy() for k, v in arrays.items()})
    for name in Ring.ARRAYS:
        np.testing.assert_array_equal(getattr(b, name), arrays_before[name])
    assert (b.count, b.max_leaf, b.env_ended.tolist()) == (count, max_leaf, meta["env_ended"])
    assert len(b) == min(count, capacity)


def test_a_buffers_state_holds_its_rings():
    buf = bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.float32), "reward": ((), np.float32)},
                                         n_step=2, num_envs=2)
    for t in range(7):
        buf.add(x=np.full(2, t, np.float32), reward=np.ones(2, np.float32),
                terminated=np.array([t == 3, False]), truncated=np.zeros(2, bool))
    meta, arrays = buf.state_dict()
    ring = hook.ring(buf)
    assert meta["count"] == ring.count == 14 and meta["env_ended"] == ring.env_ended.tolist()
    for name in Ring.ARRAYS:
        assert arrays[name] is getattr(ring, name)
    buf.close()
