"""Offline datasets: open a D4RL, Minari or bigper HDF5 file in place, score it, sample it by score.

::

    ds = PrioritizedReplayBuffer.from_hdf5("hopper-medium-v2.hdf5")   # read-only, in place
    ds.reprioritize(score_fn, batch_size=4096)   # every transition, in order, resumable
    batch = ds.sample(256)                       # P(i) ~ (score_i + eps) ** alpha
    ds.update_priorities(batch, td_abs)          # as with any buffer
    ds.close()                                   # changed priorities go to the sidecar

The source file is never written (see ``offline/h5source.py`` for how each
layout maps onto fields); priorities live in a sidecar directory beside it
(``offline/sidecar.py``). ``add`` and ``extend`` fail: the data is read-only.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np

from ..prioritization._tree_kernels import first_bad_priority
from .sidecar import Sidecar, SidecarMismatchError, _xxh, key_params
from ..tensors.lazy import as_numpy
from ..config import Config
from ..prioritization import make as make_prioritization
from ..schedules import schedule_from_dict
from ..core import legacy
from ..core.layout import own_names, storage_growth, storage_specs
from ..core.opening import recorded_frames
from ..core.statecheck import RING_ARRAYS, check_state
from ..frames.store import FrameStore
from ..core.units import unit_class
from .h5source import LIVE, H5Source, OfflineDatasetError, in_order
from ..errors import (CorruptSnapshotError, InvalidArgumentError, InvalidTypeError,
                     PathNotFoundError)

__all__ = ["open_dataset", "score_all", "watch_priorities", "finish_priorities", "describe", "load_score_fn", "OfflineDatasetError",
           "SidecarMismatchError"]


def open_dataset(dataset, *, layout: str = "auto", priorities=None, prioritization=None, alpha=None,
              eps=None, beta=None, max_priority=None, weight_norm=None, gamma=None, seed=0,
              cache_bytes: int = 64 << 20, allow_external: bool = False):
    """Open an HDF5 dataset in place: what ``PrioritizedReplayBuffer.from_hdf5``
    builds a read-only prioritized buffer of.

    Parameters
    ----------
    dataset : str or Path
        A D4RL or bigper HDF5 file, or a Minari dataset (its directory or its ``main_data.hdf5``).
    layout : {"auto", "d4rl", "minari", "bigper"}
    priorities : str or Path, optional
        The sidecar directory (default ``<dataset>.priorities``). Its priorities are
        resumed; one made for another dataset raises ``SidecarMismatchError``.
    prioritization : {"proportional", "rank"}, optional
        How priorities become probabilities, as for ``PrioritizedReplayBuffer``;
        unset means "proportional", or for bigper's layout what the file recorded.
        Scores and saved priorities serve either: rank ranks the dataset by them.
    alpha, eps, beta, max_priority, weight_norm, gamma : optional
        As for ``PrioritizedReplayBuffer``; unset means the defaults (0.6, 1e-6, 0.4,
        None, "global", 0.99), or for bigper's layout the values the file recorded.
    seed : int
        Seed of the sampling RNG.
    cache_bytes : int
        h5py chunk cache for datasets read through h5py (compressed ones).
    allow_external : bool
        Read datasets whose data lies outside the file (HDF5 external raw storage,
        external links, virtual datasets of other files). Off by default: an untrusted
        file could otherwise return the bytes of any file you can read. Refused ones
        raise ``OfflineDatasetError`` naming the dataset and its target.

    Returns
    -------
    (Config, H5Source, (meta, arrays))
        The buffer's config (``capacity`` is the number of transitions, or
        slots for bigper's layout), the dataset as an allocated storage, and
        the state the buffer starts from. Priorities: the keys saved at close
        by a buffer of the same prioritization and parameters, else the
        scores of the last complete ``reprioritize``, else the key 1.0 for
        every sampleable transition.
    """
    src = H5Source(dataset, layout=layout, cache_bytes=cache_bytes, allow_external=allow_external, taken=own_names())
    try:
        cfg = _config(src, prioritization=prioritization, alpha=alpha, eps=eps, beta=beta, max_priority=max_priority,
                      weight_norm=weight_norm, gamma=gamma, seed=seed)
        where = Sidecar.default_path(dataset) if priorities is None else Path(priorities).expanduser()
        sidecar = Sidecar(where, src.fingerprint(), src.n, protect=src.file_id)
        sidecar.load()
        frames = FrameStore(cfg, None, **_held(src)) if cfg.frame_stack else None
        specs, growth = storage_specs(cfg, frames), storage_growth(cfg, frames)
        src.allocate(specs, growth)
        state = _initial_state(cfg, src, sidecar)
        src.opened()  # (the state holds what the buffer takes of the record: the rest goes now)
        src.sidecar = sidecar
    except BaseException:
        src.close()
        raise
    return cfg, src, state


def _held(src: H5Source) -> dict:
    """``FrameStore``'s ``offsets`` and ``index`` of a bigper file: the
    layout of its frame arrays as recorded (None: a new buffer's). A file
    of the older format (its references whole, ``obs_ref``,
    ``next_obs_ref``) has them converted in memory first, never written
    (``core/legacy.py``): its recorded state checked, then its references
    (every live one naming frames the file holds)."""
    if src.recorded is None:
        return {}
    held = recorded_frames({"arrays": src.recorded_arrays})
    rcfg = Config.from_dict(src.recorded[0])  # (as the writer recorded it: its state is that config's)
    if legacy.is_older(rcfg, src.recorded_arrays):
        check_state(rcfg, src.recorded[1], src.recorded[2])
        held["offsets"] = legacy.convert(rcfg, src, {"arrays": src.recorded_arrays},
                                         (src.recorded[1], src.recorded[2]), src.file_path)
    return held


def watch_priorities(src: H5Source, cfg: Config, leaves) -> None:
    """Keep the priorities a buffer over ``src`` changes: at close, keys that
    differ from the ones it opened with go to the sidecar. ``leaves``: a
    callable (a weak method of the buffer) giving every slot's key, or None
    once the buffer is gone."""
    src.leaves_digest = _xxh(leaves()())
    src.on_close = partial(_save_changed_leaves, leaves, cfg, src)


def finish_priorities(src: H5Source, leaves: np.ndarray) -> None:
    """The buffer's keys after ``score_all``'s scores were assigned: not "changed" at close."""
    src.leaves_digest = _xxh(leaves)


def _config(src: H5Source, *, prioritization, alpha, eps, beta, max_priority, weight_norm, gamma,
            seed) -> Config:
    if src.recorded is not None:  # bigper's layout: its recorded config, with these overrides
        rec = Config.from_dict(src.recorded[0])
        base = {k: getattr(rec, k) for k in inspect.signature(Config.build).parameters if hasattr(rec, k)}
        base["beta"] = schedule_from_dict(rec.beta)
    else:
        base = {"capacity": src.n, "fields": src.fields(), "next_of": src.next_of}
    given = {"prioritization": prioritization, "alpha": alpha, "eps": eps, "beta": beta, "max_priority": max_priority,
             "weight_norm": weight_norm, "gamma": gamma}
    base.update({k: v for k, v in given.items() if v is not None})
    base.update(seed=seed, storage="hdf5")
    return Config.build(**base)


def _initial_state(cfg: Config, src: H5Source, sidecar: Sidecar) -> tuple[dict, dict]:
    """The buffer state a dataset starts from (checked by the buffer like any
    recorded state): its transitions, ends and, for bigper's own layout, what
    its writer recorded (frame ring included, its priorities not), with a
    fresh RNG and beta schedule and the priorities of the sidecar, given to
    a strategy of ``cfg.prioritization``."""
    n = src.n
    fresh = np.random.default_rng(cfg.seed).bit_generator.state
    if src.recorded is None:
        meta = {"count": n, "max_leaf": 1.0, "beta_step": 0, "rng": fresh,
                "env_ended": [True] * cfg.num_envs}
        arrays = {"gid": np.arange(n, dtype=np.int64), "status": np.asarray(src.status, dtype=np.uint8),
                  "ends": np.asarray(src.ends, dtype=np.uint8),
                  "pending": np.zeros(n if cfg.n_step > 1 else 0, dtype=np.float64)}
    else:
        meta = dict(src.recorded[1], rng=fresh, beta_step=0)
        # the ring and, with sequences, the item tables (items hold the keys there)
        carried = RING_ARRAYS + unit_class(cfg).ARRAYS
        arrays = {k: v for k, v in src.recorded[2].items() if k in carried}
    live = np.asarray(arrays[unit_class(cfg).status_key]) == LIVE
    prio = _strategy(cfg)
    keys = _initial_keys(cfg, prio, live, sidecar)
    prio.assign(keys, live)
    pmeta, parrays = prio.state()
    meta.pop("prioritization", None)
    if pmeta:
        meta["prioritization"] = pmeta
    arrays.update(parrays)
    # every key the state holds counts (pending ones a writer recorded too: checked against it)
    held = [keys[live]] + [np.asarray(arrays[k], dtype=np.float64) for k in ("pending", "seq_pending") if k in arrays]
    meta["max_leaf"] = max(1.0, *(float(a.max(initial=0.0)) for a in held))
    return meta, arrays


def _strategy(cfg: Config):
    return make_prioritization(cfg.prioritization, cfg.capacity, alpha=cfg.alpha, eps=cfg.eps,
                               max_priority=np.inf if cfg.max_priority is None else cfg.max_priority,
                               weight_norm=cfg.weight_norm)


def _initial_keys(cfg: Config, prio, live: np.ndarray, sidecar: Sidecar) -> np.ndarray:
    """Keys, ``(capacity,)``: saved ones if they fit ``cfg``, else the scores'
    (the last complete reprioritize), else 1.0; 0.0 where not ``live``."""
    saved = sidecar.leaves(cfg.prioritization, cfg.alpha, cfg.eps, cfg.max_priority)
    if saved is not None:
        saved = np.where(live, saved, 0.0)
        if cfg.max_priority is not None:  # no key above what max_priority gives was ever saved
            top = float(prio.keys(np.array([float(cfg.max_priority)]))[0])
            i = int(np.argmax(saved))
            if saved[i] > top * (1 + 1e-12):
                raise CorruptSnapshotError(
                    f"{sidecar.path}: the saved key {saved[i]!r} of slot {i} is above {top!r}, the "
                    f"largest key max_priority={cfg.max_priority} gives")
        return saved
    if (was := sidecar.saved_with()) is not None:
        now = key_params(cfg.prioritization, cfg.alpha, cfg.eps, cfg.max_priority)
        diff = [k for k in now if was.get(k, now[k]) != now[k]] or [k for k in was if k not in now]
        warnings.warn(f"{sidecar.path}: priorities saved at close with {_params(was, diff)} are not "
                      f"used with {_params(now, diff)}; the buffer starts from the scores or 1.0",
                      stacklevel=4)
    scores = sidecar.scores()
    if scores is None:
        return live.astype(np.float64)
    out = np.zeros(live.shape[0], dtype=np.float64)
    out[live] = prio.keys(np.ascontiguousarray(scores[live], dtype=np.float64))
    return out


def _params(d: dict, keys) -> str:
    return ", ".join(f"{k}={d[k]!r}" for k in keys if k in d)


def _save_changed_leaves(leaves_ref, cfg: Config, src: H5Source) -> None:
    """At close: priorities changed by update_priorities go to the sidecar (as the strategy's keys)."""
    all_leaves = leaves_ref()
    if all_leaves is None:
        return
    leaves = all_leaves()
    if _xxh(leaves) == src.leaves_digest:
        return
    sc = src.sidecar
    try:
        sc.lock()
        try:
            sc.save_leaves(leaves, cfg.prioritization, cfg.alpha, cfg.eps, cfg.max_priority)
        finally:
            sc.unlock()
    except Exception as e:  # closing must not fail; the data is untouched either way
        warnings.warn(f"could not save the changed priorities to {sc.path}: {e}", stacklevel=4)


# -- reprioritize ---------------------------------------------------------------------
def score_all(src, live: np.ndarray, read_batch, score_fn, *, batch_size: int = 4096,
              progress: bool = True, restart: bool = False, commit_seconds: float = 2.0):
    """Score every sampleable transition of a dataset in order, durably.

    Parameters
    ----------
    src : H5Source
        The dataset (opened by ``open_dataset``).
    live : np.ndarray of int64
        Its sampleable slots, ascending.
    read_batch : callable
        ``read_batch(idx, at) -> Batch`` of the slots ``idx`` (``at``: the same
        slots as a slice where they are a run).
    score_fn : callable
        ``score_fn(batch) -> (B,)`` non-negative finite scores (numpy or torch), e.g.
        ``|TD error|``. ``batch.indices`` are the slots.
    batch_size : int
        Transitions per call.
    progress : bool
        A progress bar with rate and ETA (tqdm).
    restart : bool
        Ignore an interrupted run and start over (by default it is resumed).
    commit_seconds : float
        Scores are made durable in the sidecar at most this many seconds apart, and
        whenever ``score_fn`` raises: a new call resumes after the last scored chunk.

    Returns
    -------
    np.ndarray of float64 (n,) or None
        Every slot's score (0 where not sampleable), kept raw in the sidecar;
        None when nothing is sampleable. The caller makes them the priorities
        (proportional: leaves ``(min(score, max_priority) + eps) ** alpha``
        and one O(N) rebuild; rank: one full sort). A bad score (NaN, inf,
        negative, wrong length) raises before anything of its chunk is written.
    """
    if not isinstance(src, H5Source):
        raise InvalidTypeError("reprioritize works on buffers opened with PrioritizedReplayBuffer.from_hdf5; "
                               f"this one has storage {src.kind!r}")
    if not callable(score_fn):
        raise InvalidTypeError(f"score_fn must be callable, got {score_fn!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
    batch_size = int(batch_size)
    sc = src.sidecar
    sc.load()
    total = live.shape[0]
    entry, done, scores = None, 0, np.zeros(src.n, dtype=np.float64)
    if not restart and (resumed := sc.partial()) is not None and resumed[1]["total"] == total:
        scores, entry = resumed
        done = entry["done"]
    committed = done
    bar = _bar(total, done, progress, src.path.name)
    try:
        with in_order(src) as let_go:  # (the frames in order: read-ahead pays, and is let go of)
            last = time.monotonic()
            while done < total:
                idx = live[done:done + batch_size]
                lo, hi = int(idx[0]), int(idx[-1]) + 1
                at = slice(lo, hi) if hi - lo == idx.shape[0] else idx  # a run of slots: slices, no gathers
                s = _check_scores(score_fn(read_batch(idx, at)), idx, done, src.path)
                if not sc.locked:  # the first good chunk: only now is anything written
                    sc.lock()
                if entry is None:
                    entry = sc.start_run(total, batch_size)
                scores[at] = s
                sc.write_scores(entry, lo, scores[lo:hi])
                done += idx.shape[0]
                bar.update(idx.shape[0])
                let_go()  # (the frames it read: a 50M pass would otherwise map the whole file)
                if done < total and time.monotonic() - last >= commit_seconds:
                    sc.commit_progress(entry, done, scores, hi)
                    committed, last = done, time.monotonic()
            if entry is not None:
                if not sc.locked:  # resumed with nothing left to score
                    sc.lock()
                sc.finish_run(entry, scores)
    except BaseException:
        if entry is not None and done > committed:
            sc.lock()
            sc.commit_progress(entry, done, scores, int(live[done - 1]) + 1)
        raise
    finally:
        bar.close()
        sc.unlock()
    return None if entry is None else scores


def _bar(total: int, initial: int, progress: bool, name: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not progress, unit="tr", unit_scale=True,
                desc=f"reprioritize {name}", smoothing=0.1, mininterval=0.5)


def _check_scores(s, idx: np.ndarray, done: int, where) -> np.ndarray:
    n = idx.shape[0]
    if s is None:
        raise InvalidTypeError(f"score_fn returned None for transitions {done}..{done + n - 1} of {where}; "
                        f"it must return ({n},) scores")
    a = np.asarray(as_numpy(s))
    if a.dtype.kind not in "fiub":
        raise InvalidTypeError(f"score_fn must return numbers, got dtype {a.dtype} for transitions "
                        f"{done}..{done + n - 1} of {where}")
    a = a.astype(np.float64, copy=False)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.shape != (n,):
        raise InvalidArgumentError(f"score_fn returned scores of shape {a.shape} for a batch of {n} transitions "
                         f"({done}..{done + n - 1} of {where}); expected shape ({n},). Nothing of this "
                         "batch was written")
    i = first_bad_priority(np.ascontiguousarray(a))
    if i >= 0:
        raise InvalidArgumentError(f"score_fn returned {a[i]} for transition {done + i} (slot {idx[i]}, position {i} "
                         f"of its batch) of {where}; scores must be finite and >= 0. Nothing of this "
                         "batch was written")
    return a


# -- command-line helpers -------------------------------------------------------------------
def load_score_fn(spec: str):
    """``"package.module:function"`` (or ``"path/to/file.py:function"``) -> the function."""
    mod_name, sep, attr = str(spec).partition(":")
    if not sep or not mod_name or not attr:
        raise InvalidArgumentError(f"--score must look like package.module:function, got {spec!r}")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise PathNotFoundError(f"--score: no file {path}")
        mspec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"--score: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidTypeError(f"--score: {spec} is not callable")
    return obj


def describe(path, priorities=None) -> str:
    """A few lines on an HDF5 dataset: layout, transitions, fields and where they come from, priorities."""
    src = H5Source(path, taken=own_names())
    try:
        live = int((src.status == LIVE).sum())
        episodes = src.starts.shape[0] - 1 if src.layout == "minari" else None
        if src.layout == "d4rl":
            ends = src.ends != 0
            episodes = int(ends.sum()) + int(not ends[-1])
        lines = [f"{src.path}: {src.layout} layout, read in place ({src.file_path.stat().st_size / 1e6:,.1f} MB)",
                 f"  transitions: {src.n:,} ({live:,} sampleable)"
                 + (f", episodes: {episodes:,}" if episodes is not None else "")]
        lines.append("  fields:")
        w = max(len(n) for n in src.columns)
        for name, col in src.columns.items():
            lines.append(f"    {name:<{w}}  {str(col.shape):<14} {str(col.dtype.newbyteorder('=')):<8} "
                         f"<- {col.source}  ({col.mapping()})")
        lines.append(f"    {'terminated':<{w}}  {'()':<14} {'bool':<8} <- end flags, bit 0")
        lines.append(f"    {'truncated':<{w}}  {'()':<14} {'bool':<8} <- end flags, bit 1")
        rc = src.recorded[0] if src.recorded is not None else {}
        if isinstance(rc, dict) and rc.get("frame_stack"):
            lines.append(f"  obs, next_obs: stacks of {rc['frame_stack']!s:.12} frames, each frame stored once"
                         + (f"; compression {rc.get('compression')!s:.20}, {rc.get('compression_budget')!s:.20} "
                            "log bytes a frame" if rc.get("compression") else ""))
        lines.extend(f"  note: {n}" for n in src.notes)
        where = Sidecar.default_path(path) if priorities is None else Path(priorities)
        sc = Sidecar(where, src.fingerprint(), src.n, protect=src.file_id)
        try:
            sc.load()
            lines.append("  " + sc.describe())
        except Exception as e:
            lines.append(f"  priorities: {where}: unusable: {e}")
        return "\n".join(lines)
    finally:
        src.close()
