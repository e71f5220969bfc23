"""Snapshots written by bigper 0.1.0 (commit 2b3f65d) load and resume bit for bit.

The fixtures in tests/data/snapshot-0.1.0-{memory,memmap}/ hold a buffer with
``frame_stack=4, n_step=3, num_envs=2`` whose ring has wrapped, written by
the code before the layering refactor of issue 17 (how: the docstring of
tests/data/snapshot-0.1.0-make.py). Their ``.expected.json`` says what that
code gave after loading them: batches (indices, generations, weights,
probabilities, every sampled field) and the priority updates after each,
then more steps added and the batches after those. The current code must
give exactly the same, and leave the fixture's files untouched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.snapshot import verify

DATA = Path(__file__).resolve().parents[1] / "data"
KINDS = ("memory", "memmap")
# dtypes of the recorded steps (JSON keeps only the numbers)
STEP_DTYPES = {"obs": np.uint8, "next_obs": np.uint8, "reward": np.float32, "action": np.int64,
               "terminated": np.bool_, "truncated": np.bool_}


def fingerprint(root: Path) -> dict[str, str]:
    """Relative name -> sha256 of every file under ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def check_batch(got: bigper.Batch, want: dict, where: str) -> None:
    assert got.indices.tolist() == want["indices"], where
    assert got.generations.tolist() == want["generations"], where
    assert got.weights.tolist() == want["weights"], where
    assert got.probabilities.tolist() == want["probabilities"], where
    for field, values in want["data"].items():
        assert np.asarray(got[field]).tolist() == values, f"{where}: {field}"


@pytest.fixture(params=KINDS)
def fixture(request):
    kind = request.param
    snap = DATA / f"snapshot-0.1.0-{kind}"
    expected = json.loads((DATA / f"snapshot-0.1.0-{kind}.expected.json").read_text())
    return kind, snap, expected


def test_fixture_is_what_it_claims(fixture):
    kind, snap, expected = fixture
    assert expected["kind"] == kind and expected["written_by"] == "bigper 0.1.0 at commit 2b3f65d"
    total = sum(p.stat().st_size for p in snap.rglob("*") if p.is_file())
    assert 0 < total < 2_000_000
    assert verify(snap)["problems"] == []


def test_snapshot_from_0_1_0_resumes_bit_for_bit(fixture, tmp_path):
    kind, snap, expected = fixture
    before = fingerprint(snap)
    # 0.1.0's load went on with the open episodes (recorded below: more steps of the same stream are
    # added after the batches), so the load says the episodes continue
    buf = bigper.PrioritizedReplayBuffer.load(snap, path=None if kind == "memory" else tmp_path / "live",
                                              continue_episodes=True)
    try:
        assert buf.capacity == 48
        assert len(buf) == expected["len"]
        assert buf.total_priority == expected["total_priority"]
        for i, want in enumerate(expected["batches"]):
            got = buf.sample(want["batch_size"])
            check_batch(got, want, f"batch {i} after load")
            buf.update_priorities(got, np.asarray(want["update"]))
        assert buf.total_priority == expected["total_priority_after_updates"]
        for step in expected["more_steps"]:
            buf.add(**{k: np.asarray(v, dtype=STEP_DTYPES[k]) for k, v in step.items()})
        assert len(buf) == expected["len_after_more"]
        assert buf.total_priority == expected["total_priority_after_more"]
        for i, want in enumerate(expected["batches_after_more"]):
            got = buf.sample(want["batch_size"])
            check_batch(got, want, f"batch {i} after more steps")
            buf.update_priorities(got, np.asarray(want["update"]))
    finally:
        buf.close()
    assert fingerprint(snap) == before


def test_a_changed_expectation_fails(fixture, tmp_path):
    """The comparison is sharp: one weight off by one ulp is caught."""
    kind, snap, expected = fixture
    # loaded as the test above loads it, so that only the altered ulp differs from what it gives
    buf = bigper.PrioritizedReplayBuffer.load(snap, path=None if kind == "memory" else tmp_path / "live",
                                              continue_episodes=True)
    try:
        want = dict(expected["batches"][0])
        want["weights"] = list(want["weights"])
        want["weights"][0] = float(np.nextafter(want["weights"][0], 0.0))
        with pytest.raises(AssertionError):
            check_batch(buf.sample(want["batch_size"]), want, "altered")
    finally:
        buf.close()
