"""Issue 34: would a cache of decoded frames pay? How often a prioritized
draw hits a frame decoded in the last few batches, measured.

A learner-shaped run per capacity (default 20,000 and 1,000,000): one env,
episodes of 200..3,000 steps (an episode's first stack is its first frame
repeated, as ``FrameStackObservation`` pads), 4-frame stacks, one ``add`` a
step, and from ``--learning-starts`` steps on one ``sample(32)`` +
``update_priorities`` every ``--adds-per-batch`` (4: DQN's 4 env steps a
gradient step, each transition drawn 8 times on average) steps, with the
buffer's own prioritized sampler (alpha=0.6, new transitions at the largest
priority so far). The frames are 8 bytes (each frame's own number): only
their ids matter here, and they are bigper's own (``FrameStore.refs``).

Priorities (``|TD|`` handed to ``update_priorities``), three models:

- ``decaying``: each transition has an error drawn at its add (lognormal,
  sigma 1, ``--sigma``); every time it is drawn the learner reports it times U(0.5, 1.5)
  and learning shrinks it by 0.7 (the transitions drawn most are the ones
  learned from, as in a real run);
- ``floor``: as ``decaying``, but an error never shrinks below a fifth of
  the one drawn at its add (what a moving target leaves: errors that learning
  drives to 0 make the newest transitions, which enter at the largest
  priority, all that is drawn at a high replay ratio);
- ``fresh``: every update draws a new ``|TD|`` (lognormal, sigma 1): a heavy
  tail without memory;
- ``uniform``: alpha = 0 (the floor: no priority at all).

Over the last ``--batches`` batches (the buffer full and wrapped), for each
batch's distinct frame ids (those ``pair`` decodes: ``k + 1`` a row): the
share already decoded in the last 1, 4, 16 batches, and the hit rate of an
LRU cache of decoded 84x84 frames holding 16 MB and 64 MB (2,377 and 9,510
frames of 7,056 bytes); also the share of a batch's ids that are distinct
(what decoding each distinct frame once saves). Prints a table and a JSON line.

    PYTHONPATH=. python tools/dev/decode_cache_hits.py [--capacities 20000,1000000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchkit import import_bigper, print_table, say  # noqa: E402

BATCH, K = 32, 4
FRAME_BYTES = 84 * 84
WINDOWS = (1, 4, 16)
LRU_MB = (16, 64)


class Hits:
    """Per batch: the distinct ids, and how many were decoded in the last W
    batches or sit in an LRU cache of decoded frames."""

    def __init__(self):
        self.last: dict[int, int] = {}  # id -> last batch it was in
        self.lru = {mb: OrderedDict() for mb in LRU_MB}
        self.t = 0
        self.ids = self.distinct = 0
        self.hits = {w: 0 for w in WINDOWS}
        self.lru_hits = {mb: 0 for mb in LRU_MB}

    def batch(self, ids: np.ndarray) -> None:
        self.t += 1
        self.ids += ids.size
        d = np.unique(ids).tolist()
        self.distinct += len(d)
        last = self.last
        for f in d:
            seen = last.get(f)
            if seen is not None:
                for w in WINDOWS:
                    if self.t - seen <= w:
                        self.hits[w] += 1
            last[f] = self.t
        for mb, cache in self.lru.items():
            cap = mb * 2**20 // FRAME_BYTES
            for f in d:
                if f in cache:
                    self.lru_hits[mb] += 1
                    cache.move_to_end(f)
                else:
                    cache[f] = None
                    if len(cache) > cap:
                        cache.popitem(last=False)
        if self.t % 2000 == 0:  # forget what no window reaches
            self.last = {f: s for f, s in last.items() if self.t - s < max(WINDOWS)}

    def result(self) -> dict:
        n = max(self.distinct, 1)
        return {"batches": self.t, "distinct_share": self.distinct / max(self.ids, 1),
                **{f"last_{w}": self.hits[w] / n for w in WINDOWS},
                **{f"lru_{mb}mb": self.lru_hits[mb] / n for mb in LRU_MB}}


def run(capacity: int, model: str, batches: int, learning_starts: int, adds_per_batch: int, seed: int,
        sigma: float = 1.0) -> dict:
    bigper = import_bigper()
    buf = bigper.PrioritizedReplayBuffer(capacity=capacity, fields={"obs": ((K, 1, 8), np.uint8)}, frame_stack=K,
                                         alpha=0.0 if model == "uniform" else 0.6, seed=seed)
    rng = np.random.default_rng(seed)
    err = rng.lognormal(0.0, sigma, capacity)  # each slot's current error (decaying, floor)
    floor = err * 0.2  # the error learning does not remove (floor)
    fs = buf._frames
    steps = capacity + batches * adds_per_batch  # full, then the measured batches
    measure_from = steps - batches * adds_per_batch
    hits = Hits()
    frame = 0
    t = 0
    t0 = time.perf_counter()
    while t < steps:
        length = int(rng.integers(200, 3001))
        first = np.array([frame], dtype=np.uint64).view(np.uint8).reshape(1, 1, 8)
        stack = np.repeat(first, K, axis=0)
        for i in range(length):
            frame += 1
            new = np.array([frame], dtype=np.uint64).view(np.uint8).reshape(1, 1, 8)
            nxt = np.concatenate([stack[1:], new])
            buf.add(obs=stack, next_obs=nxt, terminated=i == length - 1, truncated=False)
            err[t % capacity] = rng.lognormal(0.0, sigma)
            floor[t % capacity] = err[t % capacity] * 0.2
            stack = nxt
            t += 1
            if t >= learning_starts and t % adds_per_batch == 0:
                b = buf.sample(BATCH)
                if t > measure_from:
                    ro, rn = fs.refs("obs_ref", b.indices), fs.refs("next_obs_ref", b.indices)
                    hits.batch(np.concatenate([ro, rn[:, -1:]], axis=1).ravel())
                if model in ("decaying", "floor"):
                    e = err[b.indices]
                    p = e * rng.uniform(0.5, 1.5, BATCH)
                    err[b.indices] = e * 0.7 if model == "decaying" else np.maximum(e * 0.7, floor[b.indices])
                else:
                    p = rng.lognormal(0.0, sigma, BATCH)
                buf.update_priorities(b, p)
            if t % 200_000 == 0:
                say(f"    {capacity:,} {model}: {t:,} of {steps:,} steps, {time.perf_counter() - t0:.0f} s")
            if t == steps:
                break
    buf.close()
    return {"capacity": capacity, "model": model, "sigma": sigma, **hits.result()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", default="20000,1000000")
    ap.add_argument("--models", default="decaying,floor,fresh,uniform")
    ap.add_argument("--batches", type=int, default=20_000, help="batches measured, after the buffer is full")
    ap.add_argument("--learning-starts", type=int, default=20_000)
    ap.add_argument("--adds-per-batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigma", type=float, default=1.0, help="the errors' lognormal sigma (their tail)")
    args = ap.parse_args()
    out = []
    for cap in (int(c) for c in args.capacities.split(",")):
        for model in args.models.split(","):
            say(f"[decode-cache-hits] capacity {cap:,}, {model} ...")
            out.append(run(cap, model, args.batches, min(args.learning_starts, cap), args.adds_per_batch,
                           args.seed, args.sigma))
    rows = [[f"{r['capacity']:,}", r["model"], f"{r['distinct_share']:.1%}",
             *(f"{r[f'last_{w}']:.2%}" for w in WINDOWS), *(f"{r[f'lru_{mb}mb']:.2%}" for mb in LRU_MB)]
            for r in out]
    print_table(["capacity", "priorities", "distinct ids", *(f"in last {w}" for w in WINDOWS),
                 *(f"LRU {mb} MB" for mb in LRU_MB)], rows)
    print(f"  B={BATCH}, k={K}: a batch's {BATCH * (K + 1)} pair ids; 'in last W': share of its distinct frames "
          f"decoded in the W batches before it; LRU: hit rate of a cache of decoded 84x84 frames of that size")
    print(json.dumps({"bench": "decode-cache-hits", "batch": BATCH, "k": K, "adds_per_batch": args.adds_per_batch,
                      "sigma": args.sigma,
                      "results": out}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
