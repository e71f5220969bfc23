"""Workload "offline": HDF5 datasets opened in place (``PrioritizedReplayBuffer.from_hdf5``).

Two datasets, each written once into a temporary directory:

- ``d4rl``: D4RL-style vectors (observations and next_observations (17,) f32,
  actions (6,) f32, rewards, terminals, timeouts; 1000-step episodes), written
  by h5py in D4RL's layout;
- ``atari``: 84x84 uint8 frames with action and reward, in bigper's own HDF5
  layout (a ``storage="hdf5"`` buffer filled and closed; chunked datasets).

For each, measured in the same run:

1. ``reprioritize`` with a trivial score function (``|reward|``) against h5py
   reading the same datasets sequentially in chunks of the same batch size:
   the ratio ``h5py time / reprioritize time`` (target >= 0.70). Warm page
   cache, and cold too where the cache can be dropped (root).
2. ``sample(256)`` from the dataset opened in place against ``sample(256)``
   from a memmap buffer holding the same data: the ratio ``hdf5 / memmap``
   (target <= 3), with both files in the page cache (read through first) and,
   where the cache can be dropped, cold.

Usage::

    python tools/bench.py offline [--quick] [--million] [--dir DIR]

Sizes: 1M vector transitions and 30k frames by default; ``--quick`` 200k and
5k; ``--million`` 1M of each (about 7 GB of frames in the file plus 7 GB for
the memmap twin; checked against free disk first, deleted after).
Prints a table and, last, one JSON line ``{"bench": "offline", ...}``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper, interleaved_blocks, print_header, print_table

OBS, ACT = 17, 6
FRAME = (84, 84)
BATCH = 256
CHUNK = 4096  # reprioritize batch and h5py read chunk
TARGET_STREAM = 0.70
TARGET_SAMPLE = 3.0
SIZES = {"quick": (200_000, 5_000), "default": (1_000_000, 30_000), "million": (1_000_000, 1_000_000)}


# -- data -------------------------------------------------------------------------------------
def write_d4rl(path: Path, n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    block = 100_000
    with __import__("h5py").File(path, "w") as f:
        d = {"observations": f.create_dataset("observations", (n, OBS), np.float32),
             "next_observations": f.create_dataset("next_observations", (n, OBS), np.float32),
             "actions": f.create_dataset("actions", (n, ACT), np.float32),
             "rewards": f.create_dataset("rewards", (n,), np.float32),
             "terminals": f.create_dataset("terminals", (n,), bool),
             "timeouts": f.create_dataset("timeouts", (n,), bool)}
        for a in range(0, n, block):
            m = min(block, n - a)
            obs = rng.standard_normal((m + 1, OBS), dtype=np.float32)
            d["observations"][a:a + m] = obs[:m]
            d["next_observations"][a:a + m] = obs[1:]
            d["actions"][a:a + m] = rng.standard_normal((m, ACT), dtype=np.float32)
            d["rewards"][a:a + m] = rng.standard_normal(m, dtype=np.float32)
            t = np.arange(a, a + m)
            d["terminals"][a:a + m] = rng.random(m) < 0.0005
            d["timeouts"][a:a + m] = t % 1000 == 999
    return list(d)


def frames(n: int, seed: int) -> np.ndarray:
    """Game-screen-like frames: flat background, moving blocks, a little noise."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, *FRAME), dtype=np.uint8)
    yy, xx = np.mgrid[: FRAME[0], : FRAME[1]]
    for i in range(n):
        f = np.full(FRAME, 40 + (i // 97) % 8 * 10, dtype=np.uint8)
        for b in range(3):
            y, x = (17 * b + 3 * i) % 76, (29 * b + 5 * i) % 76
            f[(yy >= y) & (yy < y + 8) & (xx >= x) & (xx < x + 6)] = 200 - 30 * b
        f[rng.random(FRAME) < 0.01] = 255
        out[i] = f
    return out


ATARI_FIELDS = {"obs": (FRAME, np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}


def fill_atari(buf, n: int, pool: np.ndarray, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    step = 2000
    for a in range(0, n, step):
        m = min(step, n - a)
        s = a % (pool.shape[0] - m + 1)
        buf.extend({"obs": pool[s:s + m], "action": rng.integers(0, 18, m),
                    "reward": rng.standard_normal(m).astype(np.float32),
                    "terminated": rng.random(m) < 0.0005})


D4RL_FIELDS = {"obs": ((OBS,), np.float32), "action": ((ACT,), np.float32), "reward": ((), np.float32)}


def d4rl_twin(buf, src: Path, n: int) -> None:
    """Fill a memmap buffer with the transitions of the D4RL file."""
    import h5py

    with h5py.File(src, "r") as f:
        for a in range(0, n, 100_000):
            sl = slice(a, min(n, a + 100_000))
            buf.extend({"obs": f["observations"][sl], "action": f["actions"][sl], "reward": f["rewards"][sl],
                        "next_obs": f["next_observations"][sl], "terminated": f["terminals"][sl],
                        "truncated": f["timeouts"][sl]})


# -- measurements ------------------------------------------------------------------------------
def drop_page_cache() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def h5py_stream(path: Path, names: list[str], chunk: int) -> float:
    """Seconds for h5py to read ``names`` from start to end, ``chunk`` rows at a time."""
    import h5py

    t0 = time.perf_counter()
    with h5py.File(path, "r") as f:
        ds = [f[n] for n in names]
        rows = ds[0].shape[0]
        for a in range(0, rows, chunk):
            for d in ds:
                d[a:a + chunk]
    return time.perf_counter() - t0


def reprioritize_stream(bigper, path: Path, side: Path, chunk: int) -> float:
    shutil.rmtree(side, ignore_errors=True)
    with bigper.PrioritizedReplayBuffer.from_hdf5(path, priorities=side) as buf:
        t0 = time.perf_counter()
        buf.reprioritize(lambda b: np.abs(b["reward"]), batch_size=chunk, progress=False)
        return time.perf_counter() - t0


def stream_pair(bigper, path: Path, names: list[str], side: Path, repeats: int, cold: bool) -> dict:
    out = {"h5py_s": [], "reprioritize_s": []}
    note = None
    fits = path.stat().st_size < 0.8 * mem_available()
    for r in range(repeats):
        for which in (("h5py", "reprioritize") if r % 2 == 0 else ("reprioritize", "h5py")):
            if cold and (note := drop_page_cache()):
                return {"skipped": note}
            if not cold and fits:  # warm means warm, whatever else ran on the machine meanwhile
                read_through([path])
            if which == "h5py":
                out["h5py_s"].append(h5py_stream(path, names, CHUNK))
            else:
                out["reprioritize_s"].append(reprioritize_stream(bigper, path, side, CHUNK))
    h, rp = min(out["h5py_s"]), min(out["reprioritize_s"])
    out["ratio"] = h / rp
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def read_through(paths) -> None:
    """Read files start to end, so that both sides of a comparison start from a warm page cache."""
    for root in paths:
        for p in ([root] if root.is_file() else sorted(q for q in root.rglob("*") if q.is_file())):
            with open(p, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def sample_pair(hdf5_buf, memmap_buf, rounds: int, blocks: int, warmup: int = 20) -> dict:
    fns = {"hdf5": lambda i: hdf5_buf.sample(BATCH), "memmap": lambda i: memmap_buf.sample(BATCH)}
    res = interleaved_blocks(fns, rounds, blocks, warmup=warmup)
    us = {k: statistics.median(v) * 1e6 for k, v in res.items()}
    return {"hdf5_us": us["hdf5"], "memmap_us": us["memmap"], "ratio": us["hdf5"] / us["memmap"]}


def sample_both(bigper, src: Path, twin_path: Path, open_twin, side: Path, rounds: int, blocks: int,
                cold: bool) -> dict:
    """Both buffers opened afresh for each measurement (a fresh mapping has no pages mapped
    yet; the page cache cannot drop pages a process still maps). Warm: both files read
    through first, when they fit in the page cache together; cold: the page cache dropped,
    then a few interleaved blocks with no warm-up."""
    out = {}
    size = src.stat().st_size + sum(p.stat().st_size for p in twin_path.rglob("*") if p.is_file())
    for kind in ("warm", "cold") if cold else ("warm",):
        if kind == "warm" and size > 0.8 * mem_available():
            out[kind] = {"skipped": f"the two copies ({size / 1e9:.1f} GB) do not fit in the page cache "
                                    f"({mem_available() / 1e9:.1f} GB available)"}
            continue
        note = read_through([src, twin_path]) if kind == "warm" else drop_page_cache()
        if note:
            out[kind] = {"skipped": note}
            continue
        with open_twin() as twin, bigper.PrioritizedReplayBuffer.from_hdf5(src, priorities=side) as ds:
            out[kind] = (sample_pair(ds, twin, rounds, blocks) if kind == "warm"
                         else sample_pair(ds, twin, max(5, rounds // 10), 3, warmup=0))
    return out


def run_offline(size: str, root: Path, cold: bool = True, say=print) -> dict:
    bigper = import_bigper()
    n_vec, n_atari = SIZES[size]
    quick = size == "quick"
    rounds, blocks = (50, 5) if quick else (200, 7)
    report = {}

    say(f"[offline] d4rl: writing {n_vec:,} transitions ...", flush=True)
    src = root / "d4rl.hdf5"
    names = write_d4rl(src, n_vec)
    r = {"transitions": n_vec, "file_mb": src.stat().st_size / 1e6}
    r["stream_warm"] = stream_pair(bigper, src, names, root / "d4rl.prio", 5, cold=False)
    if cold:
        r["stream_cold"] = stream_pair(bigper, src, names, root / "d4rl.prio", 1, cold=True)
    def open_twin(mode="resume"):  # made once, then reopened as it is for each sample run
        return bigper.PrioritizedReplayBuffer(n_vec, D4RL_FIELDS, storage="memmap", path=root / "d4rl-memmap",
                                              mode=mode)

    with open_twin("new") as twin:
        d4rl_twin(twin, src, n_vec)
    r["sample"] = sample_both(bigper, src, root / "d4rl-memmap", open_twin, root / "d4rl.prio2", rounds, blocks,
                              cold)
    report["d4rl"] = r

    say(f"[offline] atari: writing {n_atari:,} frames in bigper's HDF5 layout ...", flush=True)
    src = root / "atari.h5"
    pool = frames(min(n_atari, 4000) + 1, 0)
    kw = dict(next_of=())
    live = bigper.PrioritizedReplayBuffer(n_atari, ATARI_FIELDS, storage="hdf5", path=src, **kw)
    fill_atari(live, n_atari, pool)
    live.close()
    names = list(ATARI_FIELDS)
    r = {"transitions": n_atari, "file_mb": src.stat().st_size / 1e6}
    r["stream_warm"] = stream_pair(bigper, src, names, root / "atari.prio", 1 if size == "million" else 3,
                                   cold=False)
    if cold:
        r["stream_cold"] = stream_pair(bigper, src, names, root / "atari.prio", 1, cold=True)
    say("[offline] atari: memmap twin ...", flush=True)
    def open_twin_atari(mode="resume"):  # likewise
        return bigper.PrioritizedReplayBuffer(n_atari, ATARI_FIELDS, storage="memmap", path=root / "atari-memmap",
                                              mode=mode, **kw)

    with open_twin_atari("new") as twin:
        fill_atari(twin, n_atari, pool)
    r["sample"] = sample_both(bigper, src, root / "atari-memmap", open_twin_atari, root / "atari.prio2", rounds,
                              blocks, cold)
    report["atari"] = r
    return report


def print_offline(report: dict) -> None:
    rows = []
    for name, r in report.items():
        for kind in ("stream_warm", "stream_cold"):
            s = r.get(kind)
            if not s:
                continue
            if "skipped" in s:
                rows.append([f"{name} {kind}", "-", "-", f"skipped: {s['skipped']}", "-"])
                continue
            n = r["transitions"]
            h, rp = min(s["h5py_s"]), min(s["reprioritize_s"])
            rows.append([f"{name} {kind.replace('stream_', 'stream ')}", f"h5py {n / h / 1e6:.2f} M/s",
                         f"reprio {n / rp / 1e6:.2f} M/s", f"{s['ratio']:.2f}",
                         "ok" if s["ratio"] >= TARGET_STREAM else "MISS"])
        for kind, s in r["sample"].items():
            label = f"{name} sample({BATCH}) {kind}"
            if "skipped" in s:
                rows.append([label, "-", "-", f"skipped: {s['skipped']}", "-"])
                continue
            rows.append([label, f"memmap {s['memmap_us']:.0f} us", f"hdf5 {s['hdf5_us']:.0f} us",
                         f"{s['ratio']:.2f}", "ok" if s["ratio"] <= TARGET_SAMPLE else "MISS"])
    print_table(["workload", "peer", "bigper offline", "ratio", f"target (>= {TARGET_STREAM} / <= {TARGET_SAMPLE})"],
                rows)
    print("stream ratio = h5py time / reprioritize time (higher is better); "
          "sample ratio = hdf5 / memmap time (lower is better)")


def cmd_offline(args) -> int:
    if args.dqn_replay:
        from workloads.offline.dqn import cmd

        return cmd(args)
    size = "million" if args.million else ("quick" if args.quick else "default")
    print_header("offline")
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    n_vec, n_atari = SIZES[size]
    need = 2.2 * (n_atari * (FRAME[0] * FRAME[1] + 16) + n_vec * 4 * (2 * OBS + ACT + 2))
    free = shutil.disk_usage(base).free
    if free < need:
        print(f"not enough free disk under {base}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed")
        return 2
    root = Path(tempfile.mkdtemp(prefix="bigper-bench-offline-", dir=base))
    try:
        report = run_offline(size, root, cold=not args.warm_only)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_offline(report)
    print(json.dumps({"bench": "offline", "size": size, "results": report}, separators=(",", ":")))
    miss = [n for n, r in report.items()
            if r["sample"]["warm"].get("ratio", 0) > TARGET_SAMPLE or r["stream_warm"]["ratio"] < TARGET_STREAM]
    return 1 if miss else 0


def _games(value: str) -> tuple:
    import argparse

    games = tuple(g.strip() for g in value.split(",") if g.strip())
    if not games:
        raise argparse.ArgumentTypeError(f"--games needs at least one game, got {value!r}")
    return games


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="200k vectors and 5k frames (a smoke run; default: 1M vectors, 30k frames)")
    p.add_argument("--million", action="store_true",
                   help="1M transitions of each (~14 GB on disk while it runs; deleted after)")
    p.add_argument("--dir", help="where to put the files (a temporary directory under it; default: $TMPDIR)")
    p.add_argument("--warm-only", action="store_true", help="skip the cold-cache streaming runs")
    p.add_argument("--dqn-replay", action="store_true",
                   help="instead: convert a DQN Replay run written from real ALE play (tools/workloads/offline/dqn.py)")
    p.add_argument("--slots", type=int, default=10_000, help="--dqn-replay: slots a checkpoint (10,000)")
    p.add_argument("--checkpoints", type=int, default=3, help="--dqn-replay: checkpoints (3)")
    p.add_argument("--workers", type=int, help="--dqn-replay: gunzip threads (default: one per core)")
    p.add_argument("--scale", action="store_true", help="--dqn-replay: the issue 43 §4 scale run: kill -9 "
                   "and resume of convert and reprioritize, sample + update rounds "
                   "(tools/workloads/offline/dqn_scale.py)")
    p.add_argument("--distinct", type=int, default=2, help="--scale: checkpoints written (the rest are links; 2)")
    p.add_argument("--run", help="--scale: a run directory written before (by this bench, or make_run) "
                   "to convert, instead of writing one; --slots and --checkpoints must be its own")
    p.add_argument("--pool", type=int, default=100_000, help="--scale: steps of ALE play recorded (100,000)")
    from workloads.offline.dqn_scale import GAMES

    p.add_argument("--games", type=_games, default=GAMES,
                   help=f"--scale: the ALE games played for the pool, comma-separated ({','.join(GAMES)}); one "
                        "game is a real run's shape (the dataset holds one game a run)")
    p.add_argument("--gzip-level", type=int, default=1, help="--scale: gzip level of the run's files (1)")
    p.add_argument("--sample", type=int, default=2000, help="--scale: transitions checked a checkpoint (2,000)")
    p.add_argument("--check-all", action="store_true", help="--scale: check every transition of them")
    p.add_argument("--warm-rounds", type=int, default=2000,
                   help="--scale: sample + update rounds before the 200 measured (2,000: a 50M tree's pages)")
    p.set_defaults(func=cmd_offline)
