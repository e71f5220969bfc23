"""The Stable-Baselines3 / CleanRL drop-in against real SB3.

A synthetic env draws frames that encode (env, episode, step), so any mix-up
of stacks, envs or episodes shows in the bytes. It runs through SB3's
``VecFrameStack`` (channel-last, zero padding) and through Gymnasium's
``FrameStackObservation`` (channel-first, first frame repeated), with episodes
ending by termination and by ``TimeLimit`` truncation. Every sampled
transition is checked field by field against what was added, and against SB3's
own ``ReplayBuffer`` / ``NStepReplayBuffer`` fed the same stream.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")
th = pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack  # noqa: E402

from bigper.errors import (  # noqa: E402
    BigperError,
    CorruptSnapshotError,
    InvalidArgumentError,
)
from bigper.integrations.sb3 import PrioritizedDQN, PrioritizedReplayBuffer  # noqa: E402

SIDE = 6
LIMIT = 10  # TimeLimit: episodes longer than this are truncated
GAMMA = 0.9


class StepFrames(gym.Env):
    """Frames encode (env, episode, step); episodes terminate after a seeded
    random length in [3, 15], so about half of them hit the time limit."""

    def __init__(self, env_id: int, channel_axis: bool):
        self.env_id = env_id
        shape = (SIDE, SIDE, 1) if channel_axis else (SIDE, SIDE)
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.action_space = spaces.Discrete(3)
        self._rng = np.random.default_rng(100 + env_id)
        self.episode = -1
        self.channel_axis = channel_axis

    def _frame(self):
        f = np.zeros((SIDE, SIDE), dtype=np.uint8)
        f[0, 0], f[0, 1], f[0, 2], f[0, 3] = self.t % 256, self.episode % 256, self.env_id, 1 + self.t // 256
        f[1:, :] = (self.t * 7 + self.episode * 13 + self.env_id) % 251
        return f[..., None] if self.channel_axis else f

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        self.length = int(self._rng.integers(3, 16))
        return self._frame(), {}

    def step(self, action):
        self.t += 1
        reward = float(self.t + 0.25 * int(action) + 0.5 * self.env_id)
        return self._frame(), reward, self.t >= self.length, False, {}


def make_venv(kind: str, n_envs: int):
    from gymnasium.wrappers import FrameStackObservation, TimeLimit

    if kind == "sb3_last":
        fns = [lambda i=i: TimeLimit(StepFrames(i, True), LIMIT) for i in range(n_envs)]
        return VecFrameStack(DummyVecEnv(fns), 4)
    fns = [lambda i=i: FrameStackObservation(TimeLimit(StepFrames(i, False), LIMIT), 4) for i in range(n_envs)]
    return DummyVecEnv(fns)


def rollout(venv, steps: int, buffers, refs=None, seed: int = 0):
    """Step ``venv`` with random actions and add every transition as SB3's
    ``_store_transition`` does; returns the record ``(t, env) -> fields``."""
    rng = np.random.default_rng(seed)
    n = venv.num_envs
    obs = venv.reset()
    record = {}
    for t in range(steps):
        actions = rng.integers(0, 3, size=n)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, d in enumerate(dones):
            if d and infos[i].get("terminal_observation") is not None:
                next_obs[i] = infos[i]["terminal_observation"]
        for b in buffers:
            b.add(obs, next_obs, actions, rewards, dones, infos)
        for i in range(n):
            timeout = bool(infos[i].get("TimeLimit.truncated", False))
            record[t, i] = dict(obs=obs[i].copy(), next_obs=next_obs[i].copy(), action=int(actions[i]),
                                reward=np.float32(rewards[i]), done=bool(dones[i]), timeout=timeout)
            if refs is not None:
                refs[i].add(obs[i:i + 1], next_obs[i:i + 1], actions[i:i + 1], rewards[i:i + 1],
                            dones[i:i + 1], infos[i:i + 1])
        obs = new_obs
    return record


def np_samples(s):
    return {k: (None if v is None else v.cpu().numpy()) for k, v in s._asdict().items()}


@pytest.mark.parametrize("kind", ["sb3_last", "gym_first"])
@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("n_steps", [1, 3])
def test_every_sampled_transition_is_what_was_added(kind, n_envs, n_steps):
    steps = 160
    venv = make_venv(kind, n_envs)
    cap = 96 * n_envs  # smaller than the run: the ring wraps, frames expire
    ours = PrioritizedReplayBuffer(cap, venv.observation_space, venv.action_space, device="cpu",
                                   n_envs=n_envs, frame_stack=4, n_steps=n_steps, gamma=GAMMA, seed=3)
    ref_cls = ReplayBuffer if n_steps == 1 else NStepReplayBuffer
    ref_kw = {} if n_steps == 1 else {"n_steps": n_steps, "gamma": GAMMA}
    refs = [ref_cls(steps, venv.observation_space, venv.action_space, device="cpu", **ref_kw)
            for _ in range(n_envs)]
    record = rollout(venv, steps, [ours], refs)
    assert ours.layout.axis == ("last" if kind == "sb3_last" else "first")
    ends = sum(r["done"] for r in record.values())
    timeouts = sum(r["timeout"] for r in record.values())
    assert ends > timeouts > 0  # both kinds of episode end happened

    s = ours.sample(512)
    got = np_samples(s)
    gens = ours._last_draw()[1]
    assert got["observations"].shape == (512, *venv.observation_space.shape)
    assert got["weights"].shape == got["rewards"].shape == got["dones"].shape == (512, 1)
    assert (gens >= steps * n_envs - cap).all()  # only what the ring still holds
    seen_end = False
    for b in range(512):
        t, e = divmod(int(gens[b]), n_envs)
        rec = record[t, e]
        np.testing.assert_array_equal(got["observations"][b], rec["obs"])
        assert got["actions"][b, 0] == rec["action"]
        # SB3's own buffer for this env, at this step
        want = refs[e]._get_samples(np.array([t]))
        np.testing.assert_array_equal(got["next_observations"][b], want.next_observations[0].numpy())
        np.testing.assert_array_equal(got["observations"][b], want.observations[0].numpy())
        assert got["dones"][b, 0] == want.dones[0, 0].item()
        np.testing.assert_allclose(got["rewards"][b, 0], want.rewards[0, 0].item(), rtol=1e-6)
        if n_steps == 1:
            assert got["discounts"] is None
            np.testing.assert_array_equal(got["next_observations"][b], rec["next_obs"])
            assert got["rewards"][b, 0] == rec["reward"]
            assert got["dones"][b, 0] == float(rec["done"] and not rec["timeout"])
        else:
            np.testing.assert_allclose((1 - got["dones"][b, 0]) * got["discounts"][b, 0],
                                       (1 - want.dones[0, 0].item()) * want.discounts[0, 0].item(),
                                       rtol=1e-6)
        seen_end |= rec["done"]
    assert seen_end


def test_frames_are_stored_once():
    venv = make_venv("sb3_last", 2)
    ours = PrioritizedReplayBuffer(10_000, venv.observation_space, venv.action_space, device="cpu",
                                   n_envs=2, frame_stack=4)
    record = rollout(venv, 200, [ours])
    episodes = sum(r["done"] for r in record.values()) + 2
    frames = ours.buffer.state_dict()[0]["frames"]["fw"]
    # one new frame a step, plus an episode's first stack (zero padding once, first frame once)
    assert frames <= 400 + 2 * episodes, (frames, episodes)


def test_channel_last_with_colour_frames_round_trips():
    obs_space = spaces.Box(0, 255, (5, 4, 12), np.uint8)  # 4 RGB frames stacked on the last axis
    rb = PrioritizedReplayBuffer(50, obs_space, spaces.Discrete(2), device="cpu", frame_stack=4, seed=1)
    assert rb.layout.core_shape == (4, 5, 4, 3)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(12, 5, 4, 3), dtype=np.uint8)
    added = {}
    for t in range(8):
        o = np.concatenate(frames[t:t + 4], axis=-1)[None]
        n = np.concatenate(frames[t + 1:t + 5], axis=-1)[None]
        rb.add(o, n, np.array([t % 2]), np.array([t]), np.array([t == 7]), [{}])
        added[t] = (o[0], n[0])
    s = np_samples(rb.sample(64))
    for b in range(64):
        t = int(s["rewards"][b, 0])
        np.testing.assert_array_equal(s["observations"][b], added[t][0])
        np.testing.assert_array_equal(s["next_observations"][b], added[t][1])


@pytest.mark.parametrize("shape", [(4, 5, 3), (5, 3, 8)])
def test_stacks_that_do_not_overlap_come_back_exactly(shape):
    obs_space = spaces.Box(0, 255, shape, np.uint8)
    rb = PrioritizedReplayBuffer(40, obs_space, spaces.Discrete(2), device="cpu", frame_stack=4, seed=2)
    rng = np.random.default_rng(5)
    added = []
    for t in range(30):  # unrelated stacks: nothing to share, every frame stored
        o, n = rng.integers(0, 256, size=(2, 1, *shape), dtype=np.uint8)
        if t % 3 == 0:
            n[0] = o[0]  # and some next stacks equal to their obs
        rb.add(o, n, np.array([1]), np.array([t]), np.array([False]), [{}])
        added.append((o[0], n[0]))
    s = np_samples(rb.sample(128))
    for b in range(128):
        o, n = added[int(s["rewards"][b, 0])]
        np.testing.assert_array_equal(s["observations"][b], o)
        np.testing.assert_array_equal(s["next_observations"][b], n)


def test_vecnormalize_env_is_applied_as_sb3_does():
    from stable_baselines3.common.vec_env import VecNormalize

    venv = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]), gamma=0.99)
    a = PrioritizedReplayBuffer(500, venv.observation_space, venv.action_space, device="cpu", seed=4)
    b = PrioritizedReplayBuffer(500, venv.observation_space, venv.action_space, device="cpu", seed=4)
    venv.reset()
    rng = np.random.default_rng(0)
    for _ in range(200):
        act = rng.integers(0, 2, size=1)
        o = venv.get_original_obs()
        _, _, done, infos = venv.step(act)
        o2 = venv.get_original_obs().copy()
        if done[0]:
            o2[0] = venv.unnormalize_obs(infos[0]["terminal_observation"])
        for rb in (a, b):
            rb.add(o, o2, act, venv.get_original_reward(), done, infos)
    raw, norm = np_samples(a.sample(16)), np_samples(b.sample(16, env=venv))
    np.testing.assert_array_equal(norm["indices"], raw["indices"])
    np.testing.assert_allclose(norm["observations"], venv.normalize_obs(raw["observations"]), rtol=1e-6)
    np.testing.assert_allclose(norm["next_observations"], venv.normalize_obs(raw["next_observations"]), rtol=1e-6)
    np.testing.assert_allclose(norm["rewards"], venv.normalize_reward(raw["rewards"]), rtol=1e-6)
    assert not np.allclose(norm["observations"], raw["observations"])


def test_cleanrl_style_dict_infos_and_explicit_truncations():
    obs_space = spaces.Box(-1, 1, (3,), np.float32)
    rb = PrioritizedReplayBuffer(20, obs_space, spaces.Discrete(2), "cpu", 2, True, False, n_steps=2)
    o = np.zeros((2, 3), np.float32)
    # CleanRL passes terminations as done and a dict of infos; timeouts given explicitly.
    rb.add(o, o + 1, np.array([0, 1]), np.array([1.0, 2.0]), np.array([False, True]),
           {"episode": {}}, truncated=np.array([True, True]))
    state = rb.buffer.state_dict()[1]
    # env 0: truncated (bit 1); env 1: terminated wins over the truncation (bit 0)
    assert list(state["ends"][:2]) == [2, 1]
    rb2 = PrioritizedReplayBuffer(20, obs_space, spaces.Discrete(2), "cpu", 2)
    rb2.add(o, o + 1, np.array([0, 1]), np.array([1.0, 2.0]), np.array([True, True]),
            {"TimeLimit.truncated": np.array([True, True]), "_TimeLimit.truncated": np.array([True, False])})
    assert list(rb2.buffer.state_dict()[1]["ends"][:2]) == [2, 1]


def _fingerprint(rb):
    meta, arrays = rb.buffer.state_dict()
    return repr(meta), {k: v.copy() for k, v in arrays.items()}


def test_bad_input_is_refused_and_changes_nothing():
    venv = make_venv("gym_first", 1)
    rb = PrioritizedReplayBuffer(64, venv.observation_space, venv.action_space, device="cpu", frame_stack=4)
    rollout(venv, 20, [rb])
    before = _fingerprint(rb)
    o = np.zeros((1, 4, SIDE, SIDE), np.uint8)
    with pytest.raises(InvalidArgumentError, match="obs must have shape"):
        rb.add(o[:, :3], o, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    with pytest.raises(InvalidArgumentError, match="infos"):
        rb.add(o, o, np.array([0]), np.array([0.0]), np.array([False]), [{}, {}])
    s = rb.sample(8)
    rb.close_sampler()  # its thread would go on drawing (the RNG advancing) between the fingerprints
    before_update = _fingerprint(rb)
    with pytest.raises(InvalidArgumentError, match="finite"):
        rb.update_priorities(s.indices, th.full((8,), float("nan")))
    with pytest.raises(BigperError):
        rb.update_priorities(th.tensor([10_000] * 8), th.ones(8))
    after = _fingerprint(rb)
    assert after[0] == before_update[0]
    for k in after[1]:
        np.testing.assert_array_equal(after[1][k], before_update[1][k])
    assert before[0] != before_update[0]  # sampling advanced the RNG: the check has teeth
    with pytest.raises(InvalidArgumentError, match="snapshot_dir"):
        pickle.dumps(rb)
    with pytest.raises(InvalidArgumentError, match="frame_stack=5 does not divide"):
        PrioritizedReplayBuffer(8, venv.observation_space, venv.action_space, frame_stack=5)


def test_update_priorities_takes_numpy_and_torch_and_skips_overwritten():
    obs_space = spaces.Box(-1, 1, (2,), np.float32)
    rb = PrioritizedReplayBuffer(8, obs_space, spaces.Discrete(2), device="cpu", alpha=1.0)
    for t in range(8):
        rb.add(np.full((1, 2), t, np.float32), np.full((1, 2), t + 1, np.float32), np.array([0]),
               np.array([t]), np.array([False]), [{}])
    rb.update_priorities(np.arange(8), np.arange(1, 9, dtype=np.float64))
    assert rb.buffer.total_priority == pytest.approx(sum(range(1, 9)) + 8e-6)
    s = rb.sample(4)
    rb.add(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32), np.array([0]), np.array([9.0]),
           np.array([False]), [{}])  # overwrites slot 0
    old0 = rb.buffer.leaves([0])[0]
    rb.update_priorities(s.indices, th.full((4, 1), 100.0))
    if 0 in s.indices.tolist():
        assert rb.buffer.leaves([0])[0] == old0  # the overwritten slot kept its new transition's leaf
    assert all(rb.buffer.leaves([i])[0] == pytest.approx(100.0, rel=1e-6)
               for i in s.indices.tolist() if i != 0)


@pytest.mark.skipif(not th.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_samples_and_tensor_priorities():
    venv = make_venv("sb3_last", 2)
    rb = PrioritizedReplayBuffer(256, venv.observation_space, venv.action_space, device="cuda", n_envs=2,
                                 frame_stack=4, seed=0)
    cpu = PrioritizedReplayBuffer(256, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                                  frame_stack=4, seed=0)
    rollout(venv, 60, [rb, cpu])
    for _ in range(3):
        s, c = rb.sample(32), cpu.sample(32)
        assert all(t.device.type == "cuda" for t in (s.observations, s.weights, s.indices))
        for name in ("observations", "next_observations", "actions", "rewards", "dones", "weights", "indices"):
            np.testing.assert_array_equal(getattr(s, name).cpu().numpy(), getattr(c, name).numpy(), err_msg=name)
        td = th.rand(32, device="cuda") + 0.1
        rb.update_priorities(s.indices, td)
        cpu.update_priorities(c.indices, td.cpu())
    np.testing.assert_array_equal(rb.buffer.leaves(np.arange(120)), cpu.buffer.leaves(np.arange(120)))


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_save_and_load_replay_buffer_continue_sampling_exactly(tmp_path, storage):
    kw = {"frame_stack": 4, "storage": storage}
    if storage == "memmap":
        kw["path"] = str(tmp_path / "live")
    model = PrioritizedDQN("MlpPolicy", make_venv("gym_first", 2), buffer_size=200, learning_starts=10,
                           replay_buffer_kwargs=kw, device="cpu", seed=0)
    rollout(model.env, 60, [model.replay_buffer])
    rb = model.replay_buffer
    rb.update_priorities(np.arange(50), np.linspace(0.1, 5, 50))
    model.save_replay_buffer(tmp_path / "replay")
    pkl = tmp_path / "replay.pkl"
    assert pkl.is_file() and pkl.stat().st_size < 20_000  # a reference, not the transitions
    assert (tmp_path / "replay.bigper").is_dir()
    expected = [np_samples(rb.sample(32)) for _ in range(3)]
    rb.close()
    model.replay_buffer = None
    model.load_replay_buffer(pkl)
    rb2 = model.replay_buffer
    assert rb2.pos == rb.pos and rb2.full == rb.full
    for want in expected:
        got = np_samples(rb2.sample(32))
        for k in want:
            if want[k] is None:
                assert got[k] is None
            else:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    rb2.close()
    # a manifest that is not the one the pickle names is refused
    snap = next((tmp_path / "replay.bigper").glob("snap-*"))
    with open(snap / "manifest.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(CorruptSnapshotError, match="sha256"):
        model.load_replay_buffer(pkl)


@pytest.fixture
def one_torch_thread():
    # A shared 2-core CI machine: more threads only contend (and slow everyone).
    n = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(n)


def test_prioritized_dqn_learns_cartpole_and_priorities_change(one_torch_thread):
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.monitor import Monitor

    env = Monitor(gym.make("CartPole-v1"))
    # rl-zoo's CartPole settings, shortened: 5k steps, about 10 s of CPU. Seeds 0-2
    # score 160-264 here; random play scores about 22.
    model = PrioritizedDQN("MlpPolicy", env, learning_rate=2.3e-3, batch_size=64, buffer_size=20_000,
                           learning_starts=500, gamma=0.99, target_update_interval=10, train_freq=64,
                           gradient_steps=32, exploration_fraction=0.16, exploration_final_eps=0.04,
                           policy_kwargs={"net_arch": [64, 64]}, replay_buffer_kwargs={"seed": 0, "prefetch": 0},
                           device="cpu", seed=0)  # (prefetch=0: the run is the same every time; a prefetching
    rb = model.replay_buffer                      # draw sees the priorities of whenever its thread drew it)
    model.learn(5_000)
    leaves = rb.buffer.leaves(np.arange(len(rb.buffer)))
    assert np.unique(leaves).size > 100  # priorities were written back, not left at the max
    assert rb.beta0 == 0.4 and model.last_beta > 0.95  # annealed to 1.0 over learn()
    mean, _ = evaluate_policy(model, env, n_eval_episodes=5, deterministic=True)
    assert mean > 100, mean


@pytest.mark.filterwarnings("ignore:The last trajectory in the replay buffer will be truncated")
def test_plain_sb3_dqn_runs_with_priorities_at_the_max(tmp_path, one_torch_thread):
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=50, buffer_size=1_000, optimize_memory_usage=True,
                replay_buffer_class=PrioritizedReplayBuffer,
                replay_buffer_kwargs={"handle_timeout_termination": False, "snapshot_dir": tmp_path / "snaps"},
                device="cpu", seed=0)
    with pytest.warns(UserWarning, match="PrioritizedDQN"):  # said once: sampling stays uniform
        model.learn(300)
        model.learn(200)  # SB3 cuts its optimize_memory_usage array here (dones[pos] = True)
    rb = model.replay_buffer
    assert rb.size() == 500
    leaves = rb.buffer.leaves(np.arange(500))
    assert (leaves == leaves[0]).all()  # nobody wrote priorities back: all at the max
    model.save_replay_buffer(tmp_path / "rb.pkl")  # plain DQN: the snapshot goes to snapshot_dir
    assert [p.name for p in (tmp_path / "snaps").iterdir() if p.name.startswith("snap-")] == ["snap-00000001"]


def test_beta_anneals_to_one_over_learn():
    from bigper.integrations.sb3 import annealed_beta

    assert annealed_beta(0.4, 1.0) == 0.4
    assert annealed_beta(0.4, 0.5) == pytest.approx(0.7)
    assert annealed_beta(0.4, 0.0) == 1.0


def test_import_stays_light():
    code = ("import sys, bigper, bigper.integrations; "
            "print('torch' in sys.modules, 'stable_baselines3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_atari_example_smoke(tmp_path):
    pytest.importorskip("ale_py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-m", "bigper.examples.sb3_dqn_atari", "--smoke"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "resumed" in out.stdout
    assert not list(tmp_path.iterdir())
