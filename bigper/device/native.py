"""The feed on the CPU: a gathering thread that never takes the GIL.

A thread that gives the GIL up for a gather must take it back from a
launch-bound learner, which drops and retakes it at every op: while that
thread waits, every drop the learner makes wakes it (a system call the learner
pays, hundreds an update) and it gets the GIL only once the switch interval
forces it. So here the thread's whole life is one compiled call
(``core/feed.serve_kernel``) that never returns to Python, and everything that
needs the GIL runs in the learner's own ``next()``, where it costs only its own
time::

    learner  next(): check the batch gathered for it (lock) -> draw the batch
             ``depth`` ahead into a free slot (lock, one compiled call) ->
             post it -> the batch's tensors
    thread   forever: take the next posted slot -> gather its rows and frames
             -> count it done (looks again every ~0.1 ms when idle)

The slots are rows of one pool the thread knows; each gets torch tensors of its
own (``torch.from_numpy`` of its row: a storage each, so the use counts that
say whether a batch is still held are the slot's own). A slot is reused only
when nothing of its batch is held (``Slot.unheld``); a learner that keeps every
batch gets slots outside the pool, filled in its own thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque

import numpy as np

from ..core import feed as plan
from ..core.prefetch import Threaded, why_after
from ..errors import BufferClosedError
from .feed import _HELD, FeedSampler, Filler, Slot

# Pool slots beyond the ``depth`` in flight and the ``_HELD`` the learner holds: batches a learner
# keeps a little longer (the SB3 drop-in keeps its last four batches' targets). A row is only
# touched when first used.
_SPARE = 4
# Jobs the ring holds at least (a pool of more slots gets one entry a slot: posted and not yet
# gathered, at most ``depth``, must never wrap onto a job the thread has not taken).
_JOBS = 64


def _never() -> bool:
    return False


def feed_sampler(parts, b: int, dev, depth: int, beta=None, stratified: bool = True):
    """The feed for a buffer (its ``core.parts.Parts``; ``device.feed.covered``
    says the feed serves it): on the CPU with a thread (POSIX), ``NativeFeed``;
    else ``FeedSampler``, and for compressed frames: their decode under the
    lock is the longest part of a batch (0.4 ms at B = 32), and in
    ``NativeFeed`` it would run in the learner's ``next()`` (the learner proxy
    kept 74% / 33% of its speed at B = 32 / 256 so, 92% / 52% with the decode
    in ``FeedSampler``'s thread: ``tools/bench.py learner``). That thread draws
    ahead from the start, as the general sampler does."""
    compressed = parts.frames is not None and parts.frames.log is not None
    if dev.type == "cpu" and depth > 0 and os.name == "posix" and not compressed:
        return NativeFeed(parts, b, dev, depth, beta, stratified)
    return FeedSampler(parts, b, dev, depth, beta, stratified)


class NativeFeed(Threaded):
    """The iterator ``sampler(B, prefetch, device="cpu")`` gives where the
    feed covers the buffer: the contract of ``core.prefetch.Prefetcher``
    (errors, ``close``, ``ready``), batches as ``FeedBatch`` dicts equal to
    ``sample(B).to_torch()``'s, draw for draw."""

    def __init__(self, parts, b: int, dev, depth: int, beta=None, stratified: bool = True):
        self._filler = Filler(parts, b, dev, beta, stratified)
        layout = self._filler.layout
        n = depth + _HELD + _SPARE
        self._pool = np.empty((n, layout.size), dtype=np.uint8)
        self._slots: list = [None] * n    # made at first use
        self._free = list(range(n))[::-1]  # pool rows nobody holds (a stack: the warmest first)
        self._kept: list = []              # slots the learner kept when it moved on: looked at again later
        self._flight: deque = deque()      # (slot, job) drawn and posted, oldest first
        self._out: deque = deque()         # slots handed out, the last ``_HELD``
        self._ctl = np.zeros(4, dtype=np.int64)
        self._jobs = np.zeros((max(_JOBS, n), 2), dtype=np.int64)
        self._depth = depth
        self._error: BaseException | None = None  # a draw ahead that failed: raised after the batches before it
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (Threaded's; the thread puts nothing there)
        self._src = None  # the sources the thread gathers from
        r = layout.regions
        frames = r.get(".frames")
        fw = int(np.prod(frames[1][1:], dtype=np.int64)) * frames[2].itemsize if frames else 0
        self._spec = np.array([r["indices"][0], b, r[".ids"][0] if ".ids" in r else 0,
                               frames[0] if frames else 0, fw], dtype=np.int64)
        self._fspec = np.array([[r[name][0], int(np.prod(r[name][1][1:], dtype=np.int64)) * r[name][2].itemsize,
                                 r[".last" if at else "indices"][0]]
                                for name, at in zip(layout.fields, layout.at_last)], dtype=np.int64).reshape(-1, 3)

    @property
    def ready(self) -> int:
        """Batches gathered and waiting."""
        done = int(self._ctl[plan.DONE])
        return sum(1 for _, job in self._flight if job < done)

    def __next__(self):
        if self._done:
            self._stop_iteration()
        out = self._out
        while len(out) >= _HELD:  # the batch before the last: back to the pool, or kept
            slot = out.popleft()
            if slot.index is not None:  # (a slot of its own is let go)
                (self._free.append(slot.index) if slot.unheld() else self._kept.append(slot))
        try:
            slot = self._next_slot()
        except KeyboardInterrupt:  # (the learner's to catch: the slots are where they were, the iteration goes on)
            raise
        except BaseException as e:
            self._done, self._why = True, why_after(self._why, e)
            self.close()
            raise
        out.append(slot)
        slot.code = slot.block.shape
        return slot.batch()

    def _next_slot(self) -> Slot:
        filler = self._filler
        parts = filler.ref()
        if parts is None:
            raise BufferClosedError("the buffer of this sampler was dropped")
        self._top_up(parts)
        if not self._flight:
            if self._error is not None:
                raise self._error
            slot = filler.new_slot()  # every pool slot held: one of its own, filled here
            filler.fill(slot, _never)
            return slot
        slot, job = self._flight.popleft()
        try:
            self._wait(job)
            filler.check(parts, slot.block, _never)
        except KeyboardInterrupt:
            self._flight.appendleft((slot, job))  # (waited for and checked again by the next next())
            raise
        self._top_up(parts)  # the next one posted now: gathered while the learner steps
        return slot

    def _wait(self, job: int) -> None:
        """Until the thread has gathered ``job``; the iteration's end if it was told to stop."""
        while True:
            got = plan.wait_kernel(self._ctl, job)
            if got == 1:
                return
            if got == 0 or self._done:  # closed meanwhile (by another thread, or the buffer's close)
                self._done = True
                self._stop_iteration()
            if not self._thread.is_alive():  # (a forked child's copy: closed by the fork's hook first)
                self._done = True
                self._why = self._why or BufferClosedError("this sampler's thread is gone; make a new sampler")
                self._stop_iteration()

    def _top_up(self, parts) -> None:
        """Draw and post batches until ``depth`` are in flight (or no slot is free)."""
        filler = self._filler
        while len(self._flight) < self._depth and self._error is None:
            slot = self._free_slot()
            if slot is None:
                return
            try:
                filler.draw_into(parts, slot, _never)
                if filler.src is not self._src:
                    self._restart(filler.src)
            except KeyboardInterrupt:
                self._free.append(slot.index)  # (that draw is skipped: the random stream is past it)
                raise
            except BaseException as e:  # noqa: BLE001 (raised once the batches drawn before it are taken)
                self._free.append(slot.index)
                self._error = e
                return
            job = plan.post_kernel(self._ctl, self._jobs, slot.index, filler.n_ids[slot.block.shape])
            self._flight.append((slot, job))

    def _free_slot(self) -> Slot | None:
        if not self._free:
            for i, slot in enumerate(self._kept):
                if slot.unheld():
                    del self._kept[i]
                    return slot
            return None
        s = self._free.pop()
        slot = self._slots[s]
        if slot is None:
            slot = self._slots[s] = self._filler.new_slot(self._pool[s])
            slot.index = s
        return slot

    def _restart(self, src) -> None:
        """(Re)start the thread on ``src``: the sources changed (a restore,
        new storage arrays); what it has is gathered first, from the old ones."""
        ctl = self._ctl
        if self._thread is not None:
            self._wait(int(ctl[plan.POSTED]) - 1)
            ctl[plan.STOP] = 1
            self._thread.join()
            if self._done:  # (closed from another thread meanwhile)
                self._stop_iteration()
            ctl[plan.STOP] = 0
        self._src = src
        self._thread = threading.Thread(target=plan.serve_kernel, name="bigper-feed", daemon=True,
                                        args=(ctl, self._jobs, self._pool, self._spec, self._fspec, src.srcs,
                                              src.ring))
        self._thread.start()
        if self._done:  # a close from another thread since the check above: its stop may predate ours
            ctl[plan.STOP] = 1

    def _signal_stop(self) -> None:
        self._ctl[plan.STOP] = 1
