"""A snapshot's frame references: read, converted from the older format, checked.

Since issue 43 a transition's frame references are one frame id and small
offsets (``frame_ref``, ``frame_off``: ``frames/store.py``). A snapshot
written before records them whole (``obs_ref`` and ``next_obs_ref``, int64
``(C, k)`` each); a load converts them in memory (``refs_from_stacks``) and
never changes the snapshot: its data records are replaced, in the manifest
body this load works from, by two records that hold the converted arrays
(``"array"``) and no files, which ``_load._fill`` copies into the storage.

Either way the references are data read from disk: before anything is
allocated, every live or pending transition must reference only frames the
snapshot still holds (``statecheck.check_refs``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CorruptSnapshotError, IncompatibleSnapshotError
from ..core.statecheck import check_refs
from ..frames.refs import offset_dtype, refs_from_stacks
from ..common.status import LIVE, PENDING
from .manifest import check_file

LEGACY = ("obs_ref", "next_obs_ref")


def read_array(snap: Path, body: dict, name: str, layout: tuple) -> np.ndarray:
    """The whole data array ``name`` of the snapshot (every file checked against its checksum)."""
    rec = body["data"][name]
    if "array" in rec:
        return rec["array"]
    rows, shape, dt = layout
    parts = [np.frombuffer(check_file(snap, m, body["files"][m], keep=True), dtype=dt) for m in rec["files"]]
    flat = np.concatenate(parts) if parts else np.zeros(0, dt)
    return flat.reshape((rows, *shape))


def layouts_of(snap: Path, cfg, layouts: dict) -> dict:
    """``layouts`` as the arrays will be once ``convert`` ran: an older
    snapshot's ``obs_ref`` / ``next_obs_ref`` (checked: the config's ``(C,
    k)`` int64) as ``frame_ref`` / ``frame_off`` of the config.

    Raises
    ------
    IncompatibleSnapshotError
        The old arrays are not the ones the config needs.
    """
    if not cfg.frame_stack or "obs_ref" not in layouts or "frame_ref" in layouts:
        return layouts
    c, k = cfg.capacity, cfg.frame_stack
    names = LEGACY if "obs" in cfg.next_of else LEGACY[:1]
    want = (c, (k,), np.dtype(np.int64))
    for name in LEGACY:
        have = layouts.get(name)
        if (name in names) != (have is not None) or (have is not None and tuple(have) != want):
            raise IncompatibleSnapshotError(
                f"{snap}: its frame references ({name}) are recorded as {have}, the config needs "
                f"{want if name in names else 'none'}")
    out = {n: v for n, v in layouts.items() if n not in LEGACY}
    dt = offset_dtype(k, cfg.num_envs)
    out["frame_ref"] = (c, (), np.dtype(np.int64))
    out["frame_off"] = (c, (k * len(names),), dt)
    return out


def convert(snap: Path, body: dict, cfg, layouts: dict, state: dict) -> tuple[dict, dict]:
    """``(body, layouts)`` with an older snapshot's ``obs_ref`` /
    ``next_obs_ref`` records (checked by ``layouts_of``) replaced by
    ``frame_ref`` / ``frame_off`` records holding the converted arrays (the
    snapshot is unchanged; so are a newer snapshot's ``body`` and
    ``layouts``, returned as they are).

    The offsets are the config's, or wider where a live transition's
    references lie further apart than those hold (``refs_from_stacks``).

    Raises
    ------
    CorruptSnapshotError
        A live or pending transition references a negative frame id.
    """
    data = body["data"]
    if not cfg.frame_stack or "obs_ref" not in data or "frame_ref" in data:
        return body, layouts
    names = [n for n in LEGACY if n in data]
    status = state.get("status")
    used = (status == LIVE) | (status == PENDING) if isinstance(status, np.ndarray) and \
        status.shape == (cfg.capacity,) else np.zeros(cfg.capacity, dtype=bool)  # (refused by check_state)
    try:
        fref, foff = refs_from_stacks([read_array(snap, body, n, layouts[n]) for n in names], cfg.frame_stack,
                                      cfg.num_envs, used)
    except ValueError as e:
        raise CorruptSnapshotError(f"its frame references (obs_ref / next_obs_ref, the older format) cannot be "
                                   f"converted: {e}") from None
    data = {n: r for n, r in data.items() if n not in LEGACY}
    layouts = layouts_of(snap, cfg, layouts)
    layouts["frame_off"] = (cfg.capacity, tuple(foff.shape[1:]), foff.dtype)
    for name, a in (("frame_ref", fref), ("frame_off", foff)):
        data[name] = {"rows": cfg.capacity, "shape": list(a.shape[1:]), "dtype": a.dtype.str, "chunk_rows": None,
                      "files": [], "array": a}
    return {**body, "data": data}, layouts


def check(snap: Path, body: dict, cfg, layouts: dict, state: dict) -> None:
    """Every live or pending transition of the snapshot references only
    frames it holds (``statecheck.check_refs``; ``CorruptSnapshotError``)."""
    if not cfg.frame_stack or "frame_ref" not in layouts or "frame_off" not in layouts:
        return  # (a layout the config does not fit was refused before)
    refs = [read_array(snap, body, n, layouts[n]) for n in ("frame_ref", "frame_off")]
    check_refs(cfg, body["state"]["meta"], state, *refs)
