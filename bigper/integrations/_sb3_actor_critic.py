"""PrioritizedSAC, PrioritizedTD3, PrioritizedDDPG: SB3's actor-critic
algorithms with prioritized replay.

Each ``train`` is SB3's (stable-baselines3 2.9) with its sampling and critic
loss lines replaced by the shared PER calls (``_sb3_per``): each
transition's squared TD error is weighted by its IS weight in the critic
loss, and the mean of ``|Q_k - y|`` over the critics is written back as its
priority after every gradient step. The actor loss stays unweighted, as in
the papers that add PER to TD3 and SAC: the IS correction is for the biased
regression target, and the actor's objective has no target. DDPG is SB3's
TD3 with one critic and no delay, and so is ``PrioritizedDDPG``.
"""

from __future__ import annotations

import numpy as np
import torch as th
from stable_baselines3 import DDPG, SAC, TD3
from stable_baselines3.common.utils import polyak_update

from ._sb3_per import PrioritizedAlgorithm, mse_loss

__all__ = ["PrioritizedDDPG", "PrioritizedSAC", "PrioritizedTD3"]


class PrioritizedSAC(PrioritizedAlgorithm, SAC):
    """SB3's ``SAC`` over bigper's ``PrioritizedReplayBuffer``; takes SAC's arguments."""

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        """SB3's SAC step, with each critic's loss weighted by its IS weight and the mean ``|TD|`` of both critics written back."""
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
                next_q_values = th.cat(self.critic_target(replay_data.next_observations, next_actions), dim=1)
                next_q_values, _ = th.min(next_q_values, dim=1, keepdim=True)
                next_q_values = next_q_values - ent_coef * next_log_prob.reshape(-1, 1)
                target_q_values = replay_data.rewards + (1 - replay_data.dones) * discounts * next_q_values
            current_q_values = self.critic(replay_data.observations, replay_data.actions)
            critic_loss, td = mse_loss(current_q_values, target_q_values, replay_data.weights, scale=0.5)
            critic_losses.append(critic_loss.item())
            self.critic.optimizer.zero_grad()
            critic_loss.backward()
            self.critic.optimizer.step()
            self._per_write_back(replay_data, td)
            q_values_pi = th.cat(self.critic(replay_data.observations, actions_pi), dim=1)
            min_qf_pi, _ = th.min(q_values_pi, dim=1, keepdim=True)
            actor_loss = (ent_coef * log_prob - min_qf_pi).mean()
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


class PrioritizedTD3(PrioritizedAlgorithm, TD3):
    """SB3's ``TD3`` over bigper's ``PrioritizedReplayBuffer``; takes TD3's arguments."""

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """SB3's TD3 (and DDPG) step, with each critic's loss weighted by its IS weight and the mean ``|TD|`` over the critics written back."""
        self.policy.set_training_mode(True)
        self._update_learning_rate([self.actor.optimizer, self.critic.optimizer])
        actor_losses, critic_losses = [], []
        for _ in range(gradient_steps):
            self._n_updates += 1
            replay_data = self._per_sample(batch_size)
            discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
            with th.no_grad():
                noise = replay_data.actions.clone().data.normal_(0, self.target_policy_noise)
                noise = noise.clamp(-self.target_noise_clip, self.target_noise_clip)
                next_actions = (self.actor_target(replay_data.next_observations) + noise).clamp(-1, 1)
                next_q_values = th.cat(self.critic_target(replay_data.next_observations, next_actions), dim=1)
                next_q_values, _ = th.min(next_q_values, dim=1, keepdim=True)
                target_q_values = replay_data.rewards + (1 - replay_data.dones) * discounts * next_q_values
            current_q_values = self.critic(replay_data.observations, replay_data.actions)
            critic_loss, td = mse_loss(current_q_values, target_q_values, replay_data.weights)
            critic_losses.append(critic_loss.item())
            self.critic.optimizer.zero_grad()
            critic_loss.backward()
            self.critic.optimizer.step()
            self._per_write_back(replay_data, td)
            if self._n_updates % self.policy_delay == 0:
                actor_loss = -self.critic.q1_forward(replay_data.observations,
                                                     self.actor(replay_data.observations)).mean()
                actor_losses.append(actor_loss.item())
                self.actor.optimizer.zero_grad()
                actor_loss.backward()
                self.actor.optimizer.step()
                polyak_update(self.critic.parameters(), self.critic_target.parameters(), self.tau)
                polyak_update(self.actor.parameters(), self.actor_target.parameters(), self.tau)
                polyak_update(self.critic_batch_norm_stats, self.critic_batch_norm_stats_target, 1.0)
                polyak_update(self.actor_batch_norm_stats, self.actor_batch_norm_stats_target, 1.0)
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if len(actor_losses) > 0:
            self.logger.record("train/actor_loss", np.mean(actor_losses))
        self.logger.record("train/critic_loss", np.mean(critic_losses))
        self._per_log()


class PrioritizedDDPG(PrioritizedTD3, DDPG):
    """SB3's ``DDPG`` (TD3 with one critic, no delay, no target noise) over
    bigper's buffer; takes DDPG's arguments and trains with ``PrioritizedTD3.train``."""


for _cls in (PrioritizedSAC, PrioritizedTD3, PrioritizedDDPG):
    _cls.__module__ = "bigper.integrations.sb3"  # their public home (pickles, reprs)
