"""The shard: a Ray actor that holds one local bigper buffer.

Every method runs to completion before the next starts (a synchronous actor),
so each call sees and leaves the buffer in a consistent state. Calls from one
caller run in the order it made them; calls from different callers (writer
actors, the learner) interleave call by call.

Each reply that the coordinator uses for sampling carries the shard's
*stats* after the call: ``(total, min_leaf, len, max_leaf, epoch)``.

``epoch`` is 0 for the shard's first incarnation and a random non-zero number
after Ray restarted it; it is stored in the top bits of the generations a
batch carries, so a priority update computed against a shard's earlier life
is skipped instead of landing on a slot the restored shard rewrote.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections import deque
from pathlib import Path

import numpy as np

from ..batch import Batch
from ..buffer import PrioritizedReplayBuffer
from ..errors import BigperError
from ..storage import in_memory, storage_class
from ._manifest import read_recovery_pointer

EPOCH_SHIFT = 48
GID_MASK = (1 << EPOCH_SHIFT) - 1


def shard_name(k: int) -> str:
    return f"shard-{k}"


def shard_path(root, k: int, storage: str):
    """Where shard ``k`` keeps live data under ``root`` (a disk storage), else None."""
    if root is None or in_memory(storage):
        return None
    name = shard_name(k) + storage_class(storage).path_suffix
    return str(Path(root) / name)


def _reconstructed() -> bool:
    import ray

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _leaves(buf, batch) -> np.ndarray:
    """The sampled leaves, exactly (``probabilities * total`` can be off by an ulp)."""
    return buf.leaves(batch.indices)


class Shard:
    """Actor body. ``spec`` holds: ``shard`` (its number), ``kwargs`` (the local
    buffer's keywords, capacity included), ``path`` (live data, disk storages),
    ``recovery_dir`` (where the pointer to the latest snapshot lives) and
    ``load_from`` (a shard snapshot to start from)."""

    def __init__(self, spec: dict):
        self.k = int(spec["shard"])
        self.path = spec.get("path")
        self.epoch = 0
        snap = spec.get("load_from")
        if _reconstructed():
            self.epoch = int.from_bytes(os.urandom(2), "little") % ((1 << 15) - 1) + 1
            latest = read_recovery_pointer(spec.get("recovery_dir"))
            snap = None if latest is None else str(Path(latest) / shard_name(self.k))
            if snap is None and self.path is not None and os.path.exists(self.path):
                # No snapshot to resume from: the dead incarnation's directory is
                # unclean (see UncleanStorageError); keep it aside, start empty.
                aside = f"{self.path}.crashed-{int(time.time())}"
                shutil.move(self.path, aside)
                warnings.warn(f"shard {self.k} restarted without a snapshot; its old data "
                              f"was moved to {aside} and it starts empty")
        self.failed, self.restored_from = None, snap
        try:
            if snap is not None:
                self.buf = PrioritizedReplayBuffer.load(snap, path=self.path)
            else:
                self.buf = PrioritizedReplayBuffer(**spec["kwargs"], path=self.path)
        except BigperError as e:
            if self.epoch:
                raise  # a restart: Ray tries again (the error is in the actor's log)
            # A first start: the coordinator raises this error as its own
            # (a constructor's exception would only reach it as ActorDiedError).
            self.failed, self.buf = (type(e).__name__, str(e)), None
            return
        # Arrivals of the rows held, oldest first: [stamp, writer, rows]. Rows
        # restored from a snapshot are older than anything a writer sends now.
        held = len(self.buf)
        self._ages = deque([[0, None, held]] if held else [])
        self._aged = held  # rows in _ages

    def ready(self):
        """None, or ``(error class name, message)`` of a failed start."""
        return self.failed

    def _arrived(self, stamp: int, writer, rows: int) -> None:
        """Keep the arrivals in step with the ring: the oldest rows are overwritten first."""
        ages = self._ages
        ages.append([int(stamp), writer, rows])
        self._aged += rows
        extra = self._aged - len(self.buf)
        while extra > 0 and ages:
            cut = min(ages[0][2], extra)
            ages[0][2] -= cut
            self._aged -= cut
            extra -= cut
            if not ages[0][2]:
                ages.popleft()

    def _fill(self) -> tuple:
        """What a writer routes by: ``(len, capacity, oldest row's stamp, its writer)``
        (``None, None`` when empty; writer None: restored from a snapshot)."""
        front = self._ages[0] if self._ages else (None, None)
        return len(self.buf), self.buf.capacity, front[0], front[1]

    # -- stats and priority updates ---------------------------------------------------
    # Every call from the coordinator carries its pending priority updates
    # (applied first, in order) and the largest leaf it has seen on any shard.
    def _apply(self, updates, max_leaf_hint: float) -> tuple:
        b = self.buf
        for slots, stamps, priorities in updates or ():
            if stamps is None:
                b.update_priorities(slots, priorities)
                continue
            keep = (stamps >> EPOCH_SHIFT) == self.epoch
            if not keep.all():
                slots, stamps, priorities = slots[keep], stamps[keep], priorities[keep]
            if slots.shape[0]:
                b.update_priorities(Batch({}, slots, None, None, stamps & GID_MASK), priorities)
        view = b.shard
        if max_leaf_hint > view.max_leaf:
            # New transitions get the largest leaf seen on any shard.
            view.raise_max_leaf(max_leaf_hint)
        return (b.total_priority, view.min_leaf, len(b), view.max_leaf, self.epoch)

    def stats(self, updates=None, max_leaf_hint: float = 0.0):
        return None, self._apply(updates, max_leaf_hint)

    def update(self, updates, max_leaf_hint: float):
        return None, self._apply(updates, max_leaf_hint)

    def info(self) -> dict:
        import ray

        return {"shard": self.k, "len": len(self.buf), "capacity": self.buf.capacity,
                "total_priority": self.buf.total_priority, "epoch": self.epoch,
                "restored_from": self.restored_from, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "oldest_stamp": self._fill()[2]}

    # -- writing -----------------------------------------------------------------
    def extend(self, data: dict, priorities=None, valid=None, stamp: int = 0, writer=None) -> tuple:
        """Store a chunk; ``stamp`` is when writer ``writer`` sent it (ns since the epoch).
        Returns ``_fill()`` after the chunk, for the writer's routing."""
        if valid is None:
            self.buf.extend(data, priorities)
        else:
            self.buf.extend(data, priorities, valid)
        self._arrived(stamp, writer, int(data["terminated"].size))
        return self._fill()

    def fill(self) -> tuple:
        return self._fill()

    # -- sampling ----------------------------------------------------------------
    def sample(self, updates, max_leaf_hint: float, targets, seen_total: float, beta: float,
               uniforms=None, stratified: bool = True):
        """Sample at local prefix-sum ``targets`` laid out against ``seen_total``.

        With ``uniforms`` instead (the coordinator's only live shard), the
        targets are laid out here over the current total, with the arithmetic
        of a local buffer's ``sample``: one round trip, exact, bit for bit.

        Returns ``(part, stats)``; ``part`` is None when ``targets`` is empty.
        When this shard's total moved since the coordinator saw it (a writer
        added, an update landed), the targets are rescaled onto the current
        total, so the draw inside the shard stays exactly proportional to the
        current leaves; ``part["scale"] = seen_total / total`` lets the
        coordinator report the probability the draw really had.
        """
        b = self.buf
        stats = self._apply(updates, max_leaf_hint)
        total = stats[0]
        if uniforms is not None:
            if not total > 0:
                return {"empty": True}, stats
            n = uniforms.shape[0]
            targets = (np.arange(n) + uniforms) * (total / n) if stratified else uniforms * total
            seen_total = total
        if targets.shape[0] == 0:
            return None, stats
        if not total > 0:
            return {"empty": True}, stats
        scale = 1.0
        if total != seen_total:
            scale = seen_total / total
            targets = targets / scale
        targets = np.minimum(targets, np.nextafter(total, 0.0))
        batch = b.shard.sample_at(targets, beta=beta)
        part = {"data": batch.data, "slots": batch.indices, "leaves": _leaves(b, batch),
                "scale": scale, "gens": batch.generations | (self.epoch << EPOCH_SHIFT)}
        return part, stats

    # -- persistence -------------------------------------------------------------
    def save(self, snapshot: str) -> dict:
        self.buf.save(snapshot)
        return {"len": len(self.buf), "total_priority": self.buf.total_priority,
                "epoch": self.epoch}

    def close(self) -> None:
        self.buf.close()
