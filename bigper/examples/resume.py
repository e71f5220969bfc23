"""Killed with SIGKILL, resumed from a snapshot, and it continues exactly.

::

    python -m bigper.examples.resume            # 10k steps, killed somewhere past the middle
    python -m bigper.examples.resume --smoke    # a short run (CI)
    python -m bigper.examples.resume --prioritization rank   # the same with rank-based PER

This script is the parent of three training processes (the same code, this
file with ``--role train``), each Double DQN with prioritized replay on
CartPole-v1 with a memmap buffer on disk:

1. ``reference``: trains ``--steps`` steps, never interrupted, no snapshots.
2. ``victim``: trains with a ``Snapshots`` series (``snaps.save(buf)`` every
   ``--snapshot-every`` steps, at the next episode end) and is killed by the
   parent with a real ``SIGKILL`` once it has passed ``--kill-at`` steps,
   wherever it is: mid-step, mid-update, mid-snapshot.
3. ``resumed``: loads the latest snapshot with ``Snapshots.load_latest``
   (taking over the dead writer's live directory), loads the learner state
   saved beside it, and trains on to ``--steps``.

Each training process logs, for every learner step, the sampled indices, the
loss and the buffer's total priority (floats as hex, so bit for bit). The
parent checks that every step the resumed process logs is identical to the
reference's, and that both end with the same total priority and weights.

What makes the continuation exact: the buffer snapshot holds data, priorities,
the sampler's RNG and the beta schedule's position; the learner's state (both
networks, Adam's moments, counters, the exploration RNG) is written, without
pickle, just before each buffer snapshot; the environment is reset with a
seed derived from the episode number, and snapshots are taken at episode ends.

With ``--path``, the run directory is kept; running again with the same
``--path`` replaces what the previous run of this script wrote there (it
leaves a marker file, ``.bigper-resume-example``, and removes only its own
entries) and refuses a directory it did not create. Each fresh buffer is
created with ``mode="new"``, so it never reopens an earlier run's data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bigper.examples.resume", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--snapshot-every", type=int, default=1_000)
    p.add_argument("--kill-at", type=int, help="kill the victim once it passes this step "
                                               "(default: a random step between 40%% and 80%% of --steps)")
    p.add_argument("--learning-starts", type=int, default=500)
    p.add_argument("--path", help="run directory (default: a temporary one, removed at the end)")
    p.add_argument("--prioritization", choices=("proportional", "rank"), default="proportional",
                   help="P(i) from the priority (proportional, default) or from its rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a short run (CI)")
    # internal: a training process
    p.add_argument("--role", choices=("parent", "train"), default="parent", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.snapshot_every, args.learning_starts = 700, 150, 100
        args.kill_at = args.kill_at or 420
    return args


# -- a training process -------------------------------------------------------------

def _cartpole_net():
    from torch import nn

    return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def train(args) -> int:
    import gymnasium as gym
    import torch

    import bigper
    from bigper.examples._dqn import DoubleDQN, epsilon, load_state, save_state

    # One thread: CPU kernels then reduce in one fixed order, so runs repeat bit for bit.
    # (torch.use_deterministic_algorithms would import the compiler stack: seconds per process.)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    run = Path(args.run)
    snaps = bigper.Snapshots(run / "snaps", keep=2) if args.snapshot_every else None
    agent = DoubleDQN(_cartpole_net, lr=5e-4, target_every=250)
    rng = np.random.default_rng(args.seed)
    step, episode = 0, 0
    if args.resume and snaps is not None and snaps.latest() is not None:
        # The killed writer's live directory is taken over: the snapshot's data replace it.
        buf = snaps.load_latest(path=run / "replay")
        step = int(buf.state_dict()[0]["count"])  # transitions ever added = env steps (one env)
        meta, arrays = load_state(run / "learner" / f"step-{step:08d}")
        agent.load_state(meta["agent"], arrays)
        rng.bit_generator.state = meta["rng"]
        episode = int(meta["episode"])
        print(f"resumed at step {step:,} (episode {episode}) from {snaps.latest().name}", flush=True)
    else:
        buf = bigper.PrioritizedReplayBuffer(
            args.steps, {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
            n_step=3, gamma=0.99, alpha=0.6, beta=bigper.LinearSchedule(0.4, 1.0, args.steps),
            prioritization=args.prioritization, storage="memmap", path=run / "replay", mode="new",
            seed=args.seed)
    env = gym.make("CartPole-v1")
    next_snap = (step // args.snapshot_every + 1) * args.snapshot_every if snaps else None
    with open(args.log, "a", buffering=1) as log:
        while step < args.steps:
            obs, _ = env.reset(seed=args.seed * 1_000_003 + episode)
            done = False
            while not done and step < args.steps:
                explore = epsilon(step, end=0.02, steps=args.steps // 3)
                action = int(rng.integers(2)) if rng.random() < explore else agent.act(obs)
                nxt, reward, term, trunc, _ = env.step(action)
                buf.add(obs=obs, action=action, reward=reward, next_obs=nxt, terminated=term, truncated=trunc)
                obs, done, step = nxt, term or trunc, step + 1
                if step >= args.learning_starts:
                    batch = buf.sample(32)
                    td_abs, loss = agent.learn(batch)
                    buf.update_priorities(batch, td_abs)
                    log.write(json.dumps({"step": step, "indices": batch.indices.tolist(),
                                          "loss": float(loss).hex(), "total": buf.total_priority.hex()}) + "\n")
            episode += 1
            if snaps is not None and step >= next_snap and step < args.steps:
                # Learner first, then the buffer: a snapshot always has its learner state.
                meta, arrays = agent.state()
                save_state(run / "learner" / f"step-{step:08d}",
                           {"agent": meta, "rng": rng.bit_generator.state, "episode": episode}, arrays)
                snaps.save(buf)
                next_snap = (step // args.snapshot_every + 1) * args.snapshot_every
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes()
                                         for v in agent.state()[1].values())).hexdigest()
        log.write(json.dumps({"final": True, "step": step, "total": buf.total_priority.hex(),
                              "weights": digest}) + "\n")
    buf.close()
    return 0


# -- the parent ----------------------------------------------------------------------

def _read(log: Path) -> list:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line a killed process was writing
            break
    return out


def _child(args, run: Path, log: Path, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bigper.examples.resume", "--role", "train", "--run", str(run),
           "--log", str(log), "--steps", str(args.steps), "--learning-starts", str(args.learning_starts),
           "--seed", str(args.seed), "--prioritization", args.prioritization, *extra]
    return subprocess.Popen(cmd)


def _last_step(log: Path) -> int:
    """The step of the last complete line of ``log`` (read from its tail)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().split(b"\n")[:-1]
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


MARKER = ".bigper-resume-example"
OWN = ("reference", "victim", "reference.jsonl", "victim.jsonl", "resumed.jsonl")


def _prepare(root: Path) -> str | None:
    """An empty run directory: a new one, or one a previous run of this script
    left (only its own entries are removed). None, or why not."""
    if root.exists() and not root.is_dir():
        return f"--path {root} exists and is not a directory"
    if root.is_dir() and any(root.iterdir()):
        if not (root / MARKER).is_file():
            return (f"--path {root} is not empty and was not written by this script "
                    f"(no {MARKER}); choose a new run directory")
        others = sorted(p.name for p in root.iterdir() if p.name not in OWN + (MARKER,))
        if others:
            return f"--path {root} holds entries this script did not write ({', '.join(others)}); left as is"
        for name in OWN:
            p = root / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        print(f"replaced the previous run in {root}", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("written by python -m bigper.examples.resume\n")
    return None


def parent(args) -> int:
    tmp = None if args.path else tempfile.mkdtemp(prefix="bigper-resume-")
    root = Path(args.path or tmp)
    problem = _prepare(root)
    if problem:
        print(f"resume: {problem}", file=sys.stderr)
        return 2
    print(f"{args.prioritization} prioritization, run directory {root}", flush=True)
    kill_at = args.kill_at or int(np.random.default_rng().integers(int(0.4 * args.steps), int(0.8 * args.steps)))
    try:
        t0 = time.perf_counter()
        # The reference and the victim are independent: they run side by side.
        print(f"1/3 reference run: {args.steps:,} steps, never interrupted (in the background)", flush=True)
        ref = _child(args, root / "reference", root / "reference.jsonl", "--snapshot-every", "0")
        print(f"2/3 victim run: snapshots every {args.snapshot_every:,} steps; SIGKILL once past step "
              f"{kill_at:,}", flush=True)
        victim_log = root / "victim.jsonl"
        victim = _child(args, root / "victim", victim_log, "--snapshot-every", str(args.snapshot_every))
        try:
            while victim.poll() is None and _last_step(victim_log) < kill_at:
                time.sleep(0.005)
            if victim.poll() is not None:
                print(f"resume: the victim exited (code {victim.returncode}) before step {kill_at}",
                      file=sys.stderr)
                return 1
            os.kill(victim.pid, signal.SIGKILL)
            code = victim.wait()
            killed_at = _last_step(victim_log)
            print(f"    killed by SIGKILL (exit code {code}) at step {killed_at:,}", flush=True)

            print("3/3 resumed run: Snapshots.load_latest, then on to the end", flush=True)
            res = _child(args, root / "victim", root / "resumed.jsonl", "--snapshot-every",
                         str(args.snapshot_every), "--resume")
            if res.wait() != 0 or ref.wait() != 0:
                print(f"resume: a run failed (resumed: {res.returncode}, reference: {ref.returncode})",
                      file=sys.stderr)
                return 1
        finally:
            for proc in (ref, victim):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return _compare(root, killed_at, code, time.perf_counter() - t0)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _compare(root: Path, killed_at: int, code: int, seconds: float) -> int:
    ref = _read(root / "reference.jsonl")
    victim = _read(root / "victim.jsonl")
    resumed = _read(root / "resumed.jsonl")
    by_step = {r["step"]: r for r in ref if "final" not in r}
    steps = [r for r in resumed if "final" not in r]
    first = steps[0]["step"] if steps else None
    same = [r == by_step.get(r["step"]) for r in steps]
    victim_same = all(r == by_step.get(r["step"]) for r in victim)
    final_same = bool(ref and resumed and ref[-1].get("final") and ref[-1] == resumed[-1])
    ok = bool(steps) and all(same) and victim_same and final_same and code == -signal.SIGKILL
    rows = [
        ("killed by", f"SIGKILL (exit code {code}) at step {killed_at:,}"),
        ("resumed at", f"step {first - 1:,}" if first else "-"),
        ("steps redone after the kill", f"{killed_at - first + 1:,}" if first else "-"),
        ("learner steps compared", f"{len(steps):,}: {sum(same):,} identical (indices, loss, total priority)"),
        ("victim before the kill", "identical to the reference" if victim_same else "DIFFERENT"),
        ("final priorities and weights", "identical" if final_same else "DIFFERENT"),
        ("wall time", f"{seconds:.1f} s"),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{w}}  {v}" for k, v in rows))
    if ok:
        print("resume: the continuation matches the run that was never killed, bit for bit")
        return 0
    bad = next((r["step"] for r, s in zip(steps, same) if not s), None)
    print(f"resume: MISMATCH (first differing step: {bad})", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return train(args) if args.role == "train" else parent(args)


if __name__ == "__main__":
    sys.exit(main())
