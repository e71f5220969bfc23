"""Attack on the pread reads of ``from_hdf5`` (``_h5map.pread_rows``, ``_gather_mapped``'s
fallback, ``plan_reads``, ``H5Source.MAP_BYTES``), ``H5Source.opened`` and the source's
``ends``/``status`` now sharing memory with the recorded arrays.

Every layout the map serves (D4RL contiguous, chunked, chunks written out of order,
chunks never written with a zero and with a non-zero fill value, one row a chunk,
gzip; Minari-like episodes each stored differently; bigper's own layout with its
compressed frame log) is read with every dataset through the map and with none
(``MAP_BYTES = 0``), and both are compared with h5py, for rows repeated, unsorted,
adjacent, at the ends, in 2-D. Then the file is changed under the reader: cut
(in a child: a SIGBUS would kill it), extended, replaced by a rename; a sparse
file whose one coalesced read passes Linux's 2 GiB cap on one read; a chunk
crafted to end exactly at the end of the file; a short read not at the end of
the file followed by a chunk never written. Threads: two sampling while a third
closes; one sampling while ``reprioritize`` runs. A ``chdir`` between open and
read. The source's flags and the file's bytes after sampling, updating,
reprioritizing, close and reopen; ``opened()`` twice, after close, on D4RL.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
import bigper.offline.h5source as H
from bigper.errors import InvalidIndexError, OfflineDatasetError
from bigper.offline._h5map import _gather_mapped, pread_rows
from bigper.offline.h5source import H5Source

N = 240
ROW = (3, 5)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _open(path, budget, **kw) -> H5Source:
    """An ``H5Source`` opened with ``MAP_BYTES = budget`` (read at open: ``plan_reads``)."""
    old = H.MAP_BYTES
    H.MAP_BYTES = budget
    try:
        return H5Source(path, **kw)
    finally:
        H.MAP_BYTES = old


def _put(f, name, a, layout, fill=None):
    chunk = (8, *a.shape[1:])
    if layout == "contiguous":
        f.create_dataset(name, data=a)
    elif layout == "chunked":
        f.create_dataset(name, data=a, chunks=chunk)
    elif layout == "row-chunks":  # one row a chunk: no two rows coalesce unless placed so
        f.create_dataset(name, data=a, chunks=(1, *a.shape[1:]))
    elif layout == "scattered":  # chunks written last to first, interleaved with the other datasets
        d = f.create_dataset(name, shape=a.shape, dtype=a.dtype, chunks=chunk)
        for lo in list(range(0, a.shape[0], 8))[::-1]:
            d[lo:lo + 8] = a[lo:lo + 8]
    elif layout in ("holes", "holes-fill"):  # every third chunk never written
        kw = {"fillvalue": fill} if layout == "holes-fill" else {}
        d = f.create_dataset(name, shape=a.shape, dtype=a.dtype, chunks=chunk, **kw)
        for lo in range(0, a.shape[0], 8):
            if (lo // 8) % 3 != 1:
                d[lo:lo + 8] = a[lo:lo + 8]
    elif layout == "gzip":
        f.create_dataset(name, data=a, chunks=chunk, compression="gzip")
    else:
        raise AssertionError(layout)


def _d4rl(path: Path, layout: str, variant: str, n: int = N, row=ROW, seed: int = 0) -> dict:
    """A D4RL file; ``variant``: 'next' (a next_observations dataset), 'terminal-last'
    (the last step a terminal: its next_obs is its own row), 'timeout-last' (the last
    step a timeout without a next observation: held dead, still readable)."""
    rng = np.random.default_rng(seed)
    term = rng.random(n) < 0.04
    tout = (rng.random(n) < 0.03) & ~term
    if variant == "terminal-last":
        term[-1], tout[-1] = True, False
    elif variant == "timeout-last":
        term[-1], tout[-1] = False, True
    data = {"observations": rng.integers(1, 256, (n, *row), dtype=np.uint8),
            "actions": rng.normal(size=(n, 2)).astype(">f4"),  # (big-endian: bytes as the file has them)
            # (n, 1): read as a scalar per row (not compressed: see the xfail below)
            "rewards": rng.normal(size=(n, 1) if layout != "gzip" else n),
            "terminals": term.astype(np.float32), "timeouts": tout}
    if variant == "next":
        data["next_observations"] = rng.integers(1, 256, (n, *row), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        for name, a in data.items():
            # a non-zero fill value (h5py reads it, the map cannot) for the observations; zero for the rest
            own = layout if layout != "holes-fill" or name.endswith("observations") else "holes"
            _put(f, name, a, own, fill=7)
    with h5py.File(path, "r") as f:  # the truth: what h5py reads (a hole reads as its fill value)
        return {k: f[k][...] for k in f}


def _truth(data: dict, name: str, rows: np.ndarray) -> np.ndarray:
    n = data["observations"].shape[0]
    term = data["terminals"] != 0
    if name == "obs":
        return data["observations"][rows]
    if name == "next_obs":
        if "next_observations" in data:
            return data["next_observations"][rows]
        return data["observations"][np.clip(rows + 1 - term[rows], 0, n - 1)]
    if name == "action":
        return data["actions"][rows]
    if name == "reward":
        return data["rewards"].reshape(n)[rows]
    if name == "terminated":
        return term[rows]
    if name == "truncated":
        return data["timeouts"][rows] != 0
    raise AssertionError(name)


D4RL_LAYOUTS = ["contiguous", "chunked", "row-chunks", "scattered", "holes", "holes-fill", "gzip"]
VARIANTS = ["next", "terminal-last", "timeout-last"]
_CACHE: dict = {}


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    """(layout, variant) -> (through the map, all with pread, h5py truth); closed at the end."""
    def get(layout, variant):
        key = (layout, variant)
        if key not in _CACHE:
            path = tmp_path_factory.mktemp(f"{layout}-{variant}") / "d.h5"
            data = _d4rl(path, layout, variant)
            _CACHE[key] = (_open(path, 1 << 40), _open(path, 0), data, path)
        return _CACHE[key]
    yield get
    for m, p, _, _ in _CACHE.values():
        m.close()
        p.close()
    _CACHE.clear()


def _rows(n):
    one = st.one_of(st.integers(0, n - 1), st.sampled_from([0, 1, n - 2, n - 1]))
    return st.one_of(st.lists(one, max_size=50),
                     st.tuples(st.integers(0, n - 1), st.integers(1, n)).map(
                         lambda t: list(range(t[0], min(n, t[0] + t[1])))),  # a run (a streamed pass)
                     st.lists(one, min_size=6, max_size=6).map(lambda v: np.reshape(v, (2, 3)).tolist()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", D4RL_LAYOUTS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_rows(N))
def test_d4rl_rows_read_with_pread_equal_the_map_and_h5py(opened, layout, variant, rows):
    mapped, pread, data, _ = opened(layout, variant)
    if layout != "gzip":
        assert any(c.mapped_any for c in pread.columns.values())
    if layout == "holes-fill":  # (its holes read as 7: h5py's, never the map's zeros)
        assert not pread.columns["obs"].mapped_any and not mapped.columns["obs"].mapped_any
    assert all(c.pread for c in pread.columns.values() if c.mapped_any)
    assert not any(c.pread for c in mapped.columns.values())
    r = np.asarray(rows, dtype=np.int64)
    for name in [*pread.columns, "terminated", "truncated"]:
        a, b = mapped.read(name, r), pread.read(name, r)
        want = _truth(data, name, r)
        assert b.shape == want.shape and a.shape == want.shape, name
        assert np.array_equal(b, want), (name, r)
        assert np.array_equal(a, want), (name, r)


@pytest.mark.parametrize("budget", [1 << 40, 0])
def test_compressed_rewards_of_shape_n_by_1_are_read(tmp_path, budget, monkeypatch):
    """(Was a strict xfail: compressed (n, 1) rewards, read through h5py (_read_h5), raised a raw
    ValueError for any read of two rows: (k, 1) does not fit (k,).)"""
    path = tmp_path / "r.h5"
    rng = np.random.default_rng(0)
    rew = rng.normal(size=(50, 1))
    with h5py.File(path, "w") as f:
        f["observations"] = rng.normal(size=(50, 3))
        f["actions"] = rng.normal(size=(50, 2))
        f.create_dataset("rewards", data=rew, chunks=(10, 1), compression="gzip")
        f["terminals"] = np.zeros(50, np.float32)
        f["timeouts"] = np.zeros(50, bool)
    monkeypatch.setattr(H, "MAP_BYTES", budget)
    with bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=0) as buf:
        idx = np.arange(0, 49, 3)
        assert np.array_equal(buf.gather(idx)["reward"], rew[idx, 0])


@pytest.mark.parametrize("layout", ["contiguous", "holes"])
def test_rows_out_of_range_are_refused_by_both(opened, layout):
    mapped, pread, _, _ = opened(layout, "next")
    for src in (mapped, pread):
        for bad in ([-1], [N], [0, N], [N + 10**12], [-(2**62)]):
            with pytest.raises(InvalidIndexError):
                src.read("obs", np.asarray(bad, dtype=np.int64))
        assert src.read("obs", np.zeros(0, np.int64)).shape == (0, *ROW)


# -- Minari-like: episodes stored each its own way -------------------------------------------------

EPISODES = [("contiguous", 17), ("row-chunks", 1), ("gzip", 40), ("holes", 23), ("scattered", 30),
            ("holes-fill", 12), ("chunked", 9)]


def _minari(path: Path) -> dict:
    rng = np.random.default_rng(5)
    obs, nxt, act, rew, term, trunc = [], [], [], [], [], []
    with h5py.File(path, "w") as f:
        for e, (layout, steps) in enumerate(EPISODES):
            g = f.create_group(f"episode_{e}")
            o = rng.normal(size=(steps + 1, 4)).astype(np.float32)
            a = rng.integers(-300, 300, (steps, 2)).astype(np.int16)
            r = rng.normal(size=steps).astype(np.float32)
            te = np.zeros(steps, bool)
            tr = np.zeros(steps, bool)
            (te if e % 2 else tr)[-1] = True
            _put(g, "observations", o, layout, fill=7.0)
            _put(g, "actions", a, layout, fill=7)
            _put(g, "rewards", r, "contiguous" if layout == "holes-fill" else layout, fill=7.0)
            g["terminations"], g["truncations"] = te, tr
    with h5py.File(path, "r") as f:
        for e, (layout, steps) in enumerate(EPISODES):
            g = f[f"episode_{e}"]
            o = g["observations"][...]
            obs.append(o[:-1])
            nxt.append(o[1:])
            act.append(g["actions"][...])
            rew.append(g["rewards"][...])
            term.append(g["terminations"][...])
            trunc.append(g["truncations"][...])
    return {"obs": np.concatenate(obs), "next_obs": np.concatenate(nxt), "action": np.concatenate(act),
            "reward": np.concatenate(rew), "terminated": np.concatenate(term), "truncated": np.concatenate(trunc)}


@pytest.fixture(scope="module")
def minari(tmp_path_factory):
    path = tmp_path_factory.mktemp("minari") / "m.h5"
    data = _minari(path)
    mapped, pread = _open(path, 1 << 40), _open(path, 0)
    yield mapped, pread, data
    mapped.close()
    pread.close()


M = sum(s for _, s in EPISODES)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_rows(M))
def test_minari_episodes_read_with_pread_equal_the_map_and_h5py(minari, rows):
    mapped, pread, data = minari
    assert pread.layout == "minari" and pread.n == M
    partial = [c for c in pread.columns.values() if c.mapped_any and not c.mapped_all]
    assert partial and all(c.pread for c in partial)  # (the per-episode path: map, pread and h5py mixed)
    r = np.asarray(rows, dtype=np.int64)
    for name in [*pread.columns, "terminated", "truncated"]:
        want = data[name][r]
        a, b = mapped.read(name, r), pread.read(name, r)
        assert np.array_equal(b, want), (name, r)
        assert np.array_equal(a, want), (name, r)


# -- bigper's own layout: a compressed frame log ----------------------------------------------------

@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    from bigper.convert_dqn import convert_dqn_replay
    from tests.offline._dqn_replay_files import two_checkpoints

    d = tmp_path_factory.mktemp("dqn")
    convert_dqn_replay(two_checkpoints(d / "run", 300), d / "f.h5", progress=False)
    return d / "f.h5"


@pytest.fixture(scope="module")
def frames_sources(frames):
    mapped, pread = _open(frames, 1 << 40), _open(frames, 0)
    with h5py.File(frames, "r") as f:
        truth = {n: f[c.paths[0]][...] for n, c in pread.columns.items()}
    yield mapped, pread, truth
    mapped.close()
    pread.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bigper_layout_arrays_read_with_pread_equal_the_map_and_h5py(frames_sources, data):
    mapped, pread, truth = frames_sources
    assert pread.columns["frame_log"].pread and not mapped.columns["frame_log"].pread
    for name, want in truth.items():
        rows = np.asarray(data.draw(_rows(want.shape[0]), label=name), dtype=np.int64)
        a, b = mapped.read(name, rows), pread.read(name, rows)
        assert np.array_equal(b, want[rows]), name
        assert np.array_equal(a, want[rows]), name


def _flags_of_file(path):
    with h5py.File(path, "r") as f:
        return f["_bigper/state/status"][...], f["_bigper/state/ends"][...]


def test_bigper_layout_flags_never_alias_the_ring_and_stay_the_files(frames, monkeypatch):
    """The source's ends/status are now the recorded arrays themselves (copy=False); the
    buffer's ring must be its own copy, and sampling, updating, reprioritizing, closing
    and reopening must leave the source's flags, its fingerprint and the file's bytes as
    the file has them."""
    monkeypatch.setattr(H, "MAP_BYTES", 0)
    file_before = _sha(frames)
    status, ends = _flags_of_file(frames)
    buf = bigper.PrioritizedReplayBuffer.from_hdf5(frames, seed=3)
    try:
        src = buf.storage
        assert src.recorded[2] == {}  # (opened: the record's arrays let go)
        fp = src.fingerprint()
        assert np.array_equal(src.status, status) and np.array_equal(src.ends, ends)
        ring = buf._ring
        for mine in (ring.status, ring.ends, ring.gid):
            assert not np.shares_memory(mine, src.status) and not np.shares_memory(mine, src.ends)
        src.opened()  # twice: nothing more to let go
        assert src.recorded[2] == {} and src.fingerprint() == fp
        rng = np.random.default_rng(0)
        for _ in range(15):
            b = buf.sample(32)
            buf.update_priorities(b, rng.random(32) + 0.1)
        buf.reprioritize(lambda b: 1.0 + np.abs(np.asarray(b["reward"], np.float64)), batch_size=100,
                         progress=False)
        ring.ends[:] ^= 1  # (the ring's copy changed: the source's must not follow)
        ring.ends[:] ^= 1
        assert np.array_equal(src.status, status) and np.array_equal(src.ends, ends)
        assert np.array_equal(buf.status, status)
        assert src.fingerprint() == fp
        n = len(buf)
        keys = buf.prioritization.key_at(np.arange(n)).copy()
        live = np.flatnonzero(buf.status == 1)
        rew = buf.gather(live)["reward"]
    finally:
        buf.close()
    src.opened()  # after close: harmless
    assert _sha(frames) == file_before  # (the dataset is never written: the sidecar holds the keys)
    with bigper.PrioritizedReplayBuffer.from_hdf5(frames, seed=3) as again:
        assert again.storage.fingerprint() == fp
        assert np.array_equal(again.status, status)
        assert np.array_equal(again.prioritization.key_at(np.arange(n)), keys)
        assert np.allclose(keys[live], (1.0 + np.abs(rew.astype(np.float64)) + again.config.eps) ** again.config.alpha)
    assert _sha(frames) == file_before


def test_opened_on_a_d4rl_source_twice_and_after_close(tmp_path, monkeypatch):
    path = tmp_path / "d.h5"
    data = _d4rl(path, "holes", "timeout-last")
    monkeypatch.setattr(H, "MAP_BYTES", 0)
    buf = bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=0)
    src = buf.storage
    fresh = _open(path, 0)
    try:
        assert src.recorded is None
        src.opened()
        src.opened()
        assert src.recorded is None
        for _ in range(10):
            b = buf.sample(16)
            buf.update_priorities(b, np.ones(16) * 2)
        assert np.array_equal(src.status, fresh.status) and np.array_equal(src.ends, fresh.ends)
        assert not np.shares_memory(buf._ring.status, src.status)
        assert src.fingerprint() == fresh.fingerprint()
        live = np.flatnonzero(buf.status == 1)
        assert np.array_equal(buf.gather(live)["obs"], data["observations"][live])
    finally:
        buf.close()
        fresh.close()
    src.opened()
    assert src.recorded is None


# -- the file changed under the reader --------------------------------------------------------------

CUT_CHILD = r"""
import json, os, sys
import numpy as np
import bigper, bigper.offline.h5source as H
H.MAP_BYTES = 0
path, cuts, ops = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
orig = open(path, "rb").read()
out = []
for cut in cuts:
    for op in ops:
        with open(path, "r+b") as g:  # (the file whole again, same inode)
            g.write(orig)
        buf = bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=1)
        try:
            n = len(buf)
            keys = buf.prioritization.key_at(np.arange(n)).tobytes()
            live = np.flatnonzero(buf.status == 1)
            os.truncate(path, cut)  # (another process cut the file under the reader)
            try:
                if op == "gather":
                    buf.gather(live)
                elif op == "sample":
                    for _ in range(20):
                        buf.update_priorities(b := buf.sample(64), np.ones(64))
                elif op == "read":
                    for name in buf.storage.columns:
                        buf.storage.read(name, np.arange(buf.storage.rows(name)))
                elif op == "reprioritize":
                    buf.reprioritize(lambda b: np.ones(len(b.indices)), batch_size=50, progress=False)
                else:
                    buf.gather(live[-3:])
                res = "read"
            except OSError as e:
                res = "refused: " + type(e).__name__ + ": " + str(e)
            same = buf.prioritization.key_at(np.arange(n)).tobytes() == keys
            twin_same = None
            if op == "sample":  # a refused sample drew nothing: the next ones are a twin's
                with open(path, "r+b") as g:
                    g.write(orig)
                twin_same = True
                with bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=1) as twin:
                    for _ in range(3):
                        a, b = buf.sample(64), twin.sample(64)
                        twin_same &= bool(np.array_equal(a.indices, b.indices) and np.array_equal(a["obs"], b["obs"])
                                          and np.array_equal(a.weights, b.weights))
        finally:
            buf.close()
        out.append({"cut": cut, "op": op, "res": res, "same": same, "twin": twin_same})
print("RESULT " + json.dumps(out))
"""


def _obs_offset(path):
    with h5py.File(path, "r") as f:
        d = f["observations"]
        off = d.id.get_offset()
        if off is None:
            off = min(d.id.get_chunk_info(i).byte_offset for i in range(d.id.get_num_chunks()))
        return off, int(np.prod(d.shape[1:])) * d.dtype.itemsize


def _child(code, *args, timeout=240):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("layout", ["contiguous", "holes"])
def test_a_file_cut_under_the_pread_reader_is_an_oserror_naming_it_and_changes_nothing(tmp_path, layout):
    """Cut to nothing, in the middle of an observation row, on a row's boundary: every
    read with pread (gather, sample + update, each column whole, reprioritize) is an
    OSError naming the file, never a SIGBUS, never a silent read; the keys are as
    they were."""
    path = tmp_path / "cut.h5"
    _d4rl(path, layout, "next", n=600, row=(3, 700))
    off, rb = _obs_offset(path)
    cuts = [0, off + rb + rb // 2, off + 2 * rb]
    r = _child(CUT_CHILD, path, json.dumps(cuts), json.dumps(["gather", "sample", "read", "reprioritize",
                                                             "score_next"]))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    results = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert len(results) == 15
    for res in results:
        assert res["same"], res
        if res["op"] == "score_next" and res["cut"] != 0:
            continue  # (its three rows may lie before the cut of a chunked file: either is right)
        assert res["res"].startswith("refused: ") and str(path) in res["res"], res


def test_a_sample_refused_by_a_cut_file_draws_nothing(tmp_path):
    """(Was a strict xfail: a sample whose read failed had drawn its uniforms and stepped beta,
    so the next samples differed from those of a twin that never failed.)"""
    path = tmp_path / "cut.h5"
    _d4rl(path, "contiguous", "next", n=600, row=(3, 700))
    off, rb = _obs_offset(path)
    r = _child(CUT_CHILD, path, json.dumps([0, off + rb + rb // 2]), json.dumps(["sample"]))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    results = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert [x["res"].startswith("refused: ") for x in results] == [True, True], results
    assert [x["twin"] for x in results] == [True, True], results


def test_a_file_extended_or_replaced_after_open_reads_as_opened(tmp_path):
    path = tmp_path / "d.h5"
    _d4rl(path, "scattered", "next")
    mapped, pread = _open(path, 1 << 40), _open(path, 0)
    try:
        rows = np.random.default_rng(0).integers(0, N, 500)
        before = {n: mapped.read(n, rows) for n in mapped.columns}
        with open(path, "ab") as g:  # appended to
            g.write(b"\xff" * 100_000)
        for src in (mapped, pread):
            for n, want in before.items():
                assert np.array_equal(src.read(n, rows), want), n
        other = tmp_path / "other.h5"
        _d4rl(other, "scattered", "next", seed=9)
        os.replace(other, path)  # a new file renamed over it: the one opened is still read
        for src in (mapped, pread):
            for n, want in before.items():
                assert np.array_equal(src.read(n, rows), want), n
    finally:
        mapped.close()
        pread.close()


def test_one_coalesced_read_past_linuxs_2gib_cap_still_returns_exact_rows(tmp_path):
    """A sparse contiguous dataset of 2,060 one-MiB rows: rows 0.. are one run of bytes,
    one read longer than Linux serves in one call (0x7ffff000 bytes). The kernel asks
    at most 1 GiB a call and goes on where a call stopped, so it finishes alone; every
    row exact (written rows past the cap included, the rest HDF5's holes: zeros).
    (It returned short at row 0 and left the rows to the Python fallback before.)"""
    path = tmp_path / "sparse.h5"
    n, rb = 2060, 1 << 20
    written = [0, 1, 1000, 2046, 2047, 2048, 2059]
    with h5py.File(path, "w") as f:
        d = f.create_dataset("observations", shape=(n, rb), dtype=np.uint8)  # contiguous, allocated late
        for r in written:
            d[r] = (np.arange(rb) * 7 + r) % 251 + 1
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = np.zeros(n, np.float32)
        f["terminals"] = np.zeros(n, np.float32)
        f["timeouts"] = np.zeros(n, bool)
    assert os.stat(path).st_blocks * 512 < 100 << 20  # (sparse: the holes take no disk)
    src = _open(path, 0)
    try:
        col = src.columns["obs"]
        assert col.pread and col.mapped_all and n * rb > 0x7ffff000
        rows = np.arange(n, dtype=np.int64)
        out = np.empty(n * rb, np.uint8)
        # (the kernel alone: its one run of all the rows, read in calls of at most 1 GiB)
        assert pread_rows(src._fd, np.zeros(n, np.int64), rows, col.chunk_rows, col.first_chunk,
                          col.chunk_addr, rb, out) == -1
        for r in written:
            assert np.array_equal(out[r * rb:(r + 1) * rb], (np.arange(rb) * 7 + r) % 251 + 1), r
        del out
        got = src.read("obs", rows)
        for r in range(0, n, 64):
            block = got[r:r + 64]
            mask = np.isin(np.arange(r, r + block.shape[0]), written)
            assert not block[~mask].any(), r
        for r in written:
            assert np.array_equal(got[r], (np.arange(rb) * 7 + r) % 251 + 1), r
        del got
    finally:
        src.close()


def test_a_short_read_before_a_hole_still_reads_the_hole_as_zeros(tmp_path):
    """The kernel's read of rows 0-1 fails (the file cut); the file is whole again by the
    time the fallback reads (a writer rewriting it in place, or any short read that is
    not at its end). Row 5 lies in a chunk never written: it must read as zeros. (Was a
    strict xfail: the fallback re-read only written rows and left np.empty's bytes there.)"""
    path = tmp_path / "h.h5"
    rng = np.random.default_rng(0)
    obs = rng.integers(1, 256, (64, 3, 7), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("observations", shape=obs.shape, dtype=obs.dtype, chunks=(4, 3, 7))
        for lo in range(0, 64, 8):  # chunks 0, 2, 4, ... written; 1, 3, ... holes
            d[lo:lo + 4] = obs[lo:lo + 4]
        f["actions"] = np.zeros((64, 2), np.float32)
        f["rewards"] = np.zeros(64)
        f["terminals"] = np.zeros(64, bool)
        f["timeouts"] = np.zeros(64, bool)
    orig = path.read_bytes()
    src = _open(path, 0)
    try:
        col = src.columns["obs"]
        assert col.pread and col.chunk_addr[1] < 0
        rows = np.array([0, 1, 4, 5], np.int64)
        bad = []
        for _ in range(5):
            with open(path, "r+b") as g:
                g.write(orig)
            os.truncate(path, int(col.chunk_addr[0]))  # the kernel's read of rows 0-1 fails

            def whole_again(offset, out, first=[True]):  # noqa: B006  (the file restored, then read)
                if first[0]:
                    first[0] = False
                    with open(path, "r+b") as g:
                        g.write(orig)
                src._pread(offset, out)

            junk = np.full(rows.shape[0] * col.row_bytes, 0xAB, np.uint8)  # (freed memory np.empty may reuse)
            del junk
            got = _gather_mapped(col, None, np.zeros(4, np.int64), rows, src._fd, whole_again)
            assert np.array_equal(got[:2], obs[:2])
            bad.append(got[2:].any())
        assert not any(bad), bad
    finally:
        src.close()


def _chunk_at_the_end(path: Path, past: int = 0) -> np.ndarray:
    """A D4RL file (HDF5's earliest format: a v1 B-tree without checksums) whose last
    observation chunk was moved, with new bytes, to the very end of the file (its
    address patched), ``past`` bytes of it missing."""
    n = 32
    obs = np.arange(n * 6, dtype=np.uint8).reshape(n, 6)
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("observations", data=obs, chunks=(8, 6))
        f["actions"] = np.zeros((n, 2), np.float32)
        f["rewards"] = np.zeros(n)
        f["terminals"] = np.zeros(n, np.float32)
        f["timeouts"] = np.zeros(n, bool)
    with h5py.File(path, "r") as f:
        last = f["observations"].id.get_chunk_info(3).byte_offset
    b = bytearray(path.read_bytes())
    old = struct.pack("<Q", last)
    assert b.count(old) == 1
    size = len(b)
    b[b.index(old):b.index(old) + 8] = struct.pack("<Q", size)
    new = (255 - obs[24:]).tobytes()
    b += new[:len(new) - past]
    assert b[:9] == b"\x89HDF\r\n\x1a\n\x00"  # (superblock version 0: its end of allocation at byte 40)
    b[40:48] = struct.pack("<Q", len(b))
    path.write_bytes(bytes(b))
    return np.concatenate([obs[:24], 255 - obs[24:]])


def test_a_chunk_ending_exactly_at_the_end_of_the_file_is_read_whole(tmp_path):
    path = tmp_path / "end.h5"
    want = _chunk_at_the_end(path)
    with h5py.File(path, "r") as f:
        assert np.array_equal(f["observations"][...], want)  # (h5py reads the patched chunk)
    for budget in (1 << 40, 0):
        src = _open(path, budget)
        try:
            assert src.columns["obs"].mapped_all and src.columns["obs"].pread == (budget == 0)
            for rows in (np.arange(32), np.array([31]), np.array([31, 24, 23, 31, 0])):
                assert np.array_equal(src.read("obs", rows), want[rows])
        finally:
            src.close()


def test_a_chunk_one_byte_past_the_end_of_the_file_is_refused_at_open(tmp_path):
    path = tmp_path / "past.h5"
    _chunk_at_the_end(path, past=1)
    before = _sha(path)
    for budget in (1 << 40, 0):
        old = H.MAP_BYTES
        H.MAP_BYTES = budget
        try:
            with pytest.raises(OfflineDatasetError, match="past the end of the file"):
                bigper.PrioritizedReplayBuffer.from_hdf5(path)
        finally:
            H.MAP_BYTES = old
    assert _sha(path) == before and not (tmp_path / "past.h5.priorities").exists()


# -- threads, chdir --------------------------------------------------------------------------------

THREADS_CHILD = r"""
import sys, threading, time
import numpy as np
import bigper, bigper.offline.h5source as H
from bigper.errors import BufferClosedError
H.MAP_BYTES = 0
path = sys.argv[1]
ends = []
for rep in range(8):
    buf = bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=rep)
    live = np.flatnonzero(buf.status == 1)
    obs = buf.gather(live)["obs"].copy()
    go = threading.Event()
    def worker(k):
        rng = np.random.default_rng(k)
        go.wait()
        try:
            while True:
                b = buf.sample(64)
                got = buf.gather(b.indices)["obs"]
                pos = np.searchsorted(live, b.indices)
                assert np.array_equal(got, obs[pos]), "a wrong row"
                assert np.array_equal(b["obs"], obs[pos]), "a wrong row in a batch"
                buf.update_priorities(b, rng.random(64) + 0.1)
        except BufferClosedError:
            ends.append("closed")
        except BaseException as e:
            ends.append(f"{type(e).__name__}: {e}")
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    go.set()
    time.sleep(0.05 + 0.03 * rep)
    buf.close()
    for t in ts:
        t.join(60)
    assert buf.storage._fd == -1
print("ENDS", ends)
"""


def test_two_threads_sampling_while_a_third_closes(tmp_path):
    path = tmp_path / "d.h5"
    _d4rl(path, "holes", "next", n=3000, row=(3, 300))
    r = _child(THREADS_CHILD, path)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    ends = ast.literal_eval(r.stdout.split("ENDS ", 1)[1].strip())
    assert ends == ["closed"] * 16, ends


def test_a_sampler_thread_while_reprioritize_runs(tmp_path, monkeypatch):
    path = tmp_path / "d.h5"
    data = _d4rl(path, "chunked", "next", n=3000, row=(3, 300))
    monkeypatch.setattr(H, "MAP_BYTES", 0)
    errors, rounds = [], [0]
    with bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=2) as buf:
        live = np.flatnonzero(buf.status == 1)
        stop = threading.Event()

        def sampler():
            try:
                while not stop.is_set():
                    b = buf.sample(32)
                    assert np.array_equal(b["obs"], data["observations"][b.indices])
                    assert np.array_equal(b["next_obs"], data["next_observations"][b.indices])
                    rounds[0] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=sampler)
        t.start()
        try:
            buf.reprioritize(lambda b: 1.0 + np.abs(np.asarray(b["reward"], np.float64)), batch_size=64,
                             progress=False)
        finally:
            stop.set()
            t.join(60)
        assert not errors, errors
        keys = buf.prioritization.key_at(live)
        want = (1.0 + np.abs(data["rewards"][live, 0]) + buf.config.eps) ** buf.config.alpha
        assert np.allclose(keys, want)


def test_a_chdir_between_open_and_read_redirects_nothing(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    data = _d4rl(a / "d.h5", "contiguous", "next")
    _d4rl(b / "d.h5", "contiguous", "next", seed=4)  # a decoy at the same relative name
    decoy = _sha(b / "d.h5")
    monkeypatch.setattr(H, "MAP_BYTES", 0)
    monkeypatch.chdir(a)
    buf = bigper.PrioritizedReplayBuffer.from_hdf5("d.h5", seed=0)
    try:
        monkeypatch.chdir(b)
        live = np.flatnonzero(buf.status == 1)
        got = buf.gather(live)
        assert np.array_equal(got["obs"], data["observations"][live])
        assert np.array_equal(buf.storage.read("next_obs", live), data["next_observations"][live])
        s = buf.sample(16)
        buf.update_priorities(s, np.full(16, 5.0))
        keys = buf.prioritization.key_at(np.arange(len(buf))).copy()
    finally:
        buf.close()
    assert (a / "d.h5.priorities").exists() and not (b / "d.h5.priorities").exists()
    assert _sha(b / "d.h5") == decoy
    with bigper.PrioritizedReplayBuffer.from_hdf5(a / "d.h5", seed=0) as again:
        assert np.array_equal(again.prioritization.key_at(np.arange(len(again))), keys)
