"""Compressed frames at scale (issue 24): ``tools/bench.py atari --compression zstd``.

Two runs, each bigper buffer in its own child process (its RssAnon is the
buffer's, not the parent's), memmap storage under ``--dir``:

- ``--million N``: a capacity of N million one-step transitions with 4-frame
  stacks, filled with N million steps, compressed; at ``N <= 1`` the same
  buffer uncompressed beside it. Reports the fill (steps/s: every step one
  ``add``, after the first 20k so compilation and the dictionary's training
  are not in it), the bytes on disk and per live transition, the process's
  RssAnon (largest seen during the fill), and sample(32) + update with the
  page cache warm (median of 2,000 rounds).
- ``--sweep``: capacities 2^20 .. 2^``--sweep-max`` (default 23), compressed and
  uncompressed (each where the disk holds it with 10% to spare), each filled
  to capacity; then the buffer is closed, the page cache dropped (root only;
  pages a live mapping holds would survive the drop) and the buffer reopened
  (``mode="resume"``), and the rounds are timed cold: the median of the
  first 100, and of rounds 1,000-2,000 (the page cache refilling as the
  rounds read). Plotted to
  ``tools/results/compression-sweep.png``.

The frames are real ALE play (``workloads.codecs.frames``: 3,000 frames of random
play per game, ``--game``, default MsPacman, the median game by compressed
size), replayed as episodes of random length (200..3,000 frames) from random
starts, each episode shifted by a random 0..4 pixels down and right (a
scene seen from elsewhere): no two episodes hold the same frames, so neither
the dictionary nor the compressor sees one pool repeat.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # started by path (its parent does so): tools/ is the import root, not this folder
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [os.path.dirname(os.path.dirname(_here))] + [p for p in sys.path if p != _here]

import numpy as np  # noqa: E402

from benchkit import REPO_ROOT, TOOLS_DIR, disk_bytes, import_bigper, print_table, proc_status, say  # noqa: E402
from workloads.storage.data import drop_page_cache  # noqa: E402

BATCH = 32
FIELDS = {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
WARMUP = 20_000
HERE = Path(__file__).resolve()


def episodes(game: str, seed: int):
    """Endless episodes ``(frames (L, 84, 84) uint8)`` of real play, varied (module docstring)."""
    from workloads.codecs.frames import frames

    pool = frames(game)
    rng = np.random.default_rng(seed)
    n = pool.shape[0]
    while True:
        ln = int(rng.integers(200, n))
        a = int(rng.integers(0, n - ln))
        dy, dx = (int(v) for v in rng.integers(0, 5, size=2))
        ep = pool[a:a + ln]
        if dy or dx:
            ep = np.pad(ep, ((0, 0), (dy, 0), (dx, 0)), mode="edge")[:, :84, :84]
        yield np.ascontiguousarray(ep)


def fill(buf, steps: int, game: str, seed: int = 0) -> dict:
    """``steps`` adds from ``episodes``; the rate after WARMUP steps (and the CPU time an add
    takes, in this thread and in the process), the largest RssAnon."""
    it = episodes(game, seed)
    t = 0
    rss = 0
    t_warm = None
    cpu = (time.thread_time(), time.process_time())  # (this thread's: the adds; the process's: with the worker)
    t0 = time.perf_counter()
    while t < steps:
        ep = next(it)
        pad = np.concatenate([ep[:1]] * 3 + [ep])
        last = ep.shape[0] - 2
        for i in range(last + 1):
            if t == WARMUP:
                t_warm = time.perf_counter()
                cpu = (time.thread_time(), time.process_time())
            buf.add(obs=pad[i:i + 4], next_obs=pad[i + 1:i + 5], action=t % 6, reward=float(i % 3 == 0),
                    terminated=i == last, truncated=False)
            t += 1
            if t % 100_000 == 0:
                rss = max(rss, proc_status().get("RssAnon", 0))
                if t % 1_000_000 == 0:
                    say(f"    {t:,} steps, {t / (time.perf_counter() - t0):,.0f}/s")
            if t == steps:
                break
    t1 = time.perf_counter()
    main_cpu, proc_cpu = time.thread_time() - cpu[0], time.process_time() - cpu[1]
    rss = max(rss, proc_status().get("RssAnon", 0))
    after = steps - WARMUP if t_warm is not None else steps
    return {"fill_s": t1 - t0, "add_per_s": after / (t1 - (t_warm or t0)), "rss_anon_max": rss,
            "add_cpu_us": main_cpu / after * 1e6, "add_process_cpu_us": proc_cpu / after * 1e6}


def rounds(buf, n: int) -> np.ndarray:
    """Seconds per sample(32) + update_priorities, each round."""
    rng = np.random.default_rng(3)
    out = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        b = buf.sample(BATCH)
        buf.update_priorities(b, rng.random(BATCH) + 0.01)
        out[i] = time.perf_counter() - t
    return out


def child(capacity: int, steps: int, compression: str | None, root: Path, game: str, cold: bool,
          budget: int | None) -> dict:
    bigper = import_bigper()
    path = root / f"buf-{compression or 'raw'}-{capacity}"
    kw = {"compression": compression} if compression else {}
    if compression and budget:
        kw["compression_budget"] = budget
    t0 = time.perf_counter()
    buf = bigper.PrioritizedReplayBuffer(capacity, FIELDS, frame_stack=4, storage="memmap", path=path,
                                         seed=0, **kw)
    res = {"capacity": capacity, "steps": steps, "compression": compression, "create_s": time.perf_counter() - t0}
    try:
        res.update(fill(buf, steps, game))
        res["live"] = len(buf)
        res["disk_bytes"] = disk_bytes(path)
        res["disk_per_live"] = res["disk_bytes"] / max(res["live"], 1)
        if compression:
            fs = buf._frames
            res["budget"] = fs.log.seg * fs.log.slots / fs.F  # log bytes allocated a frame
        warm = rounds(buf, 2000)
        res["warm_us"] = float(np.median(warm[200:])) * 1e6
        res["rss_anon_end"] = proc_status().get("RssAnon", 0)
        if cold:  # pages a live mapping holds survive drop_caches: close, drop, then reopen
            buf.close()
            why = drop_page_cache()
            buf = bigper.PrioritizedReplayBuffer(capacity, FIELDS, frame_stack=4, storage="memmap", path=path,
                                                 mode="resume", seed=0, **kw)
            if why:
                res["cold"] = why
            else:
                c = rounds(buf, 2000)
                res["cold_first100_us"] = float(np.median(c[:100])) * 1e6
                res["cold_1000_2000_us"] = float(np.median(c[1000:])) * 1e6
        res["status"] = "ok"
    finally:
        buf.close()
        shutil.rmtree(path, ignore_errors=True)
    return res


def spawn(capacity, steps, compression, root, game, cold, budget) -> dict:
    cmd = [sys.executable, str(HERE), "--child", str(capacity), str(steps), compression or "none", str(root),
           game, "1" if cold else "0", str(budget or 0)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(p.stderr[-3000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"status": "error", "error": f"exit {p.returncode}",
                                                "capacity": capacity, "compression": compression}


def _fits(root: Path, capacity: int, compression: str | None) -> bool:
    need = capacity * (600 if compression else 7_300) * 1.1
    return shutil.disk_usage(root).free > need


def run_million(n_million: float, root: Path, game: str, budget: int | None) -> list[dict]:
    cap = int(n_million * 1_000_000)
    out = []
    for comp in ("zstd",) + ((None,) if n_million <= 1 else ()):
        if not _fits(root, cap, comp):
            out.append({"status": "skipped", "why": "disk", "capacity": cap, "compression": comp})
            continue
        say(f"[atari --compression] {comp or 'uncompressed'} memmap, capacity {cap:,}, {cap:,} steps ...")
        out.append(spawn(cap, cap, comp, root, game, False, budget))
    return out


def run_sweep(sweep_min: int, sweep_max: int, root: Path, game: str, budget: int | None) -> list[dict]:
    out = []
    for e in range(sweep_min, sweep_max + 1):
        cap = 1 << e
        for comp in ("zstd", None):
            if not _fits(root, cap, comp):
                out.append({"status": "skipped", "why": "disk", "capacity": cap, "compression": comp})
                continue
            say(f"[atari --sweep] {comp or 'uncompressed'} memmap, capacity 2^{e}, cold after a drop ...")
            out.append(spawn(cap, cap, comp, root, game, True, budget))
    return out


def _mb(x) -> str:
    return f"{x / 2**20:,.0f}" if isinstance(x, (int, float)) else "-"


def _us(x) -> str:
    return f"{x:,.1f}" if isinstance(x, (int, float)) else "-"


def report(million: list[dict], sweep: list[dict]) -> None:
    if million:
        rows = []
        for r in million:
            if r.get("status") != "ok":
                rows.append([r.get("compression") or "none", f"{r.get('capacity', 0):,}", r.get("status", "?"),
                             r.get("why", r.get("error", ""))] + ["-"] * 6)
                continue
            rows.append([r["compression"] or "none", f"{r['capacity']:,}", f"{r['fill_s']:,.0f}",
                         f"{r['add_per_s']:,.0f}", f"{r['disk_bytes'] / 1e9:.2f}", f"{r['disk_per_live']:,.0f}",
                         f"{r['live']:,}", _mb(r["rss_anon_max"]), _us(r["warm_us"]),
                         f"{r['budget']:.0f}" if "budget" in r else "-"])
        print_table(["compression", "capacity", "fill s", "add/s", "disk GB", "disk B/live", "live",
                     "RssAnon MB", "round us warm", "log B/frame"], rows)
        z = next((r for r in million if r.get("compression") and r.get("status") == "ok"), None)
        p = next((r for r in million if not r.get("compression") and r.get("status") == "ok"), None)
        if z and p:
            print(f"  at {z['capacity']:,}: round {z['warm_us'] / p['warm_us']:.2f}x uncompressed (target <= 2x), "
                  f"add {z['add_per_s'] / p['add_per_s']:.2f}x (target >= 0.5x)")
        if z:
            print(f"  targets at 10M: fill <= 30 min ({z['fill_s'] / 60:.1f}), disk <= 5 GB "
                  f"({z['disk_bytes'] / 1e9:.2f}), RssAnon <= 2 GB ({z['rss_anon_max'] / 2**30:.2f}), "
                  f"round <= 400 us warm ({z['warm_us']:.0f})")
    if sweep:
        rows = []
        by = {}
        for r in sweep:
            by[(r.get("capacity"), r.get("compression"))] = r
        for cap in sorted({r.get("capacity") for r in sweep}):
            z, p = by.get((cap, "zstd"), {}), by.get((cap, None), {})
            ratio = (p.get("cold_1000_2000_us") / z["cold_1000_2000_us"]
                     if p.get("cold_1000_2000_us") and z.get("cold_1000_2000_us") else None)
            ratio100 = (p.get("cold_first100_us") / z["cold_first100_us"]
                        if p.get("cold_first100_us") and z.get("cold_first100_us") else None)
            rows.append([f"2^{cap.bit_length() - 1}", f"{z.get('disk_bytes', 0) / 1e9:.2f}" if z.get("disk_bytes") else "-",
                         f"{p.get('disk_bytes', 0) / 1e9:.2f}" if p.get("disk_bytes") else p.get("why", "-"),
                         _us(z.get("warm_us")), _us(p.get("warm_us")),
                         _us(z.get("cold_first100_us")), _us(p.get("cold_first100_us")),
                         _us(z.get("cold_1000_2000_us")), _us(p.get("cold_1000_2000_us")),
                         f"{ratio100:.1f}x" if ratio100 else "-", f"{ratio:.1f}x" if ratio else "-"])
        print_table(["capacity", "zstd GB", "raw GB", "zstd warm", "raw warm", "zstd cold 1-100",
                     "raw cold 1-100", "zstd cold 1k-2k", "raw cold 1k-2k", "ratio 1-100", "ratio 1k-2k"], rows)
        print("  us per sample(32) + update; cold: after dropping the page cache (raw / zstd = ratio; target >= 20x "
              "at 2^22, uncompressed data > RAM)")
        plot(sweep)


def plot(sweep: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for comp, style in (("zstd", "-"), (None, "--")):
        for key, label, marker in (("warm_us", "warm", "o"), ("cold_1000_2000_us", "cold (rounds 1k-2k)", "s"),
                                   ("cold_first100_us", "cold (first 100)", "^")):
            pts = sorted((r["capacity"], r[key]) for r in sweep
                         if r.get("compression") == comp and r.get("status") == "ok" and key in r)
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], style, marker=marker,
                        label=f"{comp or 'uncompressed'} {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("capacity (transitions)")
    ax.set_ylabel("µs per sample(32) + update")
    ax.set_title("Atari memmap buffer, compressed frames vs raw frames")
    ax.legend(fontsize=7)
    fig.tight_layout()
    dst = Path(TOOLS_DIR) / "results" / "compression-sweep.png"
    fig.savefig(dst, dpi=110)
    print(f"  plot: {dst.relative_to(REPO_ROOT)}")


def main(args) -> int:
    root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir or tempfile.gettempdir()))
    try:
        million = run_million(args.million or 1, root, args.game, args.budget) if not args.sweep or args.million \
            else []
        sweep = run_sweep(args.sweep_min, args.sweep_max, root, args.game, args.budget) if args.sweep else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(million, sweep)
    print(json.dumps({"bench": "atari-compression", "game": args.game, "million": million, "sweep": sweep},
                     separators=(",", ":")))
    return 0 if all(r.get("status") in ("ok", "skipped") for r in million + sweep) else 1


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    cap, steps, comp, root, game, cold, budget = sys.argv[2:9]
    r = child(int(cap), int(steps), None if comp == "none" else comp, Path(root), game, cold == "1",
              int(budget) or None)
    print(json.dumps(r, separators=(",", ":")))
