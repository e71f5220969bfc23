"""Batch.to_torch and priorities from tensors (bigper.tensors)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from bigper.tensors import lazy, pinned  # noqa: E402
from bigper.batch import Batch  # noqa: E402

CUDA = torch.cuda.is_available()


def _buffer(**kw):
    fields = {"obs": ((4, 6, 5), np.uint8), "action": ((), np.int64), "reward": ((), np.float32),
              "aux": ((3,), np.float64)}
    buf = bigper.PrioritizedReplayBuffer(64, fields, frame_stack=4, n_step=3, seed=1, **kw)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (200, 6, 5), dtype=np.uint8)
    for t in range(100):
        buf.add(obs=frames[t:t + 4], action=t % 5, reward=np.float32(t), next_obs=frames[t + 1:t + 5],
                aux=np.full(3, t, np.float64), terminated=t % 17 == 16, truncated=t % 23 == 22)
    return buf


def _leaves(buf):
    return np.array(buf.state_dict()[1]["leaves"])


def test_cpu_dtypes_shapes_and_shared_memory():
    buf = _buffer()
    b = buf.sample(8)
    t = b.to_torch()
    assert set(t) == set(b.keys()) | {"weights", "indices", "generations"}
    want = {"obs": torch.uint8, "next_obs": torch.uint8, "action": torch.int64, "reward": torch.float32,
            "aux": torch.float64, "terminated": torch.bool, "truncated": torch.bool,
            "discount": torch.float32, "weights": torch.float32, "indices": torch.int64,
            "generations": torch.int64}
    assert {k: v.dtype for k, v in t.items()} == want
    for k in b:
        assert tuple(t[k].shape) == b[k].shape and t[k].device.type == "cpu"
        np.testing.assert_array_equal(t[k].numpy(), b[k])
        # no copy: the tensor is the batch's memory
        assert t[k].data_ptr() == b[k].ctypes.data
    assert tuple(t["obs"].shape) == (8, 4, 6, 5)
    np.testing.assert_array_equal(t["indices"].numpy(), b.indices)
    np.testing.assert_array_equal(t["weights"].numpy(), b.weights)
    # The bookkeeping is the tensors' own (B numbers): a learner's in-place op never reaches the batch.
    assert t["weights"].data_ptr() != b.weights.ctypes.data
    assert t["indices"].data_ptr() != b.indices.ctypes.data
    assert b.to_torch(device="cpu").keys() == t.keys()
    assert b.to_torch(device=torch.device("cpu"))["obs"].device.type == "cpu"


def _odd_batch():
    """A batch whose arrays torch cannot share as they are."""
    base = np.arange(48, dtype=np.float32).reshape(8, 6)
    ro = np.arange(8, dtype=np.int64)
    ro.flags.writeable = False
    data = {"strided": base[:, ::2], "readonly": ro, "bigendian": np.arange(8, dtype=">f4"),
            "flags": np.zeros(8, dtype=bool)}
    return Batch(data, np.arange(8, dtype=np.int32), np.ones(8, dtype=np.float64),
                 np.full(8, 1 / 8), np.arange(8, dtype=np.int64)), base


def test_cpu_copies_exactly_where_needed():
    b, base = _odd_batch()
    t = b.to_torch()
    np.testing.assert_array_equal(t["strided"].numpy(), base[:, ::2])
    # strided without negative strides: shared as it is (obs/next_obs of one frame gather are such views)
    assert t["strided"].data_ptr() == base.ctypes.data and t["strided"].stride() == (6, 2)
    assert t["readonly"].data_ptr() != b["readonly"].ctypes.data  # copied: torch may write
    assert t["bigendian"].dtype == torch.float32
    np.testing.assert_array_equal(t["bigendian"].numpy(), np.arange(8, dtype=np.float32))
    assert t["flags"].data_ptr() == b["flags"].ctypes.data  # contiguous and writable: shared
    assert t["weights"].dtype == torch.float32 and t["indices"].dtype == torch.int64
    np.testing.assert_array_equal(t["indices"].numpy(), np.arange(8))


def test_unsupported_dtype_names_the_field():
    b = Batch({"text": np.array(["a"] * 4)}, np.arange(4), np.ones(4, np.float32), np.ones(4), np.arange(4))
    with pytest.raises(TypeError, match="'text'"):
        b.to_torch()


def _pair():
    return _buffer(), _buffer()


@pytest.mark.parametrize("make", [
    lambda p: torch.tensor(p, dtype=torch.float32),
    lambda p: torch.tensor(p, dtype=torch.float64),
    lambda p: torch.tensor(p, dtype=torch.float32, requires_grad=True) * 1.0,  # non-leaf with grad
    lambda p: torch.tensor(p, dtype=torch.float32, requires_grad=True),        # leaf with grad
    lambda p: torch.tensor(p, dtype=torch.float32)[:, None],                  # (B, 1)
    lambda p: torch.tensor(np.repeat(p, 2), dtype=torch.float32)[::2],        # strided view
    lambda p: torch.tensor(p, dtype=torch.float16),
    lambda p: torch.tensor(p, dtype=torch.bfloat16),
    lambda p: torch.nn.Parameter(torch.tensor(p, dtype=torch.float32)),
], ids=["f32", "f64", "grad-nonleaf", "grad-leaf", "column", "strided", "f16", "bf16", "parameter"])
def test_update_priorities_from_tensors(make):
    a, b = _pair()
    ba, bb = a.sample(16), b.sample(16)
    assert np.array_equal(ba.indices, bb.indices)
    t = make(np.linspace(0.25, 4.0, 16))
    want = lazy.as_numpy(t).astype(np.float64).reshape(-1)  # what the tensor holds (f16/bf16 rounded)
    a.update_priorities(ba, t)
    b.update_priorities(bb, want)
    np.testing.assert_array_equal(_leaves(a), _leaves(b))
    assert a.total_priority == b.total_priority


def test_update_priorities_with_tensor_indices():
    a, b = _pair()
    idx = a.sample(16).indices
    b.sample(16)
    p = np.linspace(0.5, 2.0, 16)
    t = a.sample(4).to_torch()  # a batch converted, then its indices used as a tensor
    b.sample(4)
    a.update_priorities(torch.from_numpy(idx), torch.from_numpy(p).float())
    b.update_priorities(idx, p.astype(np.float32).astype(np.float64))
    a.update_priorities(t["indices"], torch.ones(4))
    b.update_priorities(t["indices"].numpy().copy(), np.ones(4))
    np.testing.assert_array_equal(_leaves(a), _leaves(b))


def test_update_priorities_from_td_of_a_learner():
    """The usual shape of a learner: TD errors with grad, on the batch converted to torch."""
    buf = _buffer()
    batch = buf.sample(32)
    t = batch.to_torch()
    w = torch.zeros(1, requires_grad=True)
    td = t["reward"] + t["discount"] * w - t["reward"] * 0.5
    loss = (t["weights"] * td.pow(2)).mean()
    loss.backward()
    buf.update_priorities(batch, td.abs())
    leaves = _leaves(buf)
    tdn = td.detach().abs().numpy().astype(np.float64)
    last = {}
    for i, j in enumerate(batch.indices):
        last[j] = tdn[i]  # a repeated index: the last value wins
    for j, p in last.items():
        assert leaves[j] == pytest.approx((p + 1e-6) ** 0.6)


def test_bad_tensor_priorities_leave_the_buffer_unchanged():
    buf = _buffer()
    batch = buf.sample(8)
    before = _leaves(buf).copy()
    for bad in (torch.full((8,), float("nan")), -torch.ones(8), torch.ones(7)):
        with pytest.raises(ValueError):
            buf.update_priorities(batch, bad)
    np.testing.assert_array_equal(_leaves(buf), before)


def test_as_numpy_passes_non_tensors_through():
    a = np.arange(3)
    assert lazy.as_numpy(a) is a
    assert lazy.as_numpy([1, 2]) == [1, 2]
    t = torch.arange(4, dtype=torch.float32)
    assert lazy.as_numpy(t).ctypes.data == t.data_ptr()  # a CPU tensor is shared
    assert lazy.as_numpy(torch.tensor([1.5], dtype=torch.bfloat16)).dtype == np.float32
    c = torch.tensor([1 + 2j]).conj()
    assert lazy.as_numpy(c)[0] == 1 - 2j


# -- the pinned pool's reuse rule, with fake events (no GPU needed) ------------------

class _Event:
    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


class _CpuPool(pinned.PinnedPool):
    def _new_slot(self, shape, dtype):
        return pinned._Slot(torch.empty(shape, dtype=dtype))


def test_pool_never_hands_out_a_buffer_with_a_copy_in_flight():
    pool = _CpuPool(depth=2)
    key = ("dev", "obs", (4,), "|u1")
    s1 = pool.acquire(key, (4,), torch.uint8)
    e1 = _Event()
    pool.release(key, s1, e1)
    s2 = pool.acquire(key, (4,), torch.uint8)
    assert s2 is not s1  # s1's copy is still in flight
    e2 = _Event()
    pool.release(key, s2, e2)
    s3 = pool.acquire(key, (4,), torch.uint8)  # pool full, both busy: wait on the oldest
    assert s3 is s1 and e1.waited and not e2.waited
    pool.release(key, s3, _Event())
    e2.done = True
    assert pool.acquire(key, (4,), torch.uint8) is s2  # a finished copy: reused without waiting
    assert not e2.waited


def test_pool_evicts_old_keys():
    pool = _CpuPool(depth=2, max_keys=2)
    for i in range(5):
        key = ("dev", f"f{i}", (2,), "<f4")
        pool.release(key, pool.acquire(key, (2,), torch.float32), None)
    assert len(pool._free) == 2


def _pair_buffer():
    """n_step=1 frame stacks: sample returns obs and next_obs as views of one
    gather (not C-contiguous), so to_torch copies them on the CPU."""
    buf = bigper.PrioritizedReplayBuffer(64, {"obs": ((4, 6, 5), np.uint8), "action": ((), np.int64)},
                                         frame_stack=4, seed=2)
    frames = np.random.default_rng(1).integers(0, 255, (120, 6, 5), dtype=np.uint8)
    for t in range(110):
        buf.add(obs=frames[t:t + 4], action=t, next_obs=frames[t + 1:t + 5], terminated=t % 29 == 28)
    return buf


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["drop", "tensor", "view", "numpy", "float"]),
                          st.integers(0, 7)), min_size=1, max_size=25))
def test_cpu_copies_never_reuse_memory_a_tensor_still_holds(ops):
    buf = _pair_buffer()
    assert not buf.sample(4)["obs"].flags.c_contiguous  # the case under test: a copy is made
    held = []  # (what the caller kept, the values it must still show)
    for kind, drop in ops:
        b = buf.sample(8)
        want = {k: b[k].copy() for k in ("obs", "next_obs")}
        t = b.to_torch()
        del b
        for k in ("obs", "next_obs"):
            np.testing.assert_array_equal(t[k].numpy(), want[k])
            kept = {"tensor": t[k], "view": t[k][2:5], "numpy": t[k].numpy(), "float": t[k].float()}.get(kind)
            if kept is not None:
                held.append((kept, want[k][2:5] if kind == "view" else want[k]))
        del t
        if held and drop < len(held):
            held.pop(drop)
        for kept, values in held:
            got = kept.numpy() if isinstance(kept, torch.Tensor) else kept
            np.testing.assert_array_equal(got, values)


def test_cpu_copies_from_threads_stay_intact():
    import threading

    buf = _pair_buffer()
    lock, errors = threading.Lock(), []

    def work():
        for _ in range(200):
            with lock:  # sample under our lock; convert outside it, concurrently
                b = buf.sample(8)
                want = b["obs"].copy()
            t = b.to_torch()
            del b
            for _ in range(3):
                if not np.array_equal(t["obs"].numpy(), want):
                    errors.append("a live tensor's memory was handed out again")
                    return

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_reused_arrays_hand_out_only_what_nobody_holds():
    from bigper.common.reuse import ReusedArrays

    pool = ReusedArrays(depth=2, max_keys=2)
    a = pool.take((3,), np.dtype(np.uint8))
    b = pool.take((3,), np.dtype(np.uint8))
    assert b is not a  # a is still held here
    t = torch.from_numpy(b)
    del a
    c = pool.take((3,), np.dtype(np.uint8))
    assert c is not b  # held through the tensor
    del t, b, c
    for i in range(4):
        pool.take((i + 5,), np.dtype(np.float32))
    assert len(pool._arrays) == 2


# -- CUDA ------------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_dtypes_devices_and_values():
    buf = _buffer()
    b = buf.sample(8)
    t = b.to_torch(device="cuda")
    for k in b:
        assert t[k].device.type == "cuda" and t[k].dtype == torch.from_numpy(b[k]).dtype
        np.testing.assert_array_equal(t[k].cpu().numpy(), b[k])
    assert t["weights"].dtype == torch.float32 and t["indices"].dtype == torch.int64
    buf.update_priorities(b, (t["reward"] + 1).abs())  # priorities from a CUDA tensor
    buf.update_priorities(t["indices"], torch.ones(8, device="cuda", requires_grad=True))


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_reused_pinned_buffers_keep_every_batch_intact():
    buf = _buffer()
    batches, tensors = [], []
    for _ in range(12):  # more calls than the pool is deep
        b = buf.sample(32)
        batches.append(b)
        torch.cuda._sleep(20_000_000)  # the copies queue behind this: really in flight on return
        tensors.append(b.to_torch(device="cuda", non_blocking=True))
    torch.cuda.synchronize()
    for b, t in zip(batches, tensors):
        for k in b:
            np.testing.assert_array_equal(t[k].cpu().numpy(), b[k])
        np.testing.assert_array_equal(t["indices"].cpu().numpy(), b.indices)
    blocking = batches[0].to_torch(device="cuda:0", non_blocking=False)
    np.testing.assert_array_equal(blocking["obs"].cpu().numpy(), batches[0]["obs"])
