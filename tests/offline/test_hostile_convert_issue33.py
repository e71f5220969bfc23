"""Issue 33, causes 6 and 7 and the convert mutants that lived.

- convert takes the lock a writer takes before it changes anything at dst:
  a live writer's (or reader's) file is never replaced under it.
- a sequence buffer's HDF5 file opens with ``from_hdf5`` exactly as it was
  written (the item tables included), and ``convert`` refuses it as documented.
- the keys convert carries: the largest becomes the file's max_leaf (the file
  resumes), and a dataset where only some keys changed carries every one.
- the destination directory is fsynced after the last rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.convert import convert
from bigper.errors import InvalidArgumentError, StorageLockedError

from tests._hostile_snapshot_cases import fingerprint
from tests._roundtrip import batch_bytes, held, kwargs_of
from tests.offline.test_convert import cli, everything

FIELDS = {"obs": ((4, 8, 8), np.uint8), "action": ((), np.int64)}


def small_d4rl(path: Path, n: int = 60, seed: int = 0) -> None:
    import h5py

    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 255, (n + 4, 8, 8), dtype=np.uint8)
    obs = np.stack([frames[i:i + 4] for i in range(n)])
    nxt = np.stack([frames[i + 1:i + 5] for i in range(n)])
    with h5py.File(path, "w") as f:
        f["observations"], f["next_observations"] = obs, nxt
        f["actions"] = rng.integers(0, 4, n)
        f["rewards"] = rng.standard_normal(n).astype(np.float32)
        f["terminals"] = np.zeros(n, bool)
        f["timeouts"] = np.zeros(n, bool)


def live_writer(path: Path, n: int = 30):
    buf = bigper.PrioritizedReplayBuffer(capacity=40, fields=FIELDS, frame_stack=4, storage="hdf5", path=path)
    rng = np.random.default_rng(3)
    for i in range(n):
        o = rng.integers(0, 255, (4, 8, 8), dtype=np.uint8)
        buf.add(obs=o, next_obs=np.roll(o, 1, axis=0), action=i, terminated=i % 9 == 8)
    return buf


# -- cause 6: the lock before any change --------------------------------------------------
def test_convert_over_a_live_writers_file_is_storage_locked_and_the_writer_keeps_its_data(tmp_path):
    src, live = tmp_path / "src.h5", tmp_path / "live" / "buf.h5"
    small_d4rl(src)
    live.parent.mkdir()
    buf = live_writer(live)
    try:
        data, keys = held(buf)
        before = fingerprint(live.parent)
        with pytest.raises(StorageLockedError, match="buf.h5"):
            convert(src, live, overwrite=True, progress=False)
        assert fingerprint(live.parent) == before  # not replaced, no partial, no lock file of convert's
        after, keys2 = held(buf)  # the writer goes on with what it held
        assert {k: v.tobytes() for k, v in after.items()} == {k: v.tobytes() for k, v in data.items()}
        assert keys2.tobytes() == keys.tobytes()
        buf.add(obs=np.zeros((4, 8, 8), np.uint8), next_obs=np.ones((4, 8, 8), np.uint8), action=99)
    finally:
        buf.close()
    with bigper.PrioritizedReplayBuffer(**kwargs_of(buf.config), storage="hdf5", path=live, mode="resume") as b:
        assert len(b) == 31 and b.gather(np.array([30]))["action"][0] == 99


def test_convert_over_a_writer_in_another_process_is_storage_locked(tmp_path):
    src, live = tmp_path / "src.h5", tmp_path / "buf.h5"
    small_d4rl(src)
    code = ("import sys, numpy as np, bigper\n"
            "b = bigper.PrioritizedReplayBuffer(capacity=8, fields={'x': ((), np.int64)}, storage='hdf5', "
            "path=sys.argv[1])\n"
            "b.add(x=5); print('ready', flush=True); sys.stdin.readline(); b.close()\n")
    from tests._child import Child

    with Child(code, live, stdin=True) as child:
        child.said("ready")
        before = fingerprint(tmp_path)
        with pytest.raises(StorageLockedError, match=f"process {child.pid}"):
            convert(src, live, overwrite=True, progress=False)
        assert fingerprint(tmp_path) == before
        child.send("")
        if child.end() != 0:
            child.fail("did not close its buffer")
    with bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.int64)}, storage="hdf5", path=live,
                                        mode="resume") as b:
        assert len(b) == 1 and b.gather(np.array([0]))["x"][0] == 5


def test_convert_leaves_no_lock_file_it_made_at_dst(tmp_path):
    src, dst = tmp_path / "src.h5", tmp_path / "d.h5"
    small_d4rl(src)
    convert(src, dst, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["d.h5", "src.h5"]


# -- cause 7: a sequence buffer's file -----------------------------------------------------
def sequence_file(path: Path, n: int = 23, update: bool = True):
    kw = dict(capacity=16, fields={"obs": ((3,), np.float32), "action": ((), np.int64)},
              sequence=bigper.Sequence(3, burn_in=1))
    with bigper.PrioritizedReplayBuffer(**kw, storage="hdf5", path=path) as buf:
        for i in range(n):
            buf.add(obs=np.full(3, i, np.float32), action=i, next_obs=np.full(3, i + 1, np.float32),
                    terminated=i % 7 == 6)
        live = np.flatnonzero(buf.state_dict()[1]["seq_status"] == 1)
        if update:  # (from_hdf5 starts from the sidecar's keys, else 1.0, not the writer's)
            buf.update_priorities(live[::2], np.arange(live[::2].shape[0]) + 2.0)
    return kw


def test_a_sequence_buffers_hdf5_file_opens_with_from_hdf5_as_it_resumes(tmp_path):
    p = tmp_path / "seq.h5"
    kw = sequence_file(p, update=False)
    ok = cli("verify", p)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    before = fingerprint(tmp_path)
    shutil.copy(p, tmp_path / "resumed.h5")
    with bigper.PrioritizedReplayBuffer.from_hdf5(p, seed=11) as ds, \
            bigper.PrioritizedReplayBuffer(**kw, storage="hdf5", path=tmp_path / "resumed.h5", mode="resume",
                                           seed=11, read_only=True) as res:
        assert ds.config.sequence == kw["sequence"].to_dict() and len(ds) == len(res) == 16
        st, rt = ds.state_dict()[1], res.state_dict()[1]
        for name in ("seq_pos", "seq_status", "seq_pending", "seq_next", "seq_ptr", "status", "gid"):
            assert st[name].tobytes() == rt[name].tobytes(), name
        assert ds.leaves(np.arange(16)).tobytes() == res.leaves(np.arange(16)).tobytes()
        assert ds.total_priority == res.total_priority
        for _ in range(3):
            a, b = ds.sample(5), res.sample(5)
            assert a["obs"].shape == (5, 4, 3) and batch_bytes(a) == batch_bytes(b)
    assert fingerprint(p) == {k: v for k, v in before.items() if k == str(p)}  # read-only, in place


def test_a_sequence_datasets_priorities_survive_close_and_reopen(tmp_path):
    p = tmp_path / "seq.h5"
    sequence_file(p)
    with bigper.PrioritizedReplayBuffer.from_hdf5(p) as ds:
        b = ds.sample(4)
        ds.update_priorities(b, np.full(4, 7.5))
        keys = ds.leaves(np.arange(16))
    with bigper.PrioritizedReplayBuffer.from_hdf5(p) as ds:
        assert ds.leaves(np.arange(16)).tobytes() == keys.tobytes()


def test_convert_of_a_sequence_buffer_is_the_documented_refusal(tmp_path):
    p, dst = tmp_path / "seq.h5", tmp_path / "out" / "z.h5"
    sequence_file(p)
    before = fingerprint(tmp_path)
    with pytest.raises(InvalidArgumentError, match="sequence items; convert reads one stream of one-step"):
        convert(p, dst, progress=False)
    assert fingerprint(tmp_path) == before
    r = cli("convert", p, dst, "--no-progress")
    assert r.returncode == 2 and "sequence items" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- the mutants of convert.py that lived ---------------------------------------------------
def reprioritized_storage(path: Path, some: bool):
    """A closed hdf5 storage of 30 transitions whose keys were then changed through from_hdf5:
    every one to a value above 1 (``some=False``) or only every third (``some=True``)."""
    live_writer(path).close()
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
        live = np.flatnonzero(ds.status == 1)
        pick = live[::3] if some else live
        ds.update_priorities(pick, 3.0 + np.arange(pick.shape[0], dtype=np.float64))


def test_a_converted_file_with_keys_above_one_resumes_as_a_writer(tmp_path):
    src, dst = tmp_path / "src.h5", tmp_path / "z.h5"
    reprioritized_storage(src, some=False)
    convert(src, dst, progress=False)
    _, keys = everything(dst)
    assert keys.max() > 1.0
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        cfg = ds.config
    # a writer resuming the file: the recorded max_leaf covers the largest key of the file
    with bigper.PrioritizedReplayBuffer(**kwargs_of(cfg), storage="hdf5", path=dst, mode="resume") as b:
        b.add(obs=np.zeros((4, 8, 8), np.uint8), next_obs=np.zeros((4, 8, 8), np.uint8), action=1)
        assert b.state_dict()[0]["max_leaf"] >= keys.max()


def test_only_some_changed_keys_are_carried_each_as_it_was(tmp_path):
    src, dst = tmp_path / "src.h5", tmp_path / "z.h5"
    reprioritized_storage(src, some=True)
    _, want = everything(src)
    assert (want == 1.0).any() and (want != 1.0).any()
    convert(src, dst, progress=False)
    _, got = everything(dst)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_destination_directory_is_fsynced_after_the_last_rename(overwrite, tmp_path, monkeypatch):
    src, dst = tmp_path / "src.h5", tmp_path / "out" / "z.h5"
    reprioritized_storage(src, some=True)  # a sidecar too: two renames
    dst.parent.mkdir()
    if overwrite:
        convert(src, dst, progress=False)
        shutil.rmtree(f"{dst}.priorities")
    calls = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "link", "unlink")}
    folder = os.stat(dst.parent)

    def record(name):
        def call(*a, **k):
            if name == "fsync":
                st = os.fstat(a[0])
                calls.append(("fsync-dir" if (st.st_dev, st.st_ino) == (folder.st_dev, folder.st_ino)
                              else "fsync", None))
            elif str(a[-1] if name != "unlink" else a[0]).startswith(str(dst.parent)):
                calls.append((name, str(a[-1] if name != "unlink" else a[0])))
            return real[name](*a, **k)
        return call

    for name in real:
        monkeypatch.setattr(os, name, record(name))
    convert(src, dst, progress=False, overwrite=overwrite)
    monkeypatch.undo()
    into_dst = [i for i, (name, arg) in enumerate(calls) if name in ("replace", "rename", "link")
                and arg in (str(dst), f"{dst}.priorities")]
    assert len(into_dst) == 2, calls
    assert any(name == "fsync-dir" for name, _ in calls[into_dst[-1] + 1:]), calls
    _, got = everything(dst)
    _, want = everything(src)
    assert got.tobytes() == want.tobytes()
