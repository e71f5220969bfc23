"""Feeding a real Gymnasium vector env in both autoreset modes (the recipe
docs/guide/atari.md documents), checked against a naive record of every transition."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import FrameStackObservation, TimeLimit

import bigper
from tests.frames.test_frames import naive_expectation, window_complete

K, STACK, N_STEP, GAMMA = 3, 3, 3, 0.9
ACTION_SEED = 0
ROOT = Path(__file__).resolve().parents[2]


def make_env():
    # Short episodes, so terminations (pole falls) and truncations (time limit) both happen.
    return FrameStackObservation(TimeLimit(gym.make("CartPole-v1"), max_episode_steps=25), STACK)


def new_buffer(capacity):
    return bigper.PrioritizedReplayBuffer(
        capacity=capacity,
        fields={"obs": ((STACK, 4), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=STACK, n_step=N_STEP, gamma=GAMMA, num_envs=K, seed=0)


def readme_recipes() -> dict:
    """The two loops of the "Vector envs" section of docs/guide/atari.md, exactly as printed."""
    text = (ROOT / "docs/guide/atari.md").read_text()
    section = text[text.index("## Vector envs\n"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    by_mode = {("NEXT_STEP" if "NEXT_STEP" in b else "SAME_STEP"): b for b in blocks}
    assert len(blocks) == 2 and set(by_mode) == {"NEXT_STEP", "SAME_STEP"}, blocks
    return by_mode


class Tee:
    """The real buffer, plus a plain record of every ``add`` (per env, None
    where ``valid`` is False) for the naive expectation."""

    def __init__(self, buf, added):
        self.buf, self.added, self.rows = buf, added, []

    def add(self, *, obs, action, reward, next_obs, terminated, truncated, valid=None):
        self.buf.add(obs=obs, action=action, reward=reward, next_obs=next_obs, terminated=terminated,
                     truncated=truncated, **({} if valid is None else {"valid": valid}))
        self.rows.append(np.asarray(terminated) | np.asarray(truncated))
        for e in range(K):
            self.added.append(None if valid is not None and not valid[e] else dict(
                obs=np.array(obs[e]), next_obs=np.array(next_obs[e]), action=action[e], reward=reward[e],
                term=bool(terminated[e]), trunc=bool(truncated[e])))


def run_recipe(mode: str, buf, steps: int, added: list) -> Tee:
    """Run the documented loop for ``mode`` on a real SyncVectorEnv of K envs."""
    envs = gym.vector.SyncVectorEnv([make_env] * K, autoreset_mode=getattr(gym.vector.AutoresetMode, mode))
    # The recipe seeds the envs (reset(seed=0)) but draws its actions from the
    # action space, whose generator is seeded apart: unseeded, the episodes
    # change from run to run and sometimes no time limit (truncation) falls in
    # the window the test checks. Seeded, every run plays the same episodes.
    envs.action_space.seed(ACTION_SEED)
    tee = Tee(buf, added)
    try:
        exec(compile(readme_recipes()[mode], f"docs/guide/atari.md ({mode})", "exec"),
             {"np": np, "envs": envs, "buf": tee, "steps": steps})
    finally:
        envs.close()
    return tee


def run_next_step(buf, steps, added):
    return run_recipe("NEXT_STEP", buf, steps, added)


def run_same_step(buf, steps, added):
    return run_recipe("SAME_STEP", buf, steps, added)


@pytest.mark.parametrize("runner", [run_next_step, run_same_step])
def test_vector_env_transitions_are_exact(runner):
    capacity = 200
    buf = new_buffer(capacity)
    added: list = []
    tee = runner(buf, 150, added)
    # Every recorded transition's next_obs continues its obs by one frame: a reset
    # observation recorded in place of the episode's final one would not.
    for a in added:
        if a is not None:
            np.testing.assert_array_equal(a["next_obs"][:-1], a["obs"][1:])
    # Steps where some but not all envs ended happened (the ones whose final_obs is None).
    assert any(r.any() and not r.all() for r in tee.rows)
    assert len(buf) == min(len(added), capacity)
    held = range(len(added) - capacity, len(added))
    real = [g for g in held if added[g] is not None]
    assert any(added[g]["term"] for g in real) and any(added[g]["trunc"] for g in real)
    expect = {g % capacity for g in real if _complete(added, g)}
    got = set(np.flatnonzero(buf.prioritization.tree.leaves > 0))
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
