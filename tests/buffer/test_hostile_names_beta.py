"""Hostile tests of issue 40, causes 1, 4, 6 and 7: names bigper keeps for
itself, the one beta rule, and the smaller inconsistencies.

1. A field could take the name of one of bigper's own arrays (``frames``,
   ``obs_ref``, ``frame_log``, the HDF5 record ``_bigper``, ...) and then
   shared the array: silent corruption, or a raw error at the first add or
   close. Every name bigper stores, in a storage or a state, and every key of
   a batch or ``to_torch`` dict, is now refused at construction with the list
   of what is taken (promise 17); the names are collected here from real
   buffers of every kind on every storage, so a new array cannot be missed.
4, 6. What a beta is was decided in several places: the SB3 drop-in stopped
   annealing for ``np.float32(0.5)``, ``np.int64`` and ``Fraction``; ``10**400``
   was a raw ``OverflowError``; 0-d arrays and tensors were taken by
   ``sample(beta=)`` and refused by the constructor. One function decides now,
   and every entry is held to it here.
7. The smaller ones, each with its test below.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import PrioritizedReplayBuffer as PRB
from bigper import Sequence
from bigper.core import layout
from bigper.core.layout import storage_specs
from bigper.errors import IncompatibleSnapshotError, InvalidArgumentError
from bigper.storage.memory import MemoryStorage

from tests._hostile_snapshot_cases import fingerprint, resign

OBS = ((2, 4, 4), np.uint8)

# One config of every kind whose arrays are named differently (and the rank strategy,
# whose state array is its own), each with the fields its kind needs.
KINDS = {
    "plain": dict(fields={"obs": ((3,), np.float32), "reward": ((), np.float32)}),
    "n_step": dict(fields={"obs": ((3,), np.float32), "reward": ((), np.float32)}, n_step=3),
    "rank": dict(fields={"obs": ((3,), np.float32)}, prioritization="rank"),
    "stack": dict(fields={"obs": OBS}, frame_stack=2),
    "stack_envs": dict(fields={"obs": OBS}, frame_stack=2, num_envs=2),
    "stack_no_next": dict(fields={"obs": OBS}, frame_stack=2, next_of=()),
    "zstd": dict(fields={"obs": OBS}, frame_stack=2, compression="zstd"),
    "zstd_budget": dict(fields={"obs": OBS}, frame_stack=2, compression="zstd", compression_budget=64),
    "sequence": dict(fields={"obs": ((3,), np.float32)}, sequence=Sequence(length=2, burn_in=1)),
    "sequence_stack": dict(fields={"obs": OBS}, frame_stack=2, sequence=Sequence(length=2)),
}
STORAGES = ("memory", "memmap", "hdf5")


def _buffer(kind: str, storage: str, tmp: Path, extra: dict | None = None, **over) -> PRB:
    kw = {**KINDS[kind], **over}
    kw["fields"] = {**kw["fields"], **(extra or {})}
    path = None if storage == "memory" else tmp / f"buf-{kind}-{storage}{'.h5' if storage == 'hdf5' else ''}"
    return PRB(capacity=32, storage=storage, path=path, seed=1, **kw)


def _fill(buf: PRB, steps: int = 12) -> None:
    rng = np.random.default_rng(0)
    envs = buf.config.num_envs
    for t in range(steps):
        row = {}
        for name, (shape, dt) in buf.config.step_inputs().items():
            if name in ("terminated", "truncated"):
                continue
            lead = (envs,) if envs > 1 else ()
            row[name] = rng.integers(0, 100, size=lead + tuple(shape)).astype(dt)
        flag = np.zeros(envs, bool) if envs > 1 else False
        buf.add(**row, terminated=flag, truncated=(t % 5 == 4) | flag)


def _names_bigper_stores(kind: str, storage: str, tmp: Path) -> set[str]:
    """Every name a real buffer of ``kind`` on ``storage`` gives something of its own:
    its storage's arrays, its recorded state, what it keeps on disk beside the
    arrays, and the keys of a batch and of its ``to_torch`` dict; less the fields'."""
    buf = _buffer(kind, storage, tmp)
    user = set(buf.config.fields) | {f"next_{n}" for n in buf.config.next_of}  # the user's names
    _fill(buf)
    names = set(storage_specs(buf.config)) | set(buf.state_dict()[1])
    batch = buf.sample(4)
    names |= set(batch.keys()) | set(batch.to_torch("cpu"))
    path = buf.storage.path
    buf.close()
    if storage == "memmap":
        names |= set(json.loads((path / "meta.json").read_text())["arrays"])
        names |= {p.name[:-4] for p in (path / "state").iterdir()}
    elif storage == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            names |= set(f.keys())
    return names - user


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_name_bigper_stores_is_refused_as_a_field(kind, storage, tmp_path):
    taken = _names_bigper_stores(kind, storage, tmp_path)
    assert {"obs_ref", "frames"} <= taken or not KINDS[kind].get("frame_stack") or "zstd" in kind
    for name in sorted(taken):
        before = fingerprint(tmp_path)
        with pytest.raises(InvalidArgumentError, match="names taken are") as e:
            _buffer(kind, storage, tmp_path, {name: ((4,), np.int64)})
        assert repr(name) in str(e.value)
        assert fingerprint(tmp_path) == before, f"refusing field {name!r} changed the disk"
    assert taken <= set(layout.own_names())


def test_own_names_holds_every_kinds_storage_specs_and_prioritization_arrays():
    """``own_names`` is derived from the code that makes the arrays: each
    strategy's declared ``ARRAYS`` are what its ``state`` records."""
    from bigper.prioritization import STRATEGIES

    for strategy in STRATEGIES.values():
        p = strategy(8, alpha=0.6, eps=1e-6, max_priority=np.inf, weight_norm="global")
        assert set(p.state()[1]) == set(strategy.ARRAYS)
    assert {"frames", "obs_ref", "next_obs_ref", "frame_log", "frame_index", "_bigper"} <= set(layout.own_names())


def test_a_frames_field_beside_a_frame_stack_is_refused_not_shared(tmp_path):
    """The issue's case: a ``frames`` field with ``frame_stack=4`` was taken, and
    its values overwrote the frame ring."""
    fields = {"obs": ((4, 6, 6), np.uint8), "frames": ((6, 6), np.uint8)}
    with pytest.raises(InvalidArgumentError, match="'frames'.*names taken are.*obs_ref"):
        PRB(capacity=64, fields=fields, frame_stack=4)
    with pytest.raises(InvalidArgumentError, match="'frame_log'"):
        PRB(capacity=64, fields={"obs": ((4, 6, 6), np.uint8), "frame_log": ((8,), np.uint8)},
            frame_stack=4, compression="zstd")
    with pytest.raises(InvalidArgumentError, match="'_bigper'"):
        PRB(capacity=8, fields={"obs": ((3,), np.float32), "_bigper": ((2,), np.float32)},
            storage="hdf5", path=tmp_path / "b.h5")
    assert not os.path.lexists(tmp_path / "b.h5")


def test_from_parts_refuses_a_config_whose_field_takes_an_own_name():
    cfg = bigper.config.Config.build(capacity=8, fields={"obs": ((3,), np.float32), "gid": ((2,), np.int64)})
    with pytest.raises(InvalidArgumentError, match="'gid'"):
        PRB.from_parts(cfg, MemoryStorage())


def test_the_layout_never_gives_two_arrays_one_name():
    """A config that slipped past the checks (made without ``build``) is an
    internal error in ``storage_specs``, never two specs under one name."""
    cfg = bigper.config.Config.build(capacity=8, fields={"obs": ((2, 3, 3), np.uint8)}, frame_stack=2)
    bad = dataclasses.replace(cfg, fields={**cfg.fields, "obs_ref": ((2,), "<i8")})
    with pytest.raises(RuntimeError, match="internal error.*obs_ref"):
        storage_specs(bad)


def test_a_snapshot_whose_config_names_an_own_array_is_refused_and_makes_nothing(tmp_path):
    buf = PRB(capacity=8, fields={"obs": ((3,), np.float32), "x": ((2,), np.float32)})
    _fill(buf, 5)
    snap = buf.save(tmp_path / "snap")
    buf.close()

    def rename(body):
        f = body["config"]["fields"]
        f["status"] = f.pop("x")
        body["data"]["status"] = body["data"].pop("x")

    resign(snap, rename)
    before = fingerprint(tmp_path)
    with pytest.raises(IncompatibleSnapshotError, match="'status'"):
        PRB.load(snap)
    assert fingerprint(tmp_path) == before
