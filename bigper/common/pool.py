"""A small shared thread pool for work split into index ranges.

Numba kernels (``nogil=True``) and numpy's element-wise loops release the
GIL, so a bulk job cut into ranges runs on several cores from plain threads.
Every range computes exactly what the whole call would compute for those
elements (no reduction changes order), so the result is the same bit for
bit whatever the number of threads.

Not numba's ``parallel=True``: its default threading layer (workqueue) aborts
the process when two Python threads enter parallel kernels at once, which a
prefetching sampler beside a learner would do.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def workers() -> int:
    """Threads a bulk job uses: the cores this process may run on, at most 16
    (``BIGPER_THREADS`` overrides; 1 turns threading off)."""
    env = os.environ.get("BIGPER_THREADS")
    if env and env.isdigit() and int(env) >= 1:
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


def _forget_pool() -> None:
    """In a forked child: the parent's pool has no threads here (a job sent to it
    would wait for ever); the child makes its own on first use."""
    global _POOL, _LOCK
    _POOL, _LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(1, workers() - 1), thread_name_prefix="bigper-pool")
        return _POOL


def ranges(n: int, min_chunk: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``0..n``, one per thread, each at least
    ``min_chunk`` long (one range when ``n`` is small)."""
    parts = max(1, min(workers(), n // max(1, min_chunk)))
    step = -(-n // parts)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]


def for_ranges(fn: Callable[[int, int], None], n: int, min_chunk: int) -> None:
    """Call ``fn(lo, hi)`` over ``ranges(n, min_chunk)``: the first range in
    this thread, the others in the pool; returns when all are done and
    re-raises the first error."""
    parts = ranges(n, min_chunk)
    if len(parts) == 1:
        fn(*parts[0])
        return
    futures = [_pool().submit(fn, lo, hi) for lo, hi in parts[1:]]
    err = None
    try:
        fn(*parts[0])
    except BaseException as e:  # noqa: BLE001 (wait for the others first)
        err = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err
