"""The SB3 drop-in's pickles: a reference to a bigper snapshot, never the transitions.

A pickle (``save_replay_buffer``, ``pickle.dumps``) holds the path of a bigper
snapshot and the SHA-256 of its manifest; loading it checks the hash and loads
the snapshot (plain arrays and JSON: nothing of bigper's is unpickled). What
each pickle keeps its word on:

- **Its snapshot stays.** A pickle written where bigper does not know the
  file (``pickle.dumps``, SB3's own ``save_to_pkl``) gets a snapshot in a
  series that bigper never prunes (``keep=None``): nothing tells bigper when
  that pickle is gone, and a user who kept ``rb-10k.pkl`` and ``rb-20k.pkl``
  expects both to load. Successive snapshots of a disk storage share their
  unchanged data files (hard links), so a series costs little more than what
  changed between pickles. A pickle written by a prioritized algorithm's
  ``save_replay_buffer(path)`` owns ``<path>.bigper/``: saving to that path
  again replaces the pickle and, with it, the need for the older snapshot;
  that series keeps two (the one the file names, and the one before in case
  the new file never lands). A copy of an older pickle made outside bigper
  then names a snapshot that is gone, and loading it says it was superseded.
- **A live path is never rewound without being asked.** Loading restores the
  snapshot into the live path the buffer used, or, for a pickle read from a
  copied or moved run folder (a fork), into that path's counterpart in the
  copy (``bigper.snapshot.counterpart``): a fork never writes into the
  original run. A live path holding a buffer closed with more transitions
  than the snapshot is refused unless ``load_replay_buffer(path,
  rewind=True)``; when the load replaces something (fewer transitions, a
  writer that died without closing, or a rewind), a ``UserWarning`` at the
  caller's line says what. A path a live writer holds is refused
  (``StorageLockedError``) and left as it was.
- **A failed save loses nothing.** ``save_pickle`` refuses a closed buffer
  before any file is opened and writes the pickle through a temporary file,
  fsync and rename, so the previous pickle at that path survives any failure.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import os
import pickle
import re
import warnings
from pathlib import Path

from .. import PrioritizedReplayBuffer as CoreBuffer
from .. import Snapshots
from ..config import Config
from ..errors import (
    BigperError,
    BufferClosedError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
    PathNotFoundError,
    StorageLockedError,
    UncleanStorageError,
)
from ..snapshot import counterpart, default_live_path, describe
from ..storage import in_memory
from ..common.files import read_regular, write_durable

MANIFEST = "manifest.json"
_SNAP = re.compile(r"^snap-\d{8}$")
# A pickle whose file bigper knows keeps the snapshot it names and the one before.
KEEP_AT_PATH = 2


def manifest_digest(snap: Path) -> str:
    """SHA-256 of ``snap/manifest.json``, read as bigper reads every file:
    a regular file only (a FIFO, device or symlink is refused without
    blocking), bounded in size."""
    try:
        raw = read_regular(Path(snap) / MANIFEST)
    except FileNotFoundError:
        raise _gone(Path(snap)) from None
    except OSError as e:
        raise CorruptSnapshotError(f"the replay buffer's snapshot {snap}/{MANIFEST} cannot be read: {e}") from e
    return hashlib.sha256(raw).hexdigest()


def _gone(snap: Path) -> PathNotFoundError:
    """The error for a pickle whose snapshot is missing: superseded, or removed by hand."""
    root = snap.parent
    try:
        later = sorted(e for e in os.listdir(root) if _SNAP.match(e) and e > snap.name)
    except OSError:
        later = []
    if later:
        return PathNotFoundError(
            f"this pickle's snapshot {snap} is gone: it was superseded by a later save to the same "
            f"place ({root} keeps only the snapshots of the last pickles written there; the newest is "
            f"{later[-1]}). Load the pickle written last at that path, or pickle with snapshot_dir= "
            "(a series bigper never prunes) to keep every pickle loadable")
    return PathNotFoundError(
        f"this pickle's snapshot {snap} does not exist (its {MANIFEST} is missing): was it moved or deleted? "
        f"If the run folder was moved or copied with the pickle and its {root.name}/ folder beside it, load "
        "it with the load_replay_buffer(<the pickle's new path>) of bigper's PrioritizedDQN (or PrioritizedSAC, "
        "...): it finds the snapshot beside the pickle (pickle.loads and plain SB3 cannot know where the pickle "
        f"was). Otherwise put {root} back where it was")


def write_snapshot(buf: CoreBuffer, root: Path, keep: int | None) -> tuple[str, str]:
    """Snapshot ``buf`` into the series at ``root``; its path and manifest digest."""
    snap = Snapshots(root, keep=keep).save(buf)
    return os.fspath(snap), manifest_digest(snap)


def save_pickle(rb, path) -> None:
    """Pickle ``rb`` to ``path`` as SB3's ``save_to_pkl`` names it (``.pkl``
    added where the name has no suffix), atomically; a file object is written
    to as SB3 does. A closed buffer is refused before anything is opened."""
    if rb.closed:
        raise BufferClosedError("save_replay_buffer: the replay buffer is closed; nothing was written "
                                "(the previous pickle, if any, is untouched)")
    if not isinstance(path, (str, os.PathLike)):
        from stable_baselines3.common.save_util import save_to_pkl

        rb._snapshot_target = None
        save_to_pkl(path, rb)
        return
    target = Path(path)
    if target.suffix == "":
        target = Path(f"{target}.pkl")
    if target.is_dir():
        raise PathExistsError(f"save_replay_buffer: path={str(target)!r} is a directory; give a file name")
    rb._snapshot_target = f"{os.fspath(path)}.bigper"
    try:
        data = pickle.dumps(rb, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        rb._snapshot_target = None
    target.parent.mkdir(parents=True, exist_ok=True)
    write_durable(target, data)


def core_kwargs(cfg: Config) -> dict:
    """The keywords that build a core buffer of ``cfg`` (but capacity and fields)."""
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    kw["beta"] = cfg.schedule
    del kw["capacity"], kw["fields"]
    return kw


def _what_is_live(snap: Path, info: dict, live: str | None = None) -> tuple[int | None, str | None, str | None]:
    """The snapshot's transition count, the live path it loads into (``live``,
    else the one it recorded, absolute), and what that path holds when it
    differs from the snapshot (None when it holds nothing, or the same count).
    ``StorageLockedError`` when a live writer holds it: nothing to replace."""
    n_snap = info.get("count")
    on_disk = not in_memory(info["config"].get("storage", "memory"))
    if live is None and on_disk:
        at = default_live_path(snap, info)
        live = None if at is None else os.fspath(at)
    if not isinstance(live, str) or not on_disk \
            or not os.path.lexists(live):
        return n_snap, live, None
    cfg = Config.from_dict(info["config"])
    try:
        probe = CoreBuffer(cfg.capacity, cfg.fields, path=live, mode="resume", read_only=True,
                           **core_kwargs(cfg))
    except StorageLockedError:
        raise
    except UncleanStorageError:
        return n_snap, live, "a buffer whose writer did not close it (killed?), transitions since unknown"
    except BigperError as e:
        return n_snap, live, f"something bigper cannot read as this buffer ({e})"
    try:
        n_live = probe.state_dict()[0]["count"]
    finally:
        probe.close()
    if n_live == n_snap:
        return n_snap, live, None
    if n_snap is not None and n_live > n_snap:
        return n_snap, live, (f"{n_live} transitions at its last close, so the {n_live - n_snap} transitions "
                        "added after the pickle was written (and priority updates since) are discarded")
    return n_snap, live, f"{n_live} transitions at its last close"


def checked_snapshot(state: dict) -> Path:
    """The snapshot a pickle's ``state`` names, its manifest's hash checked
    (missing, superseded or rewritten: refused)."""
    snap = state.get("snapshot")
    if not isinstance(snap, str):
        raise InvalidTypeError(f"the pickle's snapshot must be a str, got {type(snap).__name__}")
    snap = Path(snap)
    digest = manifest_digest(snap)
    if digest != state.get("manifest_sha256"):
        raise CorruptSnapshotError(f"{snap}/{MANIFEST} is not the snapshot this pickle was written "
                                   f"with (sha256 {digest}, recorded {state.get('manifest_sha256')})")
    return snap


# True inside ``rewinding()``: an unpickled buffer may replace a live path holding newer data.
REWIND: contextvars.ContextVar[bool] = contextvars.ContextVar("bigper_sb3_rewind", default=False)


@contextlib.contextmanager
def rewinding():
    """Within this block, unpickling a replay buffer (``pickle.loads``, SB3's
    own ``load_replay_buffer``) may rewind a live path that holds more
    transitions than the pickle's snapshot: what was added since is lost.
    Outside it that is refused (``PathExistsError``). A ``Prioritized*``
    algorithm says the same with ``load_replay_buffer(path, rewind=True)``."""
    token = REWIND.set(True)
    try:
        yield
    finally:
        REWIND.reset(token)


def open_snapshot(state: dict, *, capacity: int, n_envs: int, live: str | None = None, rewind: bool = False,
                  continue_episodes: bool = False, device=None) -> CoreBuffer:
    """The bigper buffer a pickle's ``state`` names: its manifest hash checked,
    its shape checked against the pickle's (``capacity``, ``n_envs``), loaded
    into ``live`` (default: the live path it was saved from, or its
    counterpart in a copied run folder), with a ``UserWarning`` saying what
    that path held when it had moved on. A path holding newer data is
    refused unless ``rewind``; the episodes open at the snapshot end there
    unless ``continue_episodes`` (``PrioritizedReplayBuffer.load``); ``device``:
    the device tier it gets (rebuilt from the snapshot's data), or None."""
    snap = checked_snapshot(state)
    info = describe(snap)
    cfg = info["config"]
    if cfg.get("capacity") != capacity or cfg.get("num_envs", 1) != n_envs:
        raise IncompatibleSnapshotError(f"{snap} holds capacity {cfg.get('capacity')} for {cfg.get('num_envs', 1)} "
                                        f"env(s), the pickle says {capacity // max(n_envs, 1)} x {n_envs}")
    n_snap, into, replaced = _what_is_live(snap, info, live)
    rewind = rewind or REWIND.get()
    try:
        buf = CoreBuffer.load(snap, path=into, rewind=rewind, continue_episodes=continue_episodes, device=device)
    except PathExistsError as e:
        if "rewind=True" not in str(e):
            raise
        raise PathExistsError(f"loading the replay buffer pickle of {snap}: {e} (for SB3: "
                              "model.load_replay_buffer(path, rewind=True), or pickle.loads / SB3's own load "
                              "inside `with bigper.integrations.sb3.rewinding():`; or resume the live buffer "
                              "with replay_buffer_kwargs={'mode': 'resume', ...})") from None
    if replaced is not None:  # said once, as a warning (not also a log line)
        warnings.warn(f"loading this pickle restored {snap} ({n_snap} transitions) into the live path {into}, "
                      f"replacing what it held: {replaced}", UserWarning, stacklevel=user_level())
    return buf


def user_level() -> int:
    """The ``stacklevel`` of a warning that names the user's line: the first
    frame outside bigper, Stable-Baselines3 and the pickle machinery."""
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the bigper package
    level, f = 1, sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(here) or f"{os.sep}stable_baselines3{os.sep}"
                             in f.f_code.co_filename or f.f_code.co_filename.endswith(f"{os.sep}pickle.py")):
        level += 1
        f = f.f_back
    return level


def beside_the_pickle(state: dict, pickle_path: str) -> tuple[dict, str | None]:
    """A pickle read from a run folder that was moved or copied since it was
    written: its state naming the copy of its snapshot, and the live path at
    its counterpart in the copy (inside the run folder or beside the pickle's
    folder: ``bigper.snapshot.counterpart``; else None: it loads into the live
    path it recorded). The copy of the snapshot is the folder beside the
    pickle that ``save_replay_buffer(path)`` writes (``<path>.bigper/``), else
    (a plain ``pickle.dumps``: ``<live>.snapshots/`` or ``snapshot_dir``) the
    nearest copy of the snapshot's folder in the pickle's folder, as given, or
    above it (``_nearest_copy``; a snapshot there that is not this one is refused by
    ``checked_snapshot``): so a copy of a run folder never loads, and with
    ``rewind`` never rewinds, the original run.
    Anything else: ``state`` and None."""
    snap, p = state.get("snapshot"), Path(pickle_path)
    if not isinstance(snap, str):
        return state, None
    snap = Path(snap)
    if not _SNAP.match(snap.name):
        return state, None
    names = {f"{p.name}.bigper"} | ({f"{p.stem}.bigper"} if p.suffix == ".pkl" else set())
    start = Path(os.path.abspath(p.parent))  # (as given: a folder linked into the original stays the copy's)
    moved = start / snap.parent.name / snap.name
    if snap.parent.name not in names or not os.path.lexists(moved / MANIFEST):
        moved = _nearest_copy(snap, start)
        if moved is None:
            return state, None
    if os.path.abspath(snap) == os.fspath(moved) or (snap.parent.name in names and os.path.realpath(
            snap.parent) == os.path.realpath(moved.parent)):
        return state, None  # read where it was written (the pickle's own folder: through a link too)
    state = dict(state, snapshot=os.fspath(moved))
    recorded = (describe(moved).get("storage") or {}).get("path")
    live = None if not isinstance(recorded, str) else counterpart(os.path.abspath(recorded), snap, moved)
    if live is None:
        return state, None
    return dict(state, live_path=os.fspath(live)), os.fspath(live)


def _nearest_copy(snap: Path, start: Path) -> Path | None:
    """``<folder>/<the last k folders of snap's path>/<snap's name>`` holding a
    manifest, ``folder`` ``start`` or the nearest above it, ``k`` the fewest
    (a ``snapshot_dir`` nested in the run folder, ``run/ckpt/series``, is found
    from the copy's ``run``), or None. (Its manifest's hash is checked by
    ``checked_snapshot``: another snapshot there is refused, never passed over
    for the original.)"""
    tail = snap.parent.parts[1:]  # (the folders under the root)
    for d in (start, *start.parents):
        for k in range(1, len(tail) + 1):
            here = d.joinpath(*tail[-k:], snap.name)
            if os.path.lexists(here / MANIFEST):
                return here
    return None


# A replay-buffer pickle holds spaces and paths, never transitions: a few KB.
PICKLE_LIMIT = 64 << 20


class _StateOnly:
    """Stands in for the drop-in's class while a pickle is peeked at: keeps its state, opens nothing."""

    def __setstate__(self, state) -> None:
        self.state = state


class _Peek(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name == "PrioritizedReplayBuffer" and module.startswith("bigper.integrations"):
            return _StateOnly
        return super().find_class(module, name)


def read_pickle(path) -> tuple[bytes, str]:
    """The bytes of a replay-buffer pickle at ``path`` (SB3's naming: ``path``,
    else ``path.pkl``), read as bigper reads every file (a FIFO or device is
    refused without blocking), and the name to quote in errors. Nothing is
    unpickled and nothing is opened for writing."""
    if not isinstance(path, (str, os.PathLike)):
        return path.read(), repr(path)
    p = Path(path)
    if not os.path.lexists(p) and os.path.lexists(f"{p}.pkl"):
        p = Path(f"{p}.pkl")
    if not os.path.lexists(p):
        raise PathNotFoundError(f"load_replay_buffer: path={str(path)!r} does not exist (nor {str(path)!r}.pkl)")
    try:
        return read_regular(p, limit=PICKLE_LIMIT, follow=True, error=InvalidArgumentError), str(p)
    except OSError as e:
        raise InvalidArgumentError(f"load_replay_buffer: path={str(p)!r} cannot be read: {e}") from e


def peek_state(data: bytes, where: str) -> dict:
    """The state a drop-in pickle carries, without loading its snapshot;
    ``IncompatibleSnapshotError`` naming ``where`` for anything else."""
    import io

    try:
        obj = _Peek(io.BytesIO(data)).load()
    except Exception as e:  # any unpickling failure: not a pickle bigper can read
        raise IncompatibleSnapshotError(f"load_replay_buffer: {where} is not a bigper SB3 replay buffer "
                                        f"pickle ({type(e).__name__}: {e})") from None
    state = getattr(obj, "state", None) if isinstance(obj, _StateOnly) else None
    if not isinstance(state, dict):
        raise IncompatibleSnapshotError(f"load_replay_buffer: {where} is not a bigper SB3 replay buffer "
                                        f"pickle (it holds a {type(obj).__name__})")
    return state


def check_fits(state: dict, where: str, model) -> None:
    """Refuse a pickle whose spaces or env count are not the model's (another algorithm's)."""
    for key, want in (("observation_space", model.observation_space), ("action_space", model.action_space),
                      ("n_envs", model.n_envs)):
        if key in state and state[key] != want:
            raise IncompatibleSnapshotError(f"load_replay_buffer: {where} holds a buffer with {key} "
                                            f"{state[key]}, this model has {want} (another algorithm's pickle?)")
