"""The tests' one door into a buffer's private parts.

White-box tests of the frame store, the compressed log, the ring and the
sample unit read (and, in hostile tests, corrupt) state the public API does
not show. They reach it only through these functions, so a change of the
buffer's private names changes this file alone. Everything else goes
through the public API (``buf.storage``, ``buf.prioritization``,
``buf.status``, ``buf.state_dict()``, ``buf.shard``).
"""

from __future__ import annotations


def frames(buf):
    """The buffer's frame store (``bigper.frames.store.FrameStore``), or None without frame stacks."""
    return buf._frames


def log(buf):
    """The compressed frame log (``bigper.frames.segments.SegmentLog``) of a ``compression="zstd"`` buffer."""
    return buf._frames.log


def ring(buf):
    """The ring's bookkeeping and counters (``bigper.core.ring.Ring``: gid, status, ends, pending, count, max_leaf)."""
    return buf._ring


def unit(buf):
    """The buffer's sample unit (``bigper.core.units``: ``Transitions`` or ``Sequences``)."""
    return buf._unit


def tree(buf):
    """The proportional strategy's sum tree (``buf.prioritization.tree``)."""
    return buf.prioritization.tree


def entries(buf, index=None, rows=None):
    """``(offsets, lengths, generations)`` of frame index rows ``rows`` (all
    when None) of ``index`` (the buffer's ``frame_index`` when None), read as
    the compressed log reads them (``bigper.frames.segments.split_entries``).
    ``buf``: the buffer, or (with ``index``, of a buffer since closed) the
    newest dictionary generation it had (``newest_gen``)."""
    from bigper.frames.segments import split_entries

    index = buf._frames.store.arrays["frame_index"] if index is None else index
    rows = slice(None) if rows is None else rows
    return split_entries(index[rows], buf if isinstance(buf, int) else newest_gen(buf))


def newest_gen(buf) -> int:
    """The newest zstd dictionary generation of a compressed buffer (0: none yet)."""
    return int(buf._frames.log.dicts.hi)


def set_entries(buf, index, rows, offset=None, length=None, gen=None) -> None:
    """Write frame index rows ``rows`` of ``index`` (the buffer's layout,
    packed or wide: ``bigper.frames.segments.put_entry``) with the given
    offsets, lengths and generations, the others kept (an attacker's entry:
    values past a field's bits wrap as int64 arithmetic does)."""
    import numpy as np

    from bigper.frames.segments import put_entries

    rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
    o, ln, d = (np.array(a, dtype=np.int64) for a in entries(buf, index, rows))
    o[:] = o if offset is None else offset
    ln[:] = ln if length is None else length
    out = np.empty((rows.shape[0], index.shape[1]), dtype=np.int64)
    for i in range(rows.shape[0]):
        put_entries(out[i:i + 1], o[i:i + 1], ln[i:i + 1], int(d[i] if gen is None else gen))
    index[rows] = out


def frame_gens(log, ids):
    """The dictionary generation each of frames ``ids`` names (live; ``log``: ``hook.log(buf)``)."""
    from bigper.frames.segments import split_entries

    return split_entries(log._entries(ids), log.dicts.hi)[2]


def thread_feed(buf, batch_size, prefetch):
    """The feed with a thread of its own that draws and gathers
    (``bigper.device.feed.FeedSampler``: what CUDA gets) on the CPU, where
    ``sampler`` gives the native feed; closed by the buffer's ``close`` as
    ``sampler``'s are."""
    import torch

    from bigper.device.feed import FeedSampler, covered

    why = covered(buf._parts, torch.device("cpu"))
    assert why is None, f"the feed does not cover this buffer: {why}"
    it = FeedSampler(buf._parts, int(batch_size), torch.device("cpu"), int(prefetch))
    buf._guard.samplers.add(it)
    return it
