"""What a snapshot holds besides the buffer (``SnapshotInfo``), and the names
that a series of numbered snapshots (``bigper.Snapshots``) gives its entries."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .manifest import read_manifest

NAME = re.compile(r"^snap-(\d{8,})$")
TMP_PREFIX = ".tmp-"  # a save in progress (or interrupted): <parent>/.tmp-<name>-<pid>-<rand>
DEL_PREFIX = ".del-"  # a deletion in progress (or interrupted)
# Exactly the names save and retention give their temporaries: nothing else is removed.
LEFTOVER = re.compile(r"^(\.tmp-snap-\d{8,}-\d+-[0-9a-f]{8}|\.del-snap-\d{8,}-[0-9a-f]{8})$")


def seq_of(p: Path) -> int:
    """The number of a snapshot named ``snap-<number>``; -1 for any other name."""
    m = NAME.match(p.name)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot holds besides the buffer (``Snapshots.last_loaded``,
    ``snapshot_info``). Each parameter is also an attribute of the same
    name; ``load_latest`` and ``snapshot_info`` make them.

    Parameters
    ----------
    path : Path
        The snapshot directory.
    number : int or None
        Its sequence number under a ``Snapshots`` root (``snap-00000042`` -> 42).
    created : str or None
        When it was written (ISO 8601, UTC).
    metadata : JSON value or None
        What the caller passed as ``metadata=`` to ``save`` (e.g. ``{"step": 100000}``).
    files : Mapping[str, Path]
        ``name -> path`` of the caller's files kept in the snapshot (read-only:
        copy one before changing it; retention deletes them with the snapshot).
    count, len : int or None
        Transitions ever added, and held, when it was written.
    """

    path: Path
    number: int | None
    created: str | None
    metadata: Any
    files: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}))
    count: int | None = None
    len: int | None = None

    @property
    def step(self) -> Any:
        """``metadata["step"]`` when the caller recorded one, else None."""
        return self.metadata.get("step") if isinstance(self.metadata, dict) else None


def snapshot_info(snapshot: str | os.PathLike[str]) -> SnapshotInfo:
    """The ``SnapshotInfo`` of one snapshot directory (its manifest checked;
    the files it names are not read)."""
    p = Path(os.path.abspath(snapshot))
    body = read_manifest(p)
    user = body.get("user") or {}
    seq = seq_of(p)
    count = body["state"]["meta"].get("count")
    n = body.get("summary", {}).get("len")
    return SnapshotInfo(
        path=p, number=seq if seq >= 0 else None, created=body.get("created"),
        metadata=user.get("metadata"),
        files=MappingProxyType({name: p / m for name, m in user.get("files", {}).items()}),
        count=count if isinstance(count, int) else None, len=n if isinstance(n, int) else None)
