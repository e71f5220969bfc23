"""Feeding a real Gymnasium vector env in both autoreset modes (the recipe
the README documents), checked against a naive record of every transition."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import FrameStackObservation, TimeLimit

import bigper
from tests.test_frames import naive_expectation, window_complete

K, STACK, N_STEP, GAMMA = 3, 3, 3, 0.9


def make_env():
    # Short episodes, so terminations (pole falls) and truncations (time limit) both happen.
    return FrameStackObservation(TimeLimit(gym.make("CartPole-v1"), max_episode_steps=25), STACK)


def new_buffer(capacity):
    return bigper.PrioritizedReplayBuffer(
        capacity=capacity,
        fields={"obs": ((STACK, 4), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=STACK, n_step=N_STEP, gamma=GAMMA, num_envs=K, seed=0)


def run_next_step(buf, steps, added):
    """NEXT_STEP: the step after an episode end only resets that env; pass
    valid=False for it so the env's stream stays aligned."""
    envs = gym.vector.SyncVectorEnv([make_env] * K, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    obs, _ = envs.reset(seed=0)
    resetting = np.zeros(K, dtype=bool)
    for _ in range(steps):
        action = envs.action_space.sample()
        nxt, reward, term, trunc, _ = envs.step(action)
        buf.add(obs=obs, action=action, reward=reward, next_obs=nxt, terminated=term,
                truncated=trunc, valid=~resetting)
        for e in range(K):
            added.append(None if resetting[e] else dict(
                obs=obs[e].copy(), next_obs=nxt[e].copy(), action=action[e], reward=reward[e],
                term=bool(term[e]), trunc=bool(trunc[e])))
        resetting = term | trunc
        obs = nxt
    envs.close()


def run_same_step(buf, steps, added):
    """SAME_STEP: an ended env returns its reset obs at once and the final
    obs in info["final_obs"]: that final obs is the transition's next_obs."""
    envs = gym.vector.SyncVectorEnv([make_env] * K, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=0)
    for _ in range(steps):
        action = envs.action_space.sample()
        nxt, reward, term, trunc, info = envs.step(action)
        real_next = nxt.copy()
        done = term | trunc
        for e in np.flatnonzero(done):
            real_next[e] = info["final_obs"][e]
        buf.add(obs=obs, action=action, reward=reward, next_obs=real_next, terminated=term,
                truncated=trunc)
        for e in range(K):
            added.append(dict(obs=obs[e].copy(), next_obs=real_next[e].copy(), action=action[e],
                              reward=reward[e], term=bool(term[e]), trunc=bool(trunc[e])))
        obs = nxt
    envs.close()


@pytest.mark.parametrize("runner", [run_next_step, run_same_step])
def test_vector_env_transitions_are_exact(runner):
    capacity = 200
    buf = new_buffer(capacity)
    added: list = []
    runner(buf, 150, added)
    assert len(buf) == min(len(added), capacity)
    held = range(len(added) - capacity, len(added))
    real = [g for g in held if added[g] is not None]
    assert any(added[g]["term"] for g in real) and any(added[g]["trunc"] for g in real)
    expect = {g % capacity for g in real if _complete(added, g)}
    got = set(np.flatnonzero(buf._tree.leaves > 0))
    # Short episodes cost a reset frame each, more than the frame ring's
    # margin: the oldest transitions may lose their frames (and must then
    # not be sampled), but no others.
    assert got <= expect and len(got) >= 0.8 * len(expect)
    batch = buf.sample(256)
    for i in range(batch.size):
        g = int(batch.generations[i])
        a = added[g]
        assert a is not None, "sampled a reset-only step"
        ret, nxt, term, disc = naive_expectation(added, g, N_STEP, K, GAMMA)
        np.testing.assert_array_equal(batch["obs"][i], a["obs"])
        np.testing.assert_array_equal(batch["next_obs"][i], nxt)
        assert batch["action"][i] == a["action"]
        np.testing.assert_allclose(batch["reward"][i], ret, rtol=1e-6)
        assert bool(batch["terminated"][i]) == term
        np.testing.assert_allclose(batch["discount"][i], disc, rtol=1e-6)


def _complete(added, g):
    return window_complete(added, g, N_STEP, K)


def test_valid_false_only_after_an_episode_end():
    buf = new_buffer(20)
    z = np.zeros((K, STACK, 4), np.float32)
    step = dict(obs=z, next_obs=z, action=np.zeros(K, np.int64), reward=np.zeros(K, np.float32))
    buf.add(**step)  # an episode in progress for every env
    with pytest.raises(ValueError, match="valid is False for env 1 at row 1"):
        buf.add(**step, valid=np.array([True, False, True]))
    assert len(buf) == K
    buf.add(**step, terminated=np.array([False, True, False]))
    buf.add(**step, valid=np.array([True, False, True]))
    assert len(buf) == 3 * K
