"""``bigper demo``: a real Atari game into a disk-backed replay buffer, measured.

Pong (ALE, through Gymnasium's ``AtariPreprocessing`` and
``FrameStackObservation``) fills a memmap buffer (frame stacks stored once,
3-step returns, beta annealed 0.4 -> 1) of capacity ``--steps``, at most
1,000,000: a memmap buffer preallocates every slot (a full disk is an error
at creation, not a crash mid-run), so a short run is not given gigabytes of
slots it never writes; ``--capacity`` sets it (``--steps 1000000`` fills 1M). Every
``--learn-every`` env steps a learner-shaped step runs beside it: sample 32,
an IS-weighted Huber loss of a tiny conv Q-network on the CPU, priorities
updated from ``|TD|``. At the end the buffer is snapshotted with
``Snapshots``, restored into a fresh directory with ``load_latest``, and the
restored buffer's next samples are checked against the original's. It prints
what it measured and writes a plot of the priorities and of the ages of the
sampled transitions. ``--prioritization rank`` runs the same with rank-based
prioritization. It says how much disk the run directory takes before it starts
and at the end (with the command that removes it), the buffer's disk per slot
allocated and per transition held, and its peak memory, split
into the process's own (RssAnon) and the memmap files' pages mapped into it
(RssFile: page cache, shared and reclaimable, but counted in RSS).

The run directory (``--path``)::

    replay/      the live memmap buffer
    snaps/       the snapshot series
    restored/    the buffer restored from the latest snapshot
    demo.png     priorities and sampled ages
    results.json the table's numbers
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from .report import Memory, Stopwatch, Trace, format_table, human, plot

GAME = "Pong"
CAPACITY = 1_000_000
DEFAULT_STEPS = 50_000


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"env steps (default {DEFAULT_STEPS:,}: a few minutes on 2 cores; "
                        "1000000 fills a 1M-capacity buffer)")
    p.add_argument("--capacity", type=int, default=None,
                   help=f"buffer capacity in transitions, preallocated whole on disk (about 7.2 KB a slot; "
                        f"default: --steps, at most {CAPACITY:,}, the slots the run fills)")
    p.add_argument("--path", help="run directory, new or empty (default runs/demo-<timestamp>)")
    p.add_argument("--game", default=GAME, help=f"ALE game (default {GAME})")
    p.add_argument("--learn-every", type=int, default=4, help="env steps per learner step (4)")
    p.add_argument("--batch-size", type=int, default=32, help="transitions per sample (32)")
    p.add_argument("--verify-batches", type=int, default=20,
                   help="batches compared between the original and the restored buffer (20)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    p.add_argument("--prioritization", choices=("proportional", "rank"), default="proportional",
                   help="P(i) from the priority itself (proportional, the default) or from its rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def capacity_of(args) -> int:
    """The buffer's capacity: ``--capacity`` as given, else the slots the run
    fills (``--steps``, at most ``CAPACITY``). The memmap buffer preallocates
    every slot (so a full disk is an ``OSError`` at creation, never a SIGBUS
    mid-run); slots a short run never writes would buy nothing for it."""
    return args.capacity if args.capacity is not None else min(args.steps, CAPACITY)


def estimate_bytes(capacity: int) -> int:
    """Disk a demo buffer of ``capacity`` preallocates: frames, refs, the other fields."""
    from ..frames.store import frame_capacity

    frames = frame_capacity(capacity, 4, 1) * 84 * 84
    per = 2 * 4 * 8 + 8 + 4 + 1 + 1  # obs/next_obs refs, action, reward, flags
    return frames + capacity * per + (64 << 20)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _allocated(root: Path) -> int:
    """Bytes the files under ``root`` take on disk (allocated blocks, not sizes;
    a file hard-linked twice, as snapshots link chunk files, counted once)."""
    seen, total = set(), 0
    for p in root.rglob("*"):
        st = p.lstat()
        if p.is_file() and not p.is_symlink() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def learning_start(args) -> int:
    """Env steps before the learner's first step."""
    return min(1_000, max(args.batch_size, args.steps // 10))


def sample_calls(args) -> int:
    """``sample`` calls of the run: one per learner step, the beta schedule's length."""
    start = learning_start(args)
    first = -(-start // args.learn_every) * args.learn_every  # first step >= start that learns
    return max(0, (args.steps - 1 - first) // args.learn_every + 1) if first < args.steps else 0


def check_args(args) -> str | None:
    for name in ("steps", "capacity", "learn_every", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.verify_batches < 0 or args.threads < 1:
        return "--verify-batches must be >= 0 and --threads >= 1"
    run = Path(args.path)
    if run.exists() and (not run.is_dir() or any(run.iterdir())):
        return f"--path {run} exists and is not an empty directory; choose a new run directory"
    capacity = capacity_of(args)
    need = estimate_bytes(capacity)
    free = shutil.disk_usage(_existing(run)).free
    if free < need:
        return (f"a buffer of capacity {capacity:,} preallocates about {need / 1e9:.1f} GB at {run}, "
                f"but only {free / 1e9:.1f} GB is free there. Free some space, pass --path on a larger "
                f"disk, or shrink the buffer with --capacity (e.g. --capacity "
                f"{max(1000, int(capacity * free / need * 0.8) // 1000 * 1000):,})")
    return None


def run(args) -> int:
    if args.path is None:
        args.path = str(Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    problem = check_args(args)
    if problem:
        print(f"bigper demo: {problem}", file=sys.stderr)
        return 2
    sized = args.capacity is None
    args.capacity = capacity_of(args)
    mem = Memory()
    try:
        import torch
        from tqdm import tqdm

        from ..examples._atari import make_env, q_network
        from ..examples._dqn import DoubleDQN
    except ImportError as e:
        print(f"bigper demo: {e} (in a bigper checkout: ./run.sh demo, or pip install -e '.[torch,atari]')", file=sys.stderr)
        return 2
    run_dir = Path(args.path).absolute()  # printed paths (and the rm -r line) work from any directory
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    env = make_env(args.game, seed=args.seed)
    need = estimate_bytes(args.capacity)
    why = (f"sized to --steps: the slots this run fills; --capacity {CAPACITY:,} preallocates "
           f"{estimate_bytes(CAPACITY) / 1e9:.1f} GB" if sized and args.capacity < CAPACITY else
           "every slot, so that a full disk is an error now, not a crash mid-run")
    print(f"bigper demo: ALE/{args.game}-v5 (frameskip=1, repeat_action_probability=0.0; "
          f"AtariPreprocessing + FrameStackObservation(4)), {args.steps:,} env steps into a memmap "
          f"buffer of capacity {args.capacity:,} ({args.prioritization} prioritization) at "
          f"{run_dir / 'replay'}\n"
          f"  disk: it preallocates about {human(need)} under {run_dir} ({why}; the snapshot and "
          f"the restored buffer hard-link those files rather than copy them); it stays after the run: "
          f"remove it with  rm -r {run_dir}", flush=True)
    n_actions = env.action_space.n
    # A tiny conv Q-network (3-step Double DQN targets, IS-weighted Huber loss) on the CPU.
    learner = DoubleDQN(lambda: q_network(n_actions, size="tiny"), lr=1e-4, target_every=1000)
    buf = _open_buffer(run_dir / "replay", args)
    clock, trace = Stopwatch(), Trace(args.steps, args.batch_size)
    t_start = time.perf_counter()
    try:
        _play(env, buf, learner, clock, trace, args, tqdm, mem)
    finally:
        env.close()
    t_loop = time.perf_counter() - t_start
    beta_end, calls = trace.beta, trace.calls
    plot(buf, trace, run_dir / "demo.png", args)
    disk = _allocated(run_dir / "replay")
    mem.check()

    from .. import Snapshots

    print("snapshotting (Snapshots.save) ...", flush=True)
    snaps = Snapshots(run_dir / "snaps", keep=2)
    t0 = time.perf_counter()
    snap = snaps.save(buf)
    t_snap = time.perf_counter() - t0
    mem.check()
    print(f"restoring (Snapshots.load_latest) into {run_dir / 'restored'} ...", flush=True)
    t0 = time.perf_counter()
    # A copy checked against the original, whose episode goes on: the restored one's goes on too.
    restored = snaps.load_latest(path=run_dir / "restored", continue_episodes=True)
    t_restore = time.perf_counter() - t0
    mem.check()
    try:
        same = _verify(buf, restored, learner, args.verify_batches, args.batch_size)
        mem.check()
    finally:
        restored.close()
        buf.close()
    run_disk = _allocated(run_dir)
    mem.stop()

    results = {
        "game": args.game, "steps": args.steps, "capacity": args.capacity, "held": len(buf),
        "env_steps_per_s": clock.n.get("env", 0) / max(clock.s.get("env", 0.0) + clock.s.get("reset", 0.0), 1e-12), "adds_per_s": clock.rate("add"),
        "sample_update_us": clock.mean_us("sample") + clock.mean_us("update"),
        "sample_us": clock.mean_us("sample"), "update_us": clock.mean_us("update"),
        "first_sample_update_ms": 1e3 * (clock.first.get("sample", 0.0) + clock.first.get("update", 0.0)),
        "learner_ms": clock.mean_us("learn") / 1e3, "loop_steps_per_s": args.steps / t_loop,
        # Disk both ways: the preallocated files per capacity slot, and per transition the run
        # holds (a short run in a large buffer pays for slots it never wrote).
        "disk_bytes": disk, "bytes_per_slot": disk / args.capacity,
        "bytes_per_transition_held": disk / max(len(buf), 1),
        "disk_used_bytes": disk / args.capacity * len(buf), "capacity_sized_to_steps": sized,
        "snapshot_s": t_snap, "restore_s": t_restore, "verified_batches": same,
        "verify_ok": same == args.verify_batches, "snapshot": str(snap),
        "episodes": trace.episodes, "mean_return_last10": trace.mean_return(),
        "prioritization": args.prioritization, "sample_calls": calls, "beta_end": beta_end,
        "run_disk_bytes": run_disk, "peak_rss_bytes": Memory.peak_rss(),
        "peak_rss_anon_bytes": mem.peak_anon, "peak_rss_file_bytes": mem.peak_file,
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(format_table(results, args))
    print(f"\nrun directory: {run_dir}\n  plot:     {run_dir / 'demo.png'}\n  buffer:   {run_dir / 'replay'}"
          f"\n  snapshot: {run_dir / 'snaps' / Path(snap).name}\n  restored: {run_dir / 'restored'}\n  numbers:  {run_dir / 'results.json'}")
    print(f"\ndisk: {run_dir} holds {human(run_disk)} (the buffer, its snapshot, the restored copy); "
          f"remove it with:  rm -r {run_dir}")
    print(f"memory: peak RSS {results['peak_rss_bytes'] / 1e9:.2f} GB; of it, the process's own memory "
          f"(RssAnon) peaked at {mem.peak_anon / 1e9:.2f} GB and the pages of the memmap files mapped into "
          f"it (RssFile, page cache shared with the kernel and reclaimable) at {mem.peak_file / 1e9:.2f} GB")
    if not results["verify_ok"]:
        print(f"bigper demo: the restored buffer diverged from the original after {same} identical "
              "batches", file=sys.stderr)
        return 1
    return 0


def _open_buffer(path: Path, args):
    import bigper

    from ..examples._atari import atari_fields

    # The schedule advances once per sample() call: its length is the run's
    # number of learner steps, so beta is 1.0 at the last one.
    return bigper.PrioritizedReplayBuffer(
        args.capacity, atari_fields(), frame_stack=4, n_step=3, gamma=0.99, alpha=0.6,
        beta=bigper.LinearSchedule(0.4, 1.0, max(1, sample_calls(args) - 1)),
        prioritization=args.prioritization, storage="memmap", path=path,
        mode="new",  # each demo run has its own new run directory (check_args refuses a used one)
        seed=args.seed)


def _play(env, buf, learner, clock, trace, args, tqdm, mem) -> None:
    pc = time.perf_counter
    obs, _ = env.reset(seed=args.seed)
    start = learning_start(args)
    explore = max(1, args.steps // 2)
    rng, n_actions = np.random.default_rng(args.seed), env.action_space.n
    ret, loss = 0.0, float("nan")
    bar = tqdm(total=args.steps, unit="step", disable=args.no_progress, file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 15.0)
    try:
        for step in range(args.steps):
            eps = max(0.05, 1.0 - 0.95 * step / explore)
            action = int(rng.integers(n_actions)) if rng.random() < eps else learner.act(obs)
            t0 = pc()
            nxt, reward, term, trunc, _ = env.step(action)
            t1 = pc()
            buf.add(obs=obs, action=action, reward=np.sign(reward), next_obs=nxt, terminated=term,
                    truncated=trunc)
            t2 = pc()
            clock.add("env", t1 - t0)
            clock.add("add", t2 - t1)
            ret += reward
            obs = nxt
            if term or trunc:
                t0 = pc()
                obs, _ = env.reset()
                clock.add("reset", pc() - t0)
                trace.returns.append(ret)
                trace.episodes += 1
                ret = 0.0
            if step >= start and step % args.learn_every == 0:
                loss = _learn(buf, learner, clock, trace, step + 1, args)
            if step % 500 == 0 or step == args.steps - 1:
                mem.check()
                bar.set_postfix_str(f"env {clock.rate('env'):,.0f}/s, sample+update "
                                    f"{clock.mean_us('sample') + clock.mean_us('update'):,.0f} us, "
                                    f"loss {loss:.4f}, beta {buf.beta:.3f}, episodes {trace.episodes}",
                                    refresh=False)
            bar.update(1)
    finally:
        bar.close()


def _learn(buf, learner, clock, trace, added: int, args) -> float:
    pc = time.perf_counter
    trace.beta = buf.beta  # what this call uses
    t0 = pc()
    batch = buf.sample(args.batch_size)
    t1 = pc()
    td_abs, loss = learner.learn(batch)
    t2 = pc()
    buf.update_priorities(batch, td_abs)
    t3 = pc()
    clock.add("sample", t1 - t0)
    clock.add("learn", t2 - t1)
    clock.add("update", t3 - t2)
    # Age 0 is the newest transition; the newest n_step - 1 wait for their window.
    held = len(buf)
    trace.record(added - 1 - batch.generations, 2, held)
    return loss


def _verify(buf, restored, learner, n: int, batch_size: int) -> int:
    """Sample both buffers ``n`` times, feeding both the same priority
    updates; the number of batches that were identical before the first
    difference."""
    import torch

    for i in range(n):
        a, b = buf.sample(batch_size), restored.sample(batch_size)
        same = (np.array_equal(a.indices, b.indices) and np.array_equal(a.weights, b.weights)
                and np.array_equal(a.probabilities, b.probabilities) and a.keys() == b.keys()
                and all(np.array_equal(a[k], b[k]) for k in a))
        if not same:
            return i
        with torch.no_grad():
            td_abs = learner.td_errors(a.to_torch()).abs()
        buf.update_priorities(a, td_abs)
        restored.update_priorities(b, td_abs)
    return n


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="bigper demo", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
