"""Incremental memmap snapshots: chunk files are shared by hard links between
the live buffer and its snapshots; the live buffer copies a shared chunk
before its first write into it, so a snapshot's bytes never change."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

import bigper
from bigper import Snapshots
from bigper.snapshot import _save, verify

load = bigper.PrioritizedReplayBuffer.load

from tests._snapshot_cases import Stream, assert_same_runs, feed, learn, make, tree_hash


def inodes(d) -> dict:
    return {p.name: p.stat().st_ino for p in sorted((d / "data").iterdir()) if p.suffix == ".bin"}


@pytest.fixture
def setup(tmp_path):
    stream = Stream(k=None, frame=(32, 32), seed=1)  # 1 KB rows: 4 rows a chunk at 4 KB chunks
    buf = make("memmap", tmp_path / "live", stream, capacity=256, chunk_bytes=4096)
    feed(buf, stream, 300)
    yield buf, stream, tmp_path
    buf.close()


def test_snapshots_share_unchanged_chunks_and_copy_only_what_changed(setup, monkeypatch):
    buf, stream, tmp = setup
    snaps = Snapshots(tmp / "snaps", keep=None)
    s1 = snaps.save(buf)
    live = tmp / "live"
    assert len(inodes(s1)) > 100
    assert inodes(s1) == inodes(live)  # the first snapshot links every chunk: nothing copied
    before = tree_hash(s1)

    hashed = []
    real = _save.digest
    monkeypatch.setattr(_save, "digest", lambda b: hashed.append(memoryview(b).nbytes) or real(b))
    feed(buf, stream, 6)  # rows 44..49 of obs, next_obs and the small fields
    changed = {n for n, i in inodes(live).items() if inodes(s1)[n] != i}
    assert changed and len(changed) <= 8, changed  # copy-on-write: only the chunks written
    s2 = snaps.save(buf)
    assert {n for n, i in inodes(s2).items() if inodes(s1)[n] != i} == changed
    assert inodes(s2) == inodes(live)
    total = sum(p.stat().st_size for p in (s2 / "data").iterdir())
    assert sum(hashed) <= total // 10, "the second save hashes the changed chunks only"
    assert tree_hash(s1) == before
    for s in (s1, s2):
        assert verify(s)["problems"] == []


def test_live_buffer_never_writes_into_a_shared_file(setup):
    buf, stream, tmp = setup
    s1 = tmp / "s1"
    buf.save(s1)
    before = tree_hash(s1)
    learn(buf, stream, 80, seed=3, adds=(3, 5))  # wraps the ring: every chunk is written again
    assert tree_hash(s1) == before
    assert not set(inodes(s1).values()) & set(inodes(tmp / "live").values())
    assert all(os.stat(p).st_nlink == 1 for p in (s1 / "data").iterdir())
    with pytest.raises(ValueError, match="read-only"):
        buf.storage.arrays["obs"][0] = 1  # the arrays handed out are views, never a way around


def test_a_chunk_no_snapshot_holds_any_more_is_written_in_place(setup):
    buf, stream, tmp = setup
    s1 = tmp / "s1"
    buf.save(s1)
    import shutil

    shutil.rmtree(s1)  # nlink back to 1: nothing to protect
    before = inodes(tmp / "live")
    feed(buf, stream, 10)
    assert inodes(tmp / "live") == before


def test_loading_attaches_the_snapshot_chunks(setup):
    buf, stream, tmp = setup
    snap = tmp / "snap"
    buf.save(snap)
    other = copy.deepcopy(stream)
    ran = learn(buf, stream, 20, seed=4)
    before = tree_hash(snap)
    b = load(snap, path=tmp / "resumed")
    assert inodes(tmp / "resumed") == inodes(snap)  # attached, not copied
    assert_same_runs(ran, learn(b, other, 20, seed=4))
    learn(b, other, 60, seed=5, adds=(3, 5))
    b.close()
    assert tree_hash(snap) == before
    b = bigper.PrioritizedReplayBuffer(256, Stream(k=None, frame=(32, 32)).fields(), storage="memmap",
                                       path=tmp / "resumed", storage_options={"chunk_bytes": 4096},
                                       mode="resume")
    assert len(b) == 256  # a clean close: the resumed directory reopens like any other
    b.close()


def test_a_read_only_storage_is_copied_not_linked(setup):
    buf, stream, tmp = setup
    buf.close()
    ro = bigper.PrioritizedReplayBuffer(256, stream.fields(), storage="memmap", path=tmp / "live",
                                        read_only=True, storage_options={"chunk_bytes": 4096})
    snap = tmp / "snap"
    ro.save(snap)  # its writer could be another process, which would not know of the links
    assert not set(inodes(snap).values()) & set(inodes(tmp / "live").values())
    ro.close()
    assert verify(snap)["problems"] == []
    b = load(snap, path=tmp / "b")
    assert len(b) == 256
    b.close()


def test_chunked_reads_and_writes_round_trip_across_chunk_edges(tmp_path):
    rng = np.random.default_rng(0)
    fields = {"x": ((3, 5), np.float64), "y": ((), np.int16), "z": ((7,), np.bool_)}
    buf = bigper.PrioritizedReplayBuffer(1000, fields, storage="memmap", path=tmp_path / "b",
                                         storage_options={"chunk_bytes": 4096}, next_of=())
    data = {"x": rng.standard_normal((1000, 3, 5)), "y": rng.integers(-9, 9, 1000).astype(np.int16),
            "z": rng.random((1000, 7)) < 0.5}
    buf.extend(data)
    st = buf.storage
    assert st._arr["x"].n >= 2  # 120-byte rows: 512 rows make a whole number of pages
    idx = rng.integers(0, 1000, 500)
    for name, want in data.items():
        assert np.array_equal(st.read(name, idx), want[idx])
    buf.save(tmp_path / "s")
    st.write("x", np.array([3, 999, 3]), np.zeros((3, 3, 5)))  # shared chunks: copied, then written
    assert np.array_equal(st.read("x", np.array([3, 999, 4])), np.concatenate([np.zeros((2, 3, 5)), data["x"][[4]]]))
    buf.close()
    back = load(tmp_path / "s", path=tmp_path / "c")
    assert np.array_equal(back.storage.read("x", np.arange(1000)), data["x"])
    back.close()


def test_prepare_copies_every_shared_chunk_a_step_will_write_before_any_write(setup):
    buf, stream, tmp = setup
    buf.save(tmp / "s1")
    snap_bytes = tree_hash(tmp / "s1")
    st = buf.storage
    before = inodes(tmp / "live")
    data = {n: st.read(n, np.arange(256)) for n in st.arrays}
    st.prepare({"obs": np.array([0, 255]), "reward": slice(0, 4)})
    after = inodes(tmp / "live")
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"obs.bin", f"obs.{63:06d}.bin", "reward.bin"}, changed
    for n in st.arrays:  # nothing written: only copied
        assert np.array_equal(st.read(n, np.arange(256)), data[n])
    feed(buf, stream, 5)
    assert tree_hash(tmp / "s1") == snap_bytes


_WRAP_CHILD = r'''
import sys
import numpy as np
import bigper

path, snap, k = sys.argv[1], sys.argv[2], int(sys.argv[3]) or None
cap = 64
fields = {"obs": (((k,) if k else ()) + (16, 16), np.uint8), "reward": ((), np.float32)}


def chunk(m, g0):
    shape = (m,) + fields["obs"][0]
    obs = (np.arange(g0, g0 + m) % 251).astype(np.uint8)[:, None, None] * np.ones(shape[-2:], np.uint8)
    if k:
        obs = np.repeat(obs[:, None], k, axis=1)
    return {"obs": obs, "next_obs": obs.copy(), "reward": np.arange(g0, g0 + m, dtype=np.float32),
            "terminated": np.zeros(m, bool), "truncated": np.zeros(m, bool)}


# 256-byte frames, 4 KiB chunks: 16 rows a chunk, 4 chunks for the ring.
buf = bigper.PrioritizedReplayBuffer(cap, fields, frame_stack=k, storage="memmap", path=path,
                                     storage_options={"chunk_bytes": 4096}, seed=0)
buf.extend(chunk(60, 0))
buf.save(snap)  # every chunk is now shared with the snapshot
buf.extend(chunk(20, 60))  # slots 60..63, then past the end onto 0..15
got = buf.storage.read("reward", np.arange(cap))
want = np.arange(16, 80, dtype=np.float32)[(np.arange(cap) - 16) % cap]
assert np.array_equal(got, want), (got, want)
b = buf.sample(32)
assert np.all(b["obs"].reshape(32, -1).max(axis=1) == (np.asarray(b["reward"]) % 251)), "obs follows reward"
buf.close()
# back into the live path, over the buffer closed there with 20 more transitions: a rewind, asked for
old = bigper.PrioritizedReplayBuffer.load(snap, rewind=True)
assert np.array_equal(old.storage.read("reward", np.arange(60)), np.arange(60, dtype=np.float32))
old.close()
print("ok")
'''


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "frame-stack-2"])
def test_an_extend_that_wraps_past_the_ring_end_after_a_snapshot_copies_the_wrapped_chunks(k, tmp_path):
    """The write of an ``extend`` that wraps touches the chunks at the ring's
    end and at its start; both must be copied before the write. Run in a child
    so that a write into a shared (read-only) mapping is a failed test with its
    signal, not a crashed pytest; the snapshot's files stay byte for byte."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    snap = tmp_path / "snap"
    r = subprocess.run([sys.executable, "-c", _WRAP_CHILD, str(tmp_path / "live"), str(snap), str(k)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
    assert verify(snap)["problems"] == []
