"""Compressed frames on real ALE play: bytes per transition and sample/add cost.

For each of six games (tools/bench_codec_frames.py, 3,000 frames of random
play), a buffer of ``--capacity`` (default 20,000) one-step transitions with
4-frame stacks, compression="zstd", filled from a stream cycling over the
frames (the dictionary is trained on the first 1,000; the frames before it
are soon overwritten, as in any run longer than the capacity). Bytes per
transition count every field: the log bytes the live frames take (segment
tails included), the frame index, the references, action/reward/flags and
the priority tree's leaves. Then sample(32) + update_priorities and one add,
against the same buffer uncompressed. Run: ``python tools/bench_compression.py``.
The 10M fill and the beyond-RAM sweep: ``tools/bench.py atari --compression zstd``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_codec_frames import GAMES, frames  # noqa: E402

import bigper  # noqa: E402


def fill(buf, fr, n, warm=3000):
    """``n`` adds cycling over ``fr``; adds per second after the first ``warm``
    (compilation and the dictionary's training are not in it)."""
    pad = np.concatenate([fr[:1]] * 3 + [fr])
    t0 = time.perf_counter()
    for t in range(n):
        if t == warm:
            t0 = time.perf_counter()
        i = t % (fr.shape[0] - 1)
        buf.add(obs=pad[i:i + 4], next_obs=pad[i + 1:i + 5], action=t % 6, reward=0.0,
                terminated=i == fr.shape[0] - 2, truncated=False)
    return (n - warm) / (time.perf_counter() - t0)


def round_us(buf, reps=300):
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        b = buf.sample(32)
        buf.update_priorities(b, rng.random(32))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts[20:])) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=20000)
    args = ap.parse_args()
    fields = {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
    per = []
    print(f"{'game':14s} {'B/transition':>12s} {'ratio':>6s} {'round us':>9s} {'plain us':>9s} "
          f"{'add/s':>7s} {'plain add/s':>11s}")
    for g in GAMES:
        fr = frames(g)
        z = bigper.PrioritizedReplayBuffer(capacity=args.capacity, fields=fields, frame_stack=4,
                                           compression="zstd", compression_budget=7056)
        p = bigper.PrioritizedReplayBuffer(capacity=args.capacity, fields=fields, frame_stack=4)
        n = args.capacity + 2000
        add_z, add_p = fill(z, fr, n), fill(p, fr, n)
        fs = z._frames
        log = fs.log
        live = np.flatnonzero(z._status == 1)
        ids = np.unique(np.concatenate([fs._refs("obs_ref", live).ravel(), fs._refs("next_obs_ref", live).ravel()]))
        idx = fs.store.arrays["frame_index"][ids % fs.F]
        frame_bytes = int((idx[:, 1] & 0xFFFFFFFF).sum())
        # Segment tails: the share of the log that holds no frame, spread over the frames.
        used = log.g * log.seg + log.pos
        written = int(fs.store.arrays["frame_index"][np.arange(max(0, fs.fw - fs.F), fs.fw) % fs.F, 1].__and__(
            0xFFFFFFFF).sum())
        frame_bytes = frame_bytes * max(1.0, used / max(written, 1) if log.g < log.S else 1.0)
        other = sum(a.nbytes for k, a in fs.store.arrays.items() if k not in ("frame_log",))
        other += 8 * args.capacity  # leaves (the tree holds about one float64 a transition)
        bpt = (frame_bytes + other * len(live) / args.capacity) / len(live)
        per.append(bpt)
        print(f"{g:14s} {bpt:12.0f} {len(ids) * 7056 / max(frame_bytes, 1):6.1f} {round_us(z):9.1f} "
              f"{round_us(p):9.1f} {add_z:7.0f} {add_p:11.0f}", flush=True)
    print(f"median bytes per transition over {len(GAMES)} games: {np.median(per):.0f} (target <= 500; "
          "uncompressed 7,243)")


if __name__ == "__main__":
    main()
