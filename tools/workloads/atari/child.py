"""Workload "atari", one library in a process of its own (what ``--peer NAME`` runs).

Fill, steady-state adds, a check of the samples against the stream, timed
rounds and bytes per transition for one library; the result is one JSON line
on stdout, read by the parent (main.py ``spawn``).

Usage (the parent runs it)::

    python tools/workloads/atari/child.py --peer bigper-memmap --size 100000 [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # started by path (its parent does so): tools/ is the import root, not this folder
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [os.path.dirname(os.path.dirname(_here))] + [p for p in sys.path if p != _here]

import numpy as np  # noqa: E402

from benchkit import PeerUnavailable, disk_bytes, import_bigper, proc_status, say, short_error, time_both  # noqa: E402
from workloads.atari.data import BATCH, H, K, MILLION, W, Stream, real_frames, td_pool  # noqa: E402
from workloads.atari.peers import MAKERS, file_sizes, ram_arrays  # noqa: E402


def check(subj: dict, stream: Stream, count: int, cap: int, draws: int = 8) -> dict:
    """Compare sampled stacks with the stream; count the rows that differ."""
    if subj["probe"] is None:
        return {"ok": True, "rows": 0, "note": "not checked"}
    rows = bad_obs = bad_next = bad_next_terminal = 0
    problems = []
    for _ in range(draws):
        gids, obs, nxt, w = subj["probe"](count)
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        if gids.min() < max(0, count - cap) or gids.max() >= count:
            problems.append(f"sampled steps outside [{count - cap}, {count}): {gids.min()}..{gids.max()}")
            break
        if not (np.all(np.isfinite(w)) and w.min() > 0 and w.max() <= 1 + 1e-5):
            problems.append(f"weights outside (0, 1]: {w.min()}..{w.max()}")
        e_obs, e_next, term = stream.expected(gids)
        rows += gids.shape[0]
        bad_obs += int((np.asarray(obs) != e_obs).any(axis=(1, 2, 3)).sum())
        if nxt is not None:
            wrong = (np.asarray(nxt) != e_next).any(axis=(1, 2, 3))
            bad_next += int((wrong & ~term).sum())
            bad_next_terminal += int((wrong & term).sum())
    if bad_obs:
        problems.append(f"{bad_obs} of {rows} obs stacks differ from what was added")
    if bad_next:
        problems.append(f"{bad_next} of {rows} next_obs stacks (non-terminal) differ")
    return {"ok": not problems, "rows": rows, "bad_obs": bad_obs, "bad_next": bad_next,
            "bad_next_terminal": bad_next_terminal, "problems": problems}


def warm_up(name: str, stream: Stream, root: Path) -> None:
    """Import the library and run every path once on a small buffer (numba
    kernels loaded or compiled, lazy imports done), so that what the real
    buffer's RSS growth measures is its data, not the library's code."""
    cap = 256
    subj = MAKERS[name](cap, stream, root / "warm")
    for g in range(1200):  # past the first episode end
        subj["add"](g)
    for i in range(5):
        subj["round"](i)
    if subj["probe"] is not None:
        subj["probe"](1200)
    subj["close"]()
    del subj
    shutil.rmtree(root / "warm", ignore_errors=True)
    gc.collect()


def run_peer(name: str, cap: int, quick: bool, root: Path) -> dict:
    """Fill, add, check, time rounds and measure bytes for one library."""
    frames, source = real_frames()
    stream = Stream(frames)
    del frames
    warm_up(name, stream, root)
    rss0 = proc_status()
    t0 = time.perf_counter()
    subj = MAKERS[name](cap, stream, root)
    create_s = time.perf_counter() - t0
    add = subj["add"]
    res: dict[str, Any] = {"status": "ok", "api": subj["api"], "notes": subj["notes"], "frames": source,
                           "create_s": create_s, "capacity": cap}

    # (a) the fill, then steady-state adds into the full ring.
    say(f"[atari {name}] filling {cap:,} steps ...")
    block = max(1000, cap // 20)
    fill_cpu = 0.0
    t0 = time.perf_counter()
    g = 0
    while g < cap:
        m = min(block, cap - g)
        fill_cpu += time_both(lambda i, g=g: add(g + i), m)[1] * m
        g += m
    res["fill_s"] = time.perf_counter() - t0
    res["fill_per_s"] = cap / res["fill_s"]
    res["fill_per_s_cpu"] = cap / fill_cpu
    more = min(5_000 if quick else 20_000, cap // 5)
    wb = max(500, more // 10)
    wrap = []
    while g < cap + more:
        wrap.append(time_both(lambda i, g=g: add(g + i), wb))
        g += wb
    count = g
    res["add_per_s"] = 1 / statistics.median(w for w, _ in wrap)
    res["add_per_s_cpu"] = 1 / statistics.median(c for _, c in wrap)
    res["add_per_s_blocks"] = [1 / w for w, _ in wrap]
    res["added"] = count
    gc.collect()
    res["bytes"] = subj["bytes"](rss0)

    # correctness of what comes back, before any timing
    res["check"] = check(subj, stream, count, cap)

    # (b) rounds
    rounds, blocks, warm = (100, 3, 20) if quick else (300, 7, 100)
    rnd = subj["round"]
    say(f"[atari {name}] timing {blocks} blocks of {rounds} rounds ...")
    for i in range(warm):
        rnd(i)
    t = [time_both(rnd, rounds) for _ in range(blocks)]
    res["round_us"] = statistics.median(w for w, _ in t) * 1e6
    res["round_us_cpu"] = statistics.median(c for _, c in t) * 1e6
    res["round_us_blocks"] = [w * 1e6 for w, _ in t]
    res["rounds_per_block"] = rounds
    if name.startswith("bigper") and not quick:
        res["round_breakdown_us"] = bigper_breakdown(subj["buffer"], rounds)
    subj["close"]()
    return res


def bigper_breakdown(buf, rounds: int) -> dict[str, float]:
    """Where a bigper round goes, CPU us per call: sample (tree + weights +
    gather), the gather alone, and the priority update (by the batch's indices)."""
    pool = td_pool()
    idx = buf.sample(BATCH).indices
    sample = time_both(lambda i: buf.sample(BATCH), rounds)
    gather = time_both(lambda i: buf._gather(idx), rounds)
    update = time_both(lambda i: buf.update_priorities(idx, pool[i % len(pool)]), rounds)
    return {"sample": sample[1] * 1e6, "gather_only": gather[1] * 1e6, "update": update[1] * 1e6,
            "sample_wall": sample[0] * 1e6, "gather_only_wall": gather[0] * 1e6, "update_wall": update[0] * 1e6}


def bytes_at_million(root: Path) -> dict:
    """Disk blocks of a freshly created 1M-capacity memmap buffer (its files are
    preallocated in full, so nothing needs filling), per transition."""
    bigper = import_bigper()
    need = 7.5e9
    free = shutil.disk_usage(root).free
    if free < need * 1.1:
        return {"status": "skipped", "why": f"{free / 1e9:.1f} GB free under {root}, need ~{need / 1e9:.1f}"}
    path = root / "bigper-memmap-1m-empty"
    t0 = time.perf_counter()
    buf = bigper.PrioritizedReplayBuffer(
        MILLION, {"obs": ((K, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, storage="memmap", path=path, seed=0)
    create_s = time.perf_counter() - t0
    try:
        disk = disk_bytes(path)
        files = file_sizes(path)
        ram = ram_arrays(buf)
    finally:
        buf.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"status": "ok", "create_s": create_s, "disk_bytes": disk, "disk_per_transition": disk / MILLION,
            "ram_per_transition": ram / MILLION, "bytes_per_transition": (disk + ram) / MILLION,
            "ram": "bytes of the buffer's in-RAM arrays (tree, bookkeeping)", "files": files}


def child_main(args) -> int:
    root = Path(args.dir or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"bench-atari-{args.peer}-", dir=root))
    try:
        if args.peer == "bytes-1m":
            res = bytes_at_million(work)
        else:
            res = run_peer(args.peer, args.size, args.quick, work)
    except PeerUnavailable as exc:
        res = {"status": "unavailable", "error": str(exc)}
    except ImportError as exc:
        res = {"status": "not installed", "error": short_error(exc)}
    except Exception as exc:  # a library under construction must not stop the others
        import traceback

        traceback.print_exc(limit=4)
        res = {"status": "error", "error": short_error(exc)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, separators=(",", ":")))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", required=True, help=f"one of {', '.join(MAKERS)}, or bytes-1m")
    p.add_argument("--size", type=int, default=100_000, help="transitions (default 100000)")
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--dir", help="where disk buffers go (a temporary directory under it; default $TMPDIR)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="atari/child.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(child_main(parser.parse_args()))
