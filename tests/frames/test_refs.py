"""Frame references as one id and offsets (issue 43, section 2), at the kernel.

``assign_refs`` against the input bytes (every reference names a frame
holding exactly the bytes of its stack position), its ``reach`` (no offset
past what the dtype holds, however far back a stream's frames lie), and
``pack_refs`` / ``unpack_refs`` / ``derive_minref`` against the references
they encode. Streams from a small alphabet of frames, so frames repeat inside
a stack, across steps and across envs; episode ends and rows stored without
frames anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigper.frames.refs import derive_minref, offset_dtype, offset_reach, pack_refs, unpack_refs
from bigper.frames.store import assign_refs

WORDS = 16  # a frame: 16 uint64 words


@st.composite
def streams(draw):
    k = draw(st.integers(1, 4))
    envs = draw(st.integers(1, 3))
    m = draw(st.integers(1, 40))
    alphabet = draw(st.integers(1, 6))
    has_next = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    reach = draw(st.integers(0, 24))
    return k, envs, m, alphabet, has_next, seed, reach


def _rows(k, envs, m, alphabet, seed):
    """Stacks that mostly continue (a new frame a step), reset at episode ends,
    from ``alphabet`` distinct frames; a row after an end may hold no frames."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**63, (alphabet, WORDS), dtype=np.uint64)
    stack = [None] * envs
    obs = np.empty((m, k, WORDS), np.uint64)
    nxt = np.empty((m, k, WORDS), np.uint64)
    ends = np.zeros(m, np.uint8)
    valid = np.ones(m, np.bool_)
    ended = [True] * envs
    for r in range(m):
        e = r % envs
        if stack[e] is None:
            stack[e] = pool[rng.integers(0, alphabet, k)] if rng.random() < 0.5 else \
                np.repeat(pool[rng.integers(0, alphabet)][None], k, axis=0)
        if ended[e] and rng.random() < 0.2:
            valid[r] = False  # a reset step of next-step autoreset: no frames
        obs[r] = stack[e]
        nxt[r] = np.concatenate([stack[e][1:], pool[rng.integers(0, alphabet)][None]])
        ends[r] = rng.random() < 0.15
        ended[e] = bool(ends[r]) or not valid[r]
        stack[e] = None if ends[r] else nxt[r]
    return obs, nxt, ends, valid


@settings(max_examples=300, deadline=None)
@given(streams())
def test_references_name_the_input_bytes_and_stay_within_reach(case):
    k, envs, m, alphabet, has_next, seed, reach = case
    obs, nxt, ends, valid = _rows(k, envs, m, alphabet, seed)
    env = np.arange(m, dtype=np.int64) % envs
    stream = (np.zeros((envs, k, WORDS), np.uint64), np.zeros((envs, k), np.int64), np.zeros(envs, np.bool_))
    obs_ref, next_ref = np.empty((m, k), np.int64), np.empty((m, k), np.int64)
    new = np.empty((2 * m * k, WORDS), np.uint64)
    slots = np.arange(m, dtype=np.int64)[::-1].copy()  # rows go to slots in another order
    minref = np.full(m, 99, np.int64)
    fw0 = 1000
    fw = assign_refs((obs, nxt, env, ends, valid), stream, fw0, has_next, (obs_ref, next_ref), new, slots, minref,
                     reach)
    frames = new[:fw - fw0]
    stacks = [(obs_ref, obs)] + ([(next_ref, nxt)] if has_next else [])
    for r in range(m):
        if not valid[r]:
            assert (obs_ref[r] == -1).all() and minref[slots[r]] == -1
            continue
        ids = np.concatenate([ref[r] for ref, _ in stacks])
        for ref, src in stacks:
            assert (frames[ref[r] - fw0] == src[r]).all(), "a reference names other bytes"
        assert ids.max() - ids.min() <= reach + 2 * k - 1, "a reused frame beyond the reach"
        assert minref[slots[r]] == ids.min()
    # packed into the slots and back
    n_off = k * (2 if has_next else 1)
    fref, foff = np.zeros(m, np.int64), np.zeros((m, n_off), np.uint8 if reach + 2 * k < 256 else np.uint16)
    pack_refs(obs_ref, next_ref, has_next, slots, fref, foff)
    for stack, (ref, _) in enumerate(stacks):
        assert (unpack_refs(fref[slots], foff[slots], k, stack) == ref).all()
    assert (derive_minref(fref, foff)[slots] == minref[slots]).all()


def test_a_stream_continued_from_beyond_the_reach_writes_its_frames_again():
    """One env's stream goes on after many frames of other envs: within the
    reach its frames are reused, beyond it written again (each still the input's)."""
    k, words = 2, WORDS
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 2**63, words, dtype=np.uint64) for _ in range(3))
    last = (np.stack([a, b])[None].copy(), np.array([[5, 6]], np.int64), np.array([True]))
    row = (np.stack([a, b])[None], np.stack([b, c])[None], np.zeros(1, np.int64), np.zeros(1, np.uint8),
           np.ones(1, np.bool_))
    # reach 11: frame 5 is reused while the first new id is at most 16, frame 6 while at most 17
    for fw0, want_obs, written in ((16, [5, 6], 1), (17, [17, 6], 2), (18, [18, 19], 3)):
        o, n = np.empty((1, k), np.int64), np.empty((1, k), np.int64)
        stream = tuple(x.copy() for x in last)
        fw = assign_refs(row, stream, fw0, True, (o, n), np.empty((4, words), np.uint64),
                         np.zeros(1, np.int64), np.zeros(1, np.int64), 11)
        assert o[0].tolist() == want_obs and n[0, 0] == o[0, 1], (fw0, o, n)
        assert fw - fw0 == written
        assert max(o.max(), n.max()) - min(o.min(), n.min()) <= 11 + 2 * k - 1


def test_offset_dtypes_hold_the_stream_of_every_env():
    assert offset_dtype(4, 1) == np.uint8 and offset_dtype(4, 24) == np.uint8
    assert offset_dtype(4, 25) == np.uint16 and offset_dtype(4, 6000) == np.uint16
    assert offset_dtype(4, 7000) == np.uint32
    for k, envs in ((1, 1), (4, 1), (4, 24), (4, 64), (16, 200)):
        dt = offset_dtype(k, envs)
        # a steady stream reuses frames written k steps of every env ago: within reach
        assert offset_reach(k, dt) >= (k + 1) * envs


def test_the_references_and_derived_state_a_buffer_writes(tmp_path):
    """What a frame-stacked buffer keeps per transition for its references: one
    int64 id and 2k narrow offsets (k without next_obs); the slots' oldest
    references and the ring's gid are derived, never written to disk."""
    import bigper
    from bigper.core.layout import storage_specs

    fields = {"obs": ((4, 6, 6), np.uint8), "action": ((), np.int64)}
    cfg = bigper.config.Config.build(capacity=10, fields=fields, frame_stack=4)
    specs = storage_specs(cfg)
    assert specs["frame_ref"] == (10, (), np.dtype(np.int64)) and specs["frame_off"] == (10, (8,), np.dtype(np.uint8))
    assert not {"obs_ref", "next_obs_ref"} & set(specs)
    many = bigper.config.Config.build(capacity=10, fields=fields, frame_stack=4, num_envs=30)
    assert storage_specs(many)["frame_off"] == (10, (8,), np.dtype(np.uint16))
    alone = bigper.config.Config.build(capacity=10, fields=fields, frame_stack=4, next_of=())
    assert storage_specs(alone)["frame_off"] == (10, (4,), np.dtype(np.uint8))
    buf = bigper.PrioritizedReplayBuffer(10, fields, frame_stack=4, storage="memmap", path=tmp_path / "b")
    rng = np.random.default_rng(1)
    s = rng.integers(0, 9, (4, 6, 6), dtype=np.uint8)
    for t in range(14):
        n = np.concatenate([s[1:], rng.integers(0, 9, (1, 6, 6), dtype=np.uint8)])
        buf.add(obs=s, next_obs=n, action=t, terminated=t == 6)
        s = n if t != 6 else rng.integers(0, 9, (4, 6, 6), dtype=np.uint8)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    for where in (tmp_path / "b" / "state", snap / "state"):
        kept = {p.name for p in where.iterdir()}
        assert "status.npy" in kept and not {"gid.npy", "frames_minref.npy"} & kept, kept


# -- the older format's references (obs_ref, next_obs_ref) converted ----------------------------------


def _old(rows: list[list[int]], k: int = 2) -> list[np.ndarray]:
    a = np.array(rows, dtype=np.int64)
    return [a[:, :k], a[:, k:]]


def test_older_references_convert_to_the_narrowest_offsets_that_hold_them():
    """The config's offsets when they hold every sampleable slot's spread, else
    the next wider ones: old files may legitimately hold references further
    apart (an older writer reused a frame without a reach)."""
    from bigper.frames.refs import refs_from_stacks

    used = np.ones(3, np.bool_)
    for spread, want in ((0, np.uint8), (255, np.uint8), (256, np.uint16), (70_000, np.uint32),
                         (2**33, np.uint64)):
        stacks = _old([[10, 11, 11, 12], [5, 5, 5, 6], [100, 100 + spread, 100 + spread, 100 + spread]])
        fref, foff = refs_from_stacks(stacks, 2, 1, used)
        assert foff.dtype == want, spread
        assert fref.tolist() == [12, 6, 100 + spread]
        assert unpack_refs(fref, foff, 2, 0).tolist() == stacks[0].tolist()
        assert unpack_refs(fref, foff, 2, 1).tolist() == stacks[1].tolist()
    # never narrower than what the config writes (many envs: uint16 from the start)
    assert refs_from_stacks(_old([[1, 2, 2, 3]]), 2, 200, used[:1])[1].dtype == np.uint16


def test_only_invalid_older_references_are_refused_naming_the_slot():
    from bigper.frames.refs import refs_from_stacks

    used = np.array([True, True, False])
    # a slot no sample reads may hold anything (the padding rule: -1 for a row stored without frames)
    fref, foff = refs_from_stacks(_old([[3, 4, 4, 5], [7, 8, 8, 9], [-1, -1, -1, -1]]), 2, 1, used)
    assert fref[2] == -1 and foff.dtype == np.uint8
    junk = refs_from_stacks(_old([[3, 4, 4, 5], [7, 8, 8, 9], [-(2**63), 2**62, 0, 5]]), 2, 1, used)
    assert junk[1].dtype == np.uint8  # (an unread slot's spread never widens the offsets)
    for row in ([-1, -1, -1, -1], [-1, 4, 4, 5], [3, -2, 4, 5]):  # negative ids in a sampleable slot
        with pytest.raises(ValueError, match="slot 1 .*negative"):
            refs_from_stacks(_old([[3, 4, 4, 5], row, [0, 0, 0, 0]]), 2, 1, used)


def test_offset_dtypes_a_reader_accepts():
    from bigper.frames.refs import check_offsets

    assert check_offsets(np.dtype(np.uint8), 4, 1) == np.uint8
    assert check_offsets(np.dtype("<u2"), 4, 1) == np.uint16  # (wider: converted from an older file)
    for bad, envs in (("<i2", 1), ("<f4", 1), ("|u1", 200), ("<i8", 1), (">u2", 1)):
        with pytest.raises(ValueError, match="frame_off"):
            check_offsets(np.dtype(bad), 4, envs)
    assert offset_reach(4, np.dtype(np.uint64)) < 2**63  # (a reach the kernels' int64 holds)
