"""Hostile use of ``MemmapStorage.release_pages`` (``buf.storage.release_pages``).

``release_pages(name, lo, hi)`` runs ``MADV_DONTNEED`` over the whole pages of
rows ``lo .. hi - 1`` of a chunked, ``MAP_SHARED`` file mapping. That advice
is only harmless on shared file pages: on anything private it throws bytes
away. So every argument at and past its limits is refused by type and value,
naming it, with the buffer's data, tree and files byte for byte as before;
and the rows it lets go read back exactly wherever the bytes live: a chunk a
snapshot shares (mapped read-only, then copied by a write), a read-only
storage, a storage whose directory was deleted or whose process changed its
cwd, and a buffer another thread extends, samples, updates, saves and closes
while this one releases in a loop.
"""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

import bigper
from bigper.errors import BigperError, InvalidArgumentError, InvalidTypeError
from bigper.storage.memmap import MemmapStorage

from tests._hostile_snapshot_cases import fingerprint

ROW = 4096 + 40  # rows that do not start on page boundaries
N = 64


def _buffer(path, capacity=N, row=ROW, **kw):
    return bigper.PrioritizedReplayBuffer(capacity=capacity, fields={"x": ((row,), np.uint8)}, storage="memmap",
                                          path=path, **kw)


def _rows(seed, n=N, row=ROW):
    return np.random.default_rng(seed).integers(0, 256, (n, row), dtype=np.uint8)


def _everything(buf):
    """What a refusal must leave as it was: the rows, the tree, the bookkeeping."""
    meta, arrays = buf.state_dict()
    return (np.array(buf.storage.arrays["x"]).tobytes(), buf.total_priority,
            {k: np.asarray(v).tobytes() for k, v in arrays.items()}, repr(sorted(meta.items())))


BIG = np.iinfo(np.int64)
REFUSED = [
    # (name, lo, hi), error, words of the message
    (("x", np.int64(BIG.min), 1), InvalidArgumentError, r"rows -9223372036854775808\.\.1 are not rows"),
    (("x", 0, np.int64(BIG.max)), InvalidArgumentError, r"rows 0\.\.9223372036854775807 are not rows"),
    (("x", 0, np.uint64(2**64 - 1)), InvalidArgumentError, r"rows 0\.\.18446744073709551615 are not rows"),
    (("x", np.uint64(2**64 - 1), np.uint64(2**64 - 1)), InvalidArgumentError, "are not rows"),
    (("x", 0, 2**70), InvalidArgumentError, r"rows 0\.\.1180591620717411303424 are not rows"),
    (("x", -(2**70), 0), InvalidArgumentError, "are not rows"),
    (("x", -1, 0), InvalidArgumentError, r"rows -1\.\.0 are not rows"),
    (("x", N, N + 1), InvalidArgumentError, rf"rows {N}\.\.{N + 1} are not rows of array 'x' \(0\.\.{N}"),
    (("x", 5, 4), InvalidArgumentError, r"rows 5\.\.4 are not rows.*lo <= hi"),
    (("x", np.int8(-1), np.int8(3)), InvalidArgumentError, r"rows -1\.\.3"),
    (("x", False, 1), InvalidTypeError, "lo must be an int, got bool"),
    (("x", 0, np.bool_(True)), InvalidTypeError, "hi must be an int, got bool"),
    (("x", 0.0, 1), InvalidTypeError, "lo must be an int, got float"),
    (("x", 0, np.float64(1)), InvalidTypeError, "hi must be an int, got float64"),
    (("x", 0, float("nan")), InvalidTypeError, "hi must be an int"),
    (("x", None, 1), InvalidTypeError, "lo must be an int, got NoneType"),
    (("x", "0", 1), InvalidTypeError, "lo must be an int, got str"),
    (("x", np.array(0), 1), InvalidTypeError, "lo must be an int, got ndarray"),
    (("x", 0, [1]), InvalidTypeError, "hi must be an int, got list"),
    (("x", 0, 1 + 0j), InvalidTypeError, "hi must be an int, got complex"),
    (("y", 0, 1), InvalidArgumentError, r"name must be an array of this storage \(one of \['x'\]\), got 'y'"),
    (("X", 0, 1), InvalidArgumentError, "name must be an array"),
    (("x ", 0, 1), InvalidArgumentError, "name must be an array"),
    ((b"x", 0, 1), InvalidArgumentError, r"got b'x'"),
    ((None, 0, 1), InvalidArgumentError, "got None"),
    ((np.str_("y"), 0, 1), InvalidArgumentError, "name must be an array"),
    # the bookkeeping a close records in state/ is not an array of the storage
    (("leaves", 0, 1), InvalidArgumentError, "name must be an array"),
    (("status", 0, 1), InvalidArgumentError, "name must be an array"),
    (("gid", 0, 1), InvalidArgumentError, "name must be an array"),
    (("../data/x", 0, 1), InvalidArgumentError, "name must be an array"),
    (("x" * 10000, 0, 1), InvalidArgumentError, "name must be an array"),
]


@pytest.fixture
def filled(tmp_path):
    buf = _buffer(tmp_path / "b")
    buf.extend({"x": _rows(1)})
    buf.update_priorities(np.arange(0, N, 3), np.linspace(0.5, 4, len(range(0, N, 3))))
    buf.storage.flush()
    yield buf, tmp_path / "b"
    if not buf.closed:
        buf.close()


def test_every_argument_at_and_past_its_limits_is_refused_and_changes_nothing(filled):
    buf, path = filled
    before, files = _everything(buf), fingerprint(path)
    for args, err, words in REFUSED:
        with pytest.raises(err, match=words):
            buf.storage.release_pages(*args)
        assert _everything(buf) == before, args
    assert fingerprint(path) == files
    assert len(str(pytest.raises(InvalidArgumentError, buf.storage.release_pages, "x" * 10000, 0, 1).value)) < 300


@pytest.mark.parametrize("lo,hi", [(np.int64(0), np.int64(N)), (np.uint64(0), np.uint64(N)), (np.int32(3), np.uint8(9)),
                                   (np.uint64(N), N), (0, 0), (N, N), (np.int16(1), np.int16(2))])
def test_numpy_ints_in_range_are_taken_and_every_byte_reads_back(filled, lo, hi):
    buf, path = filled
    before, files = _everything(buf), fingerprint(path)
    buf.storage.release_pages(np.str_("x"), lo, hi)  # (a numpy str is a str)
    assert _everything(buf) == before
    assert np.array_equal(buf.gather(np.arange(N))["x"], _rows(1))
    assert fingerprint(path) == files


def test_a_closed_storage_refuses_and_its_files_stay(filled):
    buf, path = filled
    store = buf.storage
    buf.close()
    files = fingerprint(path)
    for args in (("x", 0, N), ("x", 0, 0), ("y", 0, 1)):
        with pytest.raises(InvalidArgumentError, match=r"one of \[\]"):
            store.release_pages(*args)
    assert fingerprint(path) == files
    with _buffer(path, mode="resume") as again:
        assert np.array_equal(again.storage.arrays["x"], _rows(1))


def test_a_read_only_storage_lets_go_and_reads_the_same(filled):
    from bigper.core.layout import allocate

    buf, path = filled
    cfg = buf.config
    buf.close()
    files = fingerprint(path)
    src = MemmapStorage(path, read_only=True, random_reads=True)  # (both mappings: region and reader)
    src.open(cfg.to_dict())
    try:
        allocate(src, cfg)
        assert src._arr["x"].reader is not None
        src.release_pages("x", 0, N)
        assert np.array_equal(src.arrays["x"], _rows(1))
        src.release_pages("x", 1, N - 1)
        assert np.array_equal(src.arrays["x"][5:9], _rows(1)[5:9])
        with pytest.raises(InvalidArgumentError, match="are not rows"):
            src.release_pages("x", 0, N + 1)
    finally:
        src.close()
    assert fingerprint(path) == files


def test_released_rows_of_chunks_a_snapshot_shares_then_written_keep_both_copies_exact(tmp_path):
    """After a save, the chunks are hard links the snapshot shares, mapped read-only;
    a write copies its chunk (thaw) and remaps it. Releases before, between and
    after: the buffer reads what it wrote, the snapshot what it saved."""
    row = 1000 + 24  # 4 rows a page, 8 a chunk: a release's pages start and end inside chunks
    first, second = _rows(1, row=row), _rows(2, row=row)
    opts = {"chunk_bytes": 8 * row}
    with _buffer(tmp_path / "b", row=row, storage_options=opts) as buf:
        buf.extend({"x": first})
        snap = buf.save(tmp_path / "snap")
        assert buf.storage.shared_chunks > 3
        saved = fingerprint(snap)
        buf.storage.release_pages("x", 0, N)
        assert np.array_equal(buf.storage.arrays["x"], first)
        buf.extend({"x": second[:N // 3]})  # slots 0 .. N/3 - 1: their chunks thawed (copied)
        buf.storage.release_pages("x", 0, N)
        want = np.concatenate([second[:N // 3], first[N // 3:]])
        assert np.array_equal(buf.storage.arrays["x"], want)
        assert np.array_equal(buf.gather(np.arange(N))["x"], want)
        buf.storage.release_pages("x", N // 3 - 1, N // 3 + 1)  # (the rows around the thawed edge)
        buf.extend({"x": second[N // 3:]})
        buf.storage.release_pages("x", 0, N)
        assert np.array_equal(buf.storage.arrays["x"], second)
    assert fingerprint(snap) == saved
    with bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "again") as old:
        assert np.array_equal(old.gather(np.arange(N))["x"], first)
    with _buffer(tmp_path / "b", row=row, storage_options=opts, mode="resume") as buf:
        assert np.array_equal(buf.storage.arrays["x"], second)


def test_a_chdir_or_the_directory_deleted_while_open(tmp_path):
    old = os.getcwd()
    (tmp_path / "w").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "w")
    try:
        buf = _buffer("b")  # a relative path
        buf.extend({"x": _rows(3)})
        os.chdir(tmp_path / "elsewhere")
        buf.storage.release_pages("x", 0, N)
        assert np.array_equal(buf.storage.arrays["x"], _rows(3))
        assert os.listdir(tmp_path / "elsewhere") == []
        shutil.rmtree(tmp_path / "w" / "b")  # the files stay mapped: the rows read back from them
        buf.storage.release_pages("x", 0, N)
        assert np.array_equal(buf.storage.arrays["x"], _rows(3))
        assert np.array_equal(buf.gather(np.arange(N))["x"], _rows(3))
        with pytest.raises(BigperError, match="deleted"):
            buf.close()
        assert os.listdir(tmp_path / "elsewhere") == [] and not os.path.lexists(tmp_path / "w" / "b")
    finally:
        os.chdir(old)


def test_released_in_a_loop_while_another_thread_writes_samples_updates_saves_and_closes(tmp_path):
    """release_pages takes no lock of the buffer's: a release racing an extend (a
    write, a thaw of a chunk a save shares), a sample, a priority update, a save and
    the close must not crash, lose a byte, or write after the close."""
    cap = 4 * N
    row = 1024  # (chunks of 8 rows: many of them, shared after each save)
    buf = _buffer(tmp_path / "b", capacity=cap, row=row, storage_options={"chunk_bytes": 8 * row})
    store = buf.storage
    stop = threading.Event()
    errors, releases = [], [0]

    def releaser():
        while not stop.is_set():
            try:
                store.release_pages("x", 0, cap)
                store.release_pages("x", 1, cap // 2 + 1)
                releases[0] += 1
            except InvalidArgumentError as e:  # only once closed: the arrays are gone
                if not buf.closed:
                    errors.append(e)
                return
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    t = threading.Thread(target=releaser)
    t.start()
    try:
        want = np.zeros((cap, row), np.uint8)
        for i in range(24):
            rows = _rows(100 + i, 23, row)
            slots = (np.arange(23) + 23 * i) % cap
            buf.extend({"x": rows})
            want[slots] = rows
            b = buf.sample(16)
            np.testing.assert_array_equal(b["x"], want[b.indices])
            buf.update_priorities(b, np.full(16, 1.0 + i))
            if i in (5, 15):
                buf.save(tmp_path / f"snap{i}")
                np.testing.assert_array_equal(buf.storage.arrays["x"], want)
        np.testing.assert_array_equal(buf.gather(np.arange(cap))["x"], want)
        buf.close()
    finally:
        t.join(timeout=60)
        stop.set()
        t.join()
    assert not errors, errors
    assert releases[0] > 0
    with _buffer(tmp_path / "b", capacity=cap, row=row, storage_options={"chunk_bytes": 8 * row},
                 mode="resume") as again:
        np.testing.assert_array_equal(again.storage.arrays["x"], want)
    with bigper.PrioritizedReplayBuffer.load(tmp_path / "snap5", path=tmp_path / "r5") as old:
        assert len(old) == 6 * 23
