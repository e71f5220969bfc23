"""The side of ``bench torchrl`` that runs in each buffer's own process (its venv: TorchRL's
prioritized buffer needs the torch its extension was built for): the data as TorchRL's collector
writes it, each buffer, one side's timed rounds and proxy share, and the kill -9 resume check's
writer and reader. ``python tools/workloads/torchrl/side.py WHAT CONFIG_JSON`` prints a JSON line."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

if not __package__:  # started by path (its parent does so): tools/ is the import root, not this folder
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [os.path.dirname(os.path.dirname(_here))] + [p for p in sys.path if p != _here]

import numpy as np  # noqa: E402

K, H, W, N_ACTIONS = 4, 84, 84, 6
ALPHA, BETA = 0.6, 0.4
CHUNK = 1000  # steps an extend (a collector's frames_per_batch)
TARGET_SPEED = 3.0  # TorchRL µs / bigper µs, sample + update
TARGET_BYTES = 6.0  # TorchRL bytes / bigper bytes on disk a transition
DEFAULT_TRL_PYTHON = "/tmp/trl-venv/bin/python"


# -- the data: TensorDicts as TorchRL's collector writes them -------------------------------------------------


def chunks(torch, frames: np.ndarray, n: int, start: int = 0):
    """TensorDicts of up to CHUNK steps covering steps ``start .. start + n`` of the stream."""
    from tensordict import TensorDict

    from workloads.atari.data import Stream

    stream = Stream(frames)
    for g in range(start, start + n, CHUNK):
        m = min(CHUNK, start + n - g)
        steps = [stream.step(i) for i in range(g, g + m)]
        term = torch.from_numpy(np.array([s[4] for s in steps])).reshape(m, 1)
        false = torch.zeros(m, 1, dtype=torch.bool)
        yield TensorDict({
            "pixels": torch.from_numpy(np.stack([s[0] for s in steps])),
            "action": torch.nn.functional.one_hot(torch.from_numpy(np.array([s[2] for s in steps])), N_ACTIONS),
            "done": false.clone(), "terminated": false.clone(), "truncated": false.clone(),
            "next": {"pixels": torch.from_numpy(np.stack([s[1] for s in steps])),
                     "reward": torch.from_numpy(np.array([s[3] for s in steps], np.float32)).reshape(m, 1),
                     "done": term.clone(), "terminated": term.clone(), "truncated": false.clone()},
        }, batch_size=[m])


def disk_bytes(path) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


# -- one side, in its own process ---------------------------------------------------------------------------------


def make_buffer(lib: str, n: int, scratch: str, seed: int = 0):
    """``(buffer, sampler description)`` for side ``lib``: "bigper", "torchrl" or "torchrl-uniform"."""
    import torch
    from torchrl.data import LazyMemmapStorage

    if lib == "bigper":
        from benchkit import import_bigper

        import_bigper()
        from bigper.integrations.torchrl import PrioritizedReplayBuffer

        rb = PrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, priority_key="td_error",
                                     storage=LazyMemmapStorage(n, scratch_dir=scratch), frame_stack=K, seed=seed)
        return rb, "bigper.integrations.torchrl.PrioritizedReplayBuffer (frame_stack=4)"
    gen = torch.Generator().manual_seed(seed)
    if lib == "torchrl-nogen":  # as TorchRL's own examples build it: draws from torch's global RNG
        lib, gen = "torchrl", None
    if lib == "torchrl":
        import torchrl._torchrl  # noqa: F401  (its sum trees: fail here, by name, where the extension does not load)
        from torchrl.data import TensorDictPrioritizedReplayBuffer

        rb = TensorDictPrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, priority_key="td_error",
                                               storage=LazyMemmapStorage(n, scratch_dir=scratch), generator=gen)
        return rb, "TensorDictPrioritizedReplayBuffer + LazyMemmapStorage"
    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=scratch), sampler=RandomSampler(),
                                priority_key="td_error", generator=gen)
    return rb, "TensorDictReplayBuffer + LazyMemmapStorage, RandomSampler (uniform: the fallback)"


def weights_of(s):
    w = s.get("priority_weight", None)
    return w if w is not None else s.get("_weight", None)


def run_side(cfg: dict) -> dict:
    """Fill, time, measure one side; returns its numbers (the child's JSON line)."""
    import torch

    from workloads.learner.proxy import proxy_learner

    torch.set_num_threads(1)
    frames = np.load(cfg["frames"])
    n, lib = cfg["transitions"], cfg["lib"]
    out = {"lib": lib, "torch": torch.__version__, "transitions": n}
    try:
        import torchrl

        out["torchrl"] = torchrl.__version__
    except Exception:  # noqa: BLE001
        pass
    if lib == "bigper":  # compile (or load from numba's cache) the kernels first: the fill times the writing
        warm, _ = make_buffer(lib, 2 * CHUNK, cfg["scratch"] + "-warm")
        for td in chunks(torch, frames, 2 * CHUNK):
            warm.extend(td)
        s = warm.sample(8)
        s.set("td_error", torch.ones(8))
        warm.update_tensordict_priority(s)
        warm.close()
        shutil.rmtree(cfg["scratch"] + "-warm", ignore_errors=True)
    rb, out["buffer"] = make_buffer(lib, n, cfg["scratch"])
    t0 = time.perf_counter()
    for td in chunks(torch, frames, n):
        rb.extend(td)
    out["fill_s"] = time.perf_counter() - t0
    os.sync()  # the fill's dirty pages written back now, not while the rounds are timed
    out["bytes_per_transition"] = disk_bytes(cfg["scratch"]) / n
    out["len"] = len(rb)

    rng = np.random.default_rng(1)
    out["round_us"], out["round_cpu_us"], out["proxy"] = {}, {}, {}
    step = proxy_learner(torch, torch.device("cpu"), cfg["proxy_ops"])
    for b in cfg["batches"]:
        pool = [torch.from_numpy(np.abs(rng.standard_normal(b)).astype(np.float32) + 0.01) for _ in range(16)]

        def round_(i, b=b, pool=pool):
            s = rb.sample(b)
            s.set("td_error", pool[i % len(pool)])
            rb.update_tensordict_priority(s)

        for i in range(10):
            round_(i)
        walls, cpus = [], []
        for _ in range(cfg["repeats"]):
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(cfg["iters"]):
                round_(i)
            walls.append((time.perf_counter() - w0) / cfg["iters"] * 1e6)
            cpus.append((time.process_time() - c0) / cfg["iters"] * 1e6)
        out["round_us"][b], out["round_cpu_us"][b] = float(np.median(walls)), float(np.median(cpus))

        # the DQN-style loop with the proxy learner: sample -> learner -> "td_error" -> update
        def view(s):
            return {"reward": s.get(("next", "reward")).reshape(-1), "obs": s.get("pixels"),
                    "weights": weights_of(s) if weights_of(s) is not None else torch.ones(s.shape[0])}

        ready = view(rb.sample(b).clone())

        def fed(i, b=b):
            s = rb.sample(b)
            s.set("td_error", step(view(s)))
            rb.update_tensordict_priority(s)

        def timed(fn):
            for i in range(5):
                fn(i)
            t1 = time.perf_counter()
            for i in range(cfg["proxy_iters"]):
                fn(i)
            return (time.perf_counter() - t1) / cfg["proxy_iters"] * 1e6

        ceiling = timed(lambda i: step(ready))
        feed = timed(fed)
        ceiling = min(ceiling, timed(lambda i: step(ready)))
        out["proxy"][b] = {"ceiling_us": ceiling, "fed_us": feed, "share": ceiling / feed}
    s = rb.sample(32)
    out["sample_keys"] = sorted(str(k) for k in s.keys(True, True))
    out["weight_key"] = "priority_weight" if "priority_weight" in s.keys() else "_weight"
    if lib == "bigper":
        rb.close()
    return out


# -- resume after kill -9 ----------------------------------------------------------------------------------------


def _digest(s) -> dict:
    import hashlib

    px = s.get("pixels").contiguous().numpy()
    nx = s.get(("next", "pixels")).contiguous().numpy()
    w = weights_of(s)
    return {"index": s.get("index").reshape(-1).tolist(),
            "weights": None if w is None else [float(f"{x:.9g}") for x in w.reshape(-1).tolist()],
            "rows": hashlib.sha256(px.tobytes() + nx.tobytes()).hexdigest()[:16]}


def _priorities(rb, lib: str, n: int) -> np.ndarray | None:
    if lib == "bigper":
        return np.asarray(rb.buffer.leaves(np.arange(n)), np.float64)
    if lib.startswith("torchrl") and lib != "torchrl-uniform":
        tree = rb._sampler._sum_tree  # TorchRL's sum tree: its leaves are priority ** alpha
        return np.array([float(tree[i]) for i in range(n)])
    return None


def resume_writer(cfg: dict) -> None:
    """Fill, train, dumps, print the next draw, then write and sample until killed."""
    import torch

    torch.set_num_threads(1)
    frames, n, lib = np.load(cfg["frames"]), cfg["transitions"], cfg["lib"]
    rb, _ = make_buffer(lib, 2 * n, cfg["scratch"], seed=4)
    for td in chunks(torch, frames, n):
        rb.extend(td)
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        s = rb.sample(32)
        s.set("td_error", torch.rand(32, generator=g) + 0.01)
        rb.update_tensordict_priority(s)
    t0 = time.perf_counter()
    rb.dumps(cfg["snap"])
    dump_s = time.perf_counter() - t0
    p = _priorities(rb, lib, n)
    if p is not None:
        np.save(cfg["snap_prio"], p)
    print("after " + json.dumps({**_digest(rb.sample(32)), "dumps_s": dump_s,
                                 "dump_bytes": disk_bytes(cfg["snap"])}), flush=True)
    start = n
    while True:  # writing and sampling until the kill
        for td in chunks(torch, frames, 100, start=start):
            rb.extend(td)
        start += 100
        s = rb.sample(32)
        s.set("td_error", torch.rand(32) + 0.01)
        rb.update_tensordict_priority(s)


def resume_reader(cfg: dict) -> dict:
    """A fresh process: the same constructor, ``loads`` the dump, draw."""
    import torch

    torch.set_num_threads(1)
    n, lib = cfg["transitions"], cfg["lib"]
    rb, _ = make_buffer(lib, 2 * n, cfg["scratch"], seed=4)
    notes = {}
    t0 = time.perf_counter()
    if lib == "bigper":
        rb.loads(cfg["snap"], rewind=True)  # the killed run wrote past its snapshot at this path
    else:
        try:
            rb.loads(cfg["snap"])
        except RuntimeError as e:  # TorchRL: its loads will not write over the killed run's memmap files
            notes = {"same_scratch_dir": f"{type(e).__name__}: {e}"[:300], "loaded_into": "a new scratch_dir"}
            rb, _ = make_buffer(lib, 2 * n, cfg["scratch"] + "-fresh", seed=4)
            t0 = time.perf_counter()
            rb.loads(cfg["snap"])
    out = {**notes, "loads_s": time.perf_counter() - t0, "len": len(rb), **_digest(rb.sample(32))}
    p = _priorities(rb, lib, n)
    if p is not None and os.path.exists(cfg["snap_prio"]):
        out["same_priorities"] = bool(np.array_equal(p, np.load(cfg["snap_prio"])))
    return out


def child_main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    if argv[0] == "side":
        print(json.dumps(run_side(cfg)))
    elif argv[0] == "resume-writer":
        resume_writer(cfg)
    elif argv[0] == "resume-reader":
        print(json.dumps(resume_reader(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
