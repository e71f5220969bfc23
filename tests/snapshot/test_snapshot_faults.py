"""Snapshots under faults: flipped bits and truncations in every file, I/O
errors injected into os.write/os.fsync, and a real full disk (tmpfs)."""

from __future__ import annotations

import copy
import errno
import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import CorruptSnapshotError, Snapshots
from bigper.snapshot import verify

load = bigper.PrioritizedReplayBuffer.load

from tests._snapshot_cases import Stream, assert_same_runs, assert_same_state, feed, learn, make, tree_hash

# -- corruption ------------------------------------------------------------------------------

TRIALS = {"memmap": 150, "memory": 60, "hdf5": 30}  # 240 in all


def _mutate(path: Path, rng: np.random.Generator) -> str:
    raw = bytearray(path.read_bytes())
    if rng.random() < 0.6 and raw:
        bit = int(rng.integers(len(raw) * 8))
        raw[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(raw))
        return f"flip bit {bit}"
    keep = int(rng.integers(len(raw)))  # strictly shorter, possibly empty
    path.write_bytes(bytes(raw[:keep]))
    return f"truncate to {keep}"


@pytest.mark.parametrize("kind", sorted(TRIALS))
def test_every_flipped_bit_and_truncation_is_detected(kind, tmp_path):
    stream = Stream(k=4, frame=(16, 16), seed=5)
    live = None if kind == "memory" else tmp_path / ("live.h5" if kind == "hdf5" else "live")
    a = make(kind, live, stream, capacity=40, n_step=2, chunk_bytes=4096)
    feed(a, stream, 70)
    learn(a, stream, 5, seed=0)
    pristine = tmp_path / "pristine"
    a.save(pristine)
    a.close()
    files = sorted(p.relative_to(pristine) for p in pristine.rglob("*") if p.is_file())
    if kind == "memmap":
        assert len(list((pristine / "data").iterdir())) > 5  # several chunks per big array
    rng = np.random.default_rng({"memmap": 1, "memory": 2, "hdf5": 3}[kind])
    hit = set()
    for t in range(TRIALS[kind]):
        snap = tmp_path / f"t{t}"
        shutil.copytree(pristine, snap)
        rel = files[t % len(files)] if t < 2 * len(files) else files[int(rng.integers(len(files)))]
        what = _mutate(snap / rel, rng)
        hit.add(rel)
        target = None if kind == "memory" else tmp_path / f"live{t}{'.h5' if kind == 'hdf5' else ''}"
        try:
            buf = load(snap, path=target)
        except CorruptSnapshotError:
            pass
        except Exception as e:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"{rel}: {what}: {type(e).__name__}: {e}")
        else:
            buf.close()
            pytest.fail(f"{rel}: {what}: loaded silently")
        with pytest.raises(CorruptSnapshotError):
            verify(snap)
        assert target is None or not target.exists(), "a corrupt snapshot must not touch the live path"
        shutil.rmtree(snap)
    assert hit == set(files)


# -- I/O errors ----------------------------------------------------------------------------------


class Faults:
    """Fails the first os.write/os.fsync whose file's path matches a pattern
    with EIO, and records the calls made after that failure (fsyncs run from
    a thread pool, so the other files of the same batch may still be synced)."""

    def __init__(self, monkeypatch):
        self.target = None
        self.failed = None  # (name, path) of the failing call
        self.after = []  # (name, path) of every call after it
        self._real = {"write": os.write, "fsync": os.fsync}
        for name in self._real:
            monkeypatch.setattr(os, name, self._wrap(name))

    def _wrap(self, name):
        real = self._real[name]

        def call(fd, *args):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if self.failed is not None:
                self.after.append((name, path))
            elif self.target and self.target[0] == name and re.search(self.target[1], path):
                self.failed = (name, path)
                raise OSError(errno.EIO, f"injected EIO in os.{name}")
            return real(fd, *args)
        return call

    def arm(self, name=None, pattern=None):
        self.target = None if name is None else (name, pattern)
        self.failed, self.after = None, []

    def check_stopped(self, root: Path) -> None:
        """Never retried, and the save went no further: no write, no parent fsync."""
        assert self.failed is not None
        assert self.failed not in self.after, f"{self.failed} was retried"
        assert not [c for c in self.after if c[0] == "write"], self.after
        assert not [c for c in self.after if Path(c[1]) == root], self.after


# Every kind of file a save writes or syncs: state arrays, data chunks (copied,
# or the live chunk files linked, then made durable), the manifest,
# the temporary directories, and the parent after the rename.
TARGETS = {
    "memmap": [("write", r"/state/leaves\.npy$"), ("write", r"/state/[a-z_]+\.npy$"),
               ("write", r"/manifest\.json$"),
               ("fsync", r"/state/ends\.npy$"), ("fsync", r"/\.tmp-snap-[^/]+/data/[a-z_]+\.bin$"),
               ("fsync", r"/\.tmp-snap-[^/]+/data/frames\.\d+\.bin$"), ("fsync", r"/manifest\.json$"),
               ("fsync", r"/\.tmp-snap-[^/]+/state$"), ("fsync", r"/\.tmp-snap-[^/]+/data$"),
               ("fsync", r"/\.tmp-snap-[^/]+$"), ("fsync", r"/snaps$")],
    "memory": [("write", r"/state/leaves\.npy$"), ("write", r"/data/frames\.bin$"),
               ("write", r"/data/reward\.bin$"), ("write", r"/manifest\.json$"),
               ("fsync", r"/state/status\.npy$"), ("fsync", r"/data/frame_ref\.bin$"),
               ("fsync", r"/manifest\.json$"), ("fsync", r"/\.tmp-snap-[^/]+/data$"),
               ("fsync", r"/\.tmp-snap-[^/]+$"), ("fsync", r"/snaps$")],
}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names files by /proc/self/fd (Linux)")
@pytest.mark.parametrize("kind", ["memmap", "memory"])
def test_an_io_error_fails_the_snapshot_and_leaves_the_previous_one(kind, tmp_path, monkeypatch):
    stream = Stream(k=2, frame=(16, 16), seed=8)
    live = tmp_path / "live" if kind == "memmap" else None
    a = make(kind, live, stream, capacity=200, n_step=2, chunk_bytes=4096)
    feed(a, stream, 50)
    root = tmp_path / "snaps"
    first = Snapshots(root, keep=2).save(a)
    expected = copy.deepcopy(a.state_dict())
    before = tree_hash(first)
    faults = Faults(monkeypatch)
    for name, pattern in TARGETS[kind]:
        feed(a, stream, 30)  # dirty chunks: the save has data to make durable
        faults.arm(name, pattern)
        try:
            Snapshots(root, keep=2).save(a)
        except OSError as e:
            assert e.errno == errno.EIO, (name, pattern, e)
        else:
            pytest.fail(f"no os.{name} of a file matching {pattern} in a save")
        faults.check_stopped(root)
        assert sorted(os.listdir(root)) == [".lock", first.name], "no leftovers, nothing new"
    faults.arm()
    assert tree_hash(first) == before
    # the previous snapshot loads as it was saved: its open episode not ended (continue_episodes)
    back = Snapshots(root).load_latest(path=tmp_path / "back" if kind == "memmap" else None,
                                       continue_episodes=True)
    assert back.state_dict()[0] == expected[0]
    for k, v in expected[1].items():
        assert np.array_equal(back.state_dict()[1][k], v), k
    back.close()
    # the buffer carries on, and the next snapshot is whole
    learn(a, stream, 10, seed=4)
    good = Snapshots(root, keep=2).save(a)
    assert verify(good)["problems"] == []
    b = load(good, path=tmp_path / "b" if kind == "memmap" else None, continue_episodes=True)  # same stream goes on
    assert_same_state(a, b)
    other = copy.deepcopy(stream)
    assert_same_runs(learn(a, stream, 5, seed=5), learn(b, other, 5, seed=5))
    a.close()
    b.close()


# -- a real full disk ----------------------------------------------------------------------------


@contextmanager
def tmpfs(where: Path, size: str):
    if os.geteuid() != 0:
        pytest.skip("a full disk is a real tmpfs, mounted here as root; this run is not root")
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_disk_fails_the_snapshot_and_the_previous_one_loads(tmp_path):
    """Snapshots on a 1 MB tmpfs; each needs ~0.6 MB (copied: the buffer is in memory)."""
    stream = Stream(k=None, frame=(16, 16), seed=2)
    a = make("memory", None, stream, capacity=1024)
    feed(a, stream, 1100)
    with tmpfs(tmp_path / "fs", "1m") as fs:
        root = fs / "snaps"
        first = Snapshots(root, keep=1).save(a)
        want = a.state_dict()
        feed(a, stream, 10)
        with pytest.raises(OSError) as e:
            Snapshots(root, keep=1).save(a)
        assert e.value.errno == errno.ENOSPC
        assert sorted(os.listdir(root)) == [".lock", first.name]
        assert Snapshots(root).cleaned == []
        b = Snapshots(root).load_latest(continue_episodes=True)  # as saved: its open episode not ended
        assert b.state_dict()[0] == want[0]
        assert verify(first)["problems"] == []


def test_full_disk_while_the_live_buffer_copies_a_shared_chunk_is_an_oserror(tmp_path):
    """memmap live data and its snapshots on one small tmpfs: the snapshot links
    chunks (no space), then copy-on-write needs space the disk does not have."""
    stream = Stream(k=None, frame=(32, 32), seed=6)
    with tmpfs(tmp_path / "fs", "2m") as fs:
        a = make("memmap", fs / "live", stream, capacity=800, chunk_bytes=64 << 10)  # 1.6 MB
        feed(a, stream, 800)
        snap = fs / "snap"
        a.save(snap)  # hard links: fits
        want = copy.deepcopy(a.state_dict())
        with pytest.raises(OSError) as e:
            for _ in range(800):
                feed(a, stream, 1)
                want = copy.deepcopy(a.state_dict())
        assert e.value.errno == errno.ENOSPC
        got = a.state_dict()
        assert got[0] == want[0], "a failed add leaves the bookkeeping as it was"
        for k in want[1]:
            assert np.array_equal(got[1][k], want[1][k]), k
        assert verify(snap)["problems"] == []
        b = load(snap, path=tmp_path / "elsewhere")  # another filesystem: chunks are copied
        assert len(b) == 800
        assert not any(p.stat().st_nlink > 1 for p in (tmp_path / "elsewhere" / "data").iterdir())
        b.close()
        shutil.rmtree(snap)  # frees the chunks only it held, so that close can record the state
        a.close()


def test_full_disk_helper_skips_politely_when_not_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="not root"):
        with tmpfs(tmp_path / "x", "1m"):
            pass
