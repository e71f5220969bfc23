"""Workload "storage", ``--million``: a 1M-capacity memmap buffer and its peak RssAnon."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from benchkit import import_bigper, print_table
from workloads.storage.data import (
    BATCH,
    CHUNK,
    FIELDS,
    FRAME,
    TARGET_RSS_ANON_MB,
    Steps,
    disk_bytes,
    make_round,
    rss_anon_mb,
    td_pool,
)


class RssSampler(threading.Thread):
    """Reads RssAnon every ``every`` seconds until stopped; keeps the peak."""

    def __init__(self, every: float = 0.02):
        super().__init__(daemon=True)
        self.every, self.peak, self.samples = every, rss_anon_mb(), 0
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(self.every):
            self.peak = max(self.peak, rss_anon_mb())
            self.samples += 1

    def stop(self) -> float:
        self._stop_evt.set()
        self.join()
        self.peak = max(self.peak, rss_anon_mb())
        return self.peak


def run_million(quick: bool, root: Path, say=print) -> dict:
    bigper = import_bigper()
    cap = 1_000_000
    fill = 100_000 if quick else cap
    steps = Steps(next_obs=False)
    path = root / "million"
    free = shutil.disk_usage(root).free
    need = cap * (FRAME[0] * FRAME[1] + 8 + 4 + 1)
    if free < need * 1.1:
        return {"status": "skipped", "why": f"{free / 1e9:.1f} GB free at {root}, need {need / 1e9:.1f} GB"}
    base = rss_anon_mb()
    sampler = RssSampler()
    sampler.start()
    say(f"[storage] million: creating a {cap:,}-capacity memmap buffer at {path} ...", flush=True)
    t0 = time.perf_counter()
    buf = bigper.PrioritizedReplayBuffer(cap, FIELDS, storage="memmap", path=path, next_of=(), seed=0)
    create_s = time.perf_counter() - t0
    after_create = rss_anon_mb()
    say(f"[storage] million: created in {create_s:.2f} s; filling {fill:,} through extend ...", flush=True)
    trace = []
    t0 = time.perf_counter()
    for i in range(fill // CHUNK):
        buf.extend(steps.chunk(i))
        if (i + 1) % 100 == 0:
            trace.append([(i + 1) * CHUNK, round(time.perf_counter() - t0, 2), round(rss_anon_mb(), 1)])
            say(f"  {trace[-1][0]:>9,} transitions  {trace[-1][1]:7.1f} s  RssAnon {trace[-1][2]:.0f} MB",
                flush=True)
    fill_s = time.perf_counter() - t0
    pool = td_pool()
    rnd = make_round(buf, pool)
    for i in range(200):
        rnd(i)
    t1 = time.perf_counter()
    for i in range(2000):
        rnd(i)
    round_us = (time.perf_counter() - t1) / 2000 * 1e6
    t1 = time.perf_counter()
    buf.close()
    close_s = time.perf_counter() - t1
    peak = sampler.stop()
    on_disk = disk_bytes(path)
    shutil.rmtree(path)
    return {"status": "ok", "capacity": cap, "filled": fill, "chunk": CHUNK, "create_s": create_s,
            "fill_s": fill_s, "fill_per_s": fill / fill_s, "close_s": close_s, "round_us": round_us,
            "disk_bytes": on_disk, "rss_anon_mb": {"before": base, "after_create": after_create,
                                                   "peak": peak, "samples": sampler.samples},
            "target_rss_anon_mb": TARGET_RSS_ANON_MB, "trace": trace}


def print_million(rep: dict) -> None:
    print()
    if rep["status"] != "ok":
        print(f"million: {rep['status']}: {rep['why']}")
        return
    r = rep["rss_anon_mb"]
    print(f"million: memmap, capacity {rep['capacity']:,}, obs {FRAME} uint8 (next_of=()), "
          f"{rep['disk_bytes'] / 1e9:.2f} GB on disk")
    print_table(["what", "value"], [
        ["create s", f"{rep['create_s']:.2f}"],
        [f"fill {rep['filled']:,} s", f"{rep['fill_s']:.1f} ({rep['fill_per_s']:,.0f}/s)"],
        ["close s", f"{rep['close_s']:.2f}"],
        [f"sample({BATCH}) + update us", f"{rep['round_us']:.1f}"],
        ["RssAnon before MB", f"{r['before']:.0f}"],
        ["RssAnon after create MB", f"{r['after_create']:.0f}"],
        ["RssAnon peak MB", f"{r['peak']:.0f} (target < {rep['target_rss_anon_mb']}, "
                            f"{r['samples']} samples)"],
    ])
