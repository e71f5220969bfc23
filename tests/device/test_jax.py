"""Batch.to_jax, Batch as a JAX pytree, and priorities from jax.Array (bigper.tensors.jax), with real JAX.

What needs another JAX device (the one-transfer path, priorities deferred from a device) runs in a
child process with two CPU devices (``--xla_force_host_platform_device_count=2``): the same code a
GPU takes, on the host.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
jnp = jax.numpy

import bigper  # noqa: E402
from bigper.tensors import jax as J  # noqa: E402
from bigper.batch import Batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"obs": ((4, 6, 5), np.uint8), "action": ((), np.int32), "reward": ((), np.float32),
          "aux": ((3,), np.float16)}


def _buffer(fields=FIELDS, **kw):
    buf = bigper.PrioritizedReplayBuffer(64, fields, frame_stack=4, seed=1, **kw)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (200, 6, 5), dtype=np.uint8)
    for t in range(100):
        buf.add(obs=frames[t:t + 4], action=t % 5, reward=np.float32(t), next_obs=frames[t + 1:t + 5],
                aux=np.full(3, t, fields["aux"][1]), terminated=t % 17 == 16, truncated=t % 23 == 22)
    return buf


def _leaves(buf):
    return np.array(buf.state_dict()[1]["leaves"])


def _child(code: str, devices: int = 2, x64: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), BIGPER_THREADS="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _aligned_out(buf, b: int) -> dict:
    """``sample(out=...)`` arrays at 64-byte aligned addresses, one per field."""
    probe = buf.sample(b)
    return {k: J.aligned_empty(v.shape, v.dtype) for k, v in probe.items()}


def test_host_fields_are_shared_not_copied_by_pointer():
    buf = _buffer()
    b = buf.sample(8, out=_aligned_out(buf, 8))
    j = b.to_jax()
    assert list(j) == [*b, "weights", "indices", "generations"]
    for k in b:
        assert j[k].devices() == {jax.devices("cpu")[0]}
        assert j[k].dtype == b[k].dtype and j[k].shape == b[k].shape
        np.testing.assert_array_equal(np.asarray(j[k]), b[k])
        assert j[k].unsafe_buffer_pointer() == b[k].ctypes.data, k  # the jax array is the batch's memory


def test_host_any_array_is_copied_at_most_once_and_exactly_when_documented():
    buf = _buffer()
    b = buf.sample(16)
    j = b.to_jax()
    for k in b:
        a = b[k]
        shared = a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 64 == 0
        assert (j[k].unsafe_buffer_pointer() == a.ctypes.data) == shared, k
        assert j[k].unsafe_buffer_pointer() % 64 == 0  # copies land aligned: XLA shares them in turn
        np.testing.assert_array_equal(np.asarray(j[k]), a)
    # the frame stacks are strided views of one gather: never shared, copied once each
    assert not b["obs"].flags.c_contiguous and j["obs"].unsafe_buffer_pointer() != b["obs"].ctypes.data
    np.testing.assert_array_equal(np.asarray(j["weights"]), b.weights)
    np.testing.assert_array_equal(np.asarray(j["indices"]), b.indices)
    np.testing.assert_array_equal(np.asarray(j["generations"]), b.generations)
    assert j["weights"].dtype == jnp.float32


def test_to_jax_dict_updates_priorities_and_goes_through_jit():
    buf, twin = _buffer(), _buffer()
    b, bt = buf.sample(8), twin.sample(8)
    j = b.to_jax()
    td = jax.jit(lambda d: jnp.abs(d["reward"] - 1.0) + d["weights"] * 0)(j)  # the dict is a pytree
    buf.update_priorities(j, td)
    twin.update_priorities(bt, np.abs(bt["reward"] - 1.0))
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))


def test_64_bit_values_follow_jax_x64_and_a_value_that_would_change_is_refused():
    fields = {"obs": ((3,), np.float64), "action": ((), np.int64)}
    buf = bigper.PrioritizedReplayBuffer(16, fields, seed=0)
    for t in range(10):
        buf.add(obs=np.full(3, t + 0.5), action=t, next_obs=np.full(3, t + 1.5))
    j = buf.sample(4).to_jax()
    assert j["obs"].dtype == jnp.float32 and j["action"].dtype == jnp.int32 and j["indices"].dtype == jnp.int32
    buf.add(obs=np.full(3, 1e300), action=2**40, next_obs=np.zeros(3))
    with pytest.raises(bigper.InvalidArgumentError, match="jax_enable_x64"):
        for _ in range(50):  # until a batch holds the big values
            buf.sample(8).to_jax()


def test_64_bit_values_with_x64_on_are_kept_and_shared():
    out = _child("""
        import numpy as np, jax, bigper
        from bigper.tensors import jax as J
        buf = bigper.PrioritizedReplayBuffer(16, {"obs": ((3,), np.float64), "action": ((), np.int64)}, seed=0)
        for t in range(10):
            buf.add(obs=np.full(3, 1e300), action=2**40 + t, next_obs=np.zeros(3))
        probe = buf.sample(4)
        b = buf.sample(4, out={k: J.aligned_empty(v.shape, v.dtype) for k, v in probe.items()})
        j = b.to_jax()
        assert j["action"].dtype == np.int64 and j["indices"].dtype == np.int64 and j["obs"].dtype == np.float64
        assert all(j[k].unsafe_buffer_pointer() == b[k].ctypes.data for k in b)
        assert (np.asarray(j["action"]) >= 2**40).all()
        print("ok")
    """, devices=1, x64=True)
    assert "ok" in out


def test_one_transfer_to_another_device_with_stacks_rebuilt_there():
    """A second JAX device: one aligned block, one device_put, one jitted unpack; the frames of
    obs/next_obs travel once, sequence stacks are rebuilt from each row's distinct frames."""
    out = _child("""
        import numpy as np, jax, bigper
        from bigper.tensors import jax as J
        dev = jax.devices()[1]
        puts = []
        real = jax.device_put
        def counting(x, device=None, *a, **k):  # counts calls; the real device_put does the work
            puts.append(getattr(x, "nbytes", None))
            return real(x, device, *a, **k)
        jax.device_put = counting
        fields = {"obs": ((4, 6, 5), np.uint8), "action": ((), np.int32), "reward": ((), np.float32)}
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 255, (200, 6, 5), dtype=np.uint8)
        def fill(buf):
            for t in range(100):
                buf.add(obs=frames[t:t + 4], action=t % 5, reward=np.float32(t), next_obs=frames[t + 1:t + 5],
                        terminated=t % 17 == 16)
            return buf
        buf = fill(bigper.PrioritizedReplayBuffer(64, fields, frame_stack=4, seed=1))
        b = buf.sample(8)
        j = b.to_jax(dev)
        assert len(puts) == 1, puts
        # the pair gather (8 rows of 5 frames) travels instead of two stacks of 4
        assert puts[0] < b["obs"].nbytes * 2, (puts, b["obs"].nbytes)
        assert list(j) == [*b, "weights", "indices", "generations"]
        for k in j:
            assert j[k].devices() == {dev}, k
        for k in b:
            np.testing.assert_array_equal(np.asarray(j[k]), b[k], err_msg=k)
        for k in ("weights", "indices", "generations"):
            np.testing.assert_array_equal(np.asarray(j[k]), getattr(b, k))
        assert b.to_jax("cpu:1")["obs"].devices() == {dev}
        seq = fill(bigper.PrioritizedReplayBuffer(64, fields, frame_stack=4, seed=1,
                                                  sequence=bigper.Sequence(length=5, burn_in=2)))
        sb = seq.sample(3)
        puts.clear()
        sj = sb.to_jax(dev)
        assert len(puts) == 1
        assert list(sj) == [*sb, "weights", "indices", "generations", "mask"]
        for k in sb:
            np.testing.assert_array_equal(np.asarray(sj[k]), sb[k], err_msg=k)
        np.testing.assert_array_equal(np.asarray(sj["mask"]), sb.mask)
        seq.update_priorities(sj, jax.numpy.ones((3, 7), jax.numpy.float32))
        print("ok")
    """)
    assert "ok" in out


def test_sequences_on_the_host_with_mask():
    fields = {"obs": ((4, 6, 5), np.uint8), "action": ((), np.int32), "reward": ((), np.float32),
              "aux": ((3,), np.float16)}
    buf = _buffer(fields, sequence=bigper.Sequence(length=5, burn_in=2))
    b = buf.sample(4)
    j = b.to_jax()
    assert list(j) == [*b, "weights", "indices", "generations", "mask"]
    for k in b:
        np.testing.assert_array_equal(np.asarray(j[k]), b[k])
    np.testing.assert_array_equal(np.asarray(j["mask"]), b.mask)
    assert j["mask"].dtype == jnp.bool_
    t = jax.tree_util.tree_map(jnp.asarray, b)
    assert t.burn_in == 2 and isinstance(t.mask, jax.Array)
    twin = _buffer(fields, sequence=bigper.Sequence(length=5, burn_in=2))
    bt = twin.sample(4)
    td = np.arange(4 * 7, dtype=np.float32).reshape(4, 7)
    buf.update_priorities(t, jnp.asarray(td))
    twin.update_priorities(bt, td)
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))


def test_device_tier_batch_goes_through_dlpack_from_torch():
    pytest.importorskip("torch")
    buf = _buffer(device="cpu")
    b = buf.sample(8)
    tensors = b.transport.tensors
    j = b.to_jax()
    assert list(j) == [*b, "weights", "indices", "generations"]
    for k in b:
        np.testing.assert_array_equal(np.asarray(j[k]), b[k].numpy())
        if b[k].is_contiguous() and b[k].data_ptr() % 64 == 0:
            assert j[k].unsafe_buffer_pointer() == tensors[k].data_ptr(), k  # shared through DLPack
    twin = _buffer(device="cpu")
    bt = twin.sample(8)
    buf.update_priorities(j, jnp.full(8, 3.0))
    twin.update_priorities(bt, np.full(8, 3.0))
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))


def test_device_names():
    b = _buffer().sample(2)
    assert b.to_jax("cpu")["obs"].devices() == {jax.devices("cpu")[0]}
    assert b.to_jax(jax.devices()[0])["obs"].devices() == {jax.devices()[0]}
    for bad, match in (("nowhere", "no such backend"), ("cpu:9", "cpu device"), ("cpu:x", "index"),
                       (3, "jax.Device")):
        with pytest.raises(bigper.InvalidArgumentError, match=match):
            b.to_jax(bad)


def test_host_values_of_a_host_array_is_a_view():
    x = jax.device_put(jnp.arange(32, dtype=jnp.float32), jax.devices("cpu")[0])  # (a GPU JAX's default: a GPU)
    a = J.host_values(x)
    assert a.ctypes.data == x.unsafe_buffer_pointer() and not a.flags.writeable
    assert J.host_values(jnp.ones(4, jnp.bfloat16)).dtype == np.float32


def test_priorities_from_jax_match_numpy_bit_for_bit():
    buf, twin = _buffer(), _buffer()
    for step in range(20):
        b, bt = buf.sample(8), twin.sample(8)
        td = np.random.default_rng(step).random(8).astype(np.float32) * 5
        buf.update_priorities(b, jnp.asarray(td))
        twin.update_priorities(bt, td)
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))
    buf.assign_priorities(jnp.arange(64, dtype=jnp.float32))
    twin.assign_priorities(np.arange(64, dtype=np.float32))
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))
    buf.update_priorities(jnp.asarray([1, 2]), jnp.asarray([4.0, 5.0]))  # raw indices, jax too
    twin.update_priorities(np.array([1, 2]), np.array([4.0, 5.0]))
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))


def test_priorities_on_a_device_are_applied_later_in_order_and_survive_deletion():
    """The accelerator path, on a second CPU device counted as one (HOST_PLATFORMS emptied: the
    real deferred path, with real jax arrays)."""
    out = _child("""
        import numpy as np, jax, jax.numpy as jnp, bigper
        from bigper.tensors import jax as J
        J.HOST_PLATFORMS = frozenset()
        dev = jax.devices()[1]
        def make():
            buf = bigper.PrioritizedReplayBuffer(32, {"x": ((2,), np.float32)}, seed=3)
            for t in range(30):
                buf.add(x=np.full(2, t, np.float32))
            return buf
        leaves = lambda buf: np.array(buf.state_dict()[1]["leaves"])
        buf, twin = make(), make()
        for step in range(5):
            b, bt = buf.sample(6), twin.sample(6)
            td = np.random.default_rng(step).random(6).astype(np.float32)
            x = jax.device_put(jnp.asarray(td), dev)
            buf.update_priorities(b.to_jax(dev), x)
            assert len(buf._guard.deferred) == 1  # in flight: the call returned without reading it
            x.delete()                      # the learner may drop or donate it: the host copy is its own
            twin.update_priorities(bt, td)
        buf.sample(2), twin.sample(2)
        assert len(buf._guard.deferred) == 0
        assert np.array_equal(leaves(buf), leaves(twin))
        before = leaves(buf)
        b = buf.sample(6)
        twin.sample(6)
        buf.update_priorities(b, jax.device_put(jnp.full(6, jnp.nan), dev))
        try:
            buf.sample(2)
        except bigper.InvalidArgumentError as e:
            assert "not applied" in str(e) and "nan" in str(e), e
        else:
            raise AssertionError("a NaN update from a device was not reported")
        assert np.array_equal(leaves(buf), before)
        for bad, err in ((jax.device_put(jnp.ones(5), dev), "shape"),
                         (jax.device_put(jnp.ones(6, jnp.complex64), dev), "real numbers")):
            try:
                buf.update_priorities(b, bad)
            except bigper.InvalidArgumentError as e:
                assert err in str(e), e
            else:
                raise AssertionError(err)
        assert len(buf._guard.deferred) == 0 and np.array_equal(leaves(buf), before)
        print("ok")
    """)
    assert "ok" in out


# -- the pytree ---------------------------------------------------------------------------------

def test_pytree_round_trip_and_key_paths():
    buf = _buffer()
    b = buf.sample(4)
    leaves, tree = jax.tree_util.tree_flatten(b)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(back, Batch) and list(back) == list(b) and back.burn_in == b.burn_in
    assert all(back[k] is b[k] for k in b) and back.indices is b.indices and back.mask is None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(b)]
    assert paths == [f"[{k!r}]" for k in b] + [".indices", ".weights", ".probabilities", ".generations"]
    m = jax.tree_util.tree_map(jnp.asarray, b)
    assert isinstance(m, Batch) and all(isinstance(m[k], jax.Array) for k in b)
    # a batch of jax arrays updates priorities like the batch it came from
    twin = _buffer()
    bt = twin.sample(4)
    buf.update_priorities(m, jnp.full(4, 2.0))
    twin.update_priorities(bt, np.full(4, 2.0))
    np.testing.assert_array_equal(_leaves(buf), _leaves(twin))
    assert jax.jit(lambda bb: bb["reward"] * bb.weights)(m).shape == (4,)


_DTYPES = st.sampled_from([np.uint8, np.int32, np.float32, np.float16, np.bool_, np.int8])


@st.composite
def batches(draw):
    n = draw(st.integers(0, 5))
    names = draw(st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), max_size=4, unique=True))
    seq = draw(st.booleans())
    t = draw(st.integers(1, 3)) if seq else None
    data = {}
    for name in names:
        shape = (n, t) if seq else (n,)
        shape += tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        data[name] = np.zeros(shape, draw(_DTYPES)) + draw(st.integers(0, 1))
    mask = np.ones((n, t), bool) if seq else None
    return Batch(data, np.arange(n, dtype=np.int64), np.ones(n, np.float32), np.full(n, 0.5),
                 np.zeros(n, np.int64), mask, draw(st.integers(0, t)) if seq else 0)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_pytree_round_trip_property(b):
    leaves, tree = jax.tree_util.tree_flatten(b)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert list(back) == list(b) and back.burn_in == b.burn_in
    for name in ("indices", "weights", "probabilities", "generations", "mask"):
        assert getattr(back, name) is getattr(b, name)
    assert all(back[k] is b[k] for k in b)
    m = jax.tree_util.tree_map(jnp.asarray, b)
    assert jax.tree_util.tree_structure(m) == tree
    for k in b:
        np.testing.assert_array_equal(np.asarray(m[k]), b[k])
    if b.mask is not None:
        np.testing.assert_array_equal(np.asarray(m.mask), b.mask)


@pytest.mark.parametrize("order", ["jax-first", "bigper-first-then-sample", "batch-before-jax",
                                   "jax-imported-by-another-thread"])
def test_registration_in_every_import_order(order):
    code = {
        "jax-first": """
            import jax, jax.numpy as jnp
            import bigper
            from bigper.batch import Batch
            import numpy as np
            b = Batch({"x": np.ones(2)}, np.arange(2), np.ones(2, np.float32), np.ones(2), np.zeros(2, np.int64))
        """,
        "bigper-first-then-sample": """
            import numpy as np, bigper
            from bigper.batch import Batch
            import jax, jax.numpy as jnp
            b = Batch({"x": np.ones(2)}, np.arange(2), np.ones(2, np.float32), np.ones(2), np.zeros(2, np.int64))
        """,
        "batch-before-jax": """
            import numpy as np, bigper
            from bigper.batch import Batch
            b = Batch({"x": np.ones(2)}, np.arange(2), np.ones(2, np.float32), np.ones(2), np.zeros(2, np.int64))
            import jax, jax.numpy as jnp
            b.to_jax()  # registers (a batch made before jax was loaded, none since)
        """,
        "jax-imported-by-another-thread": """
            import threading, numpy as np, bigper
            from bigper.batch import Batch
            t = threading.Thread(target=lambda: __import__("jax.numpy"))
            t.start()
            while t.is_alive():
                Batch({"x": np.ones(2)}, np.arange(2), np.ones(2, np.float32), np.ones(2), np.zeros(2, np.int64))
            import jax, jax.numpy as jnp
            b = Batch({"x": np.ones(2)}, np.arange(2), np.ones(2, np.float32), np.ones(2), np.zeros(2, np.int64))
        """,
    }[order]
    out = _child(code + """
            m = jax.tree_util.tree_map(jnp.asarray, b)
            assert isinstance(m, Batch) and isinstance(m["x"], jax.Array), type(m)
            print("ok")
    """, devices=1)
    assert "ok" in out


def test_bigper_imports_and_samples_without_jax():
    out = _child("""
        import sys
        sys.modules["jax"] = None  # as if JAX were not installed: any import of it fails
        import numpy as np, bigper
        buf = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32)}, seed=0)
        for t in range(5):
            buf.add(x=np.float32(t))
        b = buf.sample(2)
        buf.update_priorities(b, np.ones(2))
        try:
            b.to_jax()
        except ImportError as e:
            assert "pip install" in str(e), e
        else:
            raise AssertionError("to_jax without jax")
        assert "jax" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
        print("ok")
    """, devices=1)
    assert "ok" in out


def test_jax_is_not_imported_by_bigper():
    out = _child("""
        import sys, numpy as np, bigper
        buf = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32)}, seed=0)
        buf.add(x=np.float32(1))
        buf.update_priorities(buf.sample(2), np.ones(2))
        print(sorted(m for m in sys.modules if m == "jax" or m.startswith("jax.")))
    """, devices=1)
    assert out.strip() == "[]"
