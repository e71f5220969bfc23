"""What the round-trip matrix (tests/snapshot/test_roundtrip_matrix.py) found, each as a direct test."""

from __future__ import annotations

import numpy as np
import pytest

import bigper

from tests._roundtrip import held

NONE = np.zeros(0, dtype=np.int64)


def test_from_hdf5_of_an_n_step_file_whose_pending_keys_were_raised_opens(tmp_path):
    p = tmp_path / "b.h5"
    with bigper.PrioritizedReplayBuffer(capacity=20, fields={"obs": ((), np.int64), "reward": ((), np.float32)},
                                        n_step=3, storage="hdf5", path=p) as buf:
        for i in range(6):
            buf.add(obs=i, reward=1.0, next_obs=i + 1)
        b = buf.sample(4)
        buf.update_priorities(b, np.full(4, 50.0))
        for i in range(6, 8):  # waiting for their 3-step window: pending, at the raised key
            buf.add(obs=i, reward=1.0, next_obs=i + 1)
        pending = buf.state_dict()[1]["pending"]
        assert pending.max() > 1.0
    with bigper.PrioritizedReplayBuffer.from_hdf5(p) as ds:
        data, keys = held(ds)
        assert data["obs"].tolist() == list(range(6)) and (keys == 1.0).all()


def test_from_hdf5_of_a_sequence_file_whose_pending_keys_were_raised_opens(tmp_path):
    p = tmp_path / "s.h5"
    with bigper.PrioritizedReplayBuffer(capacity=20, fields={"obs": ((), np.int64)}, storage="hdf5", path=p,
                                        sequence=bigper.Sequence(4)) as buf:
        for i in range(9):
            buf.add(obs=i, next_obs=i + 1)
        b = buf.sample(2)
        buf.update_priorities(b, np.full((2, 4), 50.0))
        for i in range(9, 14):  # an item starts at 12, after the update
            buf.add(obs=i, next_obs=i + 1)
        assert buf.state_dict()[1]["seq_pending"].max() > 1.0
    with bigper.PrioritizedReplayBuffer.from_hdf5(p) as ds:
        assert ds.sample(3)["obs"].shape == (3, 4)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_gather_of_no_index_gives_empty_fields(compression, tmp_path):
    kw = dict(capacity=16, fields={"obs": ((2, 8, 8), np.uint8), "a": ((3,), np.float16)}, frame_stack=2,
              compression=compression)
    p = tmp_path / "b.h5"
    with bigper.PrioritizedReplayBuffer(**kw, storage="hdf5", path=p) as buf:
        for i in range(5):
            o = np.full((2, 8, 8), i, np.uint8)
            buf.add(obs=o, next_obs=o + 1, a=np.zeros(3, np.float16))
        got = buf.gather(NONE)
        assert got["obs"].shape == (0, 2, 8, 8) and got["next_obs"].shape == (0, 2, 8, 8)
        assert got["a"].shape == (0, 3) and got["a"].dtype == np.float16
    with bigper.PrioritizedReplayBuffer.from_hdf5(p) as ds:
        got = ds.gather(NONE)
        assert got["obs"].shape == (0, 2, 8, 8) and got["a"].shape == (0, 3)
