"""The snapshot format: ``manifest.json``, checksums, and names that stay inside.

::

    snap-00000042/
      manifest.json               written last; covers itself with a checksum
      state/<name>.npy            the buffer's bookkeeping (state_dict arrays)
      data/<name>.bin             rows of a stored array, raw, C order, in chunks
      data/<name>.000001.bin      of ``chunk_rows`` rows (shape, dtype in the manifest)
      user/<name>                 files the caller asked to keep with it (Snapshots.save(files=))

``manifest.json`` is one flat JSON object (format 1)::

    magic, format, bigper_version, created     what and who wrote it
    config                                     Config.to_dict()
    storage      {kind, path, options,         where the live data was (the default load path),
                  snapshot}                    and where this snapshot was written (optional)
    state        {meta, arrays: name -> file}  the buffer's state_dict
    data         name -> {rows, shape, dtype, chunk_rows, files: [file, ...]}
    files        file -> {size, xxh3_64}       every file but the manifest
    summary      len, capacity, total_priority, bytes (for `bigper info`)
    user         {metadata, files: name -> file}   optional: the caller's JSON and files
    manifest_xxh3_64                           xxh3 of every byte before this key

``user`` arrived within format 1: a snapshot without it loads as before (a
bigper from before it refuses a snapshot that has user files).

A file name is 2 path components: ``state/``, ``data/`` or ``user/`` and a name of
letters, digits, ``_ - .`` not starting with a dot. Members are opened one
component at a time with ``O_NOFOLLOW`` under the snapshot's directory, so
neither ``..`` nor a symlink can reach outside it.
"""

from __future__ import annotations

import json
import os
import re
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
from ..common.files import check_dense, open_regular

MAGIC = "bigper-snapshot"
FORMAT = 1
MANIFEST = "manifest.json"
TOPS = ("state", "data", "user")
_TAIL = re.compile(rb',\n "manifest_xxh3_64": "([0-9a-f]{16})"\n}\n\Z')
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
READ_BLOCK = 8 << 20
MANIFEST_LIMIT = 64 << 20  # bytes; a manifest bigper writes is a few kilobytes a thousand files
BIG = 1 << 62  # no recorded count, size or dimension reaches it; products are checked against it


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
    except (ValueError, RecursionError) as e:  # a broken writer, or a crafted (re-signed) file
        raise CorruptSnapshotError(f"{where}: manifest.json is not valid JSON: {str(e)[:200]}") from None
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
        fd = open_regular(snap / MANIFEST)
    except FileNotFoundError:
        raise CorruptSnapshotError(
            f"{snap} has no manifest.json: an incomplete snapshot, or not a snapshot") from None
    except OSError as e:
        raise CorruptSnapshotError(f"{snap}/manifest.json cannot be opened: {e}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MANIFEST_LIMIT + 1)
    if len(raw) > MANIFEST_LIMIT:
        raise CorruptSnapshotError(f"{snap}/manifest.json is larger than {MANIFEST_LIMIT} bytes")
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
            f"{where}: manifest names the file {name!r}, which is not state/, data/ or user/<name> "
            "(a name that could resolve outside the snapshot is refused)")
    return name


def _need(cond, where, what):
    if not cond:
        raise IncompatibleSnapshotError(f"{where}: manifest has an unexpected layout: {what}")


def _count(v, lo: int = 0) -> bool:
    """An int (not a bool) in ``[lo, BIG)``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < BIG


def check_structure(body: dict, where) -> None:
    """Types, ranges and cross references of a format-1 body (after its
    checksum held): whatever a crafted, re-signed manifest holds, what passes
    here can be used without a raw Python error or an overflow."""
    for key, typ in (("config", dict), ("storage", dict), ("state", dict), ("data", dict), ("files", dict)):
        _need(isinstance(body.get(key), typ), where, f"{key!r} must be a {typ.__name__}")
    _need(isinstance(body.get("summary", {}), dict), where, "'summary' must be a dict")
    files = body["files"]
    for name, rec in files.items():
        check_member(name, where)
        _need(isinstance(rec, dict) and _count(rec.get("size")) and isinstance(rec.get("xxh3_64"), str),
              where, f"files[{name!r}] needs an int size >= 0 and an xxh3_64 string")
    sto = body["storage"]
    _need(isinstance(sto.get("kind"), str), where, "storage kind must be a string")
    _need(sto.get("path") is None or isinstance(sto["path"], str), where, "storage path must be a string")
    _need(sto.get("snapshot") is None or isinstance(sto["snapshot"], str), where,
          "storage snapshot (where it was written) must be a string")
    opts = sto.get("options")
    _need(opts is None or isinstance(opts, dict), where, f"storage options must be a dict, got {str(opts)[:60]}")
    opts = opts or {}
    _need("chunk_bytes" not in opts or _count(opts["chunk_bytes"], 1), where,
          f"storage option chunk_bytes must be an int >= 1, got {str(opts.get('chunk_bytes'))[:60]}")
    _need(opts.get("compression") in (None, "lzf", "gzip"), where,
          f"storage option compression must be null, 'lzf' or 'gzip', got {str(opts.get('compression'))[:60]}")
    st = body["state"]
    _need(isinstance(st.get("meta"), dict) and isinstance(st.get("arrays"), dict), where, "state")
    for name, f in st["arrays"].items():
        _need(_PART.match(name) and isinstance(f, str) and f in files and f.startswith("state/"), where,
              f"state array {name!r}")
    claimed = set()
    for name, rec in body["data"].items():
        _need(_PART.match(name) and isinstance(rec, dict), where, f"data[{name!r}]")
        ok = all(_count(rec.get(k), 1) for k in ("rows", "chunk_rows")) \
            and isinstance(rec.get("shape"), list) and len(rec["shape"]) <= 32 \
            and all(_count(d, 1) for d in rec["shape"]) \
            and isinstance(rec.get("dtype"), str) and len(rec["dtype"]) <= 32 \
            and isinstance(rec.get("files"), list)
        _need(ok, where, f"data[{name!r}] needs rows, chunk_rows, shape (ints >= 1), dtype, files")
        elements = rec["rows"]
        for d in rec["shape"]:  # Python ints: no wrap-around (an int64 product of 2**32 x 2**32 is 0)
            elements *= d
            _need(elements < BIG, where, f"data[{name!r}] declares {rec['rows']} rows of shape "
                                         f"{rec['shape']}: more elements than any buffer holds")
        _need(len(rec["files"]) == -(-rec["rows"] // rec["chunk_rows"]), where,
              f"data[{name!r}] has {len(rec['files'])} files for {rec['rows']} rows of {rec['chunk_rows']}")
        for f in rec["files"]:
            _need(isinstance(f, str) and f in files and f.startswith("data/") and f not in claimed, where,
                  f"data[{name!r}] file {str(f)[:80]!r}")
            claimed.add(f)
    user = body.get("user")
    if user is not None:
        _need(isinstance(user, dict) and isinstance(user.get("files", {}), dict), where,
              "'user' must be a dict with a 'files' dict")
        for name, f in user.get("files", {}).items():
            _need(_PART.match(name) and f == f"user/{name}" and f in files, where, f"user file {name!r}")


# -- reading members ---------------------------------------------------------------
def open_member(snap: Path, name: str) -> int:
    """An fd for the regular file ``name`` under ``snap``; nothing on the way may be a symlink."""
    top, leaf = check_member(name, snap).split("/")
    try:
        dfd = os.open(Path(snap) / top, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY)
        try:
            # O_NONBLOCK and fstat: a FIFO or device here is refused at once, never read
            return open_regular(leaf, os.O_RDONLY, dir_fd=dfd)
        finally:
            os.close(dfd)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"{snap}: {name} is missing") from None
    except CorruptSnapshotError as e:
        raise CorruptSnapshotError(f"{snap}: {name}: {e}") from None
    except OSError as e:
        raise CorruptSnapshotError(f"{snap}: {name} cannot be opened ({e.strerror})") from None


def member_sizes(snap: Path, names) -> None:
    """Check that each member's size on disk is the one its manifest records
    (``names``: ``(name, rec)`` pairs), without reading it: what a load may
    allocate from the manifest is then bounded by the bytes really there."""
    for name, rec in names:
        fd = open_member(snap, name)
        try:
            size = os.fstat(fd).st_size
            if size != rec["size"]:
                raise CorruptSnapshotError(
                    f"{snap}: {name} has {size} bytes, the manifest records {rec['size']} (truncated?)")
            check_dense(fd, f"{snap}: {name}")  # a terabyte of holes is no terabyte of data
        finally:
            os.close(fd)


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
        check_dense(fd, f"{snap}: {name}")  # read in time bounded by the bytes really on disk
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
