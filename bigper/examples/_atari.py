"""What the demo and the Atari example share: the environment and a small Q-network."""

from __future__ import annotations

import numpy as np

# The ALE settings of the DQN papers: AtariPreprocessing does the frame skipping
# (4, max-pooled over the last two frames) and up to 30 no-op starts, so the base
# env runs with frameskip=1; no sticky actions (v5's default is 0.25).
ALE_KWARGS = {"frameskip": 1, "repeat_action_probability": 0.0}
STACK = 4
SIZE = 84


def make_env(game: str = "Pong", *, seed: int = 0):
    """``ALE/<game>-v5`` through ``AtariPreprocessing`` (84x84 grayscale, frame
    skip 4, no-op starts) and ``FrameStackObservation(4)``: observations are
    (4, 84, 84) uint8."""
    try:
        import ale_py
        import gymnasium as gym
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the Atari demo and examples need gymnasium and ale-py: "
                          "pip install -e '.[atari]' in a bigper checkout") from e
    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", **ALE_KWARGS)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=SIZE,
                                          grayscale_obs=True, terminal_on_life_loss=False)
    env = gym.wrappers.FrameStackObservation(env, STACK)
    env.action_space.seed(seed)
    return env


def atari_fields() -> dict:
    return {"obs": ((STACK, SIZE, SIZE), np.uint8), "action": ((), np.int64),
            "reward": ((), np.float32)}


def q_network(n_actions: int, *, size: str = "tiny"):
    """A conv Q-network over (B, 4, 84, 84) uint8 stacks.

    ``"tiny"``: every other pixel (42x42), one 4x4 stride-4 conv and a
    64-unit layer; about 4 ms per Double DQN update of 32 on one CPU core,
    so that in the demo the buffer, not the network, is what is measured.
    ``"nature"``: the DQN paper's network.
    """
    import torch
    from torch import nn

    class QNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stride = 2 if size == "tiny" else 1
            if size == "tiny":
                self.body = nn.Sequential(nn.Conv2d(STACK, 16, 4, stride=4), nn.ReLU(), nn.Flatten(),
                                          nn.Linear(16 * 10 * 10, 64), nn.ReLU())
                width = 64
            elif size == "nature":
                self.body = nn.Sequential(
                    nn.Conv2d(STACK, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                    nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, 512),
                    nn.ReLU())
                width = 512
            else:
                raise ValueError(f"size must be 'tiny' or 'nature', got {size!r}")
            self.head = nn.Linear(width, n_actions)

        def forward(self, obs):
            if self.stride > 1:  # subsample while still uint8: 4x fewer bytes to convert
                obs = obs[..., ::self.stride, ::self.stride]
            return self.head(self.body(obs.to(torch.float32) / 255.0))

    return QNet()
