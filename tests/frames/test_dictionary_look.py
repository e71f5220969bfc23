"""The dictionary look off the add's path (bigper/frames/look.py): a look's
training runs in a thread, its outcome is applied at the next multiple of
``TRAIN_FRAMES``; where a dictionary is adopted depends on the adds only.

Every test compares what comes back with what was added, byte for byte
(each transition carries its number in ``step``), and two runs of the same
adds with each other: dictionaries, index entries, next samples."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
import bigper.frames.dictionaries
import bigper.frames.look
import bigper.frames.segments

from tests.frames.test_compression import ATARI, Feed, check_all_live, check_sample, make
from tests import hook

GAMES = np.load(ATARI)
NAMES = ("Pong", "Qbert", "MsPacman", "Seaquest", "Breakout", "SpaceInvaders")
W = 40  # frames between two looks in these tests


def _retrain_often(mp):
    """A look every ``W`` frames, and every candidate adopted: a dictionary a look."""
    mp.setattr(bigper.frames.segments, "TRAIN_FRAMES", W)
    mp.setattr(bigper.frames.dictionaries, "PAYS", -100.0)
    mp.setattr(bigper.frames.dictionaries, "DRIFT", -100.0)


def _slow_looks(mp, seconds):
    """Each look's thread first sleeps ``seconds`` (a loaded machine): adds reach the frame
    where its outcome is due before it has one, and wait for it there."""
    work = bigper.frames.look.work

    def slow(inputs):
        time.sleep(seconds)
        return work(inputs)
    mp.setattr(bigper.frames.look, "work", slow)


def steps_of(games, per_game, seed=0):
    """The steps ``(obs, next_obs, terminated, step)`` of a feed switching games, and the feed
    (its ``added``: each step's stacks)."""
    feed = Feed(GAMES[games[0]], 4, seed=seed)
    out = []
    for g in games:
        feed.frames = GAMES[g]
        for _ in range(per_game):
            o, o2, term, s = feed.step()
            out.append((o[0], o2[0], bool(term[0]), int(s[0])))
    return out, feed


def add(buf, steps):
    for o, o2, term, s in steps:
        buf.add(obs=o, next_obs=o2, step=s, terminated=term, truncated=False)


def log_state(buf):
    """The dictionaries and the live frames' index entries."""
    fs, log = hook.frames(buf), hook.log(buf)
    ids = np.arange(max(log.oldest(), fs.fw - fs.F, 0), fs.fw, dtype=np.int64)
    meta, blob = log.dicts.state()
    return meta, blob.copy(), log._entries(ids).copy()


def same_log(a, b):
    ma, ba, ea = log_state(a)
    mb, bb, eb = log_state(b)
    assert ma == mb
    assert np.array_equal(ba, bb) and np.array_equal(ea, eb)


def test_where_a_dictionary_is_adopted_does_not_depend_on_the_threads_speed(tmp_path):
    steps, feed = steps_of(("Pong", "Qbert", "MsPacman", "Seaquest"), 90)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        fast = make("memory", tmp_path, (84, 84), k=4, capacity=300, seed=1)
        add(fast, steps)
        _slow_looks(mp, 0.05)
        slow = make("memory", tmp_path, (84, 84), k=4, capacity=300, seed=1)
        add(slow, steps)
    same_log(fast, slow)
    log = hook.log(fast)
    assert log.dicts.hi >= 4  # looks were applied, one a W frames
    # A generation's first frame follows the add that crossed a multiple of W (an add writes at most 2k frames).
    fw = hook.frames(fast).fw
    ids = np.arange(max(log.oldest(), fw - hook.frames(fast).F, 0), fw, dtype=np.int64)
    gens = hook.frame_gens(log, ids)
    firsts = ids[1:][np.diff(gens) != 0]
    assert firsts.size >= 2
    for f in firsts:
        assert (f // W) * W > f - 2 * 4 - 1, f"generation {gens[ids == f]} begins at frame {f}"
    check_all_live(fast, feed)
    check_all_live(slow, feed)
    a, b = fast.sample(64), slow.sample(64)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a["obs"], b["obs"])
    fast.close()
    slow.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(1, 359), games=st.lists(st.sampled_from(NAMES), min_size=2, max_size=4),
       slow=st.sampled_from([0.0, 0.02]))
def test_a_snapshot_at_any_point_resumes_exactly(tmp_path_factory, cut, games, slow):
    """Wherever the snapshot falls (a look in flight or not, its thread done or not),
    the loaded buffer and the one that went on agree after the same adds: the same
    dictionaries at the same frames, the same next samples, every stack exact."""
    tmp = tmp_path_factory.mktemp("look")
    steps, feed = steps_of(games, 360 // len(games) + 1)
    steps = steps[:360]
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        if slow:
            _slow_looks(mp, slow)
        buf = make("memory", tmp, (84, 84), k=4, capacity=200, seed=2)
        add(buf, steps[:cut])
        snap = buf.save(tmp / "snap")
        back = bigper.PrioritizedReplayBuffer.load(snap, continue_episodes=True)  # (the feed goes on)
        same_log(buf, back)
        add(buf, steps[cut:])
        add(back, steps[cut:])
        same_log(buf, back)
        a, b = buf.sample(48), back.sample(48)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a["obs"], b["obs"])
    assert np.array_equal(a["next_obs"], b["next_obs"])
    check_all_live(back, feed)
    buf.close()
    back.close()


def test_close_while_a_look_is_in_flight_records_its_outcome_and_resumes(tmp_path):
    steps, feed = steps_of(("Pong", "Qbert"), 120)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        _slow_looks(mp, 0.5)
        buf = make("memmap", tmp_path, (84, 84), k=4, capacity=200, seed=3)
        i = 0
        while hook.log(buf)._look is None or i < W * 2:  # a look (not the first) in flight
            assert i < len(steps), "no look was in flight"
            add(buf, steps[i:i + 1])
            i += 1
        hi = hook.log(buf).dicts.hi
        t = time.perf_counter()
        buf.close()
        assert time.perf_counter() - t < 30
        closed = buf.state_dict()[0]["frames"]
        assert closed["dicts_first"] + len(closed["dict_sizes"]) - 1 == hi + 1  # adopted at close
        again = make("memmap", tmp_path, (84, 84), k=4, capacity=200, seed=3, mode="resume")
        assert hook.log(again).dicts.hi == hi + 1
        check_all_live(again, feed)
        add(again, steps[i:])
        check_all_live(again, feed)
        check_sample(again, feed, 32)
    again.close()


def test_adds_and_samples_from_two_threads_while_looks_run(tmp_path):
    steps, feed = steps_of(("Pong", "MsPacman", "Qbert", "Seaquest"), 150)
    errors, sampled = [], [0]
    done = threading.Event()
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        buf = make("memory", tmp_path, (84, 84), k=4, capacity=250, seed=4)
        add(buf, steps[:50])

        def sampler():
            try:
                while not done.is_set():
                    check_sample(buf, feed, 16)
                    sampled[0] += 1
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        t = threading.Thread(target=sampler)
        t.start()
        try:
            add(buf, steps[50:])
        finally:
            done.set()
            t.join()
    assert not errors, errors[0]
    assert sampled[0] > 0
    assert hook.log(buf).dicts.hi >= 4
    check_all_live(buf, feed)
    buf.close()


@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
def test_frames_written_while_a_look_runs_decode_exactly_on_every_storage(kind, tmp_path):
    steps, feed = steps_of(("Breakout", "SpaceInvaders", "Pong"), 100)
    with pytest.MonkeyPatch.context() as mp:
        _retrain_often(mp)
        _slow_looks(mp, 0.01)
        buf = make(kind, tmp_path, (84, 84), k=4, capacity=150, seed=5)
        add(buf, steps)
    assert hook.log(buf).dicts.hi >= 3
    check_all_live(buf, feed)
    check_sample(buf, feed, 64)
    buf.close()
