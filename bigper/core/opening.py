"""Opening a buffer's storage path (``mode="new" | "resume" | "overwrite"``).

The order is the point (promise 11): the path is made absolute first (a
later ``os.chdir`` never redirects a write), the storage's lock is taken
next, and only under that lock is anything at the path read, and, for
``"overwrite"``, replaced; a live writer or reader is ``StorageLockedError``
with nothing read, moved or deleted. ``storage_options`` are checked against
the options the chosen storage documents before anything is opened.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import LAYOUT_KEYS, Config
from ..errors import BigperError, IncompatibleSnapshotError, InvalidArgumentError, InvalidTypeError, PathExistsError
from ..frames.dictionaries import as_dictionary
from ..frames.store import FrameStore, require_compression
from ..storage import open_storage, storage_class
from ..common.files import real_names
from . import legacy
from .layout import DERIVED, allocate, check_field_names
from .statecheck import check_state

MODES = ("new", "resume", "overwrite")


def held(recorded: dict) -> int:
    """Transitions a recorded storage holds (for messages)."""
    try:
        cfg, state = recorded["config"], recorded["state"]
        return int(min(int(state["count"]), int(cfg["capacity"])))
    except (KeyError, TypeError, ValueError):
        return 0


def storage_options(kind: str, options) -> dict:
    """``options`` as a dict of the documented options of storage ``kind``
    (its class's ``options``, README "Storages"); ``InvalidArgumentError``
    naming any other, so that an internal switch (``takeover``,
    ``read_only``) cannot be reached through them."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidTypeError(f"storage_options must be a dict or None, got {type(options).__name__} "
                               f"{options!r:.80}")
    allowed = storage_class(kind).options
    unknown = sorted(str(k) for k in options if k not in allowed)
    if unknown:
        raise InvalidArgumentError(
            f"storage_options has {unknown!r:.200}, which storage={kind!r} does not take; its options "
            f"are {list(allowed)} (nothing was opened or changed)")
    return dict(options)


def open_path(cfg: Config, path, mode: str, read_only: bool, storage_options_):
    """The storage of a new buffer of ``cfg`` at ``path``, opened as ``mode``
    says, and what it recorded (None when it starts empty)."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    opts = storage_options(cfg.storage, storage_options_)
    if read_only and mode != "resume":
        mode = "resume"  # a reader only ever looks at what is there
    if storage_class(cfg.storage).in_memory:
        store = open_storage(cfg.storage)
    else:
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidTypeError(f"path must be a str or os.PathLike for storage={cfg.storage!r}, "
                                   f"got {type(path).__name__} {path!r:.80}")
        path = Path(os.path.abspath(path))  # resolved once: a later chdir changes nothing
        store = open_storage(cfg.storage, path, read_only=read_only, **opts)
    recorded = store.open(cfg.to_dict())  # the lock first; then what the path holds is read
    if recorded is None or mode == "resume":
        return store, recorded
    try:
        if mode == "new":
            raise PathExistsError(
                f"path={str(path)!r} already holds a bigper buffer ({held(recorded)} transitions); "
                "pass mode='resume' to continue it or mode='overwrite' to replace it")
        store.replace(cfg.to_dict())  # under the lock open took: no second writer comes between
    except BaseException:
        store.abort()
        raise
    return store, None


def check_arguments(cfg: Config, path, read_only: bool, dictionary):
    """The constructor's checks that need more than one argument; returns the
    dictionary as the frame store takes it."""
    check_field_names(cfg)
    if cfg.compression is not None:
        require_compression()  # before anything at the path: the extra's error, nothing made
    if dictionary is not None:
        if cfg.compression is None:
            raise InvalidArgumentError("compression_dictionary needs compression='zstd', got compression=None")
        dictionary = as_dictionary(dictionary)
    if cfg.n_step > 1 and cfg.fields.get("reward", ((None,),))[0] != ():
        raise InvalidArgumentError("n_step > 1 needs a scalar 'reward' field to sum, "
                                   f"got fields {sorted(cfg.fields)}")
    if storage_class(cfg.storage).in_memory and (path is not None or read_only):
        raise InvalidArgumentError(f"storage={cfg.storage!r} takes no path or read_only, got path={path!r}")
    return dictionary


def recorded_frames(recorded: dict) -> dict:
    """``FrameStore``'s ``offsets`` and ``index`` as a storage records its
    arrays: the dtype of its ``frame_off`` and the row shape of its
    ``frame_index`` (None: none recorded). Untrusted: ``FrameStore`` checks them."""
    arrays = recorded.get("arrays")
    arrays = arrays if isinstance(arrays, dict) else {}
    off, index = arrays.get("frame_off"), arrays.get("frame_index")
    shape = index.get("shape") if isinstance(index, dict) else None
    # (a record of frame_index without a shape is refused by name as an empty one, not taken for a new log's)
    return {"offsets": off.get("dtype") if isinstance(off, dict) else None,
            "index": [] if isinstance(index, dict) and shape is None else shape}


def open_buffer(cfg: Config, path, mode: str, read_only: bool, options, dictionary):
    """``(store, frames, state, old)`` of a new buffer of ``cfg``: its storage
    opened at ``path`` as ``mode`` says and allocated, its frame store (or
    None), and, when it resumes, the recorded state (checked before the
    storage is attached, so a refused state leaves the path as it was) and
    the recorded config. On a refusal the storage is released without
    recording anything."""
    try:
        store, recorded = open_path(cfg, path, mode, read_only, options)
    except (OSError, BigperError) as e:
        raise real_names(e)
    state = old = None
    held: dict = {}
    try:
        if recorded is not None:
            old = Config.from_dict(recorded["config"])
            diff = cfg.differences(old, ignore=(), only=LAYOUT_KEYS)
            if diff:
                raise IncompatibleSnapshotError(
                    f"{path} holds a buffer of another layout; differing key(s): " + "; ".join(diff)
                    + " (the stored data depends on these; use another path or mode='overwrite')")
            state = store.saved_state()
            check_state(cfg, *state)
            if legacy.is_older(cfg, recorded.get("arrays")):  # an older bigper's folder: converted first
                held = {**recorded_frames(recorded), "offsets": legacy.convert(cfg, store, recorded, state, path)}
            else:
                held = recorded_frames(recorded)
            # (what a recorded state holds that follows from the rest is derived, not taken: layout.DERIVED)
            state = (state[0], {n: a for n, a in state[1].items() if n not in DERIVED})
        frames = FrameStore(cfg, store, dictionary, **held) if cfg.frame_stack else None
        allocate(store, cfg, frames)
    except BaseException as e:
        real_names(e)
        store.abort()  # released recording nothing: a refused path stays as it was
        raise
    return store, frames, state, old
