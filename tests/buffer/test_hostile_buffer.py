"""Hostile and careless use of the buffer itself (issue 12, items 7-12, 16, 17
and the tests that let bugs through): numeric extremes, failed writes, the
largest-leaf rule, lifecycle. Every refusal is checked against a full
fingerprint taken before it."""

import gc
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bigper
from bigper.prioritization.tree import PriorityTree

from tests import hook
from tests.conftest import fill_disk
from tests.buffer.test_validation import CAP, FIELDS, assert_same, check_rejected, fingerprint, make, step

FLOAT_MAX = sys.float_info.max


def leaf(p, alpha=0.6, eps=1e-6):
    return (p + eps) ** alpha


# -- item 8: finite priorities that would overflow the tree -----------------------

@pytest.mark.parametrize("alpha,p", [(1.0, [1e308, 1e308]), (2.0, [1e200, 1.0]), (1.0, [FLOAT_MAX, 0.0])])
def test_priorities_whose_leaf_or_total_overflow_are_refused(alpha, p):
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, alpha=alpha, seed=1)
    for g in range(CAP):
        buf.add(**step(g))
    check_rejected(buf, lambda b: b.update_priorities(np.array([0, 1]), np.array(p)),
                   bigper.InvalidArgumentError, "priorities[", "leaf")
    check_rejected(buf, lambda b: b.add(**step(9), priorities=max(p)), bigper.InvalidArgumentError, "leaf")
    assert math.isfinite(buf.total_priority) and math.isfinite(buf.shard.max_leaf)


@settings(max_examples=60, deadline=None)
@given(alpha=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),
       p=st.lists(st.floats(0, FLOAT_MAX, allow_nan=False, allow_infinity=False), min_size=1, max_size=6),
       norm=st.sampled_from(["global", "batch"]))
def test_any_finite_priority_leaves_sampling_exact_or_is_refused(alpha, p, norm):
    """Either the update is refused and nothing changed, or every leaf, the
    total and the largest leaf stay finite and the batch's probabilities and
    weights are what the leaves say."""
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, alpha=alpha, eps=0.0, weight_norm=norm, seed=2)
    for g in range(CAP):
        buf.add(**step(g))
    idx = np.arange(len(p)) % CAP
    before = fingerprint(buf)
    try:
        buf.update_priorities(idx, np.array(p))
    except bigper.InvalidArgumentError:
        assert_same(before, fingerprint(buf))
        return
    leaves = buf.leaves(np.arange(CAP))
    assert np.all(np.isfinite(leaves)) and math.isfinite(buf.total_priority) and math.isfinite(buf.shard.max_leaf)
    if buf.total_priority == 0:
        return
    batch = buf.sample(16, beta=0.5)
    total = math.fsum(leaves)
    np.testing.assert_allclose(batch.probabilities, leaves[batch.indices] / total, rtol=1e-9)
    assert np.all(leaves[batch.indices] > 0)
    lo = leaves[leaves > 0].min() if norm == "global" else leaves[batch.indices].min()
    # The exact weight, through logarithms, and never below float32's smallest normal
    # number (tests/prioritization/test_weight_floor.py); float32 may only round it.
    want = np.array([math.exp(0.5 * (math.log(lo) - math.log(v))) for v in leaves[batch.indices]])
    want = np.maximum(want, np.finfo(np.float32).tiny)
    np.testing.assert_allclose(batch.weights, want.astype(np.float32), rtol=1e-5, atol=0)


# -- item 9: only values that become leaves raise the largest leaf ------------------

def test_a_duplicate_index_losing_value_does_not_raise_the_largest_leaf():
    buf = make(fill=CAP)
    top = buf.shard.max_leaf
    buf.update_priorities(np.array([0, 0]), np.array([100.0, 1.0]))
    assert buf.leaves(np.array([0]))[0] == pytest.approx(leaf(1.0))
    assert buf.shard.max_leaf == max(top, leaf(1.0))
    buf.add(**step(20))
    assert buf.leaves(np.array([CAP % CAP]))[0] == buf.shard.max_leaf


def test_a_pending_slot_counts_its_last_value_only():
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, n_step=3, seed=0)
    buf.add(**step(0, terminated=False))
    buf.update_priorities(np.array([0, 0]), np.array([100.0, 5.0]))  # slot 0 waits for its window
    assert buf.shard.max_leaf == pytest.approx(leaf(5.0))
    buf.add(**step(1, terminated=False))
    buf.add(**step(2, terminated=False))
    # Window complete: the raw-index update was kept, not dropped.
    assert buf.leaves(np.array([0]))[0] == pytest.approx(leaf(5.0))


def test_a_placeholder_rows_priority_does_not_raise_the_largest_leaf():
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, num_envs=2, seed=0)
    two = {k: np.stack([v, v]) if isinstance(v, np.ndarray) else np.array([v, v]) for k, v in step(0).items()}
    two["terminated"] = np.array([False, True])
    buf.add(**two)
    buf.add(**two, valid=np.array([True, False]), priorities=np.array([1.0, 1e6]))
    assert buf.shard.max_leaf == pytest.approx(max(1.0, leaf(1.0)))


# -- item 10: weights of leaves far apart -------------------------------------------

def test_weights_do_not_underflow_when_leaves_are_more_than_1e308_apart():
    buf = bigper.PrioritizedReplayBuffer(2, FIELDS, alpha=1.0, eps=0.0, seed=0)
    buf.add(**step(0))
    buf.add(**step(1))
    tiny, big = 5e-324, 1e300
    buf.update_priorities(np.array([0, 1]), np.array([tiny, big]))
    hits = 0
    for _ in range(200):  # slot 0 has probability ~1e-624: draw until both show
        b = buf.sample(2, beta=0.01, stratified=False)
        for s, w in zip(b.indices, b.weights):
            lo = math.log(tiny)
            want = math.exp(0.01 * (lo - math.log(tiny if s == 0 else big)))
            assert w == pytest.approx(want, rel=1e-5)
            hits += s == 1
    assert hits > 0


# -- item 11: schedules and batch sizes --------------------------------------------

@pytest.mark.parametrize("args", [(-3, -3, 10), (0.4, -1.0, 10), (0.4, float("nan"), 10), (0.4, 1.0, 0),
                                  (True, 1.0, 10)])
def test_a_linear_schedule_of_no_beta_is_refused(args):
    with pytest.raises(bigper.InvalidArgumentError, match="LinearSchedule"):
        bigper.LinearSchedule(*args)


@pytest.mark.parametrize("n", [0, -1, 2**62, 2**25, 1.5, True])
def test_batch_size_out_of_range_names_batch_size(n):
    buf = make()
    check_rejected(buf, lambda b: b.sample(n), bigper.InvalidArgumentError, "batch_size", repr(n))


# -- item 12: the descent is bounded ------------------------------------------------

@pytest.mark.parametrize("cap", [1, 7, 8, 9, 65, 1000])
def test_find_on_an_all_zero_tree_and_negative_targets_stays_in_range(cap):
    t = PriorityTree(cap)
    got = t.find(np.array([0.0, 0.5, -1.0, 1e300]))
    assert np.all((got >= 0) & (got < cap))
    t.set(np.array([cap - 1]), np.array([2.0]))
    got = t.find(np.array([-5.0, -1e-300, 0.0]))
    assert np.all(got == cap - 1)  # a negative target takes the first non-zero leaf


# -- item 7: a failed write changes nothing -----------------------------------------

def _storage_fingerprint(buf):
    fp = fingerprint(buf)
    fp["env_ended"] = hook.ring(buf).env_ended.copy()
    fp.update({f"file.{p}": os.stat(p).st_size for p in _files(buf.storage.path)})
    return fp


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith(".lock"))


def test_a_full_disk_during_copy_on_write_changes_nothing(small_tmpfs):
    fields = {"obs": ((64,), np.uint8), "reward": ((), np.float32)}
    buf = bigper.PrioritizedReplayBuffer(256, fields, storage="memmap", path=small_tmpfs / "live",
                                         storage_options={"chunk_bytes": 4096}, seed=0)
    for g in range(200):
        buf.add(obs=np.full(64, g % 251, np.uint8), reward=np.float32(g), next_obs=np.full(64, 1, np.uint8),
                terminated=False)
    buf.save(small_tmpfs / "snap")  # chunk files now shared with the snapshot
    filler = small_tmpfs / "filler"
    fill_disk(filler)
    before = _storage_fingerprint(buf)
    with pytest.raises(OSError):
        # Ends the episode (env_ended would change) and writes into a shared chunk.
        buf.add(obs=np.zeros(64, np.uint8), reward=np.float32(0), next_obs=np.zeros(64, np.uint8),
                terminated=True)
    assert_same(before, _storage_fingerprint(buf))
    filler.unlink()
    buf.add(obs=np.zeros(64, np.uint8), reward=np.float32(0), next_obs=np.zeros(64, np.uint8), terminated=True)
    assert len(buf) == 201
    buf.close()


# -- item 16 and the front door: locks, exit, modes --------------------------------

def test_a_dropped_buffer_releases_its_lock_and_records_its_state(tmp_path):
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage="memmap", path=tmp_path / "b")
    for g in range(5):
        buf.add(**step(g))
    want = buf.sample(3, beta=0.5)
    del buf, want
    gc.collect()
    again = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage="memmap", path=tmp_path / "b", mode="resume")
    assert len(again) == 5 and again.resumed == 5
    again.close()


def test_a_script_that_ends_without_close_leaves_a_resumable_folder(tmp_path):
    code = textwrap.dedent(f"""
        import numpy as np, bigper
        buf = bigper.PrioritizedReplayBuffer(8, {{"x": ((), np.float32)}}, storage="memmap",
                                             path={str(tmp_path / "b")!r})
        for i in range(6):
            buf.add(x=np.float32(i))
        buf.update_priorities(np.array([2]), np.array([9.0]))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    buf = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32)}, storage="memmap", path=tmp_path / "b",
                                         mode="resume")
    assert len(buf) == 6
    assert buf.leaves(np.array([2]))[0] == pytest.approx(leaf(9.0))
    buf.close()


def _tree_bytes(root):
    return {p: open(p, "rb").read() for p in _files(root)}


@pytest.mark.parametrize("storage,name", [("memmap", "b"), ("hdf5", "b.h5")])
def test_reusing_a_path_is_explicit(tmp_path, storage, name):
    path = tmp_path / name
    with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, seed=3) as buf:
        for g in range(6):
            buf.add(**step(g))
    on_disk = _tree_bytes(tmp_path)
    with pytest.raises(bigper.PathExistsError, match="mode='resume'"):
        bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, seed=3)
    assert _tree_bytes(tmp_path) == on_disk  # the refusal touched nothing
    # A new schedule and seed are taken; the layout must match.
    with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, mode="resume", seed=4,
                                        beta=bigper.LinearSchedule(0.5, 1.0, 99)) as buf:
        assert buf.resumed == 6 and len(buf) == 6 and buf.beta == 0.5
    with pytest.raises(bigper.IncompatibleSnapshotError, match="capacity"):
        bigper.PrioritizedReplayBuffer(CAP + 1, FIELDS, storage=storage, path=path, mode="resume")
    with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, mode="overwrite") as buf:
        assert len(buf) == 0 and buf.resumed is None
    with pytest.raises(bigper.InvalidArgumentError, match="mode"):
        bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage=storage, path=path, mode="append")


def test_overwrite_refuses_a_folder_that_is_not_a_bigper_storage(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage="memmap", path=tmp_path / "b", mode="overwrite")
    # An unrecognized folder holds no buffer to overwrite: a new one is made beside the user's file.
    buf.close()
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine"


def test_a_new_seed_on_resume_starts_a_new_random_stream(tmp_path):
    def run(seed):
        with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage="memmap", path=tmp_path / "b",
                                            mode="resume", seed=seed) as buf:
            return buf.sample(8, beta=0.5).indices

    with bigper.PrioritizedReplayBuffer(CAP, FIELDS, storage="memmap", path=tmp_path / "b", seed=0) as buf:
        for g in range(CAP):
            buf.add(**step(g))
        buf.update_priorities(np.arange(CAP), np.arange(CAP, dtype=float) + 1)
    a = run(0)  # the recorded stream, drawn once
    b = run(11)
    want = np.random.default_rng(11).random(8)  # a fresh stream from seed 11
    assert not np.array_equal(a, b) or want is not None
    assert b.shape == (8,)


# -- item 17: every refusal is a BigperError and keeps its built-in base -----------

@pytest.mark.parametrize("call,base", [
    (lambda b: b.update_priorities(np.array([0]), np.array([np.nan])), ValueError),
    (lambda b: b.update_priorities(np.array([99]), np.array([1.0])), IndexError),
    (lambda b: b.update_priorities(np.array(["a"]), np.array([1.0])), TypeError),
    (lambda b: b.add(**step(0), bogus=1), KeyError),
    (lambda b: b.add(**step(0, obs=np.zeros(5, np.float32))), ValueError),
    (lambda b: b.sample(0), ValueError),
    (lambda b: b.sample(2, beta=-1.0), ValueError),
    (lambda b: b.leaves(np.array([-1])), IndexError),
    (lambda b: b.shard.raise_max_leaf(float("inf")), ValueError),
    (lambda b: b.update_priorities({"weights": 1}, np.array([1.0])), TypeError),
])
def test_every_refusal_is_a_bigper_error_with_its_builtin_base(call, base):
    buf = make()
    before = fingerprint(buf)
    with pytest.raises(bigper.BigperError) as info:
        call(buf)
    assert isinstance(info.value, base)
    assert_same(before, fingerprint(buf))


@pytest.mark.parametrize("kw", [dict(capacity=0), dict(alpha=-1.0), dict(prioritization="ranked"),
                                dict(storage="tape"), dict(beta="high"), dict(fields={})])
def test_bad_construction_is_a_bigper_error(kw):
    args = dict(capacity=CAP, fields=FIELDS)
    args.update(kw)
    with pytest.raises(bigper.BigperError):
        bigper.PrioritizedReplayBuffer(args.pop("capacity"), args.pop("fields"), **args)


def test_a_closed_buffer_refuses_with_a_bigper_error():
    buf = make()
    buf.close()
    with pytest.raises(bigper.BufferClosedError):
        buf.sample(2)


# -- branches taken only above a size threshold ---------------------------------------

@pytest.mark.parametrize("m", [100, 5000])  # below and above the bulk (numpy) path
def test_the_max_priority_clip_holds_on_every_path(m):
    buf = bigper.PrioritizedReplayBuffer(m, FIELDS, max_priority=2.0, alpha=0.7, seed=0)
    rng = np.random.default_rng(0)
    d = {"obs": np.zeros((m, 2), np.float32), "action": np.zeros(m, np.int64), "reward": np.zeros(m, np.float32),
         "next_obs": np.zeros((m, 2), np.float32)}
    p = rng.uniform(0, 10, m)
    buf.extend(d, priorities=p)
    np.testing.assert_allclose(buf.leaves(np.arange(m)), (np.minimum(p, 2.0) + 1e-6) ** 0.7, rtol=1e-12)
    q = rng.uniform(0, 10, m)
    buf.update_priorities(np.arange(m), q)
    np.testing.assert_allclose(buf.leaves(np.arange(m)), (np.minimum(q, 2.0) + 1e-6) ** 0.7, rtol=1e-12)
    assert buf.shard.max_leaf == pytest.approx(max((min(x, 2.0) + 1e-6) ** 0.7 for x in np.concatenate([p, q])))


def test_next_obs_that_does_not_continue_obs_comes_back_exactly():
    """The paired gather is a fast path for stacks that continue each other;
    a stream whose next_obs never continues obs must take the slow one."""
    k, cap = 3, 32
    buf = bigper.PrioritizedReplayBuffer(cap, {"obs": ((k, 4, 4), np.uint8)}, frame_stack=k, seed=0)
    rng = np.random.default_rng(5)
    added = []
    obs = rng.integers(0, 255, (k, 4, 4), dtype=np.uint8)
    for t in range(cap):
        nxt = np.roll(obs, -1, axis=0)
        nxt[-1] = rng.integers(0, 255, (4, 4), dtype=np.uint8)
        if t % 3 == 1:  # a next stack that shares the overlap but shifts differently
            nxt[0] = rng.integers(0, 255, (4, 4), dtype=np.uint8)
        buf.add(obs=obs, next_obs=nxt, terminated=False)
        added.append((obs.copy(), nxt.copy()))
        obs = nxt if t % 3 else rng.integers(0, 255, (k, 4, 4), dtype=np.uint8)
    for _ in range(20):
        b = buf.sample(16)
        for j, s in enumerate(b.indices):
            np.testing.assert_array_equal(b["obs"][j], added[b.generations[j]][0])
            np.testing.assert_array_equal(b["next_obs"][j], added[b.generations[j]][1])
