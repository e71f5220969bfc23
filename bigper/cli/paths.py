"""What a path holds, for the ``bigper`` command, when it is not what a
command reads: a run folder, a folder of checkpoints, an SB3 replay-buffer
pickle.

A user points ``bigper verify`` or ``bigper info`` at the folder they have
(``runs/pong``), not at the snapshot inside it; the command says what the
folder is not and names what below it the command does read. An SB3 user has
``ckpt/replay_buffer.pkl``: the pickle names its snapshot, and ``verify``
follows it. The pickle is read as opcodes (``pickletools``), never unpickled:
a file given to ``verify`` is untrusted, and unpickling runs code.
"""

from __future__ import annotations

import os
import pickletools
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import IncompatibleSnapshotError, InvalidArgumentError
from ..integrations._sb3_pickle import PICKLE_LIMIT, beside_the_pickle, checked_snapshot
from ..common.files import read_regular

# How far below a folder the survey looks, and how many entries it reads at most:
# a run folder holds its snapshots a level or two down; a home directory must not take minutes.
DEPTH = 3
ENTRIES = 20_000
SHOWN = 12  # lines of each kind; the rest are counted


@dataclass
class Found:
    """What a folder holds below it that bigper reads, each a path."""
    snapshots: list[Path] = field(default_factory=list)
    roots: list[tuple[Path, list[str]]] = field(default_factory=list)  # a Snapshots root and its snap-* names
    storages: list[tuple[Path, str]] = field(default_factory=list)  # (path, "memmap" | "hdf5")
    pickles: list[Path] = field(default_factory=list)
    empty: bool = False
    truncated: bool = False

    def __bool__(self) -> bool:
        return bool(self.snapshots or self.roots or self.storages or self.pickles)


def survey(folder: Path) -> Found:
    """Snapshots, Snapshots roots, live storages and ``.pkl`` files below
    ``folder``, ``DEPTH`` levels deep at most; what a snapshot or a storage
    holds is not looked into."""
    found, seen = Found(), 0
    try:
        with os.scandir(folder) as it:
            found.empty = next(it, None) is None
    except OSError:
        return found
    todo = [(Path(folder), 0)]
    while todo:
        d, depth = todo.pop(0)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        names = {e.name for e in entries}
        snaps = sorted(n for n in names if n.startswith("snap-") and os.path.isfile(d / n / "manifest.json"))
        if d != Path(folder) and snaps:
            found.roots.append((d, snaps))
            continue
        for e in entries:
            seen += 1
            if seen > ENTRIES:
                found.truncated = True
                return found
            p = d / e.name
            if e.name.startswith(".") or e.name in snaps:
                continue
            if e.is_dir(follow_symlinks=False):
                if os.path.isfile(p / "manifest.json"):
                    found.snapshots.append(p)
                elif os.path.isfile(p / "meta.json"):
                    found.storages.append((p, "memmap"))
                elif depth + 1 < DEPTH:
                    todo.append((p, depth + 1))
            elif e.is_file(follow_symlinks=False):
                if e.name.endswith(".pkl"):
                    found.pickles.append(p)
                elif f"{e.name}.lock" in names:
                    found.storages.append((p, "hdf5"))
    return found


def not_what_it_reads(folder: Path, command: str) -> tuple[str, bool]:
    """The message for a folder that is not a snapshot, a Snapshots root or
    a storage: what it is not, and what below it ``command`` reads; and
    whether there was anything to name."""
    found = survey(folder)
    head = (f"{folder} is not a snapshot, a Snapshots root or a bigper storage (it holds no manifest.json, "
            "no snap-* snapshot and no meta.json)")
    if found.empty:
        return f"{head}: it is empty", False
    if not found:
        return (f"{head}, and nothing {DEPTH} levels below it is one, nor an SB3 replay-buffer pickle"
                + (f" (stopped after looking at {ENTRIES:,} entries)" if found.truncated else "")), False
    lines = [f"{head}; below it:"]

    def some(rows: list[str]) -> None:
        lines.extend(rows[:SHOWN])
        if len(rows) > SHOWN:
            lines.append(f"  ... and {len(rows) - SHOWN} more")

    some([f"  {f'a live {kind} storage':23} {p}" for p, kind in found.storages])
    some([f"  {'a Snapshots root':23} {p} ({len(s)} snapshot{'s' if len(s) > 1 else ''}, the latest {s[-1]})"
          for p, s in found.roots])
    some([f"  {'a snapshot':23} {p}" for p in found.snapshots])
    some([f"  {'an SB3 pickle':23} {p} (verify follows it to its snapshot)" for p in found.pickles])
    if found.truncated:
        lines.append(f"  (stopped after looking at {ENTRIES:,} entries)")
    lines.append(f"run bigper {command} on one of these")
    return "\n".join(lines), True


# -- an SB3 replay-buffer pickle, read without unpickling ------------------------------------

# Opcodes whose argument is a string the stream pushes (GLOBAL and INST: "module name", the
# class of protocols 0-3; protocols 4-5 push the two names as strings for STACK_GLOBAL).
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "GLOBAL", "INST"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_SILENT = {"PROTO", "FRAME", "MARK", "STOP"}
_FORMAT = "bigper.sb3/"  # the drop-in's pickle format, "bigper.sb3/<version>"


# Opcodes read at most: a bigper SB3 pickle (spaces, paths, a few numbers) has a few hundred;
# a crafted one packed with them would otherwise cost seconds and memory before its refusal.
MAX_OPS = 100_000


def pickle_reference(path: Path) -> dict:
    """The ``format``, ``snapshot`` and ``manifest_sha256`` strings of an
    SB3 drop-in pickle at ``path``, read from its opcodes: nothing in it is
    imported, called or built. ``IncompatibleSnapshotError`` naming ``path``
    for any other file."""
    where = os.fspath(path)
    try:
        data = read_regular(path, limit=PICKLE_LIMIT, follow=True, error=InvalidArgumentError)
    except OSError as e:
        raise InvalidArgumentError(f"{where} cannot be read: {e}") from e

    def refuse(why: str) -> IncompatibleSnapshotError:
        return IncompatibleSnapshotError(f"{where} is not a bigper SB3 replay-buffer pickle ({why})")

    # The drop-in's state is a dict whose string items follow each other in the stream
    # ("snapshot", then its path); memo references are resolved so that a repeated string counts.
    items: list[str | None] = []
    memo: dict[int, str | None] = {}
    try:
        for n, (op, arg, _) in enumerate(pickletools.genops(data)):
            if n >= MAX_OPS:  # the drop-in's pickle is spaces and paths: a few hundred opcodes
                raise refuse(f"more than {MAX_OPS:,} pickle opcodes, far more than a replay-buffer pickle holds")
            name = op.name
            if name in _SILENT:
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = items[-1] if items else None
            elif name in _PUTS:
                memo[arg] = items[-1] if items else None
            else:
                items.append(memo.get(arg) if name in _GETS else arg if name in _STRINGS else None)
    except IncompatibleSnapshotError:
        raise
    except Exception as e:  # noqa: BLE001 (any malformed stream: not a pickle bigper wrote)
        raise refuse(f"not a pickle: {type(e).__name__}: {e}") from None
    if not any(isinstance(v, str) and v.startswith("bigper.integrations") for v in items):
        raise refuse("it pickles no bigper replay buffer")
    ref: dict[str, str] = {}
    for key in ("format", "snapshot", "manifest_sha256"):
        at = [i for i, v in enumerate(items[:-1]) if v == key and isinstance(items[i + 1], str)]
        if not at:
            raise refuse(f"no {key!r} recorded as a string")
        ref[key] = items[at[0] + 1]
    if not ref["format"].startswith(_FORMAT):
        raise refuse(f"its format is {ref['format'][:40]!r}")
    return ref


def pickle_snapshot(path: Path) -> Path:
    """The snapshot an SB3 drop-in pickle names, found as ``load_replay_buffer``
    finds it (beside the pickle when the run folder was moved or copied), its
    manifest checked against the hash the pickle recorded
    (``CorruptSnapshotError``; ``PathNotFoundError`` when it is gone)."""
    ref = pickle_reference(path)
    state, _ = beside_the_pickle(ref, os.fspath(path))
    return checked_snapshot(state)
