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

``--part train`` (also in ``both``, the default): the learner's train steps
alone, the target of issue 41: ``model.train(gradient_steps=1,
batch_size=32)`` of SB3's ``DQN`` with its own buffer beside bigper's
``PrioritizedDQN`` (synchronous ``prefetch=0``, the drop-in's path before
the sampler; its default prefetching sampler; the sampler with the device
tier on ``--device``), each over a small CNN (two convolutions and a linear
layer, ``policy_kwargs``) on the same Atari-shaped stream, the learn
progress moving at every step as in ``learn`` (so PrioritizedDQN's beta
anneals at every step). Blocks of ``--train-steps`` steps are interleaved
and rotated; the median block gives ms a step and the share ``SB3 / x``
(the target: >= 95%); beside it the learner thread's own CPU time a step
(``time.thread_time``: what the learner's thread ran, not the sampler's
thread nor the other processes of a shared machine).
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


# -- the learner's train steps ---------------------------------------------------------
TRAIN_KINDS = ("sb3-dqn", "bigper-sync", "bigper-sampler", "bigper-tier")


def small_cnn():
    """SB3 features extractor: conv 8x8/4 (8), conv 4x4/2 (16), linear 128: a small Atari CNN
    (NatureCNN has 32, 64 and 64 channels and 512 features), so the feed's share shows."""
    import torch as th
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class SmallCNN(BaseFeaturesExtractor):
        def __init__(self, observation_space, features_dim: int = 128):
            super().__init__(observation_space, features_dim)
            c = observation_space.shape[0]
            self.net = th.nn.Sequential(th.nn.Conv2d(c, 8, 8, stride=4), th.nn.ReLU(), th.nn.Conv2d(8, 16, 4, stride=2),
                                        th.nn.ReLU(), th.nn.Flatten(), th.nn.Linear(16 * 9 * 9, features_dim), th.nn.ReLU())

        def forward(self, obs):
            return self.net(obs)

    return SmallCNN


class _Stacks:
    """A gymnasium env giving the bench's stacks (only its spaces are used: the buffer is filled by hand)."""

    def __new__(cls, layout: str = "first"):
        import gymnasium as gym

        obs_space, act_space = spaces_(layout)

        class Env(gym.Env):
            observation_space, action_space = obs_space, act_space

            def reset(self, *, seed=None, options=None):
                return obs_space.sample(), {}

            def step(self, action):
                return obs_space.sample(), 0.0, False, False, {}

        return Env()


def build_model(kind: str, capacity: int, device: str):
    import warnings

    from stable_baselines3 import DQN

    kw = dict(buffer_size=capacity, learning_starts=0, batch_size=32, device=device, seed=0,
              policy_kwargs={"features_extractor_class": small_cnn(), "net_arch": []})
    if kind == "sb3-dqn":
        return DQN("CnnPolicy", _Stacks(), **kw)
    import inspect

    from bigper.integrations.sb3 import PrioritizedDQN, PrioritizedReplayBuffer

    rbk = {"frame_stack": K}
    if kind == "bigper-sync":
        if "prefetch" in inspect.signature(PrioritizedReplayBuffer.__init__).parameters:
            rbk["prefetch"] = 0
    elif kind == "bigper-tier":
        rbk["device"] = device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrioritizedDQN("CnnPolicy", _Stacks(), replay_buffer_kwargs=rbk, **kw)


def run_train(capacity: int, episode: int, steps: int, repeats: int, device: str, stacks) -> dict:
    import statistics

    models, results = {}, {}
    action = np.zeros((1, 1), dtype=np.int64)
    reward = np.ones(1, dtype=np.float32)
    not_done, done = np.zeros(1, dtype=bool), np.ones(1, dtype=bool)
    infos = [{"TimeLimit.truncated": False}]
    for kind in TRAIN_KINDS:
        try:
            m = build_model(kind, capacity, device)
            rb = m.replay_buffer
            for i in range(capacity):
                p = i % episode
                rb.add(stacks[p], stacks[p + 1], action, reward, done if p == episode - 1 else not_done, infos)
            from stable_baselines3.common.logger import configure

            m.set_logger(configure(None, []))  # (train() records; learn would set one)
            m._current_progress_remaining = 1.0
            m.train(gradient_steps=5, batch_size=32)  # warm: allocator, first gathers, the sampler opened
            models[kind] = m
        except Exception as e:  # report and go on with the others
            results[kind] = {"error": short_error(e)}
    total = steps * repeats * len(models) + 1
    done_steps = [0]

    def step_of(m):
        def one(i):
            done_steps[0] += 1  # learn's progress moves at every step: the annealed beta changes
            m._current_progress_remaining = 1.0 - done_steps[0] / total
            m.train(gradient_steps=1, batch_size=32)
        return one

    import gc
    import time

    fns = {k: step_of(m) for k, m in models.items()}
    names = list(fns)
    walls: dict = {k: [] for k in names}
    cpus: dict = {k: [] for k in names}
    for r in range(repeats):  # interleaved, the order rotating (as benchkit.interleaved_blocks)
        for kind in names[r % len(names):] + names[:r % len(names)]:
            gc.disable()
            w0, c0 = time.perf_counter(), time.thread_time()
            for i in range(steps):
                fns[kind](i)
            walls[kind].append((time.perf_counter() - w0) / steps)
            cpus[kind].append((time.thread_time() - c0) / steps)
            gc.enable()
    for kind in names:
        b = walls[kind]
        results[kind] = {"step_ms": statistics.median(b) * 1e3, "best_ms": min(b) * 1e3,
                         "thread_cpu_ms": statistics.median(cpus[kind]) * 1e3, "blocks_ms": [x * 1e3 for x in b]}
    for m in models.values():
        if hasattr(m.replay_buffer, "close"):
            m.replay_buffer.close()
    return results


def report_train(results: dict, capacity: int, steps: int, repeats: int, device: str) -> None:
    base = results.get("sb3-dqn", {})
    rows = []
    for kind in TRAIN_KINDS:
        r = results.get(kind, {"error": "not run"})
        if "error" in r:
            rows.append([kind, r["error"], "", "", "", "", ""])
            continue
        share = ratio(base.get("step_ms"), r["step_ms"])
        best = ratio(base.get("best_ms"), r["best_ms"])
        cpu = ratio(base.get("thread_cpu_ms"), r["thread_cpu_ms"])
        rows.append([kind, fmt(r["step_ms"], ".2f"), fmt(None if share is None else 100 * share, ".1f"),
                     fmt(r["best_ms"], ".2f"), fmt(None if best is None else 100 * best, ".1f"),
                     fmt(r["thread_cpu_ms"], ".2f"), fmt(None if cpu is None else 100 * cpu, ".1f")])
    print(f"Learner train steps alone, B=32, small CNN on 4x84x84 stacks, {capacity} transitions, "
          f"{repeats} x {steps} steps interleaved; learners and tier on {device!r}")
    print_table(["learner", "ms/step (median block)", "share of SB3 DQN %", "ms/step (best block)",
                 "share, best blocks %", "learner thread CPU ms/step", "share, CPU %"], rows)
    print("(share: SB3 DQN's time / the learner's, in this run; the learner thread's CPU time leaves out "
          "the sampler's thread and the other processes on a shared machine)")


def main(args) -> int:
    import json

    import torch

    import_bigper()
    torch.set_num_threads(1)  # the same for every row; extra threads only contend on a shared machine
    versions = print_header("sb3")
    if args.part in ("train", "both"):
        capacity = 2_000 if args.quick else args.train_capacity
        say(f"train steps: fill {capacity} per learner, {args.repeats} x {args.train_steps} steps each")
        train = run_train(capacity, args.episode, args.train_steps, args.repeats, args.device,
                          make_stream(args.episode))
        report_train(train, capacity, args.train_steps, args.repeats, args.device)
        print(json.dumps({"bench": "sb3-train", "capacity": capacity, "steps": args.train_steps,
                          "repeats": args.repeats, "device": args.device, "versions": versions, "results": train},
                         separators=(",", ":")))
        if args.part == "train":
            return 0
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
    p.add_argument("--part", choices=("buffer", "train", "both"), default="both",
                   help="the buffer's add/sample rows, the learner's train steps, or both")
    p.add_argument("--train-capacity", type=int, default=5_000, help="transitions each learner's buffer holds")
    p.add_argument("--train-steps", type=int, default=20, help="train steps a timed block")
    p.add_argument("--repeats", type=int, default=15, help="blocks per learner, interleaved")
    p.add_argument("--device", default="cpu", help="the learners' device (train rows), where the tier goes too")
