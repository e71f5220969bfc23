"""Reusing a storage path (``mode="new" | "resume" | "overwrite"``): what a
path holds, looked at without changing it, and a fresh storage in place of
one bigper proved its own."""

from __future__ import annotations

from pathlib import Path

from .config import Config
from .errors import BigperError
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
