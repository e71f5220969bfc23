"""PrioritizedReplayBuffer: the ring, add/extend/sample/update, and its entry
points to snapshots and offline datasets.

Every public method is an *entry point*: it runs under the buffer's one
re-entrant lock and, unless it is marked otherwise below, refuses a closed
buffer inside it (``core.lifecycle.entry_point``). Nothing reads or changes the buffer's state
outside that lock, so two threads calling any two methods are serialized,
and a write never lands on a buffer another thread closed.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from . import snapshot as _snapshot
from .core.lifecycle import Guard, entry_point, entry_point_as, reader, run_first_at_exit
from .core.ingest import MAX_BATCH, Ingest, as_index, as_priorities, check_batch_size, update_target
from .core.layout import check_field_names, check_storage, for_disk, held_frames, plain_fields, storage_specs
from .core.opening import check_arguments, open_buffer
from .core.parts import Draws, Parts
from .core.reader import Reader
from .core.statecheck import check_state
from .core.writer import Writer
from .tensors.jax import check_deferred, host_values, is_jax_array, on_host
from .tensors.transport import Transport
from .tensors.lazy import as_device, is_device_tensor
from .batch import Batch
from .config import LAYOUT_KEYS, Config
from .config import Sequence as ReplaySequence  # (typing's Sequence is used here too)
from .errors import (
    BigperError,
    BufferClosedError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidIndexError,
    InvalidTypeError,
    ReadOnlyBufferError,
)
from .frames.store import FrameStore
from .device.deferred import Deferred
from .core.prefetch import Direct, Prefetcher
from .core.ring import Ring
from .prioritization import make as make_prioritization
from .prioritization.base import LIVE, Prioritization
from .common.files import real_names
from .schedules import ConstantSchedule, LinearSchedule, as_beta
from .storage.base import Storage, StorageBase
from .core.shardview import ShardView
from .core.units import apply_update, unit_for

log: logging.Logger = logging.getLogger("bigper")

def _sample_in(ref, size: int, device, sample_kw: dict):
    """One batch of the buffer behind the weak reference ``ref`` (a sampler
    thread holds no strong reference between draws, so dropping the buffer
    closes it at once)."""
    buf = ref()
    if buf is None:
        raise BufferClosedError("the buffer of this sampler was dropped")
    batch = buf._sample_for(size, device, sample_kw)
    del buf
    if device is None:
        return batch
    from .tensors.streams import mark_ready

    return mark_ready(batch.to_torch(device))


class PrioritizedReplayBuffer:
    """A prioritized replay buffer (proportional or rank-based PER) over any storage.

    Parameters
    ----------
    capacity : int
        Transitions held, across all envs (>= 1).
    fields : dict[str, tuple[shape, dtype]]
        Per-step data. ``"obs"`` is a stack of frames on axis 0 when
        ``frame_stack`` is set. A name bigper keeps for its own arrays or
        keys (``frames``, ``obs_ref``, ``weights``, ...:
        ``bigper.core.layout.own_names()``) is refused with the list.
    frame_stack : int, optional
        Store each frame of ``"obs"`` once and rebuild stacks at sample time.
    n_step, gamma : int, float
        n-step returns computed at sample time.
    alpha, eps, max_priority : float
        A leaf holds ``(min(p, max_priority) + eps) ** alpha`` (proportional);
        rank ranks by ``min(p, max_priority)`` and draws rank ``r`` in
        proportion to ``r ** -alpha``.
    beta : float or schedule
        IS exponent in [0, 1] (any real number type, a 0-d array or tensor:
        ``bigper.schedules.as_beta``); a schedule is advanced once per ``sample`` call.
    weight_norm : {"global", "batch"}
        Divide weights by the largest possible weight, or by the batch's largest.
    prioritization : {"proportional", "rank"}
        How priorities become probabilities (``bigper.prioritization``).
    storage : {"memory", "memmap", "hdf5"}
        Where the data lives: numpy arrays, preallocated files in a directory, or one HDF5 file.
    path : str or Path, optional
        Where disk storages live; resolved to an absolute path once, here.
    mode : {"new", "resume", "overwrite"}
        For a ``path`` that already holds a buffer: refuse (``PathExistsError``),
        continue it, or replace it (only what bigper proves it created).
    continue_episodes : bool
        With ``mode="resume"``: whether each env's episode that was open when
        the buffer was last recorded goes on with the next ``add``. Default
        False: after a crash or a restart the environment that was mid-episode
        is gone, so each open episode ends at its last recorded step as
        truncated (its n-step windows and sequence items complete with what
        they have and bootstrap there; none joins the new episode). Pass True
        only when the environments' own state was restored too.
    read_only : bool
        Open an existing disk buffer to sample from it without writing.
    storage_options : dict, optional
        The chosen storage's documented options (memmap: ``random_reads``;
        hdf5: ``compression``); any other name is refused.
    next_of : tuple[str], optional
        Fields that get a successor ``next_<name>``; default ``("obs",)`` where there is one.
    num_envs : int
        With more than one, ``add`` takes a leading env axis and each env is its own stream.
    sequence : bigper.Sequence, optional
        Items are sequences of steps (recurrent agents): ``sample`` returns
        fields ``(B, burn_in + length, ...)`` with a ``mask``, and priorities
        belong to items (``bigper.core.sequences``; README "Sequences").
    seed : int, optional
        Seed of the one ``numpy.random.Generator`` that draws every uniform.
    compression : {None, "zstd"}
        With ``frame_stack``: store each frame compressed (zstd, a dictionary
        trained on the first frames) in a log of segments that grows as the
        frames need (``capacity`` is held whatever they compress to),
        decompressed at sample time (``bigper.frames.segments``); needs the
        ``compression`` extra (in a checkout: ``pip install -e '.[compression]'``).
    compression_budget : int, optional
        A cap: bytes of log a frame, preallocated at creation (default: none,
        the log grows). Frames that compress worse than it release the oldest
        segment early, so fewer than ``capacity`` transitions stay sampleable
        (said once, with a ``RuntimeWarning``). A budget whose log could not
        keep one transition of every env of frames that do not compress is
        refused naming one that works.
    compression_dictionary : bytes or (n,) uint8 array, optional
        A zstd dictionary (e.g. ``bigper.train_dictionary(frames)``) used from
        the first frame instead of one trained on the first frames; retrained
        later only where it pays. Not part of the layout: it is stored with the
        frames, and a resumed buffer keeps the dictionaries it recorded.
    device : str or torch.device, optional
        The device tier: keep a copy of the stored data (frames once, raw also
        when compressed) in this torch device's memory, written through before
        each draw. ``sample`` then draws on the host tree and gathers on the
        device: what a loss reads in its ``Batch`` (the fields, ``weights``,
        ``mask``) is device tensors, what names the draw (``indices``,
        ``generations``, ``probabilities``) stays numpy (see ``Batch``;
        ``to_torch()`` returns a ``TensorBatch`` of tensors). The storage stays the
        copy that counts (snapshots, resume, ``verify``); a resumed or loaded
        buffer rebuilds the device copy from it. Refused at construction,
        naming the bytes, where the device cannot hold it (``bigper info``
        shows what a config takes). Not part of the layout; ``"cpu"`` runs the
        same code on CPU tensors.

    Notes
    -----
    ``update_priorities`` with priorities on a device (a CUDA tensor) returns
    without waiting for them: they are copied to pinned memory behind the
    learner's kernels and applied, in order, by the next call that reads the
    tree (``sample``, the sampler's thread, ``add``, ``save``, ``close``, a read
    of the priorities). Their shapes are checked at once; values that are not
    valid priorities are reported by that next call, which applies nothing of
    that update.

    Thread safety: every public method takes the buffer's one lock, so any
    two may be called from two threads; a method called on a closed buffer
    raises ``BufferClosedError`` (``len``, ``closed``, ``capacity``,
    ``total_priority`` and ``close`` answer on a closed buffer too).
    """

    def __init__(self, capacity: int, fields: Mapping[str, tuple[int | tuple[int, ...], npt.DTypeLike]], *,
                 frame_stack: int | None = None, n_step: int = 1, gamma: float = 0.99,
                 alpha: float = 0.6, eps: float = 1e-6, max_priority: float | None = None,
                 beta: float | LinearSchedule | ConstantSchedule = 0.4,
                 weight_norm: Literal["global", "batch"] = "global",
                 prioritization: Literal["proportional", "rank"] = "proportional",
                 storage: Literal["memory", "memmap", "hdf5"] = "memory",
                 path: str | os.PathLike[str] | None = None, mode: Literal["new", "resume", "overwrite"] = "new",
                 next_of: Sequence[str] | None = None, num_envs: int = 1, seed: int | None = 0,
                 read_only: bool = False, storage_options: Mapping[str, Any] | None = None,
                 compression: Literal["zstd"] | None = None, compression_budget: int | None = None,
                 compression_dictionary: bytes | np.ndarray | None = None,
                 sequence: ReplaySequence | None = None, device: Any = None,
                 continue_episodes: bool = False) -> None:
        cfg = Config.build(capacity=capacity, fields=fields, frame_stack=frame_stack,
                           n_step=n_step, gamma=gamma, alpha=alpha, eps=eps,
                           max_priority=max_priority, beta=beta, weight_norm=weight_norm,
                           next_of=next_of, num_envs=num_envs, seed=seed, storage=storage,
                           prioritization=prioritization, compression=compression,
                           compression_budget=compression_budget, sequence=sequence)
        dictionary = check_arguments(cfg, path, read_only, compression_dictionary)
        _check_flag(continue_episodes, "continue_episodes")
        mirror = _mirror(cfg, device)  # device memory first: a refusal makes nothing on disk
        store, frames, state, old = open_buffer(cfg, path, mode, read_only, storage_options, dictionary)
        self._start(cfg, store, frames, mirror, state, reseed=old is not None and cfg.seed != old.seed,
                    release=True)
        self.resumed: int | None = None if old is None else min(self._ring.count, cfg.capacity)
        if old is not None:
            changed = cfg.differences(old, ignore=LAYOUT_KEYS)
            log.info("bigper: resumed %s with %d transitions%s", path, self.resumed,
                     "; new values for " + "; ".join(changed) if changed else "")
            if not read_only:
                self._resume_episodes(continue_episodes)

    def _resume_episodes(self, go_on: bool) -> None:
        """After a resume or a load: end every env's open episode (truncated)
        unless the caller's environments go on with it (``continue_episodes``)."""
        if go_on:
            return
        ended = self._writer.end_episodes()
        if ended.size:
            log.info("bigper: ended the open episode of env(s) %s at the resume point (truncated); pass "
                     "continue_episodes=True when the environments were restored too", ended.tolist())

    @classmethod
    def from_parts(cls, config: Config, store: Storage,
                   state: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None,
                   device: Any = None) -> "PrioritizedReplayBuffer":
        """A buffer over ``store``, whose arrays are allocated already, for
        snapshot loads and offline datasets. On a refusal the store is left
        to the caller.

        Parameters
        ----------
        config : Config
            The buffer's layout and sampling parameters.
        store : Storage
            An open storage holding the arrays ``storage_specs(config)`` names
            (checked: a missing array, another dtype, row shape or rows, or a
            kind of bigper's own it is not, is ``InvalidArgumentError``
            naming it). A storage without ``rows``/``grow`` holds the
            compressed log whole (``storage/base.py``).
        state : tuple, optional
            ``(meta, arrays)`` as ``state_dict`` gives them, checked before use.
        device : str or torch.device, optional
            Keep a copy of the data on this torch device (the device tier), rebuilt from ``store``.

        Returns
        -------
        PrioritizedReplayBuffer
        """
        if not isinstance(store, StorageBase):
            raise InvalidTypeError(f"store must be a storage (a subclass of bigper.storage.base.StorageBase, which "
                                   f"gives the optional calls their defaults), got {type(store).__name__}")
        check_field_names(config)
        buf = cls.__new__(cls)
        try:  # the frame layout it holds: the config's, or wider (an older format's, converted or kept)
            frames = FrameStore(config, store, **held_frames(store)) if config.frame_stack else None
        except IncompatibleSnapshotError as e:
            raise InvalidArgumentError(f"store: {e}") from None
        check_storage(store, config, frames)  # its arrays are the ones this buffer keeps, or refused by name
        if frames is not None:
            frames.attach()
        buf._start(config, store, frames, _mirror(config, device), state)
        return buf

    @classmethod
    def storage_specs(cls, config: Config) -> dict[str, Any]:
        """``name -> (rows, shape, dtype)`` of every array a buffer of ``config``
        keeps in its storage.

        Parameters
        ----------
        config : Config
            The buffer's layout.

        Returns
        -------
        dict
        """
        return storage_specs(config)

    # -- construction ----------------------------------------------------------
    def _start(self, cfg: Config, store, frames, mirror, state, reseed: bool = False, release: bool = False) -> None:
        """Build the parts over an allocated ``store`` and take ``state``; on a
        refusal the buffer is closed and, with ``release``, the storage let go
        without recording anything (else it is the caller's)."""
        self._guard = Guard(Deferred(), None)  # (closed until the parts are built)
        self.resumed = None
        try:
            self._setup(cfg, store, frames, mirror)
            if state is not None:
                self._restore(*state, reseed=reseed)
        except BaseException as e:
            real_names(e)
            self._forget()
            if release:
                store.abort()  # recording nothing: a refused path stays as it was
            raise

    def _setup(self, cfg: Config, store, frames, mirror=None) -> None:
        self.config = cfg
        self._maxp = np.inf if cfg.max_priority is None else cfg.max_priority
        c = cfg.capacity
        self._ingest = Ingest(cfg)
        self._store = store
        self._frames = frames
        self._plain = plain_fields(cfg)
        self._prio = make_prioritization(cfg.prioritization, c, alpha=cfg.alpha, eps=cfg.eps,
                                         max_priority=self._maxp, weight_norm=cfg.weight_norm)
        # The slots' bookkeeping and counters (core/ring.py); its arrays are changed in place, never replaced.
        self._ring = ring = Ring(c, cfg.num_envs, cfg.n_step)
        # What a leaf stands for (a transition, a sequence item): everything that depends on it.
        self._unit = unit_for(cfg, ring)
        self._reader = Reader(cfg, store, self._frames, self._plain, self._ingest.stored, ring.ends, ring.gid)
        self._writer = Writer(cfg, store, self._frames, self._plain, self._prio, ring, self._unit)
        self._mirror = mirror
        # A priority update applied to the unit, the prioritization and the ring (also by the guard, for
        # the updates from device tensors it settles).
        self._update = self._guard.apply = functools.partial(apply_update, self._unit, self._prio, ring)
        self._draws = draws = Draws(cfg.schedule, cfg.seed)  # the random stream and the beta schedule
        # Its parts, for what draws from it without being it (its feed, its shard view).
        self._parts = Parts(config=cfg, guard=self._guard, store=store, frames=frames, plain=self._plain,
                            stored=self._ingest.stored, prio=self._prio, ring=ring, unit=self._unit,
                            reader=self._reader, mirror=mirror, draws=draws)
        self._guard.opened(self.close, shares_files=not store.in_memory)
        if store.close_first_at_exit:
            run_first_at_exit()

    def _forget(self) -> None:
        """Mark a buffer whose construction failed closed, so that nothing
        (its finalizer, the exit handler) records state into its storage."""
        self._guard.forget()

    @property
    def _fused(self) -> bool:
        """False: every call takes the general path (staged storage writes, one
        numpy call a step); tests/core/test_fused.py hold the fused paths to it, bit for bit."""
        return self._writer.fused

    @_fused.setter
    def _fused(self, on: bool) -> None:
        self._writer.fused = self._reader.fused = self._unit.fused = bool(on)

    # -- sizes (these answer on a closed buffer too) -----------------------------
    @property
    def capacity(self) -> int:
        """Transitions held at most, across all envs."""
        return self.config.capacity

    @reader
    def __len__(self) -> int:
        """Transitions held (sampleable or waiting for their n-step window)."""
        return len(self._parts)

    @property
    @reader
    def total_priority(self) -> float:
        """Sum of all leaves: ``P(i) = leaf_i / total_priority``."""
        return self._prio.total

    @property
    def device(self) -> Any:
        """The ``torch.device`` of the device tier (``device=``), or None without one."""
        mirror = getattr(self, "_mirror", None)
        return None if mirror is None else mirror.device

    @property
    @reader
    def beta(self) -> float:
        """The beta the next ``sample`` call will use."""
        return self._draws.beta()

    # -- writing ---------------------------------------------------------------
    @entry_point
    def add(self, *, priorities: npt.ArrayLike | None = None, valid: npt.ArrayLike | None = None,
            **step: npt.ArrayLike) -> None:
        """Add one env step (with ``num_envs > 1``: one step of every env).

        Takes every field, ``next_<name>`` for the fields in ``next_of``, and
        optionally ``terminated`` and ``truncated`` (default False). Values
        have the field's shape, with a leading env axis when ``num_envs > 1``,
        and are stored exactly or refused (``InvalidArgumentError``).

        Parameters
        ----------
        priorities : float or array-like (num_envs,), optional
            Priorities of the new transitions; default: the largest leaf so far.
        valid : bool or array-like of bool (num_envs,), optional
            Marks envs whose step is not a transition: with Gymnasium's
            next-step autoreset, the step right after an episode end only
            resets the env. Such a row keeps its env's stream aligned but is
            never sampled; it is accepted only right after an episode end of
            that env (or before its first step).
        **step
            The step's values by name: every field, ``next_<name>``,
            ``terminated`` and ``truncated``.
        """
        self._check_writable()
        rows, leaves, valid = self._ingest.step(step, priorities, valid)
        self._writer.write(rows, leaves, valid)

    @entry_point
    def extend(self, data: Mapping[str, npt.ArrayLike], priorities: npt.ArrayLike | None = None,
               valid: npt.ArrayLike | None = None) -> None:
        """Add many steps at once, as many ``add`` calls would.

        Parameters
        ----------
        data : mapping of str to array-like
            The values ``add`` takes, each with a leading time axis (then the
            env axis when ``num_envs > 1``).
        priorities : array-like, optional
            Matches those axes; default: the largest leaf so far.
        valid : array-like of bool, optional
            Matches those axes; see ``add``.
        """
        self._check_writable()
        rows, leaves, valid = self._ingest.steps(data, priorities, valid)
        self._writer.write(rows, leaves, valid)

    # -- sampling --------------------------------------------------------------
    @entry_point
    def sample(self, batch_size: int, *, beta: float | None = None, stratified: bool = True,
               out: Mapping[str, np.ndarray] | None = None) -> Batch:
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
            shape and dtype ``sample`` gives it, C-contiguous, sharing no
            memory with each other or with the buffer): frames and fields are
            gathered straight into them (say, numpy views of pinned host
            tensors, so ``to_torch`` needs no second copy), and the batch
            holds them. The caller must not reuse one while a batch holds it.
            Where a read can fail (an HDF5 file, a dataset read with pread),
            the batch is gathered first and copied into them once every read
            succeeded: a failed sample leaves them as they were.

        Returns
        -------
        Batch
            Numpy arrays; with a device tier (``device=``), the fields,
            ``weights`` and ``mask`` are tensors on that device and
            ``indices``, ``generations`` and ``probabilities`` stay numpy.
        """
        return self._draw(batch_size, beta, stratified, out, True)

    @entry_point_as(draw=True)
    def _sample_for(self, batch_size: int, device, sample_kw: dict) -> Batch:
        """``sample`` for a sampler: a batch bound for a CUDA device leaves the
        stacks of a sequence batch to be rebuilt there from its distinct frames."""
        cuda = device is not None and str(device).split(":")[0] in _STAGED
        beta, stratified = sample_kw.get("beta"), sample_kw.get("stratified", True)
        if not cuda or self._mirror is not None:
            return self._draw(batch_size, beta, stratified, None, True)
        if not self._unit.staged:  # the stacks rebuilt on the device from each row's distinct frames
            return self._draw(batch_size, beta, stratified, None, False)
        from .tensors.pinned import Staged
        from .tensors.lazy import load_torch

        torch = load_torch()
        staged = Staged(torch, torch.device(device), self._reader.staging_specs(int(batch_size)))
        try:
            out = {k: v for k, v in staged.views.items() if k not in ("weights", "indices", "generations")}
            batch = self._draw(batch_size, beta, stratified, None, True, into=out)
            for key in ("weights", "indices", "generations"):
                np.copyto(staged.views[key], getattr(batch, key), casting="same_kind")
        except BaseException:
            staged.drop()
            raise
        return batch.carrying(Transport(staged=staged))  # to_torch sends the block as it is

    def _draw(self, batch_size, beta, stratified, out, stacks: bool, into: dict | None = None) -> Batch:
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            check_batch_size(batch_size)  # raises, or passes a numpy integer
        if out is not None:
            if self._mirror is not None:
                raise InvalidArgumentError("sample(out=...) gathers into host arrays; this buffer has a device "
                                           f"tier (device={str(self._mirror.device)!r}) and gathers there")
            out = self._unit.check_out(self._reader, out, int(batch_size))
            self._check_not_mine(out)
        b = self._draws.beta() if beta is None else as_beta(beta)
        if not self._prio.sampleable:
            raise InvalidArgumentError(self._unit.unsampleable(len(self)))
        draws = self._draws
        # A draw whose gather fails (an I/O error, a device's) is undone: the next draw is this
        # one's. Saving the RNG's state costs 0.6 us, so only where a read can fail.
        undo = getattr(self._store, "reads_may_fail", True) or self._mirror is not None
        before = draws.rng.bit_generator.state if undo else None
        try:
            idx, prob, w = self._prio.sample(draws.rng.random(int(batch_size)),
                                             stratified=bool(stratified), beta=b)
            if self._mirror is not None:
                batch = self._device_batch(idx, w, prob)
            elif out and undo:  # the caller's arrays written once every read succeeded (promise 16)
                batch = self._unit.batch(self._reader, idx, w, prob, None, stacks)
                for name, arr in out.items():
                    np.copyto(arr, batch.data[name])
                    batch.data[name] = arr
            else:
                batch = self._unit.batch(self._reader, idx, w, prob, into if into is not None else out, stacks)
        except BaseException:
            if before is not None:
                draws.rng.bit_generator.state = before
            raise
        draws.step += 1
        return batch

    def _device_batch(self, idx: np.ndarray, w: np.ndarray, prob: np.ndarray) -> Batch:
        """The batch at ``idx`` gathered on the device tier: the host computes
        the small values and frame ids, the device gathers the data."""
        self._mirror.sync(self._store, self._frames, self._ring.count)
        return self._unit.device_batch(self._reader, self._mirror, idx, w, prob)

    def _check_not_mine(self, out: dict) -> None:
        """Refuse ``out`` arrays that share memory with anything the buffer
        owns (its storage's arrays, its state, its tree): gathering into one
        would overwrite stored data."""
        owned = [a for a in self.state_dict()[1].values() if isinstance(a, np.ndarray)]
        for holder in (self._prio, self._prio.tree, self._writer, self._reader):
            owned += [v for v in vars(holder).values() if isinstance(v, np.ndarray)] if holder is not None else []
        for arrays in (self._store.arrays, self._store.writable_arrays):
            owned += [v for v in (arrays or {}).values() if isinstance(v, np.ndarray)]
        for name, arr in out.items():
            if any(np.may_share_memory(arr, a) for a in owned):
                raise InvalidArgumentError(f"out[{name!r}] shares memory with the buffer's own arrays "
                                           "(its storage, state or tree); pass arrays of your own")

    @entry_point
    def sampler(self, batch_size: int, prefetch: int = 2, device: Any = None,
                **sample_kw: Any) -> Iterator[Any]:
        """An endless iterator of batches, the next ones prepared in a background thread.

        Parameters
        ----------
        batch_size : int
            As for ``sample``.
        prefetch : int
            Batches kept ready ahead of the learner (0: no thread, each batch
            drawn when asked for; the iterator behaves the same either way).
        device : str or torch.device, optional
            When given, items are ``Batch.to_torch(device)`` dicts (on CUDA
            through pinned memory, non-blocking), which ``update_priorities``
            takes; else ``Batch`` objects.
        **sample_kw
            ``beta`` and ``stratified``, passed to every ``sample`` call.

        Returns
        -------
        iterator
            Of ``Batch`` objects, or of ``to_torch`` dicts when ``device`` is given.

        Notes
        -----
        With a ``device``, transitions with ``n_step=1``, proportional
        priorities and frames raw, compressed (not with a device tier) or none,
        in memory, memmap or a device tier are served by the **feed** (``bigper/device/feed.py``, the GPU guide):
        one compiled draw under the lock, one compiled gather without the
        lock or the GIL, into a few reused slots; each batch gets tensors and a
        dict of its own over a slot's bytes, filled again only once nothing of
        them is held, so a batch you keep never changes; a draw there
        applies the device priority updates whose copies arrived, waiting for
        none. Its batches equal ``sample(B).to_torch(device)`` draw for draw.

        Every draw is an ordinary ``sample`` call made under the buffer's lock,
        so adds, priority updates and snapshots interleave with the thread's
        draws, never inside one. A batch drawn before a priority update was
        applied reflects the priorities of its draw time (as a ``sample`` call
        made then would); updating a prefetched batch later skips the slots
        overwritten since its draw, as for any batch. ``close()`` (also on the
        buffer's ``close``, and when the iterator is collected) stops the
        thread and drops the batches it prepared; they were drawn, so the
        random stream and the beta schedule are past them. Iterating on
        after the buffer's ``close`` (another thread's, say) raises
        ``BufferClosedError`` at every ``next()``, whatever ``prefetch``,
        never a silent ``StopIteration`` that would end a learner's loop as if
        the data had run out. Any other error of a draw (an empty buffer) is
        raised once, and ends the iterator; make a new one. ``beta`` is
        checked when the sampler is made (``bigper.schedules.as_beta``). The thread
        holds the buffer only during a draw: a buffer dropped with its
        sampler is closed (its lock released) when the last of them is collected.
        """
        check_batch_size(batch_size)
        if device is not None:
            device = as_device(device)  # (a bad one refused here, not in the thread)
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or not 0 <= prefetch <= 1024:
            raise InvalidArgumentError(f"prefetch must be an int in [0, 1024], got {prefetch!r}")
        unknown = sorted(set(sample_kw) - {"beta", "stratified"})
        if unknown:
            raise InvalidArgumentError(f"sampler passes only beta and stratified to sample, got {unknown}")
        if sample_kw.get("beta") is not None:  # refused here, not at a draw; a tensor read once
            sample_kw["beta"] = as_beta(sample_kw["beta"])
        if device is not None:
            from .device import feed, native

            if feed.covered(self._parts, device) is None:  # the GIL-free feed (device/feed.py, device/native.py)
                it = native.feed_sampler(self._parts, int(batch_size), device, int(prefetch),
                                         sample_kw.get("beta"), sample_kw.get("stratified", True))
                self._guard.samplers.add(it)
                return it
        produce = functools.partial(_sample_in, weakref.ref(self), int(batch_size), device, dict(sample_kw))
        if prefetch == 0:
            it = Direct(produce)
        else:
            handover = None
            if device is not None and device.type == "cuda":
                from .tensors.streams import handover
            it = Prefetcher(produce, int(prefetch), self._guard.lock, prepare=self._guard.deferred.wait,
                            finish=handover)
        self._guard.samplers.add(it)
        return it

    # -- priorities ------------------------------------------------------------
    @entry_point_as(settle=False)
    def update_priorities(self, target: Batch | Mapping[str, Any] | npt.ArrayLike,
                          priorities: npt.ArrayLike) -> None:
        """Set the priorities of sampled transitions.

        Parameters
        ----------
        target : Batch, mapping with ``"indices"``, or array of int
            A batch from ``sample`` or the dict ``Batch.to_torch`` gives (slots
            overwritten since sampling are skipped), or raw slots. A
            ``to_torch`` dict is read from the host copies of its indices,
            generations and mask made with it (no tensor is read back from a
            device), as long as it holds the tensors it was made with: a
            change made in place to ``tensors["indices"]`` (or
            ``"generations"``) is ignored. To target other slots, put a new
            tensor under the key (the dict is then read as it is) or pass
            the indices themselves.
        priorities : array-like (B,)
            Non-negative finite magnitudes, e.g. ``|TD error|``; numpy, torch
            or ``jax.Array``. With a repeated index, the last value wins. With
            ``sequence=...`` also per-step errors ``(B, T)`` or ``(B, length)``
            for a batch target, reduced per item with ``eta * max + (1 - eta)
            * mean`` over the real steps after the burn-in
            (``sequences.reduce_errors``). Values on an accelerator (a CUDA
            tensor, a ``jax.Array`` on a GPU or TPU) are copied to the host
            without blocking the learner and applied by the next call that
            needs the tree; a check that needs the values (NaN, negative)
            then fails that call, and the update changes nothing. A
            ``jax.Array`` on JAX's CPU device is read in place (no copy, once
            its computation is done); bfloat16 and other dtypes numpy has no
            arithmetic for are read as float32.
        """
        self._check_writable("priorities")
        idx, stamps, use_stamps, mask = update_target(target)
        if is_jax_array(priorities):
            if not on_host(priorities):
                self._defer(idx, stamps, use_stamps, mask, priorities)
                return
            priorities = host_values(priorities)
        elif is_device_tensor(priorities):
            self._defer(idx, stamps, use_stamps, mask, priorities)
            return
        if self._guard.deferred.items:
            self._guard.settle()
        self._update(idx, stamps, use_stamps, mask, priorities)

    def _defer(self, idx, stamps, use_stamps: bool, mask, priorities) -> None:
        """Keep an update whose values are on a device: checked here as far as
        the host can without reading them, applied by ``_settle``."""
        n = idx.shape[0]
        shape = tuple(priorities.shape)
        if shape not in self._unit.priority_shapes(n):
            raise InvalidArgumentError(f"priorities must have shape ({n},) to match the indices, got {shape}")
        if is_jax_array(priorities):
            check_deferred(priorities)
        elif priorities.is_complex():
            raise InvalidTypeError(f"priorities must be real numbers, got dtype {priorities.dtype}")
        self._unit.check_update(idx, stamps, use_stamps, mask, shape)
        self._check_indices(idx)
        self._guard.deferred.push(idx.copy(), stamps.copy(), use_stamps, None if mask is None else np.array(mask), priorities)

    @entry_point
    def assign_priorities(self, priorities: npt.ArrayLike) -> None:
        """Set the priority of every slot at once in O(N) (a dataset's scores).

        All or nothing, like ``update_priorities``.

        Parameters
        ----------
        priorities : array-like (capacity,)
            Non-negative finite magnitudes; rows of slots that are not
            sampleable are ignored.
        """
        self._check_writable("priorities")
        self._assign(as_priorities(priorities, self.capacity))

    def _assign(self, p: np.ndarray) -> None:
        live = self._unit.status == LIVE
        bad = np.flatnonzero(live & ~((p >= 0) & (p < np.inf)))
        if bad.size:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[bad[0]]} at position {bad[0]}")
        keys = self._prio.keys(np.where(live, p, 0.0))
        self._prio.assign(keys, live)
        if live.any():
            self._ring.max_leaf = max(self._ring.max_leaf, float(keys[live].max()))

    # -- state (close/reopen and snapshots) --------------------------------------
    @reader
    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(meta, arrays)``: JSON-able counters and RNG state, and the
        bookkeeping arrays (views of the live ones: copy before changing);
        with the storage's data, everything to resume. Answers on a closed
        buffer too (what it recorded at close)."""
        meta, ring = self._ring.state()
        meta.update(self._draws.state())
        pmeta, arrays = self._prio.state()
        if pmeta:
            meta["prioritization"] = pmeta
        arrays = {**arrays, **ring}
        if self._frames is not None:
            fmeta, farrays = self._frames.state()
            meta["frames"] = fmeta
            arrays.update(farrays)
        arrays.update(self._unit.state())
        return meta, arrays

    @entry_point
    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Replace the bookkeeping with a recorded ``state_dict`` (checked first;
        ``CorruptSnapshotError`` on anything a buffer could not have written).

        Parameters
        ----------
        meta : dict
            The JSON-able part of ``state_dict()``.
        arrays : dict of str to numpy.ndarray
            Its arrays.
        """
        # All or nothing: some checks (the frame log's slots, its index, the
        # dictionaries) can only run inside the restore, after the ring and
        # the priorities were replaced; a refused state puts the old one back.
        before = copy.deepcopy(self.state_dict())
        try:
            self._restore(meta, arrays)
        except BaseException:
            self._restore(*before)
            raise

    def _restore(self, meta: dict, arrays: dict, reseed: bool = False) -> None:
        check_state(self.config, meta, arrays)
        c = self.config.capacity
        for name, want in (("status", (c,)), ("ends", (c,))):  # (gid follows from count: Ring.restore)
            got = arrays.get(name)
            if got is None or got.shape != want:
                raise IncompatibleSnapshotError(
                    f"recorded state array {name!r} has shape {None if got is None else got.shape}, "
                    f"expected {want}")
        self._prio.restore(meta.get("prioritization", {}), arrays,
                           arrays[self._unit.status_key])
        self._ring.restore(meta, arrays)
        self._draws.restore(meta, reseed)  # (reseed: a new seed on resume starts a new random stream)
        if self._frames is not None:
            self._frames.restore(meta["frames"], arrays)
        self._unit.restore(arrays)
        if self._mirror is not None:  # the device copy is rebuilt from the storage
            self._mirror.forget()
            self._mirror.sync(self._store, self._frames, self._ring.count, progress=True)

    # -- snapshots -------------------------------------------------------------
    @entry_point
    def save(self, snapshot: str | os.PathLike[str], *, metadata: Any = None,
             files: Mapping[str, str | os.PathLike[str]] | None = None) -> Path:
        """Write a crash-consistent snapshot of tree, data and state to the
        new directory ``snapshot``; returns its absolute path.

        ``metadata`` (JSON-able) and ``files`` (``name -> path`` of the
        caller's files, e.g. a model checkpoint) are kept in it, checksummed
        (see ``bigper.Snapshots.save``). With a prefetching ``sampler``
        running, the snapshot is taken between two of its draws: the batches
        it prepared before were drawn before the save (the saved random state
        is past them), so a buffer resumed from it draws next what the
        running sampler would have drawn after them.

        Parameters
        ----------
        snapshot : str or Path
            A directory that does not exist yet.
        metadata : JSON-able, optional
            The caller's record (a step, a run id), kept in the manifest.
        files : mapping of str to path, optional
            ``name -> path`` of the caller's files to copy into the snapshot.

        Returns
        -------
        Path
            The snapshot's absolute path.
        """
        # its folder deleted while open: say so, not a raw ENOENT
        self._store.check_present(f"save({str(snapshot)!r}) cannot link its data into a snapshot")
        summary = {"len": len(self), "capacity": self.capacity, "total_priority": self.total_priority}
        try:
            return _snapshot.save(snapshot, config=self.config, state=for_disk(self.state_dict()), storage=self._store,
                                  summary=summary, metadata=metadata, files=files)
        except OSError as e:  # a full disk's ENOSPC names no file: name the snapshot
            raise real_names(e, where=os.path.abspath(snapshot))

    @classmethod
    def load(cls, snapshot: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None,
             device: Any = None, continue_episodes: bool = False,
             rewind: bool = False) -> "PrioritizedReplayBuffer":
        """Resume the buffer saved in ``snapshot``.

        Parameters
        ----------
        snapshot : str or Path
            A snapshot directory (``save``, ``Snapshots.save``).
        path : str or Path, optional
            Where a disk storage keeps its live data. Default: the path
            recorded in the snapshot; for a snapshot read from elsewhere than
            where it was written (a copied or moved run folder: a fork), the
            same place relative to it, so a fork never writes into the
            original run's folder. What a crashed writer left there is
            replaced, and so is a buffer bigper closed there holding no more
            transitions than the snapshot; one holding more is refused
            (``PathExistsError``) unless ``rewind``; anything else there is
            refused and left as it was.
        device : str or torch.device, optional
            Keep a copy of the data on this torch device (the device tier),
            rebuilt from the snapshot's data (a progress bar for large buffers).
        continue_episodes : bool
            Whether each env's episode open at the snapshot goes on with the
            next ``add`` (only when the environments were restored to the
            snapshot's point too). Default False: each ends there as
            truncated, so no n-step window or sequence item mixes the two
            sides of the resume (see the constructor).
        rewind : bool
            Replace a buffer closed at the live path with more transitions
            than the snapshot (what was added and updated since is lost).
            Default False: refused, nothing changed.

        Returns
        -------
        PrioritizedReplayBuffer

        Raises
        ------
        CorruptSnapshotError
            A file is missing, truncated or does not match its checksum.
        IncompatibleSnapshotError
            Another format version, a config this bigper cannot build, or
            ``path`` holds a buffer of another config.
        StorageLockedError
            A live writer holds ``path``.
        """
        _check_flag(continue_episodes, "continue_episodes")
        _check_flag(rewind, "rewind")
        if device is not None:
            as_device(device)  # before anything at the path is made
        try:
            parts = _snapshot.load(snapshot, path=path, rewind=bool(rewind))
        except (OSError, BigperError) as e:
            raise real_names(e)
        try:
            buf = cls.from_parts(parts.config, parts.storage, (parts.meta, parts.arrays), device=device)
            buf._resume_episodes(continue_episodes)
            return buf
        except BigperError:
            parts.release()
            raise
        except (KeyError, ValueError, TypeError, IndexError) as e:
            parts.release()
            raise IncompatibleSnapshotError(
                f"{parts.snapshot}: its recorded state does not fit this bigper's buffer: {e!r}") from e

    # -- offline datasets --------------------------------------------------------
    @classmethod
    def from_hdf5(cls, dataset: str | os.PathLike[str], **kwargs: Any) -> "PrioritizedReplayBuffer":
        """Open a D4RL, Minari or bigper HDF5 dataset in place, read-only (its
        priorities writable, kept in a sidecar).

        Parameters
        ----------
        dataset : str or Path
            The HDF5 file.
        **kwargs
            As ``bigper.offline.datasets.open_dataset`` takes them: ``alpha``, ``eps``,
            ``max_priority``, ``beta``, ``prioritization``, ``seed``,
            ``priorities`` (the sidecar's path), ``allow_external``, ...; and
            ``device`` (the device tier, built from the file).

        Returns
        -------
        PrioritizedReplayBuffer
        """
        from .offline.datasets import open_dataset, watch_priorities  # h5py-heavy: loaded on first use

        device = kwargs.pop("device", None)
        if device is not None:
            as_device(device)
        cfg, src, state = open_dataset(dataset, **kwargs)
        try:
            buf = cls.from_parts(cfg, src, state, device=device)
            watch_priorities(src, cfg, weakref.WeakMethod(buf._all_leaves))
        except BaseException:
            src.close()
            raise
        return buf

    @entry_point
    def reprioritize(self, score_fn: Callable[[Batch], npt.ArrayLike], batch_size: int = 4096,
                     progress: bool = True, *,
                     restart: bool = False, commit_seconds: float = 2.0) -> None:
        """Score every sampleable transition in order with ``score_fn(batch) -> |TD|``
        and make the scores its priorities (a buffer from ``from_hdf5``).

        Scores are made durable in the dataset's sidecar as they come (at
        most ``commit_seconds`` apart); an interrupted run resumes where it
        stopped unless ``restart``. The buffer's priorities change only at
        the end, all at once. The buffer's lock is held throughout, so other
        threads' calls wait until it finishes.

        Parameters
        ----------
        score_fn : callable
            ``score_fn(batch) -> |TD|``: one non-negative finite score per
            transition of the ``Batch`` it is given.
        batch_size : int
            Transitions per ``score_fn`` call.
        progress : bool
            Show a progress bar.
        restart : bool
            Score from the start, ignoring an interrupted run's scores.
        commit_seconds : float
            Longest time between two durable commits of scores.
        """
        from .offline.datasets import finish_priorities, score_all

        src = self._store
        scores = score_all(src, np.flatnonzero(self._ring.status == LIVE), self._scored_batch, score_fn,
                           batch_size=batch_size, progress=progress, restart=restart,
                           commit_seconds=commit_seconds)
        if scores is not None:
            self._assign(scores)
            finish_priorities(src, self._all_leaves())

    def _scored_batch(self, idx: np.ndarray, at) -> Batch:
        return Batch(self._gather(idx), idx,
                     np.ones(idx.shape[0], dtype=np.float32), self._prio.probabilities(idx),
                     self._ring.gid[at].copy())

    def _all_leaves(self) -> np.ndarray:
        with self._guard.lock:
            return self._prio.key_at(np.arange(self.capacity, dtype=np.int64))

    # -- for the rooms above (shards, integrations) ------------------------------
    @property
    @reader
    def storage(self) -> Storage:
        """The storage object (``kind``, ``path``, ``read``/``write``)."""
        return self._store

    @property
    @reader
    def prioritization(self) -> Prioritization:
        """The prioritization strategy (``bigper.prioritization``)."""
        return self._prio

    @property
    @entry_point
    def status(self) -> np.ndarray:
        """Slot status, a read-only copy (uint8: 0 empty, 1 sampleable, 2 waiting
        for its n-step window, 3 dead)."""
        return _frozen(self._ring.status)

    @property
    @entry_point
    def generations(self) -> np.ndarray:
        """How many transitions had been added when each slot was last written
        (int64, -1 for never), a read-only copy; ``Batch.generations`` are these."""
        return _frozen(self._ring.gid)

    @entry_point
    def gather(self, indices: npt.ArrayLike) -> dict[str, np.ndarray]:
        """The data of the transitions at ``indices`` as ``sample`` returns it
        (no draw, no weights).

        Parameters
        ----------
        indices : array-like of int
            Slots; every one must be sampleable.

        Returns
        -------
        dict of str to numpy.ndarray
        """
        idx = self._check_indices(indices)
        bad = np.flatnonzero(self._unit.status[idx] != LIVE)
        if bad.size:
            raise InvalidIndexError(f"indices[{bad[0]}] = {idx[bad[0]]} is not a sampleable {self._unit.noun}")
        return self._gather(idx)

    def _gather(self, idx: np.ndarray) -> dict:
        return self._unit.gather(self._reader, idx)

    def _check_indices(self, indices) -> np.ndarray:
        idx = as_index(indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise InvalidIndexError(f"indices must be in [0, {self.capacity}), got {idx.min()}..{idx.max()}")
        return idx

    @entry_point
    def leaves(self, indices: npt.ArrayLike) -> np.ndarray:
        """Stored priority keys (float64) at ``indices``: 0 for slots not sampleable.

        Parameters
        ----------
        indices : array-like of int
            Slots in ``[0, capacity)``.

        Returns
        -------
        numpy.ndarray
        """
        return self._prio.key_at(self._check_indices(indices))

    @property
    def shard(self) -> ShardView:
        """What a coordinator of shards asks of this buffer (``bigper.distributed``):
        ``sample_at`` given prefix sums, ``max_leaf``/``raise_max_leaf``/``min_leaf``
        (``bigper.core.shardview``)."""
        return ShardView(self._parts, self)  # (made per call: a view the buffer held would keep it alive)

    # -- lifecycle -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._guard.closed

    def _check_writable(self, what: str = "data"):
        store = self._store
        if store.read_only and not (what == "priorities" and store.priorities_writable):
            where = store.path or ""
            raise ReadOnlyBufferError(f"this buffer is read-only ({what}): opened read_only at {where}")

    def close(self) -> None:
        """Flush, record the state and release the storage; reopening a disk
        path with ``mode="resume"`` continues. Idempotent. Updates from
        device tensors still in flight are applied first."""
        if getattr(self, "_guard", None) is None or self._guard.closed:
            return
        with self._guard.lock:  # another thread's call ends first; this thread's own is refused
            self._refuse_inside("close")
            if self._guard.deferred:
                try:
                    self._guard.settle()
                except BigperError as e:  # close must close: say what was not applied
                    log.warning("bigper: %s", e)
        # Samplers first, outside the lock: their threads may be waiting for it.
        # A consumer still iterating one is told why it ends (not a silent StopIteration).
        for s in list(self._guard.samplers):
            s.close(why=BufferClosedError("the buffer of this sampler was closed"))
        with self._guard.lock:
            self._refuse_inside("close")
            if not self._guard.closed:
                state = None if self._store.read_only else for_disk(self.state_dict())
                self._guard.forget()
                try:
                    self._store.close(state)
                except (OSError, BigperError) as e:  # paths as the user gave them, not /proc/self/fd/N
                    raise real_names(e, where=self._store.path)
                finally:  # (the compressed log: its look, codec and what it keeps of the storage's arrays)
                    if self._frames is not None and self._frames.log is not None:
                        self._frames.log.close()

    def _refuse_inside(self, what: str) -> None:
        # Under the lock: a method still running can only be this thread's own.
        if self._guard.in_call is not None:
            raise InvalidArgumentError(
                f"{what}() was called from inside this buffer's own {self._guard.in_call}() (by a callback or "
                f"an input's __array__ on this thread); call {what}() after {self._guard.in_call}() returns")

    def __del__(self) -> None:
        # A buffer dropped without close() (a notebook cell, an exception)
        # records its state and releases its lock when it is collected.
        try:
            self.close()
        except Exception:  # noqa: BLE001 (nothing to raise to in a finalizer)
            pass

    def __enter__(self) -> "PrioritizedReplayBuffer":
        """The buffer itself; the ``with`` block's end closes it."""
        return self

    def __exit__(self, *exc: object) -> None:
        """``close()``."""
        self.close()

    def __repr__(self) -> str:
        # Read without settling updates in flight: a repr (a log line, a debugger) reports nobody's error.
        with self._guard.lock:
            state = "closed" if self._guard.closed else f"len={min(self._ring.count, self.config.capacity)}"
            total = self._prio.total
        pending = f", {len(self._guard.deferred)} update(s) in flight" if self._guard.deferred else ""
        return (f"PrioritizedReplayBuffer({state}, capacity={self.capacity}, "
                f"storage={self.config.storage!r}, total_priority={total:.6g}{pending})")


# Devices whose sampler batches are gathered straight into one staging block
# (on the CPU torch shares the host arrays instead; tests add "cpu" to check the path).
_STAGED = ("cuda",)


def _check_flag(value, name: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.80}")


def _mirror(cfg: Config, device):
    """The device tier of a buffer of ``cfg`` on ``device`` (None: none)."""
    if device is None:
        return None
    from .device.mirror import Mirror, frames_of

    return Mirror(as_device(device), cfg.capacity, plain_fields(cfg), frames_of(cfg))


def _frozen(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out.flags.writeable = False
    return out
