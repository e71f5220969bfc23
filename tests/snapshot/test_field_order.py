"""A batch's keys come in the order the buffer's fields were given, also after
the buffer was written and read back: every file bigper writes sorts its JSON
keys, so a config whose fields are not in sorted order records that order
beside them (``field_order``, ``Config.to_dict``), and every reader takes it
back (``Config.from_dict``). A config whose fields are sorted records none: its
files are as before. A crafted ``field_order`` is refused by name, nothing
changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.config import Config
from bigper.errors import IncompatibleSnapshotError, InvalidArgumentError
from bigper.snapshot.manifest import MANIFEST, decode
from tests._hostile_snapshot_cases import fingerprint, resign

FIELDS = {"z": ((), np.float32), "a": ((2,), np.int64), "m": ((), np.uint8)}
ORDER = ["z", "a", "m", "terminated", "truncated", "discount"]
ROOT = Path(__file__).resolve().parents[2]


def _buffer(storage="memory", path=None, fields=FIELDS, **kw):
    buf = bigper.PrioritizedReplayBuffer(capacity=50, fields=fields, seed=0, storage=storage,
                                         **({} if path is None else {"path": path}), **kw)
    for t in range(30):
        buf.add(**{n: np.full(s, t).astype(d) for n, (s, d) in fields.items()}, terminated=t % 9 == 8)
    return buf


def test_the_order_is_recorded_only_where_it_is_not_sorted():
    cfg = Config.build(capacity=10, fields=FIELDS)
    assert cfg.to_dict()["field_order"] == ["z", "a", "m"]
    assert list(Config.from_dict(json.loads(json.dumps(cfg.to_dict(), sort_keys=True))).fields) == ["z", "a", "m"]
    plain = Config.build(capacity=10, fields=dict(sorted(FIELDS.items())))
    assert "field_order" not in plain.to_dict()


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_a_loaded_snapshot_gives_the_fields_in_their_order(tmp_path, storage):
    path = None if storage == "memory" else tmp_path / ("b.h5" if storage == "hdf5" else "b")
    buf = _buffer(storage, path)
    assert list(buf.sample(4).data) == ORDER
    buf.save(tmp_path / "snap")
    buf.close()
    body = decode((tmp_path / "snap" / MANIFEST).read_bytes(), tmp_path / "snap")
    assert body["config"]["field_order"] == ["z", "a", "m"]
    again = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap")
    assert list(again.sample(4).data) == ORDER
    assert list(again.config.fields) == ["z", "a", "m"]
    again.close()


def test_from_hdf5_of_a_bigper_file_gives_the_fields_in_their_order(tmp_path):
    buf = _buffer("hdf5", tmp_path / "b.h5")
    buf.close()
    ds = bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "b.h5")
    assert list(ds.sample(4).data) == ORDER
    ds.close()


def test_sorted_fields_write_what_they_always_wrote(tmp_path):
    buf = _buffer(fields=dict(sorted(FIELDS.items())))
    buf.save(tmp_path / "snap")
    buf.close()
    body = decode((tmp_path / "snap" / MANIFEST).read_bytes(), tmp_path / "snap")
    assert "field_order" not in body["config"]
    assert list(bigper.PrioritizedReplayBuffer.load(tmp_path / "snap").sample(4).data)[:3] == ["a", "m", "z"]


def test_verify_and_info_take_a_recorded_order(tmp_path):
    buf = _buffer()
    buf.save(tmp_path / "snap")
    buf.close()
    for cmd in ("verify", "info"):
        r = subprocess.run([sys.executable, "-m", "bigper", cmd, str(tmp_path / "snap")], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
        assert "INVALID" not in r.stdout


CRAFTED = [[], ["z", "a"], ["z", "a", "m", "m"], ["a", "m", "z"], "zam", [1, 2, 3], ["z", "a", "q"], None,
           {"z": 0, "a": 1, "m": 2}, ["z", "a", "m", "terminated"]]


@pytest.mark.parametrize("order", CRAFTED, ids=[repr(o)[:24] for o in CRAFTED])
def test_a_crafted_field_order_is_refused_by_name_and_changes_nothing(tmp_path, order):
    buf = _buffer()
    buf.save(tmp_path / "snap")
    buf.close()
    resign(tmp_path / "snap", lambda body: body["config"].__setitem__("field_order", order))
    before = fingerprint(tmp_path)
    with pytest.raises(IncompatibleSnapshotError, match="field_order"):
        bigper.PrioritizedReplayBuffer.load(tmp_path / "snap")
    assert fingerprint(tmp_path) == before
    with pytest.raises(InvalidArgumentError, match="field_order"):
        Config.from_dict({**Config.build(capacity=10, fields=FIELDS).to_dict(), "field_order": order})
