"""Double DQN with prioritized replay on an Atari game, the buffer on disk.

::

    python -m bigper.examples.dqn_atari --game Pong --steps 5000000 --path runs/dqn-pong \
        --snapshot-every 100000
    python -m bigper.examples.dqn_atari --path runs/dqn-pong --resume   # after a crash or a stop
    python -m bigper.examples.dqn_atari --smoke          # a few hundred steps, under a minute
    python -m bigper.examples.dqn_atari --prioritization rank

The buffer is a memmap ``PrioritizedReplayBuffer`` of 1M transitions (about
7.2 GB: each 84x84 frame is stored once, stacks are rebuilt at sample time),
3-step returns, alpha 0.6, and beta annealed linearly from 0.4 to 1.0 over the
learner's steps. Every 4 env steps the learner samples 32 transitions, takes
one IS-weighted Double DQN step (``_dqn.DoubleDQN``) and writes ``|TD|`` back
as the new priorities. The network runs on CUDA when there is one; batches go
there with ``Batch.to_torch(device)`` (pinned, non-blocking copies).
``--prioritization rank`` samples by rank instead of by priority.

Run directories: each run gets its own (``runs/dqn-<game>-<timestamp>`` by
default), so the same command runs again without touching the last run. The
buffer is created with ``mode="new"``: a ``--path`` that already holds a run
is refused with a message, never mixed in. ``--resume`` continues the run in
``--path`` from its latest snapshot: each snapshot (``Snapshots.save`` with
``metadata=`` and ``files=``) carries the learner's networks and optimizer,
the env step and the exploration RNG, so the buffer, the beta schedule and
the learner continue together (the env restarts at a new episode).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import bigper
from bigper.examples._atari import atari_fields, make_env, q_network
from bigper.examples._dqn import DoubleDQN, epsilon, load_state, save_state


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bigper.examples.dqn_atari", description=__doc__.split("\n")[0])
    p.add_argument("--game", default="Pong")
    p.add_argument("--steps", type=int, default=5_000_000, help="env steps (agent steps, 4 frames each)")
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--path", help="run directory (default runs/dqn-<game>-<timestamp>); the buffer is "
                                  "<path>/replay, snapshots <path>/snaps")
    p.add_argument("--n-step", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learn-every", type=int, default=4)
    p.add_argument("--learning-starts", type=int, default=20_000)
    p.add_argument("--target-every", type=int, default=8_000, help="learner steps between target syncs")
    p.add_argument("--lr", type=float, default=6.25e-5)
    p.add_argument("--explore-steps", type=int, default=250_000, help="epsilon 1 -> 0.01 over these env steps")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="env steps between snapshots of buffer and learner (0: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --path from its latest snapshot (to the --steps it was started with)")
    p.add_argument("--prioritization", choices=("proportional", "rank"), default="proportional",
                   help="P(i) from the priority (proportional, default) or from its rank")
    p.add_argument("--net", default="nature", choices=("nature", "tiny"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10_000)
    p.add_argument("--smoke", action="store_true", help="a tiny run in a temporary directory (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.capacity, args.learning_starts, args.explore_steps = 400, 1_000, 150, 300
        args.target_every, args.snapshot_every, args.net, args.log_every = 50, 300, "tiny", 100
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the env wants the other core
    if args.resume and not args.path:
        print("dqn_atari: --resume needs --path (the run directory to continue)", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="bigper-dqn-") if args.smoke and not args.path else None
    run = Path(tmp or args.path or f"runs/dqn-{args.game.lower()}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        return train(args, run)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _open(args, run: Path, agent, n_actions):
    """The buffer and where the run stands: ``(buf, snaps, step, episodes, rng_state)``."""
    snaps = bigper.Snapshots(run / "snaps", keep=2) if args.snapshot_every or args.resume else None
    if args.resume:
        if snaps.latest() is None:
            raise bigper.PathNotFoundError(f"--resume: no snapshot under {run / 'snaps'} to continue from")
        # The whole run goes back to its snapshot (learner, buffer, random state): the live
        # directory a stopped run left, newer than the snapshot, is replaced on purpose (rewind).
        # The environment starts a new episode, so the one open at the snapshot ends there.
        buf = snaps.load_latest(path=run / "replay", rewind=True)
        info = snaps.last_loaded
        meta, arrays = load_state(info.files["learner.json"].with_suffix(""))
        agent.load_state(meta, arrays)
        m = info.metadata
        print(f"resumed from {info.path.name} at step {m['step']:,} ({len(buf):,} transitions, "
              f"beta {buf.beta:.3f})", flush=True)
        args.steps = int(m["steps"])
        return buf, snaps, int(m["step"]), int(m["episodes"]), m["rng"]
    learner_steps = max(1, (args.steps - args.learning_starts) // args.learn_every)
    # mode="new": a --path that holds an earlier run is refused (PathExistsError), never mixed in.
    buf = bigper.PrioritizedReplayBuffer(
        args.capacity, atari_fields(), frame_stack=4, n_step=args.n_step, gamma=0.99,
        alpha=0.6, beta=bigper.LinearSchedule(0.4, 1.0, max(1, learner_steps - 1)),  # one step per sample()
        prioritization=args.prioritization, storage="memmap", path=run / "replay", mode="new",
        seed=args.seed)
    return buf, snaps, 0, 0, None


def _snapshot(args, run: Path, snaps, buf, agent, step: int, episodes: int, rng) -> Path:
    """Learner first (a temporary file), then buffer and learner in one snapshot."""
    meta, arrays = agent.state()
    tmp = run / "learner-tmp" / "learner"
    save_state(tmp, meta, arrays)
    return snaps.save(buf, metadata={"step": step, "steps": args.steps, "episodes": episodes,
                                     "rng": rng.bit_generator.state},
                      files={"learner.json": tmp.with_suffix(".json"), "learner.npz": tmp.with_suffix(".npz")})


def train(args, run: Path) -> int:
    env = make_env(args.game, seed=args.seed)
    n_actions = env.action_space.n
    agent = DoubleDQN(lambda: q_network(n_actions, size=args.net), lr=args.lr,
                      target_every=args.target_every, device=args.device)
    try:
        buf, snaps, start, n_episodes, rng_state = _open(args, run, agent, n_actions)
    except (bigper.PathExistsError, bigper.PathNotFoundError) as e:
        env.close()
        print(f"dqn_atari: {e}\n  (--resume continues a run from its latest snapshot; a new run needs "
              "a new --path)", file=sys.stderr)
        return 2
    print(f"Double DQN + PER ({args.prioritization}) on ALE/{args.game}-v5: buffer {buf.capacity:,} "
          f"transitions at {run / 'replay'}, net on {args.device}", flush=True)
    rng = np.random.default_rng(args.seed)
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    obs, _ = env.reset(seed=args.seed + n_episodes)
    ret, returns, losses = 0.0, [], []
    t0 = time.perf_counter()
    try:
        for step in range(start + 1, args.steps + 1):
            if rng.random() < epsilon(step, steps=args.explore_steps):
                action = int(rng.integers(n_actions))
            else:
                action = agent.act(obs)
            nxt, reward, term, trunc, _ = env.step(action)
            # Rewards clipped to their sign, as in the DQN papers.
            buf.add(obs=obs, action=action, reward=np.sign(reward), next_obs=nxt,
                    terminated=term, truncated=trunc)
            ret += reward
            obs = nxt
            if term or trunc:
                returns.append(ret)
                ret = 0.0
                obs, _ = env.reset()
            if step >= args.learning_starts and step % args.learn_every == 0:
                batch = buf.sample(args.batch_size)          # beta advances once per call
                td_abs, loss = agent.learn(batch)
                buf.update_priorities(batch, td_abs)         # a tensor on any device is fine
                losses.append(loss)
            if snaps is not None and args.snapshot_every and step % args.snapshot_every == 0:
                snap = _snapshot(args, run, snaps, buf, agent, step, n_episodes + len(returns), rng)
                print(f"  snapshot {snap.name}", flush=True)
            if step % args.log_every == 0 or step == args.steps:
                recent = f"{np.mean(returns[-10:]):.1f}" if returns else "-"
                print(f"step {step:>9,}  episodes {n_episodes + len(returns):>5}  return(last 10) {recent:>6}  "
                      f"loss {np.mean(losses[-100:]) if losses else float('nan'):.4f}  beta {buf.beta:.3f}  "
                      f"{(step - start) / (time.perf_counter() - t0):,.0f} steps/s", flush=True)
    finally:
        env.close()
        buf.close()
        shutil.rmtree(run / "learner-tmp", ignore_errors=True)
    if start >= args.steps:
        print(f"done: the run in {run} had already reached step {args.steps:,}")
        return 0
    if not losses or not np.isfinite(losses).all():
        print("dqn_atari: no finite loss was produced", file=sys.stderr)
        return 1
    print(f"done: {len(losses):,} learner steps, buffer closed at {run / 'replay'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
