"""Checks of recorded storage metadata, and the buffer's bookkeeping arrays as .npy files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import IncompatibleSnapshotError, UncleanStorageError
from ._files import fsync_dir




def check_meta(meta: dict, fmt: str, version: int, where) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise IncompatibleSnapshotError(f"{where} is not a {fmt} storage (format={meta.get('format')!r})")
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
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / f"{name}.npy")
    fsync_dir(path)


def load_state_dir(path: Path) -> dict:
    if not path.is_dir():
        return {}
    return {p.stem: np.load(p, allow_pickle=False) for p in sorted(path.glob("*.npy"))}
