"""Side-by-side benchmarks of bigper against other replay buffers: the command line.

Every workload runs bigper and the installed peers (cpprb, Tianshou, TorchRL)
on the same data and reports times plus ratios ``peer time / bigper time``.
Absolute numbers move with the machine and its load; ratios taken in the same
run are what the targets (docs/benchmarks.md) use.

Usage::

    python tools/bench.py WORKLOAD [options]      # python tools/bench.py WORKLOAD --help
    python tools/bench.py tree [--quick] [--libs bigper,cpprb]

Each workload prints a table and, last, one JSON line with every number
(``{"bench": "<workload>", ...}``). A peer that is not installed is reported as
such; a library that fails (bigper while it is being written, say) is reported
with its error and the others still run.

Layout: this file only parses the command line and dispatches. Each workload
is a package of its own, ``tools/workloads/<workload>/``: its ``main.py``
(``add_arguments(parser)``, and either ``func`` set on the parser's defaults
or ``main(args) -> int``) is imported only when it runs; the package's other
modules are its helpers and the scripts it starts by path in child processes
(``atari/child.py``, ``torchrl/side.py``). tools/ is the import root
(``import benchkit``, ``from workloads.atari.data import Stream``); the shared
helpers (versions, timing, tables) are in ``tools/benchkit.py``. A workload
may use another's module (learner and torchrl take atari's data, torchrl runs
sequences' sides), never this file. To add a workload, write its package and
add a line to ``WORKLOADS``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))

# workload -> (its module: tools/workloads/<workload>/main.py, one line of help)
WORKLOADS: dict[str, tuple[str, str]] = {
    "offline": ("workloads.offline.main",
                "HDF5 datasets in place: reprioritize vs h5py streaming, sample(256) vs memmap"),
    "tree": ("workloads.tree.main",
             "capacity 2^20: sample + IS weights + priority update, batch 32 and 256"),
    "storage": ("workloads.storage.main",
                "memory vs memmap vs HDF5 on Atari-shaped data: fill, bytes, rounds"),
    "atari": ("workloads.atari.main",
              "Atari-shaped replay, one process per library: add, sample+update, bytes; --compression zstd "
              "[--games|--adds]: compressed frames at scale, or game by game, or compressed adds against raw"),
    "snapshot": ("workloads.snapshot.main",
                 "memmap snapshots of 100k (--million: 1M) Atari frames: first and second snapshot, load with "
                 "verification, each beside its baseline"),
    "ray": ("workloads.ray.main",
            "sharded buffer on a local Ray cluster: inserts/s from 2 writer actors and samples/s at the "
            "learner for 1, 2, 4 shards, beside one local buffer"),
    "sb3": ("workloads.sb3.main",
            "the Stable-Baselines3 drop-in beside SB3's own replay buffer"),
    "learner": ("workloads.learner.main",
                "a Nature-CNN DQN learner fed by each feed (ceiling, numpy, sample, sampler, device tier, "
                "zstd), B 32 and 256, as a share of its ceiling; sequences to the device"),
    "codecs": ("workloads.codecs.main",
               "which codec for compressed frames: zstd (bigper's numba kernel), lz4, blosc2 and the zstandard "
               "package on real ALE frames: ratio, one frame, a batch of 160"),
    "torchrl": ("workloads.torchrl.main",
                "bigper's TorchRL drop-in beside TorchRL's TensorDictPrioritizedReplayBuffer + "
                "LazyMemmapStorage: sample + update, learner share, bytes, resume after kill -9"),
    "sequences": ("workloads.sequences.main",
                  "prioritized sequences (R2D2: 32 x 40+80 steps) on Atari-shaped steps: add with/without, "
                  "sample + update, bytes; flashbax, TorchRL"),
}


class WorkloadMissing(Exception):
    """The workload's module is not in tools/ (a checkout without it, or one being written)."""


def module_path(module: str) -> str:
    """The file of ``module`` (``workloads.tree.main``) under tools/."""
    return os.path.join(TOOLS_DIR, *module.split(".")) + ".py"


def load_workload(name: str):
    """Import the module of workload ``name`` from tools/.

    Raises
    ------
    WorkloadMissing
        When ``tools/workloads/<name>/main.py`` (or its package) is not there.
        Any other ImportError (a dependency the module needs) propagates: that
        is the module's error.
    """
    module = WORKLOADS[name][0]
    if TOOLS_DIR not in sys.path:  # `bigper bench` runs this file through runpy
        sys.path.insert(0, TOOLS_DIR)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not exc.name or not (module == exc.name or module.startswith(exc.name + ".")):
            raise
        raise WorkloadMissing(f"bench {name}: its module {module_path(module)} is not there") from exc


def _chosen(argv: list[str]) -> str | None:
    """The workload named on the command line (the first word that is one), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in WORKLOADS else None
    return None


def build_parser(workload: str | None = None) -> argparse.ArgumentParser:
    """The parser: a subcommand per workload; only ``workload``'s module is imported
    (for its options), so ``--help`` and one workload need no other bench."""
    parser = argparse.ArgumentParser(
        prog="bench", description="bigper side by side with cpprb, Tianshou and TorchRL; prints ratios."
    )
    sub = parser.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    for name, (_, help_) in WORKLOADS.items():
        p = sub.add_parser(name, help=help_)
        if name == workload:
            mod = load_workload(name)
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p)
            if not hasattr(mod, "main") and p.get_default("func") is None:
                raise WorkloadMissing(f"bench {name}: {mod.__file__} has neither main(args) nor a func default")
            p.set_defaults(module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(_chosen(argv)).parse_args(argv)
    except WorkloadMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    func = getattr(args, "func", None) or args.module.main
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
