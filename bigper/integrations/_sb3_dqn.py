"""PrioritizedDQN: SB3's DQN with prioritized replay (Schaul et al. 2016).

What changes against SB3's ``DQN.train``: the Huber loss of each sampled
transition is weighted by its IS weight, ``|TD error|`` is written back as its
priority, and beta goes linearly from the buffer's ``beta`` to 1.0 over
``learn(total_timesteps)`` (SB3's own progress counter), unless the buffer
was given a schedule. Everything else is SB3's: target network, exploration,
gradient clipping, logging.
"""

from __future__ import annotations

import numpy as np
import torch as th
from stable_baselines3 import DQN
from torch.nn import functional as F

from ..errors import InvalidArgumentError
from ._sb3_buffer import PrioritizedReplayBuffer
from ._sb3_per import annealed_beta
from ._sb3_pickle import save_pickle


class PrioritizedDQN(DQN):
    """SB3's ``DQN`` over ``bigper.integrations.sb3.PrioritizedReplayBuffer``.

    Takes DQN's arguments. ``replay_buffer_class`` defaults to (and must be a
    subclass of) the bigper buffer; ``n_steps`` and ``gamma`` are handed to
    the buffer (SB3 only wires them into its own ``NStepReplayBuffer``).
    """

    def __init__(self, policy, env, *args, replay_buffer_class=None, replay_buffer_kwargs=None,
                 n_steps: int = 1, **kwargs):
        if replay_buffer_class is None:
            replay_buffer_class = PrioritizedReplayBuffer
        if not (isinstance(replay_buffer_class, type) and issubclass(replay_buffer_class, PrioritizedReplayBuffer)):
            raise InvalidArgumentError("PrioritizedDQN needs replay_buffer_class to be bigper's "
                                       f"PrioritizedReplayBuffer or a subclass, got {replay_buffer_class!r}")
        rb_kwargs = dict(replay_buffer_kwargs or {})
        if n_steps > 1:
            rb_kwargs.setdefault("n_steps", n_steps)
        # DQN's _setup_model (run inside super().__init__) builds the buffer;
        # the buffer's gamma follows the model's unless given.
        self._rb_gamma_default = "gamma" not in rb_kwargs
        super().__init__(policy, env, *args, replay_buffer_class=replay_buffer_class,
                         replay_buffer_kwargs=rb_kwargs, **kwargs)

    def _setup_model(self) -> None:
        if getattr(self, "_rb_gamma_default", False):
            self.replay_buffer_kwargs["gamma"] = self.gamma
        super()._setup_model()

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        rb = self.replay_buffer
        beta = None if rb.beta_is_schedule else annealed_beta(rb.beta0, self._current_progress_remaining)
        losses, td_means = [], []
        for _ in range(gradient_steps):
            data = rb.sample(batch_size, env=self._vec_normalize_env, beta=beta)
            discounts = data.discounts if data.discounts is not None else self.gamma
            with th.no_grad():
                next_q, _ = self.q_net_target(data.next_observations).max(dim=1)
                target = data.rewards + (1 - data.dones) * discounts * next_q.reshape(-1, 1)
            current = th.gather(self.q_net(data.observations), dim=1, index=data.actions.long())
            # Per-transition Huber loss, weighted by IS weights: the PER correction.
            per_item = F.smooth_l1_loss(current, target, reduction="none")
            loss = (data.weights * per_item).mean()
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            td = (current - target).detach().abs().reshape(-1)
            td_means.append(float(td.mean()))
            rb.update_priorities(data.indices, td)
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))
        self.logger.record("train/td_abs", np.mean(td_means))
        self.last_beta = rb.buffer.beta if beta is None else beta
        self.logger.record("train/beta", self.last_beta)

    def save_replay_buffer(self, path) -> None:
        """Pickle the buffer as SB3 does, with its bigper snapshot in ``<path>.bigper/``
        (unless the buffer has a ``snapshot_dir``); the pickle is written atomically,
        and a closed buffer is refused before any file is opened."""
        rb = self.replay_buffer
        if rb is None:
            raise InvalidArgumentError("save_replay_buffer: this model has no replay buffer yet")
        save_pickle(rb, path)

    def load_replay_buffer(self, path, truncate_last_traj: bool = True) -> None:
        """Replace the replay buffer by the pickled one; the current one is closed
        first, so that a disk storage's lock is free for the snapshot's."""
        if isinstance(self.replay_buffer, PrioritizedReplayBuffer):
            self.replay_buffer.close()
        super().load_replay_buffer(path, truncate_last_traj)


PrioritizedDQN.__module__ = "bigper.integrations.sb3"  # its public home (pickles, reprs)
