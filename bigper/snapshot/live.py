"""Verifying a live storage (``bigper verify PATH`` on a storage, not a snapshot).

``verify_live(path)`` reads the storage at ``path`` without changing it and
returns a ``Verdict``, which the CLI prints and turns into its exit code;
None when ``path`` holds no storage of a kind bigper knows
(``storage.kind_at``). What differs between kinds is asked of the storage's
class (``storage/base.py``): whether it is at ``path`` (``recognizes``), its
lock file (``lock_path``), what can be checked while a live writer holds it
(``check_layout``), and whether the files its record names are there
(``check_files``). The rest is the same for every kind: a read-only
``open``, the recorded state's invariants (``core/statecheck.py``) and, with
compression, every live frame decompressed.

A storage a live buffer holds is never called corrupt: its data and
priorities change while it runs, so the verdict says who holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from ..config import Config
from ..core import legacy
from ..core.layout import DERIVED
from ..core.opening import recorded_frames
from ..core.statecheck import check_state
from ..errors import (
    BigperError,
    IncompatibleSnapshotError,
    StorageLockedError,
    UncleanStorageError,
)
from ..storage import kind_at
from ..storage.base import StorageBase
from ..common.files import FileLock, real_names

# What a verdict says, worst last; the CLI's exit code follows from it.
OK, IN_USE, UNCLEAN, INCOMPATIBLE, CORRUPT, INVALID = "OK", "IN USE", "UNCLEAN", "INCOMPATIBLE", "CORRUPT", "INVALID"


class Verdict(NamedTuple):
    """What ``verify_live`` found: ``status`` (one of the names above),
    ``text`` (the line after ``"<path>: "``) and ``more`` (lines below it)."""

    status: str
    text: str
    more: tuple[str, ...] = ()


def _line(e: BaseException) -> str:
    """An error as one line (its message names the path)."""
    return " ".join(str(real_names(e)).split("\n")) or type(e).__name__


def verify_live(path: Path) -> Verdict | None:
    """The verdict on the live storage at ``path``, read-only; None when
    ``path`` holds no storage of a known kind."""
    path = Path(path)
    cls = kind_at(path)
    if cls is None:
        return None
    kind = cls.kind
    lock = cls.lock_path(path)
    pid = FileLock.holder_pid(lock) if lock is not None else None
    if pid is not None:
        who = f"process {pid}" if pid > 0 else "another process"
        text = (f"a live {kind} buffer holds it ({who}); its data and priorities change while it runs, so only "
                "a snapshot can be verified: save one (buf.save or Snapshots.save) and verify that")
        try:  # what does not change while it runs: the record of its layout
            layout = cls.check_layout(path)
        except BigperError as e:
            return Verdict(IN_USE, text, (f"its layout is not consistent: {_line(e)}",))
        return Verdict(IN_USE, text, () if layout is None else (f"its layout is consistent: {layout}",))
    store = cls.create(path, read_only=True)
    try:
        meta = store.open({})
    except StorageLockedError as e:  # a writer arrived since the probe
        return Verdict(IN_USE, _line(e))
    except UncleanStorageError as e:
        return Verdict(UNCLEAN, _line(e))
    except IncompatibleSnapshotError as e:  # another format (an HDF5 dataset that is no bigper storage)
        return Verdict(INCOMPATIBLE, _line(e))
    except BigperError as e:
        return Verdict(CORRUPT, _line(e))
    try:
        try:
            cls.check_files(path, meta)
        except BigperError as e:
            return Verdict(CORRUPT, _line(e))
        state_meta, arrays = store.saved_state()
        if state_meta is None:
            return Verdict(OK, f"a {kind} storage closed before anything was recorded")
        cfg = Config.from_dict(meta["config"])
        check_state(cfg, state_meta, arrays)
        held, older = recorded_frames(meta), legacy.is_older(cfg, meta.get("arrays"))
        if older:  # an older bigper's folder: its references converted in memory (and checked)
            held["offsets"] = legacy.convert(cfg, store, meta, (state_meta, arrays), path)
        arrays = {n: a for n, a in arrays.items() if n not in DERIVED}
        frames_checked = _verify_frames(cfg, store, state_meta, arrays, held)
    except BigperError as e:
        return Verdict(INVALID, f"its recorded state is inconsistent: {_line(e)}")
    except Exception as e:  # noqa: BLE001  (a config this bigper cannot read)
        return Verdict(INCOMPATIBLE, f"{type(e).__name__}: {_line(e)}")
    finally:
        store.close()
    return Verdict(OK, f"a {kind} storage closed cleanly; layout and recorded state consistent "
                       f"({min(int(state_meta['count']), int(meta['config']['capacity'])):,} transitions"
                       + (f"; {frames_checked:,} compressed frames decompressed and checked)"
                          if cfg.compression else ")"),
                   ("its frame references are in an older bigper's format (obs_ref / next_obs_ref): read "
                    "converted in memory; a writer's next resume converts them on disk",) if older else ())


def _verify_frames(cfg: Config, store: StorageBase, state_meta: dict[str, Any], arrays: dict[str, Any],
                   held: dict) -> int:
    """With compression: decompress every live frame of ``store`` (bounds,
    size and checksum of each); the count checked. ``held``: the layout of
    the frame arrays it holds (``FrameStore``'s ``offsets`` and ``index``)."""
    if not cfg.compression:
        return 0
    from ..core.layout import allocate
    from ..frames.store import FrameStore

    frames = FrameStore(cfg, store, **held)
    allocate(store, cfg, frames)
    frames.restore(state_meta["frames"], arrays)
    try:
        return frames.check_live(arrays["status"])
    finally:
        if frames.log is not None:
            frames.log.close()


__all__ = ["Verdict", "verify_live", "OK", "IN_USE", "UNCLEAN", "INCOMPATIBLE", "CORRUPT", "INVALID"]
