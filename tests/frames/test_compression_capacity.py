"""Issue 34: a compressed buffer keeps ``capacity`` whatever its frames
compress to, and its log takes the disk its bytes need (it grows by segments).

The reference for what a buffer holds is always an uncompressed twin fed the
same steps: the same transitions sampleable, the same batches drawn.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper

from tests.conftest import fill_disk
from tests.frames.test_compression import ATARI, Feed, check_all_live, check_sample, make
from tests import hook

ROOT = Path(__file__).resolve().parents[2]


def frames_of(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """84x84 frames that compress about 10x ("atari": real play), about 2x
    ("half": noise in the low nibble only), not at all ("noise"), or a mix."""
    rng = np.random.default_rng(seed)
    if kind == "atari":
        src = np.load(ATARI)["MsPacman"]
        return src[np.arange(n) % src.shape[0]]
    if kind == "half":
        return (rng.integers(0, 16, (n, 84, 84)) * 17).astype(np.uint8)
    if kind == "noise":
        return rng.integers(0, 256, (n, 84, 84), dtype=np.uint8)
    parts = [frames_of(k, n, seed + i) for i, k in enumerate(("atari", "half", "noise"))]
    pick = rng.integers(0, 3, n)
    return np.stack([parts[p][i] for i, p in enumerate(pick)])


def twins(kind, tmp, capacity, budget=None, **kw):
    z = make(kind, tmp, (84, 84), k=4, capacity=capacity, budget=budget, seed=5, **kw)
    raw = bigper.PrioritizedReplayBuffer(capacity=capacity, fields={"obs": ((4, 84, 84), np.uint8),
                                                                    "step": ((), np.int64)},
                                         frame_stack=4, seed=5, **kw)
    return z, raw


def disk_bytes(root: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("frames", ["atari", "half", "noise", "mixed"])
@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
def test_capacity_is_held_whatever_the_frames_compress_to(kind, frames, tmp_path):
    z, raw = twins(kind, tmp_path, 300)
    feed = Feed(frames_of(frames, 700, seed=1), 4, seed=2)
    twin = Feed(feed.frames, 4, seed=2)
    feed.run(z, 900)
    twin.run(raw, 900)
    np.testing.assert_array_equal(z.status, raw.status)  # the same transitions sampleable
    assert (z.status == 1).sum() > 250
    a, b = z.sample(48), raw.sample(48)
    for key in ("obs", "next_obs", "step"):
        np.testing.assert_array_equal(a[key], b[key])
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.indices, b.indices)
    assert check_all_live(z, feed) == int((raw.status == 1).sum())
    z.close()
    raw.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(8, 120), kinds=st.lists(st.sampled_from(["atari", "half", "noise"]), min_size=1,
                                                       max_size=4),
       num_envs=st.integers(1, 3), n_step=st.integers(1, 3), steps=st.integers(1, 400))
def test_a_log_that_grows_keeps_what_the_raw_ring_keeps(capacity, kinds, num_envs, n_step, steps):
    """Property: whatever the frames, the envs, n_step and how far the ring
    wrapped, the compressed buffer's sampleable set and draws are the raw one's."""
    fields = {"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)}
    kw = dict(capacity=capacity, fields=fields, frame_stack=4, num_envs=num_envs, n_step=n_step, seed=1)
    z = bigper.PrioritizedReplayBuffer(compression="zstd", **kw)
    raw = bigper.PrioritizedReplayBuffer(**kw)
    frames = np.concatenate([frames_of(k, 60, seed=i) for i, k in enumerate(kinds)])
    feeds = [Feed(frames, 4, seed=3, num_envs=num_envs) for _ in range(2)]
    for buf, feed in zip((z, raw), feeds):
        for _ in range(max(1, steps // num_envs)):
            o, o2, term, g = feed.step()
            r = g.astype(np.float32)
            if num_envs == 1:
                buf.add(obs=o[0], next_obs=o2[0], step=g[0], reward=r[0], terminated=term[0], truncated=False)
            else:
                buf.add(obs=o, next_obs=o2, step=g, reward=r, terminated=term, truncated=np.zeros_like(term))
    np.testing.assert_array_equal(z.status, raw.status)
    if (raw.status == 1).any():
        a, b = z.sample(16), raw.sample(16)
        for key in ("obs", "next_obs", "step", "reward"):
            np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_array_equal(a.weights, b.weights)
    z.close()
    raw.close()


def test_disk_follows_the_bytes_of_the_frames(tmp_path):
    """A log of frames that compress takes a small share of one of noise; each
    holds its live frames' bytes and a few segments more (the room the larger
    frames before the first dictionary took is given back), never the worst case."""
    took = {}
    for frames in ("atari", "noise"):
        buf = make("memmap", tmp_path, (84, 84), k=4, capacity=2000, name=frames)
        feed = Feed(frames_of(frames, 3000, seed=4), 4, seed=5)
        log, most = hook.log(buf), 0
        for _ in range(60):
            feed.run(buf, 100)
            most = max(most, log.slots)
        data = tmp_path / frames / "data"
        on_disk = sum(os.stat(p).st_blocks * 512 for p in data.glob("frame_log*"))
        assert on_disk == log.slots * log.seg  # every segment allocated is really reserved, nothing more
        assert log.slots * log.seg <= log.held_bytes() + 4 * log.seg  # the frames' bytes and a few segments
        assert log.slots < log.S  # never the worst case the log could grow to
        took[frames] = on_disk
        assert check_all_live(buf, feed) >= 1800
        buf.close()
    assert took["atari"] * 5 < took["noise"]


def test_a_capped_log_says_once_that_its_cap_costs_capacity(tmp_path):
    z = make("memory", tmp_path, (84, 84), k=4, capacity=300, budget=441)
    feed = Feed(frames_of("noise", 500), 4)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        feed.run(z, 600)
    said = [w for w in got if "compression_budget" in str(w.message)]
    assert len(said) == 1 and ROOT / "tests" in Path(said[0].filename).resolve().parents  # once, at the caller's line (a test file)
    assert (z.status == 1).sum() < 100  # what the cap costs: the raw ring would hold about 280
    z.close()


def test_a_full_disk_when_the_log_grows_is_an_oserror_naming_the_file_and_changes_nothing(small_tmpfs):
    from tests.frames.test_hostile_compression import _full_fingerprint
    from tests.buffer.test_validation import assert_same

    live = small_tmpfs / "live"
    buf = bigper.PrioritizedReplayBuffer(
        capacity=150, fields={"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=4,
        storage="memmap", path=live, compression="zstd", seed=0)
    feed = Feed(frames_of("noise", 400), 4)
    feed.run(buf, 20)
    filler = small_tmpfs / "filler"
    fill_disk(filler)
    for _ in range(200):  # adds go on into the open segment; the one that opens a new one fails
        before = _full_fingerprint(buf, live)
        slots = hook.log(buf).slots
        o, o2, term, steps = feed.step()
        try:
            buf.add(obs=o[0], next_obs=o2[0], step=steps[0], terminated=term[0], truncated=False)
        except OSError as e:
            assert "frame_log" in str(e) and str(live) in str(e), e
            break
        assert hook.log(buf).slots >= slots
    else:
        pytest.fail("200 adds of frames that do not compress on a full disk did not fail")
    assert_same(before, _full_fingerprint(buf, live))
    filler.unlink()
    buf.add(obs=o[0], next_obs=o2[0], step=steps[0], terminated=term[0], truncated=False)
    feed.run(buf, 60)
    check_sample(buf, feed, 32)
    check_all_live(buf, feed)
    buf.close()
    again = bigper.PrioritizedReplayBuffer(  # resumed, the log as it grew
        capacity=150, fields={"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=4,
        storage="memmap", path=live, compression="zstd", seed=0, mode="resume")
    assert again.resumed
    check_all_live(again, feed)
    again.close()


@pytest.mark.parametrize("kind", ["memmap", "hdf5", "memory"])
def test_snapshots_and_copy_on_write_across_a_log_that_grew(kind, tmp_path):
    buf = make(kind, tmp_path, (84, 84), k=4, capacity=200)
    feed = Feed(frames_of("mixed", 600, seed=7), 4, seed=8)
    feed.run(buf, 120)
    buf.save(tmp_path / "s1")
    first = {g: feed.added[g] for g in range(feed.g)}
    slots_then = hook.log(buf).slots
    feed.run(buf, 400)  # grows, then reuses slots a snapshot holds (copy-on-write)
    assert hook.log(buf).slots > slots_then
    buf.save(tmp_path / "s2")
    for snap, n in (("s1", 120), ("s2", 520)):
        got = bigper.PrioritizedReplayBuffer.load(tmp_path / snap,
                                                  path=None if kind == "memory" else tmp_path / f"live-{snap}")
        assert hook.ring(got).count == n
        check_all_live(got, feed)
        check_sample(got, feed, 32)
        got.close()
    assert all(np.array_equal(first[g][0], feed.added[g][0]) for g in first)
    check_all_live(buf, feed)
    buf.close()
    ok = subprocess.run([sys.executable, "-m", "bigper", "verify", str(tmp_path / "s1")], capture_output=True,
                        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ok.returncode == 0 and "compressed frames decompressed and checked" in ok.stdout, ok.stdout + ok.stderr


_CHILD = """
import sys, numpy as np
sys.path.insert(0, {root!r})
import bigper
from pathlib import Path
from tests.frames.test_compression import Feed, check_sample
from tests.frames.test_compression_capacity import frames_of
root, live = Path({root_dir!r}), Path({live!r})
snaps = bigper.Snapshots(root, keep=2)
feed = Feed(frames_of("mixed", 400, seed=3), 4, seed=11)
if snaps.latest() is not None:
    buf = snaps.load_latest(path=live)
    for _ in range(buf._ring.count):
        feed.step()
else:
    buf = bigper.PrioritizedReplayBuffer(
        capacity=120, fields={{"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}}, frame_stack=4,
        storage="memmap", path=live, compression="zstd", seed=3)
print("ready", flush=True)
while True:
    feed.run(buf, 9)
    if len(buf) > 16:
        check_sample(buf, feed, 8)
    print("added", flush=True)
    snaps.save(buf)
    print("saved", flush=True)
"""


def test_kill_9_while_the_log_grows_then_resume_is_exact(tmp_path):
    """Frames that do not compress make most adds of the first rounds open (and
    allocate) a segment: a kill lands in one often. Resume from the latest
    snapshot, four times over, and every live transition is exact."""
    import random

    from tests.frames.test_hostile_compression import kill_at_random

    rng = random.Random(9)
    root, live = tmp_path / "snaps", tmp_path / "live"
    code = _CHILD.format(root=str(ROOT), root_dir=str(root), live=str(live))

    kill_at_random(code, rng, max_sleep=0.03)
    snaps = bigper.Snapshots(root, keep=2)
    buf = snaps.load_latest(path=tmp_path / "check")
    feed = Feed(frames_of("mixed", 400, seed=3), 4, seed=11)
    for _ in range(hook.ring(buf).count):
        feed.step()
    assert check_all_live(buf, feed) > 16
    feed.run(buf, 200)  # and it goes on: grows, reuses
    check_all_live(buf, feed)
    buf.close()
