"""Issue 34: does decoding each distinct frame once (``FrameStore._decode``)
cost anything when a batch has no repeated frame?

A compressed buffer of ``--capacity`` (default 20,000) transitions with
4-frame stacks, filled with real ALE frames (``workloads.codecs.frames``, default
MsPacman), then, interleaved in one process: ``SegmentLog.decode`` of a
batch's ``pair`` ids as the read path called it before (every id decoded,
repeats included) and ``FrameStore._decode`` of the same ids, for batches
drawn the way ``sample`` draws them (B=32, k + 1 ids a row) and for batches
with many repeats (a batch of 256 from a buffer of 64). Prints µs per call
(median of blocks) and the JSON line.

    PYTHONPATH=. python tools/dev/decode_once_timing.py [--capacity 20000] [--game MsPacman]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workloads.codecs.frames import frames  # noqa: E402

import bigper  # noqa: E402

FIELDS = {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64)}


def filled(capacity: int, game: str, n: int):
    fr = frames(game)
    buf = bigper.PrioritizedReplayBuffer(capacity=capacity, fields=FIELDS, frame_stack=4, compression="zstd", seed=0)
    pad = np.concatenate([fr[:1]] * 3 + [fr])
    for t in range(n):
        i = t % (fr.shape[0] - 1)
        buf.add(obs=pad[i:i + 4], next_obs=pad[i + 1:i + 5], action=t % 6, terminated=i == fr.shape[0] - 2,
                truncated=False)
    return buf


def pair_ids(buf, b: int) -> np.ndarray:
    """The ids ``pair`` decodes for one ``sample(b)``'s slots."""
    idx = buf.sample(b).indices
    fs = buf._frames
    ro, rn = fs.refs("obs_ref", idx), fs.refs("next_obs_ref", idx)
    return np.concatenate([ro, rn[:, -1:]], axis=1).ravel()


def timed(fns: dict, batches: list, blocks: int) -> dict:
    """µs per call of each function over ``batches``: the median of ``blocks``
    blocks, the functions' order alternating; and each against the first as
    the median of the per-block ratios (the machine drifts less within a block)."""
    per = {k: [] for k in fns}
    for r in range(blocks):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            for ids, out in batches:
                fns[name](ids, out)
            per[name].append((time.perf_counter() - t0) / len(batches) * 1e6)
    first = np.array(per[next(iter(fns))])
    return {k: {"us": float(np.median(v)), "ratio": float(np.median(np.array(v) / first)),
                "ratio_q25_q75": [float(q) for q in np.quantile(np.array(v) / first, [0.25, 0.75])]}
            for k, v in per.items()}


def case(buf, b: int, blocks: int) -> dict:
    """The timings for batches of ``b`` drawn from ``buf``: all of them, and
    those without a repeated frame and those with one apart."""
    fs = buf._frames
    every, plain, repeats = [], [], []
    out = np.empty((b * (fs.k + 1), fs.row_bytes), dtype=np.uint8)  # (one output: as a reused one is)
    draws = 0
    while draws < 50 or (min(len(plain), len(repeats)) < 50 and draws < 5000):
        ids = pair_ids(buf, b)
        draws += 1
        if len(every) < 50:
            every.append((ids, out))
        (plain if np.unique(ids).shape[0] == ids.shape[0] else repeats).append((ids, out))
    for ids, out in every + repeats[:50]:  # the same bytes both ways
        ref = fs.log.decode(ids, np.empty_like(out))
        assert np.array_equal(ref, fs._decode(ids, out))
    uniq, src = np.empty(b * 5, np.int64), np.empty(b * 5, np.int64)
    fns = {"decode every id (before)": lambda ids, out: fs.log.decode(ids, out),
           "_decode (each distinct once)": fs._decode,
           "distinct_ids alone": lambda ids, out: bigper.frames.store.distinct_ids(ids, uniq, src)}
    res = {}
    for name, batches in (("drawn", every), ("without a repeat", plain[:50]), ("with a repeat", repeats[:50])):
        if batches:
            res[name] = timed(fns, batches, blocks)
            res[name]["distinct share of ids"] = float(np.mean([np.unique(i).shape[0] / i.shape[0]
                                                                for i, _ in batches]))
            res[name]["share of batches"] = 1.0 if name == "drawn" else \
                len(plain if name == "without a repeat" else repeats) / draws
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--game", default="MsPacman")
    ap.add_argument("--blocks", type=int, default=100)
    args = ap.parse_args()
    out = {}
    big = filled(args.capacity, args.game, args.capacity + 2000)
    out[f"B=32 from {args.capacity:,}"] = case(big, 32, args.blocks)
    big.close()
    small = filled(64, args.game, 400)
    out["B=256 from 64"] = case(small, 256, args.blocks // 2)
    small.close()
    for name, cases in out.items():
        for sub, r in cases.items():
            print(f"{name}, {sub}: {r['share of batches']:.0%} of batches, distinct {r['distinct share of ids']:.1%} "
                  "of ids")
            for k, v in r.items():
                if isinstance(v, dict):
                    print(f"  {k:30s} {v['us']:9.1f} us  ratio {v['ratio']:.3f} "
                          f"(IQR {v['ratio_q25_q75'][0]:.3f}-{v['ratio_q25_q75'][1]:.3f})")
    print(json.dumps({"bench": "decode-once", **out}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
