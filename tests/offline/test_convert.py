"""bigper convert: a zstd-compressed bigper HDF5 dataset from an uncompressed one.

Every test compares what the converted file gives back with what the source
gives back (both opened with ``from_hdf5``), transition by transition in
stream order, byte for byte, on real ALE frames (tests/data/atari_frames.npz).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

import bigper
from bigper.convert import convert
from bigper.errors import InvalidArgumentError, PathExistsError

from tests._child import Child
from tests._hostile_snapshot_cases import fingerprint

ATARI = Path(__file__).parents[1] / "data" / "atari_frames.npz"
ROOT = Path(__file__).parents[2]
K = 4


def stream(game: str, n: int, seed: int = 0):
    """``n`` steps of 4-frame stacks over real frames, in episodes that end by
    termination, by timeout, or (once) by a reset without an end flag."""
    frames = np.load(ATARI)[game]
    rng = np.random.default_rng(seed)
    obs, nxt, term, trunc = [], [], [], []
    pos, t, length = 0, 0, int(rng.integers(5, 40))
    stack = lambda s: frames[[(pos + max(0, s - K + 1 + j)) % frames.shape[0] for j in range(K)]]  # noqa: E731
    for i in range(n):
        obs.append(stack(t))
        nxt.append(stack(t + 1))
        end = t + 1 == length
        kind = int(rng.integers(3)) if end else -1
        term.append(kind == 0)
        trunc.append(kind == 1)  # kind 2: a reset the flags do not show
        if end:
            pos, t, length = pos + t + 3, 0, int(rng.integers(5, 40))
        else:
            t += 1
    return (np.stack(obs), np.stack(nxt), np.array(term), np.array(trunc),
            rng.integers(0, 6, n), rng.standard_normal(n).astype(np.float32))


def write_d4rl(path: Path, game="Breakout", n=300, next_observations=True, obs=None):
    o, o2, term, trunc, act, rew = stream(game, n)
    with h5py.File(path, "w") as f:
        f["observations"] = o if obs is None else obs
        if next_observations:
            f["next_observations"] = o2
        f["actions"], f["rewards"] = act, rew
        f["terminals"], f["timeouts"] = term, trunc
    return o, o2, term, trunc, act, rew


def everything(path, **kw):
    """Every sampleable transition of a dataset, in stream order, and their keys."""
    with bigper.PrioritizedReplayBuffer.from_hdf5(path, **kw) as b:
        live = np.flatnonzero(b.status == 1)
        live = live[np.argsort(b.generations[live], kind="stable")]
        data = b.gather(live)
        return data, b.leaves(live)


def assert_same_transitions(src, dst):
    a, _ = everything(src)
    b, _ = everything(dst)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        assert a[name].tobytes() == b[name].tobytes(), name
    return a


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bigper", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout)


@pytest.mark.parametrize("game", ["Breakout", "MsPacman"])
def test_d4rl_of_real_frames_converts_byte_for_byte_and_is_smaller(game, tmp_path):
    (tmp_path / "src").mkdir()
    src, dst = tmp_path / "src" / "d.h5", tmp_path / "d-zstd.h5"
    o, o2, term, trunc, act, rew = write_d4rl(src, game)
    before = fingerprint(tmp_path / "src")
    r = convert(src, dst, progress=False)
    assert fingerprint(tmp_path / "src") == before  # the source is never written
    assert r["transitions"] == 300 and r["frame_stack"] == K and r["skipped"] == 0
    data = assert_same_transitions(src, dst)
    # and against what was written into the source, not only what from_hdf5 reads of it
    assert data["obs"].tobytes() == o.tobytes() and data["next_obs"].tobytes() == o2.tobytes()
    assert (data["terminated"] == term).all() and (data["truncated"] == trunc).all()
    assert (data["action"] == act).all() and data["reward"].tobytes() == rew.tobytes()
    assert os.path.getsize(dst) * 4 < os.path.getsize(src)
    assert not os.path.lexists(f"{dst}.partial") and not os.path.lexists(f"{dst}.partial.lock")


def test_d4rl_timeouts_without_next_observations_are_left_out_and_said(tmp_path):
    src, dst = tmp_path / "d.h5", tmp_path / "z.h5"
    _, _, term, trunc, *_ = write_d4rl(src, next_observations=False)
    r = convert(src, dst, progress=False)
    # a timeout, and the last row unless terminal, have no next observation in the file
    dead = int(trunc.sum()) + int(not term[-1] and not trunc[-1])
    assert r["skipped"] == dead > 0
    assert r["transitions"] == 300 - dead
    assert_same_transitions(src, dst)


def test_uncompressed_bigper_storage_with_a_wrapped_ring_and_priorities(tmp_path):
    (tmp_path / "src").mkdir()
    src, dst = tmp_path / "src" / "buf.h5", tmp_path / "z.h5"
    o, o2, term, trunc, act, rew = stream("Seaquest", 260)
    buf = bigper.PrioritizedReplayBuffer(
        capacity=200, fields={"obs": ((K, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, storage="hdf5", path=src, alpha=0.7)
    for i in range(260):
        buf.add(obs=o[i], next_obs=o2[i], action=act[i], reward=rew[i], terminated=term[i], truncated=trunc[i])
    buf.close()
    with bigper.PrioritizedReplayBuffer.from_hdf5(src) as ds:  # priorities of its sidecar
        live = np.flatnonzero(ds.status == 1)
        ds.update_priorities(live, np.random.default_rng(1).random(live.shape[0]) * 5)
    before = fingerprint(tmp_path / "src")
    r = convert(src, dst, progress=False)
    assert fingerprint(tmp_path / "src") == before
    assert r["transitions"] == live.shape[0]
    assert_same_transitions(src, dst)
    _, ka = everything(src)
    _, kb = everything(dst)
    assert ka.tobytes() == kb.tobytes() and not (ka == 1.0).all()  # carried over exactly


class StackEnv:
    """A Gymnasium env of real frames as 4-frame stacks (for minari.DataCollector)."""

    def __new__(cls):
        import gymnasium as gym

        class Env(gym.Env):
            observation_space = gym.spaces.Box(0, 255, (K, 84, 84), np.uint8)
            action_space = gym.spaces.Discrete(6)

            def __init__(self):
                self.frames = np.load(ATARI)["Pong"]
                self.pos = 0

            def reset(self, seed=None, options=None):
                super().reset(seed=seed)
                self.pos += 7
                self.t = 0
                return self._obs(), {}

            def _obs(self):
                return self.frames[[(self.pos + max(0, self.t - K + 1 + j)) % 300 for j in range(K)]]

            def step(self, action):
                self.t += 1
                end = self.t >= 10 + self.np_random.integers(20)
                return self._obs(), float(action), bool(end and self.t % 2), bool(end and not self.t % 2), {}

        return Env()


def test_minari_dataset_of_frame_stacks_made_by_minari(tmp_path, monkeypatch):
    pytest.importorskip("minari")
    from tests.offline.test_offline_minari import collect

    ds, src = collect(tmp_path / "minari", monkeypatch, "test/stacks-v0", StackEnv, 6)
    before = fingerprint(src)
    convert(src, tmp_path / "z.h5", progress=False)
    assert fingerprint(src) == before
    data = assert_same_transitions(src, tmp_path / "z.h5")
    # against minari's own reading of its episodes
    want = np.concatenate([e.observations[:-1] for e in ds.iterate_episodes()])
    assert data["obs"].tobytes() == want.tobytes()


def test_an_existing_dst_is_refused_unless_overwrite_and_src_is_never_dst(tmp_path):
    (tmp_path / "src").mkdir()
    src, dst = tmp_path / "src" / "d.h5", tmp_path / "z.h5"
    write_d4rl(src, n=60)
    dst.write_bytes(b"mine")
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="z.h5"):
        convert(src, dst, progress=False)
    with pytest.raises(InvalidArgumentError, match="source"):
        convert(src, src, overwrite=True, progress=False)
    assert fingerprint(tmp_path) == before
    convert(src, dst, overwrite=True, progress=False)
    assert_same_transitions(src, dst)


@pytest.mark.parametrize("shape", [(84, 84), (84, 84, 3), (2,)])
def test_obs_that_are_not_frame_stacks_are_refused_naming_field_and_shape(shape, tmp_path):
    (tmp_path / "src").mkdir()
    src = tmp_path / "src" / "d.h5"
    write_d4rl(src, n=20, next_observations=False, obs=np.zeros((20, *shape), np.uint8))
    before = fingerprint(tmp_path)
    with pytest.raises(InvalidArgumentError, match=rf"'obs'.*{str(shape)[1:-1]}"):
        convert(src, tmp_path / "z.h5", progress=False)
    assert fingerprint(tmp_path) == before


# The convert of a subprocess, stopped at a point the test names: it says "at <point>" on
# stdout and sleeps there, and is killed with SIGKILL. The code it runs is the real one.
KILLED = """
import sys, time
import bigper.convert as c
point = sys.argv[3]
def stop():
    print("at", point, flush=True)
    time.sleep(3600)  # until killed: a busy machine may take minutes to get there
if point == "chunk":
    extend, calls = c.PrioritizedReplayBuffer.extend, []
    def slow(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            stop()
        return extend(self, *a, **k)
    c.PrioritizedReplayBuffer.extend = slow
else:  # the partial file complete and closed, not yet renamed
    publish = c.publish
    c.publish = lambda *a: (stop(), publish(*a))
c.convert(sys.argv[1], sys.argv[2], progress=False, chunk=64)
"""


@pytest.mark.parametrize("point", ["chunk", "publish"])
def test_kill_9_midway_leaves_no_dst_and_the_next_run_completes(point, tmp_path):
    (tmp_path / "src").mkdir()
    src, dst = tmp_path / "src" / "d.h5", tmp_path / "z.h5"
    write_d4rl(src, n=400)
    before = fingerprint(tmp_path / "src")
    with Child(KILLED, src, dst, point) as child:
        child.said(f"at {point}")
        assert os.path.exists(f"{dst}.partial")
        child.kill()
    assert not os.path.lexists(dst)
    assert fingerprint(tmp_path / "src") == before
    r = cli("convert", src, dst, "--no-progress")  # replaces the killed run's partial file
    assert r.returncode == 0, r.stderr
    assert_same_transitions(src, dst)
    assert not os.path.lexists(f"{dst}.partial") and not os.path.lexists(f"{dst}.partial.lock")


def test_converted_file_reprioritizes_samples_and_info_shows_compression(tmp_path):
    src, dst = tmp_path / "d.h5", tmp_path / "z.h5"
    write_d4rl(src, n=120)
    r = cli("convert", src, dst, "--no-progress", "--budget", "900")
    assert r.returncode == 0 and "120 transitions" in r.stdout, r.stderr
    want, _ = everything(src)
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        ds.reprioritize(lambda b: b.indices.astype(np.float64) % 7, batch_size=32, progress=False)
        b = ds.sample(64)
        assert (b.indices % 7 != 0).all()  # score 0: never drawn (eps aside, as keys say)
        np.testing.assert_array_equal(b["obs"], want["obs"][b.indices])
        np.testing.assert_array_equal(b["next_obs"], want["next_obs"][b.indices])
    info = cli("info", dst)
    assert info.returncode == 0 and "zstd" in info.stdout, info.stdout + info.stderr
    again = cli("convert", src, dst, "--no-progress")
    assert again.returncode == 2 and "z.h5" in again.stderr and "exists" in again.stderr


def test_a_budget_too_small_is_refused_with_one_that_fits_and_leaves_nothing(tmp_path):
    (tmp_path / "src").mkdir()
    src, dst = tmp_path / "src" / "d.h5", tmp_path / "z.h5"
    write_d4rl(src, "MsPacman", n=200)
    before = fingerprint(tmp_path)
    # (200: a budget the config takes, its log keeps one stack of frames that do not compress,
    # but not 200 MsPacman frames of about 1,150 bytes)
    with pytest.raises(InvalidArgumentError, match=r"compression_budget=200 .*budget=(\d+)") as e:
        convert(src, dst, budget=200, progress=False)
    assert fingerprint(tmp_path) == before  # no dst, no partial file, no lock file
    fits = int(__import__("re").search(r"budget=(\d+) \(--budget\)", str(e.value)).group(1))
    convert(src, dst, budget=fits, progress=False)
    assert_same_transitions(src, dst)


def test_a_second_convert_to_the_same_dst_meanwhile_is_storage_locked(tmp_path):
    src, dst = tmp_path / "d.h5", tmp_path / "z.h5"
    write_d4rl(src, n=400)
    with Child(KILLED, src, dst, "chunk") as child:
        child.said("at chunk")
        held = fingerprint(f"{dst}.partial")
        with pytest.raises(bigper.StorageLockedError, match=r"z\.h5 is in use by process"):
            convert(src, dst, progress=False)
        assert fingerprint(f"{dst}.partial") == held and not os.path.lexists(dst)
        child.kill()
