"""What SB3's writers write, SB3's readers read (issue 33, the SB3 parts).

Every writer (a model's ``save``, ``save_replay_buffer``) of DQN and SAC and
their prioritized classes, under the default configs, into every reader
(``load``, ``load_replay_buffer``) of the same family: it opens exactly, or
bigper refuses it naming why; never a raw exception. And QR-DQN's training
step is sb3-contrib's on the same batch (a swap of current and target
quantiles only showed in a slow learning test).
"""

from __future__ import annotations

import warnings

import pytest

th = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")
sb3 = pytest.importorskip("stable_baselines3")

from stable_baselines3.common.type_aliases import ReplayBufferSamples  # noqa: E402

from bigper.errors import BigperError  # noqa: E402
from bigper.integrations import sb3 as bsb3  # noqa: E402

from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)


FAMILIES = {"DQN": "CartPole-v1", "SAC": "Pendulum-v1"}


def small() -> dict:
    """Fresh every time: SB3 writes into a model's policy_kwargs."""
    return dict(learning_starts=20, buffer_size=400, batch_size=16, policy_kwargs={"net_arch": [16]})


def algo(family: str, prioritized: bool):
    return getattr(bsb3, f"Prioritized{family}") if prioritized else getattr(sb3, family)


def trained(family: str, prioritized: bool, tmp_path, **kw):
    m = algo(family, prioritized)("MlpPolicy", FAMILIES[family], device="cpu", seed=0, **small(), **kw)
    m.learn(40)
    return m


def params(m) -> dict:
    return {k: v.clone() for k, v in m.policy.state_dict().items()}


# -- model zips: every writer into every reader of its family ---------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("writer", ["plain", "prioritized"])
@pytest.mark.parametrize("reader", ["plain", "prioritized"])
@pytest.mark.parametrize("n_steps", [1, 3])
def test_a_model_zip_loads_into_either_class_exactly(tmp_path, family, writer, reader, n_steps):
    m = trained(family, writer == "prioritized", tmp_path, n_steps=n_steps)
    m.save(tmp_path / "model.zip")
    want = params(m)
    if m.replay_buffer is not None and hasattr(m.replay_buffer, "close"):
        m.replay_buffer.close()
    try:
        loaded = algo(family, reader == "prioritized").load(tmp_path / "model.zip", env=gym.make(FAMILIES[family]),
                                                           device="cpu")
    except BigperError as e:  # a refusal is fine when it says why
        assert "replay_buffer_class" in str(e), e
        return
    got = params(loaded)
    assert want.keys() == got.keys() and all(th.equal(want[k], got[k]) for k in want)
    if reader == "prioritized":
        rb = loaded.replay_buffer
        assert isinstance(rb, bsb3.PrioritizedReplayBuffer) and rb.n_steps == n_steps
        assert rb.gamma == loaded.gamma
    # and it trains on, once its fresh buffer holds a few windows again (the zip has no transitions)
    loaded.learning_starts = loaded.num_timesteps + 10
    loaded.learn(30, reset_num_timesteps=False)
    if reader == "prioritized":
        loaded.replay_buffer.close()


def test_a_plain_model_with_a_buffer_bigper_cannot_stand_in_for_is_refused_saying_why(tmp_path):
    from stable_baselines3.common.buffers import DictReplayBuffer

    m = sb3.DQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, **small())
    m.replay_buffer_class = DictReplayBuffer  # as a model saved with it names it
    m.save(tmp_path / "model.zip")
    with pytest.raises(BigperError, match="DictReplayBuffer"):
        bsb3.PrioritizedDQN.load(tmp_path / "model.zip", device="cpu")


# -- replay-buffer pickles: every writer into every reader -----------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("writer", ["plain", "prioritized"])
@pytest.mark.parametrize("reader", ["plain", "prioritized"])
def test_a_replay_buffer_pickle_opens_exactly_or_is_refused(tmp_path, family, writer, reader):
    kw = {"replay_buffer_class": bsb3.PrioritizedReplayBuffer} if writer == "plain" else {}
    kw["replay_buffer_kwargs"] = {"storage": "memmap", "path": str(tmp_path / "live")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plain SB3 with the drop-in: "nothing updates priorities"
        m = trained(family, writer == "prioritized", tmp_path, **kw)
    m.save_replay_buffer(tmp_path / "rb")
    rb = m.replay_buffer
    want = [rb.sample(16, beta=0.5) for _ in range(2)]
    held = rb.size()
    rb.close()
    other = algo(family, reader == "prioritized")("MlpPolicy", FAMILIES[family], device="cpu", seed=1,
                                                   **small(), **({} if reader == "prioritized" else
                                                               {"replay_buffer_class": bsb3.PrioritizedReplayBuffer}))
    try:
        other.load_replay_buffer(tmp_path / "rb.pkl")
    except BigperError as e:
        assert "rb.pkl" in str(e) or "snapshot" in str(e), e
        return
    back = other.replay_buffer
    assert back.size() == held
    for w in want:
        got = back.sample(16, beta=0.5)
        for k, v in w._asdict().items():
            assert (v is None and getattr(got, k) is None) or th.equal(getattr(got, k), v), k
    back.close()


def test_a_plain_sb3_buffer_pickle_into_a_prioritized_model_is_refused_by_bigper(tmp_path):
    m = sb3.DQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, **small())
    m.learn(40)
    m.save_replay_buffer(tmp_path / "rb")
    p = bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, **small())
    before = p.replay_buffer
    with pytest.raises(BigperError, match="not a bigper SB3 replay buffer"):
        p.load_replay_buffer(tmp_path / "rb.pkl")
    assert p.replay_buffer is before and not before.closed
    before.close()


# -- QR-DQN: one training step is sb3-contrib's on the same batch ---------------------------------
def test_qrdqn_train_step_is_sb3_contribs_on_the_same_batch():
    contrib = pytest.importorskip("sb3_contrib")
    kw = dict(learning_starts=10_000, buffer_size=400, policy_kwargs={"net_arch": [16], "n_quantiles": 7},
              device="cpu", seed=0, max_grad_norm=1e9)
    per = bsb3.PrioritizedQRDQN("MlpPolicy", "CartPole-v1", **kw)
    per.learn(100)  # learning_starts not reached: transitions in, no gradient step
    theirs = contrib.QRDQN("MlpPolicy", "CartPole-v1", **kw)
    theirs.learn(1)  # its logger set up
    theirs.policy.load_state_dict(per.policy.state_dict())
    rb = per.replay_buffer
    data = rb.sample(32)
    ones = data._replace(weights=th.ones_like(data.weights))
    rb.sample = lambda *a, **k: ones
    theirs.replay_buffer.sample = lambda *a, **k: ReplayBufferSamples(
        data.observations, data.actions, data.next_observations, data.dones, data.rewards)
    before = params(per)
    per.train(gradient_steps=1, batch_size=32)
    theirs.train(gradient_steps=1, batch_size=32)
    a, b = params(per), params(theirs)
    moved = [k for k in a if "quantile_net." in k and not th.equal(a[k], before[k])]
    assert moved, "the step changed nothing"
    for k in a:
        assert th.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k
    rb.close()


def test_learn_on_from_a_zip_without_its_buffer_says_what_to_do(tmp_path):
    """n_steps > 1: the loaded model trains at once (its step count is past
    learning_starts), and its fresh buffer has no complete window yet."""
    m = trained("SAC", True, tmp_path, n_steps=3)
    m.save(tmp_path / "model.zip")
    loaded = bsb3.PrioritizedSAC.load(tmp_path / "model.zip", env=gym.make("Pendulum-v1"), device="cpu")
    with pytest.raises(BigperError, match="learning_starts") as e:
        loaded.learn(10, reset_num_timesteps=False)
    assert "load_replay_buffer" in str(e.value)
    loaded.learning_starts = loaded.num_timesteps + 5  # what the error says: then it trains on
    loaded.learn(10, reset_num_timesteps=False)
    loaded.replay_buffer.close()
