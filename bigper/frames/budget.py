"""The compressed frame log's size: its geometry and the budget rule.

One rule, used by everything that meets a ``compression_budget``: the
validator a config meets when it is built or read back from disk (resume,
``load``, ``from_hdf5``), and the layout the segment log (``frames/segments.py``)
is made with (``log_geometry``: a fixed log for a budget, a growing one
without).

Since issue 34 a budget is optional, and a cap: without one (the default)
the log grows by segments as its frames need them (``grow_geometry``), up to
the segments ``F`` frames that do not compress would take, so a buffer keeps
``capacity`` sampleable transitions whatever its frames compress to. With
one, the log has the fixed size below (every file a budget ever made keeps
loading as it was), and frames that compress worse than it release the
oldest segment early.

A budget is valid when the log it gives keeps, at its emptiest, the frames
one sampleable item needs even when no frame compresses: at the moment a
segment opens and the oldest is released, only ``S - 1`` sealed segments of
at least ``seg // bound(row_bytes)`` frames each are left, and one
transition of each env needs ``frame_stack + n_step`` of them (a sequence,
``frame_stack + burn_in + length``). A smaller budget would keep nothing
sampleable, ever, with frames that do not compress.
"""

from __future__ import annotations

import math

from .zstd import bound

MAX_SEG = 1 << 20  # bytes of one segment at most (the log grows in segments past that)
PAGE = 4096  # a growing log's segments are whole pages: each is one chunk file of a memmap storage
HINT = 64  # a growing log's segments: about 1/HINT of what F frames take at a sixteenth of a frame each


def frame_capacity(capacity: int, k: int, num_envs: int) -> int:
    """Frames in the ring: one a step, plus room for episode starts (about
    1.6%) and for the stacks of every env in flight."""
    return capacity + capacity // 64 + (k + 1) * num_envs + 1


def geometry(F: int, row_bytes: int, budget: int) -> tuple[int, int, int]:
    """``(BLOCK, SEG, S)``: block and segment bytes and segments for ``F``
    frames of ``row_bytes`` at ``budget`` bytes a frame."""
    block = min(4096, 1 << max(6, (row_bytes - 1).bit_length()))
    total = max(F * budget, 1)
    per = max(math.ceil(bound(row_bytes) / block), min(MAX_SEG // block, total // 16 // block))
    seg = per * block
    return block, seg, max(3, math.ceil(total / seg))


def grow_geometry(F: int, row_bytes: int) -> tuple[int, int, int]:
    """``(BLOCK, SEG, S)`` of a log that grows (no budget): segments of
    whole pages, about a 64th of what ``F`` frames take at a sixteenth of a
    frame (small segments keep the bytes held beyond the frames' own small:
    the open segment's free tail, the oldest one's expired head, one spare),
    between one largest zstd frame and ``MAX_SEG``; ``S`` segments at most:
    enough for ``F`` frames that do not compress, each segment holding at
    least ``SEG // bound`` of them, with the open one and the oldest one's
    expired part on top."""
    block = min(4096, 1 << max(6, (row_bytes - 1).bit_length()))
    big = bound(row_bytes)
    typical = F * max(64, row_bytes // 16) // HINT
    seg = -(-max(big, min(MAX_SEG, typical)) // PAGE) * PAGE
    return block, seg, -(-F // (seg // big)) + 2


def log_geometry(F: int, row_bytes: int, budget: int | None) -> tuple[int, int, int]:
    """The geometry of a log: fixed by ``budget`` (``geometry``), or growing (None)."""
    return grow_geometry(F, row_bytes) if budget is None else geometry(F, row_bytes, budget)


def frames_needed(F: int, k: int, n_step: int, num_envs: int, steps: int = 1) -> int:
    """Frames one item of every env spans: its ``k``-frame stack and the
    ``max(n_step, steps)`` frames after its first (``steps``: a sequence's
    ``burn_in + length``); at most the ``F`` frames the ring holds (more
    would not be sampleable raw either, and would ask for a log of any size:
    a recorded n_step of 2**29)."""
    return min((k + max(n_step, steps)) * num_envs, F)


def kept(F: int, row_bytes: int, budget: int) -> int:
    """Frames that do not compress which the log keeps at its emptiest:
    ``S - 1`` sealed segments of ``seg // bound(row_bytes)`` frames at least."""
    _block, seg, S = geometry(F, row_bytes, budget)
    return (S - 1) * (seg // bound(row_bytes))


def budget_range(F: int, row_bytes: int, need: int) -> tuple[int, int]:
    """``(lo, hi)``: ``lo`` keeps ``need`` frames that do not compress
    (``kept``), the first found by bisection; ``hi`` is a frame's largest
    zstd frame (a larger budget is never needed), or ``lo`` where that is
    more (a small ring of many envs). ``kept`` is not monotone in the budget
    (a segment one block longer can leave one segment fewer), so a budget in
    ``lo..hi`` is valid only where ``fits`` says so."""
    big = bound(row_bytes)
    # A budget this large has segments of at most max(MAX_SEG, a frame and a block)
    # and more than need + 1 of them: it keeps need frames.
    top = max(big, math.ceil((need + 2) * (max(MAX_SEG, big + 4096) + 4096) / max(F, 1)))
    a, b = 1, top
    while a < b:
        mid = (a + b) // 2
        if kept(F, row_bytes, mid) >= need:
            b = mid
        else:
            a = mid + 1
    return a, max(big, a)


def fits(F: int, row_bytes: int, need: int, budget: int) -> bool:
    """``budget`` is one a config may record: in ``1..hi`` and its log keeps
    ``need`` frames that do not compress."""
    return 1 <= budget <= budget_range(F, row_bytes, need)[1] and kept(F, row_bytes, budget) >= need

