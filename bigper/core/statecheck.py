"""Validation of a recorded buffer state (from a snapshot or a reopened
storage) before any of it is used: everything read from disk is hostile
until checked. Raises ``CorruptSnapshotError`` naming the field and value.

What a buffer of config ``cfg`` can have written (``buffer.py`` ``_setup``,
``_write_chunk``; ``frames/store.py`` ``state``)::

    meta    count        int, 0 <= count < 2**62
            max_leaf     float, finite, > 0, >= every leaf
            beta_step    int, 0 <= beta_step < 2**62
            env_ended    list of num_envs bools
            rng          a PCG64 state that numpy accepts
            frames       {"fw": int} with frame stacks
    arrays  leaves       float64 (C,), finite, >= 0; 0 unless the slot is live
            gid          int64 (C,): slot s holds the newest transition number
                         g < count with g % C == s, or -1 if none was written
            status       uint8 (C,) in {empty, live, pending, dead}; empty iff gid < 0
            ends         uint8 (C,) in 0..3 (bit 0 terminated, bit 1 truncated)
            pending      float64 (C,) with n_step > 1 else (0,), finite, in [0, max_leaf]
            frames_*     the frame ring's per-env stream state (see frames/store.py)
            seq_*        with sequences: item positions, status, pending keys, each
                         env's next position and item pointer (core/sequences.py);
                         the status must be exactly what positions and ring imply

Every check is one numpy pass over the arrays (O(N)); nothing is allocated
from a recorded size before the recorded arrays are known to have it.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..frames.refs import check_offsets, refs_outside
from ..frames.store import frame_capacity
from .recorded import BIG as _BIG, array as _array, refuse as _bad
from .ring import first_wrong_gid, gid_of
from .units import unit_class
from ..common.status import DEAD, EMPTY, LIVE, PENDING  # noqa: F401

_EXACT = 1 << 53  # ints up to this are floats exactly
_BASE = ("leaves", "gid", "status", "ends", "pending")
_FRAMES = ("frames_last", "frames_last_ref", "frames_has_last", "frames_ptr")
_SEGMENTS = ("frames_seg_first", "frames_dict")  # with compression (frames/segments.py); and when the log grows:
_GROWS = ("frames_seg_slot",)
# The buffer's own arrays whatever the prioritization (its strategy adds its own).
RING_ARRAYS = tuple(n for n in _BASE if n != "leaves") + _FRAMES + _SEGMENTS + _GROWS


def _is_int(v, lo: int, hi: int) -> bool:
    """``v`` is an int (a JSON integer: not a bool, not a float) in ``[lo, hi)``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


def _int(meta: dict, key: str, lo: int = 0, hi: int = _BIG, where: str = "") -> int:
    v = meta.get(key)
    if not _is_int(v, lo, hi):
        _bad(f"{where}{key} must be an int in [{lo}, {hi}), got {v!r:.80}")
    return v


def _positive(meta: dict, key: str) -> float:
    """A finite number > 0. The writer records a float; an int is taken only
    where a float holds it exactly (JSON has no other way to tell 2**70 from
    a float, and float(2**1100) overflows)."""
    v = meta.get(key)
    ok = isinstance(v, float) or _is_int(v, -_EXACT, _EXACT + 1)
    if not ok or not math.isfinite(v) or v <= 0:
        _bad(f"{key} must be a finite number > 0, got {v!r:.80}")
    return float(v)


def _rng(state) -> None:
    if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
        _bad(f"rng must be a PCG64 state, got {str(state)[:80]!r}")
    # numpy casts what it is given (a float state 1.5 becomes 1): the types are checked first
    inner = state.get("state")
    if not isinstance(inner, dict) or not all(_is_int(inner.get(k), 0, 1 << 128) for k in ("state", "inc")) \
            or not _is_int(state.get("has_uint32"), 0, 2) or not _is_int(state.get("uinteger"), 0, 1 << 32):
        _bad(f"rng state needs ints state, inc in [0, 2**128), has_uint32 0 or 1 and uinteger in "
             f"[0, 2**32), got {str(state)[:160]}")
    try:
        np.random.PCG64().state = state  # numpy's own check of every field
    except Exception as e:  # noqa: BLE001  (any refusal by numpy is a corrupt state)
        _bad(f"rng state is not one numpy accepts: {str(e)[:120]}")


def check_state(cfg, meta: dict, arrays: dict) -> None:
    """Check the JSON counters ``meta`` and the bookkeeping ``arrays`` of a
    buffer with config ``cfg``; raise ``CorruptSnapshotError`` on anything a
    buffer could not have written.

    Parameters
    ----------
    cfg : Config
        The buffer's validated config (capacity, n_step, num_envs, frame_stack).
    meta : dict
        ``state_dict()[0]`` as recorded (JSON).
    arrays : dict
        name -> ndarray, ``state_dict()[1]`` as recorded.
    """
    if not isinstance(meta, dict) or not isinstance(arrays, dict):
        _bad(f"meta and arrays must be a dict, got {type(meta).__name__} and {type(arrays).__name__}")
    c, envs = cfg.capacity, cfg.num_envs
    kind = getattr(cfg, "prioritization", "proportional")
    compressed = getattr(cfg, "compression", None)
    want = set(_BASE) | (set(_FRAMES) if cfg.frame_stack else set()) \
        | (set(_SEGMENTS) if compressed else set()) \
        | ({"frames_seg_slot"} if compressed and getattr(cfg, "compression_budget", 0) is None else set())
    unit = unit_class(cfg)
    want |= set(unit.ARRAYS)
    have = set(arrays)
    if "pending" not in have and cfg.n_step == 1:  # not recorded by early format-1 writers
        have.add("pending")
        arrays = {**arrays, "pending": np.zeros(0, np.float64)}
    derived = "gid" not in have  # not written to disk since issue 43 (layout.DERIVED): it follows from count
    have.add("gid")
    if cfg.frame_stack and "frames_minref" in have:  # (in memory, and on disk before issue 43: checked below)
        have.discard("frames_minref")
    if kind != "proportional":
        # Another prioritization keeps its own arrays (checked by its restore); the
        # buffer's own ones must all be there.
        want.discard("leaves")
        if not want <= have:
            _bad(f"arrays {sorted(have)} lack {sorted(want - have)}")
    elif have != want:
        _bad(f"arrays {sorted(have)} differ from the expected {sorted(want)}")
    if not isinstance(meta.get("prioritization", {}), dict):
        _bad(f"prioritization must be a dict, got {str(meta.get('prioritization'))[:80]}")

    count = _int(meta, "count")
    _int(meta, "beta_step")
    top = _positive(meta, "max_leaf")
    if cfg.prioritization == "proportional" and top > sys.float_info.max / c:
        _bad(f"max_leaf {top!r} is above float max / capacity ({sys.float_info.max / c:.6g}): "
             "a sum of capacity such leaves overflows")
    ended = meta.get("env_ended")
    if not isinstance(ended, list) or len(ended) != envs or not all(isinstance(e, bool) for e in ended):
        _bad(f"env_ended must be a list of {envs} bools, got {str(ended)[:80]}")
    _rng(meta.get("rng"))

    gid = None if derived else _array(arrays, "gid", np.int64, (c,))
    status = _array(arrays, "status", np.uint8, (c,))
    ends = _array(arrays, "ends", np.uint8, (c,))
    pending = _array(arrays, "pending", np.float64, (c if cfg.n_step > 1 else 0,))

    # Every key the buffer writes counts toward max_leaf, so a pending one never exceeds it.
    bad = np.flatnonzero(~((pending >= 0) & (pending <= top)))
    if bad.size:
        _bad(f"pending[{bad[0]}] = {pending[bad[0]]!r} (a pending leaf is finite, >= 0 and <= max_leaf {top!r})")
    bad = np.flatnonzero(status > DEAD)
    if bad.size:
        _bad(f"status[{bad[0]}] = {status[bad[0]]} (not one of 0 empty, 1 live, 2 pending, 3 dead)")
    bad = np.flatnonzero(ends > 3)
    if bad.size:
        _bad(f"ends[{bad[0]}] = {ends[bad[0]]} (episode-end flags are 0..3)")
    s = -1 if derived else first_wrong_gid(gid, count)
    if s >= 0:
        _bad(f"gid[{s}] = {gid[s]}, but after count {count} slot {s} holds transition "
             f"{int(gid_of(np.int64(s), count, c))}")
    # A slot is written iff it is below count (gid >= 0): checked without building a
    # derived gid, which a 50M ring's check would hold whole (400 MB) for nothing.
    bad = _first_unwritten_mismatch(status, count)
    if bad >= 0:
        _bad(f"slot {bad} has gid {int(gid_of(np.int64(bad), count, c))} and status {status[bad]} "
             "(written iff not empty)")
    leafy = unit.check_recorded(cfg, arrays, count, gid, status, ends, top)  # (the unit's own arrays)
    if "leaves" in arrays:
        _check_leaves(_array(arrays, "leaves", np.float64, (c,)), leafy, top)
    if cfg.n_step == 1 and (status == PENDING).any():
        _bad(f"slot {np.flatnonzero(status == PENDING)[0]} waits for an n-step window, but n_step is 1")
    if cfg.frame_stack:
        _check_frames(cfg, meta, arrays, count, status)


def _first_unwritten_mismatch(status: np.ndarray, count: int) -> int:
    """The first slot that is empty but below ``count``, or written but not, or -1."""
    n = min(count, status.shape[0])
    for lo, part, wrong in ((0, status[:n], True), (n, status[n:], False)):
        mismatch = (part == EMPTY) == wrong  # (argmax: no index array of a ring of mismatches)
        i = int(mismatch.argmax()) if mismatch.size else 0
        if mismatch.size and mismatch[i]:
            return lo + i
    return -1


def _check_leaves(leaves: np.ndarray, status: np.ndarray, top: float) -> None:
    bad = np.flatnonzero(~np.isfinite(leaves) | (leaves < 0))
    if bad.size:
        _bad(f"leaves[{bad[0]}] = {leaves[bad[0]]!r} (a leaf is finite and >= 0)")
    bad = np.flatnonzero((leaves > 0) & (status != LIVE))
    if bad.size:
        _bad(f"slot {bad[0]} has leaf {leaves[bad[0]]!r} but status {status[bad[0]]}: only a live "
             "transition can be sampled")
    if leaves.size and leaves.max() > top:
        _bad(f"max_leaf {top!r} is below the largest leaf {leaves.max()!r}")
    with np.errstate(over="ignore"):
        total = float(leaves.sum())
    if not np.isfinite(total):
        _bad("the leaves sum to more than the largest float: no probability could be computed")


def _check_frames(cfg, meta: dict, arrays: dict, count: int, status: np.ndarray) -> None:
    """The frame ring's stream state (``frames/store.py`` ``FrameStore.state``)."""
    k, envs, c = cfg.frame_stack, cfg.num_envs, cfg.capacity
    fm = meta.get("frames")
    if not isinstance(fm, dict):
        _bad(f"frames must be a dict with frame stacks, got {str(fm)[:80]}")
    # Each transition writes at most the 2k frames of its two stacks.
    fw = _int(fm, "fw", 0, 2 * k * count + 1, where="frames.")
    shape = cfg.shape("obs")
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * cfg.dtype("obs").itemsize
    _array(arrays, "frames_last", np.uint8, (envs, k, row_bytes))
    last_ref = _array(arrays, "frames_last_ref", np.int64, (envs, k))
    has_last = _array(arrays, "frames_has_last", np.bool_, (envs,))
    ptr = _array(arrays, "frames_ptr", np.int64, (envs,))
    live = last_ref[has_last]
    if live.size and (live.min() < 0 or live.max() >= fw):
        _bad(f"frames_last_ref holds a frame outside the {fw} frames written")
    e = np.arange(envs, dtype=np.int64)
    bad = np.flatnonzero((ptr < 0) | (ptr % envs != e) | (ptr >= count + envs))
    if bad.size:
        _bad(f"frames_ptr[{bad[0]}] = {ptr[bad[0]]} (env {bad[0]}'s expiry pointer after {count} steps)")
    # The references are data, not state: frame_ref / frame_off are checked where they are read
    # (FrameStore.restore, a snapshot's check_refs). Each slot's oldest one is a state array only
    # in memory (and in files before issue 43): checked when given.
    lo = fw - frame_capacity(c, k, envs)
    if getattr(cfg, "compression", None):
        lo = max(lo, _check_segments(cfg, fm, arrays, fw, row_bytes))
    if "frames_minref" in arrays:
        refs = _array(arrays, "frames_minref", np.int64, (c,))[(status == LIVE) | (status == PENDING)]
        if refs.size and (refs.min() < max(lo, 0) or refs.max() >= fw):
            _bad(f"frames_minref: a sampleable transition references frames outside the ring "
                 f"[{max(lo, 0)}, {fw})")


def check_refs(cfg, meta: dict, arrays: dict, frame_ref: np.ndarray, frame_off: np.ndarray) -> None:
    """A recorded state's frame references (the data arrays ``frame_ref``
    ``(C,)`` and ``frame_off`` ``(C, k or 2k)`` of ``frames/store.py``, read
    from disk) after ``check_state``: their dtypes and shapes, and every live
    or pending transition referencing only frames still stored.

    Raises
    ------
    CorruptSnapshotError
        Naming the array, or the first slot and its frames.
    """
    c, k = cfg.capacity, cfg.frame_stack
    n_off = k * (2 if "obs" in cfg.next_of else 1)
    fref = _array({"frame_ref": frame_ref}, "frame_ref", np.int64, (c,))
    try:  # the config's offsets, or wider ones (a buffer converted from the older format keeps them)
        dt = check_offsets(getattr(frame_off, "dtype", None), k, cfg.num_envs)
    except (TypeError, ValueError) as e:
        _bad(str(e))
    foff = _array({"frame_off": frame_off}, "frame_off", dt, (c, n_off))
    fm = meta["frames"]
    fw = int(fm["fw"])
    lo = fw - frame_capacity(c, k, cfg.num_envs)
    if getattr(cfg, "compression", None):
        shape = cfg.shape("obs")
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * cfg.dtype("obs").itemsize
        lo = max(lo, _check_segments(cfg, fm, arrays, fw, row_bytes))
    status = arrays["status"]
    wrong, _ = refs_outside(fref, foff, (status == LIVE) | (status == PENDING), max(lo, 0), fw)
    if wrong:
        _bad(wrong)


def _check_segments(cfg, fm: dict, arrays: dict, fw: int, row_bytes: int) -> int:
    """The segment log's state (``frames/segments.py`` ``SegmentLog.state``); returns
    the oldest frame still in the log. (The slots against the storage's:
    ``SegmentLog.restore``.)"""
    from ..frames.segments import log_geometry

    F = frame_capacity(cfg.capacity, cfg.frame_stack, cfg.num_envs)
    _block, seg, S = log_geometry(F, row_bytes, cfg.compression_budget)
    g = _int(fm, "seg", 0, fw + 1, where="frames.")  # a segment opens only for a frame
    _int(fm, "pos", 0, seg + 1, where="frames.")
    first = _array(arrays, "frames_seg_first", np.int64, (S,))
    _check_dictionaries(fm, arrays.get("frames_dict"))
    if cfg.compression_budget is None:  # a log that grows: its oldest live segment, each one's slot
        lo = _int(fm, "seg_lo", max(0, g - S + 1), g + 1, where="frames.")
        slots = _array(arrays, "frames_seg_slot", np.int64, (S,))[np.arange(lo, g + 1) % S]
        if (slots < 0).any() or (slots >= S).any() or np.unique(slots).size != slots.size:
            _bad(f"frames_seg_slot: the live segments {lo}..{g} lie in slots {slots[:8].tolist()}, not "
                 f"distinct ones in [0, {S})")
    else:
        lo = max(0, g - S + 1)
    seq = first[np.arange(lo, g + 1) % S]
    if lo == 0:
        seq = seq.copy()
        seq[0] = 0  # (segment 0 starts at frame 0, whatever its row says)
    if seq.size and ((seq < 0).any() or (seq > fw).any() or (np.diff(seq) < 0).any()):
        _bad(f"frames_seg_first: the live segments' first frames {seq[:8].tolist()} are not "
             f"increasing within [0, {fw}]")
    return int(seq[0]) if lo > 0 else 0


def _check_dictionaries(fm: dict, d) -> None:
    """The dictionaries' record (``dictionaries.Dictionaries.state``): the
    bytes of generations ``dicts_first ..`` one after another, ``dict_sizes``
    each; a record of format 1 without them holds one dictionary or none."""
    from ..frames.dictionaries import DICT_LIMIT, MAX_DICTS, MAX_GEN

    if not isinstance(d, np.ndarray) or d.dtype != np.uint8 or d.ndim != 1 or d.size > MAX_DICTS * DICT_LIMIT:
        _bad(f"frames_dict must be uint8 of at most {MAX_DICTS * DICT_LIMIT} bytes, got "
             f"{getattr(d, 'dtype', type(d).__name__)} {getattr(d, 'shape', '')}")
    keys = {"dicts_first", "dict_sizes", "dict_base"} & set(fm)
    if not keys:
        if d.size > DICT_LIMIT:
            _bad(f"frames_dict holds one dictionary of at most {DICT_LIMIT} bytes, got {d.size}")
        return
    if len(keys) != 3:
        _bad(f"frames.dicts_first, dict_sizes and dict_base go together, got only {sorted(keys)}")
    first = _int(fm, "dicts_first", 1, MAX_GEN + 1, where="frames.")
    sizes = fm["dict_sizes"]
    if not isinstance(sizes, list) or len(sizes) > MAX_DICTS or not all(_is_int(v, 8, DICT_LIMIT + 1) for v in sizes):
        _bad(f"frames.dict_sizes must be a list of at most {MAX_DICTS} sizes in [8, {DICT_LIMIT}], got {sizes!r:.80}")
    if first + len(sizes) - 1 > MAX_GEN:  # an index entry holds generations up to MAX_GEN
        _bad(f"frames.dicts_first {first} with {len(sizes)} dictionaries goes past generation {MAX_GEN}")
    if sum(sizes) != d.size:
        _bad(f"frames.dict_sizes {sizes} add up to {sum(sizes)} bytes, frames_dict holds {d.size}")
    base = fm["dict_base"]
    if base is not None and not (isinstance(base, (int, float)) and not isinstance(base, bool)
                                 and np.isfinite(base) and base >= 0):
        _bad(f"frames.dict_base must be null or a finite number >= 0, got {base!r:.80}")
    retry = fm.get("dict_retry", [0, 0])  # (absent from states recorded before it was)
    if not isinstance(retry, list) or len(retry) != 2 or not all(_is_int(v, 0, _BIG) for v in retry):
        _bad(f"frames.dict_retry must be [next frame, wait] of two ints >= 0, got {retry!r:.80}")
