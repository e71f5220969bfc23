"""Attacks on the zstd dictionaries of compressed frames (bigper/frames/dictionaries.py,
the generations named in bigper/frames/segments.py's frame index): crafted states
that every other check lets through, retrains around snapshots, kill -9 and
the frames still in flight. Each is refused with bigper's error, or comes
back byte for byte; never other bytes than the ones added."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import bigper
import bigper.frames.dictionaries
import bigper.frames.segments
from bigper.frames import zstd as _zstd
from bigper.errors import CorruptSnapshotError, InvalidArgumentError

from tests._hostile_snapshot_cases import refused
from tests.frames.test_compression import ATARI, Feed, check_all_live, check_sample, make
from tests.frames.test_compression_dicts import _always_retrain, run
from tests.frames.test_hostile_compression import put_data
from tests import hook

GAMES = np.load(ATARI)
SKIPPABLE = 0x184D2A50  # a zstd skippable frame's magic: decoders step over it


def _retrained_snapshot(tmp_path, monkeypatch, games=("Pong", "Qbert", "MsPacman", "Seaquest")):
    """A memory snapshot whose live frames name several dictionary generations."""
    _always_retrain(monkeypatch)
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=300, budget=1500)
    feed = None
    for game in games:
        feed = run(buf, GAMES[game], 90, feed)
    log, fs = hook.log(buf), hook.frames(buf)
    lo = max(log.oldest(), fs.fw - fs.F, 0)
    ids = np.arange(lo, fs.fw, dtype=np.int64)
    info = {"ids": ids, "entries": log._entries(ids).copy(), "raw": log.decode(ids).copy(),
            "dicts": {log.dicts.lo + i: d.copy() for i, d in enumerate(log.dicts.dicts)},
            "log": np.asarray(fs.store.arrays["frame_log"]).reshape(-1).copy(),
            "index": np.asarray(fs.store.arrays["frame_index"]).copy(), "F": fs.F,
            "block": log.block, "gen": hook.newest_gen(buf)}
    snap = buf.save(tmp_path / "snap")
    buf.close()
    return snap, info


def _compress(raw: np.ndarray, d: np.ndarray | None) -> bytes:
    c = _zstd.Codec(3)
    try:
        slot = 0
        if d is not None:
            c.set_dictionary(1, d)
            slot = 1
        data, _ = c.compress(raw.reshape(1, -1), slot)
        return bytes(data)
    finally:
        c.close()


def test_a_frame_naming_an_older_live_generation_is_refused_at_load(tmp_path, monkeypatch):
    """Frame X (after a frame of generation k) is rewritten as a valid zstd
    frame of an older live generation j (padded to its length with a skippable
    frame), its index entry naming j: every offset, length, bound and
    decode check passes, only "generations never go back" is broken. Loaded,
    the slot reuse would drop j while X still names it (adopt keeps the
    generations from the oldest live frame's on): refused at load."""
    snap, m = _retrained_snapshot(tmp_path, monkeypatch)
    ids, e = m["ids"], m["entries"]
    offs, lens, gens = hook.entries(m["gen"], e)
    live_gens = sorted(m["dicts"])
    assert len(live_gens) >= 2
    found = None
    for i in range(len(ids) - 2, 0, -1):  # not the newest (the open segment's end is checked) nor the first
        k = int(gens[i])
        if gens[i - 1] != k:
            continue
        for j in live_gens:
            if not 1 <= j < k:
                continue
            body = _compress(m["raw"][i], m["dicts"][j])
            if len(body) + 8 <= lens[i]:
                found = i, j, body
                break
        if found:
            break
    assert found is not None, "no frame that an older generation compresses shorter"
    i, j, body = found
    o, ln = int(offs[i]), int(lens[i])
    pad = ln - len(body) - 8
    crafted = body + struct.pack("<II", SKIPPABLE, pad) + b"\0" * pad
    # the crafted bytes decode to exactly frame X's bytes with generation j's dictionary
    c = _zstd.Codec(3)
    c.set_dictionary(1, m["dicts"][j])
    out = np.empty((1, m["raw"].shape[1]), np.uint8)
    r = _zstd.decompress_rows(c.dctx(), c.ddicts, np.frombuffer(crafted, np.uint8), np.zeros(1, np.int64),
                              np.array([ln]), np.ones(1, np.int64), out, 0, 1)
    c.close()
    assert r == -1 and np.array_equal(out[0], m["raw"][i])
    log = m["log"].copy()
    log[o:o + ln] = np.frombuffer(crafted, np.uint8)
    index = m["index"].copy()
    hook.set_entries(m["gen"], index, ids[i] % m["F"], gen=j)
    put_data(snap, "frame_log", log.reshape(-1, m["block"]))
    put_data(snap, "frame_index", index)
    err = refused(CorruptSnapshotError, snap)
    assert "going back" in str(err) or "back" in str(err)


def _check_loaded(snap, feed, tmp_path, name, expect):
    """``snap`` loads to exactly the transitions it held (``expect``: their
    gids), each stack byte for byte; the live index checked by load."""
    kw = {} if expect["kind"] == "memory" else {"path": tmp_path / name}
    loaded = bigper.PrioritizedReplayBuffer.load(snap, **kw)
    try:
        live = np.flatnonzero(loaded.status == 1)
        assert sorted(int(g) for g in loaded.generations[live]) == expect["gids"]
        assert hook.log(loaded).dicts.hi == expect["hi"]
        assert check_all_live(loaded, feed) == len(expect["gids"])
        check_sample(loaded, feed, 32)
    finally:
        loaded.close()


@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
def test_snapshots_between_retrains_load_exactly_after_the_slots_were_reused(kind, tmp_path, monkeypatch):
    """Snapshots taken between retrains (the live buffer then wraps its
    segment ring and reuses every dictionary slot twice): each loads to what
    it held, with the dictionaries of its time."""
    _always_retrain(monkeypatch)
    buf = make(kind, tmp_path, (84, 84), k=4, capacity=200, budget=1500)
    feed, snaps = None, []
    games = ["Pong", "Qbert", "MsPacman", "Seaquest", "Breakout", "SpaceInvaders"]
    for i, game in enumerate(games * 3):
        feed = run(buf, GAMES[game], 60, feed)
        if i % 4 == 1:
            live = np.flatnonzero(buf.status == 1)
            snaps.append((buf.save(tmp_path / f"snap{i}"),
                          {"kind": kind, "gids": sorted(int(g) for g in buf.generations[live]),
                           "hi": hook.log(buf).dicts.hi}))
    assert hook.log(buf).dicts.hi > 2 * bigper.frames.dictionaries.MAX_DICTS
    assert snaps[-1][1]["hi"] - snaps[0][1]["hi"] > bigper.frames.dictionaries.MAX_DICTS  # every slot reused since
    check_all_live(buf, feed)
    for j, (snap, expect) in enumerate(snaps):
        _check_loaded(snap, feed, tmp_path, f"r{j}", expect)
    buf.close()


_META_CASES = {
    "first_string": {"dicts_first": "1"}, "first_float": {"dicts_first": 1.0}, "first_bool": {"dicts_first": True},
    "first_zero": {"dicts_first": 0}, "first_negative": {"dicts_first": -3}, "first_huge": {"dicts_first": 2 ** 62},
    "first_null": {"dicts_first": None}, "first_past_frames": "first_past",
    "sizes_dict": {"dict_sizes": {"a": 1}}, "sizes_null": {"dict_sizes": None}, "sizes_string": "sizes_str",
    "sizes_float": "sizes_float", "sizes_bool": "sizes_bool", "sizes_negative": "sizes_neg",
    "sizes_empty": {"dict_sizes": []}, "sizes_nine": "sizes_nine", "sizes_zero_one": "sizes_zero",
    "base_string": {"dict_base": "1"}, "base_bool": {"dict_base": True}, "base_negative": {"dict_base": -1.0},
    "base_nan": {"dict_base": float("nan")}, "base_inf": {"dict_base": float("inf")}, "base_list": {"dict_base": [1]},
    "only_first": "drop_two", "no_base": "drop_base",
}


def _craft_meta(case, fm, blob):
    """The frames' meta changes of ``case`` (and a new frames_dict, or None)."""
    v = _META_CASES[case]
    sizes, first = fm["dict_sizes"], fm["dicts_first"]
    if isinstance(v, dict):
        return v, None, ()
    if v == "first_past":  # the generations the frames name no longer recorded
        return {"dicts_first": first + len(sizes)}, None, ()
    if v == "sizes_str":
        return {"dict_sizes": [str(s) for s in sizes]}, None, ()
    if v == "sizes_float":
        return {"dict_sizes": [float(s) for s in sizes]}, None, ()
    if v == "sizes_bool":
        return {"dict_sizes": [True] * len(sizes)}, blob[:len(sizes)], ()
    if v == "sizes_neg":
        return {"dict_sizes": [sizes[0] + sizes[1], -sizes[1], *sizes[2:]]}, None, ()
    if v == "sizes_nine":
        n = bigper.frames.dictionaries.MAX_DICTS + 1
        parts = np.split(blob, np.cumsum(sizes)[:-1])
        extra = n - len(sizes)
        return {"dict_sizes": [sizes[0]] * extra + sizes}, np.concatenate([parts[0]] * extra + parts), ()
    if v == "sizes_zero":
        return {"dict_sizes": [0, *sizes]}, None, ()
    if v == "drop_two":
        return {}, None, ("dict_sizes", "dict_base")
    if v == "drop_base":
        return {}, None, ("dict_base",)
    raise AssertionError(case)


@pytest.mark.parametrize("case", sorted(_META_CASES))
def test_a_crafted_dictionary_record_in_the_manifest_is_refused_at_load(case, tmp_path, monkeypatch):
    from tests._hostile_snapshot_cases import put_state, resign
    from tests.frames.test_compression_dicts import _multi_snapshot

    snap = _multi_snapshot(tmp_path, monkeypatch)
    fm = json.loads((snap / "manifest.json").read_text())["state"]["meta"]["frames"]
    blob = np.load(snap / "state" / "frames_dict.npy")
    assert len(fm["dict_sizes"]) >= 3
    changes, new_blob, drop = _craft_meta(case, fm, blob)
    if new_blob is not None:
        put_state(snap, "frames_dict", new_blob)

    def edit(b):
        f = b["state"]["meta"]["frames"]
        f.update(changes)
        for k in drop:
            f.pop(k)
    resign(snap, edit)
    refused(CorruptSnapshotError, snap)


@pytest.mark.parametrize("case", ["int16", "two_d", "float", "bool", "huge"])
def test_a_crafted_frames_dict_array_is_refused_at_load(case, tmp_path, monkeypatch):
    from tests._hostile_snapshot_cases import put_state
    from tests.frames.test_compression_dicts import _multi_snapshot

    snap = _multi_snapshot(tmp_path, monkeypatch)
    blob = np.load(snap / "state" / "frames_dict.npy")
    new = {"int16": blob.astype(np.int16), "two_d": blob[:blob.size // 2 * 2].reshape(2, -1),
           "float": blob.astype(np.float32), "bool": blob.astype(bool),
           "huge": np.zeros(bigper.frames.dictionaries.MAX_DICTS * bigper.frames.dictionaries.DICT_LIMIT + 1, np.uint8)}[case]
    put_state(snap, "frames_dict", new)
    refused(CorruptSnapshotError, snap)


# -- the generation field of an index entry: 31 bits ------------------------------------

TOP = (1 << 31) - 1  # the largest generation an index entry holds (length | generation << 32, int64)


def _given_dict_snapshot(tmp_path, n_steps=60):
    """A memory snapshot of a buffer with a given dictionary: every frame names generation 1."""
    d = bigper.train_dictionary(GAMES["Pong"][:200])
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=300, budget=1500, compression_dictionary=d)
    feed = run(buf, GAMES["Pong"][100:], n_steps)
    index = np.asarray(hook.frames(buf).store.arrays["frame_index"]).copy()
    fw = hook.frames(buf).fw
    assert fw < hook.frames(buf).F and (hook.entries(buf, index, slice(0, fw))[2] == 1).all()
    snap = buf.save(tmp_path / "snap")
    buf.close()
    return snap, index, d, feed, fw


def _rename_generation(snap, index, fw, gen, extra_dicts=(), d=None):
    from tests._hostile_snapshot_cases import put_state, resign

    index = index.copy()
    hook.set_entries(gen, index, np.arange(fw), gen=gen)
    put_data(snap, "frame_index", index)
    if extra_dicts:
        put_state(snap, "frames_dict", np.concatenate([d, *extra_dicts]))
    sizes = [int(d.size)] + [int(x.size) for x in extra_dicts]
    resign(snap, lambda b: b["state"]["meta"]["frames"].update(dicts_first=gen, dict_sizes=sizes))


def test_a_buffer_at_the_last_generation_stops_retraining_and_stays_exact(tmp_path, monkeypatch):
    """A (crafted) state whose newest dictionary is generation 2**31 - 1, the
    largest an index entry holds, loads; retraining then keeps the current
    dictionary instead of writing generations that wrap into the sign bit
    (which made every later add and sample fail)."""
    snap, index, d, feed, fw = _given_dict_snapshot(tmp_path)
    _rename_generation(snap, index, fw, TOP, d=d)
    loaded = bigper.PrioritizedReplayBuffer.load(snap)
    assert hook.log(loaded).dicts.hi == TOP
    _always_retrain(monkeypatch)
    for game in ["Qbert", "MsPacman", "Seaquest"]:
        feed = run(loaded, GAMES[game], 60, feed)
        assert hook.log(loaded).dicts.hi == TOP
        check_all_live(loaded, feed)
        check_sample(loaded, feed, 32)
    loaded.close()


def test_a_dictionary_record_past_the_last_generation_is_refused_at_load(tmp_path):
    """Generations 2**31 - 1 and 2**31 recorded (frames naming the first):
    the next frame would name 2**31, which an index entry cannot hold."""
    snap, index, d, feed, fw = _given_dict_snapshot(tmp_path)
    _rename_generation(snap, index, fw, TOP, extra_dicts=[d], d=d)
    err = refused(CorruptSnapshotError, snap)
    assert "dicts_first" in str(err)


# -- kill -9 right after retrains ------------------------------------------------------

_CHILD = """
import sys, numpy as np
sys.path.insert(0, {root!r})
import bigper, bigper.frames.segments, bigper.frames.dictionaries
bigper.frames.segments.TRAIN_FRAMES = 20  # a new dictionary every 20 frames: kills land right after retrains
bigper.frames.dictionaries.PAYS = bigper.frames.dictionaries.DRIFT = -100.0
from pathlib import Path
from tests.frames.test_compression import ATARI, Feed
games = np.load(ATARI)
root, live = Path({root_dir!r}), Path({live!r})
snaps = bigper.Snapshots(root, keep=2)
feed = Feed(games["Pong"], 4, seed=11)
if snaps.latest() is not None:
    buf = snaps.load_latest(path=live, continue_episodes=True)  # the feed below is restored too: it goes on
    for _ in range(buf._ring.count):
        feed.step()
else:
    buf = bigper.PrioritizedReplayBuffer(
        capacity=150, fields={{"obs": ((4, 84, 84), np.uint8), "step": ((), np.int64)}}, frame_stack=4,
        storage="memmap", path=live, compression="zstd", compression_budget=700, seed=3,
        storage_options={{"chunk_bytes": 8192}})
print("ready", flush=True)
names = list(games)
while True:
    feed.frames = games[names[(buf._ring.count // 23) % len(names)]]
    feed.run(buf, 7)
    snaps.save(buf)
    print("saved", flush=True)
"""


def test_kill_9_right_after_retrains_then_resume_is_exact(tmp_path):
    """A child retrains every 20 frames (each adopted, slots reused), saves a
    snapshot every 7 steps and is killed with SIGKILL at a random moment after
    its first snapshot, four times, each run resuming from the latest snapshot:
    that snapshot always loads to exactly the transitions added, with the
    dictionaries they name."""
    import random
    import time
    from pathlib import Path

    from tests._child import Child

    root_repo = Path(__file__).resolve().parents[2]
    rng = random.Random(7)
    root, live = tmp_path / "snaps", tmp_path / "live"
    code = _CHILD.format(root=str(root_repo), root_dir=str(root), live=str(live))
    for _ in range(4):
        with Child(code) as child:
            child.said("ready")
            # Killed only once a snapshot exists (a slow machine takes seconds to save the first):
            # a live folder without one is unclean, and the next run rightly refuses it.
            child.said("saved")
            time.sleep(rng.uniform(0.5, 2.0))
            child.kill()
    snaps = bigper.Snapshots(root, keep=2)
    buf = snaps.load_latest(path=tmp_path / "check")
    games = list(GAMES)
    feed = Feed(GAMES["Pong"], 4, seed=11)
    while feed.g < hook.ring(buf).count:  # the child's stream: the game switches every 23 transitions
        feed.frames = GAMES[games[(feed.g // 23) % len(games)]]
        for _ in range(7):
            feed.step()
    assert hook.log(buf).dicts.hi >= 3  # several retrains recorded
    assert check_all_live(buf, feed) > 0
    check_sample(buf, feed, 32)
    buf.close()


# -- a retrain that fails (no memory) -------------------------------------------------

@pytest.mark.parametrize("where", ["adopt", "train", "trial"])
def test_a_retrain_that_runs_out_of_memory_loses_nothing(where, tmp_path, monkeypatch):
    """Retraining runs inside ``add`` after the frames were written. A
    MemoryError in it (the live codec taking the new dictionary, training, or
    the trial codec) used to escape half-way: the dictionary list had grown
    while the codec slot had not (the next add: IndexError), the add's
    transition was half recorded, and the next snapshot did not load. Now the
    retrain is skipped (it only saves bytes): every add succeeds, every
    transition comes back exactly, live and after a snapshot."""
    _always_retrain(monkeypatch)
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=300, budget=1500)
    feed = run(buf, GAMES["Pong"], 90)
    hi = hook.log(buf).dicts.hi
    assert hi >= 1
    live_codec = hook.log(buf).dicts.codec
    fails = {"n": 0}

    def once(orig, match):
        def f(*a, **kw):
            if match(a) and fails["n"] == 0:
                fails["n"] += 1
                raise MemoryError("injected: no memory for the dictionary")
            return orig(*a, **kw)
        return f
    if where == "adopt":
        monkeypatch.setattr(_zstd.Codec, "set_dictionary",
                            once(_zstd.Codec.set_dictionary, lambda a: a[0] is live_codec))
    elif where == "train":
        monkeypatch.setattr(_zstd, "train", once(_zstd.train, lambda a: True))
    else:
        monkeypatch.setattr(_zstd.Codec, "set_dictionary",
                            once(_zstd.Codec.set_dictionary, lambda a: a[0] is not live_codec))
    feed = run(buf, GAMES["Qbert"], 90, feed)
    assert fails["n"] == 1  # the failure happened, inside an add
    feed = run(buf, GAMES["MsPacman"], 90, feed)
    assert hook.log(buf).dicts.hi > hi  # later retrains went on
    check_all_live(buf, feed)
    check_sample(buf, feed, 32)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    loaded = bigper.PrioritizedReplayBuffer.load(snap)
    check_all_live(loaded, feed)
    check_sample(loaded, feed, 32)
    loaded.close()


# -- a log too small for one stack of frames that do not compress ----------------------

@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_log_holds_at_least_one_stack_of_frames_that_do_not_compress(kind, tmp_path):
    from tests.frames.test_compression import noise

    # A budget whose log of 3 one-frame segments keeps no stack of k + 1 frames is refused (it
    # used to be taken, and every transition dropped silently); the one the error names works.
    with pytest.raises(InvalidArgumentError, match="compression_budget=64 is too small") as e:
        make(kind, tmp_path, (84, 84), k=4, capacity=40, budget=64)
    assert not (tmp_path / "buf").exists()
    fits = int(str(e.value).rsplit("compression_budget=", 1)[1].split()[0])
    buf = make(kind, tmp_path, (84, 84), k=4, capacity=40, budget=fits)
    feed = Feed(noise(np.random.default_rng(0), 300, (84, 84), np.uint8), 4)
    feed.run(buf, 100)
    assert (buf.status == 1).sum() >= 1  # the newest transition at least
    check_sample(buf, feed, 8)
    buf.close()
