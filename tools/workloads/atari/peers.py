"""Workload "atari", the libraries: one adapter per library over the same stream.

``make_<peer>(capacity, stream, root)`` returns a dict with:

- ``add(g)``: add global step ``g`` of the stream
- ``round(i)``: sample BATCH + weights + update BATCH priorities (the i-th pool array)
- ``probe(count) -> (gids, obs (B,4,84,84), next_obs, weights)`` for the checks
- ``bytes(rss0) -> dict``: bytes per transition and how they were measured
- ``api``, ``notes``, ``close()``
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from benchkit import PeerUnavailable, disk_bytes, import_bigper, proc_status, short_error
from workloads.atari.data import ALPHA, BATCH, BETA, H, K, W, Stream, td_pool


def ram_arrays(obj, depth: int = 4, seen: set | None = None) -> int:
    """Bytes of the numpy arrays reachable from ``obj`` through attributes,
    dicts and lists (tree, bookkeeping), not through its storage (whose arrays
    are file mappings or the data itself)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):  # a view of an array already counted starts at its address
        addr = ("addr", obj.__array_interface__["data"][0])
        if addr in seen:
            return 0
        seen.add(addr)
        return obj.nbytes
    if type(obj).__module__.startswith("bigper.storage"):
        return 0
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("bigper"):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(ram_arrays(v, depth - 1, seen) for v in items)


def slot_gids(slots: np.ndarray, count: int, capacity: int) -> np.ndarray:
    """Global step held at each ring slot after ``count`` adds (slot = step % capacity)."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    return slots + capacity * ((count - 1 - slots) // capacity)



def make_numpy(cap: int, stream: Stream, root: Path) -> dict:
    frames = np.zeros((cap, H, W), dtype=np.uint8)
    action = np.zeros(cap, dtype=np.int64)
    reward = np.zeros(cap, dtype=np.float32)
    rng = np.random.default_rng(0)
    k4 = np.arange(K)

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        s = g % cap
        frames[s] = nxt[-1]
        action[s], reward[s] = a, r

    def rnd(i: int) -> None:
        s = rng.integers(0, cap - K - 1, BATCH)
        refs = s[:, None] + k4
        frames[refs], frames[refs + 1], action[s], reward[s]  # noqa: B018

    return {"add": add, "round": rnd, "probe": None,
            "bytes": lambda rss0: _rss_bytes(rss0, cap),
            "api": "frames[refs] for obs and next_obs (refs (32, 4)); add = one frame + 2 scalars into a ring",
            "notes": ["floor: no tree, no weights, no episode padding"], "close": lambda: None}


def _rss_bytes(rss0: dict, cap: int) -> dict:
    now = proc_status()
    grow = now["VmRSS"] - rss0["VmRSS"]
    return {"bytes_per_transition": grow / cap, "where": "RAM (RSS growth)", "ram_bytes": grow}


def make_bigper(cap: int, stream: Stream, root: Path, *, storage: str, n_step: int = 1) -> dict:
    bigper = import_bigper()
    path = None
    if storage != "memory":
        path = root / f"bigper-{storage}-n{n_step}"
    buf = bigper.PrioritizedReplayBuffer(
        cap, {"obs": ((K, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, n_step=n_step, gamma=0.99, alpha=ALPHA, beta=BETA, storage=storage, path=path,
        seed=0)
    pool = td_pool()

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        buf.add(obs=obs, action=a, reward=r, next_obs=nxt, terminated=term)

    def rnd(i: int) -> None:
        b = buf.sample(BATCH)
        buf.update_priorities(b, pool[i % len(pool)])

    def probe(count: int):
        b = buf.sample(256)
        gids = np.asarray(b.generations, dtype=np.int64)
        if n_step > 1:  # next_obs is the stack n steps on (or at the episode end)
            return gids, b["obs"], None, b.weights
        return gids, b["obs"], b["next_obs"], b.weights

    def nbytes(rss0: dict) -> dict:
        now = proc_status()
        if path is None:
            grow = now["VmRSS"] - rss0["VmRSS"]
            return {"bytes_per_transition": grow / cap, "where": "RAM (RSS growth)", "ram_bytes": grow}
        disk = disk_bytes(path)
        anon = now["RssAnon"] - rss0["RssAnon"]
        arrays = ram_arrays(buf)
        return {"bytes_per_transition": (disk + anon) / cap, "where": "disk + RAM (RssAnon growth)",
                "disk_bytes": disk, "ram_bytes": anon, "disk_per_transition": disk / cap,
                "ram_per_transition": anon / cap, "ram_arrays_per_transition": arrays / cap,
                "files": file_sizes(path)}

    return {"add": add, "round": rnd, "probe": probe, "bytes": nbytes,
            "api": f"PrioritizedReplayBuffer(frame_stack=4, n_step={n_step}, storage={storage!r}).add / "
                   "sample(32) / update_priorities(batch, td)",
            "notes": [], "close": buf.close, "buffer": buf}


def file_sizes(path: Path) -> dict[str, int]:
    """Allocated bytes per array (chunk files summed), for the bytes breakdown."""
    out: dict[str, int] = {}
    for p in path.rglob("*"):
        if p.is_file():
            key = p.name.split(".")[0] if p.parent.name == "data" else f"{p.parent.name}/{p.name}"
            out[key] = out.get(key, 0) + p.stat().st_blocks * 512
    return out


def make_cpprb(cap: int, stream: Stream, root: Path) -> dict:
    from cpprb import PrioritizedReplayBuffer

    rb = PrioritizedReplayBuffer(
        cap, {"obs": {"shape": (H, W, K), "dtype": np.uint8}, "act": {"dtype": np.int64},
              "rew": {"dtype": np.float32}, "done": {"dtype": np.bool_}},
        next_of="obs", stack_compress="obs", alpha=ALPHA, eps=1e-6)
    pool = td_pool()

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        rb.add(obs=np.moveaxis(obs, 0, -1), next_obs=np.moveaxis(nxt, 0, -1), act=a, rew=r, done=term)
        if term:
            rb.on_episode_end()

    def rnd(i: int) -> None:
        s = rb.sample(BATCH, beta=BETA)
        rb.update_priorities(s["indexes"], pool[i % len(pool)])

    def probe(count: int):
        s = rb.sample(256, beta=BETA)
        gids = slot_gids(s["indexes"], count, cap)
        return gids, np.moveaxis(s["obs"], -1, 1), np.moveaxis(s["next_obs"], -1, 1), s["weights"]

    return {"add": add, "round": rnd, "probe": probe, "bytes": lambda rss0: _rss_bytes(rss0, cap),
            "api": 'PrioritizedReplayBuffer(next_of="obs", stack_compress="obs").add / sample(32, beta) / '
                   "update_priorities(indexes, td)",
            "notes": ["stacks stored and sampled as (84, 84, 4): the stack axis must be last"],
            "close": lambda: None}


def make_tianshou(cap: int, stream: Stream, root: Path) -> dict:
    from tianshou.data import Batch, PrioritizedReplayBuffer

    np.random.seed(0)  # its prioritized sampling draws from the global RNG
    buf = PrioritizedReplayBuffer(cap, alpha=ALPHA, beta=BETA, stack_num=K, ignore_obs_next=True,
                                  save_only_last_obs=True)
    pool = td_pool()

    def add(g: int) -> None:
        obs, nxt, a, r, term = stream.step(g)
        buf.add(Batch(obs=obs, act=a, rew=r, terminated=term, truncated=False, obs_next=nxt))

    def rnd(i: int) -> None:
        b, idx = buf.sample(BATCH)
        b.obs, b.obs_next, b.weight  # noqa: B018 (stacked at sample time)
        buf.update_weight(idx, pool[i % len(pool)])

    def probe(count: int):
        b, idx = buf.sample(256)
        return slot_gids(idx, count, cap), b.obs, b.obs_next, b.weight

    return {"add": add, "round": rnd, "probe": probe, "bytes": lambda rss0: _rss_bytes(rss0, cap),
            "api": "PrioritizedReplayBuffer(stack_num=4, save_only_last_obs=True, ignore_obs_next=True)"
                   ".add(Batch) / sample(32) / update_weight(idx, td)",
            "notes": ["next_obs of a terminal step is its own obs (the buffer does not keep it)"],
            "close": lambda: None}


def make_torchrl(cap: int, stream: Stream, root: Path) -> dict:
    import torch

    try:  # PrioritizedSampler's sum/min trees live in TorchRL's C++ extension
        import torchrl._torchrl  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"torchrl._torchrl does not load with torch {torch.__version__}: "
                              f"{short_error(exc)}") from exc
    raise PeerUnavailable("torchrl adapter not written: its extension loaded, add one")


MAKERS: dict[str, Callable[[int, Stream, Path], dict]] = {
    "numpy": make_numpy,
    "bigper-memory": lambda c, s, r: make_bigper(c, s, r, storage="memory"),
    "bigper-memmap": lambda c, s, r: make_bigper(c, s, r, storage="memmap"),
    "bigper-memmap-n3": lambda c, s, r: make_bigper(c, s, r, storage="memmap", n_step=3),
    "cpprb": make_cpprb,
    "tianshou": make_tianshou,
    "torchrl": make_torchrl,
}
VERSION_OF = {"numpy": "numpy", "cpprb": "cpprb", "tianshou": "tianshou", "torchrl": "torchrl"}
