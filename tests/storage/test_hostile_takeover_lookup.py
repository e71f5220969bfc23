"""Attacks on a snapshot load's takeover of a live memmap folder (``MemmapStorage._own_previous``):
data/ as a FIFO, a link to another folder, a regular file, a folder of junk; chunk names with huge
indices; ``.cow`` leftovers beyond the record; meta.json rows/chunk_rows absurd. Each load takes
over or refuses with a BigperError, never hangs, and never deletes what bigper did not write."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import bigper
from bigper.errors import BigperError

from tests._hostile_snapshot_cases import deadline, fingerprint

FIELDS = {"obs": ((2,), np.float32)}


def _live(tmp_path):
    live = tmp_path / "live"
    with bigper.PrioritizedReplayBuffer(8, FIELDS, storage="memmap", path=live,
                                        storage_options={"chunk_bytes": 16}) as buf:
        for i in range(5):
            buf.add(obs=np.full(2, i, np.float32), next_obs=np.full(2, i + 1, np.float32))
        buf.save(tmp_path / "snap")
        want = buf.sample(4)
    return live, want


def _load(tmp_path, live, want):
    with deadline(10):
        try:
            back = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=live)
        except BigperError:
            return False
    try:
        got = back.sample(4)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got["obs"], want["obs"])
    finally:
        back.close()
    return True


@pytest.mark.parametrize("kind", ["fifo", "link", "file", "junk"])
def test_a_strange_data_entry_is_taken_over_or_refused_and_nothing_foreign_goes(kind, tmp_path):
    live, want = _live(tmp_path)
    data = live / "data"
    other = tmp_path / "other"
    other.mkdir()
    (other / "obs.0.bin").write_bytes(b"users")
    (other / "keep.txt").write_bytes(b"mine")
    if kind != "junk":
        shutil.rmtree(data)
    if kind == "fifo":
        os.mkfifo(data)
    elif kind == "link":
        os.symlink(other, data)
    elif kind == "file":
        data.write_bytes(b"a user's file named data")
    else:
        for i in range(3000):
            (data / f"junk{i}.bin").write_bytes(b"")
        (data / "obs.999999999999.bin").write_bytes(b"x")
        (data / "obs.00.bin").write_bytes(b"y")
    foreign = fingerprint(other)
    before = fingerprint(live)
    took = _load(tmp_path, live, want)
    assert fingerprint(other) == foreign
    if not took:
        assert fingerprint(live) == before
    elif kind == "junk":  # the user's junk is not bigper's
        assert (data / "junk2999.bin").exists() and (data / "obs.999999999999.bin").exists()
        assert (data / "obs.00.bin").exists()


def test_cow_leftovers_beyond_the_record_are_not_bigpers(tmp_path):
    live, want = _live(tmp_path)
    data = live / "data"
    (data / "obs.999.bin.cow").write_bytes(b"z")
    (data / "obs.999999999999.bin.cow").write_bytes(b"z")
    took = _load(tmp_path, live, want)
    if took:
        assert (data / "obs.999.bin.cow").exists() and (data / "obs.999999999999.bin.cow").exists()


@pytest.mark.parametrize("rows,chunk_rows", [
    (2**63 - 1, 1), (2**63 - 1, 2**63 - 1), (-1, 1), (5, 0), (5, -3), (0, 1), (5.5, 1), ("5", 1),
    (5, "1"), (None, 1), (True, 1), (2**64, 1), (5, 1e308), (float("nan"), 1),
])
def test_absurd_record_numbers_take_over_or_refuse(rows, chunk_rows, tmp_path):
    live, want = _live(tmp_path)
    meta = json.loads((live / "meta.json").read_text())
    meta["arrays"]["obs"] = {**meta["arrays"]["obs"], "rows": rows, "chunk_rows": chunk_rows}
    (live / "meta.json").write_text(json.dumps(meta))
    other = tmp_path / "data_keep"
    other.mkdir()
    (live / "data" / "notmine.txt").write_bytes(b"mine")
    _load(tmp_path, live, want)
    assert (live / "data" / "notmine.txt").read_bytes() == b"mine"
