"""Attack on ``train/td_abs`` of the Prioritized SB3 algorithms
(``_sb3_per.PrioritizedAlgorithm._per_write_back`` keeps each gradient
step's mean ``|TD|`` as a tensor, ``_per_log`` reads them once a log).

The logged value is held to the mean of the per-step means computed here,
independently, in float64, for td of float16/bfloat16/float32/float64,
shapes (B,), (B, 1) and quantiles (B, N), ``learn`` with
``gradient_steps`` 1, 3 and -1; and the kept tensors never reach a saved model.
"""

from __future__ import annotations

import numpy as np
import pytest

th = pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from bigper.integrations import sb3 as bsb3  # noqa: E402

from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)


def _build(name="PrioritizedDQN", **kw):
    cls = getattr(bsb3, name)
    env = "CartPole-v1" if name in ("PrioritizedDQN", "PrioritizedQRDQN") else "Pendulum-v1"
    kw.setdefault("learning_starts", 50)
    kw.setdefault("buffer_size", 2_000)
    kw.setdefault("batch_size", 32)
    kw.setdefault("policy_kwargs", {"net_arch": [16]})
    return cls("MlpPolicy", env, device="cpu", seed=0, **kw)


def _capture(model):
    """Every ``train/td_abs`` recorded, and each step's td (float64 copies) written back since the last record."""
    from stable_baselines3.common.logger import configure

    model.set_logger(configure(None, []))  # (kept by learn: a logger of the user's)
    logged, steps, pending = [], [], []
    record = model.logger.record

    def recording(key, value, *a, **k):
        if key == "train/td_abs":
            logged.append(value)
            steps.append(list(pending))
            pending.clear()
        return record(key, value, *a, **k)

    model.logger.record = recording
    write_back = model._per_write_back

    def spying(data, td):
        pending.append(float(td.detach().to("cpu", th.float64).mean()))
        return write_back(data, td)

    model._per_write_back = spying
    return logged, steps


def _after_setup(model):
    """The model set up (its logger and buffer) with a few transitions."""
    model.learn(60)


@pytest.mark.parametrize("dtype", [th.float16, th.bfloat16, th.float32, th.float64])
@pytest.mark.parametrize("shape", [(32,), (32, 1)])
def test_logged_td_abs_is_the_mean_of_the_steps_means(dtype, shape):
    model = _build()
    _after_setup(model)
    logged, _ = _capture(model)
    rng = np.random.default_rng(1)
    means = []
    for step in range(5):
        data = model.replay_buffer.sample(32, env=model._vec_normalize_env)
        td = th.tensor(rng.random(shape) * (3 + step), dtype=th.float64).to(dtype)
        means.append(float(td.to(th.float64).mean()))  # (each step's mean of what it was given)
        model._per_write_back(data, td)
    model._per_log()
    assert len(logged) == 1 and isinstance(logged[0], float)
    # (the kept mean is in td's dtype: float16/bfloat16 means rounded to it, then averaged exactly)
    kept = [float(th.tensor(m, dtype=th.float64).to(dtype).to(th.float64)) if dtype in (th.float16, th.bfloat16)
            else m for m in means]
    tol = {th.float16: 2e-3, th.bfloat16: 1e-2, th.float32: 1e-6, th.float64: 1e-12}[dtype]
    assert logged[0] == pytest.approx(np.mean(kept), rel=tol), (logged[0], np.mean(kept))
    assert model._per_td == []


def test_float64_td_keeps_its_precision():
    """A float64 learner's td: the log is its float64 mean (a float32 mean
    loses it: the value SB3 logged before the tensors were kept, np.mean of floats)."""
    model = _build()
    _after_setup(model)
    logged, _ = _capture(model)
    base = 1.0 + 1e-9
    data = model.replay_buffer.sample(32, env=model._vec_normalize_env)
    for i in range(3):
        model._per_write_back(data, th.full((32,), base + i * 1e-10, dtype=th.float64))
    model._per_log()
    assert logged[0] == pytest.approx(np.mean([base + i * 1e-10 for i in range(3)]), rel=1e-14, abs=0)


def _have(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


@pytest.mark.parametrize("name,gradient_steps", [("PrioritizedDQN", 1), ("PrioritizedDQN", 3),
                                                  ("PrioritizedDQN", -1), ("PrioritizedSAC", 2),
                                                  ("PrioritizedTD3", -1),
                                                  pytest.param("PrioritizedQRDQN", 2, marks=pytest.mark.skipif(
                                                      not _have("sb3_contrib"), reason="sb3-contrib")),
                                                  pytest.param("PrioritizedTQC", -1, marks=pytest.mark.skipif(
                                                      not _have("sb3_contrib"), reason="sb3-contrib"))])
def test_learn_logs_the_mean_of_the_steps_means(name, gradient_steps):
    model = _build(name, gradient_steps=gradient_steps, train_freq=4)
    _after_setup(model)
    logged, steps = _capture(model)
    model.learn(80, reset_num_timesteps=False)
    assert logged, "no train/td_abs recorded"
    for value, per_step in zip(logged, steps):
        assert per_step, "a record without a step"
        if gradient_steps > 0:
            n = gradient_steps * (2 if name == "PrioritizedTD3" else 1)
            assert len(per_step) in (gradient_steps, n), per_step
        assert value == pytest.approx(float(np.mean(per_step)), rel=1e-6)
    assert model._per_td == []


def test_a_save_while_steps_are_kept_loads_and_keeps_no_tensors(tmp_path):
    """``model.save`` with step means kept (a save from inside ``train``, or a
    subclass that logs less often): the saved model loads, and its kept list
    is empty (never a pickled tensor, which may be a CUDA one)."""
    import zipfile

    model = _build()
    _after_setup(model)
    data = model.replay_buffer.sample(32, env=model._vec_normalize_env)
    model._per_write_back(data, th.rand(32) + 0.5)
    model._per_write_back(data, th.rand(32) + 0.5)
    assert len(model._per_td) == 2
    model.save(tmp_path / "m.zip")
    with zipfile.ZipFile(tmp_path / "m.zip") as z:
        blob = z.read("data").decode()
    assert "_per_td" not in blob, "the kept step means were saved"
    back = bsb3.PrioritizedDQN.load(tmp_path / "m.zip", env=model.get_env(), device="cpu")
    assert getattr(back, "_per_td", []) == []
    back.learn(60, reset_num_timesteps=False)  # (trains and logs)
    assert back._per_td == []
