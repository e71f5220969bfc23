"""compression="zstd": frames compressed in a ring of segments (bigper/frames/segments.py).

Every test compares what sampling returns with what was added, byte for byte
(each transition carries its own number in ``step``), and checks the segment
ring against a plain reference: a transition is sampleable only while all
its frames are in live segments.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from bigper.errors import CorruptSnapshotError, IncompatibleSnapshotError, InvalidArgumentError

from tests._hostile_snapshot_cases import fingerprint
from tests import hook

ATARI = Path(__file__).parents[1] / "data" / "atari_frames.npz"
STORAGES = ("memory", "memmap", "hdf5")


def _path(kind, tmp, name="buf"):
    return None if kind == "memory" else (tmp / f"{name}.h5" if kind == "hdf5" else tmp / name)


def make(kind, tmp, shape=(8, 8), dtype=np.uint8, k=3, capacity=40, budget=None, name="buf", wide=False, **kw):
    """A compressed buffer; ``wide``: its frame index in the wide layout an
    older bigper wrote (two int64 an entry), through ``from_parts``."""
    args = dict(capacity=capacity, fields={"obs": ((k, *shape), dtype), "step": ((), np.int64)},
                frame_stack=k, compression="zstd", compression_budget=budget, **kw)
    if not wide:
        return bigper.PrioritizedReplayBuffer(storage=kind, path=_path(kind, tmp, name), **args)
    from bigper.config import Config
    from bigper.core.layout import storage_growth
    from bigper.storage import open_storage

    cfg = Config.build(storage=kind, **args)
    specs = bigper.PrioritizedReplayBuffer.storage_specs(cfg)
    specs["frame_index"] = (specs["frame_index"][0], (2,), np.dtype(np.int64))
    store = open_storage(kind, _path(kind, tmp, name))
    store.open(cfg.to_dict())
    store.allocate(specs, storage_growth(cfg) or None)
    return bigper.PrioritizedReplayBuffer.from_parts(cfg, store)


class Feed:
    """Episodes of frames drawn from ``source(rng, n)``; remembers every transition's stacks."""

    def __init__(self, frames: np.ndarray, k: int, seed=0, num_envs=1):
        self.frames, self.k, self.rng = frames, k, np.random.default_rng(seed)
        self.added: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.g, self.num_envs = 0, num_envs
        self.pos = [0] * num_envs
        self.t = [0] * num_envs

    def _stack(self, e, t):
        start = self.pos[e]
        idx = [start + max(0, t - self.k + 1 + j) for j in range(self.k)]
        return self.frames[np.array(idx) % self.frames.shape[0]]

    def step(self):
        """One step of each env: (obs, next_obs, terminated) arrays with a leading env axis."""
        obs, nxt, term = [], [], []
        for e in range(self.num_envs):
            o, o2 = self._stack(e, self.t[e]), self._stack(e, self.t[e] + 1)
            end = bool(self.rng.random() < 0.05)
            obs.append(o)
            nxt.append(o2)
            term.append(end)
            self.added[self.g + e] = (o, o2)
            if end:
                self.pos[e] += self.t[e] + 2 + int(self.rng.integers(0, 50))
                self.t[e] = 0
            else:
                self.t[e] += 1
        g = self.g
        self.g += self.num_envs
        return np.stack(obs), np.stack(nxt), np.array(term), np.arange(g, g + self.num_envs)

    def run(self, buf, n):
        for _ in range(n):
            o, o2, term, steps = self.step()
            if self.num_envs == 1:
                buf.add(obs=o[0], next_obs=o2[0], step=steps[0], terminated=term[0], truncated=False)
            else:
                buf.add(obs=o, next_obs=o2, step=steps, terminated=term, truncated=np.zeros_like(term))


def check_sample(buf, feed, n=64):
    b = buf.sample(n)
    for i in range(n):
        o, o2 = feed.added[int(b["step"][i])]
        np.testing.assert_array_equal(b["obs"][i], o)
        np.testing.assert_array_equal(b["next_obs"][i], o2)
    return b


def check_all_live(buf, feed):
    """Every live transition decodes to exactly its stacks, and none references a released frame."""
    fs = hook.frames(buf)
    live = np.flatnonzero(buf.status == 1)
    oldest = max(fs.fw - fs.F, fs.log.oldest())
    assert (fs.minref[live] >= oldest).all()
    if live.size:
        obs = fs.stacks("obs_ref", live)
        nxt = fs.stacks("next_obs_ref", live)
        for j, s in enumerate(live):
            g = int(buf.generations[s])
            o, o2 = feed.added[g]
            np.testing.assert_array_equal(obs[j], o)
            np.testing.assert_array_equal(nxt[j], o2)
    return live.size


def noise(rng, n, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((n, *shape)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (n, *shape), endpoint=True).astype(dtype)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["noise", "equal", "blocks"]),
       dtype=st.sampled_from([np.uint8, np.int16, np.float32]),
       shape=st.sampled_from([(8, 8), (5, 7), (3, 4, 2)]),
       k=st.integers(1, 4), budget=st.sampled_from([None, 16, 64]),
       steps=st.integers(1, 160), seed=st.integers(0, 2**16))
def test_round_trip_any_frames_against_reference(kind, dtype, shape, k, budget, steps, seed, tmp_path):
    rng = np.random.default_rng(seed)
    if kind == "noise":  # incompressible: stored raw
        frames = noise(rng, 200, shape, dtype)
    elif kind == "equal":
        frames = np.full((200, *shape), 7, dtype=dtype)
    else:  # compressible: few distinct values in blocks
        frames = np.repeat(noise(rng, 200, (1,) * len(shape), dtype), 1, axis=0) * np.ones(shape, dtype)
    row = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        buf = make("memory", tmp_path, shape, dtype, k, capacity=37, budget=min(budget or row, row))
    except InvalidArgumentError as e:  # a log that could keep no stack of frames that do not compress
        assert "is too small" in str(e)
        buf = make("memory", tmp_path, shape, dtype, k, capacity=37)
    feed = Feed(frames, k, seed)
    feed.run(buf, steps)
    if len(buf) and (buf.status == 1).any():
        check_sample(buf, feed, 16)
    check_all_live(buf, feed)


@pytest.mark.parametrize("kind", STORAGES)
def test_segments_wrap_and_release_make_transitions_unsampleable_never_wrong(kind, tmp_path):
    rng = np.random.default_rng(1)
    frames = noise(rng, 300, (8, 8), np.uint8)  # raw, 64 bytes: one segment holds one block's worth
    buf = make(kind, tmp_path, budget=16, capacity=60)
    log = hook.log(buf)
    feed = Feed(frames, 3)
    released = False
    for _ in range(30):
        feed.run(buf, 13)
        released |= log.oldest() > hook.frames(buf).fw - hook.frames(buf).F
        n = check_all_live(buf, feed)
        if n:
            check_sample(buf, feed, 32)
    assert log.g > 2 * log.S  # the ring wrapped twice
    assert released  # the segments, not the frame ring, limited what stays sampleable
    buf.close()


@pytest.mark.parametrize("game", ["Pong", "Breakout", "MsPacman", "Seaquest", "SpaceInvaders", "Qbert"])
def test_real_atari_frames_round_trip_with_a_dictionary(game, tmp_path, monkeypatch):
    monkeypatch.setattr(bigper.frames.segments, "TRAIN_FRAMES", 150)
    frames = np.load(ATARI)[game]
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=250, budget=1500)
    feed = Feed(frames, 4)
    feed.run(buf, 600)
    assert hook.log(buf).dicts.hi >= 1  # trained on the first frames, used after them
    check_sample(buf, feed, 64)
    check_all_live(buf, feed)


@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
@pytest.mark.parametrize("n_step,num_envs", [(1, 2), (3, 1), (2, 3)])
def test_vector_envs_nstep_and_both_prioritizations(prioritization, n_step, num_envs, tmp_path):
    rng = np.random.default_rng(2)
    frames = noise(rng, 64, (8, 8), np.uint8) // 32  # compressible
    buf = bigper.PrioritizedReplayBuffer(
        capacity=48, fields={"obs": ((3, 8, 8), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=3, compression="zstd", compression_budget=40, n_step=n_step, num_envs=num_envs,
        prioritization=prioritization)
    feed = Feed(frames, 3, num_envs=num_envs)
    for _ in range(60):
        o, o2, term, steps = feed.step()
        kw = dict(obs=o, next_obs=o2, step=steps, reward=np.ones(num_envs, np.float32), terminated=term,
                  truncated=np.zeros_like(term))
        buf.add(**({k: v[0] for k, v in kw.items()} if num_envs == 1 else kw))
        if len(buf) > 8 and (buf.status == 1).any():
            b = buf.sample(8)
            buf.update_priorities(b, rng.random(8))
            for i in range(8):
                o_, _ = feed.added[int(b["step"][i])]
                np.testing.assert_array_equal(b["obs"][i], o_)
    check_all_live(buf, feed)


@pytest.mark.parametrize("kind", STORAGES)
def test_snapshot_and_resume_across_segment_boundaries_are_exact(kind, tmp_path):
    frames = np.load(ATARI)["Qbert"]
    a = make(kind, tmp_path, (84, 84), k=4, capacity=120, budget=400, name="a", seed=5)
    feed = Feed(frames, 4)
    feed.run(a, 150)
    g_before = hook.log(a).g
    snap = a.save(tmp_path / "snap")
    # The uninterrupted run: more steps across new segments, then samples.
    feed2 = Feed(frames, 4)
    feed2.added, feed2.g, feed2.pos, feed2.t = dict(feed.added), feed.g, list(feed.pos), list(feed.t)
    feed2.rng = np.random.default_rng(99)
    feed.rng = np.random.default_rng(99)
    feed.run(a, 80)
    assert hook.log(a).g > g_before
    want = [check_sample(a, feed, 32) for _ in range(3)]
    a.close()
    # feed2 goes on with the same episodes as the uninterrupted run: they continue past the load
    b = bigper.PrioritizedReplayBuffer.load(snap, path=_path(kind, tmp_path, "b"), continue_episodes=True)
    feed2.run(b, 80)
    for w in want:
        got = check_sample(b, feed2, 32)
        np.testing.assert_array_equal(got.indices, w.indices)
        np.testing.assert_array_equal(got["obs"], w["obs"])
    b.close()


def test_reopen_with_another_compression_is_refused_and_changes_nothing(tmp_path):
    buf = make("memmap", tmp_path)
    Feed(np.zeros((10, 8, 8), np.uint8), 3).run(buf, 5)
    buf.close()
    before = fingerprint(tmp_path / "buf")
    for kw in ({"compression": None}, {"compression": "zstd", "compression_budget": 30}):
        with pytest.raises(IncompatibleSnapshotError, match="compression"):
            bigper.PrioritizedReplayBuffer(capacity=40, fields={"obs": ((3, 8, 8), np.uint8), "step": ((), np.int64)},
                                           frame_stack=3, storage="memmap", path=tmp_path / "buf", mode="resume", **kw)
        assert fingerprint(tmp_path / "buf") == before


@pytest.mark.parametrize("kw,name", [({"compression": "lz4"}, "compression"),
                                     ({"compression": "zstd", "compression_budget": 0}, "compression_budget"),
                                     # more than a frame's largest zstd frame (_zstd.bound(64) = 127)
                                     ({"compression": "zstd", "compression_budget": 128}, "compression_budget"),
                                     ({"compression": None, "compression_budget": 8}, "compression_budget")])
def test_bad_compression_arguments_are_refused(kw, name, tmp_path):
    with pytest.raises(InvalidArgumentError, match=name):
        bigper.PrioritizedReplayBuffer(capacity=8, fields={"obs": ((2, 8, 8), np.uint8)}, frame_stack=2,
                                       storage="memmap", path=tmp_path / "x", **kw)
    assert not (tmp_path / "x").exists()
    with pytest.raises(InvalidArgumentError, match="frame_stack"):
        bigper.PrioritizedReplayBuffer(capacity=8, fields={"obs": ((8,), np.uint8)}, compression="zstd")


@pytest.mark.parametrize("where", ["offset", "length", "dict", "bytes"])
def test_a_damaged_index_or_log_is_corrupt_snapshot_error_never_wrong_bytes(where, tmp_path):
    frames = np.load(ATARI)["Pong"]
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=50)
    Feed(frames, 4).run(buf, 60)
    arrays = hook.frames(buf).store.arrays
    live = np.flatnonzero(buf.status == 1)
    ids = np.unique(hook.frames(buf)._refs("obs_ref", live))
    rows = ids % hook.frames(buf).F
    index = arrays["frame_index"]
    if where == "offset":
        hook.set_entries(buf, index, rows, offset=hook.log(buf).log_bytes - 3)
    elif where == "length":
        hook.set_entries(buf, index, rows, length=84 * 84 + 1)
    elif where == "dict":
        hook.set_entries(buf, index, rows, gen=5)
    else:  # a flipped bit inside each frame: the checksum catches it
        o, ln, _ = hook.entries(buf, index, rows)
        flat = arrays["frame_log"].reshape(-1)
        flat[o + ln // 2] ^= 0x10
    with pytest.raises(CorruptSnapshotError):
        buf.sample(8)


def test_a_crafted_segment_state_in_a_snapshot_is_refused(tmp_path):
    from tests._hostile_snapshot_cases import put_state, refused

    buf = make("memory", tmp_path, capacity=40, budget=16)
    Feed(np.random.default_rng(0).integers(0, 255, (100, 8, 8), dtype=np.uint8), 3).run(buf, 80)
    snap = buf.save(tmp_path / "snap")
    first = buf.state_dict()[1]["frames_seg_first"].copy()
    first[:] = first[::-1]
    put_state(snap, "frames_seg_first", first)
    refused(CorruptSnapshotError, snap)


def test_without_libzstd_the_error_names_the_extra_and_nothing_is_made(tmp_path):
    code = f"""
import bigper, bigper.frames.zstd as z, numpy as np
z._candidates = lambda: []
try:
    bigper.PrioritizedReplayBuffer(capacity=8, fields={{"obs": ((2, 8, 8), np.uint8)}}, frame_stack=2,
                                   storage="memmap", path={str(tmp_path / 'x')!r}, compression="zstd")
except bigper.BigperError as e:
    assert isinstance(e, ImportError)
    print("refused:", e)
b = bigper.PrioritizedReplayBuffer(capacity=8, fields={{"obs": ((2, 8, 8), np.uint8)}}, frame_stack=2)
print("plain ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 0, r.stderr
    assert "bigper[compression]" in r.stdout and "plain ok" in r.stdout
    assert not (tmp_path / "x").exists()


def test_decode_on_threads_matches_one_thread(tmp_path):
    frames = np.load(ATARI)["Seaquest"]
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=200)
    Feed(frames, 4).run(buf, 200)
    fs = hook.frames(buf)
    ids = np.arange(fs.fw - 150, fs.fw, dtype=np.int64)
    code = ("import os, numpy as np; from bigper.common import pool; print(pool.workers())")
    del code
    env_before = os.environ.get("BIGPER_THREADS")
    try:
        os.environ["BIGPER_THREADS"] = "1"
        one = fs.log.decode(ids)
        os.environ["BIGPER_THREADS"] = "3"
        three = fs.log.decode(ids)
    finally:
        if env_before is None:
            os.environ.pop("BIGPER_THREADS", None)
        else:
            os.environ["BIGPER_THREADS"] = env_before
    np.testing.assert_array_equal(one, three)


def test_cli_info_shows_the_ratio_and_verify_decompresses_every_live_frame(tmp_path):
    frames = np.load(ATARI)["Breakout"]
    buf = make("memmap", tmp_path, (84, 84), k=4, capacity=100)
    Feed(frames, 4).run(buf, 120)
    live = np.flatnonzero(buf.status == 1)
    victim = int(hook.frames(buf)._refs("obs_ref", live[-1:])[0, 0])
    off, ln, _ = (int(a[0]) for a in hook.entries(buf, rows=[victim % hook.frames(buf).F]))
    seg = hook.log(buf).seg  # (a log that grows has a chunk file a segment)
    buf.close()
    run = lambda *a: subprocess.run([sys.executable, "-m", "bigper", *a, str(tmp_path / "buf")],  # noqa: E731
                                    capture_output=True, text=True,
                                    env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    info = run("info")
    assert info.returncode == 0 and "compression zstd" in info.stdout and "compress " in info.stdout
    ok = run("verify")
    assert ok.returncode == 0 and "compressed frames decompressed and checked" in ok.stdout, ok.stdout
    k, off = divmod(int(off), seg)
    name = "frame_log.bin" if k == 0 else f"frame_log.{k:06d}.bin"
    log = np.memmap(tmp_path / "buf" / "data" / name, mode="r+", dtype=np.uint8)
    log[off + ln // 2] ^= 0x04
    log.flush()
    del log
    bad = run("verify")
    assert bad.returncode != 0 and f"frame {victim}" in bad.stdout, bad.stdout
