"""Workload "storage", the data and helpers: synthetic Atari-like frames, steps, rounds.

Shared by main.py (the comparison), million.py (the 1M buffer) and sweep.py
in this package, and by the atari workload (workloads/atari/data.py: frames when
ale-py is missing; scale.py and games.py: ``drop_page_cache``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper

KINDS = ("memory", "memmap", "hdf5", "hdf5-lzf")
FRAME = (84, 84)
FIELDS = {"obs": (FRAME, np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
BATCH = 32
CHUNK = 1000  # transitions per extend
TARGET_MEMMAP_OVER_MEMORY = 1.25
TARGET_RSS_ANON_MB = 300



# -- data -------------------------------------------------------------------------


def frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` synthetic Atari-like frames: a flat background, a few moving
    blocks and a little noise (so lzf sees data about as compressible as a
    game screen, not random bytes)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, *FRAME), dtype=np.uint8)
    yy, xx = np.mgrid[: FRAME[0], : FRAME[1]]
    for i in range(n):
        f = np.full(FRAME, 40 + (i // 97) % 8 * 10, dtype=np.uint8)
        for b in range(4):
            y, x = (17 * b + 3 * i) % 76, (29 * b + 5 * i + 7 * b * b) % 76
            f[(yy >= y) & (yy < y + 8) & (xx >= x) & (xx < x + 6)] = 200 - 30 * b
        f[rng.random(FRAME) < 0.01] = 255
        out[i] = f
    return out


class Steps:
    """Chunks of transitions cut from a pool of frames (built once, reused)."""

    def __init__(self, next_obs: bool = True, pool: int = 4 * CHUNK, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.pool = frames(pool + 1, seed)
        self.action = rng.integers(0, 18, pool, dtype=np.int64)
        self.reward = rng.standard_normal(pool).astype(np.float32)
        self.term = rng.random(pool) < 0.002
        self.n, self.next_obs = pool, next_obs

    def chunk(self, i: int, m: int = CHUNK) -> dict:
        s = (i * m) % (self.n - m + 1)
        d = {"obs": self.pool[s:s + m], "action": self.action[s:s + m],
             "reward": self.reward[s:s + m], "terminated": self.term[s:s + m]}
        if self.next_obs:
            d["next_obs"] = self.pool[s + 1:s + m + 1]
        return d

    def step(self, i: int) -> dict:
        j = i % self.n
        d = {"obs": self.pool[j], "action": self.action[j], "reward": self.reward[j],
             "terminated": bool(self.term[j])}
        if self.next_obs:
            d["next_obs"] = self.pool[j + 1]
        return d


# -- helpers ------------------------------------------------------------------------


def open_buffer(kind: str, capacity: int, root: Path, **kw):
    bigper = import_bigper()
    if kind == "hdf5-lzf":
        kw["storage_options"] = {"compression": "lzf"}
    if kind != "memory":
        kw["path"] = root / (kind + (".h5" if kind.startswith("hdf5") else ""))
        kw.setdefault("mode", "resume")  # the bench reopens its buffers (fresh when nothing is there)
    return bigper.PrioritizedReplayBuffer(capacity, FIELDS, storage=kind.split("-")[0], alpha=0.6,
                                          beta=0.4, seed=0, **kw)


def disk_bytes(path: Path) -> int:
    """Blocks allocated to the files at or under ``path`` (lock files included)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    if path.is_file():
        files.append(path.with_name(path.name + ".lock"))
    return sum(p.stat().st_blocks * 512 for p in files if p.exists())


def touch_pages(buf) -> None:
    """Read one byte of every page of a memory-mapped storage: the page cache
    is warm, but a fresh mapping still takes a (minor) fault on the first
    touch of each page, a cost a long run pays once, not every round."""
    for a in (buf._store.arrays or {}).values():
        flat = a.reshape(-1).view(np.uint8) if a.flags.c_contiguous else None
        if flat is not None:
            int(flat[::4096].sum())


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def drop_page_cache() -> str | None:
    """Drop the page cache; None when done, else why not."""
    if os.geteuid() != 0:
        return "not root"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def td_pool(n: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [np.abs(rng.standard_normal(BATCH)) + 0.01 for _ in range(n)]


def make_round(buf, pool):
    def rnd(i: int) -> None:
        buf.update_priorities(buf.sample(BATCH), pool[i % len(pool)])
    return rnd


def interleaved_wall_cpu(fns: dict, n: int, repeats: int, warmup: int, block_s: float = 0.25) -> dict:
    """Like ``benchkit.interleaved_blocks``, with the process's CPU time of each
    block beside its wall time (µs per call): on a shared, loaded machine the
    CPU time is the steadier of the two for work that does not wait on a disk.
    A slow function gets fewer calls a block (about ``block_s`` seconds, at
    least 5); returns ``name -> (wall, cpu, calls per block)``."""
    calls = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        for i in range(warmup):
            fn(i)
            if time.perf_counter() - t0 > 2 * block_s and i >= 4:
                break
        per = (time.perf_counter() - t0) / (i + 1)
        calls[name] = int(min(n, max(5, block_s / per)))
    names = list(fns)
    out = {name: ([], [], calls[name]) for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, k = fns[name], calls[name]
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(k):
                fn(i)
            out[name][0].append((time.perf_counter() - w0) / k * 1e6)
            out[name][1].append((time.process_time() - c0) / k * 1e6)
    return out

