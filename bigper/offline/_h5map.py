"""Rows of HDF5 datasets read through a memory map of the file, h5py where that cannot work.

An uncompressed HDF5 dataset is one run of bytes at a known file offset
(contiguous layout), or chunks, each a run of bytes at its own offset. Where
every chunk spans whole rows, row ``r`` of a dataset starts at byte::

    chunk_addr[r // chunk_rows] + (r % chunk_rows) * row_bytes

so a batch is a gather from a read-only memory map of the file (the speed of
the memmap storage, and no h5py call per batch), or, for a dataset beyond the
map's budget (``plan_reads``), a kernel's preads of the same bytes. A :class:`Column` is one
output array over one dataset per *segment* (a Minari episode; the whole file
for D4RL and bigper's layout). Anything the map cannot serve (compressed or
filtered chunks, chunks that split a row, compact or external layouts, other
file drivers) is read through h5py, grouped so that each chunk is read once.
A mapped column is checked against h5py on one row when it is built; a
mismatch sends it to h5py for good.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba import types

from ..common.kernels import kernel
from ..errors import OfflineDatasetError
from ..storage._h5guard import check_row_bytes

# Rows of a contiguous dataset read as one h5py block when read through h5py.
_BLOCK_BYTES = 1 << 16
# Runs of rows at least this long are read with pread, not copied from the map: no page
# faults, and the kernel's sequential readahead (a streamed reprioritize reads like h5py).
_PREAD_BYTES = 1 << 16
# More runs of back-to-back chunks than this: the per-row address gather instead.
_MAX_RUNS = 64


@kernel
def row_addr(s, r, chunk_rows, first_chunk, chunk_addr, row_bytes):
    """The file offset of row ``r`` of segment ``s``, or -1 where its chunk was never written."""
    cr = chunk_rows[s]
    a = chunk_addr[first_chunk[s] + r // cr]
    return a if a < 0 else a + (r % cr) * row_bytes


@kernel
def gather_rows(mm, seg, row, chunk_rows, first_chunk, chunk_addr, row_bytes, out):
    """Copy row ``row[i]`` of segment ``seg[i]`` to bytes ``i*row_bytes ..`` of ``out`` (1-D uint8).

    A chunk that was never written (address -1) reads as zeros, HDF5's fill
    value. Byte offsets are unsigned so that the copy loops vectorize (signed
    indices carry a wraparound check per byte).
    """
    rb = np.uint64(row_bytes)
    for i in range(row.shape[0]):
        a = row_addr(seg[i], row[i], chunk_rows, first_chunk, chunk_addr, row_bytes)
        dst = np.uint64(i) * rb
        if a < 0:
            for j in range(rb):
                out[dst + j] = 0
        else:
            src = np.uint64(a)
            for j in range(rb):
                out[dst + j] = mm[src + j]


# libc's pread, linked by name (numba's ExternalFunction: the kernel's cache entry is the same in
# every process): (fd, buffer address, bytes, file offset) -> bytes read, -1 on an error.
_pread = types.ExternalFunction("pread", types.intp(types.intc, types.uintp, types.uintp, types.int64))
# Bytes asked of one pread at most (Linux returns at most 0x7ffff000; macOS refuses more than INT_MAX).
_MAX_READ = 1 << 30


@kernel
def pread_rows(fd, seg, row, chunk_rows, first_chunk, chunk_addr, row_bytes, out):
    """``gather_rows`` through ``pread`` on ``fd`` instead of a map: rows that lie
    back to back in the file and in ``out`` are one read. Nothing is mapped, so
    a sampled row does not stay in the process's RSS (a map keeps every page a
    batch touched, and the kernel maps a whole folio around each fault). Returns
    the first row of a read that failed or ended early (the end of the file:
    the caller reads from there on again, to retry or to say why), or -1."""
    rb = row_bytes
    base = out.ctypes.data  # (uintp: an offset is added as uintp, never mixed with int64 into a float)
    start, src0, n = 0, np.int64(-1), np.int64(0)  # the read being gathered: out row, file offset, bytes
    for i in range(row.shape[0] + 1):
        src = np.int64(-1)
        if i < row.shape[0]:
            src = row_addr(seg[i], row[i], chunk_rows, first_chunk, chunk_addr, rb)
            if src < 0:  # a chunk never written: HDF5's fill value
                for j in range(rb):
                    out[i * rb + j] = 0
            elif n > 0 and src == src0 + n:
                n += rb
                continue
        done = np.int64(0)
        while done < n:  # (a short read goes on where it stopped)
            got = _pread(fd, base + np.uintp(start * rb + done), np.uintp(min(n - done, _MAX_READ)), src0 + done)
            if got <= 0:
                return start
            done += got
        start, src0, n = i, src, (rb if src >= 0 else 0)
    return -1


@kernel
def row_order(r):
    """0: strictly increasing, 1: non-decreasing with repeats, 2: unsorted."""
    kind = 0
    for i in range(1, r.shape[0]):
        if r[i] < r[i - 1]:
            return 2
        if r[i] == r[i - 1]:
            kind = 1
    return kind


@dataclass
class Column:
    """One array a batch carries, read from one dataset per segment.

    ``row = t + shift - back[g]``, clipped into the segment, where ``t`` is
    the transition's step inside its segment and ``g`` its global index:
    ``shift=1`` reads the successor row (``next_obs`` from ``observations``),
    ``back`` (uint8 per transition, optional) cancels that shift where the
    successor is unknown (a D4RL terminal without ``next_observations``).
    """

    name: str
    shape: tuple
    dtype: np.dtype
    paths: list            # one dataset path per segment
    source: str            # how describe() names it, e.g. "observations[t+1]"
    shift: int = 0
    back: np.ndarray | None = None
    seg_rows: np.ndarray | None = None      # (E,) rows of each segment's dataset
    # The map (filled by map_column); chunk_rows[s] == 0: segment s is read through h5py.
    chunk_rows: np.ndarray | None = None
    first_chunk: np.ndarray | None = None
    chunk_addr: np.ndarray | None = None
    row_bytes: int = 0
    pread: bool = False  # mapped rows are read with pread, not from the map (``read_column``)
    mapped_all: bool = False
    mapped_any: bool = False
    # One segment whose chunks lie back to back in row order, in a few runs: a plain
    # array view of each run (numpy's take() is the memmap storage's own gather).
    runs: list | None = None                # the views
    runs_start: np.ndarray | None = None    # first row of each run, then the row count
    runs_offset: np.ndarray | None = None   # where each run starts in the file

    def mapping(self) -> str:
        how = "read with pread" if self.pread else "memory-mapped"
        return how if self.mapped_all else (f"partly {how}" if self.mapped_any else "via h5py")


def _dataset_map(d, row_bytes: int, size: int):
    """``(chunk_rows, chunk addresses)`` of dataset ``d``, or None where rows are not plain bytes.

    Every byte the map would serve must lie inside the file's ``size`` bytes: a
    crafted address past the end would make the gather read outside the map
    (a crash, not an error), so it is refused here, naming the dataset.
    """
    from h5py import h5d

    rows = d.shape[0]
    if rows == 0 or row_bytes == 0 or d.dtype.hasobject or d.dtype.kind not in "biuf":
        return None
    dcpl = d.id.get_create_plist()
    if dcpl.get_external_count():
        return None
    layout = dcpl.get_layout()
    if layout == h5d.CONTIGUOUS:
        off = d.id.get_offset()
        if off is None:
            return None
        if off + rows * row_bytes > size:
            raise _outside(d, off, rows * row_bytes, size)
        return rows, np.array([off], dtype=np.int64)
    if layout != h5d.CHUNKED or dcpl.get_nfilters() or tuple(d.chunks[1:]) != tuple(d.shape[1:]):
        return None
    cr = int(d.chunks[0])
    addr = np.full(-(-rows // cr), -1, dtype=np.int64)
    bad = []

    def visit(info):
        c = info.chunk_offset[0] // cr
        if c < addr.shape[0]:
            off = int(info.byte_offset)
            need = min(cr, rows - c * cr) * row_bytes
            if off + need > size:
                bad.append((off, need))
            else:
                addr[c] = off

    try:
        d.id.chunk_iter(visit)
    except (AttributeError, NotImplementedError):  # HDF5 < 1.12.3: one call per chunk
        for i in range(d.id.get_num_chunks()):
            visit(d.id.get_chunk_info(i))
    if bad:
        raise _outside(d, bad[0][0], bad[0][1], size)
    if (addr < 0).any() and np.any(d.fillvalue):
        return None  # unwritten chunks read as a non-zero fill value: leave that to h5py
    return cr, addr


def _outside(d, off: int, nbytes: int, size: int):
    return OfflineDatasetError(f"{d.file.filename}: dataset {d.name!r} declares {nbytes:,} bytes of data at "
                               f"byte {off:,}, past the end of the file ({size:,} bytes); a truncated or "
                               "crafted file")


def map_column(col: Column, f, mm) -> None:
    """Fill ``col``'s map from the open h5py file ``f``; ``mm`` is its uint8 memory map or None."""
    e = len(col.paths)
    col.row_bytes = check_row_bytes(col.shape, col.dtype.itemsize, f.filename, col.name)
    col.chunk_rows = np.zeros(e, dtype=np.int64)
    col.first_chunk = np.zeros(e, dtype=np.int64)
    tables = []
    n = 0
    for s, path in enumerate(col.paths):
        got = _dataset_map(f[path], col.row_bytes, mm.shape[0]) if mm is not None else None
        if got is None:
            continue
        col.chunk_rows[s], table = got
        col.first_chunk[s] = n
        tables.append(table)
        n += table.shape[0]
    col.chunk_addr = np.concatenate(tables) if tables else np.zeros(1, dtype=np.int64)
    col.mapped_any = bool((col.chunk_rows > 0).any())
    col.mapped_all = bool((col.chunk_rows > 0).all())
    if col.mapped_any:
        s = int(np.argmax(col.chunk_rows > 0))
        d = f[col.paths[s]]
        last = d.shape[0] - 1
        via_map = _gather_mapped(col, mm, np.full(2, s, dtype=np.int64), np.array([0, last]))
        via_h5 = np.asarray([d[0], d[last]], dtype=col.dtype)
        if via_map.tobytes() != via_h5.tobytes():
            col.chunk_rows[:] = 0
            col.mapped_any = col.mapped_all = False
    if col.mapped_all and e == 1:
        _find_runs(col, mm)


def plan_reads(columns, budget: int) -> None:
    """Which mapped datasets are read through the map: the smallest first, while
    their bytes add up to at most ``budget``; a column that reads any other is
    read with pread (``Column.pread``). A map keeps in the process's RSS every page a read has
    touched (the kernel maps a whole folio around each fault), so a column read
    at random through it ends up resident whole: a 50M-transition file's frame
    log is 12 GB of RSS. pread maps nothing. Measured on a 1M-transition Atari
    file, whose pages were cached: pread of the frame log and its index costs
    what the map costs; of the small per-transition columns too, about 0.6 us a
    read more (B=256: 3.8 ms a round through the map, 4.5 ms all with pread)."""
    mapped = [c for c in columns if c.mapped_any]
    size: dict = {}  # dataset path -> bytes (a dataset two columns read, obs and next_obs, counted once)
    for c in mapped:
        for p, rows in zip(c.paths, c.seg_rows):
            size[p] = int(rows) * c.row_bytes
    used, far = 0, set()
    for p in sorted(size, key=lambda p: (size[p], p)):
        used += size[p]
        if used > budget:
            far.add(p)
    for c in mapped:
        c.pread = any(p in far for p in c.paths)


def _find_runs(col: Column, mm) -> None:
    """Contiguous layout, or chunks placed back to back (HDF5's early allocation puts
    nearly all of them so): cut the rows into runs of plain bytes, if there are few."""
    a, cr, rows, rb = col.chunk_addr, int(col.chunk_rows[0]), int(col.seg_rows[0]), col.row_bytes
    if (a < 0).any():
        return
    first = np.concatenate([[0], np.flatnonzero(np.diff(a) != cr * rb) + 1])  # chunk opening each run
    if first.shape[0] > _MAX_RUNS:
        return
    start = np.minimum(first * cr, rows)
    stop = np.append(start[1:], rows)
    if (a[first] + (stop - start) * rb > mm.shape[0]).any():
        return
    col.runs = [np.ndarray((int(m), *col.shape), dtype=col.dtype, buffer=mm, offset=int(o))
                for m, o in zip(stop - start, a[first])]
    col.runs_start = np.append(start, rows).astype(np.int64)
    col.runs_offset = a[first].astype(np.int64)


def _read_runs(col: Column, row: np.ndarray, pread, unique: bool) -> np.ndarray:
    n = row.shape[0]
    out = np.empty((n,) + col.shape, dtype=col.dtype)
    if n == 0:  # (gather of no index: nothing to read)
        return out
    if len(col.runs) == 1:
        groups = [(0, 0, n)]
    else:  # rows are sorted: one group per run they fall in
        which = np.searchsorted(col.runs_start, row, side="right") - 1
        cut = np.flatnonzero(np.diff(which)) + 1
        bounds = [0, *cut.tolist(), n]
        groups = [(int(which[lo]), lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    for j, lo, hi in groups:
        rr = row[lo:hi] - col.runs_start[j] if j else row[lo:hi]
        view, m = col.runs[j], hi - lo
        r0 = int(rr[0])
        if unique and m > 1 and int(rr[-1]) - r0 == m - 1:  # a run of rows (reprioritize): one copy
            if pread is not None and m * col.row_bytes >= _PREAD_BYTES:
                pread(int(col.runs_offset[j]) + r0 * col.row_bytes, out[lo:hi])
            else:
                out[lo:hi] = view[r0:r0 + m]
        else:
            np.take(view, rr, axis=0, out=out[lo:hi])
    return out


def _gather_mapped(col: Column, mm, seg: np.ndarray, row: np.ndarray, fd: int = -1, pread=None) -> np.ndarray:
    """Rows ``row`` of segments ``seg`` from the map ``mm``, or with ``pread`` on
    ``fd`` (>= 0): see ``pread_rows``. From a read the kernel could not finish
    on, the rows are read again one by one by ``pread(offset, out)`` (which
    raises ``OSError`` at the end of the file: one cut since it was opened, or
    with the error's reason)."""
    rb = col.row_bytes
    out = np.empty(row.shape[0] * rb, dtype=np.uint8)
    if fd < 0:
        gather_rows(mm, seg, row, col.chunk_rows, col.first_chunk, col.chunk_addr, rb, out)
    else:
        bad = pread_rows(fd, seg, row, col.chunk_rows, col.first_chunk, col.chunk_addr, rb, out)
        for i in range(bad if bad >= 0 else row.shape[0], row.shape[0]):
            a = int(row_addr(seg[i], row[i], col.chunk_rows, col.first_chunk, col.chunk_addr, rb))
            if a < 0:  # (not reached by the kernel: zeros, as it gives them)
                out[i * rb:(i + 1) * rb] = 0
            elif pread is None:
                raise OSError(f"a read of {col.name!r} at byte {a} failed")
            else:
                pread(a, out[i * rb:(i + 1) * rb])
    return out.view(col.dtype).reshape((row.shape[0],) + col.shape)


def _read_h5(d, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = d[rows]`` for sorted unique ``rows``: one h5py slice read per run of
    rows in the same or adjacent chunks, so each chunk is read (and decompressed) once."""
    if d.chunks:
        span = int(d.chunks[0])
    else:
        row_bytes = max(1, int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize)
        span = max(1, _BLOCK_BYTES // row_bytes)
    block = rows // span
    cuts = np.flatnonzero(np.diff(block) > 1) + 1
    lo = 0
    for hi in (*cuts.tolist(), rows.shape[0]):
        a, b = int(rows[lo]), int(rows[hi - 1]) + 1
        part = d[a:b]
        # (a dataset of (n, 1) read as one value a row, D4RL's rewards: the same values, its shape)
        out[lo:hi] = part[rows[lo:hi] - a].reshape(out[lo:hi].shape)
        lo = hi


def read_column(col: Column, f, mm, seg: np.ndarray, t: np.ndarray, g: np.ndarray,
                pread=None, fd: int = -1) -> np.ndarray:
    """Rows of ``col`` for sorted unique transitions ``g`` (segment ``seg``, step ``t``).

    ``pread(offset, out)``, when given, fills the array ``out`` from the file at
    ``offset``; long runs of consecutive rows are read with it. A column marked
    ``pread`` (``plan_reads``) has its mapped rows read with pread on ``fd`` in a
    kernel, none through the map.
    """
    fd = fd if col.pread else -1
    row = t + col.shift if col.shift else t
    if col.back is not None:
        row = row - col.back[g]
    if col.shift or col.back is not None:
        row = np.clip(row, 0, col.seg_rows[seg] - 1)
    if fd >= 0 and col.mapped_all:
        out = _gather_mapped(col, mm, seg, row, fd, pread)
    elif col.runs is not None:
        # rows shifted or clipped may repeat: a run of rows is then not told by its ends
        out = _read_runs(col, row, pread, unique=not col.shift and col.back is None)
    elif col.mapped_all:
        out = _gather_mapped(col, mm, seg, row)
    else:
        out = np.empty((row.shape[0],) + col.shape, dtype=col.dtype)
        use_map = col.chunk_rows[seg] > 0 if col.mapped_any else np.zeros(row.shape[0], dtype=bool)
        if use_map.any():
            out[use_map] = _gather_mapped(col, mm, seg[use_map], row[use_map], fd, pread)
        rest = np.flatnonzero(~use_map)
        if rest.shape[0]:
            # Rows are sorted by transition, hence by segment: cut at segment changes.
            cuts = np.flatnonzero(np.diff(seg[rest])) + 1
            for part in np.split(rest, cuts):
                sub = np.empty((part.shape[0],) + col.shape, dtype=col.dtype)
                _read_h5(f[col.paths[int(seg[part[0]])]], row[part], sub)
                out[part] = sub
    if not out.dtype.isnative:
        out = out.astype(out.dtype.newbyteorder("="))
    return out
