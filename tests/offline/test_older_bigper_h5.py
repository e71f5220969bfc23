"""An older bigper's HDF5 file keeps opening (issue 43 section 2).

``tests/data/live-v1-refs64-zstd.h5`` is a compressed buffer an older bigper
(23b6758) wrote with ``storage="hdf5"`` and closed: its frame references
whole (``obs_ref``, ``next_obs_ref``, int64 x 4), a few of them further
apart than the uint8 offsets of 3 envs hold (an env on one static frame).
``from_hdf5`` opens it read-only with the references converted in memory
(the file's bytes unchanged: hashed) and samples what the older bigper
sampled. Old arrays that lie (outside the frames stored, another dtype or
shape, missing) are refused with bigper's error, the file unchanged.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import bigper
from bigper.errors import BigperError, CorruptSnapshotError, OfflineDatasetError

from tests._hostile_snapshot_cases import deadline
from tests.storage.test_older_live import same_batches, same_far

DATA = Path(__file__).resolve().parents[1] / "data"
NAME = "live-v1-refs64-zstd"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy(tmp_path: Path) -> Path:
    dst = tmp_path / f"{NAME}.h5"
    shutil.copyfile(DATA / f"{NAME}.h5", dst)
    return dst


def test_from_hdf5_of_an_older_bigper_file_converts_its_references_in_memory(tmp_path):
    want = json.loads((DATA / f"{NAME}.expected.json").read_text())
    path = copy(tmp_path)
    before, listing = sha(path), sorted(p.name for p in tmp_path.iterdir())
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(path, priorities=tmp_path / "sidecar")
    assert len(ds) == want["len"] and ds.total_priority == want["total_priority"]
    assert want["far"]["slots"], "the fixture holds references further apart than uint8 offsets"
    same_far(ds, want["far"])
    same_batches(ds, want["batches"])
    ds.close()
    assert sha(path) == before  # not a byte of the file changed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(listing + ["sidecar"])
    with h5py.File(path, "r") as f:  # (and what it holds is still the older format)
        assert "obs_ref" in f and "frame_ref" not in f


def _lie(tmp_path: Path, change) -> Path:
    path = copy(tmp_path)
    with h5py.File(path, "r+") as f:
        meta = json.loads(f["_bigper"].attrs["meta"])
        change(f, meta)
        f["_bigper"].attrs["meta"] = json.dumps(meta)
    return path


def _refused(path: Path, exc, match: str) -> None:
    before = sha(path)
    with deadline():
        with pytest.raises(exc, match=match):
            bigper.PrioritizedReplayBuffer.from_hdf5(path, priorities=path.with_name("sidecar"))
    assert sha(path) == before


def _live_slot(f) -> int:
    return int(np.flatnonzero(f["_bigper/state/status"][()] == 1)[5])


@pytest.mark.parametrize("value", ["past", "negative"])
def test_older_references_outside_the_frames_stored_are_refused_naming_the_slot(value, tmp_path):
    slot = []

    def change(f, meta):
        s = _live_slot(f)
        slot.append(s)
        fw = meta["state"]["frames"]["fw"]
        row = f["next_obs_ref"][s]
        row[-1] = fw if value == "past" else -2
        f["next_obs_ref"][s] = row
    path = _lie(tmp_path, change)
    _refused(path, CorruptSnapshotError, f"slot {slot[0]}")


@pytest.mark.parametrize("what", ["dtype", "shape", "missing"])
def test_older_reference_arrays_of_another_layout_are_refused(what, tmp_path):
    def change(f, meta):
        old = f["obs_ref"][()]
        del f["obs_ref"]
        rec = meta["arrays"]["obs_ref"]
        if what == "dtype":
            f.create_dataset("obs_ref", data=old.astype(np.int32))
            rec["dtype"] = "<i4"
        elif what == "shape":
            f.create_dataset("obs_ref", data=old[:, :3])
            rec["shape"] = [3]
        else:
            meta["arrays"].pop("obs_ref")
    path = _lie(tmp_path, change)
    _refused(path, BigperError, "obs_ref")


def test_an_older_files_recorded_oldest_references_are_checked_then_derived(tmp_path):
    """The older format recorded each slot's oldest frame (``frames_minref``):
    read from disk, it is checked like any state array (a live slot's frames
    said to be gone: refused), then derived from the references, so a lie
    that passes the check changes nothing read."""
    want = json.loads((DATA / f"{NAME}.expected.json").read_text())

    def lie(value):
        def change(f, meta):
            m = f["_bigper/state/frames_minref"][()]
            m[_live_slot(f)] = value
            f["_bigper/state/frames_minref"][...] = m
        return change
    (tmp_path / "a").mkdir()
    _refused(_lie(tmp_path / "a", lie(-7)), CorruptSnapshotError, "frames_minref")
    path = _lie(tmp_path, lie(200))  # (a frame still stored, not the slot's oldest)
    before = sha(path)
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(path, priorities=tmp_path / "sidecar")
    same_batches(ds, want["batches"])
    ds.close()
    assert sha(path) == before
