"""Rank-based prioritization over offline datasets: ``from_hdf5(..., prioritization="rank")``,
``reprioritize`` ranking the whole dataset, keys saved at close and resumed, bigper's own
layout written under one prioritization and read under the other.

Expected ranks and probabilities are computed here from the scores with numpy
(argsort, ``rank**-alpha``), never read back from the buffer's ranking."""

import json
import warnings

import numpy as np
import pytest
from scipy import stats

import bigper
from tests.offline.test_offline import sha256, write_d4rl

PRB = bigper.PrioritizedReplayBuffer


def exact_ranks(scores: np.ndarray, live: np.ndarray) -> np.ndarray:
    """1-based rank of each live slot by score, largest first; ties by slot, the later first."""
    slots = np.flatnonzero(live)
    order = np.lexsort((-slots, -scores[slots]))  # primary: score descending, then slot descending
    rank = np.zeros(live.shape[0], dtype=np.int64)
    rank[slots[order]] = np.arange(1, slots.shape[0] + 1)
    return rank


def rank_law(rank: np.ndarray, n: int, alpha: float) -> np.ndarray:
    return np.where(rank > 0, np.maximum(rank, 1).astype(float) ** -alpha, 0.0) / (
        np.arange(1, n + 1, dtype=float) ** -alpha).sum()


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "walker.hdf5"
    lengths = (400, 350, 500, 250)
    data = write_d4rl(path, lengths=lengths, ends=("terminal", "timeout", "terminal", "timeout"))
    return path, data


def distinct_scores(batch) -> np.ndarray:
    # a function of the row alone, distinct for every row: |reward| plus a slot-dependent tie-breaker
    return np.abs(batch["reward"]).astype(np.float64) * 10 + batch.indices * 1e-3


def test_reprioritize_ranks_the_dataset_and_sampling_follows_the_rank_law(dataset):
    path, data = dataset
    before = sha256(path)
    n = data["observations"].shape[0]
    alpha = 0.7
    scores = np.abs(data["rewards"]).astype(np.float64) * 10 + np.arange(n) * 1e-3
    with PRB.from_hdf5(path, prioritization="rank", alpha=alpha, seed=11) as buf:
        live = buf.status == 1
        buf.reprioritize(distinct_scores, batch_size=97, progress=False)
        rank = exact_ranks(scores, live)
        law = rank_law(rank, int(live.sum()), alpha)
        # right after reprioritize the ranking is exact: probabilities of single slots
        got = buf.prioritization.probabilities(np.arange(n))
        assert np.allclose(got, law, rtol=1e-9)
        # rank deciles: chi-square over 120k draws (not stratified, so draws are independent)
        draws, counts = 0, np.zeros(n)
        probs_seen = {}
        while draws < 120_000:
            b = buf.sample(1000, stratified=False)
            np.add.at(counts, b.indices, 1)
            probs_seen.update(zip(b.indices.tolist(), b.probabilities.tolist()))
            draws += 1000
        edges = np.quantile(rank[live], np.linspace(0, 1, 11))
        decile = np.clip(np.searchsorted(edges, rank, side="right") - 1, 0, 9)
        obs = np.array([counts[live & (decile == d)].sum() for d in range(10)])
        exp = np.array([law[live & (decile == d)].sum() for d in range(10)]) * draws
        assert stats.chisquare(obs, exp).pvalue > 1e-4
        # batch.probabilities are the law's, for every slot seen
        seen = np.array(sorted(probs_seen))
        assert np.allclose([probs_seen[i] for i in seen], law[seen], rtol=1e-6)
        # monotone: a larger score is never less likely
        order = np.argsort(scores[live])
        assert np.all(np.diff(got[live][order]) >= 0)
    assert sha256(path) == before


def test_scores_come_back_as_ranks_under_any_alpha(dataset):
    path, data = dataset
    n = data["observations"].shape[0]
    scores = np.abs(data["rewards"]).astype(np.float64) * 10 + np.arange(n) * 1e-3
    with PRB.from_hdf5(path) as buf:  # scored under proportional
        live = buf.status == 1
        buf.reprioritize(distinct_scores, progress=False)
    for alpha in (0.5, 1.0):
        with PRB.from_hdf5(path, prioritization="rank", alpha=alpha) as buf:
            rank = exact_ranks(scores, live)
            pos = buf.prioritization.positions(np.arange(n))
            assert np.array_equal(pos + 1, np.where(live, rank, 0))
            assert np.allclose(buf.prioritization.probabilities(np.arange(n)),
                               rank_law(rank, int(live.sum()), alpha))


def test_max_priority_clips_before_ranking(dataset):
    path, data = dataset
    n = data["observations"].shape[0]
    with PRB.from_hdf5(path, prioritization="rank", max_priority=5.0) as buf:
        live = buf.status == 1
        buf.reprioritize(distinct_scores, progress=False)
        scores = np.minimum(np.abs(data["rewards"]).astype(np.float64) * 10 + np.arange(n) * 1e-3, 5.0)
        assert np.array_equal(buf.leaves(np.arange(n)), np.where(live, scores, 0.0))
        pos = buf.prioritization.positions(np.arange(n))
        assert np.array_equal(pos + 1, np.where(live, exact_ranks(scores, live), 0))


def test_without_scores_every_transition_ties_and_the_later_slot_ranks_first(dataset):
    path, data = dataset
    n = data["observations"].shape[0]
    with PRB.from_hdf5(path, prioritization="rank") as buf:
        live = buf.status == 1
        assert buf.prioritization.check(buf.status) == []
        pos = buf.prioritization.positions(np.arange(n))
        assert np.array_equal(pos + 1, np.where(live, exact_ranks(np.ones(n), live), 0))


def test_updated_keys_are_saved_at_close_and_resumed(dataset):
    path, data = dataset
    n = data["observations"].shape[0]
    side = path.with_name(path.name + ".priorities")
    with PRB.from_hdf5(path, prioritization="rank", seed=3) as buf:
        live = buf.status == 1
        buf.reprioritize(distinct_scores, progress=False)
        b = buf.sample(64)
        new = np.linspace(0.0, 50.0, 64)
        buf.update_priorities(b, new)
        keys = buf.leaves(np.arange(n))
    entry = json.loads((side / "meta.json").read_text())["leaves"]
    assert entry["prioritization"] == "rank"
    # what update_priorities set is what comes back, under another alpha too (rank keys
    # are clipped priorities); the ranking is exact again after the reopening sort
    want = np.abs(data["rewards"]).astype(np.float64) * 10 + np.arange(n) * 1e-3
    for i, v in zip(b.indices, new):
        want[i] = v
    want = np.where(live, want, 0.0)
    for alpha in (0.6, 0.9):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = PRB.from_hdf5(path, prioritization="rank", alpha=alpha)
        with again:
            assert np.array_equal(again.leaves(np.arange(n)), keys)
            assert np.allclose(again.leaves(np.arange(n)), want)
            pos = again.prioritization.positions(np.arange(n))
            assert np.array_equal(pos + 1, np.where(live, exact_ranks(want, live), 0))
    # another max_priority: the saved keys are not used, the scores are
    with pytest.warns(UserWarning, match="max_priority=None are not used with max_priority=100.0"):
        clipped = PRB.from_hdf5(path, prioritization="rank", max_priority=100.0)
    with clipped:
        scores = np.abs(data["rewards"]).astype(np.float64) * 10 + np.arange(n) * 1e-3
        assert np.array_equal(clipped.leaves(np.arange(n)), np.where(live, np.minimum(scores, 100.0), 0.0))


@pytest.mark.parametrize("saved, opened", [("rank", "proportional"), ("proportional", "rank")])
def test_keys_of_one_strategy_are_not_read_as_the_other(dataset, saved, opened):
    path, data = dataset
    n = data["observations"].shape[0]
    with PRB.from_hdf5(path, prioritization=saved) as buf:
        live = buf.status == 1
        buf.reprioritize(distinct_scores, progress=False)
        buf.update_priorities(np.flatnonzero(live)[:3], np.array([100.0, 200.0, 300.0]))
    with pytest.warns(UserWarning, match=f"prioritization='{saved}' are not used with prioritization='{opened}'"):
        other = PRB.from_hdf5(path, prioritization=opened)
    with other:  # from the scores of the reprioritize
        scores = np.abs(data["rewards"]).astype(np.float64) * 10 + np.arange(n) * 1e-3
        want = scores if opened == "rank" else (scores + 1e-6) ** 0.6
        assert np.allclose(other.leaves(np.arange(n)), np.where(live, want, 0.0))


def test_keys_saved_before_rank_existed_are_proportional(dataset):
    """A sidecar written by an earlier bigper has no 'prioritization' in its leaves entry."""
    path, _ = dataset
    side = path.with_name(path.name + ".priorities")
    with PRB.from_hdf5(path) as buf:
        buf.update_priorities(np.array([0, 1]), np.array([5.0, 7.0]))
    meta = json.loads((side / "meta.json").read_text())
    del meta["leaves"]["prioritization"]
    (side / "meta.json").write_text(json.dumps(meta))
    with PRB.from_hdf5(path) as again:
        assert np.allclose(again.leaves(np.array([0, 1])), (np.array([5.0, 7.0]) + 1e-6) ** 0.6)
    with pytest.warns(UserWarning, match="prioritization='proportional' are not used"):
        PRB.from_hdf5(path, prioritization="rank").close()


@pytest.mark.parametrize("writer, reader", [("rank", "rank"), ("rank", "proportional"),
                                            ("proportional", "rank")])
@pytest.mark.parametrize("kw", [{}, {"n_step": 3}, {"frame_stack": 2}], ids=["plain", "nstep", "frames"])
def test_bigper_layout_written_and_read_under_either_strategy(tmp_path, writer, reader, kw):
    shape = (2, 6, 6) if "frame_stack" in kw else (6, 6)
    fields = {"obs": (shape, np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
    path = tmp_path / "replay.h5"
    rng = np.random.default_rng(0)
    twin = PRB(50, fields, **kw)
    live_buf = PRB(50, fields, storage="hdf5", path=path, prioritization=writer, **kw)
    o = rng.integers(0, 255, size=shape, dtype=np.uint8)
    for i in range(70):  # wraps around
        o2 = rng.integers(0, 255, size=shape, dtype=np.uint8)
        if "frame_stack" in kw:
            o2[:-1] = o[1:]
        step = dict(obs=o, action=i, reward=float(i % 17), next_obs=o2, terminated=i % 13 == 12)
        live_buf.add(**step)
        twin.add(**step)
        o = rng.integers(0, 255, size=shape, dtype=np.uint8) if i % 13 == 12 else o2
    live_buf.close()
    before = sha256(path)
    asked = None if reader == writer else reader  # unset: what the file recorded
    with PRB.from_hdf5(path, prioritization=asked, seed=3) as buf:
        assert buf.config.prioritization == reader
        ok = twin.status == 1
        assert np.array_equal(buf.status == 1, ok)
        assert buf.prioritization.check(buf.status) == []
        for _ in range(5):
            b = buf.sample(16)
            assert ok[b.indices].all()
            want = twin.gather(b.indices)
            for k in want:
                assert np.array_equal(b[k], want[k]), k
        buf.reprioritize(lambda b: b["reward"].astype(np.float64) + b.indices * 1e-3,
                         batch_size=7, progress=False)
        slots = np.flatnonzero(ok)
        scores = np.zeros(50)
        scores[slots] = twin.gather(slots)["reward"].astype(np.float64) + slots * 1e-3
        if reader == "rank":
            pos = buf.prioritization.positions(np.arange(50))
            assert np.array_equal(pos + 1, np.where(ok, exact_ranks(scores, ok), 0))
        else:
            assert np.allclose(buf.leaves(np.arange(50)), np.where(ok, (scores + 1e-6) ** 0.6, 0.0))
    assert sha256(path) == before


def test_bad_prioritization_is_refused_before_anything_is_written(dataset):
    path, _ = dataset
    side = path.with_name(path.name + ".priorities")
    before = sha256(path)
    with pytest.raises(bigper.InvalidArgumentError, match="prioritization must be one of"):
        PRB.from_hdf5(path, prioritization="ranked")
    assert sha256(path) == before and not side.exists()


def test_cli_info_names_the_saved_strategy(dataset, capsys):
    from bigper.cli import main

    path, _ = dataset
    with PRB.from_hdf5(path, prioritization="rank") as buf:
        buf.update_priorities(np.array([0]), np.array([3.0]))
    assert main(["info", str(path)]) == 0
    assert "rank keys saved at close (max_priority=None)" in capsys.readouterr().out
