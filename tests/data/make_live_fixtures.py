"""Write the committed fixtures of an older bigper's *live* storages (issue 43 section 2):
a memmap run folder and a bigper HDF5 file as the bigper before the frame
references became one id and offsets wrote them (``obs_ref`` and
``next_obs_ref``, int64 x k each), and what that bigper sampled from them.

Run it with the older bigper first on the path, never with this one::

    git worktree add /tmp/oldbigper 23b6758
    PYTHONPATH=/tmp/oldbigper python tests/data/make_live_fixtures.py

Writes, beside this file:

- ``live-v1-refs64-memmap/`` (3 envs, n-step 2, raw frames) and
  ``live-v1-refs64-far-memmap/`` (the same with env 0 on one static frame
  for 140 steps while the others play: its stacks reference a frame ~280
  ids before their newest, further than the offsets of 3 envs reach, which
  an older writer reused without a bound), each a folder closed cleanly;
  ``<name>.expected.json``: what a ``mode="resume"`` of a copy gave
  (``continue_episodes=True``): length, total priority, the stacks of the
  slots whose frames lie further apart than uint8 offsets hold, three batches
  with the updates after each, then, after 20 more steps, two more.
- ``live-v1-refs64-zstd.h5`` (storage="hdf5", zstd, 3 envs, a static env
  as above) and ``live-v1-refs64-zstd.expected.json``: what ``from_hdf5``
  of it sampled (a sidecar elsewhere): the far slots' stacks as above, and
  three batches with their updates; and what a ``mode="resume"`` of a copy
  sampled (``resume``: three batches).

A fixture is written once, by the bigper it names, and kept; do not
regenerate one to make a test pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import bigper

HERE = Path(__file__).resolve().parent
FIELDS = {"reward": ((), np.float32), "action": ((), np.int64)}
FIXTURES = {
    "live-v1-refs64-memmap": dict(capacity=48, num_envs=3, frame=(3, 3), steps=30, static=0,
                                  kw=dict(storage="memmap", n_step=2, alpha=0.7, beta=0.4)),
    "live-v1-refs64-far-memmap": dict(capacity=600, num_envs=3, frame=(3, 3), steps=190, static=140,
                                      kw=dict(storage="memmap", n_step=2, alpha=0.7, beta=0.4)),
    "live-v1-refs64-zstd": dict(capacity=600, num_envs=3, frame=(6, 6), steps=190, static=140, hi=4, train=60,
                                kw=dict(storage="hdf5", n_step=1, alpha=0.6, beta=0.5, compression="zstd")),
}
K = 4


def steps(rng, n, num_envs, frame, static, hi=256):
    """Steps of ``num_envs`` envs whose stacks continue (episode ends every
    ~12 steps); env 0 shows one frame for its first ``static`` steps."""
    stack = [None] * num_envs
    still = rng.integers(0, hi, frame, dtype=np.uint8)
    for t in range(n):
        rows = []
        for e in range(num_envs):
            f = still if (e == 0 and t < static) else rng.integers(0, hi, frame, dtype=np.uint8)
            if stack[e] is None:
                stack[e] = np.stack([f] * K)
            nxt = np.concatenate([stack[e][1:], f[None]])
            end = not (e == 0 and t < static) and rng.random() < 0.08
            term = bool(end and rng.random() < 0.5)
            rows.append(dict(obs=stack[e], next_obs=nxt, reward=np.float32(rng.standard_normal()),
                             action=np.int64(rng.integers(0, 4)), terminated=term, truncated=end and not term))
            stack[e] = None if end else nxt
        yield {name: np.stack([r[name] for r in rows]) for name in rows[0]}


def batches(buf, rng, n, offset=0.0):
    out = []
    for i in range(n):
        b = buf.sample(6)
        upd = (np.arange(6) + 1.0 + i + offset).tolist()
        out.append({"batch_size": 6, "indices": b.indices.tolist(), "weights": b.weights.tolist(),
                    "data": {f: b[f].tolist() for f in ("obs", "next_obs", "reward", "action", "discount")},
                    "update": upd})
        buf.update_priorities(b, np.asarray(upd))
    return out


def far(buf) -> dict:
    """The stacks of the sampleable slots whose frames lie further apart than
    uint8 offsets hold (read through the older bigper's frame store)."""
    fs = buf._frames
    slots = np.flatnonzero(np.isin(buf.state_dict()[1]["status"], (1, 2)))
    refs = np.concatenate([fs.refs("obs_ref", slots), fs.refs("next_obs_ref", slots)], axis=1)
    slots = slots[refs.max(axis=1) - refs.min(axis=1) > 247]
    return {"slots": slots.tolist(), "obs": fs.stacks("obs_ref", slots).tolist(),
            "next_obs": fs.stacks("next_obs_ref", slots).tolist()}


def make(name: str, spec: dict, tmp: Path) -> dict:
    rng = np.random.default_rng(43)
    fields = {"obs": ((K, *spec["frame"]), np.uint8), **FIELDS}
    if "train" in spec:
        import bigper.frames.segments as segments

        segments.TRAIN_FRAMES = spec["train"]
    hdf5 = spec["kw"]["storage"] == "hdf5"
    live = tmp / (name + (".h5" if hdf5 else ""))
    buf = bigper.PrioritizedReplayBuffer(spec["capacity"], fields, path=live, num_envs=spec["num_envs"],
                                         frame_stack=K, seed=11, **spec["kw"])
    gen = steps(rng, spec["steps"] + 20, spec["num_envs"], spec["frame"], spec["static"], spec.get("hi", 256))
    for _ in range(spec["steps"]):
        buf.add(**next(gen))
        if rng.random() < 0.3:
            buf.update_priorities(buf.sample(4), rng.random(4) * 2)
    buf.close()
    dst = HERE / live.name
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    (shutil.copytree if live.is_dir() else shutil.copyfile)(live, dst)
    if dst.is_dir():
        (dst / ".lock").unlink(missing_ok=True)  # (a lock file is made at open; git keeps no empty files)
    else:
        (HERE / (live.name + ".lock")).unlink(missing_ok=True)
    ref = tmp / ("ref" + (".h5" if hdf5 else ""))
    (shutil.copytree if live.is_dir() else shutil.copyfile)(dst, ref)
    if hdf5:
        ds = bigper.PrioritizedReplayBuffer.from_hdf5(ref, priorities=tmp / "sidecar")
        expected = {"len": len(ds), "total_priority": ds.total_priority, "far": far(ds),
                    "batches": batches(ds, rng, 3)}
        ds.close()
        again = tmp / "resumed.h5"
        shutil.copyfile(dst, again)
        res = bigper.PrioritizedReplayBuffer(spec["capacity"], fields, path=again, num_envs=spec["num_envs"],
                                             frame_stack=K, seed=11, mode="resume", continue_episodes=True,
                                             **spec["kw"])
        expected["resume"] = {"len": len(res), "total_priority": res.total_priority, "batches": batches(res, rng, 3)}
        res.close()
    else:
        res = bigper.PrioritizedReplayBuffer(spec["capacity"], fields, path=ref, num_envs=spec["num_envs"],
                                             frame_stack=K, seed=11, mode="resume", continue_episodes=True,
                                             **spec["kw"])
        expected = {"len": len(res), "total_priority": res.total_priority, "far": far(res),
                    "batches": batches(res, rng, 3)}
        for _ in range(20):
            res.add(**next(gen))
        expected["after_adds"] = {"len": len(res), "total_priority": res.total_priority,
                                  "batches": batches(res, rng, 2, offset=10.0)}
        res.close()
    rev = subprocess.run(["git", "-C", str(Path(bigper.__file__).parents[1]), "rev-parse", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    spec_out = {k: v for k, v in spec.items() if k != "kw"}
    expected = {"written_by": rev, "spec": {**spec_out, "frame_stack": K, **spec["kw"]}, **expected}
    (HERE / f"{name}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {dst} ({rev})")
    return expected


if __name__ == "__main__":
    if Path(bigper.__file__).resolve().parents[1] == HERE.parents[1]:
        sys.exit("run this with an older bigper first on the path (PYTHONPATH=/tmp/oldbigper), not this one")
    for name in sys.argv[1:] or FIXTURES:
        with tempfile.TemporaryDirectory() as tmp:
            make(name, FIXTURES[name], Path(tmp))
