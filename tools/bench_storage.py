"""Workload "storage": bigper's storages side by side on Atari-shaped data.

For memory, memmap, HDF5 and HDF5 with lzf, in one process and on the same
data: fill rate (``add`` one step at a time, and ``extend`` in chunks, with
the final flush), bytes per transition (on disk: allocated blocks; memory:
RAM), and sample(32) + update_priorities rounds with a warm page cache and,
where the page cache can be dropped (root), a cold one. Ratios are taken in
the same run: memmap / memory (target <= 1.25 warm) and hdf5 / memmap.

``--million``: a 1M-capacity memmap buffer of 84x84 uint8 frames
(``next_of=()``, about 7 GB): seconds to create it, then fill it through
``extend`` while a thread samples RssAnon (/proc/self/status); the target is
a peak under 300 MB (the data is on disk, not in RAM).

Usage::

    python tools/bench.py storage [--quick] [--million] [--dir DIR]

Prints a table and, last, one JSON line ``{"bench": "storage", ...}``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchkit import fmt, import_bigper, print_header, print_table, ratio, versions

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
    for a in getattr(buf._store, "arrays", {}).values():
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
        path = getattr(buf._store, "path", None)
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


# -- one million ------------------------------------------------------------------------


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


# -- command -------------------------------------------------------------------------------


def run(quick: bool, million: bool, root: str | None = None) -> dict:
    top = Path(tempfile.mkdtemp(prefix="bigper-bench-storage-", dir=root))
    try:
        report = {"bench": "storage", "quick": quick, "dir": str(top),
                  "filesystem": _filesystem(top), "versions": versions()}
        if million:  # first, so the peak RssAnon is not that of the comparison's leftovers
            report["million"] = run_million(quick, top)
        report.update(run_storages(quick, top))
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

    print_header("storage")
    report = run(args.quick, args.million, args.dir)
    print(f"dir: {report['dir']} ({report['filesystem']})")
    print_storages(report)
    if "million" in report:
        print_million(report["million"])
    print(json.dumps(report, separators=(",", ":")))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="10k transitions, fewer rounds (a smoke run)")
    p.add_argument("--million", action="store_true",
                   help="also create and fill a 1M-capacity memmap buffer (~7 GB on disk; deleted after)")
    p.add_argument("--dir", help="where the buffers go (in a temporary directory under it; default: $TMPDIR)")
    p.set_defaults(func=cmd_storage)


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="bench_storage", description=__doc__.splitlines()[0])
    add_arguments(parser)
    a = parser.parse_args()
    sys.exit(a.func(a))
