"""Hostile tests of the resume rules (promise 18): the open episode ending at
``load`` / ``mode="resume"`` (``Writer.end_episodes``, ``Items.end``), the
``continue_episodes`` and ``rewind`` flags, and forks of a run folder
(``snapshot._load.counterpart`` / ``default_live_path`` / ``_check_newer``).

A case that holds is a plain test; a case that shows a bug is
``xfail(strict=True)`` with the bug in its reason.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import threading
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import cli
from bigper.errors import (
    BigperError,
    InvalidArgumentError,
    InvalidTypeError,
    PathExistsError,
    StorageLockedError,
)
from tests import hook
from tests._hostile_snapshot_cases import deadline, fingerprint, resign

LIVE, PENDING = bigper.common.status.LIVE, bigper.common.status.PENDING
F = {"obs": ((1,), np.float32), "reward": ((), np.float32)}
load = bigper.PrioritizedReplayBuffer.load


def verify(path) -> int:
    """``bigper verify PATH``'s exit status, in process (its output swallowed)."""
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return cli.main(["verify", str(path)])


def same_state(a, b) -> bool:
    ma, aa = a
    mb, ab = b
    return ma == mb and sorted(aa) == sorted(ab) and all(
        aa[k].dtype == ab[k].dtype and np.array_equal(aa[k], ab[k]) for k in aa)


def copy_state(buf):
    meta, arrays = buf.state_dict()
    return meta, {k: np.array(v) for k, v in arrays.items()}


# -- a stream of rows with a reference of what was added ----------------------------------


class Rows:
    """Rows of ``E`` envs (round robin), each env a stream of episodes whose
    frame stacks continue (``k`` frames) or single frames; ``rows[g]`` is what
    the g-th transition was given."""

    def __init__(self, E=1, k=None, frame=(3, 3), seed=0, p_end=0.25, autoreset=False):
        self.rng = np.random.default_rng(seed)
        self.E, self.k, self.frame, self.p_end, self.autoreset = E, k, frame, p_end, autoreset
        self.stack = [None] * E
        self.reset_next = [False] * E
        self.rows: list = []

    def fields(self):
        return {"obs": ((self.k, *self.frame) if self.k else self.frame, np.uint8),
                "reward": ((), np.float32)}

    def _frame(self):
        return self.rng.integers(0, 256, self.frame, dtype=np.uint8)

    def step(self, open_end=False):
        """One step of every env; ``open_end``: no episode ends in it."""
        out = {n: [] for n in ("obs", "next_obs", "reward", "terminated", "truncated", "valid")}
        for e in range(self.E):
            valid = True
            if self.reset_next[e]:  # next-step autoreset: the reset step is no transition
                valid, self.reset_next[e] = False, False
            if self.stack[e] is None:
                f = self._frame()
                self.stack[e] = np.stack([f] * self.k) if self.k else f
            f = self._frame()
            nxt = np.concatenate([self.stack[e][1:], f[None]]) if self.k else f
            end = valid and not open_end and self.rng.random() < self.p_end
            term = bool(end and self.rng.random() < 0.5)
            row = {"obs": self.stack[e], "next_obs": nxt, "reward": np.float32(len(self.rows) + 1),
                   "terminated": term, "truncated": bool(end and not term), "valid": valid}
            for n in out:
                out[n].append(row[n])
            self.rows.append(row)
            if not valid:
                self.stack[e] = None
            else:
                self.stack[e] = None if end and not self.autoreset else nxt
                if end and self.autoreset:
                    self.stack[e], self.reset_next[e] = None, True
        if self.E == 1:
            return {n: np.asarray(v[0]) for n, v in out.items()}
        return {n: np.stack(v) for n, v in out.items()}

    def feed(self, buf, n, open_end_last=True):
        for i in range(n):
            s = self.step(open_end=open_end_last and i == n - 1)
            valid = s.pop("valid")
            if np.all(valid):
                buf.add(**s)
            else:
                buf.add(**s, valid=valid)


def check_stacks(buf, rows: Rows, *, n: int = 1, cut: int | None = None):
    """Every sampleable transition's obs, and its n-step next_obs (the
    next_obs of its window's last row: the episode's end, the n-th row, or its
    env's last row before the resume at row ``cut``), is what was added."""
    status = buf.status
    live = np.flatnonzero(status == LIVE)
    if not live.size:
        return 0
    got = buf.gather(live)
    gen = buf.generations[live]
    E, total = rows.E, len(rows.rows)
    for i, g in enumerate(gen.tolist()):
        want = rows.rows[g]
        np.testing.assert_array_equal(got["obs"][i], want["obs"], err_msg=f"obs of transition {g}")
        j, m = g, 1
        while True:
            r = rows.rows[j]
            if r["terminated"] or r["truncated"] or m == n or j + E >= total \
                    or (cut is not None and j < cut <= j + E):
                break
            j, m = j + E, m + 1
        np.testing.assert_array_equal(got["next_obs"][i], rows.rows[j]["next_obs"],
                                      err_msg=f"next_obs of transition {g} (window end {j})")
    return live.size


CASES = {
    # name: (buffer kwargs, Rows kwargs, steps)
    "plain-n1": (dict(capacity=40), dict(), 12),
    "nstep3": (dict(capacity=40, n_step=3), dict(), 12),
    "nstep5-wrap": (dict(capacity=7, n_step=5), dict(), 23),
    "nstep2-envs3": (dict(capacity=30, n_step=2, num_envs=3), dict(E=3, p_end=0.4), 9),
    "nstep4-envs3-wrap": (dict(capacity=9, n_step=4, num_envs=3), dict(E=3, p_end=0.3), 14),
    "stack4": (dict(capacity=40, frame_stack=4), dict(k=4), 12),
    "stack4-nstep3-envs3-wrap": (dict(capacity=12, frame_stack=4, n_step=3, num_envs=3), dict(E=3, k=4), 17),
    "stack4-zstd": (dict(capacity=40, frame_stack=4, compression="zstd"), dict(k=4, frame=(16, 16)), 12),
    "stack2-zstd-nstep2-envs3-wrap": (dict(capacity=9, frame_stack=2, compression="zstd", n_step=2, num_envs=3),
                                      dict(E=3, k=2, frame=(16, 16)), 11),
    "rank-nstep3": (dict(capacity=40, n_step=3, prioritization="rank"), dict(), 12),
    "rank-nstep2-envs3-wrap": (dict(capacity=9, n_step=2, num_envs=3, prioritization="rank"), dict(E=3), 10),
    "autoreset-nstep3-envs3": (dict(capacity=60, n_step=3, num_envs=3), dict(E=3, autoreset=True, p_end=0.4), 12),
    "autoreset-stack4-nstep2": (dict(capacity=60, n_step=2, frame_stack=4), dict(k=4, autoreset=True, p_end=0.4),
                                15),
    "capacity1-nstep3": (dict(capacity=1, n_step=3), dict(), 5),
    "capacity1-stack4": (dict(capacity=1, frame_stack=4), dict(k=4), 5),
    "empty-nstep3": (dict(capacity=10, n_step=3), dict(), 0),
    "seq-envs3-wrap": (dict(capacity=14, num_envs=3, sequence=bigper.Sequence(length=3, burn_in=1, period=2)),
                       dict(E=3, p_end=0.2), 11),
    "seq-stack4-autoreset": (dict(capacity=50, frame_stack=4, sequence=bigper.Sequence(length=4, burn_in=2, period=1)),
                             dict(k=4, autoreset=True, p_end=0.3), 14),
    "seq-rank-zstd": (dict(capacity=30, frame_stack=2, compression="zstd", prioritization="rank",
                           sequence=bigper.Sequence(length=5, period=5)), dict(k=2, frame=(16, 16)), 9),
}


def build(case, storage, path, cases=None):
    kw, rkw, steps = (CASES if cases is None else cases)[case]
    kw = dict(kw)
    cap = kw.pop("capacity")
    rows = Rows(seed=sum(map(ord, case)), **rkw)
    buf = bigper.PrioritizedReplayBuffer(cap, rows.fields(), storage=storage, path=path, seed=0, gamma=0.5, **kw)
    rows.feed(buf, steps)
    return buf, rows, cap, kw


def reopen(cap, fields, kw, storage, path, **extra):
    return bigper.PrioritizedReplayBuffer(cap, fields, storage=storage, path=path, seed=0, gamma=0.5,
                                          mode="resume", **kw, **extra)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_ends_open_episodes_verifiably_and_idempotently(tmp_path, case, storage):
    """close -> resume (the open episodes end) -> the stacks are what was
    added -> close -> resume again changes nothing -> save -> the snapshot and
    the live folder verify -> load -> the same state, nothing more ended."""
    path = tmp_path / ("live.h5" if storage == "hdf5" else "live")
    buf, rows, cap, kw = build(case, storage, path)
    fields = rows.fields()
    buf.close()
    r1 = reopen(cap, fields, kw, storage, path)
    n1 = len(r1)
    seq = CASES[case][0].get("sequence") is not None
    assert not (hook.unit(r1).status == PENDING).any(), "an item of the old side still waits for the new one"
    if not seq:
        check_stacks(r1, rows, n=kw.get("n_step", 1))
    s1 = copy_state(r1)
    r1.close()
    assert verify(path) == 0, "the resumed-and-closed live folder fails bigper verify"
    r2 = reopen(cap, fields, kw, storage, path)
    assert len(r2) == n1
    assert same_state(copy_state(r2), s1), "a second resume changed the recorded state"
    snap = r2.save(tmp_path / "snap")
    r2.close()
    assert verify(snap) == 0
    r3 = load(snap, path=tmp_path / ("other.h5" if storage == "hdf5" else "other"))
    assert same_state(copy_state(r3), s1), "a load after the resume changed the recorded state"
    cut = len(rows.rows)
    rows.feed(r3, 4)  # the new side: a new episode whose stacks are still exact
    if not seq:
        check_stacks(r3, rows, n=kw.get("n_step", 1), cut=cut)
    else:
        live = np.flatnonzero(hook.unit(r3).status == LIVE)
        if live.size:
            got = r3.gather(live)
            rew = np.where(got["mask"], got["reward"], 0)
            old = len(rows.rows) - 4 * rows.E
            for i in range(live.size):
                sides = {int(v) <= old for v in rew[i][got["mask"][i]].tolist()}
                assert len(sides) == 1, f"item at slot {live[i]} mixes the two sides of the resume"
    r3.close()
    assert verify(tmp_path / ("other.h5" if storage == "hdf5" else "other")) == 0


# -- forks: counterpart, default_live_path, _check_newer ------------------------------------


def run_folder(root: Path, storage="memmap", live_rel="replay", snap_rel="ckpt/snap-00000001", more=5,
               close=True, prioritization="proportional"):
    """A run: 10 transitions, a snapshot, ``more`` transitions, a clean close (the live data is newer)."""
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=root / live_rel, seed=0,
                                       prioritization=prioritization)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=t % 4 == 3)
    b.save(root / snap_rel)
    for t in range(10, 10 + more):
        b.add(obs=[t], reward=2.0, next_obs=[t + 1], terminated=False)
    if close:
        b.close()
    return b


def cp(src, dst, *flags):
    subprocess.run(["cp", "-a", *flags, str(src), str(dst)], check=True)


def test_fork_of_a_run_reached_through_a_symlink_loads_into_the_fork(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    run_folder(tmp_path / "link")  # the job ran as /.../link/replay, /.../link/ckpt/...
    cp(real, tmp_path / "fork")
    before = fingerprint(real)
    b = load(tmp_path / "fork/ckpt/snap-00000001", rewind=True)  # rewind the FORK's copy, as asked
    at = Path(b.storage.path)
    b.close()
    assert fingerprint(real) == before, "the original run's live folder was rewound by a load from its copy"
    assert at == tmp_path / "fork/replay"


def test_fork_whose_live_path_is_a_symlink_to_the_original_is_refused(tmp_path):
    run_folder(tmp_path / "run")
    (tmp_path / "fork").mkdir()
    shutil.copytree(tmp_path / "run/ckpt", tmp_path / "fork/ckpt")
    os.symlink(tmp_path / "run/replay", tmp_path / "fork/replay")
    before = fingerprint(tmp_path / "run", tmp_path / "fork")
    with pytest.raises(PathExistsError):
        load(tmp_path / "fork/ckpt/snap-00000001", rewind=True).close()
    assert fingerprint(tmp_path / "run", tmp_path / "fork") == before


def test_fork_whose_live_path_is_a_symlink_is_refused_without_rewind(tmp_path):
    """Without rewind the newer-data rule refuses it, and nothing changes on either side."""
    run_folder(tmp_path / "run")
    (tmp_path / "fork").mkdir()
    shutil.copytree(tmp_path / "run/ckpt", tmp_path / "fork/ckpt")
    os.symlink(tmp_path / "run/replay", tmp_path / "fork/replay")
    before = fingerprint(tmp_path / "run", tmp_path / "fork")
    with pytest.raises(PathExistsError):
        load(tmp_path / "fork/ckpt/snap-00000001")
    assert fingerprint(tmp_path / "run", tmp_path / "fork") == before


@pytest.mark.parametrize("storage,live_rel", [("memmap", "replay"), ("hdf5", "replay.h5")])
def test_fork_made_with_hard_links_never_writes_into_the_original(tmp_path, storage, live_rel):
    """``cp -al``: every file of the fork is a hard link of the original's; a
    rewind of the fork and writes after it leave the original's bytes alone."""
    run_folder(tmp_path / "run", storage=storage, live_rel=live_rel)
    cp(tmp_path / "run", tmp_path / "fork", "-l")
    before = fingerprint(tmp_path / "run")
    b = load(tmp_path / "fork/ckpt/snap-00000001", rewind=True)
    assert Path(b.storage.path) == tmp_path / "fork" / live_rel and len(b) == 10
    for t in range(60):  # round the ring: every chunk written
        b.add(obs=[500 + t], reward=9.0, next_obs=[501 + t], terminated=t % 7 == 6)
    b.update_priorities(np.arange(20), np.full(20, 3.0))
    b.save(tmp_path / "fork/ckpt/snap-00000002")
    b.close()
    assert fingerprint(tmp_path / "run") == before, "a write went through a hard link into the original"
    again = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=tmp_path / "fork" / live_rel, mode="resume")
    again.add(obs=[0], reward=0.0, next_obs=[1], terminated=False)
    again.close()
    assert fingerprint(tmp_path / "run") == before


def test_resume_of_a_hard_linked_copy_of_a_live_folder_never_writes_into_the_original(tmp_path):
    run_folder(tmp_path / "run")
    cp(tmp_path / "run", tmp_path / "fork", "-l")
    before = fingerprint(tmp_path / "run")
    b = bigper.PrioritizedReplayBuffer(50, F, storage="memmap", path=tmp_path / "fork/replay", mode="resume")
    for t in range(60):
        b.add(obs=[500 + t], reward=9.0, next_obs=[501 + t], terminated=False)
    b.update_priorities(np.arange(20), np.full(20, 3.0))
    b.close()
    assert fingerprint(tmp_path / "run") == before


@pytest.mark.parametrize("what", ["file", "fifo", "readonly-dir", "dangling-link", "foreign-dir"])
def test_fork_whose_counterpart_is_not_a_live_folder_is_refused_untouched(tmp_path, what):
    run_folder(tmp_path / "run")
    (tmp_path / "fork").mkdir()
    shutil.copytree(tmp_path / "run/ckpt", tmp_path / "fork/ckpt")
    there = tmp_path / "fork/replay"
    if what == "file":
        there.write_text("mine")
    elif what == "fifo":
        os.mkfifo(there)
    elif what == "readonly-dir":
        there.mkdir()
        (there / "notes.txt").write_text("mine")
        there.chmod(0o555)
    elif what == "dangling-link":
        os.symlink(tmp_path / "nowhere", there)
    else:
        there.mkdir()
        (there / "data").mkdir()
        (there / "data/obs.bin").write_bytes(b"user data")
    before = fingerprint(tmp_path / "run", tmp_path / "fork", tmp_path / "nowhere")
    try:
        with deadline(20):
            for rewind in (False, True):
                with pytest.raises(BigperError):
                    load(tmp_path / "fork/ckpt/snap-00000001", rewind=rewind).close()
        assert fingerprint(tmp_path / "run", tmp_path / "fork", tmp_path / "nowhere") == before
    finally:
        if what == "readonly-dir":
            there.chmod(0o755)


def test_fork_whose_counterpart_folder_is_read_only_and_empty(tmp_path):
    """An empty read-only folder at the fork's live path: an OSError/bigper error, never the original."""
    run_folder(tmp_path / "run")
    (tmp_path / "fork").mkdir()
    shutil.copytree(tmp_path / "run/ckpt", tmp_path / "fork/ckpt")
    (tmp_path / "fork/replay").mkdir()
    (tmp_path / "fork/replay").chmod(0o555)
    before = fingerprint(tmp_path / "run")
    try:
        if os.geteuid() == 0:  # root writes anyway: then it must load into the fork's folder
            b = load(tmp_path / "fork/ckpt/snap-00000001")
            assert Path(b.storage.path) == tmp_path / "fork/replay"
            b.close()
        else:
            with pytest.raises((OSError, BigperError)):
                load(tmp_path / "fork/ckpt/snap-00000001")
        assert fingerprint(tmp_path / "run") == before
    finally:
        (tmp_path / "fork/replay").chmod(0o755)


@pytest.mark.parametrize("how", ["moved", "renamed-run", "snapshot-renamed", "relative-live"])
def test_moved_renamed_and_relative_runs_load_where_they_should(tmp_path, how, monkeypatch):
    if how == "relative-live":
        monkeypatch.chdir(tmp_path)
        b = bigper.PrioritizedReplayBuffer(50, F, storage="memmap", path="run/replay", seed=0)
        for t in range(10):
            b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
        b.save("run/ckpt/snap-00000001")
        b.close()
        monkeypatch.chdir("/")
        cp(tmp_path / "run", tmp_path / "fork")
        before = fingerprint(tmp_path / "run")
        r = load(tmp_path / "fork/ckpt/snap-00000001")
        assert Path(r.storage.path) == tmp_path / "fork/replay"
        r.close()
        assert fingerprint(tmp_path / "run") == before
        return
    run_folder(tmp_path / "run")
    if how == "moved":
        (tmp_path / "deeper").mkdir()
        os.rename(tmp_path / "run", tmp_path / "deeper/run")
        snap, want = tmp_path / "deeper/run/ckpt/snap-00000001", tmp_path / "deeper/run/replay"
    elif how == "renamed-run":
        os.rename(tmp_path / "run", tmp_path / "run2")
        snap, want = tmp_path / "run2/ckpt/snap-00000001", tmp_path / "run2/replay"
    else:  # the snapshot copied under another name inside its own run: the same run's live path
        cp(tmp_path / "run/ckpt/snap-00000001", tmp_path / "run/ckpt/keep")
        snap, want = tmp_path / "run/ckpt/keep", tmp_path / "run/replay"
    before = fingerprint(want)
    with pytest.raises(PathExistsError, match="rewind=True"):  # the live data (moved with it) is newer
        load(snap)
    assert fingerprint(want) == before
    r = load(snap, rewind=True)
    assert Path(r.storage.path) == want and len(r) == 10
    r.close()


CRAFTED = [123, ["a"], {"x": 1}, None, True, "", "..", "../../../..", "/", "/x/../../..", "\x00",
           "relative/ckpt/snap-00000001", "/elsewhere/run/ckpt/snap-00000001",
           "/../../../../ckpt/snap-00000001", "//ckpt/snap-00000001",
           pytest.param("/fork/ckpt/snap-00000001", marks=pytest.mark.xfail(strict=True, reason=(
               "counterpart() trusts storage.snapshot: a crafted '/fork/ckpt/snap-N' matches the copy's last "
               "3 names, so old='/' and the live path becomes <copy's parent>/<the whole recorded path>, a "
               "folder made outside the fork (low severity: a crafted storage.path can point anywhere too; "
               "refusing old='/' broke an honest copy of a run folder at the root, /workspace: "
               "tests/snapshot/test_hostile_counterpart.py)")))]


@pytest.mark.parametrize("value", CRAFTED, ids=[repr(v.values[0] if type(v).__name__ == "ParameterSet" else v)[:30] for v in CRAFTED])
def test_crafted_storage_snapshot_never_writes_into_the_original_run(tmp_path, value):
    """A re-signed manifest whose ``storage.snapshot`` is anything: without
    ``rewind`` the original run (newer) is never touched; with it the load
    goes into the fork, or (a value that shows no move: the rule for
    snapshots written before bigper recorded it) into the recorded path,
    never anywhere else, and nothing appears outside ``tmp_path``."""
    run_folder(tmp_path / "run")
    cp(tmp_path / "run", tmp_path / "fork")
    snap = tmp_path / "fork/ckpt/snap-00000001"
    resign(snap, lambda body: body["storage"].__setitem__("snapshot", value))
    from tests.snapshot.test_hostile_counterpart import _loads_into_the_fork_or_nowhere

    _loads_into_the_fork_or_nowhere(tmp_path, snap)


def test_crafted_live_path_inside_the_snapshot_is_refused(tmp_path):
    run_folder(tmp_path / "run")
    cp(tmp_path / "run", tmp_path / "fork")
    snap = tmp_path / "fork/ckpt/snap-00000001"
    # the original's live path is recorded inside its snapshot: the fork's counterpart overlaps the snapshot
    resign(snap, lambda body: body["storage"].__setitem__("path", str(tmp_path / "run/ckpt/snap-00000001/data")))
    before = fingerprint(tmp_path / "run", tmp_path / "fork")
    with pytest.raises(InvalidArgumentError, match="overlap"):
        load(snap, rewind=True)
    assert fingerprint(tmp_path / "run", tmp_path / "fork") == before


# -- rewind: locks, killed writers, equal counts, series fallback ---------------------------


KILLED = r"""
import os, signal, sys, numpy as np, bigper
kind, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
b = bigper.PrioritizedReplayBuffer(50, {"obs": ((1,), np.float32), "reward": ((), np.float32)}, storage=kind,
                                   path=path, seed=0, mode="resume")
for t in range(n):
    b.add(obs=[1000 + t], reward=7.0, next_obs=[1001 + t], terminated=False)
b.update_priorities(np.arange(5), np.full(5, 9.0))
if kind == "hdf5":
    b.storage.flush() if hasattr(b.storage, "flush") else None
os.kill(os.getpid(), signal.SIGKILL)
"""


def live_of(storage, root):
    return root / ("replay.h5" if storage == "hdf5" else "replay")


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_rewind_of_a_path_a_live_writer_holds_is_refused_untouched(tmp_path, storage):
    live = live_of(storage, tmp_path)
    b = run_folder(tmp_path, storage=storage, live_rel=live.name, close=False)
    snap = tmp_path / "ckpt/snap-00000001"
    before = fingerprint(tmp_path)
    for rewind in (False, True):
        with pytest.raises(StorageLockedError):
            load(snap, rewind=rewind)
    assert fingerprint(tmp_path) == before
    assert len(b) == 15
    b.add(obs=[0], reward=0.0, next_obs=[1], terminated=False)  # the writer goes on unharmed
    b.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_killed_writers_newer_folder_is_taken_over_and_verifies(tmp_path, storage):
    """Unclean (kill -9 after more adds): replaced without rewind, as the guide says, and the result verifies."""
    live = live_of(storage, tmp_path)
    run_folder(tmp_path, storage=storage, live_rel=live.name)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", KILLED, storage, str(live), "20"], env=env, capture_output=True,
                       timeout=600)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    with pytest.raises(bigper.errors.UncleanStorageError):
        bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, mode="resume")
    b = load(tmp_path / "ckpt/snap-00000001")
    assert len(b) == 10
    b.close()
    assert verify(live) == 0


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_equal_count_with_newer_priorities_is_not_silently_rewound(tmp_path, storage):
    """(Was a strict xfail: ``_check_newer`` compared transition counts only.)"""
    live = live_of(storage, tmp_path)
    b = run_folder(tmp_path, storage=storage, live_rel=live.name, more=0, close=False)
    for _ in range(5):  # a learner that only samples and updates after the snapshot
        batch = b.sample(4)
        b.update_priorities(batch, np.full(4, 50.0))
    b.close()
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="rewind"):
        load(tmp_path / "ckpt/snap-00000001").close()
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("since", ["lowered", "raised_once", "reprioritized"])
def test_equal_count_with_any_change_since_is_not_silently_rewound(tmp_path, storage, since, prioritization):
    """Priorities changed since, no transition written: lowered (the largest
    leaf stays), one raised past the largest (no draw), every one set anew as
    ``reprioritize`` sets them (no draw). Refused without ``rewind``, the
    folder byte for byte as it was; with it, the state a load of the
    snapshot into a new path gives."""
    live = live_of(storage, tmp_path)
    b = run_folder(tmp_path, storage=storage, live_rel=live.name, more=0, close=False,
                   prioritization=prioritization)
    if since == "lowered":
        b.update_priorities(np.array([1, 2, 3]), np.array([0.25, 0.5, 0.125]))
    elif since == "raised_once":
        b.update_priorities(np.array([4]), np.array([3.0]))
    else:
        b.update_priorities(np.arange(10), np.linspace(0.1, 0.9, 10))
    b.close()
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="rewind=True"):
        load(tmp_path / "ckpt/snap-00000001").close()
    assert fingerprint(tmp_path) == before
    r = load(tmp_path / "ckpt/snap-00000001", path=tmp_path / "elsewhere" / live.name)
    assert r.config.prioritization == prioritization
    want = copy_state(r)
    r.close()
    r = load(tmp_path / "ckpt/snap-00000001", rewind=True)
    got = copy_state(r)
    for t in range(3):  # the run goes on with a new episode, as after a restart
        r.add(obs=[100 + t], reward=3.0, next_obs=[101 + t], terminated=t == 2)
    assert len(r) == 13 and set(r.sample(8)["reward"].tolist()) <= {1.0, 3.0}
    r.close()
    assert same_state(got, want)
    assert verify(live) == 0
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="rewind=True"):  # older than the live path now: refused
        load(tmp_path / "ckpt/snap-00000001")
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_equal_count_untouched_since_loads_without_rewind(tmp_path, storage):
    live = live_of(storage, tmp_path)
    run_folder(tmp_path, storage=storage, live_rel=live.name, more=0)
    b = load(tmp_path / "ckpt/snap-00000001")
    assert len(b) == 10
    b.close()
    assert verify(live) == 0


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_load_latest_falls_back_past_a_corrupt_newest_but_keeps_newer_live_data(tmp_path, storage):
    live = live_of(storage, tmp_path)
    snaps = bigper.Snapshots(tmp_path / "snaps", keep=None)
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0)
    for t in range(8):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    s1 = snaps.save(b)
    for t in range(8, 12):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    s2 = snaps.save(b)
    b.close()
    victim = next(p for p in sorted((s2 / "data").iterdir()) if p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    os.unlink(victim)  # (a hard link of the live chunk: never flip the live bytes)
    victim.write_bytes(bytes(data))
    before = fingerprint(live, s1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(PathExistsError, match="rewind=True"):
            snaps.load_latest()
        assert fingerprint(live, s1) == before
        with pytest.warns(RuntimeWarning, match="corrupt"):
            r = snaps.load_latest(rewind=True)
    assert snaps.last_loaded.path == s1 and len(r) == 8
    r.close()
    assert verify(live) == 0


@pytest.mark.parametrize("pair", ["load-resume", "load-load", "resume-resume"])
@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_load_and_resume_racing_on_one_live_path(tmp_path, storage, pair):
    """Two threads: load(snapshot) and mode="resume" at the same path. One
    wins; the other gets a bigper error; the winner's buffer is whole."""
    live = live_of(storage, tmp_path)
    run_folder(tmp_path, storage=storage, live_rel=live.name, more=0)
    snap = tmp_path / "ckpt/snap-00000001"
    for attempt in range(4):
        got, errs = [], []
        go = threading.Barrier(2)

        def do(fn):
            go.wait()
            try:
                got.append(fn())
            except BigperError as e:
                errs.append(e)

        fns = {"load": lambda: load(snap, rewind=True),
               "resume": lambda: bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, mode="resume",
                                                                seed=0)}
        ts = [threading.Thread(target=do, args=(fns[name],)) for name in pair.split("-")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert len(got) + len(errs) == 2
        assert all(isinstance(e, StorageLockedError) for e in errs), errs
        for b in got:
            assert len(b) == 10
            b.add(obs=[1], reward=1.0, next_obs=[2], terminated=False)
        # both may win one after the other only if the first closed: never both open at once
        assert len(got) == 1, "two buffers hold one live path"
        for b in got:
            b.close()
        assert verify(live) == 0
        # back to 10 for the next round
        load(snap, rewind=True).close()


# -- the flags: every type, read_only, the device tier, a sampler thread -------------------


def small_run(tmp_path, n_step=3, **kw):
    b = bigper.PrioritizedReplayBuffer(30, F, storage="memmap", path=tmp_path / "live", seed=0, n_step=n_step,
                                       gamma=0.5, **kw)
    for t in range(6):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snap = b.save(tmp_path / "snap")
    b.close()
    return snap


@pytest.mark.parametrize("value", [np.bool_(True), np.bool_(False), True, False])
def test_numpy_bools_are_taken_as_bools(tmp_path, value):
    snap = small_run(tmp_path)
    b = load(snap, path=tmp_path / "a", continue_episodes=value, rewind=value)
    assert (b.status[:6] == PENDING).any() == bool(value)  # goes on: the last windows still wait
    b.close()
    r = bigper.PrioritizedReplayBuffer(30, F, storage="memmap", path=tmp_path / "live", mode="resume", n_step=3,
                                       gamma=0.5, continue_episodes=value)
    assert (r.status[:6] == PENDING).any() == bool(value)
    r.close()


BAD = [1, 0, np.int64(1), None, "True", "", 1.0, [True], np.array([True]), np.array(True)]


@pytest.mark.parametrize("value", BAD, ids=[f"{type(v).__name__}-{v!r}"[:30] for v in BAD])
def test_other_types_are_refused_everywhere_with_nothing_changed(tmp_path, value):
    snap = small_run(tmp_path)
    snaps = bigper.Snapshots(tmp_path / "snaps")
    live = bigper.PrioritizedReplayBuffer(30, F, storage="memmap", path=tmp_path / "live", mode="resume", n_step=3,
                                          gamma=0.5, continue_episodes=True)
    snaps.save(live)
    live.close()
    before = fingerprint(tmp_path)
    for kw in ("continue_episodes", "rewind"):
        with pytest.raises(InvalidTypeError, match=kw):
            load(snap, path=tmp_path / "x", **{kw: value})
        with pytest.raises(InvalidTypeError, match=kw):
            snaps.load_latest(path=tmp_path / "y", **{kw: value})
    with pytest.raises(InvalidTypeError, match="continue_episodes"):
        bigper.PrioritizedReplayBuffer(30, F, storage="memmap", path=tmp_path / "live", mode="resume", n_step=3,
                                       gamma=0.5, continue_episodes=value)
    assert fingerprint(tmp_path) == before


def test_load_latest_with_a_loader_takes_numpy_false_as_the_default(tmp_path):
    snap = small_run(tmp_path)
    root = tmp_path / "snaps"
    root.mkdir()
    shutil.copytree(snap, root / "snap-00000001")
    snaps = bigper.Snapshots(root, loader=lambda p, path=None: load(p, path=tmp_path / "z"))
    snaps.load_latest(continue_episodes=np.False_, rewind=np.False_).close()


def test_read_only_resume_ends_nothing_and_writes_nothing(tmp_path):
    small_run(tmp_path)
    before = fingerprint(tmp_path)
    for go_on in (False, True):
        ro = bigper.PrioritizedReplayBuffer(30, F, storage="memmap", path=tmp_path / "live", mode="resume",
                                            n_step=3, gamma=0.5, read_only=True, continue_episodes=go_on)
        assert (ro.status[:6] == PENDING).sum() == 2
        ro.sample(4)
        ro.close()
    assert fingerprint(tmp_path) == before


def test_the_device_tier_draws_what_the_host_draws_after_the_episode_ended(tmp_path):
    pytest.importorskip("torch")
    rows = Rows(E=3, k=4, p_end=0.3, seed=5)
    b = bigper.PrioritizedReplayBuffer(24, rows.fields(), frame_stack=4, n_step=3, num_envs=3, gamma=0.5,
                                       storage="memmap", path=tmp_path / "live", seed=0)
    rows.feed(b, 7)
    snap = b.save(tmp_path / "snap")
    b.close()
    host = load(snap, path=tmp_path / "h")
    dev = load(snap, path=tmp_path / "d", device="cpu")
    assert same_state(copy_state(host), copy_state(dev))
    for _ in range(3):
        rows_new = [rows.step() for _ in range(2)]
        for s in rows_new:
            s.pop("valid")
            host.add(**s)
            dev.add(**s)
        x, y = host.sample(16), dev.sample(16)
        np.testing.assert_array_equal(x.indices, y.indices)
        for key in x.data:
            np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key].cpu()), err_msg=key)
    host.close()
    dev.close()


def test_a_sampler_thread_on_the_original_while_its_snapshot_loads(tmp_path):
    rows = Rows(E=1, k=4, seed=9)
    b = bigper.PrioritizedReplayBuffer(40, rows.fields(), frame_stack=4, n_step=2, storage="memmap",
                                       path=tmp_path / "live", seed=0)
    rows.feed(b, 12)
    it = b.sampler(4, prefetch=2)
    next(it)
    snap = b.save(tmp_path / "snap")
    r = load(snap, path=tmp_path / "other")
    for _ in range(5):
        next(it)
        r.sample(4)
    check_stacks(r, rows, n=2)
    it.close()
    b.close()
    r.close()
    assert verify(tmp_path / "live") == 0 and verify(tmp_path / "other") == 0


def test_fork_symlinked_to_a_killed_original_never_replaces_it(tmp_path):
    run_folder(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", KILLED, "memmap", str(tmp_path / "run/replay"), "20"], env=env,
                       capture_output=True, timeout=600)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    (tmp_path / "fork").mkdir()
    shutil.copytree(tmp_path / "run/ckpt", tmp_path / "fork/ckpt")
    os.symlink(tmp_path / "run/replay", tmp_path / "fork/replay")
    before = fingerprint(tmp_path / "run")
    try:
        load(tmp_path / "fork/ckpt/snap-00000001").close()
    except BigperError:
        pass
    assert fingerprint(tmp_path / "run") == before


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_loads_that_end_episodes_never_change_the_snapshot(tmp_path, storage):
    rows = Rows(E=3, k=4, p_end=0.3, seed=11)
    path = None if storage == "memory" else live_of(storage, tmp_path)
    b = bigper.PrioritizedReplayBuffer(20, rows.fields(), frame_stack=4, n_step=3, num_envs=3, gamma=0.5,
                                       storage=storage, path=path, seed=0)
    rows.feed(b, 9)
    snap = b.save(tmp_path / "snap")
    b.close()
    before = fingerprint(snap)
    states = []
    for i in range(3):
        kw = {} if storage == "memory" else {"path": tmp_path / f"l{i}{'.h5' if storage == 'hdf5' else ''}"}
        r = load(snap, **kw)
        states.append(copy_state(r))
        r.add(**{k: v for k, v in rows.step().items() if k != "valid"})
        r.close()
    assert fingerprint(snap) == before
    assert same_state(states[0], states[1]) and same_state(states[1], states[2])
    assert verify(snap) == 0


def test_hdf5_fork_whose_live_file_is_a_symlink_to_the_original(tmp_path):
    run_folder(tmp_path / "run", storage="hdf5", live_rel="replay.h5")
    (tmp_path / "fork").mkdir()
    shutil.copytree(tmp_path / "run/ckpt", tmp_path / "fork/ckpt")
    os.symlink(tmp_path / "run/replay.h5", tmp_path / "fork/replay.h5")
    before = fingerprint(tmp_path / "run", tmp_path / "fork")
    for rewind in (False, True):
        with pytest.raises(BigperError):
            load(tmp_path / "fork/ckpt/snap-00000001", rewind=rewind).close()
    assert fingerprint(tmp_path / "run", tmp_path / "fork") == before


def test_compressed_frames_under_a_budget_end_their_episodes_verifiably(tmp_path):
    rows = Rows(E=1, k=4, frame=(16, 16), seed=2, p_end=0.1)
    kw = dict(frame_stack=4, compression="zstd", n_step=3, gamma=0.5)
    # random frames do not compress: a budget this small releases segments early (frames expire)
    b = bigper.PrioritizedReplayBuffer(16, rows.fields(), storage="memmap", path=tmp_path / "live", seed=0,
                                       compression_budget=170, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rows.feed(b, 40)
    b.close()
    r = bigper.PrioritizedReplayBuffer(16, rows.fields(), storage="memmap", path=tmp_path / "live", mode="resume",
                                       seed=0, compression_budget=170, **kw)
    assert not (r.status == PENDING).any()
    check_stacks(r, rows, n=3)
    s = copy_state(r)
    r.close()
    assert verify(tmp_path / "live") == 0
    r = bigper.PrioritizedReplayBuffer(16, rows.fields(), storage="memmap", path=tmp_path / "live", mode="resume",
                                       seed=0, compression_budget=170, **kw)
    assert same_state(copy_state(r), s)
    r.close()


@pytest.mark.parametrize("how", ["latest-symlink", "renamed-in-fork"])
def test_fork_loaded_through_another_name_never_rewinds_the_original(tmp_path, how):
    run_folder(tmp_path / "run")
    cp(tmp_path / "run", tmp_path / "fork")
    if how == "latest-symlink":
        os.symlink("snap-00000001", tmp_path / "fork/ckpt/latest")
        snap = tmp_path / "fork/ckpt/latest"
    else:
        os.rename(tmp_path / "fork/ckpt/snap-00000001", tmp_path / "fork/ckpt/best")
        snap = tmp_path / "fork/ckpt/best"
    before = fingerprint(tmp_path / "run")
    b = load(snap, rewind=True)
    at = Path(b.storage.path)
    b.close()
    assert fingerprint(tmp_path / "run") == before, f"the original was rewound (loaded into {at})"
    assert at == tmp_path / "fork/replay"


@pytest.mark.parametrize("go_on", [True, False])
def test_load_latest_passes_continue_episodes_through_a_fallback(tmp_path, go_on):
    snaps = bigper.Snapshots(tmp_path / "snaps", keep=None)
    b = bigper.PrioritizedReplayBuffer(30, F, n_step=3, gamma=0.5, seed=0)
    for t in range(6):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snaps.save(b)
    b.add(obs=[6], reward=1.0, next_obs=[7], terminated=False)
    s2 = snaps.save(b)
    b.close()
    (s2 / "manifest.json").write_bytes(b"{}")  # the newest is corrupt
    with pytest.warns(RuntimeWarning, match="corrupt"):
        r = snaps.load_latest(continue_episodes=np.bool_(go_on))
    assert len(r) == 6 and (r.status == PENDING).any() == go_on
    r.close()


def test_a_failed_write_does_not_fake_an_episode_end_for_the_resume(tmp_path):
    import errno

    path = tmp_path / "live.h5"
    b = bigper.PrioritizedReplayBuffer(10, F, storage="hdf5", path=path, n_step=2, gamma=0.5, seed=0)
    b.add(obs=[0], reward=1.0, next_obs=[1], terminated=False)  # the episode is open
    before = copy_state(b)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    store = b.storage
    real = store.write
    store.write = full
    try:
        with pytest.raises(OSError):
            b.add(obs=[1], reward=1.0, next_obs=[2], terminated=True)
    finally:
        store.write = real
    assert same_state(copy_state(b), before), "the failed add changed the recorded state"
    b.close()
    r = bigper.PrioritizedReplayBuffer(10, F, storage="hdf5", path=path, mode="resume", n_step=2, gamma=0.5)
    try:
        assert r.status[0] == LIVE, "the open episode was not ended at the resume"
    finally:
        r.close()


def test_fork_read_through_a_symlinked_folder_loads_into_the_fork(tmp_path):
    """The copy (not the original) reached through a symlink: the live path is the fork's own."""
    run_folder(tmp_path / "run")
    cp(tmp_path / "run", tmp_path / "fork-real")
    os.symlink(tmp_path / "fork-real", tmp_path / "fork")
    before = fingerprint(tmp_path / "run")
    with pytest.raises(PathExistsError, match="rewind=True"):  # the fork's own copy is newer
        load(tmp_path / "fork/ckpt/snap-00000001")
    b = load(tmp_path / "fork/ckpt/snap-00000001", rewind=True)
    assert os.path.realpath(b.storage.path) == str(tmp_path / "fork-real/replay")
    b.close()
    assert fingerprint(tmp_path / "run") == before


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_chdir_between_open_save_load_and_close_changes_no_path(tmp_path, storage, monkeypatch):
    """Relative paths are taken at the call that names them: a buffer opened
    at a relative path, the working directory changed, a snapshot saved at a
    relative path (under the new one), closed: its live files stay where it
    was opened. A load of that snapshot into a fork, the directory changed
    again before an add and the close: the fork resumes whole, the original
    live folder byte for byte as it was."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    live = "replay.h5" if storage == "hdf5" else "replay"
    monkeypatch.chdir(run)
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    monkeypatch.chdir(elsewhere)
    snap = b.save("ckpt/snap")
    assert snap == elsewhere / "ckpt" / "snap"
    b.add(obs=[10], reward=1.0, next_obs=[11], terminated=False)
    b.close()
    assert (run / live).exists() and not (elsewhere / live).exists()
    original = fingerprint(run / live, elsewhere / "ckpt")
    monkeypatch.chdir(run)
    r = load(elsewhere / "ckpt" / "snap", path="fork-" + live)
    monkeypatch.chdir(elsewhere)
    r.add(obs=[20], reward=2.0, next_obs=[21], terminated=True)
    r.close()
    assert fingerprint(run / live, elsewhere / "ckpt") == original and not (elsewhere / ("fork-" + live)).exists()
    monkeypatch.chdir("/")
    f = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=run / ("fork-" + live), mode="resume", seed=0)
    assert len(f) == 11 and set(f.sample(8)["reward"].tolist()) <= {1.0, 2.0}
    f.close()
    assert verify(run / live) == 0 and verify(run / ("fork-" + live)) == 0


@pytest.mark.parametrize("saved_at, now_at, live, want", [
    ("/runs/a/ckpt/snap-3", "/runs/b/ckpt/latest", "/runs/a/replay", "/runs/b/replay"),  # a copied run folder
    ("/runs/a/ckpt/snap-3", "/runs/b/ckpt/snap-3", "/elsewhere/replay", None),  # live outside the moved tree
    ("/runs/a/ckpt/snap-3", "/runs/a/ckpt/snap-3", "/runs/a/replay", None),  # nothing moved
    ("/x/ckpt/snap-3", "/y/other/snap-3", "/x/replay", None),  # no folder shared
    ("/workspace/ckpt/snap-1", "/home/u/workspace/ckpt/snap-1", "/workspace/replay",
     "/home/u/workspace/replay"),  # a run folder at the root, copied (the shared folders reach /)
    ("/home/u/ckpt/snap-1", "/ckpt/snap-1", "/home/u/replay", "/replay"),  # (moved up to the root: a folder)
])
def test_counterpart_moves_the_live_path_with_a_folder_only(saved_at, now_at, live, want):
    from bigper.snapshot._load import counterpart

    got = counterpart(live, saved_at, now_at)
    assert (None if got is None else str(got)) == want
