"""The ``bigper`` command line."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def _bench(args) -> int:
    script = Path(__file__).resolve().parent.parent / "tools" / "bench.py"
    if not script.exists():
        print("bigper bench runs tools/bench.py from a source checkout; it was not found at "
              f"{script}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *(args.rest or ["tree"])]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _reprioritize(args) -> int:
    import time

    from . import offline

    try:
        score_fn = offline.load_score_fn(args.score)
        buf = offline.from_hdf5(args.dataset, priorities=args.priorities, layout=args.layout)
    except (OSError, ImportError, ValueError, TypeError, AttributeError) as e:
        print(f"bigper reprioritize: {e}", file=sys.stderr)
        return 2
    with buf:
        t0 = time.perf_counter()
        offline.reprioritize(buf, score_fn, batch_size=args.batch_size, progress=not args.no_progress,
                             restart=args.restart)
        dt = time.perf_counter() - t0
        n = int((buf._status == 1).sum())
        print(f"scored {n:,} transitions of {args.dataset} in {dt:.1f} s ({n / max(dt, 1e-9):,.0f}/s); "
              f"priorities in {buf._store.sidecar.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigper", description="Prioritized replay on disk.")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmark bigper against cpprb, Tianshou and TorchRL "
                                     "(tools/bench.py; default workload: tree)")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="workload and options for tools/bench.py")
    b.set_defaults(func=_bench)
    r = sub.add_parser("reprioritize", help="score every transition of an HDF5 dataset (D4RL, Minari, "
                                            "bigper) in place; priorities go to a sidecar beside it")
    r.add_argument("dataset", help="HDF5 file, or a Minari dataset directory")
    r.add_argument("--score", required=True, metavar="MODULE:FUNCTION",
                   help="score_fn(batch) -> (B,) scores >= 0, as package.module:function or file.py:function")
    r.add_argument("--batch-size", type=int, default=4096, help="transitions per score_fn call (4096)")
    r.add_argument("--priorities", help="sidecar directory (default: <dataset>.priorities)")
    r.add_argument("--layout", default="auto", choices=("auto", "d4rl", "minari", "bigper"))
    r.add_argument("--restart", action="store_true", help="start over instead of resuming an interrupted run")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_reprioritize)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
