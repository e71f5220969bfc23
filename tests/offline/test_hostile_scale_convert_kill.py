"""kill -9 and a full disk in ``convert_dqn_replay``'s last step (``_to_hdf5``).

``_to_hdf5`` closes the work buffer first (its state recorded in its
directory), reopens that directory read-only and copies its arrays and the
recorded state into ``DST.partial``, releasing pages as it goes. A convert
killed at each point of it (the buffer closed and not yet reopened, in the
middle of the copy, before the HDF5 file's close, before the publish), then
run again, finishes the file an uninterrupted convert writes: every dataset
and attribute equal (``_bigper``'s meta JSON parsed and compared), not only
the transitions. A full disk at each point is an ``OSError`` naming the
place, with no ``DST``, no partial file, the work directory kept, and an
exact resume once there is room.
"""

from __future__ import annotations

import os

import pytest

import bigper.convert_dqn as c

from tests._child import Child
from tests.conftest import fill_disk, mounted_tmpfs
from tests.offline.test_hostile_scale_convert import content, reference, run  # noqa: F401 (fixtures)


KILLED = """
import sys, time
import bigper.convert_dqn as c
point = sys.argv[3]
def stop(*a, **k):
    print("at", point, flush=True)
    time.sleep(3600)
if point == "closed, not reopened":
    opened = c.MemmapStorage.open
    def open_(self, *a, **k):
        if self.read_only:
            stop()
        return opened(self, *a, **k)
    c.MemmapStorage.open = open_
elif point == "copying":
    write, calls = c.HDF5Storage.write, []
    def write_(self, *a, **k):
        calls.append(1)
        if len(calls) == 4:
            stop()
        return write(self, *a, **k)
    c.HDF5Storage.write = write_
elif point == "before the HDF5 close":
    c.HDF5Storage.close = stop
elif point == "before the publish":
    c.publish = stop
c.convert_dqn_replay(sys.argv[1], sys.argv[2], progress=False, chunk=100, workers=1)
"""


@pytest.mark.parametrize("point", ["closed, not reopened", "copying", "before the HDF5 close", "before the publish"])
def test_kill_9_in_the_hdf5_copy_then_again_gives_the_uninterrupted_file(run, reference, tmp_path, point):
    dst = tmp_path / "d.h5"
    with Child(KILLED, run, dst, point) as child:
        child.said(f"at {point}")
        child.kill()
    assert not os.path.lexists(dst) and os.path.isdir(f"{dst}.partial.d")
    r = c.convert_dqn_replay(run, dst, progress=False, workers=1)
    assert r["resumed_after"] == 2
    got = content(dst)
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert got[k] == reference[k], k
    assert not os.path.lexists(f"{dst}.partial") and not os.path.lexists(f"{dst}.partial.d")


@pytest.fixture
def tmpfs(tmp_path):
    """A 32 MB tmpfs: room for the work, then a full disk on demand."""
    yield from mounted_tmpfs(tmp_path, "32m")


@pytest.mark.parametrize("point", ["before the close", "at the HDF5 file's creation", "in the copy"])
def test_a_full_disk_in_the_hdf5_copy_keeps_the_work_and_leaves_no_dst(run, reference, tmpfs, monkeypatch, point):
    dst = tmpfs / "d.h5"
    filler = tmpfs / "filler"
    if point == "before the close":
        to = c._to_hdf5
        monkeypatch.setattr(c, "_to_hdf5", lambda *a: (fill_disk(filler), to(*a)))
    elif point == "at the HDF5 file's creation":
        opened = c.HDF5Storage.open
        monkeypatch.setattr(c.HDF5Storage, "open", lambda self, *a: (fill_disk(filler), opened(self, *a))[1])
    else:
        write, calls = c.HDF5Storage.write, []

        def write_(self, *a):
            calls.append(1)
            if len(calls) == 2:
                fill_disk(filler)
            return write(self, *a)
        monkeypatch.setattr(c.HDF5Storage, "write", write_)
    with pytest.raises(OSError) as e:
        c.convert_dqn_replay(run, dst, progress=False, workers=1)
    assert e.value.errno == 28 and str(tmpfs) in str(e.value), e.value
    assert sorted(os.listdir(tmpfs)) == ["d.h5.partial.d", "filler"]
    assert sorted(os.listdir(f"{dst}.partial.d")) == ["convert.json", "live", "snaps"]
    monkeypatch.undo()
    os.unlink(filler)
    r = c.convert_dqn_replay(run, dst, progress=False, workers=1)
    assert r["resumed_after"] == 2
    got = content(dst)
    assert all(got[k] == reference[k] for k in reference) and sorted(got) == sorted(reference)
    assert sorted(os.listdir(tmpfs)) == ["d.h5"]


