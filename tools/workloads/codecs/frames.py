"""Real ALE frames for the compression measurements: six games, random policy,
84x84 grayscale after ``AtariPreprocessing``; cached under /tmp.

``python tools/workloads/codecs/frames.py --fixture`` writes the small committed
fixture tests/data/atari_frames.npz (a few hundred frames per game, zlib'd).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

GAMES = ("Pong", "Breakout", "MsPacman", "Seaquest", "SpaceInvaders", "Qbert")
CACHE = Path(tempfile.gettempdir()) / "bigper_bench_codec_frames"


def record(game: str, n: int, seed: int = 0) -> np.ndarray:
    """``n`` frames of ``game`` under a uniform random policy (resets included)."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.0)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    rng = np.random.default_rng(seed)
    out = np.empty((n, 84, 84), dtype=np.uint8)
    obs, _ = env.reset(seed=seed)
    for i in range(n):
        out[i] = obs
        obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        if term or trunc:
            obs, _ = env.reset()
    env.close()
    return out


def frames(game: str, n: int = 3000) -> np.ndarray:
    """Cached ``record(game, n)``."""
    CACHE.mkdir(exist_ok=True)
    path = CACHE / f"{game}-{n}.npy"
    if path.exists():
        return np.load(path)
    out = record(game, n)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", action="store_true")
    ap.add_argument("-n", type=int, default=3000)
    args = ap.parse_args()
    if args.fixture:
        # Every 4th frame of the first 800: varied, still real play, small on disk.
        out = {g: frames(g, args.n)[:300] for g in GAMES}
        dst = Path(__file__).resolve().parents[3] / "tests" / "data" / "atari_frames.npz"
        np.savez_compressed(dst, **out)
        print(dst, dst.stat().st_size, "bytes")
        return
    for g in GAMES:
        print(g, frames(g, args.n).shape)


if __name__ == "__main__":
    main()
