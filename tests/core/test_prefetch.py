"""The prefetching sampler: ``buf.sampler(B, prefetch=d)`` draws in a thread.

Exactness is checked against a twin buffer that makes the same calls in the
order the sampler made them. The order is made deterministic by waiting until
the thread is blocked on a full queue (it has then drawn ``consumed + d + 1``
batches), so every comparison is bit for bit.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import bigper
from bigper.errors import BufferClosedError, InvalidArgumentError
from bigper.core.prefetch import Prefetcher

FIELDS = {"obs": ((4, 6, 6), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}


def make(seed=0, **kw):
    return bigper.PrioritizedReplayBuffer(64, FIELDS, frame_stack=4, seed=seed, **kw)


def fill(buf, n, start=0):
    rng = np.random.default_rng(start)
    for t in range(start, start + n):
        o = np.full((4, 6, 6), t % 251, np.uint8)
        o2 = np.full((4, 6, 6), (t + 1) % 251, np.uint8)
        buf.add(obs=o, action=np.int64(t), reward=np.float32(rng.random()), next_obs=o2,
                terminated=(t % 17 == 16))


def drawn(buf) -> int:
    return int(buf.state_dict()[0]["beta_step"])


def wait_steady(buf, it, consumed, depth, timeout=20.0):
    """Until the thread is blocked on a full queue: it drew consumed + depth + 1."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if it.ready == depth and drawn(buf) == consumed + depth + 1:
            return
        time.sleep(0.002)
    raise AssertionError(f"sampler not steady: ready={it.ready}, drawn={drawn(buf)}, "
                         f"expected {consumed + depth + 1}")


def same_batch(a, b):
    assert np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.weights, b.weights)
    assert np.array_equal(a.probabilities, b.probabilities)
    assert np.array_equal(a.generations, b.generations)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def fingerprint(buf):
    meta, arrays = buf.state_dict()
    return repr(meta), {k: np.array(v) for k, v in arrays.items()}


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_sampler_equals_sample_calls_in_the_same_order(depth):
    buf, twin = make(), make()
    fill(buf, 100)
    fill(twin, 100)
    rng = np.random.default_rng(depth)
    it = buf.sampler(8, prefetch=depth)
    ref = []
    for j in range(12):
        b = next(it)
        wait_steady(buf, it, j + 1, depth)
        while len(ref) < j + depth + 2:  # the twin draws what the thread has drawn by now
            ref.append(twin.sample(8))
        same_batch(b, ref[j])
        td = rng.random(8) * 3
        buf.update_priorities(b, td)
        twin.update_priorities(ref[j], td)
        if j % 4 == 3:  # adds between draws overwrite slots of prefetched batches
            fill(buf, 9, start=100 + j * 9)
            fill(twin, 9, start=100 + j * 9)
    it.close()
    a, b = fingerprint(buf), fingerprint(twin)
    assert a[0] == b[0]
    for k in a[1]:
        assert np.array_equal(a[1][k], b[1][k]), k


def test_prefetched_batch_updates_skip_overwritten_slots():
    buf = make()
    fill(buf, 70)
    it = buf.sampler(16, prefetch=2)
    first = next(it)
    wait_steady(buf, it, 1, 2)
    fill(buf, 40, start=70)  # overwrites most slots the prefetched batches hold
    later = next(it)  # drawn before those adds
    stale = buf.state_dict()[1]["gid"][later.indices] != later.generations
    assert stale.any()
    before = buf.leaves(later.indices[stale]).copy()
    buf.update_priorities(later, np.full(16, 123.0))
    assert np.array_equal(buf.leaves(later.indices[stale]), before)
    fresh = later.indices[~stale]
    if fresh.size:
        want = (123.0 + buf.config.eps) ** buf.config.alpha
        assert np.all(buf.leaves(fresh) == want)
    del first
    it.close()


def test_snapshot_while_sampling_resumes_after_the_prefetched_draws(tmp_path):
    buf = make()
    fill(buf, 90)
    depth = 2
    it = buf.sampler(8, prefetch=depth)
    for j in range(3):
        b = next(it)
        buf.update_priorities(b, np.arange(8.0) + j)
    wait_steady(buf, it, 3, depth)
    snap = buf.save(tmp_path / "snap")
    loaded = bigper.PrioritizedReplayBuffer.load(snap, continue_episodes=True)  # compared with buf, which goes on
    for _ in range(depth + 1):  # drawn before the save
        next(it)
    same_batch(next(it), loaded.sample(8))  # the first draw after the save, in both
    it.close()
    loaded.close()
    buf.close()


def test_device_cpu_gives_tensors_that_update_priorities_takes():
    torch = pytest.importorskip("torch")
    buf, twin = make(), make()
    fill(buf, 80)
    fill(twin, 80)
    with buf.sampler(8, prefetch=2, device="cpu") as it:
        t = next(it)
        assert isinstance(t["obs"], torch.Tensor) and t["obs"].shape == (8, 4, 6, 6)
        ref = twin.sample(8)
        assert np.array_equal(t["indices"].numpy(), ref.indices)
        assert np.array_equal(t["obs"].numpy(), ref["obs"])
        buf.update_priorities(t, torch.ones(8))


def test_prefetch_zero_is_plain_sample_calls():
    buf, twin = make(), make()
    fill(buf, 80)
    fill(twin, 80)
    it = buf.sampler(8, prefetch=0, beta=0.7, stratified=False)
    for _ in range(5):
        same_batch(next(it), twin.sample(8, beta=0.7, stratified=False))
    assert threading.active_count() >= 1


@pytest.mark.parametrize("kw", [dict(batch_size=0), dict(batch_size=2.0), dict(batch_size=True),
                                dict(batch_size=4, prefetch=-1), dict(batch_size=4, prefetch=1.5),
                                dict(batch_size=4, prefetch=True), dict(batch_size=4, weights=1)])
def test_bad_arguments_refused_and_nothing_drawn(kw):
    buf = make()
    fill(buf, 30)
    before = fingerprint(buf)
    n_threads = threading.active_count()
    with pytest.raises(InvalidArgumentError):
        buf.sampler(**kw)
    after = fingerprint(buf)
    assert before[0] == after[0]
    assert all(np.array_equal(before[1][k], after[1][k]) for k in before[1])
    assert threading.active_count() == n_threads


def test_empty_buffer_error_reaches_the_consumer_and_stops_the_thread():
    buf = make()
    it = buf.sampler(4, prefetch=2)
    with pytest.raises(InvalidArgumentError, match="no sampleable"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    it._thread.join(5)
    assert not it._thread.is_alive()


def test_buffer_close_stops_its_samplers_and_later_calls_refuse():
    buf = make()
    fill(buf, 40)
    it = buf.sampler(4, prefetch=3)
    next(it)
    buf.close()
    assert not it._thread.is_alive()
    with pytest.raises(BufferClosedError):  # a learner's loop is told, not ended silently
        next(it)
    with pytest.raises(BufferClosedError):
        buf.sampler(4)


def test_dropped_sampler_stops_its_thread():
    buf = make()
    fill(buf, 40)
    it = buf.sampler(4, prefetch=2)
    next(it)
    thread = it._thread
    del it
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    buf.close()


def test_prefetcher_keeps_order_and_holds_the_lock_while_producing():
    lock = threading.Lock()
    seen = []

    def produce():
        assert lock.locked()
        seen.append(len(seen))
        return seen[-1]

    p = Prefetcher(produce, 2, lock)
    got = [next(p) for _ in range(50)]
    p.close()
    assert got == list(range(50))
