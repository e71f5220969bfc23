"""Attack on the fused decode of compressed frames (commits 9eb8e9d and
27ece2d): ``SegmentLog.decode`` of a batch (``not threads or n <= chunk``)
runs one compiled ``decode_frames(da, ids, scratch, out)`` whose arguments
(``DecodeArgs``: the storage's ``frame_index`` and flat ``frame_log``, the
counters ``st``, the live dictionary generations ``lo..hi``, this thread's
zstd ``dctx``, the codec's ``ddicts`` pointers) and an int64 scratch are
cached per thread (``threading.local``), keyed by ``Dictionaries.version``
and the identity of the arrays; a failure code falls back to the old path,
which raises the precise ``CorruptSnapshotError``.

What a cache of pointers and arrays can get wrong, tried here; every sampled
stack is held to the stacks added for its transition (``Feed``), every
decoded frame to the old path (``threads=True, chunk=0``), and every test
checks that the fused call ran (a counting wrapper of ``decode_frames``):

* stale dictionaries: adoptions every 40 frames, past ``MAX_DICTS`` (slots
  reused, their DDicts freed) and past generation 127 (the packed code
  wraps), under threads whose caches predate all of it; ``load_state``
  rewinding the dictionaries and the counters (later adoptions reuse the
  generation numbers for other dictionaries), and one refused (every
  dictionary's content damaged: the fused call inside the restore's check
  fails, the old path names the frame) that rolls back; a seeded soup of
  adds, ``extend`` past the capacity (a write's checkpoint), recorded and
  loaded states and samples on four threads; a restorer thread beside a
  writer and three samplers; ``save``/``load``, ``mode="resume"``,
  read-only, ``compression_dictionary=`` given up front;
* a stale codec: ``SegmentLog.close`` / ``Dictionaries.close`` free it and
  it is made again under another thread's cache;
* stale arrays: a memmap log that grows and shrinks again (``trim`` unmaps
  its top chunks), a memory log whose block doubles, a random-read mapping
  remapped by copy-on-write after snapshots, each under an older thread's
  cache; the scratch of 1, then thousands, of frames; 32 and 33 frames;
* many threads (each its own cache) sampling while a writer adopts, threads
  that come and go, ``close`` from another thread while two sample; a
  child sampling on a thread while it adopts and saves, killed with
  SIGKILL (a use-after-free would end it first), its last snapshot exact;
* crafted index entries, packed and wide: each is ``CorruptSnapshotError``
  naming the frame, the old path's very message, never other bytes;
* frames of 1 byte, odd sizes, uint8 and float32, over 64 KiB (the wide
  index), ``frame_stack`` 1..4, memory and memmap, capped and growing logs,
  the native feed with batches of 1 and of 400.

All of that held. What fails (strict xfails): the caches outlive what they
cache. ``PrioritizedReplayBuffer.close`` never calls ``SegmentLog.close``,
so the ``DecodeArgs`` every sampling thread keeps (``segments.py:772``)
keep a closed memmap buffer's log files mapped (``memmap.close`` promises
nothing stays held; the comment at ``segments.py:943`` says the same), as
the staged-append arguments (``segments.py:438-440``, older) already did
for a growing log; and a thread that sampled once and then waits keeps a
memory buffer's outgrown log block alive.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import queue
import re
import threading
import time
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest

import bigper
import bigper.frames.segments as segments
from bigper.errors import BufferClosedError, CorruptSnapshotError
from bigper.frames.dictionaries import MAX_DICTS
from bigper.frames.segments import GEN_CODES

from tests import hook
from tests._child import Child
from tests.device.test_hostile_compressed_feed import _exact, _frames
from tests.device.test_hostile_compressed_feed2 import _Sink
from tests.frames.test_compression import Feed, check_sample, make, noise
from tests.frames.test_compression_dicts import _always_retrain
from tests.frames.test_hostile_compression import live_ids
from tests.frames.test_hostile_frame_index import _victim

ROOT = Path(__file__).resolve().parents[2]
# The refusal of a state whose oldest frame's index row a later frame took (``check_index``).
REFUSED = re.compile(r"frame_index: frame \d+'s entry \[.*\] is not where the segment log puts it \(")


# -- helpers -------------------------------------------------------------------------------------

@pytest.fixture
def fused(monkeypatch):
    """Counts the calls of the fused kernel (``segments.decode_frames``): a
    test that means to attack it checks that it ran."""
    calls = [0]
    real = segments.decode_frames

    def counting(*a):
        calls[0] += 1
        return real(*a)
    monkeypatch.setattr(segments, "decode_frames", counting)
    return calls


def both(log, ids):
    """Frames ``ids`` through the fused call and through the old path: the same bytes."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    a = log.decode(ids, threads=False)
    b = log.decode(ids, threads=True, chunk=0)
    np.testing.assert_array_equal(a, b)
    return a


def small(buf, feed, k, sizes=(1, 2, 3)):
    """Batches whose frames are few (``B * (k + 1) <= 32``: the fused call), each exact."""
    for b in sizes:
        assert b * (k + 1) <= segments.DECODE_CHUNK
        check_sample(buf, feed, b)


class Other:
    """A thread of its own (its own cache) that runs what it is handed, one call at a time."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while True:
            fn, box, done = self.q.get()
            if fn is None:
                return
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
                box.append((False, e))
            done.set()

    def __call__(self, fn, timeout=120):
        box, done = [], threading.Event()
        self.q.put((fn, box, done))
        assert done.wait(timeout), "the other thread hangs"
        ok, v = box[0]
        if not ok:
            raise v
        return v

    def stop(self):
        self.q.put((None, None, None))
        self.t.join(30)
        assert not self.t.is_alive()


def _slot_of(buf, f):
    """A live slot whose obs stack reads frame ``f``."""
    fs = hook.frames(buf)
    live = np.flatnonzero(buf.status == 1)
    refs = fs._refs("obs_ref", live)
    hit = np.flatnonzero((refs == f).any(axis=1))
    assert hit.size, f"no live obs stack reads frame {f}"
    return int(live[hit[0]])


# -- 1. stale dictionaries: adoptions past MAX_DICTS and past code 127 ---------------------------

@pytest.mark.parametrize("kind,budget", [("memory", None), ("memmap", 64)])
def test_small_batches_stay_exact_while_codes_wrap_past_127_under_an_old_threads_cache(kind, budget, tmp_path,
                                                                                      monkeypatch, fused):
    """A dictionary adopted every 40 frames until the newest generation's
    7-bit code wrapped (generation 128 is code 1, more than ``MAX_DICTS``
    slots reused, their DDicts freed): batches of 1..3 after each adoption
    are exact, the fused call equals the old path on every live frame, and a
    thread that cached its arguments at generation 1 and waited all along
    decodes exact at the end."""
    _always_retrain(monkeypatch)
    k = 2
    buf = make(kind, tmp_path, (12, 12), k=k, capacity=120, budget=budget, seed=3)
    feed = Feed(_frames(np.uint8, (12, 12), seed=1, n=400), k, seed=3)
    feed.run(buf, 45)
    log = hook.log(buf)
    assert log.dicts.hi >= 1
    other = Other()
    try:
        other(lambda: small(buf, feed, k))
        first = fused[0]
        assert first > 0
        seen = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (a capped log may say it costs capacity)
            while log.dicts.hi <= GEN_CODES + 3:
                feed.run(buf, 40)
                small(buf, feed, k, (1, 3))
                seen += 1
                if seen % 16 == 0:
                    both(log, live_ids(buf))
        assert log.dicts.hi > GEN_CODES + 1 and log.dicts.lo > MAX_DICTS
        other(lambda: small(buf, feed, k, (1, 2, 3, 5)))
        other(lambda: both(log, live_ids(buf)[:30]))
        assert fused[0] > first + seen
    finally:
        other.stop()
    buf.close()


def test_many_threads_each_with_its_cache_sample_exact_while_a_writer_adopts(tmp_path, monkeypatch, fused):
    """A writer thread adopting a dictionary every 40 frames (past
    ``MAX_DICTS``), a thread rewinding the buffer to the state it recorded a
    moment before (``load_state``: the dictionaries and counters go back,
    or it is refused and rolled back), three sampler threads drawing batches
    of 1..6 and a stream of threads that sample once and end: every stack
    exact, no error.

    Once ``F`` frames were written, a recorded state checks the last ``F``
    (``check_index``) and every frame the writer adds after it takes the
    ``frame_index`` row of the oldest of them (``f % F``), which the oldest
    live transition still reads: a state recorded one add ago is refused,
    rightly (the frame's entry "is not where the segment log puts it"). Under
    load the writer adds in every 10 ms window, so every other record ->
    load holds the writer off (``wlock``, taken around each of its runs) and
    must be taken; the others race it, and a refusal of theirs must be that
    one, after the writer moved. The writer goes on until one was taken."""
    _always_retrain(monkeypatch)
    k = 4
    buf = make("memory", tmp_path, (10, 10), k=k, capacity=150, seed=4)
    feed = Feed(_frames(np.uint8, (10, 10), seed=2, n=300), k, seed=4)
    feed.run(buf, 50)
    log = hook.log(buf)
    stop, errors, counts = threading.Event(), [], []
    wlock, restored = threading.Lock(), threading.Event()

    def writer():
        try:
            while not stop.is_set() and (log.dicts.hi < 2 * MAX_DICTS + 4 or not restored.is_set()):
                with wlock:
                    feed.run(buf, 10)
        except BaseException as e:  # noqa: BLE001
            errors.append(("writer", repr(e)))
        stop.set()

    def sampler(i):
        n = 0
        try:
            while not stop.is_set():
                check_sample(buf, feed, 1 + (n + i) % 6)
                n += 1
        except BaseException as e:  # noqa: BLE001
            errors.append((f"sampler {i}", repr(e)))
            stop.set()
        counts.append(n)

    def once():
        try:
            check_sample(buf, feed, 2)
        except BaseException as e:  # noqa: BLE001
            errors.append(("once", repr(e)))

    def restorer():
        n = 0
        try:
            while not stop.is_set():
                held = n % 2 == 0  # (the first one too: one is taken on any machine)
                n += 1
                with wlock if held else contextlib.nullcontext():
                    with buf._guard.lock:  # (a copy the writer cannot tear: a torn one is refused, rightly)
                        rec = copy.deepcopy(buf.state_dict())
                    time.sleep(0.01)
                    try:
                        buf.load_state(*rec)
                        loads.append(True)
                        restored.set()
                    except CorruptSnapshotError as e:
                        # (rolled back: fw as at the load, or later)
                        moved = hook.frames(buf).fw - rec[0]["frames"]["fw"]
                        loads.append(False)
                        if held or moved <= 0 or not REFUSED.match(str(e)):
                            errors.append(("restorer", f"held={held}", f"moved={moved}", str(e)))
                            stop.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(("restorer", repr(e)))
            stop.set()

    loads = []
    threads = [threading.Thread(target=writer), threading.Thread(target=restorer)] + \
        [threading.Thread(target=sampler, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    born = 0
    t0 = time.time()
    while not stop.is_set() and time.time() - t0 < 150:  # (the writer's adoptions end it: seconds, unloaded)
        t = threading.Thread(target=once)
        t.start()
        t.join()
        born += 1
    stop.set()
    for t in threads:
        t.join(150)
    assert not errors, errors
    assert log.dicts.hi >= 2 * MAX_DICTS + 4
    assert min(counts) > 0 and born > 0 and fused[0] > born and restored.is_set() and any(loads)
    small(buf, feed, k, (1, 2, 6))
    buf.close()


# -- 2. load_state rewinds the dictionaries; a refused one rolls back -------------------------------

def test_load_state_rewinds_dictionaries_and_a_refused_one_rolls_back(tmp_path, monkeypatch, fused):
    """``load_state`` of a state recorded three adoptions ago (the
    dictionaries and counters rewound; later adoptions then reuse the same
    generation numbers for other dictionaries), and one of the present state
    with every dictionary's content damaged (zstd takes them; the fused
    call inside the restore fails on it, the old path names it; the state
    rolls back): batches stay exact in this thread and in one whose cache
    predates each change."""
    _always_retrain(monkeypatch)
    k = 3
    rng = np.random.default_rng(3)
    frames = np.repeat(rng.integers(0, 256, (1, 12, 12), dtype=np.uint8), 400, axis=0)  # (a dictionary's
    frames[:, 0, :3] = rng.integers(0, 256, (400, 3))  # content is what they are made of)
    buf = make("memory", tmp_path, (12, 12), k=k, capacity=600, seed=5)
    feed = Feed(frames, k, seed=5)
    feed.run(buf, 90)
    log = hook.log(buf)
    other = Other()
    try:
        other(lambda: small(buf, feed, k))
        rec = copy.deepcopy(buf.state_dict())
        gen_then, fw_then = log.dicts.hi, hook.frames(buf).fw
        feed.run(buf, 200)
        assert log.dicts.hi >= gen_then + 3
        small(buf, feed, k)
        buf.load_state(*rec)
        assert log.dicts.hi == gen_then and hook.frames(buf).fw == fw_then
        small(buf, feed, k)
        other(lambda: small(buf, feed, k))
        before = fused[0]
        feed.run(buf, 200)  # (the rewound generations are adopted again, other dictionaries)
        assert log.dicts.hi >= gen_then + 3
        other(lambda: small(buf, feed, k, (1, 2, 3, 4)))
        small(buf, feed, k)
        assert fused[0] > before

        meta, arrays = copy.deepcopy(buf.state_dict())
        blob = arrays["frames_dict"]
        sizes = meta["frames"]["dict_sizes"]
        for end, size in zip(np.cumsum(sizes), sizes):  # each dictionary's content, not its header
            blob[end - 3 * size // 4:end] ^= 0x5A
        gens = (log.dicts.lo, log.dicts.hi)
        before = fused[0]
        with pytest.raises(CorruptSnapshotError, match="does not decompress"):
            buf.load_state(meta, arrays)
        assert fused[0] > before  # (the restore's check decoded through the fused call, which failed)
        assert (log.dicts.lo, log.dicts.hi) == gens
        small(buf, feed, k)
        other(lambda: small(buf, feed, k, (1, 5)))
        both(log, live_ids(buf))
    finally:
        other.stop()
    buf.close()


def _extend(buf, feed, m):
    """``m`` steps of ``feed`` in one ``extend`` (more rows than slots: the write's checkpoint)."""
    o, o2, term, g = zip(*[feed.step() for _ in range(m)])
    buf.extend({"obs": np.concatenate(o), "next_obs": np.concatenate(o2), "step": np.concatenate(g),
                "terminated": np.concatenate(term), "truncated": np.zeros(m, bool)})


@pytest.mark.slow  # (CI time: run with -m slow)
@pytest.mark.parametrize("kind,seed", [("memory", 0), ("memmap", 1), ("memory", 2)])
def test_a_seeded_soup_of_writes_restores_and_samples_on_four_threads(kind, seed, tmp_path, monkeypatch, fused):
    """Two hundred operations drawn at random: adds, ``extend`` of up to three
    times the capacity (a write's checkpoint), ``state_dict`` recorded,
    ``load_state`` of any recorded state (accepted, or refused and rolled
    back: the frames it names were overwritten), batches of 1..7 in this
    thread or one of three others (each its own cache, made at any point of
    this history), all frames through both paths: every stack exact."""
    _always_retrain(monkeypatch)
    k = 2
    r = np.random.default_rng(seed)
    buf = make(kind, tmp_path, (10, 10), k=k, capacity=100, seed=seed)
    feed = Feed(_frames(np.uint8, (10, 10), seed=seed, n=300), k, seed=seed)
    feed.run(buf, 30)
    log = hook.log(buf)
    others = [Other() for _ in range(3)]
    states, done = [], {"accepted": 0, "refused": 0}
    ops = ["add", "extend", "main", "other", "other", "record", "load", "both"]
    try:
        for _ in range(200):
            op = ops[int(r.integers(len(ops)))]
            if op == "add":
                feed.run(buf, int(r.integers(1, 60)))
            elif op == "extend":
                _extend(buf, feed, int(r.integers(2, 300)))
            elif op == "main":
                check_sample(buf, feed, int(r.integers(1, 8)))
            elif op == "other":
                b = int(r.integers(1, 8))
                others[int(r.integers(3))](lambda: check_sample(buf, feed, b))
            elif op == "record":
                states.append(copy.deepcopy(buf.state_dict()))
            elif op == "load" and states:
                st = states[int(r.integers(len(states)))]
                buf.state_dict()  # (load_state's own settles a dictionary look in flight first)
                gens = (log.dicts.lo, log.dicts.hi, hook.frames(buf).fw)
                try:
                    buf.load_state(*copy.deepcopy(st))
                    done["accepted"] += 1
                except CorruptSnapshotError:
                    assert (log.dicts.lo, log.dicts.hi, hook.frames(buf).fw) == gens
                    done["refused"] += 1
            elif op == "both":
                both(log, live_ids(buf))
        for o in others:
            o(lambda: small(buf, feed, k, (1, 7)))
    finally:
        for o in others:
            o.stop()
    assert done["accepted"] > 0 and log.dicts.hi > 2 * MAX_DICTS and fused[0] > 50, (done, log.dicts.hi)
    buf.close()


# -- 3. snapshots, resume, a dictionary given up front --------------------------------------------------

@pytest.mark.parametrize("given", [False, True])
def test_save_load_and_resume_then_small_batches_are_exact(given, tmp_path, monkeypatch, fused):
    """A memmap buffer (adoptions past ``MAX_DICTS``, or a dictionary given up
    front) saved, closed, resumed (``mode="resume"``, then read-only) and
    loaded from its snapshot into memory: batches of 1..7 exact in each, in this thread and
    in one whose cache was made for the buffer before."""
    k = 3
    frames = _frames(np.uint8, (9, 11), seed=6, n=300)
    kw = {}
    if given:
        kw["compression_dictionary"] = bigper.train_dictionary(frames[:200], 1024)
    else:
        _always_retrain(monkeypatch)
    buf = make("memmap", tmp_path, (9, 11), k=k, capacity=100, name="live", seed=6, **kw)
    feed = Feed(frames, k, seed=6)
    feed.run(buf, 40 if given else 420)
    assert (hook.log(buf).dicts.hi == 1) if given else (hook.log(buf).dicts.lo > 1)
    other = Other()
    try:
        other(lambda: small(buf, feed, k))
        snap = buf.save(tmp_path / "snap")
        buf.close()
        back = make("memmap", tmp_path, (9, 11), k=k, capacity=100, name="live", mode="resume", **kw)
        small(back, feed, k, (1, 7))
        other(lambda: small(back, feed, k, (1, 4)))
        feed.run(back, 60)
        small(back, feed, k, (1, 7))
        back.close()
        ro = make("memmap", tmp_path, (9, 11), k=k, capacity=100, name="live", mode="resume", read_only=True)
        small(ro, feed, k, (1, 7))  # (read-only arrays: another compiled signature)
        other(lambda: small(ro, feed, k, (2,)))
        both(hook.log(ro), live_ids(ro))
        ro.close()
        loaded = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "loaded")
        other(lambda: small(loaded, feed, k, (2, 3)))
        small(loaded, feed, k)
        both(hook.log(loaded), live_ids(loaded))
        loaded.close()
    finally:
        other.stop()
    assert fused[0] > 8


# -- 4. a stale codec: closed and made again ---------------------------------------------------------------

def test_the_codec_closed_and_made_again_under_another_threads_cache(tmp_path, monkeypatch, fused):
    """``SegmentLog.close`` (what ``verify`` calls on its own log) and
    ``Dictionaries.close`` free the codec: its dctx and DDicts. A thread whose
    kept arguments point at them decodes next through a codec made again,
    exact; so does this thread, repeatedly."""
    _always_retrain(monkeypatch)
    k = 2
    buf = make("memory", tmp_path, (12, 12), k=k, capacity=150, seed=7)
    feed = Feed(_frames(np.uint8, (12, 12), seed=4, n=400), k, seed=7)
    feed.run(buf, 200)
    log = hook.log(buf)
    ids = live_ids(buf)
    want = log.decode(ids, threads=True, chunk=0)
    other = Other()
    try:
        other(lambda: log.decode(ids[:10], threads=False))
        small(buf, feed, k)
        for i in range(4):  # (the log's close drops the caches too; the dictionaries' close alone does not)
            old = log.codec
            (log.close if i % 2 else log.dicts.close)()
            assert log.codec is not old
            np.testing.assert_array_equal(other(lambda: log.decode(ids, threads=False)), want)
            np.testing.assert_array_equal(log.decode(ids[:7], threads=False), want[:7])
            small(buf, feed, k)
        feed.run(buf, 50)  # (adoptions with the codec made again)
        small(buf, feed, k)
        other(lambda: small(buf, feed, k))
    finally:
        other.stop()
    assert fused[0] >= 12
    buf.close()


# -- 5. stale arrays: a log that grows and shrinks; the scratch ------------------------------------------

@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_log_that_grows_then_gives_slots_back_under_an_older_threads_cache(kind, tmp_path, fused):
    """Incompressible frames grow the log (memmap: chunk files mapped in; memory:
    the block doubles), then compressible ones let ``trim`` give the top
    slots back (memmap: their chunks unmapped). A thread that cached the log
    before each change decodes after it, exact (never through a view of the
    log it holds no more)."""
    k = 2
    rng = np.random.default_rng(8)
    loud = noise(rng, 400, (12, 12), np.uint8)
    quiet = np.zeros((400, 12, 12), np.uint8)  # (a few bytes each once compressed)
    quiet[:, 0, :4] = rng.integers(0, 256, (400, 4))
    buf = make(kind, tmp_path, (12, 12), k=k, capacity=120, seed=8)
    log = hook.log(buf)
    feed = Feed(quiet, k, seed=8)
    feed.run(buf, 20)
    other = Other()
    try:
        other(lambda: small(buf, feed, k))
        slots0 = log.slots
        noisy = Feed(loud, k, seed=9)
        noisy.g, noisy.added = feed.g, feed.added
        noisy.run(buf, 160)
        grown = log.slots
        assert grown > slots0 + 2
        other(lambda: small(buf, noisy, k, (1, 2, 3, 4)))
        quiet_again = Feed(quiet, k, seed=10)
        quiet_again.g, quiet_again.added = noisy.g, noisy.added
        low = grown
        for _ in range(40):
            quiet_again.run(buf, 20)
            low = min(low, log.slots)
            if log.slots < grown - 2:
                break
        assert log.slots < grown - 2, (grown, log.slots)
        other(lambda: small(buf, quiet_again, k, (1, 2, 3, 4)))
        other(lambda: both(log, live_ids(buf)))
        small(buf, quiet_again, k)
    finally:
        other.stop()
    assert fused[0] > 8
    buf.close()


def test_random_reads_snapshots_copy_on_write_and_growth_under_an_older_threads_cache(tmp_path, monkeypatch,
                                                                                       fused):
    """A memmap log read through its second, random-read mapping
    (``random_reads=True``: what ``arrays`` gives, and the fused call keeps),
    written through the first: a snapshot shares its chunks, the adds after
    it copy them and remap both mappings, the log grows; a thread that cached
    the log before each step decodes after it, exact, as this one does."""
    _always_retrain(monkeypatch)
    k = 3
    rng = np.random.default_rng(17)
    buf = make("memmap", tmp_path, (12, 12), k=k, capacity=150, name="live", seed=17,
               storage_options={"random_reads": True})
    assert buf.storage.arrays["frame_log"].ctypes.data != buf.storage.writable_arrays["frame_log"].ctypes.data
    feed = Feed(_frames(np.uint8, (12, 12), seed=17, n=300), k, seed=17)
    feed.run(buf, 100)
    slots0 = hook.log(buf).slots
    other = Other()
    try:
        other(lambda: small(buf, feed, k))
        for i in range(3):
            buf.save(tmp_path / f"snap{i}")
            assert buf.storage.shared_chunks > 0
            other(lambda: small(buf, feed, k, (1,)))
            loud = Feed(noise(rng, 200, (12, 12), np.uint8), k, seed=18 + i)
            loud.g, loud.added = feed.g, feed.added
            loud.run(buf, 60)  # (chunks copied and remapped; the log grows)
            feed.g = loud.g
            other(lambda: small(buf, feed, k, (1, 2, 5)))
            small(buf, feed, k, (1, 7))
            both(hook.log(buf), live_ids(buf))
            feed.run(buf, 40)
    finally:
        other.stop()
    assert fused[0] > 15 and hook.log(buf).slots > slots0
    buf.close()


def test_the_scratch_of_a_batch_of_one_then_thousands_then_one(tmp_path, fused):
    """One thread decodes 1 frame (a scratch of 1,024), then 3,000 (made
    again, larger), then 2, then 5,000 repeated ids: each equal to the old
    path; 32 frames asked on the pool's threads take the fused call, 33 the
    old path, the same bytes; the native feed serves batches of 1, then 400
    (2,000 frames), then 1, exact."""
    pytest.importorskip("torch")
    k = 4
    buf = make("memory", tmp_path, (6, 6), k=k, capacity=600, seed=9)
    feed = Feed(_frames(np.uint8, (6, 6), seed=9, n=300), k, seed=9)
    feed.run(buf, 700)
    log = hook.log(buf)
    ids = live_ids(buf)
    rng = np.random.default_rng(9)
    for n in (1, 3000, 2, 5000, 1):
        both(log, rng.choice(ids, n))
    want = log.decode(ids[:40], threads=True, chunk=0)
    before = fused[0]
    np.testing.assert_array_equal(log.decode(ids[:32]), want[:32])  # (the pool's threads asked: 32 fused)
    assert fused[0] == before + 1
    np.testing.assert_array_equal(log.decode(ids[:33]), want[:33])  # (33: the old path)
    assert fused[0] == before + 1
    for b in (1, 400, 1):
        it = buf.sampler(b, prefetch=2, device="cpu")
        for _ in range(3):
            _exact(next(it), feed)
        it.close()
    assert fused[0] >= 5
    buf.close()


# -- 6. frames of every size and type --------------------------------------------------------------------

GEOMETRY = [  # (storage, shape, dtype, frame_stack, budget, incompressible)
    ("memory", (1, 1), np.uint8, 1, None, False),
    ("memmap", (3, 5), np.uint8, 2, None, False),
    ("memory", (7, 9), np.float32, 3, 64, False),
    ("memmap", (5, 7), np.float32, 4, None, True),
    ("memory", (256, 256), np.uint8, 2, None, True),  # over 64 KiB compressed: the wide index
    ("memmap", (181, 181), np.uint8, 1, None, True),  # 32,761 bytes, odd
]


@pytest.mark.slow  # (CI time: run with -m slow)
@pytest.mark.parametrize("kind,shape,dtype,k,budget,loud", GEOMETRY)
def test_frames_of_every_size_and_type_decode_exact(kind, shape, dtype, k, budget, loud, tmp_path, fused):
    """1-byte frames, odd sizes, float32, frames over 64 KiB compressed (the
    wide index), frame_stack 1..4, capped and growing logs: batches of 1 and
    of as many as the fused call takes are exact, ``gather`` of one slot too,
    and every live frame decodes the same through both paths."""
    big = int(np.prod(shape)) * np.dtype(dtype).itemsize > 20000
    cap = 12 if big else 60
    frames = noise(np.random.default_rng(11), 40 if big else 200, shape, dtype) if loud else \
        _frames(dtype, shape, seed=11, n=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a capped log may say it costs capacity)
        buf = make(kind, tmp_path, shape, dtype=dtype, k=k, capacity=cap, budget=budget, seed=11)
        feed = Feed(frames, k, seed=11)
        feed.run(buf, cap + cap // 2)
        log = hook.log(buf)
        if shape == (256, 256):
            assert log.width == 2
        most = segments.DECODE_CHUNK // (k + 1)
        small(buf, feed, k, sorted({1, 2, most}))
        ids = live_ids(buf)
        both(log, ids)
        both(log, ids[:1])
        s = int(np.flatnonzero(buf.status == 1)[0])
        g = buf.gather([s])
        o, o2 = feed.added[int(g["step"][0])]
        np.testing.assert_array_equal(g["obs"][0], o)
        np.testing.assert_array_equal(g["next_obs"][0], o2)
    assert fused[0] >= 4
    buf.close()


# -- 7. crafted index entries ---------------------------------------------------------------------------

def _craft_cases(log, o, ln, d):
    seg, top = log.seg, log.log_bytes
    cases = {
        "offset past the log": dict(offset=top),
        "offset at the log's end minus one": dict(offset=top - 1),
        "length 0": dict(length=0),
        "length past the largest frame": dict(length=log.max_len + 1),
        "across a segment's end": dict(offset=(o // seg + 1) * seg - 1, length=max(ln, 2)),
        "one byte into its frame": dict(offset=o + 1, length=ln - 1),
        "a generation past the newest": dict(gen=log.dicts.hi + 1),
        "no dictionary": dict(gen=0),
    }
    if log.dicts.lo > 1:
        cases["a generation before the oldest live"] = dict(gen=log.dicts.lo - 1)
    if log.dicts.hi > log.dicts.lo:
        cases["another live generation"] = dict(gen=log.dicts.lo if d != log.dicts.lo else log.dicts.hi)
    return cases


@pytest.mark.parametrize("kind,wide", [("memory", False), ("memmap", False), ("memmap", True)])
def test_crafted_index_entries_are_corrupt_snapshot_error_naming_the_frame(kind, wide, tmp_path, monkeypatch,
                                                                           fused):
    """A live frame's index entry crafted (outside the log, a length of 0 or
    past the largest frame, across a segment's end, into its own frame, a
    generation outside the live ones or another live one, none), packed or
    wide: the fused
    decode of it, alone and inside a batch of 24, is ``CorruptSnapshotError``
    naming that frame with the old path's very message; ``gather`` of its slot
    too; the entry put back, it decodes to its bytes again."""
    _always_retrain(monkeypatch)
    k = 3
    buf = make(kind, tmp_path, (8, 8), k=k, capacity=60, seed=12, wide=wide)
    feed = Feed(_frames(np.uint8, (8, 8), seed=12, n=300), k, seed=12)
    feed.run(buf, 420)
    log = hook.log(buf)
    assert log.dicts.hi > log.dicts.lo > 1 and log.width == (2 if wide else 1)
    f, r, _ = _victim(buf)
    index = buf.storage.writable_arrays["frame_index"]
    good = np.array(index[r])
    (o,), (ln,), (d,) = hook.entries(buf, index, [r])
    o, ln, d = int(o), int(ln), int(d)
    want = log.decode(np.array([f]), threads=True, chunk=0).copy()
    slot = _slot_of(buf, f)
    ids = live_ids(buf)
    batch = np.concatenate([ids[ids != f][:12], [f], ids[ids != f][12:23]]).astype(np.int64)
    assert batch.shape[0] == 24
    for name, change in _craft_cases(log, o, ln, d).items():
        hook.set_entries(buf, index, [r], **change)
        for what in (np.array([f], dtype=np.int64), batch):
            before = fused[0]
            with pytest.raises(CorruptSnapshotError, match=f"frame {f}[ ']") as new:
                log.decode(what, threads=False)
            assert fused[0] == before + 1, name
            with pytest.raises(CorruptSnapshotError) as old:
                log.decode(what, threads=True, chunk=0)
            assert str(new.value) == str(old.value), name
        with pytest.raises(CorruptSnapshotError, match=f"frame {f}[ ']"):
            buf.gather([slot])
        index[r] = good
        np.testing.assert_array_equal(log.decode(np.array([f]), threads=False), want, err_msg=name)
    small(buf, feed, k)
    buf.close()


# -- 8. sampling after close; what a closed buffer keeps ------------------------------------------------

@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_close_while_threads_sample_then_every_read_is_refused(kind, tmp_path, fused):
    """Two threads sampling batches of 1..5 without pause and a native feed
    open when another thread closes the buffer (a memmap's maps let go): every
    batch before is exact, every call after is ``BufferClosedError`` (the
    threads, ``sample``, ``gather``, the feed's ``next``, a new ``sampler``),
    never a crash or other bytes."""
    pytest.importorskip("torch")
    k = 2
    buf = make(kind, tmp_path, (8, 8), k=k, capacity=40, seed=13)
    feed = Feed(_frames(np.uint8, (8, 8), seed=13, n=100), k, seed=13)
    feed.run(buf, 30)
    it = buf.sampler(2, prefetch=2, device="cpu")
    _exact(next(it), feed)
    errors, ends, counts = [], [], []

    def sampler(i):
        n = 0
        try:
            while True:
                check_sample(buf, feed, 1 + (n + i) % 5)
                n += 1
        except BufferClosedError:
            ends.append(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))
        counts.append(n)

    threads = [threading.Thread(target=sampler, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    closer = threading.Thread(target=buf.close)
    closer.start()
    closer.join(60)
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(ends) == [0, 1] and min(counts) > 0
    for call in (lambda: buf.sample(2), lambda: buf.gather([0]), lambda: next(it),
                 lambda: buf.sampler(2, device="cpu")):
        with pytest.raises(BufferClosedError):
            call()
    assert fused[0] > 2


def _mapped(folder) -> list[str]:
    """The compressed log's files under ``folder`` this process maps (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) == 6 else ""
            if name.startswith(str(folder)) and ("frame_log" in name or "frame_index" in name):
                out.append(name)
    return sorted(set(out))


def test_a_closed_memmap_buffer_sampled_in_batches_too_big_for_the_fused_call_maps_nothing(tmp_path, fused):
    """The control of the next test: a capped memmap buffer (no staged adds)
    sampled in batches of 40 frames or more only (the old path), closed and
    still referenced: none of its files stays mapped."""
    k = 3
    buf = make("memmap", tmp_path, (8, 8), k=k, capacity=60, budget=64, name="live", seed=14)
    feed = Feed(_frames(np.uint8, (8, 8), seed=14, n=200), k, seed=14)
    feed.run(buf, 80)
    assert _mapped(tmp_path / "live")
    check_sample(buf, feed, 40)
    buf.close()
    gc.collect()
    assert fused[0] == 0
    assert _mapped(tmp_path / "live") == []


# (Was a strict xfail, fixed: see the commit that removed its marker.)
@pytest.mark.parametrize("where", ["this thread", "another thread"])
def test_a_closed_memmap_buffer_sampled_through_the_fused_call_maps_nothing(where, tmp_path, fused):
    """The same buffer sampled in batches of 2 (the fused call), in this thread
    or in another that lives on: once closed, none of its files may stay
    mapped (a deleted run folder's space would stay taken)."""
    k = 3
    buf = make("memmap", tmp_path, (8, 8), k=k, capacity=60, budget=64, name="live", seed=14)
    feed = Feed(_frames(np.uint8, (8, 8), seed=14, n=200), k, seed=14)
    feed.run(buf, 80)
    other = Other()
    try:
        if where == "this thread":
            check_sample(buf, feed, 2)
        else:
            other(lambda: check_sample(buf, feed, 2))
        assert fused[0] >= 1
        buf.close()
        gc.collect()
        assert _mapped(tmp_path / "live") == []
    finally:
        other.stop()


# (Was a strict xfail, fixed: see the commit that removed its marker.)
def test_a_closed_memmap_buffer_with_a_growing_log_maps_nothing(tmp_path, fused):
    """The default, growing log, sampled only in batches too big for the
    fused call: once closed, none of its log files may stay mapped."""
    k = 3
    buf = make("memmap", tmp_path, (8, 8), k=k, capacity=60, name="live", seed=14)
    feed = Feed(_frames(np.uint8, (8, 8), seed=14, n=200), k, seed=14)
    feed.run(buf, 80)
    check_sample(buf, feed, 40)
    assert fused[0] == 0
    buf.close()
    gc.collect()
    assert _mapped(tmp_path / "live") == []


def _grow_memory_log(tmp_path):
    k = 2
    buf = make("memory", tmp_path, (12, 12), k=k, capacity=300, seed=15)
    feed = Feed(_frames(np.uint8, (12, 12), seed=15, n=300), k, seed=15)
    feed.run(buf, 10)
    return buf, feed, k


def _outgrow(buf, feed, block):
    """Adds incompressible frames until the memory log's block is replaced."""
    loud = Feed(noise(np.random.default_rng(15), 400, (12, 12), np.uint8), 2, seed=16)
    loud.g, loud.added = feed.g, feed.added
    store = hook.frames(buf).store
    for _ in range(60):
        loud.run(buf, 10)
        if store._room["frame_log"][0] is not block:
            log = hook.log(buf)
            for _ in range(40):  # (until an add that fits the open segment made the staged arguments again)
                if log._staged_key is None or log._staged_key[0].base is not block:
                    return loud
                loud.run(buf, 1)
            raise AssertionError("the staged arguments still hold the old block")
    raise AssertionError("the log never outgrew its block")


# (Was a strict xfail, fixed: see the commit that removed its marker.)
def test_a_thread_that_sampled_once_and_waits_does_not_keep_an_outgrown_log_block(tmp_path, fused):
    buf, feed, k = _grow_memory_log(tmp_path)
    block = hook.frames(buf).store._room["frame_log"][0]
    gone = weakref.ref(block)
    other = Other()
    try:
        other(lambda: check_sample(buf, feed, 2))
        assert fused[0] >= 1
        _outgrow(buf, feed, block)
        del block
        gc.collect()
        assert gone() is None, "the old log block is still referenced"
    finally:
        other.stop()
    buf.close()


def test_a_thread_that_ends_lets_its_cache_go(tmp_path, fused):
    """The control: once the thread that sampled ends, the outgrown block goes."""
    buf, feed, k = _grow_memory_log(tmp_path)
    block = hook.frames(buf).store._room["frame_log"][0]
    gone = weakref.ref(block)
    other = Other()
    other(lambda: check_sample(buf, feed, 2))
    other.stop()
    assert fused[0] >= 1
    loud = _outgrow(buf, feed, block)
    del block
    gc.collect()
    assert gone() is None
    small(buf, loud, k)
    buf.close()


# -- 9. a child sampling on a thread while it adopts and saves, killed -9 ---------------------------------

_KILLED = """
import sys, threading, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bigper, bigper.frames.segments, bigper.frames.dictionaries
bigper.frames.segments.TRAIN_FRAMES = 40
bigper.frames.dictionaries.PAYS = bigper.frames.dictionaries.DRIFT = -100.0
from pathlib import Path
from tests.frames.test_compression import Feed, make, check_sample
from tests.frames.test_hostile_frame_index import _frames
from tests import hook
tmp = Path(sys.argv[1])
buf = make("memmap", tmp, (8, 8), k=3, capacity=150, name="live", seed=2)
feed = Feed(_frames(400), 3, seed=9)
feed.run(buf, 10)
stop, errors, done = [False], [], [0]

def sampler():
    n = 0
    try:
        while not stop[0]:
            check_sample(buf, feed, 1 + n % 7)
            n += 1
            done[0] = n
    except BaseException as e:
        errors.append(repr(e))
        stop[0] = True

t = threading.Thread(target=sampler, daemon=True)
t.start()
saved = 0
while not stop[0]:
    feed.run(buf, 40)
    if saved < 3 and hook.newest_gen(buf) >= 10 * (saved + 1):
        buf.save(tmp / ("snap%d" % saved))
        print("saved", saved, feed.g, done[0], flush=True)
        saved += 1
print("error", errors, flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # (CI time: run with -m slow)
def test_kill_9_of_a_process_sampling_on_a_thread_while_it_adopts_and_saves(tmp_path, fused):
    """A child adds to a compressed memmap buffer (a dictionary every 40
    frames, more than 3 x ``MAX_DICTS`` of them) while a thread of its own
    samples batches of 1..7 (the fused call, its cache made again at each
    adoption) without pause: it must be alive when SIGKILL comes (a
    use-after-free ends it before), and its last snapshot loads with every
    small batch exact."""
    with Child(_KILLED.format(root=str(ROOT)), tmp_path) as child:
        got = [child.said("saved", timeout=300) for _ in range(3)]
        time.sleep(0.3)  # (more adoptions, the sampler going on)
        child.kill()
    _, n, steps, sampled = got[-1].split()
    assert int(sampled) > 0
    from tests.frames.test_hostile_frame_index import _frames as frames8

    feed = Feed(frames8(400), 3, seed=9)
    feed.run(_Sink(), int(steps))
    loaded = bigper.PrioritizedReplayBuffer.load(tmp_path / f"snap{n}")
    assert hook.log(loaded).dicts.hi >= 30
    small(loaded, feed, 3, (1, 2, 5, 7))
    both(hook.log(loaded), live_ids(loaded))
    loaded.close()
