"""DQN Replay Dataset files for tests: real ALE play recorded the way Dopamine's
circular replay buffer records it, saved the way its checkpoints are saved
(each array ``np.save``-d into a gzip file), and a reference of every sampleable
transition built from those files by the format's rules.

The recorder is written from the format's description (module doc of
``bigper/offline/dqn_replay.py``), not from Dopamine's code.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

K = 4


def play(game: str = "Breakout", steps: int = 3000, seed: int = 0, max_len: int | None = None):
    """``steps`` agent steps of random play: ``(frames (steps, 84, 84) uint8, actions, rewards,
    ends)`` where ``ends[t]`` marks the last step of an episode (game over, or ``max_len``
    steps, which Dopamine's logged runs also record as terminal)."""
    import cv2
    import gymnasium as gym
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", obs_type="grayscale", frameskip=4, repeat_action_probability=0.25)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    frames, actions, rewards, ends = [], [], [], []
    t = 0
    for _ in range(steps):
        frames.append(cv2.resize(obs, (84, 84), interpolation=cv2.INTER_AREA))
        a = int(rng.integers(env.action_space.n))
        obs, r, term, trunc, _ = env.step(a)
        t += 1
        end = term or trunc or (max_len is not None and t >= max_len)
        actions.append(a)
        rewards.append(r)
        ends.append(end)
        if end:
            obs, _ = env.reset()
            t = 0
    env.close()
    return (np.stack(frames), np.array(actions, np.int32), np.array(rewards, np.float32), np.array(ends, bool))


class Recorder:
    """A circular buffer of ``capacity`` slots, as the format records adds."""

    def __init__(self, capacity: int, horizon: int = 1, shape=(84, 84)):
        self.c, self.h = capacity, horizon
        self.obs = np.zeros((capacity, *shape), np.uint8)
        self.action = np.zeros(capacity, np.int32)
        self.reward = np.zeros(capacity, np.float32)
        self.terminal = np.zeros(capacity, np.uint8)
        self.add_count = 0

    def _put(self, o, a, r, t):
        i = self.add_count % self.c
        self.obs[i], self.action[i], self.reward[i], self.terminal[i] = o, a, r, t
        self.add_count += 1

    def add(self, o, a, r, t) -> None:
        if self.add_count == 0 or self.terminal[(self.add_count - 1) % self.c] == 1:
            for _ in range(K - 1):  # the pads before an episode's first step
                self._put(0, 0, 0.0, 0)
        self._put(o, a, r, int(t))

    def invalid_range(self):
        cur = self.add_count % self.c
        return np.array([(cur - self.h + i) % self.c for i in range(K + self.h)])

    def save(self, run: Path, n: int, add_count: int | None = None) -> None:
        run.mkdir(parents=True, exist_ok=True)
        arrays = {"$store$_observation": self.obs, "$store$_action": self.action,
                  "$store$_reward": self.reward, "$store$_terminal": self.terminal,
                  "add_count": np.array(self.add_count if add_count is None else add_count),
                  "invalid_range": self.invalid_range()}
        for name, a in arrays.items():
            write_npy_gz(run / f"{name}_ckpt.{n}.gz", a)


def write_npy_gz(path: Path, a: np.ndarray) -> None:
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb") as g:
        np.save(g, a, allow_pickle=False)


def load_npy_gz(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as g:
        return np.load(g, allow_pickle=False)


def logged_run(run: Path, game="Breakout", capacity=1000, checkpoints=3, seed=0, max_len=None,
               final=True):
    """A run as batch_rl logs it: a checkpoint each time the cursor reaches ``capacity - 1``,
    and (``final``) the last, partly filled lap with add_count set to the cursor."""
    rec = Recorder(capacity)
    frames, actions, rewards, ends = play(game, capacity * checkpoints + capacity // 2, seed, max_len)
    logged = 0
    for t in range(frames.shape[0]):
        rec.add(frames[t], actions[t], rewards[t], ends[t])
        if rec.add_count % capacity == capacity - 1 and logged < checkpoints:
            rec.save(run, logged)
            logged += 1
    if final:
        rec.save(run, logged, add_count=rec.add_count % capacity)
    return rec


def reference(run: Path, n: int):
    """The sampleable transitions of checkpoint ``n`` by the format's rules, in the order
    they were added: a dict of obs, next_obs (stacks), action, reward, terminal."""
    ld = lambda name: load_npy_gz(run / f"{name}_ckpt.{n}.gz")  # noqa: E731
    obs, act, rew, term = (ld(f"$store${k}") for k in ("_observation", "_action", "_reward", "_terminal"))
    add_count, inv = int(ld("add_count")), ld("invalid_range")
    c = obs.shape[0]
    h = inv.shape[0] - K
    cur = add_count % c
    full = add_count >= c
    out = {k: [] for k in ("obs", "next_obs", "action", "reward", "terminal")}
    order = [(cur + p) % c for p in range(c)] if full else list(range(add_count))
    for i in order:
        if not full and not (K - 1 <= i < cur - h):
            continue
        if i in set(int(x) for x in inv):
            continue
        if any(term[(i - j) % c] for j in range(1, K)):
            continue
        out["obs"].append(obs[[(i - K + 1 + j) % c for j in range(K)]])
        out["next_obs"].append(obs[[(i - K + 2 + j) % c for j in range(K)]])
        out["action"].append(act[i])
        out["reward"].append(rew[i])
        out["terminal"].append(bool(term[i]))
    return {k: np.array(v) for k, v in out.items()}


def two_checkpoints(run: Path, capacity: int = 300) -> Path:
    """Breakout saved twice in a ring of ``capacity`` (``capacity - 10`` adds, then
    ``2 * capacity + 20``: the second wraps), episodes of at most 60 steps."""
    frames, act, rew, ends = play("Breakout", 2 * capacity + 50, seed=2, max_len=60)
    rec = Recorder(capacity)
    for t in range(frames.shape[0]):
        rec.add(frames[t], act[t], rew[t], ends[t])
        if t in (capacity - 10, 2 * capacity + 20):
            rec.save(run, 0 if t < capacity else 1)
    return run
