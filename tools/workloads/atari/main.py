"""Workload "atari": Atari-shaped replay, bigper against cpprb, Tianshou and TorchRL.

Every library gets the same stream of transitions: ``obs`` and ``next_obs``
are (4, 84, 84) uint8 frame stacks cut from real Pong frames (84x84 after
Gymnasium's ``AtariPreprocessing``, recorded once and cached under /tmp),
padded at an episode start the way ``FrameStackObservation`` pads them;
episodes end (terminated) every 900-1100 steps. Each library runs in a
process of its own (tools/workloads/atari/child.py ``--peer NAME``), so the memory it
reports is its own. In each process:

(a) add: ``N`` steps one ``add`` call at a time (the fill), then another
    ``N/5`` (at most 20k) steps into the full ring, timed in blocks (the
    steady state a learner sees, ring wrapping included);
(b) a round: sample(32) with both stacks gathered and the IS weights, then a
    priority update of the 32 (precomputed |TD| values), median of blocks;
(c) bytes per transition: RSS growth for libraries that hold their data in
    RAM; for bigper's memmap storage the blocks its files hold on disk plus
    its anonymous RAM growth (tree and bookkeeping; the page cache is not
    counted).

Before timing, every library's samples are compared with the stream (obs,
and next_obs apart from the terminal step of an episode, which some peers do
not keep). The floor is bare numpy: a ring of single frames and a gather of
32 x 4 frames for obs and again for next_obs (no tree, no weights).

Configurations (each library's documented setting for Atari):
  bigper    frame_stack=4, n_step=1 (and n_step=3 as an extra row)
  cpprb     next_of="obs", stack_compress="obs" (the stack on the last axis,
            so stacks are added as (84, 84, 4) views and sampled as
            (32, 84, 84, 4)), on_episode_end() at episode ends
  Tianshou  stack_num=4, save_only_last_obs=True, ignore_obs_next=True (its
            Atari examples' buffer)
  TorchRL   its prioritized sampler needs the C++ extension torchrl._torchrl

Every timing is taken twice: wall clock and this process's CPU time (the
machine may be shared; the ratios are given for both). ``--malloc tuned``
runs every process with fixed glibc malloc thresholds: a sample returns two
fresh ~0.9 MB arrays, and with the default, dynamic thresholds whether they
come with ~400 page faults (10x the round time) depends on the process's
allocation history, not on the library.

Usage::

    python tools/bench.py atari [--quick] [--size 100000] [--million] [--repeat R]
                                [--peers numpy,bigper-memory,...] [--malloc default|tuned] [--dir DIR]
    python tools/bench.py atari --compression zstd [--million N] [--sweep [--sweep-max 23]] [--game G]
    python tools/bench.py atari --compression zstd --games [--capacity 20000] [--cases Pong,noise]
    python tools/bench.py atari --compression zstd --adds [--capacities 20000,100000,1000000]

Prints a table and, last, one JSON line ``{"bench": "atari", ...}``.
``--million`` also fills a 1M-capacity bigper memmap buffer with 1M steps of
the same stream (about 7.3 GB on disk, deleted afterwards). ``--compression
zstd`` runs compressed frames at scale instead (scale.py):
``--million 10`` fills 10M transitions, ``--sweep`` compares compressed and
raw frames against capacity with the page cache dropped; ``--games``
reports six games of real play and two synthetic streams at the default
settings (games.py: disk bytes a transition, sampleable
transitions against capacity, warm and cold rounds, adds/s against raw).

Layout (tools/workloads/atari/): main.py runs the comparison (one child
process per library and run, medians, ratios); the children run child.py
(loop.py the learner-shaped rows); the stream and constants are in data.py,
the adapters in peers.py, the table in report.py; ``--compression`` runs
scale.py, games.py or adds.py.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchkit import print_header, ratio, say, versions
from workloads.atari.data import ALPHA, BATCH, BETA, MILLION, TARGET_ADD, TARGET_BYTES, TARGET_ROUND, real_frames
from workloads.atari.loop import print_loop
from workloads.atari.peers import MAKERS
from workloads.atari.report import print_report

HERE = os.path.dirname(os.path.abspath(__file__))  # the children's scripts are beside this file

PEERS = ("numpy", "bigper-memory", "bigper-memmap", "bigper-memmap-n3", "cpprb", "tianshou", "torchrl")
RIVALS = ("cpprb", "tianshou", "torchrl")
OURS = ("bigper-memory", "bigper-memmap")
# Fixed glibc malloc thresholds (they switch off its dynamic ones): every
# sample allocates ~1 MB arrays, and with the defaults, whether those come
# with fresh zero pages (a page fault each 4 KB) depends on the process's
# allocation history. "tuned" takes that out of the comparison; "default" is
# what a user gets.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


# -- the comparison (parent process) ---------------------------------------------------------


def spawn(peer: str, size: int, quick: bool, root: str | None, malloc: str = "default",
          timeout: float = 3600) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "child.py"), "--peer", peer, "--size", str(size)]
    if quick:
        cmd.append("--quick")
    if root:
        cmd += ["--dir", root]
    t0 = time.perf_counter()
    env = dict(os.environ)
    for k in MALLOC_TUNED:
        env.pop(k, None)
    if malloc == "tuned":
        env.update(MALLOC_TUNED)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"status": "error", "error": f"exit {p.returncode}, no result line"}
    res = json.loads(lines[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def merge(runs: list[dict]) -> dict:
    """One result from repeated runs of a peer: medians of the timings, the runs kept."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return runs[-1]
    out = dict(ok[-1])
    for key in ("round_us", "round_us_cpu", "add_per_s", "add_per_s_cpu", "fill_per_s", "fill_per_s_cpu"):
        out[key] = statistics.median(r[key] for r in ok)
        out[key + "_runs"] = [r[key] for r in ok]
    out["runs"] = len(ok)
    return out


def compare(ours: dict, peers: dict) -> dict:
    """Ratios of every bigper result in ``ours`` against the fastest rival in
    ``peers``, by wall time and by CPU time (fastest picked for each)."""
    rivals = {p: peers[p] for p in RIVALS if peers.get(p, {}).get("status") == "ok"}
    out: dict[str, Any] = {}
    for clock, rk, ak in (("wall", "round_us", "add_per_s"), ("cpu", "round_us_cpu", "add_per_s_cpu")):
        fr = min(rivals, key=lambda p: rivals[p][rk], default=None)
        fa = max(rivals, key=lambda p: rivals[p][ak], default=None)
        out[f"fastest_round_peer_{clock}"], out[f"fastest_add_peer_{clock}"] = fr, fa
        for name, r in ours.items():
            if not name.startswith("bigper") or r.get("status") != "ok":
                continue
            d = out.setdefault(name, {})
            d[f"round_{clock}"] = ratio(rivals[fr][rk], r[rk]) if fr else None
            d[f"add_{clock}"] = ratio(r[ak], rivals[fa][ak]) if fa else None
            d[f"round_over_numpy_floor_{clock}"] = ratio(r[rk], peers.get("numpy", {}).get(rk))
    return out


def spawn_loop(size: int, quick: bool, root: str | None, timeout: float = 3600) -> dict:
    """loop.py in a process of its own; its JSON line."""
    cmd = [sys.executable, os.path.join(HERE, "loop.py"), "--size", str(size)]
    cmd += ["--quick"] if quick else []
    cmd += ["--dir", root] if root else []
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"status": "error", "error": f"exit {p.returncode}, no result line"}


def run(quick: bool, size: int, million: bool, repeat: int, peers: tuple[str, ...],
        root: str | None, malloc: str = "default", no_loop: bool = False) -> dict:
    if quick:
        size = min(size, 20_000)
    real_frames()  # record the frame cache once, before the peers race for it
    order = list(peers)
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for r in range(repeat):
        for p in order[r % len(order):] + order[: r % len(order)]:
            say(f"[atari] {p}, size {size:,} (run {r + 1} of {repeat}) ...")
            runs[p].append(spawn(p, size, quick, root, malloc))
            if runs[p][-1].get("status") in ("unavailable", "not installed"):
                order.remove(p)
                if not order:
                    break
    results = {p: merge(v) for p, v in runs.items()}

    ratios = compare(results, results)
    rep: dict[str, Any] = {"bench": "atari", "quick": quick, "size": size, "batch": BATCH, "alpha": ALPHA,
                           "beta": BETA, "repeat": repeat, "malloc": malloc,
                           "malloc_env": MALLOC_TUNED if malloc == "tuned" else {}, "versions": versions(),
                           "results": results,
                           "ratios": ratios, "targets": {"round": TARGET_ROUND, "add": TARGET_ADD,
                                                         "bytes_1m": TARGET_BYTES}}

    # bytes per transition at 1M capacity: the preallocated files of a 1M memmap
    # buffer plus its in-RAM arrays (tree and bookkeeping)
    rep["bytes_1m"] = spawn("bytes-1m", MILLION, quick, root)
    if not no_loop:  # num_envs=8 adds, buffer calls inside a learner's step, prefetch wait
        say("[atari] learner-shaped rows (bigper memmap): num_envs=8, in the loop, prefetch ...")
        rep["loop"] = spawn_loop(size, quick, root)

    if million:
        need = 8.0e9
        where = root or tempfile.gettempdir()
        free = shutil.disk_usage(where).free
        if free < need:
            rep["million"] = {"status": "skipped", "why": f"{free / 1e9:.1f} GB free under {where}"}
        else:
            say(f"[atari] bigper-memmap at 1M capacity, 1M steps ({free / 1e9:.0f} GB free) ...")
            m = spawn("bigper-memmap", MILLION, quick, root, malloc)
            if m.get("status") == "ok":
                m["ratios"] = compare({"bigper-memmap": m}, results)["bigper-memmap"]
                m["ratios"]["note"] = f"against the peers at {size:,}"
            rep["million"] = m
    return rep


def cmd_atari(args) -> int:
    if args.compression or args.sweep or args.games or args.adds:
        if not args.compression:
            raise SystemExit(f"{'--games' if args.games else '--adds' if args.adds else '--sweep'} needs "
                             "--compression zstd")
        print_header("atari --compression")
        if args.adds:  # compressed adds against raw, capacity by capacity (adds.py)
            from workloads.atari import adds

            return adds.main(args)
        rc = 0
        if args.games:  # the six games and two synthetic streams at the defaults (games.py)
            from workloads.atari import games

            rc = games.main(args)
        if args.million or args.sweep or not args.games:
            from workloads.atari import scale

            rc = scale.main(args) or rc
        return rc
    peers = tuple(s.strip() for s in args.peers.split(",")) if args.peers else PEERS
    unknown = [p for p in peers if p not in MAKERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}, expected a subset of {list(MAKERS)}")
    print_header("atari")
    rep = run(args.quick, args.size, args.million, args.repeat, peers, args.dir, args.malloc, args.no_loop)
    print_report(rep)
    if "loop" in rep:
        print_loop(rep["loop"])
    print(json.dumps(rep, separators=(",", ":")))
    bad = [n for n, r in rep["results"].items()
           if r.get("status") == "error" or (n.startswith("bigper") and not r.get("check", {}).get("ok", True))]
    return 1 if bad else 0


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="at most 20k transitions, fewer rounds (a smoke run)")
    p.add_argument("--size", type=int, default=100_000, help="transitions per library (default 100000)")
    p.add_argument("--million", type=float, nargs="?", const=1.0, default=None, metavar="N",
                   help="also fill a 1M-capacity bigper memmap buffer with 1M steps (~7.5 GB; deleted after); "
                        "with --compression: an N-million-capacity compressed buffer (N <= 1: beside the "
                        "uncompressed one)")
    p.add_argument("--compression", choices=("zstd",),
                   help="compressed frames at scale instead of the peers' table (tools/workloads/atari/scale.py): "
                        "--million N and/or --sweep")
    p.add_argument("--sweep", action="store_true",
                   help="with --compression: capacities 2^20..2^--sweep-max, compressed and raw, cold after "
                        "dropping the page cache (root)")
    p.add_argument("--sweep-min", type=int, default=20, help="smallest capacity of --sweep, as a power of 2")
    p.add_argument("--sweep-max", type=int, default=23, help="largest capacity of --sweep, as a power of 2")
    p.add_argument("--games", action="store_true",
                   help="with --compression: six games of real ALE play and two synthetic streams (noise, half "
                        "noise) at the default settings, memmap: disk bytes a transition, sampleable transitions "
                        "against capacity, warm and cold rounds, adds/s against raw (tools/workloads/atari/games.py)")
    p.add_argument("--adds", action="store_true",
                   help="with --compression: compressed adds against raw ones at each of --capacities (add/s, "
                        "CPU time an add, ratio) and the warm round (tools/workloads/atari/adds.py)")
    p.add_argument("--capacities", help="with --adds: comma-separated capacities (default 20000,100000,1000000)")
    p.add_argument("--capacity", type=int, default=20_000, help="with --games: each buffer's capacity")
    p.add_argument("--cases", help="with --games: a comma-separated subset of the games, noise and half")
    p.add_argument("--game", default="MsPacman", help="with --compression: the game whose real frames fill it")
    p.add_argument("--budget", type=int, help="with --compression: compression_budget (log bytes a frame)")
    p.add_argument("--repeat", type=int, default=1, help="runs per library (rotating order); medians reported")
    p.add_argument("--peers", help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--malloc", choices=("default", "tuned"), default="default",
                   help="tuned: every library's process runs with fixed glibc malloc thresholds "
                        f"({', '.join(f'{k}={v}' for k, v in MALLOC_TUNED.items())})")
    p.add_argument("--no-loop", action="store_true",
                   help="skip the learner-shaped rows (num_envs=8 adds, calls inside a CNN step, prefetch)")
    p.add_argument("--dir", help="where disk buffers go (a temporary directory under it; default $TMPDIR)")
    p.set_defaults(func=cmd_atari)
