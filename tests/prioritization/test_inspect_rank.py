"""``bigper info`` / ``bigper verify`` say which prioritization a snapshot uses,
and check a rank snapshot's own invariants (its heap), not a proportional tree."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.snapshot import describe, verify
from bigper.snapshot.inspect import format_description

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"obs": ((3,), np.float32), "action": ((), np.int64)}


def _buffer(kind: str, **kw):
    buf = bigper.PrioritizedReplayBuffer(50, FIELDS, prioritization=kind, seed=0, **kw)
    for i in range(60):  # wraps: 50 held
        buf.add(obs=np.full(3, i, np.float32), action=i % 3, next_obs=np.full(3, i + 1, np.float32))
    batch = buf.sample(8)
    buf.update_priorities(batch, np.arange(1.0, 9.0))
    return buf


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "bigper", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["proportional", "rank"])
def test_info_and_verify_name_the_prioritization(tmp_path, kind):
    buf = _buffer(kind)
    snap = buf.save(tmp_path / "snap")
    d = describe(snap)
    assert d["prioritization"] == kind
    text = format_description(d)
    assert f"capacity 50; {kind} prioritization;" in text
    if kind == "rank":
        p = d["priorities"]
        assert p["sampleable"] == len(buf) == 50 and p["sort_every"] == 50 and p["max"] == 8.0
        assert "priority  rank: 50 sampleable" in text
    rep = verify(snap)
    assert rep["prioritization"] == kind and rep["problems"] == []
    r = _cli("verify", str(snap))
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
    r = _cli("info", str(snap))
    assert r.returncode == 0 and f"{kind} prioritization" in r.stdout, r.stdout + r.stderr


def test_verify_finds_a_broken_rank_heap_and_changes_nothing(tmp_path):
    buf = _buffer("rank")
    buf.update_priorities(np.flatnonzero(buf.status == 1), np.arange(50.0))
    buf.prioritization.sort()
    heap = buf.prioritization._heap
    heap[[0, 49]] = heap[[49, 0]]  # the smallest at the root: a heap that is not a heap
    snap = buf.save(tmp_path / "snap")  # checksums of these bytes: the files are intact
    before = _files(snap)
    rep = verify(snap)
    assert rep["problems"] and any("heap" in p for p in rep["problems"]), rep
    r = _cli("verify", str(snap))
    assert r.returncode != 0 and "INVALID" in r.stdout and "heap" in r.stdout, r.stdout + r.stderr
    assert _files(snap) == before
