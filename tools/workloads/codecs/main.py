"""Which codec for compressed frames: ratio and decode time on real ALE frames.

Per game (frames.py beside this file, 3,000 frames, random play): the ratio of
each codec compressing frames one by one, the time to decode one frame, and a
batch of 160 random frames (a batch of 32 one-step transitions, 4-frame
stacks plus the next frame) into one output array, on 1 and 2 threads where
the codec offers threads. Run: ``python tools/bench.py codecs``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from benchkit import import_bigper
from workloads.codecs.frames import GAMES, frames

import_bigper()  # the checkout's bigper, for its private modules below
from bigper.common import pool as _pool  # noqa: E402
from bigper.frames import zstd as _zstd  # noqa: E402

BATCH = 160
REPS = 200


def best(fn, reps=REPS):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def main(args=None) -> int:
    import blosc2
    import lz4.block
    import zstandard

    rng = np.random.default_rng(0)
    print(f"{'game':14s} {'codec':22s} {'ratio':>6s} {'1 frame us':>10s} {'160, 1 thr':>10s} {'160, 2 thr':>10s}")
    for g in GAMES:
        fr = frames(g).reshape(3000, -1)
        n = fr.shape[1]
        pick = rng.integers(1000, 3000, BATCH)
        out = np.empty((BATCH, n), dtype=np.uint8)
        rows = [fr[i].tobytes() for i in range(fr.shape[0])]
        # lz4 block
        lz = [lz4.block.compress(r, store_size=False) for r in rows]
        ratio = fr.nbytes / sum(map(len, lz))
        one = best(lambda: lz4.block.decompress(lz[1500], uncompressed_size=n))
        bat = best(lambda: [lz4.block.decompress(lz[i], uncompressed_size=n) for i in pick])
        print(f"{g:14s} {'lz4 (python loop)':22s} {ratio:6.1f} {one:10.1f} {bat:10.1f} {'-':>10s}")
        # blosc2 (its zstd, one chunk per frame)
        bl = [blosc2.compress(r, typesize=1, codec=blosc2.Codec.ZSTD, clevel=3) for r in rows]
        ratio = fr.nbytes / sum(map(len, bl))
        one = best(lambda: blosc2.decompress(bl[1500]))
        bat = best(lambda: [blosc2.decompress(bl[i]) for i in pick])
        print(f"{g:14s} {'blosc2 zstd (loop)':22s} {ratio:6.1f} {one:10.1f} {bat:10.1f} {'-':>10s}")
        # zstandard, with a dictionary trained on the first 1000 frames
        for use_dict in (False, True):
            d = zstandard.train_dictionary(16384, rows[:1000]) if use_dict else None
            cz = zstandard.ZstdCompressor(level=3, dict_data=d)
            dz = zstandard.ZstdDecompressor(dict_data=d)
            zs = [cz.compress(r) for r in rows]
            ratio = fr.nbytes / sum(map(len, zs))
            one = best(lambda: dz.decompress(zs[1500]))
            bat = best(lambda: [dz.decompress(zs[i]) for i in pick])
            sel = [zs[i] for i in pick]

            def multi(t):
                res = dz.multi_decompress_to_buffer(sel, decompressed_sizes=np.full(BATCH, n, np.uint64).tobytes(),
                                                    threads=t)
                np.copyto(out, np.frombuffer(res[0].tobytes() if len(res) == 1 else b"".join(
                    bytes(res[i]) for i in range(len(res))), np.uint8).reshape(BATCH, n))
            m1, m2 = best(lambda: multi(1)), best(lambda: multi(2))
            name = "zstandard" + (" +dict" if use_dict else "")
            print(f"{g:14s} {name + ' (loop)':22s} {ratio:6.1f} {one:10.1f} {bat:10.1f} {'-':>10s}")
            print(f"{g:14s} {name + ' (multi)':22s} {ratio:6.1f} {'':10s} {m1:10.1f} {m2:10.1f}")
        # libzstd from numba (bigper.frames.zstd), GIL released, split over the pool's threads
        for use_dict in (False, True):
            codec = _zstd.Codec(level=3)
            did = codec.add_dictionary(_zstd.train(fr[:1000])) if use_dict else 0
            log, lengths = codec.compress(fr, did)
            offs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            ratio = fr.nbytes / log.nbytes
            o, ln, ids = offs[pick], lengths[pick], np.full(BATCH, did, np.int64)
            o1, l1, i1 = offs[1500:1501], lengths[1500:1501], ids[:1]

            def dec(lo, hi, o=o, ln=ln, ids=ids):
                r = _zstd.decompress_rows(codec.dctx(), codec.ddicts, log, o, ln, ids, out, lo, hi)
                assert r < 0
            one = best(lambda: _zstd.decompress_rows(codec.dctx(), codec.ddicts, log, o1, l1, i1, out, 0, 1))
            t1 = best(lambda: dec(0, BATCH))
            import os
            os.environ["BIGPER_THREADS"] = "2"
            t2 = best(lambda: _pool.for_ranges(dec, BATCH, 16))
            del os.environ["BIGPER_THREADS"]
            assert (out == fr[pick]).all()
            name = "numba+libzstd" + (" +dict" if use_dict else "")
            print(f"{g:14s} {name:22s} {ratio:6.1f} {one:10.1f} {t1:10.1f} {t2:10.1f}")
        sys.stdout.flush()

    return 0
