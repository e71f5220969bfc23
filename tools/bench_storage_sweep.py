"""Workload "storage", the memmap capacity sweep: how a round grows with capacity.

A memmap buffer of 84x84 uint8 frames (``next_of=()``, about 7 KB a
transition on disk) at capacities 2^14 up to ``--sweep-max`` (default 2^18,
1.9 GB; 2^22 is 30 GB, more than this machine's RAM, so the page cache cannot
hold it). Each is filled to capacity through ``extend``, then:

- **warm**: sample(32) + update_priorities rounds with the page cache holding
  the data (a run whose buffer fits in RAM), beside the floor: a bare numpy
  ``take`` of 32 random rows from the same mapped arrays, no tree, no weights;
- **cold** (root only: the page cache is dropped first): the first rounds
  after the drop, the frames read from disk, beside the same bare gather
  after another drop.

Capacities the disk cannot hold with 10% to spare are skipped and said so.
No peer is beside it: cpprb, Tianshou and TorchRL keep their data in RAM.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from bench_storage_data import (
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
from benchkit import import_bigper, print_table

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


def _timed(fn, rounds: int) -> float:
    """Median µs of ``rounds`` calls, each timed alone."""
    t = []
    for i in range(rounds):
        t0 = time.perf_counter()
        fn(i)
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e6


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
            touch_pages(buf)
            warm = interleaved_wall_cpu({"round": make_round(buf, pool), "floor": _floor(buf)},
                                        2000, 3 if quick else 7, 200)
            row = {"status": "ok", "fill_s": fill_s, "disk_bytes": disk_bytes(path),
                   "round_us": statistics.median(warm["round"][0]),
                   "floor_us": statistics.median(warm["floor"][0])}
            buf.close()
            # Cold: a mapped page survives a drop of the page cache, so each
            # figure comes from a fresh open after the drop.
            for key, make in (("cold_round_us", lambda b: make_round(b, pool)), ("cold_floor_us", _floor)):
                why = drop_page_cache()
                if why:
                    row[key], row["cold_why"] = None, why
                    continue
                buf = bigper.PrioritizedReplayBuffer(cap, FIELDS, mode="resume", **opts)
                row[key] = _timed(make(buf), COLD_ROUNDS)
                buf.close()
            rows[str(cap)] = row
        finally:
            buf.close()
            del buf
            gc.collect()
            shutil.rmtree(path, ignore_errors=True)
    return {"capacities": caps, "batch": BATCH, "cold_rounds": COLD_ROUNDS, "rows": rows}


def print_sweep(sweep: dict) -> None:
    print()
    print(f"memmap capacity sweep: sample({sweep['batch']}) + update, median µs; floor = bare numpy "
          f"take of {sweep['batch']} random rows from the same mapped arrays; cold = the first "
          f"{sweep['cold_rounds']} rounds after dropping the page cache and reopening")
    table = []
    for cap in sweep["capacities"]:
        r = sweep["rows"][str(cap)]
        head = f"2^{cap.bit_length() - 1}"
        if r["status"] != "ok":
            table.append([head, r["status"], r["why"], "", "", "", ""])
            continue
        cold = ("-", "-") if r["cold_round_us"] is None else \
            (f"{r['cold_round_us']:.0f}", f"{r['cold_floor_us']:.0f}")
        table.append([head, f"{r['disk_bytes'] / 1e9:.2f}", f"{cap / r['fill_s']:,.0f}",
                      f"{r['round_us']:.1f}", f"{r['floor_us']:.1f}", *cold])
    print_table(["capacity", "GB on disk", "fill/s", "warm round", "warm floor", "cold round", "cold floor"],
                table)
    whys = {r.get("cold_why") for r in sweep["rows"].values() if r.get("cold_why")}
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
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (("round_us", "bigper memmap, page cache warm", "o-"),
                              ("floor_us", "bare numpy gather, warm", "o--"),
                              ("cold_round_us", "bigper memmap, cold", "s-"),
                              ("cold_floor_us", "bare numpy gather, cold", "s--")):
        pts = [(c, sweep["rows"][str(c)].get(key)) for c in ok]
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
