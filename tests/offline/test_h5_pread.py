"""``from_hdf5`` reads its large datasets with pread, so that sampling keeps none of them in RSS.

A read-only map keeps every page a read touched in the process's RSS (and the
kernel maps a whole folio around each fault): sampling a 50M-transition file
through it left 16.6 GB of the file resident. ``_h5map.plan_reads`` maps the
smallest datasets, up to ``h5source.MAP_BYTES`` in all, and reads the rest with
pread in a kernel (``pread_rows``). Both must read every row exactly as h5py
does, on every layout the map serves (contiguous, chunked back to back or not,
chunks never written, bigper's compressed frame log; episodes of a Minari-like
file are in ``test_hostile_pread.py``), whatever the rows asked (repeated,
unsorted, adjacent, at the ends).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
import bigper.offline.h5source as H
from bigper.convert_dqn import convert_dqn_replay
from tests.offline._dqn_replay_files import two_checkpoints

N = 600


def _map_rss_kb(src) -> int:
    """Resident kB of the source's map, from /proc/self/smaps (its VMA starts at the map's address)."""
    start = f"{src._mm.ctypes.data:x}-"
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(start):
            for j in range(i + 1, len(lines)):
                if lines[j].startswith("Rss:"):
                    return int(lines[j].split()[1])
    raise AssertionError("the map is not in /proc/self/smaps")


def _write(path: Path, layout: str) -> dict:
    rng = np.random.default_rng(3)
    data = {"observations": rng.integers(0, 256, (N, 3, 700), dtype=np.uint8),
            "actions": rng.normal(size=(N, 2)).astype(np.float32),
            "rewards": rng.normal(size=N).astype(np.float64),
            "terminals": (np.arange(N) % 97 == 96).astype(np.float32),
            "timeouts": (np.arange(N) % 151 == 150)}
    with h5py.File(path, "w") as f:
        for name, a in data.items():
            if layout == "contiguous":
                f.create_dataset(name, data=a)
            elif layout == "chunked":  # chunks back to back: runs of plain bytes
                f.create_dataset(name, data=a, chunks=(16, *a.shape[1:]))
            elif layout == "scattered":  # chunks written out of order, interleaved with the other datasets
                d = f.create_dataset(name, shape=a.shape, dtype=a.dtype, chunks=(8, *a.shape[1:]))
                for lo in list(range(0, N, 8))[::-1]:
                    d[lo:lo + 8] = a[lo:lo + 8]
            elif layout == "holes":  # chunks never written read as HDF5's fill value, zeros
                d = f.create_dataset(name, shape=a.shape, dtype=a.dtype, chunks=(8, *a.shape[1:]))
                keep = (np.arange(N) // 8) % 3 != 1
                a[~keep] = 0
                for lo in range(0, N, 8):
                    if keep[lo]:
                        d[lo:lo + 8] = a[lo:lo + 8]
    return data


@pytest.fixture(scope="module", params=["contiguous", "chunked", "scattered", "holes"])
def d4rl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "d.h5"
    return path, _write(path, request.param)


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """bigper's own layout: compressed frame stacks, a frame log read in blocks."""
    d = tmp_path_factory.mktemp("dqn")
    run = two_checkpoints(d / "run", 300)
    convert_dqn_replay(run, d / "f.h5", progress=False)
    return d / "f.h5"


def _both(path, budget_small, monkeypatch):
    """The file opened twice: every dataset through the map, and none (all read with pread)."""
    monkeypatch.setattr(H, "MAP_BYTES", 1 << 40)
    mapped = bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=0)
    monkeypatch.setattr(H, "MAP_BYTES", budget_small)
    try:
        pread = bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=0)
    except BaseException:
        mapped.close()
        raise
    return mapped, pread


rows = st.lists(st.integers(0, N - 1), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(idx=rows, sort=st.booleans())
def test_rows_read_with_pread_equal_h5py_on_every_layout(d4rl, idx, sort, monkeypatch):
    path, data = d4rl
    mapped, pread = _both(path, 0, monkeypatch)
    with mapped, pread:
        live = np.flatnonzero(mapped.status == 1)  # (a timeout without a next observation is not)
        idx = live[np.asarray(sorted(idx) if sort else idx, dtype=np.int64) % live.shape[0]]
        assert all(c.pread for c in pread.storage.columns.values() if c.mapped_any)
        assert any(c.mapped_any for c in pread.storage.columns.values())
        assert not any(c.pread for c in mapped.storage.columns.values())
        a, b = mapped.gather(idx), pread.gather(idx)
        assert np.array_equal(b["obs"], data["observations"][idx])
        assert np.array_equal(b["action"], data["actions"][idx])
        assert np.array_equal(b["reward"], data["rewards"][idx])
        for k in a:
            assert np.array_equal(a[k], b[k]), k
        if idx.size:  # a run of rows (a streamed pass's read), from each row asked to the end
            run = live[live >= idx.min()]
            assert np.array_equal(pread.gather(run)["obs"], data["observations"][run])


def test_frame_stacks_read_with_pread_equal_the_maps(frames, monkeypatch):
    mapped, pread = _both(frames, 0, monkeypatch)
    with mapped, pread:
        assert pread.storage.columns["frame_log"].pread and not mapped.storage.columns["frame_log"].pread
        n = len(mapped)
        rng = np.random.default_rng(0)
        for idx in (np.arange(n), rng.integers(0, n, 500), np.sort(rng.integers(0, n, 64)), np.array([n - 1, 0])):
            a, b = mapped.gather(idx), pread.gather(idx)
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), k
        for _ in range(20):  # sample + update rounds through both: the same draws, the same batches
            x, y = mapped.sample(32), pread.sample(32)
            assert np.array_equal(x.indices, y.indices) and np.array_equal(x["obs"], y["obs"])
            assert np.array_equal(x["next_obs"], y["next_obs"])
            p = rng.random(32) + 0.01
            mapped.update_priorities(x, p)
            pread.update_priorities(y, p)


def test_the_smallest_datasets_are_mapped_up_to_the_budget(d4rl, monkeypatch):
    path, data = d4rl
    with h5py.File(path, "r") as f:
        size = {k: f[k].size * f[k].dtype.itemsize for k in data}
    # obs and next_obs share observations; the map's budget counts each column it serves
    sizes = {"obs": size["observations"], "next_obs": size["observations"], "action": size["actions"],
             "reward": size["rewards"]}
    budget = size["actions"] + size["rewards"] + 1
    monkeypatch.setattr(H, "MAP_BYTES", budget)
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
        cols = ds.storage.columns
        mapped = {k for k in sizes if k in cols and cols[k].mapped_any and not cols[k].pread}
        assert mapped == {"action", "reward"}, {k: (sizes[k], cols[k].pread) for k in sizes if k in cols}
        assert cols["obs"].pread


def test_sampling_with_pread_leaves_nothing_of_the_file_resident(tmp_path, monkeypatch):
    """The same sampling through the map keeps the pages it read (the check can fail)."""
    path = tmp_path / "big.h5"
    rng = np.random.default_rng(0)
    n, row = 3000, 16384  # 49 MB of observations
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=rng.integers(0, 256, (n, row), dtype=np.uint8))
        f.create_dataset("actions", data=rng.normal(size=(n, 2)).astype(np.float32))
        f.create_dataset("rewards", data=rng.normal(size=n).astype(np.float32))
        f.create_dataset("terminals", data=np.zeros(n, np.float32))
        f.create_dataset("timeouts", data=np.arange(n) % 500 == 499)
    got = {}
    for budget in (1 << 40, 1 << 20):  # all through the map; the small ones only (48 KB)
        monkeypatch.setattr(H, "MAP_BYTES", budget)
        with bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=1) as ds:
            ds.storage.release_pages()
            for _ in range(200):
                ds.update_priorities(b := ds.sample(64), np.ones(64))
            got[budget] = _map_rss_kb(ds.storage)
    assert got[1 << 40] > 20_000, got  # (the map kept what it read: tens of MB)
    assert got[1 << 20] < 1_000, got  # (the small datasets' pages only)


CHILD = r"""
import os, sys
import numpy as np
import bigper, bigper.offline.h5source as H
H.MAP_BYTES = 0
path = sys.argv[1]
with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
    os.truncate(path, 4096)  # (another process cut the file under the reader)
    try:
        ds.gather(np.flatnonzero(ds.status == 1)[-5:])
    except OSError as e:
        print("refused:", e)
"""


def test_a_file_cut_under_the_reader_is_an_error_not_a_crash(tmp_path):
    """Through the map, a read past a file's new end is a SIGBUS: the process dies.
    With pread it is an OSError naming the file."""
    path = tmp_path / "cut.h5"
    _write(path, "contiguous")
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and str(path) in r.stdout and "end of file" in r.stdout, r.stdout


def test_a_dataset_two_columns_read_is_read_one_way(tmp_path, monkeypatch):
    """obs and next_obs both read ``observations`` (no next_observations): the budget
    counts it once, and both columns read it the same way, whichever side of the budget."""
    path = tmp_path / "d.h5"
    data = _write(path, "contiguous")
    with h5py.File(path, "r") as f:
        obs = f["observations"].size
        small = sum(f[k].size * f[k].dtype.itemsize for k in ("actions", "rewards"))  # (the flags: not columns)
    for budget, far in ((small + obs, False), (small + obs - 1, True)):
        monkeypatch.setattr(H, "MAP_BYTES", budget)
        with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
            cols = ds.storage.columns
            assert cols["obs"].paths == cols["next_obs"].paths
            assert cols["obs"].pread == cols["next_obs"].pread == far, budget
            idx = np.flatnonzero(ds.status == 1)[:50]
            assert np.array_equal(ds.gather(idx)["obs"], data["observations"][idx])
