"""Attack on ``check_state``'s "a slot is written iff it is below count" rule
(``statecheck._first_unwritten_mismatch``), which no longer builds the derived gid of
a state read from disk (one without ``gid``) unless its unit reads it
(``READS_GID``: sequences).

For a plain buffer, an n-step buffer and a sequence buffer, not wrapped and
wrapped, the recorded ``count`` is crafted (0, 1, capacity - 1, capacity,
capacity + 1, the recorded one, huge) and the ``status`` array too (an empty
slot below count, a written slot at or after it, on both sides of the ring's
cursor). The verdict is compared with the rule before the change, written here
from its definition (derive ``gid`` from ``count``; a slot is refused where
``(gid < 0) != (status == EMPTY)``, naming the first such slot, its gid and
status), and with ``check_state`` given that gid recorded (the path of a state
held in memory): the same refusal, word for word, or the same acceptance. The
arrays given are never changed. A plain ring's check no longer holds a derived
gid (8 bytes a slot): its peak memory is measured.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import bigper
from bigper import Sequence
from bigper.config import Config
from bigper.core.recorded import BIG
from bigper.core.statecheck import check_state
from bigper.core.units import Sequences, Transitions, unit_class
from bigper.errors import CorruptSnapshotError

C = 16
EMPTY, LIVE = 0, 1


def _ref_gid(count: int, c: int) -> list:
    """The ring's rule in Python ints: slot s holds transition s + k*c, the last one below count."""
    return [s + (count - 1 - s) // c * c if s < count else -1 for s in range(c)]


def _old_verdict(status: np.ndarray, count: int, c: int):
    """The message of the rule before the change, or None."""
    gid = _ref_gid(count, c)
    for s in range(c):
        if (gid[s] < 0) != (status[s] == EMPTY):
            return f"slot {s} has gid {gid[s]} and status {status[s]} (written iff not empty)"
    return None


def _feed(buf, steps: int, kind: str) -> None:
    for i in range(steps):
        kw = {"obs": np.full(2, i, np.float32), "next_obs": np.full(2, i + 1, np.float32)}
        buf.add(**kw, action=np.int64(i % 3), reward=np.float32(i), terminated=(i % 7 == 6), truncated=False)


def _state(kind: str, steps: int):
    fields = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
    kw = {"n_step": 3} if kind == "nstep" else {"sequence": Sequence(3, period=2)} if kind == "seq" else {}
    buf = bigper.PrioritizedReplayBuffer(C, fields, seed=1, **kw)
    _feed(buf, steps, kind)
    meta, arrays = buf.state_dict()
    cfg = buf.config
    arrays = {k: np.array(v) for k, v in arrays.items()}
    buf.close()
    return cfg, meta, arrays


STATES = {(kind, steps): None for kind in ("plain", "nstep", "seq") for steps in (10, 37)}


@pytest.fixture(scope="module")
def states():
    return {key: _state(*key) for key in STATES}


def _verdict(cfg, meta, arrays):
    try:
        check_state(cfg, meta, arrays)
    except CorruptSnapshotError as e:
        return str(e)
    return None


def _crafts(status: np.ndarray, count: int, recorded: int):
    """(name, status) variants: as recorded, and each side of the written/empty border broken."""
    out = [("as recorded", status)]
    n = min(count, C)
    cursor = recorded % C
    for name, slot, value in (("first slot empty", 0, EMPTY), ("last slot below count empty", n - 1, EMPTY),
                              ("slot at count written", n, LIVE), ("last slot written", C - 1, LIVE),
                              ("slot before the cursor empty", cursor - 1, EMPTY),
                              ("slot at the cursor empty", cursor, EMPTY),
                              ("slot after the cursor written", cursor + 1, LIVE),
                              ("slot at the cursor written", cursor, LIVE)):
        if 0 <= slot < C:
            s = status.copy()
            s[slot] = value
            out.append((name, s))
    s = status.copy()
    s[:] = LIVE
    out.append(("every slot written", s))
    out.append(("every slot empty", np.zeros_like(status)))
    return out


@pytest.mark.parametrize("key", list(STATES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_the_written_iff_below_count_rule_refuses_as_the_old_one(states, key):
    cfg, meta, arrays = states[key]
    recorded = int(meta["count"])
    assert unit_class(cfg) is (Sequences if key[0] == "seq" else Transitions)
    disk = {k: v for k, v in arrays.items() if k != "gid"}  # (as read from disk: gid derived)
    counts = sorted({0, 1, C - 1, C, C + 1, recorded, recorded + 1, recorded - 1, 2 * C + 5, BIG - 1, BIG - C})
    tried = refused = 0
    for count in counts:
        if count < 0:
            continue
        for name, status in _crafts(arrays["status"], count, recorded):
            a = dict(disk, status=status)
            before = {k: v.tobytes() for k, v in a.items()}
            m = dict(meta, count=count)
            old = _old_verdict(status, count, C)
            got = _verdict(cfg, m, a)
            with_gid = _verdict(cfg, m, dict(a, gid=np.asarray(_ref_gid(count, C), dtype=np.int64)))
            where = (key, count, name, got)
            assert {k: v.tobytes() for k, v in a.items()} == before, where  # (nothing given is changed)
            tried += 1
            if old is not None:
                refused += 1
                assert got is not None and got.endswith(old), (where, old)
                assert with_gid == got, (where, with_gid)
            else:
                assert got is None or "written iff not empty" not in got, where
                assert got == with_gid, (where, with_gid)
    assert tried > 60 and refused > 20, (tried, refused)
    assert _verdict(cfg, meta, disk) is None  # (the state as recorded: taken)


@pytest.mark.parametrize("kind", ["plain", "nstep", "seq"])
def test_a_state_taken_with_a_derived_gid_loads_into_the_same_buffer(kind):
    """The acceptance's other side: a state taken without its gid gives the buffer the one
    that recorded it has (its gid what count gives), sampling as it does."""
    fields = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
    kw = {"n_step": 3} if kind == "nstep" else {"sequence": Sequence(3, period=2)} if kind == "seq" else {}
    a = bigper.PrioritizedReplayBuffer(C, fields, seed=1, **kw)
    b = bigper.PrioritizedReplayBuffer(C, fields, seed=2, **kw)
    try:
        for buf in (a, b):
            _feed(buf, 37, kind)
        a.update_priorities(x := a.sample(4), np.arange(1.0, 5.0) if kind != "seq" else np.ones((4, 3)))
        meta, arrays = a.state_dict()
        disk = {k: np.array(v) for k, v in arrays.items() if k != "gid"}
        b.load_state(meta, disk)
        assert np.array_equal(b._ring.gid, np.asarray(_ref_gid(int(meta["count"]), C), dtype=np.int64))
        assert np.array_equal(b._ring.gid, a._ring.gid) and np.array_equal(b._ring.status, a._ring.status)
        for _ in range(3):
            p, q = a.sample(5), b.sample(5)
            assert np.array_equal(p.indices, q.indices) and np.array_equal(p.weights, q.weights)
            assert np.array_equal(p["obs"], q["obs"])
    finally:
        a.close()
        b.close()


def test_a_plain_rings_check_holds_no_derived_gid():
    """A 4M-slot ring read from disk: the check's temporaries stay far below the 32 MB a
    derived gid takes (the old rule built it, and compared it: 36 MB and more)."""
    c = 1 << 22
    small = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.uint8)})
    small.extend({"x": np.zeros(8, np.uint8)})
    meta, _ = small.state_dict()
    d = small.config.to_dict()
    small.close()
    cfg = Config.from_dict(dict(d, capacity=c))
    arrays = {"status": np.ones(c, np.uint8), "ends": np.zeros(c, np.uint8), "pending": np.zeros(0),
              "leaves": np.ones(c)}
    meta = dict(meta, count=c + 12345, max_leaf=1.0)
    check_state(cfg, meta, arrays)  # (warm: numba, imports)
    tracemalloc.start()
    try:
        check_state(cfg, meta, arrays)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    bad = dict(arrays, status=arrays["status"].copy())
    bad["status"][c - 1] = EMPTY
    g = (c - 1) + (c + 12345 - 1 - (c - 1)) // c * c  # (the ring's rule for the last slot)
    with pytest.raises(CorruptSnapshotError, match=f"slot {c - 1} has gid {g} and status 0"):
        check_state(cfg, meta, bad)
