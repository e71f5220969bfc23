"""Write the committed 0.1.0 snapshot fixtures (frame stacks, n-step, two envs).

They pin the behaviour of bigper 0.1.0 as of commit 2b3f65d (before the
layering refactor of issue 17), so a refactor that moves code can be shown
to change nothing a user sees. Written once, with that commit's code::

    git worktree add /tmp/old 2b3f65d
    PYTHONPATH=/tmp/old python tests/data/snapshot-0.1.0-make.py 2b3f65d
    git worktree remove /tmp/old

For each storage (memory, memmap) it writes ``snapshot-0.1.0-<kind>/`` (a
snapshot of a buffer with ``frame_stack=4, n_step=3, num_envs=2`` that has
wrapped its ring and had priorities updated) and
``snapshot-0.1.0-<kind>.expected.json``: what a load of that snapshot gave
with that code, namely the length and total priority, the first batches
sampled after the load with the priority updates that follow each, then a
few more steps added (recorded in the file) and the batches after those.
``tests/snapshot/test_fixture_compat.py`` checks that the current code gives the same,
bit for bit. Do not regenerate a fixture to make a test pass.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import bigper

HERE = Path(__file__).resolve().parent
K, FRAME, NUM_ENVS = 4, (6, 6), 2
FIELDS = {"obs": ((K, *FRAME), np.uint8), "reward": ((), np.float32), "action": ((), np.int64)}
SAMPLED = ("obs", "next_obs", "reward", "action", "discount", "terminated")


def config(kind: str, path) -> dict:
    """Keyword arguments of the fixture's buffer (also what the test builds nothing from: it loads)."""
    return dict(capacity=48, fields=FIELDS, frame_stack=K, n_step=3, gamma=0.9, num_envs=NUM_ENVS,
                alpha=0.6, beta=bigper.LinearSchedule(0.4, 1.0, 50), storage=kind, path=path, seed=11)


def steps(rng: np.random.Generator, n: int):
    """``n`` vector steps of ``NUM_ENVS`` envs: stacks that continue, episode
    ends (terminated or truncated) every ~8 steps, new random frames."""
    stack = [None] * NUM_ENVS
    for _ in range(n):
        rows = []
        for e in range(NUM_ENVS):
            if stack[e] is None:
                stack[e] = np.stack([rng.integers(0, 256, FRAME, dtype=np.uint8)] * K)
            nxt = np.concatenate([stack[e][1:], rng.integers(0, 256, FRAME, dtype=np.uint8)[None]])
            end = bool(rng.random() < 0.125)
            term = bool(end and rng.random() < 0.5)
            rows.append(dict(obs=stack[e], next_obs=nxt, reward=np.float32(rng.standard_normal()),
                             action=np.int64(rng.integers(0, 6)), terminated=term, truncated=end and not term))
            stack[e] = None if end else nxt
        yield {name: np.stack([r[name] for r in rows]) for name in rows[0]}


def batch_record(b, size: int, update: list[float]) -> dict:
    return {"batch_size": size, "indices": b.indices.tolist(), "generations": b.generations.tolist(),
            "weights": b.weights.tolist(), "probabilities": b.probabilities.tolist(),
            "data": {f: np.asarray(b[f]).tolist() for f in SAMPLED}, "update": update}


def make(kind: str, commit: str) -> None:
    rng = np.random.default_rng(170)
    with tempfile.TemporaryDirectory() as tmp:
        live = None if kind == "memory" else Path(tmp) / "live"
        buf = bigper.PrioritizedReplayBuffer(**config(kind, live))
        for i, step in enumerate(steps(rng, 70)):  # 140 transitions into 48 slots: the ring wraps
            buf.add(**step)
            if i >= 6 and rng.random() < 0.5:
                b = buf.sample(4)
                buf.update_priorities(b, rng.random(4) * 3)
        snap = HERE / f"snapshot-0.1.0-{kind}"
        if snap.exists():
            shutil.rmtree(snap)
        buf.save(snap)
        buf.close()

        # what a load gives: sampled from a fresh load of the fixture itself
        loaded = bigper.PrioritizedReplayBuffer.load(snap, path=None if kind == "memory" else Path(tmp) / "l2")
        expected = {"written_by": f"bigper {bigper.__version__} at commit {commit}", "kind": kind,
                    "len": len(loaded), "total_priority": loaded.total_priority, "batches": []}
        for i in range(4):
            b = loaded.sample(8)
            upd = (np.arange(8) * 0.25 + 0.5 + i).tolist()
            expected["batches"].append(batch_record(b, 8, upd))
            loaded.update_priorities(b, np.asarray(upd))
        expected["total_priority_after_updates"] = loaded.total_priority
        more = list(steps(np.random.default_rng(171), 6))
        expected["more_steps"] = [{k: v.tolist() for k, v in s.items()} for s in more]
        for s in more:
            loaded.add(**s)
        expected["len_after_more"] = len(loaded)
        expected["total_priority_after_more"] = loaded.total_priority
        expected["batches_after_more"] = []
        for i in range(2):
            b = loaded.sample(8)
            upd = (np.arange(8) * 0.5 + 1.0 + i).tolist()
            expected["batches_after_more"].append(batch_record(b, 8, upd))
            loaded.update_priorities(b, np.asarray(upd))
        loaded.close()
    (HERE / f"snapshot-0.1.0-{kind}.expected.json").write_text(json.dumps(expected, indent=0) + "\n")
    print(f"wrote {snap} with {bigper.__file__}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: PYTHONPATH=<checkout of that commit> python snapshot-0.1.0-make.py COMMIT")
    for kind in ("memory", "memmap"):
        make(kind, sys.argv[1])
