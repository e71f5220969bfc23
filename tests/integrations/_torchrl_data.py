"""TensorDicts shaped as a TorchRL collector gives them, for the TorchRL drop-in's tests:
a real ALE env through TorchRL's ``GymWrapper`` + ``CatFrames``, and a synthetic
stream whose frames encode (episode, step) so any mix-up shows in the bytes."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

K, SIDE = 4, 6


def make_env(max_steps: int = 40, game: str = "ALE/Pong-v5"):
    """A real ALE game as TorchRL sees it: 84x84 grayscale frames (Gymnasium's
    AtariPreprocessing), "pixels" stacked by CatFrames(N=4, dim=-3), episodes cut
    by StepCounter (truncation) and ended by the game (termination)."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing
    from torchrl.envs import (CatFrames, Compose, GymWrapper, RenameTransform, RewardSum, StepCounter,
                              TransformedEnv, UnsqueezeTransform)

    gym.register_envs(ale_py)
    e = gym.make(game, frameskip=1, repeat_action_probability=0.0)
    e = AtariPreprocessing(e, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=0)
    return TransformedEnv(GymWrapper(e), Compose(
        RenameTransform(["observation"], ["pixels"]), UnsqueezeTransform(-3, in_keys=["pixels"]),
        CatFrames(N=4, dim=-3, in_keys=["pixels"]), StepCounter(max_steps=max_steps), RewardSum()))


class QNet(torch.nn.Module):
    """A small Q-network over uint8 stacks (4, 84, 84)."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 8, stride=8)
        self.head = torch.nn.Linear(4 * 10 * 10, n_actions)

    def forward(self, x):
        return self.head(self.conv(x.float() / 255).flatten(-3))


def make_actor(env, seed: int = 0):
    from torchrl.modules import QValueActor

    torch.manual_seed(seed)
    actor = QValueActor(QNet(env.action_spec.shape[-1]), in_keys=["pixels"], spec=env.action_spec)
    actor(env.reset())  # (lazy shapes)
    return actor


def frame(ep: int, t: int) -> np.ndarray:
    return np.full((1, SIDE, SIDE), (ep * 37 + t * 5) % 251, np.uint8)


def stream(steps: int, ep_len: int = 7, start: int = 0, truncate_every: int = 3) -> TensorDict:
    """``steps`` collector steps of episodes of ``ep_len`` steps, every
    ``truncate_every``-th episode truncated, the others terminated; "pixels" a
    CatFrames stack (first frame repeated at a reset), as TorchRL gives it."""
    rows = []
    for g in range(start, start + steps):
        ep, t = divmod(g, ep_len)
        last = t == ep_len - 1
        trunc = last and ep % truncate_every == 0
        stack = lambda tt: np.concatenate([frame(ep, max(tt - j, 0)) for j in range(K - 1, -1, -1)])  # noqa: E731
        rows.append(dict(pixels=stack(t), nxt=stack(t + 1), reward=np.float32(g % 5 - 2), term=last and not trunc,
                         trunc=trunc, action=g % 3, step=t))
    n = len(rows)
    col = lambda k, dt: torch.as_tensor(np.array([r[k] for r in rows]), dtype=dt)  # noqa: E731
    flag = lambda k: col(k, torch.bool).reshape(n, 1)  # noqa: E731
    false = torch.zeros(n, 1, dtype=torch.bool)
    return TensorDict({
        "pixels": col("pixels", torch.uint8),
        "action": torch.nn.functional.one_hot(col("action", torch.int64), 3),
        "step_count": col("step", torch.int64).reshape(n, 1),
        "done": false.clone(), "terminated": false.clone(), "truncated": false.clone(),
        "collector": {"traj_ids": torch.as_tensor([(start + i) // ep_len for i in range(n)])},
        "next": {"pixels": col("nxt", torch.uint8), "reward": col("reward", torch.float32).reshape(n, 1),
                 "done": flag("term") | flag("trunc"), "terminated": flag("term"), "truncated": flag("trunc"),
                 "step_count": col("step", torch.int64).reshape(n, 1) + 1},
    }, batch_size=[n])
