"""Hostile tests of ``_check_newer``'s count checks (bigper/snapshot/_load.py)
against LEGIT closed buffers: a buffer bigper closed cleanly holding no more
transitions than the snapshot must be replaced by ``load`` (the rule in
``PrioritizedReplayBuffer.load``'s docstring), never refused for a count that
"does not say" or that its own status outnumbers.

Built for real (no record edited): a ring wrapped many times (count >>
capacity), num_envs > 1, n_step > 1 with windows pending at the snapshot,
sequence items (status per item, count per step), rank, raw and zstd frame
stacks, a zstd log capped by a compression_budget that releases segments, a
buffer loaded from the snapshot then closed untouched, a live path holding
an older buffer (fewer transitions) than a fork's snapshot, a buffer reopened
and closed empty; memmap and HDF5. And the converse: one step more after the
snapshot is still refused. No case found a false refusal when written.
(``reprioritize`` is only for ``from_hdf5`` buffers, which have no live path
to load into: not a case here.)
"""

from __future__ import annotations

import numpy as np
import pytest

import bigper
from bigper.errors import PathExistsError

P = bigper.PrioritizedReplayBuffer
SEQ = bigper.Sequence(length=4, burn_in=1)

KINDS = {
    "wrapped_12x": dict(cap=16, n=200),
    "nstep3_pending": dict(cap=16, n=40, n_step=3),
    "envs3_nstep2": dict(cap=18, n=30, num_envs=3, n_step=2),
    "rank_wrapped": dict(cap=16, n=50, prioritization="rank"),
    "sequence": dict(cap=32, n=50, sequence=SEQ),
    "sequence_envs2": dict(cap=32, n=50, num_envs=2, sequence=SEQ),
    "frames_raw": dict(cap=32, n=70, frame_stack=4),
    "frames_zstd": dict(cap=32, n=70, frame_stack=4, compression="zstd"),
    "frames_zstd_budget": dict(cap=64, n=300, frame_stack=4, compression="zstd", compression_budget=30),
    "frames_zstd_sequence": dict(cap=32, n=70, frame_stack=4, compression="zstd", sequence=SEQ),
}


def _step(buf, i, fs, ne):
    o = np.full((fs, 4, 4) if fs else (4, 4), i % 7, np.uint8)
    kw = dict(obs=o, reward=np.float32(i), next_obs=o, terminated=(i % 9 == 8), truncated=False)
    if ne > 1:
        kw = {k: np.stack([np.asarray(v)] * ne) for k, v in kw.items()}
    buf.add(**kw)


def _build(root, kind, storage):
    k = dict(KINDS[kind])
    cap, n = k.pop("cap"), k.pop("n")
    fs, ne = k.get("frame_stack"), k.get("num_envs", 1)
    path = root / ("live.h5" if storage == "hdf5" else "live")
    fields = {"obs": ((fs, 4, 4) if fs else (4, 4), np.uint8), "reward": ((), np.float32)}
    buf = P(cap, fields, storage=storage, path=path, **k)
    for i in range(n):
        _step(buf, i, fs, ne)
    return buf, path, fs, ne


def _loads(snap, path, expect_len):
    b = P.load(snap, path=path)
    try:
        assert len(b) == expect_len
        assert b.state_dict()[0]["count"] >= expect_len
    finally:
        b.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_closed_at_the_snapshot_is_replaced(tmp_path, kind, storage):
    buf, path, _, _ = _build(tmp_path, kind, storage)
    snap = buf.save(tmp_path / "snap")
    n = len(buf)
    buf.close()
    _loads(snap, path, n)


@pytest.mark.parametrize("kind", ["wrapped_12x", "envs3_nstep2", "sequence_envs2", "frames_zstd_budget"])
def test_loaded_then_closed_untouched_is_replaced(tmp_path, kind):
    buf, path, _, _ = _build(tmp_path, kind, "memmap")
    snap = buf.save(tmp_path / "snap")
    n = len(buf)
    buf.close()
    P.load(snap).close()  # ends the open episodes: pending windows/items go live, count unchanged
    _loads(snap, path, n)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("kind", ["wrapped_12x", "nstep3_pending", "sequence", "frames_zstd_budget"])
def test_an_older_buffer_under_a_forks_newer_snapshot_is_replaced(tmp_path, kind, storage):
    buf, path, fs, ne = _build(tmp_path, kind, storage)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    fork = P.load(snap, path=tmp_path / ("p2.h5" if storage == "hdf5" else "p2"))
    for i in range(5):
        _step(fork, 1000 + i, fs, ne)
    n = len(fork)
    snap2 = fork.save(tmp_path / "snap2")
    fork.close()
    _loads(snap2, path, n)  # held < snapshot count: replaced


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_reopened_and_closed_empty_is_replaced(tmp_path, storage):
    path = tmp_path / ("l.h5" if storage == "hdf5" else "l")
    b = P(16, {"x": ((2,), np.float32)}, storage=storage, path=path)
    for _ in range(5):
        b.add(x=np.zeros(2, np.float32))
    snap = b.save(tmp_path / "snap")
    b.close()
    P(16, {"x": ((2,), np.float32)}, storage=storage, path=path, mode="resume").close()
    P(16, {"x": ((2,), np.float32)}, storage=storage, path=path, mode="overwrite").close()
    _loads(snap, path, 5)


@pytest.mark.parametrize("kind", ["wrapped_12x", "sequence_envs2", "frames_zstd_budget"])
def test_one_step_more_since_is_still_refused(tmp_path, kind):
    buf, path, fs, ne = _build(tmp_path, kind, "memmap")
    snap = buf.save(tmp_path / "snap")
    _step(buf, 5000, fs, ne)
    buf.close()
    with pytest.raises(PathExistsError, match="rewind=True"):
        P.load(snap, path=path)
    P.load(snap, path=path, rewind=True).close()
