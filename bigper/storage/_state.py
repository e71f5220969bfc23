"""Checks of recorded storage metadata, and the buffer's bookkeeping arrays as .npy files."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np

from ..errors import CorruptSnapshotError, IncompatibleSnapshotError, UncleanStorageError
from ._files import fsync_dir, open_regular, read_regular

# Names of the buffer's state arrays (``state/<name>.npy``): plain identifiers.
STATE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,99}$")
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


def check_meta(meta: dict, fmt: str, version: int, where) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise IncompatibleSnapshotError(f"{where} is not a {fmt} storage (format={str(got)[:80]!r})")
    if meta.get("version") != version:
        raise IncompatibleSnapshotError(
            f"{where} has {fmt} format version {meta.get('version')!r}; this bigper reads version {version}")
    if not meta.get("clean"):
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


def load_state_dir(path: Path, names=None) -> dict:
    """The arrays in ``path/<name>.npy``: each opened as a regular file
    (never a FIFO, device or symlink) and parsed without pickle. ``names``:
    the names recorded at close (None: every ``<name>.npy`` there)."""
    if not path.is_dir() or path.is_symlink():
        return {}
    if names is None:
        names = [e[:-4] for e in sorted(os.listdir(path)) if e.endswith(".npy") and STATE_NAME.match(e[:-4])]
    out = {}
    for name in names:
        if not isinstance(name, str) or not STATE_NAME.match(name):
            raise CorruptSnapshotError(f"{path}: recorded state array name {str(name)[:80]!r} is not a plain name")
        p = path / f"{name}.npy"
        out[name] = npy_from_bytes(read_regular(p, limit=1 << 40), p)
    return out
