"""Storages on real files: data round-trips, close and reopen resumes exactly,
configs and names are checked, files are never truncated.

Every test writes to its own ``tmp_path``; capacities are small so the module
runs in seconds. Locks and killed writers are in ``test_storage_lock.py``, a
full disk in ``test_storage_disk.py``.
"""

import os

import h5py
import numpy as np
import pytest

import bigper
from bigper import IncompatibleSnapshotError, LinearSchedule
from tests._storage_cases import DISK, Stream, file_bytes, file_sizes, open_buffer, where

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
          np.uint64, np.float16, np.float32, np.float64]
KINDS = ("memory", "memmap", "hdf5", "hdf5-lzf")


def check_sample(buf, stream, capacity, batch_size=64):
    """A sample holds exactly what was last added at each sampled slot."""
    batch = buf.sample(batch_size)
    want = stream.expected(batch.indices, capacity)
    for name, w in want.items():
        got = batch[name]
        assert got.dtype == w.dtype, f"{name}: dtype {got.dtype} != {w.dtype}"
        np.testing.assert_array_equal(got, w, err_msg=f"field {name!r}")
    return batch


# -- round trip ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_and_shape_round_trips(kind, dtype, tmp_path):
    # "img" rows are over 4 KB, which HDF5 storage reads row by row
    fields = {"s": ((), dtype), "v": ((5,), dtype), "img": ((2, 48, 48), dtype)}
    cap = 7
    stream = Stream(fields, next_of=("img",), seed=int(np.dtype(dtype).num))
    path = where(kind, tmp_path)
    with open_buffer(kind, path, cap, fields, next_of=("img",), seed=1) as buf:
        stream.add([buf], 3)
        stream.extend([buf], 9)  # more than the capacity in one call: only the newest 7 stay
        stream.add([buf], 2)
        stream.extend([buf], 4)  # wraps around the end of the ring
        assert len(buf) == cap
        check_sample(buf, stream, cap)
    if kind == "memory":
        return
    with open_buffer(kind, path, cap, fields, next_of=("img",), read_only=True) as again:
        assert len(again) == cap
        check_sample(again, stream, cap)


# -- close and reopen resumes --------------------------------------------------------

FIELDS = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}


class Rounds:
    """The same learner loop (sample, then update with a fixed |TD|) on two buffers."""

    def __init__(self, batch_size=8, seed=7):
        self.rng = np.random.default_rng(seed)
        self.batch_size = batch_size

    def run(self, ref, buf, n):
        for _ in range(n):
            a, b = ref.sample(self.batch_size), buf.sample(self.batch_size)
            assert_same_batch(a, b)
            td = np.abs(self.rng.standard_normal(self.batch_size)) * 3
            ref.update_priorities(a, td)
            buf.update_priorities(b, td)


def assert_same_batch(a, b):
    np.testing.assert_array_equal(b.indices, a.indices)
    np.testing.assert_array_equal(b.weights, a.weights)
    np.testing.assert_array_equal(b.probabilities, a.probabilities)
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=f"field {name!r}")


def assert_same_state(ref, buf):
    assert len(buf) == len(ref)
    assert buf.total_priority == ref.total_priority
    assert buf.beta == ref.beta
    (meta_a, arrays_a), (meta_b, arrays_b) = ref.state_dict(), buf.state_dict()
    assert meta_b == meta_a
    assert set(arrays_b) == set(arrays_a)
    for name in arrays_a:
        np.testing.assert_array_equal(arrays_b[name], arrays_a[name], err_msg=name)


@pytest.mark.parametrize("kind", DISK)
@pytest.mark.parametrize("n_step,num_envs", [(1, 1), (3, 2)], ids=["1step", "3step-2envs"])
@pytest.mark.parametrize("style", ["close", "with"])
def test_reopen_resumes_exactly(kind, n_step, num_envs, style, tmp_path):
    """A buffer closed and reopened mid-way draws, weighs and updates exactly as
    one that never closed (an in-memory twin fed the same data)."""
    cap = 24
    kw = dict(n_step=n_step, num_envs=num_envs, gamma=0.9, alpha=0.7, seed=3,
              beta=LinearSchedule(0.4, 1.0, 50))
    # each reopen goes on with the same stream as the twin that never closed: its episodes continue
    again = dict(kw, continue_episodes=True)
    path = where(kind, tmp_path)
    stream = Stream(FIELDS, next_of=("obs",), num_envs=num_envs, seed=11, extremes=False)
    rounds = Rounds()
    ref = open_buffer("memory", None, cap, FIELDS, **kw)

    def first_half(buf):
        stream.extend([ref, buf], 9)
        stream.add([ref, buf], 4)
        rounds.run(ref, buf, 5)
        # sampled before the close, updated after the reopen
        return ref.sample(8), buf.sample(8)

    def second_half(buf, pending):
        assert_same_state(ref, buf)
        td = np.linspace(0.1, 4.0, 8)
        ref.update_priorities(pending[0], td)
        buf.update_priorities(pending[1], td)
        stream.extend([ref, buf], 7)  # wraps: overwrites slots the pending batch held
        stream.add([ref, buf], 3)
        rounds.run(ref, buf, 20)
        assert_same_state(ref, buf)

    if style == "close":
        buf = open_buffer(kind, path, cap, FIELDS, **kw)
        pending = first_half(buf)
        buf.close()
        buf = open_buffer(kind, path, cap, FIELDS, **again)
        second_half(buf, pending)
        buf.close()
        buf = open_buffer(kind, path, cap, FIELDS, **again)
        assert_same_state(ref, buf)
        rounds.run(ref, buf, 20)
        buf.close()
    else:
        with open_buffer(kind, path, cap, FIELDS, **kw) as buf:
            pending = first_half(buf)
        with open_buffer(kind, path, cap, FIELDS, **again) as buf:
            second_half(buf, pending)
        with open_buffer(kind, path, cap, FIELDS, **again) as buf:
            assert_same_state(ref, buf)
            rounds.run(ref, buf, 20)


@pytest.mark.parametrize("kind", DISK)
def test_read_only_reader_resumes_and_changes_nothing(kind, tmp_path):
    """Readers start from the recorded state (the same draws the resumed
    writer makes), refuse writes, and leave every byte as it was."""
    cap = 16
    path = where(kind, tmp_path)
    stream = Stream(FIELDS, next_of=("obs",), seed=5)
    with open_buffer(kind, path, cap, FIELDS, seed=2) as buf:
        stream.extend([buf], 20)
        buf.update_priorities(np.arange(cap), np.arange(cap) + 0.5)
        buf.sample(4)
    before = file_bytes(path)
    with open_buffer(kind, path, cap, FIELDS, read_only=True) as r1, \
            open_buffer(kind, path, cap, FIELDS, read_only=True) as r2:
        drawn = [r1.sample(8) for _ in range(5)]
        for b in drawn:
            assert_same_batch(b, r2.sample(8))
        with pytest.raises(ValueError, match="read_only"):
            r1.update_priorities(drawn[0], np.ones(8))
        with pytest.raises(ValueError, match="read_only"):
            stream.add([r1])
        stream.added.pop()
    assert file_bytes(path) == before
    # the resumed writer as the readers saw it: its open episode goes on (check_sample compares flags)
    with open_buffer(kind, path, cap, FIELDS, continue_episodes=True) as buf:
        for b in drawn:
            assert_same_batch(b, check_sample(buf, stream, cap, batch_size=8))


# -- config and names ----------------------------------------------------------------


@pytest.mark.parametrize("kind", DISK)
@pytest.mark.parametrize("change,key", [
    ({"capacity": 17}, "capacity"),
    ({"fields": {**FIELDS, "obs": ((5,), np.float32)}}, "fields"),
    ({"alpha": 0.5}, "alpha"),
], ids=["capacity", "field-shape", "alpha"])
def test_mismatched_config_names_the_key(kind, change, key, tmp_path):
    path = where(kind, tmp_path)
    base = {"capacity": 16, "fields": FIELDS, "alpha": 0.6}
    stream = Stream(FIELDS, next_of=("obs",), seed=1)
    with open_buffer(kind, path, base["capacity"], base["fields"], alpha=base["alpha"]) as buf:
        stream.extend([buf], 10)
    sizes = file_sizes(path)
    other = {**base, **change}
    with pytest.raises(IncompatibleSnapshotError) as e:
        open_buffer(kind, path, other["capacity"], other["fields"], alpha=other["alpha"])
    assert isinstance(e.value, bigper.BigperError)
    msg = str(e.value)
    assert f"{key}:" in msg, msg
    assert str(path) in msg, msg
    others = [k for k in ("capacity", "fields", "alpha") if k != key]
    assert not any(f"{k}:" in msg for k in others), msg
    # the refused open left the buffer whole and unlocked
    assert file_sizes(path) == sizes
    # reopened as it was closed (check_sample compares every flag as added: the episode goes on)
    with open_buffer(kind, path, base["capacity"], base["fields"], alpha=base["alpha"],
                     continue_episodes=True) as buf:
        assert len(buf) == 10
        check_sample(buf, stream, base["capacity"])


def test_hdf5_file_of_another_kind_is_refused_untouched(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(12.0)
    before = path.read_bytes()
    with pytest.raises(IncompatibleSnapshotError, match="not a bigper-hdf5 storage"):
        open_buffer("hdf5", path, 12, FIELDS)
    assert path.read_bytes() == before


def test_memmap_format_version_is_checked(tmp_path):
    path = where("memmap", tmp_path)
    open_buffer("memmap", path, 8, FIELDS).close()
    meta = (path / "meta.json").read_text()
    assert '"version": 1' in meta
    (path / "meta.json").write_text(meta.replace('"version": 1', '"version": 99'))
    with pytest.raises(IncompatibleSnapshotError, match="version 99"):
        open_buffer("memmap", path, 8, FIELDS)


@pytest.mark.parametrize("kind", ("memory",) + DISK)
@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "a\\b", "x\x00"])
def test_bad_field_name_is_refused_before_touching_disk(kind, name, tmp_path):
    path = where(kind, tmp_path / "sub")
    with pytest.raises(ValueError) as e:
        open_buffer(kind, path, 8, {name: ((), np.float32), "reward": ((), np.float32)})
    assert repr(name) in str(e.value)
    assert list(tmp_path.iterdir()) == []


# -- files on disk ------------------------------------------------------------------


@pytest.mark.parametrize("kind", DISK)
def test_files_are_preallocated_and_never_truncated(kind, tmp_path):
    cap = 40
    fields = {"obs": ((8, 8), np.uint8), "reward": ((), np.float32)}
    path = where(kind, tmp_path)
    stream = Stream(fields, next_of=("obs",), seed=3)
    with open_buffer(kind, path, cap, fields) as buf:
        stream.extend([buf], 10)
    created = file_sizes(path)
    data = [path] if kind == "hdf5" else sorted((path / "data").iterdir())
    if kind == "memmap":  # one file per array, or chunk files <name>.<k>.bin
        want = {"obs": 64 * cap, "next_obs": 64 * cap, "reward": 4 * cap}
        for name, nbytes in want.items():
            got = sum(p.stat().st_size for p in data if p.name.split(".")[0] == name)
            assert got >= nbytes, name
    for p in data:  # blocks really reserved, not a sparse file
        assert p.stat().st_blocks * 512 >= p.stat().st_size, p

    for role in ("reader", "writer", "writer"):
        # a writer goes on with the same stream (check_sample compares every flag as added): its open
        # episode continues rather than ending (truncated) at the reopen
        go_on = {"continue_episodes": True} if role == "writer" else {}
        buf = open_buffer(kind, path, cap, fields, read_only=role == "reader", **go_on)
        sizes = file_sizes(path)
        for name, size in created.items():
            if kind == "memmap" and name.startswith("data/"):
                assert sizes[name] == size, name
            else:  # metadata may grow; nothing ever shrinks
                assert sizes[name] >= size, name
        check_sample(buf, stream, cap)
        if role == "writer":
            stream.add([buf], 3)
        buf.close()
    assert len(stream.added) == 16


@pytest.mark.parametrize("shared", [0, 2])
def test_a_storage_that_shares_chunks_is_prepared_before_every_write(shared):
    """storage/base.py: ``prepare`` is called with the rows of each write while
    ``shared_chunks`` says a snapshot shares some (never when it is 0, the default)."""
    from bigper.config import Config
    from bigper.storage.memory import MemoryStorage

    calls = []

    class Prepared(MemoryStorage):
        shared_chunks = shared

        def prepare(self, writes):
            calls.append(sorted(writes))

    cfg = Config.build(capacity=8, fields={"obs": ((3,), np.float32)})
    store = Prepared()
    store.allocate(bigper.PrioritizedReplayBuffer.storage_specs(cfg))  # from_parts takes an allocated store
    buf = bigper.PrioritizedReplayBuffer.from_parts(cfg, store)
    buf.add(obs=np.zeros(3, np.float32), next_obs=np.ones(3, np.float32))
    buf.extend({"obs": np.zeros((3, 3), np.float32), "next_obs": np.ones((3, 3), np.float32)})
    assert len(buf) == 4 and calls == ([["next_obs", "obs"], ["next_obs", "obs"]] if shared else [])
    assert np.array_equal(buf.gather(np.arange(4))["next_obs"], np.ones((4, 3), np.float32))


def _vm_flags(lo: int, hi: int) -> list[set]:
    """The VmFlags of each mapping of this process overlapping ``[lo, hi)`` (/proc/self/smaps)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                cur = a < hi and b > lo
            elif head == "VmFlags:" and cur:
                out.append(set(line.split()[1:]))
    return out


def test_memmap_random_reads_map_the_files_twice_and_both_see_every_write(tmp_path):
    """With ``random_reads``, sampled rows are read through mappings advised
    random ("rr" in smaps: a cold row costs its own pages, not the read-ahead
    around it); writes and chunk copies go through mappings with the default
    read-ahead. Both map the same files: after a snapshot's copy-on-write
    remaps a chunk, each still sees exactly the bytes written."""
    cap = 1500  # 84x84 frames: three 4 MB chunk files per array
    fields = {"obs": ((84, 84), np.uint8), "reward": ((), np.float32)}
    stream = Stream(fields, next_of=("obs",), seed=5)
    with open_buffer("memmap", tmp_path / "buf", cap, fields, storage_options={"random_reads": True}) as buf:
        store = buf.storage
        stream.extend([buf], cap)
        readers, writers = _spans(store.arrays), _spans(store.writable_arrays)

        def check_flags():
            for name in ("obs", "next_obs", "reward"):
                r, w = _vm_flags(*readers[name]), _vm_flags(*writers[name])
                assert r and all("rr" in f for f in r), (name, r)
                assert w and not any("rr" in f for f in w), (name, w)

        check_flags()
        assert len(_vm_flags(*readers["obs"])) >= 3  # a mapping per chunk file
        buf.save(tmp_path / "snap")
        assert store.shared_chunks > 0
        stream.extend([buf], 700)  # overwrites the first chunks: each copied, then remapped
        assert store.shared_chunks < 9
        check_flags()
        for name in ("obs", "next_obs", "reward"):
            np.testing.assert_array_equal(store.arrays[name], store.writable_arrays[name], err_msg=name)
        check_sample(buf, stream, cap, batch_size=256)
        np.testing.assert_array_equal(buf.gather(np.arange(cap))["obs"],
                                      stream.expected(np.arange(cap), cap)["obs"])


@pytest.mark.parametrize("option", [False, None])
def test_memmap_reads_with_read_ahead_when_the_data_fits_in_memory(option, tmp_path):
    """``random_reads=False``, and the default for data under half the machine's
    memory: one mapping, read-ahead kept (a reopened buffer's page cache fills sooner)."""
    from bigper.storage.memmap import random_reads_pay

    fields = {"obs": ((84, 84), np.uint8)}
    opts = {} if option is None else {"storage_options": {"random_reads": option}}
    with open_buffer("memmap", tmp_path / "buf", 800, fields, **opts) as buf:
        Stream(fields, next_of=("obs",), seed=1).extend([buf], 800)
        r, w = _spans(buf.storage.arrays), _spans(buf.storage.writable_arrays)
        assert r == w  # the same mapping
        assert not any("rr" in f for f in _vm_flags(*r["obs"]))
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert not random_reads_pay(ram // 2) and random_reads_pay(ram // 2 + 1)


@pytest.mark.parametrize("bad", [1, "yes", 0.5])
def test_memmap_random_reads_must_be_a_bool_or_none(bad, tmp_path):
    with pytest.raises(bigper.InvalidArgumentError, match="random_reads"):
        open_buffer("memmap", tmp_path / "buf", 8, {"obs": ((2,), np.float32)},
                    storage_options={"random_reads": bad})
    assert not (tmp_path / "buf").exists()


def _spans(arrays: dict) -> dict:
    return {n: (a.ctypes.data, a.ctypes.data + a.nbytes) for n, a in arrays.items()}
