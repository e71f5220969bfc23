"""More hostile use of Batch.to_jax and jax.Array priorities: values at dtype
limits (with jax_enable_x64 off), batches of a closed buffer, two threads
converting and updating at once."""

import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import bigper  # noqa: E402
from bigper.batch import Batch  # noqa: E402
from tests.buffer.test_validation import assert_same, fingerprint  # noqa: E402

B = 8


def make(**kw):
    buf = bigper.PrioritizedReplayBuffer(32, {"x": ((2,), np.float32), "a": ((), np.int32)}, seed=5, **kw)
    for t in range(40):
        buf.add(x=np.full(2, t, np.float32), a=t % 3, terminated=t % 9 == 8)
    return buf


def one(f):
    n = len(f)
    return Batch({"f": f}, np.arange(n), np.ones(n, np.float32), np.ones(n), np.zeros(n, np.int64))


@pytest.mark.parametrize("vals,dtype", [
    ([np.iinfo(np.int32).max, np.iinfo(np.int32).min], np.int64),
    ([np.iinfo(np.uint32).max, 0], np.uint64),
    ([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float64),
    ([np.finfo(np.float16).max, np.finfo(np.float16).tiny], np.float16),
    ([np.nan, np.inf], np.float64),
])
def test_to_jax_keeps_values_at_the_edge_of_the_32_bit_range(vals, dtype):
    a = np.array(vals, dtype)
    j = np.asarray(one(a).to_jax()["f"])
    np.testing.assert_array_equal(j.astype(np.float64) if a.dtype.kind == "f" else j, a)


@pytest.mark.parametrize("vals,dtype", [([np.iinfo(np.int32).max + 1], np.int64),
                                        ([np.iinfo(np.int32).min - 1], np.int64),
                                        ([2**32], np.uint64), ([np.finfo(np.float64).max], np.float64),
                                        ([-3.5e38], np.float64)])
def test_to_jax_refuses_values_32_bits_cannot_hold(vals, dtype):
    with pytest.raises(bigper.InvalidArgumentError, match="'?f'? holds"):
        one(np.array(vals, dtype)).to_jax()


# (This was a strict xfail: _canonical refused a float64 that becomes inf in float32 but let a
# nonzero one (1e-300, a subnormal) silently become 0.0.)
@pytest.mark.parametrize("vals,dtype", [([1e-300, 0.5], np.float64), ([0.5, 5e-324], np.float64),
                                        ([-1e-200], np.float64), ([0.7e-45 * 0.99], np.float64),
                                        ([1 + 1e-300j], np.complex128), ([1e-300 + 1j], np.complex128)])
def test_to_jax_refuses_a_nonzero_float64_that_float32_holds_as_0(vals, dtype):
    b = one(np.array(vals, dtype))
    with pytest.raises(bigper.InvalidArgumentError, match="'?f'? holds .* as 0 "):
        b.to_jax()


@pytest.mark.parametrize("vals,dtype", [([np.finfo(np.float32).smallest_subnormal, -0.0, 0.0], np.float64),
                                        ([0.7e-45 * 1.01], np.float64), ([1e-40 + 0j, 0j], np.complex128)])
def test_to_jax_keeps_float64_that_float32_holds_nonzero_or_that_is_0(vals, dtype):
    a = np.array(vals, dtype)
    j = np.asarray(one(a).to_jax()["f"])
    assert ((j != 0) == (a != 0)).all(), (j, a)
    np.testing.assert_array_equal(j, a.astype(j.dtype))  # (numpy's own rounding to 32 bits)


@pytest.mark.parametrize("p", [np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45,
                               float(np.finfo(np.float16).max)])
def test_jax_priorities_at_float32_limits_like_numpy(p):
    a, b = make(), make()
    s = a.sample(B)
    b.sample(B)
    outcomes = []
    for buf, prio in ((a, np.full(B, p, np.float32)), (b, jnp.full(B, p, jnp.float32))):
        before = fingerprint(buf)
        try:
            buf.update_priorities(s.indices, prio)
            outcomes.append(("ok", float(buf.total_priority)))
        except bigper.BigperError as e:
            assert_same(before, fingerprint(buf))
            outcomes.append((type(e).__name__, None))
    assert outcomes[0] == outcomes[1], outcomes


def test_to_jax_of_a_batch_from_a_closed_memmap_buffer(tmp_path):
    buf = make(storage="memmap", path=tmp_path / "r")
    b = buf.sample(B)
    want = {k: np.array(b[k]) for k in b.data}
    buf.close()
    j = b.to_jax()
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(j[k]), v)
    with pytest.raises(bigper.BufferClosedError):
        buf.update_priorities(j, jnp.ones(B))


def test_to_jax_of_a_batch_after_the_buffer_is_deleted(tmp_path):
    import gc
    import shutil
    buf = make(storage="memmap", path=tmp_path / "r")
    b = buf.sample(B)
    want = {k: np.array(b[k]) for k in b.data}
    buf.close()
    del buf
    gc.collect()
    shutil.rmtree(tmp_path / "r")
    j = b.to_jax()
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(j[k]), v)


def test_two_threads_to_jax_and_update_priorities():
    buf = make()
    errors = []
    batches = [buf.sample(B) for _ in range(4)]

    def converter():
        try:
            for i in range(200):
                j = batches[i % 4].to_jax()
                assert np.asarray(j["x"]).shape == (B, 2)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def updater():
        try:
            for i in range(200):
                s = buf.sample(B)
                buf.update_priorities(s.to_jax(), jnp.full(B, 0.5 + (i % 7), jnp.float32))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=converter), threading.Thread(target=updater)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert np.isfinite(buf.total_priority)
