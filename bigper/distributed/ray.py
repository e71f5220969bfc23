"""ShardedPrioritizedBuffer: one bigper buffer split over Ray actors.

::

    writers (any actor)          coordinator (the learner's process)
    writer().add/extend          one np.random.Generator, the beta schedule
        | chunks: room, then oldest  | 1. totals of every shard   (one parallel round trip)
        v                            | 2. sample_at on each shard (one parallel round trip)
    [shard 0] [shard 1] ... [shard S-1]   each a Ray actor holding a local buffer

What it guarantees, and what it costs: see ``bigper.distributed``.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
import numpy.typing as npt

import ray
from ray.exceptions import RayActorError

from ..batch import Batch
from ..config import Config
from ..core.layout import check_field_names
from ..core.parts import Draws
from ..schedules import ConstantSchedule, LinearSchedule, as_beta
from . import _manifest as M
from . import _options
from ._draw import draw
from ._sampling import shard_capacities
from ._placement import start_shards, stop_shards
from ._shard import shard_path
from ._shardset import ShardSet
from ._updates import split_updates
from ._writer import ShardWriter
from ..errors import (BufferClosedError, CorruptSnapshotError, IncompatibleSnapshotError, InvalidArgumentError,
                      InvalidTypeError)


def _entry(method):
    """A public entry point: it runs under the buffer's one (re-entrant) lock,
    and checks that the buffer is open inside it, so no call can run half on
    a buffer another thread closes, or interleave with another call."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            self._check_open()
            return method(self, *args, **kwargs)
    return run


class ShardedPrioritizedBuffer:
    """A prioritized replay buffer whose transitions live in ``num_shards`` Ray actors.

    Parameters
    ----------
    num_shards : int
        Shard actors, each holding a local ``PrioritizedReplayBuffer`` of
        ``capacity / num_shards`` transitions (its own ``path/shard-k`` on disk).
    capacity, fields, **keywords
        As ``bigper.PrioritizedReplayBuffer`` (``seed`` seeds the coordinator's generator).
        **Capacity across shards:** writers fill the shard with the most room
        first (cutting chunks to fit where no episode must stay whole), then
        send each chunk to the shard whose oldest rows arrived first. One writer
        fills the buffer to exactly ``min(added, capacity)`` and evicts oldest
        first across shards, to within one chunk per shard; in episode mode
        (``n_step > 1`` or ``frame_stack``, where chunks end at episode ends)
        the buffer holds ``min(added, capacity)`` minus less than one chunk per
        shard. With several writers, each learns the others' rows from the
        shards' replies: the buffer still holds less than a chunk per shard
        under ``min(added, capacity)``, and eviction order is approximate (in
        simulation the newer half of the last ``capacity`` rows loses under
        1/20 of what the older half loses; see ``bigper.distributed._routing``).
    prioritization : {"proportional"}
        Only proportional; ``"rank"`` raises ``InvalidArgumentError``.
    placement : {"PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"}
        Placement-group strategy for the shards' bundles.
    num_cpus_per_shard : float or None
        CPUs each shard's bundle reserves (fractions allowed). None (default),
        as Ray does for actors: no reservation, the shards go anywhere the
        placement strategy allows. A reservation the cluster cannot hold raises
        ``ShardUnavailableError`` within 5 s, naming what was asked and what is free.
    recovery_dir : str or Path, optional
        Where ``latest.json`` (the snapshot restarted shards reload) lives;
        default ``path`` for disk storages, else a fresh temporary directory
        (single node only: on a multi-node cluster give a shared directory).
    fresh_totals : bool
        Ask the shards for their totals on every ``sample`` (exact, two round
        trips) or use the totals their last replies carried (one round trip).
    chunk_size, max_writes_in_flight : int
        Steps per write call, and unacknowledged write calls per writer.
    max_pending_updates, max_updates_in_flight : int
        Priority-update rows a shard may have waiting for its next call before
        they are sent on their own, and how many such calls may be unacknowledged.
    shard_timeout_s : float
        How long ``sample`` waits for a shard before going on without it. A
        shard that Ray is restarting holds the calls made to it until it is
        back, so after a lost node the learner waits this long once, then
        samples the live shards; keep it well under a restart (seconds).
    max_restarts : int
        Ray restarts per shard (-1: unlimited).
    actor_options : dict, optional
        More ``ray.remote`` options for the shard actors (memory, runtime_env, ...).
    """

    #: The manifest format of ``save``'s snapshots. Its presence tells
    #: ``bigper.Snapshots`` that this buffer writes its own snapshots
    #: (``save(path) -> Path``) and loads them with ``load(path, path=None)``.
    snapshot_format = M.FORMAT
    config: Config
    num_shards: int
    fresh_totals: bool
    recovery_dir: str
    chunk_size: int
    max_writes_in_flight: int

    def __init__(self, num_shards: int, capacity: int,
                 fields: Mapping[str, tuple[int | tuple[int, ...], npt.DTypeLike]], *,
                 frame_stack: int | None = None, n_step: int = 1, gamma: float = 0.99, alpha: float = 0.6,
                 eps: float = 1e-6, max_priority: float | None = None,
                 beta: float | LinearSchedule | ConstantSchedule = 0.4,
                 weight_norm: Literal["global", "batch"] = "global",
                 storage: Literal["memory", "memmap", "hdf5"] = "memory",
                 path: str | os.PathLike[str] | None = None, next_of: Sequence[str] | None = None,
                 num_envs: int = 1, seed: int | None = 0,
                 prioritization: Literal["proportional"] = "proportional",
                 storage_options: Mapping[str, Any] | None = None,
                 placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK",
                 num_cpus_per_shard: float | None = None, recovery_dir: str | os.PathLike[str] | None = None,
                 fresh_totals: bool = True, chunk_size: int = 256, max_writes_in_flight: int = 4,
                 max_updates_in_flight: int = 8, max_pending_updates: int = 65536,
                 shard_timeout_s: float = 10.0, max_restarts: int = -1,
                 actor_options: Mapping[str, Any] | None = None,
                 _restore: tuple[str, dict[str, Any]] | None = None, sequence: None = None) -> None:
        self._lock = threading.RLock()  # every public entry point holds it
        self._closed = True
        if sequence is not None:
            raise InvalidArgumentError(
                "sequence=...: sharded buffers do not serve sequence items (an item's steps and its "
                "burn-in would have to stay on one shard, and exact sampling across shards is not "
                "kept for them); use a single PrioritizedReplayBuffer with sequence=...")
        if prioritization != "proportional":
            raise InvalidArgumentError(
                f"prioritization={prioritization!r}: sharded buffers are proportional only (the "
                "coordinator draws prefix sums of one total over all shards; rank has no such total). "
                "Use a single PrioritizedReplayBuffer for rank-based prioritization")
        cfg = Config.build(capacity=capacity, fields=fields, frame_stack=frame_stack, n_step=n_step,
                           gamma=gamma, alpha=alpha, eps=eps, max_priority=max_priority, beta=beta,
                           weight_norm=weight_norm, next_of=next_of, num_envs=num_envs, seed=seed,
                           storage=storage)
        check_field_names(cfg)  # before any shard: each would refuse it on its own
        o = _options.check(cfg, num_shards=num_shards, placement=placement,
                           num_cpus_per_shard=num_cpus_per_shard, storage=storage, path=path,
                           chunk_size=chunk_size, max_writes_in_flight=max_writes_in_flight,
                           max_updates_in_flight=max_updates_in_flight,
                           max_pending_updates=max_pending_updates, shard_timeout_s=shard_timeout_s,
                           max_restarts=max_restarts)
        self.config, self.num_shards = cfg, o["num_shards"]
        self.fresh_totals = bool(fresh_totals)
        self._timeout = o["shard_timeout_s"]
        self._caps = shard_capacities(cfg.capacity, self.num_shards)
        self._offsets = np.concatenate([[0], np.cumsum(self._caps)]).astype(np.int64)
        self._path = None if path is None else str(Path(path).absolute())
        self._tmp_recovery = None
        if recovery_dir is None:
            if self._path is not None:
                recovery_dir = self._path
            else:
                recovery_dir = self._tmp_recovery = tempfile.mkdtemp(prefix="bigper-recovery-")
        self.recovery_dir = str(Path(recovery_dir).absolute())
        if _restore is None:
            M.clear_recovery_pointer(self.recovery_dir)  # a pointer from an earlier run is not ours
        else:
            M.write_recovery_pointer(self.recovery_dir, _restore[0])
        kw = dict(frame_stack=frame_stack, n_step=n_step, gamma=gamma, alpha=alpha, eps=eps,
                  max_priority=max_priority, beta=beta, weight_norm=weight_norm, storage=storage,
                  next_of=next_of, num_envs=num_envs, storage_options=storage_options)
        specs = [{"shard": k, "recovery_dir": self.recovery_dir, "path": shard_path(self._path, k, storage),
                  "load_from": None if _restore is None else str(Path(_restore[0]) / f"shard-{k}"),
                  "kwargs": dict(kw, capacity=int(self._caps[k]), fields=dict(cfg.fields),
                                 seed=None if cfg.seed is None else cfg.seed + 1 + k)}
                 for k in range(self.num_shards)]
        # An explicit reservation that cannot fit fails fast (the figures are
        # known); with none, placement only waits on the cluster's own start-up.
        wait = 5.0 if o["cpus"] is not None else max(60.0, self._timeout)
        try:
            self._pg, self._shards = start_shards(
                specs, placement=placement, cpus=o["cpus"], max_restarts=o["max_restarts"],
                actor_options=dict(actor_options or {}), timeout=wait)
        except BaseException:
            if self._tmp_recovery:
                shutil.rmtree(self._tmp_recovery, ignore_errors=True)
            raise
        self._closed = False
        self._draws = Draws(cfg.schedule, cfg.seed)  # the coordinator's random stream and beta schedule
        self._norm_batch = cfg.weight_norm == "batch"
        self._set = ShardSet(self._shards, timeout=self._timeout,
                             max_in_flight=o["max_updates_in_flight"],
                             max_pending=o["max_pending_updates"])
        self._writers = 1
        self.chunk_size, self.max_writes_in_flight = o["chunk_size"], o["max_writes_in_flight"]
        self._writer = ShardWriter(self._shards, cfg.to_dict(), start=0, chunk_size=self.chunk_size,
                                   max_in_flight=self.max_writes_in_flight)
        if _restore is not None:
            coord = _restore[1]["coordinator"]
            self._draws.restore(coord)
            self._set.max_leaf = float(coord["max_leaf"])

    # -- sizes ---------------------------------------------------------------------
    @property
    @_entry
    def shard_timeout_s(self) -> float:
        """How long a call waits for a shard before going on without it (settable:
        e.g. generous while shards load their kernels, short once they run)."""
        return self._timeout

    @shard_timeout_s.setter
    @_entry
    def shard_timeout_s(self, value: float) -> None:
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = float("nan")
        if isinstance(value, bool) or not v > 0:
            raise InvalidArgumentError(f"shard_timeout_s must be > 0, got {value!r}")
        self._timeout = v
        if getattr(self, "_set", None) is not None:
            self._set.timeout = v

    # capacity and shard_offsets are fixed at construction: read without the
    # lock, and still after close (as a local buffer's capacity).
    @property
    def capacity(self) -> int:
        """Transitions held at most, over all shards."""
        return self.config.capacity

    @property
    @_entry
    def beta(self) -> float:
        """The beta the next ``sample`` call will use."""
        return self._draws.beta()

    @property
    def shard_offsets(self) -> np.ndarray:
        """(num_shards + 1,) int64: shard ``k`` owns global indices ``[offsets[k], offsets[k+1])``."""
        return self._offsets.copy()

    @property
    @_entry
    def shard_actors(self) -> list[Any]:
        """The shard actors' handles (shard ``k`` at position ``k``)."""
        return list(self._shards)

    @_entry
    def __len__(self) -> int:
        """Transitions held by the live shards (after flushing this process's writes)."""
        self._sync()
        return int(sum(st[2] for st in self._set.probe().values()))

    @property
    @_entry
    def total_priority(self) -> float:
        """Sum of the leaves of the live shards."""
        self._sync()
        return float(sum(st[0] for st in self._set.probe().values()))

    @_entry
    def shard_info(self) -> list[dict[str, Any] | None]:
        """Per shard: a dict (len, capacity, total_priority, epoch, restored_from, pid), or
        None for a shard that did not answer within ``shard_timeout_s``."""
        self._check_open()
        refs = [s.info.remote() for s in self._shards]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self._timeout)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else None)
            except RayActorError:
                out.append(None)
        return out

    # -- writing ---------------------------------------------------------------------
    @_entry
    def writer(self, *, chunk_size: int | None = None, max_in_flight: int | None = None) -> ShardWriter:
        """A handle for writing from another process (pass it to a Ray actor)."""
        self._check_open()
        w = ShardWriter(self._shards, self.config.to_dict(), start=self._writers,
                        chunk_size=chunk_size or self.chunk_size,
                        max_in_flight=max_in_flight or self.max_writes_in_flight)
        self._writers += 1
        return w

    @_entry
    def add(self, *, priorities: npt.ArrayLike | None = None, valid: npt.ArrayLike | None = None,
            **step: npt.ArrayLike) -> None:
        """As ``PrioritizedReplayBuffer.add``; collected into chunks (see ``flush``)."""
        self._check_open()
        self._writer.add(priorities=priorities, valid=valid, **step)

    @_entry
    def extend(self, data: Mapping[str, npt.ArrayLike], priorities: npt.ArrayLike | None = None,
               valid: npt.ArrayLike | None = None) -> None:
        """As ``PrioritizedReplayBuffer.extend``; sent in chunks (see ``capacity`` above)."""
        self._check_open()
        self._writer.extend(data, priorities, valid)

    @_entry
    def flush(self) -> None:
        """Send this process's pending steps and wait until the shards stored them
        and applied every priority update sent so far."""
        self._sync()
        self._set.send_updates()
        self._set.reap(0)

    def _sync(self) -> None:
        self._check_open()
        self._writer.flush()

    # -- sampling --------------------------------------------------------------------
    @_entry
    def sample(self, batch_size: int, *, beta: float | None = None, stratified: bool = True) -> Batch:
        """Draw ``batch_size`` transitions over all live shards, ``P(i) = leaf_i / T``.

        Same arguments and same ``Batch`` as ``PrioritizedReplayBuffer.sample``;
        ``indices`` are global (see ``shard_offsets``).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
        b = self._draws.beta() if beta is None else as_beta(beta)  # the one beta rule
        self._sync()
        batch = draw(self._set, self._draws.rng, self._offsets, int(batch_size), b, bool(stratified),
                     fresh=self.fresh_totals, batch_norm=self._norm_batch)
        self._draws.step += 1
        return batch

    # -- priorities --------------------------------------------------------------------
    @_entry
    def update_priorities(self, target: Batch | Mapping[str, Any] | npt.ArrayLike,
                          priorities: npt.ArrayLike) -> None:
        """As ``PrioritizedReplayBuffer.update_priorities``, grouped by shard and
        asynchronous: a shard's updates ride on the next call to it (the next
        ``sample``), or go on their own once ``max_pending_updates`` rows wait, with
        at most ``max_updates_in_flight`` such calls unacknowledged. An error a
        shard raises (a raw index never written) surfaces at a later call."""
        self._check_open()
        for s, slots, stamps, p in split_updates(target, priorities, self._offsets, self.config.capacity):
            self._set.queue_update(s, slots, stamps, p)

    # -- persistence ---------------------------------------------------------------------
    @_entry
    def save(self, snapshot: str | os.PathLike[str]) -> Path:
        """Snapshot every shard and the coordinator into the new directory ``snapshot``;
        returns its absolute path.

        All or nothing (see ``_manifest``); ``bigper.Snapshots`` numbers, keeps
        and falls back over these as over a local buffer's. Writers in other
        processes should ``flush()`` first: each shard is saved as it stands
        when its call runs. Restarted shards reload the latest one.
        """
        self.flush()
        snapshot = Path(snapshot).absolute()
        M.save(self._shards, snapshot, {
            "num_shards": self.num_shards, "capacities": self._caps.tolist(),
            "config": self.config.to_dict(), "path": self._path,
            "coordinator": {**self._draws.state(), "max_leaf": self._set.max_leaf}})
        M.write_recovery_pointer(self.recovery_dir, snapshot)
        return snapshot

    @classmethod
    def load(cls, snapshot: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None,
             **options: Any) -> "ShardedPrioritizedBuffer":
        """Resume a sharded buffer saved by ``save``: shards reload their snapshots
        (live data under ``path``, default the recorded one), the coordinator its
        generator and beta step. ``options``: the constructor's Ray and routing keywords.

        Raises ``CorruptSnapshotError`` when a shard's snapshot fails its checks
        (so ``Snapshots.load_latest`` falls back to the previous one).
        """
        m = M.read_manifest(snapshot)
        try:  # a crafted config is the snapshot's fault, named as such
            cfg = Config.from_dict(m["config"])
            fields = {n: (s, d) for n, (s, d) in cfg.fields.items()}
        except Exception as e:
            raise IncompatibleSnapshotError(f"{snapshot}: its config is not valid for this bigper: "
                                            f"{str(e)[:200]}") from None
        if path is None and m["path"] is not None and not isinstance(m["path"], str):
            raise CorruptSnapshotError(f"{snapshot}: manifest path is {m['path']!r}, not a string")
        return cls(m["num_shards"], cfg.capacity, fields, frame_stack=cfg.frame_stack,
                   n_step=cfg.n_step, gamma=cfg.gamma, alpha=cfg.alpha, eps=cfg.eps,
                   max_priority=cfg.max_priority, beta=cfg.schedule, weight_norm=cfg.weight_norm,
                   storage=cfg.storage, path=path if path is not None else m["path"],
                   next_of=cfg.next_of, num_envs=cfg.num_envs, seed=cfg.seed,
                   _restore=(str(Path(snapshot).absolute()), m), **options)

    # -- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("this sharded buffer is closed")

    def close(self) -> None:
        """Flush, close every shard's storage (disk storages resume on reopen),
        stop the actors and free the placement group."""
        with self._lock:
            if not self._closed:
                self._close()

    def _close(self) -> None:
        try:
            self.flush()
            refs = [s.close.remote() for s in self._shards]
            ray.wait(refs, num_returns=len(refs), timeout=max(self._timeout, 60.0))
            for ref in refs:
                try:
                    ray.get(ref, timeout=0)
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # a dead shard has nothing to close; a stuck one is killed below
        finally:
            self._kill()

    def _kill(self) -> None:
        stop_shards(self._shards, self._pg)
        if self._tmp_recovery:
            shutil.rmtree(self._tmp_recovery, ignore_errors=True)
        self._closed = True

    def __enter__(self) -> "ShardedPrioritizedBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> NoReturn:
        raise InvalidTypeError("a ShardedPrioritizedBuffer stays in the process that made it; "
                        "pass buf.writer() to other actors")

    def __repr__(self) -> str:
        with self._lock:
            state = "closed" if self._closed else f"capacity={self.config.capacity}"
        return f"ShardedPrioritizedBuffer(num_shards={self.num_shards}, {state})"
