"""More hostile use of the SB3 drop-in's background sampler: close_sampler from
another thread while one samples, pickling while another thread samples."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

th = pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from tests.integrations.test_hostile_sb3_prefetch import feed_threads, filled, wait_for  # noqa: E402
from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)


def _run(*fns):
    errors = []

    def wrap(f):
        def g():
            try:
                f()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        return g
    ts = [threading.Thread(target=wrap(f)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(90)
    assert not any(t.is_alive() for t in ts), "deadlock"
    return errors


def test_close_sampler_from_another_thread_during_sample():
    before = feed_threads()  # (threads other tests' samplers still hold on this worker do not count)
    rb = filled(n=200, cap=128)
    stop = threading.Event()

    def learner():
        try:
            for _ in range(200):
                s = rb.sample(16)
                assert s.observations.shape == (16, 3)
                rb.update_priorities(s.indices, th.rand(16) + 0.01)
        finally:
            stop.set()

    def closer():
        while not stop.is_set():
            rb.close_sampler()
    errors = _run(learner, closer)
    assert not errors, errors
    rb.close_sampler()
    wait_for(lambda: feed_threads() <= before)
    rb.close()


def test_pickle_while_another_thread_samples(tmp_path):
    rb = filled(n=200, cap=128, snapshot_dir=tmp_path / "snaps")
    blobs = []
    stop = threading.Event()

    def learner():
        while not stop.is_set():
            s = rb.sample(16)
            rb.update_priorities(s.indices, th.rand(16) + 0.01)

    def pickler():
        try:
            for _ in range(4):
                blobs.append(pickle.dumps(rb))
        finally:
            stop.set()
    errors = _run(learner, pickler)
    assert not errors, errors
    for blob in blobs:
        other = pickle.loads(blob)
        assert len(other.buffer) == 128
        leaves = other.buffer.leaves(np.arange(128))
        assert np.isfinite(leaves).all() and (leaves > 0).all()
        s = other.sample(16)
        assert s.observations.shape == (16, 3)
        other.close()
    rb.close()


def test_pickle_with_another_thread_sampling_resumes_where_the_pickle_was_taken(tmp_path):
    """The resumed buffer's next draw is the one the pickled buffer's random state gives."""
    rb = filled(n=200, cap=128, snapshot_dir=tmp_path / "snaps")
    rb.sample(16)  # the sampler is open with batches prepared
    blob = pickle.dumps(rb)
    a = pickle.loads(blob)
    b = pickle.loads(blob)
    sa, sb = a.sample(16), b.sample(16)
    np.testing.assert_array_equal(sa.indices.numpy(), sb.indices.numpy())
    a.close()
    b.close()
    rb.close()


def test_close_sampler_then_sample_after_close_is_refused():
    from bigper.errors import BufferClosedError
    rb = filled()
    rb.sample(8)
    rb.close()
    rb.close_sampler()  # idempotent after close
    with pytest.raises(BufferClosedError):
        rb.sample(8)
    with pytest.raises(BufferClosedError):
        pickle.dumps(rb)
