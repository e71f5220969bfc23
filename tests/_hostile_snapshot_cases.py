"""Shared pieces of the hostile snapshot tests: fingerprints of what is on
disk, a deadline instead of a hang, re-signing a manifest as an attacker
would (its checksum is a plain xxh3), small snapshots built once and copied."""

from __future__ import annotations

import io
import os
import signal
import stat
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import bigper

load = bigper.PrioritizedReplayBuffer.load
from bigper.snapshot.manifest import MANIFEST, decode, digest, encode

from tests._snapshot_cases import Stream, feed, make

def fingerprint(*roots) -> dict:
    """path -> (kind, bytes or link target) for every entry under ``roots`` (lstat: links not followed)."""
    out = {}
    for root in roots:
        root = Path(root)
        if not os.path.lexists(root):
            out[str(root)] = None
            continue
        todo = [root]
        while todo:
            p = todo.pop()
            m = os.lstat(p).st_mode
            if stat.S_ISLNK(m):
                out[str(p)] = ("link", os.readlink(p))
            elif stat.S_ISDIR(m):
                out[str(p)] = ("dir", None)
                todo += sorted(p.iterdir())
            elif stat.S_ISREG(m):
                out[str(p)] = ("file", p.read_bytes())
            else:
                out[str(p)] = ("special", stat.S_IFMT(m))
    return out


@contextmanager
def deadline(seconds: int = 5):
    """Fail instead of hanging (a FIFO read blocks forever)."""
    def boom(*_):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def resign(snap: Path, change) -> None:
    """Apply ``change(body)`` to the manifest and sign it again."""
    body = decode((snap / MANIFEST).read_bytes(), snap)
    change(body)
    (snap / MANIFEST).write_bytes(encode(body))


def sign_raw(snap: Path, text: str) -> None:
    """Write ``text`` (a JSON object without its checksum key) as a signed manifest."""
    head = text.rstrip().rstrip("}").rstrip().encode()
    (snap / MANIFEST).write_bytes(head + f',\n "manifest_xxh3_64": "{digest(head)}"\n}}\n'.encode())


def put_state(snap: Path, name: str, arr) -> None:
    """Replace (or add) state array ``name`` with ``arr`` and re-sign (an attacker's snapshot)."""
    bio = io.BytesIO()
    np.save(bio, np.asarray(arr), allow_pickle=False)
    raw = bio.getvalue()
    member = f"state/{name}.npy"
    if os.path.lexists(snap / member):
        os.unlink(snap / member)
    (snap / member).write_bytes(raw)

    def change(b):
        b["files"][member] = {"size": len(raw), "xxh3_64": digest(raw)}
        b["state"]["arrays"][name] = member
    resign(snap, change)


_PRISTINE: dict = {}


def small(kind: str, tmp: Path, k=None, n_step=1, capacity=16, name="snap") -> Path:
    """A fresh copy of a small snapshot (each kind and shape is built once per session)."""
    import atexit
    import shutil
    import tempfile

    key = (kind, k, n_step, capacity)
    if key not in _PRISTINE:
        where = Path(tempfile.mkdtemp(prefix="bigper-hostile-"))
        atexit.register(shutil.rmtree, where, True)  # (the session's copy: gone with it, not left in /tmp)
        stream = Stream(k=k, seed=3)
        path = None if kind == "memory" else (where / "live.h5" if kind == "hdf5" else where / "live")
        buf = make(kind, path, stream, capacity=capacity, n_step=n_step)
        feed(buf, stream, capacity + 5)
        _PRISTINE[key] = buf.save(where / "snap")
        buf.close()
    dst = tmp / name
    shutil.copytree(_PRISTINE[key], dst)
    return dst


def refused(exc, snap: Path, *others, path=None):
    """load(snap, path=path) raises ``exc`` and changes nothing on disk."""
    before = fingerprint(snap, *others)
    with deadline():
        with pytest.raises(exc) as e:
            load(snap, path=path)
    assert fingerprint(snap, *others) == before
    return e.value



def fill(fs: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on the tmpfs ``fs`` (in ``fs/filler``)."""
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(fs / "filler", "wb") as f:
        if free - leave > 0:
            f.write(b"\0" * (free - leave))
