"""``buf.shard``: what a coordinator of shards (``bigper.distributed``) asks
of one buffer, kept off the buffer's own API.

A sharded buffer draws its uniforms itself and turns them into prefix-sum
targets per shard, so a shard samples at given targets (``sample_at``, the
buffer's RNG and beta schedule untouched); and the shards share the largest
key any of them has seen, so that a new transition enters every shard at the
same key (``max_leaf``, ``raise_max_leaf``, ``min_leaf``). Each call runs as
one of the buffer's public methods: under its lock, on an open buffer.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import numpy.typing as npt

from ..batch import Batch
from ..errors import InvalidArgumentError, InvalidTypeError
from ..schedules import as_beta
from .lifecycle import entry_point


class ShardView:
    """The shard-coordination calls of one buffer (``buf.shard``), each one of
    the buffer's entry points (under its guard: ``core.lifecycle``).

    Parameters
    ----------
    parts : Parts
        The buffer's parts (``core.parts``; the view keeps no state of its own).
    owner : PrioritizedReplayBuffer
        The buffer, only kept: it stays open while a view of it lives.
    """

    def __init__(self, parts: Any, owner: Any) -> None:
        self._parts: Any = parts
        self._owner = owner
        self._guard = parts.guard  # (what ``entry_point`` runs each call under)

    @property
    @entry_point
    def max_leaf(self) -> float:
        """The largest key so far: what a new transition enters with."""
        return self._parts.ring.max_leaf

    @property
    @entry_point
    def min_leaf(self) -> float:
        """Smallest non-zero key (``inf`` when nothing is sampleable)."""
        return self._parts.prio.min_key

    @entry_point
    def raise_max_leaf(self, value: float) -> None:
        """Let new transitions enter at ``value`` if it is larger (the largest
        key any shard has seen).

        Parameters
        ----------
        value : float
            A key: finite, > 0.
        """
        v = value.item() if getattr(value, "shape", None) == () and hasattr(value, "item") else value
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidTypeError(f"value must be a real number (a key), got {value!r:.80}")
        try:
            v = float(v)
        except OverflowError:  # an int past float's range
            raise InvalidArgumentError(f"value must be finite, > 0 and a valid key, got {value!r:.80}") from None
        parts = self._parts
        prio, top = parts.prio, parts.prio.limit  # (rank: inf, it keeps no float key)
        if parts.config.max_priority is not None:  # no priority gives a key above max_priority's
            top = min(top, float(prio.keys(np.array([float(parts.config.max_priority)]))[0]))
        if not (0 < v <= top and v < np.inf):
            raise InvalidArgumentError(f"value must be finite, > 0 and a valid key (at most {top!r}), "
                                       f"got {value!r:.80}")
        parts.ring.max_leaf = max(parts.ring.max_leaf, v)

    @entry_point
    def sample_at(self, targets: npt.ArrayLike, *, beta: float) -> Batch:
        """Sample the leaves at the given prefix-sum ``targets`` in ``[0, total_priority)``.

        The RNG and the beta schedule are not touched; probabilities and
        weights are local to this buffer (weights normalized by the batch max).
        Proportional prioritization only; not with sequences.

        Parameters
        ----------
        targets : array-like of float
            Prefix sums, each in ``[0, total_priority)``.
        beta : float
            The IS exponent.

        Returns
        -------
        Batch
        """
        parts = self._parts
        if not parts.unit.shardable:
            raise InvalidArgumentError("sample_at is not available with sequence=... (sharded buffers "
                                       "do not serve sequences)")
        t = np.asarray(targets)
        if t.dtype.kind not in "fiu":
            raise InvalidTypeError(f"targets must be real numbers, got dtype {t.dtype}")
        # The shape is checked before ascontiguousarray, which makes a 0-d array 1-D: one
        # number is refused as update_priorities refuses one index (a batch is 1-D).
        if t.ndim != 1 or t.shape[0] < 1:
            raise InvalidArgumentError(f"targets must be a non-empty 1-D array, got shape {t.shape}")
        t = np.ascontiguousarray(t, dtype=np.float64)
        prio = parts.prio
        total = prio.total
        if not prio.sampleable:
            raise InvalidArgumentError(f"cannot sample: no sampleable transition (len={len(parts)})")
        ok = np.isfinite(t) & (t >= 0) & (t < total)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise InvalidArgumentError(f"targets must be finite and in [0, {total}), got {t[bad]} at {bad}")
        idx, prob, w = prio.sample_at(t, beta=as_beta(beta))
        return Batch(parts.unit.gather(parts.reader, idx), idx, w, prob, parts.ring.gid[idx])
