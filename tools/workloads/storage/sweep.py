"""Workload "storage", the memmap capacity sweep: how a round grows with capacity.

A memmap buffer of 84x84 uint8 frames (``next_of=()``, about 7 KB a
transition on disk) at capacities 2^14 up to ``--sweep-max`` (default 2^18,
1.9 GB; 2^22 is 30 GB, more than this machine's RAM, so the page cache cannot
hold it). Each is filled to capacity through ``extend``, then:

- **warm**: sample(32) + update_priorities rounds with the page cache holding
  the data (a run whose buffer fits in RAM; past RAM, "(> RAM)", as warm as
  the page cache can keep it), beside the floor: a bare numpy
  ``take`` of 32 random rows from the same mapped arrays, no tree, no weights;
- **cold** (root only: the page cache is dropped first): the first rounds
  after the drop, the frames read from disk, beside the same bare gather
  after another drop;

each reopened with read-ahead (``storage_options={"random_reads": False}``)
and without (``True``); ``default`` says which one ``None`` picks here.

Capacities the disk cannot hold with 10% to spare are skipped and said so.
No peer is beside it: cpprb, Tianshou and TorchRL keep their data in RAM.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper, print_table
from workloads.storage.data import (
    BATCH,
    CHUNK,
    FIELDS,
    FRAME,
    Steps,
    disk_bytes,
    drop_page_cache,
    interleaved_wall_cpu,
    make_round,
    td_pool,
    touch_pages,
)

from bigper.storage.memmap import random_reads_pay

ROW_BYTES = FRAME[0] * FRAME[1] + 8 + 4 + 1  # obs, action, reward, ends
COLD_ROUNDS = 100


def _floor(buf, seed: int = 7):
    """A bare gather of BATCH random rows of every stored field, straight from the mapped arrays."""
    arrays = buf._store.arrays
    rng = np.random.default_rng(seed)
    n = buf.capacity

    def gather(i: int) -> None:
        idx = rng.integers(0, n, BATCH)
        for a in arrays.values():
            a.take(idx, axis=0, mode="clip")

    return gather


def _ram() -> int:
    """Bytes of RAM this machine has (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _timed(fn, rounds: int) -> float:
    """Median µs of ``rounds`` calls, each timed alone."""
    t = []
    for i in range(rounds):
        t0 = time.perf_counter()
        fn(i)
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e6


def _measure(bigper, cap: int, opts: dict, pool, quick: bool) -> dict:
    """Warm and cold rounds and floors of the filled buffer at ``opts["path"]``,
    reopened with ``opts``. Cold: a mapped page survives a drop of the page
    cache, so each cold figure comes from a fresh open after the drop."""
    out = {}
    with bigper.PrioritizedReplayBuffer(cap, FIELDS, mode="resume", **opts) as buf:
        if disk_bytes(opts["path"]) < _ram() // 2:  # else the page cache cannot hold it: warm-up rounds only
            touch_pages(buf)
        warm = interleaved_wall_cpu({"round": make_round(buf, pool), "floor": _floor(buf)},
                                    2000, 3 if quick else 7, 200)
    out["round_us"], out["floor_us"] = (statistics.median(warm[k][0]) for k in ("round", "floor"))
    for key, make in (("cold_round_us", lambda b: make_round(b, pool)), ("cold_floor_us", _floor)):
        why = drop_page_cache()
        if why:
            out[key], out["cold_why"] = None, why
            continue
        with bigper.PrioritizedReplayBuffer(cap, FIELDS, mode="resume", **opts) as buf:
            out[key] = _timed(make(buf), COLD_ROUNDS)
    return out


def run_sweep(quick: bool, sweep_max: int, root: Path, say=print) -> dict:
    bigper = import_bigper()
    steps = Steps(next_obs=False)
    pool = td_pool()
    top = 16 if quick else sweep_max
    caps = [2**e for e in sorted(set(range(14, top + 1, 2)) | {top})]
    rows = {}
    for cap in caps:
        path = root / f"sweep-{cap}"
        free = shutil.disk_usage(root).free
        if free < cap * ROW_BYTES * 1.1:
            rows[str(cap)] = {"status": "skipped",
                              "why": f"{free / 1e9:.1f} GB free, need {cap * ROW_BYTES / 1e9:.1f} GB"}
            continue
        say(f"[storage sweep] capacity 2^{cap.bit_length() - 1}: filling {cap:,} ...", flush=True)
        opts = dict(storage="memmap", path=path, next_of=(), alpha=0.6, beta=0.4, seed=0)
        buf = bigper.PrioritizedReplayBuffer(cap, FIELDS, **opts)
        try:
            t0 = time.perf_counter()
            for i in range(-(-cap // CHUNK)):
                buf.extend(steps.chunk(i, min(CHUNK, cap - i * CHUNK)))
            fill_s = time.perf_counter() - t0
            buf.close()
            os.sync()  # the fill's dirty pages written back now, not during the timed rounds
            row = {"status": "ok", "fill_s": fill_s, "disk_bytes": disk_bytes(path), "ram_bytes": _ram(),
                   "default": "random" if random_reads_pay(disk_bytes(path)) else "ahead"}
            for reads in ("ahead", "random"):
                row[reads] = _measure(bigper, cap, {**opts, "storage_options": {"random_reads": reads == "random"}},
                                      pool, quick)
            rows[str(cap)] = row
        finally:
            buf.close()
            del buf
            gc.collect()
            shutil.rmtree(path, ignore_errors=True)
    return {"capacities": caps, "batch": BATCH, "cold_rounds": COLD_ROUNDS, "rows": rows}


def print_sweep(sweep: dict) -> None:
    print()
    print(f"memmap capacity sweep: sample({sweep['batch']}) + update, median µs, reopened with read-ahead "
          f"(random_reads=False) and without (True); floor = a bare numpy take of {sweep['batch']} random "
          f"rows from the same mapped arrays (default reads); cold = the first {sweep['cold_rounds']} rounds "
          "after dropping the page cache and reopening; default = what random_reads=None picks here")
    table = []
    for cap in sweep["capacities"]:
        r = sweep["rows"][str(cap)]
        head = f"2^{cap.bit_length() - 1}"
        if r["status"] != "ok":
            table.append([head, r["status"], r["why"]] + [""] * 8)
            continue
        big = " (> RAM)" if r["disk_bytes"] > r.get("ram_bytes", 0) > 0 else ""
        d = r[r["default"]]

        def f(v, spec=".0f"):
            return "-" if v is None else format(v, spec)

        table.append([head + big, f"{r['disk_bytes'] / 1e9:.2f}", f"{cap / r['fill_s']:,.0f}", r["default"],
                      f(r["ahead"]["round_us"], ".1f"), f(r["random"]["round_us"], ".1f"), f(d["floor_us"], ".1f"),
                      f(r["ahead"]["cold_round_us"]), f(r["random"]["cold_round_us"]), f(d["cold_floor_us"])])
    print_table(["capacity", "GB on disk", "fill/s", "default", "warm ahead", "warm random", "warm floor",
                 "cold ahead", "cold random", "cold floor"], table)
    whys = {r[m].get("cold_why") for r in sweep["rows"].values() if r["status"] == "ok"
            for m in ("ahead", "random") if r[m].get("cold_why")}
    if whys:
        print(f"  no cold figures: {', '.join(sorted(whys))}")
    if "plot" in sweep:
        print(f"  {sweep['plot']}")


def plot_sweep(sweep: dict, path: str) -> str:
    """Write the sweep as a PNG (round time against capacity, log-log); returns a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'bigper[atari]')"
    ok = [c for c in sweep["capacities"] if sweep["rows"][str(c)]["status"] == "ok"]
    if not ok:
        return "no plot: no capacity was measured"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lines = [(m, key, f"bigper, {'read-ahead' if m == 'ahead' else 'random reads'}, {t}", style)
             for t, key, mark in (("warm", "round_us", "o"), ("cold", "cold_round_us", "s"))
             for m, style in (("ahead", mark + "-"), ("random", mark + ":"))]
    lines += [(None, "floor_us", "bare numpy gather, warm", "o--"), (None, "cold_floor_us", "bare numpy gather, cold", "s--")]
    for mode, key, label, style in lines:
        pts = [(c, sweep["rows"][str(c)][mode or sweep["rows"][str(c)]["default"]].get(key)) for c in ok]
        pts = [(c, y) for c, y in pts if y is not None]
        if pts:
            ax.plot([c for c, _ in pts], [y for _, y in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"memmap, 84x84 frames: sample {sweep['batch']} + update")
    ax.set_xlabel("capacity (transitions)")
    ax.set_ylabel("us per round (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"
