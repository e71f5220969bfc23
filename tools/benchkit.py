"""Shared helpers of the benchmarks in tools/: versions, timing, tables.

Every workload (``tools/workloads/<workload>/``) imports what it needs from
here, and nothing in this module imports a workload, so the tools have one
direction: ``benchkit <- workloads.<workload>.* <- bench`` (the command line,
which imports the chosen workload's ``main`` module only when it runs it).

A workload's ``main`` module gives ``add_arguments(parser)`` (optional) and
either sets ``func`` on the parser's defaults or defines ``main(args) -> int``;
it prints a table and, last, one JSON line ``{"bench": "<workload>", ...}``.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS_DIR)
PEER_DISTS = ("cpprb", "tianshou", "torchrl", "tensordict", "torch")


# -- versions and imports ----------------------------------------------------------------


def dist_version(name: str) -> str | None:
    """Installed version of distribution ``name``, or None; never imports it."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of the interpreter and libraries, read without importing the peers."""
    import numba

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    for dist in ("bigper", *PEER_DISTS):
        out[dist] = dist_version(dist)
    return out


def import_bigper():
    """Import bigper, preferring the checkout this script lives in."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import bigper

    return bigper


def print_header(title: str) -> dict[str, str | None]:
    """Print the bench title, the versions and the machine; return the versions."""
    v = versions()
    libs = ", ".join(f"{k} {v[k] or 'not installed'}" for k in PEER_DISTS)
    print(f"== bench {title} ==")
    print(f"python {v['python']}, numpy {v['numpy']}, numba {v['numba']}")
    print(f"peers: {libs}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}")
    return v


class PeerUnavailable(Exception):
    """A peer is installed but cannot run here (a broken compiled extension, say)."""


def short_error(exc: BaseException) -> str:
    """``Type: message``, cut to 200 characters, for a table's notes."""
    msg = f"{type(exc).__name__}: {exc}"
    return msg if len(msg) <= 200 else msg[:197] + "..."


def say(*a) -> None:
    """Progress on stderr, so stdout keeps the table and the JSON line."""
    print(*a, file=sys.stderr, flush=True)


# -- timing ------------------------------------------------------------------------------


def time_blocks(fn: Callable[[int], None], n: int) -> float:
    """Seconds per call of ``fn(i)`` for ``i in range(n)``, with the GC off."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - t0) / n
    finally:
        if gc_was_on:
            gc.enable()


def time_both(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """Wall and CPU (this process) seconds per call of ``fn(i)``, ``i in range(n)``, GC off.

    The machine may be shared: CPU time leaves out the time other processes
    held the cores, wall time does not; both are reported."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n
    finally:
        if gc_was_on:
            gc.enable()


def interleaved_blocks(
    fns: dict[str, Callable[[int], None]], n: int, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Time ``repeats`` blocks of ``n`` calls for every function, interleaved.

    The order of the functions rotates each repeat, so slow drifts of the
    machine (another process, thermal state) spread over all libraries instead
    of landing on one. Returns the per-call seconds of every block.
    """
    names = list(fns)
    for name in names:
        for i in range(warmup):
            fns[name](i)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            blocks[name].append(time_blocks(fns[name], n))
    return blocks


def ratio(peer: float | None, ours: float | None) -> float | None:
    """``peer / ours``, or None when either is missing or ours is not positive."""
    if peer is None or ours is None or ours <= 0:
        return None
    return peer / ours


# -- memory and disk ---------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


def disk_bytes(path: Path) -> int:
    """Blocks allocated to every file under ``path``, in bytes."""
    return sum(p.stat().st_blocks * 512 for p in Path(path).rglob("*") if p.is_file())


# -- tables ------------------------------------------------------------------------------


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or "-" for a missing number."""
    return "-" if x is None else format(x, spec)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Print ``rows`` under ``headers``: first column left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
