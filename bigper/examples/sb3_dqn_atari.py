"""Stable-Baselines3's DQN with prioritized replay on disk, through bigper's drop-in.

::

    python -m bigper.examples.sb3_dqn_atari --game Pong --steps 2000000 --dir runs/sb3-pong
    python -m bigper.examples.sb3_dqn_atari --smoke      # a few hundred steps, under a minute

The environment is SB3's own: ``make_atari_env`` (the DQN paper's wrappers,
84x84x1 frames) and ``VecFrameStack(4)``, so observations are (84, 84, 4),
stacked on the channel axis. The model is ``PrioritizedDQN`` (SB3's DQN with
an IS-weighted loss and ``|TD|`` written back, beta annealed to 1.0 over the
run) over ``bigper.integrations.sb3.PrioritizedReplayBuffer`` with
``frame_stack=4`` and memmap storage: each frame is stored once on disk, about
7.2 KB a transition, where SB3's own buffer keeps 56 KB a transition in RAM.

Halfway through ``learn(steps)``, the run is saved as a preempted job would be (``model.save`` and
``model.save_replay_buffer``: the pickle holds a reference to a bigper
snapshot in ``<dir>/replay_buffer.bigper/``, not the transitions), the model
is dropped, and a new one is loaded from disk and finishes the run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bigper.examples.sb3_dqn_atari",
                                description=__doc__.split("\n")[0])
    p.add_argument("--game", default="Pong")
    p.add_argument("--steps", type=int, default=2_000_000, help="env steps (4 frames each)")
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--learning-starts", type=int, default=80_000)
    p.add_argument("--train-freq", type=int, default=4, help="env steps between gradient steps")
    p.add_argument("--dir", help="run directory (default runs/sb3-<game>-<timestamp>)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny run in a temporary directory (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        # The learner starts late and steps rarely: SB3's Nature CNN on a CPU is the slow part.
        args.steps, args.buffer_size, args.learning_starts, args.train_freq = 300, 2_000, 120, 16
    return args


def StopAt(n: int):
    """An SB3 callback that ends ``learn`` after ``n`` env steps."""
    from stable_baselines3.common.callbacks import BaseCallback

    class _StopAt(BaseCallback):
        def _on_step(self) -> bool:
            return self.num_timesteps < n

    return _StopAt()


def make_env(game: str, seed: int):
    try:
        import ale_py
        import gymnasium as gym
        from stable_baselines3.common.env_util import make_atari_env
        from stable_baselines3.common.vec_env import VecFrameStack
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this example needs SB3 and the Atari extra: "
                          "pip install -e '.[sb3,atari]' in a bigper checkout") from e
    gym.register_envs(ale_py)
    return VecFrameStack(make_atari_env(f"{game}NoFrameskip-v4", n_envs=1, seed=seed), n_stack=4)


def build(args, env, run: Path):
    from bigper.integrations.sb3 import PrioritizedDQN

    replay = {"frame_stack": 4, "storage": "memmap", "path": str(run / "replay"),
              "alpha": 0.6, "beta": 0.4, "seed": args.seed}
    return PrioritizedDQN("CnnPolicy", env, learning_rate=1e-4, buffer_size=args.buffer_size,
                          learning_starts=args.learning_starts, batch_size=32, train_freq=args.train_freq,
                          gradient_steps=1, target_update_interval=1000 if not args.smoke else 50,
                          exploration_fraction=0.1, exploration_final_eps=0.01,
                          replay_buffer_kwargs=replay, device=args.device, seed=args.seed, verbose=0)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bigper.integrations.sb3 import PrioritizedDQN

    if args.smoke:
        torch.set_num_threads(1)  # CI machines are shared; more threads only contend

    tmp = tempfile.mkdtemp(prefix="bigper-sb3-") if args.smoke else None
    run = Path(tmp) if tmp else Path(args.dir or f"runs/sb3-{args.game.lower()}-{time.strftime('%Y%m%d-%H%M%S')}")
    run.mkdir(parents=True, exist_ok=True)
    try:
        env = make_env(args.game, args.seed)
        model = build(args, env, run)
        first = args.steps // 2
        t0 = time.perf_counter()
        # learn(total) as planned; a callback stops it halfway, as a preemption would.
        model.learn(args.steps, callback=StopAt(first))
        first = model.num_timesteps
        rb = model.replay_buffer
        print(f"learned {first} steps in {time.perf_counter() - t0:.1f} s; buffer {rb.size()} steps on "
              f"disk at {run / 'replay'}, beta {rb.beta:.3f}")
        # Save as a preempted job would, then drop everything.
        model.save(run / "model")
        model.save_replay_buffer(run / "replay_buffer")
        expected = rb.buffer.sample(8, beta=1.0).indices if rb.size() else None
        model.replay_buffer.close()
        del model, rb

        # A new process would start here: load the model, then the buffer.
        model = PrioritizedDQN.load(run / "model", env=env, device=args.device)
        model.load_replay_buffer(run / "replay_buffer.pkl")
        rb = model.replay_buffer
        again = rb.buffer.sample(8, beta=1.0).indices if rb.size() else None
        same = expected is None or (again == expected).all()
        print(f"resumed: {rb.size()} steps from the snapshot in {run / 'replay_buffer.bigper'}; "
              f"next sample identical to the saved run's: {bool(same)}")
        if not same:
            print("error: the resumed buffer sampled differently", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        model.learn(args.steps - first, reset_num_timesteps=False)
        print(f"learned {args.steps - first} more steps in {time.perf_counter() - t0:.1f} s; "
              f"final beta {model.replay_buffer.beta:.3f}")
        model.replay_buffer.close()
        env.close()
        if not args.smoke:
            print(f"run directory: {run} (remove with: rm -rf {run})")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
