"""A memmap folder's arrays replaced by others in place, journaled in ``meta.json``.

An older bigper's run folder keeps its frame references whole (``obs_ref``,
``next_obs_ref``); a writer's resume converts it (``core/legacy.py`` computes
the new arrays, this module puts them on disk). ``meta.json`` is the commit
point: each of its writes is atomic (``write_json``: a temporary file, fsync,
rename), and at every moment it names every file of the folder, so a kill -9
anywhere leaves a folder that is either the old one or the new one::

    S0  arrays: old                          (the older bigper's folder)
    S1  arrays: old, converting: {new}       the new files are being written: named before they exist
    S2  arrays: new, converted: {old}        the commit: the old files are leftovers, named
    S3  arrays: new                          the old files deleted (at close, or at the next open)

A writer that opens a folder in S1 deletes the new files and goes on from S0
(converting again); in S2 it deletes the old files (S3). A reader (``read_only``,
``bigper verify``) changes nothing: it reads S1 as the old folder, S2 as the new
one. A resume refused after S2 (the rest of the resume fails) goes back to S0
(``undo``), so a refusal leaves the folder as it was. The journal is read from
disk like anything else: it may name only files that are not the folder's
recorded ones, plain names inside ``data/`` and ``state/`` (``check_journal``),
and a name in it that is not a regular file now is not bigper's (refused,
never opened or deleted).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from ..errors import CorruptSnapshotError, IncompatibleSnapshotError, PathExistsError
from .chunks import _Array, chunk_name
from ..common.files import fsync_dir, open_regular, write_json
from .state import STATE_NAME, check_arrays, entry_kind

KEYS = ("converting", "converted")
# The state files a conversion drops: what the older format recorded and this one derives
# (core/layout.DERIVED). A journal naming another would delete state a resume reads.
DROPPED_STATE = ("gid", "frames_minref")
_CHUNK = re.compile(r"^([A-Za-z_][A-Za-z0-9_\-]{0,127})(?:\.(\d{6,}))?\.bin$")


def check_journal(meta: dict, where) -> None:
    """The journal keys of a ``meta.json`` (read from disk) as a conversion
    writes them, else ``CorruptSnapshotError`` naming the key."""
    arrays, files = meta.get("arrays") or {}, meta.get("state_files")
    for key in KEYS:
        j = meta.get(key)
        if j is None:
            continue

        def bad(what):
            raise CorruptSnapshotError(f"{where}/meta.json: {key} {what}")
        if not isinstance(j, dict) or set(j) != {"arrays", "state"} or not isinstance(j["state"], list):
            bad("must be {'arrays': {...}, 'state': [...]}")
        try:
            check_arrays(j["arrays"], where)
        except CorruptSnapshotError as e:
            bad(f"names arrays that are not plain ones ({e})")
        taken = sorted(set(j["arrays"]) & set(arrays))
        if taken:
            bad(f"names {taken}, which the folder records as its arrays")
        if not all(isinstance(s, str) and STATE_NAME.match(s) for s in j["state"]):
            bad(f"names state files {str(j['state'])[:80]} that are not plain names")
        if not set(j["state"]) <= set(DROPPED_STATE):
            bad(f"names state files {sorted(set(j['state']) - set(DROPPED_STATE))[:8]}, which no conversion "
                f"drops (only {list(DROPPED_STATE)})")
        if key == "converting" and j["state"]:
            bad("names state files (a conversion in progress deletes none)")
        if isinstance(files, list) and set(j["state"]) & set(files):
            bad(f"names {sorted(set(j['state']) & set(files))}, which the folder records as its state")
    if all(meta.get(k) is not None for k in KEYS):
        raise CorruptSnapshotError(f"{where}/meta.json: converting and converted at once")


def chunk_files(arrays: dict, present) -> list[str]:
    """The names among ``present`` (a folder's entries) that are chunk files
    of ``arrays`` (name -> record, read from disk): looked up entry by entry,
    so a record of 2**55 one-row chunks costs what the folder holds."""
    out = []
    for entry in present:
        m = _CHUNK.match(entry)
        if m is None or m.group(1) not in arrays:
            continue
        k = int(m.group(2) or 0)
        if chunk_name(m.group(1), k) == entry and k < _chunks(arrays[m.group(1)]):
            out.append(entry)
    return sorted(out)


def _entries(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def journal_files(meta: dict, present=()) -> tuple[set, set]:
    """``(data file names, state names)`` the journal names among ``present``
    (the entries of ``data/``): bigper's, for a takeover."""
    data, state = set(), set()
    for key in KEYS:
        j = meta.get(key)
        if isinstance(j, dict) and isinstance(j.get("arrays"), dict):
            data |= set(chunk_files(j["arrays"], present))
            state |= {s for s in j.get("state") or () if isinstance(s, str)}
    return data, state


def _chunks(rec: dict) -> int:
    try:
        return -(-int(rec["rows"]) // int(rec["chunk_rows"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0


def _named(root: Path, j: dict, strict: bool = True) -> list[Path]:
    """The files ``j`` names that are there, as regular files; one that is
    not (a FIFO, a symlink: not bigper's) is ``PathExistsError`` (``strict``)
    or left where it is."""
    out = []
    paths = [root / "data" / e for e in chunk_files(j["arrays"], _entries(root / "data"))]
    paths += [root / "state" / f"{s}.npy" for s in j["state"]]
    for p in paths:
        if os.path.lexists(p):
            if entry_kind(p) != "file":
                if not strict:
                    continue
                raise PathExistsError(f"{p} is named by bigper's conversion journal but is not a plain file now: "
                                      "not bigper's, so it is neither opened nor deleted (nothing was changed)")
            out.append(p)
    return out


def check_files(root: Path, meta: dict) -> None:
    """What ``recover`` checks before it deletes anything, changing nothing
    (a writer's open: refused there, before the lock file is its own)."""
    for key in KEYS:
        j = meta.get(key)
        if j is not None:
            _kept_whole(root, meta)
            _named(root, j)


def recover(root: Path, meta: dict) -> dict:
    """A writer's open of a folder whose conversion was interrupted: S1 back
    to S0 (the new files deleted), S2 on to S3 (the old ones); the meta it
    writes, or ``meta`` as it was when it has no journal."""
    for key in KEYS:
        j = meta.get(key)
        if j is not None:
            _kept_whole(root, meta)  # (the files it goes on with are there: else nothing is deleted)
            for p in _named(root, j):  # (all checked before the first goes)
                p.unlink()
            for sub in ("data", "state"):
                if (root / sub).is_dir():
                    fsync_dir(root / sub)
            meta = {k: v for k, v in meta.items() if k != key}
            write_json(root / "meta.json", meta)
    return meta


def _kept_whole(root: Path, meta: dict) -> None:
    """Every chunk file of the arrays ``meta`` records (what a recovery goes
    on with) is a regular file of its size, else ``IncompatibleSnapshotError``
    naming it: the journal's other files are then the only copy, kept."""
    held = len(_entries(root / "data"))
    for name, rec in (meta.get("arrays") or {}).items():
        if _chunks(rec) > held:  # (more chunk files than data/ holds entries: not counted one by one)
            raise IncompatibleSnapshotError(
                f"{root / 'data'}: the record names {_chunks(rec)} chunk files of {name}, the folder holds "
                f"{held} entries; the interrupted conversion's other files are kept (nothing was changed)")
        a = _Array(root, name, rec)
        for k in range(a.n):
            p = a.path(k)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size < a.sizes[k]:
                what = "missing" if st is None else "not a regular file" if not stat.S_ISREG(st.st_mode) \
                    else f"{st.st_size} bytes, expected {a.sizes[k]}"
                raise IncompatibleSnapshotError(
                    f"chunk file {p} is {what}: the record names {a.rows} rows of {name}; the interrupted "
                    f"conversion's other files are kept (nothing was changed)")


def write_new(root: Path, meta: dict, new: dict, layout: dict, old: tuple, old_state: tuple) -> dict:
    """S0 to S2: the arrays ``new`` (name -> array, laid out as ``layout``)
    written beside the recorded ones, then recorded in place of ``old`` and the
    state files ``old_state``; returns the meta written (S2). A failure
    (a full disk) goes back to S0 and raises."""
    meta_path = root / "meta.json"
    write_json(meta_path, {**meta, "converting": {"arrays": layout, "state": []}})  # named before they exist
    try:
        for name, rec in layout.items():
            a = _Array(root, name, rec)
            flat = np.ascontiguousarray(new[name]).reshape(-1).view(np.uint8)
            for k in range(a.n):
                try:
                    fd = open_regular(a.path(k), os.O_RDWR | os.O_CREAT | os.O_EXCL)
                except FileExistsError:
                    raise PathExistsError(f"{a.path(k)} is already there, but bigper's record does not name it: "
                                          "not bigper's, so the conversion does not write it (nothing was "
                                          "changed; move it away to go on)") from None
                try:
                    os.posix_fallocate(fd, 0, a.sizes[k])  # a full disk is an OSError here
                    view, pos = memoryview(flat[a.offset(k):a.offset(k) + a.sizes[k]]), 0
                    while view:
                        n = os.pwrite(fd, view, pos)
                        view, pos = view[n:], pos + n
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(root / "data")
        after = json.loads(json.dumps(meta))
        after["arrays"] = {n: r for n, r in meta["arrays"].items() if n not in old}
        after["arrays"].update(layout)
        files = meta.get("state_files")
        if isinstance(files, list):
            after["state_files"] = [s for s in files if s not in old_state]
        after["shared_digests"] = {n: d for n, d in (meta.get("shared_digests") or {}).items() if n not in old}
        after["converted"] = {"arrays": {n: meta["arrays"][n] for n in old}, "state": list(old_state)}
        write_json(meta_path, after)  # the commit
    except BaseException:
        undo(root, meta, layout, named=False)
        raise
    return after


def undo(root: Path, before: dict, layout: dict, named: bool = True) -> None:
    """S2 (or S1) back to S0: the new files named (again), deleted, then the
    old record (``before``) written back."""
    if named:
        write_json(root / "meta.json", {**before, "converting": {"arrays": layout, "state": []}})
    for name, rec in layout.items():
        for k in range(_chunks(rec)):
            p = root / "data" / chunk_name(name, k)
            if os.path.lexists(p) and entry_kind(p) == "file":
                p.unlink()
    fsync_dir(root / "data")
    write_json(root / "meta.json", before)


def finish(root: Path, meta: dict) -> dict:
    """S2 to S3 (a writer's close): the old files deleted; the meta without
    the journal (the caller writes it)."""
    j = meta.get("converted")
    if j is None:
        return meta
    for p in _named(root, j, strict=False):
        p.unlink()
    for sub in ("data", "state"):
        if (root / sub).is_dir():
            fsync_dir(root / sub)
    return {k: v for k, v in meta.items() if k != "converted"}
