"""The snapshot format: ``manifest.json``, checksums, and names that stay inside.

::

    snap-00000042/
      manifest.json               written last; covers itself with a checksum
      state/<name>.npy            the buffer's bookkeeping (state_dict arrays)
      data/<name>.bin             rows of a stored array, raw, C order, in chunks
      data/<name>.000001.bin      of ``chunk_rows`` rows (shape, dtype in the manifest)

``manifest.json`` is one flat JSON object (format 1)::

    magic, format, bigper_version, created     what and who wrote it
    config                                     Config.to_dict()
    storage      {kind, path, options}         where the live data was (the default load path)
    state        {meta, arrays: name -> file}  the buffer's state_dict
    data         name -> {rows, shape, dtype, chunk_rows, files: [file, ...]}
    files        file -> {size, xxh3_64}       every file but the manifest
    summary      len, capacity, total_priority, bytes (for `bigper info`)
    manifest_xxh3_64                           xxh3 of every byte before this key

A file name is 1-2 path components: ``state/`` or ``data/`` and a name of
letters, digits, ``_ - .`` not starting with a dot. Members are opened one
component at a time with ``O_NOFOLLOW`` under the snapshot's directory, so
neither ``..`` nor a symlink can reach outside it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from ..errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    PathNotFoundError,
)

MAGIC = "bigper-snapshot"
FORMAT = 1
MANIFEST = "manifest.json"
TOPS = ("state", "data")
_TAIL = re.compile(rb',\n "manifest_xxh3_64": "([0-9a-f]{16})"\n}\n\Z')
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
READ_BLOCK = 8 << 20


def digest(buf) -> str:
    """xxh3-64 of a bytes-like object, as 16 hex digits."""
    return xxhash.xxh3_64(buf).hexdigest()


# -- the manifest's own checksum --------------------------------------------------
def encode(body: dict) -> bytes:
    """The bytes of manifest.json for ``body``: its JSON with a last key that
    holds the checksum of everything before it."""
    text = json.dumps(body, indent=1, sort_keys=True)
    if not text.endswith("\n}"):
        raise InvalidArgumentError("manifest body must be a non-empty dict")
    head = text[:-2].encode()
    return head + f',\n "manifest_xxh3_64": "{digest(head)}"\n}}\n'.encode()


def decode(raw: bytes, where) -> dict:
    """The manifest body; CorruptSnapshotError unless its checksum holds."""
    m = _TAIL.search(raw)
    if m is None:
        raise CorruptSnapshotError(
            f"{where}: manifest.json is truncated or damaged (its checksum line is missing)")
    if digest(raw[:m.start()]) != m.group(1).decode():
        raise CorruptSnapshotError(f"{where}: manifest.json does not match its checksum")
    try:
        body = json.loads(raw.decode())
    except ValueError as e:  # cannot pass the checksum unless the writer was broken
        raise CorruptSnapshotError(f"{where}: manifest.json is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise CorruptSnapshotError(f"{where}: manifest.json is not a JSON object")
    body.pop("manifest_xxh3_64", None)
    return body


def read_manifest(snap: Path) -> dict:
    """Read, check and return the manifest body of the snapshot directory ``snap``."""
    snap = Path(snap)
    if not snap.is_dir():
        raise PathNotFoundError(f"no snapshot directory at {snap}")
    try:
        fd = os.open(snap / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CorruptSnapshotError(
            f"{snap} has no manifest.json: an incomplete snapshot, or not a snapshot") from None
    except OSError as e:
        raise CorruptSnapshotError(f"{snap}/manifest.json cannot be opened: {e}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(64 << 20)
    body = decode(raw, snap)
    if body.get("magic") != MAGIC:
        raise IncompatibleSnapshotError(f"{snap} is not a bigper snapshot (magic {body.get('magic')!r})")
    if body.get("format") != FORMAT:
        raise IncompatibleSnapshotError(
            f"{snap} has snapshot format {body.get('format')!r}; this bigper reads format {FORMAT} "
            f"(it was written by bigper {body.get('bigper_version')!r})")
    check_structure(body, snap)
    return body


# -- structure and names ------------------------------------------------------------
def check_member(name, where) -> str:
    """A manifest's file name that resolves inside the snapshot, or CorruptSnapshotError."""
    parts = name.split("/") if isinstance(name, str) else None
    if not parts or len(parts) != 2 or parts[0] not in TOPS or not _PART.match(parts[1]):
        raise CorruptSnapshotError(
            f"{where}: manifest names the file {name!r}, which is not state/<name> or data/<name> "
            "(a name that could resolve outside the snapshot is refused)")
    return name


def _need(cond, where, what):
    if not cond:
        raise IncompatibleSnapshotError(f"{where}: manifest has an unexpected layout: {what}")


def check_structure(body: dict, where) -> None:
    """Types and cross references of a format-1 body (after its checksum held)."""
    for key, typ in (("config", dict), ("storage", dict), ("state", dict), ("data", dict), ("files", dict)):
        _need(isinstance(body.get(key), typ), where, f"{key!r} must be a {typ.__name__}")
    files = body["files"]
    for name, rec in files.items():
        check_member(name, where)
        _need(isinstance(rec, dict) and isinstance(rec.get("size"), int) and rec["size"] >= 0
              and isinstance(rec.get("xxh3_64"), str), where, f"files[{name!r}]")
    st = body["state"]
    _need(isinstance(st.get("meta"), dict) and isinstance(st.get("arrays"), dict), where, "state")
    for name, f in st["arrays"].items():
        _need(_PART.match(name) and f in files and f.startswith("state/"), where, f"state array {name!r}")
    for name, rec in body["data"].items():
        _need(_PART.match(name) and isinstance(rec, dict), where, f"data[{name!r}]")
        ok = all(isinstance(rec.get(k), int) and rec[k] >= 1 for k in ("rows", "chunk_rows")) \
            and isinstance(rec.get("shape"), list) and all(isinstance(d, int) and d >= 1 for d in rec["shape"]) \
            and isinstance(rec.get("dtype"), str) and isinstance(rec.get("files"), list)
        _need(ok, where, f"data[{name!r}] needs rows, chunk_rows, shape, dtype, files")
        _need(len(rec["files"]) == -(-rec["rows"] // rec["chunk_rows"]), where,
              f"data[{name!r}] has {len(rec['files'])} files for {rec['rows']} rows of {rec['chunk_rows']}")
        for f in rec["files"]:
            _need(f in files and f.startswith("data/"), where, f"data[{name!r}] file {f!r}")


# -- reading members ---------------------------------------------------------------
def open_member(snap: Path, name: str) -> int:
    """An fd for the regular file ``name`` under ``snap``; nothing on the way may be a symlink."""
    top, leaf = check_member(name, snap).split("/")
    flags = os.O_RDONLY | os.O_NOFOLLOW
    try:
        dfd = os.open(Path(snap) / top, flags | os.O_DIRECTORY)
        try:
            fd = os.open(leaf, flags, dir_fd=dfd)
        finally:
            os.close(dfd)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{snap}: {name} is missing") from None
    except OSError as e:
        raise CorruptSnapshotError(f"{snap}: {name} cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptSnapshotError(f"{snap}: {name} is not a regular file")
    return fd


def check_file(snap: Path, name: str, rec: dict, buf: bytearray | None = None, keep: bool = False):
    """Read ``name`` once, checking its size and checksum against ``rec``.

    Returns its bytes when ``keep``; ``buf`` is a reusable read buffer.
    """
    fd = open_member(snap, name)
    try:
        size = os.fstat(fd).st_size
        if size != rec["size"]:
            raise CorruptSnapshotError(
                f"{snap}: {name} has {size} bytes, the manifest records {rec['size']} (truncated?)")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        h = xxhash.xxh3_64()
        out = bytearray(size) if keep else None
        if buf is None or keep:
            buf = out if keep else bytearray(min(READ_BLOCK, max(size, 1)))
        view = memoryview(buf)
        done = 0
        while done < size:
            chunk = view[done:] if keep else view[:min(len(view), size - done)]
            n = os.readv(fd, [chunk])
            if n == 0:
                raise CorruptSnapshotError(f"{snap}: {name} ended after {done} of {size} bytes")
            h.update(chunk[:n])
            done += n
        if h.hexdigest() != rec["xxh3_64"]:
            raise CorruptSnapshotError(f"{snap}: {name} does not match its checksum")
        return out if keep else None
    finally:
        os.close(fd)


def check_files(snap: Path, files: list, threads: int = 4) -> None:
    """``check_file`` for each ``(name, rec)``, a few at a time: reading and
    hashing both release the GIL, so threads overlap the I/O of one file with
    the hashing of another. Raises the error of the first bad file in order."""
    if threads <= 1 or len(files) <= 1:
        buf = bytearray(READ_BLOCK)
        for name, rec in files:
            check_file(snap, name, rec, buf)
        return
    local = threading.local()

    def one(item):
        if not hasattr(local, "buf"):
            local.buf = bytearray(READ_BLOCK)
        check_file(snap, item[0], item[1], local.buf)

    ex = ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="bigper-verify")
    try:
        futures = [ex.submit(one, item) for item in files]
        for f in futures:
            f.result()
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
