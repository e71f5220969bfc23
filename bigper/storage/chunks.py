"""Chunk files of the memmap storage: naming, sizing, and one array's chunks
mapped side by side into one address range, with copy-on-write of chunks a
snapshot shares (see ``memmap.py`` for the layout)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..errors import IncompatibleSnapshotError, PathExistsError
from ..common.files import open_regular, preallocate
from ._region import PAGE, Region, round_up

CHUNK_BYTES = 4 << 20


def chunk_name(name: str, k: int) -> str:
    """File name of chunk ``k`` of array ``name`` (field names hold no dots)."""
    return f"{name}.bin" if k == 0 else f"{name}.{k:06d}.bin"


def chunk_rows_for(rows: int, row_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk file: about ``chunk_bytes``, and a whole number of pages
    (so the chunks tile one address range), or all rows in one chunk."""
    unit = PAGE // math.gcd(row_bytes, PAGE)
    per = max(unit, (max(1, chunk_bytes // row_bytes) // unit) * unit)
    return rows if per >= rows else per


class _Array:
    """One array: its chunk files, their mapping and their shared/private state."""

    def __init__(self, root: Path, name: str, rec: dict, most: int | None = None):
        self.name = name
        self.rows, self.shape = int(rec["rows"]), tuple(rec["shape"])
        self.most = self.rows if most is None else max(int(most), self.rows)  # rows it may grow to
        self.dtype = np.dtype(rec["dtype"])
        self.row_bytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.chunk_rows = int(rec["chunk_rows"])
        self.dir = root / "data"
        self.chunk_bytes = self.chunk_rows * self.row_bytes  # a page multiple unless n == 1
        self.n, self.sizes = 0, []
        self.shared = np.zeros(0, dtype=bool)
        self.nshared = 0  # shared.sum(), kept as it changes: writes ask it every time
        self.digests: list = []  # xxh3 of a shared chunk (files that never change)
        self.inodes: list = []
        self._count(self.rows)
        self.region = None  # the mapping that writes and whole-chunk reads go through
        self.reader = None  # the same files again, read-only, for random rows (see map)

    def _count(self, rows: int) -> None:
        """Chunks (and their sizes) for ``rows`` rows; an array that grows or
        shrinks keeps its first ones."""
        n0 = self.n
        self.rows, self.n = rows, -(-rows // self.chunk_rows)
        self.sizes = [min(self.chunk_rows, rows - k * self.chunk_rows) * self.row_bytes for k in range(self.n)]
        if self.n < n0:
            self.nshared -= int(self.shared[self.n:].sum())
        self.shared = np.concatenate([self.shared, np.zeros(max(0, self.n - n0), dtype=bool)])[:self.n]
        self.digests = (self.digests + [None] * max(0, self.n - n0))[:self.n]
        self.inodes = (self.inodes + [0] * max(0, self.n - n0))[:self.n]

    def path(self, k: int) -> Path:
        return self.dir / chunk_name(self.name, k)

    def offset(self, k: int) -> int:
        return k * self.chunk_bytes

    def map(self, writable: bool, known: dict, random_reads: bool = False) -> None:
        """Map every chunk into one address range: ``rw`` (and ``view``) through
        ``region``, with the kernel's default read-ahead, which sequential writes
        and chunk copies want. With ``random_reads``, ``ro`` (what sampling
        reads) maps the same files a second time through ``reader``, advised
        random: a row read from disk then costs its own pages, not the 128 KB
        read-ahead around each. Both share the page cache and see each other's
        writes at once."""
        # An array that may grow reserves the address space of its most rows now: its
        # views stay where they are as chunks are mapped in after them (``grow``).
        size = max(self.offset(self.n - 1) + round_up(self.sizes[-1]), round_up(self.most * self.row_bytes))
        self.region = Region(size)
        self.reader = Region(size) if random_reads else None
        for k in range(self.n):
            self._map_chunk(k, writable, known.get(str(k)))
        self._views()

    def _views(self) -> None:
        self.flat = self.region.array(self.region.size)
        shape = (self.rows, *self.shape)
        self.rw = self.flat[:self.rows * self.row_bytes].view(self.dtype).reshape(shape)
        reads = self.flat if self.reader is None else self.reader.array(self.reader.size)
        self.ro = reads[:self.rows * self.row_bytes].view(self.dtype).reshape(shape)
        self.ro.flags.writeable = False

    def mapped_bytes(self) -> int:
        """Bytes of the region its chunks cover (the rest is reserved only)."""
        return self.offset(self.n - 1) + round_up(self.sizes[-1])

    def shrink(self, rows: int) -> int:
        """``rows`` rows from now on (fewer, whole chunks): the chunks past
        them are unmapped, then their files deleted (a snapshot's links keep
        its copies). Returns how many chunks went."""
        if rows >= self.rows or rows < self.chunk_rows or rows % self.chunk_rows:
            raise ValueError(f"{self.name}: cannot shrink from {self.rows} to {rows} rows "
                             f"(chunks of {self.chunk_rows})")
        first, last = rows // self.chunk_rows, self.n
        for k in range(first, last):
            self.region.unmap(self.offset(k), self.sizes[k])
            if self.reader is not None:
                self.reader.unmap(self.offset(k), self.sizes[k])
        paths = [self.path(k) for k in range(first, last)]
        self._count(rows)
        self._views()
        for p in paths:
            p.unlink(missing_ok=True)
        return last - first

    def grow(self, rows: int, writable: bool) -> list:
        """``rows`` rows from now on (whole chunks, ``most`` at most): the new
        chunk files made, really reserved on disk (a full disk is an
        ``OSError`` naming the file, and every file this call made goes
        again), then mapped. A file already at a new chunk's name is
        ``PathExistsError`` naming it, untouched. Returns the paths made."""
        if rows <= self.rows or rows > self.most or rows % self.chunk_rows or self.rows % self.chunk_rows:
            raise ValueError(f"{self.name}: cannot grow from {self.rows} to {rows} rows "
                             f"(chunks of {self.chunk_rows}, {self.most} at most)")
        first, last = self.n, -(-rows // self.chunk_rows)
        made = []
        try:
            for k in range(first, last):
                p = self.path(k)
                # Made here or refused: a file already at the name (a hard link, a copy, anything
                # bigper's record does not name) is not bigper's (promise 7), so it is never
                # extended, mapped or written through, and never deleted.
                try:
                    preallocate(p, self.chunk_bytes, new=True)
                except FileExistsError:
                    raise PathExistsError(
                        f"{p} is already there, but bigper's record names no chunk {k} of {self.name}: it is "
                        "not bigper's, so the log does not grow into it (nothing was changed; move it away "
                        "to go on)") from None
                made.append(p)
        except BaseException:
            for p in made:
                p.unlink(missing_ok=True)
            raise
        self._count(rows)
        for k in range(first, last):
            self._map_chunk(k, writable)
        self._views()
        return made

    def _map(self, k: int, fd: int, writable: bool) -> None:
        self.region.map_file(self.offset(k), self.sizes[k], fd, writable=writable)
        if self.reader is not None:
            self.reader.map_file(self.offset(k), self.sizes[k], fd, writable=False)
            self.reader.advise_random(self.offset(k), self.sizes[k])

    def _map_chunk(self, k: int, writable: bool, known=None) -> None:
        p = self.path(k)
        try:
            fd = open_regular(p, os.O_RDONLY)  # never a FIFO (a hang) or a symlink out of data/
        except FileNotFoundError:  # (a record naming rows, e.g. of a grown log, whose chunk file is gone)
            raise IncompatibleSnapshotError(
                f"chunk file {p} is missing: the record names {self.rows} rows of {self.name}") from None
        try:
            st = os.fstat(fd)
            if st.st_size < self.sizes[k]:  # mapping past the end would SIGBUS on access
                raise IncompatibleSnapshotError(
                    f"chunk file {p} has {st.st_size} bytes, expected {self.sizes[k]}")
            shared = st.st_nlink > 1
            if writable and not shared:
                os.close(fd)
                fd = open_regular(p, os.O_RDWR)
            self._map(k, fd, writable and not shared)
        finally:
            os.close(fd)
        self.nshared += int(shared) - int(self.shared[k])
        self.shared[k] = shared
        self.inodes[k] = st.st_ino
        self.digests[k] = known[1] if shared and known and known[0] == st.st_ino else None

    def release_pages(self, lo: int, hi: int) -> None:
        """Rows ``lo .. hi - 1`` leave this process's RSS, in both mappings
        (``Region.release_pages``: their bytes stay in the files)."""
        for region in (self.region, self.reader):
            if region is not None and hi > lo:
                region.release_pages(lo * self.row_bytes, (hi - lo) * self.row_bytes)

    def view(self, k: int) -> np.ndarray:
        """The chunk's bytes as mapped (uint8, padding included)."""
        o = self.offset(k)
        return self.flat[o:o + self.sizes[k]]

    def thaw(self, k: int) -> bool:
        """Make chunk ``k`` private and writable: copy it first if a snapshot
        holds it. True when a copy replaced the file (the directory changed)."""
        p = self.path(k)
        copied = os.stat(p).st_nlink > 1
        if copied:
            tmp = p.with_name(p.name + ".cow")
            try:
                # Made here (O_EXCL): a file at the name now is not bigper's (resume removed its own
                # leftovers), and truncating it would write through a planted hard link.
                fd = open_regular(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                raise PathExistsError(
                    f"{tmp} is already there, but bigper did not make it: it is not bigper's, so the copy-on-"
                    "write of its chunk does not go through it (nothing was changed; move it away to go on)"
                ) from None
            try:
                os.posix_fallocate(fd, 0, self.sizes[k])  # a full disk is an OSError here
                view = memoryview(self.view(k))
                while view:
                    view = view[os.write(fd, view):]
                os.replace(tmp, p)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
        else:
            fd = open_regular(p, os.O_RDWR)
        try:
            self._map(k, fd, True)  # the reader too: it still maps the snapshot's file
            self.inodes[k] = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        # The chunk is written next, row by row: fault all its pages in for writing
        # now, once, instead of one write fault per page on later adds.
        self.region.populate_write(self.offset(k), self.sizes[k])
        self.nshared -= int(self.shared[k])
        self.shared[k] = False
        self.digests[k] = None
        return copied

    def shared_chunks_of(self, rows):
        """The chunks ``rows`` touch that a snapshot still shares (distinct,
        ascending), cheaply: an add touches one row of each small array and a
        few frame rows, and after a snapshot this runs on every add until the
        ring has passed every chunk."""
        cr = self.chunk_rows
        if isinstance(rows, (int, np.integer)):
            k = int(rows) % self.rows // cr
            return (k,) if self.shared[k] else ()
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.rows)
            if step != 1:
                ks = self.chunks_of(rows)
                return ks[self.shared[ks]]
            if stop <= start:
                return ()
            return [k for k in range(start // cr, (stop - 1) // cr + 1) if self.shared[k]]
        r = np.asarray(rows).reshape(-1)
        ks = np.where(r < 0, r + self.rows, r) // cr
        hit = ks[self.shared[ks]]
        return np.unique(hit) if hit.size else ()

    def chunks_of(self, rows) -> np.ndarray:
        cr = self.chunk_rows
        if isinstance(rows, (int, np.integer)):
            return np.array([int(rows) % self.rows // cr])
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.rows)
            if step == 1:
                return np.arange(start // cr, (stop - 1) // cr + 1) if stop > start else np.zeros(0, np.int64)
            rows = np.arange(start, stop, step)
        r = np.asarray(rows).reshape(-1)
        return np.unique(np.where(r < 0, r + self.rows, r) // cr)
