"""SAC with twin critics on Pendulum-v1, with prioritized replay (or uniform).

::

    python -m bigper.examples.sac                 # 20k steps, prioritized
    python -m bigper.examples.sac --no-per        # the same with uniform replay
    python -m bigper.examples.sac --prioritization rank   # rank-based prioritized replay
    python -m bigper.examples.sac --smoke         # a short run (CI)

How prioritized replay meets a twin-critic learner:

- Each critic has its own TD error, ``delta_j = y - Q_j(s, a)``. The priority
  written back is their mean magnitude, ``(|delta_1| + |delta_2|) / 2``: a
  transition is interesting when the critics, together, miss it; either
  critic alone would tilt sampling toward its own errors.
- The critic loss is weighted by the importance-sampling weights,
  ``mean_i w_i * (delta_1,i ** 2 + delta_2,i ** 2) / 2``, which undoes the
  bias of sampling in proportion to priority (beta annealed 0.4 -> 1.0).
- The actor and temperature losses are plain means over the batch: they
  do not estimate an expectation under the replay distribution's TD targets.
- ``--no-per`` builds the same buffer with ``alpha=0``: every leaf is 1, so
  sampling is uniform and every weight is 1, with no other code path.
- ``--prioritization rank`` ranks transitions by that priority instead
  (``P`` from ``rank ** -alpha``): less sensitive to a few huge TD errors,
  which a twin critic early in training produces.

The buffer lives in memory (``storage="memory"``, nothing on disk), so the
script runs again as often as you like; each run starts fresh.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import bigper


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bigper.examples.sac", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--use-per", dest="use_per", action="store_true", default=True,
                   help="prioritized replay (the default)")
    p.add_argument("--no-per", dest="use_per", action="store_false", help="uniform replay (alpha=0)")
    p.add_argument("--prioritization", choices=("proportional", "rank"), default="proportional",
                   help="P(i) from the priority (proportional, default) or from its rank")
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-starts", type=int, default=1_000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005, help="target critics' Polyak step")
    p.add_argument("--eval-every", type=int, default=5_000)
    p.add_argument("--eval-episodes", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a short run (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.learning_starts, args.batch_size, args.hidden = 500, 200, 64, 64
        args.eval_every, args.eval_episodes = 500, 1
    return args


def mlp(n_in: int, n_out: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, n_out))


class Actor(nn.Module):
    """A tanh-squashed Gaussian policy scaled to the action bounds."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, scale: float):
        super().__init__()
        self.body = mlp(obs_dim, 2 * act_dim, hidden)
        self.scale = scale

    def forward(self, obs, deterministic: bool = False):
        mean, log_std = self.body(obs).chunk(2, dim=-1)
        if deterministic:
            return self.scale * torch.tanh(mean), None
        log_std = log_std.clamp(-5.0, 2.0)
        u = mean + log_std.exp() * torch.randn_like(mean)
        # log N(u) minus the log-determinant of a = scale * tanh(u), computed stably.
        logp = (-0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - (2 * (math.log(2) - u - F.softplus(-2 * u)) + math.log(self.scale)).sum(-1)
        return self.scale * torch.tanh(u), logp


class Critic(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int):
        super().__init__()
        self.q = mlp(obs_dim + act_dim, 1, hidden)

    def forward(self, obs, act):
        return self.q(torch.cat([obs, act], dim=-1)).squeeze(-1)


class SAC:
    def __init__(self, obs_dim: int, act_dim: int, scale: float, args):
        h = args.hidden
        self.actor = Actor(obs_dim, act_dim, h, scale)
        self.q1, self.q2 = Critic(obs_dim, act_dim, h), Critic(obs_dim, act_dim, h)
        self.q1_targ, self.q2_targ = Critic(obs_dim, act_dim, h), Critic(obs_dim, act_dim, h)
        self.q1_targ.load_state_dict(self.q1.state_dict())
        self.q2_targ.load_state_dict(self.q2.state_dict())
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.pi_opt = torch.optim.Adam(self.actor.parameters(), lr=args.lr)
        self.q_opt = torch.optim.Adam([*self.q1.parameters(), *self.q2.parameters()], lr=args.lr)
        self.a_opt = torch.optim.Adam([self.log_alpha], lr=args.lr)
        self.tau = args.tau

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = False) -> np.ndarray:
        a, _ = self.actor(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic)
        return a[0].numpy()

    def learn(self, batch) -> tuple[torch.Tensor, dict]:
        """One SAC step from a ``bigper.Batch``; returns the new priorities and the losses."""
        t = batch.to_torch()
        s, a, s2 = t["obs"], t["action"], t["next_obs"]
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            a2, logp2 = self.actor(s2)
            q_next = torch.min(self.q1_targ(s2, a2), self.q2_targ(s2, a2)) - alpha * logp2
            y = t["reward"] + t["discount"] * q_next  # discount: gamma, or 0 where terminated
        d1, d2 = y - self.q1(s, a), y - self.q2(s, a)
        q_loss = (t["weights"] * (d1.pow(2) + d2.pow(2))).mean() / 2
        self.q_opt.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_opt.step()

        a_new, logp = self.actor(s)
        q_new = torch.min(self.q1(s, a_new), self.q2(s, a_new))
        pi_loss = (alpha * logp - q_new).mean()
        self.pi_opt.zero_grad(set_to_none=True)
        pi_loss.backward()
        self.pi_opt.step()
        a_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        self.a_opt.zero_grad(set_to_none=True)
        a_loss.backward()
        self.a_opt.step()

        with torch.no_grad():
            for net, targ in ((self.q1, self.q1_targ), (self.q2, self.q2_targ)):
                for p, pt in zip(net.parameters(), targ.parameters()):
                    pt.lerp_(p, self.tau)
        priorities = (d1.detach().abs() + d2.detach().abs()) / 2
        return priorities, {"q": float(q_loss.detach()), "pi": float(pi_loss.detach()), "alpha": float(alpha)}


def evaluate(env, agent: SAC, episodes: int, seed: int) -> float:
    total = 0.0
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            obs, r, term, trunc, _ = env.step(agent.act(obs, deterministic=True))
            total += r
            done = term or trunc
    return total / episodes


def main(argv=None) -> int:
    import gymnasium as gym

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    env, eval_env = gym.make("Pendulum-v1"), gym.make("Pendulum-v1")
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    scale = float(env.action_space.high[0])
    agent = SAC(obs_dim, act_dim, scale, args)
    learner_steps = max(1, args.steps - args.learning_starts)  # one sample() call each
    buf = bigper.PrioritizedReplayBuffer(
        args.capacity,
        {"obs": ((obs_dim,), np.float32), "action": ((act_dim,), np.float32), "reward": ((), np.float32)},
        gamma=args.gamma, alpha=0.6 if args.use_per else 0.0, prioritization=args.prioritization,
        beta=bigper.LinearSchedule(0.4, 1.0, max(1, learner_steps - 1)) if args.use_per else 0.0,
        seed=args.seed)
    kind = f"prioritized ({args.prioritization})" if args.use_per else "uniform"
    print(f"SAC on Pendulum-v1, {kind} replay, {args.steps:,} steps", flush=True)
    rng = np.random.default_rng(args.seed)
    obs, _ = env.reset(seed=args.seed)
    env.action_space.seed(args.seed)
    t0, info, score = time.perf_counter(), {}, float("nan")
    for step in range(1, args.steps + 1):
        if step <= args.learning_starts:
            action = rng.uniform(-scale, scale, act_dim).astype(np.float32)
        else:
            action = agent.act(obs)
        nxt, reward, term, trunc, _ = env.step(action)
        buf.add(obs=obs, action=action, reward=reward, next_obs=nxt, terminated=term, truncated=trunc)
        obs = nxt
        if term or trunc:
            obs, _ = env.reset()
        if step > args.learning_starts:
            batch = buf.sample(args.batch_size)
            priorities, info = agent.learn(batch)
            buf.update_priorities(batch, priorities)  # (|delta1| + |delta2|) / 2
        if step % args.eval_every == 0 or step == args.steps:
            score = evaluate(eval_env, agent, args.eval_episodes, seed=10_000 + step)
            losses = "  ".join(f"{k} {v:.3f}" for k, v in info.items())
            print(f"step {step:>7,}  eval return {score:8.1f}  {losses}  beta {buf.beta:.3f}  "
                  f"{step / (time.perf_counter() - t0):,.0f} steps/s", flush=True)
    ok = info and all(np.isfinite(v) for v in info.values()) and np.isfinite(score)
    print(f"final eval return {score:.1f} ({kind} replay)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
