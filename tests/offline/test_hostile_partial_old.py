"""Attack on commit 661ea36 ("convert: an overwrite moves the older file aside
first"): ``_publish`` with ``overwrite=True`` and an existing dst renames dst
to ``<dst>.partial.old`` (``_replaced``), the new sidecar into place, links
the partial at dst, unlinks the partial, syncs the folder and unlinks the
older file; every publish first unlinks a regular file at ``.partial.old``
(``_clear_leftovers``), after ``_check_leftovers`` refused anything else
there under dst's lock; ``_check_not_source`` refuses ``.partial.old`` as a
source.

Attacked here, with real files, real kill -9 and real signals (the fork
server of test_hostile_killed_publish3): a hard link at ``.partial.old`` to
another dataset, a file outside, the source; a file, folder or symlink put
at ``.partial.old`` while the convert writes; a folder or symlink put at dst
between the publish's check and its rename; a file put at dst before the
link; a reader opening dst during the publish; a live buffer on the older
file at ``.partial.old``; a kill -9 after each step, then a convert without
overwrite; Ctrl-C (SIGINT) at each step; a real ENOSPC at the link (a
tmpfs out of inodes: a hard link takes one there); two converts racing
(threads, processes) over a killed overwrite; relative paths and a chdir; a
dst reached through a symlinked parent; dst a hard link of the source; an
overwrite of a dst open in a live buffer; a parent symlink re-pointed
before the publish; a folder put at ``<dst>.priorities`` before the
sidecar's rename (a real ENOTEMPTY).

Held: a hard link at ``.partial.old`` loses only that name; the source there
(or at dst) is refused, every byte left; a folder or symlink put at
``.partial.old`` mid-run is refused and left; a reader during the publish is
refused or finds no dst, never a mix; a kill before the link is finished by
a convert without overwrite; Ctrl-C before the link or after the unlink of
the partial leaves the older file or the complete new one; a real ENOSPC at
the link puts the older file back; two threads or processes over the
leftover: one completes; relative paths, a chdir, a symlinked parent.

Findings (strict xfails, each with its cause, file:line): a user's file put
at ``.partial.old`` mid-run is unlinked unproven; a refusal at the publish
says "nothing was read or written" and leaves the converted file unnamed; a
folder or symlink put at dst before the move aside is moved to
``.partial.old``; a file put at dst before the link leaves the older file at
``.partial.old``, unnamed; a live buffer on the older file aside has it
unlinked under it; after a kill past the link the older file stays at
``.partial.old`` for good, every convert refused; Ctrl-C between the link and
the partial's unlink leaves dst with default keys; a live reader of dst
(which holds no lock) has dst overwritten under it; a re-pointed parent
symlink publishes another folder's leftover and says done.

After this attack (commits f5a32d7 and after): the move aside is recorded first
(``<dst>.partial.old.id``, the identities of the older and the new file), is a
link that never replaces anything, and only the recorded file is ever removed
from ``.partial.old``, never while a buffer (or any HDF5 reader: its flock) has
it open; refusals name what they leave; dst's folder is resolved once. Three
tests here held what that stops and were changed (each says so): a hard link at
``.partial.old`` (and a copy, with relative paths) is refused, no longer
unlinked; a live reader of dst makes an overwrite ``StorageLockedError``; a
re-pointed parent leaves the other folder untouched (the convert goes on in the
folder it resolved). The record itself is attacked in test_hostile_partial_old2.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

import bigper
from bigper.convert import convert
from bigper.errors import BigperError, InvalidArgumentError, PathExistsError, StorageLockedError

from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.conftest import mounted_tmpfs
from tests.offline.test_convert import everything, write_d4rl
from tests.offline.test_hostile_convert_killed_publish import _files, _source
from tests.offline.test_hostile_killed_publish2 import _refused_and_unchanged, two_threads
from tests.offline.test_hostile_killed_publish3 import (  # noqa: F401  (fixtures)
    _completes, _copy_ow, _kill_at, _left, copy_killed, killed_overwrite, killed_overwrite_now, server)

OLD = "z.h5.partial.old"


@pytest.fixture(autouse=True)
def _no_hang():
    """A test stuck for 150 s dumps every thread's stack and ends its worker (xdist starts another)."""
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- a folder with a source and an older dst (a convert of another file), copied for each test --------

@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``src/d1.h5`` (keys not 1.0), ``src/old.h5`` and ``z.h5``, a convert of old.h5 (keys 1.0)."""
    root = tmp_path_factory.mktemp("fresh")
    src, want = _source(root)
    write_d4rl(root / "src" / "old.h5", n=90)
    convert(root / "src" / "old.h5", root / "z.h5", progress=False)
    return root, want, everything(root / "z.h5")[1]


def _copy_fresh(fresh, tmp_path):
    root, want, old = fresh
    run = tmp_path / "t"
    copy_killed(root, run)
    return run, run / "src" / "d1.h5", run / "z.h5", want, old


def _keys(path):
    with deadline(60):
        return everything(path)[1].tobytes()


# -- hard links at .partial.old (a regular file, but not the one convert moved there) ----------------

@pytest.mark.parametrize("to", ["another-dataset", "a-file-outside"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_hard_link_at_partial_old_is_refused_and_left(killed_overwrite_now, tmp_path, to, overwrite):
    """What sits at .partial.old is a hard link to a file with another name (another dataset in
    the folder, a file outside it), in place of the older file the killed overwrite moved there
    and recorded: not the recorded file, so the next convert is refused naming it, and every
    name and byte stays. (Until the record, this test held that only the name .partial.old went:
    a name bigper did not make, removed unproven.)"""
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    os.unlink(run / OLD)
    if to == "another-dataset":
        theirs = run / "o.h5"
        write_d4rl(theirs, n=40)
    else:
        (tmp_path / "outside").mkdir()
        theirs = tmp_path / "outside" / "keep.bin"
        theirs.write_bytes(os.urandom(4096))
    os.link(theirs, run / OLD)
    before = fingerprint(theirs)
    e = _refused_and_unchanged(run, src, dst, overwrite=overwrite)
    assert OLD in str(e), str(e)
    assert fingerprint(theirs) == before and os.stat(theirs).st_nlink == 2 and os.path.samefile(theirs, run / OLD)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_hard_link_of_the_source_at_partial_old_is_refused_and_left(killed_overwrite_now, tmp_path, overwrite):
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    os.unlink(run / OLD)
    os.link(src, run / OLD)
    _refused_and_unchanged(run, src, dst, err=InvalidArgumentError, overwrite=overwrite)
    assert os.path.samefile(src, run / OLD)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_dst_that_is_a_hard_link_of_the_source_is_refused_and_left(fresh, tmp_path, overwrite):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    os.unlink(dst)
    os.link(src, dst)
    _refused_and_unchanged(run, src, dst, err=(InvalidArgumentError, PathExistsError), overwrite=overwrite)


def test_an_overwrite_of_a_dst_hard_linked_elsewhere_keeps_the_other_name(fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    os.link(dst, tmp_path / "keep.h5")
    before = fingerprint(tmp_path / "keep.h5")
    _completes(run, src, dst, want, True)
    assert fingerprint(tmp_path / "keep.h5") == before and os.stat(tmp_path / "keep.h5").st_nlink == 1
    assert _keys(tmp_path / "keep.h5") == old.tobytes()


# -- something put at .partial.old while the convert writes (after _check_leftovers found nothing) ----

WRITING = ("mkdir", "$z.h5.partial.priorities")  # (the convert is past its checks, writing its priorities)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_users_file_put_at_partial_old_during_the_convert_is_never_deleted(server, fresh, tmp_path, overwrite):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    if not overwrite:
        os.unlink(dst)

    def during():
        (run / OLD).write_text("the user's only copy")

    said = _kill_at(server, src, dst, *WRITING, 1, overwrite, during=during, resume=True)
    assert said.startswith("ended"), said
    assert os.path.lexists(run / OLD) and (run / OLD).read_text() == "the user's only copy", said


@pytest.mark.parametrize("what", ["dir", "symlink"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_or_symlink_put_at_partial_old_during_the_convert_is_refused_and_left(server, fresh, tmp_path,
                                                                                      what, overwrite):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    if not overwrite:
        os.unlink(dst)
    (tmp_path / "mine.txt").write_text("mine")

    def during():
        if what == "dir":
            (run / OLD).mkdir()
            (run / OLD / "mine.txt").write_text("mine")
        else:
            os.symlink(tmp_path / "mine.txt", run / OLD)

    said = _kill_at(server, src, dst, *WRITING, 1, overwrite, during=during, resume=True)
    assert said.startswith("ended PathExistsError"), said
    assert (run / OLD / "mine.txt" if what == "dir" else tmp_path / "mine.txt").read_text() == "mine"
    if what == "symlink":
        assert os.readlink(run / OLD) == str(tmp_path / "mine.txt")
    if overwrite:
        assert _keys(dst) == old.tobytes()
    else:
        assert not os.path.lexists(dst)
    assert not os.path.lexists(run / "z.h5.priorities")


@pytest.mark.parametrize("where", ["partial-old", "dst"])
def test_a_refusal_at_the_publish_leaves_the_folder_as_it_was_or_says_what_it_wrote(server, fresh, tmp_path, where):
    """A folder put at .partial.old (or at dst, an overwrite) while the convert writes: refused at
    the publish. The folder is then as it was (but for that folder), or the error says where the
    converted file was left."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    before = _files(run)

    def during():
        if where == "dst":
            os.rename(dst, tmp_path / "older.h5")
        (run / (OLD if where == "partial-old" else "z.h5")).mkdir()

    said = _kill_at(server, src, dst, *WRITING, 1, True, during=during, resume=True)
    assert said.startswith("ended PathExistsError"), said
    os.rmdir(run / (OLD if where == "partial-old" else "z.h5"))
    if where == "dst":
        os.rename(tmp_path / "older.h5", dst)
    assert _files(run) == before or ("nothing was" not in said and "z.h5.partial" in said), (said, _left(run))


# -- a folder or symlink put at dst between the publish's check and its rename ------------------------

@pytest.mark.parametrize("what", ["dir", "symlink"])
def test_a_non_file_put_at_dst_just_before_the_move_aside_is_never_moved(server, fresh, tmp_path, what):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    (tmp_path / "mine.txt").write_text("mine")

    def during():
        os.rename(dst, tmp_path / "older.h5")
        if what == "dir":
            dst.mkdir()
            (dst / "mine.txt").write_text("mine")
        else:
            os.symlink(tmp_path / "mine.txt", dst)

    said = _kill_at(server, src, dst, "link", "z.h5>" + OLD, 1, True, during=during, resume=True)
    assert said.startswith("ended"), said
    if what == "dir":
        assert dst.is_dir() and (dst / "mine.txt").read_text() == "mine", (said, _left(run))
    else:
        assert os.path.islink(dst) and os.readlink(dst) == str(tmp_path / "mine.txt"), (said, _left(run))


# -- a file put at dst after the older one went aside, before the link --------------------------------

def test_a_file_put_at_dst_before_the_link_leaves_the_older_file_where_it_was_or_named(server, fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)

    def during():
        (run / "z.h5").write_text("appeared")

    said = _kill_at(server, src, dst, "link", "z.h5.partial>z.h5", 1, True, during=during, resume=True)
    assert said.startswith("ended PathExistsError"), said
    assert (run / "z.h5").read_text() == "appeared"
    assert OLD in said, (said, _left(run))


def test_a_file_put_at_dst_before_the_link_never_opens_with_the_new_sidecar(server, fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)

    def during():
        write_d4rl(run / "z.h5", n=120)  # (the new file's structure)

    said = _kill_at(server, src, dst, "link", "z.h5.partial>z.h5", 1, True, during=during, resume=True)
    assert said.startswith("ended PathExistsError"), said
    assert not os.path.lexists(run / "z.h5.priorities")
    assert _keys(run / OLD) == old.tobytes()  # (the older file whole, aside)


# -- a reader of dst during the publish ------------------------------------------------------------

@pytest.mark.parametrize("op,match", [("link", "z.h5>" + OLD), ("unlink", "$z.h5"), ("rename", "$z.h5.partial.priorities"),
                                      ("link", "z.h5.partial>z.h5"), ("unlink", "$z.h5.partial"),
                                      ("unlink", "$" + OLD)])
def test_a_reader_during_the_publish_is_refused_never_sees_a_mix(server, fresh, tmp_path, op, match):
    """Another process (this one) opens dst while the convert is stopped at each step: refused
    (dst's lock is held), or no dst; after the kill it opens with the older keys or the new."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    seen = []

    def during():
        try:
            with deadline(60):
                seen.append(everything(dst)[1].tobytes())
        except (StorageLockedError, BigperError) as e:
            seen.append(type(e).__name__)

    assert _kill_at(server, src, dst, op, match, 1, True, during=during), server.last
    assert seen and seen[0] in ("StorageLockedError", "PathNotFoundError"), seen
    if os.path.lexists(dst):
        assert _keys(dst) in (old.tobytes(), want.tobytes())


# -- a live buffer on the older file at .partial.old ----------------------------------------------

@pytest.mark.parametrize("overwrite", [False, True])
def test_a_live_buffer_on_the_older_file_aside_keeps_it(killed_overwrite_now, tmp_path, overwrite):
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(run / OLD)
    try:
        try:
            with deadline(60):
                convert(src, dst, progress=False, overwrite=overwrite)
        except StorageLockedError:
            pass
        assert os.path.lexists(run / OLD), _left(run)
    finally:
        ds.close()


@pytest.mark.parametrize("leftover", [False, True])
def test_an_overwrite_of_a_dst_open_in_a_live_buffer_is_refused_and_left(fresh, tmp_path, leftover):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    if leftover:
        shutil.copy(dst, run / OLD)
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(dst)
    try:
        _refused_and_unchanged(run, src, dst, err=StorageLockedError, overwrite=True)
    finally:
        ds.close()
    assert _keys(dst) == old.tobytes()


# -- a kill -9 after each step, then a convert without overwrite ---------------------------------------

BEFORE_LINK = [("unlink", "+$z.h5"), ("rename", "+z.h5.partial.priorities>z.h5.priorities"),
               ("link", "z.h5.partial>z.h5")]
AFTER_LINK = [("link", "+z.h5.partial>z.h5"), ("unlink", "+$z.h5.partial"), ("rename", OLD + ">")]
# (the last: before the removal of the older file moves it into <dst>.partial.gone to unlink it there)


@pytest.mark.parametrize("op,match", BEFORE_LINK)
def test_a_kill_before_the_link_then_a_plain_convert_finishes(server, fresh, tmp_path, op, match):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    assert _kill_at(server, src, dst, op, match, 1, True), server.last
    assert not os.path.lexists(dst) and _keys(run / OLD) == old.tobytes()
    _completes(run, src, dst, want, False)


@pytest.mark.parametrize("point", [("unlink", "$" + OLD), ("unlink", "+$" + OLD)])
def test_a_kill_at_the_clearing_of_a_leftover_then_a_plain_convert_finishes(server, killed_overwrite_now, tmp_path,
                                                                            point):
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    assert _kill_at(server, src, dst, *point, 1, False), server.last
    assert not os.path.lexists(dst)
    _completes(run, src, dst, want, False)


@pytest.mark.parametrize("op,match", AFTER_LINK + [("ln", "partial-at-dst")])
def test_a_kill_after_the_link_then_the_next_convert_removes_the_older_file(server, fresh, killed_overwrite_now,
                                                                            tmp_path, op, match):
    """(ln: a kill before the link, then the user links the complete partial at dst by hand.)"""
    if op == "ln":
        run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
        os.link(run / "z.h5.partial", dst)
    else:
        run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
        assert _kill_at(server, src, dst, op, match, 1, True), server.last
    assert _keys(dst) == want.tobytes() and _keys(run / OLD) == old.tobytes()
    said = []
    for overwrite in (False, True):
        try:
            with deadline(60):
                convert(src, dst, progress=False, overwrite=overwrite)
        except BigperError as e:
            said.append(str(e))
    assert _keys(dst) == want.tobytes()
    assert not os.path.lexists(run / OLD) or any(OLD in s for s in said), (said, _left(run))


# -- Ctrl-C (SIGINT) at each step of the publish ----------------------------------------------------

def _interrupt(dst):
    """``during``: SIGINT to the convert (its pid is in dst's lock file), then wait for it to end."""
    def during():
        pid = int((dst.with_name(dst.name + ".lock")).read_text().split()[0])
        os.kill(pid, signal.SIGINT)
        _wait_exit(pid)  # (the SIGUSR1 that follows finds a zombie)
    return during


def _wait_exit(pid):
    """Until process ``pid`` has ended (a zombie, or gone); ``AssertionError`` after two
    minutes (a loaded machine's slowest convert ends in seconds: past that it hangs)."""
    for _ in range(12000):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not end")


# (INTERRUPTED_AFTER_LINK was a strict xfail: a KeyboardInterrupt after os.link(partial, dst) and
# before os.unlink(partial) moved the new sidecar back, so dst opened with the default keys 1.0.
# Once linked, the publish is done: nothing is put back.)


STEPS = [("rename", "$z.h5.partial.priorities"), ("link", "z.h5.partial>z.h5"), ("unlink", "$z.h5.partial")]


def _each(points, overwrite):
    return [pytest.param(op, match, overwrite) for op, match in points]


@pytest.mark.parametrize("op,match,overwrite", _each([("link", "z.h5>" + OLD), ("unlink", "$z.h5")] + STEPS + [("unlink", "$" + OLD)], True)
                         + _each(STEPS, False))
def test_ctrl_c_at_each_step_of_the_publish(server, fresh, tmp_path, op, match, overwrite):
    """Interrupted, dst opens with the older file's keys (or is absent), or with the new file's:
    never the new file with other keys; the next convert with the same overwrite completes."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    if not overwrite:
        os.unlink(dst)
    said = _kill_at(server, src, dst, op, match, 1, overwrite, during=_interrupt(dst), resume=True)
    assert isinstance(said, str) and said.startswith("ended KeyboardInterrupt"), said
    if os.path.lexists(dst):
        assert _keys(dst) in ((old.tobytes(), want.tobytes()) if overwrite else (want.tobytes(),)), _left(run)
        if _keys(dst) == want.tobytes():
            return
    _completes(run, src, dst, want, overwrite)


# -- a real ENOSPC at the link (tmpfs: a hard link takes an inode) -------------------------------------

def test_enospc_at_the_link_puts_the_older_file_back(fresh, tmp_path):
    """(A fork server of its own, and a deadline: a convert stopped on a full tmpfs never holds
    up the module's server.)"""
    from tests._child import Child
    from tests.offline.test_hostile_killed_publish3 import SERVER

    gen = mounted_tmpfs(tmp_path, "64m,nr_inodes=400")
    fs = next(gen)
    run = fs / "t"
    try:
        root, want, old = fresh
        shutil.copytree(root, run, symlinks=True)
        src, dst = run / "src" / "d1.h5", run / "z.h5"
        (fs / "fill").mkdir()

        def during():  # every free inode taken: the link cannot get one
            for i in range(10000):
                try:
                    os.close(os.open(fs / "fill" / str(i), os.O_CREAT | os.O_WRONLY, 0o644))
                except OSError:
                    return

        with Child(SERVER, stdin=True) as own:
            own.said("ready")
            try:
                with deadline(120):
                    said = _kill_at(own, src, dst, "link", "z.h5.partial>z.h5", 1, True, during=during, resume=True)
            finally:
                _kill_children_of(own.pid)
        shutil.rmtree(fs / "fill")
        assert said.startswith("ended OSError") and "No space left" in said, said
        assert _keys(dst) == old.tobytes()
        assert not os.path.lexists(run / OLD) and not os.path.lexists(run / "z.h5.priorities"), _left(run)
        _completes(run, src, dst, want, True)
    finally:
        next(gen, None)


def _kill_children_of(ppid: int) -> None:
    """SIGKILL what the fork server ``ppid`` (started by this test) forked and has not reaped."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                        os.kill(int(d), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass


# -- two converts over a killed overwrite (the older file aside) -------------------------------------

def _raced(said, run, dst, want):
    said = sorted(said, key=lambda s: s != "done")
    assert said[0] == "done" and said[1].startswith(("StorageLockedError", "PathExistsError")), said
    assert everything(dst)[1].tobytes() == want.tobytes()
    assert _left(run) == ["src", "z.h5", "z.h5.priorities"], _left(run)


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_over_the_older_file_aside(server, killed_overwrite_now, tmp_path, overwrite):
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    server.send("\t".join(["race", str(src), str(dst), "1" if overwrite else "0"]))
    said = [server.line(), server.line()]
    assert server.line() == "raced"
    _raced([s[len("ended "):] for s in said], run, dst, want)


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_threads_over_the_older_file_aside(killed_overwrite_now, tmp_path, overwrite):
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    _raced(two_threads(src, dst, overwrite=overwrite), run, dst, want)


# -- relative paths, a chdir; a dst through a symlinked parent ----------------------------------------

def test_relative_paths_and_a_chdir(server, fresh, tmp_path, monkeypatch):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    rel = os.path.join("src", "d1.h5")
    assert _kill_at(server, rel, "z.h5", "unlink", "+$z.h5", 1, True, cwd=run), server.last
    before = _files(run)
    other = tmp_path / "other"
    shutil.copytree(run / "src", other / "src")
    shutil.copy(run / OLD, other / OLD)  # (a copy of another folder's leftover: no record of its own there)
    monkeypatch.chdir(other)
    theirs = _files(other)
    with deadline(60), pytest.raises(PathExistsError, match=str(other / OLD)):
        convert(rel, "z.h5", progress=False)  # (a file convert did not move there is never removed)
    assert _files(other) == theirs and _files(run) == before
    os.unlink(other / OLD)
    with deadline(60):
        convert(rel, "z.h5", progress=False)
    assert sorted(os.listdir(other)) == ["src", "z.h5", "z.h5.priorities"]
    assert _files(run) == before
    monkeypatch.chdir(run)
    with deadline(60):
        convert(rel, "z.h5", progress=False)
    assert everything(dst)[1].tobytes() == want.tobytes()
    assert _left(run) == ["src", "z.h5", "z.h5.priorities"], _left(run)


def test_a_dst_through_a_symlinked_parent(server, fresh, tmp_path):
    """Killed after the move aside through ``via/`` (a symlink to ``t/``), a live convert through
    ``via/`` holds the lock a convert through ``t/`` takes; the next convert through ``t/`` finishes."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    via = tmp_path / "via"
    os.symlink(run, via)
    seen = []

    def during():
        try:
            convert(src, dst, progress=False, overwrite=True)
            seen.append("done")
        except BigperError as e:
            seen.append(type(e).__name__)

    assert _kill_at(server, src, via / "z.h5", "unlink", "+$z.h5", 1, True, during=during), server.last
    assert seen == ["StorageLockedError"], seen
    assert not os.path.lexists(dst) and _keys(run / OLD) == old.tobytes()
    _completes(run, src, dst, want, False)
    assert os.path.islink(via)


def test_a_live_reader_of_the_older_dst_keeps_it_and_its_keys(fresh, tmp_path):
    """A buffer reading the older dst (no lock file is there for it to hold; HDF5's flock on the
    file is what convert probes) changes its keys; an overwrite is refused with
    StorageLockedError, nothing changed; the reader still reads the older file, and its close
    keeps its keys with it. (Until that probe, the overwrite replaced dst under the reader, and
    this test held only that the reader's keys never went beside the new file.)"""
    import warnings

    import numpy as np

    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    older = everything(dst)[0]
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(dst)
    try:
        ids = np.flatnonzero(ds.status == 1)
        ds.update_priorities(ids, np.full(ids.shape[0], 7.0))
        before = _files(run)
        with deadline(60), pytest.raises(StorageLockedError, match="z.h5"):
            convert(src, dst, progress=False, overwrite=True)
        assert _files(run) == before
        live = ids[np.argsort(ds.generations[ids], kind="stable")]
        got = ds.gather(live)
        assert all(got[k].tobytes() == older[k].tobytes() for k in older)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.close()
    assert all(everything(dst)[0][k].tobytes() == older[k].tobytes() for k in older)
    assert _keys(dst) not in (old.tobytes(), want.tobytes())  # (the reader's, saved at its close)
    assert _left(run) == ["src", "z.h5", "z.h5.priorities"], _left(run)


def test_two_processes_overwriting_an_older_dst(server, fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    server.send("\t".join(["race", str(src), str(dst), "1"]))
    said = [server.line(), server.line()]
    assert server.line() == "raced"
    _raced([s[len("ended "):] for s in said], run, dst, want)


def test_two_threads_overwriting_an_older_dst(fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    _raced(two_threads(src, dst, overwrite=True), run, dst, want)


def test_a_symlinked_parent_re_pointed_before_the_publish_never_publishes_anothers_file(fresh, tmp_path):
    """The parent symlink re-pointed at the publish: the other folder is never touched, and a
    convert that says done wrote the folder it resolved when it began (promise 11). (Was a
    strict xfail: the publish went by path into the other folder and said done; this test then
    asked dst through the re-pointed symlink for the new keys, which a convert that resolves
    its folder once never gives.) (A fork server of its own, under a deadline: on the module's
    server, after the other tests, this stop at os.lstat has hung a full run; alone it never did.)"""
    from tests._child import Child
    from tests.offline.test_hostile_killed_publish3 import SERVER

    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(run, other, symlinks=True)
    shutil.copy(other / "z.h5", other / "z.h5.partial")  # (a leftover of a convert of its own)
    via = tmp_path / "via"
    os.symlink(run, via)
    theirs = fingerprint(other)

    def during():  # (at the publish: its second look at .partial.old, _clear_leftovers)
        os.unlink(via)
        os.symlink(other, via)

    with Child(SERVER, stdin=True) as own:
        own.said("ready")
        try:
            with deadline(120):
                said = _kill_at(own, src, via / "z.h5", "lstat", "$" + OLD, 2, True, during=during, resume=True)
        finally:
            _kill_children_of(own.pid)
    assert isinstance(said, str) and said.startswith("ended"), said
    assert fingerprint(other) == theirs, said
    if said == "ended done":  # (in the folder via named when convert began: its folder, resolved once)
        assert _keys(run / "z.h5") == want.tobytes(), ("convert said done; dst holds another source's file",
                                                      _left(run))


# -- a real failure at the sidecar's rename; a source without keys (no sidecar to move) ----------------

def test_a_folder_put_at_the_sidecar_path_before_its_rename_puts_the_older_file_back(server, fresh, tmp_path):
    """A folder of the user's appears at <dst>.priorities just before the new sidecar's rename (a real
    ENOTEMPTY): the older file is put back at dst, the user's folder is left, and the new sidecar
    stays the partial's."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)

    def during():
        (run / "z.h5.priorities").mkdir()
        (run / "z.h5.priorities" / "notes.txt").write_text("mine")

    said = _kill_at(server, src, dst, "rename", "z.h5.partial.priorities>z.h5.priorities", 1, True, during=during,
                    resume=True)
    assert isinstance(said, str) and said.startswith("ended") and said != "ended done", said
    assert os.listdir(run / "z.h5.priorities") == ["notes.txt"]
    assert not os.path.lexists(run / OLD) and (run / "z.h5.partial.priorities").is_dir(), _left(run)
    shutil.rmtree(run / "z.h5.priorities")
    assert _keys(dst) == old.tobytes()
    _completes(run, src, dst, want, True)


@pytest.mark.parametrize("op,match", BEFORE_LINK[:1] + BEFORE_LINK[2:] + AFTER_LINK[:1])
def test_a_killed_overwrite_from_a_source_without_keys(server, fresh, tmp_path, op, match):
    """(No sidecar to move: the older file aside, the new one linked.) The next convert without
    overwrite finishes a kill before the link; after it, dst is the new file."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    plain = run / "src" / "plain.h5"
    write_d4rl(plain, n=120)
    keys = everything(plain)[1]
    assert _kill_at(server, plain, dst, op, match, 1, True), server.last
    assert not os.path.lexists(run / "z.h5.priorities")
    if os.path.lexists(dst):
        assert _keys(dst) == keys.tobytes() and _keys(run / OLD) == old.tobytes()
        return
    assert _keys(run / OLD) == old.tobytes()
    with deadline(60):
        convert(plain, dst, progress=False)
    assert _keys(dst) == keys.tobytes()
    assert _left(run) == ["src", "z.h5"], _left(run)


# CI time: the attack's cases run under -m slow, but for the Ctrl-C steps (the cause this stop fixed)
for _name, _test in list(globals().items()):
    if _name.startswith("test_") and _name != "test_ctrl_c_at_each_step_of_the_publish":
        pytest.mark.slow(_test)
