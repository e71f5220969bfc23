"""Compressed adds against raw adds, capacity by capacity (issue 43 §3):
``tools/bench.py atari --compression zstd --adds [--capacities 20000,100000,1000000]``.

For each capacity, a memmap buffer of one-step transitions with 4-frame
stacks, compressed (``compression="zstd"`` at its defaults) and raw, each in
a child process of its own (``scale.child``: real ALE play of
``--game``, episodes from random starts, shifted, so no two repeat), filled
with ``capacity + min(capacity // 2, 200,000)`` steps, one ``add`` a step, so
the ring has wrapped. Reported per capacity:

- add/s after the first 20,000 steps (compilation and the first dictionary
  out of it), compressed and raw, and their ratio (target >= 0.7x);
- the CPU time an add takes in the adding thread, and in the whole process
  (the difference: the dictionary's training in its thread, the codec's
  pool): on a shared machine the wall-clock rate moves with the load, the
  CPU times much less;
- the warm round, sample(32) + update_priorities (median of rounds 200-2,000,
  page cache warm), compressed and raw (target <= 400 µs at 1M).

Capacities whose buffers would not fit on the disk (with 10% to spare) are
skipped and say so. Prints a table and, last, one JSON line
``{"bench": "atari-adds", ...}``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from benchkit import print_table, say
from workloads.atari.scale import _fits, spawn

CAPACITIES = (20_000, 100_000, 1_000_000)
TARGET_RATIO, TARGET_ROUND_US = 0.7, 400.0


def steps_for(capacity: int) -> int:
    return capacity + min(capacity // 2, 200_000)


def run(capacities, root: Path, game: str) -> list[dict]:
    out = []
    for cap in capacities:
        for comp in ("zstd", None):
            if not _fits(root, cap, comp):
                out.append({"status": "skipped", "why": "disk", "capacity": cap, "compression": comp})
                continue
            say(f"[atari --adds] {comp or 'raw'} memmap, capacity {cap:,}, {steps_for(cap):,} adds ...")
            out.append(spawn(cap, steps_for(cap), comp, root, game, False, None))
    return out


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def summary(results: list[dict]) -> list[dict]:
    """Per capacity: both rates, CPU times, rounds and the ratios."""
    by = {(r.get("capacity"), r.get("compression")): r for r in results if r.get("status") == "ok"}
    rows = []
    for cap in sorted({r.get("capacity") for r in results}):
        z, p = by.get((cap, "zstd"), {}), by.get((cap, None), {})
        rows.append({
            "capacity": cap, "zstd_add_per_s": z.get("add_per_s"), "raw_add_per_s": p.get("add_per_s"),
            "add_ratio": _ratio(z.get("add_per_s"), p.get("add_per_s")),
            "zstd_add_cpu_us": z.get("add_cpu_us"), "raw_add_cpu_us": p.get("add_cpu_us"),
            "add_ratio_cpu": _ratio(p.get("add_cpu_us"), z.get("add_cpu_us")),
            "zstd_add_process_cpu_us": z.get("add_process_cpu_us"),
            "zstd_round_us": z.get("warm_us"), "raw_round_us": p.get("warm_us")})
    return rows


def report(rows: list[dict]) -> None:
    table = [[f"{r['capacity']:,}", _f(r["zstd_add_per_s"], ",.0f"), _f(r["raw_add_per_s"], ",.0f"),
              _f(r["add_ratio"], ".2f"), _f(r["zstd_add_cpu_us"], ".1f"), _f(r["zstd_add_process_cpu_us"], ".1f"),
              _f(r["raw_add_cpu_us"], ".1f"), _f(r["add_ratio_cpu"], ".2f"), _f(r["zstd_round_us"], ",.0f"),
              _f(r["raw_round_us"], ",.0f")] for r in rows]
    print_table(["capacity", "zstd add/s", "raw add/s", "ratio", "zstd cpu us", "zstd proc us", "raw cpu us",
                 "ratio cpu", "zstd round us", "raw round us"], table)
    print("  add/s after the first 20,000 adds, one add a step; cpu: this thread's CPU time an add (proc: the "
          "whole process, the dictionary's thread included); round: sample(32) + update, warm, median")
    ok = [r for r in rows if r["add_ratio"] is not None]
    if ok:
        print(f"  adds >= {TARGET_RATIO}x raw at every capacity: wall "
              f"{min(r['add_ratio'] for r in ok):.2f}x at worst, cpu "
              f"{min(r['add_ratio_cpu'] for r in ok if r['add_ratio_cpu']):.2f}x at worst")
    top = max((r for r in rows if r["zstd_round_us"] is not None), key=lambda r: r["capacity"], default=None)
    if top:
        print(f"  warm round at {top['capacity']:,}: {top['zstd_round_us']:.0f} us compressed "
              f"(target <= {TARGET_ROUND_US:.0f} at 1M), raw {_f(top['raw_round_us'], '.0f')}")


def main(args) -> int:
    caps = tuple(int(c) for c in args.capacities.split(",")) if getattr(args, "capacities", None) else CAPACITIES
    root = Path(tempfile.mkdtemp(prefix="bench-adds-", dir=args.dir or tempfile.gettempdir()))
    try:
        results = run(caps, root, args.game)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summary(results)
    report(rows)
    print(json.dumps({"bench": "atari-adds", "game": args.game, "summary": rows, "results": results},
                     separators=(",", ":")))
    return 0 if all(r.get("status") in ("ok", "skipped") for r in results) else 1
