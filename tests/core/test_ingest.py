"""The exact-type shortcut of ``add`` (``Ingest._exact_one``) gives the rows the full
checks give, or steps aside (None) so that the full checks raise their error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bigper
from bigper.errors import BigperError

FIELDS = {"obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
          "flag": ((), np.bool_), "small": ((), np.int16)}


def _full(ing, step):
    """The full checks' rows (each with its row axis), or the error they raise."""
    try:
        rows = ing._check(step, (), "add", "")
    except BigperError as e:
        return type(e)
    return {n: v[None] for n, v in rows.items()}


def _values(name):
    shape, dt = FIELDS.get(name, ((), np.bool_))
    scalars = st.one_of(st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.sampled_from([np.float32(1.5), np.float64(-2.25), np.int64(7), np.int16(-3),
                                         np.bool_(True), np.uint8(200), "x", None]))
    arrays = st.sampled_from([np.zeros(shape, dt), np.ones((3,), np.float64), np.zeros((2,), np.float32),
                              np.arange(3, dtype=np.float32)[::-1], np.zeros((), np.float32),
                              np.zeros((1, *shape), dt)])
    return st.one_of(scalars, arrays)


def _base():
    return {"obs": np.arange(3, dtype=np.float32), "next_obs": np.ones(3, np.float32), "action": np.int64(2),
            "reward": np.float32(0.5), "flag": np.bool_(False), "small": np.int16(9), "terminated": False}


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_the_shortcut_agrees_with_the_full_checks(data):
    buf = bigper.PrioritizedReplayBuffer(8, FIELDS)
    ing = buf._ingest
    step = _base()
    for n in data.draw(st.lists(st.sampled_from(sorted(ing.inputs) + ["unknown"]), unique=True, max_size=3)):
        step[n] = data.draw(_values(n), label=n)
    for n in data.draw(st.lists(st.sampled_from(sorted(step)), unique=True, max_size=1), label="dropped"):
        del step[n]
    fast = ing._exact_one(step)
    full = _full(ing, step)
    if fast is None:
        return  # the full checks decide (add goes through them)
    assert isinstance(full, dict), f"the shortcut accepted {step!r}, the full checks raised {full}"
    assert fast.keys() == full.keys()
    for n in fast:
        assert fast[n].dtype == full[n].dtype and fast[n].shape == full[n].shape, n
        assert np.array_equal(fast[n], full[n], equal_nan=True), n


def test_the_shortcut_takes_the_common_steps():
    ing = bigper.PrioritizedReplayBuffer(8, FIELDS)._ingest
    step = _base()
    assert ing._exact_one(step) is not None
    step.update(action=3, reward=0.25, flag=True, terminated=np.bool_(False), truncated=True)
    assert ing._exact_one(step) is not None


@pytest.mark.parametrize("step, err", [
    ({"action": 1, "reward": 0.5, "flag": True, "small": np.int16(1), "next_obs": np.zeros(3, np.float32)},
     bigper.UnknownFieldError),  # no obs
    ({"obs": np.zeros(3, np.float32), "action": 2**63, "reward": 0.5, "flag": True, "small": np.int16(1),
      "next_obs": np.zeros(3, np.float32)},
     None),  # out of int64 range: the full checks' numpy conversion decides
    ({"obs": np.zeros(3, np.float32), "action": 1, "reward": 0.5, "flag": True, "small": np.int16(1),
      "extra": 1, "next_obs": np.zeros(3, np.float32)}, bigper.UnknownFieldError),
    ({"obs": np.zeros(4, np.float32), "action": 1, "reward": 0.5, "flag": True, "small": np.int16(1),
      "next_obs": np.zeros(3, np.float32)},
     bigper.InvalidArgumentError),
    ({"obs": np.zeros(3, np.float32), "action": 1.5, "reward": 0.5, "flag": True, "small": np.int16(1),
      "next_obs": np.zeros(3, np.float32)},
     bigper.InvalidArgumentError),  # not integral: refused by value (3.0 would be stored)
])
def test_what_the_shortcut_leaves_to_the_full_checks(step, err):
    buf = bigper.PrioritizedReplayBuffer(8, FIELDS)
    assert buf._ingest._exact_one(step) is None
    if err is not None:
        with pytest.raises(err):
            buf.add(**step)
        assert len(buf) == 0


def test_python_scalars_are_stored_as_the_fields_types():
    buf = bigper.PrioritizedReplayBuffer(8, FIELDS)
    buf.add(obs=np.arange(3, dtype=np.float32), next_obs=np.zeros(3, np.float32), action=5, reward=0.1, flag=True, small=np.int16(-4),
            terminated=np.bool_(True))
    b = buf.gather(np.array([0]))
    assert b["action"].dtype == np.int64 and b["action"][0] == 5
    assert b["reward"].dtype == np.float32 and b["reward"][0] == np.float32(0.1)
    assert b["flag"][0] and b["small"][0] == -4 and b["terminated"][0] and not b["truncated"][0]


@pytest.mark.parametrize("reward, taken", [
    (1e300, False), (-3.5e38, False), (3.4028235677973366e38, False),  # the first float32 rounds to inf
    (3.4028235677973362e38, True), (float(np.finfo(np.float32).max), True),
    (float("nan"), True), (float("inf"), True), (-0.0, True), (1e-300, True),
    (np.float64(1e300), False), (np.float64(-0.1), True),  # np.float64 (np.sign(reward)) takes the shortcut too
])
def test_the_shortcut_steps_aside_for_a_float_that_becomes_inf(reward, taken):
    ing = bigper.PrioritizedReplayBuffer(8, FIELDS)._ingest
    step = dict(_base(), reward=reward)
    rows = ing._exact_one(step)
    assert (rows is not None) == taken
    if rows is not None:
        assert np.array_equal(rows["reward"], np.array([reward], np.float32), equal_nan=True)
