"""Does prioritized replay help? Double DQN on CartPole-v1, PER against uniform replay.

::

    python tools/learning_check.py                 # 3 seeds x {PER, uniform}, at most ~15 min on 2 cores
    python tools/learning_check.py --seeds 0 1 2 3 4 --workers 4

The same learner, hyper-parameters and seeds run twice: once with
``alpha=0.6`` (beta annealed 0.4 -> 1.0) and once with ``alpha=0``, where
every leaf is 1, sampling is uniform and every weight is 1. The measure is
the number of training episodes until the mean return of the last
``--window`` episodes reaches ``--target`` (475, CartPole-v1's solved
threshold). A run that has not reached it after ``--max-steps`` env steps
(or when the time budget runs out) counts as not reached.

Not run in CI: it is a learning result, not a unit test. Its output goes in
the README.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--window", type=int, default=10, help="episodes averaged (10)")
    p.add_argument("--max-steps", type=int, default=60_000, help="env steps per run at most")
    p.add_argument("--budget-min", type=float, default=14.0, help="wall-clock budget for everything, minutes")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (one core each)")
    return p.parse_args(argv)


def one_run(job: dict) -> dict:
    """Train until the target is reached; returns episodes and steps it took (None if not reached)."""
    import gymnasium as gym
    import torch
    from torch import nn

    import bigper
    from bigper.examples._dqn import DoubleDQN, epsilon

    torch.set_num_threads(1)
    seed, per = job["seed"], job["per"]
    torch.manual_seed(seed)

    def net():
        return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))

    agent = DoubleDQN(net, lr=1e-3, adam_eps=1e-8, target_every=250, grad_clip=10.0)
    buf = bigper.PrioritizedReplayBuffer(
        50_000, {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        n_step=3, gamma=0.99, alpha=0.6 if per else 0.0,
        beta=bigper.LinearSchedule(0.4, 1.0, job["max_steps"]) if per else 0.0, seed=seed)
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    returns, step, t0 = [], 0, time.perf_counter()
    reached = None
    while step < job["max_steps"] and reached is None and time.time() < job["deadline"]:
        obs, _ = env.reset(seed=seed * 100_003 + len(returns))
        done, ret = False, 0.0
        while not done:
            eps = epsilon(step, start=1.0, end=0.01, steps=10_000)
            action = int(rng.integers(2)) if rng.random() < eps else agent.act(obs)
            nxt, reward, term, trunc, _ = env.step(action)
            buf.add(obs=obs, action=action, reward=reward, next_obs=nxt, terminated=term, truncated=trunc)
            obs, done, ret, step = nxt, term or trunc, ret + reward, step + 1
            if step >= 1_000:
                batch = buf.sample(64)
                td_abs, _ = agent.learn(batch)
                buf.update_priorities(batch, td_abs)
        returns.append(ret)
        if len(returns) >= job["window"] and np.mean(returns[-job["window"]:]) >= job["target"]:
            reached = len(returns)
    return {"seed": seed, "per": per, "episodes": reached, "steps": step if reached else None,
            "total_steps": step, "total_episodes": len(returns), "seconds": time.perf_counter() - t0,
            "timed_out": reached is None and time.time() >= job["deadline"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.time() + 60 * args.budget_min
    jobs = [{"seed": s, "per": per, "max_steps": args.max_steps, "target": args.target,
             "window": args.window, "deadline": deadline} for s in args.seeds for per in (True, False)]
    print(f"Double DQN on CartPole-v1 (3-step returns, batch 64, MLP 128x128), PER (alpha 0.6, beta "
          f"0.4->1) vs uniform (alpha 0); episodes until the mean return of the last {args.window} "
          f"reaches {args.target:g}; at most {args.max_steps:,} env steps a run; seeds {args.seeds}", flush=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        results = []
        for r in pool.imap_unordered(one_run, jobs):
            results.append(r)
            what = (f"reached in {r['episodes']} episodes ({r['steps']:,} steps)" if r["episodes"]
                    else f"not reached after {r['total_episodes']} episodes ({r['total_steps']:,} steps"
                         f"{', time budget' if r['timed_out'] else ''})")
            print(f"  seed {r['seed']} {'PER    ' if r['per'] else 'uniform'} {what}, {r['seconds']:.0f} s",
                  flush=True)
    print(format_table(results, args))
    print(f"total wall time {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def format_table(results: list, args) -> str:
    by = {(r["seed"], r["per"]): r for r in results}

    def cell(r):
        return f"{r['episodes']} ({r['steps']:,} steps)" if r["episodes"] else f"not reached (>{r['total_episodes']})"

    lines = [f"\n| seed | PER: episodes to {args.target:g} | uniform: episodes to {args.target:g} |",
             "|---|---|---|"]
    for s in args.seeds:
        lines.append(f"| {s} | {cell(by[(s, True)])} | {cell(by[(s, False)])} |")
    def summary(per):
        eps = [by[(s, per)]["episodes"] for s in args.seeds]
        got = [e for e in eps if e]
        if len(got) == len(eps):
            return f"median {int(np.median(got))}"
        return f"{len(got)}/{len(eps)} reached" + (f", median of those {int(np.median(got))}" if got else "")

    lines.append(f"| all | {summary(True)} | {summary(False)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
