"""The zstd dictionaries of a compressed frame log: given, trained, retrained.

Frames name the dictionary *generation* they were written with (1, 2, ...;
0: none) in their index entry, so generations are non-decreasing in frame
order and the live ones are those from the oldest live frame's to the
newest. At most ``MAX_DICTS`` are kept: generation ``g`` lives in codec slot
``(g - 1) % MAX_DICTS + 1``, and a new one is adopted only when the
generation it would displace names no live frame.

Retraining where it pays (``SegmentLog.maybe_train``, its heavy part in a thread:
``frames/look.py``): every
``TRAIN_FRAMES`` frames the mean stored length of the newest frames is
compared with what the current dictionary gave when it was adopted
(``base``); only when it grew by ``DRIFT`` is a candidate trained (on the
frames before the newest, so the comparison is on frames it never saw) and
adopted when it takes at least ``PAYS`` fewer bytes than the current one on
the newest frames. A candidate that does not pay leaves ``base`` as it was
(one trained on frames from before a change of content cannot pay; the next
one can), and the next try waits ``TRAIN_FRAMES``, then twice as long after
each candidate that does not pay either, until one is adopted or the frames
shrink back. Measured on the real ALE pool (tools/workloads/codecs/frames.py,
3,000 frames a game, dictionaries trained on 1,000 frames, compared on 1,000
later ones): a candidate of the same game saves -30% .. +14% (Qbert's levels
change), one after a switch of game saves +26% .. +90%; 10% adopts every
switch and almost never a same-game candidate.
"""

from __future__ import annotations

import numpy as np

from . import zstd as _zstd
from ..errors import CorruptSnapshotError, InvalidArgumentError

MAX_DICTS = 8  # live dictionaries kept at most
DICT_LIMIT = 1 << 20  # bytes of one dictionary at most (given or recorded)
MAX_GEN = (1 << 31) - 1  # the last generation: an index entry holds it in bits 32..62 (length | gen << 32)
PAYS = 0.10  # a candidate is adopted when it saves this share of the bytes
DRIFT = 0.10  # a candidate is trained when frames grew by this share since the last adoption
TRAIN_BYTES = 128 << 20  # train_dictionary trains on at most this many bytes of frames (an even thinning)


def train_dictionary(frames, size: int = 16384) -> np.ndarray:
    """A zstd dictionary trained on ``frames``, for ``compression_dictionary=``.

    Parameters
    ----------
    frames : array_like, (m, ...) numeric
        Frames like those the buffer will store (each row one frame); a few
        hundred to a few thousand (at least 10, of at least 8 bytes each:
        zstd's trainer crashes on less, so less is refused before the call).
    size : int
        The dictionary's largest size in bytes (256 .. 1 MiB).

        More than ``TRAIN_BYTES`` (128 MiB) of frames are thinned evenly
        (every k-th frame) before training: only those are copied, so a view
        of many frames (a memmap, a broadcast) costs only what is trained on.

    Returns
    -------
    np.ndarray, (n,) uint8
        The dictionary's bytes (``n <= size``).
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 256 <= size <= DICT_LIMIT:
        raise InvalidArgumentError(f"size must be an int of bytes in 256..{DICT_LIMIT}, got {size!r}")
    a = np.asarray(frames)
    least, short = _zstd.TRAIN_MIN_SAMPLES, _zstd.TRAIN_MIN_SAMPLE_BYTES
    if a.ndim < 2 or a.dtype.kind not in "biuf" or a.shape[0] < least or a[0].nbytes < short:
        raise InvalidArgumentError(f"frames must be a numeric array (m, ...) of at least {least} frames of at "
                                   f"least {short} bytes each (what zstd's trainer takes), got {a.dtype} {a.shape}")
    m, row = a.shape[0], a[0].nbytes
    keep = min(m, max(least, TRAIN_BYTES // row))  # (zstd also counts samples in 32 bits)
    if keep < m:  # pick the rows before any copy: a view of 2**31 frames is not copied whole
        a = a[np.linspace(0, m - 1, keep).round().astype(np.int64)]
    rows = np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.uint8)
    d = _zstd.train(rows, int(size))
    if d is None or d.size < 256:
        raise InvalidArgumentError(f"frames: zstd could not train a dictionary on {a.shape[0]} frames of "
                                   f"{a[0].nbytes} bytes (too few or too uniform)")
    return d


def as_dictionary(value, name: str = "compression_dictionary") -> np.ndarray:
    """``value`` (bytes or a 1-d uint8 array) as a dictionary zstd accepts,
    else ``InvalidArgumentError`` naming ``name``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        d = np.frombuffer(bytes(value), dtype=np.uint8).copy()
    elif isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
        d = value.copy()
    else:
        raise InvalidArgumentError(f"{name} must be bytes or a 1-d uint8 array (a zstd dictionary, e.g. from "
                                   f"bigper.train_dictionary), got {type(value).__name__} "
                                   f"{getattr(value, 'dtype', '')} {getattr(value, 'shape', '')}")
    if d.size > DICT_LIMIT:
        raise InvalidArgumentError(f"{name} has {d.size} bytes, more than {DICT_LIMIT}")
    try:
        check(d)
    except ValueError as e:
        raise InvalidArgumentError(f"{name} is not a zstd dictionary: {e}") from None
    return d


def check(d: np.ndarray) -> None:
    """ValueError unless zstd builds dictionary ``d``."""
    c = _zstd.Codec(level=3)
    try:
        c.set_dictionary(1, d)
    finally:
        c.close()


class Dictionaries:
    """The live dictionaries, generations ``lo .. hi`` (none: ``hi == 0``)."""

    def __init__(self, first: np.ndarray | None = None):
        self.lo = 1
        self.dicts: list[np.ndarray] = [] if first is None else [first]
        self.base: float | None = None  # bytes a frame the current dictionary gave when adopted
        # After a candidate that did not pay: no other before frame ``retry``, and the wait
        # doubles with each one that does not (training costs seconds a thousand frames).
        self.retry, self.wait = 0, 0
        self._codec = None
        self.version = 0  # changes with the live dictionaries or the codec (what a decode keeps: segments.py)

    @property
    def hi(self) -> int:
        return self.lo + len(self.dicts) - 1 if self.dicts else 0

    @staticmethod
    def slot(gen: int) -> int:
        return 0 if gen == 0 else (gen - 1) % MAX_DICTS + 1

    @property
    def codec(self) -> _zstd.Codec:
        if self._codec is None:
            codec = _zstd.Codec(level=3)
            for i, d in enumerate(self.dicts):
                codec.set_dictionary(self.slot(self.lo + i), d)
            self._codec = codec
        return self._codec

    def adopt(self, d: np.ndarray, oldest_gen: int) -> bool:
        """Make ``d`` generation ``hi + 1`` after dropping those older than
        ``oldest_gen`` (the oldest live frame's); False when ``MAX_DICTS``
        live ones are kept already, or generation ``MAX_GEN`` is (nothing
        changes then: the current dictionary stays)."""
        if self.lo + len(self.dicts) > MAX_GEN:  # the new one's number would not fit an index entry
            return False
        drop = max(0, min(oldest_gen, self.hi + 1) - self.lo) if oldest_gen else 0
        if len(self.dicts) - drop >= MAX_DICTS:
            return False
        # The codec first: when it fails (no memory) nothing has changed. Its slot
        # holds the generation MAX_DICTS back, dropped here (no live frame names it).
        self.codec.set_dictionary(self.slot(self.lo + len(self.dicts)), d)
        if drop:
            self.dicts, self.lo = self.dicts[drop:], self.lo + drop
        self.dicts.append(d)
        self.version += 1
        return True

    def state(self) -> tuple[dict, np.ndarray]:
        meta = {"dicts_first": self.lo, "dict_sizes": [int(d.size) for d in self.dicts], "dict_base": self.base,
                "dict_retry": [self.retry, self.wait]}
        return meta, (np.concatenate(self.dicts) if self.dicts else np.zeros(0, dtype=np.uint8))

    def restore(self, meta: dict, blob: np.ndarray) -> None:
        """Take recorded dictionaries (checked by ``core/statecheck.py``); one zstd
        refuses is ``CorruptSnapshotError``. A state of format 1 without
        ``dict_sizes`` holds one dictionary (generation 1) or none (0 or 1 byte)."""
        blob = np.asarray(blob, dtype=np.uint8)
        if "dict_sizes" in meta:
            lo, sizes, base = int(meta["dicts_first"]), [int(s) for s in meta["dict_sizes"]], meta["dict_base"]
        else:
            lo, sizes, base = 1, ([blob.size] if blob.size > 1 else []), None
        retry, wait = (int(v) for v in meta.get("dict_retry", (0, 0)))  # (none before it was recorded)
        bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        dicts = [blob[a:b].copy() for a, b in zip(bounds[:-1], bounds[1:])]
        codec = _zstd.Codec(level=3)  # built here once: a dictionary zstd refuses fails the restore
        try:
            for i, d in enumerate(dicts):
                try:
                    codec.set_dictionary(self.slot(lo + i), d)
                except ValueError as e:
                    raise CorruptSnapshotError(f"frames_dict: dictionary {lo + i}: {e}") from None
        except BaseException:
            codec.close()
            raise
        self.close()
        self.lo, self.dicts, self.base = lo, dicts, None if base is None else float(base)
        self.retry, self.wait = retry, wait
        self._codec = codec
        self.version += 1

    def close(self) -> None:
        self.version += 1
        if self._codec is not None:
            self._codec.close()
            self._codec = None
