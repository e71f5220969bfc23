"""The feed (``core/feed.py``, ``device/feed.py``): a sampler bound for a torch
device, drawn with one compiled call under the lock and gathered without it.

Held to ``sample(B).to_torch(device)`` of a twin buffer bit for bit (same
seed, same draws); its slots are never refilled under a batch someone holds;
writes that race its lock-free gather never tear a batch; its thread makes a
handful of Python calls a batch. CPU everywhere, CUDA where present."""

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from bigper.device.feed import FeedSampler, covered  # noqa: E402
from bigper.device.native import NativeFeed  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
DTYPES = [np.uint8, np.int16, np.int64, np.float16, np.float32, np.float64, np.bool_]


def _np(x):
    return x.detach().cpu().numpy()


def _steps(rng, n, fields, k, ends_every, next_of=()):
    data = {}
    fields = dict(fields, **{f"next_{name}": fields[name] for name in next_of})
    for name, (shape, dt) in fields.items():
        if name in ("obs", "next_obs") and k:
            continue
        if np.dtype(dt) == np.bool_:
            data[name] = rng.random((n, *shape)) < 0.5
        else:
            data[name] = (rng.random((n, *shape)) * 100).astype(dt)
    if k:
        fr = rng.integers(0, 255, (n + k, 3, 4), dtype=np.uint8)
        data["obs"] = np.stack([fr[i:i + k] for i in range(n)])
        data["next_obs"] = np.stack([fr[i + 1:i + 1 + k] for i in range(n)])
    term = np.zeros(n, bool)
    trunc = np.zeros(n, bool)
    if ends_every:
        term[ends_every - 1::ends_every] = True
        trunc[ends_every // 2::ends_every * 3] = True
        trunc &= ~term
    data["terminated"], data["truncated"] = term, trunc
    return data


@st.composite
def setups(draw):
    k = draw(st.sampled_from([None, 1, 2, 4]))
    fields = {}
    for i in range(draw(st.integers(0 if k else 1, 3))):
        shape = draw(st.sampled_from([(), (3,), (2, 3)]))
        fields[f"f{i}"] = (shape, draw(st.sampled_from(DTYPES)))
    if k:
        fields["obs"] = ((k, 3, 4), np.uint8)
    kw = dict(capacity=draw(st.sampled_from([5, 16, 40])), fields=fields, frame_stack=k, seed=draw(st.integers(0, 99)),
              weight_norm=draw(st.sampled_from(["global", "batch"])), alpha=draw(st.sampled_from([0.0, 0.6, 1.0])),
              storage=draw(st.sampled_from(["memory", "memmap"])))
    if draw(st.booleans()):
        kw["beta"] = bigper.LinearSchedule(0.2, 1.0, 7)
    n_step = draw(st.sampled_from([1, 1, 2, 3, 5]))
    if n_step > 1:  # (a scalar reward to sum; a field read at each window's end)
        fields["reward"] = ((), draw(st.sampled_from([np.float32, np.float64, np.int16, np.uint8, np.bool_])))
        kw.update(n_step=n_step, gamma=draw(st.sampled_from([0.99, 0.5, 1.0])))
        if "f0" in fields and draw(st.booleans()):
            kw["next_of"] = ("f0",) + (("obs",) if k else ())
    return kw, draw(st.integers(1, 40)), draw(st.integers(1, 90)), draw(st.sampled_from([0, 1, 5, 13]))


def _pair(kw, tmp_path):
    bufs = []
    for name in "ab":
        k = dict(kw)
        if k.get("storage") == "memmap":
            k["path"] = tmp_path / name
        bufs.append(bigper.PrioritizedReplayBuffer(**k))
    return bufs


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(setup=setups(), data=st.data())
def test_feed_batches_equal_sample_to_torch(tmp_path_factory, device, setup, data):
    """Keys (in order), dtypes, shapes and values, weights, indices and
    generations: the feed gives what ``sample(B).to_torch(device)`` gives a
    twin buffer, draw after draw, with priority updates between them."""
    kw, b, n, ends = setup
    a, twin = _pair(kw, tmp_path_factory.mktemp("feed"))
    rng = np.random.default_rng(kw["seed"])
    next_of = [name for name in kw.get("next_of", ()) if name != "obs"]
    steps = _steps(rng, n, kw["fields"], kw["frame_stack"], ends, next_of)
    a.extend(steps)
    twin.extend(steps)
    if not twin._parts.prio.sampleable:  # (n-step: no window complete yet; both refuse alike)
        with pytest.raises(bigper.InvalidArgumentError):
            twin.sample(b)
        with pytest.raises(bigper.InvalidArgumentError):
            next(a.sampler(b, prefetch=0, device=device))
        return
    it = a.sampler(b, prefetch=0, device=device)
    assert isinstance(it, (FeedSampler, NativeFeed))
    for _ in range(4):
        got = next(it)
        want = twin.sample(b).to_torch(device)
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
            assert got[key].device == want[key].device, key
            np.testing.assert_array_equal(_np(got[key]), _np(want[key]), err_msg=key)
        p = data.draw(st.lists(st.floats(0, 50), min_size=b, max_size=b))
        a.update_priorities(got, torch.tensor(p))
        twin.update_priorities(want, torch.tensor(p))
    assert a.total_priority == twin.total_priority
    np.testing.assert_array_equal(a.leaves(np.arange(len(a))), twin.leaves(np.arange(len(twin))))
    it.close()
    a.close()
    twin.close()


def _atari_like(tmp_path=None, capacity=400, **kw):
    fields = {"obs": ((4, 6, 7), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)}
    store = dict(storage="memmap", path=tmp_path) if tmp_path is not None else {}
    return bigper.PrioritizedReplayBuffer(capacity=capacity, fields=fields, frame_stack=4, seed=3, **store, **kw)


def _add(buf, g0, n, episode=50):
    """Steps ``g0 .. g0 + n - 1``: the pixels of step g's newest frame and its
    ``step`` field both say g, so a torn row shows."""
    g = np.arange(g0, g0 + n)
    frames = lambda s: np.broadcast_to((s % 251).astype(np.uint8)[:, None, None, None], (n, 1, 6, 7))  # noqa: E731
    obs = np.concatenate([frames(g - 3 + j) for j in range(4)], axis=1)
    nxt = np.concatenate([frames(g - 2 + j) for j in range(4)], axis=1)
    buf.extend({"obs": obs, "next_obs": nxt, "step": g, "reward": g.astype(np.float32),
                "terminated": (g + 1) % episode == 0})


def _check_rows(t):
    step = _np(t["step"])
    assert np.array_equal(_np(t["obs"])[:, -1, 0, 0], (step % 251).astype(np.uint8))
    assert np.array_equal(_np(t["next_obs"])[:, -1, 0, 0], ((step + 1) % 251).astype(np.uint8))
    assert np.array_equal(_np(t["reward"]), step.astype(np.float32))
    assert np.array_equal(_np(t["generations"]), step)  # one env: transition g is step g


@pytest.mark.parametrize("device", DEVICES)
def test_held_batches_are_never_refilled(device):
    """Batches a learner keeps (the dicts, a tensor taken out, a view of one)
    keep their values while the sampler goes on: their slots are not reused."""
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(16, prefetch=2, device=device)
    kept, copies = [], []
    for i in range(30):
        t = next(it)
        if i % 3 == 0:
            kept.append(t)
        elif i % 3 == 1:
            kept.append({"obs": t["obs"], "step": t["step"]})
        else:
            kept.append({"view": t["next_obs"][:, 1:], "step": t["step"][2:]})
        copies.append({k: v.clone() for k, v in kept[-1].items()})
    for _ in range(20):
        next(it)
    for held, copy in zip(kept, copies):
        for k in copy:
            assert torch.equal(held[k], copy[k]), k
    for t in kept[::3]:
        _check_rows(t)
    it.close()
    buf.close()


@pytest.mark.parametrize("device", DEVICES)
def test_slots_are_reused_when_nothing_is_held(device):
    """A learner loop that keeps nothing runs on a fixed set of slots (no new
    pinned block a batch)."""
    buf = _atari_like()
    _add(buf, 0, 400)
    it = buf.sampler(8, prefetch=2, device=device)
    seen = set()
    for _ in range(40):
        t = next(it)
        seen.add(t["obs"].untyped_storage().data_ptr())
        buf.update_priorities(t, t["weights"].float() + 0.5)
    del t
    assert len(seen) <= 5
    it.close()
    buf.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_writes_racing_the_gather_never_tear_a_batch(tmp_path, device, storage):
    """Adds from another thread while the feed gathers without the lock: each
    row's fields, frames and generation are of one transition, whatever was
    overwritten meanwhile (a small ring, overwritten many times)."""
    buf = _atari_like(tmp_path / "b" if storage == "memmap" else None, capacity=64)
    _add(buf, 0, 64)
    stop = threading.Event()
    errors = []

    def writer():
        g = 64
        try:
            while not stop.is_set() and g < 60_000:
                _add(buf, g, 7)
                g += 7
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=writer)
    th.start()
    it = buf.sampler(32, prefetch=2, device=device)
    try:
        for _ in range(300):
            t = next(it)
            _check_rows(t)
            buf.update_priorities(t, t["weights"].float() + 0.1)
    finally:
        stop.set()
        th.join()
        it.close()
    assert not errors
    buf.close()


@pytest.mark.parametrize("device", DEVICES)
def test_close_and_errors_keep_the_sampler_contract(device):
    buf = _atari_like()
    it = buf.sampler(4, prefetch=2, device=device)
    with pytest.raises(bigper.InvalidArgumentError):  # an empty buffer: raised once, then the end
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    _add(buf, 0, 50)
    it = buf.sampler(4, prefetch=2, device=device)
    next(it)
    buf.close()
    for _ in range(3):  # closed under the learner: every next() says so, never a StopIteration
        with pytest.raises(bigper.BufferClosedError):
            next(it)


def thread_calls_a_batch(make_iter) -> float:
    """Python calls and C calls a batch (``threading.setprofile``: threads
    started after it, so the feed's) after 5 batches, of the sampler
    ``make_iter()`` makes (closed after): the median of five windows of ten
    batches (a loaded machine's stalls make the thread poll for a free slot,
    calls that are no batch's work)."""
    counts = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            counts[0] += 1
    threading.setprofile(prof)
    try:
        it = make_iter()
    finally:
        threading.setprofile(None)
    for _ in range(5):
        t = next(it)
    windows = []
    for _ in range(5):
        c0 = counts[0]
        for _ in range(10):
            t = next(it)
        windows.append((counts[0] - c0) / 10)
    del t
    it.close()
    return float(np.median(windows))


def test_thread_makes_a_handful_of_python_calls_a_batch():
    """The feed's thread: at most 12 Python calls a batch (calls and C calls,
    ``threading.setprofile``), whatever the batch size."""
    buf = _atari_like()
    _add(buf, 0, 400)
    for b in (8, 256):
        per = thread_calls_a_batch(lambda: buf.sampler(b, prefetch=1, device="cpu"))
        assert per <= 12, (b, per)


def test_what_the_feed_does_not_cover_takes_the_general_path(tmp_path):
    for kw in (dict(prioritization="rank"), dict(storage="hdf5", path=tmp_path / "x.h5"),
               dict(sequence=bigper.Sequence(4)), dict(n_step=3, reward_dtype=np.float16)):
        if "reward_dtype" in kw:  # (numba has no float16 to sum a window's rewards in)
            buf = bigper.PrioritizedReplayBuffer(
                capacity=400, fields={"obs": ((4, 6, 7), np.uint8), "step": ((), np.int64),
                                      "reward": ((), kw.pop("reward_dtype"))}, frame_stack=4, seed=3, **kw)
        else:
            buf = _atari_like(**kw)
        _add(buf, 0, 60)
        assert covered(buf._parts, torch.device("cpu")) is not None
        it = buf.sampler(4, prefetch=0, device="cpu")
        assert not isinstance(it, (FeedSampler, NativeFeed))
        next(it)
        buf.close()
    assert sys.modules.get("bigper.device.feed") is not None
    from bigper.core import feed as plan

    buf = _atari_like(n_step=3)  # n-step: the host feed, not a device tier's
    assert covered(buf._parts, torch.device("cpu")) is None
    assert plan.covered(buf._parts, host=False) == "n-step returns with a device tier"
    buf.close()


def test_the_cpu_feed_draws_nothing_before_the_first_next():
    """On the CPU the feed draws in the learner's next() (the semantics guide):
    a sampler made and left alone moves neither the random stream nor the
    beta schedule; the first next() then draws what sample() would have."""
    a, b = _atari_like(), _atari_like()
    _add(a, 0, 300)
    _add(b, 0, 300)
    it = a.sampler(8, prefetch=3, device="cpu")
    time.sleep(0.2)
    assert it.ready == 0
    np.testing.assert_array_equal(a.sample(8).indices, b.sample(8).indices)
    first = next(it)
    np.testing.assert_array_equal(first.host["indices"], b.sample(8).indices)
    it.close()
    a.close()
    b.close()
