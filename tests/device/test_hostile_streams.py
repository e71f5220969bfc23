"""Attack on the learner's current stream cached per thread
(``tensors/streams.current_stream``) and on ``to_torch``'s key order.

``current_stream`` is taken in the feed's ``next()`` (the learner's stream
waits for the batch), in ``_give_back`` (the slot released after the
learner's use) and in ``update_priorities`` of CUDA tensors (``Deferred``:
the event after the learner's kernels). A stale cache would make the wrong
stream wait: batches read before they are written, priorities read before
they are computed. CUDA-only cases skip here; the key order is also held on
the CPU.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402

from tests.device.test_feed import _add, _atari_like  # noqa: E402

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="CUDA streams")


def _np(x):
    return x.detach().cpu().numpy()


# -- key order, every buffer kind ---------------------------------------------------------------------

def _kinds():
    """(name, buffer maker) of every kind of batch: frames or none, n-step,
    sequences, compressed, rank."""
    f = {"obs": ((3, 5), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}

    def plain(**kw):
        return bigper.PrioritizedReplayBuffer(capacity=64, fields={"action": ((), np.int64), "reward": ((), np.float32),
                                                                   "x": ((2,), np.float64), "b": ((), np.bool_)},
                                              seed=1, **kw)

    def frames(**kw):
        return bigper.PrioritizedReplayBuffer(capacity=64, fields=f, frame_stack=3, seed=1, **kw)

    return [("no frames", lambda: plain()),
            ("no frames n-step", lambda: plain(n_step=3)),
            ("frames", lambda: frames()),
            ("frames n-step", lambda: frames(n_step=2)),
            ("compressed", lambda: frames(compression="zstd")),
            ("rank", lambda: frames(prioritization="rank")),
            ("sequences", lambda: frames(sequence=bigper.Sequence(4))),
            ("sequences burn-in", lambda: plain(sequence=bigper.Sequence(5, burn_in=2, period=2)))]


def _fill(buf, n=40):
    fields = buf.config.fields
    rng = np.random.default_rng(0)
    for t in range(n):
        row = {}
        for name, (shape, dtype) in fields.items():
            row[name] = rng.integers(0, 5, shape).astype(dtype)
        if "obs" in row:
            row["next_obs"] = row["obs"]
        buf.add(**row, terminated=t % 13 == 12, truncated=False)


def _want_order(batch):
    keys = list(batch.data) + ["weights", "indices", "generations"]
    if getattr(batch, "mask", None) is not None:
        keys.append("mask")
    return keys


def _made(maker):
    try:
        buf = maker()
    except (bigper.InvalidArgumentError, TypeError) as e:  # (a kind this build spells otherwise)
        pytest.fail(f"could not make the buffer: {e}")
    return buf


@pytest.mark.parametrize("name", [k for k, _ in _kinds()])
def test_cpu_to_torch_keys_are_the_batchs_then_weights_indices_generations_mask(name):
    buf = _made(dict(_kinds())[name])
    _fill(buf)
    batch = buf.sample(8)
    t = batch.to_torch("cpu")
    assert list(t) == _want_order(batch), (list(t), _want_order(batch))
    assert list(batch.to_torch()) == _want_order(batch)
    buf.close()


@cuda_only
@pytest.mark.parametrize("name", [k for k, _ in _kinds()])
def test_cuda_to_torch_keys_equal_the_cpu_order(name):
    buf = _made(dict(_kinds())[name])
    _fill(buf)
    for b in (1, 8, 33):
        batch = buf.sample(b)
        cpu = batch.to_torch("cpu")
        for dev in ("cuda", "cuda:0"):
            cuda = batch.to_torch(dev)
            assert list(cuda) == list(cpu) == _want_order(batch), (dev, list(cuda), list(cpu))
            for key in cpu:
                np.testing.assert_array_equal(_np(cuda[key]), _np(cpu[key]), err_msg=key)
    buf.close()


@cuda_only
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_cuda_tier_and_feed_keys_equal_the_cpu_order(compression):
    """A device tier's batch and the feed's: the same keys, in the same order, as the host's."""
    tier, host = _atari_like(device="cuda", compression=compression), _atari_like(compression=compression)
    for buf in (tier, host):
        _add(buf, 0, 200)
    want = list(host.sample(8).to_torch("cpu"))
    assert list(tier.sample(8).to_torch("cuda")) == want
    it = tier.sampler(8, prefetch=0, device="cuda")
    assert list(next(it)) == want
    it.close()
    it = host.sampler(8, prefetch=2, device="cuda")
    assert list(next(it)) == want
    it.close()
    tier.close()
    host.close()


# -- the learner's stream ------------------------------------------------------------------------------

def _spin(s, ms=20):
    """Work on stream ``s`` that takes a while (so a missing wait shows)."""
    torch.cuda._sleep(int(ms * 1_000_000 // 1))  # (cycles: a few ms on any GPU)


@cuda_only
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("dev", ["cuda", "cuda:0"])
def test_next_and_update_under_a_learner_stream_switching_between_batches(prefetch, dev):
    """Streams s1, s2 and the default in turn around ``next(it)`` and
    ``update_priorities(batch, cuda tensor)``: every batch exact on the
    stream that took it, priorities computed on that stream (after a long
    kernel) applied as a twin's (host values) are."""
    a, twin = _atari_like(), _atari_like()
    for buf in (a, twin):
        _add(buf, 0, 300)
    it = a.sampler(16, prefetch=prefetch, device=dev)
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.default_stream()]
    for i in range(12):
        s = streams[i % 3]
        with torch.cuda.stream(s):
            batch = next(it)
            step = batch["step"].clone()  # (on s: reads the batch after the stream waited for it)
            obs = batch["obs"][:, -1, 0, 0].clone()
            _spin(s)
            p = (step.double() % 7) + 0.5 + i  # made on s after a long kernel
            a.update_priorities(batch, p)
        s.synchronize()
        st = step.cpu().numpy()
        np.testing.assert_array_equal(obs.cpu().numpy(), (st % 251).astype(np.uint8))
        twin.update_priorities(_np(batch["indices"]), (st % 7) + 0.5 + i)
    it.close()
    a.sample(1)  # (the deferred updates applied)
    twin.sample(1)
    np.testing.assert_array_equal(a.prioritization.key_at(np.arange(300)), twin.prioritization.key_at(np.arange(300)))
    a.close()
    twin.close()


@cuda_only
def test_two_learner_threads_each_with_its_own_stream():
    """Two threads, each with its own stream and its own feed of one
    buffer: each thread's cache is its own (a shared cache would make one
    thread's stream wait for the other's batch, or not at all)."""
    buf = _atari_like()
    _add(buf, 0, 300)
    errors, done = [], []

    def learner(k):
        try:
            s = torch.cuda.Stream()
            it = buf.sampler(16, prefetch=k, device="cuda")
            with torch.cuda.stream(s):
                for i in range(30):
                    batch = next(it)
                    _spin(s, 5)
                    step = batch["step"].clone()
                    obs = batch["obs"][:, -1, 0, 0].clone()
                    buf.update_priorities(batch, step.double() % 5 + 0.1)
                    s.synchronize()
                    st = step.cpu().numpy()
                    assert (obs.cpu().numpy() == (st % 251).astype(np.uint8)).all(), (k, i)
                    assert torch.cuda.current_stream() == s
            it.close()
            done.append(k)
        except BaseException as e:  # noqa: BLE001
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=learner, args=(k,)) for k in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(done) == [0, 2], errors
    buf.close()


@cuda_only
def test_current_stream_follows_the_thread_and_the_context():
    from bigper.tensors.streams import current_stream

    d0, dn = torch.device("cuda:0"), torch.device("cuda")
    assert current_stream(torch, d0) == torch.cuda.current_stream(d0)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert current_stream(torch, d0) == s
        assert current_stream(torch, dn) == s
    assert current_stream(torch, dn) == torch.cuda.current_stream()
    seen = []
    t = threading.Thread(target=lambda: seen.append(current_stream(torch, d0)))
    with torch.cuda.stream(s):
        current_stream(torch, d0)
        t.start()
        t.join()
    assert seen[0] == torch.cuda.default_stream(d0)  # (the other thread's own current stream)
