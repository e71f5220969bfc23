"""One contiguous range of virtual memory stitched together from file chunks.

::

    address:  base                base+C              base+2C         base+size
              | chunk 0 (file A)  | chunk 1 (file B)  | chunk 2 (C')  |
                 PROT_READ           PROT_READ|WRITE     ...

A ``Region`` reserves the whole range once (``PROT_NONE``, no memory
committed) and maps each chunk file over its part with ``MAP_FIXED``. numpy
sees one ordinary array, so a gather is a plain fancy index, whatever file
each row lives in. Remapping one chunk (copy-on-write: a new file at the same
addresses) leaves every array view valid. The range is unmapped when the last
view of it is gone.

Linux (and other POSIX systems with ``MAP_FIXED``) only; offsets and lengths
are multiples of the page size.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
from ..errors import InvalidArgumentError

PAGE = mmap.PAGESIZE

PROT_NONE, PROT_READ, PROT_WRITE = 0, mmap.PROT_READ, mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE = mmap.MAP_SHARED, mmap.MAP_PRIVATE
MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20 if sys.platform.startswith("linux") else 0x1000)
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0x40
MS_SYNC = 4 if sys.platform.startswith("linux") else 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int64]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.msync.restype = ctypes.c_int
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23  # Linux 5.14+
MADV_RANDOM = 1
MADV_DONTNEED = 4
_MAP_FAILED = ctypes.c_void_p(-1).value


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def _fail(what: str):
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


class Region:
    """``size`` bytes of reserved address space (a multiple of the page size)."""

    def __init__(self, size: int):
        self.size = round_up(max(int(size), 1))
        addr = _libc.mmap(None, self.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            self.addr = None
            _fail(f"reserving {self.size} bytes of address space")
        self.addr = addr

    def map_file(self, offset: int, length: int, fd: int, *, writable: bool) -> None:
        """Map the first ``length`` bytes of ``fd`` at ``offset``, replacing what
        was there. Only the last chunk of a region may end inside a page (the
        rest of that page reads as zeros and is never written back)."""
        if offset % PAGE or length < 1 or offset + round_up(length) > self.size:
            raise InvalidArgumentError(f"bad chunk placement: offset {offset}, length {length}, region {self.size}")
        prot = PROT_READ | (PROT_WRITE if writable else 0)
        want = self.addr + offset
        got = _libc.mmap(want, length, prot, MAP_SHARED | MAP_FIXED, fd, 0)
        if got is None or got == _MAP_FAILED:
            _fail("mapping a chunk file")
        if got != want:  # cannot happen with MAP_FIXED; never write through a stray mapping
            raise OSError(f"mmap placed a chunk at {got:#x}, expected {want:#x}")

    def unmap(self, offset: int, length: int) -> None:
        """Give the range back to the reservation (``PROT_NONE``, nothing
        committed): the file mapped there is let go."""
        if offset % PAGE or length < 1 or offset + round_up(length) > self.size:
            raise InvalidArgumentError(f"bad range: offset {offset}, length {length}, region {self.size}")
        want = self.addr + offset
        got = _libc.mmap(want, round_up(length), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                         -1, 0)
        if got is None or got == _MAP_FAILED or got != want:
            _fail("unmapping a chunk")

    def populate_write(self, offset: int, length: int) -> bool:
        """Fault the range in for writing now (``MADV_POPULATE_WRITE``), so the
        writes that follow take no page fault each (on ext4 a write fault on a
        shared file page costs tens of microseconds). Best effort: False where
        the kernel does not offer it or declines; nothing else changes."""
        if not sys.platform.startswith("linux") or length < 1:
            return False
        return _libc.madvise(self.addr + offset, round_up(length), MADV_POPULATE_WRITE) == 0

    def advise_random(self, offset: int, length: int) -> bool:
        """``MADV_RANDOM`` over the range: a page fault reads that page only,
        no read-ahead around it. Best effort, as ``populate_write``."""
        if length < 1:
            return False
        return _libc.madvise(self.addr + offset, round_up(length), MADV_RANDOM) == 0

    def release_pages(self, offset: int, length: int) -> bool:
        """``MADV_DONTNEED`` over the whole pages inside the range: this process
        stops holding them (they leave its RSS); a shared file's pages stay in
        the file and the page cache, written ones too, and the next access maps
        them again. Best effort, as ``populate_write``."""
        lo, hi = round_up(offset), (offset + length) // PAGE * PAGE
        if hi <= lo or not sys.platform.startswith("linux"):
            return False
        return _libc.madvise(self.addr + lo, hi - lo, MADV_DONTNEED) == 0

    def sync(self, offset: int, length: int) -> None:
        """msync(MS_SYNC): written pages of the range reach their files."""
        if length and _libc.msync(self.addr + offset, length, MS_SYNC) != 0:
            _fail("msync")

    def array(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array over the first ``nbytes``; it keeps the region alive."""
        buf = (ctypes.c_char * self.size).from_address(self.addr)
        buf._region = self  # the array's base chain owns the region
        return np.frombuffer(buf, dtype=np.uint8, count=nbytes)

    def __del__(self):
        addr = getattr(self, "addr", None)
        if addr is not None:
            try:
                _libc.munmap(addr, self.size)
            except Exception:  # interpreter shutdown
                pass
            self.addr = None
