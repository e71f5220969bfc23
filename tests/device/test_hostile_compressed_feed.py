"""Attack on the feed serving compressed frames (``compression="zstd"``): the
drawn frames decoded into the batch's block under the buffer's lock right
after the draw (``SegmentLog.decode`` in the feed's thread), the fields gathered without it.

Every batch is held to the stacks that were added for its transition (the
``step`` field and the generations name it), in both frame index layouts,
memory and memmap, capped and growing logs, several envs, episodes ending
(pair and split stacks, obs-only buffers), frame_stack 1..4, uint8/uint16/
float32 frames, B=1 and B past the live transitions, beta schedules and
``prefetch`` 0..4. Races (a writer whose log releases segments and adopts a
dictionary at every look, more than ``MAX_DICTS`` of them; ``save``,
``state_dict``/``load_state`` and ``close`` from other threads) and damaged
index entries or log bytes run in child processes, so a crash is a failure
and not a dead test run.

Found and fixed: on the CPU with ``prefetch > 0`` a compressed buffer got
``FeedSampler``'s own thread, which draws ahead as soon as the sampler is
made: the sampler moved the random stream before the first ``next()``
(the semantics guide: on the CPU the feed draws in ``next()`` itself, nothing
before the first), and its draws interleaved with the learner's priority
updates at the threads' whim, so two seeded runs drew different batches.
The native feed draws (and so decodes, under the lock) in ``next()``; its
thread gathers the fields only.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from bigper.device.feed import FeedSampler  # noqa: E402
from bigper.device.native import NativeFeed  # noqa: E402

from tests import hook  # noqa: E402
from tests._child import Child, env_with_root  # noqa: E402
from tests._child_batch import run_scripts, said_ok  # noqa: E402
from tests.device.test_feed import _add, _atari_like, thread_calls_a_batch  # noqa: E402
from tests.frames.test_compression import Feed, make  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _np(x):
    return x.detach().cpu().numpy()


def _exact(batch, feed, nxt=True):
    """Every row's stacks are those added for the transition its ``step`` names."""
    steps = _np(batch["step"])
    np.testing.assert_array_equal(steps, _np(batch["generations"]))  # (one step a generation, every env)
    obs = _np(batch["obs"])
    nobs = _np(batch["next_obs"]) if nxt else None
    for i, g in enumerate(steps):
        o, o2 = feed.added[int(g)]
        np.testing.assert_array_equal(obs[i], o, err_msg=f"obs of step {g}")
        if nxt:
            np.testing.assert_array_equal(nobs[i], o2, err_msg=f"next_obs of step {g}")


def _frames(dtype, shape, seed=0, n=120):
    """Frames that compress (few distinct values) but differ frame to frame."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 3, (n, *shape))
    return (base * 1000 + np.arange(n).reshape(-1, *[1] * len(shape))).astype(dtype)


# -- exactness ---------------------------------------------------------------------------------------

CASES = [  # (storage, wide, k, dtype, num_envs, budget, prefetch, FeedSampler's own thread)
    ("memory", False, 1, np.uint8, 1, None, 0, False),
    ("memory", True, 2, np.uint16, 2, 64, 1, False),
    ("memmap", False, 3, np.float32, 1, 64, 3, False),
    ("memmap", True, 4, np.uint8, 3, None, 4, False),
    ("memory", False, 4, np.float32, 2, None, 2, True),
    ("memmap", True, 2, np.uint8, 1, 64, 1, True),
]


@pytest.mark.parametrize("kind,wide,k,dtype,envs,budget,prefetch,own_thread", CASES)
def test_every_batch_is_the_stacks_added_for_its_transitions(tmp_path, kind, wide, k, dtype, envs, budget,
                                                               prefetch, own_thread):
    """B=1, B past the live transitions and a middling one; a beta schedule;
    the writer moving on between batches (segments released by a capped log)."""
    shape = (5, 7)
    buf = make(kind, tmp_path, shape=shape, dtype=dtype, k=k, capacity=40, budget=budget, wide=wide,
               num_envs=envs, seed=5, beta=bigper.LinearSchedule(0.3, 1.0, 20))
    feed = Feed(_frames(dtype, shape, seed=k), k, seed=k, num_envs=envs)
    feed.run(buf, 6)
    with _quiet():
        for b in (1, 7, 3 * 40):
            it = hook.thread_feed(buf, b, prefetch) if own_thread else \
                buf.sampler(b, prefetch=prefetch, device="cpu")
            assert isinstance(it, (FeedSampler, NativeFeed))
            for _ in range(4):
                batch = next(it)
                _exact(batch, feed)
                buf.update_priorities(batch, np.random.default_rng(b).random(b) + 0.05)
                feed.run(buf, 5)
            it.close()
    buf.close()


class _quiet:
    """A capped log's warning that it costs capacity is expected here."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("dtype", [np.float16, ">u2", ">f4"])
def test_frames_of_float16_or_another_byte_order_are_added_and_sampled_exactly(compression, dtype):
    """Found: ``add`` of frame stacks of a dtype numba has no type for
    (float16, big-endian) failed inside a numba kernel (``TypingError``,
    ``NotImplementedError: float16``), raw frames or compressed. Their
    bytes are stored and sampled exactly, by ``sample`` and by the feed where
    it covers them (it leaves another byte order to the general path)."""
    k, shape = 3, (3, 2)
    buf = bigper.PrioritizedReplayBuffer(capacity=30, fields={"obs": ((k, *shape), dtype), "step": ((), np.int64)},
                                         frame_stack=k, compression=compression, seed=0)
    fr = (np.random.default_rng(0).integers(0, 5, (80, *shape)) * 1.5 + 0.25).astype(dtype)
    added = {}
    for g in range(40):
        o, o2 = fr[[max(g - 2 + j, 0) for j in range(k)]], fr[[max(g - 1 + j, 0) for j in range(k)]]
        added[g] = (o, o2)
        buf.add(obs=o, next_obs=o2, step=g, terminated=g % 11 == 10, truncated=False)
    s = buf.sample(12)
    for i, g in enumerate(s["step"]):
        np.testing.assert_array_equal(s["obs"][i], added[int(g)][0])
        np.testing.assert_array_equal(s["next_obs"][i], added[int(g)][1])
    native = np.dtype(dtype).newbyteorder("=")
    for prefetch in (0, 2):
        it = buf.sampler(6, prefetch=prefetch, device="cpu")
        for _ in range(3):
            batch = next(it)
            for i, g in enumerate(_np(batch["step"])):
                np.testing.assert_array_equal(_np(batch["obs"][i]), added[int(g)][0].astype(native))
                np.testing.assert_array_equal(_np(batch["next_obs"][i]), added[int(g)][1].astype(native))
        it.close()
    buf.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_obs_only_buffers_and_no_other_field(prefetch):
    """``next_of=()`` (obs stacks only) with and without a field beside them."""
    for fields in ({"obs": ((2, 5, 7), np.uint16)}, {"obs": ((2, 5, 7), np.uint16), "r": ((), np.float32)}):
        buf = bigper.PrioritizedReplayBuffer(capacity=30, fields=fields, frame_stack=2, compression="zstd",
                                             next_of=(), seed=0)
        fr = _frames(np.uint16, (5, 7), n=200)
        added = {}
        for g in range(50):
            row = {"obs": fr[[max(g - 1, 0), g]], "terminated": g % 9 == 8, "truncated": False}
            if "r" in fields:
                row["r"] = np.float32(g)
            added[g] = row
            buf.add(**row)
        it = buf.sampler(5, prefetch=prefetch, device="cpu")
        for _ in range(5):
            batch = next(it)
            assert "next_obs" not in batch
            for i, g in enumerate(_np(batch["generations"])):
                np.testing.assert_array_equal(_np(batch["obs"][i]), added[int(g)]["obs"])
                if "r" in fields:
                    assert float(batch["r"][i]) == g
        it.close()
        buf.close()


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_prefetch_0_equals_twin_sample_to_torch(tmp_path, storage):
    """Draw for draw, with priority updates between: the feed of a compressed
    buffer gives what ``sample(B).to_torch("cpu")`` of a twin gives."""
    bufs = [_atari_like(tmp_path / name if storage == "memmap" else None, compression="zstd") for name in "ab"]
    for buf in bufs:
        _add(buf, 0, 300)
    a, twin = bufs
    it = a.sampler(16, prefetch=0, device="cpu")
    rng = np.random.default_rng(0)
    for _ in range(6):
        got, want = next(it), twin.sample(16).to_torch("cpu")
        assert list(got) == list(want)
        for key in want:
            np.testing.assert_array_equal(_np(got[key]), _np(want[key]), err_msg=key)
        p = torch.tensor(rng.random(16) * 5)
        a.update_priorities(got, p)
        twin.update_priorities(want, p)
    it.close()
    for buf in bufs:
        buf.close()


def test_decode_on_the_pools_threads_equals_twin_sample_to_torch(monkeypatch):
    """Where the machine has cores beside the learner's and the feed's (a GPU
    host; here ``BIGPER_THREADS=4``), a batch's frames are decoded on the
    pool's threads, 256 frames a thread at least: draw for draw the same
    batches as a twin's ``sample``, the pool used at B = 64 (320 frames)."""
    import bigper.frames.segments as segments

    monkeypatch.setenv("BIGPER_THREADS", "4")
    spread = []
    real = segments.for_ranges
    monkeypatch.setattr(segments, "for_ranges", lambda fn, n, chunk: (spread.append((n, chunk)), real(fn, n, chunk)))
    bufs = [_atari_like(compression="zstd") for _ in "ab"]
    for buf in bufs:
        _add(buf, 0, 300)
    a, twin = bufs
    rng = np.random.default_rng(1)
    for b in (64, 8):
        it = a.sampler(b, prefetch=0, device="cpu")
        for _ in range(4):
            got, want = next(it), twin.sample(b).to_torch("cpu")
            assert list(got) == list(want)
            for key in want:
                np.testing.assert_array_equal(_np(got[key]), _np(want[key]), err_msg=key)
            p = torch.tensor(rng.random(b) * 5 + 0.1)
            a.update_priorities(got, p)
            twin.update_priorities(want, p)
        it.close()
    assert (64 * 5, 256) in spread  # (B = 64: obs and next_obs of 4 frames, one frame apart)
    for buf in bufs:
        buf.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device tier's feed runs on CUDA only")
@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_device_tier_of_compressed_frames_takes_the_feed_and_equals_the_host_twin(prefetch, budget):
    """Compressed frames with a device tier: the feed gathers the raw frames
    the tier holds on the device. Draw for draw (``prefetch=0``; with a
    thread, every batch is still the stacks added for its step), the same
    batches as a host twin's ``sample(B).to_torch("cuda")``, while adds move
    the log on (a smallest budget releases frames of live transitions)."""
    import warnings

    kw = dict(compression="zstd")
    if budget is not None:  # (the smallest budget the rule takes, as test_hostile_device finds it)
        try:
            _atari_like(compression="zstd", compression_budget=1).close()
        except bigper.InvalidArgumentError as e:
            kw["compression_budget"] = int(str(e).split("compression_budget=")[-1].split()[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tier, twin = _atari_like(**kw, device="cuda"), _atari_like(**kw)
        for buf in (tier, twin):
            _add(buf, 0, 300)
        it = tier.sampler(16, prefetch=prefetch, device="cuda")
        assert isinstance(it, FeedSampler)
        rng = np.random.default_rng(2)
        g = 300
        for _ in range(6):
            got = next(it)
            step = _np(got["step"])
            np.testing.assert_array_equal(_np(got["obs"])[:, -1, 0, 0], (step % 251).astype(np.uint8))
            np.testing.assert_array_equal(_np(got["next_obs"])[:, -1, 0, 0], ((step + 1) % 251).astype(np.uint8))
            if prefetch == 0:
                want = twin.sample(16).to_torch("cuda")
                assert list(got) == list(want)
                for key in want:
                    np.testing.assert_array_equal(_np(got[key]), _np(want[key]), err_msg=key)
                p = torch.tensor(rng.random(16) * 5 + 0.1, device="cuda")
                tier.update_priorities(got, p)
                twin.update_priorities(want, p)
            for buf in (tier, twin):
                _add(buf, g, 37)
            g += 37
        it.close()
        tier.close()
        twin.close()


# -- the CPU feed's contract (the semantics guide) -----------------------------------------------

def test_on_the_cpu_raw_frames_are_drawn_in_next_and_compressed_ones_in_the_feeds_thread():
    """The semantics guide: on the CPU the feed draws raw frames in ``next()``
    itself (a sampler left alone moves neither the random stream nor the beta
    schedule); compressed frames are drawn and decompressed by its own thread
    from the start (in ``next()`` the decode would cost the learner most of its
    speed), ``prefetch`` batches ahead, each still the stacks of its transitions."""
    for compression in (None, "zstd"):
        a, b = _atari_like(compression=compression), _atari_like(compression=compression)
        _add(a, 0, 300)
        _add(b, 0, 300)
        it = a.sampler(8, prefetch=3, device="cpu")
        deadline = time.monotonic() + 10
        while compression and it.ready < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert it.ready == (3 if compression else 0), compression
        if compression is None:  # nothing drawn: the twins' streams still agree
            np.testing.assert_array_equal(a.sample(8).indices, b.sample(8).indices)
            np.testing.assert_array_equal(next(it).host["indices"], b.sample(8).indices)
        else:  # three draws made: the twin's first three are those batches, in order
            for _ in range(3):
                np.testing.assert_array_equal(next(it).host["indices"], b.sample(8).indices)
        it.close()
        a.close()
        b.close()


@pytest.mark.parametrize("compression,prefetch", [(None, 2), ("zstd", 0)])
def test_seeded_runs_with_priority_updates_draw_the_same_batches(compression, prefetch):
    """Two twins iterated with a priority update after every batch draw the
    same batches where the draws happen at fixed points of the learner's loop:
    raw frames with ``prefetch`` (drawn in ``next()``), compressed frames with
    ``prefetch=0`` (each batch filled in the caller's thread; with a thread of
    its own the feed draws whenever it gets the lock, as the general sampler)."""
    runs = []
    for _ in range(2):
        buf = _atari_like(compression=compression)
        _add(buf, 0, 300)
        it = buf.sampler(8, prefetch=prefetch, device="cpu")
        seen = []
        for i in range(40):
            batch = next(it)
            seen.append(batch.host["indices"].copy())
            buf.update_priorities(batch, torch.full((8,), 50.0 + i))
            time.sleep(0.002 * (i % 3))  # (a thread, if any, would get the lock at other points of each run)
        it.close()
        buf.close()
        runs.append(np.stack(seen))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_the_feed_thread_makes_few_python_calls_whatever_the_batch_size(monkeypatch):
    """Calls and C calls a batch in ``FeedSampler``'s thread (what CUDA gets;
    on the CPU here through ``hook.thread_feed``), which decodes the frames:
    the decode is a few compiled calls, not one a frame: at most 26 a batch,
    no more for B=256 than for B=8. (The native feed's thread makes none.)
    On two cores, as here: with more, a large batch's decode is spread over
    the pool's threads (``test_decode_on_the_pools_threads_...``)."""
    monkeypatch.setenv("BIGPER_THREADS", "2")
    buf = _atari_like(compression="zstd")
    _add(buf, 0, 400)
    per = {b: thread_calls_a_batch(lambda: hook.thread_feed(buf, b, 1)) for b in (8, 256)}
    buf.close()
    assert per[8] <= 26 and per[256] <= per[8] + 1, per


# -- kept batches ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch,own_thread", [(0, False), (1, False), (3, False), (2, True)])
def test_kept_batches_never_change_while_the_feed_goes_on(prefetch, own_thread):
    """Every third batch kept (its tensors and a copy of them) while the writer
    wraps the ring and the log: the kept bytes never change."""
    buf = _atari_like(capacity=60, compression="zstd")
    _add(buf, 0, 60)
    it = hook.thread_feed(buf, 8, prefetch) if own_thread else buf.sampler(8, prefetch=prefetch, device="cpu")
    kept = []
    g = 60
    for i in range(45):
        batch = next(it)
        if i % 3 == 0:
            kept.append((batch, {k: v.clone() for k, v in batch.items()}))
        buf.update_priorities(batch, torch.rand(8) + 0.1)
        _add(buf, g, 7)
        g += 7
    for batch, copy in kept:
        for k, v in copy.items():
            assert torch.equal(batch[k], v), k
    it.close()
    buf.close()


# -- races and damage, in children -----------------------------------------------------------------

_RACE = """
import copy, sys, threading, time, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bigper, bigper.frames.segments, bigper.frames.dictionaries
from bigper.errors import BufferClosedError
bigper.frames.segments.TRAIN_FRAMES = 20  # a look every 20 frames, each adopted: slots reused
bigper.frames.dictionaries.PAYS = bigper.frames.dictionaries.DRIFT = -100.0
from pathlib import Path
from tests.frames.test_compression import ATARI, Feed, make
from tests import hook
games = np.load(ATARI)
tmp = Path(sys.argv[1])
kind, budget, prefetch, wide = sys.argv[2], (None if sys.argv[3] == "none" else int(sys.argv[3])), \\
    int(sys.argv[4]), sys.argv[5] == "1"
own_thread = sys.argv[6] == "1"  # FeedSampler's thread (what CUDA gets) instead of the native feed
buf = make(kind, tmp, shape=(84, 84), k=4, capacity=100, budget=budget, wide=wide, seed=1)
feed = Feed(games["Pong"], 4, seed=3)
feed.run(buf, 30)
first_gen = hook.newest_gen(buf)
stop, errors, mine = [False], [], threading.Lock()  # (mine: a state_dict is views of live arrays)
names = list(games)

def writer():
    i = 0
    try:
        while not stop[0]:
            feed.frames = games[names[i % len(names)]]
            i += 1
            with mine:
                feed.run(buf, 5)
    except BufferClosedError:
        pass
    except BaseException as e:
        errors.append(repr(e))

def other():
    i = 0
    try:
        while not stop[0]:
            i += 1
            if i % 3 == 0:
                buf.save(tmp / f"snap{{i}}")
            else:
                with mine:
                    m, a = buf.state_dict()
                    buf.load_state(copy.deepcopy(m), {{k: np.array(v, copy=True) for k, v in a.items()}})
            time.sleep(0.01)
    except BufferClosedError:
        pass
    except BaseException as e:
        errors.append(repr(e))

threads = [threading.Thread(target=writer), threading.Thread(target=other)]
for t in threads:
    t.start()
it = hook.thread_feed(buf, 16, prefetch) if own_thread else buf.sampler(16, prefetch=prefetch, device="cpu")
n, kept, closer, t0 = 0, [], None, time.time()
try:
    while True:
        try:
            b = next(it)
        except BufferClosedError:
            break
        n += 1
        steps = b["step"].numpy()
        for i in range(16):
            o, o2 = feed.added[int(steps[i])]
            assert (b["obs"][i].numpy() == o).all(), ("obs", n, i)
            assert (b["next_obs"][i].numpy() == o2).all(), ("next_obs", n, i)
        if n % 5 == 0:
            kept.append((b, {{k: v.clone() for k, v in b.items()}}))
        try:
            buf.update_priorities(b, np.random.rand(16) + 0.1)
        except BufferClosedError:
            pass
        if closer is None and n >= 40 and hook.newest_gen(buf) - first_gen > 9:
            closer = threading.Thread(target=buf.close)
            closer.start()
        assert time.time() - t0 < 120, "never closed"
finally:
    stop[0] = True
    for t in threads:
        t.join()
    if closer is not None:
        closer.join()
for b, c in kept:
    for k, v in c.items():
        assert (b[k] == v).all(), k
assert closer is not None and not errors, errors
it.close()
print("ok", n, flush=True)
"""


@pytest.mark.parametrize("kind,budget,prefetch,wide,own_thread", [
    ("memory", "none", 2, "0", "0"), ("memmap", "700", 1, "1", "0"), ("memory", "700", 0, "0", "0"),
    ("memory", "700", 2, "0", "1"), ("memmap", "none", 4, "1", "1")])
def test_writer_adoptions_snapshots_restores_and_close_race_the_feed(feed_races, request, kind, budget, prefetch,
                                                                    wide, own_thread):
    """A writer whose log adopts a dictionary every 20 frames (more than 8:
    codec slots reused; a capped log releasing segments), a thread saving
    and restoring the buffer's own state, the learner checking every batch and
    keeping some (the native feed, and ``FeedSampler``'s own thread, which
    CUDA gets), then ``close`` from a third thread: never a crash, never a
    wrong byte, the iteration ends with ``BufferClosedError``."""
    said_ok(feed_races, request)


_DAMAGE = """
import sys, warnings
import numpy as np
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
from pathlib import Path
from bigper.errors import CorruptSnapshotError
from tests.frames.test_compression import ATARI, Feed, make
from tests import hook
games = np.load(ATARI)
tmp = Path(sys.argv[1])
for wide in (False, True):
    for prefetch in (0, 2, -2):  # (-2: FeedSampler's own thread, prefetch 2)
        for how in ("offset", "length", "generation", "far offset", "log byte"):
            buf = make("memory", tmp, shape=(84, 84), k=4, capacity=60, wide=wide, seed=1)
            Feed(games["Pong"], 4, seed=3).run(buf, 50)
            fs = hook.frames(buf)
            index, log = fs.store.arrays["frame_index"], fs.store.arrays["frame_log"]
            index0, log0 = index.copy(), log.copy()
            rows = np.arange(fs.F)
            o, ln, d = hook.entries(buf)
            if how == "offset":
                hook.set_entries(buf, index, rows, offset=o + 3)
            elif how == "length":
                hook.set_entries(buf, index, rows, length=ln + 1)
            elif how == "generation":
                hook.set_entries(buf, index, rows, gen=5)
            elif how == "far offset":
                hook.set_entries(buf, index, rows, offset=1 << 40)
            else:
                flat = log.reshape(-1)
                for r in rows:
                    if ln[r] > 0:
                        flat[o[r] + ln[r] // 2] ^= 0x10
            it = hook.thread_feed(buf, 8, 2) if prefetch < 0 else buf.sampler(8, prefetch=prefetch, device="cpu")
            try:
                next(it)
                raise SystemExit(f"no error: {{wide}} {{prefetch}} {{how}}")
            except CorruptSnapshotError:
                pass
            try:
                next(it)
                raise SystemExit(f"a batch after the error: {{wide}} {{prefetch}} {{how}}")
            except (StopIteration, CorruptSnapshotError):
                pass
            it.close()
            try:
                buf.sample(8)
                raise SystemExit(f"sample drew damaged frames without an error: {{how}}")
            except CorruptSnapshotError:
                pass
            index[:] = index0
            log[:] = log0
            buf.sample(8)
            it = buf.sampler(8, prefetch=max(prefetch, 0), device="cpu")
            next(it)
            it.close()
            buf.close()
print("ok", flush=True)
"""


def test_damaged_entries_or_log_bytes_are_corrupt_snapshot_error_from_next(tmp_path):
    """Every entry (packed and wide layouts) shifted, lengthened, naming a
    dictionary that is not there or pointing far outside the log, or a byte
    of every frame flipped: ``next(it)`` raises ``CorruptSnapshotError`` (no
    hang, no crash, no batch), the sampler ends and closes, and the buffer,
    repaired, samples again through ``sample`` and a new feed."""
    with Child(_DAMAGE.format(root=str(ROOT)), tmp_path) as child:
        child.said("ok", timeout=240)
        assert child.end() == 0, child.stderr()


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
buf = make(sys.argv[2], tmp, shape=(84, 84), k=4, capacity=80, seed=1,
           budget=None if sys.argv[3] == "none" else int(sys.argv[3]))
feed = Feed(games["Pong"], 4, seed=3)
feed.run(buf, 40)
stop, errors, counts = [False], [], {{}}

def writer():
    i = 0
    while not stop[0]:
        feed.frames = games[names[i % len(names)]]
        i += 1
        feed.run(buf, 3)

def learner(name, make_it, update):
    try:
        it, n = make_it(), 0
        while not stop[0]:
            b = next(it) if it is not None else buf.sample(16)
            steps = np.asarray(b["step"])
            obs = np.asarray(b["obs"])
            nxt = np.asarray(b["next_obs"])
            for i in range(steps.shape[0]):
                o, o2 = feed.added[int(steps[i])]
                assert (obs[i] == o).all() and (nxt[i] == o2).all(), (name, n, i)
            if update:
                buf.update_priorities(b, np.random.rand(steps.shape[0]) + 0.1)
            n += 1
            counts[name] = n
        if it is not None:
            it.close()
    except BaseException as e:
        errors.append((name, repr(e)))

threads = [threading.Thread(target=writer),
           threading.Thread(target=learner, args=("native", lambda: buf.sampler(16, prefetch=2, device="cpu"), True)),
           threading.Thread(target=learner, args=("own thread", lambda: hook.thread_feed(buf, 16, 3), True)),
           threading.Thread(target=learner, args=("prefetch 0", lambda: buf.sampler(16, prefetch=0, device="cpu"),
                                                  False)),
           threading.Thread(target=learner, args=("sample", lambda: None, False))]
for t in threads:
    t.start()
# (at least 4 s, and on until every reader has a batch and more dictionaries than codec slots were
# adopted: the first calls compile bigper's kernels, which on a fresh machine takes most of 4 s)
t0 = time.monotonic()
while time.monotonic() - t0 < 4 or (time.monotonic() - t0 < 150 and not errors
                                    and (len(counts) < 4 or hook.newest_gen(buf) <= 9)):
    time.sleep(0.1)
stop[0] = True
for t in threads:
    t.join()
assert not errors and len(counts) == 4 and min(counts.values()) > 0, (errors, counts)
assert hook.newest_gen(buf) > 9  # (more dictionaries adopted than codec slots)
buf.close()
print("ok", counts, flush=True)
"""


@pytest.mark.parametrize("kind,budget", [("memory", "700"), ("memmap", "none")])
def test_several_feeds_and_sample_on_threads_of_their_own_with_a_writer(feed_races, request, kind, budget):
    """Four readers at once (the native feed, ``FeedSampler``'s thread, a
    ``prefetch=0`` feed and plain ``sample``), each on a thread of its own,
    while a writer adopts dictionaries and the log grows or releases
    segments: every batch exact, no crash (they share the log's decode
    scratch, under the lock)."""
    said_ok(feed_races, request)


# The race and many-readers cases above run in one batch of child interpreters (tests/_child_batch.py:
# each case a fresh run of its script with its own argv and globals, its output and exit status
# apart; a crash or a hang ends only its own case and the cases after it go on in a new child):
# one interpreter start and one load of torch and bigper's kernels for the seven, not one each.
@pytest.fixture(scope="module")
def feed_races(request, tmp_path_factory):
    return run_scripts(request, tmp_path_factory, {
        "test_writer_adoptions_snapshots_restores_and_close_race_the_feed":
            (_RACE.format(root=str(ROOT)), ("kind", "budget", "prefetch", "wide", "own_thread")),
        "test_several_feeds_and_sample_on_threads_of_their_own_with_a_writer":
            (_MANY.format(root=str(ROOT)), ("kind", "budget"))}, env=env_with_root(), timeout=240)
