"""Hostile tests of the SB3 drop-in's new surfaces: the background sampler
``sample()`` keeps open, and the device tier (``device_tier`` /
``replay_buffer_kwargs={"device": ...}``).

Batch size and beta changing mid-run, a save and a load while the sampler has
batches prepared, two threads sampling and updating at once, the buffer
closed under the model (the drop-in's and the core's ``close``), the model's
buffer replaced, a draw that fails and the next that succeeds, bad options,
and a child killed with SIGKILL in the middle of ``learn`` whose buffer a new
process resumes.

A case that holds is a plain test; one that shows a bug is ``xfail(strict=True)``.
"""

from __future__ import annotations

import pickle
import threading
import time
import warnings

import numpy as np
import pytest

th = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")
pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402

from bigper import LinearSchedule  # noqa: E402
from bigper.errors import BufferClosedError, InvalidArgumentError, UncleanStorageError  # noqa: E402
from bigper.integrations import sb3 as bsb3  # noqa: E402

from tests._child import Child  # noqa: E402
from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)

OBS = spaces.Box(-10, 10, (3,), np.float32)
ACT = spaces.Discrete(2)


def filled(n=64, cap=64, **kw):
    rb = bsb3.PrioritizedReplayBuffer(cap, OBS, ACT, device="cpu", seed=0, **kw)
    for t in range(n):
        o = np.full((1, 3), t % 20, np.float32)
        rb.add(o, o + 1, np.array([t % 2]), np.array([float(t)]), np.array([t % 9 == 8]), [{}])
    return rb


def feed_threads() -> int:
    return sum(t.name == "bigper-prefetch" and t.is_alive() for t in threading.enumerate())


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def expected_weights(rb, idx, beta):
    """``(N P(i)) ** -beta`` over the largest possible weight, from the leaves now (no update since the draw)."""
    n = len(rb.buffer)
    leaves = rb.buffer.leaves(np.arange(n))
    p = leaves / leaves.sum()
    w = (n * p[idx]) ** -beta
    return w / (n * p[p > 0].min()) ** -beta


def test_batch_size_changes_mid_run():
    rb = filled()
    before = feed_threads()
    for size in (16, 32, 16, 7, 7, 64):
        s = rb.sample(size)
        assert s.observations.shape == (size, 3) and s.weights.shape == (size, 1) and s.indices.shape == (size,)
        assert rb._feed_key[1] == size
        rb.update_priorities(s.indices, th.rand(size) + 0.1)
        wait_for(lambda: feed_threads() <= before + 1)  # the one of the previous size is gone
    for bad in (0, -1, 2.5, "8", True):
        with pytest.raises(InvalidArgumentError):
            rb.sample(bad)
    assert rb.sample(8).indices.shape == (8,)  # a refused size left the sampler usable
    rb.close()
    wait_for(lambda: feed_threads() == before)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_beta_changes_mid_run(prefetch):
    """Numbers (the annealing PrioritizedDQN does, a jump to 0 and back), the
    buffer's own schedule, and beta_steps: the weights are always those of the
    beta asked for (for None: the buffer's schedule at each draw)."""
    rb = filled(prefetch=prefetch)
    rb.update_priorities(np.arange(64), np.linspace(0.1, 4, 64))
    for beta in (0.4, 0.45, 0.9, 0.0, 1.0, 0.2, 0.0):
        s = rb.sample(32, beta=beta)
        np.testing.assert_allclose(s.weights.numpy().ravel(), expected_weights(rb, s.indices.numpy(), beta),
                                   rtol=1e-5)
    rb.close()
    sched = filled(prefetch=prefetch, beta=LinearSchedule(0.2, 1.0, 10))
    sched.update_priorities(np.arange(64), np.linspace(0.1, 4, 64))
    for i in range(4):
        s = sched.sample(16)
        w = s.weights.numpy().ravel()
        # drawn in order: the i-th draw used the schedule's i-th beta, also when drawn ahead
        np.testing.assert_allclose(w, expected_weights(sched, s.indices.numpy(), 0.2 + 0.08 * i), rtol=1e-5)
    sched.close()
    steps = filled(n=10, prefetch=prefetch, beta=0.4, beta_steps=40)
    s = steps.sample(8)
    assert steps.beta == pytest.approx(0.55)
    for t in range(10, 30):  # adds anneal it; the open sampler's batches follow
        o = np.zeros((1, 3), np.float32)
        steps.add(o, o, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    steps.update_priorities(np.arange(30), np.linspace(0.1, 4, 30))
    s = steps.sample(8)
    assert steps.beta == pytest.approx(0.85)
    assert s.weights.shape == (8, 1) and float(s.weights.max()) <= 1.0
    steps.close()


def test_save_and_load_while_the_sampler_has_batches_ready(tmp_path):
    """Pickling drops the prepared batches first: the run that goes on and
    the one loaded from the pickle draw the same next batches."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=30,
                                    buffer_size=200, batch_size=16, policy_kwargs={"net_arch": [16]},
                                    replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "live")})
    model.learn(120)
    rb = model.replay_buffer
    assert rb._feed is not None
    wait_for(lambda: rb._feed.ready == rb.prefetch)  # batches drawn ahead, waiting
    model.save_replay_buffer(tmp_path / "rb")
    assert rb._feed is None
    going_on = [rb.sample(16) for _ in range(3)]
    rb.close()
    model.load_replay_buffer(tmp_path / "rb.pkl")
    rb2 = model.replay_buffer
    for want in going_on:
        got = rb2.sample(16)
        for name in ("observations", "actions", "rewards", "dones", "weights", "indices"):
            assert th.equal(getattr(got, name), getattr(want, name)), name
    model.learn(40, reset_num_timesteps=False)  # training goes on from the loaded buffer
    rb2.close()


def test_load_replay_buffer_drops_the_old_samplers_batches(tmp_path):
    rb = filled(snapshot_dir=str(tmp_path / "snaps"))
    rb.sample(8)
    blob = pickle.dumps(rb)  # closes its sampler first
    assert rb._feed is None
    rb.sample(8)
    back = pickle.loads(blob)
    assert back.prefetch == rb.prefetch and back.device_tier is None
    assert back.sample(8).indices.shape == (8,)
    rb.close()
    back.close()


def test_two_threads_sample_and_update_at_once():
    rb = filled(n=200, cap=128)
    errors, counts = [], [0, 0]

    def learner(k):
        try:
            for _ in range(150):
                s = rb.sample(16)
                assert s.observations.shape == (16, 3)
                assert ((s.indices >= 0) & (s.indices < 128)).all()
                rb.update_priorities(s.indices, th.rand(16) + 0.01)
                counts[k] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=learner, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for _ in range(100):  # and a collector adding meanwhile
        o = np.zeros((1, 3), np.float32)
        rb.add(o, o, np.array([1]), np.array([1.0]), np.array([False]), [{}])
    for t in ts:
        t.join(120)
    assert not errors, errors
    assert counts == [150, 150]
    leaves = rb.buffer.leaves(np.arange(128))
    assert np.isfinite(leaves).all() and (leaves >= 0).all()
    rb.close()


@pytest.mark.parametrize("which", ["drop-in", "core"])
def test_buffer_closed_under_a_sampling_thread(which):
    """Closed from another thread while one samples in a loop: that loop gets
    BufferClosedError (never a silent StopIteration, never a hang), and so
    does every later call."""
    rb = filled()
    seen = []

    def loop():
        try:
            while True:
                s = rb.sample(8)
                rb.update_priorities(s.indices, th.ones(8))
        except BaseException as e:  # noqa: BLE001
            seen.append(e)

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.3)
    (rb.close if which == "drop-in" else rb.buffer.close)()
    t.join(60)
    assert not t.is_alive()
    assert len(seen) == 1 and isinstance(seen[0], BufferClosedError), seen
    with pytest.raises(BufferClosedError):
        rb.sample(8)
    rb.close()


def test_learn_after_the_core_was_closed_under_the_model(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=20,
                                buffer_size=300, batch_size=16, policy_kwargs={"net_arch": [16]})
    m.learn(60)
    assert m.replay_buffer._feed is not None
    m.replay_buffer.buffer.close()  # the bigper buffer itself, under the drop-in and its sampler
    with pytest.raises(BufferClosedError):
        m.learn(30, reset_num_timesteps=False)


def test_the_models_buffer_replaced_stops_the_old_sampler():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=20,
                                buffer_size=300, batch_size=16, policy_kwargs={"net_arch": [16]})
    m.learn(60)
    old = m.replay_buffer
    assert old._feed is not None
    m.replay_buffer = bsb3.PrioritizedReplayBuffer(300, m.observation_space, m.action_space, device="cpu")
    m.learn(60, reset_num_timesteps=False)
    assert old._feed is None and m.replay_buffer._feed is not None
    assert not old.closed  # only its sampler: the buffer is the user's
    old.close()
    m.replay_buffer.close()


def test_a_failed_draw_then_a_good_one():
    """A draw that fails (nothing sampleable yet) ends that sampler; the next
    call, once there is something to draw, opens another."""
    rb = bsb3.PrioritizedReplayBuffer(16, OBS, ACT, device="cpu", n_steps=3)
    o = np.zeros((1, 3), np.float32)
    rb.add(o, o, np.array([0]), np.array([0.0]), np.array([False]), [{}])  # its window is not complete
    for _ in range(2):
        with pytest.raises(InvalidArgumentError):
            rb.sample(4)
        assert rb._feed is None
    for _ in range(3):
        rb.add(o, o, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    assert rb.sample(4).discounts.shape == (4, 1)
    rb.close()


def test_bad_options_are_refused():
    for bad in (-1, 1025, True, 2.0, "2", None):
        with pytest.raises(InvalidArgumentError, match="prefetch"):
            bsb3.PrioritizedReplayBuffer(8, OBS, ACT, device="cpu", prefetch=bad)
    for bad in ("nope", 3, object()):
        with pytest.raises(InvalidArgumentError, match="device_tier"):
            bsb3.PrioritizedReplayBuffer(8, OBS, ACT, device="cpu", device_tier=bad)
    with pytest.raises(InvalidArgumentError, match="device tier twice"):
        bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu",
                            replay_buffer_kwargs={"device": "cpu", "device_tier": True})
    # the plain SB3 algorithm passes its own device=: the tier is device_tier there
    from stable_baselines3 import DQN

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = DQN("MlpPolicy", "CartPole-v1", device="cpu", buffer_size=100, learning_starts=10,
                replay_buffer_class=bsb3.PrioritizedReplayBuffer, replay_buffer_kwargs={"device_tier": True})
    assert m.replay_buffer.buffer.device == th.device("cpu")
    m.learn(30)
    m.replay_buffer.close()


def test_a_tier_buffer_pickles_with_its_tier(tmp_path):
    rb = filled(device_tier="cpu", snapshot_dir=str(tmp_path / "snaps"))
    assert rb.buffer.device == th.device("cpu")
    back = pickle.loads(pickle.dumps(rb))
    assert back.device_tier == "cpu" and back.buffer.device == th.device("cpu")
    s = back.sample(8)
    back.update_priorities(s.indices, th.ones(8))
    core = back.buffer
    other = bsb3.PrioritizedReplayBuffer.from_buffer(core, OBS, ACT, device="cpu")  # a tier buffer is taken
    assert other.sample(4).indices.shape == (4,)
    rb.close()
    back.close()


CHILD = r"""
import sys, warnings
import torch
torch.set_num_threads(1)
from stable_baselines3.common.callbacks import BaseCallback
from bigper.integrations.sb3 import PrioritizedDQN

class Say(BaseCallback):
    def _on_step(self):
        if self.num_timesteps == 150:  # a checkpoint while the sampler has batches drawn ahead
            self.model.save_replay_buffer(sys.argv[2])
            print("saved", self.model.replay_buffer.buffer.state_dict()[0]["count"], flush=True)
        if self.num_timesteps == 200:
            print("learning", flush=True)
        return True

warnings.simplefilter("ignore")
m = PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=20, train_freq=1,
                   buffer_size=400, batch_size=16, policy_kwargs={"net_arch": [16]},
                   replay_buffer_kwargs={"storage": "memmap", "path": sys.argv[1], "device": True})
m.learn(1_000_000, callback=Say())
"""


def test_kill_9_during_learn_then_resume(tmp_path):
    """A child learning with the sampler prefetching (and the tier) saves its
    buffer, learns on and is killed with SIGKILL: its live folder is refused
    as unclean, and a new process loads the checkpoint (taking the folder
    over) and learns on, the sampler and the tier working."""
    live, ckpt = tmp_path / "live", tmp_path / "rb"
    with Child(CHILD, live, ckpt) as child:
        saved = int(child.said("saved").split()[1])
        child.said("learning")
        time.sleep(0.2)  # mid-learn: the sampler's thread drawing, adds and updates going on
        child.kill()

    def model(**rbk):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=1, learning_starts=0,
                                       buffer_size=400, batch_size=16, policy_kwargs={"net_arch": [16]},
                                       replay_buffer_kwargs={"storage": "memmap", "device": True, **rbk})

    with pytest.raises(UncleanStorageError):
        model(path=str(live), mode="resume").learn(10)
    m = model(path=str(tmp_path / "other"))
    m.load_replay_buffer(f"{ckpt}.pkl")
    rb = m.replay_buffer
    assert len(rb.buffer) == saved and rb.buffer.device == th.device("cpu") and rb.device_tier is True
    m.learn(100)
    assert len(rb.buffer) == min(saved + 100, 400) and rb._feed is not None
    s = rb.sample(16)
    assert s.observations.shape == (16, 4)
    rb.close()


def test_a_sampler_closed_under_a_sampling_thread_is_replaced_never_a_silent_end():
    """close_sampler from another thread while one samples in a loop: that loop
    goes on with a new sampler (the one closed under its next() ended it with
    StopIteration, which must not reach SB3); the buffer's close then ends it
    with BufferClosedError."""
    rb = filled()
    seen, drawn = [], [0]

    def loop():
        try:
            while True:
                s = rb.sample(8)
                rb.update_priorities(s.indices, th.ones(8))
                drawn[0] += 1
        except BaseException as e:  # noqa: BLE001
            seen.append(e)

    t = threading.Thread(target=loop)
    t.start()
    for _ in range(200):
        rb.close_sampler()
        time.sleep(0.002)
    assert t.is_alive() and not seen, seen
    n = drawn[0]
    wait_for(lambda: drawn[0] > n + 5)
    rb.close()
    t.join(60)
    assert not t.is_alive()
    assert len(seen) == 1 and isinstance(seen[0], BufferClosedError), seen
