"""Hostile tests of the equal-count rule of ``_check_newer`` (promise 18): a
live path closed at the snapshot's count whose recorded largest leaf is
larger than the snapshot's is refused without ``rewind=True``.

Attacked: the live path's recorded meta crafted (``state`` / ``count`` /
``max_leaf`` of every JSON type, NaN and infinities) for memmap and HDF5 --
each must be a clear ``PathExistsError`` leaving the path byte for byte as it
was, or the load goes on as before, never a raw exception; the snapshot's own
``max_leaf`` crafted and re-signed; rank and proportional, n-step and
sequences; legitimate flows that must load without ``rewind`` (a loaded
buffer closed untouched or after sampling, loaded again); the SB3 drop-in's
``load_replay_buffer`` in process; two threads loading into one path.

A case that holds is a plain test; a case that shows a bug is
``xfail(strict=True)`` with the bug in its reason.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.errors import BigperError, PathExistsError, StorageLockedError
from tests._hostile_snapshot_cases import deadline, fingerprint, resign
from tests.snapshot.test_hostile_resume import CASES, build, live_of, run_folder

load = bigper.PrioritizedReplayBuffer.load
F = {"obs": ((1,), np.float32), "reward": ((), np.float32)}
SNAP = "ckpt/snap-00000001"


def raised_run(root, storage, value=3.0):
    """run_folder at 10 transitions, one priority raised to ``value`` after the snapshot, closed."""
    live = live_of(storage, root)
    b = run_folder(root, storage=storage, live_rel=live.name, more=0, close=False)
    b.update_priorities(np.array([4]), np.array([value]))
    b.close()
    raised_run.top = b.state_dict()[0]["max_leaf"]  # the recorded largest leaf (3.0 ** alpha)
    return live


def edit_meta(live, storage, change) -> None:
    """Apply ``change(meta)`` to the closed buffer's recorded meta, as an attacker would."""
    if storage == "memmap":
        p = live / "meta.json"
        meta = json.loads(p.read_text())
        change(meta)
        p.write_text(json.dumps(meta))
    else:
        import h5py
        with h5py.File(live, "a") as f:
            g = f["_bigper"]
            meta = json.loads(g.attrs["meta"])
            change(meta)
            g.attrs["meta"] = json.dumps(meta)


def _load_outcome(root, snap, path=None, refused=PathExistsError) -> str:
    """``load(snap, path=path)``: ``"refused"`` (a ``BigperError`` that is a
    ``refused``, everything under ``root`` byte for byte as it was) or
    ``"loaded"``; never a hang, never another error."""
    before = fingerprint(root)
    with deadline(20):
        try:
            load(snap, path=path).close()
        except BigperError as e:
            assert isinstance(e, refused), e  # (rewind=True, or a file bigper never writes)
            assert fingerprint(root) == before
            return "refused"
    return "loaded"


def _set(keys, value):
    def change(meta):
        d = meta
        for k in keys[:-1]:
            d = d[k]
        if value is KeyError:
            d.pop(keys[-1], None)
        else:
            d[keys[-1]] = value
    return change


CRAFTED = {
    "max_leaf-nan": (("state", "max_leaf"), float("nan")),
    "max_leaf-inf": (("state", "max_leaf"), float("inf")),
    "max_leaf--inf": (("state", "max_leaf"), float("-inf")),
    "max_leaf-huge": (("state", "max_leaf"), 1e308),
    "max_leaf-str": (("state", "max_leaf"), "9"),
    "max_leaf-null": (("state", "max_leaf"), None),
    "max_leaf-bool": (("state", "max_leaf"), True),
    "max_leaf-list": (("state", "max_leaf"), [9.0]),
    "max_leaf-dict": (("state", "max_leaf"), {"v": 9.0}),
    "max_leaf-int": (("state", "max_leaf"), 9),
    "max_leaf-missing": (("state", "max_leaf"), KeyError),
    "count-bool": (("state", "count"), True),
    "count-float": (("state", "count"), 10.0),
    "count-str": (("state", "count"), "10"),
    "count-null": (("state", "count"), None),
    "count-huge": (("state", "count"), 10 ** 30),
    "state-missing": (("state",), KeyError),
    "state-list": (("state",), [10, 9.0]),
    "state-str": (("state",), "x"),
    "state-null": (("state",), None),
    "clean-str": (("clean",), "true"),
}


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("crafted", sorted(CRAFTED))
def test_a_crafted_live_meta_is_a_clean_refusal_or_the_load_goes_on(tmp_path, storage, crafted):
    """Whatever the live path's recorded meta says: a ``PathExistsError``
    naming ``rewind=True`` with the path byte for byte as it was, or a load
    that goes on (and verifies) -- never a raw TypeError/KeyError/ValueError
    or a formatting error in the message."""
    live = raised_run(tmp_path, storage)
    keys, value = CRAFTED[crafted]
    edit_meta(live, storage, _set(keys, value))
    before = fingerprint(tmp_path)
    with deadline():
        try:
            b = load(tmp_path / SNAP)
        except PathExistsError as e:
            assert "rewind=True" in str(e)
            assert fingerprint(tmp_path) == before
            return
    assert len(b) == 10
    b.close()


UNREADABLE_COUNT = [k for k in CRAFTED if k.startswith(("count-", "state-")) and k != "count-huge"] + ["count-neg"]


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("crafted", UNREADABLE_COUNT)
def test_a_clean_live_record_that_does_not_say_its_count_is_never_loaded_over(tmp_path, storage, crafted):
    """A buffer closed cleanly at the live path, whose record's transition
    count does not read as one (a string, null, a bool, a float, negative, no
    state at all): it may hold more than the snapshot, so the load refuses
    naming ``rewind=True`` and leaves every byte; ``rewind=True`` loads. (The
    load used to take such a folder over as if it held nothing newer.)"""
    live = raised_run(tmp_path, storage)
    keys, value = CRAFTED.get(crafted, (("state", "count"), -1))
    edit_meta(live, storage, _set(keys, value))
    before = fingerprint(tmp_path)
    with deadline(), pytest.raises(PathExistsError, match="rewind=True"):
        load(tmp_path / SNAP)
    assert fingerprint(tmp_path) == before
    b = load(tmp_path / SNAP, rewind=True)
    assert len(b) == 10
    b.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("value", [float("inf"), 1e308, float("nan")])
def test_a_crafted_large_live_max_leaf_refusal_message_is_well_formed(tmp_path, storage, value):
    """The message formats any float the live meta holds (inf, nan, 1e308);
    whatever it holds, the leaves that changed since refuse the load."""
    live = raised_run(tmp_path, storage)
    edit_meta(live, storage, _set(("state", "max_leaf"), value))
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="rewind=True") as e:
        load(tmp_path / SNAP)
    assert "holds a buffer closed with this snapshot's 10 transitions" in str(e.value)
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("snap_max", [1, 2.5, 100.0, 2 ** 53, float("nan"), float("inf"), True, "3", None])
def test_a_resigned_snapshot_max_leaf_is_refused_as_corrupt_or_judged_cleanly(tmp_path, storage, snap_max):
    """The snapshot's own recorded ``max_leaf`` crafted and re-signed: the
    snapshot is refused (a ``BigperError``), or the load is (the leaves
    changed since, whatever ``max_leaf`` says), the path untouched either way."""
    raised_run(tmp_path, storage)
    top = raised_run.top
    resign(tmp_path / SNAP, lambda body: body["state"]["meta"].__setitem__("max_leaf", snap_max))
    before = fingerprint(tmp_path)
    try:
        b = load(tmp_path / SNAP)
    except PathExistsError as e:
        assert "rewind=True" in str(e) and fingerprint(tmp_path) == before
        return
    except BigperError:
        assert fingerprint(tmp_path) == before
        return
    b.close()
    raise AssertionError(f"loaded over priorities raised since (snapshot max_leaf {snap_max!r}, live {top})")


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", ["rank-nstep3", "seq-rank-zstd", "seq-envs3-wrap", "nstep5-wrap",
                                  "stack2-zstd-nstep2-envs3-wrap"])
def test_priorities_raised_since_are_refused_in_every_shape(tmp_path, storage, case):
    """Rank and proportional, n-step, sequences, frames: a batch's priorities
    raised past the largest after the snapshot, closed: refused untouched;
    with ``rewind=True`` it loads the snapshot's count."""
    path = tmp_path / ("live.h5" if storage == "hdf5" else "live")
    buf, rows, cap, kw = build(case, storage, path)
    snap = buf.save(tmp_path / "snap")
    buf.update_priorities(buf.sample(2), np.full(2, 50.0))
    buf.close()
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="rewind=True"):
        load(snap)
    assert fingerprint(tmp_path) == before
    load(snap, rewind=True).close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", ["rank-nstep2-envs3-wrap", "seq-stack4-autoreset", "nstep4-envs3-wrap",
                                  "capacity1-nstep3", "empty-nstep3"])
def test_a_loaded_buffer_closed_untouched_or_after_sampling_loads_again_without_rewind(tmp_path, storage, case):
    """A snapshot loaded, closed untouched; loaded, sampled, closed; loaded
    with ``continue_episodes``: each time the same snapshot loads again
    without ``rewind`` (ending the open episodes at a load raises no leaf)."""
    path = tmp_path / ("live.h5" if storage == "hdf5" else "live")
    buf, rows, cap, kw = build(case, storage, path)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    for step in ("untouched", "sampled", "continued", "again"):
        b = load(snap, continue_episodes=step == "continued")
        if step == "sampled" and len(b):
            b.sample(2)
        b.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_load_latest_refuses_a_path_with_priorities_raised_after_its_newest(tmp_path, storage):
    """``Snapshots.load_latest``: the newest snapshot at the live count,
    priorities raised after it -> PathExistsError (no fall back to an older
    snapshot, nothing changed); saved again right before close -> loads."""
    live = live_of(storage, tmp_path)
    snaps = bigper.Snapshots(tmp_path / "snaps", keep=None)
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0)
    for t in range(8):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snaps.save(b)
    b.update_priorities(np.array([2]), np.array([4.0]))
    snaps.save(b)
    b.update_priorities(np.array([3]), np.array([9.0]))
    b.close()
    before = fingerprint(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall back
        with pytest.raises(PathExistsError, match="rewind=True"):
            snaps.load_latest()
    assert fingerprint(tmp_path) == before
    r = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0, mode="resume")
    snaps.save(r)  # a snapshot right before close
    r.close()
    got = snaps.load_latest()
    assert len(got) == 8
    got.close()


def test_sb3_load_replay_buffer_refuses_priorities_raised_since_and_keeps_the_models_buffer(tmp_path):
    """The SB3 drop-in in process: save_replay_buffer, a priority raised on
    the model's open buffer, load_replay_buffer of that pickle -> refused,
    the model keeps its buffer, open and writable; rewind=True loads."""
    pytest.importorskip("stable_baselines3")
    from tests.integrations.test_sb3_resume import add, model
    m = model(replay_buffer_kwargs={"storage": "memmap", "path": str(tmp_path / "replay")})
    rb = m.replay_buffer
    for t in range(5):
        add(rb, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "replay")
    rb.update_priorities(np.array([1]), np.array([7.0]))
    with pytest.raises(PathExistsError, match="rewind=True"):
        m.load_replay_buffer(tmp_path / "ckpt" / "replay.pkl")
    assert m.replay_buffer is rb and not rb.closed
    add(rb, 5, 1.0)  # still writable
    with pytest.warns(UserWarning, match="discarded"):
        m.load_replay_buffer(tmp_path / "ckpt" / "replay.pkl", rewind=True)
    assert m.replay_buffer is not rb
    m.replay_buffer.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_two_threads_loading_one_snapshot_into_one_path(tmp_path, storage):
    """One wins, the other is ``StorageLockedError``; after the winner's
    close the snapshot loads again without rewind."""
    live = live_of(storage, tmp_path)
    run_folder(tmp_path, storage=storage, live_rel=live.name, more=0)
    out, gate = [], threading.Barrier(2)

    def go():
        gate.wait()
        try:
            out.append(load(tmp_path / SNAP))
        except BigperError as e:
            out.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    bufs = [o for o in out if isinstance(o, bigper.PrioritizedReplayBuffer)]
    errs = [o for o in out if not isinstance(o, bigper.PrioritizedReplayBuffer)]
    assert len(bufs) == 1 and len(errs) == 1 and isinstance(errs[0], StorageLockedError), out
    bufs[0].close()
    load(tmp_path / SNAP).close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
def test_priorities_raised_below_the_largest_ever_are_not_silently_rewound(tmp_path, storage, prioritization):
    """Priorities lowered to 0.01 before the snapshot, raised to 0.9 after
    (below the largest leaf ever, 1.0), closed: a load must not discard them.
    (Was a strict xfail for rank: its heap was not compared, only its
    largest leaf ever.)"""
    live = live_of(storage, tmp_path)
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0, prioritization=prioritization)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    b.update_priorities(np.arange(10), np.full(10, 0.01))
    snap = b.save(tmp_path / "snap")
    b.update_priorities(np.arange(10), np.full(10, 0.9))
    b.close()
    before = fingerprint(tmp_path)
    try:
        load(snap).close()
    except PathExistsError:
        assert fingerprint(tmp_path) == before
        return
    pytest.fail("the priorities raised since were silently discarded")


@pytest.mark.parametrize("what", ["dense past any state", "sparse 64 MiB", "fifo", "symlink", "not npy",
                                  "wrong dtype", "wrong shape"])
def test_a_crafted_recorded_leaves_file_is_never_trusted(tmp_path, what):
    """The leaves a closed memmap buffer recorded (``state/leaves.npy``),
    read before the takeover to compare with the snapshot's: a file larger
    than any state of the buffer's capacity, a sparse one, a FIFO, a symlink,
    bytes that are no ``.npy``, another dtype or shape. Never read past what
    it can hold, never a hang or a crash: the load goes on (the comparison
    left out) or is refused with the folder unchanged."""
    import os

    live = tmp_path / "replay"
    b = bigper.PrioritizedReplayBuffer(50, F, storage="memmap", path=live, seed=0)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snap = b.save(tmp_path / "snap")
    b.update_priorities(np.array([1, 2]), np.array([0.3, 0.2]))
    b.close()
    leaves = live / "state" / "leaves.npy"
    if what == "dense past any state":
        with open(leaves, "ab") as f:
            f.write(b"\0" * (64 * 1100))
    elif what == "sparse 64 MiB":
        os.truncate(leaves, 64 << 20)  # (the fingerprint reads it: not GiBs)
    elif what == "fifo":
        leaves.unlink()
        os.mkfifo(leaves)
    elif what == "symlink":
        (tmp_path / "elsewhere.npy").write_bytes(leaves.read_bytes())
        leaves.unlink()
        os.symlink(tmp_path / "elsewhere.npy", leaves)
    elif what == "not npy":
        leaves.write_bytes(b"\x93NUMPY garbage" * 10)
    else:
        np.save(leaves, np.zeros(50, np.float32) if what == "wrong dtype" else np.zeros(49, np.float64))
    _load_outcome(tmp_path, snap, refused=BigperError)


@pytest.mark.parametrize("what", ["external fifo", "external /dev/zero", "external same bytes", "float32",
                                  "2-d", "huge declared gzip", "-0.0 for 0.0", "changed, chunked gzip"])
def test_a_crafted_hdf5_recorded_leaves_dataset_is_never_trusted(tmp_path, what):
    """The leaves a closed HDF5 buffer recorded (``/_bigper/state/leaves``),
    read before the takeover: a dataset whose bytes live in an external file
    (a FIFO blocked the load forever: fixed, storage outside the file is not
    read), another dtype or shape, a huge declared shape, chunked and
    compressed. Never a hang; the load goes on or is refused, file unchanged."""
    import os

    h5py = pytest.importorskip("h5py")
    live = tmp_path / "replay.h5"
    b = bigper.PrioritizedReplayBuffer(50, F, storage="hdf5", path=live, seed=0)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    snap = b.save(tmp_path / "snap")
    b.close()
    ext = tmp_path / "ext.bin"
    with h5py.File(live, "a") as f:
        g = f["_bigper/state"]
        old = g["leaves"][()]
        del g["leaves"]
        x = old.copy()
        if what.startswith("external"):
            if what == "external fifo":
                os.mkfifo(ext)
            elif what == "external same bytes":
                old.tofile(ext)
            src = "/dev/zero" if what == "external /dev/zero" else str(ext)
            g.create_dataset("leaves", shape=old.shape, dtype=old.dtype, external=[(src, 0, h5py.h5f.UNLIMITED)])
        elif what == "huge declared gzip":
            g.create_dataset("leaves", shape=(10 ** 12,), dtype=old.dtype, chunks=(1024,), compression="gzip")
        elif what == "float32":
            g.create_dataset("leaves", data=old.astype(np.float32))
        elif what == "2-d":
            g.create_dataset("leaves", data=old.reshape(1, -1))
        elif what == "-0.0 for 0.0":
            x[x == 0] = -0.0
            g.create_dataset("leaves", data=x)
        else:
            x[3] *= 1.0000001
            g.create_dataset("leaves", data=x, chunks=(7,), compression="gzip", shuffle=True, fletcher32=True)
    got = _load_outcome(tmp_path, snap, refused=BigperError)
    assert (got == "refused") == (what == "changed, chunked gzip"), (what, got)  # (only a changed leaf is seen)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", ["seq-envs3-wrap", "stack2-zstd-nstep2-envs3-wrap", "nstep5-wrap"])
def test_a_sampled_items_priority_changed_after_the_snapshot_is_refused(tmp_path, storage, case):
    """Sequences, several envs, compressed frames, a wrapped ring: the item a
    sample drew, reprioritized after the snapshot, closed -> refused; unchanged."""
    path = tmp_path / ("live.h5" if storage == "hdf5" else "live")
    buf, rows, cap, kw = build(case, storage, path)
    snap = buf.save(tmp_path / "snap")
    buf.update_priorities(np.asarray(buf.sample(1).indices), np.array([123.0]))
    buf.close()
    before = fingerprint(tmp_path)
    with pytest.raises(PathExistsError, match="rewind=True"):
        load(snap)
    assert fingerprint(tmp_path) == before


def _heap_case(what, heap):
    """A crafted recorded rank heap (10 live entries of 50 slots)."""
    heap = heap.copy()
    if what == "a slot named twice":
        heap[1, 1] = (heap[1, 1] >> 31 << 31) | (heap[0, 1] & ((1 << 31) - 1))
    elif what == "a slot past capacity":
        heap[0, 1] = (heap[0, 1] >> 31 << 31) | 49_999
    elif what == "a negative word":
        heap[2, 1] = -1
    elif what == "NaN keys":
        heap[:10, 0] = np.float64("nan").view(np.int64)
    elif what == "permuted, same keys":  # (the order a sort leaves changed, no priority)
        heap[:10] = heap[:10][::-1]
    return heap


@pytest.mark.parametrize("what", ["a slot named twice", "a slot past capacity", "a negative word", "NaN keys",
                                  "permuted, same keys", "n past capacity", "n negative", "n a float",
                                  "no heap", "wrong dtype", "wrong shape"])
def test_a_crafted_recorded_rank_heap_is_never_trusted(tmp_path, what):
    """The heap a closed rank buffer recorded (``state/rank_heap.npy``) and
    its ``n`` in the recorded meta, read before the takeover to compare the
    priorities with the snapshot's: never a crash, a hang or a read past the
    heap; the load is refused with the folder unchanged, or goes on. A heap
    that names the same priorities (permuted) is no change: it loads."""
    live = tmp_path / "replay"
    b = bigper.PrioritizedReplayBuffer(50, F, storage="memmap", path=live, seed=0, prioritization="rank")
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    b.update_priorities(np.arange(10), np.linspace(0.1, 1.0, 10))
    snap = b.save(tmp_path / "snap")
    b.close()
    path = live / "state" / "rank_heap.npy"
    heap = np.load(path)
    if what.startswith("n "):
        edit_meta(live, "memmap", _set(["state", "prioritization", "n"],
                                       {"n past capacity": 51, "n negative": -1, "n a float": 10.0}[what]))
    elif what == "no heap":
        path.unlink()
    elif what in ("wrong dtype", "wrong shape"):
        np.save(path, heap.astype(np.float64) if what == "wrong dtype" else heap[:49])
    else:
        np.save(path, _heap_case(what, heap))
    assert not (_load_outcome(tmp_path, snap, refused=BigperError) == "refused" and what == "permuted, same keys")


# -- the rank heap compared at load: legitimate flows, float edges, every shape, crafted records ----------------

RANK_CASES = {  # (as test_hostile_resume.CASES, with prioritization="rank")
    "rank-nstep2-envs3-wrap": CASES["rank-nstep2-envs3-wrap"],
    "seq-rank-zstd": CASES["seq-rank-zstd"],
    "rank-stack2-zstd-nstep2-envs3-wrap": (dict(CASES["stack2-zstd-nstep2-envs3-wrap"][0], prioritization="rank"),
                                           *CASES["stack2-zstd-nstep2-envs3-wrap"][1:]),
    "rank-seq-envs3-wrap": (dict(CASES["seq-envs3-wrap"][0], prioritization="rank"), *CASES["seq-envs3-wrap"][1:]),
    "rank-seq-stack4-autoreset": (dict(CASES["seq-stack4-autoreset"][0], prioritization="rank"),
                                  *CASES["seq-stack4-autoreset"][1:]),
}


def rank_run(tmp_path, storage, before=None, after=None, capacity=12, **kw):
    """A rank buffer (``capacity`` 12: it sorts at the first sample past 12
    writes): 10 transitions, priorities 0.1 .. 1.0, ``before(b)``, a
    snapshot, ``after(b)``, closed. Returns the snapshot and whether the
    recorded heap (positions, ticks) changed since it."""
    live = live_of(storage, tmp_path)
    b = bigper.PrioritizedReplayBuffer(capacity, F, storage=storage, path=live, seed=0, prioritization="rank", **kw)
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    b.update_priorities(np.arange(10), np.linspace(0.1, 1.0, 10))
    if before is not None:
        before(b)
    snap = b.save(tmp_path / "snap")
    heap = np.array(b.state_dict()[1]["rank_heap"])
    if after is not None:
        after(b)
    moved = not np.array_equal(heap, b.state_dict()[1]["rank_heap"])
    b.close()
    return snap, moved


def _upd(slots, values):
    return lambda b: b.update_priorities(np.asarray(slots), np.asarray(values, dtype=np.float64))


UNCHANGED = {  # name: (before the snapshot, after it, buffer kwargs): no priority changes
    "a sample sorts the heap": (None, lambda b: b.sample(4), {}),
    "an explicit sort": (None, lambda b: b.prioritization.sort(), {}),
    "every priority set again, then a sort": (None, lambda b: (_upd(range(10), np.linspace(0.1, 1.0, 10))(b),
                                                             b.sample(3)), {}),
    "set again in reverse order": (None, _upd(range(9, -1, -1), np.linspace(0.1, 1.0, 10)[::-1]), {}),
    "assign_priorities, same values": (None, lambda b: b.assign_priorities(
        np.concatenate([np.linspace(0.1, 1.0, 10), np.zeros(2)])), {}),
    "0.0 -> -0.0": (_upd([3], [0.0]), _upd([3], [-0.0]), {}),
    "-0.0 -> 0.0": (_upd([3], [-0.0]), _upd([3], [0.0]), {}),
    "clipped at max_priority, raised further": (_upd([3], [5.0]), _upd([3], [9.0]), {"max_priority": 2.0}),
    "a refused update (inf)": (None, lambda b: pytest.raises(bigper.errors.InvalidArgumentError,
                                                             _upd([3], [np.inf]), b), {}),
    "a refused update (nan among valid)": (None, lambda b: pytest.raises(bigper.errors.InvalidArgumentError,
                                                                         _upd([1, 2], [0.5, np.nan]), b), {}),
}


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("what", sorted(UNCHANGED))
def test_a_rank_heap_reordered_with_no_priority_changed_loads_without_rewind(tmp_path, storage, what):
    """Between the snapshot and the close the heap moved (a sort, updates to
    the same values, ticks renumbered) or a refused update changed nothing:
    no priority of a transition changed, so the load must go on without
    ``rewind`` (a false refusal would block every resume of a rank run that
    sampled after its last snapshot)."""
    before, after, kw = UNCHANGED[what]
    snap, moved = rank_run(tmp_path, storage, before, after, **kw)
    assert moved or what.startswith("a refused"), "the case did not move the heap"
    with deadline(20):
        b = load(snap)
    assert len(b) == 10
    b.close()


CHANGED = {  # name: (before the snapshot, after it): one priority changed by the least a float can
    "0.0 -> the smallest subnormal": (_upd([3], [0.0]), _upd([3], [5e-324])),
    "the smallest subnormal -> 0.0": (_upd([3], [5e-324]), _upd([3], [0.0])),
    "1.0 -> its next float": (_upd([3], [1.0]), _upd([3], [np.nextafter(1.0, 2.0)])),
    "lowered to 0.0": (None, _upd([3], [0.0])),
    "two swapped": (None, _upd([2, 5], [0.6, 0.3])),
    "below max_priority -> at it": (_upd([3], [1.5]), _upd([3], [7.0])),
    "the largest float, clipped by no max_priority": (None, _upd([3], [np.finfo(np.float64).max])),
}


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("what", sorted(CHANGED))
def test_a_rank_priority_changed_by_the_least_step_is_refused(tmp_path, storage, what):
    """A single priority changed after the snapshot, by as little as a float
    can (a subnormal from zero, one ulp, two values swapped, so the multiset
    of keys is unchanged): refused naming rewind=True, byte for byte."""
    before, after = CHANGED[what]
    kw = {"max_priority": 2.0} if "max_priority" in what and "no max" not in what else {}
    snap, _ = rank_run(tmp_path, storage, before, after, **kw)
    before_fp = fingerprint(tmp_path)
    with deadline(20), pytest.raises(PathExistsError, match="rewind=True"):
        load(snap)
    assert fingerprint(tmp_path) == before_fp
    load(snap, rewind=True).close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", sorted(RANK_CASES))
def test_a_rank_items_priority_lowered_after_the_snapshot_is_refused_in_every_shape(tmp_path, storage, case):
    """Rank with n-step and several envs on a wrapped ring, sequences (zstd
    frames, several envs, autoreset): the item a sample drew, LOWERED after
    the snapshot (the largest leaf ever cannot show it), closed -> refused,
    byte for byte."""
    path = live_of(storage, tmp_path)
    buf, rows, cap, kw = build(case, storage, path, RANK_CASES)
    snap = buf.save(tmp_path / "snap")
    buf.update_priorities(np.asarray(buf.sample(1).indices), np.array([1e-9]))
    buf.close()
    before = fingerprint(tmp_path)
    with deadline(20), pytest.raises(PathExistsError, match="rewind=True"):
        load(snap)
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", sorted(RANK_CASES))
def test_rank_flows_that_change_no_priority_load_again_without_rewind(tmp_path, storage, case):
    """The same snapshot loaded after each of: a load closed untouched; a
    load, samples (the heap sorted), close; ``mode="resume"`` (the open
    episodes end: new items, no priority of the snapshot's changed), close;
    ``continue_episodes``; a load into another path beside it. Never a false
    refusal."""
    path = live_of(storage, tmp_path)
    buf, rows, cap, kw = build(case, storage, path, RANK_CASES)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    with deadline(60):
        for step in ("untouched", "sampled", "resumed", "continued", "elsewhere", "again"):
            if step == "resumed":
                r = bigper.PrioritizedReplayBuffer(cap, rows.fields(), storage=storage, path=path, seed=0,
                                                   gamma=0.5, mode="resume", **kw)
                if len(r):
                    r.sample(3)
                r.close()
                continue
            b = load(snap, continue_episodes=step == "continued",
                     path=(tmp_path / "other" / path.name) if step == "elsewhere" else None)
            if step == "sampled" and len(b):
                for _ in range(3):
                    b.sample(2)
                b.prioritization.sort()
            b.close()


def _rank_closed(tmp_path, storage, changed=False):
    """A rank buffer of 50 slots, 10 transitions, priorities 0.1 .. 1.0, a
    snapshot, closed (``changed``: slot 3 lowered to 0.05 after it)."""
    live = live_of(storage, tmp_path)
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0, prioritization="rank")
    for t in range(10):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
    b.update_priorities(np.arange(10), np.linspace(0.1, 1.0, 10))
    snap = b.save(tmp_path / "snap")
    if changed:
        b.update_priorities(np.array([3]), np.array([0.05]))
    b.close()
    return live, snap


def _load_or_refuse(tmp_path, snap, seconds=20):
    """'loaded' (verified 10 transitions) or 'refused' (a BigperError, the folder byte for byte as it was)."""
    before = fingerprint(tmp_path)
    with deadline(seconds):
        try:
            b = load(snap)
        except BigperError as e:
            assert fingerprint(tmp_path) == before, f"refused ({type(e).__name__}) but the folder changed"
            return "refused"
    assert len(b) == 10
    b.close()
    return "loaded"


MEMMAP_HEAPS = ["fifo", "symlink to the same heap", "dangling symlink", "directory", "empty file", "sparse 64 MiB",
                "dense past any state", "not npy", "pickled object array", "big-endian, same", "uint64, same",
                "3-d, same bytes", "fortran order, same", "fortran order, a key changed", "header declares 2**40 rows"]


@pytest.mark.parametrize("what", MEMMAP_HEAPS)
def test_a_crafted_recorded_rank_heap_file_is_never_trusted(tmp_path, what):
    """``state/rank_heap.npy`` of a closed memmap rank buffer replaced by
    what an attacker (or a broken disk) leaves: never a hang, a crash, a
    pickle load or a read past what a 50-slot state can hold; refused with
    the folder byte for byte, or the load goes on. The same heap in another
    layout bigper does not write (Fortran order) is not read: it loads."""
    import os

    live, snap = _rank_closed(tmp_path, "memmap")
    p = live / "state" / "rank_heap.npy"
    heap = np.load(p)
    if what == "fifo":
        p.unlink()
        os.mkfifo(p)
    elif what.startswith("symlink") or what == "dangling symlink":
        other = tmp_path / "elsewhere.npy"
        if what != "dangling symlink":
            other.write_bytes(p.read_bytes())
        p.unlink()
        os.symlink(other, p)
    elif what == "directory":
        p.unlink()
        p.mkdir()
    elif what == "empty file":
        p.write_bytes(b"")
    elif what == "sparse 64 MiB":
        os.truncate(p, 64 << 20)
    elif what == "dense past any state":
        with open(p, "ab") as f:
            f.write(b"\0" * (64 * 1100))
    elif what == "not npy":
        p.write_bytes(b"\x93NUMPY\x01\x00" + b"\xff" * 200)
    elif what == "pickled object array":
        np.save(p, np.array([{"x": 1}] * 100, dtype=object).reshape(50, 2), allow_pickle=True)
    elif what == "big-endian, same":
        np.save(p, heap.astype(">i8"))
    elif what == "uint64, same":
        np.save(p, heap.view(np.uint64))
    elif what == "3-d, same bytes":
        np.save(p, heap.reshape(50, 2, 1))
    elif what.startswith("fortran order"):
        h = np.asfortranarray(heap)
        if what.endswith("changed"):
            h[0, 0] = np.float64(0.123).view(np.int64)
        np.save(p, h)
    elif what == "header declares 2**40 rows":
        p.write_bytes(p.read_bytes().replace(b"(50, 2)", b"(1099511627776, 2)"))
    got = _load_or_refuse(tmp_path, snap)
    if what.startswith("fortran order") or what in ("big-endian, same", "uint64, same"):
        assert got == "loaded"


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("where,value", [
    ("n", None), ("n", "10"), ("n", True), ("n", 10.0), ("n", float("inf")), ("n", float("nan")), ("n", [10]),
    ("n", {"n": 10}), ("n", 2 ** 70), ("n", -(2 ** 70)), ("n", 0), ("n", 9), ("n", 50), ("n", KeyError),
    ("prioritization", None), ("prioritization", "rank"), ("prioritization", [10]), ("prioritization", KeyError),
    ("prioritization", {"n": 10})])
def test_a_crafted_recorded_rank_meta_is_a_clean_refusal_or_the_load_goes_on(tmp_path, storage, where, value):
    """The ``n`` of the live path's recorded rank state (how many heap rows
    hold keys), and the prioritization meta itself, of every JSON type and
    out of range: never a raw exception or a read past the heap; a refusal
    leaves the path byte for byte."""
    live, snap = _rank_closed(tmp_path, storage)
    keys = ["state", "prioritization"] + (["n"] if where == "n" else [])
    edit_meta(live, storage, _set(keys, value))
    got = _load_or_refuse(tmp_path, snap)
    if (where, value) in (("n", 10.0), ("n", "10"), ("n", None), ("n", KeyError), ("prioritization", None)):
        assert got == "loaded"  # (not decoded: no change can be shown; nothing else refuses)



HDF5_HEAPS = ["external fifo", "external same bytes", "big-endian, same", "int32", "float64 view", "compound",
              "scalar", "empty", "1-d same bytes", "a group", "soft link to a changed copy",
              "chunked gzip, same", "chunked gzip, a key changed", "huge declared, fill value"]


@pytest.mark.parametrize("what", HDF5_HEAPS)
def test_a_crafted_hdf5_recorded_rank_heap_is_never_trusted(tmp_path, what):
    """``/_bigper/state/rank_heap`` of a closed HDF5 rank buffer crafted with
    h5py: never a hang (a FIFO as external storage), a crash or a read past
    what a 50-slot state can hold; refused byte for byte or goes on. The
    same heap stored chunked and compressed is the same heap (loads); with a
    key changed it is refused; a soft link within the file is followed as
    HDF5 does (its target is the heap read)."""
    import os

    h5py = pytest.importorskip("h5py")
    live, snap = _rank_closed(tmp_path, "hdf5")
    ext = tmp_path / "ext.bin"
    with h5py.File(live, "a") as f:
        g = f["_bigper/state"]
        old = g["rank_heap"][()]
        del g["rank_heap"]
        changed = old.copy()
        changed[0, 0] = np.float64(0.123).view(np.int64)
        if what.startswith("external"):
            if what == "external fifo":
                os.mkfifo(ext)
            else:
                old.tofile(ext)
            g.create_dataset("rank_heap", shape=old.shape, dtype=old.dtype,
                             external=[(str(ext), 0, h5py.h5f.UNLIMITED)])
        elif what == "big-endian, same":
            g.create_dataset("rank_heap", data=old.astype(">i8"))
        elif what == "int32":
            g.create_dataset("rank_heap", data=old.astype(np.int32))
        elif what == "float64 view":
            g.create_dataset("rank_heap", data=old.view(np.float64))
        elif what == "compound":
            g.create_dataset("rank_heap", data=old.view([("a", "<i8"), ("b", "<i8")]).reshape(-1))
        elif what == "scalar":
            g.create_dataset("rank_heap", data=np.int64(7))
        elif what == "empty":
            g.create_dataset("rank_heap", data=h5py.Empty("<i8"))
        elif what == "1-d same bytes":
            g.create_dataset("rank_heap", data=old.reshape(-1))
        elif what == "a group":
            g.create_group("rank_heap")
        elif what == "soft link to a changed copy":
            f.create_dataset("/elsewhere", data=changed)
            g["rank_heap"] = h5py.SoftLink("/elsewhere")
        elif what.startswith("chunked gzip"):
            g.create_dataset("rank_heap", data=changed if what.endswith("changed") else old, chunks=(7, 2),
                             compression="gzip", shuffle=True, fletcher32=True)
        elif what == "huge declared, fill value":
            g.create_dataset("rank_heap", shape=(10 ** 9, 2), dtype=np.int64, chunks=(1 << 16, 2),
                             compression="gzip")
    got = _load_or_refuse(tmp_path, snap)
    if what in ("chunked gzip, same", "big-endian, same", "int32", "scalar", "empty", "a group"):
        assert got == "loaded", what
    if what in ("chunked gzip, a key changed", "soft link to a changed copy"):
        assert got == "refused", what


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_live_path_of_the_other_prioritization_is_refused_untouched(tmp_path, storage):
    """The live path holds a closed buffer of the same fields and count but
    the other prioritization (rank there, proportional in the snapshot, and
    the reverse): another config, refused before anything is read or taken
    over; with its recorded config made unreadable (an unknown key) the
    load never trusts the other strategy's arrays -- it goes on or is refused
    byte for byte, never a raw exception."""
    for live_kind, snap_kind in (("rank", "proportional"), ("proportional", "rank")):
        root = tmp_path / live_kind
        live = live_of(storage, root)
        b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=root / "snapshot-run", seed=0,
                                           prioritization=snap_kind)
        for t in range(10):
            b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
        snap = b.save(root / "snap")
        b.close()
        o = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0, prioritization=live_kind)
        for t in range(10):
            o.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
        o.update_priorities(np.arange(10), np.linspace(2.0, 0.1, 10))
        o.close()
        before = fingerprint(root)
        with deadline(20), pytest.raises(bigper.errors.IncompatibleSnapshotError, match="prioritization"):
            load(snap, path=live)
        assert fingerprint(root) == before
        edit_meta(live, storage, lambda meta: meta["config"].__setitem__("zzz", 1))
        _load_outcome(root, snap, path=live, refused=BigperError)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_crafted_recorded_capacity_does_not_lift_the_size_cap_of_the_arrays_read(tmp_path, storage, monkeypatch):
    """``previous_arrays`` reads no recorded state array larger than a state
    of the buffer's capacity can be. That capacity must be the snapshot's
    (the comparison's), not the live path's recorded one: a recorded config
    made unreadable (an unknown key: ``_check_previous`` then lets it by)
    with ``capacity`` 2**22 lifted the cap to 256 MiB, so a 20 KB HDF5 file
    declaring a (2**23, 2) heap of its fill value made the load allocate and
    fill 128 MiB (2**28: 16 GiB, the interpreter killed for memory), and a
    memmap ``rank_heap.npy`` of 32 MiB was read whole (fixed: the caller's
    capacity bounds the read, ``storage.state.state_slots``). The load goes on (the
    heap does not decode) using no more memory than a small buffer's."""
    import tracemalloc

    live, snap = _rank_closed(tmp_path, storage)
    rows = 1 << 23 if storage == "hdf5" else 1 << 21

    def crafted(meta):
        meta["config"]["capacity"] = 1 << 22
        meta["config"]["zzz"] = 1

    edit_meta(live, storage, crafted)
    if storage == "hdf5":
        import h5py
        with h5py.File(live, "a") as f:
            del f["_bigper/state/rank_heap"]
            f["_bigper/state"].create_dataset("rank_heap", shape=(rows, 2), dtype=np.int64, chunks=(1 << 16, 2),
                                              compression="gzip")
    else:
        np.save(live / "state" / "rank_heap.npy", np.zeros((rows, 2), np.int64))
    import bigper.storage.state as state_mod

    read = []
    real = state_mod.read_regular
    monkeypatch.setattr(state_mod, "read_regular", lambda p, **kw: read.append(p) or real(p, **kw))
    tracemalloc.start()
    try:
        load(snap, path=tmp_path / "other" / live.name).close()  # (what a load takes anyway: its copy buffers)
        base = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        read.clear()
        with deadline(20):
            b = load(snap)  # (goes on: the heap does not decode)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(b) == 10
    b.close()
    assert not [p for p in read if Path(p).name == "rank_heap.npy"], "the crafted 32 MiB heap was read"
    assert peak < base + (4 << 20), f"the load took {peak >> 20} MiB ({base >> 20} MiB into a new path)"


@pytest.mark.parametrize("change", ["untouched", "lowered"])
@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_what_a_resume_made_sampleable_is_compared_as_a_load_makes_it(tmp_path, case, storage, change):
    """Every shape of the matrix: a snapshot with windows or items still
    open (pending), closed; a ``mode="resume"`` ends them (they become
    sampleable with the key the snapshot kept pending for them), closed
    untouched: a load without ``rewind`` goes on (it gives them the same
    keys: nothing is discarded). Lowered after the resume instead: refused,
    the folder byte for byte as it was, where there was a pending one (was a
    silent discard: only the slots live at the snapshot were compared)."""
    from tests import hook
    from tests.snapshot.test_hostile_resume import reopen

    path = tmp_path / ("live.h5" if storage == "hdf5" else "live")
    buf, rows, cap, kw = build(case, storage, path)
    pending = np.flatnonzero(hook.unit(buf).status == bigper.common.status.PENDING)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    r = reopen(cap, rows.fields(), kw, storage, path)
    made = pending[hook.unit(r).status[pending] == bigper.common.status.LIVE]
    if change == "lowered" and made.size:
        r.update_priorities(made, np.full(made.size, 1e-3))
    r.close()
    before = fingerprint(tmp_path)
    with deadline(60):
        if change == "lowered" and made.size:
            with pytest.raises(PathExistsError, match="rewind=True"):
                load(snap)
            assert fingerprint(tmp_path) == before
        else:
            load(snap).close()


# -- the slots pending at the snapshot: flows that change nothing, changes that must be seen, a crafted status --

PEND = {
    # name: (buffer kwargs, envs, steps); the last step of every env leaves its episode open
    "nstep3": (dict(n_step=3), 1, 10),
    "rank-nstep3-sort1": (dict(n_step=3, prioritization="rank"), 1, 10),
    "nstep3-maxp": (dict(n_step=3, max_priority=0.3), 1, 10),
    "nstep3-alpha-eps": (dict(n_step=3, alpha=0.37, eps=1e-7), 1, 10),
    "nstep4-envs3": (dict(n_step=4), 3, 10),  # some episodes of the three ended, others open
    "seq-burnin-period": (dict(sequence=bigper.Sequence(length=4, burn_in=2, period=3)), 1, 10),
    "seq-rank-envs3": (dict(sequence=bigper.Sequence(length=4, burn_in=1, period=2), prioritization="rank"), 3, 10),
}


def _pend_build(name, storage, root, lower=None):
    """A buffer of shape ``name`` (40 slots) with pending slots; ``lower``: their
    keys set to ``lower`` (and a few live ones') before the snapshot, so the keys
    the snapshot keeps pending are not all the largest. Returns
    ``(buf, reopen(**extra), pending slots, snapshot path)``, the buffer still open."""
    from tests import hook
    from tests.snapshot.test_hostile_resume import Rows

    kw, E, steps = PEND[name]
    rows = Rows(E=E, seed=3, p_end=0.2 if E > 1 else 0.0)
    path = live_of(storage, root)
    b = bigper.PrioritizedReplayBuffer(40, rows.fields(), storage=storage, path=path, seed=0, gamma=0.5,
                                       num_envs=E, **kw)
    if kw.get("prioritization") == "rank":
        b.prioritization.sort_every = 1  # (recorded: a sort at every sample, on the resumed buffer too)
    rows.feed(b, steps)
    pending = np.flatnonzero(hook.unit(b).status == PENDING)
    assert pending.size, "the shape leaves nothing pending"
    if lower is not None:
        b.update_priorities(pending, np.full(pending.size, lower))
        b.update_priorities(np.flatnonzero(hook.unit(b).status == LIVE)[:2], np.array([0.1234567, 7e-5]))
    if kw.get("prioritization") == "rank":
        b.sample(4)
    snap = b.save(root / "snap")

    def again(**extra):
        return bigper.PrioritizedReplayBuffer(40, rows.fields(), storage=storage, path=path, seed=0, gamma=0.5,
                                              num_envs=E, mode="resume", **kw, **extra)
    return b, again, pending, snap


LIVE, PENDING = bigper.common.status.LIVE, bigper.common.status.PENDING
FLOWS = ["resume continuing", "resume, sample", "resume twice", "load twice", "load continuing",
         "resume continuing, then resume", "pending keys lowered, then resume"]


@pytest.mark.parametrize("name,storage", [(n, "memmap") for n in sorted(PEND) if n != "nstep3"]
                         + [("seq-rank-envs3", "hdf5")])
def test_flows_that_change_nothing_load_the_snapshot_without_rewind(tmp_path, name, storage):
    """Nothing set since the snapshot, whatever reopened the live path: a
    resume with ``continue_episodes=True`` (the pending slots stay pending),
    a resume then samples (a rank sort at every one), two resumes, the
    snapshot loaded and closed twice, loaded continuing its episodes; pending
    keys below the largest (clipped by ``max_priority``, rounded by alpha and
    eps); several envs of which only some left an episode open; sequence items
    with a burn-in and a period. Each time the snapshot loads again without
    ``rewind``, continuing or not."""
    for i, flow in enumerate(FLOWS):
        root = tmp_path / str(i)
        b, again, pending, snap = _pend_build(name, storage, root, lower=0.0123 if "lowered" in flow else None)
        b.close()
        if flow.startswith("resume continuing"):
            again(continue_episodes=True).close()
        if flow in ("resume, sample", "resume twice", "resume continuing, then resume",
                    "pending keys lowered, then resume"):
            r = again()
            if flow == "resume, sample":
                for _ in range(3):
                    r.sample(4)
            r.close()
        if flow == "resume twice":
            again().close()
        if flow.startswith("load"):
            for _ in range(2):
                load(snap, continue_episodes=flow == "load continuing").close()
        with deadline(20):
            load(snap).close()
            load(snap, continue_episodes=True).close()


def _refused(root, snap):
    before = fingerprint(root)
    with deadline(20), pytest.raises(PathExistsError, match="rewind=True"):
        load(snap)
    assert fingerprint(root) == before
    with deadline(20), pytest.raises(PathExistsError, match="rewind=True"):
        load(snap, continue_episodes=True)
    assert fingerprint(root) == before


@pytest.mark.parametrize("name,storage", [("nstep3", "memmap"), ("rank-nstep3-sort1", "memmap"),
                                          ("seq-burnin-period", "memmap"), ("seq-burnin-period", "hdf5")])
@pytest.mark.parametrize("when", [
    "before close", "after a continuing resume", "raised after a resume", "set to the largest ever after a resume"])
def test_a_priority_set_since_on_a_slot_pending_at_the_snapshot_is_refused(tmp_path, name, storage, when):
    """Pending keys lowered to 0.0123 before the snapshot; after it, one of
    those slots (an n-step window, a sequence item) set: on the open buffer
    (still pending at close), after a resume that continued the episode
    (still pending), raised to 0.5 (below the largest ever: only the key
    comparison sees it) after a resume made it live, or set to exactly the
    largest leaf ever. Each is newer than the snapshot: refused, byte for byte.
    (Was a silent discard for a slot still pending at close, with no resume
    or a continuing one: its status showed it pending, the leaves/heap hold
    no key for it, and the recorded pending key it changed was never read;
    fixed: compared with the snapshot's pending key.)"""
    from tests import hook

    b, again, pending, snap = _pend_build(name, storage, tmp_path, lower=0.0123)
    top = b.state_dict()[0]["max_leaf"]
    slot = pending[-1:]
    if when == "before close":
        b.update_priorities(slot, np.array([0.5]))
        b.close()
    else:
        b.close()
        r = again(continue_episodes=when == "after a continuing resume")
        assert hook.unit(r).status[slot[0]] == (PENDING if "continuing" in when else LIVE)
        if when == "set to the largest ever after a resume":
            rank = PEND[name][0].get("prioritization") == "rank"
            r.update_priorities(slot, np.array([top if rank else 1.0 - 1e-6]))  # (leaf (p + eps) ** alpha = 1.0)
            assert r.state_dict()[0]["max_leaf"] == top  # (not raised: only the key comparison sees it)
        else:
            r.update_priorities(slot, np.array([0.5]))
        r.close()
    _refused(tmp_path, snap)


STATUS_FILES = ["int64, same values", "2-d, same bytes", "one slot short", "values 4..255", "all LIVE",
                "all PENDING", "fifo", "symlink to the same", "not npy", "directory", "sparse 64 MiB"]
def _craft_status(p: Path, what: str, status: np.ndarray) -> None:
    import os

    if what == "int64, same values":
        np.save(p, status.astype(np.int64))
    elif what == "2-d, same bytes":
        np.save(p, status.reshape(1, -1))
    elif what == "one slot short":
        np.save(p, status[:-1])
    elif what == "values 4..255":
        np.save(p, np.where(status == LIVE, 200, 4).astype(np.uint8))
    elif what in ("all LIVE", "all PENDING"):
        np.save(p, np.full_like(status, LIVE if what == "all LIVE" else PENDING))
    elif what == "fifo":
        p.unlink()
        os.mkfifo(p)
    elif what == "symlink to the same":
        other = p.parent.parent.parent / "elsewhere.npy"
        other.write_bytes(p.read_bytes())
        p.unlink()
        os.symlink(other, p)
    elif what == "not npy":
        p.write_bytes(b"\x93NUMPY\x01\x00" + b"\x07" * 90)
    elif what == "directory":
        p.unlink()
        p.mkdir()
    elif what == "sparse 64 MiB":
        os.truncate(p, 64 << 20)


@pytest.mark.parametrize("change", ["none", "a live slot's"])
@pytest.mark.parametrize("what,name", [(w, "nstep3") for w in STATUS_FILES]
                         + [(w, "seq-burnin-period") for w in ("values 4..255", "all LIVE", "not npy")])
def test_a_crafted_recorded_status_file_never_hides_a_change_nor_hangs(tmp_path, what, change, name):
    """``state/status.npy`` (``seq_status.npy``) of a closed memmap buffer
    whose resume made the snapshot's pending slots live, replaced by what an
    attacker or a broken disk leaves: never a hang or a crash; refused with
    the folder byte for byte, or loaded. Where a slot live at the snapshot had
    its priority changed since, refused whatever the status file is (the
    status only decides the pending slots' comparison). (Was a silent
    discard: the status was read in one ``previous_arrays`` call with the
    leaves, and one that did not read -- not ``.npy``, too large -- made the
    whole call None, the leaves comparison left out with it; fixed: each
    array read on its own.)"""
    from tests import hook

    b, again, pending, snap = _pend_build(name, "memmap", tmp_path, lower=0.0123)
    key = hook.unit(b).status_key
    b.close()
    r = again()
    if change != "none":
        r.update_priorities(np.flatnonzero(hook.unit(r).status == LIVE)[:1], np.array([0.0042]))
    r.close()
    p = tmp_path / "replay" / "state" / f"{key}.npy"
    _craft_status(p, what, np.load(p))
    got = _load_outcome(tmp_path, snap)
    if change != "none":
        assert got == "refused", "a priority changed since was discarded"
    elif what in ("int64, same values", "2-d, same bytes", "one slot short", "values 4..255", "all PENDING"):
        assert got == "loaded", what  # (not trusted, or shows nothing changed)


HDF5_STATUS = ["a group", "compound", "float64, same values", "all LIVE", "external fifo", "external same bytes",
               "soft link to an all-LIVE copy", "huge declared"]


@pytest.mark.parametrize("change", ["none", "a live slot's"])
@pytest.mark.parametrize("what", HDF5_STATUS)
def test_a_crafted_hdf5_recorded_status_never_hides_a_change_nor_hangs(tmp_path, what, change):
    """``/_bigper/state/status`` of a closed HDF5 buffer crafted with h5py
    (after a resume made the snapshot's pending slots live): never a hang (a
    FIFO as external storage), a crash; refused byte for byte or loaded; a
    priority changed since at a slot live at the snapshot refused whatever
    the dataset is. (Was a silent discard where the dataset did not read --
    a group, compound, a huge declared shape -- as for the memmap file.)
    A dataset stored outside the file leaves the whole record unread
    (``check_links``: no byte from elsewhere): the load goes on there."""
    import os

    h5py = pytest.importorskip("h5py")
    b, again, pending, snap = _pend_build("nstep3", "hdf5", tmp_path, lower=0.0123)
    b.close()
    r = again()
    if change != "none":
        r.update_priorities(np.flatnonzero(r.status == LIVE)[:1], np.array([0.0042]))
    r.close()
    ext = tmp_path / "ext.bin"
    with h5py.File(tmp_path / "replay.h5", "a") as f:
        g = f["_bigper/state"]
        old = g["status"][()]
        del g["status"]
        if what == "a group":
            g.create_group("status")
        elif what == "compound":
            g.create_dataset("status", data=old.view([("a", "u1")]))
        elif what == "float64, same values":
            g.create_dataset("status", data=old.astype(np.float64))
        elif what == "all LIVE":
            g.create_dataset("status", data=np.full_like(old, LIVE))
        elif what.startswith("external"):
            if what == "external fifo":
                os.mkfifo(ext)
            else:
                old.tofile(ext)
            g.create_dataset("status", shape=old.shape, dtype=old.dtype, external=[(str(ext), 0, h5py.h5f.UNLIMITED)])
        elif what == "soft link to an all-LIVE copy":
            f.create_dataset("/elsewhere", data=np.full_like(old, LIVE))
            g["status"] = h5py.SoftLink("/elsewhere")
        elif what == "huge declared":
            g.create_dataset("status", shape=(10 ** 12,), dtype=np.uint8, chunks=(1 << 16,), compression="gzip")
    got = _load_outcome(tmp_path, snap)
    if change != "none" and not what.startswith("external"):
        # (a dataset stored outside the file makes the file's record unread as a whole: check_links)
        assert got == "refused", "a priority changed since was discarded"
    elif what in ("float64, same values", "compound", "a group"):
        assert got == "loaded", what


# -- previous_arrays and _check_newer under races, moved folders, odd entries, capacity limits ---------------


def test_a_recorded_state_file_grown_after_its_size_was_looked_at_is_held_to_the_limit(tmp_path, monkeypatch):
    """``MemmapStorage.previous_arrays`` measures each file by name, then reads
    it: a file grown (or swapped for a larger one) in between was read up to
    a TiB (``load_state_dir``'s own limit). Now the limit holds on the file
    opened too: never more than a state of the capacity is read."""
    import bigper.storage.memmap as mm
    import bigper.storage.state as st

    live = raised_run(tmp_path, "memmap")
    limit = st.STATE_BYTES_PER_SLOT * (50 + 1024)
    read, original, read_regular = [], mm.load_state_dir, st.read_regular

    def grown_then_read(path, names=None, **kw):
        with open(path / "leaves.npy", "ab") as f:  # (dense: no hole check to stop it)
            f.write(b"\1" * (limit + 4096))
        return original(path, names, **kw)

    def recorded(p, **kw):
        out = read_regular(p, **kw)
        read.append(len(out))
        return out

    monkeypatch.setattr(mm, "load_state_dir", grown_then_read)
    monkeypatch.setattr(st, "read_regular", recorded)
    with deadline(20):
        try:
            load(tmp_path / SNAP).close()
        except PathExistsError:
            pass
    assert all(n <= limit for n in read), (read, limit)
    assert live.exists()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_load_racing_a_resume_of_its_path_never_discards_the_priorities_set_since(tmp_path, storage):
    """One thread loads the snapshot into the live path (closed at the
    snapshot's count, a priority raised since) while another resumes that
    path: the load is refused (locked, or the change seen), the resume opens
    or is locked out, and the raised priority is still there after."""
    for i in range(3):
        root = tmp_path / str(i)
        root.mkdir()
        live = raised_run(root, storage)
        top = raised_run.top
        out, gate = {}, threading.Barrier(2)

        def loader():
            gate.wait()
            try:
                out["load"] = load(root / SNAP)
            except BigperError as e:
                out["load"] = e

        def resumer():
            gate.wait()
            try:
                out["resume"] = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0,
                                                               mode="resume")
            except BigperError as e:
                out["resume"] = e

        threads = [threading.Thread(target=loader), threading.Thread(target=resumer)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for v in out.values():
            if isinstance(v, bigper.PrioritizedReplayBuffer):
                v.close()
        assert isinstance(out["load"], (PathExistsError, StorageLockedError)), out
        assert isinstance(out["resume"], (bigper.PrioritizedReplayBuffer, StorageLockedError)), out
        _assert_resumes_with_top(storage, live, top)


def _assert_resumes_with_top(storage, live, top) -> None:
    """The run folder ``live`` resumes with the largest priority ``top`` (the writer's, kept)."""
    r = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0, mode="resume")
    try:
        assert r.state_dict()[0]["max_leaf"] == top
    finally:
        r.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_load_racing_the_close_of_the_writer_never_discards_what_it_closed_with(tmp_path, storage):
    """A writer (a priority raised after the snapshot, equal count) closes in
    one thread while another loads the snapshot into its path again and
    again: each load is locked out or refused, none ever replaces the path."""
    live = live_of(storage, tmp_path)
    b = run_folder(tmp_path, storage=storage, live_rel=live.name, more=0, close=False)
    b.update_priorities(np.array([4]), np.array([3.0]))
    top = b.state_dict()[0]["max_leaf"]
    outcomes, closed = [], threading.Event()

    def closer():
        b.close()
        closed.set()

    def loader():  # (no SIGALRM deadline off the main thread: bounded by its tries)
        for _ in range(2000):
            done = closed.is_set()
            try:
                got = load(tmp_path / SNAP)
            except BigperError as e:
                got = e
            outcomes.append(got)
            if isinstance(got, bigper.PrioritizedReplayBuffer):
                got.close()
                return
            if done:
                return

    t1, t2 = threading.Thread(target=loader), threading.Thread(target=closer)
    t1.start()
    t2.start()
    t2.join(30)
    t1.join(30)
    assert outcomes and all(isinstance(o, (StorageLockedError, PathExistsError)) for o in outcomes), outcomes
    assert isinstance(outcomes[-1], PathExistsError)
    _assert_resumes_with_top(storage, live, top)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_chdir_while_the_recorded_state_is_read_compares_the_path_named_at_the_call(tmp_path, storage, monkeypatch):
    """``load(snap, path="replay")`` relative, the working folder changed
    (another thread's ``os.chdir``) just as the recorded priorities are read,
    to a folder holding a decoy "replay" closed as the snapshot: the load
    compares the path it was given (a priority raised since: refused) and
    leaves the decoy as it was."""
    from bigper.storage import storage_class

    decoy = tmp_path / "decoy"
    decoy.mkdir()
    run_folder(decoy, storage=storage, live_rel=live_of(storage, decoy).name, more=0)
    live = raised_run(tmp_path, storage)
    monkeypatch.chdir(tmp_path)
    cls = storage_class(storage)
    original = cls.previous_arrays

    def moved(self, *a, **kw):
        os.chdir(decoy)
        return original(self, *a, **kw)

    monkeypatch.setattr(cls, "previous_arrays", moved)
    before, decoy_before = fingerprint(live.parent / "ckpt"), fingerprint(decoy)
    with deadline(20), pytest.raises(PathExistsError, match="priorities changed since"):
        load(tmp_path / SNAP, path=live.name).close()
    assert fingerprint(decoy) == decoy_before and fingerprint(live.parent / "ckpt") == before


def _moved_state(live: Path, elsewhere: Path, how: str) -> None:
    """The closed memmap buffer's ``state/`` made odd: a symlink to a copy
    elsewhere, a regular file, or its arrays replaced by folders."""
    import shutil

    state = live / "state"
    if how == "symlink to a copy":
        shutil.copytree(state, elsewhere / "state")
        shutil.rmtree(state)
        os.symlink(elsewhere / "state", state)
    elif how == "symlink to a changed copy":  # (elsewhere holds the snapshot's priorities: a decoy)
        shutil.copytree(state, elsewhere / "state")
        shutil.rmtree(state)
        os.symlink(elsewhere / "state", state)
        np.save(elsewhere / "state" / "leaves.npy", np.zeros(50))
    elif how == "a regular file":
        shutil.rmtree(state)
        state.write_bytes(b"state")
    elif how == "empty":
        shutil.rmtree(state)
        state.mkdir()
    else:  # "<name>.npy a folder"
        name = how.split(".npy")[0]
        (state / f"{name}.npy").unlink()
        (state / f"{name}.npy").mkdir()


STATE_SHAPES = ["symlink to a copy", "symlink to a changed copy", "a regular file", "empty",
                "leaves.npy a folder", "status.npy a folder", "pending.npy a folder"]


@pytest.mark.parametrize("how", STATE_SHAPES)
@pytest.mark.parametrize("value", [3.0, 0.125], ids=["raised", "lowered"])
def test_a_recorded_state_folder_moved_or_replaced_is_a_clean_outcome_and_nothing_elsewhere_is_written(tmp_path,
                                                                                                       how, value):
    """The live path's ``state/`` (priority raised since the snapshot) a
    symlink to elsewhere, a file, empty, or an array's file a folder (what
    root cannot be kept from reading by a chmod): the load is refused with
    everything as it was, or goes on; the folder elsewhere is never written
    (not at the load, not at the loaded buffer's close). (An emptied
    ``state/`` with a priority lowered loads: nothing recorded to compare, by
    design -- each array that does not read leaves out its comparison.)"""
    live = raised_run(tmp_path, "memmap", value)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _moved_state(live, elsewhere, how)
    before = fingerprint(elsewhere)
    outcome = _load_outcome(tmp_path, tmp_path / SNAP, refused=BigperError)
    assert fingerprint(elsewhere) == before, outcome
    if value == 3.0 or how in ("leaves.npy a folder", "status.npy a folder"):
        assert outcome == "refused"  # (the largest leaf ever raised, or the leaves read: the change is seen)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("change", [False, True])
def test_a_one_slot_buffer_is_compared_at_its_one_slot(tmp_path, storage, change):
    """capacity=1, full: a priority changed since the snapshot is refused;
    none changed loads without rewind."""
    live = live_of(storage, tmp_path)
    b = bigper.PrioritizedReplayBuffer(1, F, storage=storage, path=live, seed=0)
    for t in range(3):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=True)
    snap = b.save(tmp_path / "snap")
    if change:
        b.update_priorities(np.array([0]), np.array([0.25]))
    b.close()
    assert _load_outcome(tmp_path, snap) == ("refused" if change else "loaded")


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
def test_a_large_capacity_with_few_transitions_is_compared_at_each(tmp_path, storage, prioritization):
    """capacity 2**17, three transitions: the one priority lowered since the
    snapshot is refused; the arrays read are held to the capacity's size."""
    live = live_of(storage, tmp_path)
    b = bigper.PrioritizedReplayBuffer(1 << 17, F, storage=storage, path=live, seed=0, prioritization=prioritization)
    for t in range(3):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=t == 2)
    snap = b.save(tmp_path / "snap")
    b.update_priorities(np.array([1]), np.array([0.5]))
    b.close()
    assert _load_outcome(tmp_path, snap) == "refused"


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_previous_arrays_called_with_any_wanted_and_capacity_never_raises(tmp_path, storage):
    """``StorageBase.previous_arrays(wanted, capacity=)`` on a store opened for
    a takeover of a closed buffer, with ``wanted`` of odd types (a str, empty,
    unknown names) and ``capacity`` at and past its limits (0, 1, negative,
    bool, 10**30, float, str, numpy int): None or the named arrays, read as
    recorded; never an exception; the folder unchanged."""
    from bigper.storage import storage_class

    live = raised_run(tmp_path, storage)
    if storage == "memmap":
        cfg = json.loads((live / "meta.json").read_text())["config"]
    else:
        import h5py
        with h5py.File(live, "r") as f:
            cfg = json.loads(f["_bigper"].attrs["meta"])["config"]
    before = fingerprint(tmp_path)
    store = storage_class(storage).restoring(live, {})
    store.open(cfg)
    try:
        for wanted in (None, ("leaves",), ["leaves"], "leaves", "s", (), ("nope",), ("leaves", "leaves")):
            for cap in (None, 0, 1, 50, -1, True, False, 10 ** 30, 2.5, "50", np.int64(50), np.uint8(1)):
                got = store.previous_arrays(wanted, capacity=cap)
                assert got is None or (isinstance(got, dict) and all(isinstance(v, np.ndarray)
                                                                      for v in got.values())), (wanted, cap)
                if got and "leaves" in got:
                    assert got["leaves"].shape == (50,) and got["leaves"].dtype == np.float64
    finally:
        store.abort()
    assert fingerprint(tmp_path) == before
