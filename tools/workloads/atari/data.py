"""Workload "atari", the data: its constants, the recorded Pong frames and the stream.

Every library in main.py (and the learner and torchrl workloads) gets the same :class:`Stream` of
transitions cut from real Pong frames (``real_frames``, cached under /tmp).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from benchkit import short_error

K, H, W = 4, 84, 84
BATCH = 32
ALPHA, BETA = 0.6, 0.4
N_FRAMES = 5000
FRAME_CACHE = Path(tempfile.gettempdir()) / f"bigper_bench_atari_pong_{N_FRAMES}.npy"
TARGET_ROUND = 2.0  # fastest rival round / bigper round
TARGET_ADD = 4.0  # bigper adds per s / fastest rival's
TARGET_BYTES = 7300  # per transition at 1M capacity, on disk + RAM (KB = 1000 bytes)
MILLION = 1_000_000


def real_frames(n: int = N_FRAMES) -> tuple[np.ndarray, str]:
    """``n`` 84x84 uint8 Pong frames (random actions), cached in /tmp; synthetic
    frames when ale-py is not installed. Returns ``(frames, source)``."""
    if FRAME_CACHE.exists():
        f = np.load(FRAME_CACHE)
        if f.shape == (n, H, W):
            return f, f"ALE Pong, {n} frames cached at {FRAME_CACHE}"
    try:
        import ale_py
        import gymnasium as gym
        from gymnasium.wrappers import AtariPreprocessing
    except ImportError as exc:
        from workloads.storage.data import frames as synthetic

        return synthetic(n), f"synthetic frames ({short_error(exc)})"
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    rng = np.random.default_rng(0)
    out = np.empty((n, H, W), dtype=np.uint8)
    obs, _ = env.reset(seed=0)
    for i in range(n):
        out[i] = obs
        obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        if term or trunc:
            obs, _ = env.reset()
    env.close()
    tmp = FRAME_CACHE.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, FRAME_CACHE)
    return out, f"ALE Pong, {n} frames recorded to {FRAME_CACHE}"


class Stream:
    """A periodic stream of transitions over episodes cut from ``frames``.

    Episode ``e`` of length ``L`` is one padded array ``[f0, f0, f0, f0, f1, ..., fL]``;
    step ``t`` has ``obs = pad[t:t+4]`` and ``next_obs = pad[t+1:t+5]`` (views:
    producing a step costs the "environment" nothing). The last step of an
    episode is terminated; the next starts with a reset stack. The stream
    repeats after ``period`` steps (whole episodes).
    """

    def __init__(self, frames: np.ndarray, seed: int = 0):
        rng = np.random.default_rng(seed)
        n = frames.shape[0]
        self.pads, pos = [], 0
        while pos < n - 1200:
            length = int(rng.integers(900, 1101))
            idx = np.concatenate([[pos] * (K - 1), np.arange(pos, pos + length + 1)])
            self.pads.append(frames[idx])
            pos += length + 1
        lengths = [p.shape[0] - K for p in self.pads]
        self.period = sum(lengths)
        self.ep = np.repeat(np.arange(len(lengths)), lengths)
        self.t = np.concatenate([np.arange(length) for length in lengths])
        self.term = self.t == np.repeat(np.array(lengths) - 1, lengths)
        self.action = rng.integers(0, 6, self.period, dtype=np.int64)
        self.reward = rng.standard_normal(self.period).astype(np.float32)
        self.episodes = len(lengths)

    def step(self, g: int) -> tuple[np.ndarray, np.ndarray, int, float, bool]:
        j = g % self.period
        pad, t = self.pads[self.ep[j]], self.t[j]
        return pad[t:t + K], pad[t + 1:t + K + 1], self.action[j], self.reward[j], bool(self.term[j])

    def expected(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """obs and next_obs stacks of global steps ``gids``, and whether each is terminal."""
        obs = np.stack([self.step(int(g))[0] for g in gids])
        nxt = np.stack([self.step(int(g))[1] for g in gids])
        return obs, nxt, self.term[gids % self.period]


def td_pool(n: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [np.abs(rng.standard_normal(BATCH)) + 0.01 for _ in range(n)]

