"""``MemmapStorage.release_pages``: rows leave the process's RSS, and nothing else changes.

A copy of a large storage read once (convert's HDF5 copy of 50M transitions)
lets go of each piece it read (``MADV_DONTNEED`` on the whole pages inside the
rows), so the process holds one piece, not the storage. The bytes stay in the
files: a read after it maps them again and gives the same rows, and a write
before it (a dirty page) reaches the file and a reopen.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import bigper

ROW = 4096 + 40  # (rows that do not start on pages)


def _rss_file_mb() -> float:
    return [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("RssFile")][0] / 1024


def _buffer(path, capacity, **kw):
    return bigper.PrioritizedReplayBuffer(capacity=capacity, fields={"x": ((ROW,), np.uint8)}, storage="memmap",
                                          path=path, **kw)


def test_released_rows_leave_the_rss_and_read_back_the_same(tmp_path):
    n = 16384  # 66 MB
    rng = np.random.default_rng(0)
    want = rng.integers(0, 256, (n, ROW), dtype=np.uint8)
    with _buffer(tmp_path / "b", n) as buf:
        buf.extend({"x": want})
        store = buf.storage
        store.release_pages("x", 0, n)
        before = _rss_file_mb()
        assert int(np.asarray(store.arrays["x"]).sum(dtype=np.int64)) == int(want.sum(dtype=np.int64))
        touched = _rss_file_mb()
        store.release_pages("x", 0, n)
        after = _rss_file_mb()
        assert touched - before > 40 and touched - after > 40, (before, touched, after)
        assert np.array_equal(store.arrays["x"], want)  # mapped again, the same bytes
        assert np.array_equal(buf.gather(np.arange(0, n, 97))["x"], want[::97])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.integers(0, 300), span=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_any_rows_released_after_writes_keep_every_byte_through_a_reopen(tmp_path_factory, lo, span, seed):
    n = 300
    hi = min(n, lo + span)
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("lg") / "b"
    first, second = (rng.integers(0, 256, (n, ROW), dtype=np.uint8) for _ in range(2))
    with _buffer(path, n) as buf:
        buf.extend({"x": first})
        buf.storage.release_pages("x", lo, hi)  # (dirty pages: they go to the file, not away)
        assert np.array_equal(buf.storage.arrays["x"], first)
        buf.extend({"x": second[:n // 2]})  # written after: slots 0 .. n/2 - 1
        buf.storage.release_pages("x", lo, hi)
    want = np.concatenate([second[:n // 2], first[n // 2:]])
    with _buffer(path, n, mode="resume") as buf:
        assert np.array_equal(buf.storage.arrays["x"], want)


def test_arguments_are_checked_and_a_closed_storage_has_no_rows(tmp_path):
    from bigper.errors import InvalidArgumentError, InvalidTypeError

    buf = _buffer(tmp_path / "b", 10)
    buf.extend({"x": np.ones((10, ROW), np.uint8)})
    store = buf.storage
    for args, err, words in ((("y", 0, 1), InvalidArgumentError, "name must be an array"),
                             ((7, 0, 1), InvalidArgumentError, "name must be an array"),
                             (("x", 0.0, 1), InvalidTypeError, "lo must be an int"),
                             (("x", 0, True), InvalidTypeError, "hi must be an int"),
                             (("x", -1, 1), InvalidArgumentError, r"rows -1\.\.1 are not rows"),
                             (("x", 3, 2), InvalidArgumentError, r"rows 3\.\.2 are not rows"),
                             (("x", 0, 11), InvalidArgumentError, r"rows 0\.\.11 are not rows of array 'x' \(0\.\.10")):
        with pytest.raises(err, match=words):
            store.release_pages(*args)
    store.release_pages("x", 10, 10)  # (nothing)
    assert np.array_equal(store.arrays["x"], np.ones((10, ROW), np.uint8))
    buf.close()
    with pytest.raises(InvalidArgumentError, match=r"one of \[\]"):
        store.release_pages("x", 0, 1)
