"""The sampler against its exact distribution: fixed seeds, loose thresholds.

Every expectation here is computed from the priorities the test chose
(``leaf = (min(p, max_priority) + eps) ** alpha``), never read back from the
buffer. A chi-square p-value above 1e-3 passes; with the seeds fixed each
test is deterministic.
"""

import math

import numpy as np
import pytest
from scipy import stats

import bigper

FIELDS = {"x": ((), np.int64)}


def filled(capacity, priorities, **kw):
    buf = bigper.PrioritizedReplayBuffer(capacity, FIELDS, **kw)
    n = len(priorities)
    buf.extend({"x": np.arange(n, dtype=np.int64)}, priorities=np.asarray(priorities, dtype=np.float64))
    return buf


def counts(buf, n_batches, batch_size, **kw):
    seen = np.zeros(buf.capacity, dtype=np.int64)
    for _ in range(n_batches):
        b = buf.sample(batch_size, **kw)
        np.testing.assert_array_equal(b["x"], b.indices)  # data travels with its slot
        np.add.at(seen, b.indices, 1)
    return seen


def chisquare_against(seen, leaves):
    """p-value of the observed counts against P(i) = leaf_i / sum; zero leaves must never be drawn."""
    leaves = np.asarray(leaves, dtype=np.float64)
    assert seen[leaves == 0].sum() == 0, "a zero-priority slot was sampled"
    nz = leaves > 0
    expected = seen.sum() * leaves[nz] / math.fsum(leaves)
    return stats.chisquare(seen[nz], expected).pvalue


@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("capacity,written", [(777, 777), (1000, 600), (3, 3)])
def test_frequencies_match_exact_probabilities(stratified, capacity, written):
    rng = np.random.default_rng(capacity + written)
    p = rng.gamma(0.7, 2.0, written)
    p[rng.random(written) < 0.1] = 0.0  # with eps=0 these are never sampleable
    p[0] = 3.0
    alpha = 0.7
    buf = filled(capacity, p, alpha=alpha, eps=0.0, seed=11)
    leaves = np.zeros(capacity)
    leaves[:written] = p ** alpha
    draws = 60_000 if written > 3 else 6_000
    seen = counts(buf, draws // 200, 200, stratified=stratified)
    assert seen[written:].sum() == 0, "an unwritten slot was sampled"
    assert chisquare_against(seen, leaves) > 1e-3


def test_chisquare_detects_a_wrong_distribution():
    """The threshold is loose but not toothless: uniform sampling of the same
    slots is rejected."""
    rng = np.random.default_rng(0)
    p = rng.gamma(0.7, 2.0, 500) + 0.01
    seen = np.bincount(rng.integers(0, 500, 60_000), minlength=500)
    assert chisquare_against(seen, p ** 0.7) < 1e-3


def test_stratified_rows_cover_their_slices():
    """Row b of a stratified batch comes from the b-th slice of the total:
    with n equal leaves and batch n, row b is slot b."""
    n = 50
    buf = filled(n, np.ones(n), alpha=1.0, eps=0.0, seed=3)
    for _ in range(20):
        np.testing.assert_array_equal(buf.sample(n).indices, np.arange(n))


def test_priority_bias():
    """A transition with 10x the priority is drawn about 10**alpha times as
    often as one of its peers."""
    n, alpha = 100, 0.6
    p = np.ones(n)
    p[37] = 10.0
    buf = filled(n, p, alpha=alpha, eps=0.0, seed=7)
    seen = counts(buf, 400, 256, stratified=False)
    ratio = seen[37] / np.delete(seen, 37).mean()
    assert ratio == pytest.approx(10 ** alpha, rel=0.06)
    # and not 10x (alpha ignored) nor 1x (priorities ignored)
    assert abs(ratio - 10) > 3 and abs(ratio - 1) > 2


def test_update_priorities_changes_the_distribution():
    n = 64
    buf = filled(n, np.ones(n), alpha=1.0, eps=0.0, seed=5)
    p = np.arange(n, dtype=np.float64) % 7  # some zeros
    buf.update_priorities(np.arange(n), p)
    seen = counts(buf, 200, 256)
    assert chisquare_against(seen, p) > 1e-3


def expected_weights(leaves, idx, beta, norm):
    """w_i = (N P(i))**-beta over the largest possible weight (global: the
    smallest non-zero P) or the batch's largest."""
    leaves = np.asarray(leaves, dtype=np.float64)
    n = leaves.shape[0]  # N = len(buf); it cancels in both normalizations
    prob = leaves / math.fsum(leaves)
    raw = (n * prob[idx]) ** -beta
    top = (n * prob[prob > 0].min()) ** -beta if norm == "global" else raw.max()
    return raw / top


@pytest.mark.parametrize("norm", ["global", "batch"])
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_importance_weights(norm, beta):
    rng = np.random.default_rng(1)
    p = rng.uniform(0.1, 5.0, 300)
    p[5] = 0.01  # the global minimum: rarely drawn, still sets the global norm
    alpha, eps = 0.6, 1e-3
    buf = filled(300, p, alpha=alpha, eps=eps, beta=beta, weight_norm=norm, seed=2)
    leaves = (p + eps) ** alpha
    for _ in range(20):
        b = buf.sample(32)
        np.testing.assert_allclose(b.probabilities, leaves[b.indices] / math.fsum(leaves), rtol=1e-12)
        np.testing.assert_allclose(b.weights, expected_weights(leaves, b.indices, beta, norm), rtol=1e-6)
        if norm == "batch":
            assert b.weights.max() == pytest.approx(1.0)
        elif beta > 0 and 5 not in b.indices:
            assert b.weights.max() < 1.0


def test_global_weights_use_n_of_the_buffer_not_the_capacity():
    """A half-full buffer: N = len(buf); the zero leaves of unwritten slots do
    not count as the minimum."""
    buf = filled(10, [1.0, 4.0, 2.0], alpha=1.0, eps=0.0, beta=1.0, seed=0)
    b = buf.sample(64, stratified=False)
    leaves = np.array([1.0, 4.0, 2.0])
    np.testing.assert_allclose(b.weights, expected_weights(leaves, b.indices, 1.0, "global"), rtol=1e-6)
    # leaf 4 against the minimum leaf 1: (4/1)**-1
    assert set(np.round(b.weights, 6)) <= {1.0, 0.25, 0.5}


def test_linear_schedule_values():
    s = bigper.LinearSchedule(0.4, 1.0, 200)
    assert s(0) == 0.4 and s(200) == 1.0 and s(10_000) == 1.0
    assert s(100) == pytest.approx(0.7) and s(50) == pytest.approx(0.55)
    down = bigper.LinearSchedule(1.0, 0.0, 4)
    assert [down(i) for i in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def beta_of(batch):
    """beta read back from a batch over leaves 1 and 4 (global norm): w(4) = 4**-beta."""
    w4 = batch.weights[batch.indices == 1]
    assert w4.size
    return -math.log(float(w4[0])) / math.log(4.0)


@pytest.mark.parametrize("norm", ["global", "batch"])
def test_beta_schedule_advances_once_per_sample(norm):
    sched = bigper.LinearSchedule(0.4, 1.0, 6)
    # leaves 1 and 4, and equal strata: row 0 always slot 0, row 1 slot 1 (batch 5, slices of 1)
    buf = filled(2, [1.0, 4.0], alpha=1.0, eps=0.0, beta=sched, weight_norm=norm, seed=0)
    got = []
    for step in range(9):
        assert buf.beta == pytest.approx(sched(step))
        if step == 3:  # an override uses the given beta; the schedule still advances
            assert beta_of(buf.sample(5, beta=0.9)) == pytest.approx(0.9, abs=1e-5)
            continue
        got.append((step, beta_of(buf.sample(5))))
    for step, b in got:
        assert b == pytest.approx(sched(step), abs=1e-5), f"sample call {step}"
    assert buf.beta == 1.0


def test_failed_sample_does_not_advance_the_schedule():
    sched = bigper.LinearSchedule(0.0, 1.0, 4)
    buf = bigper.PrioritizedReplayBuffer(4, FIELDS, beta=sched, alpha=1.0, eps=0.0, seed=0)
    with pytest.raises(ValueError):
        buf.sample(3)
    with pytest.raises(ValueError):
        buf.sample(0)
    buf.extend({"x": np.arange(2)}, priorities=np.array([1.0, 4.0]))
    assert buf.beta == 0.0
    assert beta_of(buf.sample(5)) == pytest.approx(0.0, abs=1e-6)


def test_new_transitions_enter_at_the_largest_leaf_seen():
    alpha, eps = 0.5, 0.01
    buf = bigper.PrioritizedReplayBuffer(8, FIELDS, alpha=alpha, eps=eps, seed=0)

    def added_leaf():
        before = buf.total_priority
        buf.add(x=0)
        return buf.total_priority - before

    assert added_leaf() == pytest.approx(1.0)          # 1.0 before any update
    buf.update_priorities(np.array([0]), np.array([0.2]))
    assert added_leaf() == pytest.approx(1.0)          # a smaller leaf does not lower it
    buf.update_priorities(np.array([1]), np.array([9.0]))
    assert added_leaf() == pytest.approx((9.0 + eps) ** alpha)
    buf.update_priorities(np.array([1]), np.array([0.0]))
    assert added_leaf() == pytest.approx((9.0 + eps) ** alpha)  # the largest ever seen, not the current
    buf.add(x=0, priorities=16.0)                       # priorities given to add count too
    assert added_leaf() == pytest.approx((16.0 + eps) ** alpha)


def test_max_priority_clips_leaves_and_the_insertion_value():
    alpha, eps, cap = 0.6, 1e-6, 2.0
    buf = bigper.PrioritizedReplayBuffer(8, FIELDS, alpha=alpha, eps=eps, max_priority=cap, seed=0)
    buf.extend({"x": np.arange(2)}, priorities=np.array([0.5, 1000.0]))
    assert buf.total_priority == pytest.approx((0.5 + eps) ** alpha + (cap + eps) ** alpha)
    before = buf.total_priority
    buf.add(x=0)
    assert buf.total_priority - before == pytest.approx((cap + eps) ** alpha)
    buf.update_priorities(np.array([0]), np.array([50.0]))
    assert buf.total_priority == pytest.approx(3 * (cap + eps) ** alpha)


def test_max_priority_insertion_is_sampled_in_proportion():
    """After updates, fresh transitions (at the max leaf) dominate the draws as P says."""
    buf = filled(100, np.full(90, 0.1), alpha=1.0, eps=0.0, seed=9)
    buf.update_priorities(np.array([3]), np.array([2.0]))
    buf.extend({"x": np.arange(90, 100)})  # ten new ones at leaf 2.0
    leaves = np.full(100, 0.1)
    leaves[3] = 2.0
    leaves[90:] = 2.0
    assert chisquare_against(counts(buf, 100, 256), leaves) > 1e-3
