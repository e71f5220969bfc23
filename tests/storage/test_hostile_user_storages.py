"""Issue 40, cause 5: a user's storage through ``from_parts`` is checked
against what the buffer keeps in it, or works (promises 8 and 14).

A storage without the growing members (``rows``, ``grow``) allocates the
compressed log whole (``storage/base.py``): the log then holds every slot
from the start and never grows, instead of a raw ``NotImplementedError``.
A storage whose arrays are not the specs ``storage_specs(config)`` names (a
wrong dtype or row shape, a missing array, too few rows) is refused at
``from_parts`` with bigper's error naming the array, not a raw
``OverflowError``/``KeyError``/``IndexError`` at the first add; one that
claims a kind of bigper's own without being that storage is refused by name
(a snapshot would treat it as one: a raw ``AttributeError`` at ``save``).
"""

from __future__ import annotations

import numpy as np
import pytest

import bigper
from bigper.config import Config
from bigper.core.layout import allocate, storage_growth, storage_specs
from bigper.errors import InvalidArgumentError
from bigper.storage.base import StorageBase
from bigper.storage.memory import MemoryStorage

PRB = bigper.PrioritizedReplayBuffer
SHAPE = (8, 8)
FRAMED = dict(capacity=32, fields={"obs": ((2, *SHAPE), np.uint8), "reward": ((), np.float32)}, frame_stack=2,
              seed=1)


class DictStorage(StorageBase):
    """A user's storage on ``StorageBase`` alone: read and write, no growing
    members (so it allocates every array whole, as ``storage/base.py`` says)."""

    kind = "dict"

    def __init__(self, change=None):
        self.d, self.change = {}, change

    def open(self, config):
        return None

    def allocate(self, specs, growth=None):
        specs = dict(specs)
        if self.change is not None:
            self.change(specs)
        self.d = {n: np.zeros((rows, *shape), dtype) for n, (rows, shape, dtype) in specs.items()}

    def read(self, name, rows):
        return self.d[name][rows]

    def write(self, name, rows, values):
        self.d[name][rows] = values

    def flush(self):
        pass

    def close(self, state=None):
        pass

    def nbytes(self):
        return sum(a.nbytes for a in self.d.values())


class OneStep(DictStorage):
    """Honours ``growth`` (one step of the log) but cannot say how many rows it holds, nor grow."""

    def allocate(self, specs, growth=None):
        growth = growth or {}
        super().allocate({n: (min(r, growth[n]) if n in growth else r, sh, dt)
                          for n, (r, sh, dt) in specs.items()})


def _steps(n, seed=0):
    rng = np.random.default_rng(seed)
    for t in range(n):
        f = rng.integers(0, 256, size=(3, *SHAPE), dtype=np.uint8)  # noise: the log fills
        yield {"obs": f[:2], "next_obs": f[1:], "reward": np.float32(t), "terminated": t % 9 == 8}


def test_a_storage_without_growing_members_holds_the_compressed_log_whole():
    cfg = Config.build(**FRAMED, compression="zstd")
    store = DictStorage()
    allocate(store, cfg)
    buf = PRB.from_parts(cfg, store)
    twin = PRB(**FRAMED, compression="zstd")
    for step in _steps(200):  # many times the capacity: every slot of the log in use
        buf.add(**step)
        twin.add(**step)
    assert len(buf) == len(twin) == 32
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = buf.sample(8), twin.sample(8)
        assert np.array_equal(x.indices, y.indices)
        for k in x.keys():
            assert np.array_equal(np.asarray(x[k]), np.asarray(y[k])), k
        p = rng.random(8)
        buf.update_priorities(x, p)
        twin.update_priorities(y, p)
    buf.close()


def test_a_log_allocated_one_step_by_a_storage_that_cannot_grow_is_refused_by_name():
    cfg = Config.build(**FRAMED, compression="zstd")
    store = OneStep()
    allocate(store, cfg)
    before = {k: v.copy() for k, v in store.d.items()}
    with pytest.raises(InvalidArgumentError, match="frame_log"):
        PRB.from_parts(cfg, store)
    assert all(np.array_equal(before[k], store.d[k]) for k in before)


def _wrong_dtype(specs):
    rows, shape, _ = specs["reward"]
    specs["reward"] = (rows, shape, np.dtype(np.float16))


def _wrong_shape(specs):
    rows, shape, dtype = specs["frame_off"]
    specs["frame_off"] = (rows, (3,), dtype)


def _missing(specs):
    del specs["reward"]


def _too_few_rows(specs):
    rows, shape, dtype = specs["reward"]
    specs["reward"] = (rows - 1, shape, dtype)


def _frames_too_few(specs):
    rows, shape, dtype = specs["frames"]
    specs["frames"] = (rows - 1, shape, dtype)


@pytest.mark.parametrize("change, name", [(_wrong_dtype, "reward"), (_wrong_shape, "frame_off"),
                                          (_missing, "reward"), (_too_few_rows, "reward"),
                                          (_frames_too_few, "frames")])
@pytest.mark.parametrize("storage", ["memory", "read-write"])
def test_arrays_that_are_not_the_specs_are_refused_at_from_parts_naming_the_array(change, name, storage):
    cfg = Config.build(**FRAMED)
    if storage == "memory":
        store = MemoryStorage()
        specs = dict(storage_specs(cfg))
        change(specs)
        store.allocate(specs, storage_growth(cfg))
        data = store.arrays
    else:
        store = DictStorage(change)
        allocate(store, cfg)
        data = store.d
    before = {k: v.copy() for k, v in data.items()}
    with pytest.raises(InvalidArgumentError, match=repr(name)):
        PRB.from_parts(cfg, store)
    assert all(np.array_equal(before[k], data[k]) for k in before)


@pytest.mark.parametrize("claim", ["memmap", "hdf5"])
def test_a_storage_claiming_a_kind_of_bigpers_own_is_refused_by_name(claim):
    class Claims(MemoryStorage):
        kind = claim

    cfg = Config.build(**FRAMED)
    store = Claims()
    allocate(store, cfg)
    with pytest.raises(InvalidArgumentError, match=f"Claims claims kind={claim!r}"):
        PRB.from_parts(cfg, store)


def test_a_memory_storage_subclass_keeping_its_kind_is_taken():
    class Mine(MemoryStorage):
        pass

    cfg = Config.build(**FRAMED)
    store = Mine()
    allocate(store, cfg)
    buf = PRB.from_parts(cfg, store)
    for step in _steps(40):
        buf.add(**step)
    assert len(buf) == 32
    buf.close()
