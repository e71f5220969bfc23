"""Loading a snapshot: verify every byte, then rebuild the buffer.

Nothing is written into the snapshot, ever (promise 6). Every file is read
once and checked against its size and checksum before anything on disk
changes; then the live location is taken over:

- a chunked storage (memmap, ``StorageBase.chunked``): the snapshot's chunk
  files are hard-linked into ``path/data`` (copied where linking is
  impossible) and mapped; they are shared, so the live buffer copies a chunk
  before its first write into it;
- any other (memory, hdf5): rows are copied into the storage its kind's
  ``restoring`` makes (fresh arrays, a new file at ``path``), checked as they
  are read.

A snapshot read where it was written loads into the live path it recorded;
one read elsewhere (its run folder copied or moved: a fork) loads into the
same place relative to it (``counterpart``), never into the original run's
folder. A live path that holds a buffer closed with more transitions than
the snapshot is refused unless the caller asks for a ``rewind`` by name: a
load never discards newer data by default (promise 18).

Taking over ``path`` replaces whatever a dead writer left there. A path
whose writer is alive raises ``StorageLockedError``; a path that holds a
buffer of another config raises ``IncompatibleSnapshotError`` (nothing is
touched); a path holding anything bigper cannot prove it wrote (its marker,
and only the file names its records name) raises ``PathExistsError``.

Everything in the snapshot is untrusted until checked, in this order, and
nothing is allocated from a recorded size before the files on disk are
known to hold that many bytes: the manifest (its checksum, then types and
ranges), the config, the data layout against the arrays the config needs,
every member's size on disk, the state arrays and their invariants
(``core/statecheck.py``), every data byte; only then is a buffer built.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import Config
from ..errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
)
from ..core.layout import DERIVED, check_field_names, storage_growth, storage_specs
from ..frames.store import FrameStore
from ..storage import storage_class
from ..storage.base import fits_spec
from ..core.statecheck import check_state
from ..prioritization import STRATEGIES
from ..core.units import unit_class
from ..common.status import LIVE, PENDING
from ..storage.state import npy_from_bytes
from .manifest import check_file, check_files, member_sizes, read_manifest
from ._save import specs_of
from . import _refs

log = logging.getLogger("bigper")


def _config(body: dict, snap) -> Config:
    d = body["config"]
    try:
        rebuilt = Config.from_dict(d)  # validated as the constructor validates its arguments
        check_field_names(rebuilt)
    except Exception as e:  # any shape of bad config is the same answer
        raise IncompatibleSnapshotError(f"{snap}: its config is not valid for this bigper: {e}") from None
    if rebuilt.to_dict() != d:
        diff = [k for k in rebuilt.to_dict() if rebuilt.to_dict()[k] != d.get(k)]
        raise IncompatibleSnapshotError(f"{snap}: its config does not validate; key(s) {diff} differ")
    return rebuilt


def _layouts(body: dict, snap) -> dict:
    """name -> (rows, shape, dtype), with each data file's size checked against it."""
    out = {}
    for name, rec in body["data"].items():
        try:
            dt = np.dtype(rec["dtype"])
        except Exception:  # noqa: BLE001  (numpy's many ways of refusing a dtype string)
            raise IncompatibleSnapshotError(f"{snap}: data[{name!r}] has dtype {rec['dtype']!r}") from None
        if dt.hasobject or dt.fields is not None or dt.shape or dt.kind not in "biufc":
            raise IncompatibleSnapshotError(f"{snap}: data[{name!r}] has dtype {dt}, not a numeric one")
        rows, cr, shape = rec["rows"], rec["chunk_rows"], tuple(rec["shape"])
        row_bytes = math.prod(shape) * dt.itemsize  # Python ints: sizes never wrap
        for k, member in enumerate(rec["files"]):
            want = min(cr, rows - k * cr) * row_bytes
            if body["files"][member]["size"] != want:
                raise IncompatibleSnapshotError(
                    f"{snap}: {member} is recorded with {body['files'][member]['size']} bytes, "
                    f"but {name}'s layout needs {want}")
        out[name] = (rows, shape, dt)
    return out


def _state_arrays(body: dict, snap) -> dict:
    out = {}
    for name, member in body["state"]["arrays"].items():
        raw = check_file(snap, member, body["files"][member], keep=True)
        out[name] = npy_from_bytes(raw, f"{snap}/{member}")
    return out


def _frames(cfg: Config, layouts: dict, snap) -> FrameStore | None:
    """The frame store of ``cfg`` (none without frame stacks) with the frame
    offsets the snapshot holds: the config's, or wider ones (a buffer
    converted from the older format keeps them); another dtype is
    ``IncompatibleSnapshotError``."""
    if not cfg.frame_stack:
        return None
    off, index = layouts.get("frame_off"), layouts.get("frame_index")
    try:
        return FrameStore(cfg, None, offsets=None if off is None else off[2],
                          index=None if index is None else index[1])
    except IncompatibleSnapshotError as e:
        raise IncompatibleSnapshotError(f"{snap}: {e}") from None


def _needed_specs(cfg: Config, frames: FrameStore | None = None) -> dict:
    """name -> (rows, shape, dtype) of the arrays a buffer of ``cfg`` stores,
    found without allocating them."""
    return {n: (int(r), tuple(int(d) for d in sh), np.dtype(t))
            for n, (r, sh, t) in storage_specs(cfg, frames).items()}


def _check_sizes(body: dict, snap, cfg: Config, layouts: dict) -> None:
    """Before anything is allocated: the recorded layout is the one the
    config needs, and every file is on disk with its recorded size, so what
    the config makes a load allocate is bounded by the bytes really there."""
    member_sizes(snap, sorted(body["files"].items()))
    # Every buffer records one status byte per slot, whatever its prioritization.
    status = body["state"]["arrays"].get("status")
    if status is None or body["files"][status]["size"] < cfg.capacity:
        raise CorruptSnapshotError(
            f"{snap}: its config declares capacity {cfg.capacity}, but its recorded status "
            f"({status!r}) does not hold {cfg.capacity} slots")
    _compare_specs(_needed_specs(cfg, _frames(cfg, layouts, snap)), layouts, snap, cfg, storage_growth(cfg))


def _fill(store, snap: Path, body: dict, layouts: dict) -> None:
    """Copy every data file's rows into ``store`` (checking each file again as it is read)."""
    for name, rec in body["data"].items():
        rows, shape, dt = layouts[name]
        cr = rec["chunk_rows"]
        if "array" in rec:  # converted from an older format (_refs.convert): in memory, no file
            store.write(name, slice(0, rows), rec["array"])
            continue
        for k, member in enumerate(rec["files"]):
            raw = check_file(snap, member, body["files"][member], keep=True)
            stop = min(rows, (k + 1) * cr)
            block = np.frombuffer(raw, dtype=dt).reshape((stop - k * cr, *shape))
            store.write(name, slice(k * cr, stop), block)


def _check_apart(live: Path, snap: Path) -> None:
    try:
        lv, sn = live.resolve(), snap.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop on the way
        raise PathExistsError(f"path={str(live)!r} cannot be resolved: {e}") from None
    if lv == sn or sn in lv.parents or lv in sn.parents:
        raise InvalidArgumentError(f"path={str(live)!r} and the snapshot {str(snap)!r} overlap; a load "
                         "never writes into a snapshot, so the live data must live elsewhere")


def _check_previous(meta, cfg: Config, live) -> None:
    """A location that holds a buffer of another config is not taken over."""
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        return
    try:
        prev = Config.from_dict(meta["config"])
    except Exception:
        return
    diff = cfg.differences(prev)
    if diff:
        raise IncompatibleSnapshotError(
            f"{live} holds a buffer of another config, which loading would replace; differing "
            "key(s): " + "; ".join(diff) + ". Pass another path= (or remove that buffer first).")


def counterpart(live, saved_at, now_at) -> Path | None:
    """Where ``live`` (recorded by a snapshot written at ``saved_at``) lies for
    the same snapshot read at ``now_at``: the folders the two snapshots' parent
    paths share at their end are the same folders, so the tree above them
    moved (a copy of a run folder, a moved one; the snapshot itself may have
    another name there). None when nothing moved, when the two share no
    folder, or when ``live`` is not inside the tree that moved (the recorded
    path then stands).

    ::

        saved_at /runs/a/ckpt/snap-3    live /runs/a/replay
        now_at   /runs/b/ckpt/latest    ->   /runs/b/replay
    """
    a, b = Path(saved_at).parent.parts, Path(now_at).parent.parts
    k = 0
    while k < min(len(a), len(b)) and a[len(a) - 1 - k] == b[len(b) - 1 - k]:
        k += 1
    old, new = Path(*a[:len(a) - k]), Path(*b[:len(b) - k])
    if k == 0 or old == new:
        return None
    try:
        rel = Path(live).relative_to(old)
    except ValueError:
        return None
    return new / rel


def default_live_path(snap: Path, body: dict) -> Path | None:
    """The live path a load of ``snap`` (manifest ``body``) takes without
    ``path=``: the recorded one, or its ``counterpart`` when the snapshot was
    written elsewhere (None: it records none)."""
    sto = body.get("storage") or {}
    live = sto.get("path")
    if not isinstance(live, str):
        return None
    live = Path(os.path.abspath(live))
    saved_at = sto.get("snapshot")
    if isinstance(saved_at, str):
        now_at = os.path.realpath(snap)  # a "latest" symlink: where the snapshot really is
        # The live path as recorded, else with its links resolved (a run reached through a
        # symlinked folder records the link in one path and the real folder in the other).
        moved = counterpart(live, saved_at, now_at) or counterpart(os.path.realpath(live), saved_at, now_at)
        if moved is not None:
            log.info("bigper: %s was written at %s; it loads into %s, where %s was beside the original (which "
                     "is not touched)", snap, saved_at, moved, live)
            return moved
    return live


def _check_newer(store, cfg: Config, snap_meta: dict, snap_arrays: dict, live, rewind: bool) -> None:
    """A live path whose buffer was closed holding more transitions than the
    snapshot (its ``snap_meta``), or as many but priorities changed since
    (``_priorities_changed``), or its largest leaf ever raised since (what a
    record without keys still shows, ``_raised_since``), keeps them unless
    ``rewind``: loading would discard newer data (a crashed writer's folder,
    unclean, records nothing newer that could be resumed: it is taken over
    as before)."""
    previous = store.previous
    if rewind or not isinstance(previous, dict) or previous.get("clean") is not True:
        return
    st = previous.get("state")
    held = st.get("count") if isinstance(st, dict) else None
    if not isinstance(held, int) or isinstance(held, bool) or held < 0:  # (a clean close always records it)
        raise PathExistsError(f"path={str(live)!r} holds a buffer closed cleanly whose record does not say how "
                              f"many transitions it holds (state count {str(held)[:40]!r}): it may be newer than "
                              "this snapshot. Load the snapshot into a new path=, or pass rewind=True to replace "
                              "it; nothing was changed")
    key = unit_class(cfg).status_key
    status = snap_arrays.get(key)
    if isinstance(status, np.ndarray) and status.ndim == 1:  # (a count that says less than its state holds)
        now = _recorded(store, key, len(status), status.shape, np.uint8)
        marked = int((now == LIVE).sum()) if now is not None else 0
        if marked > held:
            raise PathExistsError(f"path={str(live)!r} holds a buffer closed cleanly whose record says {held} "
                                  f"transitions while its status marks {marked} live: it may be newer than this "
                                  "snapshot. Load the snapshot into a new path=, or pass rewind=True to replace "
                                  "it; nothing was changed")
    count = snap_meta["count"]
    if held > count:
        why = (f"{held} transitions written, newer than this snapshot's {count}: loading it there would discard "
               f"the {held - count} transitions (and the priority updates) since")
    elif held < count:
        return
    elif _priorities_changed(STRATEGIES.get(cfg.prioritization), unit_class(cfg), st, store, snap_meta,
                             snap_arrays):
        why = (f"this snapshot's {count} transitions but priorities changed since (the priority of a transition "
               "live or pending at the snapshot differs): loading it there would discard them")
    elif _raised_since(st, snap_meta):
        why = (f"this snapshot's {count} transitions but priorities raised since (its largest "
               f"{st['max_leaf']:.6g}, the snapshot's {snap_meta['max_leaf']:.6g}): loading it there would "
               "discard them")
    else:
        return
    raise PathExistsError(f"path={str(live)!r} holds a buffer closed with {why}. Resume that buffer with "
                          "mode='resume', load the snapshot into a new path=, or pass rewind=True to replace it "
                          "with the snapshot; nothing was changed")


def _raised_since(meta: dict, snap_meta: dict) -> bool:
    """Whether a closed buffer's recorded ``meta`` shows priorities raised
    since the snapshot whose meta is ``snap_meta`` (same count): its largest
    leaf ever is larger. (A load ends the episodes open at the snapshot, which
    changes the ring's arrays and the leaves: a buffer loaded and closed
    untouched differs there from its snapshot, so those are not compared;
    batches drawn since, its random state, are no data of the run.)"""
    have, had = meta.get("max_leaf"), snap_meta.get("max_leaf")
    return isinstance(have, float) and isinstance(had, (int, float)) and have > had


def _priorities_changed(strategy, unit, meta: dict, store, snap_meta: dict, snap_arrays: dict) -> bool:
    """Whether the priority keys a closed buffer recorded (its state ``meta``
    and the arrays ``store.previous_arrays`` reads: hostile) differ from what
    a load of the snapshot gives, the ``strategy`` decoding both
    (``Prioritization.recorded_keys``: the leaves, a rank buffer's heap), at
    every slot (a sequence buffer's: item) of the ``unit`` live in the
    snapshot, and at every one pending there (an n-step window, an item,
    still open): a load gives those the key the snapshot kept pending for
    them, so one the closed buffer recorded live (a resume ended the open
    episode) is compared by its key, one still pending (no resume, or one
    continuing the episodes) by its recorded pending key; one set since
    differs. Each array is read on its own: one that does not read (or
    decode) leaves out only the comparison that needs it. False where none
    shows a change."""
    if strategy is None or not strategy.ARRAYS:
        return False
    status = snap_arrays.get(unit.status_key)
    if status is None or np.ndim(status) != 1:
        return False
    capacity = len(status)  # (the prioritization's slots: a sequence buffer's items)
    # (capped at the snapshot's slots: the live path's recorded capacity is as hostile as its arrays)
    have = strategy.recorded_keys(meta.get("prioritization", {}),
                                  store.previous_arrays(strategy.ARRAYS, capacity=capacity) or {}, capacity)
    had = strategy.recorded_keys(snap_meta.get("prioritization", {}), snap_arrays, capacity)
    if have is None or had is None:
        return False
    status = np.asarray(status)
    live = status == LIVE
    if not np.array_equal(have[live], had[live], equal_nan=True):
        return True
    pending = snap_arrays.get(unit.pending_key)
    was = status == PENDING
    if not (was.any() and isinstance(pending, np.ndarray) and pending.shape == status.shape):
        return False
    pending = np.asarray(pending, dtype=np.float64)
    now = _recorded(store, unit.status_key, capacity, status.shape, np.uint8)
    if now is None:
        return False
    made = was & (now == LIVE)
    if not np.array_equal(have[made], pending[made], equal_nan=True):
        return True
    still = was & (now == PENDING)
    kept = _recorded(store, unit.pending_key, capacity, status.shape, np.float64) if still.any() else None
    return kept is not None and not np.array_equal(kept[still], pending[still], equal_nan=True)


def _recorded(store, name: str, capacity: int, shape: tuple, dtype) -> np.ndarray | None:
    """The closed buffer's recorded state array ``name`` (hostile), read on
    its own; None unless it reads with exactly ``shape`` and ``dtype``."""
    a = (store.previous_arrays((name,), capacity=capacity) or {}).get(name)
    return a if isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dtype else None


def _release(store) -> None:
    """Let go of a storage that failed to load, recording nothing: a disk
    location stays marked unclean (or is removed if this load created it)."""
    store.abort()


def _allocate(cfg: Config, store, layouts: dict, snap) -> None:
    # (as core/layout.allocate, with the snapshot's frame offsets; the buffer's frame store attaches later)
    frames = _frames(cfg, layouts, snap)
    specs, growth = storage_specs(cfg, frames), storage_growth(cfg, frames)
    store.allocate(specs, growth) if growth else store.allocate(specs)


def _check_specs(store, layouts: dict, snap, cfg: Config) -> None:
    """The arrays just allocated are the snapshot's (an array that grows,
    grown first to the rows the snapshot holds of it: checked against the
    config before, ``_check_sizes``)."""
    have = specs_of(store)
    for name in storage_growth(cfg):
        if name in layouts and name in have and layouts[name][0] > have[name][0]:
            store.grow(name, layouts[name][0])
    _compare_specs(specs_of(store), layouts, snap, cfg)


def _compare_specs(have: dict, layouts: dict, snap, cfg: Config, growth=None) -> None:
    """``have`` (what the config or the storage holds) against the
    snapshot's ``layouts``; with ``growth``, ``have`` gives the most rows of
    an array that grows (``storage.base.fits_spec``)."""
    growth = growth or {}
    if set(have) != set(layouts) or not all(fits_spec(n, layouts[n], have[n], growth) for n in have):
        n = next(n for n in sorted(set(have) | set(layouts))
                 if n not in have or n not in layouts or not fits_spec(n, layouts[n], have[n], growth))
        fmt = lambda v: "absent" if v is None else f"{v[0]} rows of {v[1]} {v[2]}"  # noqa: E731
        raise IncompatibleSnapshotError(
            f"{snap}: its data does not fit the buffer its config builds (capacity {cfg.capacity}, "
            f"fields {cfg.fields}, frame_stack {cfg.frame_stack}, num_envs {cfg.num_envs}): array "
            f"{n!r} is recorded as {fmt(layouts.get(n))}, the config needs {fmt(have.get(n))}")


def _restore(cfg, body, snap, live, layouts, rewind, state):
    """The storage of the snapshot's kind, made at ``live`` (none in memory)
    and filled with its data. A disk storage takes the lock first, then looks
    at what is there (a live writer is ``StorageLockedError`` naming it;
    anything not its own is ``PathExistsError``); a dead writer's files are
    replaced only when the new ones are made, under the same lock, and put
    back if the load fails before that. A chunked storage (memmap) adopts
    the snapshot's chunk files when its chunking is the snapshot's."""
    cls = storage_class(cfg.storage)
    opts = body["storage"].get("options") or {}
    try:
        store = cls.restoring(live, opts)
    except (InvalidArgumentError, TypeError, ValueError) as e:  # options read from the snapshot: untrusted
        raise IncompatibleSnapshotError(f"{snap}: its storage options {str(opts)[:120]} do not make a "
                                        f"{cfg.storage} storage: {e}") from None
    store.open(cfg.to_dict())
    try:
        _check_previous(store.previous, cfg, live)  # previous: None in memory
        _check_newer(store, cfg, body["state"]["meta"], state, live, rewind)
        if store.chunked:
            native = store.layout(layouts, storage_growth(cfg))
            if all(native[n]["chunk_rows"] == body["data"][n]["chunk_rows"] for n in layouts):
                store.adopt({n: {**native[n], "files": [(snap / m, body["files"][m]["xxh3_64"])
                                                        for m in body["data"][n]["files"]]}
                             for n in layouts})
                _allocate(cfg, store, layouts, snap)
                return store
            # written with another chunking (another page size): copy the rows
        store.check_room(sum(body["files"][m]["size"] for rec in body["data"].values() for m in rec["files"]))
        _allocate(cfg, store, layouts, snap)
        _check_specs(store, layouts, snap, cfg)
        _fill(store, snap, body, layouts)
    except BaseException:
        _release(store)
        raise
    return store


def inspect(snap: Path, problems: list | None = None):
    """``(body, cfg, layouts, state)`` of the snapshot ``snap``: manifest,
    config, data layout, state arrays, each checked before the next is read
    (state files fully, against their checksums; data files by size only).
    An invalid recorded state raises ``CorruptSnapshotError``, or is appended
    to ``problems`` when a list is given (``verify`` reports it)."""
    body = read_manifest(snap)
    cfg = _config(body, snap)
    layouts = _layouts(body, snap)
    _check_sizes(body, snap, cfg, _refs.layouts_of(snap, cfg, layouts))
    state = _state_arrays(body, snap)
    try:
        check_state(cfg, body["state"]["meta"], state)
    except CorruptSnapshotError as e:
        if problems is None:
            raise CorruptSnapshotError(f"{snap}: {e}") from None
        problems.append(str(e))
        return body, cfg, _refs.layouts_of(snap, cfg, layouts), state
    # An older snapshot's frame references, converted in memory (the snapshot is never changed);
    # then the references of every sampleable transition checked against the frames held.
    try:
        body, layouts = _refs.convert(snap, body, cfg, layouts, state)
        _refs.check(snap, body, cfg, layouts, state)
    except CorruptSnapshotError as e:
        if problems is None:
            raise CorruptSnapshotError(f"{snap}: {e}") from None
        problems.append(str(e))
        layouts = _refs.layouts_of(snap, cfg, layouts)
    return body, cfg, layouts, state


def load(snapshot, *, path=None, rewind=False) -> "Restored":
    """The parts of the buffer saved in ``snapshot``, every byte checked:
    its config, its storage (allocated and filled, at ``path`` for disk
    storages) and its recorded state, for ``PrioritizedReplayBuffer.load``.

    Parameters
    ----------
    snapshot : str or Path
        A snapshot directory (from ``buf.save`` or ``Snapshots``).
    path : str or Path, optional
        Where a disk storage keeps its live data; default, the path recorded
        in the snapshot, or its ``counterpart`` when the snapshot was copied
        or moved since. Whatever a dead writer left there is replaced.
    rewind : bool
        Replace a buffer closed at ``path`` with more transitions than the
        snapshot (refused by default: ``PathExistsError``).

    Raises
    ------
    CorruptSnapshotError
        A file is missing, truncated or does not match its checksum.
    IncompatibleSnapshotError
        Another format version, a config this bigper cannot build, or
        ``path`` holds a buffer of another config.
    StorageLockedError
        A live writer holds ``path``.
    """
    for name, v in (("snapshot", snapshot), ("path", path)):
        if not isinstance(v, (str, os.PathLike)) and not (name == "path" and v is None):
            raise InvalidTypeError(f"{name} must be a str or os.PathLike, got {type(v).__name__} {v!r:.80}")
    snap = Path(os.path.abspath(snapshot))
    body, cfg, layouts, state = inspect(snap)
    kind = cfg.storage
    live = None
    if not storage_class(kind).in_memory:
        live = Path(os.path.abspath(path)) if path is not None else default_live_path(snap, body)
        if live is None:
            raise InvalidArgumentError(f"{snap} records no live path for its {kind} storage; pass path=")
        if os.path.islink(live):  # a fork's link to the original's folder: never written through
            raise PathExistsError(f"path={str(live)!r} is a symbolic link (to {os.readlink(live)!r}); a load "
                                  "never writes through a link: pass path= a folder of its own; nothing was changed")
        _check_apart(live, snap)
        # every byte checked before the live path changes
        check_files(snap, [(m, body["files"][m]) for rec in body["data"].values() for m in rec["files"]])
    elif path is not None:
        raise InvalidArgumentError(f"{snap} holds a storage={kind!r} buffer, which takes no path=, got {path!r}")
    # The caller's files are part of what resumes: a damaged checkpoint makes the snapshot corrupt.
    check_files(snap, [(m, body["files"][m]) for m in (body.get("user") or {}).get("files", {}).values()])
    store = _restore(cfg, body, snap, live, layouts, rewind, state)
    # (what the recorded state holds that follows from the rest is derived, not taken: layout.DERIVED)
    return Restored(snap, cfg, store, body["state"]["meta"], {n: a for n, a in state.items() if n not in DERIVED})


@dataclass(frozen=True)
class Restored:
    """A loaded snapshot's parts: a buffer is built of them, or they are released."""

    snapshot: Path
    config: Config
    storage: object
    meta: dict
    arrays: dict

    def release(self) -> None:
        """Let go of the storage, recording nothing (the buffer was refused)."""
        _release(self.storage)
