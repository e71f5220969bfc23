"""Shared pieces of the snapshot tests: consistent Atari-like streams (frame
stacks that continue, episode ends), buffers on every storage, a learner-shaped
loop, comparisons bit for bit, and file hashes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

import bigper

KINDS = ("memory", "memmap", "hdf5")


class Stream:
    """Steps of ``num_envs`` envs: ``obs`` is a stack of ``k`` frames (or one
    frame when ``k`` is None) whose ``next_obs`` shifts in a new frame; episodes
    end (terminated or truncated) at random and restart with a fresh stack."""

    def __init__(self, num_envs: int = 1, k: int | None = 4, frame=(8, 8), seed: int = 0,
                 p_end: float = 0.08):
        self.rng = np.random.default_rng(seed)
        self.E, self.k, self.frame, self.p_end = num_envs, k, tuple(frame), p_end
        self.stack: list = [None] * num_envs
        self.t = 0

    def fields(self) -> dict:
        obs = ((self.k, *self.frame) if self.k else self.frame, np.uint8)
        return {"obs": obs, "reward": ((), np.float32), "action": ((), np.int64)}

    def _frame(self) -> np.ndarray:
        return self.rng.integers(0, 256, self.frame, dtype=np.uint8)

    def step(self) -> dict:
        out = {n: [] for n in ("obs", "next_obs", "reward", "action", "terminated", "truncated")}
        for e in range(self.E):
            if self.stack[e] is None:
                f = self._frame()
                self.stack[e] = np.stack([f] * self.k) if self.k else f
            f = self._frame()
            nxt = np.concatenate([self.stack[e][1:], f[None]]) if self.k else f
            end = self.rng.random() < self.p_end
            term = bool(end and self.rng.random() < 0.6)
            out["obs"].append(self.stack[e])
            out["next_obs"].append(nxt)
            out["reward"].append(np.float32(self.rng.standard_normal()))
            out["action"].append(np.int64(self.rng.integers(0, 6)))
            out["terminated"].append(term)
            out["truncated"].append(bool(end and not term))
            self.stack[e] = None if end else nxt
        self.t += 1
        if self.E == 1:
            return {n: np.asarray(v[0]) for n, v in out.items()}
        return {n: np.stack(v) for n, v in out.items()}


def where(kind: str, tmp: Path, name: str):
    if kind == "memory":
        return None
    return tmp / (f"{name}.h5" if kind == "hdf5" else name)


def make(kind: str, path, stream: Stream, capacity: int = 64, chunk_bytes: int = 4096, **kw):
    if kind == "memmap":
        kw.setdefault("storage_options", {"chunk_bytes": chunk_bytes})
    kw.setdefault("frame_stack", stream.k)
    if path is not None:
        kw.setdefault("mode", "resume")  # these tests reopen on purpose
    return bigper.PrioritizedReplayBuffer(capacity, stream.fields(), storage=kind, path=path,
                                          num_envs=stream.E, **kw)


def feed(buf, stream: Stream, n: int) -> None:
    for _ in range(n):
        buf.add(**stream.step())


def learn(buf, stream: Stream, rounds: int, seed: int, batch: int = 8, adds=(0, 3)) -> list:
    """A learner-shaped loop: add a few steps, sample, update the batch's
    priorities (now and then by raw indices too). Returns every batch and update."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        feed(buf, stream, int(rng.integers(*adds, endpoint=True)))
        b = buf.sample(batch)
        p = rng.random(batch) * 3
        buf.update_priorities(b, p)
        rec = {"indices": b.indices, "weights": b.weights, "probabilities": b.probabilities,
               "generations": b.generations, "data": dict(b.data), "update": p}
        if r % 7 == 3:
            idx = b.indices[: batch // 2].copy()
            q = rng.random(idx.shape[0])
            buf.update_priorities(idx, q)
            rec["raw_update"] = (idx, q)
        out.append(rec)
    return out


def assert_same_runs(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        for key in ("indices", "weights", "probabilities", "generations", "update"):
            assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), (i, key)
        assert sorted(x["data"]) == sorted(y["data"]), i
        for key in x["data"]:
            u, v = x["data"][key], y["data"][key]
            assert u.dtype == v.dtype and u.shape == v.shape, (i, key)
            assert np.array_equal(u, v, equal_nan=u.dtype.kind == "f"), (i, key)


def assert_same_state(a, b) -> None:
    ma, aa = a.state_dict()
    mb, ab = b.state_dict()
    assert ma == mb
    assert sorted(aa) == sorted(ab)
    for k in aa:
        assert aa[k].dtype == ab[k].dtype and np.array_equal(aa[k], ab[k]), k


def tree_hash(root: Path) -> dict:
    """relative path -> sha256 of every file under ``root`` (the bytes only)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
