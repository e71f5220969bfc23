"""PrioritizedDQN: SB3's DQN with prioritized replay (Schaul et al. 2016).

``train`` is SB3's ``DQN.train`` (stable-baselines3 2.9) with its sampling
and loss lines replaced by the shared PER calls (``_sb3_per``): the Huber
loss of each transition is weighted by its IS weight and ``|Q - y|`` is
written back as its priority. Everything else is SB3's: target network,
exploration, gradient clipping, logging.
"""

from __future__ import annotations

import numpy as np
import torch as th
from stable_baselines3 import DQN

from ._sb3_per import PrioritizedAlgorithm, huber_loss

__all__ = ["PrioritizedDQN"]


class PrioritizedDQN(PrioritizedAlgorithm, DQN):
    """SB3's ``DQN`` over ``bigper.integrations.sb3.PrioritizedReplayBuffer``;
    takes DQN's arguments (see ``PrioritizedAlgorithm`` for the buffer's)."""

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """SB3's DQN step, with each Huber loss weighted by its IS weight and ``|TD|`` written back."""
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            replay_data = self._per_sample(batch_size)
            discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
            with th.no_grad():
                next_q_values = self.q_net_target(replay_data.next_observations)
                next_q_values, _ = next_q_values.max(dim=1)
                next_q_values = next_q_values.reshape(-1, 1)
                target_q_values = replay_data.rewards + (1 - replay_data.dones) * discounts * next_q_values
            current_q_values = self.q_net(replay_data.observations)
            current_q_values = th.gather(current_q_values, dim=1, index=replay_data.actions.long())
            loss, td = huber_loss(current_q_values, target_q_values, replay_data.weights)
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            self._per_write_back(replay_data, td)
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))
        self._per_log()


PrioritizedDQN.__module__ = "bigper.integrations.sb3"  # its public home (pickles, reprs)
