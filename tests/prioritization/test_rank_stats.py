"""The rank sampler against its exact distribution (seeded chi-square).

Right after a full sort, with distinct priorities, the draws follow
``P(rank r) = r**-alpha / H(n)``. The reference ranks come from sorting the
priorities here, independently of the heap; a chi-square p-value above 1e-3
passes, and the same test rejects a wrong law.
"""

import math

import numpy as np
import pytest
from scipy import stats

import bigper
from bigper.prioritization.rank import RankPrioritizer

N = 1000


def law(n, alpha):
    f = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return f / math.fsum(f)


def filled(alpha, seed=0, **kw):
    rng = np.random.default_rng(seed)
    r = RankPrioritizer(N, alpha=alpha, eps=1e-6, max_priority=math.inf,
                        weight_norm=kw.pop("weight_norm", "global"), **kw)
    prios = rng.permutation(N).astype(np.float64) * 0.37 + rng.random()  # distinct
    r.insert(rng.permutation(N).astype(np.int64), np.zeros(N))
    gid, status, pending = np.arange(N, dtype=np.int64), np.ones(N, np.uint8), np.zeros(N)
    slots = np.arange(N, dtype=np.int64)
    r.update(slots, prios, gid, False, gid, status, pending)
    r.sort()
    # The reference: rank 1 is the largest priority.
    rank_of_slot = np.empty(N, dtype=np.int64)
    rank_of_slot[np.argsort(-prios)] = np.arange(1, N + 1)
    return r, rank_of_slot


def draws(r, k, calls, stratified, seed=1):
    rng = np.random.default_rng(seed)
    out = [r.sample(rng.random(k), stratified=stratified, beta=0.4) for _ in range(calls)]
    return [np.concatenate(x) for x in zip(*out)]


def decile_pvalue(ranks, p):
    edges = np.linspace(0, N, 11).astype(int)
    seen = np.array([np.count_nonzero((ranks > a) & (ranks <= b)) for a, b in zip(edges, edges[1:])])
    expected = np.array([p[a:b].sum() for a, b in zip(edges, edges[1:])]) * ranks.size
    return stats.chisquare(seen, expected).pvalue


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.3])
@pytest.mark.parametrize("stratified", [True, False])
def test_rank_deciles_follow_the_law(alpha, stratified):
    r, rank_of_slot = filled(alpha)
    idx, prob, _ = draws(r, 64, 1600, stratified)  # 102,400 draws
    ranks = rank_of_slot[idx]
    p = law(N, alpha)
    assert decile_pvalue(ranks, p) > 1e-3
    # The probabilities reported are the law's at the exact rank.
    assert np.allclose(prob, p[ranks - 1], rtol=1e-12, atol=0)


def test_deciles_reject_a_wrong_law():
    r, rank_of_slot = filled(0.6)
    idx, _, _ = draws(r, 64, 1600, True)
    assert decile_pvalue(rank_of_slot[idx], law(N, 0.5)) < 1e-3


def test_single_transitions_match_reported_probabilities():
    """Each of the 30 top ranks on its own, the rest pooled: empirical
    frequencies against ``batch.probabilities`` as reported."""
    r, rank_of_slot = filled(0.8, seed=4)
    idx, prob, _ = draws(r, 128, 1000, True, seed=9)  # 128,000 draws
    reported = {}
    for s, p in zip(idx.tolist(), prob.tolist()):
        assert reported.setdefault(s, p) == p  # one probability per transition
    top = np.argsort(rank_of_slot)[:30]
    p_top = np.array([reported[s] for s in top])
    seen = np.array([np.count_nonzero(idx == s) for s in top] + [0])
    seen[-1] = idx.size - seen[:-1].sum()
    expected = np.append(p_top, 1 - p_top.sum()) * idx.size
    assert stats.chisquare(seen, expected).pvalue > 1e-3


@pytest.mark.parametrize("norm", ["global", "batch"])
def test_weights_are_normalized_is_weights(norm):
    alpha, beta = 0.7, 0.4
    r, rank_of_slot = filled(alpha, weight_norm=norm)
    idx, prob, w = draws(r, 32, 20, True)
    p = law(N, alpha)
    raw = (N * p[rank_of_slot[idx] - 1]) ** -beta
    for b in range(0, idx.size, 32):
        ref = (N * p[-1]) ** -beta if norm == "global" else raw[b:b + 32].max()
        assert np.allclose(w[b:b + 32], raw[b:b + 32] / ref, rtol=1e-5)


def test_monotone_right_after_sort():
    """A larger priority never has a smaller probability, ties none here."""
    r, rank_of_slot = filled(0.6, seed=2)
    slots = np.argsort(rank_of_slot)  # by priority, largest first
    p = r.probabilities(slots)
    assert np.all(np.diff(p) < 0)


def test_buffer_rank_sampling_matches_the_law():
    """Through the public buffer: distinct priorities, a sort at the first
    sample (writes reached sort_every = capacity), then 10^5 draws."""
    buf = bigper.PrioritizedReplayBuffer(capacity=N, fields={"x": ((), np.float32)},
                                         prioritization="rank", alpha=0.6, seed=3)
    buf.extend({"x": np.arange(N, dtype=np.float32)})
    rng = np.random.default_rng(0)
    prios = rng.permutation(N) + 0.5
    buf.update_priorities(np.arange(N), prios)
    rank_of_slot = np.empty(N, dtype=np.int64)
    rank_of_slot[np.argsort(-prios)] = np.arange(1, N + 1)
    ranks = np.concatenate([rank_of_slot[buf.sample(100).indices] for _ in range(1000)])
    assert decile_pvalue(ranks, law(N, 0.6)) > 1e-3
    b = buf.sample(16)
    assert np.allclose(b.probabilities, law(N, 0.6)[rank_of_slot[b.indices] - 1], rtol=1e-12)
    assert np.array_equal(b["x"], b.indices.astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [32, 256])
def test_round_within_2x_of_proportional_at_a_million(batch):
    """Sample B + update B at 2**20 slots, rank against proportional in the
    same process, alternating, CPU time: the issue's ratio (no absolute time)."""
    import time

    from bigper.prioritization.proportional import Proportional

    cap = 1 << 20
    rng = np.random.default_rng(0)
    gid, status, pending = np.arange(cap, dtype=np.int64), np.ones(cap, np.uint8), np.zeros(cap)
    strategies = []
    for cls in (RankPrioritizer, Proportional):
        s = cls(cap, alpha=0.6, eps=1e-6, max_priority=math.inf, weight_norm="global")
        s.insert(np.arange(cap, dtype=np.int64), s.keys(rng.lognormal(0, 2, cap)))
        strategies.append(s)

    def rounds(s, reps):
        t = time.process_time()
        for _ in range(reps):
            idx, _, _ = s.sample(rng.random(batch), stratified=True, beta=0.4)
            s.update(idx, rng.lognormal(0, 2, batch), gid[idx], True, gid, status, pending)
        return time.process_time() - t

    for s in strategies:
        rounds(s, 50)  # compile and warm
    # 2**20 writes and more: rank's re-sort (one per 2**20 writes) is in, amortized.
    reps = 4 * ((cap // batch + 255) // 4)
    got = [[rounds(s, reps // 4) for s in strategies] for _ in range(4)]
    rank, prop = np.sum(got, axis=0)
    assert rank < 2.0 * prop, f"rank {rank / reps * 1e6:.1f} us vs proportional {prop / reps * 1e6:.1f} us"
