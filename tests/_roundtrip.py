"""Helpers shared by the round-trip tests (issue 33): a buffer's constructor
arguments from a recorded config, every transition a buffer holds, and a batch
as comparable bytes."""

from __future__ import annotations

import numpy as np

import bigper
from bigper.schedules import schedule_from_dict


def kwargs_of(cfg) -> dict:
    """``PrioritizedReplayBuffer`` arguments that rebuild ``cfg`` (a ``Config``), storage aside."""
    kw = dict(capacity=cfg.capacity, fields={n: (tuple(s), np.dtype(d)) for n, (s, d) in cfg.fields.items()},
              frame_stack=cfg.frame_stack, n_step=cfg.n_step, gamma=cfg.gamma, alpha=cfg.alpha, eps=cfg.eps,
              max_priority=cfg.max_priority, beta=schedule_from_dict(cfg.beta), weight_norm=cfg.weight_norm,
              prioritization=cfg.prioritization, next_of=tuple(cfg.next_of), num_envs=cfg.num_envs,
              compression=cfg.compression, compression_budget=cfg.compression_budget)
    if cfg.sequence is not None:
        kw["sequence"] = bigper.Sequence(**cfg.sequence)
    return kw


def held(buf) -> tuple[dict, np.ndarray]:
    """Every sampleable slot's (with sequences: item's) data in stream order, and its keys."""
    live = np.flatnonzero((buf.state_dict()[1]["seq_status"] if buf.config.sequence else buf.status) == 1)
    live = live[np.argsort(buf.generations[live], kind="stable")]
    return buf.gather(live), buf.leaves(live)


def batch_bytes(b) -> dict:
    """A sampled batch as name -> bytes (fields, indices, weights, probabilities)."""
    out = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in ((k, np.asarray(b[k])) for k in b.keys())}
    for name in ("indices", "weights", "probabilities", "mask"):
        v = getattr(b, name)
        if v is not None:
            v = np.asarray(v)
            out[name] = (v.dtype.str, v.shape, v.tobytes())
    return out


# -- the round-trip matrix's examples -------------------------------------------------------
# A spec is plain JSON (it crosses into a child process): the buffer's arguments and the steps
# fed to it, made by ``steps`` from a seed. Every buffer of a spec, fed by ``feed``, holds the
# same data, keys and random state, whatever its storage.
DTYPES = ("uint8", "int16", "int64", "float16", "float32", "float64", "bool")


def buffer_kwargs(spec: dict) -> dict:
    fields = {name: (tuple(shape), np.dtype(dt)) for name, (shape, dt) in spec["fields"].items()}
    kw = dict(capacity=spec["capacity"], fields=fields, frame_stack=spec["frame_stack"], n_step=spec["n_step"],
              num_envs=spec["num_envs"], prioritization=spec["prioritization"], alpha=0.7, seed=spec["seed"],
              compression=spec["compression"], compression_budget=spec["budget"])
    if spec["sequence"] is not None:
        kw["sequence"] = bigper.Sequence(*spec["sequence"])
    return kw


def build(spec: dict, storage: str = "memory", path=None, **extra):
    return bigper.PrioritizedReplayBuffer(**buffer_kwargs(spec), storage=storage, path=path, **extra)


def _values(rng, shape, dt: np.dtype) -> np.ndarray:
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt)
    return (rng.standard_normal(shape) * 100).astype(dt)


def steps(spec: dict):
    """The ``add`` calls of ``spec``: dicts of arrays with a leading env axis when num_envs > 1."""
    rng = np.random.default_rng(spec["data_seed"])
    envs, k = spec["num_envs"], spec["frame_stack"]
    fields = {n: (tuple(s), np.dtype(d)) for n, (s, d) in spec["fields"].items()}
    oshape, odt = fields["obs"]
    fshape = oshape[1:] if k else oshape
    levels = spec["levels"]  # few distinct byte values: frames that compress
    new_frame = (lambda: rng.integers(0, levels, fshape).astype(odt)) if odt.kind in "iu" \
        else (lambda: _values(rng, fshape, odt))
    episode = [[new_frame()] for _ in range(envs)]  # each env's frames since its episode began

    def stack(e: int, t: int) -> np.ndarray:
        if not k:
            return episode[e][t]
        return np.stack([episode[e][max(0, t - k + 1 + j)] for j in range(k)])

    out = []
    for _ in range(spec["steps"]):
        step = {n: [] for n in ("obs", "next_obs", "terminated", "truncated", *fields)}
        for e in range(envs):
            t = len(episode[e]) - 1
            episode[e].append(new_frame())
            end = rng.random() < spec["p_end"]
            step["obs"].append(stack(e, t))
            step["next_obs"].append(stack(e, t + 1))
            step["terminated"].append(bool(end and rng.random() < 0.5))
            step["truncated"].append(bool(end and not step["terminated"][-1]))
            for n, (s, dt) in fields.items():
                if n != "obs":
                    step[n].append(_values(rng, s, dt))
            if end:
                episode[e] = [new_frame()]
        out.append({n: (np.stack(v) if envs > 1 else v[0]) if n not in ("terminated", "truncated")
                    else (np.array(v) if envs > 1 else v[0]) for n, v in step.items()})
    return out


def feed(buf, spec: dict, start: int = 0, stop: int | None = None, said=None) -> None:
    """Add ``steps(spec)[start:stop]``; halfway and at the end, sample and update the priorities of
    the batch. ``said(i)`` is called after step ``i``."""
    todo = steps(spec)
    for i, step in enumerate(todo):
        if i < start or (stop is not None and i >= stop):
            continue
        buf.add(**step)
        if said is not None:
            said(i)
        if i in (len(todo) // 2, len(todo) - 1):
            try:
                b = buf.sample(4)
            except bigper.BigperError:  # nothing sampleable yet: the same in every buffer of the spec
                continue
            buf.update_priorities(b, np.arange(1, 5, dtype=np.float64) * 1.5 + i)


# A writer in its own interpreter: argv spec (JSON), storage path, snapshot path, how it ends:
# "exit" feeds every step and returns without close(); "kill" feeds half, saves a snapshot,
# then feeds the rest saying each step, and waits to be killed.
CHILD = """
import json, sys, time
from tests._roundtrip import build, feed
spec, path, snap, how = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
buf = build(spec, spec["storage"], None if spec["storage"] == "memory" else path)
if how == "exit":
    feed(buf, spec)
    print("exiting without close", flush=True)
else:
    half = spec["steps"] // 2
    feed(buf, spec, stop=half)
    buf.save(snap)
    print("saved", flush=True)
    feed(buf, spec, start=half, said=lambda i: print("step", i, flush=True))
    print("done", flush=True)
    time.sleep(600)
"""
