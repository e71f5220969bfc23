"""``bigper convert RUN_DIR DST``: the DQN Replay Dataset (Dopamine's replay checkpoints) as
one compressed bigper HDF5 dataset.

::

    from bigper.convert_dqn import convert_dqn_replay
    convert_dqn_replay("dqn_replay/Pong/1/replay_logs", "pong-1.h5")
    ds = PrioritizedReplayBuffer.from_hdf5("pong-1.h5")    # 4-frame stacks, each frame stored once (zstd)

The run directory is checked whole first (``offline/dqn_replay.py``: every
file's type, header, size, trailer, and the small arrays' values), so a run
that disagrees with the format is refused before anything at ``DST`` changes.
Then each checkpoint's sampleable transitions (the format's rules) are
streamed, in the order they were added, into a ``storage="memmap"`` buffer
with ``frame_stack`` and ``compression="zstd"`` kept in ``DST.partial.d/``;
the frames are decompressed by other threads (one checkpoint each, ahead of
the writer), so gunzip and zstd run on every core. After each checkpoint the
buffer is snapshotted there (``Snapshots``, the newest one kept): a convert
killed at any point resumes after the last finished checkpoint when run
again with the same run directory and options. At the end the buffer's
arrays and state are copied (never recompressed) into an HDF5 file
``DST.partial``, renamed into place as ``DST``, and the work directory is
removed. A crash leaves no ``DST``.

Each checkpoint is read on its own, as Dopamine samples it: the few
transitions at the seam of two consecutive logged checkpoints (the newest
slot of one, whose successor is in the next, and the oldest of the next,
whose stack reaches back into the first) are not sampleable in either, and
are left out, about five in a million.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy as np

from .buffer import PrioritizedReplayBuffer
from .config import Config
from .core.layout import allocate
from .core.statecheck import check_state
from .errors import InvalidArgumentError, InvalidTypeError, OfflineDatasetError, PathExistsError
from .frames.budget import frame_capacity
from .frames.store import require_compression
from .offline.dqn_replay import open_run, prefetch_frames, scan_run, stream_transitions, _workers
from .offline.publish import DstLock, check_dst, publish, refuse_open, remove
from .snapshots import Snapshots
from .common.files import fsync_dir, read_json, real_names, write_json
from .storage.hdf5 import HDF5Storage
from .storage.memmap import MemmapStorage

__all__ = ["convert_dqn_replay"]

MARK = "convert.json"
FORMAT = "bigper-dqn-replay-convert"
VERSION = 1
_COPY_BYTES = 64 << 20  # bytes of an array copied into the HDF5 file at a time


def convert_dqn_replay(run_dir, dst, *, frame_stack: int = 4, overwrite: bool = False, progress: bool = True,
                       workers: int | None = None, restart: bool = False, chunk: int = 1024) -> dict:
    """Write ``dst``, a bigper HDF5 dataset (``compression="zstd"``), from a DQN Replay run.

    Parameters
    ----------
    run_dir : str or Path
        The directory of ``$store$_observation_ckpt.N.gz`` files and their companions. Never written.
    dst : str or Path
        The new file; ``DST.partial.d/`` holds the work (and what a resume continues from).
    frame_stack : int
        Frames per stack (Dopamine's ``stack_size``, 4 in the dataset; the files do not record it).
    overwrite : bool
        Replace an existing regular file at ``dst``.
    progress : bool
        A tqdm progress bar (transitions, rate, ETA).
    workers : int, optional
        Threads that decompress (default: one per core); up to ``workers - 1`` checkpoints
        are decompressed ahead of the one being written.
    restart : bool
        Discard the work of an earlier convert to ``dst`` of another run or other options
        (refused otherwise, naming it) and start over.
    chunk : int
        Transitions ``extend``-ed at a time.

    Returns
    -------
    dict
        ``transitions``, ``checkpoints``, ``resumed_after`` (checkpoints a resume found
        done), ``frame_stack``, ``src_bytes`` (the gzip files), ``dst_bytes``, ``dst``.
    """
    for name, value in (("overwrite", overwrite), ("progress", progress), ("restart", restart)):
        if not isinstance(value, bool):
            raise InvalidTypeError(f"{name} must be True or False, got {value!r}")
    for name, value in (("frame_stack", frame_stack), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if frame_stack > 64:
        raise InvalidArgumentError(f"frame_stack must be at most 64, got {frame_stack}")
    workers = _workers(workers)
    if not isinstance(dst, (str, os.PathLike)):
        raise InvalidTypeError(f"dst must be a str or os.PathLike, got {type(dst).__name__} {dst!r:.80}")
    dst = Path(os.path.abspath(os.path.expanduser(dst)))
    dst = Path(os.path.realpath(dst.parent)) / dst.name  # (its folder resolved once, as convert's)
    partial = dst.with_name(dst.name + ".partial")
    work = dst.with_name(dst.name + ".partial.d")
    check_dst(dst, overwrite)
    require_compression()
    cks = scan_run(run_dir, frame_stack=frame_stack, workers=workers)  # every refusal before dst changes
    run = cks[0].run
    # (resolved: a link on either side must not hide a dst inside the source)
    real_dst, real_run = Path(os.path.realpath(dst)), Path(os.path.realpath(run))
    if real_dst == real_run or real_run in real_dst.parents:
        raise InvalidArgumentError(f"dst={str(dst)!r} is inside run_dir {run}; convert never writes its source")
    n = sum(ck.transitions for ck in cks)
    if n == 0:
        raise OfflineDatasetError(f"run_dir={str(run)!r}: none of its {len(cks)} checkpoints holds a sampleable "
                                  "transition")
    k = frame_stack
    runs = sum(ck.runs for ck in cks)
    # Frames: one a transition plus up to k at each run's start; the frame ring of `cap`
    # holds cap + cap // 64 + k + 2, so no frame is ever overwritten (slots past n stay empty).
    cap = n + max(0, runs * k - n // 64)
    cfg = Config.build(capacity=cap, fields={"obs": ((k, *cks[0].frame_shape), np.uint8),
                                             "action": ((), np.int32), "reward": ((), np.float32)},
                       frame_stack=k, storage="memmap", compression="zstd")
    if frame_capacity(cap, k, 1) < n + runs * k:  # (the rule above; kept true by a test)
        raise AssertionError("frame ring too small")
    mark = {"format": FORMAT, "version": VERSION, "frame_stack": k, "capacity": cap,
            "run": str(run), "checkpoints": [[ck.n, {kind: list(m.ident[1:]) for kind, m in ck.members.items()}]
                                             for ck in cks]}
    lock = DstLock(dst)
    try:
        check_dst(dst, overwrite)  # again, under the lock
        if overwrite:
            refuse_open(dst)  # (the older file, open in a reader: before the work, not at its end)
        snaps, buf, done = _start(work, mark, cfg, restart)
        dir_fd = open_run(run)
        made = []
        try:
            buf = _convert_checkpoints(buf, snaps, cks, done, dir_fd, k, n, workers, chunk, progress)
            live = int((buf.status == 1).sum())
            if live != n:
                raise RuntimeError(f"{live:,} of {n:,} converted transitions are sampleable (a bug: please report)")
            live_dir, mcfg = buf.storage.path, buf.config
            buf.close()  # (recorded in its directory: what the copy reads)
            buf = None  # its tree and bookkeeping go before the copy
            _to_hdf5(live_dir, mcfg, partial, made)
            publish(partial, dst, overwrite)
        except BaseException as e:
            if buf is not None and not buf.closed:
                buf.close()  # the work directory keeps the finished checkpoints for a resume
            if made:
                remove(partial)
            raise real_names(e, where=partial)
        finally:
            os.close(dir_fd)
        _remove_work(work)
    finally:
        lock.release()
    return {"transitions": n, "checkpoints": len(cks), "resumed_after": done, "frame_stack": k,
            "src_bytes": sum(ck.files_bytes for ck in cks), "dst_bytes": int(os.stat(dst).st_size),
            "dst": str(dst)}


def _start(work: Path, mark: dict, cfg: Config, restart: bool):
    """``(Snapshots, buffer, checkpoints done)``: the work directory's newest snapshot
    when it was made for this run and these options, else a new buffer."""
    if os.path.lexists(work):
        theirs = _read_mark(work)
        if theirs != mark:
            if not restart:
                raise PathExistsError(
                    f"{work} holds the work of a convert of another run, other files or other options "
                    f"(its {MARK} differs); pass restart=True (--restart) to discard it, or remove it")
            _remove_work(work)
    if not os.path.lexists(work):
        work.mkdir()
        write_json(work / MARK, mark)
        fsync_dir(work.parent)
    snaps = Snapshots(work / "snaps", keep=1)
    if snaps.latest() is not None:
        buf, info = snaps.load_latest(path=work / "live", with_info=True, rewind=True)
        done = int(info.metadata["done"])
        if not 0 < done <= len(mark["checkpoints"]) or buf.config.capacity != cfg.capacity:
            buf.close()
            raise PathExistsError(f"{snaps.latest()} does not belong to {work / MARK}; remove {work}")
        return snaps, buf, done
    store = MemmapStorage(work / "live", takeover=True)  # what a run killed before its first snapshot left
    store.open(cfg.to_dict())
    try:
        allocate(store, cfg)
        return snaps, PrioritizedReplayBuffer.from_parts(cfg, store), 0
    except BaseException:
        store.abort()
        raise


def _read_mark(work: Path) -> dict:
    st = os.lstat(work)
    if not stat.S_ISDIR(st.st_mode):
        raise PathExistsError(f"{work} exists and is not a directory that convert made; move it away")
    try:
        return read_json(work / MARK, error=PathExistsError)
    except (FileNotFoundError, PathExistsError):
        raise PathExistsError(f"{work} exists without convert's record ({MARK}): not convert's; move it away "
                              "(nothing in it was changed)") from None


def _remove_work(work: Path) -> None:
    """Remove the work directory convert made: its record names it; its three entries
    only (anything else there stays, and so does the directory)."""
    _read_mark(work)
    for sub in ("snaps", "live"):
        p = work / sub
        if os.path.lexists(p) and stat.S_ISDIR(os.lstat(p).st_mode):
            shutil.rmtree(p)
    os.unlink(work / MARK)
    try:
        os.rmdir(work)
    except OSError:
        pass
    fsync_dir(work.parent)


def _convert_checkpoints(buf, snaps, cks, done, dir_fd, k, n, workers, chunk, progress):
    from tqdm.auto import tqdm

    ahead: dict[int, object] = {}
    initial = sum(ck.transitions for ck in cks[:done])
    try:
        with tqdm(total=n, initial=initial, disable=not progress, unit="tr", unit_scale=True,
                  desc=f"convert {cks[0].run.name}", smoothing=0.05, mininterval=0.5) as bar:
            for i in range(done, len(cks)):
                for j in range(i, min(len(cks), i + workers)):  # this checkpoint and the next ones
                    if j not in ahead and cks[j].transitions:
                        ahead[j] = prefetch_frames(dir_fd, cks[j], k)
                bar.set_postfix_str(f"checkpoint {cks[i].n}", refresh=False)
                pf = ahead.pop(i, None)
                try:
                    for data in stream_transitions(dir_fd, cks[i], k, chunk=chunk, prefetch=pf, recycle=True):
                        buf.extend(data)
                        bar.update(data["action"].shape[0])
                finally:
                    if pf is not None:
                        pf.close()
                snaps.save(buf, metadata={"done": i + 1, "checkpoint": cks[i].n})
    finally:
        for pf in ahead.values():
            pf.close()
    return buf


def _to_hdf5(live_dir: Path, mcfg: Config, partial: Path, made: list) -> None:
    """Copy the closed memmap buffer at ``live_dir`` (config ``mcfg``) into a new HDF5
    storage at ``partial``: its arrays row for row (the compressed log as it is, never
    recompressed), then the state its close recorded, checked first. Nothing of a
    buffer is built: the copy holds the recorded state's arrays (leaves, status and
    ends: 10 bytes a transition) and one 64 MB piece, each piece let go of once
    written (a 50M-transition copy held the whole dataset's pages before)."""
    d = mcfg.to_dict()
    d["storage"] = "hdf5"
    cfg = Config.from_dict(d)
    src = MemmapStorage(live_dir, read_only=True, random_reads=False)  # (read in order)
    src.open(mcfg.to_dict())
    try:
        allocate(src, mcfg)
        store = HDF5Storage(partial, takeover=True)
        store.open(cfg.to_dict())
        made.append(True)
        try:
            allocate(store, cfg)
            for name, arr in src.arrays.items():
                rows = src.rows(name)
                if rows is not None and store.rows(name) != rows:
                    store.grow(name, rows) if store.rows(name) < rows else store.shrink(name, rows)
                step = max(1, _COPY_BYTES // max(1, arr[:1].nbytes))
                for lo in range(0, arr.shape[0], step):
                    hi = min(arr.shape[0], lo + step)
                    store.write(name, slice(lo, hi), np.asarray(arr[lo:hi]))
                    src.release_pages(name, lo, hi)
            state = src.saved_state()
            check_state(cfg, *state)  # (what from_parts checked when the copy built a buffer)
            store.close(state)
        except BaseException:
            store.abort()
            raise
    finally:
        src.close()
