"""The SB3 / CleanRL drop-in's buffer: SB3's ``ReplayBuffer`` interface over a
prioritized ``bigper.PrioritizedReplayBuffer`` (see ``bigper.integrations.sb3``)."""

from __future__ import annotations

import contextvars
import difflib
import inspect
import logging
import os
import sys
import threading
import warnings
from collections import deque
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer

from .. import PrioritizedReplayBuffer as CoreBuffer
from ..tensors.lazy import as_numpy
from ..batch import Batch
from ..config import Config
from ..core.ingest import check_batch_size
from ..errors import BufferClosedError, IncompatibleSnapshotError, InvalidArgumentError, PathExistsError
from ..schedules import ConstantSchedule, LinearSchedule, as_beta, as_schedule, is_schedule
from ._layout import StackLayout, from_core_tensor
from ._sb3_pickle import KEEP_AT_PATH, core_kwargs, open_snapshot, write_snapshot

if TYPE_CHECKING:
    from stable_baselines3.common.vec_env import VecNormalize

__all__ = ["PrioritizedReplayBuffer", "PrioritizedReplayBufferSamples"]

# The public home of these classes: pickles name them there, wherever they are defined.
_HOME = "bigper.integrations.sb3"
_PICKLE_FORMAT = "bigper.sb3/1"
# Samples with no update_priorities call before the buffer says that sampling is uniform.
_PLAIN_SAMPLES_WARN = 100
# Buffer options that are not part of bigper's Config.
_NOT_CONFIG = ("path", "mode", "read_only", "storage_options", "continue_episodes", "device")
# Core options the drop-in sets itself, or that it does not support (sequences); the
# core's device= is the drop-in's device_tier= (SB3 passes its own device= to every buffer).
_SET_HERE = ("capacity", "fields", "num_envs", "n_step", "sequence", "device")
# Batches a sampler prepares ahead of sample() (the drop-in's default prefetch=).
PREFETCH = 2
# Batches handed out whose update_priorities target is kept (matched by their indices
# tensor): the latest, and the one before for a learner that samples ahead, or two threads.
_KEEP_TARGETS = 4
# True while a Prioritized algorithm's ``load`` rebuilds its model: the buffer
# it builds opens its storage on first use (learn), not at construction.
DEFER_OPEN: contextvars.ContextVar[bool] = contextvars.ContextVar("bigper_sb3_defer_open", default=False)

log = logging.getLogger("bigper")


class PrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ``ReplayBufferSamples`` fields in their order, plus the PER ones.

    ``dones`` is 1 only where the (n-step) window ended by termination (timeouts
    are not dones, as in SB3). ``discounts`` is None with ``n_steps=1`` (SB3's
    DQN then uses its own gamma); with ``n_steps > 1`` it is ``gamma**m`` for a
    window of ``m`` steps, also where ``dones`` is 1, exactly as SB3's
    ``NStepReplayBuffer`` gives it (the target masks it with ``1 - dones``).
    ``weights``: float32 ``(B, 1)``; ``indices``: int64 ``(B,)``.
    """

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: th.Tensor


def _timeouts(infos, n_envs: int) -> np.ndarray:
    """``TimeLimit.truncated`` per env from SB3's list of dicts or a Gymnasium vector env's dict."""
    out = np.zeros(n_envs, dtype=bool)
    if isinstance(infos, dict):
        t = infos.get("TimeLimit.truncated")
        if t is not None:
            mask = infos.get("_TimeLimit.truncated")
            out[:] = np.asarray(t, dtype=bool).reshape(n_envs)
            if mask is not None:
                out &= np.asarray(mask, dtype=bool).reshape(n_envs)
        return out
    if infos is None:
        return out
    infos = list(infos)
    if len(infos) != n_envs:
        raise InvalidArgumentError(f"infos must hold one dict per env ({n_envs}), got {len(infos)}")
    for i, info in enumerate(infos):
        out[i] = bool(info.get("TimeLimit.truncated", False))
    return out


class PrioritizedReplayBuffer(ReplayBuffer):
    """SB3's ``ReplayBuffer`` interface over a prioritized bigper buffer.

    Parameters
    ----------
    buffer_size, observation_space, action_space, device, n_envs :
        As SB3's ``ReplayBuffer``. Transitions held: ``max(buffer_size // n_envs, 1) * n_envs``.
    optimize_memory_usage : bool
        Accepted and ignored: bigper stores each frame once in any case.
    handle_timeout_termination : bool
        Read timeouts from ``infos[i]["TimeLimit.truncated"]`` (a timeout ends
        the episode but is not a done).
    alpha : float
        Priority exponent (0.6).
    beta : float or schedule
        IS exponent. A float is where the annealing to 1.0 starts (over
        ``learn`` in the ``Prioritized*`` algorithms, over ``beta_steps`` adds
        when given); a ``bigper.LinearSchedule`` is advanced once per ``sample``.
    beta_steps : int, optional
        Anneal beta from ``beta`` to 1.0 over this many ``add`` calls (env steps
        of a vector env, CleanRL's ``total_timesteps``), then keep 1.0: no
        sample counting by hand, and it resumes with the buffer.
    storage, path, seed :
        The bigper buffer's storage ("memory", "memmap", "hdf5"), its path and seed.
    frame_stack : int, optional
        Observations are stacks of this many frames; each frame is stored once.
    frame_axis : {"auto", "first", "last"}
        Which axis holds the stack ("auto": the one ``frame_stack`` divides; if
        both, the smaller, as SB3 tells channel-first images).
    n_steps, gamma :
        n-step returns as SB3's ``NStepReplayBuffer`` computes them. ``n_step``
        (the core's spelling) is taken for ``n_steps``; both, with different
        values, are refused.
    snapshot_dir : str or Path, optional
        Where pickling writes its bigper snapshot (see the module docstring).
    prefetch : int
        Batches a background sampler prepares ahead of ``sample()`` (default 2;
        see ``sample``). 0: each ``sample()`` draws and converts in the
        caller's thread (the synchronous path of bigper 0.x).
    device_tier : bool, str or torch.device, optional
        Keep a copy of the stored data in device memory (bigper's device
        tier, the core's ``device=``): True for this buffer's ``device`` (the
        model's), or a device. Batches are then gathered there and handed to
        SB3 without a host copy. ``Prioritized*`` algorithms take it as
        ``replay_buffer_kwargs={"device": ...}`` too (SB3 passes its own
        ``device=`` to every buffer, so the plain algorithms need this name).
    **bigper_kwargs :
        Passed on to ``bigper.PrioritizedReplayBuffer`` (``eps``, ``max_priority``,
        ``mode="resume"`` to continue the buffer at ``path``, ...); an option
        neither takes is refused naming the closest one.

    The storage is created here (the first ``add`` costs what the others do),
    and a line says where and how big (the ``bigper`` logger at INFO, else
    stderr; ``close()`` says what stays), except while a ``Prioritized*``
    algorithm's ``load`` rebuilds a model (loading to evaluate makes no file)
    and where ``path`` already holds something and ``mode`` is "new": those
    open on first use (a rerun over a used path gets its ``PathExistsError``
    there). uint8 images that look like frame stacks without ``frame_stack``
    get a ``UserWarning`` naming the ``frame_stack`` to pass.
    ``size()`` and ``pos`` count what the bigper buffer holds, also after
    ``mode="resume"``.
    """

    buffer_size: int
    optimize_memory_usage: bool
    handle_timeout_termination: bool
    n_steps: int
    gamma: float
    snapshot_dir: str | os.PathLike[str] | None
    layout: StackLayout
    beta_is_schedule: bool
    beta0: float
    beta_steps: int | None
    full: bool
    pos: int

    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: th.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, alpha: float = 0.6,
                 beta: float | LinearSchedule | ConstantSchedule = 0.4, storage: str = "memory",
                 path: str | os.PathLike[str] | None = None, seed: int = 0, frame_stack: int | None = None,
                 frame_axis: str = "auto", n_steps: int | None = None, gamma: float = 0.99,
                 snapshot_dir: str | os.PathLike[str] | None = None, beta_steps: int | None = None,
                 prefetch: int = PREFETCH, device_tier: Any = None, **bigper_kwargs: Any) -> None:
        if isinstance(n_envs, bool) or not isinstance(n_envs, (int, np.integer)) or n_envs < 1:
            raise InvalidArgumentError(f"n_envs must be an int >= 1, got {n_envs!r}")
        n_envs = int(n_envs)
        # SB3's BaseBuffer only records spaces, shapes and the device; ReplayBuffer's
        # own __init__ would allocate its obs/next_obs arrays, which is what we replace.
        super(ReplayBuffer, self).__init__(buffer_size, observation_space, action_space, device,
                                           n_envs=n_envs)
        if isinstance(observation_space, spaces.Dict):
            raise InvalidArgumentError(
                f"observation_space: Dict spaces are not supported by bigper's PrioritizedReplayBuffer, got "
                f"{observation_space}; flatten the observation (gymnasium.wrappers.FlattenObservation) "
                "or use SB3's DictReplayBuffer (uniform replay; HerReplayBuffer for goal-conditioned tasks)")
        beta_steps = _beta_steps(beta_steps)
        self.prefetch: int = _prefetch(prefetch)
        self.device_tier = _device_tier(device_tier)
        # One beta rule (schedules.as_beta): a number of any real type (np.float32, np.int64,
        # Fraction, a 0-d array or tensor) is where the annealing to 1.0 starts; a schedule
        # object is the user's, and the bigper buffer advances it.
        beta_is_schedule = is_schedule(beta)
        beta = as_schedule(beta) if beta_is_schedule else as_beta(beta)
        _check_options(bigper_kwargs)
        n_steps = one_n_steps("PrioritizedReplayBuffer", {"n_steps": n_steps, "n_step": bigper_kwargs.pop("n_step", None)})
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = bool(handle_timeout_termination)
        self.n_steps = 1 if n_steps is None else n_steps
        self.gamma = float(gamma)
        self.snapshot_dir = snapshot_dir
        self.layout = StackLayout(self.obs_shape, frame_stack, frame_axis)
        self._act_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        fields = {"obs": (self.layout.core_shape, np.dtype(observation_space.dtype)),
                  "action": ((self.action_dim,), self._act_dtype),
                  "reward": ((), np.dtype(np.float32))}
        kwargs = dict(frame_stack=frame_stack, n_step=self.n_steps, gamma=self.gamma, alpha=alpha,
                      beta=beta, storage=storage, path=path, seed=seed, num_envs=n_envs,
                      device=self._tier_device(), **bigper_kwargs)
        # Checked now, opened on first use: SB3's DQN.load builds a buffer that
        # load_replay_buffer replaces at once, and it must not touch the disk.
        cfg = Config.build(capacity=self.buffer_size * n_envs, fields=fields,
                           **{k: v for k, v in kwargs.items() if k not in _NOT_CONFIG})
        _transitions_only(cfg, "PrioritizedReplayBuffer")
        if frame_stack is None:
            _hint_frame_stack(self.obs_shape, np.dtype(observation_space.dtype))
        self._core_args = (self.buffer_size * n_envs, fields, kwargs)
        self._core = None
        self._live_path = None if path is None else os.fspath(path)
        self.beta_is_schedule = beta_is_schedule
        self.beta0 = float(as_schedule(beta)(0))
        self.beta_steps = beta_steps
        self._wire()
        used = path is not None and kwargs.get("mode", "new") == "new" and os.path.lexists(path)
        if not used and not DEFER_OPEN.get():
            self.buffer  # noqa: B018 (the storage is created now, not at the first add)

    @property
    def buffer(self) -> CoreBuffer:
        """The bigper buffer behind this one."""
        if self._core is None:
            capacity, fields, kwargs = self._core_args
            try:
                self._core = CoreBuffer(capacity, fields, **kwargs)
            except PathExistsError as e:
                if "mode='resume'" not in str(e):
                    raise
                raise PathExistsError(
                    f"{e} (with Stable-Baselines3 the buffer's options go in replay_buffer_kwargs: "
                    f"replay_buffer_kwargs={{'path': {kwargs.get('path')!r}, 'mode': 'resume', ...}} when "
                    "building or loading the model, e.g. PrioritizedDQN.load(model_path, "
                    "replay_buffer_kwargs=...))") from None
            self._count_steps()  # a resumed buffer holds what it held
            _say_where(self._core, "holds")
        return self._core

    def _refuse_if_unopened_and_empty(self, what: str) -> None:
        """Refuse a call that needs transitions on a buffer not opened yet (a
        loaded model's) whose opening would make a new, empty storage at its
        path: the call would be refused anyway, and a refusal makes no file
        (promise 15). A path that holds a buffer to resume is opened as usual."""
        if self._core is not None or self._core_args is None:
            return
        kwargs = self._core_args[2]
        path = kwargs.get("path")
        if path is None or (kwargs.get("mode", "new") != "overwrite" and os.path.lexists(path)):
            return  # (memory makes no file; an existing path resumes, or is refused by name when it opens)
        raise InvalidArgumentError(
            f"{what}: this replay buffer holds no transition: it was not opened yet (a loaded model's buffer "
            f"opens at its first add), and nothing was made at path={os.fspath(path)!r}; learn, or "
            "load_replay_buffer(...) first")

    def _tier_device(self) -> Any:
        """The device the core's tier goes on (the core's ``device=``), or None."""
        tier = self.device_tier
        return None if tier is None else self.device if tier is True else tier

    def _wire(self) -> None:
        """Counters derived from the bigper buffer (after construction and after unpickling)."""
        # (indices tensor handed out, its update target: the Batch or the sampler's TensorBatch),
        # newest last: an update by a batch's indices skips the slots overwritten since its draw.
        self._targets: deque = deque(maxlen=_KEEP_TARGETS)
        self._feed = None  # the open sampler (see _next_from_feed), and what it was opened with
        self._feed_key = None
        self._feed_lock = threading.RLock()
        self._learner_beta = None  # the beta a Prioritized algorithm sampled with last
        self._snapshot_target = None
        self._plain_samples = 0  # samples since construction with no update_priorities yet
        self._count_steps()

    def _count_steps(self) -> None:
        self._steps = 0 if self._core is None else self._core.state_dict()[0]["count"] // self.n_envs
        self._sync_cursor()

    @classmethod
    def from_buffer(cls, buffer: CoreBuffer, observation_space: spaces.Space, action_space: spaces.Space,
                    device: th.device | str = "auto", *, handle_timeout_termination: bool = True,
                    frame_axis: str = "auto", snapshot_dir: str | os.PathLike[str] | None = None,
                    beta_steps: int | None = None, prefetch: int = PREFETCH) -> "PrioritizedReplayBuffer":
        """The drop-in over an open bigper buffer: one loaded from a snapshot
        (``bigper.Snapshots(root).load_latest()``) or reopened with
        ``mode="resume"``. ``size()``, ``pos`` and sampling continue where the
        buffer is; capacity, envs, frame stack, n-step and gamma are the
        buffer's, and its fields must be the ones this drop-in builds for the
        spaces (``InvalidArgumentError`` naming the difference otherwise). A
        buffer with a device tier (``device=``) is served from it.
        """
        beta_steps = _beta_steps(beta_steps)
        if not isinstance(buffer, CoreBuffer):
            raise InvalidArgumentError(f"from_buffer: buffer must be a bigper.PrioritizedReplayBuffer, "
                                       f"got {type(buffer).__name__}")
        if buffer.closed:
            raise BufferClosedError("from_buffer: the bigper buffer is closed")
        cfg = buffer.config
        _transitions_only(cfg, "from_buffer")
        if cfg.capacity % cfg.num_envs:
            raise InvalidArgumentError(f"from_buffer: capacity {cfg.capacity} is not a multiple of "
                                       f"num_envs {cfg.num_envs}, which SB3's buffer_size needs")
        self = cls.__new__(cls)
        super(ReplayBuffer, self).__init__(cfg.capacity, observation_space, action_space, device,
                                           n_envs=cfg.num_envs)
        self.buffer_size = cfg.capacity // cfg.num_envs
        self.optimize_memory_usage = False
        self.handle_timeout_termination = bool(handle_timeout_termination)
        self.n_steps, self.gamma = cfg.n_step, cfg.gamma
        self.snapshot_dir = snapshot_dir
        self.layout = StackLayout(self.obs_shape, cfg.frame_stack, frame_axis)
        self._act_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        want = {"obs": (self.layout.core_shape, np.dtype(observation_space.dtype).str),
                "action": ((self.action_dim,), self._act_dtype.str), "reward": ((), np.dtype(np.float32).str)}
        if dict(cfg.fields) != want:
            raise InvalidArgumentError(f"from_buffer: the buffer's fields {cfg.fields} are not the ones "
                                       f"these spaces need {want}")
        storage_path = buffer.storage.path
        self._core, self._core_args = buffer, None
        self._live_path = None if storage_path is None else os.fspath(storage_path)
        schedule = cfg.schedule
        self.beta_is_schedule = cfg.beta.get("kind") != "constant"
        self.beta0 = float(schedule(0))
        self.beta_steps = beta_steps
        self.prefetch: int = _prefetch(prefetch)
        self.device_tier = None if buffer.device is None else str(buffer.device)
        self._wire()
        return self

    # -- beta ------------------------------------------------------------------
    def beta_for_learner(self, progress_remaining: float) -> float | None:
        """The beta a prioritized SB3 algorithm samples with: None where the
        buffer's schedule decides, annealed by ``add`` count with
        ``beta_steps``, else from ``beta`` to 1.0 over ``learn``. What it
        samples with is what ``beta`` reads from then on."""
        if self.beta_is_schedule:
            self._learner_beta = None
            return None
        b = self._beta_by_steps() if self.beta_steps is not None else annealed_beta(self.beta0, progress_remaining)
        self._learner_beta = b
        return b

    @property
    def beta(self) -> float:
        """The beta in use: the one ``sample()`` without ``beta=`` uses now.
        Annealed by ``add`` count with ``beta_steps``; under a ``Prioritized*``
        algorithm's ``learn``, the beta of its latest gradient step (annealed
        over ``learn``, the ``last_beta`` it logs as ``train/beta``); else the
        bigper buffer's."""
        if self.beta_steps is not None and not self.beta_is_schedule:
            return self._beta_by_steps()
        if self._learner_beta is not None:
            return self._learner_beta
        if self._core is None:  # not opened yet (a loaded model): reading beta makes no file
            return self.beta0
        return self.buffer.beta

    @beta.setter
    def beta(self, value: object) -> None:
        # CleanRL's PER sets rb.beta each step; here that would silently do nothing.
        raise InvalidArgumentError(
            f"beta cannot be set on the buffer (got {value!r}): pass beta_steps= (add calls) to anneal "
            "it from beta to 1.0 over the run, or beta= to sample()")

    def _beta_by_steps(self) -> float:
        done = min(self._steps / self.beta_steps, 1.0)
        return self.beta0 + (1.0 - self.beta0) * done

    def _sync_cursor(self) -> None:
        steps = self._steps
        self.full = steps >= self.buffer_size
        self.pos = steps % self.buffer_size

    # -- writing -------------------------------------------------------------
    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: Sequence[dict[str, Any]] | dict[str, Any], *,
            truncated: np.ndarray | None = None) -> None:
        """Add one step of every env, exactly as SB3 (and CleanRL) call it.

        Parameters
        ----------
        obs, next_obs : array (n_envs, obs_shape...)
        action : array (n_envs, ...) reshaped to (n_envs, action_dim)
        reward, done : array (n_envs,)
            ``done`` as SB3's VecEnv gives it (terminated or timed out).
        infos : list of dict, or dict
            SB3's per-env list, or a Gymnasium vector env's dict of arrays;
            ``TimeLimit.truncated`` marks timeouts.
        truncated : array (n_envs,) of bool, optional
            Timeouts given directly (for CleanRL, which passes ``terminations``
            as ``done``): the episode ends there but keeps its bootstrap.
        """
        n = self.n_envs
        obs = np.asarray(obs)
        next_obs = np.asarray(next_obs)
        want = (n, *self.obs_shape)
        if obs.shape != want or next_obs.shape != want:
            if isinstance(self.observation_space, spaces.Discrete):
                obs, next_obs = obs.reshape(want), next_obs.reshape(want)
            for name, x in (("obs", obs), ("next_obs", next_obs)):
                if x.shape != want:
                    raise InvalidArgumentError(f"add: {name} must have shape {want}, got {x.shape}")
        action = np.asarray(action).reshape((n, self.action_dim))
        done = np.asarray(done).reshape(n).astype(bool, copy=False)
        timeout = _timeouts(infos, n) if self.handle_timeout_termination else np.zeros(n, dtype=bool)
        terminated = done & ~timeout
        trunc = done & timeout
        if truncated is not None:
            trunc = trunc | (np.asarray(truncated, dtype=bool).reshape(n) & ~terminated)
        # The reward goes in as given: the core stores it if it fits float32 (finite), else refuses.
        reward = np.asarray(reward).reshape(n)
        obs, next_obs = self.layout.to_core(obs, 1), self.layout.to_core(next_obs, 1)
        if n == 1:
            self.buffer.add(obs=obs[0], next_obs=next_obs[0], action=action[0], reward=reward[0],
                            terminated=terminated[0], truncated=trunc[0])
        else:
            self.buffer.add(obs=obs, next_obs=next_obs, action=action, reward=reward,
                            terminated=terminated, truncated=trunc)
        self._steps += 1
        self._sync_cursor()

    @property
    def dones(self) -> "_EpisodeCut":
        """What SB3's ``_setup_learn`` writes to (``dones[pos] = True``) when a
        model with ``optimize_memory_usage`` starts ``learn`` again: SB3 cuts
        its single obs array there. bigper stores each ``next_obs`` (and
        compares frames by their bytes), so there is nothing to cut."""
        return _EpisodeCut()

    def reset(self) -> None:
        """Refused: a bigper buffer is not cleared in place (make a new one)."""
        raise InvalidArgumentError("reset is not supported by bigper's buffer; build a new one")

    # -- sampling ------------------------------------------------------------
    def sample(self, batch_size: int, env: VecNormalize | None = None, *,
               beta: float | None = None) -> PrioritizedReplayBufferSamples:
        """Draw ``batch_size`` transitions in proportion to priority.

        Parameters
        ----------
        batch_size : int
        env : VecNormalize, optional
            Observations and rewards normalized as SB3 does.
        beta : float, optional
            IS exponent for this call (``PrioritizedDQN`` passes its annealed value).

        Notes
        -----
        With ``prefetch > 0`` (the default) the batch comes from a bigper
        sampler (``buffer.sampler(batch_size, prefetch=..., device=self.device)``)
        kept open from call to call: its thread draws and gathers the next
        batches (on the device tier when there is one) while the learner
        computes. It is opened again when ``batch_size``, the device, or the
        kind of beta (the buffer's own schedule or a number given here)
        changes, and closed (its prepared batches dropped: they were drawn, so
        the random stream is past them) by ``close_sampler``, ``close``,
        pickling (``save_replay_buffer``), ``load_replay_buffer`` and a model
        whose buffer was replaced. Each batch is what a ``sample`` call at
        its draw would have returned, with two differences:

        - a batch prepared before an ``add`` or a priority update is drawn
          from the buffer as it was then (prefetching replay's usual lag, at
          most ``prefetch + 1`` batches). Its data is that of the draw, and
          ``update_priorities`` by its ``indices`` skips the slots overwritten
          since (by their generation), as for any batch. A prepared n-step
          batch whose window a later ``add`` overwrote in a row that
          terminated (SB3's ``discounts`` there need the window's episode
          ends) is dropped for the next one.
        - its ``weights`` were computed with the beta the sampler was opened
          with, ``b0``; asked for another beta ``b`` (``PrioritizedDQN``
          anneals it at every step), they are ``w ** (b / b0)``, which is
          ``(N * P(i)) ** -b`` normalized as ``weight_norm`` says, the
          normalizer being the same transition's for every beta (equal to
          the synchronous path's to float32 rounding).

        A ``VecNormalize`` ``env`` (statistics read at sampling time) and
        ``prefetch=0`` take the synchronous path: drawn and converted in the
        caller's thread.
        """
        if beta is None and not self.beta_is_schedule:
            beta = self._beta_by_steps() if self.beta_steps is not None else self._learner_beta
        elif beta is not None:
            beta = as_beta(beta)  # the one rule, as the bigper buffer's sample applies it
        self._refuse_if_unopened_and_empty("sample")
        if env is None and self.prefetch:
            out = self._sample_prefetched(batch_size, beta)
        else:
            batch = self.buffer.sample(batch_size, beta=beta)
            out = self._samples(batch, env)
        if self._plain_samples >= 0:
            self._plain_samples += 1
            if self._plain_samples == _PLAIN_SAMPLES_WARN:
                warnings.warn(
                    f"bigper PrioritizedReplayBuffer: {_PLAIN_SAMPLES_WARN} batches sampled and no "
                    "update_priorities call: every priority stays at the max, so sampling is uniform. With SB3, "
                    "use bigper.integrations.sb3.PrioritizedDQN (or PrioritizedSAC, PrioritizedTD3, "
                    "PrioritizedDDPG, PrioritizedQRDQN, PrioritizedTQC) instead of the plain algorithm; in a "
                    "loop of your own, call rb.update_priorities(data.indices, td_abs) after each step",
                    UserWarning, stacklevel=2)
        return out

    def _samples(self, batch: Batch, env) -> PrioritizedReplayBufferSamples:
        """The synchronous path: ``batch`` drawn in this thread, converted here."""
        if self.buffer.device is not None:  # a tier's batch: normalization reads numpy
            batch = Batch({k: as_numpy(v) for k, v in batch.data.items()}, batch.indices,
                          as_numpy(batch.weights), batch.probabilities, batch.generations)
        obs = self.layout.from_core(batch["obs"])
        nxt = self.layout.from_core(batch["next_obs"])
        rewards = batch["reward"].astype(np.float32, copy=False).reshape(-1, 1)
        if env is not None:
            if self.n_steps > 1 and getattr(env, "norm_reward", False):
                raise InvalidArgumentError(
                    "sample: reward normalization (VecNormalize norm_reward=True) with n_steps > 1 "
                    "is not supported: bigper sums the raw rewards of a window")
            obs = self._normalize_obs(obs, env)
            nxt = self._normalize_obs(nxt, env)
            rewards = self._normalize_reward(rewards, env)
        data = {"observations": obs, "actions": batch["action"], "next_observations": nxt,
                "dones": batch["terminated"].astype(np.float32).reshape(-1, 1), "rewards": rewards}
        if self.n_steps > 1:
            data["discounts"] = self._discounts(batch).reshape(-1, 1)
        t = Batch(data, batch.indices, batch.weights, batch.probabilities, batch.generations)
        t = t.to_torch(self.device)
        out = PrioritizedReplayBufferSamples(
            t["observations"], t["actions"], t["next_observations"], t["dones"], t["rewards"],
            t.get("discounts"), t["weights"].reshape(-1, 1), t["indices"])
        self._targets.append((out.indices, batch))
        return out

    def _discounts(self, batch: Batch) -> np.ndarray:
        """SB3's ``NStepReplayBuffer`` discounts: ``gamma**m`` for a window of
        ``m`` steps, also where it ended by termination (bigper gives 0 there;
        SB3 leaves that to ``1 - dones``, and a drop-in returns what SB3 returns)."""
        disc = batch["discount"].astype(np.float32, copy=True)
        rows = np.flatnonzero(batch["terminated"])
        if rows.size:
            disc[rows] = self._window_discounts(batch.generations[rows])[0]
        return disc

    def _window_discounts(self, gens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(gamma**m, current)`` for the transitions of generations ``gens``:
        ``m`` the steps of each one's window up to the first step that ended
        its episode (where it terminated, that step is the first with an end
        flag), as float32; ``current``: whether the slot still holds that
        transition (a window is overwritten only after its first slot, the
        oldest, so where it does, the window's end flags are the draw's)."""
        arrays = self.buffer.state_dict()[1]
        ends, cap = arrays["ends"], self.buffer.capacity
        steps = np.arange(self.n_steps, dtype=np.int64) * self.n_envs
        slots = (gens[:, None] + steps[None, :]) % cap
        m = (ends[slots] != 0).argmax(axis=1) + 1
        current = arrays["gid"][gens % cap] == gens
        return (self.gamma ** m).astype(np.float32), current

    # -- the prefetching path --------------------------------------------------
    def _sample_prefetched(self, batch_size: int, beta: float | None) -> PrioritizedReplayBufferSamples:
        with self._feed_lock:  # (two threads calling sample take turns for the sampler)
            for _ in range(self.prefetch + 2):
                tensors, drawn_beta = self._next_from_feed(batch_size, beta)
                out = self._tensor_samples(tensors, drawn_beta, beta)
                if out is not None:
                    self._targets.append((out.indices, tensors))
                    return out
            # (another thread kept overwriting the windows of every batch drawn): drawn here
            self.close_sampler()
            return self._samples(self.buffer.sample(batch_size, beta=beta), None)

    def _next_from_feed(self, batch_size: int, beta: float | None):
        """The next batch of the open sampler (opened first where there is none
        for this batch size, device, buffer and beta), and the beta it was drawn with."""
        if type(batch_size) is not int:
            check_batch_size(batch_size)  # raises, or passes a numpy integer
            batch_size = int(batch_size)
        core = self.buffer
        key = self._feed_key
        if (self._feed is None or key[0] is not core or key[1] != batch_size or key[2] != self.device
                or not _rescalable(key[3], beta)):
            self.close_sampler()
            feed = core.sampler(batch_size, prefetch=self.prefetch, device=self.device, beta=beta)
            self._feed, self._feed_key = feed, (core, batch_size, self.device, beta)
        feed, drawn_beta = self._feed, self._feed_key[3]
        try:
            return next(feed), drawn_beta
        except StopIteration:
            # Closed under this call (another thread's close_sampler, or the drop-in's close): a new
            # sampler draws, or says why it cannot (a closed buffer), never a silent end.
            self.close_sampler()
            return self._next_from_feed(batch_size, beta)
        except BaseException:
            # A sampler whose draw failed (an empty buffer, a closed one) has ended: the next call opens another.
            self.close_sampler()
            raise

    def _tensor_samples(self, tensors, drawn_beta: float | None, beta: float | None):
        """SB3's samples from a sampler's ``TensorBatch`` (already on ``self.device``);
        None where it cannot give this batch's n-step discounts (see ``sample``)."""
        discounts = None
        if self.n_steps > 1:
            discounts = self._tensor_discounts(tensors)
            if discounts is None:
                return None
        weights = tensors["weights"]
        if beta is not None and drawn_beta is not None and beta != drawn_beta:
            weights = weights.double().pow(beta / drawn_beta).float()
        return PrioritizedReplayBufferSamples(
            from_core_tensor(self.layout, tensors["obs"]), tensors["action"],
            from_core_tensor(self.layout, tensors["next_obs"]),
            tensors["terminated"].to(th.float32).reshape(-1, 1), tensors["reward"].to(th.float32).reshape(-1, 1),
            discounts, weights.reshape(-1, 1), tensors["indices"])

    def _tensor_discounts(self, tensors):
        """``_discounts`` for a sampler's batch, on its device (the host reads
        nothing back from it unless a row's window was overwritten since its draw)."""
        host = tensors.host_target() if hasattr(tensors, "host_target") else None
        gens = as_numpy(tensors["generations"]) if host is None else host[1]
        gm, current = self._window_discounts(np.asarray(gens, dtype=np.int64))
        term = tensors["terminated"]
        if not current.all() and as_numpy(term[th.from_numpy(~current).to(term.device)]).any():
            return None
        disc = tensors["discount"].to(th.float32)
        return th.where(term, th.from_numpy(gm).to(disc.device), disc).reshape(-1, 1)

    def close_sampler(self) -> None:
        """Close the background sampler ``sample`` keeps open, dropping the
        batches it prepared (they were drawn: the random stream is past them);
        the next ``sample`` opens another. ``close``, pickling and
        ``load_replay_buffer`` call it."""
        with self._feed_lock:
            feed, self._feed, self._feed_key = self._feed, None, None
            if feed is not None:
                feed.close()

    def _last_draw(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, generations)`` of the latest batch handed out (tests)."""
        _, target = self._targets[-1]
        if isinstance(target, Batch):
            return target.indices, target.generations
        return as_numpy(target["indices"]), as_numpy(target["generations"])

    def update_priorities(self, indices: th.Tensor | npt.ArrayLike, priorities: th.Tensor | npt.ArrayLike) -> None:
        """Set priorities, e.g. ``|TD error|``; numpy arrays or torch tensors on any device.

        The ``indices`` tensor of one of the latest batches ``sample`` gave is
        matched to that batch (the ``TensorBatch`` its sampler gave, or its
        ``Batch``), so transitions overwritten since its draw are skipped.
        """
        self._refuse_if_unopened_and_empty("update_priorities")
        self._plain_samples = -1  # priorities are written back: nothing to warn about
        for handed, target in reversed(tuple(self._targets)):
            if indices is handed:
                self.buffer.update_priorities(target, priorities)
                return
        self.buffer.update_priorities(indices, priorities)

    def size(self) -> int:
        """Transitions held (SB3's ``size()``: per env, as SB3 counts them)."""
        return self.buffer_size if self.full else self.pos

    def close(self) -> None:
        """Close the bigper buffer (a disk storage is flushed and unlocked, and
        what it leaves on disk is logged: where, and how big)."""
        self.close_sampler()
        if self._core is not None and not self._core.closed:
            self._core.close()
            _say_where(self._core, "left")

    def reopen(self) -> None:
        """Open again the disk storage this buffer closed (``mode="resume"``, its
        episodes going on: nothing happened between the close and now), for a
        ``load_replay_buffer`` that closed it to load into its path and was
        refused."""
        core = self._core
        if core is None or not core.closed or core.storage.path is None:
            return
        cfg = core.config
        self.close_sampler()
        self._core = CoreBuffer(cfg.capacity, cfg.fields, path=core.storage.path, mode="resume",
                                continue_episodes=True, device=core.device, **core_kwargs(cfg))
        self._count_steps()

    @property
    def closed(self) -> bool:
        """True after ``close()`` (a buffer never used is open: its storage opens on first use)."""
        return self._core is not None and self._core.closed

    # -- pickling: a snapshot reference, never the transitions (see _sb3_pickle) ---
    def _snapshot_series(self) -> tuple[Path, int | None]:
        """Where this pickle's snapshot goes, and how many of that series to keep."""
        if self._snapshot_target is not None and self.snapshot_dir is None:
            # save_replay_buffer(path) owns <path>.bigper/: the pickle at that path names
            # the newest snapshot; the one before stays until the next save lands.
            return Path(self._snapshot_target), KEEP_AT_PATH
        # A pickle whose file bigper does not know: its snapshot is never pruned.
        if self.snapshot_dir is not None:
            return Path(self.snapshot_dir), None
        if self._live_path is not None:
            return Path(f"{self._live_path}.snapshots"), None
        raise InvalidArgumentError(
            "pickling a bigper PrioritizedReplayBuffer writes a snapshot, and this one has no place "
            "for it: pass snapshot_dir= to the buffer, use PrioritizedDQN.save_replay_buffer(path), "
            "or use a disk storage")

    def __getstate__(self) -> dict[str, Any]:
        if self.closed:  # before any directory is made or file written
            raise BufferClosedError("cannot pickle a closed bigper PrioritizedReplayBuffer: its "
                                    "transitions are no longer reachable (pickle it before close())")
        root, keep = self._snapshot_series()
        # Batches the sampler prepared are dropped first: the snapshot's random state is past them,
        # so the run that goes on and one resumed from this snapshot draw the same next batches.
        self.close_sampler()
        snap, digest = write_snapshot(self.buffer, root, keep)
        return {"format": _PICKLE_FORMAT, "snapshot": snap, "manifest_sha256": digest,
                "buffer_size": self.buffer_size, "n_envs": self.n_envs,
                "observation_space": self.observation_space, "action_space": self.action_space,
                "device": str(self.device), "handle_timeout_termination": self.handle_timeout_termination,
                "n_steps": self.n_steps, "gamma": self.gamma, "frame_stack": self.layout.k,
                "frame_axis": self.layout.axis or "auto", "live_path": self._live_path,
                "beta_is_schedule": self.beta_is_schedule, "beta0": self.beta0, "beta_steps": self.beta_steps,
                "prefetch": self.prefetch,
                "device_tier": self.device_tier if self.device_tier in (None, True) else str(self.device_tier),
                "snapshot_dir": None if self.snapshot_dir is None else os.fspath(self.snapshot_dir)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._restore(state)

    def _restore(self, state: dict[str, Any], live: str | None = None, rewind: bool = False,
                 continue_episodes: bool = False, device: Any = None) -> None:
        """The buffer a pickle's ``state`` describes, its snapshot loaded into
        ``live`` (default: the live path it recorded; see ``open_snapshot`` for
        ``rewind`` and ``continue_episodes``), for a learner on ``device``
        (default: the one it recorded; a ``device_tier=True`` follows it)."""
        if not isinstance(state, dict) or state.get("format") != _PICKLE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise IncompatibleSnapshotError(f"not a bigper SB3 replay buffer pickle ({_PICKLE_FORMAT}), got {got!r}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise IncompatibleSnapshotError(f"bigper SB3 replay buffer pickle lacks {missing}")
        # (keys absent from pickles written before they existed: their defaults then)
        self.prefetch = _prefetch(state.get("prefetch", PREFETCH))
        self.device_tier = _device_tier(state.get("device_tier"))
        super(ReplayBuffer, self).__init__(state["buffer_size"], state["observation_space"],
                                           state["action_space"], state["device"] if device is None else device,
                                           n_envs=state["n_envs"])
        buf = open_snapshot(state, capacity=state["buffer_size"] * state["n_envs"], n_envs=state["n_envs"],
                            live=live, rewind=rewind, continue_episodes=continue_episodes,
                            device=self._tier_device())
        self.buffer_size = state["buffer_size"]
        self.optimize_memory_usage = False
        self.handle_timeout_termination = state["handle_timeout_termination"]
        self.n_steps, self.gamma = state["n_steps"], state["gamma"]
        self.snapshot_dir = state["snapshot_dir"]
        self.layout = StackLayout(self.obs_shape, state["frame_stack"], state["frame_axis"])
        self._act_dtype = np.dtype(self._maybe_cast_dtype(self.action_space.dtype))
        self._core = buf
        self._core_args = None
        self._live_path = state["live_path"]
        self.beta_is_schedule, self.beta0 = bool(state["beta_is_schedule"]), float(state["beta0"])
        beta_steps = state.get("beta_steps")  # absent from pickles written before it existed
        self.beta_steps = None if beta_steps is None else int(beta_steps)
        self._wire()


PrioritizedReplayBuffer.__module__ = PrioritizedReplayBufferSamples.__module__ = _HOME


def _transitions_only(cfg: Config, where: str) -> None:
    """SB3's algorithms train on transitions: a sequence buffer (batches of
    windows, ``(B, L, ...)``) would be handed to them as if it were one."""
    if cfg.sequence is not None:
        raise InvalidArgumentError(f"{where}: a sequence buffer (sequence={cfg.sequence}) samples windows, not "
                                   "the transitions SB3's algorithms train on; use bigper.PrioritizedReplayBuffer "
                                   "directly for sequences")


def _beta_steps(value: object) -> int | None:
    """``beta_steps`` checked (an int >= 1, numpy ints too, or None) and made a plain int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"beta_steps must be an int >= 1 (add calls) or None, got {value!r}")
    return int(value)


def _prefetch(value: object) -> int:
    """``prefetch`` checked (an int in [0, 1024], as the bigper sampler takes it) and made a plain int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 1024:
        raise InvalidArgumentError(f"prefetch must be an int in [0, 1024] (0: no background sampler), got {value!r}")
    return int(value)


def _device_tier(value: object) -> bool | str | th.device | None:
    """``device_tier`` checked: None (or False) for none, True (or "auto") for
    the buffer's own device, else a torch device (the core checks that it
    can hold the tier when the buffer opens)."""
    if value is None or value is False:
        return None
    if value is True or (isinstance(value, str) and value == "auto"):
        return True
    if isinstance(value, (str, th.device)):
        try:
            th.device(value)
        except (RuntimeError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"device_tier must be True, None or a torch device ('cuda', 'cpu'), "
                                       f"got {value!r} ({e})") from None
        return value
    raise InvalidArgumentError(f"device_tier must be True, None or a torch device ('cuda', 'cpu'), got {value!r}")


def _rescalable(drawn: float | None, wanted: float | None) -> bool:
    """Whether a sampler drawing with beta ``drawn`` serves a learner asking
    for ``wanted``: the same (None: the buffer's own schedule), or two numbers
    with ``drawn > 0`` (weights at ``drawn`` raised to ``wanted / drawn``)."""
    if drawn is None or wanted is None:
        return drawn is wanted
    return drawn > 0 or wanted == drawn


def annealed_beta(beta0: float, progress_remaining: float) -> float:
    """Beta from ``beta0`` at the start of ``learn`` to 1.0 at its end
    (``progress_remaining``: SB3's, 1.0 at the start, 0.0 at the end)."""
    done = min(max(1.0 - float(progress_remaining), 0.0), 1.0)
    return beta0 + (1.0 - beta0) * done


class _EpisodeCut:
    """Takes SB3's ``dones[pos] = True`` and keeps nothing (see ``PrioritizedReplayBuffer.dones``)."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


_STATE_KEYS = ("snapshot", "manifest_sha256", "buffer_size", "n_envs", "observation_space",
               "action_space", "device", "handle_timeout_termination", "n_steps", "gamma",
               "frame_stack", "frame_axis", "live_path", "beta_is_schedule", "beta0", "snapshot_dir")


def _drop_in_options() -> list[str]:
    """Every option the drop-in takes by name (its own and the core's it passes on)."""
    own = [n for n in inspect.signature(PrioritizedReplayBuffer.__init__).parameters
           if n not in ("self", "buffer_size", "observation_space", "action_space", "device", "n_envs",
                        "bigper_kwargs")]
    core = [n for n in inspect.signature(CoreBuffer.__init__).parameters
            if n not in ("self", *_SET_HERE) and n not in own]
    return sorted(own + core)


def _check_options(given: dict[str, Any]) -> None:
    """Refuse an option the drop-in does not have, naming the closest one it has."""
    options = _drop_in_options()
    unknown = [k for k in given if k not in options and k != "n_step"]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, options, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidArgumentError(f"PrioritizedReplayBuffer has no option {k!r}{hint}; its options: {options}")


def one_n_steps(where: str, given: dict[str, Any]) -> int | None:
    """The n-step count given under any of its names (``n_steps``, SB3's
    spelling; ``n_step``, the core's), an int >= 1, or None where none was
    given; two different values are refused."""
    vals = {k: v for k, v in given.items() if v is not None}
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise InvalidArgumentError(f"{where}: {k} must be an int >= 1, got {v!r}")
    if len({int(v) for v in vals.values()}) > 1:
        both = ", ".join(f"{k}={v!r}" for k, v in vals.items())
        raise InvalidArgumentError(f"{where}: n_steps given twice with different values ({both}); give it once")
    return int(next(iter(vals.values()))) if vals else None


def _hint_frame_stack(shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Warn once where uint8 images look like a stack of frames and ``frame_stack``
    is unset: each transition then stores ``obs`` and ``next_obs`` whole, about
    ``2k`` times the frames' bytes, where a frame stack stores each frame once."""
    if dtype != np.uint8 or len(shape) != 3 or min(shape[0], shape[-1]) > 16:
        return
    k = shape[0] if shape[0] < shape[-1] else shape[-1]
    if k in (1, 3) or k > 16:  # one frame, or colour channels
        return
    axis = "first" if k == shape[0] else "last"
    # 6, 9, 12, 15 channels may be grey frames or stacks of colour frames (3 channels each)
    which = f"frame_stack={k}" if k % 3 else f"frame_stack={k} (grey frames) or {k // 3} (colour frames)"
    warnings.warn(
        f"PrioritizedReplayBuffer: observations of shape {shape} uint8 look like stacked frames on the "
        f"{axis} axis, and frame_stack is not set, so every frame is stored several times (in obs and "
        f"next_obs of consecutive transitions): pass {which} to store each frame once (for 4 frames, "
        "about 8x less memory or disk)", UserWarning, stacklevel=3)


def _say_where(core: CoreBuffer, what: str) -> None:
    """One line on a disk buffer's files: where and how big (when it is opened,
    and what is ``left`` at close). Logged to the ``bigper`` logger at INFO,
    printed to stderr where nothing handles that logger."""
    path = core.storage.path
    if path is None:
        return
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    size = sum(p.stat().st_size for p in files)
    if what == "holds":
        msg = (f"bigper: the replay buffer's files are at {path} ({core.config.storage}), {size / 1e6:.1f} MB for "
               f"{core.capacity:,} transitions")
    else:
        msg = (f"bigper: closed the replay buffer; {size / 1e6:.1f} MB stay at {path} (resume it with "
               f"mode='resume'; delete that folder when the run is done)")
    if log.hasHandlers():
        log.info(msg)
    else:
        print(msg, file=sys.stderr)
