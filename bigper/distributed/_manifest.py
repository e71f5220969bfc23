"""Sharded snapshots: one local snapshot per shard plus a manifest, committed
atomically; and the recovery pointer that restarted shards read.

::

    snap-000100/
      manifest.json      format, version, shard count and capacities, config,
                         coordinator state (RNG, beta step, max leaf), per-shard summary
      shard-0/ ...       a bigper snapshot of each shard (bigper.snapshot)
      shard-1/ ...

The shards write into a temporary sibling directory; the manifest is written
and fsynced last, then the directory is renamed into place and its parent
fsynced. A crash at any point leaves either the complete snapshot or none
(a leftover ``.<name>.tmp-*`` directory that loading ignores).

``recovery_dir/latest.json`` names the latest committed snapshot; it is
replaced atomically after each commit. A shard that Ray restarts reads it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    PathExistsError,
    PathNotFoundError,
)
from ..storage._files import fsync_dir, read_json, write_json

FORMAT = "bigper-sharded"
VERSION = 1
POINTER = "latest.json"


def temp_dir_for(snapshot: Path) -> Path:
    snapshot = Path(snapshot)
    if snapshot.exists():
        raise PathExistsError(f"snapshot {snapshot} already exists; save to a new directory")
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    tmp = snapshot.parent / f".{snapshot.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir()
    return tmp


def save(actors: list, snapshot: Path, body: dict) -> None:
    """Each shard saves itself into ``<tmp>/shard-k`` (in parallel); then the
    manifest ``body`` (plus format, version and the shards' summaries) commits."""
    import ray

    tmp = temp_dir_for(snapshot)
    try:
        infos = ray.get([a.save.remote(str(tmp / f"shard-{k}")) for k, a in enumerate(actors)])
        commit(tmp, snapshot, {"format": FORMAT, "version": VERSION, **body, "shards": infos})
    except BaseException:
        abort(tmp)
        raise


def commit(tmp: Path, snapshot: Path, manifest: dict) -> None:
    """Write the manifest last, then rename ``tmp`` to ``snapshot`` and fsync the parent."""
    write_json(tmp / "manifest.json", manifest)
    fsync_dir(tmp)
    os.rename(tmp, snapshot)
    fsync_dir(snapshot.parent)


def abort(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def read_manifest(snapshot) -> dict:
    snapshot = Path(snapshot)
    path = snapshot / "manifest.json"
    if not path.exists():
        raise PathNotFoundError(f"no sharded bigper snapshot at {snapshot} (missing manifest.json)")
    try:
        m = read_json(path)
    except ValueError as exc:
        raise CorruptSnapshotError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise IncompatibleSnapshotError(f"{snapshot} is not a {FORMAT} snapshot (format={got!r})")
    if m.get("version") != VERSION:
        raise IncompatibleSnapshotError(
            f"{snapshot} has {FORMAT} version {m.get('version')!r}; this bigper reads version {VERSION}")
    from ._sampling import shard_capacities

    cap = m["config"]["capacity"]
    if shard_capacities(cap, m["num_shards"]).tolist() != m["capacities"]:
        raise IncompatibleSnapshotError(f"{snapshot}: shard capacities {m['capacities']} do not "
                                        f"split capacity {cap} the way this bigper does")
    for k in range(int(m["num_shards"])):
        if not (snapshot / f"shard-{k}").is_dir():
            raise CorruptSnapshotError(f"{snapshot} lacks shard-{k}/ that its manifest lists")
    return m


def write_recovery_pointer(recovery_dir, snapshot) -> None:
    if recovery_dir is None:
        return
    d = Path(recovery_dir)
    d.mkdir(parents=True, exist_ok=True)
    write_json(d / POINTER, {"snapshot": str(Path(snapshot).absolute())})


def clear_recovery_pointer(recovery_dir) -> None:
    if recovery_dir is not None:
        try:
            os.unlink(Path(recovery_dir) / POINTER)
        except FileNotFoundError:
            pass


def read_recovery_pointer(recovery_dir) -> str | None:
    if recovery_dir is None:
        return None
    p = Path(recovery_dir) / POINTER
    if not p.exists():
        return None
    snap = read_json(p)["snapshot"]
    return snap if Path(snap).is_dir() else None
