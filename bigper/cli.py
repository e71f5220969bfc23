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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigper", description="Prioritized replay on disk.")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="benchmark bigper against cpprb, Tianshou and TorchRL "
                                     "(tools/bench.py; default workload: tree)")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="workload and options for tools/bench.py")
    b.set_defaults(func=_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
