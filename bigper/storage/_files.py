"""File helpers shared by the disk storages and snapshots: locks, durable
JSON, preallocation."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ..errors import StorageLockedError


class FileLock:
    """An flock on ``path``: released by the kernel when the process dies, so
    a killed writer never blocks the next one. Exclusive for writers, shared
    for readers."""

    def __init__(self, path: Path, *, shared: bool = False, owner=None):
        self.path = Path(path)
        owner = owner if owner is not None else self.path.parent
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            who = "a writer" if shared else "another writer or reader"
            raise StorageLockedError(
                f"{owner} is in use by {who} (lock {self.path} is held); "
                "one writer per storage path") from None

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync it, rename
    it into place and fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, obj) -> None:
    write_durable(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: Path):
    with open(path, "rb") as f:
        return json.loads(f.read())


def preallocate(path: Path, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` really reserved on disk: a full disk is
    an OSError here, never a SIGBUS when a mapped page is first written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
