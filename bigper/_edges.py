"""Buffer methods for the rooms at the edge: snapshots, offline datasets and
shard coordinators. They use the buffer's public parts and a few internals;
the rooms themselves import lazily, so ``import bigper`` stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _kernels as K
from ._ingest import as_index
from .batch import Batch
from .errors import InvalidArgumentError, InvalidIndexError

if TYPE_CHECKING:
    from .buffer import PrioritizedReplayBuffer


class EdgeMethods:
    def save(self, snapshot):
        """Write a crash-consistent snapshot of tree, data and state to the
        directory ``snapshot``; returns its path."""
        from .snapshot import save

        return save(self, snapshot)

    @classmethod
    def load(cls, snapshot, *, path=None) -> "PrioritizedReplayBuffer":
        """Resume the buffer saved in ``snapshot``; ``path``: where a disk storage keeps
        its live data (default: the path recorded in the snapshot)."""
        from .snapshot import load

        return load(snapshot, path=path)

    @classmethod
    def from_hdf5(cls, dataset, **kwargs) -> "PrioritizedReplayBuffer":
        """Open a D4RL, Minari or bigper HDF5 dataset in place, read-only; see ``bigper.offline``."""
        from .offline import from_hdf5

        return from_hdf5(dataset, **kwargs)

    def reprioritize(self, score_fn, batch_size: int = 4096, progress: bool = True) -> None:
        """Score every transition in order with ``score_fn(batch) -> |TD|`` and set all priorities."""
        from .offline import reprioritize

        reprioritize(self, score_fn, batch_size=batch_size, progress=progress)

    def leaves(self, indices) -> np.ndarray:
        """Leaf values (float64) at ``indices``: 0 for slots not sampleable."""
        idx = as_index(indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise InvalidIndexError(f"indices must be in [0, {self.capacity}), got {idx.min()}..{idx.max()}")
        return self._tree.leaves[idx]

    @property
    def max_leaf(self) -> float:
        """The largest leaf value so far: what a new transition enters with."""
        return self._max_leaf

    def raise_max_leaf(self, value: float) -> None:
        """Let new transitions enter at ``value`` if it is larger (for shards
        that share the largest leaf any of them has seen)."""
        v = float(value)
        if not (v > 0 and v < np.inf):
            raise InvalidArgumentError(f"value must be finite and > 0, got {value!r}")
        self._max_leaf = max(self._max_leaf, v)

    @property
    def min_leaf(self) -> float:
        """Smallest non-zero leaf (``inf`` when nothing is sampleable)."""
        return self._tree.min

    def sample_at(self, targets, *, beta: float) -> Batch:
        """Sample the leaves at the given prefix-sum ``targets`` in ``[0, total_priority)``.

        For coordinators that draw the uniforms themselves (the Ray shards):
        the RNG and the beta schedule are not touched; probabilities and
        weights are local to this buffer (weights normalized by the batch max).
        """
        self._check_open()
        t = np.ascontiguousarray(targets, dtype=np.float64)
        if t.ndim != 1 or t.shape[0] < 1:
            raise InvalidArgumentError(f"targets must be a non-empty 1-D array, got shape {t.shape}")
        total = self._tree.total
        if not total > 0:
            raise InvalidArgumentError(f"cannot sample: no sampleable transition (len={len(self)})")
        bad = K.first_bad_priority(t)
        if bad >= 0 or t.max() >= total:
            raise InvalidArgumentError(f"targets must be finite and in [0, {total}), got {t[bad if bad >= 0 else t.argmax()]}")
        idx = self._tree.find(t)
        leaves = self._tree.leaves[idx]
        w = ((leaves / leaves.min()) ** (-float(beta))).astype(np.float32)
        return Batch(self._gather(idx), idx, w, leaves / total, self._gid[idx])
