"""Compressed frames in a log of segments, with random access by frame id.

With ``compression="zstd"`` the frame ring holds no raw frames. Each new frame
is compressed on its own (zstd, level 3, a content checksum, a dictionary
once one is trained) and appended to a log of segments of ``SEG`` bytes,
written in order; a frame never straddles two segments. Frame ``f``'s index
row ``f % F`` says where it is::

    frame_log    (A * SEG / BLOCK, BLOCK) uint8   A allocated segment slots, BLOCK bytes a row
    frame_index  (F, 1) int64                     offset << 23 | length << 7 | dictionary code
                 (F, 2) int64                     [offset, length | dictionary << 32]: wide

    segments (ids):  lo    lo+1   ...   g (open)
    their slots:     [3]   [0]    ...   [5: f f f f ....free....]     free slots: 1, 4

Segment ``g`` lives in slot ``seg_slot[g % S]`` and starts with frame
``seg_first[g % S]``. When a frame does not fit in the open segment, segment
``g + 1`` opens in the lowest free slot. Which slots are free follows from
the frames the ring still holds: segment ``lo`` is released once every frame
in it is older than the newest ``F`` (its transitions expired with them), so
a log that grows (no ``compression_budget``, the default) keeps every frame a
sampleable transition needs, whatever the frames compress to: ``capacity``
is a promise. Without a free slot it allocates one (``_open_ahead``: the
storage grows by one segment, and a log of ``SPARE_FROM`` slots or more by a
few spare ones beyond (``spare``, kept by ``trim``), really reserved on disk, so a full disk is an
``OSError`` naming the file before anything changed), up to the ``S`` slots
``F`` frames that do not compress would need; a storage that does not grow
(``rows`` None: ``storage/base.py``) holds all ``S`` from the start, and an
append that fails later in its write gives a growth back (``common.undo``). A log with a budget has
``S`` slots from its creation and never grows: slot ``g % S``, and the
segment that lived there is released whole when ``g`` opens, expired or not
(frames that compress worse than the budget cost capacity then: said once).

An index entry is one int64 (``put_entry``, ``split_entries``): the byte
offset in the log (40 bits), the length (16) and the dictionary generation's
code (7: 0 for none, else ``(gen - 1) % 127 + 1``; the live generations span
fewer than ``MAX_DICTS``, so the newest one names it). A log whose frames or
bytes do not fit those bits (a frame over 64 KiB, a log over 1 TiB), and
every log an older bigper wrote, keeps two (``wide``): the offset, and the
length with the generation whole above bit 32. The storage's rows say which
(``index_width``); a log keeps the layout it was made with.

Sealed segments never change, so a snapshot of a memmap storage hard-links
their chunk files, and copy-on-write touches only the segments written.

A frame that does not shrink is a zstd frame too (raw blocks, a few bytes
more than the frame, ``_zstd.bound``), so every frame carries its checksum.

Everything read back from the index is checked before the log is touched:
an offset or a length outside the allocated log or across a segment's end
fails the read with ``CorruptSnapshotError``, as does a frame that does not
decompress to exactly its bytes (or whose checksum fails). When a buffer is
restored (``load``, resume, ``bigper verify``) the whole live index is checked
against the segment state (``check_index``): each frame in the segment
``seg_first`` puts it in, right after the frame before it, the open segment
ending at ``pos``; the dictionary generations the frames name must be
recorded ones, non-decreasing in frame order, each one zstd accepts and that
decodes the frames that name it.

Dictionaries (``frames/dictionaries.py``): one given by the user is generation 1
from the first frame; else one is trained on the first ``TRAIN_FRAMES``
frames, and every ``TRAIN_FRAMES`` frames after that a new one is trained
and adopted only where it pays (``maybe_train``; the training in a thread,
``frames/look.py``, its outcome applied at the next look). Frames keep the
generation they were written with.

An add of a few rows whose frames fit in the open segment (not near a look,
not a capped log) is written in one compiled call (``append_staged``, from
``FrameStore.logged_args``, in ``core/writer.write_rows_logged``); anything else takes ``append``.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from typing import NamedTuple

import numpy as np

from . import zstd as _zstd
from .zstd import compress_rows, decompress_rows
from . import dictionaries
from . import look as _look
from .budget import log_geometry
from ..common.kernels import kernel
from ..common.pool import for_ranges
from .dictionaries import MAX_DICTS, Dictionaries
from ..errors import CorruptSnapshotError
from ..common.undo import Journal

log = logging.getLogger("bigper")

DICT_BYTES = 16384
TRAIN_FRAMES = 1000  # frames between two looks at the dictionary (and the frames a candidate is measured on)
TRAIN_SAMPLE = 500  # frames a candidate is trained on at most
MIN_LOOK = 64  # frames in the log at least for a look (half to train a candidate on, half to measure it)
LEN_MASK = (1 << 32) - 1  # a wide entry's length (its generation above)
CODE_BITS, LEN_BITS = 7, 16  # a packed entry: offset << OFF_SHIFT | length << CODE_BITS | code
OFF_SHIFT = CODE_BITS + LEN_BITS
GEN_CODES = (1 << CODE_BITS) - 1  # generation codes 1..127 (0: no dictionary)
PACKED_LEN = (1 << LEN_BITS) - 1  # the longest frame a packed entry holds
PACKED_BYTES = 1 << (63 - OFF_SHIFT)  # the largest log a packed entry points into (1 TiB)
SPARE_FROM, SPARE_MAX = 64, 16  # a growing log of 64 slots or more grows slots // 64 spare ones (16 at most)
DECODE_CHUNK = 32  # frames per thread at least in a decode


# The log's counters, one int64 array (``SegmentLog.st``) that ``place`` updates in place.
POS, G, LO, A = 0, 1, 2, 3  # bytes used in the open segment, its id, the oldest live one's, slots allocated


@kernel
def place(lengths, f0, F, seg, capped, st, seg_first, seg_slot, used, offsets):
    """Offsets in the log of frames ``f0, f0 + 1, ...`` of ``lengths``,
    appended from the open segment; a frame that does not fit opens the next
    segment (see the module docstring): expired segments are released (not
    when ``capped``), the lowest free slot taken, else slot ``st[A]`` (the
    log grows: ``st[A] + 1`` slots), else (capped, or all ``S`` slots in use)
    the oldest segment's. Updates ``st``, ``seg_first``, ``seg_slot``,
    ``used``; returns how many segments were released while they still held
    one of the newest ``F`` frames (the capacity a capped log cost)."""
    S = seg_first.shape[0]
    pos, g, lo, n = st[POS], st[G], st[LO], st[A]
    forced = 0
    for i in range(lengths.shape[0]):
        ln = lengths[i]
        if pos + ln > seg:
            f = f0 + i  # the frame that opens segment g + 1
            if not capped:
                while lo < g and seg_first[(lo + 1) % S] <= f + 1 - F:
                    used[seg_slot[lo % S]] = 0
                    lo += 1
            s = -1
            for j in range(n):
                if used[j] == 0:
                    s = j
                    break
            if s < 0:
                if n < S and not capped:
                    s = n
                    n += 1
                else:
                    if seg_first[(lo + 1) % S] > f + 1 - F:
                        forced += 1
                    s = seg_slot[lo % S]
                    used[s] = 0
                    lo += 1
            g += 1
            seg_first[g % S] = f
            seg_slot[g % S] = s
            used[s] = 1
            pos = 0
        offsets[i] = seg_slot[g % S] * seg + pos
        pos += ln
    st[POS], st[G], st[LO], st[A] = pos, g, lo, n
    return forced


@kernel
def gen_code(gen):
    """A packed entry's code of dictionary generation ``gen`` (0: none)."""
    return 0 if gen == 0 else (gen - 1) % GEN_CODES + 1


@kernel
def put_entry(index, r, o, ln, gen):
    """Index row ``r`` (packed when ``index`` has one column, else wide):
    offset ``o``, length ``ln``, dictionary generation ``gen``."""
    if index.shape[1] == 1:
        index[r, 0] = (o << OFF_SHIFT) | (ln << CODE_BITS) | gen_code(gen)
    else:
        index[r, 0] = o
        index[r, 1] = ln | (gen << 32)


@kernel
def read_entry(index, r, ghi):
    """``(offset, length, generation)`` of index row ``r``; a packed code is
    the generation of the 127 up to ``ghi`` (the newest) that has it, -1
    where that would be none (below 1). Checks nothing (``gather_index`` does)."""
    v = index[r, 0]
    if index.shape[1] != 1:
        w = index[r, 1]
        return v, w & LEN_MASK, w >> 32
    c = v & GEN_CODES
    d = 0 if c == 0 else ghi - (gen_code(ghi) - c) % GEN_CODES
    return v >> OFF_SHIFT, (v >> CODE_BITS) & PACKED_LEN, d if c == 0 or d >= 1 else -1


@kernel
def put_entries(index, offsets, lengths, gen):
    """Index rows ``0 .. n - 1`` of frames at ``offsets`` of ``lengths`` and generation ``gen``."""
    for i in range(offsets.shape[0]):
        put_entry(index, i, offsets[i], lengths[i], gen)


def split_entries(entries: np.ndarray, ghi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(offsets, lengths, generations)`` of index rows ``entries`` ((n, 1)
    or (n, 2) int64), as ``read_entry`` reads each."""
    e = np.asarray(entries, dtype=np.int64)
    if e.shape[1] != 1:
        return e[:, 0], e[:, 1] & LEN_MASK, e[:, 1] >> 32
    v = e[:, 0]
    c = v & GEN_CODES
    top = 0 if ghi == 0 else (ghi - 1) % GEN_CODES + 1
    d = ghi - (top - c) % GEN_CODES
    return v >> OFF_SHIFT, (v >> CODE_BITS) & PACKED_LEN, np.where(c == 0, 0, np.where(d >= 1, d, -1))


def index_width(held, max_len: int, log_bytes: int) -> int:
    """Columns of ``frame_index``: a new log's (``held`` None) 1 where its
    frames (``max_len`` bytes at most) and bytes fit a packed entry, else 2;
    a held one's row shape (read from disk: untrusted) ``(1,)`` where they
    fit, or ``(2,)``. Raises ``ValueError`` naming ``frame_index`` otherwise."""
    fits = max_len <= PACKED_LEN and log_bytes <= PACKED_BYTES
    if held is None:
        return 1 if fits else 2
    shape = tuple(held) if isinstance(held, (tuple, list)) else None
    if shape is not None and all(type(x) is int for x in shape) and (shape == (2,) or (shape == (1,) and fits)):
        return shape[0]
    raise ValueError(f"frame_index rows of shape {held!r}: this bigper keeps (2,) or, for frames of "
                     f"{PACKED_LEN} bytes at most in a log of {PACKED_BYTES} at most, (1,) (frames of "
                     f"{max_len} bytes, a log of {log_bytes} at most here)")


@kernel
def put_rows(scratch, lengths, offsets, log, index, F, f0, did):
    """The compressed frames in ``scratch`` (one after another) at their
    ``offsets`` in the log, and their index rows ``index[f % F]`` (of more
    than ``F`` frames the newest win)."""
    src = 0
    for i in range(lengths.shape[0]):
        o, ln = offsets[i], lengths[i]
        log[o:o + ln] = scratch[src:src + ln]
        put_entry(index, (f0 + i) % F, o, ln, did)
        src += ln


class StagedLog(NamedTuple):
    """The open segment as ``append_staged`` writes it (``SegmentLog.staged_args``)."""

    cctx: int  # the compression context of the newest dictionary (a ZSTD_CCtx pointer)
    st: np.ndarray  # the log's counters
    seg: int  # bytes a segment
    seg_first: np.ndarray  # each segment slot's first frame
    seg_slot: np.ndarray  # each segment's slot
    used: np.ndarray  # each slot's bytes in use
    flat: np.ndarray  # the storage's log bytes, flat
    index: np.ndarray  # (F, 1 or 2) int64: each frame's entry (``put_entry``)
    did: int  # the newest dictionary's generation


@kernel
def append_staged(log, staged, scratch, f0, n):
    """Frames ``f0 .. f0 + n - 1``, raw in rows ``(f0 + i) % R`` of ``staged``
    ``(R, row_bytes)``, compressed (into ``scratch``, room for ``n`` frames
    that do not shrink) and appended to the open segment with their index
    rows, when they all fit in it; nothing changes otherwise. ``log``: the
    log's ``StagedLog`` (``SegmentLog.staged_args``). Returns 0, or -1 (they
    do not fit: the caller takes the general path), or -2 (zstd failed)."""
    log = StagedLog(*log)  # (a plain tuple at the call: common/kernels.py says why)
    cctx, st, seg, seg_first, seg_slot, used = log.cctx, log.st, log.seg, log.seg_first, log.seg_slot, log.used
    flat, index, did = log.flat, log.index, log.did
    R = staged.shape[0]
    F = index.shape[0]
    lengths = np.empty(n, dtype=np.int64)
    offsets = np.empty(n, dtype=np.int64)
    pos = 0
    for i in range(n):
        r = (f0 + i) % R
        got = compress_rows(cctx, staged[r:r + 1], scratch[pos:], lengths[i:i + 1])
        if got < 0:
            return -2
        pos += got
    if st[POS] + pos > seg:
        return -1
    place(lengths, f0, F, seg, False, st, seg_first, seg_slot, used, offsets)
    put_rows(scratch, lengths, offsets, flat, index, F, f0, did)
    return 0


@kernel
def gather_index(index, rows, log_bytes, seg, max_len, glo, ghi, nslots, offsets, lengths, dicts):
    """Index entries ``index[rows]``, checked (inside the log and inside one
    segment, a length in ``1..max_len``, dictionary generation 0 or one in
    ``glo..ghi``), with the codec slot of their generation in ``dicts``;
    returns the first position whose entry is not, or -1."""
    for i in range(rows.shape[0]):
        o, ln, d = read_entry(index, rows[i], ghi)
        # (o > log_bytes - ln, not o + ln > log_bytes: a crafted o near 2**63 wraps the sum)
        if o < 0 or ln < 1 or ln > max_len or o > log_bytes - ln or (d != 0 and (d < glo or d > ghi)) \
                or o // seg != (o + ln - 1) // seg:
            return i
        offsets[i] = o
        lengths[i] = ln
        dicts[i] = 0 if d == 0 else (d - 1) % nslots + 1
    return -1


class DecodeArgs(NamedTuple):
    """What ``decode_frames`` reads of a log (``SegmentLog._decode_args``), a
    plain tuple at the call: the storage's ``frame_index`` and flat
    ``frame_log``, the log's counters ``st`` and geometry, the live
    generations ``glo..ghi``, a thread's decompression context and the
    codec's dictionaries."""
    index: np.ndarray
    F: int
    st: np.ndarray
    seg: int
    max_len: int
    glo: int
    ghi: int
    dctx: int
    ddicts: np.ndarray
    log: np.ndarray


@kernel
def decode_frames(da, ids, scratch, out):
    """``gather_index`` then ``decompress_rows`` of frames ``ids`` into the
    first rows of ``out``, in one call (``scratch``: (4, m >= n) int64).
    Returns -1, or where it stopped (the caller says why: ``SegmentLog.decode``)."""
    da = DecodeArgs(*da)
    n = ids.shape[0]
    offsets, lengths, slots, rows = scratch[0, :n], scratch[1, :n], scratch[2, :n], scratch[3, :n]
    for i in range(n):
        rows[i] = ids[i] % da.F
    bad = gather_index(da.index, rows, da.st[A] * da.seg, da.seg, da.max_len, da.glo, da.ghi, MAX_DICTS,
                       offsets, lengths, slots)
    if bad >= 0:
        return bad
    return decompress_rows(da.dctx, da.ddicts, da.log, offsets, lengths, slots, out, 0, n)


class SegmentLog:
    """The compressed frames of one buffer (see the module docstring)."""

    def __init__(self, F: int, row_bytes: int, budget: int | None, store, dictionary: np.ndarray | None = None,
                 index=None):
        """``index``: the row shape of the ``frame_index`` the storage holds
        (None: a new log's, ``index_width``; another is ``ValueError``)."""
        self.F, self.row_bytes, self.store = F, row_bytes, store
        self.capped = budget is not None  # a fixed log of S slots; else it grows as frames need
        self.block, self.seg, self.S = log_geometry(F, row_bytes, budget)
        self.max_len = _zstd.bound(row_bytes)  # a frame's largest zstd frame
        self.width = index_width(index, self.max_len, self.S * self.seg)  # frame_index's columns
        self.seg_rows = self.seg // self.block
        self.st = np.zeros(4, dtype=np.int64)  # POS, G, LO, A (``place``)
        self.st[A] = self.S if self.capped else 1
        self.seg_first = np.zeros(self.S, dtype=np.int64)  # first frame of segment g, at g % S
        self.seg_slot = np.zeros(self.S, dtype=np.int64)  # slot of segment g, at g % S
        self.used = np.zeros(self.S, dtype=np.uint8)  # slots holding a live segment
        self.used[0] = 1  # segment 0, open in slot 0
        self.warned = False  # a capped log said once that its cap costs capacity
        self.dicts = Dictionaries(dictionary)  # the given one (generation 1) or none yet
        self._scratch = np.empty(0, dtype=np.uint8)  # append's compressed frames, before they are placed
        self._opened = False  # an append opened segments since the last ``trim``
        self.grows = not self.capped  # the storage grows the log (``attach`` asks it)
        self._look: _look.Look | None = None  # a dictionary look in flight (``maybe_train``)
        self._staged_key = self._staged = None  # staged_args' arrays and ints, and what they were made of
        self._decoders = threading.local()  # .mine: this thread's DecodeArgs for decode (_decode_args)

    @property
    def g(self) -> int:
        """The open segment."""
        return int(self.st[G])

    @property
    def pos(self) -> int:
        """Bytes used in the open segment."""
        return int(self.st[POS])

    @property
    def slots(self) -> int:
        """Segment slots allocated (the storage holds ``slots * seg`` log bytes)."""
        return int(self.st[A])

    @property
    def log_bytes(self) -> int:
        """Bytes of the log the storage holds (what an index entry may point into)."""
        return self.slots * self.seg

    def specs(self) -> dict:
        return {"frame_log": (self.S * self.seg_rows, (self.block,), np.dtype(np.uint8)),
                "frame_index": (self.F, (self.width,), np.dtype(np.int64))}

    def growth(self) -> dict:
        """Arrays that grow, by the rows of one step: ``frame_log`` one segment
        at a time (none for a capped log, allocated whole)."""
        return {} if self.capped else {"frame_log": self.seg_rows}

    def attach(self) -> None:
        """Take the slots the storage holds (a reopened or loaded log may have
        grown). A storage that does not grow (``rows`` None) allocated every
        slot: the log holds them all and never grows or gives any back."""
        if not self.capped:
            rows = self.store.rows("frame_log")
            self.grows = rows is not None
            self.st[A] = self.S if rows is None else rows // self.seg_rows

    @property
    def codec(self) -> _zstd.Codec:
        return self.dicts.codec

    def oldest(self) -> int:
        """The first frame still in the log (the first of the oldest live segment)."""
        lo = int(self.st[LO])
        return 0 if lo == 0 else int(self.seg_first[lo % self.S])

    def held_bytes(self) -> int:
        """Log bytes the live segments span (the open one to ``pos``)."""
        return (self.g - int(self.st[LO])) * self.seg + self.pos

    # -- writing ---------------------------------------------------------------
    def touched(self) -> np.ndarray:
        """Log rows an append writes before it opens a segment: the open
        segment's rest (``append`` makes the segments it opens writable itself)."""
        first = int(self.seg_slot[self.g % self.S]) * self.seg_rows
        return np.arange(first + self.pos // self.block, first + self.seg_rows, dtype=np.int64)

    @staticmethod
    def look_due(fw: int, most: int) -> bool:
        """Whether ``most`` frames more from frame ``fw`` may reach a dictionary look (``maybe_train``)."""
        return (fw + most) // TRAIN_FRAMES > fw // TRAIN_FRAMES

    def staged_args(self, rw: dict) -> tuple | None:
        """``append_staged``'s ``log`` group (a ``StagedLog``'s values, a
        plain tuple) for an append of frames into the
        storage's arrays ``rw``, or None where only ``append`` may write (a
        capped log: its appends may release segments)."""
        if self.capped:
            return None
        ds = self.dicts
        did, codec, frame_log, index = ds.hi, ds.codec, rw["frame_log"], rw["frame_index"]
        key = self._staged_key
        if key is None or key[0] is not frame_log or key[1] is not index or key[2] != did or key[3] is not codec:
            self._staged_key = (frame_log, index, did, codec)
            self._staged = tuple(StagedLog(codec.cctx[ds.slot(did)], self.st, self.seg, self.seg_first,
                                           self.seg_slot, self.used, frame_log.reshape(-1), index, did))
        return self._staged

    def append(self, f0: int, frames: np.ndarray, rw: dict | None, journal: Journal | None = None) -> None:
        """Compress and store frames ``f0 .. f0 + m - 1`` ((m, row_bytes) uint8).

        What can fail (zstd, the segments to open: the storage grown,
        copy-on-write) happens before the log changes: an ``OSError`` (a full
        disk, naming the file) leaves it as it was. What it changes then (the
        counters and slots, the storage grown, the log bytes and index rows it
        overwrites) is recorded in ``journal`` first, so that a later call of
        the same write that fails puts it back (``common.undo.Journal``). Free
        segments are given back by ``trim``, once the write went through."""
        m = frames.shape[0]
        if m == 0:
            return
        journal = Journal() if journal is None else journal
        did = self.dicts.hi  # the generation the frames name
        slot = self.dicts.slot(did)
        if rw is not None:  # the storage's arrays: compressed straight into one scratch block
            need = m * self.max_len
            if self._scratch.shape[0] < need:
                self._scratch = np.empty(need, dtype=np.uint8)
            lengths = np.empty(m, dtype=np.int64)
            used = self.codec.compress_into(slot, frames, self._scratch, lengths)
            if used < 0:
                raise RuntimeError(f"zstd failed to compress a frame of {self.row_bytes} bytes (row {-1 - used})")
            data = self._scratch
        else:
            data, lengths = self.codec.compress(frames, slot)
        offsets = np.empty(m, dtype=np.int64)
        opens = self.st[POS] + (lengths[0] if m == 1 else lengths.sum()) > self.seg
        journal.add(self._counters(bool(opens)))
        if opens:  # segments open: make them writable first
            self._open_ahead(f0, lengths, offsets, journal)
        forced = place(lengths, f0, self.F, self.seg, self.capped, self.st, self.seg_first, self.seg_slot,
                       self.used, offsets)
        if forced and not self.warned:
            self._warn_cap()
        rows = np.arange(f0, f0 + m, dtype=np.int64) % self.F
        if m > self.F:
            rows = rows[-self.F:]
        if rw is not None:
            flat = rw["frame_log"].reshape(-1)  # (after _open_ahead: the log as it grew)
            for lo, hi in self._runs(lengths, offsets):
                journal.keep(flat, slice(int(offsets[lo]), int(offsets[lo] + lengths[lo:hi].sum())))
            journal.keep(rw["frame_index"], rows)
            put_rows(data, lengths, offsets, flat, rw["frame_index"], self.F, f0, did)
        else:
            self._put_through(data, lengths, offsets, rows, did, journal)
        self._opened |= bool(opens)

    @staticmethod
    def _runs(lengths: np.ndarray, offsets: np.ndarray):
        """``(lo, hi)``: the runs of frames that lie one after another in the log."""
        m = lengths.shape[0]
        if m == 1:
            return ((0, 1),)
        breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1]) + 1
        bounds = np.concatenate([[0], breaks, [m]])
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def _counters(self, slots: bool = True):
        """The step that puts the counters back as they are now, and the
        segments' slots with ``slots`` (only an append that opens a segment
        changes them)."""
        st, warned = self.st.copy(), self.warned
        if not slots:
            def back_counters():
                self.st[:] = st
            return back_counters
        first, slot, used = self.seg_first.copy(), self.seg_slot.copy(), self.used.copy()

        def back():
            self.st[:], self.seg_first[:], self.seg_slot[:], self.used[:] = st, first, slot, used
            self.warned = warned
        return back

    def checkpoint(self):
        """The step that puts back everything in memory (counters, slots,
        dictionaries, the look in flight) as it is now, for a write of many appends."""
        back = self._counters()
        dmeta, blob = self.dicts.state()
        dmeta, blob = json.loads(json.dumps(dmeta)), blob.copy()
        look = self._look  # (its outcome is kept: applied again at its frame when the write is repeated)

        def back_all():
            back()
            if self._look is not look:  # (one began since: dropped; the one before is back in flight)
                self.drop_look()
                self._look = look
            if self.dicts.state()[0] != dmeta:  # (a dictionary was adopted since)
                self.dicts.restore(dmeta, blob)
        return back_all

    def _put_through(self, data, lengths, offsets, rows, did: int, journal: Journal) -> None:
        """The frames and their index rows ``rows`` through the storage's writes
        (storages without arrays, HDF5): frames contiguous in the log, one write a run."""
        m = lengths.shape[0]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for a, b in self._runs(lengths, offsets):
            lo = int(starts[a])
            self._write_bytes(int(offsets[a]), data[lo:lo + int(lengths[a:b].sum())], journal)
        entries = np.empty((m, self.width), dtype=np.int64)
        put_entries(entries, offsets, lengths, did)
        journal.write(self.store, "frame_index", rows, entries[-rows.shape[0]:], self.F)

    def _open_ahead(self, f0: int, lengths: np.ndarray, offsets: np.ndarray, journal: Journal) -> None:
        """Before an append that opens segments: place it on copies of the
        state to learn which slots it opens, grow the storage by the new ones
        and make the others writable (copy-on-write). Changes no state but
        the slots allocated (``journal`` gives the growth back)."""
        st, used, slot_of = self.st.copy(), self.used.copy(), self.seg_slot.copy()
        place(lengths, f0, self.F, self.seg, self.capped, st, self.seg_first.copy(), slot_of, used, offsets)
        had = self.slots  # (slots allocated now are new files: nothing to copy)
        if st[A] > self.st[A]:
            # A large log grows a few spare slots beyond what this append needs (each growth
            # is a meta.json rewrite and fsyncs): the next appends open segments in them.
            grown = min(self.S, int(st[A]) + self.spare())
            self.store.grow("frame_log", grown * self.seg_rows)  # (all or nothing: an OSError changes nothing)
            journal.add(lambda: self.store.shrink("frame_log", had * self.seg_rows))
            self.st[A] = grown
            self._drop_decoders()
        if self.store.shared_chunks:
            opened = slot_of[np.arange(self.g + 1, int(st[G]) + 1) % self.S]
            opened = opened[opened < had]
            if opened.size:
                self.store.prepare({"frame_log": (opened[:, None] * self.seg_rows
                                       + np.arange(self.seg_rows)).reshape(-1)})
                self._drop_decoders()

    def spare(self) -> int:
        """Free slots a growth adds beyond the append's need, and ``trim`` keeps: none
        below ``SPARE_FROM`` slots, then one in ``SPARE_FROM``, at most ``SPARE_MAX``."""
        return min(SPARE_MAX, self.slots // SPARE_FROM)

    def trim(self) -> None:
        """After a write that opened segments: give the storage back the free
        slots at the top of the log, all but one (the frames once took more
        room: those before the first dictionary, a stretch that compressed
        worse). Best effort: a failure keeps them."""
        if not self._opened:
            return
        self._opened = False
        if not self.grows:
            return
        keep = n = self.slots
        while keep > 2 and self.used[keep - 1] == 0 and self.used[keep - 2] == 0:
            keep -= 1
        keep = min(n, keep + self.spare())  # (the spare slots a growth made stay)
        if keep == n:
            return
        self._drop_decoders()
        try:
            self.store.shrink("frame_log", keep * self.seg_rows)
        except OSError as e:
            log.warning("bigper: giving back %d free log segments did not complete (the log holds what the "
                        "storage does): %r", n - keep, e)
            # The slots the storage holds, whatever happened (reads are bounded by them).
            self.st[A] = self.store.rows("frame_log") // self.seg_rows
        else:
            self.st[A] = keep

    def _warn_cap(self) -> None:
        self.warned = True
        msg = (f"bigper: the compressed log's cap (compression_budget, {self.S} segments of {self.seg:,} bytes) "
               "now released frames of transitions still in the ring: frames compress to more than the budget, "
               "so the buffer holds fewer sampleable transitions than its capacity (`bigper info` says how "
               "many); leave compression_budget unset and the log grows as its frames need")
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=_caller_level())

    def _write_bytes(self, start: int, data: np.ndarray, journal: Journal) -> None:
        """Bytes at ``start`` in the log, through the storage's block reads and
        writes (the blocks they overwrite recorded in ``journal``)."""
        b0, b1 = start // self.block, (start + data.shape[0] - 1) // self.block + 1
        rows = np.arange(b0, b1, dtype=np.int64)
        # The bytes around ours in the first and last block stay (a copy: a read may give a view).
        old = np.array(self.store.read("frame_log", rows), dtype=np.uint8, copy=True)
        buf = old.copy().reshape(-1)
        buf[start - b0 * self.block:start - b0 * self.block + data.shape[0]] = data
        journal.add(lambda: self.store.write("frame_log", rows, old))
        self.store.write("frame_log", slice(b0, b1), buf.reshape(b1 - b0, self.block))

    def maybe_train(self, fw0: int, fw: int) -> None:
        """After frames ``fw0 .. fw - 1`` were written: each time the count
        crosses a multiple of ``TRAIN_FRAMES``, look whether a new dictionary
        pays (``frames/dictionaries.py``): the newest ``W = TRAIN_FRAMES`` frames take
        ``DRIFT`` more bytes than at the last adoption (or none was tried),
        and a candidate trained on the frames before them takes ``PAYS``
        fewer bytes on them than the current dictionary. Frames after it use
        it; earlier ones keep theirs.

        The first dictionary is trained here, in the add. A later look's
        training and measurements run in a thread (``frames/look.py``)
        while adds go on; its outcome is applied here when the count reaches
        the next multiple of ``W`` (waiting for the thread only if it has not
        finished), before that crossing's own look: where and when a
        dictionary is adopted depends on the adds, never on the machine's
        speed. ``settle_look`` applies it sooner (a snapshot, a write of many
        rows)."""
        W = TRAIN_FRAMES
        if fw // W <= fw0 // W:
            return
        if self._look is not None and fw >= self._look.adopt_at:
            self.settle_look(fw)
        if self._look is not None:  # (a look in flight, from a write that crossed several multiples)
            return
        # On the frames still in the log, however few a capped log keeps: frames that compress
        # worse than its budget leave fewer than W in it until a dictionary makes them small.
        lo = max(fw - 2 * W, self.oldest(), fw - self.F, 0)
        if fw - lo < min(W // 2, MIN_LOOK):
            return
        ev = max(lo + (fw - lo) // 2, fw - W)  # measured on [ev, fw), trained on [lo, ev)
        # Trained on the newest TRAIN_SAMPLE of those at most: the trainer's time grows faster
        # than its input (measured on Seaquest: 1,000 frames 260 ms, 500 70 ms, the
        # dictionaries as good).
        lo = max(lo, ev - TRAIN_SAMPLE)
        ds = self.dicts
        if ds.base is not None and self._lengths(np.arange(ev, fw, dtype=np.int64)).mean() \
                <= ds.base * (1 + dictionaries.DRIFT) + 8:
            ds.retry = ds.wait = 0  # back to the size of the last adoption: no wait for the next drift
            return
        if fw < ds.retry:  # candidates since the drift did not pay: wait before the next
            return
        # Retraining only saves bytes: it runs after the add's frames were written, so
        # a failure in it (no memory, a damaged frame: sample and verify report it) skips it.
        try:
            inputs = self._look_inputs(lo, ev, fw)
        except (MemoryError, ValueError, RuntimeError, CorruptSnapshotError) as e:
            log.warning("bigper: retraining the zstd dictionary at frame %d failed, skipped: %r", fw, e)
            return
        if ds.hi == 0:  # the first dictionary: trained here, used from the next frame (once a buffer)
            self._look = _look.Look(inputs, fw, thread=False)
            self.settle_look(fw)
        else:
            self._look = _look.Look(inputs, (fw // W + 1) * W)

    def _look_inputs(self, lo: int, ev: int, fw: int) -> _look.Inputs:
        """Copies of what a look on frames ``lo .. fw - 1`` needs (checked index
        entries, their bytes, the dictionaries they name)."""
        ids = np.arange(lo, fw, dtype=np.int64)
        n = ids.shape[0]
        entries = self._entries(ids)
        offsets, lengths, slots = (np.empty(n, dtype=np.int64) for _ in range(3))
        bad = gather_index(entries, np.arange(n, dtype=np.int64), self.log_bytes, self.seg, self.max_len,
                           self.dicts.lo, self.dicts.hi, MAX_DICTS, offsets, lengths, slots)
        if bad >= 0:
            raise CorruptSnapshotError(f"frame {lo + bad}'s index entry {self._said(entries[bad:bad + 1])} is damaged")
        arrays = self.store.arrays
        if arrays is not None:  # the runs of frames that lie one after another, copied
            flat = arrays["frame_log"].reshape(-1)
            parts, at = [], 0
            starts = np.empty(n, dtype=np.int64)
            for a, b in self._runs(lengths, offsets):
                size = int(offsets[b - 1] + lengths[b - 1] - offsets[a])
                parts.append(flat[int(offsets[a]):int(offsets[a]) + size])
                starts[a:b] = offsets[a:b] - offsets[a] + at
                at += size
            blob = np.concatenate(parts)
        else:
            blob, starts = self._read_spans(offsets, lengths)
        ds = self.dicts
        current = ds.slot(ds.hi)
        named = {int(s) for s in np.unique(slots)} | {current}
        dicts = {s: ds.dicts[(s - ds.slot(ds.lo)) % MAX_DICTS] for s in named if s}
        return _look.Inputs(fw, ev - lo, blob, np.ascontiguousarray(starts), lengths, slots, dicts, current,
                            self.row_bytes, DICT_BYTES)

    def settle_look(self, fw_now: int) -> None:
        """Apply the look in flight now, ``fw_now`` frames written (waiting for
        its thread): adopt its candidate where it pays, all or nothing; a look
        that failed changes nothing."""
        look, self._look = self._look, None
        if look is None:
            return
        fw = look.inputs.fw
        try:
            out = look.outcome()
        except (MemoryError, ValueError, RuntimeError, CorruptSnapshotError) as e:
            log.warning("bigper: retraining the zstd dictionary at frame %d failed, skipped: %r", fw, e)
            return
        ds = self.dicts
        adopted = False
        if out.new is not None and out.new <= (1 - dictionaries.PAYS) * out.now:
            oldest = split_entries(self._entries(np.array([max(self.oldest(), fw_now - self.F, 0)], dtype=np.int64)),
                                   ds.hi)[2][0]
            try:
                adopted = ds.adopt(out.candidate, int(oldest))  # (all or nothing)
            except (MemoryError, ValueError, RuntimeError) as e:
                log.warning("bigper: adopting a new zstd dictionary at frame %d failed, skipped: %r", fw, e)
                return
        if adopted:
            ds.base = out.new / out.measured
            ds.retry = ds.wait = 0
        elif ds.base is None:  # no dictionary was adopted yet: drift is measured from these frames
            ds.base = out.now / out.measured
        else:  # the size at the last adoption stays the reference: try again, later
            ds.wait = TRAIN_FRAMES if ds.wait == 0 else 2 * ds.wait
            ds.retry = fw + ds.wait

    def drop_look(self) -> None:
        """Forget the look in flight (waiting for its thread: it holds no state
        of the log, but the log's codec may be closed next)."""
        look, self._look = self._look, None
        if look is not None:
            look.wait()

    def _entries(self, ids: np.ndarray) -> np.ndarray:
        """Index rows (n, width) of frames ``ids`` (live)."""
        arrays = self.store.arrays
        rows = ids % self.F
        if arrays is not None:
            return np.asarray(arrays["frame_index"])[rows]
        order = np.sort(rows)
        return self.store.read("frame_index", order)[np.searchsorted(order, rows)]

    def _lengths(self, ids: np.ndarray) -> np.ndarray:
        return split_entries(self._entries(ids), self.dicts.hi)[1]

    def _said(self, entries: np.ndarray) -> str:
        """An index row as an error names it."""
        o, ln, d = split_entries(entries, self.dicts.hi)
        return f"[offset {int(o[0])}, length {int(ln[0])}, dictionary {int(d[0])}]"

    # -- reading ---------------------------------------------------------------
    def _decode_args(self, arrays: dict, n: int, stale: bool) -> tuple:
        """This thread's ``DecodeArgs`` for ``decode``, made now, and a scratch of
        ``n`` frames at least, after what they were made of: kept until the
        dictionaries (``version``), the storage's arrays or the counters' array
        change (``st`` is updated in place, never replaced). ``stale``: this
        thread's were made of others; every thread's go then."""
        if stale:
            self._drop_decoders()
        ds, codec = self.dicts, self.codec
        index, flat = arrays["frame_index"], arrays["frame_log"]
        da = (index, self.F, self.st, self.seg, self.max_len, ds.lo, ds.hi, codec.dctx(), codec.ddicts,
              flat.reshape(-1))
        mine = self._decoders.mine = (ds.version, index, flat, da, np.empty((4, max(n, 1024)), np.int64))
        return mine

    def _drop_decoders(self) -> None:
        """Every thread's ``DecodeArgs`` go (a thread that waits would keep the
        storage's arrays a growth, a shrink or a copy-on-write replaced)."""
        self._decoders = threading.local()

    def decode(self, ids: np.ndarray, out: np.ndarray | None = None, threads: bool = True,
               chunk: int = DECODE_CHUNK) -> np.ndarray:
        """Frames ``ids`` ((n,) int64, live; or their index rows ``id % F``,
        which name the same frames) as (n, row_bytes) uint8 rows of ``out``
        (the first n when it has more); ``threads``: on the pool's threads,
        ``chunk`` frames a thread at least, else in this one only (the feed's:
        ``core/feed.decode``, under the buffer's lock, beside a learner)."""
        n = ids.shape[0]
        if out is None:
            out = np.empty((n, self.row_bytes), dtype=np.uint8)
        arrays = self.store.arrays
        if arrays is not None and (not threads or n <= chunk):  # the usual batch: one compiled call
            try:
                mine = self._decoders.mine  # (what it was made of: compared by identity)
            except AttributeError:  # (this thread's first)
                mine = None
            if mine is None or mine[0] != self.dicts.version or mine[1] is not arrays["frame_index"] \
                    or mine[2] is not arrays["frame_log"] or mine[4].shape[1] < n:
                mine = self._decode_args(arrays, n, stale=mine is not None)
            if decode_frames(mine[3], ids, mine[4], out) < 0:
                return out
            # (else the frame that stopped it, named below)
        offsets, lengths, dicts = np.empty((3, n), dtype=np.int64)  # (each row contiguous)
        if arrays is not None:
            index, rows = arrays["frame_index"], ids % self.F
        else:
            index, rows = self.store.read("frame_index", ids % self.F), np.arange(n, dtype=np.int64)
        bad = gather_index(index, rows, self.log_bytes, self.seg, self.max_len, self.dicts.lo, self.dicts.hi,
                           MAX_DICTS, offsets, lengths, dicts)
        if bad >= 0:
            raise CorruptSnapshotError(
                f"frame {int(ids[bad])}'s index entry {self._said(index[rows[bad:bad + 1]])} points outside the log "
                f"of {self.log_bytes} bytes or across a segment's end, has a length outside "
                f"1..{self.max_len} or names no dictionary of {self.dicts.lo}..{self.dicts.hi}")
        if arrays is not None:
            log = arrays["frame_log"].reshape(-1)
        else:
            log, offsets = self._read_spans(offsets, lengths)
        codec = self.codec
        ddicts = codec.ddicts
        failed = []

        def run(lo: int, hi: int) -> None:
            r = _zstd.decompress_rows(codec.dctx(), ddicts, log, offsets, lengths, dicts, out, lo, hi)
            if r >= 0:
                failed.append(r)
        if threads and n > chunk:
            for_ranges(run, n, chunk)
        else:
            run(0, n)
        if failed:
            r = min(failed)
            raise CorruptSnapshotError(
                f"frame {int(ids[r])} (log bytes {int(offsets[r])}..+{int(lengths[r])}) does not decompress "
                f"to its {self.row_bytes} bytes: the log or its index is damaged")
        return out

    def _read_spans(self, offsets: np.ndarray, lengths: np.ndarray):
        """The log blocks the frames need (storages without arrays), with the
        frames' offsets in them."""
        b0 = offsets // self.block
        b1 = (offsets + lengths - 1) // self.block + 1
        rows = np.concatenate([np.arange(a, b) for a, b in zip(b0, b1)]).astype(np.int64)
        base = np.concatenate([[0], np.cumsum(b1 - b0)[:-1]]) * self.block
        data = self.store.read("frame_log", rows).reshape(-1)
        return np.ascontiguousarray(data), base + offsets % self.block

    # -- state ---------------------------------------------------------------
    def state(self) -> tuple[dict, dict]:
        dmeta, blob = self.dicts.state()
        meta = {"seg": self.g, "pos": self.pos, **dmeta}
        arrays = {"frames_seg_first": self.seg_first, "frames_dict": blob}
        if not self.capped:  # (a capped log's slots and oldest segment follow from g, as format 1 wrote it)
            meta["seg_lo"] = int(self.st[LO])
            arrays["frames_seg_slot"] = self.seg_slot
        return meta, arrays

    def restore(self, meta: dict, arrays: dict) -> None:
        """Take a recorded state (checked by ``core/statecheck.py``) and check the
        slots, the live index and the dictionaries against it and the storage:
        ``CorruptSnapshotError``."""
        self.drop_look()  # (its frames and dictionaries are not these)
        g = int(meta["seg"])
        self.st[G], self.st[POS] = g, int(meta["pos"])
        self.seg_first[:] = arrays["frames_seg_first"]
        if self.capped:
            lo = max(0, g - self.S + 1)
            self.seg_slot[:] = np.arange(self.S)  # segment g in slot g % S
        else:
            lo = int(meta["seg_lo"])
            self.seg_slot[:] = arrays["frames_seg_slot"]
            self.attach()
        self.st[LO] = lo
        live = self.seg_slot[np.arange(lo, g + 1) % self.S]
        if live.size and (live.max() >= self.slots or np.unique(live).size != live.size):
            raise CorruptSnapshotError(
                f"frames_seg_slot: the live segments {lo}..{g} lie in slots {live[:8].tolist()}, which are not "
                f"distinct slots of the {self.slots} the log holds")
        self.used[:] = 0
        self.used[live] = 1
        self.dicts.restore(meta, arrays["frames_dict"])
        self.check_index(int(meta["fw"]))

    def check_index(self, fw: int, chunk: int = 1 << 20) -> int:
        """Check the index entries of every frame still in the log against the
        segment state (``CorruptSnapshotError`` naming the first that is off),
        and decode the newest frame of each dictionary; returns the frames checked.

        Frames are written in order, so the entries are fully determined: frame
        ``f`` lies in the segment ``seg_first`` puts it in, right after frame
        ``f - 1`` or at its segment's start when it opened it, and the open
        segment ends at ``pos``. An entry pointing at another frame, into one,
        across a segment's end or outside the log breaks one of these. Checked
        ``chunk`` frames at a time (what it holds is a few arrays of ``chunk``,
        not of the log's 50M frames), each chunk continuing where the one before
        ended."""
        lo = max(self.oldest(), fw - self.F, 0)
        if fw <= lo:
            return 0
        segs = np.arange(int(self.st[LO]), self.g + 1, dtype=np.int64)
        firsts = np.where(segs == 0, 0, self.seg_first[segs % self.S])
        opened = firsts[segs > 0]
        glo, ghi = self.dicts.lo, self.dicts.hi
        end = int(self.seg_slot[self.g % self.S]) * self.seg + self.pos
        newest: dict[int, int] = {}  # dictionary -> the newest frame it encodes
        prev = None  # (segment, end, dictionary) of the frame before the chunk
        for a in range(lo, fw, chunk):
            ids = np.arange(a, min(fw, a + chunk), dtype=np.int64)
            o, ln, d = split_entries(self._entries(ids), ghi)
            s = segs[np.clip(np.searchsorted(firsts, ids, side="right") - 1, 0, segs.size - 1)]
            start = self.seg_slot[s % self.S] * self.seg
            prev_end = np.empty_like(o)
            prev_end[1:] = o[:-1] + ln[:-1]
            opens = np.zeros(ids.shape[0], dtype=np.bool_)
            opens[1:] = s[1:] != s[:-1]
            if prev is not None:
                opens[0], prev_end[0] = s[0] != prev[0], prev[1]
            opens |= np.isin(ids, opened) | (ids == 0)
            want = np.where(opens, start, prev_end)
            if prev is None:
                want[0] = o[0] if not opens[0] else start[0]  # (its predecessor is gone: only bounds below)
            ok = (o >= start) & (ln >= 1) & (ln <= self.max_len) & (o <= start + self.seg - ln) & (o == want) \
                & ((d == 0) | ((d >= glo) & (d <= ghi)))
            ok[1:] &= d[1:] >= d[:-1]  # generations never go back in frame order
            if prev is not None:
                ok[0] &= d[0] >= prev[2]
            if ids[-1] == fw - 1 and ok.all() and o[-1] + ln[-1] != end:
                ok[-1] = False
            if not ok.all():
                i = int(np.argmin(ok))
                raise CorruptSnapshotError(
                    f"frame_index: frame {int(ids[i])}'s entry [offset {int(o[i])}, length {int(ln[i])}, dictionary "
                    f"{int(d[i])}] is not where the segment log puts it (segment {int(s[i])}, bytes "
                    f"{int(start[i])}..{int(start[i]) + self.seg}, expected offset {int(want[i])}, open segment "
                    f"{self.g} ending at {self.pos}, dictionaries {glo}..{ghi}, none going back)")
            for k in np.unique(d):
                newest[int(k)] = int(ids[np.flatnonzero(d == k)[-1]])
            prev = (int(s[-1]), int(o[-1] + ln[-1]), int(d[-1]))
            r0 = a % self.F  # (the index rows read: they need not stay in this process's RSS)
            for lo_r, hi_r in ((r0, min(self.F, r0 + ids.shape[0])), (0, r0 + ids.shape[0] - self.F)):
                if hi_r > lo_r:
                    self.store.release_pages("frame_index", lo_r, hi_r)
        for k in sorted(newest):  # each dictionary decodes its frames (another one would not)
            self.decode(np.array([newest[k]], dtype=np.int64))
        return fw - lo

    def close(self) -> None:
        self.drop_look()
        self._drop_decoders()  # (and the staged appends': a closed storage's maps go)
        self._staged_key = self._staged = None
        self.dicts.close()


def _caller_level() -> int:
    """The ``stacklevel`` of a warning that names the caller's line outside bigper."""
    import sys

    here = __file__.rsplit("/", 2)[0] + "/"  # the bigper package (this file is bigper/frames/segments.py)
    level, f = 1, sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(here):
        level += 1
        f = f.f_back
    return level
