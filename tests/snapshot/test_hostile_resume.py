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

LIVE, PENDING = bigper.status.LIVE, bigper.status.PENDING
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


def check_stacks(buf, rows: Rows, *, next_too: bool):
    """Every sampleable transition's obs (and, with n_step 1, next_obs) is what was added."""
    status = buf.status
    live = np.flatnonzero(status == LIVE)
    if not live.size:
        return 0
    got = buf.gather(live)
    gen = buf.generations[live]
    for i, g in enumerate(gen.tolist()):
        want = rows.rows[g]
        np.testing.assert_array_equal(got["obs"][i], want["obs"], err_msg=f"obs of transition {g}")
        if next_too:
            np.testing.assert_array_equal(got["next_obs"][i], want["next_obs"], err_msg=f"next_obs of {g}")
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


def build(case, storage, path):
    kw, rkw, steps = CASES[case]
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
        check_stacks(r1, rows, next_too=kw.get("n_step", 1) == 1)
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
    rows.feed(r3, 4)  # the new side: a new episode whose stacks are still exact
    if not seq:
        check_stacks(r3, rows, next_too=kw.get("n_step", 1) == 1)
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
