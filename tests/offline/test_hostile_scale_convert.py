"""Hostile runs of ``convert_dqn_replay``'s last step and of its frame reader.

``_to_hdf5`` now closes the work buffer first (its state recorded in its
directory), reopens that directory read-only and copies its arrays and the
recorded state into ``DST.partial`` (kill -9 and a full disk there:
test_hostile_scale_convert_kill.py). Held here:

- the work directory's ``live/`` tampered between a killed run and the next
  (a FIFO, a symlink, a truncated chunk, a state array or the record
  rewritten, ``live`` itself a symlink): refused naming it, or replaced by the
  snapshot; never a wrong file;
- the recycled frame buffers of the reader: a checkpoint whose frames turn
  out corrupt in the middle of the stream (several chunks in) is bigper's
  error naming the file, and leaves no reader thread behind.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

import bigper.convert_dqn as c
from bigper.errors import CorruptSnapshotError, OfflineDatasetError, PathExistsError
from bigper.offline.dqn_replay import open_run, scan_run, stream_transitions

from tests._hostile_snapshot_cases import deadline
from tests.offline._dqn_replay_files import K, two_checkpoints

C = 300


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return two_checkpoints(tmp_path_factory.mktemp("scale") / "run", C)


def content(path) -> dict:
    """Every dataset's dtype, shape and bytes, every attribute (the meta JSON parsed)."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.dtype.str, obj.shape, obj[()].tobytes() if obj.size else b"")
            for k, v in obj.attrs.items():
                v = v.decode() if isinstance(v, bytes) else v
                out[f"{name}@{k}"] = json.loads(v) if k == "meta" else np.asarray(v).tobytes()
        for k, v in f.attrs.items():
            out[f"@{k}"] = np.asarray(v).tobytes()
        f.visititems(visit)
    return out


@pytest.fixture(scope="module")
def reference(run, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ref") / "ref.h5"
    c.convert_dqn_replay(run, dst, progress=False, workers=1)
    out = content(dst)
    assert "_bigper@meta" in out and "frame_log" in out
    return out


def _fifo(p: Path):
    p.unlink()
    os.mkfifo(p)


def _link(p: Path):
    p.rename(p.with_name("elsewhere"))
    p.symlink_to("elsewhere")


def _state(p: Path):
    a = np.load(p).copy()
    a.reshape(-1)[:3] = 7 if a.dtype != bool else True
    p.unlink()
    np.save(p, a)


def _replace(p: Path, size: int):
    data = p.read_bytes()[:size]
    p.unlink()
    p.write_bytes(data)


def _unclean(p: Path):
    m = json.loads(p.read_text())
    m["clean"] = False
    p.write_text(json.dumps(m))


TAMPER = {
    # what, where in live/, the change, the words of a refusal (None: the snapshot replaces it)
    "a FIFO for a chunk": ("data/frame_log.bin", _fifo, r"live holds data/'frame_log\.bin'"),
    "a symlink for a chunk": ("data/frame_log.bin", _link, r"live holds data/'elsewhere'"),
    "a FIFO for a state array": ("state/leaves.npy", _fifo, r"live holds state/'leaves\.npy'"),
    # (live's chunks are the snapshot's, hard links: truncated in place, both are; the
    # snapshot's manifest names it. Replaced by a short copy, only live's is: rewound.)
    "a truncated chunk": ("data/frame_log.bin", lambda p: os.truncate(p, 100),
                          r"snaps/snap-00000002: data/frame_log\.bin has 100 bytes, the manifest records"),
    "a truncated small array": ("data/action.bin", lambda p: os.truncate(p, 7),
                                r"data/action\.bin has 7 bytes.*truncated"),
    "a chunk replaced by a short copy": ("data/frame_log.bin", lambda p: _replace(p, 100), None),
    "a small array replaced by a short copy": ("data/action.bin", lambda p: _replace(p, 7), None),
    "leaves rewritten": ("state/leaves.npy", _state, None),
    "status rewritten": ("state/status.npy", _state, None),
    "the record unclean": ("meta.json", _unclean, None),
}


class Killed(BaseException):
    """What a kill -9 leaves, in this process: nothing of convert's handling runs on."""


@pytest.mark.parametrize("case", sorted(TAMPER) + ["live a symlink"])
def test_live_tampered_between_a_killed_run_and_the_next(run, reference, tmp_path, monkeypatch, case):
    """The run before stopped with the work buffer closed and not reopened (as the kill
    -9 tests in test_hostile_scale_convert_kill.py leave it, without a child)."""
    dst = tmp_path / "d.h5"
    opened = c.MemmapStorage.open

    def open_(self, *a):
        if self.read_only:
            raise Killed
        return opened(self, *a)
    monkeypatch.setattr(c.MemmapStorage, "open", open_)
    with pytest.raises(Killed):
        c.convert_dqn_replay(run, dst, progress=False, workers=1)
    monkeypatch.undo()
    work = Path(f"{dst}.partial.d")
    if case == "live a symlink":
        shutil.move(work / "live", tmp_path / "moved")
        (work / "live").symlink_to(tmp_path / "moved")
        words = "is a symbolic link"
    else:
        rel, change, words = TAMPER[case]
        change(work / "live" / rel)
    with deadline(120):
        if words is not None:
            with pytest.raises((PathExistsError, CorruptSnapshotError), match=words):
                c.convert_dqn_replay(run, dst, progress=False, workers=1)
            assert not os.path.lexists(dst) and work.is_dir()
            return
        r = c.convert_dqn_replay(run, dst, progress=False, workers=1)
    assert r["resumed_after"] == 2
    got = content(dst)
    assert sorted(got) == sorted(reference) and all(got[k] == reference[k] for k in reference)


def _gunzip_threads():
    return [t for t in threading.enumerate() if t.name == "bigper-gunzip" and t.is_alive()]


@pytest.mark.parametrize("rows,chunk", [(8, 1), (1, 3), (3, 1), (64, 50)])
def test_frames_corrupt_several_chunks_in_are_an_error_and_leave_no_thread(run, tmp_path, rows, chunk):
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    path = bad / "$store$_observation_ckpt.1.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x5A  # (the size and trailer kept: the scan passes, the stream finds it)
    st = os.stat(path)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not _gunzip_threads()
    ck = scan_run(bad)[1]
    fd = open_run(bad)
    got = 0
    try:
        with deadline(60), pytest.raises(OfflineDatasetError, match=r"observation_ckpt\.1\.gz") as e:
            for d in stream_transitions(fd, ck, K, chunk=chunk, rows=rows, depth=1):
                got += d["action"].shape[0]
    finally:
        os.close(fd)
    assert got > rows, (got, e.value)  # (found after several chunks, not at the first)
    assert not _gunzip_threads()


def test_a_corrupt_checkpoint_in_a_convert_that_reads_ahead_leaves_no_thread(run, tmp_path):
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    path = bad / "$store$_observation_ckpt.1.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))
    with deadline(120), pytest.raises(OfflineDatasetError, match=r"observation_ckpt\.1\.gz"):
        c.convert_dqn_replay(bad, tmp_path / "d.h5", progress=False, workers=3)  # (checkpoint 1 read ahead)
    assert not _gunzip_threads()
    assert not os.path.lexists(tmp_path / "d.h5")
