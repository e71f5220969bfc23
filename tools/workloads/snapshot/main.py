"""Workload "snapshot": memmap snapshots of an Atari-shaped buffer.

One 84x84 uint8 ``obs`` per transition (``next_of=()``; frame stacks store one
frame a step the same way), plus ``action`` and ``reward``, in a memmap
buffer filled to capacity. Measured, each beside its baseline in the same run:

- **first snapshot** vs copying the same bytes and fsyncing them (target
  <= 1.3x). Taken twice: right after the fill, while the kernel still holds
  much of the data dirty (the snapshot must make it durable), and once the
  data is on disk (the usual case: data written more than ~30 s earlier has
  been written back). A memmap snapshot links the chunk files instead of
  copying them, so its cost is making dirty data durable plus one xxh3 pass.
- **second snapshot** after 10k new steps (with sample + update between
  them), vs the first (target <= 5%). Its price moved to the live buffer:
  copy-on-write of each shared chunk at its first write, measured during the
  10k steps and reported.
- **load** including verification (every byte hashed, chunks attached by
  hard link) vs reading the snapshot's bytes once (target <= 1.5x); with a
  cold page cache where it can be dropped (root), and warm.

Usage::

    python tools/bench.py snapshot [--capacity N] [--million] [--dir DIR]

Default: 100k transitions (~0.7 GB); ``--million``: 1M (~7 GB; the disk needs
about 2.2x that free; everything is deleted afterwards). Prints a table and,
last, one JSON line ``{"bench": "snapshot", ...}``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper, print_header, print_table, versions

FRAME = (84, 84)
FIELDS = {"obs": (FRAME, np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
NEW_STEPS = 10_000
BLOCK = 1000
TARGETS = {"first_over_copy": 1.3, "second_over_first": 0.05, "load_over_read": 1.5}


def _frames(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, *FRAME), dtype=np.uint8)


def _steps(pool: np.ndarray, g0: int, n: int) -> dict:
    i = np.arange(g0, g0 + n)
    obs = pool[i % pool.shape[0]]
    obs[:, 0, 0] = (i % 251).astype(np.uint8)  # every frame differs from the pool's
    return {"obs": obs, "action": i.astype(np.int64), "reward": np.ones(n, np.float32),
            "terminated": (i % 1000) == 999}


def _drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where impossible."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def _copy_and_fsync(src: Path, dst: Path) -> float:
    """Seconds to copy every file of ``src`` (through the kernel) and fsync them all."""
    from bigper.snapshot._save import fsync_all

    t0 = time.perf_counter()
    written = []
    for p in _files(src):
        q = dst / p.relative_to(src)
        q.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "rb") as fi, open(q, "wb") as fo:
            size, off = os.fstat(fi.fileno()).st_size, 0
            while off < size:
                off += os.copy_file_range(fi.fileno(), fo.fileno(), size - off)
        written.append(q)
    fsync_all(written + sorted({q.parent for q in written}) + [dst])
    return time.perf_counter() - t0


def _read_once(d: Path) -> float:
    """Seconds to read every byte of the files under ``d`` once."""
    buf = memoryview(bytearray(8 << 20))
    t0 = time.perf_counter()
    for p in _files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _nbytes(d: Path) -> int:
    return sum(p.stat().st_size for p in _files(d))


class _CowClock:
    """Time and count the live buffer's copy-on-write of shared chunks."""

    def __init__(self):
        from bigper.storage import memmap

        self.mod, self.real = memmap._Array, memmap._Array.thaw
        self.seconds, self.copies, self.bytes = 0.0, 0, 0
        clock = self

        def thaw(arr, k):
            t0 = time.perf_counter()
            copied = clock.real(arr, k)
            clock.seconds += time.perf_counter() - t0
            clock.copies += int(copied)
            clock.bytes += arr.sizes[k] if copied else 0
            return copied
        self.mod.thaw = thaw

    def close(self):
        self.mod.thaw = self.real


def run_snapshot(capacity: int, where: Path) -> dict:
    bigper = import_bigper()
    load = bigper.PrioritizedReplayBuffer.load

    rng = np.random.default_rng(0)
    pool = _frames(4096, 1)
    live, snaps_root, base = where / "live", where / "snaps", where / "copy"
    res: dict = {"capacity": capacity, "new_steps": NEW_STEPS, "dir": str(where)}
    # -- fill ------------------------------------------------------------------
    t0 = time.perf_counter()
    buf = bigper.PrioritizedReplayBuffer(capacity, FIELDS, next_of=(), storage="memmap", path=live, seed=0)
    for g in range(0, capacity, BLOCK):
        buf.extend(_steps(pool, g, min(BLOCK, capacity - g)))
    buf.update_priorities(np.arange(capacity), rng.random(capacity) + 0.01)
    res["fill_s"] = time.perf_counter() - t0
    snaps = bigper.Snapshots(snaps_root, keep=None)
    # -- first snapshot, data still dirty from the fill -----------------------------
    t0 = time.perf_counter()
    s = snaps.save(buf)
    res["first_dirty_s"] = time.perf_counter() - t0
    shutil.rmtree(s)
    buf.close()  # no snapshot holds the chunks now: the next save hashes every byte again
    os.sync()
    buf = bigper.PrioritizedReplayBuffer(capacity, FIELDS, next_of=(), storage="memmap", path=live, seed=0,
                                         mode="resume")
    # -- first snapshot, data on disk (the usual case) ------------------------------
    t0 = time.perf_counter()
    s1 = snaps.save(buf)
    res["first_s"] = time.perf_counter() - t0
    res["snapshot_bytes"] = _nbytes(s1)
    os.sync()
    res["copy_fsync_s"] = _copy_and_fsync(s1, base)
    shutil.rmtree(base)
    # -- 10k new steps, then the second snapshot ---------------------------------------
    cow = _CowClock()
    t0 = time.perf_counter()
    for g in range(capacity, capacity + NEW_STEPS, 100):
        buf.extend(_steps(pool, g, 100))
        b = buf.sample(32)
        buf.update_priorities(b, rng.random(32) + 0.01)
    res["steps_s"] = time.perf_counter() - t0
    cow.close()
    res["cow_s"], res["cow_copies"], res["cow_bytes"] = cow.seconds, cow.copies, cow.bytes
    t0 = time.perf_counter()
    s2 = snaps.save(buf)
    res["second_s"] = time.perf_counter() - t0
    old = {p.name: p.stat().st_ino for p in (s1 / "data").iterdir()}
    res["second_new_bytes"] = sum(p.stat().st_size for p in _files(s2)
                                  if p.parent.name != "data" or old.get(p.name) != p.stat().st_ino)
    buf.close()
    # -- load (verify + attach) vs reading the bytes once -----------------------------------
    res["cold_cache"] = _drop_caches()
    t0 = time.perf_counter()
    b = load(s2, path=where / "resumed")
    res["load_s"] = time.perf_counter() - t0
    b.close()
    _drop_caches()
    res["read_s"] = _read_once(s2)
    t0 = time.perf_counter()
    b = load(s2, path=where / "resumed")
    res["load_warm_s"] = time.perf_counter() - t0
    b.close()
    res["read_warm_s"] = _read_once(s2)
    res["ratios"] = {
        "first_over_copy": res["first_s"] / res["copy_fsync_s"],
        "first_dirty_over_copy": res["first_dirty_s"] / res["copy_fsync_s"],
        "second_over_first": res["second_s"] / res["first_s"],
        "second_over_first_dirty": res["second_s"] / res["first_dirty_s"],
        "second_over_copy": res["second_s"] / res["copy_fsync_s"],
        "load_over_read": res["load_s"] / res["read_s"],
        "load_over_read_warm": res["load_warm_s"] / res["read_warm_s"],
    }
    return res


def print_snapshot(r: dict) -> None:
    gb = r["snapshot_bytes"] / 1e9
    cold = "cold cache" if r["cold_cache"] else "cache NOT dropped (not root)"
    q = r["ratios"]
    rows = [
        ["fill (extend, 1k a call)", f"{r['fill_s']:.2f} s", f"{r['capacity'] / r['fill_s']:,.0f} steps/s", ""],
        ["copy + fsync the same bytes", f"{r['copy_fsync_s']:.2f} s", f"{gb / r['copy_fsync_s']:.2f} GB/s", "baseline"],
        ["first snapshot, data on disk", f"{r['first_s']:.2f} s", f"{q['first_over_copy']:.3f}x copy",
         f"<= {TARGETS['first_over_copy']}x"],
        ["first snapshot, right after the fill", f"{r['first_dirty_s']:.2f} s",
         f"{q['first_dirty_over_copy']:.3f}x copy", f"<= {TARGETS['first_over_copy']}x"],
        [f"{r['new_steps']:,} steps + sample/update", f"{r['steps_s']:.2f} s",
         f"of which copy-on-write {r['cow_s']:.2f} s", f"{r['cow_copies']} chunks, {r['cow_bytes'] / 1e6:.0f} MB"],
        ["second snapshot", f"{r['second_s']:.3f} s",
         f"{100 * q['second_over_first']:.1f}% of first ({100 * q['second_over_first_dirty']:.1f}% of after-fill)",
         f"<= {100 * TARGETS['second_over_first']:.0f}%"],
        ["  bytes it did not share", f"{r['second_new_bytes'] / 1e6:.1f} MB", f"{100 * q['second_over_copy']:.2f}% of copy time", ""],
        [f"read the snapshot once ({cold})", f"{r['read_s']:.2f} s", f"{gb / r['read_s']:.2f} GB/s", "baseline"],
        [f"load incl. verification ({cold})", f"{r['load_s']:.2f} s", f"{q['load_over_read']:.3f}x read",
         f"<= {TARGETS['load_over_read']}x"],
        ["read once, warm cache", f"{r['read_warm_s']:.2f} s", f"{gb / r['read_warm_s']:.2f} GB/s", "baseline"],
        ["load incl. verification, warm", f"{r['load_warm_s']:.2f} s", f"{q['load_over_read_warm']:.3f}x read", ""],
    ]
    print(f"memmap buffer of {r['capacity']:,} Atari frames; snapshot {gb:.2f} GB in {r['dir']}")
    print_table(["", "time", "rate / ratio", "target"], rows)


def cmd_snapshot(args) -> int:
    import json

    cap = 1_000_000 if args.million else args.capacity
    print_header("snapshot")
    root = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    need = int(cap * (FRAME[0] * FRAME[1] + 40) * 2.2)
    free = shutil.disk_usage(root).free
    if free < need:
        print(f"bench snapshot: {root} has {free / 1e9:.1f} GB free; {cap:,} frames need about "
              f"{need / 1e9:.1f} GB (live data and a copy baseline)")
        return 2
    where = Path(tempfile.mkdtemp(prefix="bigper-bench-snapshot-", dir=root))
    try:
        res = run_snapshot(cap, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print_snapshot(res)
    res["versions"] = versions()
    print(json.dumps({"bench": "snapshot", **res}, separators=(",", ":"), default=str))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--capacity", type=int, default=100_000, help="transitions (default 100k, ~0.7 GB)")
    p.add_argument("--million", action="store_true", help="1M transitions (~7 GB on disk; deleted after)")
    p.add_argument("--dir", help="where to put the buffer and snapshots (default: $TMPDIR)")
    p.set_defaults(func=cmd_snapshot)
