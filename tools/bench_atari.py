"""Workload "atari": Atari-shaped replay, bigper against cpprb, Tianshou and TorchRL.

Every library gets the same stream of transitions: ``obs`` and ``next_obs``
are (4, 84, 84) uint8 frame stacks cut from real Pong frames (84x84 after
Gymnasium's ``AtariPreprocessing``, recorded once and cached under /tmp),
padded at an episode start the way ``FrameStackObservation`` pads them;
episodes end (terminated) every 900-1100 steps. Each library runs in a
process of its own (this script with ``--peer NAME``), so the memory it
reports is its own. In each process:

(a) add: ``N`` steps one ``add`` call at a time (the fill), then another
    ``N/5`` (at most 20k) steps into the full ring, timed in blocks (the
    steady state a learner sees, ring wrapping included);
(b) a round: sample(32) with both stacks gathered and the IS weights, then a
    priority update of the 32 (precomputed |TD| values), median of blocks;
(c) bytes per transition: RSS growth for libraries that hold their data in
    RAM; for bigper's memmap storage the blocks its files hold on disk plus
    its anonymous RAM growth (tree and bookkeeping; the page cache is not
    counted).

Before timing, every library's samples are compared with the stream (obs,
and next_obs apart from the terminal step of an episode, which some peers do
not keep). The floor is bare numpy: a ring of single frames and a gather of
32 x 4 frames for obs and again for next_obs (no tree, no weights).

Configurations (each library's documented setting for Atari):
  bigper    frame_stack=4, n_step=1 (and n_step=3 as an extra row)
  cpprb     next_of="obs", stack_compress="obs" (the stack on the last axis,
            so stacks are added as (84, 84, 4) views and sampled as
            (32, 84, 84, 4)), on_episode_end() at episode ends
  Tianshou  stack_num=4, save_only_last_obs=True, ignore_obs_next=True (its
            Atari examples' buffer)
  TorchRL   its prioritized sampler needs the C++ extension torchrl._torchrl

Every timing is taken twice: wall clock and this process's CPU time (the
machine may be shared; the ratios are given for both). ``--malloc tuned``
runs every process with fixed glibc malloc thresholds: a sample returns two
fresh ~0.9 MB arrays, and with the default, dynamic thresholds whether they
come with ~400 page faults (10x the round time) depends on the process's
allocation history, not on the library.

Usage::

    python tools/bench.py atari [--quick] [--size 100000] [--million] [--repeat R]
                                [--peers numpy,bigper-memory,...] [--malloc default|tuned] [--dir DIR]

Prints a table and, last, one JSON line ``{"bench": "atari", ...}``.
``--million`` also fills a 1M-capacity bigper memmap buffer with 1M steps of
the same stream (about 7.3 GB on disk, deleted afterwards).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

TOOLS = os.path.dirname(os.path.abspath(__file__))
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from bench import (  # noqa: E402
    _dist_version,
    _fmt,
    _import_bigper,
    _short_error,
    print_header,
    print_table,
    ratio,
    versions,
)

K, H, W = 4, 84, 84
BATCH = 32
ALPHA, BETA = 0.6, 0.4
N_FRAMES = 5000
FRAME_CACHE = Path(tempfile.gettempdir()) / f"bigper_bench_atari_pong_{N_FRAMES}.npy"
PEERS = ("numpy", "bigper-memory", "bigper-memmap", "bigper-memmap-n3", "cpprb", "tianshou", "torchrl")
RIVALS = ("cpprb", "tianshou", "torchrl")
OURS = ("bigper-memory", "bigper-memmap")
TARGET_ROUND = 2.0  # fastest rival round / bigper round
TARGET_ADD = 4.0  # bigper adds per s / fastest rival's
TARGET_BYTES = 7300  # per transition at 1M capacity, on disk + RAM (KB = 1000 bytes)
MILLION = 1_000_000
# Fixed glibc malloc thresholds (they switch off its dynamic ones): every
# sample allocates ~1 MB arrays, and with the defaults, whether those come
# with fresh zero pages (a page fault each 4 KB) depends on the process's
# allocation history. "tuned" takes that out of the comparison; "default" is
# what a user gets.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


# -- data ------------------------------------------------------------------------------


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def real_frames(n: int = N_FRAMES) -> tuple[np.ndarray, str]:
    """``n`` 84x84 uint8 Pong frames (random actions), cached in /tmp; synthetic
    frames when ale-py is not installed. Returns ``(frames, source)``."""
    if FRAME_CACHE.exists():
        f = np.load(FRAME_CACHE)
        if f.shape == (n, H, W):
            return f, f"ALE Pong, {n} frames cached at {FRAME_CACHE}"
    try:
        import ale_py
        import gymnasium as gym
        from gymnasium.wrappers import AtariPreprocessing
    except ImportError as exc:
        from bench_storage import frames as synthetic

        return synthetic(n), f"synthetic frames ({_short_error(exc)})"
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    rng = np.random.default_rng(0)
    out = np.empty((n, H, W), dtype=np.uint8)
    obs, _ = env.reset(seed=0)
    for i in range(n):
        out[i] = obs
        obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        if term or trunc:
            obs, _ = env.reset()
    env.close()
    tmp = FRAME_CACHE.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, FRAME_CACHE)
    return out, f"ALE Pong, {n} frames recorded to {FRAME_CACHE}"


class Stream:
    """A periodic stream of transitions over episodes cut from ``frames``.

    Episode ``e`` of length ``L`` is one padded array ``[f0, f0, f0, f0, f1, ..., fL]``;
    step ``t`` has ``obs = pad[t:t+4]`` and ``next_obs = pad[t+1:t+5]`` (views:
    producing a step costs the "environment" nothing). The last step of an
    episode is terminated; the next starts with a reset stack. The stream
    repeats after ``period`` steps (whole episodes).
    """

    def __init__(self, frames: np.ndarray, seed: int = 0):
        rng = np.random.default_rng(seed)
        n = frames.shape[0]
        self.pads, pos = [], 0
        while pos < n - 1200:
            length = int(rng.integers(900, 1101))
            idx = np.concatenate([[pos] * (K - 1), np.arange(pos, pos + length + 1)])
            self.pads.append(frames[idx])
            pos += length + 1
        lengths = [p.shape[0] - K for p in self.pads]
        self.period = sum(lengths)
        self.ep = np.repeat(np.arange(len(lengths)), lengths)
        self.t = np.concatenate([np.arange(length) for length in lengths])
        self.term = self.t == np.repeat(np.array(lengths) - 1, lengths)
        self.action = rng.integers(0, 6, self.period, dtype=np.int64)
        self.reward = rng.standard_normal(self.period).astype(np.float32)
        self.episodes = len(lengths)

    def step(self, g: int) -> tuple[np.ndarray, np.ndarray, int, float, bool]:
        j = g % self.period
        pad, t = self.pads[self.ep[j]], self.t[j]
        return pad[t:t + K], pad[t + 1:t + K + 1], self.action[j], self.reward[j], bool(self.term[j])

    def expected(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """obs and next_obs stacks of global steps ``gids``, and whether each is terminal."""
        obs = np.stack([self.step(int(g))[0] for g in gids])
        nxt = np.stack([self.step(int(g))[1] for g in gids])
        return obs, nxt, self.term[gids % self.period]


def time_both(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """Wall and CPU (this process) seconds per call of ``fn(i)``, ``i in range(n)``, GC off.

    The machine may be shared: CPU time leaves out the time other processes
    held the cores, wall time does not; both are reported."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n
    finally:
        if gc_was_on:
            gc.enable()


def td_pool(n: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [np.abs(rng.standard_normal(BATCH)) + 0.01 for _ in range(n)]


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


def disk_bytes(path: Path) -> int:
    """Blocks allocated to every file under ``path``."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def ram_arrays(obj, depth: int = 4, seen: set | None = None) -> int:
    """Bytes of the numpy arrays reachable from ``obj`` through attributes,
    dicts and lists (tree, bookkeeping), not through its storage (whose arrays
    are file mappings or the data itself)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):  # a view of an array already counted starts at its address
        addr = ("addr", obj.__array_interface__["data"][0])
        if addr in seen:
            return 0
        seen.add(addr)
        return obj.nbytes
    if type(obj).__module__.startswith("bigper.storage"):
        return 0
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("bigper"):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(ram_arrays(v, depth - 1, seen) for v in items)


def slot_gids(slots: np.ndarray, count: int, capacity: int) -> np.ndarray:
    """Global step held at each ring slot after ``count`` adds (slot = step % capacity)."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    return slots + capacity * ((count - 1 - slots) // capacity)


# -- one adapter per library -------------------------------------------------------------
#
# make_<peer>(capacity, stream, root) returns a dict with:
#   add(g)      add global step g of the stream
#   round(i)    sample BATCH + weights + update BATCH priorities (the i-th pool array)
#   probe(count) -> (gids, obs (B,4,84,84), next_obs, weights) for the checks
#   bytes(rss0) -> dict: bytes per transition and how they were measured
#   api, notes, close()


class PeerUnavailable(Exception):
    pass


def make_numpy(cap: int, stream: Stream, root: Path) -> dict:
    frames = np.zeros((cap, H, W), dtype=np.uint8)
    action = np.zeros(cap, dtype=np.int64)
    reward = np.zeros(cap, dtype=np.float32)
    rng = np.random.default_rng(0)
    k4 = np.arange(K)

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        s = g % cap
        frames[s] = nxt[-1]
        action[s], reward[s] = a, r

    def rnd(i: int) -> None:
        s = rng.integers(0, cap - K - 1, BATCH)
        refs = s[:, None] + k4
        frames[refs], frames[refs + 1], action[s], reward[s]  # noqa: B018

    return {"add": add, "round": rnd, "probe": None,
            "bytes": lambda rss0: _rss_bytes(rss0, cap),
            "api": "frames[refs] for obs and next_obs (refs (32, 4)); add = one frame + 2 scalars into a ring",
            "notes": ["floor: no tree, no weights, no episode padding"], "close": lambda: None}


def _rss_bytes(rss0: dict, cap: int) -> dict:
    now = proc_status()
    grow = now["VmRSS"] - rss0["VmRSS"]
    return {"bytes_per_transition": grow / cap, "where": "RAM (RSS growth)", "ram_bytes": grow}


def make_bigper(cap: int, stream: Stream, root: Path, *, storage: str, n_step: int = 1) -> dict:
    bigper = _import_bigper()
    path = None
    if storage != "memory":
        path = root / f"bigper-{storage}-n{n_step}"
    buf = bigper.PrioritizedReplayBuffer(
        cap, {"obs": ((K, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, n_step=n_step, gamma=0.99, alpha=ALPHA, beta=BETA, storage=storage, path=path,
        seed=0)
    pool = td_pool()

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        buf.add(obs=obs, action=a, reward=r, next_obs=nxt, terminated=term)

    def rnd(i: int) -> None:
        b = buf.sample(BATCH)
        buf.update_priorities(b, pool[i % len(pool)])

    def probe(count: int):
        b = buf.sample(256)
        gids = np.asarray(b.generations, dtype=np.int64)
        if n_step > 1:  # next_obs is the stack n steps on (or at the episode end)
            return gids, b["obs"], None, b.weights
        return gids, b["obs"], b["next_obs"], b.weights

    def nbytes(rss0: dict) -> dict:
        now = proc_status()
        if path is None:
            grow = now["VmRSS"] - rss0["VmRSS"]
            return {"bytes_per_transition": grow / cap, "where": "RAM (RSS growth)", "ram_bytes": grow}
        disk = disk_bytes(path)
        anon = now["RssAnon"] - rss0["RssAnon"]
        arrays = ram_arrays(buf)
        return {"bytes_per_transition": (disk + anon) / cap, "where": "disk + RAM (RssAnon growth)",
                "disk_bytes": disk, "ram_bytes": anon, "disk_per_transition": disk / cap,
                "ram_per_transition": anon / cap, "ram_arrays_per_transition": arrays / cap,
                "files": _file_sizes(path)}

    return {"add": add, "round": rnd, "probe": probe, "bytes": nbytes,
            "api": f"PrioritizedReplayBuffer(frame_stack=4, n_step={n_step}, storage={storage!r}).add / "
                   "sample(32) / update_priorities(batch, td)",
            "notes": [], "close": buf.close, "buffer": buf}


def _file_sizes(path: Path) -> dict[str, int]:
    """Allocated bytes per array (chunk files summed), for the bytes breakdown."""
    out: dict[str, int] = {}
    for p in path.rglob("*"):
        if p.is_file():
            key = p.name.split(".")[0] if p.parent.name == "data" else f"{p.parent.name}/{p.name}"
            out[key] = out.get(key, 0) + p.stat().st_blocks * 512
    return out


def make_cpprb(cap: int, stream: Stream, root: Path) -> dict:
    from cpprb import PrioritizedReplayBuffer

    rb = PrioritizedReplayBuffer(
        cap, {"obs": {"shape": (H, W, K), "dtype": np.uint8}, "act": {"dtype": np.int64},
              "rew": {"dtype": np.float32}, "done": {"dtype": np.bool_}},
        next_of="obs", stack_compress="obs", alpha=ALPHA, eps=1e-6)
    pool = td_pool()

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        rb.add(obs=np.moveaxis(obs, 0, -1), next_obs=np.moveaxis(nxt, 0, -1), act=a, rew=r, done=term)
        if term:
            rb.on_episode_end()

    def rnd(i: int) -> None:
        s = rb.sample(BATCH, beta=BETA)
        rb.update_priorities(s["indexes"], pool[i % len(pool)])

    def probe(count: int):
        s = rb.sample(256, beta=BETA)
        gids = slot_gids(s["indexes"], count, cap)
        return gids, np.moveaxis(s["obs"], -1, 1), np.moveaxis(s["next_obs"], -1, 1), s["weights"]

    return {"add": add, "round": rnd, "probe": probe, "bytes": lambda rss0: _rss_bytes(rss0, cap),
            "api": 'PrioritizedReplayBuffer(next_of="obs", stack_compress="obs").add / sample(32, beta) / '
                   "update_priorities(indexes, td)",
            "notes": ["stacks stored and sampled as (84, 84, 4): the stack axis must be last"],
            "close": lambda: None}


def make_tianshou(cap: int, stream: Stream, root: Path) -> dict:
    from tianshou.data import Batch, PrioritizedReplayBuffer

    np.random.seed(0)  # its prioritized sampling draws from the global RNG
    buf = PrioritizedReplayBuffer(cap, alpha=ALPHA, beta=BETA, stack_num=K, ignore_obs_next=True,
                                  save_only_last_obs=True)
    pool = td_pool()

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        buf.add(Batch(obs=obs, act=a, rew=r, terminated=term, truncated=False, obs_next=nxt))

    def rnd(i: int) -> None:
        b, idx = buf.sample(BATCH)
        b.obs, b.obs_next, b.weight  # noqa: B018 (stacked at sample time)
        buf.update_weight(idx, pool[i % len(pool)])

    def probe(count: int):
        b, idx = buf.sample(256)
        return slot_gids(idx, count, cap), b.obs, b.obs_next, b.weight

    return {"add": add, "round": rnd, "probe": probe, "bytes": lambda rss0: _rss_bytes(rss0, cap),
            "api": "PrioritizedReplayBuffer(stack_num=4, save_only_last_obs=True, ignore_obs_next=True)"
                   ".add(Batch) / sample(32) / update_weight(idx, td)",
            "notes": ["next_obs of a terminal step is its own obs (the buffer does not keep it)"],
            "close": lambda: None}


def make_torchrl(cap: int, stream: Stream, root: Path) -> dict:
    import torch

    try:  # PrioritizedSampler's sum/min trees live in TorchRL's C++ extension
        import torchrl._torchrl  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"torchrl._torchrl does not load with torch {torch.__version__}: "
                              f"{_short_error(exc)}") from exc
    raise PeerUnavailable("torchrl adapter not written: its extension loaded, add one")


MAKERS: dict[str, Callable[[int, Stream, Path], dict]] = {
    "numpy": make_numpy,
    "bigper-memory": lambda c, s, r: make_bigper(c, s, r, storage="memory"),
    "bigper-memmap": lambda c, s, r: make_bigper(c, s, r, storage="memmap"),
    "bigper-memmap-n3": lambda c, s, r: make_bigper(c, s, r, storage="memmap", n_step=3),
    "cpprb": make_cpprb,
    "tianshou": make_tianshou,
    "torchrl": make_torchrl,
}
VERSION_OF = {"numpy": "numpy", "cpprb": "cpprb", "tianshou": "tianshou", "torchrl": "torchrl"}


# -- one peer, in its own process ----------------------------------------------------------


def check(subj: dict, stream: Stream, count: int, cap: int, draws: int = 8) -> dict:
    """Compare sampled stacks with the stream; count the rows that differ."""
    if subj["probe"] is None:
        return {"ok": True, "rows": 0, "note": "not checked"}
    rows = bad_obs = bad_next = bad_next_terminal = 0
    problems = []
    for _ in range(draws):
        gids, obs, nxt, w = subj["probe"](count)
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        if gids.min() < max(0, count - cap) or gids.max() >= count:
            problems.append(f"sampled steps outside [{count - cap}, {count}): {gids.min()}..{gids.max()}")
            break
        if not (np.all(np.isfinite(w)) and w.min() > 0 and w.max() <= 1 + 1e-5):
            problems.append(f"weights outside (0, 1]: {w.min()}..{w.max()}")
        e_obs, e_next, term = stream.expected(gids)
        rows += gids.shape[0]
        bad_obs += int((np.asarray(obs) != e_obs).any(axis=(1, 2, 3)).sum())
        if nxt is not None:
            wrong = (np.asarray(nxt) != e_next).any(axis=(1, 2, 3))
            bad_next += int((wrong & ~term).sum())
            bad_next_terminal += int((wrong & term).sum())
    if bad_obs:
        problems.append(f"{bad_obs} of {rows} obs stacks differ from what was added")
    if bad_next:
        problems.append(f"{bad_next} of {rows} next_obs stacks (non-terminal) differ")
    return {"ok": not problems, "rows": rows, "bad_obs": bad_obs, "bad_next": bad_next,
            "bad_next_terminal": bad_next_terminal, "problems": problems}


def warm_up(name: str, stream: Stream, root: Path) -> None:
    """Import the library and run every path once on a small buffer (numba
    kernels loaded or compiled, lazy imports done), so that what the real
    buffer's RSS growth measures is its data, not the library's code."""
    cap = 256
    subj = MAKERS[name](cap, stream, root / "warm")
    for g in range(1200):  # past the first episode end
        subj["add"](g)
    for i in range(5):
        subj["round"](i)
    if subj["probe"] is not None:
        subj["probe"](1200)
    subj["close"]()
    del subj
    shutil.rmtree(root / "warm", ignore_errors=True)
    gc.collect()


def run_peer(name: str, cap: int, quick: bool, root: Path) -> dict:
    """Fill, add, check, time rounds and measure bytes for one library."""
    frames, source = real_frames()
    stream = Stream(frames)
    del frames
    warm_up(name, stream, root)
    rss0 = proc_status()
    t0 = time.perf_counter()
    subj = MAKERS[name](cap, stream, root)
    create_s = time.perf_counter() - t0
    add = subj["add"]
    res: dict[str, Any] = {"status": "ok", "api": subj["api"], "notes": subj["notes"], "frames": source,
                           "create_s": create_s, "capacity": cap}

    # (a) the fill, then steady-state adds into the full ring.
    say(f"[atari {name}] filling {cap:,} steps ...")
    block = max(1000, cap // 20)
    fill_cpu = 0.0
    t0 = time.perf_counter()
    g = 0
    while g < cap:
        m = min(block, cap - g)
        fill_cpu += time_both(lambda i, g=g: add(g + i), m)[1] * m
        g += m
    res["fill_s"] = time.perf_counter() - t0
    res["fill_per_s"] = cap / res["fill_s"]
    res["fill_per_s_cpu"] = cap / fill_cpu
    more = min(5_000 if quick else 20_000, cap // 5)
    wb = max(500, more // 10)
    wrap = []
    while g < cap + more:
        wrap.append(time_both(lambda i, g=g: add(g + i), wb))
        g += wb
    count = g
    res["add_per_s"] = 1 / statistics.median(w for w, _ in wrap)
    res["add_per_s_cpu"] = 1 / statistics.median(c for _, c in wrap)
    res["add_per_s_blocks"] = [1 / w for w, _ in wrap]
    res["added"] = count
    gc.collect()
    res["bytes"] = subj["bytes"](rss0)

    # correctness of what comes back, before any timing
    res["check"] = check(subj, stream, count, cap)

    # (b) rounds
    rounds, blocks, warm = (100, 3, 20) if quick else (300, 7, 100)
    rnd = subj["round"]
    say(f"[atari {name}] timing {blocks} blocks of {rounds} rounds ...")
    for i in range(warm):
        rnd(i)
    t = [time_both(rnd, rounds) for _ in range(blocks)]
    res["round_us"] = statistics.median(w for w, _ in t) * 1e6
    res["round_us_cpu"] = statistics.median(c for _, c in t) * 1e6
    res["round_us_blocks"] = [w * 1e6 for w, _ in t]
    res["rounds_per_block"] = rounds
    if name.startswith("bigper") and not quick:
        res["round_breakdown_us"] = bigper_breakdown(subj["buffer"], rounds)
    subj["close"]()
    return res


def bigper_breakdown(buf, rounds: int) -> dict[str, float]:
    """Where a bigper round goes, CPU us per call: sample (tree + weights +
    gather), the gather alone, and the priority update (by the batch's indices)."""
    pool = td_pool()
    idx = buf.sample(BATCH).indices
    sample = time_both(lambda i: buf.sample(BATCH), rounds)
    gather = time_both(lambda i: buf._gather(idx), rounds)
    update = time_both(lambda i: buf.update_priorities(idx, pool[i % len(pool)]), rounds)
    return {"sample": sample[1] * 1e6, "gather_only": gather[1] * 1e6, "update": update[1] * 1e6,
            "sample_wall": sample[0] * 1e6, "gather_only_wall": gather[0] * 1e6, "update_wall": update[0] * 1e6}


def bytes_at_million(root: Path) -> dict:
    """Disk blocks of a freshly created 1M-capacity memmap buffer (its files are
    preallocated in full, so nothing needs filling), per transition."""
    bigper = _import_bigper()
    need = 7.5e9
    free = shutil.disk_usage(root).free
    if free < need * 1.1:
        return {"status": "skipped", "why": f"{free / 1e9:.1f} GB free under {root}, need ~{need / 1e9:.1f}"}
    path = root / "bigper-memmap-1m-empty"
    t0 = time.perf_counter()
    buf = bigper.PrioritizedReplayBuffer(
        MILLION, {"obs": ((K, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, storage="memmap", path=path, seed=0)
    create_s = time.perf_counter() - t0
    try:
        disk = disk_bytes(path)
        files = _file_sizes(path)
        ram = ram_arrays(buf)
    finally:
        buf.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"status": "ok", "create_s": create_s, "disk_bytes": disk, "disk_per_transition": disk / MILLION,
            "ram_per_transition": ram / MILLION, "bytes_per_transition": (disk + ram) / MILLION,
            "ram": "bytes of the buffer's in-RAM arrays (tree, bookkeeping)", "files": files}


def child_main(args) -> int:
    root = Path(args.dir or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"bench-atari-{args.peer}-", dir=root))
    try:
        if args.peer == "bytes-1m":
            res = bytes_at_million(work)
        else:
            res = run_peer(args.peer, args.size, args.quick, work)
    except PeerUnavailable as exc:
        res = {"status": "unavailable", "error": str(exc)}
    except ImportError as exc:
        res = {"status": "not installed", "error": _short_error(exc)}
    except Exception as exc:  # a library under construction must not stop the others
        import traceback

        traceback.print_exc(limit=4)
        res = {"status": "error", "error": _short_error(exc)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, separators=(",", ":")))
    return 0


# -- the comparison (parent process) ---------------------------------------------------------


def spawn(peer: str, size: int, quick: bool, root: str | None, malloc: str = "default",
          timeout: float = 3600) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", peer, "--size", str(size)]
    if quick:
        cmd.append("--quick")
    if root:
        cmd += ["--dir", root]
    t0 = time.perf_counter()
    env = dict(os.environ)
    for k in MALLOC_TUNED:
        env.pop(k, None)
    if malloc == "tuned":
        env.update(MALLOC_TUNED)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"status": "error", "error": f"exit {p.returncode}, no result line"}
    res = json.loads(lines[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def merge(runs: list[dict]) -> dict:
    """One result from repeated runs of a peer: medians of the timings, the runs kept."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return runs[-1]
    out = dict(ok[-1])
    for key in ("round_us", "round_us_cpu", "add_per_s", "add_per_s_cpu", "fill_per_s", "fill_per_s_cpu"):
        out[key] = statistics.median(r[key] for r in ok)
        out[key + "_runs"] = [r[key] for r in ok]
    out["runs"] = len(ok)
    return out


def compare(ours: dict, peers: dict) -> dict:
    """Ratios of every bigper result in ``ours`` against the fastest rival in
    ``peers``, by wall time and by CPU time (fastest picked for each)."""
    rivals = {p: peers[p] for p in RIVALS if peers.get(p, {}).get("status") == "ok"}
    out: dict[str, Any] = {}
    for clock, rk, ak in (("wall", "round_us", "add_per_s"), ("cpu", "round_us_cpu", "add_per_s_cpu")):
        fr = min(rivals, key=lambda p: rivals[p][rk], default=None)
        fa = max(rivals, key=lambda p: rivals[p][ak], default=None)
        out[f"fastest_round_peer_{clock}"], out[f"fastest_add_peer_{clock}"] = fr, fa
        for name, r in ours.items():
            if not name.startswith("bigper") or r.get("status") != "ok":
                continue
            d = out.setdefault(name, {})
            d[f"round_{clock}"] = ratio(rivals[fr][rk], r[rk]) if fr else None
            d[f"add_{clock}"] = ratio(r[ak], rivals[fa][ak]) if fa else None
            d[f"round_over_numpy_floor_{clock}"] = ratio(r[rk], peers.get("numpy", {}).get(rk))
    return out


def run(quick: bool, size: int, million: bool, repeat: int, peers: tuple[str, ...],
        root: str | None, malloc: str = "default") -> dict:
    if quick:
        size = min(size, 20_000)
    real_frames()  # record the frame cache once, before the peers race for it
    order = list(peers)
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for r in range(repeat):
        for p in order[r % len(order):] + order[: r % len(order)]:
            say(f"[atari] {p}, size {size:,} (run {r + 1} of {repeat}) ...")
            runs[p].append(spawn(p, size, quick, root, malloc))
            if runs[p][-1].get("status") in ("unavailable", "not installed"):
                order.remove(p)
                if not order:
                    break
    results = {p: merge(v) for p, v in runs.items()}

    ratios = compare(results, results)
    rep: dict[str, Any] = {"bench": "atari", "quick": quick, "size": size, "batch": BATCH, "alpha": ALPHA,
                           "beta": BETA, "repeat": repeat, "malloc": malloc,
                           "malloc_env": MALLOC_TUNED if malloc == "tuned" else {}, "versions": versions(),
                           "results": results,
                           "ratios": ratios, "targets": {"round": TARGET_ROUND, "add": TARGET_ADD,
                                                         "bytes_1m": TARGET_BYTES}}

    # bytes per transition at 1M capacity: the preallocated files of a 1M memmap
    # buffer plus its in-RAM arrays (tree and bookkeeping)
    rep["bytes_1m"] = spawn("bytes-1m", MILLION, quick, root)

    if million:
        need = 8.0e9
        where = root or tempfile.gettempdir()
        free = shutil.disk_usage(where).free
        if free < need:
            rep["million"] = {"status": "skipped", "why": f"{free / 1e9:.1f} GB free under {where}"}
        else:
            say(f"[atari] bigper-memmap at 1M capacity, 1M steps ({free / 1e9:.0f} GB free) ...")
            m = spawn("bigper-memmap", MILLION, quick, root, malloc)
            if m.get("status") == "ok":
                m["ratios"] = compare({"bigper-memmap": m}, results)["bigper-memmap"]
                m["ratios"]["note"] = f"against the peers at {size:,}"
            rep["million"] = m
    return rep


# -- output ---------------------------------------------------------------------------


def _bytes_cell(r: dict) -> str:
    b = r.get("bytes", {})
    if "bytes_per_transition" not in b:
        return "-"
    if "disk_per_transition" in b:
        return (f"{b['bytes_per_transition']:,.0f} (disk {b['disk_per_transition']:,.0f} + RAM "
                f"{b['ram_per_transition']:,.0f}; arrays {b['ram_arrays_per_transition']:,.0f})")
    return f"{b['bytes_per_transition']:,.0f} (RAM)"


def _check_cell(r: dict) -> str:
    c = r.get("check", {})
    if not c:
        return "-"
    if c.get("note"):
        return "-"
    if c["ok"]:
        return "ok"
    return f"{c['bad_obs'] + c['bad_next']}/{c['rows']} differ"


def _ratio_cell(d: dict, key: str) -> str:
    return f"{_fmt(d.get(key + '_wall'), '.2f')} / {_fmt(d.get(key + '_cpu'), '.2f')}"


def print_report(rep: dict) -> None:
    res, rat = rep["results"], rep["ratios"]
    any_ok = next((r for r in res.values() if r.get("status") == "ok"), {})
    print()
    print(f"atari: {rep['size']:,} transitions, obs/next_obs (4, 84, 84) uint8 from {any_ok.get('frames', '?')}; "
          f"episodes 900-1100 steps; alpha {rep['alpha']}, beta {rep['beta']}")
    print(f"one process per library; add = one step per call (fill, then {min(20_000, rep['size'] // 5):,} more "
          f"into the full ring: median of blocks); round = sample({rep['batch']}) with obs and next_obs stacks "
          f"+ IS weights + update of the {rep['batch']} priorities (median of blocks); "
          f"{rep['repeat']} run(s) per library, medians; wall / CPU: wall-clock and this process's CPU time "
          f"(the machine may be shared); malloc: {rep['malloc']} "
          f"{' '.join(f'{k}={v}' for k, v in rep['malloc_env'].items())}")
    headers = ["library", "version", "fill/s", "add/s wall", "add/s cpu", "add ratio w/c", "round us wall",
               "round us cpu", "round ratio w/c", "bytes/transition", "check"]
    rows = []
    vers = rep["versions"]
    for name, r in res.items():
        if r.get("status") != "ok":
            rows.append([name, r.get("status", "?")] + [""] * (len(headers) - 2))
            continue
        rr = rat.get(name, {})
        v = "checkout" if name.startswith("bigper") else (vers.get(VERSION_OF.get(name, ""), "") or "")
        rows.append([name, v, _fmt(r["fill_per_s"], ",.0f"), _fmt(r["add_per_s"], ",.0f"),
                     _fmt(r["add_per_s_cpu"], ",.0f"), _ratio_cell(rr, "add") if rr else "",
                     _fmt(r["round_us"], ".1f"), _fmt(r["round_us_cpu"], ".1f"),
                     _ratio_cell(rr, "round") if rr else "",
                     _bytes_cell(r) if rep["malloc"] == "default" else "n/a (tuned malloc)", _check_cell(r)])
    print_table(headers, rows)
    if rep["malloc"] != "default":
        print("bytes/transition: not measured with tuned malloc (freed memory stays in the heap and is reused, "
              "so RSS growth undercounts); see a default run")
    print(f"ratios (wall / cpu): round = fastest peer's round / this (fastest: "
          f"{rat.get('fastest_round_peer_wall')} / {rat.get('fastest_round_peer_cpu')}; target >= {TARGET_ROUND}); "
          f"add = this add/s / fastest peer's ({rat.get('fastest_add_peer_wall')} / "
          f"{rat.get('fastest_add_peer_cpu')}; target >= {TARGET_ADD})")
    for name, r in res.items():
        if r.get("status") != "ok":
            print(f"  {name}: {r.get('status')}: {r.get('error')}")
            continue
        for n in r.get("notes", []):
            print(f"  {name}: {n}")
        c = r.get("check", {})
        if c.get("rows"):
            extra = (f"; next_obs of terminal steps differing: {c['bad_next_terminal']}"
                     if c.get("bad_next_terminal") else "")
            print(f"  {name}: check of {c['rows']} sampled rows: "
                  f"{'ok' if c['ok'] else '; '.join(c['problems'])}{extra}")
        if "round_breakdown_us" in r:
            b = r["round_breakdown_us"]
            print(f"  {name}: round = sample {b['sample']:.1f} us (gather of one batch's indices, repeated: "
                  f"{b['gather_only']:.1f}) + update {b['update']:.1f} us (cpu)")
        if r.get("runs", 1) > 1:
            print(f"  {name}: runs: round us wall {', '.join(f'{x:.1f}' for x in r['round_us_runs'])}; "
                  f"cpu {', '.join(f'{x:.1f}' for x in r['round_us_cpu_runs'])}; add/s wall "
                  f"{', '.join(f'{x:,.0f}' for x in r['add_per_s_runs'])}; cpu "
                  f"{', '.join(f'{x:,.0f}' for x in r['add_per_s_cpu_runs'])}")
    b = rep.get("bytes_1m", {})
    if b.get("status") == "ok" and "bytes_per_transition" in b:
        files = ", ".join(f"{k} {v / MILLION:,.1f}" for k, v in sorted(b["files"].items(), key=lambda kv: -kv[1])
                          if v)
        verdict = "ok" if b["bytes_per_transition"] <= TARGET_BYTES else "MISSED"
        print(f"bytes per transition at 1M capacity (bigper memmap, n_step=1, created, not filled): "
              f"{b['bytes_per_transition']:,.0f} = files {b['disk_per_transition']:,.0f} (preallocated blocks) + "
              f"RAM {b['ram_per_transition']:,.0f} (its in-RAM arrays' bytes); target <= {TARGET_BYTES:,}: "
              f"{verdict}")
        print(f"  files per transition: {files}")
    else:
        print(f"bytes per transition at 1M capacity: {b.get('status')}: {b.get('why') or b.get('error')}")
    m = rep.get("million")
    if m:
        if m.get("status") != "ok":
            print(f"1M run: {m.get('status')}: {m.get('why') or m.get('error')}")
        else:
            mb, mr = m["bytes"], m.get("ratios", {})
            worst = mb["disk_per_transition"] + max(mb["ram_per_transition"], mb["ram_arrays_per_transition"])
            verdict = "ok" if worst <= TARGET_BYTES else "MISSED"
            print(f"1M run (bigper memmap, capacity 1,000,000, {m['added']:,} steps added one add() each): "
                  f"create {m['create_s']:.1f} s; fill {m['fill_s']:.1f} s = {m['fill_per_s']:,.0f} steps/s "
                  f"(cpu {m['fill_per_s_cpu']:,.0f}/s)")
            print(f"  add into the full ring {m['add_per_s']:,.0f}/s wall, {m['add_per_s_cpu']:,.0f}/s cpu "
                  f"(ratio w/c {_ratio_cell(mr, 'add')}); round {m['round_us']:.1f} us wall, "
                  f"{m['round_us_cpu']:.1f} us cpu (ratio w/c {_ratio_cell(mr, 'round')}; {mr.get('note')})")
            print(f"  bytes/transition {worst:,.0f} (disk {mb['disk_per_transition']:,.0f} + RAM: RssAnon growth "
                  f"{mb['ram_per_transition']:,.0f}, in-RAM arrays {mb['ram_arrays_per_transition']:,.0f}; the "
                  f"larger counted); target <= {TARGET_BYTES:,}: {verdict}; check {_check_cell(m)}")
            if "round_breakdown_us" in m:
                bd = m["round_breakdown_us"]
                print(f"  round = sample {bd['sample']:.1f} us (gather of one batch's indices, repeated: "
                      f"{bd['gather_only']:.1f}) + update {bd['update']:.1f} us (cpu)")


def cmd_atari(args) -> int:
    peers = tuple(s.strip() for s in args.peers.split(",")) if args.peers else PEERS
    unknown = [p for p in peers if p not in MAKERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}, expected a subset of {list(MAKERS)}")
    print_header("atari")
    rep = run(args.quick, args.size, args.million, args.repeat, peers, args.dir, args.malloc)
    print_report(rep)
    print(json.dumps(rep, separators=(",", ":")))
    bad = [n for n, r in rep["results"].items()
           if r.get("status") == "error" or (n.startswith("bigper") and not r.get("check", {}).get("ok", True))]
    return 1 if bad else 0


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="at most 20k transitions, fewer rounds (a smoke run)")
    p.add_argument("--size", type=int, default=100_000, help="transitions per library (default 100000)")
    p.add_argument("--million", action="store_true",
                   help="also fill a 1M-capacity bigper memmap buffer with 1M steps (~7.5 GB; deleted after)")
    p.add_argument("--repeat", type=int, default=1, help="runs per library (rotating order); medians reported")
    p.add_argument("--peers", help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--malloc", choices=("default", "tuned"), default="default",
                   help="tuned: every library's process runs with fixed glibc malloc thresholds "
                        f"({', '.join(f'{k}={v}' for k, v in MALLOC_TUNED.items())})")
    p.add_argument("--dir", help="where disk buffers go (a temporary directory under it; default $TMPDIR)")
    p.set_defaults(func=cmd_atari)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench_atari", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--peer", help=argparse.SUPPRESS)  # child mode: one library, result on stdout
    a = parser.parse_args()
    sys.exit(child_main(a) if a.peer else a.func(a))
