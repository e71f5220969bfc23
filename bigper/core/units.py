"""Sample units: what one leaf of the prioritization stands for.

A buffer holds one unit and asks it everything that depends on what a leaf
is; the buffer, the reader and the writer never ask which one they hold.

- ``Transitions``: a leaf per step (the default), sampleable once its n-step
  window completes (or at once with ``n_step=1``).
- ``Sequences``: a leaf per sequence item (``sequence=bigper.Sequence(...)``),
  at the item's start step; its tables and kernels are ``sequences.Items``.

A unit answers (``SampleUnit``): which leaves exist (``status``, ``pending``),
what a write makes sampleable or kills (``commit``, ``committed``), how a
batch is gathered (``batch``, ``gather``, ``device_batch``, ``check_out``),
how priorities reduce to one a leaf (``priorities``, ``check_update``), and
its recorded state (``ARRAYS``, ``state``, ``restore``, ``check_recorded``),
and which paths serve it (``staged``, ``shardable``, ``fed``). A third unit
(whole episodes) is a class and one line in ``unit_class``
(docs/development.md, "Add a sample unit").
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from . import nstep
from .ingest import as_priorities
from ..common.kernels import ring_rows
from ..batch import Batch
from ..tensors.transport import Transport
from ..errors import InvalidArgumentError
from .sequences import ITEM_ARRAYS, Items, check_items
from ..common.status import LIVE


class SampleUnit(Protocol):
    """What a buffer asks of its sample unit (see the module's docstring)."""

    noun: str               # "transition", "sequence item": for messages
    status: np.ndarray      # (capacity,) uint8: each leaf slot's status (bigper.common.status)
    pending: np.ndarray     # (capacity,) float64: the keys of pending leaves
    status_key: str         # the name of ``status`` in a recorded state
    pending_key: str        # the name of ``pending`` in a recorded state
    staged: bool            # a CUDA-bound batch is gathered into one pinned block (else the device rebuilds stacks)
    shardable: bool         # ``sample_at`` (the Ray shards) serves it
    fed: bool               # the GIL-free feed (``core/feed.py``) serves it
    ARRAYS: tuple           # the names of its own arrays in a recorded state (beside the ring's)

    @staticmethod
    def check_recorded(cfg, arrays: dict, count: int, gid, status, ends, top: float) -> np.ndarray:
        """Refuse (``core.recorded.refuse``) a recorded state whose unit arrays
        a buffer of ``cfg`` could not have written, given the ring's checked
        ``gid`` (None where it was not recorded: it follows from ``count``),
        ``status``, ``ends`` after ``count`` rows and the largest key
        ``top``; returns the status that says which slots hold a leaf."""

    def unsampleable(self, n: int) -> str:
        """The message of a draw from a buffer of ``len`` ``n`` with no sampleable leaf."""

    def commit(self, prio, g0: int, slots, ends, valid, keys, count: int, frames) -> None:
        """Rows ``g0 .. count - 1`` were committed to the ring at ``slots``:
        set the leaves they make sampleable and remove those they end (frames
        that expired included)."""

    def committed(self, prio, rows: dict, g0: int, keys, top: float, valid, count: int) -> None:
        """The same after ``write_rows`` set the per-step leaves in one call
        (``keys`` None: every row entered at ``top``, the largest key then)."""

    def episodes_ended(self, prio, last, count: int) -> None:
        """Rows ``last`` (one an env, the last written) were marked truncated
        after the fact (``Writer.end_episodes``): make sampleable what their
        episodes' ends complete."""

    def batch(self, reader, idx, w, prob, out, stacks: bool) -> Batch:
        """The batch of the leaves at ``idx`` (``stacks=False``: frame stacks left for a device to rebuild)."""

    def gather(self, reader, idx) -> dict:
        """The data of the leaves at ``idx`` as ``sample`` gives it."""

    def device_batch(self, reader, mirror, idx, w, prob) -> Batch:
        """The batch at ``idx`` gathered by the device tier ``mirror``."""

    def check_out(self, reader, out, b: int) -> dict:
        """``sample(out=...)`` arrays checked for a batch of ``b``."""

    def priority_shapes(self, n: int) -> tuple:
        """The shapes ``update_priorities`` takes for ``n`` indices."""

    def priorities(self, priorities, mask, idx, stamps, use_stamps: bool) -> np.ndarray:
        """``(n,)`` float64 priorities of the leaves at ``idx``, checked."""

    def check_update(self, idx, stamps, use_stamps: bool, mask, shape: tuple) -> None:
        """What the host can check of an update whose values are on a device."""

    def state(self) -> dict:
        """The unit's own arrays in a recorded state (views)."""

    def restore(self, arrays: dict) -> None:
        """Take them back from a checked state."""


class Transitions:
    """A leaf per transition: the ring's own status and pending keys.

    Parameters
    ----------
    cfg : Config
    ring : Ring
        The buffer's slot bookkeeping (its arrays are the unit's).
    """

    noun = "transition"
    status_key = "status"
    pending_key = "pending"
    ARRAYS: tuple = ()  # its own state arrays (the ring's status and pending keys are its)
    staged = True
    shardable = True
    fed = True
    fused = True  # (False, for tests only: the general paths, tests/core/test_fused.py)

    def __init__(self, cfg, ring):
        self.cfg, self.ring = cfg, ring
        self.status, self.pending = ring.status, ring.pending

    @staticmethod
    def check_recorded(cfg, arrays, count, gid, status, ends, top) -> np.ndarray:
        return status  # (the ring's arrays, which the state check checked)

    def unsampleable(self, n: int) -> str:
        return (f"cannot sample: no sampleable transition (len={n}; with n_step > 1 a transition becomes "
                "sampleable once its window completes or its episode ends)")

    def commit(self, prio, g0, slots, ends, valid, keys, count, frames) -> None:
        cfg, ring = self.cfg, self.ring
        if cfg.n_step == 1:
            if valid is None:
                prio.insert(slots, keys)  # replaces what the slots held
            else:
                prio.remove(slots[~valid])
                prio.insert(slots[valid], keys[valid])
        else:
            prio.remove(slots)  # waiting for their windows now
            self.pending[slots] = keys
            self._complete(prio, g0, count)
        if frames is not None:
            dead = frames.expire(count, ring.gid, self.status)
            if dead.shape[0]:
                prio.remove(dead)

    def committed(self, prio, rows, g0, keys, top, valid, count) -> None:
        pass  # write_rows set every leaf

    def episodes_ended(self, prio, last, count) -> None:
        if self.cfg.n_step > 1:  # (with n_step 1 every written transition is sampleable already)
            self._complete(prio, int(last.min()), count)

    def _complete(self, prio, g: int, count: int) -> None:
        """Make live the pending transitions whose windows (which may reach row
        ``g`` or later) are complete now."""
        cfg, ring = self.cfg, self.ring
        first = max(0, g - (cfg.n_step - 1) * cfg.num_envs)
        ready = np.empty(count - first, dtype=np.int64)
        r = nstep.complete(first, count, cfg.capacity, cfg.num_envs, cfg.n_step, ring.ends,
                           ring.gid, self.status, ready)
        if r:
            ready = ready[:r]
            self.status[ready] = LIVE
            prio.insert(ready, self.pending[ready])

    def batch(self, reader, idx, w, prob, out, stacks) -> Batch:
        return reader.transitions(idx, w, prob, out)

    def gather(self, reader, idx) -> dict:
        return reader.gather(idx, None, None)

    def device_batch(self, reader, mirror, idx, w, prob) -> Batch:
        return mirror.batch(reader.plan(idx), idx, w, prob, self.ring.gid[idx])

    def check_out(self, reader, out, b) -> dict:
        return reader.check_out(out, b)

    def priority_shapes(self, n: int) -> tuple:
        return (n,), (n, 1)

    def priorities(self, priorities, mask, idx, stamps, use_stamps) -> np.ndarray:
        return as_priorities(priorities, idx.shape[0])

    def check_update(self, idx, stamps, use_stamps, mask, shape) -> None:
        pass

    def state(self) -> dict:
        return {}  # status and pending are the ring's

    def restore(self, arrays: dict) -> None:
        pass


class Sequences:
    """A leaf per sequence item, at its start step (``sequences.Items``
    keeps the tables).

    Parameters
    ----------
    cfg : Config
        With ``cfg.sequence`` set.
    ring : Ring
    """

    noun = "sequence item"
    status_key = "seq_status"
    pending_key = "seq_pending"
    ARRAYS = ITEM_ARRAYS  # the item tables (Items.state)
    check_recorded = staticmethod(check_items)
    staged = False
    shardable = False
    fed = False
    fused = True  # (False, for tests only: the general paths, tests/core/test_fused.py)

    def __init__(self, cfg, ring):
        self.cfg, self.ring = cfg, ring
        self.items = items = Items(cfg, ring.gid, ring.status, ring.ends)
        self.status, self.pending = items.status, items.pending

    def unsampleable(self, n: int) -> str:
        return (f"cannot sample: no sampleable sequence item (len={n} steps; an item becomes sampleable once "
                f"its length={self.items.length} steps are written or its episode ends, and valid=False rows "
                "start none)")

    def commit(self, prio, g0, slots, ends, valid, keys, count, frames) -> None:
        if frames is not None:  # steps whose frames expired: the items they belong to die with them
            frames.expire(count, self.ring.gid, self.ring.status)
        self.items.write(prio, g0, slots, ends, valid, keys, count, self.fused)

    def committed(self, prio, rows, g0, keys, top, valid, count) -> None:
        # write_rows set the leaves per step: the items' tables and leaves replace them
        m = rows["terminated"].shape[0]
        if keys is None:
            keys = np.full(m, top)
        slots, ends = np.empty(m, np.int64), np.empty(m, np.uint8)
        ring_rows(g0, self.cfg.capacity, rows["terminated"], rows["truncated"], slots, ends)
        self.items.write(prio, g0, slots, ends, valid, keys, count)

    def episodes_ended(self, prio, last, count) -> None:
        ready = self.items.end(last)
        if ready.shape[0]:
            prio.insert(ready, self.pending[ready])

    def batch(self, reader, idx, w, prob, out, stacks) -> Batch:
        """Every field ``(B, T, ...)``, padded steps zero (as R2D2 pads), with the ``(B, T)`` mask."""
        slots, mask = self.items.window(idx)
        data, mask, once = reader.windows(slots, mask, stacks)
        # (with ``once``: how to_torch moves each row's frames once)
        return Batch.make(data, idx, w, prob, self.ring.gid[idx], mask, self.items.burn_in,
                          None if once is None else Transport(frames=once))

    def gather(self, reader, idx) -> dict:
        data, mask, _ = reader.windows(*self.items.window(idx))
        return {**data, "mask": mask}

    def device_batch(self, reader, mirror, idx, w, prob) -> Batch:
        slots, mask = self.items.window(idx)
        return mirror.batch(reader.plan(slots, mask), idx, w, prob, self.ring.gid[idx], mask, self.items.burn_in)

    def check_out(self, reader, out, b) -> dict:
        raise InvalidArgumentError("sample(out=...) is not available with sequence=...: a batch of "
                                   "sequences is gathered by windows")

    def priority_shapes(self, n: int) -> tuple:
        return (n,), (n, 1), (n, self.items.T), (n, self.items.length)

    def priorities(self, priorities, mask, idx, stamps, use_stamps) -> np.ndarray:
        n = idx.shape[0]
        p = self.items.reduce(priorities, mask, n)
        p = as_priorities(priorities if p is None else p, n)
        self.items.check_starts(idx, stamps, use_stamps)
        return p

    def check_update(self, idx, stamps, use_stamps, mask, shape) -> None:
        if shape[1:] not in ((), (1,)):  # the mask's checks, on stand-in values
            self.items.reduce(np.zeros(shape), None if mask is None else np.asarray(mask), idx.shape[0])
        self.items.check_starts(idx, stamps, use_stamps)

    def state(self) -> dict:
        return self.items.state()

    def restore(self, arrays: dict) -> None:
        self.items.restore(arrays)


def unit_class(cfg) -> type:
    """The sample unit of a buffer of ``cfg`` (a class: ``unit_for`` makes one)."""
    return Sequences if cfg.sequence else Transitions


def unit_for(cfg, ring) -> SampleUnit:
    """The sample unit of a buffer of ``cfg`` over ``ring``."""
    return unit_class(cfg)(cfg, ring)


def apply_update(unit, prio, ring, idx, stamps, use_stamps: bool, mask, priorities) -> None:
    """A priority update: its values checked and reduced by ``unit``, written
    into ``prio`` (only where the slots still hold what was sampled), and the
    ring's largest key kept."""
    p = unit.priorities(priorities, mask, idx, stamps, use_stamps)
    top = prio.update(idx, p, stamps, use_stamps, ring.gid, unit.status, unit.pending)
    if top > ring.max_leaf:
        ring.max_leaf = top
