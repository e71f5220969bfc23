"""Resuming SB3 the way users do (issue 45): each case as a user met it.

- ``PrioritizedDQN(n_steps=3)`` resumed with ``load_replay_buffer`` after a
  crash: the episode open at the checkpoint ends there (SB3's
  ``truncate_last_traj=True``), so no n-step return mixes it with the
  episode the new process starts; ``truncate_last_traj=False`` keeps it.
- A run laid out as ``CheckpointCallback`` lays it out, copied (``cp -a``)
  and loaded from the copy's checkpoint: the original run's files stay byte
  for byte; the copy's own live data, newer than the checkpoint, is replaced
  only when asked (``rewind=True``).
- Resuming from the live folder without ``mode='resume'``: refused before
  ``learn`` collects a step, naming ``replay_buffer_kwargs``.
- The load's warning names the user's line, not bigper's.

Each failed before the change.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

th = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")
pytest.importorskip("stable_baselines3")

from stable_baselines3.common.callbacks import CheckpointCallback  # noqa: E402

from bigper.errors import PathExistsError  # noqa: E402
from bigper.integrations import sb3 as bsb3  # noqa: E402

from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)
from tests.snapshot.test_resume_boundaries import tree_digest  # noqa: E402


def model(**kw):
    kw.setdefault("learning_starts", 30)
    kw.setdefault("buffer_size", 500)
    kw.setdefault("batch_size", 16)
    kw.setdefault("policy_kwargs", {"net_arch": [16]})
    return bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, **kw)


def add(rb, obs: float, reward: float, done: bool = False) -> None:
    o = np.full((1, 4), obs, np.float32)
    rb.add(o, o + 0.5, np.zeros((1, 1)), np.array([reward], np.float32), np.array([done]), [{}])


@pytest.mark.parametrize("truncate", [True, False])
def test_load_replay_buffer_ends_the_open_episode_unless_told_it_goes_on(tmp_path, truncate):
    m = model(n_steps=3, gamma=0.5, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "replay")})
    rb = m.replay_buffer
    for t in range(5):  # an episode open at the checkpoint
        add(rb, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "replay")
    rb.close()  # the crash: the live folder is what the next process finds
    m2 = model(n_steps=3, gamma=0.5, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "other")})
    m2.replay_buffer.close()
    m2.load_replay_buffer(tmp_path / "ckpt" / "replay.pkl", truncate_last_traj=truncate)
    for t in range(3):  # the new process's env.reset(): a new episode (unless the env was restored)
        add(m2.replay_buffer, 100 + t, 10.0)
    got = m2.replay_buffer.buffer.gather(np.arange(5))
    if truncate:
        np.testing.assert_allclose(got["reward"], [1.75, 1.75, 1.75, 1.5, 1.0])
    else:
        np.testing.assert_allclose(got["reward"], [1.75, 1.75, 1.75, 4.0, 8.5])
    m2.replay_buffer.close()


def test_a_copied_checkpoint_callback_run_never_rewinds_the_original(tmp_path):
    run = tmp_path / "run"
    m = model(replay_buffer_kwargs={"storage": "memmap", "path": str(run / "replay")})
    cb = CheckpointCallback(save_freq=100, save_path=str(run / "ckpt"), name_prefix="model",
                            save_replay_buffer=True)
    m.learn(250, callback=cb)
    m.replay_buffer.close()  # the original run stops with 250 transitions; its checkpoint holds 200
    fork = tmp_path / "fork"
    subprocess.run(["cp", "-a", str(run), str(fork)], check=True)
    before = tree_digest(run)
    m2 = bsb3.PrioritizedDQN.load(fork / "ckpt" / "model_200_steps.zip", env=gym.make("CartPole-v1"), device="cpu")
    fork_before = tree_digest(fork)
    with pytest.raises(PathExistsError, match="rewind=True"):
        m2.load_replay_buffer(fork / "ckpt" / "model_replay_buffer_200_steps.pkl")
    assert tree_digest(fork) == fork_before and tree_digest(run) == before
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m2.load_replay_buffer(fork / "ckpt" / "model_replay_buffer_200_steps.pkl", rewind=True)
    said = [x for x in w if "replacing what it held" in str(x.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(x.filename, str(x.message)) for x in w]
    assert str(fork / "replay") in str(said[0].message)
    assert m2.replay_buffer.size() == 199  # the callback of step 200 runs before that step's add
    assert Path(m2.replay_buffer.buffer.storage.path) == fork / "replay"
    m2.learn(20, reset_num_timesteps=False)
    m2.replay_buffer.close()
    assert tree_digest(run) == before, "the fork changed the original run"


def test_resuming_from_the_live_folder_without_mode_resume_is_refused_before_learn(tmp_path):
    m = model(replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "replay")})
    m.learn(40)
    m.save(tmp_path / "model.zip")
    m.replay_buffer.close()
    loaded = bsb3.PrioritizedDQN.load(tmp_path / "model.zip", env=gym.make("CartPole-v1"), device="cpu")
    steps = loaded.num_timesteps
    with pytest.raises(PathExistsError, match=r"replay_buffer_kwargs=\{'path': .*'mode': 'resume'"):
        loaded.learn(40, reset_num_timesteps=False)
    assert loaded.num_timesteps == steps  # nothing was collected
    ok = bsb3.PrioritizedDQN.load(tmp_path / "model.zip", env=gym.make("CartPole-v1"), device="cpu",
                                  replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "replay"),
                                                        "mode": "resume"})
    ok.learn(40, reset_num_timesteps=False)
    assert ok.replay_buffer.size() == 80
    ok.replay_buffer.close()
