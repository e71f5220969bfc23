"""Compressed frames in a ring of segments, with random access by frame id.

With ``compression="zstd"`` the frame ring holds no raw frames. Each new frame
is compressed on its own (zstd, level 3, a content checksum, a dictionary
once one is trained) and appended to a log of ``S`` segments of ``SEG`` bytes,
written in order; a frame never straddles two segments. Frame ``f``'s index
row ``f % F`` says where it is::

    frame_log    (S * SEG / BLOCK, BLOCK) uint8   the segments, BLOCK bytes a row
    frame_index  (F, 2) int64                     [byte offset in the log, length | dict id << 32]

    segment:  g-S+1   g-S+2  ...  g (open)
              [sealed][sealed]... [f f f f ....free....]

When a frame does not fit in the open segment ``g``, segment ``g + 1`` opens
in row ``(g + 1) % S`` and the segment that lived there (``g + 1 - S``) is
released whole: its frames are gone, and the frame ring's expiry
(``frames.expire``) makes the transitions that referenced them unsampleable.
Sealed segments never change, so a snapshot of a memmap storage hard-links
their chunk files, and copy-on-write touches only the open segment's chunk.

The log is preallocated at the storage's creation (``budget`` bytes a frame),
so a full disk is an ``OSError`` when the buffer is made, never later. A
frame that does not shrink is a zstd frame too (raw blocks, a few bytes more
than the frame, ``_zstd.bound``), so every frame carries its checksum.

Everything read back from the index is checked before the log is touched:
an offset or a length outside the log or across a segment's end fails the
read with ``CorruptSnapshotError``, as does a frame that does not decompress
to exactly its bytes (or whose checksum fails). When a buffer is restored
(``load``, resume, ``bigper verify``) the whole live index is checked against
the segment state (``check_index``): each frame in the segment ``seg_first``
puts it in, right after the frame before it, the open segment ending at
``pos``; the dictionary generations the frames name must be recorded ones,
non-decreasing in frame order, each one zstd accepts and that decodes the
frames that name it.

Dictionaries (``dictionaries.py``): one given by the user is generation 1
from the first frame; else one is trained on the first ``TRAIN_FRAMES``
frames, and every ``TRAIN_FRAMES`` frames after that a new one is trained
and adopted only where it pays (``maybe_train``). Frames keep the
generation they were written with.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from . import _zstd, dictionaries
from ._budget import geometry  # (the rule config.py checks budgets by: one place)
from ._kernels import kernel
from ._pool import for_ranges
from .dictionaries import MAX_DICTS, Dictionaries
from .errors import CorruptSnapshotError

log = logging.getLogger("bigper")

DICT_BYTES = 16384
TRAIN_FRAMES = 1000  # frames between two looks at the dictionary (and the frames a candidate is measured on)
MIN_LOOK = 64  # frames in the log at least for a look (half to train a candidate on, half to measure it)
LEN_MASK = (1 << 32) - 1
DECODE_CHUNK = 32  # frames per thread at least in a decode


@kernel
def place(lengths, pos, g, seg, S, seg_first, f0, offsets):
    """Offsets in the log of frames ``f0, f0 + 1, ...`` of ``lengths``,
    appended from ``pos`` in segment ``g``; opening a segment records its first
    frame in ``seg_first``. Returns the new ``(pos, g)``."""
    for i in range(lengths.shape[0]):
        ln = lengths[i]
        if pos + ln > seg:
            g += 1
            pos = 0
            seg_first[g % S] = f0 + i
        offsets[i] = (g % S) * seg + pos
        pos += ln
    return pos, g


@kernel
def append_rows(cctx, frames, scratch, lengths, log, index, F, f0, did, pos, g, seg, S, seg_first):
    """Compress frames ``f0, f0 + 1, ...`` (rows of ``frames``) into
    ``scratch``, then place them in the log from ``pos`` in segment ``g`` and
    write their index rows (``index[f % F]``; of more than ``F`` frames the
    newest win). Nothing changes when a frame fails to compress: returns
    ``(-1 - r, g)`` for row r then, else the new ``(pos, g)``."""
    used = _zstd.compress_rows(cctx, frames, scratch, lengths)
    if used < 0:
        return used, g
    offsets = np.empty(frames.shape[0], dtype=np.int64)
    pos, g = place(lengths, pos, g, seg, S, seg_first, f0, offsets)
    src = 0
    for i in range(frames.shape[0]):
        o, ln = offsets[i], lengths[i]
        log[o:o + ln] = scratch[src:src + ln]
        r = (f0 + i) % F
        index[r, 0] = o
        index[r, 1] = ln | (did << 32)
        src += ln
    return pos, g


@kernel
def gather_index(index, rows, log_bytes, seg, max_len, glo, ghi, nslots, offsets, lengths, dicts):
    """Index entries ``index[rows]``, checked (inside the log and inside one
    segment, a length in ``1..max_len``, dictionary generation 0 or one in
    ``glo..ghi``), with the codec slot of their generation in ``dicts``;
    returns the first position whose entry is not, or -1."""
    for i in range(rows.shape[0]):
        r = rows[i]
        o = index[r, 0]
        v = index[r, 1]
        ln = v & 0xFFFFFFFF
        d = v >> 32
        # (o > log_bytes - ln, not o + ln > log_bytes: a crafted o near 2**63 wraps the sum)
        if o < 0 or ln < 1 or ln > max_len or o > log_bytes - ln or (d != 0 and (d < glo or d > ghi)) \
                or o // seg != (o + ln - 1) // seg:
            return i
        offsets[i] = o
        lengths[i] = ln
        dicts[i] = 0 if d == 0 else (d - 1) % nslots + 1
    return -1


class SegmentLog:
    """The compressed frames of one buffer (see the module docstring)."""

    def __init__(self, F: int, row_bytes: int, budget: int, store, dictionary: np.ndarray | None = None):
        self.F, self.row_bytes, self.store = F, row_bytes, store
        self.block, self.seg, self.S = geometry(F, row_bytes, budget)
        self.max_len = _zstd.bound(row_bytes)  # a frame's largest zstd frame
        self.log_bytes = self.S * self.seg
        self.g = 0  # the open segment
        self.pos = 0  # bytes used in it
        self.seg_first = np.zeros(self.S, dtype=np.int64)  # first frame of each segment row
        self.dicts = Dictionaries(dictionary)  # the given one (generation 1) or none yet
        self._scratch = np.empty(0, dtype=np.uint8)  # append's compressed frames, before they are placed

    def specs(self) -> dict:
        return {"frame_log": (self.log_bytes // self.block, (self.block,), np.dtype(np.uint8)),
                "frame_index": (self.F, (2,), np.dtype(np.int64))}

    @property
    def codec(self) -> _zstd.Codec:
        return self.dicts.codec

    def oldest(self) -> int:
        """The first frame still in the log (the first of the oldest live segment)."""
        first = self.g - self.S + 1
        return 0 if first <= 0 else int(self.seg_first[first % self.S])

    # -- writing ---------------------------------------------------------------
    def touched(self, n_frames: int) -> np.ndarray:
        """Log rows that appending ``n_frames`` frames may write (an upper bound)."""
        per_seg = self.seg // self.block
        fit = max(1, self.seg - self.max_len + 1)  # bytes a sealed segment holds at least
        segs = 1 + min(n_frames, math.ceil(n_frames * self.max_len / fit))
        segs = min(self.S, segs)
        first = (self.g % self.S) * per_seg + self.pos // self.block
        last = (self.g + segs - 1) % self.S * per_seg + per_seg  # exclusive, in its segment
        if segs == self.S:
            return np.arange(self.log_bytes // self.block, dtype=np.int64)
        span = (last - first) % (self.log_bytes // self.block) or self.log_bytes // self.block
        return (first + np.arange(span, dtype=np.int64)) % (self.log_bytes // self.block)

    def append(self, f0: int, frames: np.ndarray, rw: dict | None) -> None:
        """Compress and store frames ``f0 .. f0 + m - 1`` ((m, row_bytes) uint8)."""
        m = frames.shape[0]
        if m == 0:
            return
        did = self.dicts.hi  # the generation the frames name
        slot = self.dicts.slot(did)
        if rw is not None:  # the storage's arrays: one kernel call compresses and places every frame
            need = m * self.max_len
            if self._scratch.shape[0] < need:
                self._scratch = np.empty(need, dtype=np.uint8)
            lengths = np.empty(m, dtype=np.int64)
            pos, g = append_rows(self.codec.cctx[slot], frames, self._scratch, lengths,
                                 rw["frame_log"].reshape(-1), rw["frame_index"], self.F, f0, did, self.pos,
                                 self.g, self.seg, self.S, self.seg_first)
            if pos < 0:
                raise RuntimeError(f"zstd failed to compress a frame of {self.row_bytes} bytes (row {-1 - pos})")
            self.pos, self.g = pos, g
            return
        data, lengths = self.codec.compress(frames, slot)
        offsets = np.empty(m, dtype=np.int64)
        self.pos, self.g = place(lengths, self.pos, self.g, self.seg, self.S, self.seg_first, f0, offsets)
        # Storages without arrays (HDF5): runs of frames contiguous in the log, one write each.
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1]) + 1
        bounds = np.concatenate([[0], breaks, [m]])
        for a, b in zip(bounds[:-1], bounds[1:]):
            lo = int(starts[a])
            self._write_bytes(int(offsets[a]), data[lo:lo + int(lengths[a:b].sum())])
        entries = np.empty((m, 2), dtype=np.int64)
        entries[:, 0] = offsets
        entries[:, 1] = lengths | (did << 32)
        rows = np.arange(f0, f0 + m, dtype=np.int64) % self.F
        if m > self.F:
            rows, entries = rows[-self.F:], entries[-self.F:]
        self.store.write("frame_index", rows, entries)

    def _write_bytes(self, start: int, data: np.ndarray) -> None:
        """Bytes at ``start`` in the log, through the storage's block reads and writes."""
        b0, b1 = start // self.block, (start + data.shape[0] - 1) // self.block + 1
        buf = np.zeros((b1 - b0) * self.block, dtype=np.uint8)
        if start % self.block:  # keep the bytes before ours in the first block
            buf[:self.block] = self.store.read("frame_log", np.array([b0], dtype=np.int64))[0]
        buf[start - b0 * self.block:start - b0 * self.block + data.shape[0]] = data
        self.store.write("frame_log", slice(b0, b1), buf.reshape(b1 - b0, self.block))

    def maybe_train(self, fw0: int, fw: int) -> None:
        """After frames ``fw0 .. fw - 1`` were written: each time the count
        crosses a multiple of ``TRAIN_FRAMES``, look whether a new dictionary
        pays (``dictionaries.py``): the newest ``W = TRAIN_FRAMES`` frames take
        ``DRIFT`` more bytes than at the last adoption (or none was tried),
        and a candidate trained on the frames before them takes ``PAYS``
        fewer bytes on them than the current dictionary. Frames after it use
        it; earlier ones keep theirs."""
        W = TRAIN_FRAMES
        if fw // W <= fw0 // W:
            return
        # On the frames still in the log, however few the budget keeps: frames that compress
        # worse than the budget leave fewer than W in it until a dictionary makes them small.
        lo = max(fw - 2 * W, self.oldest(), fw - self.F, 0)
        if fw - lo < min(W // 2, MIN_LOOK):
            return
        ev = max(lo + (fw - lo) // 2, fw - W)  # measured on [ev, fw), trained on [lo, ev)
        ds = self.dicts
        if ds.base is not None and self._lengths(np.arange(ev, fw, dtype=np.int64)).mean() \
                <= ds.base * (1 + dictionaries.DRIFT) + 8:
            ds.retry = ds.wait = 0  # back to the size of the last adoption: no wait for the next drift
            return
        if fw < ds.retry:  # candidates since the drift did not pay: wait before the next
            return
        # Retraining only saves bytes: it runs after the add's frames were written, so
        # a failure in it (no memory, a candidate zstd refuses) skips it, changing nothing.
        try:
            frames = self.decode(np.arange(lo, fw, dtype=np.int64))
            train, test = frames[:ev - lo], frames[ev - lo:]
            now = int(self.codec.compress(test, ds.slot(ds.hi))[1].sum())
            cand = _zstd.train(train, DICT_BYTES)
            new = None
            if cand is not None and cand.size >= 256:
                trial = _zstd.Codec(level=3)
                try:
                    trial.set_dictionary(1, cand)
                    new = int(trial.compress(test, 1)[1].sum())
                finally:
                    trial.close()
        except (MemoryError, ValueError, RuntimeError, CorruptSnapshotError) as e:  # (a damaged frame:
            # sample and verify report it)
            log.warning("bigper: retraining the zstd dictionary at frame %d failed, skipped: %r", fw, e)
            return
        adopted = False
        if new is not None and new <= (1 - dictionaries.PAYS) * now:
            oldest = self._entries(np.array([max(self.oldest(), fw - self.F, 0)], dtype=np.int64))[0, 1] >> 32
            try:
                adopted = ds.adopt(cand, int(oldest))  # (all or nothing)
            except (MemoryError, ValueError, RuntimeError) as e:
                log.warning("bigper: adopting a new zstd dictionary at frame %d failed, skipped: %r", fw, e)
                return
        if adopted:
            ds.base = new / test.shape[0]
            ds.retry = ds.wait = 0
        elif ds.base is None:  # no dictionary was adopted yet: drift is measured from these frames
            ds.base = now / test.shape[0]
        else:  # the size at the last adoption stays the reference: try again, later
            ds.wait = W if ds.wait == 0 else 2 * ds.wait
            ds.retry = fw + ds.wait

    def _entries(self, ids: np.ndarray) -> np.ndarray:
        """Index entries (n, 2) of frames ``ids`` (live)."""
        arrays = getattr(self.store, "arrays", None)
        rows = ids % self.F
        if arrays is not None:
            return np.asarray(arrays["frame_index"])[rows]
        order = np.sort(rows)
        return self.store.read("frame_index", order)[np.searchsorted(order, rows)]

    def _lengths(self, ids: np.ndarray) -> np.ndarray:
        return self._entries(ids)[:, 1] & LEN_MASK

    # -- reading ---------------------------------------------------------------
    def decode(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Frames ``ids`` ((n,) int64, live) as (n, row_bytes) uint8 rows of ``out``."""
        n = ids.shape[0]
        if out is None:
            out = np.empty((n, self.row_bytes), dtype=np.uint8)
        offsets = np.empty(n, dtype=np.int64)
        lengths = np.empty(n, dtype=np.int64)
        dicts = np.empty(n, dtype=np.int64)
        arrays = getattr(self.store, "arrays", None)
        if arrays is not None:
            index, rows = arrays["frame_index"], ids % self.F
        else:
            index, rows = self.store.read("frame_index", ids % self.F), np.arange(n, dtype=np.int64)
        bad = gather_index(index, rows, self.log_bytes, self.seg, self.max_len, self.dicts.lo, self.dicts.hi,
                           MAX_DICTS, offsets, lengths, dicts)
        if bad >= 0:
            raise CorruptSnapshotError(
                f"frame {int(ids[bad])}'s index entry {index[rows[bad]].tolist()} points outside the log "
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
        for_ranges(run, n, DECODE_CHUNK)
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
        return ({"seg": self.g, "pos": self.pos, **dmeta},
                {"frames_seg_first": self.seg_first, "frames_dict": blob})

    def restore(self, meta: dict, arrays: dict) -> None:
        """Take a recorded state (checked by ``_statecheck``) and check the
        live index and the dictionaries against it: ``CorruptSnapshotError``."""
        self.g, self.pos = int(meta["seg"]), int(meta["pos"])
        self.seg_first[:] = arrays["frames_seg_first"]
        self.dicts.restore(meta, arrays["frames_dict"])
        self.check_index(int(meta["fw"]))

    def check_index(self, fw: int) -> int:
        """Check the index entries of every frame still in the log against the
        segment state (``CorruptSnapshotError`` naming the first that is off),
        and decode the newest frame of each dictionary; returns the frames checked.

        Frames are written in order, so the entries are fully determined: frame
        ``f`` lies in the segment ``seg_first`` puts it in, right after frame
        ``f - 1`` or at its segment's start when it opened it, and the open
        segment ends at ``pos``. An entry pointing at another frame, into one,
        across a segment's end or outside the log breaks one of these."""
        lo = max(self.oldest(), fw - self.F, 0)
        if fw <= lo:
            return 0
        ids = np.arange(lo, fw, dtype=np.int64)
        entries = self._entries(ids)
        o, v = entries[:, 0], entries[:, 1]
        ln, d = v & LEN_MASK, v >> 32
        segs = np.arange(max(0, self.g - self.S + 1), self.g + 1, dtype=np.int64)
        firsts = np.where(segs == 0, 0, self.seg_first[segs % self.S])
        s = segs[np.clip(np.searchsorted(firsts, ids, side="right") - 1, 0, segs.size - 1)]
        start = (s % self.S) * self.seg
        prev_end = np.empty_like(o)
        prev_end[1:] = o[:-1] + ln[:-1]
        opens = np.zeros(ids.shape[0], dtype=np.bool_)
        opens[1:] = s[1:] != s[:-1]
        opens |= np.isin(ids, firsts[segs > 0]) | (ids == 0)
        want = np.where(opens, start, prev_end)
        want[0] = o[0] if not opens[0] else start[0]  # (its predecessor is gone: only bounds below)
        glo, ghi = self.dicts.lo, self.dicts.hi
        ok = (o >= start) & (ln >= 1) & (ln <= self.max_len) & (o <= start + self.seg - ln) & (o == want) \
            & ((d == 0) | ((d >= glo) & (d <= ghi)))
        ok[1:] &= d[1:] >= d[:-1]  # generations never go back in frame order
        if ok.all() and o[-1] + ln[-1] != (self.g % self.S) * self.seg + self.pos:
            ok[-1] = False
        if not ok.all():
            i = int(np.argmin(ok))
            raise CorruptSnapshotError(
                f"frame_index: frame {int(ids[i])}'s entry [offset {int(o[i])}, length {int(ln[i])}, dictionary "
                f"{int(d[i])}] is not where the segment log puts it (segment {int(s[i])}, bytes "
                f"{int(start[i])}..{int(start[i]) + self.seg}, expected offset {int(want[i])}, open segment "
                f"{self.g} ending at {self.pos}, dictionaries {glo}..{ghi}, none going back)")
        for k in np.unique(d):  # each dictionary decodes its frames (another one would not)
            self.decode(ids[np.flatnonzero(d == k)[-1:]])
        return int(ids.shape[0])

    def close(self) -> None:
        self.dicts.close()
