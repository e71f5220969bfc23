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


# A look trains its candidate with zstd's fastCover search over two segment sizes k (50 and 2,000,
# chosen on a quarter of the samples held out: ZDICT_optimizeTrainFromBuffer_fastCover in one step),
# not ZDICT_trainFromBuffer's four steps (k = 50 .. 2,000): a look (65-130 ms with those) holds adds
# up less often and less long. Two steps (k = 50, 1,025, 2,000) gave frames 1.01x the four steps'
# in 22-40 ms; one step gives 0.996x the two steps' (0.935x .. 1.0x) in 24 ms against their 38 (six
# games, three windows a game, trained on 500 frames and measured on the 500 after them; both timed
# on a loaded machine), and the six games' frames at 20,000 took the same bytes a frame as with two
# steps, with compressed adds about 20% faster (tools/results/compression-games-2026-11-29.txt, run 3).
# (Picking the smaller of k = 50 and k = 2,000 on the measured frames themselves gave 0.95x per game,
# but 594 B on the DQN Replay scale run's four-game pool against 361: a dictionary fitted to the
# newest frames of one game, poor on the next.)
LOOK_STEPS = 1


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
    cand = _zstd.train(train, inp.dict_bytes, steps=LOOK_STEPS)
    new = None
    if cand is not None and cand.size >= _zstd.DICT_MIN_BYTES:
        trial = _zstd.Codec(level=3)
        try:
            trial.set_dictionary(1, cand)
            new = _size(trial, 1, test)
        finally:
            trial.close()
    else:
        cand = None
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
