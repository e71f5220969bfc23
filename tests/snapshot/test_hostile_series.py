"""Snapshots (the numbered series) touches only what it provably wrote
(promise 7): a user's folder named like a snapshot but holding no bigper
manifest is never deleted by retention, and a file or symlink named like the
next snapshot is stepped over, never a reason to stop saving."""

from __future__ import annotations

import os

import numpy as np

import bigper
from bigper import Snapshots

from tests._hostile_snapshot_cases import fingerprint


def small():
    buf = bigper.PrioritizedReplayBuffer(16, {"x": ((2,), np.float32)}, seed=0)
    for i in range(5):
        buf.add(x=np.full(2, i, np.float32))
    return buf


def test_retention_keeps_a_users_folder_named_like_a_snapshot(tmp_path):
    root = tmp_path / "snaps"
    mine = root / "snap-00000001"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (root / "snap-00000002").mkdir()  # empty, also not bigper's
    before = fingerprint(mine, root / "snap-00000002")
    snaps = Snapshots(root, keep=1)
    buf = small()
    for _ in range(3):
        snaps.save(buf)
    assert fingerprint(mine, root / "snap-00000002") == before
    assert [p.name for p in snaps.list()] == ["snap-00000005"]
    assert snaps.load_latest().capacity == 16


def test_a_file_or_symlink_named_like_the_next_snapshot_is_stepped_over(tmp_path):
    root = tmp_path / "snaps"
    snaps = Snapshots(root, keep=2)
    buf = small()
    first = snaps.save(buf)
    assert first.name == "snap-00000001"
    (root / "snap-00000002").write_text("a user's file")
    os.symlink(tmp_path, root / "snap-00000003")
    before = fingerprint(root / "snap-00000002", root / "snap-00000003")
    second = snaps.save(buf)
    third = snaps.save(buf)
    assert (second.name, third.name) == ("snap-00000004", "snap-00000005")
    assert fingerprint(root / "snap-00000002", root / "snap-00000003") == before
    assert [p.name for p in snaps.list()] == ["snap-00000004", "snap-00000005"]
    assert snaps.latest() == third


def test_a_users_entry_with_a_huge_number_neither_stops_nor_inflates_the_series(tmp_path):
    """Numbering went past *every* name that looks like a snapshot: one user
    folder ``snap-<240 digits>`` made the next name longer than a file name
    may be (raw ``OSError`` ENAMETOOLONG on every save from then on), and a
    user's ``snap-99999999`` pushed the series to nine digits. Numbers follow
    bigper's own snapshots; a name that is taken is stepped over."""
    root = tmp_path / "snaps"
    root.mkdir()
    huge = root / ("snap-" + "9" * 240)
    huge.mkdir()
    (huge / "notes.txt").write_text("mine")
    (root / "snap-99999999").write_text("a user's file")
    (root / "snap-00000002").mkdir()  # a user's empty folder
    before = fingerprint(huge, root / "snap-99999999", root / "snap-00000002")
    snaps = Snapshots(root, keep=2)
    buf = small()
    names = [snaps.save(buf).name for _ in range(4)]
    assert names == ["snap-00000001", "snap-00000003", "snap-00000004", "snap-00000005"]
    assert fingerprint(huge, root / "snap-99999999", root / "snap-00000002") == before
    assert [p.name for p in snaps.list()] == ["snap-00000004", "snap-00000005"]
    assert snaps.latest().name == "snap-00000005"
    assert len(snaps.load_latest()) == 5 and snaps.last_loaded.number == 5
