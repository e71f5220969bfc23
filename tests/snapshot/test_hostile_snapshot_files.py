"""Hostile snapshots, their files: FIFOs, symlinks and directories in place
of every member, foreign files where a load writes (never replaced or
deleted), a full disk (real tmpfs) at every point of save and load, and the
caller's metadata and files kept in snapshots.

Every refusal is checked against a fingerprint of what is on disk before it.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import bigper
from bigper import CorruptSnapshotError, IncompatibleSnapshotError, PathExistsError, Snapshots
from bigper.errors import InvalidArgumentError, InvalidTypeError, PathNotFoundError
from bigper.snapshot import verify

load = bigper.PrioritizedReplayBuffer.load
from bigper.snapshot.manifest import MANIFEST, decode

from tests._snapshot_cases import Stream, feed, make
from tests._hostile_snapshot_cases import (
    deadline,
    fill,
    fingerprint,
    refused,
    resign,
    small,
)
from tests.snapshot.test_snapshot_faults import tmpfs

DATA = Path(__file__).parents[1] / "data"


# -- special files and symlinks in place of members (item 5) -------------------------------------
def _members(snap: Path) -> list[str]:
    return sorted(decode((snap / MANIFEST).read_bytes(), snap)["files"])


@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_fifo_or_symlink_in_place_of_any_member_is_refused_at_once(kind, tmp_path):
    snap = small(kind, tmp_path, k=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    for member in _members(snap):
        p = snap / member
        keep = p.read_bytes()
        for plant in ("fifo", "symlink", "dir"):
            os.unlink(p)
            if plant == "fifo":
                os.mkfifo(p)
            elif plant == "dir":
                os.mkdir(p)
            else:  # the very same bytes, reached through a link: still refused
                (outside / p.name).write_bytes(keep)
                os.symlink(outside / p.name, p)
            t0 = time.monotonic()
            refused(CorruptSnapshotError, snap, path=None if kind == "memory" else tmp_path / "live2")
            with deadline():
                with pytest.raises(CorruptSnapshotError):
                    verify(snap)
            assert time.monotonic() - t0 < 2, (member, plant)
            os.rmdir(p) if plant == "dir" else os.unlink(p)
            p.write_bytes(keep)
    load(snap, path=None if kind == "memory" else tmp_path / "live2").close()


def test_load_latest_falls_back_past_a_fifo_without_hanging_holding_the_lock(tmp_path):
    stream = Stream(k=None, seed=2)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 10)
    snaps = Snapshots(tmp_path / "snaps", keep=None)
    first = snaps.save(buf, metadata={"step": 10})
    feed(buf, stream, 3)
    second = snaps.save(buf, metadata={"step": 13})
    victim = second / "state" / "leaves.npy"
    os.unlink(victim)
    os.mkfifo(victim)
    with deadline():
        with pytest.warns(RuntimeWarning, match="falling back"):
            got = snaps.load_latest()
    assert snaps.last_loaded.path == first and snaps.last_loaded.step == 10
    assert len(got) == 10
    snaps.save(got)  # the root's lock was released


def test_a_snapshot_name_that_is_a_symlink_is_not_a_snapshot(tmp_path):
    stream = Stream(k=None, seed=2)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 10)
    elsewhere = buf.save(tmp_path / "elsewhere")
    snaps = Snapshots(tmp_path / "snaps")
    os.symlink(elsewhere, snaps.root / "snap-00000009")
    assert snaps.list() == [] and snaps.latest() is None
    with pytest.raises(PathNotFoundError):
        snaps.load_latest()


# -- foreign files where a load writes (items 1 and 2) -----------------------------------------
def _hdf5_snap(tmp: Path) -> Path:
    return small("hdf5", tmp)


def test_hdf5_load_never_replaces_a_file_it_did_not_write(tmp_path):
    snap = _hdf5_snap(tmp_path)
    target = tmp_path / "target.h5"
    plants = {
        "text": lambda: target.write_text("my notes\n"),
        "empty": lambda: target.write_bytes(b""),
        "foreign hdf5": lambda: h5py.File(target, "w").create_dataset("x", data=np.arange(3)),
        "hdf5 with a fake group": lambda: h5py.File(target, "w").create_group("_bigper").attrs.__setitem__(
            "meta", json.dumps({"format": "not-bigper"})),
        "hdf5 signature then junk": lambda: target.write_bytes(b"\x89HDF\r\n\x1a\n" + b"junk" * 100),
        "fifo": lambda: os.mkfifo(target),
        "symlink to a file": lambda: os.symlink(tmp_path / "real.txt", target),
        "directory": lambda: target.mkdir(),
    }
    (tmp_path / "real.txt").write_text("x")
    for name, plant in plants.items():
        plant()
        refused(PathExistsError, snap, target, tmp_path / "real.txt", tmp_path / "target.h5.lock", path=target)
        assert not list(tmp_path.glob(".target.h5.trash-*")), name
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        else:
            target.unlink()
    load(snap, path=target).close()  # an empty place: loads


def test_a_resigned_storage_path_naming_another_file_does_not_wipe_it(tmp_path):
    snap = _hdf5_snap(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    resign(snap, lambda b: b["storage"].__setitem__("path", str(victim)))
    refused(PathExistsError, snap, victim)
    assert victim.read_text() == "precious"


def test_hdf5_load_replaces_its_own_dead_writers_file(tmp_path):
    snap = _hdf5_snap(tmp_path)
    live = tmp_path / "live.h5"
    buf = load(snap, path=live)
    buf.storage._lock.release()  # the writer "dies" (its lock goes with the process)
    buf.storage._lock = None
    b2 = load(snap, path=live)
    assert len(b2) == 16
    b2.close()


MEMMAP_FOREIGN = {
    "data/train.csv and state/model.pt": {"data/train.csv": b"a,b\n", "state/model.pt": b"w"},
    "a subdirectory in data": {"data/sub/x.bin": b"x"},
    "a chunk-like name no record names": {"meta.json": None, "data/zzz.bin": b"x"},
    "a foreign meta.json": {"meta.json": b'{"format": "something-else"}'},
    "meta.json not JSON": {"meta.json": b"\x00\x01"},
    "a top-level file": {"notes.txt": b"x"},
    "a trash-like name": {".trash-notours": b"x"},
    "a state file never recorded": {"meta.json": None, "state/model.npy": b"x"},
}


@pytest.mark.parametrize("case", sorted(MEMMAP_FOREIGN))
def test_memmap_load_never_deletes_what_it_did_not_write(case, tmp_path):
    snap = small("memmap", tmp_path)
    live = tmp_path / "target"
    for rel, raw in MEMMAP_FOREIGN[case].items():
        p = live / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if raw is None:  # a genuine bigper record of this very config
            load(snap, path=live).close()
            continue
        p.write_bytes(raw)
    refused(PathExistsError, snap, live, path=live)


def test_memmap_load_refuses_symlinks_and_fifos_in_its_directory(tmp_path):
    snap = small("memmap", tmp_path)
    live = tmp_path / "target"
    load(snap, path=live).close()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "x").write_text("mine")
    chunk = sorted((live / "data").iterdir())[0]
    for plant in ("symlink", "fifo"):
        os.unlink(chunk)
        os.symlink(keep / "x", chunk) if plant == "symlink" else os.mkfifo(chunk)
        refused(PathExistsError, snap, live, keep, path=live)
    os.unlink(chunk)
    os.rename(live / "data", tmp_path / "data-aside")
    os.symlink(keep, live / "data")
    refused(PathExistsError, snap, live, keep, path=live)


def test_memmap_load_takes_over_its_own_leftovers(tmp_path):
    """What bigper wrote itself is replaced: a dead writer's directory, an
    interrupted takeover's trash, copy-on-write leftovers."""
    snap = small("memmap", tmp_path)
    live = tmp_path / "target"
    buf = load(snap, path=live)
    buf.storage._lock.release()
    buf.storage._lock = None
    (live / ".trash-0123456789ab").mkdir()
    (live / ".trash-0123456789ab" / "x.bin").write_bytes(b"x")
    chunk = sorted((live / "data").iterdir())[0]
    (chunk.parent / (chunk.name + ".cow")).write_bytes(b"partial copy")
    b2 = load(snap, path=live)
    assert len(b2) == 16
    assert sorted(p.name for p in live.iterdir()) == [".lock", "data", "meta.json"]
    b2.close()


# -- full disk at every write of save and load (real tmpfs) ------------------------------------
@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_full_disk_at_every_point_of_load_leaves_the_snapshot_and_path_as_they_were(kind, tmp_path):
    """A load into a small tmpfs with less and less room: either it loads, or
    it raises OSError(ENOSPC) (never h5py's muddled errors), the snapshot
    unchanged and nothing but bigper-marked files left at the path."""
    import shutil

    snap = small(kind, tmp_path, k=2, capacity=64)
    size = sum(p.stat().st_size for p in snap.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "fs", "1m") as fs:
        live = fs / ("live.h5" if kind == "hdf5" else "live")
        outcomes = set()
        for leave in np.linspace(0, size + (320 << 10), 12).astype(int):
            fill(fs, int(leave))
            before = fingerprint(snap)
            try:
                with deadline(20):
                    buf = load(snap, path=live)
            except OSError as e:
                outcomes.add("failed")
                assert e.errno == errno.ENOSPC, e
                assert fingerprint(snap) == before
                if kind == "hdf5":
                    assert not live.exists()
                else:
                    assert not live.exists() or not any(live.iterdir()) or (live / "meta.json").exists(), \
                        "what is left is marked as bigper's"
            else:
                outcomes.add("loaded")
                assert len(buf) == 64
                buf.storage._lock.release()  # dropped, not closed: closing needs room of its own
                buf.storage._lock = None
            shutil.rmtree(live, ignore_errors=True) if kind == "memmap" else live.unlink(missing_ok=True)
            os.unlink(fs / "filler")
        assert outcomes == {"failed", "loaded"}, outcomes


def test_full_disk_at_every_point_of_a_snapshot_save(tmp_path):
    stream = Stream(k=None, frame=(8, 8), seed=2)
    buf = make("memory", None, stream, capacity=256)
    feed(buf, stream, 300)
    (tmp_path / "model.pt").write_bytes(os.urandom(50_000))
    with tmpfs(tmp_path / "fs", "1m") as fs:
        snaps = Snapshots(fs / "snaps", keep=None)  # a successful save must not retire the first
        first = snaps.save(buf, metadata={"step": 1})
        want = fingerprint(first)
        outcomes = set()
        for leave in np.linspace(0, 120_000, 10).astype(int):
            fill(fs, int(leave))
            try:
                got = snaps.save(buf, metadata={"step": 2}, files={"model.pt": tmp_path / "model.pt"})
            except OSError as e:
                assert e.errno == errno.ENOSPC
                outcomes.add("failed")
                assert fingerprint(first) == want
                assert sorted(os.listdir(snaps.root)) == [".lock", first.name], "no temporary left"
            else:
                outcomes.add("saved")
                os.unlink(fs / "filler")
                import shutil

                shutil.rmtree(got)
                continue
            os.unlink(fs / "filler")
        assert "failed" in outcomes
        b = snaps.load_latest()
        assert snaps.last_loaded.path == first and len(b) == 256


# -- the caller's metadata and files (issue 15) -----------------------------------------------
def test_metadata_and_files_are_kept_checksummed_and_retained_with_their_snapshot(tmp_path):
    stream = Stream(k=None, seed=5)
    buf = make("memmap", tmp_path / "live", stream, capacity=16)
    snaps = Snapshots(tmp_path / "snaps", keep=2)
    model = tmp_path / "model.pt"
    saved = []
    for step in range(3):
        feed(buf, stream, 4)
        model.write_bytes(f"weights at {step}".encode() * 100)
        saved.append(snaps.save(buf, metadata={"step": step, "run": "pong"}, files={"model.pt": model}))
    buf.close()
    assert snaps.list() == saved[1:], "retention removed the oldest with its files"
    got, info = snaps.load_latest(path=tmp_path / "live2", with_info=True)
    assert info == snaps.last_loaded and info.path == saved[2] and info.number == 3
    assert info.metadata == {"step": 2, "run": "pong"} and info.step == 2
    assert info.files["model.pt"].read_bytes() == model.read_bytes()
    assert len(got) == 12
    got.close()
    # a damaged user file makes its snapshot corrupt: load_latest falls back to the one before
    raw = bytearray(info.files["model.pt"].read_bytes())
    raw[5] ^= 1
    info.files["model.pt"].write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="falling back"):
        snaps.load_latest(path=tmp_path / "live3").close()
    assert snaps.last_loaded.path == saved[1] and snaps.last_loaded.step == 1
    with pytest.raises(CorruptSnapshotError, match="model.pt"):
        verify(saved[2])


def test_bad_metadata_or_files_are_refused_before_anything_is_written(tmp_path):
    stream = Stream(k=None, seed=5)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 4)
    snaps = Snapshots(tmp_path / "snaps")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ok.bin").write_bytes(b"x")
    bad = [
        (InvalidTypeError, {"metadata": {"x": object()}}),
        (InvalidTypeError, {"metadata": {"x": float("nan")}}),
        (InvalidArgumentError, {"metadata": {"x": "y" * (2 << 20)}}),
        (InvalidArgumentError, {"files": {"../escape": tmp_path / "ok.bin"}}),
        (InvalidArgumentError, {"files": {".hidden": tmp_path / "ok.bin"}}),
        (InvalidArgumentError, {"files": {"a/b": tmp_path / "ok.bin"}}),
        (InvalidTypeError, {"files": [tmp_path / "ok.bin"]}),
        (InvalidTypeError, {"files": {"x": 3}}),
        (PathNotFoundError, {"files": {"x": tmp_path / "missing"}}),
        (InvalidArgumentError, {"files": {"x": tmp_path / "fifo"}}),
        (InvalidArgumentError, {"files": {"x": tmp_path}}),
    ]
    before = fingerprint(snaps.root)
    for exc, kw in bad:
        with deadline():
            with pytest.raises(exc):
                snaps.save(buf, **kw)
        assert fingerprint(snaps.root) == before, kw


def test_snapshots_written_before_user_data_load_with_empty_info(tmp_path):
    import shutil

    root = tmp_path / "snaps"
    root.mkdir()
    shutil.copytree(DATA / "snapshot-v1-memory", root / "snap-00000001")
    snaps = Snapshots(root)
    buf = snaps.load_latest()
    assert snaps.last_loaded.metadata is None and dict(snaps.last_loaded.files) == {}
    assert snaps.last_loaded.number == 1 and snaps.last_loaded.step is None
    buf.close()


def test_a_snapshots_root_or_snapshot_through_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    stream = Stream(k=None, seed=5)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 4)
    for where in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(PathExistsError):
            Snapshots(where)
        with pytest.raises(PathExistsError):
            buf.save(where / "snap")
    assert (tmp_path / "f").read_text() == "x"


def test_every_refusal_is_a_bigper_error():
    for exc in (CorruptSnapshotError, IncompatibleSnapshotError, PathExistsError):
        assert issubclass(exc, bigper.BigperError)


def test_a_snapshots_root_removes_only_its_own_leftovers(tmp_path):
    root = tmp_path / "snaps"
    root.mkdir()
    for name in (".tmp-notes", ".del-mine", ".tmp-snap-00000001-12-zzzzzzzz"):
        (root / name).mkdir()
        (root / name / "keep.txt").write_text("mine")
    (root / ".tmp-snap-00000001-12-0123abcd").mkdir()  # an interrupted save's name: removed
    (root / ".del-snap-00000001-0123abcd").mkdir()  # an interrupted deletion's: removed
    snaps = Snapshots(root)
    assert sorted(snaps.cleaned) == [".del-snap-00000001-0123abcd", ".tmp-snap-00000001-12-0123abcd"]
    for name in (".tmp-notes", ".del-mine", ".tmp-snap-00000001-12-zzzzzzzz"):
        assert (root / name / "keep.txt").read_text() == "mine"
