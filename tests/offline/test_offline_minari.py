"""Minari datasets made locally with minari.DataCollector, opened in place by from_hdf5."""

import hashlib
import warnings

import numpy as np
import pytest
from tests import hook

minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")

import bigper  # noqa: E402
from bigper.offline.datasets import OfflineDatasetError, describe  # noqa: E402

PRB = bigper.PrioritizedReplayBuffer


class DictEnv(gym.Env):
    """Nested dict observations (a Box, a small uint8 grid and a Discrete); ends by truncation."""

    observation_space = gym.spaces.Dict({
        "pos": gym.spaces.Box(-1, 1, (2,), np.float32),
        "inner": gym.spaces.Dict({"grid": gym.spaces.Box(0, 255, (3, 3), np.uint8),
                                  "k": gym.spaces.Discrete(4)}),
    })
    action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {"x": 0.0}

    def _obs(self):
        o = self.observation_space.sample()
        o["pos"][0] = self.t / 100  # the step, readable back
        return o

    def step(self, action):
        self.t += 1
        return self._obs(), float(self.t), False, self.t >= 4 + self.np_random.integers(3), {"x": float(self.t)}


def collect(root, monkeypatch_env, env_id, make, episodes, **kw):
    monkeypatch_env.setenv("MINARI_DATASETS_PATH", str(root))
    env = minari.DataCollector(make(), **kw)
    env.action_space.seed(0)
    for ep in range(episodes):
        env.reset(seed=ep)
        done = False
        while not done:
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            done = term or trunc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = env.create_dataset(dataset_id=env_id, algorithm_name="random")
    env.close()
    return ds, root / env_id


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("minari")
    try:
        yield {
            "cartpole": collect(root, mp, "test/cartpole-random-v0", lambda: gym.make("CartPole-v1"), 12),
            "pendulum": collect(root, mp, "test/pendulum-random-v0",
                                lambda: gym.make("Pendulum-v1", max_episode_steps=40), 4),
            "dict": collect(root, mp, "test/dict-random-v0", DictEnv, 5, record_infos=True),
        }
    finally:
        mp.undo()


def episodes_of(ds):
    """Per-transition (episode, step) and the episodes themselves, read through minari."""
    eps = list(ds.iterate_episodes())
    where = [(e, t) for e, ep in enumerate(eps) for t in range(len(ep.rewards))]
    return eps, where


def leaf(obs, parts):
    for p in parts:
        obs = obs[p]
    return obs


@pytest.mark.parametrize("name", ["cartpole", "pendulum", "dict"])
def test_pairs_are_consecutive_steps_of_one_episode(datasets, name):
    ds, path = datasets[name]
    data_file = path / "data" / "main_data.hdf5"
    before = hashlib.sha256(data_file.read_bytes()).hexdigest()
    eps, where = episodes_of(ds)
    with PRB.from_hdf5(path, seed=2) as buf:
        assert len(buf) == buf.capacity == ds.total_steps == len(where)
        seen = set()
        for _ in range(30):
            b = buf.sample(32)
            seen.update(b.indices.tolist())
            for row, i in enumerate(b.indices):
                e, t = where[i]
                ep = eps[e]
                if name == "dict":
                    for parts in (("pos",), ("inner", "grid"), ("inner", "k")):
                        key = "obs_" + "_".join(parts)
                        assert np.array_equal(b[key][row], leaf(ep.observations, parts)[t])
                        assert np.array_equal(b["next_" + key][row], leaf(ep.observations, parts)[t + 1])
                    assert b["info_x"][row] == ep.infos["x"][t + 1] == t + 1
                else:
                    assert np.array_equal(b["obs"][row], ep.observations[t])
                    assert np.array_equal(b["next_obs"][row], ep.observations[t + 1])
                assert np.array_equal(b["action"][row], ep.actions[t])
                assert b["reward"][row] == ep.rewards[t]
                assert b["terminated"][row] == ep.terminations[t]
                assert b["truncated"][row] == ep.truncations[t]
                assert b["discount"][row] == (0.0 if ep.terminations[t] else np.float32(0.99))
        assert len(seen) > 0.5 * len(where)
    assert hashlib.sha256(data_file.read_bytes()).hexdigest() == before


def test_episode_ends(datasets):
    ds, path = datasets["cartpole"]
    eps, _ = episodes_of(ds)
    with PRB.from_hdf5(path) as buf:
        last = np.cumsum([len(ep.rewards) for ep in eps]) - 1
        ends = hook.ring(buf).ends
        assert np.array_equal(np.flatnonzero(ends), last)
        assert all(ends[i] & 1 for i, ep in zip(last, eps) if ep.terminations[-1])
    ds, path = datasets["pendulum"]
    with PRB.from_hdf5(path) as buf:  # 40-step time limit: every episode truncated
        assert np.array_equal(np.flatnonzero(hook.ring(buf).ends == 2), np.arange(1, 5) * 40 - 1)


def test_reprioritize_minari_and_reopen(datasets, tmp_path):
    ds, path = datasets["pendulum"]
    side = tmp_path / "pend.priorities"
    with PRB.from_hdf5(path, priorities=side) as buf:
        buf.reprioritize(lambda b: np.abs(b["reward"]), batch_size=25, progress=False)
        leaves = buf.prioritization.tree.leaves.copy()
    rewards = np.concatenate([ep.rewards for ep in ds.iterate_episodes()])
    assert np.allclose(leaves, (np.abs(rewards) + 1e-6) ** 0.6)
    with PRB.from_hdf5(path / "data" / "main_data.hdf5", priorities=side) as again:
        assert np.array_equal(again.prioritization.tree.leaves, leaves)
    text = describe(path, priorities=side)
    assert "minari layout" in text and "episodes: 4" in text and "complete reprioritize" in text


def test_describe_names_fields(datasets):
    _, path = datasets["dict"]
    text = describe(path)
    for name in ("obs_pos", "obs_inner_grid", "obs_inner_k", "next_obs_pos", "info_x", "action", "reward"):
        assert name in text


def test_jpeg_and_broken_episodes_are_refused(datasets, tmp_path):
    import shutil

    import h5py

    _, path = datasets["cartpole"]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    f = copy / "data" / "main_data.hdf5"
    with h5py.File(f, "a") as h:
        v = h["episode_3/actions"][:-1]
        del h["episode_3/actions"]
        h["episode_3/actions"] = v
    with pytest.raises(OfflineDatasetError, match="episode_3/actions has .* rows; expected"):
        PRB.from_hdf5(copy)
    with h5py.File(f, "a") as h:
        del h["episode_3/actions"]
    with pytest.raises(OfflineDatasetError, match="'episode_3/actions', which is missing"):
        PRB.from_hdf5(copy)
    with h5py.File(f, "a") as h:
        h["episode_3/actions"] = np.zeros(len(h["episode_3/rewards"]), dtype=np.int64)
        obs = h["episode_2/observations"]
        rows = obs.shape[0]
        enc = np.zeros((rows, 50), dtype=np.uint8)  # what an encoded frame looks like
        del h["episode_2/observations"]
        h["episode_2/observations"] = enc
    with pytest.raises(OfflineDatasetError, match="episode_2/observations holds uint8 .*JPEG-encoded"):
        PRB.from_hdf5(copy)
    with h5py.File(f, "a") as h:
        del h["episode_2/observations"]
        h["episode_2/observations"] = np.zeros((rows, 4), dtype=np.float64)
    with pytest.raises(OfflineDatasetError, match="episode_2 does not match the first episode in field 'obs'"):
        PRB.from_hdf5(copy)
