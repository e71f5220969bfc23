"""Does prioritized replay help? Double DQN on CartPole-v1: proportional PER, rank PER, uniform.

::

    python tools/learning_check.py                 # 3 seeds x 3 variants, ~10-35 min on 2 cores (--budget-min)
    python tools/learning_check.py --seeds 0 1 2 3 4 --workers 4
    python tools/learning_check.py --variants proportional uniform

The same learner, hyper-parameters and seeds run once per variant:

- ``proportional``: ``alpha=0.6``, beta annealed 0.4 -> 1.0 (the PER paper's
  tuned values for the proportional variant);
- ``rank``: ``prioritization="rank"``, ``alpha=0.7``, beta annealed 0.5 -> 1.0
  (the paper's tuned values for the rank-based variant);
- ``uniform``: ``alpha=0``, where every leaf is 1, sampling is uniform and
  every weight is 1 (the same code path). The measure is
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


# variant -> (prioritization, alpha, beta start); beta ends at 1.0 for the prioritized ones.
VARIANTS = {"proportional": ("proportional", 0.6, 0.4), "rank": ("rank", 0.7, 0.5),
            "uniform": ("proportional", 0.0, None)}
LABEL = {"proportional": "PER proportional", "rank": "PER rank", "uniform": "uniform"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--window", type=int, default=10, help="episodes averaged (10)")
    p.add_argument("--max-steps", type=int, default=60_000, help="env steps per run at most")
    p.add_argument("--budget-min", type=float, default=40.0, help="wall-clock budget for everything, minutes")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="which replay variants to run (all three by default)")
    return p.parse_args(argv)


def one_run(job: dict) -> dict:
    """Train until the target is reached; returns episodes and steps it took (None if not reached)."""
    import gymnasium as gym
    import torch
    from torch import nn

    import bigper
    from bigper.examples._dqn import DoubleDQN, epsilon

    torch.set_num_threads(1)
    seed, variant = job["seed"], job["variant"]
    kind, alpha, beta0 = VARIANTS[variant]
    torch.manual_seed(seed)

    def net():
        return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))

    agent = DoubleDQN(net, lr=1e-3, adam_eps=1e-8, target_every=250, grad_clip=10.0)
    buf = bigper.PrioritizedReplayBuffer(
        50_000, {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        n_step=3, gamma=0.99, alpha=alpha, prioritization=kind,
        # one schedule step per sample() call: one call per env step from step 1,000 on
        beta=bigper.LinearSchedule(beta0, 1.0, max(1, job["max_steps"] - 1_000)) if beta0 is not None else 0.0,
        seed=seed)
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
    return {"seed": seed, "variant": variant, "episodes": reached, "steps": step if reached else None,
            "total_steps": step, "total_episodes": len(returns), "seconds": time.perf_counter() - t0,
            "timed_out": reached is None and time.time() >= job["deadline"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.time() + 60 * args.budget_min
    jobs = [{"seed": s, "variant": v, "max_steps": args.max_steps, "target": args.target,
             "window": args.window, "deadline": deadline} for s in args.seeds for v in args.variants]
    print(f"Double DQN on CartPole-v1 (3-step returns, batch 64, MLP 128x128): "
          f"{', '.join(args.variants)} (proportional alpha 0.6, beta 0.4->1; rank alpha 0.7, beta 0.5->1; "
          f"uniform alpha 0); episodes until the mean return of the last {args.window} "
          f"reaches {args.target:g}; at most {args.max_steps:,} env steps a run; seeds {args.seeds}", flush=True)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        results = []
        for r in pool.imap_unordered(one_run, jobs):
            results.append(r)
            what = (f"reached in {r['episodes']} episodes ({r['steps']:,} steps)" if r["episodes"]
                    else f"not reached after {r['total_episodes']} episodes ({r['total_steps']:,} steps"
                         f"{', time budget' if r['timed_out'] else ''})")
            print(f"  seed {r['seed']} {LABEL[r['variant']]:<16} {what}, {r['seconds']:.0f} s",
                  flush=True)
    print(format_table(results, args))
    print(f"total wall time {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def format_table(results: list, args) -> str:
    by = {(r["seed"], r["variant"]): r for r in results}

    def cell(r):
        return f"{r['episodes']} ({r['steps']:,} steps)" if r["episodes"] else f"not reached (>{r['total_episodes']})"

    def summary(variant):
        eps = [by[(s, variant)]["episodes"] for s in args.seeds]
        got = [e for e in eps if e]
        if len(got) == len(eps):
            return f"median {int(np.median(got))}"
        return f"{len(got)}/{len(eps)} reached" + (f", median of those {int(np.median(got))}" if got else "")

    head = " | ".join(f"{LABEL[v]}: episodes to {args.target:g}" for v in args.variants)
    lines = [f"\n| seed | {head} |", "|---" * (1 + len(args.variants)) + "|"]
    for s in args.seeds:
        lines.append(f"| {s} | " + " | ".join(cell(by[(s, v)]) for v in args.variants) + " |")
    lines.append("| all | " + " | ".join(summary(v) for v in args.variants) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
