"""Hostile tests of the SB3 drop-in's resume rules: ``load_replay_buffer``
with ``truncate_last_traj`` / ``rewind`` on two prioritized algorithms,
``rewinding()`` nested and from two threads, ``learn`` on a closed buffer,
and pickles read from a copy of their run folder.

A case that holds is a plain test; one that shows a bug is ``xfail(strict=True)``.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

th = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")
pytest.importorskip("stable_baselines3")

from bigper.errors import BigperError, BufferClosedError, InvalidTypeError, PathExistsError  # noqa: E402
from bigper.integrations import sb3 as bsb3  # noqa: E402
from bigper.integrations.sb3 import rewinding  # noqa: E402

from tests._hostile_snapshot_cases import fingerprint  # noqa: E402
from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)

PENDING = 2


def dqn(tmp_path, name="replay", **kw):
    rbk = kw.pop("replay_buffer_kwargs", {"storage": "memmap", "path": str(tmp_path / name)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=20,
                                   buffer_size=300, batch_size=16, policy_kwargs={"net_arch": [16]},
                                   replay_buffer_kwargs=rbk, **kw)


def sac(tmp_path, name="replay", **kw):
    rbk = kw.pop("replay_buffer_kwargs", {"storage": "memmap", "path": str(tmp_path / name)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bsb3.PrioritizedSAC("MlpPolicy", "Pendulum-v1", device="cpu", seed=0, learning_starts=20,
                                   buffer_size=300, batch_size=16, policy_kwargs={"net_arch": [16]},
                                   replay_buffer_kwargs=rbk, **kw)


MAKERS = {"dqn": dqn, "sac": sac}


def add(m, t, reward, done=False):
    rb = m.replay_buffer
    shape = m.observation_space.shape
    o = np.full((1, *shape), float(t), np.float32)
    act = np.zeros((1, 1)) if m.action_space.shape == () else np.zeros((1, *m.action_space.shape), np.float32)
    rb.add(o, o + 0.5, act, np.array([reward], np.float32), np.array([done]), [{}])


@pytest.mark.parametrize("algo", sorted(MAKERS))
@pytest.mark.parametrize("truncate", [True, False, np.bool_(True), np.bool_(False)])
def test_load_replay_buffer_truncate_last_traj(tmp_path, algo, truncate):
    m = MAKERS[algo](tmp_path, n_steps=3, gamma=0.5)
    for t in range(5):
        add(m, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "rb")
    m.replay_buffer.close()
    m2 = MAKERS[algo](tmp_path, name="other", n_steps=3, gamma=0.5)
    m2.replay_buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl", truncate_last_traj=truncate)
    core = m2.replay_buffer.buffer
    assert (core.status[:5] == PENDING).any() == (not truncate)
    for t in range(3):
        add(m2, 100 + t, 10.0)
    got = core.gather(np.arange(5))
    want = [1.75, 1.75, 1.75, 1.5, 1.0] if truncate else [1.75, 1.75, 1.75, 4.0, 8.5]
    np.testing.assert_allclose(got["reward"], want)
    m2.learn(30, reset_num_timesteps=False)
    m2.replay_buffer.close()


@pytest.mark.parametrize("algo", sorted(MAKERS))
def test_load_replay_buffer_rewind_only_when_asked(tmp_path, algo):
    m = MAKERS[algo](tmp_path)
    for t in range(10):
        add(m, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "rb")
    for t in range(10, 25):
        add(m, t, 2.0)
    m.replay_buffer.close()
    before = fingerprint(tmp_path)
    m2 = MAKERS[algo](tmp_path, name="fresh")
    m2.replay_buffer.close()
    before = fingerprint(tmp_path)
    for bad in (1, None, "yes"):
        with pytest.raises(InvalidTypeError):
            m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl", rewind=bad)
        with pytest.raises(InvalidTypeError):
            m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl", truncate_last_traj=bad)
    with pytest.raises(PathExistsError, match="rewind=True"):
        m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl")
    assert fingerprint(tmp_path) == before
    with pytest.warns(UserWarning, match="replacing what it held"):
        m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl", rewind=np.bool_(True))
    assert m2.replay_buffer.size() == 10
    m2.learn(30, reset_num_timesteps=False)
    m2.replay_buffer.close()


def pickled_run(tmp_path):
    """A buffer pickled with plain ``pickle`` (its snapshot in ``<live>.snapshots``), then 15 more adds."""
    m = dqn(tmp_path)
    for t in range(10):
        add(m, t, 1.0)
    blob = pickle.dumps(m.replay_buffer)
    for t in range(10, 25):
        add(m, t, 2.0)
    m.replay_buffer.close()
    return blob


def test_rewinding_nested_restores_the_refusal(tmp_path):
    blob = pickled_run(tmp_path)
    before = fingerprint(tmp_path)
    with rewinding():
        with rewinding():
            pass
        with rewinding():  # an inner block that ends by an exception
            with pytest.raises(ZeroDivisionError):
                with rewinding():
                    1 / 0
        assert bsb3.rewinding is rewinding
        from bigper.integrations._sb3_pickle import REWIND
        assert REWIND.get() is True  # still inside the outer block
    from bigper.integrations._sb3_pickle import REWIND
    assert REWIND.get() is False
    with pytest.raises(PathExistsError, match="rewinding"):
        pickle.loads(blob)
    assert fingerprint(tmp_path) == before
    with rewinding(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rb = pickle.loads(blob)
    assert rb.size() == 10
    rb.close()


def test_rewinding_in_one_thread_never_lets_another_rewind(tmp_path):
    blob = pickled_run(tmp_path)
    before = fingerprint(tmp_path)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def holder():
        with rewinding():
            inside.set()
            done.wait(60)

    def other():
        inside.wait(60)
        try:
            pickle.loads(blob)
            seen["err"] = None
        except BigperError as e:
            seen["err"] = e
        finally:
            done.set()

    ts = [threading.Thread(target=holder), threading.Thread(target=other)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert isinstance(seen.get("err"), PathExistsError), seen
    assert fingerprint(tmp_path) == before


@pytest.mark.filterwarnings("ignore::UserWarning")  # (catch_warnings is not thread-safe)
def test_rewinding_in_two_threads_at_once(tmp_path):
    """Both threads ask for a rewind of one live path: one wins, the other is refused (locked or newer), no crash."""
    blob = pickled_run(tmp_path)
    out, go = [], threading.Barrier(2)

    def one():
        go.wait()
        try:
            with rewinding(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(pickle.loads(blob))
        except BigperError as e:
            out.append(e)

    ts = [threading.Thread(target=one) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    bufs = [x for x in out if not isinstance(x, BaseException)]
    assert len(out) == 2 and len(bufs) >= 1, out
    for b in bufs:
        assert b.size() == 10
        b.close()


@pytest.mark.parametrize("algo", sorted(MAKERS))
def test_learn_on_a_model_whose_buffer_was_closed(tmp_path, algo):
    m = MAKERS[algo](tmp_path)
    m.learn(25)
    m.replay_buffer.close()
    before = fingerprint(tmp_path)
    steps = m.num_timesteps
    with pytest.raises(BufferClosedError):
        m.learn(10, reset_num_timesteps=False)
    assert fingerprint(tmp_path) == before
    assert m.num_timesteps <= steps + 1


def test_plain_pickle_in_a_copied_run_never_rewinds_the_original(tmp_path):
    """(Was a strict xfail: beside_the_pickle followed <path>.bigper/ snapshots only, so the
    copy's load rewound the ORIGINAL run's live folder.)"""
    run = tmp_path / "run"
    run.mkdir()
    blob = pickled_run(run)
    (run / "rb.pkl").write_bytes(blob)
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "fork")], check=True)
    before = fingerprint(run)
    m = dqn(tmp_path / "fork", name="other")
    m.replay_buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m.load_replay_buffer(tmp_path / "fork" / "rb.pkl", rewind=True)
            m.replay_buffer.close()
        except BigperError:
            pass
    assert fingerprint(run) == before


def test_a_refused_load_into_the_models_own_live_path_leaves_its_buffer_open(tmp_path):
    m = dqn(tmp_path)
    for t in range(10):
        add(m, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "rb")
    for t in range(10, 25):
        add(m, t, 2.0)
    with pytest.raises(PathExistsError, match="rewind=True"):
        m.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl")
    try:
        assert not m.replay_buffer.closed, "the refused load closed the model's buffer"
        assert m.replay_buffer.size() == 25
        m.learn(30, reset_num_timesteps=False)
    finally:
        m.replay_buffer.close()


def test_rewind_into_the_models_own_live_path(tmp_path):
    m = dqn(tmp_path)
    for t in range(10):
        add(m, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "rb")
    for t in range(10, 25):
        add(m, t, 2.0)
    with pytest.warns(UserWarning, match="replacing what it held"):
        m.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl", rewind=True)
    assert m.replay_buffer.size() == 10
    m.learn(30, reset_num_timesteps=False)
    m.replay_buffer.close()


def test_mode_resume_through_sb3_takes_continue_episodes(tmp_path):
    m = dqn(tmp_path, n_steps=3)
    for t in range(5):
        add(m, t, 1.0)
    m.replay_buffer.close()
    m2 = dqn(tmp_path, n_steps=3, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "replay"),
                                                        "mode": "resume", "continue_episodes": True})
    try:
        assert (m2.replay_buffer.buffer.status[:5] == PENDING).any()  # the episode goes on
    finally:
        m2.replay_buffer.close()


def test_mode_resume_through_sb3_ends_the_open_episode(tmp_path):
    m = dqn(tmp_path, n_steps=3)
    for t in range(5):
        add(m, t, 1.0)
    m.replay_buffer.close()
    m2 = dqn(tmp_path, n_steps=3, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "replay"),
                                                        "mode": "resume"})
    assert not (m2.replay_buffer.buffer.status[:5] == PENDING).any()
    m2.learn(30, reset_num_timesteps=False)
    m2.replay_buffer.close()


@pytest.mark.parametrize("algo", sorted(MAKERS))
def test_fork_of_a_symlinked_run_through_save_replay_buffer(tmp_path, algo):
    """The SB3 path relates the pickle's recorded path to the copy itself (beside_the_pickle): it holds."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    m = MAKERS[algo](tmp_path / "link")
    for t in range(10):
        add(m, t, 1.0)
    m.save_replay_buffer(tmp_path / "link/ckpt/rb")
    for t in range(10, 25):
        add(m, t, 2.0)
    m.replay_buffer.close()
    subprocess.run(["cp", "-a", str(real), str(tmp_path / "fork")], check=True)
    before = fingerprint(real)
    m3 = MAKERS[algo](tmp_path / "fork", name="other")
    m3.replay_buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m3.load_replay_buffer(tmp_path / "fork/ckpt/rb.pkl", rewind=True)
    assert Path(m3.replay_buffer.buffer.storage.path) == tmp_path / "fork/replay"
    m3.replay_buffer.close()
    assert fingerprint(real) == before


@pytest.mark.parametrize("where", ["rb.pkl", "ckpt/rb.pkl", "a/b/rb.pkl"])
def test_plain_pickle_in_a_copied_run_loads_the_copy(tmp_path, where):
    """The pickle anywhere inside the copied run folder: the copy's snapshot (the nearest
    folder of its name above the pickle) goes into the copy's live folder; the original
    run is never read for it, never changed."""
    run = tmp_path / "run"
    run.mkdir()
    blob = pickled_run(run)
    (run / where).parent.mkdir(parents=True, exist_ok=True)
    (run / where).write_bytes(blob)
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "fork")], check=True)
    shutil.rmtree(tmp_path / "fork" / "replay")  # (the copy's live folder gone: nothing newer there)
    before = fingerprint(run)
    m = dqn(tmp_path / "other")
    m.replay_buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.load_replay_buffer(tmp_path / "fork" / where)
    try:
        assert m.replay_buffer.size() == 10
        assert str(m.replay_buffer.buffer.storage.path).startswith(str(tmp_path / "fork"))
    finally:
        m.replay_buffer.close()
    assert fingerprint(run) == before


def test_plain_pickle_beside_a_tampered_copy_is_refused_never_loads_the_original(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rb.pkl").write_bytes(pickled_run(run))
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "fork")], check=True)
    snap = next((tmp_path / "fork" / "replay.snapshots").glob("snap-*"))
    manifest = snap / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b"{", b"{ ", 1))
    before, fork_before = fingerprint(run), fingerprint(tmp_path / "fork")
    m = dqn(tmp_path / "other")
    m.replay_buffer.close()
    with pytest.raises(BigperError, match=r"fork/replay\.snapshots/snap-"):
        m.load_replay_buffer(tmp_path / "fork" / "rb.pkl", rewind=True)
    assert fingerprint(run) == before and fingerprint(tmp_path / "fork") == fork_before
