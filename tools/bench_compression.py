"""Compressed frames game by game: an alias of
``python tools/bench.py atari --compression zstd --games`` (tools/bench_atari_games.py).

    python tools/bench_compression.py [--capacity 20000] [--cases Pong,noise] [--dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_atari_games  # noqa: E402
from benchkit import print_header  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--cases", help="a comma-separated subset of the games, noise and half")
    ap.add_argument("--dir", help="where the buffers go (a temporary directory under it)")
    args = ap.parse_args()
    print_header("atari --compression zstd --games")
    return bench_atari_games.main(args)


if __name__ == "__main__":
    sys.exit(main())
