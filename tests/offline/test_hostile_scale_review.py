"""Hostile review of f094d8e: stream_transitions(recycle=), in_order(), convert's copy
inside in_order, and convert_dqn's check of the recorded state before the HDF5 copy."""

from __future__ import annotations

import os
import threading

import h5py
import numpy as np
import pytest

import bigper
import bigper.convert_dqn as cdqn
from bigper.convert import convert
from bigper.convert_dqn import convert_dqn_replay
from bigper.errors import BigperError, CorruptSnapshotError, InvalidArgumentError
from bigper.offline.dqn_replay import open_run, prefetch_frames, scan_run, stream_transitions
from bigper.offline.h5source import H5Source, in_order

from tests._hostile_snapshot_cases import fingerprint
from tests.offline._dqn_replay_files import K, reference, two_checkpoints
from tests.offline.test_convert import assert_same_transitions, everything, write_d4rl


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return two_checkpoints(tmp_path_factory.mktemp("atk2") / "run")


def gunzips():
    return [t for t in threading.enumerate() if t.name == "bigper-gunzip" and t.is_alive()]


def collect(run, ck, recycle, own_prefetch, rows=64):
    fd = open_run(run)
    pf = prefetch_frames(fd, ck, K, rows=rows) if own_prefetch else None
    try:
        dicts = list(stream_transitions(fd, ck, K, chunk=50, rows=rows, prefetch=pf, recycle=recycle))
        if recycle:  # only the last dict holds: nothing is compared from the list
            return None
        return {k: np.concatenate([d[k] for d in dicts]) for k in ("obs", "next_obs", "action", "reward")}
    finally:
        if pf is not None:
            pf.close()
        os.close(fd)


# 1. stream_transitions(recycle=)

@pytest.mark.parametrize("own_prefetch", [False, True])
def test_every_kept_dict_holds_without_recycle_even_with_a_callers_prefetch(run, own_prefetch):
    for ck in scan_run(run):
        got, ref = collect(run, ck, False, own_prefetch), reference(run, ck.n)
        for k in got:
            assert np.array_equal(got[k], ref[k]), (ck.n, k)
    assert not gunzips()


@pytest.mark.parametrize("own_prefetch", [False, True])
def test_recycle_true_with_a_callers_prefetch_gives_the_reference_when_copied(run, own_prefetch):
    ck = scan_run(run)[1]
    fd = open_run(run)
    pf = prefetch_frames(fd, ck, K, rows=64) if own_prefetch else None
    try:
        out = [np.array(d["obs"]) for d in stream_transitions(fd, ck, K, chunk=50, rows=64, prefetch=pf,
                                                               recycle=True)]
    finally:
        if pf is not None:
            pf.close()
        os.close(fd)
    assert np.array_equal(np.concatenate(out), reference(run, ck.n)["obs"])


@pytest.mark.parametrize("bad", [1, "yes", None, 0])
def test_recycle_that_is_not_a_bool_is_refused_naming_it_at_the_call(run, bad):
    ck = scan_run(run)[0]
    fd = open_run(run)
    pf = prefetch_frames(fd, ck, K, rows=64)
    try:
        with pytest.raises(BigperError, match=f"recycle.*{bad!r}"):
            stream_transitions(fd, ck, K, prefetch=pf, recycle=bad)  # refused here, not at next()
        # the caller's prefetch is untouched by the refusal: a valid call still streams it all
        got = [np.array(d["obs"]) for d in stream_transitions(fd, ck, K, rows=64, prefetch=pf, recycle=True)]
        assert np.array_equal(np.concatenate(got), reference(run, ck.n)["obs"])
    finally:
        pf.close()
        os.close(fd)
    for t in gunzips():
        t.join(5)
    assert not gunzips()


def test_recycle_as_a_numpy_bool_is_a_bool(run):
    ck = scan_run(run)[0]
    fd = open_run(run)
    try:
        got = [np.array(d["obs"]) for d in stream_transitions(fd, ck, K, rows=64, recycle=np.bool_(True))]
    finally:
        os.close(fd)
    assert np.array_equal(np.concatenate(got), reference(run, ck.n)["obs"])


def test_closing_the_generator_midway_then_the_prefetch_leaves_no_thread(run):
    ck = scan_run(run)[1]
    for recycle in (False, True):
        fd = open_run(run)
        pf = prefetch_frames(fd, ck, K, rows=32, depth=2)
        g = stream_transitions(fd, ck, K, chunk=10, rows=32, prefetch=pf, recycle=recycle)
        next(g), next(g)
        g.close()
        pf.close()
        os.close(fd)
        # the caller's prefetch closed: its thread is gone (close joins, or it exits soon)
        for t in gunzips():
            t.join(5)
        assert not gunzips()
        # and an own prefetch goes with the generator
        fd = open_run(run)
        g = stream_transitions(fd, ck, K, chunk=10, rows=32, recycle=recycle)
        next(g)
        g.close()
        os.close(fd)
        for t in gunzips():
            t.join(5)
        assert not gunzips()


# 2. in_order()

def d4rl(tmp_path, n=300):
    (tmp_path / "src").mkdir(exist_ok=True)
    src = tmp_path / "src" / "d.h5"
    write_d4rl(src, n=n)
    return src


def test_in_order_restores_random_advice_after_an_exception_and_sampling_is_right(tmp_path):
    src = d4rl(tmp_path)
    want, _ = everything(src)
    with bigper.PrioritizedReplayBuffer.from_hdf5(src) as b:
        store = b.storage
        assert isinstance(store, H5Source)
        calls = []
        real = store.advise
        store.advise = lambda sequential: (calls.append(sequential), real(sequential))[1]
        with pytest.raises(RuntimeError, match="inside"):
            with in_order(store) as let_go:
                let_go()
                raise RuntimeError("inside")
        assert calls == [True, False]
        with in_order(store):  # nested: the inner exit sets random while the outer pass goes on
            with in_order(store) as inner:
                inner()
        assert calls[-1] is False
        live = np.flatnonzero(b.status == 1)
        live = live[np.argsort(b.generations[live], kind="stable")]
        got = b.gather(live)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), k
        s = b.sample(32, seed=0) if "seed" in b.sample.__code__.co_varnames else b.sample(32)
        assert s is not None


def test_in_order_on_a_closed_h5source_and_other_storages(tmp_path):
    src = d4rl(tmp_path)
    b = bigper.PrioritizedReplayBuffer.from_hdf5(src)
    store = b.storage
    b.close()
    with in_order(store) as let_go:  # a closed map: best effort, nothing happens
        let_go()
    for storage in ("memory", "memmap"):
        kw = {"path": str(tmp_path / "mm")} if storage == "memmap" else {}
        buf = bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.float32)}, storage=storage, **kw)
        with buf:
            with in_order(buf.storage) as let_go:
                assert let_go() is None


# 3. convert of an HDF5 dataset, inside in_order

def test_convert_of_an_h5py_d4rl_gives_every_transition(tmp_path):
    src = d4rl(tmp_path)
    before = fingerprint(tmp_path / "src")
    r = convert(src, tmp_path / "z.h5", progress=False, chunk=64)
    assert r["transitions"] == 300
    assert fingerprint(tmp_path / "src") == before
    assert_same_transitions(src, tmp_path / "z.h5")


def test_convert_interrupted_midcopy_leaves_the_source_and_no_dst(tmp_path, monkeypatch):
    src = d4rl(tmp_path)
    want, _ = everything(src)
    before = fingerprint(tmp_path / "src")
    dst = tmp_path / "z.h5"
    real, n = bigper.PrioritizedReplayBuffer.extend, [0]

    def boom(self, *a, **k):
        n[0] += 1
        if n[0] == 3:
            raise RuntimeError("interrupted mid-copy")
        return real(self, *a, **k)

    monkeypatch.setattr(bigper.PrioritizedReplayBuffer, "extend", boom)
    with pytest.raises(RuntimeError, match="mid-copy"):
        convert(src, dst, progress=False, chunk=64)
    monkeypatch.undo()
    assert n[0] == 3
    assert fingerprint(tmp_path / "src") == before
    assert not dst.exists() and not (tmp_path / "z.h5.partial").exists()
    got, _ = everything(src)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    convert(src, dst, progress=False, chunk=64)
    assert_same_transitions(src, dst)


# 4. convert_dqn checks the recorded state before the copy

def datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_a_tampered_recorded_state_is_refused_and_leaves_nothing(run, tmp_path, monkeypatch):
    good = tmp_path / "good.h5"
    convert_dqn_replay(run, good, progress=False)
    dst = tmp_path / "d.h5"
    real = cdqn._to_hdf5

    def tamper(live_dir, mcfg, partial, made):
        p = os.path.join(live_dir, "state", "status.npy")
        a = np.load(p)
        a[np.flatnonzero(a == 1)[0]] = 7  # a status no buffer has
        np.save(p, a)
        return real(live_dir, mcfg, partial, made)

    monkeypatch.setattr(cdqn, "_to_hdf5", tamper)
    with pytest.raises(CorruptSnapshotError):
        convert_dqn_replay(run, dst, progress=False)
    monkeypatch.undo()
    assert not dst.exists() and not (tmp_path / "d.h5.partial").exists()
    convert_dqn_replay(run, dst, progress=False)
    a, b = datasets(good), datasets(dst)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert not (tmp_path / "d.h5.partial.d").exists()
