"""Frame stacks, n-step windows and env streams against a naive buffer that
stores every transition in full."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from tests import hook

H, W = 5, 3


class Streams:
    """K envs producing stacks of k small frames, with episode ends,
    resets padded by repeating the first frame, and (optionally) stacks that
    do not continue the previous next_obs without any end flag."""

    def __init__(self, rng, k, num_envs, p_term, p_trunc, p_jump):
        self.rng, self.k, self.K = rng, k, num_envs
        self.p_term, self.p_trunc, self.p_jump = p_term, p_trunc, p_jump
        self.tick = 0
        self.stacks = [self._reset() for _ in range(num_envs)]

    def _frame(self):
        self.tick += 1
        # A few distinct values so equal frames happen too (dedup must stay exact).
        return self.rng.integers(0, 3, (H, W), dtype=np.uint8) + np.uint8(self.tick % 7)

    def _reset(self):
        return np.stack([self._frame()] * self.k)

    def step(self):
        obs = np.stack(self.stacks)
        nxt = np.stack([np.concatenate([s[1:], self._frame()[None]]) for s in self.stacks])
        term = self.rng.random(self.K) < self.p_term
        trunc = ~term & (self.rng.random(self.K) < self.p_trunc)
        for e in range(self.K):
            if term[e] or trunc[e]:
                self.stacks[e] = self._reset()
            elif self.rng.random() < self.p_jump:
                self.stacks[e] = np.stack([self._frame() for _ in range(self.k)])
            else:
                self.stacks[e] = nxt[e]
        return obs, nxt, term, trunc


def naive_expectation(added, g, n, K, gamma):
    """What transition g must look like: n-step return inside its episode."""
    ret, disc, term = 0.0, 1.0, False
    for j in range(n):
        step = added[g + j * K]
        ret += disc * float(step["reward"])
        disc *= gamma
        last = step
        if step["term"]:
            term = True
            break
        if step["trunc"]:
            break
    return ret, last["next_obs"], term, (0.0 if term else disc)


def window_complete(added, g, n, K):
    for j in range(n):
        h = g + j * K
        if h >= len(added):
            return False
        if added[h]["term"] or added[h]["trunc"]:
            return True
    return True


def check_batch(buf, batch, added, n, K, gamma, capacity):
    count = len(added)
    for i in range(batch.size):
        g = int(batch.generations[i])
        assert count - capacity <= g < count, "sampled a transition no longer held"
        assert int(batch.indices[i]) == g % capacity
        assert window_complete(added, g, n, K), "sampled before its n-step window completed"
        ret, nxt, term, disc = naive_expectation(added, g, n, K, gamma)
        a = added[g]
        np.testing.assert_array_equal(batch["obs"][i], a["obs"])
        np.testing.assert_array_equal(batch["next_obs"][i], nxt)
        assert batch["action"][i] == a["action"]
        np.testing.assert_allclose(batch["reward"][i], ret, rtol=1e-5, atol=1e-6)
        assert bool(batch["terminated"][i]) == term
        np.testing.assert_allclose(batch["discount"][i], disc, rtol=1e-6)
        np.testing.assert_array_equal(batch["extra"][i], a["extra"])


def run_streams(buf, streams, steps, added, *, use_extend, rng):
    k = streams.k
    K = streams.K
    pending = []
    for t in range(steps):
        obs, nxt, term, trunc = streams.step()
        reward = rng.random(K).astype(np.float32)
        action = np.arange(len(added), len(added) + K, dtype=np.int64)
        extra = rng.integers(0, 100, (K, 2)).astype(np.int16)
        step = dict(obs=obs, next_obs=nxt, action=action, reward=reward, terminated=term,
                    truncated=trunc, extra=extra)
        if K == 1:
            step = {key: v[0] for key, v in step.items()}
        if use_extend:
            pending.append(step)
            if len(pending) == 3 or t == steps - 1:
                buf.extend({key: np.stack([p[key] for p in pending]) for key in step})
                pending = []
        else:
            buf.add(**step)
        for e in range(K):
            added.append(dict(obs=obs[e], next_obs=nxt[e], action=action[e], reward=reward[e],
                              term=bool(term[e]), trunc=bool(trunc[e]), extra=extra[e]))
    assert k == obs.shape[1]


STORAGES = ["memory", "memmap", "hdf5"]
COMPRESSIONS = [None, "zstd"]  # compression="zstd": frames in a ring of compressed segments (frames/segments.py)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([1, 3, 5]), K=st.sampled_from([1, 3]),
       k=st.sampled_from([1, 2, 4]), capacity=st.integers(1, 40), steps=st.integers(1, 60),
       p_end=st.sampled_from([0.0, 0.1, 0.5, 1.0]), p_jump=st.sampled_from([0.0, 0.2]),
       use_extend=st.booleans(), compression=st.sampled_from(COMPRESSIONS))
def test_frames_match_naive_buffer_memory(seed, n, K, k, capacity, steps, p_end, p_jump, use_extend, compression):
    _run_case("memory", None, seed, n, K, k, capacity, steps, p_end, p_jump, use_extend, compression)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([1, 3, 5]), K=st.sampled_from([1, 3]),
       capacity=st.integers(1, 30), steps=st.integers(1, 40), compression=st.sampled_from(COMPRESSIONS))
def test_frames_match_naive_buffer_disk(tmp_path_factory, storage, seed, n, K, capacity, steps, compression):
    path = tmp_path_factory.mktemp("buf") / ("b.h5" if storage == "hdf5" else "b")
    _run_case(storage, path, seed, n, K, 4, capacity, steps, 0.1, 0.1, False, compression)


def _run_case(storage, path, seed, n, K, k, capacity, steps, p_end, p_jump, use_extend, compression=None):
    rng = np.random.default_rng(seed)
    gamma = 0.9
    kw = {} if storage == "memory" else {"path": path}
    buf = bigper.PrioritizedReplayBuffer(
        capacity=capacity,
        fields={"obs": ((k, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32),
                "extra": ((2,), np.int16)},
        frame_stack=k, n_step=n, gamma=gamma, num_envs=K, storage=storage, seed=seed, compression=compression, **kw)
    streams = Streams(rng, k, K, p_end / 2, p_end / 2, p_jump)
    added: list = []
    run_streams(buf, streams, steps, added, use_extend=use_extend, rng=rng)
    live = sum(1 for g in range(max(0, len(added) - capacity), len(added))
               if window_complete(added, g, n, K))
    assert (buf.status == 1).sum() <= live
    if buf.total_priority > 0:
        check_batch(buf, buf.sample(32), added, n, K, gamma, capacity)
        check_batch(buf, buf.sample(7, stratified=False), added, n, K, gamma, capacity)
    else:
        with pytest.raises(ValueError, match="no sampleable"):
            buf.sample(4)
    buf.close()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_complete_transition_is_sampleable_when_frames_fit(compression):
    """With continuing streams no frame is overwritten before its transition,
    so exactly the complete, held transitions are sampleable."""
    rng = np.random.default_rng(1)
    capacity, K, n = 50, 2, 3
    buf = bigper.PrioritizedReplayBuffer(
        capacity=capacity, fields={"obs": ((4, H, W), np.uint8), "action": ((), np.int64),
                                   "reward": ((), np.float32), "extra": ((2,), np.int16)},
        frame_stack=4, n_step=n, num_envs=K, compression=compression)
    added: list = []
    run_streams(buf, Streams(rng, 4, K, 0.02, 0.02, 0.0), 120, added, use_extend=False, rng=rng)
    expect = {g % capacity for g in range(len(added) - capacity, len(added))
              if window_complete(added, g, n, K)}
    assert set(np.flatnonzero(buf.prioritization.tree.leaves > 0)) == expect


def test_each_frame_stored_once_for_continuing_streams():
    rng = np.random.default_rng(2)
    buf = bigper.PrioritizedReplayBuffer(
        capacity=1000, fields={"obs": ((4, H, W), np.uint8), "action": ((), np.int64),
                               "reward": ((), np.float32), "extra": ((2,), np.int16)},
        frame_stack=4)
    streams = Streams(rng, 4, 1, 0.0, 0.0, 0.0)
    run_streams(buf, streams, 300, [], use_extend=False, rng=rng)
    # One reset frame (its padding repeats it) and then one new frame a step.
    assert hook.frames(buf).fw <= 1 + 300


@pytest.mark.parametrize("bad, match", [
    (dict(obs=np.zeros((3, H, W), np.uint8)), r"obs must have shape \(4, 5, 3\)"),
    (dict(next_obs=None), "missing field"),
])
def test_bad_stacks_leave_buffer_unchanged(bad, match):
    buf = bigper.PrioritizedReplayBuffer(
        capacity=10, fields={"obs": ((4, H, W), np.uint8), "action": ((), np.int64)}, frame_stack=4)
    good = dict(obs=np.ones((4, H, W), np.uint8), next_obs=np.ones((4, H, W), np.uint8), action=1)
    buf.add(**good)
    before = (hook.frames(buf).fw, hook.ring(buf).count, buf.prioritization.tree.sums.copy(), hook.frames(buf).last_frames.copy())
    step = {**good, **bad}
    step = {k: v for k, v in step.items() if v is not None}
    with pytest.raises((ValueError, KeyError), match=match):
        buf.add(**step)
    after = (hook.frames(buf).fw, hook.ring(buf).count, buf.prioritization.tree.sums, hook.frames(buf).last_frames)
    assert before[0] == after[0] and before[1] == after[1]
    np.testing.assert_array_equal(before[2], after[2])
    np.testing.assert_array_equal(before[3], after[3])


def test_env_axis_of_wrong_length():
    buf = bigper.PrioritizedReplayBuffer(
        capacity=10, fields={"obs": ((2, H, W), np.uint8), "action": ((), np.int64)},
        frame_stack=2, num_envs=3)
    z = np.zeros((2, 2, H, W), np.uint8)
    with pytest.raises(ValueError, match=r"obs must have shape \(3, 2, 5, 3\), got \(2, 2, 5, 3\)"):
        buf.add(obs=z, next_obs=z, action=np.zeros(2, np.int64))
    assert len(buf) == 0


def test_frame_stack_needs_a_stack_axis():
    with pytest.raises(ValueError, match=r"frame_stack=4 needs fields\['obs'\] of shape \(4, \.\.\.\)"):
        bigper.PrioritizedReplayBuffer(capacity=10, fields={"obs": ((84, 84), np.uint8)}, frame_stack=4)
    with pytest.raises(ValueError, match="needs an 'obs' field"):
        bigper.PrioritizedReplayBuffer(capacity=10, fields={"x": ((4, 2), np.uint8)}, frame_stack=4)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_stacks_held_by_the_caller_are_never_reused(compression):
    """Sampling reuses a previous batch's stack arrays only once nothing refers to them."""
    rng = np.random.default_rng(3)
    buf = bigper.PrioritizedReplayBuffer(
        capacity=200, fields={"obs": ((4, H, W), np.uint8), "action": ((), np.int64),
                              "reward": ((), np.float32), "extra": ((2,), np.int16)},
        frame_stack=4, seed=3, compression=compression)
    run_streams(buf, Streams(rng, 4, 1, 0.05, 0.0, 0.1), 150, [], use_extend=False, rng=rng)
    held = buf.sample(16)
    want = held["obs"].copy(), held["next_obs"].copy()
    view = buf.sample(16)["obs"][3]  # only a view of a batch's array survives
    want_view = view.copy()
    for _ in range(20):
        buf.sample(16)
    np.testing.assert_array_equal(held["obs"], want[0])
    np.testing.assert_array_equal(held["next_obs"], want[1])
    np.testing.assert_array_equal(view, want_view)
