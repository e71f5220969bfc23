"""Stable-Baselines3's SAC with prioritized replay on disk, through bigper.

::

    python -m bigper.examples.sb3_sac --steps 20000 --dir runs/sb3-sac-pendulum
    python -m bigper.examples.sb3_sac --smoke      # a few hundred steps, seconds

``PrioritizedSAC`` is SB3's SAC whose critic loss weights each transition by
its IS weight and writes the mean ``|TD|`` of its two critics back as its
priority after every gradient step; beta goes from 0.4 to 1.0 over the run.
The buffer is ``bigper.integrations.sb3.PrioritizedReplayBuffer`` on memmap
storage (``<dir>/replay``).

Halfway through ``learn(steps)`` the run is saved as a preempted job would be
(``model.save`` and ``model.save_replay_buffer``: the pickle names a bigper
snapshot in ``<dir>/replay_buffer.bigper/``), the model is dropped, and a new
one is loaded from disk, checked to sample what the saved one would have, and
finishes the run; then it is evaluated over 5 episodes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bigper.examples.sb3_sac", description=__doc__.split("\n")[0])
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--steps", type=int, default=20_000, help="env steps")
    p.add_argument("--buffer-size", type=int, default=200_000)
    p.add_argument("--learning-starts", type=int, default=1_000)
    p.add_argument("--dir", help="run directory (default runs/sb3-sac-<env>-<timestamp>)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny run in a temporary directory (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.buffer_size, args.learning_starts = 300, 1_000, 100
    return args


def stop_at(n: int):
    """An SB3 callback that ends ``learn`` after ``n`` env steps (a preemption)."""
    from stable_baselines3.common.callbacks import BaseCallback

    class _StopAt(BaseCallback):
        def _on_step(self) -> bool:
            return self.num_timesteps < n

    return _StopAt()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import gymnasium as gym
        import torch
        from stable_baselines3.common.evaluation import evaluate_policy
        from stable_baselines3.common.monitor import Monitor
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this example needs SB3: pip install -e '.[sb3]' in a bigper checkout") from e
    from bigper.integrations.sb3 import PrioritizedSAC

    if args.smoke:
        torch.set_num_threads(1)  # CI machines are shared; more threads only contend
    tmp = tempfile.mkdtemp(prefix="bigper-sb3-sac-") if args.smoke else None
    name = args.env.split("-")[0].lower()
    run = Path(tmp) if tmp else Path(args.dir or f"runs/sb3-sac-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run.mkdir(parents=True, exist_ok=True)
    try:
        env = gym.make(args.env)
        replay = {"storage": "memmap", "path": str(run / "replay"), "alpha": 0.6, "beta": 0.4, "seed": args.seed}
        model = PrioritizedSAC("MlpPolicy", env, learning_rate=1e-3, buffer_size=args.buffer_size,
                               learning_starts=args.learning_starts, replay_buffer_kwargs=replay,
                               device=args.device, seed=args.seed, verbose=0)
        first = args.steps // 2
        t0 = time.perf_counter()
        model.learn(args.steps, callback=stop_at(first))  # learn(total) as planned, stopped halfway
        first = model.num_timesteps
        rb = model.replay_buffer
        print(f"learned {first} steps in {time.perf_counter() - t0:.1f} s; buffer {rb.size()} transitions "
              f"on disk at {run / 'replay'}, beta {rb.beta:.3f}")
        model.save(run / "model")
        model.save_replay_buffer(run / "replay_buffer")
        expected = rb.buffer.sample(8, beta=1.0).indices
        rb.close()
        del model, rb

        # A new process would start here: load the model, then the buffer.
        model = PrioritizedSAC.load(run / "model", env=env, device=args.device)
        model.load_replay_buffer(run / "replay_buffer.pkl")
        rb = model.replay_buffer
        same = bool((rb.buffer.sample(8, beta=1.0).indices == expected).all())
        print(f"resumed: {rb.size()} transitions from {run / 'replay_buffer.bigper'}; "
              f"next sample identical to the saved run's: {same}")
        if not same:
            print("error: the resumed buffer sampled differently", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        model.learn(args.steps - first, reset_num_timesteps=False)
        print(f"learned {args.steps - first} more steps in {time.perf_counter() - t0:.1f} s; "
              f"final beta {model.replay_buffer.beta:.3f}")
        eval_env = Monitor(gym.make(args.env))
        mean, std = evaluate_policy(model, eval_env, n_eval_episodes=2 if args.smoke else 5, deterministic=True)
        print(f"mean return over {'2' if args.smoke else '5'} episodes: {mean:.1f} +/- {std:.1f}")
        rb.close()
        env.close()
        if not args.smoke:
            print(f"run directory: {run} (remove with: rm -rf {run})")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
