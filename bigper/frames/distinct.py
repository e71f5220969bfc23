"""A sequence batch's frames once: each row's distinct frames, and where each
stack step finds its frames among them.

A row of ``T`` steps with ``k``-frame stacks names about ``T + k`` distinct
frames but ``2 T k`` stack entries (``obs`` and ``next_obs``): moving the
distinct frames and rebuilding the stacks where they are used (on a device,
one gather) moves ``2k`` times fewer bytes::

    refs (B, T, k) per stack --argsort per row--> ids (B, n), positions (B, T, k)
"""

from __future__ import annotations

import numpy as np


def distinct_frames(refs: dict, mask: np.ndarray) -> tuple[np.ndarray, dict, np.ndarray]:
    """Each row's distinct frames of a sequence batch: ``refs`` are the
    ``(B, T, k)`` frame ids of its stacks by name (``obs``, ``next_obs``),
    ``mask`` its real steps (a padded step's stack is zeros: id -1).

    Returns ``ids`` ``(B, n)`` (a row's distinct ids, then -1: zero frames),
    by name the ``(B, T, k)`` positions of each stack's frames among its
    row's ``ids``, and ``first`` ``(B, n)``: where each distinct frame occurs
    in the row's stacks laid end to end (``names`` in order, ``T * k`` each;
    -1 for a zero frame)."""
    names = list(refs)
    b, t, k = refs[names[0]].shape
    ids = np.concatenate([np.where(mask[:, :, None], refs[n], -1).reshape(b, t * k) for n in names], axis=1)
    order = np.argsort(ids, axis=1, kind="stable")
    srt = np.take_along_axis(ids, order, axis=1)
    new = np.ones(srt.shape, dtype=np.bool_)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    rank = np.cumsum(new, axis=1) - 1
    n = int(rank[:, -1].max()) + 1
    out = np.full((b, n), -1, dtype=np.int64)
    np.put_along_axis(out, rank, srt, axis=1)
    first = np.full((b, n), -1, dtype=np.int64)
    np.put_along_axis(first, rank, order, axis=1)
    first[out < 0] = -1
    pos = np.empty_like(rank)
    np.put_along_axis(pos, order, rank, axis=1)
    index = {name: pos[:, i * t * k:(i + 1) * t * k].reshape(b, t, k) for i, name in enumerate(names)}
    return out, index, first


def frames_of_stacks(stacks: list, first: np.ndarray) -> np.ndarray:
    """The ``(B, n, *frame)`` distinct frames of a sequence batch taken from
    its own ``(B, T, k, *frame)`` stacks (``distinct_frames``' ``first``)."""
    b, t, k = stacks[0].shape[:3]
    frame = stacks[0].shape[3:]
    tk = t * k
    out = np.zeros((b, first.shape[1], *frame), dtype=stacks[0].dtype)
    rows = np.arange(b, dtype=np.int64)[:, None] * tk
    for i, s in enumerate(stacks):
        sel = (first >= i * tk) & (first < (i + 1) * tk)
        out[sel] = s.reshape(b * tk, *frame)[(rows + first - i * tk)[sel]]
    return out
