"""``H5Source.release_pages``: a dataset's mapped pages leave the RSS, and it reads the same after.

``from_hdf5`` reads a file through one read-only map; a streamed pass over a
dataset larger than memory (``reprioritize``: ``score_all``) would leave every
page of it mapped (the 50M scale run's reprioritize reached 10 GB of RSS, all
of it the file's pages). ``score_all`` lets them go after each batch.
"""

from __future__ import annotations

import h5py
import numpy as np

import bigper
import bigper.offline.h5source as H


def _rss_file_mb() -> float:
    return [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("RssFile")][0] / 1024


def _dataset(path, n=6000, row=12288):
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (n, row), dtype=np.uint8)  # 74 MB
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=obs)
        f.create_dataset("actions", data=rng.normal(size=(n, 2)).astype(np.float32))
        f.create_dataset("rewards", data=rng.normal(size=n).astype(np.float32))
        f.create_dataset("terminals", data=(np.arange(n) % 500 == 499).astype(np.float32))
        f.create_dataset("timeouts", data=np.zeros(n, dtype=bool))
    return obs


def test_the_maps_pages_leave_the_rss_and_the_rows_read_the_same(tmp_path):
    obs = _dataset(tmp_path / "d.h5")
    with bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "d.h5") as ds:
        src = ds.storage
        src.release_pages()
        before = _rss_file_mb()
        for lo in range(0, obs.shape[0], 7):  # rows one at a time (a gather through the map)
            ds.gather(np.arange(lo, min(lo + 1, obs.shape[0])))
        assert int(np.asarray(src._mm).sum(dtype=np.int64)) > 0  # (every page of the file)
        touched = _rss_file_mb()
        src.release_pages()
        after = _rss_file_mb()
        assert touched - before > 50 and touched - after > 50, (before, touched, after)
        idx = np.arange(0, obs.shape[0], 13)
        assert np.array_equal(ds.gather(idx)["obs"], obs[idx])


def test_a_reprioritize_pass_lets_go_as_it_goes(tmp_path, monkeypatch):
    _dataset(tmp_path / "d.h5")
    calls = []
    real = H.H5Source.release_pages
    monkeypatch.setattr(H.H5Source, "release_pages", lambda self: (calls.append(1), real(self))[1])
    with bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "d.h5") as ds:
        ds.reprioritize(lambda b: np.ones(len(b.indices)), batch_size=1000, progress=False)
        assert len(calls) >= len(ds) // 1000
        assert np.allclose(ds.prioritization.key_at(np.arange(len(ds))), (1 + 1e-6) ** 0.6)


def test_an_open_bigper_file_holds_its_record_once(tmp_path):
    """``from_hdf5`` of bigper's layout reads the recorded state (leaves, ends,
    status) to build the buffer; once built, only the buffer's ring and the
    source's end flags stay: about 12 bytes a slot traced (22 when the record's
    arrays and a second copy of its flags stayed: 500 MB more at 50M)."""
    import tracemalloc

    c = 1 << 20
    path = tmp_path / "b.h5"
    with bigper.PrioritizedReplayBuffer(capacity=c, fields={"x": ((), np.uint8)}, storage="hdf5",
                                        path=str(path)) as b:
        b.extend({"x": np.arange(c, dtype=np.uint64).astype(np.uint8)})
    tracemalloc.start()
    try:
        ds = bigper.PrioritizedReplayBuffer.from_hdf5(path)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    with ds:
        assert held < 16 * c, f"{held / c:.1f} bytes a slot held after the open"
        idx = np.arange(0, c, 4099)
        assert np.array_equal(ds.gather(idx)["x"], idx.astype(np.uint8))
        ds.update_priorities(idx, np.full(idx.shape[0], 3.0))
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:  # (the priorities it kept at close)
        assert np.allclose(ds.prioritization.key_at(idx), (3.0 + 1e-6) ** 0.6)
