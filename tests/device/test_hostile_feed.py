"""Hostile cases for the feed (``core/feed.py``, ``device/feed.py``): the path a
``sampler(B, prefetch, device=...)`` takes for n_step=1 transitions with
proportional priorities and raw frames.

The attack on it found nine bugs (a learner's swapped or renamed keys, numpy
views of the host indices, in-place metadata edits and ``share_memory_`` not
seen as holding a slot; a failed, rolled-back write and a restore racing the
gather; a redraw that took a second draw; more batches ready than
``prefetch``; a forked child taking the parent's batches; a close under the
lock deadlocking): each is a test here, fixed since. A row of a
batch is checked self-consistent the way ``test_feed.py`` does it: the pixels
of step g's newest frame, its ``step`` field, its reward and its generation all
say g (``_add``/``_check_rows``), so a torn or foreign row shows.

CPU everywhere; CUDA cases run where a GPU is present.
"""

from __future__ import annotations

import errno
import gc
import os
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
from bigper.device.feed import FeedSampler  # noqa: E402
from bigper.device.native import NativeFeed  # noqa: E402
from tests.buffer.test_validation import assert_same, fingerprint  # noqa: E402
from tests.device.test_feed import _add, _atari_like, _check_rows, _np  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _twin_pair(tmp_path=None, capacity=400, n=400, **kw):
    bufs = []
    for name in "ab":
        b = _atari_like(None if tmp_path is None else tmp_path / name, capacity=capacity, **kw)
        _add(b, 0, n)
        bufs.append(b)
    return bufs


def _same_batch(got, want):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(_np(got[k]), _np(want[k]), err_msg=k)


def _leaves(buf):
    return buf.leaves(np.arange(buf.capacity))


def _run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a crash or a hang there is a result, not the end of the run)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture
def threaded(monkeypatch):
    """The feed's threaded sampler (``FeedSampler``: CUDA's path, and ``prefetch=0``) for a CPU
    sampler with prefetch too, where a test's subject is that thread."""
    from bigper.device import native

    monkeypatch.setattr(native, "feed_sampler", FeedSampler)


class _GatherHook:
    """Replaces the feed's lock-free gather (``core.feed.gather_kernel``, the
    name ``Filler.fill`` calls) so that a test runs ``during()`` between the
    draw and the gather of the next batch, or blocks the gather on events.
    On the CPU with prefetch (``NativeFeed``: a compiled thread gathers) the
    hook is the learner's wait for a posted batch (``core.feed.wait_kernel``):
    ``during()`` runs after the draw, while (or after) the thread gathers, and
    before the check."""

    def __init__(self, monkeypatch, during=None, before=None):
        self.real = plan.gather_kernel
        self.real_wait = plan.wait_kernel
        self.during, self.before = during, before
        self.armed = True
        monkeypatch.setattr(plan, "gather_kernel", self)
        monkeypatch.setattr(plan, "wait_kernel", self.wait)

    def wait(self, ctl, job):
        if not self.armed:
            return self.real_wait(ctl, job)
        self.armed = False
        if self.during is not None:
            self.during()
        got = self.real_wait(ctl, job)
        if self.before is not None:
            self.before()
        return got

    def __call__(self, *args):
        if self.armed:
            self.armed = False
            if self.during is not None:
                self.during()
            self.real(*args)
            if self.before is not None:
                self.before()
            return None
        return self.real(*args)


# ---------------------------------------------------------------------------------------------
# Bugs: a learner that changes what it was handed (the slot is refilled under it, or carries
# the change into later batches). ``Slot.unheld`` counts Python references and torch storage
# uses; anything that changes a slot without changing those counts slips through.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["swap", "rename"])
def test_keys_swapped_or_renamed_by_the_learner_never_reach_later_batches(device, how):
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=0, device=device)
    t = next(it)
    keys = list(t)
    if how == "swap":
        t["obs"], t["next_obs"] = t["next_obs"], t["obs"]
    else:
        t["r"] = t.pop("reward")
    del t
    for _ in range(8):
        t = next(it)
        assert list(t) == keys
        _check_rows(t)
    del t
    it.close()
    buf.close()


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_views_of_the_host_indices_are_held_like_the_tensors(device):
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=0, device=device)
    kept = []
    for _ in range(6):
        t = next(it)
        kept.append((t.host["indices"][:], t.host["generations"].reshape(-1), _np(t["indices"]).copy(),
                     _np(t["generations"]).copy()))
    del t
    for _ in range(10):
        next(it)
    for idx, gen, idx0, gen0 in kept:
        np.testing.assert_array_equal(idx, idx0)
        np.testing.assert_array_equal(gen, gen0)
    it.close()
    buf.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit", ["unsqueeze_", "requires_grad_"])
def test_in_place_metadata_edits_never_reach_later_batches(device, edit):
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=0, device=device)
    for _ in range(8):
        t = next(it)
        assert tuple(t["reward"].shape) == (8,) and not t["reward"].requires_grad
        assert tuple(t["discount"].shape) == (8,)
        getattr(t["reward"], edit)(*((1,) if edit == "unsqueeze_" else ()))
        t["discount"].unsqueeze_(-1) if edit == "unsqueeze_" else None
    del t
    it.close()
    buf.close()


def test_a_batch_tensor_sent_through_torch_multiprocessing_never_corrupts_the_feed():
    r = _run_script("""
        import sys
        import numpy as np
        from multiprocessing.reduction import ForkingPickler
        import torch, torch.multiprocessing  # noqa: F401 (registers torch's reductions)
        from tests.device.test_feed import _add, _atari_like, _check_rows
        buf = _atari_like()
        _add(buf, 0, 400)
        it = buf.sampler(8, prefetch=0, device="cpu")
        t = next(it)
        ForkingPickler.dumps(t["obs"])  # what mp.Queue.put does with a tensor
        del t
        for _ in range(40):
            t = next(it)
            _check_rows(t)
        print("consistent")
    """)
    assert r.returncode == 0 and "consistent" in r.stdout, (r.returncode, r.stderr[-1500:])


# ---------------------------------------------------------------------------------------------
# Bugs: the lock-free gather and the intact check
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_a_failed_rolled_back_write_never_reach_a_batch(monkeypatch, device):
    buf = _atari_like(capacity=64)
    _add(buf, 0, 64)
    before = fingerprint(buf)
    it = buf.sampler(16, prefetch=0, device=device)
    next(it)
    drawn, written, gathered = threading.Event(), threading.Event(), threading.Event()

    def in_gather():
        drawn.set()
        written.wait(10)

    _GatherHook(monkeypatch, during=in_gather, before=gathered.set)
    frames, real_write, calls = buf._frames, buf._frames.write, [0]

    def failing_write(*a, **k):  # the second chunk of a write of more rows than slots fails (a full disk)
        calls[0] += 1
        if calls[0] == 2:
            written.set()
            gathered.wait(10)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_write(*a, **k)

    monkeypatch.setattr(frames, "write", failing_write)
    failed = []

    def writer():
        drawn.wait(10)
        try:
            _add(buf, 64, 100)
        except OSError as e:
            failed.append(e)

    th = threading.Thread(target=writer)
    th.start()
    t = next(it)
    th.join()
    monkeypatch.undo()
    assert failed  # the write failed and changed nothing ...
    after = fingerprint(buf)
    for k in ("data.step", "data.frames", "state.gid", "state.leaves"):
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    _check_rows(t)  # ... so no batch may show its rows
    del t
    it.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_redrawn_after_a_racing_write_is_one_a_serial_run_gives(monkeypatch, device):
    sched = dict(beta=bigper.LinearSchedule(0.4, 1.0, 100))
    buf, first, then = (_atari_like(capacity=64, **sched) for _ in range(3))
    for b in (buf, first, then):
        _add(b, 0, 64)
    it = buf.sampler(16, prefetch=0, device=device)
    _GatherHook(monkeypatch, during=lambda: _add(buf, 64, 64))  # every slot replaced mid-gather
    t = next(it)
    _check_rows(t)
    first.sample(16)  # serial: the draw, then the write
    _add(first, 64, 64)
    _add(then, 64, 64)  # serial: the write, then the draw
    want = then.sample(16).to_torch(device)
    meta = buf.state_dict()[0]
    assert meta["beta_step"] == 1
    assert meta["rng"] in (first.state_dict()[0]["rng"], then.state_dict()[0]["rng"])
    _same_batch(t, want)  # (the only serial order whose batch it can be: it shows the write's rows)
    del t
    it.close()


# ---------------------------------------------------------------------------------------------
# Bugs: the sampler's own contract
# ---------------------------------------------------------------------------------------------


def test_ready_never_exceeds_prefetch():
    buf = _atari_like()
    _add(buf, 0, 400)
    for p in (1, 2):
        it = buf.sampler(8, prefetch=p, device="cpu")
        for _ in range(3):
            t = next(it)
            time.sleep(0.3)
            assert it.ready <= p, (p, it.ready)
        del t
        it.close()


def test_a_forked_child_never_takes_the_parents_prefetched_batches(tmp_path):
    r = _run_script(f"""
        import os, time, warnings
        import numpy as np
        import bigper
        from tests.device.test_feed import _add, _atari_like
        warnings.simplefilter("ignore")
        for storage in ("memory", "memmap"):
            buf = _atari_like({str(tmp_path)!r} + "/b" if storage == "memmap" else None)
            _add(buf, 0, 400)
            it = buf.sampler(8, prefetch=2, device="cpu")
            t = next(it)
            time.sleep(0.5)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                try:
                    try:
                        x = next(it)
                        msg = "batch " + ",".join(map(str, x["generations"].tolist()))
                    except bigper.BigperError as e:
                        msg = "refused " + type(e).__name__
                    except BaseException as e:
                        msg = "raised " + type(e).__name__
                    os.write(w, msg.encode())
                finally:
                    os._exit(0)
            os.close(w)
            for _ in range(200):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                print(storage, "HUNG")
                continue
            child = os.read(r, 1000).decode()
            parent = "batch " + ",".join(map(str, next(it)["generations"].tolist()))
            print(storage, "child:", child, "| same as the parent's:", child == parent)
            if storage == "memmap":
                assert child == "refused BufferClosedError", child
            else:
                assert child != parent and "HUNG" not in child, child
            it.close()
            buf.close()
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout[-1500:], r.stderr[-1500:])


def test_closing_a_sampler_while_the_buffer_lock_is_held_never_deadlocks():
    r = _run_script("""
        import os, threading, time
        import numpy as np
        import bigper.core.feed as plan
        from bigper.device import feed, native
        from tests.device.test_feed import _add, _atari_like
        native.feed_sampler = feed.FeedSampler  # (the threaded feed: its thread gathers under this test's hook)
        buf = _atari_like()
        _add(buf, 0, 400)
        it = buf.sampler(8, prefetch=1, device="cpu")
        next(it)
        time.sleep(0.3)
        real = plan.gather_kernel
        in_gather, locked = threading.Event(), threading.Event()
        def hooked(*a):
            if not in_gather.is_set():
                in_gather.set()
                locked.wait(10)
            return real(*a)
        plan.gather_kernel = hooked
        class Closes:  # priorities whose conversion (under the buffer's lock) closes the sampler
            def __array__(self, dtype=None, copy=None):
                locked.set()
                time.sleep(0.2)
                it.close()
                return np.ones(4)
        def go():
            in_gather.wait(10)
            buf.update_priorities(np.arange(4), Closes())
        th = threading.Thread(target=go, daemon=True)
        th.start()
        try:
            next(it); next(it)
        except StopIteration:  # (closed by the callback: the end, as after any close)
            pass
        th.join(10)
        print("deadlocked" if th.is_alive() else "ok", flush=True)
        os._exit(0)
    """)
    assert "ok" in r.stdout, (r.stdout[-500:], r.stderr[-1500:])


# ---------------------------------------------------------------------------------------------
# Guards: public methods from other threads while a feed runs
# ---------------------------------------------------------------------------------------------


def _f(g):
    """The priority every party gives transition ``g``: any order of their calls leaves it."""
    return (np.asarray(g) % 7 + 1).astype(np.float64)


def _add_p(buf, g0, n, episode=50):
    """``_add`` with priorities ``_f(g)`` given to extend."""
    g = np.arange(g0, g0 + n)
    frames = lambda s: np.broadcast_to((s % 251).astype(np.uint8)[:, None, None, None], (n, 1, 6, 7))  # noqa: E731
    obs = np.concatenate([frames(g - 3 + j) for j in range(4)], axis=1)
    nxt = np.concatenate([frames(g - 2 + j) for j in range(4)], axis=1)
    buf.extend({"obs": obs, "next_obs": nxt, "step": g, "reward": g.astype(np.float32),
                "terminated": (g + 1) % episode == 0}, priorities=_f(g))


def _check_leaves(buf):
    """Every sampleable slot's leaf is its own transition's ``_f`` key (what any serial run leaves), the
    rest are 0, and the tree over them is consistent."""
    meta, arrays = buf.state_dict()
    gid, status, leaves = arrays["gid"], arrays["status"], arrays["leaves"]
    live = status == 1
    want = (_f(gid) + buf.config.eps) ** buf.config.alpha
    np.testing.assert_allclose(leaves[live], want[live], rtol=1e-12)
    assert np.all(leaves[~live] == 0)
    assert buf.prioritization.check(status) == []


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_every_public_method_from_threads_while_a_feed_runs(tmp_path, storage):
    """Writers, crafted and stale updates, assign, no-op restores, reads, samples, a second
    sampler and snapshots race the feed; then a close from another thread ends it. Every row
    of every batch is one transition, every update lands on its own transition, the tree is
    consistent, and the learner's loop ends with BufferClosedError."""
    buf = _atari_like(tmp_path / "live" if storage == "memmap" else None, capacity=96)
    _add_p(buf, 0, 96)
    stop = threading.Event()
    errors, counts = [], {}
    g_next = [96]

    def loop(name, body):
        def run():
            n = 0
            try:
                while not stop.is_set():
                    body(n)
                    n += 1
            except bigper.BufferClosedError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append((name, repr(e)))
            counts[name] = n
        return threading.Thread(target=run, name=name)

    def write(n):
        k = 1 + n % 9
        _add_p(buf, g_next[0], k)
        g_next[0] += k

    rng = np.random.default_rng(0)

    def crafted(n):  # raw slots with generations read at some earlier moment: stale ones are skipped
        idx = rng.integers(0, 96, 12)
        gen = buf.generations[idx]
        if n % 2:
            time.sleep(0.001)
        buf.update_priorities({"indices": idx, "generations": gen}, _f(gen))

    def assign(n):
        with buf._guard.lock:  # (gid read and assigned in one step: the test's own serial point)
            buf.assign_priorities(_f(buf.generations))
        time.sleep(0.005)

    def restore(n):
        with buf._guard.lock:
            meta, arrays = buf.state_dict()
            buf.load_state(meta, {k: np.array(v, copy=True) for k, v in arrays.items()})
        time.sleep(0.005)

    def read(n):
        idx = rng.integers(0, 96, 8)
        buf.leaves(idx)
        len(buf), buf.total_priority, buf.beta
        try:
            got = buf.gather(idx)
            assert np.array_equal(got["obs"][:, -1, 0, 0], (got["step"] % 251).astype(np.uint8))
        except bigper.InvalidIndexError:
            pass
        s = buf.sample(8)
        assert np.array_equal(s["obs"][:, -1, 0, 0], (s["step"] % 251).astype(np.uint8))
        assert np.array_equal(s["step"], s.generations)

    it2 = buf.sampler(8, prefetch=1, device="cpu")

    def second(n):
        t = next(it2)
        _check_rows(t)
        buf.update_priorities(t, torch.from_numpy(_f(_np(t["step"]))))

    def save(n):
        if storage == "memmap":
            buf.save(tmp_path / f"snap-{n}")
        time.sleep(0.05)

    threads = [loop(n, b) for n, b in (("write", write), ("crafted", crafted), ("assign", assign),
                                       ("restore", restore), ("read", read), ("second", second), ("save", save))]
    it = buf.sampler(16, prefetch=2, device="cpu")
    for th in threads:
        th.start()
    batches = 0
    try:
        for t in it:
            _check_rows(t)
            buf.update_priorities(t, torch.from_numpy(_f(_np(t["step"]))))
            batches += 1
            if batches == 150:
                stop.set()
                for th in threads:
                    th.join()
                closer = threading.Thread(target=buf.close)
                closer.start()
                closer.join()
    except bigper.BufferClosedError:
        pass
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors
    assert batches == 150 and buf.closed
    with pytest.raises(bigper.BufferClosedError):
        next(it)
    _check_leaves(buf)
    if storage == "memmap":
        with _atari_like(tmp_path / "live", capacity=96, mode="resume") as back:
            _check_leaves(back)
            assert len(back) == 96
        snaps = sorted(tmp_path.glob("snap-*"))
        if snaps:
            with bigper.PrioritizedReplayBuffer.load(snaps[-1], path=tmp_path / "from-snap") as old:
                _check_leaves(old)


def test_a_restore_racing_the_gather_gives_the_batch_of_restore_then_sample(monkeypatch):
    buf, twin = _twin_pair(capacity=64, n=64)
    meta, arrays = buf.state_dict()
    saved = (meta, {k: np.array(v, copy=True) for k, v in arrays.items()})
    it = buf.sampler(16, prefetch=0, device="cpu")
    _GatherHook(monkeypatch, during=lambda: buf.load_state(*saved))
    t = next(it)  # drawn, then the state it was drawn from is restored under its gather
    _same_batch(t, twin.sample(16).to_torch("cpu"))
    assert_same(fingerprint(twin), fingerprint(buf))
    assert (twin._ring.restores, buf._ring.restores) == (0, 1)


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_writes_racing_every_gather_leave_the_tree_a_serial_run_leaves(monkeypatch, tmp_path, storage):
    """A write between every draw and its gather (overwriting some of the drawn slots); the
    learner updates each batch: every update lands on its own transitions or is skipped."""
    buf = _atari_like(tmp_path / "b" if storage == "memmap" else None, capacity=64)
    _add_p(buf, 0, 64)
    g = [64]

    def write():
        _add_p(buf, g[0], 5)
        g[0] += 5

    it = buf.sampler(16, prefetch=0, device="cpu")
    for _ in range(40):
        hook = _GatherHook(monkeypatch, during=write)
        t = next(it)
        assert not hook.armed
        _check_rows(t)
        buf.update_priorities(t, torch.from_numpy(_f(_np(t["step"]))))
    _check_leaves(buf)


# ---------------------------------------------------------------------------------------------
# Guards: lifecycle (dropped buffers, close from everywhere, the iterator's own close)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_a_buffer_dropped_while_the_thread_waits_is_closed_and_resumes(tmp_path, storage):
    buf = _atari_like(tmp_path / "b" if storage == "memmap" else None)
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=1, device="cpu")
    t = next(it)
    time.sleep(0.2)  # the thread filled what it may and waits for a slot
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is None
    _check_rows(t)  # the batch held stays as it was
    for _ in range(3):
        with pytest.raises(bigper.BufferClosedError):
            next(it)
    if storage == "memmap":
        with _atari_like(tmp_path / "b", mode="resume") as back:
            assert len(back) == 400


def test_a_buffer_dropped_while_the_thread_fills_is_closed_in_that_thread(tmp_path, monkeypatch, threaded):
    buf = _atari_like(tmp_path / "b")
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=1, device="cpu")
    t = next(it)
    in_gather, dropped = threading.Event(), threading.Event()
    _GatherHook(monkeypatch, during=lambda: (in_gather.set(), dropped.wait(10)))
    del t
    next(it)
    next(it)  # a slot back: the thread draws and gathers, holding the buffer
    assert in_gather.wait(10)
    ref = weakref.ref(buf)
    del buf
    dropped.set()  # the thread's own reference is the last one
    for _ in range(100):
        if ref() is None:
            break
        time.sleep(0.02)
        gc.collect()
    assert ref() is None
    with pytest.raises(bigper.BufferClosedError):
        for _ in range(10):
            _check_rows(next(it))
    with _atari_like(tmp_path / "b", mode="resume") as back:
        assert len(back) == 400


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_inside_the_learner_loop(prefetch):
    buf = _atari_like()
    _add(buf, 0, 400)
    n = 0
    with pytest.raises(bigper.BufferClosedError):
        for t in buf.sampler(8, prefetch=prefetch, device="cpu"):
            _check_rows(t)
            n += 1
            if n == 5:
                buf.close()
                _check_rows(t)
    assert n == 5


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_another_thread_mid_gather(tmp_path, monkeypatch, prefetch):
    buf = _atari_like(tmp_path / "b")
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=prefetch, device="cpu")
    next(it)
    closer = threading.Thread(target=buf.close)

    def during():  # the lock is free: the close runs (prefetch: until it waits for this thread)
        closer.start()
        closer.join(0.5 if prefetch else 10)

    _GatherHook(monkeypatch, during=during)
    try:
        for _ in range(10):
            _check_rows(next(it))
    except bigper.BufferClosedError:
        pass
    closer.join(10)
    assert not closer.is_alive() and buf.closed
    for _ in range(3):
        with pytest.raises(bigper.BufferClosedError):
            next(it)
    with _atari_like(tmp_path / "b", mode="resume") as back:
        assert len(back) == 400


def test_an_exception_in_the_learner_between_next_calls():
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=2, device="cpu")
    caught = []
    for i in range(20):
        t = next(it)
        try:
            if i % 3 == 0:
                raise RuntimeError(t)  # the traceback and the exception hold the batch
        except RuntimeError as e:
            caught.append((e, {k: v.clone() for k, v in t.items()}))
    del t
    for _ in range(10):
        next(it)
    for e, copy in caught:
        held = e.args[0]
        _check_rows(held)
        for k in copy:
            assert torch.equal(held[k], copy[k]), k
    it.close()


def test_the_iterator_closed_twice_and_used_after_close():
    buf = _atari_like()
    _add(buf, 0, 400)
    for prefetch in (0, 2):
        it = buf.sampler(8, prefetch=prefetch, device="cpu")
        next(it)
        it.close()
        it.close()
        for _ in range(3):
            with pytest.raises(StopIteration):
                next(it)
        with it:
            pass
    buf.add(obs=np.zeros((4, 6, 7), np.uint8), next_obs=np.zeros((4, 6, 7), np.uint8), step=400, reward=0.0)


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(batch_size=2 ** 25), dict(prefetch=-1),
                                 dict(prefetch=True), dict(beta=float("nan")), dict(beta=-1.0), dict(oops=1),
                                 dict(device="nope")])
def test_a_refused_sampler_changes_nothing(bad):
    buf = _atari_like()
    _add(buf, 0, 400)
    before = fingerprint(buf)
    kw = dict(batch_size=8, prefetch=2, device="cpu")
    kw.update(bad)
    with pytest.raises((bigper.BigperError, ValueError, TypeError, RuntimeError)):
        buf.sampler(**kw)
    assert_same(before, fingerprint(buf))


def test_an_empty_buffer_refusal_changes_nothing():
    buf = _atari_like()
    before = fingerprint(buf)
    for prefetch in (0, 2):
        it = buf.sampler(8, prefetch=prefetch, device="cpu")
        with pytest.raises(bigper.InvalidArgumentError):
            next(it)
    assert_same(before, fingerprint(buf))


# ---------------------------------------------------------------------------------------------
# Guards: what a learner holds, edits and hands back
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_views_held_across_many_next_calls(device):
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=2, device=device)
    kept = []
    for i in range(24):
        t = next(it)
        held = {"obs0": t["obs"][:, 0], "last": t["next_obs"][..., -1], "dl": torch.utils.dlpack.from_dlpack(
            torch.utils.dlpack.to_dlpack(t["reward"])), "step": t["step"].view(2, 4)}
        if device == "cpu":
            held["np"] = t["obs"].numpy()[:, 1:]
            held["from_np"] = torch.from_numpy(t["generations"].numpy())
            held["arr"] = np.asarray(t["weights"])
            held["host"] = t.host["indices"]
        kept.append((held, {k: (v.clone() if torch.is_tensor(v) else v.copy()) for k, v in held.items()}))
    del t, held
    for _ in range(40):
        next(it)
    for held, copy in kept:
        for k in copy:
            a, b = (_np(held[k]), _np(copy[k])) if torch.is_tensor(copy[k]) else (held[k], copy[k])
            np.testing.assert_array_equal(a, b, err_msg=k)
    it.close()


@pytest.mark.parametrize("device", DEVICES)
def test_updates_after_the_learner_edits_the_batch_land_where_they_should(device):
    """In-place edits of the tensors (indices, generations, data) are ignored by
    update_priorities (host copies); a key replaced is read as given; deleted keys keep
    the host copies. Each against a twin fed the same targets."""
    a, twin = _twin_pair(capacity=64, n=64)
    it = a.sampler(8, prefetch=0, device=device)
    for i in range(12):
        t = next(it)
        want = twin.sample(8).to_torch(device)
        _same_batch(t, want)
        td = torch.arange(1.0, 9.0, device=device) * (i + 1)
        target = want
        if i % 4 == 0:
            t["indices"].add_(1)
            t["generations"].zero_()
            t["obs"].fill_(0)
        elif i % 4 == 1:
            t["indices"] = torch.flip(t["indices"], (0,))
            t["generations"] = torch.flip(t["generations"], (0,))
            target = {"indices": _np(want["indices"])[::-1].copy(), "generations": _np(want["generations"])[::-1].copy()}
        elif i % 4 == 2:
            del t["generations"], t["obs"]
            t["extra"] = t["reward"] * 2
        a.update_priorities(t, td)
        twin.update_priorities(target, td)
        np.testing.assert_array_equal(_leaves(a), _leaves(twin), err_msg=str(i))
    del t
    for _ in range(6):
        _check_rows(next(it))


@pytest.mark.parametrize("device", DEVICES)
def test_islice_and_zip_over_the_iterator(device):
    import itertools

    a, twin = _twin_pair()
    it = a.sampler(8, prefetch=2, device=device)
    pairs = []
    for x, y in itertools.islice(zip(it, it), 6):
        pairs.append((x, y))
        _check_rows(x)
        _check_rows(y)
    for x, y in pairs:  # every batch held stays its own
        _same_batch(x, twin.sample(8).to_torch(device))
        _same_batch(y, twin.sample(8).to_torch(device))
    more = list(itertools.islice(it, 3))
    for m in more:
        _same_batch(m, twin.sample(8).to_torch(device))
    it.close()


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_0_and_3_give_the_same_draws(device):
    a, b = _twin_pair()
    it0, it3 = a.sampler(8, prefetch=0, device=device), b.sampler(8, prefetch=3, device=device)
    for _ in range(20):
        _same_batch(next(it0), next(it3))
    it0.close()
    it3.close()


# ---------------------------------------------------------------------------------------------
# Guards: shapes, dtypes, batch sizes, draw options, storage under it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, kw", [(1, {}), (1000, {}), (8, dict(stratified=False)), (8, dict(beta=0.0)),
                                   (8, dict(beta=1.0, stratified=False))])
def test_batch_sizes_and_draw_options_equal_sample_to_torch(device, b, kw):
    a, twin = _twin_pair(capacity=64, n=150, beta=bigper.LinearSchedule(0.2, 1.0, 5), weight_norm="batch")
    it = a.sampler(b, prefetch=0, device=device, **kw)
    for i in range(6):
        t = next(it)
        want = twin.sample(b, **kw).to_torch(device)
        _same_batch(t, want)
        _check_rows(t)
        td = torch.rand(b, generator=torch.Generator().manual_seed(i)) * 5
        a.update_priorities(t, td)
        twin.update_priorities(want, td)
    it.close()
    np.testing.assert_array_equal(_leaves(a), _leaves(twin))


def test_a_batch_of_2_to_the_20_without_frames():
    fields = {"x": ((3,), np.float16), "a": ((), np.int64)}
    a, twin = (bigper.PrioritizedReplayBuffer(capacity=50, fields=fields, seed=1) for _ in range(2))
    for buf in (a, twin):
        buf.extend({"x": np.arange(180, dtype=np.float16).reshape(60, 3), "a": np.arange(60)})
    b = 2 ** 20
    t = next(a.sampler(b, prefetch=0, device="cpu"))
    want = twin.sample(b).to_torch("cpu")
    _same_batch(t, want)
    assert np.array_equal(_np(t["a"]), _np(t["generations"]))


DTYPE_VALUES = {
    "u64": ((), np.uint64, [0, 2 ** 64 - 1, 2 ** 63]), "i64": ((), np.int64, [-2 ** 63, 2 ** 63 - 1, 0]),
    "f16": ((2,), np.float16, [65504, -65504, np.nan, 6e-8]), "b": ((3,), np.bool_, [True, False]),
    "i8": ((), np.int8, [-128, 127]), "u16": ((2, 2), np.uint16, [65535, 0]), "u32": ((), np.uint32, [2 ** 32 - 1]),
    "f64": ((), np.float64, [np.inf, -np.inf, 5e-324]), "c64": ((), np.complex64, [1 + 2j, -0.0]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_fields_of_every_dtype_at_their_limits(tmp_path, device, storage):
    fields = {k: (s, d) for k, (s, d, _) in DTYPE_VALUES.items()}
    n = 30
    data = {}
    for k, (shape, dt, vals) in DTYPE_VALUES.items():
        v = np.resize(np.array(vals, dtype=dt), n * int(np.prod(shape, dtype=np.int64)))
        data[k] = v.reshape(n, *shape)
    bufs = [bigper.PrioritizedReplayBuffer(capacity=16, fields=fields, seed=2, storage=storage,
                                           **({"path": tmp_path / x} if storage == "memmap" else {}))
            for x in "ab"]
    for buf in bufs:
        buf.extend(data)
    it = bufs[0].sampler(7, prefetch=2, device=device)
    for _ in range(5):
        _same_batch(next(it), bufs[1].sample(7).to_torch(device))
    it.close()


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_zero_size_field_shapes_are_refused_at_construction(shape):
    with pytest.raises(bigper.InvalidArgumentError, match="positive"):
        bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": (shape, np.float32), "a": ((), np.int64)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k, next_of", [(1, ()), (1, ("obs",)), (2, ()), (3, ("obs",))])
def test_frame_stacks_with_k_1_and_without_next_obs(device, k, next_of):
    fields = {"obs": ((k, 5, 3), np.uint8), "step": ((), np.int64)}
    a, twin = (bigper.PrioritizedReplayBuffer(capacity=40, fields=fields, frame_stack=k, next_of=next_of, seed=4)
               for _ in range(2))
    n = 90
    g = np.arange(n)
    fr = (g % 251).astype(np.uint8)[:, None, None] * np.ones((1, 5, 3), np.uint8)
    pad = np.concatenate([np.repeat(fr[:1], k, 0), fr, fr[-1:]])
    obs = np.stack([pad[i + 1:i + 1 + k] for i in range(n)])
    data = {"obs": obs, "step": g, "terminated": (g + 1) % 23 == 0}
    if next_of:
        data["next_obs"] = np.stack([pad[i + 2:i + 2 + k] for i in range(n)])
    for buf in (a, twin):
        buf.extend(data)
    it = a.sampler(16, prefetch=1, device=device)
    assert isinstance(it, (FeedSampler, NativeFeed))
    for _ in range(5):
        t = next(it)
        _same_batch(t, twin.sample(16).to_torch(device))
        assert ("next_obs" in t) == bool(next_of)
        assert np.array_equal(_np(t["obs"])[:, -1, 0, 0], (_np(t["step"]) % 251).astype(np.uint8))
    it.close()


def test_memmap_chunk_files_replaced_under_the_feed(tmp_path):
    """Files renamed over the live chunks (another program, a careless rsync): the
    mappings keep the buffer's own data; the feed gives what a twin gives."""
    a, twin = _twin_pair(tmp_path)
    it = a.sampler(8, prefetch=2, device="cpu")
    next(it)
    twin.sample(8)
    for f in (tmp_path / "a" / "data").iterdir():
        size = f.stat().st_size
        tmp = f.with_name(f.name + ".junk")
        tmp.write_bytes(b"\xff" * size)
        os.replace(tmp, f)
    for _ in range(10):
        t = next(it)
        _check_rows(t)
        _same_batch(t, twin.sample(8).to_torch("cpu"))
    it.close()


def test_chdir_between_open_and_sampling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("here")
    monkeypatch.chdir("here")
    buf = _atari_like("rel")
    _add(buf, 0, 400)
    os.mkdir(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    it = buf.sampler(8, prefetch=2, device="cpu")
    for _ in range(10):
        _check_rows(next(it))
    it.close()
    buf.close()
    assert not (tmp_path / "elsewhere" / "rel").exists()
    with _atari_like(tmp_path / "here" / "rel", mode="resume") as back:
        assert len(back) == 400


# ---------------------------------------------------------------------------------------------
# CUDA (run where a GPU is present)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_tier_writes_from_a_side_stream_never_tear_a_batch():
    """A device tier written through by adds made under another CUDA stream while the
    feed's thread gathers on its own: every row is one transition."""
    buf = _atari_like(capacity=64, device="cuda")
    _add(buf, 0, 64)
    stop = threading.Event()
    errors = []

    def writer():
        side = torch.cuda.Stream()
        g = 64
        try:
            with torch.cuda.stream(side):
                while not stop.is_set() and g < 30_000:
                    _add(buf, g, 7)
                    g += 7
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=writer)
    th.start()
    it = buf.sampler(32, prefetch=2, device="cuda")
    try:
        for _ in range(200):
            t = next(it)
            _check_rows(t)
            buf.update_priorities(t, t["weights"].float() + 0.1)
    finally:
        stop.set()
        th.join()
        it.close()
    assert not errors
    buf.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_batches_used_on_a_side_stream_are_not_refilled_under_it():
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(16, prefetch=2, device="cuda")
    side = torch.cuda.Stream()
    copies = []
    for _ in range(30):
        t = next(it)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the learner's work on this batch runs late, on another stream
            torch.cuda._sleep(2_000_000)
            copies.append((t["step"].clone(), t["obs"][:, -1, 0, 0].clone(), t["generations"].clone()))
        t["step"].record_stream(side)
        t["obs"].record_stream(side)
    torch.cuda.synchronize()
    for step, pix, gen in copies:
        assert torch.equal((step % 251).to(torch.uint8), pix)
        assert torch.equal(step, gen)
    it.close()
