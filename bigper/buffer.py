"""PrioritizedReplayBuffer: the ring, add/extend/sample/update."""

from __future__ import annotations

import numpy as np

from . import _kernels as K
from . import nstep
from ._edges import EdgeMethods
from ._statecheck import check_state
from ._ingest import Ingest, as_index, as_priorities, to_leaves
from .batch import Batch
from .config import Config
from .errors import (
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidIndexError,
    InvalidTypeError,
)
from .frames import FrameStore
from .storage import open_storage
from .tree import PriorityTree

_EMPTY = np.zeros(0, dtype=np.float64)
# Lookup by the ends bits (1 terminated, 2 truncated): a take() beats a kernel call for a batch.
_TERM = np.array([False, True, False, True])
_TRUNC = np.array([False, False, True, True])

# Slot status: what a slot holds right now.
EMPTY, LIVE, PENDING, DEAD = 0, 1, 2, 3


class PrioritizedReplayBuffer(EdgeMethods):
    """A prioritized replay buffer (proportional PER) over any storage.

    Parameters
    ----------
    capacity : int
        Transitions held, across all envs (>= 1).
    fields : dict[str, tuple[shape, dtype]]
        Per-step data. ``"obs"`` is a stack of frames on axis 0 when
        ``frame_stack`` is set.
    frame_stack : int, optional
        Store each frame of ``"obs"`` once and rebuild stacks at sample time.
    n_step, gamma : int, float
        n-step returns computed at sample time.
    alpha, eps, max_priority : float
        A leaf holds ``(min(p, max_priority) + eps) ** alpha``.
    beta : float or schedule
        IS exponent; a schedule is advanced once per ``sample`` call.
    weight_norm : {"global", "batch"}
        Divide weights by the largest possible weight, or by the batch's largest.
    storage : {"memory", "memmap", "hdf5"}
    path : str or Path, optional
        Where disk storages live; reopening the same path resumes.
    next_of : tuple[str], optional
        Fields that get a successor ``next_<name>``; default ``("obs",)`` where there is one.
    num_envs : int
        With more than one, ``add`` takes a leading env axis and each env is its own stream.
    seed : int, optional
        Seed of the one ``numpy.random.Generator`` that draws every uniform.
    """

    def __init__(self, capacity, fields, *, frame_stack=None, n_step=1, gamma=0.99, alpha=0.6,
                 eps=1e-6, max_priority=None, beta=0.4, weight_norm="global", storage="memory",
                 path=None, next_of=None, num_envs=1, seed=0, read_only=False, storage_options=None):
        cfg = Config.build(capacity=capacity, fields=fields, frame_stack=frame_stack,
                           n_step=n_step, gamma=gamma, alpha=alpha, eps=eps,
                           max_priority=max_priority, beta=beta, weight_norm=weight_norm,
                           next_of=next_of, num_envs=num_envs, seed=seed, storage=storage)
        if cfg.n_step > 1 and cfg.fields.get("reward", ((None,),))[0] != ():
            raise InvalidArgumentError("n_step > 1 needs a scalar 'reward' field to sum, "
                             f"got fields {sorted(cfg.fields)}")
        if cfg.storage == "memory" and (path is not None or read_only):
            raise InvalidArgumentError(f"storage='memory' takes no path or read_only, got path={path!r}")
        store = open_storage(cfg.storage, path, read_only=read_only, **(storage_options or {}))
        recorded = store.open(cfg.to_dict())
        if recorded is not None:
            diff = cfg.differences(Config.from_dict(recorded["config"]))
            if diff:
                store.close()
                raise IncompatibleSnapshotError(
                    f"{path} holds a buffer of another config; differing key(s): " + "; ".join(diff))
        self._setup(cfg, store)
        if recorded is not None:
            self._restore(*store.saved_state())

    # -- construction ----------------------------------------------------------
    def _setup(self, cfg: Config, store) -> None:
        self.config = cfg
        self._cfg_beta = cfg.schedule
        self._maxp = np.inf if cfg.max_priority is None else cfg.max_priority
        self._gamma = cfg.gamma
        self._norm_batch = cfg.weight_norm == "batch"
        self._discount1 = np.array([cfg.gamma, 0.0, cfg.gamma, 0.0], dtype=np.float32)
        c = cfg.capacity
        self._ingest = Ingest(cfg)
        self._store = store
        self._frames = FrameStore(cfg, store) if cfg.frame_stack else None
        # Fields stored row by row; with frame stacks, obs and next_obs go to the frame ring.
        framed = ("obs", "next_obs") if self._frames is not None else ()
        self._plain = {n: v for n, v in self._ingest.stored.items() if n not in framed}
        self._successors = {f"next_{n}" for n in cfg.next_of}
        specs = {name: (c, shape, dtype) for name, (shape, dtype) in self._plain.items()}
        if self._frames is not None:
            specs.update(self._frames.specs())
        store.allocate(specs)
        self._tree = PriorityTree(c, track_min=not self._norm_batch)
        self._gid = np.full(c, -1, dtype=np.int64)
        self._status = np.zeros(c, dtype=np.uint8)
        self._ends = np.zeros(c, dtype=np.uint8)
        self._pending = np.zeros(c if cfg.n_step > 1 else 0, dtype=np.float64)
        self._count = 0
        self._max_leaf = 1.0
        self._beta_step = 0
        self._env_ended = np.ones(cfg.num_envs, dtype=bool)  # no episode in progress
        self._rng = np.random.default_rng(cfg.seed)
        self._closed = False

    # -- state (close/reopen and snapshots) --------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        """``(meta, arrays)``: JSON-able counters and RNG state, and the
        bookkeeping arrays; with the storage's data, everything to resume."""
        meta = {"count": self._count, "max_leaf": self._max_leaf, "beta_step": self._beta_step,
                "rng": self._rng.bit_generator.state, "env_ended": self._env_ended.tolist()}
        arrays = {"leaves": self._tree.leaves, "gid": self._gid, "status": self._status,
                  "ends": self._ends, "pending": self._pending}
        if self._frames is not None:
            fmeta, farrays = self._frames.state()
            meta["frames"] = fmeta
            arrays.update(farrays)
        return meta, arrays

    def _restore(self, meta: dict, arrays: dict) -> None:
        check_state(self.config, meta, arrays)
        c = self.config.capacity
        for name, want in (("leaves", (c,)), ("gid", (c,)), ("status", (c,)), ("ends", (c,))):
            got = arrays.get(name)
            if got is None or got.shape != want:
                raise IncompatibleSnapshotError(
                    f"recorded state array {name!r} has shape {None if got is None else got.shape}, "
                    f"expected {want}")
        self._tree.set_all(arrays["leaves"])
        self._gid[:] = arrays["gid"]
        self._status[:] = arrays["status"]
        self._ends[:] = arrays["ends"]
        self._pending[:] = arrays.get("pending", self._pending)
        self._count = int(meta["count"])
        self._max_leaf = float(meta["max_leaf"])
        self._beta_step = int(meta["beta_step"])
        self._env_ended[:] = meta["env_ended"]
        self._rng.bit_generator.state = meta["rng"]
        if self._frames is not None:
            self._frames.restore(meta["frames"], arrays)

    # -- sizes -----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity

    def __len__(self) -> int:
        """Transitions held (sampleable or waiting for their n-step window)."""
        return min(self._count, self.config.capacity)

    @property
    def total_priority(self) -> float:
        """Sum of all leaves: ``P(i) = leaf_i / total_priority``."""
        return self._tree.total

    @property
    def beta(self) -> float:
        """The beta the next ``sample`` call will use."""
        return self._cfg_beta(self._beta_step)

    # -- writing ---------------------------------------------------------------
    def add(self, *, priorities=None, valid=None, **step) -> None:
        """Add one env step (with ``num_envs > 1``: one step of every env).

        Takes every field, ``next_<name>`` for the fields in ``next_of``, and
        optionally ``terminated`` and ``truncated`` (default False). Values
        have the field's shape, with a leading env axis when ``num_envs > 1``.

        ``valid`` (bool per env) marks envs whose step is not a transition:
        with Gymnasium's next-step autoreset, the step right after an episode
        end only resets the env. Such a row keeps its env's stream aligned
        but is never sampled; it is accepted only right after an episode end
        of that env (or before its first step).
        """
        self._check_writable()
        rows, leaves, valid = self._ingest.step(step, priorities, valid)
        self._write(rows, leaves, valid)

    def extend(self, data, priorities=None, valid=None) -> None:
        """Add many steps: every value has a leading time axis (then the env
        axis when ``num_envs > 1``); ``priorities`` and ``valid`` match those axes."""
        self._check_writable()
        rows, leaves, valid = self._ingest.steps(data, priorities, valid)
        self._write(rows, leaves, valid)

    def _write(self, rows: dict, leaves, valid=None) -> None:
        m = rows["terminated"].shape[0]
        if valid is not None:
            # A placeholder row may only follow an episode end of its env.
            ended = (rows["terminated"] | rows["truncated"]) | ~valid
            before = np.concatenate([self._env_ended, ended])[:m]
            bad = np.flatnonzero(~valid & ~before)
            if bad.size:
                r = int(bad[0])
                raise InvalidArgumentError(
                    f"valid is False for env {(self._count + r) % self.config.num_envs} at row {r}, "
                    "but that env's previous step did not end an episode; valid=False is for the "
                    "reset step of next-step autoreset")
        else:
            ended = rows["terminated"] | rows["truncated"]
        self._env_ended = np.concatenate([self._env_ended, ended])[-self.config.num_envs:]
        c = self.config.capacity
        # More rows than slots: write in chunks of at most `capacity`, so that
        # slots within one write are distinct and every frame stream stays whole.
        for lo in range(0, m, c):
            hi = min(lo + c, m)
            self._write_chunk({n: v[lo:hi] for n, v in rows.items()},
                              None if leaves is None else leaves[lo:hi],
                              None if valid is None else valid[lo:hi])

    def _write_chunk(self, rows: dict, leaves, valid) -> None:
        cfg = self.config
        c = cfg.capacity
        m = rows["terminated"].shape[0]
        g0 = self._count
        gids = np.arange(g0, g0 + m, dtype=np.int64)
        slots = gids % c
        where = slots[0] if m == 1 else (slice(slots[0], slots[0] + m) if slots[0] + m <= c else slots)
        ends = rows["terminated"].astype(np.uint8) | (rows["truncated"].astype(np.uint8) << 1)
        prepare = getattr(self._store, "prepare", None)
        if prepare is not None:
            # Copy-on-write storages make every row this step touches writable
            # first: running out of space then fails before anything changed.
            writes = {name: where for name in self._plain}
            if self._frames is not None:
                writes.update(self._frames.rows_touched(m, where))
            prepare(writes)
        for name in self._plain:
            self._store.write(name, where, rows[name][0] if m == 1 else rows[name])
        if self._frames is not None:
            self._frames.write(rows, gids, slots, where, ends, valid)
        if leaves is None:
            leaves = np.full(m, self._max_leaf)
        else:
            leaves = to_leaves(leaves, cfg.alpha, cfg.eps, self._maxp)
            self._max_leaf = max(self._max_leaf, float(leaves.max()))
        self._gid[slots] = gids
        self._ends[slots] = ends
        self._count = g0 + m
        status = LIVE if cfg.n_step == 1 else PENDING
        if valid is not None:
            status = np.where(valid, status, DEAD).astype(np.uint8)
            leaves = np.where(valid, leaves, 0.0)
        self._status[slots] = status
        if cfg.n_step == 1:
            self._tree.set(slots, leaves)
        else:
            self._pending[slots] = leaves
            self._tree.set(slots, np.zeros(m))
            first = max(0, g0 - (cfg.n_step - 1) * cfg.num_envs)
            ready = np.empty(self._count - first, dtype=np.int64)
            r = nstep.complete(first, self._count, c, cfg.num_envs, cfg.n_step, self._ends,
                               self._gid, self._status, ready)
            if r:
                ready = ready[:r]
                self._status[ready] = LIVE
                self._tree.set(ready, self._pending[ready])
        if self._frames is not None:
            dead = self._frames.expire(self._count, self._gid, self._status)
            if dead.shape[0]:
                self._tree.set(dead, np.zeros(dead.shape[0]))

    # -- sampling --------------------------------------------------------------
    def sample(self, batch_size: int, *, beta=None, stratified: bool = True) -> Batch:
        """Draw ``batch_size`` transitions with replacement, ``P(i) = leaf_i / total``.

        Parameters
        ----------
        batch_size : int
            >= 1.
        beta : float, optional
            Overrides the schedule for this call (the schedule still advances).
        stratified : bool
            One draw in each of ``batch_size`` equal slices of the total (default),
            or every draw over the whole total.
        """
        self._check_open()
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if beta is not None:
            try:
                b = float(beta)
            except (TypeError, ValueError):
                raise InvalidTypeError(f"beta must be a number >= 0, got {beta!r}") from None
            if not (b >= 0 and b < np.inf):
                raise InvalidArgumentError(f"beta must be finite and >= 0, got {beta!r}")
        else:
            b = self._cfg_beta(self._beta_step)
        if not self._tree.sums[0] > 0:
            raise InvalidArgumentError(
                f"cannot sample: no sampleable transition (len={len(self)}; with n_step > 1 a "
                "transition becomes sampleable once its window completes or its episode ends)")
        idx, prob, w = self._tree.sample(self._rng.random(int(batch_size)), stratified=bool(stratified),
                                         beta=b, batch_norm=self._norm_batch)
        self._beta_step += 1
        return Batch(self._gather(idx), idx, w, prob, self._gid[idx])

    def _gather(self, idx: np.ndarray) -> dict:
        cfg = self.config
        read = self._store.read
        if cfg.n_step == 1:
            last = idx
            e = self._ends.take(idx)
            term, trunc, disc = _TERM.take(e), _TRUNC.take(e), self._discount1.take(e)
        else:
            slots, disc, term, trunc = nstep.nstep_view(
                self._gid[idx], cfg.capacity, cfg.num_envs, cfg.n_step, self._ends, self._gamma)
            last = slots[np.arange(idx.shape[0]), (slots >= 0).sum(axis=1) - 1]
        data = {}
        for name in self._plain:
            data[name] = read(name, last if name in self._successors else idx)
        if self._frames is not None:
            if "obs" not in cfg.next_of:
                data["obs"] = self._frames.stacks("obs_ref", idx)
            elif last is idx:
                data["obs"], data["next_obs"] = self._frames.pair(idx)
            else:
                data["obs"] = self._frames.stacks("obs_ref", idx)
                data["next_obs"] = self._frames.stacks("next_obs_ref", last)
        if cfg.n_step > 1:
            rewards = read("reward", np.where(slots >= 0, slots, idx[:, None]).ravel()).reshape(slots.shape)
            rdt = cfg.dtype("reward")
            data["reward"] = nstep.discounted_sum(rewards, slots, self._gamma).astype(
                rdt if rdt.kind == "f" else np.float32)
        data["terminated"], data["truncated"], data["discount"] = term, trunc, disc
        return data

    # -- priorities ------------------------------------------------------------
    def update_priorities(self, target, priorities) -> None:
        """Set the priorities of sampled transitions.

        Parameters
        ----------
        target : Batch or array of int
            A batch from ``sample`` (slots overwritten since are skipped) or raw slots.
        priorities : array-like (B,)
            Non-negative finite magnitudes, e.g. ``|TD error|``; numpy or torch.
            With a repeated index, the last value wins.
        """
        self._check_writable("priorities")
        if isinstance(target, Batch):
            idx, stamps, use = target.indices, target.generations, True
        else:
            idx = as_index(target)
            stamps, use = idx, False
        p = as_priorities(priorities, idx.shape[0])
        cfg = self.config
        pre = _EMPTY
        if p.shape[0] > 4096:  # numpy's pow is vectorized; the kernel's is a scalar call per row
            with np.errstate(invalid="ignore"):
                pre = np.power(np.minimum(p, self._maxp) + cfg.eps, cfg.alpha)
        t = self._tree
        code, pos, top = K.update_kernel(t.sums, t.mins, t.offsets, t.sizes, idx, p, pre, stamps, use,
                                         self._gid, self._status, self._pending, cfg.alpha, cfg.eps,
                                         self._maxp)
        if code == 1:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[pos]} at position {pos}")
        if code:
            why = "out of range [0, capacity)" if code == 2 else "a slot never written"
            raise InvalidIndexError(f"indices[{pos}] = {idx[pos]} is {why} (capacity={self.capacity}, "
                             f"len={len(self)})")
        if top > self._max_leaf:
            self._max_leaf = top

    # -- lifecycle -------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise InvalidArgumentError("this buffer is closed")

    def _check_writable(self, what: str = "data"):
        self._check_open()
        store = self._store
        if store.read_only and not (what == "priorities" and getattr(store, "priorities_writable", False)):
            where = getattr(store, "path", None) or getattr(store, "file_path", "")
            raise InvalidArgumentError(f"this buffer is read-only ({what}): opened read_only at {where}")

    def close(self) -> None:
        """Flush and release the storage; reopening a disk path resumes."""
        if not self._closed:
            self._store.close(None if self._store.read_only else self.state_dict())
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"PrioritizedReplayBuffer(len={len(self)}, capacity={self.capacity}, "
                f"storage={self.config.storage!r}, total_priority={self.total_priority:.6g})")
