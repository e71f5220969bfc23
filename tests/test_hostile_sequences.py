"""Hostile input to sequence buffers (issue 25 attack): each test is a
finding that failed on the code before its fix, or a limit probed."""

import numpy as np
import pytest

import bigper
from bigper import Sequence
from bigper.config import Config

from .test_validation import check_rejected

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
