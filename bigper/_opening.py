"""Opening a buffer's storage path (``mode="new" | "resume" | "overwrite"``):
what a path holds, looked at without changing it, and a fresh storage in
place of one bigper proved its own."""

from __future__ import annotations

from pathlib import Path

from .config import Config
from .errors import BigperError, InvalidArgumentError, PathExistsError
from .storage import open_storage

MODES = ("new", "resume", "overwrite")


def held(recorded: dict) -> int:
    """Transitions a recorded storage holds (for messages)."""
    try:
        cfg, state = recorded["config"], recorded["state"]
        return int(min(int(state["count"]), int(cfg["capacity"])))
    except (KeyError, TypeError, ValueError):
        return 0


def probe(cfg: Config, path, opts: dict):
    """The recorded meta of a bigper storage at ``path``, looked at read-only
    (nothing on disk changes), or None when there is none to read."""
    if not Path(path).exists():
        return None
    store = open_storage(cfg.storage, path, read_only=True, **opts)
    try:
        return store.open(cfg.to_dict())
    except BigperError:
        return None  # not a readable bigper storage: the writer's open decides
    finally:
        store.close()


def overwrite(cfg: Config, path, opts: dict):
    """A fresh storage at ``path``, which ``open`` just recognized as a bigper
    storage (so its files are bigper's to replace)."""
    if cfg.storage == "memmap":
        store = open_storage("memmap", path, takeover=True, **opts)
    else:
        Path(path).unlink()
        store = open_storage(cfg.storage, path, **opts)
    store.open(cfg.to_dict())
    return store


def open_path(cfg: Config, path, mode: str, read_only: bool, storage_options):
    """The storage of a new buffer of ``cfg`` at ``path``, opened as ``mode``
    says, and what it recorded (None when it starts empty)."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    if read_only and mode != "resume":
        mode = "resume"  # a reader only ever looks at what is there
    opts = dict(storage_options or {})
    existing = None if mode == "resume" or cfg.storage == "memory" else probe(cfg, path, opts)
    if existing is not None and mode == "new":
        raise PathExistsError(
            f"path={str(path)!r} already holds a bigper buffer ({held(existing)} transitions); "
            "pass mode='resume' to continue it or mode='overwrite' to replace it")
    if existing is not None:  # overwrite what open just proved to be a bigper storage
        return overwrite(cfg, path, opts), None
    store = open_storage(cfg.storage, path, read_only=read_only, **opts)
    return store, store.open(cfg.to_dict())
