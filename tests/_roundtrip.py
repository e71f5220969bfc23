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
    """Every sampleable slot's data in stream order, and its keys."""
    live = np.flatnonzero(buf.status == 1)
    live = live[np.argsort(buf.generations[live], kind="stable")]
    return buf.gather(live), buf.leaves(live)


def batch_bytes(b) -> dict:
    """A sampled batch as name -> bytes (fields, indices, weights, probabilities)."""
    out = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in ((k, np.asarray(b[k])) for k in b.keys())}
    for name in ("indices", "weights", "probabilities", "mask"):
        v = np.asarray(getattr(b, name))
        out[name] = (v.dtype.str, v.shape, v.tobytes())
    return out
