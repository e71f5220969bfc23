"""The SB3 drop-in's pickles keep their word (issue 23, sections 5, 6 and 10).

Each case was written against the code before the fix and failed there:
a series of pickles whose first one no longer loads, an unpickle that rewinds
a live path that moved on without a word, a failed ``save_replay_buffer`` that
truncates the previous good pickle, ``discounts`` that are not SB3's, a
manifest read with a plain ``open()`` (a FIFO hangs), ``size()`` after
exactly ``buffer_size`` adds, and the import circle between the modules.
"""

from __future__ import annotations

import ast
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

th = pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import NStepReplayBuffer  # noqa: E402

from bigper.errors import (  # noqa: E402
    BufferClosedError,
    PathExistsError,
    PathNotFoundError,
    StorageLockedError,
)
from bigper.integrations.sb3 import PrioritizedReplayBuffer, rewinding  # noqa: E402

from tests._hostile_snapshot_cases import fingerprint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OBS = spaces.Box(-10, 10, (3,), np.float32)
ACT = spaces.Discrete(2)


def make(tmp_path: Path, cap: int = 64, **kw) -> PrioritizedReplayBuffer:
    kw.setdefault("storage", "memmap")
    kw.setdefault("path", str(tmp_path / "live"))
    return PrioritizedReplayBuffer(cap, OBS, ACT, device="cpu", seed=1, **kw)


def feed(rb, start: int, stop: int, done_every: int = 0) -> None:
    for t in range(start, stop):
        o = np.full((rb.n_envs, 3), t, np.float32)
        done = np.array([done_every > 0 and t % done_every == done_every - 1] * rb.n_envs)
        rb.add(o, o + 1, np.zeros(rb.n_envs, np.int64), np.full(rb.n_envs, float(t)), done,
               [{}] * rb.n_envs)


def rewards_held(rb) -> set:
    """The rewards (= the step that added them) of every transition the buffer holds."""
    s = rb.sample(512)
    return {int(r) for r in s.rewards.reshape(-1).tolist()}


def quiet_load(blob: bytes):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the live path is where the pickle left it
        return pickle.loads(blob)


# -- 6. every pickle keeps its snapshot -------------------------------------------------
@pytest.mark.parametrize("where", ["live", "snapshot_dir"])
def test_every_pickle_of_a_series_still_loads(tmp_path, where):
    kw = {"snapshot_dir": tmp_path / "snaps"} if where == "snapshot_dir" else {}
    rb = make(tmp_path, **kw)
    blobs = []
    for k in range(4):
        feed(rb, 10 * k, 10 * k + 10)
        blobs.append(pickle.dumps(rb))
    rb.close()
    for k, blob in enumerate(blobs):
        if k == 0:  # the live path holds 40, newer than this pickle: kept unless a rewind is asked for
            with pytest.raises(PathExistsError, match="rewinding"):
                pickle.loads(blob)
        with warnings.catch_warnings(), rewinding():
            warnings.simplefilter("ignore")  # each load after the first rewinds the live path: said, tested below
            back = pickle.loads(blob)
        assert back.size() == 10 * k + 10
        assert rewards_held(back) == set(range(10 * k + 10))
        back.close()


def test_save_replay_buffer_keeps_the_snapshot_of_the_pickle_at_that_path(tmp_path):
    from bigper.integrations.sb3 import PrioritizedDQN

    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=100, learning_starts=10, device="cpu",
                           seed=0, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "live")})
    rb = model.replay_buffer
    obs_space = rb.observation_space
    for t in range(30):
        o = np.full((1, *obs_space.shape), t, np.float32)
        rb.add(o, o, np.array([0]), np.array([float(t)]), np.array([False]), [{}])
        if t in (9, 19, 29):
            if t == 9:
                model.save_replay_buffer(tmp_path / "first")  # a pickle of its own: never superseded
            model.save_replay_buffer(tmp_path / "rb")
            if t == 9:
                shutil.copy(tmp_path / "rb.pkl", tmp_path / "copy-of-the-first.pkl")
    rb.close()
    model.replay_buffer = None
    model.load_replay_buffer(tmp_path / "rb.pkl")
    assert model.replay_buffer.size() == 30
    model.replay_buffer.close()
    with pytest.raises(PathExistsError, match="rewind=True"):  # the live path holds 30, newer
        model.load_replay_buffer(tmp_path / "first.pkl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_replay_buffer(tmp_path / "first.pkl", rewind=True)
    assert model.replay_buffer.size() == 10
    model.replay_buffer.close()
    # a copy of a pickle that rb.pkl has since replaced names a snapshot retention removed
    before = fingerprint(tmp_path)
    with pytest.raises(PathNotFoundError, match="superseded") as info:
        model.load_replay_buffer(tmp_path / "copy-of-the-first.pkl")
    assert "rb.bigper" in str(info.value) and "snap-00000001" in str(info.value)
    assert fingerprint(tmp_path) == before


# -- 6. unpickling never rewinds a live path silently ------------------------------------
@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_unpickling_a_live_path_that_moved_on_says_what_it_discards(tmp_path, storage):
    live = tmp_path / ("live.h5" if storage == "hdf5" else "live")
    rb = make(tmp_path, storage=storage, path=str(live))
    feed(rb, 0, 10)
    blob = pickle.dumps(rb)
    feed(rb, 10, 40)
    rb.close()
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="40 transitions"):  # newer data: kept unless asked
        pickle.loads(blob)
    assert fingerprint(tmp_path) == before
    with pytest.warns(UserWarning, match="40 transitions") as rec, rewinding():
        back = pickle.loads(blob)
    # (the record may also hold a ResourceWarning collected meanwhile: take bigper's)
    msg = next(str(w.message) for w in rec if issubclass(w.category, UserWarning) and "40 transitions" in str(w.message))
    assert str(live) in msg and "10" in msg and "30" in msg
    assert back.size() == 10
    back.close()


def test_unpickling_where_the_pickle_left_the_live_path_is_quiet(tmp_path):
    rb = make(tmp_path)
    feed(rb, 0, 10)
    blob = pickle.dumps(rb)
    rb.close()
    back = quiet_load(blob)
    assert back.size() == 10 and rewards_held(back) == set(range(10))
    back.close()


def test_unpickling_over_a_dead_writers_path_says_so(tmp_path):
    # A writer that died (kill -9) leaves its path unclean: how far it went is unknown.
    code = f"""
import os, pickle, numpy as np
from gymnasium import spaces
from bigper.integrations.sb3 import PrioritizedReplayBuffer
rb = PrioritizedReplayBuffer(64, spaces.Box(-10, 10, (3,), np.float32), spaces.Discrete(2), device="cpu",
                             storage="memmap", path={str(tmp_path / "live")!r})
for t in range(25):
    o = np.full((1, 3), t, np.float32)
    rb.add(o, o + 1, np.zeros(1, np.int64), np.full(1, float(t)), np.array([False]), [{{}}])
    if t == 9:
        open({str(tmp_path / "rb.pkl")!r}, "wb").write(pickle.dumps(rb))
os.kill(os.getpid(), 9)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    with pytest.warns(UserWarning, match="did not close"):
        back = pickle.loads((tmp_path / "rb.pkl").read_bytes())
    assert back.size() == 10 and rewards_held(back) == set(range(10))
    back.close()


def test_unpickling_over_a_live_writer_is_refused_and_changes_nothing(tmp_path):
    rb = make(tmp_path)
    feed(rb, 0, 10)
    blob = pickle.dumps(rb)
    feed(rb, 10, 20)
    rb.buffer.storage.flush()
    before = fingerprint(tmp_path)
    with pytest.raises(StorageLockedError):
        pickle.loads(blob)
    assert fingerprint(tmp_path) == before
    assert rb.size() == 20
    rb.close()


# -- 6. a failed save never truncates the previous pickle ------------------------------
def test_save_replay_buffer_after_close_keeps_the_previous_pickle(tmp_path):
    from bigper.integrations.sb3 import PrioritizedDQN

    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=100, learning_starts=10, device="cpu",
                           seed=0, replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "live")})
    rb = model.replay_buffer
    o = np.zeros((1, 4), np.float32)
    for t in range(12):
        rb.add(o + t, o + t + 1, np.array([0]), np.array([float(t)]), np.array([False]), [{}])
    model.save_replay_buffer(tmp_path / "rb")
    rb.close()
    before = fingerprint(tmp_path)
    with pytest.raises(BufferClosedError):
        model.save_replay_buffer(tmp_path / "rb")
    with pytest.raises(BufferClosedError):
        pickle.dumps(rb)
    assert fingerprint(tmp_path) == before  # no truncated pickle, no snapshot directory made
    model.replay_buffer = None
    model.load_replay_buffer(tmp_path / "rb.pkl")
    assert model.replay_buffer.size() == 12
    model.replay_buffer.close()


def test_save_replay_buffer_writes_the_pickle_atomically(tmp_path):
    """The pickle is renamed into place: a reader never sees a half-written file,
    and a file object (SB3 accepts one) still works."""
    from bigper.integrations.sb3 import PrioritizedDQN

    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=100, learning_starts=10, device="cpu",
                           seed=0, replay_buffer_kwargs={"snapshot_dir": str(tmp_path / "snaps")})
    rb = model.replay_buffer
    o = np.zeros((1, 4), np.float32)
    rb.add(o, o + 1, np.array([0]), np.array([1.0]), np.array([False]), [{}])
    (tmp_path / "rb.pkl").write_bytes(b"previous")
    ino = os.stat(tmp_path / "rb.pkl").st_ino
    model.save_replay_buffer(tmp_path / "rb.pkl")
    assert os.stat(tmp_path / "rb.pkl").st_ino != ino  # a new file renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rb.pkl", "snaps"]  # no temp file left
    with open(tmp_path / "other.pkl", "wb") as f:
        model.save_replay_buffer(f)
    for name in ("rb.pkl", "other.pkl"):
        rb.close()
        model.load_replay_buffer(tmp_path / name)
        assert model.replay_buffer.size() == 1
        rb = model.replay_buffer
    rb.close()


# -- 5. the manifest is read through the safe opener -------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "symlink_to_a_copy"])
def test_a_crafted_manifest_is_refused_without_hanging(tmp_path, kind):
    rb = make(tmp_path, storage="memory", path=None, snapshot_dir=tmp_path / "snaps")
    feed(rb, 0, 5)
    pkl = tmp_path / "rb.pkl"
    pkl.write_bytes(pickle.dumps(rb))
    rb.close()
    manifest = next((tmp_path / "snaps").glob("snap-*")) / "manifest.json"
    if kind == "fifo":
        manifest.unlink()
        os.mkfifo(manifest)
    elif kind == "dev_zero":
        manifest.unlink()
        os.symlink("/dev/zero", manifest)
    else:  # the real bytes beside, linked to: a link is not followed even to good bytes
        shutil.move(manifest, tmp_path / "manifest-copy.json")
        os.symlink(tmp_path / "manifest-copy.json", manifest)
    before = fingerprint(tmp_path)
    # In a child with bounded memory and time: a regression hangs or eats memory there, not here.
    code = f"""
import pickle, resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from bigper.errors import CorruptSnapshotError
try:
    pickle.loads(open({str(pkl)!r}, "rb").read())
except CorruptSnapshotError as e:
    print("refused:", e)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the pickle blocked on its manifest")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("refused:") and "manifest.json" in out.stdout, out.stdout
    assert fingerprint(tmp_path) == before


# -- 6. discounts are SB3's --------------------------------------------------------------
@pytest.mark.parametrize("n_envs", [1, 3])
def test_discounts_are_what_sb3s_nstep_buffer_gives_also_where_done(n_envs):
    gamma, n = 0.9, 4
    ours = PrioritizedReplayBuffer(200, OBS, ACT, device="cpu", n_envs=n_envs, n_steps=n, gamma=gamma, seed=0,
                                   handle_timeout_termination=True)
    refs = [NStepReplayBuffer(200, OBS, ACT, device="cpu", n_steps=n, gamma=gamma) for _ in range(n_envs)]
    rng = np.random.default_rng(0)
    for t in range(80):
        o = rng.normal(size=(n_envs, 3)).astype(np.float32)
        done = rng.random(n_envs) < 0.2
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.3)} for d in done]
        ours.add(o, o + 1, np.zeros(n_envs, np.int64), np.full(n_envs, 1.0), done, infos)
        for e in range(n_envs):
            refs[e].add(o[e:e + 1], o[e:e + 1] + 1, np.zeros(1), np.ones(1), done[e:e + 1], infos[e:e + 1])
    s = ours.sample(400)
    gens = ours._last_draw()[1]
    disc = s.discounts.numpy()
    dones = s.dones.numpy()
    assert dones.any() and (disc[dones == 1] > 0).all()
    for b in range(400):
        t, e = divmod(int(gens[b]), n_envs)
        refs[e].pos = 80  # SB3 marks its own last step as a cut; ours holds all 80
        want = refs[e]._get_samples(np.array([t]))
        assert dones[b, 0] == want.dones[0, 0].item()
        np.testing.assert_allclose(disc[b, 0], want.discounts[0, 0].item(), rtol=1e-6)


# -- 10. size() at exactly buffer_size adds ------------------------------------------------
@pytest.mark.parametrize("n_envs", [1, 2])
def test_size_counts_exactly_buffer_size_adds_as_full(n_envs):
    rb = PrioritizedReplayBuffer(8 * n_envs, OBS, ACT, device="cpu", n_envs=n_envs)
    sizes = []
    for t in range(10):
        feed(rb, t, t + 1)
        sizes.append((rb.size(), rb.pos, rb.full))
    assert sizes[6] == (7, 7, False)
    assert sizes[7] == (8, 0, True)  # exactly buffer_size adds: full, the cursor back at 0
    assert sizes[8] == (8, 1, True)


# -- 9. no import circle inside bigper.integrations -----------------------------------------
def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports anywhere (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = f"{package}.{node.module}" if node.module else package
                out.add(base)
                out.update(f"{package}.{a.name}" for a in node.names)
            elif node.level == 0 and node.module and node.module.startswith(package):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(package))
    return out


def test_integrations_modules_import_in_one_direction():
    pkg = "bigper.integrations"
    files = {f"{pkg}.{p.stem}": p for p in (ROOT / "bigper" / "integrations").glob("*.py") if p.stem != "__init__"}
    graph = {m: _imports(p, pkg) & set(files) - {m} for m, p in files.items()}
    assert graph[f"{pkg}.sb3"], "the graph should see sb3's imports"

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = [m for m in graph if m in reach(m)]
    assert not circles, {m: sorted(graph[m]) for m in circles}
