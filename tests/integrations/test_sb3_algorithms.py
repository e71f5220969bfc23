"""Prioritized SB3 / sb3-contrib algorithms (issue 26): one shared PER mechanism.

For each algorithm: the IS weights really scale the critic loss (rows with
weight 0 get no gradient; all weights 0 leave the critic as it was), the
losses equal SB3's own with weights 1, priorities change after ``learn()``,
and ``save_replay_buffer``/``load_replay_buffer`` resume sampling exactly.
The learning tests (Pendulum-v1, CartPole-v1, against plain SB3 with the same
seeds) are behind the ``slow`` marker.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import warnings

import numpy as np
import pytest


def _dev_extra() -> list[str]:
    """The distributions bigper's ``dev`` extra pins (its installed metadata)."""
    try:
        reqs = importlib.metadata.requires("bigper") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in reqs if re.search(r"extra\s*==\s*.dev.", r)]


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


_SB3 = {"stable-baselines3": "stable_baselines3", "sb3-contrib": "sb3_contrib"}
_DEV = _dev_extra()
# The dev suite: every other package the dev extra pins is installed. There, a missing SB3
# extra is a broken install, and the tests that need it fail (loudly), never skip.
DEV_SUITE = bool(_DEV) and all(_installed(d) for d in _DEV if d not in _SB3)
MISSING = [d for d in _DEV if d in _SB3 and not _importable(_SB3[d])] if DEV_SUITE else []


def _need(module: str):
    return importlib.import_module(module) if DEV_SUITE else pytest.importorskip(module)


th = _need("torch")
gym = _need("gymnasium")
_need("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import bigper  # noqa: E402
from bigper.errors import BufferClosedError, InvalidArgumentError, PathExistsError  # noqa: E402
from bigper.integrations import sb3 as bsb3  # noqa: E402
from bigper.integrations._sb3_per import huber_loss, mse_loss, quantile_loss  # noqa: E402

from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)

try:
    import sb3_contrib  # noqa: F401
    HAVE_CONTRIB = True
except ImportError:
    HAVE_CONTRIB = False

contrib = pytest.mark.skipif(not HAVE_CONTRIB and not DEV_SUITE, reason="needs the sb3-contrib extra")


def test_a_dev_install_has_every_sb3_extra_it_pins():
    assert not MISSING, (f"the dev extra pins {MISSING}, which is not installed: reinstall with "
                         "pip install -e '.[dev]' (its tests would otherwise skip quietly)")
CONTINUOUS = ["PrioritizedSAC", "PrioritizedTD3", "PrioritizedDDPG",
              pytest.param("PrioritizedTQC", marks=contrib)]
DISCRETE = ["PrioritizedDQN", pytest.param("PrioritizedQRDQN", marks=contrib)]


def build(name: str, **kw):
    cls = getattr(bsb3, name)
    env = "Pendulum-v1" if name in ("PrioritizedSAC", "PrioritizedTD3", "PrioritizedDDPG", "PrioritizedTQC") \
        else "CartPole-v1"
    kw.setdefault("learning_starts", 50)
    kw.setdefault("buffer_size", 2_000)
    kw.setdefault("batch_size", 32)
    kw.setdefault("policy_kwargs", {"net_arch": [32, 32]})
    return cls("MlpPolicy", env, device="cpu", seed=0, **kw)


def critic_grads(model) -> list:
    """Record the critic's gradients each time its optimizer steps (then only
    the critic loss has flowed into them: the algorithm zeroes them just before)."""
    opt = model.critic.optimizer if hasattr(model, "critic") else model.policy.optimizer
    seen, step = [], opt.step

    def recording_step(*a, **k):
        seen.append([None if p.grad is None else p.grad.detach().clone()
                     for g in opt.param_groups for p in g["params"]])
        return step(*a, **k)

    opt.step = recording_step
    return seen


def fill(model, steps: int = 200) -> None:
    model.learn(steps)  # learning_starts < steps: some train() calls happened too


def zero_weights(rb):
    orig = rb.sample

    def sample(*a, **k):
        s = orig(*a, **k)
        return s._replace(weights=th.zeros_like(s.weights))

    rb.sample = sample


# -- the loss helpers: weights per row, SB3's loss with weights 1 --------------------------
def _rows_without_weight_get_no_gradient(loss_fn, current, target, n_rows):
    w = th.ones(n_rows, 1)
    w[n_rows // 2:] = 0
    current = current.clone().requires_grad_(True)
    loss, td = loss_fn(current, target, w)
    loss.backward()
    g = current.grad.reshape(n_rows, -1).abs().sum(dim=1)
    assert (g[n_rows // 2:] == 0).all() and (g[:n_rows // 2] > 0).all()
    assert td.shape == (n_rows,) and (td >= 0).all()


def test_mse_loss_is_sb3s_with_weights_one_and_weights_rows():
    gen = th.Generator().manual_seed(0)
    q1, q2, y = (th.randn(16, 1, generator=gen) for _ in range(3))
    loss, td = mse_loss((q1, q2), y, th.ones(16, 1), scale=0.5)
    want = 0.5 * (F.mse_loss(q1, y) + F.mse_loss(q2, y))
    assert th.allclose(loss, want, rtol=1e-6)
    assert th.allclose(td, ((q1 - y).abs() + (q2 - y).abs()).reshape(-1) / 2)
    # weights scale each row's term: doubling one row's weight adds that row's term once more
    w = th.ones(16, 1)
    w[3] = 2
    loss2, _ = mse_loss((q1, q2), y, w, scale=0.5)
    extra = 0.5 * ((q1[3] - y[3]) ** 2 + (q2[3] - y[3]) ** 2) / 16
    assert th.allclose(loss2, loss + extra, rtol=1e-5)
    _rows_without_weight_get_no_gradient(lambda c, t, w: mse_loss((c, c * 2), t, w), q1, y, 16)


def test_huber_loss_is_sb3_dqns_with_weights_one():
    gen = th.Generator().manual_seed(1)
    q, y = th.randn(12, 1, generator=gen) * 3, th.randn(12, 1, generator=gen)
    loss, td = huber_loss(q, y, th.ones(12, 1))
    assert th.allclose(loss, F.smooth_l1_loss(q, y), rtol=1e-6)
    assert th.allclose(td, (q - y).abs().reshape(-1))
    _rows_without_weight_get_no_gradient(huber_loss, q, y, 12)


@contrib
@pytest.mark.parametrize("shape,target_shape,summed", [((8, 5), (8, 7), True), ((8, 2, 5), (8, 1, 6), False)])
def test_quantile_loss_is_sb3_contribs_with_weights_one(shape, target_shape, summed):
    from sb3_contrib.common.utils import quantile_huber_loss

    gen = th.Generator().manual_seed(2)
    cur, tgt = th.randn(*shape, generator=gen) * 2, th.randn(*target_shape, generator=gen) * 2
    loss, td = quantile_loss(cur, tgt, th.ones(8, 1), sum_over_quantiles=summed)
    assert th.allclose(loss, quantile_huber_loss(cur, tgt, sum_over_quantiles=summed), rtol=1e-5)
    pairs = (tgt.unsqueeze(-2) - cur.unsqueeze(-1)).abs().reshape(8, -1).mean(dim=1)
    assert th.allclose(td, pairs)
    _rows_without_weight_get_no_gradient(lambda c, t, w: quantile_loss(c, t, w, summed), cur, tgt, 8)


# -- each algorithm: weights reach its critic, priorities move, resume is exact -------------
@pytest.mark.parametrize("name", CONTINUOUS + DISCRETE)
def test_zero_weights_give_the_critic_no_gradient(name):
    model = build(name)
    fill(model)
    grads = critic_grads(model)
    model.train(gradient_steps=1, batch_size=32)
    assert any(g is not None and g.abs().sum() > 0 for g in grads[-1]), "weights 1: the critic learns"
    zero_weights(model.replay_buffer)
    model.train(gradient_steps=1, batch_size=32)
    assert len(grads) == 2
    assert all(g is None or g.abs().sum() == 0 for g in grads[-1]), "weights 0: no gradient at all"


@pytest.mark.parametrize("name", CONTINUOUS + DISCRETE)
def test_priorities_change_after_learn_and_beta_anneals(name):
    model = build(name, learning_starts=100)
    model.learn(400)
    rb = model.replay_buffer
    leaves = rb.buffer.leaves(np.arange(len(rb.buffer)))
    assert np.unique(leaves).size > 50  # written back, not left at the max
    assert rb.beta0 == 0.4 and model.last_beta > 0.95  # annealed to 1.0 over learn()


@pytest.mark.parametrize("name", CONTINUOUS + DISCRETE)
def test_save_and_load_replay_buffer_resume_sampling_exactly(tmp_path, name):
    model = build(name, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "live")})
    model.learn(150)
    rb = model.replay_buffer
    model.save_replay_buffer(tmp_path / "rb")
    expected = [rb.sample(16) for _ in range(2)]
    rb.close()
    model.load_replay_buffer(tmp_path / "rb.pkl")
    rb2 = model.replay_buffer
    assert rb2.size() == rb.size() and rb2.pos == rb.pos
    for want in expected:
        got = rb2.sample(16)
        for k, v in want._asdict().items():
            if v is None:
                assert getattr(got, k) is None
            else:
                assert th.equal(getattr(got, k), v), k
    model.learn(50, reset_num_timesteps=False)  # and training goes on over the loaded buffer
    rb2.close()


# -- what the buffer refuses, with the alternative named -------------------------------------
def test_dict_observations_and_her_are_refused_naming_the_alternative():
    obs = spaces.Dict({"observation": spaces.Box(-1, 1, (3,)), "desired_goal": spaces.Box(-1, 1, (2,))})
    with pytest.raises(InvalidArgumentError, match="FlattenObservation") as info:
        bsb3.PrioritizedReplayBuffer(100, obs, spaces.Box(-1, 1, (1,)), device="cpu")
    assert "DictReplayBuffer" in str(info.value) and "observation_space" in str(info.value)
    from stable_baselines3 import HerReplayBuffer

    with pytest.raises(InvalidArgumentError, match="HerReplayBuffer") as info:
        bsb3.PrioritizedSAC("MultiInputPolicy", "Pendulum-v1", replay_buffer_class=HerReplayBuffer)
    assert "uniform" in str(info.value)


# -- the CleanRL client's fixes -----------------------------------------------------------------
OBS = spaces.Box(-10, 10, (3,), np.float32)
ACT = spaces.Discrete(2)


def add(rb, t):
    o = np.full((rb.n_envs, 3), t, np.float32)
    rb.add(o, o + 1, np.zeros(rb.n_envs, np.int64), np.full(rb.n_envs, float(t)),
           np.zeros(rb.n_envs, bool), [{}] * rb.n_envs)


def test_beta_steps_anneals_by_add_count_and_resumes(tmp_path):
    rb = bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu", beta=0.4, beta_steps=40,
                                      storage="memmap", path=str(tmp_path / "live"))
    for t in range(10):
        add(rb, t)
    s = rb.sample(8)  # weights at beta = 0.4 + 0.6 * 10/40
    probs = rb.buffer.leaves(rb._last_draw()[0]) / rb.buffer.total_priority  # P(i) at the draw (no update since)
    n = len(rb.buffer)
    w = (n * probs) ** -0.55
    np.testing.assert_allclose(s.weights.numpy().reshape(-1), w / w.max() if np.ptp(probs) else np.ones(8),
                               rtol=1e-5)
    assert rb.beta_for_learner(1.0) == pytest.approx(0.55)
    for t in range(10, 50):
        add(rb, t)
    assert rb.beta_for_learner(1.0) == 1.0  # past beta_steps: 1.0, whatever learn's progress
    with pytest.raises(InvalidArgumentError, match="beta_steps"):
        bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu", beta_steps=0)
    rb.update_priorities(np.arange(20), np.linspace(0.1, 3, 20))
    blob = __import__("pickle").dumps(rb)
    rb.close()
    back = __import__("pickle").loads(blob)
    assert back.beta_steps == 40 and back.beta_for_learner(1.0) == 1.0
    back.close()


def test_storage_is_created_at_construction_and_a_rerun_is_told(tmp_path):
    live = tmp_path / "live"
    rb = bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu", storage="memmap", path=str(live))
    assert (live / "meta.json").is_file()  # before any add
    add(rb, 0)
    rb.close()
    again = bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu", storage="memmap", path=str(live))
    with pytest.raises(PathExistsError, match="mode='resume'"):
        add(again, 1)


def test_resume_keeps_size_and_pos_and_from_buffer_wraps_a_loaded_snapshot(tmp_path):
    live = tmp_path / "live"
    rb = bsb3.PrioritizedReplayBuffer(16, OBS, ACT, device="cpu", n_envs=2, storage="memmap", path=str(live))
    for t in range(11):
        add(rb, t)
    assert (rb.size(), rb.pos, rb.full) == (8, 3, True)
    snaps = bigper.Snapshots(tmp_path / "snaps")
    snaps.save(rb.buffer)
    rb.update_priorities(np.arange(16), np.linspace(0.5, 2, 16))
    rb.close()
    resumed = bsb3.PrioritizedReplayBuffer(16, OBS, ACT, device="cpu", n_envs=2, storage="memmap",
                                           path=str(live), mode="resume")
    assert (resumed.size(), resumed.pos, resumed.full) == (8, 3, True)
    resumed.close()
    core = snaps.load_latest(path=tmp_path / "live2")
    wrapped = bsb3.PrioritizedReplayBuffer.from_buffer(core, OBS, ACT, device="cpu")
    assert (wrapped.size(), wrapped.pos, wrapped.n_envs) == (8, 3, 2)
    s = wrapped.sample(32)
    assert set(s.rewards.reshape(-1).tolist()) <= {float(t) for t in range(3, 11)}
    add(wrapped, 11)
    assert wrapped.pos == 4
    with pytest.raises(InvalidArgumentError, match="fields"):
        bsb3.PrioritizedReplayBuffer.from_buffer(core, spaces.Box(-1, 1, (4,), np.float32), ACT, device="cpu")
    wrapped.close()
    with pytest.raises(BufferClosedError):
        bsb3.PrioritizedReplayBuffer.from_buffer(core, OBS, ACT, device="cpu")


def test_plain_sampling_without_write_back_warns_once_naming_prioritized_dqn():
    rb = bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu")
    for t in range(20):
        add(rb, t)
    with pytest.warns(UserWarning, match="PrioritizedDQN") as rec:
        for _ in range(250):
            rb.sample(4)
    assert len([r for r in rec if "PrioritizedDQN" in str(r.message)]) == 1
    quiet = bsb3.PrioritizedReplayBuffer(64, OBS, ACT, device="cpu")
    for t in range(20):
        add(quiet, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(250):  # a loop that writes priorities back is never told
            s = quiet.sample(4)
            quiet.update_priorities(s.indices, th.rand(4) + 0.1)


# -- learning, against plain SB3 with the same seeds (slow) -------------------------------------
PENDULUM = {  # rl-zoo's Pendulum-v1 settings, budgets cut to what plain SB3 reaches with these seeds
    "SAC": dict(steps=8_000, kw=dict(learning_rate=1e-3)),
    "TD3": dict(steps=10_000, kw=dict(learning_rate=1e-3, gamma=0.98, buffer_size=200_000,
                                      policy_kwargs={"net_arch": [400, 300]})),
    "DDPG": dict(steps=10_000, kw=dict(learning_rate=1e-3, gamma=0.98, buffer_size=200_000,
                                       policy_kwargs={"net_arch": [400, 300]})),
    "TQC": dict(steps=8_000, kw=dict(learning_rate=1e-3)),
}


def _learn_and_score(cls, env_id: str, steps: int, seed: int, **kw) -> float:
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.monitor import Monitor

    model = cls("MlpPolicy", env_id, device="cpu", seed=seed, **kw)
    model.learn(steps)
    env = Monitor(gym.make(env_id))
    env.reset(seed=1000 + seed)
    mean, _ = evaluate_policy(model, env, n_eval_episodes=5, deterministic=True)
    return float(mean)


def _record(name: str, figures: dict) -> None:
    out = os.environ.get("BIGPER_LEARNING_LOG")
    print(name, json.dumps(figures))
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"algo": name, **figures}) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["SAC", "TD3", "DDPG", pytest.param("TQC", marks=contrib)])
def test_pendulum_learns_with_per_as_plain_sb3_does(algo):
    import stable_baselines3 as sb3

    plain_cls = getattr(sb3, algo, None)
    if plain_cls is None:
        import sb3_contrib as c

        plain_cls = getattr(c, algo)
    cfg = PENDULUM[algo]
    extra = {}
    if algo in ("TD3", "DDPG"):
        from stable_baselines3.common.noise import NormalActionNoise

        extra["action_noise"] = NormalActionNoise(np.zeros(1), 0.1 * np.ones(1))
    plain = _learn_and_score(plain_cls, "Pendulum-v1", cfg["steps"], 0, **cfg["kw"], **extra)
    per = _learn_and_score(getattr(bsb3, f"Prioritized{algo}"), "Pendulum-v1", cfg["steps"], 0,
                           **cfg["kw"], **extra)
    _record(algo, {"env": "Pendulum-v1", "steps": cfg["steps"], "plain_sb3": plain, "bigper_per": per})
    assert per > -400, (per, plain)


@pytest.mark.slow
@contrib
def test_qrdqn_learns_cartpole_as_plain_sb3_does():
    from sb3_contrib import QRDQN

    # rl-zoo's CartPole-v1 QR-DQN settings with a shorter budget
    kw = dict(learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1_000, gamma=0.99,
              target_update_interval=10, train_freq=256, gradient_steps=128, exploration_fraction=0.16,
              exploration_final_eps=0.04, policy_kwargs={"net_arch": [256, 256], "n_quantiles": 10})
    plain = _learn_and_score(QRDQN, "CartPole-v1", 20_000, 0, **kw)
    per = _learn_and_score(bsb3.PrioritizedQRDQN, "CartPole-v1", 20_000, 0, **kw)
    _record("QRDQN", {"env": "CartPole-v1", "steps": 20_000, "plain_sb3": plain, "bigper_per": per})
    assert per > 150, (per, plain)


# -- each train() is SB3's but for the PER lines (catches a drift of the pinned SB3) -------------
def _code_lines(fn) -> list[str]:
    import inspect
    import re

    out = []
    for line in inspect.getsource(fn).splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith(("#", "assert ", '"""')):
            out.append(line)
    return out


def _joined(lines: list[str]) -> list[str]:
    """Lines with their continuations joined (our layout wraps where SB3's does not)."""
    out, depth = [], 0
    for line in lines:
        if depth > 0:
            out[-1] += " " + line
        else:
            out.append(line)
        depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
    return [" ".join(x.replace("( ", "(").split()) for x in out]


OURS_ONLY = ("_per_", "mse_loss(", "huber_loss(", "quantile_loss(")
THEIRS_ONLY = (".sample(", "F.mse_loss", "smooth_l1_loss", "quantile_huber_loss", "critic_loss =", "loss =")


def _pairs():
    pairs = [("PrioritizedDQN", "stable_baselines3", "DQN"), ("PrioritizedSAC", "stable_baselines3", "SAC"),
             ("PrioritizedTD3", "stable_baselines3", "TD3")]
    if HAVE_CONTRIB:
        pairs += [("PrioritizedQRDQN", "sb3_contrib", "QRDQN"), ("PrioritizedTQC", "sb3_contrib", "TQC")]
    return pairs


@pytest.mark.parametrize("ours,pkg,theirs", _pairs())
def test_train_is_the_pinned_sb3_train_but_for_the_per_lines(ours, pkg, theirs):
    import difflib
    import importlib

    mine = _joined(_code_lines(getattr(bsb3, ours).train))
    sb3s = _joined(_code_lines(getattr(importlib.import_module(pkg), theirs).train))
    extra, missing = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=sb3s, b=mine, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        missing += [x for x in sb3s[i1:i2] if not any(p in x for p in THEIRS_ONLY)]
        extra += [x for x in mine[j1:j2] if not any(p in x for p in OURS_ONLY)]
    assert not missing, f"{theirs}.train has lines {ours}.train lacks (did SB3 change?): {missing}"
    assert not extra, f"{ours}.train has lines SB3's lacks: {extra}"


def test_sac_example_smoke(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                      os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "bigper.examples.sb3_sac", "--smoke"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "next sample identical to the saved run's: True" in out.stdout
    assert not list(tmp_path.iterdir())


# The drop-in hands the reward to the core uncast; the core's lossless-ingest check (issue 23
# section 4, another branch) refuses what float32 cannot hold. Strict: this turns into a failure
# (XPASS) once that check lands, so the marker is removed then, not forgotten.
def test_a_reward_that_does_not_fit_float32_is_refused_not_stored_as_inf():
    rb = bsb3.PrioritizedReplayBuffer(16, OBS, ACT, device="cpu")
    add(rb, 0)
    before = repr(rb.buffer.state_dict()[0])
    o = np.zeros((1, 3), np.float32)
    with pytest.raises(InvalidArgumentError, match="reward"):
        rb.add(o, o, np.zeros(1, np.int64), np.array([1e300]), np.zeros(1, bool), [{}])
    assert repr(rb.buffer.state_dict()[0]) == before and rb.size() == 1


def test_the_drop_ins_beta_is_readable_and_refuses_assignment():
    """CleanRL's own PER sets ``rb.beta`` every step; on the drop-in that did
    nothing, silently, and the annealed beta could not be read."""
    rb = bsb3.PrioritizedReplayBuffer(16, OBS, ACT, device="cpu", beta=0.4, beta_steps=10)
    assert rb.beta == pytest.approx(0.4)
    for i in range(5):
        add(rb, i)
    assert rb.beta == pytest.approx(0.4 + 0.6 * 5 / 10)
    with pytest.raises(InvalidArgumentError, match="beta_steps"):
        rb.beta = 0.9
    assert rb.beta == pytest.approx(0.7)
    plain = bsb3.PrioritizedReplayBuffer(16, OBS, ACT, device="cpu", beta=0.5)
    assert plain.beta == pytest.approx(0.5)
