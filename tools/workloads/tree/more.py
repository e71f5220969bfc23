"""Workload "tree", the extra rows: a capacity sweep and the first call after import.

* **Sweep.** The same round as the 2^20 table (sample B with IS weights and
  data, update B priorities) at capacities 2^16 .. 2^22 (``--sweep-max`` up
  to 2^26), every library that fits in the memory available, beside each
  other; bigper-rank also gets its full re-sort timed at each size. Written as
  a table and a PNG plot (matplotlib, the ``atari`` extra; skipped with a
  note when it is missing).
* **First call.** A fresh interpreter (numba's on-disk cache warm from a
  first, discarded run) imports bigper, builds a small Atari-shaped buffer,
  adds one step, samples 32 and updates their priorities: what a new Ray
  actor or data-loader process pays before its first batch. Target < 1 s.

The timing helpers are tools/benchkit.py's; the adapters are peers.py's (beside this file).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from workloads.tree.peers import TREE_ADAPTERS, TREE_BATCHES, tree_data, tree_priorities
from benchkit import REPO_ROOT, PeerUnavailable, fmt, interleaved_blocks, print_table, say, short_error

# Bytes a library needs per transition in the sweep, roughly (data twice, tree, bookkeeping):
# a size is skipped for a library when this times the capacity passes 60% of the free memory.
BYTES_PER_ROW = {"bigper": 120, "bigper-rank": 120, "cpprb": 110, "tianshou": 200, "torchrl": 300}


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_sweep(quick: bool, sweep_max: int, libs: tuple[str, ...]) -> dict[str, Any]:
    """Median round time (us) per library, capacity and batch size."""
    if not 16 <= sweep_max <= 26:
        raise SystemExit(f"--sweep-max must be in [16, 26], got {sweep_max}")
    caps = [2**e for e in range(16, sweep_max + 1, 1 if quick is False else 2)]
    rounds = {32: 200, 256: 80} if quick else {32: 600, 256: 250}
    repeats, warmup = (2, 10) if quick else (3, 30)
    out: dict[str, Any] = {"capacities": caps, "batches": list(TREE_BATCHES), "rows": {}}
    for cap in caps:
        say(f"[tree sweep] capacity 2^{cap.bit_length() - 1} ...")
        data = tree_data(cap)
        p0 = tree_priorities(cap, seed=1)
        subjects, row = {}, {}
        for name in libs:
            need = BYTES_PER_ROW.get(name, 300) * cap
            if need > 0.6 * _available_bytes():
                row[name] = {"status": "skipped", "why": f"needs ~{need / 2**30:.1f} GiB"}
                continue
            try:
                subjects[name] = TREE_ADAPTERS[name](data, p0)
                row[name] = {"status": "ok", "round_us": {}}
            except (ImportError, PeerUnavailable) as exc:
                row[name] = {"status": "not installed", "error": short_error(exc)}
            except Exception as exc:  # one library failing must not stop the sweep
                row[name] = {"status": "error", "error": short_error(exc)}
        for b in TREE_BATCHES:
            fns = {n: s.make_round(b) for n, s in subjects.items()}
            for n, secs in interleaved_blocks(fns, rounds[b], repeats, warmup).items():
                row[n]["round_us"][str(b)] = float(np.median(secs)) * 1e6
        rank = subjects.get("bigper-rank")
        if rank is not None:
            sorts = []
            for _ in range(3):
                rank.bulk_update(p0[::-1].copy())
                t0 = time.perf_counter()
                rank.buffer.prioritization.sort()
                sorts.append(time.perf_counter() - t0)
            row["bigper-rank"]["sort_ms"] = float(np.median(sorts)) * 1e3
        out["rows"][str(cap)] = row
        del subjects, rank, data, p0
        gc.collect()
    return out


def plot_sweep(sweep: dict, path: str) -> str:
    """Write the sweep as a PNG (round time against capacity, log-log); returns a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'bigper[atari]')"
    fig, axes = plt.subplots(1, len(sweep["batches"]), figsize=(11, 4.2), sharex=True)
    caps = sweep["capacities"]
    names = sorted({n for row in sweep["rows"].values() for n, r in row.items() if r.get("status") == "ok"})
    for ax, b in zip(np.atleast_1d(axes), sweep["batches"]):
        for name in names:
            pts = [(c, sweep["rows"][str(c)][name]["round_us"].get(str(b))) for c in caps
                   if sweep["rows"][str(c)].get(name, {}).get("status") == "ok"]
            pts = [(c, y) for c, y in pts if y is not None]
            if pts:
                ax.plot([c for c, _ in pts], [y for _, y in pts], marker="o", label=name,
                        linewidth=2.5 if name.startswith("bigper") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"sample {b} + IS weights + update {b}")
        ax.set_xlabel("capacity (transitions)")
        ax.set_ylabel("us per round (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


_FIRST_CALL = r"""
import json, time, sys
t0 = time.perf_counter()
import numpy as np
tn = time.perf_counter()
import numba
tb = time.perf_counter()
import bigper
t1 = time.perf_counter()
init = 0.0
if "--split" in sys.argv:  # numba's own start-up (target and typing set-up) on a one-line kernel
    from bigper.prioritization._tree_kernels import first_bad_priority
    first_bad_priority(np.ones(1))
    init = time.perf_counter() - t1
    t1 = time.perf_counter()
buf = bigper.PrioritizedReplayBuffer(256, {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64),
    "reward": ((), np.float32)}, frame_stack=4, seed=0)
o = np.zeros((4, 84, 84), np.uint8)
buf.add(obs=o, action=np.int64(0), reward=np.float32(0), next_obs=o, terminated=False)
t2 = time.perf_counter()
b = buf.sample(32)
t3 = time.perf_counter()
buf.update_priorities(b, np.ones(32))
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0 - init, "numpy_import_s": tn - t0, "numba_import_s": tb - tn,
                  "numba_init_s": init, "first_add_s": t2 - t1, "first_sample_s": t3 - t2,
                  "first_update_s": t4 - t3, "total_s": t4 - t0}))
"""


def first_call(runs: int = 3) -> dict[str, Any]:
    """Import + first add + first sample + first update in fresh processes (the
    first run fills numba's cache if it is cold and is not counted)."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got, split = [], []
    for i in range(2 * runs + 1):
        extra = ["--split"] if i % 2 == 0 and i else []
        p = subprocess.run([sys.executable, "-c", _FIRST_CALL, *extra], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=600)
        if p.returncode:
            return {"status": "error", "error": p.stderr[-300:]}
        if i:
            (split if extra else got).append(json.loads(p.stdout.strip().splitlines()[-1]))
    keys = got[0].keys()
    out = {"status": "ok", "runs": got, **{k: float(np.median([g[k] for g in got])) for k in keys},
           "target_s": 1.0}
    # The same with numba's start-up taken apart: what is numba's, what is bigper's kernels' loading.
    out["split"] = {k: float(np.median([g[k] for g in split])) for k in split[0]}
    return out


def run_extra(quick: bool, *, sweep_max: int, libs: tuple[str, ...], plot: str | None) -> dict:
    sweep = run_sweep(quick, sweep_max, libs)
    sweep["plot"] = plot_sweep(sweep, plot) if plot else "no plot asked for"
    return {"sweep": sweep, "first_call": first_call(2 if quick else 3)}


def print_extra(extra: dict) -> None:
    sweep = extra["sweep"]
    print()
    print("tree capacity sweep: us per round (sample B + IS weights + update B), median; "
          "ratio = peer / bigper at the same size")
    names = sorted({n for row in sweep["rows"].values() for n, r in row.items() if r.get("status") == "ok"})
    absent = sorted({n for row in sweep["rows"].values() for n in row} - set(names))
    headers = ["capacity"]
    for b in sweep["batches"]:
        headers += [f"{n} B={b}" for n in names]
    headers += ["rank sort ms"]
    rows = []
    for c in sweep["capacities"]:
        row = sweep["rows"][str(c)]
        cells = [f"2^{c.bit_length() - 1}"]
        for b in sweep["batches"]:
            ours = row.get("bigper", {}).get("round_us", {}).get(str(b))
            for n in names:
                us = row.get(n, {}).get("round_us", {}).get(str(b))
                if us is None:
                    cells.append(row.get(n, {}).get("status", "-"))
                elif n == "bigper" or ours is None:
                    cells.append(fmt(us, ".1f"))
                else:
                    cells.append(f"{us:.1f} ({us / ours:.2f})")
        cells.append(fmt(row.get("bigper-rank", {}).get("sort_ms"), ".1f"))
        rows.append(cells)
    print_table(headers, rows)
    if absent:
        print(f"  not run: {', '.join(absent)} (not installed or not enough memory)")
    print(f"  {sweep['plot']}")
    fc = extra["first_call"]
    print()
    if fc.get("status") == "ok":
        print(f"first call after import (fresh process, numba cache warm, median of {len(fc['runs'])}): "
              f"import {fc['import_s'] * 1e3:.0f} ms, first add {fc['first_add_s'] * 1e3:.0f} ms, "
              f"first sample {fc['first_sample_s'] * 1e3:.0f} ms, first update {fc['first_update_s'] * 1e3:.0f} ms; "
              f"total {fc['total_s']:.2f} s (target < {fc['target_s']:.0f} s)")
        sp = fc["split"]
        print(f"  of which: numpy import {sp['numpy_import_s'] * 1e3:.0f} ms, numba import "
              f"{sp['numba_import_s'] * 1e3:.0f} ms, numba's start-up at its first kernel call "
              f"{sp['numba_init_s'] * 1e3:.0f} ms (any cached kernel); bigper's own: import "
              f"{(sp['import_s'] - sp['numpy_import_s'] - sp['numba_import_s']) * 1e3:.0f} ms, loading "
              f"its kernels for add/sample/update {(sp['first_add_s'] + sp['first_sample_s'] + sp['first_update_s']) * 1e3:.0f} ms")
    else:
        print(f"first call after import: {fc.get('status')}: {fc.get('error')}")
