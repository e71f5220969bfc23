"""zstd's dictionary trainers on real ALE frames: the default search over k
(``ZDICT_trainFromBuffer``: fastCover, d = 8, four steps of k in 50..2000),
the same search in ``LOOK_STEPS`` steps (what a look of the frame log
trains: ``frames/look.py``), fastCover at fixed segment sizes k, and the
smaller of k = 50 and k = 2000 picked on the measured frames.

For each of six games (``workloads.codecs.frames``: 3,000 frames of random
play, cached under /tmp), three windows: a dictionary trained on 500 frames,
measured on the 500 after them (level 3, frames compressed one by one, as the
log does). Prints bytes a frame and training ms per trainer, then each
trainer's geometric mean ratio to the search.

    python tools/dev/dictionary_trainers.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bigper.frames import zstd as Z  # noqa: E402
from bigper.frames.look import LOOK_STEPS  # noqa: E402
from workloads.codecs.frames import GAMES, frames  # noqa: E402

KS = (50, 300, 1024, 2000)


def size(d: np.ndarray, rows: np.ndarray) -> float:
    codec = Z.Codec(level=3)
    try:
        codec.set_dictionary(1, d)
        dst = np.empty(rows.shape[0] * Z.bound(rows.shape[1]), dtype=np.uint8)
        used = Z.compress_rows(codec.cctx[1], rows, dst, np.empty(rows.shape[0], dtype=np.int64))
    finally:
        codec.close()
    return used / rows.shape[0]


def timed(train, *args, **kw):
    t = time.perf_counter()
    d = train(*args, **kw)
    return d, (time.perf_counter() - t) * 1e3


def main() -> int:
    ratios: dict = {}
    print(f"{'game':<14} window  " + "  ".join(f"{n:>16}" for n in ["search", f"steps={LOOK_STEPS}",
                                                                     *(f"k={k}" for k in KS), "two-k"]))
    for game in GAMES:
        fr = frames(game).reshape(3000, -1)
        for w, start in enumerate((0, 1000, 2000)):
            train = np.ascontiguousarray(fr[start:start + 500])
            test = np.ascontiguousarray(fr[start + 500:start + 1000])
            d0, t0 = timed(Z.train, train, 16384)
            base = size(d0, test)
            cells = [f"{base:7.0f} B {t0:4.0f} ms"]
            d1, t1 = timed(Z.train, train, 16384, steps=LOOK_STEPS)
            cells.append(f"{size(d1, test):7.0f} B {t1:4.0f} ms")
            ratios.setdefault(f"steps={LOOK_STEPS}", []).append(size(d1, test) / base)
            fixed = {}
            for k in KS:
                d, t = timed(Z.train, train, 16384, k=k)
                fixed[k] = (size(d, test), t)
                cells.append(f"{fixed[k][0]:7.0f} B {t:4.0f} ms")
                ratios.setdefault(f"k={k}", []).append(fixed[k][0] / base)
            two = [fixed[k] for k in (50, 2000)]
            best = min(s for s, _ in two)
            cells.append(f"{best:7.0f} B {sum(t for _, t in two):4.0f} ms")
            ratios.setdefault("two-k", []).append(best / base)
            print(f"{game:<14} {w:>6}  " + "  ".join(f"{c:>16}" for c in cells))
    print("bytes a frame against the search's, geometric mean (min .. max):")
    for name, r in ratios.items():
        r = np.array(r)
        print(f"  {name:<8} {np.exp(np.log(r).mean()):.3f}  ({r.min():.2f} .. {r.max():.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
