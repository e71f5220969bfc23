"""bigper convert of a DQN Replay run (Dopamine's replay checkpoints) into one zstd dataset.

The run directories are written from real ALE play, recorded and saved the way
the format records and saves them (tests/offline/_dqn_replay_files.py), and
every transition of the converted dataset, and every sampled stack, is held
equal to a reference built from the same files by the format's rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.convert_dqn import convert_dqn_replay
from bigper.errors import PathExistsError
from bigper.offline.dqn_replay import scan_run

from tests._child import Child
from tests._hostile_snapshot_cases import fingerprint
from tests.offline._dqn_replay_files import K, Recorder, logged_run, play, reference

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """batch_rl's logged run of Breakout: three full laps of 1,000 slots and the final partial one."""
    run = tmp_path_factory.mktemp("logged") / "run"
    logged_run(run, "Breakout", capacity=1000, checkpoints=3, seed=0, max_len=150)
    return run


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """Pong checkpoints saved at any cursor (the ring wraps inside each), update_horizon 3,
    and short episodes (an episode start every few dozen slots)."""
    run = tmp_path_factory.mktemp("wrapped") / "run"
    frames, act, rew, ends = play("Pong", 2400, seed=1, max_len=37)
    rec = Recorder(700, horizon=3)
    saves = {1000: 0, 1733: 1, 2100: 2, 2399: 3}
    for t in range(frames.shape[0]):
        rec.add(frames[t], act[t], rew[t], ends[t])
        if t in saves:
            rec.save(run, saves[t])
    return run


def references(run: Path) -> dict:
    refs = [reference(run, ck.n) for ck in scan_run(run)]
    return {k: np.concatenate([r[k] for r in refs]) for k in refs[0]}


def assert_equals_reference(dst: Path, run: Path, samples: int = 8) -> dict:
    ref = references(run)
    n = ref["action"].shape[0]
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        assert len(ds) == n
        live = np.flatnonzero(ds.status == 1)
        assert (live == np.arange(n)).all()  # slot i holds the i-th transition added
        got = ds.gather(np.arange(n))
        for mine, theirs in (("obs", "obs"), ("next_obs", "next_obs"), ("action", "action"),
                             ("reward", "reward"), ("terminated", "terminal")):
            assert got[mine].dtype == ref[theirs].dtype, mine
            assert got[mine].tobytes() == ref[theirs].tobytes(), mine
        for _ in range(samples):
            b = ds.sample(64)
            for mine, theirs in (("obs", "obs"), ("next_obs", "next_obs"), ("action", "action"),
                                 ("terminated", "terminal")):
                np.testing.assert_array_equal(b[mine], ref[theirs][b.indices])
            np.testing.assert_array_equal(b["reward"], ref["reward"][b.indices])
            np.testing.assert_array_equal(b["discount"], np.where(ref["terminal"][b.indices], 0.0, 0.99).astype(b["discount"].dtype))
        frames_written = ds.state_dict()[0]["frames"]["fw"]
    return {"n": n, "got": got, "frames": frames_written}


def test_a_logged_run_converts_to_exactly_the_formats_transitions(logged, tmp_path):
    before = fingerprint(logged)
    dst = tmp_path / "out" / "breakout.h5"
    r = convert_dqn_replay(logged, dst, progress=False, workers=2)
    assert fingerprint(logged) == before  # the run is never written
    res = assert_equals_reference(dst, logged)
    assert r["transitions"] == res["n"] and r["checkpoints"] == 4 and r["resumed_after"] == 0
    # each frame once: one a transition, a few more at each episode start (its pads)
    assert res["frames"] < res["n"] * 1.1
    assert sorted(os.listdir(dst.parent)) == ["breakout.h5"]  # no work directory, no partial file left


def test_episode_boundaries_are_the_formats(logged, tmp_path):
    """terminated where the slot is terminal; truncated (bootstrap kept) on the last
    transition before any slot that is not sampleable; no other end."""
    dst = tmp_path / "b.h5"
    convert_dqn_replay(logged, dst, progress=False)
    got = assert_equals_reference(dst, logged, samples=1)["got"]
    n = got["action"].shape[0]
    ends = np.flatnonzero(got["terminated"] | got["truncated"])
    assert not (got["terminated"] & got["truncated"]).any()
    # every episode's next transition starts from zero pads (a new episode), or a new checkpoint
    nxt = ends[ends + 1 < n] + 1
    starts_padded = (got["obs"][nxt][:, :K - 1] == 0).all(axis=(1, 2, 3))
    assert starts_padded.sum() >= len(nxt) - 4  # (a checkpoint's first transition need not start an episode)
    # inside an episode each stack continues the last: next_obs[i] == obs[i+1]
    inside = np.setdiff1d(np.arange(n - 1), ends)
    assert (got["next_obs"][inside] == got["obs"][inside + 1]).all()


def test_wrapped_checkpoints_a_longer_horizon_and_short_episodes(wrapped, tmp_path):
    cks = scan_run(wrapped)
    assert [ck.horizon for ck in cks] == [3] * 4 and all(ck.full and ck.cursor > 0 for ck in cks)
    dst = tmp_path / "pong.h5"
    r = convert_dqn_replay(wrapped, dst, progress=False, workers=1, chunk=50)
    res = assert_equals_reference(dst, wrapped)
    assert r["transitions"] == res["n"]


def test_the_cli_converts_and_every_reader_opens_the_file(logged, tmp_path):
    dst = tmp_path / "b.h5"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "bigper", *map(str, a)], capture_output=True,  # noqa: E731
                                    text=True, env=env, timeout=300)
    r = run("convert", logged, dst, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "DQN Replay checkpoints" in r.stdout and "/s" in r.stdout
    assert run("verify", dst).returncode == 0
    info = run("info", dst)
    assert info.returncode == 0 and "zstd" in info.stdout
    again = run("convert", logged, dst, "--no-progress", "--layout", "dqn-replay")
    assert again.returncode == 2 and "exists" in again.stderr
    bad = run("convert", logged, tmp_path / "c.h5", "--budget", "100")
    assert bad.returncode == 2 and "--budget" in bad.stderr and not os.path.lexists(tmp_path / "c.h5")
    # and a converted file converts again (HDF5 into HDF5), transition for transition
    from bigper.convert import convert
    convert(dst, tmp_path / "again.h5", progress=False)
    assert_equals_reference(tmp_path / "again.h5", logged, samples=1)


# A convert in a child interpreter, killed with SIGKILL while it writes checkpoint 2
# (checkpoints 0 and 1 finished and snapshotted), or once all are done while it copies
# the buffer into the HDF5 file.
KILLED = """
import sys, time
import bigper.convert_dqn as c
point = sys.argv[3]
def stop():
    print("at", point, flush=True)
    time.sleep(3600)
if point == "checkpoint":
    saves, extend = [], c.PrioritizedReplayBuffer.extend
    save = c.Snapshots.save
    def counted(self, *a, **k):
        out = save(self, *a, **k)
        saves.append(1)
        return out
    def slow(self, *a, **k):
        out = extend(self, *a, **k)
        if len(saves) == 2:
            stop()
        return out
    c.Snapshots.save, c.PrioritizedReplayBuffer.extend = counted, slow
else:  # the HDF5 file made and half written
    write, calls = c.HDF5Storage.write, []
    def half(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            stop()
        return write(self, *a, **k)
    c.HDF5Storage.write = half
c.convert_dqn_replay(sys.argv[1], sys.argv[2], progress=False, chunk=100)
"""


@pytest.mark.parametrize("point,done", [("checkpoint", 2), ("copy", 4)])
def test_kill_9_midway_resumes_after_the_last_finished_checkpoint(point, done, logged, tmp_path):
    dst = tmp_path / "b.h5"
    before = fingerprint(logged)
    with Child(KILLED, logged, dst, point) as child:
        child.said(f"at {point}")
        child.kill()
    assert not os.path.lexists(dst)
    assert os.path.isdir(f"{dst}.partial.d")
    r = convert_dqn_replay(logged, dst, progress=False)
    assert r["resumed_after"] == done
    assert_equals_reference(dst, logged)
    assert fingerprint(logged) == before
    # (the lock file the killed process made stays: nothing proves whose it is, as for convert)
    assert sorted(os.listdir(tmp_path)) == ["b.h5", "b.h5.lock"]


def test_work_of_another_run_is_refused_unless_restart(logged, wrapped, tmp_path):
    dst = tmp_path / "b.h5"
    with Child(KILLED, logged, dst, "checkpoint") as child:
        child.said("at checkpoint")
        child.kill()
    held = fingerprint(f"{dst}.partial.d")  # (b.h5.lock, the dead child's, gets the pid of the next holder)
    with pytest.raises(PathExistsError, match=r"b\.h5\.partial\.d .*another run"):
        convert_dqn_replay(wrapped, dst, progress=False)
    assert fingerprint(f"{dst}.partial.d") == held and not os.path.lexists(dst)
    r = convert_dqn_replay(wrapped, dst, progress=False, restart=True)
    assert r["resumed_after"] == 0
    assert_equals_reference(dst, wrapped, samples=1)


def test_a_folder_at_the_work_path_that_is_not_converts_is_left_alone(logged, tmp_path):
    dst = tmp_path / "b.h5"
    (tmp_path / "b.h5.partial.d").mkdir()
    (tmp_path / "b.h5.partial.d" / "mine.txt").write_text("mine")
    held = fingerprint(tmp_path)
    for restart in (False, True):
        with pytest.raises(PathExistsError, match="not convert's"):
            convert_dqn_replay(logged, dst, progress=False, restart=restart)
        assert fingerprint(tmp_path) == held


def test_the_python_call_checks_its_arguments(logged, tmp_path):
    held = fingerprint(tmp_path)
    for kw in ({"frame_stack": 0}, {"workers": 0}, {"chunk": True}, {"progress": 1}, {"restart": "no"}):
        with pytest.raises((bigper.InvalidArgumentError, bigper.InvalidTypeError), match=next(iter(kw))):
            convert_dqn_replay(logged, tmp_path / "b.h5", **kw)
    with pytest.raises(bigper.InvalidArgumentError, match="inside run_dir"):
        convert_dqn_replay(logged, logged / "b.h5", progress=False)
    assert fingerprint(tmp_path) == held


def test_an_overwrite_of_a_dst_open_in_a_reader_is_refused_before_the_work(logged, tmp_path):
    """(offline/publish.py ``refuse_open``, as convert's: before, convert_dqn found the reader
    only at its publish, after the whole conversion.) The refusal leaves the folder as it was
    (no partial, no work folder); once the reader closes, the overwrite goes through."""
    dst = tmp_path / "out" / "breakout.h5"
    convert_dqn_replay(logged, dst, progress=False, workers=1)
    reader = bigper.PrioritizedReplayBuffer.from_hdf5(dst)
    try:
        before = fingerprint(dst.parent)
        with pytest.raises(bigper.errors.StorageLockedError, match="open in a buffer or another HDF5 reader"):
            convert_dqn_replay(logged, dst, overwrite=True, progress=False, workers=1)
        assert fingerprint(dst.parent) == before
        assert len(reader.sample(4).indices) == 4  # (the reader reads on)
    finally:
        reader.close()
    r = convert_dqn_replay(logged, dst, overwrite=True, progress=False, workers=1)
    assert r["resumed_after"] == 0
    assert sorted(os.listdir(dst.parent)) == ["breakout.h5"]
    assert_equals_reference(dst, logged)
