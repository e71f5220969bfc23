"""What every prioritized SB3 algorithm shares, written once.

``PrioritizedAlgorithm`` goes before the SB3 algorithm in the bases
(``class PrioritizedSAC(PrioritizedAlgorithm, SAC)``). It checks and wires
the replay buffer, and gives each algorithm's ``train`` three calls that
replace SB3's sampling and loss lines, nothing else:

- ``self._per_sample(batch_size)``: SB3's ``sample`` with this gradient
  step's beta (annealed from the buffer's ``beta`` to 1.0 over ``learn``,
  unless the buffer has a schedule or ``beta_steps``);
- a loss from ``mse_loss`` / ``huber_loss`` / ``quantile_loss`` below: SB3's
  loss with each transition's term weighted by its IS weight (with weights
  all 1 it equals SB3's, to rounding), and ``|TD|`` per transition;
- ``self._per_write_back(data, td)``: ``|TD|`` written back as priorities.

What ``|TD|`` is for each kind of critic: one Q-value, ``|Q - y|``; several
critics (TD3, SAC), the mean of their ``|Q_k - y|`` (a transition that any
critic gets wrong keeps a high priority); quantiles (QR-DQN, TQC), the mean of
``|y_j - theta_i|`` over every pair of target and current quantile (and
critic), the magnitude the quantile Huber loss is built from.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch as th

from ..errors import InvalidArgumentError, InvalidTypeError
from ._sb3_buffer import DEFER_OPEN, PrioritizedReplayBuffer, annealed_beta, one_n_steps
from ._sb3_pickle import beside_the_pickle, check_fits, checked_snapshot, peek_state, read_pickle, save_pickle

__all__ = ["PrioritizedAlgorithm", "annealed_beta", "huber_loss", "mse_loss", "quantile_loss", "weighted_mean"]


def weighted_mean(per_item: th.Tensor, weights: th.Tensor) -> th.Tensor:
    """``mean_b(w_b * loss_b)``: the PER correction (Schaul et al. 2016, Alg. 1)."""
    return (weights.reshape(-1) * per_item.reshape(per_item.shape[0])).mean()


def mse_loss(current_values, target: th.Tensor, weights: th.Tensor, scale: float = 1.0):
    """SB3's ``scale * sum_k F.mse_loss(Q_k, y)`` over critics, IS-weighted,
    and ``|TD|`` averaged over critics. Returns ``(loss, td (B,))``."""
    sq = sum((q - target) ** 2 for q in current_values)
    td = th.stack([(q - target).detach().abs().reshape(-1) for q in current_values]).mean(dim=0)
    return scale * weighted_mean(sq, weights), td


def huber_loss(current: th.Tensor, target: th.Tensor, weights: th.Tensor):
    """SB3 DQN's ``F.smooth_l1_loss(Q, y)``, IS-weighted; ``(loss, |Q - y| (B,))``."""
    per_item = th.nn.functional.smooth_l1_loss(current, target, reduction="none")
    return weighted_mean(per_item, weights), (current - target).detach().abs().reshape(-1)


def quantile_loss(current: th.Tensor, target: th.Tensor, weights: th.Tensor, sum_over_quantiles: bool):
    """sb3-contrib's quantile Huber loss (QR-DQN: ``current`` (B, N), ``target``
    (B, N'); TQC: (B, critics, N) and (B, 1, N')), each transition's part
    IS-weighted; with weights 1 it is the batch mean sb3-contrib takes.
    Returns ``(loss, td (B,))`` with ``td`` the mean ``|y_j - theta_i|``."""
    b, n = current.shape[0], current.shape[-1]
    delta = target.unsqueeze(-2) - current.unsqueeze(-1)  # (..., N current, N' target)
    a = delta.abs()
    huber = th.where(a > 1, a - 0.5, 0.5 * delta ** 2)
    tau = ((th.arange(n, device=current.device, dtype=th.float) + 0.5) / n).reshape(n, 1)
    elem = (tau - (delta.detach() < 0).float()).abs() * huber
    if sum_over_quantiles:
        elem = elem.sum(dim=-2)
    per_item = elem.reshape(b, -1).mean(dim=1)
    return weighted_mean(per_item, weights), a.detach().reshape(b, -1).mean(dim=1)


class PrioritizedAlgorithm:
    """The PER side of an SB3 off-policy algorithm; see the module docstring.

    Takes the algorithm's arguments. ``replay_buffer_class`` defaults to (and
    must be a subclass of) bigper's buffer; ``n_steps`` and ``gamma`` are
    handed to the buffer (SB3 wires them only into its own ``NStepReplayBuffer``).
    ``replay_buffer_kwargs={"device": ...}`` is the buffer's ``device_tier``
    (bigper's device tier; SB3 gives every buffer the model's ``device=``):
    True or "auto" for the model's device, where the batches are then gathered.
    """

    def __init__(self, policy, env, *args, replay_buffer_class=None, replay_buffer_kwargs=None,
                 n_steps: int | None = None, **kwargs):
        name = type(self).__name__
        if replay_buffer_class is None:
            replay_buffer_class = PrioritizedReplayBuffer
        if not (isinstance(replay_buffer_class, type) and issubclass(replay_buffer_class, PrioritizedReplayBuffer)):
            hint = ""
            if getattr(replay_buffer_class, "__name__", "") == "HerReplayBuffer":
                hint = (" HerReplayBuffer relabels goals at sampling time, which prioritized replay does not "
                        "support here: use the plain SB3 algorithm with HerReplayBuffer (uniform replay), or "
                        f"{name} on a flat observation space.")
            raise InvalidArgumentError(f"{name} needs replay_buffer_class to be bigper's "
                                       f"PrioritizedReplayBuffer or a subclass, got {replay_buffer_class!r}.{hint}")
        rb_kwargs = dict(replay_buffer_kwargs or {})
        if "device" in rb_kwargs:  # bigper's device tier (SB3 passes the model's device= itself)
            tier = rb_kwargs.pop("device")
            if "device_tier" in rb_kwargs and rb_kwargs["device_tier"] != tier:
                raise InvalidArgumentError(f"{name}: replay_buffer_kwargs gives the device tier twice, device="
                                           f"{tier!r} and device_tier={rb_kwargs['device_tier']!r}; give it once")
            rb_kwargs["device_tier"] = tier
        # One n-step count, whichever way it was spelled (SB3's n_steps, the core's n_step).
        n = one_n_steps(name, {"n_steps": n_steps, "replay_buffer_kwargs['n_steps']": rb_kwargs.pop("n_steps", None),
                               "replay_buffer_kwargs['n_step']": rb_kwargs.pop("n_step", None)})
        if n is not None and n > 1:
            rb_kwargs["n_steps"] = n
        # _setup_model (run inside the algorithm's __init__) builds the buffer;
        # its gamma follows the model's unless given.
        self._rb_gamma_default = "gamma" not in rb_kwargs
        self._per_td = []  # mean |TD| of each gradient step since the last log
        self._per_fed = None  # weak reference to the buffer last sampled from (its sampler is closed once replaced)
        self.last_beta = None
        super().__init__(policy, env, *args, replay_buffer_class=replay_buffer_class,
                         replay_buffer_kwargs=rb_kwargs, **kwargs)

    def learn(self, *args, **kwargs):
        """SB3's ``learn``, with the replay buffer's storage opened first: a path
        that cannot be opened (one that holds a buffer while ``mode`` is "new")
        is refused before any step is collected."""
        rb = self.replay_buffer
        if isinstance(rb, PrioritizedReplayBuffer) and not rb.closed:
            rb.buffer  # noqa: B018 (opens a storage deferred by load)
        return super().learn(*args, **kwargs)

    @classmethod
    def load(cls, *args, **kwargs):
        """SB3's ``load``; the replay buffer it builds makes no file until it is
        used (``learn``) or replaced (``load_replay_buffer``). A model saved by
        the plain SB3 algorithm (``SAC(...).save``) loads with bigper's buffer."""
        token = DEFER_OPEN.set(True)
        try:
            return super().load(*args, **kwargs)
        finally:
            DEFER_OPEN.reset(token)

    def _excluded_save_params(self) -> list[str]:
        # (_per_td: step means kept as tensors, maybe on a GPU; never saved: a load starts a new log)
        return [*super()._excluded_save_params(), "_per_fed", "_per_td"]

    def _setup_model(self) -> None:
        self._adopt_plain_sb3_buffer()
        if getattr(self, "_rb_gamma_default", False):
            self.replay_buffer_kwargs["gamma"] = self.gamma
        super()._setup_model()
        self._resume_beta()

    def _resume_beta(self) -> None:
        """A loaded model's buffer (or one ``load_replay_buffer`` put in) goes on
        with the beta of the model's last gradient step: ``rb.beta``, ``sample()``
        and ``last_beta`` agree, as they did before the save."""
        if getattr(self, "last_beta", None) is not None and self.replay_buffer is not None:
            self.replay_buffer.beta_for_learner(self._current_progress_remaining)

    def _adopt_plain_sb3_buffer(self) -> None:
        """A model saved by SB3's own algorithm names SB3's buffer class (set by
        its ``_setup_model``): ``ReplayBuffer`` or, with ``n_steps > 1``,
        ``NStepReplayBuffer``. Those become bigper's, with the same n-step
        returns; any other class cannot, and is refused saying why."""
        from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer

        rbc = self.replay_buffer_class
        if rbc is None or (isinstance(rbc, type) and issubclass(rbc, PrioritizedReplayBuffer)):
            return
        name = type(self).__name__
        if rbc not in (ReplayBuffer, NStepReplayBuffer):
            raise InvalidArgumentError(
                f"{name}: this model uses replay_buffer_class={getattr(rbc, '__name__', rbc)!r}, which bigper's "
                "prioritized buffer cannot stand in for (only SB3's ReplayBuffer and NStepReplayBuffer can); "
                "load it with the SB3 algorithm it was saved with")
        kw = dict(self.replay_buffer_kwargs or {})
        n = one_n_steps(name, {"n_steps": kw.pop("n_steps", None), "the model's n_steps": getattr(self, "n_steps", 1)
                               if rbc is NStepReplayBuffer else None})
        kw.pop("gamma", None)  # the model's, below
        if n is not None and n > 1:
            kw["n_steps"] = n
        self.replay_buffer_class, self.replay_buffer_kwargs = PrioritizedReplayBuffer, kw
        self.n_steps = 1  # handed to the buffer (SB3 would warn that a custom buffer ignores it)
        self._rb_gamma_default = True

    # -- the three calls a train() makes -----------------------------------------------
    def _per_sample(self, batch_size: int):
        """One gradient step's batch, drawn with this step's beta."""
        rb = self.replay_buffer
        if rb.buffer.total_priority <= 0:  # SB3 trains once num_timesteps > learning_starts, also on a fresh buffer
            raise InvalidArgumentError(
                f"{type(self).__name__}: no transition to train on yet: the replay buffer holds {len(rb.buffer)} "
                f"and none is sampleable (n_steps={rb.n_steps}: a transition is once its window completes or its "
                "episode ends). A model loaded to train on: load_replay_buffer(...) first, or let it collect "
                f"before it trains (model.learning_starts = model.num_timesteps + {max(rb.n_steps, 1) * 10})")
        beta = rb.beta_for_learner(self._current_progress_remaining)
        self.last_beta = rb.buffer.beta if beta is None else beta  # what rb.beta reads too
        ref = getattr(self, "_per_fed", None)
        fed = None if ref is None else ref()
        if fed is not rb:
            if fed is not None:  # the model's buffer was replaced: the old one's sampler stops drawing
                fed.close_sampler()
            self._per_fed = weakref.ref(rb)
        return rb.sample(batch_size, env=self._vec_normalize_env, beta=beta)

    def _per_write_back(self, data, td: th.Tensor) -> None:
        """``|TD|`` of the batch ``data`` as its new priorities (slots
        overwritten since the sample are skipped)."""
        self.replay_buffer.update_priorities(data.indices, td)
        # (kept on td's device and read once a log: ``float`` here would wait for the step's kernels,
        # a stall a step between the optimizer's launches and the next batch's)
        self._per_td.append(td.detach().mean())

    def _per_log(self) -> None:
        """``train/beta`` and ``train/td_abs`` beside SB3's own records."""
        if self._per_td:
            # (averaged in float64 on the host, one copy: a float64 td keeps its precision; MPS has no float64)
            self.logger.record("train/td_abs", float(th.stack(self._per_td).to("cpu", th.float64).mean()))
        self._per_td = []
        if self.last_beta is not None:
            self.logger.record("train/beta", self.last_beta)

    # -- saving the buffer ------------------------------------------------------------
    def save_replay_buffer(self, path) -> None:
        """Pickle the buffer as SB3 does, with its bigper snapshot in ``<path>.bigper/``
        (unless the buffer has a ``snapshot_dir``); the pickle is written atomically,
        and a closed buffer is refused before any file is opened."""
        rb = self.replay_buffer
        if rb is None:
            raise InvalidArgumentError("save_replay_buffer: this model has no replay buffer yet")
        save_pickle(rb, path)

    def load_replay_buffer(self, path, truncate_last_traj: bool = True, rewind: bool = False) -> None:
        """Replace the replay buffer by the pickled one. The file is read and
        checked first (a missing file, a FIFO, another algorithm's pickle, a
        snapshot that is gone are refused with the model's buffer as it was);
        the current buffer is closed before the load only where the pickle
        restores into the live path it holds (its lock must be free), else
        after the load succeeded.

        ``truncate_last_traj`` (SB3's meaning): each env's episode open at the
        pickle's snapshot ends there, as truncated, so no n-step window joins
        it to the episode the environment starts next; False only when the
        environments were restored to that point too. A pickle read from a
        copied run folder (a fork) loads into the copy's live path, never the
        original's; a live path holding more transitions than the pickle's
        snapshot is refused unless ``rewind=True``."""
        for name, v in (("truncate_last_traj", truncate_last_traj), ("rewind", rewind)):
            if not isinstance(v, (bool, np.bool_)):
                raise InvalidTypeError(f"load_replay_buffer: {name} must be True or False, got {v!r:.80}")
        data, where = read_pickle(path)
        state = peek_state(data, where)
        check_fits(state, where, self)
        # A run folder moved or copied with the pickle: the snapshot beside it, and the live path with it.
        state, live = beside_the_pickle(state, where) if isinstance(path, (str, os.PathLike)) else (state, None)
        checked_snapshot(state)
        old = self.replay_buffer
        ours = isinstance(old, PrioritizedReplayBuffer) and not old.closed
        if ours:  # its prepared batches are of the buffer being replaced
            old.close_sampler()
        reopen = False
        if ours and old._live_path is not None and state.get("live_path") is not None \
                and os.path.realpath(old._live_path) == os.path.realpath(state["live_path"]):
            old.close()  # the load restores into this path: its lock must be free
            reopen = True
        # peek_state unpickled everything but the drop-in's class, whose state it kept
        rb = PrioritizedReplayBuffer.__new__(PrioritizedReplayBuffer)
        try:
            rb._restore(state, live=live, rewind=bool(rewind), continue_episodes=not truncate_last_traj,
                        device=self.device)
        except BaseException:
            if reopen:  # refused (newer data there, ...): the model keeps its buffer, open as it was
                old.reopen()
            raise
        if ours and not old.closed:
            old.close()
        rb.device = self.device
        self.replay_buffer = rb
        self._resume_beta()
