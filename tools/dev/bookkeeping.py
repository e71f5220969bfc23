"""Bytes a transition, array by array (issue 43, section 2): what a compressed
Atari buffer stores besides the user's fields and the compressed frames.

    python tools/dev/bookkeeping.py [--capacity 20000] [--game MsPacman] [--json]

Builds a buffer of ``--capacity`` one-step transitions at the defaults
(``frame_stack=4``, ``compression="zstd"``, fields ``action`` int64 and
``reward`` float32) on memmap storage and on hdf5 storage, fills each with
``capacity * 3 // 2`` steps of real ALE play (``workloads/atari/scale.py`` ``episodes``:
episodes of random length from random starts, shifted so none repeats),
closes it, and saves a snapshot of it. Each of the four (two live storages,
two snapshots) is measured array by array:

- memmap and snapshots: the blocks each file holds (``st_blocks * 512``),
  the files of one array (its chunks, ``frame_log.000001.bin`` ...) summed;
- hdf5: each dataset's storage size (``get_storage_size``), and the rest of
  the file (HDF5's own metadata) as ``(hdf5 overhead)``.

Each array is put in one part: ``user`` (the fields), ``frames`` (the
compressed log: ``frame_log``) or ``bigper`` (everything else: the frame
index and references, the ring's, the tree's and the frame store's state,
the records). Prints one table a storage (B/tr = bytes over the capacity)
and, last, one JSON line ``{"bench": "bookkeeping", ...}``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # tools/: the bench helpers

FIELDS = {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
USER = ("action", "reward")
FRAMES = ("frame_log", "frames")


def part(name: str) -> str:
    """``user``, ``frames`` or ``bigper``: whose bytes an array holds."""
    base = name.split("/")[-1]
    if base in USER:
        return "user"
    return "frames" if base in FRAMES else "bigper"


def files_by_array(root: Path) -> dict:
    """Blocks of every file under ``root``, by array (chunks of one array summed)."""
    out: dict[str, int] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        name = re.sub(r"\.\d{6}\.bin$|\.bin$|\.npy$", "", rel)
        name = name.split("/")[-1] if "/" in name else name
        out[name] = out.get(name, 0) + p.stat().st_blocks * 512
    return out


def hdf5_by_array(path: Path) -> dict:
    """Storage size of every dataset of the file at ``path``, and the rest of the file."""
    import h5py

    out: dict[str, int] = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name.split("/")[-1]] = int(obj.id.get_storage_size())
        f.visititems(visit)
    out["(hdf5 overhead)"] = max(0, path.stat().st_blocks * 512 - sum(out.values()))
    return out


def build(bigper, storage: str, capacity: int, game: str, root: Path) -> tuple[Path, Path]:
    """A filled, closed buffer of ``storage`` at ``root/storage`` and its snapshot; their paths."""
    from workloads.atari.games import fill

    live, snap = root / storage, root / f"snap-{storage}"
    buf = bigper.PrioritizedReplayBuffer(capacity, FIELDS, frame_stack=4, storage=storage, path=live,
                                         compression="zstd", seed=0)
    try:
        fill(buf, game, capacity * 3 // 2)
        buf.save(snap)
    finally:
        buf.close()
    return live, snap


def table(title: str, sizes: dict, capacity: int) -> dict:
    """Print the arrays of one storage, biggest first, and the sum of each part; returns the sums."""
    from benchkit import print_table

    rows = [[name, part(name), f"{b / capacity:.2f}"] for name, b in sorted(sizes.items(), key=lambda x: -x[1])]
    sums = {p: sum(b for n, b in sizes.items() if part(n) == p) / capacity for p in ("user", "frames", "bigper")}
    rows += [[f"= {p}", "", f"{v:.2f}"] for p, v in sums.items()]
    print(f"\n{title} (capacity {capacity:,}): bytes a transition")
    print_table(["array", "part", "B/tr"], rows)
    return sums


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--game", default="MsPacman")
    ap.add_argument("--dir", default=None, help="where the buffers are made (a temporary folder in it)")
    a = ap.parse_args(argv)
    from benchkit import import_bigper

    bigper = import_bigper()
    tmp = Path(tempfile.mkdtemp(prefix="bookkeeping-", dir=a.dir))
    result = {"bench": "bookkeeping", "capacity": a.capacity, "game": a.game}
    try:
        for storage in ("memmap", "hdf5"):
            live, snap = build(bigper, storage, a.capacity, a.game, tmp)
            sizes = files_by_array(live) if storage == "memmap" else hdf5_by_array(live)
            result[storage] = {"parts": table(f"{storage}, closed", sizes, a.capacity), "arrays": sizes}
            ss = files_by_array(snap)
            result[f"snapshot-{storage}"] = {"parts": table(f"snapshot of {storage}", ss, a.capacity),
                                             "arrays": ss}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
