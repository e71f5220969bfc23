"""A live storage of the older format, whose frame references are whole, converted at open.

Before issue 43 a transition's frame references were stored whole
(``obs_ref`` and ``next_obs_ref``, int64 ``(C, k)`` each) and ``gid`` and
``frames_minref`` were recorded; now they are one id and offsets
(``frame_ref``, ``frame_off``: ``frames/refs.py``) and the two state arrays
are derived. A run folder an older bigper wrote keeps opening: its
references are read (a regular file of the record's layout, or the error
naming it), converted (``refs_from_stacks``: wider offsets where an older
writer reused a frame from far back) and checked (every live or pending
transition referencing frames still stored, ``statecheck.check_refs``)
before anything changes; then the storage records the new arrays
(``convert``): a writer in place, journaled so that a kill -9 leaves the old
folder or the new one (``storage/_relayout.py``), a reader in memory.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptSnapshotError, IncompatibleSnapshotError
from ..frames.refs import refs_from_stacks
from ..common.status import LIVE, PENDING
from .statecheck import check_refs

LEGACY = ("obs_ref", "next_obs_ref")  # the older format's names (core/layout.LEGACY_NAMES)
OLD_STATE = ("gid", "frames_minref")  # recorded by the older format, derived now (core/layout.DERIVED)


def is_older(cfg, arrays) -> bool:
    """Whether a storage's record of its ``arrays`` (name -> layout) is the
    older format's: frame references whole, none of the current ones."""
    return bool(cfg.frame_stack) and isinstance(arrays, dict) and "frame_ref" not in arrays \
        and any(n in arrays for n in LEGACY)


def check_layout(cfg, arrays: dict, where) -> tuple[str, ...]:
    """The older arrays a buffer of ``cfg`` reads (``obs_ref``, and
    ``next_obs_ref`` with next_obs stacks), each recorded as ``(capacity,
    k)`` native int64 rows; ``IncompatibleSnapshotError`` naming the first
    that is not (or that is there without next_obs stacks)."""
    names = LEGACY if "obs" in cfg.next_of else LEGACY[:1]
    c, k = cfg.capacity, cfg.frame_stack
    for name in LEGACY:
        rec = arrays.get(name)
        if rec is None and name not in names:
            continue
        ok = isinstance(rec, dict) and name in names
        if ok:
            try:
                dt = np.dtype(rec.get("dtype"))
                ok = rec.get("rows") == c and list(rec.get("shape") or ()) == [k] and dt == np.int64 and dt.isnative
            except (TypeError, ValueError):
                ok = False
        if not ok:
            got = "absent" if rec is None else {key: rec.get(key) for key in ("rows", "shape", "dtype")} \
                if isinstance(rec, dict) else str(rec)[:80]
            raise IncompatibleSnapshotError(
                f"{where}: its frame references in the older format ({name}) are recorded as {got}; a buffer of "
                f"this config reads {('(%d, %d) int64' % (c, k)) if name in names else 'none'} (nothing was changed)")
    return names


def convert(cfg, store, recorded: dict, state: tuple[dict, dict], where) -> np.dtype:
    """Convert the older references of ``store`` (opened, not allocated;
    ``recorded``: what it recorded; ``state``: its recorded state, checked by
    ``check_state``) and record the new ones (``store.convert``); returns the
    offsets' dtype. Refused before anything changes: arrays of another
    layout (``IncompatibleSnapshotError``), a live or pending transition
    referencing frames not stored (``CorruptSnapshotError`` naming the slot),
    a chunk file that is not a regular file of its size (the storage's error
    naming it)."""
    names = check_layout(cfg, recorded["arrays"], where)
    meta, arrays = state
    status = arrays["status"]
    used = (status == LIVE) | (status == PENDING)
    stacks = [store.recorded_array(n) for n in names]
    try:
        fref, foff = refs_from_stacks(stacks, cfg.frame_stack, cfg.num_envs, used)
        check_refs(cfg, meta, arrays, fref, foff)
    except (ValueError, CorruptSnapshotError) as e:
        raise CorruptSnapshotError(f"{where}: its frame references ({' / '.join(names)}, the older format) "
                                   f"cannot be read: {e} (nothing was changed)") from None
    old_state = tuple(n for n in OLD_STATE if n in arrays)  # (recorded, so on disk: they go too)
    store.convert({"frame_ref": fref, "frame_off": foff}, names, old_state)
    return foff.dtype
