"""``python tools/bench.py offline --dqn-replay``: convert a DQN Replay run (issue 43 §1).

A run is written in the dataset's format (each checkpoint a ring of
``--slots`` 84x84 frames recorded as Dopamine records them, ``np.save`` into
gzip files) from real ALE play of several games (random actions, frameskip 4,
grayscale, 84x84 INTER_AREA), then ``bigper convert RUN DST`` runs on it.
Reported: play and write time (not counted), the convert's transitions a
second, its peak RSS (of this process), bytes a transition of the gzip files
and of the converted file, and the frames bigper wrote per transition.
``--scale``: the §4 scale run (``dqn_scale.py``: kill -9 and
resume of the convert and of ``reprioritize``, the sample + update rounds).
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchkit import REPO_ROOT

sys.path.insert(0, REPO_ROOT)  # the checkout's bigper, and tests/offline's DQN Replay writer

GAMES = ("Breakout", "Pong", "Seaquest", "MsPacman")


def run_dqn_replay(root: Path, slots: int, checkpoints: int, workers=None, say=print) -> dict:
    from tests.offline._dqn_replay_files import Recorder, play

    import bigper
    from bigper.convert_dqn import convert_dqn_replay

    run = root / "run"
    t0 = time.perf_counter()
    rec = Recorder(slots)
    logged = 0
    per_game = slots * checkpoints // len(GAMES) + slots
    for g, game in enumerate(GAMES):
        frames, act, rew, ends = play(game, per_game, seed=g)
        for t in range(frames.shape[0]):
            rec.add(frames[t], act[t], rew[t], ends[t] or t == frames.shape[0] - 1)
            if rec.add_count % slots == slots - 1 and logged < checkpoints:
                rec.save(run, logged)
                logged += 1
        if logged == checkpoints:
            break
    made = time.perf_counter() - t0
    say(f"wrote {logged} checkpoints of {slots:,} slots ({', '.join(GAMES)}) in {made:.1f} s")
    src = sum(p.stat().st_size for p in run.iterdir())
    dst = root / "out.h5"
    t0 = time.perf_counter()
    r = convert_dqn_replay(run, dst, progress=False, workers=workers)
    dt = time.perf_counter() - t0
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        fw = ds.state_dict()[0]["frames"]["fw"]
    n = r["transitions"]
    return {"checkpoints": logged, "slots": slots, "transitions": n, "seconds": round(dt, 2),
            "rate": round(n / dt), "src_bytes_per_tr": round(src / n, 1),
            "dst_bytes_per_tr": round(r["dst_bytes"] / n, 1), "frames_per_tr": round(fw / n, 4),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def cmd(args) -> int:
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    if args.scale:
        return cmd_scale(args, base)
    root = Path(tempfile.mkdtemp(prefix="bigper-bench-dqn-", dir=base))
    try:
        rep = run_dqn_replay(root, args.slots, args.checkpoints, args.workers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"converted {rep['transitions']:,} transitions in {rep['seconds']} s: {rep['rate']:,}/s; "
          f"{rep['src_bytes_per_tr']} B/transition gzip -> {rep['dst_bytes_per_tr']} B bigper zstd; "
          f"{rep['frames_per_tr']} frames/transition; peak RSS {rep['peak_rss_mb']} MB")
    print(json.dumps({"bench": "offline-dqn-replay", "results": rep}, separators=(",", ":")))
    return 0


def cmd_scale(args, base: Path) -> int:
    from workloads.offline.dqn_scale import print_scale, run_scale

    n = args.slots * args.checkpoints
    need = n * 700 + args.slots * 200  # the work directory and the HDF5 copy side by side, the source
    free = shutil.disk_usage(base).free
    if free < need:
        print(f"not enough free disk under {base}: {free / 1e9:.1f} GB free, about {need / 1e9:.1f} GB needed")
        return 2
    root = Path(tempfile.mkdtemp(prefix="bigper-bench-dqn-scale-", dir=base))
    t0 = time.perf_counter()
    try:
        rep = run_scale(root, args.slots, args.checkpoints, distinct=args.distinct, pool=args.pool,
                        level=args.gzip_level, sample=args.sample, check_all=args.check_all,
                        reuse=Path(args.run).resolve() if args.run else None, games=args.games,
                        warm_rounds=args.warm_rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rep["wall_s"] = round(time.perf_counter() - t0)
    print_scale(rep)
    print(json.dumps({"bench": "offline-dqn-replay-scale", "results": rep}, separators=(",", ":")))
    return 0
