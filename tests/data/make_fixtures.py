"""Write the committed format-1 snapshot fixtures (run from the repository root):

    python tests/data/make_fixtures.py

Writes ``tests/data/snapshot-v1-<kind>/`` (a snapshot) and
``snapshot-v1-<kind>.expected.json`` (what loading it must give: length,
total priority, and the first batches sampled after the load, with the
updates that follow each). A fixture is written once, by the format version
it names, and then kept: ``tests/snapshot/test_snapshot.py`` checks that this bigper
still loads it and resumes it exactly. Do not regenerate one to make a test
pass; a new format version gets new fixtures beside the old ones.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import bigper  # noqa: E402


def steps(rng, n, num_envs, k, frame, hi=256):
    """Consistent steps: frame stacks that continue, episode ends every ~10 steps
    (frame bytes below ``hi``: a small ``hi`` makes frames that compress)."""
    stack = [None] * num_envs
    for _ in range(n):
        rows = []
        for e in range(num_envs):
            if stack[e] is None:
                f = rng.integers(0, hi, frame, dtype=np.uint8)
                stack[e] = np.stack([f] * k) if k else f
            f = rng.integers(0, hi, frame, dtype=np.uint8)
            nxt = np.concatenate([stack[e][1:], f[None]]) if k else f
            end = rng.random() < 0.1
            term = bool(end and rng.random() < 0.5)
            rows.append(dict(obs=stack[e], next_obs=nxt, reward=np.float32(rng.standard_normal()),
                             action=np.int64(rng.integers(0, 4)), terminated=term, truncated=end and not term))
            stack[e] = None if end else nxt
        yield rows[0] if num_envs == 1 else {n: np.stack([r[n] for r in rows]) for n in rows[0]}


FIXTURES = {
    "memory": dict(capacity=24, num_envs=2, k=None, frame=(3, 3),
                   kw=dict(n_step=3, gamma=0.9, alpha=0.6, beta=bigper.LinearSchedule(0.4, 1.0, 100))),
    "memmap": dict(capacity=20, num_envs=1, k=2, frame=(4, 4), kw=dict(n_step=1, alpha=0.5, beta=0.5)),
    # compression="zstd" (frames/segments.py): a dictionary trained after 40 frames, segments wrapped
    "zstd-memmap": dict(capacity=30, num_envs=1, k=3, frame=(16, 16), storage="memmap", hi=4, train=40, n=90,
                        kw=dict(n_step=2, alpha=0.6, beta=0.5, compression="zstd", compression_budget=80)),
    # the last format with 64 bits a frame reference (obs_ref, next_obs_ref: int64 x k each), written by
    # bigper 23b6758 before the references became one frame id and offsets (issue 43 section 2)
    "refs64-zstd-hdf5": dict(capacity=40, num_envs=2, k=4, frame=(16, 16), storage="hdf5", hi=4, train=40, n=60,
                             cont=True, kw=dict(n_step=1, alpha=0.6, beta=0.5, compression="zstd")),
    "refs64-envs-memmap": dict(capacity=36, num_envs=3, k=4, frame=(6, 6), storage="memmap", n=30, cont=True,
                               kw=dict(n_step=2, alpha=0.7, beta=0.4)),
}
ONCE = ("zstd-memmap", "refs64-zstd-hdf5", "refs64-envs-memmap")  # written by this maker only when named: python tests/data/make_fixtures.py zstd-memmap


def make(kind: str, out: Path) -> None:
    spec = FIXTURES[kind]
    rng = np.random.default_rng(2024)
    obs = ((spec["k"], *spec["frame"]) if spec["k"] else spec["frame"], np.uint8)
    fields = {"obs": obs, "reward": ((), np.float32), "action": ((), np.int64)}
    storage = spec.get("storage", kind)
    if "train" in spec:
        import bigper.frames.segments as segments

        segments.TRAIN_FRAMES = spec["train"]
    with tempfile.TemporaryDirectory() as tmp:
        path = None if storage == "memory" else Path(tmp) / "live"
        buf = bigper.PrioritizedReplayBuffer(spec["capacity"], fields, storage=storage, path=path,
                                             num_envs=spec["num_envs"], frame_stack=spec["k"], seed=7,
                                             **spec["kw"])
        for step in steps(rng, spec.get("n", 30), spec["num_envs"], spec["k"], spec["frame"], spec.get("hi", 256)):
            buf.add(**step)
            if buf.total_priority > 0 and rng.random() < 0.5:
                b = buf.sample(4)
                buf.update_priorities(b, rng.random(4) * 2)
        snap = out / f"snapshot-v1-{kind}"
        if snap.exists():
            shutil.rmtree(snap)
        buf.save(snap)
        buf.close()
        # what a load must give: sampled from a fresh load of the fixture itself
        # (cont: the episodes open at the snapshot go on, as test_snapshot loads every fixture)
        more = {"continue_episodes": True} if spec.get("cont") else {}
        loaded = bigper.PrioritizedReplayBuffer.load(snap, path=None if storage == "memory" else Path(tmp) / "l2",
                                                     **more)
        expected = {"len": len(loaded), "total_priority": loaded.total_priority, "batches": []}
        for i in range(3):
            b = loaded.sample(6)
            upd = (np.arange(6) + 1.0 + i).tolist()
            expected["batches"].append({
                "batch_size": 6, "indices": b.indices.tolist(), "weights": b.weights.tolist(),
                "data": {f: b[f].tolist() for f in ("obs", "reward", "action", "discount")},
                "update": upd})
            loaded.update_priorities(b, np.asarray(upd))
        loaded.close()
    (out / f"snapshot-v1-{kind}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {snap}")


if __name__ == "__main__":
    for kind in sys.argv[1:] or sorted(set(FIXTURES) - set(ONCE)):
        make(kind, HERE)
