"""Workload "storage": bigper's storages side by side on Atari-shaped data.

For memory, memmap, HDF5 and HDF5 with lzf, in one process and on the same
data: fill rate (``add`` one step at a time, and ``extend`` in chunks, with
the final flush), bytes per transition (on disk: allocated blocks; memory:
RAM), and sample(32) + update_priorities rounds with a warm page cache and,
where the page cache can be dropped (root), a cold one. Ratios are taken in
the same run: memmap / memory (target <= 1.25 warm) and hdf5 / memmap.

The memmap capacity sweep (sweep.py): sample(32) + update
from 2^14 to ``--sweep-max`` (default 2^18) transitions, page cache warm and
cold, beside a bare numpy gather, as a table and a PNG (``--plot``).

``--million``: a 1M-capacity memmap buffer of 84x84 uint8 frames
(``next_of=()``, about 7 GB): seconds to create it, then fill it through
``extend`` while a thread samples RssAnon (/proc/self/status); the target is
a peak under 300 MB (the data is on disk, not in RAM).

Usage::

    python tools/bench.py storage [--quick] [--million] [--sweep-max LOG2] [--dir DIR]

Prints a table and, last, one JSON line ``{"bench": "storage", ...}``.

Layout (tools/workloads/storage/): the comparison is here (main.py); the
frames, steps and helpers are in data.py, the ``--million`` run in
million.py, the sweep in sweep.py, the copy-on-write row in cow.py.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchkit import fmt, print_header, print_table, ratio, versions
from workloads.storage.cow import print_cow, run_cow
from workloads.storage.data import (
    BATCH,
    CHUNK,
    FRAME,
    KINDS,
    TARGET_MEMMAP_OVER_MEMORY,
    Steps,
    disk_bytes,
    drop_page_cache,
    interleaved_wall_cpu,
    make_round,
    open_buffer,
    td_pool,
    touch_pages,
)
from workloads.storage.million import print_million, run_million
from workloads.storage.sweep import plot_sweep, print_sweep, run_sweep


# -- the comparison -------------------------------------------------------------------


def run_storages(quick: bool, root: Path, say=print) -> dict:
    cap = 10_000 if quick else 100_000
    n_add = 1_000 if quick else 2_000  # the rest of the capacity in chunks of CHUNK
    blocks, rounds, warmup = (5, 100, 50) if quick else (15, 300, 200)
    cold_rounds, cold_repeats, cold_s = (100, 2, 3.0) if quick else (300, 3, 10.0)
    steps, pool = Steps(), td_pool()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    res: dict[str, dict] = {}
    bufs = {}
    warm = open_buffer("memory", 64, root)  # numba's cached kernels load here, not in a timing
    warm.extend(steps.chunk(0, 64))
    warm.update_priorities(warm.sample(BATCH), pool[0])
    for kind in KINDS:
        say(f"[storage] {kind}: filling {cap:,} transitions ...", flush=True)
        t0 = time.perf_counter()
        buf = open_buffer(kind, cap, root)
        create_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n_add):
            buf.add(**steps.step(i))
        add_s = time.perf_counter() - t0
        n_ext = (cap - n_add) // CHUNK
        t0 = time.perf_counter()
        for i in range(n_ext):
            buf.extend(steps.chunk(i))
        ext_s = time.perf_counter() - t0
        n = len(buf)
        path = buf._store.path
        close_s = None
        if path:  # close: flush, fsync, state; what was added is on disk now
            t0 = time.perf_counter()
            buf.close()
            close_s = time.perf_counter() - t0
            buf = open_buffer(kind, cap, root)  # the page cache is still warm
            touch_pages(buf)
        nbytes = disk_bytes(path) if path else buf._store.nbytes()
        res[kind] = {"create_s": create_s, "add_per_s": n_add / add_s, "extend_per_s": n_ext * CHUNK / ext_s,
                     "close_s": close_s, "durable_per_s": cap / (add_s + ext_s + (close_s or 0)),
                     "len": n, "bytes_per_transition": nbytes / cap, "where": "disk" if path else "RAM"}
        bufs[kind] = buf

    say(f"[storage] warm rounds: {blocks} blocks of {rounds} sample({BATCH}) + update ...", flush=True)
    fns = {kind: make_round(buf, pool) for kind, buf in bufs.items()}
    for kind, (wall, cpu, k) in interleaved_wall_cpu(fns, rounds, blocks, warmup).items():
        res[kind]["warm_us"] = statistics.median(wall)
        res[kind]["warm_cpu_us"] = statistics.median(cpu)
        res[kind]["warm_us_blocks"] = wall
        res[kind]["warm_rounds_per_block"] = k

    # Cold: close (unmapping the files and emptying HDF5's chunk cache), drop
    # the page cache, reopen, and time the first rounds one by one.
    cold_note = None
    for rep in range(cold_repeats):
        for kind in KINDS[1:]:
            bufs[kind].close()
            cold_note = drop_page_cache()
            if cold_note:
                bufs[kind] = open_buffer(kind, cap, root)
                continue
            bufs[kind] = buf = open_buffer(kind, cap, root)
            rnd = make_round(buf, pool)
            t0 = time.perf_counter()
            for i in range(cold_rounds):  # at most cold_s seconds: compressed HDF5 is slow
                rnd(i)
                if time.perf_counter() - t0 > cold_s:
                    break
            res[kind].setdefault("cold_us_repeats", []).append((time.perf_counter() - t0) / (i + 1) * 1e6)
        if cold_note:
            break
    for kind in KINDS[1:]:
        if "cold_us_repeats" in res[kind]:
            res[kind]["cold_us"] = statistics.median(res[kind]["cold_us_repeats"])
        bufs[kind].close()
    bufs.clear()

    m = res["memmap"]
    ratios = {
        "memmap/memory warm": ratio(m["warm_us"], res["memory"]["warm_us"]),
        "memmap/memory warm cpu": ratio(m["warm_cpu_us"], res["memory"]["warm_cpu_us"]),
        "hdf5/memmap warm": ratio(res["hdf5"]["warm_us"], m["warm_us"]),
        "hdf5/memmap warm cpu": ratio(res["hdf5"]["warm_cpu_us"], m["warm_cpu_us"]),
        "hdf5/memmap cold": ratio(res["hdf5"].get("cold_us"), m.get("cold_us")),
        "hdf5-lzf/memmap warm": ratio(res["hdf5-lzf"]["warm_us"], m["warm_us"]),
        "hdf5-lzf/memmap cold": ratio(res["hdf5-lzf"].get("cold_us"), m.get("cold_us")),
    }
    return {"capacity": cap, "n_add": n_add, "loadavg": load, "chunk": CHUNK, "batch": BATCH,
            "blocks": blocks, "rounds_per_block": rounds, "cold_rounds": cold_rounds, "cold_s": cold_s,
            "cold": "measured" if cold_note is None else f"cold not measurable ({cold_note})",
            "ratios": ratios, "results": res}


def print_storages(rep: dict) -> None:
    print()
    print(f"storage: capacity {rep['capacity']:,}, obs {FRAME} uint8 + next_obs, action int64, reward "
          f"float32; add = one step per call ({rep['n_add']:,} steps), extend = chunks of {rep['chunk']} "
          f"(into the page cache); close = flush + fsync + state; fill/s = capacity / (add + extend + close)")
    print(f"round = sample({rep['batch']}) + update_priorities; warm: median of {rep['blocks']} blocks of up "
          f"to {rep['rounds_per_block']} (wall, and this process's CPU time); cold: wall, first "
          f"{rep['cold_rounds']} rounds (at most {rep['cold_s']:.0f} s) after dropping the page cache")
    print(f"machine load average at the start: {rep['loadavg']}")
    headers = ["storage", "create s", "add/s", "extend/s", "close s", "fill/s", "bytes/transition",
               "warm us", "warm cpu us", "cold us"]
    rows = []
    for kind, r in rep["results"].items():
        rows.append([kind, fmt(r["create_s"], ".3f"), fmt(r["add_per_s"], ",.0f"),
                     fmt(r["extend_per_s"], ",.0f"), fmt(r["close_s"], ".2f"),
                     fmt(r["durable_per_s"], ",.0f"),
                     f"{r['bytes_per_transition']:,.0f} ({r['where']})", fmt(r["warm_us"], ".1f"),
                     fmt(r["warm_cpu_us"], ".1f"),
                     fmt(r.get("cold_us"), ".1f") if kind != "memory" else "-"])
    print_table(headers, rows)
    print(f"cold: {rep['cold']}")
    for name, v in rep["ratios"].items():
        target = f"  (target <= {TARGET_MEMMAP_OVER_MEMORY})" if name.startswith("memmap/memory") else ""
        print(f"  {name}: {fmt(v, '.2f')}{target}")
    for kind, r in rep["results"].items():
        b = r["warm_us_blocks"]
        print(f"  {kind} warm block range us: {min(b):.1f}-{max(b):.1f} "
              f"({r['warm_rounds_per_block']} rounds a block)")


# -- command -------------------------------------------------------------------------------


def run(quick: bool, million: bool, root: str | None = None, sweep_max: int = 18,
        plot: str | None = None) -> dict:
    top = Path(tempfile.mkdtemp(prefix="bigper-bench-storage-", dir=root))
    try:
        report = {"bench": "storage", "quick": quick, "dir": str(top),
                  "filesystem": _filesystem(top), "versions": versions()}
        if million:  # first, so the peak RssAnon is not that of the comparison's leftovers
            report["million"] = run_million(quick, top)
        report.update(run_storages(quick, top))
        from workloads.storage.data import frames

        report["cow"] = run_cow(quick, top, frames(3000))
        if sweep_max:
            report["sweep"] = run_sweep(quick, sweep_max, top)
            if plot:
                report["sweep"]["plot"] = plot_sweep(report["sweep"], plot)
        return report
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _filesystem(path: Path) -> str:
    try:
        r = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, timeout=10)
        return " ".join(r.stdout.splitlines()[-1].split()[:2])
    except Exception:  # informational only
        return "unknown"


def cmd_storage(args) -> int:
    import json

    if args.sweep_max and not 14 <= args.sweep_max <= 24:
        raise SystemExit(f"--sweep-max must be 0 or in [14, 24], got {args.sweep_max}")
    print_header("storage")
    report = run(args.quick, args.million, args.dir, args.sweep_max, args.plot)
    print(f"dir: {report['dir']} ({report['filesystem']})")
    print_storages(report)
    if "million" in report:
        print_million(report["million"])
    print_cow(report["cow"])
    if "sweep" in report:
        print_sweep(report["sweep"])
    print(json.dumps(report, separators=(",", ":")))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="10k transitions, fewer rounds (a smoke run)")
    p.add_argument("--million", action="store_true",
                   help="also create and fill a 1M-capacity memmap buffer (~7 GB on disk; deleted after)")
    p.add_argument("--sweep-max", type=int, default=18, metavar="LOG2",
                   help="largest capacity of the memmap sweep, a power of two (14..24; default 18, "
                        "1.9 GB; 22 is 30 GB; 0: no sweep)")
    # No plot unless asked: the committed figure changes only when a maintainer writes it on purpose.
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write the sweep's plot to PNG (default: none; the docs' figure is "
                        "tools/results/bench-memmap-sweep.png)")
    p.add_argument("--dir", help="where the buffers go (in a temporary directory under it; default: $TMPDIR)")
    p.set_defaults(func=cmd_storage)
