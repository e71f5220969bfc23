"""Issue 42: a new storage is one file and one registration line.

``RowCountingStorage`` below is the whole of a new storage kind (a memory
storage that counts the rows written through it), and ``register`` is the
one line that makes ``storage="counting"`` a name a buffer, a snapshot, a
load and ``bigper verify`` know. docs/development.md, "Add a storage",
walks through the same steps and names these files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import storage
from bigper.cli import main
from bigper.errors import IncompatibleSnapshotError, InvalidArgumentError, InvalidTypeError
from bigper.storage.base import StorageBase
from bigper.storage.memory import MemoryStorage

FIELDS = {"obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
ROOT = Path(__file__).resolve().parents[2]


class RowCountingStorage(MemoryStorage):
    """A storage kind of its own: arrays in memory, and a count of the
    writes made through ``write`` (a load fills its rows that way)."""

    kind = "counting"

    def __init__(self):
        super().__init__()
        self.writes = 0

    def write(self, name, rows, values):
        self.writes += 1
        super().write(name, rows, values)


@pytest.fixture
def counting():
    storage.register(RowCountingStorage)  # the one registration line
    try:
        yield RowCountingStorage
    finally:
        storage._REGISTERED.pop("counting", None)  # tests leave the registry as they found it


def _fill(buf, n=40, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        buf.add(obs=rng.random(3, dtype=np.float32), action=i, reward=float(i),
                next_obs=rng.random(3, dtype=np.float32), terminated=i % 9 == 8)


def test_a_registered_storage_runs_add_sample_save_load_verify(counting, tmp_path, capsys):
    buf = bigper.PrioritizedReplayBuffer(capacity=32, fields=FIELDS, storage="counting", seed=3)
    assert type(buf.storage) is RowCountingStorage and buf.config.storage == "counting"
    _fill(buf)
    b = buf.sample(8)
    buf.update_priorities(b, np.abs(b["reward"]) + 0.5)
    snap = buf.save(tmp_path / "snap")
    twin = bigper.PrioritizedReplayBuffer.load(snap)
    assert type(twin.storage) is RowCountingStorage and twin.storage.writes > 0
    assert twin.config == buf.config
    for _ in range(3):  # resume is exact: the next batches are the ones the saved buffer draws
        x, y = buf.sample(8), twin.sample(8)
        np.testing.assert_array_equal(x.indices, y.indices)
        for key in ("obs", "next_obs", "action", "reward", "discount"):
            np.testing.assert_array_equal(x[key], y[key])
        np.testing.assert_array_equal(x.weights, y.weights)
    assert main(["verify", str(snap)]) == 0
    assert "OK" in capsys.readouterr().out
    with pytest.raises(InvalidArgumentError, match="takes no path="):
        bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "live")
    buf.close()
    twin.close()


def test_a_registered_memory_kind_takes_no_path_and_no_options(counting, tmp_path):
    with pytest.raises(InvalidArgumentError, match="storage='counting' takes no path"):
        bigper.PrioritizedReplayBuffer(capacity=8, fields=FIELDS, storage="counting", path=tmp_path / "x")
    with pytest.raises(InvalidArgumentError, match="which storage='counting' does not take"):
        bigper.PrioritizedReplayBuffer(capacity=8, fields=FIELDS, storage="counting",
                                       storage_options={"takeover": True})


def test_an_unregistered_kind_is_refused_by_name(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"storage must be one of \('memory', 'memmap', 'hdf5'\), "
                                                   r"got 'counting'"):
        bigper.PrioritizedReplayBuffer(capacity=8, fields=FIELDS, storage="counting")
    for bad in (["memory"], None, 3, b"memory"):
        with pytest.raises(InvalidArgumentError, match="storage must be one of"):
            bigper.PrioritizedReplayBuffer(capacity=8, fields=FIELDS, storage=bad)


def test_a_snapshot_of_a_kind_no_longer_registered_is_incompatible(counting, tmp_path):
    buf = bigper.PrioritizedReplayBuffer(capacity=16, fields=FIELDS, storage="counting", seed=0)
    _fill(buf, 10)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    storage._REGISTERED.pop("counting")
    with pytest.raises(IncompatibleSnapshotError, match="counting"):
        bigper.PrioritizedReplayBuffer.load(snap)


def test_register_refuses_what_is_not_a_kind_of_its_own(counting):
    class Impostor(MemoryStorage):
        kind = "memmap"

    class Twin(MemoryStorage):
        kind = "counting"

    class Unnamed(MemoryStorage):
        pass  # inherits "memory": no kind of its own

    class Shouting(MemoryStorage):
        kind = "Loud"

    for cls in (Impostor, Twin):
        with pytest.raises(InvalidArgumentError, match="is taken"):
            storage.register(cls)
    for cls in (Unnamed, Shouting):
        with pytest.raises(InvalidArgumentError, match="kind of its own|own lower-case identifier"):
            storage.register(cls)
    for bad in (object, "counting", RowCountingStorage(), dict):
        with pytest.raises(InvalidTypeError, match="subclass of bigper.storage.StorageBase"):
            storage.register(bad)
    assert storage.register(RowCountingStorage) is RowCountingStorage  # again: the same class, no change
    assert storage.kinds() == ("memory", "memmap", "hdf5", "counting")


def test_a_storage_claiming_a_registered_kind_without_being_it_is_refused(counting):
    class Claimer(StorageBase):
        kind = "counting"

    cfg = bigper.PrioritizedReplayBuffer(capacity=8, fields=FIELDS, storage="counting").config
    with pytest.raises(InvalidArgumentError, match="claims kind='counting'"):
        bigper.PrioritizedReplayBuffer.from_parts(cfg, Claimer())


def test_what_every_kind_answers():
    """bigper's own kinds answer the questions that used to be ``kind ==`` branches."""
    mem, mm, h5 = (storage.storage_class(k) for k in ("memory", "memmap", "hdf5"))
    assert (mem.in_memory, mm.in_memory, h5.in_memory) == (True, False, False)
    assert (mem.chunked, mm.chunked, h5.chunked) == (False, True, False)
    assert (mem.options, mm.options, h5.options) == ((), ("random_reads", "chunk_bytes"), ("compression",))
    assert (mem.close_first_at_exit, mm.close_first_at_exit, h5.close_first_at_exit) == (False, False, True)
    assert mm.lock_path(Path("/x/run")) == Path("/x/run/.lock")
    assert h5.lock_path(Path("/x/run.h5")) == Path("/x/run.h5.lock")
    assert mem.lock_path(Path("/x")) is None and mem.recognizes(Path("/")) is False
    assert not storage.in_memory("counting") and not storage.in_memory(["memory"]) and storage.in_memory("memory")
    with pytest.raises(InvalidArgumentError, match="storage must be one of"):
        storage.storage_class("nope")


def test_the_worked_example_names_files_that_exist():
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("## Add a storage", 1)[1].split("\n## ", 1)[0]
    named = {w.strip("`,.:()") for w in section.split() if w.startswith("`") and "/" in w}
    named = {n for n in named if n.endswith(".py") and "<" not in n}
    assert len(named) >= 6, named  # the worked example names the files it touches and those it does not
    for name in named:
        assert (ROOT / name).is_file(), name
