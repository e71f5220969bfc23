"""``bigper info`` on a live memmap storage whose record (meta.json) was
crafted: the format, version, record fields and config are checked as a
resume checks them before anything of the record is printed (a value could
carry a newline or a terminal escape, a capacity could be any number); a
record a dead writer left unclean is still described. Nothing is changed."""

from __future__ import annotations

import json

import numpy as np
import pytest

import bigper
from bigper.cli import main

from tests._hostile_snapshot_cases import fingerprint


@pytest.fixture(scope="module")
def closed(tmp_path_factory):
    path = tmp_path_factory.mktemp("info") / "live"
    buf = bigper.PrioritizedReplayBuffer(100, {"x": ((2,), np.float32), "a": ((), np.int64)}, storage="memmap",
                                         path=path)
    for i in range(10):
        buf.add(x=np.full(2, i, np.float32), a=i)
    buf.close()
    return path


def _crafted(closed, tmp_path, change) -> tuple:
    live = tmp_path / "live"
    live.mkdir()
    for p in closed.rglob("*"):
        dst = live / p.relative_to(closed)
        dst.mkdir(exist_ok=True) if p.is_dir() else dst.write_bytes(p.read_bytes())
    meta = json.loads((live / "meta.json").read_text())
    change(meta)
    (live / "meta.json").write_text(json.dumps(meta))
    return live, fingerprint(live)


def _info(live, capsys) -> tuple:
    rc = main(["info", str(live)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _cfg(**kw):
    return lambda m: m["config"].update(kw)


CASES = {
    "format_with_a_newline": (lambda m: m.update(format="bigper-memmap\nINJECTED"), "format"),
    "version_2": (lambda m: m.update(version=2), "version"),
    "clean_a_string": (lambda m: m.update(clean="yes"), "clean"),
    "config_not_an_object": (lambda m: m.update(config=["capacity", 100]), "config"),
    "prioritization_with_an_escape": (_cfg(prioritization="rank\x1b[2J"), "prioritization"),
    "n_step_0": (_cfg(n_step=0), "n_step"),
    "capacity_beyond_int64": (_cfg(capacity=10 ** 30), "capacity"),
    "capacity_other_than_the_rows": (_cfg(capacity=101), "capacity"),
    "capacity_a_float": (_cfg(capacity=100.0), "capacity"),
    "storage_hdf5": (_cfg(storage="hdf5"), "storage"),
    "a_field_of_another_dtype": (_cfg(fields={"x": [[2], "<f4"], "a": [[], "|S8"]}), "a"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_live_record_is_refused_naming_it_and_nothing_of_it_printed(closed, tmp_path, capsys, case):
    change, named = CASES[case]
    live, before = _crafted(closed, tmp_path, change)
    rc, out, err = _info(live, capsys)
    assert rc != 0, out
    assert out == "", out  # (nothing of the record reached stdout)
    assert "meta.json" in err or "format" in err, err
    assert named in err, err
    assert "\x1b" not in err and "\nINJECTED" not in err, repr(err)
    assert fingerprint(live) == before


@pytest.mark.parametrize("clean", [True, False])
def test_a_true_record_is_described_clean_or_left_open_by_a_dead_writer(closed, tmp_path, capsys, clean):
    live, before = _crafted(closed, tmp_path, lambda m: m.update(clean=clean))
    rc, out, err = _info(live, capsys)
    assert rc == 0, err
    assert "capacity 100;" in out and "10 transitions" in out, out
    assert ("closed cleanly" in out) == clean and ("OPEN or its writer died" in out) != clean, out
    assert fingerprint(live) == before
