"""Write the committed snapshot fixture of a buffer with sequence items
(run from the repository root):

    python tests/data/make_sequence_fixture.py

Writes ``tests/data/snapshot-v1-sequence/`` (a memmap snapshot: two envs,
frame stacks of 2, episodes of varied length, length 4 + burn-in 2, period
3, priorities updated per step) and ``snapshot-v1-sequence.expected.json``
(what loading it must give: length, total priority, and the first batches
sampled after the load with their masks and a digest of every field).
Written once and kept: ``tests/core/test_sequences.py`` checks that this bigper
still loads it and resumes it exactly. Do not regenerate it to make a test pass.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import bigper  # noqa: E402

NAME = "snapshot-v1-sequence"
FIELDS = {"obs": ((2, 3, 4), np.uint8), "reward": ((), np.float32), "action": ((), np.int64),
          "hidden": ((3,), np.float32)}


def digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return f"{a.dtype.str}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()


def batch_record(b) -> dict:
    return {"indices": b.indices.tolist(), "generations": b.generations.tolist(),
            "weights": b.weights.tolist(), "probabilities": b.probabilities.tolist(),
            "mask": b.mask.astype(int).tolist(), "burn_in": b.burn_in,
            "data": {n: digest(v) for n, v in sorted(b.data.items())}}


def run(buf, rng, steps):
    stack = [None, None]
    for _ in range(steps):
        rows = []
        for e in range(2):
            if stack[e] is None:
                f = rng.integers(0, 256, (3, 4), dtype=np.uint8)
                stack[e] = np.stack([f, f])
            f = rng.integers(0, 256, (3, 4), dtype=np.uint8)
            nxt = np.stack([stack[e][1], f])
            end = rng.random() < 0.12
            term = bool(end and rng.random() < 0.5)
            rows.append(dict(obs=stack[e], next_obs=nxt, reward=np.float32(rng.standard_normal()),
                             action=np.int64(rng.integers(0, 4)),
                             hidden=rng.standard_normal(3).astype(np.float32),
                             terminated=term, truncated=end and not term))
            stack[e] = None if end else nxt
        buf.add(**{n: np.stack([r[n] for r in rows]) for n in rows[0]})
        if buf.total_priority > 0 and rng.random() < 0.4:
            b = buf.sample(4)
            td = rng.random((4, 6)) * 2
            td[~b.mask] = np.nan
            buf.update_priorities(b, td)


def main() -> None:
    rng = np.random.default_rng(25)
    with tempfile.TemporaryDirectory() as tmp:
        buf = bigper.PrioritizedReplayBuffer(
            40, FIELDS, frame_stack=2, num_envs=2, storage="memmap", path=Path(tmp) / "live", seed=9,
            alpha=0.7, beta=bigper.LinearSchedule(0.4, 1.0, 50),
            sequence=bigper.Sequence(4, burn_in=2, period=3, eta=0.8))
        run(buf, rng, 45)
        snap = HERE / NAME
        if snap.exists():
            shutil.rmtree(snap)
        buf.save(snap)
        buf.close()
        loaded = bigper.PrioritizedReplayBuffer.load(snap, path=Path(tmp) / "l2")
        expected = {"len": len(loaded), "total_priority": loaded.total_priority, "batches": []}
        for _ in range(3):
            b = loaded.sample(5)
            rec = batch_record(b)
            td = np.round(rng.random((5, 6)) * 3, 3)
            rec["update"] = td.tolist()
            loaded.update_priorities(b, td)
            expected["batches"].append(rec)
        expected["total_after"] = loaded.total_priority
        loaded.close()
    (HERE / f"{NAME}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
