"""Second attack on the CPU feed of compressed frames (``FeedSampler``'s own
thread, drawing ahead and decoding under the buffer's lock): two threads on
every pair of public methods while it runs and the learner keeps every batch,
a kill -9 of a process adding with a feed running then a resume, a full disk
while adds grow the log, a ``chdir`` between opening and the sampler, priority
updates at float limits, and garbage collection of the buffer or the sampler.
The risky cases run in child processes: a crash is a failure, not a dead run.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402

from tests._child import Child, env_with_root  # noqa: E402
from tests._child_batch import run_scripts, said_ok  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = """
import gc, itertools, os, sys, threading, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bigper
from bigper.errors import BigperError, BufferClosedError
from bigper.device.feed import FeedSampler
from pathlib import Path
from tests.frames.test_compression import Feed, make, check_sample, check_all_live
from tests import hook

def frames(n=400, shape=(12, 12), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 3, (n, *shape)) * 40 + np.arange(n).reshape(-1, 1, 1) % 40).astype(np.uint8)

def exact(b, feed):
    steps = b["step"].numpy()
    assert (steps == b["generations"].numpy()).all()
    for i, g in enumerate(steps):
        o, o2 = feed.added[int(g)]
        assert (b["obs"][i].numpy() == o).all(), ("obs", int(g))
        assert (b["next_obs"][i].numpy() == o2).all(), ("next_obs", int(g))
"""


# -- two threads on every pair of public methods ---------------------------------------------------

_PAIRS = _PRELUDE + """
tmp = Path(sys.argv[1])
OPS = ["add", "extend", "update", "save", "close", "sample", "state_dict", "sampler"]
pairs = list(itertools.combinations_with_replacement(OPS, 2))
errors = []
for n_pair, (a, b) in enumerate(pairs):
    buf = make("memmap", tmp, shape=(12, 12), k=3, capacity=60, name=f"b{{n_pair}}", seed=n_pair)
    feed = Feed(frames(seed=n_pair), 3, seed=n_pair)
    feed.run(buf, 30)
    mine = threading.Lock()  # (the Feed's record of stacks is not thread-safe; the buffer is)
    it = buf.sampler(8, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler), type(it)
    stop = [False]

    def op(name, j):
        i = 0
        try:
            while not stop[0]:
                i += 1
                if name == "add":
                    with mine:
                        feed.run(buf, 2)
                elif name == "extend":
                    with mine:  # (steps numbered in the order they are added: generation == step)
                        steps = [feed.step() for _ in range(4)]
                        o, o2, term, g = (np.concatenate(x) for x in zip(*steps))
                        buf.extend({{"obs": o, "next_obs": o2, "step": g, "terminated": term,
                                    "truncated": np.zeros_like(term)}})
                elif name == "update":
                    s = buf.sample(8)
                    buf.update_priorities(s, np.random.rand(8) + 0.1)
                elif name == "save":
                    buf.save(tmp / f"s{{n_pair}}_{{j}}_{{i}}")
                elif name == "close":
                    time.sleep(0.15)
                    buf.close()
                    return
                elif name == "sample":
                    with mine:
                        s = buf.sample(8)
                        for r in range(8):
                            o, o2 = feed.added[int(s["step"][r])]
                            assert (s["obs"][r] == o).all() and (s["next_obs"][r] == o2).all()
                elif name == "state_dict":
                    m, arr = buf.state_dict()
                    assert m["count"] >= 0 if isinstance(m, dict) and "count" in m else True
                elif name == "sampler":
                    it2 = buf.sampler(4, prefetch=1, device="cpu")
                    for _ in range(3):
                        bb = next(it2)
                        with mine:
                            exact(bb, feed)
                    it2.close()
                time.sleep(0.001)
        except BufferClosedError:
            pass
        except StopIteration:
            pass
        except BaseException as e:
            import traceback
            errors.append((a, b, name, traceback.format_exc()))

    ts = [threading.Thread(target=op, args=(a, 0)), threading.Thread(target=op, args=(b, 1))]
    for t in ts:
        t.start()
    kept = []
    t0 = time.time()
    try:
        # (0.25 s a pair, 36 pairs: the learner takes 13 (save) to hundreds of batches while each op runs; close,
        # 0.15 s in, lands inside the window; 0.4 s took 5 s more and reached nothing new)
        while time.time() - t0 < 0.25:
            try:
                bt = next(it)
            except (BufferClosedError, StopIteration):
                break
            with mine:
                exact(bt, feed)
            kept.append((bt, {{k: v.clone() for k, v in bt.items()}}))
            try:
                buf.update_priorities(bt, np.random.rand(8) + 0.1)
            except BufferClosedError:
                pass
    except BaseException as e:
        import traceback
        errors.append((a, b, "learner", traceback.format_exc()))
    stop[0] = True
    for t in ts:
        t.join(timeout=60)
        assert not t.is_alive(), (a, b, "hangs")
    for bt, c in kept:
        for k, v in c.items():
            assert (bt[k] == v).all(), (a, b, k)
    it.close()
    if "close" not in (a, b):
        check_sample(buf, feed, 16)
    buf.close()
    if errors:
        break
assert not errors, errors[:3]
print("ok", len(pairs), flush=True)
"""


def test_two_threads_on_every_pair_of_public_methods_while_the_feed_runs(feed2_children, request):
    """``add``/``extend``/``update_priorities``/``save``/``close``/``sample``/
    ``state_dict``/a second sampler, every pair on two threads, while the
    learner takes every batch of a compressed ``FeedSampler`` and keeps them
    all: every batch exact, kept batches unchanged, no hang or crash."""
    said_ok(feed2_children, request, timeout=300)


# -- kill -9 while adding with a feed running, then resume ------------------------------------------

_KILLED = _PRELUDE + """
tmp = Path(sys.argv[1])
buf = make("memmap", tmp, shape=(12, 12), k=3, capacity=80, budget=int(sys.argv[2]) or None, name="live", seed=1)
feed = Feed(frames(), 3, seed=7)
feed.run(buf, 20)  # (then the sampler: a compressed feed's thread draws at once, and an empty buffer refuses)
it = buf.sampler(8, prefetch=3, device="cpu")
n = 20
while True:
    feed.run(buf, 3)
    n += 3
    if n % 30 == 2:
        b = next(it)
        exact(b, feed)
        buf.update_priorities(b, np.random.rand(8) + 0.1)
    if n == 200:
        buf.save(tmp / "snap")  # with the feed's thread drawing ahead
        print("go", flush=True)
    if n > 1500:
        break
print("done", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("budget", [0, 100])
def test_kill_9_while_adding_with_a_feed_running_resumes_exact(tmp_path, budget):
    """A process adds to a compressed memmap buffer (a growing or capped log)
    with a feed drawing ahead; SIGKILL at a point it reported. The folder of a
    writer that died open is refused by ``mode="resume"`` with
    ``UncleanStorageError`` (the guide's contract, feed or not: its data and
    priorities may disagree), and changes nothing; the snapshot saved while
    the feed ran loads exact, into that folder too, and goes on."""
    with Child(_KILLED.format(root=str(ROOT)), tmp_path, budget) as child:
        child.said("go", timeout=300)
        time.sleep(0.05)  # (adds, the feed drawing ahead)
        child.kill()
    from tests.frames.test_compression import Feed, check_all_live, check_sample, make

    feed = Feed(_frames(), 3, seed=7)
    feed.run(_Sink(), 1600)
    from tests._hostile_snapshot_cases import fingerprint

    def data():  # (the lock file names whoever looked last)
        return {k: v for k, v in fingerprint(tmp_path / "live").items() if not k.endswith(".lock")}

    before = data()
    with pytest.raises(bigper.errors.UncleanStorageError):
        make("memmap", tmp_path, shape=(12, 12), k=3, capacity=80, budget=budget or None, name="live",
             seed=1, mode="resume")
    assert data() == before
    import shutil

    shutil.rmtree(tmp_path / "live")
    again = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "live")
    assert check_all_live(again, feed) > 0
    it = again.sampler(8, prefetch=2, device="cpu")
    for _ in range(5):
        b = next(it)
        for i, g in enumerate(b["step"].numpy()):
            o, o2 = feed.added[int(g)]
            np.testing.assert_array_equal(b["obs"][i].numpy(), o)
    it.close()
    check_sample(again, feed, 16)
    again.close()


class _Sink:
    def add(self, **kw):
        pass


def _frames(n=400, shape=(12, 12), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 3, (n, *shape)) * 40 + np.arange(n).reshape(-1, 1, 1) % 40).astype(np.uint8)


# -- a full disk while adds grow the log -------------------------------------------------------------

_FULL = _PRELUDE + """
from tests.conftest import fill_disk
from tests.frames.test_compression import noise
from tests.frames.test_hostile_compression import _full_fingerprint
from tests.buffer.test_validation import assert_same
mnt = Path(sys.argv[1])
live = mnt / "live"
buf = make("memmap", mnt, shape=(16, 16), k=2, capacity=200, name="live", seed=0)
feed = Feed(noise(np.random.default_rng(5), 900, (16, 16), np.uint8), 2, seed=5)
feed.run(buf, 10)
it = buf.sampler(8, prefetch=2, device="cpu")
assert isinstance(it, FeedSampler)
b = next(it); exact(b, feed)
fill_disk(mnt / "filler")
failed = False
for n in range(400):
    # the feed's thread idle (its slots full) before the look at the state
    t0 = time.time()
    while it.ready < 2 and time.time() - t0 < 10:
        time.sleep(0.005)
    time.sleep(0.02)
    before = _full_fingerprint(buf, live)
    g0, state0 = feed.g, (feed.pos[:], feed.t[:], feed.rng.bit_generator.state)
    try:
        feed.run(buf, 1)
    except OSError:
        failed = True
        break
    if n % 4 == 0:
        b = next(it); exact(b, feed)
        buf.update_priorities(b, np.random.rand(8) + 0.1)
assert failed, "adds of noise on a full disk never failed"
after = _full_fingerprint(buf, live)
assert_same(before, after)
served = 0
for _ in range(6):
    try:
        b = next(it)
    except BigperError:
        break
    exact(b, feed)
    buf.update_priorities(b, np.random.rand(8) + 0.1)
    served += 1
check_all_live(buf, feed)
os.unlink(mnt / "filler")
feed.g, feed.pos, feed.t = g0, state0[0], state0[1]
feed.rng.bit_generator.state = state0[2]
feed.run(buf, 30)
it2 = buf.sampler(8, prefetch=2, device="cpu")
for _ in range(4):
    b = next(it2); exact(b, feed)
it2.close(); it.close()
check_all_live(buf, feed)
buf.close()
again = make("memmap", mnt, shape=(16, 16), k=2, capacity=200, name="live", seed=0, mode="resume")
check_all_live(again, feed)
again.close()
print("ok", served, flush=True)
"""


def test_full_disk_while_adds_grow_the_log_with_a_feed_running(small_tmpfs):
    """A real 3 MB tmpfs filled: the add that needs room raises ``OSError``
    and changes nothing (memory and disk), the feed still serves exact
    batches, and with room again the adds go on and the folder resumes."""
    with Child(_FULL.format(root=str(ROOT)), small_tmpfs) as child:
        child.said("ok", timeout=300)
        assert child.end() == 0, child.stderr()


# -- chdir between opening and the sampler -----------------------------------------------------------

_CHDIR = _PRELUDE + """
tmp = Path(sys.argv[1])
(tmp / "a").mkdir(); (tmp / "b").mkdir()
os.chdir(tmp / "a")
kw = dict(capacity=60, fields={{"obs": ((3, 12, 12), np.uint8), "step": ((), np.int64)}}, frame_stack=3,
          compression="zstd", storage="memmap", path="rel", seed=0)
buf = bigper.PrioritizedReplayBuffer(**kw)
feed = Feed(frames(), 3, seed=2)
feed.run(buf, 40)
os.chdir(tmp / "b")
it = buf.sampler(8, prefetch=2, device="cpu")
for _ in range(5):
    b = next(it); exact(b, feed)
    buf.update_priorities(b, np.random.rand(8) + 0.1)
    feed.run(buf, 7)
snap = buf.save("snap")   # relative to the new directory, as any path the caller names now
os.chdir(tmp)
it.close()
feed.run(buf, 5)
buf.close()
assert not (tmp / "b" / "rel").exists() and not (tmp / "rel").exists(), os.listdir(tmp / "b")
os.chdir(tmp / "a")
again = bigper.PrioritizedReplayBuffer(**kw, mode="resume")
check_all_live(again, feed)
again.close()
print("ok", flush=True)
"""


def test_chdir_between_opening_and_the_sampler(feed2_children, request):
    """A memmap buffer opened at a relative path; the process changes
    directory before the sampler starts and before it closes: the feed reads
    and the buffer writes the folder it opened, which then resumes exact."""
    said_ok(feed2_children, request, timeout=300)


# -- priorities at float limits -----------------------------------------------------------------------

def _buffer(capacity=60):
    from tests.frames.test_compression import Feed

    buf = bigper.PrioritizedReplayBuffer(capacity=capacity, fields={"obs": ((3, 12, 12), np.uint8),
                                                                   "step": ((), np.int64)},
                                         frame_stack=3, compression="zstd", seed=0)
    feed = Feed(_frames(), 3, seed=4)
    feed.run(buf, capacity)
    return buf, feed


def _exact(b, feed):
    for i, g in enumerate(b["step"].numpy()):
        o, o2 = feed.added[int(g)]
        np.testing.assert_array_equal(b["obs"][i].numpy(), o)
        np.testing.assert_array_equal(b["next_obs"][i].numpy(), o2)


@pytest.mark.parametrize("bad,kind", [(bad, kind) for bad in (np.inf, -np.inf, np.nan, -1.0, -1e-40)
                                      for kind in ("numpy", "torch64", "torch32")]
                         + [(bad, kind) for bad in (np.inf, np.nan, -1.0, 70000.0) for kind in ("torch16", "bf16")
                            if (bad, kind) != (70000.0, "bf16")]
                         + [(-1.0, "int64"), (-(2.0 ** 63), "int64")])
def test_invalid_priorities_on_feed_batches_are_refused_and_change_nothing(bad, kind):
    """NaN, infinities (float16 70000 is inf), negatives (a float32 subnormal,
    int64's least), one of eight: refused, the tree and total unchanged, the
    feed goes on exact."""
    from bigper.device.feed import FeedSampler
    from bigper.errors import InvalidArgumentError

    buf, feed = _buffer()
    it = buf.sampler(8, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler)
    b = next(it)
    _exact(b, feed)
    p = np.full(8, 0.5)
    p[3] = bad
    p = {"numpy": lambda: p, "torch64": lambda: torch.tensor(p), "torch32": lambda: torch.tensor(p, dtype=torch.float32),
         "torch16": lambda: torch.tensor(p, dtype=torch.float16), "bf16": lambda: torch.tensor(p, dtype=torch.bfloat16),
         "int64": lambda: torch.tensor(p).to(torch.int64)}[kind]()
    before = (buf.total_priority, buf.prioritization.tree.copy() if hasattr(buf.prioritization.tree, "copy")
              else None)
    prios = buf.state_dict()[1]
    snap = {k: np.array(v, copy=True) for k, v in prios.items() if "prio" in k or "tree" in k}
    with pytest.raises(InvalidArgumentError):
        buf.update_priorities(b, p)
    assert buf.total_priority == before[0]
    after = buf.state_dict()[1]
    for k, v in snap.items():
        np.testing.assert_array_equal(np.asarray(after[k]), v, err_msg=k)
    for _ in range(3):
        _exact(next(it), feed)
    it.close()
    buf.close()


@pytest.mark.parametrize("value", [0.0, 5e-324, 1e-310, 1e308, np.finfo(np.float64).max, 3.4e38])
def test_extreme_finite_priorities_on_feed_batches_keep_sampling_sane(value):
    """Finite non-negative values at the ends of float64 (0, subnormals, 1e308,
    the largest double): accepted or refused with a bigper error, never a total
    or weights that are inf/nan; the feed's next batches are exact, their
    weights in [0, 1] (a batch of 1e308-priority transitions weighs ~1e-74
    of the buffer's least likely one: 0 in float32, as ``sample`` gives)."""
    from bigper.errors import BigperError

    buf, feed = _buffer()
    it = buf.sampler(8, prefetch=1, device="cpu")
    for rnd in range(4):
        b = next(it)
        _exact(b, feed)
        w = b["weights"].numpy()
        assert np.isfinite(w).all() and (w >= 0).all() and (w <= 1 + 1e-6).all(), (rnd, w)
        total = buf.total_priority
        try:
            buf.update_priorities(b, np.full(8, value))
        except BigperError:
            assert buf.total_priority == total
        assert np.isfinite(buf.total_priority), buf.total_priority
    s = buf.sample(8)
    assert np.isfinite(s.weights).all() and (s.weights >= 0).all() and (s.weights <= 1).all(), s.weights
    it.close()
    buf.close()


# -- garbage collection -------------------------------------------------------------------------------

_GC = _PRELUDE + """
tmp = Path(sys.argv[1])
base = threading.active_count()
for kind in ("memory", "memmap"):
    buf = make(kind, tmp, shape=(12, 12), k=3, capacity=60, name="g" + kind, seed=0)
    feed = Feed(frames(), 3, seed=1)
    feed.run(buf, 60)
    it = buf.sampler(8, prefetch=3, device="cpu")
    assert isinstance(it, FeedSampler)
    b = next(it); exact(b, feed)
    del buf
    gc.collect()
    ended = False
    for _ in range(8):
        try:
            b = next(it)
        except (BigperError, StopIteration):
            ended = True
            break
        exact(b, feed)   # a batch it still gives is exact
    it.close()
    gc.collect()
    # the sampler dropped while the buffer is used
    buf = make(kind, tmp, shape=(12, 12), k=3, capacity=60, name="h" + kind, seed=0)
    feed = Feed(frames(), 3, seed=1)
    feed.run(buf, 60)
    it = buf.sampler(8, prefetch=3, device="cpu")
    exact(next(it), feed)
    del it, b
    gc.collect()
    for _ in range(20):
        feed.run(buf, 5)
        check_sample(buf, feed, 16)
    it = buf.sampler(8, prefetch=2, device="cpu")
    for _ in range(3):
        exact(next(it), feed)
    del it
    gc.collect()
    buf.close()
    gc.collect()
t0 = time.time()
while threading.active_count() > base and time.time() - t0 < 10:
    time.sleep(0.05)
assert threading.active_count() == base, [t.name for t in threading.enumerate()]
print("ok", flush=True)
"""


def test_buffer_or_sampler_dropped_while_the_feed_thread_runs(feed2_children, request):
    """The buffer dropped without ``close`` while the feed's thread draws
    ahead: the sampler gives exact batches or ends with a bigper error, no
    crash; the sampler dropped while the buffer is used: the buffer goes on
    exact; every feed thread ends."""
    said_ok(feed2_children, request, timeout=300)


# -- dictionary codes wrapping past 127 under a running feed ------------------------------------------

_WRAP = _PRELUDE + """
import bigper.frames.segments, bigper.frames.dictionaries
from bigper.frames.segments import GEN_CODES
bigper.frames.segments.TRAIN_FRAMES = 40
bigper.frames.dictionaries.PAYS = bigper.frames.dictionaries.DRIFT = -100.0  # every candidate adopted
tmp = Path(sys.argv[1])
rng = np.random.default_rng(0)
fr = np.zeros((500, 16, 16), np.uint8)
fr[:, :4] = rng.integers(0, 8, (500, 4, 16))
fr[:, 8:] = np.arange(16)[None, None] * rng.integers(1, 4, (500, 1, 1))
buf = make(sys.argv[2], tmp, (16, 16), k=2, capacity=200, name="many", seed=3)
feed = Feed(fr, 2, seed=3)
feed.run(buf, 60)
mine, stop, errors = threading.Lock(), [False], []

def writer():
    try:
        while not stop[0] and hook.newest_gen(buf) <= GEN_CODES + 15:
            with mine:
                feed.run(buf, 10)
    except BaseException as e:
        errors.append(repr(e))
    stop[0] = True

w = threading.Thread(target=writer)
w.start()
it = buf.sampler(16, prefetch=3, device="cpu")
assert isinstance(it, FeedSampler)
n, kept, t0 = 0, [], time.time()
try:
    while not stop[0]:
        b = next(it)
        with mine:
            exact(b, feed)
        if n % 7 == 0:
            kept.append((b, {{k: v.clone() for k, v in b.items()}}))
        buf.update_priorities(b, np.random.rand(16) + 0.1)
        n += 1
        assert time.time() - t0 < 200, ("slow", hook.newest_gen(buf))
finally:
    stop[0] = True
    w.join()
assert not errors, errors
assert hook.newest_gen(buf) > GEN_CODES + 1, hook.newest_gen(buf)
for _ in range(10):  # after the wrap, the writer stopped
    exact(next(it), feed)
for b, c in kept:
    for k, v in c.items():
        assert (b[k] == v).all(), k
it.close()
check_all_live(buf, feed)
buf.close()
print("ok", n, flush=True)
"""


@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_the_feed_stays_exact_while_dictionary_codes_wrap_past_127(feed2_children, request, kind):
    """A writer thread whose log adopts a dictionary every 40 frames until the
    packed entry's 7-bit generation code wraps (generation 128 is code 1),
    ``FeedSampler`` drawing ahead and decoding all along: every batch is the
    stacks added for it, kept ones never change."""
    said_ok(feed2_children, request, timeout=300)


# -- frames at the packed entry's length limit; a read-only folder ------------------------------------

@pytest.mark.parametrize("n,width", [(65249, 1), (65250, 2)])
def test_the_feed_serves_frames_at_the_packed_length_limit_and_one_past(n, width):
    """Incompressible frames whose zstd bound is 65535 bytes (the packed
    entry's longest) and 65536 (wide entries): the feed's batches are exact."""
    from bigper.device.feed import FeedSampler
    from tests import hook

    buf = bigper.PrioritizedReplayBuffer(capacity=12, fields={"obs": ((2, n), np.uint8), "step": ((), np.int64)},
                                         frame_stack=2, compression="zstd", seed=0)
    assert hook.frames(buf).store.arrays["frame_index"].shape[1] == width
    fr = np.random.default_rng(0).integers(0, 256, (40, n)).astype(np.uint8)
    added = {}
    for g in range(20):
        o, o2 = fr[[max(g - 1, 0), g]], fr[[g, g + 1]]
        added[g] = (o, o2)
        buf.add(obs=o, next_obs=o2, step=g, terminated=False, truncated=False)
    it = buf.sampler(4, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler)
    for _ in range(4):
        b = next(it)
        for i, g in enumerate(b["step"].numpy()):
            np.testing.assert_array_equal(b["obs"][i].numpy(), added[int(g)][0])
            np.testing.assert_array_equal(b["next_obs"][i].numpy(), added[int(g)][1])
    it.close()
    buf.close()


def test_a_read_only_folder_is_served_exact_and_refuses_updates(tmp_path):
    from bigper.device.feed import FeedSampler
    from bigper.errors import ReadOnlyBufferError
    from tests._hostile_snapshot_cases import fingerprint
    from tests.frames.test_compression import Feed, make

    buf = make("memmap", tmp_path, shape=(12, 12), k=3, capacity=60, seed=0)
    feed = Feed(_frames(), 3, seed=1)
    feed.run(buf, 80)
    buf.close()
    before = {k: v for k, v in fingerprint(tmp_path / "buf").items() if not k.endswith(".lock")}
    ro = bigper.PrioritizedReplayBuffer(capacity=60, fields={"obs": ((3, 12, 12), np.uint8), "step": ((), np.int64)},
                                        frame_stack=3, compression="zstd", storage="memmap", path=tmp_path / "buf",
                                        mode="resume", read_only=True)
    it = ro.sampler(8, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler)
    for _ in range(5):
        b = next(it)
        _exact(b, feed)
        with pytest.raises(ReadOnlyBufferError):
            ro.update_priorities(b, np.ones(8))
    it.close()
    ro.close()
    assert {k: v for k, v in fingerprint(tmp_path / "buf").items() if not k.endswith(".lock")} == before


_RO_KILLED = _PRELUDE + """
d = Path(sys.argv[1])
ro = bigper.PrioritizedReplayBuffer(capacity=60, fields={{"obs": ((3, 12, 12), np.uint8), "step": ((), np.int64)}},
    frame_stack=3, compression="zstd", storage="memmap", path=d / "buf", mode="resume", read_only=True)
it = ro.sampler(8, prefetch=3, device="cpu")
assert isinstance(it, FeedSampler)
for _ in range(5):
    next(it)
print("go", flush=True)
while True:
    next(it)
"""


def test_kill_9_of_a_read_only_reader_with_a_feed_leaves_the_folder_resumable(tmp_path):
    """A second process reads a closed folder read-only through the feed (its
    thread drawing ahead); SIGKILL: the folder still resumes for writing,
    unchanged and exact."""
    from tests._hostile_snapshot_cases import fingerprint
    from tests.frames.test_compression import Feed, check_all_live, make

    buf = make("memmap", tmp_path, shape=(12, 12), k=3, capacity=60, seed=0)
    feed = Feed(_frames(), 3, seed=1)
    feed.run(buf, 80)
    buf.close()
    before = {k: v for k, v in fingerprint(tmp_path / "buf").items() if not k.endswith(".lock")}
    with Child(_RO_KILLED.format(root=str(ROOT)), tmp_path) as child:
        child.said("go", timeout=300)
        child.kill()
    assert {k: v for k, v in fingerprint(tmp_path / "buf").items() if not k.endswith(".lock")} == before
    again = make("memmap", tmp_path, shape=(12, 12), k=3, capacity=60, seed=0, mode="resume")
    check_all_live(again, feed)
    feed.run(again, 10)
    check_all_live(again, feed)
    again.close()


_FULL_BUSY = _PRELUDE + """
from tests.conftest import fill_disk
from tests.frames.test_compression import noise
mnt = Path(sys.argv[1])
buf = make("memmap", mnt, shape=(16, 16), k=2, capacity=200, name="live", seed=0)
feed = Feed(noise(np.random.default_rng(5), 900, (16, 16), np.uint8), 2, seed=5)
feed.run(buf, 10)
mine, stop, errors, served = threading.Lock(), [False], [], [0]

def learner():
    it = buf.sampler(8, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler)
    try:
        while not stop[0]:
            b = next(it)
            with mine:
                exact(b, feed)
            buf.update_priorities(b, np.random.rand(8) + 0.1)
            served[0] += 1
    except BaseException as e:
        errors.append(repr(e))
    it.close()

fill_disk(mnt / "filler")
t = threading.Thread(target=learner)
t.start()
failed = None
for n in range(600):
    try:
        with mine:
            feed.run(buf, 1)
    except OSError as e:
        failed = n
        # the step the add refused is not in the buffer: forget it as the Feed's record
        break
time.sleep(0.3)
stop[0] = True
t.join()
assert failed is not None, "adds of noise on a full disk never failed"
assert not errors and served[0] > 0, (errors, served)
check_all_live(buf, feed)
check_sample(buf, feed, 16)
os.unlink(mnt / "filler")  # (close writes the state: room for it)
buf.close()
again = make("memmap", mnt, shape=(16, 16), k=2, capacity=200, name="live", seed=0, mode="resume")
check_all_live(again, feed)
again.close()
print("ok", failed, served[0], flush=True)
"""


def test_full_disk_while_a_learner_thread_takes_feed_batches(small_tmpfs):
    """A learner thread takes feed batches without pause while the main thread
    adds noise onto a filled 3 MB tmpfs: the add that needs room raises
    ``OSError``, the learner's batches are all exact, every live transition too."""
    with Child(_FULL_BUSY.format(root=str(ROOT)), small_tmpfs) as child:
        child.said("ok", timeout=300)
        assert child.end() == 0, child.stderr()


@pytest.mark.parametrize("kind", ["memory", "memmap"])
@pytest.mark.parametrize("src_wide,dst_wide", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("twin_adds", [50, 70])
def test_a_refused_load_state_while_the_feed_draws_ahead_changes_nothing(tmp_path, kind, src_wide, dst_wide,
                                                                         twin_adds):
    """``load_state`` of another buffer's bookkeeping (its frame index of the
    other layout or the same, its log grown as far or further: it names log
    bytes this buffer does not hold) while ``FeedSampler`` draws ahead: refused
    with ``CorruptSnapshotError`` (the old state put back, a second restore),
    and the feed's batches, every live transition and later adds stay exact."""
    import copy

    from bigper.device.feed import FeedSampler
    from tests.frames.test_compression import Feed, check_all_live, make

    fr = _frames(300)
    a = make(kind, tmp_path, shape=(12, 12), k=3, capacity=40, seed=0, wide=dst_wide, name="a")
    fa = Feed(fr, 3, seed=1)
    fa.run(a, 50)
    w = make("memory", tmp_path, shape=(12, 12), k=3, capacity=40, seed=0, wide=src_wide, name="w")
    Feed(fr[::-1].copy(), 3, seed=2).run(w, twin_adds)
    it = a.sampler(4, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler)
    _exact(next(it), fa)
    m, arr = w.state_dict()
    with pytest.raises(bigper.errors.CorruptSnapshotError):
        a.load_state(copy.deepcopy(m), {k: np.array(v, copy=True) for k, v in arr.items()})
    for _ in range(6):
        b = next(it)
        _exact(b, fa)
        a.update_priorities(b, np.random.rand(4) + 0.1)
    check_all_live(a, fa)
    fa.run(a, 20)
    for _ in range(4):
        _exact(next(it), fa)
    check_all_live(a, fa)
    it.close()
    a.close()
    w.close()


_GC_GATHER = _PRELUDE + """
tmp = Path(sys.argv[1])
fr = frames(301)
res = {{}}
for trial in range(10):
    buf = bigper.PrioritizedReplayBuffer(capacity=300, fields={{"obs": ((2, 12, 12), np.uint8), "big": ((8192,), np.float32),
                                         "step": ((), np.int64)}}, frame_stack=2, compression="zstd",
                                         storage="memmap", path=tmp / f"b{{trial}}", seed=trial)
    big = np.ones(8192, np.float32)
    for g in range(300):
        buf.add(obs=fr[[max(g - 1, 0), g]], next_obs=fr[[g, g + 1]], big=big * g, step=g, terminated=False,
                truncated=False)
    it = buf.sampler(1024, prefetch=2, device="cpu")
    assert isinstance(it, FeedSampler)
    b = next(it)
    time.sleep(0.001 * (trial % 10))  # (the thread drawing, gathering 32 MB of ``big`` without the lock, or idle)
    del buf
    gc.collect()
    try:
        for _ in range(4):
            b = next(it)
            s = b["step"].numpy()
            assert (b["big"].numpy()[:, 17] == s).all() and (b["obs"][:, 1].numpy() == fr[s]).all()
        r = "served"
    except (BigperError, StopIteration) as e:
        r = type(e).__name__
    res[r] = res.get(r, 0) + 1
    it.close()
    del it, b
    gc.collect()
print("ok", res, flush=True)
"""


def test_a_memmap_buffer_dropped_while_the_feed_gathers_without_the_lock(feed2_children, request):
    """A memmap buffer dropped (no ``close``) while the feed's thread gathers
    32 MB batches of a field without the lock: its storage is unmapped only
    after the thread let go (no crash), and the sampler ends with a bigper
    error or serves exact batches."""
    said_ok(feed2_children, request, timeout=300)


_EXIT = _PRELUDE + """
tmp = Path(sys.argv[1])
buf = make("memmap", tmp, shape=(12, 12), k=3, capacity=80, name="live", seed=1)
feed = Feed(frames(), 3, seed=7)
feed.run(buf, 80)
it = buf.sampler(64, prefetch=4, device="cpu")
next(it); next(it)
if sys.argv[2] == "adds":
    def w():
        while feed.g < 3000:
            feed.run(buf, 5)
    threading.Thread(target=w, daemon=True).start()
    time.sleep(0.2)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("mode", ["idle", "adds"])
def test_the_interpreter_exits_without_close_while_the_feed_draws_ahead(tmp_path, mode):
    """A script ends without ``close`` while the feed's thread draws ahead (and
    a daemon thread adds): the exit closes the buffer (no hang, status 0) and
    the folder resumes exact."""
    from tests.frames.test_compression import Feed, check_all_live, check_sample, make

    with Child(_EXIT.format(root=str(ROOT)), tmp_path, mode) as child:
        child.said("exiting", timeout=300)
        assert child.end(timeout=120) == 0, child.stderr()
    feed = Feed(_frames(), 3, seed=7)
    feed.run(_Sink(), 3000)
    again = make("memmap", tmp_path, shape=(12, 12), k=3, capacity=80, name="live", seed=1, mode="resume")
    assert check_all_live(again, feed) > 0
    check_sample(again, feed, 16)
    again.close()


# The tests above that only wait for a child's "ok" run in one batch of child interpreters
# (tests/_child_batch.py: each case a fresh run of its script with its own argv and globals, its
# output and exit status apart; a crash or a hang ends only its own case and the cases after it go
# on in a new child): one interpreter start and one load of torch and bigper's kernels for the six,
# not one each. The garbage-collection case first: it counts the interpreter's threads.
@pytest.fixture(scope="module")
def feed2_children(request, tmp_path_factory):
    return run_scripts(request, tmp_path_factory, {
        "test_buffer_or_sampler_dropped_while_the_feed_thread_runs":
            (_GC.format(root=str(ROOT)), ()),
        "test_two_threads_on_every_pair_of_public_methods_while_the_feed_runs":
            (_PAIRS.format(root=str(ROOT)), ()),
        "test_chdir_between_opening_and_the_sampler":
            (_CHDIR.format(root=str(ROOT)), ()),
        "test_the_feed_stays_exact_while_dictionary_codes_wrap_past_127":
            (_WRAP.format(root=str(ROOT)), ('kind',)),
        "test_a_memmap_buffer_dropped_while_the_feed_gathers_without_the_lock":
            (_GC_GATHER.format(root=str(ROOT)), ()),
    }, env=env_with_root(), timeout=300)
