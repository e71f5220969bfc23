"""Workload "storage", the copy-on-write row: single-step adds before and after a snapshot.

A memmap buffer with ``frame_stack=4`` (the Atari layout) is filled, then
timed one ``add`` at a time in three phases, every call timed on its own:

- **before**: no snapshot was ever taken (the baseline);
- **after**: right after a snapshot, which shares every chunk file. The
  first write into each chunk copies it (about 4 MB: the spikes, one in a
  few hundred adds); the median is the adds into chunks already copied, while
  other chunks are still shared (a whole ring pass, at 1M capacity 1M adds);
- **after a ring pass**: every chunk copied, none shared any more.

The target: the median after the snapshot within 10% of the one before it
(the copies are paid once per chunk, not by every add).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper

K, FRAME = 4, (84, 84)


def _stack(pool: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    j = g % (pool.shape[0] - K - 1)
    return pool[j:j + K], pool[j + 1:j + K + 1]


def _times(buf, pool, g0: int, n: int) -> list[float]:
    out = []
    rew = np.float32(0.5)
    for g in range(g0, g0 + n):
        o, o2 = _stack(pool, g)
        t0 = time.perf_counter()
        buf.add(obs=o, action=np.int64(g % 18), reward=rew, next_obs=o2, terminated=(g % 1000 == 999))
        out.append(time.perf_counter() - t0)
    return out


def _summary(t: list[float]) -> dict:
    us = np.asarray(t) * 1e6
    return {"median_us": float(np.median(us)), "mean_us": float(us.mean()), "p99_us": float(np.quantile(us, 0.99)),
            "max_us": float(us.max()), "adds": int(us.size)}


def run_cow(quick: bool, root: Path, pool: np.ndarray) -> dict:
    """Median/mean/p99/max per add before a snapshot, at first touch after it, and steady after."""
    bigper = import_bigper()
    cap = 10_000 if quick else 50_000
    n = 2000 if quick else 5000
    buf = bigper.PrioritizedReplayBuffer(
        cap, {"obs": ((K, *FRAME), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, storage="memmap", path=root / "cow-live", seed=0)
    try:
        buf.extend({"obs": np.stack([_stack(pool, g)[0] for g in range(cap)]),
                    "next_obs": np.stack([_stack(pool, g)[1] for g in range(cap)]),
                    "action": np.zeros(cap, np.int64), "reward": np.zeros(cap, np.float32),
                    "terminated": np.zeros(cap, bool)})
        g = cap
        _times(buf, pool, g, n)  # warm: page faults of the first pass, lazy paths
        g += n
        before = _times(buf, pool, g, n)
        g += n
        t0 = time.perf_counter()
        buf.save(root / "cow-snap")
        save_s = time.perf_counter() - t0
        first = _times(buf, pool, g, n)
        g += n
        # Move the ring on without timing until every chunk has had its first touch.
        while g < 2 * cap + 3 * n:
            _times(buf, pool, g, 1000)
            g += 1000
        steady = _times(buf, pool, g, n)
        shared = int(getattr(buf.storage, "_nshared", -1))
    finally:
        buf.close()
    out = {"capacity": cap, "save_s": save_s, "before": _summary(before), "first_touch": _summary(first),
           "steady": _summary(steady), "chunks_still_shared": shared}
    out["steady_over_before"] = out["steady"]["median_us"] / out["before"]["median_us"]
    out["first_over_before"] = out["first_touch"]["median_us"] / out["before"]["median_us"]
    return out


def print_cow(r: dict) -> None:
    print()
    print(f"copy-on-write after a snapshot (memmap, frame_stack=4, capacity {r['capacity']:,}; one add timed "
          f"at a time; the snapshot took {r['save_s']:.2f} s):")
    for key, label in (("before", "before any snapshot"), ("first_touch", "after the snapshot"),
                       ("steady", "after a ring pass")):
        s = r[key]
        print(f"  {label:<22} median {s['median_us']:7.1f} us  mean {s['mean_us']:7.1f}  "
              f"p99 {s['p99_us']:8.1f}  max {s['max_us'] / 1e3:6.1f} ms  ({s['adds']} adds)")
    print(f"  median after the snapshot / before = {r['first_over_before']:.2f} (target <= 1.10; max = a "
          f"chunk's copy); after a ring pass / before = {r['steady_over_before']:.2f}; chunks still shared "
          f"at the end: {r['chunks_still_shared']}")
