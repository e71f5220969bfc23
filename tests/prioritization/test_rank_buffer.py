"""Rank prioritization through the whole buffer: frames, n-step, vector envs,
every storage, snapshots (exact resume), reopen, and the batch form of
update_priorities. The rank law itself is tested in test_rank_stats.py."""

import numpy as np
import pytest

import bigper


FIELDS = {"obs": ((3, 6, 6), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}


def _steps(rng, n, k=3):
    """A frame-stack stream with episode ends; obs and next_obs continue each other."""
    frames = [rng.integers(0, 255, (6, 6), dtype=np.uint8) for _ in range(k)]
    out = []
    for t in range(n):
        obs = np.stack(frames[-k:])
        frames.append(rng.integers(0, 255, (6, 6), dtype=np.uint8))
        nxt = np.stack(frames[-k:])
        term = t % 17 == 16
        out.append(dict(obs=obs, action=np.int64(t), reward=np.float32(t % 5), next_obs=nxt,
                        terminated=term, truncated=t % 23 == 22 and not term))
        if term or t % 23 == 22:
            frames = [rng.integers(0, 255, (6, 6), dtype=np.uint8)] * k
    return out


def _open(storage, tmp_path, **kw):
    extra = {} if storage == "memory" else {"path": tmp_path / ("b.h5" if storage == "hdf5" else "b")}
    return bigper.PrioritizedReplayBuffer(64, FIELDS, frame_stack=3, n_step=3, prioritization="rank",
                                          storage=storage, seed=7, **extra, **kw)


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_rank_buffer_returns_what_was_added_and_resumes_exactly(storage, tmp_path):
    rng = np.random.default_rng(0)
    steps = _steps(rng, 150)
    buf = _open(storage, tmp_path)
    for s in steps:
        buf.add(**s)
    for i in range(20):
        b = buf.sample(16)
        for j, g in enumerate(b.generations):
            np.testing.assert_array_equal(b["obs"][j], steps[g]["obs"])
            assert b["action"][j] == steps[g]["action"]
        assert np.all(b.probabilities > 0) and np.all(np.isfinite(b.weights)) and b.weights.max() <= 1
        buf.update_priorities(b, np.abs(rng.normal(size=16)))
    assert buf.prioritization.check(buf.status) == []
    snap = buf.save(tmp_path / "snap")
    # both go on with the same adds, buf as the run that never stopped: other's open episode continues
    other = bigper.PrioritizedReplayBuffer.load(
        snap, path=None if storage == "memory" else tmp_path / ("c.h5" if storage == "hdf5" else "c"),
        continue_episodes=True)
    for i in range(10):
        x, y = buf.sample(8), other.sample(8)
        np.testing.assert_array_equal(x.indices, y.indices)
        np.testing.assert_array_equal(x.weights, y.weights)
        np.testing.assert_array_equal(x.probabilities, y.probabilities)
        p = np.abs(rng.normal(size=8))
        buf.update_priorities(x, p)
        other.update_priorities(y, p)
        s = steps[i]
        buf.add(**s)
        other.add(**s)
    other.close()
    buf.close()


def test_rank_update_by_batch_skips_overwritten_slots_and_larger_is_likelier():
    buf = bigper.PrioritizedReplayBuffer(32, {"x": ((), np.float32)}, prioritization="rank", seed=0)
    for i in range(32):
        buf.add(x=np.float32(i))
    old = buf.sample(8)
    for i in range(32):  # overwrite every slot
        buf.add(x=np.float32(100 + i))
    before = buf.leaves(np.arange(32)).copy()
    buf.update_priorities(old, np.full(8, 1e6))
    np.testing.assert_array_equal(buf.leaves(np.arange(32)), before)
    buf.update_priorities(np.arange(32), np.arange(32, dtype=float))
    buf.prioritization.sort() if hasattr(buf.prioritization, "sort") else None
    counts = np.bincount(np.concatenate([buf.sample(32).indices for _ in range(2000)]), minlength=32)
    # Slot 31 has the largest |delta| (rank 1), slot 0 the smallest.
    assert counts[31] > counts[16] > counts[0]


def test_sharded_buffers_refuse_rank_clearly():
    buf = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32)}, prioritization="rank")
    buf.add(x=np.float32(1))
    with pytest.raises(bigper.InvalidArgumentError, match="proportional"):
        buf.shard.sample_at(np.array([0.1]), beta=0.4)
