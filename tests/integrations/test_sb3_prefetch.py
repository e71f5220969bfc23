"""The SB3 drop-in's prefetching path and its device tier against its synchronous path.

Twin buffers get the same seed and the same stream (the synthetic frames of
``test_sb3``, channel-last through ``VecFrameStack`` and channel-first through
``FrameStackObservation``, episodes ending by termination and by timeout);
one samples synchronously (``prefetch=0``: the path the drop-in always took
before), the other from its background sampler, with or without the device
tier (``device_tier``, on the CPU here; the same on CUDA where there is one).
With no write between them, their batches are equal field by field: values,
shapes, dtypes, devices. Across writes, every row of a prefetched batch is
still exactly the transition it names (checked against what was added and
against SB3's own n-step buffer), and priorities skip overwritten slots.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")
th = pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer  # noqa: E402

from bigper.integrations.sb3 import PrioritizedDQN, PrioritizedReplayBuffer  # noqa: E402

from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)
from tests.integrations.test_sb3 import GAMMA, make_venv, np_samples, rollout  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if th.cuda.is_available() else [])


def assert_same(a, b, what=""):
    """Two ``PrioritizedReplayBufferSamples`` equal field by field (dtype, shape, device, values)."""
    assert a._fields == b._fields
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), f"{what}{name}"
        if x is None:
            continue
        assert (x.dtype, tuple(x.shape), x.device) == (y.dtype, tuple(y.shape), y.device), f"{what}{name}"
        assert th.equal(x.cpu(), y.cpu()), f"{what}{name}"


def twins(venv, n_envs, n_steps, cap, device="cpu", **kw):
    """(synchronous, prefetching, prefetching with the tier) drop-ins, one seed."""
    make = lambda **more: PrioritizedReplayBuffer(  # noqa: E731
        cap, venv.observation_space, venv.action_space, device=device, n_envs=n_envs, frame_stack=4,
        n_steps=n_steps, gamma=GAMMA, seed=7, **kw, **more)
    return make(prefetch=0), make(prefetch=2), make(prefetch=2, device_tier=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sb3_last", "gym_first"])
@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("n_steps", [1, 3])
def test_prefetched_batches_equal_the_synchronous_ones(device, kind, n_envs, n_steps):
    venv = make_venv(kind, n_envs)
    sync, pre, tier = twins(venv, n_envs, n_steps, 96 * n_envs, device)
    assert tier.buffer.device is not None and pre.buffer.device is None
    rollout(venv, 130, [sync, pre, tier])  # the ring wraps
    for i in range(6):  # (a new sampler, say for another batch size, drops what the last one drew ahead)
        size = 64
        want = sync.sample(size)
        assert want.observations.device.type == device
        assert_same(want, pre.sample(size), f"prefetched, batch {i}: ")
        assert_same(want, tier.sample(size), f"tier, batch {i}: ")
    for rb in (sync, pre, tier):
        rb.close()


@pytest.mark.parametrize("schedule", ["anneal", "fixed", "buffer"])
def test_weights_follow_the_learners_beta(schedule):
    """A sampler opened at one beta serves the next ones: its weights are
    ``w ** (b / b0)``, the synchronous draw's to float32 rounding."""
    from bigper import LinearSchedule

    venv = make_venv("gym_first", 1)
    beta = LinearSchedule(0.3, 1.0, 20) if schedule == "buffer" else 0.4
    sync, pre, tier = twins(venv, 1, 1, 200, beta=beta)
    rollout(venv, 150, [sync, pre, tier])
    p = np.random.default_rng(0).random(200) * 5
    for rb in (sync, pre, tier):
        rb.update_priorities(np.arange(150), p[:150])
    for i in range(8):
        b = {"anneal": 0.4 + 0.07 * i, "fixed": 0.6, "buffer": None}[schedule]
        want = sync.sample(32, beta=b)
        for rb in (pre, tier):
            got = rb.sample(32, beta=b)
            for name in ("observations", "indices", "rewards", "dones"):
                assert th.equal(getattr(got, name), getattr(want, name)), name
            if schedule == "anneal" and i:
                th.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=0)
            else:
                assert th.equal(got.weights, want.weights)
    assert pre._feed_key[3] == {"anneal": 0.4, "fixed": 0.6, "buffer": None}[schedule]  # one sampler throughout
    for rb in (sync, pre, tier):
        rb.close()


@pytest.mark.parametrize("tier", [False, True])
def test_prefetched_rows_stay_exact_across_adds(tier):
    """Batches prepared before adds that overwrite their slots: every row is
    still the transition it names, n-step discounts as SB3's, and updates
    by the batch skip the slots overwritten since the draw. (On the CPU the
    feed, n-step too, draws in ``sample()`` itself: no row is stale there.)"""
    venv = make_venv("sb3_last", 2)
    n, cap, steps = 3, 40, 400
    rb = PrioritizedReplayBuffer(cap, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                                 frame_stack=4, n_steps=n, gamma=GAMMA, seed=1, prefetch=3, device_tier=tier)
    refs = [NStepReplayBuffer(steps, venv.observation_space, venv.action_space, device="cpu", n_steps=n,
                              gamma=GAMMA) for _ in range(2)]
    record = rollout(venv, 30, [rb], refs)
    stale = 0
    obs = venv.reset()
    rng = np.random.default_rng(1)
    for t in range(30, steps):
        if t % 3 == 0:
            s = rb.sample(24)
            idx, gens = rb._last_draw()
            got = np_samples(s)
            gid = rb.buffer.state_dict()[1]["gid"]
            for b in range(24):
                step, e = divmod(int(gens[b]), 2)
                rec = record[step, e]
                np.testing.assert_array_equal(got["observations"][b], rec["obs"])
                assert got["actions"][b, 0] == rec["action"]
                refs[e].pos = t  # SB3 treats its own last step as a cut; the record holds all
                want = refs[e]._get_samples(np.array([step]))
                np.testing.assert_array_equal(got["next_observations"][b], want.next_observations[0].numpy())
                assert got["dones"][b, 0] == want.dones[0, 0].item()
                np.testing.assert_allclose(got["rewards"][b, 0], want.rewards[0, 0].item(), rtol=1e-6)
                np.testing.assert_allclose(got["discounts"][b, 0], want.discounts[0, 0].item(), rtol=1e-6)
            before = rb.buffer.leaves(np.arange(cap))
            rb.update_priorities(s.indices, th.full((24,), 50.0))
            after = rb.buffer.leaves(np.arange(cap))
            moved = gid[idx] != gens  # overwritten since the draw: their leaves are the new transitions'
            stale += int(moved.sum())
            np.testing.assert_array_equal(after[idx[moved]], before[idx[moved]])
            kept = after[idx[~moved]]  # updated, or 0 where the transition lost its frames (no longer sampleable)
            assert (np.isclose(kept, (50.0 + 1e-6) ** 0.6) | (kept == 0)).all() and (kept > 0).any()
            time.sleep(0.002)  # let the sampler prepare ahead of the next adds
        actions = rng.integers(0, 3, size=2)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, d in enumerate(dones):
            if d and infos[i].get("terminal_observation") is not None:
                next_obs[i] = infos[i]["terminal_observation"]
        rb.add(obs, next_obs, actions, rewards, dones, infos)
        for i in range(2):
            record[t, i] = dict(obs=obs[i].copy(), next_obs=next_obs[i].copy(), action=int(actions[i]),
                                reward=np.float32(rewards[i]), done=bool(dones[i]))
            refs[i].add(obs[i:i + 1], next_obs[i:i + 1], actions[i:i + 1], rewards[i:i + 1], dones[i:i + 1],
                        infos[i:i + 1])
        obs = new_obs
    from bigper.device.native import NativeFeed

    if isinstance(rb._feed, NativeFeed):  # (the CPU feed draws in sample(): no row is drawn before the adds)
        assert stale == 0
    else:
        assert stale > 0  # prefetched rows were overwritten before their update: the check has teeth
    rb.close()


def _dqn(**rbk):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=50,
                              buffer_size=400, batch_size=32, train_freq=1, target_update_interval=50,
                              policy_kwargs={"net_arch": [32]}, replay_buffer_kwargs=rbk)


def test_training_with_the_tier_is_training_without_it():
    """PrioritizedDQN over a buffer with a device tier (replay_buffer_kwargs
    device=): synchronous, it trains to the same weights as without the tier;
    prefetching, it trains and priorities move."""
    sync = []
    for kw in ({"prefetch": 0}, {"prefetch": 0, "device": "cpu"}):  # one after the other: SB3 seeds global RNGs
        sync.append(_dqn(**kw))
        sync[-1].learn(300)
    assert sync[1].replay_buffer.buffer.device == th.device("cpu")
    assert sync[0].replay_buffer.buffer.device is None
    for (n, a), (_, b) in zip(sync[0].q_net.named_parameters(), sync[1].q_net.named_parameters()):
        assert th.equal(a, b), n
    m = _dqn(device=True)
    m.learn(300)
    rb = m.replay_buffer
    assert rb.device_tier is True and rb.buffer.device == th.device("cpu") and rb._feed is not None
    leaves = rb.buffer.leaves(np.arange(len(rb.buffer)))
    assert np.ptp(leaves) > 0  # priorities were written back through the sampler's batches
    assert m.last_beta > 0.4
    for model in (*sync, m):
        model.replay_buffer.close()


@pytest.mark.skipif(not th.cuda.is_available(), reason="needs a CUDA device")
def test_training_with_a_cuda_tier():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cuda", seed=0, learning_starts=50,
                           buffer_size=400, batch_size=32, policy_kwargs={"net_arch": [32]},
                           replay_buffer_kwargs={"device": "auto"})
    m.learn(300)
    rb = m.replay_buffer
    assert rb.buffer.device.type == "cuda"
    s = rb.sample(32)
    assert all(t.device.type == "cuda" for t in (s.observations, s.weights, s.indices, s.dones))
    rb.update_priorities(s.indices, th.rand(32, device="cuda") + 0.1)
    rb.close()


def test_plain_sb3_buffer_is_the_reference():
    """The synchronous path still equals SB3's own buffer for a uniform draw
    (the twin tests above then tie the prefetching path to SB3 too)."""
    venv = make_venv("gym_first", 1)
    ours = PrioritizedReplayBuffer(64, venv.observation_space, venv.action_space, device="cpu", frame_stack=4,
                                   prefetch=2)
    ref = ReplayBuffer(64, venv.observation_space, venv.action_space, device="cpu")
    record = rollout(venv, 40, [ours])
    rollout(make_venv("gym_first", 1), 40, [ref])
    s = ours.sample(32)
    gens = ours._last_draw()[1]
    want = ref._get_samples(gens.astype(np.int64))
    for name in ("observations", "next_observations", "actions", "rewards"):
        got, exp = getattr(s, name), getattr(want, name)
        assert got.shape == exp.shape, name
        np.testing.assert_array_equal(got.numpy(), exp.numpy().astype(got.numpy().dtype), err_msg=name)
    assert len(record) == 40
    ours.close()
