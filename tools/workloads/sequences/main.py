"""Workload "sequences": prioritized sequence replay on an Atari-shaped stream.

Every library gets the same stream: (4, 84, 84) uint8 frame stacks that
continue step to step (one new 84x84 frame a step, drawn from a pool of
random frames), episodes of 200-2000 steps (seeded), R2D2's items: B=32
sequences of 80 steps plus a 40-step burn-in (T = 120), period 40.

(a) add: ``--steps`` steps, one ``add`` call a step, bigper with and without
    ``sequence=`` (memmap storage; the stacks are made the same way for both);
(b) a round: sample 32 sequences (every field (32, 120, ...), obs stacks
    rebuilt per step) and update their priorities from per-step errors
    (32, 120): median of ``--rounds`` rounds;
(c) bytes per step: bigper's memmap files on disk (blocks) / steps; an
    in-memory peer's state (its arrays' bytes) / steps.

Peers, each in its own process:
  flashbax  ``make_prioritised_trajectory_buffer`` on JAX's CPU backend (a
            separate venv: ``--flashbax-python``, default /tmp/fbx-venv);
            obs stored per step as a (4, 84, 84) stack; filled in chunks of
            1,000 steps (one add a step would take far longer); it does not
            know episode boundaries (its sequences cross them).
  TorchRL   ``PrioritizedSliceSampler`` (slices of 120 along an ``episode``
            key, not strict) over ``LazyMemmapStorage``, in a venv where its
            compiled extension loads (``--torchrl-python``, default
            /tmp/trl-venv/bin/python, made by tools/dev/trl_venv.sh: torch
            2.14.1 + torchrl 0.14.1 there, else reported unavailable); obs stored per step as a (4, 84, 84) stack,
            extended in chunks of 1,000 steps; priorities updated per step.

Usage::

    python tools/bench.py sequences                   # 20k steps
    python tools/bench.py sequences --steps 1000000   # the issue's 1M (about 7 GB of memmap files)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper

B, LENGTH, BURN, PERIOD = 32, 80, 40, 40
T = LENGTH + BURN
POOL = 509  # frames in the pool (prime: consecutive stacks never repeat a frame)


def add_arguments(p):
    p.add_argument("--steps", type=int, default=20_000, help="steps added (default 20k; 1M for the issue's size)")
    p.add_argument("--rounds", type=int, default=15, help="sample + update rounds timed")
    p.add_argument("--flashbax-python", default="/tmp/fbx-venv/bin/python",
                   help="a Python with flashbax and jax[cpu] (a separate venv)")
    p.add_argument("--torchrl-python", default="/tmp/trl-venv/bin/python",
                   help="a Python where torchrl's compiled extension loads (a separate venv)")
    p.add_argument("--dir", default=None, help="where bigper's memmap files go (default: a temp dir)")


def stream(n, seed=0):
    """``(frame ids (n, 4), episode-end flags (n,))``: stacks continue within an
    episode; a reset repeats its first frame 4 times."""
    rng = np.random.default_rng(seed)
    ids = np.empty((n, 4), np.int64)
    ends = np.zeros(n, bool)
    f, left = 0, 0
    for t in range(n):
        if left == 0:
            left = int(rng.integers(200, 2001))
            stack = [f % POOL] * 4
            f += 1
        ids[t] = stack
        stack = stack[1:] + [f % POOL]
        f += 1
        left -= 1
        ends[t] = left == 0
    return ids, ends


def frames():
    return np.random.default_rng(1).integers(0, 256, (POOL, 84, 84), dtype=np.uint8)


def disk_bytes(path: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in path.rglob("*") if p.is_file())


def run_bigper(args, with_sequence: bool, where: Path) -> dict:
    import bigper

    n = args.steps
    pool = frames()
    ids, ends = stream(n)
    seq = bigper.Sequence(LENGTH, burn_in=BURN, period=PERIOD) if with_sequence else None
    buf = bigper.PrioritizedReplayBuffer(
        n, {"obs": ((4, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=4, storage="memmap", path=where, sequence=seq, seed=0)
    t0 = time.perf_counter()
    for t in range(n):
        nxt = ids[t + 1] if t + 1 < n and not ends[t] else np.r_[ids[t][1:], (ids[t][-1] + 1) % POOL]
        buf.add(obs=pool[ids[t]], next_obs=pool[nxt], action=t % 6, reward=0.0, terminated=bool(ends[t]))
    add_s = time.perf_counter() - t0
    out = {"add_per_s": n / add_s, "bytes_per_step": disk_bytes(where) / n}
    if with_sequence:
        rng = np.random.default_rng(0)
        times = []
        for _ in range(args.rounds + 2):
            td = rng.random((B, T))
            t1 = time.perf_counter()
            batch = buf.sample(B)
            buf.update_priorities(batch, td)
            times.append(time.perf_counter() - t1)
        assert batch["obs"].shape == (B, T, 4, 84, 84)
        out["round_ms"] = 1e3 * float(np.median(times[2:]))
    buf.close()
    return out


FLASHBAX_CHILD = r"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
import flashbax as fbx
n, rounds, B, T, PERIOD, POOL = (int(x) for x in sys.argv[1:7])
pool = np.random.default_rng(1).integers(0, 256, (POOL, 84, 84), dtype=np.uint8)
ids = np.load(sys.argv[7])
buf = fbx.make_prioritised_trajectory_buffer(add_batch_size=1, sample_batch_size=B, sample_sequence_length=T,
    period=PERIOD, min_length_time_axis=T, max_length_time_axis=n, priority_exponent=0.6, device="cpu")
ex = {"obs": jnp.zeros((4, 84, 84), jnp.uint8), "action": jnp.int32(0), "reward": jnp.float32(0),
      "done": jnp.bool_(False)}
state = buf.init(ex)
add = jax.jit(buf.add, donate_argnums=0)
sample = jax.jit(buf.sample)
setp = jax.jit(buf.set_priorities, donate_argnums=0)
t0 = time.perf_counter()
C = 1000
for lo in range(0, n, C):
    hi = min(lo + C, n)
    obs = pool[ids[lo:hi]][None]
    m = hi - lo
    state = add(state, {"obs": jnp.asarray(obs), "action": jnp.zeros((1, m), jnp.int32),
                        "reward": jnp.zeros((1, m), jnp.float32), "done": jnp.zeros((1, m), jnp.bool_)})
jax.block_until_ready(state)
add_s = time.perf_counter() - t0
nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
key = jax.random.PRNGKey(0)
times = []
rng = np.random.default_rng(0)
for i in range(rounds + 2):
    key, k = jax.random.split(key)
    td = rng.random((B, T))
    t1 = time.perf_counter()
    s = sample(state, k)
    jax.block_until_ready(s.experience)
    # R2D2's reduction, as a flashbax user computes it on the host
    p = 0.9 * td.max(1) + 0.1 * td.mean(1)
    state = setp(state, s.indices, jnp.asarray(p, jnp.float32))
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t1)
print(json.dumps({"add_per_s": n / add_s, "add_note": "chunks of 1000 steps", "round_ms":
                  1e3 * float(np.median(times[2:])), "bytes_per_step": nbytes / n}))
"""


def run_flashbax(args, tmp: Path) -> dict:
    py = args.flashbax_python
    if not Path(py).exists():
        return {"unavailable": f"no {py} (make a venv with flashbax and jax[cpu])"}
    ids, _ = stream(args.steps)
    np.save(tmp / "ids.npy", ids)
    script = tmp / "fbx_child.py"
    script.write_text(FLASHBAX_CHILD)
    r = subprocess.run([py, str(script), str(args.steps), str(args.rounds), str(B), str(T), str(PERIOD),
                        str(POOL), str(tmp / "ids.npy")], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        return {"error": r.stderr[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


TORCHRL_CHILD = r"""
import json, sys, time
import numpy as np
import torch
import torchrl._torchrl  # its prioritized samplers need the C++ extension
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers import PrioritizedSliceSampler
n, rounds, B, T, POOL = (int(x) for x in sys.argv[1:6])
scratch = sys.argv[6]
pool = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (POOL, 84, 84), dtype=np.uint8))
ids = torch.from_numpy(np.load(sys.argv[7]))
ends = torch.from_numpy(np.load(sys.argv[8]))
episode = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1].long()]), 0)
rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=scratch),
    sampler=PrioritizedSliceSampler(max_capacity=n, alpha=0.6, beta=0.4, slice_len=T, traj_key="episode",
                                    strict_length=False),
    batch_size=B * T)
t0 = time.perf_counter()
C = 1000
for lo in range(0, n, C):
    hi = min(lo + C, n)
    m = hi - lo
    rb.extend(TensorDict({"obs": pool[ids[lo:hi]], "action": torch.zeros(m, dtype=torch.long),
                          "reward": torch.zeros(m), "episode": episode[lo:hi]}, batch_size=[m]))
add_s = time.perf_counter() - t0
rng = np.random.default_rng(0)
times = []
for i in range(rounds + 2):
    td_err = torch.from_numpy(rng.random(B * T).astype(np.float32))
    t1 = time.perf_counter()
    s = rb.sample()
    rb.update_priority(s["index"], td_err)
    times.append(time.perf_counter() - t1)
import os
blocks = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(scratch) for f in fs)
print(json.dumps({"add_per_s": n / add_s, "add_note": "extend in chunks of 1000 steps",
                  "round_ms": 1e3 * float(np.median(times[2:])), "bytes_per_step": blocks / n,
                  "bytes_where": "disk", "versions": f"torch {torch.__version__}"}))
"""


def run_torchrl(args, tmp: Path) -> dict:
    py = args.torchrl_python
    if not Path(py).exists():
        return {"unavailable": f"no {py} (a venv where torchrl's compiled extension loads)"}
    ids, ends = stream(args.steps)
    np.save(tmp / "ids.npy", ids)
    np.save(tmp / "ends.npy", ends)
    script = tmp / "trl_child.py"
    script.write_text(TORCHRL_CHILD)
    (tmp / "trl").mkdir(exist_ok=True)
    r = subprocess.run([py, str(script), str(args.steps), str(args.rounds), str(B), str(T), str(POOL),
                        str(tmp / "trl"), str(tmp / "ids.npy"), str(tmp / "ends.npy")],
                       capture_output=True, text=True, timeout=3600)
    shutil.rmtree(tmp / "trl", ignore_errors=True)
    if r.returncode != 0:
        return {"unavailable": r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else "failed"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(args) -> int:
    import_bigper()  # the checkout's bigper, for run_bigper's import
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bigper-bench-seq-"))
    tmp.mkdir(parents=True, exist_ok=True)
    res = {"bench": "sequences", "steps": args.steps, "batch": B, "T": T, "period": PERIOD}
    try:
        warm = type(args)(**{**vars(args), "steps": 400, "rounds": 1})
        for on in (False, True):  # compile (or load from numba's cache) every kernel before timing
            run_bigper(warm, on, tmp / "warm")
            shutil.rmtree(tmp / "warm", ignore_errors=True)
        res["bigper_plain"] = run_bigper(args, False, tmp / "plain")
        shutil.rmtree(tmp / "plain", ignore_errors=True)
        res["bigper"] = run_bigper(args, True, tmp / "seq")
        shutil.rmtree(tmp / "seq", ignore_errors=True)
        res["flashbax"] = run_flashbax(args, tmp)
        res["torchrl"] = run_torchrl(args, tmp)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    b = res["bigper"]
    print(f"sequences: {args.steps:,} Atari-shaped steps, B={B} sequences of {BURN}+{LENGTH} steps, period {PERIOD}")
    print(f"  bigper   add {b['add_per_s']:,.0f}/s (without sequences {res['bigper_plain']['add_per_s']:,.0f}/s: "
          f"{b['add_per_s'] / res['bigper_plain']['add_per_s']:.2f}x); sample+update {b['round_ms']:.1f} ms; "
          f"{b['bytes_per_step']:,.0f} bytes/step on disk")
    for peer in ("flashbax", "torchrl"):
        r = res[peer]
        if "round_ms" in r:
            print(f"  {peer:<8} add {r['add_per_s']:,.0f}/s ({r.get('add_note', '')}); sample+update "
                  f"{r['round_ms']:.1f} ms ({r['round_ms'] / b['round_ms']:.2f}x bigper's time); "
                  f"{r['bytes_per_step']:,.0f} bytes/step {'on disk' if r.get('bytes_where') == 'disk' else 'in RAM'} "
                  f"({r['bytes_per_step'] / b['bytes_per_step']:.1f}x)")
        else:
            print(f"  {peer:<8} {r}")
    print(json.dumps(res))
    return 0
