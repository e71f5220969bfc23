"""Writing a snapshot: everything into a temporary directory, then one rename.

The order is what makes a snapshot all or nothing (promise 1)::

    mkdir  <parent>/.tmp-<name>-<pid>-<rand>/{state,data}
    write           state/*.npy, data/* (or hard-link the storage's chunk files)
    fsync           every one of them (and every changed chunk linked)
    write + fsync   manifest.json (last: a directory without it is no snapshot)
    fsync           state/, data/, the temporary directory
    rename          .tmp-... -> <name>
    fsync           <parent>

Any failed write or fsync raises ``OSError``; the temporary directory is
removed and nothing else changed. A failed fsync is never retried (after a
failure, the kernel may have dropped the dirty pages and report success the
second time). Files are synced after all are written, from a pool of
threads: the filesystem groups concurrent fsyncs into a few journal commits
and device flushes instead of one per file (6x faster here for 15 files).

A chunked storage (memmap, ``StorageBase.chunked``): a chunk file is hard-linked, not copied. Chunks already
shared with an earlier snapshot are linked as they are (their checksum is
known); the others are hashed, linked and made durable, and once the
snapshot is committed they are shared, so the live buffer copies them before
writing (``storage/memmap.py``).
Where links are impossible (another filesystem, a read-only storage whose
writer is another process) chunks are copied.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import xxhash

from ..config import check_name
from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
    PathNotFoundError,
)
from ..storage import kinds
from ..storage.chunks import chunk_name, chunk_rows_for
from ..common.files import fsync_dir, open_regular
from .manifest import _PART, FORMAT, MAGIC, MANIFEST, READ_BLOCK, digest, encode
from .series import TMP_PREFIX

METADATA_LIMIT = 1 << 20  # bytes of JSON; metadata is for counters and names, files for the rest

_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.EOPNOTSUPP,
            getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


class Transaction:
    """The temporary directory of one snapshot and the files written into it."""

    def __init__(self, target: Path):
        self.target = target
        self.tmp = target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.files: dict[str, dict] = {}
        self.unsynced: list[Path] = []  # written or linked, fsynced at commit

    def begin(self, user: bool = False) -> None:
        os.mkdir(self.tmp)
        for top in ("state", "data", "user") if user else ("state", "data"):
            os.mkdir(self.tmp / top)

    def copy(self, name: str, src_fd: int) -> str:
        """Copy the open file ``src_fd`` to member ``name``, hashing as it goes."""
        import xxhash

        fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        h, size, buf = xxhash.xxh3_64(), 0, bytearray(READ_BLOCK)
        try:
            while True:
                n = os.readv(src_fd, [buf])
                if n == 0:
                    break
                h.update(memoryview(buf)[:n])
                _write_all(fd, memoryview(buf)[:n])
                size += n
        finally:
            os.close(fd)
        self.unsynced.append(self.tmp / name)
        self.files[name] = {"size": size, "xxh3_64": h.hexdigest()}
        return name

    def write(self, name: str, data) -> str:
        """Write the bytes-like ``data`` to member ``name`` (fsynced at commit)."""
        fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        self.unsynced.append(self.tmp / name)
        self.files[name] = {"size": memoryview(data).nbytes, "xxh3_64": digest(data)}
        return name

    def link(self, name: str, src: Path, size: int, xxh: str, sync: bool) -> str:
        """Hard-link ``src`` as member ``name``; ``sync``: its data may not be durable yet."""
        os.link(src, self.tmp / name)
        self.files[name] = {"size": int(size), "xxh3_64": xxh}
        if sync:
            self.unsynced.append(self.tmp / name)
        return name

    def commit(self, body: dict) -> None:
        fsync_all(self.unsynced)
        body["files"] = dict(sorted(self.files.items()))
        body.setdefault("summary", {})["bytes"] = sum(f["size"] for f in self.files.values())
        fd = os.open(self.tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, encode(body))
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_all([self.tmp / top for top in ("state", "data", "user") if (self.tmp / top).exists()]
                  + [self.tmp])
        if os.path.lexists(self.target):
            raise PathExistsError(f"snapshot {self.target} appeared while it was being written")
        os.rename(self.tmp, self.target)
        try:
            fsync_dir(self.target.parent)
        except BaseException:  # its name may not last: a failed snapshot is none at all
            os.rename(self.target, self.tmp)
            raise

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: list, threads: int = 16) -> None:
    """fsync every file or directory in ``paths``, concurrently; the first
    error is raised once all calls have returned (no call is ever repeated)."""
    if len(paths) <= 1:
        for p in paths:
            _fsync_path(p)
        return
    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix="bigper-fsync") as ex:
        futures = [ex.submit(_fsync_path, p) for p in paths]
    for f in futures:
        f.result()


def _mkdirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each durably named in its parent."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not d.is_dir():
                raise PathExistsError(f"{d} exists and is not a directory") from None
        except NotADirectoryError:
            raise PathExistsError(f"a part of {d} exists and is not a directory") from None
        fsync_dir(d.parent)


def _npy(arr: np.ndarray) -> memoryview:
    bio = io.BytesIO()
    np.save(bio, np.ascontiguousarray(arr), allow_pickle=False)
    return bio.getbuffer()


def specs_of(store) -> dict:
    """name -> (rows, shape, dtype) of every array a storage holds."""
    arrays = store.dsets or store.arrays
    return {n: (int(a.shape[0]), tuple(int(d) for d in a.shape[1:]), np.dtype(a.dtype))
            for n, a in arrays.items()}


def _rows(store, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of array ``name``, straight from the storage's arrays."""
    arrays = store.dsets or store.arrays
    return arrays[name][start:stop]


def _file_digest(path, size: int) -> str:
    """``digest`` of the first ``size`` bytes of the chunk file ``path``, read in blocks."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(READ_BLOCK, max(size, 1)))
    view = memoryview(buf)
    fd = open_regular(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = os.preadv(fd, [view[:min(len(buf), size - done)]], done)
            if n <= 0:
                raise OSError(f"{path}: ended at {done} of {size} bytes while hashing")
            h.update(view[:n])
            done += n
    finally:
        os.close(fd)
    return h.hexdigest()


def _link_chunks(tx: Transaction, store) -> tuple[dict, list]:
    """Link every chunk file; returns the data entries and the chunks to mark
    shared once the snapshot is committed (a failed save marks nothing)."""
    out, linkable, share = {}, True, []
    table = store.chunk_table()
    todo = [(name, k, c[0], c[1]) for name, (_, chunks) in table.items() for k, c in enumerate(chunks)
            if c[3] is None]
    # Hashing reads the files (the page cache the mapping writes through), not the
    # mapping: mapping a whole 7 GB buffer in would count every page in this
    # process's RSS. Reading and hashing release the GIL: a few threads.
    with ThreadPoolExecutor(4, thread_name_prefix="bigper-hash") as ex:
        fresh = dict(zip([(n, k) for n, k, _, _ in todo], ex.map(lambda t: _file_digest(t[2], t[3]), todo)))
    for name, (rec, chunks) in table.items():
        files = []
        for k, (path, size, shared, xxh) in enumerate(chunks):
            member = f"data/{chunk_name(name, k)}"
            if linkable:
                durable = shared and xxh is not None  # linked by a committed snapshot before
                xxh = xxh or fresh[name, k]
                try:
                    tx.link(member, path, size, xxh, sync=not durable)
                except OSError as e:
                    if e.errno not in _NO_LINK:
                        raise
                    linkable = False
                else:
                    share.append((name, k, xxh))
            if not linkable:
                tx.write(member, store.chunk_view(name, k))
            files.append(member)
        out[name] = {**{k: rec[k] for k in ("rows", "shape", "dtype", "chunk_rows")}, "files": files}
    return out, share


def _copy_rows(tx: Transaction, store) -> dict:
    out = {}
    for name, (rows, shape, dtype) in specs_of(store).items():
        row_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        cr = chunk_rows_for(rows, row_bytes)
        files = []
        for k in range(-(-rows // cr)):
            block = np.ascontiguousarray(_rows(store, name, k * cr, min(rows, (k + 1) * cr)))
            files.append(tx.write(f"data/{chunk_name(name, k)}", block.reshape(-1).view(np.uint8)))
        out[name] = {"rows": rows, "shape": list(shape), "dtype": dtype.str, "chunk_rows": cr, "files": files}
    return out


def _storage_record(store, target: Path) -> dict:
    """Where the live data was, and where the snapshot itself was written
    (``snapshot``): a copy of the tree read elsewhere loads into its own
    counterpart of the live path (``_load.counterpart``), not the original's."""
    path = store.path
    options = store.snapshot_options()
    saved_at = os.path.join(os.path.realpath(target.parent), target.name)
    return {"kind": store.kind, "path": None if path is None else os.path.abspath(path), "options": options,
            "snapshot": saved_at}


def _user_metadata(metadata):
    if metadata is None:
        return None
    try:
        text = json.dumps(metadata, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidTypeError(f"metadata must be JSON (dicts, lists, str, finite numbers, bools, "
                               f"None), got {type(metadata).__name__}: {str(e)[:120]}") from None
    if len(text) > METADATA_LIMIT:
        raise InvalidArgumentError(f"metadata is {len(text)} bytes of JSON, more than {METADATA_LIMIT}; "
                                   "put large things in files= instead")
    return json.loads(text)


def _open_user_files(files) -> dict:
    """name -> open fd of each file the caller gave (regular files only), or the error."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise InvalidTypeError(f"files must be a dict name -> path, got {type(files).__name__}")
    fds = {}
    try:
        for name, src in files.items():
            if not isinstance(name, str) or not _PART.match(name):
                raise InvalidArgumentError(
                    f"files: name {name!r} must be letters, digits, '_', '-' or '.', not starting with "
                    "a dot (it becomes a file name inside the snapshot)")
            if not isinstance(src, (str, os.PathLike)):
                raise InvalidTypeError(f"files[{name!r}] must be a path, got {type(src).__name__}")
            try:
                fds[name] = open_regular(src, os.O_RDONLY, follow=True, error=InvalidArgumentError)
            except FileNotFoundError:
                raise PathNotFoundError(f"files[{name!r}]: no file at {str(src)!r}") from None
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def save(snapshot, *, config, state, storage, summary, metadata=None, files=None) -> Path:
    """Write a crash-consistent snapshot of a buffer's parts to the new directory ``snapshot``.

    Parameters
    ----------
    snapshot : str or Path
        A directory that must not exist yet; missing parents are created.
    config : Config
        The buffer's config.
    state : (dict, dict)
        The buffer's ``state_dict()``: JSON-able meta and named arrays.
    storage : Storage
        The buffer's open storage; it may go on being used afterwards (memmap
        storage copies a chunk the snapshot shares before its first write into it).
    summary : dict
        ``len``, ``capacity``, ``total_priority`` (for ``bigper info``).
    metadata : JSON-able, optional
        The caller's own record (a step, an episode count, a run id), kept
        in the manifest, covered by its checksum; bigper never interprets it.
    files : dict of str to path, optional
        ``name -> path`` of the caller's files (a model checkpoint written
        just before), copied into ``user/<name>`` within the same atomic
        commit and checksummed; bigper never loads them. Names are plain
        file names.

    Returns
    -------
    Path
        The snapshot's absolute path.

    Raises
    ------
    FileExistsError
        ``snapshot`` exists: snapshots are never overwritten.
    OSError
        A write or fsync failed (a full disk, an I/O error): nothing was
        written, any earlier snapshot is untouched.
    """
    from .._version import __version__

    store = storage
    kind = store.kind
    if not isinstance(kind, str) or kind not in kinds():
        raise InvalidArgumentError(
            f"snapshots hold buffers on the storages a buffer may name ({', '.join(kinds())}); this "
            f"buffer's storage is {kind!r} (a dataset opened in place is its own data, and reprioritize "
            "keeps its priorities in a sidecar beside it)")
    if store.dsets is None and store.arrays is None:
        raise InvalidArgumentError(
            f"snapshots copy a storage's arrays (arrays, or an HDF5 file's dsets); this {kind} storage "
            f"({type(store).__name__}) has neither, so it cannot be snapshotted (nothing was written)")
    target = Path(os.path.abspath(snapshot))
    if os.path.lexists(target):
        raise PathExistsError(f"snapshot {target} exists; snapshots are never overwritten "
                              "(pick a new name, or let bigper.Snapshots number them)")
    metadata = _user_metadata(metadata)
    meta, arrays = state
    try:
        meta = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise InvalidTypeError(f"the buffer's state_dict meta is not JSON-able: {e}") from None
    for name in arrays:
        check_name(name, "state array name")
    _mkdirs(target.parent)
    if not target.parent.is_dir():
        raise PathExistsError(f"{target.parent} exists and is not a directory; the snapshot {target} "
                              "cannot be made in it")
    user_fds = _open_user_files(files)
    tx = Transaction(target)
    try:
        tx.begin(user=bool(user_fds))
        user = {name: tx.copy(f"user/{name}", fd) for name, fd in user_fds.items()}
        state = {name: tx.write(f"state/{name}.npy", _npy(a)) for name, a in arrays.items()}
        share = []
        if store.chunked and not store.read_only:  # its chunk files are linked, not copied
            data, share = _link_chunks(tx, store)
        else:
            data = _copy_rows(tx, store)
        body = {
            "magic": MAGIC, "format": FORMAT, "bigper_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "config": config.to_dict(),
            "storage": _storage_record(store, target),
            "state": {"meta": meta, "arrays": state},
            "data": data,
            "summary": dict(summary),
        }
        if metadata is not None or user:
            body["user"] = {"metadata": metadata, "files": user}
        tx.commit(body)
    except BaseException:
        tx.abort()
        raise
    finally:
        for fd in user_fds.values():
            os.close(fd)
    for name, k, xxh in share:  # the snapshot holds these files now: copy before writing
        store.mark_shared(name, k, xxh)
    return target
