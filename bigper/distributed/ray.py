"""ShardedPrioritizedBuffer: one bigper buffer split over Ray actors.

::

    writers (any actor)          coordinator (the learner's process)
    writer().add/extend          one np.random.Generator, the beta schedule
        | chunks, round robin        | 1. totals of every shard   (one parallel round trip)
        v                            | 2. sample_at on each shard (one parallel round trip)
    [shard 0] [shard 1] ... [shard S-1]   each a Ray actor holding a local buffer

What it guarantees, and what it costs: see ``bigper.distributed``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

import ray
from ray.exceptions import RayActorError

from ..batch import Batch
from .._ingest import as_index, as_priorities
from ..config import Config
from . import _manifest as M
from ._sampling import assemble, lay_out, shard_capacities
from ._placement import PLACEMENTS, start_shards, stop_shards
from ._shard import shard_path
from ._shardset import ShardSet
from ._writer import ShardWriter
from ..errors import InvalidArgumentError, InvalidIndexError, InvalidTypeError, ShardUnavailableError


class ShardedPrioritizedBuffer:
    """A prioritized replay buffer whose transitions live in ``num_shards`` Ray actors.

    Parameters
    ----------
    num_shards : int
        Shard actors, each holding a local ``PrioritizedReplayBuffer`` of
        ``capacity / num_shards`` transitions (its own ``path/shard-k`` on disk).
    capacity, fields, **keywords
        As ``bigper.PrioritizedReplayBuffer`` (``seed`` seeds the coordinator's generator).
    placement : {"PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"}
        Placement-group strategy for the shards' bundles.
    num_cpus_per_shard : float
        CPUs each shard's bundle reserves (fractions allowed).
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
        How long ``sample`` waits for a shard before going on without it.
    max_restarts : int
        Ray restarts per shard (-1: unlimited).
    actor_options : dict, optional
        More ``ray.remote`` options for the shard actors (memory, runtime_env, ...).
    """

    def __init__(self, num_shards, capacity, fields, *, frame_stack=None, n_step=1, gamma=0.99,
                 alpha=0.6, eps=1e-6, max_priority=None, beta=0.4, weight_norm="global",
                 storage="memory", path=None, next_of=None, num_envs=1, seed=0,
                 storage_options=None, placement="PACK", num_cpus_per_shard=1.0,
                 recovery_dir=None, fresh_totals=True, chunk_size=256, max_writes_in_flight=4,
                 max_updates_in_flight=8, max_pending_updates=65536, shard_timeout_s=10.0,
                 max_restarts=-1, actor_options=None, _restore=None):
        if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
            raise InvalidArgumentError(f"num_shards must be an int >= 1, got {num_shards!r}")
        cfg = Config.build(capacity=capacity, fields=fields, frame_stack=frame_stack, n_step=n_step,
                           gamma=gamma, alpha=alpha, eps=eps, max_priority=max_priority, beta=beta,
                           weight_norm=weight_norm, next_of=next_of, num_envs=num_envs, seed=seed,
                           storage=storage)
        if cfg.capacity < num_shards:
            raise InvalidArgumentError(f"capacity must be >= num_shards={num_shards}, got {capacity!r}")
        if placement not in PLACEMENTS:
            raise InvalidArgumentError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if not float(num_cpus_per_shard) > 0:
            raise InvalidArgumentError(f"num_cpus_per_shard must be > 0, got {num_cpus_per_shard!r}")
        if (cfg.n_step > 1 or cfg.frame_stack) and cfg.num_envs > 1:
            raise InvalidArgumentError("a sharded buffer with n_step > 1 or frame_stack needs num_envs=1 "
                             "(chunks must end at episode ends); give each env its own writer(), "
                             f"got num_envs={num_envs}")
        if storage != "memory" and path is None:
            raise InvalidArgumentError(f"storage={storage!r} needs a path=, got None")
        for name, v in (("chunk_size", chunk_size), ("max_writes_in_flight", max_writes_in_flight),
                        ("max_updates_in_flight", max_updates_in_flight),
                        ("max_pending_updates", max_pending_updates)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        if not float(shard_timeout_s) > 0:
            raise InvalidArgumentError(f"shard_timeout_s must be > 0, got {shard_timeout_s!r}")
        self.config, self.num_shards = cfg, int(num_shards)
        self.fresh_totals = bool(fresh_totals)
        self.shard_timeout_s = float(shard_timeout_s)
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
        self._closed = True
        kw = dict(frame_stack=frame_stack, n_step=n_step, gamma=gamma, alpha=alpha, eps=eps,
                  max_priority=max_priority, beta=beta, weight_norm=weight_norm, storage=storage,
                  next_of=next_of, num_envs=num_envs, storage_options=storage_options)
        specs = [{"shard": k, "recovery_dir": self.recovery_dir, "path": shard_path(self._path, k, storage),
                  "load_from": None if _restore is None else str(Path(_restore[0]) / f"shard-{k}"),
                  "kwargs": dict(kw, capacity=int(self._caps[k]), fields=dict(cfg.fields),
                                 seed=None if cfg.seed is None else cfg.seed + 1 + k)}
                 for k in range(self.num_shards)]
        try:
            self._pg, self._shards = start_shards(
                specs, placement=placement, cpus=float(num_cpus_per_shard), max_restarts=int(max_restarts),
                actor_options=dict(actor_options or {}), timeout=max(60.0, self.shard_timeout_s))
        except BaseException:
            if self._tmp_recovery:
                shutil.rmtree(self._tmp_recovery, ignore_errors=True)
            raise
        self._closed = False
        self._rng = np.random.default_rng(cfg.seed)
        self._schedule, self._beta_step = cfg.schedule, 0
        self._norm_batch = cfg.weight_norm == "batch"
        self._set = ShardSet(self._shards, timeout=self.shard_timeout_s,
                             max_in_flight=int(max_updates_in_flight),
                             max_pending=int(max_pending_updates))
        self._writers = 1
        self.chunk_size, self.max_writes_in_flight = int(chunk_size), int(max_writes_in_flight)
        self._writer = ShardWriter(self._shards, cfg.to_dict(), start=0, chunk_size=chunk_size,
                                   max_in_flight=max_writes_in_flight)
        if _restore is not None:
            coord = _restore[1]["coordinator"]
            self._rng.bit_generator.state = coord["rng"]
            self._beta_step, self._set.max_leaf = int(coord["beta_step"]), float(coord["max_leaf"])

    # -- sizes ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def beta(self) -> float:
        """The beta the next ``sample`` call will use."""
        return self._schedule(self._beta_step)

    @property
    def shard_offsets(self) -> np.ndarray:
        """(num_shards + 1,) int64: shard ``k`` owns global indices ``[offsets[k], offsets[k+1])``."""
        return self._offsets.copy()

    @property
    def shard_actors(self) -> list:
        """The shard actors' handles (shard ``k`` at position ``k``)."""
        return list(self._shards)

    def __len__(self) -> int:
        """Transitions held by the live shards (after flushing this process's writes)."""
        self._sync()
        return int(sum(st[2] for st in self._set.probe().values()))

    @property
    def total_priority(self) -> float:
        """Sum of the leaves of the live shards."""
        self._sync()
        return float(sum(st[0] for st in self._set.probe().values()))

    def shard_info(self) -> list:
        """Per shard: a dict (len, capacity, total_priority, epoch, restored_from, pid), or
        None for a shard that did not answer within ``shard_timeout_s``."""
        self._check_open()
        refs = [s.info.remote() for s in self._shards]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.shard_timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else None)
            except RayActorError:
                out.append(None)
        return out

    # -- writing ---------------------------------------------------------------------
    def writer(self, *, chunk_size=None, max_in_flight=None) -> ShardWriter:
        """A handle for writing from another process (pass it to a Ray actor)."""
        self._check_open()
        w = ShardWriter(self._shards, self.config.to_dict(), start=self._writers,
                        chunk_size=chunk_size or self.chunk_size,
                        max_in_flight=max_in_flight or self.max_writes_in_flight)
        self._writers += 1
        return w

    def add(self, *, priorities=None, valid=None, **step) -> None:
        """As ``PrioritizedReplayBuffer.add``; collected into chunks (see ``flush``)."""
        self._check_open()
        self._writer.add(priorities=priorities, valid=valid, **step)

    def extend(self, data, priorities=None, valid=None) -> None:
        """As ``PrioritizedReplayBuffer.extend``; sent in chunks, round robin."""
        self._check_open()
        self._writer.extend(data, priorities, valid)

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
    def sample(self, batch_size: int, *, beta=None, stratified: bool = True) -> Batch:
        """Draw ``batch_size`` transitions over all live shards, ``P(i) = leaf_i / T``.

        Same arguments and same ``Batch`` as ``PrioritizedReplayBuffer.sample``;
        ``indices`` are global (see ``shard_offsets``).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if beta is not None:
            b = float(beta)
            if not (b >= 0 and b < np.inf):
                raise InvalidArgumentError(f"beta must be finite and >= 0, got {beta!r}")
        else:
            b = self._schedule(self._beta_step)
        self._sync()
        sh, n = self._set, int(batch_size)
        sh.reap(sh.max_in_flight)
        for _ in range(self.num_shards + 2):
            live = sh.live()
            if len(live) == 1:
                batch = self._sample_one(live[0], n, b, bool(stratified))
                if batch is None:
                    continue
                self._beta_step += 1
                return batch
            if self.fresh_totals:
                stats = sh.probe()
            else:
                sh.reap(0)
                stats = sh.cached()
            totals = np.array([stats[s][0] if s in stats else 0.0 for s in range(self.num_shards)])
            if not totals.sum() > 0:
                raise InvalidArgumentError(
                    f"cannot sample: no sampleable transition (len={sum(st[2] for st in stats.values())} "
                    f"on {len(stats)} live shard(s) of {self.num_shards})")
            shard, local, total = lay_out(self._rng.random(n), totals, bool(stratified))
            positions, calls = {}, {}
            for s in stats:
                pos = np.flatnonzero(shard == s)
                # Pipelined: every live shard answers, so its cached total stays fresh.
                if pos.shape[0] or not self.fresh_totals:
                    positions[s] = pos
                    calls[s] = sh.call(s, "sample", local[pos], totals[s], b)
            replies = sh.collect(calls)
            parts = {s: r[0] for s, r in replies.items() if r[0] is not None}
            if len(replies) < len(calls) or any(p.get("empty") for p in parts.values()):
                continue  # a shard died or emptied mid-call: draw again over the live ones
            for s, r in replies.items():
                stats[s] = r[1]
            floor = min([st[1] * (parts[s]["scale"] if s in parts else 1.0) for s, st in stats.items()
                         if st[1] < np.inf] or [np.inf])
            batch = assemble(n, parts, {s: positions[s] for s in parts}, self._offsets, total, floor,
                             b, self._norm_batch)
            self._beta_step += 1
            return batch
        raise ShardUnavailableError(f"sampling failed {self.num_shards + 2} times in a row: shards keep dying")

    def _sample_one(self, s: int, n: int, beta: float, stratified: bool):
        """The only live shard lays the draws out itself: one round trip."""
        state = self._rng.bit_generator.state
        calls = {s: self._set.call(s, "sample", None, 0.0, beta, self._rng.random(n), stratified)}
        reply = self._set.collect(calls).get(s)
        if reply is None:
            return None  # it went down: try again over what is live
        part, st = reply
        if part.get("empty"):
            self._rng.bit_generator.state = state  # as a local buffer: no draw when empty
            raise InvalidArgumentError(f"cannot sample: no sampleable transition (len={st[2]} on the one live "
                             f"shard of {self.num_shards})")
        return assemble(n, {s: part}, {s: np.arange(n)}, self._offsets, st[0], st[1], beta,
                        self._norm_batch)

    # -- priorities --------------------------------------------------------------------
    def update_priorities(self, target, priorities) -> None:
        """As ``PrioritizedReplayBuffer.update_priorities``, grouped by shard and
        asynchronous: a shard's updates ride on the next call to it (the next
        ``sample``), or go on their own once ``max_pending_updates`` rows wait, with
        at most ``max_updates_in_flight`` such calls unacknowledged. An error a
        shard raises (a raw index never written) surfaces at a later call."""
        self._check_open()
        if isinstance(target, Batch):
            idx, stamps = target.indices, target.generations
        else:
            idx, stamps = as_index(target), None
        p = as_priorities(priorities, idx.shape[0])
        bad = np.flatnonzero(~((p >= 0) & (p < np.inf)))
        if bad.shape[0]:
            i = int(bad[0])
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[i]} at position {i}")
        out = np.flatnonzero((idx < 0) | (idx >= self.capacity))
        if out.shape[0]:
            bad = int(out[0])
            raise InvalidIndexError(f"indices[{bad}] = {idx[bad]} is out of range [0, capacity) "
                             f"(capacity={self.capacity})")
        if p.shape[0] == 0:
            return
        shard = np.searchsorted(self._offsets, idx, side="right") - 1
        slots = idx - self._offsets[shard]
        if self.num_shards == 1:
            self._set.queue_update(0, slots, stamps, p)
            return
        for s in np.unique(shard):
            sel = shard == s
            self._set.queue_update(int(s), slots[sel], None if stamps is None else stamps[sel], p[sel])

    # -- persistence ---------------------------------------------------------------------
    def save(self, snapshot) -> None:
        """Snapshot every shard and the coordinator into the new directory ``snapshot``.

        All or nothing (see ``_manifest``). Writers in other processes should
        ``flush()`` first: each shard is saved as it stands when its call runs.
        """
        self.flush()
        snapshot = Path(snapshot).absolute()
        M.save(self._shards, snapshot, {
            "num_shards": self.num_shards, "capacities": self._caps.tolist(),
            "config": self.config.to_dict(), "path": self._path,
            "coordinator": {"rng": self._rng.bit_generator.state, "beta_step": self._beta_step,
                            "max_leaf": self._set.max_leaf}})
        M.write_recovery_pointer(self.recovery_dir, snapshot)

    @classmethod
    def load(cls, snapshot, *, path=None, **options) -> "ShardedPrioritizedBuffer":
        """Resume a sharded buffer saved by ``save``: shards reload their snapshots
        (live data under ``path``, default the recorded one), the coordinator its
        generator and beta step. ``options``: the constructor's Ray and routing keywords."""
        m = M.read_manifest(snapshot)
        cfg = Config.from_dict(m["config"])
        fields = {n: (s, d) for n, (s, d) in cfg.fields.items()}
        return cls(m["num_shards"], cfg.capacity, fields, frame_stack=cfg.frame_stack,
                   n_step=cfg.n_step, gamma=cfg.gamma, alpha=cfg.alpha, eps=cfg.eps,
                   max_priority=cfg.max_priority, beta=cfg.schedule, weight_norm=cfg.weight_norm,
                   storage=cfg.storage, path=path if path is not None else m["path"],
                   next_of=cfg.next_of, num_envs=cfg.num_envs, seed=cfg.seed,
                   _restore=(str(Path(snapshot).absolute()), m), **options)

    # -- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this sharded buffer is closed")

    def close(self) -> None:
        """Flush, close every shard's storage (disk storages resume on reopen),
        stop the actors and free the placement group."""
        if self._closed:
            return
        try:
            self.flush()
            refs = [s.close.remote() for s in self._shards]
            ray.wait(refs, num_returns=len(refs), timeout=max(self.shard_timeout_s, 60.0))
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        raise InvalidTypeError("a ShardedPrioritizedBuffer stays in the process that made it; "
                        "pass buf.writer() to other actors")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"capacity={self.capacity}"
        return f"ShardedPrioritizedBuffer(num_shards={self.num_shards}, {state})"
