"""Hostile input to sequence buffers (issue 25 attack): each test is a
finding that failed on the code before its fix, or a limit probed."""

import numpy as np
import pytest

import bigper
from bigper import Sequence
from bigper.config import Config

from tests.buffer.test_validation import check_rejected

FIELDS = {"obs": ((2,), np.float32)}


def add_steps(buf, n, end_every=7, g0=0):
    for i in range(g0, g0 + n):
        buf.add(obs=np.full(2, i, np.float32), next_obs=np.full(2, i + 1, np.float32),
                terminated=(i % end_every == end_every - 1), truncated=False)


@pytest.mark.parametrize("name", ["length", "burn_in", "period"])
@pytest.mark.parametrize("value", [2**63, 2**64, 2**100])
def test_a_sequence_int_beyond_int64_is_refused_at_construction(name, value):
    """The item kernels compute in int64: a value they cannot hold was
    accepted and the first add crashed with a raw OverflowError."""
    kw = {"length": 3, name: value}
    with pytest.raises(bigper.InvalidArgumentError) as info:
        Sequence(**kw)
    assert name in str(info.value) and str(value) in str(info.value)
    with pytest.raises(bigper.InvalidArgumentError) as info:
        Config.from_dict({"capacity": 50, "fields": {"obs": [[2], "<f4"]}, "sequence": kw})
    assert name in str(info.value)


def test_the_largest_period_still_serves_one_item_an_episode():
    buf = bigper.PrioritizedReplayBuffer(50, FIELDS, sequence=Sequence(3, period=2**62))
    add_steps(buf, 60)
    starts = {int(g) for g in buf.sample(16).generations}
    assert starts and all(s % 7 == 0 for s in starts)  # episodes start every 7 steps


def _used(seq=None, cap=30, alpha=1.0, prioritization="proportional"):
    buf = bigper.PrioritizedReplayBuffer(cap, FIELDS, sequence=seq or Sequence(3, burn_in=2, period=2),
                                         alpha=alpha, eps=0.0, seed=3, prioritization=prioritization)
    add_steps(buf, 40, end_every=9)
    return buf


def test_huge_finite_per_step_errors_reduce_to_a_finite_priority():
    """``eta * max + (1 - eta) * mean`` of finite errors is finite (<= max);
    the mean was a sum over the steps divided after, which overflowed to
    inf and refused good input with 'got inf' (a value never given). With
    alpha = 0.5 such a priority is a leaf far below the tree's limit."""
    buf = _used(alpha=0.5)
    b = buf.sample(4)
    big = np.finfo(np.float64).max
    buf.update_priorities(b, np.full((4, 5), big))
    last = int(b.indices[-1])
    np.testing.assert_allclose(buf.leaves([last])[0], np.sqrt(big), rtol=1e-12)
    half = np.full((4, 5), big / 2)
    half[:, -1] = big  # a mix: the reduction lies between mean and max
    buf.update_priorities(b, half)
    got = buf.leaves([last])[0] ** 2
    assert np.isfinite(got) and big / 2 * (1 - 1e-12) <= got <= big


RAGGED = [[1.0, 2.0], [1.0]] * 2


def _ragged_case(case, b):
    """(target, priorities) of a sampled batch ``b`` with one ragged part."""
    d = {"indices": b.indices, "generations": b.generations, "mask": b.mask}
    return {
        "batch, ragged priorities": (b, RAGGED),
        "dict, ragged priorities": (d, RAGGED),
        "indices, ragged priorities": (b.indices, RAGGED),
        "dict, ragged indices": (dict(d, indices=[[0, 1], [2]] * 2), np.ones((4, 5))),
        "ragged indices": ([[0, 1], [2]] * 2, np.ones(4)),
        "dict, ragged mask": (dict(d, mask=[[True] * 5, [True]] * 2), np.ones((4, 5))),
    }[case]


@pytest.mark.parametrize("case,what", [
    ("batch, ragged priorities", "priorities"), ("dict, ragged priorities", "priorities"),
    ("indices, ragged priorities", "priorities"), ("dict, ragged indices", "indices"),
    ("ragged indices", "indices"), ("dict, ragged mask", "mask"),
])
def test_ragged_input_is_refused_naming_it(case, what):
    """A ragged list for the priorities, the indices or the mask raised
    numpy's raw ValueError from np.asarray (not a BigperError)."""
    buf = _used()
    tgt, pr = _ragged_case(case, buf.sample(4))
    check_rejected(buf, lambda x: x.update_priorities(tgt, pr), bigper.InvalidTypeError, what)


@pytest.mark.parametrize("what", ["valid", "priorities", "obs"])
def test_ragged_extend_input_is_refused_naming_it(what):
    """The same for extend's valid rows, priorities and data of a vector env."""
    buf = bigper.PrioritizedReplayBuffer(30, FIELDS, num_envs=2, sequence=Sequence(2, burn_in=1))
    data = {"obs": np.zeros((3, 2, 2), np.float32), "next_obs": np.zeros((3, 2, 2), np.float32),
            "terminated": np.zeros((3, 2), bool), "truncated": np.zeros((3, 2), bool)}
    buf.extend(data)
    kw = {"valid": None, "priorities": None}
    ragged = [[True, True], [True], [True, False]]
    if what == "obs":
        data = dict(data, obs=[[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    else:
        kw[what] = ragged
    check_rejected(buf, lambda x: x.extend(data, **kw), bigper.InvalidTypeError, what)


def _pending_key_above_max_leaf(arrays, meta, key):
    arrays = {k: v.copy() for k, v in arrays.items()}
    s = np.flatnonzero(arrays["seq_status"] == 2)  # PENDING
    assert s.size, "the state must hold a pending item"
    arrays["seq_pending"][s[0]] = key
    return arrays, int(s[0])


@pytest.mark.parametrize("key", [1e308, 1000.0])
def test_a_pending_key_above_max_leaf_is_a_corrupt_state(tmp_path, key):
    """Every key a buffer writes counts toward max_leaf, so a pending key above
    it was never written; it was accepted, and once the item completed its
    leaf exceeded max_leaf (1e308: above the tree's limit, the root overflows
    with two such)."""
    from tests._hostile_snapshot_cases import fingerprint as disk
    from tests._hostile_snapshot_cases import put_state, refused

    seq = Sequence(4, burn_in=1, period=2)
    buf = bigper.PrioritizedReplayBuffer(30, FIELDS, sequence=seq)
    add_steps(buf, 20, end_every=1000)
    meta, arrays = buf.state_dict()
    crafted, s = _pending_key_above_max_leaf(arrays, meta, key)
    check_rejected(buf, lambda x: x.load_state(meta, crafted), bigper.CorruptSnapshotError, "seq_pending", str(s))
    # a snapshot with it: load refuses, the snapshot unchanged
    snap = buf.save(tmp_path / "snap")
    put_state(snap, "seq_pending", crafted["seq_pending"])
    assert "seq_pending" in str(refused(bigper.CorruptSnapshotError, snap))
    # a live memmap folder with it: resume and verify refuse, the folder unchanged
    live = bigper.PrioritizedReplayBuffer(30, FIELDS, sequence=seq, storage="memmap", path=tmp_path / "live")
    add_steps(live, 20, end_every=1000)
    live.close()
    np.save(tmp_path / "live" / "state" / "seq_pending.npy", crafted["seq_pending"], allow_pickle=False)
    before = disk(tmp_path / "live")
    with pytest.raises(bigper.CorruptSnapshotError) as info:
        bigper.PrioritizedReplayBuffer(30, FIELDS, sequence=seq, storage="memmap", path=tmp_path / "live",
                                       mode="resume")
    assert "seq_pending" in str(info.value)
    assert disk(tmp_path / "live") == before


def test_sampling_before_any_item_completes_names_sequence_items():
    """Only placeholder rows and pending items: the refusal spoke of
    transitions and n_step, neither of which a sequence buffer has."""
    buf = bigper.PrioritizedReplayBuffer(40, FIELDS, num_envs=3, sequence=Sequence(4, burn_in=1))
    z = np.zeros((2, 3, 2), np.float32)
    buf.extend({"obs": z, "next_obs": z, "terminated": np.zeros((2, 3), bool)}, valid=np.zeros((2, 3), bool))
    buf.extend({"obs": z, "next_obs": z, "terminated": np.zeros((2, 3), bool)})
    msg = check_rejected(buf, lambda x: x.sample(2), bigper.InvalidArgumentError, "sequence item", "length=4")
    assert "n_step" not in msg
