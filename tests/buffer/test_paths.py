"""Paths are resolved once, when a buffer opens (promise 11): a later
``os.chdir`` (notebooks, launchers and job scripts do it), with or without a
same-named folder at the new working directory, never redirects a write, a
save or a close; the other folder stays byte for byte as it was."""

from __future__ import annotations

import os

import numpy as np
import pytest

import bigper
from tests._hostile_snapshot_cases import fingerprint
from tests._storage_cases import AGENT_FIELDS

KINDS = ("memory", "memmap", "hdf5")
CAP = 64


def _name(kind):
    return None if kind == "memory" else ("replay.h5" if kind == "hdf5" else "replay")


def _open(kind, name, mode="new"):
    kw = {} if kind == "memory" else {"path": name, "mode": mode}
    return bigper.PrioritizedReplayBuffer(CAP, AGENT_FIELDS, storage=kind, seed=0, **kw)


def _add(buf, n, base):
    for i in range(n):
        v = np.float32(base + i)
        buf.add(obs=np.full(3, v, np.float32), reward=v, next_obs=np.full(3, v + 1, np.float32))


def _rewards(buf):
    """The rewards the buffer holds, sorted (what was added, wherever it lives)."""
    return np.sort(np.asarray(buf.storage.read("reward", np.arange(len(buf)))))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("other_has_one", [True, False], ids=["same-named-folder", "empty-folder"])
@pytest.mark.parametrize("op", ["close", "save", "add", "sample"])
def test_chdir_after_open_never_redirects_a_write(kind, other_has_one, op, tmp_path, monkeypatch):
    run1, run2, snaps = tmp_path / "run1", tmp_path / "run2", tmp_path / "snaps"
    for d in (run1, run2, snaps):
        d.mkdir()
    name = _name(kind)
    if other_has_one and kind != "memory":  # another run's buffer under the same relative name
        monkeypatch.chdir(run2)
        with _open(kind, name) as other:
            _add(other, 40, 1000)
    before = fingerprint(run2)

    monkeypatch.chdir(run1)
    buf = _open(kind, name)
    _add(buf, 10, 0)
    monkeypatch.chdir(run2)  # the job script moves on to the other run's folder
    if op == "add":
        _add(buf, 5, 10)
    elif op == "sample":
        batch = buf.sample(8)
        buf.update_priorities(batch, np.full(8, 0.5))
    elif op == "save":
        buf.save(snaps / "s")
    n = len(buf)
    buf.close()

    assert fingerprint(run2) == before  # the other run's folder: not one byte changed
    want = np.arange(n, dtype=np.float32)
    if op == "save":  # the snapshot holds this run's data, not the other run's
        with bigper.PrioritizedReplayBuffer.load(snaps / "s", path=tmp_path / "restored" / (name or "x")
                                                 if kind != "memory" else None) as back:
            assert len(back) == 10
            np.testing.assert_array_equal(_rewards(back), want)
    if kind != "memory":
        monkeypatch.chdir(run1)  # this run's buffer was closed cleanly where it was opened
        with _open(kind, name, mode="resume") as again:
            assert again.resumed == n
            np.testing.assert_array_equal(_rewards(again), want)


@pytest.mark.parametrize("kind", ("memmap", "hdf5"))
def test_the_recorded_path_of_a_snapshot_is_the_one_opened(kind, tmp_path, monkeypatch):
    """A snapshot records where its live data was (for ``load(path=None)``): the
    folder the buffer opened, whatever the working directory at ``save``."""
    (tmp_path / "run1").mkdir()
    (tmp_path / "run2").mkdir()
    monkeypatch.chdir(tmp_path / "run1")
    with _open(kind, _name(kind)) as buf:
        _add(buf, 6, 0)
        monkeypatch.chdir(tmp_path / "run2")
        buf.save(tmp_path / "snap")
    from bigper.snapshot.manifest import read_manifest

    recorded = read_manifest(tmp_path / "snap")["storage"]["path"]
    assert recorded == str(tmp_path / "run1" / _name(kind))


@pytest.mark.parametrize("kind", ("memmap", "hdf5"))
def test_a_folder_renamed_under_an_open_buffer_keeps_its_writes(kind, tmp_path):
    """The folder is held by a descriptor from open: when a launcher moves the
    run away and makes a new run under the old name (with a buffer of its
    own there), adds, a snapshot and close still go to the folder that was
    opened, and the newcomer's files stay byte for byte as they were."""
    run, moved = tmp_path / "run", tmp_path / "run-moved"
    run.mkdir()
    buf = _open(kind, run / _name(kind))
    _add(buf, 10, 0)
    os.rename(run, moved)
    run.mkdir()
    with _open(kind, run / _name(kind)) as other:
        _add(other, 40, 1000)
    before = fingerprint(run)
    _add(buf, 5, 10)
    buf.save(tmp_path / "snap")
    buf.close()
    assert fingerprint(run) == before
    want = np.arange(15, dtype=np.float32)
    with _open(kind, moved / _name(kind), mode="resume") as again:
        assert again.resumed == 15
        np.testing.assert_array_equal(_rewards(again), want)
    with bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "back" / _name(kind)) as back:
        np.testing.assert_array_equal(_rewards(back), want)
