"""How ``convert`` (and ``convert_dqn``) put a finished file at ``dst``:
the lock, the checks, the publish, and the recovery of a killed one.

The new file is written as ``<dst>.partial`` (a bigper storage: its lock
keeps a leftover of a killed run from a live one) and published only when
it is complete and closed: a crash or kill -9 midway leaves no destination.
Before anything at the destination changes, the caller takes the lock a
buffer there would hold (``DstLock``: ``<dst>.lock``): a live writer's file
is ``StorageLockedError``, never replaced under it.

``publish`` moves the file's priorities sidecar into place first, and with
``overwrite`` moves the older file aside first (``<dst>.partial.old``,
removed at the end): a kill -9 between those steps leaves the new file's
sidecar beside no destination, which the next convert recognizes and
finishes (``check_dst``, ``_killed_publish``), never beside the older file.
The move aside is recorded first (``<dst>.partial.old.id``: the identities
of the older and the new file, written whole and synced at a temporary name,
``<dst>.partial.id<hex>``, then linked at its own), is a link that never replaces
anything, then the unlink of dst; only the recorded file is ever removed
from ``.partial.old``, and not while a buffer has it open (``_aside``), by a
rename into a folder made for it (``<dst>.partial.gone``) where it is
checked before its unlink (``_remove``: a file put at the name meanwhile is
put back). A
killed removal of a sidecar goes through ``<dst>.partial.priorities.dropped``
(``_dropped``). The ``<dst>.partial*`` names are convert's own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import warnings
from pathlib import Path

from ..common.files import FileLock, fsync_dir, open_regular, read_regular
from ..errors import BigperError, InvalidArgumentError, PathExistsError, StorageLockedError


def settled(e: BigperError, partial: Path, dst: Path) -> BigperError:
    """``e``, a refusal of ``dst`` (which changes nothing), saying what an interrupted
    overwrite left at ``_replaced``: the older file it replaced, kept there until a convert
    publishes at dst (``_clear_leftovers``) or the user deletes it."""
    rec = _aside_record(partial)
    old = _older_at(partial, os.path.lexists(rec))
    if not (os.path.lexists(old) or os.path.lexists(rec)):
        return e
    try:
        state, _ = _aside(partial, dst)
    except BigperError as why:
        return type(e)(f"{e}; and {why}")
    if state in (None, "stale"):  # (a record of nothing aside: the next publish drops it)
        return e
    if state in ("same", "published"):
        note = (f"an interrupted overwrite of dst left the older file it replaced at {old} (recorded in {rec}; "
                f"{'a second name of the file at dst' if state == 'same' else 'dst is the new file it wrote'}): "
                "delete both when you no longer need it; a convert that publishes at dst removes them")
    else:
        note = f"an interrupted overwrite of dst left the older file it replaced at {old} (recorded in {rec})"
    return type(e)(f"{e}; {note}")


def kept_at_partial(e: OSError | BigperError, partial: Path) -> OSError | BigperError:
    """``e``, a refusal (or an ``OSError``) at the publish, saying where the complete converted
    file is kept."""
    side = sidecar_of(partial)
    where = (f"the converted file is complete and kept at {partial}"
             + (f", its priorities at {side}" if os.path.isdir(side) and not os.path.islink(side) else "")
             + "; the next convert to dst writes it anew")
    if not isinstance(e, BigperError):  # (an OSError of the publish: a full disk, a mount at dst)
        return type(e)(e.errno, f"{e.strerror} ({where})", e.filename) if e.errno else type(e)(f"{e} ({where})")
    text = str(e)
    text = (text.replace("(nothing was read or written)", f"({where})") if "(nothing was read or written)" in text
            else f"{text} ({where})")
    return type(e)(text)


class DstLock:
    """The lock of a bigper HDF5 storage at ``dst`` (``<dst>.lock``), held
    exclusively: ``StorageLockedError`` while a buffer writes or reads there.
    A lock file this convert made is removed (while still held) at release."""

    def __init__(self, dst: Path):
        dst.parent.mkdir(parents=True, exist_ok=True)
        path = dst.with_name(dst.name + ".lock")
        made = not os.path.lexists(path)
        self._lock = FileLock(path, owner=dst)
        self._made = made

    def release(self) -> None:
        if self._made:
            remove(self._lock.path)
        self._lock.release()


def check_dst(dst: Path, overwrite: bool, partial: Path | None = None, locked: bool = False) -> None:
    """Refuse a ``dst`` this convert may not write (``PathExistsError``,
    nothing read or written). A sidecar at ``<dst>.priorities`` is refused,
    unless it is the one a convert killed between the two renames of
    ``publish`` left (``_killed_publish``): before the lock, that is left to
    judge under it (``locked``); ``drop_leftover`` removes it."""
    side = sidecar_of(dst)
    if os.path.lexists(side):
        if partial is None or not _killed_publish(dst, partial, side, locked, overwrite):
            raise PathExistsError(f"{side} exists: priorities of another file at dst={str(dst)!r}, which the new "
                                  "file would open with or be refused by; move or delete it first (nothing was "
                                  "read or written)")
        # (no dst: the killed run's file is still its partial, which this run replaces; the
        # sidecar goes at this run's publish, under the same lock: a failure before it leaves it)
    try:
        st = os.lstat(dst)
    except FileNotFoundError:
        return
    if not overwrite:
        raise PathExistsError(f"dst={str(dst)!r} already exists; pass overwrite=True (--overwrite) to "
                              "replace it (nothing was read or written)")
    if not stat.S_ISREG(st.st_mode):
        raise PathExistsError(f"dst={str(dst)!r} exists and is not a regular file; overwrite replaces only "
                              "a regular file (nothing was read or written)")


def _killed_publish(dst: Path, partial: Path, side: Path, locked: bool, overwrite: bool) -> bool:
    """Whether ``side`` (``<dst>.priorities``) is the sidecar of ``partial``
    that ``publish`` moved into place before a kill -9 stopped it short of
    the file: no ``dst`` (or, with ``overwrite``, the older regular file the
    killed run was replacing, which this run replaces too), the complete
    ``partial`` still there, and the sidecar made for it under ``dst``'s name
    (its fingerprint; ``load`` checks the rest): never the older file's, which
    an overwrite refuses. Before the lock only the files' presence is looked
    at; under ``dst``'s lock (which a convert holds all through ``publish``)
    the partial is opened and compared."""
    from .h5source import H5Source
    from .sidecar import Sidecar

    if os.path.lexists(dst) and not (overwrite and os.path.isfile(dst) and not os.path.islink(dst)):
        return False
    if not os.path.isfile(partial) or os.path.islink(partial) or not os.path.isdir(side) or os.path.islink(side):
        return False
    if not _ours_only(side):  # (bigper's own regular files only: a folder holding anything else is not removed)
        return False
    if not locked:
        return True

    def made_for(path: Path):
        try:
            src = H5Source(path, held=path == dst)  # (dst's lock is ours)
        except BigperError:
            return None
        try:
            meta = Sidecar(side, dict(src.fingerprint(), name=dst.name), src.n).load()
        except BigperError:
            return None
        finally:
            src.close()
        return meta if isinstance(meta, dict) and meta.get("dataset", {}).get("name") == dst.name else None

    # (a sidecar that the older dst opens with may be its own: the fingerprint is of the
    # files' structure, which two datasets may share; that one is never removed)
    return made_for(partial) is not None and not (os.path.lexists(dst) and made_for(dst) is not None)


def sidecar_of(path: Path) -> Path:
    """Where the priorities sidecar of the file at ``path`` lives (``<path>.priorities``)."""
    from .sidecar import Sidecar

    return Sidecar.default_path(path)


def drop_sidecar(path: Path) -> None:
    """Remove the sidecar directory this convert made beside its partial file
    (or a killed run's, under the partial's lock): bigper's own names only."""
    from .sidecar import _OURS

    if not os.path.lexists(path) or not stat.S_ISDIR(os.lstat(path).st_mode):
        return
    for p in sorted(path.iterdir(), key=lambda p: p.name == "meta.json"):  # (its record last: check_leftovers)
        if _OURS.fullmatch(p.name) and stat.S_ISREG(os.lstat(p).st_mode):
            p.unlink(missing_ok=True)
    os.rmdir(path)  # anything else there: an OSError, nothing of it removed


def _dropped(partial: Path) -> Path:
    """Where the recovery moves a killed publish's sidecar to remove it: a
    name of the partial's (``<dst>.partial.*`` names are this convert's own,
    under dst's lock), never one a user's file is at (``check_not_source``)."""
    return sidecar_of(partial).with_name(sidecar_of(partial).name + ".dropped")


def _ours_only(folder: Path) -> bool:
    """Whether ``folder`` (a real directory) holds bigper's own regular files only."""
    from .sidecar import _OURS

    try:
        return stat.S_ISDIR(os.lstat(folder).st_mode) and all(
            _OURS.fullmatch(e.name) and e.is_file(follow_symlinks=False) for e in os.scandir(folder))
    except OSError:
        return False


def _replaced(partial: Path) -> Path:
    """Where ``publish`` moves the older ``dst`` an overwrite replaces, until the new file is in place."""
    return partial.with_name(partial.name + ".old")


def _aside_record(partial: Path) -> Path:
    """Convert's record of the file it moves to ``_replaced`` (``<dst>.partial.old.id``): written
    (and synced) before the move, removed after the older file; what proves that the file at
    ``_replaced`` is the older dst it moved there, and that dst is the new file it published."""
    return partial.with_name(partial.name + ".old.id")


_RECORD_KIND = "bigper convert: the older dst moved aside"
_RECORD_LIMIT = 4096  # (a record is about 200 bytes)
_OLDER_DST = "dst={dst!r}, the older file an overwrite replaces"


def _identity(st: os.stat_result) -> list:
    """What names one version of a regular file: ``[st_dev, st_ino, st_size, st_mtime_ns]``."""
    return [int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns)]


def _write_record(partial: Path, dst: Path, older: os.stat_result, newer: os.stat_result) -> None:
    """Record, durably, the identities of the older dst (about to go aside) and of the new file
    (``partial``, about to be linked at dst). Written whole and synced under a name of its own
    (``_temporary``), then linked at the record's name (which never replaces anything) and
    unlinked there: the record's name only ever holds a complete record, so that a Ctrl-C or
    a kill -9 at any step leaves no record or one that proves what it says, never one that
    blocks the next convert. ``PathExistsError`` naming it when something is there; an
    ``OSError`` (a full disk) names it too. Whatever fails, nothing of it is left."""
    rec = _aside_record(partial)
    body = json.dumps({"kind": _RECORD_KIND, "dst": dst.name, "older": _identity(older),
                       "newer": _identity(newer)}, sort_keys=True).encode()
    try:
        fd, tmp = _temporary(partial)
    except OSError as e:
        if isinstance(e, BigperError):
            raise
        raise OSError(e.errno, f"{e.strerror} (writing {rec})", str(rec)) from None
    mine = None
    try:
        mine = os.fstat(fd)
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        try:
            os.link(tmp, rec, follow_symlinks=False)
        except FileExistsError:
            raise PathExistsError(f"{rec} appeared while converting; an overwrite records there the older dst it "
                                  f"moves to {_replaced(partial)}: move or delete it first") from None
        if _is(tmp, mine):
            os.unlink(tmp)
        fsync_dir(rec.parent)
    except BaseException as e:
        # (what is ours goes: the record's name when it is this file (a Ctrl-C as the link
        # returned: the name is made, what follows is not), and the temporary's)
        try:
            mine = mine or os.fstat(fd)
            for p in (rec, tmp):
                if _is(p, mine):
                    os.unlink(p)
        finally:
            os.close(fd)
        if isinstance(e, OSError) and not isinstance(e, BigperError):
            raise OSError(e.errno, f"{e.strerror} (writing {rec})", str(rec)) from None
        raise
    os.close(fd)


_TEMPORARY = ".id"  # (+ 4 hex digits: a name as long as the record's, so that it fits where that does)


def _temporary(partial: Path) -> tuple[int, Path]:
    """A new, empty regular file for the record to be written in, made (``O_EXCL``, never
    through a link) at a name of the partial's with a random tail (``<dst>.partial.id<hex>``),
    and open for writing: ``(fd, path)``. A Ctrl-C as its open returns leaves nothing (the
    empty file it made at that fresh name goes); a kill -9 before the record is linked leaves
    it, at a name no later convert needs (it blocks none, and nothing proves it bigper's once
    no process holds it); one linked at the record's name goes with the record
    (``_drop_record``)."""
    import secrets

    for _ in range(100):
        tmp = partial.with_name(f"{partial.name}{_TEMPORARY}{secrets.token_hex(2)}")
        if os.path.lexists(tmp):  # (someone's, or a killed run's: never this open's, so never removed below)
            continue
        try:
            return open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, error=PathExistsError), tmp
        except FileExistsError:
            continue
        except BaseException as e:
            if not isinstance(e, OSError):  # (an interrupt as the open returned: its fd lost, the file made)
                try:
                    st = os.lstat(tmp)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    os.unlink(tmp)
            raise
    raise PathExistsError(f"{partial.parent} holds a file at every name {partial.name}{_TEMPORARY}<4 hex digits> "
                          "that convert tried for the record of an overwrite; move or delete them first")


def _read_record(partial: Path, dst: Path) -> dict | None:
    """The record at ``_aside_record`` (``{"older": identity, "newer": identity}``), or None
    when there is none. Read as untrusted input: anything but a small regular file holding
    exactly what ``_write_record`` writes for this ``dst`` is ``PathExistsError`` naming it,
    and then nothing at ``_replaced`` is ever removed on its word."""
    rec = _aside_record(partial)

    def refuse(why):
        return PathExistsError(
            f"{rec} {why}: it is not a record convert wrote for dst={str(dst)!r} (where an overwrite records "
            f"the older file it moves to {_replaced(partial)}), so nothing is removed on its word; "
            "move or delete it first")

    try:
        raw = read_regular(rec, limit=_RECORD_LIMIT, error=PathExistsError)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # (a name this file system cannot hold: no record can be there)
            return None
        if isinstance(e, PathExistsError):
            raise refuse(f"cannot be read as a record ({e})") from None
        raise refuse(f"cannot be read ({e.strerror})") from None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise refuse("is not JSON") from None

    def ident(v):
        return isinstance(v, list) and len(v) == 4 and all(type(x) is int and -(1 << 63) <= x < 1 << 64 for x in v)

    if not (isinstance(meta, dict) and sorted(meta) == ["dst", "kind", "newer", "older"]
            and meta["kind"] == _RECORD_KIND and meta["dst"] == dst.name
            and ident(meta["older"]) and ident(meta["newer"])):
        raise refuse("does not hold what convert records there")
    return {"older": meta["older"], "newer": meta["newer"]}


def _drop_record(partial: Path) -> None:
    """Remove the record (one ``_write_record`` wrote, or one ``_read_record`` accepted), and
    before it any second name of it at a temporary's name (``_temporary``: a kill -9 between
    the record's link and the temporary's unlink leaves one)."""
    rec = _aside_record(partial)
    try:
        st = os.lstat(rec)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        return
    if st.st_nlink > 1:
        tail = re.compile(re.escape(partial.name + _TEMPORARY) + "[0-9a-f]{4}")
        with os.scandir(partial.parent) as found:
            for e in found:
                if tail.fullmatch(e.name) and _is(Path(e.path), st):
                    os.unlink(e.path)
    os.unlink(rec)
    fsync_dir(partial.parent)


def _aside(partial: Path, dst: Path) -> tuple[str | None, os.stat_result | None]:
    """What sits at ``_replaced`` (or, where a removal was killed midway, in ``_gone``'s folder:
    ``_older_at``) and what it is, proven against the record:

    - ``None``: nothing there and no record;
    - ``"stale"``: a record, nothing there (a kill before the move aside, or after the older
      file's removal): the record goes;
    - ``"same"``: the older file, still at dst too (a kill between the link and the unlink of
      the move aside): only the name ``_replaced`` goes;
    - ``"published"``: the older file, and dst is the new file the record names (a kill after
      the link, or the partial linked at dst by hand): the older file goes;
    - ``"pending"``: the older file, and no dst (a kill before the link): the next publish
      removes it.

    Anything else is ``PathExistsError`` naming it, nothing touched: a file at ``_replaced``
    without a record (a user's, an older bigper's), a record that is not convert's, a file
    there that is not the one recorded (a hard link, a copy, a folder, a symlink, a FIFO),
    or the recorded older file beside a dst that is not the recorded new one."""
    rec = _aside_record(partial)
    record = _read_record(partial, dst)
    old = _older_at(partial, record is not None)
    try:
        st = os.lstat(old)
    except FileNotFoundError:
        return (None if record is None else "stale"), None
    if record is None:
        raise PathExistsError(f"{old} exists, and no record of convert's ({rec}) says it is the older dst an "
                              "overwrite moved there: convert removes only that; move or delete it first")
    if not stat.S_ISREG(st.st_mode) or _identity(st) != record["older"]:
        raise PathExistsError(f"{old} is not the file {rec} records (the older dst an overwrite moved there): "
                              "convert removes only that; move or delete it first")
    try:
        d = os.lstat(dst)
    except FileNotFoundError:
        return "pending", st
    if (d.st_dev, d.st_ino) == (st.st_dev, st.st_ino):
        return "same", st
    if stat.S_ISREG(d.st_mode) and _identity(d) == record["newer"]:
        return "published", st
    raise PathExistsError(f"{old} holds the older dst that an interrupted overwrite moved aside ({rec} records "
                          f"it), and dst={str(dst)!r} is not the file that overwrite wrote: move {old} (the older "
                          "file, whole) where you want it, or delete it, first")


def _unused(path: Path, ident: list, what: str, *, lockfile: bool = True, unlink: bool = False) -> None:
    """``StorageLockedError`` naming ``path`` (the regular file whose identity is ``ident``)
    when a buffer, or any HDF5 reader (HDF5 holds an flock on the file it opens), has it
    open, or (``lockfile``) a buffer holds its lock ``<path>.lock``; probed with an exclusive
    non-blocking flock on the file itself, which makes no file. ``unlink``: then unlink it,
    that flock held while its name goes."""
    try:
        fd = open_regular(path, os.O_RDONLY, error=PathExistsError)
    except FileNotFoundError:
        return
    try:
        if _identity(os.fstat(fd)) != ident:
            raise PathExistsError(f"{path} changed while convert was removing it ({what}); left as it is")
        busy = f"{path} ({what}) is open in a buffer or another HDF5 reader"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageLockedError(f"{busy}: close it, then convert again; it was left as it is") from None
        lock = path.with_name(path.name + ".lock")
        try:
            lfd = open_regular(lock, os.O_RDONLY, error=PathExistsError) if lockfile else -1
        except (OSError, PathExistsError):
            lfd = -1  # (none, or not a regular file: not a lock a buffer holds)
        if lfd >= 0:
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StorageLockedError(f"{busy} (lock {lock} is held): close it, then convert again; "
                                         "it was left as it is") from None
            finally:
                os.close(lfd)  # (its flock goes with it)
        if unlink:
            _remove(path, os.fstat(fd), what)
    finally:
        os.close(fd)


def _gone(path: Path) -> Path:
    """The folder the removal of ``path`` (``_replaced``: ``<dst>.partial.old``) moves it into
    first (``<dst>.partial.gone``, made for it, removed after it): a name of convert's own,
    as long as the record's or shorter."""
    return path.with_name(path.name[:-len(".old")] + ".gone")


def _older_at(partial: Path, recorded: bool) -> Path:
    """Where the older file an overwrite moved aside is: ``_replaced``, or, with a record and
    nothing there, in ``_gone``'s folder, where a removal killed before its unlink left it."""
    old = _replaced(partial)
    if recorded and not os.path.lexists(old) and _real_dir(_gone(old)) and os.path.lexists(_gone(old) / old.name):
        return _gone(old) / old.name  # (never through a symlink at _gone: a name elsewhere is not ours)
    return old


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _check_gone(partial: Path, old: Path) -> None:
    """``PathExistsError`` naming ``_gone`` (before anything is written) unless the removal of
    the older file at ``old`` can use it: nothing there, an empty folder (a killed removal's),
    or the folder holding that file alone (``_older_at``)."""
    gone = _gone(_replaced(partial))
    if not os.path.lexists(gone):
        return
    try:
        if _real_dir(gone) and os.listdir(gone) in ([], [old.name] if old.parent == gone else []):
            return
    except OSError:
        pass
    raise PathExistsError(f"{gone} is in the way: convert moves the older file at {old} there to remove it, and "
                          "it holds what convert did not put there; move or delete it first (nothing was read "
                          "or written)")


def _remove(path: Path, held: os.stat_result, what: str) -> None:
    """Unlink the name ``path`` of the file ``held`` (convert's own, proven), never a file put
    there meanwhile: the name is first renamed into a folder made for it (``_gone``: nothing
    else is there to replace) and checked there; the file that was put at ``path`` is put
    back (``PathExistsError`` naming it). A name already in that folder (a killed removal's)
    is checked and unlinked there. The folder goes when empty."""
    gone = _gone(path) if path.parent.name != path.name[:-len(".old")] + ".gone" else path.parent
    moved = gone / path.name
    if path != moved:
        try:
            os.mkdir(gone, 0o700)
        except FileExistsError:
            try:
                os.rmdir(gone)  # (an empty one a killed removal left; anything else stays)
            except OSError:
                raise PathExistsError(f"{gone} is in the way: convert moves {path} ({what}) there to remove it; "
                                      "move or delete it first") from None
            os.mkdir(gone, 0o700)
        try:
            os.rename(path, moved)
        except FileNotFoundError:  # (no name left to remove)
            os.rmdir(gone)
            return
    if _is(moved, held):
        os.unlink(moved)
        try:
            os.rmdir(gone)
        except OSError:  # (something put in it meanwhile: it stays, and the next removal names it)
            pass
        return
    put = f"{path} changed while convert was removing it ({what})"
    try:  # (not the file checked: someone's, put at path meanwhile: back where it was, never over anything)
        if stat.S_ISDIR(os.lstat(moved).st_mode):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "taken", str(path))
            os.rename(moved, path)
        else:
            os.link(moved, path, follow_symlinks=False)
            os.unlink(moved)
    except FileExistsError:
        raise PathExistsError(f"{put}: what was put there is kept at {moved}, {path} being taken again; "
                              "move it where you want it") from None
    os.rmdir(gone)
    raise PathExistsError(f"{put}; it was put back and left as it is")


def _finish_aside(partial: Path, dst: Path, states=("stale", "same", "published", "pending")) -> str | None:
    """Finish what an interrupted overwrite left at ``_replaced`` (under dst's lock), where the
    state (``_aside``) is one of ``states``: the older file (or its second name) goes, then the
    record. The state found; ``PathExistsError`` / ``StorageLockedError`` as ``_aside`` and
    ``_unused`` say, nothing removed."""
    state, st = _aside(partial, dst)
    if state not in states:
        return state
    old = _older_at(partial, state is not None)
    if state == "same":  # (two names of the older file: dst's stays)
        _remove(old, st, "a second name of dst")
    elif state in ("published", "pending"):
        _unused(old, _identity(st), "the older dst an interrupted overwrite moved aside, to be removed", unlink=True)
    if state is not None:
        try:
            os.rmdir(_gone(_replaced(partial)))  # (empty: a removal killed after its unlink)
        except OSError:
            pass
        if state != "stale":
            fsync_dir(partial.parent)
        _drop_record(partial)
    return state


def check_leftovers(partial: Path, dst: Path) -> None:
    """``PathExistsError`` unless what sits at the names ``publish`` clears is
    what a killed publish leaves there: at ``_replaced``, nothing or the older
    dst the record proves (``_aside``; one a buffer has open is
    ``StorageLockedError``); at ``_dropped``, nothing or what a killed removal
    left of a sidecar made for ``dst``: bigper's own files, among them its
    record naming dst (``drop_sidecar`` removes it last), or none."""
    state, st = _aside(partial, dst)
    if state in ("published", "pending"):
        _unused(_older_at(partial, True), _identity(st),
                "the older dst an interrupted overwrite moved aside, to be removed")
    if state in ("published", "pending", "same"):  # (removed at the publish, through _gone)
        _check_gone(partial, _older_at(partial, True))
    trash = _dropped(partial)
    if not os.path.lexists(trash):
        return
    if _ours_only(trash):
        try:
            left = os.listdir(trash)
            if not left:
                return
            if "meta.json" in left:
                with open(trash / "meta.json", "rb") as f:
                    meta = json.loads(f.read(1 << 20))
                if isinstance(meta, dict) and isinstance(meta.get("dataset"), dict) \
                        and meta["dataset"].get("name") == dst.name:
                    return
        except (OSError, ValueError):
            pass
    raise PathExistsError(f"{trash} holds what bigper did not leave there; a convert moves a killed run's "
                          "priorities there to remove them: move or delete it first (nothing was read or written)")


def _clear_leftovers(partial: Path, dst: Path) -> None:
    """Finish what a kill -9 stopped: the removal of the older dst an
    overwrite replaced (``_replaced``) and of a killed publish's sidecar
    (``_dropped``); ``check_leftovers`` first."""
    check_leftovers(partial, dst)
    _finish_aside(partial, dst)
    try:
        drop_sidecar(_dropped(partial))
    except OSError as e:
        raise PathExistsError(f"{_dropped(partial)} (a killed run's priorities, being removed) cannot be removed: "
                              f"{e.strerror}; move or delete it first") from None


def drop_leftover(partial: Path, dst: Path) -> None:
    """Remove the killed publish's sidecar at ``<dst>.priorities`` (recognized
    under dst's lock: ``check_dst``), before this run replaces the partial it
    was proven against (a kill while this run writes then leaves no sidecar
    beside a partial it was not made for). Renamed away first (``_dropped``,
    cleared of a killed removal's files first: ``check_leftovers`` proved them
    bigper's), so that a kill -9 while its files go leaves it whole where it
    was (the next convert recognizes it) or gone from there, never half of it;
    a file put there since it was recognized is put back with it
    (``PathExistsError``, nothing removed)."""
    side, trash = sidecar_of(dst), _dropped(partial)
    try:
        drop_sidecar(trash)
    except OSError as e:
        raise PathExistsError(f"{trash} (a killed run's priorities, being removed) cannot be removed: "
                              f"{e.strerror}; move or delete it first") from None
    os.rename(side, trash)
    if not _ours_only(trash):
        os.rename(trash, side)
        raise PathExistsError(f"{side} holds files bigper did not write (put there while converting); "
                              "move or delete them first (nothing there was removed)")
    drop_sidecar(trash)


def check_not_source(store, dst: Path, partial: Path) -> None:
    src = Path(store.file_path)
    for p in (dst, partial, _replaced(partial)):
        if os.path.exists(p) and os.path.samefile(p, src):
            raise InvalidArgumentError(f"dst={str(dst)!r} is the source file {src} (or its .partial, or the "
                                       "older file a killed overwrite left at .partial.old); convert never "
                                       "writes its source")
    # The source's priorities sidecar (a directory that from_hdf5 reads): a file made
    # there, or beside it as the partial's sidecar, would change how the source opens.
    side = store.sidecar
    if side is not None:
        theirs = os.path.realpath(side.path)
        for p in (dst, partial, sidecar_of(partial), sidecar_of(dst), _dropped(partial)):
            if os.path.realpath(p) == theirs or os.path.realpath(p).startswith(theirs + os.sep):
                raise InvalidArgumentError(f"dst={str(dst)!r} is (or is in) {side.path}, where the source's "
                                           "priorities live; convert never writes its source")


def publish(partial: Path, dst: Path, overwrite: bool) -> None:
    """``partial`` becomes ``dst``: linked (which fails if something appeared at
    ``dst`` meanwhile) and unlinked; then the directory is synced and the
    partial's lock file removed. With ``overwrite`` the older file is moved
    aside first (``_move_aside``: recorded, then linked at ``_replaced`` and
    unlinked at dst, never over anything) and removed last, unless a buffer has
    it open (then it stays, recorded, and the next convert removes it); a
    failure before the link puts it back (or, where dst is taken, says where it
    is kept)."""
    ours, side = sidecar_of(partial), sidecar_of(dst)
    _clear_leftovers(partial, dst)  # (a killed publish's or recovery's)
    if overwrite or not os.path.lexists(dst):  # else the link below says it appeared meanwhile
        check_dst(dst, overwrite)
    # The older file goes aside first and the priorities next: a kill -9 between
    # the renames leaves a sidecar without its file (which the next convert
    # recognizes and removes, under this lock: _killed_publish), never a file
    # that opens with another's priorities or with default ones.
    old = _move_aside(partial, dst) if overwrite and os.path.lexists(dst) else None
    moved = os.path.isdir(ours) and not os.path.islink(ours)
    linked, new = False, None
    try:
        new = os.lstat(partial)  # (the new file: what dst is once linked, whatever stops the flag below)
        if moved:
            os.rename(ours, side)
        try:
            os.link(partial, dst)
        except FileExistsError:
            if not _is(dst, new):  # (else a second name of the new file: it is published)
                raise PathExistsError(f"dst={str(dst)!r} appeared while converting") from None
        linked = True  # (published: from here on nothing is put back, dst is the new file with its sidecar)
        os.unlink(partial)
    except BaseException as e:
        # (the flag is not proof: a Ctrl-C as os.link returns comes before it is set; dst that
        # is the new file (its inode) is published, and nothing is put back, as after the flag)
        linked = linked or (new is not None and _is(dst, new))
        if not linked:
            if moved and not os.path.lexists(ours):
                os.rename(side, ours)
            if old is not None and not _put_back(partial, dst, old) and isinstance(e, BigperError):
                raise type(e)(f"{e}; the older file dst held is kept at {old}") from None
        raise
    fsync_dir(dst.parent)
    if old is not None:
        try:
            # ("same": what went aside was the new file itself, a second name of it put at dst
            # while converting; that second name, made by the move aside, goes with the record)
            _finish_aside(partial, dst, ("published", "same"))
        except (BigperError, OSError) as e:  # (a buffer opened it meanwhile, a full disk: it stays, recorded,
            # for the next convert; dst is published, which no exception may say otherwise of)
            warnings.warn(f"convert published {dst}; the older file it replaced stays at {old} for now: {e}. "
                          "The next convert to this dst removes it once it is closed", stacklevel=3)
    remove(partial.with_name(partial.name + ".lock"))


def _is(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` names the file (the inode) whose ``lstat`` was ``st`` (False where it
    cannot be looked at: nothing is proven there)."""
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _move_aside(partial: Path, dst: Path) -> Path:
    """Move the older regular file at ``dst`` to ``_replaced``: its identity (and the new
    file's) recorded durably first (``_write_record``), then linked there (which fails if
    anything is there: nothing is ever replaced) and checked against the record, then
    unlinked at dst. Anything but the regular file that was checked (a folder or symlink put
    at dst meanwhile) is ``PathExistsError``, left where it is. A failure (or Ctrl-C) leaves
    dst as it was and the record dropped; a kill between the link and the unlink leaves two
    names of one file, which ``_aside`` knows."""
    old = _replaced(partial)
    st = os.lstat(dst)
    changed = (f"dst={str(dst)!r} is no longer the regular file that was checked (something was put there "
               "while converting); overwrite replaces only a regular file")
    if not stat.S_ISREG(st.st_mode):
        raise PathExistsError(changed)
    _unused(dst, _identity(st), _OLDER_DST.format(dst=str(dst)), lockfile=False)
    _write_record(partial, dst, st, os.lstat(partial))
    made = False
    try:
        try:
            os.link(dst, old, follow_symlinks=False)
        except FileExistsError:
            raise PathExistsError(f"{old} appeared while converting; an overwrite moves the older dst there "
                                  "until the new file is in place: move or delete it first") from None
        except OSError:  # (a folder put at dst meanwhile cannot be linked: EPERM)
            if not stat.S_ISREG(os.lstat(dst).st_mode):
                raise PathExistsError(changed) from None
            raise
        made = True
        got, now = os.lstat(old), os.lstat(dst)
        if not stat.S_ISREG(got.st_mode) or _identity(got) != _identity(st) \
                or (now.st_dev, now.st_ino) != (got.st_dev, got.st_ino):
            raise PathExistsError(changed)
        os.unlink(dst)
    except BaseException:
        try:  # (made: the link was made, though a Ctrl-C in it may have come after)
            made = made or _identity(os.lstat(old))[:2] == _identity(st)[:2]
        except FileNotFoundError:
            pass
        if made:  # (undone: the name made at old goes; the older file, if already off dst, goes back)
            _undo_aside(partial, dst, old, st)
        else:
            _drop_record(partial)
        raise
    return old


def _undo_aside(partial: Path, dst: Path, old: Path, st: os.stat_result) -> None:
    """What ``_move_aside`` did, undone after its link: the name at ``old`` goes while dst
    still names the same file, or the older file goes back to a free dst; else it stays at
    ``old``, proven by the record (the next convert finishes or names it)."""
    try:
        got = os.lstat(old)
    except FileNotFoundError:
        _drop_record(partial)
        return
    try:
        now = os.lstat(dst)
    except FileNotFoundError:
        now = None
    if now is not None and (now.st_dev, now.st_ino) == (got.st_dev, got.st_ino):
        os.unlink(old)  # (a second name of what is at dst, made just now)
        _drop_record(partial)
    elif now is None and _identity(got) == _identity(st):
        _put_back(partial, dst, old)


def _put_back(partial: Path, dst: Path, old: Path) -> bool:
    """Put the older file (moved to ``old`` by ``_move_aside``) back at ``dst``: linked (never
    over what is there) and unlinked at ``old``, the record dropped. False when dst is taken:
    it stays at ``old``, and its record is dropped too, so that no later convert removes it
    (the error names it)."""
    try:
        os.link(old, dst, follow_symlinks=False)
    except FileExistsError:
        _drop_record(partial)
        return False
    except OSError:  # (no inode for a link: a full tmpfs counts links; a rename takes none)
        if os.path.lexists(dst):
            _drop_record(partial)
            return False
        os.rename(old, dst)
    else:
        os.unlink(old)
    fsync_dir(dst.parent)
    _drop_record(partial)
    return True


def remove(path: Path) -> None:
    """Unlink a regular file this convert made (the partial file, its lock file)."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    if path.suffix == ".partial":
        remove(path.with_name(path.name + ".lock"))


def refuse_open(dst: Path) -> None:
    """``StorageLockedError`` when a buffer or another HDF5 reader has the regular file at
    ``dst`` open (an overwrite's older file: no lock file may be there for a reader to hold,
    but HDF5 holds an flock on the file it reads)."""
    if os.path.isfile(dst) and not os.path.islink(dst):
        _unused(dst, _identity(os.lstat(dst)), _OLDER_DST.format(dst=str(dst)), lockfile=False)
