"""Hostile use of ``H5Source.release_pages`` and ``H5Source.advise`` (``from_hdf5``'s map).

``reprioritize`` advises the read-only map of the dataset ``MADV_NORMAL`` for its
pass and ``MADV_RANDOM`` after, and lets go of every mapped page after each
batch (``MADV_DONTNEED``). Both take no lock: a sampler thread reads rows
through the same map while another thread releases and re-advises it, a
``score_fn`` releases the pages of the batch it is reading, or closes the
buffer under the pass. Every row read must be the file's; a closed source
takes both calls as no-ops; and a pass interrupted at any batch, then resumed,
must give exactly the priorities of a pass that never stopped.
"""

from __future__ import annotations

import shutil
import threading

import h5py
import numpy as np
import pytest

import bigper
from bigper.errors import BigperError

N, ROW = 3000, 4096


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("h5")
    rng = np.random.default_rng(7)
    obs = rng.integers(0, 256, (N, ROW), dtype=np.uint8)
    with h5py.File(d / "d.h5", "w") as f:
        f.create_dataset("observations", data=obs)
        f.create_dataset("actions", data=rng.normal(size=(N, 2)).astype(np.float32))
        f.create_dataset("rewards", data=rng.normal(size=N).astype(np.float32))
        f.create_dataset("terminals", data=(np.arange(N) % 400 == 399).astype(np.float32))
        f.create_dataset("timeouts", data=np.zeros(N, dtype=bool))
    return d / "d.h5", obs


def _copy(data, tmp_path, name="d.h5"):
    path = tmp_path / name
    shutil.copyfile(data[0], path)
    return path


def test_release_and_advise_while_a_sampler_thread_reads(data, tmp_path):
    path, obs = _copy(data, tmp_path), data[1]
    with bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=0) as ds:
        src = ds.storage
        stop, errors, rounds = threading.Event(), [], [0]

        def sampler():
            try:
                while not stop.is_set():
                    b = ds.sample(64)
                    if not np.array_equal(b["obs"], obs[b.indices]):
                        errors.append(f"wrong rows at {b.indices[:4]}")
                        return
                    rounds[0] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=sampler) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i in range(300):
                src.release_pages()
                src.release_pages("obs", 0, 10)  # (the storage protocol's arguments: all pages go)
                src.advise(sequential=bool(i % 2))
                if rounds[0] > 60 and i > 100:
                    break
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert rounds[0] > 0
        idx = np.arange(0, N, 11)
        assert np.array_equal(ds.gather(idx)["obs"], obs[idx])


def test_after_close_both_are_no_ops_and_a_kept_row_stays_readable(data, tmp_path):
    path, obs = _copy(data, tmp_path), data[1]
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(path)
    src = ds.storage
    kept = ds.gather(np.arange(5))["obs"]
    ds.close()
    src.release_pages()
    src.advise(sequential=True)
    src.advise(sequential=False)
    src.release_pages("obs", 0, 1)
    assert np.array_equal(kept, obs[:5])
    with pytest.raises(BigperError, match="closed"):
        ds.sample(4)


def _score(b) -> np.ndarray:
    """A score of the rows read (so a wrong row gives a wrong priority)."""
    return b["obs"][:, :64].astype(np.float64).mean(axis=1) / 255.0 + np.abs(b["action"]).sum(axis=1)


def _uninterrupted(data, tmp_path):
    path = _copy(data, tmp_path, "whole.h5")
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
        ds.reprioritize(_score, batch_size=256, progress=False)
        return ds.prioritization.key_at(np.arange(len(ds))).copy()


class Stop(Exception):
    pass


@pytest.mark.parametrize("at", [1, 2, 6, 11, 12])
@pytest.mark.parametrize("commit_seconds", [0.0, 3600.0])
def test_a_pass_interrupted_at_any_batch_then_resumed_gives_the_same_priorities(data, tmp_path, at,
                                                                                 commit_seconds):
    want = _uninterrupted(data, tmp_path)
    path = _copy(data, tmp_path)
    calls = [0]

    def failing(b):
        calls[0] += 1
        if calls[0] == at:
            raise Stop
        return _score(b)

    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
        before = ds.prioritization.key_at(np.arange(len(ds))).copy()
        with pytest.raises(Stop):
            ds.reprioritize(failing, batch_size=256, progress=False, commit_seconds=commit_seconds)
        assert np.array_equal(ds.prioritization.key_at(np.arange(len(ds))), before)  # (all at once, at the end)
    resumed = []

    def counting(b):
        resumed.append(len(b.indices))
        return _score(b)

    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
        ds.reprioritize(counting, batch_size=256, progress=False)
        got = ds.prioritization.key_at(np.arange(len(ds)))
        live = int((ds.status == 1).sum())  # (the sampleable ones: the last step has no successor)
        assert sum(resumed) == live - 256 * (at - 1)  # resumed after the batches scored before the failure
        assert got.tobytes() == want.tobytes()
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:  # (and as the sidecar gives them back)
        assert ds.prioritization.key_at(np.arange(len(ds))).tobytes() == want.tobytes()


def test_a_score_fn_that_releases_and_advises_the_map_it_reads(data, tmp_path):
    want = _uninterrupted(data, tmp_path)
    path = _copy(data, tmp_path)
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as ds:
        src = ds.storage

        def meddling(b):
            src.release_pages()
            src.advise(sequential=False)
            s = _score(b)
            src.release_pages()
            assert np.array_equal(b["obs"], data[1][b.indices])
            return s

        ds.reprioritize(meddling, batch_size=256, progress=False)
        assert ds.prioritization.key_at(np.arange(len(ds))).tobytes() == want.tobytes()


def test_a_score_fn_that_closes_the_buffer_under_the_pass(data, tmp_path):
    """The pass holds the buffer's lock, but ``score_fn`` runs inside it: a close there
    must end the pass with bigper's error, and the next open resume it exactly."""
    want = _uninterrupted(data, tmp_path)
    path = _copy(data, tmp_path)
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(path)
    calls = [0]

    def closing(b):
        calls[0] += 1
        s = _score(b)
        if calls[0] == 3:
            ds.close()
        return s

    try:
        with pytest.raises(BigperError):
            ds.reprioritize(closing, batch_size=256, progress=False)
    finally:
        if not ds.closed:
            ds.close()
    assert calls[0] == 3
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as again:
        again.reprioritize(_score, batch_size=256, progress=False)
        assert again.prioritization.key_at(np.arange(len(again))).tobytes() == want.tobytes()
