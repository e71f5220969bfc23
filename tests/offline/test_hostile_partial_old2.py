"""Attack on the record of the older file an overwrite moves aside (commit f5a32d7:
``<dst>.partial.old.id``, written and fsynced before ``os.link(dst, <dst>.partial.old)``
and ``unlink(dst)``; ``.partial.old`` is removed only when it is the file the record
names and dst is the new file it names, or the older one still, or absent).

The record is read from disk, so it is hostile input (DESIGN.md promises 7, 8, 14):
here it is damaged, truncated, empty, huge (dense and sparse), a FIFO, a symlink to a
valid record, a folder, not UTF-8, a 100,000-deep list, a record for another dst, one
with a key more, a bool, a float or a negative where an integer goes, the identity of
another file; a copy of the older file (same bytes, size and mtime, another inode) at
``.partial.old``; no record at all (an older bigper's leftover); the source at the
record's name. Each is refused with ``PathExistsError`` naming it (or, for the source,
``InvalidArgumentError``), and the folder is as it was: every name, byte and inode.

Real kill -9 (the fork server of test_hostile_killed_publish3) at the record's
creation (an empty record: refused, never acted on), between the link and the unlink of
the move aside (two names of the older file), after it; real Ctrl-C right after the
link; a buffer that opens the older file aside while the publish is stopped before its
removal (it stays, recorded, with a warning; the next refusal names it); a stale record
(nothing aside) removed by the next publish.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

import bigper
from bigper.convert import convert
from bigper.errors import InvalidArgumentError, PathExistsError

from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.offline.test_convert import everything, write_d4rl
from tests.offline.test_hostile_killed_publish3 import (  # noqa: F401  (fixtures)
    _completes, _copy_ow, _kill_at, _left, killed_overwrite_now, server)
from tests.offline.test_hostile_partial_old import _copy_fresh, _interrupt, _keys, fresh  # noqa: F401

OLD = "z.h5.partial.old"
REC = "z.h5.partial.old.id"
TMP = "z.h5.partial.id"  # (+ 4 hex digits: the record's file until it is complete, _temporary)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _no_hang():
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _state(run):
    """Every name under ``run`` with its kind and bytes, and every file's inode and link count
    (lock files aside: a refusal under dst's lock writes its pid there)."""
    out = {}
    for k, v in fingerprint(run).items():
        if k.endswith(".lock"):
            continue
        st = os.lstat(k)
        out[k] = (v, st.st_ino, st.st_nlink)
    return out


def _refused(run, src, dst, err=PathExistsError, names=REC):
    """Refused with ``err`` naming ``names``, with and without overwrite; nothing changed."""
    before = _state(run)
    for overwrite in (False, True):
        with deadline(60), pytest.raises(err) as e:
            convert(src, dst, progress=False, overwrite=overwrite)
        assert names in str(e.value), str(e.value)
        assert _state(run) == before
    return e.value


def _valid(run):
    return json.loads((run / REC).read_text())


# -- the record, damaged or crafted (a killed overwrite: the older file aside, no dst) ---------------

def _damage(run, how):
    rec = run / REC
    raw = rec.read_bytes()
    meta = json.loads(raw)
    if how == "truncated":
        rec.write_bytes(raw[:len(raw) // 2])
    elif how == "empty":
        rec.write_bytes(b"")
    elif how == "flipped-bit":
        meta["older"][1] ^= 1
        rec.write_text(json.dumps(meta))
    elif how == "huge":
        rec.write_bytes(raw + b" " * (1 << 20))
    elif how == "huge-sparse":
        with open(rec, "r+b") as f:
            f.truncate(16 << 20)  # (sparse: the test's fingerprint reads it all)
    elif how == "fifo":
        os.unlink(rec)
        os.mkfifo(rec)
    elif how == "symlink":
        shutil.copy(rec, run / "src" / "valid.id")
        os.unlink(rec)
        os.symlink(run / "src" / "valid.id", rec)
    elif how == "directory":
        os.unlink(rec)
        rec.mkdir()
        (rec / "x").write_text("mine")
    elif how == "not-utf8":
        rec.write_bytes(b"\xff\xfe" + raw)
    elif how == "deep":
        rec.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    elif how == "another-dst":
        meta["dst"] = "y.h5"
        rec.write_text(json.dumps(meta))
    elif how == "a-key-more":
        meta["also"] = 1
        rec.write_text(json.dumps(meta))
    elif how in ("bool", "float", "negative", "short"):
        meta["older"][2] = {"bool": True, "float": float(meta["older"][2]), "negative": -1}.get(how) \
            if how != "short" else meta["older"][2]
        if how == "short":
            meta["older"] = meta["older"][:3]
        rec.write_text(json.dumps(meta))
    elif how == "not-an-object":
        rec.write_text(json.dumps([meta]))
    elif how == "another-files-identity":  # (the source's: a record that names a file that is not aside)
        st = os.lstat(run / "src" / "d1.h5")
        meta["older"] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
        rec.write_text(json.dumps(meta))
    else:
        raise AssertionError(how)


DAMAGE = ["truncated", "empty", "flipped-bit", "huge", "huge-sparse", "fifo", "symlink", "directory", "not-utf8",
          "deep", "another-dst", "a-key-more", "bool", "float", "negative", "short", "not-an-object",
          "another-files-identity"]


def test_the_killed_overwrite_has_a_record_that_proves_the_older_file(killed_overwrite_now, tmp_path):
    """(The control: the record names the older file aside and the new file, and the next
    convert without overwrite finishes, leaving neither.)"""
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    meta = _valid(run)
    st = os.lstat(run / OLD)
    assert meta["older"] == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    st = os.lstat(run / "z.h5.partial")
    assert meta["newer"] == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    _completes(run, src, dst, want, False)


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_or_crafted_record_is_refused_and_nothing_removed(killed_overwrite_now, tmp_path, how):
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    _damage(run, how)
    names = OLD if how in ("flipped-bit", "another-files-identity") else REC
    _refused(run, src, dst, names=names)
    assert _keys(run / OLD) == old.tobytes()


def test_a_copy_of_the_older_file_at_partial_old_is_refused_and_left(killed_overwrite_now, tmp_path):
    """Same bytes, size and mtime (cp -p), another inode: not the file the record names."""
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    shutil.copy2(run / OLD, run / "copy.h5")
    os.replace(run / "copy.h5", run / OLD)
    _refused(run, src, dst, names=OLD)


def test_no_record_beside_the_older_file_is_refused_and_left(killed_overwrite_now, tmp_path):
    """What an older bigper (before the record) left, or a user's file at that name."""
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    os.unlink(run / REC)
    _refused(run, src, dst, names=OLD)
    os.unlink(run / OLD)
    _completes(run, src, dst, want, False)


def test_a_stale_record_is_removed_by_the_next_publish(killed_overwrite_now, tmp_path):
    """The older file aside gone (the user moved it away): the record proves nothing is there
    and goes with the next publish; the file moved away is never touched."""
    run, src, dst, side, want, old = _copy_ow(killed_overwrite_now, tmp_path)
    os.rename(run / OLD, tmp_path / "kept.h5")
    before = fingerprint(tmp_path / "kept.h5")
    _completes(run, src, dst, want, False)
    assert fingerprint(tmp_path / "kept.h5") == before


def test_the_source_at_the_records_name_is_refused_and_left(fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    os.link(src, run / REC)
    before = _state(run)
    with deadline(60), pytest.raises((PathExistsError, InvalidArgumentError)) as e:
        convert(run / REC, dst, progress=False, overwrite=True)
    assert REC in str(e.value), str(e.value)
    assert _state(run) == before


def test_a_record_put_there_during_the_convert_is_refused_and_kept(server, fresh, tmp_path):
    """(O_EXCL: a file put at the record's name meanwhile is never written through or replaced.)"""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)

    def during():
        (run / REC).write_text("mine")

    said = _kill_at(server, src, dst, "mkdir", "$z.h5.partial.priorities", 1, True, during=during, resume=True)
    assert said.startswith("ended PathExistsError") and REC in said and "z.h5.partial" in said, said
    assert (run / REC).read_text() == "mine" and _keys(dst) == old.tobytes()
    assert not os.path.lexists(run / OLD)


# -- a real kill -9 at each step of the move aside --------------------------------------------------

# (Was test_a_kill_right_after_the_records_creation_leaves_an_empty_record_that_is_refused: killed
# between the record's O_EXCL open and its write, an empty record at its name refused every later
# convert until the user deleted it. The record is now written whole under a temporary name of its
# own first (_write_record, _temporary), then linked at its name: these say what a kill at each of
# those steps leaves, and that it blocks nothing.)

def test_a_kill_right_after_the_records_creation_leaves_nothing_that_blocks_the_next_convert(server, fresh,
                                                                                          tmp_path):
    """Killed between the O_EXCL open of the record's file (at its temporary name) and its write:
    an empty file there, no record, dst still the older file. Nothing proves that empty file
    convert's once its run is gone, so it is never removed; it is at a name no convert needs, and
    the next overwrite completes around it."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    assert _kill_at(server, src, dst, "open", "+" + TMP, 1, True), server.last
    tmp = [n for n in os.listdir(run) if n.startswith(TMP)]
    assert len(tmp) == 1 and (run / tmp[0]).read_bytes() == b"", _left(run)
    assert not os.path.lexists(run / REC) and not os.path.lexists(run / OLD) and _keys(dst) == old.tobytes()
    with deadline(60):
        convert(src, dst, progress=False, overwrite=True)
    assert everything(dst)[1].tobytes() == want.tobytes()
    assert _left(run) == sorted(["src", "z.h5", "z.h5.priorities", tmp[0]]), _left(run)
    assert (run / tmp[0]).read_bytes() == b""


@pytest.mark.parametrize("op,match", [("link", "+>" + REC), ("unlink", TMP)],
                         ids=["right-after-the-link-at-its-name", "before-its-temporarys-unlink"])
def test_a_kill_after_the_records_link_leaves_a_record_the_next_convert_drops_with_its_second_name(
        server, fresh, tmp_path, op, match):
    """Killed once the complete record has its name, before its temporary name goes: the record
    (nothing aside yet: stale) and a second name of it. The next overwrite drops both, and
    completes; a refusal before it changes nothing."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    assert _kill_at(server, src, dst, op, match, 1, True), server.last
    tmp = [n for n in os.listdir(run) if n.startswith(TMP)]
    assert _valid(run) and len(tmp) == 1 and os.path.samefile(run / tmp[0], run / REC), _left(run)
    assert _keys(dst) == old.tobytes() and not os.path.lexists(run / OLD)
    before = _state(run)
    with deadline(60), pytest.raises(PathExistsError):
        convert(src, dst, progress=False)
    assert _state(run) == before
    _completes(run, src, dst, want, True)


def test_a_kill_before_the_move_aside_leaves_a_record_the_next_convert_drops(server, fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    assert _kill_at(server, src, dst, "link", "z.h5>" + OLD, 1, True), server.last
    assert _valid(run) and _keys(dst) == old.tobytes() and not os.path.lexists(run / OLD)
    _completes(run, src, dst, want, True)


def test_a_kill_between_the_link_and_the_unlink_leaves_two_names_of_the_older_file(server, fresh, tmp_path):
    """dst and .partial.old name one file: a refusal says so and changes nothing; the next
    overwrite removes the second name only, and completes."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    assert _kill_at(server, src, dst, "link", "+z.h5>" + OLD, 1, True), server.last
    assert os.path.samefile(dst, run / OLD) and _keys(dst) == old.tobytes()
    before = _state(run)
    with deadline(60), pytest.raises(PathExistsError) as e:
        convert(src, dst, progress=False)
    assert OLD in str(e.value) and "second name" in str(e.value), str(e.value)
    assert _state(run) == before
    _completes(run, src, dst, want, True)


def test_a_kill_after_the_move_aside_is_finished_by_a_plain_convert(server, fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    assert _kill_at(server, src, dst, "unlink", "+$z.h5", 1, True), server.last
    assert not os.path.lexists(dst) and _keys(run / OLD) == old.tobytes() and _valid(run)
    _completes(run, src, dst, want, False)


def test_ctrl_c_right_after_the_link_puts_everything_back(server, fresh, tmp_path):
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    said = _kill_at(server, src, dst, "link", "+z.h5>" + OLD, 1, True, during=_interrupt(dst), resume=True)
    assert said.startswith("ended KeyboardInterrupt"), said
    assert _keys(dst) == old.tobytes() and os.stat(dst).st_nlink == 1
    assert not os.path.lexists(run / OLD) and not os.path.lexists(run / REC), _left(run)
    _completes(run, src, dst, want, True)


# -- a buffer opens the older file aside while the publish is stopped before its removal -------------

def test_a_buffer_on_the_older_file_aside_at_the_publishs_end_keeps_it(server, fresh, tmp_path):
    """The publish is done (dst the new file) but the older file aside is open in a buffer: it
    stays, recorded (a warning says so); the next convert's refusal names it; once the buffer is
    closed and dst gone, the next convert removes it."""
    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    held = []

    def during():
        held.append(bigper.PrioritizedReplayBuffer.from_hdf5(run / OLD))

    try:
        said = _kill_at(server, src, dst, "unlink", "$z.h5.partial", 1, True, during=during, resume=True)
        assert said == "ended done", said
        assert _keys(dst) == want.tobytes() and _keys(run / OLD) == old.tobytes() and _valid(run)
        before = _state(run)
        with deadline(60), pytest.raises(PathExistsError) as e:
            convert(src, dst, progress=False)
        assert OLD in str(e.value) and "dst is the new file" in str(e.value), str(e.value)
        assert _state(run) == before
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for ds in held:
                ds.close()
    os.unlink(dst)
    shutil.rmtree(run / "z.h5.priorities")
    _completes(run, src, dst, want, False)


def test_the_publish_warns_when_the_older_file_aside_is_open(fresh, tmp_path):
    """(In this process, so the warning is seen: the buffer opens the older file as the publish
    links the new one, by a hook on os.link.)"""
    import bigper.convert as c

    run, src, dst, want, old = _copy_fresh(fresh, tmp_path)
    held = []
    real = os.link

    def link(a, b, *r, **k):
        out = real(a, b, *r, **k)
        if str(b) == str(dst) and str(a).endswith("z.h5.partial"):
            held.append(bigper.PrioritizedReplayBuffer.from_hdf5(run / OLD))
        return out

    c.os.link = link
    try:
        with deadline(60), pytest.warns(UserWarning, match="stays at .*z.h5.partial.old"):
            convert(src, dst, progress=False, overwrite=True)
    finally:
        c.os.link = real
        for ds in held:
            ds.close()
    assert _keys(dst) == want.tobytes() and _keys(run / OLD) == old.tobytes() and _valid(run)

