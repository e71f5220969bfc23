"""IS weights are never 0 or subnormal in a batch's float32: a weight below
float32's smallest normal number (leaves about 1e38 ** (1 / beta) apart) is
given as that number (``_tree_kernels.W_MIN``), on every path that draws from
the tree (``sample``, the native feed's ``sampler``). Before, a finite
priority of 1.8e308 gave weights of exactly 0: transitions drawn and then
ignored by the learner."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bigper

TINY = float(np.finfo(np.float32).tiny)


def _reference(lo: float, v: np.ndarray, beta: float) -> np.ndarray:
    """``(lo / v) ** beta`` in float64 through logarithms (no underflow on the
    way), floored at float32's smallest normal number, as float32."""
    w = np.exp(beta * (math.log(lo) - np.log(v)))
    return np.maximum(w, TINY).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(exps=st.lists(st.floats(-300, 300), min_size=2, max_size=40), beta=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**31 - 1))
def test_tree_weights_are_the_formula_floored_at_float32s_smallest_normal(exps, beta, seed):
    from bigper.prioritization._tree_kernels import sample_kernel
    from bigper.prioritization.tree import PriorityTree

    keys = np.array([10.0 ** e for e in exps])
    n = keys.shape[0]
    tree = PriorityTree(n)
    tree.set(np.arange(n), keys)
    u = np.random.default_rng(seed).random(16)
    idx, prob, w = sample_kernel(tree.sums, tree.mins, tree.offsets, u, False, beta, False)
    assert w.dtype == np.float32
    assert (w >= TINY).all() and np.isfinite(w).all(), w
    np.testing.assert_allclose(w, _reference(tree.min, tree.leaves[idx], beta), rtol=2e-6)


@pytest.mark.parametrize("weight_norm", ["global", "batch"])
@pytest.mark.parametrize("via", ["sample", "sampler"])
def test_a_priority_of_float64_max_gives_weights_of_float32s_smallest_normal_not_0(via, weight_norm):
    buf = bigper.PrioritizedReplayBuffer(64, {"x": ((), np.float32)}, seed=3, weight_norm=weight_norm)
    for t in range(64):
        buf.add(x=np.float32(t), terminated=t % 8 == 7)
    huge = float(np.finfo(np.float64).max)
    p = np.full(64, 1e-300)
    p[5] = huge
    buf.update_priorities(np.arange(64), p)
    if via == "sample":
        batches = [buf.sample(32) for _ in range(20)]
    else:
        with buf.sampler(32, prefetch=0, device="cpu") as it:
            batches = [next(it) for _ in range(20)]
    w = np.concatenate([np.asarray(b["weights"] if isinstance(b, dict) else b.weights) for b in batches])
    idx = np.concatenate([np.asarray(b["indices"] if isinstance(b, dict) else b.indices) for b in batches])
    assert (w >= TINY).all() and np.isfinite(w).all(), w
    assert (idx == 5).mean() > 0.99  # (it holds nearly all of the mass)
    if weight_norm == "global":  # the smallest leaf is about 1e185 times smaller: (1e-185) ** 0.4 < 1e-38
        assert (w[idx == 5] == np.float32(TINY)).all()
    else:  # a batch of that one transition alone: weight 1
        assert set(np.unique(w[idx == 5])) <= {np.float32(1.0), np.float32(TINY)}


def test_rays_merged_draw_floors_its_weights_too():
    """The sharded buffer's batch (``distributed._sampling.assemble``, the
    shards' parts merged): leaves about 1e300 apart, global and batch norms."""
    from bigper.distributed._sampling import assemble

    parts = {s: {"data": {"x": np.arange(2, dtype=np.float32) + 2 * s}, "slots": np.arange(2),
                 "gens": np.ones(2, np.int64), "leaves": np.array(leaves), "scale": 1.0}
             for s, leaves in enumerate([[1e-150, 1.0], [1e150, 2.0]])}
    positions = {0: np.array([0, 1]), 1: np.array([2, 3])}
    eff = np.array([1e-150, 1.0, 1e150, 2.0])
    total = float(eff.sum())
    for batch_norm in (False, True):
        b = assemble(4, parts, positions, np.array([0, 2, 4]), total, 1e-150, 0.4, batch_norm)
        w = np.asarray(b.weights)
        assert w.dtype == np.float32 and (w >= TINY).all() and np.isfinite(w).all(), w
        np.testing.assert_allclose(w, _reference(1e-150, eff, 0.4), rtol=2e-6)
