"""Direct tests of checks in the compressed frame log that hand-made mutants
removed without any other test noticing (issue 33): each fails when its check
is weakened. A read out of bounds runs in a child, so that it shows as a
failure (its signal) instead of killing the test run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
import bigper.frames.dictionaries
from bigper.errors import CorruptSnapshotError
from bigper.snapshot import verify

from tests.frames.test_compression import make, noise
from tests.frames.test_hostile_compression import put_data
from tests import hook

ROOT = Path(__file__).resolve().parents[2]
GAMES = np.load(Path(__file__).parents[1] / "data" / "atari_frames.npz")


def _child(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- segments.gather_index: the bound check that cannot overflow -------------------------------

def test_an_offset_of_exactly_2_63_minus_its_length_is_refused_never_read(tmp_path):
    # o + ln == 2**63 wraps to a negative int64, below any log size: a check written as
    # `o + ln > log_bytes` lets the entry through and the decoder reads 8 EiB past the log.
    # (Segments of 128 bytes, a power of two: 2**63 - ln and 2**63 - 1 lie in one segment,
    # so only the bound check can refuse it.)
    code = """
import numpy as np
from bigper.errors import CorruptSnapshotError
from tests.frames.test_compression import Feed, make
buf = make("memory", None, capacity=40, budget=24, wide=True)  # (a packed entry's offset cannot reach 2**63)
assert buf._frames.log.seg == 128, buf._frames.log.seg
Feed(np.random.default_rng(0).integers(0, 4, (100, 8, 8), dtype=np.uint8), 3).run(buf, 30)
idx = buf._frames.store.arrays["frame_index"]
ln = idx[:, 1] & 0xFFFFFFFF
idx[:, 0] = np.iinfo(np.int64).max - ln + 1  # exactly 2**63 - ln
try:
    buf.sample(8)
except CorruptSnapshotError as e:
    print("refused:", e)
"""
    r = _child(code, tmp_path)
    assert r.returncode == 0 and "refused:" in r.stdout and "outside the log" in r.stdout, \
        (r.returncode, r.stdout, r.stderr[-2000:])


# -- segments.gather_index: a frame never straddles a segment's end ----------------------------

def test_a_frame_copied_across_a_segment_end_is_refused_not_decoded(tmp_path):
    buf = make("memory", tmp_path, capacity=40, budget=24)
    rng = np.random.default_rng(1)
    frames = noise(rng, 60, (8, 8), np.uint8)
    for t in range(20):
        buf.add(obs=frames[t:t + 3], next_obs=frames[t + 1:t + 4], step=t, terminated=False, truncated=False)
    log, F = hook.log(buf), hook.frames(buf).F
    idx = hook.frames(buf).store.arrays["frame_index"]
    flat = hook.frames(buf).store.arrays["frame_log"].reshape(-1)
    f = hook.frames(buf).fw - 1
    o, ln, _ = (int(a[0]) for a in hook.entries(buf, rows=[f % F]))
    raw = log.decode(np.array([f], dtype=np.int64)).copy()
    # The frame's exact bytes, moved to straddle the end of a segment other than its own
    end = ((o // log.seg + 2) % log.S or 1) * log.seg
    start = end - ln // 2
    assert start // log.seg != (start + ln - 1) // log.seg and start + ln <= log.log_bytes
    payload = flat[o:o + ln].copy()
    flat[start:start + ln] = payload
    hook.set_entries(buf, idx, f % F, offset=start)
    with pytest.raises(CorruptSnapshotError, match="across a segment's end"):
        log.decode(np.array([f], dtype=np.int64))
    # The same bytes inside that segment decode to the frame: the refusal is the straddle's
    inside = end - ln
    flat[inside:inside + ln] = payload
    hook.set_entries(buf, idx, f % F, offset=inside)
    np.testing.assert_array_equal(log.decode(np.array([f], dtype=np.int64)), raw)


# -- segments.touched: the segment a write opens is made private after a snapshot ----------------

def test_the_first_write_into_a_new_segment_after_a_snapshot_is_copy_on_write(tmp_path):
    # Realistic sizes: 84x84 frames, segments of 64 KiB, the log in chunk files of one page.
    # After a snapshot every chunk is shared with it (hard links, mapped read-only); the add
    # whose frame opens the next segment must make that segment's first chunk private first.
    code = """
import numpy as np
import bigper
from pathlib import Path
rng = np.random.default_rng(0)
frames = rng.integers(0, 256, (400, 84, 84), dtype=np.uint8)  # incompressible: about 9 a segment
buf = bigper.PrioritizedReplayBuffer(
    capacity=1000, fields={"obs": ((4, 84, 84), np.uint8)}, frame_stack=4, storage="memmap",
    path=Path("live"), compression="zstd", compression_budget=1030, storage_options={"chunk_bytes": 4096})
log = buf._frames.log
assert log.seg == 65536, log.seg
t, crossed = 0, 0
def add():
    global t
    buf.add(obs=frames[t:t + 4], next_obs=frames[t + 1:t + 5], terminated=False, truncated=False)
    t += 1
add()
L = int(log._lengths(np.array([buf._frames.fw - 1]))[0])  # every noise frame takes as many bytes
for n in range(3):
    while log.pos + L <= log.seg:  # fill the open segment until the next frame cannot fit
        add()
    buf.save(Path(f"snap{n}"))
    g = log.g
    add()
    crossed += log.g == g + 1 and log.pos > 0
b = buf.sample(8)
buf.close()
for n in range(3):  # the snapshots kept their bytes
    assert not bigper.snapshot.verify(Path(f"snap{n}"))["problems"]
print("crossed", crossed)
"""
    r = _child(code, tmp_path)
    assert r.returncode == 0 and "crossed 3" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


# -- dictionaries.train_dictionary: past TRAIN_BYTES, an even spread of the frames ----------------

def test_train_dictionary_thins_many_frames_evenly_not_the_first(monkeypatch):
    # Each frame says which it is (its index in its first 4 bytes), over content that changes
    # along the array: the frames trained on must be spread over all of it, every k-th.
    m, row = 2000, 7056
    monkeypatch.setattr(bigper.frames.dictionaries, "TRAIN_BYTES", 200 * row)
    pool = np.concatenate([GAMES[g] for g in ("Pong", "MsPacman", "Qbert", "Seaquest")])
    frames = pool[np.arange(m) * pool.shape[0] // m].copy()
    frames.reshape(m, -1)[:, :4] = np.arange(m, dtype=np.uint32).view(np.uint8).reshape(m, 4)
    seen = {}
    real = bigper.frames.dictionaries._zstd.train

    def spy(samples, size):
        seen["ids"] = samples[:, :4].copy().view(np.uint32).ravel()
        return real(samples, size)

    monkeypatch.setattr(bigper.frames.dictionaries._zstd, "train", spy)
    d = bigper.train_dictionary(frames, size=16384)
    ids = seen["ids"]
    assert ids.shape == (200,) and ids[0] == 0 and ids[-1] == m - 1
    gaps = np.diff(ids.astype(np.int64))
    assert gaps.min() >= 9 and gaps.max() <= 11, (gaps.min(), gaps.max())
    assert d.dtype == np.uint8 and 256 <= d.size <= 16384


# -- frames.check_live: pending transitions' frames are checked too --------------------------------

def test_verify_checks_the_frames_only_pending_transitions_name(tmp_path):
    # n_step=3: the newest two transitions are pending (their n-step window is not complete),
    # and the second newest frame is named only by them; a live transition reads it as its
    # n-step next_obs, so sample would fail on it. verify must find it damaged.
    k, frames = 4, noise(np.random.default_rng(3), 40, (8, 8), np.uint8)
    buf = bigper.PrioritizedReplayBuffer(
        capacity=30, fields={"obs": ((k, 8, 8), np.uint8), "reward": ((), np.float32)}, frame_stack=k, n_step=3,
        compression="zstd")
    for t in range(20):
        buf.add(obs=frames[t:t + k], next_obs=frames[t + 1:t + k + 1], reward=1.0, terminated=False,
                truncated=False)
    fs = hook.frames(buf)
    live, pending = np.flatnonzero(buf.status == 1), np.flatnonzero(buf.status == 2)
    assert pending.size == 2
    named_live = np.union1d(fs._refs("obs_ref", live).ravel(), fs._refs("next_obs_ref", live).ravel())
    named_pending = np.union1d(fs._refs("obs_ref", pending).ravel(), fs._refs("next_obs_ref", pending).ravel())
    only = np.setdiff1d(named_pending, named_live)
    victim = int(only[only < fs.fw - 1].max())  # not the newest frame: a load decodes that one
    o, ln, _ = (int(a[0]) for a in hook.entries(buf, rows=[victim % fs.F]))
    snap = buf.save(tmp_path / "snap")
    buf.close()
    assert not verify(snap)["problems"]
    log = np.fromfile(snap / "data" / "frame_log.bin", dtype=np.uint8)
    log[o + ln // 2] ^= 0x20  # a flipped byte, the manifest signed again: only the checksum tells
    put_data(snap, "frame_log", log)
    problems = verify(snap)["problems"]
    assert problems and f"frame {victim} " in problems[0], problems
    with bigper.PrioritizedReplayBuffer.load(snap) as loaded, pytest.raises(CorruptSnapshotError):
        for _ in range(50):  # what verify protects against: a sample that reads it
            loaded.sample(16)
