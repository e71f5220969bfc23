"""Second attack on the feed (``sampler(B, prefetch, device="cpu")``): what a
learner can do to a batch that a slot's give-back did not see, and the
lock-free gather's check. It found seven causes (a tensor re-pointed in place
with ``as_strided_``/``set_``/``.data =``/``transpose_``; a held
``untyped_storage()`` or ``_base``; a held view masked by another tensor
re-pointed off the block; a key added to ``t.host``; ``.grad``, ``__class__``
and attributes left on a tensor): each batch now gets tensors, a dict and host
copies of its own, and a slot counts only what it owns. All are plain tests.
A row is checked self-consistent as ``test_feed.py`` does (``_check_rows``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper.core.feed as plan  # noqa: E402
from tests.device.test_feed import _add, _atari_like, _check_rows, _np  # noqa: E402


def _buf(capacity=400):
    buf = _atari_like(capacity=capacity)
    _add(buf, 0, capacity)
    return buf


def _later_batches_consistent(it, n=8, b=None):
    for _ in range(n):
        t = next(it)
        _check_rows(t)
        if b is not None:
            for k in ("reward", "step", "weights", "indices", "generations"):
                assert tuple(t[k].shape) == (b,), k
                assert t[k].stride() == (1,), k
    del t


# ---------------------------------------------------------------------------------------------
# A learner that re-points a batch tensor at other bytes of the same storage: same shape, dtype,
# requires_grad, same storage (no use count moves): ``counts()`` does not look at the storage
# offset nor the strides, so the slot is refilled and every later batch of it carries the edit.
# ---------------------------------------------------------------------------------------------

def _repoint(t, how):
    r = t["reward"]
    w = t["weights"]  # float32 (B,), as reward: another region of the same block
    if how == "as_strided_":
        t["step"].as_strided_(tuple(t["step"].shape), (0,))  # every row reads row 0
    elif how == "set_":
        r.set_(r.untyped_storage(), w.storage_offset(), tuple(r.shape), r.stride())
    elif how == "data":
        r.data = w
    elif how == "transpose_":  # a square (B, k, ...) stack: same shape, strides swapped
        t["obs"].transpose_(0, 1)


@pytest.mark.parametrize("how", ["as_strided_", "set_", "data", "transpose_"])
def test_a_batch_tensor_re_pointed_in_place_never_reaches_later_batches(how):
    buf = _buf()
    b = 4  # (B == k: a square stack for transpose_)
    it = buf.sampler(b, prefetch=0, device="cpu")
    t = next(it)
    _repoint(t, how)
    del t
    try:
        _later_batches_consistent(it, b=b)
    finally:
        it.close()
        buf.close()


# ---------------------------------------------------------------------------------------------
# Holds. Guard: a DLPack export (numpy's or torch's capsule) is seen (it makes a TensorImpl).
# Bug: the storage's Python object is the one the slot keeps itself (``Slot.stores``: torch
# gives one PyObject a storage), so holding it moves only that object's refcount, which
# ``counts()`` does not read: the batch is refilled under the holder.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["np.from_dlpack", "to_dlpack"])
def test_a_batch_held_through_dlpack_is_never_refilled(how):
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    t = next(it)
    want = _np(t["step"]).copy()
    if how == "np.from_dlpack":
        held = np.from_dlpack(t["step"])
        view = lambda: held  # noqa: E731
    else:
        cap = torch.utils.dlpack.to_dlpack(t["step"])
        view = lambda: torch.utils.dlpack.from_dlpack(cap).numpy()  # noqa: E731
    del t
    try:
        for _ in range(10):
            next(it)
        np.testing.assert_array_equal(view(), want)
    finally:
        it.close()
        buf.close()


@pytest.mark.parametrize("how", ["numpy", "memoryview", "frombuffer", "Parameter", "weakref_and_view", "detach",
                                 "untyped_storage", "storage"])
def test_other_holds_are_seen(how):
    """Holds through a Python reference, a new TensorImpl or the storage object."""
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    t = next(it)
    want = _np(t["reward"]).copy()
    r = t["reward"]
    if how == "numpy":
        held = r.numpy()
        get = lambda: held  # noqa: E731
    elif how == "memoryview":
        held = memoryview(r.numpy())
        get = lambda: np.asarray(held)  # noqa: E731
    elif how == "frombuffer":
        held = np.frombuffer(memoryview(r.numpy()), dtype=np.float32)
        get = lambda: held  # noqa: E731
    elif how == "untyped_storage":
        st, off = r.untyped_storage(), r.storage_offset()
        get = lambda: torch.tensor([], dtype=torch.float32).set_(st, off, (8,)).numpy()  # noqa: E731
    elif how == "Parameter":
        held = torch.nn.Parameter(r, requires_grad=False)
        get = lambda: held.detach().numpy()  # noqa: E731
    elif how == "weakref_and_view":
        held = r[2:]
        want = want[2:]
        get = lambda: held.numpy()  # noqa: E731
    elif how == "detach":
        held = r.detach()
        get = lambda: held.numpy()  # noqa: E731
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = r.storage()
        off = r.storage_offset()
        get = lambda: np.asarray(st.tolist()[off:off + 8], dtype=np.float32)  # noqa: E731
    del t, r
    try:
        for _ in range(10):
            next(it)
        np.testing.assert_array_equal(get(), want)
    finally:
        it.close()
        buf.close()


# ---------------------------------------------------------------------------------------------
# In-place edits of a batch tensor's other state, carried into later batches of the slot.
# ---------------------------------------------------------------------------------------------

class _Sub(torch.Tensor):
    pass


def _edit_state(r, how):
    if how == "grad":
        r.grad = torch.ones(tuple(r.shape))
    elif how == "__class__":
        r.__class__ = _Sub
    else:
        r.tag = "seen"


def _state_clean(r):
    return r.grad is None and type(r) is torch.Tensor and not hasattr(r, "tag")


@pytest.mark.parametrize("how", ["grad", "__class__", "attribute"])
def test_a_batch_tensors_python_state_never_reaches_later_batches(how):
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    try:
        for _ in range(8):
            t = next(it)
            assert _state_clean(t["reward"])
            _edit_state(t["reward"], how)
        del t
    finally:
        it.close()
        buf.close()


def test_a_key_added_to_the_host_dict_never_reaches_later_batches():
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    try:
        keys = None
        for _ in range(8):
            t = next(it)
            keys = keys or set(t.host)
            assert set(t.host) == keys and "seen" not in keys
            t.host["seen"] = True
        del t
    finally:
        it.close()
        buf.close()


def test_values_written_into_a_batch_never_reach_later_batches():
    """Guard: in-place writes of the values (every region a batch reads is refilled)."""
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    try:
        for _ in range(8):
            t = next(it)
            _check_rows(t)
            for k in list(t):
                t[k].fill_(True if t[k].dtype == torch.bool else 7)
            t.host["indices"][:] = 3
            t.host["generations"][:] = 3
        del t
    finally:
        it.close()
        buf.close()


@pytest.mark.parametrize("key", ["reward", "obs"])
def test_a_batch_held_through_a_tensors_base_is_never_refilled(key):
    """What a batch tensor reaches: its ``_base`` where it has one (the feed's tensors are
    ``detach``ed from the slot's prototypes: none), else a tensor over its whole storage."""
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    t = next(it)
    base = t[key]._base
    if base is None:
        base = torch.empty(0, dtype=torch.uint8).set_(t[key].untyped_storage())
    assert base.data_ptr() <= t[key].data_ptr()
    want = base.clone()
    del t
    try:
        for _ in range(10):
            next(it)
        assert torch.equal(base, want)
    finally:
        it.close()
        buf.close()


def test_a_held_view_masked_by_a_tensor_re_pointed_off_the_block_is_never_refilled():
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    t = next(it)
    held = t["step"][:]
    want = held.clone()
    t["reward"].set_(torch.zeros(8))
    del t
    try:
        for _ in range(10):
            next(it)
        assert torch.equal(held, want)  # (the hold)
        _later_batches_consistent(it, n=2)  # (the re-pointed tensor)
    finally:
        it.close()
        buf.close()


def test_resize_of_a_batch_tensor_cannot_move_the_block():
    """Guard: the slot's storage is not resizable, so a resize_ past it cannot leave the
    host numpy views (``t.host``: what update_priorities reads) on freed memory."""
    buf = _buf()
    it = buf.sampler(8, prefetch=0, device="cpu")
    try:
        t = next(it)
        with pytest.raises(RuntimeError):
            t["reward"].resize_(1 << 22)
        del t
        _later_batches_consistent(it, b=8)
    finally:
        it.close()
        buf.close()


class _FailOnce:
    def __init__(self, monkeypatch):
        self.real, self.armed = plan.gather_kernel, True
        monkeypatch.setattr(plan, "gather_kernel", self)

    def __call__(self, *args):
        if self.armed:
            self.armed = False
            self.real(*args)  # (half the work done: the block holds this batch's rows)
            raise MemoryError("injected in the gather")
        return self.real(*args)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_exception_in_the_gather_never_hands_out_its_slot(monkeypatch, prefetch):
    """Guard: the error is raised once, the iterator ends, and a new sampler's batches are whole.
    (The threaded feed's gather; ``NativeFeed``'s compiled thread has no Python to raise in.)"""
    from bigper.device import feed, native

    monkeypatch.setattr(native, "feed_sampler", feed.FeedSampler)
    buf = _buf()
    it = buf.sampler(8, prefetch=prefetch, device="cpu")
    _check_rows(next(it)) if prefetch == 0 else None
    _FailOnce(monkeypatch)
    with pytest.raises(MemoryError):
        for _ in range(6):
            next(it)
    with pytest.raises((StopIteration, Exception)):
        next(it)
    it.close()
    it = buf.sampler(8, prefetch=prefetch, device="cpu")
    _later_batches_consistent(it, b=8)
    it.close()
    buf.close()


def test_assign_priorities_racing_the_gather_keeps_the_draw_times_batch(monkeypatch):
    """Guard: priorities only; the batch is the one drawn, its rows whole."""
    buf = _buf(capacity=64)
    twin = _buf(capacity=64)
    it = buf.sampler(16, prefetch=0, device="cpu")
    real = plan.gather_kernel
    armed = [True]

    def hook(*args):
        if armed[0]:
            armed[0] = False
            buf.assign_priorities(np.linspace(0.1, 9.0, 64))
        return real(*args)

    monkeypatch.setattr(plan, "gather_kernel", hook)
    t = next(it)
    _check_rows(t)
    want = twin.sample(16)
    np.testing.assert_array_equal(_np(t["indices"]), want.indices)
    np.testing.assert_allclose(_np(t["weights"]), want.weights, rtol=1e-6)
    del t
    it.close()
    buf.close()
    twin.close()
