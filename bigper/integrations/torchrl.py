"""TorchRL drop-in: a prioritized replay buffer with TorchRL's interface, backed by bigper.

A TorchRL DQN script changes one constructor line::

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, priority_key="td_error",
                                           storage=LazyMemmapStorage(100_000), batch_size=32)
    # becomes
    rb = bigper.integrations.torchrl.PrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, priority_key="td_error", storage=LazyMemmapStorage(100_000, scratch_dir="replay"),
        batch_size=32, frame_stack=4)

and keeps everything else: ``extend`` (what a collector calls), ``add``,
``sample`` (a TensorDict with every stored key plus ``"index"`` and
``"priority_weight"``, which ``DQNLoss`` reads), ``update_tensordict_priority``
(after the loss wrote ``priority_key``), ``update_priority``, ``len``,
``write_count``, ``batch_size``, iteration, ``empty``, ``state_dict`` /
``load_state_dict``, ``dumps`` / ``loads``, transforms. Every transition lives
in a ``bigper.PrioritizedReplayBuffer`` (the ``buffer`` attribute): frames of a
``CatFrames`` stack stored once, n-step returns at sample time, the device
tier, crash-consistent snapshots and ``mode="resume"``.

It is not a subclass of TorchRL's ``ReplayBuffer`` and does not plug bigper in
as TorchRL ``Storage``/``Sampler``/``Writer`` components (the TorchRL page of
the docs says why); TorchRL's collectors, losses and ``ReplayBufferTrainer``
only call the methods above. Nothing of TorchRL's compiled extension is used.

How keys map to fields: ``bigper.integrations._torchrl_layout``.
"""

from __future__ import annotations

import collections
import json
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from .. import PrioritizedReplayBuffer as CoreBuffer
from ..errors import (
    BigperError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
)
from ..frames.refs import refs_from_stacks
from ..common.status import LIVE, PENDING
from ..storage import in_memory, open_storage
from ._torchrl_layout import NEXT, SAMPLE_KEYS, STEPS_KEY, DONE, TERMINATED, TRUNCATED, Key, Layout

__all__ = ["PrioritizedReplayBuffer"]

_FORMAT = "bigper.torchrl/1"


def _current_refs(cfg, data: dict, arrays: dict) -> dict:
    """``data`` of a state dict, with the whole frame references an older
    bigper kept (``obs_ref``, ``next_obs_ref``) as the current ``frame_ref`` /
    ``frame_off`` (``frames.store.refs_from_stacks``); other data as given."""
    if not cfg.frame_stack or "obs_ref" not in data or "frame_ref" in data:
        return data
    status = arrays.get("status")
    if not isinstance(status, np.ndarray) or status.shape != (cfg.capacity,):
        raise InvalidArgumentError(f"state_dict['state']['status'] must be ({cfg.capacity},), got "
                                   f"{getattr(status, 'shape', None)}")
    stacks = [data[n] for n in ("obs_ref", "next_obs_ref") if n in data]
    if any(a.shape != (cfg.capacity, cfg.frame_stack) for a in stacks):
        raise InvalidArgumentError(f"state_dict['data'] frame references must be ({cfg.capacity}, "
                                   f"{cfg.frame_stack}), got {[a.shape for a in stacks]}")
    try:
        fref, foff = refs_from_stacks(stacks, cfg.frame_stack, cfg.num_envs, (status == LIVE) | (status == PENDING))
    except ValueError as e:
        raise InvalidArgumentError(f"state_dict's frame references cannot be converted: {e}") from None
    out = {n: a for n, a in data.items() if n not in ("obs_ref", "next_obs_ref")}
    out["frame_ref"], out["frame_off"] = fref, foff
    return out


_REDUCTIONS = ("max", "min", "mean", "median", "sum")
# torch dtypes a field can hold (numpy has the same one): anything else is refused by name
_DTYPES = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
           torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
           torch.float32: np.float32, torch.float64: np.float64}
_ISSUED = 64  # sampled index tensors remembered for stale-slot checks (a learner keeps one or two)
# a snapshot folder written into an existing empty folder (TorchRL's dumps takes one: a TemporaryDirectory)
_INNER = "bigper-snapshot"


def _key(key) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _leaf(cls: type) -> bool:
    """A TensorDict leaf, non-tensor data included (TensorDict's default skips it: it would
    be dropped without a word)."""
    from tensordict.utils import is_non_tensor

    return not issubclass(cls, TensorDictBase) or is_non_tensor(cls)


def _storage_args(storage, capacity, device):
    """``(kind, capacity, path, device)`` from ``storage=``: a bigper storage
    name, or one of TorchRL's storages (its ``max_size``, ``scratch_dir`` and ``device``)."""
    if storage is None or isinstance(storage, str):
        kind = storage or "memory"
        if kind not in ("memory", "memmap"):
            raise InvalidArgumentError(f"storage must be 'memory', 'memmap' or a TorchRL LazyTensorStorage / "
                                       f"LazyMemmapStorage, got {storage!r}")
        if capacity is None:
            raise InvalidArgumentError("capacity is needed with storage=None or a storage name (or pass "
                                       "storage=LazyMemmapStorage(N))")
        return kind, capacity, None, device
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage

    if not isinstance(storage, (LazyMemmapStorage, LazyTensorStorage)):
        raise InvalidTypeError(f"storage must be 'memory', 'memmap', a TorchRL LazyTensorStorage or "
                               f"LazyMemmapStorage, got {type(storage).__name__}")
    size = int(storage.max_size)
    if capacity is not None and capacity != size:
        raise InvalidArgumentError(f"capacity={capacity!r} differs from storage.max_size={size}")
    path = getattr(storage, "scratch_dir", None) if isinstance(storage, LazyMemmapStorage) else None
    kind = "memmap" if path is not None else "memory"
    sdev = getattr(storage, "device", None)
    if device is None and sdev not in (None, "auto") and torch.device(sdev).type != "cpu":
        device = sdev
    return kind, size, path, device


class PrioritizedReplayBuffer:
    """TorchRL's prioritized replay-buffer interface over a bigper buffer.

    Parameters
    ----------
    alpha, beta, eps : float
        As TorchRL's ``TensorDictPrioritizedReplayBuffer`` (``eps`` 1e-8 as
        there); ``beta`` may be a ``bigper.LinearSchedule`` (advanced once per
        ``sample``).
    priority_key : str or tuple of str
        Where the loss writes ``|TD error|`` (``DQNLoss``: ``"td_error"``); an
        ``extend`` whose TensorDict holds it uses it as the new priorities.
    storage : {"memory", "memmap"} or TorchRL LazyTensorStorage / LazyMemmapStorage
        A TorchRL storage is read for its ``max_size`` (the capacity),
        ``scratch_dir`` (``LazyMemmapStorage``: bigper's memmap ``path``;
        without one the data stays in memory) and device (the device tier).
    capacity : int, optional
        Transitions held (with a storage name; default: the storage's ``max_size``).
    batch_size : int, optional
        What ``sample()`` and iteration draw.
    transform : TorchRL Transform, optional
        Applied to each sampled TensorDict (its ``inv`` to what is written).
    reduction : {"max", "min", "mean", "median", "sum"}
        How a priority with more than one value per item is reduced.
    frame_stack : int, optional
        ``obs_key`` holds stacks of this many frames on its first axis
        (``CatFrames(N=k, dim=-3)``); each frame is stored once.
    obs_key : str or tuple of str
        The frame-stacked key and, under it in ``"next"``, its successor (``"pixels"``).
    n_step, gamma : int, float
        n-step returns at sample time: ``("next", "reward")`` is the discounted
        sum, the ``"next"`` keys with a root counterpart are those at the
        window's end, and ``"steps_to_next_obs"`` (what ``DQNLoss`` raises
        gamma to) is added. A window that terminated gives ``n_step`` there
        (its bootstrap is masked by ``("next", "terminated")``).
    path, mode : str, {"new", "resume", "overwrite"}
        bigper's memmap path (instead of a ``scratch_dir``) and what to do
        when it holds a buffer; ``mode="resume"`` opens it here, its layout
        read from its config.
    device : str or torch.device, optional
        bigper's device tier: the data also lives in this device's memory and
        samples are gathered there.
    num_envs : int
        With more than one, ``extend`` takes TensorDicts of batch size
        ``(num_envs, T)`` (a collector over a batched env) and each env is its own stream.
    seed, max_priority, prioritization, weight_norm, compression, continue_episodes :
        As ``bigper.PrioritizedReplayBuffer``.
    prefetch, pin_memory : optional
        Accepted for TorchRL's signature; a sample is one compiled call here,
        so nothing is prefetched, and nothing is pinned.

    Notes
    -----
    The bigper buffer is made by the first ``extend``/``add`` (the TensorDict
    says what its fields are, as TorchRL's lazy storages do), by ``loads`` or
    ``load_state_dict``, or here with ``mode="resume"`` on a path that holds one.
    Every public method holds one lock: two threads may extend and sample at once.
    """

    def __init__(self, *, alpha: float = 0.6, beta: Any = 0.4, priority_key: str | tuple[str, ...] = "td_error",
                 eps: float = 1e-8, storage: Any = None, capacity: int | None = None,
                 batch_size: int | None = None, transform: Any = None, reduction: str = "max",
                 frame_stack: int | None = None, obs_key: str | tuple[str, ...] = "pixels", n_step: int = 1,
                 gamma: float = 0.99, path: str | os.PathLike[str] | None = None, mode: str = "new",
                 device: Any = None, num_envs: int = 1, seed: int | None = 0, max_priority: float | None = None,
                 prioritization: str = "proportional", weight_norm: str = "global",
                 compression: str | None = None, continue_episodes: bool = False,
                 prefetch: int | None = None, pin_memory: bool = False) -> None:
        kind, cap, spath, device = _storage_args(storage, capacity, device)
        if path is not None and spath is not None and Path(path) != Path(spath):
            raise InvalidArgumentError(f"path={str(path)!r} and the storage's scratch_dir={str(spath)!r} differ")
        path = path if path is not None else spath
        if path is not None:
            kind = "memmap"
        if reduction not in _REDUCTIONS:
            raise InvalidArgumentError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
            raise InvalidArgumentError(f"batch_size must be a positive int or None, got {batch_size!r}")
        if not isinstance(priority_key, (str, tuple)) or not _key(priority_key) or \
                not all(isinstance(p, str) for p in _key(priority_key)):
            raise InvalidTypeError(f"priority_key must be a str or a tuple of str, got {priority_key!r}")
        if not isinstance(obs_key, (str, tuple)) or not all(isinstance(p, str) for p in _key(obs_key)):
            raise InvalidTypeError(f"obs_key must be a str or a tuple of str, got {obs_key!r}")
        if type(n_step) is not int or n_step < 1:
            raise InvalidArgumentError(f"n_step must be an int >= 1, got {n_step!r}")
        if type(num_envs) is not int or num_envs < 1:
            raise InvalidArgumentError(f"num_envs must be an int >= 1, got {num_envs!r}")
        self._lock = threading.RLock()
        self.priority_key: str | tuple[str, ...] = priority_key
        self._pkey = _key(priority_key)
        self._obs_key = _key(obs_key)
        self._batch_size = batch_size
        self._reduction = reduction
        self._num_envs = num_envs
        self._frame_stack, self._n_step = frame_stack, n_step
        # The path made absolute once, as the core buffer does: a later chdir never moves empty() or loads()
        path = None if path is None else os.path.abspath(os.path.expanduser(os.fspath(path)))
        self._on_disk, self._path, self._mode = not in_memory(kind), path, mode
        self._core_kw = dict(capacity=cap, frame_stack=frame_stack, n_step=n_step, gamma=gamma, alpha=alpha,
                             eps=eps, max_priority=max_priority, beta=beta, weight_norm=weight_norm,
                             prioritization=prioritization, storage=kind, num_envs=num_envs, seed=seed,
                             compression=compression, device=device)
        self._continue = continue_episodes
        self._transform = None
        if transform is not None:
            self.append_transform(transform)
        self._issued: collections.OrderedDict = collections.OrderedDict()
        self._layout: Layout | None = None
        self.buffer: CoreBuffer | None = None
        if mode == "resume" and path is not None and Path(path, "meta.json").is_file():
            self._resume_at_path()
        elif mode not in ("new", "resume", "overwrite"):
            raise InvalidArgumentError(f"mode must be 'new', 'resume' or 'overwrite', got {mode!r}")

    # -- the bigper buffer ----------------------------------------------------------------
    def _open(self, layout: Layout, mode: str | None = None, go_on: bool | None = None) -> CoreBuffer:
        kw = dict(self._core_kw)
        return CoreBuffer(kw.pop("capacity"), fields=layout.fields, next_of=layout.next_of,
                          path=self._path, mode=mode or self._mode,
                          continue_episodes=self._continue if go_on is None else go_on, **kw)

    def _resume_at_path(self) -> None:
        """``mode="resume"`` on a path that holds a buffer: its layout from its recorded config."""
        from ..config import Config
        from ..common.files import read_json

        try:  # read before the lock is taken, only to learn the fields: the open below checks everything
            rec = read_json(Path(self._path) / "meta.json")
            cfg = Config.from_dict(rec["config"])
            layout = Layout.from_config(cfg.fields, cfg.next_of, obs_key=self._obs_key,
                                        frame_stack=self._frame_stack, n_step=self._n_step)
        except BigperError:
            raise
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"path={str(self._path)!r} holds no bigper buffer this TorchRL buffer can "
                                       f"resume: {e!r}") from e
        self.buffer = self._open(layout)
        self._layout = layout

    def _core(self, what: str) -> CoreBuffer:
        if self.buffer is None:
            raise InvalidArgumentError(f"{what}: the buffer is empty (nothing was extended or loaded yet)")
        return self.buffer

    # -- properties -----------------------------------------------------------------------
    @property
    def batch_size(self) -> int | None:
        """What ``sample()`` draws without an argument."""
        return self._batch_size

    @property
    def write_count(self) -> int:
        """Transitions written so far through ``add``/``extend`` (kept across resume and loads)."""
        with self._lock:
            return 0 if self.buffer is None else int(self.buffer.state_dict()[0]["count"])

    def __len__(self) -> int:
        with self._lock:
            return 0 if self.buffer is None else len(self.buffer)

    def __repr__(self) -> str:
        return f"bigper.integrations.torchrl.PrioritizedReplayBuffer({self.buffer!r}, batch_size={self._batch_size})"

    # -- transforms -----------------------------------------------------------------------
    @property
    def transform(self) -> Any:
        """The TorchRL ``Compose`` applied to samples (None without transforms)."""
        return self._transform

    def append_transform(self, transform: Any) -> "PrioritizedReplayBuffer":
        """Apply ``transform`` to each sample after the ones there (``inv`` to writes)."""
        from torchrl.envs.transforms import Compose, Transform

        if not isinstance(transform, Transform):
            raise InvalidTypeError(f"transform must be a TorchRL Transform, got {type(transform).__name__}")
        with self._lock:
            if self._transform is None:
                self._transform = Compose()
            self._transform.append(transform)
        return self

    def insert_transform(self, index: int, transform: Any) -> "PrioritizedReplayBuffer":
        """Insert ``transform`` at ``index`` of the sample transforms."""
        from torchrl.envs.transforms import Compose, Transform

        if not isinstance(transform, Transform):
            raise InvalidTypeError(f"transform must be a TorchRL Transform, got {type(transform).__name__}")
        with self._lock:
            if self._transform is None:
                self._transform = Compose()
            self._transform.insert(index, transform)
        return self

    # -- writing --------------------------------------------------------------------------
    def _leaves(self, td: TensorDictBase, lead: int) -> dict[Key, np.ndarray]:
        """Every stored leaf of ``td`` as a host numpy array (leading batch axes first)."""
        out: dict[Key, np.ndarray] = {}
        skip = {(k,) for k in SAMPLE_KEYS} | {self._pkey}
        for key, v in td.items(include_nested=True, leaves_only=True, is_leaf=_leaf):
            key = _key(key)
            if key in skip:
                continue
            if not isinstance(v, torch.Tensor):
                raise InvalidTypeError(f"TensorDict key {key!r} holds a {type(v).__name__}; this buffer stores "
                                       "tensors only")
            if v.layout != torch.strided or v.device.type == "meta":
                raise InvalidArgumentError(f"TensorDict key {key!r} is a {v.layout} tensor on {v.device}; this "
                                           "buffer stores dense tensors with data")
            if v.dtype not in _DTYPES:
                raise InvalidTypeError(f"TensorDict key {key!r} has dtype {v.dtype}, which this buffer does not "
                                       f"store (it takes {sorted(str(d) for d in _DTYPES)})")
            a = v.detach().to("cpu").numpy()
            if v.is_neg() or v.is_conj():
                a = v.detach().resolve_neg().resolve_conj().to("cpu").numpy()
            if lead == 2:
                a = np.swapaxes(a, 0, 1)  # (envs, T) as a collector gives it -> (T, envs) as bigper takes it
            out[key] = a
        return out

    def _check_leaves(self, leaves: dict, layout: Layout, lead: int) -> None:
        missing = sorted(set(layout.leaves) - set(leaves))
        extra = sorted(set(leaves) - set(layout.leaves))
        if missing or extra:
            raise InvalidArgumentError(
                f"tensordicts must hold the keys of the first extend: missing {missing[:8]}, extra {extra[:8]}")
        for key, (shape, dtype) in layout.leaves.items():
            a = leaves[key]
            if a.shape[lead:] != shape or a.dtype != dtype:
                raise InvalidArgumentError(f"tensordicts[{key!r}] must have shape {shape} and dtype {dtype} per "
                                           f"item, got shape {a.shape[lead:]} dtype {a.dtype}")

    def _core_data(self, leaves: dict, layout: Layout, lead_shape: tuple) -> dict[str, np.ndarray]:
        data = {}
        for key, name in layout.source.items():
            data[name] = leaves[key].reshape(lead_shape + layout.core_shape(key))
        flag = lambda k: leaves[k].reshape(lead_shape)  # noqa: E731
        term = flag(TERMINATED) if TERMINATED in leaves else flag(DONE)
        if TRUNCATED in leaves:
            trunc = flag(TRUNCATED)
        elif DONE in leaves and TERMINATED in leaves:
            trunc = flag(DONE) & ~term
        else:
            trunc = np.zeros(lead_shape, bool)
        data["terminated"], data["truncated"] = term, trunc
        return data

    def _priorities(self, td: TensorDictBase, lead: int) -> np.ndarray | None:
        p = td.get(self._pkey, None)
        if p is None:
            return None
        if not isinstance(p, torch.Tensor) or p.dtype not in _DTYPES or p.dtype == torch.bool:
            raise InvalidTypeError(f"tensordicts[{self.priority_key!r}] must be a real tensor, got "
                                   f"{type(p).__name__} {getattr(p, 'dtype', '')}")
        p = self._reduce(p.detach().to("cpu").to(torch.float64), lead, tuple(td.batch_size), "tensordicts")
        return np.swapaxes(p.numpy(), 0, 1) if lead == 2 else p.numpy()

    def _reduce(self, p: torch.Tensor, lead: int, batch: tuple, what: str) -> torch.Tensor:
        if tuple(p.shape[:lead]) != batch:
            raise InvalidArgumentError(f"{what}[{self.priority_key!r}] must have the batch shape {batch} first, "
                                       f"got shape {tuple(p.shape)}")
        if p.ndim == lead:
            return p
        flat = p.reshape(batch + (-1,))
        if flat.shape[-1] == 1:
            return flat[..., 0]
        r = getattr(flat, self._reduction)(dim=-1)
        return r[0] if isinstance(r, tuple) else r

    def _lead(self, td: TensorDictBase, what: str, single: bool) -> int:
        want = (0 if single else 1) + (self._num_envs > 1)
        if not isinstance(td, TensorDictBase):
            raise InvalidTypeError(f"{what} must be a TensorDict, got {type(td).__name__}")
        if td.batch_dims != want or (self._num_envs > 1 and td.batch_size[0] != self._num_envs):
            shape = "(num_envs,)" if single else "(T,)" if self._num_envs == 1 else "(num_envs, T)"
            raise InvalidArgumentError(f"{what} must have batch size {shape} (num_envs={self._num_envs}), got "
                                       f"{tuple(td.batch_size)}")
        return want

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        """Write a TensorDict of steps, in time order (what a collector gives).

        Parameters
        ----------
        tensordicts : TensorDict, batch size (T,) or (num_envs, T)
            Every leaf is stored; ``"index"``, ``"priority_weight"`` and
            ``priority_key`` are not (``priority_key``, when there, gives the
            new transitions' priorities unless ``update_priority=False``).

        Returns
        -------
        torch.Tensor (T,) or (num_envs, T) int64
            The slots written.
        """
        with self._lock:
            return self._write(tensordicts, "tensordicts", update_priority, single=False)

    def add(self, data: TensorDictBase) -> int | torch.Tensor:
        """Write one step (batch size () or, with ``num_envs``, (num_envs,)); returns its slot(s)."""
        with self._lock:
            idx = self._write(data, "data", None, single=True)
            return int(idx[0]) if self._num_envs == 1 else idx[:, 0]

    def _write(self, td, what: str, update_priority, single: bool) -> torch.Tensor:
        lead = self._lead(td, what, single)
        if single:
            td = td.unsqueeze(-1)
            lead += 1
        if self._transform is not None and len(self._transform):
            td = self._transform.inv(td)
        leaves = self._leaves(td, lead)
        layout = self._layout
        if layout is None:
            layout = Layout.from_leaves({k: (a.shape[lead:], a.dtype) for k, a in leaves.items()},
                                        obs_key=self._obs_key, frame_stack=self._frame_stack, n_step=self._n_step)
        else:
            self._check_leaves(leaves, layout, lead)
        lead_shape = next(iter(leaves.values())).shape[:lead]
        data = self._core_data(leaves, layout, lead_shape)
        prio = self._priorities(td, lead) if update_priority in (None, True) else None
        made = self.buffer is None
        core = self.buffer if not made else self._open(layout)
        count = int(core.state_dict()[0]["count"])
        try:
            core.extend(data, priorities=prio)
        except BaseException:
            if made:  # nothing kept of a first write that failed; a path we made is ours to replace
                core.close()
                if self._mode == "new":
                    self._mode = "overwrite"
            raise
        if made:
            self.buffer, self._layout = core, layout
        n = int(np.prod(lead_shape))
        idx = torch.arange(count, count + n, dtype=torch.int64).remainder_(core.capacity)
        return idx.reshape(lead_shape).T if lead == 2 else idx

    # -- sampling -------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """A TensorDict of ``batch_size`` transitions drawn by priority.

        It holds every stored key as it was written (n-step: see the
        constructor), ``"index"`` (int64, the slots) and ``"priority_weight"``
        (float32, the IS weights ``DQNLoss`` multiplies its loss by); on the
        device tier's device with ``device=``.

        Parameters
        ----------
        batch_size : int, optional
            Default: the constructor's.
        return_info : bool
            Also return ``{"index": ..., "priority_weight": ...}``.
        """
        with self._lock:
            b = batch_size if batch_size is not None else self._batch_size
            if b is None:
                raise InvalidArgumentError("batch_size is None here and in the constructor: pass one")
            batch = self._core("sample").sample(b)
            td = self._to_td(batch)
            if self._transform is not None and len(self._transform):
                td = self._transform(td)
            if return_info:
                return td, {"index": td.get("index"), "priority_weight": td.get("priority_weight")}
            return td

    def _to_td(self, batch) -> TensorDict:
        layout = self._layout
        n = batch.size
        weights = batch.weights
        dev = weights.device if isinstance(weights, torch.Tensor) else torch.device("cpu")
        td = TensorDict({}, batch_size=[n], device=dev)
        for key, name in layout.source.items():
            v = batch[name]
            t = v if isinstance(v, torch.Tensor) else torch.from_numpy(v)
            td.set(key, t.reshape((n,) + layout.leaves[key][0]))
        if layout.n_step > 1:
            steps = self._steps(batch, layout)
            td.set(STEPS_KEY, steps.to(dev).reshape(n, 1))
        index = torch.from_numpy(np.array(batch.indices, dtype=np.int64)).to(dev)
        td.set("index", index)
        td.set("priority_weight", weights if isinstance(weights, torch.Tensor) else torch.from_numpy(weights))
        self._issued[id(index)] = (weakref.ref(index), np.array(batch.indices), np.array(batch.generations))
        while len(self._issued) > _ISSUED:
            self._issued.popitem(last=False)
        return td

    def _steps(self, batch, layout: Layout) -> torch.Tensor:
        d = batch["discount"]
        d = d.detach().to("cpu").numpy() if isinstance(d, torch.Tensor) else np.asarray(d)
        gamma = float(self.buffer.config.gamma)
        m = np.full(d.shape, layout.n_step, np.int64)
        live = d > 0
        if 0 < gamma < 1:
            m[live] = np.rint(np.log(d[live].astype(np.float64)) / math.log(gamma)).astype(np.int64)
        return torch.from_numpy(m)

    def __iter__(self) -> Iterator[TensorDict]:
        """Endless samples of ``batch_size`` (sampling is with replacement)."""
        if self._batch_size is None:
            raise InvalidArgumentError("iterating needs batch_size= in the constructor")
        while True:
            yield self.sample()

    # -- priorities -----------------------------------------------------------------------
    def _target(self, index) -> Any:
        """The bigper target of an index tensor: one this buffer sampled (unchanged)
        carries its generations, so slots overwritten since are skipped."""
        if not isinstance(index, torch.Tensor):
            return np.asarray(index)
        entry = self._issued.get(id(index))
        if entry is not None and entry[0]() is index:
            if index.device.type != "cpu" or np.array_equal(index.numpy(), entry[1]):
                return {"indices": entry[1], "generations": entry[2]}
        return index.detach().to("cpu").numpy()

    def update_priority(self, index: Any, priority: Any) -> None:
        """Set the priorities at ``index`` (slots; a sampled ``"index"`` skips
        the slots overwritten since it was drawn) to ``priority`` (``|TD error|``)."""
        with self._lock:
            core = self._core("update_priority")
            if isinstance(priority, torch.Tensor) and priority.ndim > 1:
                priority = self._reduce(priority.detach(), 1, (priority.shape[0],), "priority")
            core.update_priorities(self._target(index), priority)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """``update_priority(data["index"], data[priority_key])``: what a training
        loop calls after the loss wrote ``priority_key`` into the sample."""
        with self._lock:
            if not isinstance(data, TensorDictBase):
                raise InvalidTypeError(f"data must be a TensorDict, got {type(data).__name__}")
            index = data.get("index", None)
            p = data.get(self._pkey, None)
            if index is None or p is None:
                raise InvalidArgumentError(f"data must hold 'index' and {self.priority_key!r} (the loss writes it), "
                                           f"got keys {sorted(map(str, data.keys(True, True)))[:12]}")
            if not isinstance(p, torch.Tensor):
                raise InvalidTypeError(f"data[{self.priority_key!r}] must be a tensor, got {type(p).__name__}")
            if data.batch_dims != 1:
                raise InvalidArgumentError(f"data must have batch size (B,), got {tuple(data.batch_size)}")
            p = self._reduce(p.detach(), 1, tuple(data.batch_size), "data")
            self._core("update_tensordict_priority").update_priorities(self._target(index), p)

    # -- empty, state and snapshots ---------------------------------------------------------
    def empty(self, empty_write_count: bool = True) -> None:
        """Drop every transition (a disk path is replaced: what bigper made there).

        ``empty_write_count=False`` is refused: bigper's count is its ring's cursor.
        """
        with self._lock:
            if not empty_write_count:
                raise InvalidArgumentError("empty(empty_write_count=False) is not supported: bigper's write count "
                                           "is its ring's cursor")
            if self.buffer is None:
                return
            layout = self._layout
            self.buffer.close()
            self.buffer = None
            self.buffer = self._open(layout, mode="overwrite")
            self._issued.clear()

    def state_dict(self) -> dict[str, Any]:
        """Everything to rebuild the buffer in memory: its config (JSON), its
        bookkeeping and its data as tensors. ``storage="memory"`` only (a disk
        buffer's state is its files: ``dumps``/``loads`` or ``mode="resume"``)."""
        with self._lock:
            core = self._core("state_dict")
            self._memory_only(core, "state_dict")
            meta, arrays = core.state_dict()
            return {"format": _FORMAT, "config": json.dumps(core.config.to_dict()), "meta": json.dumps(meta),
                    "state": {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()},
                    "data": {k: torch.from_numpy(np.array(v)) for k, v in core.storage.arrays.items()}}

    def _memory_only(self, core, what: str) -> None:
        if not core.storage.in_memory or core.config.compression is not None:
            raise InvalidArgumentError(f"{what} holds a buffer in memory; this one is storage="
                                       f"{core.config.storage!r}, compression={core.config.compression!r}: use "
                                       "dumps(path)/loads(path) (a bigper snapshot) or mode='resume'")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the buffer with one ``state_dict`` gave (checked first; a
        refusal leaves this buffer as it was)."""
        from ..config import Config

        with self._lock:
            if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
                raise InvalidArgumentError(f"state_dict must be a dict of format {_FORMAT!r}, got "
                                           f"{type(state_dict).__name__} of format "
                                           f"{state_dict.get('format') if isinstance(state_dict, dict) else None!r}")
            try:
                cfg = Config.from_dict(json.loads(state_dict["config"]))
                meta = json.loads(state_dict["meta"])
                arrays = {str(k): np.array(v.numpy()) for k, v in state_dict["state"].items()}
                data = {str(k): v.numpy() for k, v in state_dict["data"].items()}
                older = cfg.frame_stack and "obs_ref" in data and "frame_ref" not in data
                data = _current_refs(cfg, data, arrays)
                if older:  # each slot's oldest frame follows from the converted references: derived, not taken
                    arrays.pop("frames_minref", None)
            except BigperError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise InvalidArgumentError(f"state_dict is not one this buffer wrote: {e!r}") from e
            layout = Layout.from_config(cfg.fields, cfg.next_of, obs_key=self._obs_key,
                                        frame_stack=self._frame_stack, n_step=self._n_step)
            if not in_memory(cfg.storage) or self._on_disk:
                raise InvalidArgumentError("load_state_dict makes a buffer in memory; use loads(path) for disk")
            if self._layout is not None and (layout.fields != self._layout.fields
                                             or layout.next_of != self._layout.next_of):
                raise InvalidArgumentError(f"state_dict holds fields {sorted(layout.fields)}, this buffer "
                                           f"{sorted(self._layout.fields)}")
            new = self._open(layout)
            try:
                was = new.storage.writable_arrays
                off, index = data.get("frame_off"), data.get("frame_index")
                if (off is not None and "frame_off" in was and off.dtype != was["frame_off"].dtype) or \
                        (index is not None and "frame_index" in was and index.shape[1:] != was["frame_index"].shape[1:]):
                    # (converted references that need wider offsets, an older bigper's wide frame index)
                    new = self._held(new, None if off is None else off.dtype,
                                     None if index is None else tuple(index.shape[1:]))
                have = new.storage.writable_arrays
                if set(have) != set(data):
                    raise InvalidArgumentError(f"state_dict['data'] has arrays {sorted(data)}, expected {sorted(have)}")
                for k, a in data.items():
                    if a.shape != have[k].shape or a.dtype != have[k].dtype:
                        raise InvalidArgumentError(f"state_dict['data'][{k!r}] has shape {a.shape} dtype {a.dtype}, "
                                                   f"expected {have[k].shape} {have[k].dtype}")
                    have[k][...] = a
                new.load_state(meta, arrays)
            except BaseException:
                new.close()
                raise
            old, self.buffer, self._layout = self.buffer, new, layout
            self._issued.clear()
            if old is not None:
                old.close()

    def _held(self, core: CoreBuffer, dtype, index) -> CoreBuffer:
        """``core`` (empty, in memory; closed here) made again with frame
        offsets of ``dtype`` and frame index rows of shape ``index``: wider
        than its config's, as a buffer converted from the older format keeps
        them (``frames.refs.check_offsets``, ``frames.segments.index_width``;
        another is ``InvalidArgumentError``)."""
        from ..core.layout import storage_growth, storage_specs
        from ..frames.store import FrameStore

        cfg = core.config
        try:
            frames = FrameStore(cfg, None, offsets=dtype, index=index)
        except IncompatibleSnapshotError as e:
            core.close()
            raise InvalidArgumentError(f"state_dict['data']: {e}") from None
        store = open_storage(cfg.storage)
        store.open(cfg.to_dict())
        specs, growth = storage_specs(cfg, frames), storage_growth(cfg, frames)
        store.allocate(specs, growth) if growth else store.allocate(specs)
        core.close()
        return CoreBuffer.from_parts(cfg, store, device=self._core_kw["device"])

    def dumps(self, path: str | os.PathLike[str]) -> Path:
        """Write a bigper snapshot (crash-consistent, checksummed, no pickle) at
        ``path``, a folder that does not exist yet or an empty one (then the
        snapshot is its ``bigper-snapshot`` subfolder); returns the snapshot's path."""
        with self._lock:
            core = self._core("dumps")
            p = Path(path)
            if p.is_dir() and not p.is_symlink():
                if any(p.iterdir()):
                    raise PathExistsError(f"dumps(path={str(path)!r}): the folder is not empty; pass a new path")
                p = p / _INNER
            return core.save(p, metadata={"torchrl": {"format": _FORMAT, "obs_key": list(self._obs_key)}})

    def loads(self, path: str | os.PathLike[str], *, rewind: bool = False) -> None:
        """Replace the buffer with the snapshot ``dumps`` wrote at ``path``:
        data, priorities, random state, beta step (the next sample is the one
        the saved buffer would have drawn). A refusal leaves this buffer as it was.

        Parameters
        ----------
        path : str or Path
            What ``dumps`` was given.
        rewind : bool
            As ``bigper.PrioritizedReplayBuffer.load``: replace a disk buffer
            holding more transitions than the snapshot at this buffer's path.
        """
        with self._lock:
            p = Path(path)
            if (p / _INNER).is_dir():
                p = p / _INNER
            dev = self._core_kw["device"]
            old = self.buffer
            live = None
            if self._on_disk:
                live = self._path
                if old is not None:
                    old.close()  # the path is ours; reopened below if the load is refused
            try:
                new = CoreBuffer.load(p, path=live, device=dev, continue_episodes=self._continue, rewind=rewind)
            except BaseException as e:
                if old is not None and self._on_disk:
                    try:
                        self.buffer = self._open(self._layout, mode="resume", go_on=True)
                    except BaseException as again:  # noqa: BLE001 (the load's refusal is what the caller gets)
                        e.add_note(f"this buffer could not reopen {str(live)!r} afterwards (it stays closed): "
                                   f"{type(again).__name__}: {again}")
                raise
            try:
                cfg = new.config
                layout = Layout.from_config(cfg.fields, cfg.next_of, obs_key=self._obs_key,
                                            frame_stack=cfg.frame_stack, n_step=cfg.n_step)
            except BaseException:
                new.close()
                raise
            self.buffer, self._layout = new, layout
            self._issued.clear()
            if old is not None and not self._on_disk:
                old.close()

    save = dumps
    dump = dumps
    load = loads

    def close(self) -> None:
        """Close the bigper buffer (a disk buffer resumes from its path)."""
        with self._lock:
            if self.buffer is not None:
                self.buffer.close()

    def __enter__(self) -> "PrioritizedReplayBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
