"""Attacks on compression="zstd" (bigper/frames/segments.py, bigper/frames/zstd.py).

A frame index, a segment state, a dictionary or the log's bytes read from a
snapshot or a live memmap folder are hostile input: a crafted one is refused
(``CorruptSnapshotError``) by ``load``/resume with nothing changed on disk,
or by ``sample`` when it was changed under a running buffer; never a crash of
the interpreter, never other bytes than the ones added.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.errors import CorruptSnapshotError
from bigper.snapshot.manifest import digest

from tests.conftest import fill_disk
from tests._hostile_snapshot_cases import deadline, fingerprint, put_state, refused, resign
from tests.frames.test_compression import ATARI, Feed, check_sample, make, noise
from tests import hook

ROOT = Path(__file__).resolve().parents[2]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def kill_at_random(code: str, rng, trials: int = 4, max_sleep: float = 0.05) -> None:
    """Run ``code`` (a child that prints "ready", then "added" and "saved" each
    round) ``trials`` times, each killed with SIGKILL at a random moment. The
    kill lands at a point the child reports, however slow the machine (a cold
    numba cache makes the first snapshot take seconds): after its first
    snapshot (so that there is always one to resume: a live folder without one
    is unclean), then during a random later add or save, a random fraction of a
    round into it."""
    import time

    from tests._child import Child

    for _ in range(trials):
        with Child(code) as child:
            child.said("ready")
            child.said("added")
            child.said("saved")
            for _ in range(rng.randrange(3)):
                child.said("added")
                child.said("saved")
            if rng.random() < 0.5:
                child.said("added")  # killed during a save, else during an add
            time.sleep(rng.uniform(0.0, max_sleep))
            child.kill()  # (fails, with its stderr, if it had ended by itself: an error in its loop)


def put_data(snap: Path, name: str, arr: np.ndarray) -> None:
    """Replace data file ``data/<name>.bin`` with ``arr``'s bytes and re-sign (an attacker's snapshot)."""
    raw = np.ascontiguousarray(arr).tobytes()
    member = f"data/{name}.bin"
    os.unlink(snap / member)
    (snap / member).write_bytes(raw)
    resign(snap, lambda b: b["files"].__setitem__(member, {"size": len(raw), "xxh3_64": digest(raw)}))


def live_ids(buf) -> np.ndarray:
    fs = hook.frames(buf)
    live = np.flatnonzero(buf.status == 1)
    return np.unique(np.concatenate([fs._refs("obs_ref", live).ravel(), fs._refs("next_obs_ref", live).ravel()]))


def _victims(buf):
    """Two live frames next to each other in one segment: (id, its index row, the next id's row)."""
    fs, log = hook.frames(buf), hook.log(buf)
    index = np.asarray(fs.store.arrays["frame_index"]) if hasattr(fs.store, "arrays") else \
        fs.store.read("frame_index", np.arange(fs.F))
    ids = live_ids(buf)
    o = hook.entries(buf, index)[0]
    for f in ids[::-1]:
        if f + 1 in ids and o[f % fs.F] // log.seg == o[(f + 1) % fs.F] // log.seg:
            return int(f), index
    raise AssertionError("no two live frames in one segment")


def _snapshot(kind, tmp_path, frames=None, capacity=40, budget=24, steps=70, shape=(8, 8), k=3):
    if frames is None:
        frames = np.zeros((100, *shape), np.uint8)  # a few bytes each once compressed: several a segment
        frames[:, 0, :3] = np.random.default_rng(0).integers(0, 256, (100, 3), dtype=np.uint8)
    buf = make(kind, tmp_path, shape, k=k, capacity=capacity, budget=budget, name="live")
    Feed(frames, k).run(buf, steps)
    f, index = _victims(buf)
    meta = {"F": hook.frames(buf).F, "log_bytes": hook.log(buf).log_bytes, "seg": hook.log(buf).seg,
            "row_bytes": hook.frames(buf).row_bytes, "victim": f, "index": index.copy(), "gen": hook.newest_gen(buf)}
    snap = buf.save(tmp_path / "snap")
    buf.close()
    return snap, meta


BIG = np.iinfo(np.int64).max


def _craft(case, m):
    """The snapshot's frame index with the victim's entry (or its neighbour's) crafted."""
    index, F, f, buf = m["index"].copy(), m["F"], m["victim"], m["gen"]
    r, nxt = f % F, (f + 1) % F
    (o, on), (ln, _), _ = hook.entries(buf, index, [r, nxt])
    o, on, ln = int(o), int(on), int(ln)
    packed = index.shape[1] == 1
    if case == "offset_negative":
        hook.set_entries(buf, index, r, offset=-1)
    elif case == "offset_at_end":
        hook.set_entries(buf, index, r, offset=m["log_bytes"])
    elif case == "offset_one_past":
        hook.set_entries(buf, index, r, offset=m["log_bytes"] - ln + 1)
    elif case == "offset_overflows":  # o + length wraps around int64 (packed: the offset's 40 bits, all set)
        hook.set_entries(buf, index, r, offset=(1 << 40) - 1 - ln // 2 if packed else BIG - ln // 2)
    elif case == "length_zero":
        hook.set_entries(buf, index, r, length=0)
    elif case == "length_huge":
        hook.set_entries(buf, index, r, length=0xFFFF if packed else 0xFFFFFFFF)
    elif case == "entry_negative":
        index[r, -1] = -1
    elif case == "entry_top_bit":  # the sign bit alone set above a valid entry
        index[r, 0] |= np.int64(-(1 << 63))
    elif case == "dict_missing":
        hook.set_entries(buf, index, r, gen=7)
    elif case == "dict_code_max":  # packed: code 127, a generation far from the live ones
        hook.set_entries(buf, index, r, gen=127)
    elif case == "same_as_next":  # points at another whole frame
        index[r] = index[nxt]
    elif case == "into_next":  # overlaps the next frame
        hook.set_entries(buf, index, r, offset=on - 1)
    elif case == "inside_itself":
        hook.set_entries(buf, index, r, offset=o + 1, length=ln - 1)
    elif case == "straddles_segments":
        hook.set_entries(buf, index, r, offset=(o // m["seg"] + 1) * m["seg"] - ln // 2)
    else:
        raise AssertionError(case)
    return index


INDEX_CASES = ["offset_negative", "offset_at_end", "offset_one_past", "offset_overflows", "length_zero",
               "length_huge", "entry_negative", "entry_top_bit", "dict_missing", "dict_code_max", "same_as_next",
               "into_next", "inside_itself", "straddles_segments"]


@pytest.mark.parametrize("case", INDEX_CASES)
@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_crafted_frame_index_in_a_snapshot_is_refused_at_load(kind, case, tmp_path):
    snap, m = _snapshot(kind, tmp_path)
    put_data(snap, "frame_index", _craft(case, m))
    refused(CorruptSnapshotError, snap, path=None if kind == "memory" else tmp_path / "resumed")


@pytest.mark.parametrize("case", ["offset_overflows", "length_huge", "into_next", "same_as_next",
                                  "straddles_segments"])
def test_a_crafted_frame_index_in_a_live_folder_is_refused_at_resume(case, tmp_path):
    snap, m = _snapshot("memmap", tmp_path)
    path = tmp_path / "live"
    crafted = _craft(case, m)
    np.memmap(path / "data" / "frame_index.bin", dtype=np.int64, mode="r+").reshape(crafted.shape)[:] = crafted
    before = fingerprint(path)
    with deadline(), pytest.raises(CorruptSnapshotError):
        bigper.PrioritizedReplayBuffer(capacity=40, fields={"obs": ((3, 8, 8), np.uint8), "step": ((), np.int64)},
                                       frame_stack=3, storage="memmap", path=path, mode="resume",
                                       compression="zstd", compression_budget=24)
    assert fingerprint(path) == before


def test_an_index_entry_that_overflows_is_refused_at_sample_never_a_crash(tmp_path):
    # A running buffer whose index is changed under it: the per-read bound check, in a
    # child so that a read out of bounds shows as a failure instead of killing the run.
    code = f"""
import numpy as np, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.frames.test_compression import Feed, make
from bigper.errors import CorruptSnapshotError
from pathlib import Path
buf = make("memory", Path("."), capacity=40, budget=24)
Feed(np.random.default_rng(0).integers(0, 4, (100, 8, 8), dtype=np.uint8), 3).run(buf, 30)
idx = buf._frames.store.arrays["frame_index"]
if idx.shape[1] == 2:
    idx[:, 0] = {BIG} - (idx[:, 1] & 0xFFFFFFFF) // 2
else:  # packed: the offset's 40 bits all set
    idx[:, 0] |= ((1 << 40) - 1) << 23
try:
    buf.sample(8)
except CorruptSnapshotError as e:
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert r.returncode == 0 and "refused:" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


# -- the checksum ------------------------------------------------------------------

def test_a_flipped_byte_of_an_incompressible_frame_is_caught_by_its_checksum(tmp_path):
    """Noise does not shrink; its frame's bytes still carry a checksum. A flipped byte in
    the middle decodes (raw block) to other bytes: only the checksum can tell."""
    frames = noise(np.random.default_rng(3), 100, (8, 8), np.uint8)
    buf = make("memory", tmp_path, capacity=40, budget=64)
    feed = Feed(frames, 3)
    feed.run(buf, 30)
    check_sample(buf, feed, 16)
    fs = hook.frames(buf)
    ids = live_ids(buf)
    o, ln, _ = hook.entries(buf, rows=ids % fs.F)
    flat = fs.store.arrays["frame_log"].reshape(-1)
    flat[o + ln // 2] ^= 0x01
    with pytest.raises(CorruptSnapshotError, match="does not decompress"):
        buf.sample(8)


def test_a_flipped_literal_of_a_compressed_frame_is_caught_by_its_checksum(tmp_path):
    """Frames whose bytes are half noise, half zeros: their literals are stored raw
    inside the compressed block, so a flipped literal byte decodes to other bytes."""
    rng = np.random.default_rng(4)
    frames = np.zeros((100, 16, 16), np.uint8)
    frames[:, :8] = rng.integers(0, 256, (100, 8, 16), dtype=np.uint8)
    buf = make("memory", tmp_path, (16, 16), capacity=40, budget=200)
    Feed(frames, 3).run(buf, 30)
    fs = hook.frames(buf)
    f = int(live_ids(buf)[-1])
    o, ln, _ = (int(a[0]) for a in hook.entries(buf, rows=[f % fs.F]))
    assert ln < 256 - 8  # it did compress
    flat = fs.store.arrays["frame_log"].reshape(-1)
    want = fs.log.decode(np.array([f]))[0].copy()
    caught = 0
    for pos in range(o + 8, o + ln - 4):  # inside the block, before the checksum
        flat[pos] ^= 0x01
        try:
            got = fs.log.decode(np.array([f]))[0]
        except CorruptSnapshotError:
            caught += 1
        else:  # a bit zstd does not read (padding): the same bytes, never others
            np.testing.assert_array_equal(got, want, err_msg=f"a flipped byte at {pos - o} of {ln}")
        flat[pos] ^= 0x01
    assert caught >= (ln - 12) * 3 // 4


def test_a_frame_of_another_size_with_a_valid_checksum_is_refused(tmp_path):
    buf = make("memory", tmp_path, capacity=40, budget=64)
    Feed(np.zeros((10, 8, 8), np.uint8), 3).run(buf, 10)
    fs = hook.frames(buf)
    f = int(live_ids(buf)[-1])
    for size in (0, 63, 65, 128):
        frame, ln = fs.log.codec.compress(np.full((1, max(size, 1)), 9, np.uint8)[:, :size] if size else
                                          np.zeros((1, 1), np.uint8)[:, :0], 0)
        if size == 0:
            continue
        o = int(hook.entries(buf, rows=[f % fs.F])[0][0])
        fs.store.arrays["frame_log"].reshape(-1)[o:o + frame.size] = frame
        hook.set_entries(buf, fs.store.arrays["frame_index"], f % fs.F, length=frame.size, gen=0)
        with pytest.raises(CorruptSnapshotError):
            fs.log.decode(np.array([f]))


# -- the dictionary ------------------------------------------------------------------

def _dict_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(bigper.frames.segments, "TRAIN_FRAMES", 150)
    snap, m = _snapshot("memory", tmp_path, np.load(ATARI)["Breakout"], capacity=200, budget=1500, steps=450,
                        shape=(84, 84), k=4)
    d = np.load(snap / "state" / "frames_dict.npy")
    assert d.size > 256  # a dictionary was trained and frames use it
    return snap, d


@pytest.mark.parametrize("case", ["garbage", "magic_then_garbage", "truncated", "other_dictionary", "none"])
def test_a_crafted_dictionary_in_a_snapshot_is_refused_at_load(case, tmp_path, monkeypatch):
    snap, d = _dict_snapshot(tmp_path, monkeypatch)
    rng = np.random.default_rng(5)
    if case == "garbage":
        bad = rng.integers(0, 256, d.size, dtype=np.uint8)
    elif case == "magic_then_garbage":
        bad = np.concatenate([d[:8], rng.integers(0, 256, d.size - 8, dtype=np.uint8)])
    elif case == "truncated":
        bad = d[:d.size // 2]
    elif case == "other_dictionary":
        from bigper.frames import zstd as _zstd
        bad = _zstd.train(np.load(ATARI)["Qbert"][:200].reshape(200, -1), d.size)
    else:
        bad = np.zeros(0, np.uint8)
    put_state(snap, "frames_dict", bad)
    refused(CorruptSnapshotError, snap)


# -- the library -------------------------------------------------------------------

@pytest.mark.parametrize("what", ["text", "missing", "directory"])
def test_bigper_libzstd_at_a_non_library_is_refused_naming_the_extra(what, tmp_path):
    lib = tmp_path / "libzstd.so"
    if what == "text":
        lib.write_text("not a library\n")
    elif what == "directory":
        lib.mkdir()
    code = f"""
import bigper, numpy as np
try:
    bigper.PrioritizedReplayBuffer(capacity=8, fields={{"obs": ((2, 8, 8), np.uint8)}}, frame_stack=2,
                                   storage="memmap", path={str(tmp_path / 'x')!r}, compression="zstd")
except bigper.BigperError as e:
    assert isinstance(e, ImportError), type(e)
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**_env(), "BIGPER_LIBZSTD": str(lib)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "bigper[compression]" in r.stdout and str(lib) in r.stdout, r.stdout
    assert not (tmp_path / "x").exists()


def test_buffers_without_compression_never_need_libzstd(tmp_path):
    """With no zstd to be had (BIGPER_LIBZSTD names nothing), raw frame stacks
    and plain fields add, extend, sample, update and snapshot as ever: the
    kernels they run never link libzstd (a compressed add's one call,
    ``write_rows_logged``, is a kernel of its own; one that ``write_rows``
    called compiled libzstd's symbols into every buffer's adds: a segfault
    where the library was not loaded)."""
    code = f"""
import bigper, numpy as np
rng = np.random.default_rng(0)
for k in (2, None):
    fields = {{"obs": (((k, 8, 8) if k else (8, 8)), np.uint8), "r": ((), np.float32)}}
    buf = bigper.PrioritizedReplayBuffer(capacity=16, fields=fields, frame_stack=k, storage="memmap",
                                         path={str(tmp_path)!r} + f"/b{{k}}", seed=0)
    for t in range(40):
        o = rng.integers(0, 3, (((k, 8, 8) if k else (8, 8))), dtype=np.uint8)
        buf.add(obs=o, next_obs=np.roll(o, -1, axis=0) if k else o, r=np.float32(t), terminated=t % 7 == 6)
    buf.extend({{"obs": np.zeros((3, *fields["obs"][0]), np.uint8), "next_obs": np.zeros((3, *fields["obs"][0]),
                np.uint8), "r": np.ones(3, np.float32), "terminated": np.zeros(3, bool)}})
    b = buf.sample(8)
    buf.update_priorities(b, np.ones(8))
    buf.save({str(tmp_path)!r} + f"/s{{k}}")
    print("ok", k, len(buf), float(b["r"].sum()) >= 0)
    buf.close()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**_env(), "BIGPER_LIBZSTD": str(tmp_path / "no-libzstd.so")}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok 2 16 True" in r.stdout and "ok None 16 True" in r.stdout, r.stdout


# -- threads -------------------------------------------------------------------------

def test_two_threads_add_sample_save_and_close_a_compressed_buffer(tmp_path):
    frames = np.load(ATARI)["Seaquest"]
    buf = make("memmap", tmp_path, (84, 84), k=4, capacity=120, budget=500)
    feed = Feed(frames, 4)
    feed.run(buf, 20)
    errors, stop = [], threading.Event()

    def sampler():
        n = 0
        try:
            while not stop.is_set():
                try:
                    b = buf.sample(16)
                except bigper.BigperError as e:  # closed under it: a clear refusal, nothing else
                    if buf.closed if hasattr(buf, "closed") else "closed" in str(e):
                        return
                    raise
                for i in range(16):
                    o, o2 = feed.added[int(b["step"][i])]
                    np.testing.assert_array_equal(b["obs"][i], o)
                    np.testing.assert_array_equal(b["next_obs"][i], o2)
                n += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=sampler)
    t.start()
    for i in range(6):
        feed.run(buf, 30)
        buf.save(tmp_path / f"snap{i}")
    buf.close()
    stop.set()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    b = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap5", path=tmp_path / "again")
    check_sample(b, feed, 32)
    b.close()


# -- bigper verify of a snapshot ------------------------------------------------------

@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_verify_of_a_snapshot_decompresses_every_live_frame(kind, tmp_path):
    frames = noise(np.random.default_rng(6), 100, (8, 8), np.uint8)
    buf = make(kind, tmp_path, capacity=40, budget=64, name="live")
    Feed(frames, 3).run(buf, 60)
    ids = live_ids(buf)
    victim = int(ids[len(ids) // 2])
    o, ln, _ = (int(a[0]) for a in hook.entries(buf, rows=[victim % hook.frames(buf).F]))
    snap = buf.save(tmp_path / "snap")
    buf.close()

    def verify():
        return subprocess.run([sys.executable, "-m", "bigper", "verify", str(snap)], capture_output=True,
                              text=True, env=_env())
    ok = verify()
    assert ok.returncode == 0 and f"{len(ids)} compressed frames decompressed and checked" in ok.stdout, ok.stdout
    log = np.fromfile(snap / "data" / "frame_log.bin", dtype=np.uint8)
    log[o + ln // 2] ^= 0x20  # a flipped byte, the manifest signed again: only the frame's checksum tells
    put_data(snap, "frame_log", log)
    before = fingerprint(snap)
    bad = verify()
    assert bad.returncode != 0 and f"frame {victim} " in bad.stdout and "INVALID" in bad.stdout, bad.stdout
    assert fingerprint(snap) == before


# -- a full disk (a real 3 MB tmpfs) -------------------------------------------------

# (small_tmpfs: tests/conftest.py, a real 3 MB tmpfs)


def _full_fingerprint(buf, root):
    from tests.buffer.test_validation import fingerprint as buffer_fingerprint

    fp = buffer_fingerprint(buf)
    meta, arrays = hook.frames(buf).state()
    fp.update({f"frames.{k}": v for k, v in meta.items()})
    fp.update({f"frames.{k}": np.array(v, copy=True) for k, v in arrays.items()})
    fp["disk"] = fingerprint(root)
    return fp


def test_a_full_disk_at_creation_is_an_oserror_and_nothing_is_made(small_tmpfs):
    before = fingerprint(small_tmpfs)
    with pytest.raises(OSError):  # a capped log of about 3.5 MB preallocated on 3 MB (a log that
        # grows: test_compression_capacity.py, a full disk when it grows)
        bigper.PrioritizedReplayBuffer(capacity=8000, fields={"obs": ((4, 84, 84), np.uint8)}, frame_stack=4,
                                       storage="memmap", path=small_tmpfs / "live", compression="zstd",
                                       compression_budget=441)
    assert fingerprint(small_tmpfs) == before


def test_a_full_disk_during_add_is_an_oserror_and_changes_nothing(small_tmpfs):
    from tests.buffer.test_validation import assert_same

    frames = np.load(ATARI)["MsPacman"]
    buf = bigper.PrioritizedReplayBuffer(
        capacity=150, fields={"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=4,
        storage="memmap", path=small_tmpfs / "live", compression="zstd", compression_budget=1200,
        storage_options={"chunk_bytes": 4096}, seed=0)
    feed = Feed(frames, 4)
    feed.run(buf, 100)
    buf.save(small_tmpfs / "snap")  # every chunk now shared with the snapshot: the next write copies one
    filler = small_tmpfs / "filler"
    fill_disk(filler)
    before = _full_fingerprint(buf, small_tmpfs / "live")
    o, o2, term, steps = feed.step()
    with pytest.raises(OSError):
        buf.add(obs=o[0], next_obs=o2[0], step=steps[0], terminated=True, truncated=False)
    assert_same(before, _full_fingerprint(buf, small_tmpfs / "live"))
    filler.unlink()
    buf.add(obs=o[0], next_obs=o2[0], step=steps[0], terminated=True, truncated=False)
    feed.run(buf, 60)
    check_sample(buf, feed, 32)
    buf.close()
    again = bigper.PrioritizedReplayBuffer.load(small_tmpfs / "snap", path=small_tmpfs / "again")
    assert len(again) == 100
    again.close()


# -- kill -9 during add and save -------------------------------------------------------

_CHILD = """
import sys, numpy as np
sys.path.insert(0, {root!r})
import bigper
from pathlib import Path
from tests.frames.test_compression import ATARI, Feed, check_sample
root, live = Path({root_dir!r}), Path({live!r})
snaps = bigper.Snapshots(root, keep=2)
feed = Feed(np.load(ATARI)["Pong"], 4, seed=11)
if snaps.latest() is not None:
    buf = snaps.load_latest(path=live)
    for _ in range(buf._ring.count):
        feed.step()
else:
    buf = bigper.PrioritizedReplayBuffer(
        capacity=120, fields={{"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}}, frame_stack=4,
        storage="memmap", path=live, compression="zstd", compression_budget=600, seed=3,
        storage_options={{"chunk_bytes": 8192}})
print("ready", flush=True)
while True:
    feed.run(buf, 7)
    if len(buf) > 16:
        check_sample(buf, feed, 8)
    print("added", flush=True)
    snaps.save(buf)
    print("saved", flush=True)
"""


def test_kill_9_during_add_and_save_then_resume_is_exact(tmp_path):
    import random

    from tests.frames.test_compression import check_all_live

    rng = random.Random(5)
    root, live = tmp_path / "snaps", tmp_path / "live"
    code = _CHILD.format(root=str(ROOT), root_dir=str(root), live=str(live))

    kill_at_random(code, rng, max_sleep=0.05)
    snaps = bigper.Snapshots(root, keep=2)
    assert snaps.latest() is not None
    buf = snaps.load_latest(path=tmp_path / "check")
    feed = Feed(np.load(ATARI)["Pong"], 4, seed=11)
    for _ in range(hook.ring(buf).count):
        feed.step()
    assert hook.ring(buf).count > 7 and check_all_live(buf, feed) > 0
    check_sample(buf, feed, 32)
    buf.close()
