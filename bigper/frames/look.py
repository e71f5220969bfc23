"""The dictionary look's heavy part, off the add's path: a worker thread.

A look (``SegmentLog.maybe_train``) decides *whether* to train under the
buffer's lock, from the index alone (a few µs); when it trains, it copies
what the training needs (the compressed bytes of frames ``lo .. fw - 1``
and the dictionaries they name, a few hundred KB) and hands them to a
``Look``: a thread that decodes them, measures the current dictionary on
the newest frames, trains a candidate on the ones before and measures it
too. zstd's trainer (ctypes) and the codec's kernels (numba, ``nogil``)
release the GIL, so adds go on beside it on another core.

The outcome depends only on those inputs, never on when the thread ran:
the log applies it at a fixed frame count (``adopt_at``, the next multiple
of ``TRAIN_FRAMES``), waiting for the thread only if it has not finished by
then, so the same adds give the same dictionaries, in the same frames,
whatever the machine's load. A look's thread touches nothing of the buffer
(it has its own codec and copies of its inputs): closing the buffer, a
restore or a failed write only wait for it and drop the outcome. In a
forked child the thread does not exist: ``outcome`` then runs the work in
the calling thread, on the same inputs, with the same result.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from . import zstd as _zstd


# The candidates a look trains: fastCover at two fixed segment sizes k, the one that compresses the
# measured frames smaller kept, not zstd's default search over k (ZDICT_trainFromBuffer: 37-57 ms on
# 500 frames, a look 65-130 ms, and adds in a tight loop waited for it at nearly every look). On 500
# frames of each of six games, three windows a game, measured on the 500 after them
# (tools/dev/dictionary_trainers.py): both trainings together 18-34 ms, frames 0.93x the search's
# (geometric mean; 0.57x .. 1.15x); k = 2000 alone 0.96x, but SpaceInvaders up to 1.36x (its best
# k is 50). (The search picks k on a quarter of its samples and keeps the dictionary trained on
# the other three quarters; these train on them all.)
LOOK_K = (50, 2000)


@dataclass(frozen=True)
class Inputs:
    """What a look trains and measures on (copies: nothing of the log)."""

    fw: int  # the frame count when the look began (its frames are ``fw - n .. fw - 1``)
    split: int  # frames ``0 .. split - 1`` train the candidate, the others measure it
    blob: np.ndarray  # (bytes,) uint8: the frames' zstd frames
    offsets: np.ndarray  # (n,) int64: each frame's start in ``blob``
    lengths: np.ndarray  # (n,) int64
    slots: np.ndarray  # (n,) int64: the codec slot of each frame's dictionary (0: none)
    dicts: dict  # codec slot -> the dictionary's bytes, for every slot the frames name and ``current``
    current: int  # the codec slot of the dictionary new frames use now (0: none)
    row_bytes: int
    dict_bytes: int  # the candidate's largest size


@dataclass(frozen=True)
class Outcome:
    """A look's measurements: bytes of the measured frames with the current
    dictionary (``now``) and with the candidate (``new``; None: no candidate)."""

    now: int
    new: int | None
    candidate: np.ndarray | None
    measured: int  # frames measured on


def work(inp: Inputs) -> Outcome:
    """Decode, measure, train, measure again (pure: the same inputs give the
    same outcome). Raises what the codec or the trainer raise (a damaged
    frame: ``RuntimeError``; no memory)."""
    codec = _zstd.Codec(level=3)
    try:
        for slot, d in sorted(inp.dicts.items()):
            codec.set_dictionary(slot, d)
        n = inp.offsets.shape[0]
        frames = np.empty((n, inp.row_bytes), dtype=np.uint8)
        bad = _zstd.decompress_rows(codec.dctx(), codec.ddicts, inp.blob, inp.offsets, inp.lengths, inp.slots,
                                    frames, 0, n)
        if bad >= 0:
            raise RuntimeError(f"frame {inp.fw - n + bad} does not decompress to its {inp.row_bytes} bytes")
        train, test = frames[:inp.split], frames[inp.split:]
        now = _size(codec, inp.current, test)
    finally:
        codec.close()
    cand, new = None, None
    for k in LOOK_K:  # (the smaller on the measured frames; ties: the first)
        d = _zstd.train(train, inp.dict_bytes, k=k)
        if d is None or d.size < _zstd.DICT_MIN_BYTES:
            continue
        trial = _zstd.Codec(level=3)
        try:
            trial.set_dictionary(1, d)
            size = _size(trial, 1, test)
        finally:
            trial.close()
        if new is None or size < new:
            cand, new = d, size
    return Outcome(now, new, cand, int(test.shape[0]))


def _size(codec: _zstd.Codec, slot: int, rows: np.ndarray) -> int:
    """Bytes of ``rows`` compressed one by one with ``slot``'s dictionary, in
    this thread (one compressor: no pool)."""
    dst = np.empty(rows.shape[0] * _zstd.bound(rows.shape[1]), dtype=np.uint8)
    lengths = np.empty(rows.shape[0], dtype=np.int64)
    used = _zstd.compress_rows(codec.cctx[slot], rows, dst, lengths)
    if used < 0:
        raise RuntimeError(f"zstd failed to compress a frame of {rows.shape[1]} bytes (row {-1 - used})")
    return int(used)


class Look:
    """One look's work, running in its own thread from construction
    (``thread``); its ``outcome()`` is applied at frame ``adopt_at``."""

    def __init__(self, inputs: Inputs, adopt_at: int, thread: bool = True):
        self.inputs, self.adopt_at = inputs, adopt_at
        self._result: Outcome | BaseException | None = None
        self._thread: threading.Thread | None = None
        if thread:  # (else, or when no thread is to be had, the work runs when its outcome is asked for)
            t = threading.Thread(target=self._run, name="bigper-dictionary", daemon=True)
            try:
                t.start()
            except RuntimeError:
                return
            self._thread = t

    def _run(self) -> None:
        try:
            self._result = work(self.inputs)
        except BaseException as e:  # noqa: BLE001 (handed to whoever asks for the outcome)
            self._result = e

    def wait(self) -> None:
        """Until the thread has ended (it may have been lost: a fork)."""
        if self._thread is not None:
            self._thread.join()

    def outcome(self) -> Outcome:
        """The work's outcome, waited for; run here when the thread could not
        start or did not survive (a forked child); raises what the work raised."""
        self.wait()
        if self._result is None:
            self._run()
        r = self._result
        if not isinstance(r, Outcome):
            raise r if isinstance(r, BaseException) else RuntimeError("the dictionary look gave no outcome")
        return r
