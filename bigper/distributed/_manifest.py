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
(a leftover ``.tmp-<name>-*`` directory that loading ignores and
``bigper.Snapshots`` removes, as it does its own).

manifest.json ends with a checksum of everything before it, laid out as a
local snapshot's manifest (``"manifest_xxh3_64"`` last): a flipped bit or a
truncation is a ``CorruptSnapshotError``, and ``bigper.Snapshots`` lists a
sharded snapshot as intact (another format) only when its checksum holds.

``recovery_dir/latest.json`` names the latest committed snapshot; it is
replaced atomically after each commit. A shard that Ray restarts reads it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import xxhash

from ..errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    PathExistsError,
    PathNotFoundError,
)
from ..common.files import fsync_dir, read_json, read_regular, write_durable, write_json

FORMAT = "bigper-sharded"
VERSION = 1
POINTER = "latest.json"
TMP_PREFIX = ".tmp-"  # the prefix bigper.Snapshots clears at start (an interrupted save)
_TAIL = re.compile(rb',\n "manifest_xxh3_64": "([0-9a-f]{16})"\n}\n\Z')


def encode(body: dict) -> bytes:
    """manifest.json's bytes: ``body`` as JSON, its last key the xxh3-64 of what precedes it."""
    head = json.dumps(body, indent=1, sort_keys=True)[:-2].encode()
    return head + f',\n "manifest_xxh3_64": "{xxhash.xxh3_64(head).hexdigest()}"\n}}\n'.encode()


def decode(raw: bytes, where) -> dict:
    m = _TAIL.search(raw)
    if m is None or xxhash.xxh3_64(raw[:m.start()]).hexdigest() != m.group(1).decode():
        raise CorruptSnapshotError(f"{where}: manifest.json is truncated or does not match its checksum")
    try:
        body = json.loads(raw.decode())
    except (ValueError, RecursionError) as e:
        raise CorruptSnapshotError(f"{where}: manifest.json is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise CorruptSnapshotError(f"{where}: manifest.json is not a JSON object")
    body.pop("manifest_xxh3_64", None)
    return body


def temp_dir_for(snapshot: Path) -> Path:
    snapshot = Path(snapshot)
    if snapshot.exists():
        raise PathExistsError(f"snapshot {snapshot} already exists; save to a new directory")
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    tmp = snapshot.parent / f"{TMP_PREFIX}{snapshot.name}-{os.getpid()}-{os.urandom(4).hex()}"
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
    write_durable(tmp / "manifest.json", encode(manifest))
    fsync_dir(tmp)
    os.rename(tmp, snapshot)
    fsync_dir(snapshot.parent)


def abort(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def read_manifest(snapshot) -> dict:
    """The checked manifest of the sharded snapshot directory ``snapshot``."""
    snapshot = Path(snapshot)
    path = snapshot / "manifest.json"
    if not snapshot.is_dir():
        raise PathNotFoundError(f"no sharded bigper snapshot at {snapshot} (not a directory)")
    try:
        raw = read_regular(path, error=CorruptSnapshotError)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{snapshot} has no manifest.json: an incomplete snapshot, "
                                   "or not a snapshot") from None
    m = decode(raw, snapshot)
    if m.get("format") != FORMAT:
        raise IncompatibleSnapshotError(f"{snapshot} is not a {FORMAT} snapshot (format={m.get('format')!r})")
    if m.get("version") != VERSION:
        raise IncompatibleSnapshotError(
            f"{snapshot} has {FORMAT} version {m.get('version')!r}; this bigper reads version {VERSION}")
    from ._sampling import shard_capacities

    try:
        n, cap, caps = int(m["num_shards"]), int(m["config"]["capacity"]), list(m["capacities"])
        coord = m["coordinator"]
        # The coordinator's state must apply before any shard starts.
        np.random.default_rng().bit_generator.state = coord["rng"]
        step, leaf = coord["beta_step"], float(coord["max_leaf"])
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not 0 < leaf < np.inf:
            raise ValueError(f"beta_step={step!r}, max_leaf={leaf!r}")
        # caps has as many entries as the file had room for: compare its length first.
        ok = len(caps) == n and 1 <= n <= cap and shard_capacities(cap, n).tolist() == caps
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CorruptSnapshotError(f"{snapshot}: manifest lacks or mangles a field ({str(e)[:200]!r})") from None
    if not ok:
        raise IncompatibleSnapshotError(f"{snapshot}: shard capacities {caps} do not "
                                        f"split capacity {cap} the way this bigper does")
    for k in range(n):
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
