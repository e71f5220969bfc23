"""The compressed log's frame index (issue 43, section 2): one int64 a frame
(offset, length and the dictionary generation's code packed), where the
frames and the log fit its bits; two (the wide layout an older bigper wrote)
otherwise. A log keeps the layout its storage holds: old files stay readable
and writable as they are."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bigper
from bigper.frames.dictionaries import MAX_DICTS, MAX_GEN
from bigper.frames.segments import index_width, put_entries, read_entry, split_entries
from tests import hook
from tests.frames.test_compression import ATARI, Feed, check_sample, make, noise

OFF_MAX = (1 << 40) - 1


@st.composite
def _entry(draw, packed):
    """An entry a log may write: offset, length, and a generation live beside the newest ``ghi``."""
    ghi = draw(st.integers(0, MAX_GEN))
    gen = 0 if ghi == 0 else draw(st.one_of(st.just(0), st.integers(max(1, ghi - MAX_DICTS + 1), ghi)))
    off = draw(st.integers(0, OFF_MAX if packed else (1 << 62)))
    ln = draw(st.integers(1, 0xFFFF if packed else 0xFFFFFFFF))
    return off, ln, gen, ghi


@settings(max_examples=400, deadline=None)
@given(packed=st.booleans(), data=st.data())
def test_an_entry_reads_back_as_written_in_both_layouts(packed, data):
    off, ln, gen, ghi = data.draw(_entry(packed))
    index = np.zeros((3, 1 if packed else 2), dtype=np.int64)
    put_entries(index[1:2], np.array([off]), np.array([ln]), gen)
    assert tuple(int(x) for x in read_entry(index, 1, ghi)) == (off, ln, gen)
    o, n, d = split_entries(index[1:2], ghi)
    assert (int(o[0]), int(n[0]), int(d[0])) == (off, ln, gen)
    assert not index[0].any() and not index[2].any()  # (its row only)


@settings(max_examples=400, deadline=None)
@given(words=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=2, max_size=2),
       ghi=st.integers(0, MAX_GEN), packed=st.booleans())
def test_any_word_reads_the_same_in_the_kernel_and_in_numpy(words, ghi, packed):
    """What a crafted file holds is read one way: the kernel's check and the
    Python checks (``check_index``, errors) see the same entry; a packed code
    names no generation below 1 (-1, refused) and none above the newest."""
    index = np.array([words[:1] if packed else words], dtype=np.int64)
    o, n, d = split_entries(index, ghi)
    assert tuple(int(x) for x in read_entry(index, 0, ghi)) == (int(o[0]), int(n[0]), int(d[0]))
    if packed:
        assert d[0] == 0 or d[0] == -1 or max(1, ghi - 126) <= d[0] <= ghi
        assert 0 <= n[0] <= 0xFFFF


def test_the_layout_follows_the_frames_and_the_log():
    assert index_width(None, 7_100, 1 << 38) == 1  # Atari frames, a 50M-frame log that does not compress
    assert index_width(None, 70_000, 1 << 20) == 2  # a frame over 64 KiB
    assert index_width(None, 7_100, (1 << 40) + 1) == 2  # a log over 1 TiB
    assert index_width((2,), 7_100, 1 << 20) == 2 and index_width([2], 7_100, 1 << 20) == 2  # an older file
    assert index_width([1], 7_100, 1 << 20) == 1
    for bad in [(1,), [3], [], [1, 1], ["1"], [True], [1.0], "1", None.__class__, 1, {"1": 1}]:
        held = (1,) if bad == (1,) else bad
        if bad == (1,):  # a packed index held for frames that do not fit it
            with pytest.raises(ValueError, match="frame_index"):
                index_width(held, 70_000, 1 << 20)
            continue
        with pytest.raises(ValueError, match="frame_index"):
            index_width(held, 7_100, 1 << 20)


def test_a_new_atari_buffer_keeps_8_bytes_of_index_a_frame(tmp_path):
    frames = np.load(ATARI)["Pong"]
    buf = make("memmap", tmp_path, (84, 84), k=4, capacity=200)
    feed = Feed(frames, 4)
    feed.run(buf, 260)
    F = hook.frames(buf).F
    assert buf.storage.arrays["frame_index"].shape == (F, 1)
    check_sample(buf, feed, 64)
    buf.close()
    data = tmp_path / "buf" / "data"
    assert sum(p.stat().st_size for p in data.glob("frame_index*")) == 8 * F


def test_frames_too_large_for_a_packed_entry_keep_the_wide_index_and_stay_exact(tmp_path):
    frames = noise(np.random.default_rng(2), 40, (260, 260), np.uint8)  # 67,600 bytes: over 64 KiB
    buf = make("memory", tmp_path, (260, 260), k=2, capacity=12)
    assert hook.frames(buf).store.arrays["frame_index"].shape[1] == 2
    feed = Feed(frames, 2)
    feed.run(buf, 30)
    check_sample(buf, feed, 16)
    loaded = bigper.PrioritizedReplayBuffer.load(buf.save(tmp_path / "snap"))
    assert hook.frames(loaded).store.arrays["frame_index"].shape[1] == 2
    check_sample(loaded, feed, 16)
    loaded.close()
    buf.close()


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_a_wide_index_stays_wide_through_save_load_resume_and_verify(storage, tmp_path):
    """A buffer of the older layout (two int64 an entry) written on, saved,
    loaded, written on, closed, resumed and verified: exact, and still wide
    everywhere (nothing rewrites it in the other layout)."""
    from bigper.snapshot import live

    frames = np.load(ATARI)["Breakout"]
    feed = Feed(frames, 4, seed=3)
    buf = make(storage, tmp_path, (84, 84), k=4, capacity=120, wide=True)
    feed.run(buf, 150)
    check_sample(buf, feed, 32)
    snap = buf.save(tmp_path / "snap")
    buf.close()

    def width(b):
        store = b.storage
        return (store.arrays if store.arrays is not None else store.dsets)["frame_index"].shape[1]

    path = None if storage == "memory" else tmp_path / ("loaded.h5" if storage == "hdf5" else "loaded")
    loaded = bigper.PrioritizedReplayBuffer.load(snap, path=path)
    assert width(loaded) == 2
    feed.run(loaded, 90)
    check_sample(loaded, feed, 32)
    loaded.close()
    if path is None:
        return
    verdict = live.verify_live(path)
    assert verdict is not None and verdict.status == live.OK and "compressed frames" in verdict.text, verdict
    again = bigper.PrioritizedReplayBuffer(
        capacity=120, fields={"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=4,
        storage=storage, path=path, mode="resume", compression="zstd")
    assert width(again) == 2
    feed.run(again, 40)
    check_sample(again, feed, 32)
    again.close()
