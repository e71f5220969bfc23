"""Attacks on the dictionary look's thread (bigper/frames/look.py): fork,
kill -9 and a dropped buffer while a look is in flight, a look whose thread
fails, a failed write of many chunks while one is in flight, a look whose
thread never started."""

from __future__ import annotations

import gc
import os
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import bigper
import bigper.frames.look
import bigper.frames.segments
from bigper.errors import StorageLockedError

from tests.frames.test_compression import check_all_live, check_sample, make
from tests.frames.test_dictionary_look import _retrain_often, _slow_looks, add, log_state, same_log, steps_of
from tests import hook

CAP = 200


def _in_flight(buf, steps, i=0):
    """Add steps until a look (not the first dictionary's) is in flight; returns the next step's index."""
    while hook.log(buf)._look is None or hook.log(buf).dicts.hi < 2:
        assert i < len(steps), "no look was in flight"
        add(buf, steps[i:i + 1])
        i += 1
    return i


def test_a_fork_while_a_look_is_in_flight_gives_the_child_the_same_dictionaries(tmp_path):
    """The child has no thread: it runs the look's work itself, on the same
    inputs, and adopts what the parent adopts, at the same frame."""
    steps, feed = steps_of(("Pong", "Qbert", "Seaquest"), 120)
    out = tmp_path / "child.npz"
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        _slow_looks(mp, 0.3)
        buf = make("memory", tmp_path, (84, 84), k=4, capacity=CAP, seed=1)
        i = _in_flight(buf, steps)
        pid = os.fork()
        if pid == 0:  # the child: go on alone, record the log's state, leave without cleanup
            code = 1
            try:
                add(buf, steps[i:])
                meta, blob, entries = log_state(buf)
                np.savez(out, meta=np.array(repr(meta)), blob=blob, entries=entries)
                code = 0
            finally:
                os._exit(code)
        add(buf, steps[i:])
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert hook.log(buf).dicts.hi >= 3
    meta, blob, entries = log_state(buf)
    got = np.load(out)
    assert str(got["meta"]) == repr(meta)
    assert np.array_equal(got["blob"], blob) and np.array_equal(got["entries"], entries)
    check_all_live(buf, feed)
    buf.close()


def test_a_look_whose_thread_fails_changes_nothing_and_later_looks_go_on(tmp_path, caplog):
    steps, feed = steps_of(("Pong", "Qbert", "MsPacman"), 120)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        work, fails = bigper.frames.look.work, []

        def once(inputs):
            if not fails:
                fails.append(inputs.fw)
                raise MemoryError("injected: no memory in the look's thread")
            return work(inputs)
        buf = make("memmap", tmp_path, (84, 84), k=4, capacity=CAP, seed=2)
        i = _in_flight(buf, steps)  # (a look in flight: the next one fails)
        mp.setattr(bigper.frames.look, "work", once)
        hi = hook.log(buf).dicts.hi
        add(buf, steps[i:])
    assert fails
    assert "retraining the zstd dictionary at frame %d failed" % fails[0] in caplog.text
    assert hook.log(buf).dicts.hi > hi + 1  # the looks after it were adopted
    check_all_live(buf, feed)
    check_sample(buf, feed, 32)
    buf.close()


def test_a_failed_write_of_many_chunks_puts_the_look_in_flight_back(tmp_path):
    """An ``extend`` of more rows than the capacity fails in its second chunk
    (a full disk as the log grows) while a look is in flight: the buffer is as
    a twin's that never tried, the look in flight included, and the same adds
    then give both the same dictionaries at the same frames."""
    steps, feed = steps_of(("Pong", "Qbert", "MsPacman", "Seaquest"), 150)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        _slow_looks(mp, 0.05)
        buf = make("memory", tmp_path, (84, 84), k=4, capacity=60, seed=3)
        twin = make("memory", tmp_path, (84, 84), k=4, capacity=60, seed=3)
        i = _in_flight(buf, steps)
        add(twin, steps[:i])
        big = steps[i:i + 150]
        rows = {"obs": np.stack([s[0] for s in big]), "next_obs": np.stack([s[1] for s in big]),
                "terminated": np.array([s[2] for s in big]), "truncated": np.zeros(len(big), bool),
                "step": np.array([s[3] for s in big])}
        log = hook.log(buf)
        append, calls = type(log).append, []

        def failing(self, *a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(28, "injected: no space left on device")
            return append(self, *a, **kw)
        mp.setattr(type(log), "append", failing)
        look = log._look
        with pytest.raises(OSError):
            buf.extend(rows)
        mp.setattr(type(log), "append", append)
        assert log._look is look  # (the look in flight at the write's start, back in flight)
        add(buf, steps[i:])
        add(twin, steps[i:])
    same_log(buf, twin)
    a, b = buf.sample(32), twin.sample(32)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a["obs"], b["obs"])
    check_all_live(buf, feed)
    buf.close()
    twin.close()


def test_a_look_whose_thread_could_not_start_runs_when_its_outcome_is_due(tmp_path):
    steps, feed = steps_of(("Pong", "Qbert", "MsPacman"), 100)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        fast = make("memory", tmp_path, (84, 84), k=4, capacity=CAP, seed=4)
        add(fast, steps)

        class Refused(threading.Thread):
            def start(self):
                raise RuntimeError("can't start new thread")
        mp.setattr(bigper.frames.look, "threading", types.SimpleNamespace(Thread=Refused))
        none = make("memory", tmp_path, (84, 84), k=4, capacity=CAP, seed=4)
        add(none, steps)
    assert hook.log(fast).dicts.hi >= 3
    same_log(fast, none)
    check_all_live(none, feed)
    fast.close()
    none.close()


def test_a_buffer_dropped_while_a_look_is_in_flight_releases_its_lock_and_resumes(tmp_path):
    steps, feed = steps_of(("Pong", "Qbert"), 120)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        _slow_looks(mp, 0.5)
        buf = make("memmap", tmp_path, (84, 84), k=4, capacity=CAP, seed=5)
        i = _in_flight(buf, steps)
        del buf
        gc.collect()
        t = time.perf_counter()
        while True:  # (the look's thread holds nothing of the buffer: the lock goes with it)
            try:
                again = make("memmap", tmp_path, (84, 84), k=4, capacity=CAP, seed=5, mode="resume")
                break
            except StorageLockedError:
                assert time.perf_counter() - t < 30
                time.sleep(0.1)
        check_all_live(again, feed)
        add(again, steps[i:])
    check_all_live(again, feed)
    check_sample(again, feed, 32)
    again.close()


_CHILD = """
import sys, time, numpy as np
sys.path.insert(0, {root!r})
import bigper, bigper.frames.look, bigper.frames.segments, bigper.frames.dictionaries
bigper.frames.segments.TRAIN_FRAMES = 40
bigper.frames.dictionaries.PAYS = bigper.frames.dictionaries.DRIFT = -100.0
work = bigper.frames.look.work
def slow(inputs):
    print("training", flush=True)
    time.sleep(3600)
    return work(inputs)
from tests.frames.test_dictionary_look import add, steps_of
from tests.frames.test_compression import make
from tests import hook
from pathlib import Path
steps, feed = steps_of(("Pong", "Qbert"), 120)
buf = make("memmap", Path({tmp!r}), (84, 84), k=4, capacity={cap}, seed=6)
add(buf, steps[:60])
buf.save(Path({tmp!r}) / "snap")
bigper.frames.look.work = slow
add(buf, steps[60:])
"""


def test_kill_9_while_a_look_is_in_flight_then_resume_is_exact(tmp_path):
    """The child's look never finishes (its thread sleeps); it is killed with
    SIGKILL while its adds wait for it: the live folder resumes (to what the
    child recorded last) and every transition in it comes back exactly."""
    from tests._child import Child

    root = Path(__file__).resolve().parents[2]
    with Child(_CHILD.format(root=str(root), tmp=str(tmp_path), cap=CAP)) as child:
        child.said("training")
        time.sleep(0.5)
        child.kill()
    steps, feed = steps_of(("Pong", "Qbert"), 120)
    snap = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "from-snap",
                                               continue_episodes=True)
    check_all_live(snap, feed)
    add(snap, steps[60:])  # (the same adds again: this time the look's thread is not stopped)
    assert check_all_live(snap, feed) > 0
    check_sample(snap, feed, 32)
    snap.close()
