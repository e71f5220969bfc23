"""``bigper convert``: a compressed bigper HDF5 dataset from an uncompressed one.

::

    convert("pong-d4rl.h5", "pong-zstd.h5")       # D4RL, Minari or bigper layout in
    ds = PrioritizedReplayBuffer.from_hdf5("pong-zstd.h5")   # frames zstd-compressed

The source is opened as ``from_hdf5`` opens it (read-only, in place) and its
sampleable transitions are read in stream order (file order; for bigper's
layout, the order they were added), in chunks, and ``extend``-ed into a new
``storage="hdf5"`` buffer with ``frame_stack`` and ``compression="zstd"``:
each distinct frame is stored once, compressed, and every transition comes
back byte for byte. The priority keys the source opens with (its sidecar's,
else 1.0) become the new buffer's.

Nothing is ever written to the source. The new file is written as
``<dst>.partial`` and published only when it is complete and closed, its
priorities sidecar first, an overwrite's older file moved aside first
(``offline/publish.py`` says how, and how a killed run is recovered): a
crash or kill -9 midway leaves no destination, and never a file beside
another's priorities. The ``<dst>.partial*`` names are convert's own.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .buffer import PrioritizedReplayBuffer
from .errors import BigperError, InvalidArgumentError, InvalidTypeError, PathExistsError
from .core.layout import allocate
from .config import Config
from .frames.store import frame_capacity, require_compression
from .common.files import real_names
from .storage.hdf5 import HDF5Storage
from .frames.segments import log_geometry
from .common.status import EMPTY
from .offline.h5source import in_order
from .offline.publish import (DstLock, check_dst, check_leftovers, check_not_source, drop_leftover, drop_sidecar,
                              kept_at_partial, publish, refuse_open, remove, settled, sidecar_of)

__all__ = ["convert", "infer_frame_stack"]

LIVE = 1
# A leading axis this small on a 3-D observation is taken for a stack of frames
# ((4, 84, 84)); (84, 84, 3) images are not: they need --frame-stack, and are refused.
_MAX_INFERRED_STACK = 16


def infer_frame_stack(shape: tuple, frame_stack=None) -> int:
    """The frame stack of ``obs`` rows of ``shape``: ``frame_stack`` when given
    (it must be ``shape[0]``), else ``shape[0]`` for a ``(K, H, W)`` stack with
    a small ``K``. ``InvalidArgumentError`` naming the field and shape otherwise."""
    shape = tuple(shape)
    if frame_stack is not None:
        if isinstance(frame_stack, bool) or not isinstance(frame_stack, (int, np.integer)) or frame_stack < 1:
            raise InvalidArgumentError(f"frame_stack must be an int >= 1, got {frame_stack!r}")
        if len(shape) < 2 or shape[0] != frame_stack:
            raise InvalidArgumentError(
                f"frame_stack={frame_stack} needs the source's 'obs' rows to be stacks of shape "
                f"({frame_stack}, ...); its 'obs' rows have shape {shape}")
        return int(frame_stack)
    if len(shape) == 3 and 1 <= shape[0] <= _MAX_INFERRED_STACK:
        return int(shape[0])
    raise InvalidArgumentError(
        f"the source's 'obs' rows have shape {shape}, which is not a stack of frames (K, H, W) with "
        f"K <= {_MAX_INFERRED_STACK}; compression stores the frames of frame stacks: give frame_stack "
        "(--frame-stack K) if axis 0 is the stack")


def convert(src, dst, *, frame_stack=None, budget=None, overwrite: bool = False, progress: bool = True,
            chunk: int = 512, layout: str = "auto", allow_external: bool = False) -> dict:
    """Write ``dst``, a bigper HDF5 dataset with ``compression="zstd"``, from ``src``.

    Parameters
    ----------
    src : str or Path
        A D4RL or bigper HDF5 file, or a Minari dataset (as ``from_hdf5`` takes it). Never written.
    dst : str or Path
        The new file. Written as ``<dst>.partial`` and renamed into place at the end.
    frame_stack : int, optional
        Frames per ``obs`` stack; default: axis 0 of ``obs`` rows of shape ``(K, H, W)``
        (for bigper's layout, its recorded ``frame_stack``).
    budget : int, optional
        ``compression_budget``: a cap of log bytes a frame (default: none, the log grows as the
        frames need).
    overwrite : bool
        Replace an existing regular file at ``dst`` (else ``PathExistsError``; one a buffer
        has open is ``StorageLockedError``).
    progress : bool
        A tqdm progress bar (rate, ETA).
    chunk : int
        Transitions read and written at a time.
    layout, allow_external
        As for ``from_hdf5``.

    Returns
    -------
    dict
        ``transitions`` (converted), ``skipped`` (held but not sampleable in the
        source: a D4RL timeout without its next observation), ``frame_stack``,
        ``src_bytes``, ``dst_bytes``, ``dst`` (its absolute path).
    """
    for name, value in (("overwrite", overwrite), ("progress", progress)):
        if not isinstance(value, bool):
            raise InvalidTypeError(f"{name} must be True or False, got {value!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise InvalidArgumentError(f"chunk must be an int >= 1, got {chunk!r}")
    if not isinstance(dst, (str, os.PathLike)):
        raise InvalidTypeError(f"dst must be a str or os.PathLike, got {type(dst).__name__} {dst!r:.80}")
    dst = Path(os.path.abspath(os.path.expanduser(dst)))
    # The folder resolved once (promise 11): a symlinked parent re-pointed while converting
    # never sends the publish (or its lock) to another folder; dst itself is not followed.
    dst = Path(os.path.realpath(dst.parent)) / dst.name
    partial = dst.with_name(dst.name + ".partial")
    try:
        check_dst(dst, overwrite, partial)
    except PathExistsError as e:
        raise settled(e, partial, dst) from None
    source = PrioritizedReplayBuffer.from_hdf5(src, layout=layout, allow_external=allow_external)
    lock = None
    try:
        store = source.storage
        check_not_source(store, dst, partial)
        cfg = _source_config(source, store, frame_stack)
        order = _stream_order(source)
        n = int(order.shape[0])
        if n == 0:
            raise InvalidArgumentError(f"{store.path} has no sampleable transition to convert")
        # dst's own lock, the one a writer or reader of a buffer there holds, before anything
        # at dst changes (promises 5 and 11): a live buffer's file is never replaced under it
        lock = DstLock(dst)
        try:
            check_dst(dst, overwrite, partial, locked=True)  # again, under the lock
        except PathExistsError as e:
            raise settled(e, partial, dst) from None
        if overwrite:
            refuse_open(dst)  # (the older file, open in a reader)
        check_leftovers(partial, dst)  # (what a killed publish may have left at names of the partial's)
        keys = source.leaves(order)
        _config(cfg, n, budget)  # (the arguments' every refusal before anything at dst changes)
        require_compression()
        if os.path.lexists(sidecar_of(dst)):  # (a killed publish's, recognized: see check_dst)
            drop_leftover(partial, dst)  # (before the partial it was proven against is replaced)
        made = []  # set once the partial file is ours (its lock taken, its record written)
        try:
            cap = n
            kept, used, fw = _write(source, partial, cfg, cap, order, keys, budget, chunk, progress,
                                    store.path.name, made)
            given = budget is not None
            for _ in range(1 if given else 3):
                if kept == n:
                    break
                # The frames (short episodes: each start adds frames) outgrew the frame ring, or
                # their compressed bytes (frames that compress worse than a given budget) the
                # log: once more, with a frame ring that holds every frame (a log without a
                # budget grows to hold every byte). Slots past n stay empty (never sampled).
                cap = max(cap, n + max(0, fw + 1 - frame_capacity(n, cfg["frame_stack"], 1)))
                kept, used, fw = _write(source, partial, cfg, cap, order, keys, budget, chunk, progress,
                                        store.path.name, made)
            if kept < n:
                fits, _ = _fit(used, cfg, cap)
                hint = (f"budget={fits} (--budget) holds them all" if fits < _row_bytes(cfg) else
                        "they barely compress: leave budget unset and convert makes room for them")
                raise InvalidArgumentError(
                    f"compression_budget={budget} bytes a frame is too small for the frames of {store.path}: "
                    f"the log wrapped and only {kept:,} of {n:,} transitions stayed sampleable; "
                    f"{hint} (nothing was written at {dst})")
            if np.any(keys != 1.0):  # 1.0 is what a dataset without a sidecar starts from
                _save_priorities(partial, dst, keys, cfg)
        except BaseException as e:
            if made:
                drop_sidecar(sidecar_of(partial))
                remove(partial)
            raise real_names(e, where=partial)  # the path as given, not /proc/self/fd/N
        src_bytes = store.nbytes()
        try:
            publish(partial, dst, overwrite)
        except (BigperError, OSError) as e:
            if os.path.lexists(partial):  # (refused before the link: the complete file is kept, and named)
                raise kept_at_partial(e, partial) from None
            raise
    finally:
        try:
            source.close()
        finally:
            if lock is not None:
                lock.release()
    return {"transitions": n, "skipped": int(store.n) - n if store.recorded is None else
            int((np.asarray(store.status) != EMPTY).sum()) - n,
            "frame_stack": cfg["frame_stack"], "src_bytes": int(src_bytes),
            "dst_bytes": int(os.stat(dst).st_size), "dst": str(dst)}


def _write(source, partial: Path, cfg: dict, cap: int, order, keys, budget, chunk, progress, name,
           made) -> tuple[int, int, int]:
    """Write ``partial`` (replacing a leftover) with capacity ``cap``; ``(transitions
    sampleable in it, log bytes its frames took, frames written)``."""
    n = order.shape[0]
    out = _open_partial(partial, _config(cfg, cap, budget))
    made.append(True)
    try:
        _copy(source, out, order, chunk, progress, name, cfg)
        live = out.status == LIVE
        full = np.zeros(cap, dtype=np.float64)
        full[:n] = keys
        out.prioritization.assign(full, live)
        out.shard.raise_max_leaf(float(keys.max()))  # new rows enter at the source's largest key
        meta, _ = out.state_dict()
        fm = meta["frames"]
        _, seg, _ = log_geometry(frame_capacity(cap, cfg["frame_stack"], 1), _row_bytes(cfg),
                                 out.config.compression_budget)
        return int(live.sum()), int(fm["seg"]) * seg + int(fm["pos"]), int(fm["fw"])
    finally:
        out.close()  # a complete record even of a partial file: the next convert replaces it


def _config(cfg: dict, cap: int, budget) -> Config:
    """The new buffer's config at capacity ``cap`` (``InvalidArgumentError`` for a ``budget`` no
    buffer takes)."""
    return Config.build(
        capacity=cap, fields=cfg["fields"], frame_stack=cfg["frame_stack"], next_of=cfg["next_of"],
        alpha=cfg["alpha"], eps=cfg["eps"], max_priority=cfg["max_priority"], gamma=cfg["gamma"],
        prioritization=cfg["prioritization"], storage="hdf5", compression="zstd", compression_budget=budget)


def _open_partial(partial: Path, cfg: Config) -> PrioritizedReplayBuffer:
    """A new buffer of ``cfg`` in the HDF5 storage at ``partial``. What a killed
    convert left there (open, so unclean) is replaced as a snapshot load replaces
    a dead writer's file: under the lock, and only when it carries bigper's marker
    (anything else is ``PathExistsError``; a live convert's, ``StorageLockedError``)."""
    require_compression()
    store = HDF5Storage(partial, takeover=True)
    store.open(cfg.to_dict())
    try:
        allocate(store, cfg)
        return PrioritizedReplayBuffer.from_parts(cfg, store)
    except BaseException:
        store.abort()
        raise


def _row_bytes(cfg: dict) -> int:
    shape, dtype = cfg["fields"]["obs"]
    return int(np.prod(shape[1:])) * np.dtype(dtype).itemsize


def _fit(used: int, cfg: dict, cap: int) -> tuple[int, int]:
    """``(budget, capacity)`` whose log holds ``used`` bytes with room for the
    segment the ring keeps open (a sixteenth of the log, or less). A budget is
    at most a frame's bytes: frames that compress to more (noise, tiny frames)
    get that and more frame slots (``capacity`` grows; the slots stay empty)."""
    frames = frame_capacity(cap, cfg["frame_stack"], 1)
    want = max(64, math.ceil(used * 1.15 / frames) + 64)
    row = _row_bytes(cfg)
    if want <= row:
        return int(want), int(cap)
    return int(row), int(cap + math.ceil(frames * want / row) - frames)


def _save_priorities(partial: Path, dst: Path, keys: np.ndarray, cfg: dict) -> None:
    """The source's keys, slot by slot of the new file, into the sidecar beside
    ``partial`` (``<dst>.partial.priorities``), made for ``dst``: what
    ``from_hdf5(dst)`` opens with (as if saved at close by a buffer of these
    parameters) once ``publish`` has renamed it, before the file, into place."""
    from .offline.sidecar import Sidecar
    from .offline.h5source import H5Source

    side = sidecar_of(partial)
    drop_sidecar(side)  # a killed run's
    src = H5Source(partial)
    try:
        sc = Sidecar(side, dict(src.fingerprint(), name=dst.name), src.n, protect=src.file_id)
        sc.load()
        full = np.zeros(src.n, dtype=np.float64)  # slots past the transitions stay empty
        full[:keys.shape[0]] = keys
        sc.lock()
        try:
            sc.save_leaves(full, cfg["prioritization"], cfg["alpha"],
                           cfg["eps"], cfg["max_priority"])
        finally:
            sc.unlock()
    finally:
        src.close()


def _source_config(source: PrioritizedReplayBuffer, store, frame_stack) -> dict:
    """The new buffer's fields and parameters: the source's (as ``from_hdf5``
    built its config; for bigper's layout, the recorded one), with ``frame_stack``."""
    c = source.config
    if c.num_envs != 1 or c.n_step != 1 or c.sequence is not None:
        raise InvalidArgumentError(
            f"{store.path} was recorded with num_envs={c.num_envs}, n_step={c.n_step}"
            f"{', sequence items' if c.sequence is not None else ''}; convert reads one stream of "
            "one-step transitions (num_envs=1, n_step=1)")
    fields = {n: (tuple(s), np.dtype(d)) for n, (s, d) in c.fields.items()}
    if "obs" not in fields:
        raise InvalidArgumentError(f"{store.path} has no 'obs' field to compress (fields: {sorted(fields)})")
    if "obs" not in c.next_of:
        raise InvalidArgumentError(f"{store.path}: field 'obs' has no successor next_obs; frame stacks need one")
    if c.frame_stack and frame_stack is None:
        frame_stack = c.frame_stack
    k = infer_frame_stack(fields["obs"][0], frame_stack)
    return {"fields": fields, "next_of": tuple(c.next_of), "frame_stack": k, "alpha": c.alpha, "eps": c.eps,
            "max_priority": c.max_priority, "gamma": c.gamma, "prioritization": c.prioritization}


def _stream_order(source: PrioritizedReplayBuffer) -> np.ndarray:
    """Sampleable slots in the order they were added (file order for D4RL and Minari)."""
    live = np.flatnonzero(source.status == LIVE)
    return live[np.argsort(source.generations[live], kind="stable")]


def _copy(source, out, order: np.ndarray, chunk: int, progress: bool, name: str, cfg: dict) -> None:
    from tqdm.auto import tqdm

    names = {"terminated", "truncated", *cfg["fields"], *(f"next_{n}" for n in cfg["next_of"])}
    with tqdm(total=order.shape[0], disable=not progress, unit="tr", unit_scale=True,
              desc=f"convert {name}", smoothing=0.1, mininterval=0.5) as bar, \
            in_order(source.storage) as let_go:  # (an HDF5 dataset's map: read ahead, let go of)
        for lo in range(0, order.shape[0], chunk):
            idx = order[lo:lo + chunk]
            data = source.gather(idx)
            out.extend({k: v for k, v in data.items() if k in names})
            let_go()
            bar.update(idx.shape[0])
