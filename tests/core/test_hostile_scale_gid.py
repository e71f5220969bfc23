"""``expected_gid`` / ``first_wrong_gid`` / ``gid_of`` (the ring's transition numbers,
derived in chunks) at the ends of what a record may say.

A state read from disk has no ``gid`` (it follows from ``count``): ``check_state``
derives it from the recorded ``count`` before anything else about the count is
known to be sane. A crafted count must be refused as the count, naming it,
never overflow int64 into a wrong gid, raise a raw numpy error, or allocate
more than the ring's capacity; counts near the bound give the ring's rule
exactly (python ints as the reference).
"""

from __future__ import annotations

import numpy as np
import pytest

import bigper
from bigper.core.recorded import BIG
from bigper.core.ring import expected_gid, first_wrong_gid, gid_of
from bigper.core.statecheck import check_state
from bigper.errors import CorruptSnapshotError


def _reference(count: int, capacity: int, slots) -> list:
    out = []
    for s in slots:
        if s >= count:
            out.append(-1)
        else:
            out.append(s + (count - 1 - s) // capacity * capacity)
    return out


@pytest.mark.parametrize("count", [BIG - 1, BIG - 2, BIG - 7, BIG // 3, 2**40 + 3, 1])
@pytest.mark.parametrize("capacity", [1, 7, 1000, 2**20 + 3])
def test_counts_near_the_bound_give_the_rings_rule(count, capacity):
    slots = sorted({0, 1, capacity // 2, capacity - 1} & set(range(capacity)))
    want = _reference(count, capacity, slots)
    got = expected_gid(count, capacity, chunk=333)
    assert got[slots].tolist() == want
    assert (got[got >= 0] < count).all() and (got[got >= 0] % capacity == np.flatnonzero(got >= 0)).all()
    assert gid_of(np.asarray(slots, dtype=np.int64), count, capacity).tolist() == want
    assert first_wrong_gid(got, count, chunk=333) == -1
    bad = got.copy()
    bad[-1] -= capacity  # (one lap back: the number a slot held before)
    assert first_wrong_gid(bad, count, chunk=333) == capacity - 1


@pytest.fixture(scope="module")
def recorded():
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"x": ((), np.uint8)})
    buf.extend({"x": np.zeros(100, np.uint8)})
    meta, arrays = buf.state_dict()
    cfg = buf.config
    buf.close()
    return cfg, meta, {k: np.array(v) for k, v in arrays.items() if k != "gid"}  # (as read from disk)


@pytest.mark.parametrize("count", [BIG, BIG + 1, 2**63, 2**64, 2**200, -1, -(2**63), True, 1.0, 100.0, "100", None,
                                   [100]])
def test_a_crafted_count_is_refused_as_the_count_when_gid_is_derived(recorded, count):
    cfg, meta, arrays = recorded
    with pytest.raises(CorruptSnapshotError, match="count must be an int in"):
        check_state(cfg, dict(meta, count=count), arrays)


@pytest.mark.parametrize("count", [BIG - 1, 2**40 + 3, 101, 64, 0, 63])
def test_a_count_in_range_gets_bigpers_verdict_and_its_gid_is_the_rules(recorded, count):
    """A plausible count that is not this ring's: refused by bigper (it leaves a slot the
    status says is written without a gid), or taken with the gid the rule gives.
    (A full ring's derived gid cannot tell 100 adds from 101: issue 43's design.)"""
    cfg, meta, arrays = recorded
    try:
        check_state(cfg, dict(meta, count=count), arrays)
    except CorruptSnapshotError as e:
        assert count < 64 and "gid -1 and status" in str(e), e
    else:
        assert count >= 64
        assert expected_gid(count, 64).tolist() == _reference(count, 64, range(64))
    check_state(cfg, meta, arrays)  # (the count it recorded: taken)

