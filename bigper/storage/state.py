"""Checks of recorded storage metadata, and the buffer's bookkeeping arrays as .npy files."""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

import numpy as np

from ..errors import CorruptSnapshotError, IncompatibleSnapshotError, UncleanStorageError
from ..common.files import fsync_dir, open_regular, read_regular

# Names of the buffer's state arrays (``state/<name>.npy``): plain identifiers.
STATE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,99}$")
# A recorded state array holds at most this many bytes per slot (a crafted larger one is not read).
STATE_BYTES_PER_SLOT = 64


def state_bytes_limit(config, capacity=None) -> int:
    """The most bytes one recorded state array of a buffer of ``config``
    (hostile: a dict or anything) takes: a few numbers a slot
    (``STATE_BYTES_PER_SLOT``, ``state_slots``), the last ``frame_stack``
    frames of each env (``frames_last``) and, compressed, the live
    dictionaries (``frames_dict``)."""
    limit = STATE_BYTES_PER_SLOT * (state_slots(config, capacity) + 1024)
    try:
        k, envs = int(config.get("frame_stack") or 0), int(config.get("num_envs") or 1)
        shape, dt = config["fields"]["obs"]
        row = math.prod(int(x) for x in shape[1:]) * np.dtype(dt).itemsize
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # (refused by the config's own checks)
        return limit
    if k > 0 and envs > 0:
        limit += envs * k * row
    if config.get("compression"):
        from ..frames.dictionaries import DICT_LIMIT, MAX_DICTS

        limit += MAX_DICTS * (DICT_LIMIT + 64)
    return limit


def state_slots(config, capacity=None) -> int:
    """The slots whose state bounds what a recorded state array may hold
    (``STATE_BYTES_PER_SLOT * (slots + 1024)`` bytes): the recorded
    ``config``'s capacity (hostile: a dict or anything; 0 when it names
    none), never more than ``capacity`` when the caller gives it (the slots
    it can use: a crafted capacity in a config nothing else reads then lifts
    nothing)."""
    cap = config.get("capacity") if isinstance(config, dict) else None
    cap = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else 0
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 0:
        cap = min(cap, capacity) if cap else capacity
    return cap
_ARRAY_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,127}$")  # config.check_name's field names
_BIG = 1 << 62


def entry_kind(path: Path) -> str:
    """"file", "dir" or "other" (a symlink, FIFO, socket, device), without following links."""
    mode = os.lstat(path).st_mode
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def check_arrays(arrays, where) -> dict:
    """The ``arrays`` record of a meta.json (name -> rows, shape, dtype,
    chunk_rows), checked so that mapping it can neither overflow nor
    reach outside ``data/``; ``CorruptSnapshotError`` otherwise."""
    def bad(what):
        raise CorruptSnapshotError(f"{where}/meta.json: {what}")

    if not isinstance(arrays, dict):
        bad(f"arrays must be a dict, got {type(arrays).__name__}")
    for name, rec in arrays.items():
        if not isinstance(name, str) or not _ARRAY_NAME.match(name):
            bad(f"array name {name[:80]!r} is not a plain name")
        if not isinstance(rec, dict):
            bad(f"arrays[{name!r}] must be a dict")
        rec.setdefault("chunk_rows", rec.get("rows"))  # written before chunks: one each
        ints = [rec.get("rows"), rec.get("chunk_rows")] + (rec["shape"] if isinstance(rec.get("shape"), list) else [None])
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v < _BIG for v in ints):
            bad(f"arrays[{name!r}] needs rows, chunk_rows and shape of ints >= 1")
        try:
            if not isinstance(rec.get("dtype"), str):  # (np.dtype(None) is float64: a missing dtype is no default)
                raise TypeError
            dt = np.dtype(rec.get("dtype"))
        except Exception:  # noqa: BLE001
            bad(f"arrays[{name!r}] has dtype {str(rec.get('dtype'))[:40]!r}")
        if dt.hasobject or dt.fields is not None or dt.shape or dt.kind not in "biufc":
            bad(f"arrays[{name!r}] has dtype {dt}, not a numeric one")
        n = rec["rows"] * dt.itemsize
        for d in rec["shape"]:
            n *= d
        if n >= _BIG:
            bad(f"arrays[{name!r}] declares {n} bytes")
    return arrays




def npy_from_bytes(raw, where) -> np.ndarray:
    """The array in the ``.npy`` bytes ``raw``, read without pickle and
    without allocating from the header: the header's shape and dtype must
    account for exactly the bytes that follow it, else ``CorruptSnapshotError``."""
    import io

    from numpy.lib import format as npf

    f = io.BytesIO(raw)
    try:
        version = npf.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npf.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = npf.read_array_header_2_0(f)
        else:
            raise ValueError(f"npy version {version}")
    except Exception as e:  # noqa: BLE001  (whatever numpy says of a bad header)
        raise CorruptSnapshotError(f"{where} is not a readable .npy file: {str(e)[:200]}") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf" or fortran:
        raise CorruptSnapshotError(f"{where} holds a {dtype} array (fortran={fortran}); bigper writes "
                                   "C-order numeric arrays only")
    count = 1
    for d in shape:
        count *= int(d)
    start = f.tell()
    if count * dtype.itemsize != len(raw) - start:
        raise CorruptSnapshotError(f"{where}: its header declares {shape} {dtype} "
                                   f"({count * dtype.itemsize} bytes), the file holds {len(raw) - start}")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=start).reshape(shape).copy()


def _int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


_DIGEST = re.compile(r"^[0-9a-f]{16}$")


def check_record(meta: dict, where) -> None:
    """Types and ranges of the fields a storage's record keeps beside its
    arrays (``check_arrays``) and its state (``core/statecheck.py``), each as bigper
    writes it; ``CorruptSnapshotError`` naming the field otherwise. A JSON
    number is not a bool, a bool is not a number, an int is not a float."""
    def bad(key, what):
        raise CorruptSnapshotError(f"{where}/meta.json: {key} must be {what}, got {str(meta.get(key))[:80]!r}")

    if not isinstance(meta.get("clean"), bool):
        bad("clean", "true or false")
    state = meta.get("state")
    if "state" not in meta or state is not None and not isinstance(state, dict):  # (bigper always writes it)
        bad("state", "an object or null")
    for key in ("count", "beta_step"):  # read for messages before the state is checked in full
        if isinstance(state, dict) and key in state and not _int(state[key], 0, _BIG):
            raise CorruptSnapshotError(f"{where}/meta.json: state {key} must be an int in [0, 2**62), "
                                       f"got {str(state[key])[:80]!r}")
    files = meta.get("state_files")
    if files is not None and not (isinstance(files, list)
                                  and all(isinstance(f, str) and STATE_NAME.match(f) for f in files)):
        bad("state_files", "a list of plain array names")
    if "chunk_bytes" in meta and not _int(meta["chunk_bytes"], 1, _BIG):
        bad("chunk_bytes", "an int >= 1")
    if meta.get("compression") not in (None, "lzf", "gzip"):
        bad("compression", "null, 'lzf' or 'gzip'")
    shared = meta.get("shared_digests")
    if shared is None:
        return
    ok = isinstance(shared, dict) and all(
        isinstance(per, dict) and all(
            isinstance(k, str) and k.isdigit() and isinstance(rec, list) and len(rec) == 2
            and _int(rec[0], 0, 1 << 64) and isinstance(rec[1], str) and _DIGEST.match(rec[1])
            for k, rec in per.items())
        for per in shared.values())
    if not ok:
        bad("shared_digests", "{array: {chunk: [inode, xxh3 hex]}}")


def check_meta(meta: dict, fmt: str, version: int, where, unclean_ok: bool = False) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise IncompatibleSnapshotError(f"{where} is not a {fmt} storage (format={str(got)[:80]!r})")
    if meta.get("version") != version:
        raise IncompatibleSnapshotError(
            f"{where} has {fmt} format version {meta.get('version')!r}; this bigper reads version {version}")
    check_record(meta, where)
    if not meta.get("clean") and not unclean_ok:  # (unclean_ok: a reader that only describes it)
        raise UncleanStorageError(
            f"{where} was not closed: its writer died while the buffer was open, so its data "
            "and priorities may disagree. Resume from a snapshot instead: "
            "PrioritizedReplayBuffer.load(snapshot, path=...) or Snapshots(root).load_latest(path=...) "
            "takes the directory over.")
    return meta


def save_state_dir(path: Path, arrays: dict) -> None:
    path.mkdir(exist_ok=True)
    for name, arr in arrays.items():
        tmp = path / f".{name}.npy.tmp"
        with os.fdopen(open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / f"{name}.npy")
    fsync_dir(path)


def load_state_dir(path: Path, names=None, limit: int = 1 << 40) -> dict:
    """The arrays in ``path/<name>.npy``: each opened as a regular file
    (never a FIFO, device or symlink) and parsed without pickle. ``names``:
    the names recorded at close (None: every ``<name>.npy`` there).
    ``limit``: the most bytes one file may hold (measured on the file opened,
    not on a name looked at before: a file put there since is held to it
    too); ``CorruptSnapshotError`` past it."""
    if not path.is_dir() or path.is_symlink():
        return {}
    if names is None:
        names = [e[:-4] for e in sorted(os.listdir(path)) if e.endswith(".npy") and STATE_NAME.match(e[:-4])]
    out = {}
    for name in names:
        if not isinstance(name, str) or not STATE_NAME.match(name):
            raise CorruptSnapshotError(f"{path}: recorded state array name {str(name)[:80]!r} is not a plain name")
        p = path / f"{name}.npy"
        out[name] = npy_from_bytes(read_regular(p, limit=limit), p)
    return out
