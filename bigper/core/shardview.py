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

from typing import Any

import numpy as np
import numpy.typing as npt

from ..batch import Batch
from ..errors import InvalidArgumentError, InvalidTypeError
from ..schedules import as_beta
from .lifecycle import entry_point


class ShardView:
    """The shard-coordination calls of one buffer (``buf.shard``).

    Parameters
    ----------
    buf : PrioritizedReplayBuffer
        The buffer (the view keeps no state of its own).
    """

    def __init__(self, buf: Any) -> None:
        self._buf: Any = buf

    @property
    def max_leaf(self) -> float:
        """The largest key so far: what a new transition enters with."""
        return _max_leaf(self._buf)

    @property
    def min_leaf(self) -> float:
        """Smallest non-zero key (``inf`` when nothing is sampleable)."""
        return _min_leaf(self._buf)

    def raise_max_leaf(self, value: float) -> None:
        """Let new transitions enter at ``value`` if it is larger (the largest
        key any shard has seen).

        Parameters
        ----------
        value : float
            A key: finite, > 0.
        """
        raise_max_leaf(self._buf, value)

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
        return sample_at(self._buf, targets, beta)


# The calls themselves, each run as the buffer's entry point (``self`` is the buffer).
@entry_point
def _max_leaf(self) -> float:
    return self._ring.max_leaf


@entry_point
def _min_leaf(self) -> float:
    return self._prio.min_key


@entry_point
def raise_max_leaf(self, value) -> None:
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidTypeError(f"value must be a number, got {value!r}") from None
    if not (v > 0 and v <= getattr(self._prio, "limit", np.inf) and v < np.inf):  # (rank has no limit)
        raise InvalidArgumentError(f"value must be finite, > 0 and a valid key, got {value!r}")
    self._ring.max_leaf = max(self._ring.max_leaf, v)


@entry_point
def sample_at(self, targets, beta) -> Batch:
    if not self._unit.shardable:
        raise InvalidArgumentError("sample_at is not available with sequence=... (sharded buffers "
                                   "do not serve sequences)")
    t = np.ascontiguousarray(targets, dtype=np.float64)
    if t.ndim != 1 or t.shape[0] < 1:
        raise InvalidArgumentError(f"targets must be a non-empty 1-D array, got shape {t.shape}")
    prio = self._prio
    total = prio.total
    if not prio.sampleable:
        raise InvalidArgumentError(f"cannot sample: no sampleable transition (len={len(self)})")
    ok = np.isfinite(t) & (t >= 0) & (t < total)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise InvalidArgumentError(f"targets must be finite and in [0, {total}), got {t[bad]} at {bad}")
    idx, prob, w = prio.sample_at(t, beta=as_beta(beta))
    return Batch(self._gather(idx), idx, w, prob, self._ring.gid[idx])
