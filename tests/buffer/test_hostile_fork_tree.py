"""Attacks on the memory buffer's private priority tree (``prioritization/tree.py`` ``_alloc``,
MAP_PRIVATE): a fork while a prefetching sampler runs, with either prioritization, the child
using every public method (sample, update_priorities, add, extend, save, state_dict/load_state),
and a 'fork' multiprocessing worker handed the buffer: the parent's state is untouched."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import warnings

import numpy as np
import pytest

import bigper

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")

CAP = 32
FIELDS = {"obs": ((2,), np.float32), "reward": ((), np.float32)}


def _buf(prioritization):
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, seed=0, prioritization=prioritization)
    for i in range(CAP - 4):
        buf.add(obs=np.full(2, i, np.float32), reward=float(i), next_obs=np.full(2, i + 1, np.float32))
    buf.update_priorities(np.arange(CAP - 4), np.linspace(0.5, 2.0, CAP - 4))
    return buf


def _arrays(buf):
    meta, arrays = buf.state_dict()
    out = {k: np.array(v, copy=True) for k, v in arrays.items()}
    out["__leaves"] = np.array(buf.leaves(np.arange(CAP)), copy=True)
    out["__total"] = np.float64(buf.total_priority)
    out["__len"] = np.int64(len(buf))
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _child_work(buf, where):
    """Every public method; raises on any failure."""
    rng = np.random.default_rng(5)
    for _ in range(3):
        s = buf.sample(4)
        buf.update_priorities(s, rng.random(4) * 9 + 0.1)
    for i in range(10):  # wraps the ring
        buf.add(obs=np.full(2, 100 + i, np.float32), reward=-1.0, next_obs=np.full(2, 7, np.float32))
    buf.extend({"obs": np.full((6, 2), 55, np.float32), "reward": np.zeros(6, np.float32),
                "next_obs": np.full((6, 2), 56, np.float32)}, priorities=np.full(6, 3.0))
    buf.update_priorities(np.arange(CAP), np.full(CAP, 11.0))
    buf.save(where)
    meta, arrays = buf.state_dict()
    meta, arrays = dict(meta), {k: np.array(v, copy=True) for k, v in arrays.items()}
    buf.update_priorities(np.arange(CAP), np.full(CAP, 0.25))
    buf.load_state(meta, arrays)
    it = buf.sampler(4, prefetch=2)
    for _ in range(3):
        next(it)
    it.close() if hasattr(it, "close") else None


def _fork():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _wait(pid, seconds=20):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
def test_a_child_forked_while_a_prefetching_sampler_runs_leaves_the_parent_untouched(prioritization, tmp_path):
    buf = _buf(prioritization)
    it = buf.sampler(4, prefetch=2)
    for _ in range(3):
        next(it)
    time.sleep(0.05)  # (the prefetch thread fills its queue and waits)
    before = _arrays(buf)
    pid = _fork()
    if pid == 0:
        code = 3
        try:
            signal.alarm(15)
            _child_work(buf, tmp_path / "child_snap")
            code = 0
        except BaseException as e:  # noqa: BLE001
            (tmp_path / "child.txt").write_text(repr(e))
        finally:
            os._exit(code)
    code = _wait(pid)
    assert code == 0, (tmp_path / "child.txt").read_text() if (tmp_path / "child.txt").exists() else code
    _same(_arrays(buf), before)
    # the child's snapshot is its own and loads
    back = bigper.PrioritizedReplayBuffer.load(tmp_path / "child_snap")
    assert len(back) == CAP
    lv = back.leaves(np.arange(CAP))
    assert np.allclose(lv, lv[0]) or prioritization == "rank"  # (the child set every priority to 11)
    back.close()
    next(it)  # the parent's sampler goes on
    buf.update_priorities(np.arange(4), np.full(4, 2.0))
    if prioritization == "proportional":
        assert np.isclose(buf.total_priority, buf.leaves(np.arange(CAP)).sum(), rtol=1e-6)
    buf.close()


def _worker(buf, where, q):
    try:
        _child_work(buf, where)
        q.put(("ok", float(buf.total_priority)))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", repr(e)))


@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
def test_a_fork_multiprocessing_worker_handed_a_memory_buffer_works_on_its_own_copy(prioritization, tmp_path):
    buf = _buf(prioritization)
    before = _arrays(buf)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        p = ctx.Process(target=_worker, args=(buf, tmp_path / "w_snap", q))
        p.start()
    try:
        got = q.get(timeout=20)
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()
    assert got[0] == "ok", got
    _same(_arrays(buf), before)
    buf.close()
