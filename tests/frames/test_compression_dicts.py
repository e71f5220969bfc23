"""zstd dictionaries of compressed frames: given by the user, retrained where
it pays (bigper/frames/dictionaries.py), every live one stored and checked."""

from __future__ import annotations

import numpy as np
import pytest

import bigper
import bigper.frames.dictionaries
import bigper.frames.segments
from bigper.errors import CorruptSnapshotError, InvalidArgumentError

from tests._hostile_snapshot_cases import fingerprint, put_state, refused, resign
from tests.frames.test_compression import ATARI, Feed, check_all_live, check_sample, make
from tests import hook

GAMES = np.load(ATARI)


def run(buf, frames, steps, feed=None):
    """Continue ``feed`` (its step numbers) on other frames for ``steps`` steps."""
    f = Feed(frames, 4)
    if feed is not None:
        f.g, f.added = feed.g, feed.added
    f.run(buf, steps)
    return f


def stored_lengths(log, ids):
    return log._lengths(np.asarray(ids, dtype=np.int64))


def test_a_game_switch_retrains_and_the_bytes_per_frame_drop(tmp_path, monkeypatch):
    monkeypatch.setattr(bigper.frames.segments, "TRAIN_FRAMES", 150)
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=400, budget=1500)
    feed = run(buf, GAMES["Pong"], 600)
    log = hook.log(buf)
    gen, pong_dict = log.dicts.hi, log.dicts.dicts[-1].copy()
    assert gen >= 1
    feed = run(buf, GAMES["Qbert"], 600, feed)
    assert log.dicts.hi > gen  # a Qbert dictionary was adopted
    fw = hook.frames(buf).fw
    newest = np.arange(fw - 100, fw)
    frames = log.decode(newest)
    c = bigper.frames.zstd.Codec(3)
    c.set_dictionary(1, pong_dict)
    with_pong = int(c.compress(frames, 1)[1].sum())
    c.close()
    assert stored_lengths(log, newest).sum() < 0.9 * with_pong
    check_all_live(buf, feed)
    check_sample(buf, feed, 64)
    buf.close()


@pytest.mark.parametrize("game", ["Pong", "Breakout", "MsPacman"])
def test_an_unchanging_stream_does_not_retrain(game, tmp_path, monkeypatch):
    monkeypatch.setattr(bigper.frames.segments, "TRAIN_FRAMES", 150)
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=400, budget=1500)
    run(buf, GAMES[game], 1500)
    assert hook.frames(buf).fw > 9 * 150  # nine looks at the dictionary
    assert hook.log(buf).dicts.hi == 1  # trained once, never again
    buf.close()


def _always_retrain(monkeypatch, every=40):
    monkeypatch.setattr(bigper.frames.segments, "TRAIN_FRAMES", every)
    monkeypatch.setattr(bigper.frames.dictionaries, "PAYS", -100.0)  # every candidate adopted
    monkeypatch.setattr(bigper.frames.dictionaries, "DRIFT", -100.0)


@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
def test_old_frames_stay_readable_across_retrains_and_slot_reuse(kind, tmp_path, monkeypatch):
    _always_retrain(monkeypatch)
    buf = make(kind, tmp_path, (84, 84), k=4, capacity=300, budget=1500)
    feed = None
    seen = set()
    for i, game in enumerate(["Pong", "MsPacman", "Qbert", "Seaquest", "Breakout", "SpaceInvaders"] * 2):
        feed = run(buf, GAMES[game], 90, feed)
        log = hook.log(buf)
        seen.add(log.dicts.hi)
        assert len(log.dicts.dicts) <= bigper.frames.dictionaries.MAX_DICTS
        check_all_live(buf, feed)
    assert log.dicts.hi > 2 * bigper.frames.dictionaries.MAX_DICTS  # slots were reused
    check_sample(buf, feed, 64)
    buf.close()


def test_snapshot_and_resume_are_exact_across_retrains(tmp_path, monkeypatch):
    _always_retrain(monkeypatch)
    buf = make("memmap", tmp_path, (84, 84), k=4, capacity=300, budget=1500)
    feed = None
    for game in ["Pong", "Qbert", "MsPacman", "Seaquest"] * 3:
        feed = run(buf, GAMES[game], 90, feed)
    log = hook.log(buf)
    assert len(log.dicts.dicts) > 1 and log.dicts.lo > 1
    snap = buf.save(tmp_path / "snap")
    state = log.dicts.state()
    loaded = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "resumed")
    meta, blob = hook.log(loaded).dicts.state()
    assert meta == state[0] and np.array_equal(blob, state[1])
    check_all_live(loaded, feed)
    a, b = buf.sample(64), loaded.sample(64)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a["obs"], b["obs"])
    loaded.close()
    buf.close()


def _multi_snapshot(tmp_path, monkeypatch):
    _always_retrain(monkeypatch)
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=300, budget=1500)
    feed = None
    for game in ["Pong", "Qbert", "MsPacman"] * 2:
        feed = run(buf, GAMES[game], 90, feed)
    assert len(hook.log(buf).dicts.dicts) >= 3
    snap = buf.save(tmp_path / "snap")
    buf.close()
    return snap


def _frames_meta(snap, **changes):
    def edit(b):
        b["state"]["meta"]["frames"].update(changes)
    resign(snap, edit)


@pytest.mark.parametrize("case", ["first_shifted", "sizes_split_elsewhere", "dicts_swapped", "one_dropped",
                                  "sizes_off"])
def test_a_crafted_dictionary_set_is_refused_at_load(case, tmp_path, monkeypatch):
    snap = _multi_snapshot(tmp_path, monkeypatch)
    blob = np.load(snap / "state" / "frames_dict.npy")
    import json
    fm = json.loads((snap / "manifest.json").read_text())["state"]["meta"]["frames"]
    first, sizes = fm["dicts_first"], fm["dict_sizes"]
    parts = np.split(blob, np.cumsum(sizes)[:-1])
    if case == "first_shifted":
        _frames_meta(snap, dicts_first=first + 1)
    elif case == "sizes_split_elsewhere":  # (the same total, each dictionary cut at another byte)
        _frames_meta(snap, dict_sizes=[sizes[0] - 1000, sizes[1] + 1000, *sizes[2:]])
    elif case == "dicts_swapped":
        put_state(snap, "frames_dict", np.concatenate(parts[::-1]))
        _frames_meta(snap, dict_sizes=sizes[::-1])
    elif case == "one_dropped":
        put_state(snap, "frames_dict", np.concatenate(parts[1:]))
        _frames_meta(snap, dict_sizes=sizes[1:], dicts_first=first + 1)
    else:
        _frames_meta(snap, dict_sizes=[*sizes[:-1], sizes[-1] + 1])
    refused(CorruptSnapshotError, snap)


# -- a dictionary given by the user -------------------------------------------------

def test_a_given_dictionary_is_used_from_the_first_frame(tmp_path):
    d = bigper.train_dictionary(GAMES["MsPacman"][:200])
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=200, budget=1500, compression_dictionary=d)
    plain = make("memory", tmp_path, (84, 84), k=4, capacity=200, budget=1500, name="plain")
    feeds = [run(b, GAMES["MsPacman"][200:], 50) for b in (buf, plain)]
    log, plog = hook.log(buf), hook.log(plain)
    ids = np.arange(hook.frames(buf).fw)
    assert (hook.frame_gens(log, ids) == 1).all()
    assert stored_lengths(log, ids).sum() < 0.5 * stored_lengths(plog, ids).sum()
    check_all_live(buf, feeds[0])
    snap = buf.save(tmp_path / "snap")
    loaded = bigper.PrioritizedReplayBuffer.load(snap)
    assert np.array_equal(hook.log(loaded).dicts.dicts[0], d)
    check_all_live(loaded, feeds[0])
    for b in (buf, plain, loaded):
        b.close()


@pytest.mark.parametrize("bad", ["text", "garbage", "list", "2d", "no_compression"])
def test_a_bad_given_dictionary_is_refused_naming_it_and_nothing_is_made(bad, tmp_path):
    d = bigper.train_dictionary(GAMES["Pong"][:200])
    value = {"text": "dict", "garbage": np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8),
             "list": list(d[:100]), "2d": d[:400].reshape(20, 20),
             "no_compression": d}[bad]
    before = fingerprint(tmp_path)
    kw = dict(compression=None) if bad == "no_compression" else {}
    with pytest.raises(InvalidArgumentError, match="compression_dictionary"):
        bigper.PrioritizedReplayBuffer(
            capacity=50, fields={"obs": ((4, 84, 84), np.uint8)}, frame_stack=4, storage="memmap",
            path=tmp_path / "buf", **({"compression": "zstd"} | kw), compression_dictionary=value)
    assert fingerprint(tmp_path) == before


def test_train_dictionary_refuses_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="size"):
        bigper.train_dictionary(GAMES["Pong"][:100], size=10)
    with pytest.raises(InvalidArgumentError, match="frames"):
        bigper.train_dictionary(np.zeros(5, np.uint8))
