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
    assert {"frame_ref", "frame_off", "frames"} <= taken or not KINDS[kind].get("frame_stack") or "zstd" in kind
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
    assert {"frames", "frame_ref", "frame_off", "frame_log", "frame_index", "_bigper"} <= set(layout.own_names())
    # and the names an older format stored, which a load still reads (converted): never a field's
    assert {"obs_ref", "next_obs_ref", "frames_minref"} <= set(layout.own_names())


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
    bad = dataclasses.replace(cfg, fields={**cfg.fields, "frame_ref": ((2,), "<i8")})
    with pytest.raises(RuntimeError, match="internal error.*frame_ref"):
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


# ---------------------------------------------------------------------------------------------
# 4, 6. One beta rule at every entry


def _betas():
    torch = pytest.importorskip("torch")
    from fractions import Fraction

    good = {"float": 0.5, "np.float32": np.float32(0.5), "np.float16": np.float16(0.5), "np.int64 0": np.int64(0),
            "int 1": 1, "Fraction": Fraction(1, 2), "0-d array": np.array(0.5), "0-d int array": np.array(1),
            "0-d tensor": torch.tensor(0.5), "0-d float64 tensor": torch.tensor(0.25, dtype=torch.float64)}
    bad = {"10**400": (10**400, InvalidArgumentError), "-10**400": (-10**400, InvalidArgumentError),
           "10**5000": (10**5000, InvalidArgumentError), "huge Fraction": (Fraction(10**400, 3), InvalidArgumentError),
           "nan": (float("nan"), InvalidArgumentError), "inf": (np.float32("inf"), InvalidArgumentError),
           "1.5": (1.5, InvalidArgumentError), "-0.1": (-0.1, InvalidArgumentError),
           "0-d array 2": (np.array(2.0), InvalidArgumentError), "0-d tensor nan": (torch.tensor(float("nan")),
                                                                                  InvalidArgumentError),
           "True": (True, bigper.InvalidTypeError), "np.bool_": (np.bool_(False), bigper.InvalidTypeError),
           "0-d bool tensor": (torch.tensor(True), bigper.InvalidTypeError), "str": ("0.5", bigper.InvalidTypeError),
           "complex": (0.5 + 0j, bigper.InvalidTypeError), "1-d array": (np.array([0.5]), bigper.InvalidTypeError),
           "None-ish list": ([0.5], bigper.InvalidTypeError), "0-d str array": (np.array("0.5"), bigper.InvalidTypeError)}
    return good, bad


F3 = {"obs": ((3,), np.float32), "reward": ((), np.float32)}


def _filled(**kw) -> PRB:
    buf = PRB(capacity=16, fields=F3, seed=3, **kw)
    for t in range(10):
        buf.add(obs=np.full(3, t, np.float32), next_obs=np.full(3, t + 1, np.float32), reward=np.float32(t),
                terminated=False, truncated=t % 4 == 3)
    buf.update_priorities(np.arange(10), np.linspace(0.1, 2.0, 10))
    return buf


def _entries():
    """Every entry that takes a beta: ``(name, call(buffer, beta) -> a Batch or a number)``."""
    def sampler(b, beta, prefetch):
        it = b.sampler(4, prefetch=prefetch, beta=beta)
        try:
            return next(it)
        finally:
            it.close()

    return {
        "constructor": lambda b, beta: _filled(beta=beta).sample(4),
        "LinearSchedule": lambda b, beta: _filled(beta=bigper.LinearSchedule(beta, 1.0, 4)).sample(4),
        "LinearSchedule end": lambda b, beta: _filled(beta=bigper.LinearSchedule(0.0, beta, 1)).sample(4),
        "ConstantSchedule": lambda b, beta: _filled(beta=bigper.ConstantSchedule(beta)).sample(4),
        "sample": lambda b, beta: b.sample(4, beta=beta),
        "sampler prefetch=0": lambda b, beta: sampler(b, beta, 0),
        "sampler prefetch=1": lambda b, beta: sampler(b, beta, 1),
        "shard.sample_at": lambda b, beta: b.shard.sample_at(np.array([0.5, 3.0, 7.5]), beta=beta),
    }


def _state(b: PRB):
    meta, arrays = b.state_dict()
    return json.dumps(meta, sort_keys=True, default=str), {k: np.array(v) for k, v in arrays.items()}


@pytest.mark.parametrize("entry", sorted(_entries()))
def test_every_entry_takes_a_beta_of_any_real_type_as_its_float(entry):
    good, _ = _betas()
    call = _entries()[entry]
    for name, value in good.items():
        got = call(_filled(), value)
        want = call(_filled(), float(value))
        np.testing.assert_array_equal(got.weights, want.weights, err_msg=name)
        np.testing.assert_array_equal(got.indices, want.indices, err_msg=name)


@pytest.mark.parametrize("entry", sorted(_entries()))
def test_every_entry_refuses_what_is_no_beta_with_bigpers_error_and_changes_nothing(entry):
    _, bad = _betas()
    call = _entries()[entry]
    for name, (value, error) in bad.items():
        b = _filled()
        before = _state(b)
        with pytest.raises(error, match="beta") as e:
            call(b, value)
        assert type(e.value).__module__ == "bigper.errors", (name, e.value)
        after = _state(b)
        assert before[0] == after[0], name
        assert all(np.array_equal(before[1][k], after[1][k]) for k in before[1]), name
        b.close()


def test_a_sampler_refuses_a_bad_beta_when_it_is_made_not_at_its_first_draw():
    b = _filled()
    for value in (10**400, "0.5", np.array([0.5])):
        with pytest.raises(InvalidArgumentError, match="beta"):
            b.sampler(4, prefetch=0, beta=value)
        with pytest.raises(InvalidArgumentError, match="beta"):
            b.sampler(4, prefetch=2, beta=value)


def test_a_schedule_records_plain_json_numbers_whatever_it_was_given():
    from fractions import Fraction

    s = bigper.LinearSchedule(np.float32(0.25), Fraction(1, 1), np.int64(10))
    assert s.to_dict() == {"kind": "linear", "start": 0.25, "end": 1.0, "steps": 10}
    assert json.loads(json.dumps(s.to_dict())) == s.to_dict()
    assert bigper.ConstantSchedule(np.array(0.5)).to_dict() == {"kind": "constant", "value": 0.5}


# -- the SB3 drop-in ------------------------------------------------------------------------


def _sb3():
    pytest.importorskip("stable_baselines3")
    from gymnasium import spaces

    from bigper.integrations import sb3

    return sb3, spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2)


def test_the_sb3_drop_in_anneals_a_beta_of_any_real_type_as_its_float():
    """The issue's case: ``np.float32(0.5)``, ``np.int64``, ``Fraction`` were taken
    for schedules, and ``learn`` never annealed them."""
    sb3, obs, act = _sb3()
    good, _ = _betas()
    for name, value in good.items():
        rb = sb3.PrioritizedReplayBuffer(64, obs, act, device="cpu", beta=value)
        twin = sb3.PrioritizedReplayBuffer(64, obs, act, device="cpu", beta=float(value))
        assert not rb.beta_is_schedule, name
        for progress in (1.0, 0.5, 0.0):
            assert rb.beta_for_learner(progress) == twin.beta_for_learner(progress), (name, progress)
        assert rb.beta_for_learner(0.0) == 1.0, name
    schedule = bigper.LinearSchedule(0.4, 1.0, 10)
    assert sb3.PrioritizedReplayBuffer(64, obs, act, device="cpu", beta=schedule).beta_is_schedule


def test_a_prioritized_dqn_anneals_an_np_float32_beta_through_learn():
    sb3, _, _ = _sb3()
    seen = {}
    for beta in (np.float32(0.5), 0.5):
        m = sb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=20,
                               buffer_size=200, batch_size=8, train_freq=4, policy_kwargs={"net_arch": [8]},
                               replay_buffer_kwargs={"beta": beta})
        m.learn(120)
        seen[type(beta).__name__] = (m.replay_buffer.beta, m.last_beta)
    assert seen["float32"] == seen["float"], seen
    assert seen["float"][0] > 0.9, seen


@pytest.mark.parametrize("where", ["constructor", "sample"])
def test_the_sb3_drop_in_refuses_what_is_no_beta_with_bigpers_error(where):
    sb3, obs, act = _sb3()
    _, bad = _betas()
    good, _ = _betas()
    for name, (value, error) in bad.items():
        with pytest.raises(error, match="beta") as e:
            if where == "constructor":
                sb3.PrioritizedReplayBuffer(64, obs, act, device="cpu", beta=value)
            else:
                rb = sb3.PrioritizedReplayBuffer(64, obs, act, device="cpu")
                rb.add(np.zeros((1, 3), np.float32), np.ones((1, 3), np.float32), np.zeros(1), np.ones(1),
                       np.zeros(1), [{}])
                rb.sample(2, beta=value)
        assert type(e.value).__module__ == "bigper.errors", (name, e.value)
    rb = sb3.PrioritizedReplayBuffer(64, obs, act, device="cpu")
    rb.add(np.zeros((1, 3), np.float32), np.ones((1, 3), np.float32), np.zeros(1), np.ones(1), np.zeros(1), [{}])
    for name, value in good.items():  # 0-d arrays and tensors as the bigper buffer's sample takes them
        assert rb.sample(2, beta=value).weights.shape == (2, 1), name


# ---------------------------------------------------------------------------------------------
# 7. The smaller inconsistencies


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_a_sampler_after_its_buffers_close_raises_buffer_closed_at_every_next(prefetch):
    """``prefetch=0`` raised ``BufferClosedError`` once and then ``StopIteration``,
    which ends a learner's loop as if the data had run out; now every prefetch
    behaves as the docstring says."""
    b = _filled()
    it = b.sampler(4, prefetch=prefetch)
    next(it)
    b.close()
    for _ in range(3):
        with pytest.raises(bigper.BufferClosedError):
            next(it)
    with pytest.raises(bigper.BufferClosedError):
        for _ in it:
            pass


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_sampler_ends_quietly_on_its_own_close_and_after_another_error_once(prefetch):
    b = _filled()
    it = b.sampler(4, prefetch=prefetch)
    next(it)
    it.close()
    assert list(it) == []
    empty = PRB(capacity=8, fields=F3)
    it = empty.sampler(2, prefetch=prefetch)
    with pytest.raises(InvalidArgumentError, match="no sampleable"):
        next(it)
    assert list(it) == []  # (an empty buffer's error is raised once, and ends it: as with a thread)
    empty.close()
    with pytest.raises(bigper.BufferClosedError):
        empty.sampler(2, prefetch=prefetch)


def _tier_and_host():
    pytest.importorskip("torch")
    return _filled(device="cpu"), _filled()


def test_to_torch_twice_on_a_tier_batch_gives_each_call_its_own_bookkeeping_tensors():
    tier, host = _tier_and_host()
    last = {}
    for buf in (tier, host):
        batch = buf.sample(6)
        a, b = batch.to_torch("cpu"), batch.to_torch("cpu")
        for key in ("weights", "indices", "generations"):
            assert a[key] is not b[key] and a[key].data_ptr() != b[key].data_ptr(), (buf.device, key)
        want = {k: a[k].clone() for k in ("weights", "indices", "generations")}
        a["weights"].mul_(0)
        a["indices"].fill_(0)
        a["generations"].fill_(-7)
        c = batch.to_torch("cpu")
        for key, v in want.items():
            assert b[key].equal(v) and c[key].equal(v), (buf.device, key)
        np.testing.assert_array_equal(c["indices"].numpy(), batch.indices)
        last[buf.device is not None] = (buf, c)
    for buf, c in last.values():  # a later call's dict is a target as the first one is
        buf.update_priorities(c, np.linspace(0.5, 3.0, 6))
    np.testing.assert_array_equal(tier.state_dict()[1]["leaves"], host.state_dict()[1]["leaves"])


@pytest.mark.parametrize("tier", [False, True])
def test_an_in_place_change_to_to_torch_indices_is_ignored_by_the_update(tier):
    """Documented in ``update_priorities``: a ``to_torch`` dict is read from the
    host copies made with it while it holds its own tensors; a new tensor under
    the key is read as given."""
    torch = pytest.importorskip("torch")
    a, twin = (_filled(device="cpu"), _filled(device="cpu")) if tier else (_filled(), _filled())
    batch, twin_batch = a.sample(4), twin.sample(4)
    np.testing.assert_array_equal(batch.indices, twin_batch.indices)
    t = batch.to_torch("cpu")
    t["indices"].add_(1)  # in place: ignored
    a.update_priorities(t, np.full(4, 5.0))
    twin.update_priorities(twin_batch, np.full(4, 5.0))
    np.testing.assert_array_equal(a.state_dict()[1]["leaves"], twin.state_dict()[1]["leaves"])
    other = (batch.indices + 1) % 10
    t2 = batch.to_torch("cpu")
    t2["indices"] = torch.as_tensor(other)  # replaced: read as it is (raw slots, no generation check)
    t2.pop("generations")
    a.update_priorities(t2, np.full(4, 0.25))
    twin.update_priorities(other, np.full(4, 0.25))
    np.testing.assert_array_equal(a.state_dict()[1]["leaves"], twin.state_dict()[1]["leaves"])
    assert "in place" in PRB.update_priorities.__doc__ and "ignored" in PRB.update_priorities.__doc__


@pytest.mark.parametrize("target", ["np.float64", "float", "0-d array", "0-d tensor"])
def test_shard_sample_at_refuses_one_number_as_update_priorities_refuses_one_index(target):
    """Targets are a 1-D array, like the raw indices of ``update_priorities``;
    a 0-d one was made 1-D by ``ascontiguousarray`` and taken."""
    torch = pytest.importorskip("torch")
    value = {"np.float64": np.float64(0.1), "float": 0.1, "0-d array": np.array(0.1),
             "0-d tensor": torch.tensor(0.1)}[target]
    b = _filled()
    before = _state(b)
    with pytest.raises(InvalidArgumentError, match="1-D"):
        b.shard.sample_at(value, beta=0.5)
    with pytest.raises(InvalidArgumentError, match="1-D"):
        b.update_priorities(np.asarray(value).astype(np.int64), 1.0)
    after = _state(b)
    assert before[0] == after[0]
    assert b.shard.sample_at(np.array([0.1]), beta=0.5).indices.shape == (1,)


def test_a_loaded_models_buffer_refuses_to_sample_before_learn_and_makes_no_file(tmp_path, monkeypatch):
    """Promise 15: a refusal makes no file. The loaded model's buffer was opened
    (its storage folder made) by ``sample`` before the refusal."""
    sb3, _, _ = _sb3()
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    run.mkdir()
    fresh.mkdir()
    monkeypatch.chdir(run)
    m = sb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", device="cpu", seed=0, learning_starts=20, buffer_size=200,
                           batch_size=8, policy_kwargs={"net_arch": [8]},
                           replay_buffer_kwargs={"storage": "memmap", "path": "runs/x/replay"})
    m.learn(30)
    m.save("model.zip")
    m.replay_buffer.close()
    monkeypatch.chdir(fresh)
    before = fingerprint(tmp_path)
    loaded = sb3.PrioritizedDQN.load(run / "model.zip", device="cpu")
    with pytest.raises(InvalidArgumentError, match="holds no transition"):
        loaded.replay_buffer.sample(4)
    with pytest.raises(InvalidArgumentError, match="holds no transition"):
        loaded.replay_buffer.update_priorities(np.arange(2), np.ones(2))
    assert fingerprint(tmp_path) == before, "a refused sample made files"
    monkeypatch.chdir(run)  # where the path holds the saved run's buffer: it resumes and samples
    resumed = sb3.PrioritizedDQN.load(run / "model.zip", device="cpu",
                                      replay_buffer_kwargs={"storage": "memmap", "path": "runs/x/replay",
                                                            "mode": "resume"})
    assert resumed.replay_buffer.sample(4).weights.shape == (4, 1)
    resumed.replay_buffer.close()


def test_a_d4rl_dataset_whose_extra_columns_take_bigpers_names_opens_without_them(tmp_path):
    """A D4RL file's extra per-step datasets become fields; one called like an
    array or key of bigper's own (``status``, ``frames``, ``weights``) is skipped
    with a note, as ``discount`` was, not a refusal of the whole dataset."""
    h5py = pytest.importorskip("h5py")
    n = 12
    path = tmp_path / "d.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        f["actions"] = np.zeros((n, 2), np.float32)
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = (np.arange(n) % 6 == 5).astype(np.float32)
        f["timeouts"] = np.zeros(n, bool)
        for name in ("status", "frames", "weights", "obs_ref", "kept"):
            f[name] = np.arange(n, dtype=np.int64)
    before = fingerprint(tmp_path)
    with PRB.from_hdf5(path) as buf:
        assert "kept" in buf.config.fields
        assert not set(buf.config.fields) & set(layout.own_names())
        batch = buf.sample(4)
        np.testing.assert_array_equal(batch["kept"], batch.indices)
    from bigper.offline.datasets import describe

    text = describe(path)
    for name in ("status", "frames", "weights", "obs_ref"):
        assert name in text, text
    after = fingerprint(tmp_path)
    assert {k for k in after if k not in before} <= {k for k in after if "priorities" in k or k.endswith(".lock")}
