"""Compressed frames at the default settings, game by game (issue 34):
``tools/bench.py atari --compression zstd --games``.

For each of the six games of real ALE play (``workloads.codecs.frames``: 3,000
frames of random play each, 84x84 after ``AtariPreprocessing``), and two
synthetic streams (``noise``: uniform random bytes, which do not compress;
``half``: a frame half noise, half black, which compresses about 2x), a
memmap buffer of ``--capacity`` (default 20,000) one-step transitions with
4-frame stacks and ``compression="zstd"`` **at its defaults** (no
``compression_budget``), in a temporary directory, and the same buffer
uncompressed beside it. Each is filled with ``capacity * 3 // 2`` steps
(``scale.episodes``: episodes of 200..3,000 frames from random
starts, each shifted by 0..4 pixels, so no episode repeats another; the
synthetic ones fresh bytes every frame), so the frame log has wrapped.
Reported:

- ``disk B/tr``: the blocks every file of the buffer's directory holds
  (``st_blocks * 512``, summed) over the capacity;
- ``held``: sampleable transitions (``status == 1``, the public status
  array) over the capacity: ``capacity`` is a promise (docs/reliability.md);
- ``frame B``: the mean compressed size of the frames the live transitions
  use, and ``log B/frame``: the budget the buffer chose;
- the round: ``sample(32)`` + ``update_priorities``, median µs, warm (after
  the fill, page cache warm) and cold (the buffer closed, the page cache
  dropped (root only), reopened with ``mode="resume"``: the median of the
  first 100 rounds);
- ``add/s``: one ``add`` a step, after the first 3,000, against the raw buffer's.

Prints a table and, last, one JSON line ``{"bench": "atari-games", ...}``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchkit import disk_bytes, import_bigper, print_table, say
from workloads.atari.scale import rounds  # (sample(32) + update, each timed)
from workloads.storage.data import drop_page_cache

GAMES = ("Pong", "Breakout", "MsPacman", "Seaquest", "SpaceInvaders", "Qbert")  # (workloads.codecs.frames.GAMES)
SYNTHETIC = ("noise", "half")
FIELDS = {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
WARM_ADDS = 3000  # adds before the rate is timed (compilation, the dictionary's first training)


def episodes(case: str, seed: int = 0):
    """Endless episodes ``(L, 84, 84)`` uint8 of ``case``: a game's real play
    (``scale.episodes``) or fresh synthetic bytes."""
    if case in GAMES:
        from workloads.atari.scale import episodes as real

        yield from real(case, seed)
        return
    rng = np.random.default_rng(seed)
    while True:
        ln = int(rng.integers(200, 3000))
        ep = rng.integers(0, 256, (ln, 84, 84), dtype=np.uint8)
        if case == "half":
            ep[:, 42:] = 0
        yield ep


def fill(buf, case: str, steps: int) -> float:
    """``steps`` adds, one a step; adds per second after the first ``WARM_ADDS``
    (a third of them in a smaller run), making the episodes left out."""
    warm = min(WARM_ADDS, steps // 3)
    it = episodes(case)
    t = 0
    spent = 0.0
    while t < steps:
        ep = next(it)
        pad = np.concatenate([ep[:1]] * 3 + [ep])
        last = ep.shape[0] - 2
        t0 = time.perf_counter()
        for i in range(last + 1):
            if t == warm:
                spent, t0 = 0.0, time.perf_counter()
            buf.add(obs=pad[i:i + 4], next_obs=pad[i + 1:i + 5], action=t % 6, reward=float(i % 3 == 0),
                    terminated=i == last, truncated=False)
            t += 1
            if t == steps:
                break
        spent += time.perf_counter() - t0
    return (steps - warm) / spent


def frame_bytes(buf) -> float | None:
    """Mean compressed bytes of the frames the live transitions use (None: raw)."""
    fs = buf._frames  # (a bench's look inside: no public call gives a frame's compressed size)
    if fs.log is None:
        return None
    live = np.flatnonzero(buf.status == 1)
    if not live.size:
        return None
    ids = np.unique(np.concatenate([fs.refs("obs_ref", live).ravel(), fs.refs("next_obs_ref", live).ravel()]))
    return float(fs.log._lengths(ids).mean())


def one(bigper, case: str, capacity: int, compression: str | None, root: Path, reps: int) -> dict:
    path = root / f"{case}-{compression or 'raw'}"
    kw = {"compression": compression} if compression else {}
    make = lambda mode: bigper.PrioritizedReplayBuffer(  # noqa: E731
        capacity, FIELDS, frame_stack=4, storage="memmap", path=path, mode=mode, seed=0, **kw)
    res = {"case": case, "compression": compression, "capacity": capacity}
    buf = make("new")
    try:
        res["add_per_s"] = fill(buf, case, capacity * 3 // 2)
        res["budget"] = buf.config.compression_budget
        res["disk_bytes"] = disk_bytes(path)
        res["disk_per_transition"] = res["disk_bytes"] / capacity
        res["sampleable"] = int((buf.status == 1).sum())
        res["held"] = res["sampleable"] / capacity
        res["frame_bytes"] = frame_bytes(buf)
        res["warm_us"] = float(np.median(rounds(buf, reps)[reps // 10:])) * 1e6
        buf.close()
        why = drop_page_cache()
        buf = make("resume")
        if why:
            res["cold"] = why
        else:
            res["cold_first100_us"] = float(np.median(rounds(buf, 100))) * 1e6
        res["status"] = "ok"
    finally:
        buf.close()
        shutil.rmtree(path, ignore_errors=True)
    return res


def run(capacity: int, cases: tuple[str, ...], root: str | None, reps: int = 1000) -> list[dict]:
    bigper = import_bigper()
    out = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-games-", dir=root))
    try:
        for case in cases:
            for comp in ("zstd", None):
                say(f"[atari --games] {case}, {comp or 'raw'} memmap, capacity {capacity:,} ...")
                try:
                    out.append(one(bigper, case, capacity, comp, tmp, reps))
                except Exception as e:  # noqa: BLE001 (a failing case is reported; the others still run)
                    out.append({"case": case, "compression": comp, "status": "error",
                                "error": f"{type(e).__name__}: {e}"[:200]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(results: list[dict], cap: int) -> None:
    by = {(r["case"], r["compression"]): r for r in results}
    rows = []
    for case in dict.fromkeys(r["case"] for r in results):
        z, p = by.get((case, "zstd"), {}), by.get((case, None), {})
        if z.get("status") != "ok":
            rows.append([case, z.get("error", "?")] + ["-"] * 11)
            continue
        rows.append([case, _f(z["disk_per_transition"], ",.0f"), _f(p.get("disk_per_transition"), ",.0f"),
                     f"{z['sampleable']:,}", f"{z['held']:.1%}", _f(z.get("frame_bytes"), ",.0f"),
                     _f(z.get("budget"), ",d"), _f(z.get("warm_us"), ",.0f"), _f(p.get("warm_us"), ",.0f"),
                     _f(z.get("cold_first100_us"), ",.0f"), _f(p.get("cold_first100_us"), ",.0f"),
                     _f(z.get("add_per_s"), ",.0f"),
                     _f(z["add_per_s"] / p["add_per_s"] if p.get("add_per_s") else None, ".2f")])
    print_table(["case", "disk B/tr", "raw B/tr", "sampleable", "held", "frame B", "log B/frame", "warm us",
                 "raw warm", "cold us", "raw cold", "add/s", "add/raw"], rows)
    games = [by[(g, "zstd")]["disk_per_transition"] for g in GAMES if by.get((g, "zstd"), {}).get("status") == "ok"]
    if games:
        print(f"  median disk bytes a transition over {len(games)} games: {np.median(games):,.0f} "
              f"(raw {np.median([by[(g, None)]['disk_per_transition'] for g in GAMES if (g, None) in by]):,.0f})")
    print(f"  capacity {cap:,}, memmap, compression='zstd' at its defaults; held: sampleable / capacity; "
          "rounds: sample(32) + update, µs median, cold: first 100 after dropping the page cache")


def main(args) -> int:
    cases = tuple(c.strip() for c in args.cases.split(",")) if getattr(args, "cases", None) else GAMES + SYNTHETIC
    unknown = [c for c in cases if c not in GAMES + SYNTHETIC]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}, expected a subset of {list(GAMES + SYNTHETIC)}")
    results = run(args.capacity, cases, args.dir)
    report(results, args.capacity)
    print(json.dumps({"bench": "atari-games", "capacity": args.capacity, "results": results},
                     separators=(",", ":")))
    return 0 if all(r.get("status") == "ok" for r in results) else 1
