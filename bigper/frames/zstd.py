"""libzstd, called from numba kernels with the GIL released.

The library is the system's ``libzstd`` where there is one, else the copy
that the ``blosc2`` wheel carries (``pip install 'bigper[compression]'``
installs it; its ``libblosc2`` exports the whole zstd API). Nothing is loaded
at import: :func:`lib` loads it on the first use of compression, and the
kernels link to its functions by name (numba's ``ExternalFunction``), so they
compile to the same cache entries in every process.

Every frame is one zstd frame with a content checksum, a frame that does
not shrink too (stored in raw blocks): a flipped bit in a stored frame fails
its decompression instead of returning other bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import numpy as np
from numba import types

from ..common.kernels import kernel
from ..common.pool import for_ranges, ranges
from ..errors import CompressionUnavailableError

EXTRA = "in a bigper checkout, pip install -e '.[compression]' (from an index: pip install 'bigper[compression]')"
_LOCK = threading.Lock()
_LIB = None
_C_LEVEL, _C_CHECKSUM = 100, 201  # ZSTD_c_compressionLevel, ZSTD_c_checksumFlag
DICT_MAGIC = bytes.fromhex("37a430ec")  # ZSTD_MAGIC_DICTIONARY, little endian


def _candidates() -> list[str]:
    env = os.environ.get("BIGPER_LIBZSTD")
    if env:  # the user's choice: that library or none (never silently another)
        return [env]
    out = []
    found = ctypes.util.find_library("zstd")
    if found:
        out.append(found)
    out.append("libzstd.so.1")
    try:
        import blosc2  # noqa: F401  (only its shared library is used)

        d = os.path.join(os.path.dirname(blosc2.__file__), "lib")
        out += [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith("libblosc2")]
    except (ImportError, OSError):
        pass
    return out


def lib():
    """The loaded library (ctypes), with its symbols visible to numba's linker."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        import llvmlite.binding as llvm

        errors = []
        for name in _candidates():
            try:
                cdll = ctypes.CDLL(name)
                cdll.ZSTD_compress2, cdll.ZSTD_decompress_usingDDict, cdll.ZDICT_trainFromBuffer  # noqa: B018
                if cdll.ZSTD_versionNumber() < 10400:
                    raise OSError(f"zstd {cdll.ZSTD_versionNumber()} is older than 1.4")
                path = getattr(cdll, "_name", name)
                llvm.load_library_permanently(path if os.path.sep in path else name)
            except (OSError, AttributeError, RuntimeError) as e:
                errors.append(f"{name}: {e}")
                continue
            _declare(cdll)
            _LIB = cdll
            return cdll
        raise CompressionUnavailableError(
            f"compression='zstd' needs libzstd (>= 1.4): none could be loaded ({'; '.join(errors) or 'none found'}); "
            f"install the extra: {EXTRA}")


def _declare(c) -> None:
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for fn, res, args in (
        ("ZSTD_createCCtx", vp, []), ("ZSTD_freeCCtx", sz, [vp]),
        ("ZSTD_createDCtx", vp, []), ("ZSTD_freeDCtx", sz, [vp]),
        ("ZSTD_CCtx_setParameter", sz, [vp, ctypes.c_int, ctypes.c_int]),
        ("ZSTD_CCtx_refCDict", sz, [vp, vp]),
        ("ZSTD_createCDict", vp, [vp, sz, ctypes.c_int]), ("ZSTD_freeCDict", sz, [vp]),
        ("ZSTD_createDDict", vp, [vp, sz]), ("ZSTD_freeDDict", sz, [vp]),
        ("ZSTD_isError", ctypes.c_uint, [sz]), ("ZSTD_getErrorName", ctypes.c_char_p, [sz]),
        ("ZDICT_trainFromBuffer", sz, [vp, sz, vp, vp, ctypes.c_uint]),
        ("ZSTD_versionNumber", ctypes.c_uint, []),
        ("ZDICT_isError", ctypes.c_uint, [sz]),
    ):
        f = getattr(c, fn)
        f.restype, f.argtypes = res, args
    fast = getattr(c, "ZDICT_optimizeTrainFromBuffer_fastCover", None)  # (static-only: some builds leave it out)
    if fast is not None:
        fast.restype, fast.argtypes = sz, [vp, sz, vp, vp, ctypes.c_uint, ctypes.POINTER(_FastCover)]


# The kernels' view of the library: pointers are passed as integers (uintp).
_u = types.uintp
_compress2 = types.ExternalFunction("ZSTD_compress2", _u(_u, _u, _u, _u, _u))
_decompress = types.ExternalFunction("ZSTD_decompress_usingDDict", _u(_u, _u, _u, _u, _u, _u))
_is_error = types.ExternalFunction("ZSTD_isError", types.uint32(_u))


# Rows a thread compresses at least (about 0.8 ms of 84x84 frames): fewer go in one call.
COMPRESS_CHUNK = 64


def bound(n: int) -> int:
    """The largest zstd frame a row of ``n`` bytes can take (``ZSTD_COMPRESSBOUND``)."""
    return n + (n >> 8) + ((128 * 1024 - n) >> 11 if n < 128 * 1024 else 0)


@kernel
def compress_rows(cctx, src, dst, lengths):
    """Compress each row of ``src`` (m, n) uint8 into ``dst`` (at least
    ``m * bound(n)`` bytes) one after another, each a zstd frame with its
    checksum (a row that does not shrink is one too: raw blocks, a few bytes
    longer); ``lengths[r]`` gets row r's size. Returns the bytes used, or
    ``-1 - r`` when row r failed."""
    m, n = src.shape
    pos = 0
    cap = dst.shape[0]
    for r in range(m):
        res = _compress2(cctx, dst.ctypes.data + pos, cap - pos, src[r].ctypes.data, n)
        if _is_error(res) != 0:
            return -1 - r
        lengths[r] = res
        pos += res
    return pos


@kernel
def decompress_rows(dctx, ddicts, log, offsets, lengths, dict_ids, out, lo, hi):
    """Rows ``lo .. hi-1`` of ``out`` (m, n) uint8 from the zstd frames
    ``log[offsets[r]:offsets[r] + lengths[r]]`` (checked to lie inside ``log``
    by the caller), with dictionary ``ddicts[dict_ids[r]]`` (0: none). Returns
    the first row that failed (a zstd error: a damaged frame, a failed
    checksum, another dictionary; or another size than ``n``), or -1."""
    n = out.shape[1]
    for r in range(lo, hi):
        res = _decompress(dctx, out[r].ctypes.data, n, log.ctypes.data + offsets[r], lengths[r],
                          ddicts[dict_ids[r]])
        if _is_error(res) != 0 or res != n:
            return r
    return -1


class Codec:
    """Compression contexts for one dictionary set: a compressor per
    dictionary (level, checksum) and decompressors, one per thread."""

    def __init__(self, level: int = 3):
        self.c = lib()
        self.level = level
        self.cdicts: list[int] = [0]  # index 0: no dictionary
        self.ddicts = np.zeros(1, dtype=np.uintp)
        self.cctx: list[int] = [self._cctx(0)]
        self._more: dict[tuple[int, int], int] = {}  # (slot, i): compressor i >= 1 of a slot, for compress_into
        self._dctx: dict[int, int] = {}
        self._dlock = threading.Lock()

    def _cctx(self, cdict: int) -> int:
        c = self.c
        cctx = c.ZSTD_createCCtx()
        if not cctx:
            raise MemoryError("ZSTD_createCCtx failed")
        for p, v in ((_C_LEVEL, self.level), (_C_CHECKSUM, 1)):
            self._check(c.ZSTD_CCtx_setParameter(cctx, p, v))
        if cdict:
            self._check(c.ZSTD_CCtx_refCDict(cctx, cdict))
        return cctx

    def _check(self, code: int) -> None:
        if self.c.ZSTD_isError(code):
            raise RuntimeError(self.c.ZSTD_getErrorName(code).decode())

    def _dicts(self, content: np.ndarray) -> tuple[int, int]:
        """A CDict and a DDict of ``content``; ValueError when zstd refuses it."""
        buf = np.ascontiguousarray(content, dtype=np.uint8)
        if buf.size < 8 or bytes(buf[:4]) != DICT_MAGIC:
            raise ValueError(f"a zstd dictionary starts with {DICT_MAGIC.hex()}, got {buf.size} bytes "
                             f"starting {bytes(buf[:4]).hex()}")
        cd = self.c.ZSTD_createCDict(buf.ctypes.data, buf.nbytes, self.level)
        dd = self.c.ZSTD_createDDict(buf.ctypes.data, buf.nbytes)  # both copy the bytes
        if not cd or not dd:  # (also what damaged entropy tables give)
            for x, free in ((cd, self.c.ZSTD_freeCDict), (dd, self.c.ZSTD_freeDDict)):
                if x:
                    free(x)
            raise ValueError(f"zstd refused the dictionary of {buf.size} bytes (damaged tables, or no memory)")
        return cd, dd

    def set_dictionary(self, slot: int, content: np.ndarray) -> None:
        """Put a dictionary (its bytes) in ``slot`` (>= 1), freeing the one
        there (slots between get none); ValueError when zstd refuses it."""
        cd, dd = self._dicts(content)
        try:
            cctx = self._cctx(cd)
        except BaseException:
            self.c.ZSTD_freeCDict(cd)
            self.c.ZSTD_freeDDict(dd)
            raise
        while len(self.cdicts) <= slot:
            self.cdicts.append(0)
            self.cctx.append(0)
        ddicts = np.zeros(max(self.ddicts.shape[0], slot + 1), dtype=np.uintp)
        ddicts[:self.ddicts.shape[0]] = self.ddicts
        old = self.cdicts[slot], int(ddicts[slot]), self.cctx[slot]
        for key in [key for key in self._more if key[0] == slot]:  # (they refer to the old CDict)
            self.c.ZSTD_freeCCtx(self._more.pop(key))
        self.cdicts[slot], self.cctx[slot] = cd, cctx
        ddicts[slot] = dd
        self.ddicts = ddicts
        c = self.c
        for x, free in ((old[2], c.ZSTD_freeCCtx), (old[0], c.ZSTD_freeCDict), (old[1], c.ZSTD_freeDDict)):
            if x:
                free(x)

    def dctx(self) -> int:
        """This thread's decompression context."""
        t = threading.get_ident()
        d = self._dctx.get(t)
        if d is None:
            with self._dlock:
                d = self.c.ZSTD_createDCtx()
                if not d:
                    raise MemoryError("ZSTD_createDCtx failed")
                self._dctx[t] = d
        return d

    def compress_into(self, dict_id: int, rows: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> int:
        """``compress_rows`` with dictionary ``dict_id``: many rows are cut into ranges
        compressed on several threads (a compressor each; the kernel releases the GIL),
        their frames then moved one after another. Each row is its own zstd frame, so
        the bytes, ``lengths`` and the return value are those of one call."""
        m, n = rows.shape
        if m < 2 * COMPRESS_CHUNK:  # one range whatever the threads (an add's frames: no pool, no environ)
            return compress_rows(self.cctx[dict_id], rows, dst, lengths)
        parts = ranges(m, COMPRESS_CHUNK)
        if len(parts) == 1:
            return compress_rows(self.cctx[dict_id], rows, dst, lengths)
        b = bound(n)
        ctxs = [self.cctx[dict_id]] + [self._more_cctx(dict_id, i) for i in range(1, len(parts))]
        at = {lo: i for i, (lo, _hi) in enumerate(parts)}
        used = [0] * len(parts)

        def one(lo: int, hi: int) -> None:
            used[at[lo]] = compress_rows(ctxs[at[lo]], rows[lo:hi], dst[lo * b:hi * b], lengths[lo:hi])
        for_ranges(one, m, COMPRESS_CHUNK)  # (the same ranges: same m and chunk)
        pos = 0
        for (lo, _hi), u in zip(parts, used):
            if u < 0:
                return u - lo  # -1 - (the failed row)
            if pos != lo * b:
                dst[pos:pos + u] = dst[lo * b:lo * b + u]  # (numpy copies overlapping slices safely)
            pos += u
        return pos

    def _more_cctx(self, slot: int, i: int) -> int:
        cctx = self._more.get((slot, i))
        if cctx is None:
            cctx = self._more[(slot, i)] = self._cctx(self.cdicts[slot])
        return cctx

    def compress(self, rows: np.ndarray, dict_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``(bytes, lengths)``: rows (m, n) uint8 compressed one by one, one
        after another, each a zstd frame of at most ``bound(n)`` bytes."""
        m, n = rows.shape
        dst = np.empty(m * bound(n), dtype=np.uint8)
        lengths = np.empty(m, dtype=np.int64)
        used = self.compress_into(dict_id, rows, dst, lengths)
        if used < 0:
            raise RuntimeError(f"zstd failed to compress a frame of {n} bytes (row {-1 - used})")
        return dst[:used], lengths

    def close(self) -> None:
        c = self.c
        for x in [*self.cctx, *self._more.values()]:
            if x:
                c.ZSTD_freeCCtx(x)
        self._more = {}
        for x in self.cdicts[1:]:
            if x:
                c.ZSTD_freeCDict(x)
        for x in self.ddicts[1:]:
            if x:
                c.ZSTD_freeDDict(int(x))
        for x in self._dctx.values():
            c.ZSTD_freeDCtx(x)
        self.cctx, self.cdicts, self._dctx = [], [0], {}
        self.ddicts = np.zeros(1, dtype=np.uintp)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


# What ZDICT_trainFromBuffer needs, checked before the call: it crashes on less instead of
# returning an error (SIGSEGV with 8 or 9 samples of one byte, SIGFPE with 10: zstd issues
# #3599 and #4499; its fastCover hashes d = 6 or 8 bytes at a time and reads past shorter
# samples). Its own command line refuses fewer than 5 samples ("nb of samples too low").
TRAIN_MIN_SAMPLES = 10
TRAIN_MIN_SAMPLE_BYTES = 8
TRAIN_MAX_BYTES = 2000 << 20  # ZDICT_MAX_SAMPLES_SIZE: more is refused (or cut) by the trainer
DICT_MIN_BYTES = 256  # ZDICT_DICTSIZE_MIN


def trainable(m: int, n: int) -> bool:
    """``m`` samples of ``n`` bytes are what the trainer takes without crashing."""
    return m >= TRAIN_MIN_SAMPLES and n >= TRAIN_MIN_SAMPLE_BYTES and m * n <= TRAIN_MAX_BYTES and m < 1 << 32


class _ZParams(ctypes.Structure):
    _fields_ = [("compressionLevel", ctypes.c_int), ("notificationLevel", ctypes.c_uint), ("dictID", ctypes.c_uint)]


class _FastCover(ctypes.Structure):
    """``ZDICT_fastCover_params_t`` as zstd 1.4.5 and later lay it out."""
    _fields_ = [("k", ctypes.c_uint), ("d", ctypes.c_uint), ("f", ctypes.c_uint), ("steps", ctypes.c_uint),
                ("nbThreads", ctypes.c_uint), ("splitPoint", ctypes.c_double), ("accel", ctypes.c_uint),
                ("shrinkDict", ctypes.c_uint), ("shrinkDictMaxRegression", ctypes.c_uint), ("zParams", _ZParams)]


# fastCover's other parameters for ``train(..., k= or steps=)``: ZDICT_trainFromBuffer's own (d = 8,
# f = 20, accel 1, each k trained on 3/4 of the samples and measured on the rest).
FIXED_D, FIXED_F = 8, 20


def train(samples: np.ndarray, size: int = 16384, k: int | None = None,
          steps: int | None = None) -> np.ndarray | None:
    """A zstd dictionary of at most ``size`` bytes (``size`` at least
    ``DICT_MIN_BYTES``; on a few tiny samples zstd may give fewer: callers
    check) trained on ``samples`` (m, n) uint8 rows; None when training fails
    (too few or too uniform samples), and without calling the trainer when
    the samples are fewer or shorter than it takes (``trainable``).
    ``k``: fastCover at that segment size alone; ``steps``: its search over
    that many k in 50 .. 2,000 (the default's is 4); both need zstd >= 1.4.5,
    else the default."""
    if not DICT_MIN_BYTES <= size:
        raise ValueError(f"a zstd dictionary takes at least {DICT_MIN_BYTES} bytes, got size={size}")
    m, n = samples.shape
    if not trainable(m, n):
        return None
    c = lib()
    samples = np.ascontiguousarray(samples, dtype=np.uint8)
    sizes = np.full(m, n, dtype=np.uintp)
    out = np.empty(size, dtype=np.uint8)
    fast = getattr(c, "ZDICT_optimizeTrainFromBuffer_fastCover", None) if (k or steps) and \
        c.ZSTD_versionNumber() >= 10405 else None
    if fast is not None:  # (declared by _declare) the default's trainer, fewer steps or one k
        kk = min(int(k), size) if k else 0
        if k and kk < FIXED_D or not 1 <= (steps or 1) <= 64:  # (a k near 2**32 loops forever in zstd 1.5)
            return None
        p = _FastCover(k=kk, d=FIXED_D, f=FIXED_F, accel=1, steps=steps or 1)
        p.zParams.compressionLevel = 3
        got = fast(out.ctypes.data, size, samples.ctypes.data, sizes.ctypes.data, m, ctypes.byref(p))
    else:
        got = c.ZDICT_trainFromBuffer(out.ctypes.data, size, samples.ctypes.data, sizes.ctypes.data, m)
    if c.ZDICT_isError(got):
        return None
    return out[:got].copy()
