"""Hostile input at the JAX surface: every refusal names what it refuses and leaves the buffer exactly
as it was (a full fingerprint before and after); every accepted jax.Array does what the same values in
numpy do, bit for bit. Real JAX throughout."""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
ml_dtypes = pytest.importorskip("ml_dtypes")

import bigper  # noqa: E402
from bigper.tensors import jax as J  # noqa: E402
from bigper.batch import Batch  # noqa: E402
from tests.buffer.test_validation import assert_same, fingerprint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
B = 8


@pytest.fixture(autouse=True)
def _on_jax_cpu():
    """Arrays on JAX's CPU device, whatever the default one: these cases hold jax.Arrays to what numpy's
    values do, read in place and checked at the call. On a GPU (a GPU JAX's default device) values are
    copied to the host without blocking and checked by the next call that needs the tree, as CUDA
    tensors are (``update_priorities``'s docstring; tests/device/test_hostile_device.py's deferred cases)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def make(**kw):
    buf = bigper.PrioritizedReplayBuffer(32, {"x": ((2,), np.float32), "a": ((), np.int32)}, seed=5,
                                         beta=bigper.LinearSchedule(0.4, 1.0, 10), **kw)
    for t in range(40):
        buf.add(x=np.full(2, t, np.float32), a=t % 3, terminated=t % 9 == 8)
    buf.update_priorities(np.array([1, 2, 3]), np.array([3.0, 0.5, 7.0]))
    return buf


def refused(buf, target, priorities, err=bigper.InvalidArgumentError):
    """The call raises ``err``; the buffer is exactly as before. Returns the message."""
    before = fingerprint(buf)
    with pytest.raises(err) as info:
        buf.update_priorities(target, priorities)
    assert_same(before, fingerprint(buf))
    return str(info.value)


def _leaves(buf):
    return np.array(buf.state_dict()[1]["leaves"])


# -- every dtype: the same as numpy, or the same refusal ------------------------------------------

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32,
          jnp.uint32, jnp.bool_]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_accepted_like_numpy(dtype):
    buf, twin = make(), make()
    b, bt = buf.sample(B), twin.sample(B)
    vals = np.arange(B) % 2 if dtype == jnp.bool_ else np.arange(B) + 1
    x = jnp.asarray(vals, dtype=dtype)
    buf.update_priorities(b, x)
    host = np.asarray(x)
    twin.update_priorities(bt, host.astype(np.float32) if host.dtype.kind == "V" else host)
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int16, jnp.int32, jnp.float16, jnp.bfloat16, jnp.float32])
def test_negative_values_of_every_signed_dtype_refused_like_numpy(dtype):
    buf, twin = make(), make()
    b, bt = buf.sample(B), twin.sample(B)
    vals = np.ones(B)
    vals[5] = -3
    msg = refused(buf, b, jnp.asarray(vals, dtype))
    host = np.asarray(jnp.asarray(vals, dtype))
    msg_np = refused(twin, bt, host.astype(np.float32) if host.dtype.kind == "V" else host)
    assert msg == msg_np and "position 5" in msg


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_non_finite_refused_like_numpy(bad, dtype):
    buf, twin = make(), make()
    b, bt = buf.sample(B), twin.sample(B)
    vals = np.ones(B, np.float32)
    vals[B - 1] = bad
    msg = refused(buf, b, jnp.asarray(vals, dtype))
    assert msg == refused(twin, bt, vals)


def test_64_bit_dtypes_with_x64_on_like_numpy():
    """int64, uint64 (the largest included) and float64 priorities exist only with jax_enable_x64."""
    code = """
        import numpy as np, jax, jax.numpy as jnp, bigper
        from tests.device.test_hostile_jax import make, _leaves, refused, B
        for dtype, vals in ((jnp.uint64, [2**64 - 1] + [1] * (B - 1)), (jnp.int64, list(range(B))),
                            (jnp.float64, [1e300] * B)):
            buf, twin = make(), make()
            b, bt = buf.sample(B), twin.sample(B)
            x = jnp.asarray(np.array(vals, dtype=np.dtype(dtype)))
            assert x.dtype == dtype
            buf.update_priorities(b, x)
            twin.update_priorities(bt, np.array(vals, dtype=np.dtype(dtype)))
            assert np.array_equal(_leaves(buf), _leaves(twin)), dtype
        buf, twin = make(), make()
        b, bt = buf.sample(B), twin.sample(B)
        neg = np.arange(B, dtype=np.int64) - 3
        assert refused(buf, b, jnp.asarray(neg)) == refused(twin, bt, neg)
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu", BIGPER_THREADS="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# -- shapes, kinds, dead arrays -----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (B - 1,), (B + 1,), (B, 2), (1, B), (0,), (B, 1, 1)])
def test_wrong_shapes_refused_like_numpy(shape):
    buf, twin = make(), make()
    b, bt = buf.sample(B), twin.sample(B)
    msg = refused(buf, b, jnp.ones(shape, jnp.float32))
    assert msg == refused(twin, bt, np.ones(shape, np.float32))


def test_complex_and_key_arrays_refused():
    buf = make()
    b = buf.sample(B)
    assert "numbers" in refused(buf, b, jnp.ones(B, jnp.complex64), bigper.InvalidTypeError)
    keys = jax.random.split(jax.random.key(0), B)
    assert "key" in refused(buf, b, keys, bigper.InvalidTypeError)


def test_deleted_and_donated_arrays_refused_by_name():
    buf = make()
    b = buf.sample(B)
    x = jnp.ones(B)
    x.delete()
    assert "deleted or donated" in refused(buf, b, x)
    y = jnp.ones(B)
    jax.jit(lambda v: v * 2, donate_argnums=0)(y)
    if not y.is_deleted():  # pragma: no cover - a backend that does not donate
        pytest.skip("this JAX backend did not donate the buffer")
    assert "deleted or donated" in refused(buf, b, y)
    j = b.to_jax()
    j["indices"].delete()  # the dict's host copies stand for its indices: the update is still exact
    twin = make()
    bt = twin.sample(B)
    buf.update_priorities(j, jnp.full(B, 2.0))
    twin.update_priorities(bt, np.full(B, 2.0))
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))
    idx = jnp.asarray(b.indices)
    idx.delete()
    assert "indices" in refused(buf, idx, jnp.ones(B))


def test_traced_values_refused_by_name():
    buf = make()
    b = buf.sample(B)
    before = fingerprint(buf)
    msgs = []

    @jax.jit
    def step(td):
        try:
            buf.update_priorities(b, td)
        except bigper.InvalidTypeError as e:
            msgs.append(str(e))
        return td

    step(jnp.ones(B))
    assert msgs and "traced" in msgs[0]
    assert_same(before, fingerprint(buf))


def test_bad_jax_indices_refused_like_numpy():
    buf, twin = make(), make()
    for idx in ([0, 1, 99], [-1, 0, 1], [0.5, 1.0, 2.0]):
        x = jnp.asarray(idx)
        msg = refused(buf, x, jnp.ones(3), bigper.InvalidArgumentError)
        assert msg == refused(twin, np.asarray(x), np.ones(3), bigper.InvalidArgumentError)


def test_a_changed_to_jax_dict_is_read_as_it_is():
    buf = make()
    b = buf.sample(B)
    j = b.to_jax()
    j["indices"] = jnp.arange(B - 1)  # replaced: the dict is read as given, and it no longer matches
    refused(buf, j, jnp.ones(B))


def test_to_jax_of_hostile_batches():
    ok = Batch({"x": np.arange(6, dtype=">f4")[::-2], "ro": np.frombuffer(bytes(12), np.int32)},
               np.arange(3), np.ones(3, np.float32), np.ones(3), np.zeros(3, np.int64))
    j = ok.to_jax()  # byte-swapped, negative strides, read-only: each copied once, values kept
    np.testing.assert_array_equal(np.asarray(j["x"]), ok["x"])
    np.testing.assert_array_equal(np.asarray(j["ro"]), ok["ro"])
    for bad in (np.array(["a", "b", "c"]), np.array([object()] * 3), np.zeros(3, "M8[s]")):
        b = Batch({"f": bad}, np.arange(3), np.ones(3, np.float32), np.ones(3), np.zeros(3, np.int64))
        with pytest.raises(bigper.InvalidTypeError, match="'f'"):
            b.to_jax()
    big = Batch({"f": np.array([1, 2**40])}, np.arange(2), np.ones(2, np.float32), np.ones(2),
                np.zeros(2, np.int64))
    with pytest.raises(bigper.InvalidArgumentError, match=r"f holds 1099511627776.*jax_enable_x64"):
        big.to_jax()
    empty = Batch({"f": np.zeros((0, 3), np.float32)}, np.zeros(0, np.int64), np.ones(0, np.float32),
                  np.ones(0), np.zeros(0, np.int64))
    assert empty.to_jax()["f"].shape == (0, 3)


# -- devices, threads, a closed buffer -----------------------------------------------------------

def test_arrays_on_another_device():
    code = """
        import numpy as np, jax, jax.numpy as jnp, bigper
        from tests.device.test_hostile_jax import make, _leaves, B
        dev = jax.devices()[1]
        buf, twin = make(), make()
        b, bt = buf.sample(B), twin.sample(B)
        j = b.to_jax(dev)
        buf.update_priorities(j, jax.device_put(jnp.full(B, 4.0), dev))  # a host device: read at once
        assert len(buf._guard.deferred) == 0
        twin.update_priorities(bt, np.full(B, 4.0))
        buf.update_priorities(jax.device_put(jnp.asarray(b.indices), dev), jax.device_put(jnp.ones(B), dev))
        twin.update_priorities(bt.indices, np.ones(B))
        assert np.array_equal(_leaves(buf), _leaves(twin))
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", BIGPER_THREADS="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_two_threads_sample_convert_and_update_at_once():
    buf = make()
    errors = []
    halves = (np.arange(0, 16), np.arange(16, 32))

    def work(k):
        try:
            for i in range(60):
                b = buf.sample(B)
                j = b.to_jax()
                buf.update_priorities(j, jnp.abs(j["x"][:, 0]) + 1.0)
                buf.update_priorities(jnp.asarray(halves[k]), jnp.full(16, float(k + 1)))
                if i % 10 == 0:
                    jax.tree_util.tree_map(jnp.asarray, b)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    leaves = _leaves(buf)
    assert np.isclose(buf.total_priority, leaves.sum())
    # Each slot holds the last value written to it, by either thread: its half's constant or the
    # batch value of its transition (|x| + 1), never anything else.
    slots = np.arange(32)
    x = np.where(slots < 8, slots + 32, slots).astype(np.float64)  # the transition each slot holds
    cand = []
    for vals in (np.where(slots < 16, 1.0, 2.0), x + 1.0):
        twin = make()
        twin.update_priorities(slots, vals)
        cand.append(_leaves(twin))
    assert ((leaves == cand[0]) | (leaves == cand[1])).all(), (leaves, cand)


def test_buffer_closed_between_sample_and_update(tmp_path):
    buf = make(storage="memmap", path=tmp_path / "r")
    b = buf.sample(B)
    j = b.to_jax()
    td = jnp.full(B, 9.0)
    before = fingerprint(buf)
    buf.close()
    with pytest.raises(bigper.BufferClosedError):
        buf.update_priorities(j, td)
    with pytest.raises(bigper.BufferClosedError):
        buf.update_priorities(jax.tree_util.tree_map(jnp.asarray, b), td)
    np.testing.assert_array_equal(np.asarray(b.to_jax()["x"]), b["x"])  # the batch outlives its buffer
    again = bigper.PrioritizedReplayBuffer(32, {"x": ((2,), np.float32), "a": ((), np.int32)}, seed=5,
                                           beta=bigper.LinearSchedule(0.4, 1.0, 10), storage="memmap",
                                           path=tmp_path / "r", mode="resume")
    np.testing.assert_array_equal(_leaves(again), before["state.leaves"])
    again.close()
