"""PrioritizedReplayBuffer: the ring, add/extend/sample/update."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Mapping

import numpy as np

from ._ingest import MAX_BATCH, Ingest, as_index, as_priorities, check_batch_size
from ._opening import held, open_path
from ._protocol import BufferProtocol
from ._reader import Reader
from ._statecheck import check_state
from ._writer import Writer
from .batch import Batch
from .config import LAYOUT_KEYS, Config
from .errors import (
    BufferClosedError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    ReadOnlyBufferError,
)
from .frames import FrameStore
from .prioritization import make as make_prioritization
from .prefetch import Prefetcher

log = logging.getLogger("bigper")

# Buffers still open at interpreter exit are closed cleanly (state recorded),
# so a script that ends without close() leaves a folder that resumes.
_OPEN: "weakref.WeakSet[PrioritizedReplayBuffer]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for buf in list(_OPEN):
        try:
            buf.close()
        except Exception as e:  # noqa: BLE001 (exit must go on; say what was lost)
            log.warning("bigper: could not close %r at exit: %s", buf, e)


class PrioritizedReplayBuffer(BufferProtocol):
    """A prioritized replay buffer (proportional or rank-based PER) over any storage.

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
        A leaf holds ``(min(p, max_priority) + eps) ** alpha`` (proportional);
        rank ranks by ``min(p, max_priority)`` and draws rank ``r`` in
        proportion to ``r ** -alpha``.
    beta : float or schedule
        IS exponent; a schedule is advanced once per ``sample`` call.
    weight_norm : {"global", "batch"}
        Divide weights by the largest possible weight, or by the batch's largest.
    prioritization : {"proportional", "rank"}
        How priorities become probabilities (``bigper.prioritization``).
    storage : {"memory", "memmap", "hdf5"}
    path : str or Path, optional
        Where disk storages live.
    mode : {"new", "resume", "overwrite"}
        For a ``path`` that already holds a buffer: refuse (``PathExistsError``),
        continue it, or replace it (only what bigper proves it created).
    read_only : bool
        Open an existing disk buffer to sample from it without writing.
    storage_options : dict, optional
        Passed to the storage (e.g. HDF5 compression).
    next_of : tuple[str], optional
        Fields that get a successor ``next_<name>``; default ``("obs",)`` where there is one.
    num_envs : int
        With more than one, ``add`` takes a leading env axis and each env is its own stream.
    seed : int, optional
        Seed of the one ``numpy.random.Generator`` that draws every uniform.
    """

    def __init__(self, capacity, fields, *, frame_stack=None, n_step=1, gamma=0.99, alpha=0.6,
                 eps=1e-6, max_priority=None, beta=0.4, weight_norm="global",
                 prioritization="proportional", storage="memory", path=None, mode="new",
                 next_of=None, num_envs=1, seed=0, read_only=False, storage_options=None):
        cfg = Config.build(capacity=capacity, fields=fields, frame_stack=frame_stack,
                           n_step=n_step, gamma=gamma, alpha=alpha, eps=eps,
                           max_priority=max_priority, beta=beta, weight_norm=weight_norm,
                           next_of=next_of, num_envs=num_envs, seed=seed, storage=storage,
                           prioritization=prioritization)
        if cfg.n_step > 1 and cfg.fields.get("reward", ((None,),))[0] != ():
            raise InvalidArgumentError("n_step > 1 needs a scalar 'reward' field to sum, "
                                       f"got fields {sorted(cfg.fields)}")
        if cfg.storage == "memory" and (path is not None or read_only):
            raise InvalidArgumentError(f"storage='memory' takes no path or read_only, got path={path!r}")
        store, recorded = open_path(cfg, path, mode, read_only, storage_options)
        self.resumed = None
        state = None
        try:
            if recorded is not None:
                old = Config.from_dict(recorded["config"])
                diff = cfg.differences(old, ignore=(), only=LAYOUT_KEYS)
                if diff:
                    raise IncompatibleSnapshotError(
                        f"{path} holds a buffer of another layout; differing key(s): " + "; ".join(diff)
                        + " (the stored data depends on these; use another path or mode='overwrite')")
                # Checked before the storage is attached (and marked in use), so a
                # refused state leaves the directory as it was.
                state = store.saved_state()
                check_state(cfg, *state)
                self.resumed = held(recorded)
            self._setup(cfg, store)
            if state is not None:
                self._restore(*state, reseed=cfg.seed != old.seed)
        except BaseException:
            self._closed = True
            _OPEN.discard(self)
            # Release without recording anything: a refused path stays as it was.
            abort = getattr(store, "abort", None)
            abort() if abort is not None else store.close()
            raise
        if recorded is not None:
            changed = cfg.differences(old, ignore=LAYOUT_KEYS)
            log.info("bigper: resumed %s with %d transitions%s", path, self.resumed,
                     "; new values for " + "; ".join(changed) if changed else "")

    @classmethod
    def from_parts(cls, config: Config, store, state=None) -> "PrioritizedReplayBuffer":
        """A buffer over an opened, allocated-on-demand ``store`` (for snapshot
        loads and offline datasets); ``state``: ``(meta, arrays)`` as
        ``state_dict`` gives them, checked before use."""
        buf = cls.__new__(cls)
        buf.resumed = None
        buf._setup(config, store)
        if state is not None:
            buf._restore(*state)
        return buf

    @classmethod
    def storage_specs(cls, config: Config) -> dict:
        """``name -> (rows, shape, dtype)`` of every array a buffer of ``config``
        keeps in its storage (for snapshot loads that check sizes before
        allocating anything)."""
        frames = FrameStore(config, None) if config.frame_stack else None
        framed = ("obs", "next_obs") if frames is not None else ()
        plain = {n: v for n, v in Ingest(config).stored.items() if n not in framed}
        return cls._specs(config, plain, frames)

    @staticmethod
    def _specs(cfg: Config, plain: dict, frames) -> dict:
        specs = {name: (cfg.capacity, shape, dtype) for name, (shape, dtype) in plain.items()}
        if frames is not None:
            specs.update(frames.specs())
        return specs

    # -- construction ----------------------------------------------------------
    def _setup(self, cfg: Config, store) -> None:
        self.config = cfg
        self._closed = True  # until the storage is allocated
        self._cfg_beta = cfg.schedule
        self._maxp = np.inf if cfg.max_priority is None else cfg.max_priority
        c = cfg.capacity
        self._ingest = Ingest(cfg)
        self._store = store
        self._frames = FrameStore(cfg, store) if cfg.frame_stack else None
        # Fields stored row by row; with frame stacks, obs and next_obs go to the frame ring.
        framed = ("obs", "next_obs") if self._frames is not None else ()
        self._plain = {n: v for n, v in self._ingest.stored.items() if n not in framed}
        store.allocate(self._specs(cfg, self._plain, self._frames))
        self._prio = make_prioritization(cfg.prioritization, c, alpha=cfg.alpha, eps=cfg.eps,
                                         max_priority=self._maxp, weight_norm=cfg.weight_norm)
        self._gid = np.full(c, -1, dtype=np.int64)
        self._status = np.zeros(c, dtype=np.uint8)
        self._ends = np.zeros(c, dtype=np.uint8)
        self._pending = np.zeros(c if cfg.n_step > 1 else 0, dtype=np.float64)
        self._reader = Reader(cfg, store, self._frames, self._plain, self._ingest.stored, self._ends, self._gid)
        # The writer keeps the ring's counters: transitions added, largest key, envs whose episode ended.
        self._writer = Writer(cfg, store, self._frames, self._plain, self._prio, self._gid, self._status,
                              self._ends, self._pending)
        self._beta_step = 0
        self._rng = np.random.default_rng(cfg.seed)
        # Serializes every call that reads or changes state with the prefetching
        # samplers' threads (re-entrant: save and sample_at call back in).
        self._lock = threading.RLock()
        self._samplers: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()
        self._closed = False
        _OPEN.add(self)

    # The ring's counters live in the writer (the write path's room).
    _count = property(lambda self: self._writer.count, lambda self, v: setattr(self._writer, "count", v))
    _max_leaf = property(lambda self: self._writer.max_leaf,
                         lambda self, v: setattr(self._writer, "max_leaf", v))
    _env_ended = property(lambda self: self._writer.env_ended,
                          lambda self, v: setattr(self._writer, "env_ended", v))

    @property
    def _fused(self) -> bool:
        """False: every call takes the general path (staged storage writes, one
        numpy call a step); tests/test_fused.py hold the fused paths to it, bit for bit."""
        return self._writer.fused

    @_fused.setter
    def _fused(self, on: bool) -> None:
        self._writer.fused = bool(on)

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
        return self._prio.total

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
        with self._lock:
            self._writer.write(rows, leaves, valid)

    def extend(self, data, priorities=None, valid=None) -> None:
        """Add many steps: every value has a leading time axis (then the env
        axis when ``num_envs > 1``); ``priorities`` and ``valid`` match those axes."""
        self._check_writable()
        rows, leaves, valid = self._ingest.steps(data, priorities, valid)
        with self._lock:
            self._writer.write(rows, leaves, valid)

    # -- sampling --------------------------------------------------------------
    def sample(self, batch_size: int, *, beta=None, stratified: bool = True, out=None) -> Batch:
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
        out : dict[str, np.ndarray], optional
            Arrays to gather into, for any of the batch's fields (each of the
            shape and dtype ``sample`` gives it, C-contiguous): frames and
            fields are gathered straight into them (say, numpy views of pinned
            host tensors, so ``to_torch`` needs no second copy), and the batch
            holds them. The caller must not reuse one while a batch holds it.
        """
        self._check_open()
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            check_batch_size(batch_size)  # raises, or passes a numpy integer
        if out is not None:
            out = self._reader.check_out(out, int(batch_size))
        if beta is not None:
            try:
                b = float(beta)
            except (TypeError, ValueError):
                raise InvalidTypeError(f"beta must be a number >= 0, got {beta!r}") from None
            if not (b >= 0 and b < np.inf):
                raise InvalidArgumentError(f"beta must be finite and >= 0, got {beta!r}")
        with self._lock:
            self._check_open()
            if beta is None:  # read under the lock: a sampler thread advances the schedule too
                b = self._cfg_beta(self._beta_step)
            if not self._prio.sampleable:
                raise InvalidArgumentError(
                    f"cannot sample: no sampleable transition (len={len(self)}; with n_step > 1 a "
                    "transition becomes sampleable once its window completes or its episode ends)")
            idx, prob, w = self._prio.sample(self._rng.random(int(batch_size)),
                                             stratified=bool(stratified), beta=b)
            self._beta_step += 1
            return self._reader.batch(idx, w, prob, out, self._writer.fused)

    def sampler(self, batch_size: int, prefetch: int = 2, device=None, **sample_kw):
        """An endless iterator of batches, the next ones prepared in a background thread.

        Parameters
        ----------
        batch_size : int
            As for ``sample``.
        prefetch : int
            Batches kept ready ahead of the learner (0: no thread, each batch
            drawn when asked for).
        device : str or torch.device, optional
            When given, items are ``Batch.to_torch(device)`` dicts (on CUDA
            through pinned memory, non-blocking), which ``update_priorities``
            takes; else ``Batch`` objects.
        **sample_kw
            ``beta`` and ``stratified``, passed to every ``sample`` call.

        Every draw is an ordinary ``sample`` call made under the buffer's lock,
        so adds, priority updates and snapshots interleave with the thread's
        draws, never inside one. A batch drawn before a priority update was
        applied reflects the priorities of its draw time (as a ``sample`` call
        made then would); updating a prefetched batch later skips the slots
        overwritten since its draw, as for any batch. ``close()`` (also on the
        buffer's ``close``, and when the iterator is collected) stops the
        thread and drops the batches it prepared; they were drawn, so the
        random stream and the beta schedule are past them.
        """
        self._check_open()
        check_batch_size(batch_size)
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or not 0 <= prefetch <= 1024:
            raise InvalidArgumentError(f"prefetch must be an int in [0, 1024], got {prefetch!r}")
        unknown = sorted(set(sample_kw) - {"beta", "stratified"})
        if unknown:
            raise InvalidArgumentError(f"sampler passes only beta and stratified to sample, got {unknown}")
        size = int(batch_size)

        def produce():
            batch = self.sample(size, **sample_kw)
            return batch if device is None else batch.to_torch(device)

        if prefetch == 0:
            return (produce() for _ in iter(int, 1))
        it = Prefetcher(produce, int(prefetch), self._lock)
        self._samplers.add(it)
        return it

    def _gather(self, idx: np.ndarray) -> dict:
        return self._reader.gather(idx, None, None, self._fused)

    # -- priorities ------------------------------------------------------------
    def update_priorities(self, target, priorities) -> None:
        """Set the priorities of sampled transitions.

        Parameters
        ----------
        target : Batch, mapping with ``"indices"``, or array of int
            A batch from ``sample`` or the dict ``Batch.to_torch`` gives (slots
            overwritten since sampling are skipped), or raw slots.
        priorities : array-like (B,)
            Non-negative finite magnitudes, e.g. ``|TD error|``; numpy or torch.
            With a repeated index, the last value wins.
        """
        self._check_writable("priorities")
        if isinstance(target, Batch):
            idx, stamps, use = target.indices, target.generations, True
        elif isinstance(target, Mapping):
            if "indices" not in target:
                raise InvalidTypeError("target is a mapping without 'indices'; pass a Batch, the dict "
                                       f"Batch.to_torch() gives, or an index array (keys: {sorted(target)[:8]})")
            idx = as_index(target["indices"])
            gens = target.get("generations")
            stamps, use = (idx, False) if gens is None else (as_index(gens), True)
            if use and stamps.shape != idx.shape:
                raise InvalidArgumentError(f"target['generations'] has shape {stamps.shape}, "
                                           f"expected {idx.shape} like target['indices']")
        else:
            idx = as_index(target)
            stamps, use = idx, False
        p = as_priorities(priorities, idx.shape[0])
        with self._lock:
            self._check_open()
            top = self._prio.update(idx, p, stamps, use, self._gid, self._status, self._pending)
            if top > self._max_leaf:
                self._max_leaf = top

    # -- lifecycle -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._closed

    def _check_open(self):
        if self._closed:
            raise BufferClosedError("this buffer is closed")

    def _check_writable(self, what: str = "data"):
        self._check_open()
        store = self._store
        if store.read_only and not (what == "priorities" and getattr(store, "priorities_writable", False)):
            where = getattr(store, "path", None) or getattr(store, "file_path", "")
            raise ReadOnlyBufferError(f"this buffer is read-only ({what}): opened read_only at {where}")

    def close(self) -> None:
        """Flush, record the state and release the storage; reopening a disk
        path with ``mode="resume"`` continues. Idempotent."""
        if getattr(self, "_closed", True):
            return
        # Samplers first, outside the lock: their threads may be waiting for it.
        for s in list(getattr(self, "_samplers", ())):
            s.close()
        with self._lock:
            if not self._closed:
                self._closed = True
                _OPEN.discard(self)
                self._store.close(None if self._store.read_only else self.state_dict())

    def __del__(self):
        # A buffer dropped without close() (a notebook cell, an exception)
        # records its state and releases its lock when it is collected.
        try:
            self.close()
        except Exception:  # noqa: BLE001 (nothing to raise to in a finalizer)
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"PrioritizedReplayBuffer(len={len(self)}, capacity={self.capacity}, "
                f"storage={self.config.storage!r}, total_priority={self.total_priority:.6g})")
