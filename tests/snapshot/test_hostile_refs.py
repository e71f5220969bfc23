"""Frame references read from disk are hostile (issue 43, section 2).

A transition's frames are one id and offsets back from it (``frame_ref``,
``frame_off``: frames/store.py); an older snapshot holds them whole
(``obs_ref``, ``next_obs_ref``) and is converted at load. Either way, a
live transition that references frames outside those stored is refused
with ``CorruptSnapshotError`` naming the arrays and the slot, the snapshot
untouched and nothing made at the live path; so is a live storage that
resumes with such references. The boundary (the oldest frame still stored)
loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import CorruptSnapshotError, IncompatibleSnapshotError
from bigper.frames.store import frame_capacity
from bigper.snapshot import verify
from bigper.snapshot.manifest import MANIFEST, decode, digest

from tests._hostile_snapshot_cases import fingerprint, load, refused, resign, small
from tests._snapshot_cases import Stream, feed, make

DATA = Path(__file__).resolve().parents[1] / "data"


def put_data(snap: Path, name: str, arr: np.ndarray) -> None:
    """Replace data array ``name`` (one chunk file) with ``arr``'s bytes and re-sign."""
    body = decode((snap / MANIFEST).read_bytes(), snap)
    (member,) = body["data"][name]["files"]
    raw = np.ascontiguousarray(arr).tobytes()
    os.unlink(snap / member)  # (a hard link a live buffer may share: replaced, not written through)
    (snap / member).write_bytes(raw)
    resign(snap, lambda b: b["files"].__setitem__(member, {"size": len(raw), "xxh3_64": digest(raw)}))


def data(snap: Path, name: str) -> np.ndarray:
    body = decode((snap / MANIFEST).read_bytes(), snap)
    rec = body["data"][name]
    (member,) = rec["files"]
    return np.fromfile(snap / member, dtype=rec["dtype"]).reshape(rec["rows"], *rec["shape"])


def _window(snap: Path, k: int, capacity: int = 16) -> tuple[int, int]:
    """``(lo, fw)``: the frames a raw-ring snapshot still holds."""
    fw = decode((snap / MANIFEST).read_bytes(), snap)["state"]["meta"]["frames"]["fw"]
    return max(0, fw - frame_capacity(capacity, k, 1)), fw


@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_live_transition_referencing_frames_not_stored_is_refused(kind, tmp_path):
    snap = small(kind, tmp_path, k=2)
    lo, fw = _window(snap, 2)
    assert lo > 0, "the pristine snapshot's frame ring has wrapped"
    fref, foff = data(snap, "frame_ref"), data(snap, "frame_off")
    status = np.load(snap / "state" / "status.npy")
    slot = int(np.flatnonzero(status == 1)[0])
    path = None if kind == "memory" else tmp_path / "live"
    cases = [("frame_ref", fw), ("frame_ref", fw + 10**9), ("frame_ref", lo - 1), ("frame_ref", -1),
             ("frame_off", 255)]
    for name, value in cases:
        ref, off = fref.copy(), foff.copy()
        if name == "frame_ref":
            ref[slot] = value
            off[slot] = 0
        else:
            off[slot, -1] = value  # its next_obs stack's last frame 255 ids back: below the ring
        put_data(snap, "frame_ref", ref)
        put_data(snap, "frame_off", off)
        e = refused(CorruptSnapshotError, snap, tmp_path / "live", path=path)
        assert "frame_ref / frame_off" in str(e) and f"slot {slot}" in str(e), str(e)
        assert not os.path.lexists(tmp_path / "live"), "nothing made at the live path"
        assert any("frame_ref / frame_off" in p for p in verify(snap)["problems"])
    # the oldest frame still stored is fine: every reference of the slot at lo
    ref, off = fref.copy(), foff.copy()
    ref[slot], off[slot] = lo, 0
    put_data(snap, "frame_ref", ref)
    put_data(snap, "frame_off", off)
    b = load(snap, path=path)
    assert b.sample(4).indices.shape == (4,)
    b.close()


def test_frame_offsets_of_another_dtype(tmp_path):
    """Wider unsigned offsets than the config writes hold the same references
    (a buffer converted from an older format keeps them): they load; a signed
    or narrower dtype is incompatible."""
    snap = small("memory", tmp_path, k=2)
    off = data(snap, "frame_off")
    body = decode((snap / MANIFEST).read_bytes(), snap)
    (member,) = body["data"]["frame_off"]["files"]

    def put_as(dtype):
        raw = off.astype(dtype).tobytes()
        os.unlink(snap / member)
        (snap / member).write_bytes(raw)

        def change(b):
            b["files"][member] = {"size": len(raw), "xxh3_64": digest(raw)}
            b["data"]["frame_off"]["dtype"] = np.dtype(dtype).str
        resign(snap, change)
    want = load(snap).sample(8).indices.tolist()
    put_as(np.uint16)
    b = load(snap)
    assert b.sample(8).indices.tolist() == want and b._store.arrays["frame_off"].dtype == np.uint16
    put_as(np.int16)
    e = refused(IncompatibleSnapshotError, snap)
    assert "frame_off" in str(e)


def _old(tmp_path: Path) -> Path:
    """A copy of the committed snapshot of the format before (int64 x k references, 3 envs)."""
    snap = tmp_path / "old"
    shutil.copytree(DATA / "snapshot-v1-refs64-envs-memmap", snap)
    return snap


def test_an_older_snapshots_references_out_of_range_are_refused(tmp_path):
    snap = _old(tmp_path)
    obs, nxt = data(snap, "obs_ref"), data(snap, "next_obs_ref")
    status = np.load(snap / "state" / "status.npy")
    slot = int(np.flatnonzero(status == 1)[0])
    fw = decode((snap / MANIFEST).read_bytes(), snap)["state"]["meta"]["frames"]["fw"]
    for value in (fw, -3):
        bad = nxt.copy()
        bad[slot, :] = value
        bad[slot, 0] = obs[slot].min() if value > 0 else value
        put_data(snap, "next_obs_ref", bad)
        e = refused(CorruptSnapshotError, snap, tmp_path / "live", path=tmp_path / "live")
        assert f"slot {slot}" in str(e), str(e)
        assert verify(snap)["problems"]
    put_data(snap, "next_obs_ref", nxt)
    load(snap, path=tmp_path / "live", continue_episodes=True).close()
    # (references further apart than the config's offsets hold, within the frames stored, convert to
    # wider offsets: tests/storage/test_older_live.py, tests/frames/test_refs.py)


def test_an_older_snapshot_of_a_wrong_reference_shape_is_incompatible(tmp_path):
    snap = _old(tmp_path)
    body = decode((snap / MANIFEST).read_bytes(), snap)
    (member,) = body["data"]["next_obs_ref"]["files"]
    raw = (snap / member).read_bytes()[: 36 * 3 * 8]
    os.unlink(snap / member)
    (snap / member).write_bytes(raw)

    def change(b):
        b["files"][member] = {"size": len(raw), "xxh3_64": digest(raw)}
        b["data"]["next_obs_ref"]["shape"] = [3]
    resign(snap, change)
    e = refused(IncompatibleSnapshotError, snap, path=tmp_path / "live")
    assert "next_obs_ref" in str(e)


def test_a_live_storage_resumed_with_references_out_of_range_is_refused(tmp_path):
    """The memmap storage's own files (no snapshot): a resume reads frame_ref
    and refuses a live transition on frames not stored; its files are as
    they were, and a resume after the bytes are put back works."""
    stream = Stream(k=2, seed=5)
    path = tmp_path / "live"
    buf = make("memmap", path, stream, capacity=16)
    feed(buf, stream, 30)
    live = np.flatnonzero(buf.status == 1)
    buf.close()
    chunk = path / "data" / "frame_ref.bin"
    good = chunk.read_bytes()
    ref = np.frombuffer(good, dtype=np.int64).copy()
    ref[live[0]] = 10**12
    chunk.write_bytes(ref.tobytes())
    before = fingerprint(path)
    with pytest.raises(CorruptSnapshotError, match=f"slot {live[0]}"):
        make("memmap", path, stream, capacity=16, mode="resume")
    assert fingerprint(path) == before
    chunk.write_bytes(good)
    b = make("memmap", path, stream, capacity=16, mode="resume")
    assert len(b) == 16
    b.close()


def test_an_older_looking_live_storage_that_lies_is_refused(tmp_path):
    """A new folder whose record renames frame_ref to obs_ref (so it looks like
    an older bigper's, with arrays that are not its): refused naming the array,
    untouched (tests/storage/test_hostile_older_live.py has the real ones)."""
    stream = Stream(k=2, seed=6)
    path = tmp_path / "live"
    buf = make("memmap", path, stream, capacity=16)
    feed(buf, stream, 20)
    buf.close()
    meta = path / "meta.json"
    meta.write_text(meta.read_text().replace('"frame_ref"', '"obs_ref"'))
    before = fingerprint(path)
    with pytest.raises(IncompatibleSnapshotError, match="obs_ref"):
        make("memmap", path, stream, capacity=16, mode="resume")
    assert fingerprint(path) == before


def test_an_older_looking_hdf5_file_that_lies_is_refused_by_from_hdf5(tmp_path):
    """``from_hdf5`` of a bigper HDF5 file whose record renames frame_ref to
    obs_ref (an older bigper's names over arrays that are not its): bigper's
    error naming the array, the file unchanged
    (tests/offline/test_older_bigper_h5.py opens a real one)."""
    import json

    import h5py

    stream = Stream(k=2, seed=7)
    path = tmp_path / "buf.h5"
    buf = make("hdf5", path, stream, capacity=16)
    feed(buf, stream, 20)
    buf.close()
    with h5py.File(path, "r+") as f:
        meta = json.loads(f["_bigper"].attrs["meta"])
        meta["arrays"]["obs_ref"] = meta["arrays"].pop("frame_ref")
        f.move("frame_ref", "obs_ref")
        f["_bigper"].attrs["meta"] = json.dumps(meta)
    before = fingerprint(path)
    with pytest.raises(bigper.errors.BigperError, match="obs_ref"):
        bigper.PrioritizedReplayBuffer.from_hdf5(path, priorities=tmp_path / "sidecar")
    assert fingerprint(path) == before
