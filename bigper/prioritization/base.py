"""The interface every prioritization strategy implements.

The buffer owns the ring (which slots hold what: ``gid``, ``status``,
``pending``) and hands a strategy three kinds of request:

* writes: ``insert`` slots that became sampleable with their keys,
  ``remove`` slots that stopped being sampleable, ``update`` priorities of
  sampled transitions (validated, routed by slot status, applied atomically);
* reads: ``sample`` uniforms into indices, probabilities and IS weights;
  ``total``, ``sampleable``, ``key_at``;
* state: ``state()``/``restore()`` as plain arrays and a JSON-able dict, and
  ``check()`` for ``bigper verify``.

A *key* is what a strategy stores per slot, computed by ``keys`` from a
user's priority ``p`` (finite, >= 0): proportional stores the leaf
``(min(p, max_priority) + eps) ** alpha``; rank stores ``min(p, max_priority)``
and ranks by it. Keys are float64; a larger key is never less likely. New
transitions enter with the largest key seen so far (the buffer tracks it).

Slot status codes (the buffer's ``status`` array): 0 never written, 1
sampleable, 2 waiting for its n-step window (its key in ``pending``), 3 dead
(overwritten frames, a ``valid=False`` placeholder).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

from ..common.status import DEAD, EMPTY, LIVE, PENDING  # noqa: F401  (the slot status codes, re-exported)


class Prioritization(ABC):
    """One prioritization strategy over ``capacity`` slots.

    Parameters
    ----------
    capacity : int
        Slots, >= 1.
    alpha, eps, max_priority : float
        The buffer's priority exponent, offset and clip (``inf`` for none).
    weight_norm : {"global", "batch"}
        Normalize IS weights by the largest possible weight, or by the batch's.
    """

    kind: str = ""
    # What the fused kernels of the writer, the sequence items and the feed take: a
    # ``PriorityTree`` of the keys (proportional), or None (they go through the methods).
    tree: Any = None
    # The largest key the strategy keeps finite (a proportional tree's: float max / capacity).
    limit: float = math.inf
    # The names of the arrays ``state`` records (unique across the buffer; no field
    # may take them: ``core/layout.py`` reads them here, without building a strategy).
    ARRAYS: tuple[str, ...] = ()
    capacity: int
    alpha: float
    eps: float
    max_priority: float
    batch_norm: bool

    def __init__(self, capacity: int, *, alpha: float, eps: float, max_priority: float,
                 weight_norm: str) -> None:
        self.capacity = int(capacity)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.max_priority = float(max_priority)
        self.batch_norm = weight_norm == "batch"

    # -- keys ------------------------------------------------------------------
    @abstractmethod
    def keys(self, p: np.ndarray) -> np.ndarray:
        """Keys (float64, finite) for validated priorities ``p`` (finite, >= 0).

        Raises ``InvalidArgumentError`` naming the position of a priority whose
        key would not be finite."""

    # -- writes ----------------------------------------------------------------
    @abstractmethod
    def insert(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Make ``slots`` (int64, distinct) sampleable with ``keys``."""

    @abstractmethod
    def remove(self, slots: np.ndarray) -> None:
        """Make ``slots`` (int64) not sampleable."""

    def assign(self, keys: np.ndarray, live: np.ndarray) -> None:
        """Replace every slot's key at once: slots where ``live`` (bool,
        ``(capacity,)``) get ``keys`` (float64, ``(capacity,)``), the others
        become not sampleable."""
        self.remove(np.arange(self.capacity, dtype=np.int64))
        slots = np.flatnonzero(live).astype(np.int64)
        self.insert(slots, np.ascontiguousarray(keys[slots]))

    @abstractmethod
    def update(self, idx: np.ndarray, p: np.ndarray, stamps: np.ndarray, use_stamps: bool,
               gid: np.ndarray, status: np.ndarray, pending: np.ndarray) -> float:
        """Set the priorities ``p`` of slots ``idx``, all or nothing.

        Rows are routed by ``status``: sampleable slots get the new key;
        slots waiting for their n-step window get it in ``pending``; slots
        overwritten since sampling (``gid != stamps`` when ``use_stamps``) and
        dead slots are skipped. A repeated index: the last row wins. Raises
        ``InvalidArgumentError`` (a bad priority, or a key or total that would
        not be finite) or ``InvalidIndexError`` (out of range, never written),
        changing nothing. Returns the largest key that was set or pended
        (0.0 if none), for the buffer's largest-key rule.
        """

    # -- reads -----------------------------------------------------------------
    @property
    @abstractmethod
    def total(self) -> float:
        """Sum of the unnormalized sampling masses (``P(i) = mass_i / total``)."""

    @property
    @abstractmethod
    def sampleable(self) -> bool:
        """True when at least one slot can be drawn."""

    @abstractmethod
    def key_at(self, idx: np.ndarray) -> np.ndarray:
        """Stored keys at ``idx`` (0.0 where a slot is not sampleable)."""

    def probabilities(self, idx: np.ndarray) -> np.ndarray:
        """``P`` the sampler gives slots ``idx`` now (0 where not sampleable)."""
        return self.key_at(idx) / self.total if self.sampleable else np.zeros(idx.shape[0])

    @abstractmethod
    def sample(self, uniforms: np.ndarray, *, stratified: bool,
               beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(indices int64, probabilities float64, weights float32)`` for
        uniforms in ``[0, 1)``, one draw each; stratified: draw ``b`` lands in
        the ``b``-th of ``len(uniforms)`` slices of equal probability."""

    @property
    def min_key(self) -> float:
        """Smallest key of a sampleable slot (``inf`` when none)."""
        raise InvalidArgumentError(f"prioritization={self.kind!r} has no smallest key to share")

    def sample_at(self, targets: np.ndarray, *, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draws at given points of ``[0, total)`` (for shard coordinators that
        draw the uniforms themselves); weights normalized by the batch's largest."""
        raise InvalidArgumentError(
            f"prioritization={self.kind!r} cannot be sampled at given targets (sharded buffers "
            "need prioritization='proportional')")

    # -- state -----------------------------------------------------------------
    @abstractmethod
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(meta, arrays)``: JSON-able counters and named arrays, everything
        to resume sampling bit for bit. Array names are unique across the buffer."""

    @abstractmethod
    def restore(self, meta: dict[str, Any], arrays: dict[str, np.ndarray], status: np.ndarray) -> None:
        """Load what ``state`` gave (already checked by ``check_state``);
        ``status`` tells which slots are sampleable."""

    @abstractmethod
    def check(self, status: np.ndarray) -> list[str]:
        """Invariant violations (empty when healthy), for ``bigper verify``."""

    @classmethod
    def recorded_keys(cls, meta: Any, arrays: Any, capacity: int) -> np.ndarray | None:
        """Each slot's priority key (float64, ``capacity`` of them) in a
        recorded state (``meta``, ``arrays``: what ``state`` gave, read from
        disk and not checked: hostile), or None where they do not decode.
        A slot that holds no key reads NaN. Compares two records of one run
        (``snapshot._load``: a live path's priorities changed since a
        snapshot); nothing is trusted beyond the comparison."""
        return None
