"""Hostile: the sampler feed (``sampler(B, prefetch=2, device="cpu")``) over the buffer's
``Parts`` while the buffer is dropped, closed from another thread, or given an older state.
Each batch is checked against the rows' own encoding (``_check_rows``: pixels and ``step``
say the step number), never against an earlier answer of the buffer. The iterator must end
with ``BufferClosedError`` or go on giving correct batches; never wrong data, never a hang."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bigper.errors import BufferClosedError  # noqa: E402
from tests.device.test_feed import _add, _atari_like, _check_rows  # noqa: E402

T = 60


def _run(fn):
    errs, out = [], []

    def body():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 (reported by the caller)
            errs.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errs, out


def _join(t):
    t.join(T)
    assert not t.is_alive(), "hang: a thread still runs"


def _drain(it, n):
    """Up to ``n`` batches, each checked; the error that ended it, or None."""
    for _ in range(n):
        try:
            b = next(it)
        except BufferClosedError as e:
            return e
        _check_rows(b)
    return None


def test_drop_the_buffer_while_iterating():
    buf = _atari_like(capacity=200)
    _add(buf, 0, 200)
    it = buf.sampler(16, prefetch=2, device="cpu")
    assert type(it).__name__ == "NativeFeed"
    _check_rows(next(it))
    ref = weakref.ref(buf)
    del buf
    gc.collect()

    def go():
        return _drain(it, 50)
    t, errs, out = _run(go)
    _join(t)
    assert not errs, errs
    # The iterator holds the buffer (it keeps serving correct rows) or ends with BufferClosedError.
    assert out[0] is None or isinstance(out[0], BufferClosedError)
    del it
    gc.collect()
    assert ref() is None, "the buffer outlives its iterator"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_another_thread_mid_iteration(prefetch):
    buf = _atari_like(capacity=200)
    _add(buf, 0, 200)
    it = buf.sampler(16, prefetch=prefetch, device="cpu")
    _check_rows(next(it))
    started = threading.Event()

    def go():
        started.set()
        got = 0
        while True:
            try:
                b = next(it)
            except BufferClosedError as e:
                return e, got
            _check_rows(b)
            got += 1
            if got > 100000:
                return None, got
    t, errs, out = _run(go)
    started.wait(T)
    c, cerrs, _ = _run(buf.close)
    _join(c)
    _join(t)
    assert not cerrs and not errs, (cerrs, errs)
    assert isinstance(out[0][0], BufferClosedError)
    with pytest.raises(BufferClosedError):
        next(it)


def test_close_while_holding_batches_keeps_them_intact():
    buf = _atari_like(capacity=200)
    _add(buf, 0, 200)
    it = buf.sampler(16, prefetch=2, device="cpu")
    held = [next(it) for _ in range(4)]
    copies = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in held]
    buf.close()
    gc.collect()
    for b, c in zip(held, copies):
        _check_rows(b)
        for k, v in c.items():
            assert torch.equal(b[k], v), k


def test_load_state_while_iterating_gives_correct_batches():
    buf = _atari_like(capacity=400)
    _add(buf, 0, 120)
    old = copy.deepcopy(buf.state_dict())
    _add(buf, 120, 120)  # no wrap: the older state's rows keep their data
    it = buf.sampler(16, prefetch=2, device="cpu")
    done = threading.Event()
    seen = []

    def go():
        while not done.is_set():
            b = next(it)
            _check_rows(b)
            seen.append(b["step"].numpy().copy())
    t, errs, _ = _run(go)
    for _ in range(5):
        buf.load_state(*copy.deepcopy(old))
        buf.load_state(*copy.deepcopy(buf.state_dict()))
    done.set()
    _join(t)
    assert not errs, errs
    buf.load_state(*copy.deepcopy(old))
    late = next(it)  # (up to prefetch=2 batches drawn before the restore may still come)
    late = [next(it) for _ in range(3)][-1]
    _check_rows(late)
    assert (late["step"].numpy() < 120).all()
    buf.close()
    assert seen


def test_update_priorities_from_the_feed_while_another_thread_closes():
    buf = _atari_like(capacity=200)
    _add(buf, 0, 200)
    it = buf.sampler(16, prefetch=2, device="cpu")
    rng = np.random.default_rng(0)
    started = threading.Event()

    def learn():
        n = 0
        while True:
            try:
                b = next(it)
                _check_rows(b)
                buf.update_priorities(b, torch.from_numpy(rng.random(16) + 0.1))
            except BufferClosedError:
                return n
            n += 1
            started.set()
    t, errs, out = _run(learn)
    assert started.wait(T)
    c, cerrs, _ = _run(buf.close)
    _join(c)
    _join(t)
    assert not errs and not cerrs, (errs, cerrs)
    assert out[0] > 0


def test_extend_from_another_thread_while_the_feed_serves_and_wraps():
    buf = _atari_like(capacity=100)
    _add(buf, 0, 100)
    it = buf.sampler(16, prefetch=2, device="cpu")
    a, aerrs, _ = _run(lambda: [_add(buf, g, 7) for g in range(100, 800, 7)])
    got = 0
    while a.is_alive():
        b = next(it)
        _check_rows(b)
        got += 1
        assert got < 10 ** 6
    _join(a)
    assert not aerrs, aerrs
    b = [next(it) for _ in range(3)][-1]
    _check_rows(b)
    assert (b["step"].numpy() >= 700).all()
    buf.close()
