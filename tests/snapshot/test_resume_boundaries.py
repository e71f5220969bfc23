"""Resume the way users resume (issue 45, sections 1 and 2).

1. After ``load`` or ``mode="resume"`` the environment that was mid-episode
   is gone: each env's open episode ends at the resume point (truncated), so
   no n-step window, frame stack or sequence item joins it to the episode
   the environment starts next, unless the caller says the episode continues
   (``continue_episodes=True``). Checked against a plain Python reference of
   n-step windows, for every storage, vector envs, transitions and sequences.
2. A load never discards newer data: a live path holding a buffer closed
   with more transitions than the snapshot is refused unless ``rewind=True``,
   and a snapshot read from a copy of its run folder (a fork) loads into the
   copy's own live path, leaving the original's files byte for byte as they
   were, with the live path beside or inside the checkpoint folder.

Each case failed on the code before the change: the windows joined the two
sides (rewards 1 + 0.5 * 1 + 0.25 * 10), and the fork's load rewound the
original run's buffer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from bigper.errors import InvalidTypeError, PathExistsError
from tests import hook

F = {"obs": ((1,), np.float32), "reward": ((), np.float32)}
OLD, NEW = 1.0, 1000.0  # rewards of the two sides: a window that mixes them sums to >= 1000


def tree_digest(root: Path) -> dict:
    """Every file under ``root``: its bytes' sha256 (and every folder), to compare byte for byte."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root) + "/"] = "dir"
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:  # a test's own files
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# -- 1. the case, as a user wrote it ---------------------------------------------


def test_nstep_windows_end_at_the_resume_point(tmp_path):
    os.chdir(tmp_path)
    b = bigper.PrioritizedReplayBuffer(100, F, n_step=3, gamma=0.5, storage="memmap", path="live", seed=0)
    for t in range(5):  # an episode still open at the snapshot
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snap = b.save("snap")
    b.close()
    r = bigper.PrioritizedReplayBuffer.load(snap, path="resumed")
    for t in range(3):  # after the resumed process's env.reset(): a new episode
        r.add(obs=[100 + t], reward=10.0, next_obs=[101 + t], terminated=False)
    g = r.gather(np.arange(5))
    np.testing.assert_allclose(g["reward"], [1.75, 1.75, 1.75, 1.5, 1.0])
    np.testing.assert_array_equal(g["next_obs"].ravel(), [3, 4, 5, 5, 5])
    np.testing.assert_allclose(g["discount"], [0.125, 0.125, 0.125, 0.25, 0.5])  # truncated: bootstraps
    assert g["truncated"].tolist() == [False, False, True, True, True]  # windows that reach step 4
    assert (r.status[:5] == bigper.common.status.LIVE).all()  # their windows completed at the resume
    r.close()


def test_an_episode_that_goes_on_is_said_so(tmp_path):
    """The user who restored the environment too keeps one episode across the resume."""
    os.chdir(tmp_path)
    b = bigper.PrioritizedReplayBuffer(100, F, n_step=3, gamma=0.5, storage="memmap", path="live", seed=0)
    for t in range(5):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snap = b.save("snap")
    b.close()
    r = bigper.PrioritizedReplayBuffer.load(snap, path="resumed", continue_episodes=True)
    for t in range(5, 8):
        r.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    g = r.gather(np.arange(5))
    np.testing.assert_allclose(g["reward"], [1.75] * 5)
    np.testing.assert_array_equal(g["next_obs"].ravel(), [3, 4, 5, 6, 7])
    r.close()


def test_mode_resume_ends_the_open_episode_and_read_only_changes_nothing(tmp_path):
    os.chdir(tmp_path)
    b = bigper.PrioritizedReplayBuffer(100, F, n_step=2, gamma=0.5, storage="memmap", path="live", seed=0)
    for t in range(4):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    b.close()
    ro = bigper.PrioritizedReplayBuffer(100, F, n_step=2, gamma=0.5, storage="memmap", path="live",
                                        mode="resume", read_only=True)
    assert ro.status[3] == bigper.common.status.PENDING  # a reader looks at what is there
    ro.close()
    r = bigper.PrioritizedReplayBuffer(100, F, n_step=2, gamma=0.5, storage="memmap", path="live", mode="resume")
    r.add(obs=[50], reward=NEW, next_obs=[51], terminated=False)
    g = r.gather([3])
    assert g["reward"][0] == 1.0 and g["next_obs"][0, 0] == 4 and g["truncated"][0]
    r.close()
    # Recorded at close: the next resume sees the ended episode as the last one left it.
    r2 = bigper.PrioritizedReplayBuffer(100, F, n_step=2, gamma=0.5, storage="memmap", path="live", mode="resume")
    assert r2.gather([3])["reward"][0] == 1.0
    r2.close()


@pytest.mark.parametrize("value", [1, "yes", None, np.array([True])])
def test_continue_episodes_and_rewind_take_booleans_only(tmp_path, value):
    os.chdir(tmp_path)
    b = bigper.PrioritizedReplayBuffer(10, F, storage="memmap", path="live")
    b.add(obs=[0], reward=1.0, next_obs=[1], terminated=False)
    snap = b.save("snap")
    b.close()
    before = tree_digest(tmp_path)
    for kw in ("continue_episodes", "rewind"):
        with pytest.raises(InvalidTypeError, match=kw):
            bigper.PrioritizedReplayBuffer.load(snap, path="other", **{kw: value})
    with pytest.raises(InvalidTypeError, match="continue_episodes"):
        bigper.PrioritizedReplayBuffer(10, F, storage="memmap", path="live", mode="resume",
                                       continue_episodes=value)
    assert tree_digest(tmp_path) == before


# -- 1. the property: no window mixes the two sides ----------------------------------------


def reference_window(stream: list, i: int, n: int, k: int, gamma: float, cut: int | None) -> tuple:
    """(reward, next_obs, discount) of transition ``i`` of ``stream`` (rows of
    (obs, reward, next_obs, term, trunc) added round-robin over ``k`` envs),
    its window cut after row ``cut`` of its env (the resume point) when given."""
    total, m = 0.0, 0
    j = i
    while True:
        obs, rew, nxt, term, trunc = stream[j]
        total += gamma ** m * rew
        m += 1
        if term:
            return total, nxt, 0.0
        if trunc or m == n or (cut is not None and j == cut) or j + k >= len(stream):
            return total, nxt, gamma ** m
        j += k


def make_stream(ends: list, k: int, start: int, reward: float, side: int) -> list:
    rows = []
    for t, e in enumerate(ends):
        code = side * 100_000 + start + t
        rows.append(([float(code)], reward, [float(code) + 0.5], e == 1, e == 2))
    return rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 3), n=st.integers(1, 4), storage=st.sampled_from(["memory", "memmap", "hdf5"]),
       how=st.sampled_from(["load", "resume"]),
       old=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=14),
       new=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=14))
def test_no_window_mixes_the_two_sides_of_a_resume(tmp_path_factory, k, n, storage, how, old, new):
    if storage == "memory" and how == "resume":
        how = "load"  # a memory buffer resumes only from a snapshot
    tmp = tmp_path_factory.mktemp("side")
    gamma = 0.5
    old, new = old[:len(old) // k * k] or [0] * k, new[:len(new) // k * k] or [0] * k
    a_rows = make_stream(old, k, 0, OLD, 1)
    b_rows = make_stream(new, k, 0, NEW, 2)
    kw = dict(n_step=n, gamma=gamma, num_envs=k, storage=storage, seed=3)
    path = None if storage == "memory" else tmp / ("live.h5" if storage == "hdf5" else "live")
    buf = bigper.PrioritizedReplayBuffer(64, F, path=path, **kw)

    def add(b, rows):
        for lo in range(0, len(rows), k):
            chunk = rows[lo:lo + k]
            b.add(obs=np.array([r[0] for r in chunk], np.float32), reward=np.array([r[1] for r in chunk], np.float32),
                  next_obs=np.array([r[2] for r in chunk], np.float32), terminated=np.array([r[3] for r in chunk]),
                  truncated=np.array([r[4] for r in chunk]))

    add(buf, a_rows)
    if how == "load":
        snap = buf.save(tmp / "snap")
        buf.close()
        buf = bigper.PrioritizedReplayBuffer.load(snap, path=None if storage == "memory" else
                                                  tmp / ("resumed.h5" if storage == "hdf5" else "resumed"))
    else:
        buf.close()
        buf = bigper.PrioritizedReplayBuffer(64, F, path=path, mode="resume", **kw)
    add(buf, b_rows)
    stream = a_rows + b_rows
    live = np.flatnonzero(buf.status == bigper.common.status.LIVE)
    got = buf.gather(live)
    for row, slot in enumerate(live.tolist()):
        side_old = slot < len(a_rows)
        # the resume point of this transition's env: its last row before the resume
        cut = None
        if side_old:
            env = slot % k
            cut = max(j for j in range(env, len(a_rows), k))
        want = reference_window(stream, slot, n, k, gamma, cut)
        assert got["obs"][row, 0] == stream[slot][0][0]
        assert got["reward"][row] == pytest.approx(want[0]), (slot, side_old)
        assert got["next_obs"][row, 0] == want[1][0], (slot, side_old)
        assert got["discount"][row] == pytest.approx(want[2]), (slot, side_old)
        assert (got["reward"][row] < NEW) == side_old  # never a reward of the other side
    buf.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 2), length=st.integers(1, 4), period=st.integers(1, 3), burn_in=st.integers(0, 2),
       old=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=12),
       new=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=12),
       go_on=st.booleans())
def test_no_sequence_item_mixes_the_two_sides_of_a_resume(tmp_path_factory, k, length, period, burn_in, old, new,
                                                          go_on):
    period = min(period, length)
    tmp = tmp_path_factory.mktemp("seq")
    old, new = old[:len(old) // k * k] or [0] * k, new[:len(new) // k * k] or [0] * k
    seq = bigper.Sequence(length=length, burn_in=burn_in, period=period)
    kw = dict(num_envs=k, storage="memmap", seed=1, sequence=seq)
    buf = bigper.PrioritizedReplayBuffer(64, F, path=tmp / "live", **kw)

    def add(b, ends, side):
        for lo in range(0, len(ends), k):
            e = np.array(ends[lo:lo + k])
            code = np.array([[side * 100_000 + lo + j] for j in range(k)], np.float32)
            b.add(obs=code, reward=np.full(k, side, np.float32), next_obs=code + 0.5, terminated=e == 1,
                  truncated=e == 2)

    add(buf, old, 1)
    snap = buf.save(tmp / "snap")
    buf.close()
    buf = bigper.PrioritizedReplayBuffer.load(snap, path=tmp / "resumed", continue_episodes=go_on)
    add(buf, new, 2)
    items = hook.unit(buf).status  # item status, at each item's start step
    live = np.flatnonzero(items == bigper.common.status.LIVE)
    pending = np.flatnonzero(items == bigper.common.status.PENDING)
    if not go_on:  # every item of the old side is complete: none waits for steps of the new one
        assert not any(s < len(old) for s in pending.tolist())
    if live.size:
        got = buf.gather(live)
        sides = np.where(got["mask"], got["reward"], 0)
        for row in range(live.size):
            seen = set(sides[row][got["mask"][row]].tolist())
            assert len(seen) == 1 or go_on, (live[row], seen)
    buf.close()


# -- 2. a load never discards newer data; a fork gets its own path --------------------------


def run_folder(tmp_path: Path, storage: str, live_rel: str, snap_rel: str) -> Path:
    """A run folder: live data at ``live_rel``, a snapshot at ``snap_rel``,
    then more transitions and a clean close (the live data is newer)."""
    run = tmp_path / "run"
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=run / live_rel, seed=0)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=t % 4 == 3)
    b.save(run / snap_rel)
    for t in range(10, 15):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    b.close()
    return run


@pytest.mark.parametrize("storage,live_rel", [("memmap", "replay"), ("memmap", "ckpt/replay"),
                                              ("hdf5", "replay.h5"), ("hdf5", "ckpt/replay.h5")])
def test_a_fork_of_a_run_folder_never_touches_the_original(tmp_path, storage, live_rel):
    run = run_folder(tmp_path, storage, live_rel, "ckpt/snaps/snap-00000001")
    fork = tmp_path / "fork"
    subprocess.run(["cp", "-a", str(run), str(fork)], check=True)
    before = tree_digest(run)
    snap = fork / "ckpt/snaps/snap-00000001"
    # The fork's copy of the live data holds 15, newer than the snapshot's 10: kept unless asked.
    fork_before = tree_digest(fork)
    with pytest.raises(PathExistsError, match="rewind=True"):
        bigper.PrioritizedReplayBuffer.load(snap)
    assert tree_digest(fork) == fork_before
    b = bigper.PrioritizedReplayBuffer.load(snap, rewind=True)
    assert Path(b.storage.path) == fork / live_rel  # the fork's own live path
    assert len(b) == 10
    b.add(obs=[99], reward=1.0, next_obs=[100], terminated=False)
    b.close()
    assert tree_digest(run) == before  # the original, byte for byte
    # Loading the original's own snapshot where it was written: its live path, refused as newer.
    with pytest.raises(PathExistsError, match="15 transitions"):
        bigper.PrioritizedReplayBuffer.load(run / "ckpt/snaps/snap-00000001")
    assert tree_digest(run) == before


def test_a_fork_whose_live_folder_was_not_copied_gets_a_fresh_one(tmp_path):
    run = run_folder(tmp_path, "memmap", "replay", "ckpt/snap-00000001")
    fork = tmp_path / "fork"
    shutil.copytree(run / "ckpt", fork / "ckpt")  # only the checkpoints
    before = tree_digest(run)
    b = bigper.PrioritizedReplayBuffer.load(fork / "ckpt/snap-00000001")
    assert Path(b.storage.path) == fork / "replay" and len(b) == 10
    b.close()
    assert tree_digest(run) == before


def test_a_live_path_holding_fewer_or_a_crashed_writers_data_is_replaced(tmp_path):
    os.chdir(tmp_path)
    b = bigper.PrioritizedReplayBuffer(50, F, storage="memmap", path="live", seed=0)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snap = b.save("snap")
    b.close()
    other = bigper.PrioritizedReplayBuffer(50, F, storage="memmap", path="other", seed=0)
    for t in range(4):
        other.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    other.close()
    r = bigper.PrioritizedReplayBuffer.load(snap, path="other")  # 4 < 10: nothing newer is lost
    assert len(r) == 10
    r.close()
