"""What the rooms above the buffer use: its recorded state (``state_dict``,
``load_state``) and the protocol that snapshots, offline datasets and shards
work through (the storage, slot status and generations, keys, the largest key,
sampling at given targets, whole-dataset priorities), and the entry points
those rooms provide for the buffer's ``save``/``load``/``from_hdf5``/
``reprioritize`` methods.

``BufferProtocol`` is a mixin of ``PrioritizedReplayBuffer`` (``buffer.py``),
which owns the attributes it reads (``config``, ``_prio``, the ring arrays,
``_writer``'s counters, ``_rng``, ``_frames``, ``_store``, ``_lock``).
"""

from __future__ import annotations

import numpy as np

from ._ingest import as_index, as_priorities
from ._statecheck import check_state
from .batch import Batch
from .errors import IncompatibleSnapshotError, InvalidArgumentError, InvalidIndexError, InvalidTypeError
from .prioritization.base import LIVE


# Rooms above the buffer (snapshots, offline datasets) provide the entry points
# that the buffer offers as methods (``save``, ``load``, ``from_hdf5``,
# ``reprioritize``); ``bigper/__init__`` plugs them in, so this module never
# imports upward.
_PROVIDED: dict = {}


def provide(**entry_points) -> None:
    """Plug in the functions behind ``save``/``load``/``from_hdf5``/``reprioritize``."""
    _PROVIDED.update(entry_points)


def _provided(name: str):
    fn = _PROVIDED.get(name)
    if fn is None:  # only reachable when bigper's package __init__ did not run
        raise InvalidArgumentError(f"{name} needs the bigper package imported (import bigper)")
    return fn


class BufferProtocol:
    """State and the protocol of the rooms above, for ``PrioritizedReplayBuffer``."""

    # -- state (close/reopen and snapshots) --------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        """``(meta, arrays)``: JSON-able counters and RNG state, and the
        bookkeeping arrays; with the storage's data, everything to resume."""
        meta = {"count": self._count, "max_leaf": self._max_leaf, "beta_step": self._beta_step,
                "rng": self._rng.bit_generator.state, "env_ended": self._env_ended.tolist()}
        pmeta, arrays = self._prio.state()
        if pmeta:
            meta["prioritization"] = pmeta
        arrays = dict(arrays)
        arrays.update({"gid": self._gid, "status": self._status, "ends": self._ends,
                       "pending": self._pending})
        if self._frames is not None:
            fmeta, farrays = self._frames.state()
            meta["frames"] = fmeta
            arrays.update(farrays)
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict) -> None:
        """Replace the bookkeeping with a recorded ``state_dict`` (checked first;
        ``CorruptSnapshotError`` on anything a buffer could not have written)."""
        self._restore(meta, arrays)

    def _restore(self, meta: dict, arrays: dict, reseed: bool = False) -> None:
        check_state(self.config, meta, arrays)
        c = self.config.capacity
        for name, want in (("gid", (c,)), ("status", (c,)), ("ends", (c,))):
            got = arrays.get(name)
            if got is None or got.shape != want:
                raise IncompatibleSnapshotError(
                    f"recorded state array {name!r} has shape {None if got is None else got.shape}, "
                    f"expected {want}")
        self._prio.restore(meta.get("prioritization", {}), arrays, arrays["status"])
        self._gid[:] = arrays["gid"]
        self._status[:] = arrays["status"]
        self._ends[:] = arrays["ends"]
        self._pending[:] = arrays.get("pending", self._pending)
        self._count = int(meta["count"])
        self._max_leaf = float(meta["max_leaf"])
        self._beta_step = int(meta["beta_step"])
        self._env_ended[:] = meta["env_ended"]
        if not reseed:  # a new seed on resume starts a new random stream
            self._rng.bit_generator.state = meta["rng"]
        if self._frames is not None:
            self._frames.restore(meta["frames"], arrays)

    # -- for the rooms above (snapshots, offline datasets, shards) -----------------
    def save(self, snapshot):
        """Write a crash-consistent snapshot of tree, data and state to the
        directory ``snapshot``; returns its path.

        With a prefetching ``sampler`` running, the snapshot is taken between
        two of its draws: the batches it prepared before were drawn before the
        save (the saved random state is past them), so a buffer resumed from
        it draws next what the running sampler would have drawn after them."""
        with self._lock:
            return _provided("save")(self, snapshot)

    @classmethod
    def load(cls, snapshot, *, path=None) -> "BufferProtocol":
        """Resume the buffer saved in ``snapshot``; ``path``: where a disk storage keeps
        its live data (default: the path recorded in the snapshot)."""
        return _provided("load")(snapshot, path=path)

    @classmethod
    def from_hdf5(cls, dataset, **kwargs) -> "BufferProtocol":
        """Open a D4RL, Minari or bigper HDF5 dataset in place, read-only; see ``bigper.offline``."""
        return _provided("from_hdf5")(dataset, **kwargs)

    def reprioritize(self, score_fn, batch_size: int = 4096, progress: bool = True) -> None:
        """Score every transition in order with ``score_fn(batch) -> |TD|`` and set all priorities."""
        _provided("reprioritize")(self, score_fn, batch_size=batch_size, progress=progress)

    @property
    def storage(self):
        """The storage object (``kind``, ``path``, ``read``/``write``)."""
        return self._store

    @property
    def prioritization(self):
        """The prioritization strategy (``bigper.prioritization``)."""
        return self._prio

    @property
    def status(self) -> np.ndarray:
        """Slot status, read-only view (uint8: 0 empty, 1 sampleable, 2 waiting for
        its n-step window, 3 dead)."""
        v = self._status.view()
        v.flags.writeable = False
        return v

    @property
    def generations(self) -> np.ndarray:
        """How many transitions had been added when each slot was last written
        (int64, -1 for never), read-only view; ``Batch.generations`` are these."""
        v = self._gid.view()
        v.flags.writeable = False
        return v

    def assign_priorities(self, priorities) -> None:
        """Set the priority of every slot at once in O(N) (a dataset's scores):
        ``priorities`` has shape ``(capacity,)``; rows of slots that are not
        sampleable are ignored. All or nothing, like ``update_priorities``."""
        self._check_writable("priorities")
        p = as_priorities(priorities, self.capacity)
        live = self._status == LIVE
        bad = np.flatnonzero(live & ~((p >= 0) & (p < np.inf)))
        if bad.size:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[bad[0]]} at position {bad[0]}")
        keys = self._prio.keys(np.where(live, p, 0.0))
        self._prio.assign(keys, live)
        if live.any():
            self._max_leaf = max(self._max_leaf, float(keys[live].max()))

    def gather(self, indices) -> dict:
        """The data of the transitions at ``indices`` as ``sample`` returns it
        (no draw, no weights); every index must be sampleable."""
        self._check_open()
        idx = self._check_indices(indices)
        bad = np.flatnonzero(self._status[idx] != LIVE)
        if bad.size:
            raise InvalidIndexError(f"indices[{bad[0]}] = {idx[bad[0]]} is not a sampleable transition")
        return self._gather(idx)

    def _check_indices(self, indices) -> np.ndarray:
        idx = as_index(indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise InvalidIndexError(f"indices must be in [0, {self.capacity}), got {idx.min()}..{idx.max()}")
        return idx

    def leaves(self, indices) -> np.ndarray:
        """Stored priority keys (float64) at ``indices``: 0 for slots not sampleable."""
        return self._prio.key_at(self._check_indices(indices))

    @property
    def max_leaf(self) -> float:
        """The largest key so far: what a new transition enters with."""
        return self._max_leaf

    def raise_max_leaf(self, value: float) -> None:
        """Let new transitions enter at ``value`` if it is larger (for shards
        that share the largest key any of them has seen)."""
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise InvalidTypeError(f"value must be a number, got {value!r}") from None
        if not (v > 0 and v <= getattr(self._prio, "limit", np.inf) and v < np.inf):
            raise InvalidArgumentError(f"value must be finite, > 0 and a valid key, got {value!r}")
        self._max_leaf = max(self._max_leaf, v)

    @property
    def min_leaf(self) -> float:
        """Smallest non-zero key (``inf`` when nothing is sampleable)."""
        return self._prio.min_key

    def sample_at(self, targets, *, beta: float) -> Batch:
        """Sample the leaves at the given prefix-sum ``targets`` in ``[0, total_priority)``.

        For coordinators that draw the uniforms themselves (the Ray shards):
        the RNG and the beta schedule are not touched; probabilities and
        weights are local to this buffer (weights normalized by the batch max).
        Proportional prioritization only.
        """
        self._check_open()
        t = np.ascontiguousarray(targets, dtype=np.float64)
        if t.ndim != 1 or t.shape[0] < 1:
            raise InvalidArgumentError(f"targets must be a non-empty 1-D array, got shape {t.shape}")
        total = self._prio.total
        if not self._prio.sampleable:
            raise InvalidArgumentError(f"cannot sample: no sampleable transition (len={len(self)})")
        ok = np.isfinite(t) & (t >= 0) & (t < total)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise InvalidArgumentError(f"targets must be finite and in [0, {total}), got {t[bad]} at {bad}")
        idx, prob, w = self._prio.sample_at(t, beta=float(beta))
        return Batch(self._gather(idx), idx, w, prob, self._gid[idx])

    @property
    def _tree(self):
        # Transitional: the proportional strategy's tree, for rooms not yet on the public protocol.
        return self._prio.tree
