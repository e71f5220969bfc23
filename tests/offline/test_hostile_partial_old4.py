"""Attack on the five newest ``publish:`` commits (a937f80, ebbcdce, e19c3d5, 9328354, 6b4c338):
the move-aside record written whole at a temporary ``<dst>.partial.id<hex>`` (O_EXCL, fsync) and
linked at ``<dst>.partial.old.id``; the older file removed by a rename into a folder made for it,
``<dst>.partial.gone``, checked and unlinked there (``_remove``), found there after a kill
(``_older_at``); dst that is the new file's inode counted as published whatever the flag says.

Attacked here with real files, real HDF5, real kill -9 and SIGINT (the fork server of
test_hostile_killed_publish3) and a real tmpfs (root): something of a user's at
``<dst>.partial.gone`` (a folder with files, a file, a symlink to a folder, a FIFO, a folder of
mode 000 owned by nobody, an empty folder); a symlink at ``.partial.gone`` to a folder holding
the older file a kill left aside; a file put into ``.partial.gone`` after a kill there and while a
removal runs in it; a real ENOSPC (no inode left) at the mkdir of ``.partial.gone`` after the
publish; a user's file and symlink at the temporary record's names, every such name taken, an
interrupt at the temporary's open over a user's empty file; kill -9 and Ctrl-C at every new step
(the temporary's open, link, unlink; mkdir, rename into, unlink in and rmdir of ``.partial.gone``;
the record's unlink), each followed by a convert without and then with overwrite; two processes
over a removal killed in ``.partial.gone``; a dst name of 240 characters killed in the removal;
the older file a killed removal left in ``.partial.gone`` given as the source.

Held (plain tests): every kill -9 and Ctrl-C point above is followed by a convert that completes or
refuses with every file as it was, and an overwrite that leaves nothing of convert's but, after a
kill -9 between the temporary's open and its link, that one temporary (documented: nothing proves
it convert's once no process holds it, so it is never removed; each such kill leaves one more); a
Ctrl-C leaves no temporary; a user's file, symlink or hard link at a temporary's name is skipped
and left; every name taken is a PathExistsError before dst changes; an empty folder at
``.partial.gone`` is taken as a killed removal's and goes (the ``.partial.*`` names are convert's).

Findings, fixed in bigper/offline/publish.py (each test below fails without its fix):
- ``check_leftovers`` did not look at ``.partial.gone``: a user's folder (or file) there made the
  next convert over an older file aside write the whole new file and only then refuse
  (``_remove``, "in the way"), leaving ``<dst>.partial`` and its lock behind; now refused before
  the write, nothing changed (``_check_gone``).
- ``_older_at`` followed a symlink at ``.partial.gone``: the older file a user moved into the
  symlink's target folder was unlinked there (and the convert then failed with a raw
  NotADirectoryError at the rmdir); now a symlink there is never looked through.
- ``_remove`` let the rmdir of ``.partial.gone`` fail raw (ENOTEMPTY) after its unlink when a file
  was put in the folder meanwhile: a convert that had published dst raised an OSError; now the
  folder (with that file) stays.
- ``publish`` caught only a BigperError from its final removal of the older file: an OSError
  there (ENOSPC at the mkdir of ``.partial.gone``) came out of a convert that had published dst;
  now it is the same warning (the older file stays, recorded, for the next convert).
- ``_temporary`` removed an empty regular file at the temporary's name on an interrupt before its
  open returned, though that file may be a user's (the open never ran); now a name where
  anything exists is skipped before the open, so the file removed is one the open made.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import warnings

import pytest

from bigper.convert import convert
from bigper.errors import BigperError, PathExistsError

from tests._hostile_snapshot_cases import deadline
from tests.conftest import mounted_tmpfs
from tests.offline.test_convert import everything, write_d4rl
from tests.offline.test_hostile_killed_publish3 import (  # noqa: F401  (fixtures)
    _kill_at, copy_killed, server)
from tests.offline.test_hostile_partial_old import _interrupt, _kill_children_of
from tests.offline.test_hostile_partial_old2 import _state

OLD = "z.h5.partial.old"
REC = "z.h5.partial.old.id"
GONE = "z.h5.partial.gone"
TMP = "z.h5.partial.id"  # (+ 4 hex digits)


@pytest.fixture(autouse=True)
def _no_hang():
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _digest(path) -> str:
    """What a dataset holds (its transitions and keys), whatever file holds it."""
    with deadline(60):
        data, keys = everything(path)
    h = hashlib.sha256(keys.tobytes())
    for k in sorted(data):
        h.update(k.encode() + data[k].tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """``src/old.h5`` and ``src/new.h5`` (no keys: no sidecar, so that an overwrite may always
    follow) and ``z.h5``, a convert of old.h5: (root, digest of old.h5's convert, of new.h5's)."""
    root = tmp_path_factory.mktemp("base")
    (root / "src").mkdir()
    write_d4rl(root / "src" / "old.h5", n=90)
    write_d4rl(root / "src" / "new.h5", n=100)
    convert(root / "src" / "new.h5", root / "w.h5", progress=False)
    new = _digest(root / "w.h5")
    os.unlink(root / "w.h5")
    convert(root / "src" / "old.h5", root / "z.h5", progress=False)
    return root, _digest(root / "z.h5"), new


def _copy(base, tmp_path):
    root, old, new = base
    run = tmp_path / "t"
    copy_killed(root, run)
    return run, run / "src" / "new.h5", run / "z.h5", old, new


def _left(run):
    return sorted(p.name for p in run.iterdir() if p.name != "z.h5.lock")


def _convert(src, dst, overwrite):
    with deadline(60):
        return convert(src, dst, progress=False, overwrite=overwrite)


def _refused_unchanged(run, src, dst, overwrite, names):
    before = _state(run)
    with pytest.raises(BigperError) as e:
        _convert(src, dst, overwrite)
    assert names in str(e.value), str(e.value)
    assert _state(run) == before, ("a refusal changed files", _left(run))
    return str(e.value)


@pytest.fixture(scope="module")
def killed_in_gone(server, base, tmp_path_factory):
    """An overwrite of z.h5 by new.h5 killed in the removal of the older file: moved into
    ``.partial.gone``, before its unlink there (dst is the new file, the older file recorded)."""
    root = tmp_path_factory.mktemp("killedgone")
    run, src, dst, old, new = _copy(base, root)
    assert _kill_at(server, src, dst, "unlink", "$" + OLD, 1, True), server.last
    assert not os.path.lexists(run / OLD) and os.path.isfile(run / GONE / OLD) and os.path.isfile(run / REC)
    return run


@pytest.fixture(scope="module")
def killed_pending(server, base, tmp_path_factory):
    """An overwrite of z.h5 by new.h5 killed at the publish's link: the older file aside at
    ``.partial.old``, recorded, no dst."""
    root = tmp_path_factory.mktemp("killedpending")
    run, src, dst, old, new = _copy(base, root)
    assert _kill_at(server, src, dst, "link", "z.h5.partial>z.h5", 1, True), server.last
    assert not os.path.lexists(dst) and os.path.isfile(run / OLD) and os.path.isfile(run / REC)
    return run


def _copy_killed(run, tmp_path):
    """``copy_killed`` (the record made to name the copies), the older file in .partial.gone too."""
    import json

    to = tmp_path / "t"
    copy_killed(run, to)
    if os.path.isfile(run / GONE / OLD) and os.path.isfile(to / REC):
        meta = json.loads((to / REC).read_text())
        if meta["older"] == _ident(run / GONE / OLD):
            meta["older"] = _ident(to / GONE / OLD)
            (to / REC).write_text(json.dumps(meta))
    return to, to / "src" / "new.h5", to / "z.h5"


def _ident(path):
    st = os.lstat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


# -- something of a user's at <dst>.partial.gone ---------------------------------------------------------

def _put_at_gone(run, tmp_path, what):
    gone = run / GONE
    if what == "folder-with-files":
        gone.mkdir()
        (gone / "mine.txt").write_text("the user's")
        (gone / OLD).write_bytes(b"a user's file named like the older file")
    elif what == "file":
        gone.write_text("the user's file")
    elif what == "symlink-to-a-folder":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "mine.txt").write_text("the user's")
        (tmp_path / "elsewhere" / OLD).write_text("the user's")
        gone.symlink_to(tmp_path / "elsewhere")
    elif what == "fifo":
        os.mkfifo(gone)
    elif what == "mode-000-owned-by-nobody":
        gone.mkdir()
        (gone / "mine.txt").write_text("the user's")
        os.chown(gone, 65534, 65534)
        os.chmod(gone, 0)
    else:
        raise AssertionError(what)


THINGS = ["folder-with-files", "file", "symlink-to-a-folder", "fifo", "mode-000-owned-by-nobody"]


# (Was a bug, fixed (_check_gone, called from check_leftovers): the second convert wrote the whole new
# file, then refused at the publish (_remove: ".partial.gone is in the way") and left <dst>.partial and
# its lock behind.)
@pytest.mark.parametrize("what", [pytest.param(w, marks=[] if w in ("folder-with-files", "symlink-to-a-folder")
                                               else [pytest.mark.slow]) for w in THINGS])
def test_a_users_thing_at_partial_gone_is_never_touched_and_refused_before_the_write(base, tmp_path, what):
    """An overwrite publishes (the older file stays aside, recorded, with a warning naming
    .partial.gone); the next convert over that older file is refused before it writes anything,
    every file as it was (the symlink's target too); once the thing is moved away, the next
    overwrite leaves nothing of convert's."""
    run, src, dst, old, new = _copy(base, tmp_path)
    _put_at_gone(run, tmp_path, what)
    outside = _state(tmp_path / "elsewhere") if what == "symlink-to-a-folder" else None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _convert(src, dst, True)
    assert _digest(dst) == new
    assert any(GONE in str(x.message) for x in w), [str(x.message) for x in w]
    assert _left(run) == ["src", "z.h5", GONE, OLD, REC], _left(run)
    for overwrite in (False, True):
        _refused_unchanged(run, run / "src" / "old.h5", dst, overwrite, GONE if overwrite else "z.h5")
    if outside is not None:
        assert _state(tmp_path / "elsewhere") == outside
    kept = tmp_path / "kept"
    os.rename(run / GONE, kept)
    _convert(run / "src" / "old.h5", dst, True)
    assert _digest(dst) == old and _left(run) == ["src", "z.h5"], _left(run)
    if what == "folder-with-files" or what == "mode-000-owned-by-nobody":
        os.chmod(kept, 0o700)
        assert (kept / "mine.txt").read_text() == "the user's"


def test_an_empty_folder_at_partial_gone_is_taken_as_a_killed_removals(base, tmp_path):
    """(By design: <dst>.partial.* names are convert's own; an empty folder there is what a
    removal killed after its unlink leaves, and it goes.)"""
    run, src, dst, old, new = _copy(base, tmp_path)
    (run / GONE).mkdir()
    _convert(src, dst, True)
    assert _digest(dst) == new and _left(run) == ["src", "z.h5"], _left(run)


# (Was a bug, fixed (_older_at looks into .partial.gone only when it is a real folder): a symlink at
# .partial.gone to a folder holding the older file aside (moved there by the user after a kill) was
# looked through, the older file unlinked in that folder, then a raw NotADirectoryError at the rmdir.)
def test_a_symlink_at_partial_gone_is_never_looked_through(base, killed_pending, tmp_path):
    run, src, dst = _copy_killed(killed_pending, tmp_path)
    keep = tmp_path / "keep"
    keep.mkdir()
    os.rename(run / OLD, keep / OLD)  # (the user keeps the older file, in a folder of their own)
    (run / GONE).symlink_to(keep)
    theirs = _state(keep)
    said = None
    try:
        _convert(src, dst, False)
    except BigperError as e:
        said = str(e)
    assert _state(keep) == theirs, ("a name inside the symlink's target was changed", said)
    assert os.path.islink(run / GONE)
    if said is None:
        assert _digest(dst) == base[2]


# (Was a bug, fixed (_check_gone): a file put into .partial.gone beside the older file a killed removal
# left there made the next overwrite write the whole new file, unlink the older file, then fail raw at
# the rmdir (OSError ENOTEMPTY), the partial and its lock left behind.)
def test_a_file_put_into_partial_gone_after_a_kill_is_refused_before_the_write(killed_in_gone, tmp_path):
    run, src, dst = _copy_killed(killed_in_gone, tmp_path)
    (run / GONE / "mine.txt").write_text("the user's")
    for overwrite in (False, True):
        _refused_unchanged(run, run / "src" / "old.h5", dst, overwrite, GONE if overwrite else "z.h5")
    os.rename(run / GONE / "mine.txt", tmp_path / "mine.txt")
    _convert(run / "src" / "old.h5", dst, True)
    assert _left(run) == ["src", "z.h5"], _left(run)
    assert (tmp_path / "mine.txt").read_text() == "the user's"


# (Was a bug, fixed (_remove: the rmdir of .partial.gone tolerates what was put in it): the convert,
# which had published dst, ended with a raw OSError ENOTEMPTY.)
def test_a_file_put_into_partial_gone_during_the_removal_is_kept_and_the_publish_stands(server, base, tmp_path):
    run, src, dst, old, new = _copy(base, tmp_path)

    def during():  # the older file is in .partial.gone, checked; a file of the user's lands beside it
        (run / GONE / "mine.txt").write_text("the user's")

    said = _kill_at(server, src, dst, "unlink", "$" + OLD, 1, True, during=during, resume=True)
    assert said == "ended done", said
    assert _digest(dst) == new
    assert (run / GONE / "mine.txt").read_text() == "the user's"
    assert not os.path.lexists(run / GONE / OLD) and not os.path.lexists(run / REC), _left(run)


# -- a full tmpfs (no inode left) at the mkdir of .partial.gone, after the publish ----------------------

# (Was a bug, fixed (publish: an OSError of the final removal is the warning a BigperError there is):
# the convert, which had published dst, ended with a raw OSError ENOSPC.)
@pytest.mark.slow  # (CI time: run with -m slow)
def test_enospc_at_the_mkdir_of_partial_gone_after_the_publish(base, tmp_path):
    from tests._child import Child
    from tests.offline.test_hostile_killed_publish3 import SERVER

    gen = mounted_tmpfs(tmp_path, "64m,nr_inodes=400")
    fs = next(gen)
    try:
        root, old, new = base
        run = fs / "t"
        copy_killed(root, run)
        src, dst = run / "src" / "new.h5", run / "z.h5"
        (fs / "fill").mkdir()

        def during():
            for i in range(10000):
                try:
                    os.close(os.open(fs / "fill" / str(i), os.O_CREAT | os.O_WRONLY, 0o644))
                except OSError:
                    return

        with Child(SERVER, stdin=True) as own:
            own.said("ready")
            try:
                with deadline(120):
                    said = _kill_at(own, src, dst, "mkdir", "$" + GONE, 1, True, during=during, resume=True)
            finally:
                _kill_children_of(own.pid)
        shutil.rmtree(fs / "fill")
        assert said == "ended done", said
        assert _digest(dst) == new
        assert os.path.isfile(run / OLD) and os.path.isfile(run / REC), _left(run)
        _convert(run / "src" / "old.h5", dst, True)
        assert _digest(dst) == old and _left(run) == ["src", "z.h5"], _left(run)
    finally:
        next(gen, None)


# -- the temporary record's names ---------------------------------------------------------------------------

def _names(monkeypatch, *tails):
    """secrets.token_hex gives ``tails`` in turn, then random ones."""
    import secrets

    real = secrets.token_hex
    todo = list(tails)
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: todo.pop(0) if todo else real(n))


def test_a_users_file_and_symlink_at_the_temporary_names_are_never_touched(base, tmp_path, monkeypatch):
    run, src, dst, old, new = _copy(base, tmp_path)
    target = tmp_path / "target.txt"
    target.write_text("the user's")
    (run / (TMP + "abcd")).write_text("the user's file")
    (run / (TMP + "abce")).symlink_to(target)
    os.link(target, run / (TMP + "abcf"))  # (a hard link: a regular file, not convert's)
    theirs = {n: (os.lstat(run / n).st_ino, os.readlink(run / n) if os.path.islink(run / n)
                  else (run / n).read_text()) for n in (TMP + "abcd", TMP + "abce", TMP + "abcf")}
    _names(monkeypatch, "abcd", "abce", "abcf")
    _convert(src, dst, True)
    assert _digest(dst) == new
    assert {n: (os.lstat(run / n).st_ino, os.readlink(run / n) if os.path.islink(run / n)
                else (run / n).read_text()) for n in theirs} == theirs
    assert target.read_text() == "the user's"
    assert _left(run) == sorted(["src", "z.h5", *theirs]), _left(run)


def test_every_temporary_name_taken_is_a_refusal_that_keeps_dst(base, tmp_path, monkeypatch):
    """(100 tries, each at a taken name: the publish is refused before anything at dst changes.)"""
    run, src, dst, old, new = _copy(base, tmp_path)
    (run / (TMP + "abcd")).write_text("the user's file")
    _names(monkeypatch, *["abcd"] * 100)
    with pytest.raises(PathExistsError) as e:
        _convert(src, dst, True)
    assert TMP in str(e.value) and "kept at" in str(e.value), str(e.value)
    assert _digest(dst) == old and (run / (TMP + "abcd")).read_text() == "the user's file"
    assert not os.path.lexists(run / OLD) and not os.path.lexists(run / REC), _left(run)


# (Was a bug, fixed (_temporary skips a name where anything is, before its open): an interrupt as the
# open was called (before it returned a file it made) removed the user's empty file at that name.)
def test_an_interrupt_at_the_temporarys_open_never_removes_a_users_empty_file(base, tmp_path, monkeypatch):
    run, src, dst, old, new = _copy(base, tmp_path)
    mine = run / (TMP + "abcd")
    mine.touch()
    ino = os.lstat(mine).st_ino
    real = os.open

    def hook(path, *a, **k):
        if str(path).endswith(TMP + "abcd"):
            raise KeyboardInterrupt  # (as the open is called: it made nothing)
        return real(path, *a, **k)

    _names(monkeypatch, "abcd", "abce")
    monkeypatch.setattr(os, "open", hook)
    try:
        _convert(src, dst, True)
    except KeyboardInterrupt:
        pass
    finally:
        monkeypatch.setattr(os, "open", real)
    assert os.path.lexists(mine) and os.lstat(mine).st_ino == ino, _left(run)


# -- kill -9 and Ctrl-C at every new step, then a convert without and with overwrite -------------------------

STEPS = [
    ("open", TMP), ("open", "+" + TMP),                      # the temporary record made
    ("link", TMP), ("link", "+" + TMP),                      # linked at the record's name
    ("unlink", TMP), ("unlink", "+" + TMP),                  # the temporary's name goes
    ("mkdir", "$" + GONE), ("mkdir", "+$" + GONE),           # the folder the older file goes into
    ("rename", OLD + ">"), ("rename", "+" + OLD + ">"),      # the older file moved into it
    ("unlink", "$" + OLD), ("unlink", "+$" + OLD),           # unlinked there
    ("rmdir", "$" + GONE), ("rmdir", "+$" + GONE),           # the folder goes
    ("unlink", "$" + REC), ("unlink", "+$" + REC),           # the record goes
]
DEFAULT = {("link", "+" + TMP), ("rename", "+" + OLD + ">")}


def _then(run, dst, old, new, orphans_ok):
    """After an interrupted overwrite of z.h5 (old.h5's) by new.h5's: dst is one of the two
    files, whole; a convert without overwrite completes or is refused with every file as it
    was; then one with overwrite completes and leaves nothing of convert's (but, after a kill
    before the record's link, the temporary it was writing: nothing proves it convert's)."""
    if os.path.lexists(dst):
        assert _digest(dst) in (old, new), _left(run)
    before = _state(run)
    try:
        _convert(run / "src" / "new.h5", dst, False)
    except BigperError:
        assert _state(run) == before, ("a refusal changed files", _left(run))
    else:
        assert _digest(dst) == new
    _convert(run / "src" / "old.h5", dst, True)
    assert _digest(dst) == old
    left = [n for n in _left(run) if not (orphans_ok and n.startswith(TMP))]
    assert left == ["src", "z.h5"], _left(run)
    assert len(_left(run)) - len(left) <= 1, _left(run)


def _steps(default):
    return [pytest.param(op, m, marks=[] if (op, m) in default else [pytest.mark.slow]) for op, m in STEPS]


@pytest.mark.parametrize("op,match", _steps(DEFAULT))
def test_a_kill_at_each_new_step_then_converts(server, base, tmp_path, op, match):
    run, src, dst, old, new = _copy(base, tmp_path)
    assert _kill_at(server, src, dst, op, match, 1, True), (op, match, server.last)
    orphans = (op, match) in {("open", "+" + TMP), ("link", TMP)}
    if not orphans:
        assert not any(n.startswith(TMP) for n in _left(run)) or os.path.lexists(run / REC), _left(run)
    _then(run, dst, old, new, orphans)


@pytest.mark.parametrize("op,match", _steps({("unlink", "+" + TMP)}))
def test_ctrl_c_at_each_new_step_then_converts(server, base, tmp_path, op, match):
    run, src, dst, old, new = _copy(base, tmp_path)
    said = _kill_at(server, src, dst, op, match, 1, True, during=_interrupt(dst), resume=True)
    assert isinstance(said, str) and said.startswith("ended KeyboardInterrupt"), (op, match, said)
    assert not any(n.startswith(TMP) for n in _left(run)), ("an interrupt left a temporary record", _left(run))
    _then(run, dst, old, new, False)


# -- two processes over a removal killed in .partial.gone; a long dst name -------------------------------------

@pytest.mark.slow  # (CI time: run with -m slow)
@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_over_a_removal_killed_in_partial_gone(server, killed_in_gone, tmp_path, overwrite):
    run, src, dst = _copy_killed(killed_in_gone, tmp_path)
    plain = run / "src" / "old.h5"
    server.send("\t".join(["race", str(plain), str(dst), "1" if overwrite else "0"]))
    said = sorted(s[len("ended "):] for s in (server.line(), server.line()))
    assert server.line() == "raced"
    if overwrite:
        said = sorted(said, key=lambda s: s != "done")
        assert said[0] == "done" and said[1].startswith(("StorageLockedError", "PathExistsError", "done")), said
        assert _left(run) == ["src", "z.h5"], _left(run)
    else:
        assert all(s.startswith("PathExistsError") for s in said), said
        assert os.path.isfile(run / GONE / OLD) and os.path.isfile(run / REC), _left(run)


@pytest.mark.slow  # (CI time: run with -m slow)
def test_a_240_character_dst_killed_in_the_removal_then_an_overwrite(server, base, tmp_path):
    """(240: the longest name whose record, <dst>.partial.old.id, fits NAME_MAX; its temporary and
    <dst>.partial.gone fit too.)"""
    run, src, dst, old, new = _copy(base, tmp_path)
    long = run / ("a" * 237 + ".h5")
    _convert(run / "src" / "old.h5", long, False)
    assert _kill_at(server, src, long, "unlink", "$" + long.name + ".partial.old", 1, True), server.last
    assert os.path.isdir(run / (long.name + ".partial.gone"))
    _convert(run / "src" / "old.h5", long, True)
    assert _digest(long) == old
    assert sorted(n for n in os.listdir(run) if n.startswith("aaa")) in ([long.name], [long.name, long.name + ".lock"])


def test_the_kill_points_are_reached(server, base, tmp_path):
    """(The control: a stop before the record's link finds the temporary complete, the record not
    yet there; a stop before the unlink in .partial.gone finds the older file there.)"""
    run, src, dst, old, new = _copy(base, tmp_path)
    seen = {}

    def during():
        seen["tmp"] = [n for n in os.listdir(run) if n.startswith(TMP)]
        seen["rec"] = os.path.lexists(run / REC)

    said = _kill_at(server, src, dst, "link", TMP, 1, True, during=during, resume=True)
    assert said == "ended done", said
    assert len(seen["tmp"]) == 1 and not seen["rec"], seen
    assert stat.S_ISREG(os.lstat(dst).st_mode) and _digest(dst) == new and _left(run) == ["src", "z.h5"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_older_file_in_partial_gone_as_the_source_is_refused_and_left(killed_in_gone, tmp_path, overwrite):
    """(The older file a killed removal left in .partial.gone, given as the source: never removed
    while it is read, every file as it was.)"""
    run, src, dst = _copy_killed(killed_in_gone, tmp_path)
    before = _state(run)
    with pytest.raises(BigperError) as e:
        _convert(run / GONE / OLD, dst, overwrite)
    assert _state(run) == before, _left(run)
    assert ("already exists" if not overwrite else "open in a buffer") in str(e.value), str(e.value)
