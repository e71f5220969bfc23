"""PrioritizedQRDQN and PrioritizedTQC: sb3-contrib's quantile algorithms
with prioritized replay (the ``sb3-contrib`` extra).

Each ``train`` is sb3-contrib's (2.9) with its sampling and loss lines
replaced by the shared PER calls (``_sb3_per``): each transition's part of
the quantile Huber loss is weighted by its IS weight, and the mean
``|y_j - theta_i|`` over every pair of target and current quantile (and, for
TQC, every critic) is written back as its priority. That is the magnitude
the quantile loss is made of; the expected-value TD error ``|mean y - mean
theta|`` can be 0 while the distributions still differ, so it would let
transitions whose distribution is wrong fall out of the sample.
"""

from __future__ import annotations

import numpy as np
import torch as th
from sb3_contrib import QRDQN, TQC
from stable_baselines3.common.utils import polyak_update

from ._sb3_per import PrioritizedAlgorithm, quantile_loss

__all__ = ["PrioritizedQRDQN", "PrioritizedTQC"]


class PrioritizedQRDQN(PrioritizedAlgorithm, QRDQN):
    """sb3-contrib's ``QRDQN`` over bigper's ``PrioritizedReplayBuffer``; takes QRDQN's arguments."""

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """sb3-contrib's QR-DQN step, with each quantile Huber loss weighted by its IS weight and the mean ``|y_j - theta_i|`` written back."""
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            replay_data = self._per_sample(batch_size)
            discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
            with th.no_grad():
                next_quantiles = self.quantile_net_target(replay_data.next_observations)
                next_greedy_actions = next_quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True)
                next_greedy_actions = next_greedy_actions.expand(batch_size, self.n_quantiles, 1)
                next_quantiles = next_quantiles.gather(dim=2, index=next_greedy_actions).squeeze(dim=2)
                target_quantiles = replay_data.rewards + (1 - replay_data.dones) * discounts * next_quantiles
            current_quantiles = self.quantile_net(replay_data.observations)
            actions = replay_data.actions[..., None].long().expand(batch_size, self.n_quantiles, 1)
            current_quantiles = th.gather(current_quantiles, dim=2, index=actions).squeeze(dim=2)
            loss, td = quantile_loss(current_quantiles, target_quantiles, replay_data.weights,
                                     sum_over_quantiles=True)
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            if self.max_grad_norm is not None:
                th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            self._per_write_back(replay_data, td)
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))
        self._per_log()


class PrioritizedTQC(PrioritizedAlgorithm, TQC):
    """sb3-contrib's ``TQC`` over bigper's ``PrioritizedReplayBuffer``; takes TQC's arguments."""

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        """sb3-contrib's TQC step, with each critic's quantile Huber loss weighted by its IS weight and the mean ``|y_j - theta_i|`` written back."""
        self.policy.set_training_mode(True)
        optimizers = [self.actor.optimizer, self.critic.optimizer]
        if self.ent_coef_optimizer is not None:
            optimizers += [self.ent_coef_optimizer]
        self._update_learning_rate(optimizers)
        ent_coef_losses, ent_coefs = [], []
        actor_losses, critic_losses = [], []
        for gradient_step in range(gradient_steps):
            replay_data = self._per_sample(batch_size)
            discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
            if self.use_sde:
                self.actor.reset_noise()
            actions_pi, log_prob = self.actor.action_log_prob(replay_data.observations)
            log_prob = log_prob.reshape(-1, 1)
            ent_coef_loss = None
            if self.ent_coef_optimizer is not None and self.log_ent_coef is not None:
                ent_coef = th.exp(self.log_ent_coef.detach())
                ent_coef_loss = -(self.log_ent_coef * (log_prob + self.target_entropy).detach()).mean()
                ent_coef_losses.append(ent_coef_loss.item())
            else:
                ent_coef = self.ent_coef_tensor
            ent_coefs.append(ent_coef.item())
            if ent_coef_loss is not None and self.ent_coef_optimizer is not None:
                self.ent_coef_optimizer.zero_grad()
                ent_coef_loss.backward()
                self.ent_coef_optimizer.step()
            with th.no_grad():
                next_actions, next_log_prob = self.actor.action_log_prob(replay_data.next_observations)
                next_quantiles = self.critic_target(replay_data.next_observations, next_actions)
                n_target_quantiles = self.critic.quantiles_total - self.top_quantiles_to_drop_per_net * self.critic.n_critics
                next_quantiles, _ = th.sort(next_quantiles.reshape(batch_size, -1))
                next_quantiles = next_quantiles[:, :n_target_quantiles]
                target_quantiles = next_quantiles - ent_coef * next_log_prob.reshape(-1, 1)
                target_quantiles = replay_data.rewards + (1 - replay_data.dones) * discounts * target_quantiles
                target_quantiles.unsqueeze_(dim=1)
            current_quantiles = self.critic(replay_data.observations, replay_data.actions)
            critic_loss, td = quantile_loss(current_quantiles, target_quantiles, replay_data.weights,
                                            sum_over_quantiles=False)
            critic_losses.append(critic_loss.item())
            self.critic.optimizer.zero_grad()
            critic_loss.backward()
            self.critic.optimizer.step()
            self._per_write_back(replay_data, td)
            qf_pi = self.critic(replay_data.observations, actions_pi).mean(dim=2).mean(dim=1, keepdim=True)
            actor_loss = (ent_coef * log_prob - qf_pi).mean()
            actor_losses.append(actor_loss.item())
            self.actor.optimizer.zero_grad()
            actor_loss.backward()
            self.actor.optimizer.step()
            if gradient_step % self.target_update_interval == 0:
                polyak_update(self.critic.parameters(), self.critic_target.parameters(), self.tau)
                polyak_update(self.batch_norm_stats, self.batch_norm_stats_target, 1.0)
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/ent_coef", np.mean(ent_coefs))
        self.logger.record("train/actor_loss", np.mean(actor_losses))
        self.logger.record("train/critic_loss", np.mean(critic_losses))
        if len(ent_coef_losses) > 0:
            self.logger.record("train/ent_coef_loss", np.mean(ent_coef_losses))
        self._per_log()


for _cls in (PrioritizedQRDQN, PrioritizedTQC):
    _cls.__module__ = "bigper.integrations.sb3"  # their public home (pickles, reprs)
