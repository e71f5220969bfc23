"""Hostile tests of the device tier (issue 31): ``device=``, ``to_torch``'s
single copy, ``TensorBatch`` and deferred priority updates, frames-once
sequences. Every tier case runs on ``device="cpu"`` (the same code over CPU
tensors); CUDA-only cases are skipped without a GPU.

A case marked ``xfail(strict=True)`` is a failure found here: its reason says
the exact failure, so it flips when fixed."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import numpy as np
import pytest
from tests import hook

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from bigper.tensors import transfer  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on a GPU machine)")


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _same(host, dev, order=True):
    """The tier batch ``dev`` holds exactly the host batch ``host``."""
    assert (list(host.keys()) == list(dev.keys())) if order else (set(host) == set(dev)), \
        (list(host.keys()), list(dev.keys()))
    for k in host:
        a, b = host[k], _np(dev[k])
        assert b.dtype == a.dtype and b.shape == a.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), k
    np.testing.assert_array_equal(host.indices, dev.indices)
    np.testing.assert_array_equal(host.generations, dev.generations)
    np.testing.assert_array_equal(host.weights, _np(dev.weights))
    if host.mask is not None:
        np.testing.assert_array_equal(host.mask, _np(dev.mask))


def _state(buf):
    meta, arrays = buf.state_dict()
    return repr(meta), {k: np.array(v, copy=True) for k, v in arrays.items()}


def _same_state(a, b):
    assert a[0] == b[0]
    assert set(a[1]) == set(b[1])
    for k in a[1]:
        np.testing.assert_array_equal(a[1][k], b[1][k], err_msg=k)


def _pair(**kw):
    return bigper.PrioritizedReplayBuffer(**kw), bigper.PrioritizedReplayBuffer(**kw, device="cpu")


def _both(host, tier, method, *args, **kw):
    getattr(host, method)(*args, **kw)
    getattr(tier, method)(*args, **kw)


def _check(host, tier, n=4, b=6, update=True, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        try:
            x = host.sample(b)
        except bigper.InvalidArgumentError:
            with pytest.raises(bigper.InvalidArgumentError):
                tier.sample(b)
            return
        y = tier.sample(b)
        _same(x, y)
        if update:
            shape = x.mask.shape if x.mask is not None and rng.random() < 0.5 else (b,)
            p = np.abs(rng.standard_normal(shape)) + 0.01
            host.update_priorities(x, p)
            tier.update_priorities(y.to_torch(), torch.from_numpy(p))
    _same_state(_state(host), _state(tier))


# -- the tier against the host path, where the Hypothesis machine may not reach ------------


def test_capacity_1_wraps_many_times_with_frames_and_n_step():
    for kw in (dict(capacity=1, fields={"x": ((2,), np.int16)}),
               dict(capacity=1, fields={"obs": ((2, 3), np.uint8), "a": ((), np.int64)}, frame_stack=2),
               dict(capacity=2, fields={"obs": ((3, 3), np.uint8), "reward": ((), np.float32)}, frame_stack=3,
                    n_step=3)):
        host, tier = _pair(**kw)
        rng = np.random.default_rng(1)
        fs = kw.get("frame_stack")
        for t in range(60):
            step = {}
            for name, (shape, dt) in kw["fields"].items():
                step[name] = rng.integers(0, 3, shape).astype(dt)
            if fs:
                step["next_obs"] = np.concatenate([step["obs"][1:], rng.integers(0, 3, (1, 3 if fs == 3 else 3))
                                                   .astype(np.uint8)[:, :step["obs"].shape[1]]])
            step["terminated"] = bool(rng.random() < 0.2)
            step["truncated"] = bool(rng.random() < 0.1) and not step["terminated"]
            _both(host, tier, "add", **step)
            if t % 3 == 0:
                _check(host, tier, n=2, b=3, seed=t)
        _check(host, tier, n=3, b=5)


def test_vector_envs_with_valid_false_rows_after_autoreset():
    kw = dict(capacity=23, fields={"obs": ((2, 3), np.uint8), "action": ((), np.int64),
                                   "reward": ((), np.float32)}, frame_stack=2,
              num_envs=3, n_step=2, seed=3)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(2)
    ended = np.zeros(3, bool)
    for t in range(90):
        obs = rng.integers(0, 5, (3, 2, 3), dtype=np.uint8)
        nxt = np.concatenate([obs[:, 1:], rng.integers(0, 5, (3, 1, 3), dtype=np.uint8)], axis=1)
        valid = ~(ended & (rng.random(3) < 0.7))
        term = rng.random(3) < 0.15
        trunc = (rng.random(3) < 0.1) & ~term
        _both(host, tier, "add", obs=obs, next_obs=nxt, action=rng.integers(0, 9, 3),
              reward=rng.standard_normal(3).astype(np.float32), terminated=term,
              truncated=trunc, valid=valid)
        ended = (term | trunc) | ~valid
        if t % 4 == 1:
            _check(host, tier, n=1, b=7, seed=t)
    _check(host, tier, n=4, b=9)


def test_n_step_3_with_truncation_and_next_of_a_plain_field():
    kw = dict(capacity=17, fields={"state": ((3,), np.float64), "reward": ((), np.float64), "a": ((), np.int8)},
              next_of=("state",), n_step=3, gamma=0.9, seed=5)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(3)
    for t in range(70):
        term = rng.random() < 0.1
        trunc = (rng.random() < 0.15) and not term
        _both(host, tier, "add", state=rng.standard_normal(3), next_state=rng.standard_normal(3),
              reward=rng.standard_normal(), a=np.int8(t % 100), terminated=term, truncated=trunc)
        if t % 5 == 4:
            _check(host, tier, n=1, b=8, seed=t)
    _check(host, tier)


@pytest.mark.parametrize("rdt", [np.float16, np.float64, np.int32])
def test_n_step_reward_of_every_dtype(rdt):
    kw = dict(capacity=19, fields={"obs": ((2,), np.float32), "reward": ((), rdt)}, n_step=3, gamma=0.5, seed=1)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(4)
    for t in range(40):
        _both(host, tier, "add", obs=rng.standard_normal(2).astype(np.float32),
              next_obs=rng.standard_normal(2).astype(np.float32), reward=rdt(t % 7),
              terminated=bool(t % 11 == 10))
    _check(host, tier)


DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]


def test_fields_of_every_dtype_and_shape():
    fields = {}
    for i, dt in enumerate(DTYPES):
        for j, shape in enumerate([(), (1,), (3, 2)]):  # (0,) is refused by the config, both paths
            fields[f"f{i}_{j}"] = (shape, dt)
    host, tier = _pair(capacity=13, fields=fields, seed=2)
    rng = np.random.default_rng(5)
    for t in range(30):
        step = {}
        for name, (shape, dt) in fields.items():
            v = rng.integers(0, 100, shape)
            if np.dtype(dt).kind == "b":
                v = v % 2 == 0
            step[name] = np.asarray(v).astype(dt) if np.dtype(dt).kind != "c" else (v + 1j * v).astype(dt)
        step["f7_0"] = np.int64(-2**63 + t)  # extremes travel exactly
        step["f8_0"] = np.uint64(2**64 - 1 - t)
        _both(host, tier, "add", **step)
    _check(host, tier)


def test_big_endian_field_dtype():
    """A big-endian field: the tier's tensors are native (torch has no byte order), the values the host's,
    and what the host path's to_torch gives."""
    kw = dict(capacity=9, fields={"x": ((2,), ">i4"), "y": ((), ">f8")}, seed=0)
    host, tier = _pair(**kw)
    for t in range(12):
        _both(host, tier, "add", x=np.array([t, -t], ">i4"), y=np.array(t * 1.5, ">f8"))
    for _ in range(3):
        a, b = host.sample(6), tier.sample(6)
        ta = a.to_torch()
        for k in a:
            np.testing.assert_array_equal(_np(b[k]), a[k])
            assert _np(b[k]).dtype == a[k].dtype.newbyteorder("=") == _np(ta[k]).dtype


def test_compression_with_frames_expiring_from_a_small_budget():
    kw = dict(capacity=40, fields={"obs": ((3, 8, 8), np.uint8), "a": ((), np.int64), "reward": ((), np.float32)},
              frame_stack=3,
              compression="zstd", compression_budget=1, n_step=2, seed=7)
    try:  # the smallest budget the rule takes (issue 33: one that keeps a transition of frames that do not compress)
        bigper.PrioritizedReplayBuffer(**kw).close()
    except bigper.InvalidArgumentError as e:
        kw["compression_budget"] = int(str(e).split("compression_budget=")[-1].split()[0])
    host, tier = _pair(**kw)
    rng = np.random.default_rng(6)
    for t in range(400):
        start = t == 0 or end
        if start:
            obs = np.repeat(rng.integers(0, 255, (1, 8, 8), dtype=np.uint8), 3, axis=0)
        f = rng.integers(0, 255, (1, 8, 8), dtype=np.uint8) if rng.random() < 0.5 else obs[-1:]  # dedupe
        nxt = np.concatenate([obs[1:], f])
        end = rng.random() < 0.05
        _both(host, tier, "add", obs=obs, next_obs=nxt, a=t, reward=np.float32(t % 5), terminated=end)
        obs = nxt
        if t % 37 == 0:
            _check(host, tier, n=1, b=8, seed=t)
    _check(host, tier, n=6, b=16)


def test_rank_prioritization_after_many_updates():
    kw = dict(capacity=31, fields={"obs": ((2, 2), np.uint8)}, frame_stack=2, prioritization="rank", seed=9)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(7)
    obs = rng.integers(0, 9, (2, 2), dtype=np.uint8)
    for t in range(100):
        nxt = np.concatenate([obs[1:], rng.integers(0, 9, (1, 2), dtype=np.uint8)])
        _both(host, tier, "add", obs=obs, next_obs=nxt)
        obs = nxt
        if t % 9 == 8:
            _check(host, tier, n=2, b=10, seed=t)


@pytest.mark.parametrize("k", [None, 1, 4])
def test_sequences_with_burn_in_and_padding_at_every_position(k):
    length = 5
    fields = {"obs": (((k, 2, 2) if k else (2, 2)), np.uint8), "r": ((), np.float32)}
    kw = dict(capacity=29, fields=fields, frame_stack=k, sequence=bigper.Sequence(length, burn_in=2, period=1),
              seed=4)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(8)
    eps = [1, 2, 3, 4, 5, 6, 1, 1, 7, 2, 9, 3, 1, 4]  # episodes end at every position of a window
    t = 0
    for n in eps * 3:
        obs = np.repeat(rng.integers(1, 255, (1, 2, 2), dtype=np.uint8), k, axis=0) if k else \
            rng.integers(1, 255, (2, 2), dtype=np.uint8)
        for i in range(n):
            if k:
                nxt = np.concatenate([obs[1:], rng.integers(1, 255, (1, 2, 2), dtype=np.uint8)])
            else:
                nxt = rng.integers(1, 255, (2, 2), dtype=np.uint8)
            _both(host, tier, "add", obs=obs, next_obs=nxt, r=np.float32(t), terminated=i == n - 1)
            obs = nxt
            t += 1
        _check(host, tier, n=1, b=6, seed=t)
    _check(host, tier, n=5, b=12)


def test_load_state_round_trip_and_an_older_state():
    kw = dict(capacity=20, fields={"obs": ((2, 3), np.uint8), "a": ((), np.int64), "reward": ((), np.float64)},
              frame_stack=2, n_step=2,
              seed=1)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(9)

    def fill(n):
        for t in range(n):
            obs = rng.integers(0, 9, (2, 3), dtype=np.uint8)
            nxt = np.concatenate([obs[1:], rng.integers(0, 9, (1, 3), dtype=np.uint8)])
            _both(host, tier, "add", obs=obs, next_obs=nxt, a=t, reward=float(t), terminated=t % 7 == 6)

    fill(25)
    _check(host, tier, n=2)
    for buf in (host, tier):
        buf.load_state(*buf.state_dict())
    _check(host, tier, n=2)
    old_h, old_t = _state(host), _state(tier)
    fill(9)
    _check(host, tier, n=2)
    host.load_state(eval(old_h[0]), old_h[1])  # an older state over newer data: both paths the same
    tier.load_state(eval(old_t[0]), old_t[1])
    _check(host, tier, n=3)
    fill(30)
    _check(host, tier, n=3)


def test_resume_after_close_then_more_adds(tmp_path):
    kw = dict(capacity=16, fields={"obs": ((2, 2), np.uint8)}, frame_stack=2, storage="memmap", seed=2)
    rng = np.random.default_rng(10)
    steps = []
    for t in range(60):
        obs = rng.integers(0, 9, (2, 2), dtype=np.uint8)
        steps.append(dict(obs=obs, next_obs=np.concatenate([obs[1:], obs[:1] + 1]), terminated=t % 5 == 4))
    for name, dev in (("h", None), ("t", "cpu")):
        b = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / name, device=dev)
        for s in steps[:37]:
            b.add(**s)
        b.sample(4)
        b.close()
    host = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "h", mode="resume")
    tier = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "t", mode="resume", device="cpu")
    _check(host, tier, n=2)
    for s in steps[37:]:
        _both(host, tier, "add", **s)
    _check(host, tier, n=3)
    host.close()
    tier.close()


def test_snapshots_load_latest_takes_device(tmp_path):
    kw = dict(capacity=16, fields={"x": ((2,), np.float32)}, storage="memmap", path=tmp_path / "live")
    buf = bigper.PrioritizedReplayBuffer(**kw)
    for t in range(10):
        buf.add(x=np.full(2, t, np.float32))
    snaps = bigper.Snapshots(tmp_path / "snaps", keep=2)
    snaps.save(buf)
    buf.close()
    loaded = snaps.load_latest(path=tmp_path / "l", device="cpu")
    assert isinstance(loaded.sample(3)["x"], torch.Tensor)
    loaded.close()


def _write_d4rl(path, n=30):
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["observations"] = rng.standard_normal((n, 3)).astype(np.float32)
        f["actions"] = rng.standard_normal((n, 2)).astype(np.float32)
        f["rewards"] = rng.standard_normal(n).astype(np.float32)
        f["next_observations"] = rng.standard_normal((n, 3)).astype(np.float32)
        term = np.zeros(n, bool)
        term[9] = term[25] = True
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)


def test_from_hdf5_takes_device(tmp_path):
    _write_d4rl(tmp_path / "d.h5")
    host = bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "d.h5", priorities=tmp_path / "p1")
    tier = bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "d.h5", priorities=tmp_path / "p2", device="cpu")
    _check(host, tier, n=3, b=5)
    host.close()
    tier.close()


# -- device= values -----------------------------------------------------------------------


def _ls(p):
    return sorted(str(x.relative_to(p)) for x in p.rglob("*"))


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, "nonsense", [], object(), 1.0, "mps", "xla", -1, True])
def test_bad_device_values_refused_by_name_nothing_on_disk_path_usable(tmp_path, device):
    if CUDA and device in ("cuda", "cuda:0", 0):
        pytest.skip("a valid device here")
    before = _ls(tmp_path)
    kw = dict(capacity=8, fields={"x": ((), np.float32)}, storage="memmap", path=tmp_path / "p")
    with pytest.raises(bigper.InvalidArgumentError, match="device"):
        bigper.PrioritizedReplayBuffer(**kw, device=device)
    assert _ls(tmp_path) == before
    buf = bigper.PrioritizedReplayBuffer(**kw)  # the same path, no StorageLockedError
    buf.add(x=np.float32(1))
    buf.close()


def test_a_device_type_whose_backend_is_missing_is_an_invalid_argument(tmp_path):
    kw = dict(capacity=8, fields={"x": ((), np.float32)}, storage="memmap", path=tmp_path / "p")
    with pytest.raises(bigper.InvalidArgumentError, match="device"):
        bigper.PrioritizedReplayBuffer(**kw, device="hpu")
    assert not (tmp_path / "p").exists()


def test_meta_device_is_refused():
    with pytest.raises(bigper.InvalidArgumentError, match="meta"):
        buf = bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.float32)}, device="meta")
        buf.add(x=np.float32(1))
        buf.sample(2)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_good_device_spellings_are_taken(device):
    buf = bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.float32)}, device=device)
    buf.add(x=np.float32(2))
    assert float(_np(buf.sample(2)["x"])[0]) == 2.0


def test_load_with_an_unusable_device_makes_nothing_and_the_path_stays_usable(tmp_path):
    kw = dict(capacity=8, fields={"x": ((), np.float32)}, storage="memmap", path=tmp_path / "live")
    buf = bigper.PrioritizedReplayBuffer(**kw)
    for t in range(5):
        buf.add(x=np.float32(t))
    buf.save(tmp_path / "snap")
    buf.close()
    before = _ls(tmp_path)
    with pytest.raises(bigper.InvalidArgumentError, match="device"):
        bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "new", device="mps")
    assert _ls(tmp_path) == before  # the live copy at "new" is not left behind
    again = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "new")
    assert len(again) == 5
    again.close()


# -- sizes ----------------------------------------------------------------------------------


def test_need_does_not_overflow_on_huge_shapes(tmp_path):
    from bigper.device.mirror import need

    assert need({"x": ((2**40, 2**40), np.float64)}, 10, None) == 11 * 2**80 * 8
    assert need({}, 10, (2**62, (2**3, 2**3), np.uint8)) == (2**62 + 1) * 64


@pytest.mark.parametrize("capacity,shape", [(2**40, (1,)), (2**20, (84, 84, 4, 1024))])
def test_sizes_past_memory_are_refused_naming_the_bytes(tmp_path, capacity, shape):
    kw = dict(capacity=capacity, fields={"x": (shape, np.uint8)}, storage="memmap", path=tmp_path / "p")
    try:
        with pytest.raises(bigper.InvalidArgumentError, match=r"\d+ bytes"):
            bigper.PrioritizedReplayBuffer(**kw, device="cpu")
    except AssertionError:
        raise
    assert not (tmp_path / "p").exists()


def test_a_field_whose_bytes_overflow_int64_is_refused_naming_the_real_bytes(tmp_path):
    shape = (2**32, 2**32)
    with pytest.raises(bigper.InvalidArgumentError) as e:
        bigper.PrioritizedReplayBuffer(capacity=2, fields={"x": (shape, np.uint8)}, storage="memmap",
                                       path=tmp_path / "p", device="cpu")
    assert str(3 * 2**64) in str(e.value), str(e.value)
    assert not (tmp_path / "p").exists()


def test_frames_past_memory_are_refused_naming_the_bytes(tmp_path):
    kw = dict(capacity=2**24, fields={"obs": ((4, 2048, 2048), np.uint8)}, frame_stack=4, storage="memmap",
              path=tmp_path / "p")
    with pytest.raises(bigper.InvalidArgumentError, match=r"\d+ bytes"):
        bigper.PrioritizedReplayBuffer(**kw, device="cpu")
    assert not (tmp_path / "p").exists()


# -- to_torch -------------------------------------------------------------------------------


def _batch(data, b):
    return bigper.Batch(data, np.arange(b, dtype=np.int64), np.ones(b), np.full(b, 1.0 / max(b, 1)),
                        np.zeros(b, np.int64))


def test_to_torch_of_odd_arrays():
    base = np.arange(6 * 4, dtype=np.int32).reshape(6, 4)
    ro = base.copy()
    ro.flags.writeable = False
    data = {"ro": ro, "be": base.astype(">i4"), "neg": base[::-1], "nc": base[:, ::2],
            "zero": np.zeros((6, 0), np.float32), "bool": base % 2 == 0, "c": (base + 1j).astype(np.complex64)}
    b = _batch(data, 6)
    t = b.to_torch()
    for k, v in data.items():
        assert _np(t[k]).dtype == v.dtype.newbyteorder("="), k
        np.testing.assert_array_equal(_np(t[k]), v, err_msg=k)
    t["ro"] += 1  # a read-only array is copied, never written
    np.testing.assert_array_equal(ro, base)
    empty = _batch({"x": np.zeros((0, 3), np.float32)}, 0)
    te = empty.to_torch()
    assert te["x"].shape == (0, 3) and te["indices"].shape == (0,)


@pytest.mark.parametrize("dev", [None, "cpu"])
def test_scribbling_on_to_torch_indices_does_not_redirect_the_update(dev):
    ref = _filled(None)
    buf = _filled(dev)
    b, r = buf.sample(8), ref.sample(8)
    t = b.to_torch()
    t["indices"].zero_()  # a learner's in-place op on its own tensors
    t["generations"].zero_()
    t["weights"].mul_(0)
    p = np.linspace(1, 5, 8)
    buf.update_priorities(t, torch.from_numpy(p))
    ref.update_priorities(r, p)
    _same_state(_state(ref), _state(buf))
    np.testing.assert_array_equal(b.indices, r.indices)


def test_writing_into_cpu_tensors_never_reaches_the_stored_data():
    for dev in (None, "cpu"):
        buf = bigper.PrioritizedReplayBuffer(capacity=32, fields={"obs": ((3, 2, 2), np.uint8), "a": ((), np.int64),
                                                                   "v": ((2,), np.float32)},
                                             frame_stack=3, device=dev, seed=0)
        rng = np.random.default_rng(0)
        obs = rng.integers(0, 200, (3, 2, 2), dtype=np.uint8)
        for t in range(40):
            nxt = np.concatenate([obs[1:], rng.integers(0, 200, (1, 2, 2), dtype=np.uint8)])
            buf.add(obs=obs, next_obs=nxt, a=t, v=np.full(2, t, np.float32))
            obs = nxt
        b = buf.sample(16)
        ref = {k: v.copy() for k, v in buf.gather(b.indices).items()}
        t = b.to_torch()
        idx = b.indices.copy()
        for k, v in t.items():
            if k in ("indices", "generations"):
                continue  # (those are the batch's own: see the test above)
            if v.dtype == torch.bool:
                v.logical_not_()
            else:
                v.add_(1)
        got = buf.gather(idx)
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=(dev, k))
        # A second look at the same slots: the state is as before.
        x = buf.gather(idx)
        np.testing.assert_array_equal(x["obs"], ref["obs"])


def test_a_held_cpu_tensor_is_not_overwritten_by_later_samples():
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((4, 3, 3), np.uint8)}, frame_stack=4, seed=0)
    rng = np.random.default_rng(1)
    obs = rng.integers(0, 200, (4, 3, 3), dtype=np.uint8)
    for t in range(80):
        nxt = np.concatenate([obs[1:], rng.integers(0, 200, (1, 3, 3), dtype=np.uint8)])
        buf.add(obs=obs, next_obs=nxt)
        obs = nxt
    b = buf.sample(16)
    t = b.to_torch()
    want = {k: v.clone() for k, v in t.items()}
    idx = b.indices.copy()
    del b
    gc.collect()
    for _ in range(20):
        buf.sample(16).to_torch()
    for k in want:
        assert torch.equal(t[k], want[k]), k
    np.testing.assert_array_equal(buf.gather(idx)["obs"], want["obs"].numpy())


def test_tier_to_torch_results_are_independent_dicts():
    buf = bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.float32)}, device="cpu")
    for t in range(8):
        buf.add(x=np.float32(t))
    b = buf.sample(4)
    t1 = b.to_torch()
    del t1["weights"]
    t1["x"] = t1["x"] * 0
    t2 = b.to_torch()
    assert "weights" in t2
    np.testing.assert_array_equal(_np(t2["x"]), _np(b["x"]))


def _seq(k=3, length=6, burn_in=2, cap=37, seed=0):
    buf = bigper.PrioritizedReplayBuffer(capacity=cap, fields={"obs": ((k, 2, 3), np.uint8), "r": ((), np.int32)},
                                         frame_stack=k, sequence=bigper.Sequence(length, burn_in=burn_in),
                                         seed=seed)
    rng = np.random.default_rng(seed)
    t = 0
    for n in [1, 2, 3, 5, 8, 13, 1, 4, 6, 2, 9, 7, 1, 1, 3, 11] * 3:  # wraps the ring several times
        obs = np.repeat(rng.integers(1, 255, (1, 2, 3), dtype=np.uint8), k, axis=0)
        for i in range(n):
            nxt = np.concatenate([obs[1:], rng.integers(1, 255, (1, 2, 3), dtype=np.uint8)])
            buf.add(obs=obs, next_obs=nxt, r=np.int32(t), terminated=i == n - 1)
            obs = nxt
            t += 1
    return buf


@pytest.mark.parametrize("k,length,burn_in", [(1, 1, 0), (2, 4, 3), (3, 6, 2), (4, 2, 0)])
def test_frames_once_path_equals_materialized_stacks(k, length, burn_in):
    """What to_torch does for a CUDA device (the distinct frames travel, the stacks are rebuilt
    by one gather) run on the CPU, against the materialized stacks of a twin buffer."""
    a, b = _seq(k, length, burn_in), _seq(k, length, burn_in)
    for _ in range(8):
        want = a.sample(16)
        got = b._sample_for(16, "cuda", {})  # the batch a sampler bound for CUDA makes: no stacks
        assert "obs" not in got.data
        arrays, derived = transfer.fields_of(got, copies=True)
        out = transfer._derive(torch, transfer.move(torch, arrays, torch.device("cpu")), derived)
        for name in want:
            np.testing.assert_array_equal(_np(out[name]), want[name], err_msg=name)
            assert _np(out[name]).dtype == want[name].dtype
        np.testing.assert_array_equal(_np(out["mask"]), want.mask)


def test_sequence_views_are_the_batch_own():
    buf = _seq()
    b = buf.sample(8)
    ref = buf.gather(b.indices)
    ref = {k: np.array(v, copy=True) for k, v in ref.items()}
    t = b.to_torch()
    t["obs"].add_(3)
    t["next_obs"].add_(5)
    kind, *once = b.transport.frames
    if kind == "frames":  # (the host path keeps the stacks' frame ids instead: nothing to scribble on)
        once[0][...] = 9
    got = buf.gather(b.indices)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


# -- update_priorities with TensorBatch / Batch --------------------------------------------


def _filled(dev=None, n=40, cap=32, **kw):
    buf = bigper.PrioritizedReplayBuffer(capacity=cap, fields={"x": ((2,), np.float32), "a": ((), np.int64)},
                                         device=dev, seed=3, **kw)
    for t in range(n):
        buf.add(x=np.full(2, t, np.float32), a=t)
    return buf


@pytest.mark.parametrize("dev", [None, "cpu"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_priorities_from_tensors_change_nothing(dev, bad):
    buf = _filled(dev)
    b = buf.sample(8)
    before = _state(buf)
    p = torch.ones(8, dtype=torch.float64)
    p[5] = bad
    for target in (b, b.to_torch(), dict(b.to_torch()), b.indices):
        with pytest.raises(bigper.InvalidArgumentError):
            buf.update_priorities(target, p)
        _same_state(before, _state(buf))
    for shape in ((7,), (8, 2), (2, 4), ()):
        with pytest.raises(bigper.InvalidArgumentError):
            buf.update_priorities(b.to_torch(), torch.ones(shape))
        _same_state(before, _state(buf))


@pytest.mark.parametrize("dev", [None, "cpu"])
def test_stale_to_torch_dicts_skip_overwritten_slots(dev):
    ref = _filled(None)
    buf = _filled(dev)
    b, r = buf.sample(8), ref.sample(8)
    t = b.to_torch()
    for x in (buf, ref):
        for s in range(40, 55):  # overwrites about half the ring
            x.add(x=np.full(2, s, np.float32), a=s)
    p = np.linspace(1, 5, 8)
    buf.update_priorities(t, torch.from_numpy(p))
    ref.update_priorities(r, p)
    _same_state(_state(ref), _state(buf))
    # And the mutated dicts: deleting generations or adding keys does not change the target.
    t2 = b.to_torch()
    del t2["generations"]
    t2["extra"] = torch.zeros(3)
    buf.update_priorities(t2, torch.from_numpy(p))
    ref.update_priorities(r, p)
    _same_state(_state(ref), _state(buf))


def test_a_tensor_batch_with_replaced_indices_is_not_silently_redirected():
    ref = _filled(None)
    buf = _filled(None)
    b, r = buf.sample(8), ref.sample(8)
    t = b.to_torch()
    new = torch.arange(8, dtype=torch.int64)
    t["indices"] = new
    p = np.linspace(1, 2, 8)
    try:
        buf.update_priorities(t, torch.from_numpy(p))
    except bigper.InvalidArgumentError:
        return  # a refusal is fine
    # What the dict says: its indices, with its generations (slots whose generation differs are skipped).
    ref.update_priorities({"indices": new.numpy(), "generations": t["generations"].numpy()}, p)
    _same_state(_state(ref), _state(buf))


def test_tier_batches_as_update_targets_equal_host_batches():
    host, tier = _filled(None), _filled("cpu")
    for i in range(6):
        x, y = host.sample(8), tier.sample(8)
        _same(x, y)
        p = np.arange(1, 9, dtype=np.float64) * (i + 1)
        host.update_priorities(x, p)
        tier.update_priorities(y, torch.from_numpy(p))  # the Batch itself, values a CPU tensor
        host.add(x=np.full(2, 100 + i, np.float32), a=100 + i)
        tier.add(x=np.full(2, 100 + i, np.float32), a=100 + i)
    _same_state(_state(host), _state(tier))


# -- threads ----------------------------------------------------------------------------


def _consistent(batch):
    """Every row of a batch of ``_stream`` is one transition: its fields agree."""
    a = _np(batch["a"])
    np.testing.assert_array_equal(_np(batch["x"]), np.stack([a, a], axis=1).astype(np.float32))
    obs, nxt = _np(batch["obs"]), _np(batch["next_obs"])
    np.testing.assert_array_equal(obs[:, -1, 0], (a % 251).astype(np.uint8))
    np.testing.assert_array_equal(nxt[:, -1, 0], ((a + 1) % 251).astype(np.uint8))
    np.testing.assert_array_equal(obs[:, 0, 0], (np.maximum(a - 1, 0) % 251).astype(np.uint8))


def _stream(buf, lo, hi):
    for t in range(lo, hi):
        f = lambda s: np.full((1, 3), s % 251, np.uint8)  # noqa: E731
        buf.add(obs=np.concatenate([f(max(t - 1, 0)), f(t)]), next_obs=np.concatenate([f(t), f(t + 1)]),
                x=np.full(2, t, np.float32), a=t)


def test_every_public_method_from_threads_with_a_prefetching_sampler(tmp_path):
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((2, 3), np.uint8), "x": ((2,), np.float32),
                                                              "a": ((), np.int64)},
                                         frame_stack=2, storage="memmap", path=tmp_path / "live", device="cpu",
                                         seed=1)
    _stream(buf, 0, 40)
    errors = []
    stop = threading.Event()
    count = {"batches": 0}

    def guard(fn):
        def run():
            try:
                fn()
            except bigper.BufferClosedError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        return run

    def learner():
        for t in buf.sampler(8, prefetch=2, device="cpu"):
            _consistent(t)
            buf.update_priorities(t, t["x"][:, 0].double().abs() + 0.5)
            count["batches"] += 1
            if stop.is_set() and count["batches"] > 50:
                break

    def writer():
        t = 40
        while not stop.is_set():
            _stream(buf, t, t + 3)
            t += 3

    def other():
        i = 0
        while not stop.is_set():
            i += 1
            b = buf.sample(4)
            _consistent(b)
            g = buf.gather(b.indices)
            buf.state_dict()
            if i % 7 == 0:
                buf.save(tmp_path / f"snap{i % 3}", ) if not (tmp_path / f"snap{i % 3}").exists() else None
            if i % 5 == 0:
                live = buf.status  # noqa: F841
            assert g["a"].shape == (4,)

    ths = [threading.Thread(target=guard(f)) for f in (learner, writer, other)]
    for th in ths:
        th.start()
    import time
    time.sleep(3)
    stop.set()
    for th in ths:
        th.join(30)
    assert not any(th.is_alive() for th in ths)
    assert not errors, errors
    assert count["batches"] > 0
    buf.close()
    for s in tmp_path.glob("snap*"):
        b = bigper.PrioritizedReplayBuffer.load(s, path=tmp_path / ("l" + s.name), device="cpu")
        _consistent(b.sample(8))
        b.close()


def test_close_from_another_thread_while_sampling_and_adding(tmp_path):
    for rep in range(3):
        buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((2, 3), np.uint8),
                                                                  "x": ((2,), np.float32), "a": ((), np.int64)},
                                             frame_stack=2, storage="memmap", path=tmp_path / f"live{rep}",
                                             device="cpu", seed=1)
        _stream(buf, 0, 40)
        errors = []
        it = buf.sampler(8, prefetch=2, device="cpu")

        def learner():
            try:
                for t in it:
                    _consistent(t)
                    buf.update_priorities(t, torch.ones(8))
            except bigper.BufferClosedError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        def writer():
            try:
                t = 40
                while True:
                    _stream(buf, t, t + 2)
                    t += 2
            except bigper.BufferClosedError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ths = [threading.Thread(target=learner), threading.Thread(target=writer)]
        for th in ths:
            th.start()
        import time
        time.sleep(0.3 + 0.2 * rep)
        buf.close()
        for th in ths:
            th.join(20)
        assert not any(th.is_alive() for th in ths)
        assert not errors, errors
        with pytest.raises(bigper.BufferClosedError):
            buf.add(obs=np.zeros((2, 3), np.uint8), next_obs=np.zeros((2, 3), np.uint8), x=np.zeros(2, np.float32),
                    a=0)
        again = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((2, 3), np.uint8),
                                                                    "x": ((2,), np.float32), "a": ((), np.int64)},
                                               frame_stack=2, storage="memmap", path=tmp_path / f"live{rep}",
                                               mode="resume", device="cpu")
        _consistent(again.sample(8))
        again.close()


def test_a_dropped_tier_buffer_with_a_running_sampler_releases_its_lock(tmp_path):
    kw = dict(capacity=64, fields={"obs": ((2, 3), np.uint8), "x": ((2,), np.float32), "a": ((), np.int64)},
              frame_stack=2, storage="memmap", path=tmp_path / "live", seed=1)
    buf = bigper.PrioritizedReplayBuffer(**kw, device="cpu")
    _stream(buf, 0, 30)
    it = buf.sampler(4, prefetch=2, device="cpu")
    next(it)
    ref = weakref.ref(buf)
    del buf
    import time
    for _ in range(100):  # the sampler's thread may be inside a draw (holding the buffer) for a moment
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.05)
    assert ref() is None
    with pytest.raises(bigper.BufferClosedError):
        for _ in range(10):
            next(it)
    again = bigper.PrioritizedReplayBuffer(**kw, mode="resume", device="cpu")
    assert len(again) > 0
    _consistent(again.sample(8))
    again.close()


FORK = textwrap.dedent("""
    import os, sys, numpy as np, bigper
    buf = bigper.PrioritizedReplayBuffer(capacity=16, fields={"x": ((2,), np.float32)}, storage="memmap",
                                         path=sys.argv[1], device={dev!r})
    for t in range(10):
        buf.add(x=np.full(2, t, np.float32))
    buf.sample(3)
    pid = os.fork()
    if pid == 0:
        try:
            b = buf.sample(3)
            print("child-sample", type(b).__name__, flush=True)
        except bigper.BigperError as e:
            print("child-sample-refused", type(e).__name__, flush=True)
        try:
            buf.add(x=np.zeros(2, np.float32))
            print("child-add-ok", flush=True)
        except bigper.BigperError as e:
            print("child-add-refused", type(e).__name__, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    buf.add(x=np.ones(2, np.float32))
    print("parent", len(buf), flush=True)
    buf.close()
""")


def test_fork_after_creating_a_tier_buffer_behaves_like_the_host_path(tmp_path):
    outs = []
    for dev in (None, "cpu"):
        code = FORK.replace("{dev!r}", repr(dev))
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"p{dev}")], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1], outs


# -- CUDA: deferred updates and the pinned paths (skipped without a GPU) -------------------


@needs_cuda
def test_cuda_deferred_update_after_the_target_batch_slots_are_overwritten():
    ref = _filled(None)
    buf = _filled("cuda")
    b, r = buf.sample(8), ref.sample(8)
    t = b.to_torch()
    torch.cuda._sleep(5_000_000)
    p = np.linspace(1, 5, 8)
    buf.update_priorities(t, torch.from_numpy(p).cuda())  # in flight
    ref.update_priorities(r, p)  # the same order: the next call (an add) applies the update first
    for x in (buf, ref):
        for s in range(40, 60):
            x.add(x=np.full(2, s, np.float32), a=s)
    _same_state(_state(ref), _state(buf))


@needs_cuda
def test_cuda_deferred_raw_indices_are_applied_before_an_overwrite():
    ref = _filled(None)
    buf = _filled(None)
    p = np.linspace(1, 5, 8)
    idx = np.arange(8)
    torch.cuda._sleep(5_000_000)
    buf.update_priorities(idx, torch.from_numpy(p).cuda())
    ref.update_priorities(idx, p)
    for x in (buf, ref):
        for s in range(40, 44):
            x.add(x=np.full(2, s, np.float32), a=s)
    _same_state(_state(ref), _state(buf))


@needs_cuda
def test_cuda_many_deferred_updates_in_flight_keep_their_values():
    """More updates in flight than the pinned pool's depth, each with distinct values."""
    ref = _filled(None)
    buf = _filled(None)
    torch.cuda._sleep(20_000_000)
    for i in range(20):
        p = np.full(4, 1.0 + i)
        idx = np.arange(4) + i
        buf.update_priorities(idx, torch.from_numpy(p).cuda())
        ref.update_priorities(idx, p)
    _same_state(_state(ref), _state(buf))


@needs_cuda
def test_cuda_invalid_deferred_update_does_not_break_len():
    buf = _filled(None)
    b = buf.sample(8)
    bad = torch.full((8,), float("nan"), device="cuda")
    buf.update_priorities(b.to_torch("cuda"), bad)
    n = len(buf)  # a read: reports nothing of another call
    assert n == 32


@needs_cuda
def test_cuda_tier_every_dtype():
    fields = {f"f{i}": ((3,), dt) for i, dt in enumerate(DTYPES)}
    host = bigper.PrioritizedReplayBuffer(capacity=9, fields=fields, seed=0)
    tier = bigper.PrioritizedReplayBuffer(capacity=9, fields=fields, seed=0, device="cuda")
    for t in range(12):
        step = {n: np.full(3, t % 2 if np.dtype(dt).kind == "b" else t).astype(dt) for n, (_, dt) in fields.items()}
        host.add(**step)
        tier.add(**step)
    for _ in range(3):
        _same(host.sample(5), tier.sample(5))


# -- deferred updates, driven on the CPU ------------------------------------------------------
# A tensor that says it lives on another device: update_priorities defers it exactly as a CUDA
# tensor (bigper/device/deferred.py), minus the event; so order, errors, close and threads are
# attacked here without a GPU.


class _OnDevice(torch.Tensor):
    @property
    def device(self):
        return torch.device("xla")


def _dev(p):
    return torch.as_tensor(np.asarray(p)).as_subclass(_OnDevice)


def test_fake_device_tensors_take_the_deferred_path():
    buf = _filled(None)
    b = buf.sample(8)
    buf.update_priorities(b, _dev(np.ones(8) * 3))
    assert len(buf._guard.deferred) == 1


def test_repr_after_an_invalid_deferred_update_does_not_raise():
    buf = _filled(None)
    b = buf.sample(8)
    bad = np.ones(8)
    bad[2] = np.nan
    buf.update_priorities(b, _dev(bad))
    assert "PrioritizedReplayBuffer" in repr(buf)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_invalid_deferred_update_changes_nothing_and_is_reported_once(bad):
    buf = _filled(None)
    b = buf.sample(8)
    before = _state(buf)
    p = np.ones(8)
    p[5] = bad
    buf.update_priorities(b, _dev(p))
    with pytest.raises(bigper.InvalidArgumentError, match="not applied"):
        buf.sample(4)
    _same_state(before, _state(buf))  # the failed sample drew nothing, the update changed nothing
    buf.sample(4)


def test_an_invalid_deferred_update_does_not_end_a_running_sampler():
    buf = _filled("cpu")
    it = buf.sampler(8, prefetch=2, device="cpu")
    t = next(it)
    bad = np.ones(8)
    bad[0] = np.nan
    raised = 0
    try:
        buf.update_priorities(t, _dev(bad))
    except bigper.InvalidArgumentError:
        raised += 1
    got = 0
    for _ in range(10):  # a learner's loop: the error reaches its next call, the sampler goes on
        try:
            t = next(it)
            got += 1
            buf.update_priorities(t, np.ones(8))
        except bigper.InvalidArgumentError:
            raised += 1
    assert raised == 1 and got == 10, (raised, got)
    it.close()


def test_deferred_and_immediate_updates_keep_their_order():
    ref, buf = _filled(None), _filled(None)
    rng = np.random.default_rng(0)
    for i in range(30):
        x, y = ref.sample(8), buf.sample(8)
        np.testing.assert_array_equal(x.indices, y.indices)
        p = np.abs(rng.standard_normal(8)) + 0.1
        q = np.abs(rng.standard_normal(8)) + 0.1
        ref.update_priorities(x, p)
        ref.update_priorities(x.indices, q)
        if i % 2:
            buf.update_priorities(y.to_torch(), _dev(p))
            buf.update_priorities(y.indices, q)  # immediate after deferred: the deferred one first
        else:
            buf.update_priorities(y, p)
            buf.update_priorities(y.indices, _dev(q))
        if i % 3 == 0:
            for z in (ref, buf):
                z.add(x=np.full(2, 50 + i, np.float32), a=50 + i)
        if i % 5 == 0:
            for z in (ref, buf):
                z.assign_priorities(np.linspace(0.5, 2, 32))
    _same_state(_state(ref), _state(buf))


def test_deferred_updates_pending_at_close_and_at_gc_are_recorded(tmp_path):
    kw = dict(capacity=32, fields={"x": ((2,), np.float32), "a": ((), np.int64)}, storage="memmap", seed=3)
    ref = _filled(None)
    r = ref.sample(8)
    p = np.linspace(1, 4, 8)
    ref.update_priorities(r, p)
    for how in ("close", "gc"):
        buf = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / how)
        for t in range(40):
            buf.add(x=np.full(2, t, np.float32), a=t)
        b = buf.sample(8)
        buf.update_priorities(b, _dev(p))
        assert buf._guard.deferred
        if how == "close":
            buf.close()
        else:
            del buf, b
            gc.collect()
        again = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / how, mode="resume")
        np.testing.assert_array_equal(again.state_dict()[1]["leaves"], ref.state_dict()[1]["leaves"], err_msg=how)
        again.close()


def test_deferred_updates_from_a_learner_thread_with_a_sampler_and_a_writer(tmp_path):
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((2, 3), np.uint8), "x": ((2,), np.float32),
                                                              "a": ((), np.int64)},
                                         frame_stack=2, storage="memmap", path=tmp_path / "live", device="cpu",
                                         seed=1)
    _stream(buf, 0, 40)
    errors = []
    it = buf.sampler(8, prefetch=2, device="cpu")

    def learner():
        try:
            for _ in range(150):
                t = next(it)
                _consistent(t)
                buf.update_priorities(t, _dev(t["x"][:, 0].double().abs() + 0.5))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def writer():
        try:
            for s in range(40, 200, 2):
                _stream(buf, s, s + 2)
                if s % 20 == 0:
                    buf.save(tmp_path / f"snap{s}")
                if s % 30 == 0:
                    with buf._guard.lock:  # (atomically: see _op)
                        buf.load_state(*_copy_state(buf.state_dict()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=learner), threading.Thread(target=writer)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    it.close()
    assert not errors, errors
    assert np.isfinite(buf.total_priority) and not buf._guard.deferred
    buf.close()


def _copy_state(state):
    meta, arrays = state
    return meta, {k: np.array(v, copy=True) for k, v in arrays.items()}


def test_deferred_sequence_updates_with_a_mask_equal_the_host():
    kw = dict(capacity=37, fields={"obs": ((3, 2, 3), np.uint8), "r": ((), np.int32)}, frame_stack=3,
              sequence=bigper.Sequence(6, burn_in=2))
    a, b = _seq(), _seq()
    rng = np.random.default_rng(3)
    for i in range(10):
        x, y = a.sample(8), b.sample(8)
        p = np.abs(rng.standard_normal(x.mask.shape if i % 2 else (8,))) + 0.1
        a.update_priorities(x, p)
        b.update_priorities(y.to_torch(), _dev(p))
    _same_state(_state(a), _state(b))


def test_deferred_update_shapes_refused_at_once_like_the_immediate_path():
    buf = _filled(None)
    b = buf.sample(8)
    before = _state(buf)
    for shape in ((7,), (8, 2), (1, 8), (), (8, 1, 1)):
        try:
            buf.update_priorities(b, np.ones(shape))
            immediate = None
        except bigper.BigperError as e:
            immediate = type(e)
        if immediate is None:
            buf.update_priorities(b, _dev(np.ones(shape)))
            continue
        with pytest.raises(immediate):
            buf.update_priorities(b, _dev(np.ones(shape)))
        assert not buf._guard.deferred
    buf.sample(2)
    assert before is not None


def test_deferred_update_to_a_closed_buffer_is_refused():
    buf = _filled(None)
    b = buf.sample(8)
    buf.close()
    with pytest.raises(bigper.BufferClosedError):
        buf.update_priorities(b, _dev(np.ones(8)))


def test_meta_priorities_are_a_bigper_error():
    buf = _filled(None)
    b = buf.sample(8)
    with pytest.raises(bigper.BigperError):
        buf.update_priorities(b, torch.ones(8, device="meta"))


# -- devices a batch or a sampler is asked for -------------------------------------------------


@pytest.mark.skipif(CUDA, reason="needs a torch without CUDA")
def test_to_torch_cuda_without_cuda_is_an_invalid_argument():
    buf = _filled(None)
    with pytest.raises(bigper.InvalidArgumentError, match="CUDA"):
        buf.sample(4).to_torch("cuda")


def test_sampler_with_a_bad_device_is_refused_at_once():
    buf = _filled(None)
    with pytest.raises(bigper.InvalidArgumentError, match="device"):
        it = buf.sampler(4, device="nonsense")
        next(it)


SCRIPT_NO_CLOSE = textwrap.dedent("""
    import sys, numpy as np, bigper
    buf = bigper.PrioritizedReplayBuffer(capacity=16, fields={"obs": ((2, 3), np.uint8)}, frame_stack=2,
                                         storage=sys.argv[2], path=sys.argv[1], device=sys.argv[3] or None, seed=1)
    for t in range(21):
        buf.add(obs=np.full((2, 3), t, np.uint8), next_obs=np.full((2, 3), t + 1, np.uint8), terminated=t % 6 == 5)
    it = buf.sampler(4, prefetch=0, device="cpu")  # (a prefetching one would draw a racy number of batches)
    next(it)
    buf.sample(3)
""")


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_script_ending_without_close_leaves_a_tier_buffer_that_resumes(tmp_path, storage):
    outs = []
    for dev in ("", "cpu"):
        p = subprocess.run([sys.executable, "-c", SCRIPT_NO_CLOSE, str(tmp_path / f"p{dev}"), storage, dev],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert p.returncode == 0, p.stderr
        buf = bigper.PrioritizedReplayBuffer(capacity=16, fields={"obs": ((2, 3), np.uint8)}, frame_stack=2,
                                             storage=storage, path=tmp_path / f"p{dev}", mode="resume",
                                             device=dev or None, seed=1)
        outs.append(buf)
    _check(outs[0], outs[1], n=3, b=4)
    for b in outs:
        b.close()


# -- the mirror's sync in small chunks, big extends, other storages -----------------------------


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_sync_in_tiny_chunks_with_extends_past_capacity(tmp_path, monkeypatch, storage):
    from bigper.device import mirror

    monkeypatch.setattr(mirror, "CHUNK", 3)
    monkeypatch.setattr(mirror, "PROGRESS_ROWS", 0)  # the progress bar on every rebuild
    kw = dict(capacity=11, fields={"obs": ((2, 2), np.uint8), "a": ((), np.int64), "reward": ((), np.float32)},
              frame_stack=2, n_step=2, num_envs=2, seed=6, storage=storage)
    if storage != "memory":
        host = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "h")
        tier = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "t", device="cpu")
    else:
        host, tier = _pair(**kw)
    rng = np.random.default_rng(11)
    for r in range(12):
        n = int(rng.integers(1, 30))  # up to almost 3x the capacity at once
        obs = rng.integers(0, 250, (n, 2, 2, 2), dtype=np.uint8)
        nxt = np.concatenate([obs[:, :, 1:], rng.integers(0, 250, (n, 2, 1, 2), dtype=np.uint8)], axis=2)
        data = {"obs": obs, "next_obs": nxt, "a": rng.integers(0, 99, (n, 2)),
                "reward": rng.standard_normal((n, 2)).astype(np.float32),
                "terminated": rng.random((n, 2)) < 0.1}
        _both(host, tier, "extend", data)
        _check(host, tier, n=1, b=7, seed=r)
        if r == 6:
            tier.load_state(*_copy_state(tier.state_dict()))  # a rebuild in tiny chunks
            host.load_state(*_copy_state(host.state_dict()))
    if storage != "memory":
        host.close()
        tier.close()


def test_sample_arguments_on_the_tier():
    host, tier = _pair(capacity=20, fields={"x": ((2,), np.float64)}, seed=4, weight_norm="batch",
                       beta=bigper.LinearSchedule(0.2, 1.0, 10))
    for t in range(25):
        _both(host, tier, "add", x=np.full(2, t * 0.5))
    for kw in ({}, {"beta": 0.7}, {"stratified": False}, {"beta": 1.0, "stratified": False}):
        _same(host.sample(9, **kw), tier.sample(9, **kw))
    assert host.beta == tier.beta


@needs_cuda
def test_cuda_to_torch_of_odd_arrays():
    base = np.arange(6 * 4, dtype=np.int32).reshape(6, 4)
    ro = base.copy()
    ro.flags.writeable = False
    data = {"ro": ro, "be": base.astype(">i4"), "neg": base[::-1], "nc": base[:, ::2],
            "bool": base % 2 == 0, "c": (base + 1j).astype(np.complex64), "h": base.astype(np.float16),
            "u64": base.astype(np.uint64)}
    t = _batch(data, 6).to_torch("cuda")
    for k, v in data.items():
        np.testing.assert_array_equal(_np(t[k]), v, err_msg=k)
    e = _batch({"x": np.zeros((0, 3), np.float32)}, 0).to_torch("cuda")
    assert e["x"].shape == (0, 3) and e["x"].is_cuda


@needs_cuda
def test_cuda_sampler_batches_read_on_the_learners_side_stream():
    """The sampler's thread copies on its own (default) stream; a learner on a side stream reads the
    batch there. Its data must be the host batch's even when the default stream is busy."""
    ref = _filled(None)
    buf = _filled("cuda")
    s = torch.cuda.Stream()
    torch.cuda._sleep(200_000_000)  # the default stream busy for a while
    it = buf.sampler(8, prefetch=1, device="cuda")
    with torch.cuda.stream(s):  # a batch is ready on the stream that is current when next() takes it
        t = next(it)
        got = t["x"].clone()
    s.synchronize()
    want = ref.sample(8)
    np.testing.assert_array_equal(got.cpu().numpy(), want["x"])
    it.close()


@needs_cuda
def test_cuda_deferred_update_recorded_on_a_side_stream():
    ref, buf = _filled(None), _filled(None)
    rng = np.random.default_rng(0)
    s = torch.cuda.Stream()
    for _ in range(10):
        x, y = ref.sample(8), buf.sample(8)
        p = np.abs(rng.standard_normal(8)) + 0.1
        with torch.cuda.stream(s):
            torch.cuda._sleep(2_000_000)
            td = torch.from_numpy(p).to("cuda", non_blocking=True) * 1.0  # made on s, behind the sleep
            buf.update_priorities(y.to_torch("cuda"), td)
        ref.update_priorities(x, p)
    _same_state(_state(ref), _state(buf))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16])
def test_cuda_deferred_update_of_other_dtypes_equals_the_host(dtype):
    ref, buf = _filled(None), _filled(None)
    x, y = ref.sample(8), buf.sample(8)
    p = torch.arange(8).remainder(2 if dtype == torch.bool else 8).to(dtype)
    ref.update_priorities(x, p)
    buf.update_priorities(y.to_torch("cuda"), p.cuda())
    _same_state(_state(ref), _state(buf))


@needs_cuda
def test_cuda_tier_sequences_equal_the_host():
    a = _seq()
    b = bigper.PrioritizedReplayBuffer(capacity=37, fields={"obs": ((3, 2, 3), np.uint8), "r": ((), np.int32)},
                                       frame_stack=3, sequence=bigper.Sequence(6, burn_in=2), seed=0, device="cuda")
    rng = np.random.default_rng(0)
    t = 0
    for n in [1, 2, 3, 5, 8, 13, 1, 4, 6, 2, 9, 7, 1, 1, 3, 11] * 3:
        obs = np.repeat(rng.integers(1, 255, (1, 2, 3), dtype=np.uint8), 3, axis=0)
        for i in range(n):
            nxt = np.concatenate([obs[1:], rng.integers(1, 255, (1, 2, 3), dtype=np.uint8)])
            b.add(obs=obs, next_obs=nxt, r=np.int32(t), terminated=i == n - 1)
            obs = nxt
            t += 1
    for _ in range(5):
        _same(a.sample(8), b.sample(8))


@pytest.mark.parametrize("dev", [None, "cpu"])
@pytest.mark.parametrize("kind", ["nstep", "sequence", "frames"])
def test_a_held_batch_is_not_changed_by_later_samples(dev, kind):
    """Every array or tensor of a batch the learner still holds stays as it was drawn (no scratch
    array of a later draw, no reused output array, no mirror row written since)."""
    if kind == "sequence":
        buf = _seq() if dev is None else None
        if buf is None:
            buf = bigper.PrioritizedReplayBuffer(capacity=37, fields={"obs": ((3, 2, 3), np.uint8),
                                                                      "r": ((), np.int32)},
                                                 frame_stack=3, sequence=bigper.Sequence(6, burn_in=2), seed=0,
                                                 device="cpu")
            _feed_seq(buf)
    else:
        kw = dict(capacity=23, fields={"obs": ((2, 3), np.uint8), "reward": ((), np.float32), "a": ((), np.int64)},
                  frame_stack=2, n_step=3 if kind == "nstep" else 1, seed=2, device=dev)
        buf = bigper.PrioritizedReplayBuffer(**kw)
        _feed(buf, 0, 30)
    b = buf.sample(8)
    t = b.to_torch()
    held_b = {k: _np(v).copy() for k, v in b.items()}
    held_t = {k: v.clone() for k, v in t.items()}
    meta = (b.indices.copy(), _np(b.weights).copy(), b.generations.copy(),
            None if b.mask is None else _np(b.mask).copy())  # (a tier batch's weights and mask: tensors)
    for i in range(12):
        x = buf.sample(8)
        x.to_torch()
        if kind != "sequence":
            _feed(buf, 30 + i * 5, 35 + i * 5)
    for k in held_b:
        np.testing.assert_array_equal(_np(b[k]), held_b[k], err_msg=k)
    for k in held_t:
        assert torch.equal(t[k], held_t[k]), k
    np.testing.assert_array_equal(b.indices, meta[0])
    np.testing.assert_array_equal(_np(b.weights), meta[1])
    np.testing.assert_array_equal(b.generations, meta[2])
    if meta[3] is not None:
        np.testing.assert_array_equal(_np(b.mask), meta[3])


def _feed(buf, lo, hi):
    for t in range(lo, hi):
        f = lambda s: np.full((1, 3), s % 251, np.uint8)  # noqa: E731
        buf.add(obs=np.concatenate([f(t - 1), f(t)]), next_obs=np.concatenate([f(t), f(t + 1)]),
                reward=np.float32(t), a=t, terminated=t % 7 == 6)


def _feed_seq(buf, seed=0, k=3):
    rng = np.random.default_rng(seed)
    t = 0
    for n in [1, 2, 3, 5, 8, 13, 1, 4, 6, 2, 9, 7, 1, 1, 3, 11] * 3:
        obs = np.repeat(rng.integers(1, 255, (1, 2, 3), dtype=np.uint8), k, axis=0)
        for i in range(n):
            nxt = np.concatenate([obs[1:], rng.integers(1, 255, (1, 2, 3), dtype=np.uint8)])
            buf.add(obs=obs, next_obs=nxt, r=np.int32(t), terminated=i == n - 1)
            obs = nxt
            t += 1


_OPS = ["add", "extend", "sample", "sampler", "update", "update_deferred", "save", "state_dict", "load_state",
        "gather", "assign"]


def _op(buf, name, tmp_path, i, rng):
    if name == "add":
        _stream(buf, 100 + i, 101 + i)
    elif name == "extend":
        t = 1000 + 3 * i
        f = lambda s: np.full((3, 1, 3), s[:, None, None] % 251, np.uint8)  # noqa: E731
        s = np.arange(t, t + 3)
        buf.extend({"obs": np.concatenate([f(s - 1), f(s)], axis=1), "next_obs": np.concatenate([f(s), f(s + 1)], axis=1),
                    "x": np.stack([s, s], axis=1).astype(np.float32), "a": s})
    elif name == "sample":
        _consistent(buf.sample(4))
    elif name == "sampler":
        it = buf.sampler(4, prefetch=1, device="cpu")
        _consistent(next(it))
        it.close()
    elif name == "update":
        b = buf.sample(4)
        buf.update_priorities(b, rng.random(4) + 0.1)
    elif name == "update_deferred":
        b = buf.sample(4)
        buf.update_priorities(b.to_torch(), _dev(rng.random(4) + 0.1))
    elif name == "save":
        p = tmp_path / f"s{threading.get_ident()}-{i}"
        buf.save(p)
    elif name == "state_dict":
        buf.state_dict()
    elif name == "load_state":
        # (atomically: a state taken before another thread's adds describes data those adds overwrote,
        # on the host path as on the tier; load_state cannot tell)
        with buf._guard.lock:
            buf.load_state(*_copy_state(buf.state_dict()))
    elif name == "gather":
        g = buf.gather(np.arange(4))
        assert g["a"].shape == (4,)
    elif name == "assign":
        buf.assign_priorities(rng.random(64) + 0.1)


@pytest.mark.parametrize("pair", [(a, b) for i, a in enumerate(_OPS) for b in _OPS[i:]], ids=lambda p: "-".join(p))
def test_two_threads_any_two_methods_on_a_tier_buffer(tmp_path, pair):
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((2, 3), np.uint8), "x": ((2,), np.float32),
                                                              "a": ((), np.int64)},
                                         frame_stack=2, storage="memmap", path=tmp_path / "live", device="cpu",
                                         seed=1)
    _stream(buf, 0, 40)
    errors = []
    import time
    # (0.15 s of both threads at once, each call made at least once however late its thread starts:
    # hundreds to thousands of overlapping calls per pair here, a new sampler 1-5 against a busy one,
    # as at 0.25 s; over 66 pairs the longer window was CI time)
    end = time.monotonic() + 0.15

    def run(name, seed):
        rng = np.random.default_rng(seed)
        i = 0
        try:
            while i == 0 or (time.monotonic() < end and i < (3 if name == "save" else 10**6)):
                _op(buf, name, tmp_path, i, rng)
                i += 1
        except Exception as e:  # noqa: BLE001
            errors.append((name, e))

    ths = [threading.Thread(target=run, args=(n, s)) for s, n in enumerate(pair)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert not errors, errors
    for _ in range(3):
        _consistent(buf.sample(8))
    assert np.isfinite(buf.total_priority) and not buf._guard.deferred
    buf.close()
    again = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((2, 3), np.uint8), "x": ((2,), np.float32),
                                                                "a": ((), np.int64)},
                                           frame_stack=2, storage="memmap", path=tmp_path / "live", mode="resume",
                                           device="cpu")
    _consistent(again.sample(8))
    again.close()


def test_bigper_info_names_the_device_memory_a_tier_needs(tmp_path):
    from bigper.device.mirror import need
    from bigper.frames.store import frame_capacity

    b = bigper.PrioritizedReplayBuffer(capacity=100, fields={"obs": ((4, 8, 8), np.uint8)}, frame_stack=4,
                                       storage="memmap", path=tmp_path / "live")
    for _ in range(10):
        b.add(obs=np.zeros((4, 8, 8), np.uint8), next_obs=np.zeros((4, 8, 8), np.uint8))
    b.close()
    nbytes = need({}, 100, (frame_capacity(100, 4, 1), (8, 8), np.uint8))
    p = subprocess.run([sys.executable, "-m", "bigper", "info", str(tmp_path / "live")], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert p.returncode == 0, p.stderr
    assert "device" in p.stdout and (f"{nbytes:,}" in p.stdout or str(nbytes) in p.stdout), p.stdout


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_read_only_open_with_a_tier_makes_no_file_and_equals_the_host(tmp_path, storage):
    kw = dict(capacity=16, fields={"obs": ((2, 3), np.uint8), "x": ((2,), np.float32), "a": ((), np.int64)},
              frame_stack=2, storage=storage, seed=1)
    w = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "live")
    _stream(w, 0, 30)
    w.close()
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    host = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "live", mode="resume", read_only=True)
    tier = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "live", mode="resume", read_only=True, device="cpu")
    for _ in range(3):
        _same(host.sample(8), tier.sample(8))
    host.close()
    tier.close()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("num_envs", [1, 3])
def test_one_step_episodes_with_distinct_reset_frames(compression, num_envs):
    """Every step is an episode whose obs stack holds k distinct frames: k + 1 new frames a transition,
    far past the ring's 1.6% room for episode starts."""
    k = 4
    kw = dict(capacity=16, fields={"obs": ((k, 3, 3), np.uint8), "a": ((), np.int64)}, frame_stack=k,
              num_envs=num_envs, compression=compression, seed=2)
    host, tier = _pair(**kw)
    rng = np.random.default_rng(12)
    lead = (num_envs,) if num_envs > 1 else ()
    for t in range(80):
        obs = rng.integers(0, 255, (*lead, k, 3, 3), dtype=np.uint8)
        nxt = np.concatenate([obs[..., 1:, :, :], rng.integers(0, 255, (*lead, 1, 3, 3), dtype=np.uint8)], axis=-3)
        _both(host, tier, "add", obs=obs, next_obs=nxt, a=np.full(lead, t) if lead else t,
              terminated=np.ones(lead, bool) if lead else True)
        if t % 5 == 0:
            _check(host, tier, n=1, b=6, seed=t)
    _check(host, tier, n=4, b=12)
    b = tier.sample(12)
    g = tier.gather(b.indices)
    np.testing.assert_array_equal(_np(b["obs"]), g["obs"])
    np.testing.assert_array_equal(_np(b["next_obs"]), g["next_obs"])


@pytest.mark.parametrize("next_of", [(), ("obs",), ("obs", "r"), ("r",)])
def test_sequences_with_other_next_of(next_of):
    k = 2
    kw = dict(capacity=29, fields={"obs": ((k, 2, 3), np.uint8), "r": ((2,), np.int32)}, frame_stack=k,
              sequence=bigper.Sequence(4, burn_in=1), next_of=next_of, seed=3)
    host, tier = _pair(**kw)
    twin = bigper.PrioritizedReplayBuffer(**kw)
    rng = np.random.default_rng(13)
    t = 0
    for n in [1, 3, 2, 7, 1, 5, 4, 9, 2, 1] * 3:
        obs = np.repeat(rng.integers(1, 255, (1, 2, 3), dtype=np.uint8), k, axis=0)
        for i in range(n):
            nxt = np.concatenate([obs[1:], rng.integers(1, 255, (1, 2, 3), dtype=np.uint8)])
            step = dict(obs=obs, r=np.array([t, -t], np.int32), terminated=i == n - 1)
            if "obs" in next_of:
                step["next_obs"] = nxt
            if "r" in next_of:
                step["next_r"] = np.array([t + 1, -t - 1], np.int32)
            for b in (host, tier, twin):
                b.add(**step)
            obs = nxt
            t += 1
    for _ in range(4):
        want = host.sample(8)
        _same(want, tier.sample(8))
        got = twin._sample_for(8, "cuda", {})  # the frames-once path, rebuilt on the CPU
        arrays, derived = transfer.fields_of(got, copies=True)
        out = transfer._derive(torch, transfer.move(torch, arrays, torch.device("cpu")), derived)
        assert set(out) >= set(want)
        for name in want:
            np.testing.assert_array_equal(_np(out[name]), want[name], err_msg=name)


def test_sb3_drop_in_over_a_tier_buffer():
    pytest.importorskip("stable_baselines3")
    gym = pytest.importorskip("gymnasium")
    from bigper.integrations.sb3 import PrioritizedReplayBuffer as SB3Buffer

    obs_space = gym.spaces.Box(0, 1, (3,), np.float32)
    act_space = gym.spaces.Discrete(4)
    core = bigper.PrioritizedReplayBuffer(capacity=16, fields={"obs": ((3,), "<f4"), "action": ((1,), "<i8"),
                                                               "reward": ((), "<f4")}, device="cpu")
    for t in range(10):
        core.add(obs=np.full(3, t, np.float32), next_obs=np.full(3, t + 1, np.float32), action=np.array([t % 4]),
                 reward=np.float32(t))
    try:
        rb = SB3Buffer.from_buffer(core, obs_space, act_space, device="cpu")
    except bigper.InvalidArgumentError:
        return  # a refusal naming the tier is fine
    s = rb.sample(4)
    np.testing.assert_array_equal(_np(s.next_observations)[:, 0], _np(s.observations)[:, 0] + 1)


def test_deferred_sequence_update_shapes_agree_with_the_immediate_path():
    buf = _seq()
    b = buf.sample(8)
    T_ = b.mask.shape[1]
    items = hook.unit(buf).items
    for shape in ((8,), (8, 1), (8, T_), (8, items.length), (8, items.T), (8, T_ - 1), (8, T_ + 1), (8, 2),
                  (8, T_, 1)):
        try:
            buf.update_priorities(b, np.ones(shape))
            immediate = None
        except bigper.BigperError as e:
            immediate = type(e)
        if immediate is None:
            buf.update_priorities(b, _dev(np.ones(shape)))
            buf.sample(2)  # applied without a late error
            continue
        with pytest.raises(immediate):
            buf.update_priorities(b, _dev(np.ones(shape)))
        assert not buf._guard.deferred, shape
