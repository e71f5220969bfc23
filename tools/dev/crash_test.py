"""Kill -9 a process at random moments while it loops on ``Snapshots.save``.

Usage::

    python tools/crash_test.py [--trials 1000] [--seed 0] [--max-delay-ms 100] [--dir DIR]

Each trial forks a child (the kernels are compiled in the parent first, so a
child starts in microseconds) that resumes with
``Snapshots(root).load_latest(path=live)`` -- taking over the live memmap
directory that the previous, killed child left unclean -- and then loops:
add a few steps, sample, update priorities, ``Snapshots.save``. The parent
sleeps a random time, sends SIGKILL, and checks:

- no leftovers of the interrupted save remain once ``Snapshots`` starts;
- every snapshot present verifies (files and tree invariants): a kill never
  leaves a half-written snapshot under a snapshot's name;
- ``load_latest`` succeeds without falling back (no warning), and the loaded
  data agrees with the bookkeeping (each stored row carries its own step number).

The child writes what it is doing into a page shared with the parent (phase,
and the last file operation it started), so the report says where the kills
landed. ``tests/snapshot/test_snapshot_crash.py`` runs 50 trials of this in CI.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bigper  # noqa: E402
from bigper import Snapshots  # noqa: E402
from bigper.snapshot import verify  # noqa: E402

PHASES = ("start", "loading", "learning", "saving")
OPS = ("none", "mkdir", "write", "fsync", "link", "rename", "unlink/rmtree")
CAPACITY = 256
FIELDS = {"obs": ((8, 8), np.uint8), "tag": ((), np.int64), "reward": ((), np.float32)}
OPTIONS = dict(n_step=2, storage="memmap", storage_options={"chunk_bytes": 4096}, seed=1)


def steps(g0: int, n: int, rng) -> dict:
    """``n`` steps numbered from ``g0``: every stored value encodes its step number."""
    g = np.arange(g0, g0 + n)
    return {"obs": np.broadcast_to((g % 251).astype(np.uint8)[:, None, None], (n, 8, 8)).copy(),
            "next_obs": np.broadcast_to(((g + 1) % 251).astype(np.uint8)[:, None, None], (n, 8, 8)).copy(),
            "tag": g.astype(np.int64), "reward": g.astype(np.float32),
            "terminated": rng.random(n) < 0.05}


def consistent(buf) -> list[str]:
    """Rows held (live or waiting for their n-step window) carry their own step number."""
    meta, arrays = buf.state_dict()
    gid, status = arrays["gid"], arrays["status"]
    held = np.flatnonzero((gid >= 0) & (status != 0))
    tags = buf._store.read("tag", held)
    obs = buf._store.read("obs", held)
    problems = []
    if not np.array_equal(tags, gid[held]):
        problems.append("a row's data belongs to another step than its bookkeeping says")
    if held.size and not (obs == (gid[held] % 251).astype(np.uint8)[:, None, None]).all():
        problems.append("an obs row does not match its step")
    if held.size and gid[held].max() >= meta["count"]:
        problems.append("a step number beyond the count")
    return problems


# -- the child --------------------------------------------------------------------------------
def _instrument(shm: np.ndarray) -> None:
    """Record in shm[2] the file operation started last (child only)."""
    def wrap(mod, name, code):
        real = getattr(mod, name)

        def call(*a, **k):
            shm[2] = code
            return real(*a, **k)
        setattr(mod, name, call)
    for name, code in (("mkdir", 1), ("write", 2), ("fsync", 3), ("link", 4), ("rename", 5),
                       ("replace", 5), ("unlink", 6), ("rmdir", 6)):
        wrap(os, name, code)
    wrap(shutil, "rmtree", 6)


def _child(root: Path, live: Path, shm: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    _instrument(shm)
    shm[0] = 1
    snaps = Snapshots(root, keep=3)
    buf = snaps.load_latest(path=live)
    while True:
        shm[0] = 2
        n = int(rng.integers(1, 40))
        buf.extend(steps(buf.state_dict()[0]["count"], n, rng))
        b = buf.sample(16)
        buf.update_priorities(b, rng.random(16) * 4)
        shm[0] = 3
        snaps.save(buf)
        shm[1] += 1


# -- the parent ----------------------------------------------------------------------------------
def _check(root: Path, check: Path) -> dict:
    snaps = Snapshots(root)
    out = {"cleaned": len(snaps.cleaned)}
    left = [e for e in os.listdir(root) if e.startswith((".tmp-", ".del-"))]
    if left:
        raise AssertionError(f"leftovers after Snapshots started: {left}")
    present = snaps.list()
    if not present:
        raise AssertionError("no snapshot at all")
    for p in present:
        rep = verify(p)  # raises CorruptSnapshotError for a damaged file
        if rep["problems"]:
            raise AssertionError(f"{p.name}: {rep['problems']}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would mean the newest was broken
        buf = snaps.load_latest(path=check)
    try:
        problems = consistent(buf)
        if problems:
            raise AssertionError(f"{present[-1].name}: {problems}")
        out["len"] = len(buf)
    finally:  # a throwaway: let go without recording its state (the next check takes over again)
        buf._store.abort()
        buf._guard.closed = True
    out["snapshots"] = len(present)
    return out


def run(trials: int, workdir: Path, *, seed: int = 0, max_delay: float = 0.3, early: float = 0.2,
        log=None) -> dict:
    """``trials`` kills; returns counts (phases and operations at kill time, saves done).

    A share ``early`` of the kills comes within 60 ms of the child's start (while it
    loads); the rest uniformly within ``max_delay`` seconds after it starts looping."""
    workdir = Path(workdir)
    root, live, check = workdir / "snaps", workdir / "live", workdir / "check"
    rng = np.random.default_rng(seed)
    buf = bigper.PrioritizedReplayBuffer(CAPACITY, FIELDS, path=live, **OPTIONS)
    buf.extend(steps(0, 100, rng))
    buf.update_priorities(buf.sample(16), rng.random(16))  # compiles every kernel before forking
    Snapshots(root, keep=3).save(buf)
    buf.close()
    _check(root, check)
    page = mmap.mmap(-1, mmap.PAGESIZE)  # MAP_SHARED: the child's writes reach the parent
    shm = np.frombuffer(page, dtype=np.int64, count=3)
    phases, ops, stats = Counter(), Counter(), Counter()
    t0 = time.perf_counter()
    for t in range(trials):
        shm[:] = 0
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller
            code = 0
            try:
                _child(root, live, shm, seed * 100_003 + t)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 3
            os._exit(code)
        if rng.random() < early:  # while it loads: takes over the live directory, reads the snapshot
            time.sleep(rng.uniform(0, 0.06))
        else:  # once it loops (it says so in shm): most of its time is in save
            # Never a kill before that point, however slow a busy machine makes the load; a
            # child that ended on its way there failed (its traceback is on stderr).
            deadline = time.perf_counter() + 600
            while shm[0] < 2:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    raise AssertionError(f"trial {t}: the child ended by itself (status {status}) before "
                                         "its first round; see its traceback")
                if time.perf_counter() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise AssertionError(f"trial {t}: the child did not start its first round in 600 s")
                time.sleep(0.0005)
            time.sleep(rng.uniform(0, max_delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            raise AssertionError(f"trial {t}: the child ended by itself (status {status}); see its traceback")
        phase, saves, op = (int(x) for x in shm)
        phases[PHASES[phase]] += 1
        if phase == 3:
            ops[OPS[op]] += 1
        stats["saves_completed"] += saves
        try:
            res = _check(root, check)
        except Exception as e:
            raise AssertionError(f"trial {t} (killed while {PHASES[phase]}, last op {OPS[op]}): "
                                 f"{type(e).__name__}: {e}") from e
        stats["leftovers_cleaned"] += res["cleaned"]
        stats["ok"] += 1
        if log and (t + 1) % max(1, trials // 10) == 0:
            log(f"  {t + 1}/{trials} trials ok ({time.perf_counter() - t0:.1f} s)")
    del shm  # the view goes before the page it looks at
    page.close()
    return {"trials": trials, "ok": stats["ok"], "killed_while": dict(phases),
            "killed_in_save_after": dict(ops), "saves_completed": stats["saves_completed"],
            "leftovers_cleaned": stats["leftovers_cleaned"], "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay-ms", type=float, default=300.0,
                    help="a kill comes uniformly within this long after the child starts looping")
    ap.add_argument("--early", type=float, default=0.2,
                    help="share of kills within 60 ms of the child's start, while it loads")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    args = ap.parse_args(argv)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bigper-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"crash_test: {args.trials} kill -9 trials in {work} (seed {args.seed}; {args.early:.0%} of "
          f"kills while the child loads, the rest within {args.max_delay_ms:g} ms of its loop's start)")
    try:
        res = run(args.trials, work, seed=args.seed, max_delay=args.max_delay_ms / 1000, early=args.early,
                  log=print)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{res['ok']}/{res['trials']} trials: load_latest succeeded, every snapshot verified, data "
          "consistent with its bookkeeping")
    print(f"killed while: {res['killed_while']}")
    print(f"killed inside save, after starting: {res['killed_in_save_after']}")
    print(f"saves completed by the children: {res['saves_completed']}; leftovers of interrupted "
          f"saves cleaned: {res['leftovers_cleaned']}; {res['seconds']} s")
    print(json.dumps({"bench": "crash_test", **res}, separators=(",", ":")))
    return 0 if res["ok"] == res["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
