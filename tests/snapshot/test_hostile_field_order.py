"""An attack on ``field_order`` (the fields' own order, recorded beside the
sorted JSON keys of a config: ``Config.to_dict`` / ``from_dict``) through every
reader of a recorded config: resume of a memmap folder and an HDF5 file (also
read-only), ``from_hdf5``, ``verify`` of a live path, ``bigper verify`` /
``bigper info``, snapshot load and ``Snapshots.load_latest``, ``convert``, the
TorchRL drop-in's ``load_state_dict`` / ``loads`` / resume, the SB3 pickle and
the sharded Ray buffer's manifest (that case in tests/distributed/test_ray_laptop.py,
on the local Ray instance it starts).

Each reader: (1) a buffer with unsorted fields comes back with their order;
(2) a crafted ``field_order`` is refused naming ``field_order``, the files and
the buffer as they were; (3) sorted fields record none (the committed
fixtures' configs read back to themselves); (4) the older fixtures still load."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.config import Config
from bigper.errors import BigperError, IncompatibleSnapshotError, InvalidArgumentError
from bigper.snapshot.live import verify_live
from bigper.snapshot.manifest import MANIFEST, decode
from tests._hostile_snapshot_cases import deadline, fingerprint, resign

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
FIELDS = {"z": ((), np.float32), "a": ((2,), np.int64), "m": ((), np.uint8)}
NAMES = ["z", "a", "m"]
ORDER = NAMES + ["terminated", "truncated", "discount"]

# every shape of a wrong field_order: empty, a name missing, a duplicate, sorted (never written), not a list,
# items not str, an unknown name, a huge list, null, nested lists, an object, a name of bigper's own
CRAFTED = [[], ["z", "a"], ["z", "a", "m", "m"], ["a", "m", "z"], "zam", [1, 2, 3], ["z", "a", "q"],
           ["z", "a", "m", "q"], ["z"] * 200_000, None, [["z"], ["a"], ["m"]], [["z", "a", "m"]],
           {"z": 0, "a": 1, "m": 2}, ["z", "a", "m", "terminated"], True, ["z", "a", None], ["Z", "a", "m"]]
IDS = [repr(o)[:20] for o in CRAFTED]
FEW = [[], ["a", "m", "z"], None, [["z"], ["a"], ["m"]]]  # (for the slower readers)


def _fill(buf, n=30, fields=FIELDS):
    for t in range(n):
        buf.add(**{k: np.full(s, t).astype(d) for k, (s, d) in fields.items()}, terminated=t % 9 == 8)
    return buf


def _buffer(storage="memory", path=None, fields=FIELDS, **kw):
    buf = bigper.PrioritizedReplayBuffer(capacity=50, fields=fields, seed=0, storage=storage,
                                         **({} if path is None else {"path": path}), **kw)
    return _fill(buf, fields=fields)


def _live(kind, tmp_path, fields=FIELDS):
    path = tmp_path / ("b.h5" if kind == "hdf5" else "b")
    _buffer(kind, path, fields=fields).close()
    return path


def _record(kind, path) -> dict:
    if kind == "memmap":
        return json.loads((path / "meta.json").read_text())
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f["_bigper"].attrs["meta"])


def _set_order(kind, path, order, drop=False):
    """The live storage's recorded config given ``field_order`` = ``order`` (as an attacker would)."""
    meta = _record(kind, path)
    if drop:
        meta["config"].pop("field_order", None)
    else:
        meta["config"]["field_order"] = order
    if kind == "memmap":
        (path / "meta.json").write_text(json.dumps(meta))
        return
    import h5py

    with h5py.File(path, "r+") as f:
        f["_bigper"].attrs["meta"] = json.dumps(meta)


def _resume(kind, path, read_only=False, fields=FIELDS):
    return bigper.PrioritizedReplayBuffer(capacity=50, fields=fields, storage=kind, path=path, mode="resume",
                                          read_only=read_only)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bigper", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- (1) the order comes back through every reader ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_a_resumed_storage_gives_the_fields_in_their_order(kind, tmp_path):
    path = _live(kind, tmp_path)
    assert _record(kind, path)["config"]["field_order"] == NAMES
    for read_only in (False, True):
        buf = _resume(kind, path, read_only=read_only)
        assert list(buf.sample(4).data) == ORDER
        assert list(buf.config.fields) == NAMES
        buf.close()
    v = verify_live(path)
    assert v.status == "OK", v
    r = _cli("verify", path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_the_recorded_order_is_a_recorded_config_not_a_layout_key(kind, tmp_path):
    """A resume given the same fields in another order is the same layout: it
    runs in the order it was given, and leaves the record as it was."""
    path = _live(kind, tmp_path)
    before = _record(kind, path)["config"]
    buf = _resume(kind, path, fields=dict(sorted(FIELDS.items())))
    assert list(buf.sample(4).data)[:3] == ["a", "m", "z"]
    buf.close()
    assert _record(kind, path)["config"] == before
    buf = _resume(kind, path, read_only=True)
    assert list(buf.sample(4).data) == ORDER
    buf.close()


def test_an_older_hdf5_record_without_field_order_reads_its_json_order(tmp_path):
    """HDF5 records its meta with ``json.dumps`` unsorted: a file written before
    ``field_order`` existed reads its fields in the order its JSON has them."""
    path = _live("hdf5", tmp_path)
    _set_order("hdf5", path, None, drop=True)
    assert list(_record("hdf5", path)["config"]["fields"]) == NAMES  # (unsorted JSON)
    buf = _resume("hdf5", path, read_only=True)
    assert list(buf.sample(4).data) == ORDER
    buf.close()
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(path)
    assert list(ds.sample(4).data) == ORDER
    ds.close()
    assert verify_live(path).status == "OK"


def test_a_snapshot_series_keeps_the_order(tmp_path):
    snaps = bigper.Snapshots(tmp_path / "series", keep=3)
    buf = _buffer()
    snaps.save(buf)
    _fill(buf, 5)
    snaps.save(buf)
    buf.close()
    again = snaps.load_latest()
    assert list(again.sample(4).data) == ORDER
    again.close()
    r = _cli("info", tmp_path / "series")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_snapshot_loaded_into_a_live_path_keeps_the_order(tmp_path):
    buf = _buffer("memmap", tmp_path / "live")
    buf.save(tmp_path / "snap")
    buf.close()
    again = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "live2")
    assert list(again.sample(4).data) == ORDER
    again.close()
    assert _record("memmap", tmp_path / "live2")["config"]["field_order"] == NAMES
    back = _resume("memmap", tmp_path / "live2", read_only=True)
    assert list(back.sample(4).data) == ORDER
    back.close()


def test_convert_of_a_bigper_file_keeps_the_order(tmp_path):
    from bigper.convert import convert

    fields = {"reward": ((), np.float32), "obs": ((4, 6, 6), np.uint8), "action": ((), np.int32)}
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields=fields, next_of=("obs",), storage="hdf5",
                                         path=tmp_path / "src.h5", seed=0)
    for t in range(40):
        o = np.full((4, 6, 6), t, np.uint8)
        buf.add(reward=np.float32(t), obs=o, next_obs=o + 1, action=np.int32(t), terminated=t % 10 == 9)
    buf.close()
    convert(tmp_path / "src.h5", tmp_path / "dst.h5", progress=False)
    out = bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "dst.h5")
    assert list(out.config.fields) == ["reward", "obs", "action"]
    ref = bigper.PrioritizedReplayBuffer(capacity=64, fields=fields, next_of=("obs",), frame_stack=4, seed=0)
    ref.add(reward=np.float32(0), obs=o, next_obs=o, action=np.int32(0), terminated=True)
    assert list(out.sample(4).data) == list(ref.sample(1).data)  # (frame stacks come after the other fields)
    out.close()


# -- (2) a crafted field_order: refused by name, nothing changed --------------------------------------------
@pytest.mark.parametrize("order", CRAFTED, ids=IDS)
@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_a_crafted_recorded_field_order_is_refused_by_every_live_reader(kind, order, tmp_path):
    path = _live(kind, tmp_path)
    _set_order(kind, path, order)
    before = fingerprint(tmp_path)
    for read_only in (False, True):
        with deadline(20), pytest.raises(InvalidArgumentError, match="field_order") as e:
            _resume(kind, path, read_only=read_only)
        assert len(str(e.value)) < 1000
        assert fingerprint(tmp_path) == before, read_only
    v = verify_live(path)
    assert v.status == "INVALID" and "field_order" in v.text, v
    if kind == "hdf5":
        with pytest.raises(InvalidArgumentError, match="field_order"):
            bigper.PrioritizedReplayBuffer.from_hdf5(path)
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("order", FEW, ids=[repr(o)[:20] for o in FEW])
@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_bigper_verify_and_info_of_a_crafted_live_record(kind, order, tmp_path):
    path = _live(kind, tmp_path)
    _set_order(kind, path, order)
    before = fingerprint(tmp_path)
    r = _cli("verify", path)
    assert r.returncode != 0 and "field_order" in r.stdout + r.stderr, r.stdout + r.stderr
    r = _cli("info", path)  # info prints what it can read of a live record: no traceback, nothing written
    assert "Traceback" not in r.stderr, r.stderr
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("order", CRAFTED, ids=IDS)
def test_a_crafted_field_order_in_a_snapshot_is_refused_by_every_snapshot_reader(order, tmp_path):
    from bigper.snapshot import verify

    snaps = bigper.Snapshots(tmp_path / "series")
    buf = _buffer()
    snaps.save(buf)
    buf.close()
    snap = snaps.latest()
    resign(snap, lambda body: body["config"].__setitem__("field_order", order))
    before = fingerprint(tmp_path)
    with pytest.raises(IncompatibleSnapshotError, match="field_order"):
        snaps.load_latest()
    with pytest.raises(IncompatibleSnapshotError, match="field_order"):
        verify(snap)
    with pytest.raises(IncompatibleSnapshotError, match="field_order"):
        bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "live")
    assert fingerprint(tmp_path) == before


def test_bigper_verify_and_info_of_a_crafted_snapshot(tmp_path):
    buf = _buffer()
    buf.save(tmp_path / "snap")
    buf.close()
    resign(tmp_path / "snap", lambda body: body["config"].__setitem__("field_order", ["a", "m", "z"]))
    before = fingerprint(tmp_path)
    for cmd in ("verify", "info"):
        r = _cli(cmd, tmp_path / "snap")
        assert r.returncode != 0 and "field_order" in r.stdout + r.stderr, (cmd, r.stdout + r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("order", CRAFTED, ids=IDS)
def test_from_dict_refuses_each_crafted_value_by_name(order):
    d = json.loads(json.dumps(Config.build(capacity=10, fields=FIELDS).to_dict(), sort_keys=True))
    with pytest.raises(InvalidArgumentError, match="field_order") as e:
        Config.from_dict({**d, "field_order": order})
    assert len(str(e.value)) < 1000
    # a config of sorted fields takes no order at all (to_dict never writes one there)
    d = Config.build(capacity=10, fields=dict(sorted(FIELDS.items()))).to_dict()
    with pytest.raises(InvalidArgumentError, match="field_order"):
        Config.from_dict({**d, "field_order": order})


def test_from_dict_refuses_a_field_order_without_fields_by_the_missing_key():
    d = Config.build(capacity=10, fields=FIELDS).to_dict()
    del d["fields"]
    with pytest.raises(InvalidArgumentError, match="fields"):
        Config.from_dict(d)


# -- (3) sorted fields record no order; the committed fixtures read back to themselves --------------------
@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
def test_sorted_fields_record_no_field_order_anywhere(kind, tmp_path):
    fields = dict(sorted(FIELDS.items()))
    path = None if kind == "memory" else tmp_path / ("b.h5" if kind == "hdf5" else "b")
    buf = _buffer(kind, path, fields=fields)
    buf.save(tmp_path / "snap")
    buf.close()
    assert "field_order" not in decode((tmp_path / "snap" / MANIFEST).read_bytes(), tmp_path / "snap")["config"]
    if kind != "memory":
        assert "field_order" not in _record(kind, path)["config"]


FIXTURES = sorted(p for p in DATA.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


@pytest.mark.parametrize("snap", FIXTURES, ids=[p.name for p in FIXTURES])
def test_a_committed_fixture_config_reads_back_to_itself(snap):
    d = json.loads((snap / MANIFEST).read_text())["config"]
    assert "field_order" not in d
    assert Config.from_dict(d).to_dict() == d  # (its fields are sorted: no order added)
    assert bigper.snapshot.verify(snap)["problems"] == []


def test_the_committed_live_fixtures_resume_read_only(tmp_path):
    import shutil

    for name in ("live-v1-refs64-memmap", "live-v1-refs64-zstd.h5"):
        src = DATA / name
        dst = tmp_path / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        kind = "hdf5" if name.endswith(".h5") else "memmap"
        cfg = Config.from_dict(_record(kind, dst)["config"])
        assert "field_order" not in _record(kind, dst)["config"]
        before = fingerprint(dst)
        kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name not in ("capacity", "fields", "beta", "storage")}
        buf = bigper.PrioritizedReplayBuffer(capacity=cfg.capacity, fields=cfg.fields, storage=kind, path=dst,
                                             mode="resume", read_only=True, beta=cfg.schedule, **kw)
        assert set(buf.sample(2).data) >= set(cfg.fields)
        buf.close()
        after = fingerprint(dst)
        after.pop(str(dst / ".lock"), None)  # (a read-only open of a memmap folder leaves its empty lock file)
        assert after == before


# -- the integrations -------------------------------------------------------------------------------------------
def test_torchrl_state_dict_with_a_crafted_field_order_is_refused_and_changes_nothing():
    pytest.importorskip("torchrl")
    from bigper.integrations.torchrl import PrioritizedReplayBuffer as TRB
    from tests.integrations._torchrl_data import stream
    from tests.integrations.test_hostile_torchrl import fingerprint as rb_fingerprint

    rb = TRB(capacity=40, batch_size=8, seed=0)
    rb.extend(stream(30))
    sd = rb.state_dict()
    names = json.loads(sd["config"])["fields"]
    assert "field_order" not in json.loads(sd["config"])  # (TorchRL's layout sorts its fields)
    other = TRB(capacity=40, batch_size=8, seed=0)
    other.extend(stream(10))
    before = rb_fingerprint(other)
    for order in FEW + [list(reversed(list(names)))[:-1], list(names)]:
        bad = {**sd, "config": json.dumps({**json.loads(sd["config"]), "field_order": order})}
        with pytest.raises(InvalidArgumentError, match="field_order"):
            other.load_state_dict(bad)
        assert rb_fingerprint(other) == before
    # a valid order other than the layout's: TorchRL's layout is its own (sorted), the data the same
    bad = {**sd, "config": json.dumps({**json.loads(sd["config"]), "field_order": list(reversed(list(names)))})}
    other.load_state_dict(bad)
    assert len(other) == len(rb)
    assert list(other.buffer.config.fields) == sorted(names)


def test_torchrl_loads_and_resume_of_a_crafted_field_order_are_refused(tmp_path):
    pytest.importorskip("torchrl")
    from bigper.integrations.torchrl import PrioritizedReplayBuffer as TRB
    from tests.integrations._torchrl_data import stream
    from tests.integrations.test_hostile_torchrl import fingerprint as rb_fingerprint

    rb = TRB(capacity=40, batch_size=8, seed=0, path=tmp_path / "live")
    rb.extend(stream(30))
    snap = rb.dumps(tmp_path / "snap")
    rb.close()
    names = sorted(_record("memmap", tmp_path / "live")["config"]["fields"])
    bad = list(reversed(names))[:-1]
    resign(Path(snap), lambda body: body["config"].__setitem__("field_order", bad))
    _set_order("memmap", tmp_path / "live", bad)
    other = TRB(capacity=40, batch_size=8, seed=0)
    other.extend(stream(10))
    before, files = rb_fingerprint(other), fingerprint(tmp_path)
    with pytest.raises(BigperError, match="field_order"):
        other.loads(snap)
    assert rb_fingerprint(other) == before and fingerprint(tmp_path) == files
    with pytest.raises(BigperError, match="field_order"):
        TRB(capacity=40, batch_size=8, seed=0, path=tmp_path / "live", mode="resume")
    assert fingerprint(tmp_path) == files


def _sb3(tmp_path):
    pytest.importorskip("stable_baselines3")
    from gymnasium import spaces

    from bigper.integrations.sb3 import PrioritizedReplayBuffer as SRB

    rb = SRB(64, spaces.Box(-10, 10, (3,), np.float32), spaces.Discrete(2), device="cpu", seed=1,
             storage="memmap", path=str(tmp_path / "live"))
    for t in range(20):
        o = np.full((1, 3), t, np.float32)
        rb.add(o, o + 1, np.zeros(1, np.int64), np.full(1, float(t)), np.array([t % 7 == 6]), [{}])
    return rb


def test_sb3_pickle_records_its_fields_order_and_loads(tmp_path):
    rb = _sb3(tmp_path)
    blob = pickle.dumps(rb)
    rb.close()
    assert _record("memmap", tmp_path / "live")["config"]["field_order"] == ["obs", "action", "reward"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = pickle.loads(blob)
    assert back.size() == 20
    assert list(back._core.config.fields) == ["obs", "action", "reward"]
    back.close()


def test_sb3_pickle_of_a_crafted_field_order_is_refused_by_name(tmp_path):
    from bigper.integrations._sb3_pickle import manifest_digest

    rb = _sb3(tmp_path)
    blob = pickle.dumps(rb)
    rb.close()
    snap = [p.parent for p in tmp_path.rglob(MANIFEST)]
    assert len(snap) == 1, snap
    snap = snap[0]
    old = manifest_digest(snap)
    resign(snap, lambda body: body["config"].__setitem__("field_order", ["obs", "reward"]))
    new = hashlib.sha256((snap / MANIFEST).read_bytes()).hexdigest()
    assert new == manifest_digest(snap) and blob.count(old.encode()) == 1
    blob = blob.replace(old.encode(), new.encode())  # the attacker re-signs the pickle's record too
    before = fingerprint(tmp_path)
    with pytest.raises(BigperError, match="field_order"):
        pickle.loads(blob)
    assert fingerprint(tmp_path) == before


def test_convert_dqn_records_its_order(tmp_path):
    cfg = Config.build(capacity=10, fields={"obs": ((4, 6, 6), np.uint8), "action": ((), np.int32),
                                           "reward": ((), np.float32)}, frame_stack=4, storage="memmap",
                       compression="zstd")
    d = cfg.to_dict()
    assert d["field_order"] == ["obs", "action", "reward"]
    d["storage"] = "hdf5"  # (what convert_dqn's _to_hdf5 does with it)
    assert list(Config.from_dict(json.loads(json.dumps(d, sort_keys=True))).fields) == ["obs", "action", "reward"]


def test_a_live_path_whose_record_is_crafted_is_let_by_as_any_unreadable_config(tmp_path):
    """A snapshot loaded into a live path whose recorded config carries a
    crafted ``field_order`` (unreadable: ``_check_previous`` lets an
    unreadable config by, as tests/snapshot/test_hostile_resume_newer.py
    documents) either goes on, giving the snapshot's order, or is refused
    with the path as it was; never a raw exception."""
    buf = _buffer("memmap", tmp_path / "orig")
    snap = buf.save(tmp_path / "snap")
    buf.close()
    _buffer("memmap", tmp_path / "live").close()
    _set_order("memmap", tmp_path / "live", ["a", "m", "z"])
    before = fingerprint(tmp_path / "live")
    try:
        again = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "live")
    except BigperError:
        assert fingerprint(tmp_path / "live") == before
    else:
        assert list(again.sample(4).data) == ORDER
        again.close()
        assert _record("memmap", tmp_path / "live")["config"]["field_order"] == NAMES


@pytest.mark.parametrize("kw", [dict(sequence=bigper.Sequence(length=3, period=2)), dict(num_envs=2),
                                dict(prioritization="rank"), dict(n_step=3)],
                         ids=["sequence", "envs2", "rank", "nstep3"])
def test_other_kinds_of_buffer_keep_the_order_through_a_snapshot(kw, tmp_path):
    n = kw.get("num_envs", 1)
    fields = {"z": FIELDS["z"], "reward": ((), np.float32), "a": FIELDS["a"]} if "n_step" in kw else FIELDS
    buf = bigper.PrioritizedReplayBuffer(capacity=60, fields=fields, seed=0, **kw)
    for t in range(30):
        buf.add(**{k: np.full((n, *s) if n > 1 else s, t).astype(d) for k, (s, d) in fields.items()},
                terminated=np.full(n, t % 9 == 8) if n > 1 else t % 9 == 8)
    want = list(buf.sample(2).data)
    assert want[:3] == list(fields)
    buf.save(tmp_path / "snap")
    buf.close()
    again = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap")
    assert list(again.sample(2).data) == want
    again.close()
