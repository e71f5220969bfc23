"""Hostile cases for ``NativeFeed`` (``device/native.py``): the CPU feed whose
thread's whole life is one compiled call (``core.feed.serve_kernel``) that
gathers posted slots without the GIL, the draw, post, wait and check running
in the learner's ``next()``.

What is attacked: the job ring between the learner and the thread (more jobs
in flight than it holds), exactness against a twin's ``sample(B).to_torch()``
with every batch held, tiny buffers, frames wrapping the ring, writers and
priority updates from other threads, restores with batches in flight, two
samplers on one buffer, threads that must end (close, buffer close or drop, a
sampler dropped, interpreter exit, Ctrl-C inside ``next()``), a thread that
must sleep when idle, ``ready``.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
import bigper.core.feed as plan  # noqa: E402
from bigper.device.native import NativeFeed  # noqa: E402
from tests.device.test_feed import _add, _atari_like, _check_rows, _np  # noqa: E402

pytestmark = pytest.mark.skipif(os.name != "posix", reason="NativeFeed is the POSIX CPU feed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a crash or a hang there is a result, not the end of the run)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _same_batch(got, want, what=""):
    assert list(got) == list(want), what
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (what, k)
        np.testing.assert_array_equal(_np(got[k]), _np(want[k]), err_msg=f"{what} {k}")


def _feed_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "bigper-feed"]


def _wait_gone(threads, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(t.is_alive() for t in threads):
            return True
        time.sleep(0.01)
    return False


def _wide(capacity, width, seed=5):
    """Rows of ``width`` bytes, each row's bytes and ``step`` field say its step (a stale or foreign row shows)."""
    buf = bigper.PrioritizedReplayBuffer(capacity=capacity, fields={"x": ((width,), np.uint8), "step": ((), np.int64)},
                                         seed=seed)
    g = np.arange(capacity)
    buf.extend({"x": np.broadcast_to((g % 251).astype(np.uint8)[:, None], (capacity, width)).copy(), "step": g,
                "terminated": np.zeros(capacity, bool)})
    return buf


# ---------------------------------------------------------------------------------------------
# The job ring: more jobs in flight than it has entries
# ---------------------------------------------------------------------------------------------


def test_more_jobs_posted_at_once_than_the_ring_holds_are_each_gathered():
    """prefetch=200: the learner keeps every batch until every pool slot is kept, then lets them
    all go; the next ``next()`` posts ~200 jobs in one burst to a thread that slept (idle), whose
    gathers (1 MB each) are slower than the draws. Posted minus done then passes the ring's 64
    entries: a job not yet taken was overwritten by a later one, so one slot was gathered twice
    and another never (its bytes a batch from before). Every batch must equal the twin's."""
    b, p = 64, 200
    buf, twin = _wide(300, 16384), _wide(300, 16384)
    it = buf.sampler(b, prefetch=p, device="cpu")
    assert isinstance(it, NativeFeed)
    lag = [0]
    real = plan.post_kernel

    def post(ctl, jobs, slot, n_ids):  # (the real post; records how far the thread is behind)
        n = real(ctl, jobs, slot, n_ids)
        lag[0] = max(lag[0], int(ctl[plan.POSTED] - ctl[plan.DONE]))
        return n

    plan.post_kernel = post
    try:
        held = []
        for i in range(p + 6):
            t = next(it)
            _same_batch(t, twin.sample(b).to_torch(), f"held {i}")
            held.append(t)
        del t
        held.clear()
        gc.collect()
        time.sleep(0.4)  # the thread idles: it looks every ms now
        for i in range(p + 20):
            _same_batch(next(it), twin.sample(b).to_torch(), f"after the burst, batch {i} (lag {lag[0]})")
    finally:
        plan.post_kernel = real
        it.close()
    assert lag[0] > 0


# ---------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 1024])
def test_every_batch_held_equals_the_twins_and_never_changes(prefetch):
    buf, twin = _atari_like(capacity=64), _atari_like(capacity=64)
    for x in (buf, twin):
        _add(x, 0, 150)  # frames wrap the ring
    it = buf.sampler(4, prefetch=prefetch, device="cpu")
    assert isinstance(it, NativeFeed)
    held, copies = [], []
    for i in range(40 if prefetch == 1 else 12):
        t = next(it)
        _same_batch(t, twin.sample(4).to_torch(), f"batch {i}")
        _check_rows(t)
        held.append(t)
        copies.append({k: v.clone() for k, v in t.items()})
    for t, c in zip(held, copies):
        for k in c:
            assert torch.equal(t[k], c[k]), k
    it.close()


def test_a_buffer_of_capacity_1_and_batches_larger_than_it():
    bufs = []
    for _ in range(2):
        b = bigper.PrioritizedReplayBuffer(capacity=1, fields={"obs": ((4, 3, 2), np.uint8), "r": ((), np.float32)},
                                           frame_stack=4, seed=1)
        bufs.append(b)
    buf, twin = bufs
    it = None
    for g in range(5):  # each step overwrites the only row; frames wrap at every step
        for x in (buf, twin):
            fr = np.full((4, 3, 2), g, np.uint8)
            x.add(obs=fr, next_obs=fr + 1, r=np.float32(g), terminated=False)
        if it is None:
            it = buf.sampler(8, prefetch=2, device="cpu")
            assert isinstance(it, NativeFeed)
        t = next(it)
        assert _np(t["r"]).shape == (8,)
        assert np.isin(_np(t["r"]), np.arange(g + 1)).all()
    it.close()
    it = buf.sampler(8, prefetch=2, device="cpu")
    for i in range(5):
        _same_batch(next(it), twin.sample(8).to_torch(), f"batch {i}")
    it.close()


# ---------------------------------------------------------------------------------------------
# Other threads: writers, updates, a second sampler
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_writers_and_two_updaters_while_next_runs(tmp_path, storage):
    buf = _atari_like(tmp_path / "b" if storage == "memmap" else None, capacity=64)
    _add(buf, 0, 64)
    it = buf.sampler(8, prefetch=3, device="cpu")
    stop = threading.Event()
    errors = []
    seen = []

    def writer():
        g = 64
        try:
            while not stop.is_set():
                _add(buf, g, 7)  # frames wrap over and over
                g += 7
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def updater(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                if seen:
                    t = seen[-1]
                    buf.update_priorities(t, rng.random(8) + 0.01)
        except bigper.BigperError:
            pass  # a stale generation may be refused; the buffer goes on
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=updater, args=(s,)) for s in (1, 2)]
    for th in threads:
        th.start()
    try:
        for _ in range(150):
            t = next(it)
            _check_rows(t)
            seen.append({"indices": t["indices"].clone(), "generations": t["generations"].clone()})
    finally:
        stop.set()
        for th in threads:
            th.join(20)
    assert not errors, errors
    leaves = buf.leaves(np.arange(buf.capacity))
    assert np.isclose(buf.total_priority, leaves.sum(), rtol=1e-6)
    it.close()
    buf.close()


def test_two_samplers_on_one_buffer():
    buf = _atari_like(capacity=64)
    _add(buf, 0, 200)
    a = buf.sampler(8, prefetch=2, device="cpu")
    b = buf.sampler(5, prefetch=7, device="cpu")
    ka, kb = [], []
    g = 200
    for i in range(30):
        ka.append(next(a))
        kb.append(next(b))
        if i % 5 == 0:
            _add(buf, g, 3)
            g += 3
    for t in ka + kb:
        _check_rows(t)
    assert len(_feed_threads()) >= 2
    threads = _feed_threads()
    a.close()
    for _ in range(10):
        _check_rows(next(b))
    buf.close()
    assert _wait_gone(threads)
    with pytest.raises(bigper.BufferClosedError):
        next(b)


# ---------------------------------------------------------------------------------------------
# Restores with batches in flight
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 3, 64])
def test_a_restore_to_fewer_rows_with_batches_in_flight(prefetch):
    buf = _atari_like(capacity=400)
    _add(buf, 0, 60)
    meta, arrays = buf.state_dict()
    small = (meta, {k: np.array(v, copy=True) for k, v in arrays.items()})
    _add(buf, 60, 340)
    it = buf.sampler(16, prefetch=prefetch, device="cpu")
    for _ in range(3):
        next(it)
    time.sleep(0.05)  # the thread gathered what was posted
    buf.load_state(*small)
    assert len(buf) == 60
    for i in range(prefetch + 5):
        t = next(it)
        idx = _np(t["indices"])
        assert (idx < 60).all(), (i, idx)
        rows = buf.gather(idx)  # (a restored state keeps the storage's bytes: frames since overwritten show)
        for k in ("obs", "next_obs", "step", "reward"):
            np.testing.assert_array_equal(_np(t[k]), rows[k], err_msg=f"batch {i} {k}")
        np.testing.assert_array_equal(_np(t["generations"]), _np(t["step"]))
    it.close()


def test_a_restore_and_writes_between_every_next_match_a_serial_twin():
    """prefetch=1 after a restore: each next() checks the batch drawn ahead (a restore since: drawn
    again). What the twin does: the same restore and writes, then sample."""
    buf, twin = _atari_like(capacity=100), _atari_like(capacity=100)
    for x in (buf, twin):
        _add(x, 0, 100)
    meta, arrays = buf.state_dict()
    saved = (meta, {k: np.array(v, copy=True) for k, v in arrays.items()})
    it = buf.sampler(8, prefetch=1, device="cpu")
    for i in range(20):
        for x in (buf, twin):
            x.load_state(*saved)
            _add(x, 100 + i, 5)
        got = next(it)
        want = twin.sample(8).to_torch()
        # a batch drawn ahead was drawn again after the restore: the twin's draw after it
        _same_batch(got, want, f"round {i}")
        # the draw ahead of this round took a draw of the twin's stream too
        twin.sample(8)
    it.close()


# ---------------------------------------------------------------------------------------------
# The thread's end
# ---------------------------------------------------------------------------------------------


def test_a_sampler_never_iterated_and_dropped_makes_no_thread():
    buf = _atari_like()
    _add(buf, 0, 100)
    before = set(_feed_threads())
    it = buf.sampler(8, prefetch=2, device="cpu")
    ref = weakref.ref(it)
    del it
    gc.collect()
    assert ref() is None
    assert set(_feed_threads()) <= before
    buf.close()


@pytest.mark.parametrize("how", ["close", "drop_sampler", "buffer_close", "drop_buffer"])
def test_the_thread_ends(tmp_path, how):
    buf = _atari_like(tmp_path / "b")
    _add(buf, 0, 200)
    before = set(_feed_threads())
    it = buf.sampler(8, prefetch=4, device="cpu")
    t = next(it)
    new = [x for x in _feed_threads() if x not in before]
    assert len(new) == 1 and new[0].is_alive()
    copy = {k: v.clone() for k, v in t.items()}
    if how == "close":
        it.close()
    elif how == "drop_sampler":
        del it
        gc.collect()
    elif how == "buffer_close":
        buf.close()
    else:
        ref = weakref.ref(buf)
        del buf
        gc.collect()
        assert ref() is None
    assert _wait_gone(new), how
    for k in copy:  # the batch held outlives its sampler and its buffer's mappings
        assert torch.equal(t[k], copy[k]), k
    _check_rows(t)
    if how in ("buffer_close", "drop_buffer"):
        with pytest.raises(bigper.BufferClosedError):
            next(it)
        with _atari_like(tmp_path / "b", mode="resume") as back:
            assert len(back) == 200


def test_an_idle_thread_sleeps():
    """The thread looks every ~ms once idle: an idle sampler must not burn a core."""
    buf = _atari_like()
    _add(buf, 0, 200)
    before = set(_feed_threads())
    it = buf.sampler(8, prefetch=2, device="cpu")
    next(it)
    (th,) = [x for x in _feed_threads() if x not in before]
    tid = th.native_id

    def cpu():
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)
    c0, w0 = cpu(), time.monotonic()
    time.sleep(1.5)
    used = (cpu() - c0) / (time.monotonic() - w0)
    assert used < 0.25, f"idle feed thread used {used:.0%} of a core"
    it.close()


def test_ready_counts_gathered_batches_up_to_prefetch():
    buf = _atari_like()
    _add(buf, 0, 200)
    for p in (1, 5):
        it = buf.sampler(8, prefetch=p, device="cpu")
        assert it.ready == 0
        next(it)
        end = time.monotonic() + 5
        while it.ready < p and time.monotonic() < end:
            time.sleep(0.01)
        assert it.ready == p
        for _ in range(3):
            next(it)
            assert 0 <= it.ready <= p
        it.close()
        assert it.ready == 0 or it.ready <= p


def test_interpreter_exit_with_live_samplers(tmp_path):
    r = _run_script(f"""
        import numpy as np
        from tests.device.test_feed import _add, _atari_like
        a = _atari_like({str(tmp_path / "m")!r})
        _add(a, 0, 300)
        b = _atari_like()
        _add(b, 0, 300)
        its = [a.sampler(8, prefetch=3, device="cpu"), b.sampler(8, prefetch=3, device="cpu"),
               a.sampler(4, prefetch=64, device="cpu")]
        held = [next(i) for i in its for _ in range(3)]
        print("exiting")
    """, timeout=60)
    assert r.returncode == 0 and "exiting" in r.stdout, (r.returncode, r.stderr[-1500:])
    with _atari_like(tmp_path / "m", mode="resume") as back:
        assert len(back) == 300


def test_fork_while_the_thread_gathers(tmp_path):
    r = _run_script(f"""
        import os, threading, time
        import bigper
        from tests.device.test_feed import _add, _atari_like, _check_rows
        buf = _atari_like()
        _add(buf, 0, 400)
        it = buf.sampler(64, prefetch=8, device="cpu")
        stop = threading.Event()
        def learner():  # keeps the thread gathering while the fork happens
            while not stop.is_set():
                _check_rows(next(it))
        th = threading.Thread(target=learner)
        th.start()
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            try:
                try:
                    next(it)
                    code = 3
                except bigper.BufferClosedError:
                    code = 0
                except BaseException:
                    code = 4
                it2 = buf.sampler(8, prefetch=2, device="cpu")  # a new sampler in the child works
                _check_rows(next(it2))
                it2.close()
            except BaseException:
                code = 5
            os._exit(code)
        for _ in range(300):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = "hung"
        stop.set()
        th.join(20)
        _check_rows(next(it))
        print("child", status if status == "hung" else os.waitstatus_to_exitcode(status))
    """, timeout=90)
    assert r.returncode == 0 and "child 0" in r.stdout, (r.returncode, r.stdout[-800:], r.stderr[-1500:])


def test_ctrl_c_inside_next_leaves_the_buffer_usable():
    r = _run_script("""
        import os, signal, threading, time
        import numpy as np
        import bigper
        from tests.device.test_feed import _add, _atari_like, _check_rows
        buf = _atari_like(capacity=200)
        _add(buf, 0, 200)
        stop = threading.Event()
        armed = [False]
        def handler(signum, frame):  # a KeyboardInterrupt only inside next(): the script's own code is spared
            if armed[0]:
                raise KeyboardInterrupt
        signal.signal(signal.SIGINT, handler)
        def bomb():
            while not stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.0003)
        interrupts = 0
        for rnd in range(20):
            it = buf.sampler(32, prefetch=3, device="cpu")
            th = threading.Thread(target=bomb)
            th.start()
            try:
                for _ in range(200):
                    try:
                        armed[0] = True
                        try:
                            t = next(it)
                        finally:
                            armed[0] = False
                        _check_rows(t)
                    except KeyboardInterrupt:
                        interrupts += 1
                        break
            finally:
                stop.set()
                th.join()
                stop.clear()
            it.close()
            ok = []
            w = threading.Thread(target=lambda: ok.append(_add(buf, 200 + rnd, 1)))
            w.start()
            w.join(5)
            assert ok, "the buffer's lock was left held by an interrupted next()"
        it = buf.sampler(8, prefetch=2, device="cpu")
        _check_rows(next(it))
        it.close()
        print("interrupts", interrupts)
    """, timeout=120)
    assert r.returncode == 0 and "interrupts" in r.stdout, (r.returncode, r.stdout[-800:], r.stderr[-2000:])


@pytest.mark.parametrize("prefetch", [1, 3])
def test_priority_updates_between_next_calls_match_a_twin_that_draws_ahead(prefetch):
    """The batches ``prefetch`` ahead are drawn before the learner's update of the one it holds:
    the twin draws as far ahead, then applies the same updates."""
    buf, twin = _atari_like(capacity=128), _atari_like(capacity=128)
    for x in (buf, twin):
        _add(x, 0, 300)
    it = buf.sampler(16, prefetch=prefetch, device="cpu")
    rng = np.random.default_rng(0)
    ahead = [twin.sample(16).to_torch() for _ in range(prefetch)]
    for i in range(25):
        got = next(it)
        ahead.append(twin.sample(16).to_torch())
        want = ahead.pop(0)
        _same_batch(got, want, f"batch {i}")
        p = torch.tensor(rng.random(16) * 10 + 0.01)
        buf.update_priorities(got, p)
        twin.update_priorities(want, p)
    np.testing.assert_array_equal(buf.leaves(np.arange(128)), twin.leaves(np.arange(128)))
    it.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_ctrl_c_caught_by_the_learner_does_not_end_the_iteration(prefetch):
    r = _run_script("""
        import os, signal, threading, time
        from tests.device.test_feed import _add, _atari_like, _check_rows
        buf = _atari_like(capacity=400)
        _add(buf, 0, 400)
        armed, got = [False], [False]
        def handler(signum, frame):
            if armed[0]:
                raise KeyboardInterrupt
        signal.signal(signal.SIGINT, handler)
        it = buf.sampler(256, prefetch=PREFETCH, device="cpu")
        def bomb():
            while not got[0]:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.0005)
        th = threading.Thread(target=bomb)
        th.start()
        for _ in range(5000):
            armed[0] = True
            try:
                next(it)
            except KeyboardInterrupt:
                got[0] = True
            finally:
                armed[0] = False
            if got[0]:
                break
        got[0] = True
        th.join()
        try:
            _check_rows(next(it))
            print("after the interrupt: a batch")
        except StopIteration:
            print("after the interrupt: StopIteration")
    """.replace("PREFETCH", str(prefetch)), timeout=60)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "after the interrupt: a batch" in r.stdout, r.stdout
