"""The ``bigper`` command line."""

from __future__ import annotations

import argparse
import errno
import json
import os
import runpy
import stat
import sys
from pathlib import Path

import numpy as np

from ..common.status import LIVE


def _bench(args) -> int:
    """tools/bench.py with every argument after ``bench`` (``--help`` included: its help
    lists the workloads, which live in tools/, not in the package)."""
    script = Path(__file__).resolve().parents[2] / "tools" / "bench.py"
    if not script.exists():
        print("bigper bench runs tools/bench.py from a source checkout; it was not found at "
              f"{script}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *(args.rest or ["tree"])]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _line(e: BaseException) -> str:
    """An error as one line (its message names the path)."""
    from ..common.files import real_names

    return " ".join(str(real_names(e)).split("\n")) or type(e).__name__


def _score_fn(spec: str):
    """``offline.load_score_fn``, with a path that is no Python file said so
    (``random.bin:f`` would otherwise be imported as the module ``random``)."""
    from ..offline import datasets as offline
    from ..errors import InvalidArgumentError

    mod = str(spec).partition(":")[0]
    if "/" in mod and not mod.endswith(".py"):
        raise InvalidArgumentError(f"--score {mod}: a file must be a .py file (package.module:function "
                                   "or path/to/file.py:function)")
    try:
        return offline.load_score_fn(spec)
    except SyntaxError as e:  # a file of random bytes is not Python; say which
        raise InvalidArgumentError(f"--score {mod} is not a Python file ({e.msg}, line {e.lineno})") from None


def _reprioritize(args) -> int:
    import time

    from ..buffer import PrioritizedReplayBuffer
    from ..errors import BigperError

    try:
        score_fn = _score_fn(args.score)
        buf = PrioritizedReplayBuffer.from_hdf5(args.dataset, priorities=args.priorities, layout=args.layout,
                                                allow_external=args.allow_external)
    except (OSError, ImportError, ValueError, TypeError, AttributeError, BigperError) as e:
        print(f"bigper reprioritize: {_line(e)}", file=sys.stderr)
        return 2
    with buf:
        t0 = time.perf_counter()
        try:
            buf.reprioritize(score_fn, batch_size=args.batch_size, progress=not args.no_progress,
                             restart=args.restart)
        except (ValueError, TypeError, KeyboardInterrupt) as e:
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else str(e)
            part = (buf.storage.sidecar.meta or {}).get("partial")
            if part:
                why += (f"\n{part['done']:,} transitions scored so far are kept in {buf.storage.sidecar.path}: "
                        "the same command resumes after them (--restart starts over)")
            print(f"bigper reprioritize: {why}", file=sys.stderr)
            return 130 if isinstance(e, KeyboardInterrupt) else 1
        dt = time.perf_counter() - t0
        n = int((buf.status == LIVE).sum())
        print(f"scored {n:,} transitions of {args.dataset} in {dt:.1f} s ({n / max(dt, 1e-9):,.0f}/s); "
              f"priorities in {buf.storage.sidecar.path}")
    return 0


def _convert(args) -> int:
    from ..convert import convert
    from ..offline.dqn_replay import is_dqn_replay

    if args.layout == "dqn-replay" or (args.layout == "auto" and is_dqn_replay(args.src)):
        return _convert_dqn(args)
    for flag, given in (("--workers", args.workers is not None), ("--restart", args.restart)):
        if given:
            print(f"bigper convert: {flag} is for a DQN Replay run directory (--layout dqn-replay)", file=sys.stderr)
            return 2
    r = convert(args.src, args.dst, frame_stack=args.frame_stack, budget=args.budget, overwrite=args.overwrite,
                progress=not args.no_progress, layout=args.layout, allow_external=args.allow_external)
    ratio = r["src_bytes"] / max(r["dst_bytes"], 1)
    print(f"converted {r['transitions']:,} transitions of {args.src} (frame_stack={r['frame_stack']}, zstd) "
          f"into {r['dst']}: {r['src_bytes'] / 1e6:,.1f} MB -> {r['dst_bytes'] / 1e6:,.1f} MB ({ratio:.1f}x)"
          + (f"; {r['skipped']:,} transitions not sampleable in the source were left out" if r["skipped"] else ""))
    return 0


def _convert_dqn(args) -> int:
    import time

    from ..convert_dqn import convert_dqn_replay

    if args.budget is not None or args.allow_external:
        print("bigper convert: --budget and --allow-external are for HDF5 sources, not a DQN Replay run",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    r = convert_dqn_replay(args.src, args.dst, frame_stack=4 if args.frame_stack is None else args.frame_stack,
                           overwrite=args.overwrite, progress=not args.no_progress, workers=args.workers,
                           restart=args.restart)
    dt = time.perf_counter() - t0
    ratio = r["src_bytes"] / max(r["dst_bytes"], 1)
    print(f"converted {r['transitions']:,} transitions of {r['checkpoints']} DQN Replay checkpoints in {args.src} "
          f"(frame_stack={r['frame_stack']}, zstd) into {r['dst']} in {dt:.1f} s "
          f"({r['transitions'] / max(dt, 1e-9):,.0f}/s"
          + (f", resumed after {r['resumed_after']} checkpoints" if r["resumed_after"] else "")
          + f"): {r['src_bytes'] / 1e6:,.1f} MB of gzip files -> {r['dst_bytes'] / 1e6:,.1f} MB ({ratio:.1f}x)")
    return 0


def _print_json(obj) -> None:
    import json

    print(json.dumps(obj, indent=1, sort_keys=True, default=str))


def _info_snapshot(path: Path, args) -> int:
    from ..snapshot import describe
    from ..snapshot.inspect import format_description

    d = describe(path)
    _print_json(d) if args.json else print(format_description(d) + _device_line(d.get("config")))
    return 0


def _device_line(cfg) -> str:
    """``bigper info``'s line on the device memory a tier of this config takes ("" if it cannot say)."""
    from ..config import Config
    from ..device.mirror import describe_need

    try:
        return "\n  " + describe_need(Config.from_dict(cfg))
    except Exception:  # noqa: BLE001 (a record this bigper cannot build: nothing to add)
        return ""


def _info_series(path: Path, args) -> int:
    from ..snapshots import Snapshots

    snaps = Snapshots.__new__(Snapshots)  # look only: no cleanup, no directory created
    snaps.root, snaps.keep = path.resolve(), None
    found = snaps.list()
    latest = snaps.latest()
    if args.json:
        _print_json({"root": str(path), "snapshots": [str(p) for p in found], "latest": str(latest)})
        return 0
    print(f"{path}: {len(found)} snapshot(s); latest intact: {latest.name if latest else None}")
    for p in found:
        print(f"  {p.name}")
    return _info_snapshot(latest, args) if latest else 0


def _info_storage(path: Path, args) -> int:
    from ..common.files import read_json

    meta = read_json(path / "meta.json")  # a regular file only: never hangs on a FIFO
    if not isinstance(meta, dict):
        print(f"bigper info: {path}/meta.json is not a bigper storage record", file=sys.stderr)
        return 1
    from ..storage.state import check_arrays

    # (on a copy: check_arrays fills in what an older record leaves out, and --json prints the file's record)
    check_arrays(json.loads(json.dumps(meta.get("arrays", {}))), path)  # CorruptSnapshotError: crafted
    c = _check_live_record(meta, path)
    if args.json:
        _print_json({k: v for k, v in meta.items() if k != "state"})
        return 0
    state = meta.get("state") or {}
    cap = c.capacity
    n = min(state.get("count", 0), cap)
    # Only regular files count: a dangling symlink or a FIFO in data/ is named, never followed.
    size, stray = 0, []
    if (path / "data").is_dir() and not (path / "data").is_symlink():
        for p in sorted((path / "data").iterdir()):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
            else:
                stray.append(p.name)
    print(f"{path}: a live {meta.get('format')} storage, version {meta.get('version')}, "
          f"{'closed cleanly' if meta.get('clean') else 'OPEN or its writer died (resume from a snapshot)'}")
    print(f"  capacity {cap:,}; {n:,} transitions at the last close{_sampleable(path, cap, n)}; "
          f"{size / 1e6:,.1f} MB of data; {c.prioritization} prioritization")
    if c.compression is not None:
        print(f"  compression {c.compression}: {_ratio(c, state)}")
    for name, a in meta.get("arrays", {}).items():
        print(f"  {name}: {a['rows']:,} x {tuple(a['shape'])} {a['dtype']}")
    if "obs_ref" in meta.get("arrays", {}) and "frame_ref" not in meta.get("arrays", {}):
        print("  its frame references are an older bigper's (obs_ref / next_obs_ref, whole int64 ids): read "
              "converted in memory; a writer's next resume converts them on disk (frame_ref + frame_off)")
    line = _device_line(meta["config"])
    if line:
        print(line.lstrip("\n"))
    if stray:
        print(f"  data/ also holds {len(stray)} entr{'y' if len(stray) == 1 else 'ies'} that bigper does not "
              f"read (not regular files): {', '.join(ascii(n) for n in stray[:5])}")
    return 0


def _check_live_record(meta: dict, path: Path):
    """What ``bigper info`` prints of a live memmap storage's record, checked
    as a resume checks it (its writer may have died: an unclean record is
    described, not refused): the format and version, the record's fields and
    the config; returns the config. A crafted record is refused naming the
    field; nothing of it is printed (a value could carry a newline or a
    terminal escape)."""
    from ..config import Config
    from ..core.layout import plain_fields
    from ..errors import BigperError, CorruptSnapshotError
    from ..storage.memmap import FORMAT, VERSION
    from ..storage.state import check_meta

    check_meta(meta, FORMAT, VERSION, path, unclean_ok=True)
    try:
        cfg = Config.from_dict(meta.get("config"))
    except BigperError as e:
        raise CorruptSnapshotError(f"{path}/meta.json: its config is not one this bigper builds: {e}") from None
    if cfg.storage != "memmap":
        raise CorruptSnapshotError(f"{path}/meta.json: a memmap storage's config says storage={cfg.storage!r}")
    state = meta.get("state")
    if isinstance(state, dict):  # (null: closed before anything was recorded)
        if "count" not in state:  # (check_record checked it where present)
            raise CorruptSnapshotError(f"{path}/meta.json: its state records no transition count")
        fm = state.get("frames")
        if fm is not None:  # what the compression line reads: counters, each an int in [0, 2**62)
            bad = [k for k in ("fw", "seg", "pos", "seg_lo") if isinstance(fm, dict) and k in fm
                   and not (isinstance(fm[k], int) and not isinstance(fm[k], bool) and 0 <= fm[k] < 1 << 62)]
            # (``_ratio`` reads them as checked here)
            if not isinstance(fm, dict):
                raise CorruptSnapshotError(f"{path}/meta.json: state frames must be an object, got a "
                                           f"{type(fm).__name__}")
            if bad:
                raise CorruptSnapshotError(f"{path}/meta.json: state frames {bad[0]} must be an int in [0, 2**62), "
                                           f"got {str(fm[bad[0]])[:80]!r}")
    # The arrays the config lays out: each field's as the config says it (a row a slot); the frame
    # store's by name only (their layouts vary with bigper's version: the resume converts or refuses;
    # nothing here is sized from the record: a crafted capacity must not allocate).
    arrays = meta.get("arrays", {})
    fields = plain_fields(cfg)
    known = set(fields)
    if cfg.frame_stack:
        known |= {"frame_ref", "frame_off", "obs_ref", "next_obs_ref"}
        known |= {"frame_log", "frame_index"} if cfg.compression is not None else {"frames"}
    extra = sorted(set(arrays) - known)
    if extra:
        raise CorruptSnapshotError(f"{path}/meta.json: arrays {extra[0]!r} is none a buffer of its config keeps")
    for name, (shape, dtype) in fields.items():
        rows = cfg.capacity
        rec = arrays.get(name)
        have = None if rec is None else (rec["rows"], tuple(rec["shape"]), np.dtype(rec["dtype"]))
        if have is not None and have[1:] == (tuple(shape), np.dtype(dtype)) and have[0] != rows:
            raise CorruptSnapshotError(f"{path}/meta.json: config capacity {cfg.capacity:,} but arrays {name!r} "
                                       f"holds {have[0]:,} rows")
        if have != (rows, tuple(shape), np.dtype(dtype)):
            raise CorruptSnapshotError(
                f"{path}/meta.json: arrays {name!r} is {'missing' if have is None else have}, but its config "
                f"keeps it as {(rows, tuple(shape), np.dtype(dtype))}")
    return cfg


def _sampleable(path: Path, cap: int, n: int) -> str:
    """``", N sampleable"`` from the status recorded at the last close (a
    compressed log capped by its budget may hold fewer than the ring); empty
    when there is none or it cannot be read."""
    from ..storage.state import load_state_dir

    try:
        status = load_state_dir(path / "state", ["status"]).get("status")
    except Exception:  # noqa: BLE001 (info reports what it can read)
        return ""
    if not isinstance(status, np.ndarray) or status.shape != (cap,) or status.dtype.kind not in "iub":
        return ""
    live = int((status == LIVE).sum())
    if live > n:  # (a status file that disagrees with the record: said, not counted)
        return f"; its status file marks {live:,} slots live, more than that: damaged"
    return f", {live:,} of them sampleable"


def _ratio(c, state: dict) -> str:
    """The compression ratio of the frames written so far (raw bytes over the
    log bytes they took, segment tails included), from a recorded state
    whose config ``c`` and frame counters ``_check_live_record`` checked."""
    from ..frames.store import frame_capacity
    from ..frames.segments import log_geometry

    try:
        fm = state.get("frames") or {}
        row = int(np.prod(c.shape("obs")[1:])) * c.dtype("obs").itemsize
        _, seg, S = log_geometry(frame_capacity(c.capacity, c.frame_stack, c.num_envs), row, c.compression_budget)
        fw, g, pos = (fm[k] for k in ("fw", "seg", "pos"))
        lo = fm.get("seg_lo", max(0, g - S + 1))
        if lo > g or pos > seg:
            raise ValueError("counters out of order")
        used = g * seg + pos
        held = (g - lo) * seg + pos
    except Exception as e:  # noqa: BLE001 (a record this bigper cannot read: said, not raised)
        return f"ratio unknown ({type(e).__name__})"
    ratio = f"{fw * row / used:.1f}x" if used > 0 else "no frames yet"
    size = (f"a log that grows as its frames need, by segments of {seg:,} bytes ({S} at most), "
            f"now spanning {held:,} bytes" if c.compression_budget is None else
            f"a log capped at {c.compression_budget} bytes a frame by compression_budget ({S} segments of "
            f"{seg:,} bytes; frames that compress to more cost capacity)")
    return f"{size}; frames written so far compress {ratio}"


def _info(args) -> int:
    """Dispatch on what PATH is; anything that is not a snapshot or a storage
    goes to ``bigper.offline.datasets.describe`` (HDF5 and Minari datasets)."""
    from ..errors import BigperError

    path = Path(args.path)
    if not path.exists():
        print(f"bigper info: {_missing(path)}", file=sys.stderr)
        return 2
    try:
        if (path / "manifest.json").is_file():
            return _info_snapshot(path, args)
        if path.is_dir() and any(p.name.startswith("snap-") for p in path.iterdir()):
            return _info_series(path, args)
        if (path / "meta.json").is_file():
            return _info_storage(path, args)
    except BigperError as e:
        print(f"bigper info: {e}", file=sys.stderr)
        return 1
    if path.is_dir() and not (path / "data" / "main_data.hdf5").exists():
        # A folder that is no Minari dataset either (a run folder, a folder of checkpoints):
        # say what it is not and what below it info reads, not what a Minari folder would hold.
        from .paths import not_what_it_reads

        text, named = not_what_it_reads(path, "info")
        print(text, file=sys.stdout if named else sys.stderr)
        return 0 if named else 2
    try:
        from ..offline.datasets import describe
    except ImportError:
        describe = None
    if describe is None:
        print(f"bigper info: {path} is not a snapshot, a Snapshots root or a storage directory",
              file=sys.stderr)
        return 2
    try:
        out = describe(path)
    except Exception as e:  # a file that is no dataset either: say so, no traceback
        print(f"bigper info: {path}: {e}", file=sys.stderr)
        return 2
    _print_json(out) if args.json and not isinstance(out, str) else print(out)
    return 0


def _missing(path: Path) -> str:
    """Why ``path.exists()`` is False, in words."""
    if not os.path.lexists(path):
        return f"{path} does not exist"
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{path} is a symbolic link loop"
        if e.errno == errno.ENOENT:
            return f"{path} is a dangling symbolic link (to {os.readlink(path)})"
        return f"{path} cannot be read ({e.strerror})"
    return f"{path} cannot be read"


# Exit codes of `bigper verify` (also in its --help).
VERIFY_OK, VERIFY_BAD, VERIFY_MISSING, VERIFY_IN_USE = 0, 1, 2, 3


def _verify_storage(path: Path, verdict) -> int:
    """Print a live storage's verdict (``snapshot.live``); its exit code."""
    from ..snapshot.live import IN_USE, OK

    print(f"{verdict.status:<7}  {path}: {verdict.text}")
    for line in verdict.more:
        print(f"         {line}")
    return VERIFY_OK if verdict.status == OK else VERIFY_IN_USE if verdict.status == IN_USE else VERIFY_BAD


def _verify(args) -> int:
    path = Path(args.path)
    if not path.exists():
        print(f"MISSING  {path}: {_missing(path)}")
        return VERIFY_MISSING
    from ..snapshot.live import verify_live

    verdict = verify_live(path)
    if verdict is not None:
        return _verify_storage(path, verdict)
    if path.suffix == ".pkl" and path.is_file():
        return _verify_pickle(path)
    if not path.is_dir():  # a FIFO, a device, a file that is no bigper storage: nothing to verify
        what = "a regular file" if path.is_file() else "not a regular file or directory"
        print(f"bigper verify: {path} is {what}, not a snapshot directory, a Snapshots root, a bigper "
              "storage or an SB3 replay-buffer pickle", file=sys.stderr)
        return VERIFY_MISSING
    if not (path / "manifest.json").exists() and any(p.name.startswith("snap-") for p in path.iterdir()):
        targets = sorted(p for p in path.iterdir() if p.name.startswith("snap-"))
    elif not os.path.lexists(path / "manifest.json") and not any(
            os.path.lexists(path / member) for member in ("data", "state")):
        # Nothing of a snapshot in it (a run folder, an empty folder, a folder of checkpoints):
        # not a snapshot, exit 2; a folder with a snapshot's members but no manifest stays CORRUPT.
        from .paths import not_what_it_reads

        print(f"bigper verify: {not_what_it_reads(path, 'verify')[0]}", file=sys.stderr)
        return VERIFY_MISSING
    else:
        targets = [path]
    return _verify_snapshots(targets)


def _verify_pickle(path: Path) -> int:
    """An SB3 replay-buffer pickle: the snapshot it names, verified (read
    from its opcodes, never unpickled)."""
    from .paths import pickle_snapshot
    from ..errors import CorruptSnapshotError, IncompatibleSnapshotError, InvalidArgumentError, PathNotFoundError

    try:
        snap = pickle_snapshot(path)
    except (IncompatibleSnapshotError, InvalidArgumentError) as e:
        print(f"bigper verify: {_line(e)}", file=sys.stderr)
        return VERIFY_MISSING
    except PathNotFoundError as e:
        print(f"MISSING  {path}: {_line(e)}")
        return VERIFY_MISSING
    except CorruptSnapshotError as e:
        print(f"CORRUPT  {path}: {_line(e)}")
        return VERIFY_BAD
    print(f"pickle   {path}: an SB3 replay-buffer pickle; its snapshot is {snap}")
    return _verify_snapshots([snap])


def _verify_snapshots(targets: list) -> int:
    from ..errors import CorruptSnapshotError, IncompatibleSnapshotError
    from ..snapshot import verify

    bad = 0
    for t in targets:
        try:
            rep = verify(t)
        except FileNotFoundError as e:
            print(f"MISSING  {t}: {e}")
            bad += 1
            continue
        except CorruptSnapshotError as e:
            print(f"CORRUPT  {t}: {e}")
            bad += 1
            continue
        except IncompatibleSnapshotError as e:
            print(f"INCOMPATIBLE  {t}: {e}")
            bad += 1
            continue
        if rep["problems"]:
            bad += 1
            print(f"INVALID  {t}: files intact, but the bookkeeping is inconsistent:")
            for p in rep["problems"]:
                print(f"  - {p}")
        else:
            what = "rank heap" if rep.get("prioritization") == "rank" else "tree"
            frames = rep.get("frames_checked")
            print(f"OK       {t}: {rep['files']} files, {rep['bytes']:,} bytes checked; {what} and "
                  "bookkeeping consistent"
                  + (f"; {frames:,} compressed frames decompressed and checked" if frames is not None else ""))
    return VERIFY_BAD if bad else VERIFY_OK


def _demo(args) -> int:
    from ..demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = argparse.ArgumentParser(prog="bigper", description="Prioritized replay on disk.")
    p.add_argument("--version", action="version", version=f"bigper {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    from ..demo import add_arguments as demo_arguments

    d = sub.add_parser("demo", help="the main job: Pong fills a 1M-capacity memmap buffer beside a "
                                    "learner loop; snapshot, restore, verify; prints what it measured")
    demo_arguments(d)
    d.set_defaults(func=_demo)
    b = sub.add_parser("bench", help="benchmark bigper against cpprb, Tianshou and TorchRL "
                                     "(tools/bench.py; default workload: tree; bench --help lists the "
                                     "workloads)", add_help=False)
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
    r.add_argument("--allow-external", action="store_true",
                   help="read datasets whose data lives in other files (HDF5 external storage, external "
                        "links, virtual datasets); refused by default: a crafted file could expose other files")
    r.set_defaults(func=_reprioritize)
    c = sub.add_parser("convert", help="write a compressed (zstd) bigper HDF5 dataset from an uncompressed "
                                       "one (D4RL, Minari, bigper) or a DQN Replay run directory (Dopamine's "
                                       "replay checkpoints); the source is never written")
    c.add_argument("src", help="HDF5 file, a Minari dataset directory, or a DQN Replay run directory "
                               "($store$_observation_ckpt.N.gz and companions)")
    c.add_argument("dst", help="the new file (written as DST.partial, renamed into place when complete)")
    c.add_argument("--frame-stack", type=int, metavar="K",
                   help="frames per obs stack (default: axis 0 of (K, H, W) obs, or what a bigper file recorded)")
    c.add_argument("--budget", type=int, metavar="BYTES",
                   help="compression_budget: a cap of log bytes a frame (default: none, the log grows as frames need)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing file at DST")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--layout", default="auto", choices=("auto", "d4rl", "minari", "bigper", "dqn-replay"))
    c.add_argument("--allow-external", action="store_true",
                   help="read source datasets whose data lives in other files (refused by default)")
    c.add_argument("--workers", type=int, metavar="N",
                   help="DQN Replay: threads that decompress checkpoints (default: one per core)")
    c.add_argument("--restart", action="store_true",
                   help="DQN Replay: discard an interrupted convert's work at DST.partial.d of another run "
                        "or options (the same run and options resume after the last finished checkpoint)")
    c.set_defaults(func=_convert)
    i = sub.add_parser("info", help="config, size, fill and priorities of a snapshot, a Snapshots "
                                    "root, a storage directory or a dataset")
    i.add_argument("path", help="a snapshot directory, a Snapshots root, a memmap storage directory, "
                                "or an HDF5 dataset / Minari dataset directory")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_info)
    v = sub.add_parser("verify", help="check every file of a snapshot (or of each snapshot under a "
                                      "Snapshots root) against its checksum, and the tree's invariants",
                       description="Check a snapshot, every snapshot under a Snapshots root, a closed "
                                   "storage, or the snapshot an SB3 replay-buffer pickle names, read-only "
                                   "(the pickle is never unpickled).",
                       epilog="exit status: 0 all OK; 1 corrupt, invalid, incompatible or unclean; "
                              "2 path missing, or not a snapshot or storage; 3 a live buffer holds the "
                              "storage (its PID is printed; save a snapshot and verify that)")
    v.add_argument("path", help="a snapshot directory, a Snapshots root, a memmap storage directory, "
                                "an HDF5 storage file, or an SB3 replay-buffer pickle (.pkl)")
    v.set_defaults(func=_verify)
    return p


def main(argv=None) -> int:
    """Run a subcommand. A bad path or a bad file is never a traceback: an
    error bigper raises on purpose, or the OSError of a path (a FIFO, a
    symlink loop, a file where a directory belongs), is one line on stderr
    naming it, and exit status 2."""
    from ..errors import BigperError

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ["bench"]:  # everything after it is tools/bench.py's, --help included
        args = argparse.Namespace(command="bench", func=_bench, rest=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (BigperError, OSError) as e:
        print(f"bigper {args.command}: {_line(e)}", file=sys.stderr)
        return 2
