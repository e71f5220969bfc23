"""Attacks on the SB3 drop-in's newer surfaces (issue 26): each case failed on
the code before its fix. A failed ``load_replay_buffer`` closed the model's
buffer first (a missing file, a FIFO, another algorithm's pickle lost the
buffer training was using); another algorithm's pickle was accepted and broke
``learn`` later; ``from_buffer`` refused the numpy int that the constructor
takes for ``beta_steps``; ``n_envs=0`` raised ZeroDivisionError."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

th = pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402

import bigper  # noqa: E402
from bigper.errors import (  # noqa: E402
    BigperError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
)
from bigper.integrations import sb3 as bsb3  # noqa: E402

from tests._hostile_snapshot_cases import fingerprint  # noqa: E402
from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)

OBS = spaces.Box(-10, 10, (3,), np.float32)
ACT = spaces.Discrete(2)


def small(cls, env, tmp_path, name="live", **kw):
    rbk = {"storage": "memmap", "path": str(tmp_path / name)} if tmp_path is not None else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls("MlpPolicy", env, device="cpu", seed=0, learning_starts=30, buffer_size=300, batch_size=16,
                   policy_kwargs={"net_arch": [16]}, replay_buffer_kwargs=rbk, **kw)


def held(rb):
    """What the buffer holds and samples: its count, priorities and one seeded batch."""
    core = rb.buffer
    n = len(core)
    return n, core.leaves(np.arange(n)).tolist()


def _bad_paths(tmp_path):
    fifo = tmp_path / "fifo.pkl"
    os.mkfifo(fifo)
    link = tmp_path / "link.pkl"
    link.symlink_to(tmp_path / "elsewhere.pkl")
    (tmp_path / "elsewhere.pkl").write_bytes(b"not a pickle")
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"\x80\x05not a pickle at all")
    return {"missing": tmp_path / "nope.pkl", "fifo": fifo, "symlink to junk": link, "junk": junk}


@pytest.mark.parametrize("kind", ["missing", "fifo", "symlink to junk", "junk"])
@pytest.mark.parametrize("storage", ["memmap", "memory"])
def test_a_failed_load_replay_buffer_keeps_the_models_buffer(tmp_path, kind, storage):
    model = small(bsb3.PrioritizedDQN, "CartPole-v1", tmp_path if storage == "memmap" else None)
    model.learn(60)
    rb = model.replay_buffer
    path = _bad_paths(tmp_path)[kind]
    before, disk = held(rb), fingerprint(tmp_path)
    with pytest.raises(BigperError) as info:
        model.load_replay_buffer(path)
    assert str(path.name) in str(info.value)
    assert model.replay_buffer is rb and not rb.closed
    assert held(rb) == before and fingerprint(tmp_path) == disk
    model.learn(20, reset_num_timesteps=False)  # training goes on over the same buffer
    rb.close()


def test_another_algorithms_pickle_is_refused_before_anything_changes(tmp_path):
    sac = small(bsb3.PrioritizedSAC, "Pendulum-v1", tmp_path, name="sac-live")
    sac.learn(40)
    sac.save_replay_buffer(tmp_path / "sac")
    sac.replay_buffer.close()
    dqn = small(bsb3.PrioritizedDQN, "CartPole-v1", tmp_path)
    dqn.learn(40)
    rb = dqn.replay_buffer
    before, disk = held(rb), fingerprint(tmp_path)
    with pytest.raises(IncompatibleSnapshotError, match="observation_space") as info:
        dqn.load_replay_buffer(tmp_path / "sac.pkl")
    assert "sac.pkl" in str(info.value)
    assert dqn.replay_buffer is rb and not rb.closed
    assert held(rb) == before and fingerprint(tmp_path) == disk
    rb.close()


def test_load_replay_buffer_twice_in_a_row_and_after_close(tmp_path):
    model = small(bsb3.PrioritizedTD3, "Pendulum-v1", tmp_path)
    model.learn(50)
    model.save_replay_buffer(tmp_path / "rb")
    n = len(model.replay_buffer.buffer)
    model.load_replay_buffer(tmp_path / "rb")  # SB3's name: .pkl added
    model.load_replay_buffer(tmp_path / "rb.pkl")  # the live path is held by the first load: freed
    assert len(model.replay_buffer.buffer) == n
    model.replay_buffer.close()
    model.load_replay_buffer(tmp_path / "rb.pkl")  # over a closed one
    model.learn(20, reset_num_timesteps=False)
    model.replay_buffer.close()


def test_beta_steps_numpy_int_is_taken_by_from_buffer_as_by_the_constructor():
    core = bigper.PrioritizedReplayBuffer(8, {"obs": ((3,), np.float32), "action": ((1,), np.int64),
                                              "reward": ((), np.float32)})
    rb = bsb3.PrioritizedReplayBuffer.from_buffer(core, OBS, ACT, device="cpu", beta_steps=np.int64(5))
    assert rb.beta_steps == 5 and type(rb.beta_steps) is int
    for bad in (0, -1, True, 5.0, "5"):
        with pytest.raises(InvalidArgumentError, match="beta_steps"):
            bsb3.PrioritizedReplayBuffer.from_buffer(core, OBS, ACT, device="cpu", beta_steps=bad)
        with pytest.raises(InvalidArgumentError, match="beta_steps"):
            bsb3.PrioritizedReplayBuffer(8, OBS, ACT, device="cpu", beta_steps=bad)


@pytest.mark.parametrize("n_envs", [0, -1, True, 1.5])
def test_a_bad_n_envs_is_refused_naming_it(n_envs):
    with pytest.raises(InvalidArgumentError, match="n_envs"):
        bsb3.PrioritizedReplayBuffer(8, OBS, ACT, device="cpu", n_envs=n_envs)


FIELDS = {"obs": ((3,), np.float32), "action": ((1,), np.int64), "reward": ((), np.float32)}


def test_a_sequence_buffer_is_refused_by_the_drop_in_which_hands_out_transitions():
    core = bigper.PrioritizedReplayBuffer(64, FIELDS, sequence=bigper.Sequence(length=4))
    with pytest.raises(InvalidArgumentError, match="sequence"):
        bsb3.PrioritizedReplayBuffer.from_buffer(core, OBS, ACT, device="cpu")
    assert not core.closed and len(core) == 0
    with pytest.raises(InvalidArgumentError, match="sequence"):
        bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu", sequence=bigper.Sequence(length=4))


def test_a_nan_loss_is_refused_and_leaves_every_priority_as_it_was():
    model = small(bsb3.PrioritizedSAC, "Pendulum-v1", None)
    model.learn(40)
    with th.no_grad():
        for p in model.critic.parameters():
            p.fill_(float("nan"))
    rb = model.replay_buffer
    before = held(rb)
    with pytest.raises(InvalidArgumentError, match="finite"):
        model.learn(20, reset_num_timesteps=False)
    n = before[0]
    after = rb.buffer.leaves(np.arange(n))
    assert not np.isnan(rb.buffer.leaves(np.arange(len(rb.buffer)))).any()
    assert after.tolist() == before[1]


def test_a_pickle_whose_snapshot_is_gone_is_refused_with_the_models_buffer_open(tmp_path):
    import shutil

    model = small(bsb3.PrioritizedDQN, "CartPole-v1", tmp_path)  # the pickle restores into this live path
    model.learn(40)
    model.save_replay_buffer(tmp_path / "rb")
    shutil.rmtree(tmp_path / "rb.bigper")
    rb = model.replay_buffer
    before, disk = held(rb), fingerprint(tmp_path)
    with pytest.raises(BigperError, match="does not exist"):
        model.load_replay_buffer(tmp_path / "rb.pkl")
    assert model.replay_buffer is rb and not rb.closed
    assert held(rb) == before and fingerprint(tmp_path) == disk
    rb.close()
