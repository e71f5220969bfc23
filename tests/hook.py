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
