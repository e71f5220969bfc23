"""What a buffer is made of, handed to what draws from it without being it.

``Draws`` is a buffer's random stream and beta schedule: ``sample``, a
sampler's feed and a shard coordinator each advance one (the stream by a
batch's uniforms, the schedule by one step a draw), and its state is part of
every snapshot. ``Parts`` names a buffer's parts for its feed and its shard
view (``device/feed.py``, ``device/native.py``, ``core/shardview.py``), so that
none of them reads the buffer's own attributes: the buffer builds it once, when
its parts are made (they are never replaced after that), and is the only
holder of it (the feed holds it weakly: a dropped buffer ends its samplers).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Draws:
    """A random stream and a beta schedule (``schedules``): ``rng``, the
    numpy ``Generator`` the uniforms of each batch come from; ``schedule``,
    ``beta`` of a step; ``step``, the draws made so far."""

    __slots__ = ("rng", "schedule", "step")

    def __init__(self, schedule, seed) -> None:
        self.rng = np.random.default_rng(seed)
        self.schedule = schedule
        self.step = 0

    def beta(self) -> float:
        """The beta of the next draw."""
        return self.schedule(self.step)

    def state(self) -> dict[str, Any]:
        """``{"beta_step", "rng"}``: JSON-able, as snapshots record them."""
        return {"beta_step": self.step, "rng": self.rng.bit_generator.state}

    def restore(self, meta: dict, reseed: bool = False) -> None:
        """Take a recorded ``state`` (checked by the caller); ``reseed``: keep
        this stream (a new seed on resume starts a new one), take only the step."""
        self.step = int(meta["beta_step"])
        if not reseed:
            self.rng.bit_generator.state = meta["rng"]


class Parts:
    """A buffer's parts: its ``config``, ``guard`` (``core.lifecycle.Guard``),
    ``store`` (the storage), ``frames`` (the frame store, or None), ``plain``
    (the fields stored as rows: name -> (shape, dtype)), ``stored`` (every
    stored field's shape and dtype), ``prio`` (the prioritization), ``ring``,
    ``unit`` (the sample unit), ``reader``, ``mirror`` (the device tier, or
    None) and ``draws``."""

    __slots__ = ("config", "guard", "store", "frames", "plain", "stored", "prio", "ring", "unit", "reader",
                 "mirror", "draws", "__weakref__")

    def __init__(self, *, config, guard, store, frames, plain, stored, prio, ring, unit, reader, mirror,
                 draws: Draws) -> None:
        self.config, self.guard, self.store, self.frames = config, guard, store, frames
        self.plain, self.stored, self.prio, self.ring = plain, stored, prio, ring
        self.unit, self.reader, self.mirror, self.draws = unit, reader, mirror, draws

    def __len__(self) -> int:
        """Slots held (as ``len`` of the buffer)."""
        return min(self.ring.count, self.config.capacity)
