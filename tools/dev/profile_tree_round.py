"""Where a tree round's time goes: the round of ``tools/bench.py tree`` taken apart.

A memory buffer of 2^20 transitions (the tree workload's fields), then µs per
call (best and median of 7 repeats of 20,000 calls) of:

- ``round``: ``update_priorities(sample(B), td)``, as the bench times it;
- ``sample`` and ``update`` alone;
- ``floor round``: the same work with every Python layer of bigper stripped:
  the uniforms, the two sampling kernels (draw + descent, generations + end
  flags), one numpy ``take`` a field, the ``Batch``, and the update kernel;
- the parts of that floor, each on fresh random rows (``descent``, ``meta``,
  ``takes``, ``update kernel``);
- the bulk path, ``update_priorities`` of all 2^20 rows (ms, median of 15),
  and its parts (``prioritization/_bulk.py``): the scan (checks, keys with one
  libm ``pow`` a priority, routing counts; in threads, and on one thread),
  the writes, last row first, the O(N) rebuild, and numpy's vectorized
  ``power`` of the same priorities for comparison.

The gap between ``round`` and ``floor round`` is bigper's Python (checks,
lock, schedule, dispatch); the floor is what any Python-called buffer built
on these kernels and numpy gathers would pay on this machine.

Usage::

    python tools/dev/profile_tree_round.py [--batch 32] [--capacity-log2 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: benchkit
from benchkit import import_bigper  # noqa: E402


def _time(fn, calls: int = 20_000, repeats: int = 7) -> tuple[float, float]:
    fn(0)
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return min(per), statistics.median(per)


def _ms(fn, repeats: int = 15) -> float:
    fn()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3


def _bulk(buf, rng) -> dict:
    """``update_priorities`` of every row, and its parts, in ms."""
    import os

    from bigper.prioritization import _bulk as B

    cap = buf.capacity
    idx, p = np.arange(cap), np.abs(rng.standard_normal(cap)) + 0.01
    prio, tree = buf._prio, buf._prio.tree
    args = (p, idx, idx, False, buf._ring.gid, buf._ring.status, prio.alpha, prio.eps, prio.max_priority, 1 << 16)
    keys = B.scan(*args)[0]
    res = {"update_priorities(all)": _ms(lambda: buf.update_priorities(idx, p)),
           "scan: checks + keys (threads)": _ms(lambda: B.scan(*args))}
    saved = os.environ.get("BIGPER_THREADS")
    os.environ["BIGPER_THREADS"] = "1"
    try:
        res["scan: checks + keys (one thread)"] = _ms(lambda: B.scan(*args))
    finally:
        if saved is None:
            os.environ.pop("BIGPER_THREADS")
        else:
            os.environ["BIGPER_THREADS"] = saved
    res["writes, last row first"] = _ms(lambda: B.write_last_first(
        tree.sums, int(tree.offsets[-1]), idx, keys, idx, False, buf._ring.gid, buf._ring.status, buf._ring.pending,
        np.zeros(cap, dtype=np.bool_)))
    res["O(N) rebuild"] = _ms(tree.rebuild)
    res["numpy power (vectorized), one thread"] = _ms(lambda: np.power(p + 1e-6, 0.6))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(prog="profile_tree_round", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--capacity-log2", type=int, default=20)
    a = ap.parse_args()
    bigper = import_bigper()
    from bigper.prioritization import _tree_kernels as K
    from bigper.core import ring
    from bigper.batch import Batch

    cap, b = 1 << a.capacity_log2, a.batch
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((cap, 4), dtype=np.float32)
    buf = bigper.PrioritizedReplayBuffer(
        cap, {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        alpha=0.6, beta=0.4, seed=0)
    buf.extend({"obs": obs, "action": rng.integers(0, 18, cap), "reward": rng.standard_normal(cap, dtype=np.float32),
                "next_obs": obs, "terminated": rng.random(cap) < 0.01})
    buf.update_priorities(np.arange(cap), np.abs(rng.standard_normal(cap)) + 0.01)
    pool = [np.abs(rng.standard_normal(b)) + 0.01 for _ in range(64)]

    # The internals the floor calls directly (a profile, not an API).
    tree, rd, arrays, g = buf._prio.tree, buf._reader, buf._store.arrays, buf._draws.rng
    names = tuple(buf._plain)

    def floor_sample(i):
        u = g.random(b)
        idx, prob, w = np.empty(b, np.int64), np.empty(b, np.float64), np.empty(b, np.float32)
        K.sample_into(tree.sums, tree.mins, tree.offsets, u, True, 0.4, False, idx, prob, w)
        gen, term, trunc = np.empty(b, np.int64), np.empty(b, np.bool_), np.empty(b, np.bool_)
        disc = np.empty(b, np.float32)
        ring.batch_meta(idx, rd.ends, rd.gid, rd.discount1, gen, term, trunc, disc)
        data = {n: arrays[n].take(idx, axis=0, mode="clip") for n in names}
        data.update(terminated=term, truncated=trunc, discount=disc)
        return Batch.make(data, idx, w, prob, gen)

    def floor_round(i):
        bt = floor_sample(i)
        t = tree
        K.update_capped((t.sums, t.mins, t.offsets, t.sizes), (bt.indices, pool[i % 64], np.empty(0), bt.generations,
                        True), (buf._ring.gid, buf._ring.status, buf._ring.pending), (0.6, 1e-6, np.inf, buf._prio.limit), True)

    idx, prob, w = np.empty(b, np.int64), np.empty(b, np.float64), np.empty(b, np.float32)
    gen, term, trunc = np.empty(b, np.int64), np.empty(b, np.bool_), np.empty(b, np.bool_)
    disc = np.empty(b, np.float32)
    fresh = [rng.integers(0, cap, b) for _ in range(4096)]
    batch = buf.sample(b)
    rows = {
        "round": lambda i: buf.update_priorities(buf.sample(b), pool[i % 64]),
        "sample": lambda i: buf.sample(b),
        "update": lambda i: buf.update_priorities(batch, pool[i % 64]),
        "floor round": floor_round,
        "floor sample": floor_sample,
        "descent (kernel)": lambda i: K.sample_into(tree.sums, tree.mins, tree.offsets, g.random(b), True, 0.4,
                                                    False, idx, prob, w),
        "meta (kernel)": lambda i: ring.batch_meta(fresh[i % 4096], rd.ends, rd.gid, rd.discount1, gen, term, trunc,
                                                disc),
        "takes (numpy)": lambda i: [arrays[n].take(fresh[i % 4096], axis=0, mode="clip") for n in names],
        "update (kernel)": lambda i: K.update_capped(
            (tree.sums, tree.mins, tree.offsets, tree.sizes), (fresh[i % 4096], pool[i % 64], np.empty(0),
            fresh[i % 4096], False), (buf._ring.gid, buf._ring.status, buf._ring.pending), (0.6, 1e-6, np.inf, buf._prio.limit),
            True),
        "uniforms (numpy)": lambda i: g.random(b),
    }
    out = {}
    print(f"tree round at capacity 2^{a.capacity_log2}, batch {b}: µs per call, best / median of 7 x 20,000")
    for name, fn in rows.items():
        best, med = _time(fn)
        out[name] = {"best_us": best, "median_us": med}
        print(f"  {name:18s} {best:8.2f} {med:8.2f}")
    bulk = _bulk(buf, rng)
    out["bulk_ms"] = bulk
    print("set all priorities at once: ms, median of 15")
    for name, ms in bulk.items():
        print(f"  {name:34s} {ms:8.2f}")
    gap = out["round"]["median_us"] - out["floor round"]["median_us"]
    print(f"  bigper's Python over the floor: {gap:.2f} µs a round "
          f"({gap / out['round']['median_us']:.0%} of it)")
    buf.close()
    print(json.dumps({"profile": "tree_round", "batch": b, "capacity": cap, "rows": out}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
