"""Promise 10: every public method takes the buffer's one lock and checks that
the buffer is open inside it. Two threads call any two public methods (the
pair drawn by Hypothesis, on memory and memmap storage, proportional and rank)
for a while; the interpreter survives, every refusal is bigper's, nothing is
written after close, and the buffer's invariants hold afterwards."""

from __future__ import annotations

import gc
import itertools
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from bigper import BigperError, BufferClosedError, StorageLockedError
from tests import hook

CAP = 48
FIELDS = {"obs": ((3,), np.float32), "reward": ((), np.float32)}


def make(tmp, storage, prio, mode="new"):
    kw = {} if storage == "memory" else {"path": tmp / "replay", "mode": mode}
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, prioritization=prio, seed=0, **kw)
    if mode == "new":
        for i in range(30):
            buf.add(obs=np.full(3, i, np.float32), reward=float(i), next_obs=np.full(3, i + 1, np.float32))
    return buf


class Calls:
    """The public methods, each as a callable of (buffer, call number)."""

    def __init__(self, tmp, prio):
        self.tmp, self.prio = tmp, prio
        self.closed_at = None  # count held when close ran
        self.rng = np.random.default_rng(0)
        self.saves = itertools.count()

    def add(self, buf, k):
        buf.add(obs=np.full(3, k, np.float32), reward=float(k), next_obs=np.full(3, k + 1, np.float32))

    def extend(self, buf, k):
        buf.extend({"obs": np.full((3, 3), k, np.float32), "reward": np.full(3, k, np.float32),
                    "next_obs": np.full((3, 3), k + 1, np.float32)})

    def sample(self, buf, k):
        b = buf.sample(8)
        # a batch from a half-changed tree could weigh more than the largest possible weight
        assert (b.weights <= 1 + 1e-9).all(), b.weights

    def update(self, buf, k):
        b = buf.sample(4)
        buf.update_priorities(b, self.rng.random(4) * 3)

    def update_raw(self, buf, k):
        buf.update_priorities(np.arange(k % 5, k % 5 + 4), self.rng.random(4) + 0.1)

    def assign(self, buf, k):
        buf.assign_priorities(self.rng.random(CAP) * 5)

    def gather(self, buf, k):
        live = np.flatnonzero(buf.status == 1)
        if live.size:
            try:
                buf.gather(live[:5])
            except bigper.InvalidIndexError:
                pass  # overwritten between the two calls: a refusal, never wrong bytes

    def read(self, buf, k):
        len(buf), buf.total_priority, buf.shard.max_leaf, buf.shard.min_leaf, buf.leaves(np.arange(CAP)), buf.beta

    def state(self, buf, k):
        buf.state_dict()

    def sample_at(self, buf, k):
        if self.prio == "proportional":
            t = buf.total_priority
            buf.shard.sample_at(np.array([0.0, t / 2]) if t > 0 else np.array([0.0]), beta=0.4)

    def raise_max(self, buf, k):
        buf.shard.raise_max_leaf(1.5)

    def save(self, buf, k):
        buf.save(self.tmp / f"snap-{next(self.saves)}")

    def sampler(self, buf, k):
        it = buf.sampler(4, prefetch=2)
        try:
            next(it)
        finally:
            it.close()

    def close(self, buf, k):
        if k == 3:  # part of the way through
            with buf._guard.lock:
                if not buf.closed:
                    self.closed_at = (len(buf), buf.total_priority)
                buf.close()


METHODS = [m for m in vars(Calls) if not m.startswith("_")]


def hammer(buf, calls, names, rounds=12):
    errors = []

    def run(name):
        fn = getattr(calls, name)
        for k in range(rounds):
            try:
                fn(buf, k)
            except BufferClosedError:
                pass  # after the other thread closed it
            except BigperError as e:  # any other refusal is a bug in a well-formed call
                errors.append(f"{name}: {type(e).__name__}: {e}")
            except AssertionError as e:
                errors.append(f"{name}: {e}")
            except Exception as e:  # noqa: BLE001  (a raw exception escaping is the failure)
                errors.append(f"{name}: raw {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    return errors


def check_after(buf, calls, tmp, storage, prio):
    if buf.closed:
        # nothing changed after close: same count and total as when it closed
        assert (len(buf), buf.total_priority) == calls.closed_at
        if storage != "memory":
            with make(tmp, storage, prio, mode="resume") as back:
                assert len(back) == calls.closed_at[0]
                assert back.total_priority == pytest.approx(calls.closed_at[1])
        return
    problems = buf.prioritization.check(buf.status)
    assert not problems, problems
    live = buf.status == 1
    assert (buf.leaves(np.arange(CAP))[~live] == 0).all()
    b = buf.sample(16)
    assert live[b.indices].all() and (b.weights <= 1 + 1e-9).all()
    buf.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(pair=st.tuples(st.sampled_from(METHODS), st.sampled_from(METHODS)),
       storage=st.sampled_from(["memory", "memmap"]), prio=st.sampled_from(["proportional", "rank"]))
def test_any_two_public_methods_from_two_threads(tmp_path_factory, pair, storage, prio):
    tmp = tmp_path_factory.mktemp("pair")
    buf = make(tmp, storage, prio)
    calls = Calls(tmp, prio)
    errors = hammer(buf, calls, pair)
    assert not errors, errors
    check_after(buf, calls, tmp, storage, prio)


@pytest.mark.parametrize("prio", ["proportional", "rank"])
def test_assign_races_update_without_crash_or_overweight_batches(tmp_path, prio):
    """The issue's case: rank's assign_priorities took no lock and crashed the
    interpreter against update_priorities; proportional returned weights > 1."""
    buf = make(tmp_path, "memory", prio)
    calls = Calls(tmp_path, prio)
    errors = hammer(buf, calls, ["assign", "update", "sample", "assign"], rounds=150)
    assert not errors, errors
    check_after(buf, calls, tmp_path, "memory", prio)


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_add_racing_close_writes_nothing_after_close(tmp_path, storage):
    kw = {} if storage == "memory" else {"path": tmp_path / ("r.h5" if storage == "hdf5" else "r")}
    for attempt in range(20):
        if storage != "memory":
            kw["path"] = tmp_path / f"r{attempt}{'.h5' if storage == 'hdf5' else ''}"
        buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, **kw)
        calls = Calls(tmp_path, "proportional")
        errors = hammer(buf, calls, ["add", "extend", "close"], rounds=8)
        assert not errors, errors
        assert buf.closed
        assert len(buf) == calls.closed_at[0]
        if storage != "memory":
            with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, mode="resume", **kw) as back:
                assert len(back) == calls.closed_at[0]


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_dropping_a_buffer_with_a_live_sampler_releases_its_lock_at_once(tmp_path, storage):
    path = tmp_path / ("r.h5" if storage == "hdf5" else "r")
    for _ in range(10):
        buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, mode="overwrite"
                                             if path.exists() else "new")
        for i in range(10):
            buf.add(obs=np.zeros(3, np.float32), reward=1.0, next_obs=np.ones(3, np.float32))
        it = buf.sampler(4, prefetch=2)
        next(it)
        del buf, it
        gc.collect()
        try:  # at once: no wait for the thread to notice
            again = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, mode="resume")
        except StorageLockedError as e:
            pytest.fail(f"the dropped buffer still holds its lock: {e}")
        assert len(again) == 10
        again.close()


def test_sample_out_never_writes_into_the_buffer(tmp_path):
    from tests.buffer.test_validation import assert_same, fingerprint

    buf = make(tmp_path, "memory", "proportional")
    before = fingerprint(buf)
    meta, arrays = buf.state_dict()
    cases = {
        "stored data": {"obs": buf.storage.arrays["obs"][:8]},
        "generations": {"reward": arrays["gid"][:4].view(np.float32)},
        "the tree's leaves": {"discount": buf.prioritization.tree.leaves[:4].view(np.float32)},
        "slot status": {"terminated": arrays["status"][:8].view(bool)},
    }
    for what, out in cases.items():
        with pytest.raises(bigper.InvalidArgumentError, match="shares memory with the buffer"):
            buf.sample(8, out=out)
        assert_same(before, fingerprint(buf))
    mine = {"obs": np.empty((8, 3), np.float32)}
    b = buf.sample(8, out=mine)
    assert b["obs"] is mine["obs"]


# -- attack round: re-entrancy, fork (issue 23 §1) ------------------------------------

def _new(tmp, storage):
    kw = {} if storage == "memory" else {"path": tmp / ("r.h5" if storage == "hdf5" else "r")}
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, seed=0, **kw)
    for i in range(10):
        buf.add(obs=np.full(3, i, np.float32), reward=float(i), next_obs=np.full(3, i + 1, np.float32))
    return buf, kw


class _ClosesOnConversion:
    """An input whose conversion to numpy closes the buffer it is given to (a
    callback, a lazy value, a tensor subclass): close() runs on this thread,
    inside the buffer's own method, under its (re-entrant) lock."""

    def __init__(self, buf, value):
        self.buf, self.value = buf, value

    def __array__(self, dtype=None, copy=None):
        self.buf.close()
        return self.value


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
@pytest.mark.parametrize("call", ["add", "extend", "update_priorities"])
def test_close_from_inside_a_method_of_the_same_buffer_is_refused_and_writes_nothing(tmp_path, storage, call):
    from tests.buffer.test_validation import assert_same, fingerprint

    buf, kw = _new(tmp_path, storage)
    before = fingerprint(buf)
    calls = {
        "add": lambda: buf.add(obs=_ClosesOnConversion(buf, np.zeros(3, np.float32)), reward=1.0,
                               next_obs=np.ones(3, np.float32)),
        "extend": lambda: buf.extend({"obs": _ClosesOnConversion(buf, np.zeros((2, 3), np.float32)),
                                      "reward": np.ones(2, np.float32), "next_obs": np.ones((2, 3), np.float32)}),
        "update_priorities": lambda: buf.update_priorities(np.arange(4), _ClosesOnConversion(buf, np.full(4, 7.0))),
    }
    with pytest.raises(BigperError, match="close"):
        calls[call]()
    assert not buf.closed  # the close was refused, the method too: nothing half-done
    assert_same(before, fingerprint(buf))
    buf.add(obs=np.zeros(3, np.float32), reward=1.0, next_obs=np.ones(3, np.float32))  # still works
    buf.close()
    if storage != "memory":
        with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, mode="resume", **kw) as back:
            assert len(back) == 11


def _in_a_fresh_pytest(request) -> bool:
    """Run this test again in a fresh pytest process and report its result
    (True: done here). A fork of the suite's own process copies whatever
    other modules left in it, Ray's threads and exit handlers among them,
    and the forked child can hang in those; a fresh process holds only bigper."""
    import os
    import subprocess
    import sys

    if os.environ.get("BIGPER_FRESH_PROCESS") == "1":
        return False
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       env={**os.environ, "BIGPER_FRESH_PROCESS": "1"}, capture_output=True, text=True,
                       timeout=300, cwd=str(request.config.rootpath))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout, r.stdout[-2000:]
    return True


def _fork_and_run(child) -> int:
    """Fork; the child runs ``child()`` and exits as a script or a worker that
    returns does: the exit handlers run (``atexit``), then the process ends
    (``os._exit``: the forked copy of pytest must not run on)."""
    import atexit
    import os

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            code = child() or 0
            atexit._run_exitfuncs()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_forked_child_never_closes_or_writes_the_parents_disk_buffer(tmp_path, storage, request):
    """A process forked while a disk buffer is open (a launcher, a worker pool
    with the fork start method) shares its files and its flock. Its exit ran
    the exit handler: the parent's folder was marked clean with the child's
    state and the lock released, so a second writer opened the parent's live
    path. In the child the buffer is closed without touching anything, and
    says why."""
    import warnings

    from tests._hostile_snapshot_cases import fingerprint as files

    if _in_a_fresh_pytest(request):
        return
    buf, kw = _new(tmp_path, storage)
    buf.storage.flush()
    before = files(tmp_path)

    def child():
        try:
            buf.add(obs=np.zeros(3, np.float32), reward=1.0, next_obs=np.ones(3, np.float32))
        except BufferClosedError as e:
            return 0 if "fork" in str(e) else 4
        return 5  # the child wrote into the parent's files

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (numba's)
        assert _fork_and_run(child) == 0
    assert files(tmp_path) == before  # the child recorded nothing
    with pytest.raises(StorageLockedError):  # and the parent still holds its lock
        bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, mode="resume", **kw)
    buf.add(obs=np.zeros(3, np.float32), reward=1.0, next_obs=np.ones(3, np.float32))
    buf.close()
    with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, mode="resume", **kw) as back:
        assert len(back) == 11


def test_a_forked_child_samples_a_memory_buffer_even_when_a_thread_held_its_lock(tmp_path, request):
    """A memory buffer is the child's own copy: it stays usable there, even
    if another thread was inside one of its methods (a long save, a draw of
    the sampler) at the moment of the fork: the child has no such thread to
    release the lock, and must not see a half-done change either."""
    import time
    import warnings

    if _in_a_fresh_pytest(request):
        return
    buf, _ = _new(tmp_path, "memory")
    inside, done = threading.Event(), threading.Event()

    def long_call():  # stands for a method half-way through a change, under the lock
        with buf._guard.lock:
            hook.ring(buf).count += 1000
            inside.set()
            time.sleep(0.3)
            hook.ring(buf).count -= 1000
        done.set()

    def child():
        import signal
        signal.alarm(20)  # a deadlock fails the test instead of hanging it
        if len(buf) != 10:
            return 7  # the copy caught the other thread half-way
        b = buf.sample(4)
        buf.add(obs=np.zeros(3, np.float32), reward=1.0, next_obs=np.ones(3, np.float32))
        return 0 if len(b.indices) == 4 and len(buf) == 11 else 6

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(3):
            inside.clear()
            t = threading.Thread(target=long_call)
            t.start()
            inside.wait()
            assert _fork_and_run(child) == 0
            t.join()
    assert len(buf) == 10
    buf.close()


def test_a_sampler_loop_learns_that_its_buffer_was_closed(tmp_path):
    """A learner iterating a sampler while another thread closes the buffer gets
    BufferClosedError, never a silent end of its loop (StopIteration); the
    iterator's own close() still ends it quietly."""
    buf = make(tmp_path, "memory", "proportional")
    it = buf.sampler(4, prefetch=2)
    next(it)
    closer = threading.Timer(0.05, buf.close)
    closer.start()
    with pytest.raises(BufferClosedError):
        for _ in it:
            pass
    closer.join()
    other = make(tmp_path, "memory", "rank")
    quiet = other.sampler(4, prefetch=2)
    next(quiet)
    quiet.close()
    assert list(quiet) == []
    other.close()
