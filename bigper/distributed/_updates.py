"""Priority updates addressed by global index, checked and split by shard.

No Ray here: the coordinator queues each part on its shard (``ShardSet``).
"""

from __future__ import annotations

import numpy as np

from ..core.ingest import as_index, as_priorities
from ..batch import Batch
from ..errors import InvalidArgumentError, InvalidIndexError


def split_updates(target, priorities, offsets: np.ndarray, capacity: int) -> list:
    """``[(shard, slots, generations or None, priorities)]`` for ``update_priorities``.

    ``target`` is a ``Batch`` (its generations let each shard skip slots
    rewritten since sampling) or raw global indices. Everything is checked
    before anything is returned: a bad priority or index raises and nothing
    is queued.
    """
    if isinstance(target, Batch):
        idx, stamps = target.indices, target.generations
    else:
        idx, stamps = as_index(target), None
    p = as_priorities(priorities, idx.shape[0])
    bad = np.flatnonzero(~((p >= 0) & (p < np.inf)))
    if bad.shape[0]:
        i = int(bad[0])
        raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[i]} at position {i}")
    out = np.flatnonzero((idx < 0) | (idx >= capacity))
    if out.shape[0]:
        i = int(out[0])
        raise InvalidIndexError(f"indices[{i}] = {idx[i]} is out of range [0, capacity) "
                                f"(capacity={capacity})")
    if p.shape[0] == 0:
        return []
    shard = np.searchsorted(offsets, idx, side="right") - 1
    slots = idx - offsets[shard]
    if offsets.shape[0] == 2:
        return [(0, slots, stamps, p)]
    parts = []
    for s in np.unique(shard):
        sel = shard == s
        parts.append((int(s), slots[sel], None if stamps is None else stamps[sel], p[sel]))
    return parts
