"""Attack on compressed frames decoded on the pool's threads in the feed
(``core/feed.decode`` with ``Sources.threads``, ``SegmentLog.decode`` spread by
``common/pool.for_ranges`` past one chunk) and on a compressed buffer with a
device tier taking the feed.

``BIGPER_THREADS`` is set before a sampler is made (its ``Sources`` read
``workers()`` then) to force the pool on this 2-core machine. Batches are
held to a twin's ``sample(B).to_torch("cpu")`` at batch sizes whose frame
counts straddle the chunk (256 frames a thread at least), damaged frames
in a pool thread's range name the lowest bad row, an error inside one pool
range leaves the lock free and the buffer usable, and races (a writer
adopting dictionaries beside two pooled feeds, ``close`` during a pooled
decode, a fork after one) run in child processes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
import bigper.frames.segments as segments  # noqa: E402
from bigper.core import feed as plan  # noqa: E402
from bigper.device.feed import FeedSampler  # noqa: E402
from bigper.errors import CorruptSnapshotError  # noqa: E402

from tests import hook  # noqa: E402
from tests._child import Child, env_with_root  # noqa: E402
from tests._child_batch import run_scripts, said_ok  # noqa: E402
from tests.device.test_feed import _add, _atari_like  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()


def _np(x):
    return x.detach().cpu().numpy()


def _buf(k=4, capacity=400, **kw):
    fields = {"obs": ((k, 6, 7), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)}
    return bigper.PrioritizedReplayBuffer(capacity=capacity, fields=fields, frame_stack=k, seed=3,
                                          compression="zstd", **kw)


def _fill(buf, k, g0, n, episode=50):
    """Steps g0..g0+n-1 (the newest frame's pixels and ``step`` say g), episodes of ``episode`` steps."""
    g = np.arange(g0, g0 + n)
    fr = lambda s: (s % 251).astype(np.uint8)[:, None, None, None]  # noqa: E731
    obs = np.concatenate([np.broadcast_to(fr(g - k + 1 + j), (n, 1, 6, 7)) for j in range(k)], axis=1)
    nxt = np.concatenate([np.broadcast_to(fr(g - k + 2 + j), (n, 1, 6, 7)) for j in range(k)], axis=1)
    buf.extend({"obs": obs, "next_obs": nxt, "step": g, "reward": g.astype(np.float32),
                "terminated": (g + 1) % episode == 0})


def _same(got, want):
    assert list(got) == list(want)
    for key in want:
        np.testing.assert_array_equal(_np(got[key]), _np(want[key]), err_msg=key)


def _same_state(x, y, where="state"):
    """Two ``state_dict()``s equal, value for value."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and list(x) == list(y), where
        for key in x:
            _same_state(x[key], y[key], f"{where}.{key}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _same_state(u, v, f"{where}[{i}]")
    elif isinstance(x, np.ndarray):
        np.testing.assert_array_equal(x, y, err_msg=where)
    else:
        assert x == y, where


def _spy(monkeypatch):
    """The (n, chunk) of every decode spread over the pool."""
    spread = []
    real = segments.for_ranges
    monkeypatch.setattr(segments, "for_ranges",
                        lambda fn, n, chunk: (spread.append((n, chunk)), real(fn, n, chunk))[1])
    return spread


# -- exactness at the chunk's edges -------------------------------------------------------------

# (k, B): B * (k + 1) frames a batch of pair stacks: 255, 256, 257 (k=2: 85*3=255, k=1: 128*2=256,
# k=3: 64*4=256, k=4: 51*5=255, ...), 511..514 and one far past (16 ranges).
EDGES = [(1, 128), (1, 256), (1, 257), (2, 85), (2, 86), (2, 171), (3, 64), (3, 128), (3, 129),
         (4, 51), (4, 52), (4, 103), (4, 400)]


@pytest.mark.parametrize("k,b", EDGES)
def test_pooled_decode_equals_twin_at_chunk_edges(monkeypatch, k, b):
    monkeypatch.setenv("BIGPER_THREADS", "16")
    spread = _spy(monkeypatch)
    a, twin = _buf(k), _buf(k)
    for buf in (a, twin):
        _fill(buf, k, 0, 300)
    it = a.sampler(b, prefetch=0, device="cpu")
    assert isinstance(it, FeedSampler)
    rng = np.random.default_rng(b)
    g = 300
    for _ in range(3):
        got, want = next(it), twin.sample(b).to_torch("cpu")
        _same(got, want)
        step = _np(got["step"])
        np.testing.assert_array_equal(_np(got["obs"])[:, -1, 0, 0], (step % 251).astype(np.uint8))
        p = torch.tensor(rng.random(b) * 5 + 0.1)
        a.update_priorities(got, p)
        twin.update_priorities(want, p)
        for buf in (a, twin):
            _fill(buf, k, g, 17)
        g += 17
    assert it._filler.src.threads
    n = [n for n, chunk in spread if chunk == plan.DECODE_CHUNK]
    if b * (k + 1) > plan.DECODE_CHUNK:
        assert n, spread  # (the pool used: at least one batch's frames past one chunk)
    it.close()
    _same_state(a.state_dict(), twin.state_dict())
    a.close()
    twin.close()


def test_at_most_one_chunk_stays_in_this_thread(monkeypatch):
    """256 frames or fewer: no hand-off to the pool at all (the learner's
    Python calls); 257: two ranges."""
    monkeypatch.setenv("BIGPER_THREADS", "8")
    spread = _spy(monkeypatch)
    buf = _buf(1)
    _fill(buf, 1, 0, 300)
    log = hook.log(buf)
    ids = np.tile(np.arange(0, 250, dtype=np.int64), 3)
    want = log.decode(ids[:256], threads=False)
    got = log.decode(ids[:256], threads=True, chunk=256)
    np.testing.assert_array_equal(got, want)
    assert spread == []
    got = log.decode(ids[:257], threads=True, chunk=256)
    np.testing.assert_array_equal(got, log.decode(ids[:257], threads=False))
    assert spread == [(257, 256)]
    buf.close()


@pytest.mark.parametrize("threads", ["1", "8"])
def test_seeded_runs_draw_identical_batches_whatever_the_threads(monkeypatch, threads):
    """The same batches, byte for byte, with BIGPER_THREADS=1 and =8
    (against a reference run with the pool off)."""
    runs = []
    for env in ("1", threads):
        monkeypatch.setenv("BIGPER_THREADS", env)
        buf = _buf(4)
        _fill(buf, 4, 0, 300)
        it = buf.sampler(80, prefetch=0, device="cpu")
        seen = []
        for i in range(8):
            batch = next(it)
            seen.append({key: _np(t).copy() for key, t in batch.items()})
            buf.update_priorities(batch, torch.full((80,), 1.0 + i) + torch.arange(80) * 0.01)
            _fill(buf, 4, 300 + 5 * i, 5)
        it.close()
        runs.append(seen)
        buf.close()
    for a, b in zip(*runs):
        assert list(a) == list(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# -- damage in a pool thread's range ----------------------------------------------------------------

def test_damaged_frames_only_in_a_pool_range_name_the_lowest_bad_row(monkeypatch):
    """``SegmentLog.decode`` over 1,000 rows in 16 ranges, bad frames only
    in later ranges (each range stops at its own first bad row): the error
    names the frame of the lowest bad row, as one thread would."""
    monkeypatch.setenv("BIGPER_THREADS", "16")
    buf = _buf(1, capacity=600)
    _fill(buf, 1, 0, 500)
    log = hook.log(buf)
    fs = hook.frames(buf)
    index = fs.store.arrays["frame_index"]
    flat = fs.store.arrays["frame_log"].reshape(-1)
    log0, index0 = flat.copy(), index.copy()
    ids = np.arange(1000, dtype=np.int64) % 400 + 50  # (live frames, each twice)
    bad_rows = [620, 900, 333]  # three ranges after the first
    o, ln, _ = hook.entries(buf)
    for r in bad_rows:
        f = int(ids[r] % fs.F)
        flat[o[f] + ln[f] // 2] ^= 0x5A
    # (a bad frame occurs at every row that names it: the lowest such row)
    lowest = min(int(np.flatnonzero(ids == ids[r])[0]) for r in bad_rows)
    errs = []
    for threads in (False, True):
        with pytest.raises(CorruptSnapshotError) as e:
            log.decode(ids, threads=threads, chunk=64)
        errs.append(str(e.value))
    assert errs[0] == errs[1], errs
    assert f"frame {int(ids[lowest])} " in errs[1]
    flat[:] = log0
    index[:] = index0
    np.testing.assert_array_equal(log.decode(ids, threads=True, chunk=64), log.decode(ids, threads=False))
    buf.close()


@pytest.mark.parametrize("how", ["log byte", "offset", "length"])
def test_damage_from_next_with_the_pool_names_what_one_thread_names(monkeypatch, how):
    """Half the frames damaged (the newest half of the log): ``next()`` of a
    pooled feed raises ``CorruptSnapshotError`` naming the frame a pool-less
    twin names, and leaves the state the twin's (both advanced by the draw,
    as ``sample`` on damaged frames does); the sampler ends; repaired,
    ``sample`` and a new feed work."""
    errs, states = {}, {}
    for env in ("1", "16"):
        monkeypatch.setenv("BIGPER_THREADS", env)
        buf = _buf(4)
        _fill(buf, 4, 0, 300)
        fs = hook.frames(buf)
        index, log = fs.store.arrays["frame_index"], fs.store.arrays["frame_log"]
        index0, log0 = index.copy(), log.copy()
        o, ln, _ = hook.entries(buf)
        live = np.flatnonzero(ln > 0)
        rows = live[live.shape[0] // 2:]
        if how == "log byte":
            flat = log.reshape(-1)
            for r in rows:
                flat[o[r] + ln[r] // 2] ^= 0x10
        elif how == "offset":
            hook.set_entries(buf, index, rows, offset=o[rows] + 3)
        else:
            hook.set_entries(buf, index, rows, length=ln[rows] + 1)
        it = buf.sampler(100, prefetch=0, device="cpu")
        with pytest.raises(CorruptSnapshotError) as e:
            next(it)
        errs[env] = str(e.value)
        with pytest.raises((StopIteration, CorruptSnapshotError)):
            next(it)
        it.close()
        assert buf._guard.lock.acquire(blocking=False)
        buf._guard.lock.release()
        index[:] = index0
        log[:] = log0
        states[env] = buf.state_dict()  # (after the failed draw: the pool-less twin's, value for value)
        it = buf.sampler(100, prefetch=0, device="cpu")
        batch = next(it)
        step = _np(batch["step"])
        np.testing.assert_array_equal(_np(batch["obs"])[:, -1, 0, 0], (step % 251).astype(np.uint8))
        it.close()
        buf.sample(100)
        buf.close()
    assert errs["1"] == errs["16"], errs
    _same_state(states["1"], states["16"])


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [_Boom, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["prefetch 0", "own thread"])
def test_an_error_in_one_pool_range_leaves_no_lock_held_and_no_sampler_wedged(monkeypatch, exc, where):
    """``decompress_rows`` raising in one pool range only (not the caller's):
    ``next()`` raises it (after the other ranges end), the buffer's lock is
    free, ``sample`` and ``add`` go on, the state is that of a twin that drew
    one batch, and a new pooled feed is exact against the twin."""
    monkeypatch.setenv("BIGPER_THREADS", "8")
    real = segments._zstd.decompress_rows
    armed = [True]
    main = threading.get_ident()

    def flaky(dctx, ddicts, log, offsets, lengths, dicts, out, lo, hi):
        if armed[0] and lo > 0 and threading.get_ident() != main:
            armed[0] = False
            raise exc("boom in a pool range")
        return real(dctx, ddicts, log, offsets, lengths, dicts, out, lo, hi)

    monkeypatch.setattr(segments._zstd, "decompress_rows", flaky)
    a, twin = _buf(4), _buf(4)
    for buf in (a, twin):
        _fill(buf, 4, 0, 300)
    b = 120
    if where == "own thread":
        main = None  # (the feed's thread calls the first range: any other thread is the pool's)
        it = hook.thread_feed(a, b, 2)
    else:
        it = a.sampler(b, prefetch=0, device="cpu")
    with pytest.raises(exc):
        next(it)
    assert not armed[0]
    assert a._guard.lock.acquire(timeout=5)
    a._guard.lock.release()
    if exc is KeyboardInterrupt and where == "prefetch 0":  # (the learner's to catch: the iteration goes on)
        batch = next(it)
        step = _np(batch["step"])
        np.testing.assert_array_equal(_np(batch["obs"])[:, -1, 0, 0], (step % 251).astype(np.uint8))
    else:
        with pytest.raises((StopIteration, exc)):
            next(it)
    it.close()
    # the twin at the same point: its random stream moved by the draws made
    a.sample(4)
    _fill(a, 4, 300, 3)
    it = a.sampler(b, prefetch=0, device="cpu")
    batch = next(it)
    step = _np(batch["step"])
    np.testing.assert_array_equal(_np(batch["obs"])[:, -1, 0, 0], (step % 251).astype(np.uint8))
    np.testing.assert_array_equal(_np(batch["next_obs"])[:, -1, 0, 0], ((step + 1) % 251).astype(np.uint8))
    it.close()
    a.close()
    twin.close()


# -- races, in child processes ------------------------------------------------------------------

_MANY = """
import sys, threading, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bigper.frames.segments, bigper.frames.dictionaries
bigper.frames.segments.TRAIN_FRAMES = 20
bigper.frames.dictionaries.PAYS = bigper.frames.dictionaries.DRIFT = -100.0
from pathlib import Path
from tests.frames.test_compression import ATARI, Feed, make
from tests import hook
games = np.load(ATARI)
names = list(games)
tmp = Path(sys.argv[1])
buf = make("memory", tmp, shape=(84, 84), k=4, capacity=80, seed=1, budget=int(sys.argv[2]) or None)
feed = Feed(games["Pong"], 4, seed=3)
feed.run(buf, 40)
spread = []
real = bigper.frames.segments.for_ranges
bigper.frames.segments.for_ranges = lambda fn, n, c: (spread.append(n), real(fn, n, c))[1]
stop, errors, counts = [False], [], {{}}

def writer():
    i = 0
    while not stop[0]:
        feed.frames = games[names[i % len(names)]]
        i += 1
        feed.run(buf, 3)

def learner(name, make_it):
    try:
        it, n = make_it(), 0
        while not stop[0]:
            b = next(it)
            steps = np.asarray(b["step"])
            obs = np.asarray(b["obs"])
            nxt = np.asarray(b["next_obs"])
            for i in range(steps.shape[0]):
                o, o2 = feed.added[int(steps[i])]
                assert (obs[i] == o).all() and (nxt[i] == o2).all(), (name, n, i)
            buf.update_priorities(b, np.random.rand(steps.shape[0]) + 0.1)
            n += 1
            counts[name] = n
        it.close()
    except BaseException as e:
        errors.append((name, repr(e)))

threads = [threading.Thread(target=writer),
           threading.Thread(target=learner, args=("own thread", lambda: hook.thread_feed(buf, 64, 2))),
           threading.Thread(target=learner, args=("own thread 2", lambda: hook.thread_feed(buf, 70, 1))),
           threading.Thread(target=learner, args=("prefetch 0", lambda: buf.sampler(60, prefetch=0, device="cpu")))]
for t in threads:
    t.start()
t0 = time.monotonic()
while time.monotonic() - t0 < 4 or (time.monotonic() - t0 < 150 and not errors
                                    and (len(counts) < 3 or hook.newest_gen(buf) <= 9)):
    time.sleep(0.1)
stop[0] = True
for t in threads:
    t.join()
assert not errors and len(counts) == 3 and min(counts.values()) > 0, (errors, counts)
assert hook.newest_gen(buf) > 9
assert spread and max(spread) > 256, spread[:5]
buf.close()
print("ok", counts, flush=True)
"""


@pytest.mark.parametrize("budget", ["0", "700"])
def test_pooled_feeds_with_a_writer_adopting_dictionaries(pool_children, request, budget):
    """Three pooled feeds (two ``FeedSampler`` threads, one ``prefetch=0``),
    BIGPER_THREADS=8, while a writer adopts more dictionaries than codec slots
    (and a capped log releases segments): every batch the stacks added."""
    said_ok(pool_children, request)


_CLOSE = """
import sys, threading, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bigper.frames.segments as segments
from bigper.errors import BufferClosedError
from tests.device.test_hostile_pool_decode import _buf, _fill
from tests import hook
real = segments._zstd.decompress_rows
inside = threading.Event()
slow = [True]

def slow_rows(dctx, ddicts, log, offsets, lengths, dicts, out, lo, hi):
    if slow[0] and lo > 0:
        inside.set()
        time.sleep(0.3)  # (a pool range in flight while close is called)
    return real(dctx, ddicts, log, offsets, lengths, dicts, out, lo, hi)

segments._zstd.decompress_rows = slow_rows
ends = []
for mode in ("prefetch 0", "own thread", "own thread"):
    buf = _buf(4)
    _fill(buf, 4, 0, 300)
    it = buf.sampler(120, prefetch=0, device="cpu") if mode == "prefetch 0" else hook.thread_feed(buf, 120, 2)
    got = []
    def learn():
        try:
            for _ in range(50):
                b = next(it)
                step = np.asarray(b["step"])
                assert (np.asarray(b["obs"])[:, -1, 0, 0] == (step % 251)).all()
                got.append(1)
        except (BufferClosedError, StopIteration) as e:
            got.append(e)
    inside.clear()
    t = threading.Thread(target=learn)
    t.start()
    assert inside.wait(60)
    buf.close()
    t.join(60)
    assert not t.is_alive(), mode
    assert got and not isinstance(got[-1], int), (mode, got[-3:])
    ends.append((mode, len(got), type(got[-1]).__name__))
print("ok", ends, flush=True)
"""


def test_close_from_another_thread_during_a_pooled_decode(pool_children, request):
    """``close`` while pool ranges decompress: it waits for the decode (under
    the lock), the learner's iteration ends with ``BufferClosedError`` or
    stops, no crash (the codec's contexts are freed after the decode)."""
    said_ok(pool_children, request)


# The pooled feeds and the close above run in one batch of child interpreters, BIGPER_THREADS=8
# (tests/_child_batch.py: each case a fresh run of its script with its own argv and globals, its
# output and exit status apart; a crash or a hang ends only its own case and the cases after it go
# on in a new child): one interpreter start and one load of torch and bigper's kernels for the
# three. The close case last: it slows the codec's decompress_rows for the rest of its interpreter.
# (The fork case keeps a child of its own: it forks that interpreter.)
@pytest.fixture(scope="module")
def pool_children(request, tmp_path_factory):
    return run_scripts(request, tmp_path_factory, {
        "test_pooled_feeds_with_a_writer_adopting_dictionaries": (_MANY.format(root=str(ROOT)), ("budget",)),
        "test_close_from_another_thread_during_a_pooled_decode": (_CLOSE.format(root=str(ROOT)), ()),
    }, env=env_with_root({**os.environ, "BIGPER_THREADS": "8"}), timeout=240)


_FORK = """
import os, sys, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bigper.common.pool as pool
from tests.device.test_hostile_pool_decode import _buf, _fill
buf = _buf(4)
_fill(buf, 4, 0, 300)
it = buf.sampler(120, prefetch=0, device="cpu")
b = next(it)
assert pool._POOL is not None  # (the pool was used)
want = {{k: np.asarray(v).copy() for k, v in b.items()}}
pid = os.fork()
if pid == 0:
    code = 1
    try:
        assert pool._POOL is None
        b2 = buf.sample(120)  # the parent's buffer, decoded on the child's own pool
        assert pool._POOL is not None
        step = b2["step"]
        assert (b2["obs"][:, -1, 0, 0] == step % 251).all()
        it2 = buf.sampler(120, prefetch=0, device="cpu")
        b3 = next(it2)
        step = np.asarray(b3["step"])
        assert (np.asarray(b3["obs"])[:, -1, 0, 0] == step % 251).all()
        code = 0
    finally:
        os._exit(code)
deadline = time.monotonic() + 120
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        raise SystemExit("the fork child hangs")
    time.sleep(0.05)
assert os.waitstatus_to_exitcode(status) == 0, status
b = next(it)  # the parent's pool still works
step = np.asarray(b["step"])
assert (np.asarray(b["obs"])[:, -1, 0, 0] == step % 251).all()
it.close()
buf.close()
print("ok", flush=True)
"""


def test_fork_after_a_pooled_decode_decodes_on_the_childs_pool(tmp_path):
    with Child(_FORK.format(root=str(ROOT)), env={**__import__("os").environ, "BIGPER_THREADS": "8"}) as child:
        child.said("ok", timeout=240)
        assert child.end() == 0, child.stderr()


# -- a device tier of compressed frames ------------------------------------------------------------

def _smallest_budget():
    try:
        _atari_like(compression="zstd", compression_budget=1).close()
    except bigper.InvalidArgumentError as e:
        return int(str(e).split("compression_budget=")[-1].split()[0])
    raise AssertionError("compression_budget=1 was taken")


def test_a_cpu_tier_of_compressed_frames_is_covered_and_exact_against_a_host_twin(monkeypatch):
    """``device="cpu"`` on a compressed buffer: the feed covers it (the
    frames decoded on the host, with the pool), and draw for draw it equals a
    host twin while adds release segments of live transitions."""
    import warnings

    from bigper.device.feed import covered

    monkeypatch.setenv("BIGPER_THREADS", "4")
    kw = dict(compression="zstd", compression_budget=_smallest_budget())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tier, twin = _atari_like(**kw, device="cpu"), _atari_like(**kw)
        assert covered(tier._parts, torch.device("cpu")) is None
        for buf in (tier, twin):
            _add(buf, 0, 300)
        it = tier.sampler(64, prefetch=0, device="cpu")
        assert isinstance(it, FeedSampler)
        rng = np.random.default_rng(2)
        g = 300
        for _ in range(6):
            got, want = next(it), twin.sample(64).to_torch("cpu")
            _same(got, want)
            p = torch.tensor(rng.random(64) * 5 + 0.1)
            tier.update_priorities(got, p)
            twin.update_priorities(want, p)
            for buf in (tier, twin):
                _add(buf, g, 37)
            g += 37
        it.close()
        tier.close()
        twin.close()


def _tier_pair(envs=1, k=4, budget=False, tmp=None):
    import warnings

    kw = dict(compression="zstd", num_envs=envs)
    if budget:
        kw["compression_budget"] = _smallest_budget()
    fields = {"obs": ((k, 6, 7), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [bigper.PrioritizedReplayBuffer(capacity=400, fields=fields, frame_stack=k, seed=3, device=dev, **kw)
                for dev in ("cuda", None)]


def _tier_add(buf, k, g0, n, envs=1):
    """``n`` steps of ``envs`` envs; transition t's newest frame says t % 251."""
    for s in range(g0, g0 + n):
        g = np.arange(s * envs, s * envs + envs)
        fr = lambda x: np.broadcast_to((x % 251).astype(np.uint8)[:, None, None, None], (envs, 1, 6, 7))  # noqa
        obs = np.concatenate([fr(g + (j - k + 1) * envs) for j in range(k)], axis=1)
        nxt = np.concatenate([fr(g + (j - k + 2) * envs) for j in range(k)], axis=1)
        args = dict(obs=obs, next_obs=nxt, step=g, reward=g.astype(np.float32),
                    terminated=np.full(envs, (s + 1) % 50 == 0), truncated=np.zeros(envs, bool))
        if envs == 1:
            args = {key: v[0] for key, v in args.items()}
        buf.add(**args)


@pytest.mark.skipif(not CUDA, reason="a device tier's feed runs on CUDA only")
@pytest.mark.parametrize("envs,k", [(1, 1), (3, 2), (2, 3), (4, 4)])
def test_cuda_tier_compressed_envs_and_stacks_equal_the_host_twin(envs, k):
    tier, twin = _tier_pair(envs, k, budget=True)
    for buf in (tier, twin):
        _tier_add(buf, k, 0, 80, envs)
    it = tier.sampler(16, prefetch=0, device="cuda")
    assert isinstance(it, FeedSampler)
    rng = np.random.default_rng(2)
    g = 80
    for _ in range(5):
        got, want = next(it), twin.sample(16).to_torch("cuda")
        _same(got, want)
        p = torch.tensor(rng.random(16) * 5 + 0.1, device="cuda")
        tier.update_priorities(got, p)
        twin.update_priorities(want, p)
        for buf in (tier, twin):
            _tier_add(buf, k, g, 11, envs)
        g += 11
    it.close()
    tier.close()
    twin.close()


@pytest.mark.skipif(not CUDA, reason="a device tier's feed runs on CUDA only")
def test_cuda_tier_compressed_state_dict_and_load_state_between_batches():
    tier, twin = _tier_pair(budget=True)
    for buf in (tier, twin):
        _tier_add(buf, 4, 0, 200)
    it = tier.sampler(16, prefetch=0, device="cuda")
    _same(next(it), twin.sample(16).to_torch("cuda"))
    st, st2 = tier.state_dict(), twin.state_dict()
    first = [next(it), twin.sample(16).to_torch("cuda")]
    _same(*first)
    for buf in (tier, twin):
        _tier_add(buf, 4, 200, 5)
    tier.load_state(st)
    twin.load_state(st2)
    _same(next(it), twin.sample(16).to_torch("cuda"))
    it.close()
    tier.close()
    twin.close()


@pytest.mark.skipif(not CUDA, reason="a device tier's feed runs on CUDA only")
def test_cuda_tier_compressed_save_and_load_is_exact(tmp_path):
    tier, twin = _tier_pair(budget=True)
    for buf in (tier, twin):
        _tier_add(buf, 4, 0, 200)
    tier.save(tmp_path / "snap")
    twin.save(tmp_path / "snap2")
    tier.close()
    twin.close()
    a = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", device="cuda")
    b = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap2")
    it = a.sampler(16, prefetch=0, device="cuda")
    for _ in range(4):
        got, want = next(it), b.sample(16).to_torch("cuda")
        _same(got, want)
        p = torch.rand(16, device="cuda") + 0.1
        a.update_priorities(got, p)
        b.update_priorities(want, p)
    it.close()
    a.close()
    b.close()


@pytest.mark.skipif(not CUDA, reason="a device tier's feed runs on CUDA only")
@pytest.mark.parametrize("prefetch", [0, 2])
def test_cuda_tier_compressed_close_racing_next(prefetch):
    from bigper.errors import BufferClosedError

    tier, twin = _tier_pair(budget=True)
    twin.close()
    _tier_add(tier, 4, 0, 200)
    it = tier.sampler(64, prefetch=prefetch, device="cuda")
    next(it)
    ended = []

    def learn():
        try:
            while True:
                b = next(it)
                step = _np(b["step"])
                assert (_np(b["obs"])[:, -1, 0, 0] == step % 251).all()
        except (BufferClosedError, StopIteration) as e:
            ended.append(e)

    t = threading.Thread(target=learn)
    t.start()
    tier.close()
    t.join(60)
    assert not t.is_alive() and ended
