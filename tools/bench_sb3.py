"""The Stable-Baselines3 drop-in beside SB3's own ReplayBuffer, on one Atari-shaped stream.

The stream is what SB3's DQN hands its replay buffer over ``make_atari_env`` +
``VecFrameStack(4)``: SB3 wraps a channel-last image env in ``VecTransposeImage``,
so the buffer gets (1, 4, 84, 84) uint8 stacks, channel-first (as CleanRL's
frame stack gives them too), zero-padded at an episode's start, ``next_obs``
the stack moved on by one frame, an episode end every ``--episode`` steps.
One more row feeds bigper the same stacks channel-last (84, 84, 4), as
``VecFrameStack`` gives them to a buffer filled by hand: the drop-in then
transposes on the way in and out. Every buffer gets the same calls:

- ``add``: per call (SB3's ``add(obs, next_obs, action, reward, done,
  infos)``), over the first fill of ``--capacity`` transitions (every page
  touched for the first time) and then in steady state, the ring wrapping;
- ``sample``: ``sample(32)`` per call, which includes the conversion to torch
  tensors (SB3 copies with ``th.tensor``; bigper shares or copies once);
- bytes per transition: SB3's arrays / capacity; bigper's arrays in RAM
  (storage "memory") or its files on disk (storage "memmap") / capacity.

Rows: SB3's ``ReplayBuffer`` as SB3's DQN builds it (``obs`` and ``next_obs``
arrays), SB3's with ``optimize_memory_usage=True`` (CleanRL's setting, one
obs array), and bigper's ``PrioritizedReplayBuffer(frame_stack=4)`` in RAM
and on memmap. Times are wall and CPU per call; ratios are SB3 (default) /
bigper, taken in the same run. Torch runs on one thread for every row.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from benchkit import disk_bytes, fmt, import_bigper, print_header, print_table, ratio, say, short_error, time_both

SIDE, K = 84, 4
POOL = 1024  # distinct frames cycled through the stream


def make_stream(episode: int, seed: int = 0, layout: str = "first"):
    """``stacks[p]`` for p in 0..episode: the stack an env shows at step p of an
    episode, (1, 4, 84, 84) channel-first or (1, 84, 84, 4) channel-last."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, size=(POOL, SIDE, SIDE), dtype=np.uint8)
    stacks = np.zeros((episode + 1, 1, SIDE, SIDE, K), dtype=np.uint8)
    for p in range(episode + 1):
        for j in range(K):
            f = p - (K - 1) + j  # frame index within the episode; < 0 is zero padding
            if f >= 0:
                stacks[p, 0, :, :, j] = frames[f % POOL]
    return stacks if layout == "last" else np.ascontiguousarray(np.moveaxis(stacks, -1, 2))


def spaces_(layout: str = "first"):
    from gymnasium import spaces

    shape = (SIDE, SIDE, K) if layout == "last" else (K, SIDE, SIDE)
    return spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(6)


def build(kind: str, capacity: int, where: Path):
    obs_space, act_space = spaces_(LAYOUT[kind])
    if kind == "sb3":
        from stable_baselines3.common.buffers import ReplayBuffer

        return ReplayBuffer(capacity, obs_space, act_space, device="cpu")
    if kind == "sb3-optimized":
        from stable_baselines3.common.buffers import ReplayBuffer

        return ReplayBuffer(capacity, obs_space, act_space, device="cpu", optimize_memory_usage=True,
                            handle_timeout_termination=False)
    from bigper.integrations.sb3 import PrioritizedReplayBuffer

    kw = {"storage": "memory"} if kind.startswith("bigper-memory") else {"storage": "memmap", "path": str(where / "replay")}
    # The drop-in creates its storage here, as SB3's buffer allocates its arrays: not in the first timed add.
    return PrioritizedReplayBuffer(capacity, obs_space, act_space, device="cpu", frame_stack=K, **kw)


def buffer_bytes(kind: str, rb, where: Path) -> int:
    if kind.startswith("sb3"):
        names = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
        return sum(getattr(rb, n).nbytes for n in names if hasattr(rb, n))
    meta, arrays = rb.buffer.state_dict()
    state = sum(a.nbytes for a in arrays.values())
    if kind == "bigper-memmap":
        return disk_bytes(where / "replay") + state
    store = rb.buffer._store  # the memory storage's arrays: what it holds in RAM
    return sum(a.nbytes for a in store.arrays.values()) + state


def run_one(kind: str, capacity: int, episode: int, samples: int, stacks, where: Path) -> dict:
    rb = build(kind, capacity, where)
    action = np.zeros((1, 1), dtype=np.int64)
    reward = np.ones(1, dtype=np.float32)
    not_done, done = np.zeros(1, dtype=bool), np.ones(1, dtype=bool)
    infos = [{"TimeLimit.truncated": False}]

    def add(i: int) -> None:
        p = i % episode
        rb.add(stacks[p], stacks[p + 1], action, reward, done if p == episode - 1 else not_done, infos)

    fill_wall, fill_cpu = time_both(add, capacity)  # first touch of every page included
    # Steady state: the ring wraps, every page is mapped; what a long run pays.
    add_wall, add_cpu = time_both(lambda i: add(capacity + i), min(capacity, 3_000))
    for _ in range(20):  # warm: allocator, torch, first gathers
        rb.sample(32)
    sample_wall, sample_cpu = time_both(lambda i: rb.sample(32), samples)
    out = {"fill_us": fill_wall * 1e6, "fill_cpu_us": fill_cpu * 1e6, "add_us": add_wall * 1e6, "add_cpu_us": add_cpu * 1e6, "sample_us": sample_wall * 1e6,
           "sample_cpu_us": sample_cpu * 1e6, "bytes_per_transition": buffer_bytes(kind, rb, where) / capacity}
    if hasattr(rb, "close"):
        rb.close()
    return out


KINDS = ("sb3", "sb3-optimized", "bigper-memory", "bigper-memmap", "bigper-memory-chlast")
LAYOUT = {k: ("last" if k.endswith("chlast") else "first") for k in KINDS}


def main(args) -> int:
    import json

    import torch

    import_bigper()
    torch.set_num_threads(1)  # the same for every row; extra threads only contend on a shared machine
    versions = print_header("sb3")
    capacity = 3_000 if args.quick else args.capacity
    samples = 100 if args.quick else args.samples
    streams = {layout: make_stream(args.episode, layout=layout) for layout in ("first", "last")}
    top = Path(tempfile.mkdtemp(prefix="bench-sb3-", dir=args.dir))
    results: dict = {}
    try:
        for kind in KINDS:
            say(f"{kind}: fill {capacity}, sample(32) x {samples}")
            where = top / kind
            where.mkdir()
            try:
                results[kind] = run_one(kind, capacity, args.episode, samples, streams[LAYOUT[kind]], where)
            except Exception as e:  # report and go on with the others
                results[kind] = {"error": short_error(e)}
            shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    base = results.get("sb3", {})
    rows = []
    for kind in KINDS:
        r = results[kind]
        if "error" in r:
            rows.append([kind, r["error"], "", "", "", "", "", "", "", ""])
            continue
        rows.append([kind, fmt(r["fill_us"], ".1f"), fmt(r["fill_cpu_us"], ".1f"), fmt(r["add_us"], ".1f"), fmt(r["add_cpu_us"], ".1f"), fmt(r["sample_us"], ".0f"),
                     fmt(r["sample_cpu_us"], ".0f"), fmt(r["bytes_per_transition"], ",.0f"),
                     fmt(ratio(base.get("add_us"), r["add_us"]), ".2f"),
                     fmt(ratio(base.get("sample_us"), r["sample_us"]), ".2f")])
    print(f"Atari-shaped stream (4x84x84 stacks; chlast: 84x84x4; episodes of {args.episode}), capacity {capacity}, "
          f"sample(32) with torch tensors on the CPU")
    print_table(["buffer", "fill add us", "fill cpu", "add us", "add cpu", "sample us", "sample cpu", "bytes/trans",
                 "add: sb3/x", "sample: sb3/x"], rows)
    print(json.dumps({"bench": "sb3", "capacity": capacity, "episode": args.episode, "samples": samples,
                      "versions": versions, "results": results}, separators=(",", ":")))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--capacity", type=int, default=10_000, help="transitions filled (SB3's RAM: 56 KB each)")
    p.add_argument("--samples", type=int, default=500, help="sample(32) calls timed")
    p.add_argument("--episode", type=int, default=1_000, help="steps per episode of the stream")
    p.add_argument("--quick", action="store_true", help="3k transitions, 100 samples (a smoke run)")
    p.add_argument("--dir", help="where the memmap buffer goes (a temporary directory under it)")


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="bench_sb3", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
