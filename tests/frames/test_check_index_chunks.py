"""The frame index check in chunks says what the check of the whole index says.

``SegmentLog.check_index`` checks the entries of a log's frames ``chunk`` at a
time (1M by default: a 50M-frame log's check holds arrays of 1M, not 80 bytes
a frame of temporaries), each chunk carrying on from the last frame of the one
before (its segment, where it ends, its dictionary). Whatever the chunk size,
it must accept exactly the logs the whole-index check accepts and name the
same first bad frame in the same words: here over real logs (segments opened
and capped, dictionaries trained on the way) with no, one or two entries
rewritten by an attacker (``hook.set_entries``), checked with chunks of 1 to
the whole log.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bigper.core.ring import expected_gid, first_wrong_gid
from bigper.errors import CorruptSnapshotError

from tests import hook
from tests.frames.test_compression import Feed, make, noise


def _verdict(log, fw, chunk):
    try:
        return "ok", log.check_index(fw, chunk=chunk)
    except CorruptSnapshotError as e:
        return "refused", str(e)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["memory", "memmap"]), budget=st.sampled_from([None, 24]),
       steps=st.integers(30, 140), seed=st.integers(0, 2**16),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(["offset", "length", "gen"]),
                                st.integers(-3, 3)), max_size=2))
def test_any_chunk_size_gives_the_whole_checks_verdict(tmp_path_factory, kind, budget, steps, seed, edits):
    rng = np.random.default_rng(seed)
    src = noise(rng, 40, (6, 6), np.uint8)
    src[::3] = src[0]  # (repeats: frames a dictionary compresses, of several lengths)
    buf = make(kind, tmp_path_factory.mktemp("ci"), shape=(6, 6), k=3, capacity=50, budget=budget)
    try:
        Feed(src, 3, seed=seed).run(buf, steps)
        log, fw = hook.log(buf), hook.frames(buf).fw
        lo = max(log.oldest(), fw - log.F, 0)
        index = buf.storage.writable_arrays["frame_index"]
        for where, what, delta in edits:  # an attacker's entries, each off by a little
            f = lo + int(where * (fw - lo))
            o, ln, d = (int(a[0]) for a in hook.entries(buf, index, [f % log.F]))
            new = {"offset": o + delta, "length": ln + delta, "gen": max(0, d + delta)}[what]
            hook.set_entries(buf, index, [f % log.F], **{what: new})
        whole = _verdict(log, fw, fw + 1)
        if not edits:
            assert whole == ("ok", fw - lo)
        for chunk in sorted({1, 2, 3, 7, max(1, (fw - lo) // 2), fw - lo}):
            assert _verdict(log, fw, chunk) == whole, chunk
    finally:
        if kind == "memmap":  # (an edited index must not reach a reopen)
            buf.storage.abort()
        else:
            buf.close()


def _gid_reference(count: int, capacity: int) -> np.ndarray:
    """Slot s holds the newest transition g < count with g % capacity == s (-1: none)."""
    out = np.full(capacity, -1, dtype=np.int64)
    for g in range(max(0, count - capacity), count):
        out[g % capacity] = g
    return out


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 60), count=st.integers(0, 400), chunk=st.integers(1, 70),
       wrong=st.one_of(st.none(), st.tuples(st.integers(0, 59), st.integers(-2, 2).filter(bool))))
def test_expected_gid_in_chunks_is_the_rings_rule(capacity, count, chunk, wrong):
    want = _gid_reference(count, capacity)
    assert expected_gid(count, capacity, chunk=chunk).tolist() == want.tolist()
    into = np.full(capacity, 7, dtype=np.int64)
    assert expected_gid(count, capacity, out=into, chunk=chunk) is into and into.tolist() == want.tolist()
    gid = want.copy()
    first = -1
    if wrong is not None and wrong[0] < capacity:
        gid[wrong[0]] += wrong[1]
        first = wrong[0]
    assert first_wrong_gid(gid, count, chunk=chunk) == first


def test_a_rings_recorded_gid_off_by_one_is_named_after_the_first_chunk(tmp_path):
    """Past the first chunk of 2**20 slots: the slot and both numbers are named."""
    import bigper
    from bigper.core.statecheck import check_state

    c = (1 << 20) + 5
    buf = bigper.PrioritizedReplayBuffer(capacity=c, fields={"x": ((), np.uint8)})
    try:
        buf.extend({"x": np.zeros(c + 3, np.uint8)})
        meta, arrays = buf.state_dict()
        arrays = dict(arrays, gid=np.array(arrays["gid"]))
        arrays["gid"][c - 2] += 1
        with pytest.raises(CorruptSnapshotError, match=rf"gid\[{c - 2}\] = {c - 1}, but after count {c + 3} "
                                                       rf"slot {c - 2} holds transition {c - 2}$"):
            check_state(buf.config, meta, arrays)
    finally:
        buf.close()


@pytest.fixture(scope="module")
def retrained():
    """A log of real frames of four games whose dictionary was retrained every 40 frames
    (generations 1, 2, 3, ... in frame order), and its frame index as written."""
    import bigper.frames.dictionaries as D
    import bigper.frames.segments as S
    from tests.frames.test_compression_dicts import GAMES, run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "TRAIN_FRAMES", 40)
        mp.setattr(D, "PAYS", -100.0)  # every candidate adopted
        mp.setattr(D, "DRIFT", -100.0)
        buf = make("memory", None, (84, 84), k=4, capacity=300, budget=1500)
        feed = None
        for game in ("Pong", "MsPacman", "Seaquest", "Breakout"):
            feed = run(buf, GAMES[game], 70, feed)
    index = buf.storage.writable_arrays["frame_index"]
    yield buf, index, index.copy()
    buf.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(["offset", "length", "gen"]),
                                st.integers(-3, 3)), max_size=2),
       chunk=st.integers(1, 64))
def test_across_retrained_dictionaries_any_chunk_gives_the_whole_checks_verdict(retrained, edits, chunk):
    buf, index, kept = retrained
    log, fw = hook.log(buf), hook.frames(buf).fw
    lo = max(log.oldest(), fw - log.F, 0)
    gens = hook.entries(buf, index, np.arange(lo, fw) % log.F)[2]
    assert log.dicts.hi >= 3 and len(set(gens.tolist()) - {0}) >= 2  # (generations change inside the log)
    try:
        for where, what, delta in edits:
            f = lo + int(where * (fw - lo))
            o, ln, d = (int(a[0]) for a in hook.entries(buf, index, [f % log.F]))
            hook.set_entries(buf, index, [f % log.F],
                             **{what: {"offset": o + delta, "length": ln + delta, "gen": max(0, d + delta)}[what]})
        whole = _verdict(log, fw, fw + 1)
        if not edits:
            assert whole == ("ok", fw - lo)
        assert _verdict(log, fw, chunk) == whole
        assert _verdict(log, fw, 1) == whole
    finally:
        index[:] = kept
