"""Workload "atari", the learner-shaped rows (one process, bigper memmap only).

* **Vector adds**: ``num_envs=8``, one ``add`` per step of all 8 envs,
  transitions per second, beside ``num_envs=1`` adds in the same process.
* **In the loop**: a small Atari CNN (the Nature DQN network, CPU torch)
  learns from the buffer; ``add``, ``sample(32)`` and ``update_priorities``
  each run between the forward and the backward pass, as in a learner, and
  are timed there; the same calls repeated back to back are the reference
  ("isolated"). The ratio shows what caches and threads left by the network
  cost a buffer call.
* **Gather threads**: ``sample(B)`` of large batches (256, 1024) with the
  frame gather on one thread and split over two (``BIGPER_THREADS``; the
  split is forced here, bigper itself splits only with 4 or more cores), and
  the projection to 16 cores by Amdahl's law from the two timings (the
  share of the call that ran in parallel, f, from ``t2 = t1 (1 - f/2)``).
  A projection, not a measurement: past a few cores the memory bus, not the
  core count, bounds a copy, so it is an upper bound on the gain.
* **Prefetch**: the learner-visible wait for the next batch (``next()`` on
  the iterator, ``to_torch`` included) with ``buf.sampler(32, prefetch=2,
  device="cpu")`` against ``prefetch=0`` (each batch drawn when asked for),
  with the network's forward and backward between batches.

Usage (tools/bench.py atari runs it)::

    python tools/workloads/atari/loop.py --size 100000 [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # started by path (its parent does so): tools/ is the import root, not this folder
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [os.path.dirname(os.path.dirname(_here))] + [p for p in sys.path if p != _here]

import numpy as np  # noqa: E402

from benchkit import import_bigper, short_error  # noqa: E402
from workloads.atari.data import ALPHA, BATCH, BETA, H, K, W, Stream, real_frames  # noqa: E402

ENVS = 8
FIELDS = {"obs": ((K, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}


def _buffer(bigper, cap: int, path: Path, num_envs: int):
    return bigper.PrioritizedReplayBuffer(cap, FIELDS, frame_stack=K, alpha=ALPHA, beta=BETA,
                                          storage="memmap", path=path, num_envs=num_envs, seed=0)


def vector_adds(bigper, stream: Stream, cap: int, root: Path, steps: int) -> dict:
    """Transitions per second: 8 envs a call, and one env a call, same stream."""
    out = {}
    offs = np.arange(ENVS) * (stream.period // ENVS)
    for envs in (ENVS, 1):
        buf = _buffer(bigper, cap, root / f"vec{envs}", envs)
        g = 0

        def step(g):
            if envs == 1:
                o, n, a, r, t = stream.step(g)
                buf.add(obs=o, action=a, reward=r, next_obs=n, terminated=t)
                return
            parts = [stream.step(int(g + off)) for off in offs]
            buf.add(obs=np.stack([p[0] for p in parts]), action=np.array([p[2] for p in parts]),
                    reward=np.array([p[3] for p in parts]), next_obs=np.stack([p[1] for p in parts]),
                    terminated=np.array([p[4] for p in parts]))

        while g * envs < cap:  # fill: the ring then wraps in the timed part
            step(g)
            g += 1
        blocks = []
        for _ in range(5):
            n = max(1, steps // envs // 5)
            # the env side (stacking 8 steps) is timed apart and taken out
            t0 = time.perf_counter()
            for i in range(n):
                step(g + i)
            blocks.append((time.perf_counter() - t0) / (n * envs))
            g += n
        env_s = 0.0
        if envs > 1:
            t0 = time.perf_counter()
            for i in range(200):
                parts = [stream.step(int(g + i + off)) for off in offs]
                np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])  # noqa: B018
            env_s = (time.perf_counter() - t0) / (200 * envs)
        buf.close()
        per = statistics.median(blocks) - env_s
        out[f"envs{envs}"] = {"transitions_per_s": 1 / per, "env_side_us": env_s * 1e6}
    out["ratio_8_over_1"] = out[f"envs{ENVS}"]["transitions_per_s"] / out["envs1"]["transitions_per_s"]
    return out


def _net(torch):
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(K, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512),
                         nn.ReLU(), nn.Linear(512, 6))


def in_loop(bigper, stream: Stream, cap: int, root: Path, iters: int) -> dict:
    import torch

    torch.manual_seed(0)
    net = _net(torch)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    buf = _buffer(bigper, cap, root / "loop", 1)
    g = 0
    while g < cap:
        o, n, a, r, t = stream.step(g)
        buf.add(obs=o, action=a, reward=r, next_obs=n, terminated=t)
        g += 1
    times = {"add": [], "sample": [], "update": []}
    batch = buf.sample(BATCH)
    for i in range(iters + 5):
        x = torch.from_numpy(np.ascontiguousarray(batch["obs"])).float().div_(255)
        q = net(x).gather(1, torch.from_numpy(batch["action"])[:, None]).squeeze(1)
        loss = (q - 1.0).pow(2).mul(torch.from_numpy(batch.weights)).mean()
        # --- between forward and backward: the buffer's calls -------------------
        o, n, a, r, t = stream.step(g + i)
        t0 = time.perf_counter()
        buf.add(obs=o, action=a, reward=r, next_obs=n, terminated=t)
        t1 = time.perf_counter()
        buf.update_priorities(batch, (q - 1.0).detach().abs().numpy())
        t2 = time.perf_counter()
        nxt = buf.sample(BATCH)
        t3 = time.perf_counter()
        # -----------------------------------------------------------------------
        opt.zero_grad()
        loss.backward()
        opt.step()
        batch = nxt
        if i >= 5:
            times["add"].append(t1 - t0)
            times["update"].append(t2 - t1)
            times["sample"].append(t3 - t2)
    g += iters + 5
    iso = {"add": [], "sample": [], "update": []}
    td = np.ones(BATCH)
    for i in range(200):
        o, n, a, r, t = stream.step(g + i)
        t0 = time.perf_counter()
        buf.add(obs=o, action=a, reward=r, next_obs=n, terminated=t)
        t1 = time.perf_counter()
        buf.update_priorities(batch, td)
        t2 = time.perf_counter()
        batch = buf.sample(BATCH)
        t3 = time.perf_counter()
        iso["add"].append(t1 - t0)
        iso["update"].append(t2 - t1)
        iso["sample"].append(t3 - t2)
    buf.close()
    out = {}
    for k in times:
        loop_us, iso_us = statistics.median(times[k]) * 1e6, statistics.median(iso[k]) * 1e6
        out[k] = {"in_loop_us": loop_us, "isolated_us": iso_us, "ratio": loop_us / iso_us}
    out["torch_threads"] = torch.get_num_threads()
    return out


def gather_threads(bigper, stream: Stream, cap: int, root: Path, iters: int) -> dict:
    """sample(B) for large B with the frame gather on 1 and on 2 threads, and Amdahl's projection to 16."""
    import os

    from bigper.frames import store as FR

    buf = _buffer(bigper, cap, root / "gather", 1)
    for g in range(cap):
        o, n, a, r, t = stream.step(g)
        buf.add(obs=o, action=a, reward=r, next_obs=n, terminated=t)
    saved = FR.GATHER_MIN_THREADS, os.environ.get("BIGPER_THREADS")
    FR.GATHER_MIN_THREADS = 1
    out = {}
    try:
        for b in (256, 1024):
            times = {1: [], 2: []}
            for rep in range(2 * iters):  # interleaved: 1, 2, 1, 2, ...
                threads = 1 + rep % 2
                os.environ["BIGPER_THREADS"] = str(threads)
                buf.sample(b)  # warm
                t0 = time.perf_counter()
                buf.sample(b)
                times[threads].append(time.perf_counter() - t0)
            t1, t2 = (statistics.median(times[k]) * 1e6 for k in (1, 2))
            f = min(max(2 * (1 - t2 / t1), 0.0), 1.0)
            t16 = t1 * ((1 - f) + f / 16)
            out[f"B{b}"] = {"t1_us": t1, "t2_us": t2, "speedup2": t1 / t2, "parallel_share": f,
                            "t16_projected_us": t16, "speedup16_projected": t1 / t16,
                            "frame_bytes": b * (K + 1) * H * W}
    finally:
        FR.GATHER_MIN_THREADS = saved[0]
        if saved[1] is None:
            os.environ.pop("BIGPER_THREADS", None)
        else:
            os.environ["BIGPER_THREADS"] = saved[1]
        buf.close()
    return out


def prefetch_wait(bigper, stream: Stream, cap: int, root: Path, iters: int) -> dict:
    """Median wait for the next batch (as tensors on the CPU) with and without prefetch."""
    import torch

    torch.manual_seed(0)
    net = _net(torch)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    buf = _buffer(bigper, cap, root / "prefetch", 1)
    for g in range(cap):
        o, n, a, r, t = stream.step(g)
        buf.add(obs=o, action=a, reward=r, next_obs=n, terminated=t)
    out = {}
    # Two learners: the CNN on the CPU (it competes with the thread for the 2 cores
    # and the GIL), and a step that runs off the CPU (a GPU's, stood in for by a
    # 10 ms sleep, which releases the GIL like a CUDA synchronize does).
    for learner in ("cpu_cnn", "off_cpu_10ms"):
        for depth in (0, 2, 0, 2):  # twice each, alternating; the second of each is kept
            it = buf.sampler(BATCH, prefetch=depth, device="cpu")
            waits, steps = [], []
            for i in range(iters + 3):
                t0 = time.perf_counter()
                b = next(it)
                t1 = time.perf_counter()
                if learner == "cpu_cnn":
                    q = net(b["obs"].float().div_(255)).gather(1, b["action"][:, None]).squeeze(1)
                    loss = (q - 1.0).pow(2).mul(b["weights"]).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    td = (q - 1.0).detach().abs()
                else:
                    time.sleep(0.010)
                    td = torch.ones(BATCH)
                buf.update_priorities(b, td)
                t2 = time.perf_counter()
                if i >= 3:
                    waits.append(t1 - t0)
                    steps.append(t2 - t0)
            it.close()
            out.setdefault(learner, {})[f"prefetch{depth}"] = {
                "wait_us": statistics.median(waits) * 1e6, "step_ms": statistics.median(steps) * 1e3}
        r = out[learner]
        r["wait_ratio"] = r["prefetch0"]["wait_us"] / max(r["prefetch2"]["wait_us"], 1e-3)
    buf.close()
    return out


def run(size: int, quick: bool, root: Path) -> dict:
    bigper = import_bigper()
    frames, source = real_frames()
    stream = Stream(frames)
    cap = min(size, 20_000) if quick else size
    res = {"status": "ok", "capacity": cap, "frames": source}
    for name, fn, arg in (("vector_adds", vector_adds, 4000 if quick else 16000),
                          ("in_loop", in_loop, 20 if quick else 40),
                          ("gather_threads", gather_threads, 10 if quick else 40),
                          ("prefetch", prefetch_wait, 10 if quick else 25)):
        try:
            res[name] = fn(bigper, stream, min(cap, 20_000) if name != "vector_adds" else cap, root, arg)
        except ImportError as exc:
            res[name] = {"status": "not installed", "error": short_error(exc)}
        except Exception as exc:  # one row failing must not lose the others
            res[name] = {"status": "error", "error": short_error(exc)}
    return res


def print_loop(res: dict) -> None:
    print()
    if res.get("status") != "ok":
        print(f"learner-shaped rows: {res.get('status')}: {res.get('error')}")
        return
    v = res.get("vector_adds", {})
    if "ratio_8_over_1" in v:
        print(f"num_envs=8 adds (memmap, {res['capacity']:,}): {v['envs8']['transitions_per_s']:,.0f} "
              f"transitions/s vs num_envs=1 {v['envs1']['transitions_per_s']:,.0f}/s "
              f"({v['ratio_8_over_1']:.2f}x; stacking the 8 envs' arrays, {v['envs8']['env_side_us']:.1f} "
              "us a transition, taken out)")
    else:
        print(f"num_envs=8 adds: {v}")
    loop = res.get("in_loop", {})
    if "add" in loop:
        cells = ", ".join(f"{k} {loop[k]['in_loop_us']:.0f} us in the loop vs {loop[k]['isolated_us']:.0f} "
                          f"isolated ({loop[k]['ratio']:.2f}x)" for k in ("add", "sample", "update"))
        print(f"in the loop (between a Nature-CNN forward and backward, CPU torch, "
              f"{loop['torch_threads']} threads): {cells}")
    else:
        print(f"in the loop: {loop}")
    gt = res.get("gather_threads", {})
    for b in ("B256", "B1024"):
        r = gt.get(b)
        if r:
            print(f"sample({b[1:]}) with the frame gather on 1 / 2 threads: {r['t1_us']:.0f} / {r['t2_us']:.0f} us "
                  f"({r['speedup2']:.2f}x; {r['parallel_share']:.0%} of the call in parallel); projected "
                  f"for 16 cores (Amdahl, an upper bound): {r['t16_projected_us']:.0f} us "
                  f"({r['speedup16_projected']:.1f}x)")
    if not any(b in gt for b in ("B256", "B1024")):
        print(f"gather threads: {gt}")
    p = res.get("prefetch", {})
    labels = {"cpu_cnn": "CNN step on the CPU", "off_cpu_10ms": "10 ms step off the CPU (as on a GPU)"}
    for learner, label in labels.items():
        r = p.get(learner, {})
        if "wait_ratio" in r:
            print(f"learner-visible wait per batch (to_torch included), {label}: prefetch=0 "
                  f"{r['prefetch0']['wait_us']:.0f} us, prefetch=2 {r['prefetch2']['wait_us']:.0f} us "
                  f"({r['wait_ratio']:.1f}x less); learner step {r['prefetch0']['step_ms']:.2f} vs "
                  f"{r['prefetch2']['step_ms']:.2f} ms")
    if not any("wait_ratio" in p.get(k, {}) for k in labels):
        print(f"prefetch: {p}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="atari/loop.py", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-atari-loop-", dir=a.dir))
    try:
        res = run(a.size, a.quick, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
