"""Hostile tests of what the refactor added or rewired (attack round atk32):

1. ``buf.shard`` (``core/shardview.py``): ``sample_at``, ``max_leaf``,
   ``min_leaf``, ``raise_max_leaf`` on a view made per access;
2. the sample units (``core/units.py``): transitions and sequences through
   the public API, host and deferred (device-tensor) updates;
3. the storage defaults (``storage/base.py``): a user's storage built on
   ``MemoryStorage`` with ``writable_arrays=None``, ``shared_chunks``,
   ``prepare``, through ``from_parts``;
4. the package move: the CLI, what ``import bigper`` loads, the committed
   fixtures, ``fork()``.

Each test is a limit probed. The round found nine bugs, fixed in the library
since (each test here failed before its fix): ``raise_max_leaf`` took strings
and bools, hid a re-entrant ``close()``'s refusal and ignored ``max_priority``;
a recorded ``max_leaf`` above float max / capacity was accepted; ``sample_at``
parsed strings and complex targets; a ``(B, 1)`` deferred update of a
``length=1`` sequence was refused late; a memory storage without ``arrays``
crashed ``sample``; ``save`` of a storage without arrays crashed (now refused
by name); ``from_parts`` took a storage that is no ``StorageBase``.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import PrioritizedReplayBuffer as PRB
from bigper import Sequence
from bigper.core.layout import allocate
from bigper.core.shardview import ShardView
from bigper.errors import (
    BigperError,
    BufferClosedError,
    CorruptSnapshotError,
    InvalidArgumentError,
    InvalidIndexError,
    InvalidTypeError,
    StorageLockedError,
)
from bigper.common.status import LIVE
from bigper.storage.base import StorageBase
from bigper.storage.memory import MemoryStorage

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
F = {"obs": ((3,), np.float32), "reward": ((), np.float32)}
CAP = 16


# -- helpers ---------------------------------------------------------------------------------------

def _fill(buf, n, start=0, ends=(), prio=True):
    """``n`` steps; with ``prio`` the priorities ``i % 5`` (some zero), else the largest key."""
    for i in range(start, start + n):
        kw = {"priorities": float(i % 5)} if prio else {}
        buf.add(obs=np.full(3, i, np.float32), reward=float(i), next_obs=np.full(3, -i, np.float32),
                terminated=(i in ends), **kw)


def _path(tmp, storage, name="live"):
    return None if storage == "memory" else tmp / (name + (".h5" if storage == "hdf5" else ""))


def _new(tmp=None, storage="memory", cap=CAP, **kw):
    return PRB(cap, F, seed=0, storage=storage, path=_path(tmp, storage), **kw)


def _state(buf):
    meta, arrays = buf.state_dict()
    return copy.deepcopy(meta), {k: np.array(v, copy=True) for k, v in arrays.items()}


def _same_state(a, b):
    assert a[0] == b[0], [k for k in a[0] if a[0][k] != b[0].get(k)]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        np.testing.assert_array_equal(a[1][k], b[1][k], err_msg=k)


def _same_batch(x, y):
    np.testing.assert_array_equal(x.indices, y.indices)
    np.testing.assert_array_equal(x.generations, y.generations)
    np.testing.assert_array_equal(x.weights, y.weights)
    np.testing.assert_array_equal(x.probabilities, y.probabilities)
    assert sorted(x.keys()) == sorted(y.keys())
    for k in x.keys():
        np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]), err_msg=k)


def _same_data(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _key(p, alpha=0.6, eps=1e-6):
    return (p + eps) ** alpha


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# =================================================================================================
# 1. buf.shard
# =================================================================================================

def test_the_view_is_made_per_access_and_is_a_shardview():
    buf = _new()
    _fill(buf, 5)
    a, b = buf.shard, buf.shard
    assert isinstance(a, ShardView) and a is not b
    assert a.max_leaf == b.max_leaf == _key(4.0)
    assert a.min_leaf == _key(0.0)  # the smallest non-zero leaf: priority 0 still has eps


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_a_view_kept_past_close_raises_buffer_closed_on_every_call(tmp_path, storage):
    buf = _new(tmp_path, storage)
    _fill(buf, 20)
    kept = buf.shard
    buf.close()
    for view in (kept, buf.shard):  # kept from before, and taken after the close
        for call in (lambda: view.max_leaf, lambda: view.min_leaf, lambda: view.raise_max_leaf(2.0),
                     lambda: view.sample_at(np.array([0.1]), beta=0.4)):
            with pytest.raises(BufferClosedError):
                call()
    assert len(buf) == CAP and buf.closed  # the readers that answer closed still do


LIMIT = sys.float_info.max / CAP  # the largest key a proportional buffer of CAP keeps


@pytest.mark.parametrize("value, after", [
    (3, 3.0), (np.float32(3.0), 3.0), (np.float64(2.5), 2.5), (np.float16(7.0), 7.0), (np.int64(6), 6.0),
    (np.array(4.0), 4.0),                         # a 0-d array: its number
    (5e-324, None), (1e-300, None), (1.0, None),  # below the largest key: nothing changes
    (LIMIT, LIMIT),                               # exactly the cap: kept, the root stays finite
])
def test_raise_max_leaf_takes_numbers_and_only_ever_raises(value, after):
    buf = _new()
    _fill(buf, 20)
    top = buf.shard.max_leaf
    buf.shard.raise_max_leaf(value)
    assert buf.shard.max_leaf == (top if after is None or after <= top else after)
    buf.shard.raise_max_leaf(top / 2)  # a smaller one never lowers it
    assert buf.shard.max_leaf == (top if after is None or after <= top else after)


def test_a_key_raised_to_the_cap_fills_the_whole_ring_with_a_finite_total():
    buf = _new()
    buf.shard.raise_max_leaf(LIMIT)
    _fill(buf, 3 * CAP, prio=False)
    assert math.isfinite(buf.total_priority) and buf.total_priority > 0
    np.testing.assert_array_equal(buf.leaves(np.arange(CAP)), np.full(CAP, LIMIT))
    b = buf.sample(8)
    assert np.all(np.isfinite(b.weights)) and np.all(b.probabilities > 0)


class _FloatRaises:
    def __float__(self):
        raise RuntimeError("__float__ of the caller's object")


@pytest.mark.parametrize("value, error", [
    (float("nan"), InvalidArgumentError), (float("inf"), InvalidArgumentError),
    (float("-inf"), InvalidArgumentError), (-0.0, InvalidArgumentError), (0.0, InvalidArgumentError),
    (-1.0, InvalidArgumentError), (1e308, InvalidArgumentError),
    (float(np.nextafter(LIMIT, np.inf)), InvalidArgumentError),   # one ulp above the cap
    (10 ** 400, InvalidArgumentError),                               # no float holds it
    (None, InvalidTypeError), (1 + 2j, InvalidTypeError), (np.array([4.0]), InvalidTypeError),
    ([4.0], InvalidTypeError), (object(), InvalidTypeError), ("nan", InvalidArgumentError),
    (_FloatRaises(), (RuntimeError, InvalidTypeError)),  # the caller's own error, or refused as no number
])
def test_raise_max_leaf_refusals_change_nothing(value, error):
    buf = _new()
    _fill(buf, 20)
    before = _state(buf)
    with pytest.raises(error):
        buf.shard.raise_max_leaf(value)
    _same_state(before, _state(buf))


@pytest.mark.parametrize("value", ["3.5", True, np.bool_(True)])
def test_raise_max_leaf_refuses_strings_and_bools_as_beta_does(value):
    buf = _new()
    _fill(buf, 20, prio=False)  # max_leaf 1.0: True would not raise it, "3.5" would
    before = _state(buf)
    with pytest.raises(InvalidTypeError):
        buf.shard.raise_max_leaf(value)
    _same_state(before, _state(buf))


class _ClosesOnFloat:
    def __init__(self, buf):
        self.buf, self.called = buf, False

    def __float__(self):
        self.called = True
        self.buf.close()
        return 5.0


def test_raise_max_leaf_whose_value_closes_the_buffer_is_refused_and_changes_nothing():
    buf = _new()
    _fill(buf, 20)
    before = _state(buf)
    with pytest.raises(BigperError):
        buf.shard.raise_max_leaf(_ClosesOnFloat(buf))
    assert not buf.closed
    _same_state(before, _state(buf))
    buf.shard.raise_max_leaf(5.0)  # still works
    assert buf.shard.max_leaf == 5.0


def test_raise_max_leaf_says_that_a_reentrant_close_was_refused():
    buf = _new()
    _fill(buf, 20)
    value = _ClosesOnFloat(buf)
    with pytest.raises(BigperError) as info:
        buf.shard.raise_max_leaf(value)
    # either refused as no number without converting it, or the close's refusal says why
    assert not value.called or "close() was called from inside" in str(info.value)


def test_raise_max_leaf_refuses_a_key_above_the_max_priority_cap():
    buf = _new(max_priority=2.0)
    _fill(buf, 20)
    assert buf.shard.max_leaf == pytest.approx(_key(2.0))
    before = _state(buf)
    with pytest.raises(InvalidArgumentError):
        buf.shard.raise_max_leaf(100.0)
    _same_state(before, _state(buf))


def test_under_max_priority_a_raised_key_up_to_the_cap_is_what_new_transitions_get():
    buf = _new(max_priority=2.0)
    _fill(buf, 3)  # priorities 0, 1, 2: max_leaf is the cap's key already
    buf.shard.raise_max_leaf(_key(2.0))
    _fill(buf, 1, 3, prio=False)
    assert buf.leaves([3])[0] == pytest.approx(_key(2.0))
    buf.update_priorities(np.array([3]), np.array([50.0]))  # capped
    assert buf.leaves([3])[0] == pytest.approx(_key(2.0))


CONFIGS = {"batch weights": dict(weight_norm="batch"), "max_priority": dict(max_priority=2.0),
           "device cpu": dict(device="cpu"), "alpha 1, eps 0": dict(alpha=1.0, eps=0.0)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sample_at_and_min_leaf_on_other_configs(name):
    buf = _new(**CONFIGS[name])
    _fill(buf, 20)
    live = buf.status == LIVE
    leaves = buf.leaves(np.arange(CAP))
    assert buf.shard.min_leaf == leaves[live & (leaves > 0)].min()
    before = _state(buf)
    b = buf.shard.sample_at(np.linspace(0, buf.total_priority, 40, endpoint=False), beta=0.6)
    assert isinstance(b["obs"], np.ndarray)  # a host batch, also with a device tier
    assert np.all(live[b.indices]) and np.all(leaves[b.indices] > 0)
    _same_data({k: np.asarray(b[k]) for k in b.keys()}, buf.gather(b.indices))
    _same_state(before, _state(buf))


def test_sample_at_with_two_envs_draws_each_env_in_proportion():
    buf = PRB(CAP, F, seed=0, num_envs=2)
    for i in range(10):
        buf.add(obs=np.full((2, 3), i, np.float32), reward=np.ones(2, np.float32),
                next_obs=np.zeros((2, 3), np.float32), priorities=np.array([0.0, 3.0]))
    total = buf.total_priority
    b = buf.shard.sample_at((np.arange(1000) + 0.5) * total / 1000, beta=0.4)
    odd = np.mean(b.indices % 2 == 1)  # env 1 at odd slots, key (3 + eps) ** 0.6 against eps ** 0.6
    assert odd == pytest.approx(_key(3.0) / (_key(3.0) + _key(0.0)), abs=2e-3)


def test_new_transitions_enter_at_the_raised_key_with_frame_stacks_and_n_step():
    fields = {"obs": ((4, 5, 5), np.uint8), "reward": ((), np.float32)}
    buf = PRB(24, fields, frame_stack=4, n_step=3, seed=0)
    frames = [np.full((5, 5), i, np.uint8) for i in range(60)]

    def step(i, **kw):
        stack = np.stack([frames[max(j, 0)] for j in range(i - 3, i + 1)])
        nxt = np.stack([frames[max(j, 0)] for j in range(i - 2, i + 2)])
        buf.add(obs=stack, next_obs=nxt, reward=1.0, terminated=False, **kw)

    for i in range(10):
        step(i)
    buf.shard.raise_max_leaf(9.0)
    for i in range(10, 16):
        step(i)
    # slots 10..15 enter at 9.0; with n_step=3 the last two still wait for their windows
    st = buf.status
    np.testing.assert_array_equal(buf.leaves(np.arange(10, 14)), np.full(4, 9.0))
    assert list(st[14:16]) == [2, 2] and buf.shard.max_leaf == 9.0
    b = buf.shard.sample_at(np.linspace(0, buf.total_priority, 64, endpoint=False), beta=0.5)
    assert np.all(buf.status[b.indices] == LIVE)
    _same_data({k: np.asarray(b[k]) for k in b.keys()}, buf.gather(b.indices))


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_raised_key_survives_close_and_resume(tmp_path, storage):
    buf = _new(tmp_path, storage)
    _fill(buf, 20)
    buf.shard.raise_max_leaf(7.5)
    t = np.linspace(0, buf.total_priority, 32, endpoint=False)
    was = buf.shard.sample_at(t, beta=0.3)
    buf.close()
    back = _new(tmp_path, storage, mode="resume", continue_episodes=True)  # the same batch: its episode goes on
    assert back.shard.max_leaf == 7.5 and back.state_dict()[0]["max_leaf"] == 7.5
    _same_batch(was, back.shard.sample_at(t, beta=0.3))
    _fill(back, 1, 100, prio=False)
    assert back.leaves([100 % CAP])[0] == 7.5
    back.close()


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_a_raised_key_survives_save_and_load(tmp_path, storage):
    buf = _new(tmp_path, storage)
    _fill(buf, 20)
    buf.shard.raise_max_leaf(6.25)
    buf.save(tmp_path / "snap")
    buf.close()
    back = PRB.load(tmp_path / "snap", path=_path(tmp_path, storage, "again"))
    assert back.shard.max_leaf == 6.25
    back.close()


def test_a_read_only_buffer_takes_a_raised_key_in_memory_and_records_nothing(tmp_path):
    buf = _new(tmp_path, "memmap")
    _fill(buf, 20)
    buf.close()
    before = _files(tmp_path)
    ro = _new(tmp_path, "memmap", read_only=True)
    ro.shard.raise_max_leaf(5.0)  # a coordinator raises every shard's key; a reader has no add to use it
    assert ro.shard.max_leaf == 5.0
    ro.close()
    assert _files(tmp_path) == before
    with _new(tmp_path, "memmap", mode="resume") as back:
        assert back.shard.max_leaf == _key(4.0)


def test_load_state_refuses_a_max_leaf_above_the_cap_raise_max_leaf_refuses():
    buf = _new()
    _fill(buf, 12)
    meta, arrays = _state(buf)
    before = _state(buf)
    meta["max_leaf"] = 1e308
    with pytest.raises(CorruptSnapshotError):
        buf.load_state(meta, arrays)
    _same_state(before, _state(buf))


# -- sample_at ------------------------------------------------------------------------------------

def _used(**kw):
    buf = _new(**kw)
    _fill(buf, 20)
    return buf


@pytest.mark.parametrize("name", ["empty", "2d", "nan", "inf", "-inf", "tiny negative", "at total",
                                  "float32 of total", "2**62", "None", "one bad among good"])
def test_sample_at_refuses_bad_targets_and_changes_nothing(name):
    buf = _used()
    total = buf.total_priority
    t = {"empty": np.array([]), "2d": np.zeros((2, 2)), "nan": np.array([np.nan]), "inf": np.array([np.inf]),
         "-inf": np.array([-np.inf]), "tiny negative": np.array([-1e-300]), "at total": np.array([total]),
         "float32 of total": np.array([total], np.float32), "2**62": np.array([2 ** 62]), "None": None,
         "one bad among good": np.array([0.0, 1.0, total, 0.5])}[name]
    before = _state(buf)
    with pytest.raises(InvalidArgumentError):
        buf.shard.sample_at(t, beta=0.4)
    _same_state(before, _state(buf))


@pytest.mark.parametrize("beta", [float("nan"), -0.1, 1.5, True, "0.4", None])
def test_sample_at_refuses_a_bad_beta_and_changes_nothing(beta):
    buf = _used()
    before = _state(buf)
    with pytest.raises(InvalidArgumentError):
        buf.shard.sample_at(np.array([0.1]), beta=beta)
    _same_state(before, _state(buf))


class _ClosesOnArray:
    def __init__(self, buf, value):
        self.buf, self.value = buf, value

    def __array__(self, dtype=None, copy=None):
        self.buf.close()
        return np.asarray(self.value, dtype=dtype)


def test_sample_at_targets_that_close_the_buffer_are_refused_with_why_and_change_nothing():
    buf = _used()
    before = _state(buf)
    with pytest.raises(InvalidArgumentError, match=r"close\(\) was called from inside this buffer's own sample_at"):
        buf.shard.sample_at(_ClosesOnArray(buf, [0.1, 0.2]), beta=0.4)
    assert not buf.closed
    _same_state(before, _state(buf))


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")
@pytest.mark.parametrize("targets", [np.array(["0.1"]), "0.5", np.array([0.1 + 1j]), np.array([object()])],
                         ids=["str array", "str", "complex", "object"])
def test_sample_at_refuses_targets_that_are_not_real_numbers(targets):
    buf = _used()
    with pytest.raises(InvalidTypeError):
        buf.shard.sample_at(targets, beta=0.4)


def test_sample_at_edges_that_are_valid_land_on_live_leaves_and_touch_no_rng():
    buf, twin = _used(), _used()
    total = buf.total_priority
    before = _state(buf)
    for t in (np.array([0, 1, 2]), [0.1, 0.2], np.array([-0.0]), np.array([np.nextafter(total, 0)]),
              np.array([1], np.uint8), np.linspace(0, total, 5000, endpoint=False)):
        # (one number, a 0-d array, is refused as update_priorities refuses one index: issue 40 cause 7,
        # tests/buffer/test_hostile_names_beta.py)
        b = buf.shard.sample_at(t, beta=0.4)
        assert np.all(buf.status[b.indices] == LIVE)
        leaves = buf.leaves(b.indices)
        np.testing.assert_allclose(b.probabilities, leaves / total, rtol=1e-12)
        np.testing.assert_allclose(b.weights, (leaves.min() / leaves) ** 0.4, rtol=1e-6)
        assert b.weights.max() == 1.0
        _same_data({k: np.asarray(b[k]) for k in b.keys()}, buf.gather(b.indices))
    _same_state(before, _state(buf))  # no RNG draw, no beta step
    _same_batch(buf.sample(8), twin.sample(8))


def test_sample_at_never_lands_on_a_zero_leaf_at_exact_boundaries():
    buf = PRB(CAP, F, seed=0, eps=0.0, alpha=1.0)
    for i in range(CAP - 3):  # three slots never written
        buf.add(obs=np.zeros(3, np.float32), reward=0.0, next_obs=np.zeros(3, np.float32),
                priorities=float(i % 2))
    total = buf.total_priority
    assert total == (CAP - 3) // 2
    t = np.concatenate([np.arange(total), np.nextafter(np.arange(1, total + 1), 0)])
    b = buf.shard.sample_at(t, beta=1.0)
    assert np.all(buf.leaves(b.indices) == 1.0)
    assert np.all(b.indices % 2 == 1)


def test_sample_at_on_rank_and_on_sequences_is_refused_and_changes_nothing():
    rank = _used(prioritization="rank")
    seq = _new(cap=32, sequence=Sequence(length=3, burn_in=1))
    _fill(seq, 20, ends=(7,))
    for buf, word in ((rank, "rank"), (seq, "sequence")):
        before = _state(buf)
        with pytest.raises(InvalidArgumentError, match=word):
            buf.shard.sample_at(np.array([0.0]), beta=0.4)
        _same_state(before, _state(buf))


def test_rank_min_leaf_is_the_smallest_priority_and_raise_has_no_cap():
    buf = _used(prioritization="rank")
    assert buf.shard.min_leaf == 0.0 and buf.shard.max_leaf == 4.0  # rank keys are the priorities
    buf.shard.raise_max_leaf(1e308)  # rank ranks: no sum to overflow
    _fill(buf, 1, 100, prio=False)
    assert buf.leaves([100 % CAP])[0] == 1e308
    assert math.isfinite(buf.total_priority)
    assert 100 % CAP in buf.sample(64).indices  # ranked first: drawn most


def test_sequence_items_enter_at_the_raised_key():
    buf = _new(cap=32, sequence=Sequence(length=2))
    _fill(buf, 6, prio=False)
    buf.shard.raise_max_leaf(9.0)
    _fill(buf, 6, 6, prio=False)
    leaves = buf.leaves(np.arange(32))
    assert set(leaves[[6, 8]]) == {9.0} and buf.shard.max_leaf == 9.0
    assert set(leaves[[0, 2, 4]]) == {1.0}


def test_min_leaf_of_an_empty_buffer_is_inf():
    buf = _new()
    assert buf.shard.min_leaf == math.inf and buf.shard.max_leaf == 1.0
    with pytest.raises(InvalidArgumentError, match="cannot sample"):
        buf.shard.sample_at(np.array([0.0]), beta=0.4)


# -- lifetime --------------------------------------------------------------------------------------

@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_the_view_holds_the_buffer_and_both_gone_release_its_lock(tmp_path, storage):
    buf = _new(tmp_path, storage)
    _fill(buf, 5)
    view = buf.shard
    alive = weakref.ref(buf)
    del buf
    gc.collect()
    assert alive() is not None  # the view keeps the buffer: it stays open and usable
    view.raise_max_leaf(3.0)
    assert view.max_leaf == 3.0
    with pytest.raises(StorageLockedError):
        _new(tmp_path, storage, mode="resume")
    del view
    gc.collect()
    assert alive() is None
    with _new(tmp_path, storage, mode="resume") as back:  # lock released, state recorded
        assert len(back) == 5 and back.shard.max_leaf == 3.0


def test_a_dropped_view_leaves_no_reference_to_the_buffer(tmp_path):
    buf = _new(tmp_path, "memmap")
    _fill(buf, 5)
    for _ in range(3):
        buf.shard.max_leaf
    alive = weakref.ref(buf)
    del buf
    gc.collect()
    assert alive() is None
    with _new(tmp_path, "memmap", mode="resume") as back:
        assert len(back) == 5


# -- threads ---------------------------------------------------------------------------------------

def test_a_view_from_a_second_thread_against_add_sample_update_save_and_close(tmp_path):
    buf = PRB(64, F, seed=0, storage="memmap", path=tmp_path / "live")
    _fill(buf, 80)
    view = buf.shard
    closing, errors, seen = threading.Event(), [], []
    raised = [0.0]

    def coordinator():
        i = 0
        while True:
            i += 1
            try:
                seen.append(view.max_leaf)
                v = 2.0 + i * 1e-3
                view.raise_max_leaf(v)
                raised[0] = v
                b = view.sample_at(np.array([0.0, 1e-9]), beta=0.4)
                if len(b.indices) != 2:
                    errors.append(f"batch of {len(b.indices)}")
                total = buf.total_priority
                try:
                    view.sample_at(np.linspace(0, total, 8, endpoint=False), beta=0.4)
                except InvalidArgumentError as e:  # an update between the two calls lowered the total
                    if "targets must be" not in str(e):
                        raise
                if not math.isfinite(view.min_leaf):
                    errors.append("min_leaf not finite on a full buffer")
            except BufferClosedError:
                if not closing.is_set():
                    errors.append("closed before close()")
                return
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    t = threading.Thread(target=coordinator)
    t.start()
    rng = np.random.default_rng(0)
    for i in range(60):
        _fill(buf, 1, 80 + i, prio=False)
        b = buf.sample(8)
        buf.update_priorities(b, rng.random(8) * 2)
        if i % 30 == 0:
            buf.save(tmp_path / f"snap{i}")
    closing.set()
    buf.close()
    t.join(30)
    assert not t.is_alive() and errors == []
    assert all(a <= b for a, b in zip(seen, seen[1:]))  # max_leaf never goes down
    with PRB(64, F, storage="memmap", path=tmp_path / "live", mode="resume") as back:
        assert back.shard.max_leaf >= raised[0] and len(back) == 64
    assert bigper.snapshot.verify(tmp_path / "snap30")["problems"] == []


def test_view_calls_between_a_prefetching_samplers_draws_do_not_change_its_stream():
    buf, twin = _used(), _used()
    it, it2 = buf.sampler(4, prefetch=2), twin.sampler(4, prefetch=2)
    view = buf.shard
    for i in range(10):
        view.sample_at(np.linspace(0, buf.total_priority, 7, endpoint=False), beta=0.5)
        view.raise_max_leaf(1.0 + i)
        assert view.min_leaf > 0
        _same_batch(next(it), next(it2))
    buf.close()
    twin.close()
    with pytest.raises(BufferClosedError):
        next(it)
    with pytest.raises(BufferClosedError):
        view.max_leaf


# -- deferred updates and the view -----------------------------------------------------------------

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test dependency
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="deferred updates come from torch tensors")

if torch is not None:
    class _OnDevice(torch.Tensor):
        """A tensor that says it lives on a device: update_priorities defers it (no GPU needed)."""

        @property
        def device(self):
            return torch.device("xla")


def _dev(p):
    return torch.as_tensor(np.asarray(p)).as_subclass(_OnDevice)


@needs_torch
def test_fake_device_tensors_are_device_tensors_and_cpu_ones_are_not():
    from bigper.tensors.lazy import is_device_tensor

    assert is_device_tensor(_dev([1.0])) and not is_device_tensor(torch.ones(2))
    assert not is_device_tensor(np.ones(2)) and not is_device_tensor(torch.ones(2, device="meta"))


@needs_torch
def test_the_view_settles_deferred_updates_first_and_reports_a_bad_one_once():
    buf = _used()
    b = buf.sample(4)
    buf.update_priorities(b, _dev(np.full(4, 100.0)))  # deferred: not applied yet
    assert len(buf._guard.deferred) == 1
    assert buf.shard.max_leaf == _key(100.0)  # the view's read applied it first
    b = buf.sample(4)
    p = np.ones(4)
    p[1] = np.nan
    buf.update_priorities(b, _dev(p))
    before = _state(buf)
    with pytest.raises(InvalidArgumentError, match="not applied"):
        buf.shard.min_leaf
    _same_state(before, _state(buf))
    assert buf.shard.min_leaf > 0  # reported once


# =================================================================================================
# 2. sample units: transitions and sequences through the public API
# =================================================================================================

SEQ = Sequence(length=3, burn_in=1)


def _unit_buf(seq, cap=32, **kw):
    buf = PRB(cap, F, seed=0, sequence=seq, **kw)
    _fill(buf, 12, ends=(7,), prio=False)
    return buf


@pytest.mark.parametrize("seq, noun", [(None, "transition"), (SEQ, "sequence item")])
def test_gather_of_a_slot_that_is_no_live_unit_names_the_unit(seq, noun):
    buf = _unit_buf(seq)
    before = _state(buf)
    bad = 31 if seq is None else 1  # never written / a step inside an item, not its start
    with pytest.raises(InvalidIndexError, match=f"indices\\[0\\] = {bad} is not a sampleable {noun}$"):
        buf.gather([bad])
    with pytest.raises(InvalidIndexError, match="must be in"):
        buf.gather([32])
    _same_state(before, _state(buf))
    empty = buf.gather([])
    assert empty["obs"].shape == ((0, 3) if seq is None else (0, 4, 3))
    assert ("mask" in empty) == (seq is not None)


@pytest.mark.parametrize("seq, kw, noun", [(None, {"n_step": 3}, "no sampleable transition"),
                                           (SEQ, {}, "no sampleable sequence item")])
def test_cannot_sample_names_the_unit(seq, kw, noun):
    buf = PRB(32, F, seed=0, sequence=seq, **kw)
    _fill(buf, 2, prio=False)  # a window / an item not complete yet
    before = _state(buf)
    with pytest.raises(InvalidArgumentError, match=f"cannot sample: {noun} \\(len=2"):
        buf.sample(2)
    _same_state(before, _state(buf))


def _reduce(e, mask, burn_in, eta=0.9):
    """R2D2's reduction over the real steps after the burn-in, written out."""
    out = []
    for row, m in zip(e, mask):
        v = row[m[burn_in:]] if row.shape[0] == m.shape[0] - burn_in else row[burn_in:][m[burn_in:]]
        out.append(eta * v.max() + (1 - eta) * v.mean())
    return np.array(out)


@needs_torch
@pytest.mark.parametrize("deferred", [False, True])
def test_per_step_sequence_priorities_equal_their_reduction(deferred):
    rng = np.random.default_rng(1)
    a, b = _unit_buf(SEQ), _unit_buf(SEQ)
    for _ in range(4):
        x, y = a.sample(6), b.sample(6)
        np.testing.assert_array_equal(x.indices, y.indices)  # (the leaves may differ in the last bit)
        np.testing.assert_array_equal(x.mask, y.mask)
        per_step = rng.random((6, 4)) * 3
        per_step[~x.mask] = np.nan  # padded steps are ignored
        per_step[:, 0] = np.nan     # and the burn-in
        a.update_priorities(x, _dev(per_step) if deferred else per_step)
        b.update_priorities(y, _reduce(per_step, y.mask, 1))
    x, y = a.sample(6), b.sample(6)
    np.testing.assert_array_equal(x.indices, y.indices)
    np.testing.assert_allclose(a.leaves(np.arange(32)), b.leaves(np.arange(32)), rtol=1e-12)
    # (B, length): the steps after the burn-in only; (B, 1) and (B,): one value an item
    last = rng.random((6, 3)) + 0.5
    last[~x.mask[:, 1:]] = np.nan
    a.update_priorities(x, _dev(last) if deferred else last)
    b.update_priorities(y, _reduce(last, y.mask, 1))
    col = rng.random((6, 1)) + 0.5
    a.update_priorities(a.sample(6), _dev(col) if deferred else col)
    b.update_priorities(b.sample(6), col[:, 0])
    a.sample(1), b.sample(1)
    np.testing.assert_allclose(a.leaves(np.arange(32)), b.leaves(np.arange(32)), rtol=1e-12)


@needs_torch
def test_cpu_tensors_are_applied_at_once_and_equal_numpy():
    a, b = _unit_buf(SEQ), _unit_buf(SEQ)
    x, y = a.sample(5), b.sample(5)
    e = np.random.default_rng(2).random((5, 4)) + 0.1
    a.update_priorities(x.to_torch("cpu"), torch.from_numpy(e))
    assert not a._guard.deferred  # a CPU tensor is no device tensor: nothing deferred
    b.update_priorities(y, e)
    np.testing.assert_array_equal(a.leaves(np.arange(32)), b.leaves(np.arange(32)))
    _same_batch(a.sample(5), b.sample(5))


@needs_torch
@pytest.mark.parametrize("seq, target", [(q, t) for q in (None, SEQ, Sequence(length=1, burn_in=2), Sequence(length=2))
                                         for t in ("batch", "raw", "dict")
                                         ])
def test_deferred_updates_are_refused_or_applied_exactly_as_host_ones(seq, target):
    """Every shape, for every target: the host path and the deferred path
    refuse at the update_priorities call, or both apply the same leaves."""
    for shape in [(3,), (3, 1), (3, 2), (3, 3), (3, 4), (2,), (3, 1, 1)]:
        results = []
        for deferred in (False, True):
            buf = _unit_buf(seq)
            b = buf.sample(3)
            t = {"batch": b, "raw": b.indices, "dict": b.to_torch("cpu")}[target]
            p = np.linspace(0.5, 2.0, int(np.prod(shape))).reshape(shape)
            before = _state(buf)
            try:
                buf.update_priorities(t, _dev(p) if deferred else p)
            except InvalidArgumentError:
                _same_state(before, _state(buf))
                results.append("refused")
                continue
            buf.sample(2)  # settles the deferred one: an error here would be a late refusal
            results.append(tuple(buf.leaves(np.arange(32))))
        assert results[0] == results[1], (shape, results)


@needs_torch
def test_a_column_update_with_raw_indices_is_judged_alike_on_host_and_deferred():
    results = []
    for deferred in (False, True):
        buf = _unit_buf(Sequence(length=1, burn_in=2))
        b = buf.sample(3)
        p = np.ones((3, 1))
        try:
            buf.update_priorities(b.indices, _dev(p) if deferred else p)
            results.append("accepted")
        except InvalidArgumentError:
            results.append("refused")
            continue
        buf.sample(2)
    assert results[0] == results[1]


def test_sample_out_is_refused_with_sequences_and_taken_with_transitions():
    seq = _unit_buf(SEQ)
    before = _state(seq)
    with pytest.raises(InvalidArgumentError, match=r"sample\(out=\.\.\.\) is not available with sequence"):
        seq.sample(3, out={"obs": np.zeros((3, 4, 3), np.float32)})
    _same_state(before, _state(seq))  # no draw, no beta step
    a, b = _unit_buf(None), _unit_buf(None)
    out = {"obs": np.zeros((3, 3), np.float32), "reward": np.zeros(3, np.float32)}
    x = a.sample(3, out=out)
    assert x["obs"] is out["obs"]
    _same_batch(x, b.sample(3))


@pytest.mark.parametrize("seq", [None, SEQ])
def test_assign_priorities_sets_live_units_and_ignores_the_rest(seq):
    buf = _unit_buf(seq)
    live = buf.leaves(np.arange(32)) > 0
    p = np.arange(32, dtype=np.float64)
    p[~live] = np.nan  # rows of slots that are no live unit are ignored
    buf.assign_priorities(p)
    want = np.where(live, _key(np.arange(32.0)), 0.0)
    np.testing.assert_allclose(buf.leaves(np.arange(32)), want, rtol=1e-12)
    assert buf.shard.max_leaf == pytest.approx(want.max(), rel=1e-12)
    before = _state(buf)
    bad = p.copy()
    bad[np.flatnonzero(live)[-1]] = -1.0
    with pytest.raises(InvalidArgumentError, match="finite and >= 0"):
        buf.assign_priorities(bad)
    _same_state(before, _state(buf))


UNITS = {"transitions": (None, {}), "n_step": (None, {"n_step": 3}), "seq": (SEQ, {}),
         "seq2": (Sequence(length=2, burn_in=1), {})}


@pytest.mark.parametrize("src, dst", [(a, b) for a in UNITS for b in UNITS if a != b])
def test_load_state_of_another_unit_is_refused_and_changes_nothing(src, dst):
    a = _unit_buf(UNITS[src][0], **UNITS[src][1])
    b = _unit_buf(UNITS[dst][0], **UNITS[dst][1])
    b.update_priorities(b.sample(4), np.arange(4.0))
    before = _state(b)
    with pytest.raises(CorruptSnapshotError):
        b.load_state(*_state(a))
    _same_state(before, _state(b))


@pytest.mark.parametrize("unit", list(UNITS))
def test_state_dict_round_trip_restores_the_draws(unit):
    seq, kw = UNITS[unit]
    buf = _unit_buf(seq, **kw)
    saved = _state(buf)
    first = buf.sample(5)
    buf.update_priorities(first, np.linspace(0.1, 3, 5))
    _fill(buf, 9, 50, prio=False)
    buf.load_state(*saved)
    _same_state(saved, _state(buf))
    _same_batch(first, buf.sample(5))


# =================================================================================================
# 3. storage defaults: a user's storage through from_parts
# =================================================================================================

class UserStorage(MemoryStorage):
    """A user's subclass of MemoryStorage: writes go through ``write``
    (``writable_arrays = None``), every write is prepared first
    (``shared_chunks``), and ``prepare`` fails when ``fail(writes)`` says so.
    With ``hide``, ``arrays`` is None too (reads through ``read``)."""

    writable_arrays = None

    def __init__(self, hide=False):
        self._hide = False
        super().__init__()
        self._hide = hide
        self.prepared, self.fail, self.grow_fails = 0, None, False

    @property
    def arrays(self):
        return None if self._hide else self._data

    @arrays.setter
    def arrays(self, v):
        self._data = v

    @property
    def shared_chunks(self):
        return 1

    def prepare(self, writes):
        if self.fail is not None and self.fail(writes):
            raise OSError(28, "No space left on device (UserStorage.prepare)")
        self.prepared += 1

    def grow(self, name, rows):
        if self.grow_fails:
            raise OSError(28, "No space left on device (UserStorage.grow)")
        return self._inner(MemoryStorage.grow, name, rows)

    def _inner(self, meth, *a):
        hide, self._hide = self._hide, False
        try:
            return meth(self, *a)
        finally:
            self._hide = hide

    def allocate(self, specs, growth=None):
        return self._inner(MemoryStorage.allocate, specs, growth)

    def rows(self, name):
        return self._inner(MemoryStorage.rows, name)

    def shrink(self, name, rows):
        return self._inner(MemoryStorage.shrink, name, rows)

    def read(self, name, rows):
        return self._inner(MemoryStorage.read, name, rows)

    def write(self, name, rows, values):
        return self._inner(MemoryStorage.write, name, rows, values)

    def nbytes(self):
        return self._inner(MemoryStorage.nbytes)

    def data(self):
        return {k: v.copy() for k, v in self._data.items()}


def _on_user_storage(kw, hide=False):
    cfg = PRB(**kw).config
    store = UserStorage(hide)
    allocate(store, cfg)
    return PRB.from_parts(cfg, store), store


def _same_run(ref, buf, steps, start=0):
    _fill(ref, steps, start, ends=(9,))
    _fill(buf, steps, start, ends=(9,))
    rng = np.random.default_rng(5)
    for _ in range(3):
        x, y = ref.sample(5), buf.sample(5)
        _same_batch(x, y)
        p = rng.random(5) * 3
        ref.update_priorities(x, p)
        buf.update_priorities(y, p)
    idx = ref.sample(4).indices
    buf.sample(4)
    _same_data(ref.gather(idx), buf.gather(idx))


@pytest.mark.parametrize("hide, n_step", [
    (False, 1), (False, 3), (True, 3),
    (True, 1),
])
def test_a_user_storage_gives_the_same_batches_as_plain_memory(hide, n_step):
    kw = dict(capacity=CAP, fields=F, seed=3, n_step=n_step)
    buf, store = _on_user_storage(kw, hide)
    _same_run(PRB(**kw), buf, 25)
    assert store.prepared >= 25  # shared_chunks: every write prepared first


@pytest.mark.parametrize("hide", [False, True])
def test_a_prepare_that_fails_changes_nothing_and_the_write_goes_through_after(hide):
    kw = dict(capacity=CAP, fields=F, seed=3, n_step=2)
    ref = PRB(**kw)
    buf, store = _on_user_storage(kw, hide)
    _fill(ref, 10)
    _fill(buf, 10)
    store.fail = lambda writes: True
    before, data = _state(buf), store.data()
    for call in (lambda: _fill(buf, 1, 10),
                 lambda: buf.extend({"obs": np.zeros((3, 3), np.float32), "reward": np.zeros(3, np.float32),
                                     "next_obs": np.zeros((3, 3), np.float32)})):
        with pytest.raises(OSError, match="No space left"):
            call()
        _same_state(before, _state(buf))
        _same_data(data, store.data())
    store.fail = None
    _same_run(ref, buf, 12, 10)


def test_save_of_a_read_write_only_storage_is_refused_by_name_and_writes_nothing(tmp_path):
    """Snapshots copy a storage's arrays: one that has none (read/write only) is
    refused with bigper's error naming it, nothing is written, the buffer goes on."""
    buf, store = _on_user_storage(dict(capacity=CAP, fields=F, seed=3), hide=True)
    _fill(buf, 10)
    before, data = _state(buf), store.data()
    with pytest.raises(bigper.InvalidArgumentError, match="UserStorage.*cannot be snapshotted"):
        buf.save(tmp_path / "snap")
    assert os.listdir(tmp_path) == []
    _same_state(before, _state(buf))
    _same_data(data, store.data())
    _fill(buf, 1, 10)
    buf.close()


class DictStorage(StorageBase):
    """A storage written from scratch on StorageBase: only what it must have."""

    kind = "dict"

    def __init__(self):
        self.d = {}

    def open(self, config):
        return None

    def allocate(self, specs, growth=None):
        self.d = {n: np.zeros((rows, *shape), dtype) for n, (rows, shape, dtype) in specs.items()}

    def read(self, name, rows):
        return self.d[name][rows]

    def write(self, name, rows, values):
        self.d[name][rows] = values

    def flush(self):
        pass

    def close(self, state=None):
        self.closed_with = state

    def nbytes(self):
        return sum(a.nbytes for a in self.d.values())


def test_a_storage_on_storage_base_alone_works_through_from_parts_and_its_defaults(tmp_path):
    kw = dict(capacity=CAP, fields=F, seed=3)
    cfg = PRB(**kw).config
    store = DictStorage()
    allocate(store, cfg)
    buf = PRB.from_parts(cfg, store)
    _same_run(PRB(**kw), buf, 25)
    assert store.arrays is None and store.writable_arrays is None and store.shared_chunks == 0
    with pytest.raises(RuntimeError, match="cannot grow"):
        store.grow("obs", 99)
    with pytest.raises(InvalidArgumentError, match="'dict'"):  # snapshots: memory, memmap, hdf5 only
        buf.save(tmp_path / "snap")
    assert not (tmp_path / "snap").exists()
    buf.close()
    assert store.closed_with[0]["count"] == 25


class DuckStorage:
    """Only what the ``Storage`` protocol lists (no StorageBase): what a
    reader of ``from_parts(config, store: Storage)`` would write."""

    kind, read_only = "duck", False

    def __init__(self):
        self.d = {}

    def open(self, config):
        return None

    def allocate(self, specs, growth=None):
        self.d = {n: np.zeros((rows, *shape), dtype) for n, (rows, shape, dtype) in specs.items()}

    def read(self, name, rows):
        return self.d[name][rows]

    def write(self, name, rows, values):
        self.d[name][rows] = values

    def flush(self):
        pass

    def close(self, state=None):
        pass

    def nbytes(self):
        return 0


def test_from_parts_refuses_a_storage_without_storage_base_up_front():
    cfg = PRB(CAP, F).config
    store = DuckStorage()
    allocate(store, cfg)
    data = {k: v.copy() for k, v in store.d.items()}
    with pytest.raises(InvalidTypeError, match="StorageBase"):
        PRB.from_parts(cfg, store)
    _same_data(data, store.d)


# -- compressed frames on the user's storage ------------------------------------------------------

ZF = {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
_BASE = np.random.default_rng(0).integers(0, 255, (84, 84), dtype=np.uint8)


def _frame(i):
    f = _BASE.copy()
    f[i % 84, :] = i % 251
    f[:, (3 * i) % 84] = 7
    return f


def _zfill(buf, n, start=0):
    for i in range(start, start + n):
        first = i - (i % 13)  # an episode of 13 steps: stacks start with the reset frame repeated
        stack = np.stack([_frame(max(j, first)) for j in range(i - 3, i + 1)])
        nxt = np.stack([_frame(max(j, first)) for j in range(i - 2, i + 2)])
        buf.add(obs=stack, next_obs=nxt, action=i, reward=float(i % 3), terminated=(i % 13 == 12))


def _zsame(ref, buf):
    for _ in range(3):
        x, y = ref.sample(6), buf.sample(6)
        _same_batch(x, y)
    _same_data(ref.gather(x.indices), buf.gather(x.indices))


def _zstd_or_skip():
    try:
        return PRB(**ZKW)
    except bigper.errors.CompressionUnavailableError as e:  # pragma: no cover - the compression extra
        pytest.skip(str(e))


ZKW = dict(capacity=24, fields=ZF, seed=1, frame_stack=4, compression="zstd", n_step=3)


@pytest.mark.parametrize("hide", [False, True])
def test_compressed_frames_on_a_user_storage_equal_plain_memory(hide):
    ref = _zstd_or_skip()
    buf, store = _on_user_storage(ZKW, hide)
    _zfill(ref, 60)
    _zfill(buf, 60)
    _zsame(ref, buf)


@pytest.mark.parametrize("how", ["every prepare", "the log's own prepare", "grow"])
def test_compressed_frames_a_failed_prepare_or_grow_changes_nothing(how):
    ref = _zstd_or_skip()
    buf, store = _on_user_storage(ZKW, hide=True)
    first = 2 if how == "grow" else 30  # (the log grows while the ring first fills)
    _zfill(ref, first)
    _zfill(buf, first)
    if how == "every prepare":
        store.fail = lambda writes: True
    elif how == "the log's own prepare":  # after the writer's own prepare passed: inside the frame log
        store.fail = lambda writes: set(writes) == {"frame_log"}
    else:
        store.grow_fails = True
    failed = None
    for i in range(first, 200):
        before, data = _state(buf), store.data()
        try:
            _zfill(buf, 1, i)
        except OSError:
            failed = i
            break
        _zfill(ref, 1, i)
    assert failed is not None, "never failed"
    _same_state(before, _state(buf))
    after = store.data()
    for name, a in data.items():  # the log may have grown (zero rows); no stored row changed
        np.testing.assert_array_equal(after[name][:a.shape[0]], a, err_msg=name)
        assert not after[name][a.shape[0]:].any()
    store.fail, store.grow_fails = None, False
    _zfill(buf, 8, failed)  # the refused step again, and on
    _zfill(ref, 8, failed)
    _zsame(ref, buf)


# =================================================================================================
# 4. the package move
# =================================================================================================

HEAVY = ("torch", "ray", "gymnasium", "stable_baselines3", "h5py", "tqdm", "zstandard", "pandas", "hdf5plugin")

_FORK = r"""
import atexit, hashlib, json, os, sys, warnings
import numpy as np
import bigper
from bigper.errors import BufferClosedError, StorageLockedError

heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
path = sys.argv[1]
F = {{"obs": ((3,), np.float32), "reward": ((), np.float32)}}
def step(buf, i):
    buf.add(obs=np.full(3, i, np.float32), reward=1.0, next_obs=np.zeros(3, np.float32))
def files():
    return {{os.path.join(d, n): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(path) for n in names}}
buf = bigper.PrioritizedReplayBuffer(16, F, storage="memmap", path=path, seed=0)
for i in range(5):
    step(buf, i)
view = buf.shard
buf.storage.flush()
before = files()
warnings.simplefilter("ignore", DeprecationWarning)
pid = os.fork()
if pid == 0:
    code = 0
    for call in (lambda: step(buf, 99), lambda: view.max_leaf, lambda: view.raise_max_leaf(9.0),
                 lambda: view.sample_at(np.array([0.1]), beta=0.4), lambda: buf.sample(2)):
        try:
            call()
            code |= 1
        except BufferClosedError as e:
            if "fork" not in str(e):
                code |= 2
    if not buf.closed:
        code |= 4
    atexit._run_exitfuncs()
    os._exit(code)
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
unchanged = files() == before
try:
    bigper.PrioritizedReplayBuffer(16, F, storage="memmap", path=path, mode="resume")
    locked = False
except StorageLockedError:
    locked = True
step(buf, 5)
view.raise_max_leaf(3.0)
b = view.sample_at(np.array([0.1, 3.0]), beta=0.4)
buf.close()
back = bigper.PrioritizedReplayBuffer(16, F, storage="memmap", path=path, mode="resume")
print(json.dumps({{"heavy": heavy, "child": child, "unchanged": unchanged, "locked": locked,
                  "len": len(back), "max_leaf": back.shard.max_leaf, "batch": len(b.indices)}}))
back.close()
"""


def test_import_loads_nothing_heavy_and_a_forked_child_of_an_open_memmap_buffer_is_closed(tmp_path):
    r = subprocess.run([sys.executable, "-c", _FORK.format(heavy=set(HEAVY)), str(tmp_path / "live")],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"heavy": [], "child": 0, "unchanged": True, "locked": True, "len": 6, "max_leaf": 3.0,
                   "batch": 2}


@pytest.fixture
def saved(tmp_path):
    buf = PRB(CAP, F, seed=0, storage="memmap", path=tmp_path / "live")
    _fill(buf, 20)
    buf.shard.raise_max_leaf(4.5)
    buf.save(tmp_path / "snap")
    buf.close()
    return tmp_path


def test_python_m_bigper_verify_a_snapshot(saved):
    r = subprocess.run([sys.executable, "-m", "bigper", "verify", str(saved / "snap")], capture_output=True,
                       text=True, timeout=120, cwd=str(saved), env=_env())
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr[-2000:]


def test_cli_info_and_verify_of_a_snapshot_and_a_memmap_folder(saved, capsys):
    from bigper.cli import main

    assert main(["info", str(saved / "snap")]) == 0
    out = capsys.readouterr().out
    assert "largest ever 4.5" in out and "16 / 16" in out
    assert main(["info", "--json", str(saved / "snap")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["capacity"] == CAP
    assert main(["info", str(saved / "live")]) == 0
    assert "closed cleanly" in capsys.readouterr().out
    assert main(["verify", str(saved / "live")]) == 0
    assert capsys.readouterr().out.startswith("OK")
    buf = PRB(CAP, F, storage="memmap", path=saved / "live", mode="resume")
    try:  # a live writer: verify says so, info too
        assert main(["verify", str(saved / "live")]) == 3
        assert "IN USE" in capsys.readouterr().out
    finally:
        buf.close()


FIXTURES = ["snapshot-0.1.0-memory", "snapshot-0.1.0-memmap", "snapshot-v1-memory", "snapshot-v1-memmap",
            "snapshot-v1-sequence", "snapshot-v1-zstd-memmap"]


@pytest.mark.parametrize("name", FIXTURES)
def test_committed_fixtures_load_and_their_shard_view_agrees_with_the_record(name, tmp_path):
    snap = DATA / name
    if name.endswith("zstd-memmap"):
        _zstd_or_skip()
    before = _files(snap)
    manifest = json.loads((snap / "manifest.json").read_text())
    kind = manifest["config"]["storage"]
    buf = PRB.load(snap, path=None if kind == "memory" else tmp_path / "live")
    try:
        assert buf.shard.max_leaf == manifest["state"]["meta"]["max_leaf"]
        if buf.config.sequence is None:
            assert buf.shard.min_leaf == buf.leaves(np.arange(buf.capacity))[buf.status == LIVE].min()
        else:
            assert 0 < buf.shard.min_leaf < math.inf
        state = _state(buf)
        if buf.config.sequence is not None:
            with pytest.raises(InvalidArgumentError, match="sequence"):
                buf.shard.sample_at(np.array([0.0]), beta=0.4)
        else:
            b = buf.shard.sample_at(np.linspace(0, buf.total_priority, 64, endpoint=False), beta=0.5)
            assert np.all(buf.status[b.indices] == LIVE)
            _same_data({k: np.asarray(b[k]) for k in b.keys()}, buf.gather(b.indices))
        _same_state(state, _state(buf))
    finally:
        buf.close()
    assert _files(snap) == before
